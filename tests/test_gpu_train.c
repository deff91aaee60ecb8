/* The training API on the GPU backend (one node) against the host backend, bit for bit:
 * caller handles recorded, reused (HEP_REUSE_LAYOUT with new tokens) and combined in an
 * interleaved order, one of them twice; outputs in caller memory; probabilities through
 * combine; BF16 and FP8; the receive capacity exactly met, one row short on one rank
 * (HEP_ERR_OVERFLOW on every rank, no receive byte written), then fitting again; graph
 * capture of the no-sync mode with every replay checked; the no-sync mode past the
 * capacity, captured and replayed (the rows at or past it dropped on every rank that needs
 * more: the overflow words, the kept rows, counts and tokens per expert, a combine that sums
 * only the kept rows and probabilities 0 for the dropped ones, HEP_WARN_IGNORED from
 * hep_group_sync), then a blocking call that fits. The routing has repeated and
 * unused slots, an expert nobody chooses and a token on every expert of a rank. Across
 * 2 x 2 and 2 x 4 virtual nodes (the loopback NIC; the nodes_* cases): the one-shot
 * sequence with outputs in caller memory and the zero-copy view, and the handle sequence
 * with probabilities through combine, BF16 and FP8, int32 and int64 routing; the
 * expert-major handle sequence (pad 1, 16, 128, BF16 and FP8, a budget overflow, a reused
 * layout, a handle combined twice, with and without probabilities through combine); the
 * receive capacity (BF16 and FP8, rank-major and expert-major: exactly met, one row short:
 * HEP_ERR_OVERFLOW on every rank naming the rank and its rows, no receive byte written on
 * the node of the rank over it, in the group's buffer or the caller's, then dispatch and
 * combine again; the no-sync drop, the calls themselves since they
 * cannot be captured across nodes, against the host's drop element by element, once with
 * every node dropping and once with node 0 below the capacity, whose ranks get no
 * warning); what stays refused there is checked to be. Every run checks that the
 * GUARD_ROWS after the receive outputs in caller memory were never written. Without a GPU
 * it skips with the reason. HEP_GPU_TEST_SMALL=1 runs small shapes (compute-sanitizer).
 *
 * Each case runs the same per-rank sequence on a host-backend group and on a GPU group;
 * the host run goes first and its outputs are the oracle the GPU run is compared with. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>
#include <cuda_runtime_api.h>

#include "ep_case.h"
#include "fake_mr.h"
#include "group/group.h"
#include "ranks.h"
#include "test_filter.h"

#define MAXW 8
#define MAXT 256
#define KS 4
#define EL 3
#define STEPS 3 /* dispatches (A into hA, B into hB, A reused with new tokens) */
#define COMBS 3 /* combines (hA, hB, hA again) */

typedef struct tcase {
    hep_config cfg;
    int W, T, H, K, fp8, cap_mode; /* cap_mode: 0 none; 1 the capacity sequence; 2 the no-sync
                                   overflow sequence */
    int t[2][MAXW];
    int ids[2][MAXW][MAXT * KS];
    float w[2][MAXW][MAXT * KS];
    int cap, cap_rank; /* cap_mode: the capacity (= set 0's most rows) and the rank of it */
    int gpu, graph_replays;
    int lead; /* cap_mode 2: set 1 (fits) once before the dropping calls, unchecked */
    /* the expert-major layout: pad_multiple, the row budget of hA's and hB's dispatches
     * (every rank alike), the rows the recv buffers hold (the larger budget) */
    int em, pad, budget[2], em_rows;
    /* across virtual nodes (loopback NIC): R ranks per node (0: one node of W), int64
     * routing, the one-shot sequence instead of the handles', no probabilities through
     * combine (the one-shot sequence: its layout records no routing) */
    int R, idx64, oneshot, noprobs;
    /* outputs per rank (host memory): [0] host run, [1] GPU run */
    struct rout {
        int rc[16];
        char err[512];
        int nrecv[STEPS], counts[STEPS][1 + EL];
        int emw[STEPS][3];           /* expert-major: num_permuted, overflow, overflow_rows */
        int ovw[2][3];               /* cap_mode 2: overflow_device of steps 0 and 1 */
        long long tpe[STEPS][EL];    /* ... padded tokens per expert */
        unsigned char *rows[STEPS];
        float *probs[STEPS], *scales[STEPS];
        uint16_t *comb[COMBS];
        float *pout[COMBS];
        int bad;
        char msg[512];
    } out[2][MAXW];
} tcase;

static unsigned lcg(unsigned *s)
{
    *s = *s * 1664525u + 1013904223u;
    return *s >> 8;
}

static int small_only(void)
{
    const char *v = getenv("HEP_GPU_TEST_SMALL");
    return v && *v == '1';
}

static size_t rbytes(const tcase *c)
{
    return (size_t)c->H * (c->fp8 ? 1 : 2);
}

/* Set a: random slots, some -1, some repeated; rank 0's token 0 on every expert of rank 1;
 * nobody on expert 2 E_l + 1 (W > 2) or E_l - 1 (W = 2): an expert with no tokens. */
static void make_case(tcase *c, int W, int T, int H, int fp8, unsigned seed)
{
    const int empty = W > 2 ? 2 * EL + 1 : EL - 1;
    memset(c, 0, sizeof(*c));
    c->W = W, c->T = T, c->H = H, c->fp8 = fp8;
    c->K = W * EL < KS ? W * EL : KS; /* a lone rank's group has EL experts */
    c->cfg = test_config(H, T, EL, c->K, fp8 ? HEP_DTYPE_FP8_E4M3 : HEP_DTYPE_BF16);
    c->cfg.ranks_per_node = W;
    c->cfg.dispatch_sms = 4;
    c->cfg.combine_sms = 4;
    for (int a = 0; a < 2; a++)
        for (int r = 0; r < W; r++) {
            c->t[a][r] = a == 0 ? T - 3 * r : 3 + (int)(lcg(&seed) % (unsigned)(T - 3));
            for (int i = 0; i < T; i++)
                for (int k = 0; k < c->K; k++) {
                    unsigned u = lcg(&seed);
                    int x = u % 7 == 0 ? -1 : (int)(u % (unsigned)(W * EL));
                    if (k > 0 && u % 5 == 0)
                        x = c->ids[a][r][i * c->K + k - 1];
                    c->ids[a][r][i * c->K + k] = x == empty ? -1 : x;
                    c->w[a][r][i * c->K + k] = (float)(1 + lcg(&seed) % 64) / 64.0f;
                }
        }
    for (int k = 0; W > 1 && k < c->K; k++) /* rank 0's first token at rank 1 only */
        c->ids[0][0][k] = k < EL ? EL + k : -1;
}

/* Rows rank d needs for set a. */
static int need(const tcase *c, int a, int d)
{
    int n = 0;
    for (int s = 0; s < c->W; s++)
        for (int i = 0; i < c->t[a][s]; i++) {
            int hit = 0;
            for (int k = 0; k < c->K; k++)
                hit |= c->ids[a][s][i * c->K + k] / EL == d && c->ids[a][s][i * c->K + k] >= 0;
            n += hit;
        }
    return n;
}

/* The capacity sequence: set 0 needs exactly the capacity at its fullest rank; set 1 is
 * set 0 plus one token of rank 0 on that rank only (one row short). */
static void make_cap_case(tcase *c, int W, int T, int H, int fp8, unsigned seed)
{
    make_case(c, W, T - 1, H, fp8, seed);
    c->T = T;
    c->cfg.max_tokens = T;
    c->cap_mode = 1;
    c->cap = -1;
    for (int d = 0; d < W; d++)
        if (need(c, 0, d) > c->cap)
            c->cap = need(c, 0, d), c->cap_rank = d;
    c->cfg.max_recv_rows = c->cap;
    memcpy(c->ids[1], c->ids[0], sizeof(c->ids[0]));
    memcpy(c->w[1], c->w[0], sizeof(c->w[0]));
    memcpy(c->t[1], c->t[0], sizeof(c->t[0]));
    for (int k = 0; k < c->K; k++)
        c->ids[1][0][c->t[0][0] * c->K + k] = k == 0 ? c->cap_rank * EL : -1;
    c->t[1][0]++;
}

/* Expert-major rows rank d needs for set a with pad_multiple pad (padding included). */
static int need_em(const tcase *c, int a, int d, int pad);

/* The capacity sequence in the expert-major layout (pad_multiple pad): both budgets hold
 * every rank's rows of both sets, so only the receive capacity is exceeded. */
static void make_em_cap_case(tcase *c, int W, int T, int H, int fp8, int pad, unsigned seed)
{
    int most = 0;
    make_cap_case(c, W, T, H, fp8, seed);
    c->em = 1, c->pad = pad;
    for (int a = 0; a < 2; a++)
        for (int d = 0; d < W; d++)
            most = need_em(c, a, d, pad) > most ? need_em(c, a, d, pad) : most;
    c->budget[0] = c->budget[1] = c->em_rows = most;
}

/* The no-sync overflow sequence: set 0 (random) needs more than the capacity, two thirds
 * of its busiest rank's rows, on some ranks; set 1, the first tokens of set 0, fits.
 * thin > 0: the slots of set 0 on an expert of the first `thin` ranks (node 0 of virtual
 * nodes) are unused but in every third token, so that those ranks stay below the capacity. */
static void make_drop_case(tcase *c, int W, int T, int H, int fp8, int thin, unsigned seed)
{
    int most = 0, fits;
    make_case(c, W, T, H, fp8, seed);
    for (int r = 0; r < W; r++)
        for (int i = 0; thin && i < T * c->K; i++)
            if (c->ids[0][r][i] >= 0 && c->ids[0][r][i] < thin * EL && i / c->K % 3)
                c->ids[0][r][i] = -1;
    c->cap_mode = 2;
    for (int d = 0; d < W; d++)
        most = need(c, 0, d) > most ? need(c, 0, d) : most;
    c->cap = most * 2 / 3;
    c->cfg.max_recv_rows = c->cap;
    memcpy(c->ids[1], c->ids[0], sizeof(c->ids[0]));
    memcpy(c->w[1], c->w[0], sizeof(c->w[0]));
    for (int r = 0; r < W; r++)
        c->t[1][r] = c->t[0][r] / 3;
    do { /* fewer tokens until every rank fits */
        fits = 1;
        for (int d = 0; d < W; d++)
            fits &= need(c, 1, d) <= c->cap;
        for (int r = 0; !fits && r < W; r++)
            c->t[1][r] = c->t[1][r] * 3 / 4;
    } while (!fits);
}

/* Expert-major rows rank d needs for set a with pad_multiple pad (padding included). */
static int need_em(const tcase *c, int a, int d, int pad)
{
    int rows = 0;
    for (int e = 0; e < EL; e++) {
        int n = 0;
        for (int s = 0; s < c->W; s++)
            for (int i = 0; i < c->t[a][s]; i++) {
                int hit = 0;
                for (int k = 0; k < c->K; k++)
                    hit |= c->ids[a][s][i * c->K + k] == d * EL + e;
                n += hit;
            }
        rows += (n + pad - 1) / pad * pad;
    }
    return rows;
}

