// kernels/dispatch.cu: the dispatch kernel (see ep_kernels.h for the protocol). One kernel
// per call, S blocks; block b owns tokens [b*chunk, (b+1)*chunk) of each list:
//  0. (N > 1) the other nodes' rows are in flight; their count blocks come first.
//  1. every block scans its own tokens (layout.cuh) and arrives at the rank's grid counter.
//  2. block 0 publishes the rank's counts, waits for every node-mate's and lays out; the
//     other blocks make their positions rank-wide meanwhile. (One node, rank-major: the
//     last block to arrive publishes, and every block lays out its own rows; layout.cuh.)
//  3. every block pushes its tokens' rows, probabilities and scales to their destinations
//     (own tokens first, then, N > 1, each other node's slot once it arrived) and arrives
//     at every destination; block 0 waits for every source's S arrivals.
#include <cuda_runtime.h>
#include <stdint.h>
#if defined(HEP_LAYOUT_TRACE) || defined(HEP_BLOCK_TRACE) || defined(HEP_NODE_TRACE)
#include <cstdio>
#endif

#include "kernels/ep_kernels.h"
#include "kernels/vec.cuh"

/* This file compiles twice: as itself (plain stores) and inside dispatch_bulk.cu with
 * HEP_BULK_STORES, whose kernel and entry points carry the suffix _bulk. All but the C
 * entry points at the end is in the namespace hep_dispatch (hep_dispatch_bulk), so that the
 * two compilations' device functions stay apart in the one library. */
#ifndef HEP_DISPATCH_NAME
#define HEP_DISPATCH_NAME(x) x
#endif

namespace HEP_DISPATCH_NAME(hep_dispatch) {
#include "kernels/layout.cuh"
#include "kernels/ring.cuh"

/* Tuning (bench/NOTES.md has what was measured): threads per block; 16-byte vectors per
 * lane in flight (DU); a row is cut into equal passes of at most 32 x DU vectors. */
#ifndef DISPATCH_THREADS
#define DISPATCH_THREADS HEP_DISPATCH_THREADS
#endif
#ifndef DU
#define DU 14
#endif
#ifdef HEP_STREAMING_STORES /* evict-first: the rows are not read again by this kernel */
#define ST_ROW(p, v) __stcs((p), (v))
#else
#define ST_ROW(p, v) (*(p) = (v))
#endif

#ifdef HEP_BULK_STORES
// Bulk stores (dispatch_bulk.cu; bench/NOTES.md, "Session 6"): each pass is staged once in
// the warp's shared memory and every pair's lane issues one bulk copy (cp.async.bulk,
// shared -> global) of it, so the stores leave the warp's issue slots and registers.
// Dynamic shared memory starts where the static ends, rounded up to this alignment: 128, so
// that the stages stay on 128-byte lines whatever static shared memory the kernel has
// (16 bytes off, the one-rank dispatch was 70% slower at 16 SMs: bench/NOTES.md, session
// 21; tests/kernel_spills.sh checks it).
extern __shared__ __align__(128) uint4 hep_stage[];
__device__ __forceinline__ void bulk_wait_read()
{
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_all()
{
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
}
/* The pipelined push (push_range_bulk): each warp's ring of BULK_NS stages of BULK_CH bytes
 * (an mbarrier each, in static shared memory); BULK_LAG chunks' stores may still read their
 * stages while BULK_NS - BULK_LAG chunks load. The stage region holds it or push_row's stage,
 * whichever is larger. */
#ifndef BULK_PIPE
#define BULK_PIPE 1
#endif
#ifndef BULK_NS
#define BULK_NS 3
#endif
#ifndef BULK_CH
#define BULK_CH 3584
#endif
#ifndef BULK_LAG
#define BULK_LAG 1
#endif
#define ROW_STAGE_BYTES ((size_t)(DISPATCH_THREADS / 32) * 32 * DU * 16)
#define RING_STAGE_BYTES ((size_t)(DISPATCH_THREADS / 32) * BULK_NS * BULK_CH)
#define STAGE_BYTES (ROW_STAGE_BYTES > RING_STAGE_BYTES ? ROW_STAGE_BYTES : RING_STAGE_BYTES)
#else
#define STAGE_BYTES ((size_t)0)
__device__ __forceinline__ void bulk_wait_all() {}
#endif

// One warp copies source row `src` to the rows of the pairs in `mask`: lane k holds pair
// k's destination kd and its row there (rank-major: lane d is destination d, kd = d;
// expert-major: lane k is slot k). Each pass loads up to DU vectors per lane (all in flight
// together), then stores them to every pair's row.
template <int U = DU>
__device__ __forceinline__ void push_row(const uint4 *src, bool slot, unsigned mask, int kd,
                                         int row, char *const *s_x, size_t rb, int nvec,
                                         int per_pass)
{
    const int lane = threadIdx.x & 31;
    for (int v0 = 0; v0 < nvec; v0 += per_pass) {
        const int v1 = min(nvec, v0 + per_pass);
        uint4 buf[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int q = v0 + u * 32 + lane;
            if (q < v1)
                buf[u] = slot ? ld_cg(src + q) : __ldg(src + q);
        }
#ifdef HEP_BULK_STORES
        uint4 *stage = hep_stage + (threadIdx.x >> 5) * (32 * U);
        bulk_wait_read(); /* the previous pass's copies have read the stage */
        __syncwarp();
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int q = v0 + u * 32 + lane;
            if (q < v1)
                stage[q - v0] = buf[u];
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncwarp();
        if ((mask >> lane) & 1u) {
            char *dst = s_x[kd] + (size_t)row * rb + (size_t)v0 * 16;
            const unsigned sa = (unsigned)__cvta_generic_to_shared(stage);
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n\t"
                         "cp.async.bulk.commit_group;" ::"l"(dst),
                         "r"(sa), "r"((unsigned)(v1 - v0) * 16u)
                         : "memory");
        }
#else
        for (unsigned m = mask; m; m &= m - 1) {
            const int k = __ffs(m) - 1;
            const int d = __shfl_sync(FULL, kd, k), r = __shfl_sync(FULL, row, k);
            uint4 *dst = (uint4 *)(s_x[d] + (size_t)r * rb);
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int q = v0 + u * 32 + lane;
                if (q < v1)
                    ST_ROW(dst + q, buf[u]);
            }
        }
#endif
    }
}

// What one warp needs to push token i of list L besides its row (token_meta): lane d's
// row at destination d (-1: none), the destinations written, and lane k's share of the
// token's probabilities and scales (token_tail writes them).
struct tok_meta {
    unsigned mask;
    int row, kd, ke;
    float pk;
    bool writer, vec_scale;
    float4 sc;
};

