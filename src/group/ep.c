/* group/ep.c: hep_dispatch / hep_combine: argument checks, then the GPU kernels or the
 * host backend; synchronous calls wait and turn a kernel's timeout record into a status. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/core.h"
#include "group/group.h"
#include "kernels/ep_kernels.h"
#include "net/proxy.h"

static const char *stage_name(int s)
{
    return s == HEP_STAGE_PREPROCESS       ? "dispatch layout (routing counts)"
           : s == HEP_STAGE_DISPATCH        ? "dispatch (rows arriving)"
           : s == HEP_STAGE_COMBINE         ? "combine (expert outputs ready)"
           : s == HEP_STAGE_NODE_DISPATCH   ? "dispatch (another node's tokens over the network)"
           : s == HEP_STAGE_NODE_COMBINE    ? "combine (another node's partial sums over the network)"
                                            : "?";
}

/* Point the kernels' layout (positions, row bases, counts, overflow word) at handle h's
 * device memory, or (NULL) at the group's own buffers: handle.dest_rows, and in handle.meta
 * [0, N x R) the row bases, then the counters (8-byte aligned, set in hep_ep_setup), the
 * overflow word, the count, the tokens per expert, the work counters. */
static void use_layout(hep_group *g, const hep_handle *h)
{
    hep_kargs *k = g->kargs;
    if (h) {
        k->dest_rows = h->d_rows;
        k->meta = h->d_meta;
        k->recv_count = h->d_counts;
        k->over = h->d_counts + 1;
        k->tokens_per_expert = h->d_counts + 2;
        return;
    }
    k->dest_rows = (int *)hep_my_buf(g, HEP_BUF_HANDLE_ROWS);
    k->meta = (int *)hep_my_buf(g, HEP_BUF_HANDLE_META);
    k->over = k->meta + ((g->world + 1) & ~1) + 2 * 9; /* after the 9 u64 counters */
    k->recv_count = k->over + 1;
    k->tokens_per_expert = k->recv_count + 1;
}

int hep_ep_setup(hep_group *g)
{
    hep_kargs *k;
    if (g->cfg.backend != HEP_BACKEND_GPU) {
        if (g->R > 64)
            return hep_fail(HEP_ERR_INVALID,
                            "the host backend supports up to 64 ranks per node, not %d", g->R);
        ((uint64_t *)hep_my_buf(g, HEP_BUF_MAILBOX))[HEP_MB_LOCAL] =
            (uint64_t)(uintptr_t)g->arena[HEP_ARENA_LOCAL];
        g->own_handle = hep_handle_alloc(g);
        if (!g->own_handle)
            return hep_fail(HEP_ERR_NOMEM, "group: out of memory for the dispatch layout");
        if (g->N > 1)
            return hep_proxy_create(g->coord->net, &g->proxy);
        return HEP_OK;
    }
    if (g->N > 1 && g->cfg.max_recv_rows)
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "config.max_recv_rows = %d: the GPU kernels check a receive capacity with "
                        "one node only, not across %d nodes (use 0, the worst case, or the host "
                        "backend)",
                        g->cfg.max_recv_rows, g->N);
    if (g->R > HEP_GPU_MAX_LOCAL)
        return hep_fail(HEP_ERR_INVALID, "the GPU kernels support up to %d ranks per node, not %d",
                        HEP_GPU_MAX_LOCAL, g->R);
    if (g->N > HEP_GPU_MAX_NODES)
        return hep_fail(HEP_ERR_INVALID, "the GPU kernels support up to %d nodes, not %d",
                        HEP_GPU_MAX_NODES, g->N);
    if (hep_dispatch_smem(g->R, g->cfg.experts_per_rank) > 200 * 1024)
        return hep_fail(HEP_ERR_INVALID,
                        "ranks_per_node x (experts_per_rank + 1) = %d x %d counters exceed the "
                        "dispatch kernel's shared memory",
                        g->R, g->cfg.experts_per_rank + 1);
    if (g->N > 1 && hep_node_pack_smem(g->N, g->R, g->cfg.experts_per_rank) > 200 * 1024)
        return hep_fail(HEP_ERR_INVALID,
                        "world x (experts_per_rank + 1) = %d x %d counters exceed the inter-node "
                        "pack kernel's shared memory",
                        g->world, g->cfg.experts_per_rank + 1);
    {
        int e = hep_kernels_preload();
        if (e)
            return hep_fail(HEP_ERR_CUDA, "loading the dispatch/combine kernels on GPU %d: %s",
                            g->device, cudaGetErrorString((cudaError_t)e));
    }
    k = calloc(1, sizeof(*k));
    if (!k)
        return hep_fail(HEP_ERR_NOMEM, "group: out of memory");
    k->local = g->local;
    k->R = g->R;
    k->node = g->node;
    k->N = g->N;
    k->T = g->cfg.max_tokens;
    k->kmax = g->cfg.max_topk;
    k->rank0 = g->node * g->R;
    k->peers_sys = !g->mates_one_gpu;
    k->H = g->cfg.hidden;
    k->El = g->cfg.experts_per_rank;
    k->esize = g->cfg.dtype == HEP_DTYPE_FP8_E4M3 ? 1 : 2;
    k->nscale = g->cfg.dtype == HEP_DTYPE_FP8_E4M3 ? g->cfg.hidden / HEP_FP8_BLOCK : 0;
    g->kargs = k;
    use_layout(g, NULL);
    k->epoch = (unsigned long long *)(k->meta + ((g->world + 1) & ~1));
    k->grid_arrive = k->epoch + 1;
    k->layout_ready = k->epoch + 2;
    k->pack_arrive = k->epoch + 3;
    k->pack_done = k->epoch + 4;
    k->combine_done = k->epoch + 5;
    k->count_done = k->epoch + 6;
    k->grid_arrive2 = k->epoch + 7;
    k->cepoch = k->epoch + 8;
    k->work = (unsigned *)(k->tokens_per_expert + k->El);
    k->node_pos = k->dest_rows + (size_t)g->cfg.max_tokens * (size_t)g->world;
    k->node_blocks = k->node_pos + (size_t)g->cfg.max_tokens * (size_t)g->N;
    if (g->N > 1) {
        k->send_token = hep_my_buf(g, HEP_BUF_D_ATTN_TOKEN);
        k->send_route = (int *)hep_my_buf(g, HEP_BUF_D_ATTN_PROB);
        k->send_scale = g->plan.buf[HEP_BUF_D_ATTN_SCALE].present
                            ? (float *)hep_my_buf(g, HEP_BUF_D_ATTN_SCALE)
                            : NULL;
        k->send_words = (unsigned long long *)hep_my_buf(g, HEP_BUF_D_ATTN_FLAGS);
        k->slot_token = hep_my_buf(g, HEP_BUF_D_GROUP_TOKEN);
        k->slot_route = (const int *)hep_my_buf(g, HEP_BUF_D_GROUP_PROB);
        k->slot_scale = g->plan.buf[HEP_BUF_D_GROUP_SCALE].present
                            ? (const float *)hep_my_buf(g, HEP_BUF_D_GROUP_SCALE)
                            : NULL;
        k->slot_words = (const unsigned long long *)hep_my_buf(g, HEP_BUF_D_GROUP_FLAGS);
        k->red_token = hep_my_buf(g, HEP_BUF_C_RED_TOKEN);
        k->red_words = (unsigned long long *)hep_my_buf(g, HEP_BUF_C_OUT_FLAGS);
        k->part_token = hep_my_buf(g, HEP_BUF_C_GROUP_TOKEN);
        k->part_words = (const unsigned long long *)hep_my_buf(g, HEP_BUF_C_GROUP_FLAGS);
        k->px = (unsigned long long *)(g->mapped_dev + g->plan.buf[HEP_BUF_PROXY].offset);
    }
    k->block_counts = (int *)hep_my_buf(g, HEP_BUF_HANDLE_BLOCKS);
    k->host_counts = (int *)hep_my_buf(g, HEP_BUF_HOST_COUNTS);
    k->diag = (hep_diag *)(g->mapped_dev + g->plan.buf[HEP_BUF_DIAG].offset);
    k->abort = (unsigned long long *)hep_my_buf(g, HEP_BUF_FLAGS) + HEP_FLAG_ABORT;
    for (int l = 0; l < g->R; l++) {
        k->x[l] = hep_peer_buf(g, l, HEP_BUF_TOKEN_X);
        k->prob[l] = (float *)hep_peer_buf(g, l, HEP_BUF_RECV_PROB);
        k->scale[l] = g->plan.buf[HEP_BUF_RECV_SCALE].present
                          ? (float *)hep_peer_buf(g, l, HEP_BUF_RECV_SCALE)
                          : NULL;
        k->counts[l] = (int *)hep_peer_buf(g, l, HEP_BUF_COUNTS);
        k->flags[l] = (unsigned long long *)hep_peer_buf(g, l, HEP_BUF_FLAGS);
    }
    if (g->N > 1)
        return hep_proxy_create(g->coord->net, &g->proxy);
    return HEP_OK;
}

