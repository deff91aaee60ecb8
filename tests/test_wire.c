/* The GPU path's proxy batch (backend/wire.c, hep_wire_gpu_batch) against the kernels'
 * protocol (kernels/ep_kernels.h, kernels/ring.cuh), without a GPU or a NIC: a fake set of
 * registrations, then every chunk of a dispatch and a combine batch checked for its peer,
 * its bounds inside the registered buffers (local and remote), its ready word among the
 * proxy's words of its (phase, node), and for the rings: chunk k from position k % P of
 * the slot, wanted at HEP_RING_VAL(e, k + 1), skipped by the ring's skip word, and the
 * credits after every flag, as many as the ring could need. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "backend/backend.h"
#include "kernels/ep_kernels.h"
#include "layout/plan.h"
#include "net/coordinator.h"
#include "net/proxy.h"

#define LBASE 0x100000000ull
#define RBASE(peer) (0x200000000ull * (uint64_t)((peer) + 1))
#define LKEY(i) (1000u + (uint32_t)(i))
#define RKEY(peer, i) (2000u + 100u * (uint32_t)(peer) + (uint32_t)(i))

typedef struct wire_fixture {
    hep_config cfg;
    hep_plan plan;
    hep_coord coord;
    char *arenas[HEP_ARENA_COUNT];
    hep_backend_ctx g;
    hep_proxy_chunk *ch;
    const uint64_t *px0;
} wire_fixture;

static void wire_setup(wire_fixture *f, int N, int R, int node, int local, int T, int chunk,
                       hep_dtype dt)
{
    memset(f, 0, sizeof(*f));
    hep_config_default(&f->cfg);
    f->cfg.hidden = dt == HEP_DTYPE_FP8_E4M3 ? 256 : 64;
    f->cfg.max_tokens = T;
    f->cfg.experts_per_rank = 3;
    f->cfg.max_topk = 4;
    f->cfg.dtype = dt;
    f->cfg.ranks_per_node = R;
    f->cfg.chunk_tokens = chunk;
    assert_int_equal(hep_plan_make(&f->cfg, N, R, &f->plan), HEP_OK);
    for (int i = 0; i < HEP_RDMA_BUF_COUNT; i++) {
        const hep_plan_buffer *b = &f->plan.buf[HEP_FIRST_RDMA_BUF + i];
        f->coord.mr[i].addr = LBASE + b->offset;
        f->coord.mr[i].length = b->bytes;
        f->coord.mr[i].lkey = LKEY(i);
    }
    f->coord.world = N * R;
    f->coord.remote = calloc((size_t)(N * R) * HEP_RDMA_BUF_COUNT, sizeof(hep_remote_buf));
    assert_non_null(f->coord.remote);
    for (int r = 0; r < N * R; r++)
        for (int i = 0; i < HEP_RDMA_BUF_COUNT; i++) {
            hep_remote_buf *x = &f->coord.remote[(size_t)r * HEP_RDMA_BUF_COUNT + (size_t)i];
            x->addr = RBASE(r) + f->plan.buf[HEP_FIRST_RDMA_BUF + i].offset;
            x->length = f->plan.buf[HEP_FIRST_RDMA_BUF + i].bytes;
            x->rkey = RKEY(r, i);
        }
    f->arenas[HEP_ARENA_MAPPED] = calloc(1, f->plan.arena_bytes[HEP_ARENA_MAPPED]);
    assert_non_null(f->arenas[HEP_ARENA_MAPPED]);
    f->px0 = (const uint64_t *)(f->arenas[HEP_ARENA_MAPPED] + f->plan.buf[HEP_BUF_PROXY].offset);
    f->g.cfg = &f->cfg;
    f->g.plan = &f->plan;
    f->g.coord = &f->coord;
    f->g.arena = f->arenas;
    f->g.R = R, f->g.N = N, f->g.node = node, f->g.local = local;
    f->g.rank = node * R + local, f->g.world = N * R;
    f->ch = calloc(hep_wire_gpu_batch_max(&f->g), sizeof(*f->ch));
    assert_non_null(f->ch);
}

static void wire_teardown(wire_fixture *f)
{
    free(f->ch);
    free(f->coord.remote);
    free(f->arenas[HEP_ARENA_MAPPED]);
}

/* The buffer of a registration key, local or of `peer`. */
static int buf_of_lkey(uint32_t key)
{
    assert_true(key >= LKEY(0) && key < LKEY(HEP_RDMA_BUF_COUNT));
    return HEP_FIRST_RDMA_BUF + (int)(key - LKEY(0));
}
static int buf_of_rkey(int peer, uint32_t key)
{
    assert_true(key >= RKEY(peer, 0) && key < RKEY(peer, HEP_RDMA_BUF_COUNT));
    return HEP_FIRST_RDMA_BUF + (int)(key - RKEY(peer, 0));
}