// Token i of list L (row vi of the view, the same for the own tokens): its positions,
// slots, weights and scales, loaded together before any of them is used (one memory round
// trip ahead of the row's loads, not three in a row). A row at or past the receive
// capacity is not written (only a layout of HEP_ASYNC has one); with `drop_cnt` (this
// rank's published counts of list L) each of its local experts there is taken off the
// count, which the destination sums again after the arrivals. A slot's token takes its
// positions from the offsets its sender shipped and records them in dest_rows (list L's
// positions, which combine reads). With `pre` (the blocks' own layout) the own token's
// positions are its block's: made rank-wide here (plus pre[d], the rows of the earlier
// blocks) and recorded. m.mask = 0: nothing to write.
__device__ __forceinline__ tok_meta token_meta(const hep_kargs &a, const lview &v, int L, int i,
                                               int vi, int mybase, const float *const *s_scale,
                                               int *drop_cnt, const int *pre)
{
    const int R = a.R, El = a.El, lane = threadIdx.x & 31;
    const long long first = (long long)a.rank0 * El;
    const size_t T = (size_t)a.T;
    tok_meta m;
    int *drow = a.dest_rows + ((size_t)L * T + i) * R;
    /* (L2: with a rank-wide token counter another block's scan wrote them) */
    int pos = lane >= R ? -1 : __ldcg(v.off ? v.off + (size_t)vi * R + lane : drow + lane);
    if (pre && pos >= 0) {
        pos += pre[lane];
        drow[lane] = pos;
    }
    if (v.off && lane < R)
        drow[lane] = pos;
    i = vi; /* from here on, the view's row */
    const long long myid = lane < v.K ? list_id(a, v, i, lane) : -2;
    const float myw = lane < v.K ? list_w(a, v, i, lane) : 0.f;
    m.vec_scale = a.nscale % 4 == 0 && a.nscale <= 128 && ((uintptr_t)v.scl & 15) == 0 &&
                  ((uintptr_t)s_scale[0] & 15) == 0;
    m.sc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m.vec_scale && lane < a.nscale / 4) /* one 16-byte vector a lane where they fit */
        m.sc = v.slot ? __ldcg((const float4 *)(v.scl + (size_t)i * a.nscale) + lane)
                      : ((const float4 *)(v.scl + (size_t)i * a.nscale))[lane];
    const bool dropped = pos >= 0 && a.cap && mybase + pos >= a.cap;
    m.row = pos >= 0 && !dropped ? mybase + pos : -1;
    m.mask = __ballot_sync(FULL, m.row >= 0);
    const unsigned dmask = __ballot_sync(FULL, dropped);
    m.writer = false, m.kd = -1, m.ke = 0, m.pk = 0.f;
    if (!m.mask && !dmask)
        return m;
    // once per token, lane k: slot k's expert at this node and its probability, summed
    // over the slots of the same expert (in slot order); the first such slot writes it
    const bool here = myid >= first && myid < first + (long long)R * El;
    bool writer = here;
    for (int q = 0; q < v.K; q++) {
        const long long x = __shfl_sync(FULL, myid, q);
        const float w = __shfl_sync(FULL, myw, q);
        m.pk += x == myid ? w : 0.f;
        writer &= !(q < lane && x == myid);
    }
    m.writer = writer;
#if MASK_MAGIC /* key / El by the host's multiply-high factor, not a 64-bit division */
    const int key = here ? (int)(myid - first) : 0;
    const int kd = (int)hep_div_by_magic((unsigned)key, a.el_magic);
    m.kd = here ? kd : -1;
    m.ke = here ? key - kd * El : 0;
#else
    m.kd = here ? (int)((myid - first) / El) : -1;
    m.ke = here ? (int)((myid - first) % El) : 0;
#endif
    /* the scan counted each (destination, expert) of the token once */
    if (dmask && drop_cnt && writer && ((dmask >> m.kd) & 1u))
        atomicSub(drop_cnt + m.kd * (El + 1) + 1 + m.ke, 1);
    return m;
}

// The token's probabilities and scales at every destination in m.mask (row vi of the view).
// HEP_NO_TOKEN_TAIL (a measurement build only: its probabilities and scales are not written,
// so `hybridep bench` runs it with HEP_BENCH_UNVERIFIED=1): what these writes cost the push.
__device__ __forceinline__ void token_tail(const hep_kargs &a, const lview &v, int vi,
                                           const tok_meta &m, float *const *s_prob,
                                           float *const *s_scale)
{
#ifndef HEP_NO_TOKEN_TAIL
    const int El = a.El, lane = threadIdx.x & 31;
    for (unsigned mm = m.mask; mm; mm &= mm - 1) {
        const int d = __ffs(mm) - 1;
        const int r = __shfl_sync(FULL, m.row, d);
        float *prob = s_prob[d] + (size_t)r * El;
        for (int j = lane; j < El; j += 32)
            prob[j] = 0.f;
        __syncwarp(); /* orders the zeros before the slots' values, lane to lane */
        if (m.writer && m.kd == d)
            prob[m.ke] = m.pk;
        if (m.vec_scale) {
            if (lane < a.nscale / 4)
                ((float4 *)(s_scale[d] + (size_t)r * a.nscale))[lane] = m.sc;
        } else {
            for (int c = lane; c < a.nscale; c += 32)
                s_scale[d][(size_t)r * a.nscale + c] =
                    v.slot ? __ldcg(v.scl + (size_t)vi * a.nscale + c)
                           : v.scl[(size_t)vi * a.nscale + c];
        }
    }
#endif
}

// One warp pushes token i of list L (row vi of the view): its row, probabilities and
// scales at every destination (token_meta says which and where).
template <int U = DU>
__device__ __forceinline__ void push_token(const hep_kargs &a, const lview &v, int L, int i,
                                           int vi, int mybase, char *const *s_x,
                                           float *const *s_prob, float *const *s_scale,
                                           int *drop_cnt, const int *pre = NULL)
{
    const size_t rb = (size_t)a.H * a.esize;
    const int nvec = (int)(rb / 16);
    /* equal passes: a 14 KB row is two passes of 448 vectors, not 512 + 384 */
    const int passes = (nvec + 32 * U - 1) / (32 * U);
    const int per_pass = ((nvec + passes - 1) / passes + 31) & ~31;
    const tok_meta m = token_meta(a, v, L, i, vi, mybase, s_scale, drop_cnt, pre);
    if (!m.mask)
        return;
    push_row<U>((const uint4 *)(v.tok + (size_t)vi * rb), v.slot, m.mask, threadIdx.x & 31,
                m.row, s_x, rb, nvec, per_pass);
    token_tail(a, v, vi, m, s_prob, s_scale);
}

