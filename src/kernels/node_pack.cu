// kernels/node_pack.cu: with N > 1 nodes, the scan of this rank's own tokens before the
// dispatch kernel runs: which nodes need each token (own token i is row node_pos[i][m] of
// node m's slot: the rows of node m of the tokens before it, -1 if none), the count block of
// each slot (tokens per (local rank, expert)), each token's offset among this rank's tokens
// for each (node, local rank) it goes to (shipped with it, so that the receiver forwards
// any chunk without a scan), and the own token at each row of each slot. The last block
// publishes each slot's count and count block (the receiver lays out while the rows
// travel) and the skip word of the ring's unused chunks. No row is copied here: the
// dispatch kernel packs the rings chunk by chunk as credits come back (kernels/ring.cuh;
// a pack that waited for credits would wait for a kernel that cannot run before it ends).
// An expert-major call also gives each own token's slot on another node's expert its place
// among this rank's tokens on that expert (em_place, shipped with the token), so that the
// receiver places any chunk's rows without a scan of the whole slot (kernels/expert_major.cuh).
#include <cuda_runtime.h>
#ifdef HEP_NODE_TRACE
#include <cstdio>
#endif

#include "kernels/ring.cuh"

#ifndef PACK_THREADS
#define PACK_THREADS 512
#endif

static_assert(PACK_THREADS >= HEP_GPU_MAX_NODES, "one thread per node (tid < N)");
static_assert(PACK_THREADS / 32 <= 32, "tile_positions' warp counts: [32 warps][32 keys]");

// The key of own token i's slot k on node m's experts (x - m R El), or -1: not an expert of
// m, or not the token's first slot on that expert.
__device__ __forceinline__ int em_key(const hep_kargs &a, int i, int k, int m)
{
    const long long Enode = (long long)a.El * a.R, x = topk_at(a, i, k);
    if (x < m * Enode || x >= (m + 1) * Enode)
        return -1;
    for (int q = 0; q < k; q++)
        if (topk_at(a, i, q) == x)
            return -1;
    return (int)(x - m * Enode);
}

// Expert-major calls, before the grid barrier: each own token's slot on another node's
// expert its place among the block's tokens on that expert (em_place, -1 for every other
// slot), one node at a time in words of 32 experts; the block's counts per expert of node
// m to em_pblocks[m][b]. run: [R El] shared; wcnt: tile_positions' [32][32].
__device__ void em_block_places(const hep_kargs &a, int t0, int t1, int *run, int *wcnt)
{
    const int tid = threadIdx.x, RE = a.R * a.El, K = a.K, kmax = a.kmax;
    for (int k = tid; k < (t1 - t0) * kmax; k += blockDim.x)
        a.em_place[(size_t)t0 * kmax + k] = -1;
    for (int m = 0; m < a.N; m++) {
        if (m == a.node)
            continue;
        for (int j = tid; j < RE; j += blockDim.x)
            run[j] = 0;
        __syncthreads(); /* also: the -1s above before the places below */
        for (int tile = t0; tile < t1; tile += blockDim.x) {
            const int i = tile + tid;
            for (int w0 = 0; w0 < RE; w0 += 32) {
                const int nb = min(32, RE - w0);
                unsigned mask = 0;
                for (int k = 0; i < t1 && k < K; k++) {
                    const int key = em_key(a, i, k, m);
                    if (key >= w0 && key < w0 + 32)
                        mask |= 1u << (key - w0);
                }
                int pos[32]; /* the token's place on each expert of the word (-1: none) */
                tile_positions(mask, nb, i < t1, pos, wcnt, run + w0);
                for (int k = 0; mask && k < K; k++) {
                    const int key = em_key(a, i, k, m);
                    if (key >= w0 && key < w0 + 32)
                        a.em_place[(size_t)i * kmax + k] = pos[key - w0];
                }
            }
        }
        __syncthreads();
        for (int j = tid; j < RE; j += blockDim.x)
            a.em_pblocks[((size_t)m * gridDim.x + blockIdx.x) * RE + j] = run[j];
        __syncthreads(); /* the next node's counts start from 0 */
    }
}

// After the grid barrier: the places made rank-wide (plus the earlier blocks' tokens on the
// same expert). pre: [R El] shared.
__device__ void em_rebase_places(const hep_kargs &a, int t0, int t1, int *pre)
{
    const int RE = a.R * a.El, K = a.K, kmax = a.kmax, S = gridDim.x, b = blockIdx.x;
    for (int m = 0; m < a.N; m++) {
        if (m == a.node)
            continue;
        block_prefix(a.em_pblocks + (size_t)m * S * RE, S, RE, b, pre, NULL);
        for (int k = threadIdx.x; b > 0 && k < (t1 - t0) * K; k += blockDim.x) {
            const int i = t0 + k / K, q = k % K, key = em_key(a, i, q, m);
            int *p = a.em_place + (size_t)i * kmax + q;
            if (key >= 0 && *p >= 0)
                *p += pre[key];
        }
        __syncthreads(); /* before the next node's prefix overwrites pre */
    }
}

