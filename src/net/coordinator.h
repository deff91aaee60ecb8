/* net/coordinator.h: the RDMA coordinator of a group with N > 1 nodes. It owns the NIC,
 * the registrations of the 14 inter-node buffers (through hep_gpu_mr_register) and the
 * table of every rank's remote keys and ORIGINAL buffer addresses. */
#ifndef HEP_NET_COORDINATOR_H
#define HEP_NET_COORDINATOR_H

#include "layout/plan.h"
#include "net/net.h"

typedef struct hep_remote_buf {
    uint64_t addr; /* original CUDA (or host) address: what work requests target */
    uint64_t length;
    uint32_t rkey, pad;
} hep_remote_buf;

typedef struct hep_coord {
    hep_net *net;
    hep_gpu_mr mr[HEP_RDMA_BUF_COUNT];
    int registered, dmabuf;
    hep_remote_buf *remote; /* [world][HEP_RDMA_BUF_COUNT] */
    int world;
} hep_coord;

typedef struct hep_coord_options {
    int loopback;                    /* 1: the loopback NIC; 0: a real RDMA device */
    const hep_gpu_mr_ops *mr_override; /* non-NULL members replace the NIC's (tests) */
    int host_memory;                 /* 1: the buffers are host memory (the host backend):
                                        HEP_GPU_MR_MODE=dmabuf, about GPU memory, acts as
                                        auto (ibv_reg_mr first) */
    const hep_loopback_window *windows; /* non-NULL ([world]): the loopback NIC across the
                                           processes of one host (hep_loopback_create_shared) */
} hep_coord_options;

/* Open the NIC, register every RDMA buffer of the plan that lies in `local_arena`. Not
 * collective; hep_coord_connect is. On failure nothing stays registered or open. */
int hep_coord_create(const hep_plan *p, char *local_arena, const hep_bootstrap *bs,
                     int cuda_device, const hep_coord_options *o, hep_coord **out);
/* Collective: exchange remote keys and addresses, connect the queue pairs. */
int hep_coord_connect(hep_coord *c, const hep_bootstrap *bs);
/* Deregister everything (reverse order), close the NIC. Returns the first failure. */
int hep_coord_destroy(hep_coord *c);

#endif
