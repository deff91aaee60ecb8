#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"
#include "ep_case.h"
#include "ranks.h"

uint16_t bf16_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

hep_dispatch_args ep_case_args(const ep_case *c, int t, const void *tokens, const float *scales,
                               const void *idx, const float *weights, void *stream)
{
    hep_dispatch_args da;
    memset(&da, 0, sizeof(da));
    da.num_tokens = t;
    da.tokens = tokens;
    da.scales = c->cfg.dtype == HEP_DTYPE_FP8_E4M3 ? scales : NULL;
    da.topk_idx = idx;
    da.index_type = c->index64 ? HEP_INDEX_INT64 : HEP_INDEX_INT32;
    da.topk = c->K;
    da.topk_weights = weights;
    da.stream = stream;
    return da;
}

uint16_t ep_expert_value(int rank, int row, int h)
{
    float v = (float)((rank + 1) * 8 + (row % 13)) + (float)(h % 5) * 0.25f;
    if (h < 8) /* the hand-computed cases read these channels */
        return bf16_of(v);
    if ((row + h) % 11 == 0)
        return 0x8000; /* -0.0 */
    return bf16_of((row + h + rank) % 3 == 0 ? -v : v);
}

float f32_of_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static size_t esize(const ep_case *c)
{
    return c->cfg.dtype == HEP_DTYPE_FP8_E4M3 ? 1 : 2;
}

static long long id(const ep_case *c, int r, int i, int k)
{
    size_t o = (size_t)i * (size_t)c->K + (size_t)k;
    return c->index64 ? ((long long *)c->in[r].idx)[o] : ((int *)c->in[r].idx)[o];
}

int ep_case_dispatch(ep_case *c, ep_rank_out *o, hep_group *g, const hep_dispatch_args *da,
                     hep_dispatch_result *dr)
{
    o->rc_dispatch = hep_dispatch(g, da, dr);
    if (o->rc_dispatch)
        snprintf(o->err, sizeof(o->err), "%s", hep_last_error());
    if (o->rc_dispatch && o->rc_dispatch != HEP_WARN_IGNORED) { /* ignored input: go on */
        __atomic_add_fetch(&c->gave_up, 1, __ATOMIC_RELEASE);
        return 1;
    }
    return 0;
}

static int run_rank(rank_ctx *rc)
{
    ep_case *c = rc->arg;
    ep_rank_in *in = &c->in[rc->rank];
    ep_rank_out *o = &c->out[rc->rank];
    const int H = c->cfg.hidden, El = c->cfg.experts_per_rank;
    const size_t rb = (size_t)H * esize(c);
    hep_group *g = NULL;
    hep_dispatch_args da;
    hep_dispatch_result dr;
    hep_combine_args ca;
    int rc0 = hep_group_create(&c->cfg, &rc->bs, 0, &g);
    if (rc0) {
        o->rc_dispatch = rc0;
        snprintf(o->err, sizeof(o->err), "create: %s", hep_last_error());
        return rc0;
    }
    for (int rep = 0; rep < (c->repeat ? c->repeat : 1); rep++) {
        if (rc->rank == c->skip_rank) {
            /* this rank never calls dispatch; it joins destroy once the others gave up */
            for (int spin = 0; spin < 200000 && __atomic_load_n(&c->gave_up, __ATOMIC_ACQUIRE) <
                                                    c->world - 1;
                 spin++)
                usleep(100);
            break;
        }
        da = ep_case_args(c, in->t, in->tokens, in->scales, in->idx, in->weights, NULL);
        if (ep_case_dispatch(c, o, g, &da, &dr))
            break;
        o->num_recv = dr.num_recv;
        free(o->tokens), free(o->probs), free(o->scales), free(o->tpe), free(o->expert_out);
        free(o->combined);
        o->tpe = calloc((size_t)El, sizeof(int));
        memcpy(o->tpe, dr.host_counts + 1, (size_t)El * sizeof(int));
        o->tokens = malloc(rb * (size_t)dr.num_recv + 1);
        memcpy(o->tokens, dr.tokens, rb * (size_t)dr.num_recv);
        o->probs = malloc(sizeof(float) * (size_t)El * (size_t)dr.num_recv + 1);
        memcpy(o->probs, dr.probs, sizeof(float) * (size_t)El * (size_t)dr.num_recv);
        if (dr.scales) {
            size_t n = (size_t)(H / 128) * (size_t)dr.num_recv;
            o->scales = malloc(sizeof(float) * n + 1);
            memcpy(o->scales, dr.scales, sizeof(float) * n);
        }
        /* expert outputs: a function of the rank, the row and the channel */
        o->expert_out = malloc((size_t)H * 2 * (size_t)dr.num_recv + 16);
        for (int j = 0; j < dr.num_recv; j++)
            for (int h = 0; h < H; h++)
                o->expert_out[(size_t)j * H + h] = ep_expert_value(rc->rank, j, h);
        o->combined = malloc((size_t)H * 2 * (size_t)in->t + 16);
        memset(o->combined, 0xff, (size_t)H * 2 * (size_t)in->t); /* poison */
        memset(&ca, 0, sizeof(ca));
        ca.handle = dr.handle;
        ca.out = o->combined;
        if (c->zero_copy) {
            memcpy(hep_combine_input(g), o->expert_out, (size_t)H * 2 * (size_t)dr.num_recv);
            ca.expert_out = hep_combine_input(g);
        } else {
            ca.expert_out = o->expert_out;
        }
        if (c->clobber_ids) { /* the caller reuses its id buffer: combine must not care */
            size_t n = (size_t)in->t * (size_t)c->K, w = c->index64 ? 8 : 4;
            void *keep = malloc(n * w + 1);
            memcpy(keep, in->idx, n * w);
            for (size_t q = 0; q < n; q++)
                if (c->index64)
                    ((long long *)in->idx)[q] = c->clobber_ids - 1;
                else
                    ((int *)in->idx)[q] = c->clobber_ids - 1;
            rc->bs.barrier(rc->bs.ctx); /* every rank clobbered before any combines */
            o->rc_combine = hep_combine(g, &ca);
            memcpy(in->idx, keep, n * w);
            free(keep);
        } else {
            o->rc_combine = hep_combine(g, &ca);
        }
        if (o->rc_combine) {
            snprintf(o->err, sizeof(o->err), "%s", hep_last_error());
            break;
        }
    }
    hep_group_destroy(g);
    return 0;
}

