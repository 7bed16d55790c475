/* Decode kernels: y = x · Wᵀ in float32 for a few rows of float32 x (M ≤ 16: one decode step,
 * or a speculative verification) and a packed weight W (N × K codes with their block scales),
 * without writing a dequantized W: decoding reads every weight once per token, so the bytes it
 * reads set its speed, and packed FP4 is 8× fewer bytes than FP32.
 *
 * Equal to minifloat.kernels.reference (dequantize, then an FP32 GEMM) up to FP32 summation
 * order: every weight w = value(code) * scale is the float32 product the reference dequantizes
 * to (one rounding; a decode table scaled by the block scale holds exactly those products), and
 * y[m][n] = Σ_k x[m][k] · w[n][k], accumulated in float32 by fused multiply-adds in a fixed
 * order (the same for any thread count: a row of W is one thread's). NaN and inf codes and
 * scales propagate as the reference's products do. One exception to the products: NVFP4 on
 * AVX-512 sums a block's products x · value unscaled and multiplies the sum by the block's scale
 * (one rounding more per 4 products, still within the float32 summation bound; no multiply per
 * weight), for inputs with |x| ≤ 2^100, where no such sum can overflow.
 *
 * Work per row n of W. AVX-512 (rows_fused512): whole chunks are decoded in registers and
 * multiplied at once with a group of up to seven rows of x (groups of four, a last group of 5-7 rows
 * in two passes over each row of W; more than 7 rows: each group over blocks of 64 rows of W then in
 * L2), one loop per element kind and scale layout; a thread's rows of W in one call, their setup
 * made once, and a scale applied per row or per 512 columns found outside the vector loop. Other
 * paths (row_buffered): by segments of KC columns, the segment's codes decoded (scaled) into a float
 * buffer in L1, then every row of x multiplied with it — on AVX2 with ≤ 4 rows of x, FP4 and FP8
 * decoded in registers instead and multiplied at once (fused256, the same sums: pairs of rows, each
 * pair decoding again). Either way each row of x is summed as it would be alone, so
 * y[m] does not depend on the other rows of the call (a speculative verification's rows equal
 * single steps bit for bit; tests/kernels/test_gemv.py checks every scheme — but a call with a
 * row beyond 2^100 under NVFP4, which takes the scaled path for all its rows). Within a 32-column
 * chunk a decoder may take the columns in its own order (FP4: even columns, then odd: the two nibbles of a byte;
 * NVFP4 in rows_fused512: 128-column chunks, column 8i + q in lane i of the q-th vector); x is
 * copied once per call into the same order, zero beyond K, so the products pair up. Columns past
 * the last whole chunk are decoded one by one from the value table.
 *
 * ISA paths (chosen at run time, `mf_gemv_isas`; each forced in turn by the tests):
 *   2 AVX-512: FP4 by 16-entry vpermps tables (the nibble is the index), FP6 by 32-entry
 *     two-table permutes and a sign xor, FP8 by the float16 converter (E5M2 is float16's high
 *     byte; E4M3 moved into float16's bits, × 2^8 folded into the scale, NaN patched);
 *   1 AVX2 + FMA + F16C: FP4 by 8-entry vpermps of the magnitude and a sign xor, FP6 by four
 *     such tables blended by the code's bits 3 and 4, FP8 by the float16 converter as above;
 *   0 portable C: the value table, element by element.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#define MF_X86 1
#include <immintrin.h>
#else
#define MF_X86 0
#endif

#include "_gemv.h"
#ifdef _OPENMP
#include <omp.h>
#endif

static inline uint32_t code_at(const uint8_t *row, int64_t k, int bits) {
    if (bits == 8) return row[k];
    if (bits == 4) return (row[k >> 1] >> ((k & 1) * 4)) & 15u;
    const uint8_t *g = row + (k >> 2) * 3; /* FP6: 4 codes in a little-endian 24-bit word */
    const uint32_t w = g[0] | (uint32_t)g[1] << 8 | (uint32_t)g[2] << 16;
    return (w >> (6 * (k & 3))) & 63u;
}

static inline float scale_at(const gemv_args_t *a, int64_t t) {
    return a->slut ? a->slut[((const uint8_t *)a->scales)[t]] * a->ts : ((const float *)a->scales)[t];
}

/* sh[h]: the decode scale of columns k0 + 16h … k0 + 16h + 15 of row n (blocks are 16·j wide,
 * or one per row: `mf_gemv` refuses others), for h < ceil(kc / 16). */
static void half_scales(const gemv_args_t *a, int64_t n, int64_t k0, int64_t kc, float *sh) {
    const int64_t t0 = (n / a->br) * a->ngc, nh = (kc + 15) / 16;
    if (a->ngc == 1) {
        const float s = scale_at(a, t0);
        for (int64_t h = 0; h < nh; h++) sh[h] = s;
        return;
    }
    int64_t blk = k0 / a->bc, rem = k0 % a->bc;
    float s = scale_at(a, t0 + blk);
    for (int64_t h = 0; h < nh; h++) {
        sh[h] = s;
        rem += 16;
        if (rem >= a->bc && h + 1 < nh) rem -= a->bc, s = scale_at(a, t0 + ++blk);
    }
}

/* Where column c of a chunk goes in the decoders' order. */
static inline int chunk_pos(int c, int kind, int isa) {
    if (kind != K_FP4 || isa == ISA_PORTABLE) return c;
    if (isa == ISA_AVX512) return (c & 1) ? 16 + c / 2 : c / 2;
    const int h = c >> 4, q = c & 15; /* AVX2: 16-column halves, each even then odd */
    return 16 * h + ((q & 1) ? 8 + q / 2 : q / 2);
}

/* Columns [from, kc) of the segment by the table, element by element, in the chunk order; zero
 * up to the chunk's end (x is zero there too: the products vanish). */
static void decode_tail(const gemv_args_t *a, const uint8_t *row, int64_t k0, int64_t from, int64_t kc,
                        const float *sh, float *w) {
    const int64_t end = (kc + CH - 1) / CH * CH;
    for (int64_t j = from; j < end; j++) {
        const int64_t c0 = j / CH * CH;
        const int p = chunk_pos((int)(j - c0), a->kind, a->isa);
        w[c0 + p] = j < kc ? a->lut[code_at(row, k0 + j, a->bits)] * sh[j / 16] : 0.0f;
    }
}

/* ---- AVX-512 -------------------------------------------------------------------------------- */
#if MF_X86
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

/* 16 bytes from p, zeros past `end` (a load that stays inside its buffer) */
static inline __m128i load16(const uint8_t *p, const uint8_t *end) {
    if (p + 16 <= end) return _mm_loadu_si128((const __m128i *)p);
    uint8_t tmp[16] = {0};
    memcpy(tmp, p, (size_t)(end - p));
    return _mm_loadu_si128((const __m128i *)tmp);
}

/* Chunk decoders: the 32 columns from k (a whole chunk of the segment, sh its half scales
 * from the chunk's first) as two vectors of scaled values, in the chunk order. */
