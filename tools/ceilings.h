/* tools/ceilings.h: the bench's memory ceilings, measured in the same run. The kernels
 * live in the tool (tools/ceilings.cu), not in the library: they are a yardstick, not
 * part of hybridep. Without CUDA (tools/ceilings_none.c) each returns -1. */
#ifndef HEP_TOOLS_CEILINGS_H
#define HEP_TOOLS_CEILINGS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bench_ceilings {
    double copy, write, read; /* GB/s over the whole GPU: D2D copy (read + write), memset,
                                 streaming read kernel */
} bench_ceilings;

/* Whole-GPU ceilings of `device` over 2 GiB, medians of 11 runs. 0, or -1 with why. */
int ceil_whole_gpu(int device, bench_ceilings *out, char *why, size_t why_len);

/* The same-SM copy: `blocks` blocks of 1024 threads, a warp per row, eight 16-byte loads
 * in flight per lane, copying `rows` rows of `row_bytes` (a multiple of 16) on `device`.
 * *ms is the median of `iters` timed runs after one warm-up. 0, or -1 with why. */
int ceil_same_sm_copy(int device, int blocks, size_t rows, size_t row_bytes, int iters,
                      double *ms, char *why, size_t why_len);

/* The loopback NIC's yardstick: `streams` streams each copying `bytes` device to device
 * (cudaMemcpyAsync) at once on `device`, SMs idle. *gbs counts every stream's bytes read +
 * written over the median time of `iters` runs. 0, or -1 with why. */
int ceil_stream_copies(int device, int streams, size_t bytes, int iters, double *gbs, char *why,
                       size_t why_len);

/* The separate gather into expert order that a rank-major dispatch needs: on `stream`,
 * dst row p = src row map[p] (device int [rows]; < 0: a zero row), `blocks` blocks of
 * 1024 threads. 0 or a cudaError_t of the launch (no CUDA: -1). */
int ceil_gather_rows(const void *src, void *dst, const int *map, size_t rows, size_t row_bytes,
                     int blocks, void *stream);

/* SMs of `device`, or -1 with why. */
int ceil_sm_count(int device, char *why, size_t why_len);

#ifdef __cplusplus
}
#endif
#endif
