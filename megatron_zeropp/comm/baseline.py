"""Plain ZeRO-3 collectives (full-precision all-gather and reduce-scatter), for comparison.

Same interface and byte accounting as the ZeRO++ protocols, so a training step can swap one for
the other and compare the counts in :class:`~megatron_zeropp.comm.accounting.CommStats`.

Layouts are torch's: ``zero3_all_gather`` puts rank ``i``'s input at ``output.view(-1)[i * n :
(i + 1) * n]``; ``zero3_reduce_scatter`` leaves group rank ``i`` with chunk ``i`` of the flattened
sum (or average) of the inputs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .accounting import CommStats
from .common import (
    all_gather_into,
    check_member,
    check_op,
    check_same_device,
    check_tensor,
    reduce_scatter_from,
)
from .work import CommHandle, run_protocol

ALLGATHER = "zero3_allgather"
REDUCE_SCATTER = "zero3_reduce_scatter"


def zero3_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group=None,
    async_op: bool = False,
    *,
    stats: Optional[CommStats] = None,
) -> Optional[CommHandle]:
    """All-gather ``input`` from every rank of ``group`` into ``output`` (same dtype).

    ``output.numel()`` must be ``group size * input.numel()``; both contiguous.
    """
    ranks = _check_full_and_shard("zero3_all_gather", "output", output, "input", input, group)
    if stats is not None:
        stats.count_call(ALLGATHER)
        stats.record_ring(ALLGATHER, ranks, input.numel() * input.element_size())

    def body():
        all_gather_into(output.view(-1), input.view(-1), group)

    return run_protocol(body, async_op, ALLGATHER, input.device, stats=stats)


def zero3_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group=None,
    op: str = "sum",
    async_op: bool = False,
    *,
    stats: Optional[CommStats] = None,
) -> Optional[CommHandle]:
    """Reduce-scatter ``input`` over ``group``: group rank ``i`` gets chunk ``i`` of the result.

    ``op`` is ``"sum"`` or ``"avg"``. ``input.numel()`` must be ``group size *
    output.numel()``; same dtype, contiguous. The reduction runs in the input dtype (what plain
    ZeRO-3 does with 16-bit gradients).
    """
    check_op(op)
    ranks = _check_full_and_shard(
        "zero3_reduce_scatter", "input", input, "output", output, group
    )
    if stats is not None:
        stats.count_call(REDUCE_SCATTER)
        stats.record_ring(REDUCE_SCATTER, ranks, output.numel() * output.element_size())
    rop = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG

    def body():
        reduce_scatter_from(output.view(-1), input.view(-1), rop, group)

    return run_protocol(body, async_op, REDUCE_SCATTER, input.device, lane="reduce",
                        keep=(input,), stats=stats)


def _check_full_and_shard(op, full_name, full, shard_name, shard, group):
    """Validate a (full, shard) pair before the collective; returns the group's global ranks."""
    named = {full_name: full, shard_name: shard}
    check_tensor("input", named["input"])
    check_tensor("output", named["output"])
    check_same_device(output=named["output"], input=named["input"])
    if full.dtype != shard.dtype:
        raise ValueError(
            f"{op}: output dtype {named['output'].dtype} != input dtype {named['input'].dtype}"
        )
    ranks, _ = check_member("group", group)
    g = len(ranks)
    if full.numel() != g * shard.numel():
        raise ValueError(
            f"{op}: {full_name} has {full.numel()} elements, expected group size {g} x "
            f"{shard_name} numel {shard.numel()} = {g * shard.numel()}"
        )
    return ranks
