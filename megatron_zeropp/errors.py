"""Exceptions shared by every layer."""


class StartupError(ValueError):
    """Bad input found before training: a flag, a checkpoint or a data file.

    Raised identically on every rank (the checks read only the command line and shared files), so
    the launcher prints it once, from rank 0, without a traceback, and exits with code 2.
    """