#ifdef HEP_BULK_STORES
// One warp pushes tokens [w0, w1) of list L with no registers on the rows' path: the rows
// stream through the warp's ring of BULK_NS shared-memory stages in chunks of BULK_CH bytes.
// Lane 0 loads chunk n (item n = token w0 + n / nch, chunk n % nch) with a bulk copy
// (global -> shared, completing on the stage's mbarrier); once it landed, every lane whose
// destination gets the token stores it with a bulk copy (shared -> global), and the stage
// whose stores are BULK_LAG chunks back is loaded with chunk n + BULK_NS - BULK_LAG. The
// loads run ahead across tokens while a token's metadata is loaded and its probabilities and
// scales written (token_meta, token_tail). At one rank it is 2-5% faster than one stage a
// warp filled through registers (push_row), equal at 64 SMs (bench/NOTES.md, session 18).
// Every chunk is waited for even where no destination takes it, so that each stage's
// mbarrier phase is its use count. (The mbarrier wait is on this warp's own copy, not on
// another rank: it ends unless the copy faults, which ends the kernel.)
__device__ void push_range_bulk(const hep_kargs &a, const lview &v, int L, int w0, int w1,
                                int mybase, char *const *s_x, float *const *s_prob,
                                float *const *s_scale, int *drop_cnt, const int *pre,
                                unsigned long long *bars)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned rb = (unsigned)((size_t)a.H * a.esize), nch = (rb + BULK_CH - 1) / BULK_CH;
    const unsigned n_end = (unsigned)max(w1 - w0, 0) * nch;
    const unsigned bar0 = (unsigned)__cvta_generic_to_shared(bars + warp * BULK_NS);
    const unsigned st0 = (unsigned)__cvta_generic_to_shared(hep_stage) +
                         (unsigned)(warp * BULK_NS * BULK_CH);
    if (n_end == 0)
        return;
    if (lane < BULK_NS)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + lane * 8) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncwarp();
    auto load = [&](unsigned n) {
        if (n >= n_end || lane != 0)
            return;
        const unsigned s = n % BULK_NS, c = n % nch, off = c * BULK_CH;
        const unsigned bytes = min((unsigned)BULK_CH, rb - off);
        const char *src = v.tok + (size_t)(w0 + (int)(n / nch)) * rb + off;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar0 + s * 8),
                     "r"(bytes)
                     : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                     "[%0], [%1], %2, [%3];" ::"r"(st0 + s * BULK_CH),
                     "l"(src), "r"(bytes), "r"(bar0 + s * 8)
                     : "memory");
    };
    for (unsigned n = 0; n + BULK_LAG < BULK_NS; n++)
        load(n);
    for (int i = w0; i < w1; i++) {
        const tok_meta m = token_meta(a, v, L, i, i, mybase, s_scale, drop_cnt, pre);
        const unsigned n0 = (unsigned)(i - w0) * nch;
        for (unsigned c = 0; c < nch; c++) {
            const unsigned n = n0 + c, s = n % BULK_NS, off = c * BULK_CH;
            mbar_wait(bar0 + s * 8, (n / BULK_NS) & 1u);
            if ((m.mask >> lane) & 1u) {
                char *dst = s_x[lane] + (size_t)m.row * rb + off;
                asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                                 dst),
                             "r"(st0 + s * BULK_CH), "r"(min((unsigned)BULK_CH, rb - off))
                             : "memory");
            }
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            /* chunk n + NS - LAG goes to the stage of chunk n - LAG, whose stores read it */
            asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(BULK_LAG) : "memory");
            __syncwarp();
            load(n + BULK_NS - BULK_LAG);
        }
        if (m.mask)
            token_tail(a, v, i, m, s_prob, s_scale);
    }
}
#endif

// Block b's warps push tokens of list L, in one of three ways (bench/NOTES.md, sessions 13,
// 14 and 17, has what each gave):
//  - `pre_all` (plain stores, one node, rank-major: the build where node-mates share this
//    GPU, a token going to up to R of them) or RANK (across nodes, rank-major, both
//    builds): the rank's warps share its tokens through the counter HEP_WORK_DISPATCH.
//    Warp g of the grid (b x warps + w) takes token g first, then token W + k (W warps in
//    all) for each k the counter gives it after a push, so that the rank ends with its last
//    warp, not with its slowest block: blocks of equal tokens took from 0.61 to 0.93 ms at
//    eight ranks x 16 SMs (HEP_BLOCK_TRACE). On one node a token's positions are its own
//    block's, made rank-wide by pre_all[its block] (own_layout) as it is pushed; across
//    nodes they are rank-wide already (rebase_list). The kernel's last block resets the
//    counter (work_done).
//  - GRAB (plain stores otherwise): warp w takes the block's token w first, then the
//    block's next untaken one from the shared counter `grab` (zero before the call; one
//    call a kernel).
//  - otherwise each warp takes consecutive tokens of the block's share: with bulk stores
//    on one node (one rank a GPU) either counter was 7-12% slower at 16 SMs (session 22,
//    the stages aligned; session 13's 40% for the block's was mostly their misalignment).
// DISPATCH_RGRAB and DISPATCH_GRAB override the choices (tuning). The row bases are block
// 0's (meta), or with `base` the block's own (shared memory), its positions then made
// rank-wide by `pre` as they are pushed.
#ifndef DISPATCH_RGRAB
#ifdef HEP_BULK_STORES
#define DISPATCH_RGRAB 0
#else
#define DISPATCH_RGRAB 1
#endif
#endif
#ifndef DISPATCH_GRAB
#ifdef HEP_BULK_STORES
#define DISPATCH_GRAB 0
#else
#define DISPATCH_GRAB 1
#endif
#endif
// HEP_BLOCK_TRACE (a measurement build, one node, rank-major): every block's thread 0
// prints the global timer at its entry, at the start of its push, when its first and last
// warp finished pushing, before its arrivals (block 0: after the outputs it writes) and at
// its end (block 0: once every block of every node-mate arrived), one line a block and call,
// with the SM it ran on and how many tokens its warps took from the rank's counter.
#ifdef HEP_BLOCK_TRACE
__shared__ unsigned bt_tokens;
__device__ __forceinline__ unsigned smid()
{
    unsigned r;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
    return r;
}
#define BTRACE_TOKEN() ((threadIdx.x & 31) == 0 ? (void)atomicAdd(&bt_tokens, 1u) : (void)0)
#define BTRACE(k) (threadIdx.x == 0 ? (void)(bt[k] = now_ns()) : (void)0)
#define BTRACE_WARP()                                                                      \
    do {                                                                                   \
        if ((threadIdx.x & 31) == 0) {                                                     \
            const unsigned long long t_ = now_ns();                                        \
            atomicMin(&bt_w[0], t_);                                                       \
            atomicMax(&bt_w[1], t_);                                                       \
        }                                                                                  \
    } while (0)
#else
#define BTRACE_TOKEN() ((void)0)
#define BTRACE(k) ((void)0)
#define BTRACE_WARP() ((void)0)
#endif

