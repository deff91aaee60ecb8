/* group/ep.c: hep_dispatch / hep_combine: argument checks, the handle checks and the
 * one-shot bookkeeping, then the group's backend (backend/backend.h: the host backend or
 * the GPU kernels); the backend's setup and teardown, and the group's part of the stats. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/core.h"
#include "group/group.h"
#include "group/shm.h"
#include "kernels/ep_kernels.h"
#include "net/proxy.h"

/* The backend's view of the group (backend/backend.h), filled once everything it points at
 * exists: arenas, node-mates' memory, coordinator. */
static void fill_view(hep_group *g)
{
    hep_backend_ctx *b = &g->be;
    b->cfg = &g->cfg;
    b->bs = &g->bs;
    b->device = g->device;
    b->rank = g->rank, b->world = g->world, b->R = g->R, b->N = g->N;
    b->node = g->node, b->local = g->local;
    b->mates_one_gpu = g->mates_one_gpu;
    b->mates_one_process = g->mates_one_process;
    b->hold_credits = g->hold_credits;
    b->plan = &g->plan;
    b->arena = g->arena;
    b->mapped_dev = g->mapped_dev;
    b->peer_shared = g->peer_shared;
    b->coord = g->coord;
    b->proxy = g->proxy;
    hep_shm_fill_view(g, b);
}

/* N > 1: the CPU proxy, started after the backend's setup. */
static int start_proxy(hep_group *g)
{
    int rc = HEP_OK;
    if (g->N > 1)
        rc = hep_proxy_create(g->coord->net, &g->proxy);
    g->be.proxy = g->proxy;
    return rc;
}

int hep_ep_setup(hep_group *g)
{
    int rc;
    fill_view(g);
    if (g->cfg.backend != HEP_BACKEND_GPU) {
        g->ops = &hep_host_backend;
        if (g->R > 64)
            return hep_fail(HEP_ERR_INVALID,
                            "the host backend supports up to 64 ranks per node, not %d", g->R);
        if ((rc = g->ops->setup(&g->be)))
            return rc;
        g->be.own_handle = hep_handle_alloc(g);
        if (!g->be.own_handle)
            return hep_fail(HEP_ERR_NOMEM, "group: out of memory for the dispatch layout");
        return start_proxy(g);
    }
    g->ops = &hep_gpu_backend;
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
    if ((rc = g->ops->setup(&g->be)))
        return rc;
    return start_proxy(g);
}

void hep_ep_teardown(hep_group *g)
{
    hep_proxy_destroy(g->proxy); /* before the coordinator closes its NIC */
    g->proxy = NULL;
    g->be.proxy = NULL;
    if (g->ops)
        g->ops->teardown(&g->be);
    hep_handle_destroy(g->be.own_handle);
    g->be.own_handle = NULL;
}

int hep_ep_gpu_nodes_check(int N, int layout, int procs, int probs, int async_cap,
                           const char *call)
{
    (void)probs; /* probabilities through combine: both layouts, every node count */
    if (N <= 1 || layout != HEP_LAYOUT_EXPERT_MAJOR)
        return HEP_OK; /* rank-major: caller handles, probabilities, a receive capacity in
                          both modes, every node count */
    if (async_cap) /* each node decides alone: a void layout on some nodes only would leave
                      the others' combine waiting for partial sums that never come */
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "%s: with HEP_ASYNC and config.max_recv_rows = %d, the GPU kernels "
                        "across %d nodes have no expert-major layout (it is all or nothing, and "
                        "without the host's agreement the nodes cannot decide it alike): "
                        "dispatch without HEP_ASYNC, or use the rank-major layout (which drops "
                        "rows past the capacity)",
                        call, async_cap, N);
    if (procs)
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "%s: the GPU kernels have the expert-major layout across %d nodes with "
                        "each node's ranks in one process only (this node's ranks are in "
                        "several processes, whose caller memory the node-mates' kernels cannot "
                        "address): use the rank-major layout",
                        call, N);
    return HEP_OK;
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
                    "behind each other on it; give each rank a stream of its own, made once "
                    "and kept (hep_inproc_stream(device, rank, &stream) does that)",
                    call, g->R);
}

