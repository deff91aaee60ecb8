// kernels/copies.cu: the copy kernels around dispatch and combine when the caller's memory
// is not the group's exchange buffers: dispatch outputs into caller memory (k_copy_out), a
// caller's expert outputs into the exchange buffer (k_copy_in), and the staged expert-major
// rows of a node whose ranks are several processes (k_em_stage_out, k_em_stage_in). Each
// runs on the call's stream after or before its dispatch or combine kernel.
#include <cuda_runtime.h>

#include "kernels/sync.cuh"

// Every node-mate finished reading this rank's buffers in the previous combine
// (COMBINE_DONE >= its count; at once unless two combines follow each other): the
// copy-in kernels may overwrite them. false when a wait gave up.
__device__ __forceinline__ bool mates_done_reading(const hep_kargs &a)
{
    const unsigned long long prev = *a.cepoch;
    bool ok = true;
    if (threadIdx.x < a.R)
        ok = wait_mate(a, a.flags[threadIdx.x] + HEP_FLAG_COMBINE_DONE, prev, HEP_STAGE_COMBINE,
                       threadIdx.x);
    return block_all(ok);
}

// Copy the caller's expert outputs into this rank's X and its probs_in into its prob
// buffer (count read on the device), once every node-mate finished reading them in the
// previous combine (COMBINE_DONE; at once unless two combines follow each other).
__global__ void k_copy_in(hep_kargs a)
{
    if (a.warm)
        return;
    const size_t rb = (size_t)a.H * 2, nvec = rb / 16;
    const size_t rows = (size_t)*a.recv_count, total = rows * nvec;
    const uint4 *src = (const uint4 *)a.combine_in;
    uint4 *dst = (uint4 *)a.x[a.local];
    if (!mates_done_reading(a))
        return;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; src && k < total;
         k += (size_t)gridDim.x * blockDim.x) {
        size_t r = k / nvec, c = k % nvec;
        dst[r * nvec + c] = __ldg((const uint4 *)((const char *)src + r * a.x_stride_in) + c);
    }
    if (a.probs_in) {
        const size_t np = rows * (size_t)a.El;
        float *pd = a.prob[a.local];
        for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < np;
             k += (size_t)gridDim.x * blockDim.x)
            pd[k] = __ldg(a.probs_in + k);
    }
}

// Dispatch outputs into caller memory: recv_count rows of this rank's X, prob and scale
// buffers (after the dispatch kernel on the stream).
__global__ void k_copy_out(hep_kargs a)
{
    if (a.warm)
        return;
    const size_t rows = (size_t)*a.recv_count;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (a.out_tokens) {
        const size_t n = rows * ((size_t)a.H * a.esize / 16);
        const uint4 *src = (const uint4 *)a.x[a.local];
        uint4 *dst = (uint4 *)a.out_tokens;
        for (size_t k = first; k < n; k += step)
            dst[k] = __ldg(src + k);
    }
    if (a.out_probs) {
        const size_t n = rows * (size_t)a.El;
        for (size_t k = first; k < n; k += step)
            a.out_probs[k] = __ldg(a.prob[a.local] + k);
    }
    if (a.out_scales && a.nscale) {
        const size_t n = rows * (size_t)a.nscale;
        for (size_t k = first; k < n; k += step)
            a.out_scales[k] = __ldg(a.scale[a.local] + k);
    }
}

// Staged expert-major dispatch (a.em_stage): the rows written into this rank's staging
// (its own padding and every source's rows, all arrived once the dispatch kernel ended)
// copied into its caller memory; nothing when the layout exceeded the receive capacity.
__global__ void k_em_stage_out(hep_kargs a)
{
    if (a.warm)
        return;
    if (a.cap && ld_l2(a.over))
        return;
    const size_t rows = (size_t)ld_l2(a.em + HEP_EM_NUM_PERMUTED);
    const size_t step = (size_t)gridDim.x * blockDim.x;
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const char *base = a.x[a.local];
    const size_t n = rows * ((size_t)a.H * a.esize / 16);
    const uint4 *src = (const uint4 *)(base + a.em_xoff);
    uint4 *dst = (uint4 *)a.out_tokens;
    for (size_t k = first; k < n; k += step)
        dst[k] = ld_cg(src + k);
    const float *pr = (const float *)(base + a.em_poff);
    for (size_t k = first; k < rows; k += step)
        a.out_probs[k] = __ldcg(pr + k);
    if (a.em_soff && a.out_scales) {
        const float *sc = (const float *)(base + a.em_soff);
        const size_t ns = rows * (size_t)a.nscale;
        for (size_t k = first; k < ns; k += step)
            a.out_scales[k] = __ldcg(sc + k);
    }
}

// Staged expert-major combine (a.em_stage): the caller's expert outputs (and probs_in) into
// this rank's staging, once every node-mate finished reading it in the previous combine
// (COMBINE_DONE >= the previous count; the dispatch rows it held were copied out already).
__global__ void k_em_stage_in(hep_kargs a)
{
    if (a.warm)
        return;
    if (ld_l2(a.over)) /* the layout exceeded the capacity: no combine (every rank alike) */
        return;
    const size_t rb = (size_t)a.H * 2, nvec = rb / 16;
    const size_t rows = (size_t)ld_l2(a.em + HEP_EM_NUM_PERMUTED), total = rows * nvec;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    char *base = a.x[a.local];
    if (!mates_done_reading(a))
        return;
    const uint4 *src = (const uint4 *)a.combine_in;
    uint4 *dst = (uint4 *)(base + a.em_xoff);
    for (size_t k = first; src && k < total; k += step)
        dst[k] = __ldg(src + k);
    float *pd = (float *)(base + a.em_poff);
    for (size_t k = first; a.probs_in && k < rows; k += step)
        pd[k] = __ldg(a.probs_in + k);
}

// The copy kernels: 512 threads a block, the kernel arguments by value.
static int launch_copy(void (*k)(hep_kargs), const hep_kargs *a, int blocks, void *stream)
{
    k<<<blocks, 512, 0, (cudaStream_t)stream>>>(*a);
    return (int)cudaGetLastError();
}

extern "C" int hep_launch_em_stage_out(const hep_kargs *a, int blocks, void *stream)
{
    return launch_copy(k_em_stage_out, a, blocks, stream);
}

extern "C" int hep_launch_em_stage_in(const hep_kargs *a, int blocks, void *stream)
{
    return launch_copy(k_em_stage_in, a, blocks, stream);
}

extern "C" int hep_launch_copy_in(const hep_kargs *a, int blocks, void *stream)
{
    return launch_copy(k_copy_in, a, blocks, stream);
}

extern "C" int hep_launch_copy_out(const hep_kargs *a, int blocks, void *stream)
{
    return launch_copy(k_copy_out, a, blocks, stream);
}

// Every copy kernel once, one block that returns at once (kernels/probe.cu says why).
extern "C" int hep_warm_copies(const hep_kargs *a, void *stream)
{
    static int (*const copies[])(const hep_kargs *, int, void *) = {
        hep_launch_copy_in, hep_launch_copy_out, hep_launch_em_stage_out, hep_launch_em_stage_in};
    hep_kargs w = *a;
    int e = 0;
    w.warm = 1;
    for (int i = 0; i < 4 && e == 0; i++)
        e = copies[i](&w, 1, stream);
    return e;
}
