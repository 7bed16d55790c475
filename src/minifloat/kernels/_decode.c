/* A decoder step in one call: M ≤ 16 tokens (a decode step, a speculative verification, a
 * prefill chunk) through every layer of a Llama-shaped decoder — RMSNorm, Q/K/V projections
 * (biases where the model has them, QK-norm where it has it), rotary embedding from the model's
 * own tables, attention over the KV cache (float32 or bfloat16, a sliding window per layer),
 * O projection, the SiLU-gated MLP, the final norm and the head — with no Python between the
 * operations. The eager model pays the interpreter and torch's dispatch for each of the ~20
 * operations of each layer; at decode sizes that costs more than the products
 * (minifloat.infer.generation.fused, which builds mf_model_t from a transformers model, says
 * how much).
 *
 * Every Linear is either a float32 weight (`dense`: one pass over W per call, each row of W
 * multiplied with every row of x while it is in L1) or a packed one read in place by the decode
 * kernels (`mf_gemv` of _gemv.c, with the plan minifloat.kernels.gemv made). The operations
 * follow the eager model's formulas in the same order, so results equal it up to float32
 * summation order (and the libm's last bit in exp).
 *
 * KV cache layout: layer × KV head × position × head_dim, positions 0 … capacity − 1; a call
 * writes positions pos … pos + M − 1 (rotated keys, as transformers' caches hold them), then row m
 * attends to positions ≤ pos + m (and > pos + m − window on a sliding-window layer). A bfloat16
 * cache rounds to nearest even, as torch's conversion does (NaN stays NaN).
 */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_gemv.h"

#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_thread_num(void) { return 0; }
#endif

#if defined(__x86_64__) || defined(__i386__)
#define MF_X86 1
#include <immintrin.h>
#define D512 __attribute__((target("avx512f,avx2,fma")))
#define D256 __attribute__((target("avx2,fma")))
#else
#define MF_X86 0
#endif

enum { LIN_ABSENT = 0, LIN_DENSE = 1, LIN_PACKED = 2 }; /* mf_lin_t.kind; absent: the GPT's k and v (in q: its fused qkv) and gate */
enum { NORM_RMS = 0, NORM_LAYER = 1 };
/* the MLP's activation: ACT_DEFAULT is SiLU on a gated MLP's gate, exact (erf) GELU on an ungated one;
 * ACT_GELU_TANH the tanh approximation of GELU on either (GPT-2's gelu_new, Gemma's GeGLU); ACT_RELU
 * max(u, 0) on an ungated one (OPT's) */
enum { ACT_DEFAULT = 0, ACT_GELU_TANH = 1, ACT_RELU = 2 };
#define MAX_HEAD_DIM 512 /* fused.MAX_HEAD_DIM: the rotary embedding's and a KV row's scratch */

/* Must match Linear in minifloat/infer/generation/fused.py field for field (as the structs below). */
typedef struct {
    const float *w;         /* LIN_DENSE: N × K float32, contiguous */
    const float *bias;      /* N float32, or NULL */
    const float *rot_signs; /* a Hadamard rotation of the input (rot_n signs, ±1), or NULL */
    gemv_args_t g;          /* LIN_PACKED: the weight's plan (x, y, M, isa and nthreads are set per call) */
    int64_t N, K, rot_n;    /* rot_n: the rotation's group width, dividing K */
    int32_t kind, pad;
} mf_lin_t;

typedef struct {
    mf_lin_t q, k, v, o, gate, up, down;
    const float *attn_norm, *mlp_norm; /* the norms' weights, hidden each */
    const float *attn_norm_b, *mlp_norm_b; /* LayerNorm's biases (NULL: none) */
    const float *q_norm, *k_norm;      /* QK-norm weights (head_dim), or NULL */
    const float *attn_out_norm, *mlp_out_norm; /* RMSNorms of the attention's and the MLP's outputs before
                                                * each is added to the residual (Gemma's sandwich), or NULL */
    int64_t window;                    /* sliding window in tokens; 0: every position */
    int64_t rope2;                     /* 1: this layer's rotary tables are the model's cos2 / sin2 */
    /* A mixture of experts in place of the MLP (n_expert > 0): the router's product (n_expert
     * outputs), each expert's gate, up and down products (experts[3e …]), the experts each row
     * takes, and whether their weights are renormalized to sum 1 (`moe`). */
    mf_lin_t router;
    const mf_lin_t *experts;
    int64_t n_expert, top_k, norm_topk;
    int64_t moe_kind;      /* MOE_*: how the router weighs the experts and what an expert computes */
    float swiglu_alpha, swiglu_limit; /* MOE_GPT_OSS's clamped SwiGLU */
    const float *sinks;    /* per query head, a learned logit in every row's softmax (GPT-OSS), or NULL */
    /* Qwen2-MoE's shared expert, when its product is not LIN_ABSENT: one output per row, whose
     * sigmoid weighs the dense SiLU-gated MLP in the layer's gate, up and down slots */
    mf_lin_t shared_gate;
} mf_layer_t;

/* MOE_SOFTMAX_TOPK (Mixtral, Qwen-MoE): the softmax of the router's logits, the top_k of it,
 * experts down(silu(gate(h)) · up(h)); MOE_GPT_OSS: the top_k logits (the router has a bias),
 * their softmax, experts down(((up + 1) · gate · σ(α gate))) of one gate-up product whose rows
 * alternate gate, up (gate clamped above at the limit, up to ± the limit), biases on both. */
enum { MOE_SOFTMAX_TOPK = 0, MOE_GPT_OSS = 1 };

/* KV formats: float32 and bfloat16 as they are; FP8 (E4M3, a float32 scale per head's row),
 * NVFP4 (E2M1, E4M3 scales per 16 values, a float32 tensor scale per stored chunk), MXFP4 (E2M1,
 * E8M0 scales per 32, exponent rounded up) packed: minifloat.infer.generation.kvspec's formats,
 * quantized as its KVCache quantizes them (a chunk is what one call stores of a layer's K, or V). */
enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8 = 2, KV_NVFP4 = 3, KV_MXFP4 = 4 };

typedef struct {
    int32_t kind, window;    /* KV_*; window (packed kinds): the first `sinks` and the last `recent` tokens in bfloat16 */
    int64_t sinks, recent;
    int64_t *aged;           /* packed kinds: positions sinks … *aged − 1 are packed (all, without a window) */
    void *k, *v;             /* KV_F32 / KV_BF16: n_layer × n_kv × capacity × head_dim */
    uint8_t *kc, *vc;        /* packed: codes, n_layer × n_kv × capacity × row bytes */
    void *ks, *vs;           /* packed: scales, n_layer × n_kv × capacity × (head_dim / block) codes; FP8: one float32 */
    float *kts, *vts;        /* NVFP4: the tensor scale of each token's chunk, n_layer × capacity */
    uint16_t *ksink, *vsink; /* window: n_layer × n_kv × sinks × head_dim bfloat16 */
    uint16_t *kring, *vring; /* window: n_layer × n_kv × recent × head_dim bfloat16, position p in slot p % recent */
    const float *e4m3, *e8m0, *e2m1; /* the formats' value tables, by code (256, 256, 16) */
    /* KVCache's row transforms (kvtransforms.py): rot, rot_t the head_dim × head_dim Hadamard
     * rotation R and its transpose, or NULL — every stored K row (and V row with rot_v) is x·R,
     * queries are rotated instead of each K row rotated back ((q·R)·(x·R) = q·x), and with
     * rot_v the attention output is rotated back once; pre_rope: K rows are stored before the
     * rotary embedding and get it as attention reads them (never with rot). */
    const float *rot, *rot_t;
    int32_t rot_v, pre_rope;
    /* channel (KIVI, packed kinds with a window): keys of packed positions quantized per channel
     * over blocks of `group` tokens (16 NVFP4, 32 MXFP4 and FP8), which age a whole block at a
     * time (positions sinks + b·group …, block b); kc then holds n_layer × n_kv × blocks × head_dim
     * × (a channel's block: group codes), ks n_layer × n_kv × blocks × head_dim scales (FP8: its
     * chunk's float32 scale for each block of it); the ring holds recent + group positions. */
    int32_t channel, pad;
    int64_t group, blocks;
    const float *cos_t, *sin_t; /* channel and pre_rope: the rotary tables transposed, head_dim × capacity */
} mf_kv_t;

typedef struct {
    int64_t n_layer, hidden, n_head, n_kv, head_dim, inter, vocab, capacity;
    float eps, scale; /* RMSNorm's epsilon; the attention scores' scale */
    float attn_softcap, logit_softcap; /* > 0: scores, logits capped as cap · tanh(x / cap) (Gemma 2's); 0: not */
    int32_t nthreads, isa, serial_below, norm; /* norm: NORM_RMS (Llama's) or NORM_LAYER (the built-in GPT's) */
    int32_t gate_up, act; /* gate_up: `up` is one product of gate and up (Phi-3's gate_up_proj: [gate | up]), `gate` absent;
                           * act: ACT_* */
    const float *cos, *sin; /* capacity × head_dim: the rotary tables (rotate-half form); NULL: no rotary embedding */
    const float *cos2, *sin2; /* the tables of the layers with rope2 (Gemma 3's sliding layers), or NULL */
    const mf_layer_t *layers;
    const float *final_norm, *final_norm_b;
    mf_lin_t head;
    mf_kv_t kv;
    double *timers; /* NULL, or seconds added up per kind of work (T_*): a profile */
} mf_model_t;

