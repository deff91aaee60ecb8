// kernels/combine.cu: the combine kernel (see ep_kernels.h for the protocol; the copies of
// a caller's expert outputs into the exchange buffer are in copies.cu). S blocks; with N > 1 the blocks
// first reduce the other nodes' tokens over this node (slot by slot, block b's share handed
// to the proxy as it completes; the last block publishes each slot's count and flag), then
// wait for the other nodes' partial sums of this rank's tokens; then every warp sums its
// own tokens' rows.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/ring.cuh"

#ifndef GRAB
#define GRAB 2 /* own tokens a warp takes at a time */
#endif
#ifndef COMBINE_THREADS
#define COMBINE_THREADS 512
#endif
#ifdef HEP_STREAMING_LOADS
#define LD_ROW(p) __ldcs(p)
#else
#define LD_ROW(p) ld_cg(p)
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

// The rows one warp sums for a token: destination d's row (lane d holds it, -1 if none) in
// ascending local rank, then each other node's partial sum (lane M holds its position in
// slot M's rows, -1 if none) in ascending node. With N > 32 nodes (WIDE) npos and nmask
// are not used: the partial sums are read from the token's node_pos row a word of 32
// nodes at a time.
struct row_set {
    unsigned mask, nmask;
    int row, npos;
};

