/* backend/backend.h: the interface between the group layer and its two backends, the host
 * backend (ref/) and the GPU kernels (kernels/backend_gpu.c). The group layer checks every
 * argument, the handle's tag and the one-shot bookkeeping, then calls the group's
 * hep_backend_ops; a backend sees the group only through hep_backend_ctx, a view the group
 * fills once its arenas, peers, coordinator and proxy exist (hep_ep_setup), and the record
 * of the calls that both sides keep in it. Neither backend includes group/group.h. */
#ifndef HEP_BACKEND_H
#define HEP_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "hybridep/hybridep.h"
#include "layout/plan.h"

#define HEP_MAX_LOCAL 72

/* The host backend's mailbox (sync.mailbox, u64 words): what a rank publishes to its
 * node-mates, who read it in the same address space. */
enum { HEP_MB_TOKENS, HEP_MB_SCALES, HEP_MB_IDX, HEP_MB_WEIGHTS, HEP_MB_T, HEP_MB_K,
       HEP_MB_INDEX64, HEP_MB_COMBINE_IN, HEP_MB_LOCAL,
       HEP_MB_HANDLE,   /* combine: the hep_handle it combines with (ranks of one process) */
       HEP_MB_PROBS_IN, /* combine: its probs_in, or 0 */
       HEP_MB_DEPARTED = 16 /* [R]: node-mate l entered destroy (it no longer reads here) */ };

/* Across processes (ref/host_shm.h): the words that start a rank's combine layout in its
 * segment, then [W][E_l] int32 (expert-major: each source's first row in block e). */
enum { HEP_SHM_COMB_LAYOUT, HEP_SHM_COMB_ROWS, HEP_SHM_COMB_BUDGET, HEP_SHM_COMB_PROBS,
       HEP_SHM_COMB_STAGED, /* across nodes: 1 when the rows are in the expert-major staging */
       HEP_SHM_COMB_WORDS };

struct hep_coord;
struct hep_proxy;
struct hep_shm;
struct hep_kargs;

/* What a backend sees of its group. */
typedef struct hep_backend_ctx {
    /* the view: filled by the group layer (hep_ep_setup), read-only to the backends */
    const hep_config *cfg;
    hep_bootstrap *bs;
    int device;
    int rank, world, R, N, node, local;
    int mates_one_gpu;              /* every node-mate drives this rank's GPU */
    int dispatch_bulk;              /* GPU backend: the dispatch kernel with bulk stores
                                       (dispatch_bulk.cu), chosen at setup */
    int mates_one_process;          /* every node-mate is a thread of this process */
    int hold_credits;               /* never free a ring chunk (a test hook; GPU: the proxy
                                       sends no credit) */
    const hep_plan *plan;
    char *const *arena;             /* [HEP_ARENA_COUNT] this rank's arenas */
    char *mapped_dev;               /* device address of the mapped arena */
    char *const *peer_shared;       /* [R] each node-mate's shared arena, by local rank */
    const struct hep_coord *coord;  /* N > 1: the registrations (backend/wire.c) */
    struct hep_proxy *proxy;        /* N > 1: the CPU proxy driving the NIC */
    /* host backend across processes (group/shm.c mapped the node-mates' segments): */
    const struct hep_shm *shm;      /* non-NULL then */
    char *shm_local[HEP_MAX_LOCAL]; /* each node-mate's local arena, as mapped here */
    char *shm_stage[HEP_MAX_LOCAL]; /* each node-mate's input staging, as mapped here */
    size_t shm_st_scales, shm_st_idx, shm_st_weights; /* staging offsets (tokens at 0) */
    char *shm_comb[HEP_MAX_LOCAL];  /* each node-mate's combine layout, as mapped here */
    char *shm_em[HEP_MAX_LOCAL];    /* N > 1: each node-mate's expert-major staging, as mapped
                                       here: shm_em_rows BF16 rows, then at shm_em_prob their
                                       f32 probabilities (NULL: none, max_permuted_rows 0) */
    size_t shm_em_prob, shm_em_rows;
    uint64_t shm_rounds;            /* combine rounds so far (every node-mate counts alike) */
    uint64_t handle_tag;            /* this group's tag in its handles */
    struct hep_handle *own_handle;  /* host backend: the layout of a one-shot dispatch */
    /* the record of the calls: written by the backends, read by the group layer */
    uint64_t epoch;                 /* dispatch calls made (flags are multiples of it) */
    uint64_t combine_epoch;
    int last_t;                     /* tokens of the last dispatch */
    int last_recv;                  /* rows received by it (host backend, sync mode) */
    uint64_t last_handle;           /* hep_handle_of(epoch of the last dispatch), 0 after combine */
    uint64_t copy_bytes;            /* written into caller memory by dispatches */
    int last_call;                  /* host backend, GPU across nodes: 1 dispatch, 2 combine,
                                       0 none yet */
    void *call_end;                 /* GPU across nodes: a cudaEvent_t recorded after each
                                       call's launches (the end of the last call) */
    uint64_t x_epoch;               /* GPU: the dispatch whose rows exchange.token holds, 0 once
                                       a combine ran after it (then no combine is in place) */
    int recv_limit;                 /* host backend, during a dispatch: 0, or the capacity
                                       past which rows are dropped (HEP_ASYNC, rank-major) */
    int *row_experts;               /* host backend, during an expert-major dispatch: each
                                       received row's local experts ([rows][kmax], -1 ends) */
    struct hep_kargs *kargs;        /* GPU backend: launch arguments, node pointers filled */
    int broken;                     /* a timeout left the flags inconsistent */
    char broken_msg[1024];
} hep_backend_ctx;

