/* tools/ibv_dl.c: see ibv_dl.h. */
#define _GNU_SOURCE /* dlvsym */
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ibv_dl.h"

static doc_ibv table;

/* versioned where rdma-core versions them, so an old or odd build cannot bind wrongly */
static void *bind(void *lib, const char *name, int *missing)
{
    void *p = dlvsym(lib, name, "IBVERBS_1.1");
    if (!p)
        p = dlsym(lib, name);
    if (!p)
        *missing = 1;
    return p;
}

const doc_ibv *doc_ibv_get(void)
{
    const char *path = getenv("HEP_IBVERBS_LIB");
    void *lib;
    int missing = 0;
    if (table.loaded || table.error[0])
        return &table;
    lib = dlopen(path && *path ? path : "libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(table.error, sizeof(table.error), "libibverbs is not installed (%s)", dlerror());
        return &table;
    }
    *(void **)&table.get_device_list = bind(lib, "ibv_get_device_list", &missing);
    *(void **)&table.free_device_list = bind(lib, "ibv_free_device_list", &missing);
    *(void **)&table.get_device_name = bind(lib, "ibv_get_device_name", &missing);
    *(void **)&table.open_device = bind(lib, "ibv_open_device", &missing);
    *(void **)&table.close_device = bind(lib, "ibv_close_device", &missing);
    *(void **)&table.query_device = bind(lib, "ibv_query_device", &missing);
    *(void **)&table.query_port_compat = bind(lib, "ibv_query_port", &missing);
    *(void **)&table.alloc_pd = bind(lib, "ibv_alloc_pd", &missing);
    *(void **)&table.dealloc_pd = bind(lib, "ibv_dealloc_pd", &missing);
    if (missing) {
        snprintf(table.error, sizeof(table.error), "libibverbs lacks a basic verbs symbol");
        return &table;
    }
    table.loaded = 1;
    return &table;
}

int doc_ibv_query_port(const doc_ibv *t, struct ibv_context *c, uint8_t port,
                       struct ibv_port_attr *a)
{
    struct verbs_context *vctx = verbs_get_ctx_op(c, query_port);
    if (vctx)
        return vctx->query_port(c, port, a, sizeof(*a));
    memset(a, 0, sizeof(*a));
    return t->query_port_compat ? t->query_port_compat(c, port, a) : ENOSYS;
}
