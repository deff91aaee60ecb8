/* GPU tests (an H200 or any sm_90 / sm_100 device): the kernels against the host backend
 * and the global oracle on fresh random inputs, outputs poisoned first, every element
 * checked; graph replay against eager calls; the timeout naming a missing rank; the real
 * DMA-BUF export; create/destroy with device memory; the kept per-rank streams. Without a
 * GPU every test skips with the reason. HEP_GPU_TEST_SMALL=1 runs only small cases (for
 * compute-sanitizer). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <cuda_runtime_api.h>
#include <infiniband/verbs.h>

#include "bootstrap/stream.h"
#include "core/core.h"
#include "ep_case.h"
#include "fake_mr.h"
#include "group/group.h"
#include "net/net.h"
#include "ranks.h"
#include "test_filter.h"

static int have_gpu(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        print_message("skipped: no CUDA GPU on this machine\n");
        return 0;
    }
    return 1;
}

static int small_only(void)
{
    const char *v = getenv("HEP_GPU_TEST_SMALL");
    return v && *v == '1';
}

#define CK(x)                                                                                    \
    do {                                                                                         \
        cudaError_t e_ = (x);                                                                    \
        if (e_ != cudaSuccess) {                                                                 \
            snprintf(o->err, sizeof(o->err), "%s:%d %s: %s", __FILE__, __LINE__, #x,           \
                     cudaGetErrorString(e_));                                                    \
            o->rc_dispatch = HEP_ERR_CUDA;                                                       \
            goto out;                                                                            \
        }                                                                                        \
    } while (0)

typedef struct gpu_opts {
    int graph; /* capture dispatch + combine into a graph and replay `replays` times */
    int replays;
    int ranks_per_gpu; /* 0: every rank on GPU 0; else rank r on GPU r / ranks_per_gpu */
} gpu_opts;
static gpu_opts g_opts;
static int g_hold_rank = -1; /* >= 0: that rank's proxy returns no credit (a test hook) */

static size_t esz(const ep_case *c)
{
    return c->cfg.dtype == HEP_DTYPE_FP8_E4M3 ? 1 : 2;
}

static void fill_expert_out(uint16_t *p, int rank, int rows, int H)
{
    for (int j = 0; j < rows; j++)
        for (int h = 0; h < H; h++)
            p[(size_t)j * H + h] = ep_expert_value(rank, j, h);
}

