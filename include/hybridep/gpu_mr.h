/* hybridep/gpu_mr.h: register one GPU buffer for RDMA, legacy first, DMA-BUF second.
 *
 * Usable on its own by any RDMA code. hep_gpu_mr_register() tries ibv_reg_mr (the
 * nvidia_peermem path); when that fails it exports the buffer's enclosing host-page
 * range as a DMA-BUF (cuMemGetHandleForAddressRange) and registers it with
 * ibv_reg_dmabuf_mr, with the exported range as its iova. Either way the result keeps
 * the ORIGINAL CUDA address and length: put those in work requests and in the remote
 * addresses you exchange, never ibv_mr::addr (rdma-core sets that to the offset for a
 * DMA-BUF MR).
 *
 * HEP_GPU_MR_MODE selects the policy: auto (default: legacy, then DMA-BUF), dmabuf
 * (skip the legacy attempt), legacy (no fallback).
 */
#ifndef HYBRIDEP_GPU_MR_H
#define HYBRIDEP_GPU_MR_H

#include <stddef.h>
#include <stdint.h>

#include "hybridep/status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ibv_pd;
struct ibv_mr;

typedef enum { HEP_MR_LEGACY = 1, HEP_MR_DMABUF = 2 } hep_mr_path;

/* The external calls. A NULL table means the real ones (libibverbs and the CUDA driver,
 * loaded at run time). Tests and foreign transports pass their own. */
typedef struct hep_gpu_mr_ops {
    void *ctx; /* passed back as the first argument of each call */
    /* NULL + errno on failure, like ibv_reg_mr */
    struct ibv_mr *(*reg_mr)(void *ctx, struct ibv_pd *pd, void *addr, size_t len, int access);
    /* NULL + errno on failure, like ibv_reg_dmabuf_mr */
    struct ibv_mr *(*reg_dmabuf_mr)(void *ctx, struct ibv_pd *pd, uint64_t offset, size_t len,
                                    uint64_t iova, int fd, int access);
    int (*dereg_mr)(void *ctx, struct ibv_mr *mr);       /* 0 or an errno value */
    int (*dmabuf_supported)(void *ctx, int cuda_device); /* 1 yes, 0 no, -1 query failed */
    /* 0 or a CUresult; on failure *cuda_err_name / *cuda_err_desc may be set */
    int (*export_dmabuf)(void *ctx, uint64_t addr, size_t len, int *fd,
                         const char **cuda_err_name, const char **cuda_err_desc);
    long (*page_size)(void *ctx);
    int (*close_fd)(void *ctx, int fd);
} hep_gpu_mr_ops;

typedef struct hep_gpu_mr {
    uint64_t addr;
    size_t length; /* the original CUDA buffer */
    uint64_t export_addr;
    size_t export_length; /* the exported DMA-BUF range; 0 on the legacy path */
    uint32_t lkey, rkey;
    hep_mr_path path;
    struct ibv_mr *mr;
    const hep_gpu_mr_ops *ops;
} hep_gpu_mr;

/* Register [addr, addr + len) of CUDA device `cuda_device` in `pd` with `access`
 * (IBV_ACCESS_* flags, passed unchanged to verbs). `name` names the buffer in messages
 * (may be NULL). On success fills *out and returns 0; the caller owns the registration
 * and releases it with hep_gpu_mr_deregister(). On failure returns a nonzero hep_status
 * with hep_last_error() set, *out is zeroed, and nothing is left registered or open.
 * Errors: HEP_ERR_INVALID (NULL pd/addr/out, zero length, a range that wraps, a page
 * size that is not a power of two, an aligned range that overflows), HEP_ERR_VERBS
 * (legacy failed with no fallback, or ibv_reg_dmabuf_mr failed), HEP_ERR_UNAVAILABLE
 * (the device lacks DMA-BUF), HEP_ERR_CUDA (the export failed). */
int hep_gpu_mr_register(const hep_gpu_mr_ops *ops, struct ibv_pd *pd, int cuda_device, void *addr,
                        size_t len, int access, const char *name, hep_gpu_mr *out);

/* hep_gpu_mr_register on one path only, whatever HEP_GPU_MR_MODE says: HEP_MR_LEGACY
 * (ibv_reg_mr, no fallback) or HEP_MR_DMABUF (the export and ibv_reg_dmabuf_mr, no
 * ibv_reg_mr first). For diagnostics that test each path on its own. */
int hep_gpu_mr_register_path(const hep_gpu_mr_ops *ops, hep_mr_path path, struct ibv_pd *pd,
                             int cuda_device, void *addr, size_t len, int access,
                             const char *name, hep_gpu_mr *out);

/* Release a registration made by hep_gpu_mr_register (one dereg_mr call). A zeroed or
 * already released struct is accepted and returns 0. On failure returns HEP_ERR_VERBS with
 * a message; the struct is cleared either way. */
int hep_gpu_mr_deregister(hep_gpu_mr *mr);

/* The real table (libibverbs + CUDA driver); never NULL. */
const hep_gpu_mr_ops *hep_gpu_mr_real_ops(void);

/* "legacy" or "dmabuf". */
const char *hep_gpu_mr_path_name(hep_mr_path path);

#ifdef __cplusplus
}
#endif
#endif
