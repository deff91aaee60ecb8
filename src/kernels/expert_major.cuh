// kernels/expert_major.cuh: the expert-major layout of the dispatch kernel, fused into
// k_dispatch<true> (dispatch.cu): every (token, local expert) row goes straight to its
// expert-major position in the destination's caller memory, or (a.em_stage: the node's
// ranks in several processes) in the destination's group-owned staging at the same
// position, which the destination copies into its caller memory after the kernel
// (k_em_stage_out, combine.cu). Included by dispatch.cu only.
//
// Positions (the host backend's, hybridep.h "Layouts"): at destination d, local expert e's
// block starts at EB_d[e] = the padded sizes of the blocks before it; inside it the rows
// come in receive order, i.e. by source rank, then token. So the row of source s's token i
// on (d, e) is EB_d[e] + (rows of sources before s on (d, e)) + (tokens of s before i on
// (d, e)). The last term is a second per-(d, e) prefix over the tokens, in token order:
//  1. before the grid barrier each block saves its per-(d, e) counts (the scan's s.cnt) to
//     ebc[b]; then, while block 0 lays out (block 0 itself after the release), each block
//     gives each of its (token, slot) pairs that is a token's first slot on (d, e) its
//     place among the block's tokens on (d, e), in tiles of one pair a thread (warps group
//     their lanes by (d, e) with __match_any_sync; one warp turns the groups' sizes into
//     bases, warp by warp, in shared memory): epos;
//  2. block 0, after the counts of every node-mate are in (layout_publish), derives
//     ebase[d][e] = EB_d[e] + rows of the node-mates before this rank, and for its own
//     experts the padded sizes clipped to the budget, the rows written, the overflow flag
//     and the dropped rows (em, tpe64);
//  3. after the layout is released every block adds the earlier blocks' counts (ebc) and
//     ebase to its pairs' places: epos holds each pair's row, -1 at or past the budget.
// A row is dropped exactly when its position is at or past the budget: the host's rule.
// With HEP_REUSE_LAYOUT steps 1-3 are skipped: epos, em and tpe64 are the handle's.
//
// Across nodes (N > 1) the rank forwards N lists (lists.cuh: its own tokens, then each other
// node's slot), and the sources of a destination's rows are (list, local rank) in that
// order: the host's [source node][source local rank][token]. Each list has its own epos
// and ebase in the handle (em_epos, em_ebase); block 0 derives every list's ebase from the
// counts layout_publish gathered per (list, source); the own list goes as on one node,
// while the slots travel. The last term of a slot token's row is its place among its
// sender's tokens on that expert, which the sender's pack kernel computed and shipped
// with the token (node_pack.cu, em_place): so each ring chunk is placed and forwarded as
// it lands (em_forward_token, from dispatch.cu's ring loop), rings smaller than a slot
// included. A slot's pair also keeps its key d El + e (ekey), which combine needs (the
// slot's routing is gone by then).
#ifndef HEP_KERNELS_EXPERT_MAJOR_CUH
#define HEP_KERNELS_EXPERT_MAJOR_CUH

#include "kernels/layout.cuh"

// List L's part of the handle's expert-major layout (N = 1: L = 0, the whole of it).
__device__ __forceinline__ int *em_epos(const hep_kargs &a, int L)
{
    return a.epos + (size_t)L * a.T * a.kmax;
}
__device__ __forceinline__ int *em_ebase(const hep_kargs &a, int L)
{
    return a.ebase + (size_t)L * a.R * a.El;
}
__device__ __forceinline__ int *em_ebc(const hep_kargs &a, int L)
{
    return a.ebc + (size_t)L * gridDim.x * a.R * a.El;
}
__device__ __forceinline__ int *em_ekey(const hep_kargs &a, int L) /* L != a.node */
{
    return a.ekey + (size_t)slot_index(L, a.node) * a.T * a.kmax;
}

