"""Symmetric block quantization in pure torch: the ground truth the Triton kernels must match.

Format
------
A tensor is flattened and cut into blocks of ``block_size`` elements; the last block is padded with
zeros (any numel works, nothing has to be a multiple of 8 or of a world size). Each block gets one
fp32 scale ``s = absmax / qmax`` (``qmax`` = 127 for INT8, 7 for INT4) and integer codes
``q = round(x / s)`` in ``[-qmax, qmax]``; ``x ~= q * s``.

* INT8: one ``torch.int8`` per element.
* INT4: ``torch.uint8``, two codes per byte: element ``2i`` in the low nibble, ``2i+1`` in the high
  nibble, each a two's complement nibble (-7 ... 7; -8 is never produced).

Arithmetic (the kernels do exactly this, in fp32, so the results are bit-identical)
----------------------------------------------------------------------------------
::

    absmax = max |x|                                      (NaN if any element is NaN)
    ok     = absmax is finite
    scale  = absmax / qmax            (IEEE division)     if ok else NaN
    p      = 2**64 if absmax < 2**-64 else 1              (power of two: x * p is exact)
    inv    = qmax / (absmax * p)      (IEEE division)     if ok and absmax > 0 else 0
    y      = ((x if ok else 0) * p) * inv                  (two fp32 multiplies, in this order)
    q      = round_half_to_even(clamp(y, -qmax, qmax))

The quantizer multiplies by a per-block reciprocal instead of dividing every element: one division
per block instead of one per element keeps the kernels memory-bound. ``p`` exists because
``qmax / absmax`` overflows fp32 when ``absmax`` is below about ``qmax / 3.4e38`` (bf16/fp32
subnormals); scaling such a block by an exact power of two first keeps its codes exact.

Error bound (round-to-nearest), with ``u = 2**-24`` (fp32 unit roundoff) and ``s* = absmax/qmax``
exactly: ``x * p`` is exact, so ``y = (x / s*) (1 + e1)(1 + e2)`` with ``|e| <= u``, and
``|y - x/s*| <= 2 qmax u`` (to first order). Clamping only moves ``y`` towards ``x / s*`` (which
lies in ``[-qmax, qmax]``), rounding moves it by at most 1/2, so ``|q - x/s*| <= 1/2 + 2 qmax u``.
The stored scale ``s = s* (1 + e0)`` and the product ``fl(q * s)`` add ``2 qmax u s*``. Altogether

    |x - dequantized| <= s * (1/2 + 5 * qmax * u)          (fp32 output; 5 covers 2nd-order terms)

plus one rounding of the output dtype (``|out| * 2**-8`` for bf16, ``|out| * 2**-11`` for fp16).

Special values (documented contract, tested)
---------------------------------------------
* An all-zero block has scale 0 and codes 0; it dequantizes to zeros (no 0/0).
* A block holding NaN or +-Inf gets scale NaN and codes 0, so the *whole block* dequantizes to NaN
  (Inf inputs come back as NaN, not Inf). A loss scaler's ``isfinite`` check therefore still sees
  the overflow; finite neighbours in the same block are lost, which does not matter because the
  step is skipped.
* Huge values work: a bf16 block with absmax 1e30 (or bf16's max 3.39e38) has a finite scale and
  round-trips within the bound above. For fp32 inputs within ``qmax`` ulps of fp32's max value the
  product ``q * s`` can round up to Inf.
* Subnormal-only blocks quantize exactly as the formula says (thanks to ``p``). When the scale
  itself is subnormal (absmax < qmax * 2**-126) it carries less than fp32 precision, and the bound
  above gains an absolute ``qmax * 2**-150``.

Stochastic rounding with ``row_keys`` (:func:`quantize_chunks`) replaces the rounding by
``q = floor((fl(y + 384) - 384) + r * 2**-15)``, with 15 counter-based random bits ``r`` per
element from :mod:`.rounding` (one hash per pair of columns), which the C and Triton kernels
compute bit for bit alike. ``E[q]`` is ``y`` rounded to 15 fractional bits (a bias of at most
``2**-16`` of a step) and ``q`` never leaves ``[-qmax, qmax]``; the proofs are in
:mod:`.rounding`. :func:`quantize_blockwise`'s ``generator`` path (reference only) draws 24-bit
``u ~ U[0, 1)`` from torch instead and rounds ``clamp(floor(y + u), -qmax, qmax)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .rounding import check_keys, stochastic_round, uniforms

QMAX = {8: 127, 4: 7}
"""Largest code magnitude per bit width (symmetric: -qmax ... qmax)."""

MIN_BLOCK_SIZE = 32
MAX_BLOCK_SIZE = 4096
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Below this absmax the reciprocal qmax/absmax could overflow fp32; see the module docstring.
_TINY = 2.0**-64
_TINY_SCALE = 2.0**64


@dataclass
class QuantizedTensor:
    """A block-quantized tensor: codes, one fp32 scale per block, and what is needed to undo it."""

    data: torch.Tensor
    """Codes, 1-D: ``int8`` (one per element) or ``uint8`` (INT4, two per byte), padded to whole
    blocks."""
    scales: torch.Tensor
    """fp32 scale per block, 1-D, ``ceil(numel / block_size)`` entries."""
    bits: int
    """4 or 8."""
    block_size: int
    """Elements per block (a power of two in [32, 4096])."""
    numel: int
    """Element count of the original tensor (the padding is not part of it)."""
    dtype: torch.dtype
    """dtype of the original tensor; dequantization returns this by default."""
    shape: torch.Size
    """Shape of the original tensor."""


def check_bits_and_block_size(bits: int, block_size: int) -> None:
    """Raise ``ValueError`` unless bits is 4 or 8 and block_size a power of two in [32, 4096]."""
    if bits not in QMAX:
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if (
        not isinstance(block_size, int)
        or block_size < MIN_BLOCK_SIZE
        or block_size > MAX_BLOCK_SIZE
        or block_size & (block_size - 1)
    ):
        raise ValueError(
            f"block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
            f"got {block_size!r}"
        )


def check_float_dtype(dtype: torch.dtype, what: str) -> None:
    """Raise ``ValueError`` unless dtype is bf16, fp16 or fp32."""
    if dtype not in INPUT_DTYPES:
        raise ValueError(f"{what} must be bfloat16, float16 or float32, got {dtype}")


def quantized_sizes(numel: int, bits: int, block_size: int) -> Tuple[int, int]:
    """Bytes of codes and number of blocks for one row of ``numel`` elements (padded to blocks)."""
    check_bits_and_block_size(bits, block_size)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    nblocks = -(-numel // block_size)
    return nblocks * block_size * bits // 8, nblocks


def check_codes(data: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
                numel: int) -> None:
    """Validate code/scale tensors whose last dims are one row of ``numel`` elements each."""
    nbytes, nblocks = quantized_sizes(numel, bits, block_size)
    want = torch.int8 if bits == 8 else torch.uint8
    if data.dtype != want:
        raise ValueError(f"INT{bits} codes must be {want}, got {data.dtype}")
    if scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32, got {scales.dtype}")
    if data.shape[-1:] != (nbytes,) or scales.shape[-1:] != (nblocks,):
        raise ValueError(
            f"numel={numel}, bits={bits}, block_size={block_size} needs rows of {nbytes} bytes "
            f"and {nblocks} scales, got data {tuple(data.shape)} and scales {tuple(scales.shape)}"
        )
    if data.shape[:-1] != scales.shape[:-1]:
        raise ValueError(
            f"data {tuple(data.shape)} and scales {tuple(scales.shape)} disagree on leading dims"
        )
    if data.device != scales.device:
        raise ValueError(f"data on {data.device} but scales on {scales.device}")


def quantize_blocks(
    x: torch.Tensor, bits: int, *, stochastic: bool = False,
    generator: Optional[torch.Generator] = None, u: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize fp32 blocks ``x (..., block_size)`` -> (int32 codes, fp32 scales ``(...)``).

    ``u`` (fp32, ``x``'s shape, multiples of ``2**-15`` from :func:`.rounding.uniforms`): round
    stochastically as :func:`.rounding.stochastic_round`; otherwise ``stochastic`` draws 24-bit
    uniforms from ``generator`` and rounds ``clamp(floor(y + u))``."""
    qmax = QMAX[bits]
    absmax = x.abs().amax(dim=-1)  # torch.amax propagates NaN
    # Tensor-by-tensor division on purpose: with a Python scalar torch may multiply by a
    # reciprocal instead (two roundings), and the kernels divide exactly (IEEE, one rounding).
    qmax_t = torch.full_like(absmax, qmax)
    ok = torch.isfinite(absmax)
    scale = torch.where(ok, absmax / qmax_t, torch.full_like(absmax, float("nan")))
    p = torch.where(absmax < _TINY, torch.full_like(absmax, _TINY_SCALE), torch.ones_like(absmax))
    usable = ok & (absmax > 0)
    # The division happens only where it is used, so no 0/0 or x/NaN warnings leak into the result.
    denom = torch.where(usable, absmax * p, torch.ones_like(absmax))
    inv = torch.where(usable, qmax_t / denom, torch.zeros_like(absmax))
    xs = torch.where(ok.unsqueeze(-1), x, torch.zeros_like(x))
    y = (xs * p.unsqueeze(-1)) * inv.unsqueeze(-1)
    if u is not None:
        q = stochastic_round(y, u)  # inside [-qmax, qmax] by construction (see .rounding)
    elif stochastic:
        device = y.device if generator is None else generator.device
        u = torch.rand(y.shape, generator=generator, dtype=torch.float32, device=device)
        u = u.to(y.device)
        q = torch.floor(y + u).clamp_(-qmax, qmax)
    else:
        q = torch.round(y.clamp(-qmax, qmax))  # torch.round rounds half to even
    return q.to(torch.int32), scale


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 codes ``(C, n)`` (n even for INT4) -> int8 ``(C, n)`` or packed uint8 ``(C, n/2)``."""
    if bits == 8:
        return q.to(torch.int8)
    lo, hi = q[:, 0::2], q[:, 1::2]
    return ((lo & 0xF) | ((hi & 0xF) << 4)).to(torch.uint8)


def unpack_codes(data: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int32 codes ``(C, n)``."""
    if bits == 8:
        return data.to(torch.int32)
    b = data.to(torch.int32)
    lo = ((b & 0xF) ^ 8) - 8  # sign-extend a two's complement nibble
    hi = ((b >> 4) ^ 8) - 8
    return torch.stack((lo, hi), dim=-1).reshape(b.shape[0], -1)


