/* ref/host_backend.c: dispatch and combine on host memory, ranks as threads of one
 * process (or processes of one host, through group/shm.h): the reference semantics (the oracle of every GPU test) and the backend of
 * machines without a GPU. Unlike the GPU kernels (sources push rows), each rank pulls what
 * it needs from its node-mates: a second, independent algorithm for the same outputs. With
 * N > 1 it runs the hierarchical path through the RDMA coordinator's NIC (the loopback NIC
 * in one process) and the CPU proxy, which makes it the tested wire protocol of that path.
 *
 * Dispatch, on rank (n, l): for every other node m, the tokens that need m (one of their
 * experts is there), with their routing (top-k ids and weights) and FP8 scales, are packed
 * in source order into send slot j(m) of the registered dispatch.attn_input_* and go, one
 * write per buffer, into the peer (m, l)'s dispatch.rdma_inter_node_group_* slot for n,
 * followed by the count and then the flag (RC order). Every rank then pulls, in [source node][source local][token]
 * order, what its experts need: from a node-mate's inputs for its own node, from a
 * node-mate's slot for the other nodes (after that slot's flag).
 * Combine: the peer (m, l) sums, per token of its slot for n, the rows of its node-mates
 * that received it (f32, ascending local rank), rounds to BF16 into
 * combine.rdma_intra_node_red_token, and sends them (then count, flag) into (n, l)'s
 * combine.rdma_inter_node_group_token slot for m; (n, l) adds its own node's share and
 * then the partial sums in ascending node order. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "group/group.h"
#include "group/shm.h"
#include "kernels/ep_kernels.h"
#include "net/proxy.h"

#define DONE_DISPATCH HEP_FLAG_HOST_DONE
#define DONE_COMBINE (HEP_FLAG_HOST_DONE + 1)

typedef struct view { /* a run of tokens with their routing, where they are read from */
    const unsigned char *tokens;
    const float *scales;
    const int *ids;       /* [n][Kmax] (slots) ... */
    const float *w;       /* ... [n][Kmax] */
    const void *idx;      /* ... or the caller's [t][K] (own node) */
    const float *weights;
    int t, K, index64, kmax, slot;
} view;

static uint64_t *flags_of(hep_group *g, int l)
{
    return (uint64_t *)hep_peer_buf(g, l, HEP_BUF_FLAGS);
}
static uint64_t *mailbox_of(hep_group *g, int l)
{
    return (uint64_t *)hep_peer_buf(g, l, HEP_BUF_MAILBOX);
}
/* Buffer `id` of node-mate l's local arena (one address space, or mapped: group/shm.h). */
static char *mate_local(hep_group *g, int l, int id)
{
    char *base = g->shm ? hep_shm_mate_local(g, l)
                        : (char *)(uintptr_t)mailbox_of(g, l)[HEP_MB_LOCAL];
    return base + g->plan.buf[id].offset;
}

static long long id_at(const view *v, int i, int k)
{
    if (v->slot)
        return k < v->kmax ? v->ids[(size_t)i * (size_t)v->kmax + (size_t)k] : -1;
    size_t o = (size_t)i * (size_t)v->K + (size_t)k;
    return v->index64 ? ((const long long *)v->idx)[o] : ((const int *)v->idx)[o];
}
static float w_at(const view *v, int i, int k)
{
    return v->slot ? v->w[(size_t)i * (size_t)v->kmax + (size_t)k]
                   : v->weights[(size_t)i * (size_t)v->K + (size_t)k];
}
static int kslots(const view *v)
{
    return v->slot ? v->kmax : v->K;
}
/* Does token i need global rank r (any expert on it)? / node m? */
static int needs_rank(const hep_group *g, const view *v, int i, int r)
{
    for (int k = 0; k < kslots(v); k++) {
        long long x = id_at(v, i, k);
        if (x >= 0 && x < (long long)g->cfg.experts_per_rank * g->world &&
            x / g->cfg.experts_per_rank == r)
            return 1;
    }
    return 0;
}
static int needs_node(const hep_group *g, const view *v, int i, int m)
{
    for (int l = 0; l < g->R; l++)
        if (needs_rank(g, v, i, m * g->R + l))
            return 1;
    return 0;
}

/* `arrived` (or NULL): the sender's arrival word, sent ahead of the flag (a timeout then
 * says whether the sender came and its flag was lost, or it never came). */
static int wait_ge(hep_group *g, volatile uint64_t *f, uint64_t e, int peer, const char *what,
                   const volatile uint64_t *arrived)
{
    int rc = hep_proxy_wait_flag_arrived(f, e, arrived, g->rank, peer, what);
    if (rc) {
        snprintf(g->broken_msg, sizeof(g->broken_msg), "%s", hep_last_error());
        g->broken = 1;
    }
    return rc;
}

static int wait_mates(hep_group *g, int word, uint64_t e, const char *what)
{
    for (int l = 0; l < g->R; l++) {
        int rc = wait_ge(g, flags_of(g, l) + word, e, g->node * g->R + l, what, NULL);
        if (rc)
            return rc;
    }
    return HEP_OK;
}

static int first_invalid(const hep_group *g, const view *v, int *tok, int *slot, long long *val)
{
    long long E = (long long)g->cfg.experts_per_rank * g->world;
    for (int i = 0; i < v->t; i++)
        for (int k = 0; k < kslots(v); k++) {
            long long x = id_at(v, i, k);
            if (x < -1 || x >= E) {
                *tok = i, *slot = k, *val = x;
                return 1;
            }
        }
    return 0;
}

