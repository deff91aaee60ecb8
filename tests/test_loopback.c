/* The loopback NIC refuses what a NIC refuses and lands writes where a NIC would. */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>
#include <infiniband/verbs.h>

#include "core/core.h"
#include "fake_mr.h"
#include "net/net.h"
#include "ranks.h"

#define ACC (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)

typedef struct two_nics {
    hep_net *a, *b;
} two_nics;

static int setup(void **state)
{
    static two_nics t;
    assert_int_equal(hep_loopback_create(0, 2, &t.a), HEP_OK);
    assert_int_equal(hep_loopback_create(1, 2, &t.b), HEP_OK);
    *state = &t;
    return 0;
}

static int teardown(void **state)
{
    two_nics *t = *state;
    t->a->v->destroy(t->a);
    t->b->v->destroy(t->b);
    return 0;
}

static void loopback_write_lands_and_wrong_key_or_range_is_refused(void **state)
{
    two_nics *t = *state;
    static char src[4096], dst[4096];
    hep_gpu_mr ms, md;
    hep_net_completion c[4];
    hep_loopback_stats st0, st1;
    for (int i = 0; i < 4096; i++)
        src[i] = (char)(i * 7);
    assert_int_equal(hep_gpu_mr_register(&t->a->mr_ops, t->a->pd, 0, src, 4096, ACC, "s", &ms), 0);
    assert_int_equal(hep_gpu_mr_register(&t->b->mr_ops, t->b->pd, 0, dst, 4096, ACC, "d", &md), 0);
    assert_int_equal(ms.path, HEP_MR_LEGACY);
    hep_loopback_get_stats(&st0);
    assert_int_equal(t->a->v->write(t->a, 1, ms.lkey, ms.addr + 10, md.rkey, md.addr + 100, 50, 9),
                     HEP_OK);
    assert_memory_equal(dst + 100, src + 10, 50);
    assert_int_equal(dst[99], 0);
    assert_int_equal(dst[150], 0);
    assert_int_equal(t->a->v->poll(t->a, c, 4), 1);
    assert_int_equal(c[0].wr_id, 9);
    assert_int_equal(c[0].status, 0);
    /* a wrong remote key */
    assert_int_equal(t->a->v->write(t->a, 1, ms.lkey, ms.addr, md.rkey + 1, md.addr, 8, 1),
                     HEP_ERR_VERBS);
    assert_non_null(strstr(hep_last_error(), "remote key"));
    /* the lkey used as an rkey */
    assert_int_equal(t->a->v->write(t->a, 1, ms.lkey, ms.addr, md.lkey, md.addr, 8, 1),
                     HEP_ERR_VERBS);
    /* one byte past the end of the remote registration */
    assert_int_equal(t->a->v->write(t->a, 1, ms.lkey, ms.addr, md.rkey, md.addr + 4090, 7, 1),
                     HEP_ERR_VERBS);
    assert_non_null(strstr(hep_last_error(), "outside its registration"));
    /* local range outside, and another NIC's local key */
    assert_int_equal(t->a->v->write(t->a, 1, ms.lkey, ms.addr - 1, md.rkey, md.addr, 8, 1),
                     HEP_ERR_VERBS);
    assert_int_equal(t->a->v->write(t->a, 1, md.lkey, md.addr, md.rkey, md.addr, 8, 1),
                     HEP_ERR_VERBS);
    /* the right key, but the rank that does not own it */
    assert_int_equal(t->a->v->write(t->a, 0, ms.lkey, ms.addr, md.rkey, md.addr, 8, 1),
                     HEP_ERR_VERBS);
    hep_loopback_get_stats(&st1);
    assert_int_equal(st1.refused - st0.refused, 6);
    assert_int_equal(st1.writes - st0.writes, 1);
    assert_int_equal(t->a->v->poll(t->a, c, 4), 0);
    assert_int_equal(hep_gpu_mr_deregister(&ms), 0);
    assert_int_equal(hep_gpu_mr_deregister(&md), 0);
    /* a deregistered key is refused */
    assert_int_equal(t->a->v->write(t->a, 1, ms.lkey, (uint64_t)(uintptr_t)src,
                                    md.rkey, (uint64_t)(uintptr_t)dst, 8, 1), HEP_ERR_VERBS);
}

