/* group/handle.c: the handles that the caller owns (hybridep.h, "the training API"). */
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/core.h"
#include "group/group.h"

struct hep_handle *hep_handle_alloc(const hep_group *g)
{
    struct hep_handle *h = calloc(1, sizeof(*h));
    size_t T = (size_t)g->cfg.max_tokens, K = (size_t)g->cfg.max_topk;
    size_t W = (size_t)g->world, El = (size_t)g->cfg.experts_per_rank, N = (size_t)g->N;
    if (!h)
        return NULL;
    h->tag = g->be.handle_tag;
    h->T = (int)T, h->kmax = (int)K, h->W = (int)W, h->El = (int)El, h->N = (int)N;
    h->ids = malloc(sizeof(int) * T * K);
    h->w = malloc(sizeof(float) * T * K);
    h->w_scratch = malloc(sizeof(float) * T * K);
    h->base = calloc(W + 1, sizeof(int));
    h->ebase = calloc(W * El, sizeof(int));
    h->tpe = calloc(El, sizeof(int64_t));
    h->slot_t = calloc(N, sizeof(int));
    h->slot_ids = N > 1 ? malloc(sizeof(int) * N * T * K) : NULL;
    if (!h->ids || !h->w || !h->w_scratch || !h->base || !h->ebase || !h->tpe || !h->slot_t ||
        (N > 1 && !h->slot_ids)) {
        hep_handle_destroy(h);
        return NULL;
    }
    return h;
}

int hep_handle_create(hep_group *g, hep_handle **out)
{
    if (!out)
        return hep_fail(HEP_ERR_INVALID, "hep_handle_create: NULL output");
    *out = NULL;
    if (!g)
        return hep_fail(HEP_ERR_INVALID, "hep_handle_create: NULL group");
    *out = hep_handle_alloc(g);
    if (!*out)
        return hep_fail(HEP_ERR_NOMEM, "hep_handle_create: out of memory for a handle of %d "
                        "tokens x %d slots", g->cfg.max_tokens, g->cfg.max_topk);
    if (g->ops->handle_alloc) { /* the GPU's device part */
        int rc = g->ops->handle_alloc(&g->be, *out);
        if (rc) {
            hep_handle_destroy(*out);
            *out = NULL;
            return rc;
        }
    }
    return HEP_OK;
}

void hep_handle_destroy(hep_handle *h)
{
    if (!h)
        return;
    free(h->ids), free(h->w), free(h->w_scratch), free(h->base), free(h->ebase);
    free(h->tpe), free(h->slot_t), free(h->slot_ids);
    if (h->dev) /* any current device: the pointer names its own (unified addressing) */
        (void)cudaFree(h->dev); /* nothing to report it to: the call returns nothing */
    free(h);
}

int hep_handle_check(const hep_group *g, const struct hep_handle *h, int filled, const char *call)
{
    if (h->tag != g->be.handle_tag)
        return hep_fail(HEP_ERR_INVALID,
                        "%s: the handle belongs to another group (tag %llu, this group's %llu; "
                        "also a group since destroyed): a handle is used only with the group "
                        "of the rank that created it",
                        call, (unsigned long long)h->tag, (unsigned long long)g->be.handle_tag);
    if (filled && h->epoch == 0)
        return hep_fail(HEP_ERR_INVALID,
                        "%s: the handle holds no layout yet: pass it to a dispatch without "
                        "HEP_REUSE_LAYOUT first",
                        call);
    return HEP_OK;
}
