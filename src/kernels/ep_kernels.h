/* kernels/ep_kernels.h: the dispatch/combine kernels, called from C. One file per kernel
 * family: layout.cuh (the routing scan and layout step), dispatch.cu, combine.cu,
 * node_pack.cu (N > 1), with the waits, flags and timeout record in sync.cuh and the token
 * lists in lists.cuh. With N > 1 nodes a rank forwards N token lists (its own, then each
 * other node's slot) the way one node forwards its single list; docs/architecture.md has
 * the inter-node steps.
 *
 * Protocol (all counters monotonic, never reset; e = this rank's call count, kept on the
 * device so graph replays advance it):
 *  dispatch (one kernel, S blocks): each block scans the routing of its token range
 *    (positions per destination, per-expert counts); after a grid barrier block 0
 *    publishes the rank's counts to its shared buffer (double-buffered by e & 1),
 *    COUNTS_READY = e, waits for every node-mate's, derives the row base at each
 *    destination, what it receives and tokens per expert, LAYOUT_READY = e. (One node,
 *    rank-major: no grid barrier and no LAYOUT_READY; each block adds its totals to the
 *    published counts too, the last block to arrive at the grid counter publishes
 *    COUNTS_READY = e, and every block waits for every node-mate's and derives its own row
 *    bases; block 0 writes the outputs after its push.) Then every
 *    block pushes rows, probabilities and scales into the destinations' buffers and adds 1
 *    to DISPATCH_ARRIVE[source] at each destination; block 0 waits until
 *    DISPATCH_ARRIVE[s] >= e * S for every source s (a rank alone on one node skips
 *    both, except in a call that dropped rows: kernels/dispatch.cu, arrive_all).
 *    With HEP_REUSE_LAYOUT (a.reuse) the scan and the counts are skipped: the positions,
 *    row bases and counts are a handle's (a later call's scan never ran over them), and
 *    block 0 only publishes COUNTS_READY = e and waits for every node-mate's (the barrier
 *    that says every node-mate finished its calls before e, so that nobody still reads the
 *    buffers this call writes). With a receive capacity (a.cap), block 0 knows every
 *    destination's rows from the counts (across nodes: of all N lists): if one exceeds
 *    it, no block pushes any row of any list (every rank of the node decides the same from
 *    the same counts; slots are still waited for and consumed), the layout's overflow word
 *    is 1, and the diag record names the rank; across nodes the blocking call's host side
 *    agrees with the other nodes through the bootstrap. With a.drop (HEP_ASYNC) the layout
 *    stands instead: rows whose position at a destination is at or past the capacity are
 *    not written, their source takes each of their local experts off its published count
 *    of that list (before its arrival), and the destination, once every source arrived,
 *    sums the counts of every list again into its tokens per expert; the overflow words
 *    (a.ovf) say so.
 *  combine (S blocks), call c (combines have their own count, c = *cepoch + 1: a handle
 *    can be combined more than once, or two handles one after the other): the copy of the
 *    caller's expert outputs into X first waits until every node-mate finished combine
 *    c - 1 (COMBINE_DONE >= c - 1: nobody reads X any more); then COMBINE_READY = c (its
 *    expert outputs are in place), waits for every node-mate's COMBINE_READY >= c, pulls
 *    and sums the rows of its tokens; the last block to finish sets *cepoch = c and
 *    COMBINE_DONE = c. A layout whose overflow word is 1 is not combined (every rank
 *    skips it alike).
 * Every wait is bounded; on expiry the waiter raises this rank's ABORT word (device
 * memory; the other waiters see it at their next poll and return), fills the host-mapped
 * diag record and publishes whom it waited for in its BLAME word.
 */
#ifndef HEP_EP_KERNELS_H
#define HEP_EP_KERNELS_H

#include <stdint.h>

#define HEP_GPU_MAX_LOCAL 32 /* ranks per node of the GPU kernels (one warp of lanes) */
#define HEP_GPU_MAX_NODES 128 /* nodes of the GPU kernels (words of 32 lanes) */