// One warp: out = the f32 sum of the token's rows, rounded to BF16 once. Each pass holds CU
// vectors per lane of CD rows in flight together (CU x CD x 512 bytes a warp); the rows are
// added one after another in the documented order, so every (CU, CD) gives the same bits.
template <int CU, int CD, bool WIDE>
__device__ __forceinline__ void sum_rows(const hep_kargs &a, const row_set &rs,
                                         const char *const *s_x, const char *parts, int node,
                                         size_t rb, size_t ST, uint4 *out, const int *np, int nn)
{
    const int lane = threadIdx.x & 31;
    const int nvec = (int)(rb / 16);
    const int passes = (nvec + 32 * CU - 1) / (32 * CU);
    const int per_pass = ((nvec + passes - 1) / passes + 31) & ~31;
    for (int v0 = 0; v0 < nvec; v0 += per_pass) {
        const int v1 = min(nvec, v0 + per_pass);
        float f[CU][8];
#pragma unroll
        for (int u = 0; u < CU; u++)
#pragma unroll
            for (int q = 0; q < 8; q++)
                f[u][q] = -0.0f; /* the identity of addition (+0 would turn -0 into +0) */
        for (unsigned m = rs.mask; m;) {
            const uint4 *src[CD];
            int n = 0;
#pragma unroll
            for (int c = 0; c < CD; c++) {
                src[c] = NULL;
                if (m) {
                    const int d = __ffs(m) - 1;
                    m &= m - 1;
                    src[c] = (const uint4 *)(s_x[d] + (size_t)__shfl_sync(FULL, rs.row, d) * rb);
                    n++;
                }
            }
            uint4 v[CD][CU];
#pragma unroll
            for (int c = 0; c < CD; c++)
#pragma unroll
                for (int u = 0; u < CU; u++) {
                    const int k = v0 + u * 32 + lane;
                    v[c][u] = (c < n && k < v1) ? LD_ROW(src[c] + k) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
            for (int c = 0; c < CD; c++)
                if (c < n)
#pragma unroll
                    for (int u = 0; u < CU; u++)
                        acc8(f[u], v[c][u]);
        }
        for (int g0 = 0; WIDE && g0 < nn; g0 += 32) { // WIDE: np[M] for the nodes M < nn
            const int M0 = g0 + lane;
            const int q = M0 < nn && M0 != node ? np[M0] : -1;
            const int npos = q >= 0 ? ring_row(a, q) : -1; /* its row in the ring */
            for (unsigned m = __ballot_sync(FULL, npos >= 0); m; m &= m - 1) {
                const int q = __ffs(m) - 1;
                const uint4 *src =
                    (const uint4 *)(parts + ((size_t)slot_index(g0 + q, node) * ST +
                                             (size_t)__shfl_sync(FULL, npos, q)) *
                                                rb);
                uint4 v[CU];
#pragma unroll
                for (int u = 0; u < CU; u++) {
                    const int k = v0 + u * 32 + lane;
                    v[u] = k < v1 ? ld_cg(src + k) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int u = 0; u < CU; u++)
                    acc8(f[u], v[u]);
            }
        }
        for (unsigned m = WIDE ? 0u : rs.nmask; m; m &= m - 1) { // the other nodes' partial sums
            const int M = __ffs(m) - 1;
            const uint4 *src = (const uint4 *)(parts + ((size_t)slot_index(M, node) * ST +
                                                        (size_t)__shfl_sync(FULL, rs.npos, M)) *
                                                           rb);
            uint4 v[CU];
#pragma unroll
            for (int u = 0; u < CU; u++) {
                const int k = v0 + u * 32 + lane;
                v[u] = k < v1 ? ld_cg(src + k) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < CU; u++)
                acc8(f[u], v[u]);
        }
#pragma unroll
        for (int u = 0; u < CU; u++) {
            const int k = v0 + u * 32 + lane;
            if (k < v1)
                out[k] = pack8(f[u]);
        }
    }
}

// One warp copies a token's single row: starting from -0.0, its f32 sum is the row itself,
// bit for bit, so a copy is the same result, with CV vectors a lane in flight.
#ifndef CV
#define CV 8
#endif
__device__ __forceinline__ void copy_row(const uint4 *src, uint4 *out, size_t rb)
{
    const int lane = threadIdx.x & 31;
    const int nvec = (int)(rb / 16);
    const int passes = (nvec + 32 * CV - 1) / (32 * CV);
    const int per_pass = ((nvec + passes - 1) / passes + 31) & ~31;
    for (int v0 = 0; v0 < nvec; v0 += per_pass) {
        /* one base pointer, constant offsets: no address register per vector */
        const uint4 *s = src + v0 + lane;
        uint4 *o = out + v0 + lane;
        const int n = min(nvec, v0 + per_pass) - v0 - lane; /* this lane's vectors: u*32 < n */
        uint4 buf[CV];
#pragma unroll
        for (int u = 0; u < CV; u++)
            if (u * 32 < n)
                buf[u] = LD_ROW(s + u * 32);
#pragma unroll
        for (int u = 0; u < CV; u++)
            if (u * 32 < n)
                o[u * 32] = buf[u];
    }
}

// One warp: the row `out` = f32 sum over the node-mates holding token i of list L, then
// (parts != NULL, own tokens) plus each other node's partial sum of it. A single row is
// copied (CV vectors a lane in flight); several rows are summed two at a time, four
// vectors a lane each (bench/NOTES.md has the shapes tried; these fit 128 registers).
// WIDE (N > 32, own tokens): the other nodes are counted a word of 32 at a time.
template <bool WIDE, int CU = 4, int CD = 2>
__device__ __forceinline__ void combine_row(const hep_kargs &a, const char *const *s_x, int L,
                                            int i, int mybase, uint4 *out, const char *parts)
{
    const int lane = threadIdx.x & 31, R = a.R;
    const size_t rb = (size_t)a.H * 2, T = (size_t)a.T;
    const int *np = a.node_pos + (size_t)i * a.N; /* the token's row in each node's slot */
    row_set rs;
    const int pos = lane < R ? a.dest_rows[((size_t)L * T + i) * R + lane] : -1;
    rs.row = pos >= 0 ? mybase + pos : -1;
    if (a.cap && rs.row >= a.cap)
        rs.row = -1; /* dropped at dispatch (HEP_ASYNC past the capacity): contributes 0 */
    rs.mask = __ballot_sync(FULL, rs.row >= 0);
    rs.npos = !WIDE && parts && lane < a.N && lane != a.node ? np[lane] : -1;
    if (rs.npos >= 0) /* the row of its partial sum in that node's ring */
        rs.npos = ring_row(a, rs.npos);
    rs.nmask = __ballot_sync(FULL, rs.npos >= 0);
    int n = __popc(rs.mask) + __popc(rs.nmask);
    const uint4 *part1 = NULL; /* WIDE: the first partial sum (the row when n == 1) */
    for (int g0 = 0; WIDE && parts && g0 < a.N; g0 += 32) {
        const int M = g0 + lane;
        const int p = M < a.N && M != a.node ? np[M] : -1;
        const unsigned bl = __ballot_sync(FULL, p >= 0);
        if (bl && !part1)
            part1 = (const uint4 *)(parts +
                                    ((size_t)slot_index(g0 + __ffs(bl) - 1, a.node) * a.ST +
                                     (size_t)ring_row(a, __shfl_sync(FULL, p, __ffs(bl) - 1))) *
                                        rb);
        n += __popc(bl);
    }
    if (n == 1) {
        const uint4 *src;
        if (rs.mask) {
            const int d = __ffs(rs.mask) - 1;
            src = (const uint4 *)(s_x[d] + (size_t)__shfl_sync(FULL, rs.row, d) * rb);
        } else if (WIDE) {
            src = part1;
        } else {
            const int M = __ffs(rs.nmask) - 1;
            src = (const uint4 *)(parts + ((size_t)slot_index(M, a.node) * a.ST +
                                           (size_t)__shfl_sync(FULL, rs.npos, M)) * rb);
        }
        copy_row(src, out, rb);
    } else if (n == 0) { /* routed nowhere: the empty sum, -0.0 in every channel */
        const uint4 z = make_uint4(0x80008000u, 0x80008000u, 0x80008000u, 0x80008000u);
        for (int k = lane; k < (int)(rb / 16); k += 32)
            out[k] = z;
    }
    else
        sum_rows<CU, CD, WIDE>(a, rs, s_x, parts, a.node, rb, (size_t)a.ST, out, np, a.N);
}

// An own token's row (N > 32: the wide count of the other nodes' partial sums).
__device__ __forceinline__ void combine_own(const hep_kargs &a, const char *const *s_x, int i,
                                            int mybase, uint4 *out, const char *parts)
{
    if (a.N > 32)
        combine_row<true>(a, s_x, a.node, i, mybase, out, parts);
    else
        combine_row<false>(a, s_x, a.node, i, mybase, out, parts);
}

// The probabilities through combine (the caller handle's routing in rec_ids): for each own
// token i, probs_out[i][x] = destination d's prob row of the token at local expert e, for
// every expert x = d El + e one of its slots chose; 0 elsewhere. One warp a token, lane k
// its slot k. The node-mates' prob buffers hold their probs_in (copied in before their
// COMBINE_READY, which this kernel acquired). Across nodes an expert x of node M comes from
// M's row of the token's partial probabilities (node_probs there; landed before the flag
// this kernel waited for), at the token's row in M's slot.
__device__ __forceinline__ void combine_probs_token(const hep_kargs &a, int i)
{
    const int lane = threadIdx.x & 31, El = a.El;
    const size_t E = (size_t)El * a.R * a.N, T = (size_t)a.T;
    const int Enode = El * a.R, first = a.rank0 * El;
    {
        float *po = a.probs_out + (size_t)i * E;
        for (size_t j = (size_t)lane; j < E; j += 32)
            po[j] = 0.f;
        __syncwarp(); /* the zeros before the values, lane to lane */
        const int x = lane < a.K ? a.rec_ids[(size_t)i * a.K + lane] : -1;
        const int M = x >= 0 ? x / Enode : -1;
        if (x >= 0 && M == a.node) {
            const int d = (x - first) / El, ex = (x - first) % El;
            const int row = ld_l2(a.meta + a.node * a.R + d) +
                            ld_l2(a.dest_rows + ((size_t)a.node * T + i) * a.R + d);
            if (!a.cap || row < a.cap) /* a dropped row's stays 0 */
                po[x] = __ldcg(a.prob[d] + (size_t)row * El + ex);
        } else if (x >= 0) {
            const int p = ring_row(a, a.node_pos[(size_t)i * a.N + M]);
            po[x] = __ldcg(a.part_prob + ((size_t)slot_index(M, a.node) * a.ST + p) * Enode +
                           (x - M * Enode));
        }
        __syncwarp();
    }
}

__device__ void combine_probs(const hep_kargs &a, int gw, int nw)
{
    for (int i = gw; i < a.t; i += nw)
        combine_probs_token(a, i);
}

// Across nodes with probabilities (the peer's side of combine_probs): token i of list L
// (another node's slot), this node's experts as one dense row: destination d's probs_in
// row of the token where the token went to d, 0 elsewhere. The token's owner takes the
// experts its slots chose. One warp.
__device__ __forceinline__ void node_probs(const hep_kargs &a, int L, int i, float *row)
{
    const int lane = threadIdx.x & 31, El = a.El, R = a.R;
    for (int j = lane; j < R * El; j += 32) {
        const int d = j / El;
        const int pos = a.dest_rows[((size_t)L * a.T + i) * R + d];
        const int r = pos < 0 ? -1 : ld_l2(a.meta + L * R + d) + pos;
        /* a row at or past the capacity was dropped at dispatch (HEP_ASYNC): 0, as there */
        row[j] = r < 0 || (a.cap && r >= a.cap) ? 0.f
                                                : __ldcg(a.prob[d] + (size_t)r * El + j % El);
    }
}

// The last block of combine c to finish resets the work counters for the next call, sets
// the combine count and publishes COMBINE_DONE = c: every block's reads of the node-mates'
// buffers are done (each block fenced them before its arrival), so the next combine's
// copy into X may overwrite them.
__device__ __forceinline__ void combine_done(const hep_kargs &a, unsigned long long c)
{
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned *done = a.work + HEP_WORK_COMBINE_DONE;
        __threadfence(); /* this block's grabs and reads come before its arrival */
        if (atomicAdd(done, 1u) == gridDim.x - 1) {
            a.work[HEP_WORK_COMBINE] = 0;
            *done = 0;
            for (int j = 0; a.N > 1 && j < 3 * a.N * HEP_RING_DEPTH; j++)
                ring_ctr(a, 1, 0, 0)[j] = 0; /* the next combine's ring counters */
            *a.cepoch = c;
            fence_peers(a);
            st_release_peers(a, a.flags[a.local] + HEP_FLAG_COMBINE_DONE, c);
        }
    }
}