static int check_dispatch(const hep_group *g, const hep_dispatch_args *a, hep_dispatch_result *o,
                          unsigned allowed)
{
    int rc, reuse;
    if (!g || !a || !o)
        return hep_fail(HEP_ERR_INVALID, "hep_dispatch: NULL group, arguments or result");
    if (g->be.broken)
        return hep_fail(HEP_ERR_TIMEOUT, "group is unusable after an earlier failure: %s",
                        g->be.broken_msg);
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

int hep_group_sync(hep_group *g, void *stream)
{
    if (!g)
        return hep_fail(HEP_ERR_INVALID, "hep_group_sync: NULL group");
    return g->ops->sync(&g->be, stream);
}

int hep_dispatch(hep_group *g, const hep_dispatch_args *a, hep_dispatch_result *o)
{
    int rc = check_dispatch(g, a, o, HEP_ASYNC);
    if (rc)
        return rc;
    return g->ops->dispatch(&g->be, a, NULL, NULL, o);
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
    if (g->cfg.backend == HEP_BACKEND_GPU &&
        (rc = hep_ep_gpu_nodes_check(g->N, layout, !g->mates_one_process, 0,
                                     (a->flags & HEP_ASYNC) ? g->cfg.max_recv_rows : 0,
                                     "hep_dispatch_ex")))
        return rc;
    if (g->cfg.backend == HEP_BACKEND_GPU && layout == HEP_LAYOUT_EXPERT_MAJOR && !x->handle)
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "hep_dispatch_ex: the GPU kernels record the expert-major layout in a "
                        "caller handle only (its positions live in the handle's device memory): "
                        "pass hep_dispatch_opts.handle (hep_handle_create)");
    if (g->cfg.backend == HEP_BACKEND_GPU && layout == HEP_LAYOUT_EXPERT_MAJOR &&
        !g->mates_one_process && g->cfg.max_permuted_rows == 0)
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "hep_dispatch_ex: this node's ranks are in several processes, whose "
                        "caller memory the node-mates' GPU kernels cannot address: the "
                        "expert-major layout then goes through a group-owned staging of "
                        "config.max_permuted_rows rows, which is 0 (none); create the group with "
                        "max_permuted_rows >= num_permuted_tokens, or use the rank-major layout");
    if (g->cfg.backend == HEP_BACKEND_GPU && layout == HEP_LAYOUT_EXPERT_MAJOR &&
        !g->mates_one_process && !reuse && x->num_permuted_tokens > g->cfg.max_permuted_rows)
        return hep_fail(HEP_ERR_INVALID,
                        "hep_dispatch_ex: num_permuted_tokens = %d exceeds "
                        "config.max_permuted_rows = %d, the rows of the expert-major staging "
                        "(this node's ranks are in several processes): pass a budget of at most "
                        "%d rows, or create the group with a larger max_permuted_rows",
                        x->num_permuted_tokens, g->cfg.max_permuted_rows,
                        g->cfg.max_permuted_rows / pad * pad);
    if (g->shm && g->N > 1 && layout == HEP_LAYOUT_EXPERT_MAJOR && !reuse &&
        (size_t)x->num_permuted_tokens > g->plan.max_recv_rows &&
        x->num_permuted_tokens > g->cfg.max_permuted_rows) {
        const size_t most = g->plan.max_recv_rows > (size_t)g->cfg.max_permuted_rows
                                ? g->plan.max_recv_rows
                                : (size_t)g->cfg.max_permuted_rows;
        return hep_fail(HEP_ERR_INVALID,
                        "hep_dispatch_ex: num_permuted_tokens = %d exceeds both max_recv_rows = "
                        "%zu and config.max_permuted_rows = %d: across %d nodes with this node's "
                        "ranks in several processes, the host backend's combine passes a rank's "
                        "expert-major rows to its node-mates at once, through its "
                        "exchange.token or its expert-major staging of max_permuted_rows rows "
                        "(pass a budget of at most %zu rows, or create the group with a larger "
                        "max_permuted_rows)",
                        x->num_permuted_tokens, g->plan.max_recv_rows, g->cfg.max_permuted_rows,
                        g->N, most / (size_t)pad * (size_t)pad);
    }
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
    /* without x->handle: the one-shot layout, as hep_dispatch */
    return g->ops->dispatch(&g->be, a, x, x->handle, o);
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