/* [addr, addr + len) lies in buffer b: its offset there. */
static size_t inside(const wire_fixture *f, uint64_t base, int b, uint64_t addr, size_t len)
{
    const size_t bytes = f->plan.buf[b].bytes;
    assert_true(f->plan.buf[b].present);
    assert_true(addr >= base + f->plan.buf[b].offset);
    const size_t off = (size_t)(addr - base - f->plan.buf[b].offset);
    assert_true(off <= bytes && len <= bytes - off);
    return off;
}

/* Every chunk's bounds, peer and ready word; returns the number of credits, and checks
 * that they come after every flag. */
static int check_common(const wire_fixture *f, int phase, int n)
{
    const hep_backend_ctx *g = &f->g;
    int credits = 0, last_flag = -1, first_credit = n;
    for (int i = 0; i < n; i++) {
        const hep_proxy_chunk *c = &f->ch[i];
        const int m = c->peer / g->R;
        const uint64_t *px = f->px0 + HEP_PX_WORD(g->N, phase, m);
        assert_int_equal(c->peer % g->R, g->local);
        assert_true(m != g->node && m < g->N);
        assert_true((const uint64_t *)c->ready >= px &&
                    (const uint64_t *)c->ready < px + HEP_PX_NODE_WORDS);
        if (c->len) {
            (void)inside(f, LBASE, buf_of_lkey(c->lkey), c->laddr, c->len);
            (void)inside(f, RBASE(c->peer), buf_of_rkey(c->peer, c->rkey), c->raddr, c->len);
        }
        if (c->flag) {
            const int lb = buf_of_lkey(c->flag_lkey), rb = buf_of_rkey(c->peer, c->flag_rkey);
            assert_true(lb == (phase ? HEP_BUF_C_OUT_FLAGS : HEP_BUF_D_ATTN_FLAGS));
            assert_true(rb == (phase ? HEP_BUF_C_GROUP_FLAGS : HEP_BUF_D_GROUP_FLAGS));
            (void)inside(f, LBASE, lb, c->flag_laddr, 8);
            (void)inside(f, RBASE(c->peer), rb, c->flag_raddr, 8);
            last_flag = i;
        }
        if ((const uint64_t *)c->ready == px + HEP_PX_CREDIT) {
            credits++;
            if (first_credit == n)
                first_credit = i;
        }
    }
    assert_true(last_flag < first_credit); /* a flag never waits behind a credit */
    return credits;
}

/* The ring chunks of a batch: each data chunk k to node m from position k % P of the
 * local slot j(m) to the same position of the peer's slot s, wanted and skipped at chunk
 * k's values; each flag after its data. */
