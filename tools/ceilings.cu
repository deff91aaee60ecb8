// tools/ceilings.cu: the bench's yardsticks, measured in the same run as the phases.
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime.h>

#include "ceilings.h"

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            snprintf(why, why_len, "%s: %s", #x, cudaGetErrorString(e_));                      \
            goto out;                                                                          \
        }                                                                                      \
    } while (0)

// A streaming read of n 16-byte vectors: every byte read once.
__global__ void k_read(const uint4 *p, size_t n, unsigned *sink)
{
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (size_t)gridDim.x * blockDim.x) {
        uint4 v = __ldcs(p + k);
        acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
    }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) // keeps the loads; almost never true
        atomicAdd(sink, 1u);
}

// The plain copy a phase is compared with: a warp per row, eight 16-byte loads in flight per
// lane before the stores, rows spread over all warps of the grid.
__global__ void __launch_bounds__(1024) k_copy_rows(const uint4 *src, uint4 *dst, size_t rows,
                                                    size_t vec_per_row)
{
    const unsigned lane = threadIdx.x & 31u;
    const size_t nwarps = ((size_t)gridDim.x * blockDim.x) >> 5;
    for (size_t r = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += nwarps) {
        const uint4 *s = src + r * vec_per_row;
        uint4 *d = dst + r * vec_per_row;
        for (size_t v = lane; v < vec_per_row; v += 32 * 8) {
            uint4 x[8];
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (v + (size_t)u * 32 < vec_per_row)
                    x[u] = __ldcs(s + v + (size_t)u * 32);
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (v + (size_t)u * 32 < vec_per_row)
                    __stcs(d + v + (size_t)u * 32, x[u]);
        }
    }
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

// The median of n timings (sorts them).
static double median(double *t, int n)
{
    qsort(t, (size_t)n, sizeof(double), cmp_d);
    return t[n / 2];
}

extern "C" int ceil_sm_count(int device, char *why, size_t why_len)
{
    int sms = -1;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return sms;
out:
    return -1;
}

// op 0: D2D memcpy, 1: memset, 2: read kernel; median of 11 runs after a warm-up.
static int time_op(int op, void *a, void *c, size_t bytes, unsigned *sink, int sms,
                   cudaStream_t st, double *ms_out, char *why, size_t why_len)
{
    cudaEvent_t e0 = NULL, e1 = NULL;
    double t[11];
    int rc = -1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int k = -1; k < 11; k++) {
        float ms = 0;
        CK(cudaEventRecord(e0, st));
        if (op == 0)
            CK(cudaMemcpyAsync(c, a, bytes, cudaMemcpyDeviceToDevice, st));
        else if (op == 1)
            CK(cudaMemsetAsync(c, k & 0xff, bytes, st));
        else {
            k_read<<<sms * 4, 512, 0, st>>>((const uint4 *)a, bytes / 16, sink);
            CK(cudaGetLastError());
        }
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (k >= 0)
            t[k] = ms;
    }
    *ms_out = median(t, 11);
    rc = 0;
out:
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    return rc;
}

extern "C" int ceil_whole_gpu(int device, bench_ceilings *r, char *why, size_t why_len)
{
    const size_t bytes = (size_t)2 << 30;
    void *a = NULL, *c = NULL;
    unsigned *sink = NULL;
    cudaStream_t st = NULL;
    double ms[3];
    int sms = 0, rc = -1;
    CK(cudaSetDevice(device));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CK(cudaMalloc(&a, bytes));
    CK(cudaMalloc(&c, bytes));
    CK(cudaMalloc((void **)&sink, 4));
    CK(cudaMemsetAsync(a, 1, bytes, st));
    for (int op = 0; op < 3; op++)
        if (time_op(op, a, c, bytes, sink, sms, st, &ms[op], why, why_len))
            goto out;
    r->copy = 2.0 * (double)bytes / (ms[0] * 1e-3) / 1e9;
    r->write = (double)bytes / (ms[1] * 1e-3) / 1e9;
    r->read = (double)bytes / (ms[2] * 1e-3) / 1e9;
    rc = 0;
out:
    if (a)
        cudaFree(a);
    if (c)
        cudaFree(c);
    if (sink)
        cudaFree(sink);
    if (st)
        cudaStreamDestroy(st);
    return rc;
}

extern "C" int ceil_same_sm_copy(int device, int blocks, size_t rows, size_t row_bytes, int iters,
                                 double *ms_out, char *why, size_t why_len)
{
    void *a = NULL, *c = NULL;
    cudaStream_t st = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    double *t = NULL;
    int rc = -1;
    if (row_bytes % 16 || rows == 0 || blocks < 1 || iters < 1) {
        snprintf(why, why_len, "same-SM copy: %zu rows of %zu bytes (a multiple of 16), %d "
                 "blocks, %d iterations", rows, row_bytes, blocks, iters);
        return -1;
    }
    t = (double *)malloc(sizeof(double) * (size_t)iters);
    if (!t) {
        snprintf(why, why_len, "same-SM copy: out of host memory");
        return -1;
    }
    CK(cudaSetDevice(device));
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaMalloc(&a, rows * row_bytes));
    CK(cudaMalloc(&c, rows * row_bytes));
    CK(cudaMemsetAsync(a, 1, rows * row_bytes, st));
    for (int k = -1; k < iters; k++) {
        float ms = 0;
        CK(cudaEventRecord(e0, st));
        k_copy_rows<<<blocks, 1024, 0, st>>>((const uint4 *)a, (uint4 *)c, rows, row_bytes / 16);
        CK(cudaGetLastError());
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (k >= 0)
            t[k] = ms;
    }
    *ms_out = median(t, iters);
    rc = 0;