static void receive(hep_group *g, const view *v, int i, int row, int *tpe)
{
    const int El = g->cfg.experts_per_rank, H = g->cfg.hidden;
    const size_t rb = (size_t)H * (g->cfg.dtype == HEP_DTYPE_FP8_E4M3 ? 1 : 2);
    float *prob = (float *)hep_my_buf(g, HEP_BUF_RECV_PROB) + (size_t)row * (size_t)El;
    long long first = (long long)g->rank * El;
    memcpy(hep_my_buf(g, HEP_BUF_TOKEN_X) + (size_t)row * rb, v->tokens + (size_t)i * rb, rb);
    if (g->cfg.dtype == HEP_DTYPE_FP8_E4M3) {
        size_t ns = (size_t)H / HEP_FP8_BLOCK;
        memcpy((float *)hep_my_buf(g, HEP_BUF_RECV_SCALE) + (size_t)row * ns,
               v->scales + (size_t)i * ns, ns * sizeof(float));
    }
    memset(prob, 0, (size_t)El * sizeof(float));
    for (int k = 0; k < kslots(v); k++) {
        long long x = id_at(v, i, k);
        int dup = 0;
        if (x < first || x >= first + El)
            continue;
        prob[x - first] += w_at(v, i, k);
        for (int q = 0; q < k; q++)
            dup |= id_at(v, i, q) == x;
        if (!dup)
            tpe[x - first]++;
    }
}

static void own_view(hep_group *g, int l, view *v)
{
    const volatile uint64_t *m = mailbox_of(g, l);
    memset(v, 0, sizeof(*v));
    v->tokens = (const unsigned char *)(uintptr_t)m[HEP_MB_TOKENS];
    v->scales = (const float *)(uintptr_t)m[HEP_MB_SCALES];
    v->idx = (const void *)(uintptr_t)m[HEP_MB_IDX];
    v->weights = (const float *)(uintptr_t)m[HEP_MB_WEIGHTS];
    v->t = (int)m[HEP_MB_T];
    v->K = (int)m[HEP_MB_K];
    v->index64 = (int)m[HEP_MB_INDEX64];
    if (g->shm) { /* across processes: the copy in l's staging area, mapped here */
        hep_shm_inputs in;
        hep_shm_mate_inputs(g, l, &in);
        v->tokens = in.tokens;
        v->scales = in.scales;
        v->idx = in.idx;
        v->weights = in.weights;
    }
}

/* This rank's routing as its last dispatch saw it, from the group's copy: combine must
 * not read the caller's topk_idx again (it may be freed or reused by then). */
static void recorded_view(hep_group *g, view *v)
{
    memset(v, 0, sizeof(*v));
    v->slot = 1;
    v->kmax = g->cfg.max_topk;
    v->t = g->last_t;
    v->ids = (const int *)hep_my_buf(g, HEP_BUF_HANDLE_IDS);
}

/* Copy the caller's ids as slots of kmax (an invalid id, or a slot past topk, as -1). */
static void record_ids(hep_group *g, const view *mine)
{
    const int kmax = g->cfg.max_topk;
    const long long E = (long long)g->cfg.experts_per_rank * g->world;
    int *ids = (int *)hep_my_buf(g, HEP_BUF_HANDLE_IDS);
    for (int i = 0; i < mine->t; i++)
        for (int k = 0; k < kmax; k++) {
            long long x = k < mine->K ? id_at(mine, i, k) : -1;
            ids[(size_t)i * (size_t)kmax + (size_t)k] = x >= 0 && x < E ? (int)x : -1;
        }
}

/* Node-mate l's receive slot for source node ns (count from its flag words). */
static void slot_view(hep_group *g, int l, int ns, view *v)
{
    const size_t T = (size_t)g->cfg.max_tokens, H = (size_t)g->cfg.hidden;
    const size_t rb = H * (g->cfg.dtype == HEP_DTYPE_FP8_E4M3 ? 1 : 2);
    const int kmax = g->cfg.max_topk, s = hep_slot_of(ns, g->node);
    const uint64_t *fl = (const uint64_t *)mate_local(g, l, HEP_BUF_D_GROUP_FLAGS);
    const char *route = mate_local(g, l, HEP_BUF_D_GROUP_PROB) + (size_t)s * T * 2 * (size_t)kmax * 4;
    memset(v, 0, sizeof(*v));
    v->slot = 1;
    v->kmax = kmax;
    v->t = (int)fl[s];
    v->tokens = (const unsigned char *)mate_local(g, l, HEP_BUF_D_GROUP_TOKEN) + (size_t)s * T * rb;
    v->ids = (const int *)route;
    v->w = (const float *)(route + T * (size_t)kmax * 4);
    if (g->cfg.dtype == HEP_DTYPE_FP8_E4M3)
        v->scales = (const float *)mate_local(g, l, HEP_BUF_D_GROUP_SCALE) +
                    (size_t)s * T * (H / HEP_FP8_BLOCK);
}

/* Pack, for every other node, the tokens it needs (with their routing and scales) into
 * that node's send slot, in source order: the receiver's slot layout, so each buffer goes
 * out in one write per node; then the slot's count and flag. */