template <bool GRAB = DISPATCH_GRAB, bool RANK = false>
__device__ void push_list(const hep_kargs &a, const lview &v, int L, char *const *s_x,
                          float *const *s_prob, float *const *s_scale, int *grab,
                          int *drop_cnt = NULL, const int *base = NULL, const int *pre = NULL,
                          const int *pre_all = NULL)
{
    const int lane = threadIdx.x & 31;
    const int mybase = lane >= a.R ? 0
                       : base      ? base[L * a.R + lane]
                                   : ld_l2(a.meta + L * a.R + lane);
    int t0, t1;
    block_range(v.t, blockIdx.x, gridDim.x, t0, t1);
    if (RANK || pre_all) {
        const int nw = blockDim.x >> 5, W = gridDim.x * nw;
        const int chunk = (v.t + gridDim.x - 1) / gridDim.x; /* block_range's */
        for (int i = blockIdx.x * nw + (threadIdx.x >> 5); i < v.t;) {
            push_token(a, v, L, i, i, mybase, s_x, s_prob, s_scale, drop_cnt,
                       RANK ? NULL : pre_all + (size_t)(i / chunk) * a.R);
            BTRACE_TOKEN();
            unsigned k = 0;
            if (lane == 0)
                k = atomicAdd(a.work + HEP_WORK_DISPATCH, 1u);
            i = W + (int)__shfl_sync(FULL, k, 0);
        }
    } else if (GRAB) {
        const int nw = blockDim.x >> 5;
        for (int i = t0 + (threadIdx.x >> 5); i < t1;) {
            push_token(a, v, L, i, i, mybase, s_x, s_prob, s_scale, drop_cnt, pre);
            int k = 0;
            if (lane == 0)
                k = atomicAdd(grab, 1);
            i = t0 + nw + __shfl_sync(FULL, k, 0);
        }
    } else {
#ifdef HEP_STRIDED_TOKENS
        for (int i = t0 + (threadIdx.x >> 5); i < t1; i += blockDim.x >> 5)
            push_token(a, v, L, i, i, mybase, s_x, s_prob, s_scale, drop_cnt, pre);
#else
        int w0, w1;
        warp_range(t0, t1, threadIdx.x >> 5, blockDim.x >> 5, w0, w1);
#if defined(HEP_BULK_STORES) && BULK_PIPE
        __shared__ unsigned long long s_bars[DISPATCH_THREADS / 32 * BULK_NS];
        if (!v.slot) { /* the own tokens (a slot's rows land late: ld_cg, one token a time) */
            push_range_bulk(a, v, L, w0, w1, mybase, s_x, s_prob, s_scale, drop_cnt, pre,
                            s_bars);
            w0 = w1;
        }
#endif
        for (int i = w0; i < w1; i++)
            push_token(a, v, L, i, i, mybase, s_x, s_prob, s_scale, drop_cnt, pre);
#endif
    }
    bulk_wait_all(); /* HEP_BULK_STORES: the list's copies are done (and their stage read) */
}

// The end of every block: it arrives at every destination; block 0 waits for every
// source's S arrivals here (`e * S` in all where every call arrives). A rank alone on one
// node skips both where it has no dropped rows to count again, as no other rank writes
// here and the kernel's end orders its own rows for whoever reads them next (bench/NOTES.md,
// sessions 20 to 22); a call with drops still arrives, and block 0 waits for
// `solo_base + S`, solo_base being the arrivals it read at the kernel's start (before the
// layout step, which no block passes before block 0 published its counts, so before any
// block of this call could arrive), as earlier calls may not have arrived.
__device__ __forceinline__ void arrive_all(const hep_kargs &a, unsigned long long e,
                                           unsigned long long solo_base = 0)
{
    const int R = a.R, tid = threadIdx.x;
    const bool solo = R == 1 && a.N == 1;
    if (solo && !a.drop)
        return;
    __syncthreads();
    if (tid == 0) {
        fence_peers(a);
        for (int d = 0; d < R; d++)
            red_add_release_peers(a, a.flags[d] + HEP_FLAG_DISPATCH_ARRIVE + a.local, 1ull);
    }
    if (blockIdx.x == 0 && tid < R)
        wait_mate(a, a.flags[a.local] + HEP_FLAG_DISPATCH_ARRIVE + tid,
                  solo ? solo_base + gridDim.x : e * (unsigned long long)gridDim.x,
                  HEP_STAGE_DISPATCH, tid);
}

// Block 0, after arrive_all, when this rank's rows went past the capacity with a.drop:
// every source (each node-mate, for each of the N lists it forwards) took its dropped
// rows' experts off its published counts of that list before it arrived, so their sum over
// the sources of every list is now what was kept per local expert.
__device__ void drop_recount(const hep_kargs &a, unsigned long long e)
{
    const int R = a.R, El = a.El, NR = a.N * R;
    const size_t LW = (size_t)R * (El + 1), par = (size_t)(e & 1) * a.N * LW;
    __syncthreads(); /* the arrivals that threads tid < R acquired, for every thread */
    /* the rows this rank dropped, as its layout step wrote them (s.tot holds the last
     * slot list's block totals by now, N > 1: rebase_list reuses it) */
    if (!a.drop || a.ovf[2] == 0)
        return;
    for (int j = threadIdx.x; j < El; j += blockDim.x) {
        int c = 0;
        for (int q = 0; q < NR; q++) /* source (list q / R, local rank q % R) */
            c += ld_l2(a.counts[q % R] + par + (size_t)(q / R) * LW + (size_t)a.local * (El + 1) +
                       1 + j);
        a.tokens_per_expert[j] = c;
        a.host_counts[1 + j] = c;
    }
}

// A caller handle records the routing for a later HEP_REUSE_LAYOUT dispatch and for the
// probabilities of combine: [t][K] int32 ids (not in 0..E-1: -1, as the scan ignores them)
// and the weights. Read only by later kernels.
__device__ void record_routing(const hep_kargs &a)
{
    const long long E = (long long)a.El * a.R * a.N;
    const size_t n = (size_t)a.t * a.K;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (size_t)gridDim.x * blockDim.x) {
        const long long x = topk_at(a, (int)(k / a.K), (int)(k % a.K));
        a.rec_ids[k] = x >= 0 && x < E ? (int)x : -1;
        a.rec_w[k] = a.weights[k];
    }
}

static_assert(DISPATCH_THREADS >= HEP_GPU_MAX_NODES, "one thread per other node (wait_slots)");

// ---- N > 1: the inter-node rings (kernels/ring.cuh), both sides in this kernel.
// The rank's warps share its work across nodes: the own tokens through the rank's token
// counter (NODES_RGRAB: push_list's; their positions are made rank-wide before the push),
// and each landed chunk's rows through the position's count of rows taken (NODES_FGRAB), so
// that the rank's forwarding starts when its warps are done, not its slowest SM's share.
// With fixed shares the own push ended 0.6 ms apart between a rank's first and last warp
// at 2 x 4 x 12 SMs (HEP_NODE_TRACE), and the forwarding of chunk 0, landed meanwhile,
// waited for the last; shared, dispatch is 3-7% faster there with plain stores, 5% with
// the bulk build forced (bench/NOTES.md, session 17). (On one node the bulk build keeps
// fixed shares: there the rank's counter was 10% slower, with one rank alone on the GPU.)
#ifndef NODES_RGRAB
#define NODES_RGRAB 1
#endif
#ifndef NODES_FGRAB
#define NODES_FGRAB NODES_RGRAB
#endif
#ifndef RING_DU
/* 16-byte vectors a lane in flight when forwarding a chunk: the rings' state is live there
 * too, and with DU (or 8) of them ptxas spills registers in the across-nodes instance; 6
 * spills none (a tuning knob: bench/gpu_variants.sh, bench/gpu_ab.sh) */
#define RING_DU 6
#endif

