"""qgZ: the gradient reduce-scatter as two quantized all-to-all hops with fp32 sums.

A ring reduce-scatter at low precision dequantizes, adds and requantizes at each of its Z - 1
hops, so its error grows with the group size. qgZ quantizes each value at most twice, whatever Z:

DP group of Z = K nodes x N ranks per node; DP rank ``d = k * N + j`` (k = inter-node rank,
j = intra-node rank) must end with chunk ``d`` of the sum, like ``reduce_scatter_tensor``::

    input (padded to Z * c elements) = chunks 0 .. Z-1 of c elements; chunk m is DP rank m's
    1. swizzled quantize: send position p = j' * K + k'  holds chunk k' * N + j'
       (2 x 4: positions 0..7 hold chunks 0 4 1 5 2 6 3 7), quantized at bits[0]
    2. intra-node all_to_all: intra peer j' gets positions j'*K .. j'*K + K-1, i.e. the K chunks
       of the DP ranks with intra-node index j' on every node
    3. dequantize the N received copies, sum in fp32, requantize at bits[1]  -> K rows
       (row k' = this node's partial sum of chunk k' * N + j)
    4. inter-node all_to_all: row k' goes to inter peer k' (= DP rank k' * N + j)
    5. dequantize the K node partials, sum in fp32  -> chunk d = k * N + j of the full sum

Cross-node bytes per rank: (K - 1) rows of c elements at bits[1]; a one-hop all-to-all would
send N times more.

Degenerate layouts run the hops that exist and nothing else: one node (K = 1) runs steps 1-3 and
sums to fp32 without requantizing (bits[1] unused); one rank per node (N = 1) quantizes at
bits[1] and runs steps 4-5 (bits[0] unused); a DP group of one rank copies its input (the sum
over one rank; no quantization, no communication). There is no fallback to another algorithm.

Any numel: the flattened input of M elements is zero-padded to Z * c with c = ceil(M / Z). DP
rank d receives elements [d * c, (d + 1) * c) of the padded sum; positions at or past M are
exactly 0 (zeros quantize to 0 and sum to 0). ``output.numel()`` must equal c.

Two collectives per call (one per hop), each carrying data and scales packed together.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_zeropp.quant import (
    dequantize_chunks,
    dequantize_reduce,
    qgz_chunk_order,
    quantize_chunks,
    quantized_sizes,
    swizzled_quantize,
)
from megatron_zeropp.quant.hadamard import check_rotation_block, rotate_blocks, unrotate_blocks

from .accounting import CommStats
from .common import (
    FLOAT_DTYPES,
    all_to_all_into,
    check_member,
    check_op,
    check_quant_args,
    check_same_device,
    check_tensor,
    pack_rows,
    unpack_rows,
)
from .qgz_feedback import QgzResidual
from .work import CommHandle, run_protocol

REDUCE_SCATTER = "qgz_reduce_scatter"
DEFAULT_BITS = (4, 4)
# 4-bit values need small blocks to keep the per-block absmax scale close to the values it
# serves; 128 is the group size SDP4Bit uses for 4-bit gradients.
DEFAULT_BLOCK_SIZE = 128


@dataclass(frozen=True)
class QgzPlan:
    """Sizes of one qgZ call; pure arithmetic, see :func:`qgz_plan`."""

    nodes: int
    """K: nodes the DP group spans (inter-node group size)."""
    ranks_per_node: int
    """N: DP ranks per node (intra-node group size)."""
    numel: int
    """M: elements of the input."""
    chunk_numel: int
    """c = ceil(M / Z): elements each DP rank receives (the output numel)."""
    bits: Tuple[int, int]
    """Quantized width of hop 1 (intra-node) and hop 2 (inter-node)."""
    block_size: int
    """Elements per scale, both hops; blocks never straddle chunks."""
    hop1_row: Tuple[int, int]
    """(data bytes, scale count) of one chunk quantized at ``bits[0]``."""
    hop2_row: Tuple[int, int]
    """(data bytes, scale count) of one chunk quantized at ``bits[1]``."""

    @property
    def dp_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def padded_numel(self) -> int:
        return self.dp_size * self.chunk_numel

    @property
    def runs_intra_hop(self) -> bool:
        return self.ranks_per_node > 1

    @property
    def runs_inter_hop(self) -> bool:
        return self.nodes > 1


def qgz_plan(
    numel: int, nodes: int, ranks_per_node: int, bits=DEFAULT_BITS, block_size=DEFAULT_BLOCK_SIZE
) -> QgzPlan:
    """Validate the arguments and compute the sizes of a qgZ call (no process group needed)."""
    for name, v in (("numel", numel), ("nodes", nodes), ("ranks_per_node", ranks_per_node)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"qgZ {name} must be a positive int, got {v!r}")
    if not isinstance(bits, (tuple, list)) or len(bits) != 2:
        raise ValueError(f"qgZ bits must be a pair (intra-node, inter-node), got {bits!r}")
    for b in bits:
        check_quant_args(b, block_size)
    c = math.ceil(numel / (nodes * ranks_per_node))
    return QgzPlan(
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        numel=numel,
        chunk_numel=c,
        bits=(int(bits[0]), int(bits[1])),
        block_size=block_size,
        hop1_row=tuple(quantized_sizes(c, bits[0], block_size)),
        hop2_row=tuple(quantized_sizes(c, bits[1], block_size)),
    )


def qgz_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    intra_node_group,
    inter_node_group,
    op: str = "sum",
    async_op: bool = False,
    *,
    bits=DEFAULT_BITS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    stats: Optional[CommStats] = None,
    residual: Optional[QgzResidual] = None,
    hadamard_seed: Optional[int] = None,
) -> Optional[CommHandle]:
    """Quantized two-hop reduce-scatter; DP rank ``inter_rank * N + intra_rank`` gets its chunk.

    Args:
        output: contiguous, ``ceil(input.numel() / Z)`` elements, bf16/fp16/fp32; receives chunk
            ``d`` of the (zero-padded) sum or average over the DP group.
        input: this rank's full gradient, any shape, bf16/fp16/fp32.
        intra_node_group: the DP ranks on this node (N ranks).
        inter_node_group: one DP rank per node with this rank's intra-node index (K ranks).
        op: ``"sum"`` or ``"avg"`` (divided by Z in fp32 before the cast to ``output.dtype``).
        bits: (intra-node, inter-node) widths, each 4 or 8.
        block_size: elements per scale.
        stats: optional byte counter (protocol ``"qgz_reduce_scatter"``).
        residual: error feedback (:mod:`.qgz_feedback`): the residuals of this input's
            quantizations, added to the next call's; ``None`` = none kept.
        hadamard_seed: rotate every quantization block by ``H D`` first
            (:mod:`megatron_zeropp.quant.hadamard`; D drawn from this seed, which must be the
            same on every rank), sum in the rotated domain through both hops, rotate this rank's
            chunk back at the end. Each chunk is zero-padded to whole blocks for the rotation,
            so blocks never straddle chunks; the bytes sent are the same. ``None`` = off.
    """
    check_op(op)
    check_tensor("input", input, contiguous=False)
    check_tensor("output", output, dtypes=FLOAT_DTYPES)
    check_same_device(output=output, input=input)
    intra_ranks, _ = check_member("intra_node_group", intra_node_group)
    inter_ranks, _ = check_member("inter_node_group", inter_node_group)
    me = dist.get_rank()
    if set(intra_ranks) & set(inter_ranks) != {me}:
        raise ValueError(
            f"intra_node_group {intra_ranks} and inter_node_group {inter_ranks} must share only "
            f"this rank ({me}): together they must form the N x K grid of the DP group"
        )
    plan = qgz_plan(input.numel(), len(inter_ranks), len(intra_ranks), bits, block_size)
    if output.numel() != plan.chunk_numel:
        raise ValueError(
            f"qgz_reduce_scatter: output has {output.numel()} elements, expected ceil(input "
            f"numel {plan.numel} / DP size {plan.dp_size}) = {plan.chunk_numel}"
        )
    if hadamard_seed is not None:
        if not isinstance(hadamard_seed, int) or isinstance(hadamard_seed, bool):
            raise ValueError(f"hadamard_seed must be an int or None, got {hadamard_seed!r}")
        check_rotation_block(block_size)
    if residual is not None and not isinstance(residual, QgzResidual):
        raise ValueError(f"residual must be a QgzResidual or None, got {type(residual).__name__}")
    if stats is not None:
        _record(stats, plan, intra_ranks, inter_ranks, me)

    def body():
        total = _reduce(plan, input, intra_node_group, inter_node_group, residual,
                        hadamard_seed)
        if op == "avg":
            total.div_(plan.dp_size)
        output.view(-1).copy_(total.view(-1))

    return run_protocol(body, async_op, REDUCE_SCATTER, input.device, lane="reduce",
                        keep=(input,), stats=stats)


def _record(stats: CommStats, plan: QgzPlan, intra_ranks, inter_ranks, me) -> None:
    stats.count_call(REDUCE_SCATTER)
    if plan.runs_intra_hop:
        nbytes, nblocks = plan.hop1_row
        k = plan.nodes  # K rows to every intra-node peer
        stats.record_all_to_all(REDUCE_SCATTER, intra_ranks, me, k * nbytes, k * 4 * nblocks)
    if plan.runs_inter_hop:
        nbytes, nblocks = plan.hop2_row
        stats.record_all_to_all(REDUCE_SCATTER, inter_ranks, me, nbytes, 4 * nblocks)


def _reduce(plan: QgzPlan, input: torch.Tensor, intra_group, inter_group,
            residual: Optional[QgzResidual] = None,
            hadamard_seed: Optional[int] = None) -> torch.Tensor:
    """Run the hops; returns this rank's chunk of the sum, fp32, shape (1, c)."""
    x = input.reshape(-1)
    pad = plan.padded_numel - plan.numel
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    if plan.dp_size == 1:
        return x.to(torch.float32).view(1, -1)
    if hadamard_seed is None:
        return _hops(plan, x, intra_group, inter_group, residual)
    bs, c = plan.block_size, plan.chunk_numel
    cp = math.ceil(c / bs) * bs
    rows = x.to(torch.float32).view(plan.dp_size, c)
    if cp != c:
        rows = torch.nn.functional.pad(rows, (0, cp - c))
    # quantized_sizes pads each row to whole blocks anyway: the padded plan sends the same bytes.
    padded = dataclasses.replace(plan, numel=plan.dp_size * cp, chunk_numel=cp)
    total = _hops(padded, rotate_blocks(rows.reshape(-1), bs, hadamard_seed), intra_group,
                  inter_group, residual)
    return unrotate_blocks(total.reshape(-1), bs, hadamard_seed)[:c].view(1, c)


