/* sys: libibverbs and the CUDA driver API, resolved at run time (never linked).
 *
 * hep_ibv() loads libibverbs.so.1 once (HEP_IBVERBS_LIB overrides the path) and binds
 * each symbol at the version rdma-core defines for it. hep_cu() binds the CUDA driver
 * entry points through cudaGetDriverEntryPointByVersion. Both cache their answer. A
 * missing library or symbol leaves the pointer NULL: callers check at the point of use
 * with hep_ibv_require()/hep_cu_require(), which set a message naming what is missing.
 */
#ifndef HEP_SYS_H
#define HEP_SYS_H

#include <stddef.h>
#include <stdint.h>

#include <infiniband/verbs.h>

typedef struct hep_ibv_table {
    int loaded;               /* 1 when the library was opened */
    char load_error[512];     /* why it was not, else "" */
    struct ibv_device **(*get_device_list)(int *num);
    void (*free_device_list)(struct ibv_device **list);
    const char *(*get_device_name)(struct ibv_device *dev);
    struct ibv_context *(*open_device)(struct ibv_device *dev);
    int (*close_device)(struct ibv_context *ctx);
    int (*query_device)(struct ibv_context *ctx, struct ibv_device_attr *attr);
    int (*query_port_compat)(struct ibv_context *ctx, uint8_t port, struct ibv_port_attr *attr);
    int (*query_gid)(struct ibv_context *ctx, uint8_t port, int index, union ibv_gid *gid);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *ctx);
    int (*dealloc_pd)(struct ibv_pd *pd);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *pd, void *addr, size_t len, int access);
    struct ibv_mr *(*reg_mr_iova2)(struct ibv_pd *pd, void *addr, size_t len, uint64_t iova,
                                   unsigned int access);
    struct ibv_mr *(*reg_dmabuf_mr)(struct ibv_pd *pd, uint64_t offset, size_t len,
                                    uint64_t iova, int fd, int access);
    int (*dereg_mr)(struct ibv_mr *mr);
    struct ibv_cq *(*create_cq)(struct ibv_context *ctx, int cqe, void *cq_ctx,
                                struct ibv_comp_channel *ch, int vector);
    int (*destroy_cq)(struct ibv_cq *cq);
    struct ibv_qp *(*create_qp)(struct ibv_pd *pd, struct ibv_qp_init_attr *attr);
    int (*modify_qp)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask);
    int (*destroy_qp)(struct ibv_qp *qp);
    const char *(*wc_status_str)(enum ibv_wc_status status);
} hep_ibv_table;

/* The loaded table (never NULL; check ->loaded and the members you use). */
const hep_ibv_table *hep_ibv(void);
/* 0 if the table has `fn`, else HEP_ERR_UNAVAILABLE with a message naming `what`. */
int hep_ibv_require(const void *fn, const char *what);
/* ibv_query_port through the provider op when present, as rdma-core's inline does. */
int hep_ibv_query_port(struct ibv_context *ctx, uint8_t port, struct ibv_port_attr *attr);
/* ibv_reg_mr as rdma-core's header macro does: optional-range access flags (relaxed
 * ordering) go through ibv_reg_mr_iova2 (IBVERBS_1.8). NULL + errno on failure. */
struct ibv_mr *hep_ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access);

/* ---- CUDA driver API ---- */
typedef int hep_cu_result; /* CUresult */
typedef struct hep_cu_table {
    int loaded;
    char load_error[512];
    int driver_version;
    hep_cu_result (*get_error_name)(hep_cu_result r, const char **s);
    hep_cu_result (*get_error_string)(hep_cu_result r, const char **s);
    hep_cu_result (*device_get)(int *dev, int ordinal);
    hep_cu_result (*device_get_attribute)(int *v, int attrib, int dev);
    hep_cu_result (*mem_get_handle_for_address_range)(void *handle, uint64_t dptr, size_t size,
                                                     int type, unsigned long long flags);
    hep_cu_result (*pointer_get_attribute)(void *data, int attrib, uint64_t ptr);
} hep_cu_table;

const hep_cu_table *hep_cu(void);
int hep_cu_require(const void *fn, const char *what);
/* Name and description of a CUresult ("CUDA_ERROR_UNKNOWN"-style; never NULL). */
void hep_cu_error_text(hep_cu_result r, const char **name, const char **desc);

#endif
