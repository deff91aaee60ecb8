// kernels/layout.cuh: the layout step of the dispatch kernel. Every block scans the routing
// of its share of a list (destination mask, position among the block's tokens at each
// destination, per-(destination, expert) counts). Then, two ways:
//  - one node, rank-major (own_layout): no grid barrier and no hand-off. The last block to
//    arrive publishes the rank's counts (every block added its own); every block waits for
//    every node-mate's and derives its own row bases, the earlier blocks' rows and the
//    destinations' totals in one round of loads, and pushes; block 0 writes the outputs
//    (what this rank receives, tokens per expert, the capacity's outcome) after its push.
//  - expert-major, or across nodes (layout_publish): after one grid barrier block 0
//    publishes the rank's counts (with the other nodes' count blocks), derives the row
//    bases of every list and the outputs and releases the other blocks, which made their
//    positions rank-wide meanwhile.
// Every sum is spread over a warp's lanes or the block's threads: no thread walks the
// blocks or ranks one dependent load at a time. Included by dispatch.cu only.
#ifndef HEP_KERNELS_LAYOUT_CUH
#define HEP_KERNELS_LAYOUT_CUH

#include "kernels/lists.cuh"

// HEP_LAYOUT_TRACE (a measurement build only, bench/NOTES.md): block 0's thread 0 stamps
// the SM clock at each step of the layout, and prints the steps' cycles at the kernel's end.
#ifdef HEP_LAYOUT_TRACE
static __device__ long long hep_ltrace[64][16]; /* [rank & 63][step] */
#define LTRACE(i)                                                                          \
    do {                                                                                   \
        if (blockIdx.x == 0 && threadIdx.x == 0)                                           \
            hep_ltrace[(a.rank0 + a.local) & 63][i] = clock64();                        \
    } while (0)
#else
#define LTRACE(i) ((void)0)
#endif

// Shared memory of the layout step (dynamic; hep_dispatch_smem sizes it).
struct layout_smem {
    int *cnt;  // [R][El] the block's per-(destination, expert) counts
    int *wcnt; // [32][R] per-warp offsets of a tile
    int *run;  // [R] the block's rows at each destination so far
    int *pre;  // [R] rows of the earlier blocks at each destination
    int *tot;  // [R] rows of all blocks (block 0), then of all sources at each destination
    int *base; // [R] the own list's row base at each destination (the blocks' own layout)
    int *recv; // [El + 1] what this rank receives (block 0)
    int *pkey; // [threads] expert-major places (em_places): each pair's (d, e) of a tile
    int *gkey; // [warps][32] each warp's (d, e) groups of the tile ...
    int *gcnt; // [warps][32] ... their sizes, then their bases
};

__device__ __forceinline__ layout_smem layout_smem_at(int *sm, int R, int El)
{
    layout_smem s;
    s.cnt = sm;
    s.wcnt = s.cnt + R * El;
    s.run = s.wcnt + 32 * R;
    s.pre = s.run + R;
    s.tot = s.pre + R;
    s.base = s.tot + R;
    s.recv = s.base + R;
    s.pkey = s.recv + El + 1;
    s.gkey = s.pkey + blockDim.x;
    s.gcnt = s.gkey + blockDim.x;
    return s;
}

// The first invalid routing id of the call (token i, slot k, value x), for the host's
// message. Not inlined: it is never on the scan's path.
static __device__ __noinline__ void record_bad_id(hep_diag *diag, int i, int k, long long x)
{
    if (atomicCAS(&diag->invalid_claimed, 0u, 1u) == 0u) {
        diag->bad_token = i;
        diag->bad_slot = k;
        diag->bad_value = x;
    }
}

// Token i's first id outside -1..E-1 recorded (own tokens). Off the scan's path (its one
// call site is taken only for a bad id); it takes values, not the kernel's parameters by
// reference (that would copy them to local memory: a 2 KB stack frame in every dispatch
// kernel).
static __device__ __noinline__ void record_first_bad(hep_diag *diag, const void *ids, bool index64,
                                                     int K, int i, long long E)
{
    for (int k = 0; k < K; k++) {
        const size_t o = (size_t)i * K + k;
        const long long x = index64 ? ((const long long *)ids)[o] : (long long)((const int *)ids)[o];
        if (x < -1 || x >= E) {
            record_bad_id(diag, i, k, x);
            return;
        }
    }
}

