/* group/handle.c: the handles that the caller owns (hybridep.h, "the training API"). */
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/core.h"
#include "group/group.h"
#include "kernels/ep_kernels.h"

/* The GPU layout of a handle (one node): one allocation on the group's GPU. */
static int handle_device(const hep_group *g, struct hep_handle *h)
{
    const size_t T = (size_t)g->cfg.max_tokens, K = (size_t)g->cfg.max_topk;
    const size_t R = (size_t)g->R, El = (size_t)g->cfg.experts_per_rank;
    const size_t S = (size_t)g->cfg.dispatch_sms;
    /* rank-major: rows, meta, counts, ids, weights; expert-major: positions, bases, the
     * blocks' counts, the words and padding ranges, then the int64 tokens per expert */
    const size_t ints = T * R + R + 2 + El + T * K + T * K + T * K + R * El + S * R * El +
                        HEP_EM_WORDS + 2 * El;
    const size_t ints8 = (ints + 1) & ~(size_t)1, bytes = ints8 * 4 + El * 8;
    int prev = -1;
    cudaError_t e = cudaGetDevice(&prev);
    if (e == cudaSuccess && prev != g->device)
        e = cudaSetDevice(g->device);
    if (e == cudaSuccess)
        e = cudaMalloc(&h->dev, bytes);
    if (e == cudaSuccess)
        e = cudaMemset(h->dev, 0, bytes);
    if (prev >= 0 && prev != g->device)
        (void)cudaSetDevice(prev); /* the caller's device back, whatever happened */
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        if (h->dev)
            (void)cudaFree(h->dev);
        h->dev = NULL;
        return hep_fail(e == cudaErrorMemoryAllocation ? HEP_ERR_NOMEM : HEP_ERR_CUDA,
                        "hep_handle_create: %zu bytes of device memory on GPU %d: %s", bytes,
                        g->device, cudaGetErrorString(e));
    }
    h->d_rows = (int *)h->dev;
    h->d_meta = h->d_rows + T * R;
    h->d_counts = h->d_meta + R;
    h->d_ids = h->d_counts + 2 + El;
    h->d_w = (float *)(h->d_ids + T * K);
    h->d_epos = (int *)(h->d_w + T * K);
    h->d_ebase = h->d_epos + T * K;
    h->d_ebc = h->d_ebase + R * El;
    h->d_em = h->d_ebc + S * R * El;
    h->d_tpe = (int64_t *)((int *)h->dev + ints8);
    return HEP_OK;
}

struct hep_handle *hep_handle_alloc(const hep_group *g)
{
    struct hep_handle *h = calloc(1, sizeof(*h));
    size_t T = (size_t)g->cfg.max_tokens, K = (size_t)g->cfg.max_topk;
    size_t W = (size_t)g->world, El = (size_t)g->cfg.experts_per_rank, N = (size_t)g->N;
    if (!h)
        return NULL;
    h->tag = g->handle_tag;
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
    if (g->cfg.backend == HEP_BACKEND_GPU && g->N == 1) {
        int rc = handle_device(g, *out);
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
    if (h->tag != g->handle_tag)
        return hep_fail(HEP_ERR_INVALID,
                        "%s: the handle belongs to another group (tag %llu, this group's %llu; "
                        "also a group since destroyed): a handle is used only with the group "
                        "of the rank that created it",
                        call, (unsigned long long)h->tag, (unsigned long long)g->handle_tag);
    if (filled && h->epoch == 0)
        return hep_fail(HEP_ERR_INVALID,
                        "%s: the handle holds no layout yet: pass it to a dispatch without "
                        "HEP_REUSE_LAYOUT first",
                        call);
    return HEP_OK;
}