T512 static inline __attribute__((always_inline)) void fp4_512(const uint8_t *row, int64_t k, const float *sh,
                                                               int by16, __m512 t, __m512 *v0, __m512 *v1) {
    /* 16 bytes, one per int32 lane: vpermps reads the low nibble (even columns), then the high */
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + k / 2)));
    if (by16) { /* lanes 0-7: columns 0-15 (the first block), lanes 8-15: columns 16-31 */
        const __m512 s = _mm512_insertf32x8(_mm512_set1_ps(sh[0]), _mm256_set1_ps(sh[1]), 1);
        *v0 = _mm512_mul_ps(_mm512_permutexvar_ps(b, t), s);
        *v1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t), s);
    } else { /* one block: the table scaled once, value by value as the reference multiplies */
        const __m512 ts = _mm512_mul_ps(t, _mm512_set1_ps(sh[0]));
        *v0 = _mm512_permutexvar_ps(b, ts);
        *v1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), ts);
    }
}

/* 32 FP4 columns from k with the scale vector s (lanes 0-7: columns 0-15, lanes 8-15: 16-31). */
T512 static inline __attribute__((always_inline)) void fp4s_512(const uint8_t *row, int64_t k, __m512 s, __m512 t,
                                                                __m512 *v0, __m512 *v1) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + k / 2)));
    *v0 = _mm512_mul_ps(_mm512_permutexvar_ps(b, t), s);
    *v1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t), s);
}

typedef struct { __m512 tlo, thi; __m128i spread; __m512i quad, sh6, sign; const uint8_t *end; } fp6c_t;

/* 16 FP6 codes from their 12 bytes at the start of `raw`, times s */
T512 static inline __attribute__((always_inline)) __m512 fp6_raw512(__m128i raw, __m512 s, const fp6c_t *c6) {
    const __m512i words = _mm512_castsi128_si512(_mm_shuffle_epi8(raw, c6->spread)); /* 4 × 24 bits */
    const __m512i c = _mm512_srlv_epi32(_mm512_permutexvar_epi32(c6->quad, words), c6->sh6);
    const __m512 mag = _mm512_permutex2var_ps(c6->tlo, c, c6->thi);            /* low 5 bits: the magnitude */
    const __m512i sg = _mm512_and_si512(_mm512_slli_epi32(c, 26), c6->sign); /* bit 5: the sign */
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(mag), sg)), s);
}

T512 static inline __attribute__((always_inline)) __m512 fp6_512(const uint8_t *row, int64_t k, float s,
                                                                 const fp6c_t *c6) {
    const uint8_t *p = row + k / 4 * 3; /* 16 codes: 12 bytes */
    __m128i raw;
    if (p + 16 <= c6->end) raw = _mm_loadu_si128((const __m128i *)p);
    else { uint8_t tmp[16] = {0}; memcpy(tmp, p, 12); raw = _mm_loadu_si128((const __m128i *)tmp); }
    return fp6_raw512(raw, _mm512_set1_ps(s), c6);
}

/* 16 E4M3 codes as float32: sign to bit 15 and exponent and mantissa to bits 7-13 make a float16
 * of value × 2^-8 (exact, subnormals too); the codes of NaN patched. */
T512 static inline __attribute__((always_inline)) __m512 e4m3_div256_512(__m128i raw, int nan_free) {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(raw), 7), _mm256_set1_epi16((short)0xBF80));
    if (nan_free) return _mm512_cvtph_ps(h);
    const __mmask16 isnan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x7FFF)), _mm256_set1_epi16(0x3F80));
    return _mm512_mask_mov_ps(_mm512_cvtph_ps(h), isnan, _mm512_set1_ps(NAN));
}

/* FP8 by the float16 converter: E5M2 is float16's high byte (exact, inf and NaN included); E4M3
 * by e4m3_div256_512, the 2^8 folded into the scale (exact unless that overflows: then × 2^8 first). */
T512 static inline __attribute__((always_inline)) __m512 fp8_512(const uint8_t *row, int64_t k, float s, int e5m2,
                                                                 int nan_free) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)(row + k));
    if (e5m2) return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8)), _mm512_set1_ps(s));
    const __m512 v = e4m3_div256_512(raw, nan_free);
    const float s8 = s * 256.0f;
    if (isinf(s8) && !isinf(s)) return _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(256.0f)), _mm512_set1_ps(s));
    return _mm512_mul_ps(v, _mm512_set1_ps(s8));
}

#define DECODE_CHUNK_512(K_, SH_, V0, V1)                                                                 \
    do {                                                                                                \
        if (a->kind == K_FP4) fp4_512(row, K_, SH_, by16, t4, &(V0), &(V1));                            \
        else if (a->kind == K_FP6) V0 = fp6_512(row, K_, (SH_)[0], &c6), V1 = fp6_512(row, K_ + 16, (SH_)[1], &c6); \
        else V0 = fp8_512(row, K_, (SH_)[0], e5m2, a->nan_free), V1 = fp8_512(row, K_ + 16, (SH_)[1], e5m2, a->nan_free);        \
    } while (0)

#define DECODE_SETUP_512                                                                                \
    const __m512 t4 = _mm512_loadu_ps(a->lut);                                                          \
    const int by16 = a->ngc > 1 && a->bc % CH != 0, e5m2 = a->kind == K_E5M2;                           \
    (void)by16, (void)e5m2;                                                                             \
    const fp6c_t c6 = {_mm512_loadu_ps(a->lut), _mm512_loadu_ps(a->lut + 16),                           \
                       _mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1),             \
                       _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),               \
                       _mm512_setr_epi32(0, 6, 12, 18, 0, 6, 12, 18, 0, 6, 12, 18, 0, 6, 12, 18),       \
                       _mm512_set1_epi32((int)0x80000000u), a->data + a->data_bytes}

/* The segment's whole chunks: columns [0, nfull) (a multiple of CH), scaled values into w. */
T512 static void decode512(const gemv_args_t *a, const uint8_t *row, int64_t k0, int64_t nfull, const float *sh,
                           float *w) {
    DECODE_SETUP_512;
    for (int64_t j = 0; j < nfull; j += CH) {
        __m512 v0, v1;
        DECODE_CHUNK_512(k0 + j, sh + j / 16, v0, v1);
        _mm512_storeu_ps(w + j, v0);
        _mm512_storeu_ps(w + j + 16, v1);
    }
}

/* acc[m][0..63] += x[m] · w over the segment's n columns (a multiple of CH) */
T512 static void dot512(const float *xp, int64_t xstride, int64_t M, const float *w, int64_t n, float *acc) {
    for (int64_t m = 0; m < M; m++) {
        const float *x = xp + m * xstride;
        float *ac = acc + m * 64;
        __m512 a0 = _mm512_loadu_ps(ac), a1 = _mm512_loadu_ps(ac + 16);
        __m512 a2 = _mm512_loadu_ps(ac + 32), a3 = _mm512_loadu_ps(ac + 48);
        int64_t j = 0;
        for (; j + 64 <= n; j += 64) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j), _mm512_loadu_ps(w + j), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 16), _mm512_loadu_ps(w + j + 16), a1);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 32), _mm512_loadu_ps(w + j + 32), a2);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 48), _mm512_loadu_ps(w + j + 48), a3);
        }
        if (j < n) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j), _mm512_loadu_ps(w + j), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 16), _mm512_loadu_ps(w + j + 16), a1);
        }
        _mm512_storeu_ps(ac, a0), _mm512_storeu_ps(ac + 16, a1);
        _mm512_storeu_ps(ac + 32, a2), _mm512_storeu_ps(ac + 48, a3);
    }
}

/* ---- AVX2 ----------------------------------------------------------------------------------- */
#define T256 __attribute__((target("avx2,fma,f16c")))

