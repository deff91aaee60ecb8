/* The GPU backend with one process per rank (mpirun -np W, every rank on one GPU or one GPU
 * each: node-mates share memory through CUDA IPC). Public API only (libhybridep and
 * libhybridep_mpi), so it builds on the GPU machine from the source tree with mpicc.
 *
 *   test_gpu_mpi correct   dispatch + combine on the GPU equal the host backend's, run on
 *                          the same processes with the same inputs, element by element
 *                          (received rows, probabilities, FP8 scales, tokens per expert,
 *                          combined tokens bit for bit); BF16 / FP8, int32 / int64 ids,
 *                          ragged t, a caller's and the in-place combine input, HEP_ASYNC
 *   test_gpu_mpi bench     medians of the dispatch and combine phases (from the last
 *                          rank's start to the last rank's end, CLOCK_MONOTONIC, which all
 *                          processes of a host share) at the bench's default shape
 *   test_gpu_mpi missing   the last rank never calls dispatch: every other rank returns
 *                          HEP_ERR_TIMEOUT naming it within 3 x HEP_TIMEOUT_MS
 *   test_gpu_mpi permute   the expert-major layout (hep_dispatch_ex / hep_combine_ex, a
 *                          caller handle; across processes through the group's staging,
 *                          config.max_permuted_rows) equal to the host backend's: rows,
 *                          probabilities, FP8 scales, padded tokens per expert, the
 *                          overflow words, combined tokens and probabilities through
 *                          combine bit for bit; pad 1 / 128, BF16 / FP8, a budget that
 *                          drops rows (HEP_ASYNC), a reused layout, combines in another
 *                          order and twice; and (GPU) the refusals without / above
 *                          max_permuted_rows. Names the rank and the first differing row.
 *   test_gpu_mpi nodes     W / 2 ranks per node (two virtual nodes across processes): runs
 *                          the inter-node path where a verbs NIC serves them, else checks
 *                          the refusal (HEP_ERR_UNAVAILABLE naming the loopback NIC)
 *
 * Exit 0 when every check passed, 1 on a failure, 77 ("skipped: <reason>") without a GPU
 * or without the GPU kernels in the library. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <mpi.h>

#include "hybridep/bootstrap_mpi.h"
#include "hybridep/hybridep.h"

static int rank = -1, world = 0, failures;
static cudaStream_t stream;

#define CHECK(cond, ...)                                                                         \
    do {                                                                                         \
        if (!(cond)) {                                                                           \
            failures++;                                                                          \
            fprintf(stderr, "rank %d: FAILED %s: ", rank, #cond);                                \
            fprintf(stderr, __VA_ARGS__);                                                        \
            fprintf(stderr, "\n");                                                               \
        }                                                                                        \
    } while (0)

static void cuda_ok(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        fprintf(stderr, "rank %d: %s: %s (%s)\n", rank, what, cudaGetErrorName(e),
                cudaGetErrorString(e));
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
}

/* HEP_MPI_HOST_ONLY=1: the harness itself with the host backend in place of the GPU one
 * and host memory in place of device memory (CI runs it so, without a GPU). */
static int host_only;

static void *dalloc(size_t n)
{
    void *p = NULL;
    if (host_only)
        p = calloc(1, n + 16);
    else
        cuda_ok(cudaMalloc(&p, n + 16), "cudaMalloc");
    if (!p)
        MPI_Abort(MPI_COMM_WORLD, 1);
    return p;
}

static void dfree(void *p)
{
    if (host_only)
        free(p);
    else if (p)
        cudaFree(p);
}

/* Copies between host and device memory (or host and host): unified addressing. */
static void dcopy(void *dst, const void *src, size_t n)
{
    if (host_only)
        memmove(dst, src, n);
    else
        cuda_ok(cudaMemcpy(dst, src, n, cudaMemcpyDefault), "cudaMemcpy");
}

