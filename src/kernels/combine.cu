// kernels/combine.cu: the combine kernel (see ep_kernels.h for the protocol; the copies of
// a caller's expert outputs into the exchange buffer are in copies.cu), with its parts in
// combine_rows.cuh (the row sums), combine_em.cuh (the expert-major layout) and
// combine_rings.cuh (across nodes, the partial sums' rings). S blocks; with N > 1 the blocks
// first reduce the other nodes' tokens over this node (slot by slot, block b's share handed
// to the proxy as it completes; the last block publishes each slot's count and flag), then
// wait for the other nodes' partial sums of this rank's tokens; then every warp sums its
// own tokens' rows.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#ifdef HEP_NODE_TRACE
#include <cstdio>
#endif

#include "kernels/ring.cuh"

#ifndef GRAB
#define GRAB 1 /* own tokens a warp takes at a time */
#endif
#ifndef COMBINE_THREADS
#define COMBINE_THREADS 512
#endif
/* Rows a warp loads together when it sums an own token's rows on one node with node-mates
 * (R > 1; one rank alone keeps two: its tokens have one row, and the four-row instance's
 * spills slowed that copy by up to 30%). bench/NOTES.md, session 18. */
#ifndef COMBINE_CD
#define COMBINE_CD 4
#endif
#ifdef HEP_STREAMING_LOADS
#define LD_ROW(p) __ldcs(p)
#else
#define LD_ROW(p) ld_cg(p)
#endif

#include "kernels/combine_rows.cuh"

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
            for (int j = 0; a.N > 1 && j < HEP_RING_CTR_KINDS * a.N * HEP_RING_DEPTH; j++)
                ring_ctr(a, 1, 0, 0)[j] = 0; /* the next combine's ring counters */
            *a.cepoch = c;
            fence_peers(a);
            st_release_peers(a, a.flags[a.local] + HEP_FLAG_COMBINE_DONE, c);
        }
    }
}

#include "kernels/combine_em.cuh"

static_assert(COMBINE_THREADS >= HEP_GPU_MAX_NODES, "one thread per node (tid < N)");

#include "kernels/combine_rings.cuh"

