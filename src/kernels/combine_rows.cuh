// kernels/combine_rows.cuh: the row sums of combine, rank-major: a token's rows at the
// node-mates (and, across nodes, the other nodes' partial sums) added in the documented
// order in f32 and rounded to BF16 once. Part of combine.cu (which defines LD_ROW),
// included there.
#ifndef HEP_KERNELS_COMBINE_ROWS_CUH
#define HEP_KERNELS_COMBINE_ROWS_CUH

#include "kernels/vec.cuh"

// A row of nvec 16-byte vectors cut into equal passes of at most 32 x CU vectors a warp
// (a 14 KB row is two passes of 448, not 512 + 384): the vectors of one pass.
template <int CU> __device__ __forceinline__ int row_pass(int nvec)
{
    const int passes = (nvec + 32 * CU - 1) / (32 * CU);
    return ((nvec + passes - 1) / passes + 31) & ~31;
}

// f = -0.0 in every lane: the identity of addition (+0 would turn -0 into +0).
template <int CU> __device__ __forceinline__ void zero_acc(float (&f)[CU][8])
{
#pragma unroll
    for (int u = 0; u < CU; u++)
#pragma unroll
        for (int q = 0; q < 8; q++)
            f[u][q] = -0.0f;
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
    const int nvec = (int)(rb / 16), per_pass = row_pass<CU>(nvec);
    for (int v0 = 0; v0 < nvec; v0 += per_pass) {
        const int v1 = min(nvec, v0 + per_pass);
        float f[CU][8];
        zero_acc<CU>(f);
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
// `pos`: lane d's position of the token at destination d, when the caller loaded it
// ahead (else NO_POS: loaded here).
#define NO_POS (-2)
template <bool WIDE, int CU = 4, int CD = 2>
__device__ __forceinline__ void combine_row(const hep_kargs &a, const char *const *s_x, int L,
                                            int i, int mybase, uint4 *out, const char *parts,
                                            int pos = NO_POS)
{
    const int lane = threadIdx.x & 31, R = a.R;
    const size_t rb = (size_t)a.H * 2, T = (size_t)a.T;
    const int *np = a.node_pos + (size_t)i * a.N; /* the token's row in each node's slot */
    row_set rs;
    if (pos == NO_POS)
        pos = lane < R ? a.dest_rows[((size_t)L * T + i) * R + lane] : -1;
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

// An own token's row (N > 32: the wide count of the other nodes' partial sums), CD of its
// rows loaded together (across nodes two: more spill there).
template <bool NODES, int CD>
__device__ __forceinline__ void combine_own(const hep_kargs &a, const char *const *s_x, int i,
                                            int mybase, uint4 *out, const char *parts,
                                            int pos = NO_POS)
{
    if (NODES && a.N > 32)
        combine_row<true, 4, 2>(a, s_x, a.node, i, mybase, out, parts, pos);
    else
        combine_row<false, 4, NODES ? 2 : CD>(a, s_x, a.node, i, mybase, out, parts, pos);
}

// Lane d's position of own token i at destination d (-1: none, or past the list).
__device__ __forceinline__ int own_pos(const hep_kargs &a, int i)
{
    const int lane = threadIdx.x & 31;
    return lane < a.R && i < a.t ? a.dest_rows[((size_t)a.node * a.T + i) * a.R + lane] : -1;
}

#endif // HEP_KERNELS_COMBINE_ROWS_CUH
