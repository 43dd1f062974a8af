"""qwZ difference references in checkpoints (both formats), so a resumed run is bit-exact.

With ``--zeropp-qwz-diff-bits`` every rank's weights are the reconstruction ŵ its owners built
from a chain of differences, not the 16-bit weights themselves; a resume that started from the
saved weights alone would gather them exactly (correct, but other bits than the run that did
not stop). So each rank writes ŵ of its own primary shard and the unit's counters
(``qwz_diff_reference/rank_R.pt`` in the iteration directory, before the atomic rename commits
it; 2M/Z bytes per rank), and on load every DP group rebuilds both halves of the reference
(the owners' copies and every rank's secondary slice) with one exact all-gather of the saved
owner halves per bucket. Under another layout, or from a checkpoint without the files, the
references are dropped and the next step's first gathers are exact (a note says so); every rank
agrees on which before any gather (one all-reduce), so no DP group can hang half-restored.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

DIRECTORY = "qwz_diff_reference"


def _chunks_with_diff(model_chunks) -> List:
    return [c for c in model_chunks
            if any(getattr(u, "diff", None) is not None for u in getattr(c, "units", []))]


def _fingerprint(chunks) -> Dict[str, object]:
    comm = chunks[0].comm
    return {
        "rank": dist.get_rank(), "world": dist.get_world_size(), "dp_rank": comm.dp_rank,
        "dp_size": comm.dp_size, "holders": tuple(comm.holders),
        "units": [[(u.name, [b.param_data.numel() for b in u.buckets],
                    str(u.buckets[0].param_data.dtype)) for u in c.units] for c in chunks],
    }


def _path(directory: str) -> str:
    return os.path.join(directory, DIRECTORY, f"rank_{dist.get_rank():05d}.pt")


def save(directory: str, model_chunks) -> None:
    """Write this rank's owner halves of ŵ into the (uncommitted) checkpoint ``directory``;
    nothing without ``qwz_diff_bits``."""
    chunks = _chunks_with_diff(model_chunks)
    if not chunks:
        return
    state = {"layout": _fingerprint(chunks),
             "units": [[u.diff.state_dict(c.weight_version) for u in c.units] for c in chunks]}
    path = _path(directory)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(state, path + ".part")
    os.replace(path + ".part", path)


def load(directory: str, model_chunks) -> Optional[bool]:
    """After the weights were loaded: rebuild the references from ``directory`` when every rank
    has its file at this layout (True), else drop them everywhere (False); None without
    ``qwz_diff_bits``. Collective over the world."""
    chunks = _chunks_with_diff(model_chunks)
    if not chunks:
        return None
    path = _path(directory)
    state = torch.load(path, weights_only=False) if os.path.exists(path) else None
    ok = state is not None and state["layout"] == _fingerprint(chunks)
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32,
                        device=chunks[0].units[0].shards[0].device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not bool(flag.item()):
        for c in chunks:
            c.drop_diff_references()
        if dist.get_rank() == 0:
            print(f"> qwZ difference references in {directory} are missing or from another "
                  "layout: the first gathers are exact", flush=True)
        return False
    for c, saved in zip(chunks, state["units"]):
        c.release_all()
        for u, s in zip(c.units, saved):
            u.diff.restore(s, c.weight_version)
    return True
