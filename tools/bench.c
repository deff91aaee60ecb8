/* tools/bench.c: `hybridep bench` - verify against the host backend, then time dispatch
 * and combine against the same run's memory ceiling. Virtual ranks are threads of this
 * process, spread over --gpus devices (one GPU: all on device 0). */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "cli.h"
#include "core/core.h"
#include "group/group.h"
#include "kernels/ep_kernels.h"
#include "net/proxy.h"
#include "json.h"

typedef struct bench_opts {
    int R, nodes, H, T, El, K, sms, iters, warmup, gpus, skew, as_json, host;
    hep_dtype dtype;
    unsigned seed;
    const char *dump, *json_file;
} bench_opts;

typedef struct ceilings {
    double copy, write, read; /* GB/s: D2D copy (read + write), memset (write), read kernel */
} ceilings;

typedef struct rank_data {
    int t;
    unsigned char *tokens; /* host [t, H * esize] */
    float *scales;         /* [t, H/128] */
    int *idx;              /* [t, K] */
    float *w;              /* [t, K] */
    /* GPU results kept for the verification */
    int num_recv, *tpe;
    unsigned char *r_tokens;
    float *r_probs, *r_scales;
    uint16_t *r_comb;
    /* timings, per iteration (ms) */
    float *t_disp, *t_comb;               /* own launch -> own end */
    float *s_disp, *e_disp, *s_comb, *e_comb; /* start / end after rank 0's reference event */
    double *s_pre, *e_pre; /* in-kernel %globaltimer (ms): dispatch start, layout ready */
    hep_proxy_peer_stats net[2]; /* N > 1: what the proxy posted in the timed iterations,
                                    dispatch and combine, summed over the peers */
    int rc;
    char err[1024];
} rank_data;

typedef struct bench {
    bench_opts o;
    hep_config cfg;
    int W, esize, ns;
    rank_data *rd;
    hep_inproc_world *world;
    int verify_bad;
    double ceiling_gbs; /* device (or host) copy, read + write */
    char nic[32];       /* N > 1: the NIC the proxy drove (rank 0's) */
    ceilings ceil;      /* device: copy, write-only, read-only */
    void *ref_event;    /* rank 0's reference event of the current iteration */
} bench;

static unsigned lcg(unsigned *s)
{
    *s = *s * 1664525u + 1013904223u;
    return *s >> 8;
}

static uint16_t bf16_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Top-k routing: K distinct experts per token, uniform or skewed towards the first ranks. */
static void make_routing(bench *b)
{
    const int E = b->o.El * b->W, K = b->o.K, H = b->o.H;
    unsigned s = b->o.seed;
    for (int r = 0; r < b->W; r++) {
        rank_data *d = &b->rd[r];
        size_t rb = (size_t)H * (size_t)b->esize;
        d->t = b->o.T;
        d->tokens = malloc(rb * (size_t)d->t + 16);
        for (size_t k = 0; k < rb * (size_t)d->t / 2; k++)
            ((uint16_t *)d->tokens)[k] =
                b->esize == 2 ? bf16_of((float)(lcg(&s) % 2000) / 64.0f - 15.0f) : (uint16_t)lcg(&s);
        d->scales = malloc(sizeof(float) * (size_t)(b->ns + 1) * (size_t)d->t);
        for (int k = 0; k < b->ns * d->t; k++)
            d->scales[k] = (float)(lcg(&s) % 4096) / 1024.0f;
        d->idx = malloc(sizeof(int) * (size_t)K * (size_t)d->t);
        d->w = malloc(sizeof(float) * (size_t)K * (size_t)d->t);
        for (int i = 0; i < d->t; i++) {
            float sum = 0;
            for (int k = 0; k < K; k++) {
                int e, dup;
                do {
                    unsigned u = lcg(&s);
                    e = b->o.skew && u % 4 != 0 ? (int)(u % (unsigned)(E / 4 > 0 ? E / 4 : 1))
                                                : (int)(u % (unsigned)E);
                    dup = 0;
                    for (int q = 0; q < k; q++)
                        dup |= d->idx[(size_t)i * K + q] == e;
                } while (dup);
                d->idx[(size_t)i * K + k] = e;
                d->w[(size_t)i * K + k] = (float)(1 + lcg(&s) % 1000);
                sum += d->w[(size_t)i * K + k];
            }
            for (int k = 0; k < K; k++)
                d->w[(size_t)i * K + k] /= sum;
        }
    }
}