enum { T_GEMV = 0, T_ATTENTION = 1, T_OTHER = 2 }; /* the products; attention and the cache; norms, RoPE, SiLU, residuals */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* With timers: the time since *t0 added to kind `k`, *t0 moved to now. */
static inline void lap(const mf_model_t *m, double *t0, int k) {
    if (!m->timers) return;
    const double t = now();
    m->timers[k] += t - *t0;
    *t0 = t;
}

int64_t mf_decode_sizes(int64_t *out) { /* the bindings check their mirrors of the structs against these */
    out[0] = (int64_t)sizeof(mf_lin_t);
    out[1] = (int64_t)sizeof(mf_layer_t);
    out[2] = (int64_t)sizeof(mf_model_t);
    out[3] = (int64_t)offsetof(mf_model_t, timers);
    out[4] = (int64_t)sizeof(mf_kv_t);
    return 5;
}

/* ---- dot products --------------------------------------------------------------------------- */
static float dot_c(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int q = 0; q < 8; q++) acc[q] += a[i + q] * b[i + q];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

#if MF_X86
D256 static float dot256(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    float r = _mm_cvtss_f32(h);
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

D512 static float dot512(const float *a, const float *b, int64_t n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
        s2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 32), _mm512_loadu_ps(b + i + 32), s2);
        s3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 48), _mm512_loadu_ps(b + i + 48), s3);
    }
    for (; i + 16 <= n; i += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    if (i < n) { /* the tail, masked */
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
        s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), s1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

/* The sum of a 16-lane vector in a fixed order: lanes i + (i + 8), then of those j + (j + 4), then
 * (0 + 2) and (1 + 3), then those two. pair1 … pair4 take several sums at once in the same order,
 * so a product's float32 result is the same whichever way its tile summed it: pair1 of (a, b):
 * [a's 8 first sums, b's 8]; pair2 of two pair1s: the 4 second sums of each of their 4 vectors, 128
 * bits each; pair3 of two pair2s: in each 128-bit group g, [p's two third sums, q's two]; pair4 of
 * two pair3s: in group g, the whole sums [x's 2g, x's 2g + 1, y's 2g, y's 2g + 1] — of the 16
 * vectors a_0 … a_15 that fed pair1 in order, element 4g + j is a_{4j + g}'s sum. One tile's 16
 * sums: 45 operations against 16 × 8 one at a time (SmolLM2's FP32 products, C harness,
 * interleaved: 4-16 rows of x 2-3 % faster, one row 1 %). */
D512 static inline __attribute__((always_inline)) float sum16(__m512 a) {
    const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    const __m128 f = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 h = _mm_add_ps(f, _mm_movehl_ps(f, f)); /* [f0 + f2, f1 + f3, …] */
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
D512 static inline __attribute__((always_inline)) __m512 pair1(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
D512 static inline __attribute__((always_inline)) __m512 pair2(__m512 s, __m512 t) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(s, t, 0x88), _mm512_shuffle_f32x4(s, t, 0xDD));
}
D512 static inline __attribute__((always_inline)) __m512 pair3(__m512 p, __m512 q) {
    return _mm512_add_ps(_mm512_shuffle_ps(p, q, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(p, q, _MM_SHUFFLE(3, 2, 3, 2)));
}
D512 static inline __attribute__((always_inline)) __m512 pair4(__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Rows n … n + NR − 1 of W (K columns) against R rows of x, NR, R ≤ 4: one accumulator per pair,
 * the columns in order, so a product does not depend on how many rows came with it (a speculative
 * verification's logits equal single steps'). Each 16 columns: NR + R loads for NR · R FMAs, and
 * the same columns of the rows two tiles on asked for ahead (the hardware prefetcher alone left
 * 2-16 rows of x waiting on memory; SmolLM2's 211 FP32 products, 2 threads: 8 rows of x 21.0 ms
 * → 15.1, 16 rows 25.5 → 17.5, one row 12.3 either way). A prefetch past the end of W is a hint,
 * which never faults. */
D512 static inline __attribute__((always_inline)) void tile512(const float *x, int64_t K, const float *w, float *y,
                                                               int64_t N, const int R, const int NR) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < NR; q++) acc[r][q] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[4];
        for (int q = 0; q < NR; q++) _mm_prefetch((const char *)(w + (8 + q) * K + k), _MM_HINT_T0);
        for (int q = 0; q < NR; q++) wv[q] = _mm512_loadu_ps(w + q * K + k);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_loadu_ps(x + r * K + k);
            for (int q = 0; q < NR; q++) acc[r][q] = _mm512_fmadd_ps(xv, wv[q], acc[r][q]);
        }
    }
    if (k < K) {
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1u);
        __m512 wv[4];
        for (int q = 0; q < NR; q++) wv[q] = _mm512_maskz_loadu_ps(m, w + q * K + k);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * K + k);
            for (int q = 0; q < NR; q++) acc[r][q] = _mm512_fmadd_ps(xv, wv[q], acc[r][q]);
        }
    }
    if (R == 4 && NR == 4) { /* the 16 sums at once (pair1 … pair4 above), element 4q + r: row r, column q */
        __m512 s[8], u[4];
        for (int t = 0; t < 8; t++) s[t] = pair1(acc[t >> 1][(2 * t) & 3], acc[t >> 1][(2 * t + 1) & 3]);
        for (int t = 0; t < 4; t++) u[t] = pair2(s[2 * t], s[2 * t + 1]);
        const __m512 rq = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
                                                pair4(pair3(u[0], u[1]), pair3(u[2], u[3])));
        _mm_storeu_ps(y, _mm512_castps512_ps128(rq));
        _mm_storeu_ps(y + N, _mm512_extractf32x4_ps(rq, 1));
        _mm_storeu_ps(y + 2 * N, _mm512_extractf32x4_ps(rq, 2));
        _mm_storeu_ps(y + 3 * N, _mm512_extractf32x4_ps(rq, 3));
    } else if (R == 1 && NR == 4) { /* a decode step's: the 4 sums at once, element 4q: column q */
        const __m512 u = pair2(pair1(acc[0][0], acc[0][1]), pair1(acc[0][2], acc[0][3])), v = pair3(u, u);
        const __m512 q4 = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), pair4(v, v));
        _mm_storeu_ps(y, _mm512_castps512_ps128(q4));
    } else
        for (int r = 0; r < R; r++)
            for (int q = 0; q < NR; q++) y[r * N + q] = sum16(acc[r][q]);
}

#define TILE_CASE(R, NR) \
    case (R) * 8 + (NR): tile512(x, K, w, y, N, R, NR); break;
/* y[r][n0 + q] for every row r < M of x and q < NR ≤ 4, by tiles of ≤ 4 rows of x */
D512 static void tiles512(const float *x, int64_t M, int64_t K, const float *w, float *y, int64_t N, int NR) {
    for (int64_t r0 = 0; r0 < M; r0 += 4, x += 4 * K, y += 4 * N) {
        const int R = M - r0 < 4 ? (int)(M - r0) : 4;
        switch (R * 8 + NR) {
            TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3) TILE_CASE(1, 4)
            TILE_CASE(2, 1) TILE_CASE(2, 2) TILE_CASE(2, 3) TILE_CASE(2, 4)
            TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(3, 3) TILE_CASE(3, 4)
            TILE_CASE(4, 1) TILE_CASE(4, 2) TILE_CASE(4, 3) TILE_CASE(4, 4)
        }
    }
}
#undef TILE_CASE

/* acc += p · v over n floats */
D512 static void axpy512(float *acc, float p, const float *v, int64_t n) {
    const __m512 pp = _mm512_set1_ps(p);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pp, _mm512_loadu_ps(v + i), _mm512_loadu_ps(acc + i)));
    for (; i < n; i++) acc[i] += p * v[i];
}
#endif

static void axpy_c(float *acc, float p, const float *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) acc[i] += p * v[i];
}

typedef float (*dot_t)(const float *, const float *, int64_t);
typedef void (*axpy_t)(float *, float, const float *, int64_t);

static dot_t dot_for(int isa) {
#if MF_X86
    if (isa == ISA_AVX512) return dot512;
    if (isa == ISA_AVX2) return dot256;
#endif
    (void)isa;
    return dot_c;
}

static axpy_t axpy_for(int isa) {
#if MF_X86
    if (isa == ISA_AVX512) return axpy512;
#endif
    (void)isa;
    return axpy_c;
}

/* ---- the operations ------------------------------------------------------------------------- */
static int threads_for(const mf_model_t *m, int64_t n) { return n < m->serial_below ? 1 : m->nthreads; }
/* Threads for each row's own work (norms, RoPE, activations: the same operations on each row, so a
 * row's results do not depend on the thread): split by rows from 4 rows on. SmolLM2, 2 threads, one
 * process: 4-16 rows 2-6 % faster (16 rows of FP32 22.0 → 20.7 ms), 1 row unchanged; at 2 rows the
 * split measured within ±3 % either way. */
static int row_threads(const mf_model_t *m, int64_t M) { return M < 4 ? 1 : m->nthreads; }

