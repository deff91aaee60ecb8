/* sys/ibv_table.c: libibverbs loaded with dlopen; symbols bound by version. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "core/core.h"
#include "sys.h"

static hep_ibv_table ibv_table;
static pthread_once_t ibv_once = PTHREAD_ONCE_INIT;

#ifdef HEP_NO_VERBS
/* Built without the libibverbs headers: nothing is loaded, and every verbs path says why. */
static void ibv_load(void)
{
    snprintf(ibv_table.load_error, sizeof(ibv_table.load_error),
             "this build of hybridep has no verbs NIC: the libibverbs headers (Debian: "
             "libibverbs-dev) were missing when it was built; only the loopback NIC works");
}
#else
/* rdma-core's own map file: the default version of each symbol. */
static void *bind(void *lib, const char *name, const char *version)
{
    void *p = dlvsym(lib, name, version);
    if (!p)
        hep_log(HEP_LOG_DEBUG, "libibverbs lacks %s@%s", name, version);
    return p;
}

static void ibv_load(void)
{
    const char *path = hep_env_get()->ibverbs_lib;
    hep_ibv_table *t = &ibv_table;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);

    if (!lib) {
        snprintf(t->load_error, sizeof(t->load_error),
                 "cannot load %s (%s); install rdma-core's libibverbs (Debian: libibverbs1)", path,
                 dlerror());
        return;
    }
    t->loaded = 1;
    *(void **)&t->get_device_list = bind(lib, "ibv_get_device_list", "IBVERBS_1.1");
    *(void **)&t->free_device_list = bind(lib, "ibv_free_device_list", "IBVERBS_1.1");
    *(void **)&t->get_device_name = bind(lib, "ibv_get_device_name", "IBVERBS_1.1");
    *(void **)&t->open_device = bind(lib, "ibv_open_device", "IBVERBS_1.1");
    *(void **)&t->close_device = bind(lib, "ibv_close_device", "IBVERBS_1.1");
    *(void **)&t->query_device = bind(lib, "ibv_query_device", "IBVERBS_1.1");
    *(void **)&t->query_port_compat = bind(lib, "ibv_query_port", "IBVERBS_1.1");
    *(void **)&t->query_gid = bind(lib, "ibv_query_gid", "IBVERBS_1.1");
    *(void **)&t->alloc_pd = bind(lib, "ibv_alloc_pd", "IBVERBS_1.1");
    *(void **)&t->dealloc_pd = bind(lib, "ibv_dealloc_pd", "IBVERBS_1.1");
    *(void **)&t->reg_mr = bind(lib, "ibv_reg_mr", "IBVERBS_1.1");
    *(void **)&t->reg_mr_iova2 = bind(lib, "ibv_reg_mr_iova2", "IBVERBS_1.8");
    *(void **)&t->reg_dmabuf_mr = bind(lib, "ibv_reg_dmabuf_mr", "IBVERBS_1.12");
    *(void **)&t->dereg_mr = bind(lib, "ibv_dereg_mr", "IBVERBS_1.1");
    *(void **)&t->create_cq = bind(lib, "ibv_create_cq", "IBVERBS_1.1");
    *(void **)&t->destroy_cq = bind(lib, "ibv_destroy_cq", "IBVERBS_1.1");
    *(void **)&t->create_qp = bind(lib, "ibv_create_qp", "IBVERBS_1.1");
    *(void **)&t->modify_qp = bind(lib, "ibv_modify_qp", "IBVERBS_1.1");
    *(void **)&t->destroy_qp = bind(lib, "ibv_destroy_qp", "IBVERBS_1.1");
    *(void **)&t->wc_status_str = bind(lib, "ibv_wc_status_str", "IBVERBS_1.1");
    /* The library stays loaded for the life of the process, as providers expect. */
}
#endif

const hep_ibv_table *hep_ibv(void)
{
    pthread_once(&ibv_once, ibv_load);
    return &ibv_table;
}

int hep_ibv_require(const void *fn, const char *what)
{
    const hep_ibv_table *t = hep_ibv();
    if (!t->loaded)
        return hep_fail(HEP_ERR_UNAVAILABLE, "%s is unavailable: %s", what, t->load_error);
    if (!fn)
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "%s is unavailable: %s has no such symbol (rdma-core too old?)", what,
                        hep_env_get()->ibverbs_lib);
    return HEP_OK;
}

int hep_ibv_query_port(struct ibv_context *ctx, uint8_t port, struct ibv_port_attr *attr)
{
#ifdef HEP_NO_VERBS
    (void)ctx, (void)port, (void)attr;
    return ENOSYS;
#else
    struct verbs_context *vctx = verbs_get_ctx_op(ctx, query_port);
    if (vctx)
        return vctx->query_port(ctx, port, attr, sizeof(*attr));
    if (!hep_ibv()->query_port_compat)
        return ENOSYS;
    memset(attr, 0, sizeof(*attr));
    return hep_ibv()->query_port_compat(ctx, port, attr);
#endif
}

struct ibv_mr *hep_ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access)
{
    const hep_ibv_table *t = hep_ibv();
    if ((unsigned)access & IBV_ACCESS_OPTIONAL_RANGE) {
        if (!t->reg_mr_iova2) {
            errno = EOPNOTSUPP;
            return NULL;
        }
        return t->reg_mr_iova2(pd, addr, len, (uint64_t)(uintptr_t)addr, (unsigned)access);
    }
    if (!t->reg_mr) {
        errno = EOPNOTSUPP;
        return NULL;
    }
    return t->reg_mr(pd, addr, len, access);
}