T256 static void decode256(const gemv_args_t *a, const uint8_t *row, int64_t k0, int64_t nfull, const float *sh,
                           float *w) {
    if (a->kind == K_FP4) { /* per 16 columns: 8 bytes; the magnitude by vpermps (low 3 bits), bit 3 the sign */
        const __m256 t = _mm256_loadu_ps(a->lut);
        const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
        for (int64_t j = 0; j < nfull; j += 16) {
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + (k0 + j) / 2)));
            const __m256 ts = _mm256_mul_ps(t, _mm256_set1_ps(sh[j / 16]));
            const __m256i lo = _mm256_xor_si256(_mm256_castps_si256(_mm256_permutevar8x32_ps(ts, b)),
                                                _mm256_and_si256(_mm256_slli_epi32(b, 28), sign));
            const __m256i hi = _mm256_xor_si256(
                _mm256_castps_si256(_mm256_permutevar8x32_ps(ts, _mm256_srli_epi32(b, 4))),
                _mm256_and_si256(_mm256_slli_epi32(b, 24), sign));
            _mm256_storeu_si256((__m256i *)(w + j), lo);
            _mm256_storeu_si256((__m256i *)(w + j + 8), hi);
        }
        return;
    }
    if (a->kind == K_FP6) { /* 8 codes (6 bytes): the magnitude from 4 eight-entry tables by bits 3 and 4, bit 5 the sign */
        const __m256 t0 = _mm256_loadu_ps(a->lut), t1 = _mm256_loadu_ps(a->lut + 8);
        const __m256 t2 = _mm256_loadu_ps(a->lut + 16), t3 = _mm256_loadu_ps(a->lut + 24);
        const __m128i spread = _mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, -1, -1, -1, -1, -1, -1, -1, -1);
        const __m256i pairs = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), sh6 = _mm256_setr_epi32(0, 6, 12, 18, 0, 6, 12, 18);
        const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
        const uint8_t *end = a->data + a->data_bytes;
        for (int64_t j = 0; j < nfull; j += 8) {
            const uint8_t *p = row + (k0 + j) / 4 * 3;
            __m128i raw; /* 8 bytes, 6 of them the codes: read in place unless that passes the end */
            if (p + 8 <= end) raw = _mm_loadl_epi64((const __m128i *)p);
            else { uint8_t tmp[16] = {0}; memcpy(tmp, p, 6); raw = _mm_loadu_si128((const __m128i *)tmp); }
            const __m128i words = _mm_shuffle_epi8(raw, spread);
            const __m256i c = _mm256_srlv_epi32(_mm256_permutevar8x32_epi32(_mm256_castsi128_si256(words), pairs), sh6);
            const __m256 b3 = _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)), b4 = _mm256_castsi256_ps(_mm256_slli_epi32(c, 27));
            const __m256 lo = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, c), _mm256_permutevar8x32_ps(t1, c), b3);
            const __m256 hi = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t2, c), _mm256_permutevar8x32_ps(t3, c), b3);
            const __m256i mag = _mm256_castps_si256(_mm256_blendv_ps(lo, hi, b4));
            const __m256 v = _mm256_castsi256_ps(_mm256_xor_si256(mag, _mm256_and_si256(_mm256_slli_epi32(c, 26), sign)));
            _mm256_storeu_ps(w + j, _mm256_mul_ps(v, _mm256_set1_ps(sh[j / 16])));
        }
        return;
    }
    /* FP8: 8 codes by the float16 converter, as decode512's */
    for (int64_t j = 0; j < nfull; j += 8) {
        const __m128i raw = _mm_loadl_epi64((const __m128i *)(row + k0 + j));
        float s = sh[j / 16];
        __m256 v;
        if (a->kind == K_E5M2) {
            v = _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(raw), 8));
        } else {
            const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(raw), 7), _mm_set1_epi16((short)0xBF80));
            v = _mm256_cvtph_ps(h);
            if (!a->nan_free) {
                const __m128i isnan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7FFF)), _mm_set1_epi16(0x3F80));
                v = _mm256_blendv_ps(v, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cvtepi16_epi32(isnan)));
            }
            const float s8 = s * 256.0f;
            if (isinf(s8) && !isinf(s)) v = _mm256_mul_ps(v, _mm256_set1_ps(256.0f));
            else s = s8;
        }
        _mm256_storeu_ps(w + j, _mm256_mul_ps(v, _mm256_set1_ps(s)));
    }
}

T256 static void dot256(const float *xp, int64_t xstride, int64_t M, const float *w, int64_t n, float *acc) {
    for (int64_t m = 0; m < M; m++) {
        const float *x = xp + m * xstride;
        float *ac = acc + m * 64;
        __m256 a[4];
        for (int q = 0; q < 4; q++) a[q] = _mm256_loadu_ps(ac + 8 * q);
        for (int64_t j = 0; j < n; j += 32)
            for (int q = 0; q < 4; q++)
                a[q] = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 8 * q), _mm256_loadu_ps(w + j + 8 * q), a[q]);
        for (int q = 0; q < 4; q++) _mm256_storeu_ps(ac + 8 * q, a[q]);
    }
}
/* decode256 + dot256 in one pass for R ≤ 2 rows of x (a decode step): the segment's whole chunks
 * (columns 0 … nfull - 1 from k0) decoded in registers and multiplied at once into the rows' partial
 * sums — the same products into the same sums in the same order as the buffer path, so the same
 * bits — with each 16 columns' multiplier `sm` (the scale, × 2^8 for E4M3) found before the vector
 * loop and the NaN patch chosen once. */
T256 static inline __attribute__((always_inline)) void fused256_rows(const gemv_args_t *a, const uint8_t *row,
                                                                    int64_t k0, int64_t nfull, const float *sm,
                                                                    const float *xp, int64_t xs, float *acc,
                                                                    const int R, const int nan_free) {
    __m256 ac[2][4]; /* row r: dot256's four partial sums (lanes 8q … 8q + 7 of every 32 columns) */
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) ac[r][q] = _mm256_loadu_ps(acc + r * 64 + 8 * q);
    if (a->kind == K_FP4) { /* per 16 columns: the even columns' lanes, then the odd ones' (decode256's order) */
        const uint8_t *rk = row + k0 / 2; /* k0: a multiple of KC */
        const __m256 t = _mm256_loadu_ps(a->lut);
        const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
        for (int64_t j0 = 0; j0 < nfull; j0 += 32)
            for (int q = 0; q < 4; q += 2) { /* the 16 columns from j: partial sums q, q + 1 */
                const int64_t j = j0 + 8 * q;
                const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(rk + ((uint64_t)j >> 1))));
                const __m256 ts = _mm256_mul_ps(t, _mm256_set1_ps(sm[(uint64_t)j >> 4]));
                const __m256 lo = _mm256_castsi256_ps(_mm256_xor_si256(
                    _mm256_castps_si256(_mm256_permutevar8x32_ps(ts, b)), _mm256_and_si256(_mm256_slli_epi32(b, 28), sign)));
                const __m256 hi = _mm256_castsi256_ps(
                    _mm256_xor_si256(_mm256_castps_si256(_mm256_permutevar8x32_ps(ts, _mm256_srli_epi32(b, 4))),
                                     _mm256_and_si256(_mm256_slli_epi32(b, 24), sign)));
                for (int r = 0; r < R; r++) {
                    ac[r][q] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + r * xs + j), lo, ac[r][q]);
                    ac[r][q + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + r * xs + j + 8), hi, ac[r][q + 1]);
                }
            }
    } else { /* FP8, 8 codes by the float16 converter */
        const int e5m2 = a->kind == K_E5M2;
        for (int64_t j = 0; j < nfull; j += 32)
            for (int q = 0; q < 4; q++) {
                const __m128i raw = _mm_loadl_epi64((const __m128i *)(row + k0 + j + 8 * q));
                __m256 v;
                if (e5m2) v = _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(raw), 8));
                else {
                    const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(raw), 7), _mm_set1_epi16((short)0xBF80));
                    v = _mm256_cvtph_ps(h);
                    if (!nan_free) {
                        const __m128i isnan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7FFF)), _mm_set1_epi16(0x3F80));
                        v = _mm256_blendv_ps(v, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cvtepi16_epi32(isnan)));
                    }
                }
                v = _mm256_mul_ps(v, _mm256_set1_ps(sm[(j + 8 * q) / 16]));
                for (int r = 0; r < R; r++) ac[r][q] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + r * xs + j + 8 * q), v, ac[r][q]);
            }
    }
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) _mm256_storeu_ps(acc + r * 64 + 8 * q, ac[r][q]);
}

