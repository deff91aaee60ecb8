/* net/proxy.c: the CPU proxy thread (see proxy.h). */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "net/proxy.h"

struct hep_proxy {
    hep_net *net;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int stop, busy;             /* busy: a batch is in flight */
    hep_proxy_chunk *chunks;
    unsigned char *posted;      /* per chunk */
    unsigned char *resolved;    /* per chunk: its extent was read from its descriptor */
    double *seen_ms;            /* per chunk: when it was first seen ready */
    int *next_same;             /* per chunk: the next chunk of the batch to its peer, or n */
    int *first_unposted;        /* [world]: the peer's earliest chunk not yet posted, or n */
    int n, remaining_posts;     /* chunks not yet posted */
    int lo;                     /* every chunk before it is posted */
    uint64_t epoch, outstanding;/* work requests not yet completed */
    double deadline_ms;
    int rc;
    char msg[1024];
    hep_proxy_peer_stats *stats;/* [world] */
};

#define FLAG_WR (1ull << 32) /* work request ids: chunk index, + FLAG_WR for its flag */

static void batch_fail(hep_proxy *p, int rc, const char *msg)
{
    if (p->rc)
        return;
    p->rc = rc;
    snprintf(p->msg, sizeof(p->msg), "%s", msg);
}

/* The producer (a kernel through host-mapped memory, or a host thread) writes a chunk's
 * extent, then its ready word with release semantics (the kernels: __threadfence_system,
 * then st.release.sys). The proxy reads them the other way round: ready with acquire
 * first, the extent after it. The extent words were plain volatile reads, which C11 does
 * not order after the acquire (a data race in its terms; x86 does not reorder loads, so
 * it was not a failure there, but the compiler and other hosts may): they are atomic loads
 * now. An extent of the previous call can then be read only with that call's ready word,
 * and then the chunk is not ready. */
static uint64_t ready_value(const hep_proxy_chunk *c)
{
    return __atomic_load_n((const uint64_t *)c->ready, __ATOMIC_ACQUIRE);
}
static uint64_t wanted(const hep_proxy *p, const hep_proxy_chunk *c)
{
    return c->want ? c->want : p->epoch;
}

/* Ready, and its extent known: a descriptor is read once, after the acquire of ready. */
static int ready_at(hep_proxy *p, int i)
{
    hep_proxy_chunk *c = &p->chunks[i];
    if (p->resolved[i])
        return 1;
    hep_debug_jitter(); /* stress runs: the ready word read late */
    if (ready_value(c) < wanted(p, c))
        return 0;
    if (c->desc) {
        uint64_t first = __atomic_load_n((const uint64_t *)&c->desc[0], __ATOMIC_RELAXED);
        uint64_t count = __atomic_load_n((const uint64_t *)&c->desc[1], __ATOMIC_RELAXED);
        if (c->unit == 0 || first > c->len / c->unit || count > c->len / c->unit - first) {
            char m[512];
            snprintf(m, sizeof(m),
                     "proxy of rank %d: chunk %d of '%s' for rank %d: its producer published "
                     "units %llu + %llu of %zu bytes, beyond the %zu bytes it may cover",
                     p->net->rank, i, c->name ? c->name : "?", c->peer,
                     (unsigned long long)first, (unsigned long long)count, c->unit, c->len);
            batch_fail(p, HEP_ERR_INTERNAL, m);
            return 0;
        }
        c->laddr += first * c->unit;
        c->raddr += first * c->unit;
        c->len = count * c->unit;
    }
    p->resolved[i] = 1;
    p->seen_ms[i] = hep_now_ms();
    return 1;
}

/* Not posted, and its producer said the call does not need it. */
static int skippable(const hep_proxy *p, int i)
{
    const hep_proxy_chunk *c = &p->chunks[i];
    return !p->posted[i] && c->skip &&
           __atomic_load_n((const uint64_t *)c->skip, __ATOMIC_ACQUIRE) >= c->skip_want;
}

/* A fenced chunk waits for every earlier chunk to its peer: the peer's earliest unposted
 * chunk (advanced along the peer's own list, so the batch is walked once in all) is it. */
static int postable(hep_proxy *p, int i)
{
    const hep_proxy_chunk *c = &p->chunks[i];
    if (p->posted[i] || !ready_at(p, i))
        return 0;
    if (c->fence) {
        int *f = &p->first_unposted[c->peer];
        while (*f < p->n && p->posted[*f])
            *f = p->next_same[*f];
        return *f == i;
    }
    return 1;
}

