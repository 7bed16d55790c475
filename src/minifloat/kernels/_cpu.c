/* Fused CPU kernels for scaled quantization (loaded with ctypes; no Python API used).
 *
 * Each function equals a reference in minifloat/kernels/reference.py + minifloat/formats/codec.py
 * bit for bit; tests/kernels/test_kernels.py checks it. Built by setup.py with -O3 -fopenmp -ffp-contract=off:
 * no fused multiply-adds and no fast-math, so every float operation rounds as PyTorch's does.
 *
 * Element encoding (round to nearest even, saturating) works on the float32 bits:
 *   normal results:    code = (bits + rebias + half - 1 + lsb) >> (23 - m)   (carry = next binade)
 *   subnormal results: code = bits(|y| + magic) - bits(magic), magic = 2^(emin - m + 23),
 *                      so the FPU's own rounding picks the nearest multiple of 2^(emin - m).
 * The vector encoders take encp8_mag's form of the same rounding: clamp the exponent at the
 * format's smallest normal, scale into [2^m, 2^(m+1)), round by the FPU, add the exponent back.
 * One explicit fused multiply-add (encb_mag) is exact by construction: its product is a power-of-
 * two scaling, so its one rounding is the rounding to an integer that the encoder wants.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <float.h>
#ifndef PF
#define PF 1024
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* Runtime ISA dispatch (after ggml's): this file is compiled once as it is, for any CPU of its
 * architecture (the `_portable` kernels), and once more by each of _cpu_avx2.c and _cpu_avx512.c
 * under a `#pragma GCC target`, which defines MF_ISA_SUFFIX and the ISA's macros (__AVX2__ …)
 * before including it. Every exported kernel gets its variant's suffix; kernels/cpu.py binds the
 * variant that `mf_cpu_isas` says this CPU runs (or MINIFLOAT_ISA names). Every variant equals
 * the reference bit for bit: the tests run each one this CPU has. */
#ifndef MF_ISA_SUFFIX
#define MF_ISA_SUFFIX(name) name##_portable
#ifndef MF_SOURCE_HASH
#define MF_SOURCE_HASH "unknown"
#endif
#ifndef MF_BUILD
#define MF_BUILD "portable"
#endif
/* The first 16 hex digits of the kernel sources' SHA-256, as setup.py computed them at build time. */
const char *mf_source_hash(void) { return MF_SOURCE_HASH; }
/* "portable" (every object for its architecture's baseline, ISA paths by target pragmas) or
 * "native" (MINIFLOAT_NATIVE=1: every object for the building machine's CPU). */
const char *mf_build(void) { return MF_BUILD; }
/* Bit i set: variant i of ("portable", "avx2", "avx512") runs on this CPU (and was built). */
int mf_cpu_isas(void) {
    int r = 1;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (avx2) r |= 2;
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vbmi"))
        r |= 4;
#endif
    return r;
}
#endif
#define mf_amax MF_ISA_SUFFIX(mf_amax)
#define mf_quantize MF_ISA_SUFFIX(mf_quantize)
#define mf_block_amax MF_ISA_SUFFIX(mf_block_amax)
#define mf_encode_sr MF_ISA_SUFFIX(mf_encode_sr)
#define mf_dequantize MF_ISA_SUFFIX(mf_dequantize)
#define mf_transpose MF_ISA_SUFFIX(mf_transpose)
#define mf_rht16 MF_ISA_SUFFIX(mf_rht16)

typedef struct {
    int32_t man_bits, emin, emax, max_code, sign_mask, nan_code; /* NaN encodes canonically; formats
                                                                   * without NaN (FP6, FP4): nan_code == sign_mask, a zero */
    uint32_t rebias, min_normal_bits, max_bits, magic_bits;
} elem_t;

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
enum { SC_FP32 = 0, SC_FP32_GIVEN = 1, SC_E8M0 = 2, SC_NVFP4 = 3 };

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float load(const void *x, int dt, int64_t i) {
    if (dt == DT_F32) return ((const float *)x)[i];
    if (dt == DT_BF16) return u2f((uint32_t)((const uint16_t *)x)[i] << 16);
    return (float)((const _Float16 *)x)[i];
}

static inline uint32_t enc_rne(float y, const elem_t *p) {
    uint32_t u = f2u(y), a = u & 0x7fffffffu, neg = u >> 31;
    uint32_t shift = 23 - p->man_bits;
    uint32_t sub = f2u(u2f(a) + u2f(p->magic_bits)) - p->magic_bits;
    uint32_t nrm = (a + p->rebias + (1u << (shift - 1)) - 1 + ((a >> shift) & 1)) >> shift;
    uint32_t c = a < p->min_normal_bits ? sub : nrm;
    c = a > p->max_bits ? (uint32_t)p->max_code : c;
    c |= neg ? (uint32_t)p->sign_mask : 0;
    return a > 0x7f800000u ? (uint32_t)p->nan_code : c;
}

/* Counter-based stochastic-rounding bits of element i: codec.sr_bits, bit for bit. The mixer is
 * defined for one uint32 and (below, mix32v) for 8 lanes of them. */
#define DEFINE_MIX32(NAME, T)                                                                      \
    static inline T NAME(T x) {                                                                    \
        x ^= x >> 16;                                                                              \
        x *= 0x7feb352du;                                                                          \
        x ^= x >> 15;                                                                              \
        x *= 0x846ca68bu;                                                                          \
        return x ^ (x >> 16);                                                                      \
    }
DEFINE_MIX32(mix32, uint32_t)

/* The high-word term, the same for all 2^32 indices sharing i >> 32 (hoisted by callers). */
static inline uint32_t sr_hi(uint64_t seed, uint64_t i) {
    return mix32(((uint32_t)(i >> 32) ^ (uint32_t)(seed >> 32)) + 0x9e3779b9u);
}

static inline uint32_t sr_bits(uint64_t seed, uint64_t i, uint32_t hi) {
    return mix32(mix32((uint32_t)i ^ (uint32_t)seed) ^ hi);
}

/* Stochastic rounding, in double exactly as codec.encode_with_bits computes it. */
static inline uint32_t enc_sr(float y, uint32_t rb, const elem_t *p) {
    uint32_t u = f2u(y), a = u & 0x7fffffffu, neg = u >> 31;
    if (a > 0x7f800000u) return (uint32_t)p->nan_code;
    int64_t code;
    if (a == 0x7f800000u) {
        code = p->max_code;
    } else {
        const double mag = (double)u2f(a);
        /* floor(log2 |y|) from the bits (as frexp would give it, minus one) */
        int e = a >= 0x00800000u ? (int)(a >> 23) - 127 : a ? 31 - __builtin_clz(a) - 149 : p->emin;
        if (e < p->emin) e = p->emin;
        if (e > p->emax) e = p->emax;
        uint64_t pb = (uint64_t)(1023 + p->man_bits - e) << 52; /* 2^(m - e), exact scaling */
        double pw;
        memcpy(&pw, &pb, 8);
        double r = mag * pw;
        double cap = (double)(1 << (p->man_bits + 2));
        if (r > cap) r = cap;
        double k = floor(r);
        double uu = (double)rb * 0x1p-32;
        k += (uu < r - k) ? 1.0 : 0.0;
        code = ((int64_t)(e - p->emin) << p->man_bits) + (int64_t)k;
        if (code > p->max_code) code = p->max_code;
    }
    return (uint32_t)code | (neg ? (uint32_t)p->sign_mask : 0);
}

/* ---- Vector helpers ------------------------------------------------------------------------
 * GCC vector extensions (8 lanes: AVX2 where the build machine has it, SSE pairs otherwise),
 * with AVX2 intrinsics for the few operations GCC does not map to one instruction. */
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef _Float16 v8x __attribute__((vector_size(16)));

#ifdef __AVX2__
static inline v8i vmin(v8i a, v8i b) { return (v8i)_mm256_min_epi32((__m256i)a, (__m256i)b); }
static inline v8i vmax(v8i a, v8i b) { return (v8i)_mm256_max_epi32((__m256i)a, (__m256i)b); }
/* m ? a : b, lane-wise (m is all ones or all zeros per lane). */
static inline v8i vsel(v8i m, v8i a, v8i b) {
    return (v8i)_mm256_blendv_epi8((__m256i)b, (__m256i)a, (__m256i)m);
}
static inline int vany(v8i m) { return !_mm256_testz_si256((__m256i)m, (__m256i)m); }
static inline v8i vminu(v8i a, v8i b) { return (v8i)_mm256_min_epu32((__m256i)a, (__m256i)b); }
/* round to the nearest integer, ties to even (the MXCSR default); inf / NaN give 0x80000000 */
static inline v8i vrne(v8f m) { return (v8i)_mm256_cvtps_epi32((__m256)m); }
#else
static inline v8i vsel(v8i m, v8i a, v8i b) { return (m & a) | (~m & b); }
static inline v8i vmin(v8i a, v8i b) { return vsel(a < b, a, b); }
static inline v8i vmax(v8i a, v8i b) { return vsel(a > b, a, b); }
static inline int vany(v8i m) {
    int r = 0;
    for (int k = 0; k < 8; k++) r |= m[k];
    return r != 0;
}
static inline v8i vminu(v8i a, v8i b) { return vsel((v8u)a < (v8u)b, a, b); }
/* 0 <= m < 2^23: the FPU rounds m + 2^23 to an integer; inf / NaN give bits above any code */
static inline v8i vrne(v8f m) { return (v8i)(m + 0x1p23f) - 0x4b000000; }
#endif

/* Largest of 8 non-negative lanes in three shuffle steps. */
static inline int32_t hmax8(v8i v) {
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
    return v[0];
}

/* Lane b = the largest lane of t[b]: 8 vectors reduced at once by a transpose (the block maxima
 * of 8 small blocks cost 22 operations instead of 8 separate horizontal reductions). */
static inline v8i reduce8(const v8i *t) {
    v8i u[4], w[2];
    for (int q = 0; q < 4; q++) /* halves: [t(2q) lo | t(2q+1) lo] vs [.. hi | .. hi] */
        u[q] = vmax(__builtin_shufflevector(t[2 * q], t[2 * q + 1], 0, 1, 2, 3, 8, 9, 10, 11),
                    __builtin_shufflevector(t[2 * q], t[2 * q + 1], 4, 5, 6, 7, 12, 13, 14, 15));
    for (int q = 0; q < 2; q++) /* lane pairs, within 128-bit halves */
        w[q] = vmax(__builtin_shufflevector(u[2 * q], u[2 * q + 1], 0, 2, 8, 10, 4, 6, 12, 14),
                    __builtin_shufflevector(u[2 * q], u[2 * q + 1], 1, 3, 9, 11, 5, 7, 13, 15));
    const v8i z = vmax(__builtin_shufflevector(w[0], w[1], 0, 2, 8, 10, 4, 6, 12, 14),
                       __builtin_shufflevector(w[0], w[1], 1, 3, 9, 11, 5, 7, 13, 15));
    return __builtin_shufflevector(z, z, 0, 4, 1, 5, 2, 6, 3, 7);
}

/* Codes (0..255 per int32 lane) to 8 bytes. */
static inline void store8(v8i c, uint8_t *dst) {
#ifdef __AVX2__
    const __m256i p = _mm256_packus_epi32((__m256i)c, (__m256i)c);           /* 0-3 0-3 | 4-7 4-7 */
    const __m256i b = _mm256_packus_epi16(p, p);                                /* bytes 0-3 .. | 4-7 .. */
    const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    _mm_storel_epi64((__m128i *)dst, _mm_unpacklo_epi32(lo, hi));
#else
    for (int k = 0; k < 8; k++) dst[k] = (uint8_t)c[k];
#endif
}

