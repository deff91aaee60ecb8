/* The CPU proxy over the loopback NIC on host memory: chunks go out as they become ready,
 * each flag after its data, contiguous chunks coalesce, a refused write and a producer
 * that never publishes become clear errors, and the bytes posted to a peer are exactly
 * the tokens its node needs. */
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
#include "net/proxy.h"

#define ACC (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)
#define CH 256

typedef struct fixture {
    hep_net *src, *dst;
    hep_proxy *proxy;
    unsigned char staging[8 * CH], slots[16 * CH];
    uint64_t ready[8], flags[8];
    hep_gpu_mr m_staging, m_ready, m_slots, m_flags;
} fixture;

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof(*f));
    assert_int_equal(hep_loopback_create(0, 4, &f->src), 0);
    assert_int_equal(hep_loopback_create(2, 4, &f->dst), 0);
    for (int i = 0; i < 8 * CH; i++)
        f->staging[i] = (unsigned char)(i * 13 + 1);
#define REG(nic, mem, out, name)                                                                 \
    assert_int_equal(hep_gpu_mr_register(&(nic)->mr_ops, (nic)->pd, 0, (mem), sizeof(mem), ACC,  \
                                         name, &(out)),                                           \
                     0)
    REG(f->src, f->staging, f->m_staging, "dispatch.attn_input_token");
    REG(f->src, f->ready, f->m_ready, "dispatch.attn_input_flags");
    REG(f->dst, f->slots, f->m_slots, "dispatch.rdma_inter_node_group_token");
    REG(f->dst, f->flags, f->m_flags, "dispatch.rdma_inter_node_group_flags");
#undef REG
    assert_int_equal(hep_proxy_create(f->src, &f->proxy), 0);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    hep_proxy_destroy(f->proxy);
    hep_gpu_mr_deregister(&f->m_staging);
    hep_gpu_mr_deregister(&f->m_ready);
    hep_gpu_mr_deregister(&f->m_slots);
    hep_gpu_mr_deregister(&f->m_flags);
    f->src->v->destroy(f->src);
    f->dst->v->destroy(f->dst);
    free(f);
    return 0;
}

/* chunk i: staging[src_chunk] -> slots[dst_chunk], flag i */
static hep_proxy_chunk chunk(fixture *f, int i, int src_chunk, int dst_chunk)
{
    hep_proxy_chunk c;
    memset(&c, 0, sizeof(c));
    c.ready = &f->ready[i];
    c.peer = 2;
    c.lkey = f->m_staging.lkey;
    c.laddr = f->m_staging.addr + (uint64_t)src_chunk * CH;
    c.rkey = f->m_slots.rkey;
    c.raddr = f->m_slots.addr + (uint64_t)dst_chunk * CH;
    c.len = CH;
    c.flag_lkey = f->m_ready.lkey;
    c.flag_laddr = f->m_ready.addr + (uint64_t)i * 8; /* the ready counter is the flag */
    c.flag_rkey = f->m_flags.rkey;
    c.flag_raddr = f->m_flags.addr + (uint64_t)i * 8;
    c.name = "dispatch.attn_input_token";
    c.flag = 1;
    return c;
}

static void publish(fixture *f, int i, uint64_t e)
{
    __atomic_store_n(&f->ready[i], e, __ATOMIC_RELEASE);
}

