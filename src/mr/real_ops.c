/* mr/real_ops.c: the real external calls of the registration helper. */
#include <errno.h>
#include <unistd.h>

#include "core/core.h"
#include "hybridep/gpu_mr.h"
#include "sys/sys.h"

#define CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED_ 124
#define CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD_ 1
#define CUDA_ERROR_NOT_INITIALIZED_ 3
#define CUDA_ERROR_NOT_SUPPORTED_ 801

static struct ibv_mr *real_reg_mr(void *ctx, struct ibv_pd *pd, void *addr, size_t len, int access)
{
    (void)ctx;
    if (!hep_ibv()->loaded) {
        errno = ENOSYS;
        return NULL;
    }
    return hep_ibv_reg_mr(pd, addr, len, access);
}

static struct ibv_mr *real_reg_dmabuf_mr(void *ctx, struct ibv_pd *pd, uint64_t offset, size_t len,
                                         uint64_t iova, int fd, int access)
{
    const hep_ibv_table *t = hep_ibv();
    (void)ctx;
    if (!t->reg_dmabuf_mr) {
        errno = EOPNOTSUPP; /* rdma-core older than IBVERBS_1.12 */
        return NULL;
    }
    return t->reg_dmabuf_mr(pd, offset, len, iova, fd, access);
}

static int real_dereg_mr(void *ctx, struct ibv_mr *mr)
{
    (void)ctx;
    if (!hep_ibv()->dereg_mr)
        return ENOSYS;
    return hep_ibv()->dereg_mr(mr);
}

static int real_dmabuf_supported(void *ctx, int dev)
{
    const hep_cu_table *t = hep_cu();
    int cudev = 0, v = 0;
    (void)ctx;
    if (!t->loaded || !t->device_get || t->device_get(&cudev, dev) != 0)
        return -1;
    if (t->device_get_attribute(&v, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED_, cudev) != 0)
        return -1;
    return v ? 1 : 0;
}

static int real_export_dmabuf(void *ctx, uint64_t addr, size_t len, int *fd, const char **name,
                              const char **desc)
{
    const hep_cu_table *t = hep_cu();
    int r;
    (void)ctx;
    if (!t->loaded) {
        *name = "CUDA_ERROR_NOT_INITIALIZED";
        *desc = "no CUDA driver could be loaded";
        return CUDA_ERROR_NOT_INITIALIZED_;
    }
    if (!t->mem_get_handle_for_address_range) {
        *name = "CUDA_ERROR_NOT_SUPPORTED";
        *desc = "the CUDA driver lacks cuMemGetHandleForAddressRange (needs 11.7 or newer)";
        return CUDA_ERROR_NOT_SUPPORTED_;
    }
    *fd = -1;
    r = t->mem_get_handle_for_address_range(fd, addr, len, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD_, 0);
    if (r != 0)
        hep_cu_error_text(r, name, desc);
    return r;
}

static long real_page_size(void *ctx)
{
    (void)ctx;
    return sysconf(_SC_PAGESIZE);
}

static int real_close_fd(void *ctx, int fd)
{
    (void)ctx;
    return fd >= 0 ? close(fd) : 0;
}

static const hep_gpu_mr_ops real_ops = {
    NULL,          real_reg_mr,    real_reg_dmabuf_mr, real_dereg_mr, real_dmabuf_supported,
    real_export_dmabuf, real_page_size, real_close_fd,
};

const hep_gpu_mr_ops *hep_gpu_mr_real_ops(void)
{
    return &real_ops;
}
