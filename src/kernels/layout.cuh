// kernels/layout.cuh: the layout step of the dispatch kernel. Every block scans the routing
// of its share of a list (destination mask, position among the block's tokens at each
// destination, per-(destination, expert) counts); after one grid barrier, block 0 publishes
// the rank's counts to its node-mates and derives from theirs where its rows go (a row
// base per list and destination), what it receives and the tokens per expert, while the
// other blocks make their positions rank-wide. Every sum is spread over a warp's lanes or
// the block's threads: no thread walks the blocks or ranks one dependent load at a time.
// Included by dispatch.cu only.
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
    int *tot;  // [R] rows of all blocks (block 0)
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
    s.recv = s.tot + R;
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

// Block b's positions among its tokens of list L at each destination (dest_rows, made
// rank-wide by rebase) and its totals (block_counts); with `count`, the list's
// per-(destination, expert) counts are added to the published counts `mine`. An own id
// outside -1..E-1 is recorded (once) and its slot ignored.
static __device__ void scan_list(const hep_kargs &a, const lview &v, int L, bool count,
                          const layout_smem &s, int *mine)
{
    const int R = a.R, El = a.El, tid = threadIdx.x, S = gridDim.x, b = blockIdx.x;
    const long long E = (long long)El * R * a.N, first = (long long)a.rank0 * El;
    const size_t T = (size_t)a.T, LW = (size_t)R * (El + 1);
    int t0, t1;
    block_range(v.t, b, S, t0, t1);
    for (int j = tid; j < R * El; j += blockDim.x)
        s.cnt[j] = 0;
    for (int j = tid; j < R; j += blockDim.x)
        s.run[j] = 0;
    __syncthreads();
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
#pragma unroll
            for (int k = 0; k < 8; k++) {
                key[k] = -1;
                if (k < v.K && i < t1) {
                    const long long x = list_id(a, v, i, k);
                    if (x < -1 || x >= E)
                        record_bad_id(a.diag, i, k, x);
                    else if (x >= first && x < first + (long long)R * El)
                        key[k] = (int)(x - first);
                }
            }
#pragma unroll
            for (int k = 0; k < 8; k++) {
                bool dup = false;
#pragma unroll
                for (int q = 0; q < k; q++)
                    dup |= key[q] == key[k];
                if (key[k] >= 0) {
                    mask |= 1u << (key[k] / El);
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
                const int d = (int)((x - first) / El), ex = (int)((x - first) % El);
                bool dup = false;
                for (int q = 0; q < k; q++)
                    dup |= list_id(a, v, i, q) == x;
                mask |= 1u << d;
                if (count && !dup)
                    atomicAdd(&s.cnt[d * El + ex], 1);
            }
        }
        tile_positions(mask, R, i < t1, a.dest_rows + ((size_t)L * T + i) * R, s.wcnt, s.run);
    }
    if (count)
        for (int j = tid; j < R * El; j += blockDim.x)
            if (s.cnt[j])
                atomicAdd(&mine[(size_t)L * LW + (j / El) * (El + 1) + 1 + j % El], s.cnt[j]);
    for (int d = tid; d < R; d += blockDim.x)
        a.block_counts[((size_t)L * S + b) * R + d] = s.run[d];
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
// other nodes' slots' count blocks, sent ahead of their rows), wait for every node-mate's,
// then derive the row bases (meta), what this rank receives and its tokens per expert.
// Returns false when a wait gave up (the record is filled).
static __device__ bool layout_publish(const hep_kargs &a, unsigned long long e, const layout_smem &s)
{
    const int R = a.R, El = a.El, N = a.N, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const size_t LW = (size_t)R * (El + 1), par = (size_t)(e & 1) * N * LW;
    int *mine = a.counts[a.local] + par;
    const int NR = N * R;

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
    bool ok = true;
    if (tid < R)
        ok = wait_mate(a, a.flags[tid] + HEP_FLAG_COUNTS_READY, e, HEP_STAGE_PREPROCESS, tid);
    if (!block_all(ok))
        return false;
    LTRACE(6);

    // Row base of list L at destination d: the rows there of every source (L2, s2) before
    // (L, this rank), sources in [list][local rank] order: a warp's scan per destination.
    for (int d = warp; d < R; d += nwarps) {
        int base = 0;
        for (int q0 = 0; q0 < NR; q0 += 32) {
            const int q = q0 + lane;
            const int c = q < NR ? ld_l2(a.counts[q % R] + par + (size_t)(q / R) * LW +
                                         (size_t)d * (El + 1))
                                 : 0;
            int x = c;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                int y = __shfl_up_sync(FULL, x, o);
                if (lane >= o)
                    x += y;
            }
            if (q < NR && q % R == a.local)
                a.meta[(q / R) * R + d] = base + x - c;
            base += __shfl_sync(FULL, x, 31);
        }
        if (lane == 0) /* s.tot was published above: now destination d's rows */
            s.tot[d] = base;
    }
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
    // The receive capacity: every rank of the node sees every destination's rows (of all N
    // lists: its own tokens and every slot) in the same counts, so every rank of the node
    // takes the same decision; the first destination over it is named. Blocking: nothing
    // is received on this node (across nodes the host then agrees with the other nodes,
    // backend_gpu.c). a.drop: the rows below it are (push_token drops the others, in every
    // list; tokens per expert are summed again once the sources arrived).
    int over = -1;
    if (a.cap)
        for (int d = 0; d < R; d++)
            if (s.tot[d] > a.cap) {
                over = d;
                break;
            }
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
