/* hybridep/hybridep.h: expert-parallel dispatch and combine for Mixture-of-Experts.
 *
 * A group is W ranks (W = N nodes x R ranks per node), each driving one GPU or one
 * virtual rank of a shared GPU. hep_group_create() is collective over a bootstrap
 * (hybridep/bootstrap.h); it checks that every rank has the same configuration, plans
 * and allocates all buffers, shares the intra-node ones and, for N > 1, registers the
 * inter-node ones for RDMA and connects the queue pairs.
 *
 * Ownership: the group owns every buffer it plans (see `hybridep plan`); the zero-copy
 * outputs of a dispatch point into them and stay valid until the next dispatch or combine
 * on that group. hep_dispatch_ex can write them into caller memory instead, and record the
 * layout in a handle (hep_handle_create) that the caller keeps for later combines.
 */
#ifndef HYBRIDEP_HYBRIDEP_H
#define HYBRIDEP_HYBRIDEP_H

#include <stddef.h>
#include <stdint.h>

#include "hybridep/bootstrap.h"
#include "hybridep/status.h"
#include "hybridep/version.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { HEP_DTYPE_BF16 = 0, HEP_DTYPE_FP8_E4M3 = 1 } hep_dtype;
typedef enum { HEP_BACKEND_GPU = 0, HEP_BACKEND_HOST = 1 } hep_backend;

/* Channels of FP8 data per f32 scale. */
#define HEP_FP8_BLOCK 128

/* Group shapes each backend can create (hep_config_check and group creation refuse
 * others). GPU: the kernels give one warp lane to each node-mate, and to each node of a
 * word of 32 nodes (taken one word after another). Host:
 * its ranks are threads of one process (with the in-process bootstrap at most 4096). Any
 * backend: world x max_tokens <= 2^30 receive rows. */
#define HEP_MAX_RANKS_PER_NODE_GPU 32
#define HEP_MAX_NODES_GPU 128
#define HEP_MAX_RANKS_PER_NODE_HOST 64
#define HEP_MAX_NODES_HOST 128
/* config.chunk_tokens = HEP_CHUNK_DEFAULT (the default) takes the backend's default:
 * HEP_CHUNK_DEFAULT_HOST tokens on the host backend. On the GPU kernels, two chunks of
 * ceil(T / 2) (the ring holds the whole slot: no credit round trips through the CPU proxy,
 * and chunk 0 travels while chunk 1 is packed) where a rank's inter-node slots take at
 * most HEP_GPU_WHOLE_SLOT_BYTES, counted as 3 x (N - 1) x T BF16 rows of H
 * (2 x 4 and 4 x 2 nodes at T = 4096, H = 7168: 176 and 528 MB); combine then cuts the same
 * slot into four chunks of ceil(T / 4) where they fit it (T % 4 = 0 or 3), so that its
 * partial sums land, and are summed, sooner; past it
 * HEP_CHUNK_GPU_RING_TOKENS / (N - 1) tokens, between 8 and HEP_CHUNK_DEFAULT_GPU (512 up
 * to 8 nodes, 28 at 128): a rank's rings hold as many tokens in all as 8 nodes' rings of
 * 512, so their memory stays flat in the number of nodes, while a node's share of a
 * rank's tokens (its slot) shrinks as N grows. Any other value means the same on both. */
#define HEP_CHUNK_DEFAULT (-1)
#define HEP_CHUNK_DEFAULT_HOST 8
#define HEP_CHUNK_DEFAULT_GPU 512
#define HEP_CHUNK_GPU_RING_TOKENS 3584
#define HEP_GPU_WHOLE_SLOT_BYTES (640ull << 20)

