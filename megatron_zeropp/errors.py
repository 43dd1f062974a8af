"""Exceptions shared by every layer."""


class StartupError(ValueError):
    """Bad input found before training: a flag, a checkpoint or a data file.

    Raised identically on every rank (the checks read only the command line and shared files), so
    the launcher prints it once, from rank 0, without a traceback, and exits with code 2.
    """


class NonFiniteError(RuntimeError):
    """The loss or the gradients became NaN/Inf; training stops instead of running on.

    Decided from all-reduced values, so every rank raises it at the same iteration; the launcher
    prints it once, from rank 0, and exits with code 1.
    """