/* Each rot_n-wide group of x (M × K) times T = diag(s) · H / sqrt(rot_n), into out: v ⊙ s, then
 * the butterflies (v[i], v[i + h]) → (v[i] + v[i + h], v[i] − v[i + h]) for h = 1, 2, …, then
 * × 1/sqrt(rot_n) — minifloat.kernels.reference.rht's order, so the same float32 results. */
static void rotate(const mf_lin_t *l, const float *x, int64_t M, float *out) {
    const int64_t n = l->rot_n, total = M * l->K;
    const float inv = (float)(1.0 / sqrt((double)n));
    for (int64_t g = 0; g < total; g += n) {
        float *v = out + g;
        for (int64_t i = 0; i < n; i++) v[i] = x[g + i] * l->rot_signs[i];
        for (int64_t h = 1; h < n; h *= 2)
            for (int64_t i = 0; i < n; i++)
                if ((i & h) == 0) {
                    const float a = v[i], b = v[i + h];
                    v[i] = a + b, v[i + h] = a - b;
                }
        for (int64_t i = 0; i < n; i++) v[i] *= inv;
    }
}

/* y (M × N) = x (M × K) · Wᵀ + bias (x rotated first where the layer says) */
static int linear(const mf_model_t *m, const mf_lin_t *l, const float *x, int64_t M, float *y) {
    const int64_t N = l->N, K = l->K;
    const int nt = threads_for(m, N * K);
    float *rx = NULL;
    if (l->rot_signs) {
        if (!(rx = mf_alloc64((size_t)(M * K) * sizeof(float)))) return -1;
        rotate(l, x, M, rx);
        x = rx;
    }
    if (l->kind == LIN_PACKED) {
        for (int64_t r0 = 0; r0 < M; r0 += MMAX) { /* the decode kernels take MMAX rows a call */
            gemv_args_t a = l->g;
            a.x = x + r0 * K, a.y = y + r0 * N, a.M = M - r0 < MMAX ? M - r0 : MMAX, a.isa = m->isa, a.nthreads = nt;
            if (mf_gemv(&a) != 0) {
                free(rx);
                return -1;
            }
        }
    } else if (MF_X86 && m->isa == ISA_AVX512) {
#if MF_X86
        const float *w = l->w;
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t n = 0; n < N; n += 4) tiles512(x, M, K, w + n * K, y + n, N, N - n < 4 ? (int)(N - n) : 4);
#endif
    } else {
        const dot_t dot = dot_for(m->isa);
        const float *w = l->w;
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t n = 0; n < N; n++)
            for (int64_t r = 0; r < M; r++) y[r * N + n] = dot(x + r * K, w + n * K, K);
    }
    free(rx);
    if (l->bias)
        for (int64_t r = 0; r < M; r++)
            for (int64_t n = 0; n < N; n++) y[r * N + n] += l->bias[n];
    return 0;
}

/* out = w · (x · 1/sqrt(mean(x²) + eps)) over n values (transformers' RMSNorm, in float32) */
static void rms_norm(const float *x, const float *w, float eps, int64_t n, float *out) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int q = 0; q < 8; q++) acc[q] += x[i + q] * x[i + q];
    float ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* out = (x − mean) / sqrt(var + eps) · w + b over n values (torch's LayerNorm, biased variance) */
static void layer_norm(const float *x, const float *w, const float *b, float eps, int64_t n, float *out) {
    float sum = 0.0f, sq = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i];
    const float mean = sum / (float)n;
    for (int64_t i = 0; i < n; i++) sq += (x[i] - mean) * (x[i] - mean);
    const float r = 1.0f / sqrtf(sq / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] - mean) * r * w[i] + (b ? b[i] : 0.0f);
}

/* GELU's tanh approximation as transformers computes it (NewGELUActivation, gelu(approximate="tanh")):
 * 0.5 u (1 + tanh(√(2/π) (u + 0.044715 u³))) */
static inline float gelu_tanh(float u) { return 0.5f * u * (1.0f + tanhf(0.7978845608028654f * (u + 0.044715f * u * u * u))); }

/* One row's MLP activation into g (I values): silu(gate) · up — from u's [gate | up] where the model
 * has one gate-up product, else gate in g and up in u — GeGLU's gelu_tanh(gate) · up, or ungated,
 * the activation of u. */