static void dsync(void)
{
    if (!host_only)
        cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint16_t bf16_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float f32_of(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* ------------------------------------------------------------------ one rank's inputs */
typedef struct inputs {
    int t, K, index64, fp8, H;
    unsigned char *tokens; /* [t, H x esize] */
    float *scales;         /* fp8: [t, H / 128] */
    void *idx;             /* [t, K] */
    float *weights;        /* [t, K] */
} inputs;

/* This rank's inputs of (seed, call): t in [0, T] when ragged, K distinct experts a token
 * (uniform over E), 15 % of the slots -1 unless `full`. */
static void make_inputs(inputs *in, const hep_config *c, int K, int index64, int ragged,
                        int full, unsigned seed)
{
    const int H = c->hidden, E = c->experts_per_rank * world, fp8 = c->dtype == HEP_DTYPE_FP8_E4M3;
    const size_t rb = (size_t)H * (fp8 ? 1 : 2);
    uint64_t s = (uint64_t)seed * 1000003u + (uint64_t)rank * 7919u + 1;
    memset(in, 0, sizeof(*in));
    in->t = ragged ? (int)(rng_next(&s) % (uint64_t)(c->max_tokens + 1)) : c->max_tokens;
    in->K = K, in->index64 = index64, in->fp8 = fp8, in->H = H;
    in->tokens = malloc(rb * (size_t)in->t + 16);
    in->scales = malloc(sizeof(float) * (size_t)(H / 128) * (size_t)in->t + 16);
    in->idx = malloc((size_t)in->t * (size_t)K * 8 + 16);
    in->weights = malloc(sizeof(float) * (size_t)in->t * (size_t)K + 16);
    for (int i = 0; i < in->t; i++) {
        for (int h = 0; h < H; h++) {
            uint64_t r = rng_next(&s);
            if (fp8) {
                unsigned char b = (unsigned char)r;
                in->tokens[(size_t)i * rb + (size_t)h] = (b & 0x7f) == 0x7f ? 0 : b; /* no NaN */
            } else {
                uint16_t v = bf16_of(((float)(r % 2001) - 1000.0f) / 64.0f);
                memcpy(in->tokens + (size_t)i * rb + (size_t)h * 2, &v, 2);
            }
        }
        for (int q = 0; fp8 && q < H / 128; q++)
            in->scales[(size_t)i * (size_t)(H / 128) + (size_t)q] =
                (float)(rng_next(&s) % 1000 + 1) / 256.0f;
        for (int k = 0; k < K; k++) {
            long long id;
            int dup;
            do { /* distinct experts (E >= K: checked by the configuration) */
                id = (long long)(rng_next(&s) % (uint64_t)E);
                dup = 0;
                for (int j = 0; j < k; j++) {
                    long long o = index64 ? ((long long *)in->idx)[(size_t)i * K + j]
                                          : ((int *)in->idx)[(size_t)i * K + j];
                    dup |= o == id;
                }
            } while (dup);
            if (!full && rng_next(&s) % 100 < 15)
                id = -1;
            if (index64)
                ((long long *)in->idx)[(size_t)i * K + k] = id;
            else
                ((int *)in->idx)[(size_t)i * K + k] = (int)id;
            in->weights[(size_t)i * K + k] = (float)(rng_next(&s) % 1000) / 1000.0f;
        }
    }
}

static void free_inputs(inputs *in)
{
    free(in->tokens), free(in->scales), free(in->idx), free(in->weights);
    memset(in, 0, sizeof(*in));
}

/* Expert output of received row j, channel h: mixed signs and some -0.0, so that a sum that
 * starts from +0.0 or drops a sign is caught. */
static uint16_t expert_value(int j, int h, unsigned seed)
{
    if ((j + h) % 17 == 0)
        return 0x8000; /* -0.0 */
    return bf16_of((float)((rank + 1) * 8 + (int)(seed % 5) + j % 13) * ((h % 3) ? 1.0f : -1.0f) +
                   (float)(h % 5) * 0.25f);
}

/* ------------------------------------------------------------------ one call's outputs */
typedef struct outputs {
    int rc_d, rc_c, num_recv;
    int tpe[1024];
    unsigned char *tokens;
    float *probs, *scales;
    uint16_t *combined;
} outputs;

static void free_outputs(outputs *o)
{
    free(o->tokens), free(o->probs), free(o->scales), free(o->combined);
    memset(o, 0, sizeof(*o));
}

typedef struct call_opts {
    unsigned flags;   /* 0 or HEP_ASYNC */
    int in_place;     /* expert outputs written into hep_combine_input(g) */
    unsigned seed;    /* of the expert outputs */
} call_opts;

/* One dispatch + combine on g (GPU: device copies of the inputs on `stream`). */
/* The dispatch inputs where the backend reads them: device copies (gpu; freed by
 * unstage_inputs) or the host arrays themselves. */
typedef struct staged {
    void *tok, *idx, *w, *sc;
    int own;
} staged;

static staged stage_inputs(const inputs *in, int gpu, size_t rb, int ns)
{
    const size_t t = (size_t)in->t, K = (size_t)in->K;
    staged s = {in->tokens, in->idx, in->weights, in->scales, 0};
    if (!gpu)
        return s;
    s.own = 1;
    s.tok = dalloc(rb * t + 16), s.idx = dalloc(t * K * 8 + 16), s.w = dalloc(t * K * 4 + 16);
    s.sc = dalloc(t * (size_t)ns * 4 + 16);
    dcopy(s.tok, in->tokens, rb * t);
    dcopy(s.idx, in->idx, t * K * (in->index64 ? 8 : 4));
    dcopy(s.w, in->weights, t * K * 4);
    if (in->fp8)
        dcopy(s.sc, in->scales, t * (size_t)ns * 4);
    return s;
}

static void unstage_inputs(staged *s)
{
    if (s->own)
        dfree(s->tok), dfree(s->idx), dfree(s->w), dfree(s->sc);
    s->own = 0;
}

static void run_call(hep_group *g, int gpu, const hep_config *c, const inputs *in,
                     const call_opts *co, outputs *o)
{
    const int H = c->hidden, El = c->experts_per_rank, ns = H / 128;
    const size_t rb = (size_t)H * (in->fp8 ? 1 : 2), t = (size_t)in->t;
    void *dout = NULL, *dexp = NULL;
    staged sin = stage_inputs(in, gpu, rb, ns);
    hep_dispatch_args da;
    hep_dispatch_result dr;
    hep_combine_args ca;
    uint16_t *exp_rows;
    memset(o, 0, sizeof(*o));
    memset(&da, 0, sizeof(da));
    da.num_tokens = in->t;
    da.topk = in->K;
    da.index_type = in->index64 ? HEP_INDEX_INT64 : HEP_INDEX_INT32;
    da.flags = co->flags;
    da.tokens = sin.tok, da.topk_idx = sin.idx, da.topk_weights = sin.w;
    da.scales = in->fp8 ? sin.sc : NULL;
    if (gpu)
        da.stream = stream;
    o->rc_d = hep_dispatch(g, &da, &dr);
    CHECK(o->rc_d == HEP_OK, "%s dispatch: %s", gpu ? "GPU" : "host", hep_last_error());
    if (o->rc_d != HEP_OK)
        goto out;
    if (co->flags & HEP_ASYNC) {
        dsync();
        CHECK(hep_group_sync(g, stream) == HEP_OK, "hep_group_sync: %s", hep_last_error());
        CHECK(dr.num_recv == -1, "an asynchronous dispatch returned num_recv %d", dr.num_recv);
        dr.num_recv = dr.host_counts[0]; /* valid once the stream passed the dispatch */
    }
    o->num_recv = dr.num_recv;
    memcpy(o->tpe, dr.host_counts + 1, sizeof(int) * (size_t)El);
    o->tokens = malloc(rb * (size_t)dr.num_recv + 16);
    o->probs = malloc(4 * (size_t)El * (size_t)dr.num_recv + 16);
    o->scales = calloc((size_t)ns * (size_t)dr.num_recv + 4, 4);
    if (gpu) {
        dcopy(o->tokens, dr.tokens, rb * (size_t)dr.num_recv);
        dcopy(o->probs, dr.probs, 4 * (size_t)El * (size_t)dr.num_recv);
        if (in->fp8 && dr.scales)
            dcopy(o->scales, dr.scales, 4 * (size_t)ns * (size_t)dr.num_recv);
    } else {
        memcpy(o->tokens, dr.tokens, rb * (size_t)dr.num_recv);
        memcpy(o->probs, dr.probs, 4 * (size_t)El * (size_t)dr.num_recv);
        if (in->fp8 && dr.scales)
            memcpy(o->scales, dr.scales, 4 * (size_t)ns * (size_t)dr.num_recv);
    }
    exp_rows = malloc((size_t)H * 2 * (size_t)dr.num_recv + 16);
    for (int j = 0; j < dr.num_recv; j++)
        for (int h = 0; h < H; h++)
            exp_rows[(size_t)j * H + h] = expert_value(j, h, co->seed);
    o->combined = malloc((size_t)H * 2 * t + 16);
    memset(&ca, 0, sizeof(ca));
    ca.handle = dr.handle;
    ca.flags = co->flags;
    if (gpu) {
        void *dst = co->in_place ? hep_combine_input(g) : NULL;
        if (!dst) {
            dexp = dalloc((size_t)H * 2 * (size_t)dr.num_recv + 16);
            dst = dexp;
        }
        dcopy(dst, exp_rows, (size_t)H * 2 * (size_t)dr.num_recv);
        dout = dalloc((size_t)H * 2 * t + 16);
        {
            unsigned char *poison = malloc((size_t)H * 2 * t + 16);
            memset(poison, 0xff, (size_t)H * 2 * t + 16);
            dcopy(dout, poison, (size_t)H * 2 * t);
            free(poison);
        }
        ca.expert_out = dst, ca.out = dout, ca.stream = stream;
    } else {
        void *dst = co->in_place ? hep_combine_input(g) : exp_rows;
        if (co->in_place)
            memcpy(dst, exp_rows, (size_t)H * 2 * (size_t)dr.num_recv);
        memset(o->combined, 0xff, (size_t)H * 2 * t);
        ca.expert_out = dst, ca.out = o->combined;
    }
    o->rc_c = hep_combine(g, &ca);
    CHECK(o->rc_c == HEP_OK, "%s combine: %s", gpu ? "GPU" : "host", hep_last_error());
    if (gpu && o->rc_c == HEP_OK) {
        if (co->flags & HEP_ASYNC) {
            dsync();
            CHECK(hep_group_sync(g, stream) == HEP_OK, "hep_group_sync: %s", hep_last_error());
        }
        dcopy(o->combined, dout, (size_t)H * 2 * t);
    }
    free(exp_rows);
out:
    unstage_inputs(&sin);
    dfree(dout), dfree(dexp);
}

/* GPU outputs against the host backend's: every element; exact unless tol > 0 (combine
 * across nodes rounds each node's partial sum to BF16). Returns the mismatches. */
static int compare(const char *name, const hep_config *c, const inputs *in, const outputs *gpu,
                   const outputs *host, double tol)
{
    const int H = c->hidden, El = c->experts_per_rank, ns = H / 128;
    const size_t rb = (size_t)H * (in->fp8 ? 1 : 2);
    int bad = 0;
    if (gpu->rc_d || host->rc_d || gpu->rc_c || host->rc_c)
        return 1; /* reported where it happened */
    if (gpu->num_recv != host->num_recv) {
        fprintf(stderr, "rank %d: %s: GPU received %d rows, the host backend %d\n", rank, name,
                gpu->num_recv, host->num_recv);
        return 1;
    }
    for (int e = 0; e < El; e++)
        if (gpu->tpe[e] != host->tpe[e] && bad++ < 3)
            fprintf(stderr, "rank %d: %s: tokens_per_expert[%d] GPU %d host %d\n", rank, name, e,
                    gpu->tpe[e], host->tpe[e]);
    for (size_t j = 0; j < (size_t)gpu->num_recv; j++) {
        if (memcmp(gpu->tokens + j * rb, host->tokens + j * rb, rb) && bad++ < 3)
            fprintf(stderr, "rank %d: %s: received row %zu differs\n", rank, name, j);
        if (memcmp(gpu->probs + j * (size_t)El, host->probs + j * (size_t)El, 4 * (size_t)El) &&
            bad++ < 3)
            fprintf(stderr, "rank %d: %s: probabilities of row %zu differ (GPU %g host %g ...)\n",
                    rank, name, j, gpu->probs[j * (size_t)El], host->probs[j * (size_t)El]);
        if (in->fp8 && memcmp(gpu->scales + j * (size_t)ns, host->scales + j * (size_t)ns,
                              4 * (size_t)ns) && bad++ < 3)
            fprintf(stderr, "rank %d: %s: FP8 scales of row %zu differ\n", rank, name, j);
    }
    for (size_t i = 0; i < (size_t)in->t; i++)
        for (size_t h = 0; h < (size_t)H; h++) {
            uint16_t a = gpu->combined[i * (size_t)H + h], b = host->combined[i * (size_t)H + h];
            int diff = tol > 0 ? fabs(f32_of(a) - f32_of(b)) > tol * (1.0 + fabs(f32_of(b))) : a != b;
            if (diff && bad++ < 3)
                fprintf(stderr, "rank %d: %s: combined token %zu channel %zu: GPU 0x%04x (%g) "
                        "host 0x%04x (%g)\n", rank, name, i, h, a, f32_of(a), b, f32_of(b));
        }
    return bad;
}

static void config(hep_config *c, int H, int T, int El, int K, int fp8, int backend, int R)
{
    hep_config_default(c);
    c->hidden = H, c->max_tokens = T, c->experts_per_rank = El, c->max_topk = K;
    c->dtype = fp8 ? HEP_DTYPE_FP8_E4M3 : HEP_DTYPE_BF16;
    c->backend = backend;
    c->ranks_per_node = R;
    c->dispatch_sms = c->combine_sms = 4; /* W x 4 blocks fit one GPU together */
}

static int gpu_backend(void)
{
    return host_only ? HEP_BACKEND_HOST : HEP_BACKEND_GPU;
}

static int device_of_rank(void)
{
    int n = 0;
    if (host_only)
        return 0;
    cuda_ok(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
    return rank % n;
}

/* A case: `calls` dispatch + combine rounds, each on fresh inputs, GPU against host. */
/* The end of a case against the host backend: both groups destroyed, and the mismatches
 * of every rank summed (a rank's own are reported here). */
static int end_case(hep_group *gg, hep_group *gh, int bad, const char *name)
{
    int total = 0;
    if (gg)
        CHECK(hep_group_destroy(gg) == HEP_OK, "GPU destroy: %s", hep_last_error());
    if (gh)
        CHECK(hep_group_destroy(gh) == HEP_OK, "host destroy: %s", hep_last_error());
    MPI_Allreduce(&bad, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    CHECK(bad == 0, "%s: %d mismatches against the host backend", name, bad);
    return total;
}

static void case_vs_host(const char *name, int H, int T, int El, int K, int fp8, int index64,
                         int gpu_R, int calls, const hep_bootstrap *bs)
{
    hep_config ch, cg;
    hep_group *gh = NULL, *gg = NULL;
    int rc, bad = 0, total = 0, dev = device_of_rank();
    double t0 = now_s();
    config(&ch, H, T, El, K, fp8, HEP_BACKEND_HOST, 0);
    config(&cg, H, T, El, K, fp8, gpu_backend(), gpu_R);
    rc = hep_group_create(&ch, bs, dev, &gh);
    CHECK(rc == HEP_OK, "%s: host group: %s", name, hep_last_error());
    rc = rc ? rc : hep_group_create(&cg, bs, dev, &gg);
    CHECK(rc == HEP_OK, "%s: GPU group: %s", name, hep_last_error());
    for (int call = 0; rc == HEP_OK && call < calls; call++) {
        inputs in;
        outputs og, oh;
        call_opts co = {call == 2 ? HEP_ASYNC : 0u, call == 1, 100u + (unsigned)call};
        make_inputs(&in, &cg, K, index64, call != 0, 0, 1000u * (unsigned)H + (unsigned)call);
        run_call(gh, 0, &ch, &in, &co, &oh);
        run_call(gg, 1, &cg, &in, &co, &og);
        bad += compare(name, &cg, &in, &og, &oh, gpu_R && gpu_R < world ? 1e-2 : 0.0);
        if (og.rc_d || og.rc_c || oh.rc_d || oh.rc_c)
            rc = HEP_ERR_INTERNAL;
        free_outputs(&og), free_outputs(&oh), free_inputs(&in);
    }
    total = end_case(gg, gh, bad, name);
    if (rank == 0)
        printf("%s: %s (%d calls, %.1f s)\n", total || rc ? "FAILED" : "ok", name, calls,
               now_s() - t0);
    fflush(stdout);
}

static int mode_correct(const hep_bootstrap *bs)
{
    char name[256];
    snprintf(name, sizeof(name), "%d processes on one node, BF16, int32 ids, H 512, T 64", world);
    case_vs_host(name, 512, 64, 4, 4, 0, 0, 0, 3, bs);
    snprintf(name, sizeof(name), "%d processes on one node, FP8, int64 ids, H 1024, T 96", world);
    case_vs_host(name, 1024, 96, 3, 6, 1, 1, 0, 3, bs);
    snprintf(name, sizeof(name), "%d processes on one node, BF16, int64 ids, H 7168, T 512, "
             "E_l 32, K 8", world);
    case_vs_host(name, 7168, 512, 32, 8, 0, 1, 0, 3, bs);
    return failures;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static int env_int(const char *name, int dflt)
{
    const char *s = getenv(name);
    return s && *s ? atoi(s) : dflt;
}

/* The bench's default shape (HEP_MPI_TOKENS, _HIDDEN, _EXPERTS, _TOPK, _SMS, _ITERS
 * override it), uniform routing, every slot used. */
static int mode_bench(const hep_bootstrap *bs)
{
    const int T = env_int("HEP_MPI_TOKENS", 4096), H = env_int("HEP_MPI_HIDDEN", 7168);
    const int El = env_int("HEP_MPI_EXPERTS", 32), K = env_int("HEP_MPI_TOPK", 8);
    const int S = env_int("HEP_MPI_SMS", 16), warm = 5;
    const int iters = env_int("HEP_MPI_ITERS", 20) < 1 ? 1 : env_int("HEP_MPI_ITERS", 20) > 1000
                          ? 1000 : env_int("HEP_MPI_ITERS", 20);
    const int n = iters + warm;
    hep_config c;
    hep_group *g = NULL;
    inputs in;
    void *dtok, *didx, *dw, *dout;
    double *st = calloc((size_t)n * 4, sizeof(double)), *mx = calloc((size_t)n * 4, sizeof(double));
    double dsp[1024], cmb[1024], own_d[1024], own_c[1024];
    int rows = 0, rc;
    config(&c, H, T, El, K, 0, gpu_backend(), 0);
    c.dispatch_sms = c.combine_sms = S;
    rc = hep_group_create(&c, bs, device_of_rank(), &g);
    CHECK(rc == HEP_OK, "bench group: %s", hep_last_error());
    if (rc)
        return failures;
    make_inputs(&in, &c, K, 1, 0, 1, 4242u);
    dtok = dalloc((size_t)T * H * 2);
    didx = dalloc((size_t)T * K * 8);
    dw = dalloc((size_t)T * K * 4);
    dout = dalloc((size_t)T * H * 2);
    dcopy(dtok, in.tokens, (size_t)T * H * 2);
    dcopy(didx, in.idx, (size_t)T * K * 8);
    dcopy(dw, in.weights, (size_t)T * K * 4);
    for (int it = 0; it < n && rc == HEP_OK; it++) {
        hep_dispatch_args da = {.num_tokens = T, .tokens = dtok, .topk_idx = didx,
                                .index_type = HEP_INDEX_INT64, .topk = K, .topk_weights = dw,
                                .stream = stream};
        hep_dispatch_result dr;
        hep_combine_args ca;
        MPI_Barrier(MPI_COMM_WORLD);
        st[it * 4 + 0] = now_s();
        rc = hep_dispatch(g, &da, &dr);
        st[it * 4 + 1] = now_s();
        CHECK(rc == HEP_OK, "bench dispatch: %s", hep_last_error());
        if (rc)
            break;
        rows = dr.num_recv;
        memset(&ca, 0, sizeof(ca));
        ca.handle = dr.handle, ca.expert_out = hep_combine_input(g), ca.out = dout;
        ca.stream = stream;
        MPI_Barrier(MPI_COMM_WORLD);
        st[it * 4 + 2] = now_s();
        rc = hep_combine(g, &ca);
        st[it * 4 + 3] = now_s();
        CHECK(rc == HEP_OK, "bench combine: %s", hep_last_error());
    }
    MPI_Allreduce(st, mx, n * 4, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (rc == HEP_OK) {
        long long all_rows = 0, mine = rows;
        for (int it = warm; it < n; it++) {
            dsp[it - warm] = mx[it * 4 + 1] - mx[it * 4 + 0]; /* last start to last end */
            cmb[it - warm] = mx[it * 4 + 3] - mx[it * 4 + 2];
            own_d[it - warm] = st[it * 4 + 1] - st[it * 4 + 0];
            own_c[it - warm] = st[it * 4 + 3] - st[it * 4 + 2];
        }
        MPI_Allreduce(&mine, &all_rows, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
        double md = median(dsp, iters), mc = median(cmb, iters);
        double od = median(own_d, iters), oc = median(own_c, iters), od_max = 0, oc_max = 0;
        MPI_Reduce(&od, &od_max, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        MPI_Reduce(&oc, &oc_max, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            double rb = (double)H * 2, per_rank = (double)all_rows / world;
            printf("bench: %d processes, T %d, H %d, E_l %d, K %d, BF16, %d SMs, %d iterations "
                   "(median; phase = last rank's start to last rank's end)\n",
                   world, T, H, El, K, S, iters);
            printf("  dispatch %8.3f ms  (slowest rank's own call %8.3f ms)  %7.1f GB/s algbw "
                   "per rank, %.0f rows per rank\n", md * 1e3, od_max * 1e3,
                   per_rank * rb / md * 1e-9, per_rank);
            printf("  combine  %8.3f ms  (slowest rank's own call %8.3f ms)  %7.1f GB/s algbw "
                   "per rank\n", mc * 1e3, oc_max * 1e3, per_rank * rb / mc * 1e-9);
            printf("BENCH_MPI dispatch_ms=%.4f combine_ms=%.4f\n", md * 1e3, mc * 1e3);
        }
    }
    dfree(dtok), dfree(didx), dfree(dw), dfree(dout);
    free_inputs(&in);
    free(st), free(mx);
    CHECK(hep_group_destroy(g) == HEP_OK, "destroy: %s", hep_last_error());
    return failures;
}

/* The last rank never calls dispatch: the others time out naming it, within bounds. */
static int mode_missing(const hep_bootstrap *bs)
{
    const int missing = world - 1;
    const double limit_s = 3.0 * env_int("HEP_TIMEOUT_MS", 30000) / 1000.0;
    char msg[512] = "", *all = NULL;
    double took = 0, *tooks = NULL;
    int rc, *rcs = NULL;
    hep_config c;
    hep_group *g = NULL;
    config(&c, 512, 64, 4, 4, 0, gpu_backend(), 0);
    rc = hep_group_create(&c, bs, device_of_rank(), &g);
    CHECK(rc == HEP_OK, "create: %s", hep_last_error());
    if (rc)
        return failures;
    {   /* one good call first: the group works */
        inputs in;
        outputs o;
        call_opts co = {0, 0, 1};
        make_inputs(&in, &c, 4, 0, 1, 0, 5);
        run_call(g, 1, &c, &in, &co, &o);
        free_outputs(&o), free_inputs(&in);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank != missing) {
        const size_t t = (size_t)c.max_tokens, rb = (size_t)c.hidden * 2, K = 4;
        void *dtok, *didx, *dw;
        hep_dispatch_args da;
        hep_dispatch_result dr;
        inputs in;
        double t0;
        make_inputs(&in, &c, (int)K, 0, 0, 0, 6);
        dtok = dalloc(t * rb);
        didx = dalloc(t * K * 4);
        dw = dalloc(t * K * 4);
        dcopy(dtok, in.tokens, t * rb);
        dcopy(didx, in.idx, t * K * 4);
        dcopy(dw, in.weights, t * K * 4);
        memset(&da, 0, sizeof(da));
        da.num_tokens = (int)t, da.tokens = dtok, da.topk_idx = didx, da.topk = (int)K;
        da.topk_weights = dw, da.stream = stream;
        t0 = now_s();
        rc = hep_dispatch(g, &da, &dr);
        took = now_s() - t0;
        snprintf(msg, sizeof(msg), "%s", hep_last_error());
        dfree(dtok), dfree(didx), dfree(dw);
        free_inputs(&in);
    }
    if (rank == 0) {
        rcs = calloc((size_t)world, sizeof(int));
        tooks = calloc((size_t)world, sizeof(double));
        all = calloc((size_t)world, sizeof(msg));
    }
    MPI_Gather(&rc, 1, MPI_INT, rcs, 1, MPI_INT, 0, MPI_COMM_WORLD);
    MPI_Gather(&took, 1, MPI_DOUBLE, tooks, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    MPI_Gather(msg, (int)sizeof(msg), MPI_CHAR, all, (int)sizeof(msg), MPI_CHAR, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        char want[32];
        snprintf(want, sizeof(want), "rank %d", missing);
        for (int r = 0; r < world; r++) {
            const char *m = all + (size_t)r * sizeof(msg);
            if (r == missing) {
                printf("  rank %d: never called dispatch\n", r);
                continue;
            }
            printf("  rank %d: %s after %.2f s: %s\n", r, hep_status_name(rcs[r]), tooks[r], m);
            CHECK(rcs[r] == HEP_ERR_TIMEOUT, "rank %d returned %s", r, hep_status_name(rcs[r]));
            CHECK(strstr(m, want) != NULL, "rank %d's message does not name %s", r, want);
            CHECK(tooks[r] <= limit_s, "rank %d took %.2f s (limit %.2f s)", r, tooks[r], limit_s);
        }
        free(rcs), free(tooks), free(all);
    }
    rc = hep_group_destroy(g); /* every rank: the group after a timeout */
    if (rank == 0)
        printf("  destroy after the timeout: %s %s\n", hep_status_name(rc), rc ? hep_last_error() : "");
    {
        int total = 0;
        MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        if (rank == 0)
            printf("%s: a rank that never calls dispatch is named by every other rank\n",
                   total ? "FAILED" : "ok");
    }
    return failures;
}

/* Two virtual nodes of W / 2 processes each. */
static int mode_nodes(const hep_bootstrap *bs)
{
    hep_config c;
    hep_group *g = NULL;
    int rc, R = world / 2;
    if (world < 2 || world % 2) {
        if (rank == 0)
            printf("nodes: needs an even number of processes (got %d)\n", world);
        return 1;
    }
    config(&c, 512, 64, 4, 4, 0, gpu_backend(), R);
    rc = hep_group_create(&c, bs, device_of_rank(), &g);
    if (rc == HEP_ERR_UNAVAILABLE) {
        CHECK(strstr(hep_last_error(), "loopback NIC joins ranks of one process only") != NULL,
              "the refusal does not say why: %s", hep_last_error());
        CHECK(g == NULL, "a group was returned with the refusal");
        if (rank == 0)
            printf("%s: 2 x %d virtual nodes across processes are refused: %s\n",
                   failures ? "FAILED" : "ok", R, hep_last_error());
        return failures;
    }
    CHECK(rc == HEP_OK, "2 x %d across processes: %s", R, hep_last_error());
    if (rc)
        return failures;
    if (rank == 0) {
        hep_group_info info;
        hep_group_get_info(g, &info);
        printf("2 x %d virtual nodes across processes: created (transport %s); running the "
               "inter-node path against the host backend on one node\n", R, info.transport);
    }
    CHECK(hep_group_destroy(g) == HEP_OK, "destroy: %s", hep_last_error());
    case_vs_host("2 nodes across processes, BF16 (combine within 1e-2: partial sums in BF16)",
                 512, 64, 4, 4, 0, 0, R, 2, bs);
    return failures;
}

/* ------------------------------------------------------------------ mode permute
 * The expert-major layout (hep_dispatch_ex / hep_combine_ex with a caller handle) on the
 * GPU with one process per rank (through the group's staging, config.max_permuted_rows)
 * against the host backend on the same processes, element by element. */
typedef struct em_out {
    int rc, num_permuted, overflow, overflow_rows;
    int64_t tpe[1024];
    unsigned char *tok; /* [num_permuted] rows */
    float *prob, *scale;
} em_out;

static void free_em(em_out *o)
{
    free(o->tok), free(o->prob), free(o->scale);
    memset(o, 0, sizeof(*o));
}

static int refusal_expected; /* permute_refusals: a dispatch that fails is the check */

static void *dpoisoned(size_t n)
{
    void *d = dalloc(n);
    unsigned char *p = malloc(n + 16);
    memset(p, 0xff, n);
    dcopy(d, p, n);
    free(p);
    return d;
}

/* One expert-major dispatch on g (gpu: device copies of the inputs) recording into (or,
 * reuse, dispatching again with) handle h; the outputs copied back into *o. */
static void em_dispatch(hep_group *g, int gpu, const hep_config *c, const inputs *in,
                        unsigned flags, hep_handle *h, int reuse, int pad, int budget, em_out *o)
{
    const int H = c->hidden, El = c->experts_per_rank, ns = H / 128;
    const size_t rb = (size_t)H * (in->fp8 ? 1 : 2);
    const size_t B = (size_t)budget;
    staged sin = stage_inputs(in, gpu, rb, ns);
    hep_dispatch_args da;
    hep_dispatch_opts xo;
    hep_dispatch_result dr;
    memset(o, 0, sizeof(*o));
    memset(&da, 0, sizeof(da));
    memset(&xo, 0, sizeof(xo));
    da.num_tokens = in->t;
    da.topk = reuse ? 0 : in->K;
    da.index_type = in->index64 ? HEP_INDEX_INT64 : HEP_INDEX_INT32;
    da.flags = flags | (reuse ? HEP_REUSE_LAYOUT : 0u);
    if (gpu)
        da.stream = stream;
    da.tokens = sin.tok;
    da.topk_idx = reuse ? NULL : sin.idx;
    da.topk_weights = reuse ? NULL : sin.w;
    da.scales = in->fp8 ? sin.sc : NULL;
    xo.handle = h;
    xo.layout = HEP_LAYOUT_EXPERT_MAJOR;
    xo.pad_multiple = pad;
    xo.num_permuted_tokens = budget;
    xo.recv_tokens = gpu ? dpoisoned(rb * B) : malloc(rb * B + 16);
    xo.recv_probs = gpu ? dpoisoned(4 * B) : malloc(4 * B + 16);
    xo.recv_scales = gpu ? dpoisoned(4 * B * (size_t)ns + 16) : malloc(4 * B * (size_t)ns + 16);
    o->rc = hep_dispatch_ex(g, &da, &xo, &dr);
    CHECK(o->rc == HEP_OK || refusal_expected, "%s expert-major dispatch: %s",
          gpu ? "GPU" : "host", hep_last_error());
    if (o->rc == HEP_OK) {
        if (flags & HEP_ASYNC) {
            int w[3];
            dsync();
            CHECK(hep_group_sync(g, stream) == HEP_OK, "hep_group_sync: %s", hep_last_error());
            CHECK(!gpu || host_only || xo.num_permuted == -1,
                  "an asynchronous GPU dispatch returned num_permuted %d", xo.num_permuted);
            dcopy(w, xo.permuted_device, sizeof(w));
            dcopy(o->tpe, xo.tokens_per_expert_device, sizeof(int64_t) * (size_t)El);
            o->num_permuted = w[0], o->overflow = w[1], o->overflow_rows = w[2];
        } else {
            o->num_permuted = xo.num_permuted, o->overflow = xo.overflow;
            o->overflow_rows = xo.overflow_rows;
            memcpy(o->tpe, xo.tokens_per_expert, sizeof(int64_t) * (size_t)El);
            CHECK(xo.copy_bytes == (size_t)xo.num_permuted * (rb + 4 + (in->fp8 ? 4u * ns : 0u)),
                  "copy_bytes %zu for %d rows", xo.copy_bytes, xo.num_permuted);
        }
        const size_t n = o->num_permuted > 0 ? (size_t)o->num_permuted : 0;
        o->tok = malloc(rb * n + 16), o->prob = malloc(4 * n + 16);
        o->scale = calloc((size_t)ns * n + 4, 4);
        dcopy(o->tok, xo.recv_tokens, rb * n);
        dcopy(o->prob, xo.recv_probs, 4 * n);
        if (in->fp8)
            dcopy(o->scale, xo.recv_scales, 4 * (size_t)ns * n);
    }
    unstage_inputs(&sin);
    if (gpu) {
        dfree(xo.recv_tokens), dfree(xo.recv_probs), dfree(xo.recv_scales);
    } else {
        free(xo.recv_tokens), free(xo.recv_probs), free(xo.recv_scales);
    }
}

/* The GPU's expert-major outputs against the host's, naming the first differing row. */
static int em_compare(const char *name, const hep_config *c, const inputs *in, const em_out *g,
                      const em_out *h)
{
    const int El = c->experts_per_rank, ns = c->hidden / 128;
    const size_t rb = (size_t)c->hidden * (in->fp8 ? 1 : 2);
    if (g->rc || h->rc)
        return 1;
    if (g->num_permuted != h->num_permuted || g->overflow != h->overflow ||
        g->overflow_rows != h->overflow_rows) {
        fprintf(stderr, "rank %d: %s: GPU num_permuted %d overflow %d overflow_rows %d, host %d "
                "%d %d\n", rank, name, g->num_permuted, g->overflow, g->overflow_rows,
                h->num_permuted, h->overflow, h->overflow_rows);
        return 1;
    }
    for (int e = 0; e < El; e++)
        if (g->tpe[e] != h->tpe[e]) {
            fprintf(stderr, "rank %d: %s: tokens_per_expert[%d] GPU %lld host %lld\n", rank, name,
                    e, (long long)g->tpe[e], (long long)h->tpe[e]);
            return 1;
        }
    for (size_t j = 0; j < (size_t)g->num_permuted; j++) {
        const char *what = memcmp(g->tok + j * rb, h->tok + j * rb, rb) ? "row"
                           : memcmp(g->prob + j, h->prob + j, 4) ? "probability"
                           : in->fp8 && memcmp(g->scale + j * (size_t)ns, h->scale + j * (size_t)ns,
                                               4 * (size_t)ns) ? "FP8 scales" : NULL;
        if (what) {
            fprintf(stderr, "rank %d: %s: expert-major row %zu of %d differs first (%s; GPU "
                    "prob %g host %g)\n", rank, name, j, g->num_permuted, what, g->prob[j], h->prob[j]);
            return 1;
        }
    }
    return 0;
}

/* One combine of handle h with probabilities: expert outputs of `rows` rows (seed), probs_in
 * a value a row; *out [t, H] and *pout [t, E] back on the host. */
static int em_combine(hep_group *g, int gpu, const hep_config *c, const hep_handle *h, int t,
                      int rows, int budget, unsigned seed, unsigned flags, uint16_t *out, float *pout)
{
    const int H = c->hidden, E = c->experts_per_rank * world;
    const size_t B = (size_t)budget;
    uint16_t *x = calloc(B * (size_t)H + 8, 2);
    float *pin = calloc(B + 4, 4);
    void *dx, *dp, *dout, *dpo;
    hep_combine_args ca;
    hep_combine_opts co;
    int rc;
    for (int j = 0; j < rows; j++) {
        for (int q = 0; q < H; q++)
            x[(size_t)j * H + q] = expert_value(j, q, seed);
        pin[j] = (float)(rank * 1000 + j) / 7.0f + (float)seed;
    }
    if (gpu) {
        dx = dalloc(B * (size_t)H * 2), dp = dalloc(B * 4);
        dcopy(dx, x, B * (size_t)H * 2);
        dcopy(dp, pin, B * 4);
        dout = dpoisoned((size_t)t * H * 2 + 16), dpo = dpoisoned((size_t)t * E * 4 + 16);
    } else {
        dx = x, dp = pin, dout = out, dpo = pout;
        memset(out, 0xff, (size_t)t * H * 2), memset(pout, 0xff, (size_t)t * E * 4);
    }
    memset(&ca, 0, sizeof(ca));
    memset(&co, 0, sizeof(co));
    ca.expert_out = dx, ca.out = dout, ca.stream = gpu ? stream : NULL, ca.flags = flags;
    co.handle = h, co.probs_in = dp, co.probs_out = dpo;
    rc = hep_combine_ex(g, &ca, &co);
    CHECK(rc == HEP_OK, "%s expert-major combine: %s", gpu ? "GPU" : "host", hep_last_error());
    if (rc == HEP_OK && (flags & HEP_ASYNC)) {
        dsync();
        CHECK((rc = hep_group_sync(g, stream)) == HEP_OK, "hep_group_sync: %s", hep_last_error());
    }
    if (gpu) {
        if (rc == HEP_OK) {
            /* the caller may reuse its inputs once the call returned (staged: copied) */
            dcopy(out, dout, (size_t)t * H * 2);
            dcopy(pout, dpo, (size_t)t * E * 4);
        }
        dfree(dx), dfree(dp), dfree(dout), dfree(dpo);
    }
    free(x), free(pin);
    return rc;
}

static int combine_compare(const char *name, const hep_config *c, int t, const uint16_t *go,
                           const float *gp, const uint16_t *ho, const float *hp)
{
    const int H = c->hidden, E = c->experts_per_rank * world;
    for (int i = 0; i < t; i++) {
        for (int q = 0; q < H; q++)
            if (go[(size_t)i * H + q] != ho[(size_t)i * H + q]) {
                fprintf(stderr, "rank %d: %s: combined token %d channel %d: GPU 0x%04x host "
                        "0x%04x\n", rank, name, i, q, go[(size_t)i * H + q], ho[(size_t)i * H + q]);
                return 1;
            }
        if (memcmp(gp + (size_t)i * E, hp + (size_t)i * E, 4 * (size_t)E)) {
            fprintf(stderr, "rank %d: %s: probs_out of token %d differ\n", rank, name, i);
            return 1;
        }
    }
    return 0;
}

/* The tokens of `in` changed in their lowest bits (no NaN made), for a reused layout. */
static void perturb_tokens(inputs *in)
{
    const size_t rb = (size_t)in->H * (in->fp8 ? 1 : 2);
    for (size_t b = 0; b < rb * (size_t)in->t; b += in->fp8 ? 1 : 2) {
        unsigned char v = in->tokens[b] ^ 1u;
        if (!in->fp8 || (v & 0x7f) != 0x7f)
            in->tokens[b] = v;
    }
}

/* A case: dispatch A (ragged, the budget that never overflows), dispatch B (HEP_ASYNC, a
 * budget that drops rows), A's layout again (HEP_REUSE_LAYOUT, other tokens), then
 * combines with probabilities of B, of A, and of A once more (any order, more than once). */
static void case_permute(const char *name, int H, int T, int El, int K, int fp8, int index64,
                         int pad, const hep_bootstrap *bs)
{
    hep_config ch, cg;
    hep_group *gh = NULL, *gg = NULL;
    hep_handle *hh[2] = {NULL, NULL}, *hg[2] = {NULL, NULL};
    inputs in[2];
    em_out oh, og;
    int rc, bad = 0, total = 0, over = 0, overs = 0, dev = device_of_rank();
    const int full = (world * T * (K < El ? K : El) + El * (pad - 1) + pad - 1) / pad * pad;
    const int drop = ((world * T * (K < El ? K : El)) / (4 * world) + pad - 1) / pad * pad;
    const int budget[2] = {full, drop};
    double t0 = now_s();
    config(&ch, H, T, El, K, fp8, HEP_BACKEND_HOST, 0);
    config(&cg, H, T, El, K, fp8, gpu_backend(), 0);
    cg.max_permuted_rows = full;
    rc = hep_group_create(&ch, bs, dev, &gh);
    CHECK(rc == HEP_OK, "%s: host group: %s", name, hep_last_error());
    rc = rc ? rc : hep_group_create(&cg, bs, dev, &gg);
    CHECK(rc == HEP_OK, "%s: GPU group: %s", name, hep_last_error());
    for (int q = 0; rc == HEP_OK && q < 2; q++) {
        rc = hep_handle_create(gh, &hh[q]);
        rc = rc ? rc : hep_handle_create(gg, &hg[q]);
        CHECK(rc == HEP_OK, "hep_handle_create: %s", hep_last_error());
    }
    for (int q = 0; q < 2; q++)
        make_inputs(&in[q], &cg, K, index64, 1, 0, 7000u * (unsigned)H + (unsigned)(pad + q));
    for (int q = 0; rc == HEP_OK && q < 3; q++) { /* A, B, A reused */
        char step[300];
        const int x = q == 1;
        snprintf(step, sizeof(step), "%s, dispatch %s", name,
                 q == 0 ? "A" : q == 1 ? "B (HEP_ASYNC, rows dropped)" : "A again (HEP_REUSE_LAYOUT)");
        if (q == 2)
            perturb_tokens(&in[0]);
        em_dispatch(gh, 0, &ch, &in[x], x ? HEP_ASYNC : 0u, hh[x], q == 2, pad, budget[x], &oh);
        em_dispatch(gg, 1, &cg, &in[x], x ? HEP_ASYNC : 0u, hg[x], q == 2, pad, budget[x], &og);
        bad += em_compare(step, &cg, &in[x], &og, &oh);
        if (x)
            over = oh.overflow;
        if (og.rc || oh.rc)
            rc = HEP_ERR_INTERNAL;
        free_em(&og), free_em(&oh);
    }
    MPI_Allreduce(&over, &overs, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    CHECK(rc != HEP_OK || overs > 0, "%s: the budget of %d rows dropped rows on no rank: the "
          "case does not test the drop rule", name, drop);
    for (int q = 0; rc == HEP_OK && q < 3; q++) { /* combine B, A, A */
        const int x = q == 0 ? 1 : 0, t = in[x].t, E = El * world;
        const int rows = budget[x]; /* every row up to the budget (the rest is not read) */
        uint16_t *go = malloc((size_t)t * H * 2 + 16), *ho = malloc((size_t)t * H * 2 + 16);
        float *gp = malloc((size_t)t * E * 4 + 16), *hp = malloc((size_t)t * E * 4 + 16);
        char step[300];
        snprintf(step, sizeof(step), "%s, combine %s", name,
                 q == 0 ? "B (HEP_ASYNC)" : q == 1 ? "A" : "A a second time");
        rc = em_combine(gh, 0, &ch, hh[x], t, rows, budget[x], 50u + (unsigned)q, x ? HEP_ASYNC : 0u, ho, hp);
        rc = rc ? rc : em_combine(gg, 1, &cg, hg[x], t, rows, budget[x], 50u + (unsigned)q,
                                  x ? HEP_ASYNC : 0u, go, gp);
        if (rc == HEP_OK)
            bad += combine_compare(step, &cg, t, go, gp, ho, hp);
        free(go), free(ho), free(gp), free(hp);
    }
    for (int q = 0; q < 2; q++) {
        hep_handle_destroy(hh[q]), hep_handle_destroy(hg[q]);
        free_inputs(&in[q]);
    }
    total = end_case(gg, gh, bad, name);
    if (rank == 0)
        printf("%s: %s (budgets %d and %d rows, %.1f s)\n", total || rc ? "FAILED" : "ok", name,
               full, drop, now_s() - t0);
    fflush(stdout);
}

/* Across processes without config.max_permuted_rows the expert-major layout is refused
 * naming that field, and a budget above it is refused too (both before any collective
 * step, on every rank alike). The GPU only: the host backend has no such limit. */
static void permute_refusals(const hep_bootstrap *bs)
{
    hep_config c;
    hep_group *g = NULL;
    hep_handle *h = NULL;
    inputs in;
    em_out o;
    int rc;
    config(&c, 512, 16, 2, 2, 0, HEP_BACKEND_GPU, 0);
    for (int pass = 0; pass < 2; pass++) {
        c.max_permuted_rows = pass ? 64 : 0;
        rc = hep_group_create(&c, bs, device_of_rank(), &g);
        CHECK(rc == HEP_OK, "refusal group: %s", hep_last_error());
        if (rc)
            return;
        CHECK(hep_handle_create(g, &h) == HEP_OK, "hep_handle_create: %s", hep_last_error());
        make_inputs(&in, &c, 2, 0, 0, 1, 99u);
        refusal_expected = 1;
        em_dispatch(g, 1, &c, &in, 0, h, 0, 1, pass ? 65 : 64, &o);
        refusal_expected = 0;
        CHECK(o.rc == (pass ? HEP_ERR_INVALID : HEP_ERR_UNAVAILABLE) &&
                  strstr(hep_last_error(), pass ? "exceeds config.max_permuted_rows = 64"
                                                : "config.max_permuted_rows"),
              "expected the refusal naming config.max_permuted_rows, got %d: %s", o.rc,
              hep_last_error());
        if (rank == 0)
            printf("ok: refused %s: %s\n", pass ? "a budget above max_permuted_rows"
                                               : "without max_permuted_rows", hep_last_error());
        free_em(&o), free_inputs(&in);
        hep_handle_destroy(h);
        CHECK(hep_group_destroy(g) == HEP_OK, "destroy: %s", hep_last_error());
    }
}

static int mode_permute(const hep_bootstrap *bs)
{
    char name[256];
    if (!host_only)
        permute_refusals(bs);
    snprintf(name, sizeof(name), "%d processes, expert-major, BF16, int32 ids, pad 1", world);
    case_permute(name, 512, 64, 4, 4, 0, 0, 1, bs);
    snprintf(name, sizeof(name), "%d processes, expert-major, BF16, int64 ids, pad 128", world);
    case_permute(name, 512, 64, 4, 4, 0, 1, 128, bs);
    snprintf(name, sizeof(name), "%d processes, expert-major, FP8, int64 ids, pad 128, K 6", world);
    case_permute(name, 1024, 96, 3, 6, 1, 1, 128, bs);
    snprintf(name, sizeof(name), "%d processes, expert-major, FP8, int32 ids, pad 1", world);
    case_permute(name, 1024, 64, 4, 4, 1, 0, 1, bs);
    return failures;
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "correct";
    hep_bootstrap bs;
    int n = 0, rc, total = 0, skip = 0;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    host_only = getenv("HEP_MPI_HOST_ONLY") && strcmp(getenv("HEP_MPI_HOST_ONLY"), "1") == 0;
    if (host_only)
        skip = 0;
    else if (!hep_has_gpu_backend())
        skip = 1;
    else if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0)
        skip = 2;
    if (skip) {
        if (rank == 0)
            printf("skipped: %s\n", skip == 1 ? "this libhybridep has no GPU kernels"
                                              : "no CUDA device");
        MPI_Finalize();
        return 77;
    }
    if (!host_only) {
        cuda_ok(cudaSetDevice(device_of_rank()), "cudaSetDevice");
        cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    }
    rc = hep_bootstrap_mpi_create(MPI_COMM_WORLD, &bs);
    if (rc) {
        fprintf(stderr, "rank %d: MPI bootstrap: %s\n", rank, hep_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (rank == 0)
        printf("test_gpu_mpi %s: %d processes, libhybridep %s%s\n", mode, world, hep_version(),
               host_only ? " (HEP_MPI_HOST_ONLY: the host backend in place of the GPU)" : "");
    if (strcmp(mode, "correct") == 0)
        mode_correct(&bs);
    else if (strcmp(mode, "bench") == 0)
        mode_bench(&bs);
    else if (strcmp(mode, "missing") == 0)
        mode_missing(&bs);
    else if (strcmp(mode, "nodes") == 0)
        mode_nodes(&bs);
    else if (strcmp(mode, "permute") == 0)
        mode_permute(&bs);
    else {
        if (rank == 0)
            fprintf(stderr, "usage: test_gpu_mpi correct|bench|missing|nodes|permute\n");
        failures = 1;
    }
    hep_bootstrap_mpi_destroy(&bs);
    if (!host_only)
        cudaStreamDestroy(stream);
    MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
        printf("test_gpu_mpi %s: %s\n", mode, total ? "FAILED" : "all passed");
    MPI_Finalize();
    return total ? 1 : 0;
}