// ---- the expert-major layout (N = 1): rows read straight from the node-mates' caller
// memory (their expert_out, published before COMBINE_READY), at the positions the handle's
// dispatch recorded (epos); a token's rows summed by ascending global expert, i.e. by
// destination rank and within it by local expert: the host backend's order.

// One warp: out = the f32 sum of n rows (lane j < n holds the j-th row's address), in
// order, rounded once; CU vectors a lane of two rows in flight, as sum_rows<4, 2>.
template <int CU>
__device__ __forceinline__ void em_sum_rows(const char *src, int n, size_t rb, uint4 *out)
{
    const int lane = threadIdx.x & 31;
    const int nvec = (int)(rb / 16);
    const int passes = (nvec + 32 * CU - 1) / (32 * CU);
    const int per_pass = ((nvec + passes - 1) / passes + 31) & ~31;
    for (int v0 = 0; v0 < nvec; v0 += per_pass) {
        const int v1 = min(nvec, v0 + per_pass);
        float f[CU][8];
#pragma unroll
        for (int u = 0; u < CU; u++)
#pragma unroll
            for (int q = 0; q < 8; q++)
                f[u][q] = -0.0f;
        for (int j = 0; j < n; j += 2) {
            const uint4 *p0 = (const uint4 *)__shfl_sync(FULL, (unsigned long long)src, j);
            const uint4 *p1 = (const uint4 *)__shfl_sync(FULL, (unsigned long long)src, j + 1);
            const bool two = j + 1 < n;
            uint4 v[2][CU];
#pragma unroll
            for (int u = 0; u < CU; u++) {
                const int k = v0 + u * 32 + lane;
                v[0][u] = k < v1 ? LD_ROW(p0 + k) : make_uint4(0, 0, 0, 0);
                v[1][u] = two && k < v1 ? LD_ROW(p1 + k) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < CU; u++)
                acc8(f[u], v[0][u]);
            if (two)
#pragma unroll
                for (int u = 0; u < CU; u++)
                    acc8(f[u], v[1][u]);
        }
#pragma unroll
        for (int u = 0; u < CU; u++) {
            const int k = v0 + u * 32 + lane;
            if (k < v1)
                out[k] = pack8(f[u]);
        }
    }
}