static void activate_row(const mf_model_t *m, int gated, int64_t I, float *g, const float *u) {
    if (m->gate_up)
        for (int64_t i = 0; i < I; i++) g[i] = u[i] / (1.0f + expf(-u[i])) * u[I + i];
    else if (gated && m->act == ACT_GELU_TANH)
        for (int64_t i = 0; i < I; i++) g[i] = gelu_tanh(g[i]) * u[i];
    else if (gated)
        for (int64_t i = 0; i < I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    else if (m->act == ACT_GELU_TANH)
        for (int64_t i = 0; i < I; i++) g[i] = gelu_tanh(u[i]);
    else if (m->act == ACT_RELU) /* NaN stays NaN, as torch's relu keeps it */
        for (int64_t i = 0; i < I; i++) g[i] = u[i] < 0.0f ? 0.0f : u[i];
    else
        for (int64_t i = 0; i < I; i++) g[i] = 0.5f * u[i] * (1.0f + erff(u[i] * 0.70710678118654752f)); /* gelu(fc) */
}

/* Forward declaration: a Linear's product (below). */
static int linear(const mf_model_t *m, const mf_lin_t *l, const float *x, int64_t M, float *y);

/* A mixture-of-experts layer over M rows of h (hidden each), into out, as transformers' Mixtral /
 * Qwen-MoE blocks compute it: the router's logits, their softmax in float32, each row's top_k
 * experts by probability (the lower index first among equals), their probabilities renormalized
 * to sum 1 with norm_topk; then, expert by expert in ascending order (transformers' loop over
 * experts), out[row] += weight · down(silu(gate(h)) · up(h)) for the rows that chose it — those
 * rows multiplied together, each summed as it would be alone. GPT-OSS's router and experts as
 * MOE_GPT_OSS says; a shared expert (Qwen2-MoE) added last. Returns 0, -1 out of memory. */
static int moe(const mf_model_t *m, const mf_layer_t *L, const float *h, int64_t M, float *out) {
    const int64_t E = L->n_expert, K = L->top_k, H = m->hidden;
    const int64_t I = L->moe_kind == MOE_GPT_OSS ? L->experts[0].N / 2 : L->experts[0].N; /* one gate-up product: 2I rows */
    const int shared = L->shared_gate.kind != LIN_ABSENT;
    const int64_t wide = shared && L->up.N > I ? L->up.N : I; /* the shared expert's width may differ */
    float *buf = malloc((size_t)(M * E + M * K + 2 * M * H + 3 * M * wide + M) * sizeof(float));
    int64_t *pick = malloc((size_t)(M * K + M) * sizeof(int64_t));
    if (!buf || !pick) {
        free(buf);
        free(pick);
        return -1;
    }
    float *p = buf, *w = p + M * E, *xs = w + M * K, *ys = xs + M * H, *g = ys + M * H, *u = g + M * wide, *sg = u + 2 * M * wide;
    int64_t *rows = pick + M * K;
    int rc = linear(m, &L->router, h, M, p);
    const int oss = L->moe_kind == MOE_GPT_OSS;
    for (int64_t r = 0; r < M && rc == 0; r++) {
        float *pr = p + r * E, mx = pr[0], sum = 0.0f;
        if (!oss) { /* the softmax over every expert, then its top_k */
            for (int64_t e = 1; e < E; e++) mx = pr[e] > mx ? pr[e] : mx;
            for (int64_t e = 0; e < E; e++) sum += (pr[e] = expf(pr[e] - mx));
            for (int64_t e = 0; e < E; e++) pr[e] /= sum;
        }
        float chosen = 0.0f;
        for (int64_t j = 0; j < K; j++) { /* the j-th largest probability not chosen yet */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= pick[r * K + i] == e;
                if (!taken && (best < 0 || pr[e] > pr[best])) best = e;
            }
            pick[r * K + j] = best, w[r * K + j] = pr[best], chosen += pr[best];
        }
        if (oss) { /* the softmax of the top_k logits (the first is their largest) */
            const float top = w[r * K];
            float total = 0.0f;
            for (int64_t j = 0; j < K; j++) total += (w[r * K + j] = expf(w[r * K + j] - top));
            for (int64_t j = 0; j < K; j++) w[r * K + j] /= total;
        } else if (L->norm_topk)
            for (int64_t j = 0; j < K; j++) w[r * K + j] /= chosen;
    }
    memset(out, 0, (size_t)(M * H) * sizeof(float));
    for (int64_t e = 0; e < E && rc == 0; e++) {
        int64_t n = 0;
        for (int64_t r = 0; r < M; r++)
            for (int64_t j = 0; j < K; j++)
                if (pick[r * K + j] == e) {
                    rows[n] = r * K + j; /* the row and its slot */
                    memcpy(xs + n++ * H, h + r * H, (size_t)H * sizeof(float));
                }
        if (n == 0) continue;
        const mf_lin_t *x3 = L->experts + 3 * e;
        if (oss) { /* one product, rows alternating gate and up, into u (n × 2I) */
            if (linear(m, x3, xs, n, u)) {
                rc = -1;
                break;
            }
            const float a = L->swiglu_alpha, lim = L->swiglu_limit;
            for (int64_t i = 0; i < n * I; i++) {
                float gt = u[2 * i], up = u[2 * i + 1];
                gt = gt > lim ? lim : gt; /* torch's clamp: NaN stays NaN */
                up = up > lim ? lim : (up < -lim ? -lim : up);
                g[i] = (up + 1.0f) * (gt * (1.0f / (1.0f + expf(-(gt * a)))));
            }
        } else {
            if (linear(m, x3, xs, n, g) || linear(m, x3 + 1, xs, n, u)) {
                rc = -1;
                break;
            }
            for (int64_t i = 0; i < n * I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i]; /* silu(gate) · up */
        }
        if (linear(m, x3 + 2, g, n, ys)) {
            rc = -1;
            break;
        }
        for (int64_t i = 0; i < n; i++) {
            float *o = out + (rows[i] / K) * H;
            const float wt = w[rows[i]];
            for (int64_t c = 0; c < H; c++) o[c] = o[c] + ys[i * H + c] * wt;
        }
    }
    if (shared && rc == 0) { /* out += sigmoid(shared_gate(h)) · down(silu(gate(h)) · up(h)), as Qwen2-MoE adds it */
        const int64_t S = L->up.N;
        if (linear(m, &L->gate, h, M, g) || linear(m, &L->up, h, M, u) || linear(m, &L->shared_gate, h, M, sg)) rc = -1;
        for (int64_t i = 0; i < M * S && rc == 0; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        if (rc == 0 && linear(m, &L->down, g, M, ys)) rc = -1;
        for (int64_t r = 0; r < M && rc == 0; r++) {
            const float s = 1.0f / (1.0f + expf(-sg[r]));
            for (int64_t c = 0; c < H; c++) out[r * H + c] = out[r * H + c] + s * ys[r * H + c];
        }
    }
    free(buf);
    free(pick);
    return rc;
}

/* the model's norm of each of M rows of x (hidden values) */
static void norm_rows(const mf_model_t *m, const float *x, const float *w, const float *b, int64_t M, float *out) {
#pragma omp parallel for num_threads(row_threads(m, M)) schedule(static)
    for (int64_t r = 0; r < M; r++) {
        if (m->norm == NORM_LAYER) layer_norm(x + r * m->hidden, w, b, m->eps, m->hidden, out + r * m->hidden);
        else rms_norm(x + r * m->hidden, w, m->eps, m->hidden, out + r * m->hidden);
    }
}

/* layer li's rotary tables: the second set for Gemma 3's sliding layers (rope2), else the model's */
static inline const float *rope_cos(const mf_model_t *m, int64_t li) { return m->layers[li].rope2 ? m->cos2 : m->cos; }
static inline const float *rope_sin(const mf_model_t *m, int64_t li) { return m->layers[li].rope2 ? m->sin2 : m->sin; }

/* x (head_dim) rotated in place at the tables' row: x·cos + rotate_half(x)·sin */
static void rope(float *x, const float *c, const float *s, int64_t d) {
    const int64_t h = d / 2;
    float t[MAX_HEAD_DIM];
    memcpy(t, x, (size_t)d * sizeof(float));
    for (int64_t i = 0; i < h; i++) x[i] = t[i] * c[i] + (-t[i + h]) * s[i];
    for (int64_t i = h; i < d; i++) x[i] = t[i] * c[i] + t[i - h] * s[i];
}

/* x (head_dim) times the d × d matrix r, in place: x[j] ← Σ_i x[i]·r[i][j] */
static void times_matrix(float *x, const float *r, int64_t d) {
    float t[MAX_HEAD_DIM], o[MAX_HEAD_DIM];
    memcpy(t, x, (size_t)d * sizeof(float));
    memset(o, 0, (size_t)d * sizeof(float));
    for (int64_t i = 0; i < d; i++)
        for (int64_t j = 0; j < d; j++) o[j] += t[i] * r[i * d + j];
    memcpy(x, o, (size_t)d * sizeof(float));
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN (quiet) */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline void from_bf16(const uint16_t *b, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const uint32_t u = (uint32_t)b[i] << 16;
        memcpy(out + i, &u, 4);
    }
}

/* ---- the KV cache ----------------------------------------------------------------------------- */

/* E4M3 code of v: round to nearest even, saturating at ±448; NaN: 0x7F (minifloat's canonical NaN) */
static uint8_t enc_e4m3(float v) {
    if (v != v) return 0x7F;
    const uint8_t sign = signbit(v) ? 0x80 : 0;
    const float a = fabsf(v);
    uint8_t c;
    if (a >= 448.0f) c = 0x7E;
    else if (a < 0.015625f) c = (uint8_t)nearbyintf(a * 512.0f); /* subnormals: multiples of 2^-9 (8: 2^-6) */
    else {
        uint32_t u;
        memcpy(&u, &a, 4);
        u += 0x7FFFFu + ((u >> 20) & 1u); /* to nearest even at E4M3's last mantissa bit; a carry moves the exponent */
        const uint32_t code = (((u >> 23) - 120u) << 3) | ((u >> 20) & 7u);
        c = code > 0x7E ? 0x7E : (uint8_t)code;
    }
    return sign | c;
}

/* E2M1 code of v (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives): nearest, ties to the even
 * code, saturating at ±6 */
static uint8_t enc_e2m1(float v) {
    const uint8_t sign = signbit(v) ? 8 : 0;
    const float a = fabsf(v);
    const uint8_t c = a <= 0.25f ? 0 : a < 0.75f ? 1 : a <= 1.25f ? 2 : a < 1.75f ? 3 : a <= 2.5f ? 4 : a < 3.5f ? 5
                      : a <= 5.0f ? 6 : 7;
    return sign | c;
}

/* max |x| over n values: inf counts as 0; NaN propagates unless ignore_nan (rules.finite_amax) */
static float finite_amax(const float *x, int64_t n, int ignore_nan) {
    float m = 0.0f;
    int nan = 0;
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        if (a != a) nan = 1;
        else if (a != INFINITY && a > m) m = a;
    }
    return nan && !ignore_nan ? NAN : m;
}

static int64_t kv_row_bytes(const mf_model_t *m) { return m->kv.kind == KV_FP8 ? m->head_dim : m->head_dim / 2; }
static int64_t kv_scales_per_row(const mf_model_t *m) {
    return m->kv.kind == KV_FP8 ? 1 : m->kv.kind == KV_NVFP4 ? m->head_dim / 16 : m->head_dim / 32;
}

/* NVFP4's tensor scale of a chunk of n values: S_enc = 448·6 / amax (1 for amax 0); *ts = 1 / S_enc. */
static float kv_tensor_scale(const float *x, int64_t n, float *ts) {
    const float g = finite_amax(x, n, 1);
    float s_enc = g == 0.0f ? 1.0f : 2688.0f / g;
    if (s_enc > FLT_MAX) s_enc = FLT_MAX;
    if (s_enc == 0.0f) s_enc = 1.0f;
    *ts = 1.0f / s_enc;
    return s_enc;
}

/* One row x of `len` values into codes c and scales sc, as minifloat.kernels.reference.quantize
 * encodes a row in the KV format's scheme (rules.py's formulas, float32 operations in its order):
 * FP8 one float32 scale for the row (len codes); NVFP4 (E4M3 per 16, with the chunk's s_enc and
 * ts) and MXFP4 (E8M0 per 32) len / 2 bytes of two codes. */
static void kv_encode_row(const mf_kv_t *kv, const float *x, int64_t len, float s_enc, float ts, uint8_t *c, void *scales) {
    if (kv->kind == KV_FP8) { /* encode 448 / amax (1 for amax 0), decode scale its inverse */
        const float a = finite_amax(x, len, 0);
        float enc = a == 0.0f ? 1.0f : 448.0f / a;
        if (enc == INFINITY) enc = FLT_MAX;
        *(float *)scales = 1.0f / enc;
        for (int64_t k = 0; k < len; k++) c[k] = enc_e4m3(x[k] * enc);
        return;
    }
    uint8_t *sc = scales;
    const int64_t bw = kv->kind == KV_NVFP4 ? 16 : 32;
    memset(c, 0, (size_t)(len / 2));
    for (int64_t b = 0; b < len / bw; b++) {
        const float a = finite_amax(x + b * bw, bw, 0);
        float enc;
        if (kv->kind == KV_NVFP4) { /* E4M3 block scale of (amax / 6) · S_enc; encode 1 / (scale · ts) */
            float s = (a / 6.0f) * s_enc;
            if (s > FLT_MAX) s = FLT_MAX;
            sc[b] = enc_e4m3(s);
            const float dec = kv->e4m3[sc[b]] * ts;
            enc = dec == 0.0f ? 0.0f : 1.0f / dec;
        } else { /* MXFP4: E8M0 exponent of amax / 6 rounded up to a power of two */
            int e = 0;
            const float mant = frexpf(a * (float)(1.0 / 6.0), &e);
            int ex = a == 0.0f ? 0 : (e - 1) + (mant != 0.5f);
            ex = ex < -127 ? -127 : ex > 127 ? 127 : ex;
            sc[b] = a != a ? 255 : (uint8_t)(ex + 127);
            enc = a != a ? NAN : ldexpf(1.0f, -ex);
        }
        for (int64_t k = b * bw; k < (b + 1) * bw; k++) c[k / 2] |= (uint8_t)(enc_e2m1(x[k] * enc) << (4 * (k & 1)));
    }
}