def _hops(plan: QgzPlan, x: torch.Tensor, intra_group, inter_group,
          residual: Optional[QgzResidual]) -> torch.Tensor:
    """Steps 1-5 on the padded flat input ``x`` (Z * c elements)."""
    K, N, bs = plan.nodes, plan.ranks_per_node, plan.block_size
    if plan.runs_intra_hop:
        data, scales = _first_quantize(x, K, N, plan.bits[0], bs, residual)
        rows = _intra_node_hop(plan, data, scales, intra_group, residual)
    else:
        # N == 1: the hop-1 order is the identity and the only quantization is hop 2's.
        rows = _first_quantize(x, K, 1, plan.bits[1], bs, residual)
    if not plan.runs_inter_hop:
        return rows
    return _inter_node_hop(plan, rows, inter_group)


_ORDERS: Dict[Tuple[int, int, str], torch.Tensor] = {}


def _chunk_order(K: int, N: int, device: torch.device) -> torch.Tensor:
    # Cached per device: building it from a list is a blocking host-to-device copy on CUDA.
    key = (K, N, str(device))
    order = _ORDERS.get(key)
    if order is None:
        order = torch.tensor(qgz_chunk_order(K, N), device=device)
        _ORDERS[key] = order
    return order


def _first_quantize(x, K, N, bits, bs, residual: Optional[QgzResidual]):
    """Step 1, with error feedback when ``residual`` is given (kept in input order)."""
    if residual is None:
        return swizzled_quantize(x, K, N, bits, bs)
    buf = residual.buffer("send", x.numel(), x.device)
    xr = x.to(torch.float32) + buf
    data, scales = swizzled_quantize(xr, K, N, bits, bs)
    c = x.numel() // (K * N)
    order = _chunk_order(K, N, x.device)
    sent = dequantize_chunks(data, scales, bits, bs, c, torch.float32)  # (Z, c), send order
    buf.view(-1, c).index_copy_(0, order, xr.view(-1, c).index_select(0, order) - sent)
    return data, scales