// MASK_MAGIC (a tuning switch, off): a key's destination key / El as a multiply-high
// (kernels/divmagic.h, exact for every key and E_l the layout's shared memory allows)
// instead of eight runtime divisions (about 180 instructions, 2.9 KB of the one-node
// kernel's code on the scan's path), and the same for the counts' destinations, the scan's
// per-id path (slot lists, K > 8) and the push's (destination, expert) of a token's slot
// (token_meta, em_push_rows: a 64-bit division there, 3 KB of code). The factor comes from
// the host (hep_kargs.el_magic); computed in the kernel by a 64-bit division it cost
// 0.35-0.6k cycles (bench/NOTES.md, session 31).
#ifndef MASK_MAGIC
#define MASK_MAGIC 0
#endif
#if MASK_MAGIC
#include "kernels/divmagic.h"
#endif

// Block b's positions among its tokens of list L at each destination (dest_rows, made
// rank-wide by rebase) and its totals (block_counts); with `count`, the list's
// per-(destination, expert) counts are added to the published counts `mine`. An own id
// outside -1..E-1 is recorded (once) and its slot ignored.
static __device__ void scan_list(const hep_kargs &a, const lview &v, int L, bool count,
                          const layout_smem &s, int *mine, bool totals = false)
{
    const int R = a.R, El = a.El, tid = threadIdx.x, S = gridDim.x, b = blockIdx.x;
    const long long E = (long long)El * R * a.N, first = (long long)a.rank0 * El;
    const size_t T = (size_t)a.T, LW = (size_t)R * (El + 1);
    int t0, t1;
    block_range(v.t, b, S, t0, t1);
#if MASK_MAGIC
    const unsigned long long el_magic = a.el_magic;
#endif
    for (int j = tid; j < R * El; j += blockDim.x)
        s.cnt[j] = 0;
    for (int j = tid; j < R; j += blockDim.x)
        s.run[j] = 0;
    __syncthreads();
    LTRACE(10);
    for (int tile = t0; tile < t1; tile += blockDim.x) {
        const int i = tile + tid;
        unsigned mask = 0;
        // With K <= 8 (own tokens) a token's ids are loaded together (no atomic between
        // them) and kept as keys d * El + e at this node, so the duplicate check compares
        // registers instead of reloading the earlier ids after each count's atomic
        // (bench/NOTES.md, session 6: the scan 10.5k -> 7.4k cycles). Larger K takes the
        // loop below (unrolled for every K, the code grew by 20-53 KB and was slower).
        if (v.K <= 8 && !v.slot) {
            int key[8];
            // The ids loaded and checked with no call on the path (a key lies in this
            // node's range, inside 0..E-1, so a bad id is never one). With K = 8 and
            // 16-byte aligned ids they are read as two (int32) or four (int64) vectors with
            // no branch between the loads (bench/NOTES.md, sessions 29-30: the step 0.6-0.8k
            // cycles shorter than with a load and a call site per id).
            bool bad = false;
            long long xv[8];
            const bool vec = v.K == 8 && i < t1 && ((size_t)a.topk_idx & 15) == 0;
            if (vec) {
                if (a.index64) {
                    const longlong2 *p = (const longlong2 *)a.topk_idx + (size_t)i * 4;
                    const longlong2 q0 = p[0], q1 = p[1], q2 = p[2], q3 = p[3];
                    xv[0] = q0.x, xv[1] = q0.y, xv[2] = q1.x, xv[3] = q1.y;
                    xv[4] = q2.x, xv[5] = q2.y, xv[6] = q3.x, xv[7] = q3.y;
                } else {
                    const int4 *p = (const int4 *)a.topk_idx + (size_t)i * 2;
                    const int4 q0 = p[0], q1 = p[1];
                    xv[0] = q0.x, xv[1] = q0.y, xv[2] = q0.z, xv[3] = q0.w;
                    xv[4] = q1.x, xv[5] = q1.y, xv[6] = q1.z, xv[7] = q1.w;
                }
            }
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const long long x = vec ? xv[k] : k < v.K && i < t1 ? topk_at(a, i, k) : -1;
                bad |= x < -1 || x >= E;
                key[k] = x >= first && x < first + (long long)R * El ? (int)(x - first) : -1;
            }
            if (bad)
                record_first_bad(a.diag, a.topk_idx, a.index64, a.K, i, E);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                bool dup = false;
#pragma unroll
                for (int q = 0; q < k; q++)
                    dup |= key[q] == key[k];
                if (key[k] >= 0) {
#if MASK_MAGIC
                    mask |= 1u << hep_div_by_magic((unsigned)key[k], el_magic);
#else
                    mask |= 1u << (key[k] / El);
#endif
                    if (count && !dup)
                        atomicAdd(&s.cnt[key[k]], 1);
                }
            }
        } else if (i < t1) {
            for (int k = 0; k < v.K; k++) {
                long long x = list_id(a, v, i, k);
                if (x == -1)
                    continue;
                if (x < -1 || x >= E) { /* own tokens only: slots carry -1 instead */
                    record_bad_id(a.diag, i, k, x);
                    continue;
                }
                if (x < first || x >= first + (long long)R * El)
                    continue; /* another node's expert */
#if MASK_MAGIC
                const int key = (int)(x - first);
                const int d = (int)hep_div_by_magic((unsigned)key, el_magic), ex = key - d * El;
#else
                const int d = (int)((x - first) / El), ex = (int)((x - first) % El);
#endif
                bool dup = false;
                for (int q = 0; q < k; q++)
                    dup |= list_id(a, v, i, q) == x;
                mask |= 1u << d;
                if (count && !dup)
                    atomicAdd(&s.cnt[d * El + ex], 1);
            }
        }
