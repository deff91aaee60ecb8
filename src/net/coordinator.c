/* net/coordinator.c: NIC, registrations and the remote-address table. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

#include "core/core.h"
#include "mr/mr.h"
#include "net/coordinator.h"

#define COORD_ACCESS                                                                             \
    (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |                 \
     IBV_ACCESS_RELAXED_ORDERING)

static void compose(hep_gpu_mr_ops *ops, const hep_gpu_mr_ops *o)
{
    if (!o)
        return;
    ops->ctx = o->ctx;
#define TAKE(f)                                                                                  \
    if (o->f)                                                                                    \
    ops->f = o->f
    TAKE(reg_mr);
    TAKE(reg_dmabuf_mr);
    TAKE(dereg_mr);
    TAKE(dmabuf_supported);
    TAKE(export_dmabuf);
    TAKE(page_size);
    TAKE(close_fd);
#undef TAKE
}

int hep_coord_create(const hep_plan *p, char *local_arena, const hep_bootstrap *bs,
                     int cuda_device, const hep_coord_options *o, hep_coord **out)
{
    hep_coord *c = calloc(1, sizeof(*c));
    int rc, mode = hep_env_get()->mr_mode;
    if (!c)
        return hep_fail(HEP_ERR_NOMEM, "RDMA coordinator: out of memory");
    c->world = bs->size;
    rc = o->loopback && o->windows
             ? hep_loopback_create_shared(bs->rank, bs->size, o->windows, &c->net)
         : o->loopback ? hep_loopback_create(bs->rank, bs->size, &c->net)
                       : hep_verbs_create(bs->rank, bs->size, cuda_device, &c->net);
    if (rc) {
        free(c);
        return rc;
    }
    compose(&c->net->mr_ops, o->mr_override);
    if (o->host_memory && mode == HEP_MR_MODE_DMABUF)
        mode = HEP_MR_MODE_AUTO; /* host memory has no DMA-BUF export to force */
    for (int i = 0; i < HEP_RDMA_BUF_COUNT && rc == HEP_OK; i++) {
        const hep_plan_buffer *b = &p->buf[HEP_FIRST_RDMA_BUF + i];
        if (!b->present)
            continue;
        rc = hep_gpu_mr_register_mode(&c->net->mr_ops, mode,
                                      c->net->pd, cuda_device, local_arena + b->offset, b->bytes,
                                      COORD_ACCESS, b->name, &c->mr[i]);
        if (rc == HEP_OK) {
            c->registered++;
            c->dmabuf += c->mr[i].path == HEP_MR_DMABUF;
        }
    }
    if (rc) {
        char keep[2048];
        snprintf(keep, sizeof(keep), "%s", hep_last_error());
        hep_coord_destroy(c); /* may log, never rewrites the registration's message */
        hep_set_error_text(keep);
        return rc;
    }
    *out = c;
    return HEP_OK;
}

int hep_coord_connect(hep_coord *c, const hep_bootstrap *bs)
{
    hep_remote_buf mine[HEP_RDMA_BUF_COUNT];
    int rc;
    memset(mine, 0, sizeof(mine));
    for (int i = 0; i < HEP_RDMA_BUF_COUNT; i++) {
        mine[i].addr = c->mr[i].addr; /* never ibv_mr::addr: the offset for DMA-BUF MRs */
        mine[i].length = c->mr[i].length;
        mine[i].rkey = c->mr[i].rkey;
    }
    c->remote = calloc((size_t)c->world, sizeof(mine));
    if (!c->remote)
        return hep_fail(HEP_ERR_NOMEM, "RDMA coordinator: out of memory");
    rc = bs->allgather(bs->ctx, mine, c->remote, sizeof(mine));
    if (rc == HEP_OK)
        rc = c->net->v->connect(c->net, bs);
    return rc;
}

int hep_coord_destroy(hep_coord *c)
{
    int first = HEP_OK;
    if (!c)
        return HEP_OK;
    for (int i = HEP_RDMA_BUF_COUNT - 1; i >= 0; i--) {
        int rc = hep_gpu_mr_deregister(&c->mr[i]);
        if (rc && !first)
            first = rc;
        if (rc)
            hep_log(HEP_LOG_WARN, "%s", hep_last_error());
    }
    if (c->net)
        c->net->v->destroy(c->net);
    free(c->remote);
    free(c);
    return first;
}