typedef struct hep_config {
    int hidden;           /* H: channels per token. BF16: a multiple of 8 (16-byte rows);
                             FP8: a multiple of 128. 8..65536. No default (0 = unset). */
    int max_tokens;       /* T: most tokens one rank passes to one call, 1..65536. No default. */
    int experts_per_rank; /* E_l: 1..1024. No default. Global expert id e lives on rank
                             e / E_l. */
    int max_topk;         /* K: most experts per token, 1..32, at most E_l x W. Default 8. */
    hep_dtype dtype;      /* dispatch payload: BF16 (default) or FP8 E4M3 with one f32 scale
                             per 128 channels. Combine is always BF16 with f32 accumulation. */
    int ranks_per_node;   /* R: ranks of one NVLink domain. 0 (default) = the ranks of the
                             bootstrap that share a host. Must divide W. Virtual nodes: set
                             R < W on one host and the loopback NIC carries the N > 1 path
                             (ranks of one process; the host backend also across the
                             processes of one host, through POSIX shared memory).
                             At most HEP_MAX_RANKS_PER_NODE_GPU / _HOST, with at most
                             HEP_MAX_NODES_GPU / _HOST nodes (below). */
    int dispatch_sms;     /* SMs (thread blocks) of one rank's dispatch kernel, 1..132.
                             Default 16. All co-located ranks of a GPU must fit together. */
    int combine_sms;      /* likewise for combine. Default 16. */
    int chunk_tokens;     /* C: -1..4096, default HEP_CHUNK_DEFAULT (-1): the backend's
                             default, 8 on the host backend; on the GPU kernels ceil(T / 2)
                             (combine: ceil(T / 4) over the same slot, above) while the slots
                             fit HEP_GPU_WHOLE_SLOT_BYTES, else 3584 / (N - 1) clamped to
                             8..512 (above). N > 1:
                             each inter-node slot (receive, send staging, partial sums) is a
                             ring of 2 chunks of C tokens, freed back to the sender by
                             credits, so these buffers hold 2 x C rows per other node instead
                             of T (0 = one chunk of T: no ring; a C with 2 x C >= T is one
                             chunk position per C tokens that T needs). Host backend, 8: a
                             chunk is still one large write (8 rows of H = 7168 BF16 are
                             115 KB) and the memory per rank stays almost flat in the number
                             of nodes. GPU, 512 up to 8 nodes: a chunk costs the CPU proxy a round trip of
                             its credit, so chunks are larger there; EP64 (8 x 8, T = 4096,
                             H = 7168, E_l = 4, K = 8, BF16) plans 3.97 GB per rank with it,
                             4.60 GB with 0. Both layouts take rings of any C.
                             `hybridep plan --chunk` shows the memory either way. */
    hep_backend backend;  /* GPU kernels (default) or the host backend (host memory, threads;
                             the reference semantics, and the CPU-only path). */
    int max_recv_rows;    /* receive capacity: rows the dispatch outputs of one rank hold
                             (exchange.token, dispatch.recv_prob, dispatch.recv_scaling_factor
                             are sized by it). 0 (default) = W x T, the worst case (every token
                             of every rank routed to one rank), which never overflows; else
                             1..W x T. Blocking mode: a dispatch that needs more rows on
                             any rank writes nothing into any rank's receive buffers (GPU
                             across nodes: nothing on the nodes of the ranks over it; the
                             other nodes' ranks may have received rows below the capacity,
                             which are void) and fails on every rank with HEP_ERR_OVERFLOW;
                             no row is ever written at or past the capacity. HEP_ASYNC (no host
                             round trip, so also in graph capture), rank-major layout: rows
                             are dropped instead, by the rule of the expert-major budget:
                             every rank keeps the rows whose position in its receive order
                             is below the capacity and drops those at or past it; num_recv
                             is min(rows needed, capacity), tokens_per_expert[e] counts the
                             kept rows with a slot on e, a combine of that call sums only
                             the kept rows (a dropped row contributes nothing, a token whose
                             rows were all dropped gets -0.0), probabilities through combine
                             are 0 for a dropped row, a HEP_REUSE_LAYOUT dispatch of that
                             layout drops the same rows; hep_dispatch_result.overflow_device
                             says so on the device, and the call (host backend) or
                             hep_group_sync (GPU) returns HEP_WARN_IGNORED naming the first
                             rank over it. The expert-major layout is all or nothing in
                             both modes (HEP_ERR_OVERFLOW; with HEP_ASYNC on the GPU at
                             hep_group_sync, and a combine of it does nothing). The group
                             stays usable either way. `hybridep plan` prints what uniform
                             routing needs. GPU backend, any number of nodes: each node's
                             layout step sees its ranks' rows of every list (own tokens,
                             every other node's slot); across nodes the blocking call then
                             agrees through the bootstrap (one allgather per dispatch).
                             Across nodes with HEP_ASYNC each node decides alone:
                             overflow_device[HEP_OVERFLOW_DROPPED] and hep_group_sync's
                             HEP_WARN_IGNORED are those of the ranks of this node (the
                             rows kept, counts and combine are the host backend's), and
                             the expert-major layout with HEP_ASYNC and a capacity is
                             refused (HEP_ERR_UNAVAILABLE). */
    int max_permuted_rows; /* GPU backend, one node, the node's ranks in several processes
                             (one process per GPU, torchrun): the rows of the group-owned
                             expert-major staging (expert_major.token, .prob, .scaling_factor
                             of `hybridep plan`, shared with the node-mates through CUDA IPC)
                             that the expert-major layout of hep_dispatch_ex lands in before
                             each rank copies its rows into its caller memory, and that its
                             combine reads the node-mates' expert outputs from. 0 (default) =
                             none: such a dispatch is refused naming this field; else
                             1..2^30, and a dispatch whose num_permuted_tokens exceeds it is
                             refused (HEP_ERR_INVALID). Not used (but allocated) when the
                             node's ranks are threads of one process (their kernels write the
                             caller memory directly). Host backend: used across nodes with a
                             node's ranks in several processes only, where a rank's combine
                             passes its expert-major rows (and probabilities) to its node-mates
                             through its shared segment at once: those past max_recv_rows go
                             through a staging of this many rows in the segment (2 H + 4 bytes
                             a row); a num_permuted_tokens above both is refused
                             (HEP_ERR_INVALID). */
} hep_config;