static int send_dispatch(hep_group *g, const hep_dispatch_args *a, uint64_t e)
{
    const size_t T = (size_t)g->cfg.max_tokens, H = (size_t)g->cfg.hidden;
    const int fp8 = g->cfg.dtype == HEP_DTYPE_FP8_E4M3, kmax = g->cfg.max_topk;
    const size_t rb = H * (fp8 ? 1 : 2), ns = H / HEP_FP8_BLOCK, rw = (size_t)kmax * 4;
    char *tok = hep_my_buf(g, HEP_BUF_D_ATTN_TOKEN);
    char *route = hep_my_buf(g, HEP_BUF_D_ATTN_PROB);
    char *scale = fp8 ? hep_my_buf(g, HEP_BUF_D_ATTN_SCALE) : NULL;
    uint64_t *words = (uint64_t *)hep_my_buf(g, HEP_BUF_D_ATTN_FLAGS);
    hep_proxy_chunk *ch;
    view mine;
    int n = 0, rc;
    if (g->N == 1)
        return HEP_OK; /* one node: nothing crosses a network */
    ch = malloc(sizeof(*ch) * 6 * (size_t)g->N);
    if (!ch)
        return hep_fail(HEP_ERR_NOMEM, "dispatch: out of memory");
    own_view(g, g->local, &mine);
    for (int m = 0; m < g->N; m++) {
        const int peer = m * g->R + g->local, j = hep_slot_of(m, g->node), s = hep_slot_of(g->node, m);
        const volatile uint64_t *ready = words + g->N + m;
        size_t k = 0;
        if (m == g->node)
            continue;
        /* the arrival word (words [2N, 3N)) goes first, ahead of the slot and its flag */
        __atomic_store_n(&words[2 * g->N + m], e, __ATOMIC_RELEASE);
        ch[n++] = hep_wire_chunk(g, peer, HEP_BUF_D_ATTN_FLAGS, (size_t)(2 * g->N + m) * 8,
                                 HEP_BUF_D_GROUP_FLAGS, (size_t)(2 * g->N + s) * 8, 8,
                                 words + 2 * g->N + m);
        for (int i = 0; i < a->num_tokens; i++) {
            int *ids;
            float *w;
            if (!needs_node(g, &mine, i, m))
                continue;
            memcpy(tok + ((size_t)j * T + k) * rb, (const char *)a->tokens + (size_t)i * rb, rb);
            if (fp8)
                memcpy(scale + ((size_t)j * T + k) * ns * 4, a->scales + (size_t)i * ns, ns * 4);
            ids = (int *)(route + ((size_t)j * 2 * T + k) * rw);
            w = (float *)(route + ((size_t)j * 2 * T + T + k) * rw);
            for (int q = 0; q < kmax; q++) {
                long long x = q < a->topk ? id_at(&mine, i, q) : -1;
                /* an invalid id (reported by this rank) travels as an unused slot */
                ids[q] = x >= 0 && x < (long long)g->cfg.experts_per_rank * g->world ? (int)x : -1;
                w[q] = q < a->topk ? w_at(&mine, i, q) : 0.f;
            }
            k++;
        }
        if (k) {
            ch[n++] = hep_wire_chunk(g, peer, HEP_BUF_D_ATTN_TOKEN, (size_t)j * T * rb,
                            HEP_BUF_D_GROUP_TOKEN, (size_t)s * T * rb, k * rb, ready);
            ch[n++] = hep_wire_chunk(g, peer, HEP_BUF_D_ATTN_PROB, (size_t)j * 2 * T * rw,
                            HEP_BUF_D_GROUP_PROB, (size_t)s * 2 * T * rw, k * rw, ready);
            ch[n++] = hep_wire_chunk(g, peer, HEP_BUF_D_ATTN_PROB, ((size_t)j * 2 * T + T) * rw,
                            HEP_BUF_D_GROUP_PROB, ((size_t)s * 2 * T + T) * rw, k * rw, ready);
            if (fp8)
                ch[n++] = hep_wire_chunk(g, peer, HEP_BUF_D_ATTN_SCALE, (size_t)j * T * ns * 4,
                                HEP_BUF_D_GROUP_SCALE, (size_t)s * T * ns * 4, k * ns * 4, ready);
        }
        words[m] = (uint64_t)k;
        __atomic_store_n(&words[g->N + m], e, __ATOMIC_RELEASE); /* ready = the flag value */
        ch[n++] = hep_wire_count_then_flag(g, peer, HEP_BUF_D_ATTN_FLAGS, HEP_BUF_D_GROUP_FLAGS, m, s,
                                  ready);
    }
    rc = hep_proxy_submit(g->proxy, ch, n, e);
    free(ch);
    return rc ? rc : hep_proxy_wait(g->proxy);
}

/* Expert e's positions of its local experts that token i of v chose, ascending, distinct
 * (at most 32). */
static int local_experts(const hep_group *g, const view *v, int i, int r, int *es)
{
    const int El = g->cfg.experts_per_rank;
    const long long first = (long long)r * El;
    int n = 0;
    for (int k = 0; k < kslots(v); k++) {
        long long x = id_at(v, i, k);
        int e, q;
        if (x < first || x >= first + El)
            continue;
        e = (int)(x - first);
        for (q = 0; q < n && es[q] < e; q++)
            ;
        if (q < n && es[q] == e)
            continue;
        memmove(es + q + 1, es + q, (size_t)(n - q) * sizeof(int));
        es[q] = e;
        n++;
    }
    return n;
}

static float weight_on(const hep_group *g, const view *v, int i, long long x)
{
    float p = 0;
    (void)g;
    for (int k = 0; k < kslots(v); k++)
        if (id_at(v, i, k) == x)
            p += w_at(v, i, k);
    return p;
}

/* Source s of this rank's receive order, as dispatch reads it (the slots are complete). */
static void source_view(hep_group *g, int ns, int l, view *v)
{
    if (ns == g->node)
        own_view(g, l, v);
    else
        slot_view(g, l, ns, v);
}

/* Expert-major outputs (hybridep.h, "Layouts"): every (token, local expert) row written at
 * its position in caller memory, padding zeroed, rows at or past the budget dropped.
 * cnt[e]: received tokens with a slot on e. Fills h's ebase / tpe / counts. */
