/* The quantize kernels of _cpu.c compiled for AVX2 + FMA + F16C (Haswell, Zen 1 and later);
 * kernels/cpu.py calls them only where mf_cpu_isas says the CPU runs them. Elsewhere than x86
 * this file is empty. */
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2,fma,f16c")
#define MF_ISA_SUFFIX(name) name##_avx2
#include "_cpu.c"
#endif
