"""qgZ error-feedback residuals in checkpoints (both formats), so a resumed run is bit-exact.

The residuals are per rank: what this rank's quantizations left out of its own gradients. They
belong to neither the model's nor the optimizer's sharded state (no other layout can use them),
so each rank writes its own small file beside the checkpoint's (``qgz_residuals/rank_R.pt`` in
the iteration directory, before the atomic rename commits it) and reads it back on load when
the layout is the same: world rank and size, DP rank and size, every bucket's residual sizes.
Under another layout, or from a checkpoint without the files, the residuals start at zero (as on
a fresh start), which error feedback tolerates: a rank says so once.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

DIRECTORY = "qgz_residuals"


def _units_with_feedback(model_chunks) -> List:
    out = []
    for chunk in model_chunks:
        for unit in getattr(chunk, "units", []):
            if getattr(unit, "_qgz_residuals", None) is not None:
                out.append(unit)
    return out


def _fingerprint(units) -> Dict[str, object]:
    comm = units[0].comm
    return {
        "rank": dist.get_rank(), "world": dist.get_world_size(), "dp_rank": comm.dp_rank,
        "dp_size": comm.dp_size,
        "units": [(u.name, [b.grad_data.numel() for b in u.buckets]) for u in units],
    }


def _path(directory: str) -> str:
    return os.path.join(directory, DIRECTORY, f"rank_{dist.get_rank():05d}.pt")


def save(directory: str, model_chunks) -> None:
    """Write this rank's residuals into the (uncommitted) checkpoint ``directory``; nothing
    without error feedback."""
    units = _units_with_feedback(model_chunks)
    if not units:
        return
    for u in units:
        u.finish_grad_reduce()  # a reduction in flight may still write them
    state = {"layout": _fingerprint(units),
             "residuals": [[r.state_dict() for r in u._qgz_residuals] for u in units]}
    path = _path(directory)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(state, path + ".part")
    os.replace(path + ".part", path)


def load(directory: str, model_chunks) -> Optional[bool]:
    """Restore this rank's residuals from ``directory`` when its layout matches; returns True
    (restored), False (present but another layout: left at zero) or None (no file / no error
    feedback)."""
    units = _units_with_feedback(model_chunks)
    path = _path(directory)
    if not units or not os.path.exists(path):
        return None
    state = torch.load(path, weights_only=False)
    if state["layout"] != _fingerprint(units):
        if dist.get_rank() == 0:
            print(f"> qgZ residuals in {directory} are from another layout: starting from zero",
                  flush=True)
        return False
    for u, saved in zip(units, state["residuals"]):
        device = u.buckets[0].grad_data.device
        for r, s in zip(u._qgz_residuals, saved):
            r.load_state_dict(s, device)
    return True