/* What every combine checks first: the group, the arguments, the flags. */
static int check_combine_call(const hep_group *g, const hep_combine_args *a)
{
    if (!g || !a)
        return hep_fail(HEP_ERR_INVALID, "hep_combine: NULL group or arguments");
    if (g->be.broken)
        return hep_fail(HEP_ERR_TIMEOUT, "group is unusable after an earlier failure: %s",
                        g->be.broken_msg);
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
    if (g->cfg.backend == HEP_BACKEND_GPU && c->probs_in && !c->handle)
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "hep_combine_ex: the GPU kernels carry probabilities back with a caller "
                        "handle only (its dispatch recorded the routing; the one-shot layout "
                        "keeps none): dispatch with hep_dispatch_opts.handle");
    if ((rc = check_stream(g, a->stream, "hep_combine")))
        return rc;
    if (!c->handle && g->be.last_handle == 0)
        return hep_fail(HEP_ERR_INVALID,
                        "hep_combine_ex: no handle given, and the group holds no one-shot "
                        "dispatch to combine (it was combined, or recorded into a handle)");
    if (!c->handle && a->handle != g->be.last_handle)
        return hep_fail(HEP_ERR_INVALID,
                        "hep_combine: handle 0x%llx is not this group's last dispatch's (0x%llx)",
                        (unsigned long long)a->handle, (unsigned long long)g->be.last_handle);
    h = c->handle ? c->handle : g->be.own_handle;
    if ((rc = hep_handle_check(g, h, 1, "hep_combine_ex")))
        return rc;
    if (g->cfg.backend == HEP_BACKEND_GPU &&
        (rc = hep_ep_gpu_nodes_check(g->N, h->layout, !g->mates_one_process,
                                     c->probs_in != NULL, 0, "hep_combine_ex")))
        return rc;
    if (c->probs_out && h->t > 0 && (rc = check_ptr(c->probs_out, 4, "hep_combine_ex: probs_out")))
        return rc;
    if ((rc = check_combine_buffers(g, a, h->t,
                                    h->layout == HEP_LAYOUT_EXPERT_MAJOR ? h->num_permuted : 0)))
        return rc;
    rc = g->ops->combine(&g->be, a, c->handle, c);
    if (!c->handle)
        g->be.last_handle = 0; /* the one-shot handle: once */
    return rc;
}

int hep_combine(hep_group *g, const hep_combine_args *a)
{
    int rc;
    if ((rc = check_combine_call(g, a)))
        return rc;
    if (a->handle == 0 || a->handle != g->be.last_handle)
        return hep_fail(HEP_ERR_INVALID,
                        "hep_combine: handle 0x%llx is not this group's last dispatch's (0x%llx): "
                        "combine follows its dispatch, once, on the same group",
                        (unsigned long long)a->handle, (unsigned long long)g->be.last_handle);
    if ((rc = check_stream(g, a->stream, "hep_combine")))
        return rc;
    if ((rc = check_combine_buffers(g, a, g->be.last_t,
                                    g->be.own_handle && g->be.own_handle->layout == HEP_LAYOUT_EXPERT_MAJOR
                                        ? g->be.own_handle->num_permuted
                                        : 0)))
        return rc;
    rc = g->ops->combine(&g->be, a, NULL, NULL);
    g->be.last_handle = 0; /* once */
    return rc;
}

void *hep_combine_input(hep_group *g)
{
    return g ? hep_my_buf(g, HEP_BUF_TOKEN_X) : NULL;
}


/* hep_group_get_stats: what the proxy posted, then the backend's part (the GPU's: the last
 * dispatch's device timestamps). */
void hep_ep_fill_stats(const hep_group *g, hep_group_stats *s)
{
    hep_proxy_peer_stats x;
    s->copy_bytes = g->be.copy_bytes;
    for (int p = 0; g->proxy && p < g->world; p++) {
        hep_proxy_stats(g->proxy, p, &x);
        s->net_bytes += x.bytes;
        s->net_data_writes += x.data_wrs;
        s->net_flag_writes += x.flag_wrs;
        s->net_flags_done += x.flags_done;
        s->net_ready_to_flag_ns += x.ready_to_flag_ns;
    }
    if (g->ops && g->ops->fill_stats)
        g->ops->fill_stats(&g->be, s);
}
