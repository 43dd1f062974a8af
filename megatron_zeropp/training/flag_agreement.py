"""Every rank of a job runs with the same flags: compared at start, in the start-up agreement.

Each node's launcher passes its own command line, so a per-node launch script that drifted (another
``--lr`` on one node, ``--zeropp-qwz`` on one node only) used to train silently, each rank
updating its own ZeRO shard by its own rule, or died in a collective with "Received data size
doesn't match expected size" on one rank and "Connection reset by peer" on the other, with no
message naming a flag.

The rule: every field of the parsed arguments (after validation and the start-up checks, so
derived defaults and ``--use-checkpoint-args`` are compared as they will be used) must be equal on
all ranks, except :data:`PER_NODE`: values that name this process or a place on this node, which
may differ by design. ``--load`` and ``--save`` are among them because the agreement compares what
they hold instead (the checkpoint each rank would load, the lock each rank sees), so identical
copies under other paths still work; input files (data, tokenizer) are compared by path, as nothing
else compares their contents across nodes.
"""

from __future__ import annotations

from typing import Dict, List

from megatron_zeropp.errors import StartupError

PER_NODE = frozenset({
    "local_rank",  # Megatron-LM's --local-rank: this process's GPU
    "load", "save",  # compared by content (checkpointing/agreement.py, save_lock.seen)
    "data_cache_path",  # megatron-core's index cache: often node-local scratch
    "tensorboard_dir",  # written by the last rank only
    "zeropp_qgz_error_log",  # written by rank 0 only
    "zeropp_qwz_error_log",
    "profile_dir",  # each profiled rank's own output
})
"""Fields that may differ between ranks; every other parsed argument must agree."""

_SHOWN = 60  # characters of a value in the message


def compared(args) -> Dict[str, str]:
    """This rank's values of every compared field, as text (what the ranks exchange)."""
    return {k: repr(v) for k, v in sorted(vars(args).items()) if k not in PER_NODE}


def _flag_names() -> Dict[str, str]:
    from .arguments import build_parser

    names = {}
    for action in build_parser()._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and action.dest not in names:
            names[action.dest] = longs[0]
    return names


def _short(text: str) -> str:
    return text if len(text) <= _SHOWN else text[:_SHOWN - 3] + "..."


def differences(gathered: List[dict], key: str = "flags") -> List[str]:
    """``--flag (rank 0 (host): value; rank 1 (host): other)`` for each field that differs."""
    views = [g[key] for g in gathered]
    fields = sorted(set().union(*views))
    names = _flag_names()
    out = []
    for field in fields:
        values = [v.get(field, "(unset)") for v in views]
        if len(set(values)) <= 1:
            continue
        groups: Dict[str, List[int]] = {}
        for rank, value in enumerate(values):
            groups.setdefault(value, []).append(rank)
        seen = "; ".join(
            f"{'rank ' + str(r[0]) if len(r) == 1 else 'ranks ' + str(r)} "
            f"({', '.join(sorted({gathered[i]['host'] for i in r}))}): {_short(value)}"
            for value, r in groups.items())
        out.append(f"{names.get(field, '--' + field.replace('_', '-'))} ({seen})")
    return out


def check(gathered: List[dict], key: str = "flags") -> None:
    """Raise StartupError on every rank naming each flag whose value differs between ranks."""
    diffs = differences(gathered, key)
    if diffs:
        raise StartupError(
            f"the ranks were started with different flags: {', '.join(diffs)}. Every node must "
            f"run pretrain_gpt.py with the same flags (only --load/--save, compared by what "
            f"they hold, and per-node paths may differ: "
            f"{', '.join(sorted(_flag_names().get(f, f) for f in PER_NODE - {'load', 'save'}))})")
