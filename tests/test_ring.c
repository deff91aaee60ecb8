/* The inter-node slots as rings of chunks with credits (host backend, loopback NIC):
 * rings smaller than a slot's tokens against the oracle, over several calls of one group;
 * the credits a rank's proxy wrote; a peer that never returns a credit (a timeout naming
 * it); and 128 nodes x 8 ranks in one process. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core/core.h"
#include "ep_case.h"
#include "group/group.h"
#include "layout/plan.h"
#include "net/proxy.h"
#include "ranks.h"

static void set_timeout(const char *ms)
{
    if (ms)
        setenv("HEP_TIMEOUT_MS", ms, 1);
    else
        unsetenv("HEP_TIMEOUT_MS");
    hep_env_reload();
}

static hep_config host_config(int H, int T, int El, int K, int R, int chunk, hep_dtype dt)
{
    hep_config c;
    hep_config_default(&c);
    c.hidden = H;
    c.max_tokens = T;
    c.experts_per_rank = El;
    c.max_topk = K;
    c.dtype = dt;
    c.backend = HEP_BACKEND_HOST;
    c.ranks_per_node = R;
    c.chunk_tokens = chunk;
    return c;
}

/* Rings of 2 chunks of 1 or 2 tokens (2 or 4 rows per slot) under routing that sends
 * every third token to every node (at least T / 3 tokens a slot: the rings wrap several
 * times), five calls on one group, every output checked against the oracle. */
static void ring_smaller_than_a_slot_matches_the_oracle_over_several_calls(void **state)
{
    static const struct { int N, R, chunk; hep_dtype dt; } cases[] = {
        {2, 2, 1, HEP_DTYPE_BF16}, {2, 2, 2, HEP_DTYPE_FP8_E4M3}, {4, 2, 2, HEP_DTYPE_BF16},
        {2, 4, 1, HEP_DTYPE_BF16}, {3, 1, 2, HEP_DTYPE_BF16}};
    (void)state;
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        static ep_case c;
        hep_plan p;
        const int T = 18;
        memset(&c, 0, sizeof(c));
        c.cfg = host_config(cases[k].dt == HEP_DTYPE_FP8_E4M3 ? 128 : 32, T, 2, 3, cases[k].R,
                            cases[k].chunk, cases[k].dt);
        c.world = cases[k].N * cases[k].R;
        c.K = 3;
        c.skip_rank = -1;
        c.repeat = 5;
        assert_int_equal(hep_plan_make(&c.cfg, cases[k].N, cases[k].R, &p), HEP_OK);
        assert_int_equal(p.chunk, cases[k].chunk);
        assert_int_equal(p.ring, 2);
        assert_true(p.slot_tokens < (size_t)T / 3); /* every slot's ring wraps */
        ep_case_random(&c, 100u + (unsigned)k, EP_ROUTE_NODES);
        assert_int_equal(ep_case_run(&c), 0);
        for (int r = 0; r < c.world; r++)
            if (c.out[r].rc_dispatch || c.out[r].rc_combine)
                fail_msg("case %zu rank %d: %s", k, r, c.out[r].err);
        assert_int_equal(ep_case_check(&c), 0);
        ep_case_free(&c);
    }
}

/* 2 nodes x 1 rank: rank 0 sends all 12 of its tokens to node 1 with chunks of 2 (a ring
 * of 4 rows), three calls. The chunks after the first two of each call needed a credit, so
 * rank 1's proxy wrote 12 / 2 - 2 = 4 credits a call, and rank 0's wrote none (it receives
 * nothing). With hold_credits on rank 1 the first call fails: rank 0 waits for a credit
 * and names rank 1. */
typedef struct credit_case {
    int hold;
    int rc[2];
    char msg[2][1024];
    hep_proxy_peer_stats st[2];
    uint16_t y[12 * 16];
} credit_case;