// This block's share of chunk k (`rows` tokens) of the ring to node m: each token's row,
// sanitized routing, offsets at m's ranks (the pack's) and scales into position k % P of
// the send staging, one warp a token. (The row's loop is plain: the compiler batches its
// read-only loads itself, as fast as 5, 7 or 14 explicit vectors a lane; one explicit
// vector at a time was 5-23% slower, and explicit vectors spill in some instance:
// bench/NOTES.md, session 16.)
__device__ void pack_chunk(const hep_kargs &a, int m, int k, int rows)
{
    const int lane = threadIdx.x & 31, R = a.R, N = a.N;
    const long long E = (long long)a.El * R * N;
    const size_t rb = (size_t)a.H * a.esize, nvec = rb / 16, ST = (size_t)a.ST;
    const size_t j = (size_t)slot_index(m, a.node);
    const size_t row0 = (size_t)(k % a.P) * a.C;
    int *route = a.send_route + j * ST * (size_t)HEP_GPU_ROUTE_WORDS(a.kmax, R);
    const int *list = a.slot_list + (size_t)m * a.T + (size_t)k * a.C;
    int r0, r1, w0, w1;
    block_range(rows, blockIdx.x, gridDim.x, r0, r1);
    warp_range(r0, r1, threadIdx.x >> 5, blockDim.x >> 5, w0, w1);
    for (int r = w0; r < w1; r++) {
        const int i = list[r];
        const size_t row = row0 + (size_t)r;
        long long myid = lane < a.K ? topk_at(a, i, lane) : -1;
        if (myid < -1 || myid >= E)
            myid = -1; /* reported by the scan; travels as an unused slot */
        const float myw = lane < a.K ? a.weights[(size_t)i * a.K + lane] : 0.f;
        const uint4 *src = (const uint4 *)((const char *)a.tokens + (size_t)i * rb);
        uint4 *dst = (uint4 *)(a.send_token + (j * ST + row) * rb);
        for (size_t v = lane; v < nvec; v += 32)
            dst[v] = __ldg(src + v);
        if (lane < a.kmax) {
            route[row * a.kmax + lane] = (int)myid;
            ((float *)route)[(ST + row) * a.kmax + lane] = myw;
        }
        if (lane < R)
            route[2 * ST * a.kmax + row * R + lane] = a.pack_off[((size_t)i * N + m) * R + lane];
        if (a.emajor && lane < a.kmax) /* the places of the pack (node_pack.cu) */
            route[(2 * a.kmax + R) * ST + row * a.kmax + lane] =
                a.em_place[(size_t)i * a.kmax + lane];
        for (int c = lane; c < a.nscale; c += 32)
            a.send_scale[(j * ST + row) * a.nscale + c] = a.scales[(size_t)i * a.nscale + c];
    }
}

// Chunk k of the ring to node m (n chunks this call): once its credit came (chunk k - P
// freed), every block packs its share; the last one publishes it. false when a wait gave up.
__device__ bool send_chunk(const hep_kargs &a, int m, int k, int n, int cnt, unsigned long long e)
{
    if (k >= n)
        return true;
    bool ok = true;
    if (threadIdx.x == 0)
        ok = ring_wait_credit(a, a.send_words, m, k, e, 0);
    if (!block_all(ok))
        return false;
    const int rows = min(a.C, cnt - k * a.C);
    pack_chunk(a, m, k, rows);
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system(); /* this block's rows before its count */
        if (ring_produced(a, 0, m, k, gridDim.x)) {
            __threadfence_system(); /* every block's rows before the proxy sees them */
            ring_publish(a, 0, a.send_words, m, k, rows, e);
            NT_LAST(a, e, 4 + min(k, 1));
        }
        NT_FIRST(a, e, 2 + min(k, 1));
    }
    return true;
}

// HEP_ASYNC past the capacity: this rank's published counts of list L, off which its
// dropped rows' experts come (NULL: no drop).
__device__ __forceinline__ int *drop_at(const hep_kargs &a, int *drop_base, int L)
{
    return drop_base ? drop_base + (size_t)L * a.R * (a.El + 1) : NULL;
}

// The rows of position p of slot s here (`rows` tokens of a chunk) as a list view.
__device__ __forceinline__ lview ring_view(const hep_kargs &a, int s, int p, int rows)
{
    const size_t ST = (size_t)a.ST, row0 = (size_t)s * ST + (size_t)p * a.C;
    const int *route = a.slot_route + (size_t)s * ST * HEP_GPU_ROUTE_WORDS(a.kmax, a.R);
    lview v;
    v.t = rows, v.K = a.kmax, v.slot = 1;
    v.tok = a.slot_token + row0 * a.H * a.esize;
    v.scl = a.slot_scale ? a.slot_scale + row0 * a.nscale : NULL;
    v.ids = route + (size_t)p * a.C * a.kmax;
    v.w = (const float *)(route + ST * a.kmax) + (size_t)p * a.C * a.kmax;
    v.off = route + 2 * ST * a.kmax + (size_t)p * a.C * a.R;
    v.place = route + (2 * a.kmax + a.R) * ST + (size_t)p * a.C * a.kmax;
    return v;
}

#include "kernels/expert_major.cuh"

// Chunk k of the ring from node L (its slot s here, cnt tokens, n chunks): once it landed,
// every block forwards rows of it to the node-mates (NODES_FGRAB: each warp takes the next
// untaken row from the position's count, so blocks that come late take fewer; else the
// block's share), nothing when the layout exceeded the receive capacity (the chunk is still
// consumed; EM: its rows are still placed for the handle, by fixed shares), and the last
// block to count itself frees it (ring_consumed, which clears the count of rows taken).
template <bool EM>
__device__ bool forward_chunk(const hep_kargs &a, int L, int k, int n, int cnt, bool over,
                              unsigned long long e, char *const *s_x, float *const *s_prob,
                              float *const *s_scale, int *drop_cnt)
{
    if (k >= n)
        return true;
    const int s = slot_index(L, a.node), lane = threadIdx.x & 31;
    bool ok = true;
    if (threadIdx.x == 0) {
        ok = ring_wait_landed(a, a.slot_words, s, L, k, e, 0);
        NT_FIRST(a, e, 9 + min(k, 1));
    }
    if (!block_all(ok))
        return false;
    const int rows = min(a.C, cnt - k * a.C);
    if (EM) {
        const lview v = ring_view(a, s, k % a.P, rows);
        int r0, r1, w0, w1;
        block_range(rows, blockIdx.x, gridDim.x, r0, r1);
        warp_range(r0, r1, threadIdx.x >> 5, blockDim.x >> 5, w0, w1);
        for (int r = w0; r < w1; r++)
            em_forward_token(a, v, L, k * a.C + r, r, s_x, s_prob, s_scale, !over);
        bulk_wait_all();
    } else if (!over) {
        const lview v = ring_view(a, s, k % a.P, rows);
        const int mybase = lane < a.R ? ld_l2(a.meta + L * a.R + lane) : 0;
#if NODES_FGRAB
        int *taken = ring_ctr(a, 0, RING_TAKEN, s) + k % a.P; /* zero: see ring_consumed */
        for (;;) {
            int r = 0;
            if (lane == 0)
                r = atomicAdd(taken, 1);
            r = __shfl_sync(FULL, r, 0);
            if (r >= rows)
                break;
            push_token<RING_DU>(a, v, L, k * a.C + r, r, mybase, s_x, s_prob, s_scale, drop_cnt);
        }
#else
        int r0, r1, w0, w1;
        block_range(rows, blockIdx.x, gridDim.x, r0, r1);
        warp_range(r0, r1, threadIdx.x >> 5, blockDim.x >> 5, w0, w1);
        for (int r = w0; r < w1; r++)
            push_token<RING_DU>(a, v, L, k * a.C + r, r, mybase, s_x, s_prob, s_scale, drop_cnt);
#endif
        bulk_wait_all(); /* HEP_BULK_STORES: the chunk's copies are done */
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        NT_LAST(a, e, 11 + min(k, 1));
        __threadfence(); /* this block's reads of the chunk are done */
        ok = ring_consumed(a, 0, (unsigned long long *)a.slot_words, s, L, k, 1, gridDim.x, e);
    }
    return block_all(ok);
}

