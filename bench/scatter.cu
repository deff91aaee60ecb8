// bench/scatter.cu: the memory pattern of an eight-rank dispatch on one GPU, as one kernel.
// Eight sources of T rows each send every row to the ranks that host its top-k experts
// (E = 256, K = 8, uniform: 5.25 of 8 on average), each destination's rows dense in source
// order, as the rank-major layout puts them. No layout step, no flags, no co-dependent
// kernels: what the row traffic alone reaches with a given block count and store method,
// and a kernel Nsight Compute can profile (the library's eight ranks cannot meet under it).
//
// Modes (one warp a token, tokens of a block taken from a shared counter, one block of
// THREADS threads an SM, DU 16-byte vectors a lane in flight, rows in equal passes):
//   plain:  each pass loaded into registers, stored to every destination (the library's
//           plain-store dispatch)
//   stcs:   plain with evict-first stores
//   bulk:   each pass staged in the warp's shared memory, one cp.async.bulk a destination
//   write:  the stores of plain without the loads (the scatter's write-only ceiling)
//   first:  plain to the first destination only (a gather-copy of the same rows)
//   copy:   a linear copy of the phase's bytes (half read, half written), the bench's
//           same-SM ceiling
//   plain1k, bulk1k: plain and bulk with 1024 threads a block, DU / 2 vectors a lane
//   rgrab:  plain with each source's tokens taken by its blocks' warps from one counter of
//           the source's (the library's rank counter), one kernel
//   ranks:  rgrab as the library's virtual ranks run it: one kernel a source, each on a
//           stream of its own with blocks / sources blocks, launched together; the block
//           scheduler then places each source's blocks where it places a kernel's, not
//           spread over the GPU as one kernel's
//   copyr:  copy split the same way: one kernel a source on its own stream, a fixed equal
//           share of the bytes each (the ceiling of ranks whose work is fixed a rank)
//   The split modes also print each source's kernel end (median over the iterations, from
//   the launch) as the spread between the first and last source to end.
//   pipe:   plain in passes of DU / 2 vectors a lane, the next pass's loads in flight while
//           this one is stored (the same registers); pipe20: passes of 10 vectors a lane
//   tma...: no registers on the rows' path. Each warp streams its tokens' rows through a
//           ring of NS shared-memory stages in chunks of CH bytes: lane 0 loads a chunk with
//           a bulk copy (global -> shared, an mbarrier a stage), and once it landed every
//           lane whose destination gets the token stores it with a bulk copy (shared ->
//           global); LAG chunks' stores may still read their stages while NS - LAG chunks
//           load (TMA_CONFIGS lists NW, NS, CH, LAG of each)
//
// The reduce modes move combine's rows the other way: every source row is the f32 sum of
// its copies at its destinations (ascending destination), rounded to BF16 once, written to
// an output row (BF16 only; the destinations hold a plain scatter's rows first):
//   rplain: one warp a token, passes of CU = 4 vectors a lane of CD = 2 rows in flight
//           (the library's combine, 512 threads); rp44, rp24: CU x CD = 4 x 4, 2 x 4
//   rtma...: each warp streams its tokens' (chunk, destination) pieces through a ring of NS
//           shared-memory stages of CH bytes with bulk copies (global -> shared, lane 0,
//           an mbarrier a stage); every lane adds its part of each landed piece and stores
//           the chunk's sum once its last piece is added (RTMA_CONFIGS: NW, NS, CH)
// Build (bench/gpu_build.sh does): nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90
//        -diag-suppress 128 -Isrc -o scatter bench/scatter.cu
// Run: scatter [--blocks 64,128] [--modes plain,bulk,...] [--iters 20] [--hidden 7168]
//      [--esize 2] [--tokens 4096] [--sources 8|1]; prints one row per (mode, blocks) and checks the rows.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/vec.cuh" /* acc8, pack8, mbar_wait (the library's) */

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));    \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

enum { R = 8, E = 256, K = 8, THREADS = 512, DU = 14 };
// The tma modes: name, warps a block, stages a warp, chunk bytes, store groups in flight
#define TMA_CONFIGS(X)                                                                     \
    X(tma, 16, 3, 3584, 1)                                                                 \
    X(tma8, 8, 4, 7168, 1)                                                                 \
    X(tma4, 4, 6, 7168, 1)                                                                 \
    X(t4l2, 4, 6, 7168, 2)                                                                 \
    X(t4s8, 4, 8, 7168, 2)                                                                 \
    X(t4c, 4, 12, 3584, 2)                                                                 \
    X(t8l2, 8, 4, 7168, 2)                                                                 \
    X(t2, 2, 14, 7168, 3)                                                                  \
    X(t1, 1, 28, 7168, 4)
#define RTMA_CONFIGS(X)                                                                    \
    X(rtma, 16, 6, 2048)                                                                   \
    X(rtma8, 8, 12, 2048)                                                                  \
    X(rtma8w, 8, 6, 4096)                                                                  \
    X(rtma4, 4, 24, 2048)
// rasync...: the same pieces, each lane copying its 16-byte vectors of a piece with cp.async
// (global -> its own shared-memory slots, a commit group a piece) and adding back only what
// it copied itself: no barrier and no warp-wide wait (RASYNC_CONFIGS: NW, NS, VL vectors a
// lane a piece)
#define RASYNC_CONFIGS(X)                                                                  \
    X(rasync, 16, 6, 4)                                                                    \
    X(ras8, 16, 8, 2)                                                                      \
    X(ras32, 32, 3, 4)                                                                     \
    X(ras8w, 8, 12, 4)