/* Pack n codes (one per byte) into `bits`-wide fields; see packing.py for the layouts:
 * FP4: byte i = c[2i] | c[2i+1] << 4;  FP6: 3 bytes = c[4g] | c[4g+1] << 6 | c[4g+2] << 12 | c[4g+3] << 18. */
static void pack_codes(const uint8_t *c, int64_t n, int bits, uint8_t *out) {
    int64_t i = 0;
    if (bits == 8) { memcpy(out, c, (size_t)n); return; }
    if (bits == 4) {
#ifdef __AVX2__
        const __m256i lo_hi = _mm256_set1_epi16(0x1001); /* maddubs: c[2i] + 16 c[2i+1] per 16-bit lane */
        for (; i + 32 <= n; i += 32) {
            const __m256i w = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(c + i)), lo_hi);
            const __m128i b = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            _mm_storeu_si128((__m128i *)(out + i / 2), b);
        }
#endif
        for (; i + 1 < n; i += 2) out[i / 2] = (uint8_t)(c[i] | (c[i + 1] << 4));
        return;
    }
#ifdef __AVX2__
    const __m256i by64 = _mm256_set1_epi16(0x4001), by4096 = _mm256_set1_epi32(0x10000001);
    const __m256i squeeze = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                                             0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    for (; i + 32 <= n; i += 32) {
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(c + i)), by64);
        const __m256i words = _mm256_shuffle_epi8(_mm256_madd_epi16(pairs, by4096), squeeze);
        uint8_t *o = out + i / 4 * 3;
        const __m128i lo = _mm256_castsi256_si128(words), hi = _mm256_extracti128_si256(words, 1);
        _mm_storel_epi64((__m128i *)o, lo);
        memcpy(o + 8, (const char *)&lo + 8, 4);
        _mm_storel_epi64((__m128i *)(o + 12), hi);
        memcpy(o + 20, (const char *)&hi + 8, 4);
    }
#endif
    for (; i + 3 < n; i += 4) {
        const uint8_t *q = c + i;
        uint8_t *o = out + i / 4 * 3;
        o[0] = (uint8_t)(q[0] | ((q[1] & 3) << 6));
        o[1] = (uint8_t)((q[1] >> 2) | ((q[2] & 15) << 4));
        o[2] = (uint8_t)((q[2] >> 4) | (q[3] << 2));
    }
}

/* Set code j of codes packed by pack_codes. */
static inline void put_code(uint8_t *out, int64_t j, int bits, uint32_t c) {
    if (bits == 8) {
        out[j] = (uint8_t)c;
    } else if (bits == 4) {
        uint8_t *b = out + j / 2;
        *b = (uint8_t)(j & 1 ? (*b & 0x0f) | (c << 4) : (*b & 0xf0) | c);
    } else {
        uint8_t *g = out + j / 4 * 3;
        const int sh = 6 * (int)(j % 4);
        uint32_t w = (uint32_t)g[0] | ((uint32_t)g[1] << 8) | ((uint32_t)g[2] << 16);
        w = (w & ~(63u << sh)) | (c << sh);
        g[0] = (uint8_t)w, g[1] = (uint8_t)(w >> 8), g[2] = (uint8_t)(w >> 16);
    }
}

#ifdef __AVX2__
/* 16 six-bit codes, one per byte, from the 12 bytes at g (reads 16). */
static inline __m128i unpack6x16(const uint8_t *g) {
    const __m128i spread = _mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
    const __m128i w = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)g), spread); /* 4 words of 24 bits */
    __m128i v = _mm_and_si128(w, _mm_set1_epi32(0x3f));
    v = _mm_or_si128(v, _mm_and_si128(_mm_slli_epi32(w, 2), _mm_set1_epi32(0x3f00)));
    v = _mm_or_si128(v, _mm_and_si128(_mm_slli_epi32(w, 4), _mm_set1_epi32(0x3f0000)));
    return _mm_or_si128(v, _mm_and_si128(_mm_slli_epi32(w, 6), _mm_set1_epi32(0x3f000000)));
}
#endif

/* Unpack n codes (n a multiple of the pack group) into one byte each. */
static void unpack_codes(const uint8_t *in, int64_t n, int bits, uint8_t *c) {
    int64_t i = 0;
    if (bits == 4) {
#ifdef __AVX2__
        const __m128i nib = _mm_set1_epi8(15);
        for (; i + 32 <= n; i += 32) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(in + i / 2));
            const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
            _mm_storeu_si128((__m128i *)(c + i), _mm_unpacklo_epi8(lo, hi));
            _mm_storeu_si128((__m128i *)(c + i + 16), _mm_unpackhi_epi8(lo, hi));
        }
#endif
        for (; i + 1 < n; i += 2) c[i] = in[i / 2] & 15, c[i + 1] = in[i / 2] >> 4;
        return;
    }
#ifdef __AVX2__ /* 12 bytes -> 16 codes; reads 16 bytes, so stop early */
    for (; i + 16 <= n && (i + 16) / 4 * 3 + 4 <= n / 4 * 3; i += 16)
        _mm_storeu_si128((__m128i *)(c + i), unpack6x16(in + i / 4 * 3));
#endif
    for (; i + 3 < n; i += 4) {
        const uint8_t *g = in + i / 4 * 3;
        const uint32_t w = (uint32_t)g[0] | ((uint32_t)g[1] << 8) | ((uint32_t)g[2] << 16);
        c[i] = w & 63, c[i + 1] = (w >> 6) & 63, c[i + 2] = (w >> 12) & 63, c[i + 3] = (w >> 18) & 63;
    }
}

/* ---- Element encoding, 8 lanes: the same rounding as enc_rne, except that NaN lanes come out
 * saturated; callers track the largest |bits| and fix NaN lanes afterwards. */
typedef struct {
    int32_t shift, sgn_shift, max_code, sign_mask, byte_shift, fbase, lim0; /* lim0: 2^emin's bits */
} vconst_t;

static vconst_t vconst(const elem_t *p, int bits) {
    return (vconst_t){23 - p->man_bits, 32 - bits, p->max_code, p->sign_mask, 8 - bits, (254 + p->man_bits) << 23,
                      (p->emin + 127) << 23};
}

/* The code of |x| * 2^k from the bits a of |x| (no sign), for an E8M0 scale 2^k: the scale only
 * moves exponents, so no multiply by it. lim = the |x| bits at which x * 2^k reaches the format's
 * smallest normal (2^(emin - k)); then with m mantissa bits
 *   e = max(exponent bits of a, lim)          (x's binade, or the subnormal range)
 *   code = rne(|x| * 2^(m - e)) + ((e - lim) >> (23 - m))
 * |x| * 2^(m - e) is exact: in [2^m, 2^(m+1)) for a normal result, where rounding up to 2^(m+1)
 * carries into the next binade, and below 2^m for a subnormal one. inf and NaN round to
 * 0x80000000 or more, which the unsigned clamp to max_code saturates. Valid when the scale is a
 * normal float and lim's exponent is at least max(m, 1) (pow2_limits checks). With k = 0 and
 * lim = 2^emin (k->lim0) it encodes any float32 y: the multiply-first encoders. */
static inline __attribute__((always_inline)) v8i encp8_mag(v8i a, v8i lim, const vconst_t *k) {
    const v8i e = vmax(a & 0x7f800000, lim);
    return vminu(vrne((v8f)a * (v8f)(k->fbase - e)) + ((e - lim) >> k->shift), (v8i){0} + k->max_code);
}

static inline __attribute__((always_inline)) v8i enc8(v8f y, const vconst_t *k, v8i *top) {
    const v8i u = (v8i)y, a = u & 0x7fffffff;
    *top = vmax(*top, a);
    return encp8_mag(a, (v8i){0} + k->lim0, k) | ((v8i)((v8u)u >> k->sgn_shift) & k->sign_mask);
}

#if defined(__FMA__) && defined(__AVX512VBMI__) && defined(__AVX512VL__)
#define ENCB 1
/* encp8_mag's code plus 0x4b000000 (the bits of 2^23), in 8 vector operations instead of 9:
 *   fma(|x|, 2^(m - e), 2^23 + ((e - lim) >> (23 - m)))
 * The product is exact and below 2^(m+1), and the addend 2^23 + an integer (< 2^23) is exact, so
 * the fma's one rounding (ulp 1 in [2^23, 2^24)) is encp8_mag's rne, and the integer add is exact
 * too. kc = 0x4b000000 - (lim >> (23 - m)) folds the constant parts (lim's low 23 bits are zero).
 * inf and NaN come out above the clamp. The low byte is the code: store32s takes low bytes (VBMI
 * byte permutes), so the bias costs nothing. Checked equal to encp8_mag for every float32 |x| at
 * 2^emin and over 2^emin..2^127 limits for E4M3, E5M2, E3M2, E2M3 and E2M1. One vector operation
 * fewer per 8 codes than encp8_mag (timings: README, Performance). */
static inline __attribute__((always_inline)) v8i encb_mag(v8i a, v8i lim, v8i kc, const vconst_t *k) {
    const v8i e = vmax(a & 0x7f800000, lim);
    const v8f add = (v8f)((v8i)((v8u)e >> k->shift) + kc);
    return vminu((v8i)_mm256_fmadd_ps((__m256)a, (__m256)(k->fbase - e), (__m256)add),
                 (v8i){0} + (0x4b000000 + k->max_code));
}
#define ENC_MAG(a, lim, kc, k) encb_mag(a, lim, kc, k)
#else
#define ENCB 0
#define ENC_MAG(a, lim, kc, k) encp8_mag(a, lim, k)
#endif

/* 32 codes in order from the magnitude codes m0-m3 and the float bits u0-u3 they take their signs
 * from, packed into `bits`-wide fields at dst (the layouts of pack_codes: 32, 16 or 24 bytes).
 * AVX2: the signs come from saturating packs of the bits themselves (a negative int32 stays
 * negative down to int8), so they cost 5 operations per 32 codes instead of 3 per 8; sub-byte
 * codes are packed in registers, not staged in memory and packed in a second loop. */