static void dump_routing(const bench *b)
{
    FILE *f = fopen(b->o.dump, "wb");
    int hdr[6] = {b->W, b->o.T, b->o.H, b->o.El, b->o.K, b->esize};
    if (!f) {
        fprintf(stderr, "hybridep bench: cannot write %s\n", b->o.dump);
        return;
    }
    fwrite(hdr, sizeof(hdr), 1, f);
    for (int r = 0; r < b->W; r++) {
        fwrite(&b->rd[r].t, sizeof(int), 1, f);
        fwrite(b->rd[r].idx, sizeof(int), (size_t)b->rd[r].t * (size_t)b->o.K, f);
        fwrite(b->rd[r].w, sizeof(float), (size_t)b->rd[r].t * (size_t)b->o.K, f);
    }
    fclose(f);
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

#define CKB(x)                                                                                   \
    do {                                                                                         \
        cudaError_t e_ = (x);                                                                    \
        if (e_ != cudaSuccess) {                                                                 \
            snprintf(d->err, sizeof(d->err), "%s: %s", #x, cudaGetErrorString(e_));             \
            d->rc = HEP_ERR_CUDA;                                                                \
            goto out;                                                                            \
        }                                                                                        \
    } while (0)

#define HCK(x)                                                                                   \
    do {                                                                                         \
        int r_ = (x);                                                                            \
        if (r_) {                                                                                \
            snprintf(d->err, sizeof(d->err), "%s", hep_last_error());                            \
            d->rc = r_;                                                                          \
            goto out;                                                                            \
        }                                                                                        \
    } while (0)

typedef struct thread_arg {
    bench *b;
    int rank, host_pass;
} thread_arg;

/* The host-backend pass: same inputs, results compared with what the GPU gave. */
static void *host_rank(void *p)
{
    thread_arg *ta = p;
    bench *b = ta->b;
    rank_data *d = &b->rd[ta->rank];
    hep_bootstrap bs;
    hep_config c = b->cfg;
    hep_group *g = NULL;
    hep_dispatch_args da;
    hep_dispatch_result dr;
    hep_combine_args ca;
    size_t rb = (size_t)b->o.H * (size_t)b->esize;
    uint16_t *comb = NULL;
    int bad = 0;
    c.backend = HEP_BACKEND_HOST;
    hep_inproc_bootstrap(b->world, ta->rank, &bs);
    HCK(hep_group_create(&c, &bs, 0, &g));
    memset(&da, 0, sizeof(da));
    da.num_tokens = d->t;
    da.tokens = d->tokens;
    da.scales = b->esize == 1 ? d->scales : NULL;
    da.topk_idx = d->idx;
    da.topk = b->o.K;
    da.topk_weights = d->w;
    HCK(hep_dispatch(g, &da, &dr));
    if (b->o.host) {
        d->num_recv = dr.num_recv;
    } else {
        bad += dr.num_recv != d->num_recv;
        bad += memcmp(dr.host_counts + 1, d->tpe, sizeof(int) * (size_t)b->o.El) != 0;
        if (!bad) {
            bad += memcmp(dr.tokens, d->r_tokens, rb * (size_t)d->num_recv) != 0;
            bad += memcmp(dr.probs, d->r_probs, sizeof(float) * (size_t)b->o.El * (size_t)d->num_recv) != 0;
            if (b->esize == 1)
                bad += memcmp(dr.scales, d->r_scales, sizeof(float) * (size_t)b->ns * (size_t)d->num_recv) != 0;
        }
    }
    /* expert outputs: a function of (rank, row, channel), as the GPU pass wrote */
    for (int j = 0; j < dr.num_recv; j++)
        for (int h = 0; h < b->o.H; h++)
            ((uint16_t *)hep_combine_input(g))[(size_t)j * (size_t)b->o.H + (size_t)h] =
                bf16_of((float)((ta->rank + 1) * 8 + j % 13) + 0.25f * (float)(h % 5));
    comb = malloc((size_t)b->o.H * 2 * (size_t)d->t + 16);
    memset(&ca, 0, sizeof(ca));
    ca.handle = dr.handle;
    ca.expert_out = hep_combine_input(g);
    ca.out = comb;
    HCK(hep_combine(g, &ca));
    if (!b->o.host)
        bad += memcmp(comb, d->r_comb, (size_t)b->o.H * 2 * (size_t)d->t) != 0;
    if (bad) {
        __atomic_add_fetch(&b->verify_bad, 1, __ATOMIC_RELAXED);
        snprintf(d->err, sizeof(d->err), "rank %d: GPU output differs from the host backend",
                 ta->rank);
    }
out:
    if (d->rc)
        fprintf(stderr, "hybridep bench: host backend, rank %d: %s\n", ta->rank, d->err);
    free(comb);
    hep_group_destroy(g);
    return NULL;
}

/* The proxy's counters, summed over the peers (zero with one node). */
static hep_proxy_peer_stats net_now(hep_group *g)
{
    hep_proxy_peer_stats t, x;
    memset(&t, 0, sizeof(t));
    for (int p = 0; g->proxy && p < g->world; p++) {
        hep_proxy_stats(g->proxy, p, &x);
        t.bytes += x.bytes;
        t.data_wrs += x.data_wrs;
        t.flag_wrs += x.flag_wrs;
        t.flags_done += x.flags_done;
        t.ready_to_flag_ns += x.ready_to_flag_ns;
    }
    return t;
}

/* Per rank and call in the timed iterations, for phase 0 (dispatch) or 1 (combine): bytes
 * sent, work requests, mean ready-to-flag latency (us). */
static void net_per_call(const bench *b, int phase, double *bytes, double *wrs, double *lat_us)
{
    double lat = 0, nflags = 0;
    *bytes = *wrs = 0;
    for (int r = 0; r < b->W; r++) {
        const hep_proxy_peer_stats *n = &b->rd[r].net[phase];
        *bytes += (double)n->bytes;
        *wrs += (double)(n->data_wrs + n->flag_wrs);
        lat += (double)n->ready_to_flag_ns;
        nflags += (double)n->flags_done;
    }
    *bytes /= (double)b->W * b->o.iters;
    *wrs /= (double)b->W * b->o.iters;
    *lat_us = nflags ? lat / nflags / 1e3 : NAN;
}

/* acc += now - before */
static void net_add(hep_proxy_peer_stats *acc, const hep_proxy_peer_stats *before,
                    const hep_proxy_peer_stats *now)
{
    acc->bytes += now->bytes - before->bytes;
    acc->data_wrs += now->data_wrs - before->data_wrs;
    acc->flag_wrs += now->flag_wrs - before->flag_wrs;
    acc->flags_done += now->flags_done - before->flags_done;
    acc->ready_to_flag_ns += now->ready_to_flag_ns - before->ready_to_flag_ns;
}

static void *gpu_rank(void *p)
{
    thread_arg *ta = p;
    bench *b = ta->b;
    rank_data *d = &b->rd[ta->rank];
    const int H = b->o.H, El = b->o.El, it_total = b->o.warmup + b->o.iters;
    const size_t rb = (size_t)H * (size_t)b->esize;
    int dev = b->o.gpus > 1 ? ta->rank * b->o.gpus / b->W : 0;
    hep_bootstrap bs;
    hep_group *g = NULL;
    cudaStream_t st = NULL;
    cudaEvent_t ev[7] = {0};
    void *d_tok = NULL, *d_idx = NULL, *d_out = NULL;
    float *d_sc = NULL, *d_w = NULL;
    hep_dispatch_args da;
    hep_dispatch_result dr;
    hep_combine_args ca;

    hep_inproc_bootstrap(b->world, ta->rank, &bs);
    CKB(cudaSetDevice(dev));
    HCK(hep_group_create(&b->cfg, &bs, dev, &g));
    if (ta->rank == 0 && g->coord)
        snprintf(b->nic, sizeof(b->nic), "%s", g->coord->net->v->name);
    CKB(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (int k = 0; k < 7; k++)
        CKB(cudaEventCreate(&ev[k]));
    CKB(cudaMalloc(&d_tok, rb * (size_t)d->t + 16));
    CKB(cudaMalloc((void **)&d_sc, sizeof(float) * (size_t)(b->ns + 1) * (size_t)d->t));
    CKB(cudaMalloc(&d_idx, sizeof(int) * (size_t)b->o.K * (size_t)d->t));
    CKB(cudaMalloc((void **)&d_w, sizeof(float) * (size_t)b->o.K * (size_t)d->t));
    CKB(cudaMalloc(&d_out, (size_t)H * 2 * (size_t)d->t + 16));
    CKB(cudaMemcpy(d_tok, d->tokens, rb * (size_t)d->t, cudaMemcpyHostToDevice));
    if (b->esize == 1)
        CKB(cudaMemcpy(d_sc, d->scales, sizeof(float) * (size_t)b->ns * (size_t)d->t, cudaMemcpyHostToDevice));
    CKB(cudaMemcpy(d_idx, d->idx, sizeof(int) * (size_t)b->o.K * (size_t)d->t, cudaMemcpyHostToDevice));
    CKB(cudaMemcpy(d_w, d->w, sizeof(float) * (size_t)b->o.K * (size_t)d->t, cudaMemcpyHostToDevice));
    memset(&da, 0, sizeof(da));
    da.num_tokens = d->t;
    da.tokens = d_tok;
    da.scales = b->esize == 1 ? d_sc : NULL;
    da.topk_idx = d_idx;
    da.topk = b->o.K;
    da.topk_weights = d_w;
    da.stream = st;

    /* 1. one synchronous call, results kept for the verification */
    CKB(cudaMemsetAsync(hep_combine_input(g), 0xff, g->plan.buf[HEP_BUF_TOKEN_X].bytes, st));
    CKB(cudaMemsetAsync(d_out, 0xff, (size_t)H * 2 * (size_t)d->t, st)); /* poison */
    CKB(cudaStreamSynchronize(st));
    bs.barrier(bs.ctx);
    HCK(hep_dispatch(g, &da, &dr));
    d->num_recv = dr.num_recv;
    d->tpe = malloc(sizeof(int) * (size_t)El);
    memcpy(d->tpe, dr.host_counts + 1, sizeof(int) * (size_t)El);
    d->r_tokens = malloc(rb * (size_t)d->num_recv + 1);
    d->r_probs = malloc(sizeof(float) * (size_t)El * (size_t)d->num_recv + 1);
    CKB(cudaMemcpy(d->r_tokens, dr.tokens, rb * (size_t)d->num_recv, cudaMemcpyDeviceToHost));
    CKB(cudaMemcpy(d->r_probs, dr.probs, sizeof(float) * (size_t)El * (size_t)d->num_recv, cudaMemcpyDeviceToHost));
    if (b->esize == 1) {
        d->r_scales = malloc(sizeof(float) * (size_t)b->ns * (size_t)d->num_recv + 1);
        CKB(cudaMemcpy(d->r_scales, dr.scales, sizeof(float) * (size_t)b->ns * (size_t)d->num_recv,
                       cudaMemcpyDeviceToHost));
    }
    {
        uint16_t *h = malloc((size_t)H * 2 * (size_t)d->num_recv + 16);
        for (int j = 0; j < d->num_recv; j++)
            for (int c = 0; c < H; c++)
                h[(size_t)j * H + c] = bf16_of((float)((ta->rank + 1) * 8 + j % 13) + 0.25f * (float)(c % 5));
        CKB(cudaMemcpyAsync(hep_combine_input(g), h, (size_t)H * 2 * (size_t)d->num_recv,
                            cudaMemcpyHostToDevice, st));
        CKB(cudaStreamSynchronize(st));
        free(h);
    }
    bs.barrier(bs.ctx);
    memset(&ca, 0, sizeof(ca));
    ca.handle = dr.handle;
    ca.expert_out = hep_combine_input(g);
    ca.out = d_out;
    ca.stream = st;
    HCK(hep_combine(g, &ca));
    d->r_comb = malloc((size_t)H * 2 * (size_t)d->t + 16);
    CKB(cudaMemcpy(d->r_comb, d_out, (size_t)H * 2 * (size_t)d->t, cudaMemcpyDeviceToHost));

    /* 2. timed iterations: dispatch then combine, each bracketed by events */
    d->t_disp = calloc((size_t)it_total, sizeof(float));
    d->t_comb = calloc((size_t)it_total, sizeof(float));
    d->s_disp = calloc((size_t)it_total, sizeof(float));
    d->s_pre = calloc((size_t)it_total, sizeof(double));
    d->e_pre = calloc((size_t)it_total, sizeof(double));
    d->e_disp = calloc((size_t)it_total, sizeof(float));
    d->s_comb = calloc((size_t)it_total, sizeof(float));
    d->e_comb = calloc((size_t)it_total, sizeof(float));
    da.flags = HEP_ASYNC;
    ca.flags = HEP_ASYNC;
    for (int it = 0; it < it_total; it++) {
        /* rank 0's reference, recorded on an idle stream before anyone launches */
        if (ta->rank == 0) {
            CKB(cudaEventRecord(ev[6], st));
            CKB(cudaEventSynchronize(ev[6]));
            b->ref_event = ev[6];
        }
        bs.barrier(bs.ctx);
        hep_proxy_peer_stats n0 = net_now(g), n1, n2;
        CKB(cudaEventRecord(ev[0], st));
        HCK(hep_dispatch(g, &da, &dr));
        CKB(cudaEventRecord(ev[1], st));
        CKB(cudaStreamSynchronize(st));
        HCK(hep_group_sync(g, st));
        n1 = net_now(g);
        bs.barrier(bs.ctx);
        ca.handle = dr.handle;
        CKB(cudaEventRecord(ev[2], st));
        HCK(hep_combine(g, &ca));
        CKB(cudaEventRecord(ev[3], st));
        CKB(cudaStreamSynchronize(st));
        HCK(hep_group_sync(g, st));
        n2 = net_now(g);
        if (it >= b->o.warmup) {
            net_add(&d->net[0], &n0, &n1);
            net_add(&d->net[1], &n1, &n2);
        }
        CKB(cudaEventElapsedTime(&d->t_disp[it], ev[0], ev[1]));
        CKB(cudaEventElapsedTime(&d->t_comb[it], ev[2], ev[3]));
        CKB(cudaEventElapsedTime(&d->s_disp[it], (cudaEvent_t)b->ref_event, ev[0]));
        {
            const hep_diag *dg =
                (const hep_diag *)(g->arena[HEP_ARENA_MAPPED] + g->plan.buf[HEP_BUF_DIAG].offset);
            d->s_pre[it] = (double)dg->t_start / 1e6;
            d->e_pre[it] = (double)dg->t_layout / 1e6;
        }
        CKB(cudaEventElapsedTime(&d->e_disp[it], (cudaEvent_t)b->ref_event, ev[1]));
        CKB(cudaEventElapsedTime(&d->s_comb[it], (cudaEvent_t)b->ref_event, ev[2]));
        CKB(cudaEventElapsedTime(&d->e_comb[it], (cudaEvent_t)b->ref_event, ev[3]));
        bs.barrier(bs.ctx); /* the reference event stays alive until all have read it */
    }
out:
    if (d->rc)
        fprintf(stderr, "hybridep bench: rank %d: %s\n", ta->rank, d->err);
    cudaFree(d_tok), cudaFree(d_sc), cudaFree(d_idx), cudaFree(d_w), cudaFree(d_out);
    for (int k = 0; k < 7; k++)
        if (ev[k])
            cudaEventDestroy(ev[k]);
    if (st)
        cudaStreamDestroy(st);
    hep_group_destroy(g);
    return NULL;
}

static int run_threads(bench *b, void *(*fn)(void *))
{
    pthread_t th[HEP_MAX_LOCAL];
    thread_arg ta[HEP_MAX_LOCAL];
    if (hep_inproc_world_create(b->W, &b->world))
        return 1;
    for (int r = 0; r < b->W; r++) {
        ta[r].b = b;
        ta[r].rank = r;
        pthread_create(&th[r], NULL, fn, &ta[r]);
    }
    for (int r = 0; r < b->W; r++)
        pthread_join(th[r], NULL);
    hep_inproc_world_destroy(b->world);
    b->world = NULL;
    for (int r = 0; r < b->W; r++)
        if (b->rd[r].rc)
            return 1;
    return 0;
}

static int cmp_f(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* Per iteration, a phase lasts from the moment its last rank launched until its last rank
 * finished (launch skew of the host threads excluded: it is reported on its own); the
 * median over iterations. which: 0 dispatch (its layout step included), 1 combine,
 * 2 the layout step inside dispatch (in-kernel timer: last rank's kernel start to last
 * rank's layout), 3 launch skew of dispatch (last start - first start). */
static double phase_ms(const bench *b, int which)
{
    float *per = malloc(sizeof(float) * (size_t)b->o.iters), m;
    for (int it = 0; it < b->o.iters; it++) {
        int k = b->o.warmup + it;
        double first = 1e300, last = -1e300, end = -1e300;
        for (int r = 0; r < b->W; r++) {
            const rank_data *d = &b->rd[r];
            double s = which == 1 ? d->s_comb[k] : which == 2 ? d->s_pre[k] : d->s_disp[k];
            double e = which == 1 ? d->e_comb[k] : which == 2 ? d->e_pre[k] : d->e_disp[k];
            first = s < first ? s : first;
            last = s > last ? s : last;
            end = e > end ? e : end;
        }
        per[it] = (float)(which == 3 ? last - first : end - last);
    }
    qsort(per, (size_t)b->o.iters, sizeof(float), cmp_f);
    m = per[b->o.iters / 2];
    free(per);
    return m;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median of 11 timed runs of one of three operations over 2 GiB. */
static double time_op(int op, void *a, void *c, size_t bytes, unsigned *sink, int sms)
{
    cudaEvent_t e0, e1;
    double t[11];
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int k = -1; k < 11; k++) { /* k = -1: warm-up */
        float ms = 0;
        cudaEventRecord(e0, 0);
        if (op == 0)
            cudaMemcpyAsync(c, a, bytes, cudaMemcpyDeviceToDevice, 0);
        else if (op == 1)
            cudaMemsetAsync(c, k & 0xff, bytes, 0);
        else
            hep_launch_read_ceiling(a, bytes, sink, sms * 4, 0);
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        cudaEventElapsedTime(&ms, e0, e1);
        if (k >= 0)
            t[k] = ms;
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    qsort(t, 11, sizeof(double), cmp_d);
    return t[5];
}

static ceilings device_ceilings(int dev)
{
    size_t bytes = (size_t)2 << 30;
    void *a = NULL, *c = NULL;
    unsigned *sink = NULL;
    int sms = 0;
    ceilings r = {NAN, NAN, NAN};
    cudaSetDevice(dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&c, bytes) != cudaSuccess ||
        cudaMalloc((void **)&sink, 4) != cudaSuccess) {
        cudaFree(a), cudaFree(c);
        (void)cudaGetLastError();
        return r;
    }
    cudaMemset(a, 1, bytes);
    r.copy = 2.0 * (double)bytes / (time_op(0, a, c, bytes, sink, sms) * 1e-3) / 1e9;
    r.write = (double)bytes / (time_op(1, a, c, bytes, sink, sms) * 1e-3) / 1e9;
    r.read = (double)bytes / (time_op(2, a, c, bytes, sink, sms) * 1e-3) / 1e9;
    cudaFree(a), cudaFree(c), cudaFree(sink);
    return r;
}

static double host_copy_ceiling(void)
{
    size_t bytes = (size_t)256 << 20;
    char *a = malloc(bytes), *c = malloc(bytes);
    double t[5];
    memset(a, 1, bytes);
    memset(c, 0, bytes);
    for (int k = 0; k < 5; k++) {
        double t0 = now_ms();
        memcpy(c, a, bytes);
        t[k] = now_ms() - t0;
    }
    for (int i = 0; i < 5; i++)
        for (int j = i + 1; j < 5; j++)
            if (t[j] < t[i]) {
                double x = t[i];
                t[i] = t[j];
                t[j] = x;
            }
    free(a);
    free(c);
    return 2.0 * (double)bytes / (t[2] * 1e-3) / 1e9;
}

static int parse(int argc, char **argv, bench_opts *o)
{
    int rc = 0;
    const char *dt = "bf16", *backend = NULL, *routing = "uniform";
    memset(o, 0, sizeof(*o));
    o->R = 8, o->nodes = 1, o->H = 7168, o->T = 4096, o->El = 32, o->K = 8, o->sms = 16;
    o->iters = 20, o->warmup = 5, o->gpus = 1, o->seed = (unsigned)time(NULL);
    for (int i = 0; i < argc && rc == 0; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int seed = 0;
        if (!strcmp(a, "--json"))
            o->as_json = 1;
        else if (!strcmp(a, "--ranks-per-node") && ++i)
            rc = cli_parse_int("bench", a, v, &o->R);
        else if (!strcmp(a, "--nodes") && ++i)
            rc = cli_parse_int("bench", a, v, &o->nodes);
        else if (!strcmp(a, "--hidden") && ++i)
            rc = cli_parse_int("bench", a, v, &o->H);
        else if (!strcmp(a, "--tokens") && ++i)
            rc = cli_parse_int("bench", a, v, &o->T);
        else if (!strcmp(a, "--experts-per-rank") && ++i)
            rc = cli_parse_int("bench", a, v, &o->El);
        else if (!strcmp(a, "--topk") && ++i)
            rc = cli_parse_int("bench", a, v, &o->K);
        else if (!strcmp(a, "--sms") && ++i)
            rc = cli_parse_int("bench", a, v, &o->sms);
        else if (!strcmp(a, "--iters") && ++i)
            rc = cli_parse_int("bench", a, v, &o->iters);
        else if (!strcmp(a, "--warmup") && ++i)
            rc = cli_parse_int("bench", a, v, &o->warmup);
        else if (!strcmp(a, "--gpus") && ++i)
            rc = cli_parse_int("bench", a, v, &o->gpus);
        else if (!strcmp(a, "--seed") && ++i) {
            rc = cli_parse_int("bench", a, v, &seed);
            o->seed = (unsigned)seed;
        } else if (!strcmp(a, "--dtype") && ++i)
            dt = v;
        else if (!strcmp(a, "--backend") && ++i)
            backend = v;
        else if (!strcmp(a, "--routing") && ++i)
            routing = v;
        else if (!strcmp(a, "--dump-routing") && ++i)
            o->dump = v;
        else if (!strcmp(a, "--json-file") && ++i)
            o->json_file = v;
        else
            return cli_usage_error("bench", a);
    }
    if (rc)
        return rc;
    if ((rc = cli_parse_dtype("bench", dt, &o->dtype)))
        return rc;
    o->skew = routing && !strcmp(routing, "skewed");
    if (routing && strcmp(routing, "uniform") && !o->skew) {
        fprintf(stderr, "hybridep bench: --routing must be uniform or skewed\n");
        return 2;
    }
    if (backend && strcmp(backend, "gpu") && strcmp(backend, "host")) {
        fprintf(stderr, "hybridep bench: --backend must be gpu or host\n");
        return 2;
    }
    if (o->iters < 1 || o->warmup < 0 || o->gpus < 1) {
        fprintf(stderr, "hybridep bench: --iters >= 1, --warmup >= 0, --gpus >= 1\n");
        return 2;
    }
    if (backend)
        o->host = !strcmp(backend, "host");
    else {
        int n = 0;
        o->host = cudaGetDeviceCount(&n) != cudaSuccess || n == 0;
        (void)cudaGetLastError();
    }
    if (o->nodes < 1) {
        fprintf(stderr, "hybridep bench: --nodes must be >= 1\n");
        return 2;
    }
    return 0;
}

typedef struct phase_row {
    const char *name;
    double rows, bytes, ms, algbw_rank;
    double rbytes, wbytes; /* the fewest bytes, read and written */
} phase_row;

/* The floor a phase's mix of reads and writes allows on this device: the largest of its
 * reads at the read ceiling, its writes at the write ceiling, both at the copy ceiling. */
static double floor_ms(const bench *b, const phase_row *p)
{
    double r = p->rbytes / (b->ceil.read * 1e9), w = p->wbytes / (b->ceil.write * 1e9);
    double c = (p->rbytes + p->wbytes) / (b->ceil.copy * 1e9);
    double m = r > w ? r : w;
    return (m > c ? m : c) * 1e3;
}

static void report(const bench *b, const phase_row *ph, int n, const char *gpu_name, int sm_count,
                   double host_dispatch_ms, double host_combine_ms)
{
    const bench_opts *o = &b->o;
    FILE *jf = o->as_json ? stdout : o->json_file ? fopen(o->json_file, "w") : NULL;
    if (jf) {
        hep_json j;
        json_begin(&j, jf);
        json_obj(&j, NULL);
        json_str(&j, "backend", o->host ? "host" : "gpu");
        json_str(&j, "device", gpu_name);
        json_int(&j, "ranks", b->W);
        json_int(&j, "gpus", o->host ? 0 : o->gpus);
        json_int(&j, "hidden", o->H);
        json_int(&j, "tokens", o->T);
        json_int(&j, "experts_per_rank", o->El);
        json_int(&j, "topk", o->K);
        json_str(&j, "dtype", b->esize == 1 ? "fp8" : "bf16");
        json_str(&j, "routing", o->skew ? "skewed" : "uniform");
        json_int(&j, "sms_per_rank", o->sms);
        json_int(&j, "iters", o->iters);
        json_bool(&j, "verified", !o->host && b->verify_bad == 0);
        json_num(&j, "ceiling_gbs", b->ceiling_gbs);
        json_num(&j, "write_ceiling_gbs", b->ceil.write);
        json_num(&j, "read_ceiling_gbs", b->ceil.read);
        json_int(&j, "nodes", o->nodes);
        json_arr(&j, "phases");
        for (int i = 0; i < n; i++) {
            json_obj(&j, NULL);
            json_str(&j, "phase", ph[i].name);
            json_num(&j, "rows", ph[i].rows);
            json_num(&j, "fewest_bytes", ph[i].bytes);
            json_num(&j, "median_ms", ph[i].ms);
            json_num(&j, "gbs", ph[i].bytes ? ph[i].bytes / (ph[i].ms * 1e-3) / 1e9 : NAN);
            json_num(&j, "fraction_of_ceiling",
                     ph[i].bytes ? ph[i].bytes / (ph[i].ms * 1e-3) / 1e9 / b->ceiling_gbs : NAN);
            json_num(&j, "algbw_per_rank_gbs", ph[i].algbw_rank);
            json_num(&j, "read_bytes", ph[i].rbytes);
            json_num(&j, "write_bytes", ph[i].wbytes);
            json_num(&j, "mix_floor_ms", ph[i].bytes ? floor_ms(b, &ph[i]) : NAN);
            if (!o->host && o->nodes > 1 && i >= 1 && i <= 2) {
                double bytes, wrs, lat;
                net_per_call(b, i - 1, &bytes, &wrs, &lat);
                json_num(&j, "network_bytes_per_rank", bytes);
                json_num(&j, "network_writes_per_rank", wrs);
                json_num(&j, "ready_to_flag_us", lat);
            }
            json_end_obj(&j);
        }
        json_end_arr(&j);
        json_end_obj(&j);
        json_finish(&j);
        if (jf != stdout)
            fclose(jf);
        if (o->as_json)
            return;
    }
    if (o->host) {
        printf("\nhybridep bench: HOST backend (no GPU): %d virtual ranks as threads (%d node(s) "
               "x %d%s), H=%d T=%d E=%d (%d per rank) K=%d %s, %s routing, one dispatch + "
               "combine (CPU memcpy and adds: the reference implementation, not comparable to "
               "GPU figures)\n",
               b->W, o->nodes, o->R, o->nodes > 1 ? ", loopback NIC" : "", o->H, o->T, o->El * b->W, o->El, o->K, b->esize == 1 ? "fp8" : "bf16",
               o->skew ? "skewed" : "uniform");
        printf("host memcpy ceiling: %.0f GB/s (bytes read + written)\n", b->ceiling_gbs);
        printf("received rows: %.0f; fewest bytes of both phases: %.0f; wall time: %.1f ms "
               "(%.1f GB/s)\n",
               ph[0].rows, ph[0].bytes, ph[0].ms, ph[0].bytes / (ph[0].ms * 1e-3) / 1e9);
        return;
    }
    printf("\nhybridep bench: GPU backend, %d virtual rank(s) on %s (%d SMs), H=%d T=%d "
           "E=%d (%d per rank) K=%d %s, %s routing, %d SMs per rank's kernel, %d iterations\n",
           b->W, gpu_name, sm_count, o->H, o->T, o->El * b->W, o->El, o->K,
           b->esize == 1 ? "fp8" : "bf16", o->skew ? "skewed" : "uniform", o->sms, o->iters);
    printf("ceiling: %s copy %.0f GB/s (bytes read + written, median, same run)\n",
           o->host ? "host memcpy" : "device-to-device", b->ceiling_gbs);
    if (!o->host)
        printf("         write-only (memset) %.0f GB/s, read-only (streaming read kernel) %.0f "
               "GB/s\n",
               b->ceil.write, b->ceil.read);
    printf("%-11s %10s %14s %11s %9s %8s %15s %9s\n", "phase", "rows", "fewest bytes", "median",
           "GB/s", "ceiling", "algbw/rank GB/s", "mix floor");
    for (int i = 0; i < n; i++) {
        double gbs = ph[i].bytes / (ph[i].ms * 1e-3) / 1e9;
        if (ph[i].bytes == 0)
            printf("%-11s %10s %14s %8.1f us %9s %8s %15s\n", ph[i].name, "-", "-", ph[i].ms * 1e3,
                   "-", "-", "-");
        else
            printf("%-11s %10.0f %14.0f %8.3f ms %9.0f %7.1f%% %15.1f %6.3f ms\n", ph[i].name,
                   ph[i].rows, ph[i].bytes, ph[i].ms, gbs, 100.0 * gbs / b->ceiling_gbs,
                   ph[i].algbw_rank, o->host ? NAN : floor_ms(b, &ph[i]));
    }
    if (!o->host && o->nodes > 1) { /* what crossed the (loopback) network */
        printf("network (%s NIC, %d nodes; per rank and call, medians' phase times):\n",
               b->nic, o->nodes);
        printf("%-11s %14s %10s %10s %12s %16s\n", "phase", "bytes sent", "GB/s", "writes",
               "writes/s", "ready->flag us");
        for (int ph_i = 0; ph_i < 2; ph_i++) {
            const phase_row *pr = &ph[1 + ph_i];
            double bytes, wrs, lat;
            net_per_call(b, ph_i, &bytes, &wrs, &lat);
            printf("%-11s %14.0f %10.1f %10.1f %12.0f %16.1f\n", pr->name, bytes,
                   bytes / (pr->ms * 1e-3) / 1e9, wrs, wrs / (pr->ms * 1e-3), lat);
        }
        printf("network bytes: rows, routing and scales (dispatch) or partial sums (combine) "
               "the proxy wrote to other nodes, counts and flags excluded; writes = work "
               "requests (data and flags); ready->flag = from a slot seen complete by the "
               "proxy to its flag's completion.%s\n",
               strcmp(b->nic, "loopback") ? ""
                                          : " The loopback NIC copies through this GPU's copy "
                                            "engine: these are not line-rate figures.");
    }
    if (!o->host)
        printf("preprocess = the layout step inside the dispatch kernel (in-kernel timer), "
               "included in dispatch; times run from the last rank's launch to the last rank's "
               "end; GB/s counts the fewest bytes; algbw = received rows x row bytes / time; "
               "mix floor = the phase's reads at the read ceiling, writes at the write "
               "ceiling, or all at the copy ceiling, whichever is longest\n");
    (void)host_dispatch_ms, (void)host_combine_ms;
}

int hep_cmd_bench(int argc, char **argv)
{
    static bench b;
    phase_row ph[3];
    char gpu_name[300] = "the CPU";
    int sm_count = 0, rc;
    double recv = 0, in_rows = 0, disp_bytes, comb_bytes, algd = 0, algc = 0;
    double hd = 0, hc = 0;

    memset(&b, 0, sizeof(b));
    if ((rc = parse(argc, argv, &b.o)))
        return rc;
    b.W = b.o.R * b.o.nodes;
    b.esize = b.o.dtype == HEP_DTYPE_FP8_E4M3 ? 1 : 2;
    b.ns = b.o.H / HEP_FP8_BLOCK;
    hep_config_default(&b.cfg);
    b.cfg.hidden = b.o.H;
    b.cfg.max_tokens = b.o.T;
    b.cfg.experts_per_rank = b.o.El;
    b.cfg.max_topk = b.o.K;
    b.cfg.dtype = b.o.dtype;
    b.cfg.ranks_per_node = b.o.R;
    b.cfg.dispatch_sms = b.o.sms;
    b.cfg.combine_sms = b.o.sms;
    b.cfg.backend = b.o.host ? HEP_BACKEND_HOST : HEP_BACKEND_GPU;
    if (hep_config_check(&b.cfg, b.W) || b.W > HEP_MAX_LOCAL) {
        fprintf(stderr, "hybridep bench: invalid configuration: %s\n", hep_last_error());
        return 1;
    }
    b.rd = calloc((size_t)b.W, sizeof(rank_data));
    fprintf(stderr, "[bench] generating %s routing for %d ranks x %d tokens (seed %u)\n",
            b.o.skew ? "skewed" : "uniform", b.W, b.o.T, b.o.seed);
    make_routing(&b);
    if (b.o.dump)
        dump_routing(&b);
    if (!b.o.host) {
        struct cudaDeviceProp p;
        cudaGetDeviceProperties(&p, 0);
        snprintf(gpu_name, sizeof(gpu_name), "%d x %s", b.o.gpus, p.name);
        sm_count = p.multiProcessorCount;
        fprintf(stderr, "[bench] measuring the device copy ceiling\n");
        b.ceil = device_ceilings(0);
        b.ceiling_gbs = b.ceil.copy;
        fprintf(stderr, "[bench] GPU: one checked call, then %d warm-up + %d timed iterations\n",
                b.o.warmup, b.o.iters);
        if (run_threads(&b, gpu_rank))
            return 1;
        fprintf(stderr, "[bench] verifying against the host backend (same inputs)\n");
        if (run_threads(&b, host_rank))
            return 1;
        if (b.verify_bad) {
            for (int r = 0; r < b.W; r++)
                if (b.rd[r].err[0])
                    fprintf(stderr, "hybridep bench: %s\n", b.rd[r].err);
            fprintf(stderr, "hybridep bench: VERIFICATION FAILED on %d rank(s)\n", b.verify_bad);
            return 1;
        }
        if (!b.o.as_json)
            printf("verified against the host backend: every received row, probability%s, "
                   "count and combined element equal on all %d ranks\n",
                   b.esize == 1 ? ", scale" : "", b.W);
    } else {
        double t0;
        fprintf(stderr, "[bench] no GPU: timing the host backend (the reference implementation)\n");
        b.ceiling_gbs = host_copy_ceiling();
        t0 = now_ms();
        if (run_threads(&b, host_rank))
            return 1;
        hd = now_ms() - t0;
        (void)hc;
    }
    for (int r = 0; r < b.W; r++) {
        recv += b.rd[r].num_recv;
        in_rows += b.rd[r].t;
        algd += (double)b.rd[r].num_recv * b.o.H * b.esize;
        algc += (double)b.rd[r].num_recv * b.o.H * 2;
    }
    /* fewest bytes: each source row read once, each received row written once (+ routing,
     * probabilities, scales); combine: each received row read once, each output written */
    disp_bytes = in_rows * b.o.H * b.esize + recv * b.o.H * b.esize + in_rows * b.o.K * 8 +
                 recv * b.o.El * 4 + (b.esize == 1 ? (in_rows + recv) * b.ns * 4 : 0);
    comb_bytes = recv * b.o.H * 2 + in_rows * b.o.H * 2;
    if (b.o.host) {
        ph[0] = (phase_row){"host d+c", recv, disp_bytes + comb_bytes, hd, 0, 0, 0};
        report(&b, ph, 1, gpu_name, sm_count, hd, hc);
        return 0;
    }
    ph[0] = (phase_row){"preprocess", 0, 0, phase_ms(&b, 2), 0, 0, 0}; /* inside dispatch */
    if (!b.o.as_json)
        printf("host launch skew across the %d rank threads (median, excluded below): %.1f us\n",
               b.W, phase_ms(&b, 3) * 1e3);
    ph[1] = (phase_row){"dispatch", recv, disp_bytes, phase_ms(&b, 0), 0,
                        in_rows * b.o.H * b.esize + in_rows * b.o.K * 8 +
                            (b.esize == 1 ? in_rows * b.ns * 4 : 0),
                        recv * b.o.H * b.esize + recv * b.o.El * 4 +
                            (b.esize == 1 ? recv * b.ns * 4 : 0)};
    ph[2] = (phase_row){"combine", recv, comb_bytes, phase_ms(&b, 1), 0, recv * b.o.H * 2,
                        in_rows * b.o.H * 2};
    ph[1].algbw_rank = algd / b.W / (ph[1].ms * 1e-3) / 1e9;
    ph[2].algbw_rank = algc / b.W / (ph[2].ms * 1e-3) / 1e9;
    report(&b, ph, 3, gpu_name, sm_count, 0, 0);
    return 0;
}