void hep_ep_teardown(hep_group *g)
{
    hep_proxy_destroy(g->proxy); /* before the coordinator closes its NIC */
    g->proxy = NULL;
    free(g->kargs);
    g->kargs = NULL;
    hep_handle_destroy(g->own_handle);
    g->own_handle = NULL;
}

static int check_ptr(const void *p, size_t align, const char *what)
{
    if (!p)
        return hep_fail(HEP_ERR_INVALID, "%s is NULL", what);
    if ((uintptr_t)p % align)
        return hep_fail(HEP_ERR_INVALID, "%s = %p is not %zu-byte aligned", what, p, align);
    return HEP_OK;
}

/* Node-mates that are threads of one process on one GPU run co-dependent kernels: on the
 * legacy default stream (NULL or cudaStreamLegacy) those kernels queue behind each other
 * and every wait runs into the timeout, so that stream is refused with the reason. */
static int check_stream(const hep_group *g, void *stream, const char *call)
{
    if (g->cfg.backend != HEP_BACKEND_GPU || g->R < 2 || !g->mates_one_process ||
        (stream != NULL && stream != (void *)cudaStreamLegacy))
        return HEP_OK;
    return hep_fail(HEP_ERR_INVALID,
                    "%s: stream is the legacy default stream, but the %d ranks of this node are "
                    "threads of one process: their kernels wait for each other and would queue "
                    "behind each other on it; give each rank a stream of its own "
                    "(cudaStreamCreateWithFlags(..., cudaStreamNonBlocking))",
                    call, g->R);
}

