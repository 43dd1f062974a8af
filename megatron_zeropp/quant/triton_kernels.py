"""Triton kernels for block quantization and qgZ's local steps, bit-identical to the reference.

Every kernel performs the fp32 arithmetic of :mod:`.reference` / :mod:`.qgz_reference` in the same
order, so for round-to-nearest the codes, scales and outputs equal the reference's exactly
(``torch.equal``; NaN positions equal, NaN payloads may differ). What makes that hold:

* one IEEE division per block (``tl.div_rn``; Triton's ``/`` may lower to an approximate division)
  for the scale and the reciprocal, then plain fp32 multiplies per element;
* rounding half to even through the fp32 adder: for ``|y| < 2**22``, ``y + 1.5 * 2**23`` rounds
  ``y`` to an integer in the low mantissa bits, which are then the two's complement code. This is
  the rounding ``torch.round`` does, without an F2I conversion (slow on Hopper); codes go back to
  fp32 the same way, exactly (INT8: ``bits(code + 0x4B400000) - 1.5 * 2**23``; INT4: see
  :func:`_nibble`);
* kernels are compiled with ``enable_fp_fusion=False``, because a contracted ``x * inv + magic``
  would round once where the reference rounds twice; the one deliberate fused multiply-add is the
  dequantize-reduce accumulation ``acc = fma(q, s, acc)``, which the reference defines the same way
  (:func:`.qgz_reference.fma32`);
* a NaN-propagating max for the block absmax, and bf16/fp16 loaded as themselves and widened by
  Triton (bf16 is never reinterpreted as fp16).

Stochastic rounding by row keys (``row_keys`` / ``out_row_keys``) computes the counter-based
hash of :mod:`.rounding` in uint32 arithmetic, one hash per pair of columns (the tile is split
into even and odd columns, or, for INT4, into the 8 nibble-major components, which pair up as
(0, 1), (2, 3), (4, 5), (6, 7)), and rounds with one fp32 addition, one integer addition and one
shift per element (``(bits(y + 384) + r) >> 15``, see :mod:`.rounding`), bit-identical to the
reference. Kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests).

Each program handles one tile of ``G`` consecutive blocks of one row (rows never share a tile), so
a block's absmax is a reduction inside the program and nothing crosses programs. The kernels are
memory-bound except the dequantize-reduce, which is bound by instruction issue (about 40
instructions per output element for 8 INT4 pieces): every instruction per element was counted in
the SASS (see docs/benchmarks.md).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from .qgz_reference import check_reduce_input, check_swizzle_input
from .reference import (
    QMAX,
    check_bits_and_block_size,
    check_dequantize_input,
    check_float_dtype,
    quantized_sizes,
)
from .rounding import check_keys, to_device
from .triton_rounding import (
    _FLIP_BITS_U32,
    _SR_BIAS,
    _hash_input,
    _sr_bits,
    _sr_pair,
    _sr_words,
    _sr_y,
)

# (elements per program, warps per program, FAST, MAXNREG) by kernel, from the H200 sweeps recorded
# in docs/benchmarks.md (32 elements per thread was best, except the dequantize-reduce to a float
# dtype: its interleaving runs out of registers above 16). A program's tile is at least one block.
# FAST: test each tile for the plain case (see _block_params). quantize4 (INT4, the word layout of
# _quantize_words): one warp of 4 blocks, so that no block spans two warps; with the test its
# stochastic rounding ran at 93.7 % of an H200's copy bandwidth against 87.9 % without
# (sweep_int4_tiles.py, 2026-12-06). reduce4 (INT4 in, requantized to INT4 or INT8): 4096 on 4 warps
# (the same 32 per thread in smaller programs) ran 2 points faster than 2048 on 2 on both an H200
# and an H100 for INT4 out; for INT8 out, qgZ's default since 2026-12-06, 1-3 % faster than 2048 on
# 2 on an H100 whole and on 72 % of its SMs, the H200's stand-in (ab_kernels.py, 2026-12-07). reduce
# (INT8 in, requantized) keeps 2048 on 2.
# MAXNREG: the register cap given to ptxas (None: ptxas's own choice, 64 for the reduce4). More
# registers let ptxas hoist more of the pieces' loads ahead of the arithmetic (4 of 8 at 80
# against 2 at 64, static SASS) at the cost of fewer warps per SM.
_CONFIG = {"quantize": (2048, 2, False, None), "quantize4": (1024, 1, True, None),
           "dequantize": (2048, 4, False, None), "reduce": (2048, 2, True, None),
           "reduce4": (4096, 4, True, None), "reduce_cast": (1024, 2, True, None)}
_MAX_GRID_DIM1 = 65535

# Runtime argument of the INT4 unpacking (see _nibble): the bits of 2**23.
_MAGIC23_BITS = 0x4B000000

# The INT4 dequantize-reduce addresses its input in int32 below this many words or scales.
_OFF32_LIMIT = 2**31

# Row offsets are 64-bit, element offsets inside a row 32-bit: a row must stay below this.
_MAX_ROW = 2**31 - 2 * 4096

_FLT_MAX = tl.constexpr(3.4028234663852886e38)
# NaN as bits: Triton compares global constexprs for changes between launches, and NaN != NaN.
_NAN_BITS = tl.constexpr(0x7FC00000)
_TINY = tl.constexpr(2.0**-64)
_TINY_SCALE = tl.constexpr(2.0**64)
_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23
_MAGIC_BITS = tl.constexpr(0x4B400000)  # bits of _MAGIC
_ALL = tl.constexpr(tl.PropagateNan.ALL)
# _pack_words: 8 * 0x11111111 - 0x4B400000 * 0x11111111 (mod 2**32), and 0x88888888.
_PACK_OFFSET = tl.constexpr(0x49488888)


@triton.jit
def _cast_out(v, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> output dtype, rounding to nearest even.

    Under ``TRITON_INTERPRET=1`` Triton's own fp32 -> bf16 cast truncates (the compiled cast is
    the hardware's round-to-nearest-even), so the interpreter gets the rounding spelled out on the
    bits; the compiled kernels keep the native single-instruction cast.
    """
    if INTERPRET and dtype == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)


