"""The ZeRO++ layer's per-rank state beside a checkpoint (either format, and Megatron-LM's own
torch_dist saves through the patch), so that a resumed run is bit-exact.

What each model chunk hands out (:meth:`ZeroPPDataParallel.rank_state`: the step clock, qgZ
error-feedback residuals, qwZ difference references) is per rank and per layout, so it belongs to
neither the model's nor the optimizer's sharded state. Each rank writes one file for all its
chunks, keyed by chunk index, into the iteration directory before the checkpoint is committed
(``zeropp_rank_state/rank_RRRRR.pt``), and reads its own back after the weights were loaded.

On load every rank first agrees with every other (one all-reduce) on whether all files are there
and of this layout; if not (a resharded resume, a checkpoint without them: Megatron-LM's DDP, an
older release), every chunk starts its state anew at the checkpoint's iteration and rank 0 says
why, with the values. A file holding another number of chunks than this run has is refused.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_zeropp.sharding.data_parallel import ZeroPPDataParallel
from megatron_zeropp.sharding.rank_state import differences, fingerprint

DIRECTORY = "zeropp_rank_state"


def _layers(model_chunks) -> Dict[int, ZeroPPDataParallel]:
    """The chunks that are ZeRO++ layers, by their index in ``model_chunks``."""
    return {i: c for i, c in enumerate(model_chunks) if isinstance(c, ZeroPPDataParallel)}


def path(directory: str) -> str:
    """This rank's file in the iteration ``directory``."""
    return os.path.join(directory, DIRECTORY, f"rank_{dist.get_rank():05d}.pt")


def save(directory: str, model_chunks) -> None:
    """Write this rank's per-rank state of every ZeRO++ chunk into the (uncommitted) checkpoint
    ``directory``; nothing when no chunk is one."""
    layers = _layers(model_chunks)
    if not layers:
        return
    state = {"chunks": {i: layer.rank_state() for i, layer in layers.items()}}
    target = path(directory)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    torch.save(state, target + ".part")
    os.replace(target + ".part", target)


def _why_not(saved: Optional[dict], layers: Dict[int, ZeroPPDataParallel], where: str) -> List[str]:
    if saved is None:
        return [f"no {where}"]
    if sorted(saved["chunks"]) != sorted(layers):
        return [f"{where} holds model chunks {sorted(saved['chunks'])}, this run has chunks "
                f"{sorted(layers)}"]
    out = []
    for i, layer in layers.items():
        out += [f"chunk {i} {d}" for d in differences(saved["chunks"][i]["layout"],
                                                      fingerprint(layer))]
    return out


def load(directory: str, model_chunks, iteration: int, fresh: bool = False) -> Optional[bool]:
    """After the weights of the checkpoint of ``iteration`` in ``directory`` were loaded: give
    every ZeRO++ chunk its saved per-rank state (True), or, where any rank lacks a usable one,
    a fresh one at ``iteration`` on every rank (False); None when no chunk is a ZeRO++ layer.
    ``fresh``: start anew regardless (``--finetune``: the run counts from ``iteration`` 0).
    Collective over the world."""
    layers = _layers(model_chunks)
    if not layers:
        return None
    if fresh:
        for layer in layers.values():
            layer.load_rank_state(None, iteration)
        return False
    target = path(directory)
    saved = torch.load(target, weights_only=False) if os.path.exists(target) else None
    why = _why_not(saved, layers, target)
    device = next(p.device for layer in layers.values() for p in layer.module.parameters())
    flag = torch.tensor([0 if why else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    usable = bool(flag.item())
    for i, layer in layers.items():
        layer.load_rank_state(saved["chunks"][i] if usable else None, iteration)
    if not usable and dist.get_rank() == 0:
        reason = "; ".join(why) if why else "another rank's is missing or of another layout"
        print(f"> ZeRO++ per-rank state of {directory} not used ({reason}): the step clock "
              f"goes on at iteration {iteration + 1}, qgZ residuals start at zero, the first "
              f"gathers are exact", flush=True)
    return usable
