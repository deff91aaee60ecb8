/* ref/host_shm.c: the host backend's side of the node-shared memory (see host_shm.h). */
#include <string.h>

#include "ref/host_shm.h"

char *hep_shm_mate_local(const hep_backend_ctx *g, int l)
{
    return g->shm_local[l];
}

static char *staging(const hep_backend_ctx *g, int l)
{
    return g->shm_stage[l];
}

void hep_shm_stage_inputs(hep_backend_ctx *g, const hep_dispatch_args *a)
{
    const size_t t = (size_t)a->num_tokens, K = (size_t)a->topk, H = (size_t)g->cfg->hidden;
    const int fp8 = g->cfg->dtype == HEP_DTYPE_FP8_E4M3;
    char *st = staging(g, g->local);
    if (t == 0)
        return;
    /* t <= max_tokens and topk <= max_topk were checked: the staging area holds them */
    memcpy(st, a->tokens, t * H * (fp8 ? 1 : 2));
    if (fp8 && a->scales)
        memcpy(st + g->shm_st_scales, a->scales, t * (H / HEP_FP8_BLOCK) * sizeof(float));
    memcpy(st + g->shm_st_idx, a->topk_idx, t * K * (a->index_type == HEP_INDEX_INT64 ? 8 : 4));
    memcpy(st + g->shm_st_weights, a->topk_weights, t * K * sizeof(float));
}

void hep_shm_mate_inputs(const hep_backend_ctx *g, int l, hep_shm_inputs *in)
{
    const char *st = staging(g, l);
    in->tokens = st;
    in->scales =
        g->cfg->dtype == HEP_DTYPE_FP8_E4M3 ? (const float *)(st + g->shm_st_scales) : NULL;
    in->idx = st + g->shm_st_idx;
    in->weights = (const float *)(st + g->shm_st_weights);
}

void hep_shm_publish_combine(hep_backend_ctx *g, const hep_shm_comb *c)
{
    uint64_t *w = (uint64_t *)g->shm_comb[g->local];
    w[HEP_SHM_COMB_LAYOUT] = (uint64_t)c->layout;
    w[HEP_SHM_COMB_ROWS] = (uint64_t)c->rows;
    w[HEP_SHM_COMB_BUDGET] = (uint64_t)c->budget;
    w[HEP_SHM_COMB_PROBS] = (uint64_t)c->probs;
    w[HEP_SHM_COMB_STAGED] = (uint64_t)c->staged;
    if (c->layout == HEP_LAYOUT_EXPERT_MAJOR)
        memcpy(w + HEP_SHM_COMB_WORDS, c->ebase,
               sizeof(int) * (size_t)g->world * (size_t)g->cfg->experts_per_rank);
}

void hep_shm_mate_combine(const hep_backend_ctx *g, int l, hep_shm_comb *c)
{
    const uint64_t *w = (const uint64_t *)g->shm_comb[l];
    c->layout = (int)w[HEP_SHM_COMB_LAYOUT];
    c->rows = (int)w[HEP_SHM_COMB_ROWS];
    c->budget = (int)w[HEP_SHM_COMB_BUDGET];
    c->probs = (int)w[HEP_SHM_COMB_PROBS];
    c->staged = (int)w[HEP_SHM_COMB_STAGED];
    c->ebase = (const int *)(w + HEP_SHM_COMB_WORDS);
}

void hep_shm_stage_round(hep_backend_ctx *g, const void *rows, const float *probs, int ppr,
                         int lo, int n)
{
    const size_t H = (size_t)g->cfg->hidden;
    char *dst = hep_be_buf(g, HEP_BUF_TOKEN_X);
    float *pdst = (float *)hep_be_buf(g, HEP_BUF_RECV_PROB);
    const char *src = (const char *)rows + (size_t)lo * H * 2;
    if (n <= 0)
        return;
    if (src != dst) /* memmove: the caller may pass rows inside it */
        memmove(dst, src, (size_t)n * H * 2);
    if (probs && probs + (size_t)lo * (size_t)ppr != pdst)
        memmove(pdst, probs + (size_t)lo * (size_t)ppr, (size_t)n * (size_t)ppr * sizeof(float));
}

void hep_shm_stage_combine_all(hep_backend_ctx *g, const void *src, const float *probs,
                               int rows, size_t n, struct hep_shm_comb *c)
{
    char *dst = hep_be_buf(g, HEP_BUF_TOKEN_X);
    float *pdst = (float *)hep_be_buf(g, HEP_BUF_RECV_PROB);
    c->staged = rows > 0 && (size_t)rows > g->plan->max_recv_rows;
    c->probs = probs != NULL;
    if (c->staged) {
        dst = g->shm_em[g->local];
        pdst = (float *)(dst + g->shm_em_prob);
    }
    /* memmove: the caller may pass rows (or probabilities) inside the destination */
    if (src && src != dst && rows > 0)
        memmove(dst, src, (size_t)rows * (size_t)g->cfg->hidden * 2);
    if (probs && probs != pdst && n > 0)
        memmove(pdst, probs, n * sizeof(float));
}

void hep_shm_mate_input(const hep_backend_ctx *g, int l, const uint16_t **rows,
                        const float **probs)
{
    const uint64_t *w = (const uint64_t *)g->shm_comb[l];
    const char *r = hep_be_peer_buf(g, l, HEP_BUF_TOKEN_X);
    const char *p = hep_be_peer_buf(g, l, HEP_BUF_RECV_PROB);
    if (w[HEP_SHM_COMB_STAGED] && g->shm_em[l]) {
        r = g->shm_em[l];
        p = r + g->shm_em_prob;
    }
    *rows = (const uint16_t *)r;
    *probs = w[HEP_SHM_COMB_PROBS] ? (const float *)p : NULL;
}