static int run_rank_gpu(rank_ctx *rc)
{
    ep_case *c = rc->arg;
    ep_rank_in *in = &c->in[rc->rank];
    ep_rank_out *o = &c->out[rc->rank];
    const int H = c->cfg.hidden, El = c->cfg.experts_per_rank, ns = H / 128;
    const size_t rb = (size_t)H * esz(c), ib = c->index64 ? 8 : 4;
    hep_group *g = NULL;
    cudaStream_t st = NULL;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    void *d_tok = NULL, *d_idx = NULL, *d_eo = NULL, *d_out = NULL;
    float *d_sc = NULL, *d_w = NULL;
    hep_dispatch_args da;
    hep_dispatch_result dr;
    hep_combine_args ca;
    size_t maxr;
    int rc0;
    uint16_t *eager = NULL; /* the last eager call's combine output: every replay must equal it */
    int eager_recv = -1, replay_bad = 0;

    const int dev = g_opts.ranks_per_gpu ? rc->rank / g_opts.ranks_per_gpu : 0;
    CK(cudaSetDevice(dev));
    if (g_hold_rank >= 0) {
        hep_group_hooks hooks;
        memset(&hooks, 0, sizeof(hooks)); /* the NIC HEP_NIC names, as hep_group_create */
        hooks.hold_credits = rc->rank == g_hold_rank;
        rc0 = hep_group_create_ex(&c->cfg, &rc->bs, dev, &hooks, &g);
    } else {
        rc0 = hep_group_create(&c->cfg, &rc->bs, dev, &g);
    }
    if (rc0) {
        o->rc_dispatch = rc0;
        snprintf(o->err, sizeof(o->err), "create: %s", hep_last_error());
        return rc0;
    }
    maxr = g->plan.max_recv_rows;
    rc0 = hep_inproc_stream(dev, rc->rank, (void **)&st);
    if (rc0) {
        o->rc_dispatch = rc0;
        snprintf(o->err, sizeof(o->err), "stream: %s", hep_last_error());
        goto out;
    }
    CK(cudaMalloc(&d_tok, rb * (size_t)in->t + 16));
    CK(cudaMalloc((void **)&d_sc, sizeof(float) * (size_t)(ns + 1) * (size_t)(in->t + 1)));
    CK(cudaMalloc(&d_idx, ib * (size_t)c->K * (size_t)(in->t + 1)));
    CK(cudaMalloc((void **)&d_w, sizeof(float) * (size_t)c->K * (size_t)(in->t + 1)));
    CK(cudaMalloc(&d_eo, (size_t)H * 2 * maxr));
    CK(cudaMalloc(&d_out, (size_t)H * 2 * (size_t)(in->t + 1)));
    CK(cudaMemcpy(d_tok, in->tokens, rb * (size_t)in->t, cudaMemcpyHostToDevice));
    if (c->cfg.dtype == HEP_DTYPE_FP8_E4M3)
        CK(cudaMemcpy(d_sc, in->scales, sizeof(float) * (size_t)ns * (size_t)in->t,
                      cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_idx, in->idx, ib * (size_t)c->K * (size_t)in->t, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_w, in->weights, sizeof(float) * (size_t)c->K * (size_t)in->t,
                  cudaMemcpyHostToDevice));
    { /* the expert outputs, a function of (rank, row, channel), for every possible row */
        uint16_t *h = malloc((size_t)H * 2 * maxr);
        fill_expert_out(h, rc->rank, (int)maxr, H);
        CK(cudaMemcpy(d_eo, h, (size_t)H * 2 * maxr, cudaMemcpyHostToDevice));
        free(h);
    }
    da = ep_case_args(c, in->t, d_tok, d_sc, d_idx, d_w, st);
    for (int rep = 0; rep < (c->repeat ? c->repeat : 1) + (g_opts.graph ? g_opts.replays : 0);
         rep++) {
        int replay = g_opts.graph && rep >= (c->repeat ? c->repeat : 1);
        /* poison every output the call must write */
        CK(cudaMemsetAsync(hep_my_buf(g, HEP_BUF_TOKEN_X), 0xff, g->plan.buf[HEP_BUF_TOKEN_X].bytes, st));
        CK(cudaMemsetAsync(hep_my_buf(g, HEP_BUF_RECV_PROB), 0xff, g->plan.buf[HEP_BUF_RECV_PROB].bytes, st));
        if (g->plan.buf[HEP_BUF_RECV_SCALE].present)
            CK(cudaMemsetAsync(hep_my_buf(g, HEP_BUF_RECV_SCALE), 0xff,
                               g->plan.buf[HEP_BUF_RECV_SCALE].bytes, st));
        CK(cudaMemsetAsync(d_out, 0xff, (size_t)H * 2 * (size_t)in->t, st));
        CK(cudaStreamSynchronize(st));
        rc->bs.barrier(rc->bs.ctx); /* nobody writes into a buffer being poisoned */
        if (rc->rank == c->skip_rank) {
            /* this rank never calls dispatch; it joins destroy once the others gave up */
            for (int spin = 0; spin < 400000 && __atomic_load_n(&c->gave_up, __ATOMIC_ACQUIRE) <
                                                    c->world - 1;
                 spin++)
                usleep(100);
            break;
        }
        if (replay) {
            if (!exec) {
                da.flags = HEP_ASYNC;
                CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                o->rc_dispatch = hep_dispatch(g, &da, &dr);
                memset(&ca, 0, sizeof(ca));
                ca.handle = dr.handle;
                ca.expert_out = d_eo; /* copied in on the device: the count is not known here */
                ca.out = d_out;
                ca.stream = st;
                ca.flags = HEP_ASYNC;
                o->rc_combine = hep_combine(g, &ca);
                CK(cudaStreamEndCapture(st, &graph));
                CK(cudaGraphInstantiate(&exec, graph, 0));
                if (o->rc_dispatch || o->rc_combine) {
                    snprintf(o->err, sizeof(o->err), "capture: %s", hep_last_error());
                    break;
                }
            }
            CK(cudaGraphLaunch(exec, st));
            o->rc_dispatch = hep_group_sync(g, st);
            o->rc_combine = o->rc_dispatch;
            if (o->rc_dispatch && !replay_bad++) /* its reason; the ranks go on in step */
                snprintf(o->err, sizeof(o->err), "replay %d: %s",
                         rep - (c->repeat ? c->repeat : 1), hep_last_error());
            o->num_recv = dr.host_counts[0];
        } else {
            da.flags = 0;
            if (ep_case_dispatch(c, o, g, &da, &dr))
                break;
            o->num_recv = dr.num_recv;
        }
        free(o->tokens), free(o->probs), free(o->scales), free(o->tpe);
        o->tpe = calloc((size_t)El, sizeof(int));
        CK(cudaMemcpy(o->tpe, dr.tokens_per_expert_device, sizeof(int) * (size_t)El,
                      cudaMemcpyDeviceToHost));
        o->tokens = malloc(rb * (size_t)o->num_recv + 1);
        o->probs = malloc(sizeof(float) * (size_t)El * (size_t)o->num_recv + 1);
        if (!replay) {
            CK(cudaMemcpy(o->tokens, dr.tokens, rb * (size_t)o->num_recv, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(o->probs, dr.probs, sizeof(float) * (size_t)El * (size_t)o->num_recv,
                          cudaMemcpyDeviceToHost));
            if (dr.scales) {
                o->scales = malloc(sizeof(float) * (size_t)ns * (size_t)o->num_recv + 1);
                CK(cudaMemcpy(o->scales, dr.scales, sizeof(float) * (size_t)ns * (size_t)o->num_recv,
                              cudaMemcpyDeviceToHost));
            }
            rc->bs.barrier(rc->bs.ctx); /* all copied out before any X is overwritten */
            memset(&ca, 0, sizeof(ca));
            ca.handle = dr.handle;
            ca.out = d_out;
            ca.stream = st;
            if (c->zero_copy) {
                /* on this rank's stream: a D2D cudaMemcpy may return before it is done */
                CK(cudaMemcpyAsync(hep_combine_input(g), d_eo, (size_t)H * 2 * (size_t)o->num_recv,
                                   cudaMemcpyDeviceToDevice, st));
                ca.expert_out = hep_combine_input(g);
            } else {
                ca.expert_out = d_eo;
            }
            o->rc_combine = hep_combine(g, &ca);
            if (o->rc_combine) {
                snprintf(o->err, sizeof(o->err), "%s", hep_last_error());
                break;
            }
        } else {
            /* the graph overwrote X with the expert outputs: rows are not checked here;
             * the counts and the last replay's combine output are */
            memset(o->tokens, 0, rb * (size_t)o->num_recv);
        }
        free(o->expert_out), free(o->combined);
        o->expert_out = malloc((size_t)H * 2 * (size_t)o->num_recv + 16);
        fill_expert_out(o->expert_out, rc->rank, o->num_recv, H);
        o->combined = malloc((size_t)H * 2 * (size_t)in->t + 16);
        CK(cudaMemcpy(o->combined, d_out, (size_t)H * 2 * (size_t)in->t, cudaMemcpyDeviceToHost));
        if (replay && (o->num_recv != eager_recv ||
                       memcmp(o->combined, eager, (size_t)H * 2 * (size_t)in->t))) {
            /* each replay's output was poisoned first: a replay that did not run, or ran on
             * stale state, differs here (the ranks go on in step; the failure is reported
             * after the last replay) */
            if (!replay_bad) {
                size_t first = 0, ndiff = 0, n = (size_t)H * (size_t)in->t;
                for (size_t k = n; k-- > 0;)
                    if (o->combined[k] != eager[k])
                        first = k, ndiff++;
                snprintf(o->err, sizeof(o->err),
                         "replay %d: %d rows received (eager: %d); %zu of %zu combine output "
                         "values differ from the eager call's, the first at token %zu channel "
                         "%zu: 0x%04x, eager 0x%04x",
                         rep - (c->repeat ? c->repeat : 1), o->num_recv, eager_recv, ndiff, n,
                         first / (size_t)H, first % (size_t)H, o->combined[first], eager[first]);
            }
            replay_bad++;
        }
        if (!replay && g_opts.graph) {
            free(eager);
            eager = malloc((size_t)H * 2 * (size_t)in->t + 16);
            if (!eager) {
                snprintf(o->err, sizeof(o->err), "out of host memory");
                o->rc_combine = HEP_ERR_NOMEM;
                break;
            }
            memcpy(eager, o->combined, (size_t)H * 2 * (size_t)in->t);
            eager_recv = o->num_recv;
        }
        rc->bs.barrier(rc->bs.ctx);
    }
out:
    free(eager);
    if (replay_bad && !o->rc_combine)
        o->rc_combine = HEP_ERR_INTERNAL;
    if (exec)
        cudaGraphExecDestroy(exec);
    if (graph)
        cudaGraphDestroy(graph);
    cudaFree(d_tok), cudaFree(d_sc), cudaFree(d_idx), cudaFree(d_w), cudaFree(d_eo), cudaFree(d_out);
    hep_group_destroy(g);
    return 0;
}

/* Runs the case on the GPU and on the host backend; checks both against the oracle and
 * each other (the host backend is the reference; results must be identical). */
static int run_gpu_and_host(ep_case *c, const char *label)
{
    static ep_case h;
    rank_ctx ctx[EP_MAX_RANKS];
    int bad;
    c->cfg.backend = HEP_BACKEND_GPU;
    if (run_ranks(c->world, run_rank_gpu, c, ctx))
        return -1;
    for (int r = 0; r < c->world; r++)
        if (c->out[r].rc_dispatch || c->out[r].rc_combine) {
            print_message("%s: rank %d: %s\n", label, r, c->out[r].err);
            return -1;
        }
    bad = g_opts.graph ? 0 : ep_case_check(c);
    /* the same inputs through the host backend */
    memcpy(&h, c, sizeof(h));
    memset(h.out, 0, sizeof(h.out));
    h.cfg.backend = HEP_BACKEND_HOST;
    h.repeat = 1;
    bad += ep_case_run(&h) != 0;
    for (int r = 0; r < c->world; r++)
        if (h.out[r].rc_dispatch || h.out[r].rc_combine) {
            print_message("%s: host backend, rank %d: %s\n", label, r, h.out[r].err);
            return -1;
        }
    for (int r = 0; r < c->world; r++) {
        const ep_rank_out *a = &c->out[r], *b = &h.out[r];
        size_t rb = (size_t)c->cfg.hidden * esz(c);
        if (a->num_recv != b->num_recv || memcmp(a->tpe, b->tpe, sizeof(int) * c->cfg.experts_per_rank)) {
            print_message("%s: rank %d: %d rows vs host %d\n", label, r, a->num_recv, b->num_recv);
            bad++;
            continue;
        }
        if (!g_opts.graph && (memcmp(a->tokens, b->tokens, rb * a->num_recv) ||
                              memcmp(a->probs, b->probs, 4 * (size_t)c->cfg.experts_per_rank * a->num_recv))) {
            print_message("%s: rank %d: dispatch output differs from the host backend\n", label, r);
            bad++;
        }
        if (memcmp(a->combined, b->combined, (size_t)c->cfg.hidden * 2 * c->in[r].t)) {
            print_message("%s: rank %d: combine output differs from the host backend\n", label, r);
            bad++;
        }
    }
    for (int r = 0; r < c->world; r++) {
        ep_rank_out *o = &h.out[r];
        free(o->tokens), free(o->probs), free(o->scales), free(o->tpe), free(o->expert_out);
        free(o->combined);
    }
    print_message("%s: %s\n", label, bad ? "MISMATCH" : "all outputs equal to the host backend and the oracle");
    return bad;
}

static hep_config gcfg(int H, int T, int El, int K, hep_dtype dt, int R)
{
    hep_config c = test_config(H, T, El, K, dt);
    c.ranks_per_node = R;
    c.dispatch_sms = 128 / R > 16 ? 16 : 128 / R;
    c.combine_sms = c.dispatch_sms;
    return c;
}

/* gpu_case's SMs a rank's kernel when nonzero (else its own rule: at most 16). */
static int g_case_sms;

/* N nodes x R ranks on the one GPU (N > 1: over the loopback NIC, with the registrations
 * HEP_GPU_MR_MODE asks for), against the host backend and the oracle; chunk: the
 * inter-node rings' config.chunk_tokens (HEP_CHUNK_DEFAULT: the backend's). */
static void gpu_case(int N, int R, hep_dtype dt, int skew, int index64, int zero_copy, int tmode,
                     unsigned seed, int H, int T, int chunk)
{
    static ep_case c;
    char label[192];
    memset(&c, 0, sizeof(c));
    c.cfg = gcfg(H, T, N * R == 1 ? 8 : 4, 8, dt, R); /* one rank: as many experts as K */
    c.cfg.chunk_tokens = chunk;
    if (g_opts.ranks_per_gpu) { /* ranks spread over GPUs: SMs left for the NICs' copies */
        const int on_gpu = N * R < g_opts.ranks_per_gpu ? N * R : g_opts.ranks_per_gpu;
        c.cfg.dispatch_sms = c.cfg.combine_sms = 96 / on_gpu > 16 ? 16 : 96 / on_gpu;
    } else {
        c.cfg.dispatch_sms = c.cfg.combine_sms = 128 / (N * R) > 16 ? 16 : 128 / (N * R);
    }
    if (g_case_sms)
        c.cfg.dispatch_sms = c.cfg.combine_sms = g_case_sms;
    c.world = N * R;
    c.K = 8;
    c.index64 = index64;
    c.zero_copy = zero_copy;
    c.skip_rank = -1;
    c.repeat = 2;
    c.has_t_fixed = tmode >= 0;
    c.t_fixed = tmode == 1 ? T : 0;
    ep_case_random(&c, seed, skew);
    snprintf(label, sizeof(label),
             "%d node%s x %d ranks x %d SMs %s %s %s %s t=%s H=%d T=%d chunk=%d seed=%u", N,
             N > 1 ? "s" : "", R, c.cfg.dispatch_sms, dt == HEP_DTYPE_FP8_E4M3 ? "fp8" : "bf16",
             skew == EP_ROUTE_NODES ? "node-mixed" : skew ? "skewed" : "uniform",
             index64 ? "int64" : "int32", zero_copy ? "zero-copy" : "copy",
             tmode < 0 ? "random" : tmode ? "T" : "0", H, T, chunk, seed);
    assert_int_equal(run_gpu_and_host(&c, label), 0);
    ep_case_free(&c);
}

static void one_case(int R, hep_dtype dt, int skew, int index64, int zero_copy, int tmode,
                     unsigned seed, int H, int T)
{
    gpu_case(1, R, dt, skew, index64, zero_copy, tmode, seed, H, T, HEP_CHUNK_DEFAULT);
}

static void node_case(int N, int R, hep_dtype dt, int index64, int tmode, unsigned seed, int H,
                      int T)
{
    gpu_case(N, R, dt, EP_ROUTE_NODES, index64, 0, tmode, seed, H, T, HEP_CHUNK_DEFAULT);
}

/* The inter-node slots as rings of 2 chunks of `chunk` tokens that hold less than a slot
 * (2 x chunk < T): every call streams several chunks per ring through credits, and each
 * case runs its calls twice (credits across calls). */
static void ring_case(int N, int R, hep_dtype dt, int index64, int tmode, unsigned seed, int H,
                      int T, int chunk)
{
    assert_true(2 * chunk < T);
    gpu_case(N, R, dt, EP_ROUTE_NODES, index64, 0, tmode, seed, H, T, chunk);
}

static unsigned fresh_seed(void)
{
    return (unsigned)time(NULL) ^ (unsigned)getpid() * 2654435761u;
}

/* A GPU case's start: skipped without a GPU, else its fresh seed (fresh_seed() ^ salt),
 * printed so that a failure can be replayed. */
static unsigned gpu_seed(unsigned salt)
{
    const unsigned seed = fresh_seed() ^ salt;
    if (!have_gpu())
        skip();
    print_message("fresh seed %u\n", seed);
    return seed;
}

static void gpu_kernels_match_host_backend_across_ranks_dtypes_and_routing(void **state)
{
    const unsigned seed = gpu_seed(0u);
    (void)state;
    if (small_only()) {
        one_case(2, HEP_DTYPE_BF16, 0, 0, 0, -1, seed, 256, 32);
        one_case(2, HEP_DTYPE_FP8_E4M3, 1, 1, 1, -1, seed + 1, 256, 32);
        return;
    }
    for (int R = 2; R <= 8; R *= 2) {
        one_case(R, HEP_DTYPE_BF16, 0, 0, 0, -1, seed + (unsigned)R, 7168, 512);
        one_case(R, HEP_DTYPE_FP8_E4M3, 0, 1, 1, -1, seed + 10u + (unsigned)R, 7168, 512);
        one_case(R, HEP_DTYPE_BF16, 1, 1, 1, 1, seed + 20u + (unsigned)R, 4096, 256); /* t = T */
        one_case(R, HEP_DTYPE_FP8_E4M3, 1, 0, 0, 0, seed + 30u + (unsigned)R, 2048, 64); /* t = 0 */
    }
    one_case(8, HEP_DTYPE_BF16, 0, 0, 1, 1, seed + 99u, 7168, 4096); /* the bench size */
}

static void gpu_virtual_nodes_match_host_backend_over_loopback_nic_with_dmabuf(void **state)
{
    const unsigned seed = gpu_seed(0x5bd1e995u);
    (void)state;
    setenv("HEP_GPU_MR_MODE", "dmabuf", 1); /* the real export feeds the loopback NIC */
    hep_env_reload();
    if (small_only()) {
        node_case(2, 2, HEP_DTYPE_BF16, 0, -1, seed, 256, 32);
        node_case(2, 1, HEP_DTYPE_FP8_E4M3, 1, -1, seed + 1, 256, 32);
    } else {
        node_case(2, 4, HEP_DTYPE_BF16, 0, -1, seed, 7168, 512);
        node_case(2, 4, HEP_DTYPE_FP8_E4M3, 1, -1, seed + 1, 7168, 512);
        node_case(4, 2, HEP_DTYPE_BF16, 1, 1, seed + 2, 4096, 256); /* t = T */
        node_case(4, 2, HEP_DTYPE_FP8_E4M3, 0, -1, seed + 3, 7168, 512);
        node_case(4, 2, HEP_DTYPE_BF16, 0, 0, seed + 4, 1024, 64); /* t = 0 */
        node_case(2, 4, HEP_DTYPE_BF16, 0, 1, seed + 5, 7168, 4096); /* the bench size */
    }
    unsetenv("HEP_GPU_MR_MODE");
    hep_env_reload();
}

/* The inter-node rings smaller than a slot: C = 1, 3, 16, 64 on 2 x 2, 2 x 4, 4 x 2, BF16
 * and FP8, random t, t = T and t = 0, each case's calls twice (credits across calls). */
static void gpu_virtual_nodes_rings_of_chunks_match_host_backend(void **state)
{
    const unsigned seed = gpu_seed(0x2545f491u);
    (void)state;
    setenv("HEP_GPU_MR_MODE", "dmabuf", 1);
    hep_env_reload();
    if (small_only()) {
        ring_case(2, 2, HEP_DTYPE_BF16, 0, -1, seed, 256, 32, 3);
        ring_case(2, 1, HEP_DTYPE_FP8_E4M3, 1, -1, seed + 1, 256, 32, 1);
    } else {
        ring_case(2, 2, HEP_DTYPE_BF16, 0, -1, seed + 6, 256, 64, 1);
        ring_case(2, 2, HEP_DTYPE_FP8_E4M3, 1, 1, seed + 7, 512, 64, 1); /* t = T */
        ring_case(2, 4, HEP_DTYPE_FP8_E4M3, 0, -1, seed + 8, 1024, 96, 3);
        ring_case(2, 4, HEP_DTYPE_BF16, 1, 1, seed + 9, 2048, 512, 64); /* t = T */
        ring_case(4, 2, HEP_DTYPE_BF16, 0, -1, seed + 10, 1024, 256, 16);
        ring_case(4, 2, HEP_DTYPE_FP8_E4M3, 1, 1, seed + 11, 2048, 512, 64); /* t = T */
        ring_case(4, 2, HEP_DTYPE_BF16, 0, 0, seed + 12, 1024, 64, 3); /* t = 0 */
        ring_case(4, 2, HEP_DTYPE_BF16, 0, 1, seed + 13, 2048, 256, 3); /* t = T */
    }
    unsetenv("HEP_GPU_MR_MODE");
    hep_env_reload();
}

/* ep_many_nodes_cases (ep_case.h) against the host backend and the oracle. Every virtual
 * rank is a thread with its own stream and its loopback NIC's stream, and a GPU has 32
 * hardware queues (CUDA_DEVICE_MAX_CONNECTIONS at most 32): past 16 co-dependent ranks on
 * one GPU two streams share a queue and a kernel can wait behind one that waits for it. So
 * the ranks are spread, 16 to a GPU (node-mates on one), and a case runs only where the
 * machine has the GPUs it needs. */
static void gpu_many_nodes_beyond_one_warp_match_host_backend(void **state)
{
    const int per_gpu = 16;
    unsigned seed = fresh_seed() ^ 0x2545f491u;
    int ngpu = 0, ran = 0;
    (void)state;
    if (!have_gpu())
        skip();
    if (small_only()) {
        print_message("skipped: 40 to 128 virtual ranks with their proxies are too slow under "
                      "compute-sanitizer (HEP_GPU_TEST_SMALL=1)\n");
        skip();
    }
    if (cudaGetDeviceCount(&ngpu) != cudaSuccess)
        ngpu = 0;
    print_message("fresh seed %u, %d GPU(s)\n", seed, ngpu);
    assert_int_equal(HEP_MAX_NODES_GPU, 128);
    setenv("HEP_GPU_MR_MODE", "dmabuf", 1);
    hep_env_reload();
    g_opts.ranks_per_gpu = per_gpu;
    for (size_t k = 0; k < EP_MANY_NODES_CASES; k++) {
        const ep_many_nodes_case *mc = &ep_many_nodes_cases[k];
        const int W = mc->N * mc->R, need = (W + per_gpu - 1) / per_gpu;
        assert_true(mc->N > 32 && W <= EP_MAX_RANKS && per_gpu % mc->R == 0);
        if (need > ngpu) {
            print_message("%d nodes x %d: not run: %d virtual ranks need %d GPUs (%d a GPU), "
                          "this machine has %d\n", mc->N, mc->R, W, need, per_gpu, ngpu);
            continue;
        }
        gpu_case(mc->N, mc->R, mc->dt, mc->skew, mc->index64, 0, mc->t_is_T ? 1 : -1,
                 seed + (unsigned)k, 256, 16, HEP_CHUNK_DEFAULT);
        ran++;
    }
    g_opts.ranks_per_gpu = 0;
    unsetenv("HEP_GPU_MR_MODE");
    hep_env_reload();
    if (!ran) {
        print_message("skipped: no case fits this machine's %d GPU(s)\n", ngpu);
        skip();
    }
}

/* As many virtual nodes as one GPU holds: 16 co-dependent ranks (each rank's stream and its
 * loopback NIC's copy stream take the GPU's 32 hardware queues), 96 of the SMs for the
 * kernels so that the NICs' copies have some. 16 x 1 and 8 x 2, small shapes. */
static void gpu_sixteen_virtual_nodes_on_one_gpu_match_host_backend(void **state)
{
    unsigned seed = fresh_seed() ^ 0x68e31da4u;
    (void)state;
    if (!have_gpu())
        skip();
    if (small_only()) {
        print_message("skipped: 16 virtual ranks with their proxies are too slow under "
                      "compute-sanitizer (HEP_GPU_TEST_SMALL=1)\n");
        skip();
    }
    print_message("fresh seed %u\n", seed);
    setenv("HEP_GPU_MR_MODE", "dmabuf", 1);
    hep_env_reload();
    g_opts.ranks_per_gpu = 16;
    gpu_case(16, 1, HEP_DTYPE_BF16, EP_ROUTE_NODES, 0, 0, -1, seed, 256, 32, HEP_CHUNK_DEFAULT);
    gpu_case(8, 2, HEP_DTYPE_FP8_E4M3, EP_ROUTE_NODES, 1, 0, 1, seed + 1, 512, 48, 3);
    g_opts.ranks_per_gpu = 0;
    unsetenv("HEP_GPU_MR_MODE");
    hep_env_reload();
}

static void set_id(ep_case *c, int r, int i, int k, long long x)
{
    const size_t o = (size_t)i * (size_t)c->K + (size_t)k;
    if (c->index64)
        ((long long *)c->in[r].idx)[o] = x;
    else
        ((int *)c->in[r].idx)[o] = (int)x;
}

/* Expert ids outside -1..E-1 on the GPU (one a rank, on ranks 1 and 2): the rank that
 * passed it gets HEP_WARN_IGNORED naming the token, slot and value, every other rank
 * HEP_OK, and every output is the oracle's with that slot -1. K = 8 with ids in
 * cudaMalloc'ed memory takes the layout's vector loads; K = 6 the per-id loads. */
static void invalid_id_case(int K, int index64, unsigned seed)
{
    static ep_case c;
    rank_ctx ctx[EP_MAX_RANKS];
    const int R = 4, El = 4, T = 64;
    const long long E = (long long)R * El;
    const long long bad[2] = {index64 ? (1LL << 40) + 3 : E + 7, -2};
    const int at[2][3] = {{1, 5, 3}, {2, 0, K - 1}}; /* rank, token, slot */
    memset(&c, 0, sizeof(c));
    c.cfg = gcfg(256, T, El, K, HEP_DTYPE_BF16, R);
    c.cfg.backend = HEP_BACKEND_GPU;
    c.world = R;
    c.K = K;
    c.index64 = index64;
    c.skip_rank = -1;
    c.repeat = 2;
    c.has_t_fixed = 1;
    c.t_fixed = T;
    ep_case_random(&c, seed, 0);
    for (int q = 0; q < 2; q++)
        set_id(&c, at[q][0], at[q][1], at[q][2], bad[q]);
    assert_int_equal(run_ranks(c.world, run_rank_gpu, &c, ctx), 0);
    for (int r = 0; r < R; r++) {
        const int q = r == at[0][0] ? 0 : r == at[1][0] ? 1 : -1;
        char want[96] = "";
        if (q >= 0)
            snprintf(want, sizeof(want), "on rank %d: topk_idx[%d][%d] = %lld is not -1", r,
                     at[q][1], at[q][2], bad[q]);
        print_message("K %d %s rank %d: %s %s\n", K, index64 ? "int64" : "int32", r,
                      hep_status_name(c.out[r].rc_dispatch), q >= 0 ? c.out[r].err : "");
        assert_int_equal(c.out[r].rc_dispatch, q >= 0 ? HEP_WARN_IGNORED : HEP_OK);
        assert_int_equal(c.out[r].rc_combine, HEP_OK);
        if (q >= 0)
            assert_non_null(strstr(c.out[r].err, want));
    }
    for (int q = 0; q < 2; q++) /* the oracle ignores those slots too */
        set_id(&c, at[q][0], at[q][1], at[q][2], -1);
    assert_int_equal(ep_case_check(&c), 0);
    ep_case_free(&c);
}

static void gpu_invalid_expert_id_is_a_warning_naming_it_and_its_slot_is_ignored(void **state)
{
    const unsigned seed = gpu_seed(0x1d5u);
    (void)state;
    invalid_id_case(8, 0, seed);
    invalid_id_case(8, 1, seed + 1);
    invalid_id_case(6, 0, seed + 2);
    invalid_id_case(6, 1, seed + 3);
}

static void gpu_graph_replay_gives_the_eager_results(void **state)
{
    static ep_case c;
    (void)state;
    if (!have_gpu())
        skip();
    memset(&c, 0, sizeof(c));
    c.cfg = gcfg(1024, 128, 4, 8, HEP_DTYPE_BF16, 4);
    c.world = 4;
    c.K = 8;
    c.skip_rank = -1;
    c.repeat = 1;
    ep_case_random(&c, fresh_seed(), 0);
    g_opts.graph = 1;
    g_opts.replays = 3;
    assert_int_equal(run_gpu_and_host(&c, "graph replay x3 (R=4, bf16)"), 0);
    g_opts.graph = 0;
    ep_case_free(&c);
}

/* 4 ranks, R per node; rank `missing` never calls dispatch: every other rank must time
 * out naming it. chunk: config.chunk_tokens (the inter-node rings). */
static void missing_rank_case(int R, int missing, unsigned seed, int chunk)
{
    static ep_case c;
    rank_ctx ctx[4];
    char want[64];
    setenv("HEP_TIMEOUT_MS", "1500", 1);
    hep_env_reload();
    memset(&c, 0, sizeof(c));
    c.cfg = gcfg(512, 32, 2, 2, HEP_DTYPE_BF16, R);
    c.cfg.backend = HEP_BACKEND_GPU;
    c.cfg.chunk_tokens = chunk;
    c.world = 4;
    c.K = 2;
    c.skip_rank = missing;
    ep_case_random(&c, seed, 0);
    assert_int_equal(run_ranks(4, run_rank_gpu, &c, ctx), 0);
    unsetenv("HEP_TIMEOUT_MS");
    hep_env_reload();
    snprintf(want, sizeof(want), "rank %d did not arrive", missing);
    for (int r = 0; r < 4; r++) {
        if (r == missing)
            continue;
        print_message("rank %d: %s\n", r, c.out[r].err);
        assert_int_equal(c.out[r].rc_dispatch, HEP_ERR_TIMEOUT);
        assert_non_null(strstr(c.out[r].err, want));
    }
    ep_case_free(&c);
}

/* The bulk-store dispatch kernel (the one taken where no node-mate shares the GPU) at one
 * rank alone and forced (HEP_DISPATCH_STORES=bulk) on node-mates sharing this GPU: its rows
 * against the host backend, and a missing rank named. */
static int bulk_stores_on(void **state)
{
    (void)state;
    setenv("HEP_DISPATCH_STORES", "bulk", 1);
    hep_env_reload();
    return 0;
}

static int bulk_stores_off(void **state)
{
    (void)state;
    unsetenv("HEP_DISPATCH_STORES");
    hep_env_reload();
    return 0;
}

static void gpu_bulk_dispatch_kernel_matches_host_backend_and_names_a_missing_rank(void **state)
{
    const unsigned seed = gpu_seed(0u);
    (void)state;
    if (small_only()) {
        one_case(1, HEP_DTYPE_BF16, 0, 0, 0, -1, seed, 256, 32);
        one_case(2, HEP_DTYPE_FP8_E4M3, 1, 1, 1, -1, seed + 1, 256, 32);
        return;
    }
    one_case(1, HEP_DTYPE_BF16, 0, 0, 0, -1, seed, 7168, 4096);
    one_case(2, HEP_DTYPE_BF16, 0, 0, 0, -1, seed + 1, 7168, 512);
    one_case(4, HEP_DTYPE_FP8_E4M3, 1, 1, 1, 0, seed + 2, 2048, 64);  /* t = 0 */
    one_case(8, HEP_DTYPE_BF16, 1, 0, 0, 1, seed + 3, 4096, 256);     /* t = T */
    missing_rank_case(4, 2, seed + 4, HEP_CHUNK_DEFAULT);
}

/* A rank alone with many SMs: HEP_DISPATCH_STORES=auto takes plain stores sharing the
 * rank's tokens through its counter from 48 SMs with 2.5 tokens a warp or more of
 * max_tokens (64 SMs, T = 4096), and the bulk ring below that share (64 SMs at T = 2048,
 * 128 SMs at T = 4096); each against the host backend and the oracle, twice a case, and the
 * method the group chose read from its debug log line. */
enum { STORES_LINE = 64 }; /* the chosen method's line kept by keep_stores_line */

static void keep_stores_line(void *ctx, int level, const char *line)
{
    const char *p = strstr(line, "dispatch stores: ");
    (void)level;
    if (p)
        snprintf((char *)ctx, STORES_LINE, "%s", p + strlen("dispatch stores: "));
}

static void lone_rank_case(int sms, hep_dtype dt, int skew, int index64, int zero_copy, int tmode,
                           unsigned seed, int T, const char *want)
{
    char seen[STORES_LINE] = "";
    g_case_sms = sms;
    setenv("HEP_LOG_LEVEL", "debug", 1);
    hep_env_reload();
    hep_log_set_sink(keep_stores_line, seen);
    one_case(1, dt, skew, index64, zero_copy, tmode, seed, 7168, T);
    hep_log_set_sink(NULL, NULL);
    unsetenv("HEP_LOG_LEVEL");
    hep_env_reload();
    print_message("%d SMs, T = %d: dispatch stores: %s\n", sms, T, seen);
    assert_true(strncmp(seen, want, strlen(want)) == 0 && seen[strlen(want)] == ' ');
}

static void gpu_lone_rank_with_many_sms_matches_host_backend_with_either_store_method(void **state)
{
    const unsigned seed = gpu_seed(0x27d4eb2fu);
    int sms = 0;
    (void)state;
    if (small_only()) { /* under compute-sanitizer: 4096 rows of 14 KB at 64 SMs, too slow */
        print_message("skipped: the small shapes only (HEP_GPU_TEST_SMALL)\n");
        skip();
    }
    assert_int_equal(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
    lone_rank_case(64, HEP_DTYPE_BF16, 0, 0, 0, 1, seed, 4096, "plain");
    lone_rank_case(64, HEP_DTYPE_FP8_E4M3, 1, 1, 1, -1, seed + 1, 4096, "plain"); /* random t */
    lone_rank_case(64, HEP_DTYPE_BF16, 0, 0, 0, 1, seed + 2, 2048, "bulk");
    if (sms >= 128)
        lone_rank_case(128, HEP_DTYPE_BF16, 0, 1, 0, 1, seed + 3, 4096, "bulk");
    else
        print_message("the 128-SM case skipped: this GPU has %d SMs\n", sms);
}

static int case_sms_reset(void **state) /* also after a failed assertion in the case */
{
    (void)state;
    g_case_sms = 0;
    hep_log_set_sink(NULL, NULL);
    unsetenv("HEP_LOG_LEVEL");
    hep_env_reload();
    return 0;
}

static void gpu_dispatch_times_out_naming_the_rank_that_never_called(void **state)
{
    (void)state;
    if (!have_gpu() || small_only()) /* small: under compute-sanitizer, where time stretches */
        skip();
    missing_rank_case(4, 2, 5, HEP_CHUNK_DEFAULT);
}

/* Across nodes: rank 3 never calls. Its peer (rank 1) waits for its slot, its node-mate
 * (rank 2) for its counts; rank 0 waits for rank 1, which gave up on rank 3: every rank
 * that waited names rank 3. */
static void gpu_virtual_nodes_time_out_naming_the_missing_rank_on_every_rank(void **state)
{
    (void)state;
    if (!have_gpu() || small_only())
        skip();
    missing_rank_case(2, 3, 9, HEP_CHUNK_DEFAULT);
}

/* The same with inter-node rings of 2 chunks of 4 tokens (T = 32): every rank that waited
 * names rank 3. */
static void gpu_virtual_nodes_rings_time_out_naming_the_missing_rank_on_every_rank(void **state)
{
    (void)state;
    if (!have_gpu() || small_only())
        skip();
    missing_rank_case(2, 3, 11, 4);
}

/* Across nodes with rings of 2 chunks of 2 tokens (T = 64), rank 1's proxy never returns a
 * credit. Rank 0, whose ring to rank 1 needs credits after its first two chunks, times out
 * naming rank 1 and the credit; rank 1 (no tokens of its own) times out naming rank 0,
 * whose third chunk never came. */
static void gpu_virtual_nodes_rings_time_out_naming_the_peer_that_holds_its_credits(void **state)
{
    static ep_case c;
    rank_ctx ctx[2];
    (void)state;
    if (!have_gpu() || small_only())
        skip();
    setenv("HEP_TIMEOUT_MS", "1500", 1);
    hep_env_reload();
    memset(&c, 0, sizeof(c));
    c.cfg = gcfg(256, 64, 2, 2, HEP_DTYPE_BF16, 1);
    c.cfg.chunk_tokens = 2;
    c.world = 2;
    c.K = 2;
    c.skip_rank = -1;
    c.has_t_fixed = 1;
    c.t_fixed = 64;
    ep_case_random(&c, 13, EP_ROUTE_NODES);
    c.in[1].t = 0;
    g_hold_rank = 1;
    assert_int_equal(run_ranks(2, run_rank_gpu, &c, ctx), 0);
    g_hold_rank = -1;
    unsetenv("HEP_TIMEOUT_MS");
    hep_env_reload();
    for (int r = 0; r < 2; r++)
        print_message("rank %d: %s\n", r, c.out[r].err);
    assert_int_equal(c.out[0].rc_dispatch, HEP_ERR_TIMEOUT);
    assert_non_null(strstr(c.out[0].err, "waited for rank 1 to free"));
    assert_non_null(strstr(c.out[0].err, "rank 1 arrived at the call but its credit did not come"));
    assert_int_equal(c.out[1].rc_dispatch, HEP_ERR_TIMEOUT);
    assert_non_null(strstr(c.out[1].err, "of rank 0's ring"));
    ep_case_free(&c);
}

/* Across nodes the proxy posts each call's writes: capturing a call is refused, clearly. */
static int capture_rank(rank_ctx *r)
{
    hep_config c = gcfg(256, 16, 2, 2, HEP_DTYPE_BF16, 1);
    hep_group *g = NULL;
    cudaStream_t st;
    cudaGraph_t graph = NULL;
    hep_dispatch_args da;
    hep_dispatch_result dr;
    int rc;
    cudaSetDevice(0);
    if ((rc = hep_group_create(&c, &r->bs, 0, &g)))
        return rc;
    if (hep_inproc_stream(0, r->rank, (void **)&st)) {
        hep_group_destroy(g);
        return -1;
    }
    memset(&da, 0, sizeof(da));
    da.topk = 2;
    da.stream = st;
    da.flags = HEP_ASYNC;
    cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
    rc = hep_dispatch(g, &da, &dr);
    snprintf(r->err, sizeof(r->err), "%s", rc ? hep_last_error() : "");
    cudaStreamEndCapture(st, &graph);
    if (graph)
        cudaGraphDestroy(graph);
    hep_group_destroy(g);
    return rc == HEP_ERR_UNAVAILABLE ? 0 : -1;
}

static void gpu_virtual_nodes_refuse_graph_capture_with_the_reason(void **state)
{
    rank_ctx ctx[2];
    (void)state;
    if (!have_gpu())
        skip();
    assert_int_equal(run_ranks(2, capture_rank, NULL, ctx), 0);
    for (int r = 0; r < 2; r++) {
        print_message("rank %d: %s\n", r, ctx[r].err);
        assert_int_equal(ctx[r].rc, 0);
        assert_non_null(strstr(ctx[r].err, "cannot be captured into a CUDA graph"));
    }
}

/* Two ranks of one node as threads of this process: the legacy default stream would queue
 * their co-dependent kernels behind each other; dispatch and combine refuse it up front. */
static int legacy_stream_rank(rank_ctx *r)
{
    hep_config c = gcfg(256, 16, 2, 2, HEP_DTYPE_BF16, 2);
    hep_group *g = NULL;
    cudaStream_t st = NULL;
    hep_dispatch_args da;
    hep_dispatch_result dr;
    hep_combine_args ca;
    int rc, ok = 1;
    cudaSetDevice(0);
    if (hep_inproc_stream(0, r->rank, (void **)&st))
        return -1;
    if ((rc = hep_group_create(&c, &r->bs, 0, &g)))
        return rc;
    memset(&da, 0, sizeof(da));
    da.topk = 2; /* num_tokens 0 */
    da.stream = st;
    ok &= hep_dispatch(g, &da, &dr) == HEP_OK;
    memset(&ca, 0, sizeof(ca));
    ca.handle = dr.handle;
    ca.stream = (void *)cudaStreamLegacy;
    ok &= hep_combine(g, &ca) == HEP_ERR_INVALID &&
          strstr(hep_last_error(), "legacy default stream") != NULL;
    ca.stream = st; /* the refused call did nothing: the handle is still good */
    ok &= hep_combine(g, &ca) == HEP_OK;
    da.stream = NULL;
    ok &= hep_dispatch(g, &da, &dr) == HEP_ERR_INVALID;
    {
        char keep[1024]; /* the message the test prints, past destroy */
        snprintf(keep, sizeof(keep), "%s", hep_last_error());
        hep_group_destroy(g);
        hep_set_last_error(HEP_ERR_INVALID, "%s", keep);
    }
    return ok ? 0 : -1;
}

static void gpu_ranks_of_one_process_refuse_the_legacy_default_stream(void **state)
{
    rank_ctx ctx[2];
    (void)state;
    if (!have_gpu())
        skip();
    assert_int_equal(run_ranks(2, legacy_stream_rank, NULL, ctx), 0);
    for (int r = 0; r < 2; r++) {
        print_message("rank %d: %s\n", r, ctx[r].err);
        assert_int_equal(ctx[r].rc, 0);
        assert_non_null(strstr(ctx[r].err, "legacy default stream"));
        assert_non_null(strstr(ctx[r].err, "hep_inproc_stream")); /* and where to get one */
    }
}

static void gpu_real_dmabuf_export_of_odd_sizes_covers_enclosing_pages(void **state)
{
    const hep_gpu_mr_ops *real = hep_gpu_mr_real_ops();
    size_t sizes[] = {1, 100, 3696, 2 * 1024 * 1024 + 1};
    long page = sysconf(_SC_PAGESIZE);
    int fds0;
    (void)state;
    if (!have_gpu())
        skip();
    fds0 = count_fds();
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]) + 1; i++) {
        int interior = i == sizeof(sizes) / sizeof(sizes[0]);
        size_t len = interior ? 3696 : sizes[i];
        char *base = NULL, *p;
        int fd = -1, r;
        const char *n = NULL, *d = NULL;
        uint64_t a0, a1;
        assert_int_equal(cudaMalloc((void **)&base, len + 8192), cudaSuccess);
        p = interior ? base + 0x800 + 8 : base;
        a0 = (uint64_t)(uintptr_t)p & ~(uint64_t)(page - 1);
        a1 = ((uint64_t)(uintptr_t)p + len + (uint64_t)page - 1) & ~(uint64_t)(page - 1);
        r = real->export_dmabuf(NULL, a0, (size_t)(a1 - a0), &fd, &n, &d);
        print_message("export of %zu bytes at %s pointer %p: aligned range 0x%llx+%llu -> %s\n",
                      len, interior ? "an interior" : "a cudaMalloc", (void *)p,
                      (unsigned long long)a0, (unsigned long long)(a1 - a0), r ? n : "fd");
        assert_int_equal(r, 0);
        assert_true(fd >= 0);
        close(fd);
        if (len == 3696 && !interior && !small_only()) { /* an intended CUDA error */
            fd = -1;
            r = real->export_dmabuf(NULL, (uint64_t)(uintptr_t)p, len, &fd, &n, &d);
            print_message("exact export of 3696 bytes: %s\n", r ? n : "succeeded");
            if (r == 0)
                close(fd);
            else
                assert_string_equal(n, "CUDA_ERROR_INVALID_VALUE");
        }
        cudaFree(base);
    }
    assert_int_equal(count_fds(), fds0);
}