static void check_ring(const wire_fixture *f, int phase, int n, uint64_t e, int kout, int em)
{
    const hep_backend_ctx *g = &f->g;
    /* the phase's ring over the slots: combine's may have more, smaller chunks */
    const size_t ST = f->plan.slot_tokens;
    const size_t C = (size_t)(phase ? f->plan.cchunk : f->plan.chunk);
    const size_t P = (size_t)(phase ? f->plan.cring : f->plan.ring);
    const size_t N = (size_t)g->N;
    const size_t cb = HEP_COUNT_BLOCK_WORDS((size_t)g->R, (size_t)f->cfg.experts_per_rank);
    int k = 0, mprev = -1, data = 0, flags = 0, places = 0;
    for (int i = 0; i < n; i++) {
        const hep_proxy_chunk *c = &f->ch[i];
        const int m = c->peer / g->R;
        const uint64_t *px = f->px0 + HEP_PX_WORD(g->N, phase, m);
        const size_t j = (size_t)hep_slot_of(m, g->node), s = (size_t)hep_slot_of(g->node, m);
        if (m != mprev)
            k = 0, mprev = m;
        if (c->desc) { /* a ring data chunk: position k % P */
            const size_t p = (size_t)k % P;
            assert_ptr_equal(c->ready, px + HEP_PX_RING + 3 * p);
            assert_ptr_equal(c->desc, px + HEP_PX_RING + 3 * p + 1);
            assert_true(c->want == HEP_RING_VAL(e, k + 1));
            assert_ptr_equal(c->skip, px + HEP_PX_RING_SKIP);
            assert_true(c->skip_want == HEP_RING_SKIP(e, k));
            assert_true(c->len == C * c->unit);
            const int lb = buf_of_lkey(c->lkey), rb = buf_of_rkey(c->peer, c->rkey);
            const size_t lo = inside(f, LBASE, lb, c->laddr, c->len);
            const size_t ro = inside(f, RBASE(c->peer), rb, c->raddr, c->len);
            if (lb == HEP_BUF_D_ATTN_TOKEN || lb == HEP_BUF_C_RED_TOKEN ||
                lb == HEP_BUF_C_RED_PROB || lb == HEP_BUF_D_ATTN_SCALE) {
                /* rows: slot j's position p here, slot s's position p there */
                assert_int_equal(lo, (j * ST + p * C) * c->unit);
                assert_int_equal(ro, (s * ST + p * C) * c->unit);
            } else { /* the routing: [ST][kmax] ids, [ST][kmax] weights, [ST][R] offsets,
                      * [ST][kmax] expert-major places; position p of each */
                const size_t K = (size_t)f->cfg.max_topk, R = (size_t)g->R;
                const size_t rs = ST * HEP_GPU_ROUTE_WORDS(K, R) * 4, o = lo % rs;
                assert_int_equal(lb, HEP_BUF_D_ATTN_PROB);
                assert_int_equal(lo / rs, j);
                assert_int_equal(ro / rs, s);
                assert_int_equal(o, ro % rs);
                if (o == (2 * ST * K + ST * R + p * C * K) * 4 && c->unit == K * 4)
                    places++;
                else
                    assert_true(o == p * C * K * 4 || o == (ST + p * C) * K * 4 ||
                                o == (2 * ST * K + p * C * R) * 4);
            }
            data++;
        } else if (c->flag && c->want) { /* chunk k's flag: flag source (m, p) -> landed s */
            const size_t p = (size_t)k % P;
            assert_true(c->fence);
            assert_ptr_equal(c->ready, px + HEP_PX_RING + 3 * p);
            assert_true(c->want == HEP_RING_VAL(e, k + 1));
            assert_true(c->skip_want == HEP_RING_SKIP(e, k));
            assert_int_equal(inside(f, LBASE, buf_of_lkey(c->flag_lkey), c->flag_laddr, 8),
                             HEP_RING_SRC_WORD(N, cb, (size_t)m, p, P) * 8);
            assert_int_equal(inside(f, RBASE(c->peer), buf_of_rkey(c->peer, c->flag_rkey),
                                    c->flag_raddr, 8),
                             (HEP_RING_WORD(N, cb) + s) * 8);
            assert_true(i > 0 && f->ch[i - 1].desc); /* after its data */
            k++;
            flags++;
        }
    }
    assert_int_equal(flags, (int)(N - 1) * kout);
    assert_int_equal(places, em ? (int)(N - 1) * kout : 0); /* one a chunk, expert-major */
    (void)data;
}

/* The credits of the rings received: k = 0.. of the ring from each node m, from this
 * rank's credit source for slot j(m) to m's credit word for this node. */
static void check_credits(const wire_fixture *f, int phase, int n, uint64_t e, int per_node)
{
    const hep_backend_ctx *g = &f->g;
    const size_t N = (size_t)g->N;
    const size_t B = HEP_RING_WORD(N, HEP_COUNT_BLOCK_WORDS((size_t)g->R,
                                                           (size_t)f->cfg.experts_per_rank));
    int k = 0, mprev = -1, seen = 0;
    for (int i = 0; i < n; i++) {
        const hep_proxy_chunk *c = &f->ch[i];
        const int m = c->peer / g->R;
        const uint64_t *px = f->px0 + HEP_PX_WORD(g->N, phase, m);
        if ((const uint64_t *)c->ready != px + HEP_PX_CREDIT)
            continue;
        if (m != mprev)
            k = 0, mprev = m;
        assert_int_equal(buf_of_lkey(c->lkey), phase ? HEP_BUF_C_GROUP_FLAGS : HEP_BUF_D_GROUP_FLAGS);
        assert_int_equal(buf_of_rkey(c->peer, c->rkey), phase ? HEP_BUF_C_OUT_FLAGS : HEP_BUF_D_ATTN_FLAGS);
        assert_int_equal(inside(f, LBASE, buf_of_lkey(c->lkey), c->laddr, 8),
                         (B + N + (size_t)hep_slot_of(m, g->node)) * 8);
        assert_int_equal(inside(f, RBASE(c->peer), buf_of_rkey(c->peer, c->rkey), c->raddr, 8),
                         (B + (size_t)g->node) * 8);
        assert_int_equal(c->len, 8);
        assert_false(c->flag || c->fence);
        assert_true(c->want == HEP_RING_VAL(e, k + 1));
        assert_ptr_equal(c->skip, px + HEP_PX_CREDIT_SKIP);
        assert_true(c->skip_want == HEP_RING_SKIP(e, k));
        k++;
        seen++;
    }
    assert_int_equal(seen, (int)(N - 1) * per_node);
}

