// kernels/lists.cuh: the token lists a rank forwards, each block's share of them, and the
// parallel position and prefix helpers of the layout step. Included by the .cu files of
// kernels/ only.
//
// A rank forwards N lists of tokens to its node-mates: list `node` is its own tokens (the
// caller's routing); list L != node (N > 1) is the slot received from the peer on node L
// (its tokens that this node needs, packed in source order, with kmax-wide routing). Row
// order at a destination is [list][source local rank][token]: the documented
// [source node][source local rank][token].
#ifndef HEP_KERNELS_LISTS_CUH
#define HEP_KERNELS_LISTS_CUH

#include "kernels/sync.cuh"

struct lview {
    int t, K, slot;
    const char *tok;
    const float *scl;
    const int *ids;
    const float *w;
    const int *off; /* a slot: [t][R] each token's offset at each local rank (else NULL) */
    const int *place; /* a slot: [t][kmax] each slot's expert-major place (else NULL) */
};

__device__ __forceinline__ long long topk_at(const hep_kargs &a, int i, int k)
{
    size_t o = (size_t)i * a.K + k;
    return a.index64 ? ((const long long *)a.topk_idx)[o] : (long long)((const int *)a.topk_idx)[o];
}

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
        v.off = NULL;
        v.place = NULL;
    } else {
        /* the whole slot: only where its ring holds it (P x C >= T: the expert-major
         * layout; the rank-major path reads a ring chunk by chunk, dispatch.cu) */
        const size_t s = (size_t)slot_index(L, a.node), ST = (size_t)a.ST;
        v.t = (int)ld_relaxed(a.slot_words + s), v.K = a.kmax, v.slot = 1;
        v.tok = a.slot_token + s * ST * (size_t)a.H * a.esize;
        v.scl = a.slot_scale ? a.slot_scale + s * ST * a.nscale : NULL;
        v.ids = a.slot_route + s * ST * (size_t)HEP_GPU_ROUTE_WORDS(a.kmax, a.R);
        v.w = (const float *)(v.ids + ST * a.kmax);
        v.off = v.ids + 2 * ST * a.kmax;
        v.place = v.off + ST * a.R;
    }
    return v;
}

// A slot's words landed over the network, and with rings a position is written again in
// the same kernel for a later chunk: they are read at L2 (ld.cg), never from a line an
// earlier chunk left in L1 (the acquire after the chunk's flag orders them too; this does
// not rely on how it is implemented).
__device__ __forceinline__ long long list_id(const hep_kargs &a, const lview &v, int i, int k)
{
    return v.slot ? (long long)__ldcg(v.ids + (size_t)i * a.kmax + k) : topk_at(a, i, k);
}
__device__ __forceinline__ float list_w(const hep_kargs &a, const lview &v, int i, int k)
{
    (void)a;
    return v.slot ? __ldcg(v.w + (size_t)i * v.K + k) : v.w[(size_t)i * v.K + k];
}

// Block b's share of a list of t tokens: [t0, t1).
__device__ __forceinline__ void block_range(int t, int b, int S, int &t0, int &t1)
{
    const int chunk = (t + S - 1) / S;
    t0 = min(t, b * chunk);
    t1 = min(t, t0 + chunk);
}

// Warp w's share of the block's tokens [t0, t1): consecutive tokens, so that its rows at a
// destination are adjacent and its writes stay in few DRAM pages.
__device__ __forceinline__ void warp_range(int t0, int t1, int w, int nw, int &w0, int &w1)
{
    const int per = (t1 - t0 + nw - 1) / nw;
    w0 = min(t1, t0 + w * per);
    w1 = min(t1, w0 + per);
}

// The inclusive prefix sum of v over the warp's lanes (lane k: lanes 0..k).
__device__ __forceinline__ int warp_scan(int v)
{
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(FULL, v, o);
        if (lane >= o)
            v += y;
    }
    return v;
}

__device__ __forceinline__ int warp_sum(int v)
{
#pragma unroll
    for (int o = 16; o; o >>= 1)
        v += __shfl_xor_sync(FULL, v, o);
    return v;
}

// One tile of blockDim.x tokens, each thread holding a mask of n bits for its token: the
// token's position among the block's tokens with bit d (earlier tiles counted in run[d])
// goes to out[d], -1 where the bit is clear. wcnt holds [32 warps][n]. The per-warp
// offsets are a prefix over the block's warps: one warp per destination, one lane a warp.
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
    for (int d = warp; d < n; d += nwarps) {
        const int c = lane < nwarps ? wcnt[lane * n + d] : 0;
        const int x = warp_scan(c); /* over the warps */
        const int r = run[d];
        if (lane < nwarps)
            wcnt[lane * n + d] = r + x - c;
        __syncwarp();
        if (lane == 31)
            run[d] = r + x;
    }
    __syncthreads();
    for (int d = 0; d < n; d++) {
        unsigned bit = (mask >> d) & 1u, bl = __ballot_sync(FULL, bit);
        if (valid)
            out[d] = bit ? wcnt[warp * n + d] + __popc(bl & lt) : -1;
    }
    __syncthreads();
}

// After every block published its per-destination totals bc[q * n + d] (q < S blocks):
// pre[d] = rows of the blocks before b, tot[d] = rows of all blocks. One warp per
// destination, the blocks spread over its lanes: S / 32 independent loads per lane
// instead of b dependent ones.
__device__ __forceinline__ void block_prefix(const int *bc, int S, int n, int b, int *pre,
                                             int *tot)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int d = warp; d < n; d += nwarps) {
        int p = 0, t = 0;
        for (int q = lane; q < S; q += 32) {
            const int c = ld_l2(bc + (size_t)q * n + d);
            t += c;
            p += q < b ? c : 0;
        }
        p = warp_sum(p);
        t = warp_sum(t);
        if (lane == 0) {
            pre[d] = p;
            if (tot)
                tot[d] = t;
        }
    }
    __syncthreads();
}

// Positions [t0, t1) x n made rank-wide: plus the rows of the blocks before this one.
__device__ __forceinline__ void rebase_positions(int *pos, int t0, int t1, int n, const int *pre)
{
    for (int k = threadIdx.x; k < (t1 - t0) * n; k += blockDim.x) {
        int *p = pos + (size_t)t0 * n + k;
        const int v = *p;
        if (v >= 0)
            *p = v + pre[k % n];
    }
    __syncthreads();
}

// The last block of the kernel to finish resets the n work counters (and its done counter)
// for the next call: the next kernel on the stream starts only after this one ended.
__device__ __forceinline__ void work_done(unsigned *work, int n, unsigned *done)
{
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence(); /* this block's grabs come before its arrival */
        if (atomicAdd(done, 1u) == gridDim.x - 1) {
            for (int j = 0; j < n; j++)
                work[j] = 0;
            *done = 0;
        }
    }
}

#endif
