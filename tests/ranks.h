/* Run a function on W threads, one per rank of an in-process world. */
#ifndef HEP_TEST_RANKS_H
#define HEP_TEST_RANKS_H

#include "hybridep/bootstrap.h"

typedef struct rank_ctx rank_ctx;
typedef int (*rank_fn)(rank_ctx *r);

struct rank_ctx {
    hep_bootstrap bs;
    rank_fn fn;
    int rank, world;
    void *arg;
    int rc;              /* what fn returned */
    char err[2048];      /* hep_last_error() of that thread after fn */
};

/* Runs fn on every rank; fills ctx[0..world-1]. Returns 0 if all threads ran. */
int run_ranks(int world, rank_fn fn, void *arg, rank_ctx *ctx);

/* Open file descriptors and threads of this process (from /proc/self). */
int count_fds(void);
int count_threads(void);

#endif
