/* Group creation and destruction on the host backend, one and several (virtual) nodes. */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <cuda_runtime_api.h>
#include <infiniband/verbs.h>

#include "core/core.h"
#include "fake_mr.h"
#include "group/group.h"
#include "net/net.h"
#include "net/proxy.h"
#include "ranks.h"

static _Thread_local int tl_rank = -1;
static _Thread_local int tl_exports;
static int fail_rank = -1, fail_export = -1;

/* The shared DMA-BUF export, failing on one rank's fail_export-th call. */
static int fake_export(void *ctx, uint64_t a, size_t l, int *fd, const char **n, const char **d)
{
    if (tl_rank == fail_rank && ++tl_exports == fail_export) {
        *n = "CUDA_ERROR_INVALID_VALUE";
        *d = "invalid argument";
        return 1;
    }
    return force_export_devnull(ctx, a, l, fd, n, d);
}
static const hep_gpu_mr_ops force_dmabuf = {NULL, force_no_legacy, NULL, NULL,
                                            force_dmabuf_supported, fake_export, NULL, NULL};

typedef struct group_case {
    hep_config cfg;
    int bad_rank;      /* this rank changes a field */
    int bad_hidden;    /* ... to this hidden size */
    int bad_topk;      /* ... or this max_topk */
    int force;         /* registration forced to DMA-BUF */
    int repeat;
    hep_group_info info[8];
} group_case;

static int create_destroy(rank_ctx *r)
{
    group_case *gc = r->arg;
    hep_config c = gc->cfg;
    hep_group_hooks hooks = {gc->force ? &force_dmabuf : NULL, 1};
    hep_group *g = NULL;
    int rc = 0;
    tl_rank = r->rank;
    tl_exports = 0;
    if (r->rank == gc->bad_rank && gc->bad_hidden)
        c.hidden = gc->bad_hidden;
    if (r->rank == gc->bad_rank && gc->bad_topk >= 0)
        c.max_topk = gc->bad_topk;
    for (int i = 0; i < (gc->repeat ? gc->repeat : 1) && rc == 0; i++) {
        rc = hep_group_create_ex(&c, &r->bs, 0, &hooks, &g);
        if (rc)
            return rc;
        hep_group_get_info(g, &gc->info[r->rank]);
        rc = hep_group_destroy(g);
    }
    return rc;
}

static hep_config small_config(void)
{
    hep_config c = test_config(256, 16, 2, 2, HEP_DTYPE_BF16);
    c.backend = HEP_BACKEND_HOST;
    return c;
}

static int banners;
static void count_banner(void *ctx, int level, const char *line)
{
    (void)ctx, (void)level;
    if (strcmp(line, "[HybridEP] legacy GPU memory registration is unavailable; using DMA-BUF "
                     "registration") == 0)
        banners++;
}

static void group_single_node_picks_ranks_per_host(void **state)
{
    group_case gc = {small_config(), -1, 0, -1, 0, 0, {{0}}};
    rank_ctx ctx[4];
    (void)state;
    assert_int_equal(run_ranks(4, create_destroy, &gc, ctx), 0);
    for (int r = 0; r < 4; r++) {
        assert_int_equal(ctx[r].rc, HEP_OK);
        assert_int_equal(gc.info[r].ranks_per_node, 4);
        assert_int_equal(gc.info[r].nodes, 1);
        assert_int_equal(gc.info[r].local_rank, r);
        assert_string_equal(gc.info[r].transport, "none");
        assert_int_equal(gc.info[r].max_recv_rows, 64);
    }
}

static void group_config_mismatch_fails_every_rank_naming_field_and_ranks(void **state)
{
    group_case gc = {small_config(), 3, 512, -1, 0, 0, {{0}}};
    rank_ctx ctx[4];
    (void)state;
    assert_int_equal(run_ranks(4, create_destroy, &gc, ctx), 0);
    for (int r = 0; r < 4; r++) {
        assert_int_equal(ctx[r].rc, HEP_ERR_MISMATCH);
        assert_non_null(strstr(ctx[r].err, "field 'hidden' is 256 on rank 0 but 512 on rank 3"));
    }
}

static void group_invalid_field_on_one_rank_fails_every_rank(void **state)
{
    group_case gc = {small_config(), 1, 0, 0, 0, 0, {{0}}};
    rank_ctx ctx[4];
    (void)state;
    assert_int_equal(run_ranks(4, create_destroy, &gc, ctx), 0);
    for (int r = 0; r < 4; r++) {
        assert_int_equal(ctx[r].rc, HEP_ERR_INVALID);
        assert_non_null(strstr(ctx[r].err, "config.max_topk = 0"));
        if (r != 1)
            assert_non_null(strstr(ctx[r].err, "rank 1: "));
    }
}