enum {
    M_PLAIN,
    M_STCS,
    M_BULK,
    M_WRITE,
    M_FIRST,
    M_COPY,
    M_PLAIN1K,
    M_BULK1K,
    M_PIPE,
    M_PIPE20,
    M_RGRAB,
    M_RANKS,
    M_COPYR,
#define TMA_MODE(name, nw, ns, ch, lag) M_##name,
    TMA_CONFIGS(TMA_MODE)
#undef TMA_MODE
    M_RPLAIN,
    M_RP44,
    M_RP24,
#define RTMA_MODE(name, nw, ns, ch) M_##name,
    RTMA_CONFIGS(RTMA_MODE) RASYNC_CONFIGS(RTMA_MODE)
#undef RTMA_MODE
    M_COUNT
};
static const char *mode_name[M_COUNT] = {"plain", "stcs",    "bulk",   "write", "first",
                                         "copy",  "plain1k", "bulk1k", "pipe",  "pipe20",
                                         "rgrab", "ranks",   "copyr",
#define TMA_MODE(name, nw, ns, ch, lag) #name,
                                         TMA_CONFIGS(TMA_MODE)
#undef TMA_MODE
                                         "rplain", "rp44", "rp24",
#define RTMA_MODE(name, nw, ns, ch) #name,
                                         RTMA_CONFIGS(RTMA_MODE) RASYNC_CONFIGS(RTMA_MODE)
#undef RTMA_MODE
};
static bool is_reduce(int m) { return m >= M_RPLAIN; }
static bool is_split(int m) { return m == M_RANKS || m == M_COPYR; }

struct args {
    const uint4 *src; /* [R][T] rows */
    char *dst[R];     /* destination d's rows */
    const int *pos;   /* [R][T][R]: the row at destination d, -1 when not sent */
    uint4 *out;       /* [R][T] rows: the reduce modes' sums */
    int T, per_src;   /* tokens a source, blocks a source */
    int r0;           /* the first source of this kernel (split modes: its only one) */
    int *rctr;        /* [R] each source's token counter (rgrab, ranks), zero at launch */
    int nvec;         /* 16-byte vectors a row */
};

/* Block b's source r and its tokens [t0, t1) of it; zeroes the block's token counter
 * `grab` and fills the destination table (constant indices: the parameters stay in their
 * bank). The caller's __syncthreads publishes both. */
struct share {
    int r, t0, t1;
};
__device__ __forceinline__ share block_share(const args &a, int *grab, char **s_dst)
{
    share sh;
    const int j = blockIdx.x % a.per_src, chunk = (a.T + a.per_src - 1) / a.per_src;
    sh.r = a.r0 + blockIdx.x / a.per_src;
    sh.t0 = min(a.T, j * chunk), sh.t1 = min(a.T, sh.t0 + chunk);
    if (threadIdx.x == 0)
        *grab = 0;
#pragma unroll
    for (int d = 0; d < R; d++)
        if (threadIdx.x == d)
            s_dst[d] = a.dst[d];
    return sh;
}

