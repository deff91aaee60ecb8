/* net/loopback.c: the loopback NIC. Keys and bounds are checked as a NIC checks them;
 * addresses are translated through the registered iova. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <infiniband/verbs.h>

#include "core/core.h"
#include "net/net.h"

#define LB_MAX_MRS 65536

typedef struct lb_mr {
    struct ibv_mr mr;   /* first: the helper sees a plain ibv_mr */
    struct lb_nic *owner;
    uint64_t iova, base; /* [iova, iova + length) is reachable; byte iova + k is base + k */
    size_t length;
    int access, device, live;
    int cuda_dev;        /* device memory: the GPU it is on */
} lb_mr;

typedef struct lb_nic {
    hep_net net;
    struct ibv_pd pd;   /* identity only; never passed to libibverbs */
    cudaStream_t stream; /* copies of device memory; never waits for the kernels */
    cudaEvent_t last;
    int have_stream;
    hep_net_completion *done; /* completions waiting to be polled */
    int ndone, cap;
} lb_nic;

static struct {
    pthread_mutex_t lock;
    lb_mr *mrs[LB_MAX_MRS]; /* key k is slot k - 1 */
    uint32_t next;
    hep_loopback_stats stats;
} fabric = {PTHREAD_MUTEX_INITIALIZER};

static lb_nic *nic_of_pd(struct ibv_pd *pd)
{
    return (lb_nic *)((char *)pd - offsetof(lb_nic, pd));
}

