"""Stochastic rounding in the Triton kernels: the pair hash of :mod:`.rounding` in uint32
arithmetic, and the rounding and packing of INT4 words with it (used by
:mod:`.triton_kernels`, whose docstring describes the scheme)."""

from __future__ import annotations

import triton
import triton.language as tl

# Stochastic rounding: y + 384 lies in [256, 512), where the fp32 spacing is 2**-15 (.rounding).
_SR_SHIFT = tl.constexpr(384.0)
# INT8: (bits(y + 384) + r + _SR_BIAS) >> 15 = q + 0x8800, whose low byte is q's two's
# complement byte; the bias rides along in the same 3-input integer addition.
_SR_BIAS = tl.constexpr(0x80 << 15)
# INT4 (_sr_words): the constant that turns sum_k (q_k + 0x8780) 16**k into sum_k (q_k + 8) 16**k,
# (8 - 0x8780) * 0x11111111 (mod 2**32), as _PACK_OFFSET does for _pack_words. No bias in the
# additions there, so that the odd column's b + (h >> 17) can be a single LEA.HI.
_SR_PACK_OFFSET = tl.constexpr(0x00000908)
_FLIP_BITS_U32 = tl.constexpr(0x88888888)


@triton.jit
def _sr_bits(y):
    """int32 bits of ``fl(y + 384)``, which hold ``y`` rounded to 15 fractional bits."""
    return (y + _SR_SHIFT).to(tl.int32, bitcast=True)


@triton.jit
def _pair_bits(x):
    """``(r_even, r_odd)`` (int32) of the pair hash ``mix32(j ^ key)`` (lowbias32,
    :func:`.rounding.mix32`), from ``x = j ^ (j >> 16) ^ kk`` with ``kk = key ^ (key >> 16)``:
    that is mix32's first step, with the key's half computed once per row. The last step
    ``h = x ^ (x >> 16)`` is folded in: ``h >> 17 = x >> 17`` and ``h & 0x7FFF = (x ^ (x >> 16))
    & 0x7FFF`` (one 3-input logic instruction). The second multiplier does not fit an int32
    literal, so it is made from its int32 bit pattern."""
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, -2073254261, tl.int32).to(tl.uint32, bitcast=True)
    return ((x ^ (x >> 16)) & 0x7FFF).to(tl.int32, bitcast=True), (x >> 17).to(tl.int32,
                                                                              bitcast=True)


@triton.jit
def _sr_pair(ba, bb, x, BIAS: tl.constexpr):
    """Stochastically rounded codes ``q + 0x8780 + (BIAS >> 15)`` (int32) of columns 2j and
    2j + 1, from their :func:`_sr_bits` ``ba``, ``bb`` and their pair's hash input ``x`` (see
    :func:`_pair_bits`).

    No floor, clamp or conversion: ``(bits + r) >> 15 = q + 0x8780`` already lies in
    ``[-qmax, qmax] + 0x8780`` (proof in :mod:`.rounding`)."""
    ra, rb = _pair_bits(x)
    return (ba + ra + BIAS) >> 15, (bb + rb + BIAS) >> 15


@triton.jit
def _hash_input(j, key):
    """``x`` of :func:`_pair_bits` for pair indices ``j`` (uint32) and a row key (uint32)."""
    return j ^ (j >> 16) ^ (key ^ (key >> 16))


@triton.jit
def _sr_y(x, p, inv, plain):
    """``y`` of :func:`_scaled` without the select of non-finite blocks: their values become
    garbage (NaN bits) that :func:`_sr_words` replaces by code 0 one word at a time, which is
    the code the reference gives them (``y = 0``, ``floor(r 2**-15) = 0``). Under the
    interpreter numpy warns about the ``Inf * 0`` this may compute; the result is discarded."""
    if plain:
        y = x * inv[:, None]
    else:
        y = (x * p[:, None]) * inv[:, None]
    return y


@triton.jit
def _sr_words(b0, b1, b2, b3, b4, b5, b6, b7, okw, words, key):
    """Stochastically rounded INT4 words from nibble-major :func:`_sr_bits` ``b_k`` (``b_k`` of
    word ``w`` of the row, ``words`` its index, is column 8 w + k): components 2m and 2m + 1
    are column pair 4 w + m, so four hashes per word. Words where ``okw`` is False (their
    block is not finite) are zero (codes 0)."""
    # pair 4 w + m is (4 w) ^ m (m < 4), and (4 w + m) >> 16 = (4 w) >> 16: one hash input
    # per word, then an XOR per pair
    x = _hash_input((words * 4).to(tl.uint32), key)
    q0, q1 = _sr_pair(b0, b1, x, 0)
    q2, q3 = _sr_pair(b2, b3, x ^ 1, 0)
    q4, q5 = _sr_pair(b4, b5, x ^ 2, 0)
    q6, q7 = _sr_pair(b6, b7, x ^ 3, 0)
    # the sum of _pack_words in Horner form: one shift-and-add per code (written as _pack_words
    # does it, ptxas turns (s >> 15) << 4k into a shift and a mask, then adds separately)
    w = q7.to(tl.uint32, bitcast=True)
    w = (w << 4) + q6.to(tl.uint32, bitcast=True)
    w = (w << 4) + q5.to(tl.uint32, bitcast=True)
    w = (w << 4) + q4.to(tl.uint32, bitcast=True)
    w = (w << 4) + q3.to(tl.uint32, bitcast=True)
    w = (w << 4) + q2.to(tl.uint32, bitcast=True)
    w = (w << 4) + q1.to(tl.uint32, bitcast=True)
    w = (w << 4) + q0.to(tl.uint32, bitcast=True)
    w = ((w + _SR_PACK_OFFSET) ^ _FLIP_BITS_U32).to(tl.int32, bitcast=True)
    return tl.where(okw, w, 0)
