/* The receive capacity (config.max_recv_rows) on the host backend: a dispatch that needs
 * exactly the capacity succeeds and writes nothing past it; one that needs one row more
 * fails on every rank with HEP_ERR_OVERFLOW naming the rank and its rows, writes no
 * receive byte (the whole receive region is poisoned and checked); the same one with
 * HEP_ASYNC drops the row past the capacity instead (HEP_WARN_IGNORED on every rank, the
 * overflow words, the kept rows, counts and tokens per expert, nothing written past the
 * capacity, and a combine in which the dropped row contributes nothing); and the next call
 * with fitting routing succeeds. One node of 4 ranks and 2 nodes of 2 (the loopback NIC). The
 * GPU backend takes a capacity across nodes too: group creation does not refuse it
 * (tests/test_gpu_train.c checks its outputs on one node and across virtual nodes). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "hybridep/hybridep.h"
#include "ranks.h"

#define NW 4  /* ranks */
#define NT 8  /* tokens per rank */
#define NK 2  /* slots */
#define EL 2  /* experts per rank */
#define NH 16 /* hidden */
#define CAP (NW * NT - 1) /* rank 0 receives every token but one in routing A */
#define POISON 0xa5

typedef struct tcfg {
    int ranks_per_node;
} tcfg;

/* Routing A: slot 0 of every token is expert 0 (rank 0) except rank 3's last token, slot 1
 * some expert of ranks 1..3: rank 0 needs CAP rows. Routing B: every token on rank 0: CAP
 * + 1 rows. */
static void routing(int r, int b, int *ids, float *w)
{
    for (int i = 0; i < NT; i++) {
        int skip = !b && r == NW - 1 && i == NT - 1;
        ids[i * NK] = skip ? 2 * EL + 1 : 0;
        ids[i * NK + 1] = EL + (r * NT + i) % ((NW - 1) * EL);
        w[i * NK] = 0.5f, w[i * NK + 1] = 0.25f;
    }
}

static uint16_t value(int r, int i, int c)
{
    return (uint16_t)(0x3f80 + ((r * NT + i) * 3 + c) % 97); /* BF16 of small positives */
}

/* the receive-side region of the shared arena: from exchange.token up to sync.counts */
static void region(hep_group *g, const hep_config *c, unsigned char **lo, size_t *len,
                   size_t *tok_end, size_t *prob_off, size_t *prob_end)
{
    static __thread hep_plan_info p;
    size_t tok = 0, counts = 0;
    hep_group_info gi;
    assert_int_equal(hep_group_get_info(g, &gi), 0);
    assert_int_equal(hep_plan_query(c, gi.nodes, gi.ranks_per_node, &p), 0);
    for (int b = 0; b < p.num_buffers; b++) {
        if (!strcmp(p.buffers[b].name, "exchange.token"))
            tok = p.buffers[b].offset, *tok_end = p.buffers[b].offset + p.buffers[b].bytes;
        if (!strcmp(p.buffers[b].name, "dispatch.recv_prob"))
            *prob_off = p.buffers[b].offset, *prob_end = p.buffers[b].offset + p.buffers[b].bytes;
        if (!strcmp(p.buffers[b].name, "sync.counts"))
            counts = p.buffers[b].offset;
    }
    assert_int_equal(gi.max_recv_rows, CAP);
    assert_true(tok < *tok_end && *tok_end <= *prob_off && *prob_end <= counts);
    *lo = (unsigned char *)hep_combine_input(g) - tok;
    *len = counts;
    *tok_end -= tok, *prob_off -= tok, *prob_end -= tok;
}

