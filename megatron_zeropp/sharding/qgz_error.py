"""qgZ error diagnostic: how far each unit's quantized gradient reduction is from the exact sum.

On a measured iteration every qgZ reduction of a unit also runs an fp32 all-reduce of the very
same input (a copy taken before qgZ may overwrite it) and accumulates, per unit, on the device,
``||qgz - exact||^2`` and ``||exact||^2`` over this rank's chunk
(:class:`~.error_meter.ErrorMeter`); its report sums both over the DP group (one all-reduce
for all units) and returns ``sqrt(sum err^2 / sum exact^2)`` per unit and over all units.

With ``shard_grads`` a unit is reduced once per micro-batch; the sums then run over the
micro-batches too, so a unit's figure is the norm-weighted aggregate of the step's reductions
(a micro-batch with larger gradients weighs more), not the last micro-batch's.

The extra all-reduce is issued inside the same protocol call as the qgZ reduction it checks, and
the report's all-reduce through the same comm lane (so both keep program order on every
rank), with raw ``torch.distributed``, outside the byte counters:
the modelled and handed inter-node bytes per iteration do not include it. The qgZ result used
for the update is the one the call would produce without the diagnostic (only made synchronous
within its lane, which changes timing, not values).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def exact_chunk(input: torch.Tensor, group, dp_rank: int, chunk_numel: int) -> torch.Tensor:
    """Chunk ``dp_rank`` of the fp32 sum of ``input`` over ``group`` (zero-padded to
    ``group size * chunk_numel`` elements, as qgZ pads). Copies ``input`` first."""
    z = dist.get_world_size(group)
    full = torch.zeros(z * chunk_numel, dtype=torch.float32, device=input.device)
    full[: input.numel()].copy_(input.reshape(-1))
    # all_reduce, not reduce_scatter: gloo has no reduce-scatter and this runs rarely.
    dist.all_reduce(full, group=group)
    return full[dp_rank * chunk_numel : (dp_rank + 1) * chunk_numel]
