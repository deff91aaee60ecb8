/* Fault paths and bad input on the host backend: what combine may read after dispatch,
 * what destroy frees after a failure, one meaning per status, and the knobs and calls
 * whose bad values used to pass silently. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "core/core.h"
#include "ep_case.h"
#include "fake_mr.h"
#include "group/group.h"
#include "ranks.h"

static hep_config host_config(int R)
{
    hep_config c = test_config(64, 8, 2, 2, HEP_DTYPE_BF16);
    c.backend = HEP_BACKEND_HOST;
    c.ranks_per_node = R;
    return c;
}

static void set_timeout(const char *ms)
{
    if (ms)
        setenv("HEP_TIMEOUT_MS", ms, 1);
    else
        unsetenv("HEP_TIMEOUT_MS");
    hep_env_reload();
}

static void run_clobbered(int world, int R, int index64, unsigned seed, int id_plus1)
{
    static ep_case c;
    memset(&c, 0, sizeof(c));
    c.cfg = test_config(128, 12, 2, 3, HEP_DTYPE_BF16);
    c.cfg.backend = HEP_BACKEND_HOST;
    c.cfg.ranks_per_node = R;
    c.world = world;
    c.K = 3;
    c.index64 = index64;
    c.skip_rank = -1;
    c.clobber_ids = id_plus1;
    ep_case_random(&c, seed, 0);
    assert_int_equal(ep_case_run(&c), 0);
    for (int r = 0; r < world; r++)
        if (c.out[r].rc_dispatch || c.out[r].rc_combine)
            fail_msg("rank %d: %d %d %s", r, c.out[r].rc_dispatch, c.out[r].rc_combine,
                     c.out[r].err);
    assert_int_equal(ep_case_check(&c), 0);
    ep_case_free(&c);
}

/* D1: combine follows the routing of its dispatch even when the caller rewrote its
 * topk_idx in between (all -1: nothing would be combined; all 0: rows that do not exist
 * would be read from a node-mate's expert outputs). */
static void combine_uses_the_routing_of_its_dispatch_not_the_callers_reused_ids(void **state)
{
    (void)state;
    run_clobbered(4, 0, 0, 1, 0);      /* every id -1 */
    run_clobbered(4, 0, 1, 2, 1);      /* every id 0, int64 */
    run_clobbered(4, 2, 0, 3, 1);      /* 2 x 2 virtual nodes */
    run_clobbered(4, 2, 0, 4, 0);
}

/* What each rank of a destroy test does and saw. */
typedef struct destroy_case {
    hep_config cfg;
    int early;        /* this rank skips dispatch and goes straight to destroy */
    int never;        /* this rank joins destroy only after every other rank left it */
    int left;         /* ranks that returned from destroy */
    int rc_dispatch[8], rc_destroy[8];
    char msg[8][1200];
} destroy_case;

static int destroy_rank(rank_ctx *r)
{
    destroy_case *d = r->arg;
    hep_group *g = NULL;
    int idx[16], rc;
    float w[16];
    uint16_t x[8 * 64];
    rc = hep_group_create(&d->cfg, &r->bs, 0, &g);
    if (rc)
        return rc;
    if (r->rank == d->never) /* it joins destroy only after every other rank left it */
        for (int spin = 0; spin < 200000 && __atomic_load_n(&d->left, __ATOMIC_ACQUIRE) <
                                                r->world - 1;
             spin++)
            usleep(100);
    else if (r->rank != d->early) {
        hep_dispatch_args da;
        hep_dispatch_result dr;
        memset(&da, 0, sizeof(da));
        memset(x, 0, sizeof(x));
        for (int i = 0; i < 16; i++)
            idx[i] = (i * 5 + r->rank) % (2 * r->world), w[i] = 1;
        da.num_tokens = 8;
        da.tokens = x;
        da.topk_idx = idx;
        da.topk = 2;
        da.topk_weights = w;
        d->rc_dispatch[r->rank] = hep_dispatch(g, &da, &dr);
    }
    d->rc_destroy[r->rank] = hep_group_destroy(g);
    snprintf(d->msg[r->rank], sizeof(d->msg[0]), "%s", hep_last_error());
    __atomic_add_fetch(&d->left, 1, __ATOMIC_RELEASE);
    return 0;
}