/* Layout of a rank's flags buffer (u64 monotonic counters), in words. */
#define HEP_FLAG_COUNTS_READY 0     /* this rank published its counts for call e */
/* Expert-major: where this rank's caller memory is, for its node-mates' kernels.
 * Dispatch writes the first three before its COUNTS_READY = e, combine the last two before
 * its COMBINE_READY = c; each call's kernel ends only after every node-mate has finished
 * reading through them (dispatch: their arrivals; combine: their COMBINE_DONE). */
#define HEP_FLAG_EM_TOKENS 1        /* recv_tokens of the expert-major dispatch */
#define HEP_FLAG_EM_PROBS 2         /* recv_probs */
#define HEP_FLAG_EM_SCALES 3        /* recv_scales (FP8) */
#define HEP_FLAG_EM_COMBINE_IN 4    /* the expert-major combine's expert_out */
#define HEP_FLAG_EM_PROBS_IN 5      /* its probs_in (or 0) */
#define HEP_FLAG_HOST_ROUND 6       /* host backend across processes: combine round v staged */
#define HEP_FLAG_HOST_ROUND_READ 7  /* ... and read (ref/host_backend.c, combine_rounds) */
#define HEP_FLAG_COMBINE_READY 8    /* this rank's combine input rows are in place for call e */
#define HEP_FLAG_HOST_DONE 9        /* host backend: this rank finished reading, call e (dispatch; + 1: combine) */
#define HEP_FLAG_BLAME 11           /* 0, or 1 + the rank this rank's kernels gave up on */
#define HEP_FLAG_ABORT 12           /* 0, or 1 once a wait of this rank's kernels gave up */
#define HEP_FLAG_COMBINE_DONE 13    /* this rank's combine c finished reading its node-mates */
#define HEP_FLAG_DISPATCH_ARRIVE 16 /* [W]: blocks of source s that finished writing here */

/* Across nodes, combine's network words (its arrival, the partial sums' ready counters and
 * flags) carry the combine count c, not the dispatch's e: a handle may be combined more
 * than once after one dispatch. Two calls of one kind in a row across nodes are ordered on
 * the host (kernels/backend_gpu.c, settle_same_kind): a dispatch or combine in between
 * orders them otherwise, since each waits for every other node's slot or partial sums. */
/* Layout of the proxy's ready counters (host-mapped u64), per phase (0 dispatch, 1
 * combine) and node m: for each block b, {ready, first, count} at 3b (the block's rows of
 * node m's slot are [first, first + count), in place once ready = e); then at
 * 3 * HEP_PX_MAX_BLOCKS the slot's count and flag words are in place once it is e, and at
 * 3 * HEP_PX_MAX_BLOCKS + 1 the slot's count block (dispatch) or the rank's arrival word
 * (combine: word 2N + m of combine.attn_output_flags holds e once its combine started).
 *
 * Inter-node flags buffers (u64 words): [0, N) counts, [N, 2N) flags, [2N, 3N) count-block
 * flags (dispatch) or arrival words (combine: the sender's call, sent ahead of its partial
 * sums), then per node a count block: its slot's tokens per (local rank d, expert), as
 * R x (E_l + 1) i32 (total at d, then per expert), sent ahead of the rows so that the
 * receiver lays out its rows, and forwards its own tokens, while the rows travel. */
/* A rank's work counters (u32, device, zero between calls): the next own token a combine
 * warp takes, and the combine blocks that finished (the last one resets both). */
#define HEP_WORK_COMBINE 0
#define HEP_WORK_COMBINE_DONE 1
#define HEP_WORK_DISPATCH 2      /* dispatch's rank-wide token counter (push_list) */
#define HEP_WORK_DISPATCH_DONE 3 /* its blocks done with it: the last one resets both */
#define HEP_WORK_WORDS 4

/* Threads of a dispatch block (dispatch.cu's DISPATCH_THREADS unless a tuning build sets
 * its own); the host's choice of store method counts the warps from it. */
#define HEP_DISPATCH_THREADS 512