static size_t permute(hep_group *g, hep_handle *h, const int *cnt, const hep_dispatch_opts *x)
{
    const int El = g->cfg.experts_per_rank, H = g->cfg.hidden;
    const int fp8 = g->cfg.dtype == HEP_DTYPE_FP8_E4M3, pad = h->pad, budget = h->budget;
    const size_t rb = (size_t)H * (fp8 ? 1 : 2), ns = (size_t)H / HEP_FP8_BLOCK;
    const size_t row_bytes = rb + sizeof(float) + (fp8 ? ns * sizeof(float) : 0);
    unsigned char *tok = x->recv_tokens;
    long long *run = malloc(sizeof(long long) * (size_t)El), pos = 0;
    size_t written = 0;
    int dropped = 0, es[32];
    if (!run)
        return (size_t)-1;
    for (int e = 0; e < El; e++) {
        run[e] = pos;
        pos += (cnt[e] + pad - 1) / pad * (long long)pad;
    }
    for (int e = 0; e < El; e++) { /* padding rows and the clipped block sizes */
        long long start = run[e], end = start + (cnt[e] + pad - 1) / pad * (long long)pad;
        for (long long p = start + cnt[e]; p < end && p < budget; p++) {
            memset(tok + (size_t)p * rb, 0, rb);
            x->recv_probs[p] = 0;
            if (fp8)
                memset(x->recv_scales + (size_t)p * ns, 0, ns * sizeof(float));
            written += row_bytes;
        }
        h->tpe[e] = end <= budget ? end - start : start < budget ? budget - start : 0;
    }
    h->num_permuted = (int)(pos < budget ? pos : budget);
    h->overflow = pos > budget;
    for (int sn = 0; sn < g->N; sn++)
        for (int l = 0; l < g->R; l++) {
            const int src = sn * g->R + l;
            view v;
            source_view(g, sn, l, &v);
            for (int e = 0; e < El; e++)
                h->ebase[(size_t)src * (size_t)El + (size_t)e] = (int)run[e];
            for (int i = 0; i < v.t; i++) {
                int n = local_experts(g, &v, i, g->rank, es);
                for (int q = 0; q < n; q++) {
                    long long p = run[es[q]]++;
                    if (p >= budget) {
                        dropped++;
                        continue;
                    }
                    memcpy(tok + (size_t)p * rb, v.tokens + (size_t)i * rb, rb);
                    x->recv_probs[p] =
                        weight_on(g, &v, i, (long long)g->rank * El + es[q]);
                    if (fp8)
                        memcpy(x->recv_scales + (size_t)p * ns, v.scales + (size_t)i * ns,
                               ns * sizeof(float));
                    written += row_bytes;
                }
            }
        }
    h->overflow_rows = dropped;
    free(run);
    return written;
}

/* The layout a later combine needs, from the group's buffers of this dispatch. */
static void record(hep_group *g, hep_handle *h, const hep_dispatch_args *a, uint64_t e, int rows)
{
    const size_t kmax = (size_t)g->cfg.max_topk, T = (size_t)g->cfg.max_tokens;
    view mine;
    own_view(g, g->local, &mine);
    h->epoch = e;
    h->t = a->num_tokens;
    h->topk = a->topk;
    h->recv = rows;
    memcpy(h->ids, hep_my_buf(g, HEP_BUF_HANDLE_IDS), sizeof(int) * (size_t)h->t * kmax);
    for (int i = 0; i < h->t; i++)
        for (size_t k = 0; k < kmax; k++)
            h->w[(size_t)i * kmax + k] = (int)k < a->topk ? w_at(&mine, i, (int)k) : 0.f;
    memcpy(h->base, hep_my_buf(g, HEP_BUF_HANDLE_META), sizeof(int) * (size_t)(g->world + 1));
    for (int m = 0; m < g->N; m++) {
        view v;
        if (m == g->node)
            continue;
        slot_view(g, g->local, m, &v);
        h->slot_t[m] = v.t;
        memcpy(h->slot_ids + (size_t)m * T * kmax, v.ids, sizeof(int) * (size_t)v.t * kmax);
    }
}

/* HEP_REUSE_LAYOUT: the recorded routing as the arguments of a dispatch (kmax slots of
 * int32, invalid ids already -1), with the caller's weights widened if it gave some. */
static void reuse_args(hep_handle *h, const hep_dispatch_args *a, hep_dispatch_args *b)
{
    const size_t kmax = (size_t)h->kmax;
    *b = *a;
    b->num_tokens = h->t;
    b->topk_idx = h->ids;
    b->index_type = HEP_INDEX_INT32;
    b->topk = h->kmax;
    b->topk_weights = h->w;
    if (a->topk_weights) {
        for (int i = 0; i < h->t; i++)
            for (size_t k = 0; k < kmax; k++)
                h->w_scratch[(size_t)i * kmax + k] =
                    (int)k < h->topk ? a->topk_weights[(size_t)i * (size_t)h->topk + k] : 0.f;
        b->topk_weights = h->w_scratch;
    }
}

/* Rank-major outputs into caller memory, where the caller gave some. */
static size_t copy_out(hep_group *g, int rows, hep_dispatch_opts *x)
{
    const int El = g->cfg.experts_per_rank, H = g->cfg.hidden;
    const int fp8 = g->cfg.dtype == HEP_DTYPE_FP8_E4M3;
    const size_t rb = (size_t)H * (fp8 ? 1 : 2), n = (size_t)rows;
    const size_t sb = n * (size_t)(H / HEP_FP8_BLOCK) * sizeof(float);
    size_t bytes = 0;
    if (x->recv_tokens) {
        memcpy(x->recv_tokens, hep_my_buf(g, HEP_BUF_TOKEN_X), n * rb);
        bytes += n * rb;
    }
    if (x->recv_probs) {
        memcpy(x->recv_probs, hep_my_buf(g, HEP_BUF_RECV_PROB), n * (size_t)El * sizeof(float));
        bytes += n * (size_t)El * sizeof(float);
    }
    if (fp8 && x->recv_scales) {
        memcpy(x->recv_scales, hep_my_buf(g, HEP_BUF_RECV_SCALE), sb);
        bytes += sb;
    }
    return bytes;
}