/* 2 virtual nodes x 4 ranks on the GPU: device buffers, real DMA-BUF export feeding the
 * loopback NIC; a write by original address into device memory lands at the right byte. */
static int two_node_gpu(rank_ctx *r)
{
    hep_config c = gcfg(1024, 64, 2, 2, HEP_DTYPE_FP8_E4M3, 4);
    hep_group *g = NULL;
    hep_group_hooks hooks = {NULL, 1};
    int *fails = r->arg, rc;
    cudaSetDevice(0);
    for (int it = 0; it < (r->rank == 0 ? 1 : 1); it++) {
        rc = hep_group_create_ex(&c, &r->bs, 0, &hooks, &g);
        if (rc)
            return rc;
        if (g->coord->registered != 14 || g->coord->dmabuf != 14) {
            __atomic_add_fetch(fails, 1, __ATOMIC_RELAXED);
            snprintf(r->err, sizeof(r->err), "%d registrations, %d DMA-BUF", g->coord->registered,
                     g->coord->dmabuf);
        }
        r->bs.barrier(r->bs.ctx);
        if (r->rank == 0) { /* rank 0 writes into rank 4's combine group token, by address */
            hep_remote_buf *dst = &g->coord->remote[4 * HEP_RDMA_BUF_COUNT +
                                                    (HEP_BUF_C_GROUP_TOKEN - HEP_FIRST_RDMA_BUF)];
            hep_gpu_mr *src = &g->coord->mr[HEP_BUF_D_ATTN_TOKEN - HEP_FIRST_RDMA_BUF];
            hep_net_completion done[4];
            int n = 0;
            cudaMemset((void *)(uintptr_t)src->addr, 0x5a, 4096);
            cudaDeviceSynchronize();
            rc = g->coord->net->v->write(g->coord->net, 4, src->lkey, src->addr, dst->rkey,
                                         dst->addr + 1000, 333, 7);
            for (int spin = 0; rc == 0 && n == 0 && spin < 100000; spin++)
                n = g->coord->net->v->poll(g->coord->net, done, 4);
            if (rc || n != 1) {
                __atomic_add_fetch(fails, 1, __ATOMIC_RELAXED);
                snprintf(r->err, sizeof(r->err), "loopback write: rc %d n %d: %s", rc, n,
                         hep_last_error());
            }
        }
        r->bs.barrier(r->bs.ctx);
        if (r->rank == 4) {
            unsigned char h[1400];
            char *mem = g->arena[HEP_ARENA_LOCAL] + g->plan.buf[HEP_BUF_C_GROUP_TOKEN].offset;
            cudaMemcpy(h, mem, sizeof(h), cudaMemcpyDeviceToHost);
            for (int k = 0; k < 1400; k++)
                if (h[k] != ((k >= 1000 && k < 1333) ? 0x5a : 0)) {
                    __atomic_add_fetch(fails, 1, __ATOMIC_RELAXED);
                    snprintf(r->err, sizeof(r->err), "byte %d is 0x%x", k, h[k]);
                    break;
                }
        }
        rc = hep_group_destroy(g);
    }
    return rc;
}

