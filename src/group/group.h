/* group: create/destroy, the collective agreement of every step, buffer sharing. */
#ifndef HEP_GROUP_H
#define HEP_GROUP_H

#include <stddef.h>
#include <stdint.h>

#include "hybridep/hybridep.h"
#include "backend/backend.h"
#include "layout/plan.h"
#include "net/coordinator.h"

/* Test hooks of group creation (internal; not part of the public ABI). */
typedef struct hep_group_hooks {
    const hep_gpu_mr_ops *mr_override; /* non-NULL members replace the NIC's registration calls */
    int transport;                     /* 0 = from HEP_NIC, 1 = loopback, 2 = verbs */
    int hold_credits;                  /* never free a ring chunk (a peer that does not
                                          return credits; GPU: its proxy sends none) */
} hep_group_hooks;

struct hep_group {
    hep_config cfg;
    hep_bootstrap bs;
    int device;
    int rank, world, R, N, node, local;
    int mates_one_gpu;              /* every node-mate drives this rank's GPU */
    int mates_one_process;          /* every node-mate is a thread of this process */
    int nic_xproc;                  /* N > 1, host backend: the loopback NIC across the
                                       processes of this host (group/shm.h maps the peers) */
    hep_plan plan;
    char *arena[HEP_ARENA_COUNT];   /* this rank's arenas (device or host addresses) */
    char *mapped_dev;               /* device address of the mapped arena */
    char *peer_shared[HEP_MAX_LOCAL]; /* each node-mate's shared arena, by local rank */
    unsigned char ipc_opened[HEP_MAX_LOCAL];
    hep_coord *coord;
    struct hep_proxy *proxy;        /* N > 1, host backend: the CPU proxy driving the NIC */
    struct hep_shm *shm;            /* host backend across processes: group/shm.h */
    int dmabuf_banner;              /* printed the banner */
    int hold_credits;               /* hep_group_hooks.hold_credits */
    const hep_backend_ops *ops;     /* the backend (hep_ep_setup) */
    hep_backend_ctx be;             /* what the backend sees, and the record of the calls */
};

/* group/ep.c */
int hep_ep_setup(hep_group *g);    /* after the arenas and peers exist */
void hep_ep_teardown(hep_group *g);
/* The proxy's counters and the last dispatch's device timestamps (hep_group_get_stats). */
void hep_ep_fill_stats(const hep_group *g, hep_group_stats *s);
/* What the GPU kernels take across N nodes, for one call of `call` (its name in the
 * message): the layout (hep_layout: both; expert-major with each node's ranks in one
 * process only), whether the node's ranks are in several processes, and whether
 * probabilities come back through combine (taken with both layouts), and async_cap: the
 * receive capacity (config.max_recv_rows) of a HEP_ASYNC dispatch, or 0 (the rank-major
 * layout drops rows past it; the expert-major one is refused). Caller handles are taken with
 * every layout, and rings of any size. 0 (also for N = 1), or HEP_ERR_UNAVAILABLE naming
 * the option.
 * Needs no GPU (tests/test_train.c). */
int hep_ep_gpu_nodes_check(int N, int layout, int procs, int probs, int async_cap,
                           const char *call);
/* group/handle.c */
struct hep_handle *hep_handle_alloc(const hep_group *g);
/* 0 if h was created by g and (filled) holds a layout, else HEP_ERR_INVALID naming why. */
int hep_handle_check(const hep_group *g, const struct hep_handle *h, int filled, const char *call);

/* Bytes that failed destroys kept allocated in this process (a node-mate that did not
 * arrive may still use them); they stay reachable from a list, not lost. */
size_t hep_group_kept_bytes(void);

int hep_group_create_ex(const hep_config *cfg, const hep_bootstrap *bs, int cuda_device,
                        const hep_group_hooks *hooks, hep_group **out);

/* Pointer to buffer `id` in node-mate `local`'s shared arena, or in this rank's arena. */
static inline char *hep_peer_buf(const hep_group *g, int local, int id)
{
    return g->peer_shared[local] + g->plan.buf[id].offset;
}
static inline char *hep_my_buf(const hep_group *g, int id)
{
    const hep_plan_buffer *b = &g->plan.buf[id];
    if (b->arena == HEP_ARENA_SHARED)
        return g->peer_shared[g->local] + b->offset;
    return g->arena[b->arena] + b->offset;
}

/* Collective status agreement: every rank passes its local status; all return the status
 * of the lowest failing rank, with that rank's message ("rank r: ..."). `extra` (may be
 * NULL) is an int each rank contributes; `extras` receives all of them. */
int hep_group_agree(hep_group *g, int rc, int extra, int *extras);

#endif
