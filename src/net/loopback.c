/* net/loopback.c: the loopback NIC. Keys and bounds are checked as a NIC checks them;
 * addresses are translated through the registered iova. In one process every NIC's
 * registrations are in one table (the fabric); across the processes of one host
 * (hep_loopback_create_shared) each NIC also holds a copy of every peer's registrations,
 * taken at connect, and reaches the peer's memory where its window is mapped here. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <infiniband/verbs.h>

#include "bootstrap/stream.h"
#include "core/core.h"
#include "net/net.h"

#define LB_MAX_MRS 65536
#define LB_XP_MRS 64 /* across processes: registrations a NIC may hold at connect */

typedef struct lb_mr {
    struct ibv_mr mr;   /* first: the helper sees a plain ibv_mr */
    struct lb_nic *owner;
    uint64_t iova, base; /* [iova, iova + length) is reachable; byte iova + k is base + k */
    size_t length;
    int access, device, live;
    int cuda_dev;        /* device memory: the GPU it is on */
} lb_mr;

/* Across processes: one registration of a peer, as it sent it at connect. */
typedef struct lb_remote {
    uint64_t iova, length;
    uint64_t off; /* of its first byte from the start of the peer's window */
    uint32_t rkey, access;
} lb_remote;

/* What a NIC sends at connect: its window and its registrations. */
typedef struct lb_card {
    uint64_t base, len;
    uint32_t count, pad;
    lb_remote mr[LB_XP_MRS];
} lb_card;

