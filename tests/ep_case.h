/* A dispatch + combine case run on W ranks (threads), results kept for the main thread,
 * and an independent global oracle that computes what every rank must receive. */
#ifndef HEP_TEST_EP_CASE_H
#define HEP_TEST_EP_CASE_H

#include <stdint.h>

#include "hybridep/hybridep.h"

#define EP_MAX_RANKS 128 /* test_gpu_ep: 128 virtual nodes of one rank */

typedef struct ep_rank_in {
    int t;
    void *tokens;      /* [t, H] bf16 (uint16) or fp8 (uint8) */
    float *scales;     /* fp8: [t, H/128] */
    void *idx;         /* [t, K] int32 or int64 */
    float *weights;    /* [t, K] */
    uint16_t *expert_out_seed; /* combine input rows; NULL: derive from the received rows */
} ep_rank_in;

typedef struct ep_rank_out {
    int rc_dispatch, rc_combine;
    char err[1024];
    int num_recv;
    int *tpe;               /* [El] */
    unsigned char *tokens;  /* [num_recv, H * esize] */
    float *probs;           /* [num_recv, El] */
    float *scales;          /* [num_recv, H/128] */
    uint16_t *expert_out;   /* what this rank passed to combine */
    uint16_t *combined;     /* [t, H] */
} ep_rank_out;

typedef struct ep_case {
    hep_config cfg;
    int world, K, index64, skip_rank, zero_copy, repeat;
    int gave_up;              /* ranks whose dispatch failed (for skip_rank) */
    int has_t_fixed, t_fixed; /* ep_case_random: every rank gets t_fixed tokens */
    int clobber_ids;          /* between dispatch and combine every rank overwrites its
                                 topk_idx with this id + 1 (0: it does not), then restores it */
    ep_rank_in in[EP_MAX_RANKS];
    ep_rank_out out[EP_MAX_RANKS];
} ep_case;

/* hep_dispatch on one rank of the case, its status and message recorded in o; a failure
 * other than bad input counts the rank as given up. Returns 1 when the rank must stop. */
/* The dispatch arguments of case c for t tokens in these buffers (host or device; scales
 * only for FP8). */
hep_dispatch_args ep_case_args(const ep_case *c, int t, const void *tokens, const float *scales,
                               const void *idx, const float *weights, void *stream);
int ep_case_dispatch(ep_case *c, ep_rank_out *o, hep_group *g, const hep_dispatch_args *da,
                     hep_dispatch_result *dr);

/* Runs the case (host backend unless cfg says otherwise). */
int ep_case_run(ep_case *c);
void ep_case_free(ep_case *c);
/* Random inputs: tokens in [0, T], K slots, some -1, some duplicates. skew 0: uniform;
 * 1: two thirds of the slots on rank 0; EP_ROUTE_NODES: token i's experts are all on its
 * own node (i % 3 == 0), on every node (slot k on node k % N; 1), or anywhere (2). */
#define EP_ROUTE_NODES 2

/* More nodes than a warp has lanes (the GPU kernels take nodes in words of 32), small shapes
 * (H 256, T 16, E_l 4, K 8): 40 x 1 has a partial second word, 34 x 2 node-mates beside it,
 * 64 x 1 two full words, 128 x 1 the limit. Routing by node and uniform; t_is_T: every rank
 * has T tokens, else a random t. The host backend runs them in CI (test_host_backend), the
 * GPU kernels where the machine has GPUs enough (test_gpu_ep). */
typedef struct ep_many_nodes_case {
    int N, R, skew, index64, t_is_T;
    hep_dtype dt;
} ep_many_nodes_case;
static const ep_many_nodes_case ep_many_nodes_cases[] = {
    {40, 1, EP_ROUTE_NODES, 0, 0, HEP_DTYPE_BF16},
    {34, 2, EP_ROUTE_NODES, 1, 1, HEP_DTYPE_BF16},
    {64, 1, 0, 0, 1, HEP_DTYPE_FP8_E4M3},
    {128, 1, 0, 1, 0, HEP_DTYPE_BF16},
};
#define EP_MANY_NODES_CASES (sizeof(ep_many_nodes_cases) / sizeof(ep_many_nodes_cases[0]))
void ep_case_random(ep_case *c, unsigned seed, int skew);
/* Checks every rank against the global oracle; returns the number of mismatches and
 * prints the first few. */
int ep_case_check(const ep_case *c);

uint16_t bf16_of(float f);
/* Expert output of (rank, row, channel): (rank + 1) * 8 + row % 13 + 0.25 * (h % 5) in the
 * first 8 channels; past them mixed signs and some -0.0, so that sums that drop a sign or
 * start from +0.0 are caught. */
uint16_t ep_expert_value(int rank, int row, int h);
float f32_of_bf16(uint16_t h);

#endif