// One warp: token i of list L's expert-major rows on this node (lane k: slot k's row at its
// destination, -1 for none, a repeated slot or a dropped row) summed into `out`, by
// ascending key d El + e (this node's experts in ascending order), then (parts: own tokens
// across nodes) each other node's partial sum of the token, in ascending node, rounded
// once. The keys: for own tokens the recorded routing's ids less this node's first, for
// another node's slot (N > 1) the handle's ekey. A token's rows and partial sums take at
// most one lane each: each of them needs a slot of its own among the token's K <= 32.
template <int CU = 4>
__device__ __forceinline__ void em_combine_row(const hep_kargs &a, const char *const *s_x, int L,
                                               int i, uint4 *out, const char *parts)
{
    const int lane = threadIdx.x & 31, El = a.El, own = L == a.node, K = own ? a.K : a.kmax;
    const size_t rb = (size_t)a.H * 2, T = (size_t)a.T;
    const int pos = lane < K ? (a.epos + (size_t)L * T * a.kmax)[(size_t)i * K + lane] : -1;
    const int x = pos < 0 ? 0x7fffffff
                  : own   ? a.rec_ids[(size_t)i * K + lane] - a.rank0 * El
                          : (a.ekey + (size_t)slot_index(L, a.node) * T * a.kmax)[(size_t)i * K + lane];
    const unsigned vm = __ballot_sync(FULL, pos >= 0);
    int n = __popc(vm);
    const char *mine = pos >= 0 ? s_x[x / El] + (size_t)pos * rb : NULL;
    if (parts) { /* lanes n.. : the partial sums, node by node (words of 32 nodes) */
        const int *np = a.node_pos + (size_t)i * a.N;
        const char *pm = NULL;
        int m = 0;
        for (int g0 = 0; g0 < a.N; g0 += 32) {
            const int M = g0 + lane;
            const int p = M < a.N && M != a.node ? np[M] : -1;
            const char *src =
                p >= 0 ? parts + ((size_t)slot_index(M, a.node) * a.ST + ring_row(a, p)) * rb
                       : NULL;
            const unsigned bl = __ballot_sync(FULL, p >= 0);
            for (unsigned q = bl; q; q &= q - 1, m++) {
                const char *sq = (const char *)__shfl_sync(FULL, (unsigned long long)src, __ffs(q) - 1);
                if (lane == n + m)
                    pm = sq;
            }
        }
        if (m) { /* rank the rows first (below), then put the partial sums after them */
            int rank = 0, who = 0;
            for (unsigned q = vm; q; q &= q - 1)
                rank += __shfl_sync(FULL, x, __ffs(q) - 1) < x;
            for (unsigned q = vm; q; q &= q - 1) {
                const int j = __ffs(q) - 1;
                if (__shfl_sync(FULL, rank, j) == lane)
                    who = j;
            }
            const char *ranked = (const char *)__shfl_sync(FULL, (unsigned long long)mine, who);
            if (lane >= n)
                ranked = pm;
            n += m;
            if (n == 1)
                copy_row((const uint4 *)__shfl_sync(FULL, (unsigned long long)ranked, 0), out, rb);
            else
                em_sum_rows<CU>(ranked, n, rb, out);
            return;
        }
    }
    if (n == 0) { /* no row: the empty sum, -0.0 in every channel */
        const uint4 z = make_uint4(0x80008000u, 0x80008000u, 0x80008000u, 0x80008000u);
        for (int k = lane; k < (int)(rb / 16); k += 32)
            out[k] = z;
        return;
    }
    if (n == 1) {
        copy_row((const uint4 *)__shfl_sync(FULL, (unsigned long long)mine, __ffs(vm) - 1), out,
                 rb);
        return;
    }
    // lane j gets the row of rank j by ascending expert id (the ids are distinct)
    int rank = 0, who = 0;
    for (unsigned m = vm; m; m &= m - 1) {
        const int j = __ffs(m) - 1;
        rank += __shfl_sync(FULL, x, j) < x;
    }
    for (unsigned m = vm; m; m &= m - 1) {
        const int j = __ffs(m) - 1;
        if (__shfl_sync(FULL, rank, j) == lane)
            who = j;
    }
    const char *ranked = (const char *)__shfl_sync(FULL, (unsigned long long)mine, who);
    em_sum_rows<CU>(ranked, n, rb, out);
}

// The probabilities through combine from expert-major rows: probs_out[i][x] = the row's
// value in destination d's probs_in for every expert x of a written row of this node; 0
// elsewhere. Across nodes an expert x of node M comes from M's dense row of the token's
// probabilities (em_node_probs there; landed before the flag this kernel waited for), at
// the token's row in M's slot, as in rank-major (combine_probs).
__device__ __forceinline__ void em_combine_probs_token(const hep_kargs &a,
                                                       const float *const *s_pin, int i)
{
    const int lane = threadIdx.x & 31, El = a.El, K = a.K;
    const int Enode = El * a.R, first = a.rank0 * El;
    const size_t E = (size_t)Enode * a.N, T = (size_t)a.T;
    const int *epos = a.epos + (size_t)a.node * T * a.kmax;
    {
        float *po = a.probs_out + (size_t)i * E;
        for (size_t j = (size_t)lane; j < E; j += 32)
            po[j] = 0.f;
        __syncwarp();
        const int x = lane < K ? a.rec_ids[(size_t)i * K + lane] : -1;
        const int M = x >= 0 ? x / Enode : -1;
        if (x >= 0 && M == a.node) {
            const int pos = epos[(size_t)i * K + lane];
            const float *pin = pos >= 0 ? s_pin[(x - first) / El] : NULL;
            if (pin)
                po[x] = __ldcg(pin + pos);
        } else if (x >= 0) {
            const int p = ring_row(a, a.node_pos[(size_t)i * a.N + M]);
            po[x] = __ldcg(a.part_prob + ((size_t)slot_index(M, a.node) * a.ST + p) * Enode +
                           (x - M * Enode));
        }
        __syncwarp();
    }
}

