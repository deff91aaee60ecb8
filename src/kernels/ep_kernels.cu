// kernels/ep_kernels.cu: intra-node preprocess, dispatch and combine (see ep_kernels.h).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/ep_kernels.h"

#define FULL 0xffffffffu
/* Tuning (bench/NOTES.md has what was measured): threads per block, 16-byte vectors per
 * lane in flight (dispatch DU, combine CU), destinations loaded together by combine (CD). */
#ifndef DISPATCH_THREADS
#define DISPATCH_THREADS 512
#endif
#ifndef COMBINE_THREADS
#define COMBINE_THREADS 512
#endif

// ---------------------------------------------------------------- memory-model helpers
__device__ __forceinline__ void st_release(unsigned long long *p, unsigned long long v)
{
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void red_add_release(unsigned long long *p, unsigned long long v)
{
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long now_ns()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ int ld_volatile_int(const int *p)
{
    return *(volatile const int *)p;
}
__device__ __forceinline__ uint4 ld_cg(const uint4 *p)
{
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ bool aborted(const hep_kargs &a)
{
    return *(volatile unsigned int *)&a.diag->timeout_claimed != 0;
}

// Spin until *flag >= expect, at most timeout_ns x scale; on expiry record who waited for
// what. Waits on this rank's own blocks use scale 2, so that when a peer is missing the
// record names the peer (the wait on it expires first), not the rank's own block 0.
__device__ __forceinline__ unsigned long long ld_relaxed(const unsigned long long *p)
{
    unsigned long long v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// `blame` (or NULL): the waited-for node-mate's blame word. A rank whose wait expired
// writes there whom it waited for, so that a node-mate waiting on it names that rank, not
// the one that merely stopped.
__device__ bool wait_geq_s(const hep_kargs &a, const unsigned long long *flag,
                           unsigned long long expect, int stage, int peer, unsigned scale,
                           const unsigned long long *blame)
{
    // Poll with relaxed loads and a growing sleep (a tight loop of system-scope acquire
    // loads slows the other blocks' memory traffic); one acquire fence once it is seen.
    unsigned long long start = now_ns(), seen = ld_relaxed(flag);
    unsigned sleep_ns = 32, spins = 0;
    while (seen < expect) {
        __nanosleep(sleep_ns);
        if (sleep_ns < 1024)
            sleep_ns <<= 1;
        if ((++spins & 15) == 0) {
            unsigned long long waited = now_ns() - start;
            unsigned long long culprit = blame ? ld_relaxed(blame) : 0;
            if (aborted(a))
                return false;
            /* a wait on a node-mate runs an eighth longer: when the mate waits on a
             * missing rank itself, its blame arrives before this wait gives up */
            if (waited > a.timeout_ns * scale + (blame ? a.timeout_ns / 8 : 0) || culprit) {
                if (atomicCAS(&a.diag->timeout_claimed, 0u, 1u) == 0u) {
                    a.diag->stage = stage;
                    a.diag->block = blockIdx.x;
                    a.diag->peer = culprit ? (int)(culprit - 1) : peer;
                    a.diag->via_plus1 = culprit ? peer + 1 : 0;
                    a.diag->expected = expect;
                    a.diag->seen = seen;
                    a.diag->waited_ns = waited;
                    __threadfence_system();
                    st_release(a.flags[a.local] + HEP_FLAG_BLAME,
                               culprit ? culprit : (unsigned long long)peer + 1);
                }
                return false;
            }
        }
        seen = ld_relaxed(flag);
    }
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    return true;
}

__device__ __forceinline__ bool wait_geq(const hep_kargs &a, const unsigned long long *flag,
                                         unsigned long long expect, int stage, int peer)
{
    return wait_geq_s(a, flag, expect, stage, peer, 1, NULL);
}

// A wait on node-mate `mate`'s flag word: names whom that mate was stuck on, if it was.
__device__ __forceinline__ bool wait_mate(const hep_kargs &a, const unsigned long long *flag,
                                          unsigned long long expect, int stage, int mate)
{
    return wait_geq_s(a, flag, expect, stage, a.rank0 + mate, 1,
                      a.flags[mate] + HEP_FLAG_BLAME);
}

__device__ __forceinline__ long long topk_at(const hep_kargs &a, int i, int k)
{
    size_t o = (size_t)i * a.K + k;
    return a.index64 ? ((const long long *)a.topk_idx)[o] : (long long)((const int *)a.topk_idx)[o];
}


// ---------------------------------------------------------------- token lists
// A rank forwards N lists of tokens to its node-mates: list `node` is its own tokens (the
// caller's routing); list L != node (N > 1) is the slot received from the peer on node L
// (its tokens that this node needs, packed in source order, with kmax-wide routing). Row
// order at a destination is [list][source local rank][token]: the documented
// [source node][source local rank][token].
struct lview {
    int t, K, slot;
    const char *tok;
    const float *scl;
    const int *ids;
    const float *w;
};

__device__ __forceinline__ int slot_index(int L, int node)
{
    return L < node ? L : L - 1;
}

__device__ __forceinline__ lview list_of(const hep_kargs &a, int L)
{
    lview v;
    if (L == a.node) {
        v.t = a.t, v.K = a.K, v.slot = 0;
        v.tok = (const char *)a.tokens, v.scl = a.scales, v.ids = NULL, v.w = a.weights;
    } else {
        const size_t s = (size_t)slot_index(L, a.node), T = (size_t)a.T;
        v.t = (int)ld_relaxed(a.slot_words + s), v.K = a.kmax, v.slot = 1;
        v.tok = a.slot_token + s * T * (size_t)a.H * a.esize;
        v.scl = a.slot_scale ? a.slot_scale + s * T * a.nscale : NULL;
        v.ids = a.slot_route + s * 2 * T * a.kmax;
        v.w = (const float *)(v.ids + T * a.kmax);
    }
    return v;
}

__device__ __forceinline__ long long list_id(const hep_kargs &a, const lview &v, int i, int k)
{
    return v.slot ? (long long)v.ids[(size_t)i * a.kmax + k] : topk_at(a, i, k);
}
__device__ __forceinline__ float list_w(const hep_kargs &a, const lview &v, int i, int k)
{
    return v.w[(size_t)i * v.K + k];
}

// Block b's share of a list of t tokens: [t0, t1).
__device__ __forceinline__ void block_range(int t, int b, int S, int &t0, int &t1)
{
    const int chunk = (t + S - 1) / S;
    t0 = min(t, b * chunk);
    t1 = min(t, t0 + chunk);
}

// All S blocks of this kernel arrived at *ctr (the kernels of a rank fit the GPU together).
__device__ __forceinline__ int grid_wait(const hep_kargs &a, unsigned long long *ctr,
                                         unsigned long long expect)
{
    __shared__ int ok;
    if (threadIdx.x == 0)
        ok = wait_geq_s(a, ctr, expect, HEP_STAGE_PREPROCESS, a.rank0 + a.local, 2, NULL);
    __syncthreads();
    return ok;
}

// Each list slot's flag from the peer's proxy (N > 1): every block waits for all of them.
__device__ __forceinline__ bool wait_slots(const hep_kargs &a, const unsigned long long *words,
                                           unsigned long long e, int stage)
{
    __shared__ int ok;
    if (threadIdx.x == 0)
        ok = 1;
    __syncthreads();
    if (threadIdx.x < a.N - 1) {
        int L = threadIdx.x < a.node ? threadIdx.x : threadIdx.x + 1;
        if (!wait_geq(a, words + a.N + threadIdx.x, e, stage, L * a.R + a.local))
            ok = 0;
    }
    __syncthreads();
    return ok;
}

// One tile of blockDim.x tokens, each thread holding a mask of n bits for its token: the
// token's position among the block's tokens with bit d (earlier tiles counted in run[d])
// goes to out[d], -1 where the bit is clear. wcnt holds [32 warps][n].
__device__ __forceinline__ void tile_positions(unsigned mask, int n, bool valid, int *out,
                                               int *wcnt, int *run)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const unsigned lt = (1u << lane) - 1u;
    for (int d = 0; d < n; d++) {
        unsigned bl = __ballot_sync(FULL, (mask >> d) & 1u);
        if (lane == 0)
            wcnt[warp * n + d] = __popc(bl);
    }
    __syncthreads();
    if (tid < n) {
        int r = run[tid];
        for (int w = 0; w < nwarps; w++) {
            int c = wcnt[w * n + tid];
            wcnt[w * n + tid] = r;
            r += c;
        }
        run[tid] = r;
    }
    __syncthreads();
    for (int d = 0; d < n; d++) {
        unsigned bit = (mask >> d) & 1u, bl = __ballot_sync(FULL, bit);
        if (valid)
            out[d] = bit ? wcnt[warp * n + d] + __popc(bl & lt) : -1;
    }
    __syncthreads();
}

// ---------------------------------------------------------------- node pack (N > 1)
// Own token i goes to node m's send slot (once, if any of its experts is there) at row
// node_pos[i][m] = rows of node m of the tokens before it. Block b publishes its rows
// [first, first + count) of every slot to the proxy; the last block publishes each slot's
// count and flag words.
__global__ void __launch_bounds__(DISPATCH_THREADS, 1) k_node_pack(hep_kargs a)
{
    extern __shared__ int ncnt[]; // [N][R][El + 1]: the count block of each node's slot
    const int N = a.N, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int R = a.R, El = a.El, CBI = R * (El + 1);
    const size_t CBW = HEP_COUNT_BLOCK_WORDS((size_t)R, (size_t)El);
    const int nwarps = blockDim.x >> 5, S = gridDim.x, b = blockIdx.x;
    const long long Enode = (long long)a.El * a.R, E = Enode * N;
    __shared__ int wcnt[32][HEP_GPU_MAX_NODES], run[HEP_GPU_MAX_NODES], pre[HEP_GPU_MAX_NODES];
    __shared__ unsigned long long s_epoch;
    __shared__ int s_last;
    int t0, t1;
    if (aborted(a))
        return;
    if (tid == 0)
        s_epoch = *a.epoch + 1;
    if (tid < N)
        run[tid] = 0;
    for (int j = tid; j < N * CBI; j += blockDim.x)
        ncnt[j] = 0;
    if (b == 0) /* the previous call's blocks went out before this call was submitted */
        for (int j = tid; j < N * CBI; j += blockDim.x)
            ((int *)(a.send_words + 3 * N))[(size_t)(j / CBI) * 2 * CBW + j % CBI] = 0;
    __syncthreads();
    const unsigned long long e = s_epoch;
    block_range(a.t, b, S, t0, t1);

    for (int tile = t0; tile < t1; tile += blockDim.x) {
        const int i = tile + tid;
        unsigned mask = 0;
        if (i < t1)
            for (int k = 0; k < a.K; k++) {
                long long x = topk_at(a, i, k);
                if (x < 0 || x >= E || (int)(x / Enode) == a.node)
                    continue;
                const int m = (int)(x / Enode), d = (int)((x % Enode) / El);
                bool dup_rank = false, dup = false;
                for (int q = 0; q < k; q++) {
                    long long y = topk_at(a, i, q);
                    dup |= y == x;
                    dup_rank |= y >= 0 && y < E && y / El == x / El;
                }
                mask |= 1u << m;
                int *c = ncnt + (size_t)m * CBI + (size_t)d * (El + 1);
                if (!dup_rank)
                    atomicAdd(c, 1); /* the token goes to rank d of node m once */
                if (!dup)
                    atomicAdd(c + 1 + (int)(x % El), 1);
            }
        tile_positions(mask, N, i < t1, a.node_pos + (size_t)i * N, &wcnt[0][0], run);
    }
    if (tid < N)
        a.node_blocks[(size_t)b * N + tid] = run[tid];
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        red_add_release(a.pack_arrive, 1ull);
    }
    if (!grid_wait(a, a.pack_arrive, e * (unsigned long long)S))
        return;
    // the count blocks first (zeroed by block 0 before the grid barrier): the receivers lay
    // out with them while the rows travel
    for (int j = tid; j < N * CBI; j += blockDim.x)
        if (ncnt[j] && j / CBI != a.node)
            atomicAdd((int *)(a.send_words + 3 * N) + (size_t)(j / CBI) * 2 * CBW + j % CBI,
                      ncnt[j]);
    __syncthreads();
    if (tid == 0) {
        __threadfence_system();
        s_last = atomicAdd(a.count_done, 1ull) == e * (unsigned long long)S - 1;
    }
    __syncthreads();
    if (s_last && tid < N && tid != a.node) {
        __threadfence();
        a.send_words[2 * N + tid] = e;
        __threadfence_system();
        st_release(a.px + HEP_PX_WORD(N, 0, tid) + 3 * HEP_PX_MAX_BLOCKS + 1, e);
    }
    if (tid < N) {
        int p = 0;
        for (int q = 0; q < b; q++)
            p += ld_volatile_int(a.node_blocks + (size_t)q * N + tid);
        pre[tid] = p;
    }
    __syncthreads();
    for (int k = tid; k < (t1 - t0) * N; k += blockDim.x) {
        int *p = a.node_pos + (size_t)t0 * N + k;
        if (*p >= 0)
            *p += pre[k % N];
    }
    __syncthreads();

    // copy each token once per node that needs it: row, sanitized routing, scales
    const size_t rb = (size_t)a.H * a.esize, nvec = rb / 16, T = (size_t)a.T;
    for (int i = t0 + warp; i < t1; i += nwarps) {
        const int pos = lane < N ? a.node_pos[(size_t)i * N + lane] : -1;
        const unsigned mask = __ballot_sync(FULL, pos >= 0);
        long long myid = lane < a.K ? topk_at(a, i, lane) : -1;
        if (myid < -1 || myid >= E)
            myid = -1; /* reported by the dispatch kernel; travels as an unused slot */
        const float myw = lane < a.K ? a.weights[(size_t)i * a.K + lane] : 0.f;
        const uint4 *src = (const uint4 *)((const char *)a.tokens + (size_t)i * rb);
        for (unsigned m = mask; m; m &= m - 1) {
            const int L = __ffs(m) - 1;
            const size_t j = (size_t)slot_index(L, a.node);
            const size_t row = (size_t)__shfl_sync(FULL, pos, L);
            uint4 *dst = (uint4 *)(a.send_token + (j * T + row) * rb);
            for (size_t v = lane; v < nvec; v += 32)
                dst[v] = __ldg(src + v);
            if (lane < a.kmax) {
                a.send_route[(j * 2 * T + row) * a.kmax + lane] = (int)myid;
                ((float *)a.send_route)[(j * 2 * T + T + row) * a.kmax + lane] = myw;
            }
            for (int c = lane; c < a.nscale; c += 32)
                a.send_scale[(j * T + row) * a.nscale + c] = a.scales[(size_t)i * a.nscale + c];
        }
    }
    __syncthreads();
    if (tid == 0) {
        __threadfence_system();
        for (int L = 0; L < N; L++) {
            unsigned long long *w = a.px + HEP_PX_WORD(N, 0, L) + 3 * b;
            if (L == a.node)
                continue;
            w[1] = (unsigned long long)pre[L];
            w[2] = (unsigned long long)run[L];
            __threadfence_system();
            st_release(w, e);
        }
        __threadfence_system();
        s_last = atomicAdd(a.pack_done, 1ull) == e * (unsigned long long)S - 1;
    }
    __syncthreads();
    if (s_last && tid < N && tid != a.node) { // the last block: every slot's count, flag
        int total = 0;
        __threadfence();
        for (int q = 0; q < S; q++)
            total += ld_volatile_int(a.node_blocks + (size_t)q * N + tid);
        a.send_words[tid] = (unsigned long long)total;
        a.send_words[N + tid] = e;
        __threadfence_system();
        st_release(a.px + HEP_PX_WORD(N, 0, tid) + 3 * HEP_PX_MAX_BLOCKS, e);
    }
}

// ---------------------------------------------------------------- dispatch (fused)
// One kernel per call, S blocks. Block b owns tokens [b*chunk, (b+1)*chunk) of each list.
//  0. (N > 1) every block waits for the slots of the other nodes.
//  1. every block, per list: routing of its tokens -> destination mask, its position among
//     the block's tokens for each destination, per-(destination, expert) counts (added to
//     the published counts), its per-destination totals; then it arrives at the rank's
//     grid counter.
//  2. block 0: totals -> published counts -> COUNTS_READY; waits for every node-mate's;
//     derives this rank's row base at each destination for each list, what it receives,
//     tokens per expert; LAYOUT_READY. The other blocks meanwhile turn their positions into
//     rank-wide positions (prefix over the blocks before them).
//  3. every block: pushes its tokens' rows, probabilities and scales; arrives at every
//     destination; block 0 waits for every source's S arrivals.
#ifndef DU
#define DU 4
#endif
#ifdef HEP_STREAMING_STORES /* evict-first: the rows are not read again by this kernel */
#define ST_ROW(p, v) __stcs((p), (v))
#else
#define ST_ROW(p, v) (*(p) = (v))
#endif


// Block b's positions among its tokens of list L at each destination (handle.dest_rows,
// made rank-wide by rebase_list) and its totals (handle.block_counts); with `count`, the
// list's per-(destination, expert) counts are added to the published counts `mine`.
__device__ void scan_list(const hep_kargs &a, const lview &v, int L, bool count, int *cnt,
                          int *wcnt, int *run, int *mine)
{
    const int R = a.R, El = a.El, tid = threadIdx.x, S = gridDim.x, b = blockIdx.x;
    const long long E = (long long)El * R * a.N, first = (long long)a.rank0 * El;
    const size_t T = (size_t)a.T, LW = (size_t)R * (El + 1);
    int t0, t1;
    block_range(v.t, b, S, t0, t1);
    for (int j = tid; j < R * El; j += blockDim.x)
        cnt[j] = 0;
    for (int j = tid; j < R; j += blockDim.x)
        run[j] = 0;
    __syncthreads();
    for (int tile = t0; tile < t1; tile += blockDim.x) {
        const int i = tile + tid;
        unsigned mask = 0;
        if (i < t1) {
            for (int k = 0; k < v.K; k++) {
                long long x = list_id(a, v, i, k);
                if (x == -1)
                    continue;
                if (x < -1 || x >= E) { /* own tokens only: slots carry -1 instead */
                    if (atomicCAS(&a.diag->invalid_claimed, 0u, 1u) == 0u) {
                        a.diag->bad_token = i;
                        a.diag->bad_slot = k;
                        a.diag->bad_value = x;
                    }
                    continue;
                }
                if (x < first || x >= first + (long long)R * El)
                    continue; /* another node's expert */
                const int d = (int)((x - first) / El), ex = (int)((x - first) % El);
                bool dup = false;
                for (int q = 0; q < k; q++)
                    dup |= list_id(a, v, i, q) == x;
                mask |= 1u << d;
                if (count && !dup)
                    atomicAdd(&cnt[d * El + ex], 1);
            }
        }
        tile_positions(mask, R, i < t1, a.dest_rows + ((size_t)L * T + i) * R, wcnt, run);
    }
    if (count)
        for (int j = tid; j < R * El; j += blockDim.x)
            if (cnt[j])
                atomicAdd(&mine[(size_t)L * LW + (j / El) * (El + 1) + 1 + j % El], cnt[j]);
    for (int d = tid; d < R; d += blockDim.x)
        a.block_counts[((size_t)L * S + b) * R + d] = run[d];
    __syncthreads();
}

// Block b's positions of list L made rank-wide: plus the rows of the blocks before it.
__device__ void rebase_list(const hep_kargs &a, int L, int t, int *pre)
{
    const int R = a.R, tid = threadIdx.x, S = gridDim.x, b = blockIdx.x;
    int t0, t1;
    block_range(t, b, S, t0, t1);
    for (int d = tid; d < R; d += blockDim.x) {
        int p = 0;
        for (int q = 0; q < b; q++)
            p += ld_volatile_int(a.block_counts + ((size_t)L * S + q) * R + d);
        pre[d] = p;
    }
    __syncthreads();
    for (int k = tid; k < (t1 - t0) * R; k += blockDim.x) {
        int *dr = a.dest_rows + ((size_t)L * (size_t)a.T + t0) * R + k;
        if (*dr >= 0)
            *dr += pre[k % R];
    }
    __syncthreads();
}

// Block b pushes its tokens of list L: rows, probabilities and scales at every destination.
__device__ void push_list(const hep_kargs &a, const lview &v, int L, char *const *s_x,
                          float *const *s_prob, float *const *s_scale)
{
    const int R = a.R, El = a.El, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5, S = gridDim.x, b = blockIdx.x;
    const long long first = (long long)a.rank0 * El;
    const size_t rb = (size_t)a.H * a.esize, nvec = rb / 16, T = (size_t)a.T;
    const int mybase = lane < R ? ld_volatile_int(a.meta + L * R + lane) : 0;
    int t0, t1;
    block_range(v.t, b, S, t0, t1);
    const int per_warp = (t1 - t0 + nwarps - 1) / nwarps;
    const int w0 = min(t1, t0 + warp * per_warp), w1 = min(t1, w0 + per_warp);
#ifdef HEP_STRIDED_TOKENS
    for (int i = t0 + warp; i < t1; i += nwarps) {
#else
    /* consecutive tokens per warp: their rows at a destination are adjacent, so each
     * warp's writes stay in few DRAM pages */
    for (int i = w0; i < w1; i++) {
#endif
        int pos = lane < R ? a.dest_rows[((size_t)L * T + i) * R + lane] : -1;
        int row = pos >= 0 ? mybase + pos : -1;
        unsigned mask = __ballot_sync(FULL, row >= 0);
        long long myid = lane < v.K ? list_id(a, v, i, lane) : -2;
        float myw = lane < v.K ? list_w(a, v, i, lane) : 0.f;
        const uint4 *src = (const uint4 *)(v.tok + (size_t)i * rb);
        for (size_t v0 = 0; v0 < nvec; v0 += 32 * DU) {
            uint4 buf[DU];
#pragma unroll
            for (int u = 0; u < DU; u++) {
                size_t q = v0 + (size_t)u * 32 + lane;
                if (q < nvec)
                    buf[u] = v.slot ? ld_cg(src + q) : __ldg(src + q);
            }
            for (unsigned m = mask; m; m &= m - 1) {
                int d = __ffs(m) - 1;
                int r = __shfl_sync(FULL, row, d);
                uint4 *dst = (uint4 *)(s_x[d] + (size_t)r * rb);
#pragma unroll
                for (int u = 0; u < DU; u++) {
                    size_t q = v0 + (size_t)u * 32 + lane;
                    if (q < nvec)
                        ST_ROW(dst + q, buf[u]);
                }
            }
        }
        for (unsigned m = mask; m; m &= m - 1) {
            int d = __ffs(m) - 1;
            int r = __shfl_sync(FULL, row, d);
            for (int j0 = 0; j0 < El; j0 += 32) {
                long long want = first + (long long)d * El + j0 + lane;
                float p = 0.f;
                for (int k = 0; k < v.K; k++) {
                    long long x = __shfl_sync(FULL, myid, k);
                    float w = __shfl_sync(FULL, myw, k);
                    p += x == want ? w : 0.f;
                }
                if (j0 + lane < El)
                    s_prob[d][(size_t)r * El + j0 + lane] = p;
            }
            for (int c = lane; c < a.nscale; c += 32)
                s_scale[d][(size_t)r * a.nscale + c] = v.scl[(size_t)i * a.nscale + c];
        }
    }
}

__global__ void __launch_bounds__(DISPATCH_THREADS, 1) k_dispatch(hep_kargs a)
{
    extern __shared__ int sm[];
    const int R = a.R, El = a.El, N = a.N, tid = threadIdx.x;
    const int S = gridDim.x, b = blockIdx.x;
    int *cnt = sm;                      // [R][El]
    int *wcnt = cnt + R * El;           // [32][R]
    int *run = wcnt + 32 * R;           // [R]
    int *pre = run + R;                 // [R] rows of earlier blocks
    __shared__ unsigned long long s_epoch;
    /* destination tables in shared memory: indexing the kernel parameters by a run-time
     * destination compiles to constant-bank loads, which stall on every row pass */
    __shared__ char *s_x[HEP_GPU_MAX_LOCAL];
    __shared__ float *s_prob[HEP_GPU_MAX_LOCAL], *s_scale[HEP_GPU_MAX_LOCAL];
    const size_t LW = (size_t)R * (El + 1); // counts words of one list

    if (aborted(a))
        return;
    if (tid == 0) {
        s_epoch = *a.epoch + 1;
        if (b == 0)
            a.diag->t_start = now_ns();
    }
    for (int j = tid; j < R; j += blockDim.x) {
        s_x[j] = a.x[j];
        s_prob[j] = a.prob[j];
        s_scale[j] = a.scale[j];
    }
    __syncthreads();
    const unsigned long long e = s_epoch;
    const size_t par = (size_t)(e & 1) * N * LW;
    int *mine = a.counts[a.local] + par;

    // 1. this rank's own tokens: positions within the block, counts
    scan_list(a, list_of(a, a.node), a.node, true, cnt, wcnt, run, mine);
    if (tid == 0) {
        __threadfence();
        red_add_release(a.grid_arrive, 1ull);
    }
    if (!grid_wait(a, a.grid_arrive, e * (unsigned long long)S))
        return;

    if (b == 0) { // 2. the rank's counts (the other nodes' slots: their count blocks), layout
        for (int d = tid; d < R; d += blockDim.x) {
            int total = 0;
            for (int q = 0; q < S; q++)
                total += ld_volatile_int(a.block_counts + ((size_t)a.node * S + q) * R + d);
            mine[(size_t)a.node * LW + (size_t)d * (El + 1)] = total;
        }
        if (N > 1) {
            const size_t CBW = HEP_COUNT_BLOCK_WORDS((size_t)R, (size_t)El);
            __shared__ int s_ok;
            if (tid == 0)
                s_ok = 1;
            __syncthreads();
            if (tid < N - 1) {
                int L = tid < a.node ? tid : tid + 1;
                if (!wait_geq(a, a.slot_words + 2 * N + tid, e, HEP_STAGE_NODE_DISPATCH,
                              L * R + a.local))
                    s_ok = 0;
            }
            __syncthreads();
            if (!s_ok)
                return;
            for (int j = tid; j < (N - 1) * (int)LW; j += blockDim.x) {
                const int sl = j / (int)LW, L = sl < a.node ? sl : sl + 1;
                mine[(size_t)L * LW + j % LW] = ld_volatile_int(
                    (const int *)(a.slot_words + 3 * N) + (size_t)sl * 2 * CBW + j % LW);
            }
        }
        __syncthreads();
        if (tid == 0) {
            *a.epoch = e;
            __threadfence_system();
            st_release(a.flags[a.local] + HEP_FLAG_COUNTS_READY, e);
        }
        if (tid < R)
            wait_mate(a, a.flags[tid] + HEP_FLAG_COUNTS_READY, e, HEP_STAGE_PREPROCESS, tid);
        __syncthreads();
        if (aborted(a))
            return;
        for (int j = tid; j < N * R; j += blockDim.x) { // my base for list L at dest d
            const int L = j / R, d = j % R;
            int off = 0;
            for (int L2 = 0; L2 <= L; L2++)
                for (int s2 = 0; s2 < (L2 < L ? R : a.local); s2++)
                    off += ld_volatile_int(a.counts[s2] + par + (size_t)L2 * LW +
                                           (size_t)d * (El + 1));
            a.meta[j] = off;
        }
        for (int j = tid; j <= El; j += blockDim.x) { // what I receive
            int sum = 0;
            for (int L2 = 0; L2 < N; L2++)
                for (int s2 = 0; s2 < R; s2++)
                    sum += ld_volatile_int(a.counts[s2] + par + (size_t)L2 * LW +
                                           (size_t)a.local * (El + 1) + j);
            if (j == 0)
                *a.recv_count = sum;
            else
                a.tokens_per_expert[j - 1] = sum;
            a.host_counts[j] = sum;
        }
        // the other parity was call e - 1's: every node-mate read it before it arrived
        // here at the end of that call; it is zeroed for call e + 1's additions
        for (int j = tid; j < N * (int)LW; j += blockDim.x)
            a.counts[a.local][(size_t)((e + 1) & 1) * N * LW + j] = 0;
        __syncthreads();
        if (tid == 0) {
            a.diag->t_layout = now_ns();
            __threadfence();
            st_release(a.layout_ready, e);
        }
    }
    rebase_list(a, a.node, a.t, pre);
    if (b != 0 && !grid_wait(a, a.layout_ready, e))
        return;
    if (b == 0)
        __syncthreads();

    // 3. push the own tokens (while the other nodes' rows may still travel), then theirs
    push_list(a, list_of(a, a.node), a.node, s_x, s_prob, s_scale);
    if (N > 1) {
        if (!wait_slots(a, a.slot_words, e, HEP_STAGE_NODE_DISPATCH))
            return;
        for (int L = 0; L < N; L++)
            if (L != a.node)
                scan_list(a, list_of(a, L), L, false, cnt, wcnt, run, mine);
        if (tid == 0) {
            __threadfence();
            red_add_release(a.grid_arrive2, 1ull);
        }
        if (!grid_wait(a, a.grid_arrive2, e * (unsigned long long)S))
            return;
        for (int L = 0; L < N; L++) {
            if (L == a.node)
                continue;
            const lview v = list_of(a, L);
            rebase_list(a, L, v.t, pre);
            push_list(a, v, L, s_x, s_prob, s_scale);
        }
    }
    __syncthreads();
    if (tid == 0) {
        __threadfence_system();
        for (int d = 0; d < R; d++)
            red_add_release(a.flags[d] + HEP_FLAG_DISPATCH_ARRIVE + a.local, 1ull);
    }
    if (b == 0 && tid < R)
        wait_mate(a, a.flags[a.local] + HEP_FLAG_DISPATCH_ARRIVE + tid,
                  e * (unsigned long long)S, HEP_STAGE_DISPATCH, tid);
}

extern "C" size_t hep_dispatch_smem(int R, int El)
{
    return sizeof(int) * ((size_t)R * El + 32 * (size_t)R + 2 * (size_t)R);
}

// ---------------------------------------------------------------- combine
#ifndef CU
#define CU 4
#endif
#ifdef HEP_STREAMING_LOADS
#define LD_ROW(p) __ldcs(p)
#else
#define LD_ROW(p) ld_cg(p)
#endif
#ifndef CD
#define CD 2
#endif

__device__ __forceinline__ void acc8(float *f, uint4 v)
{
    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&v;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        float2 x = __bfloat1622float2(h[q]);
        f[2 * q] += x.x;
        f[2 * q + 1] += x.y;
    }
}

__device__ __forceinline__ uint4 pack8(const float *f)
{
    uint4 v;
    __nv_bfloat162 *h = (__nv_bfloat162 *)&v;
#pragma unroll
    for (int q = 0; q < 4; q++)
        h[q] = __floats2bfloat162_rn(f[2 * q], f[2 * q + 1]);
    return v;
}

// One warp: the row `out` = f32 sum over the node-mates holding token i of list L (in
// ascending local rank), then (parts != NULL, own tokens) plus each other node's partial
// sum of it (ascending node), rounded to BF16 once.
__device__ __forceinline__ void combine_row(const hep_kargs &a, const char *const *s_x, int L,
                                            int i, int mybase, uint4 *out, const char *parts)
{
    const int lane = threadIdx.x & 31, R = a.R;
    const size_t rb = (size_t)a.H * 2, nvec = rb / 16, T = (size_t)a.T;
    int pos = lane < R ? a.dest_rows[((size_t)L * T + i) * R + lane] : -1;
    int row = pos >= 0 ? mybase + pos : -1;
    unsigned mask = __ballot_sync(FULL, row >= 0);
    int npos = parts && lane < a.N && lane != a.node ? a.node_pos[(size_t)i * a.N + lane] : -1;
    unsigned nmask = __ballot_sync(FULL, npos >= 0);
    for (size_t v0 = 0; v0 < nvec; v0 += 32 * CU) {
        float f[CU][8];
#pragma unroll
        for (int u = 0; u < CU; u++)
#pragma unroll
            for (int q = 0; q < 8; q++)
                f[u][q] = 0.f;
        // in ascending destination order, CD destinations' rows loaded together
        for (unsigned m = mask; m;) {
            const uint4 *src[CD];
            int n = 0;
#pragma unroll
            for (int c = 0; c < CD; c++) {
                src[c] = NULL;
                if (m) {
                    int d = __ffs(m) - 1;
                    m &= m - 1;
                    src[c] = (const uint4 *)(s_x[d] + (size_t)__shfl_sync(FULL, row, d) * rb);
                    n++;
                }
            }
            uint4 v[CD][CU];
#pragma unroll
            for (int c = 0; c < CD; c++)
#pragma unroll
                for (int u = 0; u < CU; u++) {
                    size_t k = v0 + (size_t)u * 32 + lane;
                    v[c][u] = (c < n && k < nvec) ? LD_ROW(src[c] + k) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
            for (int c = 0; c < CD; c++)
                if (c < n)
#pragma unroll
                    for (int u = 0; u < CU; u++)
                        acc8(f[u], v[c][u]);
        }
        for (unsigned m = nmask; m; m &= m - 1) { // the other nodes' partial sums
            const int M = __ffs(m) - 1;
            const uint4 *src = (const uint4 *)(parts + ((size_t)slot_index(M, a.node) * T +
                                                        (size_t)__shfl_sync(FULL, npos, M)) * rb);
#pragma unroll
            for (int u = 0; u < CU; u++) {
                size_t k = v0 + (size_t)u * 32 + lane;
                if (k < nvec)
                    acc8(f[u], ld_cg(src + k));
            }
        }
#pragma unroll
        for (int u = 0; u < CU; u++) {
            size_t k = v0 + (size_t)u * 32 + lane;
            if (k < nvec)
                out[k] = pack8(f[u]);
        }
    }
}

// S blocks. N > 1: first the partial sums of the other nodes' tokens (slot by slot, block
// b's share published to the proxy as it completes; the last block publishes each slot's
// count and flag), then the wait for the other nodes' partial sums of this rank's tokens.
// Then this rank's tokens.
__global__ void __launch_bounds__(COMBINE_THREADS, 1) k_combine(hep_kargs a)
{
    if (aborted(a))
        return;
    const int R = a.R, N = a.N, tid = threadIdx.x, S = gridDim.x, b = blockIdx.x;
    const int lane = tid & 31, wpb = blockDim.x >> 5, warp = tid >> 5;
    const int gw = b * wpb + warp, nw = S * wpb;
    const size_t rb = (size_t)a.H * 2, T = (size_t)a.T;
    const unsigned long long e = *a.epoch;
    __shared__ const char *s_x[HEP_GPU_MAX_LOCAL]; /* see k_dispatch */
    __shared__ int s_last;
    if (tid < R)
        s_x[tid] = a.x[tid];

    if (b == 0 && tid == 0) {
        __threadfence_system();
        st_release(a.flags[a.local] + HEP_FLAG_COMBINE_READY, e);
    }
    if (tid < R)
        wait_mate(a, a.flags[tid] + HEP_FLAG_COMBINE_READY, e, HEP_STAGE_COMBINE, tid);
    __syncthreads();
    if (aborted(a))
        return;
    if (N > 1) {
        for (int L = 0; L < N; L++) {
            if (L == a.node)
                continue;
            const int s = slot_index(L, a.node), t = (int)ld_relaxed(a.slot_words + s);
            const int mybase = lane < R ? a.meta[L * R + lane] : 0;
            int t0, t1;
            block_range(t, b, S, t0, t1);
            const int per_warp = (t1 - t0 + wpb - 1) / wpb;
            const int w0 = min(t1, t0 + warp * per_warp), w1 = min(t1, w0 + per_warp);
            for (int i = w0; i < w1; i++)
                combine_row(a, s_x, L, i, mybase,
                            (uint4 *)(a.red_token + ((size_t)s * T + i) * rb), NULL);
            __syncthreads();
            if (tid == 0) {
                unsigned long long *w = a.px + HEP_PX_WORD(N, 1, L) + 3 * b;
                __threadfence_system();
                w[1] = (unsigned long long)t0;
                w[2] = (unsigned long long)(t1 - t0);
                __threadfence_system();
                st_release(w, e);
            }
        }
        if (tid == 0) {
            __threadfence_system();
            s_last = atomicAdd(a.combine_done, 1ull) == e * (unsigned long long)S - 1;
        }
        __syncthreads();
        if (s_last && tid < N && tid != a.node) {
            __threadfence();
            a.red_words[tid] = ld_relaxed(a.slot_words + slot_index(tid, a.node));
            a.red_words[N + tid] = e;
            __threadfence_system();
            st_release(a.px + HEP_PX_WORD(N, 1, tid) + 3 * HEP_PX_MAX_BLOCKS, e);
        }
        if (!wait_slots(a, a.part_words, e, HEP_STAGE_NODE_COMBINE))
            return;
    }
    const int mybase = lane < R ? a.meta[a.node * R + lane] : 0;
#ifdef HEP_STRIDED_TOKENS
    for (int i = gw; i < a.t; i += nw) {
#else
    const int per_warp = (a.t + nw - 1) / nw;
    const int w0 = min(a.t, gw * per_warp), w1 = min(a.t, w0 + per_warp);
    for (int i = w0; i < w1; i++) {
#endif
        combine_row(a, s_x, a.node, i, mybase,
                    (uint4 *)((char *)a.combine_out + (size_t)i * rb),
                    N > 1 ? a.part_token : NULL);
    }
}

// Copy the caller's expert outputs into this rank's X (count read on the device).
__global__ void k_copy_in(hep_kargs a)
{
    const size_t rb = (size_t)a.H * 2, nvec = rb / 16;
    const size_t total = (size_t)*a.recv_count * nvec;
    const uint4 *src = (const uint4 *)a.combine_in;
    uint4 *dst = (uint4 *)a.x[a.local];
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total;
         k += (size_t)gridDim.x * blockDim.x) {
        size_t r = k / nvec, c = k % nvec;
        dst[r * nvec + c] = __ldg((const uint4 *)((const char *)src + r * a.x_stride_in) + c);
    }
}

// ---------------------------------------------------------------- launchers
extern "C" int hep_launch_dispatch(const hep_kargs *a, int blocks, void *stream)
{
    size_t smem = hep_dispatch_smem(a->R, a->El);
    cudaError_t e = cudaSuccess;
    if (smem > 48 * 1024)
        e = cudaFuncSetAttribute(k_dispatch, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)smem);
    if (e != cudaSuccess)
        return (int)e;
    k_dispatch<<<blocks, DISPATCH_THREADS, smem, (cudaStream_t)stream>>>(*a);
    return (int)cudaGetLastError();
}

extern "C" size_t hep_node_pack_smem(int N, int R, int El)
{
    return sizeof(int) * (size_t)N * (size_t)R * (size_t)(El + 1); /* the count blocks */
}

extern "C" int hep_launch_node_pack(const hep_kargs *a, int blocks, void *stream)
{
    size_t smem = hep_node_pack_smem(a->N, a->R, a->El);
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(
            k_node_pack, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess)
            return (int)e;
    }
    k_node_pack<<<blocks, DISPATCH_THREADS, smem, (cudaStream_t)stream>>>(*a);
    return (int)cudaGetLastError();
}

extern "C" int hep_launch_combine(const hep_kargs *a, int blocks, void *stream)
{
    k_combine<<<blocks, COMBINE_THREADS, 0, (cudaStream_t)stream>>>(*a);
    return (int)cudaGetLastError();
}

extern "C" int hep_launch_copy_in(const hep_kargs *a, int blocks, void *stream)
{
    k_copy_in<<<blocks, 512, 0, (cudaStream_t)stream>>>(*a);
    return (int)cudaGetLastError();
}

// With lazy module loading (the CUDA 12+ default) a kernel's first launch loads it, and the
// load can wait for the kernels already running: when those spin for this very kernel,
// that is a deadlock. Group creation loads every kernel up front.
extern "C" int hep_kernels_preload(void)
{
    cudaFuncAttributes fa;
    const void *k[] = {(const void *)k_dispatch, (const void *)k_combine,
                       (const void *)k_copy_in, (const void *)k_node_pack};
    for (unsigned i = 0; i < sizeof(k) / sizeof(k[0]); i++) {
        cudaError_t e = cudaFuncGetAttributes(&fa, k[i]);
        if (e != cudaSuccess)
            return (int)e;
    }
    return 0;
}