/* A handle's expert-major words (device ints): rows written (padding included), 1 if rows
 * went past the budget, token rows dropped; then from HEP_EM_WORDS, per local expert e,
 * [2e] the end of its data rows and [2e + 1] the end of its padding, clipped to the budget. */
#define HEP_EM_NUM_PERMUTED 0
#define HEP_EM_OVERFLOW 1
#define HEP_EM_OVERFLOW_ROWS 2
#define HEP_EM_WORDS 8

#define HEP_COUNT_BLOCK_WORDS(R, El) (((R) * ((El) + 1) + 1) / 2)
/* The GPU path's routing of one slot token (i32 words): kmax ids, kmax weights, its
 * offset among the sender's tokens for each local rank of the receiving node (-1: none),
 * and (expert-major calls) for each of its slots its place among the sender's tokens on
 * that expert (-1: not the token's first slot on an expert of the receiving node), stored
 * per slot as four blocks [ST][kmax] ids, [ST][kmax] weights, [ST][R] offsets,
 * [ST][kmax] places. */
#define HEP_GPU_ROUTE_WORDS(K, R) (3 * (K) + (R))

/* The inter-node receive slots as a ring of chunks (both backends). A slot holds P chunk
 * positions of C tokens, P <= HEP_RING_DEPTH (layout/plan.c: plan.chunk and ring; on the
 * GPU combine may cut the same slot into more, smaller chunks, plan.cchunk and cring);
 * chunk k of a call (its tokens [kC, kC + C) in slot order) lands in position k % P.
 * After the count blocks, each flags buffer has, in words (B = 3N + N cb; P its phase's):
 *  [B, B + N): sender side (dispatch.attn_input_flags, combine.attn_output_flags), word
 *    B + m: the credit from node m's peer, HEP_RING_VAL(e, chunks of my slot it freed);
 *    receiver side (the *_group_flags), word B + s: HEP_RING_VAL(e, chunks of slot s that
 *    landed), each chunk's flag written after its data on the same connection.
 *  [B + N, B + N + N P): sender side, per node m and position p, the source of the flag
 *    of the chunk in position p (it also is that chunk's ready word for the proxy);
 *    receiver side, word B + N + s: the source of the credit for slot s (the chunks freed).
 * Values carry the call e above 24 bits (T / C < 2^24 chunks), so they grow across calls. */
/* The positions of a slot's ring (fewer where they cover T), which also sizes the slot:
 * P x C rows. The GPU's default whole slot is HEP_RING_POSITIONS chunks of
 * ceil(T / HEP_RING_POSITIONS); more chunks a slot slowed the GPU dispatch at 4 x 2 nodes
 * (2.7 -> 2.9 ms with 4). A tuning build may set another. */
#ifndef HEP_RING_POSITIONS
#define HEP_RING_POSITIONS 2
#endif
/* The chunks of the GPU combine's whole-slot ring, over the same slot bytes as dispatch's
 * (plan.c takes it only where they fit): smaller chunks land sooner, so the owners of the
 * tokens start summing earlier (2 x 4 nodes: 1.31 -> 1.25 ms with 4). */
#ifndef HEP_COMBINE_CHUNKS
#define HEP_COMBINE_CHUNKS 4
#endif
/* The room of the words and counters kept per ring position (HEP_PX_RING, the ring
 * counters): at least the positions of any ring of either phase. */
#ifndef HEP_RING_DEPTH
#define HEP_RING_DEPTH 4
#endif
#if HEP_RING_POSITIONS > HEP_RING_DEPTH || HEP_COMBINE_CHUNKS > HEP_RING_DEPTH
#error "HEP_RING_DEPTH must hold HEP_RING_POSITIONS and HEP_COMBINE_CHUNKS positions"
#endif
#define HEP_RING_VAL(e, k) (((unsigned long long)(e) << 24) | (unsigned long long)(k))
#define HEP_RING_WORD(N, cb) (3 * (N) + (N) * (cb))
#define HEP_RING_SRC_WORD(N, cb, x, p, P) (HEP_RING_WORD(N, cb) + (N) + (x) * (P) + (p))
#define HEP_INTERNODE_FLAG_WORDS(N, cb, P) (HEP_RING_WORD(N, cb) + (N) + (N) * (P))
/* A word that says which chunks of a call a batch does not need: chunk k is skipped once it
 * holds HEP_RING_VAL(e, HEP_RING_MAXK - n) with n <= k (the kernel knows the n chunks of a
 * ring only on the device; the host's batch has as many as the ring could have). */
