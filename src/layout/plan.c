/* layout/plan.c: the buffer plan. */
#include <stdio.h>
#include <string.h>

#include "core/core.h"
#include "layout/plan.h"

void hep_config_default(hep_config *c)
{
    memset(c, 0, sizeof(*c));
    c->max_topk = 8;
    c->dtype = HEP_DTYPE_BF16;
    c->dispatch_sms = 16;
    c->combine_sms = 16;
    c->chunk_tokens = HEP_CHUNK_DEFAULT; /* the backend's (ring_shape) */
    c->backend = HEP_BACKEND_GPU;
}

_Static_assert(HEP_MAX_RANKS_PER_NODE_GPU == HEP_GPU_MAX_LOCAL &&
                   HEP_MAX_NODES_GPU == HEP_GPU_MAX_NODES,
               "the public limits are the kernels' limits");

static int max_local(const hep_config *c)
{
    return c->backend == HEP_BACKEND_HOST ? HEP_MAX_RANKS_PER_NODE_HOST
                                          : HEP_MAX_RANKS_PER_NODE_GPU;
}
static int max_nodes(const hep_config *c)
{
    return c->backend == HEP_BACKEND_HOST ? HEP_MAX_NODES_HOST : HEP_MAX_NODES_GPU;
}
static const char *backend_name(const hep_config *c)
{
    return c->backend == HEP_BACKEND_HOST ? "host backend" : "GPU backend";
}

/* nodes x ranks_per_node within the backend's limits (hybridep.h) */
static int check_shape(const hep_config *c, int nodes, int ranks_per_node)
{
    if (ranks_per_node < 1 || ranks_per_node > max_local(c))
        return hep_fail(HEP_ERR_INVALID,
                        "%d ranks per node is not in 1..%d (the %s's limit)", ranks_per_node,
                        max_local(c), backend_name(c));
    if (nodes < 1 || nodes > max_nodes(c))
        return hep_fail(HEP_ERR_INVALID, "%d nodes is not in 1..%d (the %s's limit)", nodes,
                        max_nodes(c), backend_name(c));
    return HEP_OK;
}

static int range(const char *field, long v, long lo, long hi, const char *why)
{
    if (v < lo || v > hi)
        return hep_fail(HEP_ERR_INVALID, "config.%s = %ld is out of range %ld..%ld%s%s", field, v,
                        lo, hi, why ? ": " : "", why ? why : "");
    return HEP_OK;
}