/* fused256_rows for FP4 and FP8 with M ≤ 4 rows of x (mf_gemv passes it no more: beyond, decoding once
 * into the buffer for all rows costs less than once per pair). Returns 0, having done nothing, for an
 * E4M3 scale whose × 2^8 overflows (decode256 then takes the segment, the scale after the 2^8). */
T256 static int fused256(const gemv_args_t *a, const uint8_t *row, int64_t k0, int64_t nfull, const float *sh,
                         const float *xp, int64_t xs, float *acc) {
    float sm[KC / 16];
    const float by = a->kind == K_E4M3 ? 256.0f : 1.0f;
    int over = 0;
    for (int64_t h = 0; h < nfull / 16; h++) {
        sm[h] = sh[h] * by;
        over |= isinf(sm[h]) && !isinf(sh[h]);
    }
    if (over) return 0;
    const int nf = a->kind != K_E4M3 || a->nan_free;
    for (int64_t m0 = 0; m0 < a->M; m0 += 2) { /* by pairs of rows of x, each pair decoding again */
        const float *x = xp + m0 * xs;
        float *ac = acc + m0 * 64;
        if (a->M - m0 == 1) nf ? fused256_rows(a, row, k0, nfull, sm, x, xs, ac, 1, 1) : fused256_rows(a, row, k0, nfull, sm, x, xs, ac, 1, 0);
        else nf ? fused256_rows(a, row, k0, nfull, sm, x, xs, ac, 2, 1) : fused256_rows(a, row, k0, nfull, sm, x, xs, ac, 2, 0);
    }
    return 1;
}
#endif

/* ---- portable ------------------------------------------------------------------------------- */
static void dot_portable(const float *xp, int64_t xstride, int64_t M, const float *w, int64_t n, float *acc) {
    for (int64_t m = 0; m < M; m++) {
        const float *x = xp + m * xstride;
        float *ac = acc + m * 64;
        for (int64_t j = 0; j < n; j += 8)
            for (int q = 0; q < 8; q++) ac[q] += x[j + q] * w[j + q];
    }
}

/* sizeof(gemv_args_t) and where its last field lies: the bindings check that their mirror of it has
 * every field (a missing last field can hide in the padding, so the size alone would not say). */
int64_t mf_gemv_args_size(void) { return (int64_t)sizeof(gemv_args_t); }
int64_t mf_gemv_args_last(void) { return (int64_t)offsetof(gemv_args_t, nan_free); }
/* The most rows of x one call takes (MMAX): gemv.MAX_ROWS must say the same, the bindings check. */
int64_t mf_gemv_max_rows(void) { return MMAX; }

/* Which paths this CPU runs: bit 1 AVX2 + FMA + F16C, bit 2 AVX-512 (F, BW, VL, DQ); bit 0 always. */
int mf_gemv_isas(void) {
    int r = 1 << ISA_PORTABLE;
#if MF_X86
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (avx2) r |= 1 << ISA_AVX2;
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        r |= 1 << ISA_AVX512;
#endif
    return r;
}

/* The 64 partial sums of each row of x, pairwise in a fixed order, into y[m][n]. */
static void finish(const gemv_args_t *a, int64_t n, float *acc) {
    for (int64_t m = 0; m < a->M; m++) {
        float *ac = acc + m * 64;
        for (int width = 32; width >= 1; width /= 2)
            for (int q = 0; q < width; q++) ac[q] += ac[q + width];
        a->y[m * a->N + n] = ac[0];
    }
}

typedef void (*decode_fn)(const gemv_args_t *, const uint8_t *, int64_t, int64_t, const float *, float *);
typedef void (*dot_fn)(const float *, int64_t, int64_t, const float *, int64_t, float *);
typedef int (*fused_fn)(const gemv_args_t *, const uint8_t *, int64_t, int64_t, const float *, const float *, int64_t,
                        float *);

/* Row n of W against every row of x: per segment, decode (whole chunks by `dec`, the rest by the
 * table) into a buffer, then `dot` it with x; or the whole chunks decoded in registers and multiplied
 * at once by `fus` (the same sums in the same order), where it takes the segment. */
static void row_buffered(const gemv_args_t *a, int64_t n, const float *xp, int64_t Kc, decode_fn dec, dot_fn dot,
                         fused_fn fus) {
    float w[KC] __attribute__((aligned(64)));
    float sh[KC / 16];
    float acc[MMAX * 64] __attribute__((aligned(64)));
    memset(acc, 0, (size_t)a->M * 64 * sizeof(float));
    const uint8_t *row = a->data + n * a->row_bytes;
    for (int64_t k0 = 0; k0 < a->K; k0 += KC) {
        const int64_t kc = a->K - k0 < KC ? a->K - k0 : KC, nfull = dec ? kc / CH * CH : 0;
        half_scales(a, n, k0, kc, sh);
        if (fus && fus(a, row, k0, nfull, sh, xp + k0, Kc, acc)) {
            if (nfull < kc) { /* the last, partial chunk through the buffer */
                decode_tail(a, row, k0, nfull, kc, sh, w);
                dot(xp + k0 + nfull, Kc, a->M, w + nfull, CH, acc);
            }
            continue;
        }
        if (dec) dec(a, row, k0, nfull, sh, w);
        decode_tail(a, row, k0, nfull, kc, sh, w);
        dot(xp + k0, Kc, a->M, w, (kc + CH - 1) / CH * CH, acc);
    }
    finish(a, n, acc);
}

#if MF_X86

/* One row of x (M = 1, a decode step), row n of W: whole chunks decoded in registers and
 * multiplied at once, their block scales read as they come (blocks 2^lb columns wide; lb = 62:
 * one scale per row); the last, partial chunk by the table. One loop per element kind and
 * scale layout, so the hot loops hold no branch on either. */
#define FMA2(J, V0, V1, A0, A1)                                                                     \
    do {                                                                                            \
        const __m512 v0_ = (V0), v1_ = (V1);                                                        \
        for (int r_ = 0; r_ < R; r_++) {                                                            \
            acc[r_][A0] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + r_ * xs + (J)), v0_, acc[r_][A0]);    \
            acc[r_][A1] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + r_ * xs + (J) + 16), v1_, acc[r_][A1]); \
        }                                                                                           \
    } while (0)
/* Chunks of slot pair SP sum into acc[r][2SP], acc[r][2SP + 1] when a row of W is one pass (NS = 2);
 * in two passes (NS = 1) pass p takes the chunks of slot pair p only, into acc[r][0], acc[r][1]. */