static void loopback_dmabuf_write_by_original_address_lands_at_the_right_byte(void **state)
{
    two_nics *t = *state;
    static char src[64];
    static char region[3 * 4096] __attribute__((aligned(4096)));
    char *dst = region + 4096 + 0x123; /* an interior, unaligned buffer */
    hep_gpu_mr ms, md;
    hep_gpu_mr_ops forced = t->b->mr_ops;
    hep_loopback_stats st;
    int fds_before = 0, fds_after = 0;
    forced.reg_mr = force_no_legacy;
    forced.dmabuf_supported = force_dmabuf_supported;
    forced.export_dmabuf = force_export_devnull;
    memset(region, 0, sizeof(region));
    for (int i = 0; i < 64; i++)
        src[i] = (char)(100 + i);
    fds_before = count_fds();
    assert_int_equal(hep_gpu_mr_register(&t->a->mr_ops, t->a->pd, 0, src, 64, ACC, "s", &ms), 0);
    assert_int_equal(hep_gpu_mr_register(&forced, t->b->pd, 0, dst, 200, ACC,
                                         "combine.attn_output_flags", &md), 0);
    assert_int_equal(md.path, HEP_MR_DMABUF);
    assert_int_equal(md.export_addr, (uint64_t)(uintptr_t)(region + 4096));
    assert_int_equal(md.export_length, 4096);
    assert_ptr_equal(md.mr->addr, NULL); /* rdma-core's offset, not an address */
    /* addressed by the original VA + 5: lands at dst[5] */
    assert_int_equal(t->a->v->write(t->a, 1, ms.lkey, ms.addr, md.rkey, md.addr + 5, 64, 1), 0);
    assert_memory_equal(dst + 5, src, 64);
    assert_int_equal(dst[4], 0);
    assert_int_equal(dst[69], 0);
    /* addressed by ibv_mr::addr (the offset): refused as a NIC refuses it */
    assert_int_equal(t->a->v->write(t->a, 1, ms.lkey, ms.addr,
                                    md.rkey, (uint64_t)(uintptr_t)md.mr->addr, 8, 2),
                     HEP_ERR_VERBS);
    hep_gpu_mr_deregister(&ms);
    hep_gpu_mr_deregister(&md);
    fds_after = count_fds();
    assert_int_equal(fds_after, fds_before); /* the exported fd was closed */
    hep_loopback_get_stats(&st);
    assert_int_equal(st.live_mrs, 0);
}

/* Across processes, simulated in one: rank 1's window is a segment at one address, and
 * rank 0 is told it is mapped at another (a memory of its own here, so that the test sees
 * which one a write went through), as it is in another process. Rank 2's window is not
 * mapped at rank 0. */
typedef struct xp_world {
    hep_loopback_window win[3][3]; /* [nic][rank] */
    char *mem[3];                  /* each rank's registration, in its own window */
    hep_net *nic[3];
    hep_gpu_mr mr[3];
    int reg_rc[3], outside_rc[3];
} xp_world;

static int xp_rank(rank_ctx *r)
{
    xp_world *w = r->arg;
    const int k = r->rank;
    int rc = hep_loopback_create_shared(k, 3, w->win[k], &w->nic[k]);
    hep_gpu_mr outside;
    static char elsewhere[64];
    if (rc)
        return rc;
    w->reg_rc[k] = hep_gpu_mr_register(&w->nic[k]->mr_ops, w->nic[k]->pd, 0, w->mem[k], 1024,
                                       ACC, "x", &w->mr[k]);
    /* memory outside the window: no other process could reach it */
    w->outside_rc[k] = hep_gpu_mr_register(&w->nic[k]->mr_ops, w->nic[k]->pd, 0, elsewhere,
                                           sizeof(elsewhere), ACC, "outside", &outside);
    return w->nic[k]->v->connect(w->nic[k], &r->bs);
}