@triton.jit
def _row_and_tile(ROWS_FIRST: tl.constexpr):
    """(row, tile within the row) of this program; the 2-D grid avoids an integer division."""
    if ROWS_FIRST:
        return tl.program_id(0), tl.program_id(1)
    else:
        return tl.program_id(1), tl.program_id(0)


@triton.jit
def _widen(x, INTERPRET: tl.constexpr):
    """Input values as fp32 (exact for bf16/fp16/fp32).

    Under ``TRITON_INTERPRET=1`` Triton's bf16 -> fp32 cast mangles subnormals, so the interpreter
    widens bf16 on the bits (a bf16 is the top half of an fp32); compiled kernels use the native
    cast, which is that same shift.
    """
    if INTERPRET and x.dtype == tl.bfloat16:
        bits = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _block_params(absmax, QMAX_F: tl.constexpr, FAST: tl.constexpr):
    """Per block ``(ok, scale, p, inv)`` exactly as in the reference (one IEEE division each),
    plus ``plain``: whether every block of the tile is finite with ``p == 1``, the usual case,
    in which the codes need no select and no multiply by ``p`` (checked only if ``FAST``: the
    check is a reduction across warps, with barriers)."""
    ok = absmax <= _FLT_MAX  # False for Inf and NaN
    nan = tl.full(absmax.shape, _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    scale = tl.where(ok, tl.div_rn(absmax, QMAX_F), nan)
    tiny = absmax < _TINY
    p = tl.where(tiny, _TINY_SCALE, 1.0)
    usable = ok & (absmax > 0.0)
    denom = tl.where(usable, absmax * p, 1.0)
    inv = tl.where(usable, tl.div_rn(QMAX_F, denom), 0.0)
    if FAST:
        plain = tl.max((tiny | (absmax != absmax) | (absmax > _FLT_MAX)).to(tl.int32), 0) == 0
    else:
        plain = False
    return ok, scale, p, inv, plain


@triton.jit
def _scaled(x, ok, p, inv, plain):
    """``y = ((x if ok else 0) * p) * inv`` of ``x [G, n]``; in a ``plain`` tile that is
    ``x * inv``."""
    if plain:
        y = x * inv[:, None]
    else:
        xs = tl.where(ok[:, None], x, 0.0)
        y = (xs * p[:, None]) * inv[:, None]
    return y


@triton.jit
def _codes(x, ok, p, inv, plain):
    """int32 whose low bits are the code of each element of ``x [G, n]`` (rounded half to even).

    The reference clamps ``y`` to [-qmax, qmax] first; that is a no-op here: ``|x| <= absmax`` and
    ``inv = fl(qmax / (absmax p))`` give ``|y| <= qmax (1 + 2**-23)``, which rounds to at most
    qmax, so the kernels skip it. In a ``plain`` tile ``(x if ok else 0) * p`` is ``x`` itself.
    """
    return (_scaled(x, ok, p, inv, plain) + _MAGIC).to(tl.int32, bitcast=True)


@triton.jit
def _sr_int8(x, ok, p, inv, plain, t, key, BS: tl.constexpr, G: tl.constexpr):
    """Stochastically rounded INT8 codes of ``x [G, BS]`` (tile t; low byte = code), one hash
    per pair of columns. The bits are made in the load layout and only then split into even
    and odd columns (splitting ``x`` first makes Triton broadcast the block parameters across
    threads, with shuffles)."""
    b = _sr_bits(_scaled(x, ok, p, inv, plain))
    e, o = tl.split(tl.reshape(b, (G, BS // 2, 2)))
    pairs = (t * G + tl.arange(0, G))[:, None] * (BS // 2) + tl.arange(0, BS // 2)[None, :]
    qe, qo = _sr_pair(e, o, _hash_input(pairs.to(tl.uint32), key), _SR_BIAS)
    return tl.reshape(tl.join(qe, qo), (G, BS))


@triton.jit
def _nibble(w, magic_bits, K: tl.constexpr):
    """Code in nibble K (0..4, bits 4K..4K+3) of int32 words ``w``, as exact fp32.

    Flipping bit 3 of a two's complement nibble gives code + 8 (0..15). Put into the bits of
    2**23 (``(w & mask) ^ (bits(2**23) + (8 << 4K))``: the nibble, its bit 3 flipped, OR-ed into
    the bits of 2**23, as the mask and 2**23 share no bits), that makes the float
    ``2**23 + (code + 8) * 16**K``; bits above 19 would reach the exponent, hence K <= 4. One
    fused multiply-add by ``16**-K`` and a constant then yields the code: the product and the
    result are exact, so its single rounding changes nothing. That is one LOP3 and one FFMA per
    code, no integer-to-float conversion and no per-word flip.

    ``magic_bits`` (0x4B000000) is a kernel argument, not a literal: with a literal the compiler
    folds the constant into the immediate of a second logic instruction (the LOP3 takes one
    immediate, the mask); with a run-time ``magic_bits + (8 << 4K)`` (computed once per program)
    it stays one ``(w & imm) ^ reg`` per code.
    """
    t = (w & (0xF << (4 * K))) ^ (magic_bits + (8 << (4 * K)))
    return tl.fma(t.to(tl.float32, bitcast=True), 1.0 / (1 << (4 * K)),
                  -(8388608.0 / (1 << (4 * K)) + 8.0))


@triton.jit
def _unpack_words(w, magic_bits):
    """The 8 INT4 codes of int32 words ``w`` as fp32, nibble-major: ``c_k`` is element 8i+k."""
    v = w >> 12  # nibbles 5..7 move to nibble positions 2..4
    return (_nibble(w, magic_bits, 0), _nibble(w, magic_bits, 1), _nibble(w, magic_bits, 2),
            _nibble(w, magic_bits, 3), _nibble(w, magic_bits, 4), _nibble(v, magic_bits, 2),
            _nibble(v, magic_bits, 3), _nibble(v, magic_bits, 4))


@triton.jit
def _interleave8(c0, c1, c2, c3, c4, c5, c6, c7):
    """Nibble-major ``c_k [G, W]`` -> ``[G, 8 W]`` with ``c_k[g, i]`` at column ``8 i + k``.

    ``tl.join`` adds a new minor dimension, so the most significant bit of k is joined first and
    the result is indexed ``[g, i, k2, k1, k0]`` with ``k = 4 k2 + 2 k1 + k0``.
    """
    d = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)),
                tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    return tl.reshape(d, (c0.shape[0], c0.shape[1] * 8))


@triton.jit
def _pack_words(c0, c1, c2, c3, c4, c5, c6, c7):
    """Codes from :func:`_codes` (int32 ``0x4B400000 + code``), nibble-major -> int32 words.

    With ``u = code + 8`` (1..15), ``sum_k u_k 16**k`` is the plain concatenation of the nibbles
    ``u_k``, and XOR 0x88888888 turns each ``u_k`` into the two's complement nibble of its code.
    Since ``c_k = 0x4B400000 + code_k``, that sum is ``sum_k c_k 16**k`` plus a constant
    (mod 2**32): one shift-and-add per code instead of a mask, a shift and an OR.
    """
    w = c0.to(tl.uint32, bitcast=True) + _PACK_OFFSET
    w += c1.to(tl.uint32, bitcast=True) << 4
    w += c2.to(tl.uint32, bitcast=True) << 8
    w += c3.to(tl.uint32, bitcast=True) << 12
    w += c4.to(tl.uint32, bitcast=True) << 16
    w += c5.to(tl.uint32, bitcast=True) << 20
    w += c6.to(tl.uint32, bitcast=True) << 24
    w += c7.to(tl.uint32, bitcast=True) << 28
    return (w ^ _FLIP_BITS_U32).to(tl.int32, bitcast=True)


@triton.jit
def _store_scales(scale, row, t, scale_ptr, nblocks_row, G: tl.constexpr, EVEN: tl.constexpr):
    blocks = t * G + tl.arange(0, G)
    ptrs = scale_ptr + row.to(tl.int64) * nblocks_row + blocks
    if EVEN:
        tl.store(ptrs, scale)
    else:
        tl.store(ptrs, scale, mask=blocks < nblocks_row)


@triton.jit
def _store_row_tile(ptr, vals, row, t, row_len, nblocks_row, W: tl.constexpr, G: tl.constexpr,
                    EVEN: tl.constexpr):
    """Store ``vals [G, W]``: W items per block, blocks ``t*G ...`` of a row of ``row_len``."""
    blocks = t * G + tl.arange(0, G)
    offs = blocks[:, None] * W + tl.arange(0, W)[None, :]
    ptrs = ptr + row.to(tl.int64) * row_len + offs
    if EVEN:
        tl.store(ptrs, vals)
    else:
        tl.store(ptrs, vals, mask=(blocks < nblocks_row)[:, None])


@triton.jit
def _load_row_tile(ptr, row, t, row_len, nblocks_row, W: tl.constexpr, G: tl.constexpr,
                   EVEN: tl.constexpr):
    """Load ``[G, W]`` items (W per block) of blocks ``t*G ...`` of a row (missing blocks: 0)."""
    blocks = t * G + tl.arange(0, G)
    offs = blocks[:, None] * W + tl.arange(0, W)[None, :]
    ptrs = ptr + row.to(tl.int64) * row_len + offs
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=(blocks < nblocks_row)[:, None], other=0)


@triton.jit
def _load_scales(scale_ptr, row, t, nblocks_row, G: tl.constexpr, EVEN: tl.constexpr):
    blocks = t * G + tl.arange(0, G)
    ptrs = scale_ptr + row.to(tl.int64) * nblocks_row + blocks
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=blocks < nblocks_row, other=0.0)


@triton.jit
def _split8(v, BS: tl.constexpr, G: tl.constexpr):
    """``v [G, BS]`` -> nibble-major ``c_k [G, BS // 8]``, ``c_k[g, i] = v[g, 8 i + k]``."""
    return _split_k(tl.reshape(v, (G, BS // 8, 2, 2, 2)))  # [g, i, k2, k1, k0]


@triton.jit
def _quantize_store(x, row, t, data_ptr, scale_ptr, nbytes_row, nblocks_row, BITS: tl.constexpr,
                    QMAX_F: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, EVEN: tl.constexpr,
                    FAST: tl.constexpr, keys_ptr, STOCHASTIC: tl.constexpr):
    """Quantize fp32 ``x [G, BS]`` (blocks of tile t of row) and store codes and scales.

    INT4 codes go out as int32 words (``data_ptr`` is the code buffer viewed as int32).
    ``STOCHASTIC``: round with the row's key from ``keys_ptr`` (int64, one per row).
    """
    absmax = tl.reduce(tl.abs(x), 1, _max_nan)
    ok, scale, p, inv, plain = _block_params(absmax, QMAX_F, FAST)
    _store_scales(scale, row, t, scale_ptr, nblocks_row, G, EVEN)
    if STOCHASTIC:
        key = tl.load(keys_ptr + row).to(tl.uint32)
    if BITS == 8:
        if STOCHASTIC:
            codes = _sr_int8(x, ok, p, inv, plain, t, key, BS, G)
        else:
            codes = _codes(x, ok, p, inv, plain)
        # truncation to int8 keeps the low byte: the two's complement code
        _store_row_tile(data_ptr, codes.to(tl.int8), row, t, nbytes_row, nblocks_row, BS, G,
                        EVEN)
    else:
        if STOCHASTIC:
            # split after the per-element float work, as the nearest path does (_sr_int8)
            b0, b1, b2, b3, b4, b5, b6, b7 = _split8(_sr_bits(_sr_y(x, p, inv, plain)), BS, G)
            words = _sr_words(b0, b1, b2, b3, b4, b5, b6, b7, ok[:, None],
                              (t * G + tl.arange(0, G))[:, None] * (BS // 8)
                              + tl.arange(0, BS // 8)[None, :], key)
        else:
            c0, c1, c2, c3, c4, c5, c6, c7 = _split8(_codes(x, ok, p, inv, plain), BS, G)
            words = _pack_words(c0, c1, c2, c3, c4, c5, c6, c7)
        _store_row_tile(data_ptr, words, row, t, nbytes_row // 4, nblocks_row, BS // 8, G, EVEN)


@triton.jit
def _quantize_words(x_ptr, src, row, t, data_ptr, scale_ptr, keys_ptr, n_cols, nbytes_row,
                    nblocks_row, QMAX_F: tl.constexpr, BS: tl.constexpr, G: tl.constexpr,
                    EVEN: tl.constexpr, FAST: tl.constexpr, INTERPRET: tl.constexpr,
                    STOCHASTIC: tl.constexpr):
    """INT4 quantize of tile t of a row, in the layout of its words: the tile is loaded as
    ``x[g, i, k]`` = column ``8 (W (t G + g) + i) + k`` (W = BS // 8 words per block), so a
    thread's 8 consecutive values (the fastest dimension) are one word. Neither g nor i is
    contiguous in memory, and Triton then gives the threads of a warp to the blocks (g)
    first: with G = 4 blocks per warp a thread holds 4 words of one block only (one pair of
    divisions per thread, three shuffles for the absmax). Triton still converts the words (for
    16-byte stores) and the scales through shared memory before storing them."""
    W: tl.constexpr = BS // 8
    words = (t * G + tl.arange(0, G))[:, None] * W + tl.arange(0, W)[None, :]  # [G, W]
    cols = words[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    ptrs = x_ptr + src.to(tl.int64) * n_cols + cols
    if EVEN:
        x = _widen(tl.load(ptrs), INTERPRET)
    else:
        x = _widen(tl.load(ptrs, mask=cols < n_cols, other=0.0), INTERPRET)
    absmax = tl.reduce(tl.reduce(tl.abs(x), 2, _max_nan), 1, _max_nan)
    ok, scale, p, inv, plain = _block_params(absmax, QMAX_F, FAST)
    _store_scales(scale, row, t, scale_ptr, nblocks_row, G, EVEN)
    inv3 = inv[:, None, None]
    p3 = p[:, None, None]
    if STOCHASTIC:
        key = tl.load(keys_ptr + row).to(tl.uint32)
        if plain:
            y = x * inv3
        else:
            y = (x * p3) * inv3
        b = tl.reshape(_sr_bits(y), (G, W, 2, 2, 2))
        b0, b1, b2, b3, b4, b5, b6, b7 = _split_k(b)
        vals = _sr_words(b0, b1, b2, b3, b4, b5, b6, b7, ok[:, None], words, key)
    else:
        if plain:
            y = x * inv3
        else:
            y = (tl.where(ok[:, None, None], x, 0.0) * p3) * inv3
        c = tl.reshape((y + _MAGIC).to(tl.int32, bitcast=True), (G, W, 2, 2, 2))
        c0, c1, c2, c3, c4, c5, c6, c7 = _split_k(c)
        vals = _pack_words(c0, c1, c2, c3, c4, c5, c6, c7)
    ptrs = data_ptr + row.to(tl.int64) * (nbytes_row // 4) + words
    if EVEN:
        tl.store(ptrs, vals)
    else:
        tl.store(ptrs, vals, mask=words < nblocks_row * W)


@triton.jit
def _split_k(c):
    """``c [.., .., 2, 2, 2]`` (k = 4 k2 + 2 k1 + k0) -> its 8 components c_k."""
    e, o = tl.split(c)  # k0 = 0, 1
    e0, e1 = tl.split(e)  # k1
    o0, o1 = tl.split(o)
    c0, c4 = tl.split(e0)  # k2
    c2, c6 = tl.split(e1)
    c1, c5 = tl.split(o0)
    c3, c7 = tl.split(o1)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _quantize_rows_kernel(x_ptr, data_ptr, scale_ptr, keys_ptr, n_cols, nbytes_row,
                          nblocks_row, NODES: tl.constexpr, RANKS_PER_NODE: tl.constexpr,
                          SWIZZLE: tl.constexpr, ROWS_FIRST: tl.constexpr,
                          BITS: tl.constexpr, QMAX_F: tl.constexpr, BS: tl.constexpr,
                          G: tl.constexpr, EVEN: tl.constexpr, FAST: tl.constexpr,
                          INTERPRET: tl.constexpr, STOCHASTIC: tl.constexpr):
    row, t = _row_and_tile(ROWS_FIRST)
    if SWIZZLE:
        # send position row = j' * K + k' reads chunk k' * N + j' (qgz_reference docstring);
        # K and N are compile-time constants so this is no run-time division
        src = (row % NODES) * RANKS_PER_NODE + row // NODES
    else:
        src = row
    if BITS == 4:
        _quantize_words(x_ptr, src, row, t, data_ptr, scale_ptr, keys_ptr, n_cols, nbytes_row,
                        nblocks_row, QMAX_F, BS, G, EVEN, FAST, INTERPRET, STOCHASTIC)
    else:
        cols = (t * G + tl.arange(0, G))[:, None] * BS + tl.arange(0, BS)[None, :]
        ptrs = x_ptr + src.to(tl.int64) * n_cols + cols
        if EVEN:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=cols < n_cols, other=0.0)
        _quantize_store(_widen(x, INTERPRET), row, t, data_ptr, scale_ptr, nbytes_row,
                        nblocks_row, BITS, QMAX_F, BS, G, EVEN, FAST, keys_ptr, STOCHASTIC)


@triton.jit
def _dequantize_int8(data_ptr, row, t, nbytes_row, nblocks_row, BS: tl.constexpr,
                     G: tl.constexpr, EVEN: tl.constexpr):
    """INT8 codes of a tile as exact fp32 ``[G, BS]`` (via the 1.5 * 2**23 trick, no I2F)."""
    q = _load_row_tile(data_ptr, row, t, nbytes_row, nblocks_row, BS, G, EVEN)
    return (q.to(tl.int32) + _MAGIC_BITS).to(tl.float32, bitcast=True) - _MAGIC


@triton.jit
def _dequantize_rows_kernel(data_ptr, scale_ptr, out_ptr, n_cols, nbytes_row, nblocks_row,
                            magic_bits, ROWS_FIRST: tl.constexpr, BITS: tl.constexpr,
                            BS: tl.constexpr, G: tl.constexpr, EVEN: tl.constexpr,
                            INTERPRET: tl.constexpr):
    row, t = _row_and_tile(ROWS_FIRST)
    s = _load_scales(scale_ptr, row, t, nblocks_row, G, EVEN)[:, None]
    if BITS == 8:
        v = _dequantize_int8(data_ptr, row, t, nbytes_row, nblocks_row, BS, G, EVEN) * s
    else:
        w = _load_row_tile(data_ptr, row, t, nbytes_row // 4, nblocks_row, BS // 8, G, EVEN)
        c0, c1, c2, c3, c4, c5, c6, c7 = _unpack_words(w, magic_bits)
        v = _interleave8(c0 * s, c1 * s, c2 * s, c3 * s, c4 * s, c5 * s, c6 * s, c7 * s)
    cols = (t * G + tl.arange(0, G))[:, None] * BS + tl.arange(0, BS)[None, :]
    ptrs = out_ptr + row.to(tl.int64) * n_cols + cols
    v = _cast_out(v, out_ptr.dtype.element_ty, INTERPRET)
    if EVEN:
        tl.store(ptrs, v)
    else:
        tl.store(ptrs, v, mask=cols < n_cols)


@triton.jit
def _finish_reduce(acc, row, t, n_cols, out_data_ptr, out_scale_ptr, out_ptr, nbytes_out,
                   nblocks_out, OUT_BITS: tl.constexpr, OUT_QMAX_F: tl.constexpr,
                   OUT_BS: tl.constexpr, TILE: tl.constexpr, EVEN: tl.constexpr,
                   INTERPRET: tl.constexpr, FAST: tl.constexpr, keys_ptr,
                   STOCHASTIC: tl.constexpr):
    """Cast or requantize the fp32 sums ``acc [TILE // B, B]`` (row-major over the tile)."""
    cols = t * TILE + tl.reshape(tl.arange(0, TILE), acc.shape)
    if not EVEN:
        # Input padding (and padding of a NaN-scaled block) must not leak into output blocks.
        acc = tl.where(cols < n_cols, acc, 0.0)
    if OUT_BITS == 0:
        ptrs = out_ptr + row.to(tl.int64) * n_cols + cols
        v = _cast_out(acc, out_ptr.dtype.element_ty, INTERPRET)
        if EVEN:
            tl.store(ptrs, v)
        else:
            tl.store(ptrs, v, mask=cols < n_cols)
    else:
        GO: tl.constexpr = TILE // OUT_BS
        _quantize_store(tl.reshape(acc, (GO, OUT_BS)), row, t, out_data_ptr, out_scale_ptr,
                        nbytes_out, nblocks_out, OUT_BITS, OUT_QMAX_F, OUT_BS, GO, EVEN, FAST,
                        keys_ptr, STOCHASTIC)


@triton.jit
def _dequantize_reduce_kernel(data_ptr, scale_ptr, out_data_ptr, out_scale_ptr, out_ptr,
                              keys_ptr, rows, n_cols, nbytes_in, nblocks_in, nbytes_out,
                              nblocks_out, magic_bits, ROWS_FIRST: tl.constexpr,
                              P: tl.constexpr, IN_BITS: tl.constexpr, IN_BS: tl.constexpr,
                              OUT_BITS: tl.constexpr, OUT_QMAX_F: tl.constexpr,
                              OUT_BS: tl.constexpr, TILE: tl.constexpr, EVEN: tl.constexpr,
                              INTERPRET: tl.constexpr, FAST: tl.constexpr,
                              STOCHASTIC: tl.constexpr, OFF64: tl.constexpr):
    row, t = _row_and_tile(ROWS_FIRST)
    GI: tl.constexpr = TILE // IN_BS
    if IN_BITS == 8:
        acc = tl.zeros((GI, IN_BS), tl.float32)
        # Unrolled so that the P pieces' loads can all be in flight; summed in piece order.
        for p in tl.static_range(P):
            s = _load_scales(scale_ptr, p * rows + row, t, nblocks_in, GI, EVEN)
            q = _dequantize_int8(data_ptr, p * rows + row, t, nbytes_in, nblocks_in, IN_BS, GI,
                                 EVEN)
            acc = tl.fma(q, s[:, None], acc)  # one rounding per piece, as the reference
        _finish_reduce(acc, row, t, n_cols, out_data_ptr, out_scale_ptr, out_ptr, nbytes_out,
                       nblocks_out, OUT_BITS, OUT_QMAX_F, OUT_BS, TILE, EVEN, INTERPRET, FAST,
                       keys_ptr, STOCHASTIC)
    else:
        # INT4: eight nibble-major accumulators, a0[g, i] for element 8i of block g, and so on.
        W: tl.constexpr = IN_BS // 8
        a0 = tl.zeros((GI, W), tl.float32)
        a1 = a0
        a2 = a0
        a3 = a0
        a4 = a0
        a5 = a0
        a6 = a0
        a7 = a0
        # Piece p's row is p * rows + row. Offsets are made once for piece 0 and advanced by a
        # uniform stride per piece, in int32 unless the input has 2**31 words or scales
        # (OFF64): no 64-bit row address per piece.
        blocks = t * GI + tl.arange(0, GI)
        if OFF64:
            r0 = row.to(tl.int64)
            nr = rows.to(tl.int64)
        else:
            r0 = row
            nr = rows
        woff = r0 * (nbytes_in // 4) + (blocks[:, None] * W + tl.arange(0, W)[None, :])
        soff = r0 * nblocks_in + blocks
        for p in tl.static_range(P):
            if p > 0:
                woff += nr * (nbytes_in // 4)
                soff += nr * nblocks_in
            if EVEN:
                s = tl.load(scale_ptr + soff)[:, None]
                w = tl.load(data_ptr + woff)
            else:
                s = tl.load(scale_ptr + soff, mask=blocks < nblocks_in, other=0.0)[:, None]
                w = tl.load(data_ptr + woff, mask=(blocks < nblocks_in)[:, None], other=0)
            c0, c1, c2, c3, c4, c5, c6, c7 = _unpack_words(w, magic_bits)
            # one rounding per piece (a fused multiply-add), as the reference
            a0 = tl.fma(c0, s, a0)
            a1 = tl.fma(c1, s, a1)
            a2 = tl.fma(c2, s, a2)
            a3 = tl.fma(c3, s, a3)
            a4 = tl.fma(c4, s, a4)
            a5 = tl.fma(c5, s, a5)
            a6 = tl.fma(c6, s, a6)
            a7 = tl.fma(c7, s, a7)
        if OUT_BITS == 4 and OUT_BS == IN_BS and EVEN:
            # Requantize without leaving the nibble-major layout (stochastic rounding too: the
            # components pair up as the hash needs).
            m = tl.maximum(tl.maximum(tl.maximum(tl.abs(a0), tl.abs(a1), propagate_nan=_ALL),
                                      tl.maximum(tl.abs(a2), tl.abs(a3), propagate_nan=_ALL),
                                      propagate_nan=_ALL),
                           tl.maximum(tl.maximum(tl.abs(a4), tl.abs(a5), propagate_nan=_ALL),
                                      tl.maximum(tl.abs(a6), tl.abs(a7), propagate_nan=_ALL),
                                      propagate_nan=_ALL),
                           propagate_nan=_ALL)
            absmax = tl.reduce(m, 1, _max_nan)
            ok, scale, pp, inv, plain = _block_params(absmax, OUT_QMAX_F, FAST)
            _store_scales(scale, row, t, out_scale_ptr, nblocks_out, GI, EVEN)
            if STOCHASTIC:
                key = tl.load(keys_ptr + row).to(tl.uint32)
                words = _sr_words(
                    _sr_bits(_sr_y(a0, pp, inv, plain)), _sr_bits(_sr_y(a1, pp, inv, plain)),
                    _sr_bits(_sr_y(a2, pp, inv, plain)), _sr_bits(_sr_y(a3, pp, inv, plain)),
                    _sr_bits(_sr_y(a4, pp, inv, plain)), _sr_bits(_sr_y(a5, pp, inv, plain)),
                    _sr_bits(_sr_y(a6, pp, inv, plain)), _sr_bits(_sr_y(a7, pp, inv, plain)),
                    ok[:, None],
                    (t * GI + tl.arange(0, GI))[:, None] * W + tl.arange(0, W)[None, :], key)
            else:
                words = _pack_words(
                    _codes(a0, ok, pp, inv, plain), _codes(a1, ok, pp, inv, plain),
                    _codes(a2, ok, pp, inv, plain), _codes(a3, ok, pp, inv, plain),
                    _codes(a4, ok, pp, inv, plain), _codes(a5, ok, pp, inv, plain),
                    _codes(a6, ok, pp, inv, plain), _codes(a7, ok, pp, inv, plain))
            _store_row_tile(out_data_ptr, words, row, t, nbytes_out // 4, nblocks_out, W, GI,
                            EVEN)
        else:
            acc = _interleave8(a0, a1, a2, a3, a4, a5, a6, a7)
            _finish_reduce(acc, row, t, n_cols, out_data_ptr, out_scale_ptr, out_ptr,
                           nbytes_out, nblocks_out, OUT_BITS, OUT_QMAX_F, OUT_BS, TILE, EVEN,
                           INTERPRET, FAST, keys_ptr, STOCHASTIC)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _config(kind: str, block_size: int,
            tuning: dict) -> Tuple[int, int, bool, Optional[int]]:
    """(tile, num_warps, fast, maxnreg) for a kernel: defaults from _CONFIG, overridden by
    ``tuning``."""
    unknown = set(tuning) - {"tile", "num_warps", "fast", "maxnreg"}
    if unknown:
        raise ValueError(f"unknown tuning options {sorted(unknown)}")
    tile, num_warps, fast, maxnreg = _CONFIG[kind]
    tile = tuning.get("tile", tile)
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two, got {tile}")
    maxnreg = tuning.get("maxnreg", maxnreg)
    if maxnreg is not None and not 24 <= maxnreg <= 255:
        raise ValueError(f"maxnreg must be None or in [24, 255], got {maxnreg}")
    return (max(tile, block_size), tuning.get("num_warps", num_warps), tuning.get("fast", fast),
            maxnreg)


def _launch_options(num_warps: int, maxnreg: Optional[int]) -> dict:
    """Compile options of a launch. No fp contraction (see the module docstring); ``maxnreg``
    only where one is set, so that ptxas's own choice is compiled with the options it had
    before the cap existed."""
    options = {"num_warps": num_warps, "enable_fp_fusion": False}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return options


def _reduce_kind(bits: int, out_bits: Optional[int]) -> str:
    """The _CONFIG entry of a dequantize-reduce of ``bits`` input to ``out_bits`` (None: a
    float dtype)."""
    return "reduce_cast" if out_bits is None else "reduce4" if bits == 4 else "reduce"


def _grid(rows: int, tiles_per_row: int) -> Tuple[Tuple[int, int], bool]:
    """2-D launch grid; the larger extent goes on axis 0 (grid axis 1 stops at 65535)."""
    if tiles_per_row <= _MAX_GRID_DIM1:
        return (rows, tiles_per_row), True
    if rows <= _MAX_GRID_DIM1:
        return (tiles_per_row, rows), False
    raise ValueError(f"{rows} rows of {tiles_per_row} tiles each exceed the launch grid")


def _check_row_length(n: int) -> None:
    if n > _MAX_ROW:
        raise ValueError(f"rows longer than {_MAX_ROW} elements are not supported, got {n}")


def _code_dtype(bits: int) -> torch.dtype:
    return torch.int8 if bits == 8 else torch.uint8


def _kernel_codes(data: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes as the kernels address them: int8 as is, INT4 bytes as int32 words (8 codes each).

    Rows of INT4 codes are whole blocks of >= 32 codes, so a row is a multiple of 16 bytes.
    """
    data = data.contiguous()
    if bits == 8:
        return data
    if data.storage_offset() % 4:
        data = data.clone()  # a word view needs 4-byte alignment; same values, new storage
    return data.view(torch.int32)


def _keys_arg(keys, rows: int, device, fallback: torch.Tensor):
    """(pointer argument, STOCHASTIC) for optional row keys; without keys a placeholder
    tensor is passed (never read)."""
    if keys is None:
        return fallback, False
    return to_device(check_keys(keys, rows), device).contiguous(), True


def _launch_quantize(src, rows, n, bits, block_size, nodes, ranks_per_node, swizzle, tuning,
                     row_keys=None):
    nbytes, nblocks = quantized_sizes(n, bits, block_size)
    data = torch.empty(rows, nbytes, dtype=_code_dtype(bits), device=src.device)
    scales = torch.empty(rows, nblocks, dtype=torch.float32, device=src.device)
    if rows == 0 or nblocks == 0:
        return data, scales
    _check_row_length(n)
    tile, num_warps, fast, maxnreg = _config("quantize" if bits == 8 else "quantize4", block_size,
                                             tuning)
    grid, rows_first = _grid(rows, -(-n // tile))
    keys, stochastic = _keys_arg(row_keys, rows, src.device, scales)
    _quantize_rows_kernel[grid](
        src, _kernel_codes(data, bits), scales, keys, n, nbytes, nblocks, NODES=nodes,
        RANKS_PER_NODE=ranks_per_node, SWIZZLE=swizzle, ROWS_FIRST=rows_first, BITS=bits,
        QMAX_F=float(QMAX[bits]), BS=block_size, G=tile // block_size, EVEN=n % tile == 0,
        FAST=fast, INTERPRET=_interpreting(), STOCHASTIC=stochastic,
        **_launch_options(num_warps, maxnreg),
    )
    return data, scales


def quantize_chunks(x2d: torch.Tensor, bits: int, block_size: int,
                    row_keys: Optional[torch.Tensor] = None,
                    **tuning) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`.reference.quantize_chunks` (``row_keys``: stochastic rounding).

    ``tuning`` (benchmarks only): ``tile`` (elements per program), ``num_warps``, ``fast``,
    ``maxnreg`` (see ``_CONFIG``).
    """
    check_bits_and_block_size(bits, block_size)
    if x2d.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x2d.shape)}")
    check_float_dtype(x2d.dtype, "input")
    rows, n = x2d.shape
    return _launch_quantize(x2d.contiguous(), rows, n, bits, block_size, 1, 1, False, tuning,
                            row_keys)


def swizzled_quantize(x_flat: torch.Tensor, nodes: int, ranks_per_node: int, bits: int,
                      block_size: int, row_keys: Optional[torch.Tensor] = None,
                      **tuning) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`.qgz_reference.swizzled_quantize`: reorder and quantize in one pass."""
    check_bits_and_block_size(bits, block_size)
    chunk = check_swizzle_input(x_flat, nodes, ranks_per_node)
    return _launch_quantize(x_flat.contiguous(), nodes * ranks_per_node, chunk, bits, block_size,
                            nodes, ranks_per_node, True, tuning, row_keys)


def dequantize_chunks(data: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
                      numel: int, dtype: torch.dtype, out: Optional[torch.Tensor] = None,
                      **tuning) -> torch.Tensor:
    """Triton :func:`.reference.dequantize_chunks`."""
    rows = check_dequantize_input(data, scales, bits, block_size, numel, dtype, out)
    if out is None:
        out = torch.empty(rows, numel, dtype=dtype, device=data.device)
    if rows == 0 or numel == 0:
        return out
    _check_row_length(numel)
    tile, num_warps, _, maxnreg = _config("dequantize", block_size, tuning)
    grid, rows_first = _grid(rows, -(-numel // tile))
    _dequantize_rows_kernel[grid](
        _kernel_codes(data, bits), scales.contiguous(), out, numel, data.shape[1], scales.shape[1],
        _MAGIC23_BITS, ROWS_FIRST=rows_first, BITS=bits, BS=block_size,
        G=tile // block_size, EVEN=numel % tile == 0, INTERPRET=_interpreting(),
        **_launch_options(num_warps, maxnreg),
    )
    return out


def dequantize_reduce(
    data: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, numel: int,
    out_bits: Optional[int] = None, out_block_size: Optional[int] = None,
    out_dtype: torch.dtype = torch.float32, out_row_keys: Optional[torch.Tensor] = None,
    **tuning,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Triton :func:`.qgz_reference.dequantize_reduce`: one pass, fp32 sums in piece order
    (``out_row_keys``: stochastic requantization)."""
    out_block_size = check_reduce_input(data, scales, bits, block_size, numel, out_bits,
                                        out_block_size, out_dtype)
    pieces, rows, nbytes_in = data.shape
    nblocks_in = scales.shape[2]
    device = data.device
    if out_bits is None:
        out = torch.empty(rows, numel, dtype=out_dtype, device=device)
        out_data, out_scales = out, out  # unused by the kernel
        nbytes_out = nblocks_out = 0
    else:
        nbytes_out, nblocks_out = quantized_sizes(numel, out_bits, out_block_size)
        out_data = torch.empty(rows, nbytes_out, dtype=_code_dtype(out_bits), device=device)
        out_scales = torch.empty(rows, nblocks_out, dtype=torch.float32, device=device)
        out = out_data  # unused by the kernel
    if rows > 0 and numel > 0:
        _check_row_length(numel)
        tile, num_warps, fast, maxnreg = _config(_reduce_kind(bits, out_bits),
                                                 max(block_size, out_block_size), tuning)
        grid, rows_first = _grid(rows, -(-numel // tile))
        keys, stochastic = _keys_arg(out_row_keys if out_bits else None, rows, device,
                                     out_scales)
        _dequantize_reduce_kernel[grid](
            _kernel_codes(data, bits), scales.contiguous(),
            out_data if out_bits is None else _kernel_codes(out_data, out_bits), out_scales, out,
            keys, rows, numel, nbytes_in, nblocks_in, nbytes_out, nblocks_out,
            _MAGIC23_BITS, ROWS_FIRST=rows_first, P=pieces, IN_BITS=bits, IN_BS=block_size,
            OUT_BITS=out_bits or 0, OUT_QMAX_F=float(QMAX[out_bits or 8]), OUT_BS=out_block_size,
            TILE=tile, EVEN=numel % tile == 0, INTERPRET=_interpreting(), FAST=fast,
            STOCHASTIC=stochastic, OFF64=max(data.numel() // 4, scales.numel()) >= _OFF32_LIMIT,
            **_launch_options(num_warps, maxnreg),
        )
    if out_bits is None:
        return out
    return out_data, out_scales