static inline __attribute__((always_inline)) void store32s(v8i m0, v8i m1, v8i m2, v8i m3, v8i u0, v8i u1, v8i u2,
                                                           v8i u3, const vconst_t *k, int bits, uint8_t *dst) {
#if ENCB
    /* byte 0 of each lane (the code, biased or not: encb_mag) and byte 3 (its sign bit at bit 7),
     * in order, by two-source byte permutes: 7 operations per 32 codes, against 9 with packs */
    const __m256i lo = _mm256_setr_epi8(0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60,
                                        0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60);
    const __m256i hi = _mm256_add_epi8(lo, _mm256_set1_epi8(3));
    const __m256i c01 = _mm256_permutex2var_epi8((__m256i)m0, lo, (__m256i)m1);
    const __m256i c23 = _mm256_permutex2var_epi8((__m256i)m2, lo, (__m256i)m3);
    const __m256i s01 = _mm256_permutex2var_epi8((__m256i)u0, hi, (__m256i)u1);
    const __m256i s23 = _mm256_permutex2var_epi8((__m256i)u2, hi, (__m256i)u3);
    const __m256i y = _mm256_inserti128_si256(c01, _mm256_castsi256_si128(c23), 1);
    const __m256i neg = _mm256_inserti128_si256(s01, _mm256_castsi256_si128(s23), 1);
    /* bit 7 of each byte is the sign; sub-byte formats want it at bit (bits - 1): y | (sign & mask) */
    const __m256i c = k->byte_shift == 0
                          ? _mm256_ternarylogic_epi32(y, neg, _mm256_set1_epi8((char)0x80), 0xF8)
                          : _mm256_ternarylogic_epi32(y, _mm256_srl_epi16(neg, _mm_cvtsi32_si128(k->byte_shift)),
                                                      _mm256_set1_epi8((char)(0x80 >> k->byte_shift)), 0xF8);
#elif defined(__AVX2__)
    const __m256i y = _mm256_packus_epi16(_mm256_packus_epi32((__m256i)m0, (__m256i)m1),
                                          _mm256_packus_epi32((__m256i)m2, (__m256i)m3));
    const __m256i neg = _mm256_packs_epi16(_mm256_packs_epi32((__m256i)u0, (__m256i)u1),
                                           _mm256_packs_epi32((__m256i)u2, (__m256i)u3));
    /* bit 7 of each byte is the sign; sub-byte formats want it at bit (bits - 1) */
    const __m256i sg = _mm256_srl_epi16(_mm256_and_si256(neg, _mm256_set1_epi8((char)0x80)),
                                        _mm_cvtsi32_si128(k->byte_shift));
    const __m256i c = _mm256_permutevar8x32_epi32(_mm256_or_si256(y, sg), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#endif
#ifdef __AVX2__
    if (bits == 8) {
        _mm256_storeu_si256((__m256i *)dst, c);
    } else if (bits == 4) { /* byte i = c[2i] | c[2i+1] << 4 */
        const __m256i w = _mm256_maddubs_epi16(c, _mm256_set1_epi16(0x1001));
        _mm_storeu_si128((__m128i *)dst, _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
    } else { /* 4 codes -> 24 bits -> 3 bytes; 12 bytes per 128-bit half */
        const __m256i squeeze = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                                                 0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
        const __m256i pairs = _mm256_maddubs_epi16(c, _mm256_set1_epi16(0x4001));
        const __m256i words = _mm256_shuffle_epi8(_mm256_madd_epi16(pairs, _mm256_set1_epi32(0x10000001)), squeeze);
        const __m128i hi = _mm256_extracti128_si256(words, 1);
        _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(words)); /* bytes 12-15: overwritten next */
        _mm_storel_epi64((__m128i *)(dst + 12), hi);
        const uint32_t last = (uint32_t)_mm_extract_epi32(hi, 2);
        memcpy(dst + 20, &last, 4);
    }
#else
#define SIGNED(m, u) ((m) | ((v8i)((v8u)(u) >> k->sgn_shift) & k->sign_mask))
    uint8_t c[32];
    store8(SIGNED(m0, u0), c), store8(SIGNED(m1, u1), c + 8);
    store8(SIGNED(m2, u2), c + 16), store8(SIGNED(m3, u3), c + 24);
    pack_codes(c, 32, bits, dst);
#undef SIGNED
#endif
}

/* Encode 32 elements from x + j (loader LD) by encp8_mag (encb_mag where ENCB) into out, packed (store32s). SCALED: of y = x * the
 * block scales enc[(j / 8) >> lb], against l0 = 2^emin (one path for normal and subnormal results:
 * the clamp at 2^emin makes the FPU's rounding the subnormal one too). Else of x itself, against the
 * block's lim (E8M0 scales, blocks of 32 << k columns; no NaN lanes: a NaN makes its block's
 * scale NaN, and such chunks are SCALED). TRACK: the largest |bits| into top (to find NaN
 * lanes, which come out saturated). */
#define ENC32(LD, SCALED, TRACK)                                                                   \
    for (; j + 32 <= n; j += 32) {                                                                 \
        if (ahead) { /* the next chunk's lines, so that its first read finds them in cache */      \
            __builtin_prefetch((const char *)(x + j) + ahead);                                      \
            if (sizeof(*x) == 4) __builtin_prefetch((const char *)(x + j) + ahead + 64);            \
        }                                                                                          \
        const v8i u0 = (v8i)(SCALED ? LD(x, j) * enc[(j >> 3) >> lb] : LD(x, j));                  \
        const v8i u1 = (v8i)(SCALED ? LD(x, j + 8) * enc[((j >> 3) + 1) >> lb] : LD(x, j + 8));    \
        const v8i u2 = (v8i)(SCALED ? LD(x, j + 16) * enc[((j >> 3) + 2) >> lb] : LD(x, j + 16));  \
        const v8i u3 = (v8i)(SCALED ? LD(x, j + 24) * enc[((j >> 3) + 3) >> lb] : LD(x, j + 24));  \
        const v8i l = SCALED ? l0 : (v8i){0} + lim[(j >> 3) >> lb];                                \
        const v8i a0 = u0 & 0x7fffffff, a1 = u1 & 0x7fffffff, a2 = u2 & 0x7fffffff, a3 = u3 & 0x7fffffff; \
        if (TRACK) top = vmax(top, vmax(vmax(a0, a1), vmax(a2, a3)));                              \
        /* encb_mag's constant, from l0 or the block's lim (encp8_mag does not use it) */          \
        const v8i kc = SCALED ? kc0 : (v8i){0} + (0x4b000000 - (lim[(j >> 3) >> lb] >> k->shift)); \
        (void)kc;                                                                                  \
        store32s(ENC_MAG(a0, l, kc, k), ENC_MAG(a1, l, kc, k), ENC_MAG(a2, l, kc, k), ENC_MAG(a3, l, kc, k), \
                 u0, u1, u2, u3, k, bits, out + j * bits / 8);                                     \
    }

typedef struct {
    int32_t mag_mask, sgn_shift, mshift, rebias, magic_bits, min_normal_code, max_mag;
    float magic;
} dconst_t;

static dconst_t dconst(const elem_t *p, int bits) {
    return (dconst_t){p->sign_mask - 1, 32 - bits, 23 - p->man_bits, (126 + p->emin) << 23, (int32_t)p->magic_bits,
                      1 << p->man_bits, p->max_code & (p->sign_mask - 1), u2f(p->magic_bits)};
}

/* Decode 8 codes arithmetically (normal: exponent rebias; subnormal: the magic-number trick in
 * reverse); *special collects lanes above the largest finite code (NaN / inf, fixed by the LUT). */
static inline v8f dec8(v8i c, const dconst_t *d, v8i *special) {
    const v8i mag = c & d->mag_mask, sgn = (c & ~d->mag_mask) << d->sgn_shift;
    const v8i nrm = (mag << d->mshift) + d->rebias;
    const v8i sub = (v8i)((v8f)(mag + d->magic_bits) - d->magic);
    *special |= mag > d->max_mag;
    return (v8f)(vsel(mag < d->min_normal_code, sub, nrm) | sgn);
}

/* ---- Per input dtype: loads, block maxima, the encode loop ------------------------------- */
#define DEFINE_LOOPS(NAME, T, LOAD1, LOAD8)                                                        \
    static inline float ld1_##NAME(const T *x, int64_t i) { return LOAD1; }                       \
    static inline v8f ld8_##NAME(const T *x, int64_t i) { LOAD8; }                                 \
    /* Largest finite |x| bits into *best (kept if larger), NaN seen into *nan. */                 \
    static inline __attribute__((always_inline)) void amax_##NAME(const void *xv, int64_t n,      \
                                                                 uint32_t *best, int *nan) {       \
        const T *x = (const T *)xv;                                                               \
        v8i fin = {0}, top = {0};                                                                 \
        int64_t i = 0;                                                                            \
        for (; i + 8 <= n; i += 8) {                                                              \
            const v8i a = (v8i)ld8_##NAME(x, i) & 0x7fffffff;                                       \
            top = vmax(top, a);                                                                   \
            fin = vmax(fin, a & (a < 0x7f800000));                                                 \
        }                                                                                         \
        uint32_t b = *best, t = (uint32_t)hmax8(top), f = (uint32_t)hmax8(fin);                    \
        b = f > b ? f : b;                                                                        \
        for (; i < n; i++) {                                                                      \
            uint32_t a = f2u(ld1_##NAME(x, i)) & 0x7fffffffu;                                      \
            t = a > t ? a : t;                                                                    \
            b = a < 0x7f800000u && a > b ? a : b;                                                 \
        }                                                                                         \
        *best = b;                                                                                \
        *nan |= t > 0x7f800000u;                                                                  \
    }                                                                                             \
    /* Largest |x| bits (inf and NaN included) over n = 8k elements. */                           \
    static inline __attribute__((always_inline)) v8i top_##NAME(const void *xv, int64_t n, v8i t) { \
        const T *x = (const T *)xv;                                                               \
        for (int64_t i = 0; i < n; i += 8) t = vmax(t, (v8i)ld8_##NAME(x, i) & 0x7fffffff);         \
        return t;                                                                                 \
    }                                                                                             \
    /* Largest |x| bits (inf, NaN included) of 8 adjacent blocks of bc = 8k columns, over rows   \
     * of `stride` elements: lane b for block b. */                                              \
    static inline __attribute__((always_inline)) v8i tops8_##NAME(const void *xv, int64_t bc,     \
                                                                  int64_t rows, int64_t stride) { \
        const T *x = (const T *)xv;                                                               \
        v8i t[8] = {{0}};                                                                         \
        for (int64_t r = 0; r < rows; r++)                                                        \
            for (int b = 0; b < 8; b++)                                                           \
                for (int64_t i = 0; i < bc; i += 8) {                                             \
                    if ((((b * bc + i) * (int64_t)sizeof(T)) & 63) == 0)                          \
                        __builtin_prefetch(x + r * stride + b * bc + i + PF / sizeof(T));          \
                    t[b] = vmax(t[b], (v8i)ld8_##NAME(x, r * stride + b * bc + i) & 0x7fffffff);  \
                }                                                                                 \
        return reduce8(t);                                                                        \
    }                                                                                             \
    /* acc[b] = max(acc[b], |x| bits) over block b's columns of one row, for nb blocks of bc = 8k */ \
    static inline __attribute__((always_inline)) void rowacc_##NAME(const void *xv, int64_t nb,     \
                                                                    int64_t bc, v8i *acc) {        \
        const T *x = (const T *)xv;                                                               \
        for (int64_t b = 0; b < nb; b++) {                                                        \
            v8i a = acc[b];                                                                       \
            for (int64_t i = 0; i < bc; i += 8) a = vmax(a, (v8i)ld8_##NAME(x, b * bc + i) & 0x7fffffff); \
            acc[b] = a;                                                                           \
        }                                                                                         \
    }                                                                                             \
    /* codes j < n of enc_rne(x[j] * enc[(j / 8) >> lb]), packed into `bits`-wide fields at out   \
     * (n a multiple of the pack group): blocks of 8 << lb columns; lim: the blocks' limits for   \
     * encp8_mag (E8M0 scales, no NaN lanes), or NULL. nan_dec: NULL, or the blocks' decode      \
     * scales, set to NaN for a block with a NaN in x (given scales of formats without NaN, whose \
     * codes cannot hold it). */                                                                  \
    static inline __attribute__((always_inline)) void encode_##NAME(                             \
        const void *xv, int64_t n, const float *enc, const int32_t *lim, int lb, const vconst_t *k,       \
        const elem_t *p, uint8_t *restrict out, int bits, int64_t ahead, int track, float *nan_dec) { \
        const T *x = (const T *)xv;                                                               \
        const vconst_t kc = *k; /* a local copy: byte stores may alias *k, and would reload it */ \
        k = &kc;                                                                                  \
        const v8i l0 = (v8i){0} + k->lim0, kc0 = (v8i){0} + (0x4b000000 - (k->lim0 >> k->shift)); \
        v8i top = {0};                                                                            \
        int64_t j = 0;                                                                            \
        if (lim) ENC32(ld8_##NAME, 0, 0) else if (track) ENC32(ld8_##NAME, 1, 1) else ENC32(ld8_##NAME, 1, 0) \
        const int64_t j32 = j; /* the last (n % 32) codes: one at a time, then packed */           \
        uint8_t tail[32];                                                                         \
        for (; j + 8 <= n; j += 8) store8(enc8(ld8_##NAME(x, j) * enc[(j >> 3) >> lb], k, &top), tail + (j - j32)); \
        for (; j < n; j++) {                                                                      \
            tail[j - j32] = (uint8_t)enc_rne(ld1_##NAME(x, j) * enc[(j >> 3) >> lb], p);          \
            if (nan_dec && isnan(ld1_##NAME(x, j))) nan_dec[(j >> 3) >> lb] = NAN;                  \
        }                                                                                         \
        if (n > j32) pack_codes(tail, n - j32, bits, out + j32 * bits / 8);                       \
        if (track && hmax8(top) > 0x7f800000) /* a NaN lane (x, or 0 * inf): NaN is canonical */   \
            for (j = 0; j < n; j++)                                                               \
                if (isnan(ld1_##NAME(x, j) * enc[(j >> 3) >> lb])) {                              \
                    put_code(out, j, bits, (uint32_t)p->nan_code);                                \
                    if (nan_dec && isnan(ld1_##NAME(x, j))) nan_dec[(j >> 3) >> lb] = NAN;          \
                }                                                                                 \
    }

DEFINE_LOOPS(f32, float, x[i], v8f v; memcpy(&v, x + i, 32); return v)
DEFINE_LOOPS(bf16, uint16_t, u2f((uint32_t)x[i] << 16),
             v8h h; memcpy(&h, x + i, 16); return (v8f)(__builtin_convertvector(h, v8u) << 16))
DEFINE_LOOPS(f16, _Float16, (float)x[i], v8x h; memcpy(&h, x + i, 16); return __builtin_convertvector(h, v8f))

/* ---- Stochastic rounding, 8 lanes ---------------------------------------------------------- */
static inline v8f ld8_any(const void *x, int dt, int64_t j) {
    if (dt == DT_F32) return ld8_f32((const float *)x, j);
    if (dt == DT_BF16) return ld8_bf16((const uint16_t *)x, j);
    return ld8_f16((const _Float16 *)x, j);
}

DEFINE_MIX32(mix32v, v8u)

/* sr_bits of the 8 indices whose low words are lo .. lo + 7 (no wrap: they share `hi`). */
static inline v8u sr_bits8(uint64_t seed, uint32_t lo, uint32_t hi) {
    const v8u i = (v8u){0, 1, 2, 3, 4, 5, 6, 7} + lo;
    return mix32v(mix32v(i ^ (uint32_t)seed) ^ hi);
}

/* enc_sr of 8 lanes, exactly: with e = floor(log2 |y|) clamped to [emin, emax], r = |y| * 2^(m - e)
 * is exact in float32 (a power-of-two scaling), k = floor(r) and f = r - k too (Sterbenz), and so
 * are F = f * 2^24 = q + g (q = floor(F) < 2^24, g in [0, 1)) and g * 256. Rounding up when
 * rb * 2^-32 < f, i.e. rb_hi * 256 + rb_lo < (q + g) * 256 with rb_hi = rb >> 8, rb_lo = rb & 255:
 * rb_hi < q, or rb_hi == q and rb_lo < g * 256 (integers below 2^24 and floats, all exact). */
static inline v8i enc_sr8(v8f y, v8u rb, const elem_t *p) {
    const v8i u = (v8i)y, a = u & 0x7fffffff;
    const v8i e = vmin(vmax((a >> 23) - 127, (v8i){0} + p->emin), (v8i){0} + p->emax);
    const v8f cap = (v8f){0} + (float)(1 << (p->man_bits + 2));
    v8f r = (v8f)a * (v8f)((127 + p->man_bits - e) << 23);
    r = (v8f)vsel(r <= cap, (v8i)r, (v8i)cap); /* NaN: cap (its lane is replaced below) */
    const v8i k = __builtin_convertvector(r, v8i); /* r >= 0: truncation is floor */
    const v8f f = (r - __builtin_convertvector(k, v8f)) * 0x1p24f;
    const v8i q = __builtin_convertvector(f, v8i);
    const v8f g = (f - __builtin_convertvector(q, v8f)) * 256.0f;
    const v8i hi = (v8i)(rb >> 8), lo = (v8i)(rb & 255);
    const v8i up = (hi < q) | ((hi == q) & (v8i)(__builtin_convertvector(lo, v8f) < g));
    v8i code = ((e - p->emin) << p->man_bits) + k - up;
    code = vmin(code, (v8i){0} + p->max_code) | ((u >> 31) & p->sign_mask);
    return vsel(a > 0x7f800000, (v8i){0} + p->nan_code, code);
}

/* Stochastic rounding of y[0..n) with the given random bits, 8 lanes at a time and the tail one
 * by one, as the quantize kernels do it: for the tests, which choose bits at the rounding
 * thresholds. */
void mf_encode_sr(const float *y, const uint32_t *rb, int64_t n, const elem_t *p, uint8_t *out) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        v8f v;
        v8u b;
        memcpy(&v, y + j, 32);
        memcpy(&b, rb + j, 32);
        store8(enc_sr8(v, b, p), out + j);
    }
    for (; j < n; j++) out[j] = (uint8_t)enc_sr(y[j], rb[j], p);
}

typedef void (*amax_fn)(const void *, int64_t, uint32_t *, int *);
static const amax_fn AMAX[3] = {amax_f32, amax_bf16, amax_f16};
static const int ESIZE[3] = {4, 2, 2};

/* Largest finite |x| as float32 (NaN if any and not ignore_nan), over n elements. */
float mf_amax(const void *x, int dt, int64_t n, int ignore_nan, int nthreads) {
    const int64_t step = 1 << 16, nchunks = (n + step - 1) / step;
    uint32_t best = 0;
    int any_nan = 0;
#pragma omp parallel for num_threads(nthreads) reduction(max : best) reduction(| : any_nan) schedule(static)
    for (int64_t k = 0; k < nchunks; k++) {
        uint32_t b = 0;
        int nn = 0;
        const int64_t len = n - k * step < step ? n - k * step : step, l8 = len / 8 * 8;
        const char *xk = (const char *)x + k * step * ESIZE[dt];
        /* the largest |bits| first (2 operations per 8 elements); the exact pass only for a
         * chunk that holds inf or NaN */
        const v8i t8 = dt == DT_F32 ? top_f32(xk, l8, (v8i){0}) : dt == DT_BF16 ? top_bf16(xk, l8, (v8i){0})
                                                                            : top_f16(xk, l8, (v8i){0});
        const uint32_t t = (uint32_t)hmax8(t8);
        if (t < 0x7f800000u) {
            b = t;
            AMAX[dt](xk + l8 * ESIZE[dt], len - l8, &b, &nn);
        } else
            AMAX[dt](xk, len, &b, &nn);
        best = b > best ? b : best;
        any_nan |= nn;
    }
    return (any_nan && !ignore_nan) ? NAN : u2f(best);
}

/* ---- Quantize ----------------------------------------------------------------------------- */
#define CH 2048 /* columns per span: a span of the input and its codes stay in L1/L2 */

typedef struct {
    const void *x;
    int dt;
    int64_t R, K, Kp, br, bc, ngc, row_bytes, cw;
    elem_t p, e4m3;
    vconst_t k, k4m3;
    int bits, mode, rule, sr, no_nan; /* rule: E8M0 0 floor, 1 rceil, 2 least-error; NVFP4 1 Four Over Six. no_nan: the caller knows x holds no NaN */
    float fmt_max, margin_mul, inv_max, s_enc, s_dec;
    const float *given, *e4m3_lut, *tile_amax; /* tile_amax: block maxima from mf_block_amax, or NULL */
    int64_t gs_r, gs_c;
    int lb;
    uint64_t seed;
    uint8_t *out;
    void *scale_out;
} job_t;

/* Encode scale of one block from its finite amax (NaN when the block holds a NaN), storing the
 * block's scale (decode scale, or its E8M0 / E4M3 code) at index t. */
static float block_scale(const job_t *J, float amax, int64_t t) {
    if (J->mode == SC_FP32) {
        float s = J->fmt_max / amax;
        s = s * J->margin_mul;
        if (isinf(s)) s = FLT_MAX;
        if (amax == 0.0f) s = 1.0f;
        ((float *)J->scale_out)[t] = 1.0f / s;
        return s;
    }
    if (J->mode == SC_E8M0) {
        if (isnan(amax)) {
            ((uint8_t *)J->scale_out)[t] = 0xFF;
            return NAN;
        }
        /* floor(log2 v) and ceil(log2 v) from the float32 bits; frexpf only for subnormal v. */
        const float v = J->rule != 1 ? amax : amax * J->inv_max;
        const uint32_t vb = f2u(v), ef = vb >> 23, mant = vb & 0x7fffffu;
        int E;
        if (ef != 0) {
            E = (int)ef - 127 + (J->rule != 1 ? -J->p.emax : (mant != 0));
        } else {
            int e = 0;
            const float m = frexpf(v, &e);
            E = J->rule != 1 ? e - 1 - J->p.emax : (e - 1) + (m != 0.5f);
        }
        E = E < -127 ? -127 : (E > 127 ? 127 : E);
        if (amax == 0.0f) E = 0;
        ((uint8_t *)J->scale_out)[t] = (uint8_t)(E + 127);
        return E <= 126 ? u2f((uint32_t)(127 - E) << 23) : u2f(0x00400000u); /* 2^-E */
    }
    /* SC_NVFP4: E4M3(amax / 6 / tensor scale), decoded, inverted */
    float s = (amax / 6.0f) * J->s_enc;
    if (s > FLT_MAX) s = FLT_MAX;
    const uint32_t code = enc_rne(s, &J->e4m3);
    ((uint8_t *)J->scale_out)[t] = (uint8_t)code;
    const float dec = J->e4m3_lut[code] * J->s_dec;
    return dec == 0.0f ? 0.0f : 1.0f / dec;
}

/* block_scale for 8 FP32- or E8M0-scaled blocks at once (the small MX blocks make this the hot
 * scalar work; NVFP4 has nvfp4_scales); returns 0 when a lane needs the scalar path (subnormal
 * E8M0 input), having stored nothing. */
static inline int block_scales8(const job_t *J, v8f amax, int64_t t, float *enc) {
    const v8i isnan_ = amax != amax;
    v8f e;
    if (J->mode == SC_FP32) {
        v8f s = J->fmt_max / amax;
        s = s * J->margin_mul;
        s = (v8f)vsel(((v8i)s & 0x7fffffff) == 0x7f800000, (v8i){0} + (int32_t)f2u(FLT_MAX), (v8i)s);
        s = (v8f)vsel(amax == 0.0f, (v8i){0} + (int32_t)f2u(1.0f), (v8i)s);
        const v8f d = 1.0f / s;
        memcpy((float *)J->scale_out + t, &d, 32);
        e = s;
    } else { /* SC_E8M0 */
        const v8f v = J->rule != 1 ? amax : amax * J->inv_max;
        const v8i vb = (v8i)v, ef = (vb >> 23) & 0xff, zero = amax == 0.0f;
        if (vany((ef == 0) & ~zero)) return 0; /* subnormal: frexpf in block_scale */
        v8i E = ef - 127 + (J->rule != 1 ? (v8i){0} - J->p.emax : -((vb & 0x7fffff) != 0));
        E = vmax(vmin(E, (v8i){0} + 127), (v8i){0} - 127);
        E = vsel(zero, (v8i){0}, E);
        const v8i code = vsel(isnan_, (v8i){0} + 0xff, E + 127);
        store8(code, (uint8_t *)J->scale_out + t);
        e = (v8f)vsel(E <= 126, (127 - E) << 23, (v8i){0} + 0x00400000);
        e = (v8f)vsel(isnan_, (v8i)((v8f){0} + NAN), (v8i)e);
    }
    memcpy(enc, &e, 32);
    return 1;
}

/* NVFP4's block_scale for the nb blocks from index t, 8 at a time: the E4M3 code of
 * amax / 6 * s_enc, its value times s_dec, inverted. The value comes from the encode itself:
 * encp8_mag rounds |s| * 2^(m - E) to the integer r, so the code stands for r * 2^(E - m) (or
 * for 448 where the code saturates), exactly; no decode of the code. In two passes over the
 * blocks, each made of independent 8-block steps: one pass per block would chain the two
 * divisions with the encode, and measured 16.6 cycles per 8 blocks in a tight loop against 13.5
 * for this (17 for the earlier three passes, which decoded the codes). */
static inline __attribute__((always_inline)) void nvfp4_scales(const job_t *J, const float *amax, int64_t nb,
                                                                int64_t t, float *enc) {
    const int64_t n8 = nb / 8;
    const vconst_t *k = &J->k4m3;
    const v8i lim = (v8i){0} + k->lim0, ulp = (v8i){0} + (J->e4m3.man_bits << 23);
    const float top = J->e4m3_lut[J->e4m3.max_code]; /* 448 */
    v8f s[(CH + 8) / 8];
    for (int64_t i = 0; i < n8; i++) {
        v8f a;
        memcpy(&a, amax + 8 * i, 32);
        const v8f v = (a / 6.0f) * J->s_enc;
        s[i] = (v8f)vsel(v > FLT_MAX, (v8i){0} + (int32_t)f2u(FLT_MAX), (v8i)v);
    }
    for (int64_t i = 0; i < n8; i++) { /* NaN: a NaN block, or a NaN tensor scale (amax = NaN) */
        const v8i nan = s[i] != s[i], e = vmax((v8i)s[i] & 0x7f800000, lim); /* s >= 0 */
        const v8i r = vrne(s[i] * (v8f)(k->fbase - e));
        const v8i code = vminu(r + ((e - lim) >> k->shift), (v8i){0} + k->max_code);
        store8(vsel(nan, (v8i){0} + J->e4m3.nan_code, code), (uint8_t *)J->scale_out + t + 8 * i);
        v8f val = __builtin_convertvector(r, v8f) * (v8f)(e - ulp);
        val = (v8f)vsel(val > top, (v8i)((v8f){0} + top), (v8i)val);
        const v8f dec = val * J->s_dec;
        v8f x = (v8f)vsel(dec == 0.0f, (v8i){0}, (v8i)(1.0f / dec));
        x = (v8f)vsel(nan, (v8i)((v8f){0} + NAN), (v8i)x);
        memcpy(enc + 8 * i, &x, 32);
    }
    for (int64_t b = 8 * n8; b < nb; b++) enc[b] = block_scale(J, amax[b], t + b);
}

/* Four Over Six (NVFP4 with rule 1, arXiv 2512.02010): per block, the E4M3 scale code that maps
 * the amax to 4 (amax / 6 * s_enc * 1.5) replaces nvfp4_scales' code (amax to 6) where the block's
 * round-to-nearest E2M1 codes under it have the smaller sum of squared errors; a tie keeps 6. Each
 * error is decode(code) * dec - x in double, summed over the rows, then the columns, in order:
 * reference._four_over_six's sum, bit for bit (-ffp-contract=off: no fused multiply-add). Padding
 * adds exact zeros and is skipped. A NaN block or tensor scale keeps its NaN code. */
static void four_over_six(const job_t *J, int64_t g, int64_t c0, int64_t nb, const float *amax, int64_t t0,
                          float *enc) {
    static const float E2M1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const int64_t br = J->br, bc = J->bc, K = J->K, r0 = g * br, r1 = r0 + br < J->R ? r0 + br : J->R;
    uint8_t *stored = (uint8_t *)J->scale_out + t0;
    for (int64_t b = 0; b < nb; b++) {
        float s = (amax[b] / 6.0f) * J->s_enc;
        s = s * 1.5f;
        if (s != s) continue;
        if (s > FLT_MAX) s = FLT_MAX;
        const uint32_t code[2] = {stored[b], enc_rne(s, &J->e4m3)};
        if (code[1] == code[0]) continue;
        float dec[2], en[2];
        double err[2] = {0.0, 0.0};
        for (int k = 0; k < 2; k++) {
            dec[k] = J->e4m3_lut[code[k]] * J->s_dec;
            en[k] = dec[k] == 0.0f ? 0.0f : 1.0f / dec[k];
        }
        const int64_t cb = c0 + b * bc, len = cb >= K ? 0 : (cb + bc < K ? bc : K - cb);
        for (int64_t r = r0; r < r1; r++)
            for (int64_t j = 0; j < len; j++) {
                const float x = load(J->x, J->dt, r * K + cb + j);
                for (int k = 0; k < 2; k++) {
                    const uint32_t c = enc_rne(x * en[k], &J->p);
                    const float q = (c & J->p.sign_mask) ? -E2M1[c & 7] : E2M1[c & 7];
                    const double d = (double)q * (double)dec[k] - (double)x;
                    err[k] = err[k] + d * d;
                }
            }
        if (err[1] < err[0]) {
            stored[b] = (uint8_t)code[1];
            enc[b] = en[1];
        }
    }
}

/* The "least-error" E8M0 rule (rule 2; block_scale stored the floor exponent E): per block whose amax
 * the floor clips (amax * 2^-E > max, E < 127), the exponent E + 1 replaces E where the block's
 * round-to-nearest codes under it have the smaller sum of squared errors; a tie keeps E. Each
 * error is value(code) * 2^E - x in double, summed in row-major order (the codes of 8 elements
 * are encoded and decoded at once, the sum stays element by element): reference._best_exponent's
 * sum, bit for bit (-ffp-contract=off). A NaN block keeps its NaN code. */
static void best_exponents(const job_t *J, int64_t g, int64_t c0, int64_t nb, const float *amax, int64_t t0,
                           float *enc) {
    const int64_t br = J->br, bc = J->bc, K = J->K, r0 = g * br, r1 = r0 + br < J->R ? r0 + br : J->R;
    uint8_t *stored = (uint8_t *)J->scale_out + t0;
    const void *x0 = J->x; /* locals: the stores through stored (uint8_t) could alias J's fields */
    const int dt = J->dt;
    const float fmt_max = J->fmt_max;
    const dconst_t dc = dconst(&J->p, J->bits);
    for (int64_t b = 0; b < nb; b++) {
        const int E = (int)stored[b] - 127;
        if (stored[b] == 0xFF || E >= 127 || !(amax[b] * enc[b] > fmt_max)) continue;
        const float en[2] = {enc[b], enc[b] * 0.5f}, dec[2] = {ldexpf(1.0f, E), ldexpf(1.0f, E + 1)};
        double err[2] = {0.0, 0.0};
        const int64_t cb = c0 + b * bc, len = cb >= K ? 0 : (cb + bc < K ? bc : K - cb);
        for (int64_t r = r0; r < r1; r++)
            for (int64_t j = 0; j < len; j += 8) { /* 8 codes encoded and decoded at once; the sums stay in order */
                const int n = len - j < 8 ? (int)(len - j) : 8; /* a partial block's last lanes: zeros, not summed */
                float xs[8] = {0}, q[2][8];
                if (n == 8) {
                    const v8f v = ld8_any(x0, dt, r * K + cb + j);
                    memcpy(xs, &v, 32);
                } else
                    for (int l = 0; l < n; l++) xs[l] = load(x0, dt, r * K + cb + j + l);
                v8f xv;
                memcpy(&xv, xs, 32);
                for (int k = 0; k < 2; k++) {
                    v8i top = {0}, special = {0};
                    const v8f qv = dec8(enc8(xv * en[k], &J->k, &top), &dc, &special);
                    memcpy(q[k], &qv, 32);
                }
                for (int l = 0; l < n; l++)
                    for (int k = 0; k < 2; k++) {
                        const double d = (double)q[k][l] * (double)dec[k] - (double)xs[l];
                        err[k] = err[k] + d * d;
                    }
            }
        if (err[1] < err[0]) {
            stored[b] = (uint8_t)(E + 1 + 127);
            enc[b] = en[1];
        }
    }
}

/* The block amax from the largest |x| bits `top` of its rows [r0, r1) and columns [cb, cb + len):
 * top itself when finite, else the exact pass (largest finite |x|, NaN when the block holds a
 * NaN). The block's largest finite |x| also raises *all. */
static inline __attribute__((always_inline)) float block_result(uint32_t top, const char *x, int64_t r0, int64_t r1,
                                                                int64_t K, int64_t cb, int64_t len, amax_fn AM,
                                                                int esize, uint32_t *all) {
    uint32_t best = top;
    int nan = 0;
    if (top >= 0x7f800000u) {
        best = 0;
        for (int64_t r = r0; r < r1 && len > 0; r++) AM(x + (r * K + cb) * esize, len, &best, &nan);
    }
    *all = best > *all ? best : *all;
    return nan ? NAN : u2f(best);
}

/* amax[b] of the nb blocks of block row g from column c0: the largest finite |x|, NaN when the
 * block holds a NaN. Returns the largest finite |x| of the chunk as float32 bits (NaN ignored). */
static inline __attribute__((always_inline)) uint32_t block_amaxes(const job_t *J, int64_t g, int64_t c0, int64_t nb,
                                                                   amax_fn AM, int dt, int esize, float *amax) {
    const int64_t br = J->br, bc = J->bc, R = J->R, K = J->K;
    const int64_t r0 = g * br, r1 = r0 + br < R ? r0 + br : R; /* rows >= R are padding */
    const char *x = (const char *)J->x;
    uint32_t all = 0;
    v8i fin = {0}; /* the largest of the all-finite groups of 8 blocks */
    int64_t b = 0;
    if (br > 1 && bc % 8 == 0 && K > c0) { /* 2-D: read the rows once, in order; one accumulator per block */
        const int64_t nf = (K - c0) / bc < nb ? (K - c0) / bc : nb; /* whole blocks */
        v8i acc[CH + 8];
        memset(acc, 0, (size_t)nf * sizeof(v8i));
        for (int64_t r = r0; r < r1; r++) {
            const char *xr = x + (r * K + c0) * esize;
            if (dt == DT_F32) rowacc_f32(xr, nf, bc, acc);
            else if (dt == DT_BF16) rowacc_bf16(xr, nf, bc, acc);
            else rowacc_f16(xr, nf, bc, acc);
        }
        for (; b < nf; b++)
            amax[b] = block_result((uint32_t)hmax8(acc[b]), x, r0, r1, K, c0 + b * bc, bc, AM, esize, &all);
    }
    if (bc == 16 || bc == 32) /* 8 whole small blocks at a time */
        for (; b + 8 <= nb && c0 + (b + 8) * bc <= K; b += 8) {
            const char *xb = x + (r0 * K + c0 + b * bc) * esize;
            /* constant widths (MX 32, NVFP4 16): unrolled, the 8 maxima stay in registers */
#define TOPS8(W) (dt == DT_F32 ? tops8_f32(xb, W, r1 - r0, K) : dt == DT_BF16 ? tops8_bf16(xb, W, r1 - r0, K) \
                                                                : tops8_f16(xb, W, r1 - r0, K))
            const v8i t = bc == 16 ? TOPS8(16) : TOPS8(32);
#undef TOPS8
            if (!vany(t > 0x7f7fffff)) { /* all finite: the maxima are the amaxes */
                memcpy(amax + b, &t, 32);
                fin = vmax(fin, t);
            } else
                for (int q = 0; q < 8; q++)
                    amax[b + q] = block_result((uint32_t)t[q], x, r0, r1, K, c0 + (b + q) * bc, bc, AM, esize, &all);
        }
    all = (uint32_t)hmax8(fin) > all ? (uint32_t)hmax8(fin) : all;
    for (; b < nb; b++) { /* one block: whole (max of |bits| first), partial or narrow */
        const int64_t cb = c0 + b * bc, len = cb >= K ? 0 : (cb + bc < K ? bc : K - cb);
        uint32_t top = 0x7f800001u; /* not known: the exact pass */
        if (bc % 8 == 0 && len == bc) {
            v8i t = {0};
            for (int64_t r = r0; r < r1; r++) {
                const char *xr = x + (r * K + cb) * esize;
                t = dt == DT_F32 ? top_f32(xr, bc, t) : dt == DT_BF16 ? top_bf16(xr, bc, t) : top_f16(xr, bc, t);
            }
            top = (uint32_t)hmax8(t);
        }
        amax[b] = block_result(top, x, r0, r1, K, cb, len, AM, esize, &all);
    }
    return all;
}

/* Whether some encode scale is 0, inf or NaN: only then (or with a NaN in x) can x * scale be NaN. */
static int any_unsafe(const float *enc, int64_t n) {
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad |= (f2u(enc[i]) & 0x7fffffffu) - 1u >= 0x7f7fffffu;
    return (int)bad;
}

/* lim[b] for encp8_mag from the E8M0 encode scales enc[b] = 2^k: the |x| bits of 2^(emin - k).
 * Returns 0 when some scale is outside encp8_mag's range (a NaN block, or a block amax below
 * about 2^-110), and the chunk then takes the multiply-first encoder. */
static int pow2_limits(const elem_t *p, const float *enc, int64_t nb, int32_t *lim) {
    const int32_t low = p->man_bits > 1 ? p->man_bits : 1;
    int ok = 1;
    for (int64_t b = 0; b < nb; b++) {
        const int32_t eb = (int32_t)(f2u(enc[b]) >> 23), l = p->emin + 254 - eb; /* enc > 0 or NaN */
        ok &= (eb >= 1) & (eb <= 254) & (l >= low);
        lim[b] = l << 23;
    }
    return ok;
}

/* One chunk: the blocks [c0, c0 + cw) of block row g — amax, scales, encode, pack. */
static inline __attribute__((always_inline)) void quantize_chunk(const job_t *J, int64_t g, int64_t c0,
                                                                 amax_fn AM, int dt, int esize) {
    const int64_t br = J->br, bc = J->bc, R = J->R, K = J->K, r0 = g * br;
    const int64_t c1 = c0 + J->cw < J->Kp ? c0 + J->cw : J->Kp, nb = (c1 - c0) / bc, b0 = c0 / bc;
    const char *x = (const char *)J->x;
    float enc[CH + 8]; /* blocks per chunk: up to CH (1-column blocks) */

    if (J->mode == SC_FP32_GIVEN) {
        for (int64_t b = 0; b < nb; b++) {
            enc[b] = J->given[g * J->gs_r + (b0 + b) * J->gs_c];
            ((float *)J->scale_out)[g * J->ngc + b0 + b] = 1.0f / enc[b];
        }
    } else {
        float buf[CH + 8];
        const int64_t t0 = g * J->ngc + b0;
        const float *amax = J->tile_amax ? J->tile_amax + t0 : buf;
        if (!J->tile_amax) block_amaxes(J, g, c0, nb, AM, dt, esize, buf);
        if (J->mode == SC_NVFP4) {
            nvfp4_scales(J, amax, nb, t0, enc);
            if (J->rule) four_over_six(J, g, c0, nb, amax, t0, enc);
        } else {
            int64_t b = 0;
            for (; b + 8 <= nb; b += 8) {
                v8f a;
                memcpy(&a, amax + b, 32);
                if (!block_scales8(J, a, t0 + b, enc + b))
                    for (int q = 0; q < 8; q++) enc[b + q] = block_scale(J, amax[b + q], t0 + b + q);
            }
            for (; b < nb; b++) enc[b] = block_scale(J, amax[b], t0 + b);
            if (J->rule == 2) best_exponents(J, g, c0, nb, amax, t0, enc);
        }
    }

    /* NaN lanes need finding only if x * scale can be NaN: a NaN in x (which makes its block's
     * computed scale NaN), or a scale of 0, inf or NaN (0 * inf, inf * 0). */
    const int track = (J->mode == SC_FP32_GIVEN && !J->no_nan) || any_unsafe(enc, nb);
    int32_t lim[CH + 8];
    const int pow2 = J->mode == SC_E8M0 && !track && pow2_limits(&J->p, enc, nb, lim);
    float stage[CH];
    uint8_t codes[CH];
    /* Given FP32 scales cannot carry a NaN of x as measured ones do, and FP6 / FP4 codes cannot
     * either: such a block's decode scale becomes NaN (the fix-up pass finds the NaN lanes). */
    float *nan_dec = J->mode == SC_FP32_GIVEN && J->p.nan_code == J->p.sign_mask
                         ? (float *)J->scale_out + g * J->ngc + b0 : NULL;
    /* Prefetch while encoding, so that the next read finds its lines in L2 but not yet evicted. A
     * chunk that reads x twice (amax, then encode) prefetches the next chunk, whose amax pass then
     * finds it in cache: the same row cw columns on, or (chunks of whole rows) the same column br
     * rows on. A chunk of whole rows that reads x once (scales given, or NVFP4's from its first
     * pass) prefetches ONCE elements ahead in memory order (a row ahead is too far: the lines leave
     * L2 before their use). A chunk of part rows that reads x once prefetches its own next row, and
     * from its last row the next chunk's first. Distances measured: README, Performance. */
    enum { ONCE = 1024 };
    const int reads_once = J->mode == SC_FP32_GIVEN || J->tile_amax;
    const int64_t ahead = J->cw < J->Kp ? J->cw : reads_once ? ONCE : br * K;
    const int once = br > 1 && reads_once && J->cw < J->Kp; /* part rows read once: next row, then next chunk */
    /* Spans of at most CH columns that start on block boundaries: whole blocks (bc <= CH), or
     * pieces of one block. Column j of a span lies in its block (j / 8) >> lb (-1: blocks not
     * 8 * 2^k wide, encoded one block at a time). */
    const int64_t sw = bc <= CH ? CH / bc * bc : CH;
    const int lb = bc > CH || nb == 1 ? 62 : J->lb;
    for (int64_t r = r0; r < r0 + br; r++) {
        for (int64_t s0 = c0, n; s0 < c1; s0 += n) {
            const int64_t bend = bc > CH ? c0 + ((s0 - c0) / bc + 1) * bc : c1; /* this span's end */
            n = (bend < c1 ? bend : c1) - s0;
            n = n < sw ? n : sw;
            const float *es = enc + (s0 - c0) / bc;
            uint8_t *dst = J->out + r * J->row_bytes + s0 * J->bits / 8;
            uint8_t *cd = J->bits == 8 ? dst : codes;
            const int64_t nin = r < R ? (K - s0 < n ? (K - s0 > 0 ? K - s0 : 0) : n) : 0;
            const char *src = x + (r * K + s0) * esize;
            int64_t pf = !once ? ahead : r + 1 < r0 + br ? K : c1 < J->Kp ? J->cw - (br - 1) * K : K - c0;
            if (nin < n) { /* padding: zeros past the last row / column (nothing to prefetch) */
                pf = 0;
                for (int64_t j = 0; j < n; j++) stage[j] = j < nin ? load(x, dt, r * K + s0 + j) : 0.0f;
                src = (const char *)stage;
            }
            const int sdt = nin < n ? DT_F32 : dt;
            if (J->sr) {
                const uint64_t i0 = (uint64_t)(r * J->Kp + s0);
                uint32_t hi = sr_hi(J->seed, i0);
                int64_t b = 0, left = bc > CH ? n : bc; /* spans start on a block boundary */
                for (int64_t j = 0, w; j < n; j += w, left -= w) {
                    if (left == 0) b++, left = bc;
                    const uint64_t i = i0 + (uint64_t)j;
                    if ((uint32_t)i == 0 && j > 0) hi = sr_hi(J->seed, i); /* crossed a 2^32 boundary */
                    if (left >= 8 && j + 8 <= n && (uint32_t)i <= 0xfffffff8u) { /* 8 lanes, one block */
                        const v8f v = ld8_any(src, sdt, j);
                        store8(enc_sr8(v * es[b], sr_bits8(J->seed, (uint32_t)i, hi), &J->p), cd + j);
                        if (nan_dec && vany((v8i)(v != v))) nan_dec[(s0 - c0) / bc + b] = NAN;
                        w = 8;
                    } else {
                        const float v = load(src, sdt, j);
                        cd[j] = (uint8_t)enc_sr(v * es[b], sr_bits(J->seed, i, hi), &J->p);
                        if (nan_dec && isnan(v)) nan_dec[(s0 - c0) / bc + b] = NAN;
                        w = 1;
                    }
                }
            } else {
                for (int64_t b = 0, step = lb >= 0 ? n : bc; b * step < n; b++) { /* one call, or one per block */
                    const int64_t o = b * step, len = n - o < step ? n - o : step;
                    const float *e = lb >= 0 ? es : es + b;
                    const int l = lb >= 0 ? lb : 62;
                    const int32_t *lm = pow2 && l >= 2 ? lim + (e - enc) : NULL;
                    float *nd = nan_dec ? nan_dec + (e - enc) : NULL;
                    uint8_t *out = lb >= 0 ? dst : cd; /* one call packs as it encodes; one per block stages */
                    const int bits = lb >= 0 ? J->bits : 8;
                    if (sdt == DT_F32) encode_f32(src + o * 4, len, e, lm, l, &J->k, &J->p, out + o, bits, pf * 4, track, nd);
                    else if (sdt == DT_BF16) encode_bf16(src + o * 2, len, e, lm, l, &J->k, &J->p, out + o, bits, pf * 2, track, nd);
                    else encode_f16(src + o * 2, len, e, lm, l, &J->k, &J->p, out + o, bits, pf * 2, track, nd);
                }
            }
            if (J->bits != 8 && (J->sr || lb < 0)) pack_codes(codes, n, J->bits, dst);
        }
    }
}

/* Columns per 1-D chunk (blocks of one row): amax, scales and encode of CW1D columns back to back,
 * prefetching the next chunk; a chunk's input (4 KiB of fp32) and codes stay in L1 between the
 * passes. The width was chosen by measurement (README, Performance). */
#define CW1D 1024

/* Columns per chunk: whole blocks; 1-D: CW1D columns or one block. */
static int64_t chunk_width(int64_t br, int64_t bc, int64_t Rp, int64_t Kp, int nthreads) {
    if (br > 1) { /* 2-D: a band of br rows, read in order for the block maxima, then again (from L2/L3) to
                   * encode. Whole rows where the band holds at most 2^22 elements (16 MiB of fp32), so that
                   * its first read is one contiguous stream, which runs at the speed of a plain sum (a
                   * band of part rows reads br short strided runs). Wider rows: chunks of 2^22 / br
                   * columns. */
        int64_t cw = (1 << 22) / br < CH * bc ? (1 << 22) / br : CH * bc;
        cw = cw / bc * bc;
        cw = cw >= Kp ? Kp : cw < bc ? bc : cw;
        /* Few block rows: narrower chunks (of at least 2048 columns), as many as make the chunks
         * a multiple of the threads, or 4 per thread, so that the threads finish together. */
        const int64_t ngr = Rp / br, T = nthreads;
        int64_t per_row = (Kp + cw - 1) / cw;
        while (T > 1 && (ngr * per_row) % T != 0 && ngr * per_row < 4 * T) per_row++;
        int64_t w = ((Kp + per_row - 1) / per_row + bc - 1) / bc * bc, least = (CH + bc - 1) / bc * bc;
        w = w > least ? w : least;
        cw = w < cw ? w : cw;
        return cw;
    }
    return bc >= CW1D ? bc : CW1D / bc * bc;
}

/* lb with bc == 8 << lb, or -1 when the blocks are not 8 * 2^k columns wide. */
static int block_shift(int64_t bc) {
    for (int lb = 0; lb < 40; lb++)
        if ((int64_t)8 << lb == bc) return lb;
    return -1;
}

/* mf_quantize's arguments, one struct (minifloat.kernels.cpu.QuantizeArgs mirrors it field for
 * field). x: R x K input of dtype dt, quantized as its Rp x Kp zero-padded view in br x bc
 * blocks; given: the encode scales (mode SC_FP32_GIVEN) at strides gs_r, gs_c of the scale grid;
 * tile_amax: NVFP4 block maxima from mf_block_amax, or NULL; out / scale_out: codes and scales. */
typedef struct {
    const void *x;
    const elem_t *elem, *e4m3;
    const float *given, *e4m3_lut, *tile_amax;
    uint8_t *out;
    void *scale_out;
    int64_t R, K, Rp, Kp, br, bc, gs_r, gs_c;
    uint64_t seed;
    int32_t dt, bits, mode, rule, sr, no_nan, nthreads;
    float fmt_max, margin_mul, inv_max, s_enc, s_dec;
} quantize_args_t;

void mf_quantize(const quantize_args_t *a) {
    const int64_t cw = chunk_width(a->br, a->bc, a->Rp, a->Kp, a->nthreads);
    const int dt = a->dt;
    job_t J = {a->x, dt, a->R, a->K, a->Kp, a->br, a->bc, a->Kp / a->bc, a->Kp * a->bits / 8, cw,
               *a->elem, *a->e4m3, vconst(a->elem, a->bits), vconst(a->e4m3, 8), a->bits, a->mode, a->rule, a->sr,
               a->no_nan, a->fmt_max, a->margin_mul, a->inv_max, a->s_enc, a->s_dec, a->given, a->e4m3_lut,
               a->tile_amax, a->gs_r, a->gs_c, block_shift(a->bc), a->seed, a->out, a->scale_out};
    const int64_t ngr = a->Rp / a->br, nch = (a->Kp + J.cw - 1) / J.cw;
#pragma omp parallel for num_threads(a->nthreads) schedule(static) collapse(2)
    for (int64_t g = 0; g < ngr; g++)
        for (int64_t ch = 0; ch < nch; ch++) {
            if (dt == DT_F32) quantize_chunk(&J, g, ch * J.cw, amax_f32, DT_F32, 4);
            else if (dt == DT_BF16) quantize_chunk(&J, g, ch * J.cw, amax_bf16, DT_BF16, 2);
            else quantize_chunk(&J, g, ch * J.cw, amax_f16, DT_F16, 2);
        }
}

/* First pass of NVFP4's two-level scaling: the block maxima (as quantize_chunk's phase 1 computes
 * them) into tile_amax (the scale grid), and the tensor's largest finite |x| (NaN ignored), so
 * that mf_quantize's second pass reads 1/16 of the data to get its block scales back. */
float mf_block_amax(const void *x, int dt, int64_t R, int64_t K, int64_t Rp, int64_t Kp, int64_t br, int64_t bc,
                    float *tile_amax, int nthreads) {
    job_t J = {0};
    J.x = x, J.dt = dt, J.R = R, J.K = K, J.Kp = Kp, J.br = br, J.bc = bc, J.ngc = Kp / bc;
    J.cw = chunk_width(br, bc, Rp, Kp, nthreads);
    const int64_t ngr = Rp / br, nch = (Kp + J.cw - 1) / J.cw;
    uint32_t all = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) collapse(2) reduction(max : all)
    for (int64_t g = 0; g < ngr; g++)
        for (int64_t ch = 0; ch < nch; ch++) {
            const int64_t c0 = ch * J.cw, c1 = c0 + J.cw < Kp ? c0 + J.cw : Kp;
            float *dst = tile_amax + g * J.ngc + c0 / bc;
            uint32_t m;
            if (dt == DT_F32) m = block_amaxes(&J, g, c0, (c1 - c0) / bc, amax_f32, DT_F32, 4, dst);
            else if (dt == DT_BF16) m = block_amaxes(&J, g, c0, (c1 - c0) / bc, amax_bf16, DT_BF16, 2, dst);
            else m = block_amaxes(&J, g, c0, (c1 - c0) / bc, amax_f16, DT_F16, 2, dst);
            all = m > all ? m : all;
        }
    return u2f(all);
}

/* ---- Dequantize: out[r, c] = value(code) * dec_scale[block] for r < R, c < K ---------------- */
static inline v8i load_codes8(const uint8_t *c) {
#ifdef __AVX2__
    return (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
#else
    v8i v;
    for (int k = 0; k < 8; k++) v[k] = c[k];
    return v;
#endif
}

#ifdef __AVX2__
/* o[0..32) = the float32s whose bytes 3 and 2 are b3 and b2 (codes 0-15 | 16-31, low bytes zero),
 * each times the scale of its block: sv[((j0 + i) / 8) >> lb]. */
static inline void store_values32(__m256i b3, __m256i b2, const float *sv, int lb, float *o, int64_t j0) {
    const __m256i z = _mm256_setzero_si256();
    const __m256i wl = _mm256_unpacklo_epi8(b2, b3), wh = _mm256_unpackhi_epi8(b2, b3); /* 0-7|16-23, 8-15|24-31 */
    const __m256i f0 = _mm256_unpacklo_epi16(z, wl), f1 = _mm256_unpackhi_epi16(z, wl);
    const __m256i f2 = _mm256_unpacklo_epi16(z, wh), f3 = _mm256_unpackhi_epi16(z, wh);
    const v8f v[4] = {(v8f)_mm256_permute2x128_si256(f0, f1, 0x20), (v8f)_mm256_permute2x128_si256(f2, f3, 0x20),
                      (v8f)_mm256_permute2x128_si256(f0, f1, 0x31), (v8f)_mm256_permute2x128_si256(f2, f3, 0x31)};
    for (int q = 0; q < 4; q++) {
        const v8f w = v[q] * sv[((j0 >> 3) + q) >> lb];
        memcpy(o + 8 * q, &w, 32);
    }
}

/* o[j] = value(code j) * sv[(j / 8) >> lb] for the n codes packed two per byte in pk, by table:
 * every value of a 4-bit format (E2M1) is a float32 whose low 16 bits are zero, so two 16-entry
 * byte lookups (vpshufb) give its bits; 32 codes take ~20 operations instead of ~60. */
static inline void fp4_values(const uint8_t *pk, int64_t n, const float *sv, int lb, __m256i t3, __m256i t2,
                              const float *lut, float *o) {
    const __m128i nib = _mm_set1_epi8(15);
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(pk + j / 2));
        const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
        const __m256i c = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi)); /* 0-15 | 16-31 */
        const __m256i b3 = _mm256_shuffle_epi8(t3, c), b2 = _mm256_shuffle_epi8(t2, c);
        store_values32(b3, b2, sv, lb, o + j, j);
    }
    for (; j < n; j++) o[j] = lut[(pk[j / 2] >> (j & 1) * 4) & 15] * sv[(j >> 3) >> lb];
}

/* The same for 6-bit codes (4 per 3 bytes, see pack_codes): 32-entry tables of the magnitudes'
 * bytes (two lookups and a blend each), the sign from bit 5; reads whole 16-byte groups within
 * the avail bytes from pk. */
static inline void fp6_values(const uint8_t *pk, int64_t n, int64_t avail, const float *sv, int lb,
                              const __m256i *t, const float *lut, float *o) {
    const __m256i m15 = _mm256_set1_epi8(15), b16 = _mm256_set1_epi8(16);
    int64_t j = 0;
    for (; j + 32 <= n && j / 4 * 3 + 28 <= avail; j += 32) {
        const __m256i c = _mm256_set_m128i(unpack6x16(pk + (j + 16) / 4 * 3), unpack6x16(pk + j / 4 * 3));
        const __m256i idx = _mm256_and_si256(c, m15);
        const __m256i upper = _mm256_cmpeq_epi8(_mm256_and_si256(c, b16), b16); /* magnitudes 16-31 */
        const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi8(32)), 2); /* bit 5 -> 7 */
        const __m256i b3 = _mm256_or_si256(
            _mm256_blendv_epi8(_mm256_shuffle_epi8(t[0], idx), _mm256_shuffle_epi8(t[1], idx), upper), sign);
        const __m256i b2 = _mm256_blendv_epi8(_mm256_shuffle_epi8(t[2], idx), _mm256_shuffle_epi8(t[3], idx), upper);
        store_values32(b3, b2, sv, lb, o + j, j);
    }
    for (; j < n; j++) {
        const uint8_t *g = pk + j / 4 * 3;
        const uint32_t w = (uint32_t)g[0] | ((uint32_t)g[1] << 8) | ((uint32_t)g[2] << 16);
        o[j] = lut[(w >> (j & 3) * 6) & 63] * sv[(j >> 3) >> lb];
    }
}
#endif