#define HEP_RING_MAXK 0xffffffull
#define HEP_RING_SKIP(e, n) HEP_RING_VAL(e, HEP_RING_MAXK - (unsigned long long)(n))
#define HEP_PX_MAX_BLOCKS 132
/* Per phase and node m, after the blocks' words and the slot's two: the GPU ring's words,
 * at HEP_PX_RING: per position p {ready, first, count} of the chunk to m in it (ready =
 * HEP_RING_VAL(e, k + 1) for chunk k), then the skip word of the chunks to m, the ready
 * word of the credits to m (HEP_RING_VAL(e, chunks freed)) and their skip word. */
#define HEP_PX_RING (3 * HEP_PX_MAX_BLOCKS + 2)
#define HEP_PX_RING_SKIP (HEP_PX_RING + 3 * HEP_RING_DEPTH)
#define HEP_PX_CREDIT (HEP_PX_RING_SKIP + 1)
#define HEP_PX_CREDIT_SKIP (HEP_PX_RING_SKIP + 2)
#define HEP_PX_NODE_WORDS (HEP_PX_RING_SKIP + 3)
#define HEP_PX_WORD(N, phase, m) (((size_t)(phase) * (size_t)(N) + (size_t)(m)) * HEP_PX_NODE_WORDS)
/* The GPU kernels' ring counters (device i32 scratch, zero at a call's start), per phase
 * (0 dispatch, 1 combine): [HEP_RING_CTR_KINDS][N][HEP_RING_DEPTH]: the producers done with
 * the chunk in each position of the ring to node m (dispatch: blocks; combine: reducing
 * warps), the consumers done with it in each position of the ring from node m (dispatch:
 * blocks that forwarded it; combine: own tokens that read their partial sum in it), at
 * [2][m][0] the chunks of the ring from m whose credit was published (in chunk order), and
 * (dispatch) the rows of the chunk in each position of the ring from m that warps took to
 * forward (reset by the chunk's last consumer). */
#define HEP_RING_CTR_KINDS 4
#define HEP_RING_CTR_WORDS(N) (2 * HEP_RING_CTR_KINDS * (N) * HEP_RING_DEPTH)

/* The waits of the timeout record. The ring's (N > 1, kernels/ring.cuh) expect and see
 * HEP_RING_VAL(call, chunks): a chunk that did not land (its sender named), or a credit
 * that did not come (the receiver that did not free the chunk named). */
enum { HEP_STAGE_PREPROCESS = 1, HEP_STAGE_DISPATCH = 2, HEP_STAGE_COMBINE = 3,
       HEP_STAGE_NODE_DISPATCH = 4, HEP_STAGE_NODE_COMBINE = 5,
       HEP_STAGE_RING_DISPATCH_CHUNK = 6, HEP_STAGE_RING_DISPATCH_CREDIT = 7,
       HEP_STAGE_RING_COMBINE_CHUNK = 8, HEP_STAGE_RING_COMBINE_CREDIT = 9 };

/* Host-mapped record of the first failure seen by a rank's kernels. The kernels only write
 * it, when a failure happens (and two timestamps once per dispatch); the host reads it
 * after the stream finished. */
typedef struct hep_diag {
    unsigned int timeout_claimed; /* 0, or 1 once the record of a timeout is complete */
    int stage, block, peer;
    unsigned long long expected, seen, waited_ns;
    unsigned int invalid_claimed; /* an expert id out of range was seen (slot ignored) */
    int bad_token, bad_slot, pad;
    long long bad_value;
    unsigned long long t_start, t_layout; /* %globaltimer of the last dispatch: kernel start,
                                             layout ready (the preprocess part) */
    int via_plus1;                /* 0, or 1 + the node-mate that had given up on `peer` */
    unsigned int overflow_claimed; /* a dispatch exceeded the receive capacity ... */
    int overflow_rank, overflow_rows; /* ... the first rank over it and the rows it needed */
    int overflow_dropped;          /* ... 1: HEP_ASYNC, the rows past it were dropped (a
                                      warning); 0: nothing was written (an error) */
} hep_diag;

