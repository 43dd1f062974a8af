/* Single-pass CPU kernels for the block quantizer and qgZ's dequantize-reduce.
 *
 * The arithmetic is the reference's (megatron_zeropp/quant/reference.py and qgz_reference.py),
 * operation for operation, so every result is bit-identical to it:
 *   - scale = absmax / qmax and inv = qmax / (absmax * p) are IEEE fp32 divisions,
 *     y = (x * p) * inv two fp32 multiplies, q = rint(clamp(y)) rounds half to even;
 *   - dequantize is one fp32 product q * s per element;
 *   - dequantize-reduce adds each piece with fmaf (one rounding), which is what the reference
 *     emulates in fp64 and what the GPU kernels do.
 * Built with -ffp-contract=off, so the compiler fuses nothing the reference rounds twice.
 * Each block is staged in an L1-sized fp32 buffer: the input is read once, the codes written once.
 * Stochastic rounding (a row key per row, NULL = round to nearest) uses the counter-based hash
 * of megatron_zeropp/quant/rounding.py, one per pair of columns: h = mix32((col >> 1) ^ key),
 * r = h & 0x7fff (even col) or h >> 17 (odd col), q = ((bits(y + 384.0f) + r) >> 15) - 0x8780,
 * which is floor((fl(y + 384) - 384) + r 2^-15) and never leaves [-qmax, qmax] (the proof is in
 * rounding.py): no floor, no clamp, no int/float conversion.
 *
 * Layouts (C order):
 *   codes  (rows, nbytes)   int8, or uint8 with element 2i in the low nibble (INT4); the codes
 *                           read by the dequantizers may have any row stride (rows received
 *                           packed next to their scales are read where they lie)
 *   scales (rows, nblocks)  fp32, contiguous
 *   dtype codes: 0 = fp32, 1 = bf16 (fp16 is converted by the caller).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_BLOCK 4096
#define TINY 0x1p-64f
#define TINY_SCALE 0x1p64f

static inline float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* torch's float -> bfloat16: round to nearest even, every NaN becomes 0x7fc0. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_to_bits(f);
    uint16_t r = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0x7fc0 : r;
}

/* n elements of src (fp32 or bf16) into dst as fp32, zeros up to len. */
static void load_f32(float *dst, const void *src, int dtype, int64_t n, int64_t len) {
    if (dtype == 0) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bits_to_f32((uint32_t)s[i] << 16);
    }
    for (int64_t i = n; i < len; i++) dst[i] = 0.0f;
}

/* lowbias32, as rounding.mix32. */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* Stochastically rounded codes of one block of y (bs even, col0 even: pairs never straddle
 * blocks), each pair of elements from one hash. */
static void round_stochastic(const float *y, int64_t bs, int bits, void *codes, uint32_t key,
                             int64_t col0) {
    const uint32_t pair0 = (uint32_t)(col0 >> 1);
    for (int64_t i = 0; i < bs / 2; i++) {
        const uint32_t h = mix32((pair0 + (uint32_t)i) ^ key);
        /* (bits + r) >> 15 = q + 0x8780 */
        const int32_t lo = (int32_t)((f32_to_bits(y[2 * i] + 384.0f) + (h & 0x7fffu)) >> 15);
        const int32_t hi = (int32_t)((f32_to_bits(y[2 * i + 1] + 384.0f) + (h >> 17)) >> 15);
        if (bits == 8) {
            ((int8_t *)codes)[2 * i] = (int8_t)(lo - 0x8780);
            ((int8_t *)codes)[2 * i + 1] = (int8_t)(hi - 0x8780);
        } else { /* the low nibbles of q + 0x8780 are q's two's complement nibbles */
            ((uint8_t *)codes)[i] = (uint8_t)((lo & 0xf) | ((hi & 0xf) << 4));
        }
    }
}

/* Quantize one block of bs fp32 values; returns its scale. stochastic: round with the hash of
 * (col0 + i) ^ key instead of to nearest. */
