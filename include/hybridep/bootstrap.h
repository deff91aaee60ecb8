/* hybridep/bootstrap.h: how the ranks of a group talk before and around the data path.
 *
 * A bootstrap is a small table of collective calls that hybridep uses at group creation
 * (configuration check, exchange of buffer addresses, IPC handles, RDMA connection info)
 * and at destroy. hybridep provides an in-process one (threads: one process drives all
 * local GPUs, or several virtual ranks on one GPU) and an MPI one (libhybridep_mpi,
 * hybridep/bootstrap_mpi.h). Any other (torch.distributed, a job launcher's store) only
 * has to fill this table.
 */
#ifndef HYBRIDEP_BOOTSTRAP_H
#define HYBRIDEP_BOOTSTRAP_H

#include <stddef.h>

#include "hybridep/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct hep_bootstrap {
    int rank; /* 0 .. size-1 */
    int size;
    void *ctx; /* passed back to every call */
    /* Every rank contributes `bytes` from send; recv receives size * bytes, rank-major.
     * 0 or a hep_status (with hep_last_error() set). Must not hang forever. */
    int (*allgather)(void *ctx, const void *send, void *recv, size_t bytes);
    int (*barrier)(void *ctx);
} hep_bootstrap;

/* ---- in-process bootstrap: one thread per rank ---- */
typedef struct hep_inproc_world hep_inproc_world;

/* The most ranks of one in-process world (and of hep_inproc_stream). */
#define HEP_INPROC_MAX_RANKS 4096

/* A world of `size` ranks (1..HEP_INPROC_MAX_RANKS) in this process. Its collectives wait
 * at most HEP_TIMEOUT_MS for every rank and then fail with HEP_ERR_TIMEOUT naming the ranks
 * that did not come; after a failed collective every later one fails with the same message
 * (create a new world). Returns 0 or HEP_ERR_INVALID / HEP_ERR_NOMEM. */
int hep_inproc_world_create(int size, hep_inproc_world **world);
/* Fill *bs for `rank` of the world (call from that rank's thread or before starting it). */
int hep_inproc_bootstrap(hep_inproc_world *world, int rank, hep_bootstrap *bs);
/* Release the world; no rank may still use it. NULL is accepted. */
void hep_inproc_world_destroy(hep_inproc_world *world);

/* The stream of virtual rank `rank` (0..HEP_INPROC_MAX_RANKS-1) on CUDA device `device`:
 * *stream receives a cudaStream_t (non-blocking: it never waits for the legacy default
 * stream), made by the first call for that (device, rank) and the same one on every later
 * call, from any thread, for the rest of the process. Never destroy it.
 *
 * Why kept: virtual ranks on one GPU run co-dependent kernels, so each needs a stream of
 * its own (the legacy default stream is refused) and those streams must sit on distinct
 * hardware queues. A GPU has at most 32 of them (CUDA_DEVICE_MAX_CONNECTIONS) and every
 * new stream takes the next one in turn, whichever streams were destroyed meanwhile: streams
 * made and destroyed per group soon share a queue with a live rank's, and a rank's kernel
 * then waits behind one that waits for it, until the timeout. Made once per rank, they take
 * their queues once (the loopback NIC keeps its copy streams in the same table). A new
 * stream runs one empty kernel, waited for, before it is handed out, so that a rank's
 * first call is not its stream's first work (bench/RESULTS.md, 2026-12-02). Graph
 * replays need queues too: after 16 virtual ranks across nodes had made 32 kept streams
 * (16 ranks', 16 NICs'), four ranks' graph replays on their own kept streams queued
 * behind a node-mate and timed out on every run, and passed in a process with fewer
 * streams. Capture and replay graphs of virtual ranks where fewer than 32 streams exist.
 * The stream that takes a GPU's last queue logs a warning once, and a rank's timeout for
 * arriving late says how many kept streams its GPU has when they take every queue.
 *
 * The calling thread's current device is as before the call. Returns 0, or, with
 * hep_last_error() set: HEP_ERR_INVALID (stream NULL, rank out of range, no such device),
 * HEP_ERR_UNAVAILABLE (no usable CUDA device, or a build of hybridep without CUDA),
 * HEP_ERR_NOMEM, or HEP_ERR_CUDA (the CUDA call that failed and its error). */
int hep_inproc_stream(int device, int rank, void **stream);

#ifdef __cplusplus
}
#endif
#endif
