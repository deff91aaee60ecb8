/* Stress of the inter-node path: many dispatch + combine calls on one group per shape
 * (2 x 2, 2 x 4 and 4 x 2 virtual nodes over the loopback NIC), fresh routing every call,
 * every output of every call checked against the tests' oracle (ep_case_check, which the
 * GPU tests check the host backend against), every status checked. Meant to run with
 * HEP_DEBUG_JITTER_US set, so that the proxy reads ready words late and the NIC lands data
 * and flags late (and, on the GPU, blocks start late).
 *
 *   stress_internode [host|gpu]   (default host)
 *   HEP_STRESS_SECONDS  bound per shape (default 3)
 *   HEP_STRESS_CALLS    bound per shape (default 10000); whichever comes first
 *   HEP_STRESS_SEED     first routing seed (default 1); a failure prints its call's seed
 *   HEP_STRESS_CHUNK    config.chunk_tokens (default 3: rings of 2 chunks of 3 tokens,
 *                       smaller than every shape's T, so the rings wrap and credits flow;
 *                       0 = one chunk of T), on both backends.
 *
 * Prints the calls done per shape. gpu: the GPU backend, small shapes (for the GPU check
 * script and compute-sanitizer); without a GPU it prints "skipped: <reason>" and exits 77. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "core/core.h"
#include "ep_case.h"
#include "fake_mr.h"
#include "ranks.h"

typedef struct stress {
    ep_case c;
    int gpu;
    unsigned seed;      /* of the current call */
    int stop;           /* rank 0 sets it between calls */
    long calls, max_calls;
    double until;
    int failed;
} stress;

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static size_t esize(const ep_case *c)
{
    return c->cfg.dtype == HEP_DTYPE_FP8_E4M3 ? 1 : 2;
}

/* Device copies of one rank's inputs and outputs (GPU mode). */
typedef struct dev_bufs {
    cudaStream_t st;
    void *tok, *idx, *eo, *out;
    float *sc, *w;
} dev_bufs;

/* 0, or a failure with its reason in err */
static int dev_alloc(const ep_case *c, int rank, size_t max_recv, dev_bufs *d, char *err,
                     size_t len)
{
    const size_t T = (size_t)c->cfg.max_tokens + 1, H = (size_t)c->cfg.hidden;
    memset(d, 0, sizeof(*d));
    if (hep_inproc_stream(0, rank, (void **)&d->st)) {
        snprintf(err, len, "stream: %s", hep_last_error());
        return -1;
    }
    if (cudaMalloc(&d->tok, T * H * esize(c)) != cudaSuccess ||
        cudaMalloc((void **)&d->sc, T * (H / 128 + 1) * 4) != cudaSuccess ||
        cudaMalloc(&d->idx, T * (size_t)c->K * 8) != cudaSuccess ||
        cudaMalloc((void **)&d->w, T * (size_t)c->K * 4) != cudaSuccess ||
        cudaMalloc(&d->eo, (max_recv + 1) * H * 2) != cudaSuccess ||
        cudaMalloc(&d->out, T * H * 2) != cudaSuccess) {
        snprintf(err, len, "device buffers: %s", cudaGetErrorString(cudaGetLastError()));
        return -1;
    }
    return 0;
}

static void dev_free(dev_bufs *d)
{
    cudaFree(d->tok), cudaFree(d->sc), cudaFree(d->idx), cudaFree(d->w), cudaFree(d->eo);
    cudaFree(d->out); /* the stream is the rank's for the process (hep_inproc_stream) */
}