static int check_dispatch(const hep_group *g, const hep_dispatch_args *a, hep_dispatch_result *o,
                          unsigned allowed)
{
    int rc, reuse;
    if (!g || !a || !o)
        return hep_fail(HEP_ERR_INVALID, "hep_dispatch: NULL group, arguments or result");
    if (g->broken)
        return hep_fail(HEP_ERR_TIMEOUT, "group is unusable after an earlier failure: %s",
                        g->broken_msg);
    if (a->num_tokens < 0 || a->num_tokens > g->cfg.max_tokens)
        return hep_fail(HEP_ERR_INVALID, "hep_dispatch: num_tokens = %d is not in 0..%d (max_tokens)",
                        a->num_tokens, g->cfg.max_tokens);
    reuse = (a->flags & HEP_REUSE_LAYOUT) != 0;
    if (!reuse && (a->topk < 1 || a->topk > g->cfg.max_topk))
        return hep_fail(HEP_ERR_INVALID, "hep_dispatch: topk = %d is not in 1..%d (max_topk)",
                        a->topk, g->cfg.max_topk);
    if ((rc = check_stream(g, a->stream, "hep_dispatch")))
        return rc;
    if (!reuse && a->index_type != HEP_INDEX_INT32 && a->index_type != HEP_INDEX_INT64)
        return hep_fail(HEP_ERR_INVALID, "hep_dispatch: index_type %d is not int32 or int64",
                        (int)a->index_type);
    if (a->flags & ~allowed)
        return hep_fail(HEP_ERR_INVALID, "hep_dispatch: flags 0x%x has bits other than %s",
                        a->flags, allowed & HEP_REUSE_LAYOUT ? "HEP_ASYNC and HEP_REUSE_LAYOUT"
                                                            : "HEP_ASYNC");
    if (a->num_tokens == 0)
        return HEP_OK;
    if (reuse) {
        if ((rc = check_ptr(a->tokens, 16, "hep_dispatch: tokens")) ||
            (a->topk_weights && (rc = check_ptr(a->topk_weights, 4, "hep_dispatch: topk_weights"))))
            return rc;
    } else if ((rc = check_ptr(a->tokens, 16, "hep_dispatch: tokens")) ||
        (rc = check_ptr(a->topk_idx, a->index_type == HEP_INDEX_INT64 ? 8 : 4,
                        "hep_dispatch: topk_idx")) ||
        (rc = check_ptr(a->topk_weights, 4, "hep_dispatch: topk_weights")))
        return rc;
    if (g->cfg.dtype == HEP_DTYPE_FP8_E4M3 &&
        (rc = check_ptr(a->scales, 4, "hep_dispatch: scales (FP8)")))
        return rc;
    return HEP_OK;
}

/* A wait on another node's flag timed out: did that peer arrive at the call? Its arrival
 * word, sent ahead of the data on the same connection (word 2N + slot of the receive flags:
 * the count-block flag of dispatch, the arrival word of combine), holds its call once it
 * started. Returns the word, or 0 when it cannot be read or the stage has none. */
