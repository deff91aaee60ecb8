/* kernels/backend_gpu.c: the GPU backend behind backend/backend.h: fills the kernels'
 * launch arguments (hep_kargs), launches them, and, in the blocking mode, waits and turns a
 * kernel's timeout record into a status. The group layer (group/ep.c) checked the
 * arguments before any call here. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "backend/backend.h"
#include "bootstrap/stream.h"
#include "core/core.h"
#include "kernels/divmagic.h"
#include "kernels/ep_kernels.h"
#include "net/proxy.h"

static const char *stage_name(int s)
{
    return s == HEP_STAGE_PREPROCESS       ? "dispatch layout (routing counts)"
           : s == HEP_STAGE_DISPATCH        ? "dispatch (rows arriving)"
           : s == HEP_STAGE_COMBINE         ? "combine (expert outputs ready)"
           : s == HEP_STAGE_NODE_DISPATCH   ? "dispatch (another node's tokens over the network)"
           : s == HEP_STAGE_NODE_COMBINE    ? "combine (another node's partial sums over the network)"
           : s == HEP_STAGE_RING_DISPATCH_CHUNK  ? "dispatch (a chunk of another node's tokens over the network)"
           : s == HEP_STAGE_RING_DISPATCH_CREDIT ? "dispatch (a credit: the receiving rank freeing a chunk of this rank's ring)"
           : s == HEP_STAGE_RING_COMBINE_CHUNK   ? "combine (a chunk of another node's partial sums over the network)"
           : s == HEP_STAGE_RING_COMBINE_CREDIT  ? "combine (a credit: the receiving rank freeing a chunk of this rank's ring)"
                                            : "?";
}

/* Point the kernels' layout (positions, row bases, counts, overflow word; across nodes the
 * own tokens' rows in each node's slot and the slots' sizes) at handle h's device memory,
 * or (NULL) at the group's own buffers: handle.dest_rows [N][T][R] then node_pos [T][N],
 * and in handle.meta [0, N x R) the row bases, then the counters (8-byte aligned, set in
 * hep_ep_setup), the overflow word, the count, the tokens per expert, the work counters,
 * the overflow words, the slots' sizes. */
static void use_layout(hep_backend_ctx *g, const hep_handle *h)
{
    hep_kargs *k = g->kargs;
    if (h) {
        k->dest_rows = h->d_rows;
        k->meta = h->d_meta;
        k->recv_count = h->d_counts;
        k->over = h->d_counts + 1;
        k->tokens_per_expert = h->d_counts + 2;
        k->ovf = h->d_drop;
        k->node_pos = h->d_npos;
        k->slot_rows = h->d_slots;
        return;
    }
    k->dest_rows = (int *)hep_be_buf(g, HEP_BUF_HANDLE_ROWS);
    k->meta = (int *)hep_be_buf(g, HEP_BUF_HANDLE_META);
    k->over = k->meta + ((g->world + 1) & ~1) + 2 * 9; /* after the 9 u64 counters */
    k->recv_count = k->over + 1;
    k->tokens_per_expert = k->recv_count + 1;
    /* after the work counters: the plan's 4 W + El + 24 + HEP_WORK_WORDS words of handle.meta
     * hold the (W + 1 rounded to even) + 18 + 2 + El + HEP_WORK_WORDS + 3 used here */
    k->ovf = (int *)(k->tokens_per_expert + k->El) + HEP_WORK_WORDS;
    /* then N - 1 slot sizes: (W + 1) + 18 + 2 + El + HEP_WORK_WORDS + 3 + N words of the
     * plan's 4 W + El + 24 + HEP_WORK_WORDS, as N <= W */
    k->slot_rows = k->ovf + 3;
    k->node_pos = k->dest_rows + (size_t)g->cfg->max_tokens * (size_t)g->world;
}

/* Across nodes, the ring of the phase about to be launched (layout/plan.h): the slots are
 * the same rows in both, but combine may cut them into more, smaller chunks (cchunk, cring)
 * than dispatch; every count of a slot's chunks in the kernels follows these. */
static void use_ring(hep_backend_ctx *g, int phase)
{
    hep_kargs *k = g->kargs;
    k->C = hep_plan_chunk(g->plan, phase);
    k->P = hep_plan_ring(g->plan, phase);
}

/* After the group layer checked the node's shape against the kernels' limits: load the
 * kernels, then the launch arguments (node pointers filled once). */
/* How the dispatch kernel writes rows. Bulk stores (dispatch_bulk.cu: the own tokens' rows
 * streamed through each warp's ring of shared-memory stages, fixed shares a warp) free the
 * warps' issue slots for loads: faster with one rank per GPU while each SM's issue rate
 * bounds the push, no faster where eight ranks share one GPU's HBM (bench/NOTES.md, session
 * 6). Plain stores take the rank's tokens from one counter, which evens out the SMs'
 * unequal write rates: from 48 SMs on, where the HBM is the bound (a copy saturates it near
 * 40), they are 4-9% faster than the bulk ring at T = 4096 and 16384 when each warp has at
 * least 2.5 tokens to share, and 3-7% slower below that (session 25, H100, a rank alone on
 * one node: not measured with node-mates on other GPUs or across nodes). So
 * HEP_DISPATCH_STORES=auto (the default) takes bulk stores where no node-mate shares this
 * rank's GPU and their staging fits the shared memory, except for a rank alone on one node
 * whose kernel has 48 SMs or more and whose max_tokens gives each warp 2.5 tokens or more. */