// Every block, after the layout was released: each ring's tokens (the received count words
// of the slots, landed with their count blocks; the pack's of the own rings); block 0 keeps
// the slots' for combine and publishes which credits the senders wait for.
__device__ bool ring_counts(const hep_kargs &a, unsigned long long e, int *cin, int *cout)
{
    const int N = a.N, tid = threadIdx.x;
    if (!wait_slots(a, a.slot_words + 2 * N, e, HEP_STAGE_NODE_DISPATCH))
        return false;
    if (tid < N && tid != a.node) {
        const int s = slot_index(tid, a.node);
        cin[tid] = (int)ld_relaxed(a.slot_words + s);
        cout[tid] = (int)ld_relaxed(a.send_words + tid);
        if (blockIdx.x == 0) {
            a.slot_rows[s] = cin[tid]; /* the layout keeps them for its combines */
            ring_skips(a, 0, tid, -1, ring_chunks(cin[tid], a.C), e);
        }
    } else if (tid < N) {
        cin[tid] = cout[tid] = 0;
    }
    __syncthreads();
    return true;
}

// Every block, at the start of a dispatch across nodes, before the layout step: chunks
// 0..P-1 of every ring to the other nodes (no credit: positions not yet taken this call),
// chunk 0 of every ring first. Their tokens are the pack kernel's (its count of each
// node's, its offsets and places). false when a wait gave up.
__device__ bool ring_send_first(const hep_kargs &a, unsigned long long e)
{
    for (int k = 0; k < a.P; k++)
        for (int m = 0; m < a.N; m++) {
            const int cnt = m == a.node ? 0 : (int)ld_relaxed(a.send_words + m);
            if (m != a.node && !send_chunk(a, m, k, ring_chunks(cnt, a.C), cnt, e))
                return false;
        }
    return true;
}

// Dispatch across nodes (EM: the expert-major layout), after ring_send_first and the
// layout: the own tokens, then step k = 0, 1, ...: send chunk k + P - 1 of every ring sent
// (k >= 1; its credit is chunk k - 1's at the receiver, freed a step earlier, so its round
// trip hides behind that step), then forward chunk k of every ring received.
// Deadlock freedom (all ranks' kernels co-resident, as the node's flags already require):
// suppose every block of every rank finished the steps before k. The sends of step k wait
// for the credits of chunk k - 1, which every rank freed in step k - 1, so they go out;
// then chunk k of every ring has been sent (first, or at step k - P + 1 <= k), so it lands
// and every block forwards it, waiting for nothing else. No block ever waits for a credit
// that only its own rank's later step would give.
template <bool EM>
__device__ bool ring_dispatch(const hep_kargs &a, unsigned long long e, bool over,
                              const layout_smem &s, char **s_x, float **s_prob, float **s_scale,
                              int *drop_base)
{
    __shared__ int cin[HEP_GPU_MAX_NODES], cout[HEP_GPU_MAX_NODES];
    const int N = a.N, C = a.C, P = a.P;
    if (!ring_counts(a, e, cin, cout))
        return false;
    int steps = 0;
    for (int m = 0; m < N; m++)
        steps = max(steps, max(ring_chunks(cin[m], C), ring_chunks(cout[m], C) - P + 1));
    if (EM && !over) /* also the node-mates' outputs into s_x, s_prob, s_scale */
        em_push<RING_DU>(a, s, s_x, s_prob, s_scale);
    else if (!over)
        push_list<false, NODES_RGRAB>(a, list_of(a, a.node), a.node, s_x, s_prob, s_scale, NULL,
                                      drop_at(a, drop_base, a.node));
    if (!EM && NODES_RGRAB) /* the last block done with the counter resets it */
        work_done(a.work + HEP_WORK_DISPATCH, 1, a.work + HEP_WORK_DISPATCH_DONE);
    if ((threadIdx.x & 31) == 0)
        NT_SPAN(a, e, 7);
    for (int k = 0; k < steps; k++) {
        for (int m = 0; k > 0 && m < N; m++)
            if (m != a.node && !send_chunk(a, m, k + P - 1, ring_chunks(cout[m], C), cout[m], e))
                return false;
        for (int L = 0; L < N; L++)
            if (L != a.node && !forward_chunk<EM>(a, L, k, ring_chunks(cin[L], C), cin[L], over, e,
                                              s_x, s_prob, s_scale, drop_at(a, drop_base, L)))
                return false;
    }
    return true;
}

// HEP_LAYOUT_PROBE (with HEP_LAYOUT_TRACE, a measurement build only): block 0's thread 0,
// first thing in the kernel, times four dependent loads, each consumed before the next
// stamp: a kernel parameter (the constant bank), the routing ids' first line (its page's
// translation and the line), their second line (same page, a line no other block
// prefetches: the line alone) and the first line again (an L2 hit). Tells a page walk
// from the line's own latency in the ids step (bench/NOTES.md, session 27).
#ifdef HEP_LAYOUT_PROBE
static __device__ long long hep_lprobe[64][5];
__device__ int hep_lprobe_sink; /* keeps each consuming branch */
__device__ __forceinline__ unsigned probe_ld(const char *p)
{
    unsigned v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void layout_probe(const hep_kargs &a) /* the parameters read in place */
{
    long long *c = hep_lprobe[(a.rank0 + a.local) & 63];
    c[0] = clock64();
    const char *ids = (const char *)a.topk_idx; /* the parameter's load is the first step */
    if ((size_t)ids == 1)
        hep_lprobe_sink = 1;
    c[1] = clock64();
    unsigned v = probe_ld(ids);
    if (v == 0x7fffffffu)
        hep_lprobe_sink = 2;
    c[2] = clock64();
    v = probe_ld(ids + 128 + (v >> 31)); /* the second line: block 0's tokens only */
    if (v == 0x7fffffffu)
        hep_lprobe_sink = 3;
    c[3] = clock64();
    v = probe_ld(ids + (v >> 31));
    if (v == 0x7fffffffu)
        hep_lprobe_sink = 4;
    c[4] = clock64();
}
#endif

// HEP_LAYOUT_TRACE: block 0's cycles of each layout step (LTRACE stamps) and of the rest.
// `self`: the blocks' own layout (one node, rank-major: the outputs written after the push,
// steps 7 and 8 last).
__device__ __forceinline__ void ltrace_print(const hep_kargs &a, bool self)
{
#ifdef HEP_LAYOUT_TRACE
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const long long *tr = hep_ltrace[(a.rank0 + a.local) & 63], c0 = tr[0], end = clock64();
#ifdef HEP_LAYOUT_PROBE
        const long long *p = hep_lprobe[(a.rank0 + a.local) & 63];
        printf("LPROBE rank %d S %d cycles: param %lld ids-line0 %lld ids-line1 %lld "
               "line0-again %lld | probe end to scan start %lld\n",
               a.rank0 + a.local, gridDim.x, p[1] - p[0], p[2] - p[1], p[3] - p[2],
               p[4] - p[3], c0 - p[4]);
#endif
        if (self)
            printf("LTRACE rank %d S %d cycles (own layout): scan %lld [zero %lld ids %lld "
                   "positions %lld counts %lld] arrive %lld mates %lld "
                   "bases %lld | push %lld finish %lld arrive %lld\n",
                   a.rank0 + a.local, gridDim.x, tr[1] - c0, tr[10] - c0, tr[11] - tr[10],
                   tr[12] - tr[11], tr[1] - tr[12], tr[2] - tr[1], tr[6] - tr[2],
                   tr[9] - tr[6], tr[7] - tr[9], tr[8] - tr[7], end - tr[8]);
        else
            printf("LTRACE rank %d S %d cycles: scan %lld barrier %lld rebase %lld tot %lld "
                   "release %lld mates %lld bases %lld tail %lld ready %lld | push+arrive "
                   "%lld\n",
                   a.rank0 + a.local, gridDim.x, tr[1] - c0, tr[2] - tr[1], tr[3] - tr[2],
                   tr[4] - tr[3], tr[5] - tr[4], tr[6] - tr[5], tr[7] - tr[6], tr[8] - tr[7],
                   tr[9] - tr[8], end - tr[9]);
    }
#else
    (void)a, (void)self;
#endif
}