/* Quantize a chunk of n rows (head_dim values each; row i is token t0 + i / n_kv, KV head i % n_kv)
 * of layer li's K (which 0) or V (1) into the packed store, each row as kv_encode_row encodes it
 * (NVFP4: one tensor scale for the chunk). */
static void kv_quantize(const mf_model_t *m, int64_t li, int which, const float *rows, int64_t n, int64_t t0) {
    const mf_kv_t *kv = &m->kv;
    const int64_t d = m->head_dim, C = m->capacity, rb = kv_row_bytes(m), ns = kv_scales_per_row(m);
    uint8_t *codes = which ? kv->vc : kv->kc;
    void *scales = which ? kv->vs : kv->ks;
    float ts = 1.0f, s_enc = 1.0f;
    if (kv->kind == KV_NVFP4) {
        s_enc = kv_tensor_scale(rows, n * d, &ts);
        float *tss = (which ? kv->vts : kv->kts) + li * C;
        for (int64_t t = t0; t < t0 + n / m->n_kv; t++) tss[t] = ts;
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t t = t0 + i / m->n_kv, g = i % m->n_kv, at = (li * m->n_kv + g) * C + t;
        void *sc = kv->kind == KV_FP8 ? (void *)((float *)scales + at) : (void *)((uint8_t *)scales + at * ns);
        kv_encode_row(kv, rows + i * d, d, s_enc, ts, codes + at * rb, sc);
    }
}

/* Bytes of one channel's block of `group` positions (channel keys). */
static int64_t kv_channel_bytes(const mf_kv_t *kv) { return kv->kind == KV_FP8 ? kv->group : kv->group / 2; }

/* Channel keys (KIVI): the t aging tokens t0 … t0 + t − 1 (rows: t × n_kv × head_dim, token-major;
 * t0 − sinks and t whole blocks) of layer li, as KVCache's ChannelPacked quantizes them: each
 * channel's t values one row (so FP8 scales each channel over the chunk, FP4 per block of tokens),
 * NVFP4 one tensor scale for the chunk. Returns 0, or -1 out of memory. */
static int kv_quantize_channels(const mf_model_t *m, int64_t li, const float *rows, int64_t t, int64_t t0) {
    const mf_kv_t *kv = &m->kv;
    const int64_t d = m->head_dim, nkv = m->n_kv, G = kv->group, gb = kv_channel_bytes(kv), b0 = (t0 - kv->sinks) / G;
    float ts = 1.0f, s_enc = 1.0f;
    if (kv->kind == KV_NVFP4) {
        s_enc = kv_tensor_scale(rows, t * nkv * d, &ts);
        for (int64_t j = t0; j < t0 + t; j++) kv->kts[li * m->capacity + j] = ts;
    }
    float *ch = malloc((size_t)t * sizeof(float) + (size_t)t * 2 + 64);
    if (!ch) return -1;
    uint8_t *codes = (uint8_t *)(ch + t), *sc = codes + t + 4; /* t codes at most; FP4: t / 16 scales at most */
    float fscale = 0.0f;
    for (int64_t g = 0; g < nkv; g++)
        for (int64_t c = 0; c < d; c++) {
            for (int64_t j = 0; j < t; j++) ch[j] = rows[(j * nkv + g) * d + c];
            kv_encode_row(kv, ch, t, s_enc, ts, codes, kv->kind == KV_FP8 ? (void *)&fscale : (void *)sc);
            for (int64_t b = 0; b < t / G; b++) {
                const int64_t at = ((li * nkv + g) * kv->blocks + b0 + b) * d + c;
                memcpy(kv->kc + at * gb, codes + b * gb, (size_t)gb);
                if (kv->kind == KV_FP8) ((float *)kv->ks)[at] = fscale;
                else ((uint8_t *)kv->ks)[at] = sc[b];
            }
        }
    free(ch);
    return 0;
}

/* Positions the bfloat16 ring holds: the window, and with channel keys up to a block not yet aged. */
static int64_t kv_ring(const mf_kv_t *kv) { return kv->recent + (kv->channel ? kv->group : 0); }

/* The bfloat16 row j of KV head g (K: which 0, V: 1) — a bf16 cache's, or a window's sink or ring
 * slot — or NULL where the row is float32 or packed. */
static const uint16_t *bf16_row(const mf_model_t *m, int64_t li, int64_t g, int64_t j, int which, int64_t aged) {
    const mf_kv_t *kv = &m->kv;
    const int64_t d = m->head_dim, lg = li * m->n_kv + g;
    if (kv->kind == KV_BF16) return (const uint16_t *)(which ? kv->v : kv->k) + (lg * m->capacity + j) * d;
    if (kv->window && j < kv->sinks) return (which ? kv->vsink : kv->ksink) + (lg * kv->sinks + j) * d;
    if (kv->window && j >= aged) return (which ? kv->vring : kv->kring) + (lg * kv_ring(kv) + j % kv_ring(kv)) * d;
    return NULL;
}

/* Row j (head_dim values) of KV head g of layer li, K (which 0) or V (1), in float32: a pointer
 * into the cache, or `buf` holding it decoded. `aged`: the packed positions' end (packed kinds). */
static const float *kv_row(const mf_model_t *m, int64_t li, int64_t g, int64_t j, int which, int64_t aged, float *buf) {
    const mf_kv_t *kv = &m->kv;
    const int64_t d = m->head_dim, C = m->capacity, at = (li * m->n_kv + g) * C + j;
    if (kv->kind == KV_F32) return (const float *)(which ? kv->v : kv->k) + at * d;
    const uint16_t *b16 = bf16_row(m, li, g, j, which, aged);
    if (b16) return from_bf16(b16, buf, d), buf;
    if (kv->channel && !which) { /* a channel-scaled key: its position's code in each channel's block */
        const int64_t G = kv->group, gb = kv_channel_bytes(kv), b = (j - kv->sinks) / G, jj = (j - kv->sinks) % G;
        const int64_t base = ((li * m->n_kv + g) * kv->blocks + b) * d;
        const float ts = kv->kind == KV_NVFP4 ? kv->kts[li * C + j] : 1.0f;
        for (int64_t k = 0; k < d; k++) {
            const uint8_t *cb = kv->kc + (base + k) * gb;
            if (kv->kind == KV_FP8) buf[k] = kv->e4m3[cb[jj]] * ((const float *)kv->ks)[base + k];
            else {
                const uint8_t sc = ((const uint8_t *)kv->ks)[base + k];
                const float s = kv->kind == KV_NVFP4 ? kv->e4m3[sc] * ts : kv->e8m0[sc];
                buf[k] = kv->e2m1[(cb[jj / 2] >> (4 * (jj & 1))) & 15] * s;
            }
        }
        return buf;
    }
    const uint8_t *c = (which ? kv->vc : kv->kc) + at * kv_row_bytes(m);
    if (kv->kind == KV_FP8) {
        const float s = ((const float *)(which ? kv->vs : kv->ks))[at];
        for (int64_t k = 0; k < d; k++) buf[k] = kv->e4m3[c[k]] * s;
        return buf;
    }
    const int64_t ns = kv_scales_per_row(m), bw = d / ns;
    const uint8_t *sc = (const uint8_t *)(which ? kv->vs : kv->ks) + at * ns;
    const float ts = kv->kind == KV_NVFP4 ? (which ? kv->vts : kv->kts)[li * C + j] : 1.0f;
    for (int64_t b = 0; b < ns; b++) {
        const float s = kv->kind == KV_NVFP4 ? kv->e4m3[sc[b]] * ts : kv->e8m0[sc[b]];
        for (int64_t k = b * bw; k < (b + 1) * bw; k++) buf[k] = kv->e2m1[(c[k / 2] >> (4 * (k & 1))) & 15] * s;
    }
    return buf;
}

/* Layer li's K and V of rows pos … pos + M − 1 (k, v: M × n_kv × head_dim, rotated) into the
 * cache. Packed kinds: without a window the M rows are one chunk; with one, the tokens that leave
 * it now (positions aged0 … aged − 1, from their bfloat16 values, as KVCache demotes them) are one
 * chunk and the rest enter the window. Returns 0, or -1 out of memory. */