#define CK(x)                                                                                    \
    do {                                                                                         \
        cudaError_t e_ = (x);                                                                    \
        if (e_ != cudaSuccess) {                                                                 \
            snprintf(o->err, sizeof(o->err), "%s: %s", #x, cudaGetErrorString(e_));            \
            return HEP_ERR_CUDA;                                                                 \
        }                                                                                        \
    } while (0)

/* One dispatch + combine of this rank on the GPU; outputs copied into o. */
static int call_gpu(ep_case *c, int r, hep_group *g, dev_bufs *d)
{
    ep_rank_in *in = &c->in[r];
    ep_rank_out *o = &c->out[r];
    const int H = c->cfg.hidden, El = c->cfg.experts_per_rank, ns = H / 128;
    const size_t rb = (size_t)H * esize(c), ib = c->index64 ? 8 : 4;
    hep_dispatch_args da;
    hep_dispatch_result dr;
    hep_combine_args ca;
    CK(cudaMemcpy(d->tok, in->tokens, rb * (size_t)in->t, cudaMemcpyHostToDevice));
    if (c->cfg.dtype == HEP_DTYPE_FP8_E4M3)
        CK(cudaMemcpy(d->sc, in->scales, 4 * (size_t)ns * (size_t)in->t, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d->idx, in->idx, ib * (size_t)c->K * (size_t)in->t, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d->w, in->weights, 4 * (size_t)c->K * (size_t)in->t, cudaMemcpyHostToDevice));
    CK(cudaMemsetAsync(d->out, 0xff, (size_t)H * 2 * (size_t)in->t, d->st)); /* poison */
    da = ep_case_args(c, in->t, d->tok, d->sc, d->idx, d->w, d->st);
    if (ep_case_dispatch(c, o, g, &da, &dr))
        return o->rc_dispatch;
    o->num_recv = dr.num_recv;
    CK(cudaMemcpy(o->tpe, dr.tokens_per_expert_device, sizeof(int) * (size_t)El,
                  cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(o->tokens, dr.tokens, rb * (size_t)o->num_recv, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(o->probs, dr.probs, 4 * (size_t)El * (size_t)o->num_recv,
                  cudaMemcpyDeviceToHost));
    if (dr.scales)
        CK(cudaMemcpy(o->scales, dr.scales, 4 * (size_t)ns * (size_t)o->num_recv,
                      cudaMemcpyDeviceToHost));
    for (int j = 0; j < o->num_recv; j++)
        for (int h = 0; h < H; h++)
            o->expert_out[(size_t)j * H + h] = ep_expert_value(r, j, h);
    CK(cudaMemcpy(d->eo, o->expert_out, (size_t)H * 2 * (size_t)o->num_recv,
                  cudaMemcpyHostToDevice));
    memset(&ca, 0, sizeof(ca));
    ca.handle = dr.handle;
    ca.expert_out = d->eo;
    ca.out = d->out;
    ca.stream = d->st;
    o->rc_combine = hep_combine(g, &ca);
    if (o->rc_combine) {
        snprintf(o->err, sizeof(o->err), "%s", hep_last_error());
        return o->rc_combine;
    }
    CK(cudaMemcpy(o->combined, d->out, (size_t)H * 2 * (size_t)in->t, cudaMemcpyDeviceToHost));
    return HEP_OK;
}

/* One dispatch + combine of this rank on the host backend; outputs copied into o. */
static int call_host(ep_case *c, int r, hep_group *g)
{
    ep_rank_in *in = &c->in[r];
    ep_rank_out *o = &c->out[r];
    const int H = c->cfg.hidden, El = c->cfg.experts_per_rank, ns = H / 128;
    const size_t rb = (size_t)H * esize(c);
    hep_dispatch_args da;
    hep_dispatch_result dr;
    hep_combine_args ca;
    da = ep_case_args(c, in->t, in->tokens, in->scales, in->idx, in->weights, NULL);
    if (ep_case_dispatch(c, o, g, &da, &dr))
        return o->rc_dispatch;
    o->num_recv = dr.num_recv;
    memcpy(o->tpe, dr.host_counts + 1, (size_t)El * sizeof(int));
    memcpy(o->tokens, dr.tokens, rb * (size_t)dr.num_recv);
    memcpy(o->probs, dr.probs, sizeof(float) * (size_t)El * (size_t)dr.num_recv);
    if (dr.scales)
        memcpy(o->scales, dr.scales, sizeof(float) * (size_t)ns * (size_t)dr.num_recv);
    for (int j = 0; j < dr.num_recv; j++)
        for (int h = 0; h < H; h++)
            o->expert_out[(size_t)j * H + h] = ep_expert_value(r, j, h);
    memset(o->combined, 0xff, (size_t)H * 2 * (size_t)in->t); /* poison */
    memset(&ca, 0, sizeof(ca));
    ca.handle = dr.handle;
    ca.out = o->combined;
    ca.expert_out = o->expert_out;
    o->rc_combine = hep_combine(g, &ca);
    if (o->rc_combine)
        snprintf(o->err, sizeof(o->err), "%s", hep_last_error());
    return o->rc_combine;
}

/* Fresh routing for every rank (rank 0, between two barriers). */
static void new_inputs(stress *s)
{
    ep_case *c = &s->c;
    for (int r = 0; r < c->world; r++) {
        free(c->in[r].tokens), free(c->in[r].scales), free(c->in[r].idx), free(c->in[r].weights);
        memset(&c->in[r], 0, sizeof(c->in[r]));
        c->out[r].rc_dispatch = c->out[r].rc_combine = 0;
        c->out[r].err[0] = 0;
    }
    c->index64 = (int)(s->seed % 2);
    ep_case_random(c, s->seed, (int)(s->seed % 3)); /* uniform, skewed, by node */
}

static int stress_rank(rank_ctx *rc)
{
    stress *s = rc->arg;
    ep_case *c = &s->c;
    ep_rank_out *o = &c->out[rc->rank];
    const int H = c->cfg.hidden, El = c->cfg.experts_per_rank;
    hep_group *g = NULL;
    dev_bufs d;
    size_t maxr;
    int rc0 = hep_group_create(&c->cfg, &rc->bs, 0, &g);
    if (rc0) { /* collective: every rank failed with the same message */
        snprintf(o->err, sizeof(o->err), "create: %s", hep_last_error());
        o->rc_dispatch = rc0;
        return rc0;
    }
    {
        hep_group_info gi;
        hep_group_get_info(g, &gi);
        maxr = (size_t)gi.max_recv_rows;
    }
    if (s->gpu && dev_alloc(c, rc->rank, maxr, &d, o->err, sizeof(o->err))) {
        o->rc_dispatch = HEP_ERR_CUDA;
        s->failed = 1; /* the others see it at the first check and stop */
    }
    o->tpe = calloc((size_t)El, sizeof(int));
    o->tokens = malloc(maxr * (size_t)H * esize(c) + 1);
    o->probs = malloc(sizeof(float) * maxr * (size_t)El + 1);
    o->scales = malloc(sizeof(float) * maxr * (size_t)(H / 128 + 1) + 1);
    o->expert_out = malloc(maxr * (size_t)H * 2 + 16);
    o->combined = malloc(((size_t)c->cfg.max_tokens + 1) * (size_t)H * 2);
    /* each call: rank 0 draws the routing between two barriers, every rank calls, then rank
     * 0 checks every rank's outputs; a barrier that fails (a rank stuck past the timeout)
     * ends the run as a failure */
    for (;;) {
        if (rc->bs.barrier(rc->bs.ctx))
            break;
        if (rc->rank == 0) {
            s->stop = s->failed || s->calls >= s->max_calls || now_s() >= s->until;
            if (!s->stop) {
                s->seed++;
                new_inputs(s);
            }
        }
        if (rc->bs.barrier(rc->bs.ctx) || s->stop)
            break;
        if (s->gpu ? call_gpu(c, rc->rank, g, &d) : call_host(c, rc->rank, g))
            __atomic_store_n(&s->failed, 1, __ATOMIC_RELEASE);
        if (rc->bs.barrier(rc->bs.ctx))
            break;
        if (rc->rank == 0 && !s->failed) {
            if (ep_case_check(c)) {
                fprintf(stderr, "stress: call %ld (seed %u): outputs differ from the oracle\n",
                        s->calls + 1, s->seed);
                s->failed = 1;
            } else {
                s->calls++;
            }
        }
    }
    if (s->stop == 0) /* left through a failed barrier */
        __atomic_store_n(&s->failed, 1, __ATOMIC_RELEASE);
    if (s->gpu)
        dev_free(&d);
    hep_group_destroy(g);
    return 0;
}

typedef struct shape {
    int N, R, H, T, El, K;
    hep_dtype dt;
} shape;

int main(int argc, char **argv)
{
    static stress s;
    const char *mode = argc > 1 ? argv[1] : "host";
    const int gpu = strcmp(mode, "gpu") == 0;
    const double seconds = getenv("HEP_STRESS_SECONDS") ? atof(getenv("HEP_STRESS_SECONDS")) : 3;
    const long max_calls = getenv("HEP_STRESS_CALLS") ? atol(getenv("HEP_STRESS_CALLS")) : 10000;
    const unsigned seed0 =
        getenv("HEP_STRESS_SEED") ? (unsigned)strtoul(getenv("HEP_STRESS_SEED"), NULL, 10) : 1;
    /* host: the routing and sizes of the soak, several tokens per block; gpu: small shapes
     * (compute-sanitizer runs them too), BF16 and FP8 */
    static const shape host_shapes[] = {{2, 2, 64, 24, 2, 4, HEP_DTYPE_BF16},
                                        {2, 4, 128, 16, 2, 3, HEP_DTYPE_FP8_E4M3},
                                        {4, 2, 64, 20, 1, 4, HEP_DTYPE_BF16}};
    static const shape gpu_shapes[] = {{2, 2, 256, 32, 2, 4, HEP_DTYPE_BF16},
                                       {2, 4, 256, 32, 2, 4, HEP_DTYPE_FP8_E4M3},
                                       {4, 2, 256, 32, 2, 4, HEP_DTYPE_BF16}};
    const int chunk = getenv("HEP_STRESS_CHUNK") ? atoi(getenv("HEP_STRESS_CHUNK")) : 3;
    const shape *shapes = gpu ? gpu_shapes : host_shapes;
    int failed = 0;
    if (!gpu && strcmp(mode, "host") != 0) {
        fprintf(stderr, "usage: stress_internode [host|gpu]\n");
        return 2;
    }
    if (gpu) {
        int n = 0;
        if (!hep_has_gpu_backend()) {
            printf("skipped: this build of hybridep has no GPU kernels\n");
            return 77;
        }
        /* a hardware queue per virtual rank and loopback NIC (tests/test_gpu_train.c) */
        setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
        if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
            printf("skipped: no CUDA GPU on this machine\n");
            return 77;
        }
    }
    printf("stress: %s backend, HEP_DEBUG_JITTER_US=%llu (seed %llu), at most %.1f s and %ld "
           "calls per shape, chunk_tokens %d\n",
           gpu ? "GPU" : "host", (unsigned long long)hep_env_get()->jitter_us,
           (unsigned long long)hep_env_get()->jitter_seed, seconds, max_calls, chunk);
    for (int k = 0; k < 3 && !failed; k++) {
        const shape *sh = &shapes[k];
        rank_ctx ctx[EP_MAX_RANKS];
        double t0 = now_s();
        memset(&s, 0, sizeof(s));
        s.gpu = gpu;
        s.c.cfg = test_config(sh->H, sh->T, sh->El, sh->K, sh->dt);
        s.c.cfg.backend = gpu ? HEP_BACKEND_GPU : HEP_BACKEND_HOST;
        s.c.cfg.ranks_per_node = sh->R;
        s.c.cfg.chunk_tokens = chunk;
        if (gpu)
            s.c.cfg.dispatch_sms = s.c.cfg.combine_sms = 4;
        s.c.world = sh->N * sh->R;
        s.c.K = sh->K;
        s.c.skip_rank = -1;
        s.seed = seed0 + 1000000u * (unsigned)k;
        s.max_calls = max_calls;
        s.until = t0 + seconds;
        if (run_ranks(s.c.world, stress_rank, &s, ctx)) {
            fprintf(stderr, "stress: could not start %d ranks\n", s.c.world);
            return 1;
        }
        for (int r = 0; r < s.c.world; r++)
            if (s.c.out[r].rc_dispatch || s.c.out[r].rc_combine) {
                fprintf(stderr,
                        "stress %d x %d: call %ld (seed %u): rank %d: dispatch %s, combine %s: "
                        "%s\n",
                        sh->N, sh->R, s.calls + 1, s.seed, r,
                        hep_status_name(s.c.out[r].rc_dispatch),
                        hep_status_name(s.c.out[r].rc_combine), s.c.out[r].err);
                s.failed = 1;
            }
        printf("stress %d x %d (%s, H %d, T %d): %ld calls in %.1f s, %s\n", sh->N, sh->R,
               sh->dt == HEP_DTYPE_FP8_E4M3 ? "fp8" : "bf16", sh->H, sh->T, s.calls,
               now_s() - t0, s.failed ? "FAILED" : "all outputs equal to the oracle");
        failed |= s.failed || s.calls == 0; /* a shape that ran no call proves nothing */
        ep_case_free(&s.c);
    }
    return failed ? 1 : 0;
}