static unsigned long long peer_arrival(hep_group *g, int stage, int peer, void *stream)
{
    const int id = stage == HEP_STAGE_NODE_COMBINE    ? HEP_BUF_C_GROUP_FLAGS
                   : stage == HEP_STAGE_NODE_DISPATCH ? HEP_BUF_D_GROUP_FLAGS
                                                      : -1;
    unsigned long long v = 0;
    const int node = g->R ? peer / g->R : 0;
    if (id < 0 || g->N < 2 || node == g->node || node < 0 || node >= g->N)
        return 0;
    /* device memory: copied on the call's own stream (finished), not the legacy one */
    if (cudaMemcpyAsync(&v, (const unsigned long long *)hep_my_buf(g, id) + 2 * g->N +
                                hep_slot_of(node, g->node),
                        sizeof(v), cudaMemcpyDeviceToHost, (cudaStream_t)stream) != cudaSuccess ||
        cudaStreamSynchronize((cudaStream_t)stream) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return v;
}

/* After the stream finished: a kernel's record becomes the call's status. */
static int diag_status(hep_group *g, const char *call, void *stream)
{
    hep_diag *d = (hep_diag *)(g->arena[HEP_ARENA_MAPPED] + g->plan.buf[HEP_BUF_DIAG].offset);
    if (d->timeout_claimed) {
        int peer = d->peer; /* a global rank */
        const unsigned long long came =
            d->via_plus1 ? 0 : peer_arrival(g, d->stage, peer, stream);
        if (!d->via_plus1 && came >= d->expected)
            snprintf(g->broken_msg, sizeof(g->broken_msg),
                     "%s timed out on rank %d after %.0f ms (HEP_TIMEOUT_MS) in %s, block %d: "
                     "waited for rank %d, expected %llu, saw %llu: rank %d arrived at call %llu "
                     "(its arrival word came over the network) but its flag did not arrive",
                     call, g->rank, (double)d->waited_ns / 1e6, stage_name(d->stage), d->block,
                     peer, d->expected, d->seen, peer, came);
        else if (d->via_plus1)
            snprintf(g->broken_msg, sizeof(g->broken_msg),
                     "%s timed out on rank %d after %.0f ms in %s, block %d: it waited for rank "
                     "%d, which had given up waiting for rank %d (HEP_TIMEOUT_MS): rank %d did "
                     "not arrive",
                     call, g->rank, (double)d->waited_ns / 1e6, stage_name(d->stage), d->block,
                     d->via_plus1 - 1, peer, peer);
        else
            snprintf(g->broken_msg, sizeof(g->broken_msg),
                     "%s timed out on rank %d after %.0f ms (HEP_TIMEOUT_MS) in %s, block %d: "
                     "waited for rank %d, expected %llu, saw %llu: rank %d did not arrive",
                     call, g->rank, (double)d->waited_ns / 1e6, stage_name(d->stage), d->block,
                     peer, d->expected, d->seen, peer);
        g->broken = 1;
        return hep_fail(HEP_ERR_TIMEOUT, "%s", g->broken_msg);
    }
    if (d->overflow_claimed) {
        const int over = d->overflow_rank, need = d->overflow_rows;
        d->overflow_claimed = 0;
        d->invalid_claimed = 0; /* nothing happened: no warning of it either */
        return hep_fail(HEP_ERR_OVERFLOW,
                        "%s: rank %d needs %d receive rows, more than config.max_recv_rows = %d; "
                        "nothing was received on any rank and the group stays usable",
                        call, over, need, g->cfg.max_recv_rows);
    }
    if (d->invalid_claimed) {
        int tok = d->bad_token, slot = d->bad_slot;
        long long v = d->bad_value;
        d->invalid_claimed = 0;
        /* the kernels ignored that slot and finished: the call happened (not an error) */
        return hep_fail(HEP_WARN_IGNORED,
                        "%s on rank %d: topk_idx[%d][%d] = %lld is not -1 or an expert id in "
                        "0..%d (that slot was ignored)",
                        call, g->rank, tok, slot, v,
                        g->cfg.experts_per_rank * g->world - 1);
    }
    return HEP_OK;
}

static int cuda_status(cudaError_t e, const char *what)
{
    (void)cudaGetLastError();
    return hep_fail(HEP_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

/* N > 1: the proxy's batch of the last call is done (0), or its error. */
static int proxy_done(hep_group *g)
{
    int rc;
    if (!g->proxy || g->cfg.backend != HEP_BACKEND_GPU)
        return HEP_OK;
    rc = hep_proxy_wait(g->proxy);
    if (rc) {
        snprintf(g->broken_msg, sizeof(g->broken_msg), "%s", hep_last_error());
        g->broken = 1;
    }
    return rc;
}

static int finish(hep_group *g, void *stream, unsigned flags, const char *call)
{
    cudaError_t e;
    int rc, prc;
    if (flags & HEP_ASYNC)
        return HEP_OK;
    e = cudaStreamSynchronize((cudaStream_t)stream);
    if (e != cudaSuccess)
        return cuda_status(e, call);
    prc = proxy_done(g);       /* the kernels are done: so is the batch, or it failed */
    rc = diag_status(g, call, stream); /* a kernel's timeout names who was missing: it wins */
    if (prc && rc != HEP_ERR_TIMEOUT)
        return hep_fail(prc, "%s", g->broken_msg);
    return rc;
}

/* N > 1 (GPU): hand the proxy this call's chunks; the kernels publish them as ready. */
static int start_network(hep_group *g, int phase, int S, void *stream, uint64_t epoch)
{
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    hep_proxy_chunk *ch;
    int n, rc;
    cudaError_t e = cudaStreamIsCapturing((cudaStream_t)stream, &cs);
    if (e != cudaSuccess)
        return cuda_status(e, phase ? "hep_combine" : "hep_dispatch");
    if (cs != cudaStreamCaptureStatusNone)
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "%s across %d nodes cannot be captured into a CUDA graph: the CPU proxy "
                        "posts each call's network writes (capture works with one node)",
                        phase ? "hep_combine" : "hep_dispatch", g->N);
    rc = proxy_done(g); /* an asynchronous call's batch before this one */
    if (rc)
        return rc;
    ch = malloc(sizeof(*ch) * (size_t)(g->N - 1) * (4 * (size_t)S + 2));
    if (!ch)
        return hep_fail(HEP_ERR_NOMEM, "%s: out of memory", phase ? "hep_combine" : "hep_dispatch");
    n = hep_wire_gpu_batch(g, phase, S, ch);
    rc = hep_proxy_submit(g->proxy, ch, n, epoch);
    free(ch);
    return rc;
}

int hep_group_sync(hep_group *g, void *stream)
{
    if (!g)
        return hep_fail(HEP_ERR_INVALID, "hep_group_sync: NULL group");
    if (g->cfg.backend != HEP_BACKEND_GPU)
        return g->broken ? hep_fail(HEP_ERR_TIMEOUT, "%s", g->broken_msg) : HEP_OK;
    return finish(g, stream, 0, "an asynchronous dispatch/combine");
}

void hep_fill_dispatch_result(hep_group *g, hep_dispatch_result *o)
{
    hep_kargs *k = g->kargs;
    memset(o, 0, sizeof(*o));
    o->tokens = hep_my_buf(g, HEP_BUF_TOKEN_X);
    o->probs = (float *)hep_my_buf(g, HEP_BUF_RECV_PROB);
    o->scales = g->plan.buf[HEP_BUF_RECV_SCALE].present
                    ? (float *)hep_my_buf(g, HEP_BUF_RECV_SCALE)
                    : NULL;
    o->host_counts = (const int *)hep_my_buf(g, HEP_BUF_HOST_COUNTS);
    o->max_recv_rows = g->plan.max_recv_rows;
    o->num_recv = -1;
    if (k) {
        o->num_recv_device = k->recv_count;
        o->tokens_per_expert_device = k->tokens_per_expert;
    }
}

/* Bytes of the rank-major outputs that a blocking dispatch copied into caller memory. */
static size_t copied_bytes(const hep_group *g, const hep_dispatch_opts *x, int rows)
{
    const size_t n = rows > 0 ? (size_t)rows : 0, H = (size_t)g->cfg.hidden;
    const int fp8 = g->cfg.dtype == HEP_DTYPE_FP8_E4M3;
    size_t b = 0;
    if (x->recv_tokens)
        b += n * H * (fp8 ? 1 : 2);
    if (x->recv_probs)
        b += n * (size_t)g->cfg.experts_per_rank * sizeof(float);
    if (fp8 && x->recv_scales)
        b += n * (H / HEP_FP8_BLOCK) * sizeof(float);
    return b;
}

/* The expert-major arguments of a GPU dispatch (one node, a caller handle): the handle's
 * positions and words, this rank's caller outputs; or none (em = 0). */
static void em_setup(hep_group *g, hep_handle *h, const hep_dispatch_opts *x, int reuse, int em)
{
    hep_kargs *k = g->kargs;
    (void)reuse;
    k->emajor = em;
    if (!em)
        return;
    k->epos = h->d_epos;
    k->ebase = h->d_ebase;
    k->ebc = h->d_ebc;
    k->em = h->d_em;
    k->tpe64 = (long long *)h->d_tpe;
    k->em_tokens = x->recv_tokens;
    k->em_probs = x->recv_probs;
    k->em_scales = g->cfg.dtype == HEP_DTYPE_FP8_E4M3 ? x->recv_scales : NULL;
}

/* Bytes of one expert-major row in caller memory: the row, its probability, its scales. */
static size_t em_row_bytes(const hep_group *g)
{
    const size_t H = (size_t)g->cfg.hidden;
    return g->cfg.dtype == HEP_DTYPE_FP8_E4M3 ? H + 4 + H / HEP_FP8_BLOCK * 4 : 2 * H + 4;
}

/* After an expert-major GPU dispatch (status rc): the options' outputs. Blocking: the
 * handle's words and padded tokens per expert copied to the host; HEP_ASYNC: only their
 * device addresses (the host fields are -1 / NULL). 0, or the copy's error. */
static int em_report(hep_group *g, hep_handle *h, hep_dispatch_opts *x,
                     const hep_dispatch_args *a, int rc)
{
    const size_t El = (size_t)g->cfg.experts_per_rank;
    int w[3] = {-1, -1, -1};
    x->permuted_device = h->d_em;
    x->tokens_per_expert_device = h->d_tpe;
    x->tokens_per_expert = NULL;
    x->copy_bytes = 0;
    if ((rc != HEP_OK && rc != HEP_WARN_IGNORED) || (a->flags & HEP_ASYNC)) {
        x->num_permuted = x->overflow = x->overflow_rows = -1;
        h->num_permuted = h->budget; /* unknown on the host: the most it can be */
        return HEP_OK;
    }
    {
        cudaError_t e = cudaMemcpyAsync(w, h->d_em, sizeof(w), cudaMemcpyDeviceToHost,
                                        (cudaStream_t)a->stream);
        if (e == cudaSuccess)
            e = cudaMemcpyAsync(h->tpe, h->d_tpe, El * sizeof(int64_t), cudaMemcpyDeviceToHost,
                                (cudaStream_t)a->stream);
        if (e == cudaSuccess)
            e = cudaStreamSynchronize((cudaStream_t)a->stream);
        if (e != cudaSuccess)
            return cuda_status(e, "hep_dispatch_ex: reading the expert-major counts");
    }
    h->num_permuted = x->num_permuted = w[HEP_EM_NUM_PERMUTED];
    h->overflow = x->overflow = w[HEP_EM_OVERFLOW];
    h->overflow_rows = x->overflow_rows = w[HEP_EM_OVERFLOW_ROWS];
    x->tokens_per_expert = h->tpe;
    x->copy_bytes = (size_t)x->num_permuted * em_row_bytes(g);
    g->copy_bytes += x->copy_bytes;
    return HEP_OK;
}

/* The GPU dispatch. x: the options (NULL: none); h: the caller handle to record into or,
 * with HEP_REUSE_LAYOUT, to read (NULL: the one-shot layout in the group's buffers). */
static int gpu_dispatch(hep_group *g, const hep_dispatch_args *a, hep_dispatch_opts *x,
                        hep_handle *h, hep_dispatch_result *o)
{
    hep_kargs *k = g->kargs;
    const int reuse = (a->flags & HEP_REUSE_LAYOUT) != 0;
    const int em = h && (reuse ? h->layout : (int)x->layout) == HEP_LAYOUT_EXPERT_MAJOR;
    const int copy = x && !em && (x->recv_tokens || x->recv_probs ||
                                  (x->recv_scales && g->cfg.dtype == HEP_DTYPE_FP8_E4M3));
    int rc;
    use_layout(g, h);
    em_setup(g, h, x, reuse, em);
    k->reuse = reuse;
    k->cap = g->cfg.max_recv_rows;
    k->rec_ids = h && !reuse ? h->d_ids : NULL;
    k->rec_w = h && !reuse ? h->d_w : NULL;
    k->t = a->num_tokens;
    if (reuse) { /* the recorded routing: int32 ids, the handle's slots */
        k->K = h->topk;
        k->index64 = 0;
        k->topk_idx = h->d_ids;
        k->weights = a->topk_weights ? a->topk_weights : h->d_w;
    } else {
        k->K = a->topk;
        k->index64 = a->index_type == HEP_INDEX_INT64;
        k->topk_idx = a->topk_idx;
        k->weights = a->topk_weights;
    }
    k->tokens = a->tokens;
    k->scales = a->scales;
    k->timeout_ns = hep_timeout_ns(); /* capped: the kernels' bound arithmetic cannot wrap */
    k->jitter_ns = hep_env_get()->jitter_us * 1000ull; /* stress runs only; 0 by default */
    if (h && !reuse) {
        h->epoch = 0; /* holds no layout until this dispatch recorded it */
        h->t = a->num_tokens;
        h->topk = a->topk;
        h->layout = em ? HEP_LAYOUT_EXPERT_MAJOR : HEP_LAYOUT_RANK_MAJOR;
        h->pad = em && x->pad_multiple > 0 ? x->pad_multiple : 1;
        h->budget = em ? x->num_permuted_tokens : 0;
    }
    if (em) {
        k->pad = h->pad;
        k->budget = h->budget;
    }
    if (g->N > 1) {
        rc = start_network(g, 0, g->cfg.dispatch_sms, a->stream, g->epoch + 1);
        if (rc)
            return rc;
        rc = hep_launch_node_pack(k, g->cfg.dispatch_sms, a->stream);
        if (rc)
            return cuda_status((cudaError_t)rc, "hep_dispatch: kernel launch");
    }
    rc = hep_launch_dispatch(k, g->cfg.dispatch_sms, a->stream);
    if (rc == 0 && copy) {
        k->out_tokens = x->recv_tokens;
        k->out_probs = x->recv_probs;
        k->out_scales = x->recv_scales;
        rc = hep_launch_copy_out(k, 64, a->stream);
    }
    if (rc)
        return cuda_status((cudaError_t)rc, "hep_dispatch: kernel launch");
    g->last_t = a->num_tokens;
    g->x_epoch = ++g->epoch; /* exchange.token holds this call's rows */
    if (em)
        g->x_epoch = 0; /* the expert-major rows are in caller memory only */
    g->last_handle = h ? 0 : hep_handle_of(g, g->epoch);
    if (h)
        h->epoch = g->epoch;
    hep_fill_dispatch_result(g, o);
    o->handle = g->last_handle;
    rc = finish(g, a->stream, a->flags, "dispatch");
    if (rc == HEP_ERR_OVERFLOW) { /* no layout: no combine, no reuse */
        g->last_handle = 0;
        g->x_epoch = 0;
        if (h)
            h->epoch = 0;
        o->handle = 0;
    }
    if ((rc == HEP_OK || rc == HEP_WARN_IGNORED) && !(a->flags & HEP_ASYNC))
        o->num_recv = o->host_counts[0];
    if (x && em) {
        int erc = em_report(g, h, x, a, rc);
        return erc ? erc : rc;
    }
    if (x) {
        x->num_permuted = o->num_recv;
        x->overflow = x->overflow_rows = 0;
        x->tokens_per_expert = NULL;
        x->permuted_device = NULL;
        x->tokens_per_expert_device = NULL;
        /* the count is on the host in the blocking mode only */
        x->copy_bytes = copy && o->num_recv > 0 ? copied_bytes(g, x, o->num_recv) : 0;
        g->copy_bytes += x->copy_bytes;
        if (x->recv_tokens)
            o->tokens = x->recv_tokens;
        if (x->recv_probs)
            o->probs = x->recv_probs;
        if (x->recv_scales && o->scales)
            o->scales = x->recv_scales;
    }
    return rc;
}

int hep_dispatch(hep_group *g, const hep_dispatch_args *a, hep_dispatch_result *o)
{
    int rc = check_dispatch(g, a, o, HEP_ASYNC);
    if (rc)
        return rc;
    if (g->cfg.backend == HEP_BACKEND_HOST)
        return hep_host_dispatch(g, a, o);
    return gpu_dispatch(g, a, NULL, NULL, o);
}

/* The training options of hep_dispatch_ex: 0, or the status that refuses them. */
static int check_dispatch_opts(hep_group *g, const hep_dispatch_args *a, const hep_dispatch_opts *x)
{
    const int reuse = (a->flags & HEP_REUSE_LAYOUT) != 0;
    const int fp8 = g->cfg.dtype == HEP_DTYPE_FP8_E4M3;
    int rc, layout = x->layout, pad = x->pad_multiple > 0 ? x->pad_multiple : 1;
    if (x->handle && (rc = hep_handle_check(g, x->handle, reuse, "hep_dispatch_ex")))
        return rc;
    if (reuse && !x->handle)
        return hep_fail(HEP_ERR_INVALID, "hep_dispatch_ex: HEP_REUSE_LAYOUT without a handle");
    if (reuse && a->num_tokens != x->handle->t)
        return hep_fail(HEP_ERR_INVALID,
                        "hep_dispatch_ex: num_tokens = %d, but the handle's layout is of %d tokens",
                        a->num_tokens, x->handle->t);
    if (reuse) {
        layout = x->handle->layout;
        pad = x->handle->pad;
    } else if (layout != HEP_LAYOUT_RANK_MAJOR && layout != HEP_LAYOUT_EXPERT_MAJOR) {
        return hep_fail(HEP_ERR_INVALID, "hep_dispatch_ex: layout %d is not rank-major (0) or "
                        "expert-major (1)", layout);
    } else if (layout == HEP_LAYOUT_EXPERT_MAJOR &&
               (x->pad_multiple < 0 || x->pad_multiple > HEP_MAX_PAD_MULTIPLE)) {
        return hep_fail(HEP_ERR_INVALID, "hep_dispatch_ex: pad_multiple = %d is not in 1..%d",
                        x->pad_multiple, HEP_MAX_PAD_MULTIPLE);
    } else if (layout == HEP_LAYOUT_EXPERT_MAJOR &&
               (x->num_permuted_tokens <= 0 || x->num_permuted_tokens % pad)) {
        return hep_fail(HEP_ERR_INVALID,
                        "hep_dispatch_ex: num_permuted_tokens = %d is not a positive multiple of "
                        "pad_multiple %d",
                        x->num_permuted_tokens, pad);
    }
    if (x->recv_tokens && (rc = check_ptr(x->recv_tokens, 16, "hep_dispatch_ex: recv_tokens")))
        return rc;
    if (x->recv_probs && (rc = check_ptr(x->recv_probs, 4, "hep_dispatch_ex: recv_probs")))
        return rc;
    if (x->recv_scales && (rc = check_ptr(x->recv_scales, 4, "hep_dispatch_ex: recv_scales")))
        return rc;
    if (layout == HEP_LAYOUT_EXPERT_MAJOR &&
        (!x->recv_tokens || !x->recv_probs || (fp8 && !x->recv_scales)))
        return hep_fail(HEP_ERR_INVALID,
                        "hep_dispatch_ex: the expert-major layout writes into caller memory: "
                        "recv_tokens, recv_probs%s must be given",
                        fp8 ? " and recv_scales (FP8)" : "");
    if (g->cfg.backend == HEP_BACKEND_GPU && layout == HEP_LAYOUT_EXPERT_MAJOR && g->N > 1)
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "hep_dispatch_ex: the expert-major layout is implemented by the GPU "
                        "kernels for one node only, not across %d nodes (the host backend has "
                        "it): use the rank-major layout",
                        g->N);
    if (g->cfg.backend == HEP_BACKEND_GPU && layout == HEP_LAYOUT_EXPERT_MAJOR && !x->handle)
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "hep_dispatch_ex: the GPU kernels record the expert-major layout in a "
                        "caller handle only (its positions live in the handle's device memory): "
                        "pass hep_dispatch_opts.handle (hep_handle_create)");
    if (g->cfg.backend == HEP_BACKEND_GPU && layout == HEP_LAYOUT_EXPERT_MAJOR &&
        !g->mates_one_process)
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "hep_dispatch_ex: the GPU kernels write expert-major rows straight into "
                        "the node-mates' caller memory, which needs every rank of the node in "
                        "one process (threads); this node's ranks are in several processes: use "
                        "the rank-major layout");
    if (g->cfg.backend == HEP_BACKEND_GPU && g->N > 1 &&
        (x->handle || x->recv_tokens || x->recv_probs || x->recv_scales))
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "hep_dispatch_ex: %s is implemented by the GPU kernels for one node only, "
                        "not across %d nodes (the host backend has it): use hep_dispatch with its "
                        "one-shot handle and the zero-copy view",
                        x->handle ? "a caller-owned handle (recording or reusing a layout)"
                                  : "writing the outputs into caller memory",
                        g->N);
    if (g->shm && layout == HEP_LAYOUT_EXPERT_MAJOR)
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "hep_dispatch_ex: the expert-major layout needs the node-mates' layouts "
                        "in one address space: the host backend has it for ranks of one process "
                        "only, not across processes");
    return HEP_OK;
}

