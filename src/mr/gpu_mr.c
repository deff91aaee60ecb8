/* mr/gpu_mr.c: the checked registration helper (see hybridep/gpu_mr.h). */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <infiniband/verbs.h>

#include "core/core.h"
#include "hybridep/gpu_mr.h"
#include "mr/mr.h"

/* What the legacy attempt left behind, for every later message. */
typedef struct legacy_result {
    int tried;
    int err; /* errno of ibv_reg_mr, copied before any other call */
    char text[256];
} legacy_result;

static void legacy_describe(legacy_result *lr)
{
    const char *hint = lr->err == ENOMEM ? "; raise the locked-memory limit (ulimit -l, "
                                            "RLIMIT_MEMLOCK)"
                                          : "";
    if (!lr->tried)
        snprintf(lr->text, sizeof(lr->text),
                 "ibv_reg_mr not attempted (HEP_GPU_MR_MODE=dmabuf)");
    else
        snprintf(lr->text, sizeof(lr->text), "ibv_reg_mr failed: %s (errno %d)%s",
                 strerror(lr->err), lr->err, hint);
}

static int check_args(struct ibv_pd *pd, void *addr, size_t len, hep_gpu_mr *out,
                      const char *name)
{
    if (!out)
        return hep_fail(HEP_ERR_INVALID, "GPU buffer '%s': output struct is NULL", name);
    if (!pd)
        return hep_fail(HEP_ERR_INVALID, "GPU buffer '%s': protection domain is NULL", name);
    if (!addr)
        return hep_fail(HEP_ERR_INVALID, "GPU buffer '%s': address is NULL", name);
    if (len == 0)
        return hep_fail(HEP_ERR_INVALID, "GPU buffer '%s': length is 0", name);
    if ((uint64_t)(uintptr_t)addr > UINT64_MAX - len)
        return hep_fail(HEP_ERR_INVALID,
                        "GPU buffer '%s': range address=%p length=%zu wraps around", name, addr,
                        len);
    return HEP_OK;
}

/* [align_down(addr), align_up(addr + len)) without overflow. */
static int export_range(const char *name, uint64_t addr, size_t len, long page, uint64_t *start,
                        size_t *size)
{
    uint64_t p = (uint64_t)page;
    uint64_t end = addr + len; /* no wrap: checked by check_args */
    if (page <= 0 || (p & (p - 1)) != 0)
        return hep_fail(HEP_ERR_INVALID, "GPU buffer '%s': host page size %ld is not a power of two",
                        name, page);
    if (end > UINT64_MAX - (p - 1))
        return hep_fail(HEP_ERR_INVALID,
                        "GPU buffer '%s': address=0x%llx length=%zu: page-aligned end overflows",
                        name, (unsigned long long)addr, len);
    *start = addr & ~(p - 1);
    *size = (size_t)(((end + p - 1) & ~(p - 1)) - *start);
    return HEP_OK;
}

static int try_legacy(const hep_gpu_mr_ops *ops, struct ibv_pd *pd, void *addr, size_t len,
                      int access, legacy_result *lr, struct ibv_mr **mr)
{
    errno = 0;
    *mr = ops->reg_mr(ops->ctx, pd, addr, len, access);
    lr->tried = 1;
    lr->err = errno; /* copied at once: every later call may overwrite errno */
    if (*mr)
        return 1;
    if (lr->err == 0)
        lr->err = EIO; /* a provider that failed without errno */
    return 0;
}

static int register_dmabuf(const hep_gpu_mr_ops *ops, struct ibv_pd *pd, int dev, uint64_t addr,
                           size_t len, int access, const char *name, const legacy_result *lr,
                           hep_gpu_mr *out)
{
    const char *cu_name = NULL, *cu_desc = NULL;
    uint64_t start = 0;
    size_t size = 0;
    int fd = -1, supported, rc, verr;
    struct ibv_mr *mr;

    supported = ops->dmabuf_supported(ops->ctx, dev);
    if (supported != 1)
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "cannot register GPU buffer '%s' (address=0x%llx length=%zu): %s; and "
                        "CUDA device %d %s DMA-BUF",
                        name, (unsigned long long)addr, len, lr->text, dev,
                        supported == 0 ? "does not support" : "could not be queried for");
    rc = export_range(name, addr, len, ops->page_size(ops->ctx), &start, &size);
    if (rc)
        return rc;
    rc = ops->export_dmabuf(ops->ctx, start, size, &fd, &cu_name, &cu_desc);
    if (rc != 0)
        return hep_fail(HEP_ERR_CUDA,
                        "cannot DMA-BUF export GPU buffer '%s' (address=0x%llx length=%zu, "
                        "exported range 0x%llx+%zu): %s: %s; %s",
                        name, (unsigned long long)addr, len, (unsigned long long)start, size,
                        cu_name ? cu_name : "CUDA_ERROR_UNKNOWN",
                        cu_desc ? cu_desc : "unknown CUDA error", lr->text);
    if (fd < 0)
        return hep_fail(HEP_ERR_CUDA,
                        "DMA-BUF export of GPU buffer '%s' reported success but no fd; %s", name,
                        lr->text);
    errno = 0;
    mr = ops->reg_dmabuf_mr(ops->ctx, pd, 0, size, start, fd, access);
    verr = errno ? errno : EIO;
    ops->close_fd(ops->ctx, fd); /* the MR holds its own reference to the DMA-BUF */
    fd = -1;
    if (!mr)
        return hep_fail(HEP_ERR_VERBS,
                        "cannot register DMA-BUF of GPU buffer '%s' (address=0x%llx length=%zu, "
                        "exported range 0x%llx+%zu): ibv_reg_dmabuf_mr failed: %s (errno %d)%s; %s",
                        name, (unsigned long long)addr, len, (unsigned long long)start, size,
                        strerror(verr), verr,
                        verr == ENOMEM ? "; raise the locked-memory limit (ulimit -l)" : "",
                        lr->text);
    out->export_addr = start;
    out->export_length = size;
    out->path = HEP_MR_DMABUF;
    out->mr = mr;
    return HEP_OK;
}

