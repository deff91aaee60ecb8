// kernels/node_pack.cu: with N > 1 nodes, pack this rank's tokens into the send staging of
// each other node that hosts one of their experts, before the dispatch kernel runs. Own
// token i goes to node m's send slot (once, if any of its experts is there) at row
// node_pos[i][m] = rows of node m of the tokens before it. Each block publishes its rows
// [first, first + count) of every slot to the proxy as soon as it wrote them; the count
// blocks (tokens per (local rank, expert) of each slot) go out first, so that the receiver
// lays out while the rows travel; the last block publishes each slot's count and flag.
#include <cuda_runtime.h>

#include "kernels/lists.cuh"

#ifndef PACK_THREADS
#define PACK_THREADS 512
#endif

static_assert(PACK_THREADS >= HEP_GPU_MAX_NODES, "one thread per node (tid < N)");

__global__ void __launch_bounds__(PACK_THREADS, 1) k_node_pack(hep_kargs a)
{
    extern __shared__ int ncnt[]; // [N][R][El + 1]: the count block of each node's slot
    const int N = a.N, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int R = a.R, El = a.El, CBI = R * (El + 1), NR = N * R;
    int *run_md = ncnt + (size_t)N * CBI; /* [N][R] the block's tokens per (node, rank) ... */
    int *pre_md = run_md + NR;            /* ... and the earlier blocks' */
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
    if (b == 0) /* the previous call's blocks went out before this call was submitted */
        for (int j = tid; j < N * CBI; j += blockDim.x)
            cblocks[(size_t)(j / CBI) * 2 * CBW + j % CBI] = 0;
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
    if (tid < N)
        a.node_blocks[(size_t)b * N + tid] = run[tid];
    for (int j = tid; j < NR; j += blockDim.x)
        a.md_blocks[(size_t)b * NR + j] = run_md[j];
    grid_arrive(a.pack_arrive);
    if (!grid_wait(a, a.pack_arrive, e * (unsigned long long)S))
        return;
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
    if (s_last && tid < N && tid != a.node) {
        __threadfence();
        a.send_words[2 * N + tid] = e;
        __threadfence_system();
        st_release(a.px + HEP_PX_WORD(N, 0, tid) + 3 * HEP_PX_MAX_BLOCKS + 1, e);
    }
    block_prefix(a.node_blocks, S, N, b, pre, tot);
    rebase_positions(a.node_pos, t0, t1, N, pre);
    block_prefix(a.md_blocks, S, NR, b, pre_md, NULL);
    for (int k = tid; k < (t1 - t0) * NR; k += blockDim.x) { /* the other nodes' offsets */
        int *p = a.pack_off + (size_t)t0 * NR + k;
        const int v = *p;
        if (k % NR / R != a.node && v >= 0)
            *p = v + pre_md[k % NR];
    }
    __syncthreads();

    // copy each token once per node that needs it: row, sanitized routing, scales
    const size_t rb = (size_t)a.H * a.esize, nvec = rb / 16, T = (size_t)a.T;
    const size_t RWS = T * (size_t)HEP_GPU_ROUTE_WORDS(a.kmax, R); /* a slot's routing words */
    for (int i = t0 + warp; i < t1; i += nwarps) {
        long long myid = lane < a.K ? topk_at(a, i, lane) : -1;
        if (myid < -1 || myid >= E)
            myid = -1; /* reported by the dispatch kernel; travels as an unused slot */
        const float myw = lane < a.K ? a.weights[(size_t)i * a.K + lane] : 0.f;
        const uint4 *src = (const uint4 *)((const char *)a.tokens + (size_t)i * rb);
        for (int g0 = 0; g0 < N; g0 += 32) { /* lane q: node g0 + q (one word with N <= 32) */
            const int pos = g0 + lane < N ? a.node_pos[(size_t)i * N + g0 + lane] : -1;
            const unsigned mask = __ballot_sync(FULL, pos >= 0);
            for (unsigned m = mask; m; m &= m - 1) {
                const int q = __ffs(m) - 1, L = g0 + q;
                const size_t j = (size_t)slot_index(L, a.node);
                const size_t row = (size_t)__shfl_sync(FULL, pos, q);
                uint4 *dst = (uint4 *)(a.send_token + (j * T + row) * rb);
                for (size_t v = lane; v < nvec; v += 32)
                    dst[v] = __ldg(src + v);
                int *route = a.send_route + j * RWS;
                if (lane < a.kmax) {
                    route[row * a.kmax + lane] = (int)myid;
                    ((float *)route)[(T + row) * a.kmax + lane] = myw;
                }
                if (lane < R)
                    route[2 * T * a.kmax + row * R + lane] =
                        a.pack_off[((size_t)i * N + L) * R + lane];
                for (int c = lane; c < a.nscale; c += 32)
                    a.send_scale[(j * T + row) * a.nscale + c] = a.scales[(size_t)i * a.nscale + c];
            }
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
        __threadfence();
        a.send_words[tid] = (unsigned long long)tot[tid];
        a.send_words[N + tid] = e;
        __threadfence_system();
        st_release(a.px + HEP_PX_WORD(N, 0, tid) + 3 * HEP_PX_MAX_BLOCKS, e);
    }
}

extern "C" size_t hep_node_pack_smem(int N, int R, int El)
{
    /* the count blocks, then the tokens per (node, rank) of this block and of the earlier */
    return sizeof(int) * (size_t)N * (size_t)R * (size_t)(El + 3);
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
    k_node_pack<<<blocks, PACK_THREADS, smem, (cudaStream_t)stream>>>(*a);
    return (int)cudaGetLastError();
}

extern "C" int hep_preload_node_pack(void)
{
    cudaFuncAttributes fa;
    return (int)cudaFuncGetAttributes(&fa, (const void *)k_node_pack);
}
