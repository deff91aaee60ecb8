// kernels/combine_rings.cuh: combine across nodes: the partial sums' rings, the reducers' side
// and the owner's waits and credits. Part of combine.cu, included there after the
// expert-major part.
#ifndef HEP_KERNELS_COMBINE_RINGS_CUH
#define HEP_KERNELS_COMBINE_RINGS_CUH

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
        else if (q >= 0 && (i & 31) == 0) /* (one token in 32: the atomics' cost) */
            NT_FIRST(a, c, 6 + min(q / a.C, 1));
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
            NT_LAST(a, c, 2 + min(k, 1));
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

#endif // HEP_KERNELS_COMBINE_RINGS_CUH