static void gpu_two_virtual_nodes_register_device_buffers_through_real_dmabuf(void **state)
{
    rank_ctx ctx[8];
    int fails = 0;
    (void)state;
    if (!have_gpu())
        skip();
    setenv("HEP_GPU_MR_MODE", "dmabuf", 1);
    hep_env_reload();
    assert_int_equal(run_ranks(8, two_node_gpu, &fails, ctx), 0);
    unsetenv("HEP_GPU_MR_MODE");
    hep_env_reload();
    for (int r = 0; r < 8; r++)
        if (ctx[r].rc || ctx[r].err[0])
            print_message("rank %d: rc %d %s\n", r, ctx[r].rc, ctx[r].err);
    for (int r = 0; r < 8; r++)
        assert_int_equal(ctx[r].rc, 0);
    assert_int_equal(fails, 0);
}

static int create_destroy_gpu(rank_ctx *r)
{
    hep_config c = gcfg(2048, 256, 4, 4, HEP_DTYPE_BF16, 2);
    hep_group_hooks hooks = {NULL, 1};
    int rc = 0;
    cudaSetDevice(0);
    for (int i = 0; i < 100 && rc == 0; i++) {
        hep_group *g = NULL;
        rc = hep_group_create_ex(&c, &r->bs, 0, &hooks, &g);
        if (rc == 0)
            rc = hep_group_destroy(g);
    }
    return rc;
}

