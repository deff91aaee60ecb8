/* kernels/divmagic.h: n / d for a divisor d known only at run time, as one multiply-high
 * by a factor computed once (one 32-bit division), instead of a runtime division per
 * quotient (about 20 instructions each on the GPU). Shared by the kernels (layout.cuh's
 * MASK_MAGIC form) and their host test (tests/test_divmagic.c).
 *
 * The factor m = floor((2^32 - 1) / d) + 1 equals ceil(2^32 / d) for every d >= 1, and
 * its excess m * d - 2^32 is at most d - 1, so floor(n * m / 2^32) = floor(n / d) whenever
 * n * (d - 1) < 2^32. The layout's keys and divisors (n < R * E_l, d = E_l, with
 * R * E_l < 51200 by the dispatch kernel's shared memory) are always inside that bound. */
#ifndef HEP_KERNELS_DIVMAGIC_H
#define HEP_KERNELS_DIVMAGIC_H

#ifdef __CUDACC__
#define HEP_DIVMAGIC_FN static __host__ __device__ __forceinline__
#else
#define HEP_DIVMAGIC_FN static inline
#endif

/* The factor for divisor d (d >= 1). */
HEP_DIVMAGIC_FN unsigned long long hep_div_magic(unsigned d)
{
    return (unsigned long long)(0xffffffffu / d) + 1ull;
}

/* n / d, exact for n * (d - 1) < 2^32, from m = hep_div_magic(d). */
HEP_DIVMAGIC_FN unsigned hep_div_by_magic(unsigned n, unsigned long long m)
{
    return (unsigned)(((unsigned long long)n * m) >> 32);
}

#endif