template <int MODE, int NT = THREADS, int U = DU>
__global__ void __launch_bounds__(NT, 1) k_scatter(args a)
{
    extern __shared__ __align__(16) uint4 stage_all[];
    __shared__ int grab;
    __shared__ char *s_dst[R]; /* indexed at run time: not from the parameter bank */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = NT / 32;
    const share sh = block_share(a, &grab, s_dst);
    const int r = sh.r, t0 = sh.t0, t1 = sh.t1;
    __syncthreads();
    const int passes = (a.nvec + 32 * U - 1) / (32 * U);
    const int per_pass = ((a.nvec + passes - 1) / passes + 31) & ~31;
    uint4 *stage = stage_all + warp * 32 * U;
    constexpr bool RC = MODE == M_RGRAB || MODE == M_RANKS; /* the source's counter */
    const int tend = RC ? a.T : t1;
    int i0 = t0 + warp;
    if (RC) {
        int k = 0;
        if (lane == 0)
            k = atomicAdd(a.rctr + r, 1);
        i0 = __shfl_sync(~0u, k, 0);
    }
    for (int i = i0; i < tend;) {
        const size_t tok = (size_t)r * a.T + i;
        const int p = lane < R ? a.pos[tok * R + lane] : -1;
        unsigned mask = __ballot_sync(~0u, p >= 0);
        if (MODE == M_FIRST)
            mask &= mask ? 1u << (__ffs(mask) - 1) : 0u;
        const uint4 *s = a.src + tok * a.nvec;
        if (MODE == M_PIPE || MODE == M_PIPE20) {
            constexpr int H = U / 2;
            const int ps = (a.nvec + 32 * H - 1) / (32 * H);
            const int per = ((a.nvec + ps - 1) / ps + 31) & ~31;
            uint4 x[H], y[H];
            auto load = [&](uint4(&b)[H], int v0, int v1) {
#pragma unroll
                for (int u = 0; u < H; u++)
                    if (v0 + u * 32 + lane < v1)
                        b[u] = __ldg(s + v0 + u * 32 + lane);
            };
            auto store = [&](const uint4(&b)[H], int v0, int v1) {
                for (unsigned m = mask; m; m &= m - 1) {
                    const int d = __ffs(m) - 1;
                    const int row = __shfl_sync(~0u, p, d);
                    uint4 *o = (uint4 *)s_dst[d] + (size_t)row * a.nvec;
#pragma unroll
                    for (int u = 0; u < H; u++)
                        if (v0 + u * 32 + lane < v1)
                            o[v0 + u * 32 + lane] = b[u];
                }
            };
            load(x, 0, min(a.nvec, per));
            for (int v0 = 0; v0 < a.nvec; v0 += 2 * per) {
                const int v1 = min(a.nvec, v0 + per), v2 = min(a.nvec, v1 + per);
                if (v1 < a.nvec)
                    load(y, v1, v2);
                store(x, v0, v1);
                if (v1 >= a.nvec)
                    break;
                if (v2 < a.nvec)
                    load(x, v2, min(a.nvec, v2 + per));
                store(y, v1, v2);
            }
        }
        for (int v0 = 0; MODE != M_PIPE && MODE != M_PIPE20 && v0 < a.nvec; v0 += per_pass) {
            const int v1 = min(a.nvec, v0 + per_pass);
            uint4 buf[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int q = v0 + u * 32 + lane;
                if (MODE == M_WRITE)
                    buf[u] = make_uint4(q, i, r, 0);
                else if (q < v1)
                    buf[u] = __ldg(s + q);
            }
            if (MODE == M_BULK || MODE == M_BULK1K) { /* (the loop after it is the other modes') */
                asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
                __syncwarp();
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const int q = v0 + u * 32 + lane;
                    if (q < v1)
                        stage[q - v0] = buf[u];
                }
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                __syncwarp();
                if ((mask >> lane) & 1u) {
                    char *d = s_dst[lane] + ((size_t)p * a.nvec + v0) * 16;
                    const unsigned sa = (unsigned)__cvta_generic_to_shared(stage);
                    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n\t"
                                 "cp.async.bulk.commit_group;" ::"l"(d),
                                 "r"(sa), "r"((unsigned)(v1 - v0) * 16u)
                                 : "memory");
                }
                continue;
            }
            for (unsigned m = mask; m; m &= m - 1) {
                const int d = __ffs(m) - 1;
                const int row = __shfl_sync(~0u, p, d);
                uint4 *o = (uint4 *)s_dst[d] + (size_t)row * a.nvec;
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const int q = v0 + u * 32 + lane;
                    if (q < v1) {
                        if (MODE == M_STCS)
                            __stcs(o + q, buf[u]);
                        else
                            o[q] = buf[u];
                    }
                }
            }
        }
        int k = 0;
        if (lane == 0)
            k = RC ? atomicAdd(a.rctr + r, 1) : atomicAdd(&grab, 1);
        i = RC ? __shfl_sync(~0u, k, 0) : t0 + nw + __shfl_sync(~0u, k, 0);
    }
    if (MODE == M_BULK || MODE == M_BULK1K)
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// The load side of k_tma (lane 0 issues): item n = (token ltok, chunk lc) goes to stage
// n % NS; a token's first chunk brings its R positions along on the same mbarrier. Then the
// item after it (the warp's next token from the block's counter after the last chunk).
template <int NW, int NS, int CH>
__device__ __forceinline__ void tma_load(const args &a, unsigned n, int &ltok, int &lc, int t0,
                                         int t1, int r, unsigned rb, unsigned nch, unsigned bar0,
                                         unsigned pos0, unsigned st0, int *grab, int *tok)
{
    const int lane = threadIdx.x & 31;
    if (ltok >= t1)
        return;
    const int s = (int)(n % NS);
    const unsigned off = (unsigned)lc * CH, bytes = min((unsigned)CH, rb - off);
    if (lane == 0) {
        const size_t row = (size_t)r * a.T + ltok;
        tok[s] = ltok;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar0 + s * 8),
                     "r"(bytes + (lc == 0 ? R * 4 : 0))
                     : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                     "[%0], [%1], %2, [%3];" ::"r"(st0 + s * CH),
                     "l"((const char *)a.src + row * rb + off), "r"(bytes), "r"(bar0 + s * 8)
                     : "memory");
        if (lc == 0)
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                         "[%0], [%1], %2, [%3];" ::"r"(pos0 + s * R * 4),
                         "l"(a.pos + row * R), "r"(R * 4), "r"(bar0 + s * 8)
                         : "memory");
    }
    if (++lc == (int)nch) {
        int k = 0;
        lc = 0;
        if (lane == 0)
            k = atomicAdd(grab, 1);
        ltok = t0 + NW + __shfl_sync(~0u, k, 0);
    }
}

template <int NW, int NS, int CH, int LAG>
__global__ void __launch_bounds__(NW * 32, 1) k_tma(args a)
{
    // dynamic shared memory: [NW][NS] mbarriers, [NW][NS][R] positions, [NW][NS][CH] rows
    static_assert(NS <= 32 && LAG >= 1 && LAG < NS, "a lane a stage; a stage loading");
    extern __shared__ __align__(128) unsigned char tma_smem[];
    __shared__ int grab;
    __shared__ char *s_dst[R];
    __shared__ int s_tok[NW][NS]; /* the token of the chunk each stage holds, -1: none */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const share sh = block_share(a, &grab, s_dst);
    const int r = sh.r, t0 = sh.t0, t1 = sh.t1;
    const unsigned rb = (unsigned)a.nvec * 16u, nch = (rb + CH - 1) / CH;
    const unsigned sm0 = (unsigned)__cvta_generic_to_shared(tma_smem);
    const unsigned bar0 = sm0 + warp * NS * 8;
    const unsigned pos0 = sm0 + NW * NS * 8 + warp * NS * R * 4;
    const unsigned st0 = sm0 + NW * NS * (8 + R * 4) + warp * NS * CH;
    const int *s_pos = (const int *)(tma_smem + NW * NS * 8) + warp * NS * R;
    if (lane < NS) {
        s_tok[warp][lane] = -1;
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + lane * 8) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    int ltok = t0 + warp, lc = 0; /* the next item to load */
    for (unsigned n = 0; n + LAG < NS; n++)
        tma_load<NW, NS, CH>(a, n, ltok, lc, t0, t1, r, rb, nch, bar0, pos0, st0, &grab,
                             s_tok[warp]);
    int p = -1;
    unsigned mask = 0;
    for (unsigned n = 0;; n++) {
        const int s = (int)(n % NS);
        __syncwarp();
        if (s_tok[warp][s] < 0)
            break;
        const unsigned c = n % nch; /* a token's chunks are consecutive items */
        const unsigned off = c * CH, bytes = min((unsigned)CH, rb - off);
        mbar_wait(bar0 + s * 8, (n / NS) & 1u);
        if (c == 0) { /* a new token: its positions came with the chunk */
            p = lane < R ? s_pos[s * R + lane] : -1;
            mask = __ballot_sync(~0u, p >= 0);
        }
        if ((mask >> lane) & 1u) {
            char *d = s_dst[lane] + (size_t)p * rb + off;
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(d),
                         "r"(st0 + s * CH), "r"(bytes)
                         : "memory");
        }
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        __syncwarp();
        if (lane == 0)
            s_tok[warp][s] = -1;
        /* item n + NS - LAG goes to stage (n - LAG) % NS: its stores (group n - LAG) read it */
        asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(LAG) : "memory");
        __syncwarp();
        tma_load<NW, NS, CH>(a, n + NS - LAG, ltok, lc, t0, t1, r, rb, nch, bar0, pos0, st0,
                             &grab, s_tok[warp]);
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