int hep_config_check(const hep_config *c, int world)
{
    int rc;
    if (!c)
        return hep_fail(HEP_ERR_INVALID, "config is NULL");
    if (world < 0)
        return hep_fail(HEP_ERR_INVALID,
                        "hep_config_check: world = %d is negative (0: check without a group size)",
                        world);
    if ((rc = range("backend", c->backend, 0, 1, "0 = GPU, 1 = host")))
        return rc;
    if ((rc = range("hidden", c->hidden, 8, 65536, NULL)) ||
        (rc = range("max_tokens", c->max_tokens, 1, 65536, NULL)) ||
        (rc = range("experts_per_rank", c->experts_per_rank, 1, 1024, NULL)) ||
        (rc = range("max_topk", c->max_topk, 1, 32, NULL)) ||
        (rc = range("dtype", c->dtype, 0, 1, "0 = BF16, 1 = FP8 E4M3")) ||
        (rc = range("ranks_per_node", c->ranks_per_node, 0, max_local(c),
                    c->backend == HEP_BACKEND_HOST ? "0 = ranks sharing a host; the host "
                                                     "backend's limit"
                                                   : "0 = ranks sharing a host; the GPU "
                                                     "kernels' limit")) ||
        (rc = range("dispatch_sms", c->dispatch_sms, 1, 132, NULL)) ||
        (rc = range("combine_sms", c->combine_sms, 1, 132, NULL)) ||
        (rc = range("chunk_tokens", c->chunk_tokens, HEP_CHUNK_DEFAULT, 4096,
                    "-1 = the backend's default, 0 = one chunk of max_tokens per inter-node "
                    "slot")) ||
        (rc = range("max_recv_rows", c->max_recv_rows, 0, 1L << 30,
                    "0 = world x max_tokens (the worst case)")) ||
        (rc = range("max_permuted_rows", c->max_permuted_rows, 0, 1L << 30,
                    "0 = no expert-major staging (the expert-major layout across processes "
                    "is then refused)")))
        return rc;
    if (c->dtype == HEP_DTYPE_BF16 && c->hidden % 8)
        return hep_fail(HEP_ERR_INVALID,
                        "config.hidden = %d: BF16 rows must be a multiple of 8 channels (16 bytes)",
                        c->hidden);
    if (c->dtype == HEP_DTYPE_FP8_E4M3 && c->hidden % HEP_FP8_BLOCK)
        return hep_fail(HEP_ERR_INVALID,
                        "config.hidden = %d: FP8 needs a multiple of %d channels (one f32 scale "
                        "per %d)",
                        c->hidden, HEP_FP8_BLOCK, HEP_FP8_BLOCK);
    if (world > 0) {
        long most = (long)max_local(c) * max_nodes(c);
        if (c->ranks_per_node > 0 && world % c->ranks_per_node)
            return hep_fail(HEP_ERR_INVALID,
                            "config.ranks_per_node = %d does not divide the %d ranks of the group",
                            c->ranks_per_node, world);
        if (c->ranks_per_node > 0 &&
            (rc = check_shape(c, world / c->ranks_per_node, c->ranks_per_node)))
            return rc;
        if (world > most)
            return hep_fail(HEP_ERR_INVALID, "a group of %d ranks exceeds the %s's %ld (%d nodes x %d)",
                            world, backend_name(c), most, max_nodes(c), max_local(c));
        if ((long)c->max_topk > (long)c->experts_per_rank * world)
            return hep_fail(HEP_ERR_INVALID,
                            "config.max_topk = %d exceeds the %ld experts of the group",
                            c->max_topk, (long)c->experts_per_rank * world);
        if ((long long)world * c->max_tokens > (1LL << 30))
            return hep_fail(HEP_ERR_INVALID,
                            "world x max_tokens = %lld exceeds 2^30 receive rows",
                            (long long)world * c->max_tokens);
        if ((rc = range("max_recv_rows", c->max_recv_rows, 0, (long)world * c->max_tokens,
                        "0 = the worst case; at most world x max_tokens")))
            return rc;
    }
    hep_clear_error(); /* valid: no earlier call's message may stand for this one */
    return HEP_OK;
}

typedef struct plan_ctx {
    hep_plan *p;
    int overflow;
} plan_ctx;

static size_t mul3(plan_ctx *x, size_t a, size_t b, size_t c)
{
    size_t r;
    if (hep_mul_overflow(a, b, &r) || hep_mul_overflow(r, c, &r)) {
        x->overflow = 1;
        return 0;
    }
    return r;
}

static void add(plan_ctx *x, int id, const char *name, const char *role, const char *elem,
                size_t elem_bytes, size_t count, int arena, int registered)
{
    hep_plan_buffer *b = &x->p->buf[id];
    b->name = name;
    b->role = role;
    b->elem = elem;
    b->elem_bytes = elem_bytes;
    b->count = count;
    b->bytes = mul3(x, elem_bytes, count, 1);
    b->arena = arena;
    b->align = 256; /* 16-byte vectors and TMA need 16; 256 keeps rows of every buffer apart */
    b->present = 1;
    b->registered = registered;
    b->alias_of = -1;
}

static void place(plan_ctx *x)
{
    hep_plan *p = x->p;
    for (int i = 0; i < HEP_BUF_COUNT; i++) {
        hep_plan_buffer *b = &p->buf[i];
        size_t *top = &p->arena_bytes[b->arena], off;
        if (!b->present || b->alias_of >= 0)
            continue;
        off = (*top + b->align - 1) / b->align * b->align;
        if (hep_add_overflow(off, b->bytes, top)) {
            x->overflow = 1;
            return;
        }
        b->offset = off;
    }
    for (int i = 0; i < HEP_BUF_COUNT; i++) {
        hep_plan_buffer *b = &p->buf[i];
        if (b->present && b->alias_of >= 0) {
            b->offset = p->buf[b->alias_of].offset;
            if (b->bytes > p->buf[b->alias_of].bytes)
                x->overflow = 1; /* cannot happen by construction; never silently overlap */
        }
    }
    for (int a = 0; a < HEP_ARENA_COUNT; a++) {
        /* whole 64 KiB units: a DMA-BUF export of a buffer's enclosing pages stays inside */
        size_t r = (p->arena_bytes[a] + 65535) / 65536 * 65536;
        if (r < p->arena_bytes[a])
            x->overflow = 1;
        p->arena_bytes[a] = r;
    }
    p->device_bytes = p->arena_bytes[HEP_ARENA_SHARED] + p->arena_bytes[HEP_ARENA_LOCAL];
    p->host_bytes = p->arena_bytes[HEP_ARENA_MAPPED] + p->arena_bytes[HEP_ARENA_PINNED];
}