static int credit_rank(rank_ctx *r)
{
    credit_case *cc = r->arg;
    hep_config c = host_config(16, 12, 1, 1, 1, 2, HEP_DTYPE_BF16);
    hep_group_hooks hooks;
    hep_group *g = NULL;
    static uint16_t tok[2][12 * 16];
    static int ids[2][12];
    static float w[2][12];
    int rc;
    memset(&hooks, 0, sizeof(hooks));
    hooks.transport = 1;
    hooks.hold_credits = cc->hold && r->rank == 1;
    rc = hep_group_create_ex(&c, &r->bs, 0, &hooks, &g);
    if (rc)
        return rc;
    for (int i = 0; i < 12; i++) {
        ids[r->rank][i] = 1; /* expert 1 lives on rank 1 (node 1) */
        w[r->rank][i] = 1.f;
        for (int h = 0; h < 16; h++)
            tok[r->rank][i * 16 + h] = bf16_of((float)(i + h % 3));
    }
    for (int call = 0; call < 3 && rc == HEP_OK; call++) {
        hep_dispatch_args da;
        hep_dispatch_result dr;
        memset(&da, 0, sizeof(da));
        da.num_tokens = r->rank == 0 ? 12 : 0;
        da.tokens = tok[r->rank];
        da.topk_idx = ids[r->rank];
        da.topk = 1;
        da.topk_weights = w[r->rank];
        rc = hep_dispatch(g, &da, &dr);
        if (rc == HEP_OK && r->rank == 1 && dr.num_recv != 12)
            rc = hep_fail(HEP_ERR_INTERNAL, "received %d rows, not 12", dr.num_recv);
        for (int i = 0; rc == HEP_OK && r->rank == 1 && i < 12 * 16; i++)
            if (((const uint16_t *)dr.tokens)[i] != tok[0][i])
                rc = hep_fail(HEP_ERR_INTERNAL, "row %d channel %d differs", i / 16, i % 16);
        if (rc == HEP_OK) {
            hep_combine_args ca;
            memset(&ca, 0, sizeof(ca));
            ca.handle = dr.handle;
            ca.expert_out = hep_combine_input(g);
            ca.out = cc->y;
            rc = hep_combine(g, &ca);
        }
        for (int i = 0; rc == HEP_OK && r->rank == 0 && i < 12 * 16; i++)
            if (cc->y[i] != tok[0][i]) /* one destination: its row comes back unchanged */
                rc = hep_fail(HEP_ERR_INTERNAL, "combined row %d channel %d differs", i / 16,
                              i % 16);
    }
    cc->rc[r->rank] = rc;
    snprintf(cc->msg[r->rank], sizeof(cc->msg[0]), "%s", rc ? hep_last_error() : "");
    if (rc == HEP_OK)
        hep_proxy_stats(g->proxy, 1 - r->rank, &cc->st[r->rank]);
    hep_group_destroy(g);
    return rc;
}

static void credits_flow_across_calls(void **state)
{
    static credit_case cc;
    rank_ctx ctx[2];
    (void)state;
    memset(&cc, 0, sizeof(cc));
    assert_int_equal(run_ranks(2, credit_rank, &cc, ctx), 0);
    for (int r = 0; r < 2; r++)
        if (cc.rc[r])
            fail_msg("rank %d: %s", r, cc.msg[r]);
    /* rank 1 -> rank 0, 3 calls: dispatch: count, count block (data), arrival, slot flag
     * (flags) and 4 credits (data); combine: 6 chunks of partial sums, their 6 flags, its
     * count and flag, and the combine's arrival word (data) */
    assert_int_equal(cc.st[1].data_wrs, 3 * ((2 + 4) + (1 + 6 + 1)));
    assert_int_equal(cc.st[1].flag_wrs, 3 * ((2) + (6 + 1)));
    /* rank 0 -> rank 1: per call 6 chunks of rows in 3 buffers and their 6 flags, the
     * count, count block, arrival, slot flag; in combine, its arrival word, the count and
     * flag of its empty slot, and 4 credits */
    assert_int_equal(cc.st[0].data_wrs, 3 * ((2 + 6 * 3) + (1 + 1 + 4)));
    assert_int_equal(cc.st[0].flag_wrs, 3 * ((6 + 2) + 1));
}

static void a_peer_that_never_returns_a_credit_is_named(void **state)
{
    static credit_case cc;
    rank_ctx ctx[2];
    (void)state;
    memset(&cc, 0, sizeof(cc));
    cc.hold = 1;
    set_timeout("300");
    assert_int_equal(run_ranks(2, credit_rank, &cc, ctx), 0);
    set_timeout(NULL);
    print_message("rank 0: %s\nrank 1: %s\n", cc.msg[0], cc.msg[1]);
    assert_int_equal(cc.rc[0], HEP_ERR_TIMEOUT);
    assert_non_null(strstr(cc.msg[0], "for a credit from rank 1"));
    /* rank 1 waited for the third chunk, which rank 0 could not send */
    assert_int_equal(cc.rc[1], HEP_ERR_TIMEOUT);
    assert_non_null(strstr(cc.msg[1], "chunk 2 of the dispatch rows from rank 0"));
}

