"""Flags of the failure handling (README "What happens when things go wrong"), added last so that
a flag Megatron-LM also has (``--exit-signal-handler``) is defined once, by whichever module
reaches it first."""

from __future__ import annotations

import argparse


def _add(g, flag: str, **kwargs) -> None:
    if flag not in g._option_string_actions:  # already defined (megatron_lm_flags)
        g.add_argument(flag, **kwargs)


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the flags (a no-op for any already defined)."""
    g = p.add_argument_group("failure handling")
    _add(g, "--break-save-lock", action="store_true",
         help="take over --save's lock even though another job seems to hold it (that job is "
              "known to be gone); a dead job's lock expires by itself")
    _add(g, "--exit-signal-handler", action="store_true",
         help="on SIGTERM, save a checkpoint (with --save) after the current iteration, "
              "then exit (Megatron-LM's flag)")
    _add(g, "--ckpt-checksums", action="store_true",
         help="write a SHA-256 of every checkpoint file at save (checksums.json); loading "
              "verifies them whenever present. Costs one extra read of the checkpoint at save "
              "and at load, spread over the ranks")