static void proxy_posts_chunks_as_they_become_ready_each_flag_after_its_data(void **state)
{
    fixture *f = *state;
    hep_proxy_chunk c[4];
    hep_proxy_peer_stats st;
    for (int i = 0; i < 4; i++)
        c[i] = chunk(f, i, i, 2 * i); /* remote gaps: no coalescing */
    assert_int_equal(hep_proxy_submit(f->proxy, c, 4, 1), 0);
    publish(f, 2, 1);
    assert_int_equal(hep_proxy_wait_flag(&f->flags[2], 1, 2, 0, "chunk 2"), 0);
    assert_memory_equal(f->slots + 4 * CH, f->staging + 2 * CH, CH); /* data before flag */
    assert_int_equal(f->flags[0], 0);
    assert_int_equal(f->slots[0], 0); /* chunk 0 not ready: not sent */
    publish(f, 0, 1);
    publish(f, 3, 1);
    publish(f, 1, 1);
    assert_int_equal(hep_proxy_wait(f->proxy), 0);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(f->flags[i], 1);
        assert_memory_equal(f->slots + 2 * i * CH, f->staging + i * CH, CH);
    }
    hep_proxy_stats(f->proxy, 2, &st);
    assert_int_equal(st.bytes, 4 * CH);
    assert_int_equal(st.data_wrs, 4);
    assert_int_equal(st.flag_wrs, 4);
    /* a second call with epoch 2: the monotonic flags move on */
    for (int i = 0; i < 4; i++)
        publish(f, i, 2);
    assert_int_equal(hep_proxy_submit(f->proxy, c, 4, 2), 0);
    assert_int_equal(hep_proxy_wait(f->proxy), 0);
    assert_int_equal(f->flags[3], 2);
}

static void proxy_coalesces_contiguous_ready_chunks_into_one_write(void **state)
{
    fixture *f = *state;
    hep_proxy_chunk c[5];
    hep_proxy_peer_stats st;
    for (int i = 0; i < 5; i++) {
        c[i] = chunk(f, i, i, i); /* contiguous on both sides */
        publish(f, i, 7);
    }
    assert_int_equal(hep_proxy_submit(f->proxy, c, 5, 7), 0);
    assert_int_equal(hep_proxy_wait(f->proxy), 0);
    hep_proxy_stats(f->proxy, 2, &st);
    assert_int_equal(st.data_wrs, 1);
    assert_int_equal(st.bytes, 5 * CH);
    assert_int_equal(st.flag_wrs, 5);
    assert_memory_equal(f->slots, f->staging, 5 * CH);
}

/* The GPU path's chunks: the producer publishes each block's extent with its ready
 * counter, and the slot's flag (fenced) goes only after every earlier chunk to the peer. */
static void proxy_takes_extents_from_the_producer_and_fences_the_slot_flag(void **state)
{
    fixture *f = *state;
    static uint64_t desc[2][2];
    hep_proxy_chunk c[3];
    hep_proxy_peer_stats st0, st;
    hep_proxy_stats(f->proxy, 2, &st0);
    for (int b = 0; b < 2; b++) {
        c[b] = chunk(f, b, 0, 8);
        c[b].flag = 0;
        c[b].len = 4 * CH; /* the most a block may cover */
        c[b].desc = desc[b];
        c[b].unit = 16;
    }
    c[2] = chunk(f, 2, 0, 0);
    c[2].len = 0; /* a flag only */
    c[2].fence = 1;
    assert_int_equal(hep_proxy_submit(f->proxy, c, 3, 1), 0);
    desc[0][0] = 0, desc[0][1] = 16; /* block 0: units [0, 16) */
    publish(f, 0, 1);
    publish(f, 2, 1);                /* the flag is ready before block 1 is */
    for (int spin = 0; spin < 2000 && f->slots[8 * CH + 255] != f->staging[255]; spin++)
        usleep(100);
    assert_memory_equal(f->slots + 8 * CH, f->staging, 16 * 16);
    usleep(20000);
    assert_int_equal(__atomic_load_n(&f->flags[2], __ATOMIC_ACQUIRE), 0); /* fenced */
    desc[1][0] = 16, desc[1][1] = 8; /* block 1: units [16, 24) */
    publish(f, 1, 1);
    assert_int_equal(hep_proxy_wait(f->proxy), 0);
    assert_int_equal(f->flags[2], 1);
    assert_memory_equal(f->slots + 8 * CH, f->staging, 24 * 16);
    assert_int_equal(f->slots[8 * CH + 24 * 16], 0); /* nothing past the extents */
    hep_proxy_stats(f->proxy, 2, &st);
    assert_int_equal(st.bytes - st0.bytes, 24 * 16);
    assert_int_equal(st.data_wrs - st0.data_wrs, 2);
    assert_int_equal(st.flags_done - st0.flags_done, 1);
    /* an extent beyond what the chunk may cover is the producer's error, named */
    desc[0][0] = 60, desc[0][1] = 8; /* units [60, 68) of at most 64 */
    publish(f, 0, 2), publish(f, 1, 2), publish(f, 2, 2);
    assert_int_equal(hep_proxy_submit(f->proxy, c, 3, 2), 0);
    assert_int_not_equal(hep_proxy_wait(f->proxy), 0);
    assert_non_null(strstr(hep_last_error(), "beyond the 1024 bytes"));
}

