/* Fused CPU kernels for scaled quantization (loaded with ctypes; no Python API used).
 *
 * Each function equals a reference in minifloat/quantize.py + minifloat/codec.py bit for bit;
 * tests/test_kernels.py checks it. Built by setup.py with -O3 -fopenmp -ffp-contract=off:
 * no fused multiply-adds and no fast-math, so every float operation rounds as PyTorch's does.
 *
 * Element encoding (round to nearest even, saturating) works on the float32 bits:
 *   normal results:    code = (bits + rebias + half - 1 + lsb) >> (23 - m)   (carry = next binade)
 *   subnormal results: code = bits(|y| + magic) - bits(magic), magic = 2^(emin - m + 23),
 *                      so the FPU's own rounding picks the nearest multiple of 2^(emin - m).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <float.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef struct {
    int32_t man_bits, emin, emax, max_code, sign_mask, nan_code; /* NaN encodes canonically */
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

/* Counter-based stochastic-rounding bits of element i: codec.sr_bits, bit for bit. */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return x ^ (x >> 16);
}

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
        double mag = fabs((double)y);
        int e = 0;
        if (mag > 0) { frexp(mag, &e); e -= 1; } else { e = p->emin; }
        if (e < p->emin) e = p->emin;
        if (e > p->emax) e = p->emax;
        double r = ldexp(mag, p->man_bits - e);
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

/* Hot loops, one copy per input dtype, written with GCC vector extensions (8 lanes: AVX2
 * where the build machine has it, SSE otherwise) so that they vectorize whatever the compiler's
 * auto-vectorizer decides. The scalar tails call the same scalar code as everything else. */
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef _Float16 v8x __attribute__((vector_size(16)));

static inline v8u vsel(v8i m, v8u a, v8u b) { return ((v8u)m & a) | (~(v8u)m & b); }

/* Largest of 8 lanes in three shuffle steps (the small MX/NVFP4 tiles reduce every 16/32). */
static inline uint32_t hmax8(v8u v) {
    v8u s = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v = vsel(s > v, s, v);
    s = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v = vsel(s > v, s, v);
    s = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    v = vsel(s > v, s, v);
    return v[0];
}

