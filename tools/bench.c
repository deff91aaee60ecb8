/* tools/bench.c: `hybridep bench` - verify against the host backend, then time dispatch
 * and combine against the same run's memory ceilings: the whole GPU's copy and a plain
 * copy kernel given the same SMs as the phase. Virtual ranks are threads of this process,
 * spread over --gpus devices (one GPU: all on device 0). Public API only. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <errno.h>

#include <cuda_runtime_api.h>

#include "ceilings.h"
#include "cli.h"
#include "json.h"

/* Every rank is a thread of this process; one node's limit of the library. */
#define BENCH_MAX_RANKS 72
#define BENCH_MAX_GPUS 64 /* --gpus */
#define BENCH_DEFAULT_SEED 1

typedef struct bench_opts {
    int R, nodes, H, T, El, K, sms, iters, warmup, gpus, skew, as_json, host, backend, dtype_i;
    int seed, layout_em, pad; /* --layout expert, --pad-multiple */
    int chunk;                /* --chunk: config.chunk_tokens */
    hep_dtype dtype;
    cli_int_list sweep;
    const char *dump, *json_file;
} bench_opts;

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
    float *t_disp, *t_comb;                   /* own launch -> own end */
    float *s_disp, *e_disp, *s_comb, *e_comb; /* start / end after rank 0's reference event */
    double *s_pre, *e_pre; /* in-kernel %globaltimer (ms): dispatch start, layout ready */
    hep_group_stats net[2]; /* N > 1: what the proxy posted in the timed iterations,
                               dispatch and combine */
    int rc;
    char err[1024];
} rank_data;

/* The expert-major part of a run (--layout expert), per rank: what its checked call gave
 * and, per timed iteration, when each of its phases started and ended (ms after rank 0's
 * reference event). */
enum { EM_DISPATCH, EM_COMBINE, EM_REUSE, EM_PAIR, EM_GATHER, EM_PHASES };
typedef struct em_rank {
    int num_permuted, overflow, gather_bad;
    long long *tpe;                  /* [El] padded rows per local expert */
    unsigned char *rows;             /* [num_permuted, H * esize] */
    float *probs, *scales;           /* [num_permuted], [num_permuted, H / 128] */
    uint16_t *comb;                  /* [t, H] the expert-major combine */
    float *s[EM_PHASES], *e[EM_PHASES];
    double *lay_s, *lay_e; /* the fresh expert-major dispatch's kernel start and layout
                              ready (in-kernel %globaltimer, ms) */
    double host_ms;                  /* host backend: its expert-major dispatch + combine */
} em_rank;

typedef struct bench {
    bench_opts o;
    hep_config cfg;
    int W, esize, ns;
    rank_data *rd;
    hep_inproc_world *world;
    int verify_bad;
    int unverified;       /* HEP_BENCH_UNVERIFIED=1: a mismatch is reported, not fatal (a
                             measurement build that leaves outputs out) */
    int unverified_runs;  /* the sweep's runs that differed under it */
    double ceiling_gbs;   /* device (or host) copy, read + write */
    char nic[32];         /* N > 1: the NIC the proxy drove (rank 0's) */
    bench_ceilings ceil;  /* device: copy, write-only, read-only */
    double lb_gbs[2];     /* loopback NIC, per phase: W streams copying that phase's network
                             bytes a rank at once, SMs idle (read + written); 0: not measured */
    void *ref_event;      /* rank 0's reference event of the current iteration */
    FILE *json_out;       /* --json-file, opened before the run so a bad path fails first */
    em_rank *em;          /* --layout expert: [W] */
    int em_budget;        /* num_permuted_tokens of every rank: the most rows one needs */
    double em_rows;       /* expert-major data rows over all ranks (padding excluded) */
} bench;

/* splitmix64: every bit well mixed (an LCG's low bits cycle quickly, which made the
 * skewed routing reach a quarter of the experts and loop forever on small ones) */
static uint64_t rnd(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint16_t bf16_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* One expert not yet among the token's first k: uniform, or skewed (3 in 4 draws from
 * the first quarter of the experts). Bounded: after 64 rejected draws, the first free one. */
static int pick_expert(uint64_t *s, const int *chosen, int k, int E, int skew)
{
    int hot = E / 4 > 0 ? E / 4 : 1;
    for (int tries = 0;; tries++) {
        uint64_t u = rnd(s);
        int e = tries >= 64 ? -1 : skew && (u >> 62) != 0 ? (int)(u % (uint64_t)hot)
                                                           : (int)(u % (uint64_t)E);
        int dup = 0;
        if (e < 0) { /* K <= E, so a free expert exists */
            for (e = 0; e < E; e++) {
                dup = 0;
                for (int q = 0; q < k; q++)
                    dup |= chosen[q] == e;
                if (!dup)
                    return e;
            }
            return 0;
        }
        for (int q = 0; q < k; q++)
            dup |= chosen[q] == e;
        if (!dup)
            return e;
    }
}

/* Top-k routing of every rank: K distinct experts per token. 0, or -1 (no memory). */
static int make_routing(bench *b)
{
    const int E = b->o.El * b->W, K = b->o.K, H = b->o.H;
    uint64_t s = (uint64_t)(unsigned)b->o.seed;
    for (int r = 0; r < b->W; r++) {
        rank_data *d = &b->rd[r];
        size_t rb = (size_t)H * (size_t)b->esize;
        d->t = b->o.T;
        d->tokens = malloc(rb * (size_t)d->t + 16);
        d->scales = malloc(sizeof(float) * (size_t)(b->ns + 1) * (size_t)d->t);
        d->idx = malloc(sizeof(int) * (size_t)K * (size_t)d->t);
        d->w = malloc(sizeof(float) * (size_t)K * (size_t)d->t);
        if (!d->tokens || !d->scales || !d->idx || !d->w)
            return -1;
        for (size_t k = 0; k < rb * (size_t)d->t / 2; k++)
            ((uint16_t *)d->tokens)[k] = b->esize == 2
                                             ? bf16_of((float)(rnd(&s) % 2000) / 64.0f - 15.0f)
                                             : (uint16_t)rnd(&s);
        for (int k = 0; k < b->ns * d->t; k++)
            d->scales[k] = (float)(rnd(&s) % 4096) / 1024.0f;
        for (int i = 0; i < d->t; i++) {
            int *row = d->idx + (size_t)i * K;
            float *w = d->w + (size_t)i * K, sum = 0;
            for (int k = 0; k < K; k++) {
                row[k] = pick_expert(&s, row, k, E, b->o.skew);
                w[k] = (float)(1 + rnd(&s) % 1000);
                sum += w[k];
            }
            for (int k = 0; k < K; k++)
                w[k] /= sum;
        }
    }
    return 0;
}

/* Distinct experts that received at least one slot (reported: a routing that misses
 * experts measures less than it claims). */
static int experts_reached(const bench *b)
{
    const int E = b->o.El * b->W;
    unsigned char *seen = calloc((size_t)E, 1);
    int n = 0;
    if (!seen)
        return -1;
    for (int r = 0; r < b->W; r++)
        for (size_t k = 0; k < (size_t)b->rd[r].t * (size_t)b->o.K; k++)
            seen[b->rd[r].idx[k]] = 1;
    for (int e = 0; e < E; e++)
        n += seen[e];
    free(seen);
    return n;
}

