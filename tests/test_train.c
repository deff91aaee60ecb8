/* The training API on the host backend (hybridep.h, "the training API"): handles that the
 * caller keeps, outputs in caller memory, the expert-major layout with padding and a row
 * budget, probabilities through combine; each against an oracle computed here from the
 * global inputs. `test_train --gpu` checks what the GPU backend takes and refuses. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ep_case.h"
#include "fake_mr.h"
#include "group/group.h"
#include "ranks.h"

#define NW 4  /* ranks of the one-node cases */
#define MAXW 8 /* ranks of the largest case (2 x 4, 4 x 2) */
#define TH 128 /* hidden of the FP8 cases (one scale per row) */
#define NT 40 /* max tokens */
#define NK 4  /* slots */
#define EL 3  /* experts per rank */
#define NH 16 /* hidden */
#define EMPTY_EXPERT (2 * EL + 1) /* nobody routes here: an expert with no tokens */
#define BIG_BUDGET 1024

typedef struct tcase {
    hep_config cfg;
    int W, H, fp8, pad, budget;     /* ranks, hidden, FP8 tokens (H = TH), ... */
    size_t rb;                      /* bytes of a token row */
    int t[2][MAXW];                 /* routing set: tokens per rank */
    int ids[2][MAXW][NT * NK];      /* routing sets A (0) and B (1) */
    float w[2][MAXW][NT * NK];
    _Alignas(16) unsigned char tok[2][MAXW][NT * TH]; /* token sets: first dispatch (0), the
                                                         reuse (1); BF16 rows of NH or FP8 of TH */
    float sc[2][MAXW][NT];          /* FP8: each row's one scale */
    int bad[MAXW];
    char msg[MAXW][256];
} tcase;

static unsigned lcg(unsigned *s)
{
    *s = *s * 1664525u + 1013904223u;
    return *s >> 8;
}

/* Routing set a: random slots, some -1, some repeated; rank 0's token 0 chooses every
 * expert of rank 1; nobody chooses EMPTY_EXPERT. W ranks, ranks_per_node of them a node
 * (0: one node); chunk: config.chunk_tokens (the inter-node rings). */
static void make_case_of(tcase *c, int W, int ranks_per_node, int chunk, int fp8, int pad,
                         int budget, unsigned seed)
{
    memset(c, 0, sizeof(*c));
    c->W = W;
    c->fp8 = fp8;
    c->H = fp8 ? TH : NH;
    c->rb = (size_t)c->H * (fp8 ? 1 : 2);
    c->cfg = test_config(c->H, NT, EL, NK, fp8 ? HEP_DTYPE_FP8_E4M3 : HEP_DTYPE_BF16);
    c->cfg.backend = HEP_BACKEND_HOST;
    c->cfg.ranks_per_node = ranks_per_node;
    if (chunk)
        c->cfg.chunk_tokens = chunk;
    c->pad = pad;
    c->budget = budget;
    for (int a = 0; a < 2; a++)
        for (int r = 0; r < W; r++) {
            c->t[a][r] = a == 0 ? NT - 3 * r : 5 + (int)(lcg(&seed) % (NT - 5));
            for (int i = 0; i < NT; i++)
                for (int k = 0; k < NK; k++) {
                    unsigned u = lcg(&seed);
                    int x = u % 7 == 0 ? -1 : (int)(u % (unsigned)(W * EL));
                    if (k > 0 && u % 5 == 0)
                        x = c->ids[a][r][i * NK + k - 1]; /* a repeated expert */
                    c->ids[a][r][i * NK + k] = x == EMPTY_EXPERT ? -1 : x;
                    c->w[a][r][i * NK + k] = (float)(1 + lcg(&seed) % 64) / 64.0f;
                }
            for (int i = 0; i < NT * c->H; i++) {
                uint16_t v = bf16_of((float)(lcg(&seed) % 200));
                if (fp8) /* bytes that are never decoded: any value will do */
                    c->tok[a][r][i] = (unsigned char)(lcg(&seed) & 0xff);
                else
                    memcpy(&c->tok[a][r][2 * (size_t)i], &v, 2);
            }
            for (int i = 0; i < NT; i++)
                c->sc[a][r][i] = (float)(1 + lcg(&seed) % 1000) / 8.0f;
        }
    for (int k = 0; k < NK; k++) /* rank 0, token 0: every local expert of rank 1 */
        c->ids[0][0][k] = k < EL ? EL + k : -1;
    for (int k = 0; ranks_per_node && k < NK; k++) /* token 1: those of the last node's last */
        c->ids[0][0][NK + k] = k < EL ? (W - 1) * EL + k : -1;
}

static void make_case(tcase *c, int ranks_per_node, int pad, int budget, unsigned seed)
{
    make_case_of(c, NW, ranks_per_node, 0, 0, pad, budget, seed);
}

static int chooses(const tcase *c, int a, int s, int i, int x)
{
    for (int k = 0; k < NK; k++)
        if (c->ids[a][s][i * NK + k] == x)
            return 1;
    return 0;
}
static float weight(const tcase *c, int a, int s, int i, int x)
{
    float p = 0;
    for (int k = 0; k < NK; k++)
        if (c->ids[a][s][i * NK + k] == x)
            p += c->w[a][s][i * NK + k];
    return p;
}
static int needs(const tcase *c, int a, int s, int i, int d)
{
    for (int e = 0; e < EL; e++)
        if (chooses(c, a, s, i, d * EL + e))
            return 1;
    return 0;
}

/* Oracle of rank d's expert-major layout of routing a: pos[s][i][e] (-1: not chosen), the
 * padded block starts, the padded total and the token rows at or past the budget. */
typedef struct em_layout {
    int pos[MAXW][NT][EL], cnt[EL], start[EL], total, dropped;
} em_layout;

