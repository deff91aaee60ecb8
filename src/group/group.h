/* group: create/destroy, the collective agreement of every step, buffer sharing. */
#ifndef HEP_GROUP_H
#define HEP_GROUP_H

#include <stddef.h>
#include <stdint.h>

#include "hybridep/hybridep.h"
#include "layout/plan.h"
#include "net/coordinator.h"

#define HEP_MAX_LOCAL 72

/* The host backend's mailbox (sync.mailbox, u64 words): what a rank publishes to its
 * node-mates, who read it in the same address space. */
enum { HEP_MB_TOKENS, HEP_MB_SCALES, HEP_MB_IDX, HEP_MB_WEIGHTS, HEP_MB_T, HEP_MB_K,
       HEP_MB_INDEX64, HEP_MB_COMBINE_IN, HEP_MB_LOCAL,
       HEP_MB_HANDLE,   /* combine: the hep_handle it combines with (ranks of one process) */
       HEP_MB_PROBS_IN, /* combine: its probs_in, or 0 */
       HEP_MB_DEPARTED = 16 /* [R]: node-mate l entered destroy (it no longer reads here) */ };

/* Test hooks of group creation (internal; not part of the public ABI). */
typedef struct hep_group_hooks {
    const hep_gpu_mr_ops *mr_override; /* non-NULL members replace the NIC's registration calls */
    int transport;                     /* 0 = from HEP_NIC, 1 = loopback, 2 = verbs */
    int hold_credits;                  /* host backend: never free a ring chunk (a peer that
                                          does not return credits) */
} hep_group_hooks;

struct hep_group {
    hep_config cfg;
    hep_bootstrap bs;
    int device;
    int rank, world, R, N, node, local;
    int mates_one_gpu;              /* every node-mate drives this rank's GPU */
    int mates_one_process;          /* every node-mate is a thread of this process */
    hep_plan plan;
    char *arena[HEP_ARENA_COUNT];   /* this rank's arenas (device or host addresses) */
    char *mapped_dev;               /* device address of the mapped arena */
    char *peer_shared[HEP_MAX_LOCAL]; /* each node-mate's shared arena, by local rank */
    unsigned char ipc_opened[HEP_MAX_LOCAL];
    hep_coord *coord;
    struct hep_proxy *proxy;        /* N > 1, host backend: the CPU proxy driving the NIC */
    struct hep_shm *shm;            /* host backend across processes: group/shm.h */
    uint64_t epoch;                 /* dispatch calls made (flags are multiples of it) */
    uint64_t combine_epoch;
    int dmabuf_banner;              /* printed the banner */
    /* dispatch/combine state */
    struct hep_kargs *kargs;        /* GPU backend: launch arguments, node pointers filled */
    int last_t;                     /* tokens of the last dispatch */
    int last_recv;                  /* rows received by it (host backend, sync mode) */
    uint64_t last_handle;           /* hep_handle_of(epoch of the last dispatch), 0 after combine */
    uint64_t handle_tag;            /* this group's tag in its handles */
    struct hep_handle *own_handle;  /* host backend: the layout of a one-shot dispatch */
    uint64_t copy_bytes;            /* written into caller memory by dispatches */
    int last_call;                  /* host backend: 1 dispatch, 2 combine, 0 none yet */
    uint64_t x_epoch;               /* GPU: the dispatch whose rows exchange.token holds, 0 once
                                       a combine ran after it (then no combine is in place) */
    int hold_credits;               /* hep_group_hooks.hold_credits */
    int *row_experts;               /* host backend, during an expert-major dispatch: each
                                       received row's local experts ([rows][kmax], -1 ends) */
    int broken;                     /* a timeout left the flags inconsistent */
    char broken_msg[1024];
};

/* group/ep.c */
int hep_ep_setup(hep_group *g);    /* after the arenas and peers exist */
/* The result's pointers into this rank's buffers (num_recv = -1, handle 0). */
void hep_fill_dispatch_result(hep_group *g, hep_dispatch_result *o);
void hep_ep_teardown(hep_group *g);
/* The proxy's counters and the last dispatch's device timestamps (hep_group_get_stats). */
void hep_ep_fill_stats(const hep_group *g, hep_group_stats *s);
/* ref/host_backend.c: the host backend's halves of dispatch and combine */
int hep_host_dispatch(hep_group *g, const hep_dispatch_args *a, hep_dispatch_result *out);
int hep_host_combine(hep_group *g, const hep_combine_args *a);
/* With the training options (group/ep.c checked them; h is the handle to record into, or
 * for reuse the one to read, never NULL; c->handle the one to combine with). */
int hep_host_dispatch_ex(hep_group *g, const hep_dispatch_args *a, hep_dispatch_opts *x,
                         struct hep_handle *h, hep_dispatch_result *out);
int hep_host_combine_ex(hep_group *g, const hep_combine_args *a, const hep_combine_opts *c);
/* A dispatch's layout as a later combine (or a dispatch with HEP_REUSE_LAYOUT) needs it.
 * The host backend fills every host field; the GPU backend (one node) keeps the layout in
 * the handle's device memory and only tag, epoch, t, topk and layout on the host (see
 * docs/architecture.md, "Handles"). */