static void gpu_create_destroy_100_times_leaks_no_device_memory_fd_or_thread(void **state)
{
    rank_ctx ctx[4];
    size_t free0, free1, total;
    int fds, threads;
    (void)state;
    if (!have_gpu() || small_only())
        skip();
    setenv("HEP_GPU_MR_MODE", "dmabuf", 1);
    setenv("HEP_LOG_LEVEL", "warn", 1); /* 400 banners otherwise */
    hep_env_reload();
    cudaSetDevice(0);
    cudaFree(0);
    { /* warm: the first group creates the CUDA context and the loopback copy stream */
        assert_int_equal(run_ranks(4, create_destroy_gpu, NULL, ctx), 0);
    }
    cudaMemGetInfo(&free0, &total);
    fds = count_fds();
    threads = count_threads();
    assert_int_equal(run_ranks(4, create_destroy_gpu, NULL, ctx), 0);
    cudaMemGetInfo(&free1, &total);
    unsetenv("HEP_GPU_MR_MODE");
    unsetenv("HEP_LOG_LEVEL");
    hep_env_reload();
    for (int r = 0; r < 4; r++)
        if (ctx[r].rc)
            fail_msg("rank %d: %s", r, ctx[r].err);
    print_message("400 group create/destroy (2 nodes x 2 ranks, DMA-BUF): device free %zu -> %zu, "
                  "fds %d -> %d, threads %d -> %d\n",
                  free0, free1, fds, count_fds(), threads, count_threads());
    assert_true(free1 + (64u << 20) >= free0); /* within the allocator's slack */
    assert_int_equal(count_fds(), fds);
    assert_int_equal(count_threads(), threads);
}