static void run_destroy(destroy_case *d, int world)
{
    rank_ctx ctx[8];
    set_timeout("300");
    assert_int_equal(run_ranks(world, destroy_rank, d, ctx), 0);
    set_timeout(NULL);
    for (int r = 0; r < world; r++)
        if (ctx[r].rc)
            fail_msg("rank %d: create: %s", r, ctx[r].err);
}

/* D3 (and D2): one rank goes to destroy while the others dispatch and time out on it;
 * they reach destroy one timeout later. Every destroy succeeds and frees everything
 * (LeakSanitizer checks the bytes; nothing is kept). */
static void destroy_after_a_timeout_frees_everything_when_every_rank_arrives(void **state)
{
    static destroy_case d;
    size_t kept = hep_group_kept_bytes();
    (void)state;
    for (int R = 0; R <= 2; R += 2) { /* one node of 4, then 2 x 2 virtual nodes */
        memset(&d, 0, sizeof(d));
        d.cfg = host_config(R);
        d.early = R ? 0 : 2;
        d.never = -1;
        run_destroy(&d, 4);
        for (int r = 0; r < 4; r++) {
            if (r != d.early)
                assert_int_equal(d.rc_dispatch[r], HEP_ERR_TIMEOUT);
            if (d.rc_destroy[r] != HEP_OK)
                fail_msg("R %d rank %d: destroy %s: %s", R, r, hep_status_name(d.rc_destroy[r]),
                         d.msg[r]);
        }
    }
    assert_int_equal(hep_group_kept_bytes(), kept);
}

/* D2: 2 x 2 nodes, rank 3 never reaches destroy while the others do. Only its node-mate
 * (rank 2) keeps memory, exactly its own arenas, and says so; node 0 frees everything.
 * Nothing faults (AddressSanitizer). */
static void destroy_without_a_node_mate_keeps_only_that_nodes_own_arenas_and_says_so(
    void **state)
{
    static destroy_case d;
    size_t before = hep_group_kept_bytes();
    hep_plan p;
    hep_config c = host_config(2);
    (void)state;
    memset(&d, 0, sizeof(d));
    d.cfg = c;
    d.early = -1;
    d.never = 3;
    hep_log_set_sink(NULL, NULL);
    run_destroy(&d, 4);
    assert_int_equal(hep_plan_make(&c, 2, 2, &p), HEP_OK);
    for (int r = 0; r < 3; r++) {
        assert_int_equal(d.rc_dispatch[r], HEP_ERR_TIMEOUT);
        assert_int_equal(d.rc_destroy[r], HEP_ERR_TIMEOUT);
    }
    assert_non_null(strstr(d.msg[0], "every node-mate had entered destroy, so everything was freed"));
    assert_non_null(strstr(d.msg[1], "everything was freed"));
    if (!strstr(d.msg[2], "node-mate rank 3 did not enter destroy") ||
        !strstr(d.msg[2], "kept allocated"))
        fail_msg("rank 2: %s", d.msg[2]);
    /* rank 3 joined last: all its node-mates had left, so it freed everything */
    assert_non_null(strstr(d.msg[3], "everything was freed"));
    assert_int_equal(hep_group_kept_bytes() - before,
                     p.arena_bytes[HEP_ARENA_SHARED] + p.arena_bytes[HEP_ARENA_LOCAL]);
}

/* D7: an expert id out of range is a warning status: the dispatch happened, and the rank
 * that passed it combines with everyone else (no timeout). */
/* D11: 2 x 2 nodes, every rank dispatches, rank 0 never combines. Rank 3 waits for the
 * partial sums of rank 1 (its peer on node 0), which came but waits for rank 0 itself: the
 * message must not say that rank 1 did not arrive. Ranks 1 and 2 name rank 0. */
typedef struct missing_combine {
    int rc_combine[4];
    char msg[4][1200];
} missing_combine;

