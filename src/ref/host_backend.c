/* ref/host_backend.c: dispatch and combine on host memory, ranks as threads of one
 * process (or processes of one host, through ref/host_shm.h): the reference semantics (the oracle of every GPU test) and the backend of
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
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "backend/backend.h"
#include "kernels/ep_kernels.h"
#include "net/proxy.h"
#include "ref/host_shm.h"

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

static uint64_t *flags_of(hep_backend_ctx *g, int l)
{
    return (uint64_t *)hep_be_peer_buf(g, l, HEP_BUF_FLAGS);
}
static uint64_t *mailbox_of(hep_backend_ctx *g, int l)
{
    return (uint64_t *)hep_be_peer_buf(g, l, HEP_BUF_MAILBOX);
}
/* Buffer `id` of node-mate l's local arena (one address space, or mapped: ref/host_shm.h). */
static char *mate_local(hep_backend_ctx *g, int l, int id)
{
    char *base = g->shm ? hep_shm_mate_local(g, l)
                        : (char *)(uintptr_t)mailbox_of(g, l)[HEP_MB_LOCAL];
    return base + g->plan->buf[id].offset;
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
static int needs_rank(const hep_backend_ctx *g, const view *v, int i, int r)
{
    for (int k = 0; k < kslots(v); k++) {
        long long x = id_at(v, i, k);
        if (x >= 0 && x < (long long)g->cfg->experts_per_rank * g->world &&
            x / g->cfg->experts_per_rank == r)
            return 1;
    }
    return 0;
}
static int needs_node(const hep_backend_ctx *g, const view *v, int i, int m)
{
    for (int l = 0; l < g->R; l++)
        if (needs_rank(g, v, i, m * g->R + l))
            return 1;
    return 0;
}

/* `arrived` (or NULL): the sender's arrival word, sent ahead of the flag (a timeout then
 * says whether the sender came and its flag was lost, or it never came). */
static int wait_ge(hep_backend_ctx *g, volatile uint64_t *f, uint64_t e, int peer, const char *what,
                   const volatile uint64_t *arrived)
{
    int rc = hep_proxy_wait_flag_arrived(f, e, arrived, g->rank, peer, what);
    if (rc) {
        snprintf(g->broken_msg, sizeof(g->broken_msg), "%s", hep_last_error());
        g->broken = 1;
    }
    return rc;
}

static int wait_mates(hep_backend_ctx *g, int word, uint64_t e, const char *what)
{
    for (int l = 0; l < g->R; l++) {
        int rc = wait_ge(g, flags_of(g, l) + word, e, g->node * g->R + l, what, NULL);
        if (rc)
            return rc;
    }
    return HEP_OK;
}

static int first_invalid(const hep_backend_ctx *g, const view *v, int *tok, int *slot, long long *val)
{
    long long E = (long long)g->cfg->experts_per_rank * g->world;
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

static int local_experts(const hep_backend_ctx *g, const view *v, int i, int r, int *es);

/* Row `row` of this rank's receive buffers from token i of v; with g->row_experts (an
 * expert-major dispatch) also the row's local experts, which permute() reads back. */
static void receive(hep_backend_ctx *g, const view *v, int i, int row, int *tpe)
{
    const int El = g->cfg->experts_per_rank, H = g->cfg->hidden;
    const size_t rb = (size_t)H * (g->cfg->dtype == HEP_DTYPE_FP8_E4M3 ? 1 : 2);
    float *prob = (float *)hep_be_buf(g, HEP_BUF_RECV_PROB) + (size_t)row * (size_t)El;
    long long first = (long long)g->rank * El;
    memcpy(hep_be_buf(g, HEP_BUF_TOKEN_X) + (size_t)row * rb, v->tokens + (size_t)i * rb, rb);
    if (g->cfg->dtype == HEP_DTYPE_FP8_E4M3) {
        size_t ns = (size_t)H / HEP_FP8_BLOCK;
        memcpy((float *)hep_be_buf(g, HEP_BUF_RECV_SCALE) + (size_t)row * ns,
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
    if (g->row_experts) {
        int es[32], n = local_experts(g, v, i, g->rank, es);
        int *o = g->row_experts + (size_t)row * (size_t)g->cfg->max_topk;
        for (int q = 0; q < g->cfg->max_topk; q++)
            o[q] = q < n ? es[q] : -1;
    }
}

/* Row `row` of the receive order: received, or (at or past g->recv_limit: HEP_ASYNC past
 * the capacity) dropped; its position still counts, so later rows keep theirs. */
static void take(hep_backend_ctx *g, const view *v, int i, int row, int *tpe)
{
    if (!g->recv_limit || row < g->recv_limit)
        receive(g, v, i, row, tpe);
}

static void own_view(hep_backend_ctx *g, int l, view *v)
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
static void recorded_view(hep_backend_ctx *g, view *v)
{
    memset(v, 0, sizeof(*v));
    v->slot = 1;
    v->kmax = g->cfg->max_topk;
    v->t = g->last_t;
    v->ids = (const int *)hep_be_buf(g, HEP_BUF_HANDLE_IDS);
}

/* Copy the caller's ids as slots of kmax (an invalid id, or a slot past topk, as -1). */
static void record_ids(hep_backend_ctx *g, const view *mine)
{
    const int kmax = g->cfg->max_topk;
    const long long E = (long long)g->cfg->experts_per_rank * g->world;
    int *ids = (int *)hep_be_buf(g, HEP_BUF_HANDLE_IDS);
    for (int i = 0; i < mine->t; i++)
        for (int k = 0; k < kmax; k++) {
            long long x = k < mine->K ? id_at(mine, i, k) : -1;
            ids[(size_t)i * (size_t)kmax + (size_t)k] = x >= 0 && x < E ? (int)x : -1;
        }
}

/* Expert e's positions of its local experts that token i of v chose, ascending, distinct
 * (at most 32). */
static int local_experts(const hep_backend_ctx *g, const view *v, int i, int r, int *es)
{
    const int El = g->cfg->experts_per_rank;
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

/* Expert-major outputs (hybridep.h, "Layouts"): every (token, local expert) row written at
 * its position in caller memory, padding zeroed, rows at or past the budget dropped.
 * cnt[e]: received tokens with a slot on e. Fills h's ebase / tpe / counts. */
static size_t permute(hep_backend_ctx *g, hep_handle *h, const int *cnt, const hep_dispatch_opts *x)
{
    const int El = g->cfg->experts_per_rank, H = g->cfg->hidden;
    const int fp8 = g->cfg->dtype == HEP_DTYPE_FP8_E4M3, pad = h->pad, budget = h->budget;
    const size_t rb = (size_t)H * (fp8 ? 1 : 2), ns = (size_t)H / HEP_FP8_BLOCK;
    const size_t row_bytes = rb + sizeof(float) + (fp8 ? ns * sizeof(float) : 0);
    unsigned char *tok = x->recv_tokens;
    const unsigned char *rows = (const unsigned char *)hep_be_buf(g, HEP_BUF_TOKEN_X);
    const float *probs = (const float *)hep_be_buf(g, HEP_BUF_RECV_PROB);
    const float *scales = fp8 ? (const float *)hep_be_buf(g, HEP_BUF_RECV_SCALE) : NULL;
    const int *base = (const int *)hep_be_buf(g, HEP_BUF_HANDLE_META);
    long long *run = malloc(sizeof(long long) * (size_t)El), pos = 0;
    size_t written = 0;
    int dropped = 0;
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
    /* from the rank-major rows just received (the other nodes' rings are reused while a
     * dispatch reads them): the same order, source by source */
    for (int src = 0; src < g->world; src++) {
        for (int e = 0; e < El; e++)
            h->ebase[(size_t)src * (size_t)El + (size_t)e] = (int)run[e];
        for (int row = base[src]; row < base[src + 1]; row++) {
            const int *es = g->row_experts + (size_t)row * (size_t)g->cfg->max_topk;
            for (int q = 0; q < g->cfg->max_topk && es[q] >= 0; q++) {
                long long p = run[es[q]]++;
                if (p >= budget) {
                    dropped++;
                    continue;
                }
                memcpy(tok + (size_t)p * rb, rows + (size_t)row * rb, rb);
                x->recv_probs[p] = probs[(size_t)row * (size_t)El + (size_t)es[q]];
                if (fp8)
                    memcpy(x->recv_scales + (size_t)p * ns, scales + (size_t)row * ns,
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
static void record(hep_backend_ctx *g, hep_handle *h, const hep_dispatch_args *a, uint64_t e, int rows)
{
    const size_t kmax = (size_t)g->cfg->max_topk;
    view mine;
    own_view(g, g->local, &mine);
    h->epoch = e;
    h->t = a->num_tokens;
    h->topk = a->topk;
    h->recv = rows;
    memcpy(h->ids, hep_be_buf(g, HEP_BUF_HANDLE_IDS), sizeof(int) * (size_t)h->t * kmax);
    for (int i = 0; i < h->t; i++)
        for (size_t k = 0; k < kmax; k++)
            h->w[(size_t)i * kmax + k] = (int)k < a->topk ? w_at(&mine, i, (int)k) : 0.f;
    memcpy(h->base, hep_be_buf(g, HEP_BUF_HANDLE_META), sizeof(int) * (size_t)(g->world + 1));
    /* slot_t and slot_ids (the other nodes' slots at this rank) were recorded by the pull,
     * while each chunk was in the ring */
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
static size_t copy_out(hep_backend_ctx *g, int rows, hep_dispatch_opts *x)
{
    const int El = g->cfg->experts_per_rank, H = g->cfg->hidden;
    const int fp8 = g->cfg->dtype == HEP_DTYPE_FP8_E4M3;
    const size_t rb = (size_t)H * (fp8 ? 1 : 2), n = (size_t)rows;
    const size_t sb = n * (size_t)(H / HEP_FP8_BLOCK) * sizeof(float);
    size_t bytes = 0;
    if (x->recv_tokens) {
        memcpy(x->recv_tokens, hep_be_buf(g, HEP_BUF_TOKEN_X), n * rb);
        bytes += n * rb;
    }
    if (x->recv_probs) {
        memcpy(x->recv_probs, hep_be_buf(g, HEP_BUF_RECV_PROB), n * (size_t)El * sizeof(float));
        bytes += n * (size_t)El * sizeof(float);
    }
    if (fp8 && x->recv_scales) {
        memcpy(x->recv_scales, hep_be_buf(g, HEP_BUF_RECV_SCALE), sb);
        bytes += sb;
    }
    return bytes;
}

/* ---------------------------------------------------------------- the inter-node rings
 *
 * Each slot (a sender's staging for a node, a receiver's slot of a node, the partial sums)
 * is a ring of P positions of C tokens (g->plan->ring, g->plan->chunk, in both phases: the
 * plan gives combine other chunks on the GPU only; the words of kernels/ep_kernels.h,
 * "rings"). Chunk k of a call, the slot's tokens [kC, kC + C), is in position k % P.
 * Ordering, for one ring (sender S = (m, l), receiver Q = (n, l)):
 *  - S packs chunk k into its staging position only once the credit word (its
 *    attn flags, word B + n, written by Q's proxy) holds RING_VAL(e, k - P + 1): Q's node
 *    read chunk k - P, so its data landed (the NIC had read S's staging position) and
 *    Q's position is free. S then stores RING_VAL(e, k + 1) with release into the flag
 *    source of the position: the proxy reads it with acquire (it is the chunk's ready word),
 *    posts the data and then, fenced behind every earlier chunk to Q, the flag write of
 *    that word on the same connection (RC order: the flag lands after the data).
 *  - The position's flag source is rewritten (for chunk k + P) only after credit k came,
 *    i.e. after Q saw chunk k's flag, so the NIC never reads a flag claiming unsent data.
 *  - Readers at Q's node wait for the landed word (Q's group flags, word B + s) with
 *    acquire, read the chunk, then store RING_VAL(e, k + 1) with release into their read
 *    word for (Q, s) (sync.flags). Q takes the minimum over its node-mates and stores it
 *    with release into its credit source (word B + N + s); the proxy posts it to S once it
 *    holds what a credit chunk wants. A credit only ever under-states what was read.
 *  - Chunks 0..P-1 of a call need no credit: a sender starts call e + 1 only after call e
 *    ended everywhere it could still be read (docs/architecture.md, "buffer reuse").
 * Every loop that waits on a ring also produces and frees, so no rank waits for a credit
 * that only its own progress could give; a loop that moves nothing for HEP_TIMEOUT_MS fails
 * naming the rank it waits for. */

static size_t cb_words(const hep_backend_ctx *g)
{
    return HEP_COUNT_BLOCK_WORDS((size_t)g->R, (size_t)g->cfg->experts_per_rank);
}
static size_t ring_base(const hep_backend_ctx *g)
{
    return HEP_RING_WORD((size_t)g->N, cb_words(g));
}
static size_t src_word(const hep_backend_ctx *g, int m, int p)
{
    return HEP_RING_SRC_WORD((size_t)g->N, cb_words(g), (size_t)m, (size_t)p,
                             (size_t)g->plan->ring);
}
/* The row within its slot of the k-th token of a call's slot stream. */
static size_t ring_row(const hep_backend_ctx *g, size_t k)
{
    const size_t C = (size_t)g->plan->chunk, P = (size_t)g->plan->ring;
    return k / C % P * C + k % C;
}
static int chunks_of(const hep_backend_ctx *g, int tokens)
{
    return (tokens + g->plan->chunk - 1) / g->plan->chunk;
}
/* Chunks of call e in a ring word (0 for an earlier call's value). */
static int chunks_in(uint64_t v, uint64_t e)
{
    return v >= HEP_RING_VAL(e, 0) ? (int)(v - HEP_RING_VAL(e, 0)) : 0;
}
static uint64_t load_acq(const volatile uint64_t *w)
{
    return __atomic_load_n((const uint64_t *)w, __ATOMIC_ACQUIRE);
}
/* The first word of slot s's count block in a flags buffer (combine: "probabilities
 * come", see combine_run). */
static size_t cb_at(const hep_backend_ctx *g, int s)
{
    return 3 * (size_t)g->N + (size_t)s * cb_words(g);
}
/* Reader `reader`'s count of the chunks it read of node-mate l's ring for slot s. */
static uint64_t *read_word(hep_backend_ctx *g, int reader, int l, int s)
{
    return flags_of(g, reader) + 16 + 2 * (size_t)g->world + (size_t)l * (size_t)(g->N - 1) +
           (size_t)s;
}

/* One other node m, this rank as its sender (dispatch rows or partial sums) and receiver. */
typedef struct ring_peer {
    int m, peer;      /* the node, and its rank with this local rank */
    int j, s;         /* my slot index for m (send staging, my receive slot); mine at m */
    int *list;        /* dispatch: my tokens that need m, in order */
    int cnt, nk, next;/* tokens and chunks to send; the next chunk to pack */
    int final;        /* the slot's count and flag are ready */
    int in_cnt, in_nk;/* tokens and chunks of m's slot here */
    int got;          /* combine: partial sums of m read so far */
    int send_probs;   /* combine: my partial sums for m carry their probabilities */
    int recv_probs;   /* combine: m's partial sums here carry theirs (-1: not read yet) */
} ring_peer;

/* Rows of chunk k of a slot of cnt tokens, chunks of C. */
static size_t chunk_rows(int cnt, int k, size_t C)
{
    const size_t left = (size_t)(cnt - k * (int)C);
    return left < C ? left : C;
}

/* The proxy's chunk list of one phase: per other node, `per_chunk` entries for each chunk
 * it sends, one for the slot's count, one per chunk it receives (its credit). */
static hep_proxy_chunk *ring_chunk_list(const hep_backend_ctx *g, const ring_peer *rp,
                                        size_t per_chunk, const char *phase)
{
    size_t total = 0;
    hep_proxy_chunk *ch;
    for (int m = 0; m < g->N; m++)
        if (m != g->node)
            total += (size_t)rp[m].nk * per_chunk + 1 + (size_t)rp[m].in_nk;
    ch = malloc(sizeof(*ch) * (total ? total : 1));
    if (!ch)
        hep_fail(HEP_ERR_NOMEM, "%s: out of memory", phase);
    return ch;
}

/* Pack chunk k of my slot for node d->m into its staging position (dispatch). */
static void pack_chunk(hep_backend_ctx *g, const hep_dispatch_args *a, const view *mine,
                       const ring_peer *d, int k)
{
    const size_t S = g->plan->slot_tokens, H = (size_t)g->cfg->hidden;
    const int fp8 = g->cfg->dtype == HEP_DTYPE_FP8_E4M3, kmax = g->cfg->max_topk;
    const size_t rb = H * (fp8 ? 1 : 2), ns = H / HEP_FP8_BLOCK, rw = (size_t)kmax * 4;
    const long long E = (long long)g->cfg->experts_per_rank * g->world;
    char *tok = hep_be_buf(g, HEP_BUF_D_ATTN_TOKEN), *route = hep_be_buf(g, HEP_BUF_D_ATTN_PROB);
    char *scale = fp8 ? hep_be_buf(g, HEP_BUF_D_ATTN_SCALE) : NULL;
    const int end = (k + 1) * g->plan->chunk < d->cnt ? (k + 1) * g->plan->chunk : d->cnt;
    for (int q = k * g->plan->chunk; q < end; q++) {
        const int i = d->list[q];
        const size_t r = (size_t)d->j * S + ring_row(g, (size_t)q);
        int *ids = (int *)(route + ((size_t)d->j * 2 * S + ring_row(g, (size_t)q)) * rw);
        float *w = (float *)(route + ((size_t)d->j * 2 * S + S + ring_row(g, (size_t)q)) * rw);
        memcpy(tok + r * rb, (const char *)a->tokens + (size_t)i * rb, rb);
        if (fp8)
            memcpy(scale + r * ns * 4, a->scales + (size_t)i * ns, ns * 4);
        for (int x = 0; x < kmax; x++) {
            long long id = x < a->topk ? id_at(mine, i, x) : -1;
            /* an invalid id (reported by this rank) travels as an unused slot */
            ids[x] = id >= 0 && id < E ? (int)id : -1;
            w[x] = x < a->topk ? w_at(mine, i, x) : 0.f;
        }
    }
}

/* Dispatch, step 1: for every other node m, the tokens that need it, the slot's count and
 * count block (tokens per (local rank, expert) there), then the arrival word, fenced
 * behind them: the receivers size their rings, and the capacity is agreed, before any row
 * moves. */
static int dispatch_announce(hep_backend_ctx *g, const hep_dispatch_args *a, uint64_t e, ring_peer *rp)
{
    const int El = g->cfg->experts_per_rank, N = g->N;
    const size_t cb = cb_words(g);
    uint64_t *words = (uint64_t *)hep_be_buf(g, HEP_BUF_D_ATTN_FLAGS);
    hep_proxy_chunk *ch = malloc(sizeof(*ch) * 3 * (size_t)N);
    view mine;
    int n = 0, rc, es[32];
    if (!ch)
        return hep_fail(HEP_ERR_NOMEM, "dispatch: out of memory");
    own_view(g, g->local, &mine);
    for (int m = 0; m < N; m++) {
        ring_peer *d = &rp[m];
        int *blk = (int *)(words + 3 * (size_t)N + (size_t)m * cb);
        if (m == g->node)
            continue;
        memset(blk, 0, cb * 8);
        for (int i = 0; i < a->num_tokens; i++) {
            if (!needs_node(g, &mine, i, m))
                continue;
            d->list[d->cnt++] = i;
            for (int dl = 0; dl < g->R; dl++) {
                int ne = local_experts(g, &mine, i, m * g->R + dl, es);
                blk[dl * (El + 1)] += ne > 0;
                for (int q = 0; q < ne; q++)
                    blk[dl * (El + 1) + 1 + es[q]]++;
            }
        }
        d->nk = chunks_of(g, d->cnt);
        words[m] = (uint64_t)d->cnt;
        __atomic_store_n(&words[2 * N + m], e, __ATOMIC_RELEASE);
        ch[n++] = hep_wire_chunk(g, d->peer, HEP_BUF_D_ATTN_FLAGS, (size_t)m * 8,
                                 HEP_BUF_D_GROUP_FLAGS, (size_t)d->s * 8, 8, words + 2 * N + m);
        ch[n++] = hep_wire_chunk(g, d->peer, HEP_BUF_D_ATTN_FLAGS, (3 * (size_t)N + m * cb) * 8,
                                 HEP_BUF_D_GROUP_FLAGS, (3 * (size_t)N + d->s * cb) * 8, cb * 8,
                                 words + 2 * N + m);
        ch[n++] = hep_wire_flag(g, d->peer, HEP_BUF_D_ATTN_FLAGS, 2 * (size_t)N + m,
                                HEP_BUF_D_GROUP_FLAGS, 2 * (size_t)N + d->s, e);
    }
    rc = hep_proxy_submit(g->proxy, ch, n, e);
    free(ch);
    return rc ? rc : hep_proxy_wait(g->proxy);
}

/* Step 2's batch: every chunk of every slot (its data, then its flag), the slots' final
 * count and flag, and the credits this rank owes for the chunks its ring receives. */
static int dispatch_stream(hep_backend_ctx *g, uint64_t e, const ring_peer *rp)
{
    const size_t S = g->plan->slot_tokens, H = (size_t)g->cfg->hidden, C = (size_t)g->plan->chunk;
    const int fp8 = g->cfg->dtype == HEP_DTYPE_FP8_E4M3, P = g->plan->ring, N = g->N;
    const size_t rb = H * (fp8 ? 1 : 2), sb = H / HEP_FP8_BLOCK * 4;
    const size_t rw = (size_t)g->cfg->max_topk * 4, B = ring_base(g);
    uint64_t *words = (uint64_t *)hep_be_buf(g, HEP_BUF_D_ATTN_FLAGS);
    uint64_t *in = (uint64_t *)hep_be_buf(g, HEP_BUF_D_GROUP_FLAGS);
    hep_proxy_chunk *ch = ring_chunk_list(g, rp, 5, "dispatch");
    int n = 0, rc;
    if (!ch)
        return HEP_ERR_NOMEM;
    for (int m = 0; m < N; m++) {
        const ring_peer *d = &rp[m];
        if (m == g->node)
            continue;
        for (int k = 0; k < d->nk; k++) {
            const size_t p = (size_t)(k % P), rows = chunk_rows(d->cnt, k, C);
            const size_t lr = (size_t)d->j * S + p * C, rr = (size_t)d->s * S + p * C;
            const uint64_t want = HEP_RING_VAL(e, k + 1);
            const volatile uint64_t *ready = words + src_word(g, m, (int)p);
            hep_proxy_chunk *c0 = ch + n;
            ch[n++] = hep_wire_chunk(g, d->peer, HEP_BUF_D_ATTN_TOKEN, lr * rb,
                                     HEP_BUF_D_GROUP_TOKEN, rr * rb, rows * rb, ready);
            ch[n++] = hep_wire_chunk(g, d->peer, HEP_BUF_D_ATTN_PROB,
                                     ((size_t)d->j * 2 * S + p * C) * rw, HEP_BUF_D_GROUP_PROB,
                                     ((size_t)d->s * 2 * S + p * C) * rw, rows * rw, ready);
            ch[n++] = hep_wire_chunk(g, d->peer, HEP_BUF_D_ATTN_PROB,
                                     ((size_t)d->j * 2 * S + S + p * C) * rw, HEP_BUF_D_GROUP_PROB,
                                     ((size_t)d->s * 2 * S + S + p * C) * rw, rows * rw, ready);
            if (fp8)
                ch[n++] = hep_wire_chunk(g, d->peer, HEP_BUF_D_ATTN_SCALE, lr * sb,
                                         HEP_BUF_D_GROUP_SCALE, rr * sb, rows * sb, ready);
            for (hep_proxy_chunk *c = c0; c < ch + n; c++)
                c->want = want;
            ch[n++] = hep_wire_flag(g, d->peer, HEP_BUF_D_ATTN_FLAGS, src_word(g, m, (int)p),
                                    HEP_BUF_D_GROUP_FLAGS, B + (size_t)d->s, want);
        }
        /* the slot's flag (its count went ahead in step 1) */
        ch[n++] = hep_wire_flag(g, d->peer, HEP_BUF_D_ATTN_FLAGS, (size_t)(N + m),
                                HEP_BUF_D_GROUP_FLAGS, (size_t)N + (size_t)d->s, e);
    }
    for (int m = 0; m < N; m++) /* after all data: a flag never waits behind a credit */
        for (int k = 0; m != g->node && !g->hold_credits && k < rp[m].in_nk - P; k++) {
            ch[n] = hep_wire_chunk(g, rp[m].peer, HEP_BUF_D_GROUP_FLAGS,
                                   (B + (size_t)N + (size_t)rp[m].j) * 8, HEP_BUF_D_ATTN_FLAGS,
                                   (B + (size_t)g->node) * 8, 8, in + B + N + rp[m].j);
            ch[n++].want = HEP_RING_VAL(e, k + 1);
        }
    rc = hep_proxy_submit(g->proxy, ch, n, e);
    free(ch);
    return rc;
}

/* Ends a streaming batch after its producer failed: the producer's message stands unless
 * the NIC refused a write (that is the cause). */
static int stream_abort(hep_backend_ctx *g, int rc, const char *msg)
{
    int prc;
    hep_proxy_cancel(g->proxy, rc, msg);
    prc = hep_proxy_wait(g->proxy);
    if (prc == HEP_ERR_VERBS)
        rc = prc;
    else
        hep_fail(rc, "%s", msg);
    snprintf(g->broken_msg, sizeof(g->broken_msg), "%s", hep_last_error());
    g->broken = 1;
    return rc;
}

/* The receive capacity (config.max_recv_rows), agreed before any row moves: each rank
 * counts the rows it needs from its node-mates' inputs and, for the other nodes, from the
 * count blocks their slots sent ahead of the rows (tokens per local rank), then every
 * rank's count goes to every rank through the bootstrap's allgather. On an overflow every
 * rank returns HEP_ERR_OVERFLOW with the same message, before any row was sent or written;
 * the allgather also stands for the end-of-reading handshake of that case. With `drop`
 * (HEP_ASYNC, rank-major) an overflow is no failure: every rank keeps the rows below the
 * capacity (g->recv_limit), `warn` (WARN_LEN bytes) gets the message, and h's drop_words
 * say so. */
#define WARN_LEN 256
static int agree_capacity(hep_backend_ctx *g, uint64_t e, int drop, hep_handle *h, char *warn)
{
    const long long cap = g->cfg->max_recv_rows;
    const int El = g->cfg->experts_per_rank;
    const size_t cb = cb_words(g);
    long long need = 0, *all;
    int rc = HEP_OK, over = -1, n_over = 0;
    for (int ns = 0; ns < g->N; ns++)
        for (int l = 0; l < g->R; l++) {
            view v;
            if (ns == g->node) {
                own_view(g, l, &v);
                for (int i = 0; i < v.t; i++)
                    need += needs_rank(g, &v, i, g->rank);
            } else {
                const uint64_t *fl = (const uint64_t *)mate_local(g, l, HEP_BUF_D_GROUP_FLAGS);
                const int *blk = (const int *)(fl + 3 * (size_t)g->N +
                                               (size_t)hep_slot_of(ns, g->node) * cb);
                need += blk[g->local * (El + 1)];
            }
        }
    all = malloc(sizeof(long long) * (size_t)g->world);
    if (!all) { /* the others wait in the allgather: this rank cannot go on either */
        snprintf(g->broken_msg, sizeof(g->broken_msg),
                 "dispatch on rank %d: out of memory for the receive-capacity agreement", g->rank);
        g->broken = 1;
        return hep_fail(HEP_ERR_NOMEM, "%s", g->broken_msg);
    }
    rc = g->bs->allgather(g->bs->ctx, &need, all, sizeof(need));
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
    h->drop_words[HEP_OVERFLOW_DROPPED] = over >= 0;
    h->drop_words[HEP_OVERFLOW_NEEDED] = (int)need;
    h->drop_words[HEP_OVERFLOW_ROWS] = need > cap ? (int)(need - cap) : 0;
    if (over >= 0 && drop) {
        g->recv_limit = (int)cap;
        snprintf(warn, WARN_LEN,
                 "dispatch: rank %d needs %lld receive rows, more than config.max_recv_rows = "
                 "%lld (%d rank(s) over; HEP_ASYNC): the rows at or past that position of each "
                 "rank's receive order were dropped",
                 over, all[over], cap, n_over);
        free(all);
        return HEP_OK;
    }
    if (over >= 0) {
        long long worst = all[over];
        free(all);
        g->epoch = e; /* this call's counts and flags are spent: the next call is e + 1 */
        return hep_fail(HEP_ERR_OVERFLOW,
                        "dispatch: rank %d needs %lld receive rows, more than "
                        "config.max_recv_rows = %lld (%d rank(s) over); nothing was received on "
                        "any rank and the group stays usable",
                        over, worst, cap, n_over);
    }
    free(all);
    return HEP_OK;
}

/* Step 1's counts of every slot this rank reads (node-mates' rings), once they came. */
static int wait_counts(hep_backend_ctx *g, uint64_t e, ring_peer *rp)
{
    for (int ns = 0; ns < g->N; ns++)
        for (int l = 0; ns != g->node && l < g->R; l++) {
            const uint64_t *fl = (const uint64_t *)mate_local(g, l, HEP_BUF_D_GROUP_FLAGS);
            const int s = hep_slot_of(ns, g->node);
            int rc = wait_ge(g, (volatile uint64_t *)&fl[2 * (size_t)g->N + (size_t)s], e,
                             ns * g->R + l, "its dispatch counts (the arrival word)", NULL);
            if (rc)
                return rc;
            if (l == g->local) {
                rp[ns].in_cnt = (int)fl[s];
                rp[ns].in_nk = chunks_of(g, rp[ns].in_cnt);
            }
        }
    return HEP_OK;
}

/* The pull of one dispatch as a loop that also packs this rank's chunks and frees the
 * chunks of its ring (see "the inter-node rings"). Receive order: [source node][source
 * local][token]; another node's source (ns, l) is read from node-mate l's ring for ns,
 * chunk by chunk once each landed. */
typedef struct pull {
    int ns, l, i, t, started; /* the source being read, its next token and its tokens */
    int row;                  /* rows received so far */
} pull;

/* The view of chunk q of node-mate l's ring for source node ns (its v.t tokens). */
static void chunk_view(hep_backend_ctx *g, int l, int ns, int q, int cnt, view *v)
{
    const size_t S = g->plan->slot_tokens, H = (size_t)g->cfg->hidden, C = (size_t)g->plan->chunk;
    const size_t rb = H * (g->cfg->dtype == HEP_DTYPE_FP8_E4M3 ? 1 : 2);
    const size_t kmax = (size_t)g->cfg->max_topk, s = (size_t)hep_slot_of(ns, g->node);
    const size_t r0 = s * S + (size_t)(q % g->plan->ring) * C;
    const char *route = mate_local(g, l, HEP_BUF_D_GROUP_PROB) + s * 2 * S * kmax * 4;
    memset(v, 0, sizeof(*v));
    v->slot = 1;
    v->kmax = (int)kmax;
    v->t = cnt - q * (int)C < (int)C ? cnt - q * (int)C : (int)C;
    v->tokens = (const unsigned char *)mate_local(g, l, HEP_BUF_D_GROUP_TOKEN) + r0 * rb;
    v->ids = (const int *)route + (size_t)(q % g->plan->ring) * C * kmax;
    v->w = (const float *)(route + S * kmax * 4) + (size_t)(q % g->plan->ring) * C * kmax;
    if (g->cfg->dtype == HEP_DTYPE_FP8_E4M3)
        v->scales = (const float *)mate_local(g, l, HEP_BUF_D_GROUP_SCALE) +
                    r0 * (H / HEP_FP8_BLOCK);
}

/* Read what is readable; 1 if anything moved. Sets *wait_l / *wait_q to the chunk it
 * waits for (or -1). */
static int pull_step(hep_backend_ctx *g, uint64_t e, pull *c, int *tpe, int record_slots, hep_handle *h,
                     int *wait_q)
{
    const size_t kmax = (size_t)g->cfg->max_topk, T = (size_t)g->cfg->max_tokens;
    const size_t B = ring_base(g);
    int *base = (int *)hep_be_buf(g, HEP_BUF_HANDLE_META);
    int did = 0;
    *wait_q = -1;
    while (c->ns < g->N) {
        view v;
        if (!c->started) {
            base[c->ns * g->R + c->l] = c->row;
            if (c->ns == g->node) {
                own_view(g, c->l, &v);
                c->t = v.t;
            } else {
                const uint64_t *fl = (const uint64_t *)mate_local(g, c->l, HEP_BUF_D_GROUP_FLAGS);
                c->t = (int)fl[hep_slot_of(c->ns, g->node)];
                if (record_slots && c->l == g->local)
                    h->slot_t[c->ns] = c->t;
            }
            c->i = 0;
            c->started = 1;
        }
        if (c->i >= c->t) {
            c->started = 0;
            if (++c->l == g->R)
                c->l = 0, c->ns++;
            continue;
        }
        if (c->ns == g->node) {
            own_view(g, c->l, &v);
            for (; c->i < v.t; c->i++)
                if (needs_rank(g, &v, c->i, g->rank))
                    take(g, &v, c->i, c->row++, tpe);
        } else {
            const int s = hep_slot_of(c->ns, g->node), q = c->i / g->plan->chunk;
            const uint64_t *fl = (const uint64_t *)mate_local(g, c->l, HEP_BUF_D_GROUP_FLAGS);
            if (chunks_in(load_acq(&fl[B + (size_t)s]), e) < q + 1) {
                *wait_q = q;
                return did;
            }
            chunk_view(g, c->l, c->ns, q, c->t, &v);
            for (int k = 0; k < v.t; k++)
                if (needs_rank(g, &v, k, g->rank))
                    take(g, &v, k, c->row++, tpe);
            if (record_slots && c->l == g->local) /* the routing a combine of mine reads */
                memcpy(h->slot_ids + ((size_t)c->ns * T + (size_t)c->i) * kmax, v.ids,
                       sizeof(int) * (size_t)v.t * kmax);
            c->i += v.t;
            __atomic_store_n(read_word(g, g->local, c->l, s), HEP_RING_VAL(e, q + 1),
                             __ATOMIC_RELEASE);
        }
        did = 1;
    }
    return did;
}

/* Pack every chunk whose position is free; 1 if anything moved. */
static int pack_step(hep_backend_ctx *g, const hep_dispatch_args *a, const view *mine, uint64_t e,
                     ring_peer *rp)
{
    const int P = g->plan->ring, N = g->N;
    uint64_t *words = (uint64_t *)hep_be_buf(g, HEP_BUF_D_ATTN_FLAGS);
    const size_t B = ring_base(g);
    int did = 0;
    for (int m = 0; m < N; m++) {
        ring_peer *d = &rp[m];
        if (m == g->node)
            continue;
        while (d->next < d->nk &&
               (d->next < P || chunks_in(load_acq(&words[B + (size_t)m]), e) >= d->next - P + 1)) {
            pack_chunk(g, a, mine, d, d->next);
            __atomic_store_n(&words[src_word(g, m, d->next % P)], HEP_RING_VAL(e, d->next + 1),
                             __ATOMIC_RELEASE);
            d->next++;
            did = 1;
        }
        if (d->next == d->nk && !d->final) {
            __atomic_store_n(&words[N + m], e, __ATOMIC_RELEASE); /* count and flag ready */
            d->final = 1;
            did = 1;
        }
    }
    return did;
}

/* As the owner of the rings that receive from the other nodes: free each chunk every
 * node-mate has read. Returns 1 if a credit moved; *short_of: a slot whose credits are not
 * all given yet (or -1), *lagger the node-mate holding it back. */
static int credit_step(hep_backend_ctx *g, uint64_t e, const ring_peer *rp, int *short_of, int *lagger)
{
    uint64_t *in = (uint64_t *)hep_be_buf(g, HEP_BUF_D_GROUP_FLAGS);
    const size_t B = ring_base(g);
    int did = 0;
    *short_of = -1;
    for (int m = 0; m < g->N; m++) {
        const int s = rp[m].j, need = rp[m].in_nk - g->plan->ring;
        int least = 1 << 30, who = 0;
        if (m == g->node || need <= 0 || g->hold_credits)
            continue;
        for (int r = 0; r < g->R; r++) {
            int k = chunks_in(load_acq(read_word(g, r, g->local, s)), e);
            if (k < least)
                least = k, who = r;
        }
        if (chunks_in(in[B + (size_t)g->N + (size_t)s], e) < least) {
            __atomic_store_n(&in[B + (size_t)g->N + (size_t)s], HEP_RING_VAL(e, least),
                             __ATOMIC_RELEASE);
            did = 1;
        }
        if (chunks_in(in[B + (size_t)g->N + (size_t)s], e) < need && *short_of < 0)
            *short_of = m, *lagger = who;
    }
    return did;
}

static int dispatch_loop(hep_backend_ctx *g, const hep_dispatch_args *a, uint64_t e, ring_peer *rp,
                         pull *c, int *tpe, int record_slots, hep_handle *h)
{
    const double limit = (double)hep_env_get()->timeout_ms;
    double last = hep_now_ms();
    const size_t B = ring_base(g);
    uint64_t *words = (uint64_t *)hep_be_buf(g, HEP_BUF_D_ATTN_FLAGS);
    view mine;
    char m[1024];
    own_view(g, g->local, &mine);
    for (;;) {
        int wait_q, short_of, lagger = 0, packing = -1, moved;
        moved = pack_step(g, a, &mine, e, rp);
        moved |= pull_step(g, e, c, tpe, record_slots, h, &wait_q);
        moved |= credit_step(g, e, rp, &short_of, &lagger);
        for (int n = 0; n < g->N && packing < 0; n++)
            if (n != g->node && !rp[n].final)
                packing = n;
        if (packing < 0 && c->ns >= g->N && short_of < 0)
            return HEP_OK;
        if (moved) {
            last = hep_now_ms();
            continue;
        }
        if (hep_now_ms() - last <= limit) {
            sched_yield();
            continue;
        }
        if (packing >= 0) {
            const ring_peer *d = &rp[packing];
            snprintf(m, sizeof(m),
                     "rank %d waited %.0f ms (HEP_TIMEOUT_MS) for a credit from rank %d: chunk %d "
                     "of its dispatch rows for node %d needs chunk %d freed, expected %llu, saw "
                     "%llu: rank %d frees a chunk of its ring once every rank of its node read it "
                     "(a rank of node %d that did not read it is named by its own timeout)",
                     g->rank, hep_now_ms() - last, d->peer, d->next, d->m, d->next - g->plan->ring,
                     (unsigned long long)HEP_RING_VAL(e, d->next - g->plan->ring + 1),
                     (unsigned long long)load_acq(&words[B + (size_t)d->m]), d->peer, d->m);
        } else if (wait_q >= 0) {
            const int s = hep_slot_of(c->ns, g->node), from = c->ns * g->R + c->l;
            const uint64_t *fl = (const uint64_t *)mate_local(g, c->l, HEP_BUF_D_GROUP_FLAGS);
            snprintf(m, sizeof(m),
                     "rank %d waited %.0f ms (HEP_TIMEOUT_MS) for chunk %d of the dispatch rows "
                     "from rank %d (its slot at rank %d): expected %llu, saw %llu: rank %d "
                     "arrived at call %llu (its counts came) but this chunk did not arrive (it "
                     "may be waiting for a credit or a rank of its own node: its own timeout "
                     "names that one)",
                     g->rank, hep_now_ms() - last, wait_q, from, g->node * g->R + c->l,
                     (unsigned long long)HEP_RING_VAL(e, wait_q + 1),
                     (unsigned long long)load_acq(&fl[B + (size_t)s]), from,
                     (unsigned long long)load_acq(&fl[2 * (size_t)g->N + (size_t)s]));
        } else {
            snprintf(m, sizeof(m),
                     "rank %d waited %.0f ms (HEP_TIMEOUT_MS) for its node-mate rank %d to read "
                     "the dispatch rows from rank %d in its ring: rank %d did not read them",
                     g->rank, hep_now_ms() - last, g->node * g->R + lagger,
                     short_of * g->R + g->local, g->node * g->R + lagger);
        }
        return stream_abort(g, HEP_ERR_TIMEOUT, m);
    }
}

/* Across nodes the receive slots of a call are written by the peers of the other nodes,
 * with nothing that waits for this rank to have read the previous call's: between a
 * dispatch and a combine the other call's data dependency orders them (a peer cannot finish
 * the combine before this rank's partial sums, sent after its dispatch), but two calls of
 * one kind in a row (possible with handles) need that order made: a barrier. */
static int order_same_kind(hep_backend_ctx *g, int kind)
{
    int rc = HEP_OK, prev = g->last_call;
    g->last_call = kind;
    if (g->N > 1 && prev == kind) {
        rc = g->bs->barrier(g->bs->ctx);
        if (rc) {
            snprintf(g->broken_msg, sizeof(g->broken_msg), "%s", hep_last_error());
            g->broken = 1;
        }
    }
    return rc;
}

/* x: the options (never NULL); h: the handle to record into, or for reuse the one to read
 * (never NULL: the one-shot layout is g->own_handle). */
static int dispatch_ex(hep_backend_ctx *g, const hep_dispatch_args *a0, hep_dispatch_opts *x,
                       hep_handle *h, hep_dispatch_result *o)
{
    const int El = g->cfg->experts_per_rank, W = g->world;
    const int reuse = (a0->flags & HEP_REUSE_LAYOUT) != 0;
    uint64_t *mb = mailbox_of(g, g->local), e = g->epoch + 1;
    int *host_counts = (int *)hep_be_buf(g, HEP_BUF_HOST_COUNTS);
    int *base = (int *)hep_be_buf(g, HEP_BUF_HANDLE_META); /* my row base per source rank */
    int row = 0, kept, rc, tok = 0, slot = 0, bad;
    char warn[WARN_LEN] = "";
    long long val = 0;
    size_t copied = 0;
    hep_dispatch_args b;
    const hep_dispatch_args *a = a0;
    view mine;
    ring_peer *rp;
    int *lists;

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
    rp = calloc((size_t)g->N, sizeof(*rp));
    lists = malloc(sizeof(int) * (size_t)g->N * (size_t)(a->num_tokens ? a->num_tokens : 1));
    if (!rp || !lists) {
        free(rp), free(lists);
        return hep_fail(HEP_ERR_NOMEM, "dispatch: out of memory");
    }
    for (int m = 0; m < g->N; m++) {
        rp[m].m = m;
        rp[m].peer = m * g->R + g->local;
        rp[m].j = hep_slot_of(m, g->node);
        rp[m].s = hep_slot_of(g->node, m);
        rp[m].list = lists + (size_t)m * (size_t)(a->num_tokens ? a->num_tokens : 1);
        rp[m].final = m == g->node;
    }
    __atomic_store_n(flags_of(g, g->local) + HEP_FLAG_COUNTS_READY, e, __ATOMIC_RELEASE);
    rc = g->N > 1 ? dispatch_announce(g, a, e, rp) : HEP_OK;
    if (rc == HEP_OK)
        rc = wait_mates(g, HEP_FLAG_COUNTS_READY, e, "its routing to be published");
    if (rc == HEP_OK && g->N > 1)
        rc = wait_counts(g, e, rp);
    g->recv_limit = 0;
    h->drop_words[HEP_OVERFLOW_DROPPED] = h->drop_words[HEP_OVERFLOW_ROWS] = 0;
    if (rc == HEP_OK && g->cfg->max_recv_rows)
        rc = agree_capacity(g, e, /* a reuse overflows only with a layout that dropped */
                            ((a->flags & HEP_ASYNC) || reuse) &&
                                h->layout == HEP_LAYOUT_RANK_MAJOR,
                            h, warn);
    if (rc == HEP_OK && h->layout == HEP_LAYOUT_EXPERT_MAJOR) {
        g->row_experts = malloc(sizeof(int) * (g->plan->max_recv_rows ? g->plan->max_recv_rows : 1) *
                                (size_t)g->cfg->max_topk);
        if (!g->row_experts)
            rc = hep_fail(HEP_ERR_NOMEM, "dispatch: out of memory");
    }
    if (rc == HEP_OK && g->N > 1)
        rc = dispatch_stream(g, e, rp);
    memset(host_counts, 0, (size_t)(El + 1) * sizeof(int));
    if (rc == HEP_OK) {
        pull c;
        memset(&c, 0, sizeof(c));
        rc = dispatch_loop(g, a, e, rp, &c, host_counts + 1, !reuse, h);
        if (rc == HEP_OK && g->N > 1 && (rc = hep_proxy_wait(g->proxy))) {
            snprintf(g->broken_msg, sizeof(g->broken_msg), "%s", hep_last_error());
            g->broken = 1;
        }
        row = c.row;
    }
    free(rp);
    free(lists);
    if (rc) {
        free(g->row_experts);
        g->row_experts = NULL;
        return rc;
    }
    kept = g->recv_limit && row > g->recv_limit ? g->recv_limit : row;
    g->recv_limit = 0;
    h->drop_words[HEP_OVERFLOW_NEEDED] = row;
    host_counts[0] = kept;
    base[W] = kept;
    own_view(g, g->local, &mine);
    bad = first_invalid(g, &mine, &tok, &slot, &val);
    record_ids(g, &mine);
    if (h->layout == HEP_LAYOUT_EXPERT_MAJOR) { /* the sources are still readable here */
        copied = permute(g, h, host_counts + 1, x);
        if (copied == (size_t)-1)
            rc = hep_fail(HEP_ERR_NOMEM, "dispatch: out of memory");
        free(g->row_experts);
        g->row_experts = NULL;
    } else {
        copied = copy_out(g, kept, x);
    }
    if (!reuse) {
        h->epoch = 0; /* until recorded below */
        record(g, h, a, e, kept);
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
    g->last_recv = kept;
    g->last_handle = 0; /* the one-shot value: set by host_dispatch */
    g->copy_bytes += copied;
    hep_fill_dispatch_result(g, o);
    o->num_recv_device = host_counts;
    o->tokens_per_expert_device = host_counts + 1;
    /* as documented for HEP_ASYNC (and as the GPU path does): counts only in the buffers */
    o->num_recv = a->flags & HEP_ASYNC ? -1 : kept;
    o->overflow_device = h->drop_words;
    x->copy_bytes = copied;
    x->num_permuted = h->layout == HEP_LAYOUT_EXPERT_MAJOR ? h->num_permuted : kept;
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
    if (warn[0] && !reuse) /* rows were dropped: the dispatch happened (a reuse of that
                              layout drops the same rows, as on the GPU, without a word) */
        return hep_fail(HEP_WARN_IGNORED, "%s", warn);
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
    float *pout;      /* [E] the current token's probs_out row, or NULL ... */
    int pout_node;    /* ... or (1) its [R][El] part of this node, a partial sum's */
} combine_ctx;

/* acc[0..H) += the rows of token i of v (from source rank src) at the node-mates that
 * received it, ascending local rank, and within an expert-major node-mate ascending local
 * expert; the probabilities of those rows into c->pout. */
static void add_node_share(hep_backend_ctx *g, const view *v, int i, int src, combine_ctx *c,
                           float *acc)
{
    const int H = g->cfg->hidden, El = g->cfg->experts_per_rank;
    for (int l = 0; l < g->R; l++) {
        int d = g->node * g->R + l, es[32], n, pd = c->pout_node ? l : d;
        const int *mbase = (const int *)mate_local(g, l, HEP_BUF_HANDLE_META);
        const hep_handle *mh =
            g->shm ? NULL : (const hep_handle *)(uintptr_t)mailbox_of(g, l)[HEP_MB_HANDLE];
        const float *pin;
        const uint16_t *rows, *x;
        hep_shm_comb mc; /* the mate's layout: its handle's (one process) or as published */
        if (!needs_rank(g, v, i, d))
            continue;
        n = local_experts(g, v, i, d, es);
        if (g->shm) {
            hep_shm_mate_combine(g, l, &mc);
            hep_shm_mate_input(g, l, &rows, &pin);
        } else {
            rows = (const uint16_t *)(uintptr_t)mailbox_of(g, l)[HEP_MB_COMBINE_IN];
            pin = (const float *)(uintptr_t)mailbox_of(g, l)[HEP_MB_PROBS_IN];
            mc.layout = mh ? mh->layout : HEP_LAYOUT_RANK_MAJOR;
            mc.budget = mh ? mh->budget : 0;
            mc.ebase = mh ? mh->ebase : NULL;
        }
        if (mc.layout != HEP_LAYOUT_EXPERT_MAJOR) {
            size_t j = (size_t)(mbase[src] + c->next[l]++);
            if (j >= g->plan->max_recv_rows)
                continue; /* dropped at dispatch (HEP_ASYNC past the capacity): nothing */
            x = rows + j * (size_t)H;
            for (int ch = 0; ch < H; ch++)
                acc[ch] += bf16_f32(x[ch]);
            for (int q = 0; c->pout && pin && q < n; q++)
                c->pout[(size_t)pd * (size_t)El + (size_t)es[q]] = pin[j * (size_t)El + (size_t)es[q]];
            continue;
        }
        for (int q = 0; q < n; q++) {
            int *en = &c->enext[(size_t)l * (size_t)El + (size_t)es[q]];
            long long p = (long long)mc.ebase[(size_t)src * (size_t)El + (size_t)es[q]] + (*en)++;
            if (p >= mc.budget)
                continue; /* dropped at dispatch: contributes nothing */
            x = rows + (size_t)p * (size_t)H;
            for (int ch = 0; ch < H; ch++)
                acc[ch] += bf16_f32(x[ch]);
            if (c->pout && pin)
                c->pout[(size_t)pd * (size_t)El + (size_t)es[q]] = pin[p];
        }
    }
}

/* Combine across nodes (the rings of "the inter-node rings", with the combine's own
 * count e): as the peer of each other node m, the partial sums of m's slot here, chunk by
 * chunk into combine.rdma_intra_node_red_token (position k % P of slot j(m)), each once
 * m's peer freed chunk k - P; and this rank's own tokens in order, each once the chunks of
 * its partial sums from every node it needs landed; this rank is the only reader of its
 * partial-sum rings, so it frees each chunk as soon as it read its last token.
 *
 * Probabilities through combine travel with the partial sums: a partial sum's token also
 * gets its node's [R][E_l] f32 probabilities (the value of each node-mate's row for each
 * local expert the token chose there, 0 elsewhere) in the same ring position of
 * combine.rdma_intra_node_red_prob, sent as one more data write of the same chunk, before
 * the chunk's flag. So they need no flag, credit, ring or wait of their own: they land,
 * are read and are freed with the rows they belong to (a ring of their own would add a
 * flag and a credit per chunk, and a second set of waits that could only ever be ready
 * together with the first). A peer sends them when any of its node-mates gave probs_in
 * (the rows of a mate without it give 0, as within one node), and says so in the first
 * word of its count block in the receiver's combine.rdma_inter_node_group_flags (the
 * combine's count e; combine uses no count block), written ahead of chunk 0's flag: a
 * receiver that asks for probabilities reads that word once chunk 0 landed and takes 0
 * for that node's experts when it does not hold e. */
typedef struct combine_run {
    const hep_handle *h;
    view mine;             /* this rank's recorded routing */
    ring_peer *rp;
    combine_ctx *cx;       /* [N]: per other node, its slot's running positions */
    combine_ctx own;
    float *acc;
    const hep_combine_opts *co;
    void *out;
    const void *in;        /* this rank's expert outputs (combine_rounds) */
    int next_tok;          /* this rank's next token to sum */
} combine_run;

static int partial_step(hep_backend_ctx *g, uint64_t e, combine_run *r)
{
    const size_t S = g->plan->slot_tokens, H = (size_t)g->cfg->hidden, T = (size_t)g->cfg->max_tokens;
    const size_t kmax = (size_t)g->cfg->max_topk, B = ring_base(g);
    const int P = g->plan->ring, C = g->plan->chunk;
    uint64_t *words = (uint64_t *)hep_be_buf(g, HEP_BUF_C_OUT_FLAGS);
    uint16_t *red = (uint16_t *)hep_be_buf(g, HEP_BUF_C_RED_TOKEN);
    float *red_prob = (float *)hep_be_buf(g, HEP_BUF_C_RED_PROB);
    const size_t En = (size_t)g->R * (size_t)g->cfg->experts_per_rank;
    int did = 0;
    for (int m = 0; m < g->N; m++) {
        ring_peer *d = &r->rp[m];
        view v;
        if (m == g->node)
            continue;
        memset(&v, 0, sizeof(v)); /* that slot's routing as the handle's dispatch saw it */
        v.slot = 1;
        v.kmax = (int)kmax;
        v.t = d->cnt;
        v.ids = r->h->slot_ids + (size_t)m * T * kmax;
        while (d->next < d->nk &&
               (d->next < P || chunks_in(load_acq(&words[B + (size_t)m]), e) >= d->next - P + 1)) {
            const int end = (d->next + 1) * C < d->cnt ? (d->next + 1) * C : d->cnt;
            for (int k = d->next * C; k < end; k++) {
                const size_t row = (size_t)d->j * S + ring_row(g, (size_t)k);
                uint16_t *o = red + row * H;
                r->cx[m].pout = d->send_probs ? red_prob + row * En : NULL;
                r->cx[m].pout_node = 1;
                if (r->cx[m].pout)
                    memset(r->cx[m].pout, 0, En * sizeof(float));
                acc_clear(r->acc, H);
                add_node_share(g, &v, k, d->peer, &r->cx[m], r->acc);
                for (size_t c = 0; c < H; c++)
                    o[c] = f32_bf16(r->acc[c]);
            }
            __atomic_store_n(&words[src_word(g, m, d->next % P)], HEP_RING_VAL(e, d->next + 1),
                             __ATOMIC_RELEASE);
            d->next++;
            did = 1;
        }
        if (d->next == d->nk && !d->final) {
            words[m] = (uint64_t)d->cnt;
            __atomic_store_n(&words[g->N + m], e, __ATOMIC_RELEASE);
            d->final = 1;
            did = 1;
        }
    }
    return did;
}

/* Sum this rank's next tokens whose partial sums all landed; *wait_m: the node it waits for. */
static int sum_step(hep_backend_ctx *g, uint64_t e, combine_run *r, int *wait_m)
{
    const size_t S = g->plan->slot_tokens, H = (size_t)g->cfg->hidden;
    const size_t E = (size_t)g->cfg->experts_per_rank * (size_t)g->world, B = ring_base(g);
    const int C = g->plan->chunk;
    uint64_t *in = (uint64_t *)hep_be_buf(g, HEP_BUF_C_GROUP_FLAGS);
    const uint16_t *parts = (const uint16_t *)hep_be_buf(g, HEP_BUF_C_GROUP_TOKEN);
    const float *part_probs = (const float *)hep_be_buf(g, HEP_BUF_C_GROUP_PROB);
    const size_t En = (size_t)g->R * (size_t)g->cfg->experts_per_rank;
    int did = 0;
    *wait_m = -1;
    for (; r->next_tok < g->last_t; r->next_tok++) {
        const int i = r->next_tok;
        uint16_t *out = (uint16_t *)r->out + (size_t)i * H;
        for (int m = 0; m < g->N; m++)
            if (m != g->node && needs_node(g, &r->mine, i, m) &&
                chunks_in(load_acq(&in[B + (size_t)r->rp[m].j]), e) < r->rp[m].got / C + 1) {
                *wait_m = m;
                return did;
            }
        r->own.pout = r->co->probs_out ? r->co->probs_out + (size_t)i * E : NULL;
        if (r->own.pout)
            memset(r->own.pout, 0, E * sizeof(float));
        acc_clear(r->acc, H);
        add_node_share(g, &r->mine, i, g->rank, &r->own, r->acc);
        for (int m = 0; m < g->N; m++) {
            ring_peer *d = &r->rp[m];
            const uint16_t *p;
            if (m == g->node || !needs_node(g, &r->mine, i, m))
                continue;
            p = parts + ((size_t)d->j * S + ring_row(g, (size_t)d->got)) * H;
            for (size_t c = 0; c < H; c++)
                r->acc[c] += bf16_f32(p[c]);
            if (r->own.pout && d->recv_probs < 0) /* chunk 0 landed: so did the word */
                d->recv_probs = load_acq(&in[cb_at(g, d->j)]) == e;
            if (r->own.pout && d->recv_probs) /* m's experts: [R][El] from global m R El */
                memcpy(r->own.pout + (size_t)m * En,
                       part_probs + ((size_t)d->j * S + ring_row(g, (size_t)d->got)) * En,
                       En * sizeof(float));
            d->got++;
            if ((d->got % C == 0 || d->got == d->in_cnt) && !g->hold_credits)
                __atomic_store_n(&in[B + (size_t)g->N + (size_t)d->j],
                                 HEP_RING_VAL(e, (d->got + C - 1) / C), __ATOMIC_RELEASE);
        }
        for (size_t c = 0; c < H; c++)
            out[c] = f32_bf16(r->acc[c]);
        did = 1;
    }
    return did;
}

/* The batch of the partial sums: each chunk's rows (and probabilities) then its flag,
 * each slot's count and flag, then the credits this rank owes for the partial sums it
 * receives. With probabilities, the word that says so goes ahead of chunk 0's data. */
static int combine_stream(hep_backend_ctx *g, uint64_t e, const ring_peer *rp)
{
    const size_t S = g->plan->slot_tokens, rb2 = (size_t)g->cfg->hidden * 2;
    const size_t C = (size_t)g->plan->chunk, B = ring_base(g);
    const size_t pb = (size_t)g->R * (size_t)g->cfg->experts_per_rank * sizeof(float);
    const int P = g->plan->ring, N = g->N;
    uint64_t *words = (uint64_t *)hep_be_buf(g, HEP_BUF_C_OUT_FLAGS);
    uint64_t *in = (uint64_t *)hep_be_buf(g, HEP_BUF_C_GROUP_FLAGS);
    hep_proxy_chunk *ch = ring_chunk_list(g, rp, 4, "combine");
    int n = 0, rc;
    if (!ch)
        return HEP_ERR_NOMEM;
    for (int m = 0; m < N; m++) {
        const ring_peer *d = &rp[m];
        if (m == g->node)
            continue;
        if (d->send_probs && d->nk > 0) { /* stored before chunk 0 can be ready */
            __atomic_store_n(&words[cb_at(g, m)], e, __ATOMIC_RELEASE);
            ch[n] = hep_wire_chunk(g, d->peer, HEP_BUF_C_OUT_FLAGS, cb_at(g, m) * 8,
                                   HEP_BUF_C_GROUP_FLAGS, cb_at(g, d->s) * 8, 8,
                                   words + src_word(g, m, 0));
            ch[n++].want = HEP_RING_VAL(e, 1);
        }
        for (int k = 0; k < d->nk; k++) {
            const size_t p = (size_t)(k % P), rows = chunk_rows(d->cnt, k, C);
            const uint64_t want = HEP_RING_VAL(e, k + 1);
            ch[n] = hep_wire_chunk(g, d->peer, HEP_BUF_C_RED_TOKEN, ((size_t)d->j * S + p * C) * rb2,
                                   HEP_BUF_C_GROUP_TOKEN, ((size_t)d->s * S + p * C) * rb2,
                                   rows * rb2, words + src_word(g, m, (int)p));
            ch[n++].want = want;
            if (d->send_probs) {
                ch[n] = hep_wire_chunk(g, d->peer, HEP_BUF_C_RED_PROB,
                                       ((size_t)d->j * S + p * C) * pb, HEP_BUF_C_GROUP_PROB,
                                       ((size_t)d->s * S + p * C) * pb, rows * pb,
                                       words + src_word(g, m, (int)p));
                ch[n++].want = want;
            }
            ch[n++] = hep_wire_flag(g, d->peer, HEP_BUF_C_OUT_FLAGS, src_word(g, m, (int)p),
                                    HEP_BUF_C_GROUP_FLAGS, B + (size_t)d->s, want);
        }
        ch[n++] = hep_wire_count_then_flag(g, d->peer, HEP_BUF_C_OUT_FLAGS, HEP_BUF_C_GROUP_FLAGS,
                                           m, d->s, words + N + m);
    }
    for (int m = 0; m < N; m++) /* after all data: a flag never waits behind a credit */
        for (int k = 0; m != g->node && !g->hold_credits && k < rp[m].in_nk - P; k++) {
            ch[n] = hep_wire_chunk(g, rp[m].peer, HEP_BUF_C_GROUP_FLAGS,
                                   (B + (size_t)N + (size_t)rp[m].j) * 8, HEP_BUF_C_OUT_FLAGS,
                                   (B + (size_t)g->node) * 8, 8, in + B + N + rp[m].j);
            ch[n++].want = HEP_RING_VAL(e, k + 1);
        }
    rc = hep_proxy_submit(g->proxy, ch, n, e);
    free(ch);
    return rc;
}

static int combine_loop(hep_backend_ctx *g, uint64_t e, combine_run *r)
{
    const double limit = (double)hep_env_get()->timeout_ms;
    const size_t B = ring_base(g);
    double last = hep_now_ms();
    uint64_t *words = (uint64_t *)hep_be_buf(g, HEP_BUF_C_OUT_FLAGS);
    const uint64_t *in = (const uint64_t *)hep_be_buf(g, HEP_BUF_C_GROUP_FLAGS);
    char msg[1024];
    for (;;) {
        int wait_m, packing = -1, moved = partial_step(g, e, r);
        moved |= sum_step(g, e, r, &wait_m);
        for (int m = 0; m < g->N && packing < 0; m++)
            if (m != g->node && !r->rp[m].final)
                packing = m;
        if (packing < 0 && r->next_tok >= g->last_t)
            return HEP_OK;
        if (moved) {
            last = hep_now_ms();
            continue;
        }
        if (hep_now_ms() - last <= limit) {
            sched_yield();
            continue;
        }
        if (packing >= 0) {
            const ring_peer *d = &r->rp[packing];
            snprintf(msg, sizeof(msg),
                     "rank %d waited %.0f ms (HEP_TIMEOUT_MS) for a credit from rank %d: chunk %d "
                     "of its partial sums for node %d needs chunk %d freed, expected %llu, saw "
                     "%llu: rank %d did not free it",
                     g->rank, hep_now_ms() - last, d->peer, d->next, d->m, d->next - g->plan->ring,
                     (unsigned long long)HEP_RING_VAL(e, d->next - g->plan->ring + 1),
                     (unsigned long long)load_acq(&words[B + (size_t)d->m]), d->peer);
        } else {
            const ring_peer *d = &r->rp[wait_m];
            const uint64_t came = load_acq(&in[2 * (size_t)g->N + (size_t)d->j]);
            char why[256];
            if (came >= e)
                snprintf(why, sizeof(why),
                         "rank %d arrived at call %llu (its arrival word came over the network) "
                         "but this chunk did not arrive (it may be waiting for a rank of its own "
                         "node: its own timeout names that one)",
                         d->peer, (unsigned long long)came);
            else
                snprintf(why, sizeof(why), "rank %d did not arrive", d->peer);
            snprintf(msg, sizeof(msg),
                     "rank %d waited %.0f ms (HEP_TIMEOUT_MS) for chunk %d of its partial sums "
                     "from rank %d: expected %llu, saw %llu: %s",
                     g->rank, hep_now_ms() - last, d->got / g->plan->chunk, d->peer,
                     (unsigned long long)HEP_RING_VAL(e, d->got / g->plan->chunk + 1),
                     (unsigned long long)load_acq(&in[B + (size_t)d->j]), why);
        }
        return stream_abort(g, HEP_ERR_TIMEOUT, msg);
    }
}

/* One node across processes (g->shm, N = 1): a node-mate's input cannot be read where its
 * caller keeps it, so it passes through its exchange.token (and dispatch.recv_prob), at
 * most max_recv_rows rows a round: node-mate by node-mate in local-rank order, each
 * mate's rows in ascending order. Every rank keeps an f32 sum per own token and adds, in
 * each round, the rows of that round it needs: per token that is node-mate by node-mate,
 * and within an expert-major one ascending local expert (its blocks are in expert order,
 * so ascending row), the order of add_node_share, so the sums are the same bits. */
static int combine_rounds(hep_backend_ctx *g, combine_run *r)
{
    const int El = g->cfg->experts_per_rank, t = g->last_t, cap = (int)g->plan->max_recv_rows;
    const size_t H = (size_t)g->cfg->hidden;
    const size_t E = (size_t)El * (size_t)g->world;
    float *acc = malloc(sizeof(float) * H * (size_t)(t > 0 ? t : 1));
    int *en = malloc(sizeof(int) * (size_t)El);
    int rc = HEP_OK;
    if (!acc || !en) {
        free(acc), free(en);
        return hep_fail(HEP_ERR_NOMEM, "combine: out of memory");
    }
    for (int i = 0; i < t; i++) {
        acc_clear(acc + (size_t)i * H, H);
        if (r->co->probs_out)
            memset(r->co->probs_out + (size_t)i * E, 0, E * sizeof(float));
    }
    for (int l = 0; l < g->R && rc == HEP_OK; l++) {
        const int d = g->node * g->R + l;
        const int *mbase = (const int *)mate_local(g, l, HEP_BUF_HANDLE_META);
        const uint16_t *rows = (const uint16_t *)hep_be_peer_buf(g, l, HEP_BUF_TOKEN_X);
        const float *pin = (const float *)hep_be_peer_buf(g, l, HEP_BUF_RECV_PROB);
        hep_shm_comb mc;
        hep_shm_mate_combine(g, l, &mc);
        for (int lo = 0; lo < mc.rows && rc == HEP_OK; lo += cap) {
            const int n = mc.rows - lo < cap ? mc.rows - lo : cap;
            const int em = mc.layout == HEP_LAYOUT_EXPERT_MAJOR;
            const uint64_t v = ++g->shm_rounds;
            int next = 0;
            if (l == g->local) {
                hep_shm_stage_round(g, r->in, r->co->probs_in, em ? 1 : El, lo, n);
                __atomic_store_n(flags_of(g, g->local) + HEP_FLAG_HOST_ROUND, v, __ATOMIC_RELEASE);
            }
            rc = wait_ge(g, flags_of(g, l) + HEP_FLAG_HOST_ROUND, v, d,
                         "a round of its expert outputs", NULL);
            if (rc)
                break;
            memset(en, 0, sizeof(int) * (size_t)El);
            for (int i = 0; i < t; i++) {
                float *a = acc + (size_t)i * H, *pout;
                int es[32], ne;
                if (!needs_rank(g, &r->mine, i, d))
                    continue;
                pout = r->co->probs_out ? r->co->probs_out + (size_t)i * E + (size_t)d * El : NULL;
                ne = local_experts(g, &r->mine, i, d, es);
                if (!em) {
                    const int j = mbase[g->rank] + next++;
                    if (j < lo || j >= lo + n)
                        continue;
                    for (size_t c = 0; c < H; c++)
                        a[c] += bf16_f32(rows[(size_t)(j - lo) * H + c]);
                    for (int q = 0; pout && mc.probs && q < ne; q++)
                        pout[es[q]] = pin[(size_t)(j - lo) * (size_t)El + (size_t)es[q]];
                    continue;
                }
                for (int q = 0; q < ne; q++) {
                    long long p = (long long)mc.ebase[(size_t)g->rank * (size_t)El + (size_t)es[q]] +
                                  en[es[q]]++;
                    if (p >= mc.budget || p < lo || p >= lo + n)
                        continue; /* dropped at dispatch, or another round's */
                    for (size_t c = 0; c < H; c++)
                        a[c] += bf16_f32(rows[(size_t)(p - lo) * H + c]);
                    if (pout && mc.probs)
                        pout[es[q]] = pin[p - lo];
                }
            }
            __atomic_store_n(flags_of(g, g->local) + HEP_FLAG_HOST_ROUND_READ, v, __ATOMIC_RELEASE);
            rc = wait_mates(g, HEP_FLAG_HOST_ROUND_READ, v, "the node-mates to read a round");
        }
    }
    for (int i = 0; rc == HEP_OK && i < t; i++) {
        uint16_t *out = (uint16_t *)r->out + (size_t)i * H;
        for (size_t c = 0; c < H; c++)
            out[c] = f32_bf16(acc[(size_t)i * H + c]);
    }
    free(acc), free(en);
    return rc;
}

/* co->handle: the layout to combine with. */
static int combine_ex(hep_backend_ctx *g, const hep_combine_args *a, const hep_combine_opts *co)
{
    const size_t H = (size_t)g->cfg->hidden, kmax = (size_t)g->cfg->max_topk;
    const hep_handle *h = co->handle;
    const uint64_t e = ++g->combine_epoch; /* combines repeat a dispatch: their own count */
    uint64_t *words = (uint64_t *)hep_be_buf(g, HEP_BUF_C_OUT_FLAGS);
    float *acc = malloc(sizeof(float) * H);
    hep_proxy_chunk *ch = malloc(sizeof(hep_proxy_chunk) * (size_t)g->N);
    ring_peer *rp = calloc((size_t)g->N, sizeof(*rp));
    combine_ctx cx, *cxs = calloc((size_t)g->N, sizeof(*cxs));
    int mates_probs = 0; /* N > 1: a node-mate sends probabilities back (combine_run) */
    int *enexts = calloc((size_t)g->N * (size_t)g->R * (size_t)g->cfg->experts_per_rank, sizeof(int));
    int n = 0, rc;
    uint64_t *mb = mailbox_of(g, g->local);

    memset(&cx, 0, sizeof(cx));
    if ((rc = order_same_kind(g, 2))) {
        free(acc), free(ch), free(rp), free(cxs), free(enexts);
        return rc;
    }
    cx.enext = calloc((size_t)g->R * (size_t)g->cfg->experts_per_rank, sizeof(int));
    if (!acc || !ch || !rp || !cxs || !enexts || !cx.enext) {
        free(acc), free(ch), free(rp), free(cxs), free(enexts), free(cx.enext);
        return hep_fail(HEP_ERR_NOMEM, "combine: out of memory");
    }
    /* the handle's layout where node-mates read it (the group's buffers hold the last
     * dispatch's, which may be another handle's) */
    memcpy(hep_be_buf(g, HEP_BUF_HANDLE_META), h->base, sizeof(int) * (size_t)(g->world + 1));
    memcpy(hep_be_buf(g, HEP_BUF_HANDLE_IDS), h->ids, sizeof(int) * (size_t)h->t * kmax);
    g->last_t = h->t;
    g->last_recv = h->recv;
    mb[HEP_MB_COMBINE_IN] =
        (uint64_t)(uintptr_t)(a->expert_out ? a->expert_out : hep_be_buf(g, HEP_BUF_TOKEN_X));
    mb[HEP_MB_HANDLE] = (uint64_t)(uintptr_t)h;
    mb[HEP_MB_PROBS_IN] = (uint64_t)(uintptr_t)co->probs_in;
    if (g->shm && g->N == 1) { /* across processes: in rounds (combine_rounds) */
        hep_shm_comb mc;
        mc.layout = h->layout;
        mc.rows = h->layout == HEP_LAYOUT_EXPERT_MAJOR ? h->num_permuted : h->recv;
        mc.budget = h->budget;
        mc.probs = co->probs_in != NULL;
        mc.staged = 0; /* rounds through exchange.token */
        mc.ebase = h->ebase;
        hep_shm_publish_combine(g, &mc);
    } else if (g->shm) { /* across processes node-mates read this rank's exchange.token
                            * and, with probs_in, its dispatch.recv_prob, all rows at once
                            * (expert-major rows past max_recv_rows: in the expert-major
                            * staging, whose rows group/ep.c checked the budget against) */
        const int em = h->layout == HEP_LAYOUT_EXPERT_MAJOR;
        hep_shm_comb mc;
        mc.layout = h->layout;
        mc.rows = em ? h->num_permuted : h->recv;
        mc.budget = h->budget;
        mc.ebase = h->ebase;
        hep_shm_stage_combine_all(g, a->expert_out, co->probs_in, mc.rows,
                                  (size_t)mc.rows * (size_t)(em ? 1 : g->cfg->experts_per_rank),
                                  &mc);
        hep_shm_publish_combine(g, &mc);
    }
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
    /* 1. the rings: partial sums out as the peer of every other node, this rank's own
     * tokens (its node's share, then the other nodes' partial sums in node order) in */
    if (rc == HEP_OK) {
        combine_run r;
        memset(&r, 0, sizeof(r));
        r.h = h;
        r.rp = rp;
        r.cx = cxs;
        r.own = cx;
        r.acc = acc;
        r.co = co;
        r.out = a->out;
        r.in = a->expert_out ? a->expert_out : hep_be_buf(g, HEP_BUF_TOKEN_X);
        recorded_view(g, &r.mine);
        for (int l = 0; l < g->R; l++) { /* published since its COMBINE_READY */
            const uint16_t *rows;
            const float *pin = NULL;
            if (g->shm)
                hep_shm_mate_input(g, l, &rows, &pin);
            mates_probs |= g->shm ? pin != NULL : mailbox_of(g, l)[HEP_MB_PROBS_IN] != 0;
        }
        for (int m = 0; m < g->N; m++) {
            rp[m].m = m;
            rp[m].peer = m * g->R + g->local;
            rp[m].j = hep_slot_of(m, g->node);
            rp[m].s = hep_slot_of(g->node, m);
            rp[m].final = m == g->node;
            if (m == g->node)
                continue;
            rp[m].cnt = h->slot_t[m];
            rp[m].nk = chunks_of(g, rp[m].cnt);
            rp[m].send_probs = mates_probs;
            rp[m].recv_probs = -1;
            for (int i = 0; i < g->last_t; i++)
                rp[m].in_cnt += needs_node(g, &r.mine, i, m);
            rp[m].in_nk = chunks_of(g, rp[m].in_cnt);
            cxs[m].enext = enexts + (size_t)m * (size_t)g->R * (size_t)g->cfg->experts_per_rank;
        }
        if (g->N > 1)
            rc = combine_stream(g, e, rp);
        if (rc == HEP_OK)
            rc = g->shm && g->N == 1 ? combine_rounds(g, &r) : combine_loop(g, e, &r);
        if (rc == HEP_OK && g->N > 1 && (rc = hep_proxy_wait(g->proxy))) {
            snprintf(g->broken_msg, sizeof(g->broken_msg), "%s", hep_last_error());
            g->broken = 1;
        }
    }
    free(acc), free(ch), free(rp), free(cxs), free(enexts), free(cx.enext);
    if (rc)
        return rc;
    __atomic_store_n(flags_of(g, g->local) + DONE_COMBINE, e, __ATOMIC_RELEASE);
    return wait_mates(g, DONE_COMBINE, e, "the node-mates to finish reading");
}

/* The backend's calls (backend/backend.h). */
static int host_setup(hep_backend_ctx *g)
{
    ((uint64_t *)hep_be_buf(g, HEP_BUF_MAILBOX))[HEP_MB_LOCAL] =
        (uint64_t)(uintptr_t)g->arena[HEP_ARENA_LOCAL];
    return HEP_OK;
}

static void host_teardown(hep_backend_ctx *g)
{
    (void)g;
}

static int host_dispatch(hep_backend_ctx *g, const hep_dispatch_args *a, hep_dispatch_opts *x,
                         hep_handle *h, hep_dispatch_result *o)
{
    hep_dispatch_opts none;
    int rc;
    if (!x) {
        memset(&none, 0, sizeof(none));
        x = &none;
    }
    rc = dispatch_ex(g, a, x, h ? h : g->own_handle, o);
    if (!h && (rc == HEP_OK || rc == HEP_WARN_IGNORED))
        o->handle = g->last_handle = hep_handle_of(g, g->epoch); /* the one-shot value */
    return rc;
}

/* c->handle given: that layout (h is the same handle); else the one-shot layout, with c's
 * probabilities when c is given. */
static int host_combine(hep_backend_ctx *g, const hep_combine_args *a, const hep_handle *h,
                        const hep_combine_opts *c)
{
    hep_combine_opts one_shot;
    (void)h;
    if (c && c->handle)
        return combine_ex(g, a, c);
    /* the one-shot layout, with the caller's probabilities if any */
    if (c)
        one_shot = *c;
    else
        memset(&one_shot, 0, sizeof(one_shot));
    one_shot.handle = g->own_handle;
    return combine_ex(g, a, &one_shot);
}

static int host_sync(hep_backend_ctx *g, void *stream)
{
    (void)stream;
    return g->broken ? hep_fail(HEP_ERR_TIMEOUT, "%s", g->broken_msg) : HEP_OK;
}

const hep_backend_ops hep_host_backend = {
    .name = "host",
    .setup = host_setup,
    .teardown = host_teardown,
    .handle_alloc = NULL,
    .dispatch = host_dispatch,
    .combine = host_combine,
    .sync = host_sync,
    .fill_stats = NULL,
};