static void plan_internode(plan_ctx *x, const hep_config *c, size_t esize, size_t nscale)
{
    hep_plan *p = x->p;
    size_t H = (size_t)c->hidden, N = (size_t)p->nodes;
    size_t Enode = (size_t)c->experts_per_rank * (size_t)p->ranks_per_node;
    size_t slots = (N - 1) * p->slot_tokens; /* rows of the other nodes' slots (rings) */
    /* a token's top-k ids (i32) then weights (f32); the GPU kernels also send its offset at
     * each of the receiving node's ranks, so that the receiver forwards without a scan */
    size_t route = c->backend == HEP_BACKEND_HOST
                       ? 2 * (size_t)c->max_topk
                       : HEP_GPU_ROUTE_WORDS((size_t)c->max_topk, (size_t)p->ranks_per_node);
    /* flags buffers: count [N], flag [N], early-count flag [N], then per node the count
     * block (tokens per (local rank, expert) of its slot, R x (E_l + 1) i32) */
    const size_t cb = HEP_COUNT_BLOCK_WORDS((size_t)p->ranks_per_node, (size_t)c->experts_per_rank);
    size_t fw = HEP_INTERNODE_FLAG_WORDS(N, cb, (size_t)p->ring);
    /* combine's: a flag source for each position of its ring (cring, maybe more than ring) */
    size_t cfw = HEP_INTERNODE_FLAG_WORDS(N, cb, (size_t)p->cring);
    const char *tok = c->dtype == HEP_DTYPE_FP8_E4M3 ? "fp8" : "bf16";
    int fp8 = c->dtype == HEP_DTYPE_FP8_E4M3;

    /* The send staging: for each other node, its tokens packed in source order (the slot
     * layout of the receiver), so that each buffer goes out in one large write per node. */
    add(x, HEP_BUF_D_ATTN_TOKEN, "dispatch.attn_input_token", "dispatch", tok, esize,
        mul3(x, slots, H, 1), HEP_ARENA_LOCAL, 1);
    add(x, HEP_BUF_D_ATTN_FLAGS, "dispatch.attn_input_flags", "dispatch", "u64", 8, fw,
        HEP_ARENA_LOCAL, 1);
    /* the routing travels instead of the node's E_node probabilities: 2K words per token
     * are fewer bytes, and the peer derives every local rank's probabilities from them */
    add(x, HEP_BUF_D_ATTN_PROB, "dispatch.attn_input_prob", "dispatch", "i32+f32", 4,
        mul3(x, slots, route, 1), HEP_ARENA_LOCAL, 1);
    if (fp8)
        add(x, HEP_BUF_D_ATTN_SCALE, "dispatch.attn_input_scaling_factor", "dispatch", "f32", 4,
            mul3(x, slots, nscale, 1), HEP_ARENA_LOCAL, 1);
    add(x, HEP_BUF_D_GROUP_TOKEN, "dispatch.rdma_inter_node_group_token", "dispatch", tok, esize,
        mul3(x, slots, H, 1), HEP_ARENA_LOCAL, 1);
    add(x, HEP_BUF_D_GROUP_FLAGS, "dispatch.rdma_inter_node_group_flags", "dispatch", "u64", 8,
        fw, HEP_ARENA_LOCAL, 1);
    add(x, HEP_BUF_D_GROUP_PROB, "dispatch.rdma_inter_node_group_prob", "dispatch", "i32+f32",
        4, mul3(x, slots, route, 1), HEP_ARENA_LOCAL, 1);
    if (fp8)
        add(x, HEP_BUF_D_GROUP_SCALE, "dispatch.rdma_inter_node_group_scaling_factor", "dispatch",
            "f32", 4, mul3(x, slots, nscale, 1), HEP_ARENA_LOCAL, 1);
    /* The peer's pre-reduced partial sums reuse its dispatch receive slots: a slot is free
     * once dispatch has forwarded it, and the next dispatch comes after this combine. */
    add(x, HEP_BUF_C_RED_TOKEN, "combine.rdma_intra_node_red_token", "combine", "bf16", 2,
        mul3(x, slots, H, 1), HEP_ARENA_LOCAL, 1);
    add(x, HEP_BUF_C_RED_PROB, "combine.rdma_intra_node_red_prob", "combine", "f32", 4,
        mul3(x, slots, Enode, 1), HEP_ARENA_LOCAL, 1);
    add(x, HEP_BUF_C_GROUP_TOKEN, "combine.rdma_inter_node_group_token", "combine", "bf16", 2,
        mul3(x, slots, H, 1), HEP_ARENA_LOCAL, 1);
    add(x, HEP_BUF_C_GROUP_FLAGS, "combine.rdma_inter_node_group_flags", "combine", "u64", 8, cfw,
        HEP_ARENA_LOCAL, 1);
    add(x, HEP_BUF_C_GROUP_PROB, "combine.rdma_inter_node_group_prob", "combine", "f32", 4,
        mul3(x, slots, Enode, 1), HEP_ARENA_LOCAL, 1);
    add(x, HEP_BUF_C_OUT_FLAGS, "combine.attn_output_flags", "combine", "u64", 8, cfw,
        HEP_ARENA_LOCAL, 1);
    /* The send staging is read (by the NIC) during dispatch only; the combine receive
     * slots are written (by the peers) during combine only, and slot j of both is node j's:
     * peer j writes its partial sums only after it received all of slot j. */
    /* Only where slot j is the same bytes in both (BF16 rows: T x 2H each). FP8 dispatch
     * slots are T x H: slot j of one lies inside slot j / 2 of the other, another node's,
     * and the node-by-node ordering above no longer holds. Seen (HEP_DEBUG_JITTER_US, 8 x 1
     * nodes, FP8): node 3 wrote its partial sums of call e + 1 into the bytes of the send
     * staging for node 7 before the proxy had sent them; so FP8 keeps its own buffers. */
    if (esize == 2) {
        p->buf[HEP_BUF_D_ATTN_TOKEN].alias_of = HEP_BUF_C_GROUP_TOKEN;
        p->buf[HEP_BUF_C_RED_TOKEN].alias_of = HEP_BUF_D_GROUP_TOKEN;
    }
}