// The end of a rank-major dispatch: every block arrives at every destination, block 0
// recounts what was kept when rows were dropped, and (trace builds) prints the layout's
// cycles (`own`: the blocks' own layout).
__device__ __forceinline__ void dispatch_end(const hep_kargs &a, unsigned long long e, bool own,
                                             unsigned long long solo_base = 0)
{
    arrive_all(a, e, solo_base);
    if (blockIdx.x == 0)
        drop_recount(a, e);
    ltrace_print(a, own);
}

// One node, rank-major, block 0: the layout's outputs (the row bases in meta, what the rank
// receives, tokens per expert, the capacity's outcome, the host's counts and the timer).
__device__ __forceinline__ void own_outputs(const hep_kargs &a, unsigned long long e,
                                            const layout_smem &s, unsigned long long t_start,
                                            unsigned long long t_layout)
{
    for (int d = threadIdx.x; d < a.R; d += blockDim.x)
        a.meta[d] = s.base[d];
    layout_finish(a, e, s);
    layout_report(a, s, t_start, t_layout);
}

// EM: the expert-major layout (kernels/expert_major.cuh); the rank-major kernel is the
// EM = false instance, its loops untouched. NODES: N > 1 (the rings' code is in these
// instances only, so that it takes no registers from the one-node instances).
template <bool EM, bool NODES>
__global__ void __launch_bounds__(DISPATCH_THREADS, 1) HEP_DISPATCH_NAME(k_dispatch)(hep_kargs a)
{
    if (a.warm)
        return;
#ifdef HEP_LAYOUT_PROBE
    if (!EM && !NODES && !a.reuse && blockIdx.x == 0 && threadIdx.x == 0)
        layout_probe(a);
#endif
    extern __shared__ int sm[];
    const int R = a.R, N = a.N, tid = threadIdx.x, S = gridDim.x, b = blockIdx.x;
    const layout_smem s = layout_smem_at(sm + STAGE_BYTES / sizeof(int), R, a.El);
    /* destination tables in shared memory: indexing the kernel parameters by a run-time
     * destination compiles to constant-bank loads, which stall on every row pass */
    __shared__ char *s_x[HEP_GPU_MAX_LOCAL];
    __shared__ float *s_prob[HEP_GPU_MAX_LOCAL], *s_scale[HEP_GPU_MAX_LOCAL];
    __shared__ int s_grab; /* push_list's token counter (DISPATCH_GRAB) */
    if (tid == 0)
        s_grab = 0; /* the layout step's barriers (grid_arrive's too) come before push_list */
    /* one node, rank-major: the first tile's routing ids fetched into L2 before anything
     * else, so that their DRAM round trip overlaps the epoch's load and the tables' */
    if (!EM && !NODES && !a.reuse) {
        int t0, t1;
        block_range(a.t, b, S, t0, t1);
        const int i = t0 + tid;
        if (i < t1) {
            const size_t o = (size_t)i * a.K;
            const void *p = a.index64 ? (const void *)((const long long *)a.topk_idx + o)
                                      : (const void *)((const int *)a.topk_idx + o);
            asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
        }
    }
#ifdef HEP_BLOCK_TRACE
    unsigned long long bt[4] = {0, 0, 0, 0};
    __shared__ unsigned long long bt_w[2];
    if (tid == 0)
        bt_w[0] = ~0ull, bt_w[1] = 0, bt_tokens = 0;
#endif
    BTRACE(0);
    const unsigned long long e = *a.epoch + 1;
    if (NODES) { /* HEP_NODE_TRACE (kernels/ring.cuh; the words: bench/ntrace.py) */
        NT_FLUSH(a, e, 'D', 0x268du); /* first events: 0, 2, 3, 7, 9, 10, 13 */
        if (tid == 0)
            NT_SPAN(a, e, 0);
    }
    block_start_jitter(a, e);
    /* arrive_all's count before this call (block 0, tid 0; before it arrives anywhere) */
    __shared__ unsigned long long s_solo;
    if (R == 1 && N == 1 && b == 0 && tid == 0)
        s_solo = ld_relaxed(a.flags[a.local] + HEP_FLAG_DISPATCH_ARRIVE);
    for (int j = tid; j < R; j += blockDim.x) {
        s_x[j] = a.x[j];
        s_prob[j] = a.prob[j];
        s_scale[j] = a.scale[j];
    }
    int *mine = a.counts[a.local] + (size_t)(e & 1) * N * R * (a.El + 1);
    if (EM && b == 0 && tid == 0)
        em_publish_outputs(a);
    // across nodes the rings' first P chunks need no credit: they go out before the layout
    // step, so that the network moves them while this rank lays out
    if (NODES && !ring_send_first(a, e))
        return;
    const unsigned long long t_start = now_ns(); /* the layout step's clock (layout_report) */

    if (a.reuse) { // a handle's layout (N = 1): only the barrier of the layout step
        grid_arrive(a.grid_arrive);
        if (b == 0) {
            if (!grid_wait(a, a.grid_arrive, e * (unsigned long long)S) || !layout_reuse(a, e, s))
                return;
            const unsigned long long t_layout = now_ns();
            if (tid == 0) {
                __threadfence();
                st_release_gpu(a.layout_ready, e);
            }
            layout_report(a, s, t_start, t_layout);
        } else if (!grid_wait(a, a.layout_ready, e)) {
            return;
        }
        if (!ld_l2(a.over)) {
            if (EM)
                em_push(a, s, s_x, s_prob, s_scale);
            else
                push_list(a, list_of(a, a.node), a.node, s_x, s_prob, s_scale, &s_grab);
        }
        arrive_all(a, e, s_solo);
        return;
    }
    // 1. this rank's own tokens: positions within the block, counts
    LTRACE(0);
    if (a.rec_ids)
        record_routing(a);
    if (!EM && !NODES) {
        // 1-2. (one node, rank-major) every block lays out its own rows: the last block to
        // arrive publishes the rank's counts; every block waits for every node-mate's and
        // derives its positions' base (the earlier blocks' rows), its row bases and the
        // destinations' totals from them in one round of loads. Its positions become
        // rank-wide as its tokens are pushed; block 0 writes the layout's outputs after its
        // own push.
#ifdef HEP_LAYOUT_TWICE
        /* a measurement build only: the same machine code run twice, the traced pass (its
         * stamps written last) the second, which runs with its code and its ids already
         * fetched. One copy of the scan: a loop that is not unrolled, its flags runtime
         * values (two calls would inline two copies, and the second pass would fetch its
         * own code cold). The first pass counts nothing (it writes the same positions and
         * block counts the real one writes again). */
#pragma unroll 1
        for (int pass = a.T < 0 ? 1 : 0; pass < 2; pass++)
            scan_list(a, list_of(a, a.node), a.node, pass == 1, s, mine, pass == 1);
#else
        scan_list(a, list_of(a, a.node), a.node, true, s, mine, true);
#endif
        LTRACE(1);
        arrive_publish(a, e);
        LTRACE(2);
        if (!wait_counts(a, e, true))
            return;
        LTRACE(6);
        /* the rank-wide token counter (push_list) where every block's s.pre fits the
         * scan's scratch (s.pkey, gkey and gcnt: the expert-major layout's only) */
        int *pre_all = DISPATCH_RGRAB && S * R <= PRE_ALL_PER_THREAD * (int)blockDim.x
                           ? s.pkey
                           : NULL;
        own_layout(a, e, s, pre_all);
        const bool over = over_capacity(a, s.tot) >= 0 && !a.drop;
        const unsigned long long t_layout = now_ns();
        LTRACE(9);
        BTRACE(1);
        if (!over)
            push_list(a, list_of(a, a.node), a.node, s_x, s_prob, s_scale, &s_grab,
                      a.drop ? mine : NULL, s.base, s.pre, pre_all);
        else /* nothing pushed: the positions still made rank-wide, for the handle */
            rebase_own(a, s);
        BTRACE_WARP();
        if (pre_all) /* the last block done with the counter resets it for the next call */
            work_done(a.work + HEP_WORK_DISPATCH, 1, a.work + HEP_WORK_DISPATCH_DONE);
        if (b == 0)
            own_outputs(a, e, s, t_start, t_layout);
        BTRACE(2);
        dispatch_end(a, e, true, s_solo);
#ifdef HEP_BLOCK_TRACE
        BTRACE(3);
        __syncthreads();
        if (tid == 0)
            printf("BTRACE %llu %d %d %llu %llu %llu %llu %llu %llu %u %u\n", e, a.rank0 + a.local,
                   b, bt[0], bt[1], bt_w[0], bt_w[1], bt[2], bt[3], smid(), bt_tokens);
#endif
        return;
    }
    scan_list(a, list_of(a, a.node), a.node, true, s, mine);
    if (EM)
        em_save_counts(a, s);
    LTRACE(1);
    grid_arrive(a.grid_arrive);
    if (!grid_wait(a, a.grid_arrive, e * (unsigned long long)S))
        return;
    LTRACE(2);
    // 2. positions made rank-wide; block 0 lays out and releases the other blocks (EM:
    // which place each pair has among its block's, meanwhile)
    rebase_list(a, a.node, a.t, s);
    LTRACE(3);
    if (b == 0) {
        if (!layout_publish(a, e, s))
            return;
        if (EM)
            em_layout(a, e, s);
        const unsigned long long t_layout = now_ns();
        if (tid == 0) {
            __threadfence();
            st_release_gpu(a.layout_ready, e);
            if (NODES)
                NT_LAST(a, e, 6);
        }
        LTRACE(9);
        layout_report(a, s, t_start, t_layout);
        if (EM)
            em_places(a, s, list_of(a, a.node), a.node);
    } else {
        if (EM)
            em_places(a, s, list_of(a, a.node), a.node);
        if (!grid_wait(a, a.layout_ready, e))
            return;
    }

    // 3. push the own tokens (while the other nodes' rows may still travel), then theirs;
    // nothing when the layout exceeded the receive capacity (every rank decided the same)
    // (across nodes: when a rank of this node needs more rows, summed over all N lists;
    // every slot is still waited for and consumed, so that every sender finishes)
    const bool over = a.cap && ld_l2(a.over);
    if (EM) { /* across nodes the rings as in rank-major, each chunk placed as it lands */
        if (!NODES && !over)
            em_push(a, s, s_x, s_prob, s_scale);
        if (NODES && !ring_dispatch<true>(a, e, over, s, s_x, s_prob, s_scale, NULL))
            return;
        arrive_all(a, e, s_solo);
        if (NODES && tid == 0)
            NT_SPAN(a, e, 13);
        return;
    }
    // (a.drop: each list's dropped rows come off this rank's counts of that list)
    int *drop_base = a.drop ? mine : NULL;
    if (!NODES && !over)
        push_list(a, list_of(a, a.node), a.node, s_x, s_prob, s_scale, &s_grab,
                  drop_base); /* list 0 */
    // across nodes each slot token's positions are its sender's offsets (no scan here), so
    // any block forwards any chunk as it lands
    if (NODES && !ring_dispatch<false>(a, e, over, s, s_x, s_prob, s_scale, drop_base))
        return;
    dispatch_end(a, e, false, s_solo);
    if (NODES && tid == 0)
        NT_SPAN(a, e, 13);
}

} // namespace hep_dispatch (hep_dispatch_bulk)