/* scales: float32 decode scales (slut NULL), or 8-bit scale codes decoded as slut[code] * ts. */
void mf_dequantize(const uint8_t *data, int64_t Kp, int64_t br, int64_t bc, int bits, const elem_t *p,
                   const float *lut, const void *scales, const float *slut, float ts, int64_t R, int64_t K,
                   float *out, int nthreads) {
    const int64_t ngc = Kp / bc, row_bytes = Kp * bits / 8, nsp = (K + CH - 1) / CH;
    const int lb = ngc == 1 ? 62 : block_shift(bc);
    const dconst_t d = dconst(p, bits);
    /* 4- and 6-bit formats whose values all have zero low 16 bits decode by byte tables of
     * their magnitudes (fp4_values / fp6_values): bytes 3 and 2 of the float32 bits of codes
     * 0-31; 6-bit codes with the sign bit must be those of their magnitude, negated. */
#ifdef __AVX2__
    uint8_t b3[32] = {0}, b2[32] = {0};
    int by_table = bits == 4 || bits == 6;
    for (int c = 0; c < 1 << bits && by_table; c++) {
        const uint32_t u = f2u(lut[c]), m = f2u(lut[c & 31]) | (bits == 6 && (c & 32) ? 0x80000000u : 0);
        by_table = (u & 0xffff) == 0 && (bits == 4 || u == m);
        if (c < 32) b3[c] = (uint8_t)(u >> 24), b2[c] = (uint8_t)(u >> 16);
    }
    __m256i tab[4]; /* byte 3 of codes 0-15, 16-31; byte 2 of codes 0-15, 16-31 */
    for (int h = 0; h < 4; h++)
        tab[h] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)((h < 2 ? b3 : b2) + 16 * (h & 1))));