/* A ring whose chunk count only its producer knows: the batch holds as many chunks as the
 * ring could have, and the skip word makes the ones past the call's count done without a
 * write; a fenced flag behind them goes out once they are skipped. Nothing is skipped
 * while the word is below a chunk's skip value, and a real chunk is never skipped. */
static void proxy_skips_the_ring_chunks_a_call_does_not_have(void **state)
{
    fixture *f = *state;
    static uint64_t skip;
    hep_proxy_chunk c[5];
    hep_proxy_peer_stats st0, st;
    hep_proxy_stats(f->proxy, 2, &st0);
    for (int i = 0; i < 4; i++) {
        c[i] = chunk(f, i, i, i + 8);
        c[i].skip = &skip;
        c[i].skip_want = 100 - (uint64_t)i; /* skipped once skip >= 100 - i: i >= 100 - skip */
    }
    c[4] = chunk(f, 4, 0, 0);
    c[4].len = 0; /* the slot's flag, behind every chunk */
    c[4].fence = 1;
    skip = 10; /* an earlier call's value: skips nothing */
    assert_int_equal(hep_proxy_submit(f->proxy, c, 5, 3), 0);
    publish(f, 4, 3);
    publish(f, 0, 3);
    publish(f, 1, 3);
    for (int spin = 0; spin < 2000 && __atomic_load_n(&f->flags[1], __ATOMIC_ACQUIRE) != 3; spin++)
        usleep(100);
    usleep(20000);
    assert_int_equal(__atomic_load_n(&f->flags[4], __ATOMIC_ACQUIRE), 0); /* 2, 3 pending */
    __atomic_store_n(&skip, 98, __ATOMIC_RELEASE); /* this call has 2 chunks */
    assert_int_equal(hep_proxy_wait(f->proxy), 0);
    assert_int_equal(f->flags[4], 3);
    assert_int_equal(f->flags[0], 3);
    assert_int_equal(f->flags[1], 3);
    assert_int_equal(f->flags[2], 0); /* skipped: neither data nor flag */
    assert_int_equal(f->flags[3], 0);
    assert_memory_equal(f->slots + 8 * CH, f->staging, 2 * CH);
    assert_int_equal(f->slots[10 * CH], 0);
    hep_proxy_stats(f->proxy, 2, &st);
    assert_int_equal(st.bytes - st0.bytes, 2 * CH);
    assert_int_equal(st.flag_wrs - st0.flag_wrs, 3);
}

static void proxy_refused_write_fails_the_batch_naming_peer_and_buffer(void **state)
{
    fixture *f = *state;
    hep_proxy_chunk c[2] = {chunk(f, 0, 0, 0), chunk(f, 1, 1, 4)};
    c[1].rkey ^= 0x55; /* a key the peer never registered */
    publish(f, 0, 1);
    publish(f, 1, 1);
    assert_int_equal(hep_proxy_submit(f->proxy, c, 2, 1), 0);
    assert_int_equal(hep_proxy_wait(f->proxy), HEP_ERR_VERBS);
    assert_non_null(strstr(hep_last_error(), "'dispatch.attn_input_token' to rank 2"));
    assert_non_null(strstr(hep_last_error(), "remote key"));
    c[0].raddr = f->m_slots.addr + sizeof(f->slots) - 8; /* runs past the registration */
    c[1] = chunk(f, 1, 1, 4);
    assert_int_equal(hep_proxy_submit(f->proxy, c, 2, 1), 0);
    assert_int_equal(hep_proxy_wait(f->proxy), HEP_ERR_VERBS);
    assert_non_null(strstr(hep_last_error(), "outside its registration"));
}