/* GPU, N > 1: whether the send staging, the receive slots and the partial sums, T BF16 rows
 * a node each, fit HEP_GPU_WHOLE_SLOT_BYTES: the default ring then holds the whole slot. */
static int gpu_whole_slot(const hep_config *cfg, int nodes)
{
    return cfg->backend != HEP_BACKEND_HOST && nodes > 1 &&
           3.0 * (nodes - 1) * (double)cfg->max_tokens * 2.0 * (double)cfg->hidden <=
               (double)HEP_GPU_WHOLE_SLOT_BYTES;
}

/* The inter-node slots' ring, on both backends: chunks of C = config.chunk_tokens tokens
 * (HEP_CHUNK_DEFAULT: the backend's default; 0: one chunk of T), HEP_RING_POSITIONS of
 * them, or fewer where they cover T. */
int hep_chunk_default(const hep_config *cfg, int nodes)
{
    int c;
    if (cfg->backend == HEP_BACKEND_HOST)
        return HEP_CHUNK_DEFAULT_HOST;
    /* while the slots fit, HEP_RING_POSITIONS chunks of T / HEP_RING_POSITIONS (the ring
     * holds the slot: no credit is waited for, and chunk 0 travels while the next ones are
     * packed) */
    if (gpu_whole_slot(cfg, nodes))
        return (cfg->max_tokens + HEP_RING_POSITIONS - 1) / HEP_RING_POSITIONS;
    c = nodes > 1 ? HEP_CHUNK_GPU_RING_TOKENS / (nodes - 1) : HEP_CHUNK_DEFAULT_GPU;
    return c < 8 ? 8 : c > HEP_CHUNK_DEFAULT_GPU ? HEP_CHUNK_DEFAULT_GPU : c;
}