static void em_oracle(const tcase *c, int a, int d, em_layout *L)
{
    memset(L, 0, sizeof(*L));
    memset(L->pos, 0xff, sizeof(L->pos));
    for (int e = 0; e < EL; e++) {
        L->start[e] = L->total;
        for (int s = 0; s < c->W; s++)
            for (int i = 0; i < c->t[a][s]; i++)
                if (chooses(c, a, s, i, d * EL + e)) {
                    L->pos[s][i][e] = L->total + L->cnt[e]++;
                    L->dropped += L->pos[s][i][e] >= c->budget;
                }
        L->total += (L->cnt[e] + c->pad - 1) / c->pad * c->pad;
    }
}
/* Oracle of rank d's rank-major row of (s, i), or -1. */
static int rm_row(const tcase *c, int a, int d, int s, int i)
{
    int j = 0;
    for (int s2 = 0; s2 < c->W; s2++)
        for (int i2 = 0; i2 < c->t[a][s2]; i2++) {
            if (s2 == s && i2 == i)
                return needs(c, a, s, i, d) ? j : -1;
            j += needs(c, a, s2, i2, d);
        }
    return -1;
}

/* What rank d's experts return for row p, and the probability it sends back. */
static uint16_t out_val(int d, int p)
{
    return bf16_of((float)(d + 1 + p % 5));
}
static float prob_val(int d, int p)
{
    return (float)(1000 * (d + 1) + p);
}

#define BAD(c, r, ...)                                                                           \
    do {                                                                                         \
        if (!(c)->bad[r]++)                                                                      \
            snprintf((c)->msg[r], sizeof((c)->msg[r]), __VA_ARGS__);                             \
    } while (0)

static void check_em(tcase *c, int r, int a, int q, const unsigned char *tok, const float *prob,
                     const float *scale, const hep_dispatch_opts *x)
{
    em_layout L;
    em_oracle(c, a, r, &L);
    if (x->num_permuted != (L.total < c->budget ? L.total : c->budget) ||
        x->overflow != (L.total > c->budget) || x->overflow_rows != L.dropped)
        BAD(c, r, "rank %d: num_permuted %d overflow %d/%d, oracle %d (budget %d) %d", r,
            x->num_permuted, x->overflow, x->overflow_rows, L.total, c->budget, L.dropped);
    for (int e = 0; e < EL; e++) {
        int end = L.start[e] + (L.cnt[e] + c->pad - 1) / c->pad * c->pad;
        int clip = end <= c->budget ? end - L.start[e]
                   : L.start[e] < c->budget ? c->budget - L.start[e] : 0;
        if (!x->tokens_per_expert || x->tokens_per_expert[e] != clip)
            BAD(c, r, "rank %d: tokens_per_expert[%d] wrong (oracle %d)", r, e, clip);
        for (int p = L.start[e] + L.cnt[e]; p < end && p < c->budget; p++)
            for (size_t h = 0; h < c->rb; h++)
                if (tok[(size_t)p * c->rb + h] != 0 || prob[p] != 0 || (c->fp8 && scale[p] != 0))
                    BAD(c, r, "rank %d: padding row %d of expert %d not zero", r, p, e);
    }
    for (int s = 0; s < c->W; s++)
        for (int i = 0; i < c->t[a][s]; i++)
            for (int e = 0; e < EL; e++) {
                int p = L.pos[s][i][e];
                if (p < 0 || p >= c->budget)
                    continue;
                if (memcmp(tok + (size_t)p * c->rb, &c->tok[q][s][(size_t)i * c->rb], c->rb))
                    BAD(c, r, "rank %d: row %d (rank %d token %d expert %d) wrong", r, p, s, i, e);
                if (c->fp8 && scale[p] != c->sc[q][s][i])
                    BAD(c, r, "rank %d: scale of row %d is %g, oracle %g", r, p, scale[p],
                        c->sc[q][s][i]);
                if (prob[p] != weight(c, a, s, i, r * EL + e))
                    BAD(c, r, "rank %d: prob of row %d is %g", r, p, prob[p]);
            }
}

static void check_rm(tcase *c, int r, int a, const void *tokv, const float *prob,
                     const float *scale, int rows)
{
    const unsigned char *tok = tokv;
    int j = 0;
    for (int s = 0; s < c->W; s++)
        for (int i = 0; i < c->t[a][s]; i++) {
            if (!needs(c, a, s, i, r))
                continue;
            if (memcmp(tok + (size_t)j * c->rb, &c->tok[0][s][(size_t)i * c->rb], c->rb))
                BAD(c, r, "rank %d: rank-major row %d wrong", r, j);
            if (c->fp8 && (!scale || scale[j] != c->sc[0][s][i]))
                BAD(c, r, "rank %d: rank-major scale %d wrong", r, j);
            for (int e = 0; e < EL; e++)
                if (prob[j * EL + e] != weight(c, a, s, i, r * EL + e))
                    BAD(c, r, "rank %d: rank-major prob [%d][%d] wrong", r, j, e);
            j++;
        }
    if (j != rows)
        BAD(c, r, "rank %d: %d rows received, oracle %d", r, rows, j);
}

/* Combine oracle for rank s of routing a: every destination's rows (expert-major at the
 * oracle's positions, or rank-major rows), summed; probabilities back per expert slot. */
static void check_combine(tcase *c, int s, int a, int em, const uint16_t *out, const float *pout)
{
    for (int i = 0; i < c->t[a][s]; i++) {
        float acc[TH];
        const size_t E = (size_t)c->W * EL;
        for (int h = 0; h < c->H; h++)
            acc[h] = -0.0f; /* a token with no rows comes back as -0.0 (hybridep.h) */
        for (int d = 0; d < c->W; d++) {
            em_layout L;
            int j = rm_row(c, a, d, s, i);
            if (em)
                em_oracle(c, a, d, &L);
            for (int e = 0; e < EL; e++) {
                float want = 0;
                int x = d * EL + e;
                if (chooses(c, a, s, i, x)) {
                    int p = em ? L.pos[s][i][e] : j;
                    if (!em || p < c->budget) {
                        for (int h = 0; em && h < c->H; h++)
                            acc[h] += f32_of_bf16(out_val(d, p));
                        want = em ? prob_val(d, p) : prob_val(d, j * EL + e);
                    }
                }
                if (pout && memcmp(&pout[(size_t)i * E + (size_t)x], &want, sizeof(want)))
                    BAD(c, s, "rank %d: probs_out[%d][%d] = %g, oracle %g (bits differ)", s, i,
                        x, pout[(size_t)i * E + (size_t)x], want);
            }
            for (int h = 0; !em && j >= 0 && h < c->H; h++)
                acc[h] += f32_of_bf16(out_val(d, j));
        }
        for (int h = 0; h < c->H; h++)
            if (out[(size_t)i * c->H + h] != bf16_of(acc[h]))
                BAD(c, s, "rank %d: combined token %d channel %d = %g, oracle %g", s, i, h,
                    f32_of_bf16(out[(size_t)i * c->H + h]), acc[h]);
    }
}