/* ---- fault paths on the GPU: destroy after a timeout, the capped kernel bound ---- */
#define FAULT_H 7168
typedef struct gpu_fault {
    int R, early, delay_rank, rc_dispatch[4], rc_combine[4], rc_destroy[4];
    char msg[4][1024];
    const char *volatile stage[4]; /* where each rank is, for the watchdog */
} gpu_fault;

static int gpu_fault_rank(rank_ctx *r)
{
    gpu_fault *f = r->arg;
    /* T = 4096 x H = 7168: each rank's receive buffer (235 MB) is far above the slack of
     * the device memory check, so one kept arena fails it */
    hep_config c = gcfg(FAULT_H, 4096, 2, 2, HEP_DTYPE_BF16, f->R);
    hep_group_hooks hooks = {NULL, 1}; /* virtual nodes: the loopback NIC */
    hep_group *g = NULL;
    hep_dispatch_args da;
    hep_dispatch_result dr;
    void *x = NULL, *y = NULL;
    int idx[64], rc;
    float w[64];
    cudaStream_t st = NULL;
    c.backend = HEP_BACKEND_GPU;
    cudaSetDevice(0);
    /* a stream of its own: on the legacy default stream the ranks' kernels would queue
     * behind each other (the library refuses it) */
    if (hep_inproc_stream(0, r->rank, (void **)&st))
        return HEP_ERR_CUDA;
    f->stage[r->rank] = "group create";
    rc = hep_group_create_ex(&c, &r->bs, 0, &hooks, &g);
    if (rc)
        return rc;
    if (r->rank != f->early) {
        f->stage[r->rank] = "allocating inputs";
        cudaMalloc(&x, 32 * FAULT_H * 2);
        cudaMalloc(&y, 32 * FAULT_H * 2);
        cudaMemset(x, 0, 32 * FAULT_H * 2);
        for (int i = 0; i < 64; i++)
            idx[i] = (i * 3 + r->rank) % 8, w[i] = 1;
        {
            void *didx = NULL, *dw = NULL;
            cudaMalloc(&didx, sizeof(idx));
            cudaMalloc(&dw, sizeof(w));
            cudaMemcpy(didx, idx, sizeof(idx), cudaMemcpyHostToDevice);
            cudaMemcpy(dw, w, sizeof(w), cudaMemcpyHostToDevice);
            memset(&da, 0, sizeof(da));
            da.num_tokens = 32;
            da.tokens = x;
            da.topk_idx = didx;
            da.topk = 2;
            da.topk_weights = dw;
            da.stream = st;
            if (r->rank == f->delay_rank)
                usleep(200 * 1000); /* later than a wrapped bound, far inside a capped one */
            f->stage[r->rank] = "hep_dispatch";
            f->rc_dispatch[r->rank] = hep_dispatch(g, &da, &dr);
            if (f->rc_dispatch[r->rank] == HEP_OK) {
                hep_combine_args ca = {dr.handle, hep_combine_input(g), y, st, 0};
                f->stage[r->rank] = "hep_combine";
                f->rc_combine[r->rank] = hep_combine(g, &ca);
            }
            /* cudaFree synchronizes the whole device: only once this rank's calls ended and,
             * when every rank runs them, every rank's did. A rank that frees while a peer's
             * combine still waits for the loopback NIC blocks that NIC's proxy thread in its
             * next CUDA call (the copy) until the device is idle, which it never is: with the
             * day-long bound of this test that hung (4 of 4 runs on the H200 once the other
             * node's partial sums came last) */
            f->stage[r->rank] = "cudaStreamSynchronize";
            cudaStreamSynchronize(st);
            if (f->early < 0) {
                f->stage[r->rank] = "barrier before freeing";
                r->bs.barrier(r->bs.ctx);
            }
            f->stage[r->rank] = "freeing inputs";
            snprintf(f->msg[r->rank], sizeof(f->msg[0]), "%s", hep_last_error());
            cudaFree(didx);
            cudaFree(dw);
        }
        cudaFree(x);
        cudaFree(y);
    }
    f->stage[r->rank] = "hep_group_destroy";
    f->rc_destroy[r->rank] = hep_group_destroy(g);
    if (f->rc_destroy[r->rank])
        snprintf(f->msg[r->rank], sizeof(f->msg[0]), "%s", hep_last_error());
    return 0;
}