/* The expert-major case: set a into hA, b into hB with budget[0], budget[1] rows. over:
 * hA's budget holds about half of its busiest rank's rows (rows dropped on every rank
 * that needs more), hB's all of them. */
static void make_em_case(tcase *c, int W, int T, int H, int fp8, int pad, int over,
                         unsigned seed)
{
    int most[2] = {0, 0};
    make_case(c, W, T, H, fp8, seed);
    c->em = 1, c->pad = pad;
    for (int a = 0; a < 2; a++)
        for (int d = 0; d < W; d++) {
            int n = need_em(c, a, d, pad);
            most[a] = n > most[a] ? n : most[a];
        }
    c->budget[1] = most[0] > most[1] ? most[0] : most[1];
    c->budget[0] = over ? (most[0] / 2 + pad - 1) / pad * pad : c->budget[1];
    if (over && c->budget[0] >= most[0]) /* at least one row short on the busiest rank */
        c->budget[0] = most[0] - pad;
    if (c->budget[0] < pad)
        c->budget[0] = pad;
    c->em_rows = c->budget[1];
}

/* Token of (set, rank, i, byte): a BF16 or FP8 pattern that is a function of its inputs
 * (FP8: any byte but the NaN codes). */
static void fill_tokens(const tcase *c, int set, int r, unsigned char *p, float *sc)
{
    const int ns = c->H / 128;
    for (int i = 0; i < c->T; i++) {
        if (c->fp8) {
            for (int h = 0; h < c->H; h++)
                p[(size_t)i * c->H + h] = (unsigned char)((i * 7 + h * 3 + r * 11 + set * 5) % 126);
            for (int q = 0; q < ns; q++)
                sc[i * ns + q] = 0.5f + (float)(r * 100 + i + q + set * 1000);
        } else {
            for (int h = 0; h < c->H; h++)
                ((uint16_t *)p)[(size_t)i * c->H + h] =
                    bf16_of((float)((i * 7 + h * 3 + r * 11 + set * 5) % 200) - 50.0f);
        }
    }
}

/* The buffers of one rank, in host memory (host backend) or device memory (GPU). */
typedef struct mem {
    int gpu;
} mem;
static void *m_alloc(const mem *m, size_t n)
{
    void *p = NULL;
    n = n ? n : 16;
    if (!m->gpu)
        return calloc(1, n);
    if (cudaMalloc(&p, n) != cudaSuccess)
        return NULL;
    return cudaMemset(p, 0xff, n) == cudaSuccess ? p : NULL;
}
static void m_free(const mem *m, void *p)
{
    if (m->gpu)
        (void)cudaFree(p);
    else
        free(p);
}
static int m_put(const mem *m, void *dst, const void *src, size_t n)
{
    if (!m->gpu) {
        memcpy(dst, src, n);
        return 0;
    }
    return cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice) != cudaSuccess;
}
static int m_get_into(const mem *m, void *dst, const void *src, size_t n)
{
    if (!m->gpu) {
        memcpy(dst, src, n);
        return 0;
    }
    return cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost) != cudaSuccess;
}
static void *m_get(const mem *m, const void *src, size_t n)
{
    void *h = malloc(n ? n : 1);
    if (!h)
        return NULL;
    if (!m->gpu)
        memcpy(h, src, n);
    else if (cudaMemcpy(h, src, n, cudaMemcpyDeviceToHost) != cudaSuccess)
        memset(h, 0xee, n);
    return h;
}

typedef struct rank_bufs {
    void *tok[2], *idx[2], *eo[2], *out;
    float *sc[2], *w[2], *pin, *pout;
    void *rtok[STEPS];
    float *rprob[STEPS], *rscale[STEPS];
    size_t maxr; /* rows of rtok, rprob, rscale; GUARD_ROWS more follow, poisoned */
    const hep_bootstrap *settle; /* GPU runs: every rank ends a step's copies here */
} rank_bufs;

/* The end of a step's copies to the host, on every rank before any starts the next call.
 * Under compute-sanitizer a copy waits for every kernel on the device: without this, one
 * rank's copy waits for a node-mate's next kernel, which waits for this rank (both ran
 * into their timeouts under memcheck on the H200). */
static void settle(const rank_bufs *b)
{
    if (b->settle && b->settle->barrier(b->settle->ctx))
        fprintf(stderr, "the test's settle barrier failed: %s\n", hep_last_error());
}

#define FAIL(...)                                                                                \
    do {                                                                                         \
        snprintf(o->err, sizeof(o->err), __VA_ARGS__);                                           \
        goto out;                                                                                \
    } while (0)

/* The harness's barrier between the ranks' steps. A failed one (a rank later than
 * HEP_TIMEOUT_MS) fails the case with the bootstrap's message, naming the late ranks:
 * ignored, the calls after it would time out naming them instead, as if the kernels had
 * lost them. */
#define BARRIER()                                                                                \
    do {                                                                                         \
        if (x->bs.barrier(x->bs.ctx))                                                            \
            FAIL("rank %d: the test's barrier: %s", r, hep_last_error());                       \
    } while (0)

/* A rank's routing into dst as the case's index type (int32, or int64 widened). */
static int put_ids(const tcase *c, const mem *m, void *dst, const int *ids)
{
    const size_t n = (size_t)c->T * c->K;
    int64_t *w;
    int rc;
    if (!c->idx64)
        return m_put(m, dst, ids, sizeof(int) * n);
    if (!(w = malloc(sizeof(*w) * n)))
        return 1;
    for (size_t k = 0; k < n; k++)
        w[k] = ids[k];
    rc = m_put(m, dst, w, sizeof(*w) * n);
    free(w);
    return rc;
}

/* Rows after the receive outputs in caller memory (poisoned with GUARD_BYTE at setup): no
 * dispatch may write them (a row at or past the capacity is never written). */
#define GUARD_ROWS 4
#define GUARD_BYTE 0xa5

static int m_set(const mem *m, void *dst, int v, size_t n)
{
    if (!m->gpu) {
        memset(dst, v, n);
        return 0;
    }
    /* the legacy stream only: at setup a node-mate's first dispatch may already spin on the
     * device waiting for this rank, so a device-wide synchronization would wait for it */
    return cudaMemset(dst, v, n) != cudaSuccess || cudaStreamSynchronize(0) != cudaSuccess;
}

/* The guard bytes after the rows of rtok/rprob/rscale of every step: the first one changed
 * is named in o->err (1), or 0. */
static int guard_intact(const tcase *c, struct rout *o, const mem *m, const rank_bufs *b, int r)
{
    const size_t rb = rbytes(c), ns = (size_t)c->H / 128, n = b->maxr;
    for (int s = 0; s < STEPS; s++) {
        const void *p[3] = {(const char *)b->rtok[s] + n * rb, b->rprob[s] + n * EL,
                            b->rscale[s] + n * ns};
        const size_t len[3] = {GUARD_ROWS * rb, GUARD_ROWS * EL * sizeof(float),
                               GUARD_ROWS * ns * sizeof(float)};
        static const char *what[3] = {"recv_tokens", "recv_probs", "recv_scales"};
        for (int q = 0; q < 3; q++) {
            unsigned char *h = len[q] ? m_get(m, p[q], len[q]) : NULL;
            for (size_t k = 0; h && k < len[q]; k++)
                if (h[k] != GUARD_BYTE) {
                    snprintf(o->err, sizeof(o->err),
                             "rank %d: %s of step %d: byte %zu past its %zu rows (the "
                             "capacity) was written: 0x%02x", r, what[q], s, k, n, h[k]);
                    free(h);
                    return 1;
                }
            free(h);
        }
    }
    return 0;
}

static int setup_bufs(tcase *c, int r, const mem *m, hep_group *g, rank_bufs *b)
{
    const size_t T = (size_t)c->T, H = (size_t)c->H, rb = rbytes(c), ns = H / 128;
    hep_group_info gi;
    size_t maxr;
    memset(b, 0, sizeof(*b));
    if (hep_group_get_info(g, &gi))
        return 1;
    maxr = gi.max_recv_rows;
    if ((size_t)c->em_rows > maxr) /* expert-major buffers hold the budget's rows */
        maxr = (size_t)c->em_rows;
    for (int s = 0; s < 2; s++) {
        unsigned char *ht = malloc(T * rb);
        float *hs = malloc(sizeof(float) * (T * ns + 1));
        uint16_t *he = malloc(maxr * H * 2);
        if (!ht || !hs || !he)
            return 1;
        fill_tokens(c, s, r, ht, hs);
        for (size_t j = 0; j < maxr; j++)
            for (size_t h = 0; h < H; h++)
                he[j * H + h] = ep_expert_value(r + 16 * s, (int)j, (int)h);
        b->tok[s] = m_alloc(m, T * rb);
        b->sc[s] = m_alloc(m, sizeof(float) * (T * ns + 1));
        b->idx[s] = m_alloc(m, (c->idx64 ? sizeof(int64_t) : sizeof(int)) * T * c->K);
        b->w[s] = m_alloc(m, sizeof(float) * T * c->K);
        b->eo[s] = m_alloc(m, maxr * H * 2);
        if (!b->tok[s] || !b->sc[s] || !b->idx[s] || !b->w[s] || !b->eo[s] ||
            m_put(m, b->tok[s], ht, T * rb) || m_put(m, b->sc[s], hs, sizeof(float) * T * ns) ||
            put_ids(c, m, b->idx[s], c->ids[s][r]) ||
            m_put(m, b->w[s], c->w[s][r], sizeof(float) * T * c->K) ||
            m_put(m, b->eo[s], he, maxr * H * 2))
            return 1;
        free(ht), free(hs), free(he);
    }
    {
        float *hp = malloc(sizeof(float) * maxr * EL);
        if (!hp)
            return 1;
        for (size_t j = 0; j < maxr * EL; j++)
            hp[j] = 0.25f + (float)(r * 100000 + (int)j);
        b->pin = m_alloc(m, sizeof(float) * maxr * EL);
        if (!b->pin || m_put(m, b->pin, hp, sizeof(float) * maxr * EL))
            return 1;
        free(hp);
    }
    b->out = m_alloc(m, T * H * 2);
    b->pout = m_alloc(m, sizeof(float) * T * EL * (size_t)c->W);
    b->maxr = maxr;
    for (int s = 0; s < STEPS; s++) {
        const size_t n = maxr + GUARD_ROWS;
        b->rtok[s] = m_alloc(m, n * rb);
        b->rprob[s] = m_alloc(m, sizeof(float) * n * EL);
        b->rscale[s] = m_alloc(m, sizeof(float) * (n * ns + 1));
        if (!b->rtok[s] || !b->rprob[s] || !b->rscale[s] ||
            m_set(m, (char *)b->rtok[s] + maxr * rb, GUARD_BYTE, GUARD_ROWS * rb) ||
            m_set(m, b->rprob[s] + maxr * EL, GUARD_BYTE, sizeof(float) * GUARD_ROWS * EL) ||
            m_set(m, b->rscale[s] + maxr * ns, GUARD_BYTE, sizeof(float) * GUARD_ROWS * ns))
            return 1;
    }
    /* cudaMemset of device memory returns before it is done, and so may a cudaMemcpy from
     * pageable memory: both done before the case's barrier, so that no kernel of the case
     * (this rank's or a node-mate's, writing into these rows) runs beside them. No kernel
     * runs yet, so the device-wide wait is safe here. */
    if (m->gpu && cudaDeviceSynchronize() != cudaSuccess)
        return 1;
    return !b->out || !b->pout;
}