/* 1 for device (or managed) memory, with its GPU in *dev. */
static int is_device_memory(uint64_t addr, int *dev)
{
    struct cudaPointerAttributes a;
    *dev = 0;
    if (cudaPointerGetAttributes(&a, (void *)(uintptr_t)addr) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    *dev = a.device;
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

static struct ibv_mr *lb_register(struct ibv_pd *pd, uint64_t iova, uint64_t base, size_t len,
                                  int access)
{
    lb_mr *m = calloc(1, sizeof(*m));
    uint32_t key = 0;
    if (!m) {
        errno = ENOMEM;
        return NULL;
    }
    pthread_mutex_lock(&fabric.lock);
    for (uint32_t i = 0; i < LB_MAX_MRS && !key; i++) {
        uint32_t slot = (fabric.next + i) % LB_MAX_MRS;
        if (!fabric.mrs[slot]) {
            key = slot + 1;
            fabric.next = slot + 1;
        }
    }
    if (key) {
        fabric.mrs[key - 1] = m;
        fabric.stats.live_mrs++;
    }
    pthread_mutex_unlock(&fabric.lock);
    if (!key) {
        free(m);
        errno = ENOSPC;
        return NULL;
    }
    m->owner = nic_of_pd(pd);
    m->iova = iova;
    m->base = base;
    m->length = len;
    m->access = access;
    m->device = is_device_memory(base, &m->cuda_dev);
    m->live = 1;
    m->mr.pd = pd;
    m->mr.lkey = key;
    m->mr.rkey = key ^ 0x80000000u; /* distinct from the lkey, as on real NICs */
    m->mr.length = len;
    m->mr.addr = (void *)(uintptr_t)iova;
    return &m->mr;
}

static struct ibv_mr *lb_reg_mr(void *ctx, struct ibv_pd *pd, void *addr, size_t len, int access)
{
    (void)ctx;
    if (!pd || !addr || !len) {
        errno = EINVAL;
        return NULL;
    }
    return lb_register(pd, (uint64_t)(uintptr_t)addr, (uint64_t)(uintptr_t)addr, len, access);
}

static struct ibv_mr *lb_reg_dmabuf_mr(void *ctx, struct ibv_pd *pd, uint64_t offset, size_t len,
                                       uint64_t iova, int fd, int access)
{
    struct ibv_mr *mr;
    (void)ctx;
    if (!pd || fd < 0 || !len) {
        errno = EINVAL;
        return NULL;
    }
    /* In one address space the exported range starts at its iova (the helper passes the
     * page-aligned CUDA address): byte k of the DMA-BUF is at iova + offset + k. */
    mr = lb_register(pd, iova, iova + offset, len, access);
    if (mr)
        mr->addr = (void *)(uintptr_t)offset; /* as rdma-core reports a DMA-BUF MR */
    return mr;
}

static int lb_dereg_mr(void *ctx, struct ibv_mr *mr)
{
    lb_mr *m = (lb_mr *)mr;
    uint32_t key = mr ? mr->lkey : 0;
    (void)ctx;
    if (!mr || key == 0 || key > LB_MAX_MRS)
        return EINVAL;
    pthread_mutex_lock(&fabric.lock);
    if (fabric.mrs[key - 1] != m) {
        pthread_mutex_unlock(&fabric.lock);
        return EINVAL;
    }
    fabric.mrs[key - 1] = NULL;
    fabric.stats.live_mrs--;
    pthread_mutex_unlock(&fabric.lock);
    free(m);
    return 0;
}

/* The range check a NIC does: no overflow in the arithmetic. */
static int in_range(const lb_mr *m, uint64_t addr, size_t len)
{
    return addr >= m->iova && addr - m->iova <= m->length && len <= m->length - (addr - m->iova);
}

static int refuse(const char *fmt, uint32_t key, uint64_t addr, size_t len, const char *why)
{
    pthread_mutex_lock(&fabric.lock);
    fabric.stats.refused++;
    pthread_mutex_unlock(&fabric.lock);
    return hep_fail(HEP_ERR_VERBS, fmt, key, (unsigned long long)addr, len, why);
}

static int push_completion(lb_nic *n, uint64_t wr_id, int status, int peer)
{
    if (n->ndone == n->cap) {
        int cap = n->cap ? n->cap * 2 : 64;
        hep_net_completion *d = realloc(n->done, (size_t)cap * sizeof(*d));
        if (!d)
            return hep_fail(HEP_ERR_NOMEM, "loopback NIC: completion queue out of memory");
        n->done = d;
        n->cap = cap;
    }
    n->done[n->ndone].wr_id = wr_id;
    n->done[n->ndone].status = status;
    n->done[n->ndone].peer = peer;
    n->ndone++;
    return HEP_OK;
}

/* device: copy with the copy engine of GPU `gpu` (the source's, where it is device
 * memory), on the NIC's stream there. */
static int lb_copy(lb_nic *n, void *dst, const void *src, size_t len, int device, int gpu)
{
    cudaError_t e;
    if (!device) {
        if (hep_env_get()->jitter_us && len > 8) {
            /* stress runs: the data lands in two parts, a delay apart, so that a reader
             * that reads before the flag sees a half-written chunk */
            memcpy(dst, src, len / 2);
            hep_debug_jitter();
            memcpy((char *)dst + len / 2, (const char *)src + len / 2, len - len / 2);
        } else {
            memcpy(dst, src, len);
        }
        /* a later write (the flag) becomes visible after this one to an acquiring reader,
         * on any CPU: the ordering an RC connection gives */
        __atomic_thread_fence(__ATOMIC_RELEASE);
        return HEP_OK;
    }
    if (!n->have_stream) {
        /* the thread posting (the proxy) starts on GPU 0: a rank of another GPU copies there */
        e = cudaSetDevice(gpu);
        if (e == cudaSuccess)
            e = cudaStreamCreateWithFlags(&n->stream, cudaStreamNonBlocking);
        if (e == cudaSuccess)
            e = cudaEventCreateWithFlags(&n->last, cudaEventDisableTiming);
        if (e != cudaSuccess)
            return hep_fail(HEP_ERR_CUDA, "loopback NIC: cannot create its copy stream: %s",
                            cudaGetErrorString(e));
        n->have_stream = 1;
    }
    e = cudaMemcpyAsync(dst, src, len, cudaMemcpyDefault, n->stream);
    if (e == cudaSuccess)
        e = cudaEventRecord(n->last, n->stream);
    if (e != cudaSuccess)
        return hep_fail(HEP_ERR_CUDA, "loopback NIC: copy of %zu bytes failed: %s", len,
                        cudaGetErrorString(e));
    return HEP_OK;
}

static int lb_write(hep_net *net, int peer, uint32_t lkey, uint64_t laddr, uint32_t rkey,
                    uint64_t raddr, size_t len, uint64_t wr_id)
{
    lb_nic *n = (lb_nic *)net;
    lb_mr *src = NULL, *dst = NULL;
    void *d, *s;
    int rc;

    pthread_mutex_lock(&fabric.lock);
    if (lkey >= 1 && lkey <= LB_MAX_MRS)
        src = fabric.mrs[lkey - 1];
    if ((rkey ^ 0x80000000u) >= 1 && (rkey ^ 0x80000000u) <= LB_MAX_MRS)
        dst = fabric.mrs[(rkey ^ 0x80000000u) - 1];
    pthread_mutex_unlock(&fabric.lock);

    if (peer < 0 || peer >= net->world)
        return hep_fail(HEP_ERR_INVALID, "loopback NIC: peer %d is not in 0..%d", peer,
                        net->world - 1);
    if (!src || src->owner != n)
        return refuse("loopback NIC: local key 0x%x (address 0x%llx, %zu bytes) %s", lkey, laddr,
                      len, "is not registered in this NIC's protection domain");
    if (!in_range(src, laddr, len))
        return refuse("loopback NIC: local key 0x%x: range 0x%llx+%zu %s", lkey, laddr, len,
                      "is outside its registration");
    if (!dst || dst->owner->net.rank != peer)
        return refuse("loopback NIC: remote key 0x%x (address 0x%llx, %zu bytes) %s", rkey, raddr,
                      len, "is not registered at that peer (remote access error)");
    if (!(dst->access & IBV_ACCESS_REMOTE_WRITE))
        return refuse("loopback NIC: remote key 0x%x (address 0x%llx, %zu bytes) %s", rkey, raddr,
                      len, "lacks IBV_ACCESS_REMOTE_WRITE");
    if (!in_range(dst, raddr, len))
        return refuse("loopback NIC: remote key 0x%x: range 0x%llx+%zu %s", rkey, raddr, len,
                      "is outside its registration (remote access error)");
    d = (void *)(uintptr_t)(dst->base + (raddr - dst->iova));
    s = (void *)(uintptr_t)(src->base + (laddr - src->iova));
    hep_debug_jitter(); /* stress runs: a write (data or flag) posted late ... */
    rc = lb_copy(n, d, s, len, src->device || dst->device,
                 src->device ? src->cuda_dev : dst->cuda_dev);
    if (rc)
        return rc;
    hep_debug_jitter(); /* ... and the next one (its flag) later still */
    pthread_mutex_lock(&fabric.lock);
    fabric.stats.writes++;
    fabric.stats.bytes += len;
    pthread_mutex_unlock(&fabric.lock);
    return push_completion(n, wr_id, 0, peer);
}

static int lb_poll(hep_net *net, hep_net_completion *out, int max)
{
    lb_nic *n = (lb_nic *)net;
    int k;
    if (n->have_stream && n->ndone) {
        cudaError_t e = cudaEventQuery(n->last);
        if (e == cudaErrorNotReady)
            return 0; /* copies still in flight: their writes have not completed yet */
        if (e != cudaSuccess)
            return -hep_fail(HEP_ERR_CUDA, "loopback NIC: a copy failed: %s",
                             cudaGetErrorString(e));
    }
    k = n->ndone < max ? n->ndone : max;
    memcpy(out, n->done, (size_t)k * sizeof(*out));
    memmove(n->done, n->done + k, (size_t)(n->ndone - k) * sizeof(*out));
    n->ndone -= k;
    return k;
}

static int lb_connect(hep_net *net, const hep_bootstrap *bs)
{
    (void)net;
    return bs->barrier(bs->ctx); /* nothing to exchange: one address space */
}

static void lb_destroy(hep_net *net)
{
    lb_nic *n = (lb_nic *)net;
    if (n->have_stream) {
        cudaStreamSynchronize(n->stream);
        cudaEventDestroy(n->last);
        cudaStreamDestroy(n->stream);
    }
    free(n->done);
    free(n);
}

static const hep_net_vtbl lb_vtbl = {"loopback", lb_connect, lb_write, lb_poll, lb_destroy};

int hep_loopback_create(int rank, int world, hep_net **out)
{
    lb_nic *n = calloc(1, sizeof(*n));
    const hep_gpu_mr_ops *real = hep_gpu_mr_real_ops();
    if (!n)
        return hep_fail(HEP_ERR_NOMEM, "loopback NIC: out of memory");
    n->net.v = &lb_vtbl;
    n->net.pd = &n->pd;
    n->net.rank = rank;
    n->net.world = world;
    /* registrations go to the fabric; the DMA-BUF export itself is the real one */
    n->net.mr_ops = *real;
    n->net.mr_ops.reg_mr = lb_reg_mr;
    n->net.mr_ops.reg_dmabuf_mr = lb_reg_dmabuf_mr;
    n->net.mr_ops.dereg_mr = lb_dereg_mr;
    *out = &n->net;
    return HEP_OK;
}

void hep_loopback_get_stats(hep_loopback_stats *s)
{
    pthread_mutex_lock(&fabric.lock);
    *s = fabric.stats;
    pthread_mutex_unlock(&fabric.lock);
}