static void dispatch_args(tcase *c, int r, int a, int q, hep_dispatch_args *da)
{
    memset(da, 0, sizeof(*da));
    da->num_tokens = c->t[a][r];
    da->tokens = c->tok[q][r];
    da->scales = c->fp8 ? c->sc[q][r] : NULL;
    da->topk_idx = c->ids[a][r];
    da->index_type = HEP_INDEX_INT32;
    da->topk = NK;
    da->topk_weights = c->w[a][r];
}

/* Combine with handle h (rows rows of layout em) and check against the oracle. */
static void combine_and_check(tcase *c, hep_group *g, int r, int a, int em, hep_handle *h,
                              int rows, int probs)
{
    hep_combine_args ca;
    hep_combine_opts co;
    const size_t H = (size_t)c->H, E = (size_t)c->W * EL;
    uint16_t *eo = malloc(sizeof(uint16_t) * (size_t)(rows + 1) * H);
    uint16_t *out = malloc(sizeof(uint16_t) * NT * H);
    float *pin = malloc(sizeof(float) * (size_t)(rows + 1) * EL);
    float *pout = malloc(sizeof(float) * NT * E);
    int rc;
    for (int p = 0; p < rows; p++)
        for (size_t h2 = 0; h2 < H; h2++)
            eo[(size_t)p * H + h2] = out_val(r, p);
    for (int p = 0; p < rows * (em ? 1 : EL); p++)
        pin[p] = prob_val(r, p);
    memset(out, 0xff, sizeof(uint16_t) * NT * H);
    memset(pout, 0xff, sizeof(float) * NT * E);
    memset(&ca, 0, sizeof(ca));
    memset(&co, 0, sizeof(co));
    ca.expert_out = eo;
    ca.out = out;
    co.handle = h;
    co.probs_in = probs ? pin : NULL;
    co.probs_out = probs ? pout : NULL;
    rc = hep_combine_ex(g, &ca, &co);
    if (rc)
        BAD(c, r, "rank %d: combine: %d %s", r, rc, hep_last_error());
    else
        check_combine(c, r, a, em, out, probs ? pout : NULL);
    free(eo), free(out), free(pin), free(pout);
}

/* Two handles: A expert-major, B rank-major into caller memory; combines in the other
 * order, a dispatch that reuses A with new tokens, A combined twice more, then the
 * one-shot flow of hep_dispatch / hep_combine. */
