"""The pure-torch CPU backend: the reference's quantizer, a plain-fp32 dequantize-reduce.

CPU tensors use the C kernels of :mod:`.cpu_native` (bit-identical to the reference, about 7x
faster); this module is what they fall back to, with a warning, where no C compiler is found,
and what ``ZEROPP_QUANT_BACKEND=cpu_torch`` selects.

The reference's :func:`~megatron_zeropp.quant.qgz_reference.fma32` emulates a fused multiply-add
in fp64 (about ten fp64 passes per piece) so that it matches the GPU kernels bit for bit; on CPU
it cost qgZ about 1 s per iteration per rank. Here each piece is added as ``acc + fl(q * s)``:
two fp32 roundings instead of one, every step a single vectorized torch op.

Error bound against the reference. Let ``t_p = q_p * s_p`` (exact), ``T = sum_p |t_p|`` and
``u = 2**-24``. Both sum in piece order 0..P-1. The reference rounds once per added piece
(P - 1 additions; the first is exact since acc starts at 0): ``|ref - sum t_p| <= (P - 1) u T``.
This path rounds each product too: ``|fast - sum t_p| <= (2P - 1) u T``. So, to first order,

    |fast - ref| <= (3P - 2) * u * T                       (tested with P = 2..8)

per element of the fp32 sum (the requantized output then differs by at most one code where the
sums straddle a rounding boundary). Everything else -- quantize, swizzled quantize, dequantize,
INT4 packing, NaN blocks -- is bit-identical to the reference: the quantizer computes the same
per-block scale and reciprocal and the same ``(x * p) * inv``, but skips the multiply by
``p = 1`` (exact) and the masking when every block is finite, and works in place.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import reference as _ref
from .qgz_reference import check_reduce_input, check_swizzle_input, qgz_chunk_order


def codes_fp32(data: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``(..., nbytes)`` as fp32 ``(..., n)``; equal to ``unpack_codes(...).float()``."""
    if bits == 8:
        return data.to(torch.float32)
    b = data.view(torch.int8)
    lo = torch.bitwise_left_shift(b, 4) >> 4  # arithmetic shift: sign-extends the low nibble
    hi = b >> 4
    return torch.stack((lo, hi), dim=-1).to(torch.float32).flatten(-2)


def quantize_chunks(x2d: torch.Tensor, bits: int, block_size: int) -> Tuple[torch.Tensor,
                                                                            torch.Tensor]:
    """Bit-identical to the reference's ``quantize_chunks``, with fewer passes over the data."""
    if x2d.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x2d.shape)}")
    _ref.check_float_dtype(x2d.dtype, "input")
    rows, numel = x2d.shape
    nbytes, nblocks = _ref.quantized_sizes(numel, bits, block_size)
    qmax = _ref.QMAX[bits]
    if numel == nblocks * block_size and x2d.dtype == torch.float32:
        y = x2d.clone()
    else:
        y = torch.zeros(rows, nblocks * block_size, dtype=torch.float32, device=x2d.device)
        y[:, :numel] = x2d
    y = y.view(rows, nblocks, block_size)
    absmax = y.abs().amax(dim=-1)
    # Per-block values exactly as the reference computes them (cheap: one per block).
    qmax_t = torch.full_like(absmax, qmax)
    ok = torch.isfinite(absmax)
    scale = torch.where(ok, absmax / qmax_t, torch.full_like(absmax, float("nan")))
    tiny = absmax < _ref._TINY
    p = torch.where(tiny, torch.full_like(absmax, _ref._TINY_SCALE), torch.ones_like(absmax))
    usable = ok & (absmax > 0)
    denom = torch.where(usable, absmax * p, torch.ones_like(absmax))
    inv = torch.where(usable, qmax_t / denom, torch.zeros_like(absmax))
    if not bool(ok.all()):
        y.masked_fill_(~ok.unsqueeze(-1), 0.0)
    if bool(tiny.any()):
        y.mul_(p.unsqueeze(-1))
    y.mul_(inv.unsqueeze(-1)).clamp_(-qmax, qmax).round_()
    q = y.view(rows, -1).to(torch.int8)
    if bits == 4:
        q = (q[:, 0::2] & 0xF) | torch.bitwise_left_shift(q[:, 1::2], 4)
        q = q.view(torch.uint8)
    return q.view(rows, nbytes), scale


def swizzled_quantize(x_flat: torch.Tensor, nodes: int, ranks_per_node: int, bits: int,
                      block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Bit-identical to the reference's ``swizzled_quantize``."""
    _ref.check_bits_and_block_size(bits, block_size)
    chunk = check_swizzle_input(x_flat, nodes, ranks_per_node)
    order = torch.tensor(qgz_chunk_order(nodes, ranks_per_node), device=x_flat.device)
    return quantize_chunks(x_flat.view(-1, chunk)[order], bits, block_size)


def dequantize_chunks(data: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
                      numel: int, dtype: torch.dtype,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bit-identical to the reference's: one fp32 product per element (into ``out`` if given)."""
    rows = _ref.check_dequantize_input(data, scales, bits, block_size, numel, dtype, out)
    nblocks = scales.shape[1]
    q = codes_fp32(data, bits).view(rows, nblocks, block_size).mul_(scales.unsqueeze(-1))
    if out is None:
        return q.view(rows, -1)[:, :numel].to(dtype)
    out.copy_(q.view(rows, -1)[:, :numel])
    return out


def dequantize_reduce(
    data: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, numel: int,
    out_bits: Optional[int] = None, out_block_size: Optional[int] = None,
    out_dtype: torch.dtype = torch.float32,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """The reference's contract with ``acc += fl(q * s)`` per piece (bound in the module doc)."""
    out_block_size = check_reduce_input(data, scales, bits, block_size, numel, out_bits,
                                        out_block_size, out_dtype)
    pieces, rows, _ = data.shape
    nblocks = scales.shape[2]
    acc = None
    for p in range(pieces):
        term = codes_fp32(data[p], bits).view(rows, nblocks, block_size)
        term.mul_(scales[p].unsqueeze(-1))
        acc = term if acc is None else acc.add_(term)
    acc = acc.view(rows, nblocks * block_size)[:, :numel].contiguous()
    if out_bits is None:
        return acc.to(out_dtype)
    return quantize_chunks(acc, out_bits, out_block_size)
