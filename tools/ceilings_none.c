/* tools/ceilings_none.c: the ceilings of a build without CUDA: there is nothing to measure. */
#include <stdio.h>

#include "ceilings.h"

#define NO_CUDA "this hybridep command was built without CUDA"

int ceil_whole_gpu(int device, bench_ceilings *out, char *why, size_t why_len)
{
    (void)device, (void)out;
    snprintf(why, why_len, NO_CUDA);
    return -1;
}

int ceil_same_sm_copy(int device, int blocks, size_t rows, size_t row_bytes, int iters,
                      double *ms, char *why, size_t why_len)
{
    (void)device, (void)blocks, (void)rows, (void)row_bytes, (void)iters, (void)ms;
    snprintf(why, why_len, NO_CUDA);
    return -1;
}

int ceil_stream_copies(int device, int streams, size_t bytes, int iters, double *gbs, char *why,
                       size_t why_len)
{
    (void)device, (void)streams, (void)bytes, (void)iters, (void)gbs;
    snprintf(why, why_len, NO_CUDA);
    return -1;
}

int ceil_sm_count(int device, char *why, size_t why_len)
{
    (void)device;
    snprintf(why, why_len, NO_CUDA);
    return -1;
}

int ceil_gather_rows(const void *src, void *dst, const int *map, size_t rows, size_t row_bytes,
                     int blocks, void *stream)
{
    (void)src, (void)dst, (void)map, (void)rows, (void)row_bytes, (void)blocks, (void)stream;
    return -1;
}