// Block 0, at the start of the call: where this rank's caller outputs are, for the
// node-mates (released with COUNTS_READY by layout_publish or layout_reuse).
__device__ __forceinline__ void em_publish_outputs(const hep_kargs &a)
{
    unsigned long long *f = a.flags[a.local];
    f[HEP_FLAG_EM_TOKENS] = (unsigned long long)(uintptr_t)a.em_tokens;
    f[HEP_FLAG_EM_PROBS] = (unsigned long long)(uintptr_t)a.em_probs;
    f[HEP_FLAG_EM_SCALES] = (unsigned long long)(uintptr_t)a.em_scales;
}

// 1a. After scan_list of the own tokens, before the grid barrier: the block's counts to
// ebc[b] (em_finalize of the later blocks adds them up after the layout is released).
__device__ __forceinline__ void em_save_counts(const hep_kargs &a, const layout_smem &s)
{
    const int RE = a.R * a.El;
    int *ebc = em_ebc(a, a.node) + (size_t)blockIdx.x * RE;
    for (int j = threadIdx.x; j < RE; j += blockDim.x)
        ebc[j] = s.cnt[j];
}

// 1b. The block's pairs' places among its tokens on each (d, e) into epos (-1: not a
// token's first slot on this node). Off the layout's critical path: the other blocks run
// it while block 0 lays out, block 0 after it released the layout; only this block reads
// its epos. The pairs go in tiles of whole tokens, one pair a thread, in (token, slot)
// order: every thread loads its pair's id (one coalesced load) and finds its key (d, e),
// a repeat of an earlier slot of its token dropping out through shared memory; each warp
// groups its lanes by key (__match_any_sync: a lane's place in its group is its rank
// among the group's lanes) and lists its groups (key, size); one warp then walks the
// tile's warps in order, 32 groups at a time (a warp's groups have distinct keys), turning
// each group's size into its base from the running counts s.cnt, in shared memory only.
// List L (v): the own tokens, or (N > 1) another node's slot, whose pairs' keys also go to
// ekey. At the end s.cnt holds the block's counts of the list per (d, e).
static __device__ void em_places(const hep_kargs &a, const layout_smem &s, const lview &v, int L)
{
    const int RE = a.R * a.El, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int K = v.K, nw = blockDim.x >> 5, P = (int)(blockDim.x / K) * K;
    const long long first = (long long)a.rank0 * a.El;
    const unsigned lt = (1u << lane) - 1u;
    int *epos = em_epos(a, L);
    int *ekey = v.slot ? em_ekey(a, L) : NULL;
    int t0, t1;
    block_range(v.t, blockIdx.x, gridDim.x, t0, t1);
    for (int j = tid; j < RE; j += blockDim.x)
        s.cnt[j] = 0;
    const int n = (t1 - t0) * K;
    for (int q0 = 0; q0 < n; q0 += P) { /* q0 and P are multiples of K: whole tokens */
        const int el = q0 + tid, i = t0 + el / K, k = el % K;
        const bool mine = tid < P && el < n;
        int key = -1;
        if (mine) {
            const long long x = list_id(a, v, i, k);
            key = x >= first && x < first + RE ? (int)(x - first) : -1;
        }
        s.pkey[tid] = key;
        __syncthreads(); /* also orders the zeroed s.cnt, and the last tile's reads */
        for (int q = 1; q <= k && key >= 0; q++) /* slot k - q of the same token */
            if (s.pkey[tid - q] == key)
                key = -1;
        const unsigned peers = __match_any_sync(FULL, key);
        const int leader = __ffs(peers) - 1;
        const unsigned leaders = __ballot_sync(FULL, key >= 0 && leader == lane);
        const int g = __popc(leaders & ((1u << leader) - 1u)); /* the group's index */
        if (key >= 0 && leader == lane) {
            s.gkey[warp * 32 + g] = key;
            s.gcnt[warp * 32 + g] = __popc(peers);
        }
        if (lane == 0 && __popc(leaders) < 32)
            s.gkey[warp * 32 + __popc(leaders)] = -1; /* the end of the warp's groups */
        __syncthreads();
        if (warp == 0) {
            for (int w = 0; w < nw; w++) {
                const int gk = s.gkey[w * 32 + lane];
                const unsigned endm = __ballot_sync(FULL, gk < 0); /* the first -1 ends it */
                if (lane < (endm ? __ffs(endm) - 1 : 32)) {
                    const int base = s.cnt[gk];
                    s.cnt[gk] = base + s.gcnt[w * 32 + lane];
                    s.gcnt[w * 32 + lane] = base;
                }
                __syncwarp();
            }
        }
        __syncthreads();
        if (mine) {
            epos[(size_t)i * K + k] = key >= 0 ? s.gcnt[warp * 32 + g] + __popc(peers & lt) : -1;
            if (ekey)
                ekey[(size_t)i * K + k] = key;
        }
        __syncthreads(); /* the next tile lists its groups over these */
    }
}

