/* bootstrap/stream.c: the CUDA streams kept for the process, per (device, slot): the
 * virtual ranks' (hep_inproc_stream) and the loopback NIC's copy streams, one table under
 * one lock. Nothing here is ever destroyed: see hep_inproc_stream in hybridep/bootstrap.h
 * for why (a GPU's 32 hardware queues are handed out in turn, whatever was destroyed). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "bootstrap/stream.h"
#include "core/core.h"
#include "kernels/kernels.h"

static struct {
    pthread_mutex_t lock;
    int devices;          /* what cudaGetDeviceCount said; set with the table */
    cudaStream_t **table; /* [devices]: NULL until its first stream, then [HEP_STREAM_SLOTS] */
} kept = {PTHREAD_MUTEX_INITIALIZER, 0, NULL};

static int cuda_fail(cudaError_t e, const char *who, int device, const char *call)
{
    int st = e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ? HEP_ERR_UNAVAILABLE
             : e == cudaErrorMemoryAllocation                            ? HEP_ERR_NOMEM
                                                                          : HEP_ERR_CUDA;
    (void)cudaGetLastError();
    return hep_fail(st, "%s, CUDA device %d: %s failed: %s (%s)", who, device, call,
                    cudaGetErrorName(e), cudaGetErrorString(e));
}

/* Device `device`'s slots, with the lock held. The device count is asked once, at the
 * first call that succeeds in asking (a process's devices do not change). */
static int slots_of(int device, const char *who, cudaStream_t **row)
{
    if (!kept.table) {
        int n = 0;
        cudaError_t e = cudaGetDeviceCount(&n);
        if (e != cudaSuccess)
            return cuda_fail(e, who, device, "cudaGetDeviceCount");
        if (n <= 0)
            return hep_fail(HEP_ERR_UNAVAILABLE, "%s, CUDA device %d: this process sees no "
                            "CUDA device", who, device);
        kept.table = calloc((size_t)n, sizeof(*kept.table));
        if (!kept.table)
            return hep_fail(HEP_ERR_NOMEM, "%s: out of host memory", who);
        kept.devices = n;
    }
    if (device >= kept.devices)
        return hep_fail(HEP_ERR_INVALID, "%s: CUDA device %d does not exist (this process sees "
                        "%d: 0..%d)", who, device, kept.devices, kept.devices - 1);
    if (!kept.table[device]) {
        kept.table[device] = calloc(HEP_STREAM_SLOTS, sizeof(cudaStream_t));
        if (!kept.table[device])
            return hep_fail(HEP_ERR_NOMEM, "%s: out of host memory", who);
    }
    *row = kept.table[device];
    return HEP_OK;
}

/* A non-blocking stream on `device`; the calling thread's device is restored after. */
static int make_stream(int device, const char *who, cudaStream_t *s)
{
    int prev = device, rc = HEP_OK;
    cudaError_t e = cudaGetDevice(&prev);
    if (e != cudaSuccess)
        return cuda_fail(e, who, device, "cudaGetDevice");
    if (prev != device && (e = cudaSetDevice(device)) != cudaSuccess)
        return cuda_fail(e, who, device, "cudaSetDevice");
    e = cudaStreamCreateWithFlags(s, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        *s = NULL;
        rc = cuda_fail(e, who, device, "cudaStreamCreateWithFlags");
    } else if ((e = (cudaError_t)hep_stream_touch(*s)) != cudaSuccess) {
        /* its first kernel now, while nothing waits for it (bench/RESULTS.md, 2026-12-02) */
        (void)cudaStreamDestroy(*s);
        *s = NULL;
        rc = cuda_fail(e, who, device, "the stream's first kernel");
    }
    if (prev != device && (e = cudaSetDevice(prev)) != cudaSuccess && rc == HEP_OK)
        rc = cuda_fail(e, who, device, "cudaSetDevice back to the caller's device");
    return rc;
}

/* The hardware queues a process gets on a GPU: CUDA_DEVICE_MAX_CONNECTIONS (1..32), 8
 * when unset or not a number in that range (CUDA's default). */
int hep_stream_queues(void)
{
    const char *v = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    char *end = NULL;
    long n = v && *v ? strtol(v, &end, 10) : 0;
    return end && *end == 0 && n >= 1 && n <= 32 ? (int)n : 8;
}

/* The streams made in a device's slots (lock held). */
static int made_in(const cudaStream_t *row)
{
    int n = 0;
    for (int i = 0; row && i < HEP_STREAM_SLOTS; i++)
        n += row[i] != NULL;
    return n;
}

int hep_kept_streams(int device)
{
    int n = 0;
    pthread_mutex_lock(&kept.lock);
    if (kept.table && device >= 0 && device < kept.devices)
        n = made_in(kept.table[device]);
    pthread_mutex_unlock(&kept.lock);
    return n;
}

int hep_stream_queue_note(char *buf, size_t len, int device, int kept_n, int queues)
{
    if (!buf || !len)
        return 0;
    buf[0] = 0;
    if (kept_n < queues)
        return 0;
    snprintf(buf, len, "; this process keeps %d streams on GPU %d, at least as many as its %d "
             "hardware queues (CUDA_DEVICE_MAX_CONNECTIONS): a stream made or a CUDA graph "
             "launched on that GPU since shares a queue with a rank's", kept_n, device, queues);
    return 1;
}

/* After a stream was made on `device` (lock held; row: its slots): the one that takes the
 * GPU's last hardware queue says so (streams are made one at a time, under the lock, so
 * the count meets the queues once). */
static void note_queues(int device, const cudaStream_t *row)
{
    const int queues = hep_stream_queues(), n = made_in(row);
    if (n == queues)
        hep_log(HEP_LOG_WARN, "GPU %d: %d kept streams (virtual ranks' and loopback NICs') take "
                "all %d of its hardware queues (CUDA_DEVICE_MAX_CONNECTIONS); a stream made or a "
                "CUDA graph launched on it from now on shares a queue with one of them, and a "
                "co-dependent rank's kernel can then wait behind another until the timeout",
                device, n, queues);
}

int hep_kept_stream(int device, int slot, const char *who, void **out)
{
    cudaStream_t *row = NULL;
    int rc;
    *out = NULL;
    if (slot < 0 || slot >= HEP_STREAM_SLOTS)
        return hep_fail(HEP_ERR_INTERNAL, "%s: stream slot %d is not in 0..%d", who, slot,
                        HEP_STREAM_SLOTS - 1);
    if (device < 0)
        return hep_fail(HEP_ERR_INVALID, "%s: CUDA device %d is not a device number", who,
                        device);
    pthread_mutex_lock(&kept.lock);
    rc = slots_of(device, who, &row);
    if (rc == HEP_OK && !row[slot] && (rc = make_stream(device, who, &row[slot])) == HEP_OK)
        note_queues(device, row);
    if (rc == HEP_OK)
        *out = row[slot];
    pthread_mutex_unlock(&kept.lock);
    return rc;
}

int hep_inproc_stream(int device, int rank, void **stream)
{
    if (!stream)
        return hep_fail(HEP_ERR_INVALID, "hep_inproc_stream: the output pointer is NULL");
    *stream = NULL;
    if (rank < 0 || rank >= HEP_INPROC_MAX_RANKS)
        return hep_fail(HEP_ERR_INVALID, "hep_inproc_stream: rank %d is not in 0..%d", rank,
                        HEP_INPROC_MAX_RANKS - 1);
    return hep_kept_stream(device, rank, "hep_inproc_stream", stream);
}