/* Store the low byte of each of 8 lanes (GCC scalarizes __builtin_convertvector here). */
static inline void store8(v8u c, uint8_t *dst) {
#ifdef __AVX2__
    const __m256i bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                           0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i t = _mm256_shuffle_epi8((__m256i)c, bytes);
    t = _mm256_permutevar8x32_epi32(t, _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
    _mm_storel_epi64((__m128i *)dst, _mm256_castsi256_si128(t));
#else
    for (int k = 0; k < 8; k++) dst[k] = (uint8_t)c[k];
#endif
}

#define DEFINE_LOOPS(NAME, T, LOAD1, LOAD8)                                                     \
    static inline float ld1_##NAME(const T *x, int64_t i) { return LOAD1; }                    \
    static inline v8f ld8_##NAME(const T *x, int64_t i) { LOAD8; }                              \
    static inline __attribute__((always_inline)) void amax_##NAME(const void *xv, int64_t n, uint32_t *best_out, int *nan_out) {     \
        const T *x = (const T *)xv;                                                            \
        v8u best = {0}, top = {0};                                                             \
        int64_t i = 0;                                                                         \
        for (; i + 8 <= n; i += 8) {                                                           \
            v8u a = (v8u)ld8_##NAME(x, i) & 0x7fffffffu;                                       \
            top = vsel(a > top, a, top);                                                       \
            a = vsel(a >= 0x7f800000u, (v8u){0}, a);                                           \
            best = vsel(a > best, a, best);                                                    \
        }                                                                                      \
        uint32_t b = *best_out, t = hmax8(top);                                                \
        b = hmax8(best) > b ? hmax8(best) : b;                                                 \
        for (; i < n; i++) {                                                                   \
            uint32_t a = f2u(ld1_##NAME(x, i)) & 0x7fffffffu;                                   \
            t = a > t ? a : t;                                                                 \
            a = a >= 0x7f800000u ? 0 : a;                                                      \
            b = a > b ? a : b;                                                                 \
        }                                                                                      \
        *best_out = b;                                                                         \
        *nan_out |= t > 0x7f800000u;                                                           \
    }                                                                                          \
    static inline __attribute__((always_inline)) void encode_##NAME(const void *xv, int64_t n, float enc, elem_t p,                 \
                              uint8_t *restrict codes) {                                       \
        const T *x = (const T *)xv;                                                            \
        const uint32_t shift = 23 - p.man_bits;                                                \
        const v8u round = (v8u){0} + (p.rebias + (1u << (shift - 1)) - 1);                     \
        const v8f magic = (v8f){0} + u2f(p.magic_bits);                                        \
        int64_t j = 0;                                                                         \
        for (; j + 8 <= n; j += 8) {                                                           \
            v8u u = (v8u)(ld8_##NAME(x, j) * enc);                                              \
            v8u a = u & 0x7fffffffu;                                                           \
            v8u sub = (v8u)((v8f)a + magic) - p.magic_bits;                                    \
            v8u nrm = (a + round + ((a >> shift) & 1u)) >> shift;                              \
            v8u c = vsel(a < p.min_normal_bits, sub, nrm);                                     \
            c = vsel(a > p.max_bits, (v8u){0} + (uint32_t)p.max_code, c);                      \
            c |= vsel((v8i)u < 0, (v8u){0} + (uint32_t)p.sign_mask, (v8u){0});                 \
            c = vsel(a > 0x7f800000u, (v8u){0} + (uint32_t)p.nan_code, c);                      \
            store8(c, codes + j);                                                              \
        }                                                                                      \
        for (; j < n; j++) codes[j] = (uint8_t)enc_rne(ld1_##NAME(x, j) * enc, &p);            \
    }

DEFINE_LOOPS(f32, float, x[i], v8f v; memcpy(&v, x + i, 32); return v)
DEFINE_LOOPS(bf16, uint16_t, u2f((uint32_t)x[i] << 16),
             v8h h; memcpy(&h, x + i, 16); return (v8f)(__builtin_convertvector(h, v8u) << 16))
DEFINE_LOOPS(f16, _Float16, (float)x[i], v8x h; memcpy(&h, x + i, 16); return __builtin_convertvector(h, v8f))

typedef void (*amax_fn)(const void *, int64_t, uint32_t *, int *);
typedef void (*encode_fn)(const void *, int64_t, float, elem_t, uint8_t *);
static const amax_fn AMAX[3] = {amax_f32, amax_bf16, amax_f16};
static const int ESIZE[3] = {4, 2, 2};

/* Largest finite |x| as float32 bits (NaN -> flagged), over n elements. */
float mf_amax(const void *x, int dt, int64_t n, int ignore_nan, int nthreads) {
    const int64_t step = 1 << 16, nchunks = (n + step - 1) / step;
    uint32_t best = 0;
    int any_nan = 0;
#pragma omp parallel for num_threads(nthreads) reduction(max : best) reduction(| : any_nan) schedule(static)
    for (int64_t k = 0; k < nchunks; k++) {
        uint32_t b = 0;
        int nn = 0;
        const int64_t len = n - k * step < step ? n - k * step : step;
        AMAX[dt]((const char *)x + k * step * ESIZE[dt], len, &b, &nn);
        best = b > best ? b : best;
        any_nan |= nn;
    }
    return (any_nan && !ignore_nan) ? NAN : u2f(best);
}

static void pack_codes(const uint8_t *c, int64_t n, int bits, uint8_t *out) {
    if (bits == 8) { memcpy(out, c, (size_t)n); return; }
    if (bits == 4) {
        int64_t i = 0;
#ifdef __AVX2__
        /* 16 codes -> 8 bytes: maddubs forms c[2i] + 16 c[2i+1] per 16-bit lane, packus narrows. */
        const __m128i lo_hi = _mm_set1_epi16(0x1001);
        for (; i + 16 <= n; i += 16) {
            const __m128i pairs = _mm_maddubs_epi16(_mm_loadu_si128((const __m128i *)(c + i)), lo_hi);
            _mm_storel_epi64((__m128i *)(out + i / 2), _mm_packus_epi16(pairs, pairs));
        }
#endif
        for (; i + 1 < n; i += 2) out[i / 2] = (uint8_t)(c[i] | (c[i + 1] << 4));
        return;
    }
    for (int64_t g = 0; g < n / 4; g++) { /* FP6: see packing.py for the layout */
        const uint8_t *q = c + 4 * g;
        out[3 * g] = (uint8_t)(q[0] | ((q[1] & 3) << 6));
        out[3 * g + 1] = (uint8_t)((q[1] >> 2) | ((q[2] & 15) << 4));
        out[3 * g + 2] = (uint8_t)((q[2] >> 4) | (q[3] << 2));
    }
}

#define CHUNK 256

/* Quantize the (R, K) input padded to (Rp, Kp) in tiles of (br, bc): amax, scale, encode, pack.
 * params: element format; e4m3: the E4M3 params (NVFP4 block scales).
 * given/gs_r/gs_c: SC_FP32_GIVEN encode scales (strides 0 broadcast one value).
 * scale_out: float decode scales (SC_FP32*) or uint8 scale codes (E8M0, E4M3), grid row-major. */
#define TILE_ARGS const void *x, int dt, int64_t R, int64_t K, int64_t Kp, int64_t br, int64_t bc, \
    const elem_t *p, int bits, int mode, int rule, float fmt_max, float margin_mul, float inv_max,     \
    const float *given, int64_t gs_r, int64_t gs_c, float s_enc, float s_dec, const elem_t *e4m3,      \
    const float *e4m3_lut, int sr, uint64_t seed, uint8_t *out, void *scale_out, int64_t ngc,         \
    int64_t row_bytes, int64_t ti, int64_t tj
#define TILE_PASS x, dt, R, K, Kp, br, bc, p, bits, mode, rule, fmt_max, margin_mul, inv_max, given, gs_r, \
    gs_c, s_enc, s_dec, e4m3, e4m3_lut, sr, seed, out, scale_out, ngc, row_bytes, ti, tj

/* One tile: amax, scale, encode, pack. Inlined once per input dtype (AM/EN are constants). */
static inline __attribute__((always_inline)) void quantize_tile(TILE_ARGS, amax_fn AM, encode_fn EN,
                                                                int esize) {
    const int64_t t = ti * ngc + tj, r0 = ti * br, c0 = tj * bc;
    const int64_t c1 = c0 + bc < K ? c0 + bc : K;
    float enc = 1.0f;
    if (mode != SC_FP32_GIVEN) {
        uint32_t best = 0;
        int any_nan = 0;
        for (int64_t r = r0; r < r0 + br && r < R; r++)
            if (c1 > c0) AM((const char *)x + (r * K + c0) * esize, c1 - c0, &best, &any_nan);
        const float amax = any_nan ? NAN : u2f(best);
        if (mode == SC_FP32) {
            float s = fmt_max / amax;
            s = s * margin_mul;
            if (isinf(s)) s = FLT_MAX;
            if (amax == 0.0f) s = 1.0f;
            enc = s;
            ((float *)scale_out)[t] = 1.0f / enc;
        } else if (mode == SC_E8M0) {
            if (any_nan) {
                enc = NAN;
                ((uint8_t *)scale_out)[t] = 0xFF;
            } else {
                /* floor(log2 v) and ceil(log2 v) from the float32 bits; frexpf only for
                 * subnormal v (rare), where the exponent field says nothing. */
                const float v = rule == 0 ? amax : amax * inv_max;
                const uint32_t vb = f2u(v), ef = vb >> 23, mant = vb & 0x7fffffu;
                int E;
                if (ef != 0) {
                    E = (int)ef - 127 + (rule == 0 ? -p->emax : (mant != 0));
                } else {
                    int e = 0;
                    const float m = frexpf(v, &e);
                    E = rule == 0 ? e - 1 - p->emax : (e - 1) + (m != 0.5f);
                }
                E = E < -127 ? -127 : (E > 127 ? 127 : E);
                if (amax == 0.0f) E = 0;
                enc = E <= 126 ? u2f((uint32_t)(127 - E) << 23) : u2f(0x00400000u); /* 2^-E */
                ((uint8_t *)scale_out)[t] = (uint8_t)(E + 127);
            }
        } else { /* SC_NVFP4 */
            float s = (amax / 6.0f) * s_enc;
            if (s > FLT_MAX) s = FLT_MAX;
            const uint32_t code = enc_rne(s, e4m3);
            ((uint8_t *)scale_out)[t] = (uint8_t)code;
            const float dec = e4m3_lut[code] * s_dec;
            enc = dec == 0.0f ? 0.0f : 1.0f / dec;
        }
    } else {
        enc = given[ti * gs_r + tj * gs_c];
        ((float *)scale_out)[t] = 1.0f / enc;
    }

    uint8_t codes[CHUNK];
    for (int64_t r = r0; r < r0 + br; r++) {
        for (int64_t c = c0; c < c0 + bc; c += CHUNK) {
            const int64_t n = c0 + bc - c < CHUNK ? c0 + bc - c : CHUNK;
            const int64_t nin = r < R ? (K - c < n ? (K - c > 0 ? K - c : 0) : n) : 0;
            if (sr) {
                const uint64_t i0 = (uint64_t)(r * Kp + c);
                uint32_t hi = sr_hi(seed, i0);
                for (int64_t j = 0; j < n; j++) {
                    const uint64_t i = i0 + (uint64_t)j;
                    if ((uint32_t)i == 0 && j > 0) hi = sr_hi(seed, i); /* crossed a 2^32 boundary */
                    const float v = j < nin ? load(x, dt, r * K + c + j) : 0.0f;
                    codes[j] = (uint8_t)enc_sr(v * enc, sr_bits(seed, i, hi), p);
                }
            } else {
                uint8_t *dst = bits == 8 ? out + r * row_bytes + c : codes;
                EN((const char *)x + (r * K + c) * esize, nin, enc, *p, dst);
                for (int64_t j = nin; j < n; j++) dst[j] = (uint8_t)enc_rne(0.0f * enc, p);
                if (bits == 8) continue;
            }
            pack_codes(codes, n, bits, out + r * row_bytes + c * bits / 8);
        }
    }
}

void mf_quantize(const void *x, int dt, int64_t R, int64_t K, int64_t Rp, int64_t Kp,
                 int64_t br, int64_t bc, const elem_t *p, int bits, int mode, int rule,
                 float fmt_max, float margin_mul, float inv_max, const float *given, int64_t gs_r,
                 int64_t gs_c, float s_enc, float s_dec, const elem_t *e4m3, const float *e4m3_lut,
                 int sr, uint64_t seed, uint8_t *out, void *scale_out, int nthreads) {
    const int64_t ngr = Rp / br, ngc = Kp / bc;
    const int64_t row_bytes = Kp * bits / 8;
#pragma omp parallel for num_threads(nthreads) schedule(static) collapse(2)
    for (int64_t ti = 0; ti < ngr; ti++)
        for (int64_t tj = 0; tj < ngc; tj++) {
            if (dt == DT_F32) quantize_tile(TILE_PASS, amax_f32, encode_f32, 4);
            else if (dt == DT_BF16) quantize_tile(TILE_PASS, amax_bf16, encode_bf16, 2);
            else quantize_tile(TILE_PASS, amax_f16, encode_f16, 2);
        }
}

/* Dequantize: out[r, c] = lut[code] * dec_scale[tile] for r < R, c < K (cropped, row-major). */
void mf_dequantize(const uint8_t *data, int64_t Kp, int64_t br, int64_t bc, int bits,
                   const float *lut, const float *dec_scale, int64_t R, int64_t K, float *out,
                   int nthreads) {
    const int64_t ngc = Kp / bc, row_bytes = Kp * bits / 8;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *row = data + r * row_bytes;
        const float *ds = dec_scale + (r / br) * ngc;
        float *o = out + r * K;
        for (int64_t jb = 0; jb < ngc; jb++) {
            const float s = ds[jb];
            const int64_t ca = jb * bc, cb = ca + bc < K ? ca + bc : K;
            if (bits == 8) {
                for (int64_t c = ca; c < cb; c++) o[c] = lut[row[c]] * s;
            } else if (bits == 4) {
                for (int64_t c = ca; c < cb; c++) o[c] = lut[(row[c >> 1] >> ((c & 1) * 4)) & 15] * s;
            } else {
                for (int64_t c = ca; c < cb; c++) {
                    const uint8_t *g = row + 3 * (c >> 2);
                    const uint32_t w = (uint32_t)g[0] | ((uint32_t)g[1] << 8) | ((uint32_t)g[2] << 16);
                    o[c] = lut[(w >> (6 * (c & 3))) & 63] * s;
                }
            }
        }
    }
}