int ep_case_run(ep_case *c)
{
    rank_ctx ctx[EP_MAX_RANKS];
    return run_ranks(c->world, run_rank, c, ctx);
}

void ep_case_free(ep_case *c)
{
    for (int r = 0; r < c->world; r++) {
        ep_rank_out *o = &c->out[r];
        free(c->in[r].tokens), free(c->in[r].scales), free(c->in[r].idx), free(c->in[r].weights);
        free(o->tokens), free(o->probs), free(o->scales), free(o->tpe), free(o->expert_out);
        free(o->combined);
    }
    memset(c->in, 0, sizeof(c->in));
    memset(c->out, 0, sizeof(c->out));
}

static unsigned lcg(unsigned *s)
{
    *s = *s * 1664525u + 1013904223u;
    return *s >> 8;
}

void ep_case_random(ep_case *c, unsigned seed, int skew)
{
    const int H = c->cfg.hidden, T = c->cfg.max_tokens, K = c->K;
    const int E = c->cfg.experts_per_rank * c->world;
    for (int r = 0; r < c->world; r++) {
        ep_rank_in *in = &c->in[r];
        in->t = c->has_t_fixed ? c->t_fixed : (int)(lcg(&seed) % (unsigned)(T + 1));
        in->tokens = malloc((size_t)(in->t + 1) * (size_t)H * esize(c));
        for (size_t b = 0; b < (size_t)in->t * (size_t)H * esize(c); b++)
            ((unsigned char *)in->tokens)[b] = (unsigned char)lcg(&seed);
        in->scales = malloc(sizeof(float) * (size_t)(in->t + 1) * (size_t)(H / 128 + 1));
        for (int j = 0; j < in->t * (H / 128); j++)
            in->scales[j] = (float)(lcg(&seed) % 1000) / 7.0f;
        in->idx = malloc((size_t)(in->t + 1) * (size_t)K * (c->index64 ? 8 : 4));
        in->weights = malloc(sizeof(float) * (size_t)(in->t + 1) * (size_t)K);
        for (int i = 0; i < in->t; i++)
            for (int k = 0; k < K; k++) {
                unsigned u = lcg(&seed);
                long long x = skew ? (long long)(u % 3 == 0 ? u % (unsigned)E
                                                            : u % (unsigned)c->cfg.experts_per_rank)
                                   : (long long)(u % (unsigned)E);
                if (skew == EP_ROUTE_NODES) { /* by token: own node only, every node, or any */
                    const int R = c->cfg.ranks_per_node ? c->cfg.ranks_per_node : c->world;
                    const unsigned En = (unsigned)(c->cfg.experts_per_rank * R);
                    const int mode = i % 3, nodes = c->world / R;
                    x = mode == 0   ? (long long)(r / R) * En + u % En
                        : mode == 1 ? (long long)(k % nodes) * En + u % En
                                    : (long long)(u % (unsigned)E);
                }
                if (u % 11 == 0)
                    x = -1;
                if (u % 17 == 0 && k > 0)
                    x = id(c, r, i, k - 1); /* a duplicate slot */
                if (c->index64)
                    ((long long *)in->idx)[(size_t)i * K + k] = x;
                else
                    ((int *)in->idx)[(size_t)i * K + k] = (int)x;
                in->weights[(size_t)i * K + k] = (float)(u % 1024) / 1024.0f;
            }
    }
}

