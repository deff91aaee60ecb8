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

/* The loopback NIC's copy of len bytes between two device buffers of the current device,
 * as a kernel on `stream` (HEP_LOOPBACK_COPY=kernel): 0 or the cudaError_t of the launch. */
int hep_net_copy_async(void *dst, const void *src, size_t len, void *stream);

#ifdef __cplusplus
}
#endif
#endif
