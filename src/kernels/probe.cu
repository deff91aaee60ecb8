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

extern "C" int hep_preload_dispatch(void);
extern "C" int hep_preload_combine(void);
extern "C" int hep_preload_node_pack(void);

// With lazy module loading (the CUDA 12+ default) a kernel's first launch loads it, and the
// load can wait for the kernels already running: when those spin for this very kernel,
// that is a deadlock. Group creation loads every kernel up front.
extern "C" int hep_kernels_preload(void)
{
    int e = hep_preload_dispatch();
    if (e == 0)
        e = hep_preload_combine();
    if (e == 0)
        e = hep_preload_node_pack();
    return e;
}