/* source_view, once another node's slot of call e arrived (its flag came). */
static int arrived_source_view(hep_group *g, int ns, int l, uint64_t e, view *v)
{
    if (ns != g->node) {
        const uint64_t *fl = (const uint64_t *)mate_local(g, l, HEP_BUF_D_GROUP_FLAGS);
        const int s = hep_slot_of(ns, g->node);
        int rc = wait_ge(g, (volatile uint64_t *)&fl[g->N + s], e, ns * g->R + l,
                         "its dispatch rows", &fl[2 * g->N + s]);
        if (rc)
            return rc;
    }
    source_view(g, ns, l, v);
    return HEP_OK;
}

/* The receive capacity (config.max_recv_rows), agreed before any rank writes a row: each
 * rank counts the rows it needs from the same sources the pull below reads (its node-mates'
 * inputs and, once their flags are in, their slots of the other nodes), then every rank's
 * count goes to every rank through the bootstrap's allgather. Nobody writes a receive
 * buffer before the allgather, and nobody reads a source after it unless every count fits,
 * so on an overflow every rank returns HEP_ERR_OVERFLOW with the same message and nothing
 * written; the allgather also stands for the end-of-reading handshake of that case. */
static int agree_capacity(hep_group *g, uint64_t e)
{
    const long long cap = g->cfg.max_recv_rows;
    long long need = 0, *all;
    int rc = HEP_OK, over = -1, n_over = 0;
    for (int ns = 0; ns < g->N && rc == HEP_OK; ns++)
        for (int l = 0; l < g->R && rc == HEP_OK; l++) {
            view v;
            rc = arrived_source_view(g, ns, l, e, &v);
            for (int i = 0; rc == HEP_OK && i < v.t; i++)
                need += needs_rank(g, &v, i, g->rank);
        }
    if (rc)
        return rc;
    all = malloc(sizeof(long long) * (size_t)g->world);
    if (!all) { /* the others wait in the allgather: this rank cannot go on either */
        snprintf(g->broken_msg, sizeof(g->broken_msg),
                 "dispatch on rank %d: out of memory for the receive-capacity agreement", g->rank);
        g->broken = 1;
        return hep_fail(HEP_ERR_NOMEM, "%s", g->broken_msg);
    }
    rc = g->bs.allgather(g->bs.ctx, &need, all, sizeof(need));
    if (rc) {
        snprintf(g->broken_msg, sizeof(g->broken_msg), "%s", hep_last_error());
        g->broken = 1;
        free(all);
        return rc;
    }
    for (int r = 0; r < g->world; r++)
        if (all[r] > cap) {
            if (over < 0)
                over = r;
            n_over++;
        }
    if (over >= 0) {
        long long worst = all[over];
        free(all);
        g->epoch = e; /* this call's slots and flags are spent: the next call is e + 1 */
        return hep_fail(HEP_ERR_OVERFLOW,
                        "dispatch: rank %d needs %lld receive rows, more than "
                        "config.max_recv_rows = %lld (%d rank(s) over); nothing was received on "
                        "any rank and the group stays usable",
                        over, worst, cap, n_over);
    }
    free(all);
    return HEP_OK;
}

int hep_host_dispatch(hep_group *g, const hep_dispatch_args *a, hep_dispatch_result *o)
{
    hep_dispatch_opts x;
    int rc;
    memset(&x, 0, sizeof(x));
    rc = hep_host_dispatch_ex(g, a, &x, g->own_handle, o);
    if (rc == HEP_OK || rc == HEP_WARN_IGNORED)
        o->handle = g->last_handle = hep_handle_of(g, g->epoch);
    return rc;
}

/* Across nodes the receive slots of a call are written by the peers of the other nodes,
 * with nothing that waits for this rank to have read the previous call's: between a
 * dispatch and a combine the other call's data dependency orders them (a peer cannot finish
 * the combine before this rank's partial sums, sent after its dispatch), but two calls of
 * one kind in a row (possible with handles) need that order made: a barrier. */
static int order_same_kind(hep_group *g, int kind)
{
    int rc = HEP_OK, prev = g->last_call;
    g->last_call = kind;
    if (g->N > 1 && prev == kind) {
        rc = g->bs.barrier(g->bs.ctx);
        if (rc) {
            snprintf(g->broken_msg, sizeof(g->broken_msg), "%s", hep_last_error());
            g->broken = 1;
        }
    }
    return rc;
}

