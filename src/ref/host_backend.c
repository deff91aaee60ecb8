/* ref/host_backend.c: dispatch and combine on host memory, ranks as threads of one
 * process. It is the reference semantics (the oracle of every GPU test) and the backend of
 * machines without a GPU. Unlike the GPU kernels (sources push rows), each rank here pulls
 * what it needs from the node-mates' published inputs: a second, independent algorithm
 * for the same outputs. Node-mates synchronise through the same monotonic flags, with
 * bounded waits. */
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "core/core.h"
#include "group/group.h"
#include "kernels/ep_kernels.h"

#define HOST_DONE_DISPATCH HEP_FLAG_HOST_DONE
#define HOST_DONE_COMBINE (HEP_FLAG_HOST_DONE + 1)

typedef struct src_view {
    const unsigned char *tokens;
    const float *scales, *weights;
    const void *idx;
    int t, K, index64;
} src_view;

static uint64_t *flags_of(hep_group *g, int l)
{
    return (uint64_t *)hep_peer_buf(g, l, HEP_BUF_FLAGS);
}
static uint64_t *mailbox_of(hep_group *g, int l)
{
    return (uint64_t *)hep_peer_buf(g, l, HEP_BUF_MAILBOX);
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Every node-mate's flags[word] >= e, within HEP_TIMEOUT_MS. */
static int wait_all(hep_group *g, int word, uint64_t e, const char *call, const char *what)
{
    double start = now_ms(), limit = (double)hep_env_get()->timeout_ms;
    for (int l = 0; l < g->R; l++) {
        uint64_t *f = flags_of(g, l) + word;
        unsigned spins = 0;
        while (__atomic_load_n(f, __ATOMIC_ACQUIRE) < e) {
            if ((++spins & 63) == 0) {
                double waited = now_ms() - start;
                if (waited > limit) {
                    int peer = g->node * g->R + l;
                    snprintf(g->broken_msg, sizeof(g->broken_msg),
                             "%s timed out on rank %d after %.0f ms (HEP_TIMEOUT_MS) waiting for "
                             "%s: expected %llu, saw %llu: rank %d did not arrive",
                             call, g->rank, waited, what, (unsigned long long)e,
                             (unsigned long long)__atomic_load_n(f, __ATOMIC_ACQUIRE), peer);
                    g->broken = 1;
                    return hep_fail(HEP_ERR_TIMEOUT, "%s", g->broken_msg);
                }
                sched_yield();
            }
        }
    }
    return HEP_OK;
}

static void view_of(hep_group *g, int l, src_view *v)
{
    const volatile uint64_t *m = mailbox_of(g, l);
    v->tokens = (const unsigned char *)(uintptr_t)m[HEP_MB_TOKENS];
    v->scales = (const float *)(uintptr_t)m[HEP_MB_SCALES];
    v->idx = (const void *)(uintptr_t)m[HEP_MB_IDX];
    v->weights = (const float *)(uintptr_t)m[HEP_MB_WEIGHTS];
    v->t = (int)m[HEP_MB_T];
    v->K = (int)m[HEP_MB_K];
    v->index64 = (int)m[HEP_MB_INDEX64];
}

static long long id_at(const src_view *v, int i, int k)
{
    size_t o = (size_t)i * (size_t)v->K + (size_t)k;
    return v->index64 ? ((const long long *)v->idx)[o] : ((const int *)v->idx)[o];
}

/* Destination ranks of token i (ids out of range are ignored, as on the GPU). */
static uint64_t dest_mask(const hep_group *g, const src_view *v, int i)
{
    long long E = (long long)g->cfg.experts_per_rank * g->R;
    uint64_t m = 0;
    for (int k = 0; k < v->K; k++) {
        long long x = id_at(v, i, k);
        if (x >= 0 && x < E)
            m |= 1ull << (x / g->cfg.experts_per_rank);
    }
    return m;
}

static int first_invalid(const hep_group *g, const src_view *v, int *tok, int *slot, long long *val)
{
    long long E = (long long)g->cfg.experts_per_rank * g->R;
    for (int i = 0; i < v->t; i++)
        for (int k = 0; k < v->K; k++) {
            long long x = id_at(v, i, k);
            if (x < -1 || x >= E) {
                *tok = i, *slot = k, *val = x;
                return 1;
            }
        }
    return 0;
}

/* Copy token i of source v into my receive row `row`; count its local experts. */
static void receive(hep_group *g, const src_view *v, int i, int row, int *tpe)
{
    const int El = g->cfg.experts_per_rank, H = g->cfg.hidden;
    const size_t rb = (size_t)H * (g->cfg.dtype == HEP_DTYPE_FP8_E4M3 ? 1 : 2);
    float *prob = (float *)hep_my_buf(g, HEP_BUF_RECV_PROB) + (size_t)row * (size_t)El;
    long long first = (long long)g->rank * El;
    memcpy(hep_my_buf(g, HEP_BUF_TOKEN_X) + (size_t)row * rb, v->tokens + (size_t)i * rb, rb);
    if (g->cfg.dtype == HEP_DTYPE_FP8_E4M3) {
        size_t ns = (size_t)H / HEP_FP8_BLOCK;
        memcpy((float *)hep_my_buf(g, HEP_BUF_RECV_SCALE) + (size_t)row * ns,
               v->scales + (size_t)i * ns, ns * sizeof(float));
    }
    memset(prob, 0, (size_t)El * sizeof(float));
    for (int k = 0; k < v->K; k++) {
        long long x = id_at(v, i, k);
        int dup = 0;
        if (x < first || x >= first + El)
            continue;
        prob[x - first] += v->weights[(size_t)i * (size_t)v->K + (size_t)k];
        for (int q = 0; q < k; q++)
            dup |= id_at(v, i, q) == x;
        if (!dup)
            tpe[x - first]++;
    }
}

int hep_host_dispatch(hep_group *g, const hep_dispatch_args *a, hep_dispatch_result *o)
{
    const int R = g->R, me = g->local, El = g->cfg.experts_per_rank;
    uint64_t *mb = mailbox_of(g, me), e = g->epoch + 1;
    int *host_counts = (int *)hep_my_buf(g, HEP_BUF_HOST_COUNTS);
    int *rows = (int *)hep_my_buf(g, HEP_BUF_HANDLE_ROWS);
    int row = 0, rc, tok = 0, slot = 0, bad;
    long long val = 0;
    src_view mine;

    mb[HEP_MB_TOKENS] = (uint64_t)(uintptr_t)a->tokens;
    mb[HEP_MB_SCALES] = (uint64_t)(uintptr_t)a->scales;
    mb[HEP_MB_IDX] = (uint64_t)(uintptr_t)a->topk_idx;
    mb[HEP_MB_WEIGHTS] = (uint64_t)(uintptr_t)a->topk_weights;
    mb[HEP_MB_T] = (uint64_t)a->num_tokens;
    mb[HEP_MB_K] = (uint64_t)a->topk;
    mb[HEP_MB_INDEX64] = a->index_type == HEP_INDEX_INT64;
    __atomic_store_n(flags_of(g, me) + HEP_FLAG_COUNTS_READY, e, __ATOMIC_RELEASE);
    rc = wait_all(g, HEP_FLAG_COUNTS_READY, e, "dispatch", "its routing to be published");
    if (rc)
        return rc;

    memset(host_counts, 0, (size_t)(El + 1) * sizeof(int));
    /* what I receive, in [source rank][token] order */
    for (int s = 0; s < R; s++) {
        src_view v;
        view_of(g, s, &v);
        for (int i = 0; i < v.t; i++)
            if (dest_mask(g, &v, i) >> me & 1)
                receive(g, &v, i, row++, host_counts + 1);
    }
    host_counts[0] = row;
    /* where my tokens landed: the rows of the sources before me come first */
    view_of(g, me, &mine);
    for (int d = 0; d < R; d++) {
        int next = 0;
        for (int s = 0; s < me; s++) {
            src_view v;
            view_of(g, s, &v);
            for (int i = 0; i < v.t; i++)
                next += (int)(dest_mask(g, &v, i) >> d & 1);
        }
        for (int i = 0; i < mine.t; i++)
            rows[(size_t)i * (size_t)R + (size_t)d] = dest_mask(g, &mine, i) >> d & 1 ? next++ : -1;
    }
    bad = first_invalid(g, &mine, &tok, &slot, &val);
    /* nobody may return (and free its inputs) while another still reads them */
    __atomic_store_n(flags_of(g, me) + HOST_DONE_DISPATCH, e, __ATOMIC_RELEASE);
    rc = wait_all(g, HOST_DONE_DISPATCH, e, "dispatch", "the node-mates to finish reading");
    if (rc)
        return rc;

    g->epoch = e;
    g->last_t = a->num_tokens;
    g->last_recv = row;
    g->last_handle = e;
    hep_fill_dispatch_result(g, o);
    o->num_recv_device = host_counts; /* host memory: the host backend's "device" */
    o->tokens_per_expert_device = host_counts + 1;
    o->num_recv = row;
    o->handle = e;
    if (bad)
        return hep_fail(HEP_ERR_INVALID,
                        "dispatch on rank %d: topk_idx[%d][%d] = %lld is not -1 or an expert id "
                        "in 0..%d (that slot was ignored)",
                        g->rank, tok, slot, val, El * g->world - 1);
    return HEP_OK;
}

static float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static uint16_t f32_to_bf16(float f) /* round to nearest even, as __float2bfloat16_rn */
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fff;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

int hep_host_combine(hep_group *g, const hep_combine_args *a)
{
    const int R = g->R, me = g->local, H = g->cfg.hidden;
    const uint64_t e = g->epoch;
    const int *rows = (const int *)hep_my_buf(g, HEP_BUF_HANDLE_ROWS);
    float acc[512];
    int rc;

    mailbox_of(g, me)[HEP_MB_COMBINE_IN] =
        (uint64_t)(uintptr_t)(a->expert_out ? a->expert_out : hep_my_buf(g, HEP_BUF_TOKEN_X));
    __atomic_store_n(flags_of(g, me) + HEP_FLAG_COMBINE_READY, e, __ATOMIC_RELEASE);
    rc = wait_all(g, HEP_FLAG_COMBINE_READY, e, "combine", "its expert outputs");
    if (rc)
        return rc;
    for (int i = 0; i < g->last_t; i++) {
        uint16_t *out = (uint16_t *)a->out + (size_t)i * (size_t)H;
        for (int c0 = 0; c0 < H; c0 += 512) {
            int n = H - c0 < 512 ? H - c0 : 512;
            memset(acc, 0, sizeof(acc));
            for (int d = 0; d < R; d++) { /* ascending destination rank, as the GPU sums */
                int r = rows[(size_t)i * (size_t)R + (size_t)d];
                const uint16_t *src;
                if (r < 0)
                    continue;
                src = (const uint16_t *)(uintptr_t)mailbox_of(g, d)[HEP_MB_COMBINE_IN] +
                      (size_t)r * (size_t)H + (size_t)c0;
                for (int c = 0; c < n; c++)
                    acc[c] += bf16_to_f32(src[c]);
            }
            for (int c = 0; c < n; c++)
                out[c0 + c] = f32_to_bf16(acc[c]);
        }
    }
    __atomic_store_n(flags_of(g, me) + HOST_DONE_COMBINE, e, __ATOMIC_RELEASE);
    return wait_all(g, HOST_DONE_COMBINE, e, "combine", "the node-mates to finish reading");
}
