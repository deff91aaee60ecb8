#include <dirent.h>
#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"
#include "ranks.h"

/* A fault in a rank's thread (or a library thread it started) while the ranks run. cmocka's
 * own handler reports only faults of the thread running the test: in another thread its
 * report stays in that thread's buffer and it exits with status 255, printing nothing (seen
 * on the GPU machine). This one writes which thread faulted, on which signal and where (a
 * backtrace), then dies of the signal, so that the exit status says what happened. Not under
 * AddressSanitizer, whose handler reports more. */
static __thread int tl_rank = -1;
static const int fault_signals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
#define NFAULT ((int)(sizeof(fault_signals) / sizeof(fault_signals[0])))

#if !defined(__SANITIZE_ADDRESS__)
static void put(const char *s)
{
    ssize_t n = write(2, s, strlen(s));
    (void)n;
}

static void put_int(int v) /* (no stdio in a signal handler) */
{
    char b[16], *p = b + sizeof(b) - 1;
    unsigned u = v < 0 ? 0u - (unsigned)v : (unsigned)v;
    *p = 0;
    do
        *--p = (char)('0' + u % 10);
    while (u /= 10);
    if (v < 0)
        *--p = '-';
    put(p);
}

static void fault_handler(int sig)
{
    void *frames[48];
    const int n = backtrace(frames, 48);
    put("\nfault: signal ");
    put_int(sig);
    put(sig == SIGSEGV ? " (SIGSEGV)" : sig == SIGBUS ? " (SIGBUS)" : sig == SIGFPE ? " (SIGFPE)"
        : sig == SIGILL ? " (SIGILL)" : " (SIGABRT)");
    if (tl_rank >= 0) {
        put(" in the thread of rank ");
        put_int(tl_rank);
    } else {
        put(" in a thread that is no rank's (the library's, or the test's main thread)");
    }
    put("; backtrace:\n");
    backtrace_symbols_fd(frames, n, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}
#endif

static int fault_report_on(struct sigaction *old)
{
#if defined(__SANITIZE_ADDRESS__)
    (void)old;
    return 0;
#else
    struct sigaction sa;
    void *warm[1];
    backtrace(warm, 1); /* loads what backtrace needs now, not inside the handler */
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = fault_handler;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < NFAULT; i++)
        sigaction(fault_signals[i], &sa, &old[i]);
    return 1;
#endif
}

static void fault_report_off(const struct sigaction *old)
{
    for (int i = 0; i < NFAULT; i++)
        sigaction(fault_signals[i], &old[i], NULL);
}

static void *rank_main(void *p)
{
    rank_ctx *r = p;
    tl_rank = r->rank;
    r->rc = r->fn(r);
    snprintf(r->err, sizeof(r->err), "%s", hep_last_error());
    return NULL;
}

int run_ranks(int world, rank_fn fn, void *arg, rank_ctx *ctx)
{
    hep_inproc_world *w;
    pthread_t *th = malloc(sizeof(*th) * (size_t)(world > 0 ? world : 1));
    int rc = th ? hep_inproc_world_create(world, &w) : -1;
    if (rc) {
        free(th);
        return -1;
    }
    for (int r = 0; r < world; r++) {
        memset(&ctx[r], 0, sizeof(ctx[r]));
        hep_inproc_bootstrap(w, r, &ctx[r].bs);
        ctx[r].rank = r;
        ctx[r].world = world;
        ctx[r].arg = arg;
        ctx[r].fn = fn;
    }
    struct sigaction old[NFAULT];
    const int reporting = fault_report_on(old);
    for (int r = 0; r < world; r++)
        pthread_create(&th[r], NULL, rank_main, &ctx[r]);
    for (int r = 0; r < world; r++)
        pthread_join(th[r], NULL);
    if (reporting)
        fault_report_off(old);
    hep_inproc_world_destroy(w);
    free(th);
    return 0;
}

static int count_dir(const char *path)
{
    DIR *d = opendir(path);
    struct dirent *e;
    int n = 0;
    if (!d)
        return -1;
    while ((e = readdir(d)))
        n += e->d_name[0] != '.';
    closedir(d);
    return n - (strcmp(path, "/proc/self/fd") == 0); /* the DIR's own fd */
}

int count_fds(void)
{
    return count_dir("/proc/self/fd");
}

int count_threads(void)
{
    return count_dir("/proc/self/task");
}
