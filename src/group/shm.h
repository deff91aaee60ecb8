/* group/shm.h: the host backend's node-shared memory across the processes of one host.
 *
 * In one process node-mates share pointers. When a group's ranks span processes, each
 * host-backend rank instead places its shared and local arenas, and a staging area for
 * its dispatch inputs, in one POSIX shared memory segment; node-mates map each other's
 * segments by name (names, sizes and a random key exchanged through the bootstrap). A
 * segment is unlinked as soon as every node-mate mapped it (or gave up), so /dev/shm keeps
 * nothing once creation returned; destroy unmaps every byte. The host backend reads and
 * writes the mapped segments through the view hep_shm_fill_view gives it (ref/host_shm.c).
 */
#ifndef HEP_GROUP_SHM_H
#define HEP_GROUP_SHM_H

#include "group/group.h"

/* Create this rank's segment and set g->arena[SHARED], g->arena[LOCAL] and g->shm.
 * HEP_ERR_NOMEM when /dev/shm cannot hold it (the message says how much was asked). */
int hep_shm_create(hep_group *g);
/* Collective: map every node-mate's segment (checking host, size and key) and, with
 * g->nic_xproc (the loopback NIC across processes), the segment of the rank of this local
 * rank on every other node; then unlink this rank's name once all ranks are past their
 * mapping. Sets g->peer_shared[]. */
int hep_shm_map_mates(hep_group *g);
/* Unmap every segment (own and mates'); unlink the own name if still linked. Sets the two
 * arena pointers to NULL. NULL g->shm is accepted. */
void hep_shm_destroy(hep_group *g);

/* Where the node-mates' segments are mapped here, for the host backend (ref/host_shm.h):
 * b->shm and its shm_* fields (b->shm = NULL when g->shm is NULL). After hep_shm_map_mates. */
void hep_shm_fill_view(const hep_group *g, hep_backend_ctx *b);

/* The loopback NIC's windows across processes (net/net.h), [world]: each rank's local
 * arena (where its RDMA buffers are), its address in the rank's own process and where it is
 * mapped here (this rank's, its node-mates' and, with g->nic_xproc, its peers' on the other
 * nodes; NULL for the rest). After hep_shm_map_mates. */
void hep_shm_nic_windows(const hep_group *g, hep_loopback_window *win);

#endif