#define USE(SP) (NS == 2 || (SP) == pass)
#define AL(SP) (NS == 2 ? 2 * (SP) : 0)
#define FMA2S(J, V0, V1, SP) FMA2(J, V0, V1, AL(SP), AL(SP) + 1)
#define FUSED_LOOP(DEC)                                                                             \
    do {                                                                                            \
        for (; j + 2 * CH <= nfull; j += 2 * CH) {                                                  \
            __m512 v0, v1, v2, v3;                                                                  \
            if (USE(0)) DEC(j, v0, v1);                                                             \
            if (USE(1)) DEC(j + CH, v2, v3);                                                        \
            if (USE(0)) FMA2S(j, v0, v1, 0);                                                        \
            if (USE(1)) FMA2S(j + CH, v2, v3, 1);                                                   \
        }                                                                                           \
        if (j < nfull) {                                                                            \
            __m512 v0, v1;                                                                          \
            if (USE(0)) {                                                                           \
                DEC(j, v0, v1);                                                                     \
                FMA2S(j, v0, v1, 0);                                                                \
            }                                                                                       \
            j += CH;                                                                                \
        }                                                                                           \
    } while (0)
/* The 16 chunks of the 512 columns from j, two at a time, chunk c decoded by DEC(J, V0, V1, c) (its
 * scale sf[c]), slot pairs as in FUSED_LOOP. */
#define GROUP_CHUNKS(DEC)                                                                           \
    for (int c = 0; c < 16; c += 2) {                                                               \
        __m512 v0, v1, v2, v3;                                                                      \
        if (USE(0)) DEC(j + CH * c, v0, v1, c);                                                     \
        if (USE(1)) DEC(j + CH * c + CH, v2, v3, c + 1);                                            \
        if (USE(0)) FMA2S(j + CH * c, v0, v1, 0);                                                   \
        if (USE(1)) FMA2S(j + CH * c + CH, v2, v3, 1);                                              \
    }
/* the chunk's two half scales (equal unless blocks are 16 columns wide) */
#define S0(J) scale_at(a, t0 + ((J) >> lb))
#define S1(J) (lb == 4 ? scale_at(a, t0 + (((J) + 16) >> lb)) : S0(J))
#define DEC_FP4_ONE(J, V0, V1) do { const float sc_[2] = {S0(J), 0}; fp4_512(row, J, sc_, 0, t4, &(V0), &(V1)); } while (0)
#define DEC_FP4_BY16(J, V0, V1) \
    fp4s_512(row, J, _mm512_insertf32x8(_mm512_set1_ps(S0(J)), _mm256_set1_ps(S1(J)), 1), t4, &(V0), &(V1))
#define DEC_FP6(J, V0, V1) V0 = fp6_512(row, J, S0(J), &c6), V1 = fp6_512(row, (J) + 16, S1(J), &c6)
#define DEC_E5M2(J, V0, V1) V0 = fp8_512(row, J, S0(J), 1, 1), V1 = fp8_512(row, (J) + 16, S1(J), 1, 1)
#define DEC_E4M3(J, V0, V1) V0 = fp8_512(row, J, S0(J), 0, nan_free), V1 = fp8_512(row, (J) + 16, S1(J), 0, nan_free)
/* E4M3 with the chunk's scale × 2^8 given as the vector SV (found outside the loop), the NaN patch by NF */
#define DEC_E4M3_BY(J, V0, V1, NF, SV)                                                              \
    V0 = _mm512_mul_ps(e4m3_div256_512(_mm_loadu_si128((const __m128i *)(row + (J))), NF), SV),     \
    V1 = _mm512_mul_ps(e4m3_div256_512(_mm_loadu_si128((const __m128i *)(row + (J) + 16)), NF), SV)

/* 16 E8M0 scale codes as float32: 2^(c - 127), the bits c << 23 (c = 0: 2^-127, a subnormal;
 * c = 255: NaN), as the E8M0 table holds them. */
T512 static inline __attribute__((always_inline)) __m512 e8m0_512(__m128i raw) {
    const __m512i c = _mm512_cvtepu8_epi32(raw);
    __m512i bits = _mm512_slli_epi32(c, 23);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(c, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(c, _mm512_set1_epi32(255)), _mm512_set1_epi32(0x7FC00000));
    return _mm512_castsi512_ps(bits);
}

/* The 16 chunk scales of the 512 columns from j of the row whose scales start at t0 (blocks 2^lb ≥ 32
 * columns wide), each × `by`, into sf; nonzero where a finite scale × by overflows. MX (E8M0 codes
 * of 32 columns, no tensor scale): the 16 codes decoded at once. */
T512 static inline __attribute__((always_inline)) int group_scales512(const gemv_args_t *a, int64_t t0, int64_t j,
                                                                     int lb, float by, float *sf) {
    if (a->sfmt == SF_E8M0 && lb == 5 && a->ts == 1.0f) {
        const __m512 s = e8m0_512(_mm_loadu_si128((const __m128i *)((const uint8_t *)a->scales + t0 + (j >> 5))));
        const __m512 sb = _mm512_mul_ps(s, _mm512_set1_ps(by)), inf = _mm512_set1_ps(INFINITY);
        _mm512_store_ps(sf, sb);
        return _mm512_cmp_ps_mask(_mm512_abs_ps(sb), inf, _CMP_EQ_OQ) & _mm512_cmp_ps_mask(_mm512_abs_ps(s), inf, _CMP_NEQ_UQ);
    }
    int over = 0;
    for (int c = 0; c < 16; c++) {
        const float s = scale_at(a, t0 + ((j + CH * c) >> lb));
        sf[c] = s * by;
        over |= isinf(sf[c]) && !isinf(s);
    }
    return over;
}

/* One 128-column NVFP4 chunk (rows_fused512's wide loop) against RN ≤ 2 rows of x: per row, each
 * lane's 8 products summed unscaled (even q, odd q: two sums of 4) and the two sums multiplied by
 * the lane's block scale `sv` into acc[r][2h], acc[r][2h + 1] — the same operations in the same
 * order for every row, whatever rows share the call. */
T512 static inline __attribute__((always_inline)) void
nvfp4_rows128(const float *xx, int64_t xs, __m512i b, __m512 t4, __m512 v0, __m512 v1, __m512 sv, __m512 acc[][4],
              int h, const int RN) {
    __m512 p0[2], p1[2];
    for (int r = 0; r < RN; r++) {
        p0[r] = _mm512_mul_ps(_mm512_loadu_ps(xx + r * xs), v0);
        p1[r] = _mm512_mul_ps(_mm512_loadu_ps(xx + r * xs + 16), v1);
    }
    for (int q = 2; q < 8; q += 2) {
        const __m512 w0 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4 * q), t4);
        const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4 * q + 4), t4);
        for (int r = 0; r < RN; r++) {
            p0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xx + r * xs + 16 * q), w0, p0[r]);
            p1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xx + r * xs + 16 * q + 16), w1, p1[r]);
        }
    }
    for (int r = 0; r < RN; r++) {
        acc[r][2 * h] = _mm512_fmadd_ps(p0[r], sv, acc[r][2 * h]);
        acc[r][2 * h + 1] = _mm512_fmadd_ps(p1[r], sv, acc[r][2 * h + 1]);
    }
}