/* Fill *c with the defaults above (the fields without a default are zero). */
void hep_config_default(hep_config *c);
/* 0 if *c is valid for a group of `world` ranks (0: check what can be checked without
 * one; negative: HEP_ERR_INVALID), else HEP_ERR_INVALID naming the field, its value and its
 * limits (including the backend's group shape). On success hep_last_error() is "". */
int hep_config_check(const hep_config *c, int world);

typedef struct hep_group hep_group;

/* Collective over `bs`: every rank calls it with the same configuration. `cuda_device`
 * is the GPU this rank drives (ignored by the host backend). On failure every rank
 * returns an error with the failing rank's message; nothing stays allocated.
 * HEP_ERR_UNAVAILABLE for several nodes that no NIC can join: the GPU backend's nodes
 * across processes, or nodes on different hosts, without a verbs NIC (the loopback NIC
 * joins the ranks of one process, and the host backend's ranks of one host). */
int hep_group_create(const hep_config *cfg, const hep_bootstrap *bs, int cuda_device,
                     hep_group **out);
/* Collective. Releases everything in reverse order of creation. NULL is accepted. Its
 * barrier waits up to 4 x HEP_TIMEOUT_MS, so that ranks still returning from a call that
 * timed out reach it: when every rank calls destroy, every byte is freed (also after a
 * timeout). If a rank never comes, the others return its failure (HEP_ERR_TIMEOUT with the
 * in-process bootstrap) and free everything except, on a rank that shares a node with a
 * rank that may still be running, the memory that rank can still reach (host backend: the
 * node-shared and local arenas; GPU: the node-shared arena); the message says how many
 * bytes were kept and why. The group pointer is invalid afterwards in every case. */
int hep_group_destroy(hep_group *g);

/* Read-only facts about a created group. */
typedef struct hep_group_info {
    int rank, world, nodes, ranks_per_node, node, local_rank;
    size_t max_recv_rows;       /* capacity of the dispatch outputs, rows */
    size_t device_bytes;        /* device memory this rank allocated */
    size_t host_bytes;          /* pinned / mapped host memory this rank allocated */
    int registrations;          /* RDMA registrations (N > 1) */
    int dmabuf_registrations;   /* of which took the DMA-BUF path */
    const char *transport;      /* "none" (N = 1), "loopback" or "verbs" */
} hep_group_info;
int hep_group_get_info(const hep_group *g, hep_group_info *info);

/* Whether this library's GPU kernels run on CUDA device `cuda_device` (launches a tiny
 * kernel and checks its answer). 0, or HEP_ERR_UNAVAILABLE (no CUDA in this build, no
 * such device, or the kernels were not built for its architecture) with the reason. */