out:
    free(t);
    if (a)
        cudaFree(a);
    if (c)
        cudaFree(c);
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    if (st)
        cudaStreamDestroy(st);
    return rc;
}

// The loopback NIC's yardstick: `streams` streams each copying `bytes` device to device
// with cudaMemcpyAsync at the same time, the SMs idle, as the NICs of that many virtual
// ranks copy. *gbs = all streams' bytes (read + written) over the median time of `iters`
// runs, from the first start to the last end, after one warm-up.
extern "C" int ceil_stream_copies(int device, int streams, size_t bytes, int iters, double *gbs,
                                  char *why, size_t why_len)
{
    enum { MAXS = 64 };
    void *a[MAXS] = {0}, *c[MAXS] = {0};
    cudaStream_t st[MAXS] = {0};
    cudaEvent_t e0 = NULL, done[MAXS] = {0};
    cudaStream_t lead = NULL;
    double *t = NULL;
    int rc = -1;
    if (streams < 1 || streams > MAXS || bytes == 0 || iters < 1) {
        snprintf(why, why_len, "stream copies: %d streams (1..%d), %zu bytes, %d iterations",
                 streams, MAXS, bytes, iters);
        return -1;
    }
    t = (double *)malloc(sizeof(double) * (size_t)iters);
    if (!t) {
        snprintf(why, why_len, "stream copies: out of host memory");
        return -1;
    }
    CK(cudaSetDevice(device));
    CK(cudaStreamCreateWithFlags(&lead, cudaStreamNonBlocking));
    CK(cudaEventCreate(&e0));
    for (int s = 0; s < streams; s++) {
        CK(cudaStreamCreateWithFlags(&st[s], cudaStreamNonBlocking));
        CK(cudaEventCreate(&done[s]));
        CK(cudaMalloc(&a[s], bytes));
        CK(cudaMalloc(&c[s], bytes));
        CK(cudaMemset(a[s], 1, bytes));
    }
    CK(cudaDeviceSynchronize());
    for (int k = -1; k < iters; k++) {
        float ms = 0;
        CK(cudaEventRecord(e0, lead));
        for (int s = 0; s < streams; s++) {
            CK(cudaStreamWaitEvent(st[s], e0, 0));
            CK(cudaMemcpyAsync(c[s], a[s], bytes, cudaMemcpyDeviceToDevice, st[s]));
            CK(cudaEventRecord(done[s], st[s]));
            CK(cudaStreamWaitEvent(lead, done[s], 0));
        }
        CK(cudaEventRecord(done[0], lead)); // after every stream's copy
        CK(cudaEventSynchronize(done[0]));
        CK(cudaEventElapsedTime(&ms, e0, done[0]));
        if (k >= 0)
            t[k] = ms;
    }
    *gbs = 2.0 * (double)bytes * streams / (median(t, iters) * 1e-3) / 1e9;
    rc = 0;
out:
    free(t);
    for (int s = 0; s < streams; s++) {
        if (a[s])
            cudaFree(a[s]);
        if (c[s])
            cudaFree(c[s]);
        if (done[s])
            cudaEventDestroy(done[s]);
        if (st[s])
            cudaStreamDestroy(st[s]);
    }
    if (e0)
        cudaEventDestroy(e0);
    if (lead)
        cudaStreamDestroy(lead);
    return rc;
}

// The gather a user runs after a rank-major dispatch to get expert-major rows: dst row p is
// src row map[p] (or zeros where map[p] < 0, the padding), one 16-byte-vector loop a warp
// per row over all warps of the grid, eight vectors a lane in flight.
__global__ void __launch_bounds__(1024) k_gather_rows(const uint4 *src, uint4 *dst,
                                                      const int *map, size_t rows,
                                                      size_t vec_per_row)
{
    const unsigned lane = threadIdx.x & 31u;
    const size_t nwarps = ((size_t)gridDim.x * blockDim.x) >> 5;
    for (size_t r = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += nwarps) {
        const int j = map[r];
        const uint4 *s = src + (size_t)(j < 0 ? 0 : j) * vec_per_row;
        uint4 *d = dst + r * vec_per_row;
        for (size_t v = lane; v < vec_per_row; v += 32 * 8) {
            uint4 x[8];
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (v + (size_t)u * 32 < vec_per_row)
                    x[u] = j < 0 ? make_uint4(0, 0, 0, 0) : __ldcs(s + v + (size_t)u * 32);
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (v + (size_t)u * 32 < vec_per_row)
                    d[v + (size_t)u * 32] = x[u];
        }
    }
}

extern "C" int ceil_gather_rows(const void *src, void *dst, const int *map, size_t rows,
                                size_t row_bytes, int blocks, void *stream)
{
    if (row_bytes % 16 || blocks < 1)
        return (int)cudaErrorInvalidValue;
    if (rows == 0)
        return 0;
    k_gather_rows<<<blocks, 1024, 0, (cudaStream_t)stream>>>((const uint4 *)src, (uint4 *)dst, map,
                                                             rows, row_bytes / 16);
    return (int)cudaGetLastError();
}