static int interleaved(rank_ctx *rx)
{
    tcase *c = rx->arg;
    const int r = rx->rank, probs = 1;
    const size_t B = (size_t)c->budget, M = (size_t)c->W * NT, H = (size_t)c->H, rb = c->rb;
    const size_t sb = c->fp8 ? sizeof(float) : 0; /* scale bytes of a row */
    hep_group *g = NULL;
    hep_handle *ha = NULL, *hb = NULL;
    hep_dispatch_args da;
    hep_dispatch_opts xa, xb;
    hep_dispatch_result dr;
    unsigned char *ta = malloc(B * rb), *tb = malloc(M * rb);
    float *pa = malloc(B * 4), *pb = malloc(M * EL * 4), *sa = malloc(B * 4), *sbuf = malloc(M * 4);
    int rc = hep_group_create(&c->cfg, &rx->bs, 0, &g), rows_b = 0, em_rows = 0;
    if (rc == 0)
        rc = hep_handle_create(g, &ha);
    if (rc == 0)
        rc = hep_handle_create(g, &hb);
    if (rc) {
        BAD(c, r, "rank %d: create: %s", r, hep_last_error());
        goto out;
    }
    memset(ta, 0xff, B * rb), memset(pa, 0xff, B * 4); /* poison: padding must be written */
    memset(sa, 0xff, B * 4);
    dispatch_args(c, r, 0, 0, &da);
    memset(&xa, 0, sizeof(xa));
    xa.handle = ha;
    xa.layout = HEP_LAYOUT_EXPERT_MAJOR;
    xa.pad_multiple = c->pad;
    xa.num_permuted_tokens = c->budget;
    xa.recv_tokens = ta;
    xa.recv_probs = pa;
    xa.recv_scales = c->fp8 ? sa : NULL;
    if ((rc = hep_dispatch_ex(g, &da, &xa, &dr))) {
        BAD(c, r, "rank %d: dispatch A: %s", r, hep_last_error());
        goto out;
    }
    check_em(c, r, 0, 0, ta, pa, sa, &xa);
    if (dr.handle != 0)
        BAD(c, r, "rank %d: a dispatch into a handle returned one-shot handle %llu", r,
            (unsigned long long)dr.handle);
    if (xa.copy_bytes != (size_t)xa.num_permuted * (rb + 4 + sb))
        BAD(c, r, "rank %d: copy_bytes %zu for %d rows", r, xa.copy_bytes, xa.num_permuted);
    em_rows = xa.num_permuted;
    dispatch_args(c, r, 1, 0, &da);
    memset(&xb, 0, sizeof(xb));
    xb.handle = hb;
    xb.recv_tokens = tb;
    xb.recv_probs = pb;
    xb.recv_scales = c->fp8 ? sbuf : NULL;
    if ((rc = hep_dispatch_ex(g, &da, &xb, &dr))) {
        BAD(c, r, "rank %d: dispatch B: %s", r, hep_last_error());
        goto out;
    }
    rows_b = dr.num_recv;
    check_rm(c, r, 1, tb, pb, sbuf, rows_b);
    if (dr.tokens != tb || xb.copy_bytes != (size_t)rows_b * (rb + EL * 4 + sb))
        BAD(c, r, "rank %d: the rank-major copy: tokens %p (caller %p), %zu bytes", r, dr.tokens,
            (void *)tb, xb.copy_bytes);
    combine_and_check(c, g, r, 1, 0, hb, rows_b, probs);
    combine_and_check(c, g, r, 0, 1, ha, c->budget, probs);
    /* the backward: dispatch again with A's layout, new tokens, no routing input */
    dispatch_args(c, r, 0, 1, &da);
    da.topk_idx = NULL;
    da.topk_weights = NULL;
    da.topk = 0;
    da.flags = HEP_REUSE_LAYOUT;
    memset(ta, 0xff, B * rb), memset(pa, 0xff, B * 4), memset(sa, 0xff, B * 4);
    if ((rc = hep_dispatch_ex(g, &da, &xa, &dr))) {
        BAD(c, r, "rank %d: dispatch reusing A: %s", r, hep_last_error());
        goto out;
    }
    check_em(c, r, 0, 1, ta, pa, sa, &xa);
    if (xa.num_permuted != em_rows)
        BAD(c, r, "rank %d: the reuse laid out %d rows, A %d", r, xa.num_permuted, em_rows);
    combine_and_check(c, g, r, 0, 1, ha, c->budget, probs);
    combine_and_check(c, g, r, 0, 1, ha, c->budget, 0);
    combine_and_check(c, g, r, 1, 0, hb, rows_b, 0); /* B still combines after all that */
    {   /* the one-shot flow, unchanged */
        hep_combine_args ca;
        uint16_t *eo = malloc(M * H * 2), *out2 = malloc(NT * H * 2);
        dispatch_args(c, r, 1, 0, &da);
        rc = hep_dispatch(g, &da, &dr);
        if (rc || dr.handle == 0) {
            BAD(c, r, "rank %d: one-shot dispatch: %s", r, hep_last_error());
        } else {
            check_rm(c, r, 1, dr.tokens, dr.probs, dr.scales, dr.num_recv);
            for (int p = 0; p < dr.num_recv; p++)
                for (size_t h = 0; h < H; h++)
                    eo[(size_t)p * H + h] = out_val(r, p);
            memset(&ca, 0, sizeof(ca));
            ca.handle = dr.handle;
            ca.expert_out = eo;
            ca.out = out2;
            if ((rc = hep_combine(g, &ca)))
                BAD(c, r, "rank %d: one-shot combine: %s", r, hep_last_error());
            else
                check_combine(c, r, 1, 0, out2, NULL);
            if (hep_combine(g, &ca) != HEP_ERR_INVALID) /* once, as before */
                BAD(c, r, "rank %d: a one-shot handle combined twice", r);
        }
        /* the one-shot layout with probabilities through hep_combine_ex and no handle (it
         * used to reach the host backend as a NULL layout) */
        rc = hep_dispatch(g, &da, &dr);
        if (rc || dr.handle == 0) {
            BAD(c, r, "rank %d: one-shot dispatch: %s", r, hep_last_error());
        } else if (probs) {
            hep_combine_opts co;
            float *pin = malloc(sizeof(float) * (size_t)(dr.num_recv + 1) * EL);
            float *pout = malloc(sizeof(float) * M * EL);
            for (int p = 0; p < dr.num_recv; p++)
                for (size_t h = 0; h < H; h++)
                    eo[(size_t)p * H + h] = out_val(r, p);
            for (int p = 0; p < dr.num_recv * EL; p++)
                pin[p] = prob_val(r, p);
            memset(&co, 0, sizeof(co));
            co.probs_in = pin;
            co.probs_out = pout;
            memset(&ca, 0, sizeof(ca));
            ca.handle = dr.handle;
            ca.expert_out = eo;
            ca.out = out2;
            if ((rc = hep_combine_ex(g, &ca, &co)))
                BAD(c, r, "rank %d: one-shot combine with probabilities: %s", r,
                    hep_last_error());
            else
                check_combine(c, r, 1, 0, out2, pout);
            free(pin), free(pout);
        } else { /* the one-shot layout still wants its combine */
            memset(&ca, 0, sizeof(ca));
            ca.handle = dr.handle;
            ca.expert_out = eo;
            ca.out = out2;
            if ((rc = hep_combine(g, &ca)))
                BAD(c, r, "rank %d: one-shot combine: %s", r, hep_last_error());
        }
        free(eo), free(out2);
    }
out:
    hep_handle_destroy(ha);
    hep_handle_destroy(hb);
    hep_group_destroy(g);
    free(ta), free(tb), free(pa), free(pb), free(sa), free(sbuf);
    return 0;
}

static void run_tcase(tcase *c)
{
    rank_ctx ctx[MAXW];
    assert_int_equal(run_ranks(c->W, interleaved, c, ctx), 0);
    for (int r = 0; r < c->W; r++)
        if (c->bad[r])
            fail_msg("%d mismatches; first: %s", c->bad[r], c->msg[r]);
}

static void run_case(int ranks_per_node, int pad, int budget)
{
    static tcase c;
    rank_ctx ctx[NW];
    make_case(&c, ranks_per_node, pad, budget, 1234u + (unsigned)pad);
    assert_int_equal(run_ranks(NW, interleaved, &c, ctx), 0);
    for (int r = 0; r < NW; r++)
        if (c.bad[r])
            fail_msg("%d mismatches; first: %s", c.bad[r], c.msg[r]);
}

static void expert_major_pad_1_matches_oracle(void **s)
{
    (void)s;
    run_case(0, 1, BIG_BUDGET);
}
static void expert_major_pad_16_matches_oracle(void **s)
{
    (void)s;
    run_case(0, 16, BIG_BUDGET);
}
static void expert_major_pad_64_matches_oracle(void **s)
{
    (void)s;
    run_case(0, 64, BIG_BUDGET);
}
static void expert_major_pad_128_matches_oracle(void **s)
{
    (void)s;
    run_case(0, 128, BIG_BUDGET);
}
static void expert_major_budget_overflow_drops_last_rows(void **s)
{
    (void)s;
    run_case(0, 16, 48);
}
static void expert_major_across_two_nodes_matches_oracle(void **s)
{
    (void)s;
    run_case(2, 16, BIG_BUDGET);
}