/* rplain: the library's combine sums (one warp a token, CU vectors a lane of CD rows in
 * flight, passes of equal size), tokens of a block from a shared counter */
template <int CU = 4, int CD = 2>
__global__ void __launch_bounds__(THREADS, 1) k_rplain(args a)
{
    __shared__ int grab;
    __shared__ char *s_dst[R];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = THREADS / 32;
    const share sh = block_share(a, &grab, s_dst);
    const int r = sh.r, t0 = sh.t0, t1 = sh.t1;
    __syncthreads();
    const int nvec = a.nvec, passes = (nvec + 32 * CU - 1) / (32 * CU);
    const int per_pass = ((nvec + passes - 1) / passes + 31) & ~31;
    for (int i = t0 + warp; i < t1;) {
        const size_t tok = (size_t)r * a.T + i;
        const int p = lane < R ? a.pos[tok * R + lane] : -1;
        const unsigned mask = __ballot_sync(~0u, p >= 0);
        for (int v0 = 0; v0 < nvec; v0 += per_pass) {
            const int v1 = min(nvec, v0 + per_pass);
            float f[CU][8];
#pragma unroll
            for (int u = 0; u < CU; u++)
#pragma unroll
                for (int q = 0; q < 8; q++)
                    f[u][q] = -0.0f;
            for (unsigned m = mask; m;) {
                const uint4 *src[CD];
                int n = 0;
#pragma unroll
                for (int c = 0; c < CD; c++) {
                    src[c] = NULL;
                    if (m) {
                        const int d = __ffs(m) - 1;
                        m &= m - 1;
                        src[c] = (const uint4 *)s_dst[d] + (size_t)__shfl_sync(~0u, p, d) * nvec;
                        n++;
                    }
                }
                uint4 v[CD][CU];
#pragma unroll
                for (int c = 0; c < CD; c++)
#pragma unroll
                    for (int u = 0; u < CU; u++) {
                        const int k = v0 + u * 32 + lane;
                        v[c][u] = (c < n && k < v1) ? __ldcg(src[c] + k) : make_uint4(0, 0, 0, 0);
                    }
#pragma unroll
                for (int c = 0; c < CD; c++)
                    if (c < n)
#pragma unroll
                        for (int u = 0; u < CU; u++)
                            acc8(f[u], v[c][u]);
            }
#pragma unroll
            for (int u = 0; u < CU; u++) {
                const int k = v0 + u * 32 + lane;
                if (k < v1)
                    a.out[tok * nvec + k] = pack8(f[u]);
            }
        }
        int k = 0;
        if (lane == 0)
            k = atomicAdd(&grab, 1);
        i = t0 + nw + __shfl_sync(~0u, k, 0);
    }
}

/* The reduce modes' pieces (rtma, rasync): a warp's tokens of source r from the block's
 * counter `grab`, each token's chunks of PV vectors, each chunk's destinations ascending.
 * Lane d holds the current token's position at destination d; the next token and its
 * positions are fetched one token ahead. Warp-uniform: every lane calls next(). */
struct pieces {
    const args *a;
    int *grab;
    int r, t0, t1, nw, nch;
    int tok, chunk, lp, ntok, np;
    unsigned lm, cm; /* the token's destinations; those of the current chunk left */
    __device__ int pos_of(int t) const
    {
        const int lane = threadIdx.x & 31;
        return t < t1 && lane < R ? a->pos[((size_t)r * a->T + t) * R + lane] : -1;
    }
    __device__ void fetch_next()
    {
        int k = 0;
        if ((threadIdx.x & 31) == 0)
            k = atomicAdd(grab, 1);
        ntok = t0 + nw + __shfl_sync(~0u, k, 0);
        np = pos_of(ntok);
    }
    __device__ void take_next()
    {
        tok = ntok, lp = np, lm = __ballot_sync(~0u, lp >= 0), chunk = 0, cm = lm;
        fetch_next();
    }
    __device__ void start(const args &aa, int *g, int src, int first, int end, int warps,
                          int chunks)
    {
        a = &aa, grab = g, r = src, t0 = first - (threadIdx.x >> 5), t1 = end, nw = warps;
        nch = chunks;
        tok = first, chunk = 0, lp = pos_of(tok), lm = __ballot_sync(~0u, lp >= 0), cm = lm;
        fetch_next();
    }
    /* the next piece: token, chunk, destination d and the row there, and whether it is the
     * chunk's last; false when the warp's tokens are done */
    __device__ bool next(int &t, int &c, int &d, int &row, bool &last)
    {
        while (tok < t1 && cm == 0) /* a token with no destination: nothing to sum */
            take_next();
        if (tok >= t1)
            return false;
        d = __ffs(cm) - 1;
        row = __shfl_sync(~0u, lp, d);
        t = tok, c = chunk;
        cm &= cm - 1;
        last = cm == 0;
        if (last) { /* the next chunk, or the next token */
            cm = lm;
            if (++chunk == nch)
                take_next();
        }
        return true;
    }
};

/* The reduce modes' consumer: piece `info` (token << 8 | chunk << 1 | the chunk's last) of
 * VL vectors a lane, at `piece` in shared memory, added into f (zeroed at a chunk's first
 * piece); at the chunk's last piece its sum goes to the token's output row. */
