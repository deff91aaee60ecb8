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

/* The GPU path's ring (kernels/ep_kernels.h, HEP_PX_*): chunk k of a ring to a peer, its
 * data from position p = k % P of local slot j to the same position of the peer's slot s, as
 * far as the producer's descriptor says (count rows of `unit` bytes; at most C), wanted at
 * HEP_RING_VAL(e, k + 1) and skipped once the ring's skip word says the call has fewer. */
static hep_proxy_chunk ring_data(const hep_backend_ctx *g, int phase, int peer, int lid,
                                 size_t loff, int rid, size_t roff, size_t unit,
                                 const uint64_t *pxn, int k, uint64_t e)
{
    const int p = k % hep_plan_ring(g->plan, phase);
    hep_proxy_chunk c =
        hep_wire_chunk(g, peer, lid, loff, rid, roff, (size_t)hep_plan_chunk(g->plan, phase) * unit,
                       pxn + HEP_PX_RING + 3 * p);
    c.desc = pxn + HEP_PX_RING + 3 * p + 1;
    c.unit = unit;
    c.want = HEP_RING_VAL(e, k + 1);
    c.skip = pxn + HEP_PX_RING_SKIP;
    c.skip_want = HEP_RING_SKIP(e, k);
    return c;
}

/* ... and its flag: the sender's flag source of position p to the peer's landed word,
 * after all of the chunk's data (fenced: after every earlier chunk to the peer). */
static hep_proxy_chunk ring_flag(const hep_backend_ctx *g, int phase, int peer, int lid, int rid,
                                 int m, int s, const uint64_t *pxn, int k, uint64_t e)
{
    const size_t N = (size_t)g->N, P = (size_t)hep_plan_ring(g->plan, phase);
    const size_t cb = HEP_COUNT_BLOCK_WORDS((size_t)g->R, (size_t)g->cfg->experts_per_rank);
    const int p = k % (int)P;
    hep_proxy_chunk c = hep_wire_flag(g, peer, lid, HEP_RING_SRC_WORD(N, cb, (size_t)m, (size_t)p, P),
                                      rid, HEP_RING_WORD(N, cb) + (size_t)s, HEP_RING_VAL(e, k + 1));
    c.ready = pxn + HEP_PX_RING + 3 * p;
    c.skip = pxn + HEP_PX_RING_SKIP;
    c.skip_want = HEP_RING_SKIP(e, k);
    return c;
}

/* The credit for chunk k of the ring this rank receives from `peer` (its slot j here): the
 * credit source of slot j to the peer's credit word for this node, unfenced (a credit never
 * waits behind data), skipped past the chunks whose credit the sender waits for. */
static hep_proxy_chunk ring_credit(const hep_backend_ctx *g, int peer, int lid, int rid, int j,
                                   const uint64_t *pxn, int k, uint64_t e)
{
    const size_t N = (size_t)g->N;
    const size_t cb = HEP_COUNT_BLOCK_WORDS((size_t)g->R, (size_t)g->cfg->experts_per_rank);
    const size_t B = HEP_RING_WORD(N, cb);
    hep_proxy_chunk c = hep_wire_chunk(g, peer, lid, (B + N + (size_t)j) * 8, rid,
                                       (B + (size_t)g->node) * 8, 8, pxn + HEP_PX_CREDIT);
    c.want = HEP_RING_VAL(e, k + 1);
    c.skip = pxn + HEP_PX_CREDIT_SKIP;
    c.skip_want = HEP_RING_SKIP(e, k);
    return c;
}

static int chunks_for(const hep_backend_ctx *g, int phase, int tokens)
{
    const int C = hep_plan_chunk(g->plan, phase);
    return (tokens + C - 1) / C;
}

size_t hep_wire_gpu_batch_max(const hep_backend_ctx *g)
{
    /* per other node: count word, count block, final count and flag, arrival; per chunk up to
     * 6 data chunks and a flag; per credit one (combine's chunks, maybe more, need fewer:
     * 2 data chunks, a flag and a credit) */
    const size_t kd = (size_t)chunks_for(g, 0, g->cfg->max_tokens);
    const size_t kc = (size_t)chunks_for(g, 1, g->cfg->max_tokens);
    return (size_t)(g->N - 1) * (4 + (8 * kd > 4 * kc ? 8 * kd : 4 * kc));
}