static void free_bufs(const mem *m, rank_bufs *b)
{
    for (int s = 0; s < 2; s++) {
        m_free(m, b->tok[s]), m_free(m, b->sc[s]), m_free(m, b->idx[s]);
        m_free(m, b->w[s]), m_free(m, b->eo[s]);
    }
    m_free(m, b->pin), m_free(m, b->out), m_free(m, b->pout);
    for (int s = 0; s < STEPS; s++)
        m_free(m, b->rtok[s]), m_free(m, b->rprob[s]), m_free(m, b->rscale[s]);
}

static hep_dispatch_args dargs(const tcase *c, int r, rank_bufs *b, int set, int tokset,
                               void *stream, unsigned flags)
{
    hep_dispatch_args a;
    memset(&a, 0, sizeof(a));
    a.num_tokens = c->t[set][r];
    a.tokens = b->tok[tokset];
    a.scales = c->fp8 ? b->sc[tokset] : NULL;
    a.topk_idx = b->idx[set];
    a.index_type = c->idx64 ? HEP_INDEX_INT64 : HEP_INDEX_INT32;
    a.topk = c->K;
    a.topk_weights = b->w[set];
    a.stream = stream;
    a.flags = flags;
    return a;
}

/* Save step s's outputs (rows, probs, scales in caller memory; the counts). */
static void save_dispatch(tcase *c, struct rout *o, const mem *m, rank_bufs *b, int s,
                          const hep_dispatch_result *dr)
{
    const size_t n = dr->num_recv > 0 ? (size_t)dr->num_recv : 0, ns = (size_t)c->H / 128;
    o->nrecv[s] = dr->num_recv;
    for (int j = 0; j <= EL; j++)
        o->counts[s][j] = dr->host_counts[j];
    if (c->em)
        return; /* save_em */
    o->rows[s] = m_get(m, b->rtok[s], n * rbytes(c));
    o->probs[s] = m_get(m, b->rprob[s], n * EL * sizeof(float));
    o->scales[s] = c->fp8 ? m_get(m, b->rscale[s], n * ns * sizeof(float)) : NULL;
    settle(b);
}

/* Step s's outputs from the result's view (rows, probs, scales in the group's buffers). */
static void save_view(tcase *c, struct rout *o, const mem *m, rank_bufs *b, int s,
                      const hep_dispatch_result *dr)
{
    const size_t n = dr->num_recv > 0 ? (size_t)dr->num_recv : 0, ns = (size_t)c->H / 128;
    o->nrecv[s] = dr->num_recv;
    for (int j = 0; j <= EL; j++)
        o->counts[s][j] = dr->host_counts[j];
    o->rows[s] = m_get(m, dr->tokens, n * rbytes(c));
    o->probs[s] = m_get(m, dr->probs, n * EL * sizeof(float));
    o->scales[s] = c->fp8 ? m_get(m, dr->scales, n * ns * sizeof(float)) : NULL;
    settle(b);
}

/* Expert-major step s: the words and tokens per expert (from the host fields, or with
 * `dev` from permuted_device / tokens_per_expert_device, as after a graph replay), then
 * num_permuted rows, one probability each, their scales. */
static void save_em(tcase *c, struct rout *o, const mem *m, rank_bufs *b, int s,
                    const hep_dispatch_opts *x, int dev)
{
    const size_t ns = (size_t)c->H / 128;
    size_t n;
    if (dev) {
        int w[3] = {-1, -1, -1};
        if (m_get_into(m, w, x->permuted_device, sizeof(w)) ||
            m_get_into(m, o->tpe[s], x->tokens_per_expert_device, sizeof(o->tpe[s])))
            memset(o->tpe[s], 0xee, sizeof(o->tpe[s]));
        memcpy(o->emw[s], w, sizeof(w));
    } else {
        o->emw[s][0] = x->num_permuted, o->emw[s][1] = x->overflow;
        o->emw[s][2] = x->overflow_rows;
        for (int e = 0; e < EL; e++)
            o->tpe[s][e] = x->tokens_per_expert ? x->tokens_per_expert[e] : -7;
    }
    n = o->emw[s][0] > 0 ? (size_t)o->emw[s][0] : 0;
    o->rows[s] = m_get(m, b->rtok[s], n * rbytes(c));
    o->probs[s] = m_get(m, b->rprob[s], n * sizeof(float));
    o->scales[s] = c->fp8 ? m_get(m, b->rscale[s], n * ns * sizeof(float)) : NULL;
    settle(b);
}

static void save_combine(tcase *c, struct rout *o, const mem *m, rank_bufs *b, int s, int t)
{
    o->comb[s] = m_get(m, b->out, (size_t)t * c->H * 2);
    o->pout[s] = m_get(m, b->pout, (size_t)t * EL * c->W * sizeof(float));
    settle(b);
}

static hep_dispatch_opts opts_into(rank_bufs *b, hep_handle *h, int s)
{
    hep_dispatch_opts x;
    memset(&x, 0, sizeof(x));
    x.handle = h;
    x.recv_tokens = b->rtok[s];
    x.recv_probs = b->rprob[s];
    x.recv_scales = b->rscale[s];
    return x;
}

/* Into step s's buffers, expert-major with budget `which` (0: hA's, 1: hB's), or
 * rank-major when the case is. */
static hep_dispatch_opts opts_case(const tcase *c, rank_bufs *b, hep_handle *h, int s, int which)
{
    hep_dispatch_opts x = opts_into(b, h, s);
    if (c->em) {
        x.layout = HEP_LAYOUT_EXPERT_MAJOR;
        x.pad_multiple = c->pad;
        x.num_permuted_tokens = c->budget[which];
    }
    return x;
}

static int do_combine(hep_group *g, hep_handle *h, rank_bufs *b, int eo, void *st, unsigned fl,
                      int probs)
{
    hep_combine_args ca;
    hep_combine_opts co;
    memset(&ca, 0, sizeof(ca));
    memset(&co, 0, sizeof(co));
    ca.expert_out = b->eo[eo];
    ca.out = b->out;
    ca.stream = st;
    ca.flags = fl;
    co.handle = h;
    co.probs_in = probs ? b->pin : NULL;
    co.probs_out = probs ? b->pout : NULL;
    return hep_combine_ex(g, &ca, &co);
}

static int compare_rank(tcase *c, int r, int step_only);

/* The overflow words of a dispatch (host or device memory). */
static void save_words(const mem *m, const hep_dispatch_result *dr, int *w)
{
    w[0] = w[1] = w[2] = -9;
    if (dr->overflow_device && m_get_into(m, w, dr->overflow_device, 3 * sizeof(int)))
        w[0] = w[1] = w[2] = -8;
}

/* cap_mode 2: the first rank of set 0 over the capacity among ranks [r0, r1), or -1. */
static int first_over(const tcase *c, int r0, int r1)
{
    for (int d = r0; d < r1; d++)
        if (need(c, 0, d) > c->cap)
            return d;
    return -1;
}

/* cap_mode 2: where run `side` of rank r says whom its drop warning names, and its
 * overflow_device[HEP_OVERFLOW_DROPPED]: any rank's (the host backend; the GPU on one node),
 * or across nodes on the GPU the ranks of r's node only (the kernels see no other node's
 * rows). -1: no rank in that scope needs more than the capacity. */
static int drop_scope_first(const tcase *c, int side, int r)
{
    if (side == 0 || !c->R)
        return first_over(c, 0, c->W);
    return first_over(c, r / c->R * c->R, r / c->R * c->R + c->R);
}

static int drop_word0(const tcase *c, int side, int r)
{
    return drop_scope_first(c, side, r) >= 0;
}

/* cap_mode 2 on rank x->rank: set 0 with HEP_ASYNC into hA and its combine (the GPU:
 * captured once, replayed graph_replays times, each replay checked against the host run),
 * its status (the call's on the host, hep_group_sync's on the GPU) in rc[2] and msg; then
 * set 1 blocking into hB and its combine. 1 with o->err set on a failure. */