__device__ void em_combine_probs(const hep_kargs &a, const float *const *s_pin, int gw, int nw)
{
    for (int i = gw; i < a.t; i += nw)
        em_combine_probs_token(a, s_pin, i);
}

// Across nodes with probabilities, expert-major (the peer's side of em_combine_probs):
// token i of list L (another node's slot), this node's experts as one dense row: at key
// d El + e, node-mate d's probs_in value at the token's expert-major row there, for every
// local expert the token chose (its first slot on it, not dropped); 0 elsewhere, and where
// the node-mate gave no probs_in. One warp.
__device__ __forceinline__ void em_node_probs(const hep_kargs &a, const float *const *s_pin,
                                              int L, int i, float *row)
{
    const int lane = threadIdx.x & 31, El = a.El, K = a.kmax;
    const size_t T = (size_t)a.T, o = (size_t)i * K + lane;
    for (int j = lane; j < a.R * El; j += 32)
        row[j] = 0.f;
    __syncwarp(); /* the zeros before the values, lane to lane */
    const int pos = lane < K ? (a.epos + (size_t)L * T * K)[o] : -1;
    if (pos >= 0) {
        const int key = (a.ekey + (size_t)slot_index(L, a.node) * T * K)[o];
        const float *pin = s_pin[key / El];
        if (pin)
            row[key] = __ldcg(pin + pos);
    }
    __syncwarp();
}

// EM: after combine_done, the last block of this rank waits until every node-mate has
// finished reading this rank's expert_out (their COMBINE_DONE >= c): the caller may reuse
// that memory once the kernel ended.
__device__ __forceinline__ void em_wait_readers(const hep_kargs &a, unsigned long long c)
{
    __shared__ int s_last_em;
    if (threadIdx.x == 0)
        s_last_em = ld_relaxed(a.cepoch) >= c;
    __syncthreads();
    if (s_last_em && (int)threadIdx.x < a.R)
        wait_mate(a, a.flags[threadIdx.x] + HEP_FLAG_COMBINE_DONE, c, HEP_STAGE_COMBINE,
                  threadIdx.x);
}

static_assert(COMBINE_THREADS >= HEP_GPU_MAX_NODES, "one thread per node (tid < N)");

// ---- N > 1: the partial sums' rings (kernels/ring.cuh). Warps have static roles: in every
// block the first RED_WARPS reduce the other nodes' slots into the rings to them (the peer's
// side), the others sum this rank's own tokens (the owner's side), so that no warp waits for
// a credit while it is the one that would free a chunk, or the reverse.
// WHOLE (P x C >= T: each slot fits its ring, no position is taken twice in a call, so no
// reducer ever waits for a credit): every warp reduces first, with the own tokens' 4 x 2
// vectors a lane, then every warp sums own tokens, as with one chunk of T per slot.
#define RED_WARPS (COMBINE_THREADS / 64)
#ifndef RING_CU /* a reducer's vectors a lane of RING_CD rows in flight (the same bits for
                   any): with the own tokens' 4 x 2 the rings' state makes ptxas spill */
#define RING_CU 2
#endif
#ifndef RING_CD
#define RING_CD 2
#endif

// Owner side, one warp: token i's partial sums from the other nodes landed (the chunk of
// its row in each node's ring). false when a wait gave up.
__device__ __forceinline__ bool own_wait(const hep_kargs &a, int i, unsigned long long c)
{
    const int lane = threadIdx.x & 31;
    bool ok = true;
    for (int g0 = 0; g0 < a.N; g0 += 32) {
        const int M = g0 + lane;
        const int q = M < a.N && M != a.node ? a.node_pos[(size_t)i * a.N + M] : -1;
        if (q >= 0 && !ring_wait_landed(a, a.part_words, slot_index(M, a.node), M, q / a.C, c, 1))
            ok = false; /* (a later word of nodes must not hide it) */
    }
    return __all_sync(FULL, ok);
}

// ... and once its partial sums (and probabilities) were read: each counts as one token of
// its chunk; the token that completes a chunk (C tokens: only full chunks are freed, and
// only they are waited for) frees it. Not with WHOLE rings: no chunk of a call takes a
// position twice, so no sender waits for a credit (the proxy's batch holds none).
__device__ __forceinline__ bool own_free(const hep_kargs &a, int i, unsigned long long c)
{
    const int lane = threadIdx.x & 31;
    bool ok = true;
    __syncwarp();
    __threadfence(); /* the reads are done */
    for (int g0 = 0; g0 < a.N; g0 += 32) {
        const int M = g0 + lane;
        const int q = M < a.N && M != a.node ? a.node_pos[(size_t)i * a.N + M] : -1;
        if (q >= 0 && !ring_consumed(a, 1, (unsigned long long *)a.part_words,
                                     slot_index(M, a.node), M, q / a.C, 1, a.C, c))
            ok = false;
    }
    return __all_sync(FULL, ok);
}