int hep_dispatch_ex(hep_group *g, const hep_dispatch_args *a, hep_dispatch_opts *x,
                    hep_dispatch_result *o)
{
    int rc;
    if (!x)
        return hep_dispatch(g, a, o);
    if ((rc = check_dispatch(g, a, o, HEP_ASYNC | HEP_REUSE_LAYOUT)) ||
        (rc = check_dispatch_opts(g, a, x)))
        return rc;
    if (g->cfg.backend == HEP_BACKEND_GPU)
        return gpu_dispatch(g, a, x, x->handle, o);
    rc = hep_host_dispatch_ex(g, a, x, x->handle ? x->handle : g->own_handle, o);
    if (!x->handle && (rc == HEP_OK || rc == HEP_WARN_IGNORED))
        o->handle = g->last_handle = hep_handle_of(g, g->epoch); /* one-shot, as hep_dispatch */
    return rc;
}

/* What combine needs from its caller, given the layout h it combines with. */
static int check_combine_buffers(const hep_group *g, const hep_combine_args *a, int t, int rows)
{
    int rc;
    (void)g;
    if (t > 0 && ((rc = check_ptr(a->out, 16, "hep_combine: out")) ||
                  (rc = check_ptr(a->expert_out, 16, "hep_combine: expert_out"))))
        return rc;
    if (t == 0 && rows > 0 && (rc = check_ptr(a->expert_out, 16, "hep_combine: expert_out")))
        return rc;
    return HEP_OK;
}