typedef struct lb_nic {
    hep_net net;
    hep_loopback_window *win; /* across processes: [world]; NULL: one process */
    lb_card *cards;           /* across processes, after connect: [world] */
    struct ibv_pd pd;   /* identity only; never passed to libibverbs */
    cudaStream_t stream; /* copies of device memory (kept for the process); never waits */
    cudaEvent_t last;    /* after this NIC's last copy */
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

/* Across processes: 1 when [addr, addr + len) is host memory inside this rank's window. */
static int in_window(const lb_nic *n, uint64_t addr, size_t len)
{
    const hep_loopback_window *w = &n->win[n->net.rank];
    int dev;
    if (is_device_memory(addr, &dev))
        return 0;
    return addr >= w->base && addr - w->base <= w->len && len <= w->len - (addr - w->base);
}

static struct ibv_mr *lb_reg_mr(void *ctx, struct ibv_pd *pd, void *addr, size_t len, int access)
{
    (void)ctx;
    if (!pd || !addr || !len) {
        errno = EINVAL;
        return NULL;
    }
    /* across processes a peer reaches only the shared window: elsewhere is a bad address */
    if (nic_of_pd(pd)->win && !in_window(nic_of_pd(pd), (uint64_t)(uintptr_t)addr, len)) {
        errno = EFAULT;
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
    if (nic_of_pd(pd)->win) { /* device memory: no window of another process reaches it */
        errno = EOPNOTSUPP;
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
        /* The copy stream, per (GPU, rank mod HEP_STREAM_NIC_SLOTS), is kept for the process
         * in the virtual ranks' table (bootstrap/stream.c): a stream made per NIC would,
         * after a few groups, share a hardware queue with a live rank's stream, and its copy
         * would wait behind that rank's kernel, which waits for the copy (seen on the H200:
         * the loopback NIC's flag landed after the 5 s timeout). Two NICs of ranks 16 apart
         * share a stream: their copies only serialize (none waits for a kernel), and each
         * NIC waits for its own event. */
        void *s = NULL;
        int rc = hep_kept_stream(gpu, HEP_STREAM_NIC_SLOT0 + n->net.rank % HEP_STREAM_NIC_SLOTS,
                                 "loopback NIC: its copy stream", &s);
        if (rc)
            return rc;
        n->stream = s;
        /* the thread posting (the proxy) starts on GPU 0: a rank of another GPU copies there */
        e = cudaSetDevice(gpu);
        if (e == cudaSuccess)
            e = cudaEventCreateWithFlags(&n->last, cudaEventDisableTiming);
        if (e != cudaSuccess)
            return hep_fail(HEP_ERR_CUDA, "loopback NIC: cannot create its copy event on GPU %d: "
                            "%s", gpu, cudaGetErrorString(e));
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

/* Across processes: where raddr of peer's registration rkey is mapped here, after the
 * checks a NIC makes (the same refusals as in one process). */
static int remote_target(lb_nic *n, int peer, uint32_t rkey, uint64_t raddr, size_t len, void **d)
{
    const lb_card *c;
    const lb_remote *m = NULL;
    if (!n->cards)
        return hep_fail(HEP_ERR_INVALID, "loopback NIC: a write before connect");
    c = &n->cards[peer];
    for (uint32_t i = 0; i < c->count && !m; i++)
        if (c->mr[i].rkey == rkey)
            m = &c->mr[i];
    if (!m)
        return refuse("loopback NIC: remote key 0x%x (address 0x%llx, %zu bytes) %s", rkey, raddr,
                      len, "is not registered at that peer (remote access error)");
    if (!(m->access & IBV_ACCESS_REMOTE_WRITE))
        return refuse("loopback NIC: remote key 0x%x (address 0x%llx, %zu bytes) %s", rkey, raddr,
                      len, "lacks IBV_ACCESS_REMOTE_WRITE");
    if (!(raddr >= m->iova && raddr - m->iova <= m->length &&
          len <= m->length - (raddr - m->iova)))
        return refuse("loopback NIC: remote key 0x%x: range 0x%llx+%zu %s", rkey, raddr, len,
                      "is outside its registration (remote access error)");
    if (!n->win[peer].here)
        return refuse("loopback NIC: remote key 0x%x (address 0x%llx, %zu bytes) %s", rkey, raddr,
                      len, "is in a peer process whose memory is not mapped here");
    /* connect checked that the registration lies in the window: off + length <= len */
    *d = n->win[peer].here + m->off + (raddr - m->iova);
    return HEP_OK;
}

static int lb_write(hep_net *net, int peer, uint32_t lkey, uint64_t laddr, uint32_t rkey,
                    uint64_t raddr, size_t len, uint64_t wr_id)
{
    lb_nic *n = (lb_nic *)net;
    lb_mr *src = NULL, *dst = NULL;
    void *d = NULL, *s;
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
    if (n->win) { /* across processes: the peer's registration as it sent it */
        rc = remote_target(n, peer, rkey, raddr, len, &d);
        if (rc)
            return rc;
        s = (void *)(uintptr_t)(src->base + (laddr - src->iova));
        hep_debug_jitter(); /* stress runs: a write (data or flag) posted late ... */
        rc = lb_copy(n, d, s, len, 0, 0);
    } else {
        if (!dst || dst->owner->net.rank != peer)
            return refuse("loopback NIC: remote key 0x%x (address 0x%llx, %zu bytes) %s", rkey,
                          raddr, len, "is not registered at that peer (remote access error)");
        if (!(dst->access & IBV_ACCESS_REMOTE_WRITE))
            return refuse("loopback NIC: remote key 0x%x (address 0x%llx, %zu bytes) %s", rkey,
                          raddr, len, "lacks IBV_ACCESS_REMOTE_WRITE");
        if (!in_range(dst, raddr, len))
            return refuse("loopback NIC: remote key 0x%x: range 0x%llx+%zu %s", rkey, raddr,
                          len, "is outside its registration (remote access error)");
        d = (void *)(uintptr_t)(dst->base + (raddr - dst->iova));
        s = (void *)(uintptr_t)(src->base + (laddr - src->iova));
        hep_debug_jitter(); /* stress runs: a write (data or flag) posted late ... */
        rc = lb_copy(n, d, s, len, src->device || dst->device,
                     src->device ? src->cuda_dev : dst->cuda_dev);
    }
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

/* Across processes: this NIC's card (its window and registrations). */
static int own_card(lb_nic *n, lb_card *c)
{
    const hep_loopback_window *w = &n->win[n->net.rank];
    int rc = HEP_OK;
    memset(c, 0, sizeof(*c));
    c->base = w->base;
    c->len = w->len;
    pthread_mutex_lock(&fabric.lock);
    for (uint32_t k = 0; k < LB_MAX_MRS && rc == HEP_OK; k++) {
        const lb_mr *m = fabric.mrs[k];
        if (!m || m->owner != n)
            continue;
        if (c->count == LB_XP_MRS) {
            rc = HEP_ERR_INVALID;
            break;
        }
        c->mr[c->count].iova = m->iova;
        c->mr[c->count].length = m->length;
        c->mr[c->count].off = m->base - w->base; /* in the window: lb_reg_mr checked it */
        c->mr[c->count].rkey = m->mr.rkey;
        c->mr[c->count].access = (uint32_t)m->access;
        c->count++;
    }
    pthread_mutex_unlock(&fabric.lock);
    if (rc)
        return hep_fail(rc, "loopback NIC: rank %d holds more than %d registrations at connect",
                        n->net.rank, LB_XP_MRS);
    return HEP_OK;
}

/* Across processes: every rank's card matches the window this rank was given for it, and
 * each registration lies inside that window. */
static int check_cards(const lb_nic *n)
{
    for (int r = 0; r < n->net.world; r++) {
        const lb_card *c = &n->cards[r];
        const hep_loopback_window *w = &n->win[r];
        if (c->base != w->base || c->len != w->len || c->count > LB_XP_MRS)
            return hep_fail(HEP_ERR_MISMATCH,
                            "loopback NIC: rank %d's window is 0x%llx+%llu, but this rank "
                            "(%d) was given 0x%llx+%llu for it",
                            r, (unsigned long long)c->base, (unsigned long long)c->len,
                            n->net.rank, (unsigned long long)w->base, (unsigned long long)w->len);
        for (uint32_t i = 0; i < c->count; i++)
            if (c->mr[i].off > w->len || c->mr[i].length > w->len - c->mr[i].off)
                return hep_fail(HEP_ERR_MISMATCH,
                                "loopback NIC: rank %d's registration of %llu bytes lies "
                                "outside its window",
                                r, (unsigned long long)c->mr[i].length);
    }
    return HEP_OK;
}

static int lb_connect(hep_net *net, const hep_bootstrap *bs)
{
    lb_nic *n = (lb_nic *)net;
    lb_card *mine;
    int rc;
    if (!n->win)
        return bs->barrier(bs->ctx); /* nothing to exchange: one address space */
    if (bs->size != net->world)
        return hep_fail(HEP_ERR_INVALID, "loopback NIC: a bootstrap of %d ranks, not %d",
                        bs->size, net->world);
    mine = malloc(sizeof(*mine));
    free(n->cards);
    n->cards = calloc((size_t)net->world, sizeof(*n->cards));
    if (!mine || !n->cards) {
        free(mine);
        return hep_fail(HEP_ERR_NOMEM, "loopback NIC: out of memory");
    }
    rc = own_card(n, mine);
    /* every rank takes part in the allgather, also one whose card failed: no rank waits */
    if (rc) {
        char keep[1024];
        snprintf(keep, sizeof(keep), "%s", hep_last_error());
        memset(mine, 0, sizeof(*mine));
        (void)bs->allgather(bs->ctx, mine, n->cards, sizeof(*mine));
        hep_set_error_text(keep);
    } else {
        rc = bs->allgather(bs->ctx, mine, n->cards, sizeof(*mine));
        if (rc == HEP_OK)
            rc = check_cards(n);
    }
    free(mine);
    if (rc) {
        free(n->cards);
        n->cards = NULL;
    }
    return rc;
}

static void lb_destroy(hep_net *net)
{
    lb_nic *n = (lb_nic *)net;
    if (n->have_stream) { /* its copies end; the stream stays for the next NIC (kept) */
        cudaError_t e = cudaEventSynchronize(n->last);
        if (e != cudaSuccess)
            hep_log(HEP_LOG_WARN, "loopback NIC of rank %d: waiting for its last copy: %s",
                    n->net.rank, cudaGetErrorString(e));
        e = cudaEventDestroy(n->last);
        if (e != cudaSuccess)
            hep_log(HEP_LOG_WARN, "loopback NIC of rank %d: cudaEventDestroy: %s", n->net.rank,
                    cudaGetErrorString(e));
    }
    free(n->done);
    free(n->cards);
    free(n->win);
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

int hep_loopback_create_shared(int rank, int world, const hep_loopback_window *win,
                               hep_net **out)
{
    lb_nic *n;
    int rc;
    if (!win || world < 1 || rank < 0 || rank >= world)
        return hep_fail(HEP_ERR_INVALID, "loopback NIC: no windows, or rank %d not in 0..%d",
                        rank, world - 1);
    rc = hep_loopback_create(rank, world, out);
    if (rc)
        return rc;
    n = (lb_nic *)*out;
    n->win = malloc((size_t)world * sizeof(*n->win));
    if (!n->win) {
        lb_destroy(*out);
        *out = NULL;
        return hep_fail(HEP_ERR_NOMEM, "loopback NIC: out of memory");
    }
    memcpy(n->win, win, (size_t)world * sizeof(*n->win));
    return HEP_OK;
}

void hep_loopback_get_stats(hep_loopback_stats *s)
{
    pthread_mutex_lock(&fabric.lock);
    *s = fabric.stats;
    pthread_mutex_unlock(&fabric.lock);
}