struct hep_handle {
    uint64_t tag;        /* the creating group's handle_tag */
    uint64_t epoch;      /* the group's dispatch count when it was recorded; 0: empty */
    int T, kmax, W, El, N;   /* the shape its arrays were sized for */
    int t, topk, recv;   /* tokens and slots of the dispatch; rows it received */
    int layout, pad, budget; /* hep_layout, pad_multiple, num_permuted_tokens */
    int num_permuted, overflow, overflow_rows;
    int em_words[3];     /* host backend: the three above, for permuted_device */
    int *ids;            /* [T][kmax] the dispatch's routing (invalid ids and unused as -1) */
    float *w;            /* [T][kmax] its weights (0 past topk) */
    float *w_scratch;    /* [T][kmax] a reuse's caller weights widened to kmax */
    int *base;           /* [W + 1] row of the first token of each source rank, then recv */
    int *ebase;          /* [W][El] expert-major: each source's first position in block e */
    int64_t *tpe;        /* [El] expert-major: padded rows per expert as written */
    int *slot_t;         /* [N] N > 1: tokens of each other node's slot at this rank ... */
    int *slot_ids;       /* [N][T][kmax] ... and their routing */
    /* GPU backend, one node: one device allocation (hep_handle_create allocates it on the
     * group's GPU, hep_handle_destroy frees it) that the kernels write when a dispatch
     * records into the handle and read in its combines and reuses */
    void *dev;
    int *d_rows;         /* [T][R] each own token's position among this rank's rows at each
                            node-mate, or -1 (the dispatch kernel's dest_rows) */
    int *d_meta;         /* [R] this rank's row base at each node-mate */
    int *d_counts;       /* [0] rows received, [1] 1 if over the receive capacity, [2, 2 + El)
                            tokens per local expert */
    int *d_ids;          /* [T][kmax] the routing (int32, -1 = none), with the row width topk */
    float *d_w;          /* [T][kmax] its weights */
    /* expert-major (see kernels/dispatch.cu): */
    int *d_epos;         /* [T][kmax] each own slot's row in its destination's expert-major
                            output (first slot of an expert only; -1: none or dropped) */
    int *d_ebase;        /* [R][El] this rank's first row in each node-mate's block e */
    int *d_ebc;          /* [S][R][El] scratch: each dispatch block's counts per expert */
    int *d_em;           /* [HEP_EM_WORDS] num_permuted, overflow, overflow_rows, then per
                            local expert its data end and padding end (clipped) */
    int64_t *d_tpe;      /* [El] padded rows per local expert as written */
};
/* group/handle.c */
struct hep_handle *hep_handle_alloc(const hep_group *g);
/* 0 if h was created by g and (filled) holds a layout, else HEP_ERR_INVALID naming why. */
int hep_handle_check(const hep_group *g, const struct hep_handle *h, int filled, const char *call);

/* group/wire.c: the proxy's chunks (net/proxy.h) of the inter-node path */
struct hep_proxy_chunk;
int hep_slot_of(int node, int at_node); /* index of `node`'s slot at a rank of `at_node` */
/* Buffer lid (+loff) of this rank to buffer rid (+roff) of `peer`, when *ready >= epoch. */
struct hep_proxy_chunk hep_wire_chunk(const hep_group *g, int peer, int lid, size_t loff,
                                      int rid, size_t roff, size_t len,
                                      const volatile uint64_t *ready);
/* A slot's count (word lword of buffer lid -> word rword of rid), then its flag (words
 * N + lword -> N + rword), after all of the batch's earlier chunks to that peer. */
struct hep_proxy_chunk hep_wire_count_then_flag(const hep_group *g, int peer, int lid, int rid,
                                                int lword, int rword,
                                                const volatile uint64_t *ready);
/* A flag on its own: word lword of lid (its source, and the chunk's ready word: posted once
 * it holds >= want) to word rword of the peer's rid, after every earlier chunk to the peer. */
struct hep_proxy_chunk hep_wire_flag(const hep_group *g, int peer, int lid, size_t lword, int rid,
                                     size_t rword, uint64_t want);
/* The GPU path's batch for phase 0 (dispatch) or 1 (combine) with S blocks; `ch` holds
 * (N - 1) x (4 S + 2). Returns the number of chunks. */
int hep_wire_gpu_batch(const hep_group *g, int phase, int S, struct hep_proxy_chunk *ch);

/* Bytes that failed destroys kept allocated in this process (a node-mate that did not
 * arrive may still use them); they stay reachable from a list, not lost. */
size_t hep_group_kept_bytes(void);

int hep_group_create_ex(const hep_config *cfg, const hep_bootstrap *bs, int cuda_device,
                        const hep_group_hooks *hooks, hep_group **out);

/* A dispatch's handle: the group's tag above its call count. */
#define HEP_HANDLE_EPOCH_BITS 40
#define HEP_HANDLE_TAG_MASK ((1ull << (64 - HEP_HANDLE_EPOCH_BITS)) - 1)
static inline uint64_t hep_handle_of(const hep_group *g, uint64_t epoch)
{
    return g->handle_tag << HEP_HANDLE_EPOCH_BITS |
           (epoch & ((1ull << HEP_HANDLE_EPOCH_BITS) - 1));
}

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
