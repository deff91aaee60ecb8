/* The host backend: hand-computed cases, edge cases, random cases against the oracle,
 * and the timeout that names the rank that never called dispatch. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core/core.h"
#include "ep_case.h"
#include "fake_mr.h"

static hep_config cfg(int H, int T, int El, int K, hep_dtype dt)
{
    hep_config c = test_config(H, T, El, K, dt);
    c.backend = HEP_BACKEND_HOST;
    return c;
}

/* A case of `world` ranks with K slots, nobody skipping; the caller fills the inputs. */
static void init_case(ep_case *c, hep_config conf, int world, int K)
{
    memset(c, 0, sizeof(*c));
    c->cfg = conf;
    c->world = world;
    c->K = K;
    c->skip_rank = -1;
}

static void set_rank(ep_case *c, int r, int t, const int *ids, const float *w)
{
    const int H = c->cfg.hidden;
    ep_rank_in *in = &c->in[r];
    in->t = t;
    in->tokens = malloc((size_t)(t + 1) * H * 2);
    for (int i = 0; i < t; i++)
        for (int h = 0; h < H; h++)
            ((uint16_t *)in->tokens)[i * H + h] = bf16_of((float)(r * 100 + i * 10 + h % 4));
    in->idx = malloc((size_t)(t + 1) * c->K * 4);
    memcpy(in->idx, ids, (size_t)t * c->K * 4);
    in->weights = malloc((size_t)(t + 1) * c->K * 4);
    memcpy(in->weights, w, (size_t)t * c->K * 4);
}

static void assert_ok(const ep_case *c)
{
    for (int r = 0; r < c->world; r++)
        if (c->out[r].rc_dispatch || c->out[r].rc_combine)
            fail_msg("rank %d: dispatch %d combine %d: %s", r, c->out[r].rc_dispatch,
                     c->out[r].rc_combine, c->out[r].err);
}

/* 2 ranks, 2 experts each; rank 0: t0 -> {0, 3}, t1 -> {2, -1}, t2 -> {1, 1};
 * rank 1: u0 -> {3, 2}, u1 -> {-1, -1}, u2 -> {0, 2}. Worked out by hand below. */
static void host_dispatch_and_combine_match_hand_computed_case(void **state)
{
    static ep_case c;
    const int ids0[] = {0, 3, 2, -1, 1, 1}, ids1[] = {3, 2, -1, -1, 0, 2};
    const float w0[] = {.5f, .25f, .75f, .125f, .375f, .0625f}, w1[] = {.5f, .5f, 1, 1, .25f, .125f};
    const ep_rank_out *o0 = &c.out[0], *o1 = &c.out[1];
    (void)state;
    init_case(&c, cfg(8, 3, 2, 2, HEP_DTYPE_BF16), 2, 2);
    set_rank(&c, 0, 3, ids0, w0);
    set_rank(&c, 1, 3, ids1, w1);
    assert_int_equal(ep_case_run(&c), 0);
    assert_ok(&c);
    /* rank 0 receives [rank 0: t0, t2][rank 1: u2] */
    assert_int_equal(o0->num_recv, 3);
    assert_int_equal(f32_of_bf16(((uint16_t *)o0->tokens)[0 * 8]), 0);   /* t0 */
    assert_int_equal(f32_of_bf16(((uint16_t *)o0->tokens)[1 * 8]), 20);  /* t2 */
    assert_int_equal(f32_of_bf16(((uint16_t *)o0->tokens)[2 * 8]), 120); /* u2 */
    assert_true(o0->probs[0] == .5f && o0->probs[1] == 0);
    assert_true(o0->probs[2] == 0 && o0->probs[3] == .375f + .0625f); /* expert 1 twice */
    assert_true(o0->probs[4] == .25f && o0->probs[5] == 0);
    assert_int_equal(o0->tpe[0], 2); /* t0, u2 */
    assert_int_equal(o0->tpe[1], 1); /* t2, once however many slots */
    /* rank 1 receives [rank 0: t0, t1][rank 1: u0, u2] */
    assert_int_equal(o1->num_recv, 4);
    assert_int_equal(f32_of_bf16(((uint16_t *)o1->tokens)[1 * 8]), 10);  /* t1 */
    assert_int_equal(f32_of_bf16(((uint16_t *)o1->tokens)[2 * 8]), 100); /* u0 */
    assert_true(o1->probs[0] == 0 && o1->probs[1] == .25f);   /* t0: expert 3 */
    assert_true(o1->probs[2] == .75f && o1->probs[3] == 0);   /* t1: expert 2 */
    assert_true(o1->probs[4] == .5f && o1->probs[5] == .5f);  /* u0: experts 3 and 2 */
    assert_true(o1->probs[6] == .125f && o1->probs[7] == 0);  /* u2: expert 2 */
    assert_int_equal(o1->tpe[0], 3);
    assert_int_equal(o1->tpe[1], 2);
    /* combine: expert_out row j on rank d is (d + 1) * 8 + j (+ 0.25 * (h % 5)) */
    assert_true(f32_of_bf16(o0->combined[0]) == 8 + 16);  /* t0 = X0[0] + X1[0] */
    assert_true(f32_of_bf16(o0->combined[8]) == 17);      /* t1 = X1[1] */
    assert_true(f32_of_bf16(o0->combined[16]) == 9);      /* t2 = X0[1] */
    assert_true(f32_of_bf16(o1->combined[0]) == 18);      /* u0 = X1[2] */
    assert_true(f32_of_bf16(o1->combined[8]) == 0);       /* u1: routed nowhere */
    assert_true(f32_of_bf16(o1->combined[16]) == 10 + 19); /* u2 = X0[2] + X1[3] */
    assert_true(f32_of_bf16(o1->combined[16 + 1]) == 10.25f + 19.25f);
    assert_int_equal(ep_case_check(&c), 0);
    ep_case_free(&c);
}