static int drop_sequence(tcase *c, rank_ctx *x, hep_group *g, hep_handle *hA, hep_handle *hB,
                         rank_bufs *b, cudaStream_t st)
{
    const int r = x->rank;
    struct rout *o = &c->out[c->gpu][r];
    const mem m = {c->gpu};
    hep_dispatch_result dr;
    hep_dispatch_opts xo;
    hep_dispatch_args da;
    int rc = 0, crc;
    /* a call without drops first: a rank alone skips its end arrivals there, and the
     * dropping calls after it must not wait for them (kernels/dispatch.cu, arrive_all) */
    if (c->lead) {
        xo = opts_into(b, hB, 1);
        da = dargs(c, r, b, 1, 0, st, 0);
        if (hep_dispatch_ex(g, &da, &xo, &dr) || do_combine(g, hB, b, 1, st, 0, 1))
            FAIL("rank %d: the call that fits before the drops: %s", r, hep_last_error());
    }
    if (!c->gpu) {
        xo = opts_into(b, hA, 0);
        da = dargs(c, r, b, 0, 0, st, HEP_ASYNC);
        o->rc[2] = hep_dispatch_ex(g, &da, &xo, &dr);
        snprintf(o->msg, sizeof(o->msg), "%s", hep_last_error());
        if (o->rc[2] && o->rc[2] != HEP_WARN_IGNORED)
            FAIL("rank %d: no-sync dispatch past the capacity: %s", r, hep_last_error());
        save_words(&m, &dr, o->ovw[0]);
        dr.num_recv = dr.num_recv_device[0];
        save_dispatch(c, o, &m, b, 0, &dr);
        if ((rc = do_combine(g, hA, b, 0, st, HEP_ASYNC, 1)))
            FAIL("rank %d: combine of the dropping dispatch: %s", r, hep_last_error());
        save_combine(c, o, &m, b, 0, c->t[0][r]);
    } else {
        /* across nodes a call cannot be captured (the proxy posts its writes): the calls
         * themselves, once, with HEP_ASYNC, and hep_group_sync */
        const int capture = c->R == 0, reps = capture ? c->graph_replays : 1;
        cudaGraph_t graph = NULL;
        cudaGraphExec_t exec = NULL;
        BARRIER();
        if (capture) {
            if (cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
                FAIL("rank %d: begin capture", r);
            xo = opts_into(b, hA, 0);
            da = dargs(c, r, b, 0, 0, st, HEP_ASYNC);
            rc = hep_dispatch_ex(g, &da, &xo, &dr);
            crc = do_combine(g, hA, b, 0, st, HEP_ASYNC, 1);
            if (cudaStreamEndCapture(st, &graph) != cudaSuccess || rc || crc ||
                cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess)
                FAIL("rank %d: capture: %d %d %s", r, rc, crc, hep_last_error());
        }
        /* every rank ended its capture before any rank synchronizes the device (the poison
         * below): a device-wide synchronization while another thread still captures fails
         * there and invalidates that capture (seen once in five runs on the H200) */
        BARRIER();
        for (int rep = 0; rep < reps; rep++) {
            hep_dispatch_result rr;
            const size_t rows = (size_t)c->cap;
            if (cudaMemset(b->rtok[0], 0xff, rows * rbytes(c)) ||
                cudaMemset(b->rprob[0], 0xff, rows * sizeof(float) * EL) ||
                cudaMemset(b->out, 0xff, (size_t)c->T * c->H * 2) ||
                cudaMemset(b->pout, 0xff, sizeof(float) * (size_t)c->T * EL * c->W) ||
                (capture && cudaMemset((void *)dr.overflow_device, 0xee, 3 * sizeof(int))) ||
                cudaDeviceSynchronize())
                FAIL("rank %d: poison", r);
            BARRIER();
            if (capture) {
                if (cudaGraphLaunch(exec, st) != cudaSuccess)
                    FAIL("rank %d: graph launch", r);
            } else {
                xo = opts_into(b, hA, 0);
                da = dargs(c, r, b, 0, 0, st, HEP_ASYNC);
                rc = hep_dispatch_ex(g, &da, &xo, &dr);
                if (rc && rc != HEP_WARN_IGNORED)
                    FAIL("rank %d: no-sync dispatch past the capacity: %s", r, hep_last_error());
                if ((crc = do_combine(g, hA, b, 0, st, HEP_ASYNC, 1))) {
                    /* the combine's call saw the proxy's failure; the dispatch kernel's own
                     * record (which wait it gave up on) comes with the stream's end */
                    char first[224];
                    snprintf(first, sizeof(first), "%s", hep_last_error());
                    FAIL("rank %d: no-sync combine of it: %s (then hep_group_sync: %.220s)", r,
                         first, hep_group_sync(g, st) ? hep_last_error() : "ok");
                }
            }
            rr = dr;
            o->rc[2] = hep_group_sync(g, st);
            snprintf(o->msg, sizeof(o->msg), "%s", hep_last_error());
            if (o->rc[2] && o->rc[2] != HEP_WARN_IGNORED)
                FAIL("rank %d: replay %d: %s", r, rep, hep_last_error());
            save_words(&m, &dr, o->ovw[0]);
            if (m_get_into(&m, &rr.num_recv, dr.num_recv_device, sizeof(int)))
                rr.num_recv = -5;
            free(o->rows[0]), free(o->probs[0]), free(o->scales[0]);
            free(o->comb[0]), free(o->pout[0]);
            save_dispatch(c, o, &m, b, 0, &rr);
            save_combine(c, o, &m, b, 0, c->t[0][r]);
            if (o->ovw[0][0] != drop_word0(c, 1, r) ||
                memcmp(o->ovw[0] + 1, c->out[0][r].ovw[0] + 1, 2 * sizeof(int)) ||
                compare_rank(c, r, 1)) {
                snprintf(o->err + strlen(o->err), sizeof(o->err) - strlen(o->err),
                         " (overflow words %d %d %d, host %d %d %d; graph replay %d)",
                         o->ovw[0][0], o->ovw[0][1], o->ovw[0][2], c->out[0][r].ovw[0][0],
                         c->out[0][r].ovw[0][1], c->out[0][r].ovw[0][2], rep);
                break;
            }
        }
        if (exec)
            cudaGraphExecDestroy(exec);
        if (graph)
            cudaGraphDestroy(graph);
        if (o->err[0])
            return 1;
    }
    /* the group stays usable: set 1 fits, blocking */
    xo = opts_into(b, hB, 1);
    da = dargs(c, r, b, 1, 0, st, 0);
    if ((o->rc[3] = hep_dispatch_ex(g, &da, &xo, &dr)))
        FAIL("rank %d: dispatch that fits after the drop: %s", r, hep_last_error());
    save_words(&m, &dr, o->ovw[1]);
    save_dispatch(c, o, &m, b, 1, &dr);
    if ((o->rc[4] = do_combine(g, hB, b, 1, st, 0, 1)))
        FAIL("rank %d: combine after the drop: %s", r, hep_last_error());
    save_combine(c, o, &m, b, 1, c->t[1][r]);
    return 0;
out: /* FAIL */
    return 1;
}

/* Across nodes, the one-shot sequence: dispatch A into caller memory, combine it from the
 * caller's expert outputs; the same with B; then A with the zero-copy view (hep_dispatch)
 * and a combine from caller memory again. GPU: the options still refused across nodes
 * are refused first (every rank alike, before any collective work). */
static int oneshot_sequence(tcase *c, rank_ctx *x, hep_group *g, hep_handle *hA, rank_bufs *b,
                            void *st)
{
    const int r = x->rank;
    struct rout *o = &c->out[c->gpu][r];
    const mem m = {c->gpu};
    hep_dispatch_result dr;
    hep_dispatch_opts xo;
    hep_dispatch_args da;
    hep_combine_args ca;
    int rc;
    for (int s = 0; s < STEPS; s++) {
        const int set = s == 1;
        xo = opts_into(b, NULL, s);
        da = dargs(c, r, b, set, set, st, 0);
        rc = s < 2 ? hep_dispatch_ex(g, &da, &xo, &dr) : hep_dispatch(g, &da, &dr);
        if (rc && rc != HEP_WARN_IGNORED)
            FAIL("rank %d: one-shot dispatch %d: %s", r, s, hep_last_error());
        if (dr.handle == 0 || (s < 2 && dr.num_recv > 0 && (xo.copy_bytes == 0 ||
                                                             dr.tokens != b->rtok[s])))
            FAIL("rank %d: one-shot dispatch %d into caller memory: handle %llu, copy_bytes "
                 "%zu, tokens %p (caller's %p)", r, s, (unsigned long long)dr.handle,
                 xo.copy_bytes, dr.tokens, b->rtok[s]);
        if (s < 2)
            save_dispatch(c, o, &m, b, s, &dr);
        else
            save_view(c, o, &m, b, s, &dr);
        memset(&ca, 0, sizeof(ca));
        ca.handle = dr.handle;
        ca.expert_out = b->eo[set];
        ca.out = b->out;
        ca.stream = st;
        if ((rc = hep_combine(g, &ca)))
            FAIL("rank %d: one-shot combine %d: %s", r, s, hep_last_error());
        save_combine(c, o, &m, b, s, c->t[set][r]);
    }
    (void)hA;
out:
    return o->err[0] != 0;
}

/* GPU across nodes: what the kernels do not take there is refused with the reason before
 * any collective work (every rank alike): probabilities through combine without a caller
 * handle (the one-shot layout records no routing). (The expert-major layout with a node's
 * ranks in several processes, refused too, needs processes: tests/test_train.c checks the
 * host's decision.) */
static int nodes_refusals(tcase *c, rank_ctx *x, hep_group *g, hep_handle *h, rank_bufs *b,
                          void *st)
{
    const int r = x->rank;
    struct rout *o = &c->out[c->gpu][r];
    int rc;
    (void)h;
    if (!c->gpu)
        return 0;
    if ((rc = do_combine(g, NULL, b, 0, st, 0, 1)) != HEP_ERR_UNAVAILABLE ||
        !strstr(hep_last_error(), "with a caller handle only"))
        FAIL("rank %d: probabilities through combine across nodes without a handle: %s (%s), "
             "want HEP_ERR_UNAVAILABLE", r, hep_status_name(rc), hep_last_error());
out:
    return o->err[0] != 0;
}

/* The handle sequence: dispatch A into hA, B into hB (outputs in caller memory), combine
 * hA, dispatch with hA's layout again (new tokens, recorded weights), combine hB, combine
 * hA again (other expert outputs). Or the capacity sequence. */
static int run_rank(rank_ctx *x)
{
    tcase *c = x->arg;
    const int r = x->rank, side = c->gpu;
    struct rout *o = &c->out[side][r];
    const mem m = {c->gpu};
    hep_config cfg = c->cfg;
    hep_group *g = NULL;
    hep_handle *hA = NULL, *hB = NULL;
    cudaStream_t st = NULL;
    rank_bufs b;
    hep_dispatch_result dr;
    hep_dispatch_opts xo;
    hep_dispatch_args da;
    int rc = 0;
    memset(&b, 0, sizeof(b));
    if (c->gpu) {
        if (cudaSetDevice(0) != cudaSuccess)
            FAIL("rank %d: cudaSetDevice(0) failed", r);
        if (hep_inproc_stream(0, r, (void **)&st))
            FAIL("rank %d: %s", r, hep_last_error());
    }
    cfg.backend = c->gpu ? HEP_BACKEND_GPU : HEP_BACKEND_HOST;
    if (c->R) { /* virtual nodes: the loopback NIC, whatever HEP_NIC says */
        hep_group_hooks hooks = {NULL, 1, 0};
        rc = hep_group_create_ex(&cfg, &x->bs, 0, &hooks, &g);
    } else {
        rc = hep_group_create(&cfg, &x->bs, 0, &g);
    }
    if (rc)
        FAIL("rank %d: create: %s", r, hep_last_error());
    if (setup_bufs(c, r, &m, g, &b) || hep_handle_create(g, &hA) || hep_handle_create(g, &hB))
        FAIL("rank %d: buffers or handles: %s", r, hep_last_error());
    /* every rank's buffers exist before any rank's first kernel: a node-mate's kernel writes
     * this rank's caller memory (the expert-major rows), and compute-sanitizer memcheck
     * checks a kernel's accesses against the allocations made before its launch */
    BARRIER();
    if (c->gpu)
        b.settle = &x->bs;
    if (c->cap_mode == 1) {
        const size_t rows1 = b.maxr * rbytes(c); /* the caller's rows of step 1 */
        /* exactly the capacity: fits (c->em: expert-major, into hA with the full budget) */
        xo = opts_case(c, &b, hA, 0, 0);
        da = dargs(c, r, &b, 0, 0, st, 0);
        o->rc[0] = hep_dispatch_ex(g, &da, &xo, &dr);
        if (o->rc[0])
            FAIL("rank %d: dispatch at the capacity: %s", r, hep_last_error());
        save_dispatch(c, o, &m, &b, 0, &dr);
        if (c->em)
            save_em(c, o, &m, &b, 0, &xo, 0);
        if ((o->rc[1] = do_combine(g, hA, &b, 0, st, 0, !c->noprobs)))
            FAIL("rank %d: combine at the capacity: %s", r, hep_last_error());
        save_combine(c, o, &m, &b, 0, c->t[0][r]);
        /* one row short on cap_rank: every rank fails, the receive buffers untouched */
        BARRIER(); /* every node-mate finished reading this rank's rows */
        if ((c->gpu && (cudaMemset(hep_combine_input(g), 0xff, (size_t)c->cap * rbytes(c)) ||
                        cudaDeviceSynchronize())) ||
            m_set(&m, b.rtok[1], 0xff, rows1))
            FAIL("rank %d: poison", r);
        BARRIER();
        xo = opts_case(c, &b, hB, 1, 1);
        da = dargs(c, r, &b, 1, 0, st, 0);
        o->rc[2] = hep_dispatch_ex(g, &da, &xo, &dr);
        snprintf(o->msg, sizeof(o->msg), "%s", hep_last_error());
        /* nothing received on this rank (across nodes on the GPU: on the node of the rank
         * over it; the other nodes received their rows, below the capacity, and the call is
         * void): not in the group's exchange buffer, not in the caller's outputs */
        if (!c->gpu || !c->R || r / c->R == c->cap_rank / c->R) {
            unsigned char *xr = c->gpu ? m_get(&m, hep_combine_input(g), (size_t)c->cap * rbytes(c))
                                       : NULL;
            unsigned char *cr = m_get(&m, b.rtok[1], rows1);
            for (size_t k = 0; xr && k < (size_t)c->cap * rbytes(c); k++)
                if (xr[k] != 0xff) {
                    o->bad++;
                    snprintf(o->err, sizeof(o->err),
                             "rank %d: the overflowing dispatch wrote receive byte %zu", r, k);
                    break;
                }
            for (size_t k = 0; cr && !o->bad && k < rows1; k++)
                if (cr[k] != 0xff) {
                    o->bad++;
                    snprintf(o->err, sizeof(o->err),
                             "rank %d: the overflowing dispatch wrote byte %zu of the caller's "
                             "recv_tokens", r, k);
                    break;
                }
            free(xr);
            free(cr);
        }
        /* the group stays usable: A again, into hB */
        xo = opts_case(c, &b, hB, 1, 1);
        da = dargs(c, r, &b, 0, 0, st, 0);
        o->rc[3] = hep_dispatch_ex(g, &da, &xo, &dr);
        if (o->rc[3])
            FAIL("rank %d: dispatch after the overflow: %s", r, hep_last_error());
        save_dispatch(c, o, &m, &b, 1, &dr);
        if (c->em)
            save_em(c, o, &m, &b, 1, &xo, 0);
        if ((o->rc[4] = do_combine(g, hB, &b, 1, st, 0, !c->noprobs)))
            FAIL("rank %d: combine after the overflow: %s", r, hep_last_error());
        save_combine(c, o, &m, &b, 1, c->t[0][r]);
        goto out;
    }
    if (c->cap_mode == 2) {
        (void)drop_sequence(c, x, g, hA, hB, &b, st); /* o->err says how it went */
        goto out;
    }
    if (c->R && nodes_refusals(c, x, g, hA, &b, st))
        goto out;
    if (c->oneshot) {
        (void)oneshot_sequence(c, x, g, hA, &b, st); /* o->err says how it went */
        goto out;
    }
    xo = opts_case(c, &b, hA, 0, 0);
    da = dargs(c, r, &b, 0, 0, st, 0);
    if ((rc = hep_dispatch_ex(g, &da, &xo, &dr)) && rc != HEP_WARN_IGNORED)
        FAIL("rank %d: dispatch A: %s", r, hep_last_error());
    if (dr.handle != 0 || xo.copy_bytes == 0)
        FAIL("rank %d: dispatch A into a handle: result handle %llu, copy_bytes %zu", r,
             (unsigned long long)dr.handle, xo.copy_bytes);
    save_dispatch(c, o, &m, &b, 0, &dr);
    if (c->em)
        save_em(c, o, &m, &b, 0, &xo, 0);
    xo = opts_case(c, &b, hB, 1, 1);
    da = dargs(c, r, &b, 1, 1, st, 0);
    if ((rc = hep_dispatch_ex(g, &da, &xo, &dr)) && rc != HEP_WARN_IGNORED)
        FAIL("rank %d: dispatch B: %s", r, hep_last_error());
    save_dispatch(c, o, &m, &b, 1, &dr);
    if (c->em)
        save_em(c, o, &m, &b, 1, &xo, 0);
    if (c->gpu) { /* the exchange buffer holds B's rows now: not A's in place */
        hep_combine_args ca;
        hep_combine_opts co;
        memset(&ca, 0, sizeof(ca));
        memset(&co, 0, sizeof(co));
        ca.expert_out = hep_combine_input(g);
        ca.out = b.out;
        ca.stream = st;
        co.handle = hA;
        if (hep_combine_ex(g, &ca, &co) != HEP_ERR_INVALID ||
            !strstr(hep_last_error(), c->em ? "caller memory" : "no longer holds"))
            FAIL("rank %d: combine of hA in place after B was not refused: %s", r,
                 hep_last_error());
    }
    if ((rc = do_combine(g, hA, &b, 0, st, 0, !c->noprobs)))
        FAIL("rank %d: combine hA: %s", r, hep_last_error());
    save_combine(c, o, &m, &b, 0, c->t[0][r]);
    xo = opts_into(&b, hA, 2); /* the layout, pad and budget are hA's */
    da = dargs(c, r, &b, 0, 1, st, HEP_REUSE_LAYOUT);
    da.topk_idx = NULL, da.topk = 0, da.topk_weights = NULL;
    if ((rc = hep_dispatch_ex(g, &da, &xo, &dr)))
        FAIL("rank %d: dispatch reusing hA: %s", r, hep_last_error());
    save_dispatch(c, o, &m, &b, 2, &dr);
    if (c->em)
        save_em(c, o, &m, &b, 2, &xo, 0);
    if ((rc = do_combine(g, hB, &b, 1, st, 0, !c->noprobs)))
        FAIL("rank %d: combine hB: %s", r, hep_last_error());
    save_combine(c, o, &m, &b, 1, c->t[1][r]);
    if ((rc = do_combine(g, hA, &b, 1, st, 0, !c->noprobs)))
        FAIL("rank %d: combine hA again: %s", r, hep_last_error());
    save_combine(c, o, &m, &b, 2, c->t[0][r]);

    if (c->gpu && c->graph_replays) {
        /* capture {dispatch A into hA, combine hA} without host synchronization, replay:
         * every replay must give the host run's step 0 and combine 0 */
        cudaGraph_t graph = NULL;
        cudaGraphExec_t exec = NULL;
        int crc = 0;
        BARRIER();
        if (cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
            FAIL("rank %d: begin capture", r);
        xo = opts_case(c, &b, hA, 0, 0);
        da = dargs(c, r, &b, 0, 0, st, HEP_ASYNC);
        char derr[160];
        rc = hep_dispatch_ex(g, &da, &xo, &dr);
        snprintf(derr, sizeof(derr), "%s", rc ? hep_last_error() : "");
        crc = do_combine(g, hA, &b, 0, st, HEP_ASYNC, !c->noprobs);
        if (cudaStreamEndCapture(st, &graph) != cudaSuccess || (rc && rc != HEP_WARN_IGNORED) ||
            crc || cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess)
            FAIL("rank %d: capture: dispatch %d (%s), combine %d (%s)", r, rc, derr, crc,
                 crc ? hep_last_error() : "");
        BARRIER(); /* every rank ended its capture: as above */
        for (int rep = 0; rep < c->graph_replays; rep++) {
            struct rout *h = &c->out[0][r];
            hep_dispatch_result rr = dr;
            const size_t poison_rows = c->em ? (size_t)c->em_rows
                                             : (size_t)(h->nrecv[0] > 0 ? h->nrecv[0] : 0);
            if (cudaMemset(b.rtok[0], 0xff, poison_rows * rbytes(c)) ||
                cudaMemset(b.rprob[0], 0xff, poison_rows * sizeof(float) * (c->em ? 1 : EL)) ||
                cudaMemset(b.out, 0xff, (size_t)c->T * c->H * 2) ||
                cudaMemset(b.pout, 0xff, sizeof(float) * (size_t)c->T * EL * c->W) ||
                cudaDeviceSynchronize())
                FAIL("rank %d: poison", r);
            BARRIER();
            if (cudaGraphLaunch(exec, st) != cudaSuccess)
                FAIL("rank %d: graph launch", r);
            if ((rc = hep_group_sync(g, st)) && rc != HEP_WARN_IGNORED)
                FAIL("rank %d: replay %d: %s", r, rep, hep_last_error());
            rr.num_recv = h->nrecv[0];
            free(o->rows[0]), free(o->probs[0]), free(o->scales[0]);
            free(o->comb[0]), free(o->pout[0]);
            save_dispatch(c, o, &m, &b, 0, &rr);
            if (c->em)
                save_em(c, o, &m, &b, 0, &xo, 1);
            save_combine(c, o, &m, &b, 0, c->t[0][r]);
            {
                int cnt = -1;
                (void)cudaMemcpy(&cnt, dr.num_recv_device, sizeof(int), cudaMemcpyDeviceToHost);
                o->nrecv[0] = cnt;
            }
            if (compare_rank(c, r, 1)) {
                snprintf(o->err + strlen(o->err), sizeof(o->err) - strlen(o->err),
                         " (graph replay %d)", rep);
                break;
            }
        }
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
    }
out:
    if (g)
        BARRIER(); /* every rank's calls ended: the guard rows can be read */
    if (g && !o->err[0] && b.maxr)
        (void)guard_intact(c, o, &m, &b, r); /* o->err names a written byte */
    hep_handle_destroy(hA);
    hep_handle_destroy(hB);
    free_bufs(&m, &b);
    hep_group_destroy(g);
    return o->err[0] ? 1 : 0;
}

static int first_diff(const void *a, const void *b, size_t n)
{
    const unsigned char *p = a, *q = b;
    if (!a || !b)
        return a != b ? 0 : -1;
    for (size_t k = 0; k < n; k++)
        if (p[k] != q[k])
            return (int)k;
    return -1;
}

/* Expert-major step s of GPU rank r against the host run: the words, the padded tokens
 * per expert, then every written row, probability and scale. 1 (and err) on a mismatch. */
static int compare_em(tcase *c, int r, int s)
{
    struct rout *h = &c->out[0][r], *o = &c->out[1][r];
    const size_t ns = (size_t)c->H / 128, n = h->emw[s][0] > 0 ? (size_t)h->emw[s][0] : 0;
    int k;
    if (memcmp(o->emw[s], h->emw[s], sizeof(h->emw[s]))) {
        snprintf(o->err, sizeof(o->err),
                 "rank %d step %d (expert-major, pad %d): num_permuted %d overflow %d "
                 "overflow_rows %d, host %d %d %d", r, s, c->pad, o->emw[s][0], o->emw[s][1],
                 o->emw[s][2], h->emw[s][0], h->emw[s][1], h->emw[s][2]);
        return 1;
    }
    for (int e = 0; e < EL; e++)
        if (o->tpe[s][e] != h->tpe[s][e]) {
            snprintf(o->err, sizeof(o->err),
                     "rank %d step %d (expert-major, pad %d): tokens_per_expert[%d] = %lld, "
                     "host %lld", r, s, c->pad, e, o->tpe[s][e], h->tpe[s][e]);
            return 1;
        }
    if ((k = first_diff(o->rows[s], h->rows[s], n * rbytes(c))) >= 0) {
        snprintf(o->err, sizeof(o->err),
                 "rank %d step %d (expert-major, pad %d): row %zu byte (channel) %zu: 0x%02x, "
                 "host 0x%02x", r, s, c->pad, (size_t)k / rbytes(c), (size_t)k % rbytes(c),
                 o->rows[s][k], h->rows[s][k]);
        return 1;
    }
    if ((k = first_diff(o->probs[s], h->probs[s], n * 4)) >= 0) {
        snprintf(o->err, sizeof(o->err),
                 "rank %d step %d (expert-major, pad %d): prob of row %d: %g, host %g", r, s,
                 c->pad, k / 4, o->probs[s][k / 4], h->probs[s][k / 4]);
        return 1;
    }
    if (c->fp8 && (k = first_diff(o->scales[s], h->scales[s], n * ns * 4)) >= 0) {
        snprintf(o->err, sizeof(o->err),
                 "rank %d step %d (expert-major, pad %d): scale %zu of row %zu: %g, host %g", r,
                 s, c->pad, (size_t)k / 4 % ns, (size_t)k / 4 / ns, o->scales[s][k / 4],
                 h->scales[s][k / 4]);
        return 1;
    }
    return 0;
}

/* GPU rank r against the host run; step_only: dispatch 0 and combine 0. Records the first
 * mismatch in the GPU side's err and counts them. */
static int compare_rank(tcase *c, int r, int step_only)
{
    struct rout *h = &c->out[0][r], *o = &c->out[1][r];
    const size_t ns = (size_t)c->H / 128, E = (size_t)EL * c->W;
    int bad = 0;
    const int nsteps = step_only ? 1 : c->cap_mode ? 2 : STEPS;
    const int ncombs = step_only ? 1 : c->cap_mode ? 2 : COMBS;
    for (int s = 0; s < nsteps; s++) {
        const size_t n = h->nrecv[s] > 0 ? (size_t)h->nrecv[s] : 0;
        int k;
        if (o->nrecv[s] != h->nrecv[s] ||
            ((!step_only || c->cap_mode == 2) &&
             memcmp(o->counts[s], h->counts[s], sizeof(h->counts[s])))) {
            snprintf(o->err, sizeof(o->err), "rank %d step %d: %d rows (tokens per expert 0: %d), "
                     "host %d (%d)", r, s, o->nrecv[s], o->counts[s][1], h->nrecv[s],
                     h->counts[s][1]);
            return ++bad;
        }
        if (c->em) {
            if (compare_em(c, r, s))
                return ++bad;
            continue;
        }
        if ((k = first_diff(o->rows[s], h->rows[s], n * rbytes(c))) >= 0) {
            snprintf(o->err, sizeof(o->err), "rank %d step %d: received row %zu byte %zu differs",
                     r, s, (size_t)k / rbytes(c), (size_t)k % rbytes(c));
            return ++bad;
        }
        if ((k = first_diff(o->probs[s], h->probs[s], n * EL * 4)) >= 0) {
            snprintf(o->err, sizeof(o->err), "rank %d step %d: prob of row %d expert %d differs",
                     r, s, k / 4 / EL, k / 4 % EL);
            return ++bad;
        }
        if (c->fp8 && (k = first_diff(o->scales[s], h->scales[s], n * ns * 4)) >= 0) {
            snprintf(o->err, sizeof(o->err), "rank %d step %d: scale of row %zu differs", r, s,
                     (size_t)k / 4 / ns);
            return ++bad;
        }
    }
    for (int s = 0; s < ncombs; s++) {
        const int set = c->cap_mode == 1 ? 0 : s == 1;
        const size_t t = (size_t)c->t[set][r];
        int k;
        if ((k = first_diff(o->comb[s], h->comb[s], t * c->H * 2)) >= 0) {
            snprintf(o->err, sizeof(o->err),
                     "rank %d combine %d: token %zu channel %zu: 0x%04x, host 0x%04x", r, s,
                     (size_t)k / 2 / c->H, (size_t)k / 2 % c->H,
                     o->comb[s][(size_t)k / 2], h->comb[s][(size_t)k / 2]);
            return ++bad;
        }
        if (!c->noprobs && (k = first_diff(o->pout[s], h->pout[s], t * E * 4)) >= 0) {
            snprintf(o->err, sizeof(o->err),
                     "rank %d combine %d: probs_out of token %zu expert %zu: %g, host %g", r, s,
                     (size_t)k / 4 / E, (size_t)k / 4 % E, o->pout[s][(size_t)k / 4],
                     h->pout[s][(size_t)k / 4]);
            return ++bad;
        }
    }
    return bad;
}

static void free_out(struct rout *o)
{
    for (int s = 0; s < STEPS; s++)
        free(o->rows[s]), free(o->probs[s]), free(o->scales[s]);
    for (int s = 0; s < COMBS; s++)
        free(o->comb[s]), free(o->pout[s]);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* An overflow case must overflow somewhere with hA's budget, and nowhere with hB's: else
 * it proves nothing. 0, or the number of ranks of the host run that say otherwise. */
static int check_em_overflow(const tcase *c, const char *name)
{
    int over = 0, bad = 0;
    for (int r = 0; r < c->W; r++) {
        const struct rout *h = &c->out[0][r];
        over += h->emw[0][1] == 1 && h->emw[0][2] > 0 && h->emw[2][1] == 1;
        if (h->emw[1][1] != 0 || h->emw[1][2] != 0) {
            print_error("%s: rank %d: hB's dispatch (the full budget %d) overflowed on the "
                        "host: %d %d\n", name, r, c->budget[1], h->emw[1][1], h->emw[1][2]);
            bad++;
        }
    }
    if (!over) {
        print_error("%s: no rank overflowed hA's budget of %d rows: the case is wrong\n", name,
                    c->budget[0]);
        bad++;
    }
    return bad;
}

/* cap_mode 2, both runs: the status and message of the dropping dispatch, its overflow
 * words and kept rows as this test counts them, the words of the call that fit. Across
 * nodes on the GPU the warning and word 0 are those of each rank's node (drop_scope_first):
 * a node with no rank over the capacity returns HEP_OK from hep_group_sync. */
static int check_drop(const tcase *c, const char *name)
{
    int bad = 0, dropped = 0;
    if (first_over(c, 0, c->W) < 0) {
        print_error("%s: no rank needs more than the capacity %d: the case is wrong\n", name,
                    c->cap);
        return 1;
    }
    for (int side = 0; side < 2; side++)
        for (int r = 0; r < c->W; r++) {
            const struct rout *o = &c->out[side][r];
            const int n0 = need(c, 0, r), n1 = need(c, 1, r), first = drop_scope_first(c, side, r);
            const int w0[3] = {first >= 0, n0, n0 > c->cap ? n0 - c->cap : 0}, w1[3] = {0, n1, 0};
            char want[128] = "";
            if (first >= 0)
                snprintf(want, sizeof(want), "rank %d needs %d receive rows, more than "
                         "config.max_recv_rows = %d (", first, need(c, 0, first), c->cap);
            dropped += side == 0 && w0[2] > 0;
            if (o->rc[2] != (first >= 0 ? HEP_WARN_IGNORED : HEP_OK) ||
                (first >= 0 && !strstr(o->msg, want)) ||
                memcmp(o->ovw[0], w0, sizeof(w0)) || memcmp(o->ovw[1], w1, sizeof(w1)) ||
                o->nrecv[0] != (n0 < c->cap ? n0 : c->cap) || o->nrecv[1] != n1) {
                print_error("%s, %s rank %d: past the capacity %d: %s: %s (want %s \"%s\"); "
                            "words %d %d %d (want %d %d %d), then %d %d %d (want %d %d %d); "
                            "rows %d, %d (want %d, %d)\n",
                            name, side ? "GPU" : "host", r, c->cap, hep_status_name(o->rc[2]),
                            o->msg, first >= 0 ? "HEP_WARN_IGNORED" : "HEP_OK", want,
                            o->ovw[0][0], o->ovw[0][1], o->ovw[0][2], w0[0], w0[1], w0[2],
                            o->ovw[1][0], o->ovw[1][1], o->ovw[1][2], w1[0], w1[1], w1[2],
                            o->nrecv[0], o->nrecv[1], n0 < c->cap ? n0 : c->cap, n1);
                bad++;
            }
        }
    if (!bad)
        print_message("%s: %d of %d ranks dropped rows past the capacity %d\n", name, dropped,
                      c->W, c->cap);
    return bad;
}

static void run_case(tcase *c, const char *name)
{
    rank_ctx ctx[MAXW];
    int fails = 0;
    const double t0 = now_s();
    for (int side = 0; side < 2; side++) {
        c->gpu = side;
        assert_int_equal(run_ranks(c->W, run_rank, c, ctx), 0);
        for (int r = 0; r < c->W; r++)
            if (c->out[side][r].err[0]) {
                print_error("%s, %s run: %s\n", name, side ? "GPU" : "host", c->out[side][r].err);
                fails++;
            }
        if (fails)
            break;
    }
    for (int r = 0; !fails && r < c->W; r++) {
        fails += compare_rank(c, r, 0);
        if (c->out[1][r].err[0])
            print_error("%s: %s\n", name, c->out[1][r].err);
    }
    if (c->em && c->budget[0] < c->budget[1] && !fails)
        fails += check_em_overflow(c, name);
    if (c->cap_mode == 2 && !fails)
        fails += check_drop(c, name);
    if (c->cap_mode == 1 && !fails)
        for (int side = 0; side < 2; side++)
            for (int r = 0; r < c->W; r++) {
                char want[64];
                snprintf(want, sizeof(want), "rank %d needs %d receive rows", c->cap_rank,
                         c->cap + 1);
                if (c->out[side][r].rc[2] != HEP_ERR_OVERFLOW ||
                    !strstr(c->out[side][r].msg, want) || c->out[side][r].bad) {
                    print_error("%s, %s rank %d: one row short gave %s: %s (want \"%s\")\n", name,
                                side ? "GPU" : "host", r, hep_status_name(c->out[side][r].rc[2]),
                                c->out[side][r].msg, want);
                    fails++;
                }
            }
    for (int side = 0; side < 2; side++)
        for (int r = 0; r < c->W; r++)
            free_out(&c->out[side][r]);
    if (fails)
        fail_msg("%s: %d ranks differ from the host backend", name, fails);
    print_message("%s: every output equals the host backend's (%.1f s)\n", name, now_s() - t0);
}

static tcase *new_case(void)
{
    tcase *c = calloc(1, sizeof(*c));
    assert_non_null(c);
    return c;
}

static int W_(void) { return small_only() ? 2 : 8; }
static int T_(void) { return small_only() ? 24 : 192; }

static void handles_interleaved_reused_and_combined_twice_bf16(void **state)
{
    tcase *c = new_case();
    (void)state;
    make_case(c, W_(), T_(), small_only() ? 128 : 1024, 0, 11u);
    run_case(c, "handles, bf16");
    free(c);
}

static void handles_interleaved_reused_and_combined_twice_fp8(void **state)
{
    tcase *c = new_case();
    (void)state;
    make_case(c, W_(), T_(), small_only() ? 128 : 1024, 1, 12u);
    run_case(c, "handles, fp8");
    free(c);
}

static void handles_with_four_ranks_and_int32_routing(void **state)
{
    tcase *c = new_case();
    (void)state;
    make_case(c, small_only() ? 2 : 4, small_only() ? 16 : 64, 256, 0, 13u);
    run_case(c, "handles, 4 ranks");
    free(c);
}

static void capacity_met_then_one_short_then_fits_again(void **state)
{
    tcase *c = new_case();
    (void)state;
    make_cap_case(c, W_(), T_(), 256, 0, 14u);
    run_case(c, "capacity");
    free(c);
}

static void expert_major_capacity_met_then_one_short_then_fits_again(void **state)
{
    tcase *c = new_case();
    (void)state;
    make_em_cap_case(c, W_(), T_(), 256, 0, 16, 18u);
    run_case(c, "expert-major, capacity, pad 16");
    free(c);
}

static void capacity_met_then_one_short_then_fits_again_fp8(void **state)
{
    tcase *c = new_case();
    (void)state;
    make_cap_case(c, W_(), T_(), 256, 1, 17u);
    run_case(c, "capacity, fp8");
    free(c);
}

static void no_sync_past_the_capacity_drops_rows_in_graph_replays_then_fits(void **state)
{
    tcase *c = new_case();
    (void)state;
    make_drop_case(c, W_(), T_(), 256, 0, 0, 16u);
    c->graph_replays = 3;
    run_case(c, "no-sync capacity overflow, graph replay x3");
    free(c);
}

static void one_rank_drops_rows_after_a_call_that_fits_then_fits(void **state)
{
    tcase *c = new_case();
    (void)state;
    make_drop_case(c, 1, T_(), 256, 0, 0, 19u);
    c->graph_replays = 3;
    c->lead = 1;
    run_case(c, "one rank, fits, drops in graph replays x3, fits");
    free(c);
}

static void graph_replays_of_the_no_sync_mode_equal_the_host(void **state)
{
    tcase *c = new_case();
    (void)state;
    make_case(c, W_(), T_(), small_only() ? 128 : 1024, 0, 15u);
    c->graph_replays = 3;
    run_case(c, "graph replay x3");
    free(c);
}

/* Across N x R virtual nodes (the loopback NIC): BF16 or FP8, int32 or int64 routing; the
 * one-shot sequence with outputs in caller memory, or the handles' (interleaved, reused,
 * combined twice, probabilities through every combine). */
static void nodes_case(int N, int R, int fp8, int idx64, int oneshot, unsigned seed,
                       const char *name, int chunk)
{
    tcase *c = new_case();
    make_case(c, N * R, small_only() ? 24 : 96, small_only() ? 128 : 1024, fp8, seed);
    c->R = R;
    c->cfg.ranks_per_node = R;
    if (chunk > 0) /* rings of 2 chunks of `chunk` tokens (else the default) */
        c->cfg.chunk_tokens = chunk;
    c->idx64 = idx64;
    c->oneshot = oneshot;
    c->noprobs = oneshot; /* the one-shot layout carries none (refused, checked above) */
    run_case(c, name);
    free(c);
}

/* The expert-major layout across N x R virtual nodes: the handle sequence (A into hA with
 * budget 0, B into hB, combine hA, hA's layout reused with new tokens, combine hB, hA
 * again), with probabilities through every combine or without; over: hA's budget drops
 * rows on the busiest ranks. */
static void nodes_em_case(int N, int R, int fp8, int idx64, int pad, int over, int probs,
                          unsigned seed, const char *name, int chunk)
{
    tcase *c = new_case();
    make_em_case(c, N * R, small_only() ? 24 : 96, small_only() ? 128 : 1024, fp8, pad, over,
                 seed);
    c->R = R;
    c->cfg.ranks_per_node = R;
    if (chunk > 0) /* rings of 2 chunks of `chunk` tokens (else the default) */
        c->cfg.chunk_tokens = chunk;
    c->idx64 = idx64;
    c->noprobs = !probs;
    run_case(c, name);
    free(c);
}

/* The cases across virtual nodes, one row each (cmocka's test name first). */
typedef struct {
    const char *test;
    int N, R, fp8, idx64;
    int em;      /* 0: rank-major (oneshot: the one-shot sequence); 1: expert-major */
    int oneshot; /* rank-major */
    int pad, over, probs; /* expert-major */
    unsigned seed;
    const char *label;
    int cap;  /* rank-major: 1 the capacity sequence, 2 the no-sync drop sequence */
    int thin; /* cap 2: node 0's experts chosen a third as often (its ranks drop nothing) */
    int chunk; /* > 0: config.chunk_tokens, the inter-node rings (0: the default) */
} nodes_spec;

static const nodes_spec nodes_specs[] = {
    {"nodes_2x2_one_shot_outputs_in_caller_memory_bf16", 2, 2, 0, 0, 0, 1, 0, 0, 0, 31u,
     "2 x 2 nodes, one-shot, caller outputs, bf16"},
    {"nodes_2x4_one_shot_outputs_in_caller_memory_fp8_int64", 2, 4, 1, 1, 0, 1, 0, 0, 0, 32u,
     "2 x 4 nodes, one-shot, caller outputs, fp8, int64"},
    {"nodes_2x2_handles_interleaved_reused_and_combined_twice_bf16", 2, 2, 0, 0, 0, 0, 0, 0, 0,
     33u, "2 x 2 nodes, handles, bf16"},
    {"nodes_2x4_handles_interleaved_reused_and_combined_twice_bf16_int64", 2, 4, 0, 1, 0, 0, 0,
     0, 0, 34u, "2 x 4 nodes, handles, bf16, int64"},
    {"nodes_2x2_handles_interleaved_reused_and_combined_twice_fp8_int64", 2, 2, 1, 1, 0, 0, 0,
     0, 0, 35u, "2 x 2 nodes, handles, fp8, int64"},
    {"nodes_2x4_handles_interleaved_reused_and_combined_twice_fp8", 2, 4, 1, 0, 0, 0, 0, 0, 0,
     36u, "2 x 4 nodes, handles, fp8"},
    {"nodes_2x2_expert_major_pad_1_bf16", 2, 2, 0, 0, 1, 0, 1, 0, 0, 41u,
     "2 x 2 nodes, expert-major, pad 1, bf16"},
    {"nodes_2x4_expert_major_pad_128_bf16_int64", 2, 4, 0, 1, 1, 0, 128, 0, 0, 42u,
     "2 x 4 nodes, expert-major, pad 128, bf16, int64"},
    {"nodes_2x2_expert_major_pad_16_fp8_int64", 2, 2, 1, 1, 1, 0, 16, 0, 0, 43u,
     "2 x 2 nodes, expert-major, pad 16, fp8, int64"},
    {"nodes_2x4_expert_major_budget_overflow_pad_16_fp8", 2, 4, 1, 0, 1, 0, 16, 1, 0, 44u,
     "2 x 4 nodes, expert-major, budget overflow, pad 16, fp8"},
    {"nodes_2x2_expert_major_budget_overflow_pad_128_bf16", 2, 2, 0, 0, 1, 0, 128, 1, 0, 45u,
     "2 x 2 nodes, expert-major, budget overflow, pad 128, bf16"},
    {"nodes_2x4_expert_major_budget_overflow_pad_1_bf16", 2, 4, 0, 0, 1, 0, 1, 1, 0, 46u,
     "2 x 4 nodes, expert-major, budget overflow, pad 1, bf16"},
    {"nodes_2x2_expert_major_probs_through_combine_pad_16_bf16", 2, 2, 0, 0, 1, 0, 16, 0, 1, 47u,
     "2 x 2 nodes, expert-major, probabilities through combine, pad 16, bf16"},
    {"nodes_2x4_expert_major_probs_through_combine_budget_overflow_pad_128_fp8", 2, 4, 1, 1, 1, 0,
     128, 1, 1, 48u,
     "2 x 4 nodes, expert-major, probabilities through combine, budget overflow, pad 128, fp8, "
     "int64"},
    {"nodes_2x4_expert_major_probs_through_combine_pad_1_bf16", 2, 4, 0, 0, 1, 0, 1, 0, 1, 49u,
     "2 x 4 nodes, expert-major, probabilities through combine, pad 1, bf16"},
    {"nodes_2x2_capacity_met_then_one_short_then_fits_again_bf16", 2, 2, 0, 0, 0, 0, 0, 0, 0,
     51u, "2 x 2 nodes, capacity, bf16", 1, 0},
    {"nodes_2x2_capacity_met_then_one_short_then_fits_again_fp8_int64", 2, 2, 1, 1, 0, 0, 0, 0,
     0, 52u, "2 x 2 nodes, capacity, fp8, int64", 1, 0},
    {"nodes_2x4_capacity_met_then_one_short_then_fits_again_bf16_int64", 2, 4, 0, 1, 0, 0, 0, 0,
     0, 53u, "2 x 4 nodes, capacity, bf16, int64", 1, 0},
    {"nodes_2x4_capacity_met_then_one_short_then_fits_again_fp8", 2, 4, 1, 0, 0, 0, 0, 0, 0, 54u,
     "2 x 4 nodes, capacity, fp8", 1, 0},
    {"nodes_2x2_expert_major_capacity_met_then_one_short_pad_16_bf16", 2, 2, 0, 0, 1, 0, 16, 0,
     0, 59u, "2 x 2 nodes, expert-major, capacity, pad 16, bf16", 1, 0},
    {"nodes_2x4_expert_major_capacity_met_then_one_short_pad_128_fp8_int64", 2, 4, 1, 1, 1, 0,
     128, 0, 0, 60u, "2 x 4 nodes, expert-major, capacity, pad 128, fp8, int64", 1, 0},
    {"nodes_2x2_no_sync_past_the_capacity_drops_rows_then_fits_bf16", 2, 2, 0, 0, 0, 0, 0, 0, 0,
     55u, "2 x 2 nodes, no-sync capacity overflow, bf16", 2, 0},
    {"nodes_2x4_no_sync_past_the_capacity_drops_rows_then_fits_fp8_int64", 2, 4, 1, 1, 0, 0, 0,
     0, 0, 56u, "2 x 4 nodes, no-sync capacity overflow, fp8, int64", 2, 0},
    {"nodes_2x4_no_sync_drop_on_one_node_only_bf16", 2, 4, 0, 0, 0, 0, 0, 0, 0, 57u,
     "2 x 4 nodes, no-sync capacity overflow on node 1 only, bf16", 2, 1},
    {"nodes_2x2_no_sync_drop_on_one_node_only_fp8", 2, 2, 1, 0, 0, 0, 0, 0, 0, 58u,
     "2 x 2 nodes, no-sync capacity overflow on node 1 only, fp8", 2, 1},
    /* the inter-node rings smaller than a slot (T = 96, or 24 small): the handle sequence
     * streams every ring through credits, call after call */
    {"nodes_2x2_handles_rings_of_chunks_of_1_bf16", 2, 2, 0, 0, 0, 0, 0, 0, 0, 61u,
     "2 x 2 nodes, handles, rings of 2 x 1 tokens, bf16", 0, 0, 1},
    {"nodes_2x4_handles_rings_of_chunks_of_3_fp8_int64", 2, 4, 1, 1, 0, 0, 0, 0, 0, 62u,
     "2 x 4 nodes, handles, rings of 2 x 3 tokens, fp8, int64", 0, 0, 3},
    {"nodes_4x2_handles_rings_of_chunks_of_16_bf16", 4, 2, 0, 0, 0, 0, 0, 0, 0, 63u,
     "4 x 2 nodes, handles, rings of 2 x 16 tokens, bf16", 0, 0, 16},
    {"nodes_4x2_handles_rings_of_chunks_of_3_fp8", 4, 2, 1, 0, 0, 0, 0, 0, 0, 64u,
     "4 x 2 nodes, handles, rings of 2 x 3 tokens, fp8", 0, 0, 3},
    {"nodes_2x2_one_shot_rings_of_chunks_of_3_fp8", 2, 2, 1, 0, 0, 1, 0, 0, 0, 65u,
     "2 x 2 nodes, one-shot, caller outputs, rings of 2 x 3 tokens, fp8", 0, 0, 3},
    {"nodes_2x4_expert_major_ring_of_two_chunks_pad_16_probs_bf16", 2, 4, 0, 0, 1, 0, 16, 0, 1,
     66u, "2 x 4 nodes, expert-major, a ring of 2 x 48 tokens, pad 16, probabilities, bf16", 0,
     0, 48},
    {"nodes_2x4_capacity_met_then_one_short_then_fits_again_rings_of_chunks_of_3_bf16", 2, 4, 0,
     0, 0, 0, 0, 0, 0, 67u, "2 x 4 nodes, capacity, rings of 2 x 3 tokens, bf16", 1, 0, 3},
    {"nodes_2x4_no_sync_drop_on_one_node_only_rings_of_chunks_of_3_fp8", 2, 4, 1, 0, 0, 0, 0, 0,
     0, 68u, "2 x 4 nodes, no-sync capacity overflow on node 1 only, rings of 2 x 3 tokens, fp8",
     2, 1, 3},
    /* the expert-major layout with rings smaller than a slot: each chunk placed as it lands
     * from the places its sender shipped, the budget's clip, the capacity sequence */
    {"nodes_2x4_expert_major_rings_of_chunks_of_3_pad_16_probs_bf16", 2, 4, 0, 0, 1, 0, 16, 0, 1,
     69u, "2 x 4 nodes, expert-major, rings of 2 x 3 tokens, pad 16, probabilities, bf16", 0, 0,
     3},
    {"nodes_2x2_expert_major_rings_of_chunks_of_1_pad_128_fp8_int64", 2, 2, 1, 1, 1, 0, 128, 0, 1,
     70u, "2 x 2 nodes, expert-major, rings of 2 x 1 tokens, pad 128, fp8, int64", 0, 0, 1},
    {"nodes_4x2_expert_major_budget_overflow_rings_of_chunks_of_5_pad_16_fp8", 4, 2, 1, 0, 1, 0, 16,
     1, 0, 71u, "4 x 2 nodes, expert-major, budget overflow, rings of 2 x 5 tokens, pad 16, fp8",
     0, 0, 5},
    {"nodes_2x4_expert_major_capacity_met_then_one_short_rings_of_chunks_of_3_pad_16_bf16", 2, 4,
     0, 0, 1, 0, 16, 0, 0, 72u,
     "2 x 4 nodes, expert-major, capacity, rings of 2 x 3 tokens, pad 16, bf16", 1, 0, 3},
};
#define N_NODES_SPECS ((int)(sizeof(nodes_specs) / sizeof(nodes_specs[0])))

/* The receive capacity across N x R virtual nodes (handles, probabilities through combine):
 * cap 1 the capacity sequence (exactly met, one row short: HEP_ERR_OVERFLOW on every rank,
 * nothing received on the node of the rank over it, then A again), cap 2 the no-sync drop
 * (the calls themselves with HEP_ASYNC and hep_group_sync: no capture across nodes), then
 * a blocking call that fits. */
static void nodes_cap_case(const nodes_spec *p)
{
    tcase *c = new_case();
    const int W = p->N * p->R, T = small_only() ? 24 : 96, H = small_only() ? 128 : 512;
    if (p->cap == 1 && p->em)
        make_em_cap_case(c, W, T, H, p->fp8, p->pad, p->seed);
    else if (p->cap == 1)
        make_cap_case(c, W, T, H, p->fp8, p->seed);
    else
        make_drop_case(c, W, T, H, p->fp8, p->thin ? p->R : 0, p->seed);
    c->R = p->R;
    c->cfg.ranks_per_node = p->R;
    c->idx64 = p->idx64;
    if (p->chunk > 0) /* the rings of chunks: an overflowing node still consumes them */
        c->cfg.chunk_tokens = p->chunk;
    if (p->thin && (first_over(c, 0, p->R) >= 0 || first_over(c, p->R, W) < 0))
        fail_msg("%s: node 0 must stay below the capacity %d and node 1 exceed it", p->label,
                 c->cap);
    run_case(c, p->label);
    free(c);
}

static void nodes_test(void **state)
{
    const nodes_spec *p = (const nodes_spec *)*state;
    if (p->cap)
        nodes_cap_case(p);
    else if (p->em)
        nodes_em_case(p->N, p->R, p->fp8, p->idx64, p->pad, p->over, p->probs, p->seed, p->label,
                      p->chunk);
    else
        nodes_case(p->N, p->R, p->fp8, p->idx64, p->oneshot, p->seed, p->label, p->chunk);
}

static void em_case(int pad, int fp8, int over, int replays, unsigned seed, const char *name)
{
    tcase *c = new_case();
    make_em_case(c, W_(), T_(), small_only() ? 128 : 1024, fp8, pad, over, seed);
    c->graph_replays = replays;
    run_case(c, name);
    free(c);
}

static void expert_major_pad_1_equals_the_host(void **state)
{
    (void)state;
    em_case(1, 0, 0, 0, 21u, "expert-major, pad 1, bf16");
}

static void expert_major_pad_16_equals_the_host(void **state)
{
    (void)state;
    em_case(16, 0, 0, 0, 22u, "expert-major, pad 16, bf16");
}

static void expert_major_pad_64_equals_the_host(void **state)
{
    (void)state;
    em_case(64, 0, 0, 0, 23u, "expert-major, pad 64, bf16");
}

static void expert_major_pad_128_equals_the_host(void **state)
{
    (void)state;
    em_case(128, 0, 0, 0, 24u, "expert-major, pad 128, bf16");
}

static void expert_major_fp8_rows_carry_their_scales(void **state)
{
    (void)state;
    em_case(16, 1, 0, 0, 25u, "expert-major, pad 16, fp8");
}

static void expert_major_budget_overflow_drops_rows_then_fits(void **state)
{
    (void)state;
    em_case(16, 0, 1, 0, 26u, "expert-major, budget overflow, pad 16");
}

static void expert_major_fp8_budget_overflow(void **state)
{
    (void)state;
    em_case(64, 1, 1, 0, 27u, "expert-major, budget overflow, pad 64, fp8");
}

static void expert_major_graph_replays_equal_the_host(void **state)
{
    (void)state;
    em_case(128, 0, 1, 3, 28u, "expert-major, graph replay x3 (budget overflow, pad 128)");
}

int main(void)
{
    static const struct CMUnitTest one_node[] = {
        cmocka_unit_test(handles_interleaved_reused_and_combined_twice_bf16),
        cmocka_unit_test(handles_interleaved_reused_and_combined_twice_fp8),
        cmocka_unit_test(handles_with_four_ranks_and_int32_routing),
        cmocka_unit_test(capacity_met_then_one_short_then_fits_again),
        cmocka_unit_test(capacity_met_then_one_short_then_fits_again_fp8),
        cmocka_unit_test(expert_major_capacity_met_then_one_short_then_fits_again),
        cmocka_unit_test(no_sync_past_the_capacity_drops_rows_in_graph_replays_then_fits),
        cmocka_unit_test(one_rank_drops_rows_after_a_call_that_fits_then_fits),
        cmocka_unit_test(graph_replays_of_the_no_sync_mode_equal_the_host),
        cmocka_unit_test(expert_major_pad_1_equals_the_host),
        cmocka_unit_test(expert_major_pad_16_equals_the_host),
        cmocka_unit_test(expert_major_pad_64_equals_the_host),
        cmocka_unit_test(expert_major_pad_128_equals_the_host),
        cmocka_unit_test(expert_major_fp8_rows_carry_their_scales),
        cmocka_unit_test(expert_major_budget_overflow_drops_rows_then_fits),
        cmocka_unit_test(expert_major_fp8_budget_overflow),
        cmocka_unit_test(expert_major_graph_replays_equal_the_host),
    };
    enum { N_ONE_NODE = sizeof(one_node) / sizeof(one_node[0]) };
    struct CMUnitTest tests[N_ONE_NODE + N_NODES_SPECS];
    memset(tests, 0, sizeof(tests));
    memcpy(tests, one_node, sizeof(one_node));
    for (int i = 0; i < N_NODES_SPECS; i++) { /* the table's rows, by their names */
        tests[N_ONE_NODE + i].name = nodes_specs[i].test;
        tests[N_ONE_NODE + i].test_func = nodes_test;
        tests[N_ONE_NODE + i].initial_state = (void *)&nodes_specs[i];
    }
    /* one hardware queue per virtual rank and loopback NIC (2 x 4 keeps 16 streams on the
     * GPU): with CUDA's default 8 a NIC's copy queues behind a rank's kernel that waits for
     * it, and the case times out (run directly, 2026-12-06); as test_gpu_ep does */
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    if (hep_gpu_probe(0)) {
        printf("skipped: no usable GPU: %s\n", hep_last_error());
        return 77;
    }
    /* e.g. "*graph_replays*" (tests/test_filter.h): those cases only */
    return hep_run_filtered("tests", tests, sizeof(tests) / sizeof(tests[0]));
}
