/* layout: the buffer plan, a pure function of the configuration, N and R.
 *
 * Every buffer a rank allocates is listed with its name, role, element type and count,
 * bytes, memory kind and alignment, and its place in one of four arenas (one allocation
 * per memory kind). Buffers that are never live at the same time may share bytes
 * (alias_of names the owner); each RDMA registration still covers exactly its own
 * buffer. All sizes are computed with overflow checks.
 */
#ifndef HEP_LAYOUT_PLAN_H
#define HEP_LAYOUT_PLAN_H

#include <stddef.h>

#include "hybridep/hybridep.h"
#include "kernels/ep_kernels.h" /* the layout of the flags buffer */

typedef enum {
    HEP_ARENA_SHARED = 0, /* device memory shared in the node (CUDA IPC / same process) */
    HEP_ARENA_LOCAL = 1,  /* device memory of this rank; RDMA-registered buffers live here */
    HEP_ARENA_MAPPED = 2, /* host memory mapped into the device (diagnostics, proxy counters) */
    HEP_ARENA_PINNED = 3, /* pinned host memory (counts copied back for the host) */
    HEP_ARENA_COUNT = 4
} hep_arena;

typedef enum {
    HEP_BUF_TOKEN_X = 0,  /* dispatch output tokens; combine input rows (same bytes) */
    HEP_BUF_RECV_PROB,
    HEP_BUF_RECV_SCALE,
    HEP_BUF_COUNTS,
    HEP_BUF_FLAGS,
    HEP_BUF_MAILBOX,
    HEP_BUF_HANDLE_ROWS,
    HEP_BUF_HANDLE_META,
    HEP_BUF_HANDLE_BLOCKS,
    HEP_BUF_DIAG,
    HEP_BUF_HOST_COUNTS,
    HEP_BUF_PROXY,
    HEP_BUF_HANDLE_IDS, /* host backend: the dispatch's top-k ids (invalid ones as -1) */
    /* GPU, config.max_permuted_rows > 0: the expert-major staging of the node's ranks in
     * several processes (rows, one probability a row, FP8 scales), IPC-shared */
    HEP_BUF_EM_TOKEN,
    HEP_BUF_EM_PROB,
    HEP_BUF_EM_SCALE,
    /* the 14 RDMA-registered inter-node buffers (N > 1) */
    HEP_BUF_D_ATTN_TOKEN,
    HEP_BUF_D_ATTN_FLAGS,
    HEP_BUF_D_ATTN_PROB,
    HEP_BUF_D_ATTN_SCALE,
    HEP_BUF_D_GROUP_TOKEN,
    HEP_BUF_D_GROUP_FLAGS,
    HEP_BUF_D_GROUP_PROB,
    HEP_BUF_D_GROUP_SCALE,
    HEP_BUF_C_RED_TOKEN,
    HEP_BUF_C_RED_PROB,
    HEP_BUF_C_GROUP_TOKEN,
    HEP_BUF_C_GROUP_FLAGS,
    HEP_BUF_C_GROUP_PROB,
    HEP_BUF_C_OUT_FLAGS,
    HEP_BUF_COUNT
} hep_buf_id;

#define HEP_FIRST_RDMA_BUF HEP_BUF_D_ATTN_TOKEN
#define HEP_RDMA_BUF_COUNT (HEP_BUF_COUNT - HEP_FIRST_RDMA_BUF)

typedef struct hep_plan_buffer {
    const char *name;
    const char *role;   /* "dispatch", "combine", "both" */
    const char *elem;   /* "bf16", "fp8", "f32", "i32", "u64", "byte" */
    size_t elem_bytes;
    size_t count;
    size_t bytes;
    int arena;          /* hep_arena */
    size_t align;
    size_t offset;      /* within its arena */
    int present;        /* 0: not needed by this configuration */
    int registered;     /* registered for RDMA through hep_gpu_mr_register */
    int alias_of;       /* -1, or the buffer whose bytes this one reuses */
} hep_plan_buffer;

typedef struct hep_plan {
    int nodes, ranks_per_node, world;
    size_t max_recv_rows;
    size_t max_permuted_rows;       /* rows of the expert-major staging (0: none planned) */
    /* N > 1: each inter-node slot is a ring of `ring` positions of `chunk` tokens
     * (slot_tokens = ring x chunk), both backends; ring = 1 and chunk = T is one chunk per
     * slot (config.chunk_tokens = 0, or >= T) */
    int chunk, ring;
    /* combine's ring over the same slots: cring positions of cchunk tokens, cring x cchunk
     * <= slot_tokens. The GPU's default whole slot takes HEP_COMBINE_CHUNKS smaller chunks
     * where they fit; else (and on the host backend) chunk and ring. */
    int cchunk, cring;
    size_t slot_tokens;
    size_t flag_words;              /* u64 counters in the flags buffer */
    hep_plan_buffer buf[HEP_BUF_COUNT];
    size_t arena_bytes[HEP_ARENA_COUNT];
    size_t device_bytes, host_bytes;
} hep_plan;

/* A phase's ring over the slots (0 dispatch, 1 combine): its chunk and its positions. */
static inline int hep_plan_chunk(const hep_plan *p, int phase)
{
    return phase == 0 ? p->chunk : p->cchunk;
}
static inline int hep_plan_ring(const hep_plan *p, int phase)
{
    return phase == 0 ? p->ring : p->cring;
}

/* Plan for `nodes` x `ranks_per_node` ranks. 0 or HEP_ERR_INVALID (with the reason). */
int hep_plan_make(const hep_config *cfg, int nodes, int ranks_per_node, hep_plan *out);

/* The chunk of config.chunk_tokens = HEP_CHUNK_DEFAULT on `backend` with `nodes` nodes
 * (hybridep.h). */
int hep_chunk_default(const hep_config *c, int nodes);

const char *hep_arena_name(int arena);

#endif