#ifdef HEP_LAYOUT_TRACE
        if (tile == t0) {
            __syncwarp();
            if (mask == 0xffffffffu)
                s.wcnt[0] = 0; /* the stamp waits for the mask (tile_positions writes wcnt first) */
            LTRACE(11);
        }
#endif
        tile_positions(mask, R, i < t1, a.dest_rows + ((size_t)L * T + i) * R, s.wcnt, s.run);
        if (tile == t0)
            LTRACE(12);
    }
    if (count)
        for (int j = tid; j < R * El; j += blockDim.x)
            if (s.cnt[j])
#if MASK_MAGIC /* (j / El) * (El + 1) + 1 + j % El = j + j / El + 1 */
                atomicAdd(&mine[(size_t)L * LW + j + 1 + hep_div_by_magic((unsigned)j, el_magic)],
                          s.cnt[j]);
#else
                atomicAdd(&mine[(size_t)L * LW + (j / El) * (El + 1) + 1 + j % El], s.cnt[j]);
#endif
    for (int d = tid; d < R; d += blockDim.x) {
        a.block_counts[((size_t)L * S + b) * R + d] = s.run[d];
        if (totals && s.run[d]) /* the blocks' own layout: the list's totals summed here too */
            atomicAdd(&mine[(size_t)L * LW + (size_t)d * (El + 1)], s.run[d]);
    }
    __syncthreads();
}

// After the grid barrier: block b's positions of list L (t tokens) made rank-wide; block 0
// also gets each destination's total in s.tot.
__device__ __forceinline__ void rebase_list(const hep_kargs &a, int L, int t, const layout_smem &s)
{
    const int R = a.R, S = gridDim.x, b = blockIdx.x;
    int t0, t1;
    block_range(t, b, S, t0, t1);
    block_prefix(a.block_counts + (size_t)L * S * R, S, R, b, s.pre, b == 0 ? s.tot : NULL);
    if (b != 0) /* block 0's positions are rank-wide already */
        rebase_positions(a.dest_rows + (size_t)L * a.T * R, t0, t1, R, s.pre);
}

// Block 0, call e: publish this rank's counts (own list totals from s.tot; with N > 1 the
// other nodes' slots' count blocks, sent ahead of their rows) and release COUNTS_READY = e.
// Returns false when a wait gave up (the record is filled).
static __device__ bool publish_counts(const hep_kargs &a, unsigned long long e,
                                      const layout_smem &s)
{
    const int R = a.R, El = a.El, N = a.N, tid = threadIdx.x;
    const size_t LW = (size_t)R * (El + 1), par = (size_t)(e & 1) * N * LW;
    int *mine = a.counts[a.local] + par;

    for (int d = tid; d < R; d += blockDim.x)
        mine[(size_t)a.node * LW + (size_t)d * (El + 1)] = s.tot[d];
    if (N > 1) {
        const size_t CBW = HEP_COUNT_BLOCK_WORDS((size_t)R, (size_t)El);
        if (!wait_slots(a, a.slot_words + 2 * N, e, HEP_STAGE_NODE_DISPATCH))
            return false;
        for (int j = tid; j < (N - 1) * (int)LW; j += blockDim.x) {
            const int sl = j / (int)LW, L = sl < a.node ? sl : sl + 1;
            mine[(size_t)L * LW + j % LW] =
                ld_l2((const int *)(a.slot_words + 3 * N) + (size_t)sl * 2 * CBW + j % LW);
        }
    }
    for (int j = tid; j <= El; j += blockDim.x)
        s.recv[j] = 0;
    __syncthreads();
    LTRACE(4);
    if (tid == 0) {
        *a.epoch = e;
        fence_peers(a);
        st_release_peers(a, a.flags[a.local] + HEP_FLAG_COUNTS_READY, e);
    }
    LTRACE(5);
    return true;
}