int hep_host_dispatch_ex(hep_group *g, const hep_dispatch_args *a0, hep_dispatch_opts *x,
                         hep_handle *h, hep_dispatch_result *o)
{
    const int El = g->cfg.experts_per_rank, W = g->world;
    const int reuse = (a0->flags & HEP_REUSE_LAYOUT) != 0;
    uint64_t *mb = mailbox_of(g, g->local), e = g->epoch + 1;
    int *host_counts = (int *)hep_my_buf(g, HEP_BUF_HOST_COUNTS);
    int *base = (int *)hep_my_buf(g, HEP_BUF_HANDLE_META); /* my row base per source rank */
    int row = 0, rc, tok = 0, slot = 0, bad;
    long long val = 0;
    size_t copied = 0;
    hep_dispatch_args b;
    const hep_dispatch_args *a = a0;
    view mine;

    if ((rc = order_same_kind(g, 1)))
        return rc;
    if (reuse) {
        reuse_args(h, a0, &b);
        a = &b;
    } else {
        h->epoch = 0; /* holds no layout until this dispatch has recorded it */
        h->layout = x->layout;
        h->pad = x->pad_multiple > 0 ? x->pad_multiple : 1;
        h->budget = x->num_permuted_tokens;
    }
    if (g->shm)
        hep_shm_stage_inputs(g, a); /* node-mates in other processes read the copy */
    mb[HEP_MB_TOKENS] = (uint64_t)(uintptr_t)a->tokens;
    mb[HEP_MB_SCALES] = (uint64_t)(uintptr_t)a->scales;
    mb[HEP_MB_IDX] = (uint64_t)(uintptr_t)a->topk_idx;
    mb[HEP_MB_WEIGHTS] = (uint64_t)(uintptr_t)a->topk_weights;
    mb[HEP_MB_T] = (uint64_t)a->num_tokens;
    mb[HEP_MB_K] = (uint64_t)a->topk;
    mb[HEP_MB_INDEX64] = a->index_type == HEP_INDEX_INT64;
    __atomic_store_n(flags_of(g, g->local) + HEP_FLAG_COUNTS_READY, e, __ATOMIC_RELEASE);
    rc = send_dispatch(g, a, e);
    if (rc == HEP_OK)
        rc = wait_mates(g, HEP_FLAG_COUNTS_READY, e, "its routing to be published");
    if (rc == HEP_OK && g->cfg.max_recv_rows)
        rc = agree_capacity(g, e);
    if (rc)
        return rc;
    memset(host_counts, 0, (size_t)(El + 1) * sizeof(int));
    for (int ns = 0; ns < g->N && rc == HEP_OK; ns++)
        for (int l = 0; l < g->R && rc == HEP_OK; l++) {
            view v;
            base[ns * g->R + l] = row;
            rc = arrived_source_view(g, ns, l, e, &v);
            for (int i = 0; rc == HEP_OK && i < v.t; i++)
                if (needs_rank(g, &v, i, g->rank))
                    receive(g, &v, i, row++, host_counts + 1);
        }
    if (rc)
        return rc;
    host_counts[0] = row;
    base[W] = row;
    own_view(g, g->local, &mine);
    bad = first_invalid(g, &mine, &tok, &slot, &val);
    record_ids(g, &mine);
    if (h->layout == HEP_LAYOUT_EXPERT_MAJOR) { /* the sources are still readable here */
        copied = permute(g, h, host_counts + 1, x);
        if (copied == (size_t)-1)
            rc = hep_fail(HEP_ERR_NOMEM, "dispatch: out of memory");
    } else {
        copied = copy_out(g, row, x);
    }
    if (!reuse) {
        h->epoch = 0; /* until recorded below */
        record(g, h, a, e, row);
    }
    /* nobody may return (and free its inputs) while another still reads them; a rank that
     * failed above (out of memory) still arrives, so that its node-mates finish */
    {
        int drc = HEP_OK;
        __atomic_store_n(flags_of(g, g->local) + DONE_DISPATCH, e, __ATOMIC_RELEASE);
        drc = wait_mates(g, DONE_DISPATCH, e, "the node-mates to finish reading");
        if (rc == HEP_OK)
            rc = drc;
    }
    if (rc)
        return rc;
    g->epoch = e;
    g->last_t = a->num_tokens;
    g->last_recv = row;
    g->last_handle = 0; /* the one-shot value: set by hep_host_dispatch */
    g->copy_bytes += copied;
    hep_fill_dispatch_result(g, o);
    o->num_recv_device = host_counts;
    o->tokens_per_expert_device = host_counts + 1;
    /* as documented for HEP_ASYNC (and as the GPU path does): counts only in the buffers */
    o->num_recv = a->flags & HEP_ASYNC ? -1 : row;
    x->copy_bytes = copied;
    x->num_permuted = h->layout == HEP_LAYOUT_EXPERT_MAJOR ? h->num_permuted : row;
    x->overflow = h->layout == HEP_LAYOUT_EXPERT_MAJOR ? h->overflow : 0;
    x->overflow_rows = h->layout == HEP_LAYOUT_EXPERT_MAJOR ? h->overflow_rows : 0;
    x->tokens_per_expert = h->layout == HEP_LAYOUT_EXPERT_MAJOR ? h->tpe : NULL;
    h->em_words[0] = h->num_permuted, h->em_words[1] = h->overflow;
    h->em_words[2] = h->overflow_rows;
    x->permuted_device = h->layout == HEP_LAYOUT_EXPERT_MAJOR ? h->em_words : NULL;
    x->tokens_per_expert_device = x->tokens_per_expert;
    if (x->recv_tokens)
        o->tokens = x->recv_tokens;
    if (x->recv_probs)
        o->probs = x->recv_probs;
    if (x->recv_scales && o->scales)
        o->scales = x->recv_scales;
    if (bad && !reuse) /* the dispatch happened: the caller must go on to combine */
        return hep_fail(HEP_WARN_IGNORED,
                        "dispatch on rank %d: topk_idx[%d][%d] = %lld is not -1 or an expert id "
                        "in 0..%d (that slot was ignored)",
                        g->rank, tok, slot, val, El * g->world - 1);
    return HEP_OK;
}

static float bf16_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}
static uint16_t f32_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fff;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* -0.0 is the identity of IEEE addition (+0.0 is not: +0 + -0 = +0), so a token with a
 * single row comes back bit for bit; the GPU kernels start from it too (and copy such a
 * row). */
