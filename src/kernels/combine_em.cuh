// kernels/combine_em.cuh: combine from the expert-major layout: the rows, the probabilities
// and the wait for the node-mates' reads of this rank's expert outputs. Part of
// combine.cu, included there after the rank-major row sums.
#ifndef HEP_KERNELS_COMBINE_EM_CUH
#define HEP_KERNELS_COMBINE_EM_CUH

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
    const int nvec = (int)(rb / 16), per_pass = row_pass<CU>(nvec);
    for (int v0 = 0; v0 < nvec; v0 += per_pass) {
        const int v1 = min(nvec, v0 + per_pass);
        float f[CU][8];
        zero_acc<CU>(f);
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

#endif // HEP_KERNELS_COMBINE_EM_CUH