template <int VL>
__device__ __forceinline__ void add_piece(const args &a, int r, int info, const uint4 *piece,
                                          float (&f)[VL][8], bool &fresh)
{
    const int lane = threadIdx.x & 31, v0 = ((info >> 1) & 127) * VL * 32;
    if (fresh) {
#pragma unroll
        for (int u = 0; u < VL; u++)
#pragma unroll
            for (int q = 0; q < 8; q++)
                f[u][q] = -0.0f;
        fresh = false;
    }
#pragma unroll
    for (int u = 0; u < VL; u++)
        if (v0 + u * 32 + lane < a.nvec)
            acc8(f[u], piece[u * 32 + lane]);
    if (info & 1) { /* the chunk's sum is complete */
        uint4 *o = a.out + ((size_t)r * a.T + (info >> 8)) * a.nvec + v0;
#pragma unroll
        for (int u = 0; u < VL; u++)
            if (v0 + u * 32 + lane < a.nvec)
                o[u * 32 + lane] = pack8(f[u]);
        fresh = true;
    }
}

/* rtma: see the header. Items n = (token, chunk, destination) in that order (destinations
 * ascending); lane 0 loads item n + NS into stage n % NS once every lane added item n. The
 * warp's next token and its positions are fetched one token ahead. */
template <int NW, int NS, int CH>
__global__ void __launch_bounds__(NW * 32, 1) k_rtma(args a)
{
    static_assert(CH % 512 == 0 && NS <= 32, "whole vectors a lane; a lane a stage");
    constexpr int VL = CH / 512; /* vectors a lane a chunk */
    extern __shared__ __align__(128) unsigned char tma_smem[];
    __shared__ int grab;
    __shared__ char *s_dst[R];
    __shared__ int s_info[NW][NS]; /* token << 8 | chunk << 1 | last piece of the chunk */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const share sh = block_share(a, &grab, s_dst);
    const int r = sh.r, t0 = sh.t0, t1 = sh.t1;
    const unsigned rb = (unsigned)a.nvec * 16u, nch = (rb + CH - 1) / CH;
    const unsigned sm0 = (unsigned)__cvta_generic_to_shared(tma_smem);
    const unsigned bar0 = sm0 + warp * NS * 8;
    const unsigned st0 = sm0 + NW * NS * 8 + warp * NS * CH;
    const uint4 *stage = (const uint4 *)(tma_smem + NW * NS * 8 + (size_t)warp * NS * CH);
    if (lane < NS) {
        s_info[warp][lane] = -1;
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + lane * 8) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    pieces pc;
    pc.start(a, &grab, r, t0 + warp, t1, NW, (int)nch);
    auto load = [&](unsigned n) {
        int tok, c, d, row;
        bool last;
        if (!pc.next(tok, c, d, row, last))
            return;
        const int s = (int)(n % NS);
        const unsigned off = (unsigned)c * CH, bytes = min((unsigned)CH, rb - off);
        if (lane == 0) {
            s_info[warp][s] = tok << 8 | c << 1 | last;
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                             bar0 + s * 8),
                         "r"(bytes)
                         : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                         "[%0], [%1], %2, [%3];" ::"r"(st0 + s * CH),
                         "l"(s_dst[d] + (size_t)row * rb + off), "r"(bytes), "r"(bar0 + s * 8)
                         : "memory");
        }
    };
    for (unsigned n = 0; n < NS; n++)
        load(n);
    float f[VL][8];
    bool fresh = true;
    for (unsigned n = 0;; n++) {
        const int s = (int)(n % NS);
        __syncwarp();
        const int info = s_info[warp][s];
        if (info < 0)
            break;
        mbar_wait(bar0 + s * 8, (n / NS) & 1u);
        add_piece<VL>(a, r, info, stage + s * (CH / 16), f, fresh);
        __syncwarp();
        if (lane == 0)
            s_info[warp][s] = -1;
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* reads before the reload */
        __syncwarp();
        load(n + NS);
    }
}

template <int NW, int NS, int VL>
__global__ void __launch_bounds__(NW * 32, 1) k_rasync(args a)
{
    static_assert(NS >= 2 && NS <= 32, "a lane a stage");
    constexpr int PV = VL * 32; /* vectors a piece */
    extern __shared__ __align__(128) uint4 as_smem[];
    __shared__ int grab;
    __shared__ char *s_dst[R];
    __shared__ int s_info[NW][NS]; /* token << 8 | chunk << 1 | last piece of the chunk */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const share sh = block_share(a, &grab, s_dst);
    const int r = sh.r, t0 = sh.t0, t1 = sh.t1;
    const int nvec = a.nvec, nch = (nvec + PV - 1) / PV;
    uint4 *stage = as_smem + (size_t)warp * NS * PV;
    const unsigned st0 = (unsigned)__cvta_generic_to_shared(stage);
    if (lane < NS)
        s_info[warp][lane] = -1;
    __syncthreads();
    pieces pc;
    pc.start(a, &grab, r, t0 + warp, t1, NW, nch);
    auto issue = [&](unsigned n) { /* piece n into stage n % NS; a commit group either way */
        int tok, c, d, row;
        bool last;
        const int s = (int)(n % NS);
        if (pc.next(tok, c, d, row, last)) {
            const int v0 = c * PV;
            const uint4 *src = (const uint4 *)s_dst[d] + (size_t)row * nvec;
#pragma unroll
            for (int u = 0; u < VL; u++) {
                const int k = v0 + u * 32 + lane;
                if (k < nvec)
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                                     st0 + (unsigned)(s * PV + u * 32 + lane) * 16u),
                                 "l"(src + k)
                                 : "memory");
            }
            if (lane == 0)
                s_info[warp][s] = tok << 8 | c << 1 | last;
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    for (unsigned n = 0; n + 1 < NS; n++)
        issue(n);
    float f[VL][8];
    bool fresh = true;
    for (unsigned n = 0;; n++) {
        const int s = (int)(n % NS);
        __syncwarp();
        const int info = s_info[warp][s];
        if (info < 0)
            break;
        issue(n + NS - 1); /* into stage (n - 1) % NS, added up in the previous turn */
        asm volatile("cp.async.wait_group %0;" ::"n"(NS - 1) : "memory");
        add_piece<VL>(a, r, info, stage + s * PV, f, fresh);
        __syncwarp();
        if (lane == 0)
            s_info[warp][s] = -1;
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
}

/* the same-SM copy ceiling: n vectors from a to b, one warp a stretch of rows, DU in flight */
__global__ void __launch_bounds__(THREADS, 1) k_copy(const uint4 *a, uint4 *b, size_t n)
{
    const size_t step = (size_t)gridDim.x * THREADS * DU;
    for (size_t base =
             ((size_t)blockIdx.x * THREADS) * DU + (threadIdx.x & ~31u) * DU + (threadIdx.x & 31);
         base < n; base += step) {
        uint4 buf[DU];
#pragma unroll
        for (int u = 0; u < DU; u++)
            if (base + u * 32 < n)
                buf[u] = __ldg(a + base + u * 32);
#pragma unroll
        for (int u = 0; u < DU; u++)
            if (base + u * 32 < n)
                b[base + u * 32] = buf[u];
    }
}

static size_t tma_smem_bytes(int nw, int ns, int ch)
{
    return (size_t)nw * ns * (8 + R * 4 + ch);
}

template <int NW, int NS, int CH, int LAG> static cudaError_t tma_setup()
{
    return cudaFuncSetAttribute(k_tma<NW, NS, CH, LAG>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)tma_smem_bytes(NW, NS, CH));
}