int hep_gpu_probe(int cuda_device);

/* ---------------------------------------------------------------- dispatch / combine
 *
 * Receive order: rank r's dispatch output lists every token routed to any of its local
 * experts exactly once, ordered by [source node][source local rank][token index] (for
 * one node: by source rank, then token index). Row j's probabilities are prob[j * E_l + e]
 * for local expert e: the sum of the top-k weights of the slots that chose global expert
 * r * E_l + e (0 where none did). tokens_per_expert[e] counts the received tokens with at
 * least one slot on local expert e. Combine returns, for each of this rank's tokens, the
 * f32 sum (in ascending destination rank) of the rows of its destinations, as BF16; a
 * token routed nowhere gets zeros. Combine does not apply the probabilities.
 *
 * Both calls are collective over the group and stream-ordered; every rank calls
 * dispatch, then combine, in the same sequence. */

typedef enum { HEP_INDEX_INT32 = 0, HEP_INDEX_INT64 = 1 } hep_index_type;

/* Flags of dispatch/combine (other bits: HEP_ERR_INVALID). */
#define HEP_ASYNC 1u /* do not wait for the stream: no host synchronization (graph capture
                        with one node; across nodes the CPU proxy posts each call's writes,
                        so capture is refused with HEP_ERR_UNAVAILABLE); counts are only on
                        the device; errors surface at hep_group_sync */

typedef struct hep_dispatch_args {
    int num_tokens;            /* t, 0..max_tokens */
    const void *tokens;        /* [t, H] BF16 or FP8 E4M3, rows 16-byte aligned */
    const float *scales;       /* FP8: [t, H / 128] f32; BF16: NULL */
    const void *topk_idx;      /* [t, topk] global expert ids, -1 = unused slot */
    hep_index_type index_type; /* int32 or int64 ids */
    int topk;                  /* 1..max_topk */
    const float *topk_weights; /* [t, topk] */
    void *stream;              /* cudaStream_t (GPU backend); ignored by the host backend */
    unsigned flags;            /* 0 or HEP_ASYNC */
} hep_dispatch_args;

typedef struct hep_dispatch_result {
    void *tokens;             /* [max_recv_rows, H] received rows (group memory) */
    float *probs;             /* [max_recv_rows, E_l] */
    float *scales;            /* FP8: [max_recv_rows, H / 128]; else NULL */
    int *num_recv_device;     /* device int: rows received */
    int *tokens_per_expert_device; /* device [E_l] */
    const int *host_counts;   /* pinned host [1 + E_l]: rows, then tokens per expert; valid
                                 once the stream has passed this dispatch */
    int num_recv;             /* rows received; -1 with HEP_ASYNC */
    size_t max_recv_rows;
    uint64_t handle;          /* pass to hep_combine */
    const int *overflow_device; /* [3] the receive capacity's words, where the backend writes
                                 them (GPU: device memory, valid once the stream passed this
                                 dispatch, also in graph replays; host backend: host memory):
                                 [HEP_OVERFLOW_DROPPED] 1 if this call dropped rows on any rank
                                 (HEP_ASYNC past config.max_recv_rows; the same on every rank;
                                 GPU across nodes: on any rank of this node), or (blocking)
                                 the call overflowed,
                                 [HEP_OVERFLOW_NEEDED] the rows this rank needed,
                                 [HEP_OVERFLOW_ROWS] the rows it dropped (needed - kept) */
} hep_dispatch_result;

/* Indices of hep_dispatch_result.overflow_device. */
#define HEP_OVERFLOW_DROPPED 0
#define HEP_OVERFLOW_NEEDED 1
#define HEP_OVERFLOW_ROWS 2