/* Post chunk i, extended over the following ready, contiguous chunks of the same peer. */
static void post_run(hep_proxy *p, int i)
{
    hep_net *net = p->net;
    hep_proxy_chunk *c = &p->chunks[i];
    size_t len = c->len;
    int last = i, rc = HEP_OK;
    while (last + 1 < p->n && !p->posted[last + 1]) {
        hep_proxy_chunk *x = &p->chunks[last], *y = &p->chunks[last + 1];
        if (y->peer != c->peer || y->lkey != c->lkey || y->rkey != c->rkey || x->len == 0 ||
            y->fence || !ready_at(p, last + 1) || y->len == 0 ||
            x->laddr + x->len != y->laddr || x->raddr + x->len != y->raddr)
            break;
        len += y->len;
        last++;
    }
    if (len) {
        rc = net->v->write(net, c->peer, c->lkey, c->laddr, c->rkey, c->raddr, len,
                           (uint64_t)i);
        if (rc == HEP_OK) {
            p->stats[c->peer].bytes += len;
            p->stats[c->peer].data_wrs++;
            p->outstanding++;
        }
    }
    for (int k = i; rc == HEP_OK && k <= last; k++) { /* flags after the data, same QP */
        hep_proxy_chunk *f = &p->chunks[k];
        if (!f->flag)
            continue;
        rc = net->v->write(net, f->peer, f->flag_lkey, f->flag_laddr, f->flag_rkey,
                           f->flag_raddr, sizeof(uint64_t), FLAG_WR + (uint64_t)k);
        if (rc == HEP_OK) {
            p->stats[f->peer].flag_wrs++;
            p->outstanding++;
        }
    }
    if (rc != HEP_OK) {
        char m[1024];
        snprintf(m, sizeof(m), "proxy of rank %d: write of '%s' to rank %d (%s NIC) failed: %s",
                 net->rank, c->name ? c->name : "?", c->peer, net->v->name, hep_last_error());
        batch_fail(p, rc, m);
    }
    for (int k = i; k <= last; k++)
        p->posted[k] = 1;
    p->remaining_posts -= last - i + 1;
}

/* One pass over the batch; returns 1 if it did anything. */
static int step(hep_proxy *p)
{
    hep_net_completion done[32];
    int did = 0, n;
    while (p->lo < p->n && p->posted[p->lo])
        p->lo++;
    for (int i = p->lo; i < p->n && !p->rc; i++)
        if (skippable(p, i)) {
            p->posted[i] = 1;
            p->remaining_posts--;
            did = 1;
        } else if (postable(p, i)) {
            post_run(p, i);
            did = 1;
        }
    n = p->outstanding ? p->net->v->poll(p->net, done, 32) : 0;
    if (n < 0) {
        batch_fail(p, -n, hep_last_error());
        p->outstanding = 0;
    }
    for (int k = 0; k < n; k++) {
        uint64_t id = done[k].wr_id;
        p->outstanding--;
        if (id >= FLAG_WR && id - FLAG_WR < (uint64_t)p->n) { /* a flag write completed */
            const hep_proxy_chunk *c = &p->chunks[id - FLAG_WR];
            hep_proxy_peer_stats *s = &p->stats[c->peer];
            double ns = (hep_now_ms() - p->seen_ms[id - FLAG_WR]) * 1e6;
            const double half_ms = (double)hep_env_get()->timeout_ms / 2;
            s->flags_done++;
            s->ready_to_flag_ns += (uint64_t)ns;
            /* a flag that lands this late may find its receiver gone (it waits
             * HEP_TIMEOUT_MS): say so here, where the lateness is seen, so that a
             * receiver's timeout on a flag that "never came" can be told from a loss */
            if (ns / 1e6 > half_ms)
                hep_log(HEP_LOG_WARN,
                        "proxy of rank %d: the flag of '%s' to rank %d completed %.0f ms after "
                        "its chunk was ready (HEP_TIMEOUT_MS = %llu): the %s NIC was late",
                        p->net->rank, c->name ? c->name : "?", c->peer, ns / 1e6,
                        (unsigned long long)hep_env_get()->timeout_ms, p->net->v->name);
        }
        if (done[k].status) {
            char m[1024];
            uint64_t ci = id >= FLAG_WR ? id - FLAG_WR : id;
            const char *name = ci < (uint64_t)p->n && p->chunks[ci].name ? p->chunks[ci].name
                                                                          : "?";
            snprintf(m, sizeof(m), "proxy of rank %d: %s of '%s' to rank %d failed: %s",
                     p->net->rank, id >= FLAG_WR ? "the flag write" : "a write", name,
                     done[k].peer, hep_last_error());
            batch_fail(p, done[k].status, m);
        }
        did = 1;
    }
    if (did) /* a streaming batch is late only when nothing moved for HEP_TIMEOUT_MS */
        p->deadline_ms = hep_now_ms() + (double)hep_env_get()->timeout_ms;
    if (!p->rc && p->remaining_posts > 0 && hep_now_ms() > p->deadline_ms) {
        char m[1024];
        for (int i = 0; i < p->n; i++)
            if (!p->posted[i]) {
                snprintf(m, sizeof(m),
                         "proxy of rank %d: chunk %d of '%s' for rank %d was not ready within "
                         "%llu ms (HEP_TIMEOUT_MS): expected %llu, saw %llu; its producer did "
                         "not publish it",
                         p->net->rank, i, p->chunks[i].name ? p->chunks[i].name : "?",
                         p->chunks[i].peer, (unsigned long long)hep_env_get()->timeout_ms,
                         (unsigned long long)wanted(p, &p->chunks[i]),
                         (unsigned long long)ready_value(&p->chunks[i]));
                break;
            }
        batch_fail(p, HEP_ERR_TIMEOUT, m);
    }
    return did;
}

