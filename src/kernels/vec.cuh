// kernels/vec.cuh: small device helpers with no library state, shared by the kernels and
// by the measurement kernels of bench/ (which include it with -I src):
//  - acc8 / pack8: eight BF16 channels of a 16-byte vector added into f32, and rounded back;
//  - mbar_wait: a warp's wait for an mbarrier phase (the bulk copies into shared memory).
#ifndef HEP_KERNELS_VEC_CUH
#define HEP_KERNELS_VEC_CUH

#include <cuda_bf16.h>

__device__ __forceinline__ void acc8(float *f, uint4 v)
{
    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&v;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        float2 x = __bfloat1622float2(h[q]);
        f[2 * q] += x.x;
        f[2 * q + 1] += x.y;
    }
}

__device__ __forceinline__ uint4 pack8(const float *f)
{
    uint4 v;
    __nv_bfloat162 *h = (__nv_bfloat162 *)&v;
#pragma unroll
    for (int q = 0; q < 4; q++)
        h[q] = __floats2bfloat162_rn(f[2 * q], f[2 * q + 1]);
    return v;
}

// Until the phase `parity` of the mbarrier at shared address `bar` completed (its
// transaction bytes landed). Callers wait only for copies this warp issued itself.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity)
{
    unsigned done = 0;
    while (!done)
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
}

#endif