/* Across virtual nodes (loopback NIC): N x R ranks, rings of chunks of 1 or 3 tokens
 * (slots of 2 or 6 rows, fewer than the tokens a slot carries, so every ring wraps),
 * pad_multiple 1 and 16, a budget that drops rows, BF16 and FP8 (rows with their scales);
 * both layouts, probabilities through combine compared bit for bit with the oracle. */
static void across_nodes(int N, int R, int chunk, int fp8, int pad, int budget)
{
    static tcase c;
    hep_plan_info info;
    int most = 0;
    make_case_of(&c, N * R, R, chunk, fp8, pad, budget, 77u * (unsigned)(N + 3 * R + chunk) + 5u);
    assert_int_equal(hep_plan_query(&c.cfg, N, R, &info), HEP_OK);
    assert_int_equal(info.chunk_tokens, chunk);
    for (int s = 0; s < c.W; s++) { /* the most tokens of one rank that need the last node */
        int n = 0;
        for (int i = 0; i < c.t[0][s]; i++) {
            int any = 0;
            for (int d = (N - 1) * R; d < N * R; d++)
                any |= needs(&c, 0, s, i, d);
            n += any;
        }
        most = n > most ? n : most;
    }
    assert_true(info.slot_tokens < (size_t)most); /* some ring wraps */
    run_tcase(&c);
}

/* The cases across virtual nodes: N x R, ring chunk, FP8, pad_multiple, budget. */
typedef struct nodes_case {
    int N, R, chunk, fp8, pad, budget;
} nodes_case;

static void probs_across_nodes(void **s)
{
    const nodes_case *c = *s;
    across_nodes(c->N, c->R, c->chunk, c->fp8, c->pad, c->budget);
}

static nodes_case nodes_cases[] = {
    {2, 2, 1, 0, 1, BIG_BUDGET}, /* probs_2x2_chunk_1_pad_1_match_oracle */
    {2, 2, 3, 0, 16, BIG_BUDGET}, /* probs_2x2_chunk_3_pad_16_match_oracle */
    {2, 4, 1, 0, 16, BIG_BUDGET}, /* probs_2x4_chunk_1_pad_16_match_oracle */
    {2, 4, 3, 0, 1, BIG_BUDGET}, /* probs_2x4_chunk_3_pad_1_match_oracle */
    {4, 2, 3, 0, 16, BIG_BUDGET}, /* probs_4x2_chunk_3_pad_16_match_oracle */
    {4, 2, 1, 0, 1, BIG_BUDGET}, /* probs_4x2_chunk_1_pad_1_match_oracle */
    {2, 4, 3, 0, 16, 48}, /* probs_2x4_budget_overflow_drops_last_rows */
    {2, 2, 3, 1, 16, BIG_BUDGET}, /* probs_fp8_2x2_chunk_3_pad_16_match_oracle */
    {2, 4, 1, 1, 16, BIG_BUDGET}, /* probs_fp8_2x4_chunk_1_pad_16_match_oracle */
    {4, 2, 1, 1, 1, BIG_BUDGET}, /* probs_fp8_4x2_chunk_1_pad_1_match_oracle */
};

/* The oracle itself sees what the cases claim to cover. */
static void cases_cover_empty_expert_every_expert_and_overflow(void **s)
{
    static tcase c;
    em_layout L;
    (void)s;
    make_case(&c, 0, 16, 48, 1234u + 16);
    em_oracle(&c, 0, 2, &L);
    assert_int_equal(L.cnt[EMPTY_EXPERT - 2 * EL], 0);
    em_oracle(&c, 0, 1, &L);
    for (int e = 0; e < EL; e++)
        assert_true(L.pos[0][0][e] >= 0);
    assert_true(L.dropped > 0);
    make_case_of(&c, 8, 4, 3, 0, 16, 48, 1);
    em_oracle(&c, 0, 7, &L); /* rank 0's token 1: every expert of the last node's last rank */
    for (int e = 0; e < EL; e++)
        assert_true(L.pos[0][1][e] >= 0);
}

/* FP8: expert-major rows carry their source row's bytes and its H / 128 scales, padding
 * zero. 2 ranks, H = 256, every token of rank r on expert 0 of rank (r + 1) % 2 and on
 * expert 1 of rank r. */
#define FH 256
typedef struct fp8_case {
    int bad[2];
    char msg[2][256];
} fp8_case;