/* Rows n0 … n1 - 1 of W against R ≤ 7 rows of x: what does not depend on the row made once (a row
 * of a small layer is a few hundred cycles of work; its setup cost about as much again).
 * Each row of x has four partial sums, as one row alone has them: acc 0-1 take the chunks of slot
 * pair 0 (the first of each pair of chunks), acc 2-3 those of slot pair 1. R ≤ 4 (NS = 2): all 4R
 * sums in registers, one pass over each row of W. R = 5-7 (NS = 1): two passes, over the chunks of
 * slot pair 0, then of slot pair 1 (the row's codes then in L1), so 2R sums are in registers and
 * every chunk is still decoded once for all R rows. Each sum takes the same chunks in the same order
 * either way, and y = Σ((acc0 + acc1) + (acc2 + acc3)) either way: bit for bit one row's result. */
T512 static inline __attribute__((always_inline)) void
rows_fused512(const gemv_args_t *a, int64_t n0, int64_t n1, const float *xp, int64_t xs, float *y, int lb,
              const uint8_t *scale_end, int wide, const int R) {
    DECODE_SETUP_512;
    const int64_t nfull = a->K / CH * CH;
    const int nan_free = a->nan_free;
    const int NS = R <= 4 ? 2 : 1; /* slot pairs per pass */
    __m512 part[7] = {0};          /* two passes: row r's acc0 + acc1 from pass 0 */
    for (int64_t n = n0; n < n1; n++)
      for (int pass = 0; pass < 3 - NS; pass++) {
        const uint8_t *row = a->data + n * a->row_bytes;
        const int64_t t0 = (a->br == 1 ? n : n / a->br) * a->ngc;
        __m512 acc[7][4]; /* row r of x: acc[r][0 … 2NS - 1] */
        for (int r = 0; r < R; r++)
            for (int q = 0; q < 2 * NS; q++) acc[r][q] = _mm512_setzero_ps();
        int64_t j = 0;
        if (wide) {
            /* NVFP4, 128 columns (64 bytes) at a time: shifting each 32-bit lane by 4q puts the code of
             * column 8i + q in lane i's low nibble, which vpermps reads: 8 lookups, no byte unpacking
             * (the shuffle unit bounds these loops). Lane i's block is i / 2 in every vector, so each
             * lane sums its 8 products unscaled (even q, odd q: two sums of 4) and one scale vector
             * (a permute of 16 decoded scales) multiplies the two sums: s·Σ x·v for Σ x·(v·s), one
             * rounding more per 4 products, no multiply per weight (`nvfp4_rows128`, two rows of x at a
             * time). x is in the same order, and |x| ≤ 2^100 (mf_gemv checks), so no unscaled sum
             * overflows. */
            const uint8_t *sc = (const uint8_t *)a->scales + t0;
            const __m512 ts256 = _mm512_set1_ps(a->ts * 256.0f);
            const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
            const int64_t k128 = a->K / 128 * 128;
            /* one 128-column chunk, the H-th of the 256 whose scales S holds (H a constant: each half's
             * sums, acc[r][2H] and acc[r][2H + 1], stay in registers) */
#define NVFP4_CHUNK128(H)                                                                                           \
    do {                                                                                                            \
        const __m512 sv = _mm512_permutexvar_ps(_mm512_add_epi32(pairs, _mm512_set1_epi32(8 * (H))), S);            \
        const __m512i b = _mm512_loadu_si512((const void *)(row + (j + 128 * (H)) / 2));                            \
        const float *xx = xp + j + 128 * (H);                                                                       \
        const __m512 v0 = _mm512_permutexvar_ps(b, t4), v1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t4);     \
        /* rows 3-7 by twos: the lookups made again (their sums would not fit beside the first two's) */            \
        _Pragma("GCC unroll 4") for (int r0_ = 0; r0_ < R; r0_ += 2)                                                \
            nvfp4_rows128(xx + r0_ * xs, xs, b, t4, v0, v1, sv, acc + r0_, AL(H) / 2, R - r0_ < 2 ? R - r0_ : 2);    \
    } while (0)
            for (; j + 256 <= k128; j += 256) {
                const __m512 S = _mm512_mul_ps(e4m3_div256_512(load16(sc + (j >> 4), scale_end), 0), ts256);
                if (USE(0)) NVFP4_CHUNK128(0);
                if (USE(1)) NVFP4_CHUNK128(1);
            }
            if (j < k128 && USE(0)) {
                const __m512 S = _mm512_mul_ps(e4m3_div256_512(load16(sc + (j >> 4), scale_end), 0), ts256);
                NVFP4_CHUNK128(0);
            }
#undef NVFP4_CHUNK128
            j = k128;
        }
        if (a->kind == K_FP4 && lb == 4) {
            if (a->sfmt == SF_E4M3) {
                /* NVFP4: 16 scale codes (256 columns) decoded at once, each chunk's pair picked by a permute;
                 * E4M3 × ts = (E4M3 × 2^-8) × (ts × 2^8), exact: ts ≤ FLT_MAX / 2688 by its definition */
                const uint8_t *sc = (const uint8_t *)a->scales + t0;
                const __m512 ts256 = _mm512_set1_ps(a->ts * 256.0f);
                const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
                for (; j + 256 <= nfull; j += 256) {
                    const __m512 S = _mm512_mul_ps(e4m3_div256_512(_mm_loadu_si128((const __m128i *)(sc + (j >> 4))), 0), ts256);
                    for (int c = 0; c < 8; c += 2) {
                        const __m512i i0 = _mm512_add_epi32(pair, _mm512_set1_epi32(2 * c));
                        const __m512i i1 = _mm512_add_epi32(pair, _mm512_set1_epi32(2 * c + 2));
                        __m512 v0, v1, v2, v3;
                        if (USE(0)) fp4s_512(row, j + CH * c, _mm512_permutexvar_ps(i0, S), t4, &v0, &v1);
                        if (USE(1)) fp4s_512(row, j + CH * (c + 1), _mm512_permutexvar_ps(i1, S), t4, &v2, &v3);
                        if (USE(0)) FMA2S(j + CH * c, v0, v1, 0);
                        if (USE(1)) FMA2S(j + CH * c + CH, v2, v3, 1);
                    }
                }
                if (j < nfull) { /* the last, partial group of chunks: its codes read within the scale grid */
                    const __m512 S = _mm512_mul_ps(e4m3_div256_512(load16(sc + (j >> 4), scale_end), 0), ts256);
                    for (int c = 0; j < nfull; j += CH, c++) {
                        if (!USE(0)) continue;
                        __m512 v0, v1;
                        fp4s_512(row, j, _mm512_permutexvar_ps(_mm512_add_epi32(pair, _mm512_set1_epi32(2 * c)), S), t4, &v0, &v1);
                        FMA2S(j, v0, v1, 0);
                    }
                }
            }
            FUSED_LOOP(DEC_FP4_BY16);
        } else if (a->kind == K_FP4) {
            if (a->sfmt == SF_E8M0 && lb == 5) {
                /* MXFP4: 16 scale codes (512 columns) decoded at once, each chunk's broadcast by a permute */
                const uint8_t *sc = (const uint8_t *)a->scales + t0;
                float sf[16] __attribute__((aligned(64)));
                for (; j + 512 <= nfull; j += 512) {
                    /* the scales through memory: each chunk's is a broadcast operand of its table's multiply.
                     * Its own scale line and loop, not group_scales512 / GROUP_CHUNKS: each measured 10-20 %
                     * slower here (the register and code layout of this loop, not their work) */
                    _mm512_store_ps(sf, e8m0_512(_mm_loadu_si128((const __m128i *)(sc + (j >> 5)))));
                    for (int c = 0; c < 16; c += 2) {
                        __m512 ts0 = t4, ts1 = t4;
                        __m512i b0 = _mm512_setzero_si512(), b1 = b0;
                        if (USE(0)) ts0 = _mm512_mul_ps(t4, _mm512_set1_ps(sf[c]));
                        if (USE(1)) ts1 = _mm512_mul_ps(t4, _mm512_set1_ps(sf[c + 1]));
                        if (USE(0)) b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + (j + CH * c) / 2)));
                        if (USE(1)) b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + (j + CH * c + CH) / 2)));
                        if (USE(0)) FMA2S(j + CH * c, _mm512_permutexvar_ps(b0, ts0), _mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), ts0), 0);
                        if (USE(1)) FMA2S(j + CH * c + CH, _mm512_permutexvar_ps(b1, ts1), _mm512_permutexvar_ps(_mm512_srli_epi32(b1, 4), ts1), 1);
                    }
                }
                if (j < nfull) { /* the last, partial group of chunks */
                    _mm512_store_ps(sf, e8m0_512(load16(sc + (j >> 5), scale_end)));
                    for (int c = 0; j < nfull; j += CH, c++) {
                        if (!USE(0)) continue;
                        const __m512 ts = _mm512_mul_ps(t4, _mm512_set1_ps(sf[c]));
                        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + j / 2)));
                        FMA2S(j, _mm512_permutexvar_ps(b, ts), _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), ts), 0);
                    }
                }
            }
            FUSED_LOOP(DEC_FP4_ONE);
        } else if (a->kind == K_FP6) {
            if (lb >= 5) {
                /* a scale per 2^lb ≥ 32 columns: each 512 columns' 16 chunk scales found first (MX: 16 E8M0
                 * codes in one vector), and their 384 bytes read in place where the 16-byte loads stay
                 * inside the weight (else FUSED_LOOP below, which copies the last codes out) */
                float sf[16] __attribute__((aligned(64)));
#define DEC_FP6_GROUP(J, V0, V1, C)                                                                        \
    V0 = fp6_raw512(_mm_loadu_si128((const __m128i *)(row + ((uint64_t)(J) >> 2) * 3)), _mm512_set1_ps(sf[C]), &c6), \
    V1 = fp6_raw512(_mm_loadu_si128((const __m128i *)(row + ((uint64_t)(J) >> 2) * 3 + 12)), _mm512_set1_ps(sf[C]), &c6)
                for (; j + 512 <= nfull && row + (j + 512) / 4 * 3 + 4 <= c6.end; j += 512) {
                    group_scales512(a, t0, j, lb, 1.0f, sf);
                    GROUP_CHUNKS(DEC_FP6_GROUP);
                }
#undef DEC_FP6_GROUP
            }
            FUSED_LOOP(DEC_FP6);
        } else if (a->kind == K_E5M2) {
            FUSED_LOOP(DEC_E5M2);
        } else if (lb == 62 && !(isinf(S0(0) * 256.0f) && !isinf(S0(0)))) {
            /* E4M3 with one scale per row (tensor or row scales): fp8_512's products, its scale × 2^8
             * broadcast and its NaN patch chosen once per row instead of per 16 columns */
            const __m512 s8 = _mm512_set1_ps(S0(0) * 256.0f);
#define DEC_E4M3_ROW_NAN_FREE(J, V0, V1) DEC_E4M3_BY(J, V0, V1, 1, s8)
#define DEC_E4M3_ROW_NAN(J, V0, V1) DEC_E4M3_BY(J, V0, V1, 0, s8)
            if (nan_free) FUSED_LOOP(DEC_E4M3_ROW_NAN_FREE);
            else FUSED_LOOP(DEC_E4M3_ROW_NAN);
#undef DEC_E4M3_ROW_NAN
#undef DEC_E4M3_ROW_NAN_FREE
        } else {
            if (lb >= 5 && lb < 62) {
                /* E4M3 with a scale per 2^lb ≥ 32 columns (MX, 128-column blocks): each 512 columns'
                 * 16 chunk scales × 2^8 found first, out of the vector loop; from a group where × 2^8
                 * overflows on, fp8_512 chunk by chunk (FUSED_LOOP below) */
                float sf[16] __attribute__((aligned(64)));
#define DEC_E4M3_GROUP_NAN_FREE(J, V0, V1, C) DEC_E4M3_BY(J, V0, V1, 1, _mm512_set1_ps(sf[C]))
#define DEC_E4M3_GROUP_NAN(J, V0, V1, C) DEC_E4M3_BY(J, V0, V1, 0, _mm512_set1_ps(sf[C]))
                for (; j + 512 <= nfull && !group_scales512(a, t0, j, lb, 256.0f, sf); j += 512) {
                    if (nan_free) GROUP_CHUNKS(DEC_E4M3_GROUP_NAN_FREE)
                    else GROUP_CHUNKS(DEC_E4M3_GROUP_NAN)
                }
#undef DEC_E4M3_GROUP_NAN
#undef DEC_E4M3_GROUP_NAN_FREE
            }
            FUSED_LOOP(DEC_E4M3);
        }
        if (j < a->K && USE(0)) { /* the last, partial chunk */
            float w[CH] __attribute__((aligned(64))), hs[2];
            hs[0] = scale_at(a, t0 + (j >> lb));
            hs[1] = a->K - j > 16 ? scale_at(a, t0 + ((j + 16) >> lb)) : hs[0];
            decode_tail(a, row, j, 0, a->K - j, hs, w);
            FMA2S(j, _mm512_load_ps(w), _mm512_load_ps(w + 16), 0);
        }
        for (int r = 0; r < R; r++) {
            const __m512 s01 = _mm512_add_ps(acc[r][0], acc[r][1]);
            if (NS == 2) y[r * a->N + n] = _mm512_reduce_add_ps(_mm512_add_ps(s01, _mm512_add_ps(acc[r][2], acc[r][3])));
            else if (pass == 0) part[r] = s01;
            else y[r * a->N + n] = _mm512_reduce_add_ps(_mm512_add_ps(part[r], s01));
        }
      }
}