static void acc_clear(float *acc, size_t H)
{
    for (size_t c = 0; c < H; c++)
        acc[c] = -0.0f;
}

/* What one combine reads: the running positions per node-mate (rank-major: next[l] tokens
 * of the current source so far; expert-major: enext[l][e] per local expert) and where the
 * probabilities go. */
typedef struct combine_ctx {
    int next[HEP_MAX_LOCAL];
    int *enext;       /* [R][El] */
    float *pout;      /* [E] the current token's probs_out row, or NULL */
} combine_ctx;

static void ctx_reset(hep_group *g, combine_ctx *c)
{
    memset(c->next, 0, sizeof(c->next));
    memset(c->enext, 0, sizeof(int) * (size_t)g->R * (size_t)g->cfg.experts_per_rank);
}

/* acc[0..H) += the rows of token i of v (from source rank src) at the node-mates that
 * received it, ascending local rank, and within an expert-major node-mate ascending local
 * expert; the probabilities of those rows into c->pout. */
static void add_node_share(hep_group *g, const view *v, int i, int src, combine_ctx *c,
                           float *acc)
{
    const int H = g->cfg.hidden, El = g->cfg.experts_per_rank;
    for (int l = 0; l < g->R; l++) {
        int d = g->node * g->R + l, es[32], n;
        const int *mbase = (const int *)mate_local(g, l, HEP_BUF_HANDLE_META);
        const hep_handle *mh =
            g->shm ? NULL : (const hep_handle *)(uintptr_t)mailbox_of(g, l)[HEP_MB_HANDLE];
        const float *pin =
            g->shm ? NULL : (const float *)(uintptr_t)mailbox_of(g, l)[HEP_MB_PROBS_IN];
        const uint16_t *rows, *x;
        if (!needs_rank(g, v, i, d))
            continue;
        rows = (const uint16_t *)(g->shm ? hep_peer_buf(g, l, HEP_BUF_TOKEN_X)
                                         : (char *)(uintptr_t)mailbox_of(g, l)[HEP_MB_COMBINE_IN]);
        n = local_experts(g, v, i, d, es);
        if (!mh || mh->layout != HEP_LAYOUT_EXPERT_MAJOR) {
            size_t j = (size_t)(mbase[src] + c->next[l]++);
            x = rows + j * (size_t)H;
            for (int ch = 0; ch < H; ch++)
                acc[ch] += bf16_f32(x[ch]);
            for (int q = 0; c->pout && pin && q < n; q++)
                c->pout[(size_t)d * (size_t)El + (size_t)es[q]] = pin[j * (size_t)El + (size_t)es[q]];
            continue;
        }
        for (int q = 0; q < n; q++) {
            int *en = &c->enext[(size_t)l * (size_t)El + (size_t)es[q]];
            long long p = (long long)mh->ebase[(size_t)src * (size_t)El + (size_t)es[q]] + (*en)++;
            if (p >= mh->budget)
                continue; /* dropped at dispatch: contributes nothing */
            x = rows + (size_t)p * (size_t)H;
            for (int ch = 0; ch < H; ch++)
                acc[ch] += bf16_f32(x[ch]);
            if (c->pout && pin)
                c->pout[(size_t)d * (size_t)El + (size_t)es[q]] = pin[p];
        }
    }
}

int hep_host_combine(hep_group *g, const hep_combine_args *a)
{
    hep_combine_opts c;
    memset(&c, 0, sizeof(c));
    c.handle = g->own_handle;
    return hep_host_combine_ex(g, a, &c);
}