static int kv_store(const mf_model_t *m, int64_t li, int64_t pos, int64_t M, const float *k, const float *v,
                    int64_t aged0, int64_t aged) {
    const mf_kv_t *kv = &m->kv;
    const int64_t d = m->head_dim, C = m->capacity, nkv = m->n_kv;
    if (kv->kind == KV_F32 || kv->kind == KV_BF16) {
        for (int64_t r = 0; r < M; r++)
            for (int64_t g = 0; g < nkv; g++) {
                const int64_t at = ((li * nkv + g) * C + pos + r) * d;
                const float *kh = k + (r * nkv + g) * d, *vh = v + (r * nkv + g) * d;
                if (kv->kind == KV_BF16) {
                    uint16_t *kt = (uint16_t *)kv->k + at, *vt = (uint16_t *)kv->v + at;
                    for (int64_t i = 0; i < d; i++) kt[i] = to_bf16(kh[i]), vt[i] = to_bf16(vh[i]);
                } else {
                    memcpy((float *)kv->k + at, kh, (size_t)d * sizeof(float));
                    memcpy((float *)kv->v + at, vh, (size_t)d * sizeof(float));
                }
            }
        return 0;
    }
    if (!kv->window) {
        kv_quantize(m, li, 0, k, M * nkv, pos);
        kv_quantize(m, li, 1, v, M * nkv, pos);
        return 0;
    }
    for (int which = 0; which < 2; which++) {
        const float *src = which ? v : k;
        uint16_t *ring = which ? kv->vring : kv->kring, *sink = which ? kv->vsink : kv->ksink;
        if (aged > aged0) { /* the tokens leaving the window: their bfloat16 values, one chunk */
            float *rows = malloc((size_t)((aged - aged0) * nkv * d) * sizeof(float));
            if (!rows) return -1;
            for (int64_t t = aged0; t < aged; t++)
                for (int64_t g = 0; g < nkv; g++) {
                    float *o = rows + ((t - aged0) * nkv + g) * d;
                    if (t < pos) from_bf16(ring + ((li * nkv + g) * kv_ring(kv) + t % kv_ring(kv)) * d, o, d);
                    else
                        for (int64_t i = 0; i < d; i++) {
                            const uint32_t u = (uint32_t)to_bf16(src[((t - pos) * nkv + g) * d + i]) << 16;
                            memcpy(o + i, &u, 4);
                        }
                }
            int bad = 0;
            if (kv->channel && !which) bad = kv_quantize_channels(m, li, rows, aged - aged0, aged0);
            else kv_quantize(m, li, which, rows, (aged - aged0) * nkv, aged0);
            free(rows);
            if (bad) return -1;
        }
        for (int64_t r = 0; r < M; r++) { /* the others enter the window (the first `sinks` for good) */
            const int64_t p = pos + r;
            if (p >= kv->sinks && p < aged) continue;
            for (int64_t g = 0; g < nkv; g++) {
                uint16_t *o = p < kv->sinks ? sink + ((li * nkv + g) * kv->sinks + p) * d
                                            : ring + ((li * nkv + g) * kv_ring(kv) + p % kv_ring(kv)) * d;
                const float *x = src + (r * nkv + g) * d;
                for (int64_t i = 0; i < d; i++) o[i] = to_bf16(x[i]);
            }
        }
    }
    return 0;
}

/* Attention of one query row is split into parts of PART positions, at fixed offsets from the
 * row's first position (so a row's result depends on its positions only: not on the threads,
 * nor on the rows beside it): each part gives its heads' score maximum, exp-sum and unnormalized
 * output; the parts then merge in order (the usual rescaling by exp(max_part − max)). Short
 * rows are one part: softmax(q·K · scale) · V as written. */
#define PART 512

/* Each head's scores (group rows of n in s) turned into exp(score − mx[h]) in place, their sum in sum[h]. */
static void exp_scores(int64_t group, int64_t n, float *s, const float *mx, float *sum) {
    for (int64_t h = 0; h < group; h++) {
        float t = 0.0f;
        for (int64_t j = 0; j < n; j++) t += (s[h * n + j] = expf(s[h * n + j] - mx[h]));
        sum[h] = t;
    }
}

/* Query row q's heads of KV group g (`group` heads, contiguous in q) against positions lo … hi
 * (≤ PART of them): per head h, mx[h] the largest score, sum[h] Σ exp(score − mx[h]) and out
 * (group × head_dim) Σ exp(score − mx[h]) · V. Each K and V row is read (decoded) once for the
 * group. `s`: group × PART scores; `buf`: head_dim floats. */
static void attend_part(const mf_model_t *m, int64_t li, int64_t g, int64_t group, const float *q, int64_t lo,
                        int64_t hi, int64_t aged, float *s, float *out, float *mx, float *sum, float *buf) {
    const int64_t d = m->head_dim, n = hi - lo + 1;
    const dot_t dot = dot_for(m->isa);
    const axpy_t axpy = axpy_for(m->isa);
    for (int64_t h = 0; h < group; h++) mx[h] = -INFINITY;
    for (int64_t j = lo; j <= hi; j++) {
        const float *k = kv_row(m, li, g, j, 0, aged, buf);
        if (m->kv.pre_rope) { /* a key stored before the rotary embedding gets its position's now */
            if (k != buf) memcpy(buf, k, (size_t)d * sizeof(float));
            rope(buf, rope_cos(m, li) + j * d, rope_sin(m, li) + j * d, d);
            k = buf;
        }
        for (int64_t h = 0; h < group; h++) {
            float v = dot(q + h * d, k, d) * m->scale;
            if (m->attn_softcap > 0.0f) v = m->attn_softcap * tanhf(v / m->attn_softcap);
            s[h * n + j - lo] = v;
            mx[h] = v > mx[h] ? v : mx[h];
        }
    }
    exp_scores(group, n, s, mx, sum);
    memset(out, 0, (size_t)(group * d) * sizeof(float));
    for (int64_t j = lo; j <= hi; j++) {
        const float *v = kv_row(m, li, g, j, 1, aged, buf);
        for (int64_t h = 0; h < group; h++) axpy(out + h * d, s[h * n + j - lo], v, d);
    }
}

#if MF_X86
/* Row j of KV head g (K: which 0, V: 1) as nv = head_dim / 16 vectors in registers: float32
 * loaded, bfloat16 widened, FP4 decoded (per 16 bytes, both nibbles' values by 16-entry vpermps
 * lookups, interleaved into column order by two-source permutes, times each block's scale); FP8 through the
 * scalar decoder's buffer. The same values as kv_row. */
D512 static inline __attribute__((always_inline)) void row512_stored(const mf_model_t *m, int64_t li, int64_t g,
                                                                     int64_t j, int which, int64_t aged, int nv, __m512 *v,
                                                                     float *buf) {
    const mf_kv_t *kv = &m->kv;
    const int64_t d = m->head_dim, C = m->capacity, at = (li * m->n_kv + g) * C + j;
    if (kv->kind == KV_F32) {
        const float *r = (const float *)(which ? kv->v : kv->k) + at * d;
        for (int c = 0; c < nv; c++) v[c] = _mm512_loadu_ps(r + 16 * c);
        return;
    }
    const uint16_t *b16 = bf16_row(m, li, g, j, which, aged);
    if (b16) {
        for (int c = 0; c < nv; c++)
            v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b16 + 16 * c))), 16));
        return;
    }
    if (kv->kind == KV_FP8 || (kv->channel && !which)) { /* through the scalar decoder */
        const float *r = kv_row(m, li, g, j, which, aged, buf);
        for (int c = 0; c < nv; c++) v[c] = _mm512_loadu_ps(r + 16 * c);
        return;
    }
    const uint8_t *cd = (which ? kv->vc : kv->kc) + at * (d / 2);
    const int64_t ns = kv_scales_per_row(m);
    const uint8_t *sc = (const uint8_t *)(which ? kv->vs : kv->ks) + at * ns;
    const float ts = kv->kind == KV_NVFP4 ? (which ? kv->vts : kv->kts)[li * C + j] : 1.0f;
    const __m512 t = _mm512_loadu_ps(kv->e2m1);
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int c = 0; c < nv; c += 2) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(cd + 8 * c)));
        const __m512 even = _mm512_permutexvar_ps(b, t), odd = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t);
        const float s0 = kv->kind == KV_NVFP4 ? kv->e4m3[sc[c]] * ts : kv->e8m0[sc[c / 2]];
        const float s1 = kv->kind == KV_NVFP4 ? kv->e4m3[sc[c + 1]] * ts : s0;
        v[c] = _mm512_mul_ps(_mm512_permutex2var_ps(even, lo, odd), _mm512_set1_ps(s0));
        v[c + 1] = _mm512_mul_ps(_mm512_permutex2var_ps(even, hi, odd), _mm512_set1_ps(s1));
    }
}

/* row512_stored, and a key stored before the rotary embedding given its position's (rope()'s
 * products and sums, in registers) */
D512 static inline __attribute__((always_inline)) void row512(const mf_model_t *m, int64_t li, int64_t g, int64_t j,
                                                              int which, int64_t aged, int nv, __m512 *v, float *buf) {
    row512_stored(m, li, g, j, which, aged, nv, v, buf);
    if (which || !m->kv.pre_rope) return;
    const float *cs = rope_cos(m, li) + j * m->head_dim, *sn = rope_sin(m, li) + j * m->head_dim;
    const int half = nv / 2;
    __m512 t[8];
    for (int c = 0; c < nv; c++) t[c] = v[c];
    const __m512i sign = _mm512_set1_epi32((int)0x80000000);
    for (int c = 0; c < nv; c++) {
        const __m512 other = c < half ? _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(t[c + half]), sign)) : t[c - half];
        v[c] = _mm512_add_ps(_mm512_mul_ps(t[c], _mm512_loadu_ps(cs + 16 * c)), _mm512_mul_ps(other, _mm512_loadu_ps(sn + 16 * c)));
    }
}

/* Channel keys: the scores (before the scale) of KV head g's `group` query heads (q) against the
 * `group` positions of block b, out[h · G + i] = Σ_c q[h][c] · k_i[c], the channels in order: each
 * channel's G codes decoded at once (FP4 by vpermps lookups, FP8 by a table gather) and scaled as
 * kv_row scales them. group · G / 16 ≤ 24 (fast512's bound). Pre-RoPE keys: q · rope_i(k_i) =
 * Σ_c k_i[c] · (q[c] cos_i[c] + q[c + h] sin_i[c + h]) for c < h (half the head), and
 * (q[c] cos_i[c] − q[c − h] sin_i[c − h]) for c ≥ h: each channel's multiplier per position, from
 * the transposed tables. */