def _quantize_chunks(x2d, bits, block_size, stochastic=False, generator=None, row_keys=None):
    if x2d.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x2d.shape)}")
    check_float_dtype(x2d.dtype, "input")
    rows, numel = x2d.shape
    nbytes, nblocks = quantized_sizes(numel, bits, block_size)
    x = torch.zeros(rows, nblocks * block_size, dtype=torch.float32, device=x2d.device)
    x[:, :numel] = x2d
    u = None
    if row_keys is not None:
        u = uniforms(check_keys(row_keys, rows).to(x.device), nblocks * block_size)
        u = u.view(rows, nblocks, block_size)
    q, scales = quantize_blocks(
        x.view(rows, nblocks, block_size), bits, stochastic=stochastic, generator=generator, u=u
    )
    return pack_codes(q.view(rows, -1), bits).view(rows, nbytes), scales.view(rows, nblocks)


def quantize_chunks(x2d: torch.Tensor, bits: int, block_size: int,
                    row_keys: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor,
                                                                      torch.Tensor]:
    """Quantize each row of ``x2d (C, n)`` on its own, each row padded to whole blocks.

    Returns ``data (C, nbytes)`` (int8 or packed uint8) and ``scales (C, nblocks)`` fp32, with
    ``(nbytes, nblocks) = quantized_sizes(n, bits, block_size)``. ``row_keys`` (int64, one
    32-bit key per row): round stochastically (:mod:`.rounding`); ``None``: to nearest.
    """
    return _quantize_chunks(x2d, bits, block_size, row_keys=row_keys)