static void run_case(hep_config conf, int world, int K, int index64, int skew, int zero_copy,
                     unsigned seed, int force_t, int repeat)
{
    static ep_case c;
    init_case(&c, conf, world, K);
    c.index64 = index64;
    c.zero_copy = zero_copy;
    c.repeat = repeat;
    c.has_t_fixed = force_t >= 0;
    c.t_fixed = force_t;
    ep_case_random(&c, seed, skew);
    assert_int_equal(ep_case_run(&c), 0);
    assert_ok(&c);
    assert_int_equal(ep_case_check(&c), 0);
    ep_case_free(&c);
}

static void run_random(hep_config conf, int world, int K, int index64, int skew, int zero_copy,
                       unsigned seed, int force_t)
{
    run_case(conf, world, K, index64, skew, zero_copy, seed, force_t, 1);
}

static void host_random_bf16_int32_matches_oracle(void **state)
{
    (void)state;
    for (unsigned s = 1; s <= 5; s++)
        run_random(cfg(256, 24, 3, 4, HEP_DTYPE_BF16), 4, 4, 0, 0, 0, s, -1);
}

static void host_random_fp8_int64_zero_copy_carries_scales(void **state)
{
    (void)state;
    for (unsigned s = 10; s <= 13; s++)
        run_random(cfg(384, 20, 2, 3, HEP_DTYPE_FP8_E4M3), 3, 3, 1, 0, 1, s, -1);
}

static void host_skewed_routing_all_tokens_to_one_rank(void **state)
{
    (void)state;
    run_random(cfg(128, 30, 4, 2, HEP_DTYPE_BF16), 4, 2, 0, 1, 0, 99, -1);
}

static void host_zero_tokens_and_full_capacity(void **state)
{
    (void)state;
    run_random(cfg(64, 16, 2, 2, HEP_DTYPE_BF16), 4, 2, 0, 0, 0, 5, 0);  /* t = 0 */
    run_random(cfg(64, 16, 2, 2, HEP_DTYPE_BF16), 4, 2, 0, 0, 0, 6, 16); /* t = T */
}

static void host_topk_one(void **state)
{
    (void)state;
    run_random(cfg(64, 16, 2, 1, HEP_DTYPE_BF16), 2, 1, 0, 0, 0, 7, -1);
}

static void host_invalid_expert_id_is_reported_and_ignored(void **state)
{
    static ep_case c;
    const int ids0[] = {0, 9}, ids1[] = {1, 2};
    const float w[] = {1, 1};
    (void)state;
    init_case(&c, cfg(8, 1, 2, 2, HEP_DTYPE_BF16), 2, 2);
    set_rank(&c, 0, 1, ids0, w);
    set_rank(&c, 1, 1, ids1, w);
    assert_int_equal(ep_case_run(&c), 0);
    assert_int_equal(c.out[0].rc_dispatch, HEP_WARN_IGNORED); /* it happened: combine follows */
    assert_non_null(strstr(c.out[0].err, "topk_idx[0][1] = 9 is not -1 or an expert id in 0..3"));
    assert_int_equal(c.out[1].rc_dispatch, HEP_OK);
    assert_int_equal(c.out[0].num_recv, 2); /* its own token (expert 0) and rank 1's */
    ((int *)c.in[0].idx)[1] = -1;           /* the oracle ignores the slot as well */
    assert_int_equal(ep_case_check(&c), 0);
    ep_case_free(&c);
}

static void host_dispatch_times_out_naming_the_rank_that_never_called(void **state)
{
    static ep_case c;
    (void)state;
    setenv("HEP_TIMEOUT_MS", "300", 1);
    hep_env_reload();
    init_case(&c, cfg(64, 8, 2, 2, HEP_DTYPE_BF16), 4, 2);
    c.skip_rank = 2;
    ep_case_random(&c, 3, 0);
    assert_int_equal(ep_case_run(&c), 0);
    unsetenv("HEP_TIMEOUT_MS");
    hep_env_reload();
    for (int r = 0; r < 4; r++) {
        if (r == 2)
            continue;
        assert_int_equal(c.out[r].rc_dispatch, HEP_ERR_TIMEOUT);
        if (!strstr(c.out[r].err, "rank 2 did not arrive"))
            fail_msg("rank %d: %s", r, c.out[r].err);
    }
    ep_case_free(&c);
}

