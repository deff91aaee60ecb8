// bench/first_launch.cu: does a kernel's first launch in a process hold back work that was
// launched after it on other streams until the kernels already running have finished?
// That is what a group's first call met (bench/RESULTS.md, "2026-12-02"): co-dependent
// kernels, one of which started only after the others gave up waiting for it.
//
// One run is one fresh process and one mode. k_spin waits on stream A (bounded, 2 s) for
// a flag that k_set raises from stream B. Between their launches a third kernel, k_other,
// goes on stream A behind k_spin (as a copy kernel follows a dispatch kernel):
//   warm:      k_other was launched once before (what group creation does now)
//   preloaded: k_other was only loaded (cudaFuncGetAttributes), never launched
//   cold:      k_other neither loaded nor launched
//   none:      no k_other at all
//   newstream: no k_other; k_set goes on a stream made at the start and never used before
//   smem_preloaded, smem_warm: as preloaded and warm, k_other with 100 KB of dynamic
//              shared memory (its attribute set before k_spin's launch in both)
// k_set is launched once before the test in every mode. Prints whether k_spin saw the flag
// and how long it waited. Build: nvcc -O2 -gencode=arch=compute_90,code=sm_90 -o
// first_launch bench/first_launch.cu; run: first_launch MODE.
#include <cstdio>
#include <cstring>

#include <cuda_runtime.h>

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                           \
            return 2;                                                                          \
        }                                                                                      \
    } while (0)

__device__ unsigned long long now_ns()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void k_spin(const volatile int *flag, unsigned long long limit_ns,
                       unsigned long long *out)
{
    const unsigned long long t0 = now_ns();
    unsigned long long t = t0;
    while (!*flag && (t = now_ns()) - t0 < limit_ns)
        ;
    out[0] = *flag;
    out[1] = t - t0;
}

__global__ void k_set(volatile int *flag)
{
    if (flag)
        *flag = 1;
}

__global__ void k_other(int *x)
{
    extern __shared__ int sh[];
    if (x) {
        sh[threadIdx.x] = x[threadIdx.x];
        x[threadIdx.x] = sh[threadIdx.x ^ 1] + 1;
    }
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "cold";
    const bool big = !strncmp(mode, "smem_", 5);
    const char *m = big ? mode + 5 : mode;
    const size_t smem = big ? 100 * 1024 : 0;
    const bool fresh = !strcmp(m, "newstream");
    if ((strcmp(m, "warm") && strcmp(m, "preloaded") && strcmp(m, "cold") &&
         strcmp(m, "none") && !fresh) || (big && strcmp(m, "warm") && strcmp(m, "preloaded"))) {
        fprintf(stderr, "usage: first_launch warm|preloaded|cold|none|newstream|smem_warm|"
                        "smem_preloaded\n");
        return 2;
    }
    int *flag = NULL;
    unsigned long long *out = NULL, h[2] = {0, 0};
    cudaStream_t a, b, c;
    CK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking));
    CK(cudaMalloc(&flag, sizeof(int)));
    CK(cudaMalloc(&out, sizeof(h)));
    k_set<<<1, 32, 0, fresh ? c : b>>>(NULL); /* k_set is warm in every mode */
    if (big)
        CK(cudaFuncSetAttribute(k_other, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)smem));
    if (!strcmp(m, "warm"))
        k_other<<<1, 32, smem, b>>>(NULL);
    if (!strcmp(m, "preloaded")) {
        cudaFuncAttributes fa;
        CK(cudaFuncGetAttributes(&fa, (const void *)k_other));
    }
    CK(cudaMemset(flag, 0, sizeof(int)));
    CK(cudaDeviceSynchronize());
    k_spin<<<1, 32, 0, a>>>(flag, 2000000000ull, out);
    if (strcmp(m, "none") && !fresh)
        k_other<<<1, 32, smem, a>>>(NULL);
    k_set<<<1, 32, 0, b>>>(flag);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost));
    printf("first_launch %-9s: k_spin %s the flag after %.3f ms\n", mode,
           h[0] ? "saw" : "never saw", (double)h[1] / 1e6);
    return h[0] ? 0 : 1;
}