static int dump_routing(const bench *b, FILE *f)
{
    int hdr[6] = {b->W, b->o.T, b->o.H, b->o.El, b->o.K, b->esize};
    int bad = fwrite(hdr, sizeof(hdr), 1, f) != 1;
    for (int r = 0; r < b->W && !bad; r++) {
        size_t n = (size_t)b->rd[r].t * (size_t)b->o.K;
        bad |= fwrite(&b->rd[r].t, sizeof(int), 1, f) != 1;
        bad |= fwrite(b->rd[r].idx, sizeof(int), n, f) != n;
        bad |= fwrite(b->rd[r].w, sizeof(float), n, f) != n;
    }
    bad |= fclose(f) != 0;
    return bad ? cli_fail("bench", 1, "writing --dump-routing '%s' failed", b->o.dump) : 0;
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

#define MCK(p)                                                                                   \
    do {                                                                                         \
        if (!(p)) {                                                                              \
            snprintf(d->err, sizeof(d->err), "out of host memory (%s)", #p);                    \
            d->rc = HEP_ERR_NOMEM;                                                               \
            goto out;                                                                            \
        }                                                                                        \
    } while (0)

typedef struct thread_arg {
    bench *b;
    int rank;
} thread_arg;

/* acc += now - before */
static void net_add(hep_group_stats *acc, const hep_group_stats *before, const hep_group_stats *now)
{
    acc->net_bytes += now->net_bytes - before->net_bytes;
    acc->net_data_writes += now->net_data_writes - before->net_data_writes;
    acc->net_flag_writes += now->net_flag_writes - before->net_flag_writes;
    acc->net_flags_done += now->net_flags_done - before->net_flags_done;
    acc->net_ready_to_flag_ns += now->net_ready_to_flag_ns - before->net_ready_to_flag_ns;
}

/* Per rank and call in the timed iterations, for phase 0 (dispatch) or 1 (combine): bytes
 * sent, work requests, mean ready-to-flag latency (us). */
static void net_per_call(const bench *b, int phase, double *bytes, double *wrs, double *lat_us)
{
    double lat = 0, nflags = 0;
    *bytes = *wrs = 0;
    for (int r = 0; r < b->W; r++) {
        const hep_group_stats *n = &b->rd[r].net[phase];
        *bytes += (double)n->net_bytes;
        *wrs += (double)(n->net_data_writes + n->net_flag_writes);
        lat += (double)n->net_ready_to_flag_ns;
        nflags += (double)n->net_flags_done;
    }
    *bytes /= (double)b->W * b->o.iters;
    *wrs /= (double)b->W * b->o.iters;
    *lat_us = nflags ? lat / nflags / 1e3 : NAN;
}

/* The loopback NIC moves each rank's network bytes with device copies on a stream of its
 * own: the same bytes on W streams at once, with the SMs idle, are the floor of that part
 * of a phase (the copy engines' rate, not a NIC's line rate). */
static void loopback_yardstick(bench *b)
{
    char why[256];
    for (int k = 0; k < 2; k++) {
        double bytes, wrs, lat;
        net_per_call(b, k, &bytes, &wrs, &lat);
        b->lb_gbs[k] = 0;
        if (bytes >= 16 && ceil_stream_copies(0, b->W, (size_t)bytes, 5, &b->lb_gbs[k], why,
                                              sizeof(why)))
            fprintf(stderr, "[bench] loopback copy yardstick: %s\n", why), b->lb_gbs[k] = 0;
    }
}

static int cmp_f(const void *a, const void *b);

/* ---------------------------------------------------------------- --layout expert
 * The fused expert-major phases of the same run, next to what a user does without them:
 * a rank-major dispatch followed by a gather into expert order (ceil_gather_rows), and a
 * dispatch with a reused layout against a fresh one. Every rank uses one budget: the most
 * rows a rank needs, so nothing is dropped. */

/* Local expert e's distinct tokens at rank d over all sources (cnt [El]). */
static void em_counts(const bench *b, int d, int *cnt)
{
    const int El = b->o.El, K = b->o.K;
    memset(cnt, 0, sizeof(int) * (size_t)El);
    for (int s = 0; s < b->W; s++)
        for (int i = 0; i < b->rd[s].t; i++)
            for (int k = 0; k < K; k++) { /* the bench's K experts of a token are distinct */
                int x = b->rd[s].idx[(size_t)i * K + k];
                if (x / El == d)
                    cnt[x % El]++;
            }
}

/* The budget (the most padded rows a rank needs) and the data rows of all ranks. */
static int em_plan(bench *b)
{
    int *cnt = malloc(sizeof(int) * (size_t)b->o.El);
    if (!cnt)
        return -1;
    b->em_budget = b->o.pad, b->em_rows = 0;
    for (int d = 0; d < b->W; d++) {
        long long rows = 0;
        em_counts(b, d, cnt);
        for (int e = 0; e < b->o.El; e++) {
            rows += (cnt[e] + b->o.pad - 1) / b->o.pad * (long long)b->o.pad;
            b->em_rows += cnt[e];
        }
        if (rows > 0x7fffffffLL) {
            free(cnt);
            return -1;
        }
        b->em_budget = rows > b->em_budget ? (int)rows : b->em_budget;
    }
    free(cnt);
    b->em = calloc((size_t)b->W, sizeof(em_rank));
    return b->em ? 0 : -1;
}

/* The gather map of rank d: expert-major row p is rank-major row map[p] (-1: padding), the
 * positions of hybridep.h's "Layouts" computed from the routing. */
static int em_map(const bench *b, int d, int *map)
{
    const int El = b->o.El, K = b->o.K;
    long long *run = malloc(sizeof(long long) * (size_t)El), pos = 0;
    int *cnt = malloc(sizeof(int) * (size_t)El), j = 0;
    if (!run || !cnt) {
        free(run), free(cnt);
        return -1;
    }
    em_counts(b, d, cnt);
    for (int e = 0; e < El; e++) {
        run[e] = pos;
        pos += (cnt[e] + b->o.pad - 1) / b->o.pad * (long long)b->o.pad;
    }
    for (int p = 0; p < b->em_budget; p++)
        map[p] = -1;
    for (int s = 0; s < b->W; s++)
        for (int i = 0; i < b->rd[s].t; i++) {
            int hit = 0;
            for (int k = 0; k < K; k++) {
                int x = b->rd[s].idx[(size_t)i * K + k];
                if (x / El == d) {
                    long long p = run[x % El]++;
                    if (p < b->em_budget)
                        map[p] = j;
                    hit = 1;
                }
            }
            j += hit;
        }
    free(run), free(cnt);
    return 0;
}

/* Expert output of rank r's expert-major row p, channel c (as the main pass's pattern). */
static uint16_t em_expert_value(int r, int p, int c)
{
    return bf16_of((float)((r + 1) * 8 + p % 13) + 0.25f * (float)(c % 5));
}

static hep_dispatch_opts em_opts(const bench *b, hep_handle *h, void *tok, float *pr, float *sc)
{
    hep_dispatch_opts x;
    memset(&x, 0, sizeof(x));
    x.handle = h;
    x.layout = HEP_LAYOUT_EXPERT_MAJOR;
    x.pad_multiple = b->o.pad;
    x.num_permuted_tokens = b->em_budget;
    x.recv_tokens = tok;
    x.recv_probs = pr;
    x.recv_scales = b->esize == 1 ? sc : NULL;
    return x;
}

/* The GPU rank's expert-major part, after its rank-major iterations (same group). 0, or
 * d->rc with d->err. */
static int em_gpu_rank(bench *b, int rank, hep_group *g, hep_bootstrap *bs, cudaStream_t st,
                       hep_dispatch_args da)
{
    rank_data *d = &b->rd[rank];
    em_rank *m = &b->em[rank];
    const int H = b->o.H, El = b->o.El, it_total = b->o.warmup + b->o.iters;
    const size_t rb = (size_t)H * (size_t)b->esize, B = (size_t)b->em_budget;
    const size_t ns = (size_t)b->ns;
    void *tok = NULL, *eo = NULL, *out = NULL, *gdst = NULL;
    float *pr = NULL, *sc = NULL;
    int *dmap = NULL, *hmap = NULL;
    uint16_t *he = NULL;
    unsigned char *gh = NULL;
    hep_handle *h = NULL;
    cudaEvent_t ev[11] = {0};
    hep_dispatch_opts x;
    hep_dispatch_result dr;
    hep_combine_args ca;
    hep_combine_opts co;

    for (int k = 0; k < 11; k++)
        CKB(cudaEventCreate(&ev[k]));
    HCK(hep_handle_create(g, &h));
    CKB(cudaMalloc(&tok, B * rb));
    CKB(cudaMalloc((void **)&pr, B * sizeof(float)));
    CKB(cudaMalloc((void **)&sc, B * (ns + 1) * sizeof(float)));
    CKB(cudaMalloc(&eo, B * (size_t)H * 2));
    CKB(cudaMalloc(&out, (size_t)d->t * (size_t)H * 2 + 16));
    CKB(cudaMalloc(&gdst, B * rb));
    CKB(cudaMalloc((void **)&dmap, B * sizeof(int)));
    hmap = malloc(B * sizeof(int));
    MCK(hmap);
    if (em_map(b, rank, hmap))
        MCK(NULL);
    CKB(cudaMemcpy(dmap, hmap, B * sizeof(int), cudaMemcpyHostToDevice));
    /* 1. one checked call (poisoned outputs), kept for the verification */
    CKB(cudaMemset(tok, 0xff, B * rb));
    CKB(cudaMemset(pr, 0xff, B * sizeof(float)));
    CKB(cudaMemset(sc, 0xff, B * (ns + 1) * sizeof(float)));
    bs->barrier(bs->ctx);
    da.flags = 0;
    x = em_opts(b, h, tok, pr, sc);
    HCK(hep_dispatch_ex(g, &da, &x, &dr));
    m->num_permuted = x.num_permuted;
    m->overflow = x.overflow;
    m->tpe = malloc(sizeof(long long) * (size_t)El);
    MCK(m->tpe);
    for (int e = 0; e < El; e++)
        m->tpe[e] = x.tokens_per_expert[e];
    m->rows = malloc(rb * (size_t)m->num_permuted + 1);
    m->probs = malloc(sizeof(float) * (size_t)m->num_permuted + 1);
    m->scales = malloc(sizeof(float) * ns * (size_t)m->num_permuted + 1);
    MCK(m->rows && m->probs && m->scales);
    CKB(cudaMemcpy(m->rows, tok, rb * (size_t)m->num_permuted, cudaMemcpyDeviceToHost));
    CKB(cudaMemcpy(m->probs, pr, sizeof(float) * (size_t)m->num_permuted, cudaMemcpyDeviceToHost));
    if (b->esize == 1)
        CKB(cudaMemcpy(m->scales, sc, sizeof(float) * ns * (size_t)m->num_permuted,
                       cudaMemcpyDeviceToHost));
    he = malloc(B * (size_t)H * 2);
    MCK(he);
    for (size_t p = 0; p < B; p++)
        for (int c = 0; c < H; c++)
            he[p * (size_t)H + (size_t)c] = em_expert_value(rank, (int)p, c);
    CKB(cudaMemcpy(eo, he, B * (size_t)H * 2, cudaMemcpyHostToDevice));
    bs->barrier(bs->ctx);
    memset(&ca, 0, sizeof(ca));
    memset(&co, 0, sizeof(co));
    ca.expert_out = eo;
    ca.out = out;
    ca.stream = st;
    co.handle = h;
    HCK(hep_combine_ex(g, &ca, &co));
    m->comb = malloc((size_t)H * 2 * (size_t)d->t + 16);
    MCK(m->comb);
    CKB(cudaMemcpy(m->comb, out, (size_t)H * 2 * (size_t)d->t, cudaMemcpyDeviceToHost));
    /* the pair computes the same rows: a rank-major dispatch, then the gather */
    bs->barrier(bs->ctx);
    HCK(hep_dispatch(g, &da, &dr));
    CKB((cudaError_t)ceil_gather_rows(dr.tokens, gdst, dmap, B, rb, b->o.sms, st));
    CKB(cudaStreamSynchronize(st));
    gh = malloc(rb * (size_t)m->num_permuted + 1);
    MCK(gh);
    CKB(cudaMemcpy(gh, gdst, rb * (size_t)m->num_permuted, cudaMemcpyDeviceToHost));
    m->gather_bad = memcmp(gh, m->rows, rb * (size_t)m->num_permuted) != 0;
    /* 2. timed iterations */
    for (int k = 0; k < EM_PHASES; k++) {
        m->s[k] = calloc((size_t)it_total, sizeof(float));
        m->e[k] = calloc((size_t)it_total, sizeof(float));
        MCK(m->s[k] && m->e[k]);
    }
    m->lay_s = calloc((size_t)it_total, sizeof(double));
    MCK(m->lay_s);
    m->lay_e = calloc((size_t)it_total, sizeof(double));
    MCK(m->lay_e);
    ca.flags = HEP_ASYNC;
    for (int it = 0; it < it_total; it++) {
        hep_group_stats n1;
        if (rank == 0) {
            CKB(cudaEventRecord(ev[10], st));
            CKB(cudaEventSynchronize(ev[10]));
            b->ref_event = ev[10];
        }
        bs->barrier(bs->ctx);
        da.flags = HEP_ASYNC; /* fresh: the layout step, recorded into h */
        x = em_opts(b, h, tok, pr, sc);
        CKB(cudaEventRecord(ev[0], st));
        HCK(hep_dispatch_ex(g, &da, &x, &dr));
        CKB(cudaEventRecord(ev[1], st));
        CKB(cudaStreamSynchronize(st));
        HCK(hep_group_sync(g, st));
        HCK(hep_group_get_stats(g, &n1));
        m->lay_s[it] = (double)n1.dispatch_start_ns / 1e6;
        m->lay_e[it] = (double)n1.layout_ready_ns / 1e6;
        bs->barrier(bs->ctx);
        CKB(cudaEventRecord(ev[2], st));
        HCK(hep_combine_ex(g, &ca, &co));
        CKB(cudaEventRecord(ev[3], st));
        CKB(cudaStreamSynchronize(st));
        HCK(hep_group_sync(g, st));
        bs->barrier(bs->ctx);
        da.flags = HEP_ASYNC | HEP_REUSE_LAYOUT; /* the same tokens with h's layout */
        x = em_opts(b, h, tok, pr, sc);
        CKB(cudaEventRecord(ev[4], st));
        HCK(hep_dispatch_ex(g, &da, &x, &dr));
        CKB(cudaEventRecord(ev[5], st));
        CKB(cudaStreamSynchronize(st));
        HCK(hep_group_sync(g, st));
        bs->barrier(bs->ctx);
        da.flags = HEP_ASYNC; /* rank-major, then the gather into expert order */
        CKB(cudaEventRecord(ev[6], st));
        HCK(hep_dispatch(g, &da, &dr));
        CKB(cudaEventRecord(ev[7], st));
        CKB((cudaError_t)ceil_gather_rows(dr.tokens, gdst, dmap, B, rb, b->o.sms, st));
        CKB(cudaEventRecord(ev[8], st));
        CKB(cudaStreamSynchronize(st));
        HCK(hep_group_sync(g, st));
        {
            const int from[EM_PHASES] = {0, 2, 4, 6, 7}, to[EM_PHASES] = {1, 3, 5, 8, 8};
            for (int k = 0; k < EM_PHASES; k++) {
                CKB(cudaEventElapsedTime(&m->s[k][it], (cudaEvent_t)b->ref_event, ev[from[k]]));
                CKB(cudaEventElapsedTime(&m->e[k][it], (cudaEvent_t)b->ref_event, ev[to[k]]));
            }
        }
        bs->barrier(bs->ctx); /* the reference event stays alive until all have read it */
    }
out:
    free(hmap), free(he), free(gh);
    cudaFree(tok), cudaFree(pr), cudaFree(sc), cudaFree(eo), cudaFree(out), cudaFree(gdst);
    cudaFree(dmap);
    for (int k = 0; k < 11; k++)
        if (ev[k])
            cudaEventDestroy(ev[k]);
    hep_handle_destroy(h);
    return d->rc;
}

/* The host rank's expert-major part: the same call on the host backend, compared with the
 * GPU's (unless this is the host-only run, which times it). Returns the mismatches. */
static int em_host_rank(bench *b, int rank, hep_group *g, hep_dispatch_args da)
{
    rank_data *d = &b->rd[rank];
    em_rank *m = &b->em[rank];
    const int H = b->o.H, El = b->o.El;
    const size_t rb = (size_t)H * (size_t)b->esize, B = (size_t)b->em_budget;
    const size_t ns = (size_t)b->ns;
    unsigned char *tok = malloc(B * rb + 1);
    float *pr = malloc(B * sizeof(float) + 4), *sc = malloc(B * (ns + 1) * sizeof(float));
    uint16_t *eo = malloc(B * (size_t)H * 2 + 2), *out = malloc((size_t)d->t * (size_t)H * 2 + 2);
    hep_handle *h = NULL;
    hep_dispatch_opts x;
    hep_dispatch_result dr;
    hep_combine_args ca;
    hep_combine_opts co;
    int bad = 0;
    double t0 = now_ms();
    MCK(tok && pr && sc && eo && out);
    HCK(hep_handle_create(g, &h));
    x = em_opts(b, h, tok, pr, sc);
    HCK(hep_dispatch_ex(g, &da, &x, &dr));
    for (size_t p = 0; p < B; p++)
        for (int c = 0; c < H; c++)
            eo[p * (size_t)H + (size_t)c] = em_expert_value(rank, (int)p, c);
    memset(&ca, 0, sizeof(ca));
    memset(&co, 0, sizeof(co));
    ca.expert_out = eo;
    ca.out = out;
    co.handle = h;
    HCK(hep_combine_ex(g, &ca, &co));
    m->host_ms = now_ms() - t0;
    if (!b->o.host) {
        bad += x.num_permuted != m->num_permuted || x.overflow != m->overflow || m->gather_bad;
        for (int e = 0; e < El && !bad; e++)
            bad += x.tokens_per_expert[e] != m->tpe[e];
        if (!bad) {
            const size_t n = (size_t)x.num_permuted;
            bad += memcmp(tok, m->rows, n * rb) != 0;
            bad += memcmp(pr, m->probs, n * sizeof(float)) != 0;
            if (b->esize == 1)
                bad += memcmp(sc, m->scales, n * ns * sizeof(float)) != 0;
            bad += memcmp(out, m->comb, (size_t)d->t * (size_t)H * 2) != 0;
        }
        if (bad)
            snprintf(d->err, sizeof(d->err), "rank %d: the GPU's expert-major output%s differs "
                     "from the host backend", rank,
                     m->gather_bad ? " (or the rank-major dispatch + gather)" : "");
    }
out:
    free(tok), free(pr), free(sc), free(eo), free(out);
    hep_handle_destroy(h);
    return bad + (d->rc != 0);
}

static void em_free(bench *b)
{
    for (int r = 0; b->em && r < b->W; r++) {
        em_rank *m = &b->em[r];
        free(m->tpe), free(m->rows), free(m->probs), free(m->scales), free(m->comb);
        free(m->lay_s);
        free(m->lay_e);
        for (int k = 0; k < EM_PHASES; k++)
            free(m->s[k]), free(m->e[k]);
        memset(m, 0, sizeof(*m));
    }
}

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
    MCK(comb);
    memset(&ca, 0, sizeof(ca));
    ca.handle = dr.handle;
    ca.expert_out = hep_combine_input(g);
    ca.out = comb;
    HCK(hep_combine(g, &ca));
    if (!b->o.host)
        bad += memcmp(comb, d->r_comb, (size_t)b->o.H * 2 * (size_t)d->t) != 0;
    if (b->o.layout_em && em_host_rank(b, ta->rank, g, da)) {
        __atomic_add_fetch(&b->verify_bad, 1, __ATOMIC_RELAXED);
        goto out;
    }
    if (bad) {
        __atomic_add_fetch(&b->verify_bad, 1, __ATOMIC_RELAXED);
        snprintf(d->err, sizeof(d->err), "rank %d: GPU output differs from the host backend",
                 ta->rank);
    }
out:
    free(comb);
    hep_group_destroy(g);
    return NULL;
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
    hep_group_info gi;
    uint16_t *h = NULL;

    hep_inproc_bootstrap(b->world, ta->rank, &bs);
    CKB(cudaSetDevice(dev));
    HCK(hep_group_create(&b->cfg, &bs, dev, &g));
    HCK(hep_group_get_info(g, &gi));
    if (ta->rank == 0)
        snprintf(b->nic, sizeof(b->nic), "%s", gi.transport);
    /* kept for the process: a sweep runs the ranks again at every SM count, and streams
     * made per run would soon share a hardware queue with a live rank's */
    HCK(hep_inproc_stream(dev, ta->rank, (void **)&st));
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
    CKB(cudaMemsetAsync(hep_combine_input(g), 0xff, gi.max_recv_rows * (size_t)H * 2, st));
    CKB(cudaMemsetAsync(d_out, 0xff, (size_t)H * 2 * (size_t)d->t, st)); /* poison */
    CKB(cudaStreamSynchronize(st));
    bs.barrier(bs.ctx);
    HCK(hep_dispatch(g, &da, &dr));
    d->num_recv = dr.num_recv;
    d->tpe = malloc(sizeof(int) * (size_t)El);
    MCK(d->tpe);
    memcpy(d->tpe, dr.host_counts + 1, sizeof(int) * (size_t)El);
    d->r_tokens = malloc(rb * (size_t)d->num_recv + 1);
    MCK(d->r_tokens);
    d->r_probs = malloc(sizeof(float) * (size_t)El * (size_t)d->num_recv + 1);
    MCK(d->r_probs);
    CKB(cudaMemcpy(d->r_tokens, dr.tokens, rb * (size_t)d->num_recv, cudaMemcpyDeviceToHost));
    CKB(cudaMemcpy(d->r_probs, dr.probs, sizeof(float) * (size_t)El * (size_t)d->num_recv, cudaMemcpyDeviceToHost));
    if (b->esize == 1) {
        d->r_scales = malloc(sizeof(float) * (size_t)b->ns * (size_t)d->num_recv + 1);
        MCK(d->r_scales);
        CKB(cudaMemcpy(d->r_scales, dr.scales, sizeof(float) * (size_t)b->ns * (size_t)d->num_recv,
                       cudaMemcpyDeviceToHost));
    }
    {
        h = malloc((size_t)H * 2 * (size_t)d->num_recv + 16);
        MCK(h);
        for (int j = 0; j < d->num_recv; j++)
            for (int c = 0; c < H; c++)
                h[(size_t)j * H + c] = bf16_of((float)((ta->rank + 1) * 8 + j % 13) + 0.25f * (float)(c % 5));
        CKB(cudaMemcpyAsync(hep_combine_input(g), h, (size_t)H * 2 * (size_t)d->num_recv,
                            cudaMemcpyHostToDevice, st));
        CKB(cudaStreamSynchronize(st));
        free(h);
        h = NULL;
    }
    bs.barrier(bs.ctx);
    memset(&ca, 0, sizeof(ca));
    ca.handle = dr.handle;
    ca.expert_out = hep_combine_input(g);
    ca.out = d_out;
    ca.stream = st;
    HCK(hep_combine(g, &ca));
    d->r_comb = malloc((size_t)H * 2 * (size_t)d->t + 16);
    MCK(d->r_comb);
    CKB(cudaMemcpy(d->r_comb, d_out, (size_t)H * 2 * (size_t)d->t, cudaMemcpyDeviceToHost));

    /* 2. timed iterations: dispatch then combine, each bracketed by events */
    d->t_disp = calloc((size_t)it_total, sizeof(float));
    MCK(d->t_disp);
    d->t_comb = calloc((size_t)it_total, sizeof(float));
    MCK(d->t_comb);
    d->s_disp = calloc((size_t)it_total, sizeof(float));
    MCK(d->s_disp);
    d->s_pre = calloc((size_t)it_total, sizeof(double));
    MCK(d->s_pre);
    d->e_pre = calloc((size_t)it_total, sizeof(double));
    MCK(d->e_pre);
    d->e_disp = calloc((size_t)it_total, sizeof(float));
    MCK(d->e_disp);
    d->s_comb = calloc((size_t)it_total, sizeof(float));
    MCK(d->s_comb);
    d->e_comb = calloc((size_t)it_total, sizeof(float));
    MCK(d->e_comb);
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
        hep_group_stats n0, n1, n2;
        HCK(hep_group_get_stats(g, &n0));
        CKB(cudaEventRecord(ev[0], st));
        HCK(hep_dispatch(g, &da, &dr));
        CKB(cudaEventRecord(ev[1], st));
        CKB(cudaStreamSynchronize(st));
        HCK(hep_group_sync(g, st));
        HCK(hep_group_get_stats(g, &n1));
        bs.barrier(bs.ctx);
        ca.handle = dr.handle;
        CKB(cudaEventRecord(ev[2], st));
        HCK(hep_combine(g, &ca));
        CKB(cudaEventRecord(ev[3], st));
        CKB(cudaStreamSynchronize(st));
        HCK(hep_group_sync(g, st));
        HCK(hep_group_get_stats(g, &n2));
        if (it >= b->o.warmup) {
            net_add(&d->net[0], &n0, &n1);
            net_add(&d->net[1], &n1, &n2);
        }
        CKB(cudaEventElapsedTime(&d->t_disp[it], ev[0], ev[1]));
        CKB(cudaEventElapsedTime(&d->t_comb[it], ev[2], ev[3]));
        CKB(cudaEventElapsedTime(&d->s_disp[it], (cudaEvent_t)b->ref_event, ev[0]));
        d->s_pre[it] = (double)n1.dispatch_start_ns / 1e6;
        d->e_pre[it] = (double)n1.layout_ready_ns / 1e6;
        CKB(cudaEventElapsedTime(&d->e_disp[it], (cudaEvent_t)b->ref_event, ev[1]));
        CKB(cudaEventElapsedTime(&d->s_comb[it], (cudaEvent_t)b->ref_event, ev[2]));
        CKB(cudaEventElapsedTime(&d->e_comb[it], (cudaEvent_t)b->ref_event, ev[3]));
        bs.barrier(bs.ctx); /* the reference event stays alive until all have read it */
    }
    if (b->o.layout_em) {
        da.flags = 0;
        em_gpu_rank(b, ta->rank, g, &bs, st, da);
    }
out:
    free(h);
    cudaFree(d_tok), cudaFree(d_sc), cudaFree(d_idx), cudaFree(d_w), cudaFree(d_out);
    for (int k = 0; k < 7; k++)
        if (ev[k])
            cudaEventDestroy(ev[k]);
    hep_group_destroy(g);
    return NULL;
}

