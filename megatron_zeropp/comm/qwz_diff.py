"""qwZ with weight differences: each step sends Q(w_t - ŵ_{t-1}), not Q(w_t).

Plain qwZ quantizes the absolute weights every step (INT8: 0.7 % relative error on every weight
the forward uses). Here the receivers already hold the previous step's reconstruction ŵ_{t-1}
(the hpZ secondary slice, which survives between steps), so the owner of a shard sends only the
block-quantized difference against it, and everyone adds the dequantized difference in place::

    owner c:    d_c   = w_c - ŵ_c                         (fp32; ŵ_c kept by the owner)
                q_c   = Q(d_c)                             (INT4/INT8 blocks, per parameter)
                ŵ_c  <- fl(ŵ_c + deq(q_c))                 (exact parameters: ŵ_c <- w_c)
    holder of c:  its copy of ŵ_c <- fl(copy + deq(q_c))   (the same expression, same bits)

Both sides evaluate the same expression on the same bits (:func:`_apply`), so the holders'
copies equal the owner's ŵ bit for bit after any number of steps (by induction from an exact
start), and because d is taken against ŵ, not against the previous w, the error never
accumulates: ``ŵ_t - w_t`` is one difference's quantization error (at most half a step of the
block's scale with round-to-nearest, a full step with stochastic rounding, plus the final
rounding to the weight dtype). A sender that differenced against its exact previous w instead
would leave the receivers a random walk of every past step's error (the negative control in
``tests/test_comm_qwz_diff.py``).

Who receives what (``holders``): the gathered tensor is ``Z`` rows (DP rank c owns row c); the
hpZ secondary cuts it into ``H`` slices of ``R = Z / H`` consecutive rows, and DP rank d holds
slice ``holders[d]``. So row c goes only to the ``R`` ranks holding slice ``c // R`` (one per
hpZ replica, i.e. one per node when the hpZ group is the node): one uneven all-to-all over the
DP group. With one DP rank per node (``H = 1``) everyone holds everything and this is an
all-gather of differences; with ``N`` ranks per node a rank sends its row to one rank per node,
so its cross-node bytes are ``(K - 1)`` rows of ``bits / 8`` bytes per element (K nodes), about
``1 / (2N)`` of INT8 qwZ's ``(Z - 1)`` rows at INT4. The rest of the full weights is then
rebuilt inside the node by the hpZ gather (the caller's business).

Wire row per owner: ``[codes | fp32 scales | exact elements]`` with the parameter-aligned layout
of :mod:`.segments` (no block spans two parameters; small parameters travel exactly in the
output dtype, as in qwZ).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from megatron_zeropp.quant import dequantize_chunks, quantize_chunks, quantized_sizes
from megatron_zeropp.quant.rounding import row_keys

from .accounting import CommStats
from .common import (
    FLOAT_DTYPES,
    all_to_all_v_into,
    check_member,
    check_quant_args,
    check_rounding_key,
    check_same_device,
    check_tensor,
    code_dtype,
    element_size,
    empty_codes,
    pack_rows,
    unpack_rows,
)
from .segments import SegmentLayout, layout_for
from .work import CommHandle, run_protocol

DIFF = "qwz_diff"
DEFAULT_BITS = 4


def check_holders(holders: Sequence[int], group_size: int) -> Tuple[int, int]:
    """Validate ``holders`` (the slice index each DP group rank holds); returns ``(H, R)``: the
    number of slices and the rows per slice (= the ranks holding each slice)."""
    holders = tuple(holders)
    if len(holders) != group_size or not all(isinstance(h, int) and h >= 0 for h in holders):
        raise ValueError(f"holders must give one slice index >= 0 per rank of the group of "
                         f"{group_size}, got {holders!r}")
    h = max(holders) + 1
    if group_size % h:
        raise ValueError(f"holders {holders!r}: {h} slices do not divide the group of "
                         f"{group_size}")
    r = group_size // h
    counts = [holders.count(j) for j in range(h)]
    if any(c != r for c in counts):
        raise ValueError(f"holders {holders!r}: each of the {h} slices must be held by "
                         f"{r} ranks, got counts {counts}")
    return h, r


def own_row_in_slice(holders: Sequence[int], rank: int) -> bool:
    """Whether DP rank ``rank`` holds its own row in its slice (then the slice is its ŵ)."""
    h, r = check_holders(holders, len(holders))
    return rank // r == holders[rank]


def qwz_diff_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group=None,
    async_op: bool = False,
    *,
    reference: Optional[torch.Tensor],
    holders: Sequence[int],
    bits: int = DEFAULT_BITS,
    block_size: int = 256,
    stats: Optional[CommStats] = None,
    segments=None,
    rounding_key: Optional[int] = None,
) -> Optional[CommHandle]:
    """Update every holder's reconstruction of the rows it holds by this step's quantized
    differences; the owner's ŵ moves with them.

    Args:
        output: this rank's slice of the reconstruction, ``R * input.numel()`` elements
            (rows ``holders[me] * R ...`` of the gathered tensor), bf16/fp16/fp32, updated in
            place. It must hold exactly what the owners' ``reference`` tensors hold.
        input: this rank's primary shard w (row ``me``), bf16/fp16/fp32.
        group: the DP process group.
        reference: the owner's ŵ of ``input`` (``input.numel()`` elements, ``output``'s dtype),
            updated in place; ``None`` exactly when this rank's own row lies in its slice
            (:func:`own_row_in_slice`), which then is the reference.
        holders: slice index held by each DP group rank (:func:`check_holders`).
        bits: 4 or 8 (width of the differences on the wire).
        block_size: elements per scale.
        stats: optional byte counter (protocol ``"qwz_diff"``).
        segments: the gathered tensor's parameters (:func:`.segments.param_segments`).
        rounding_key: round stochastically with this 32-bit key (:mod:`..quant.rounding`);
            ``None``: to nearest.
    """
    check_tensor("input", input, contiguous=False)
    check_tensor("output", output, dtypes=FLOAT_DTYPES)
    check_same_device(output=output, input=input)
    check_quant_args(bits, block_size)
    ranks, me = check_member("group", group)
    g, n = len(ranks), input.numel()
    _, r = check_holders(holders, g)
    if output.numel() != r * n:
        raise ValueError(f"qwz_diff_all_gather: output has {output.numel()} elements, expected "
                         f"{r} rows per slice x input numel {n} = {r * n}")
    own_in_slice = me // r == holders[me]
    if own_in_slice != (reference is None):
        raise ValueError(
            f"qwz_diff_all_gather: rank {me} {'holds' if own_in_slice else 'does not hold'} "
            f"its own row in its slice, so reference must be "
            f"{'None' if own_in_slice else 'its own tensor'}")
    if reference is not None:
        check_tensor("reference", reference, dtypes=(output.dtype,))
        check_same_device(output=output, reference=reference)
        if reference.numel() != n:
            raise ValueError(f"qwz_diff_all_gather: reference has {reference.numel()} elements, "
                             f"input {n}")
    check_rounding_key(rounding_key)
    layout = layout_for(segments, g, n, block_size)
    nbytes, nblocks = quantized_sizes(layout.quant_numel, bits, block_size)
    if layout.quant_numel == 0:
        nbytes = nblocks = 0
    isz = element_size(output.dtype)
    row_bytes = [nbytes + 4 * nblocks + layout.exact_elements(c) * isz for c in range(g)]
    receivers = [d for d in range(g) if holders[d] == me // r]
    senders = list(range(holders[me] * r, (holders[me] + 1) * r))
    send_splits = [row_bytes[me] if d in receivers else 0 for d in range(g)]
    recv_splits = [row_bytes[c] if c in senders else 0 for c in range(g)]
    if stats is not None:
        exact_bytes = layout.exact_elements(me) * isz
        stats.count_call(DIFF)
        stats.record_all_to_all_v(
            DIFF, ranks, ranks[me],
            [nbytes + exact_bytes if d in receivers else 0 for d in range(g)],
            [4 * nblocks if d in receivers else 0 for d in range(g)])
    keys = None if rounding_key is None else row_keys(rounding_key, (me,), input.device)
    plan = _Plan(layout, bits, block_size, nbytes, nblocks, me, r, holders[me], senders,
                 send_splits, recv_splits)

    def body():
        _diff_gather(output, input, reference, group, plan, keys)

    return run_protocol(body, async_op, DIFF, input.device, stats=stats)


class _Plan:
    def __init__(self, layout, bits, block_size, nbytes, nblocks, me, r, slice_index, senders,
                 send_splits, recv_splits):
        self.layout, self.bits, self.block_size = layout, bits, block_size
        self.nbytes, self.nblocks, self.me, self.r = nbytes, nblocks, me, r
        self.slice_index, self.senders = slice_index, senders
        self.send_splits, self.recv_splits = send_splits, recv_splits


def _diff_gather(output, input, reference, group, plan: _Plan, keys) -> None:
    layout, n, me, r = plan.layout, input.numel(), plan.me, plan.r
    slice_rows = output.view(r, n)
    ref = slice_rows[me - plan.slice_index * r] if reference is None else reference.view(-1)
    data, scales = quantize_difference(input, ref, layout, me, plan.bits, plan.block_size, keys)
    exact = layout.gather("e", input.reshape(1, n), (me,), local=True)[
        0, : layout.exact_elements(me)].to(output.dtype)
    packet = torch.cat([pack_rows(data, scales).view(-1), exact.view(torch.uint8)])
    fanout = sum(1 for s in plan.send_splits if s)
    send = packet.repeat(fanout)
    recv = torch.empty(sum(plan.recv_splits), dtype=torch.uint8, device=input.device)
    all_to_all_v_into(recv, send, plan.recv_splits, plan.send_splits, group)
    # Unpack the R rows of this slice: equal [codes | scales] parts, uneven exact parts.
    head = plan.nbytes + 4 * plan.nblocks
    codes = torch.empty(r, head, dtype=torch.uint8, device=input.device)
    exacts = torch.zeros(r, max(layout.exact_numel, 1), dtype=output.dtype, device=input.device)
    pos = 0
    for i, c in enumerate(plan.senders):
        codes[i].copy_(recv[pos : pos + head])
        ne = layout.exact_elements(c)
        if ne:
            exacts[i, :ne].view(torch.uint8).copy_(
                recv[pos + head : pos + head + ne * exacts.element_size()])
        pos += plan.recv_splits[c]
    values = dequantize_rows(codes, layout, plan.bits, plan.block_size, plan.nbytes)
    apply_difference(slice_rows, layout, plan.senders, values, exacts)
    if reference is not None:  # the owner's ŵ moves by exactly what the holders added
        own = dequantize_rows(pack_rows(data, scales), layout, plan.bits, plan.block_size,
                              plan.nbytes)
        apply_difference(reference.view(1, n), layout, (me,), own, exact.view(1, -1))


def quantize_difference(input, ref, layout: SegmentLayout, row: int, bits: int,
                        block_size: int, keys=None):
    """``Q(input - ref)`` on ``row``'s quantized wire columns: ``(codes (1, nbytes), scales (1,
    nblocks))`` (empty when the row has no quantized elements)."""
    n = input.numel()
    if not layout.quant_numel:
        return empty_codes(1, bits, input.device)
    d = input.reshape(1, n).float() - ref.reshape(1, n).float()
    return quantize_chunks(layout.gather("q", d, (row,), local=True), bits, block_size, keys)


def dequantize_rows(packed: torch.Tensor, layout: SegmentLayout, bits: int, block_size: int,
                    nbytes: int) -> torch.Tensor:
    """fp32 differences ``(rows, W)`` from packed ``[codes | scales]`` rows."""
    rows = packed.shape[0]
    if not layout.quant_numel:
        return torch.zeros(rows, 0, dtype=torch.float32, device=packed.device)
    data, scales = unpack_rows(packed, nbytes, code_dtype(bits))
    return dequantize_chunks(data, scales, bits, block_size, layout.quant_numel, torch.float32)


def apply_difference(target: torch.Tensor, layout: SegmentLayout, rows: Sequence[int],
                     values: torch.Tensor, exact: torch.Tensor) -> None:
    """``target[i] <- fl(target[i] + values[i])`` on row ``rows[i]``'s quantized pieces and
    ``exact[i]`` on its exact pieces (``target (len(rows), row_numel)``, in place).

    The one expression the owner and every holder evaluate, so their bits agree."""
    n = layout.row_numel
    if layout.identity:
        target.copy_(target.float() + values[:, :n])
        return
    for i, m in enumerate(rows):
        t = target[i]
        for a, b, col in layout.pieces(m, "q"):
            t[a:b] = t[a:b].float() + values[i, col : col + b - a]
        for a, b, col in layout.pieces(m, "e"):
            t[a:b] = exact[i, col : col + b - a]