/* Rows n0 … n1 - 1 of W against every row of x, by groups of rows: each group's chunks decoded once
 * in registers and multiplied with each of its rows, every row summed as it would be alone. Groups
 * of 4 rows, but for a remainder of 5-7 rows after them, which is one group (rows_fused512's two
 * passes: 5-7 rows cost less so than as 4 + 1-3, while 8 rows cost less as 4 + 4 — their 16 sums
 * and x leave too little room in registers and L1). More than 7 rows of x: the rows of W in blocks
 * of RB (in L2), every group of x in turn. */
#define RB 64
T512 static void rows_range512(const gemv_args_t *a, int64_t n0, int64_t n1, const float *xp, int64_t xs, int lb,
                               const uint8_t *scale_end, int wide) {
    const int64_t step = a->M <= 7 ? n1 - n0 : RB;
    for (int64_t n = n0; n < n1; n += step) {
        const int64_t ne = n + step < n1 ? n + step : n1;
        for (int64_t m0 = 0, g; m0 < a->M; m0 += g) {
            const int64_t left = a->M - m0;
            g = left <= 7 && left != 4 ? left : 4; /* ... 4, 4, then the last 1-7 (8 left: 4 + 4) */
            const float *x = xp + m0 * xs;
            float *y = a->y + m0 * a->N;
            switch (g) {
            case 1: rows_fused512(a, n, ne, x, xs, y, lb, scale_end, wide, 1); break;
            case 2: rows_fused512(a, n, ne, x, xs, y, lb, scale_end, wide, 2); break;
            case 3: rows_fused512(a, n, ne, x, xs, y, lb, scale_end, wide, 3); break;
            case 4: rows_fused512(a, n, ne, x, xs, y, lb, scale_end, wide, 4); break;
            case 5: rows_fused512(a, n, ne, x, xs, y, lb, scale_end, wide, 5); break;
            case 6: rows_fused512(a, n, ne, x, xs, y, lb, scale_end, wide, 6); break;
            default: rows_fused512(a, n, ne, x, xs, y, lb, scale_end, wide, 7); break;
            }
        }
    }
}
#endif