/* One backend. Every call's arguments were checked by the group layer. */
typedef struct hep_backend_ops {
    const char *name;
    /* After the view is filled, before the proxy is started. */
    int (*setup)(hep_backend_ctx *b);
    /* After the proxy is stopped; also after a failed or missing setup. */
    void (*teardown)(hep_backend_ctx *b);
    /* The handle memory this backend adds to the host part (hep_handle_alloc), or NULL. */
    int (*handle_alloc)(const hep_backend_ctx *b, struct hep_handle *h);
    /* x: the training options (NULL: none); h: the caller handle to record into or, with
     * HEP_REUSE_LAYOUT, to read (NULL: the one-shot layout). */
    int (*dispatch)(hep_backend_ctx *b, const hep_dispatch_args *a, hep_dispatch_opts *x,
                    struct hep_handle *h, hep_dispatch_result *o);
    /* h: the caller handle (NULL: the one-shot layout); c: the options (NULL: none). */
    int (*combine)(hep_backend_ctx *b, const hep_combine_args *a, const struct hep_handle *h,
                   const hep_combine_opts *c);
    /* hep_group_sync: the asynchronous calls' status. */
    int (*sync)(hep_backend_ctx *b, void *stream);
    /* The backend's part of hep_group_get_stats, or NULL. */
    void (*fill_stats)(const hep_backend_ctx *b, hep_group_stats *s);
} hep_backend_ops;

extern const hep_backend_ops hep_host_backend; /* ref/host_backend.c */
extern const hep_backend_ops hep_gpu_backend;  /* kernels/backend_gpu.c */

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
    int drop_words[3];   /* host backend: the receive capacity's words of its dispatch
                            (hep_dispatch_result.overflow_device) */
    int *ids;            /* [T][kmax] the dispatch's routing (invalid ids and unused as -1) */
    float *w;            /* [T][kmax] its weights (0 past topk) */
    float *w_scratch;    /* [T][kmax] a reuse's caller weights widened to kmax */
    int *base;           /* [W + 1] row of the first token of each source rank, then recv */
    int *ebase;          /* [W][El] expert-major: each source's first position in block e */
    int64_t *tpe;        /* [El] expert-major: padded rows per expert as written */
    int *slot_t;         /* [N] N > 1: tokens of each other node's slot at this rank ... */
    int *slot_ids;       /* [N][T][kmax] ... and their routing */
    /* GPU backend: one device allocation (hep_handle_create allocates it on the group's
     * GPU, hep_handle_destroy frees it) that the kernels write when a dispatch records
     * into the handle and read in its combines and reuses */
    void *dev;
    int *d_rows;         /* [N][T][R] each token of list L (own tokens, each other node's
                            slot) at its position among this rank's rows at each node-mate,
                            or -1 (the dispatch kernel's dest_rows) */
    int *d_meta;         /* [N][R] this rank's row base of each list at each node-mate */
    int *d_counts;       /* [0] rows received, [1] 1 if over the receive capacity, [2, 2 + El)
                            tokens per local expert */
    int *d_ids;          /* [T][kmax] the routing (int32, -1 = none), with the row width topk */
    float *d_w;          /* [T][kmax] its weights */
    /* expert-major (see kernels/dispatch.cu): */
    int *d_epos;         /* [N][T][kmax] each slot's row of each list (own tokens; across
                            nodes each other node's slot) in its destination's expert-major
                            output (first slot of an expert only; -1: none or dropped) */
    int *d_ebase;        /* [N][R][El] each list's first row in each node-mate's block e */
    int *d_ebc;          /* [N][S][R][El] scratch: each dispatch block's counts per expert */
    int *d_ekey;         /* [N - 1][T][kmax] across nodes: the (node-mate, local expert)
                            d El + e of each slot's row of each other node's slot, or -1 */
    int *d_em;           /* [HEP_EM_WORDS] num_permuted, overflow, overflow_rows, then per
                            local expert its data end and padding end (clipped) */
    int64_t *d_tpe;      /* [El] padded rows per local expert as written */
    int *d_drop;         /* [3] the receive capacity's words (overflow_device) */
    int *d_npos;         /* [T][N] across nodes: each own token's row in each node's slot */
    int *d_slots;        /* [N] across nodes: tokens of each other node's slot here */
};