def _intra_node_hop(plan: QgzPlan, data, scales, group, residual: Optional[QgzResidual] = None):
    """Steps 2-3. Returns requantized (data, scales) of K rows, or the fp32 sum if K == 1."""
    K, N, c, bs = plan.nodes, plan.ranks_per_node, plan.chunk_numel, plan.block_size
    send = pack_rows(data, scales)  # (Z, row bytes), in send-position order
    recv = torch.empty_like(send)
    all_to_all_into(recv, send, group)
    # Received rows: from intra peer j, the K chunks k' * N + (my intra index), k' = 0..K-1.
    r_data, r_scales = unpack_rows(recv, plan.hop1_row[0], data.dtype)
    r_data = r_data.view(N, K, -1)
    r_scales = r_scales.view(N, K, -1)
    if not plan.runs_inter_hop:
        return dequantize_reduce(r_data, r_scales, plan.bits[0], bs, c, out_dtype=torch.float32)
    if residual is None:
        return dequantize_reduce(
            r_data, r_scales, plan.bits[0], bs, c, out_bits=plan.bits[1], out_block_size=bs
        )
    # Error feedback on the requantization of the node partials, too.
    partial = dequantize_reduce(r_data, r_scales, plan.bits[0], bs, c, out_dtype=torch.float32)
    buf = residual.buffer("partial", K * c, partial.device).view(K, c)
    partial.add_(buf)
    rows = quantize_chunks(partial, plan.bits[1], bs)
    buf.copy_(partial - dequantize_chunks(*rows, plan.bits[1], bs, c, torch.float32))
    return rows


def _inter_node_hop(plan: QgzPlan, rows, group) -> torch.Tensor:
    """Steps 4-5: send node-partial row k' to inter peer k', sum the K partials received."""
    data, scales = rows
    K, c, bs = plan.nodes, plan.chunk_numel, plan.block_size
    send = pack_rows(data, scales)  # (K, row bytes)
    recv = torch.empty_like(send)
    all_to_all_into(recv, send, group)
    r_data, r_scales = unpack_rows(recv, plan.hop2_row[0], data.dtype)
    return dequantize_reduce(
        r_data.view(K, 1, -1), r_scales.view(K, 1, -1), plan.bits[1], bs, c,
        out_dtype=torch.float32,
    )
