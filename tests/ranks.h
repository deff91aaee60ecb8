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

/* The stream of virtual rank `rank` on the current GPU (*out: a cudaStream_t), made once
 * per (GPU, rank) and kept for the process: never destroy it. A GPU has at most 32
 * hardware queues and each new stream takes the next one in turn, so streams made per
 * case would soon share a queue with a live rank's, and a kernel would wait behind one
 * that waits for it. Returns the cudaError_t of making it (0: ready). */
int rank_stream(int rank, void **out);

/* Open file descriptors and threads of this process (from /proc/self). */
int count_fds(void);
int count_threads(void);

#endif