static int missing_combine_rank(rank_ctx *r)
{
    missing_combine *mc = r->arg;
    hep_config c = host_config(2);
    hep_group *g = NULL;
    hep_dispatch_args da;
    hep_dispatch_result dr;
    int idx[16], rc;
    float w[16];
    uint16_t x[8 * 64], y[8 * 64];
    if ((rc = hep_group_create(&c, &r->bs, 0, &g)))
        return rc;
    memset(&da, 0, sizeof(da));
    memset(x, 0, sizeof(x));
    for (int i = 0; i < 16; i++) /* every token on an expert of each node */
        idx[i] = (i % 2) ? (i * 3 + r->rank) % 4 : 4 + (i * 3 + r->rank) % 4, w[i] = 1;
    da.num_tokens = 8;
    da.tokens = x;
    da.topk_idx = idx;
    da.topk = 2;
    da.topk_weights = w;
    rc = hep_dispatch(g, &da, &dr);
    if (rc == HEP_OK && r->rank != 0) {
        hep_combine_args ca;
        memset(&ca, 0, sizeof(ca));
        ca.handle = dr.handle;
        ca.expert_out = hep_combine_input(g);
        ca.out = y;
        mc->rc_combine[r->rank] = hep_combine(g, &ca);
        snprintf(mc->msg[r->rank], sizeof(mc->msg[0]), "%s", hep_last_error());
    }
    hep_group_destroy(g);
    return rc;
}

static void a_peer_that_came_is_not_named_missing_when_its_node_mate_is(void **state)
{
    static missing_combine mc;
    rank_ctx ctx[4];
    (void)state;
    memset(&mc, 0, sizeof(mc));
    set_timeout("300");
    assert_int_equal(run_ranks(4, missing_combine_rank, &mc, ctx), 0);
    set_timeout(NULL);
    for (int r = 1; r < 4; r++) {
        print_message("rank %d: %s\n", r, mc.msg[r]);
        assert_int_equal(mc.rc_combine[r], HEP_ERR_TIMEOUT);
    }
    assert_non_null(strstr(mc.msg[1], "rank 0 did not arrive"));
    assert_non_null(strstr(mc.msg[2], "rank 0 did not arrive"));
    assert_null(strstr(mc.msg[3], "rank 1 did not arrive"));
    assert_non_null(strstr(mc.msg[3], "rank 1 arrived at call"));
}

static void ignored_expert_id_is_a_warning_and_the_group_goes_on_to_combine(void **state)
{
    static ep_case c;
    (void)state;
    memset(&c, 0, sizeof(c));
    c.cfg = host_config(0);
    c.world = 4;
    c.K = 2;
    c.skip_rank = -1;
    c.has_t_fixed = 1;
    c.t_fixed = 8;
    ep_case_random(&c, 7, 0);
    ((int *)c.in[1].idx)[0] = 999;
    assert_int_equal(ep_case_run(&c), 0);
    assert_int_equal(c.out[1].rc_dispatch, HEP_WARN_IGNORED);
    assert_non_null(strstr(c.out[1].err, "topk_idx[0][0] = 999"));
    for (int r = 0; r < 4; r++) {
        if (r != 1)
            assert_int_equal(c.out[r].rc_dispatch, HEP_OK);
        assert_int_equal(c.out[r].rc_combine, HEP_OK);
    }
    ((int *)c.in[1].idx)[0] = -1; /* the oracle ignores that slot too */
    assert_int_equal(ep_case_check(&c), 0);
    ep_case_free(&c);
}

/* D16: undefined flag bits, another group's handle and HEP_ASYNC's num_recv. */
typedef struct two_groups {
    uint64_t handle[2];
    int rc_flags, rc_foreign, rc_own, num_recv_async;
} two_groups;