#endif
#define SCALE(t) (slut ? slut[((const uint8_t *)scales)[t]] * ts : ((const float *)scales)[t])
#pragma omp parallel for num_threads(nthreads) schedule(static) collapse(2)
    for (int64_t r = 0; r < R; r++)
        for (int64_t sp = 0; sp < nsp; sp++) {
            const int64_t s0 = sp * CH, n = K - s0 < CH ? K - s0 : CH; /* output columns [s0, s0 + n) */
            const uint8_t *row = data + r * row_bytes;
            const int64_t t0 = (r / br) * ngc; /* this row's first block */
            float *o = out + r * K + s0;
            /* sv[q]: the scale of the span's q-th block; column s0 + j lies in block (j / 8) >> lb */
            float sv[CH / 8 + 1];
            if (lb >= 0) {
                const int64_t fb = ngc == 1 ? 0 : s0 / bc, nbs = ngc == 1 ? 1 : (n + bc - 1) / bc;
                for (int64_t q = 0; q < nbs; q++) sv[q] = SCALE(t0 + fb + q);
            }
#ifdef __AVX2__
            if (lb >= 0 && by_table) {
                if (bits == 4) fp4_values(row + s0 / 2, n, sv, lb, tab[0], tab[2], lut, o);
                else fp6_values(row + s0 / 4 * 3, n, (Kp - s0) / 4 * 3, sv, lb, tab, lut, o);
                continue;
            }
#endif
            uint8_t buf[CH + 32];
            const uint8_t *codes = row + s0;
            if (bits != 8) {
                const int64_t g = bits == 4 ? 2 : 4, nu = (n + g - 1) / g * g; /* whole pack groups */
                unpack_codes(row + s0 * bits / 8, nu, bits, buf);
                codes = buf;
            }
            if (lb < 0) { /* blocks not 8 * 2^k wide: one column at a time */
                for (int64_t j = 0; j < n; j++) o[j] = lut[codes[j]] * SCALE(t0 + (s0 + j) / bc);
                continue;
            }
            v8i special = {0};
            int64_t j = 0;
            for (; j + 8 <= n; j += 8) {
                const v8f v = dec8(load_codes8(codes + j), &d, &special) * sv[(j >> 3) >> lb];
                memcpy(o + j, &v, 32);
            }
            for (; j < n; j++) o[j] = lut[codes[j]] * sv[(j >> 3) >> lb];
            if (vany(special)) /* NaN / inf codes: from the table */
                for (j = 0; j < n; j++)
                    if ((codes[j] & d.mag_mask) > d.max_mag) o[j] = lut[codes[j]] * sv[(j >> 3) >> lb];
        }
