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

Parameter-aligned blocks (``segments``, :mod:`.segments`): the Z chunks are laid out on the wire
so that no block spans two parameters; ``exact`` segments (small parameters) ride unquantized in
the same rows, in the input dtype on hop 1 and as fp32 node partials on hop 2, summed in fp32 in
piece order like the quantized part. The layout of chunk m is the same on every rank, so the
rows of the N (then K) senders line up element by element.
"""

from __future__ import annotations

import contextvars
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
from megatron_zeropp.quant.rounding import derive_key, row_keys

from .accounting import CommStats
from .common import (
    FLOAT_DTYPES,
    all_to_all_into,
    all_to_all_v_into,
    check_member,
    check_op,
    check_quant_args,
    check_rounding_key,
    check_same_device,
    check_tensor,
    element_size,
    empty_codes,
    pack_rows,
    unpack_rows,
)
from .qgz_feedback import QgzResidual
from .segments import SegmentLayout, layout_for
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
    quant_numel: int = 0
    """W: quantized elements per wire row (``chunk_numel`` without segments)."""
    exact_per_chunk: Tuple[int, ...] = ()
    """Unquantized elements of each chunk (its small parameters; empty without segments).
    Rows carry exactly these, so a hop's rows differ in size (uneven all-to-all splits)."""
    exact_itemsize: int = 4
    """Bytes per exact element on hop 1 (the input dtype's); hop 2 sends fp32 partials."""

    @property
    def has_exact(self) -> bool:
        return any(self.exact_per_chunk)

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
    numel: int, nodes: int, ranks_per_node: int, bits=DEFAULT_BITS, block_size=DEFAULT_BLOCK_SIZE,
    layout: Optional[SegmentLayout] = None, exact_itemsize: int = 4,
) -> QgzPlan:
    """Validate the arguments and compute the sizes of a qgZ call (no process group needed).

    ``layout``: the wire layout of the Z chunks (:mod:`.segments`); ``None`` = the identity."""
    for name, v in (("numel", numel), ("nodes", nodes), ("ranks_per_node", ranks_per_node)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"qgZ {name} must be a positive int, got {v!r}")
    if not isinstance(bits, (tuple, list)) or len(bits) != 2:
        raise ValueError(f"qgZ bits must be a pair (intra-node, inter-node), got {bits!r}")
    for b in bits:
        check_quant_args(b, block_size)
    c = math.ceil(numel / (nodes * ranks_per_node))
    w = c if layout is None else layout.quant_numel
    e = () if layout is None else tuple(layout.exact_elements(m)
                                        for m in range(nodes * ranks_per_node))
    return QgzPlan(
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        numel=numel,
        chunk_numel=c,
        bits=(int(bits[0]), int(bits[1])),
        block_size=block_size,
        hop1_row=tuple(quantized_sizes(w, bits[0], block_size)),
        hop2_row=tuple(quantized_sizes(w, bits[1], block_size)),
        quant_numel=w,
        exact_per_chunk=e,
        exact_itemsize=exact_itemsize,
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
    segments=None,
    rounding_key: Optional[int] = None,
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
        segments: ``(start, end, exact)`` ranges covering the (zero-padded) input, one per
            parameter (:func:`.segments.param_segments`): no block spans two of them, and
            ``exact`` ones are summed unquantized (see the module docstring). ``None``: blocks
            run across parameters.
        rounding_key: round stochastically (both hops) with random numbers drawn from this
            32-bit key (:mod:`megatron_zeropp.quant.rounding`; each hop's rows keyed by
            chunk): the caller makes it differ per rank, iteration and bucket, and a rerun
            with the same keys is bit-identical. ``None``: round to nearest.
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
    k, n = len(inter_ranks), len(intra_ranks)
    c = math.ceil(input.numel() / (k * n)) if input.numel() > 0 else 0
    layout = None
    if segments is not None:
        segments = [tuple(seg) for seg in segments]
        if segments and segments[-1][1] == input.numel() < k * n * c:
            # The zero padding to Z * c rides with the last segment.
            segments[-1] = (segments[-1][0], k * n * c, segments[-1][2])
        layout = layout_for(segments, k * n, c, block_size)
    plan = qgz_plan(input.numel(), k, n, bits, block_size, layout,
                    element_size(input.dtype))
    if output.numel() != plan.chunk_numel:
        raise ValueError(
            f"qgz_reduce_scatter: output has {output.numel()} elements, expected ceil(input "
            f"numel {plan.numel} / DP size {plan.dp_size}) = {plan.chunk_numel}"
        )
    if hadamard_seed is not None:
        if not isinstance(hadamard_seed, int) or isinstance(hadamard_seed, bool):
            raise ValueError(f"hadamard_seed must be an int or None, got {hadamard_seed!r}")
        check_rotation_block(block_size)
    check_rounding_key(rounding_key)
    if residual is not None and not isinstance(residual, QgzResidual):
        raise ValueError(f"residual must be a QgzResidual or None, got {type(residual).__name__}")
    if stats is not None:
        record_plan_bytes(stats, plan, intra_ranks, inter_ranks, me, intra_ranks.index(me))

    def body():
        token = _ROUNDING_KEY.set(rounding_key)
        try:
            total = _reduce(plan, input, intra_node_group, inter_node_group, residual,
                            hadamard_seed, layout)
        finally:
            _ROUNDING_KEY.reset(token)
        if op == "avg":
            total.div_(plan.dp_size)
        output.view(-1).copy_(total.view(-1))

    return run_protocol(body, async_op, REDUCE_SCATTER, input.device, lane="reduce",
                        keep=(input,), stats=stats)


def qgz_residual_input(residual: QgzResidual, numel: int, intra_node_group, inter_node_group,
                       *, block_size: int = DEFAULT_BLOCK_SIZE, segments=None,
                       hadamard_seed: Optional[int] = None) -> Optional[torch.Tensor]:
    """What error feedback still owes: the residuals of ``residual`` mapped back to the input
    of ``numel`` elements (fp32; zeros at exact segments), for a caller that reduces the next
    gradients exactly and adds this first (qgZ switched off: flush, do not drop). Sum over the
    DP ranks of it equals the sum of what the ranks' quantizations left out, so adding it to
    the input of an exact reduce-scatter delivers it in full. ``None`` if nothing is held.
    The arguments are those of the qgZ calls that filled ``residual``."""
    if not residual.nbytes():
        return None
    K, N = dist.get_world_size(inter_node_group), dist.get_world_size(intra_node_group)
    z = K * N
    c = math.ceil(numel / z)
    layout = None
    w = c
    if segments is not None:
        segments = [tuple(seg) for seg in segments]
        if segments[-1][1] == numel < z * c:
            segments[-1] = (segments[-1][0], z * c, segments[-1][2])
        layout = layout_for(segments, z, c, block_size)
        w = layout.quant_numel
    send = residual.peek("send")
    width = send.numel() // z  # W, or W padded to whole blocks under the Hadamard rotation
    rows = send.view(z, width).clone()
    partial = residual.peek("partial")
    if partial is not None:  # this rank's hop-2 residual of chunks k' * N + j
        j = dist.get_rank(intra_node_group)
        rows[j::N].add_(partial.view(K, width))
    if hadamard_seed is not None:
        rows = unrotate_blocks(rows.reshape(-1), block_size, hadamard_seed).view(z, width)
    out = torch.zeros(z * c, dtype=torch.float32, device=send.device)
    if layout is None:
        out.view(z, c).copy_(rows[:, :c])
    else:
        layout.scatter(out, range(z), rows[:, :w], torch.zeros(z, layout.exact_numel,
                                                                device=send.device))
    return out[:numel]


def record_plan_bytes(stats: CommStats, plan: QgzPlan, intra_ranks, inter_ranks, me, j) -> None:
    stats.count_call(REDUCE_SCATTER)
    K, N, e = plan.nodes, plan.ranks_per_node, plan.exact_per_chunk
    if plan.runs_intra_hop:
        nbytes, nblocks = plan.hop1_row
        # K rows to every intra-node peer j': chunks k' * N + j', with their exact elements.
        payload = [K * nbytes + sum(e[k * N + jj] for k in range(K)) * plan.exact_itemsize
                   if e else K * nbytes for jj in range(N)]
        stats.record_all_to_all_v(REDUCE_SCATTER, intra_ranks, me, payload,
                                  [K * 4 * nblocks] * N)
    if plan.runs_inter_hop:
        nbytes, nblocks = plan.hop2_row
        # Row k' (chunk k' * N + j, fp32 exact partials) to inter-node peer k'.
        payload = [nbytes + (4 * e[k * N + j] if e else 0) for k in range(K)]
        stats.record_all_to_all_v(REDUCE_SCATTER, inter_ranks, me, payload,
                                  [4 * nblocks] * K)


def _reduce(plan: QgzPlan, input: torch.Tensor, intra_group, inter_group,
            residual: Optional[QgzResidual] = None,
            hadamard_seed: Optional[int] = None,
            layout: Optional[SegmentLayout] = None) -> torch.Tensor:
    """Run the hops; returns this rank's chunk of the sum, fp32, shape (1, c)."""
    x = input.reshape(-1)
    pad = plan.padded_numel - plan.numel
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    if plan.dp_size == 1:
        return x.to(torch.float32).view(1, -1)
    z, c = plan.dp_size, plan.chunk_numel
    if layout is None:
        q, e = x.view(z, c), None
    else:
        q = layout.gather("q", x, range(z))
        e = layout.gather("e", x, range(z)) if plan.has_exact else None
    me = dist.get_rank(inter_group) * plan.ranks_per_node + dist.get_rank(intra_group)
    if hadamard_seed is None:
        qsum, esum = _hops(plan, q.reshape(-1), e, intra_group, inter_group, residual)
    else:
        bs, w = plan.block_size, plan.quant_numel
        wp = math.ceil(w / bs) * bs
        rows = q.to(torch.float32)
        if wp != w:
            rows = torch.nn.functional.pad(rows, (0, wp - w))
        # quantized_sizes pads each row to whole blocks anyway: the padded plan sends the same
        # bytes.
        padded = dataclasses.replace(plan, numel=z * wp, chunk_numel=wp, quant_numel=wp)
        qsum, esum = _hops(padded, rotate_blocks(rows.reshape(-1), bs, hadamard_seed), e,
                           intra_group, inter_group, residual)
        qsum = unrotate_blocks(qsum.reshape(-1), bs, hadamard_seed)[:w].view(1, w)
    if layout is None or layout.identity and esum is None:
        return qsum[:, :c] if qsum.shape[-1] != c else qsum
    out = torch.empty(1, c, dtype=torch.float32, device=qsum.device)
    layout.scatter(out, (me,), qsum, esum, local=True)
    return out


def _hops(plan: QgzPlan, x: torch.Tensor, exact: Optional[torch.Tensor], intra_group,
          inter_group, residual: Optional[QgzResidual]):
    """Steps 1-5 on the flat quantized part ``x`` (Z rows of W elements) and the exact part
    ``exact`` (Z rows of E, chunk order, or None). Returns this rank's (quantized-part sum
    (1, W) fp32, exact-part sum (1, E) fp32 or None)."""
    K, N, bs = plan.nodes, plan.ranks_per_node, plan.block_size
    e = plan.exact_per_chunk
    if exact is not None:
        exact = exact.index_select(0, _chunk_order(K, N, exact.device))  # send order
    j = 0
    if plan.runs_intra_hop:
        j = dist.get_rank(intra_group)
        data, scales = _first_quantize(x, K, N, plan.bits[0], bs, residual)
        rows, exact = _intra_node_hop(plan, data, scales, intra_group, residual, exact)
    else:
        # N == 1: the hop-1 order is the identity and the only quantization is hop 2's.
        rows = _first_quantize(x, K, 1, plan.bits[1], bs, residual)
        if exact is not None:
            exact = [exact[k, : e[k]].to(torch.float32) for k in range(K)]
    if not plan.runs_inter_hop:
        return rows, None if exact is None else exact[0].view(1, -1)
    return _inter_node_hop(plan, rows, exact, inter_group, j)


# The stochastic-rounding key of the qgZ call running in this context (None: round to nearest).
_ROUNDING_KEY: contextvars.ContextVar = contextvars.ContextVar("qgz_rounding_key", default=None)


def _round_keys(point: int, chunks, device) -> Optional[torch.Tensor]:
    """Row keys for quantization ``point`` (1: hop 1, 2: hop 2's requantization) of rows
    holding ``chunks``, from the call's key; None when rounding to nearest. Keyed by chunk,
    not by position, so a chunk's random numbers do not depend on the send order."""
    base = _ROUNDING_KEY.get()
    if base is None:
        return None
    return row_keys(derive_key(base, point), chunks, device)


def _reduce_pieces(data, scales, bits, bs, w, out_bits=None, out_row_keys=None):
    """:func:`dequantize_reduce` of (P, C, ...) pieces to fp32 (or requantized at
    ``out_bits``, stochastically with ``out_row_keys``), also for rows of 0 quantized
    elements."""
    if w == 0:
        rows = data.shape[1]
        if out_bits is None:
            return torch.empty(rows, 0, dtype=torch.float32, device=data.device)
        return empty_codes(rows, out_bits, data.device)
    if out_bits is None:
        return dequantize_reduce(data, scales, bits, bs, w, out_dtype=torch.float32)
    return dequantize_reduce(data, scales, bits, bs, w, out_bits=out_bits, out_block_size=bs,
                             out_row_keys=out_row_keys)


def _sum_pieces(pieces: torch.Tensor) -> torch.Tensor:
    """fp32 sum over dim 0 in piece order (left to right, like the quantized part)."""
    acc = pieces[0].to(torch.float32)
    for p in range(1, pieces.shape[0]):
        acc = acc + pieces[p].to(torch.float32)
    return acc


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
    if x.numel() == 0:
        return empty_codes(K * N, bits, x.device)
    keys = _round_keys(1, qgz_chunk_order(K, N), x.device)  # per send position: its chunk's
    if residual is None:
        return swizzled_quantize(x, K, N, bits, bs, keys)
    buf = residual.buffer("send", x.numel(), x.device)
    xr = x.to(torch.float32) + buf
    data, scales = swizzled_quantize(xr, K, N, bits, bs, keys)
    c = x.numel() // (K * N)
    order = _chunk_order(K, N, x.device)
    sent = dequantize_chunks(data, scales, bits, bs, c, torch.float32)  # (Z, c), send order
    buf.view(-1, c).index_copy_(0, order, xr.view(-1, c).index_select(0, order) - sent)
    _drop_non_finite(buf)
    return data, scales


def _drop_non_finite(buf: torch.Tensor) -> None:
    """Zero the residual entries that are NaN / Inf. A non-finite gradient (fp16's dynamic loss
    scale overflows by design at the start) quantizes to a NaN block; carried on, that NaN
    would poison every later step (each one skipped). The step that produced it is skipped
    anyway, so its residual is worth nothing."""
    torch.nan_to_num_(buf, nan=0.0, posinf=0.0, neginf=0.0)


def _exchange(plan: QgzPlan, data, scales, exact, chunks, recv_chunks, pieces, group,
              exact_dtype):
    """One hop's all-to-all. Row i (chunk ``chunks[i]``) is ``[codes | scales | exact]``,
    the exact part holding just that chunk's small-parameter elements; rows go in order, the
    group's peers taking equal numbers of them. ``recv_chunks`` are the chunks of the rows one
    peer sends here (the same from every peer). Returns the received codes ``(pieces,
    len(recv_chunks), nbytes)``, scales, and per received row the ``(pieces, E)`` exact
    values (``None`` without exact parts)."""
    if exact is None:  # equal rows: one equal-split all-to-all
        send = pack_rows(data, scales)
        recv = torch.empty_like(send)
        all_to_all_into(recv, send, group)
        r_data, r_scales = unpack_rows(recv, data.shape[-1], data.dtype)
        rows = len(recv_chunks)
        return r_data.view(pieces, rows, -1), r_scales.view(pieces, rows, -1), None
    e, isz = plan.exact_per_chunk, torch.empty(0, dtype=exact_dtype).element_size()
    code_bytes, scale_bytes = data.shape[-1], 4 * scales.shape[-1]
    parts = []
    for i, m in enumerate(chunks):
        parts += [data[i].view(torch.uint8), scales[i].view(torch.uint8),
                  exact[i, : e[m]].contiguous().view(torch.uint8)]
    send = torch.cat(parts)
    per_peer = len(chunks) // pieces
    row = code_bytes + scale_bytes
    in_splits = [sum(row + e[m] * isz for m in chunks[p * per_peer : (p + 1) * per_peer])
                 for p in range(pieces)]
    from_one = sum(row + e[m] * isz for m in recv_chunks)
    recv = torch.empty(pieces * from_one, dtype=torch.uint8, device=send.device)
    all_to_all_v_into(recv, send, [from_one] * pieces, in_splits, group)
    rows = len(recv_chunks)
    r_codes = torch.empty(pieces, rows, code_bytes, dtype=torch.uint8, device=send.device)
    r_scales = torch.empty(pieces, rows, scales.shape[-1], dtype=torch.float32,
                           device=send.device)
    r_exact = [torch.empty(pieces, e[m], dtype=exact_dtype, device=send.device)
               for m in recv_chunks]
    pos = 0
    for p in range(pieces):
        for i, m in enumerate(recv_chunks):
            r_codes[p, i] = recv[pos : pos + code_bytes]
            pos += code_bytes
            r_scales[p, i].view(torch.uint8).copy_(recv[pos : pos + scale_bytes])
            pos += scale_bytes
            n = e[m] * isz
            r_exact[i][p].view(torch.uint8).copy_(recv[pos : pos + n])
            pos += n
    return r_codes.view(data.dtype), r_scales, r_exact


def _intra_node_hop(plan: QgzPlan, data, scales, group, residual: Optional[QgzResidual] = None,
                    exact: Optional[torch.Tensor] = None):
    """Steps 2-3. Returns (requantized (data, scales) of K rows, or the fp32 sum if K == 1;
    the exact part's fp32 node partials, one (1, E_m) tensor per row, or None)."""
    K, N, w, bs = plan.nodes, plan.ranks_per_node, plan.quant_numel, plan.block_size
    order = qgz_chunk_order(K, N)
    j = dist.get_rank(group)
    # Received rows: from intra peer j', the K chunks k' * N + (my intra index), k' = 0..K-1.
    r_data, r_scales, r_exact = _exchange(
        plan, data, scales, exact, order, [k * N + j for k in range(K)], N, group,
        None if exact is None else exact.dtype)
    partial_exact = None if r_exact is None else [_sum_pieces(t) for t in r_exact]
    if not plan.runs_inter_hop:
        return _reduce_pieces(r_data, r_scales, plan.bits[0], bs, w), partial_exact
    keys = _round_keys(2, [k * N + j for k in range(K)], data.device)
    if residual is None or w == 0:
        return _reduce_pieces(r_data, r_scales, plan.bits[0], bs, w, plan.bits[1], keys), \
            partial_exact
    # Error feedback on the requantization of the node partials, too.
    partial = dequantize_reduce(r_data, r_scales, plan.bits[0], bs, w, out_dtype=torch.float32)
    buf = residual.buffer("partial", K * w, partial.device).view(K, w)
    partial.add_(buf)
    rows = quantize_chunks(partial, plan.bits[1], bs, keys)
    buf.copy_(partial - dequantize_chunks(*rows, plan.bits[1], bs, w, torch.float32))
    _drop_non_finite(buf)
    return rows, partial_exact


def _inter_node_hop(plan: QgzPlan, rows, exact, group, intra_index: int = 0):
    """Steps 4-5: send node-partial row k' to inter peer k', sum the K partials received.
    ``exact``: the rows' fp32 exact partials (a list of K tensors, row k' = chunk
    ``k' * N + intra_index``) or None. Returns (quantized-part sum (1, W), exact-part sum
    (1, E_d) or None), fp32."""
    data, scales = rows
    K, N, w, bs = plan.nodes, plan.ranks_per_node, plan.quant_numel, plan.block_size
    chunks = [k * N + intra_index for k in range(K)]
    stacked = None
    if exact is not None:
        width = max(t.numel() for t in exact)
        stacked = torch.zeros(K, width, dtype=torch.float32, device=data.device)
        for k, t in enumerate(exact):
            stacked[k, : t.numel()] = t.view(-1)
    r_data, r_scales, r_exact = _exchange(
        plan, data, scales, stacked, chunks, [chunks[dist.get_rank(group)]], K, group,
        torch.float32)
    total_exact = None if r_exact is None else _sum_pieces(r_exact[0]).view(1, -1)
    return _reduce_pieces(r_data.view(K, 1, -1), r_scales.view(K, 1, -1), plan.bits[1], bs,
                          w), total_exact
