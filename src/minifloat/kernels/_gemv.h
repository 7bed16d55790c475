/* What the decode kernels (_gemv.c) share with the decode loop over them (_decode.c): the
 * argument block of mf_gemv and the codes it takes. */
#ifndef MF_GEMV_H
#define MF_GEMV_H
#include <stdint.h>
#include <stdlib.h>

enum { K_FP4 = 0, K_FP6 = 1, K_E4M3 = 2, K_E5M2 = 3 }; /* element kinds */
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
enum { SF_FP32 = 0, SF_E8M0 = 1, SF_E4M3 = 2 }; /* scale formats */
#define CH 32  /* columns per chunk: the unit of the decoders' column orders */
#define KC 512 /* columns per segment: the decoded buffer (2 KiB) stays in L1 */
#define MMAX 16

/* Must match GemvArgs in minifloat/kernels/gemv.py field for field. */
typedef struct {
    const float *x;      /* M × K, contiguous */
    const uint8_t *data; /* N rows of row_bytes packed codes (the layout's padded rows) */
    const void *scales;  /* the scale grid: float32 decode scales (slut NULL) or 8-bit codes */
    const float *slut;   /* 8-bit scale codes' values, or NULL */
    const float *lut;    /* the element format's values, by code (2^bits entries) */
    float *y;            /* M × N */
    int64_t M, N, K, row_bytes, data_bytes, br, bc, ngc;
    float ts; /* NVFP4's tensor scale (1 otherwise): a block's scale is slut[code] * ts */
    int32_t bits, kind, nthreads, isa, sfmt; /* sfmt: the scales' format (SF_*) */
    int32_t nan_free; /* 1: no code of W is NaN (checked when the plan was made): no lanes to patch */
} gemv_args_t;

/* Scratch that the kernels read by 16-float vectors: 64-byte aligned, so a row that starts on a
 * 16-float boundary never has a load straddle two cache lines (with malloc's 16-byte alignment the
 * 2-16-row kernels' times moved with wherever the heap put x: SmolLM2's 211 NVFP4 GEMVs, 16 rows,
 * 18.6 against 28.9 ms in one run). free() releases it. */
static inline void *mf_alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* y = x · Wᵀ (_gemv.c). Returns 0, or -1 when scratch memory ran out. */
int mf_gemv(const gemv_args_t *a);
int mf_gemv_isas(void);
#endif