#undef SCALE
}

/* ---- Transpose: dst (C x R) = src (R x C)ᵀ, for the column-wise operands of training -------- */
/* Tiles of 32 x 32 elements that stay in L1, transposed 8 x 8 at a time in registers (4- and
 * 2-byte elements): every line of src and dst is touched once, where torch's copy of a transposed
 * view strides through dst one element at a time. */
#define TT 32
#ifdef __AVX2__
static inline void transpose8x8_f32(const float *s, int64_t ls, float *d, int64_t ld) {
    const __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + ls), r2 = _mm256_loadu_ps(s + 2 * ls),
                 r3 = _mm256_loadu_ps(s + 3 * ls), r4 = _mm256_loadu_ps(s + 4 * ls), r5 = _mm256_loadu_ps(s + 5 * ls),
                 r6 = _mm256_loadu_ps(s + 6 * ls), r7 = _mm256_loadu_ps(s + 7 * ls);
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
                 t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
                 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee),
                 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee),
                 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee),
                 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
    _mm256_storeu_ps(d, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(d + ld, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(d + 2 * ld, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(d + 3 * ld, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(d + 4 * ld, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(d + 5 * ld, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(d + 6 * ld, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(d + 7 * ld, _mm256_permute2f128_ps(u3, u7, 0x31));
}

static inline void transpose8x8_u16(const uint16_t *s, int64_t ls, uint16_t *d, int64_t ld) {
    __m128i r[8], t[8], u[8];
    for (int k = 0; k < 8; k++) r[k] = _mm_loadu_si128((const __m128i *)(s + k * ls));
    for (int k = 0; k < 4; k++) {
        t[2 * k] = _mm_unpacklo_epi16(r[2 * k], r[2 * k + 1]);     /* a0 b0 a1 b1 a2 b2 a3 b3 */
        t[2 * k + 1] = _mm_unpackhi_epi16(r[2 * k], r[2 * k + 1]); /* a4 b4 ... a7 b7 */
    }
    for (int k = 0; k < 2; k++)
        for (int h = 0; h < 2; h++) {
            u[4 * k + 2 * h] = _mm_unpacklo_epi32(t[4 * k + h], t[4 * k + 2 + h]);
            u[4 * k + 2 * h + 1] = _mm_unpackhi_epi32(t[4 * k + h], t[4 * k + 2 + h]);
        }
    for (int h = 0; h < 4; h++) {
        _mm_storeu_si128((__m128i *)(d + (2 * h) * ld), _mm_unpacklo_epi64(u[h], u[4 + h]));
        _mm_storeu_si128((__m128i *)(d + (2 * h + 1) * ld), _mm_unpackhi_epi64(u[h], u[4 + h]));
    }
}
#endif

/* Tile [i0, i1) x [j0, j1) of src (R x C) into dst (C x R); elements of esize 4 or 2 bytes. */
static inline void transpose_tile(const void *src, void *dst, int esize, int64_t R, int64_t C, int64_t i0, int64_t i1,
                                  int64_t j0, int64_t j1) {
#ifdef __AVX2__
    if (i1 - i0 == TT && j1 - j0 == TT) { /* whole tiles: 8 x 8 in registers */
        for (int64_t i = i0; i < i1; i += 8)
            for (int64_t j = j0; j < j1; j += 8) {
                if (esize == 4) transpose8x8_f32((const float *)src + i * C + j, C, (float *)dst + j * R + i, R);
                else transpose8x8_u16((const uint16_t *)src + i * C + j, C, (uint16_t *)dst + j * R + i, R);
            }
        return;
    }
#endif
    for (int64_t i = i0; i < i1; i++)
        for (int64_t j = j0; j < j1; j++) {
            if (esize == 4) ((uint32_t *)dst)[j * R + i] = ((const uint32_t *)src)[i * C + j];
            else ((uint16_t *)dst)[j * R + i] = ((const uint16_t *)src)[i * C + j];
        }
}

void mf_transpose(const void *src, void *dst, int64_t R, int64_t C, int esize, int nthreads) {
    const int64_t nti = (R + TT - 1) / TT, ntj = (C + TT - 1) / TT;
#pragma omp parallel for num_threads(nthreads) schedule(static) collapse(2)
    for (int64_t ti = 0; ti < nti; ti++)
        for (int64_t tj = 0; tj < ntj; tj++) {
            const int64_t i0 = ti * TT, j0 = tj * TT;
            transpose_tile(src, dst, esize, R, C, i0, i0 + TT < R ? i0 + TT : R, j0, j0 + TT < C ? j0 + TT : C);
        }
}

/* ---- Random Hadamard transform of NVFP4 (16-point fast Walsh-Hadamard transform) ----------- */
/* y = FWHT16(x * s) / 4 per group of 16, in kernels/reference.py rht's order (rounds h = 1, 2, 4,
 * 8: (a, b) -> (a + b, a - b)), so the bits are the reference's. One pass over memory, where a
 * 16 x 16 matrix product through the BLAS ran at about 1.4 Gelem/s here. */
static inline void rht16_scalar(const float *x, const float *s, float *y) {
    float v[16];
    for (int i = 0; i < 16; i++) v[i] = x[i] * s[i];
    for (int h = 1; h < 16; h *= 2)
        for (int i = 0; i < 16; i++)
            if (!(i & h)) {
                const float a = v[i], b = v[i + h];
                v[i] = a + b, v[i + h] = a - b;
            }
    for (int i = 0; i < 16; i++) y[i] = v[i] * 0.25f;
}

#ifdef __AVX2__
/* (a, b) pairs h apart inside a register: the partner w from a permute; sums kept where the
 * lane is the pair's first (a + b), differences w - v = a - b where it is the second (the
 * lanes of the immediate SECOND). */
#define FWHT_ROUND(v, w, SECOND) _mm256_blend_ps(_mm256_add_ps(v, w), _mm256_sub_ps(w, v), SECOND)

static inline __m256 fwht8(__m256 v) {
    v = FWHT_ROUND(v, _mm256_permute_ps(v, 0xB1), 0xAA);           /* h = 1 */
    v = FWHT_ROUND(v, _mm256_permute_ps(v, 0x4E), 0xCC);           /* h = 2 */
    return FWHT_ROUND(v, _mm256_permute2f128_ps(v, v, 0x01), 0xF0); /* h = 4 */
}
#undef FWHT_ROUND
#endif

void mf_rht16(const float *x, float *y, int64_t ngroups, const float *s, int nthreads) {
    const int64_t per = 1024, nch = (ngroups + per - 1) / per;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < nch; c++) {
        const int64_t g1 = (c + 1) * per < ngroups ? (c + 1) * per : ngroups;
        int64_t g = c * per;
#ifdef __AVX2__
        const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8), q = _mm256_set1_ps(0.25f);
        for (; g < g1; g++) {
            const __m256 lo = fwht8(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * g), s0));
            const __m256 hi = fwht8(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * g + 8), s1));
            _mm256_storeu_ps(y + 16 * g, _mm256_mul_ps(_mm256_add_ps(lo, hi), q)); /* h = 8 */
            _mm256_storeu_ps(y + 16 * g + 8, _mm256_mul_ps(_mm256_sub_ps(lo, hi), q));
        }
#endif
        for (; g < g1; g++) rht16_scalar(x + 16 * g, s, y + 16 * g);
    }
}