def dequantize_chunks(data: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
                      numel: int, dtype: torch.dtype,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of :func:`quantize_chunks`: ``(C, numel)`` in ``dtype`` (padding dropped),
    written into ``out`` when given."""
    rows = check_dequantize_input(data, scales, bits, block_size, numel, dtype, out)
    nblocks = scales.shape[1]
    q = unpack_codes(data, bits).view(rows, nblocks, block_size).to(torch.float32)
    x = (q * scales.unsqueeze(-1)).view(rows, nblocks * block_size)
    if out is None:
        return x[:, :numel].to(dtype)
    out.copy_(x[:, :numel])
    return out


def check_dequantize_input(data: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
                           numel: int, dtype: torch.dtype, out: Optional[torch.Tensor]) -> int:
    """Every backend's checks of :func:`dequantize_chunks`' arguments; returns the row count."""
    if data.dim() != 2:
        raise ValueError(f"expected 2-D codes, got shape {tuple(data.shape)}")
    check_codes(data, scales, bits, block_size, numel)
    check_float_dtype(dtype, "output dtype")
    rows = scales.shape[0]
    check_out(out, rows, numel, dtype, data.device)
    return rows


def check_out(out, rows: int, numel: int, dtype: torch.dtype, device) -> None:
    """``out`` of a dequantization: None, or a contiguous (rows, numel) tensor of ``dtype``."""
    if out is None:
        return
    if (not isinstance(out, torch.Tensor) or tuple(out.shape) != (rows, numel)
            or out.dtype != dtype or not out.is_contiguous() or out.device != device):
        raise ValueError(
            f"out must be a contiguous ({rows}, {numel}) {dtype} tensor on {device}, got "
            + (f"{tuple(out.shape)} {out.dtype} on {out.device}, contiguous="
               f"{out.is_contiguous()}" if isinstance(out, torch.Tensor) else type(out).__name__)
        )


def quantize_blockwise(x: torch.Tensor, bits: int = 8, block_size: int = 256, *,
                       stochastic: bool = False,
                       generator: Optional[torch.Generator] = None) -> QuantizedTensor:
    """Quantize ``x`` (any shape, bf16/fp16/fp32) block-wise; see the module docstring.

    ``stochastic=True`` rounds stochastically with random numbers from ``generator`` (a CPU
    generator, or one on ``x``'s device), so results are reproducible for a seeded generator.
    """
    check_bits_and_block_size(bits, block_size)
    check_float_dtype(x.dtype, "input")
    data, scales = _quantize_chunks(
        x.reshape(1, -1), bits, block_size, stochastic=stochastic, generator=generator
    )
    return QuantizedTensor(data[0], scales[0], bits, block_size, x.numel(), x.dtype, x.shape)


def dequantize_blockwise(qt: QuantizedTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Back to a tensor of shape ``qt.shape`` in ``dtype`` (default ``qt.dtype``)."""
    out = dequantize_chunks(qt.data.view(1, -1), qt.scales.view(1, -1), qt.bits, qt.block_size,
                            qt.numel, qt.dtype if dtype is None else dtype)
    return out.view(qt.shape)
