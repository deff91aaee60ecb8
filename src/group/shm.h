/* group/shm.h: the host backend's node-shared memory across the processes of one host.
 *
 * In one process node-mates share pointers. When a group's ranks span processes, each
 * host-backend rank instead places its shared and local arenas, and a staging area for
 * its dispatch inputs, in one POSIX shared memory segment; node-mates map each other's
 * segments by name (names, sizes and a random key exchanged through the bootstrap). A
 * segment is unlinked as soon as every node-mate mapped it (or gave up), so /dev/shm keeps
 * nothing once creation returned; destroy unmaps every byte.
 */
#ifndef HEP_GROUP_SHM_H
#define HEP_GROUP_SHM_H

#include "group/group.h"

/* This rank's inputs (or a node-mate's copy of them) where the host backend reads them. */
typedef struct hep_shm_inputs {
    const void *tokens;   /* [t, H] rows */
    const float *scales;  /* FP8: [t, H / 128] */
    const void *idx;      /* [t, K] int32 or int64, as the mailbox says */
    const float *weights; /* [t, K] */
} hep_shm_inputs;

/* Create this rank's segment and set g->arena[SHARED], g->arena[LOCAL] and g->shm.
 * HEP_ERR_NOMEM when /dev/shm cannot hold it (the message says how much was asked). */
int hep_shm_create(hep_group *g);
/* Collective: map every node-mate's segment (checking host, size and key), then unlink
 * this rank's name once all ranks are past their mapping. Sets g->peer_shared[]. */
int hep_shm_map_mates(hep_group *g);
/* Unmap every segment (own and mates'); unlink the own name if still linked. Sets the two
 * arena pointers to NULL. NULL g->shm is accepted. */
void hep_shm_destroy(hep_group *g);

/* Node-mate l's local arena, as mapped here. */
char *hep_shm_mate_local(const hep_group *g, int l);
/* Copy this rank's dispatch inputs into its staging area (t <= T, topk <= max_topk). */
void hep_shm_stage_inputs(hep_group *g, const hep_dispatch_args *a);
/* Where node-mate l's staged inputs are mapped here. */
void hep_shm_mate_inputs(const hep_group *g, int l, hep_shm_inputs *in);
/* Make `rows` expert-output rows at `src` readable by node-mates: copied into this rank's
 * combine input (exchange.token) unless they are there already. Returns that address. */
const void *hep_shm_stage_combine_input(hep_group *g, const void *src, int rows);

#endif
