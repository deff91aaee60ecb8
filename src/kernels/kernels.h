/* kernels: the CUDA side of hybridep, called from C through these entry points. */
#ifndef HEP_KERNELS_H
#define HEP_KERNELS_H

#include <stddef.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Launch a tiny kernel on `device` and check its answer: 0 when this build's kernels run
 * there, else -1 with the reason in why. */
int hep_kernels_probe(int device, char *why, size_t why_len);

/* One empty kernel on `stream` (a cudaStream_t of the current device), waited for: a new
 * stream's first kernel then runs before the stream is handed out (bootstrap/stream.c). 0
 * or a cudaError_t. */
int hep_stream_touch(void *stream);

#ifdef __cplusplus
}
#endif
#endif