static int fp8_rank(rank_ctx *rx)
{
    fp8_case *c = rx->arg;
    const int r = rx->rank, t = 5, pad = 4, budget = 32;
    hep_config cfg = test_config(FH, 8, 2, 2, HEP_DTYPE_FP8_E4M3);
    unsigned char tok[8 * FH], rows[32 * FH];
    float sc[8 * 2], rs[32 * 2], rp[32], w[8 * 2];
    int ids[8 * 2];
    hep_group *g = NULL;
    hep_handle *h = NULL;
    hep_dispatch_args da;
    hep_dispatch_opts x;
    hep_dispatch_result dr;
    cfg.backend = HEP_BACKEND_HOST;
    for (int i = 0; i < t; i++) {
        ids[i * 2] = ((r + 1) % 2) * 2;
        ids[i * 2 + 1] = r * 2 + 1;
        w[i * 2] = w[i * 2 + 1] = 0.5f;
        sc[i * 2] = (float)(100 * r + i), sc[i * 2 + 1] = (float)(100 * r + i) + 0.5f;
        for (int b = 0; b < FH; b++)
            tok[i * FH + b] = (unsigned char)(r * 50 + i * 7 + b);
    }
    memset(rows, 0xff, sizeof(rows)), memset(rs, 0xff, sizeof(rs)), memset(rp, 0xff, sizeof(rp));
    if (hep_group_create(&cfg, &rx->bs, 0, &g) || hep_handle_create(g, &h)) {
        BAD(c, r, "create: %s", hep_last_error());
        goto out;
    }
    memset(&da, 0, sizeof(da));
    da.num_tokens = t, da.tokens = tok, da.scales = sc, da.topk_idx = ids, da.topk = 2;
    da.topk_weights = w;
    memset(&x, 0, sizeof(x));
    x.handle = h, x.layout = HEP_LAYOUT_EXPERT_MAJOR, x.pad_multiple = pad;
    x.num_permuted_tokens = budget, x.recv_tokens = rows, x.recv_probs = rp, x.recv_scales = rs;
    if (hep_dispatch_ex(g, &da, &x, &dr)) {
        BAD(c, r, "dispatch: %s", hep_last_error());
        goto out;
    }
    /* expert 0: the other rank's 5 tokens (rows 0..4, 5..7 padding); expert 1: my 5 (8..12) */
    if (x.num_permuted != 16 || x.tokens_per_expert[0] != 8 || x.tokens_per_expert[1] != 8)
        BAD(c, r, "rank %d: %d rows, blocks %lld %lld", r, x.num_permuted,
            (long long)x.tokens_per_expert[0], (long long)x.tokens_per_expert[1]);
    for (int e = 0; e < 2; e++) {
        int s = e == 0 ? (r + 1) % 2 : r;
        for (int i = 0; i < 8; i++) {
            int p = e * 8 + i;
            for (int b = 0; b < FH; b++)
                if (rows[p * FH + b] != (i < t ? (unsigned char)(s * 50 + i * 7 + b) : 0))
                    BAD(c, r, "rank %d: row %d byte %d", r, p, b);
            for (int q = 0; q < 2; q++)
                if (rs[p * 2 + q] != (i < t ? (float)(100 * s + i) + 0.5f * (float)q : 0.f))
                    BAD(c, r, "rank %d: row %d scale %d = %g", r, p, q, rs[p * 2 + q]);
            if (rp[p] != (i < t ? 0.5f : 0.f))
                BAD(c, r, "rank %d: row %d prob %g", r, p, rp[p]);
        }
    }
    if (x.copy_bytes != 16 * (FH + 4 + 2 * 4))
        BAD(c, r, "rank %d: copy_bytes %zu", r, x.copy_bytes);
    {   /* and the layout combines: each token's two rows (values 1 + p % 5 of each rank) */
        hep_combine_args ca;
        hep_combine_opts co;
        uint16_t eo[32 * FH], out[8 * FH];
        for (int p = 0; p < 32; p++)
            for (int b = 0; b < FH; b++)
                eo[p * FH + b] = out_val(r, p);
        memset(&ca, 0, sizeof(ca)), memset(&co, 0, sizeof(co));
        ca.expert_out = eo, ca.out = out, co.handle = h;
        if (hep_combine_ex(g, &ca, &co))
            BAD(c, r, "combine: %s", hep_last_error());
        for (int i = 0; i < t; i++) /* expert 0 of the other rank: row i; my expert 1: 8 + i */
            if (out[i * FH] != bf16_of(f32_of_bf16(out_val((r + 1) % 2, i)) +
                                        f32_of_bf16(out_val(r, 8 + i))) &&
                out[i * FH] != bf16_of(f32_of_bf16(out_val(r, 8 + i)) +
                                        f32_of_bf16(out_val((r + 1) % 2, i))))
                BAD(c, r, "rank %d: combined token %d = %g", r, i, f32_of_bf16(out[i * FH]));
    }
out:
    hep_handle_destroy(h);
    hep_group_destroy(g);
    return 0;
}

static void expert_major_fp8_rows_carry_their_scales(void **s)
{
    static fp8_case c;
    rank_ctx ctx[2];
    (void)s;
    memset(&c, 0, sizeof(c));
    assert_int_equal(run_ranks(2, fp8_rank, &c, ctx), 0);
    for (int r = 0; r < 2; r++)
        if (c.bad[r])
            fail_msg("%d failures; first: %s", c.bad[r], c.msg[r]);
}

static int errors(rank_ctx *rx)
{
    tcase *c = rx->arg;
    hep_group *g = NULL, *g2 = NULL;
    hep_handle *h = NULL, *h2 = NULL;
    hep_dispatch_args da;
    hep_dispatch_opts x;
    hep_dispatch_result dr;
    hep_combine_args ca;
    hep_combine_opts co;
    uint16_t buf[NH * 64];
    float pbuf[64];
    int n = 0;
#define EXPECT(call, want, text)                                                                 \
    do {                                                                                         \
        int rc_ = (call);                                                                        \
        n++;                                                                                     \
        if (rc_ != (want) || !strstr(hep_last_error(), text))                                    \
            BAD(c, rx->rank, "check %d: %d '%s', expected %d '%s'", n, rc_, hep_last_error(),     \
                want, text);                                                                     \
    } while (0)
    if (hep_group_create(&c->cfg, &rx->bs, 0, &g) || hep_handle_create(g, &h)) {
        BAD(c, rx->rank, "create: %s", hep_last_error());
        goto out;
    }
    EXPECT(hep_handle_create(NULL, &h2), HEP_ERR_INVALID, "NULL group");
    EXPECT(hep_handle_create(g, NULL), HEP_ERR_INVALID, "NULL output");
    dispatch_args(c, rx->rank, 0, 0, &da);
    memset(&x, 0, sizeof(x));
    x.handle = h;
    da.flags = HEP_REUSE_LAYOUT;
    EXPECT(hep_dispatch_ex(g, &da, &x, &dr), HEP_ERR_INVALID, "holds no layout");
    da.flags = HEP_REUSE_LAYOUT;
    EXPECT(hep_dispatch(g, &da, &dr), HEP_ERR_INVALID, "other than HEP_ASYNC");
    da.flags = 0;
    x.layout = HEP_LAYOUT_EXPERT_MAJOR;
    x.pad_multiple = 16;
    x.num_permuted_tokens = 40;
    EXPECT(hep_dispatch_ex(g, &da, &x, &dr), HEP_ERR_INVALID, "multiple of");
    x.pad_multiple = HEP_MAX_PAD_MULTIPLE + 1;
    EXPECT(hep_dispatch_ex(g, &da, &x, &dr), HEP_ERR_INVALID, "pad_multiple");
    x.pad_multiple = 16;
    x.num_permuted_tokens = 64;
    EXPECT(hep_dispatch_ex(g, &da, &x, &dr), HEP_ERR_INVALID, "recv_tokens, recv_probs");
    x.layout = (hep_layout)7;
    EXPECT(hep_dispatch_ex(g, &da, &x, &dr), HEP_ERR_INVALID, "layout 7");
    memset(&ca, 0, sizeof(ca));
    memset(&co, 0, sizeof(co));
    co.handle = h;
    ca.out = buf;
    ca.expert_out = buf;
    EXPECT(hep_combine_ex(g, &ca, &co), HEP_ERR_INVALID, "holds no layout");
    /* a layout recorded, then: probs_in alone, a wrong token count, another group's handle */
    x.layout = HEP_LAYOUT_EXPERT_MAJOR;
    x.recv_tokens = buf;
    x.recv_probs = pbuf;
    da.num_tokens = 5;
    EXPECT(hep_dispatch_ex(g, &da, &x, &dr), HEP_OK, "");
    co.probs_in = pbuf;
    EXPECT(hep_combine_ex(g, &ca, &co), HEP_ERR_INVALID, "go together");
    co.probs_in = NULL;
    EXPECT(hep_combine_ex(g, &ca, &co), HEP_OK, "");
    da.flags = HEP_REUSE_LAYOUT;
    da.num_tokens = 6;
    EXPECT(hep_dispatch_ex(g, &da, &x, &dr), HEP_ERR_INVALID, "layout is of 5 tokens");
    x.handle = NULL;
    EXPECT(hep_dispatch_ex(g, &da, &x, &dr), HEP_ERR_INVALID, "without a handle");
    if (hep_group_create(&c->cfg, &rx->bs, 0, &g2)) {
        BAD(c, rx->rank, "create 2: %s", hep_last_error());
        goto out;
    }
    da.num_tokens = 5;
    x.handle = h;
    EXPECT(hep_dispatch_ex(g2, &da, &x, &dr), HEP_ERR_INVALID, "another group");
    EXPECT(hep_combine_ex(g2, &ca, &co), HEP_ERR_INVALID, "another group");
    hep_group_destroy(g); /* the handle outlives its group and is still refused, not misread */
    g = NULL;
    EXPECT(hep_combine_ex(g2, &ca, &co), HEP_ERR_INVALID, "another group");
out:
    hep_group_destroy(g);
    hep_group_destroy(g2);
    hep_handle_destroy(h);
    return 0;
}

