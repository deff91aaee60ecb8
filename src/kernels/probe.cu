// kernels/probe.cu: a one-block kernel that proves this build's machine code runs on
// the device (used by `hybridep doctor`), the up-front load of every kernel, and the
// shared-memory opt-in of every launch of more than 48 KB.
#include <pthread.h>

#include <cuda_runtime.h>

#include "kernels/ep_kernels.h"
#include "kernels/kernels.h"

__global__ void hep_probe_kernel(unsigned *out, unsigned seed)
{
    unsigned v = seed ^ (threadIdx.x * 2654435761u);
    atomicAdd(out, v & 1u);
}

__global__ void hep_touch_kernel() {}

extern "C" int hep_stream_touch(void *stream)
{
    hep_touch_kernel<<<1, 32, 0, (cudaStream_t)stream>>>();
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess)
        e = cudaStreamSynchronize((cudaStream_t)stream);
    return (int)e;
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

// A kernel instance's dynamic shared-memory limit is one value per process and device,
// shared by every group and thread that launches it. Set to each launch's own size, two
// groups of different sizes in one process lower it under each other between set and
// launch ("too many resources requested for launch"). It is therefore raised to the
// device's opt-in maximum less a bound on the kernels' static shared memory
// (tests/kernel_spills.sh holds them to it): the same value whoever sets it, so it is set
// once per instance and device. Each (instance, device) set is remembered with the device's
// opt-in maximum: a later launch checks its size against that without a runtime call. The
// calls it saves ran on the host between the caller's stream work and the kernel, each
// launch (bench/NOTES.md, session 25).
#define HEP_STATIC_SMEM_BOUND 16384
#define HEP_SMEM_SETS 64 /* instances x devices remembered; past that, set every launch */
namespace {
struct smem_set {
    const void *k;
    int dev, optin;
};
smem_set g_smem_set[HEP_SMEM_SETS];
int g_smem_nset;
pthread_mutex_t g_smem_mu = PTHREAD_MUTEX_INITIALIZER;
} // namespace
extern "C" int hep_allow_smem(const void *k, size_t smem)
{
    int dev = 0, optin = 0;
    if (smem <= 48 * 1024)
        return 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess)
        return (int)e;
    int known = -1;
    pthread_mutex_lock(&g_smem_mu);
    for (int i = 0; i < g_smem_nset; i++)
        if (g_smem_set[i].k == k && g_smem_set[i].dev == dev)
            known = g_smem_set[i].optin;
    pthread_mutex_unlock(&g_smem_mu);
    if (known >= 0)
        return smem + HEP_STATIC_SMEM_BOUND > (size_t)known ? (int)cudaErrorInvalidValue : 0;
    e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e != cudaSuccess)
        return (int)e;
    if (smem + HEP_STATIC_SMEM_BOUND > (size_t)optin)
        return (int)cudaErrorInvalidValue;
    e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             optin - HEP_STATIC_SMEM_BOUND);
    if (e != cudaSuccess)
        return (int)e;
    pthread_mutex_lock(&g_smem_mu);
    bool seen = false;
    for (int i = 0; i < g_smem_nset; i++)
        seen |= g_smem_set[i].k == k && g_smem_set[i].dev == dev;
    if (!seen && g_smem_nset < HEP_SMEM_SETS)
        g_smem_set[g_smem_nset++] = smem_set{k, dev, optin};
    pthread_mutex_unlock(&g_smem_mu);
    return 0;
}

extern "C" int hep_warm_dispatch(const hep_kargs *a, void *stream);
extern "C" int hep_warm_dispatch_bulk(const hep_kargs *a, void *stream);
extern "C" int hep_warm_combine(const hep_kargs *a, void *stream);
extern "C" int hep_warm_copies(const hep_kargs *a, void *stream);
extern "C" int hep_warm_node_pack(const hep_kargs *a, void *stream);

// A kernel's first launch in a process does more than later ones. With lazy module loading
// (the CUDA 12+ default) it loads the kernel, and the load waits for the kernels already
// running (bench/first_launch.cu, mode cold): when those spin waiting for a node-mate's
// first call, they give up (HEP_TIMEOUT_MS) before it starts. With every kernel loaded, a
// group's first call in a fresh process still timed out now and then, a node-mate's kernel
// starting only after the others gave up; less often once every kernel had run once, not
// at all in 100 processes with the kept streams' first kernels as well (bench/RESULTS.md,
// 2026-12-02; the cause is not known). Group creation therefore launches every kernel
// instance once, before any rank's first call, on the legacy stream, and waits for them.
extern "C" int hep_kernels_warm(const hep_kargs *a, int bulk)
{
    int e = bulk ? hep_warm_dispatch_bulk(a, cudaStreamLegacy)
                 : hep_warm_dispatch(a, cudaStreamLegacy);
    if (e == 0)
        e = hep_warm_combine(a, cudaStreamLegacy);
    if (e == 0)
        e = hep_warm_copies(a, cudaStreamLegacy);
    if (e == 0)
        e = hep_warm_node_pack(a, cudaStreamLegacy);
    if (e == 0)
        e = (int)cudaStreamSynchronize(cudaStreamLegacy);
    return e;
}
