/* A fake external-call table for the registration helper: fails the way verbs (NULL +
 * errno) and the CUDA driver (CUresult) fail, and records every call. */
#ifndef HEP_TEST_FAKE_MR_H
#define HEP_TEST_FAKE_MR_H

#include <stdint.h>
#include <stddef.h>

#include <infiniband/verbs.h>

#include "hybridep/gpu_mr.h"

typedef struct fake_mr {
    /* behaviour */
    int legacy_errno;      /* 0: ibv_reg_mr succeeds; else NULL with this errno */
    int dmabuf_support;    /* what dmabuf_supported returns */
    int export_rc;         /* 0 or a CUresult */
    int export_fd;         /* the fd an export returns */
    int dmabuf_errno;      /* 0: ibv_reg_dmabuf_mr succeeds; else NULL with this errno */
    int dereg_rc;
    long page;
    int clobber_errno;     /* every call after reg_mr sets errno to this */
    /* records */
    int calls;             /* all calls */
    int reg_mr_calls, dmabuf_supported_calls, export_calls, reg_dmabuf_calls, dereg_calls;
    int close_calls, page_calls, closed_fd;
    int reg_mr_access, reg_dmabuf_access, reg_dmabuf_fd;
    uint64_t export_addr, reg_dmabuf_offset, reg_dmabuf_iova;
    size_t export_len, reg_dmabuf_len;
    struct ibv_mr legacy_mr, dmabuf_mr;
    hep_gpu_mr_ops ops;
} fake_mr;

void fake_mr_init(fake_mr *f);

/* Calls that force the DMA-BUF path on host memory: ibv_reg_mr fails with EFAULT, the
 * device "supports" DMA-BUF, and the export hands out a real fd (of /dev/null) so that fd
 * counting proves it is closed. Compose them over a NIC's own table. */
struct ibv_mr *force_no_legacy(void *ctx, struct ibv_pd *pd, void *a, size_t l, int acc);
int force_dmabuf_supported(void *ctx, int dev);
int force_export_devnull(void *ctx, uint64_t a, size_t l, int *fd, const char **n, const char **d);

/* A configuration with the given sizes and the defaults for the rest. */
#include "hybridep/hybridep.h"
hep_config test_config(int H, int T, int El, int K, hep_dtype dt);

#endif
