/* tools/ibv_dl.h: the doctor's own libibverbs, loaded at run time so the command runs on a
 * machine without it (the library's table is internal; this is the few calls it needs). */
#ifndef HEP_TOOLS_IBV_DL_H
#define HEP_TOOLS_IBV_DL_H

#include <infiniband/verbs.h>

typedef struct doc_ibv {
    int loaded;
    char error[256];
    struct ibv_device **(*get_device_list)(int *n);
    void (*free_device_list)(struct ibv_device **l);
    const char *(*get_device_name)(struct ibv_device *d);
    struct ibv_context *(*open_device)(struct ibv_device *d);
    int (*close_device)(struct ibv_context *c);
    int (*query_device)(struct ibv_context *c, struct ibv_device_attr *a);
    int (*query_port_compat)(struct ibv_context *c, uint8_t port, struct ibv_port_attr *a);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *c);
    int (*dealloc_pd)(struct ibv_pd *pd);
} doc_ibv;

/* Load once ($HEP_IBVERBS_LIB or libibverbs.so.1); loaded = 0 with error when absent. */
const doc_ibv *doc_ibv_get(void);
/* ibv_query_port through the provider's extended op when there is one (the inline of
 * verbs.h), else the exported compat symbol. 0 or an errno value. */
int doc_ibv_query_port(const doc_ibv *t, struct ibv_context *c, uint8_t port,
                       struct ibv_port_attr *a);

#endif