// Every node-mate published its counts of call e (threads tid < R wait one each).
// With `own_grid` (one node, rank-major: arrive_publish), this rank's own counts are
// complete once all its blocks arrived at the grid counter, each after its counts, so
// thread a.local waits for that count instead of for the flag the last block raises after
// it, a fence and a release later (the one-rank layout step 0.5-1.2 us shorter:
// bench/NOTES.md, sessions 20 and 22).
__device__ __forceinline__ bool wait_counts(const hep_kargs &a, unsigned long long e,
                                            bool own_grid = false)
{
    bool ok = true;
    if (own_grid && (int)threadIdx.x == a.local)
        ok = wait_geq_s(a, a.grid_arrive, e * gridDim.x, HEP_STAGE_PREPROCESS, a.rank0 + a.local,
                        2, NULL, false);
    else if ((int)threadIdx.x < a.R)
        ok = wait_mate(a, a.flags[threadIdx.x] + HEP_FLAG_COUNTS_READY, e, HEP_STAGE_PREPROCESS,
                       (int)threadIdx.x);
    return block_all(ok);
}

// Row base of list L at destination d, base[L * R + d]: the rows there of every source
// (L2, s2) before (L, this rank), sources in [list][local rank] order; tot[d] gets
// destination d's rows of all sources. A warp's scan per destination, from the published
// counts of call e. (No barrier: the caller's next one orders them; the warps past R go on.)
__device__ __forceinline__ void row_bases(const hep_kargs &a, unsigned long long e, int *base,
                                          int *tot)
{
    const int R = a.R, El = a.El, N = a.N, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t LW = (size_t)R * (El + 1), par = (size_t)(e & 1) * N * LW;
    const int NR = N * R;
    for (int d = warp; d < R; d += (int)(blockDim.x >> 5)) {
        int b0 = 0;
        for (int q0 = 0; q0 < NR; q0 += 32) {
            const int q = q0 + lane;
            const int c = q < NR ? ld_l2(a.counts[q % R] + par + (size_t)(q / R) * LW +
                                         (size_t)d * (El + 1))
                                 : 0;
            const int x = warp_scan(c);
            if (q < NR && q % R == a.local)
                base[(q / R) * R + d] = b0 + x - c;
            b0 += __shfl_sync(FULL, x, 31);
        }
        if (lane == 0)
            tot[d] = b0;
    }
}

// The first destination whose rows (tot, of all N lists) exceed the receive capacity, or -1:
// every rank of the node sees the same counts, so every rank (and every block) takes the
// same decision.
__device__ __forceinline__ int over_capacity(const hep_kargs &a, const int *tot)
{
    if (a.cap)
        for (int d = 0; d < a.R; d++)
            if (tot[d] > a.cap)
                return d;
    return -1;
}

// The blocks' own layout, when nothing is pushed (over the capacity): block b's positions
// of its own tokens made rank-wide in place (plus s.pre), as push_token makes them.
__device__ __forceinline__ void rebase_own(const hep_kargs &a, const layout_smem &s)
{
    int t0, t1;
    block_range(a.t, blockIdx.x, gridDim.x, t0, t1);
    if (blockIdx.x != 0)
        rebase_positions(a.dest_rows + (size_t)a.node * a.T * a.R, t0, t1, a.R, s.pre);
}

// One node, rank-major (the blocks' own layout): this block arrives at the rank's grid
// counter after its scan added its counts to the published ones; the last block to arrive
// (every block's counts are in) publishes COUNTS_READY = e. No block waits here. Two fences
// on the layout step's path: this block's release before its arrival, and the last block's
// one acq_rel fence that acquires the other blocks' counts (their adds, read through the
// counter) and releases COUNTS_READY by the relaxed store after it (a fence and a store in
// one thread are a release pattern). A fence.sc and a st.release there, three fences on the
// path, made the step 0.5 us longer (bench/NOTES.md, session 25).
__device__ __forceinline__ void arrive_publish(const hep_kargs &a, unsigned long long e)
{
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory"); /* this block's counts first */
        const unsigned long long n = atomicAdd(a.grid_arrive, 1ull) + 1;
        if (n == e * gridDim.x) { /* the last: every block read the epoch and arrived */
            *a.epoch = e;
            fence_release_peers(a); /* acquires their counts (their adds, read by ours) */
            st_relaxed_peers(a, a.flags[a.local] + HEP_FLAG_COUNTS_READY, e);
        }
    }
}