/* The float32 multiply-adds these kernels' products can reach here, timed by the caller: `nthreads`
 * threads each run `iters` rounds of twelve independent multiply-adds on `isa`'s vectors (fused, 16
 * floats on AVX-512, 8 on AVX2; the portable path's a · b + c on single floats) — enough chains in
 * flight to fill the units, no memory touched. Returns the threads that ran: the work is
 * 12 × lanes × iters × that (bench decode's floor for rows of x, `gemv.multiply_add_rate`). */
#define FMA_PROBE(T, SET1, FMA, SUM)                                                                            \
    do {                                                                                                        \
        const T b_ = SET1(0.999999f), c_ = SET1(1e-7f);                                                         \
        T a_[12];                                                                                               \
        _Pragma("GCC unroll 12") for (int i_ = 0; i_ < 12; i_++) a_[i_] = SET1((float)i_);                       \
        for (int64_t n_ = 0; n_ < iters; n_++) {                                                                \
            _Pragma("GCC unroll 12") for (int i_ = 0; i_ < 12; i_++) a_[i_] = FMA(a_[i_], b_, c_);             \
        }                                                                                                       \
        float s_ = 0;                                                                                           \
        _Pragma("GCC unroll 12") for (int i_ = 0; i_ < 12; i_++) s_ += SUM(a_[i_]);                            \
        return s_;                                                                                              \
    } while (0)
#if MF_X86
T512 static float fma_probe512(int64_t iters) { FMA_PROBE(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_reduce_add_ps); }
T256 static inline float sum256(__m256 v) { float t[8]; _mm256_storeu_ps(t, v); return t[0] + t[7]; } /* a sink: keeps the chain live */
T256 static float fma_probe256(int64_t iters) { FMA_PROBE(__m256, _mm256_set1_ps, _mm256_fmadd_ps, sum256); }
#endif
static inline float same(float v) { return v; }
static inline float muladd(float a, float b, float c) { return a * b + c; }
static float fma_probe_portable(int64_t iters) { FMA_PROBE(float, same, muladd, same); }

int mf_fma_probe(int isa, int nthreads, int64_t iters) {
    volatile float keep = 0;
    int used = 1;
#pragma omp parallel num_threads(nthreads)
    {
        float s;
#if MF_X86
        if (isa == ISA_AVX512) s = fma_probe512(iters);
        else if (isa == ISA_AVX2) s = fma_probe256(iters);
        else
#endif
            s = fma_probe_portable(iters);
#pragma omp critical
        keep += s;
#ifdef _OPENMP
#pragma omp single
        used = omp_get_num_threads();
#endif
    }
    (void)keep;
    return used;
}

/* y = x · Wᵀ (see the top of the file). The caller checks: M ≤ 16, blocks 16·j columns wide or one
 * per row, `isa` one that mf_gemv_isas reports. Returns 0, or -1 when scratch memory ran out. */
int mf_gemv(const gemv_args_t *a) {
    const int64_t M = a->M, K = a->K, Kc = (K + CH - 1) / CH * CH;
    float *xp = mf_alloc64((size_t)(M * Kc) * sizeof(float));
    if (!xp) return -1;
    int lb = -1; /* blocks 2^lb columns wide, 62 for one per row; -1: neither */
    if (a->ngc == 1) lb = 62;
    else if ((a->bc & (a->bc - 1)) == 0) lb = __builtin_ctzll((unsigned long long)a->bc);
    /* NVFP4 (16-column blocks, E4M3 scales) decoding one row of x on AVX-512: whole 128-column
     * chunks by shifts of 64 loaded bytes (see rows_fused512), x in their order */
    int wide = MF_X86 && a->isa == ISA_AVX512 && a->kind == K_FP4 && lb == 4 && a->sfmt == SF_E4M3;
    if (wide) { /* its unscaled block sums need |x| ≤ 2^100 (a NaN or inf fails too): the bits, as integers; a
                 * call with such a row takes the scaled path for all its rows (the one case where a row's
                 * result depends on the others: a single step of another row would have summed unscaled) */
        const uint32_t *xb = (const uint32_t *)a->x;
        uint32_t over = 0;
        for (int64_t i = 0; i < M * K; i++) over |= (xb[i] & 0x7FFFFFFFu) > 0x71800000u;
        wide = !over;
    }
    int perm[CH], identity = !wide;
    for (int c = 0; c < CH; c++) identity &= (perm[c] = chunk_pos(c, a->kind, a->isa)) == c;
    for (int64_t m = 0; m < M; m++) { /* x in the decoders' chunk order, zero past K */
        const float *xr = a->x + m * K;
        float *o = xp + m * Kc;
        memset(o + K / CH * CH, 0, (size_t)(Kc - K / CH * CH) * sizeof(float));
        if (identity) {
            memcpy(o, xr, (size_t)K * sizeof(float));
            continue;
        }
        int64_t c0 = 0;
        if (wide) /* 128-column chunks: vector q, lane i holds column 8i + q (rows_fused512's NVFP4 loop) */
            for (; c0 + 128 <= K; c0 += 128)
                for (int q = 0; q < 8; q++)
                    for (int i = 0; i < 16; i++) o[c0 + 16 * q + i] = xr[c0 + 8 * i + q];
        for (; c0 < K; c0 += CH)
            for (int c = 0, n = K - c0 < CH ? (int)(K - c0) : CH; c < n; c++) o[c0 + perm[c]] = xr[c0 + c];
    }
    decode_fn dec = NULL;
    dot_fn dot = dot_portable;
    fused_fn fus = NULL;
#if MF_X86
    if (a->isa == ISA_AVX512) dec = decode512, dot = dot512;
    if (a->isa == ISA_AVX2) dec = decode256, dot = dot256, fus = a->M <= 4 && a->kind != K_FP6 ? fused256 : NULL;
#endif
    /* the end of the scale grid (of 8-bit codes: read 16 at a time): (rows_pad / br) × ngc of them */
    const uint8_t *scale_end = (const uint8_t *)a->scales + (a->N + a->br - 1) / a->br * a->ngc;
#pragma omp parallel num_threads(a->nthreads)
    { /* thread t: rows [t·per, (t + 1)·per), as a static schedule splits them */
#ifdef _OPENMP
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
        const int64_t nt = 1, t = 0;
#endif
        const int64_t per = (a->N + nt - 1) / nt, n0 = t * per < a->N ? t * per : a->N;
        const int64_t n1 = n0 + per < a->N ? n0 + per : a->N;
#if MF_X86
        if (a->isa == ISA_AVX512 && lb >= 0)
            rows_range512(a, n0, n1, xp, Kc, lb, scale_end, wide);
        else
#endif
            for (int64_t n = n0; n < n1; n++) row_buffered(a, n, xp, Kc, dec, dot, fus);
    }
    free(xp);
    return 0;
}