/* A dispatch's handle: the group's tag above its call count. */
#define HEP_HANDLE_EPOCH_BITS 40
#define HEP_HANDLE_TAG_MASK ((1ull << (64 - HEP_HANDLE_EPOCH_BITS)) - 1)
static inline uint64_t hep_handle_of(const hep_backend_ctx *b, uint64_t epoch)
{
    return b->handle_tag << HEP_HANDLE_EPOCH_BITS |
           (epoch & ((1ull << HEP_HANDLE_EPOCH_BITS) - 1));
}

/* Pointer to buffer `id` in node-mate `local`'s shared arena, or in this rank's arena. */
static inline char *hep_be_peer_buf(const hep_backend_ctx *b, int local, int id)
{
    return b->peer_shared[local] + b->plan->buf[id].offset;
}
static inline char *hep_be_buf(const hep_backend_ctx *b, int id)
{
    const hep_plan_buffer *p = &b->plan->buf[id];
    if (p->arena == HEP_ARENA_SHARED)
        return b->peer_shared[b->local] + p->offset;
    return b->arena[p->arena] + p->offset;
}

/* backend/result.c: the result's pointers into this rank's buffers (num_recv = -1, handle
 * 0, no device counts: the GPU backend adds its own). */
void hep_fill_dispatch_result(const hep_backend_ctx *b, hep_dispatch_result *o);

/* backend/wire.c: the proxy's chunks (net/proxy.h) of the inter-node path */
struct hep_proxy_chunk;
int hep_slot_of(int node, int at_node); /* index of `node`'s slot at a rank of `at_node` */
/* Buffer lid (+loff) of this rank to buffer rid (+roff) of `peer`, when *ready >= epoch. */
struct hep_proxy_chunk hep_wire_chunk(const hep_backend_ctx *g, int peer, int lid, size_t loff,
                                      int rid, size_t roff, size_t len,
                                      const volatile uint64_t *ready);
/* A slot's count (word lword of buffer lid -> word rword of rid), then its flag (words
 * N + lword -> N + rword), after all of the batch's earlier chunks to that peer. */
struct hep_proxy_chunk hep_wire_count_then_flag(const hep_backend_ctx *g, int peer, int lid,
                                                int rid, int lword, int rword,
                                                const volatile uint64_t *ready);
/* A flag on its own: word lword of lid (its source, and the chunk's ready word: posted once
 * it holds >= want) to word rword of the peer's rid, after every earlier chunk to the peer. */
struct hep_proxy_chunk hep_wire_flag(const hep_backend_ctx *g, int peer, int lid, size_t lword,
                                     int rid, size_t rword, uint64_t want);
/* The GPU path's batch for phase 0 (dispatch; probs: the expert-major layout, with each
 * slot token's places) or 1 (combine; probs: with each slot token's row of
 * probabilities), call value e (dispatch: its e; combine: its count c), t own tokens;
 * `ch` holds hep_wire_gpu_batch_max(g). Returns the number of chunks. */
size_t hep_wire_gpu_batch_max(const hep_backend_ctx *g);
int hep_wire_gpu_batch(const hep_backend_ctx *g, int phase, uint64_t e, int t, int probs,
                       struct hep_proxy_chunk *ch);

#endif