static int chunks(int t, int C)
{
    return (t + C - 1) / C;
}

/* Dispatch: per other node the count, the count block (with its flag), ceil(t / C) ring
 * chunks of rows, ids, weights, offsets (the expert-major layout: and places; FP8: and
 * scales) each with its flag, the final count and flag; then per other node
 * ceil(T / C) - P credits. */
static void wire_dispatch_batch_holds_the_kernels_ring_chunks_and_credits(void **state)
{
    static const struct { int N, R, node, local, T, chunk, t, em; hep_dtype dt; } cases[] = {
        {3, 2, 1, 1, 100, 32, 70, 0, HEP_DTYPE_BF16},
        {3, 2, 0, 0, 100, 32, 100, 1, HEP_DTYPE_FP8_E4M3},
        {2, 4, 1, 3, 100, 32, 0, 0, HEP_DTYPE_BF16},
        {4, 1, 2, 0, 64, 1, 64, 1, HEP_DTYPE_BF16},
        {4, 1, 2, 0, 64, 1, 64, 0, HEP_DTYPE_BF16},
        {2, 2, 0, 1, 100, 0, 37, 0, HEP_DTYPE_FP8_E4M3},
        {2, 4, 1, 2, 100, 3, 100, 1, HEP_DTYPE_BF16},
        {5, 2, 4, 0, 96, 48, 96, 0, HEP_DTYPE_BF16},
        /* the GPU's default whole slot: dispatch's 2 chunks of 50 (of 49 at T = 98) */
        {3, 2, 1, 0, 100, HEP_CHUNK_DEFAULT, 77, 0, HEP_DTYPE_BF16},
        {2, 2, 0, 1, 98, HEP_CHUNK_DEFAULT, 98, 1, HEP_DTYPE_FP8_E4M3}};
    (void)state;
    for (size_t q = 0; q < sizeof(cases) / sizeof(cases[0]); q++) {
        static wire_fixture f;
        const uint64_t e = 7 + q;
        wire_setup(&f, cases[q].N, cases[q].R, cases[q].node, cases[q].local, cases[q].T,
                   cases[q].chunk, cases[q].dt);
        const int C = f.plan.chunk, P = f.plan.ring, fp8 = cases[q].dt == HEP_DTYPE_FP8_E4M3;
        const int kout = chunks(cases[q].t, C), kin = chunks(cases[q].T, C);
        const int em = cases[q].em;
        const int n = hep_wire_gpu_batch(&f.g, 0, e, cases[q].t, em, f.ch);
        assert_true((size_t)n <= hep_wire_gpu_batch_max(&f.g));
        assert_int_equal(n, (cases[q].N - 1) * (3 + kout * (5 + fp8 + em) + kin - P));
        assert_int_equal(check_common(&f, 0, n), (cases[q].N - 1) * (kin - P));
        check_ring(&f, 0, n, e, kout, em);
        check_credits(&f, 0, n, e, kin - P);
        f.g.hold_credits = 1; /* the test hook: a receiver that returns no credit */
        assert_int_equal(hep_wire_gpu_batch(&f.g, 0, e, cases[q].t, em, f.ch),
                         (cases[q].N - 1) * (3 + kout * (5 + fp8 + em)));
        wire_teardown(&f);
    }
}

/* Combine: per other node the arrival word, ceil(T / C) ring chunks of partial sums (and
 * probabilities) each with its flag, the final count and flag; then per other node
 * ceil(t / C) - P credits for the partial sums of this rank's t tokens. */