// One node, rank-major, once every node-mate published its counts of call e: s.pre[d] =
// this rank's rows at destination d from the blocks before this one, s.base[d] the own
// list's row base there, s.tot[d] destination d's rows of all sources (and s.recv zeroed).
// One warp a destination, both sums' loads in flight together. With `pre_all` ([S][R]
// shared memory, S x R <= PRE_ALL_PER_THREAD x the block's threads) also every
// block's s.pre: pre_all[q * R + d] = the rows at destination d of the blocks before block
// q (a rank-wide token counter pushes any block's tokens). With pre_all, the blocks'
// totals are loaded with the sources' counts, one round of loads instead of two, and s.pre
// comes from their scan (bench/NOTES.md, sessions 20 and 22).
#define PRE_ALL_PER_THREAD 3
__device__ void own_layout(const hep_kargs &a, unsigned long long e, const layout_smem &s,
                           int *pre_all = NULL)
{
    const int R = a.R, El = a.El, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int b = blockIdx.x, S = gridDim.x;
    const size_t par = (size_t)(e & 1) * R * (El + 1);
    const bool one_round = pre_all != NULL;
    int v[PRE_ALL_PER_THREAD] = {}; /* one_round: this thread's blocks' totals, stored after */
    if (one_round)
#pragma unroll
        for (int u = 0; u < PRE_ALL_PER_THREAD; u++) {
            const int k = threadIdx.x + u * (int)blockDim.x;
            if (k < S * R)
                v[u] = ld_l2(a.block_counts + k);
        }
    for (int d = warp; d < R; d += (int)(blockDim.x >> 5)) {
        int p = 0;
        if (!one_round) /* (one_round: the scan below gives s.pre) */
            for (int q = lane; q < b; q += 32)
                p += ld_l2(a.block_counts + (size_t)q * R + d);
        const int c = lane < R ? ld_l2(a.counts[lane] + par + (size_t)d * (El + 1)) : 0;
        const int x = warp_scan(c); /* over the sources (R <= 32 local ranks) */
        p = warp_sum(p);
        if (lane == a.local)
            s.base[d] = x - c;
        if (lane == 31)
            s.tot[d] = x;
        if (lane == 0 && !one_round)
            s.pre[d] = p;
    }
    for (int j = threadIdx.x; j <= El; j += blockDim.x)
        s.recv[j] = 0;
    if (one_round)
#pragma unroll
        for (int u = 0; u < PRE_ALL_PER_THREAD; u++) {
            const int k = threadIdx.x + u * (int)blockDim.x;
            if (k < S * R)
                pre_all[k] = v[u];
        }
    __syncthreads();
    if (!pre_all)
        return;
    for (int d = warp; d < R; d += (int)(blockDim.x >> 5)) { /* exclusive, over the blocks */
        int carry = 0;
        for (int q0 = 0; q0 < S; q0 += 32) {
            const int q = q0 + lane;
            const int c = q < S ? pre_all[q * R + d] : 0;
            const int x = warp_scan(c);
            if (q < S)
                pre_all[q * R + d] = carry + x - c;
            if (one_round && q == b)
                s.pre[d] = carry + x - c;
            carry += __shfl_sync(FULL, x, 31);
        }
    }
    __syncthreads();
}