static void loopback_across_processes_reaches_the_peer_mapping_with_the_same_checks(void **state)
{
    static xp_world w;
    static char own0[8192], own2[8192];
    const size_t L = 4 * 4096;
    rank_ctx ctx[3];
    hep_net_completion c[4];
    hep_loopback_stats st0, st1;
    char *seg_own, *seg_at0;
    (void)state;
    memset(&w, 0, sizeof(w));
    seg_own = mmap(NULL, L, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    seg_at0 = mmap(NULL, L, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(seg_own != MAP_FAILED && seg_at0 != MAP_FAILED && seg_own != seg_at0);
    for (int k = 0; k < 3; k++) {
        w.win[k][0] = (hep_loopback_window){(uint64_t)(uintptr_t)own0, sizeof(own0), own0};
        w.win[k][1] = (hep_loopback_window){(uint64_t)(uintptr_t)seg_own, L, seg_own};
        w.win[k][2] = (hep_loopback_window){(uint64_t)(uintptr_t)own2, sizeof(own2), own2};
    }
    w.win[0][1].here = seg_at0; /* rank 0 sees rank 1's memory at its own mapping ... */
    w.win[0][2].here = NULL;    /* ... and rank 2's not at all */
    w.mem[0] = own0 + 16;
    w.mem[1] = seg_own + 4096 + 0x123; /* an interior, unaligned registration */
    w.mem[2] = own2;
    assert_int_equal(run_ranks(3, xp_rank, &w, ctx), 0);
    for (int k = 0; k < 3; k++) {
        assert_int_equal(ctx[k].rc, HEP_OK);
        assert_int_equal(w.reg_rc[k], HEP_OK);
        assert_int_not_equal(w.outside_rc[k], HEP_OK);
    }
    for (int i = 0; i < 1024; i++)
        w.mem[0][i] = (char)(i * 3 + 1);
    hep_loopback_get_stats(&st0);
    /* addressed by rank 1's own address: written at the same byte of rank 0's mapping */
    assert_int_equal(w.nic[0]->v->write(w.nic[0], 1, w.mr[0].lkey, w.mr[0].addr + 10,
                                        w.mr[1].rkey, w.mr[1].addr + 100, 50, 7),
                     HEP_OK);
    {
        const char *at0 = seg_at0 + (w.mem[1] - seg_own);
        assert_memory_equal(at0 + 100, w.mem[0] + 10, 50);
        assert_int_equal(at0[99], 0);
        assert_int_equal(at0[150], 0);
        assert_int_equal(w.mem[1][100], 0); /* not through rank 1's address */
        memcpy(w.mem[1], at0, 1024);        /* what rank 1 would see: shared memory */
    }
    assert_int_equal(w.nic[0]->v->poll(w.nic[0], c, 4), 1);
    assert_int_equal(c[0].wr_id, 7);
    /* the refusals of one process: wrong key, the lkey as rkey, past the end, before the
     * start, another rank's key for this peer */
    assert_int_equal(w.nic[0]->v->write(w.nic[0], 1, w.mr[0].lkey, w.mr[0].addr,
                                        w.mr[1].rkey + 1, w.mr[1].addr, 8, 1),
                     HEP_ERR_VERBS);
    assert_non_null(strstr(hep_last_error(), "remote key"));
    assert_int_equal(w.nic[0]->v->write(w.nic[0], 1, w.mr[0].lkey, w.mr[0].addr, w.mr[1].lkey,
                                        w.mr[1].addr, 8, 1),
                     HEP_ERR_VERBS);
    assert_int_equal(w.nic[0]->v->write(w.nic[0], 1, w.mr[0].lkey, w.mr[0].addr,
                                        w.mr[1].rkey, w.mr[1].addr + 1020, 5, 1),
                     HEP_ERR_VERBS);
    assert_non_null(strstr(hep_last_error(), "outside its registration"));
    assert_int_equal(w.nic[0]->v->write(w.nic[0], 1, w.mr[0].lkey, w.mr[0].addr,
                                        w.mr[1].rkey, w.mr[1].addr - 1, 8, 1),
                     HEP_ERR_VERBS);
    if (w.mr[2].rkey != w.mr[1].rkey)
        assert_int_equal(w.nic[0]->v->write(w.nic[0], 1, w.mr[0].lkey, w.mr[0].addr,
                                            w.mr[2].rkey, w.mr[2].addr, 8, 1),
                         HEP_ERR_VERBS);
    /* the local side: outside the registration, and another NIC's key */
    assert_int_equal(w.nic[0]->v->write(w.nic[0], 1, w.mr[0].lkey, w.mr[0].addr + 1020,
                                        w.mr[1].rkey, w.mr[1].addr, 8, 1),
                     HEP_ERR_VERBS);
    assert_int_equal(w.nic[0]->v->write(w.nic[0], 1, w.mr[1].lkey, w.mr[1].addr,
                                        w.mr[1].rkey, w.mr[1].addr, 8, 1),
                     HEP_ERR_VERBS);
    /* a peer whose memory is not mapped here */
    assert_int_equal(w.nic[0]->v->write(w.nic[0], 2, w.mr[0].lkey, w.mr[0].addr,
                                        w.mr[2].rkey, w.mr[2].addr, 8, 1),
                     HEP_ERR_VERBS);
    assert_non_null(strstr(hep_last_error(), "not mapped here"));
    /* and the other way: rank 1 to rank 0 and to rank 2 (both mapped at rank 1) */
    assert_int_equal(w.nic[1]->v->write(w.nic[1], 2, w.mr[1].lkey, w.mr[1].addr + 100,
                                        w.mr[2].rkey, w.mr[2].addr, 50, 8),
                     HEP_OK);
    assert_memory_equal(w.mem[2], w.mem[0] + 10, 50);
    hep_loopback_get_stats(&st1);
    assert_int_equal(st1.writes - st0.writes, 2);
    assert_int_equal(st1.refused - st0.refused, w.mr[2].rkey != w.mr[1].rkey ? 8 : 7);
    for (int k = 0; k < 3; k++) {
        assert_int_equal(hep_gpu_mr_deregister(&w.mr[k]), 0);
        w.nic[k]->v->destroy(w.nic[k]);
    }
    munmap(seg_own, L);
    munmap(seg_at0, L);
}

/* A rank given another window for a peer than the one the peer has refuses to connect. */
static void loopback_across_processes_refuses_a_window_that_differs(void **state)
{
    static xp_world w;
    static char mem[3][4096];
    rank_ctx ctx[3];
    (void)state;
    memset(&w, 0, sizeof(w));
    for (int k = 0; k < 3; k++) {
        for (int r = 0; r < 3; r++)
            w.win[k][r] = (hep_loopback_window){(uint64_t)(uintptr_t)mem[r], 4096, mem[r]};
        w.mem[k] = mem[k];
    }
    w.win[2][0].len = 2048; /* rank 2 was told something else about rank 0 */
    assert_int_equal(run_ranks(3, xp_rank, &w, ctx), 0);
    assert_int_equal(ctx[0].rc, HEP_OK);
    assert_int_equal(ctx[1].rc, HEP_OK);
    assert_int_equal(ctx[2].rc, HEP_ERR_MISMATCH);
    assert_non_null(strstr(ctx[2].err, "rank 0's window"));
    for (int k = 0; k < 3; k++) {
        if (w.reg_rc[k] == HEP_OK)
            hep_gpu_mr_deregister(&w.mr[k]);
        w.nic[k]->v->destroy(w.nic[k]);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(loopback_write_lands_and_wrong_key_or_range_is_refused,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(
            loopback_dmabuf_write_by_original_address_lands_at_the_right_byte, setup, teardown),
        cmocka_unit_test(
            loopback_across_processes_reaches_the_peer_mapping_with_the_same_checks),
        cmocka_unit_test(loopback_across_processes_refuses_a_window_that_differs),
    };
    return cmocka_run_group_tests_name("loopback", tests, NULL, NULL);
}