static void ring_shape(const hep_config *c, hep_plan *p)
{
    const int T = c->max_tokens;
    const int want = c->chunk_tokens != HEP_CHUNK_DEFAULT
                         ? c->chunk_tokens
                         : hep_chunk_default(c, p->nodes);
    const int C = want > 0 && want < T ? want : T;
    const int need = (T + C - 1) / C;
    p->chunk = C;
    p->ring = need < HEP_RING_POSITIONS ? need : HEP_RING_POSITIONS;
    p->slot_tokens = (size_t)p->ring * (size_t)C;
    p->cchunk = p->chunk;
    p->cring = p->ring;
    /* The GPU's default whole slot: combine cuts the same rows into HEP_COMBINE_CHUNKS
     * chunks of ceil(T / HEP_COMBINE_CHUNKS), whose owners start summing sooner, where they
     * fit the slot (4 x ceil(T / 4) rows exceed the 2 x ceil(T / 2) of T % 4 = 1 or 2: the
     * last chunk's extent would run past the slot). Still one position a chunk, so no
     * credit is waited for. Any other ring keeps one shape for both phases. */
    if (c->chunk_tokens == HEP_CHUNK_DEFAULT && gpu_whole_slot(c, p->nodes) &&
        p->slot_tokens >= (size_t)T) {
        const int cc = (T + HEP_COMBINE_CHUNKS - 1) / HEP_COMBINE_CHUNKS;
        const int cn = (T + cc - 1) / cc;
        if ((size_t)cn * (size_t)cc <= p->slot_tokens) {
            p->cchunk = cc;
            p->cring = cn;
        }
    }
}