// One reducing warp's share (rw of nrw) of chunk k (`rows` tokens) of node L's slot s here:
// each token's partial sum (and probabilities) into its row of the ring to L; the last
// warp to finish publishes the chunk. CU x CD: vectors a lane in flight (combine_row).
template <bool EM, int CU, int CD>
__device__ __forceinline__ void reduce_chunk(const hep_kargs &a, const char *const *s_x,
                                             const float *const *s_pin, int L, int s, int k,
                                             int rows, int mybase, int rw, int nrw,
                                             unsigned long long c)
{
    const int lane = threadIdx.x & 31, R = a.R;
    const size_t rb = (size_t)a.H * 2, ST = (size_t)a.ST;
    int w0, w1;
    warp_range(0, rows, rw, nrw, w0, w1);
#pragma unroll 1
    for (int r = w0; r < w1; r++) {
        const int q = k * a.C + r;
        const size_t row = (size_t)s * ST + (size_t)ring_row(a, q);
        uint4 *red = (uint4 *)(a.red_token + row * rb);
        if (EM)
            em_combine_row<CU>(a, s_x, L, q, red, NULL);
        else
            combine_row<false, CU, CD>(a, s_x, L, q, mybase, red, NULL);
        if (a.probs_out) { /* every rank of the call alike */
            float *pr = a.red_prob + row * R * a.El;
            if (EM)
                em_node_probs(a, s_pin, L, q, pr);
            else
                node_probs(a, L, q, pr);
        }
    }
    __syncwarp();
    if (lane == 0) {
        __threadfence_system(); /* this warp's rows before its count */
        if (ring_produced(a, 1, L, k, nrw)) {
            __threadfence_system();
            ring_publish(a, 1, a.red_words, L, k, rows, c);
        }
    }
    __syncwarp();
}

// Reducer side, one warp (rw of nrw reducing warps in the grid): every other node's slot
// here, chunk by chunk into the ring to that node, each chunk's rows shared by all
// reducing warps, the last one publishing it. A warp never blocks on one ring: it goes on
// with any other ring whose next chunk has its credit, so a ring waits only for its own
// chunks' credits (its source frees chunk k after reading its tokens of it, which needs
// only the earlier chunks of the rings to it: no wait goes round in a circle). A warp that
// moves nothing for HEP_TIMEOUT_MS gives up naming the peer whose credit is missing.
template <bool EM>
__device__ bool reduce_rings(const hep_kargs &a, const char *const *s_x, const float *const *s_pin,
                             int rw, int nrw, unsigned long long c, int *cur)
{
    const int lane = threadIdx.x & 31, N = a.N, R = a.R, C = a.C, P = a.P;
    const size_t B = ring_base_word(a);
    for (int j = lane; j < N; j += 32)
        cur[j] = 0;
    __syncwarp();
    unsigned long long start = now_ns(), seen = 0;
    unsigned spins = 0;
    int stuck = -1;
    for (;;) {
        bool done = true, moved = false;
        for (int L = 0; L < N; L++) {
            if (L == a.node)
                continue;
            const int s = slot_index(L, a.node), cnt = a.slot_rows[s], n = ring_chunks(cnt, C);
            int k = cur[L];
            while (k < n) {
                if (k >= P) { /* the credit for chunk k - P, the position chunk k takes */
                    unsigned long long v = lane == 0 ? ld_relaxed(a.red_words + B + L) : 0;
                    v = __shfl_sync(FULL, v, 0);
                    if (v < HEP_RING_VAL(c, k - P + 1)) {
                        stuck = L, seen = v;
                        break;
                    }
                    fence_acquire(true);
                }
                const int rows = min(C, cnt - k * C);
                const int mybase = lane < R ? ld_l2(a.meta + L * R + lane) : 0;
                reduce_chunk<EM, RING_CU, RING_CD>(a, s_x, s_pin, L, s, k, rows, mybase, rw,
                                                   nrw, c);
                k++;
                moved = true;
            }
            __syncwarp();
            if (lane == 0)
                cur[L] = k;
            __syncwarp();
            done &= k >= n;
        }
        if (done)
            return true;
        if (moved) {
            start = now_ns();
            continue;
        }
        __nanosleep(128);
        if ((++spins & 15) == 0) {
            if (aborted(a))
                return false;
            const unsigned long long waited = now_ns() - start;
            if (waited > a.timeout_ns) {
                if (lane == 0)
                    give_up(a.abort, a.diag, a.flags[a.local] + HEP_FLAG_BLAME,
                            HEP_STAGE_RING_COMBINE_CREDIT, stuck * R + a.local, 0,
                            HEP_RING_VAL(c, cur[stuck] - P + 1), seen, waited);
                return false;
            }
        }
    }
}

// The reducer side with WHOLE rings (P x C >= T), one warp (rw of nrw, every warp of the
// grid): each other node's slot chunk by chunk into the ring to that node, as reduce_rings
// does, without its credit waits (no position is taken twice in a call) and with the own
// tokens' 4 x 2 vectors a lane in flight.
template <bool EM>
__device__ __forceinline__ void reduce_whole(const hep_kargs &a, const char *const *s_x,
                                             const float *const *s_pin, int rw, int nrw,
                                             unsigned long long c)
{
    const int lane = threadIdx.x & 31, N = a.N, R = a.R, C = a.C;
#pragma unroll 1
    for (int L = 0; L < N; L++) {
        if (L == a.node)
            continue;
        const int s = slot_index(L, a.node), cnt = a.slot_rows[s], n = ring_chunks(cnt, C);
        const int mybase = lane < R ? ld_l2(a.meta + L * R + lane) : 0;
#pragma unroll 1
        for (int k = 0; k < n; k++)
            reduce_chunk<EM, 4, 2>(a, s_x, s_pin, L, s, k, min(C, cnt - k * C), mybase, rw, nrw,
                                   c);
    }
}