static void wire_combine_batch_holds_the_kernels_ring_chunks_and_credits(void **state)
{
    static const struct { int N, R, node, local, T, chunk, t, probs; } cases[] = {
        {3, 2, 1, 0, 100, 32, 70, 1}, {2, 4, 0, 2, 100, 32, 100, 0}, {4, 2, 3, 1, 64, 1, 5, 1},
        {2, 2, 1, 1, 100, 0, 0, 0},   {3, 1, 0, 0, 96, 48, 96, 1},
        /* the GPU's default whole slot: combine's 4 chunks of 25 (2 of 49 at T = 98) */
        {3, 2, 1, 0, 100, HEP_CHUNK_DEFAULT, 77, 1}, {2, 2, 0, 1, 99, HEP_CHUNK_DEFAULT, 99, 0},
        {2, 2, 1, 1, 98, HEP_CHUNK_DEFAULT, 60, 1}};
    (void)state;
    for (size_t q = 0; q < sizeof(cases) / sizeof(cases[0]); q++) {
        static wire_fixture f;
        const uint64_t c = 3 + q;
        wire_setup(&f, cases[q].N, cases[q].R, cases[q].node, cases[q].local, cases[q].T,
                   cases[q].chunk, HEP_DTYPE_BF16);
        const int C = f.plan.cchunk, P = f.plan.cring;
        const int kin = chunks(cases[q].T, C), kc = chunks(cases[q].t, C) - P;
        const int n = hep_wire_gpu_batch(&f.g, 1, c, cases[q].t, cases[q].probs, f.ch);
        assert_true((size_t)n <= hep_wire_gpu_batch_max(&f.g));
        assert_int_equal(n, (cases[q].N - 1) * (2 + kin * (2 + cases[q].probs) +
                                                (kc > 0 ? kc : 0)));
        assert_int_equal(check_common(&f, 1, n), (cases[q].N - 1) * (kc > 0 ? kc : 0));
        check_ring(&f, 1, n, c, kin, 0);
        check_credits(&f, 1, n, c, kc > 0 ? kc : 0);
        wire_teardown(&f);
    }
}

/* The GPU's default whole slot, one slot of T rows per other node: dispatch's ring has 2
 * chunks of ceil(T / 2), combine's over the same rows 4 of ceil(T / 4) where they fit it
 * (T = 100: 2 x 50 and 4 x 25 rows); at T = 98, 4 x 25 rows would run past the slot's 98,
 * so combine keeps 2 x 49. Either way no credit (every chunk has its own position). */
static void wire_combine_takes_its_own_chunks_of_the_whole_slot(void **state)
{
    static const struct { int T, dchunk, dring, cchunk, cring; } cases[] = {
        {100, 50, 2, 25, 4}, {99, 50, 2, 25, 4}, {98, 49, 2, 49, 2}};
    (void)state;
    for (size_t q = 0; q < sizeof(cases) / sizeof(cases[0]); q++) {
        static wire_fixture f;
        const int T = cases[q].T;
        wire_setup(&f, 2, 2, 1, 0, T, HEP_CHUNK_DEFAULT, HEP_DTYPE_BF16);
        assert_int_equal(f.plan.chunk, cases[q].dchunk);
        assert_int_equal(f.plan.ring, cases[q].dring);
        assert_int_equal(f.plan.cchunk, cases[q].cchunk);
        assert_int_equal(f.plan.cring, cases[q].cring);
        assert_int_equal(f.plan.slot_tokens, (size_t)(cases[q].dchunk * cases[q].dring));
        for (int phase = 0; phase < 2; phase++) {
            const int C = phase ? cases[q].cchunk : cases[q].dchunk;
            const int P = phase ? cases[q].cring : cases[q].dring;
            const int lb = phase ? HEP_BUF_C_RED_TOKEN : HEP_BUF_D_ATTN_TOKEN;
            const size_t rb = (size_t)f.cfg.hidden * 2;
            const int n = hep_wire_gpu_batch(&f.g, phase, 5, T, 0, f.ch);
            int k = 0;
            assert_true((size_t)n <= hep_wire_gpu_batch_max(&f.g));
            /* dispatch: count, count block, 4 rows' chunks and a flag a chunk, final flag;
             * combine: arrival, the rows and a flag a chunk, final flag; no credits */
            assert_int_equal(n, phase ? 2 + 2 * P : 3 + 5 * P);
            assert_int_equal(check_common(&f, phase, n), 0);
            check_ring(&f, phase, n, 5, P, 0);
            for (int i = 0; i < n; i++) { /* the token rows: chunk k at row k C, C rows */
                const hep_proxy_chunk *c = &f.ch[i];
                if (!c->desc || buf_of_lkey(c->lkey) != lb)
                    continue;
                assert_int_equal(inside(&f, LBASE, lb, c->laddr, c->len), (size_t)k * C * rb);
                assert_int_equal(c->len, (size_t)C * rb);
                k++;
            }
            assert_int_equal(k, P);
        }
        wire_teardown(&f);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(wire_dispatch_batch_holds_the_kernels_ring_chunks_and_credits),
        cmocka_unit_test(wire_combine_batch_holds_the_kernels_ring_chunks_and_credits),
        cmocka_unit_test(wire_combine_takes_its_own_chunks_of_the_whole_slot),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
