"""A dry-run namespace shell that fails on one command: the cleanup paths of the shaped-link
benchmarks are tested with it, without root."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

from _netns import Shell  # noqa: E402


class FailingShell(Shell):
    """Records commands; raises on the first one containing ``fail_on``."""

    def __init__(self, fail_on):
        super().__init__(dry_run=True)
        self.fail_on = fail_on

    def run(self, cmd, check=True):
        super().run(cmd, check)
        if self.fail_on in " ".join(cmd) and check:
            raise RuntimeError(f"simulated failure: {' '.join(cmd)}")
        return True