#define STORES_PLAIN_SMS 48    /* plain stores' rank counter from this many SMs on ... */
#define STORES_TOKENS_X2 5     /* ... with 5/2 tokens a warp or more */
static int choose_stores(hep_backend_ctx *g)
{
    const int mode = hep_env_get()->dispatch_stores;
    const size_t smem = hep_dispatch_smem_bulk(g->R, g->cfg->experts_per_rank);
    const int fits = smem <= 200 * 1024, alone = g->R == 1 || !g->mates_one_gpu;
    if (mode == HEP_STORES_BULK && !fits)
        return hep_fail(HEP_ERR_INVALID,
                        "HEP_DISPATCH_STORES=bulk: the bulk dispatch kernel needs %zu bytes of "
                        "shared memory for %d ranks per node x %d experts per rank, more than "
                        "200 KiB (HEP_DISPATCH_STORES=auto or plain use the plain kernel)",
                        smem, g->R, g->cfg->experts_per_rank);
    const int sms = g->cfg->dispatch_sms,
              counter = g->R == 1 && g->N == 1 && sms >= STORES_PLAIN_SMS &&
                        2LL * g->cfg->max_tokens >=
                            (long long)STORES_TOKENS_X2 * (HEP_DISPATCH_THREADS / 32) * sms;
    g->dispatch_bulk =
        mode == HEP_STORES_BULK || (mode == HEP_STORES_AUTO && alone && fits && !counter);
    hep_log(HEP_LOG_DEBUG, "rank %d: dispatch stores: %s (HEP_DISPATCH_STORES=%s%s)", g->rank,
            g->dispatch_bulk ? "bulk" : "plain",
            mode == HEP_STORES_AUTO ? "auto" : mode == HEP_STORES_BULK ? "bulk" : "plain",
            mode != HEP_STORES_AUTO ? ""
            : !alone                ? ", node-mates share this GPU"
            : !fits                 ? ", staging too large"
            : counter               ? ", a rank alone; the rank's counter: 48 SMs or more, 2.5 "
                                      "tokens a warp or more"
                                    : ", no node-mate on this GPU");
    return HEP_OK;
}

static int gpu_setup(hep_backend_ctx *g)
{
    hep_kargs *k;
    int rc;
    if (g->N > 1) {
        cudaEvent_t ev = NULL;
        cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            return hep_fail(HEP_ERR_CUDA, "group: creating an event on GPU %d: %s", g->device,
                            cudaGetErrorString(e));
        }
        g->call_end = ev;
    }
    k = calloc(1, sizeof(*k));
    if (!k)
        return hep_fail(HEP_ERR_NOMEM, "group: out of memory");
    k->local = g->local;
    k->R = g->R;
    k->node = g->node;
    k->N = g->N;
    k->T = g->cfg->max_tokens;
    k->kmax = g->cfg->max_topk;
    k->rank0 = g->node * g->R;
    k->peers_sys = !g->mates_one_gpu;
    k->H = g->cfg->hidden;
    k->El = g->cfg->experts_per_rank;
    k->el_magic = hep_div_magic((unsigned)k->El);
    k->esize = g->cfg->dtype == HEP_DTYPE_FP8_E4M3 ? 1 : 2;
    k->nscale = g->cfg->dtype == HEP_DTYPE_FP8_E4M3 ? g->cfg->hidden / HEP_FP8_BLOCK : 0;
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
    /* scratch of one pack kernel: the group's, whichever layout a call uses */
    k->node_blocks = k->node_pos + (size_t)g->cfg->max_tokens * (size_t)g->N;
    if (g->N > 1) {
        k->send_token = hep_be_buf(g, HEP_BUF_D_ATTN_TOKEN);
        k->send_route = (int *)hep_be_buf(g, HEP_BUF_D_ATTN_PROB);
        k->send_scale = g->plan->buf[HEP_BUF_D_ATTN_SCALE].present
                            ? (float *)hep_be_buf(g, HEP_BUF_D_ATTN_SCALE)
                            : NULL;
        k->send_words = (unsigned long long *)hep_be_buf(g, HEP_BUF_D_ATTN_FLAGS);
        k->slot_token = hep_be_buf(g, HEP_BUF_D_GROUP_TOKEN);
        k->slot_route = (const int *)hep_be_buf(g, HEP_BUF_D_GROUP_PROB);
        k->slot_scale = g->plan->buf[HEP_BUF_D_GROUP_SCALE].present
                            ? (const float *)hep_be_buf(g, HEP_BUF_D_GROUP_SCALE)
                            : NULL;
        k->slot_words = (const unsigned long long *)hep_be_buf(g, HEP_BUF_D_GROUP_FLAGS);
        k->red_token = hep_be_buf(g, HEP_BUF_C_RED_TOKEN);
        k->red_words = (unsigned long long *)hep_be_buf(g, HEP_BUF_C_OUT_FLAGS);
        k->part_token = hep_be_buf(g, HEP_BUF_C_GROUP_TOKEN);
        k->part_words = (const unsigned long long *)hep_be_buf(g, HEP_BUF_C_GROUP_FLAGS);
        k->red_prob = (float *)hep_be_buf(g, HEP_BUF_C_RED_PROB);
        k->part_prob = (const float *)hep_be_buf(g, HEP_BUF_C_GROUP_PROB);
        k->px = (unsigned long long *)(g->mapped_dev + g->plan->buf[HEP_BUF_PROXY].offset);
    }
    k->block_counts = (int *)hep_be_buf(g, HEP_BUF_HANDLE_BLOCKS);
    if (g->N > 1) { /* the pack's scratch after the scan's block counts (layout/plan.c) */
        k->pack_off = k->block_counts + 132 * (size_t)g->world;
        k->md_blocks = k->pack_off + (size_t)g->cfg->max_tokens * (size_t)g->world;
        k->slot_list = k->md_blocks + 132 * (size_t)g->world;
        k->ring_ctr = k->slot_list + (size_t)g->cfg->max_tokens * (size_t)g->N;
        k->em_place = k->ring_ctr + HEP_RING_CTR_WORDS((size_t)g->N);
        k->em_pblocks = k->em_place + (size_t)g->cfg->max_tokens * (size_t)g->cfg->max_topk;
        k->ST = (int)g->plan->slot_tokens;
        use_ring(g, 0); /* dispatch's until a call sets its phase's */
    }
    k->host_counts = (int *)hep_be_buf(g, HEP_BUF_HOST_COUNTS);
    k->diag = (hep_diag *)(g->mapped_dev + g->plan->buf[HEP_BUF_DIAG].offset);
    k->abort = (unsigned long long *)hep_be_buf(g, HEP_BUF_FLAGS) + HEP_FLAG_ABORT;
    for (int l = 0; l < g->R; l++) {
        k->x[l] = hep_be_peer_buf(g, l, HEP_BUF_TOKEN_X);
        k->prob[l] = (float *)hep_be_peer_buf(g, l, HEP_BUF_RECV_PROB);
        k->scale[l] = g->plan->buf[HEP_BUF_RECV_SCALE].present
                          ? (float *)hep_be_peer_buf(g, l, HEP_BUF_RECV_SCALE)
                          : NULL;
        k->counts[l] = (int *)hep_be_peer_buf(g, l, HEP_BUF_COUNTS);
        k->flags[l] = (unsigned long long *)hep_be_peer_buf(g, l, HEP_BUF_FLAGS);
    }
    if (g->plan->buf[HEP_BUF_EM_TOKEN].present) {
        /* the staging of every node-mate lies at the same distance from its exchange.token:
         * one shared arena, one plan */
        const long long x0 = (long long)g->plan->buf[HEP_BUF_TOKEN_X].offset;
        k->em_xoff = (long long)g->plan->buf[HEP_BUF_EM_TOKEN].offset - x0;
        k->em_poff = (long long)g->plan->buf[HEP_BUF_EM_PROB].offset - x0;
        k->em_soff = g->plan->buf[HEP_BUF_EM_SCALE].present
                         ? (long long)g->plan->buf[HEP_BUF_EM_SCALE].offset - x0
                         : 0;
    }
    if ((rc = choose_stores(g)))
        return rc;
    { /* every kernel's first launch now, before any call (kernels/probe.cu says why) */
        int e = hep_kernels_warm(k, g->dispatch_bulk);
        if (e) {
            (void)cudaGetLastError();
            return hep_fail(HEP_ERR_CUDA, "group: the first launch of the dispatch/combine "
                            "kernels on GPU %d failed: %s", g->device,
                            cudaGetErrorString((cudaError_t)e));
        }
    }
    return HEP_OK;
}