// 2. Block 0, after layout_publish of call e: every list's ebase, and this rank's own
// block sizes.
static __device__ void em_layout(const hep_kargs &a, unsigned long long e, const layout_smem &s)
{
    const int R = a.R, El = a.El, N = a.N, RE = R * El, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const size_t LW = (size_t)R * (El + 1), par = (size_t)(e & 1) * N * LW;
    const long long budget = a.budget, pad = a.pad;
    // rows on (d, x) from every source (s.cnt), and, for each list L, from the sources
    // before (L, this rank) in [list][local rank] order (list L's ebase, unpadded)
    for (int j = tid; j < RE; j += blockDim.x) {
        const int d = j / El, x = j % El;
        int c = 0;
        for (int L = 0; L < N; L++)
            for (int q = 0; q < R; q++) {
                if (q == a.local)
                    a.ebase[(size_t)L * RE + j] = c;
                c += ld_l2(a.counts[q] + par + (size_t)L * LW + (size_t)d * (El + 1) + 1 + x);
            }
        s.cnt[j] = c;
    }
    __syncthreads();
    // per destination a warp: the padded blocks' exclusive prefix over its experts
    for (int d = warp; d < R; d += nwarps) {
        long long base = 0, dropped = 0;
        for (int x0 = 0; x0 < El; x0 += 32) {
            const int x = x0 + lane;
            const long long c = x < El ? s.cnt[d * El + x] : 0;
            const long long pc = (c + pad - 1) / pad * pad;
            long long incl = pc;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const long long y = __shfl_up_sync(FULL, incl, o);
                if (lane >= o)
                    incl += y;
            }
            const long long eb = base + incl - pc;
            if (x < El) {
                for (int L = 0; L < N; L++) {
                    int *pb = a.ebase + (size_t)L * RE + d * El + x;
                    const long long p = eb + *pb;
                    *pb = (int)(p < budget ? p : budget);
                }
                if (d == a.local) {
                    const long long start = eb < budget ? eb : budget;
                    const long long dend = eb + c < budget ? eb + c : budget;
                    const long long pend = eb + pc < budget ? eb + pc : budget;
                    a.em[HEP_EM_WORDS + 2 * x] = (int)dend;
                    a.em[HEP_EM_WORDS + 2 * x + 1] = (int)pend;
                    a.tpe64[x] = pend - start;
                    dropped += c - (dend - start);
                }
            }
            base += __shfl_sync(FULL, incl, 31);
        }
        if (d == a.local) {
#pragma unroll
            for (int o = 16; o; o >>= 1)
                dropped += __shfl_xor_sync(FULL, dropped, o);
            if (lane == 0) {
                a.em[HEP_EM_NUM_PERMUTED] = (int)(base < budget ? base : budget);
                a.em[HEP_EM_OVERFLOW] = base > budget;
                a.em[HEP_EM_OVERFLOW_ROWS] = (int)(dropped < 0x7fffffffLL ? dropped : 0x7fffffffLL);
            }
        }
    }
    __syncthreads();
}