/* D3 on the GPU: one rank goes to destroy while the others time out on it; every destroy
 * succeeds and the device memory of all four groups comes back. */
static void gpu_destroy_after_a_timeout_frees_all_device_memory(void **state)
{
    static gpu_fault f;
    rank_ctx ctx[4];
    size_t free0, free1, total;
    (void)state;
    if (!have_gpu() || small_only())
        skip();
    for (int R = 4; R >= 2; R -= 2) {
        memset(&f, 0, sizeof(f));
        f.R = R;
        f.early = 2;
        f.delay_rank = -1;
        f.rc_dispatch[2] = HEP_ERR_TIMEOUT; /* it never dispatches */
        cudaSetDevice(0);
        cudaFree(0);
        cudaMemGetInfo(&free0, &total);
        setenv("HEP_TIMEOUT_MS", "500", 1);
        hep_env_reload();
        assert_int_equal(run_ranks(4, gpu_fault_rank, &f, ctx), 0);
        unsetenv("HEP_TIMEOUT_MS");
        hep_env_reload();
        cudaMemGetInfo(&free1, &total);
        print_message("R %d: device free %zu -> %zu after a timeout and destroy\n", R, free0,
                      free1);
        for (int r = 0; r < 4; r++) {
            if (ctx[r].rc)
                fail_msg("rank %d: create: %s", r, ctx[r].err);
            assert_int_equal(f.rc_dispatch[r], HEP_ERR_TIMEOUT);
            if (f.rc_destroy[r] != HEP_OK)
                fail_msg("R %d rank %d: destroy: %s", R, r, f.msg[r]);
        }
        /* one kept shared arena alone would be 235 MB missing */
        assert_true(free1 + (64u << 20) >= free0);
    }
}

/* A test whose waits are longer than the run: after `seconds` the watchdog prints where
 * each rank is and ends the process (a failure, never a hang). */
static struct {
    pthread_t t;
    pthread_mutex_t m;
    pthread_cond_t c;
    int on;
    gpu_fault *f;
    int seconds;
} dog = {.m = PTHREAD_MUTEX_INITIALIZER, .c = PTHREAD_COND_INITIALIZER};

static void *watchdog_main(void *arg)
{
    struct timespec until;
    (void)arg;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += dog.seconds;
    pthread_mutex_lock(&dog.m);
    while (dog.on)
        if (pthread_cond_timedwait(&dog.c, &dog.m, &until) == ETIMEDOUT && dog.on) {
            fprintf(stderr, "watchdog: the test did not end within %d s; ranks:\n", dog.seconds);
            for (int r = 0; r < 4; r++)
                fprintf(stderr, "  rank %d: in %s\n", r, dog.f->stage[r] ? dog.f->stage[r] : "?");
            fflush(stderr);
            _exit(3);
        }
    pthread_mutex_unlock(&dog.m);
    return NULL;
}

