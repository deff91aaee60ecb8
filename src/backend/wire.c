/* backend/wire.c: the work the CPU proxy does for one inter-node dispatch or combine, as
 * chunks between this rank's registrations and the peers' (the wire protocol of
 * docs/architecture.md). Slot j of a rank's inter-node buffers belongs to node
 * j + (j >= its own node). */
#include <string.h>

#include "core/core.h"
#include "backend/backend.h"
#include "kernels/ep_kernels.h"
#include "net/coordinator.h"
#include "net/proxy.h"

int hep_slot_of(int node, int at_node)
{
    return node < at_node ? node : node - 1;
}

hep_proxy_chunk hep_wire_chunk(const hep_backend_ctx *g, int peer, int lid, size_t loff, int rid,
                               size_t roff, size_t len, const volatile uint64_t *ready)
{
    const hep_coord *c = g->coord;
    const hep_gpu_mr *m = &c->mr[lid - HEP_FIRST_RDMA_BUF];
    const hep_remote_buf *r = &c->remote[(size_t)peer * HEP_RDMA_BUF_COUNT +
                                         (size_t)(rid - HEP_FIRST_RDMA_BUF)];
    hep_proxy_chunk k;
    memset(&k, 0, sizeof(k));
    k.ready = ready;
    k.peer = peer;
    k.lkey = m->lkey;
    k.laddr = m->addr + loff;
    k.rkey = r->rkey;
    k.raddr = r->addr + roff;
    k.len = len;
    k.name = g->plan->buf[lid].name;
    return k;
}

/* k's flag write: u64 word lword of buffer lid to word rword of the peer's rid. */
static void set_flag(const hep_backend_ctx *g, hep_proxy_chunk *k, int lid, size_t lword, int rid,
                     size_t rword)
{
    const hep_proxy_chunk f = hep_wire_chunk(g, k->peer, lid, lword * 8, rid, rword * 8, 8, NULL);
    k->flag = 1;
    k->flag_lkey = f.lkey;
    k->flag_laddr = f.laddr;
    k->flag_rkey = f.rkey;
    k->flag_raddr = f.raddr;
}

hep_proxy_chunk hep_wire_count_then_flag(const hep_backend_ctx *g, int peer, int lid, int rid,
                                         int lword, int rword, const volatile uint64_t *ready)
{
    hep_proxy_chunk k =
        hep_wire_chunk(g, peer, lid, (size_t)lword * 8, rid, (size_t)rword * 8, 8, ready);
    set_flag(g, &k, lid, (size_t)(g->N + lword), rid, (size_t)(g->N + rword));
    k.fence = 1; /* after all of the slot's data */
    return k;
}

hep_proxy_chunk hep_wire_flag(const hep_backend_ctx *g, int peer, int lid, size_t lword, int rid,
                              size_t rword, uint64_t want)
{
    hep_proxy_chunk k = hep_wire_chunk(g, peer, lid, 0, rid, 0, 0, NULL);
    set_flag(g, &k, lid, lword, rid, rword);
    k.ready = (const volatile uint64_t *)(uintptr_t)k.flag_laddr; /* the flag's own source */
    k.want = want;
    k.fence = 1;
    return k;
}

/* The GPU path: S chunks per buffer and node, each block's rows as its descriptor says,
 * then the slot's count and flag. */
static int add_blocks(const hep_backend_ctx *g, hep_proxy_chunk *ch, int n, int peer, int lid,
                      size_t loff, int rid, size_t roff, size_t unit, const uint64_t *px, int S)
{
    for (int b = 0; b < S; b++) {
        ch[n] = hep_wire_chunk(g, peer, lid, loff, rid, roff, (size_t)g->cfg->max_tokens * unit,
                               px + 3 * b);
        ch[n].desc = px + 3 * b + 1;
        ch[n].unit = unit;
        n++;
    }
    return n;
}