// Block 0, before the rings: what the batch does not need. The ring to node M carries M's
// slot here; the ring from M the partial sums of this rank's tokens that went to M (the
// handle's node_pos: their rows there). Also each slot's final count and flag, which the
// proxy posts after every chunk to M.
__device__ void ring_combine_setup(const hep_kargs &a, unsigned long long c)
{
    __shared__ int own[HEP_GPU_MAX_NODES];
    const int N = a.N, tid = threadIdx.x;
    if (tid < N)
        own[tid] = 0;
    __syncthreads();
    for (size_t k = tid; k < (size_t)a.t * N; k += blockDim.x)
        if ((int)(k % N) != a.node && a.node_pos[k] >= 0)
            atomicAdd(&own[k % N], 1);
    __syncthreads();
    if (tid < N && tid != a.node) {
        const int cnt = a.slot_rows[slot_index(tid, a.node)];
        ring_skips(a, 1, tid, ring_chunks(cnt, a.C), ring_chunks(own[tid], a.C), c);
        a.red_words[tid] = (unsigned long long)cnt;
        a.red_words[N + tid] = c;
        __threadfence_system();
        st_release(a.px + HEP_PX_WORD(N, 1, tid) + 3 * HEP_PX_MAX_BLOCKS, c);
    }
}

// Own token i: the f32 sum of its rows (across nodes once its partial sums landed), its
// probabilities, then (rings that wrap) its chunks freed. false when a wait gave up.
template <bool EM, bool NODES, bool WHOLE>
__device__ __forceinline__ bool own_token(const hep_kargs &a, const char *const *s_x,
                                          const float *const *s_pin, unsigned long long c, int i,
                                          size_t rb, int mybase, const char *parts)
{
    uint4 *out = (uint4 *)((char *)a.combine_out + (size_t)i * rb);
    if (NODES && !own_wait(a, i, c))
        return false;
    if (EM)
        em_combine_row(a, s_x, a.node, i, out, parts);
    else
        combine_own(a, s_x, i, mybase, out, parts);
    if (NODES && a.probs_out) { /* read before the chunks are freed */
        if (EM)
            em_combine_probs_token(a, s_pin, i);
        else
            combine_probs_token(a, i);
    }
    if (NODES && !WHOLE && !own_free(a, i, c))
        return false;
    return true;
}

// The owner's side: this rank's own tokens, each the f32 sum of its rows at the node-mates
// and (N > 1) the other nodes' partial sums, with its probabilities (probs_out); across
// nodes a token waits for the chunks of its partial sums and frees them once read. The
// owning warps: all of them on one node and across nodes with WHOLE rings (after they
// reduced), the last COMBINE_THREADS / 32 - RED_WARPS of each block across nodes otherwise.
template <bool EM, bool NODES, bool WHOLE>
__device__ __forceinline__ bool own_tokens(const hep_kargs &a, const char *const *s_x,
                                           const float *const *s_pin, unsigned long long c,
                                           int first_grab)
{
    const int R = a.R, lane = threadIdx.x & 31, S = gridDim.x, b = blockIdx.x;
    const int wpb = blockDim.x >> 5, warp = threadIdx.x >> 5;
    const int skip = NODES && !WHOLE ? RED_WARPS : 0;
    const int gw = b * (wpb - skip) + warp - skip, nw = S * (wpb - skip);
    const size_t rb = (size_t)a.H * 2;
    const int mybase = lane < R ? ld_l2(a.meta + a.node * R + lane) : 0;
    const char *parts = NODES ? a.part_token : NULL;
#ifdef HEP_STATIC_TOKENS
    int w0, w1;
    warp_range(0, a.t, gw, nw, w0, w1);
    for (int i = w0; i < w1; i++) {
        if (!own_token<EM, NODES, WHOLE>(a, s_x, s_pin, c, i, rb, mybase, parts))
            return false;
    }
    (void)first_grab;
#else
    // Every warp of the rank takes the next GRAB own tokens from the rank's work counter
    // until none are left, so that no warp idles while another still has rows: the rank
    // ends with its last token, not with its slowest block. The next grab is asked for
    // before the current tokens are summed, so its round trip hides behind them. (The
    // positions are the dispatch's, complete before this kernel.)
    unsigned *work = a.work + HEP_WORK_COMBINE;
    int next = __shfl_sync(FULL, first_grab, 0);
    while (next < a.t) {
        const int i0 = next;
        int pending = 0;
        if (lane == 0)
            pending = (int)atomicAdd(work, GRAB);
        for (int i = i0; i < min(a.t, i0 + GRAB); i++) {
            if (!own_token<EM, NODES, WHOLE>(a, s_x, s_pin, c, i, rb, mybase, parts))
                return false;
        }
        next = __shfl_sync(FULL, pending, 0);
    }
#endif
    if (!NODES && a.probs_out) {
        if (EM)
            em_combine_probs(a, s_pin, gw, nw);
        else
            combine_probs(a, gw, nw);
    }
    return true;
}

