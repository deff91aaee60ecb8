// kernels/probe.cu: a one-block kernel that proves this build's machine code runs on
// the device (used by `hybridep doctor`), and the up-front load of every kernel.
#include <cuda_runtime.h>

#include "kernels/ep_kernels.h"
#include "kernels/kernels.h"

__global__ void hep_probe_kernel(unsigned *out, unsigned seed)
{
    unsigned v = seed ^ (threadIdx.x * 2654435761u);
    atomicAdd(out, v & 1u);
}

extern "C" int hep_kernels_probe(int device, char *why, size_t why_len)
{
    unsigned *d = nullptr, h = 0, expect = 0;
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess)
        e = cudaMalloc(&d, sizeof(unsigned));
    if (e == cudaSuccess)
        e = cudaMemset(d, 0, sizeof(unsigned));
    if (e == cudaSuccess) {
        hep_probe_kernel<<<1, 128>>>(d, 12345u);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess)
        e = cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost);
    if (d)
        cudaFree(d);
    for (unsigned t = 0; t < 128; t++)
        expect += (12345u ^ (t * 2654435761u)) & 1u;
    if (e != cudaSuccess) {
        snprintf(why, why_len, "%s: %s", cudaGetErrorName(e), cudaGetErrorString(e));
        (void)cudaGetLastError();
        return -1;
    }
    if (h != expect) {
        snprintf(why, why_len, "probe kernel returned %u, expected %u", h, expect);
        return -1;
    }
    snprintf(why, why_len, "ok");
    return 0;
}

// The loopback NIC's copy between two device buffers with HEP_LOOPBACK_COPY=kernel, in
// place of cudaMemcpyAsync: under compute-sanitizer a memory copy waits for every kernel of
// the device, so a copy that a spinning kernel waits for only ran once that kernel gave up;
// kernels of several streams run side by side under the tool. The source was written by a
// kernel that may still run (it fenced and published a ready word, which the proxy saw):
// the copy reads through L2. Its writes are visible to the next operation of the stream
// (the flag's copy) and, with it, to the waiting kernels.
__global__ void hep_net_copy_kernel(char *dst, const char *src, size_t len)
{
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    size_t done = 0;
    if ((((uintptr_t)dst | (uintptr_t)src) & 15u) == 0) {
        const size_t n = len / 16;
        for (size_t k = first; k < n; k += step)
            ((uint4 *)dst)[k] = __ldcg((const uint4 *)src + k);
        done = n * 16;
    } else if ((((uintptr_t)dst | (uintptr_t)src) & 7u) == 0) { /* flags: 8-byte words */
        const size_t n = len / 8;
        for (size_t k = first; k < n; k += step)
            ((unsigned long long *)dst)[k] = __ldcg((const unsigned long long *)src + k);
        done = n * 8;
    }
    for (size_t k = done + first; k < len; k += step)
        dst[k] = __ldcg((const signed char *)src + k);
}

extern "C" int hep_net_copy_async(void *dst, const void *src, size_t len, void *stream)
{
    /* 8 vectors a thread at least, at most 64 blocks: a flag is one block, a 5 MB chunk 64 */
    size_t blocks = (len / 16 + 512 * 8 - 1) / (512 * 8);
    blocks = blocks < 1 ? 1 : blocks > 64 ? 64 : blocks;
    hep_net_copy_kernel<<<(unsigned)blocks, 512, 0, (cudaStream_t)stream>>>(
        (char *)dst, (const char *)src, len);
    return (int)cudaGetLastError();
}

extern "C" int hep_preload_dispatch(void);
extern "C" int hep_preload_combine(void);
extern "C" int hep_preload_node_pack(void);

// With lazy module loading (the CUDA 12+ default) a kernel's first launch loads it, and the
// load can wait for the kernels already running: when those spin for this very kernel,
// that is a deadlock. Group creation loads every kernel up front.
extern "C" int hep_kernels_preload(void)
{
    cudaFuncAttributes fa;
    int e = hep_preload_dispatch();
    if (e == 0)
        e = hep_preload_combine();
    if (e == 0) /* the loopback NIC's copy kernel: launched while the ranks' kernels spin */
        e = (int)cudaFuncGetAttributes(&fa, (const void *)hep_net_copy_kernel);
    if (e == 0)
        e = hep_preload_node_pack();
    return e;
}
