/* The quantize kernels of _cpu.c compiled for AVX-512 with VBMI (Ice Lake, Zen 4 and later): the fused-multiply-add encoder and byte permutes;
 * kernels/cpu.py calls them only where mf_cpu_isas says the CPU runs them. Elsewhere than x86
 * this file is empty. */
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi")
#define MF_ISA_SUFFIX(name) name##_avx512
#include "_cpu.c"
#endif