static void bad_handles_and_options_are_refused_with_reasons(void **s)
{
    static tcase c;
    rank_ctx ctx[2];
    (void)s;
    make_case(&c, 0, 16, 64, 7);
    for (int r = 0; r < 2; r++) /* a world of 2: ids of its 2 x EL experts */
        for (int i = 0; i < NT * NK; i++)
            c.ids[0][r][i] = c.ids[0][r][i] < 0 ? -1 : c.ids[0][r][i] % (2 * EL);
    assert_int_equal(run_ranks(2, errors, &c, ctx), 0);
    for (int r = 0; r < 2; r++)
        if (c.bad[r])
            fail_msg("%d failures; first: %s", c.bad[r], c.msg[r]);
}

/* What the GPU kernels take across nodes, decided on the host before any GPU work (the
 * checks group/ep.c makes for a GPU group; this runs without a GPU): with one node
 * everything; across nodes both layouts with probabilities through combine, the
 * expert-major layout with each node's ranks in one process only: with the ranks in
 * several processes HEP_ERR_UNAVAILABLE naming the option and the node count; a receive
 * capacity with both layouts blocking and with the rank-major one in the no-sync mode,
 * the expert-major one with HEP_ASYNC and a capacity refused naming both. */
static void gpu_kernels_across_nodes_refuse_each_missing_option_by_name(void **s)
{
    const char *want;
    (void)s;
    assert_int_equal(hep_ep_gpu_nodes_check(1, HEP_LAYOUT_EXPERT_MAJOR, 1, 1, 0, "x"), HEP_OK);
    assert_int_equal(hep_ep_gpu_nodes_check(2, HEP_LAYOUT_RANK_MAJOR, 0, 0, 0, "x"), HEP_OK);
    assert_int_equal(hep_ep_gpu_nodes_check(2, HEP_LAYOUT_RANK_MAJOR, 1, 0, 0, "x"), HEP_OK);
    assert_int_equal(hep_ep_gpu_nodes_check(2, HEP_LAYOUT_RANK_MAJOR, 1, 1, 0, "x"), HEP_OK);
    assert_int_equal(hep_ep_gpu_nodes_check(4, HEP_LAYOUT_EXPERT_MAJOR, 0, 0, 0, "x"), HEP_OK);
    assert_int_equal(hep_ep_gpu_nodes_check(2, HEP_LAYOUT_EXPERT_MAJOR, 0, 1, 0, "x"), HEP_OK);
    assert_int_equal(hep_ep_gpu_nodes_check(4, HEP_LAYOUT_EXPERT_MAJOR, 1, 0, 0, "hep_dispatch_ex"),
                     HEP_ERR_UNAVAILABLE);
    want = "hep_dispatch_ex: the GPU kernels have the expert-major layout across 4 nodes with "
           "each node's ranks in one process only";
    assert_non_null(strstr(hep_last_error(), want));
    assert_int_equal(hep_ep_gpu_nodes_check(2, HEP_LAYOUT_EXPERT_MAJOR, 1, 1, 0, "hep_combine_ex"),
                     HEP_ERR_UNAVAILABLE);
    assert_non_null(strstr(hep_last_error(), "hep_combine_ex: the GPU kernels have the "
                                             "expert-major layout across 2 nodes"));
    /* a receive capacity: rank-major in both modes, on any number of nodes; expert-major
     * across nodes blocking only (HEP_ASYNC: the nodes could not decide it alike) */
    assert_int_equal(hep_ep_gpu_nodes_check(2, HEP_LAYOUT_RANK_MAJOR, 0, 0, 40, "x"), HEP_OK);
    assert_int_equal(hep_ep_gpu_nodes_check(128, HEP_LAYOUT_RANK_MAJOR, 0, 1, 40, "x"), HEP_OK);
    assert_int_equal(hep_ep_gpu_nodes_check(1, HEP_LAYOUT_EXPERT_MAJOR, 0, 0, 40, "x"), HEP_OK);
    assert_int_equal(hep_ep_gpu_nodes_check(2, HEP_LAYOUT_EXPERT_MAJOR, 0, 0, 0, "x"), HEP_OK);
    assert_int_equal(hep_ep_gpu_nodes_check(2, HEP_LAYOUT_EXPERT_MAJOR, 0, 0, 40, "hep_dispatch_ex"),
                     HEP_ERR_UNAVAILABLE);
    assert_non_null(strstr(hep_last_error(), "hep_dispatch_ex: with HEP_ASYNC and "
                                             "config.max_recv_rows = 40, the GPU kernels across 2 "
                                             "nodes have no expert-major layout"));
}

