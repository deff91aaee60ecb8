#include <errno.h>
#include <fcntl.h>
#include <string.h>

#include "fake_mr.h"

static void clobber(fake_mr *f)
{
    f->calls++;
    if (f->clobber_errno)
        errno = f->clobber_errno;
}

static struct ibv_mr *f_reg_mr(void *ctx, struct ibv_pd *pd, void *addr, size_t len, int access)
{
    fake_mr *f = ctx;
    (void)pd;
    f->calls++;
    f->reg_mr_calls++;
    f->reg_mr_access = access;
    if (f->legacy_errno) {
        errno = f->legacy_errno;
        return NULL;
    }
    f->legacy_mr.addr = addr;
    f->legacy_mr.length = len;
    return &f->legacy_mr;
}

static struct ibv_mr *f_reg_dmabuf_mr(void *ctx, struct ibv_pd *pd, uint64_t offset, size_t len,
                                      uint64_t iova, int fd, int access)
{
    fake_mr *f = ctx;
    (void)pd;
    clobber(f);
    f->reg_dmabuf_calls++;
    f->reg_dmabuf_offset = offset;
    f->reg_dmabuf_len = len;
    f->reg_dmabuf_iova = iova;
    f->reg_dmabuf_fd = fd;
    f->reg_dmabuf_access = access;
    if (f->dmabuf_errno) {
        errno = f->dmabuf_errno;
        return NULL;
    }
    /* rdma-core reports the offset, not the VA, as addr of a DMA-BUF MR */
    f->dmabuf_mr.addr = (void *)(uintptr_t)offset;
    f->dmabuf_mr.length = len;
    return &f->dmabuf_mr;
}

static int f_dereg_mr(void *ctx, struct ibv_mr *mr)
{
    fake_mr *f = ctx;
    (void)mr;
    clobber(f);
    f->dereg_calls++;
    return f->dereg_rc;
}

static int f_dmabuf_supported(void *ctx, int dev)
{
    fake_mr *f = ctx;
    (void)dev;
    clobber(f);
    f->dmabuf_supported_calls++;
    return f->dmabuf_support;
}

static int f_export(void *ctx, uint64_t addr, size_t len, int *fd, const char **name,
                    const char **desc)
{
    fake_mr *f = ctx;
    clobber(f);
    f->export_calls++;
    f->export_addr = addr;
    f->export_len = len;
    if (f->export_rc) {
        *name = "CUDA_ERROR_INVALID_VALUE";
        *desc = "invalid argument";
        return f->export_rc;
    }
    *fd = f->export_fd;
    return 0;
}

static long f_page_size(void *ctx)
{
    fake_mr *f = ctx;
    clobber(f);
    f->page_calls++;
    return f->page;
}

static int f_close(void *ctx, int fd)
{
    fake_mr *f = ctx;
    clobber(f);
    f->close_calls++;
    f->closed_fd = fd;
    return 0;
}

void fake_mr_init(fake_mr *f)
{
    memset(f, 0, sizeof(*f));
    f->dmabuf_support = 1;
    f->export_fd = 42;
    f->page = 4096;
    f->legacy_mr.lkey = 0x11;
    f->legacy_mr.rkey = 0x22;
    f->dmabuf_mr.lkey = 0x33;
    f->dmabuf_mr.rkey = 0x44;
    f->ops.ctx = f;
    f->ops.reg_mr = f_reg_mr;
    f->ops.reg_dmabuf_mr = f_reg_dmabuf_mr;
    f->ops.dereg_mr = f_dereg_mr;
    f->ops.dmabuf_supported = f_dmabuf_supported;
    f->ops.export_dmabuf = f_export;
    f->ops.page_size = f_page_size;
    f->ops.close_fd = f_close;
}

struct ibv_mr *force_no_legacy(void *ctx, struct ibv_pd *pd, void *a, size_t l, int acc)
{
    (void)ctx, (void)pd, (void)a, (void)l, (void)acc;
    errno = EFAULT;
    return NULL;
}

int force_dmabuf_supported(void *ctx, int dev)
{
    (void)ctx, (void)dev;
    return 1;
}

int force_export_devnull(void *ctx, uint64_t a, size_t l, int *fd, const char **n, const char **d)
{
    (void)ctx, (void)a, (void)l, (void)n, (void)d;
    *fd = open("/dev/null", O_RDONLY);
    return *fd >= 0 ? 0 : 1;
}

hep_config test_config(int H, int T, int El, int K, hep_dtype dt)
{
    hep_config c;
    hep_config_default(&c);
    c.hidden = H;
    c.max_tokens = T;
    c.experts_per_rank = El;
    c.max_topk = K;
    c.dtype = dt;
    return c;
}