// 3. Every block, after the layout was released (a slot: after every block placed its
// pairs): its pairs' places of list L made rows.
static __device__ void em_finalize(const hep_kargs &a, const layout_smem &s, const lview &v, int L)
{
    const int RE = a.R * a.El, tid = threadIdx.x, b = blockIdx.x, K = v.K;
    const long long first = (long long)a.rank0 * a.El;
    const int *ebase = em_ebase(a, L), *ebc = em_ebc(a, L);
    int *epos = em_epos(a, L);
    int t0, t1;
    block_range(v.t, b, gridDim.x, t0, t1);
    for (int j = tid; j < RE; j += blockDim.x) {
        long long p = ld_l2(ebase + j);
        for (int q = 0; q < b; q++)
            p += ld_l2(ebc + (size_t)q * RE + j);
        s.cnt[j] = (int)(p < a.budget ? p : a.budget);
    }
    __syncthreads();
    for (int el = tid; el < (t1 - t0) * K; el += blockDim.x) {
        const int i = t0 + el / K, k = el % K;
        int *pp = epos + (size_t)i * K + k;
        const int o = *pp;
        if (o >= 0) {
            const long long pos = (long long)s.cnt[(int)(list_id(a, v, i, k) - first)] + o;
            *pp = pos < a.budget ? (int)pos : -1;
        }
    }
    __syncthreads();
}

// This rank's padding rows (zero tokens, probability and scales), spread over the
// kernel's warps: rows [data end, padding end) of each local expert.
__device__ void em_zero_padding(const hep_kargs &a)
{
    const int lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
    const int gw = blockIdx.x * wpb + (threadIdx.x >> 5), nw = gridDim.x * wpb;
    const size_t rb = (size_t)a.H * a.esize, nvec = rb / 16;
    for (int x = 0; x < a.El; x++) {
        const int r0 = ld_l2(a.em + HEP_EM_WORDS + 2 * x), r1 = ld_l2(a.em + HEP_EM_WORDS + 2 * x + 1);
        for (int r = r0 + gw; r < r1; r += nw) {
            uint4 *row = (uint4 *)((char *)a.em_tokens + (size_t)r * rb);
            for (size_t q = lane; q < nvec; q += 32)
                row[q] = make_uint4(0, 0, 0, 0);
            if (lane == 0)
                a.em_probs[r] = 0.f;
            for (int c = lane; c < a.nscale; c += 32)
                a.em_scales[(size_t)r * a.nscale + c] = 0.f;
        }
    }
}

// One warp pushes token i of view v: a row, its probability (the token's weights on that
// expert, summed in slot order) and its scales for every slot k whose lane holds its row
// (the token's first slot on an expert of this node, below the budget; else -1). U: the
// vectors a lane loads before it stores (push_row).
template <int U = DU>
__device__ __forceinline__ void em_push_rows(const hep_kargs &a, const lview &v, int i, int row,
                                             char *const *s_x, float *const *s_prob,
                                             float *const *s_scale)
{
    const int El = a.El, K = v.K, lane = threadIdx.x & 31;
    const long long first = (long long)a.rank0 * El;
    const size_t rb = (size_t)a.H * a.esize;
    const int nvec = (int)(rb / 16);
    const int passes = (nvec + 32 * U - 1) / (32 * U);
    const int per_pass = ((nvec + passes - 1) / passes + 31) & ~31;
    const unsigned mask = __ballot_sync(FULL, row >= 0);
    if (!mask)
        return;
    const long long myid = lane < K ? list_id(a, v, i, lane) : -2;
    const float myw = lane < K ? list_w(a, v, i, lane) : 0.f;
    float pk = 0.f;
    for (int q = 0; q < K; q++) {
        const long long x = __shfl_sync(FULL, myid, q);
        const float w = __shfl_sync(FULL, myw, q);
        pk += x == myid ? w : 0.f;
    }
#if MASK_MAGIC /* a lane with a row holds an expert of this node: 0 <= myid - first < R * El */
    const int kd = row >= 0 ? (int)hep_div_by_magic((unsigned)(myid - first), a.el_magic) : 0;
#else
    const int kd = row >= 0 ? (int)((myid - first) / El) : 0;
#endif
    push_row<U>((const uint4 *)(v.tok + (size_t)i * rb), v.slot != 0, mask, kd, row, s_x, rb, nvec,
             per_pass);
    if (row >= 0)
        s_prob[kd][row] = pk;
    for (unsigned m = mask; m; m &= m - 1) { /* scales: the lanes copy one pair's at a time */
        const int k = __ffs(m) - 1;
        const int d = __shfl_sync(FULL, kd, k), r = __shfl_sync(FULL, row, k);
        for (int c = lane; c < a.nscale; c += 32)
            s_scale[d][(size_t)r * a.nscale + c] =
                v.slot ? __ldcg(v.scl + (size_t)i * a.nscale + c) : v.scl[(size_t)i * a.nscale + c];
    }
}