/* The GPU backend (one node) takes a caller handle (here with no tokens) and combines
 * with it, refuses the expert-major layout and probabilities without a caller handle with
 * HEP_ERR_UNAVAILABLE, and its one-shot path through hep_dispatch_ex without options still
 * works. tests/test_gpu_train.c checks the outputs against the host backend. */
static int gpu_refusal(void)
{
    hep_inproc_world *w = NULL;
    hep_bootstrap bs;
    hep_group *g = NULL;
    hep_handle *h = NULL;
    hep_config cfg = test_config(NH, NT, EL, NK, HEP_DTYPE_BF16);
    hep_dispatch_args da;
    hep_dispatch_opts x;
    hep_dispatch_result dr;
    hep_combine_args ca;
    hep_combine_opts co;
    float p = 0;
    static _Alignas(16) float sink[4];
    int fails = 0;
    if (hep_gpu_probe(0)) {
        printf("skipped: no usable GPU: %s\n", hep_last_error());
        return 77;
    }
    if (hep_inproc_world_create(1, &w) || hep_inproc_bootstrap(w, 0, &bs) ||
        hep_group_create(&cfg, &bs, 0, &g) || hep_handle_create(g, &h)) {
        printf("FAIL: setup: %s\n", hep_last_error());
        return 1;
    }
    memset(&da, 0, sizeof(da));
    da.topk = 1;
    memset(&x, 0, sizeof(x));
    x.handle = h;
    fails += hep_dispatch_ex(g, &da, &x, &dr) != HEP_OK || dr.handle != 0;
    x.handle = NULL;
    x.layout = HEP_LAYOUT_EXPERT_MAJOR;
    x.num_permuted_tokens = 16;
    x.recv_tokens = sink; /* never written: refused first (16-byte aligned, so that the */
    x.recv_probs = sink;  /* refusal is the layout's, not the pointer check's) */
    fails += hep_dispatch_ex(g, &da, &x, &dr) != HEP_ERR_UNAVAILABLE ||
             !strstr(hep_last_error(), "GPU kernels");
    memset(&x, 0, sizeof(x));
    fails += hep_dispatch_ex(g, &da, &x, &dr) != HEP_OK || dr.handle == 0;
    memset(&ca, 0, sizeof(ca));
    memset(&co, 0, sizeof(co));
    ca.handle = dr.handle;
    co.probs_in = &p;
    co.probs_out = &p;
    fails += hep_combine_ex(g, &ca, &co) != HEP_ERR_UNAVAILABLE; /* no handle: no routing */
    co.probs_in = co.probs_out = NULL;
    co.handle = h;
    fails += hep_combine_ex(g, &ca, &co) != HEP_OK; /* the handle's layout, not the one-shot */
    fails += hep_combine(g, &ca) != HEP_OK;
    if (fails)
        printf("FAIL: %d checks (last error: %s)\n", fails, hep_last_error());
    hep_handle_destroy(h);
    hep_group_destroy(g);
    hep_inproc_world_destroy(w);
    return fails ? 1 : 0;
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(cases_cover_empty_expert_every_expert_and_overflow),
        cmocka_unit_test(expert_major_pad_1_matches_oracle),
        cmocka_unit_test(expert_major_pad_16_matches_oracle),
        cmocka_unit_test(expert_major_pad_64_matches_oracle),
        cmocka_unit_test(expert_major_pad_128_matches_oracle),
        cmocka_unit_test(expert_major_budget_overflow_drops_last_rows),
        cmocka_unit_test(expert_major_across_two_nodes_matches_oracle),
        {"probs_2x2_chunk_1_pad_1_match_oracle", probs_across_nodes, NULL, NULL, &nodes_cases[0]},
        {"probs_2x2_chunk_3_pad_16_match_oracle", probs_across_nodes, NULL, NULL, &nodes_cases[1]},
        {"probs_2x4_chunk_1_pad_16_match_oracle", probs_across_nodes, NULL, NULL, &nodes_cases[2]},
        {"probs_2x4_chunk_3_pad_1_match_oracle", probs_across_nodes, NULL, NULL, &nodes_cases[3]},
        {"probs_4x2_chunk_3_pad_16_match_oracle", probs_across_nodes, NULL, NULL, &nodes_cases[4]},
        {"probs_4x2_chunk_1_pad_1_match_oracle", probs_across_nodes, NULL, NULL, &nodes_cases[5]},
        {"probs_2x4_budget_overflow_drops_last_rows", probs_across_nodes, NULL, NULL, &nodes_cases[6]},
        {"probs_fp8_2x2_chunk_3_pad_16_match_oracle", probs_across_nodes, NULL, NULL, &nodes_cases[7]},
        {"probs_fp8_2x4_chunk_1_pad_16_match_oracle", probs_across_nodes, NULL, NULL, &nodes_cases[8]},
        {"probs_fp8_4x2_chunk_1_pad_1_match_oracle", probs_across_nodes, NULL, NULL, &nodes_cases[9]},
        cmocka_unit_test(expert_major_fp8_rows_carry_their_scales),
        cmocka_unit_test(bad_handles_and_options_are_refused_with_reasons),
        cmocka_unit_test(gpu_kernels_across_nodes_refuse_each_missing_option_by_name),
    };
    if (argc > 1 && !strcmp(argv[1], "--gpu"))
        return gpu_refusal();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