static int two_groups_rank(rank_ctx *r)
{
    two_groups *t = r->arg;
    hep_config c = host_config(0);
    hep_group *g[2] = {NULL, NULL};
    hep_dispatch_args da;
    hep_dispatch_result dr;
    hep_combine_args ca;
    uint16_t y[64];
    uint64_t h[2] = {0, 0};
    int rc = hep_group_create(&c, &r->bs, 0, &g[0]);
    if (!rc)
        rc = hep_group_create(&c, &r->bs, 0, &g[1]);
    memset(&da, 0, sizeof(da));
    da.topk = 1;
    da.flags = 4;
    if (!rc && r->rank == 0)
        t->rc_flags = hep_dispatch(g[0], &da, &dr); /* refused before any collective work */
    da.flags = HEP_ASYNC;
    for (int i = 0; !rc && i < 2; i++) {
        rc = hep_dispatch(g[i], &da, &dr);
        h[i] = dr.handle;
        if (r->rank == 0) {
            t->handle[i] = dr.handle;
            t->num_recv_async = dr.num_recv;
        }
    }
    memset(&ca, 0, sizeof(ca));
    ca.out = y;
    ca.expert_out = hep_combine_input(g[0]);
    ca.handle = dr.handle; /* group 1's */
    if (!rc && r->rank == 0)
        t->rc_foreign = hep_combine(g[0], &ca);
    r->bs.barrier(r->bs.ctx);
    for (int i = 0; !rc && i < 2; i++) {
        ca.handle = h[i];
        ca.expert_out = hep_combine_input(g[i]);
        rc = hep_combine(g[i], &ca);
        if (r->rank == 0 && i == 0)
            t->rc_own = rc;
    }
    hep_group_destroy(g[1]);
    hep_group_destroy(g[0]);
    return rc;
}

static void dispatch_refuses_unknown_flags_and_combine_refuses_another_groups_handle(
    void **state)
{
    static two_groups t;
    rank_ctx ctx[2];
    (void)state;
    memset(&t, 0, sizeof(t));
    assert_int_equal(run_ranks(2, two_groups_rank, &t, ctx), 0);
    for (int r = 0; r < 2; r++)
        if (ctx[r].rc)
            fail_msg("rank %d: %s", r, ctx[r].err);
    assert_int_equal(t.rc_flags, HEP_ERR_INVALID);
    assert_int_not_equal(t.handle[0], t.handle[1]); /* both groups' first dispatch */
    assert_int_equal(t.rc_foreign, HEP_ERR_INVALID);
    assert_int_equal(t.rc_own, HEP_OK);
    assert_int_equal(t.num_recv_async, -1); /* as the header says for HEP_ASYNC */
}

/* D12: a custom bootstrap reports its failure through the public call; every rank sees
 * its text. */
static int failing_allgather(void *ctx, const void *send, void *recv, size_t bytes)
{
    (void)ctx, (void)send, (void)recv, (void)bytes;
    return hep_set_last_error(HEP_ERR_BOOTSTRAP, "store: key %s unreachable", "hep/0");
}
static int failing_barrier(void *ctx)
{
    (void)ctx;
    return HEP_OK;
}

static void custom_bootstrap_failure_carries_its_message_through_set_last_error(void **state)
{
    hep_bootstrap bs = {0, 1, NULL, failing_allgather, failing_barrier};
    hep_config c = host_config(0);
    hep_group *g = (hep_group *)&bs;
    (void)state;
    assert_int_equal(hep_set_last_error(HEP_ERR_REMOTE, "x %d", 5), HEP_ERR_REMOTE);
    assert_string_equal(hep_last_error(), "x 5");
    assert_int_equal(hep_group_create(&c, &bs, 0, &g), HEP_ERR_BOOTSTRAP);
    assert_null(g);
    assert_string_equal(hep_last_error(), "store: key hep/0 unreachable");
}