// Own token i: the f32 sum of its rows (across nodes once its partial sums landed), its
// probabilities, then (rings that wrap) its chunks freed. false when a wait gave up.
template <bool EM, bool NODES, bool WHOLE, int OCD>
__device__ __forceinline__ bool own_token(const hep_kargs &a, const char *const *s_x,
                                          const float *const *s_pin, unsigned long long c, int i,
                                          size_t rb, int mybase, const char *parts,
                                          int pos = NO_POS)
{
    uint4 *out = (uint4 *)((char *)a.combine_out + (size_t)i * rb);
    if (NODES && !own_wait(a, i, c))
        return false;
    if (EM)
        em_combine_row(a, s_x, a.node, i, out, parts);
    else
        combine_own<NODES, OCD>(a, s_x, i, mybase, out, parts, pos);
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
// On one node, rank-major, each grab's positions are loaded together, the next grab's while
// the first token of this one is summed, and the first grab's (first_pos) and the row bases
// (mybase) by the caller, ahead of its waits.
template <bool EM, bool NODES, bool WHOLE, int OCD>
__device__ __forceinline__ bool own_tokens(const hep_kargs &a, const char *const *s_x,
                                           const float *const *s_pin, unsigned long long c,
                                           int first_grab, const int *first_pos, int mybase)
{
    if (NODES) /* one node: loaded by the caller */
        mybase = (threadIdx.x & 31) < a.R ? ld_l2(a.meta + a.node * a.R + (threadIdx.x & 31)) : 0;
    const int lane = threadIdx.x & 31, S = gridDim.x, b = blockIdx.x;
    const int wpb = blockDim.x >> 5, warp = threadIdx.x >> 5;
    const int skip = NODES && !WHOLE ? RED_WARPS : 0;
    const int gw = b * (wpb - skip) + warp - skip, nw = S * (wpb - skip);
    const size_t rb = (size_t)a.H * 2;
    const char *parts = NODES ? a.part_token : NULL;
#ifdef HEP_STATIC_TOKENS
    int w0, w1;
    warp_range(0, a.t, gw, nw, w0, w1);
    for (int i = w0; i < w1; i++) {
        if (!own_token<EM, NODES, WHOLE, OCD>(a, s_x, s_pin, c, i, rb, mybase, parts))
            return false;
    }
    (void)first_grab, (void)first_pos, (void)lane;
#else
    // Every warp of the rank takes the next GRAB own tokens (one: bench/NOTES.md, session
    // 12) from the rank's work counter until none are left, so that no warp idles while
    // another still has rows: the rank ends with its last token, not with its slowest
    // block. The next grab is asked for before the current tokens are summed, so its round
    // trip hides behind them. (The positions are the dispatch's, complete before this
    // kernel.)
    unsigned *work = a.work + HEP_WORK_COMBINE;
    /* one node: every warp's first grab is its own (k_combine), and rank-major its second
     * too; the counter hands out the tokens after them */
    const int handed = NODES ? 0 : !EM ? 2 * nw * GRAB : nw * GRAB;
    int next = __shfl_sync(FULL, first_grab, 0);
    if (!EM && !NODES) {
        // two grabs ahead: the grab after this one is known (its positions in flight) while
        // this one is summed, and the one after that asked for meanwhile; its second grab is
        // also the warp's own (grab nw + w)
        int pos[GRAB], npos[GRAB], nxt = next + nw * GRAB;
#pragma unroll
        for (int g = 0; g < GRAB; g++) {
            pos[g] = first_pos[g];
            npos[g] = own_pos(a, nxt + g);
        }
        while (next < a.t) {
            int pending = 0;
            if (lane == 0)
                pending = handed + (int)atomicAdd(work, GRAB);
#pragma unroll
            for (int g = 0; g < GRAB; g++) {
                const int i = next + g;
                if (i < a.t && !own_token<EM, NODES, WHOLE, OCD>(a, s_x, s_pin, c, i, rb, mybase,
                                                                 parts, pos[g]))
                    return false;
            }
            next = nxt;
            nxt = __shfl_sync(FULL, pending, 0);
#pragma unroll
            for (int g = 0; g < GRAB; g++) {
                pos[g] = npos[g];
                npos[g] = own_pos(a, nxt + g);
            }
        }
    } else {
        (void)first_pos;
        while (next < a.t) {
            const int i0 = next;
            int pending = 0;
            if (lane == 0)
                pending = handed + (int)atomicAdd(work, GRAB);
            for (int i = i0; i < min(a.t, i0 + GRAB); i++) {
                if (!own_token<EM, NODES, WHOLE, OCD>(a, s_x, s_pin, c, i, rb, mybase, parts))
                    return false;
            }
            next = __shfl_sync(FULL, pending, 0);
        }
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
// from the one-node instances); WHOLE: N > 1 with every slot in its ring (P x C >= T);
// OCD: rows a warp loads together when it sums an own token's rows (combine_own).
template <bool EM, bool NODES, bool WHOLE, int OCD = 2>
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
    if (NODES) { /* HEP_NODE_TRACE (kernels/ring.cuh; the words: bench/ntrace.py) */
        NT_FLUSH(a, c, 'C', 0x1d1u); /* first events: 0, 4, 6, 7, 8 */
        if (tid == 0)
            NT_SPAN(a, c, 0);
    }
    if (tid < R)
        s_x[tid] = a.x[tid];
#ifndef HEP_STATIC_TOKENS
    /* the first grab of own tokens: on one node the warp's own, tokens
     * [w GRAB, (w + 1) GRAB) of warp w, with no round trip before its positions; else asked
     * for now, so that its round trip hides behind the waits (WHOLE: asked for after the
     * reduction, which holds no register for it) */
    int first_grab = 0;
    if (!NODES)
        first_grab = (b * wpb + warp) * GRAB;
    else if (lane == 0 && owns && !WHOLE)
        first_grab = (int)atomicAdd(a.work + HEP_WORK_COMBINE, GRAB);
#else
    const int first_grab = 0;
#endif
    /* one node: the row bases and (rank-major) the first grab's positions, the dispatch's
     * (complete before this kernel), loaded now so that their round trips hide behind the
     * waits too (across nodes they would hold registers through the reduction) */
    const int mybase = !NODES && lane < R ? ld_l2(a.meta + a.node * R + lane) : 0;
    int first_pos[GRAB];
#pragma unroll
    for (int g = 0; g < GRAB; g++)
        first_pos[g] = NO_POS;
#ifndef HEP_STATIC_TOKENS
    if (!EM && !NODES) {
        const int fg = __shfl_sync(FULL, first_grab, 0);
#pragma unroll
        for (int g = 0; g < GRAB; g++)
            first_pos[g] = own_pos(a, fg + g);
    }
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
            if (lane == 0)
                NT_SPAN(a, c, 4);
#ifndef HEP_STATIC_TOKENS
            first_grab = lane == 0 ? (int)atomicAdd(a.work + HEP_WORK_COMBINE, GRAB) : 0;
#endif
        }
        else if (red && !reduce_rings<EM>(a, s_x, s_pin, b * RED_WARPS + warp, S * RED_WARPS, c,
                                          s_cur[warp]))
            return;
        else if (red && lane == 0)
            NT_SPAN(a, c, 4);
    }
    if (owns && !own_tokens<EM, NODES, WHOLE, OCD>(a, s_x, s_pin, c, first_grab, first_pos, mybase))
        return;
    if (NODES && lane == 0)
        NT_SPAN(a, c, 8);
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
    else if (a->N == 1) /* node-mates: a token's rows are summed COMBINE_CD at a time */
        k = a->R > 1 ? k_combine<false, false, false, COMBINE_CD> : k_combine<false, false, false>;
    else
        k = whole ? k_combine<false, true, true> : k_combine<false, true, false>;
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
    for (int i = 0; i < 8 && e == 0; i++) { /* one node (R 1, 2); nodes, wrapping; whole */
        w.emajor = i & 1;
        w.N = i < 2 || i >= 6 ? 1 : 2;
        w.C = i < 4 || i >= 6 ? 0 : w.T;
        w.R = i >= 6 ? 2 : 1;
        e = hep_launch_combine(&w, 1, stream);
    }
    return e;
}
