/* ref/host_shm.h: the host backend's reads and writes of the node-shared memory when a
 * group's ranks span processes (group/shm.c creates and maps the segments; the group layer
 * puts where each node-mate's parts are mapped here into hep_backend_ctx). */
#ifndef HEP_REF_HOST_SHM_H
#define HEP_REF_HOST_SHM_H

#include "backend/backend.h"

struct hep_shm_comb;

/* This rank's inputs (or a node-mate's copy of them) where the host backend reads them. */
typedef struct hep_shm_inputs {
    const void *tokens;   /* [t, H] rows */
    const float *scales;  /* FP8: [t, H / 128] */
    const void *idx;      /* [t, K] int32 or int64, as the mailbox says */
    const float *weights; /* [t, K] */
} hep_shm_inputs;

/* Node-mate l's local arena, as mapped here. */
char *hep_shm_mate_local(const hep_backend_ctx *g, int l);
/* Copy this rank's dispatch inputs into its staging area (t <= T, topk <= max_topk). */
void hep_shm_stage_inputs(hep_backend_ctx *g, const hep_dispatch_args *a);
/* Where node-mate l's staged inputs are mapped here. */
void hep_shm_mate_inputs(const hep_backend_ctx *g, int l, hep_shm_inputs *in);

/* Across nodes (all rows at once): this rank's combine input, `rows` BF16 rows and with
 * `probs` their n floats (rank-major [rows, E_l], expert-major [rows]), where node-mates
 * read them once it published its combine layout (hep_shm_publish_combine) with c->probs
 * and c->staged as this call set them: exchange.token and dispatch.recv_prob when the rows
 * fit max_recv_rows, else (expert-major) the expert-major staging (rows <= shm_em_rows,
 * checked at dispatch). */
void hep_shm_stage_combine_all(hep_backend_ctx *g, const void *src, const float *probs,
                               int rows, size_t n, struct hep_shm_comb *c);
/* Node-mate l's combine input as staged there and mapped here: its rows, and its
 * probabilities or NULL when its current combine (published before its
 * HEP_FLAG_COMBINE_READY) gave none. */
void hep_shm_mate_input(const hep_backend_ctx *g, int l, const uint16_t **rows,
                        const float **probs);

/* The combine across the processes of one node, in rounds (ref/host_backend.c): each
 * node-mate's rows (and probabilities) pass through its exchange.token (and
 * dispatch.recv_prob) max_recv_rows rows at a time, as the GPU kernels copy rank-major
 * inputs there. Its layout, for the node-mates: */
typedef struct hep_shm_comb {
    int layout, rows, budget, probs; /* hep_layout; rows of its input; budget; probs_in given */
    int staged;                      /* across nodes: in the expert-major staging */
    const int *ebase;                /* expert-major: [W][E_l] each source's first row in e */
} hep_shm_comb;
/* Publish this rank's combine layout (h's) where its node-mates read it. */
void hep_shm_publish_combine(hep_backend_ctx *g, const hep_shm_comb *c);
/* Node-mate l's published layout. */
void hep_shm_mate_combine(const hep_backend_ctx *g, int l, hep_shm_comb *c);
/* Round of this rank's input: rows [lo, lo + n) of `rows` (BF16 [.., H]) and, if `probs`,
 * its floats [lo * ppr, (lo + n) * ppr) into exchange.token / dispatch.recv_prob
 * (n <= max_recv_rows, ppr <= E_l). */
void hep_shm_stage_round(hep_backend_ctx *g, const void *rows, const float *probs, int ppr,
                         int lo, int n);

#endif
