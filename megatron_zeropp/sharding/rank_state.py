"""The per-rank state of one ZeRO++ layer (one model chunk) that an exact resume needs beyond the
weights and the optimizer: handed out by
:meth:`~megatron_zeropp.sharding.data_parallel.ZeroPPDataParallel.rank_state`, taken back by
:meth:`~megatron_zeropp.sharding.data_parallel.ZeroPPDataParallel.load_rank_state`.

* the step clock (:mod:`.step_clock`): where training is, for the qgZ cutoff and the rounding
  keys;
* qgZ error-feedback residuals (``qgz_error_feedback``): what this rank's quantizations left out
  of its own gradients, per bucket;
* qwZ difference references (``qwz_diff_bits``): ŵ of this rank's primary shard and the unit's
  counters (:class:`~.diff_reference.DiffReference`); taking them back rebuilds every rank's
  secondary with one exact all-gather per bucket (collective over the DP group).

None of it belongs to the model's or the optimizer's sharded state: no other layout can use it.
So it carries the layout it was made under (:func:`fingerprint`), and a state of another layout
is refused with both values.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

FORMAT = 1


def fingerprint(layer) -> dict:
    """What the state's meaning depends on: ranks, this chunk's index, the techniques that keep
    state, every unit's buckets."""
    comm = layer.comm
    return {
        "format": FORMAT, "rank": dist.get_rank(), "world": dist.get_world_size(),
        "dp_rank": comm.dp_rank, "dp_size": comm.dp_size,
        "chunk_index": layer.clock.chunk_index,
        "qgz_error_feedback": layer.zeropp.qgz_error_feedback,
        "qwz_diff_bits": layer.zeropp.qwz_diff_bits,
        "holders": tuple(comm.holders) if comm.holders is not None else None,
        "units": [(u.name, [b.param_data.numel() for b in u.buckets],
                   str(u.buckets[0].param_data.dtype)) for u in layer.units],
    }


def differences(saved: dict, here: dict) -> list:
    """``"key: saved X, here Y"`` for each entry of two fingerprints that differs."""
    return [f"{k}: saved {saved.get(k)!r}, here {here.get(k)!r}"
            for k in sorted(set(saved) | set(here)) if saved.get(k) != here.get(k)]


def collect(layer) -> dict:
    """The layer's per-rank state (tensors on the host)."""
    for unit in layer.units:
        unit.finish_grad_reduce()  # a reduction in flight may still write the residuals
    return {
        "layout": fingerprint(layer),
        "clock": layer.clock.state_dict(),
        "units": [{"qgz_residuals": unit.qgz_residual_states(),
                   "qwz_diff": (unit.diff_reference_state(layer.weight_version)
                                if unit.diff is not None else None)}
                  for unit in layer.units],
    }


def restore(layer, state: Optional[dict], iterations_done: int) -> None:
    """Take back ``state`` (from :func:`collect`) after the weights of a checkpoint of iteration
    ``iterations_done`` were loaded; ``None``: nothing was saved (or it is of no use here): the
    clock goes on from ``iterations_done``, residuals start at zero, the first gathers are
    exact. Collective over the DP group with qwZ differences (every rank takes its own)."""
    if state is not None:
        here = fingerprint(layer)
        wrong = differences(state["layout"], here)
        if wrong:
            raise ValueError("ZeRO++ per-rank state of another layout: " + "; ".join(wrong))
    layer.clock.load_state_dict(state["clock"] if state is not None else None, iterations_done)
    layer.release_all()
    for k, unit in enumerate(layer.units):
        saved = state["units"][k] if state is not None else None
        unit.load_qgz_residual_states(saved["qgz_residuals"] if saved is not None else None)
        if unit.diff is None:
            continue
        if saved is None:
            unit.diff.drop()
        else:
            unit.load_diff_reference_state(saved["qwz_diff"], layer.weight_version)