static void start_watchdog(gpu_fault *f, int seconds)
{
    dog.f = f, dog.seconds = seconds, dog.on = 1;
    assert_int_equal(pthread_create(&dog.t, NULL, watchdog_main, NULL), 0);
}

static void stop_watchdog(void)
{
    pthread_mutex_lock(&dog.m);
    dog.on = 0;
    pthread_cond_signal(&dog.c);
    pthread_mutex_unlock(&dog.m);
    pthread_join(dog.t, NULL);
}

/* D8 on the GPU: HEP_TIMEOUT_MS = 18446744073710 used to become timeout_ns = 0.45 ms after
 * 64-bit wrap; capped, a rank that starts 200 ms late is no timeout. */
static void gpu_huge_timeout_is_capped_not_wrapped_into_a_tiny_kernel_bound(void **state)
{
    static gpu_fault f;
    rank_ctx ctx[4];
    (void)state;
    if (!have_gpu() || small_only())
        skip();
    memset(&f, 0, sizeof(f));
    f.R = 2;
    f.early = -1;
    f.delay_rank = 1;
    setenv("HEP_TIMEOUT_MS", "18446744073710", 1);
    hep_env_reload();
    /* the kernels' bound is now a day: a hang must still end this test, and say where */
    start_watchdog(&f, 120);
    assert_int_equal(run_ranks(4, gpu_fault_rank, &f, ctx), 0);
    stop_watchdog();
    unsetenv("HEP_TIMEOUT_MS");
    hep_env_reload();
    for (int r = 0; r < 4; r++) {
        if (ctx[r].rc)
            fail_msg("rank %d: create: %s", r, ctx[r].err);
        if (f.rc_dispatch[r] || f.rc_combine[r] || f.rc_destroy[r])
            fail_msg("rank %d: dispatch %d combine %d destroy %d: %s", r, f.rc_dispatch[r],
                     f.rc_combine[r], f.rc_destroy[r], f.msg[r]);
    }
}

/* hep_inproc_stream: one non-blocking stream per (device, rank), the same on every call and
 * from every thread, shared with no other rank nor with a loopback NIC's copy stream (their
 * slots lie above the ranks'), made on the device asked for, the caller's device untouched. */
static int stream_of_rank_1000(rank_ctx *r)
{
    void **got = r->arg;
    return hep_inproc_stream(0, 1000, &got[r->rank]);
}

static void gpu_inproc_stream_is_made_once_per_device_and_rank(void **state)
{
    enum { K = HEP_STREAM_NIC_SLOTS };
    void *got[8] = {0}, *all[2 * K], *s = NULL;
    rank_ctx ctx[8];
    unsigned flags = 0;
    int n = 0, dev = -1;
    (void)state;
    if (!have_gpu())
        skip();
    assert_int_equal(cudaGetDeviceCount(&n), cudaSuccess);
    /* 8 threads at once ask for a stream nobody made yet: all get the same one */
    assert_int_equal(run_ranks(8, stream_of_rank_1000, got, ctx), 0);
    for (int r = 0; r < 8; r++) {
        if (ctx[r].rc)
            fail_msg("thread %d: %s", r, ctx[r].err);
        assert_non_null(got[r]);
        assert_ptr_equal(got[r], got[0]);
    }
    assert_int_equal(cudaStreamGetFlags((cudaStream_t)got[0], &flags), cudaSuccess);
    assert_true(flags & cudaStreamNonBlocking);
    assert_int_equal(hep_inproc_stream(0, 1000, &s), HEP_OK);
    assert_ptr_equal(s, got[0]);
    for (int k = 0; k < K; k++) {
        assert_int_equal(hep_inproc_stream(0, k, &all[k]), HEP_OK);
        assert_int_equal(hep_kept_stream(0, HEP_STREAM_NIC_SLOT0 + k, "test", &all[K + k]), HEP_OK);
    }
    for (int i = 0; i < 2 * K; i++)
        for (int j = i + 1; j < 2 * K; j++)
            if (!all[i] || all[i] == all[j])
                fail_msg("kept streams %d and %d: %p and %p", i, j, all[i], all[j]);
    { /* 2K + 1 kept streams on device 0 now: at least the 32 queues the suite asks for */
        char note[256];
        const int kept_n = hep_kept_streams(0);
        assert_true(kept_n >= 2 * K + 1);
        assert_int_equal(hep_stream_queues(), 32);
        assert_int_equal(hep_stream_queue_note(note, sizeof(note), 0, kept_n, 32), 1);
        print_message("%d kept streams on GPU 0%s\n", kept_n, note);
    }
    /* from the last device, device 0's stream: made there, the caller stays where it was */
    assert_int_equal(cudaSetDevice(n - 1), cudaSuccess);
    assert_int_equal(hep_inproc_stream(0, 2000, &s), HEP_OK);
    assert_int_equal(cudaGetDevice(&dev), cudaSuccess);
    assert_int_equal(dev, n - 1);
#if CUDART_VERSION >= 12080
    assert_int_equal(cudaStreamGetDevice((cudaStream_t)s, &dev), cudaSuccess);
    assert_int_equal(dev, 0);
    assert_int_equal(hep_inproc_stream(n - 1, 0, &s), HEP_OK);
    assert_int_equal(cudaStreamGetDevice((cudaStream_t)s, &dev), cudaSuccess);
    assert_int_equal(dev, n - 1);
#endif
    assert_int_equal(cudaSetDevice(0), cudaSuccess);
    /* a device past the last: invalid, saying how many there are */
    assert_int_equal(hep_inproc_stream(n, 0, &s), HEP_ERR_INVALID);
    assert_null(s);
    print_message("%s\n", hep_last_error());
    assert_non_null(strstr(hep_last_error(), "does not exist"));
}

int main(void)
{
    struct CMUnitTest tests[] = {
        cmocka_unit_test(gpu_kernels_match_host_backend_across_ranks_dtypes_and_routing),
        cmocka_unit_test(gpu_virtual_nodes_match_host_backend_over_loopback_nic_with_dmabuf),
        cmocka_unit_test(gpu_virtual_nodes_rings_of_chunks_match_host_backend),
        cmocka_unit_test(gpu_many_nodes_beyond_one_warp_match_host_backend),
        cmocka_unit_test(gpu_graph_replay_gives_the_eager_results),
        cmocka_unit_test(gpu_invalid_expert_id_is_a_warning_naming_it_and_its_slot_is_ignored),
        cmocka_unit_test(gpu_dispatch_times_out_naming_the_rank_that_never_called),
        cmocka_unit_test_setup_teardown(
            gpu_bulk_dispatch_kernel_matches_host_backend_and_names_a_missing_rank,
            bulk_stores_on, bulk_stores_off),
        cmocka_unit_test_teardown(
            gpu_lone_rank_with_many_sms_matches_host_backend_with_either_store_method,
            case_sms_reset),
        cmocka_unit_test(gpu_virtual_nodes_time_out_naming_the_missing_rank_on_every_rank),
        cmocka_unit_test(gpu_virtual_nodes_rings_time_out_naming_the_missing_rank_on_every_rank),
        cmocka_unit_test(gpu_virtual_nodes_rings_time_out_naming_the_peer_that_holds_its_credits),
        cmocka_unit_test(gpu_virtual_nodes_refuse_graph_capture_with_the_reason),
        cmocka_unit_test(gpu_ranks_of_one_process_refuse_the_legacy_default_stream),
        cmocka_unit_test(gpu_real_dmabuf_export_of_odd_sizes_covers_enclosing_pages),
        cmocka_unit_test(gpu_two_virtual_nodes_register_device_buffers_through_real_dmabuf),
        cmocka_unit_test(gpu_create_destroy_100_times_leaks_no_device_memory_fd_or_thread),
        cmocka_unit_test(gpu_destroy_after_a_timeout_frees_all_device_memory),
        cmocka_unit_test(gpu_huge_timeout_is_capped_not_wrapped_into_a_tiny_kernel_bound),
        /* near the end: its 16 ranks' and 16 NICs' kept streams take all of the GPU's 32
         * hardware queues, and a graph's replays run after them queued behind a node-mate
         * (the graph replay case, run after it, timed out so on every run, 2026-12-02) */
        cmocka_unit_test(gpu_sixteen_virtual_nodes_on_one_gpu_match_host_backend),
        /* last: the streams it makes beyond the other cases' take no queue from them */
        cmocka_unit_test(gpu_inproc_stream_is_made_once_per_device_and_rank),
    };
    int n = 0;
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0); /* one hardware queue per virtual rank */
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("skipped: no CUDA GPU on this machine (%s); these tests run on a GPU machine\n",
               cudaGetErrorString(cudaGetLastError()));
        return 77; /* ctest: skipped, not passed */
    }
    /* e.g. "*huge_timeout*" (tests/test_filter.h): those cases only */
    return hep_run_filtered("gpu_ep", tests, sizeof(tests) / sizeof(tests[0]));
}