static void *proxy_main(void *arg)
{
    hep_proxy *p = arg;
    pthread_mutex_lock(&p->lock);
    while (!p->stop) {
        if (!p->busy) {
            pthread_cond_wait(&p->cond, &p->lock);
            continue;
        }
        if (!step(p) && p->remaining_posts > 0 && !p->rc) {
            pthread_mutex_unlock(&p->lock);
            sched_yield(); /* nothing ready yet */
            pthread_mutex_lock(&p->lock);
        }
        if ((p->remaining_posts == 0 && p->outstanding == 0) || (p->rc && p->outstanding == 0)) {
            p->busy = 0;
            pthread_cond_broadcast(&p->cond);
        }
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

int hep_proxy_create(hep_net *net, hep_proxy **out)
{
    hep_proxy *p = calloc(1, sizeof(*p));
    if (!p || !(p->stats = calloc((size_t)net->world, sizeof(*p->stats))) ||
        !(p->first_unposted = calloc((size_t)net->world, sizeof(int)))) {
        if (p)
            free(p->stats);
        free(p);
        return hep_fail(HEP_ERR_NOMEM, "proxy: out of memory");
    }
    p->net = net;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->cond, NULL);
    if (pthread_create(&p->thread, NULL, proxy_main, p) != 0) {
        free(p->stats);
        free(p->first_unposted);
        free(p);
        return hep_fail(HEP_ERR_INTERNAL, "proxy: cannot start its thread");
    }
    *out = p;
    return HEP_OK;
}

int hep_proxy_submit(hep_proxy *p, const hep_proxy_chunk *chunks, int n, uint64_t epoch)
{
    int rc = HEP_OK;
    if (!p || n < 0 || (n && !chunks))
        return hep_fail(HEP_ERR_INVALID, "proxy: invalid batch");
    pthread_mutex_lock(&p->lock);
    if (p->busy) {
        pthread_mutex_unlock(&p->lock);
        return hep_fail(HEP_ERR_INVALID, "proxy: a batch is already in flight");
    }
    for (int i = 0; i < n; i++)
        if (chunks[i].peer < 0 || chunks[i].peer >= p->net->world || !chunks[i].ready)
            rc = hep_fail(HEP_ERR_INVALID, "proxy: chunk %d has no ready counter or peer %d", i,
                          chunks[i].peer);
    free(p->chunks);
    free(p->posted);
    free(p->resolved);
    free(p->seen_ms);
    free(p->next_same);
    p->chunks = rc ? NULL : malloc(sizeof(*chunks) * (size_t)(n ? n : 1));
    p->posted = rc ? NULL : calloc((size_t)(n ? n : 1), 1);
    p->resolved = rc ? NULL : calloc((size_t)(n ? n : 1), 1);
    p->seen_ms = rc ? NULL : calloc((size_t)(n ? n : 1), sizeof(double));
    p->next_same = rc ? NULL : malloc(sizeof(int) * (size_t)(n ? n : 1));
    if (!rc && (!p->chunks || !p->posted || !p->resolved || !p->seen_ms || !p->next_same))
        rc = hep_fail(HEP_ERR_NOMEM, "proxy: out of memory");
    if (!rc) {
        memcpy(p->chunks, chunks, sizeof(*chunks) * (size_t)n);
        for (int r = 0; r < p->net->world; r++)
            p->first_unposted[r] = n;
        for (int i = n - 1; i >= 0; i--) { /* each peer's chunks as a list, in batch order */
            p->next_same[i] = p->first_unposted[chunks[i].peer];
            p->first_unposted[chunks[i].peer] = i;
        }
        p->lo = 0;
        p->n = p->remaining_posts = n;
        p->epoch = epoch;
        p->rc = 0;
        p->msg[0] = 0;
        p->deadline_ms = hep_now_ms() + (double)hep_env_get()->timeout_ms;
        p->busy = 1;
        pthread_cond_broadcast(&p->cond);
    }
    pthread_mutex_unlock(&p->lock);
    return rc;
}

int hep_proxy_wait(hep_proxy *p)
{
    int rc;
    pthread_mutex_lock(&p->lock);
    while (p->busy)
        pthread_cond_wait(&p->cond, &p->lock); /* the thread itself ends every batch in time */
    rc = p->rc;
    if (rc)
        hep_set_error_text(p->msg);
    pthread_mutex_unlock(&p->lock);
    return rc;
}

void hep_proxy_stats(hep_proxy *p, int peer, hep_proxy_peer_stats *out)
{
    pthread_mutex_lock(&p->lock);
    *out = p->stats[peer];
    pthread_mutex_unlock(&p->lock);
}

void hep_proxy_destroy(hep_proxy *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->lock);
    p->stop = 1;
    pthread_cond_broadcast(&p->cond);
    pthread_mutex_unlock(&p->lock);
    pthread_join(p->thread, NULL);
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->cond);
    free(p->chunks);
    free(p->posted);
    free(p->resolved);
    free(p->seen_ms);
    free(p->next_same);
    free(p->first_unposted);
    free(p->stats);
    free(p);
}