int hep_host_combine_ex(hep_group *g, const hep_combine_args *a, const hep_combine_opts *co)
{
    const size_t T = (size_t)g->cfg.max_tokens, H = (size_t)g->cfg.hidden, rb2 = H * 2;
    const size_t E = (size_t)g->cfg.experts_per_rank * (size_t)g->world;
    const size_t kmax = (size_t)g->cfg.max_topk;
    const hep_handle *h = co->handle;
    const uint64_t e = ++g->combine_epoch; /* combines repeat a dispatch: their own count */
    uint64_t *words = (uint64_t *)hep_my_buf(g, HEP_BUF_C_OUT_FLAGS);
    const uint64_t *in = (const uint64_t *)hep_my_buf(g, HEP_BUF_C_GROUP_FLAGS);
    uint16_t *red = (uint16_t *)hep_my_buf(g, HEP_BUF_C_RED_TOKEN);
    const uint16_t *parts = (const uint16_t *)hep_my_buf(g, HEP_BUF_C_GROUP_TOKEN);
    float *acc = malloc(sizeof(float) * H);
    hep_proxy_chunk *ch = malloc(sizeof(hep_proxy_chunk) * 3 * (size_t)g->N);
    int *knode = calloc((size_t)g->N, sizeof(int));
    combine_ctx cx;
    int n = 0, rc;
    view mine;
    uint64_t *mb = mailbox_of(g, g->local);

    memset(&cx, 0, sizeof(cx));
    if ((rc = order_same_kind(g, 2))) {
        free(acc), free(ch), free(knode);
        return rc;
    }
    cx.enext = calloc((size_t)g->R * (size_t)g->cfg.experts_per_rank, sizeof(int));
    if (!acc || !ch || !knode || !cx.enext) {
        free(acc), free(ch), free(knode), free(cx.enext);
        return hep_fail(HEP_ERR_NOMEM, "combine: out of memory");
    }
    /* the handle's layout where node-mates read it (the group's buffers hold the last
     * dispatch's, which may be another handle's) */
    memcpy(hep_my_buf(g, HEP_BUF_HANDLE_META), h->base, sizeof(int) * (size_t)(g->world + 1));
    memcpy(hep_my_buf(g, HEP_BUF_HANDLE_IDS), h->ids, sizeof(int) * (size_t)h->t * kmax);
    g->last_t = h->t;
    g->last_recv = h->recv;
    mb[HEP_MB_COMBINE_IN] =
        (uint64_t)(uintptr_t)(a->expert_out ? a->expert_out : hep_my_buf(g, HEP_BUF_TOKEN_X));
    mb[HEP_MB_HANDLE] = (uint64_t)(uintptr_t)h;
    mb[HEP_MB_PROBS_IN] = (uint64_t)(uintptr_t)co->probs_in;
    if (g->shm) /* across processes node-mates read this rank's exchange.token */
        hep_shm_stage_combine_input(g, a->expert_out, g->last_recv);
    __atomic_store_n(flags_of(g, g->local) + HEP_FLAG_COMBINE_READY, e, __ATOMIC_RELEASE);
    /* 0. the arrival words, on their own, before this rank waits for its node-mates: a peer
     * that gives up on this rank's partial sums then knows this rank came, even when a
     * node-mate of this rank is the one missing (whose own timeout names it) */
    for (int m = 0; m < g->N; m++) {
        if (m == g->node)
            continue;
        __atomic_store_n(&words[2 * g->N + m], e, __ATOMIC_RELEASE);
        ch[n++] = hep_wire_chunk(g, m * g->R + g->local, HEP_BUF_C_OUT_FLAGS,
                                 (size_t)(2 * g->N + m) * 8, HEP_BUF_C_GROUP_FLAGS,
                                 (size_t)(2 * g->N + hep_slot_of(g->node, m)) * 8, 8,
                                 words + 2 * g->N + m);
    }
    if (n) {
        rc = hep_proxy_submit(g->proxy, ch, n, e);
        if (rc == HEP_OK)
            rc = hep_proxy_wait(g->proxy);
        n = 0;
    }
    if (rc == HEP_OK)
        rc = wait_mates(g, HEP_FLAG_COMBINE_READY, e, "its expert outputs");
    /* 1. as the peer of every other node: its tokens' partial sums over this node */
    for (int m = 0; rc == HEP_OK && m < g->N; m++) {
        int src = m * g->R + g->local, s = hep_slot_of(m, g->node);
        view v;
        if (m == g->node)
            continue;
        memset(&v, 0, sizeof(v)); /* that slot's routing as the handle's dispatch saw it */
        v.slot = 1;
        v.kmax = (int)kmax;
        v.t = h->slot_t[m];
        v.ids = h->slot_ids + (size_t)m * T * kmax;
        ctx_reset(g, &cx);
        for (int k = 0; k < v.t; k++) {
            acc_clear(acc, H);
            add_node_share(g, &v, k, src, &cx, acc);
            for (size_t c = 0; c < H; c++)
                red[((size_t)s * T + (size_t)k) * H + c] = f32_bf16(acc[c]);
        }
        words[m] = (uint64_t)v.t;
        __atomic_store_n(&words[g->N + m], e, __ATOMIC_RELEASE);
        if (v.t)
            ch[n++] = hep_wire_chunk(g, src, HEP_BUF_C_RED_TOKEN, (size_t)s * T * rb2, HEP_BUF_C_GROUP_TOKEN,
                            (size_t)hep_slot_of(g->node, m) * T * rb2, (size_t)v.t * rb2,
                            words + g->N + m);
        ch[n++] = hep_wire_count_then_flag(g, src, HEP_BUF_C_OUT_FLAGS, HEP_BUF_C_GROUP_FLAGS, m,
                                  hep_slot_of(g->node, m), words + g->N + m);
    }
    if (rc == HEP_OK && g->N > 1)
        rc = hep_proxy_submit(g->proxy, ch, n, e);
    if (rc == HEP_OK && g->N > 1)
        rc = hep_proxy_wait(g->proxy);
    /* 2. my tokens: my node's share, then the other nodes' partial sums in node order */
    for (int m = 0; rc == HEP_OK && m < g->N; m++)
        if (m != g->node)
            rc = wait_ge(g, (volatile uint64_t *)&in[g->N + hep_slot_of(m, g->node)], e,
                         m * g->R + g->local, "its partial sums",
                         &in[2 * g->N + hep_slot_of(m, g->node)]);
    recorded_view(g, &mine);
    ctx_reset(g, &cx);
    for (int i = 0; rc == HEP_OK && i < g->last_t; i++) {
        uint16_t *out = (uint16_t *)a->out + (size_t)i * H;
        cx.pout = co->probs_out ? co->probs_out + (size_t)i * E : NULL;
        if (cx.pout)
            memset(cx.pout, 0, E * sizeof(float));
        acc_clear(acc, H);
        add_node_share(g, &mine, i, g->rank, &cx, acc);
        for (int m = 0; m < g->N; m++) {
            const uint16_t *p;
            if (m == g->node || !needs_node(g, &mine, i, m))
                continue;
            p = parts + ((size_t)hep_slot_of(m, g->node) * T + (size_t)knode[m]++) * H;
            for (size_t c = 0; c < H; c++)
                acc[c] += bf16_f32(p[c]);
        }
        for (size_t c = 0; c < H; c++)
            out[c] = f32_bf16(acc[c]);
    }
    free(acc);
    free(ch);
    free(knode);
    free(cx.enext);
    if (rc)
        return rc;
    __atomic_store_n(flags_of(g, g->local) + DONE_COMBINE, e, __ATOMIC_RELEASE);
    return wait_mates(g, DONE_COMBINE, e, "the node-mates to finish reading");
}