static float quantize_block(const float *x, int64_t bs, int bits, void *codes, int stochastic,
                            uint32_t key, int64_t col0) {
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    /* max |x| on the bit patterns: for non-negative floats the integer order is the float order,
     * and NaN / Inf (exponent all ones) compare above every finite value. */
    uint32_t m = 0;
    for (int64_t i = 0; i < bs; i++) {
        uint32_t a = f32_to_bits(x[i]) & 0x7fffffffu;
        m = a > m ? a : m;
    }
    if (m >= 0x7f800000u) { /* NaN or Inf in the block: NaN scale, codes 0 */
        memset(codes, 0, (size_t)(bits == 8 ? bs : bs / 2));
        return NAN;
    }
    const float absmax = bits_to_f32(m);
    const float scale = absmax / qmax;
    if (absmax == 0.0f) {
        memset(codes, 0, (size_t)(bits == 8 ? bs : bs / 2));
        return scale;
    }
    const float p = absmax < TINY ? TINY_SCALE : 1.0f;
    const float inv = qmax / (absmax * p);
    float y[MAX_BLOCK];
    if (p == 1.0f) { /* x * 1 is exact: skip the multiply */
        for (int64_t i = 0; i < bs; i++) y[i] = x[i] * inv;
    } else {
        for (int64_t i = 0; i < bs; i++) y[i] = (x[i] * p) * inv;
    }
    if (stochastic) {
        round_stochastic(y, bs, bits, codes, key, col0);
        return scale;
    }
    for (int64_t i = 0; i < bs; i++) {
        float v = y[i] < -qmax ? -qmax : y[i];
        y[i] = rintf(v > qmax ? qmax : v);
    }
    if (bits == 8) {
        int8_t *c = (int8_t *)codes;
        for (int64_t i = 0; i < bs; i++) c[i] = (int8_t)(int32_t)y[i];
    } else {
        uint8_t *c = (uint8_t *)codes;
        for (int64_t i = 0; i < bs / 2; i++) {
            int32_t lo = (int32_t)y[2 * i], hi = (int32_t)y[2 * i + 1];
            c[i] = (uint8_t)((lo & 0xf) | ((hi & 0xf) << 4));
        }
    }
    return scale;
}

/* Codes of one block as fp32. */
static void decode_block(const void *codes, int bits, int64_t bs, float *dst) {
    if (bits == 8) {
        const int8_t *c = (const int8_t *)codes;
        for (int64_t i = 0; i < bs; i++) dst[i] = (float)c[i];
    } else {
        const int8_t *c = (const int8_t *)codes;
        for (int64_t i = 0; i < bs / 2; i++) {
            int8_t b = c[i];
            dst[2 * i] = (float)(int8_t)((int8_t)(b << 4) >> 4); /* sign-extend the low nibble */
            dst[2 * i + 1] = (float)(int8_t)(b >> 4);
        }
    }
}

/* Row r of the output is x + row_offsets[r] (elements), numel long, padded to whole blocks;
 * keys: one stochastic-rounding key per output row, or NULL (round to nearest). */
void zpp_quantize_rows(const void *x, int dtype, const int64_t *row_offsets, int64_t rows,
                       int64_t numel, int bits, int64_t bs, void *codes, float *scales,
                       const int64_t *keys) {
    const int64_t esize = dtype == 0 ? 4 : 2;
    const int64_t nblocks = (numel + bs - 1) / bs;
    const int64_t block_bytes = bits == 8 ? bs : bs / 2;
    float buf[MAX_BLOCK];
    for (int64_t r = 0; r < rows; r++) {
        const char *src = (const char *)x + row_offsets[r] * esize;
        char *dst = (char *)codes + r * nblocks * block_bytes;
        for (int64_t b = 0; b < nblocks; b++) {
            int64_t n = numel - b * bs < bs ? numel - b * bs : bs;
            load_f32(buf, src + b * bs * esize, dtype, n, bs);
            scales[r * nblocks + b] = quantize_block(buf, bs, bits, dst + b * block_bytes,
                                                     keys != 0, keys ? (uint32_t)keys[r] : 0u,
                                                     b * bs);
        }
    }
}