// Block 0, once the row bases and destination totals (s.tot) are known: what this rank
// receives and its tokens per expert (s.recv, the outputs), the other parity of the counts
// zeroed for call e + 1, and the capacity's outcome.
static __device__ void layout_finish(const hep_kargs &a, unsigned long long e, const layout_smem &s)
{
    const int R = a.R, El = a.El, N = a.N, tid = threadIdx.x;
    const size_t LW = (size_t)R * (El + 1), par = (size_t)(e & 1) * N * LW;
    const int NR = N * R;
    // What this rank receives (j = 0) and per local expert (j > 0): every source's counts
    // at this rank, one load per (source, j) pair across the block.
    for (int k = tid; k < (El + 1) * NR; k += blockDim.x) {
        const int q = k / (El + 1), j = k % (El + 1);
        const int c = ld_l2(a.counts[q % R] + par + (size_t)(q / R) * LW +
                            (size_t)a.local * (El + 1) + j);
        if (c)
            atomicAdd(&s.recv[j], c);
    }
    LTRACE(7);
    // the other parity was call e - 1's: every node-mate read it before it arrived here at
    // the end of that call; it is zeroed for call e + 1's additions
    for (int j = tid; j < N * (int)LW; j += blockDim.x)
        a.counts[a.local][(size_t)((e + 1) & 1) * N * LW + j] = 0;
    __syncthreads();
    // Over the capacity: blocking, nothing is received on this node (across nodes the host
    // then agrees with the other nodes, backend_gpu.c). a.drop: the rows below it are
    // (push_token drops the others, in every list; tokens per expert are summed again once
    // the sources arrived).
    const int over = over_capacity(a, s.tot);
    const int need = s.tot[a.local];
    for (int j = tid; j <= El; j += blockDim.x) {
        if (over >= 0 && !a.drop)
            s.recv[j] = 0; /* nothing is received: a combine of it copies no row */
        if (j == 0 && a.drop && need > a.cap)
            s.recv[0] = a.cap;
        if (j == 0)
            *a.recv_count = s.recv[0];
        else
            a.tokens_per_expert[j - 1] = s.recv[j];
    }
    if (tid == 0) {
        *a.over = over >= 0 && !a.drop;
        a.ovf[0] = over >= 0; /* every call writes them: graph replays see their own */
        a.ovf[1] = need;
        a.ovf[2] = a.cap && need > a.cap ? need - a.cap : 0;
        if (over >= 0) { /* host-mapped, on an overflow only */
            a.diag->overflow_rank = a.rank0 + over;
            a.diag->overflow_rows = s.tot[over];
            a.diag->overflow_dropped = a.drop;
            __threadfence_system();
            a.diag->overflow_claimed = 1u;
        }
    }
    __syncthreads();
    LTRACE(8);
}

// Block 0, call e: publish this rank's counts, wait for every node-mate's, then derive the
// row bases (meta), what this rank receives and its tokens per expert. Returns false when a
// wait gave up (the record is filled).
static __device__ bool layout_publish(const hep_kargs &a, unsigned long long e, const layout_smem &s)
{
    if (!publish_counts(a, e, s) || !wait_counts(a, e))
        return false;
    LTRACE(6);
    row_bases(a, e, a.meta, s.tot); /* s.tot was published above: now destination d's rows */
    layout_finish(a, e, s);
    return true;
}

// Block 0, call e with HEP_REUSE_LAYOUT (N = 1): the layout is the handle's. Only the
// barrier of the layout step: COUNTS_READY = e, every node-mate's, and the other parity of
// the counts zeroed for call e + 1 (as layout_publish does). s.recv gets the handle's
// counts for the host's copy; a handle whose layout overflowed overflows again.
static __device__ bool layout_reuse(const hep_kargs &a, unsigned long long e, const layout_smem &s)
{
    const int R = a.R, El = a.El, N = a.N, tid = threadIdx.x;
    const size_t LW = (size_t)R * (El + 1);
    if (tid == 0) {
        *a.epoch = e;
        fence_peers(a);
        st_release_peers(a, a.flags[a.local] + HEP_FLAG_COUNTS_READY, e);
    }
    bool ok = true;
    if (tid < R)
        ok = wait_mate(a, a.flags[tid] + HEP_FLAG_COUNTS_READY, e, HEP_STAGE_PREPROCESS, tid);
    if (!block_all(ok))
        return false;
    for (int j = tid; j < N * (int)LW; j += blockDim.x)
        a.counts[a.local][(size_t)((e + 1) & 1) * N * LW + j] = 0;
    for (int j = tid; j <= El; j += blockDim.x)
        s.recv[j] = j == 0 ? *a.recv_count : a.tokens_per_expert[j - 1];
    __syncthreads();
    return true;
}

// Block 0, after the layout is published to this kernel's blocks: the host's copy of the
// counts (pinned memory; written after the release so that the PCIe writes never delay it).
__device__ __forceinline__ void layout_report(const hep_kargs &a, const layout_smem &s,
                                             unsigned long long t_start,
                                             unsigned long long t_layout)
{
    for (int j = threadIdx.x; j <= a.El; j += blockDim.x)
        a.host_counts[j] = s.recv[j];
    if (threadIdx.x == 0) {
        a.diag->t_start = t_start;
        a.diag->t_layout = t_layout;
    }
}

#endif