/* The GPU combine with handle h (NULL: the one-shot layout in the group's buffers) and,
 * with c, the probabilities. The caller's expert outputs (and probs_in) are copied into
 * the group's exchange buffers, where the node-mates pull them; expert_out ==
 * hep_combine_input(g) skips that copy, which is right only while the buffer still holds
 * the rows of h's dispatch and no combine ran since (else a node-mate may still read it). */
static int gpu_combine(hep_group *g, const hep_combine_args *a, const hep_handle *h,
                       const hep_combine_opts *c)
{
    hep_kargs *k = g->kargs;
    const void *x = hep_my_buf(g, HEP_BUF_TOKEN_X);
    const uint64_t epoch = h ? h->epoch : g->epoch;
    const int em = h && h->layout == HEP_LAYOUT_EXPERT_MAJOR;
    int rc = 0;
    if (!em && a->expert_out == x && g->x_epoch != epoch)
        return hep_fail(HEP_ERR_INVALID,
                        "hep_combine: expert_out is hep_combine_input(g), but that buffer no longer "
                        "holds this layout's rows (%s): pass the expert outputs from memory of "
                        "your own",
                        g->x_epoch == 0 ? "a combine ran since its dispatch"
                                        : "another dispatch ran since");
    if (em && a->expert_out == x && (h->num_permuted > 0 || h->t > 0))
        return hep_fail(HEP_ERR_INVALID,
                        "hep_combine: expert_out is hep_combine_input(g), but an expert-major "
                        "layout is combined from caller memory of [num_permuted_tokens, H] rows");
    use_layout(g, h);
    k->emajor = em;
    k->t = h ? h->t : g->last_t;
    if (h) {
        k->K = h->topk;
        k->rec_ids = h->d_ids;
    } else {
        k->rec_ids = NULL;
    }
    k->probs_in = c ? c->probs_in : NULL;
    k->probs_out = c && c->probs_in ? c->probs_out : NULL;
    k->combine_out = a->out;
    k->combine_in = a->expert_out && a->expert_out != x ? a->expert_out : NULL;
    k->x_stride_in = g->cfg.hidden * 2;
    if (em) { /* read where they are: the node-mates' kernels take these pointers */
        k->epos = h->d_epos;
        k->combine_in = a->expert_out;
    }
    if (g->N > 1 && (rc = start_network(g, 1, g->cfg.combine_sms, a->stream, g->epoch)))
        return rc;
    if (!em && (k->combine_in || k->probs_in))
        rc = hep_launch_copy_in(k, 64, a->stream);
    if (rc == 0)
        rc = hep_launch_combine(k, g->cfg.combine_sms, a->stream);
    if (rc)
        return cuda_status((cudaError_t)rc, "hep_combine: kernel launch");
    g->x_epoch = 0; /* from now on a node-mate may still read the buffer */
    return finish(g, a->stream, a->flags, "combine");
}