static void store(void *out, int dtype, int64_t at, const float *v, int64_t n) {
    if (dtype == 0) {
        memcpy((float *)out + at, v, (size_t)n * sizeof(float));
    } else {
        uint16_t *o = (uint16_t *)out + at;
        for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16(v[i]);
    }
}

/* out (rows, numel) in fp32 / bf16 = codes * scale, padding dropped; code rows row_stride bytes
 * apart. */
void zpp_dequantize_rows(const void *codes, int64_t row_stride, const float *scales, int64_t rows,
                         int64_t numel, int bits, int64_t bs, void *out, int out_dtype) {
    const int64_t nblocks = (numel + bs - 1) / bs;
    const int64_t block_bytes = bits == 8 ? bs : bs / 2;
    float buf[MAX_BLOCK];
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nblocks; b++) {
            decode_block((const char *)codes + r * row_stride + b * block_bytes, bits, bs, buf);
            const float s = scales[r * nblocks + b];
            for (int64_t i = 0; i < bs; i++) buf[i] *= s;
            int64_t n = numel - b * bs < bs ? numel - b * bs : bs;
            store(out, out_dtype, r * numel + b * bs, buf, n);
        }
    }
}

/* Sum P pieces codes (P, rows, nbytes; strides piece_stride, row_stride bytes) / scales
 * (P, rows, nblocks) per element, in piece order,
 * acc = fmaf(q, s, acc) from acc = 0. Then either requantize each row at (out_bits, out_bs) into
 * out_codes / out_scales, or (out_bits == 0) store the sums as out_dtype into out (rows, numel).
 * Works in tiles of max(bs, out_bs) elements (a multiple of both: powers of two) so the sums of a
 * tile stay in L1 across the P pieces. */
void zpp_dequantize_reduce(const void *codes, int64_t piece_stride, int64_t row_stride,
                           const float *scales, int64_t pieces, int64_t rows, int64_t numel,
                           int bits, int64_t bs, int out_bits, int64_t out_bs, void *out_codes,
                           float *out_scales, void *out, int out_dtype,
                           const int64_t *out_keys) {
    const int64_t nblocks = (numel + bs - 1) / bs;
    const int64_t block_bytes = bits == 8 ? bs : bs / 2;
    const int64_t tile = out_bits && out_bs > bs ? out_bs : bs;
    const int64_t out_nblocks = out_bits ? (numel + out_bs - 1) / out_bs : 0;
    const int64_t out_block_bytes = out_bits == 8 ? out_bs : out_bs / 2;
    float acc[MAX_BLOCK], q[MAX_BLOCK];
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t t0 = 0; t0 < numel; t0 += tile) {
            const int64_t n = numel - t0 < tile ? numel - t0 : tile;
            for (int64_t i = 0; i < tile; i++) acc[i] = 0.0f;
            for (int64_t p = 0; p < pieces; p++) {
                for (int64_t off = 0; off < n; off += bs) {
                    const int64_t b = (t0 + off) / bs;
                    decode_block((const char *)codes + p * piece_stride + r * row_stride +
                                     b * block_bytes, bits, bs, q);
                    const float s = scales[(p * rows + r) * nblocks + b];
                    float *a = acc + off;
                    for (int64_t i = 0; i < bs; i++) a[i] = fmaf(q[i], s, a[i]);
                }
            }
            /* The reference sums only [0, numel) and pads the requantized row with zeros; a NaN
             * scale would otherwise leave NaN in the padding. */
            for (int64_t i = n; i < tile; i++) acc[i] = 0.0f;
            if (!out_bits) {
                store(out, out_dtype, r * numel + t0, acc, n);
                continue;
            }
            for (int64_t off = 0; off < n; off += out_bs) {
                const int64_t b = (t0 + off) / out_bs;
                out_scales[r * out_nblocks + b] = quantize_block(
                    acc + off, out_bs, out_bits,
                    (char *)out_codes + (r * out_nblocks + b) * out_block_bytes,
                    out_keys != 0, out_keys ? (uint32_t)out_keys[r] : 0u, t0 + off);
            }
        }
    }
}