D512 static void channel_scores512(const mf_model_t *m, int64_t li, int64_t g, int64_t group, const float *q,
                                   int64_t b, float *out) {
    const mf_kv_t *kv = &m->kv;
    const int64_t d = m->head_dim, G = kv->group, gb = kv_channel_bytes(kv);
    const int64_t base = ((li * m->n_kv + g) * kv->blocks + b) * d;
    const int nvec = (int)(G / 16);
    const float ts = kv->kind == KV_NVFP4 ? kv->kts[li * m->capacity + kv->sinks + b * G] : 1.0f;
    const __m512 t4 = _mm512_loadu_ps(kv->e2m1);
    const __m512i shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    __m512 acc[24];
    for (int64_t i = 0; i < group * nvec; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c++) {
        const uint8_t *cb = kv->kc + (base + c) * gb;
        __m512 v[2];
        float sc;
        if (kv->kind == KV_FP8) {
            for (int u = 0; u < nvec; u++)
                v[u] = _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(cb + 16 * u))), kv->e4m3, 4);
            sc = ((const float *)kv->ks)[base + c];
        } else { /* position i's code: byte i / 2, nibble i & 1 */
            const __m128i raw = nvec == 1 ? _mm_loadl_epi64((const __m128i *)cb) : _mm_loadu_si128((const __m128i *)cb);
            v[0] = _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(raw, raw)), shift), t4);
            if (nvec == 2)
                v[1] = _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(raw, raw)), shift), t4);
            const uint8_t code = ((const uint8_t *)kv->ks)[base + c];
            sc = kv->kind == KV_NVFP4 ? kv->e4m3[code] * ts : kv->e8m0[code];
        }
        const __m512 sv = _mm512_set1_ps(sc);
        for (int u = 0; u < nvec; u++) v[u] = _mm512_mul_ps(v[u], sv);
        if (kv->pre_rope) {
            const int64_t half = d / 2, o = c < half ? c + half : c - half, p0 = kv->sinks + b * G;
            const float sign = c < half ? 1.0f : -1.0f;
            for (int u = 0; u < nvec; u++) {
                const __m512 cv = _mm512_loadu_ps(kv->cos_t + c * m->capacity + p0 + 16 * u);
                const __m512 sn = _mm512_loadu_ps(kv->sin_t + o * m->capacity + p0 + 16 * u);
                for (int64_t h = 0; h < group; h++) {
                    const __m512 mult = _mm512_fmadd_ps(_mm512_set1_ps(sign * q[h * d + o]), sn, _mm512_mul_ps(_mm512_set1_ps(q[h * d + c]), cv));
                    acc[h * nvec + u] = _mm512_fmadd_ps(mult, v[u], acc[h * nvec + u]);
                }
            }
            continue;
        }
        for (int64_t h = 0; h < group; h++) {
            const __m512 qc = _mm512_set1_ps(q[h * d + c]);
            for (int u = 0; u < nvec; u++) acc[h * nvec + u] = _mm512_fmadd_ps(qc, v[u], acc[h * nvec + u]);
        }
    }
    for (int64_t h = 0; h < group; h++)
        for (int u = 0; u < nvec; u++) _mm512_storeu_ps(out + h * G + 16 * u, acc[h * nvec + u]);
}

/* attend_part with each row's vectors in registers and the group's outputs accumulated in
 * registers (group · head_dim / 16 ≤ 24 vectors; head_dim 32, 64 or 128). */
D512 static inline __attribute__((always_inline)) void attend_part512_nv(const mf_model_t *m, int64_t li, int64_t g,
        int64_t group, const float *q, int64_t lo, int64_t hi, int64_t aged, float *s, float *out, float *mx,
        float *sum, float *buf, const int nv) {
    const int64_t d = m->head_dim, n = hi - lo + 1;
    __m512 qv[24], acc[24], v[8];
    for (int64_t h = 0; h < group; h++) {
        mx[h] = -INFINITY;
        for (int c = 0; c < nv; c++) qv[h * nv + c] = _mm512_loadu_ps(q + h * d + 16 * c), acc[h * nv + c] = _mm512_setzero_ps();
    }
    for (int64_t j = lo; j <= hi; j++) {
        if (m->kv.channel && j >= m->kv.sinks && j < aged) { /* a block of channel keys at once */
            const int64_t G = m->kv.group, b = (j - m->kv.sinks) / G, bs = m->kv.sinks + b * G;
            const int64_t be = bs + G - 1 < hi ? bs + G - 1 : hi; /* aged ends a block: be < aged */
            float cs[24 * 16];
            channel_scores512(m, li, g, group, q, b, cs);
            for (; j <= be; j++)
                for (int64_t h = 0; h < group; h++) {
                    const float sc = cs[h * G + j - bs] * m->scale;
                    s[h * n + j - lo] = sc;
                    mx[h] = sc > mx[h] ? sc : mx[h];
                }
            j--; /* the loop's increment: the block's end + 1 */
            continue;
        }
        row512(m, li, g, j, 0, aged, nv, v, buf);
        for (int64_t h = 0; h < group; h++) {
            __m512 a = _mm512_mul_ps(qv[h * nv], v[0]);
            for (int c = 1; c < nv; c++) a = _mm512_fmadd_ps(qv[h * nv + c], v[c], a);
            const float sc = _mm512_reduce_add_ps(a) * m->scale;
            s[h * n + j - lo] = sc;
            mx[h] = sc > mx[h] ? sc : mx[h];
        }
    }
    exp_scores(group, n, s, mx, sum);
    for (int64_t j = lo; j <= hi; j++) {
        row512(m, li, g, j, 1, aged, nv, v, buf);
        for (int64_t h = 0; h < group; h++) {
            const __m512 p = _mm512_set1_ps(s[h * n + j - lo]);
            for (int c = 0; c < nv; c++) acc[h * nv + c] = _mm512_fmadd_ps(p, v[c], acc[h * nv + c]);
        }
    }
    for (int64_t h = 0; h < group; h++)
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(out + h * d + 16 * c, acc[h * nv + c]);
}

D512 static void attend_part512(const mf_model_t *m, int64_t li, int64_t g, int64_t group, const float *q, int64_t lo,
                                int64_t hi, int64_t aged, float *s, float *out, float *mx, float *sum, float *buf) {
    switch (m->head_dim) {
    case 32: attend_part512_nv(m, li, g, group, q, lo, hi, aged, s, out, mx, sum, buf, 2); break;
    case 64: attend_part512_nv(m, li, g, group, q, lo, hi, aged, s, out, mx, sum, buf, 4); break;
    default: attend_part512_nv(m, li, g, group, q, lo, hi, aged, s, out, mx, sum, buf, 8); break;
    }
}
#endif

/* The parts' results (np of them, each group × (head_dim + 2): output, max, sum) merged into
 * out (group × head_dim), in order. */
static void attend_merge(int64_t group, int64_t d, int64_t np, const float *parts, const float *sinks, float *out) {
    const int64_t stride = group * (d + 2);
    for (int64_t h = 0; h < group; h++) {
        float mx = sinks ? sinks[h] : -INFINITY, total = 0.0f; /* a sink: one more logit in the softmax, no value */
        for (int64_t p = 0; p < np; p++) {
            const float v = parts[p * stride + group * d + h];
            mx = v > mx ? v : mx;
        }
        float *o = out + h * d;
        memset(o, 0, (size_t)d * sizeof(float));
        for (int64_t p = 0; p < np; p++) {
            const float *part = parts + p * stride;
            const float w = np == 1 && !sinks ? 1.0f : expf(part[group * d + h] - mx);
            total += w * part[group * d + group + h];
            for (int64_t i = 0; i < d; i++) o[i] += w * part[h * d + i];
        }
        if (sinks) total += expf(sinks[h] - mx);
        const float inv = 1.0f / total;
        for (int64_t i = 0; i < d; i++) o[i] *= inv;
    }
}

/* Floats of a row of the MLP's hidden layer, the model's width, or a fused qkv product, the widest. */
static int64_t wide_floats(const mf_model_t *m) {
    const int64_t qkv = (m->n_head + 2 * m->n_kv) * m->head_dim;
    const int64_t inter = m->gate_up ? 2 * m->inter : m->inter;
    const int64_t w = inter > m->hidden ? inter : m->hidden;
    return w > qkv ? w : qkv;
}

/* Scratch floats a call of M rows needs, beside the attention's (per thread). */
static int64_t scratch_floats(const mf_model_t *m, int64_t M) {
    const int64_t qd = m->n_head * m->head_dim, kd = m->n_kv * m->head_dim;
    return M * (2 * m->hidden + qd + 2 * kd + qd + 2 * wide_floats(m));
}

/* Rows pos … pos + M − 1 through the model (a prompt at once, or a few tokens); `x_in`: their
 * embeddings (M × hidden). Writes the logits of the last `logit_rows` rows (logit_rows × vocab).
 * Returns 0; -1 out of memory; -2 a position past the cache's capacity or a bad row count. */