int hep_plan_make(const hep_config *c, int nodes, int ranks_per_node, hep_plan *p)
{
    plan_ctx x = {p, 0};
    size_t W, T, H, El, rows, nscale, esize;
    int rc;

    if (!p)
        return hep_fail(HEP_ERR_INVALID, "plan output is NULL");
    memset(p, 0, sizeof(*p));
    if (!c)
        return hep_fail(HEP_ERR_INVALID, "config is NULL");
    if ((rc = range("backend", c->backend, 0, 1, "0 = GPU, 1 = host")) ||
        (rc = check_shape(c, nodes, ranks_per_node)))
        return rc;
    rc = hep_config_check(c, nodes * ranks_per_node);
    if (rc)
        return rc;
    if (c->ranks_per_node && c->ranks_per_node != ranks_per_node)
        return hep_fail(HEP_ERR_INVALID, "plan: config.ranks_per_node = %d but %d given",
                        c->ranks_per_node, ranks_per_node);
    p->nodes = nodes;
    p->ranks_per_node = ranks_per_node;
    p->world = nodes * ranks_per_node;
    W = (size_t)p->world;
    T = (size_t)c->max_tokens;
    H = (size_t)c->hidden;
    El = (size_t)c->experts_per_rank;
    /* the capacity, or the worst case: every token of every rank chooses this rank */
    rows = c->max_recv_rows ? (size_t)c->max_recv_rows : W * T;
    p->max_recv_rows = rows;
    nscale = H / HEP_FP8_BLOCK;
    esize = c->dtype == HEP_DTYPE_FP8_E4M3 ? 1 : 2;
    ring_shape(c, p);
    /* 16 words, [W] arrivals of the GPU kernels, [W] spare, then (host backend) per
     * node-mate l and other node's slot s the chunks of l's ring for s this rank read */
    p->flag_words = 16 + 2 * W + (size_t)ranks_per_node * (size_t)(nodes - 1);

    /* dispatch writes H x esize bytes a row; combine reads H x 2 bytes a row, same bytes */
    add(&x, HEP_BUF_TOKEN_X, "exchange.token", "both", "bf16", 2, mul3(&x, rows, H, 1),
        HEP_ARENA_SHARED, 0);
    add(&x, HEP_BUF_RECV_PROB, "dispatch.recv_prob", "dispatch", "f32", 4, mul3(&x, rows, El, 1),
        HEP_ARENA_SHARED, 0);
    if (esize == 1)
        add(&x, HEP_BUF_RECV_SCALE, "dispatch.recv_scaling_factor", "dispatch", "f32", 4,
            mul3(&x, rows, nscale, 1), HEP_ARENA_SHARED, 0);
    add(&x, HEP_BUF_COUNTS, "sync.counts", "both", "i32", 4, mul3(&x, 2, W, El + 1),
        HEP_ARENA_SHARED, 0);
    add(&x, HEP_BUF_FLAGS, "sync.flags", "both", "u64", 8, p->flag_words, HEP_ARENA_SHARED, 0);
    /* 16 words of what a rank publishes, then one destroy mark per node-mate */
    add(&x, HEP_BUF_MAILBOX, "sync.mailbox", "both", "u64", 8, 16 + (size_t)ranks_per_node,
        HEP_ARENA_SHARED, 0);
    /* [node][T][R] position at each node-mate of the tokens this rank forwards (its own,
     * then those received from each other node), then [T][N] each own token's position in
     * the slot of each node, then [132][N] per-block node counts */
    if (c->backend != HEP_BACKEND_HOST) /* the kernels' layout (the host backend pulls) */
        add(&x, HEP_BUF_HANDLE_ROWS, "handle.dest_rows", "both", "i32", 4,
            mul3(&x, T, W, 1) + mul3(&x, T, (size_t)nodes, 1) + 132 * (size_t)nodes,
            HEP_ARENA_LOCAL, 0);
    add(&x, HEP_BUF_HANDLE_META, "handle.meta", "both", "i32", 4, 4 * W + El + 24 + HEP_WORK_WORDS,
        HEP_ARENA_LOCAL, 0);
    /* [N][132 blocks][R] the scan's block counts; across nodes then the pack's scratch:
     * [T][N][R] each own token's offset among this rank's tokens for each (node, local
     * rank), [132 blocks][N][R] the pack blocks' counts of them, [N][T] the own token at
     * each row of each node's slot, the ring counters of both phases, and for the
     * expert-major layout [T][kmax] each own slot's place on its expert and [132 blocks]
     * [W El] the pack blocks' counts per expert */
    if (c->backend != HEP_BACKEND_HOST)
        add(&x, HEP_BUF_HANDLE_BLOCKS, "handle.block_counts", "dispatch", "i32", 4,
            132 * W + (nodes > 1 ? mul3(&x, T, W, 1) + 132 * W + mul3(&x, T, (size_t)nodes, 1) +
                                       HEP_RING_CTR_WORDS((size_t)nodes) +
                                       mul3(&x, T, (size_t)c->max_topk, 1) + 132 * W * El
                                 : 0),
            HEP_ARENA_LOCAL, 0);
    add(&x, HEP_BUF_DIAG, "diag.timeout_record", "both", "byte", 1, 4096, HEP_ARENA_MAPPED, 0);
    add(&x, HEP_BUF_HOST_COUNTS, "host.recv_counts", "dispatch", "i32", 4, El + 1,
        HEP_ARENA_PINNED, 0);
    if (c->backend == HEP_BACKEND_HOST) /* what combine reads back (not the caller's ids) */
        add(&x, HEP_BUF_HANDLE_IDS, "handle.topk_idx", "both", "i32", 4,
            mul3(&x, T, (size_t)c->max_topk, 1), HEP_ARENA_LOCAL, 0);
    if (c->backend != HEP_BACKEND_HOST && c->max_permuted_rows > 0) {
        /* the expert-major staging across processes: dispatch lands [rows, H] rows (esize
         * bytes a channel) here, combine [rows, H] BF16 expert outputs (2 bytes a channel),
         * so a row has 2 H bytes, as exchange.token */
        const size_t er = (size_t)c->max_permuted_rows;
        p->max_permuted_rows = er;
        add(&x, HEP_BUF_EM_TOKEN, "expert_major.token", "both", "bf16", 2, mul3(&x, er, H, 1),
            HEP_ARENA_SHARED, 0);
        add(&x, HEP_BUF_EM_PROB, "expert_major.prob", "both", "f32", 4, er, HEP_ARENA_SHARED, 0);
        if (esize == 1)
            add(&x, HEP_BUF_EM_SCALE, "expert_major.scaling_factor", "dispatch", "f32", 4,
                mul3(&x, er, nscale, 1), HEP_ARENA_SHARED, 0);
    }
    if (nodes > 1) {
        if (c->backend != HEP_BACKEND_HOST) /* the kernels' words to the proxy (the host
                                               backend's are in its flags buffers) */
            add(&x, HEP_BUF_PROXY, "proxy.ready_counters", "both", "u64", 8,
                2 * (size_t)nodes * HEP_PX_NODE_WORDS, HEP_ARENA_MAPPED, 0);
        plan_internode(&x, c, esize, nscale);
    }
    place(&x);
    if (x.overflow) {
        memset(p, 0, sizeof(*p));
        return hep_fail(HEP_ERR_INVALID, "plan: buffer sizes overflow size_t");
    }
    return HEP_OK;
}

const char *hep_arena_name(int arena)
{
    static const char *const n[] = {"device, IPC-shared", "device, local", "host-mapped",
                                    "pinned host"};
    return arena >= 0 && arena < HEP_ARENA_COUNT ? n[arena] : "?";
}