static float bf16_f(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* After the dropping dispatch (routing B, HEP_ASYNC): the words, counts and rows of rank r. */
static int check_drop(int r, const hep_dispatch_result *res)
{
    const int *w = res->overflow_device, *hc = res->host_counts;
    /* slot 1 of token k (of 32, in source order) is expert 2 + k % 6: rank 1 gets 12 */
    const int need = r == 0 ? NW * NT : r == 1 ? 12 : 10;
    if (!w || !hc)
        return hep_set_last_error(HEP_ERR_INTERNAL, "rank %d: no overflow words", r);
    if (w[HEP_OVERFLOW_DROPPED] != 1 || w[HEP_OVERFLOW_NEEDED] != need ||
        w[HEP_OVERFLOW_ROWS] != (r == 0 ? 1 : 0))
        return hep_set_last_error(HEP_ERR_INTERNAL,
                                  "rank %d: overflow words %d %d %d, expected 1 %d %d", r, w[0],
                                  w[1], w[2], need, r == 0);
    if (res->num_recv != -1 || res->num_recv_device[0] != (r == 0 ? CAP : need) ||
        hc[0] != res->num_recv_device[0])
        return hep_set_last_error(HEP_ERR_INTERNAL, "rank %d: num_recv %d, counts %d %d", r,
                                  res->num_recv, res->num_recv_device[0], hc[0]);
    if (r == 0) { /* every token on expert 0, the last one dropped: 31 of 32, none on 1 */
        const uint16_t *rows = res->tokens;
        if (res->tokens_per_expert_device[0] != CAP || res->tokens_per_expert_device[1] != 0)
            return hep_set_last_error(HEP_ERR_INTERNAL, "rank 0: tokens per expert %d %d",
                                      res->tokens_per_expert_device[0],
                                      res->tokens_per_expert_device[1]);
        for (int j = 0; j < CAP; j++) /* the first CAP rows of the receive order */
            for (int ch = 0; ch < NH; ch++)
                if (rows[(size_t)j * NH + ch] != value(j / NT, j % NT, ch))
                    return hep_set_last_error(HEP_ERR_INTERNAL, "rank 0: kept row %d differs", j);
    }
    return HEP_OK;
}

/* Combine of the dropping dispatch with its own rows as expert outputs: every token has
 * two rows (2 v), except rank NW - 1's last, whose row at rank 0 was dropped (v). */
static int check_drop_combine(int r, const uint16_t *out)
{
    for (int i = 0; i < NT; i++)
        for (int ch = 0; ch < NH; ch++) {
            const float v = bf16_f(value(r, i, ch));
            const float want = r == NW - 1 && i == NT - 1 ? v : 2 * v;
            if (bf16_f(out[i * NH + ch]) != want)
                return hep_set_last_error(HEP_ERR_INTERNAL,
                                          "rank %d: combine of token %d channel %d is %g, not %g",
                                          r, i, ch, bf16_f(out[i * NH + ch]), want);
        }
    return HEP_OK;
}

static int all_poison(const unsigned char *p, size_t from, size_t to)
{
    for (size_t i = from; i < to; i++)
        if (p[i] != POISON)
            return 0;
    return 1;
}

static int one_rank(rank_ctx *x)
{
    const tcfg *t = x->arg;
    hep_config c;
    hep_group *g = NULL;
    int ids[NT * NK], r = x->rank, rc;
    float w[NT * NK];
    _Alignas(16) uint16_t tok[NT * NH];
    _Alignas(16) uint16_t out[NT * NH];
    unsigned char *lo;
    size_t len = 0, tok_end = 0, prob_off = 0, prob_end = 0;
    hep_dispatch_args a;
    hep_dispatch_result res;
    hep_combine_args ca;

    hep_config_default(&c);
    c.hidden = NH, c.max_tokens = NT, c.experts_per_rank = EL, c.max_topk = NK;
    c.backend = HEP_BACKEND_HOST;
    c.ranks_per_node = t->ranks_per_node;
    c.max_recv_rows = CAP;
    if ((rc = hep_group_create(&c, &x->bs, 0, &g)))
        return rc;
    region(g, &c, &lo, &len, &tok_end, &prob_off, &prob_end);
    for (int i = 0; i < NT; i++)
        for (int ch = 0; ch < NH; ch++)
            tok[i * NH + ch] = value(r, i, ch);
    memset(&a, 0, sizeof(a));
    a.num_tokens = NT, a.tokens = tok, a.topk_idx = ids, a.topk = NK, a.topk_weights = w;
    for (int call = 0; call < 4; call++) {
        const int over = call == 1, drop = call == 2;
        routing(r, over || drop, ids, w);
        a.flags = drop ? HEP_ASYNC : 0;
        /* before a fitting call the bytes past the capacity, before the overflow all of it */
        memset(lo, POISON, len);
        rc = hep_dispatch(g, &a, &res);
        if (drop) {
            if (rc != HEP_WARN_IGNORED)
                return rc ? rc : hep_set_last_error(HEP_ERR_INTERNAL, "no drop warning");
            if (!strstr(hep_last_error(), "rank 0 needs 32 receive rows, more than "
                                           "config.max_recv_rows = 31 (1 rank(s) over; "
                                           "HEP_ASYNC): the rows at or past"))
                return HEP_ERR_INTERNAL;
            if (!all_poison(lo, tok_end, prob_off) || !all_poison(lo, prob_end, len))
                return hep_set_last_error(HEP_ERR_INTERNAL, "rank %d: dropping wrote past the "
                                          "capacity", r);
            if ((rc = check_drop(r, &res)))
                return rc;
            memset(&ca, 0, sizeof(ca));
            ca.handle = res.handle, ca.expert_out = hep_combine_input(g), ca.out = out;
            if ((rc = hep_combine(g, &ca)) || (rc = check_drop_combine(r, out)))
                return rc;
            continue;
        }
        if (over) {
            if (rc != HEP_ERR_OVERFLOW)
                return rc ? rc : hep_set_last_error(HEP_ERR_INTERNAL, "no overflow");
            if (!strstr(hep_last_error(), "rank 0 needs 32 receive rows, more than "
                                           "config.max_recv_rows = 31"))
                return HEP_ERR_INTERNAL; /* the message stays in x->err for the report */
            if (!all_poison(lo, 0, len))
                return hep_set_last_error(HEP_ERR_INTERNAL, "rank %d: receive region written",
                                          r);
            continue;
        }
        if (rc)
            return rc;
        if (!res.overflow_device || res.overflow_device[HEP_OVERFLOW_DROPPED] ||
            res.overflow_device[HEP_OVERFLOW_ROWS] ||
            res.overflow_device[HEP_OVERFLOW_NEEDED] != res.num_recv)
            return hep_set_last_error(HEP_ERR_INTERNAL, "rank %d: overflow words of a fit", r);
        if (!all_poison(lo, tok_end, prob_off) || !all_poison(lo, prob_end, len))
            return hep_set_last_error(HEP_ERR_INTERNAL, "rank %d: written past the capacity", r);
        if (r == 0) { /* every token but rank 3's last, in source order */
            const uint16_t *rows = res.tokens;
            int j = 0;
            if (res.num_recv != CAP)
                return hep_set_last_error(HEP_ERR_INTERNAL, "rank 0 got %d rows", res.num_recv);
            for (int s = 0; s < NW; s++)
                for (int i = 0; i < NT; i++, j++) {
                    if (s == NW - 1 && i == NT - 1)
                        break;
                    for (int ch = 0; ch < NH; ch++)
                        if (rows[(size_t)j * NH + ch] != value(s, i, ch))
                            return hep_set_last_error(HEP_ERR_INTERNAL, "row %d differs", j);
                }
        }
        memset(&ca, 0, sizeof(ca));
        ca.handle = res.handle, ca.expert_out = hep_combine_input(g), ca.out = out;
        if ((rc = hep_combine(g, &ca)))
            return rc;
    }
    return hep_group_destroy(g);
}

static void run(int ranks_per_node)
{
    rank_ctx ctx[NW];
    tcfg t = {ranks_per_node};
    assert_int_equal(run_ranks(NW, one_rank, &t, ctx), 0);
    for (int r = 0; r < NW; r++)
        if (ctx[r].rc)
            fail_msg("rank %d: %s: %s", r, hep_status_name(ctx[r].rc), ctx[r].err);
}

static void capacity_met_fits_one_short_overflows_or_drops_everywhere_one_node(void **state)
{
    (void)state;
    run(NW);
}

static void capacity_met_fits_one_short_overflows_or_drops_everywhere_two_nodes(void **state)
{
    (void)state;
    run(NW / 2);
}

static int gpu_rank(rank_ctx *x)
{
    hep_config c;
    hep_group *g = NULL;
    int rc;
    hep_config_default(&c);
    c.hidden = NH, c.max_tokens = NT, c.experts_per_rank = EL, c.max_topk = NK;
    c.ranks_per_node = 1; /* two nodes */
    c.max_recv_rows = NT; /* of 2 x NT */
    rc = hep_group_create(&c, &x->bs, 0, &g);
    if (rc == HEP_OK)
        hep_group_destroy(g);
    return rc;
}

/* Without a GPU the creation fails for that reason (the device), never for the capacity;
 * with one it succeeds. */
static void gpu_backend_takes_a_capacity_across_nodes_at_creation(void **state)
{
    rank_ctx ctx[2];
    (void)state;
    (void)run_ranks(2, gpu_rank, NULL, ctx);
    for (int r = 0; r < 2; r++) {
        if (ctx[r].rc == HEP_OK)
            continue;
        if (strstr(ctx[r].err, "max_recv_rows") || strstr(ctx[r].err, "capacity"))
            fail_msg("rank %d: %s: %s", r, hep_status_name(ctx[r].rc), ctx[r].err);
        print_message("rank %d: no GPU group here (%s: %s), not for the capacity\n", r,
                      hep_status_name(ctx[r].rc), ctx[r].err);
    }
}

static void config_check_bounds_the_capacity_by_world_x_tokens(void **state)
{
    hep_config c;
    (void)state;
    hep_config_default(&c);
    c.hidden = NH, c.max_tokens = NT, c.experts_per_rank = EL, c.max_topk = NK;
    c.max_recv_rows = NW * NT;
    assert_int_equal(hep_config_check(&c, NW), 0);
    c.max_recv_rows = NW * NT + 1;
    assert_int_equal(hep_config_check(&c, NW), HEP_ERR_INVALID);
    assert_non_null(strstr(hep_last_error(), "config.max_recv_rows = 33 is out of range 0..32"));
    c.max_recv_rows = -1;
    assert_int_equal(hep_config_check(&c, 0), HEP_ERR_INVALID);
    assert_non_null(strstr(hep_last_error(), "max_recv_rows"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(config_check_bounds_the_capacity_by_world_x_tokens),
        cmocka_unit_test(capacity_met_fits_one_short_overflows_or_drops_everywhere_one_node),
        cmocka_unit_test(capacity_met_fits_one_short_overflows_or_drops_everywhere_two_nodes),
        cmocka_unit_test(gpu_backend_takes_a_capacity_across_nodes_at_creation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