/* Dispatch this rank's tokens. Outputs stay valid until the next dispatch or combine. The
 * caller's buffers are read only during the call (combine uses what dispatch recorded).
 * HEP_WARN_IGNORED: an expert id out of range (not -1 and not below E); that slot was
 * ignored on every rank and the dispatch happened: call hep_combine as usual. Also (the
 * host backend with HEP_ASYNC) rows past config.max_recv_rows were dropped (see there).
 * Errors (nothing happened): HEP_ERR_INVALID (NULL pointers, t > T, topk > max_topk,
 * unknown index type or flag bits, misaligned rows), HEP_ERR_OVERFLOW (config.max_recv_rows
 * set and some rank would receive more rows: returned on every rank, the message names the
 * first such rank and the rows it needed; no receive buffer was written; the group stays
 * usable and the sequence goes on with the next dispatch; the handle holds no layout, so
 * there is no combine for this call; with HEP_ASYNC and the rank-major layout rows are
 * dropped instead), HEP_ERR_TIMEOUT (a rank did not arrive within HEP_TIMEOUT_MS;
 * the message names it; the group cannot be used afterwards), HEP_ERR_VERBS (a network
 * write failed: peer, buffer and NIC text), HEP_ERR_UNAVAILABLE (graph capture across
 * nodes), HEP_ERR_CUDA. */
int hep_dispatch(hep_group *g, const hep_dispatch_args *a, hep_dispatch_result *out);

typedef struct hep_combine_args {
    uint64_t handle;         /* from the dispatch whose rows these are */
    const void *expert_out;  /* [num_recv, H] BF16 rows in dispatch order; passing
                                hep_combine_input(g) (written in place) skips a copy */
    void *out;               /* [t, H] BF16, this rank's t of that dispatch */
    void *stream;
    unsigned flags;          /* 0 or HEP_ASYNC */
} hep_combine_args;

int hep_combine(hep_group *g, const hep_combine_args *a);

/* ---------------------------------------------------------------- the training API
 *
 * Handles. A hep_handle is a library-owned object: hep_handle_create allocates it once
 * (host memory for the host backend; with the GPU backend and one node also one device
 * allocation on the group's GPU, freed by hep_handle_destroy, that the kernels write and
 * read: the positions of this rank's tokens at each node-mate, its row bases, the counts
 * and the routing), every dispatch given it records its layout there, and every later combine, and
 * any dispatch flagged HEP_REUSE_LAYOUT, reads that layout back. Why an object and not
 * caller memory of hep_handle_size() bytes: the checks that refuse a handle of another
 * group, of a group since destroyed, or one that holds no layout run on the host from
 * fields the library reads without a device round trip (so they work with HEP_ASYNC and
 * in graph capture), and the handle's size and contents can differ per backend and per
 * group shape without the caller allocating by a formula. Any number of handles may be
 * outstanding; combine may use any live handle, in any order, more than once. Every rank
 * still calls dispatch and combine in the same sequence, each with its handle of the same
 * dispatch.
 *
 * Layouts. HEP_LAYOUT_RANK_MAJOR (default) is the receive order above. With
 * HEP_LAYOUT_EXPERT_MAJOR the rows are written into caller memory grouped by local expert:
 * expert e's block holds, in receive order, every received token with a slot on e (a
 * token on two local experts appears twice, once per expert); block e starts at the sum of
 * the earlier blocks and is padded to a multiple of pad_multiple with zero rows (tokens,
 * probability and scales zero). Each row carries one f32 probability (the sum of the
 * token's weights on that expert) and, for FP8, its H / 128 scales. The buffers hold
 * num_permuted_tokens rows (the row budget, a multiple of pad_multiple): a row, data or
 * padding, whose position is at or past the budget is not written, so the rows of the
 * highest experts go first; overflow and overflow_rows say so. tokens_per_expert[e] is
 * block e's padded row count as written (clipped to the budget), so its sum is
 * num_permuted; rows from num_permuted to the budget are not written.
 * Combine reads expert-major rows in the same positions and sums, for each token, over the
 * destination ranks in ascending order and within each over its local experts in
 * ascending order (f32, rounded to BF16 once per node as in rank-major); dropped rows
 * contribute nothing.
 *
 * Probabilities through combine (the backward of dispatch's probabilities): with
 * probs_in (rank-major: [num_recv, E_l] like dispatch's probs; expert-major: [rows] one per
 * row) combine writes probs_out [t, E] f32: for each of this rank's tokens and each global
 * expert x = d E_l + e that one of its slots chose, the value of rank d's row for (token,
 * e); 0 where no slot chose x and for a dropped row. */

typedef struct hep_handle hep_handle;