/* What every combine checks first: the group, the arguments, the flags. */
static int check_combine_call(const hep_group *g, const hep_combine_args *a)
{
    if (!g || !a)
        return hep_fail(HEP_ERR_INVALID, "hep_combine: NULL group or arguments");
    if (g->broken)
        return hep_fail(HEP_ERR_TIMEOUT, "group is unusable after an earlier failure: %s",
                        g->broken_msg);
    if (a->flags & ~HEP_ASYNC)
        return hep_fail(HEP_ERR_INVALID, "hep_combine: flags 0x%x has bits other than HEP_ASYNC",
                        a->flags);
    return HEP_OK;
}

int hep_combine_ex(hep_group *g, const hep_combine_args *a, const hep_combine_opts *c)
{
    const hep_handle *h;
    int rc;
    if (!c)
        return hep_combine(g, a);
    if ((rc = check_combine_call(g, a)))
        return rc;
    if (!c->handle && !c->probs_in && !c->probs_out)
        return hep_combine(g, a); /* no option set */
    if (!c->probs_in != !c->probs_out)
        return hep_fail(HEP_ERR_INVALID, "hep_combine_ex: probs_in and probs_out go together "
                        "(one of them is NULL)");
    if (g->cfg.backend == HEP_BACKEND_GPU && g->N > 1)
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "hep_combine_ex: %s is implemented by the GPU kernels for one node only, "
                        "not across %d nodes (the host backend has it): use hep_combine with the "
                        "one-shot handle",
                        c->handle ? "combining with a caller-owned handle"
                                  : "carrying probabilities back through combine",
                        g->N);
    if (g->cfg.backend == HEP_BACKEND_GPU && c->probs_in && !c->handle)
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "hep_combine_ex: the GPU kernels carry probabilities back with a caller "
                        "handle only (its dispatch recorded the routing; the one-shot layout "
                        "keeps none): dispatch with hep_dispatch_opts.handle");
    if ((rc = check_stream(g, a->stream, "hep_combine")))
        return rc;
    if (!c->handle && g->last_handle == 0)
        return hep_fail(HEP_ERR_INVALID,
                        "hep_combine_ex: no handle given, and the group holds no one-shot "
                        "dispatch to combine (it was combined, or recorded into a handle)");
    if (!c->handle && a->handle != g->last_handle)
        return hep_fail(HEP_ERR_INVALID,
                        "hep_combine: handle 0x%llx is not this group's last dispatch's (0x%llx)",
                        (unsigned long long)a->handle, (unsigned long long)g->last_handle);
    h = c->handle ? c->handle : g->own_handle;
    if ((rc = hep_handle_check(g, h, 1, "hep_combine_ex")))
        return rc;
    if (c->probs_in && g->cfg.backend == HEP_BACKEND_HOST && (g->N > 1 || g->shm))
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "hep_combine_ex: probabilities through combine are implemented for ranks "
                        "of one process on one node only (this group has %d nodes%s)",
                        g->N, g->shm ? ", its ranks in several processes" : "");
    if (c->probs_out && h->t > 0 && (rc = check_ptr(c->probs_out, 4, "hep_combine_ex: probs_out")))
        return rc;
    if ((rc = check_combine_buffers(g, a, h->t,
                                    h->layout == HEP_LAYOUT_EXPERT_MAJOR ? h->num_permuted : 0)))
        return rc;
    if (g->cfg.backend == HEP_BACKEND_GPU)
        rc = gpu_combine(g, a, c->handle, c);
    else
        rc = hep_host_combine_ex(g, a, c);
    if (!c->handle)
        g->last_handle = 0; /* the one-shot handle: once */
    return rc;
}