/* D8, D15: knobs with a sign, blanks, too many digits or garbage are reported, not cast. */
static void env_rejects_signed_and_oversized_values_and_caps_the_timeout(void **state)
{
    const hep_env *e;
    (void)state;
    setenv("HEP_TIMEOUT_MS", " -1", 1);
    e = hep_env_reload();
    assert_int_equal(e->timeout_ms, 30000);
    assert_non_null(strstr(e->errors, "HEP_TIMEOUT_MS=' -1'"));
    setenv("HEP_TIMEOUT_MS", "+5", 1);
    assert_int_equal(hep_env_reload()->timeout_ms, 30000);
    setenv("HEP_TIMEOUT_MS", "18446744073710", 1); /* x 10^6 used to wrap to 0.45 ms */
    e = hep_env_reload();
    assert_int_equal(e->timeout_ms, HEP_TIMEOUT_MAX_MS);
    assert_non_null(strstr(e->errors, "capped"));
    setenv("HEP_TIMEOUT_MS", "99999999999999999999999", 1);
    assert_int_equal(hep_env_reload()->timeout_ms, HEP_TIMEOUT_MAX_MS);
    /* the kernels' longest bound cannot wrap */
    assert_true(hep_timeout_ns() == HEP_TIMEOUT_MAX_MS * 1000000ull);
    assert_true(hep_timeout_ns() * 2 + hep_timeout_ns() / 8 > hep_timeout_ns());
    unsetenv("HEP_TIMEOUT_MS");
    setenv("HEP_IB_GID_INDEX", "99999999999", 1);
    e = hep_env_reload();
    assert_int_equal(e->gid_index, -1);
    assert_non_null(strstr(e->errors, "HEP_IB_GID_INDEX"));
    setenv("HEP_IB_GID_INDEX", "3", 1);
    assert_int_equal(hep_env_reload()->gid_index, 3);
    unsetenv("HEP_IB_GID_INDEX");
    setenv("HEP_NIC_MAP", "garbage", 1);
    e = hep_env_reload();
    assert_null(e->nic_map);
    assert_non_null(strstr(e->errors, "HEP_NIC_MAP='garbage'"));
    setenv("HEP_NIC_MAP", "0:mlx5_0,1:mlx5_1", 1);
    e = hep_env_reload();
    assert_string_equal(e->nic_map, "0:mlx5_0,1:mlx5_1");
    assert_string_equal(e->errors, "");
    unsetenv("HEP_NIC_MAP");
    assert_int_equal(hep_env_reload()->dispatch_stores, HEP_STORES_AUTO);
    setenv("HEP_DISPATCH_STORES", "bulk", 1);
    assert_int_equal(hep_env_reload()->dispatch_stores, HEP_STORES_BULK);
    setenv("HEP_DISPATCH_STORES", "plain", 1);
    assert_int_equal(hep_env_reload()->dispatch_stores, HEP_STORES_PLAIN);
    setenv("HEP_DISPATCH_STORES", "fast", 1);
    e = hep_env_reload();
    assert_int_equal(e->dispatch_stores, HEP_STORES_AUTO);
    assert_non_null(strstr(e->errors, "HEP_DISPATCH_STORES='fast'"));
    unsetenv("HEP_DISPATCH_STORES");
    hep_env_reload();
}

/* D14: each refusal names what is wrong; a valid check leaves no old message. */
static void bad_calls_name_the_bad_argument_and_a_valid_check_clears_the_message(void **state)
{
    hep_config c = host_config(0);
    (void)state;
    assert_int_equal(hep_inproc_world_create(2, NULL), HEP_ERR_INVALID);
    assert_non_null(strstr(hep_last_error(), "NULL"));
    assert_int_equal(hep_config_check(&c, -5), HEP_ERR_INVALID);
    assert_non_null(strstr(hep_last_error(), "world = -5"));
    assert_int_equal(hep_config_check(&c, 4), HEP_OK);
    assert_string_equal(hep_last_error(), "");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(combine_uses_the_routing_of_its_dispatch_not_the_callers_reused_ids),
        cmocka_unit_test(destroy_after_a_timeout_frees_everything_when_every_rank_arrives),
        cmocka_unit_test(
            destroy_without_a_node_mate_keeps_only_that_nodes_own_arenas_and_says_so),
        cmocka_unit_test(a_peer_that_came_is_not_named_missing_when_its_node_mate_is),
        cmocka_unit_test(ignored_expert_id_is_a_warning_and_the_group_goes_on_to_combine),
        cmocka_unit_test(
            dispatch_refuses_unknown_flags_and_combine_refuses_another_groups_handle),
        cmocka_unit_test(custom_bootstrap_failure_carries_its_message_through_set_last_error),
        cmocka_unit_test(env_rejects_signed_and_oversized_values_and_caps_the_timeout),
        cmocka_unit_test(bad_calls_name_the_bad_argument_and_a_valid_check_clears_the_message),
    };
    return cmocka_run_group_tests_name("fault", tests, NULL, NULL);
}
