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

#ifdef __cplusplus
}
#endif
#endif
