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
//   pipe:   plain in passes of DU / 2 vectors a lane, the next pass's loads in flight while
//           this one is stored (the same registers); pipe20: passes of 10 vectors a lane
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o scatter bench/scatter.cu
// Run: scatter [--blocks 64,128] [--modes plain,bulk,...] [--iters 20] [--hidden 7168]
//      [--esize 2] [--tokens 4096]; prints one row per (mode, blocks) and checks the rows.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <cuda_runtime.h>

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));    \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

enum { R = 8, E = 256, K = 8, THREADS = 512, DU = 14 };
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
    M_COUNT
};
static const char *mode_name[M_COUNT] = {"plain", "stcs",    "bulk",   "write", "first",
                                         "copy",  "plain1k", "bulk1k", "pipe",  "pipe20"};

struct args {
    const uint4 *src; /* [R][T] rows */
    char *dst[R];     /* destination d's rows */
    const int *pos;   /* [R][T][R]: the row at destination d, -1 when not sent */
    int T, per_src;   /* tokens a source, blocks a source */
    int nvec;         /* 16-byte vectors a row */
};

template <int MODE, int NT = THREADS, int U = DU>
__global__ void __launch_bounds__(NT, 1) k_scatter(args a)
{
    extern __shared__ __align__(16) uint4 stage_all[];
    __shared__ int grab;
    __shared__ char *s_dst[R]; /* indexed at run time: not from the parameter bank */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = NT / 32;
    const int r = blockIdx.x / a.per_src, j = blockIdx.x % a.per_src;
    const int chunk = (a.T + a.per_src - 1) / a.per_src;
    const int t0 = min(a.T, j * chunk), t1 = min(a.T, t0 + chunk);
    if (threadIdx.x == 0)
        grab = 0;
#pragma unroll
    for (int d = 0; d < R; d++) /* constant indices: the parameters stay in their bank */
        if (threadIdx.x == d)
            s_dst[d] = a.dst[d];
    __syncthreads();
    const int passes = (a.nvec + 32 * U - 1) / (32 * U);
    const int per_pass = ((a.nvec + passes - 1) / passes + 31) & ~31;
    uint4 *stage = stage_all + warp * 32 * U;
    for (int i = t0 + warp; i < t1;) {
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
            k = atomicAdd(&grab, 1);
        i = t0 + nw + __shfl_sync(~0u, k, 0);
    }
    if (MODE == M_BULK || MODE == M_BULK1K)
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
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
    int T = 4096, H = 7168, esize = 2, iters = 20;
    std::vector<int> blocks = {64, 128};
    std::vector<int> modes;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--blocks"))
            blocks = parse_list(argv[i + 1]);
        else if (!strcmp(argv[i], "--tokens"))
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
        if (b < R || b % R) {
            fprintf(stderr, "scatter: blocks must be a multiple of %d\n", R);
            return 2;
        }
    // routing: K distinct experts of E a token; destination = expert / (E / R)
    std::vector<int> pos((size_t)R * T * R, -1);
    size_t cnt[R] = {0}, sent = 0, firsts = 0;
    uint64_t seed = 1;
    for (int r = 0; r < R; r++)
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
                mask |= 1u << (x / (E / R));
            }
            for (int d = 0; d < R; d++)
                if ((mask >> d) & 1u)
                    pos[((size_t)r * T + i) * R + d] = (int)cnt[d]++;
            sent += (size_t)__builtin_popcount(mask);
            firsts += mask != 0;
        }
    const size_t rows_in = (size_t)R * T;
    uint4 *src = NULL, *ca = NULL, *cb = NULL;
    int *dpos = NULL;
    args a;
    a.T = T, a.nvec = (int)(rb / 16);
    CK(cudaMalloc(&src, rows_in * rb));
    CK(cudaMalloc(&dpos, pos.size() * sizeof(int)));
    CK(cudaMemcpy(dpos, pos.data(), pos.size() * sizeof(int), cudaMemcpyHostToDevice));
    for (int d = 0; d < R; d++)
        CK(cudaMalloc(&a.dst[d], std::max<size_t>(cnt[d], 1) * rb));
    a.src = src, a.pos = dpos;
    {
        std::vector<uint32_t> h(rows_in * rb / 4);
        for (size_t k = 0; k < h.size(); k++)
            h[k] = (uint32_t)(k * 2654435761u);
        CK(cudaMemcpy(src, h.data(), rows_in * rb, cudaMemcpyHostToDevice));
    }
    const double scatter_bytes = (double)(firsts + sent) * rb; /* fewest bytes: read once */
    const double first_bytes = 2.0 * firsts * rb;
    const size_t copy_vec = (size_t)(scatter_bytes / 2 / 16);
    CK(cudaMalloc(&ca, copy_vec * 16));
    CK(cudaMalloc(&cb, copy_vec * 16));
    CK(cudaMemset(ca, 1, copy_vec * 16));
    const size_t smem = (size_t)(THREADS / 32) * 32 * DU * 16;
    CK(cudaFuncSetAttribute(k_scatter<M_BULK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            (int)smem));
    CK(cudaFuncSetAttribute(k_scatter<M_BULK1K, 1024, DU / 2>,
                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    printf("scatter: %d sources x %d rows of %zu B, E %d, K %d: %.2f destinations a row, "
           "%.3f GB (rows read once + written), %d threads a block, %d vectors a lane\n",
           R, T, rb, E, K, (double)sent / firsts, scatter_bytes / 1e9, THREADS, DU);
    printf("%-6s %6s %10s %8s %10s\n", "mode", "blocks", "median ms", "GB/s", "vs copy");
    int bad = 0;
    for (int nb : blocks) {
        a.per_src = nb / R;
        double copy_ms = 0;
        std::vector<int> order(modes);
        /* the copy first: every row's ratio is to the same blocks' copy */
        std::stable_partition(order.begin(), order.end(), [](int m) { return m == M_COPY; });
        if (order.empty() || order[0] != M_COPY)
            order.insert(order.begin(), M_COPY);
        for (int m : order) {
            std::vector<float> t(iters);
            for (int it = -2; it < iters; it++) {
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
            if (m == M_COPY)
                copy_ms = ms;
            /* the same-SM copy moves the scatter's bytes: the ratio is of times, for
             * first of rates */
            const double vs =
                m == M_FIRST ? (bytes / ms) / (scatter_bytes / copy_ms) : copy_ms / ms;
            printf("%-6s %6d %10.3f %8.0f %9.1f%%\n", mode_name[m], nb, ms, bytes / ms / 1e6,
                   100.0 * vs);
            if (m != M_WRITE && m != M_FIRST && m != M_COPY) { /* check rows at random */
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
                            if (row[k] != (uint32_t)((tok * rb / 4 + k) * 2654435761u)) {
                                bad++;
                                break;
                            }
                    }
                }
                CK(cudaMemset(a.dst[0], 0, rb)); /* the next mode writes it again */
            }
        }
    }
    if (bad)
        fprintf(stderr, "scatter: %d rows differ from their source\n", bad);
    else
        printf("scatter: rows checked (64 sources a mode, every destination)\n");
    return bad ? 1 : 0;
}