// NODES: N > 1 (the rings' code is in these instances only, so that it takes no registers
// from the one-node instances); WHOLE: N > 1 with every slot in its ring (P x C >= T).
template <bool EM, bool NODES, bool WHOLE>
__global__ void __launch_bounds__(COMBINE_THREADS, 1) k_combine(hep_kargs a)
{
    if (a.warm)
        return;
    static_assert(NODES || !WHOLE, "WHOLE is an across-nodes instance");
    const int R = a.R, N = a.N, tid = threadIdx.x, S = gridDim.x, b = blockIdx.x;
    const int lane = tid & 31, warp = tid >> 5, wpb = blockDim.x >> 5;
    /* a reducing warp (across nodes; with WHOLE every warp, then it owns) */
    const bool red = NODES && (WHOLE || warp < RED_WARPS);
    const bool owns = !red || WHOLE;
    const unsigned long long e = *a.epoch, c = *a.cepoch + 1;
    __shared__ const char *s_x[HEP_GPU_MAX_LOCAL]; /* see k_dispatch */
    __shared__ const float *s_pin[HEP_GPU_MAX_LOCAL]; /* EM: the node-mates' probs_in */
    if (ld_l2(a.over)) /* the dispatch exceeded the capacity: no layout (every rank alike) */
        return;
    block_start_jitter(a, e);
    if (tid < R)
        s_x[tid] = a.x[tid];
#ifndef HEP_STATIC_TOKENS
    /* the first grab of own tokens, asked for now: its round trip hides behind the waits */
    /* (WHOLE: asked for after the reduction, which holds no register for it) */
    int first_grab =
        lane == 0 && owns && !WHOLE ? (int)atomicAdd(a.work + HEP_WORK_COMBINE, GRAB) : 0;
#else
    const int first_grab = 0;
    (void)lane;
#endif

    if (NODES && b == 0 && tid < N && tid != a.node) {
        /* arrival: this rank's combine c started. The proxy sends the word ahead of
         * the partial sums on the same connection, so a peer that times out on their flag
         * can tell a lost flag from a rank that never came (ep.c, diag_status). */
        a.red_words[2 * N + tid] = c; /* across nodes combine's words carry c (ep_kernels.h) */
        __threadfence_system();
        st_release(a.px + HEP_PX_WORD(N, 1, tid) + 3 * HEP_PX_MAX_BLOCKS + 1, c);
    }
    if (b == 0 && tid == 0) {
        if (EM) { /* where the node-mates read this rank's rows and probabilities */
            a.flags[a.local][HEP_FLAG_EM_COMBINE_IN] = (unsigned long long)(uintptr_t)a.combine_in;
            a.flags[a.local][HEP_FLAG_EM_PROBS_IN] = (unsigned long long)(uintptr_t)a.probs_in;
        }
        fence_peers(a);
        st_release_peers(a, a.flags[a.local] + HEP_FLAG_COMBINE_READY, c);
    }
    bool ok = true;
    if (tid < R)
        ok = wait_mate(a, a.flags[tid] + HEP_FLAG_COMBINE_READY, c, HEP_STAGE_COMBINE, tid);
    if (EM && tid < R && ok && a.em_stage) {
        /* across processes: the node-mate's staging (its k_em_stage_in ran before its
         * COMBINE_READY); its published probs_in only says whether it sent probabilities */
        const bool pin = ld_relaxed(a.flags[tid] + HEP_FLAG_EM_PROBS_IN) != 0;
        s_x[tid] = (const char *)a.x[tid] + a.em_xoff;
        s_pin[tid] = pin ? (const float *)((const char *)a.x[tid] + a.em_poff) : NULL;
    } else if (EM && tid < R && ok) {
        s_x[tid] = (const char *)(uintptr_t)ld_relaxed(a.flags[tid] + HEP_FLAG_EM_COMBINE_IN);
        s_pin[tid] = (const float *)(uintptr_t)ld_relaxed(a.flags[tid] + HEP_FLAG_EM_PROBS_IN);
    }
    if (!block_all(ok))
        return;
    if (NODES) {
        __shared__ int s_cur[COMBINE_THREADS / 32][HEP_GPU_MAX_NODES]; /* reducers' cursors */
        if (b == 0)
            ring_combine_setup(a, c);
        if (WHOLE) {
            reduce_whole<EM>(a, s_x, s_pin, b * wpb + warp, S * wpb, c);
#ifndef HEP_STATIC_TOKENS
            first_grab = lane == 0 ? (int)atomicAdd(a.work + HEP_WORK_COMBINE, GRAB) : 0;
#endif
        }
        else if (red && !reduce_rings<EM>(a, s_x, s_pin, b * RED_WARPS + warp, S * RED_WARPS, c,
                                          s_cur[warp]))
            return;
    }
    if (owns && !own_tokens<EM, NODES, WHOLE>(a, s_x, s_pin, c, first_grab))
        return;
    combine_done(a, c);
    if (EM && !a.em_stage) /* staged: the caller's memory was copied; k_em_stage_in of the
                              next combine waits for the readers of the staging instead */
        em_wait_readers(a, c);
}

extern "C" int hep_launch_combine(const hep_kargs *a, int blocks, void *stream)
{
    const bool whole = (long long)a->P * a->C >= a->T; /* every slot fits its ring */
    void (*k)(hep_kargs);
    if (a->emajor)
        k = a->N == 1 ? k_combine<true, false, false>
                      : whole ? k_combine<true, true, true> : k_combine<true, true, false>;
    else
        k = a->N == 1 ? k_combine<false, false, false>
                      : whole ? k_combine<false, true, true> : k_combine<false, true, false>;
    k<<<blocks, COMBINE_THREADS, 0, (cudaStream_t)stream>>>(*a);
    return (int)cudaGetLastError();
}

// Every instance once, one block that returns at once (kernels/probe.cu says why). The
// instance follows emajor, N and whole = (P x C >= T).
extern "C" int hep_warm_combine(const hep_kargs *a, void *stream)
{
    hep_kargs w = *a;
    int e = 0;
    w.warm = 1;
    w.P = 1;
    for (int i = 0; i < 6 && e == 0; i++) { /* one node; nodes, wrapping; nodes, whole */
        w.emajor = i & 1;
        w.N = i < 2 ? 1 : 2;
        w.C = i < 4 ? 0 : w.T;
        e = hep_launch_combine(&w, 1, stream);
    }
    return e;
}