static void group_two_nodes_register_all_fourteen_via_dmabuf_with_one_banner_per_node(
    void **state)
{
    group_case gc = {small_config(), -1, 0, -1, 1, 0, {{0}}};
    rank_ctx ctx[4];
    hep_loopback_stats st;
    int fds = count_fds();
    (void)state;
    gc.cfg.dtype = HEP_DTYPE_FP8_E4M3; /* FP8: the scaling-factor buffers too, all 14 */
    gc.cfg.ranks_per_node = 2;
    banners = 0;
    hep_log_set_sink(count_banner, NULL);
    assert_int_equal(run_ranks(4, create_destroy, &gc, ctx), 0);
    hep_log_set_sink(NULL, NULL);
    for (int r = 0; r < 4; r++) {
        if (ctx[r].rc)
            fail_msg("rank %d: %s", r, ctx[r].err);
        assert_int_equal(gc.info[r].nodes, 2);
        assert_int_equal(gc.info[r].node, r / 2);
        assert_int_equal(gc.info[r].registrations, 14);
        assert_int_equal(gc.info[r].dmabuf_registrations, 14);
        assert_string_equal(gc.info[r].transport, "loopback");
    }
    assert_int_equal(banners, 2);
    hep_loopback_get_stats(&st);
    assert_int_equal(st.live_mrs, 0);
    assert_int_equal(count_fds(), fds);
}

static void group_legacy_registration_prints_no_banner(void **state)
{
    group_case gc = {small_config(), -1, 0, -1, 0, 0, {{0}}};
    rank_ctx ctx[4];
    (void)state;
    gc.cfg.ranks_per_node = 1;
    banners = 0;
    hep_log_set_sink(count_banner, NULL);
    assert_int_equal(run_ranks(4, create_destroy, &gc, ctx), 0);
    hep_log_set_sink(NULL, NULL);
    for (int r = 0; r < 4; r++) {
        assert_int_equal(ctx[r].rc, HEP_OK);
        assert_int_equal(gc.info[r].registrations, 12); /* BF16: no scaling-factor buffers */
        assert_int_equal(gc.info[r].dmabuf_registrations, 0);
    }
    assert_int_equal(banners, 0);
}

static void group_failed_registration_fails_every_rank_with_that_buffers_message(void **state)
{
    group_case gc = {small_config(), -1, 0, -1, 1, 0, {{0}}};
    rank_ctx ctx[4];
    hep_loopback_stats st;
    int fds = count_fds();
    (void)state;
    gc.cfg.ranks_per_node = 2;
    fail_rank = 2;
    fail_export = 4; /* BF16: the 4th registration is dispatch.rdma_inter_node_group_token */
    assert_int_equal(run_ranks(4, create_destroy, &gc, ctx), 0);
    fail_rank = fail_export = -1;
    for (int r = 0; r < 4; r++) {
        assert_int_equal(ctx[r].rc, HEP_ERR_CUDA);
        if (!strstr(ctx[r].err, "'dispatch.rdma_inter_node_group_token'") ||
            !strstr(ctx[r].err, "CUDA_ERROR_INVALID_VALUE"))
            fail_msg("rank %d: %s", r, ctx[r].err);
        if (r != 2)
            assert_non_null(strstr(ctx[r].err, "rank 2: "));
    }
    hep_loopback_get_stats(&st);
    assert_int_equal(st.live_mrs, 0);
    assert_int_equal(count_fds(), fds);
}

static void group_create_destroy_100_times_leaks_no_fd_thread_or_registration(void **state)
{
    group_case gc = {small_config(), -1, 0, -1, 1, 100, {{0}}};
    rank_ctx ctx[4];
    hep_loopback_stats st;
    int fds = count_fds(), threads = count_threads();
    (void)state;
    gc.cfg.ranks_per_node = 2;
    hep_log_set_sink(count_banner, NULL); /* keep 200 banners off the test output */
    assert_int_equal(run_ranks(4, create_destroy, &gc, ctx), 0);
    hep_log_set_sink(NULL, NULL);
    for (int r = 0; r < 4; r++)
        assert_int_equal(ctx[r].rc, HEP_OK);
    hep_loopback_get_stats(&st);
    assert_int_equal(st.live_mrs, 0);
    assert_int_equal(count_fds(), fds);
    assert_int_equal(count_threads(), threads);
}

static void group_gpu_backend_without_a_gpu_fails_with_a_cuda_message(void **state)
{
    group_case gc = {small_config(), -1, 0, -1, 0, 0, {{0}}};
    rank_ctx ctx[2];
    int n = 0;
    (void)state;
    if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0)
        skip(); /* this machine has a GPU: the GPU tests cover the backend */
    (void)cudaGetLastError();
    gc.cfg.backend = HEP_BACKEND_GPU;
    assert_int_equal(run_ranks(2, create_destroy, &gc, ctx), 0);
    for (int r = 0; r < 2; r++) {
#ifdef HEP_NO_CUDA /* a build without CUDA names what is missing */
        assert_int_equal(ctx[r].rc, HEP_ERR_UNAVAILABLE);
        assert_non_null(strstr(ctx[r].err, "configured without a CUDA toolkit"));
#else
        assert_int_equal(ctx[r].rc, HEP_ERR_CUDA);
        assert_non_null(strstr(ctx[r].err, "selecting CUDA device"));
#endif
    }
}

