"""qwZ: the forward weight all-gather with block-quantized weights.

Each rank quantizes its primary shard block-wise (symmetric, one fp32 absmax scale per block of
``block_size`` elements; INT8 by default), the quantized bytes and scales are all-gathered (one
collective, packed per rank as ``[data | scales]``), and every rank dequantizes all N shards
into ``output`` in the output's dtype::

    rank i:  shard_i --quantize--> (q_i, s_i) --all-gather--> (q_0..q_N-1, s_0..s_N-1)
             output[i * n : (i + 1) * n] = dequantize(q_i, s_i)    for every i

The result equals, bit for bit, the concatenation of ``dequantize(quantize(shard_i))``. Rounding
is to nearest unless ``rounding_key`` asks for stochastic rounding; either way gathering twice
from the same shards (with the same key) gives identical bits: the forward and the backward
pass (through hpZ) see the same weights. Error never
accumulates across steps because every step quantizes the full-precision primary shard again.

Blocks never straddle two shards (each rank quantizes its own shard), so a shard size that is
not a multiple of ``block_size`` just ends in a short block. With ``segments`` (the bucket's
parameters, :mod:`.segments`) blocks never straddle two parameters either, and ``exact``
segments travel unquantized in the output dtype (packed per rank as ``[data | scales |
exact]``); the result then equals, per parameter piece, ``dequantize(quantize(piece))``, and the
exact pieces bit for bit what a plain all-gather delivers.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_zeropp.quant import dequantize_chunks, quantize_chunks, quantized_sizes
from megatron_zeropp.quant.rounding import row_keys

from .accounting import CommStats
from .common import (
    FLOAT_DTYPES,
    all_gather_into,
    all_to_all_v_into,
    check_member,
    check_quant_args,
    check_rounding_key,
    check_same_device,
    check_tensor,
    element_size,
    empty_codes,
    pack_rows,
    unpack_rows,
)
from .segments import layout_for
from .work import CommHandle, run_protocol

ALLGATHER = "qwz_allgather"
DEFAULT_BITS = 8
DEFAULT_BLOCK_SIZE = 256


def qwz_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group=None,
    async_op: bool = False,
    *,
    bits: int = DEFAULT_BITS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    stats: Optional[CommStats] = None,
    segments=None,
    rounding_key: Optional[int] = None,
) -> Optional[CommHandle]:
    """Quantized all-gather of every rank's ``input`` shard into ``output``.

    Args:
        output: contiguous, ``group size * input.numel()`` elements, bf16/fp16/fp32; rank ``i``'s
            shard lands at ``output.view(-1)[i * n : (i + 1) * n]``.
        input: this rank's shard, bf16/fp16/fp32 (may differ from the output dtype, e.g. an fp32
            master shard gathered into bf16 compute weights).
        group: the DP process group.
        bits: 4 or 8 (quantized width on the wire).
        block_size: elements per scale.
        stats: optional byte counter (protocol ``"qwz_allgather"``).
        segments: ``(start, end, exact)`` ranges covering the gathered tensor (one per
            parameter, :func:`.segments.param_segments`): blocks start afresh at every segment
            and ``exact`` ones are sent unquantized. ``None``: blocks run across the shard.
        rounding_key: round stochastically with random numbers drawn from this 32-bit key
            (:mod:`megatron_zeropp.quant.rounding`); every rank dequantizes the same codes, so
            all ranks still see the same weights, and the same key gives the same bits (the
            caller keeps it fixed within a step: forward and backward must see one set of
            weights). ``None``: round to nearest.
    """
    check_tensor("input", input, contiguous=False)
    check_tensor("output", output, dtypes=FLOAT_DTYPES)
    check_same_device(output=output, input=input)
    check_quant_args(bits, block_size)
    ranks, _ = check_member("group", group)
    g, n = len(ranks), input.numel()
    if output.numel() != g * n:
        raise ValueError(
            f"qwz_all_gather: output has {output.numel()} elements, expected group size {g} x "
            f"input numel {n} = {g * n}"
        )
    check_rounding_key(rounding_key)
    layout = layout_for(segments, g, n, block_size)
    nbytes, nblocks = quantized_sizes(layout.quant_numel, bits, block_size)
    me_global = torch.distributed.get_rank()
    me = ranks.index(me_global)
    if stats is not None:
        stats.count_call(ALLGATHER)
        stats.record_ring(ALLGATHER, ranks, nbytes, 4 * nblocks)
        if layout.exact_numel:  # this rank's small-parameter elements, to every peer
            stats.record_all_to_all(ALLGATHER, ranks, me_global,
                                    layout.exact_elements(me) * element_size(output.dtype))

    keys = None if rounding_key is None else row_keys(rounding_key, (me,), input.device)

    def body():
        _gather_quantized(output, input, group, g, bits, block_size, nbytes, layout, me, keys)

    return run_protocol(body, async_op, ALLGATHER, input.device, stats=stats)


def _gather_quantized(output, input, group, g, bits, block_size, nbytes, layout, me,
                      keys=None) -> None:
    n = input.numel()
    mine = input.reshape(1, n)
    if layout.quant_numel:
        data, scales = quantize_chunks(layout.gather("q", mine, (me,), local=True), bits,
                                       block_size, keys)
    else:  # every parameter of this bucket travels exactly
        data, scales = empty_codes(1, bits, input.device)
    send = pack_rows(data, scales).view(-1)
    recv = torch.empty(g, send.numel(), dtype=torch.uint8, device=send.device)
    all_gather_into(recv, send, group)
    all_data, all_scales = unpack_rows(recv, nbytes, data.dtype)
    if layout.identity:
        dequantize_chunks(all_data, all_scales, bits, block_size, n, output.dtype,
                          out=output.view(g, n))
        return
    values = all_data  # unused when there are no quantized elements
    if layout.quant_numel:
        values = dequantize_chunks(all_data, all_scales, bits, block_size, layout.quant_numel,
                                   output.dtype)
    exact = None
    if layout.exact_numel:
        exact = _gather_exact(layout, mine, me, g, output.dtype, group)
    layout.scatter(output.view(g, n), range(g), values, exact)


def _gather_exact(layout, mine, me, g, dtype, group) -> torch.Tensor:
    """The small-parameter elements of every rank, ``(g, E)`` zero-padded: each rank sends its
    own (a different count per rank, so an all-to-all with uneven receive splits rather than
    an all-gather padded to the largest, which would cost the widest rank's count on every
    rank)."""
    counts = [layout.exact_elements(q) for q in range(g)]
    isz = element_size(dtype)
    own = layout.gather("e", mine, (me,), local=True)[0, : counts[me]].to(dtype)
    send = own.repeat(g).view(torch.uint8)
    recv = torch.empty(sum(counts) * isz, dtype=torch.uint8, device=own.device)
    all_to_all_v_into(recv, send, [c * isz for c in counts], [counts[me] * isz] * g, group)
    out = torch.zeros(g, layout.exact_numel, dtype=dtype, device=own.device)
    pos = 0
    for q, c in enumerate(counts):
        out[q, :c].view(torch.uint8).copy_(recv[pos : pos + c * isz])
        pos += c * isz
    return out