/* A NIC whose completions fail the way a real one reports it (the verbs NIC's text for a
 * work completion with an error status): the batch fails naming the buffer and peer. */
typedef struct failing_nic {
    hep_net net;
    uint64_t wr[8];
    int n;
} failing_nic;

static int fn_write(hep_net *n, int peer, uint32_t lkey, uint64_t laddr, uint32_t rkey,
                    uint64_t raddr, size_t len, uint64_t wr_id)
{
    failing_nic *f = (failing_nic *)n;
    (void)peer, (void)lkey, (void)laddr, (void)rkey, (void)raddr, (void)len;
    f->wr[f->n++ % 8] = wr_id;
    return HEP_OK;
}

static int fn_poll(hep_net *n, hep_net_completion *out, int max)
{
    failing_nic *f = (failing_nic *)n;
    int k = 0;
    for (; k < f->n && k < max; k++) {
        out[k].wr_id = f->wr[k];
        out[k].peer = 2;
        out[k].status = hep_fail(HEP_ERR_VERBS, "RDMA write to rank 2 failed on mlx5_0 QP 0x1a2: "
                                                "remote access error (wr_id %llu)",
                                 (unsigned long long)f->wr[k]);
    }
    f->n = 0;
    return k;
}

static const hep_net_vtbl fn_vtbl = {"failing", NULL, fn_write, fn_poll, NULL};

static void proxy_failed_completion_names_buffer_peer_and_nic_text(void **state)
{
    fixture *f = *state;
    failing_nic nic;
    hep_proxy *p = NULL;
    hep_proxy_chunk c = chunk(f, 0, 0, 0);
    memset(&nic, 0, sizeof(nic));
    nic.net.v = &fn_vtbl;
    nic.net.rank = 0;
    nic.net.world = 4;
    c.name = "combine.rdma_intra_node_red_token";
    c.flag = 0;
    publish(f, 0, 1);
    assert_int_equal(hep_proxy_create(&nic.net, &p), 0);
    assert_int_equal(hep_proxy_submit(p, &c, 1, 1), 0);
    assert_int_equal(hep_proxy_wait(p), HEP_ERR_VERBS);
    assert_non_null(strstr(hep_last_error(), "'combine.rdma_intra_node_red_token' to rank 2"));
    assert_non_null(strstr(hep_last_error(), "QP 0x1a2: remote access error"));
    hep_proxy_destroy(p);
}

static void proxy_times_out_naming_the_chunk_whose_producer_never_published(void **state)
{
    fixture *f = *state;
    hep_proxy_chunk c[2] = {chunk(f, 0, 0, 0), chunk(f, 1, 1, 2)};
    setenv("HEP_TIMEOUT_MS", "200", 1);
    hep_env_reload();
    publish(f, 0, 1); /* chunk 1 never */
    assert_int_equal(hep_proxy_submit(f->proxy, c, 2, 1), 0);
    assert_int_equal(hep_proxy_wait(f->proxy), HEP_ERR_TIMEOUT);
    assert_non_null(strstr(hep_last_error(), "chunk 1 of 'dispatch.attn_input_token' for rank 2"));
    /* and the receiver, waiting for the missing flag, names the sender */
    assert_int_equal(hep_proxy_wait_flag(&f->flags[1], 1, 2, 0, "dispatch chunk 1"),
                     HEP_ERR_TIMEOUT);
    assert_non_null(strstr(hep_last_error(), "rank 0 did not arrive"));
    unsetenv("HEP_TIMEOUT_MS");
    hep_env_reload();
}

/* A receiver whose flag never came, but whose peer's arrival word (sent ahead of the flag
 * on the same connection) did, says that the peer arrived and its flag was lost; with the
 * arrival word of an earlier call only, that the peer did not arrive. */