typedef struct hep_kargs {
    int local, R, H, El, K, t, esize, nscale, index64;
    int node, N, T, kmax;            /* N > 1: this rank's node, the nodes, slot sizes */
    int peers_sys;                   /* 1: a node-mate is on another GPU (system-scope sync) */
    unsigned long long timeout_ns;
    unsigned long long jitter_ns;    /* 0, or HEP_DEBUG_JITTER_US in ns: each block starts after a
                                        pseudo-random delay of 0..jitter_ns (stress runs) */
    /* inputs */
    const void *tokens;
    const float *scales;
    const void *topk_idx;
    const float *weights;
    /* this rank */
    int *dest_rows;                  /* [T, R]: position at each destination or -1 */
    int *meta;                       /* [0..R) row base at each destination */
    unsigned long long *epoch;       /* device-side call counter */
    unsigned long long *grid_arrive; /* blocks of this rank's dispatch that scanned */
    unsigned long long *layout_ready;/* = e once block 0 derived the layout */
    int *block_counts;               /* [S][R] tokens per destination of each block */
    int *recv_count;                 /* device int */
    int *tokens_per_expert;          /* device [El] */
    int *over;                       /* device int: 1 if the layout exceeded the capacity */
    /* the training API (per call; see group/ep.c). dest_rows, meta, recv_count,
     * tokens_per_expert and over point at the group's own layout buffers (the one-shot
     * handle) or at a caller handle's device memory */
    int reuse;                       /* 1: HEP_REUSE_LAYOUT (N = 1): no scan, the layout is there */
    int cap;                         /* receive capacity in rows, or 0 (none); no row at or
                                        past it is ever written, nor read by combine */
    int drop;                        /* 1: HEP_ASYNC, rank-major: past the capacity the rows
                                        at or past it are dropped instead of all of them */
    int *ovf;                        /* device [3] hep_dispatch_result.overflow_device */
    int *rec_ids;                    /* NULL, or the handle's [t][K] routing: dispatch records it
                                        (ids not in 0..E-1 as -1), combine reads it (probs) */
    float *rec_w;                    /* dispatch, with rec_ids: the handle's [t][K] weights */
    unsigned long long *cepoch;      /* device-side combine counter */
    const float *probs_in;           /* combine: [recv][El] f32 copied into prob[local], or NULL */
    float *probs_out;                /* combine: [t][E] f32, or NULL */
    void *out_tokens;                /* copy-out: the caller's rows (or NULL) ... */
    float *out_probs, *out_scales;   /* ... probabilities, scales */
    unsigned *work;                  /* device [HEP_WORK_WORDS] */
    int *host_counts;                /* mapped host [1 + El] */
    hep_diag *diag;                  /* mapped host: written on failure only */
    unsigned long long *abort;       /* device: this rank's flags[HEP_FLAG_ABORT] */
    const void *combine_in;          /* combine: rows to copy into X first (or NULL) */
    void *combine_out;               /* combine: [t, H] bf16 */
    /* the node, by local rank */
    char *x[HEP_GPU_MAX_LOCAL];
    float *prob[HEP_GPU_MAX_LOCAL];
    float *scale[HEP_GPU_MAX_LOCAL];
    int *counts[HEP_GPU_MAX_LOCAL];
    unsigned long long *flags[HEP_GPU_MAX_LOCAL];
    int x_stride_in;                 /* bytes of one combine input row of combine_in */
    /* N > 1 (this rank's registered buffers; slot j holds node j + (j >= node)'s rows) */
    int *node_pos;                   /* [T][N]: an own token's row in each node's slot or -1 */
    int *node_blocks;                /* [S][N]: own tokens per node of each pack block */
    int *slot_rows;                  /* [N - 1]: tokens in each other node's slot at this rank
                                        (the layout's: dispatch writes it once the slots
                                        arrived, combine sends back that many partial sums) */
    unsigned long long *pack_arrive; /* pack blocks that counted / that finished */
    unsigned long long *pack_done;
    unsigned long long *combine_done;/* combine blocks that finished the partial sums */
    unsigned long long *count_done;  /* pack blocks that added their count blocks */
    unsigned long long *grid_arrive2;/* dispatch blocks that scanned the other nodes' slots */
    int ST, C, P;                    /* N > 1: a slot's rows (at least P x C), tokens per
                                        chunk, ring positions of the phase launched
                                        (plan.slot_tokens; dispatch: plan.chunk, ring;
                                        combine: plan.cchunk, cring) */
    int *slot_list;                  /* [N][T]: the own token at each row of node m's slot */
    int *ring_ctr;                   /* HEP_RING_CTR_WORDS(N) (above) */
    int *pack_off;                   /* [T][N][R]: an own token's offset among this rank's
                                        tokens for (node m, local rank d), or -1 (pack) */
    int *md_blocks;                  /* [S][N][R]: own tokens per (node, local rank) of each
                                        pack block */
    int *em_place;                   /* [T][kmax]: expert-major calls, an own token's place
                                        among this rank's tokens on the expert of its slot k
                                        on another node, or -1 (pack) */
    int *em_pblocks;                 /* [N][S][R El]: the pack blocks' own tokens per expert */
    char *send_token;                /* dispatch.attn_input_token [N-1][ST] rows */
    int *send_route;                 /* dispatch.attn_input_prob [N-1][ST]: per slot the kmax
                                        ids of its tokens [ST][kmax], their weights [ST][kmax]
                                        and their offsets at the node's ranks [ST][R] (the
                                        receiver's row is meta[list][d] + offset) */
    float *send_scale;               /* dispatch.attn_input_scaling_factor [N-1][ST][nscale] */
    unsigned long long *send_words;  /* dispatch.attn_input_flags: counts [N], flags [N] */
    const char *slot_token;          /* dispatch.rdma_inter_node_group_token */
    const int *slot_route;           /* dispatch.rdma_inter_node_group_prob */
    const float *slot_scale;         /* dispatch.rdma_inter_node_group_scaling_factor */
    const unsigned long long *slot_words; /* dispatch.rdma_inter_node_group_flags */
    char *red_token;                 /* combine.rdma_intra_node_red_token [N-1][ST] bf16 rows */
    unsigned long long *red_words;   /* combine.attn_output_flags: counts [N], flags [N] */
    const char *part_token;          /* combine.rdma_inter_node_group_token [N-1][ST] */
    const unsigned long long *part_words; /* combine.rdma_inter_node_group_flags */
    float *red_prob;                 /* combine.rdma_intra_node_red_prob [N-1][ST][R El]: with
                                        probs_out, each slot token's row of this node's
                                        experts' probs_in (sent with the partial sums) */
    const float *part_prob;          /* combine.rdma_inter_node_group_prob: the same rows of
                                        this rank's tokens from each other node */
    unsigned long long *px;          /* mapped: the proxy's ready counters (HEP_PX_*) */
    int rank0;                       /* global rank of local rank 0 of this node */
    /* the expert-major layout (kernels/expert_major.cuh) */
    int emajor;                      /* 1: rows at expert-major positions in caller memory */
    int pad, budget;                 /* pad_multiple, num_permuted_tokens */
    int *epos;                       /* [N][T][kmax] the handle's d_epos: list L at
                                        L T kmax (own tokens [t][K], a slot [t][kmax]) */
    int *ebase;                      /* [N][R][El] d_ebase */
    int *ebc;                        /* [N][S][R][El] d_ebc */
    int *ekey;                       /* [N - 1][T][kmax] d_ekey (N > 1) */
    int *em;                         /* d_em */
    long long *tpe64;                /* [El] d_tpe */
    void *em_tokens;                 /* dispatch: this rank's recv_tokens ... */
    float *em_probs, *em_scales;     /* ... recv_probs, recv_scales (staged: its staging) */
    /* The node's ranks in several processes (caller memory of a node-mate cannot be
     * addressed): 1: the expert-major rows, probabilities and scales land in each
     * destination's group-owned staging (expert_major.* of the plan, in the IPC-shared
     * arena), which its own kernels copy to and from its caller memory (k_em_stage_out after
     * dispatch, k_em_stage_in before combine); the fused kernels take the staging of
     * node-mate l at x[l] + em_xoff (rows), + em_poff (probabilities), + em_soff (FP8
     * scales, 0: none) in place of the pointers published in HEP_FLAG_EM_*. 0: as before. */
    int em_stage;
    long long em_xoff, em_poff, em_soff;
    int warm; /* 1: the warm-up launch of group creation (hep_kernels_warm): return at once */
    /* hep_div_magic(El) (kernels/divmagic.h): key / El as a multiply-high (MASK_MAGIC). Last,
     * so that the other fields keep their offsets in the kernels' machine code */
    unsigned long long el_magic;
} hep_kargs;