void hep_proxy_cancel(hep_proxy *p, int rc, const char *why)
{
    pthread_mutex_lock(&p->lock);
    if (p->busy) {
        batch_fail(p, rc, why);
        pthread_cond_broadcast(&p->cond);
    }
    pthread_mutex_unlock(&p->lock);
}

int hep_proxy_wait_flag(const volatile uint64_t *flag, uint64_t expect, int me, int peer,
                        const char *what)
{
    return hep_proxy_wait_flag_arrived(flag, expect, NULL, me, peer, what);
}

int hep_proxy_wait_flag_arrived(const volatile uint64_t *flag, uint64_t expect,
                                const volatile uint64_t *arrived, int me, int peer,
                                const char *what)
{
    double start = hep_now_ms(), limit = (double)hep_env_get()->timeout_ms;
    uint64_t seen, came;
    while ((seen = __atomic_load_n((const uint64_t *)flag, __ATOMIC_ACQUIRE)) < expect) {
        if (hep_now_ms() - start > limit) {
            came = arrived ? __atomic_load_n((const uint64_t *)arrived, __ATOMIC_ACQUIRE) : 0;
            if (came >= expect) /* its batch started: the flag, not the rank, is missing */
                return hep_fail(HEP_ERR_TIMEOUT,
                                "rank %d waited %.0f ms (HEP_TIMEOUT_MS) for %s from rank %d: "
                                "expected %llu, saw %llu: rank %d arrived at call %llu (its "
                                "arrival word came over the network) but this flag did not "
                                "arrive (rank %d may be waiting for a rank of its own node: "
                                "its own timeout names that one)",
                                me, hep_now_ms() - start, what, peer, (unsigned long long)expect,
                                (unsigned long long)seen, peer, (unsigned long long)came, peer);
            return hep_fail(HEP_ERR_TIMEOUT,
                            "rank %d waited %.0f ms (HEP_TIMEOUT_MS) for %s from rank %d: "
                            "expected %llu, saw %llu: rank %d did not arrive",
                            me, hep_now_ms() - start, what, peer, (unsigned long long)expect,
                            (unsigned long long)seen, peer);
        }
        sched_yield();
    }
    return HEP_OK;
}