static void host_repeated_calls_stay_correct(void **state)
{
    static ep_case c;
    (void)state;
    init_case(&c, cfg(128, 12, 2, 3, HEP_DTYPE_BF16), 4, 3);
    c.repeat = 7; /* monotonic flags across calls */
    ep_case_random(&c, 21, 0);
    assert_int_equal(ep_case_run(&c), 0);
    assert_ok(&c);
    assert_int_equal(ep_case_check(&c), 0);
    ep_case_free(&c);
}

static void run_nodes(int nodes, int R, hep_dtype dt, int index64, int zero_copy, int force_t,
                      int repeat, unsigned seed)
{
    hep_config conf = cfg(256, 20, 2, 4, dt);
    conf.ranks_per_node = R;
    run_case(conf, nodes * R, 4, index64, 0, zero_copy, seed, force_t, repeat);
}

static void host_two_nodes_of_two_ranks_match_the_oracle(void **state)
{
    (void)state;
    for (unsigned s = 40; s < 44; s++)
        run_nodes(2, 2, HEP_DTYPE_BF16, 0, 0, -1, 1, s);
}

static void host_four_nodes_of_one_rank_fp8_int64(void **state)
{
    (void)state;
    run_nodes(4, 1, HEP_DTYPE_FP8_E4M3, 1, 1, -1, 1, 50);
}

static void host_two_nodes_of_four_at_zero_and_full_capacity_repeated(void **state)
{
    (void)state;
    run_nodes(2, 4, HEP_DTYPE_BF16, 0, 1, 0, 2, 60);
    run_nodes(2, 4, HEP_DTYPE_FP8_E4M3, 0, 0, 20, 3, 61);
}

/* ep_many_nodes_cases (ep_case.h) on the host backend against the oracle: the harness and
 * the oracle at up to 128 ranks, the nodes past one word of 32 included. */
static void host_many_nodes_past_one_word_match_the_oracle(void **state)
{
    (void)state;
    for (size_t k = 0; k < EP_MANY_NODES_CASES; k++) {
        const ep_many_nodes_case *m = &ep_many_nodes_cases[k];
        hep_config conf = cfg(256, 16, 4, 8, m->dt);
        conf.ranks_per_node = m->R;
        run_case(conf, m->N * m->R, 8, m->index64, m->skew, 0, 70u + (unsigned)k,
                 m->t_is_T ? 16 : -1, 2);
    }
}

static void host_internode_dispatch_times_out_naming_the_silent_rank(void **state)
{
    static ep_case c;
    (void)state;
    setenv("HEP_TIMEOUT_MS", "300", 1);
    hep_env_reload();
    init_case(&c, cfg(64, 8, 2, 2, HEP_DTYPE_BF16), 4, 2);
    c.cfg.ranks_per_node = 2;
    c.skip_rank = 3; /* node 1 */
    ep_case_random(&c, 9, 0);
    assert_int_equal(ep_case_run(&c), 0);
    unsetenv("HEP_TIMEOUT_MS");
    hep_env_reload();
    for (int r = 0; r < 3; r++) {
        assert_int_equal(c.out[r].rc_dispatch, HEP_ERR_TIMEOUT);
        if (!strstr(c.out[r].err, "rank 3 did not arrive"))
            fail_msg("rank %d: %s", r, c.out[r].err);
    }
    ep_case_free(&c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(host_dispatch_and_combine_match_hand_computed_case),
        cmocka_unit_test(host_random_bf16_int32_matches_oracle),
        cmocka_unit_test(host_random_fp8_int64_zero_copy_carries_scales),
        cmocka_unit_test(host_skewed_routing_all_tokens_to_one_rank),
        cmocka_unit_test(host_zero_tokens_and_full_capacity),
        cmocka_unit_test(host_topk_one),
        cmocka_unit_test(host_invalid_expert_id_is_reported_and_ignored),
        cmocka_unit_test(host_dispatch_times_out_naming_the_rank_that_never_called),
        cmocka_unit_test(host_repeated_calls_stay_correct),
        cmocka_unit_test(host_two_nodes_of_two_ranks_match_the_oracle),
        cmocka_unit_test(host_four_nodes_of_one_rank_fp8_int64),
        cmocka_unit_test(host_two_nodes_of_four_at_zero_and_full_capacity_repeated),
        cmocka_unit_test(host_many_nodes_past_one_word_match_the_oracle),
        cmocka_unit_test(host_internode_dispatch_times_out_naming_the_silent_rank),
    };
    return cmocka_run_group_tests_name("host_backend", tests, NULL, NULL);
}