__global__ void __launch_bounds__(PACK_THREADS, 1) k_node_pack(hep_kargs a)
{
    if (a.warm)
        return;
    extern __shared__ int ncnt[]; // [N][R][El + 1]: the count block of each node's slot
    const int N = a.N, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int R = a.R, El = a.El, CBI = R * (El + 1), NR = N * R, RE = R * El;
    int *run_md = ncnt + (size_t)N * CBI; /* [N][R] the block's tokens per (node, rank) ... */
    int *pre_md = run_md + NR;            /* ... and the earlier blocks' */
    int *run_em = pre_md + NR;            /* [R El] expert-major: one node's experts ... */
    int *pre_em = run_em + RE;            /* ... the earlier blocks' counts of them */
    const size_t CBW = HEP_COUNT_BLOCK_WORDS((size_t)R, (size_t)El);
    const int nwarps = blockDim.x >> 5, S = gridDim.x, b = blockIdx.x;
    const long long Enode = (long long)a.El * a.R, E = Enode * N;
    /* per node; the tile offsets per warp for one word of 32 nodes at a time */
    __shared__ int wcnt[32][32], run[HEP_GPU_MAX_NODES], pre[HEP_GPU_MAX_NODES],
        tot[HEP_GPU_MAX_NODES];
    __shared__ int s_last;
    int *cblocks = (int *)(a.send_words + 3 * N); /* the count blocks, 2 x CBW words apart */
    int t0, t1;
    const unsigned long long e = *a.epoch + 1;
    block_start_jitter(a, e);
    if (tid < N)
        run[tid] = 0;
    for (int j = tid; j < N * CBI; j += blockDim.x)
        ncnt[j] = 0;
    for (int j = tid; j < NR; j += blockDim.x)
        run_md[j] = 0;
    if (b == 0) { /* the previous call's blocks went out before this call was submitted */
        for (int j = tid; j < N * CBI; j += blockDim.x)
            cblocks[(size_t)(j / CBI) * 2 * CBW + j % CBI] = 0;
        for (int j = tid; j < HEP_RING_CTR_KINDS * N * HEP_RING_DEPTH; j += blockDim.x)
            a.ring_ctr[j] = 0; /* the dispatch kernel's ring counters (after this kernel) */
    }
    __syncthreads();
    block_range(a.t, b, S, t0, t1);

    // nodes in words of 32 (one pass with N <= 32): a token's mask holds the nodes
    // [g0, g0 + 32); each id is counted in the one pass of its node
    for (int tile = t0; tile < t1; tile += blockDim.x)
        for (int g0 = 0; g0 < N; g0 += 32) {
            const int i = tile + tid;
            unsigned mask = 0;
            if (i < t1)
                for (int k = 0; k < a.K; k++) {
                    long long x = topk_at(a, i, k);
                    if (x < 0 || x >= E || (int)(x / Enode) == a.node)
                        continue;
                    const int m = (int)(x / Enode), d = (int)((x % Enode) / El);
                    if ((unsigned)(m - g0) >= 32u)
                        continue; /* another word's node */
                    bool dup_rank = false, dup = false;
                    for (int q = 0; q < k; q++) {
                        long long y = topk_at(a, i, q);
                        dup |= y == x;
                        dup_rank |= y >= 0 && y < E && y / El == x / El;
                    }
                    mask |= 1u << (m - g0);
                    int *c = ncnt + (size_t)m * CBI + (size_t)d * (El + 1);
                    if (!dup_rank)
                        atomicAdd(c, 1); /* the token goes to rank d of node m once */
                    if (!dup)
                        atomicAdd(c + 1 + (int)(x % El), 1);
                }
            /* out[d] = node_pos[i][g0 + d]: the row stride stays N */
            tile_positions(mask, min(32, N - g0), i < t1, a.node_pos + (size_t)i * N + g0,
                           &wcnt[0][0], run + g0);
        }
    // each own token's offset among the block's tokens for (node m, local rank d): the
    // receiver at m adds the rows of the blocks before (below) and its row base there, so
    // that it forwards any part of the slot without a scan of its own
    for (int tile = t0; tile < t1; tile += blockDim.x)
        for (int m = 0; m < N; m++) {
            const int i = tile + tid;
            unsigned dmask = 0;
            if (m == a.node)
                continue; /* the same for every thread */
            for (int k = 0; i < t1 && k < a.K; k++) {
                const long long x = topk_at(a, i, k);
                if (x >= 0 && x < E && (int)(x / Enode) == m)
                    dmask |= 1u << (int)((x % Enode) / El);
            }
            tile_positions(dmask, R, i < t1, a.pack_off + ((size_t)i * N + m) * R, &wcnt[0][0],
                           run_md + (size_t)m * R);
        }
    if (a.emajor)
        em_block_places(a, t0, t1, run_em, &wcnt[0][0]);
    if (tid < N)
        a.node_blocks[(size_t)b * N + tid] = run[tid];
    for (int j = tid; j < NR; j += blockDim.x)
        a.md_blocks[(size_t)b * NR + j] = run_md[j];
    grid_arrive(a.pack_arrive);
    if (!grid_wait(a, a.pack_arrive, e * (unsigned long long)S))
        return;
    block_prefix(a.node_blocks, S, N, b, pre, tot);
    // the count blocks first (zeroed by block 0 before the grid barrier): the receivers lay
    // out with them while the rows travel
    for (int j = tid; j < N * CBI; j += blockDim.x)
        if (ncnt[j] && j / CBI != a.node)
            atomicAdd(cblocks + (size_t)(j / CBI) * 2 * CBW + j % CBI, ncnt[j]);
    __syncthreads();
    if (tid == 0) {
        __threadfence_system();
        s_last = atomicAdd(a.count_done, 1ull) == e * (unsigned long long)S - 1;
    }
    __syncthreads();
    // the last block: each slot's count (sent with its count block, so that the receiver
    // knows its chunks), the skip word of the ring's unused chunks, and the slot's final
    // count and flag (the proxy posts that one after every chunk to the node)
    if (s_last && tid < N && tid != a.node) {
        __threadfence();
        a.send_words[tid] = (unsigned long long)tot[tid];
        a.send_words[2 * N + tid] = e;
        a.send_words[N + tid] = e;
        __threadfence_system();
        st_release(a.px + HEP_PX_WORD(N, 0, tid) + 3 * HEP_PX_MAX_BLOCKS + 1, e);
        ring_skips(a, 0, tid, ring_chunks(tot[tid], a.C), -1, e);
        st_release(a.px + HEP_PX_WORD(N, 0, tid) + 3 * HEP_PX_MAX_BLOCKS, e);
    }
    rebase_positions(a.node_pos, t0, t1, N, pre);
    block_prefix(a.md_blocks, S, NR, b, pre_md, NULL);
    for (int k = tid; k < (t1 - t0) * NR; k += blockDim.x) { /* the other nodes' offsets */
        int *p = a.pack_off + (size_t)t0 * NR + k;
        const int v = *p;
        if (k % NR / R != a.node && v >= 0)
            *p = v + pre_md[k % NR];
    }
    if (a.emajor)
        em_rebase_places(a, t0, t1, pre_em);
    // the own token at each row of each slot: the dispatch kernel packs the ring from it
    for (int k = tid; k < (t1 - t0) * N; k += blockDim.x) {
        const int i = t0 + k / N, m = k % N, q = a.node_pos[(size_t)i * N + m];
        if (q >= 0)
            a.slot_list[(size_t)m * a.T + q] = i;
    }
    (void)lane, (void)warp, (void)nwarps;
}

extern "C" size_t hep_node_pack_smem(int N, int R, int El)
{
    /* the count blocks, then the tokens per (node, rank) of this block and of the earlier,
     * then the expert-major counts of one node's experts, this block's and the earlier */
    return sizeof(int) * ((size_t)N * (size_t)R * (size_t)(El + 3) + 2 * (size_t)R * El);
}

extern "C" int hep_launch_node_pack(const hep_kargs *a, int blocks, void *stream)
{
    size_t smem = hep_node_pack_smem(a->N, a->R, a->El);
    int e = hep_allow_smem((const void *)k_node_pack, smem);
    if (e != 0)
        return e;
    k_node_pack<<<blocks, PACK_THREADS, smem, (cudaStream_t)stream>>>(*a);
    return (int)cudaGetLastError();
}

// One block that returns at once (kernels/probe.cu says why).
extern "C" int hep_warm_node_pack(const hep_kargs *a, void *stream)
{
    hep_kargs w = *a;
    w.warm = 1;
    return hep_launch_node_pack(&w, 1, stream);
}