/* word k of the sources: two finite BF16 values below 2 (exponents up to 126), so that the
 * reduce modes' sums are finite and exact to check */
static uint32_t src_word(size_t k)
{
    return (uint32_t)(k * 2654435761u) & 0x3F7F3F7Fu;
}

/* BF16 of x, rounded to the nearest even (x finite) */
static uint16_t bf16_rn(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static uint64_t next(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static std::vector<int> parse_list(const char *s)
{
    std::vector<int> v;
    for (const char *p = s; *p;) {
        v.push_back(atoi(p));
        const char *c = strchr(p, ',');
        if (!c)
            break;
        p = c + 1;
    }
    return v;
}

int main(int argc, char **argv)
{
    int T = 4096, H = 7168, esize = 2, iters = 20, nsrc = R;
    std::vector<int> blocks = {64, 128};
    std::vector<int> modes;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--blocks"))
            blocks = parse_list(argv[i + 1]);
        else if (!strcmp(argv[i], "--sources")) {
            nsrc = atoi(argv[i + 1]);
            if (nsrc != 1 && nsrc != R) {
                fprintf(stderr, "scatter: --sources 1 or %d\n", R);
                return 2;
            }
        } else if (!strcmp(argv[i], "--tokens"))
            T = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--hidden"))
            H = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--esize"))
            esize = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--iters"))
            iters = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--modes")) {
            for (char *m = strtok(argv[i + 1], ","); m; m = strtok(NULL, ",")) {
                int k = 0;
                while (k < M_COUNT && strcmp(m, mode_name[k]))
                    k++;
                if (k == M_COUNT) {
                    fprintf(stderr, "scatter: unknown mode %s\n", m);
                    return 2;
                }
                modes.push_back(k);
            }
        } else {
            fprintf(stderr, "scatter: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (modes.empty())
        for (int k = 0; k < M_COUNT; k++)
            modes.push_back(k);
    const size_t rb = (size_t)H * esize;
    if (T < 1 || iters < 1 || rb % 16) {
        fprintf(stderr, "scatter: bad tokens, iters or row size\n");
        return 2;
    }
    for (int b : blocks)
        if (b < nsrc || b % nsrc) {
            fprintf(stderr, "scatter: blocks must be a multiple of %d\n", nsrc);
            return 2;
        }
    // routing: K distinct experts of E a token; destination = expert / (E / R); with
    // --sources 1, every row to destination 0 (one rank, E = K = 8)
    std::vector<int> pos((size_t)R * T * R, -1);
    size_t cnt[R] = {0}, sent = 0, firsts = 0;
    uint64_t seed = 1;
    for (int r = 0; r < nsrc; r++)
        for (int i = 0; i < T; i++) {
            unsigned mask = 0, chosen[K];
            for (int k = 0; k < K; k++) {
                unsigned x;
                bool dup;
                do {
                    x = (unsigned)(next(&seed) % E);
                    dup = false;
                    for (int q = 0; q < k; q++)
                        dup |= chosen[q] == x;
                } while (dup);
                chosen[k] = x;
                mask |= nsrc == 1 ? 1u : 1u << (x / (E / R));
            }
            for (int d = 0; d < R; d++)
                if ((mask >> d) & 1u)
                    pos[((size_t)r * T + i) * R + d] = (int)cnt[d]++;
            sent += (size_t)__builtin_popcount(mask);
            firsts += mask != 0;
        }
    const size_t rows_in = (size_t)nsrc * T;
    uint4 *src = NULL, *ca = NULL, *cb = NULL;
    int *dpos = NULL;
    args a;
    a.T = T, a.nvec = (int)(rb / 16), a.r0 = 0;
    CK(cudaMalloc(&a.rctr, R * sizeof(int)));
    CK(cudaMalloc(&src, rows_in * rb));
    CK(cudaMalloc(&dpos, pos.size() * sizeof(int)));
    CK(cudaMemcpy(dpos, pos.data(), pos.size() * sizeof(int), cudaMemcpyHostToDevice));
    for (int d = 0; d < R; d++)
        CK(cudaMalloc(&a.dst[d], std::max<size_t>(cnt[d], 1) * rb));
    a.src = src, a.pos = dpos;
    {
        std::vector<uint32_t> h(rows_in * rb / 4);
        for (size_t k = 0; k < h.size(); k++)
            h[k] = src_word(k);
        CK(cudaMemcpy(src, h.data(), rows_in * rb, cudaMemcpyHostToDevice));
    }
    const double scatter_bytes = (double)(firsts + sent) * rb; /* fewest bytes: read once */
    const double first_bytes = 2.0 * firsts * rb;
    const size_t copy_vec = (size_t)(scatter_bytes / 2 / 16);
    CK(cudaMalloc(&ca, copy_vec * 16));
    CK(cudaMalloc(&cb, copy_vec * 16));
    CK(cudaMalloc(&a.out, rows_in * rb));
    CK(cudaMemset(ca, 1, copy_vec * 16));
    const size_t smem = (size_t)(THREADS / 32) * 32 * DU * 16;
#define RTMA_MODE(name, nw, ns, ch)                                                        \
    CK(cudaFuncSetAttribute(k_rtma<nw, ns, ch>, cudaFuncAttributeMaxDynamicSharedMemorySize, \
                            nw * ns * (8 + ch)));
    RTMA_CONFIGS(RTMA_MODE)
#undef RTMA_MODE
#define RASYNC_MODE(name, nw, ns, vl)                                                      \
    CK(cudaFuncSetAttribute(k_rasync<nw, ns, vl>,                                          \
                            cudaFuncAttributeMaxDynamicSharedMemorySize, nw * ns * vl * 512));
    RASYNC_CONFIGS(RASYNC_MODE)
#undef RASYNC_MODE
    CK(cudaFuncSetAttribute(k_scatter<M_BULK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            (int)smem));
    CK(cudaFuncSetAttribute(k_scatter<M_BULK1K, 1024, DU / 2>,
                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
#define TMA_MODE(name, nw, ns, ch, lag) CK((tma_setup<nw, ns, ch, lag>()));
    TMA_CONFIGS(TMA_MODE)
#undef TMA_MODE
    cudaEvent_t e0, e1, ends[R];
    cudaStream_t st[R];
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int r = 0; r < R; r++) {
        CK(cudaEventCreate(&ends[r]));
        CK(cudaStreamCreateWithFlags(&st[r], cudaStreamNonBlocking));
    }
    printf("scatter: %d sources x %d rows of %zu B, E %d, K %d: %.2f destinations a row, "
           "%.3f GB (rows read once + written), %d threads a block, %d vectors a lane\n",
           nsrc, T, rb, E, K, (double)sent / firsts, scatter_bytes / 1e9, THREADS, DU);
    printf("%-6s %6s %10s %8s %10s\n", "mode", "blocks", "median ms", "GB/s", "vs copy");
    int bad = 0;
    for (int nb : blocks) {
        a.per_src = nb / nsrc;
        double copy_ms = 0;
        std::vector<int> order(modes);
        /* the copy first: every row's ratio is to the same blocks' copy */
        std::stable_partition(order.begin(), order.end(), [](int m) { return m == M_COPY; });
        if (order.empty() || order[0] != M_COPY)
            order.insert(order.begin(), M_COPY);
        for (int m : order) {
            std::vector<float> t(iters);
            std::vector<std::vector<float>> tend(nsrc, std::vector<float>(iters));
            for (int d = 0; d < R && !is_reduce(m); d++) /* the check sees this mode's rows */
                CK(cudaMemset(a.dst[d], 0, std::max<size_t>(cnt[d], 1) * rb));
            if (is_reduce(m)) {
                if (esize != 2) {
                    printf("%-6s %6d  (BF16 only)\n", mode_name[m], nb);
                    continue;
                }
                k_scatter<M_PLAIN><<<nb, THREADS>>>(a); /* the rows the sums read */
                CK(cudaGetLastError());
                CK(cudaMemset(a.out, 0, rows_in * rb));
            }
            for (int it = -2; it < iters; it++) {
                if (is_split(m)) { /* st[0] forks to every source's stream and joins them */
                    CK(cudaMemsetAsync(a.rctr, 0, R * sizeof(int), st[0]));
                    CK(cudaEventRecord(e0, st[0]));
                    for (int r = 0; r < nsrc; r++) {
                        args ar = a;
                        ar.r0 = r;
                        CK(cudaStreamWaitEvent(st[r], e0, 0));
                        if (m == M_RANKS)
                            k_scatter<M_RANKS><<<a.per_src, THREADS, 0, st[r]>>>(ar);
                        else {
                            const size_t v0 = copy_vec * r / nsrc, v1 = copy_vec * (r + 1) / nsrc;
                            k_copy<<<a.per_src, THREADS, 0, st[r]>>>(ca + v0, cb + v0, v1 - v0);
                        }
                        CK(cudaGetLastError());
                        CK(cudaEventRecord(ends[r], st[r]));
                        CK(cudaStreamWaitEvent(st[0], ends[r], 0));
                    }
                    CK(cudaEventRecord(e1, st[0]));
                    CK(cudaEventSynchronize(e1));
                    if (it >= 0) {
                        CK(cudaEventElapsedTime(&t[it], e0, e1));
                        for (int r = 0; r < nsrc; r++)
                            CK(cudaEventElapsedTime(&tend[r][it], e0, ends[r]));
                    }
                    continue;
                }
                if (m == M_RGRAB)
                    CK(cudaMemset(a.rctr, 0, R * sizeof(int)));
                if (it >= 0)
                    CK(cudaEventRecord(e0));
                switch (m) {
                case M_PLAIN:
                    k_scatter<M_PLAIN><<<nb, THREADS>>>(a);
                    break;
                case M_STCS:
                    k_scatter<M_STCS><<<nb, THREADS>>>(a);
                    break;
                case M_BULK:
                    k_scatter<M_BULK><<<nb, THREADS, smem>>>(a);
                    break;
                case M_WRITE:
                    k_scatter<M_WRITE><<<nb, THREADS>>>(a);
                    break;
                case M_FIRST:
                    k_scatter<M_FIRST><<<nb, THREADS>>>(a);
                    break;
                case M_PLAIN1K:
                    k_scatter<M_PLAIN1K, 1024, DU / 2><<<nb, 1024>>>(a);
                    break;
                case M_BULK1K:
                    k_scatter<M_BULK1K, 1024, DU / 2><<<nb, 1024, smem>>>(a);
                    break;
                case M_PIPE:
                    k_scatter<M_PIPE><<<nb, THREADS>>>(a);
                    break;
                case M_PIPE20:
                    k_scatter<M_PIPE20, THREADS, 20><<<nb, THREADS>>>(a);
                    break;
                case M_RGRAB:
                    k_scatter<M_RGRAB><<<nb, THREADS>>>(a);
                    break;
#define TMA_MODE(name, nw, ns, ch, lag)                                                    \
    case M_##name:                                                                         \
        k_tma<nw, ns, ch, lag><<<nb, nw * 32, tma_smem_bytes(nw, ns, ch)>>>(a);            \
        break;
                    TMA_CONFIGS(TMA_MODE)
#undef TMA_MODE
                case M_RPLAIN:
                    k_rplain<<<nb, THREADS>>>(a);
                    break;
                case M_RP44:
                    k_rplain<4, 4><<<nb, THREADS>>>(a);
                    break;
                case M_RP24:
                    k_rplain<2, 4><<<nb, THREADS>>>(a);
                    break;
#define RTMA_MODE(name, nw, ns, ch)                                                        \
    case M_##name:                                                                         \
        k_rtma<nw, ns, ch><<<nb, nw * 32, (size_t)nw * ns * (8 + ch)>>>(a);                \
        break;
                    RTMA_CONFIGS(RTMA_MODE)
#undef RTMA_MODE
#define RASYNC_MODE(name, nw, ns, vl)                                                      \
    case M_##name:                                                                         \
        k_rasync<nw, ns, vl><<<nb, nw * 32, (size_t)nw * ns * vl * 512>>>(a);              \
        break;
                    RASYNC_CONFIGS(RASYNC_MODE)
#undef RASYNC_MODE
                default:
                    k_copy<<<nb, THREADS>>>(ca, cb, copy_vec);
                    break;
                }
                CK(cudaGetLastError());
                if (it >= 0) {
                    CK(cudaEventRecord(e1));
                    CK(cudaEventSynchronize(e1));
                    CK(cudaEventElapsedTime(&t[it], e0, e1));
                }
            }
            CK(cudaDeviceSynchronize());
            std::sort(t.begin(), t.end());
            const double ms = t[iters / 2];
            const double bytes = m == M_FIRST ? first_bytes : scatter_bytes;
            char spread[64] = "";
            if (is_split(m)) {
                std::vector<float> e(nsrc);
                for (int r = 0; r < nsrc; r++) {
                    std::sort(tend[r].begin(), tend[r].end());
                    e[r] = tend[r][iters / 2];
                }
                std::sort(e.begin(), e.end());
                snprintf(spread, sizeof spread, "  sources end %.3f-%.3f ms", e[0], e[nsrc - 1]);
            }
            if (m == M_COPY)
                copy_ms = ms;
            /* the same-SM copy moves the scatter's bytes: the ratio is of times, for
             * first of rates */
            const double vs =
                m == M_FIRST ? (bytes / ms) / (scatter_bytes / copy_ms) : copy_ms / ms;
            printf("%-6s %6d %10.3f %8.0f %9.1f%%%s\n", mode_name[m], nb, ms, bytes / ms / 1e6,
                   100.0 * vs, spread);
            if (is_reduce(m)) { /* every row the sum of its copies: count x the source */
                std::vector<uint16_t> row(rb / 2);
                uint64_t s = 7;
                for (int c = 0; c < 64; c++) {
                    const size_t tok = next(&s) % rows_in;
                    int copies = 0;
                    for (int d = 0; d < R; d++)
                        copies += pos[tok * R + d] >= 0;
                    CK(cudaMemcpy(row.data(), (char *)a.out + tok * rb, rb,
                                  cudaMemcpyDeviceToHost));
                    for (size_t k = 0; k < row.size(); k++) {
                        const uint32_t w = src_word(tok * rb / 4 + k / 2);
                        const uint32_t hb = (k & 1) ? w >> 16 : w & 0xFFFFu;
                        float v, f = -0.0f;
                        const uint32_t vb = hb << 16;
                        memcpy(&v, &vb, 4);
                        for (int q = 0; q < copies; q++)
                            f += v;
                        if (row[k] != bf16_rn(f)) {
                            bad++;
                            break;
                        }
                    }
                }
            } else if (m != M_WRITE && m != M_FIRST && m != M_COPY && m != M_COPYR) {
                /* check rows at random */
                std::vector<uint32_t> row(rb / 4);
                uint64_t s = 7;
                for (int c = 0; c < 64; c++) {
                    const size_t tok = next(&s) % rows_in;
                    for (int d = 0; d < R; d++) {
                        const int p = pos[tok * R + d];
                        if (p < 0)
                            continue;
                        CK(cudaMemcpy(row.data(), a.dst[d] + (size_t)p * rb, rb,
                                      cudaMemcpyDeviceToHost));
                        for (size_t k = 0; k < row.size(); k++)
                            if (row[k] != src_word(tok * rb / 4 + k)) {
                                bad++;
                                break;
                            }
                    }
                }
            }
        }
    }
    if (bad)
        fprintf(stderr, "scatter: %d rows differ from their source\n", bad);
    else
        printf("scatter: rows checked (64 sources a mode, every destination)\n");
    return bad ? 1 : 0;
}
