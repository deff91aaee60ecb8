/* The in-process bootstrap: allgather and barrier across threads, bounded waits. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <cuda_runtime_api.h>

#include "bootstrap/stream.h"
#include "core/core.h"
#include "ranks.h"

static int gather_many(rank_ctx *r)
{
    for (int round = 0; round < 50; round++) {
        int mine[3] = {r->rank, round, r->rank * 1000 + round}, all[3 * 16];
        int rc = r->bs.allgather(r->bs.ctx, mine, all, sizeof(mine));
        if (rc)
            return rc;
        for (int q = 0; q < r->world; q++)
            if (all[3 * q] != q || all[3 * q + 1] != round || all[3 * q + 2] != q * 1000 + round)
                return -1;
        if ((rc = r->bs.barrier(r->bs.ctx)))
            return rc;
    }
    return 0;
}

static void inproc_allgather_returns_every_rank_in_order(void **state)
{
    rank_ctx ctx[16];
    (void)state;
    assert_int_equal(run_ranks(16, gather_many, NULL, ctx), 0);
    for (int r = 0; r < 16; r++)
        assert_int_equal(ctx[r].rc, 0);
}

static int all_but_rank_two(rank_ctx *r)
{
    int v = r->rank, all[4];
    if (r->rank == 2)
        return 0; /* never arrives */
    return r->bs.allgather(r->bs.ctx, &v, all, sizeof(v));
}

static void inproc_timeout_names_the_rank_that_did_not_arrive(void **state)
{
    rank_ctx ctx[4];
    (void)state;
    setenv("HEP_TIMEOUT_MS", "200", 1);
    hep_env_reload();
    assert_int_equal(run_ranks(4, all_but_rank_two, NULL, ctx), 0);
    unsetenv("HEP_TIMEOUT_MS");
    hep_env_reload();
    for (int r = 0; r < 4; r++) {
        if (r == 2)
            continue;
        assert_int_equal(ctx[r].rc, HEP_ERR_TIMEOUT);
        if (!strstr(ctx[r].err, "did not arrive: 2"))
            fail_msg("rank %d: %s", r, ctx[r].err);
    }
}

static void inproc_world_rejects_bad_sizes(void **state)
{
    hep_inproc_world *w = NULL;
    hep_bootstrap bs;
    (void)state;
    assert_int_equal(hep_inproc_world_create(0, &w), HEP_ERR_INVALID);
    assert_int_equal(hep_inproc_world_create(2, &w), HEP_OK);
    assert_int_equal(hep_inproc_bootstrap(w, 2, &bs), HEP_ERR_INVALID);
    hep_inproc_world_destroy(w);
    hep_inproc_world_destroy(NULL);
}

/* hep_inproc_stream's argument checks come before any CUDA call: the same answers in
 * every build, with a GPU or without one. */
static void inproc_stream_rejects_bad_arguments(void **state)
{
    void *s = (void *)&s;
    (void)state;
    assert_int_equal(hep_inproc_stream(0, 0, NULL), HEP_ERR_INVALID);
    assert_non_null(strstr(hep_last_error(), "output pointer is NULL"));
    assert_int_equal(hep_inproc_stream(0, -1, &s), HEP_ERR_INVALID);
    assert_null(s);
    assert_non_null(strstr(hep_last_error(), "rank -1 is not in 0..4095"));
    s = (void *)&s;
    /* the slots above the ranks' are the loopback NIC's: no rank reaches them */
    assert_int_equal(hep_inproc_stream(0, HEP_INPROC_MAX_RANKS, &s), HEP_ERR_INVALID);
    assert_null(s);
    assert_non_null(strstr(hep_last_error(), "rank 4096 is not in 0..4095"));
    assert_int_equal(hep_inproc_stream(-1, 0, &s), HEP_ERR_INVALID);
    assert_non_null(strstr(hep_last_error(), "CUDA device -1 is not a device number"));
    /* the in-process world has the same bound */
    {
        hep_inproc_world *w = NULL;
        assert_int_equal(hep_inproc_world_create(HEP_INPROC_MAX_RANKS + 1, &w), HEP_ERR_INVALID);
        assert_null(w);
    }
}

/* Without a usable GPU (no device, no driver, or a build without CUDA) the call says so,
 * as HEP_ERR_UNAVAILABLE, and fills nothing. */
static void inproc_stream_without_a_gpu_is_unavailable_with_the_reason(void **state)
{
    void *s = (void *)&s;
    int n = 0;
    (void)state;
    if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) {
        print_message("skipped: this machine has a CUDA GPU (test_gpu_ep checks the streams)\n");
        skip();
    }
    (void)cudaGetLastError();
    for (int round = 0; round < 2; round++) { /* a failure is not cached as a table */
        assert_int_equal(hep_inproc_stream(0, 3, &s), HEP_ERR_UNAVAILABLE);
        assert_null(s);
        print_message("%s\n", hep_last_error());
        assert_non_null(strstr(hep_last_error(), "hep_inproc_stream, CUDA device 0: "
                                                 "cudaGetDeviceCount failed"));
#ifdef HEP_NO_CUDA
        assert_non_null(strstr(hep_last_error(), "no CUDA support"));
#endif
    }
}