static void free_results(bench *b)
{
    for (int r = 0; r < b->W; r++) {
        rank_data *d = &b->rd[r];
        void *p[] = {d->tpe, d->r_tokens, d->r_probs, d->r_scales, d->r_comb, d->t_disp,
                     d->t_comb, d->s_disp, d->e_disp, d->s_comb, d->e_comb, d->s_pre, d->e_pre};
        for (size_t k = 0; k < sizeof(p) / sizeof(p[0]); k++)
            free(p[k]);
        d->tpe = NULL, d->r_tokens = NULL, d->r_probs = NULL, d->r_scales = NULL;
        d->r_comb = NULL, d->t_disp = d->t_comb = d->s_disp = d->e_disp = NULL;
        d->s_comb = d->e_comb = NULL, d->s_pre = d->e_pre = NULL;
        memset(d->net, 0, sizeof(d->net));
        d->rc = 0;
        d->err[0] = '\0';
    }
}

/* Run fn on every rank; on failure one message, each distinct text once with its ranks
 * (one cause seen by all ranks is said once, not once per rank). */
static int run_threads(bench *b, void *(*fn)(void *), const char *what)
{
    pthread_t th[BENCH_MAX_RANKS];
    thread_arg ta[BENCH_MAX_RANKS];
    char msg[4096];
    size_t n = 0;
    int failed = 0;
    if (hep_inproc_world_create(b->W, &b->world))
        return cli_fail("bench", 1, "%s", hep_last_error());
    for (int r = 0; r < b->W; r++) {
        ta[r] = (thread_arg){b, r};
        if (pthread_create(&th[r], NULL, fn, &ta[r]) != 0) {
            /* the started ranks time out waiting for this one (HEP_TIMEOUT_MS) */
            b->rd[r].rc = HEP_ERR_NOMEM;
            snprintf(b->rd[r].err, sizeof(b->rd[r].err), "cannot start its thread");
            th[r] = 0;
        }
    }
    for (int r = 0; r < b->W; r++)
        if (th[r])
            pthread_join(th[r], NULL);
    hep_inproc_world_destroy(b->world);
    b->world = NULL;
    msg[0] = '\0';
    for (int r = 0; r < b->W; r++) {
        int seen = 0, cnt = 0;
        if (!b->rd[r].rc)
            continue;
        failed = 1;
        for (int q = 0; q < r; q++)
            seen |= b->rd[q].rc && strcmp(b->rd[q].err, b->rd[r].err) == 0;
        if (seen)
            continue;
        for (int q = r; q < b->W; q++)
            cnt += b->rd[q].rc && strcmp(b->rd[q].err, b->rd[r].err) == 0;
        if (n < sizeof(msg))
            n += (size_t)snprintf(msg + n, sizeof(msg) - n, "%s%s: %s", n ? "; " : "",
                                  cnt == b->W ? "every rank" : cnt > 1 ? "several ranks" : "rank",
                                  b->rd[r].err);
        if (cnt == 1 && n < sizeof(msg)) /* name the single rank */
            n += (size_t)snprintf(msg + n, sizeof(msg) - n, " (rank %d)", r);
    }
    return failed ? cli_fail("bench", 1, "%s failed: %s", what, msg) : 0;
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
    if (!per)
        return NAN;
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

static double host_copy_ceiling(void)
{
    size_t bytes = (size_t)256 << 20;
    char *a = malloc(bytes), *c = malloc(bytes);
    double t[5];
    if (!a || !c) {
        free(a), free(c);
        return NAN;
    }
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

static const char *const bench_notes =
    "Every rank is a thread of this process: --nodes x --ranks-per-node <= 72.\n"
    "The default seed is fixed, so two runs route alike; --seed changes it.\n"
    "--sweep-sms S1,S2,... runs the GPU bench once per SM count and prints one row each\n"
    "(layout step, dispatch, combine, the same-SM copy ceiling, ratios); a count whose\n"
    "blocks (ranks per GPU x S) exceed the GPU's SMs is skipped with the reason.\n"
    "HEP_BENCH_UNVERIFIED=1 (for measurement builds that leave outputs out): a difference\n"
    "from the host backend is reported as UNVERIFIED instead of failing the run.\n"
    "Exit codes: 0 done, 1 failed (configuration, GPU, verification), 2 bad option.";

static int parse(int argc, char **argv, bench_opts *o)
{
    int rc, routing = 0;
    memset(o, 0, sizeof(*o));
    o->R = 8, o->nodes = 1, o->H = 7168, o->T = 4096, o->El = 32, o->K = 8, o->sms = 16;
    o->iters = 20, o->warmup = 5, o->gpus = 1, o->seed = BENCH_DEFAULT_SEED, o->pad = 128;
    o->chunk = HEP_CHUNK_DEFAULT;
    {
        const cli_opt opts[] = {
            {"nodes", CLI_INT, &o->nodes, 1, 4096, NULL, "N", "virtual nodes (N > 1: the loopback NIC)"},
            {"ranks-per-node", CLI_INT, &o->R, 1, BENCH_MAX_RANKS, NULL, "R", "ranks per node"},
            {"hidden", CLI_INT, &o->H, 8, 65536, NULL, "H", "channels per token"},
            {"tokens", CLI_INT, &o->T, 1, 65536, NULL, "T", "tokens per rank"},
            {"experts-per-rank", CLI_INT, &o->El, 1, 1024, NULL, "E", "experts per rank"},
            {"topk", CLI_INT, &o->K, 1, 32, NULL, "K", "experts per token"},
            {"dtype", CLI_CHOICE, &o->dtype_i, 0, 0, "bf16|fp8", NULL, "dispatch payload"},
            {"sms", CLI_INT, &o->sms, 1, 132, NULL, "S", "SMs of each rank's kernels"},
            {"chunk", CLI_INT, &o->chunk, HEP_CHUNK_DEFAULT, 4096, NULL, "C",
             "config.chunk_tokens: tokens per chunk of the inter-node rings (-1: the "
             "backend's default, 0: one chunk of T per slot)"},
            {"sweep-sms", CLI_INT_LIST, &o->sweep, 1, 132, NULL, "S1,S2,...", "one GPU run per SM count"},
            {"iters", CLI_INT, &o->iters, 1, 100000, NULL, "I", "timed iterations"},
            {"warmup", CLI_INT, &o->warmup, 0, 100000, NULL, "W", "warm-up iterations"},
            {"backend", CLI_CHOICE, &o->backend, 0, 0, "auto|gpu|host", NULL, "auto: the GPU when there is one"},
            {"routing", CLI_CHOICE, &routing, 0, 0, "uniform|skewed", NULL, "skewed: 3 in 4 slots on the first quarter of the experts"},
            {"gpus", CLI_INT, &o->gpus, 1, BENCH_MAX_GPUS, NULL, "G", "GPUs the ranks spread over"},
            {"seed", CLI_INT, &o->seed, 0, 2147483647, NULL, "S", "routing and data seed"},
            {"dump-routing", CLI_STR, &o->dump, 0, 0, NULL, "FILE", "write the routing (binary)"},
            {"layout", CLI_CHOICE, &o->layout_em, 0, 0, "rank|expert", NULL, "expert: also the fused expert-major phases, a rank-major dispatch + gather, a reused layout"},
            {"pad-multiple", CLI_INT, &o->pad, 1, HEP_MAX_PAD_MULTIPLE, NULL, "P", "expert-major block padding (default 128)"},
            {"json", CLI_FLAG, &o->as_json, 0, 0, NULL, NULL, "one JSON document on stdout"},
            {"json-file", CLI_STR, &o->json_file, 0, 0, NULL, "FILE", "also write the JSON report to FILE"},
        };
        const cli_cmd cmd = {"bench", "verify against the host backend, then time dispatch and "
                                      "combine against the same run's ceilings",
                             opts, (int)(sizeof(opts) / sizeof(opts[0])), bench_notes};
        if ((rc = cli_parse(&cmd, argc, argv)))
            return rc;
    }
    o->dtype = o->dtype_i ? HEP_DTYPE_FP8_E4M3 : HEP_DTYPE_BF16;
    o->skew = routing == 1;
    if (o->nodes > BENCH_MAX_RANKS / o->R) /* no product that could overflow is formed */
        return cli_fail("bench", 2, "--nodes %d x --ranks-per-node %d = %lld ranks: at most %d "
                        "(every rank is a thread of this process)", o->nodes, o->R,
                        (long long)o->nodes * o->R, BENCH_MAX_RANKS);
    if (o->layout_em && o->sweep.n)
        return cli_fail("bench", 2, "--layout expert: not with --sweep-sms");
    if (o->backend == 2 && o->sweep.n)
        return cli_fail("bench", 2, "--sweep-sms times GPU kernels: not with --backend host");
    if (o->backend == 1 || (o->backend == 0 && hep_has_gpu_backend())) {
        int n = 0;
        cudaError_t e = cudaGetDeviceCount(&n);
        if (o->backend == 1 && !hep_has_gpu_backend())
            return cli_fail("bench", 1, "--backend gpu: this hybridep library was built without "
                            "CUDA (host backend only); use --backend host");
        if (o->backend == 1 && (e != cudaSuccess || n == 0))
            return cli_fail("bench", 1, "--backend gpu: no usable CUDA GPU: %s",
                            e != cudaSuccess ? cudaGetErrorString(e) : "no device");
        if (o->backend == 1 && o->gpus > n)
            return cli_fail("bench", 2, "--gpus %d: this machine has %d GPU(s)", o->gpus, n);
        o->host = e != cudaSuccess || n == 0;
        (void)cudaGetLastError();
    } else {
        o->host = 1;
    }
    if (o->host && o->sweep.n)
        return cli_fail("bench", 1, "--sweep-sms times GPU kernels: this machine has no usable GPU");
    return 0;
}

typedef struct phase_row {
    const char *name;
    double rows, bytes, ms, algbw_rank;
    double rbytes, wbytes; /* the fewest bytes, read and written */
    double row_bytes;      /* the phase's row: H x esize (dispatch) or H x 2 (combine) */
    double same_ms;        /* a plain copy of the phase's bytes with the phase's blocks */
    int same_blocks;
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

static double gbs_of(const phase_row *p)
{
    return p->bytes ? p->bytes / (p->ms * 1e-3) / 1e9 : NAN;
}

/* The same-SM copy of phase p: blocks = ranks per GPU x S; the phase's fewest bytes on one
 * GPU as rows of its row size, each read and written once. */
static int same_sm(const bench *b, int S, phase_row *p, char *why, size_t why_len)
{
    int per_gpu = b->W / b->o.gpus > 0 ? b->W / b->o.gpus : 1;
    double bytes = p->bytes / b->o.gpus;
    size_t rows = (size_t)ceil(bytes / 2 / p->row_bytes);
    p->same_blocks = per_gpu * S;
    return ceil_same_sm_copy(0, p->same_blocks, rows ? rows : 1, (size_t)p->row_bytes,
                             b->o.iters, &p->same_ms, why, why_len);
}

static void json_phase(hep_json *j, const bench *b, const phase_row *p, int i)
{
    const bench_opts *o = &b->o;
    json_obj(j, NULL);
    json_str(j, "phase", p->name);
    json_num(j, "rows", p->rows);
    json_num(j, "fewest_bytes", p->bytes);
    json_num(j, "median_ms", p->ms);
    json_num(j, "gbs", gbs_of(p));
    json_num(j, "fraction_of_ceiling", gbs_of(p) / b->ceiling_gbs);
    if (!o->host) {
        json_num(j, "algbw_per_rank_gbs", p->algbw_rank);
        json_num(j, "read_bytes", p->rbytes);
        json_num(j, "write_bytes", p->wbytes);
        json_num(j, "mix_floor_ms", p->bytes ? floor_ms(b, p) : NAN);
        json_int(j, "same_sm_blocks", p->same_blocks);
        json_num(j, "same_sm_copy_ms", p->bytes ? p->same_ms : NAN);
        json_num(j, "fraction_of_same_sm_copy", p->bytes ? p->same_ms / p->ms : NAN);
    }
    if (!o->host && o->nodes > 1 && i >= 1 && i <= 2) {
        double bytes, wrs, lat;
        net_per_call(b, i - 1, &bytes, &wrs, &lat);
        json_num(j, "network_bytes_per_rank", bytes);
        json_num(j, "network_writes_per_rank", wrs);
        json_num(j, "ready_to_flag_us", lat);
    }
    json_end_obj(j);
}

static void json_head(hep_json *j, const bench *b, const char *gpu_name, int reached)
{
    const bench_opts *o = &b->o;
    json_str(j, "hybridep_version", hep_version());
    json_str(j, "backend", o->host ? "host" : "gpu");
    json_str(j, "device", gpu_name);
    json_int(j, "ranks", b->W);
    json_int(j, "nodes", o->nodes);
    json_int(j, "gpus", o->host ? 0 : o->gpus);
    json_int(j, "hidden", o->H);
    json_int(j, "tokens", o->T);
    json_int(j, "experts_per_rank", o->El);
    json_int(j, "topk", o->K);
    json_str(j, "dtype", b->esize == 1 ? "fp8" : "bf16");
    json_str(j, "routing", o->skew ? "skewed" : "uniform");
    json_int(j, "seed", o->seed);
    json_int(j, "experts_reached", reached);
    json_int(j, "sms_per_rank", o->host ? 0 : o->sms);
    /* the host backend is timed once, with no warm-up */
    json_int(j, "iters", o->host ? 1 : o->iters);
    json_int(j, "warmup", o->host ? 0 : o->warmup);
    json_bool(j, "verified", !o->host && b->verify_bad == 0 && b->unverified_runs == 0);
    json_num(j, "ceiling_gbs", b->ceiling_gbs);
    if (b->lb_gbs[0] > 0 || b->lb_gbs[1] > 0) {
        json_num(j, "loopback_stream_copy_gbs_dispatch", b->lb_gbs[0]);
        json_num(j, "loopback_stream_copy_gbs_combine", b->lb_gbs[1]);
    }
    if (!o->host) {
        json_num(j, "write_ceiling_gbs", b->ceil.write);
        json_num(j, "read_ceiling_gbs", b->ceil.read);
    }
}

/* Write the JSON report to stdout (--json) and/or the --json-file opened at start. */
static int report_json(const bench *b, const phase_row *ph, int n, const char *gpu_name,
                       int reached, void (*extra)(hep_json *, const void *), const void *ctx)
{
    FILE *fs[2] = {b->o.as_json ? stdout : NULL, b->json_out};
    for (int k = 0; k < 2; k++) {
        hep_json j;
        if (!fs[k])
            continue;
        json_begin(&j, fs[k]);
        json_obj(&j, NULL);
        json_head(&j, b, gpu_name, reached);
        json_arr(&j, "phases");
        for (int i = 0; i < n; i++)
            json_phase(&j, b, &ph[i], i);
        json_end_arr(&j);
        if (extra)
            extra(&j, ctx);
        json_end_obj(&j);
        json_finish(&j);
    }
    if (b->json_out && (ferror(b->json_out) | fclose(b->json_out)))
        return cli_fail("bench", 1, "writing --json-file '%s' failed", b->o.json_file);
    return 0;
}

static void report_text(const bench *b, const phase_row *ph, int n, const char *gpu_name,
                        int sm_count, int reached)
{
    const bench_opts *o = &b->o;
    if (o->host) {
        printf("\nhybridep bench: HOST backend (no GPU): %d virtual ranks as threads (%d node(s) "
               "x %d%s), H=%d T=%d E=%d (%d per rank, %d reached) K=%d %s, %s routing, seed %d, "
               "one dispatch + combine (CPU memcpy and adds: the reference implementation, not "
               "comparable to GPU figures)\n",
               b->W, o->nodes, o->R, o->nodes > 1 ? ", loopback NIC" : "", o->H, o->T,
               o->El * b->W, o->El, reached, o->K, b->esize == 1 ? "fp8" : "bf16",
               o->skew ? "skewed" : "uniform", o->seed);
        printf("host memcpy ceiling: %.0f GB/s (bytes read + written)\n", b->ceiling_gbs);
        printf("received rows: %.0f; fewest bytes of both phases: %.0f; wall time: %.1f ms "
               "(%.1f GB/s)\n",
               ph[0].rows, ph[0].bytes, ph[0].ms, gbs_of(&ph[0]));
        return;
    }
    printf("\nhybridep bench: GPU backend, %d virtual rank(s) on %s (%d SMs), H=%d T=%d "
           "E=%d (%d per rank, %d reached) K=%d %s, %s routing, seed %d, %d SMs per rank's "
           "kernel, %d iterations\n",
           b->W, gpu_name, sm_count, o->H, o->T, o->El * b->W, o->El, reached, o->K,
           b->esize == 1 ? "fp8" : "bf16", o->skew ? "skewed" : "uniform", o->seed, o->sms,
           o->iters);
    printf("ceiling: device-to-device copy %.0f GB/s (bytes read + written, median, same run)\n",
           b->ceiling_gbs);
    printf("         write-only (memset) %.0f GB/s, read-only (streaming read kernel) %.0f GB/s\n",
           b->ceil.write, b->ceil.read);
    printf("%-11s %10s %14s %11s %9s %8s %15s %9s %12s %8s\n", "phase", "rows", "fewest bytes",
           "median", "GB/s", "ceiling", "algbw/rank GB/s", "mix floor", "same-SM copy",
           "vs same");
    for (int i = 0; i < n; i++) {
        const phase_row *p = &ph[i];
        if (p->bytes == 0)
            printf("%-11s %10s %14s %8.1f us\n", p->name, "-", "-", p->ms * 1e3);
        else
            printf("%-11s %10.0f %14.0f %8.3f ms %9.0f %7.1f%% %15.1f %6.3f ms %9.3f ms %7.1f%%\n",
                   p->name, p->rows, p->bytes, p->ms, gbs_of(p),
                   100.0 * gbs_of(p) / b->ceiling_gbs, p->algbw_rank, floor_ms(b, p),
                   p->same_ms, 100.0 * p->same_ms / p->ms);
    }
    if (o->nodes > 1) { /* what crossed the (loopback) network */
        printf("network (%s NIC, %d nodes; per rank and call, medians' phase times):\n", b->nic,
               o->nodes);
        printf("%-11s %14s %10s %10s %12s %16s\n", "phase", "bytes sent", "GB/s", "writes",
               "writes/s", "ready->flag us");
        for (int k = 0; k < 2; k++) {
            const phase_row *pr = &ph[1 + k];
            double bytes, wrs, lat;
            net_per_call(b, k, &bytes, &wrs, &lat);
            printf("%-11s %14.0f %10.1f %10.1f %12.0f %16.1f\n", pr->name, bytes,
                   bytes / (pr->ms * 1e-3) / 1e9, wrs, wrs / (pr->ms * 1e-3), lat);
        }
        for (int k = 0; k < 2; k++)
            if (b->lb_gbs[k] > 0) {
                double bytes, wrs, lat;
                net_per_call(b, k, &bytes, &wrs, &lat);
                printf("loopback copies, %s: %d streams of %.1f MB at once (SMs idle) move "
                       "%.0f GB/s (read + written): %.3f ms for the phase's network bytes\n",
                       ph[1 + k].name, b->W, bytes / 1e6, b->lb_gbs[k],
                       2.0 * bytes * b->W / (b->lb_gbs[k] * 1e9) * 1e3);
            }
        printf("network bytes: rows, routing and scales (dispatch) or partial sums (combine) "
               "the proxy wrote to other nodes, counts and flags excluded; writes = work "
               "requests (data and flags); ready->flag = from a slot seen complete by the "
               "proxy to its flag's completion.%s\n",
               strcmp(b->nic, "loopback") ? ""
                                          : " The loopback NIC copies through this GPU's copy "
                                            "engine: these are not line-rate figures.");
    }
    printf("preprocess = the layout step inside the dispatch kernel (in-kernel timer), "
           "included in dispatch; times run from the last rank's launch to the last rank's "
           "end; GB/s counts the fewest bytes; algbw = received rows x row bytes / time; "
           "mix floor = the phase's reads at the read ceiling, writes at the write ceiling, "
           "or all at the copy ceiling, whichever is longest; same-SM copy = a plain copy "
           "kernel with the phase's blocks (ranks per GPU x SMs) over the phase's fewest "
           "bytes, and 'vs same' its time over the phase's\n");
}

/* Phase k of the expert-major part, as phase_ms: the median over iterations of the last
 * rank's end after the last rank's start. */
static double em_phase_ms(const bench *b, int k)
{
    float *per = malloc(sizeof(float) * (size_t)b->o.iters), med;
    if (!per)
        return NAN;
    for (int it = 0; it < b->o.iters; it++) {
        const int j = b->o.warmup + it;
        double last = -1e300, end = -1e300;
        for (int r = 0; r < b->W; r++) {
            last = b->em[r].s[k][j] > last ? b->em[r].s[k][j] : last;
            end = b->em[r].e[k][j] > end ? b->em[r].e[k][j] : end;
        }
        per[it] = (float)(end - last);
    }
    qsort(per, (size_t)b->o.iters, sizeof(float), cmp_f);
    med = per[b->o.iters / 2];
    free(per);
    return med;
}

/* The in-kernel layout step of the fresh expert-major dispatch, as phase_ms(b, 2) counts
 * the rank-major one: from the last rank's kernel start to the last rank's layout (the
 * launch skew of the host threads excluded), median over iterations, ms. */
static double em_layout_ms(const bench *b)
{
    float *per = malloc(sizeof(float) * (size_t)b->o.iters), med;
    if (!per)
        return NAN;
    for (int it = 0; it < b->o.iters; it++) {
        const int k = b->o.warmup + it;
        double last = -1e300, end = -1e300;
        for (int r = 0; r < b->W; r++) {
            last = b->em[r].lay_s[k] > last ? b->em[r].lay_s[k] : last;
            end = b->em[r].lay_e[k] > end ? b->em[r].lay_e[k] : end;
        }
        per[it] = (float)(end - last);
    }
    qsort(per, (size_t)b->o.iters, sizeof(float), cmp_f);
    med = per[b->o.iters / 2];
    free(per);
    return med;
}

typedef struct em_figures {
    double ms[EM_PHASES], layout_ms, rm_rows, em_rows, pad_rows, rows_ratio;
    double rm_dispatch_ms, rm_combine_ms, rm_layout_ms;
} em_figures;

static void em_figures_of(const bench *b, const phase_row *ph, em_figures *f)
{
    memset(f, 0, sizeof(*f));
    for (int k = 0; k < EM_PHASES; k++)
        f->ms[k] = em_phase_ms(b, k);
    f->layout_ms = em_layout_ms(b);
    f->rm_rows = ph[1].rows;
    f->em_rows = b->em_rows;
    for (int r = 0; r < b->W; r++)
        f->pad_rows += b->em[r].num_permuted;
    f->pad_rows -= b->em_rows;
    f->rows_ratio = f->rm_rows > 0 ? f->em_rows / f->rm_rows : NAN;
    f->rm_dispatch_ms = ph[1].ms;
    f->rm_combine_ms = ph[2].ms;
    f->rm_layout_ms = ph[0].ms;
}

static void em_report_text(const bench *b, const phase_row *ph)
{
    em_figures f;
    em_figures_of(b, ph, &f);
    printf("\nexpert-major layout (--pad-multiple %d, num_permuted_tokens %d a rank, nothing "
           "dropped), same run, verified against the host backend:\n", b->o.pad, b->em_budget);
    printf("rows: %.0f rank-major, %.0f expert-major (+%.0f of tokens on several local experts "
           "of one rank: x%.3f), %.0f padding rows\n", f.rm_rows, f.em_rows,
           f.em_rows - f.rm_rows, f.rows_ratio, f.pad_rows);
    printf("%-34s %10s %14s %22s\n", "phase", "median", "vs rank-major", "counting extra rows");
    printf("%-34s %7.3f ms %13.3fx %21.3fx\n", "dispatch (expert-major, fused)",
           f.ms[EM_DISPATCH], f.ms[EM_DISPATCH] / f.rm_dispatch_ms,
           f.ms[EM_DISPATCH] / f.rm_dispatch_ms / f.rows_ratio);
    printf("%-34s %7.3f ms %13.3fx %21.3fx\n", "combine (expert-major, fused)",
           f.ms[EM_COMBINE], f.ms[EM_COMBINE] / f.rm_combine_ms,
           f.ms[EM_COMBINE] / f.rm_combine_ms / f.rows_ratio);
    printf("%-34s %7.3f ms (the gather alone %.3f ms): the fused dispatch is %.2fx faster\n",
           "rank-major dispatch + gather", f.ms[EM_PAIR], f.ms[EM_GATHER],
           f.ms[EM_PAIR] / f.ms[EM_DISPATCH]);
    printf("%-34s %7.3f ms: %.1f us faster than the fresh one; its layout step %.1f us "
           "(rank-major: %.1f us)\n", "dispatch (expert-major, reused)", f.ms[EM_REUSE],
           (f.ms[EM_DISPATCH] - f.ms[EM_REUSE]) * 1e3, f.layout_ms * 1e3, f.rm_layout_ms * 1e3);
    printf("vs rank-major = the phase's median over the rank-major phase's of the same run; "
           "counting extra rows = that over the rows ratio (expert-major rows / rank-major "
           "rows)\n");
}

static const bench *em_json_bench;
static const phase_row *em_json_ph;
static void em_json(hep_json *j, const void *ctx)
{
    const bench *b = em_json_bench;
    em_figures f;
    (void)ctx;
    json_obj(j, "expert_major");
    json_int(j, "pad_multiple", b->o.pad);
    json_int(j, "num_permuted_tokens", b->em_budget);
    if (b->o.host) {
        double worst = 0;
        for (int r = 0; r < b->W; r++)
            worst = b->em[r].host_ms > worst ? b->em[r].host_ms : worst;
        json_num(j, "expert_rows", b->em_rows);
        json_num(j, "host_dispatch_combine_ms", worst);
        json_end_obj(j);
        return;
    }
    em_figures_of(b, em_json_ph, &f);
    json_num(j, "rank_major_rows", f.rm_rows);
    json_num(j, "expert_rows", f.em_rows);
    json_num(j, "extra_rows", f.em_rows - f.rm_rows);
    json_num(j, "padding_rows", f.pad_rows);
    json_num(j, "rows_ratio", f.rows_ratio);
    json_num(j, "dispatch_ms", f.ms[EM_DISPATCH]);
    json_num(j, "combine_ms", f.ms[EM_COMBINE]);
    json_num(j, "dispatch_vs_rank_major", f.ms[EM_DISPATCH] / f.rm_dispatch_ms);
    json_num(j, "combine_vs_rank_major", f.ms[EM_COMBINE] / f.rm_combine_ms);
    json_num(j, "dispatch_vs_rank_major_per_row", f.ms[EM_DISPATCH] / f.rm_dispatch_ms / f.rows_ratio);
    json_num(j, "combine_vs_rank_major_per_row", f.ms[EM_COMBINE] / f.rm_combine_ms / f.rows_ratio);
    json_num(j, "rank_major_dispatch_plus_gather_ms", f.ms[EM_PAIR]);
    json_num(j, "gather_ms", f.ms[EM_GATHER]);
    json_num(j, "fused_speedup_over_pair", f.ms[EM_PAIR] / f.ms[EM_DISPATCH]);
    json_num(j, "reused_dispatch_ms", f.ms[EM_REUSE]);
    json_num(j, "reuse_saves_ms", f.ms[EM_DISPATCH] - f.ms[EM_REUSE]);
    json_num(j, "layout_step_ms", f.layout_ms);
    json_bool(j, "verified", b->verify_bad == 0);
    json_end_obj(j);
}

/* The figures of one finished GPU run (threads joined). */
static void gpu_phases(bench *b, phase_row ph[3])
{
    double recv = 0, in_rows = 0, algd = 0, algc = 0;
    const double H = b->o.H, es = b->esize, K = b->o.K, El = b->o.El, ns = b->ns;
    for (int r = 0; r < b->W; r++) {
        recv += b->rd[r].num_recv;
        in_rows += b->rd[r].t;
        algd += (double)b->rd[r].num_recv * H * es;
        algc += (double)b->rd[r].num_recv * H * 2;
    }
    /* fewest bytes: each source row read once, each received row written once (+ routing,
     * probabilities, scales); combine: each received row read once, each output written */
    memset(ph, 0, sizeof(phase_row) * 3);
    ph[0] = (phase_row){"preprocess", 0, 0, phase_ms(b, 2), 0, 0, 0, 0, 0, 0};
    ph[1] = (phase_row){"dispatch", recv, 0, phase_ms(b, 0), 0,
                        in_rows * H * es + in_rows * K * 8 + (es == 1 ? in_rows * ns * 4 : 0),
                        recv * H * es + recv * El * 4 + (es == 1 ? recv * ns * 4 : 0), H * es, 0, 0};
    ph[1].bytes = ph[1].rbytes + ph[1].wbytes;
    ph[2] = (phase_row){"combine", recv, 0, phase_ms(b, 1), 0, recv * H * 2, in_rows * H * 2,
                        H * 2, 0, 0};
    ph[2].bytes = ph[2].rbytes + ph[2].wbytes;
    ph[1].algbw_rank = algd / b->W / (ph[1].ms * 1e-3) / 1e9;
    ph[2].algbw_rank = algc / b->W / (ph[2].ms * 1e-3) / 1e9;
}

/* One GPU run at S SMs per rank: time, verify, same-SM copies. 0 or an exit code. */
static int gpu_run(bench *b, int S, phase_row ph[3])
{
    char why[512];
    b->o.sms = S;
    b->cfg.dispatch_sms = b->cfg.combine_sms = S;
    b->verify_bad = 0;
    free_results(b);
    em_free(b);
    if (!b->o.as_json)
        fprintf(stderr, "[bench] %d SMs per rank: one checked call, then %d warm-up + %d timed "
                        "iterations\n", S, b->o.warmup, b->o.iters);
    if (run_threads(b, gpu_rank, "the GPU run"))
        return 1;
    if (run_threads(b, host_rank, "the host-backend verification"))
        return 1;
    b->unverified_runs += b->verify_bad && b->unverified;
    if (b->verify_bad && b->unverified)
        fprintf(stderr, "[bench] UNVERIFIED (HEP_BENCH_UNVERIFIED): the GPU output differs from "
                        "the host backend on %d rank(s); timings printed for a measurement "
                        "build only\n", b->verify_bad);
    else if (b->verify_bad)
        return cli_fail("bench", 1, "VERIFICATION FAILED on %d rank(s): the GPU output differs "
                        "from the host backend on the same inputs (seed %d)", b->verify_bad,
                        b->o.seed);
    gpu_phases(b, ph);
    for (int i = 1; i <= 2; i++)
        if (same_sm(b, S, &ph[i], why, sizeof(why)))
            return cli_fail("bench", 1, "the same-SM copy ceiling: %s", why);
    return 0;
}

typedef struct sweep_row {
    int S, blocks, skipped;
    char why[160];
    phase_row ph[3];
} sweep_row;

typedef struct sweep_ctx {
    const bench *b;
    const sweep_row *rows;
    int n;
} sweep_ctx;

static void json_sweep(hep_json *j, const void *p)
{
    const sweep_ctx *c = p;
    json_arr(j, "sweep");
    for (int i = 0; i < c->n; i++) {
        const sweep_row *r = &c->rows[i];
        json_obj(j, NULL);
        json_int(j, "sms_per_rank", r->S);
        json_int(j, "blocks", r->blocks);
        if (r->skipped) {
            json_str(j, "skipped", r->why);
        } else {
            json_num(j, "layout_ms", r->ph[0].ms);
            json_num(j, "dispatch_ms", r->ph[1].ms);
            json_num(j, "combine_ms", r->ph[2].ms);
            json_num(j, "same_sm_copy_dispatch_ms", r->ph[1].same_ms);
            json_num(j, "same_sm_copy_combine_ms", r->ph[2].same_ms);
            json_num(j, "dispatch_fraction_of_same_sm_copy", r->ph[1].same_ms / r->ph[1].ms);
            json_num(j, "combine_fraction_of_same_sm_copy", r->ph[2].same_ms / r->ph[2].ms);
            json_num(j, "dispatch_fraction_of_ceiling", gbs_of(&r->ph[1]) / c->b->ceiling_gbs);
            json_num(j, "combine_fraction_of_ceiling", gbs_of(&r->ph[2]) / c->b->ceiling_gbs);
        }
        json_end_obj(j);
    }
    json_end_arr(j);
}

static int sweep(bench *b, const char *gpu_name, int sm_count, int reached)
{
    static sweep_row rows[CLI_LIST_MAX];
    const int per_gpu = b->W / b->o.gpus > 0 ? b->W / b->o.gpus : 1;
    sweep_ctx ctx = {b, rows, b->o.sweep.n};
    for (int i = 0; i < b->o.sweep.n; i++) {
        sweep_row *r = &rows[i];
        memset(r, 0, sizeof(*r));
        r->S = b->o.sweep.v[i];
        r->blocks = per_gpu * r->S;
        if (r->blocks > sm_count) { /* co-dependent blocks must all be resident */
            r->skipped = 1;
            snprintf(r->why, sizeof(r->why), "%d ranks per GPU x %d SMs = %d blocks > the GPU's "
                     "%d SMs", per_gpu, r->S, r->blocks, sm_count);
            continue;
        }
        if (gpu_run(b, r->S, r->ph))
            return 1;
    }
    if (!b->o.as_json) {
        printf("\nhybridep bench --sweep-sms: %d virtual rank(s) on %s (%d SMs), H=%d T=%d E=%d "
               "K=%d %s, %s routing, seed %d; %s; whole-GPU copy ceiling %.0f GB/s\n", b->W,
               gpu_name, sm_count, b->o.H, b->o.T, b->o.El * b->W, b->o.K,
               b->esize == 1 ? "fp8" : "bf16", b->o.skew ? "skewed" : "uniform", b->o.seed,
               b->unverified_runs ? "UNVERIFIED runs (HEP_BENCH_UNVERIFIED): not every row equals "
                                    "the host backend's"
                                  : "every row verified against the host backend",
               b->ceiling_gbs);
        printf("%8s %7s %10s %12s %11s %13s %13s %10s %10s %9s %9s\n", "SMs/rank", "blocks",
               "layout ms", "dispatch ms", "combine ms", "copy(disp) ms", "copy(comb) ms",
               "disp/copy", "comb/copy", "disp/GPU", "comb/GPU");
        for (int i = 0; i < b->o.sweep.n; i++) {
            const sweep_row *r = &rows[i];
            if (r->skipped) {
                printf("%8d %7d skipped: %s\n", r->S, r->blocks, r->why);
                continue;
            }
            printf("%8d %7d %10.3f %12.3f %11.3f %13.3f %13.3f %9.1f%% %9.1f%% %8.1f%% %8.1f%%\n",
                   r->S, r->blocks, r->ph[0].ms, r->ph[1].ms, r->ph[2].ms, r->ph[1].same_ms,
                   r->ph[2].same_ms, 100 * r->ph[1].same_ms / r->ph[1].ms,
                   100 * r->ph[2].same_ms / r->ph[2].ms,
                   100 * gbs_of(&r->ph[1]) / b->ceiling_gbs, 100 * gbs_of(&r->ph[2]) / b->ceiling_gbs);
        }
        printf("copy(...) = a plain copy kernel with the row's blocks over the phase's fewest "
               "bytes; x/copy = its time over the phase's (100%% = as fast as a copy with the "
               "same SMs); x/GPU = the fraction of the whole GPU's copy ceiling\n");
    }
    return report_json(b, NULL, 0, gpu_name, reached, json_sweep, &ctx);
}

int hep_cmd_bench(int argc, char **argv)
{
    static bench b;
    phase_row ph[3];
    char gpu_name[300] = "the CPU", why[512];
    int sm_count = 0, rc, reached;

    memset(&b, 0, sizeof(b));
    b.unverified = getenv("HEP_BENCH_UNVERIFIED") && !strcmp(getenv("HEP_BENCH_UNVERIFIED"), "1");
    if ((rc = parse(argc, argv, &b.o)))
        return rc < 0 ? 0 : rc;
    b.W = b.o.R * b.o.nodes; /* <= BENCH_MAX_RANKS: checked in parse */
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
    b.cfg.chunk_tokens = b.o.chunk;
    if (hep_config_check(&b.cfg, b.W))
        return cli_fail("bench", 1, "invalid configuration: %s", hep_last_error());
    /* open the outputs first: a path that cannot be written fails before a long run */
    if (b.o.json_file && !(b.json_out = fopen(b.o.json_file, "w")))
        return cli_fail("bench", 2, "--json-file '%s' cannot be written: %s", b.o.json_file,
                        strerror(errno));
    b.rd = calloc((size_t)b.W, sizeof(rank_data));
    if (!b.rd)
        return cli_fail("bench", 1, "out of host memory");
    if (!b.o.as_json)
        fprintf(stderr, "[bench] generating %s routing for %d ranks x %d tokens (seed %d)\n",
                b.o.skew ? "skewed" : "uniform", b.W, b.o.T, b.o.seed);
    if (make_routing(&b))
        return cli_fail("bench", 1, "out of host memory for the inputs of %d ranks x %d tokens",
                        b.W, b.o.T);
    reached = experts_reached(&b);
    if (b.o.layout_em && em_plan(&b))
        return cli_fail("bench", 1, "out of host memory for the expert-major plan, or more than "
                        "2^31 rows a rank");
    em_json_bench = &b;
    em_json_ph = ph;
    if (b.o.dump) {
        FILE *f = fopen(b.o.dump, "wb");
        if (!f)
            return cli_fail("bench", 2, "--dump-routing '%s' cannot be written: %s", b.o.dump,
                            strerror(errno));
        if ((rc = dump_routing(&b, f)))
            return rc;
    }
    if (b.o.host) {
        double t0;
        if (!b.o.as_json)
            fprintf(stderr, "[bench] no GPU: timing the host backend (the reference "
                            "implementation)\n");
        b.ceiling_gbs = host_copy_ceiling();
        t0 = now_ms();
        if (run_threads(&b, host_rank, "the host backend"))
            return 1;
        memset(ph, 0, sizeof(ph));
        ph[0].name = "host d+c";
        ph[0].ms = now_ms() - t0;
        for (int r = 0; r < b.W; r++) { /* the same fewest bytes as the GPU phases, summed */
            double recv = b.rd[r].num_recv, t = b.rd[r].t;
            ph[0].rows += recv;
            ph[0].bytes += (recv + t) * b.o.H * (b.esize + 2) + t * b.o.K * 8 + recv * b.o.El * 4 +
                           (b.esize == 1 ? (t + recv) * b.ns * 4 : 0);
        }
        if (!b.o.as_json)
            report_text(&b, ph, 1, gpu_name, sm_count, reached);
        if (!b.o.as_json && b.o.layout_em) {
            double worst = 0;
            for (int r = 0; r < b.W; r++)
                worst = b.em[r].host_ms > worst ? b.em[r].host_ms : worst;
            printf("expert-major (--pad-multiple %d, num_permuted_tokens %d): %.0f rows; its "
                   "dispatch + combine (included above): %.1f ms on the slowest rank\n",
                   b.o.pad, b.em_budget, b.em_rows, worst);
        }
        return report_json(&b, ph, 1, gpu_name, reached, b.o.layout_em ? em_json : NULL, NULL);
    }
    {
        struct cudaDeviceProp p;
        cudaError_t e = cudaGetDeviceProperties(&p, 0);
        if (e != cudaSuccess)
            return cli_fail("bench", 1, "cudaGetDeviceProperties: %s", cudaGetErrorString(e));
        snprintf(gpu_name, sizeof(gpu_name), "%d x %s", b.o.gpus, p.name);
        sm_count = p.multiProcessorCount;
    }
    if (!b.o.as_json)
        fprintf(stderr, "[bench] measuring the device copy ceilings\n");
    if (ceil_whole_gpu(0, &b.ceil, why, sizeof(why)))
        return cli_fail("bench", 1, "the device copy ceiling: %s", why);
    b.ceiling_gbs = b.ceil.copy;
    if (b.o.sweep.n)
        return sweep(&b, gpu_name, sm_count, reached);
    if ((rc = gpu_run(&b, b.o.sms, ph)))
        return rc;
    if (b.o.nodes > 1 && !strcmp(b.nic, "loopback"))
        loopback_yardstick(&b);
    if (!b.o.as_json && b.verify_bad)
        printf("UNVERIFIED (HEP_BENCH_UNVERIFIED): the GPU output differs from the host backend "
               "on %d of %d ranks\n", b.verify_bad, b.W);
    else if (!b.o.as_json)
        printf("verified against the host backend: every received row, probability%s, count "
               "and combined element equal on all %d ranks\n",
               b.esize == 1 ? ", scale" : "", b.W);
    if (!b.o.as_json) {
        printf("host launch skew across the %d rank threads (median, excluded below): %.1f us\n",
               b.W, phase_ms(&b, 3) * 1e3);
        report_text(&b, ph, 3, gpu_name, sm_count, reached);
        if (b.o.layout_em)
            em_report_text(&b, ph);
    }
    return report_json(&b, ph, 3, gpu_name, reached, b.o.layout_em ? em_json : NULL, NULL);
}
