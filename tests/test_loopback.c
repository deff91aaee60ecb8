/* The loopback NIC refuses what a NIC refuses and lands writes where a NIC would. */
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(loopback_write_lands_and_wrong_key_or_range_is_refused,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(
            loopback_dmabuf_write_by_original_address_lands_at_the_right_byte, setup, teardown),
    };
    return cmocka_run_group_tests_name("loopback", tests, NULL, NULL);
}