static void gpu_teardown(hep_backend_ctx *g)
{
    free(g->kargs);
    g->kargs = NULL;
    if (g->call_end)
        (void)cudaEventDestroy((cudaEvent_t)g->call_end);
    g->call_end = NULL;
}

/* A wait on another node's flag timed out: did that peer arrive at the call? Its arrival
 * word, sent ahead of the data on the same connection (word 2N + slot of the receive flags:
 * the count-block flag of dispatch, the arrival word of combine), holds its call once it
 * started. Returns the word, or 0 when it cannot be read or the stage has none. */
static unsigned long long peer_arrival(hep_backend_ctx *g, int stage, int peer, void *stream)
{
    const int combine = stage == HEP_STAGE_NODE_COMBINE || stage == HEP_STAGE_RING_COMBINE_CHUNK ||
                        stage == HEP_STAGE_RING_COMBINE_CREDIT;
    const int dispatch = stage == HEP_STAGE_NODE_DISPATCH ||
                         stage == HEP_STAGE_RING_DISPATCH_CHUNK ||
                         stage == HEP_STAGE_RING_DISPATCH_CREDIT;
    const int id = combine ? HEP_BUF_C_GROUP_FLAGS : dispatch ? HEP_BUF_D_GROUP_FLAGS : -1;
    unsigned long long v = 0;
    const int node = g->R ? peer / g->R : 0;
    if (id < 0 || g->N < 2 || node == g->node || node < 0 || node >= g->N)
        return 0;
    /* device memory: copied on the call's own stream (finished), not the legacy one */
    if (cudaMemcpyAsync(&v, (const unsigned long long *)hep_be_buf(g, id) + 2 * g->N +
                                hep_slot_of(node, g->node),
                        sizeof(v), cudaMemcpyDeviceToHost, (cudaStream_t)stream) != cudaSuccess ||
        cudaStreamSynchronize((cudaStream_t)stream) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return v;
}

/* After the stream finished: a kernel's record becomes the call's status. */
static int diag_status(hep_backend_ctx *g, const char *call, void *stream)
{
    hep_diag *d = (hep_diag *)(g->arena[HEP_ARENA_MAPPED] + g->plan->buf[HEP_BUF_DIAG].offset);
    if (d->timeout_claimed) {
        int peer = d->peer; /* a global rank */
        const unsigned long long came =
            d->via_plus1 ? 0 : peer_arrival(g, d->stage, peer, stream);
        const int ring = d->stage >= HEP_STAGE_RING_DISPATCH_CHUNK;
        const int credit = d->stage == HEP_STAGE_RING_DISPATCH_CREDIT ||
                           d->stage == HEP_STAGE_RING_COMBINE_CREDIT;
        /* a ring's words: HEP_RING_VAL(call, chunks) */
        const unsigned long long call_of = d->expected >> 24, want = d->expected & 0xffffffull;
        const unsigned long long seen_k = d->seen >> 24 == call_of ? d->seen & 0xffffffull : 0;
        if (!d->via_plus1 && ring && credit)
            snprintf(g->broken_msg, sizeof(g->broken_msg),
                     "%s timed out on rank %d after %.0f ms (HEP_TIMEOUT_MS) in %s, block %d: "
                     "waited for rank %d to free %llu chunks of this rank's ring in call %llu, "
                     "saw %llu freed: rank %d %s",
                     call, g->rank, (double)d->waited_ns / 1e6, stage_name(d->stage), d->block,
                     peer, want, call_of, seen_k, peer,
                     came < call_of ? "did not arrive"
                                    : "arrived at the call but its credit did not come");
        else if (!d->via_plus1 && ring)
            snprintf(g->broken_msg, sizeof(g->broken_msg),
                     "%s timed out on rank %d after %.0f ms (HEP_TIMEOUT_MS) in %s, block %d: "
                     "waited for chunk %llu of rank %d's ring in call %llu, saw %llu landed: "
                     "rank %d %s",
                     call, g->rank, (double)d->waited_ns / 1e6, stage_name(d->stage), d->block,
                     want ? want - 1 : 0, peer, call_of, seen_k, peer,
                     came < call_of ? "did not arrive"
                                    : "arrived at the call but the chunk did not land");
        else if (!d->via_plus1 && came >= d->expected)
            snprintf(g->broken_msg, sizeof(g->broken_msg),
                     "%s timed out on rank %d after %.0f ms (HEP_TIMEOUT_MS) in %s, block %d: "
                     "waited for rank %d, expected %llu, saw %llu: rank %d arrived at call %llu "
                     "(its arrival word came over the network) but its flag did not arrive",
                     call, g->rank, (double)d->waited_ns / 1e6, stage_name(d->stage), d->block,
                     peer, d->expected, d->seen, peer, came);
        else if (d->via_plus1 && peer == g->rank) {
            /* the missing rank is this one: its kernel came after the others gave up */
            char note[256];
            hep_stream_queue_note(note, sizeof(note), g->device, hep_kept_streams(g->device),
                                  hep_stream_queues());
            snprintf(g->broken_msg, sizeof(g->broken_msg),
                     "%s timed out on rank %d after %.0f ms in %s, block %d: it waited for rank "
                     "%d, which had given up waiting for this rank (HEP_TIMEOUT_MS): this rank's "
                     "kernel reached the call too late, because its launch was held up on the "
                     "host or because its stream queued behind other work on the GPU "
                     "(HEP_LOG_LEVEL=debug logs when each rank's kernels were launched)%s",
                     call, g->rank, (double)d->waited_ns / 1e6, stage_name(d->stage), d->block,
                     d->via_plus1 - 1, note);
        }
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
    if (d->overflow_claimed && d->overflow_dropped) { /* HEP_ASYNC: the call happened */
        const int over = d->overflow_rank, need = d->overflow_rows;
        d->overflow_claimed = 0;
        return hep_fail(HEP_WARN_IGNORED,
                        "%s: rank %d needs %d receive rows, more than config.max_recv_rows = %d "
                        "(HEP_ASYNC): the rows at or past that position of each rank's receive "
                        "order were dropped",
                        call, over, need, g->cfg->max_recv_rows);
    }
    if (d->overflow_claimed) {
        const int over = d->overflow_rank, need = d->overflow_rows;
        d->overflow_claimed = 0;
        d->invalid_claimed = 0; /* nothing happened: no warning of it either */
        return hep_fail(HEP_ERR_OVERFLOW,
                        "%s: rank %d needs %d receive rows, more than config.max_recv_rows = %d; "
                        "nothing was received on any rank and the group stays usable",
                        call, over, need, g->cfg->max_recv_rows);
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
                        g->cfg->experts_per_rank * g->world - 1);
    }
    return HEP_OK;
}

static int cuda_status(cudaError_t e, const char *what)
{
    (void)cudaGetLastError();
    return hep_fail(HEP_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

/* N > 1: the proxy's batch of the last call is done (0), or its error. */
static int proxy_done(hep_backend_ctx *g)
{
    int rc;
    const hep_diag *d =
        (const hep_diag *)(g->arena[HEP_ARENA_MAPPED] + g->plan->buf[HEP_BUF_DIAG].offset);
    if (!g->proxy || g->cfg->backend != HEP_BACKEND_GPU)
        return HEP_OK;
    /* a kernel that gave up publishes no more chunks: the batch would wait for them until
     * its own timeout (the rings' chunks become ready only as the kernels go on) */
    if (d->timeout_claimed)
        hep_proxy_cancel(g->proxy, HEP_ERR_TIMEOUT,
                         "the call's kernels gave up waiting (see the kernel's record)");
    rc = hep_proxy_wait(g->proxy);
    if (rc) {
        snprintf(g->broken_msg, sizeof(g->broken_msg), "%s", hep_last_error());
        g->broken = 1;
    }
    return rc;
}

static int finish(hep_backend_ctx *g, void *stream, unsigned flags, const char *call)
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

/* N > 1: a call on a capturing stream is refused (before anything else of it happens). */
static int refuse_capture(hep_backend_ctx *g, int phase, void *stream)
{
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    cudaError_t e = cudaStreamIsCapturing((cudaStream_t)stream, &cs);
    if (e != cudaSuccess)
        return cuda_status(e, phase ? "hep_combine" : "hep_dispatch");
    if (cs != cudaStreamCaptureStatusNone)
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "%s across %d nodes cannot be captured into a CUDA graph: the CPU proxy "
                        "posts each call's network writes (capture works with one node)",
                        phase ? "hep_combine" : "hep_dispatch", g->N);
    return HEP_OK;
}

/* N > 1 (GPU): hand the proxy this call's chunks (probs: combine carries probabilities);
 * the kernels publish them as ready. */
static int start_network(hep_backend_ctx *g, int phase, int S, void *stream, uint64_t epoch,
                         int probs)
{
    hep_proxy_chunk *ch;
    int n, rc = refuse_capture(g, phase, stream);
    if (rc)
        return rc;
    rc = proxy_done(g); /* an asynchronous call's batch before this one */
    if (rc)
        return rc;
    (void)S;
    ch = malloc(sizeof(*ch) * hep_wire_gpu_batch_max(g));
    if (!ch)
        return hep_fail(HEP_ERR_NOMEM, "%s: out of memory", phase ? "hep_combine" : "hep_dispatch");
    n = hep_wire_gpu_batch(g, phase, epoch, g->kargs->t, probs, ch);
    rc = hep_proxy_submit(g->proxy, ch, n, epoch);
    free(ch);
    return rc;
}

/* N > 1, before a call of `kind` (1 dispatch, 2 combine): two calls of one kind in a row
 * have nothing on the device that orders them (ep_kernels.h): this rank's dispatch could
 * overwrite a slot (its combine the partial sums) that a peer on another node still reads
 * for the previous call. So the previous call ends on this rank (its event: any stream,
 * HEP_ASYNC too), then every rank meets at the bootstrap's barrier, as the host backend
 * does. A call of the other kind in between orders them: then nothing is waited for. */
static int settle_same_kind(hep_backend_ctx *g, int kind, void *stream, const char *call)
{
    cudaError_t e;
    int rc;
    if (g->N < 2 || g->last_call != kind)
        return HEP_OK;
    if ((rc = refuse_capture(g, kind == 2, stream)))
        return rc;
    e = cudaEventSynchronize((cudaEvent_t)g->call_end);
    if (e != cudaSuccess)
        return cuda_status(e, call);
    rc = g->bs->barrier(g->bs->ctx);
    if (rc) {
        snprintf(g->broken_msg, sizeof(g->broken_msg), "%s", hep_last_error());
        g->broken = 1;
    }
    return rc;
}

/* N > 1, after a call of `kind` was launched on `stream`: its end, for settle_same_kind. */
static int mark_call(hep_backend_ctx *g, int kind, void *stream, const char *call)
{
    cudaError_t e;
    if (g->N < 2)
        return HEP_OK;
    e = cudaEventRecord((cudaEvent_t)g->call_end, (cudaStream_t)stream);
    if (e != cudaSuccess)
        return cuda_status(e, call);
    g->last_call = kind;
    return HEP_OK;
}

static int gpu_sync(hep_backend_ctx *g, void *stream)
{
    return finish(g, stream, 0, "an asynchronous dispatch/combine");
}

/* The result's pointers into this rank's buffers, and the kernels' device counts. */
static void fill_result(hep_backend_ctx *g, hep_dispatch_result *o)
{
    hep_kargs *k = g->kargs;
    hep_fill_dispatch_result(g, o);
    if (k) {
        o->num_recv_device = k->recv_count;
        o->tokens_per_expert_device = k->tokens_per_expert;
        o->overflow_device = k->ovf;
    }
}

/* Bytes of the rank-major outputs that a blocking dispatch copied into caller memory. */
static size_t copied_bytes(const hep_backend_ctx *g, const hep_dispatch_opts *x, int rows)
{
    const size_t n = rows > 0 ? (size_t)rows : 0, H = (size_t)g->cfg->hidden;
    const int fp8 = g->cfg->dtype == HEP_DTYPE_FP8_E4M3;
    size_t b = 0;
    if (x->recv_tokens)
        b += n * H * (fp8 ? 1 : 2);
    if (x->recv_probs)
        b += n * (size_t)g->cfg->experts_per_rank * sizeof(float);
    if (fp8 && x->recv_scales)
        b += n * (H / HEP_FP8_BLOCK) * sizeof(float);
    return b;
}

/* Whether the expert-major layout goes through the group's staging: the node's ranks are
 * in several processes, whose caller memory the node-mates cannot address (group/ep.c
 * refused it without config.max_permuted_rows). */
static int em_staged(const hep_backend_ctx *g)
{
    return !g->mates_one_process;
}

/* The expert-major arguments of a GPU dispatch (a caller handle): the handle's
 * positions and words, this rank's caller outputs (staged: its staging, and the caller's
 * outputs for the copy after the kernel); or none (em = 0). */
static void em_setup(hep_backend_ctx *g, hep_handle *h, const hep_dispatch_opts *x, int reuse, int em)
{
    hep_kargs *k = g->kargs;
    const int fp8 = g->cfg->dtype == HEP_DTYPE_FP8_E4M3;
    (void)reuse;
    k->emajor = em;
    k->em_stage = 0;
    if (!em)
        return;
    k->epos = h->d_epos;
    k->ebase = h->d_ebase;
    k->ebc = h->d_ebc;
    k->ekey = h->d_ekey;
    k->em = h->d_em;
    k->tpe64 = (long long *)h->d_tpe;
    k->em_tokens = x->recv_tokens;
    k->em_probs = x->recv_probs;
    k->em_scales = fp8 ? x->recv_scales : NULL;
    if (em_staged(g)) { /* the kernel writes the staging; k_em_stage_out the caller's */
        k->em_stage = 1;
        k->em_tokens = hep_be_buf(g, HEP_BUF_EM_TOKEN);
        k->em_probs = (float *)hep_be_buf(g, HEP_BUF_EM_PROB);
        k->em_scales = fp8 ? (float *)hep_be_buf(g, HEP_BUF_EM_SCALE) : NULL;
        k->out_tokens = x->recv_tokens;
        k->out_probs = x->recv_probs;
        k->out_scales = fp8 ? x->recv_scales : NULL;
    }
}

/* Bytes of one expert-major row in caller memory: the row, its probability, its scales. */
static size_t em_row_bytes(const hep_backend_ctx *g)
{
    const size_t H = (size_t)g->cfg->hidden;
    return g->cfg->dtype == HEP_DTYPE_FP8_E4M3 ? H + 4 + H / HEP_FP8_BLOCK * 4 : 2 * H + 4;
}

/* After an expert-major GPU dispatch (status rc): the options' outputs. Blocking: the
 * handle's words and padded tokens per expert copied to the host; HEP_ASYNC: only their
 * device addresses (the host fields are -1 / NULL). 0, or the copy's error. */
static int em_report(hep_backend_ctx *g, hep_handle *h, hep_dispatch_opts *x,
                     const hep_dispatch_args *a, int rc)
{
    const size_t El = (size_t)g->cfg->experts_per_rank;
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

/* N > 1, blocking, after the stream and the batch finished (rc: this rank's status): a
 * node's kernels decide the receive capacity from its own ranks' rows only (the rows of all
 * N lists: its own tokens and every slot), and a node whose rank needs more pushed no row
 * at all, while the other nodes received theirs (below the capacity). So every rank's
 * overflow word and needed rows reach every rank through the bootstrap's allgather (one per
 * dispatch, only with a capacity), and if any rank needs more than the capacity every rank
 * returns HEP_ERR_OVERFLOW naming the first such rank, as the host backend does, with its
 * layout void (overflow word 1, no rows, no tokens per expert). Returns the call's status. */
static int agree_capacity(hep_backend_ctx *g, void *stream, int rc)
{
    hep_kargs *k = g->kargs;
    const int W = g->world, El = g->cfg->experts_per_rank, cap = g->cfg->max_recv_rows;
    int mine[2] = {-1, -1}, *all, first = -1, over = 0, arc;
    cudaError_t e = cudaMemcpyAsync(&mine[0], k->over, sizeof(int), cudaMemcpyDeviceToHost,
                                    (cudaStream_t)stream);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(&mine[1], k->ovf + HEP_OVERFLOW_NEEDED, sizeof(int),
                            cudaMemcpyDeviceToHost, (cudaStream_t)stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize((cudaStream_t)stream);
    if (e != cudaSuccess) { /* still meet the others: they wait in the allgather */
        (void)cudaGetLastError();
        mine[0] = mine[1] = -1;
    }
    all = malloc(sizeof(mine) * (size_t)W);
    if (!all)
        return hep_fail(HEP_ERR_NOMEM, "dispatch: out of memory");
    arc = g->bs->allgather(g->bs->ctx, mine, all, sizeof(mine));
    if (arc) {
        free(all);
        snprintf(g->broken_msg, sizeof(g->broken_msg), "%s", hep_last_error());
        g->broken = 1;
        return arc;
    }
    for (int r = 0; r < W; r++)
        if (all[2 * r + 1] > cap) {
            first = first < 0 ? r : first;
            over++;
        }
    if (first >= 0 && rc != HEP_ERR_OVERFLOW && rc != HEP_OK && rc != HEP_WARN_IGNORED) {
        free(all);
        return rc; /* this rank's own failure (a timeout, CUDA) stands */
    }
    if (first < 0) {
        free(all);
        return e != cudaSuccess ? cuda_status(e, "dispatch: reading the overflow words") : rc;
    }
    {
        const int one = 1, need = all[2 * first + 1];
        int *hc = k->host_counts; /* mapped host memory; the kernels are done */
        free(all);
        /* every rank's layout void, as a node's that overflowed (its words say so already) */
        e = cudaMemcpyAsync(k->over, &one, sizeof(int), cudaMemcpyHostToDevice, (cudaStream_t)stream);
        if (e == cudaSuccess)
            e = cudaMemcpyAsync(k->ovf + HEP_OVERFLOW_DROPPED, &one, sizeof(int),
                                cudaMemcpyHostToDevice, (cudaStream_t)stream);
        if (e == cudaSuccess)
            e = cudaMemsetAsync(k->recv_count, 0, sizeof(int), (cudaStream_t)stream);
        if (e == cudaSuccess)
            e = cudaMemsetAsync(k->tokens_per_expert, 0, sizeof(int) * (size_t)El,
                                (cudaStream_t)stream);
        if (e == cudaSuccess)
            e = cudaStreamSynchronize((cudaStream_t)stream);
        if (e != cudaSuccess)
            return cuda_status(e, "dispatch: voiding the layout after a receive overflow");
        for (int j = 0; j <= El; j++)
            hc[j] = 0;
        return hep_fail(HEP_ERR_OVERFLOW,
                        "dispatch: rank %d needs %d receive rows, more than config.max_recv_rows "
                        "= %d (%d rank(s) over, agreed across %d nodes); no rank received a row "
                        "past the capacity (the nodes of the ranks over it received none), the "
                        "call's outputs are void on every rank and the group stays usable",
                        first, need, cap, over, g->N);
    }
}

/* HEP_LOG_LEVEL=debug: when each rank's kernel of a call was handed to CUDA (monotonic ms,
 * the stream), so that a timeout naming a rank that "did not arrive" can be told apart into
 * a launch that came late (the host thread held up) and a launched kernel that the GPU
 * started late (its stream queued behind other work). */
static void launch_log(const hep_backend_ctx *g, const char *phase, unsigned long long call,
                       void *stream, int done)
{
    if (hep_log_enabled(HEP_LOG_DEBUG))
        hep_log(HEP_LOG_DEBUG, "rank %d: %s call %llu: kernel %s on stream %p at %.3f ms",
                g->rank, phase, call, done ? "launched" : "launching", stream, hep_now_ms());
}

/* The GPU dispatch. x: the options (NULL: none); h: the caller handle to record into or,
 * with HEP_REUSE_LAYOUT, to read (NULL: the one-shot layout in the group's buffers). */
static int gpu_dispatch(hep_backend_ctx *g, const hep_dispatch_args *a, hep_dispatch_opts *x,
                        hep_handle *h, hep_dispatch_result *o)
{
    hep_kargs *k = g->kargs;
    const int reuse = (a->flags & HEP_REUSE_LAYOUT) != 0;
    const int em = h && (reuse ? h->layout : (int)x->layout) == HEP_LAYOUT_EXPERT_MAJOR;
    const int copy = x && !em && (x->recv_tokens || x->recv_probs ||
                                  (x->recv_scales && g->cfg->dtype == HEP_DTYPE_FP8_E4M3));
    int rc;
    use_layout(g, h);
    em_setup(g, h, x, reuse, em);
    /* across nodes a reuse lays out anew from the handle's recorded routing (the same
     * layout: a function of every rank's routing), into the handle */
    k->reuse = reuse && g->N == 1;
    k->cap = g->cfg->max_recv_rows;
    k->drop = k->cap && (a->flags & HEP_ASYNC) && !em; /* expert-major: all or nothing */
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
        if ((rc = settle_same_kind(g, 1, a->stream, "hep_dispatch")))
            return rc;
        use_ring(g, 0);
        rc = start_network(g, 0, g->cfg->dispatch_sms, a->stream, g->epoch + 1, em);
        if (rc)
            return rc;
        rc = hep_launch_node_pack(k, g->cfg->dispatch_sms, a->stream);
        if (rc)
            return cuda_status((cudaError_t)rc, "hep_dispatch: kernel launch");
    }
    launch_log(g, "dispatch", g->epoch + 1, a->stream, 0);
    rc = g->dispatch_bulk ? hep_launch_dispatch_bulk(k, g->cfg->dispatch_sms, a->stream)
                          : hep_launch_dispatch(k, g->cfg->dispatch_sms, a->stream);
    launch_log(g, "dispatch", g->epoch + 1, a->stream, 1);
    if (rc == 0 && em && k->em_stage)
        rc = hep_launch_em_stage_out(k, 64, a->stream);
    if (rc == 0 && copy) {
        k->out_tokens = x->recv_tokens;
        k->out_probs = x->recv_probs;
        k->out_scales = x->recv_scales;
        rc = hep_launch_copy_out(k, 64, a->stream);
    }
    if (rc)
        return cuda_status((cudaError_t)rc, "hep_dispatch: kernel launch");
    if ((rc = mark_call(g, 1, a->stream, "hep_dispatch")))
        return rc;
    g->last_t = a->num_tokens;
    g->x_epoch = ++g->epoch; /* exchange.token holds this call's rows */
    if (em)
        g->x_epoch = 0; /* the expert-major rows are in caller memory only */
    g->last_handle = h ? 0 : hep_handle_of(g, g->epoch);
    if (h)
        h->epoch = g->epoch;
    fill_result(g, o);
    o->handle = g->last_handle;
    rc = finish(g, a->stream, a->flags, "dispatch");
    if (g->N > 1 && k->cap && !(a->flags & HEP_ASYNC))
        rc = agree_capacity(g, a->stream, rc);
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

/* The GPU combine with handle h (NULL: the one-shot layout in the group's buffers) and,
 * with c, the probabilities. The caller's expert outputs (and probs_in) are copied into
 * the group's exchange buffers, where the node-mates pull them; expert_out ==
 * hep_combine_input(g) skips that copy, which is right only while the buffer still holds
 * the rows of h's dispatch and no combine ran since (else a node-mate may still read it). */
static int gpu_combine(hep_backend_ctx *g, const hep_combine_args *a, const hep_handle *h,
                       const hep_combine_opts *c)
{
    hep_kargs *k = g->kargs;
    const void *x = hep_be_buf(g, HEP_BUF_TOKEN_X);
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
    if (g->N > 1)
        use_ring(g, 1);
    k->emajor = em;
    k->cap = g->cfg->max_recv_rows; /* rows at or past it were dropped: not read */
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
    k->x_stride_in = g->cfg->hidden * 2;
    k->em_stage = em && em_staged(g);
    if (em) { /* read where they are: the node-mates' kernels take these pointers (staged:
                 copied into this rank's staging first, where they read them) */
        k->epos = h->d_epos;
        k->ekey = h->d_ekey;
        k->em = h->d_em;
        k->combine_in = a->expert_out;
    }
    /* across nodes combine's network words carry its own count (ep_kernels.h): the
     * kernel's c = *cepoch + 1, combines made + 1 here (every launched combine ends with
     * cepoch = c, or the group is broken) */
    if (g->N > 1 && ((rc = settle_same_kind(g, 2, a->stream, "hep_combine")) ||
                     (rc = start_network(g, 1, g->cfg->combine_sms, a->stream,
                                         g->combine_epoch + 1, k->probs_out != NULL))))
        return rc;
    if (!em && (k->combine_in || k->probs_in))
        rc = hep_launch_copy_in(k, 64, a->stream);
    if (k->em_stage)
        rc = hep_launch_em_stage_in(k, 64, a->stream);
    if (rc == 0) {
        launch_log(g, "combine", g->combine_epoch + 1, a->stream, 0);
        rc = hep_launch_combine(k, g->cfg->combine_sms, a->stream);
        launch_log(g, "combine", g->combine_epoch + 1, a->stream, 1);
    }
    if (rc)
        return cuda_status((cudaError_t)rc, "hep_combine: kernel launch");
    g->combine_epoch++;
    if ((rc = mark_call(g, 2, a->stream, "hep_combine")))
        return rc;
    g->x_epoch = 0; /* from now on a node-mate may still read the buffer */
    return finish(g, a->stream, a->flags, "combine");
}

/* The GPU half of hep_group_get_stats: the last dispatch's device timestamps. One place,
 * so that where the kernels keep their record can change. */
static void gpu_fill_stats(const hep_backend_ctx *g, hep_group_stats *s)
{
    if (g->cfg->backend == HEP_BACKEND_GPU && g->arena[HEP_ARENA_MAPPED]) {
        const hep_diag *d =
            (const hep_diag *)(g->arena[HEP_ARENA_MAPPED] + g->plan->buf[HEP_BUF_DIAG].offset);
        s->dispatch_start_ns = d->t_start;
        s->layout_ready_ns = d->t_layout;
    }
}

/* The GPU layout of a handle: one allocation on the group's GPU. */
static int handle_device(const hep_backend_ctx *g, struct hep_handle *h)
{
    const size_t T = (size_t)g->cfg->max_tokens, K = (size_t)g->cfg->max_topk;
    const size_t R = (size_t)g->R, El = (size_t)g->cfg->experts_per_rank;
    const size_t S = (size_t)g->cfg->dispatch_sms, N = (size_t)g->N, W = (size_t)g->world;
    /* rank-major: rows of the N lists, meta, counts, ids, weights; expert-major: positions,
     * bases and the blocks' counts of each list, the words and padding ranges; the receive
     * capacity's 3 words; across nodes the own tokens' rows in each node's slot and the
     * slots' sizes, then the keys of the slots' expert-major rows; then the int64 tokens
     * per expert */
    const size_t ints = T * W + W + 2 + El + T * K + T * K + N * T * K + N * R * El +
                        N * S * R * El + HEP_EM_WORDS + 2 * El + 3 + T * N + N +
                        (N - 1) * T * K;
    const size_t ints8 = (ints + 1) & ~(size_t)1, bytes = ints8 * 4 + El * 8;
    int prev = -1;
    cudaError_t e = cudaGetDevice(&prev);
    if (e == cudaSuccess && prev != g->device)
        e = cudaSetDevice(g->device);
    if (e == cudaSuccess)
        e = cudaMalloc(&h->dev, bytes);
    /* cleared on the legacy stream and waited for here: cudaMemset of device memory returns
     * before it is done, and a first dispatch on a non-blocking stream is not ordered after
     * it (the legacy stream waits for blocking streams only, so not for the kernels) */
    if (e == cudaSuccess)
        e = cudaMemset(h->dev, 0, bytes);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(cudaStreamLegacy);
    if (prev >= 0 && prev != g->device)
        (void)cudaSetDevice(prev); /* the caller's device back, whatever happened */
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        if (h->dev)
            (void)cudaFree(h->dev);
        h->dev = NULL;
        return hep_fail(e == cudaErrorMemoryAllocation ? HEP_ERR_NOMEM : HEP_ERR_CUDA,
                        "hep_handle_create: %zu bytes of device memory on GPU %d: %s", bytes,
                        g->device, cudaGetErrorString(e));
    }
    h->d_rows = (int *)h->dev;
    h->d_meta = h->d_rows + T * W;
    h->d_counts = h->d_meta + W;
    h->d_ids = h->d_counts + 2 + El;
    h->d_w = (float *)(h->d_ids + T * K);
    h->d_epos = (int *)(h->d_w + T * K);
    h->d_ebase = h->d_epos + N * T * K;
    h->d_ebc = h->d_ebase + N * R * El;
    h->d_em = h->d_ebc + N * S * R * El;
    h->d_drop = h->d_em + HEP_EM_WORDS + 2 * El;
    h->d_npos = h->d_drop + 3;
    h->d_slots = h->d_npos + T * N;
    h->d_ekey = h->d_slots + N;
    h->d_tpe = (int64_t *)((int *)h->dev + ints8);
    return HEP_OK;
}

const hep_backend_ops hep_gpu_backend = {
    .name = "gpu",
    .setup = gpu_setup,
    .teardown = gpu_teardown,
    .handle_alloc = handle_device,
    .dispatch = gpu_dispatch,
    .combine = gpu_combine,
    .sync = gpu_sync,
    .fill_stats = gpu_fill_stats,
};