int hep_wire_gpu_batch(const hep_backend_ctx *g, int phase, uint64_t e, int t, int probs,
                       hep_proxy_chunk *ch)
{
    const size_t T = (size_t)g->cfg->max_tokens, H = (size_t)g->cfg->hidden;
    /* this phase's ring: chunk k of C tokens in position k % P of a slot of ST rows */
    const size_t ST = g->plan->slot_tokens, C = (size_t)hep_plan_chunk(g->plan, phase);
    const int P = hep_plan_ring(g->plan, phase), Kin = chunks_for(g, phase, (int)T);
    const int fp8 = g->cfg->dtype == HEP_DTYPE_FP8_E4M3, kmax = g->cfg->max_topk;
    const size_t rb = H * (fp8 ? 1 : 2), rw = (size_t)kmax * 4;
    const size_t sb = H / HEP_FP8_BLOCK * 4, rb2 = H * 2;
    const size_t pb = (size_t)g->R * (size_t)g->cfg->experts_per_rank * 4; /* a prob row */
    /* a slot's routing (ep_kernels.h): [ST][kmax] ids, [ST][kmax] weights, [ST][R] offsets,
     * [ST][kmax] expert-major places */
    const size_t rs = ST * (size_t)HEP_GPU_ROUTE_WORDS(kmax, g->R) * 4, ro = (size_t)g->R * 4;
    const uint64_t *px0 = (const uint64_t *)(g->arena[HEP_ARENA_MAPPED] +
                                             g->plan->buf[HEP_BUF_PROXY].offset);
    const size_t N = (size_t)g->N;
    const size_t cb = HEP_COUNT_BLOCK_WORDS((size_t)g->R, (size_t)g->cfg->experts_per_rank);
    int n = 0;
    for (int m = 0; m < g->N; m++) {
        const int peer = m * g->R + g->local, j = hep_slot_of(m, g->node);
        const int s = hep_slot_of(g->node, m);
        const uint64_t *px = px0 + HEP_PX_WORD(g->N, phase, m);
        /* the ring to m: this call's own tokens (dispatch) or m's slot here (combine) */
        const int Kout = phase == 0 ? chunks_for(g, phase, t) : Kin;
        if (m == g->node)
            continue;
        if (phase == 0) {
            /* the slot's count and count block first, then its flag: the receiver lays out
             * and knows its chunks while the rows travel */
            ch[n++] = hep_wire_chunk(g, peer, HEP_BUF_D_ATTN_FLAGS, (size_t)m * 8,
                                     HEP_BUF_D_GROUP_FLAGS, (size_t)s * 8, 8,
                                     px + 3 * HEP_PX_MAX_BLOCKS + 1);
            ch[n] = hep_wire_chunk(g, peer, HEP_BUF_D_ATTN_FLAGS, (3 * N + m * cb) * 8,
                                   HEP_BUF_D_GROUP_FLAGS, (3 * N + s * cb) * 8, cb * 8,
                                   px + 3 * HEP_PX_MAX_BLOCKS + 1);
            set_flag(g, &ch[n], HEP_BUF_D_ATTN_FLAGS, 2 * N + m, HEP_BUF_D_GROUP_FLAGS,
                     2 * N + s);
            ch[n++].fence = 1; /* after the count: its chunk sees the same ready word alone */
            for (int k = 0; k < Kout; k++) {
                const size_t p = (size_t)(k % P), lr = (size_t)j * ST + p * C;
                const size_t rr = (size_t)s * ST + p * C;
                ch[n++] = ring_data(g, phase, peer, HEP_BUF_D_ATTN_TOKEN, lr * rb,
                                    HEP_BUF_D_GROUP_TOKEN, rr * rb, rb, px, k, e);
                ch[n++] = ring_data(g, phase, peer, HEP_BUF_D_ATTN_PROB, j * rs + p * C * rw,
                                    HEP_BUF_D_GROUP_PROB, s * rs + p * C * rw, rw, px, k, e);
                ch[n++] = ring_data(g, phase, peer, HEP_BUF_D_ATTN_PROB, j * rs + (ST + p * C) * rw,
                                    HEP_BUF_D_GROUP_PROB, s * rs + (ST + p * C) * rw, rw, px, k, e);
                ch[n++] = ring_data(g, phase, peer, HEP_BUF_D_ATTN_PROB,
                                    j * rs + 2 * ST * rw + p * C * ro, HEP_BUF_D_GROUP_PROB,
                                    s * rs + 2 * ST * rw + p * C * ro, ro, px, k, e);
                if (probs) /* expert-major: the places */
                    ch[n++] =
                        ring_data(g, phase, peer, HEP_BUF_D_ATTN_PROB,
                                  j * rs + 2 * ST * rw + ST * ro + p * C * rw, HEP_BUF_D_GROUP_PROB,
                                  s * rs + 2 * ST * rw + ST * ro + p * C * rw, rw, px, k, e);
                if (fp8)
                    ch[n++] = ring_data(g, phase, peer, HEP_BUF_D_ATTN_SCALE, lr * sb,
                                        HEP_BUF_D_GROUP_SCALE, rr * sb, sb, px, k, e);
                ch[n++] = ring_flag(g, phase, peer, HEP_BUF_D_ATTN_FLAGS, HEP_BUF_D_GROUP_FLAGS, m,
                                    s, px, k, e);
            }
            ch[n++] = hep_wire_count_then_flag(g, peer, HEP_BUF_D_ATTN_FLAGS,
                                               HEP_BUF_D_GROUP_FLAGS, m, s,
                                               px + 3 * HEP_PX_MAX_BLOCKS);
        } else {
            /* the arrival word first (ahead of the rows, same connection): the receiver's
             * timeout then tells a lost flag from a peer that never started its combine */
            ch[n++] = hep_wire_chunk(g, peer, HEP_BUF_C_OUT_FLAGS, (2 * N + m) * 8,
                                     HEP_BUF_C_GROUP_FLAGS, (2 * N + s) * 8, 8,
                                     px + 3 * HEP_PX_MAX_BLOCKS + 1);
            for (int k = 0; k < Kout; k++) {
                const size_t p = (size_t)(k % P), lr = (size_t)j * ST + p * C;
                const size_t rr = (size_t)s * ST + p * C;
                ch[n++] = ring_data(g, phase, peer, HEP_BUF_C_RED_TOKEN, lr * rb2,
                                    HEP_BUF_C_GROUP_TOKEN, rr * rb2, rb2, px, k, e);
                if (probs) /* the same rows' probabilities, before the chunk's flag */
                    ch[n++] = ring_data(g, phase, peer, HEP_BUF_C_RED_PROB, lr * pb,
                                        HEP_BUF_C_GROUP_PROB, rr * pb, pb, px, k, e);
                ch[n++] = ring_flag(g, phase, peer, HEP_BUF_C_OUT_FLAGS, HEP_BUF_C_GROUP_FLAGS, m,
                                    s, px, k, e);
            }
            ch[n++] = hep_wire_count_then_flag(g, peer, HEP_BUF_C_OUT_FLAGS,
                                               HEP_BUF_C_GROUP_FLAGS, m, s,
                                               px + 3 * HEP_PX_MAX_BLOCKS);
        }
    }
    /* after all data: a flag never waits behind a credit. The credits of the ring received
     * from m: dispatch, m's slot here (at most T tokens); combine, this rank's tokens' partial
     * sums from m (at most t). Chunk k's credit lets m send chunk k + P. */
    for (int m = 0; m < g->N; m++) {
        const int peer = m * g->R + g->local, j = hep_slot_of(m, g->node);
        const uint64_t *px = px0 + HEP_PX_WORD(g->N, phase, m);
        /* hold_credits (a test hook): a receiver that never frees a chunk */
        const int Kc = g->hold_credits ? 0 : (phase == 0 ? Kin : chunks_for(g, phase, t)) - P;
        for (int k = 0; m != g->node && k < Kc; k++)
            ch[n++] = phase == 0 ? ring_credit(g, peer, HEP_BUF_D_GROUP_FLAGS,
                                               HEP_BUF_D_ATTN_FLAGS, j, px, k, e)
                                 : ring_credit(g, peer, HEP_BUF_C_GROUP_FLAGS,
                                               HEP_BUF_C_OUT_FLAGS, j, px, k, e);
    }
    return n;
}