extern "C" size_t HEP_DISPATCH_NAME(hep_dispatch_smem)(int R, int El)
{
    /* layout_smem: cnt [R][El], wcnt [32][R], run, pre, tot, base [R], recv [El + 1], pkey,
     * gkey and gcnt [threads] */
    return STAGE_BYTES + sizeof(int) * ((size_t)R * El + 32 * (size_t)R + 4 * (size_t)R +
                                        (size_t)El + 1 + 3 * (size_t)DISPATCH_THREADS);
}

#define K_DISPATCH HEP_DISPATCH_NAME(hep_dispatch)::HEP_DISPATCH_NAME(k_dispatch)
extern "C" int HEP_DISPATCH_NAME(hep_launch_dispatch)(const hep_kargs *a, int blocks, void *stream)
{
    size_t smem = HEP_DISPATCH_NAME(hep_dispatch_smem)(a->R, a->El);
    void (*k)(hep_kargs) = a->emajor ? (a->N > 1 ? K_DISPATCH<true, true> : K_DISPATCH<true, false>)
                                     : (a->N > 1 ? K_DISPATCH<false, true> : K_DISPATCH<false, false>);
    int e = hep_allow_smem((const void *)k, smem);
    if (e != 0)
        return e;
    k<<<blocks, DISPATCH_THREADS, smem, (cudaStream_t)stream>>>(*a);
    return (int)cudaGetLastError();
}

// Every instance once, one block that returns at once (kernels/probe.cu says why).
extern "C" int HEP_DISPATCH_NAME(hep_warm_dispatch)(const hep_kargs *a, void *stream)
{
    hep_kargs w = *a;
    int e = 0;
    w.warm = 1;
    for (int i = 0; i < 4 && e == 0; i++) {
        w.emajor = i & 1;
        w.N = i & 2 ? 2 : 1;
        e = HEP_DISPATCH_NAME(hep_launch_dispatch)(&w, 1, stream);
    }
    return e;
}
#undef K_DISPATCH