/* A handle for dispatches and combines of g. It holds no layout until a dispatch given it
 * records one; it does not need g to be alive to be destroyed, and it is refused (never
 * misread) by any other group. 0, or HEP_ERR_INVALID (NULL), HEP_ERR_NOMEM. With the GPU
 * backend creating and destroying a handle allocate, clear and free device memory, which
 * CUDA orders against the device's other work (cudaFree waits for it): with virtual ranks
 * sharing one GPU in one process, do it while no node-mate's call is in flight (a kernel
 * waiting for this rank would wait for it). One process per GPU is not affected. */
int hep_handle_create(hep_group *g, hep_handle **out);
/* Frees h (NULL is accepted). Not collective; g may be destroyed before. */
void hep_handle_destroy(hep_handle *h);

typedef enum { HEP_LAYOUT_RANK_MAJOR = 0, HEP_LAYOUT_EXPERT_MAJOR = 1 } hep_layout;

#define HEP_REUSE_LAYOUT 2u /* hep_dispatch_ex: dispatch with the layout opts->handle holds:
                               topk_idx and topk are ignored (may be NULL / 0), num_tokens
                               must be the handle's, topk_weights NULL uses the recorded
                               weights (else [t, the handle's topk]); layout, pad_multiple
                               and num_permuted_tokens are the handle's */
#define HEP_MAX_PAD_MULTIPLE 1024

typedef struct hep_dispatch_opts {
    /* inputs */
    hep_handle *handle;        /* NULL: the one-shot handle of result.handle. Else the layout
                                  is recorded here (replacing what it held; result.handle is
                                  then 0) or, with HEP_REUSE_LAYOUT, read from here */
    hep_layout layout;         /* rank-major (0) or expert-major */
    int pad_multiple;          /* expert-major: 1..HEP_MAX_PAD_MULTIPLE (0 = 1) */
    int num_permuted_tokens;   /* expert-major: the row budget, > 0, a multiple of
                                  pad_multiple: rows of recv_* */
    void *recv_tokens;         /* caller memory, or NULL (rank-major: the group's view).
                                  Rank-major: [max_recv_rows, H]; expert-major (required):
                                  [num_permuted_tokens, H] */
    float *recv_probs;         /* rank-major: [max_recv_rows, E_l]; expert-major (required):
                                  [num_permuted_tokens] */
    float *recv_scales;        /* FP8: [rows, H / 128] (expert-major: required) */
    /* outputs (valid once the call returned 0 or HEP_WARN_IGNORED) */
    int num_permuted;          /* expert-major rows written (padding included); rank-major:
                                  num_recv. GPU with HEP_ASYNC: -1 (see permuted_device) */
    int overflow;              /* 1: rows past the budget were dropped (GPU, HEP_ASYNC: -1) */
    int overflow_rows;         /* token rows dropped, padding not counted (GPU, HEP_ASYNC: -1) */
    size_t copy_bytes;         /* bytes this call wrote into caller memory (recv_*) */
    const int64_t *tokens_per_expert; /* host [E_l]: expert-major padded rows per local
                                  expert; rank-major, and GPU with HEP_ASYNC: NULL. In the
                                  handle's memory: valid while the handle holds this layout */
    const int *permuted_device; /* expert-major: [3] num_permuted, overflow, overflow_rows,
                                  and ... */
    const int64_t *tokens_per_expert_device; /* ... [E_l] tokens_per_expert, where the
                                  backend writes them (GPU: device memory of the handle, valid
                                  once the stream passed this dispatch, also in graph replays;
                                  host backend: host memory); rank-major: NULL */
} hep_dispatch_opts;

/* hep_dispatch with the options above (NULL opts: hep_dispatch). Flags: HEP_ASYNC,
 * HEP_REUSE_LAYOUT. The result's pointers are the caller's recv_* where given. Errors as
 * hep_dispatch, and HEP_ERR_INVALID for a handle of another group (or of a destroyed one),
 * HEP_REUSE_LAYOUT with a handle that holds no layout or a different num_tokens, a bad
 * pad_multiple or budget, a missing expert-major buffer; HEP_ERR_UNAVAILABLE for what a
 * backend lacks (the message names it): the GPU kernels have handles, reuse and caller
 * outputs (rank-major, copied from the group's buffers after the kernel: copy_bytes counts
 * them in the blocking mode, 0 with HEP_ASYNC) with one node, and the expert-major layout
 * with one node and a caller handle (the node's ranks in one process: written by the
 * dispatch kernel straight into every node-mate's recv_*; in several processes: through
 * the group's staging of config.max_permuted_rows rows, copied into recv_* after the
 * kernel and counted in copy_bytes; HEP_ERR_UNAVAILABLE naming that field when it is 0,
 * HEP_ERR_INVALID for a num_permuted_tokens above it; every rank of a call must use
 * the expert-major layout alike; the counts reach the host in the blocking mode only);
 * across nodes the GPU kernels have caller handles (a reuse lays out anew from the
 * recorded routing, with the same result), rank-major outputs in caller memory and the
 * expert-major layout with a caller handle and each node's ranks in one process
 * (HEP_ERR_UNAVAILABLE with the ranks in several processes), and two calls of one kind in
 * a row meet at a bootstrap barrier once the previous one ended on each rank; the host
 * backend has all of them (across nodes with the ranks of a node in several processes an
 * expert-major num_permuted_tokens must not exceed both max_recv_rows and
 * config.max_permuted_rows: HEP_ERR_INVALID). */
int hep_dispatch_ex(hep_group *g, const hep_dispatch_args *a, hep_dispatch_opts *opts,
                    hep_dispatch_result *out);

typedef struct hep_combine_opts {
    const hep_handle *handle;  /* the layout to combine with (then args->handle is ignored) */
    const float *probs_in;     /* NULL, or the probabilities to send back (see above) */
    float *probs_out;          /* with probs_in: [t, E] f32 */
} hep_combine_opts;

/* hep_combine with the options above (NULL opts: hep_combine). expert_out is [num_recv, H]
 * (rank-major) or [num_permuted_tokens, H] (expert-major) BF16 caller memory. Rank-major,
 * the GPU kernels copy it (and probs_in) into the group's exchange buffers, where the
 * node-mates read it; that copy waits on the device until every node-mate finished the
 * previous combine. Expert-major, the node-mates read expert_out and probs_in where they
 * are, and this rank's combine kernel ends only once every node-mate finished reading
 * them (hep_combine_input(g) is refused); the node's ranks in several processes: copied
 * into this rank's expert-major staging first (once every node-mate finished the previous
 * combine), where the node-mates read them, so the caller may reuse them at once.
 * Errors as hep_combine, and HEP_ERR_INVALID for a handle of another group or
 * without a layout, probs_in without probs_out, expert_out == hep_combine_input(g) when
 * that buffer no longer holds the handle's rows (another dispatch or a combine ran since);
 * The host backend with the node's ranks in several processes passes expert_out and
 * probs_in to the node-mates through this rank's exchange.token and dispatch.recv_prob
 * (max_recv_rows rows a round; across nodes all its rank-major rows at once): such a
 * combine overwrites the zero-copy tokens and probabilities of the last dispatch.
 * With the GPU kernels every rank of a combine passes probabilities alike (across nodes
 * the other nodes' share comes back with the partial sums).
 * HEP_ERR_UNAVAILABLE: the GPU kernels with probabilities without a caller handle (the
 * one-shot layout records no routing). The host backend has probabilities everywhere
 * (threads or processes of one node, and across nodes, the ranks of a node in one process
 * or in several). */
int hep_combine_ex(hep_group *g, const hep_combine_args *a, const hep_combine_opts *opts);

/* Where to write expert outputs for a combine without a copy: [max_recv_rows, H] BF16,
 * for the combine that directly follows its dispatch (a handle combined later, or a second
 * time, needs the outputs in memory of the caller's: the GPU kernels refuse this buffer
 * then).
 * It shares bytes with the dispatch output tokens: with BF16, output row j is received
 * row j; with FP8 (H bytes a received row, 2 H an output row) output row j covers
 * received rows 2j and 2j + 1, so an expert that writes row j in place before it has read
 * rows 2j and 2j + 1 destroys its own inputs: read them first, or write elsewhere (any
 * other pointer is copied in). */
void *hep_combine_input(hep_group *g);

/* Wait for `stream` and report the first error of an HEP_ASYNC call (0 if none).
 * HEP_WARN_IGNORED: a call completed and ignored part of its input (an expert id out of
 * range, rows past config.max_recv_rows dropped); the message says which. */
int hep_group_sync(hep_group *g, void *stream);

/* ---------------------------------------------------------------- statistics */

/* What a group did, for benchmarks and monitoring. Counters run from group creation. */
typedef struct hep_group_stats {
    /* Inter-node (N > 1): what this rank's CPU proxy posted to other nodes, summed over
     * the peers; all zero with one node. */
    uint64_t net_bytes;            /* payload bytes (rows, routing, scales, partial sums;
                                      counts and flags excluded) */
    uint64_t net_data_writes;      /* data work requests */
    uint64_t net_flag_writes;      /* flag work requests */
    uint64_t net_flags_done;       /* flag writes completed ... */
    uint64_t net_ready_to_flag_ns; /* ... and for them the sum of the times from the slot
                                      seen complete to its flag's completion */
    /* GPU backend: the last dispatch's device timer (%globaltimer, ns), valid once its
     * stream has passed it; 0 when unknown (host backend). */
    uint64_t dispatch_start_ns;    /* the dispatch kernel started */
    uint64_t layout_ready_ns;      /* its layout step (routing scan) was done */
    uint64_t copy_bytes;           /* bytes dispatches wrote into caller memory (recv_* of
                                      hep_dispatch_opts), the copying mode's extra traffic */
    char transport[32];            /* the NIC: "none" (N = 1), "loopback" or the device */
} hep_group_stats;

/* Fill *s for this rank. 0, or HEP_ERR_INVALID for NULL arguments. */
int hep_group_get_stats(const hep_group *g, hep_group_stats *s);

/* ---------------------------------------------------------------- the buffer plan */

#define HEP_PLAN_MAX_BUFFERS 64
#define HEP_PLAN_MAX_ARENAS 8

typedef struct hep_plan_buffer_info {
    const char *name;              /* e.g. "dispatch.attn_input_token" */
    const char *role;              /* "dispatch", "combine" or "both" */
    const char *elem;              /* "bf16", "fp8", "f32", "i32", "u64", "byte" */
    const char *memory;            /* the arena it lives in (arenas[].name) */
    const char *shares_bytes_with; /* the buffer whose bytes it reuses, or NULL */
    size_t count, bytes, align, offset; /* offset within its arena */
    int rdma_registered;           /* registered through hep_gpu_mr_register (N > 1) */
} hep_plan_buffer_info;

typedef struct hep_plan_info {
    int nodes, ranks_per_node, world;
    size_t max_recv_rows;          /* capacity of the dispatch outputs, rows */
    size_t device_bytes, host_bytes; /* per rank, GPU backend */
    int num_buffers;               /* the buffers this configuration needs */
    hep_plan_buffer_info buffers[HEP_PLAN_MAX_BUFFERS];
    int num_arenas;                /* one allocation per memory kind */
    struct {
        const char *name;
        size_t bytes;
    } arenas[HEP_PLAN_MAX_ARENAS];
    /* N > 1: each inter-node slot is a ring of ring_chunks chunks of chunk_tokens tokens
     * (config.chunk_tokens resolved: the backend's default, or T for 0), slot_tokens rows */
    int chunk_tokens, ring_chunks;
    size_t slot_tokens;
} hep_plan_info;

/* The buffers a group of `nodes` x `ranks_per_node` ranks with configuration *cfg would
 * allocate on each rank, computed without allocating (cfg->ranks_per_node is ignored).
 * The strings are static. 0, or HEP_ERR_INVALID naming the field and its limits. */
int hep_plan_query(const hep_config *cfg, int nodes, int ranks_per_node, hep_plan_info *out);

/* sizeof the public struct named `name` ("hep_config", "hep_dispatch_opts", ... every
 * struct of this header and "hep_bootstrap"), as this library was built; 0 for a name it
 * does not know. For bindings that lay the structs out themselves (the Python package
 * checks every one at import, so a struct that grew is an ImportError, not a write past
 * the binding's copy). */
size_t hep_struct_size(const char *name);

#ifdef __cplusplus
}
#endif
#endif