#ifdef __cplusplus
extern "C" {
#endif
/* Each returns 0 or a cudaError_t of the launch. `stream` is a cudaStream_t. */
int hep_launch_dispatch(const hep_kargs *a, int blocks, void *stream);
/* The same kernel with bulk stores (dispatch_bulk.cu). */
int hep_launch_dispatch_bulk(const hep_kargs *a, int blocks, void *stream);
int hep_launch_combine(const hep_kargs *a, int blocks, void *stream);
/* Staged expert-major layout (em_stage): after the dispatch kernel, copy the rows written
 * (em[HEP_EM_NUM_PERMUTED], read on the device; none when the layout exceeded the receive
 * capacity) of this rank's staging to out_tokens, out_probs, out_scales. */
int hep_launch_em_stage_out(const hep_kargs *a, int blocks, void *stream);
/* Staged expert-major combine: once every node-mate finished the previous combine, copy
 * em[HEP_EM_NUM_PERMUTED] rows of combine_in (and of probs_in, if given) into this rank's
 * staging, where the node-mates' combine kernels read them. */
int hep_launch_em_stage_in(const hep_kargs *a, int blocks, void *stream);
/* Copy recv_count rows (read on the device) of combine_in into this rank's X (if
 * combine_in) and of probs_in into its prob buffer (if probs_in), once every node-mate
 * finished the previous combine. */
int hep_launch_copy_in(const hep_kargs *a, int blocks, void *stream);
/* Copy recv_count rows of this rank's X, prob and scale buffers to out_tokens, out_probs,
 * out_scales (each only if not NULL): dispatch outputs in caller memory. */
int hep_launch_copy_out(const hep_kargs *a, int blocks, void *stream);
/* N > 1: pack this rank's tokens into the send staging of each node that needs them and
 * publish each block's rows to the proxy (runs before hep_launch_dispatch). */
int hep_launch_node_pack(const hep_kargs *a, int blocks, void *stream);
/* Launch every kernel instance once with a.warm set (each returns at once) and wait for
 * them: a kernel's first launch can be held back behind the kernels already running
 * (kernels/probe.cu). Group creation, before any call. */
int hep_kernels_warm(const hep_kargs *a, int bulk);
/* Let kernel instance k (a __global__ function) launch with `smem` bytes of dynamic shared
 * memory: above 48 KB its limit goes to the device's opt-in maximum (kernels/probe.cu says
 * why not to `smem`). A cudaError_t, 0 on success. */
int hep_allow_smem(const void *k, size_t smem);
/* Bytes of dynamic shared memory the dispatch kernel needs for R ranks, El experts. */
size_t hep_dispatch_smem(int R, int El);
/* The same for the kernel with bulk stores (its row staging included). */
size_t hep_dispatch_smem_bulk(int R, int El);
/* Bytes of dynamic shared memory the inter-node pack kernel needs (N nodes). */
size_t hep_node_pack_smem(int N, int R, int El);
#ifdef __cplusplus
}
#endif
#endif