int hep_combine(hep_group *g, const hep_combine_args *a)
{
    int rc;
    if ((rc = check_combine_call(g, a)))
        return rc;
    if (a->handle == 0 || a->handle != g->last_handle)
        return hep_fail(HEP_ERR_INVALID,
                        "hep_combine: handle 0x%llx is not this group's last dispatch's (0x%llx): "
                        "combine follows its dispatch, once, on the same group",
                        (unsigned long long)a->handle, (unsigned long long)g->last_handle);
    if ((rc = check_stream(g, a->stream, "hep_combine")))
        return rc;
    if ((rc = check_combine_buffers(g, a, g->last_t,
                                    g->own_handle && g->own_handle->layout == HEP_LAYOUT_EXPERT_MAJOR
                                        ? g->own_handle->num_permuted
                                        : 0)))
        return rc;
    if (g->cfg.backend == HEP_BACKEND_HOST)
        rc = hep_host_combine(g, a);
    else
        rc = gpu_combine(g, a, NULL, NULL);
    g->last_handle = 0; /* once */
    return rc;
}

void *hep_combine_input(hep_group *g)
{
    return g ? hep_my_buf(g, HEP_BUF_TOKEN_X) : NULL;
}

/* The GPU half of hep_group_get_stats: the last dispatch's device timestamps and what the
 * proxy posted. One place, so that where the kernels keep their record can change. */
void hep_ep_fill_stats(const hep_group *g, hep_group_stats *s)
{
    hep_proxy_peer_stats x;
    s->copy_bytes = g->copy_bytes;
    for (int p = 0; g->proxy && p < g->world; p++) {
        hep_proxy_stats(g->proxy, p, &x);
        s->net_bytes += x.bytes;
        s->net_data_writes += x.data_wrs;
        s->net_flag_writes += x.flag_wrs;
        s->net_flags_done += x.flags_done;
        s->net_ready_to_flag_ns += x.ready_to_flag_ns;
    }
    if (g->cfg.backend == HEP_BACKEND_GPU && g->arena[HEP_ARENA_MAPPED]) {
        const hep_diag *d =
            (const hep_diag *)(g->arena[HEP_ARENA_MAPPED] + g->plan.buf[HEP_BUF_DIAG].offset);
        s->dispatch_start_ns = d->t_start;
        s->layout_ready_ns = d->t_layout;
    }
}