// Token i of list L (v), its rows as the layout placed them (epos).
template <int U = DU>
__device__ __forceinline__ void em_push_token(const hep_kargs &a, const lview &v, int L, int i,
                                              char *const *s_x, float *const *s_prob,
                                              float *const *s_scale)
{
    const int lane = threadIdx.x & 31;
    const int row = lane < v.K ? em_epos(a, L)[(size_t)i * v.K + lane] : -1;
    em_push_rows<U>(a, v, i, row, s_x, s_prob, s_scale);
}

// N > 1, one warp: token q of the slot from node L, at row r of the ring chunk v that holds
// it. Its rows come from the places its sender shipped (node_pack.cu: among the sender's
// tokens on each expert) and list L's bases (em_layout: the padded blocks, the sources
// before the sender), so that any chunk is placed as it lands, without the whole slot;
// epos and ekey keep them for combine. push: false when the layout exceeded the receive
// capacity (only the handle's words are written).
__device__ __forceinline__ void em_forward_token(const hep_kargs &a, const lview &v, int L, int q,
                                                 int r, char *const *s_x, float *const *s_prob,
                                                 float *const *s_scale, bool push)
{
    const int lane = threadIdx.x & 31, K = a.kmax, RE = a.R * a.El;
    const long long first = (long long)a.rank0 * a.El;
    int row = -1, key = -1;
    if (lane < K) {
        const long long x = list_id(a, v, r, lane);
        const int pl = __ldcg(v.place + (size_t)r * K + lane);
        if (pl >= 0 && x >= first && x < first + RE) {
            key = (int)(x - first);
            const long long pos = (long long)ld_l2(em_ebase(a, L) + key) + pl;
            row = pos < a.budget ? (int)pos : -1;
        }
        em_epos(a, L)[(size_t)q * K + lane] = row;
        em_ekey(a, L)[(size_t)q * K + lane] = key;
    }
    if (push) /* RING_DU: the across-nodes instance's registers (dispatch.cu) */
        em_push_rows<RING_DU>(a, v, r, row, s_x, s_prob, s_scale);
}

// Every block after the layout: its pairs' rows (unless reused), the node-mates' output
// pointers into the block's tables, this rank's padding, then its own tokens' rows (U: as
// in push_row; across nodes RING_DU).
template <int U = DU>
static __device__ void em_push(const hep_kargs &a, const layout_smem &s, char **s_x,
                               float **s_prob, float **s_scale)
{
    const int tid = threadIdx.x;
    const lview own = list_of(a, a.node);
    if (!a.reuse)
        em_finalize(a, s, own, a.node);
    if (tid < a.R && a.em_stage) { /* across processes: the node-mates' staging */
        char *base = a.x[tid];
        s_x[tid] = base + a.em_xoff;
        s_prob[tid] = (float *)(base + a.em_poff);
        s_scale[tid] = a.em_soff ? (float *)(base + a.em_soff) : NULL;
    } else if (tid < a.R) {
        const unsigned long long *f = a.flags[tid];
        s_x[tid] = (char *)(uintptr_t)ld_relaxed(f + HEP_FLAG_EM_TOKENS);
        s_prob[tid] = (float *)(uintptr_t)ld_relaxed(f + HEP_FLAG_EM_PROBS);
        s_scale[tid] = (float *)(uintptr_t)ld_relaxed(f + HEP_FLAG_EM_SCALES);
    }
    __syncthreads();
    em_zero_padding(a);
    int t0, t1, w0, w1;
    block_range(a.t, blockIdx.x, gridDim.x, t0, t1);
    warp_range(t0, t1, tid >> 5, blockDim.x >> 5, w0, w1);
    for (int i = w0; i < w1; i++)
        em_push_token<U>(a, own, a.node, i, s_x, s_prob, s_scale);
    bulk_wait_all();
}


#endif