int mf_decode(const mf_model_t *m, const float *x_in, int64_t pos, int64_t M, int64_t logit_rows, float *logits) {
    if (M < 1 || pos < 0 || pos + M > m->capacity || logit_rows < 0 || logit_rows > M) return -2;
    const int64_t H = m->hidden, d = m->head_dim, nh = m->n_head, nkv = m->n_kv;
    const int64_t qd = nh * d, kd = nkv * d, big = wide_floats(m), group = nh / nkv;
    const int64_t span = pos + M; /* the last row's positions */
    const mf_kv_t *kv = &m->kv;
    const int packed = kv->kind != KV_F32 && kv->kind != KV_BF16;
    /* packed positions' end before and after this call (every layer alike) */
    const int64_t aged0 = packed ? *kv->aged : 0;
    int64_t aged = pos + M;
    if (packed && kv->window) {
        aged = pos + M - kv->recent > kv->sinks ? pos + M - kv->recent : kv->sinks;
        aged = aged > aged0 ? aged : aged0;
        if (kv->channel) aged = aged0 + (aged - aged0) / kv->group * kv->group; /* whole blocks only */
    }
    const int nt = threads_for(m, span * nh * d * 8);
    /* AVX-512 attention with rows and outputs in registers: head_dim 32, 64 or 128, ≤ 24 output vectors */
    const int fast512 = MF_X86 && m->isa == ISA_AVX512 && (d == 32 || d == 64 || d == 128) && group * (d / 16) <= 24 &&
                        m->attn_softcap == 0.0f; /* capped scores: the scalar path caps each */
    (void)fast512;
    const int64_t per_thread = group * PART + d; /* one attention task's scores and row buffer */
    const int64_t np_max = (span + PART - 1) / PART, part_floats = group * (d + 2);
    float *buf = mf_alloc64((size_t)(scratch_floats(m, M) + nt * per_thread + M * nkv * np_max * part_floats) * sizeof(float));
    if (!buf) return -1;
    float *x = buf, *h = x + M * H, *q = h + M * H, *k = q + M * qd, *v = k + M * kd, *att = v + M * kd;
    float *g = att + M * qd, *u = g + M * big, *sc = u + M * big, *parts = sc + nt * per_thread;
    memcpy(x, x_in, (size_t)(M * H) * sizeof(float));
    int rc = 0;
    double t0 = m->timers ? now() : 0.0;
    for (int64_t li = 0; li < m->n_layer && rc == 0; li++) {
        const mf_layer_t *L = m->layers + li;
        norm_rows(m, x, L->attn_norm, L->attn_norm_b, M, h);
        lap(m, &t0, T_OTHER);
        if (L->k.kind == LIN_ABSENT) { /* one qkv product (the GPT's): its columns split into q, k and v */
            if (linear(m, &L->q, h, M, g)) {
                rc = -1;
                break;
            }
            for (int64_t r = 0; r < M; r++) {
                memcpy(q + r * qd, g + r * (qd + 2 * kd), (size_t)qd * sizeof(float));
                memcpy(k + r * kd, g + r * (qd + 2 * kd) + qd, (size_t)kd * sizeof(float));
                memcpy(v + r * kd, g + r * (qd + 2 * kd) + qd + kd, (size_t)kd * sizeof(float));
            }
        } else if (linear(m, &L->q, h, M, q) || linear(m, &L->k, h, M, k) || linear(m, &L->v, h, M, v)) {
            rc = -1;
            break;
        }
        lap(m, &t0, T_GEMV);
#pragma omp parallel for num_threads(row_threads(m, M)) schedule(static)
        for (int64_t r = 0; r < M; r++) {
            const int64_t p = pos + r;
            const float *tc = rope_cos(m, li), *ts = rope_sin(m, li);
            const float *cs = tc ? tc + p * d : NULL, *sn = ts ? ts + p * d : NULL;
            for (int64_t hh = 0; hh < nh; hh++) {
                float *qh = q + r * qd + hh * d;
                if (L->q_norm) rms_norm(qh, L->q_norm, m->eps, d, qh);
                if (cs) rope(qh, cs, sn, d);
            }
            for (int64_t hh = 0; hh < nkv; hh++) {
                float *kh = k + r * kd + hh * d;
                if (L->k_norm) rms_norm(kh, L->k_norm, m->eps, d, kh);
                if (cs && !kv->pre_rope) rope(kh, cs, sn, d);
            }
            if (kv->rot) { /* rows stored rotated; queries rotated to meet them */
                for (int64_t hh = 0; hh < nh; hh++) times_matrix(q + r * qd + hh * d, kv->rot, d);
                for (int64_t hh = 0; hh < nkv; hh++) times_matrix(k + r * kd + hh * d, kv->rot, d);
                if (kv->rot_v)
                    for (int64_t hh = 0; hh < nkv; hh++) times_matrix(v + r * kd + hh * d, kv->rot, d);
            }
        }
        lap(m, &t0, T_OTHER);
        if (kv_store(m, li, pos, M, k, v, aged0, aged)) {
            rc = -1;
            break;
        }
#pragma omp parallel for collapse(3) num_threads(nt) schedule(static)
        for (int64_t r = 0; r < M; r++)
            for (int64_t gg = 0; gg < nkv; gg++)
                for (int64_t pp = 0; pp < np_max; pp++) {
                    const int64_t p = pos + r, lo = L->window > 0 && p - L->window + 1 > 0 ? p - L->window + 1 : 0;
                    const int64_t a0 = lo + pp * PART, a1 = a0 + PART - 1 < p ? a0 + PART - 1 : p;
                    if (a0 > p) continue; /* this row has fewer parts */
                    float *s = sc + (int64_t)omp_get_thread_num() * per_thread;
                    float *o = parts + ((r * nkv + gg) * np_max + pp) * part_floats;
#if MF_X86
                    if (fast512) {
                        attend_part512(m, li, gg, group, q + r * qd + gg * group * d, a0, a1, aged, s, o, o + group * d,
                                       o + group * d + group, s + group * PART);
                        continue;
                    }
#endif
                    attend_part(m, li, gg, group, q + r * qd + gg * group * d, a0, a1, aged, s, o, o + group * d,
                                o + group * d + group, s + group * PART);
                }
        for (int64_t r = 0; r < M; r++)
            for (int64_t gg = 0; gg < nkv; gg++) {
                const int64_t p = pos + r, lo = L->window > 0 && p - L->window + 1 > 0 ? p - L->window + 1 : 0;
                attend_merge(group, d, (p - lo) / PART + 1, parts + (r * nkv + gg) * np_max * part_floats,
                             L->sinks ? L->sinks + gg * group : NULL, att + r * qd + gg * group * d);
            }
        if (kv->rot_v) /* outputs of rotated V rows rotated back */
            for (int64_t i = 0; i < M * nh; i++) times_matrix(att + i * d, kv->rot_t, d);
        lap(m, &t0, T_ATTENTION);
        if (linear(m, &L->o, att, M, h)) {
            rc = -1;
            break;
        }
        lap(m, &t0, T_GEMV);
        if (L->attn_out_norm)
            for (int64_t r = 0; r < M; r++) rms_norm(h + r * H, L->attn_out_norm, m->eps, H, h + r * H);
        for (int64_t i = 0; i < M * H; i++) x[i] = x[i] + h[i];
        norm_rows(m, x, L->mlp_norm, L->mlp_norm_b, M, h);
        lap(m, &t0, T_OTHER);
        if (L->n_expert > 0) { /* a mixture of experts: its output into h */
            if (moe(m, L, h, M, u) != 0) {
                rc = -1;
                break;
            }
            memcpy(h, u, (size_t)(M * H) * sizeof(float));
            lap(m, &t0, T_GEMV);
            if (L->mlp_out_norm)
                for (int64_t r = 0; r < M; r++) rms_norm(h + r * H, L->mlp_out_norm, m->eps, H, h + r * H);
            for (int64_t i = 0; i < M * H; i++) x[i] = x[i] + h[i];
            continue;
        }
        const int gated = L->gate.kind != LIN_ABSENT;
        if ((gated && linear(m, &L->gate, h, M, g)) || linear(m, &L->up, h, M, u)) {
            rc = -1;
            break;
        }
        lap(m, &t0, T_GEMV);
        const int64_t I = m->gate_up ? L->up.N / 2 : L->up.N; /* this layer's width (a MoE model's dense layers may differ) */
#pragma omp parallel for num_threads(row_threads(m, M)) schedule(static)
        for (int64_t r = 0; r < M; r++) activate_row(m, gated, I, g + r * I, u + r * (m->gate_up ? 2 * I : I));
        lap(m, &t0, T_OTHER);
        if (linear(m, &L->down, g, M, h)) {
            rc = -1;
            break;
        }
        lap(m, &t0, T_GEMV);
        if (L->mlp_out_norm)
            for (int64_t r = 0; r < M; r++) rms_norm(h + r * H, L->mlp_out_norm, m->eps, H, h + r * H);
        for (int64_t i = 0; i < M * H; i++) x[i] = x[i] + h[i];
    }
    if (rc == 0 && packed) *kv->aged = aged;
    if (rc == 0 && logit_rows > 0) {
        const float *last = x + (M - logit_rows) * H;
        norm_rows(m, last, m->final_norm, m->final_norm_b, logit_rows, h);
        lap(m, &t0, T_OTHER);
        rc = linear(m, &m->head, h, logit_rows, logits);
        if (rc == 0 && m->logit_softcap > 0.0f)
            for (int64_t i = 0; i < logit_rows * m->vocab; i++) logits[i] = m->logit_softcap * tanhf(logits[i] / m->logit_softcap);
        lap(m, &t0, T_GEMV);
    }
    free(buf);
    return rc;
}
