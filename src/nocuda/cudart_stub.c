/* nocuda/cudart_stub.c: the CUDA runtime calls of nocuda/cuda_runtime_api.h for a build
 * without CUDA. Each fails with cudaErrorNoDevice and touches none of its outputs except
 * where a caller relies on a defined value (counts, pointers set to zero). */
#include <stddef.h>

#include "cuda_runtime_api.h"

#define NO_CUDA_TEXT                                                                          \
    "this build of hybridep has no CUDA support (configured without a CUDA toolkit: "        \
    "nvcc 12.8 or newer); only the host backend is available"

const char *cudaGetErrorString(cudaError_t e)
{
    return e == cudaSuccess ? "no error" : NO_CUDA_TEXT;
}

const char *cudaGetErrorName(cudaError_t e)
{
    return e == cudaSuccess ? "cudaSuccess" : "cudaErrorNoDevice";
}

cudaError_t cudaGetLastError(void) { return cudaSuccess; }

cudaError_t cudaGetDeviceCount(int *n)
{
    if (n)
        *n = 0;
    return cudaErrorNoDevice;
}

cudaError_t cudaSetDevice(int dev) { return (void)dev, cudaErrorNoDevice; }
cudaError_t cudaGetDevice(int *dev) { return (void)dev, cudaErrorNoDevice; }
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int dev)
{
    return (void)p, (void)dev, cudaErrorNoDevice;
}
cudaError_t cudaDeviceSynchronize(void) { return cudaErrorNoDevice; }
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr attr, int dev)
{
    return (void)v, (void)attr, (void)dev, cudaErrorNoDevice;
}
cudaError_t cudaDeviceGetPCIBusId(char *id, int len, int dev)
{
    return (void)id, (void)len, (void)dev, cudaErrorNoDevice;
}
cudaError_t cudaDeviceCanAccessPeer(int *can, int dev, int peer)
{
    if (can)
        *can = 0;
    return (void)dev, (void)peer, cudaErrorNoDevice;
}
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags)
{
    return (void)peer, (void)flags, cudaErrorNoDevice;
}
cudaError_t cudaDriverGetVersion(int *v)
{
    if (v)
        *v = 0;
    return cudaErrorNoDevice;
}
cudaError_t cudaRuntimeGetVersion(int *v)
{
    if (v)
        *v = 0;
    return cudaErrorNoDevice;
}
cudaError_t cudaGetDriverEntryPointByVersion(const char *sym, void **fn, unsigned version,
                                             unsigned long long flags,
                                             cudaDriverEntryPointQueryResult *q)
{
    if (fn)
        *fn = NULL;
    if (q)
        *q = cudaDriverEntryPointSymbolNotFound;
    return (void)sym, (void)version, (void)flags, cudaErrorNoDevice;
}
cudaError_t cudaMalloc(void **p, size_t bytes)
{
    if (p)
        *p = NULL;
    return (void)bytes, cudaErrorNoDevice;
}
cudaError_t cudaFree(void *p) { return p ? cudaErrorNoDevice : cudaSuccess; }
cudaError_t cudaMallocHost(void **p, size_t bytes) { return cudaMalloc(p, bytes); }
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags)
{
    return (void)flags, cudaMalloc(p, bytes);
}
cudaError_t cudaFreeHost(void *p) { return cudaFree(p); }
cudaError_t cudaHostGetDevicePointer(void **d, void *h, unsigned flags)
{
    return (void)h, (void)flags, cudaMalloc(d, 0);
}
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes)
{
    if (free_bytes)
        *free_bytes = 0;
    if (total_bytes)
        *total_bytes = 0;
    return cudaErrorNoDevice;
}
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind k)
{
    return (void)dst, (void)src, (void)n, (void)k, cudaErrorNoDevice;
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind k,
                            cudaStream_t s)
{
    return (void)s, cudaMemcpy(dst, src, n, k);
}
cudaError_t cudaMemset(void *p, int v, size_t n)
{
    return (void)p, (void)v, (void)n, cudaErrorNoDevice;
}
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s)
{
    return (void)s, cudaMemset(p, v, n);
}
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p)
{
    /* no device exists, so every pointer is plain host memory */
    if (a) {
        a->type = cudaMemoryTypeUnregistered;
        a->device = -1;
        a->devicePointer = NULL;
        a->hostPointer = (void *)p;
    }
    return cudaSuccess;
}
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *h, void *p)
{
    return (void)h, (void)p, cudaErrorNoDevice;
}
cudaError_t cudaIpcOpenMemHandle(void **p, cudaIpcMemHandle_t h, unsigned flags)
{
    return (void)h, (void)flags, cudaMalloc(p, 0);
}
cudaError_t cudaIpcCloseMemHandle(void *p) { return (void)p, cudaErrorNoDevice; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags)
{
    if (s)
        *s = NULL;
    return (void)flags, cudaErrorNoDevice;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) { return (void)s, cudaErrorNoDevice; }
cudaError_t cudaStreamSynchronize(cudaStream_t s) { return (void)s, cudaErrorNoDevice; }
cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *st)
{
    if (st)
        *st = cudaStreamCaptureStatusNone;
    return (void)s, cudaErrorNoDevice;
}
cudaError_t cudaEventCreate(cudaEvent_t *e)
{
    if (e)
        *e = NULL;
    return cudaErrorNoDevice;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags)
{
    return (void)flags, cudaEventCreate(e);
}
cudaError_t cudaEventDestroy(cudaEvent_t e) { return (void)e, cudaErrorNoDevice; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    return (void)e, (void)s, cudaErrorNoDevice;
}
cudaError_t cudaEventQuery(cudaEvent_t e) { return (void)e, cudaErrorNoDevice; }
cudaError_t cudaEventSynchronize(cudaEvent_t e) { return (void)e, cudaErrorNoDevice; }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b)
{
    return (void)ms, (void)a, (void)b, cudaErrorNoDevice;
}