int hep_gpu_mr_register(const hep_gpu_mr_ops *ops, struct ibv_pd *pd, int cuda_device, void *addr,
                        size_t len, int access, const char *name, hep_gpu_mr *out)
{
    return hep_gpu_mr_register_mode(ops, hep_env_get()->mr_mode, pd, cuda_device, addr, len,
                                    access, name, out);
}

int hep_gpu_mr_register_path(const hep_gpu_mr_ops *ops, hep_mr_path path, struct ibv_pd *pd,
                             int cuda_device, void *addr, size_t len, int access,
                             const char *name, hep_gpu_mr *out)
{
    if (path != HEP_MR_LEGACY && path != HEP_MR_DMABUF)
        return hep_fail(HEP_ERR_INVALID, "hep_gpu_mr_register_path: path %d is not "
                        "HEP_MR_LEGACY or HEP_MR_DMABUF", (int)path);
    return hep_gpu_mr_register_mode(ops, path == HEP_MR_LEGACY ? HEP_MR_MODE_LEGACY
                                                               : HEP_MR_MODE_DMABUF,
                                    pd, cuda_device, addr, len, access, name, out);
}

int hep_gpu_mr_register_mode(const hep_gpu_mr_ops *ops, int mode, struct ibv_pd *pd,
                             int cuda_device, void *addr, size_t len, int access, const char *name,
                             hep_gpu_mr *out)
{
    legacy_result lr = {0, 0, ""};
    struct ibv_mr *mr = NULL;
    int rc;

    if (!name)
        name = "(unnamed)";
    rc = check_args(pd, addr, len, out, name);
    if (rc)
        return rc;
    memset(out, 0, sizeof(*out));
    if (!ops)
        ops = hep_gpu_mr_real_ops();
    out->addr = (uint64_t)(uintptr_t)addr;
    out->length = len;
    out->ops = ops;

    if (mode != HEP_MR_MODE_DMABUF && try_legacy(ops, pd, addr, len, access, &lr, &mr)) {
        out->path = HEP_MR_LEGACY;
        out->mr = mr;
    } else {
        legacy_describe(&lr);
        if (mode == HEP_MR_MODE_LEGACY) {
            memset(out, 0, sizeof(*out));
            return hep_fail(HEP_ERR_VERBS,
                            "cannot register GPU buffer '%s' (address=%p length=%zu): %s; DMA-BUF "
                            "fallback disabled (HEP_GPU_MR_MODE=legacy)",
                            name, addr, len, lr.text);
        }
        rc = register_dmabuf(ops, pd, cuda_device, out->addr, len, access, name, &lr, out);
        if (rc) {
            memset(out, 0, sizeof(*out));
            return rc;
        }
    }
    out->lkey = out->mr->lkey;
    out->rkey = out->mr->rkey;
    hep_log(HEP_LOG_DEBUG,
            "registered GPU buffer '%s' on the %s path: buffer 0x%llx+%zu, exported 0x%llx+%zu, "
            "lkey 0x%x rkey 0x%x",
            name, hep_gpu_mr_path_name(out->path), (unsigned long long)out->addr, out->length,
            (unsigned long long)out->export_addr, out->export_length, out->lkey, out->rkey);
    return HEP_OK;
}

int hep_gpu_mr_deregister(hep_gpu_mr *mr)
{
    int rc;
    const hep_gpu_mr_ops *ops;
    uint64_t addr;

    if (!mr || !mr->mr)
        return HEP_OK;
    ops = mr->ops ? mr->ops : hep_gpu_mr_real_ops();
    addr = mr->addr;
    rc = ops->dereg_mr(ops->ctx, mr->mr);
    memset(mr, 0, sizeof(*mr));
    if (rc != 0)
        return hep_fail(HEP_ERR_VERBS, "ibv_dereg_mr of GPU buffer at 0x%llx failed: %s (errno %d)",
                        (unsigned long long)addr, strerror(rc), rc);
    return HEP_OK;
}

const char *hep_gpu_mr_path_name(hep_mr_path path)
{
    return path == HEP_MR_DMABUF ? "dmabuf" : path == HEP_MR_LEGACY ? "legacy" : "none";
}