/* 2 nodes x 2 ranks, host backend: rank 0's 6 tokens with a fixed routing; after one
 * dispatch the proxy of rank 0 sent its peer (rank 2) exactly the tokens that node 1 needs,
 * once each (rows, routing, FP8 scales), plus its arrival word, one count and one flag. */
typedef struct wire_case {
    uint64_t bytes[4], data_wrs[4], flag_wrs[4];
    int rc[4];
} wire_case;

static int wire_rank(rank_ctx *r)
{
    wire_case *w = r->arg;
    hep_config c = test_config(256, 8, 2, 2, HEP_DTYPE_FP8_E4M3);
    hep_group *g = NULL;
    hep_dispatch_args da;
    hep_dispatch_result dr;
    hep_proxy_peer_stats st;
    /* experts 0-3 on node 0 (ranks 0, 1), 4-7 on node 1 (ranks 2, 3) */
    static const int ids[6][2] = {{0, 4}, {1, 2}, {5, 6}, {7, -1}, {3, 3}, {-1, -1}};
    static float wts[6][2] = {{.5f, .5f}, {.25f, .75f}, {1, 0}, {1, 0}, {.5f, .5f}, {0, 0}};
    static uint8_t tok[4][6][256];
    static float sc[4][6][2];
    int rc;
    c.backend = HEP_BACKEND_HOST;
    c.ranks_per_node = 2;
    rc = hep_group_create(&c, &r->bs, 0, &g);
    if (rc)
        return rc;
    memset(&da, 0, sizeof(da));
    da.num_tokens = r->rank == 0 ? 6 : 0; /* only rank 0 sends */
    da.tokens = tok[r->rank];
    da.scales = &sc[r->rank][0][0];
    da.topk_idx = ids;
    da.topk = 2;
    da.topk_weights = &wts[0][0];
    rc = hep_dispatch(g, &da, &dr);
    /* rank 0 alone writes w: another rank storing back what it read would lose its update */
    for (int p = 0; rc == 0 && r->rank == 0 && p < 4; p++) {
        hep_proxy_stats(g->proxy, p, &st);
        w->bytes[p] = st.bytes;
        w->data_wrs[p] = st.data_wrs;
        w->flag_wrs[p] = st.flag_wrs;
    }
    w->rc[r->rank] = rc;
    if (rc == 0) {
        hep_combine_args ca = {dr.handle, hep_combine_input(g), tok[r->rank], NULL, 0};
        rc = hep_combine(g, &ca);
    }
    hep_group_destroy(g);
    return rc;
}

static void group_internode_dispatch_sends_each_peer_exactly_what_its_node_needs(void **state)
{
    static wire_case w;
    rank_ctx ctx[4];
    /* node 1 needs tokens 0, 2, 3 (experts 4, 5-6, 7): ahead of the rows the 8-byte count
     * and the count block (2 ranks x (2 experts + 1) i32 = 3 words), then the arrival word
     * (a flag write); then 3 rows of 256 B, 3 x 2 ids (i32) and 3 x 2 weights, 3 x 2 FP8
     * scales (one chunk), the chunk's flag and the slot's flag (flag writes) */
    const uint64_t expect = 8 + 3 * 8 + 3 * 256 + 3 * 2 * 4 + 3 * 2 * 4 + 3 * 2 * 4;
    (void)state;
    memset(&w, 0, sizeof(w));
    assert_int_equal(run_ranks(4, wire_rank, &w, ctx), 0);
    for (int r = 0; r < 4; r++)
        if (ctx[r].rc)
            fail_msg("rank %d: %s", r, ctx[r].err);
    assert_int_equal(w.bytes[2], expect);
    assert_int_equal(w.flag_wrs[2], 3);
    /* the rows are packed in the send slot: the count and the count block, then one write
     * per buffer (4 buffers) */
    assert_int_equal(w.data_wrs[2], 2 + 4);
    for (int p = 0; p < 4; p++)
        if (p != 2)
            assert_int_equal(w.bytes[p], 0); /* nothing to its own node, nothing to rank 3 */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(group_single_node_picks_ranks_per_host),
        cmocka_unit_test(group_config_mismatch_fails_every_rank_naming_field_and_ranks),
        cmocka_unit_test(group_invalid_field_on_one_rank_fails_every_rank),
        cmocka_unit_test(
            group_two_nodes_register_all_fourteen_via_dmabuf_with_one_banner_per_node),
        cmocka_unit_test(group_legacy_registration_prints_no_banner),
        cmocka_unit_test(group_failed_registration_fails_every_rank_with_that_buffers_message),
        cmocka_unit_test(group_create_destroy_100_times_leaks_no_fd_thread_or_registration),
        cmocka_unit_test(group_gpu_backend_without_a_gpu_fails_with_a_cuda_message),
        cmocka_unit_test(group_internode_dispatch_sends_each_peer_exactly_what_its_node_needs),
    };
    return cmocka_run_group_tests_name("group", tests, NULL, NULL);
}
