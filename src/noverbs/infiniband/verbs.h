/* noverbs/infiniband/verbs.h: a stand-in for rdma-core's header, used only when the real
 * one (Debian: libibverbs-dev) is missing at build time. Such a build leaves the verbs NIC
 * out (HEP_NO_VERBS): nothing of it ever calls a libibverbs, so these declarations only
 * have to carry what the loopback NIC, the registration helper and their tests use; they
 * are not rdma-core's ABI and must never be passed to a real libibverbs. */
#ifndef HEP_NOVERBS_VERBS_H
#define HEP_NOVERBS_VERBS_H

#include <stddef.h>
#include <stdint.h>

#ifndef HEP_NO_VERBS
#error "the stand-in verbs.h is for builds without libibverbs headers (HEP_NO_VERBS) only"
#endif

struct ibv_device;
struct ibv_device_attr;
struct ibv_port_attr;
struct ibv_comp_channel;
struct ibv_cq;
struct ibv_qp;
struct ibv_qp_init_attr;
struct ibv_qp_attr;

struct ibv_context {
    struct ibv_device *device;
};

struct ibv_pd {
    struct ibv_context *context;
    uint32_t handle;
};

struct ibv_mr {
    struct ibv_context *context;
    struct ibv_pd *pd;
    void *addr;
    size_t length;
    uint32_t handle;
    uint32_t lkey;
    uint32_t rkey;
};

union ibv_gid {
    uint8_t raw[16];
    struct {
        uint64_t subnet_prefix;
        uint64_t interface_id;
    } global;
};

enum ibv_wc_status { IBV_WC_SUCCESS = 0 };

enum ibv_access_flags {
    IBV_ACCESS_LOCAL_WRITE = 1,
    IBV_ACCESS_REMOTE_WRITE = 1 << 1,
    IBV_ACCESS_REMOTE_READ = 1 << 2,
    IBV_ACCESS_REMOTE_ATOMIC = 1 << 3,
    IBV_ACCESS_RELAXED_ORDERING = 1 << 20,
};
#define IBV_ACCESS_OPTIONAL_RANGE 0x3ff00000

#endif
