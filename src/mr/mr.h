/* mr: GPU memory registration (internal side of hybridep/gpu_mr.h). */
#ifndef HEP_MR_H
#define HEP_MR_H

#include "core/core.h"
#include "hybridep/gpu_mr.h"

/* hep_gpu_mr_register with an explicit policy (a hep_mr_mode) instead of HEP_GPU_MR_MODE:
 * the doctor probes each path on its own with it. */
int hep_gpu_mr_register_mode(const hep_gpu_mr_ops *ops, int mode, struct ibv_pd *pd,
                             int cuda_device, void *addr, size_t len, int access, const char *name,
                             hep_gpu_mr *out);

#endif