int hep_wire_gpu_batch(const hep_backend_ctx *g, int phase, int S, int probs, hep_proxy_chunk *ch)
{
    const size_t T = (size_t)g->cfg->max_tokens, H = (size_t)g->cfg->hidden;
    const int fp8 = g->cfg->dtype == HEP_DTYPE_FP8_E4M3;
    const size_t rb = H * (fp8 ? 1 : 2), rw = (size_t)g->cfg->max_topk * 4;
    const size_t sb = H / HEP_FP8_BLOCK * 4, rb2 = H * 2;
    const size_t pb = (size_t)g->R * (size_t)g->cfg->experts_per_rank * 4; /* a prob row */
    const uint64_t *px0 = (const uint64_t *)(g->arena[HEP_ARENA_MAPPED] +
                                             g->plan->buf[HEP_BUF_PROXY].offset);
    int n = 0;
    for (int m = 0; m < g->N; m++) {
        const int peer = m * g->R + g->local, j = hep_slot_of(m, g->node);
        const int s = hep_slot_of(g->node, m);
        const uint64_t *px = px0 + HEP_PX_WORD(g->N, phase, m);
        if (m == g->node)
            continue;
        if (phase == 0) {
            /* the count block first, with its own flag: the receiver lays out early */
            const size_t cb = HEP_COUNT_BLOCK_WORDS((size_t)g->R, (size_t)g->cfg->experts_per_rank);
            const size_t N = (size_t)g->N;
            ch[n] = hep_wire_chunk(g, peer, HEP_BUF_D_ATTN_FLAGS, (3 * N + m * cb) * 8,
                                   HEP_BUF_D_GROUP_FLAGS, (3 * N + s * cb) * 8, cb * 8,
                                   px + 3 * HEP_PX_MAX_BLOCKS + 1);
            set_flag(g, &ch[n++], HEP_BUF_D_ATTN_FLAGS, 2 * N + m, HEP_BUF_D_GROUP_FLAGS,
                     2 * N + s);
            n = add_blocks(g, ch, n, peer, HEP_BUF_D_ATTN_TOKEN, j * T * rb, HEP_BUF_D_GROUP_TOKEN,
                           s * T * rb, rb, px, S);
            /* the routing's three blocks of a slot (ep_kernels.h): ids, weights, offsets */
            const size_t rs = T * (size_t)HEP_GPU_ROUTE_WORDS(g->cfg->max_topk, g->R) * 4;
            const size_t ro = (size_t)g->R * 4, rt = T * rw;
            n = add_blocks(g, ch, n, peer, HEP_BUF_D_ATTN_PROB, j * rs, HEP_BUF_D_GROUP_PROB,
                           s * rs, rw, px, S);
            n = add_blocks(g, ch, n, peer, HEP_BUF_D_ATTN_PROB, j * rs + rt,
                           HEP_BUF_D_GROUP_PROB, s * rs + rt, rw, px, S);
            n = add_blocks(g, ch, n, peer, HEP_BUF_D_ATTN_PROB, j * rs + 2 * rt,
                           HEP_BUF_D_GROUP_PROB, s * rs + 2 * rt, ro, px, S);
            if (fp8)
                n = add_blocks(g, ch, n, peer, HEP_BUF_D_ATTN_SCALE, j * T * sb,
                               HEP_BUF_D_GROUP_SCALE, s * T * sb, sb, px, S);
            ch[n++] = hep_wire_count_then_flag(g, peer, HEP_BUF_D_ATTN_FLAGS,
                                               HEP_BUF_D_GROUP_FLAGS, m, s,
                                               px + 3 * HEP_PX_MAX_BLOCKS);
        } else {
            /* the arrival word first (ahead of the rows, same connection): the receiver's
             * timeout then tells a lost flag from a peer that never started its combine */
            const size_t N = (size_t)g->N;
            ch[n++] = hep_wire_chunk(g, peer, HEP_BUF_C_OUT_FLAGS, (2 * N + m) * 8,
                                     HEP_BUF_C_GROUP_FLAGS, (2 * N + s) * 8, 8,
                                     px + 3 * HEP_PX_MAX_BLOCKS + 1);
            n = add_blocks(g, ch, n, peer, HEP_BUF_C_RED_TOKEN, j * T * rb2,
                           HEP_BUF_C_GROUP_TOKEN, s * T * rb2, rb2, px, S);
            if (probs) /* the same blocks' rows of probabilities, before the flag */
                n = add_blocks(g, ch, n, peer, HEP_BUF_C_RED_PROB, j * T * pb,
                               HEP_BUF_C_GROUP_PROB, s * T * pb, pb, px, S);
            ch[n++] = hep_wire_count_then_flag(g, peer, HEP_BUF_C_OUT_FLAGS,
                                               HEP_BUF_C_GROUP_FLAGS, m, s,
                                               px + 3 * HEP_PX_MAX_BLOCKS);
        }
    }
    return n;
}