/* The hardware queues a process gets (CUDA_DEVICE_MAX_CONNECTIONS, CUDA's default 8 when
 * unset or not 1..32), and the timeout message's note once kept streams take them all. */
static void stream_queues_follow_cuda_device_max_connections(void **state)
{
    static const struct {
        const char *v;
        int queues;
    } cases[] = {{NULL, 8}, {"", 8}, {"32", 32}, {"1", 1}, {"0", 8}, {"33", 8}, {"16x", 8},
                 {"-4", 8}};
    const char *saved = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    char *keep = saved ? strdup(saved) : NULL;
    char note[256];
    (void)state;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        if (cases[i].v)
            setenv("CUDA_DEVICE_MAX_CONNECTIONS", cases[i].v, 1);
        else
            unsetenv("CUDA_DEVICE_MAX_CONNECTIONS");
        assert_int_equal(hep_stream_queues(), cases[i].queues);
    }
    if (keep)
        setenv("CUDA_DEVICE_MAX_CONNECTIONS", keep, 1);
    else
        unsetenv("CUDA_DEVICE_MAX_CONNECTIONS");
    free(keep);
    strcpy(note, "x");
    assert_int_equal(hep_stream_queue_note(note, sizeof(note), 0, 31, 32), 0);
    assert_string_equal(note, "");
    assert_int_equal(hep_stream_queue_note(note, sizeof(note), 1, 32, 32), 1);
    print_message("%s\n", note);
    assert_non_null(strstr(note, "keeps 32 streams on GPU 1"));
    assert_non_null(strstr(note, "32 hardware queues"));
    assert_int_equal(hep_stream_queue_note(note, sizeof(note), 0, 40, 32), 1);
    assert_non_null(strstr(note, "keeps 40 streams on GPU 0"));
    assert_int_equal(hep_stream_queue_note(NULL, 0, 0, 40, 32), 0);
    /* no stream was made here: none is counted, a device out of range neither */
    assert_int_equal(hep_kept_streams(-1), 0);
    assert_int_equal(hep_kept_streams(1 << 20), 0);
}

/* Rank 1 faults, rank 0 returns. */
static int fault_on_rank_1(rank_ctx *r)
{
    if (r->rank == 1)
        raise(SIGSEGV);
    return 0;
}

/* A fault in a rank's thread is reported with the rank and a backtrace, and the process
 * dies of the signal (cmocka alone exits 255 in silence for a fault outside the test's
 * thread, tests/ranks.c). In a child process, whose stderr is read here. */
static void a_rank_threads_fault_names_the_rank_and_dies_of_the_signal(void **state)
{
    int fds[2], status = 0;
    char out[8192];
    size_t got = 0;
    ssize_t n;
    pid_t pid;
    (void)state;
#if defined(__SANITIZE_ADDRESS__)
    skip(); /* AddressSanitizer's own handler reports faults there */
#endif
    assert_int_equal(pipe(fds), 0);
    fflush(NULL);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        rank_ctx ctx[2];
        dup2(fds[1], 2);
        close(fds[0]);
        signal(SIGSEGV, SIG_DFL); /* no cmocka handler in the child: the report is ranks.c's */
        run_ranks(2, fault_on_rank_1, NULL, ctx);
        _exit(0); /* not reached: the fault ends the process */
    }
    close(fds[1]);
    while (got < sizeof(out) - 1 && (n = read(fds[0], out + got, sizeof(out) - 1 - got)) > 0)
        got += (size_t)n;
    out[got] = 0;
    close(fds[0]);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    print_message("child's stderr: %.300s\n", out);
    assert_true(WIFSIGNALED(status));
    assert_int_equal(WTERMSIG(status), SIGSEGV);
    assert_non_null(strstr(out, "fault: signal 11 (SIGSEGV) in the thread of rank 1"));
    assert_non_null(strstr(out, "backtrace:"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(inproc_allgather_returns_every_rank_in_order),
        cmocka_unit_test(inproc_timeout_names_the_rank_that_did_not_arrive),
        cmocka_unit_test(inproc_world_rejects_bad_sizes),
        cmocka_unit_test(inproc_stream_rejects_bad_arguments),
        cmocka_unit_test(inproc_stream_without_a_gpu_is_unavailable_with_the_reason),
        cmocka_unit_test(stream_queues_follow_cuda_device_max_connections),
        cmocka_unit_test(a_rank_threads_fault_names_the_rank_and_dies_of_the_signal),
    };
    return cmocka_run_group_tests_name("bootstrap", tests, NULL, NULL);
}