static void wait_flag_names_a_lost_flag_of_a_peer_that_arrived(void **state)
{
    volatile uint64_t flag = 4, arrived = 5;
    (void)state;
    setenv("HEP_TIMEOUT_MS", "50", 1);
    hep_env_reload();
    assert_int_equal(hep_proxy_wait_flag_arrived(&flag, 5, &arrived, 3, 1, "its partial sums"),
                     HEP_ERR_TIMEOUT);
    assert_non_null(strstr(hep_last_error(), "expected 5, saw 4: rank 1 arrived at call 5"));
    assert_non_null(strstr(hep_last_error(), "but this flag did not arrive"));
    assert_null(strstr(hep_last_error(), "rank 1 did not arrive"));
    arrived = 4;
    assert_int_equal(hep_proxy_wait_flag_arrived(&flag, 5, &arrived, 3, 1, "its partial sums"),
                     HEP_ERR_TIMEOUT);
    assert_non_null(strstr(hep_last_error(), "expected 5, saw 4: rank 1 did not arrive"));
    flag = 5; /* and a flag in place is no timeout */
    assert_int_equal(hep_proxy_wait_flag_arrived(&flag, 5, &arrived, 3, 1, "its partial sums"),
                     HEP_OK);
    unsetenv("HEP_TIMEOUT_MS");
    hep_env_reload();
}

/* Two nodes of two ranks: rank 0's 8 tokens, each needing node 0 (local), node 1, or
 * both. The batch sends each token that node 1 needs once, packed, to the peer (rank 2). */
static void proxy_sends_exactly_the_tokens_the_peer_node_needs_once_each(void **state)
{
    fixture *f = *state;
    const int needs_node1[8] = {1, 0, 1, 1, 0, 0, 1, 1};
    hep_proxy_chunk c[8];
    hep_proxy_peer_stats before, after;
    int n = 0;
    hep_proxy_stats(f->proxy, 2, &before);
    for (int i = 0; i < 8; i++)
        if (needs_node1[i]) {
            c[n] = chunk(f, n, i, n); /* token i -> slot n of node 0 at the peer */
            publish(f, n, 3);
            n++;
        }
    assert_int_equal(hep_proxy_submit(f->proxy, c, n, 3), 0);
    assert_int_equal(hep_proxy_wait(f->proxy), 0);
    hep_proxy_stats(f->proxy, 2, &after);
    assert_int_equal(after.bytes - before.bytes, 5 * CH); /* tokens 0, 2, 3, 6, 7 */
    assert_int_equal(after.data_wrs - before.data_wrs, 3); /* runs {0}, {2, 3}, {6, 7} */
    for (int k = 0, i = 0; i < 8; i++)
        if (needs_node1[i]) {
            assert_memory_equal(f->slots + k * CH, f->staging + i * CH, CH);
            k++;
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(wait_flag_names_a_lost_flag_of_a_peer_that_arrived),
        cmocka_unit_test_setup_teardown(
            proxy_posts_chunks_as_they_become_ready_each_flag_after_its_data, setup, teardown),
        cmocka_unit_test_setup_teardown(proxy_coalesces_contiguous_ready_chunks_into_one_write,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(
            proxy_takes_extents_from_the_producer_and_fences_the_slot_flag, setup, teardown),
        cmocka_unit_test_setup_teardown(
            proxy_failed_completion_names_buffer_peer_and_nic_text, setup, teardown),
        cmocka_unit_test_setup_teardown(proxy_skips_the_ring_chunks_a_call_does_not_have, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(proxy_refused_write_fails_the_batch_naming_peer_and_buffer,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(
            proxy_times_out_naming_the_chunk_whose_producer_never_published, setup, teardown),
        cmocka_unit_test_setup_teardown(
            proxy_sends_exactly_the_tokens_the_peer_node_needs_once_each, setup, teardown),
    };
    return cmocka_run_group_tests_name("proxy", tests, NULL, NULL);
}