static int routed_to(const ep_case *c, int s, int i, int d)
{
    for (int k = 0; k < c->K; k++) {
        long long x = id(c, s, i, k);
        if (x >= 0 && x / c->cfg.experts_per_rank == d)
            return 1;
    }
    return 0;
}

#define MISMATCH(...)                                                                            \
    do {                                                                                         \
        if (bad++ < 5)                                                                           \
            fprintf(stderr, __VA_ARGS__);                                                        \
    } while (0)

int ep_case_check(const ep_case *c)
{
    const int H = c->cfg.hidden, El = c->cfg.experts_per_rank, ns = H / 128;
    const size_t rb = (size_t)H * esize(c);
    int bad = 0;
    for (int d = 0; d < c->world; d++) {
        const ep_rank_out *o = &c->out[d];
        int row = 0, *tpe = calloc((size_t)El, sizeof(int));
        for (int s = 0; s < c->world; s++)
            for (int i = 0; i < c->in[s].t; i++) {
                if (!routed_to(c, s, i, d))
                    continue;
                if (row >= o->num_recv) {
                    row++;
                    continue;
                }
                if (memcmp(o->tokens + (size_t)row * rb,
                           (const unsigned char *)c->in[s].tokens + (size_t)i * rb, rb))
                    MISMATCH("rank %d row %d: token of (%d, %d) differs\n", d, row, s, i);
                for (int j = 0; j < El; j++) {
                    float p = 0;
                    int hit = 0;
                    for (int k = 0; k < c->K; k++)
                        if (id(c, s, i, k) == (long long)d * El + j) {
                            p += c->in[s].weights[(size_t)i * c->K + k];
                            hit = 1;
                        }
                    tpe[j] += hit;
                    if (o->probs[(size_t)row * El + j] != p)
                        MISMATCH("rank %d row %d expert %d: prob %g, expected %g\n", d, row, j,
                                 o->probs[(size_t)row * El + j], p);
                }
                if (c->cfg.dtype == HEP_DTYPE_FP8_E4M3 &&
                    memcmp(o->scales + (size_t)row * ns, c->in[s].scales + (size_t)i * ns,
                           sizeof(float) * (size_t)ns))
                    MISMATCH("rank %d row %d: scales of (%d, %d) differ\n", d, row, s, i);
                row++;
            }
        if (row != o->num_recv)
            MISMATCH("rank %d received %d rows, expected %d\n", d, o->num_recv, row);
        for (int j = 0; j < El && row == o->num_recv; j++)
            if (tpe[j] != o->tpe[j])
                MISMATCH("rank %d expert %d: %d tokens, expected %d\n", d, j, o->tpe[j], tpe[j]);
        free(tpe);
    }
    /* combine: for each source token, the f32 sum over destinations in rank order; the
     * row of (s, i) at d counts the tokens routed to d before it in [source][token] order */
    {
        int next[EP_MAX_RANKS] = {0};
        for (int s = 0; s < c->world; s++) {
            for (int i = 0; i < c->in[s].t; i++) {
                int rows[EP_MAX_RANKS];
                for (int d = 0; d < c->world; d++)
                    rows[d] = routed_to(c, s, i, d) ? next[d]++ : -1;
                for (int h = 0; h < H; h++) {
                    /* one node: every destination in f32, ascending; several nodes: the own
                     * node's share in f32, then each other node's partial sum (its
                     * destinations in f32, ascending) rounded to BF16, in node order */
                    int R = c->cfg.ranks_per_node > 0 ? c->cfg.ranks_per_node : c->world;
                    int own = s / R;
                    float acc = -0.0f; /* the identity of addition, as the backends */
                    for (int d = own * R; d < own * R + R; d++)
                        if (rows[d] >= 0)
                            acc += f32_of_bf16(c->out[d].expert_out[(size_t)rows[d] * H + h]);
                    for (int m = 0; m < c->world / R; m++) {
                        float part = -0.0f;
                        int any = 0;
                        if (m == own)
                            continue;
                        for (int d = m * R; d < m * R + R; d++)
                            if (rows[d] >= 0) {
                                part += f32_of_bf16(c->out[d].expert_out[(size_t)rows[d] * H + h]);
                                any = 1;
                            }
                        if (any)
                            acc += f32_of_bf16(bf16_of(part));
                    }
                    if (c->out[s].combined[(size_t)i * H + h] != bf16_of(acc)) {
                        MISMATCH("rank %d token %d channel %d: combined %g, expected %g\n", s, i,
                                 h, f32_of_bf16(c->out[s].combined[(size_t)i * H + h]), acc);
                        break;
                    }
                }
            }
        }
    }
    return bad;
}