/* 128 nodes x 8 ranks in one process (1024 rank threads and their proxies), 2 tokens a
 * rank, H = 8, one expert a rank, chunks of 1 token: token i of rank r goes to ranks
 * (r + 8 (i + 1)) mod W (another node) and (r + 1) mod W. Each rank must receive, in
 * [source node][source local][token] order, exactly the tokens naming it, and combine
 * (its expert outputs being the received rows) must give every token twice its row. */
#define BIG_N 128
#define BIG_R 8
#define BIG_W (BIG_N * BIG_R)
typedef struct big_case {
    int rc[BIG_W];
    char msg[BIG_W][256];
} big_case;

static float big_value(int r, int i, int h)
{
    return (float)((r * 2 + i) % 61 + h);
}

static int big_rank(rank_ctx *r)
{
    big_case *bc = r->arg;
    hep_config c = host_config(8, 2, 1, 2, BIG_R, 1, HEP_DTYPE_BF16);
    hep_group_hooks hooks;
    hep_group *g = NULL;
    hep_dispatch_args da;
    hep_dispatch_result dr;
    hep_combine_args ca;
    uint16_t tok[2 * 8], y[2 * 8];
    int ids[2 * 2], rc, row = 0;
    float w[4] = {1, 1, 1, 1};
    memset(&hooks, 0, sizeof(hooks));
    hooks.transport = 1;
    rc = hep_group_create_ex(&c, &r->bs, 0, &hooks, &g);
    if (rc)
        goto out;
    for (int i = 0; i < 2; i++) {
        ids[i * 2] = (r->rank + BIG_R * (i + 1)) % BIG_W;
        ids[i * 2 + 1] = (r->rank + 1) % BIG_W;
        for (int h = 0; h < 8; h++)
            tok[i * 8 + h] = bf16_of(big_value(r->rank, i, h));
    }
    memset(&da, 0, sizeof(da));
    da.num_tokens = 2;
    da.tokens = tok;
    da.topk_idx = ids;
    da.topk = 2;
    da.topk_weights = w;
    rc = hep_dispatch(g, &da, &dr);
    /* the expected rows: sources in rank order are [node][local] order */
    for (int s = 0; rc == HEP_OK && s < BIG_W; s++)
        for (int i = 0; rc == HEP_OK && i < 2; i++) {
            if ((s + BIG_R * (i + 1)) % BIG_W != r->rank && (s + 1) % BIG_W != r->rank)
                continue;
            for (int h = 0; h < 8 && rc == HEP_OK; h++)
                if (row >= dr.num_recv ||
                    ((const uint16_t *)dr.tokens)[row * 8 + h] != bf16_of(big_value(s, i, h)))
                    rc = hep_fail(HEP_ERR_INTERNAL, "row %d is not token %d of rank %d", row, i, s);
            row++;
        }
    if (rc == HEP_OK && row != dr.num_recv)
        rc = hep_fail(HEP_ERR_INTERNAL, "received %d rows, expected %d", dr.num_recv, row);
    if (rc == HEP_OK) {
        memset(&ca, 0, sizeof(ca));
        ca.handle = dr.handle;
        ca.expert_out = hep_combine_input(g);
        ca.out = y;
        rc = hep_combine(g, &ca);
    }
    for (int k = 0; rc == HEP_OK && k < 16; k++)
        if (y[k] != bf16_of(2 * big_value(r->rank, k / 8, k % 8)))
            rc = hep_fail(HEP_ERR_INTERNAL, "combined token %d channel %d differs", k / 8, k % 8);
out:
    bc->rc[r->rank] = rc;
    snprintf(bc->msg[r->rank], sizeof(bc->msg[0]), "%s", rc ? hep_last_error() : "");
    hep_group_destroy(g);
    return rc;
}

static void host_backend_128_nodes_of_8_ranks(void **state)
{
    static big_case bc;
    static rank_ctx ctx[BIG_W];
    hep_config c = host_config(8, 2, 1, 2, BIG_R, 1, HEP_DTYPE_BF16);
    (void)state;
    assert_int_equal(hep_config_check(&c, BIG_W), HEP_OK);
    memset(&bc, 0, sizeof(bc));
    assert_int_equal(run_ranks(BIG_W, big_rank, &bc, ctx), 0);
    for (int r = 0; r < BIG_W; r++)
        if (bc.rc[r])
            fail_msg("rank %d: %s", r, bc.msg[r]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(ring_smaller_than_a_slot_matches_the_oracle_over_several_calls),
        cmocka_unit_test(credits_flow_across_calls),
        cmocka_unit_test(a_peer_that_never_returns_a_credit_is_named),
        cmocka_unit_test(host_backend_128_nodes_of_8_ranks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
