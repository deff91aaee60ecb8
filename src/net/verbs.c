#define _DEFAULT_SOURCE /* realpath */
/* net/verbs.c: the real NIC: RC queue pairs over libibverbs, on IB and RoCE v2, without
 * DOCA, mlx5dv or GPU doorbell mappings. Every verbs call is checked. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/core.h"
#include "net/net.h"
#include "sys/sys.h"

#define VB_CQ_DEPTH 4096
#define VB_SQ_DEPTH 1024

typedef struct vb_endpoint { /* what one rank tells one peer */
    uint32_t qpn, psn;
    uint16_t lid;
    uint8_t port, link_layer, mtu, gid_index, pad[2];
    uint8_t gid[16];
} vb_endpoint;

typedef struct vb_nic {
    hep_net net;
    char name[64];
    struct ibv_context *ctx;
    struct ibv_cq *cq;
    struct ibv_qp **qp; /* [world], NULL for self */
    struct ibv_port_attr port_attr;
    int port, gid_index;
    union ibv_gid gid;
} vb_nic;

static int read_sysfs(const char *path, char *buf, size_t len)
{
    FILE *f = fopen(path, "r");
    int ok;
    if (!f)
        return -1;
    ok = fgets(buf, (int)len, f) != NULL;
    fclose(f);
    buf[strcspn(buf, "\n")] = 0;
    return ok ? 0 : -1;
}

/* Longest common prefix of the two devices' sysfs paths: the nearest in the PCI tree. */
static int pci_affinity(const char *gpu_path, const char *nic_name)
{
    char p[256], real[4096];
    int k = 0;
    snprintf(p, sizeof(p), "/sys/class/infiniband/%s/device", nic_name);
    if (!realpath(p, real))
        return 0;
    while (gpu_path[k] && gpu_path[k] == real[k])
        k++;
    return k;
}

static const char *mapped_name(int cuda_device, char *buf, size_t len)
{
    const char *map = hep_env_get()->nic_map;
    char want[16];
    if (!map || !*map)
        return NULL;
    snprintf(want, sizeof(want), "%d:", cuda_device);
    for (const char *s = map; s && *s; s = strchr(s, ',') ? strchr(s, ',') + 1 : NULL) {
        if (strncmp(s, want, strlen(want)) == 0) {
            size_t n = strcspn(s + strlen(want), ",");
            snprintf(buf, len, "%.*s", (int)n, s + strlen(want));
            return buf;
        }
    }
    return NULL;
}

static int pick_device(const hep_ibv_table *t, int cuda_device, struct ibv_device **list, int n,
                       struct ibv_device **out)
{
    char want[64], bus[32], gpu_path[4096] = "", p[128];
    const char *name = mapped_name(cuda_device, want, sizeof(want));
    int best = -1, best_score = -1;
    if (name) {
        for (int i = 0; i < n; i++)
            if (strcmp(t->get_device_name(list[i]), name) == 0) {
                *out = list[i];
                return HEP_OK;
            }
        return hep_fail(HEP_ERR_INVALID, "HEP_NIC_MAP names RDMA device '%s' for GPU %d, but "
                                         "no such device exists",
                        name, cuda_device);
    }
    if (cudaDeviceGetPCIBusId(bus, sizeof(bus), cuda_device) == cudaSuccess) {
        for (char *c = bus; *c; c++)
            *c = (char)(*c >= 'A' && *c <= 'F' ? *c - 'A' + 'a' : *c);
        snprintf(p, sizeof(p), "/sys/bus/pci/devices/%s", bus);
        if (!realpath(p, gpu_path))
            gpu_path[0] = 0;
    } else {
        (void)cudaGetLastError();
    }
    for (int i = 0; i < n; i++) {
        int s = pci_affinity(gpu_path, t->get_device_name(list[i]));
        if (s > best_score) {
            best_score = s;
            best = i;
        }
    }
    *out = list[best];
    return HEP_OK;
}

static int pick_gid(vb_nic *v)
{
    const hep_ibv_table *t = hep_ibv();
    int want = hep_env_get()->gid_index, rc;
    char path[256], type[32];
    v->gid_index = 0;
    if (v->port_attr.link_layer == IBV_LINK_LAYER_ETHERNET) {
        v->gid_index = -1;
        for (int i = 0; want < 0 && i < v->port_attr.gid_tbl_len; i++) {
            snprintf(path, sizeof(path), "/sys/class/infiniband/%s/ports/%d/gid_attrs/types/%d",
                     v->name, v->port, i);
            if (read_sysfs(path, type, sizeof(type)) == 0 && strcmp(type, "RoCE v2") == 0) {
                union ibv_gid g;
                if (t->query_gid(v->ctx, (uint8_t)v->port, i, &g) == 0 &&
                    (g.raw[10] == 0xff && g.raw[11] == 0xff)) { /* IPv4-mapped first */
                    want = i;
                    break;
                }
                if (v->gid_index < 0)
                    v->gid_index = i;
            }
        }
        if (want >= 0)
            v->gid_index = want;
        if (v->gid_index < 0)
            return hep_fail(HEP_ERR_UNAVAILABLE,
                            "RDMA device %s port %d is RoCE but has no RoCE v2 GID; set "
                            "HEP_IB_GID_INDEX",
                            v->name, v->port);
    } else if (want >= 0) {
        v->gid_index = want;
    }
    rc = t->query_gid(v->ctx, (uint8_t)v->port, v->gid_index, &v->gid);
    if (rc)
        return hep_fail(HEP_ERR_VERBS, "ibv_query_gid(%s, port %d, index %d) failed: %s", v->name,
                        v->port, v->gid_index, strerror(rc > 0 ? rc : errno));
    return HEP_OK;
}

static int open_port(vb_nic *v, struct ibv_device *dev)
{
    const hep_ibv_table *t = hep_ibv();
    struct ibv_device_attr da;
    int rc;
    snprintf(v->name, sizeof(v->name), "%s", t->get_device_name(dev));
    v->ctx = t->open_device(dev);
    if (!v->ctx)
        return hep_fail(HEP_ERR_VERBS, "ibv_open_device(%s) failed: %s", v->name, strerror(errno));
    rc = t->query_device(v->ctx, &da);
    if (rc)
        return hep_fail(HEP_ERR_VERBS, "ibv_query_device(%s) failed: %s", v->name, strerror(rc));
    for (int p = 1; p <= da.phys_port_cnt; p++) {
        rc = hep_ibv_query_port(v->ctx, (uint8_t)p, &v->port_attr);
        if (rc)
            return hep_fail(HEP_ERR_VERBS, "ibv_query_port(%s, %d) failed: %s", v->name, p,
                            strerror(rc));
        if (v->port_attr.state == IBV_PORT_ACTIVE) {
            v->port = p;
            return pick_gid(v);
        }
    }
    return hep_fail(HEP_ERR_UNAVAILABLE, "RDMA device %s has no ACTIVE port (see hybridep doctor)",
                    v->name);
}

static int create_qps(vb_nic *v)
{
    const hep_ibv_table *t = hep_ibv();
    v->qp = calloc((size_t)v->net.world, sizeof(*v->qp));
    if (!v->qp)
        return hep_fail(HEP_ERR_NOMEM, "verbs NIC: out of memory");
    v->net.pd = t->alloc_pd(v->ctx);
    if (!v->net.pd)
        return hep_fail(HEP_ERR_VERBS, "ibv_alloc_pd(%s) failed: %s", v->name, strerror(errno));
    v->cq = t->create_cq(v->ctx, VB_CQ_DEPTH, NULL, NULL, 0);
    if (!v->cq)
        return hep_fail(HEP_ERR_VERBS, "ibv_create_cq(%s, %d) failed: %s", v->name, VB_CQ_DEPTH,
                        strerror(errno));
    for (int r = 0; r < v->net.world; r++) {
        struct ibv_qp_init_attr a;
        struct ibv_qp_attr m;
        int rc;
        if (r == v->net.rank)
            continue;
        memset(&a, 0, sizeof(a));
        a.send_cq = a.recv_cq = v->cq;
        a.qp_type = IBV_QPT_RC;
        a.cap.max_send_wr = VB_SQ_DEPTH;
        a.cap.max_recv_wr = 1;
        a.cap.max_send_sge = 1;
        a.cap.max_recv_sge = 1;
        v->qp[r] = t->create_qp(v->net.pd, &a);
        if (!v->qp[r])
            return hep_fail(HEP_ERR_VERBS, "ibv_create_qp(%s, RC, to rank %d) failed: %s",
                            v->name, r, strerror(errno));
        memset(&m, 0, sizeof(m));
        m.qp_state = IBV_QPS_INIT;
        m.port_num = (uint8_t)v->port;
        m.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
        rc = t->modify_qp(v->qp[r], &m,
                          IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
        if (rc)
            return hep_fail(HEP_ERR_VERBS, "ibv_modify_qp(%s, QP 0x%x to rank %d, INIT) failed: %s",
                            v->name, v->qp[r]->qp_num, r, strerror(rc));
    }
    return HEP_OK;
}

static int to_rts(vb_nic *v, int peer, const vb_endpoint *e)
{
    const hep_ibv_table *t = hep_ibv();
    struct ibv_qp_attr m;
    int rc;
    memset(&m, 0, sizeof(m));
    m.qp_state = IBV_QPS_RTR;
    m.path_mtu = (enum ibv_mtu)(e->mtu < v->port_attr.active_mtu ? e->mtu : v->port_attr.active_mtu);
    m.dest_qp_num = e->qpn;
    m.rq_psn = e->psn;
    m.max_dest_rd_atomic = 1;
    m.min_rnr_timer = 12;
    m.ah_attr.port_num = (uint8_t)v->port;
    m.ah_attr.dlid = e->lid;
    if (e->link_layer == IBV_LINK_LAYER_ETHERNET || v->port_attr.link_layer == IBV_LINK_LAYER_ETHERNET) {
        m.ah_attr.is_global = 1;
        memcpy(m.ah_attr.grh.dgid.raw, e->gid, 16);
        m.ah_attr.grh.sgid_index = (uint8_t)v->gid_index;
        m.ah_attr.grh.hop_limit = 64;
    }
    rc = t->modify_qp(v->qp[peer], &m,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                          IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (rc)
        return hep_fail(HEP_ERR_VERBS,
                        "ibv_modify_qp(%s, QP 0x%x to rank %d, RTR, remote QP 0x%x) failed: %s",
                        v->name, v->qp[peer]->qp_num, peer, e->qpn, strerror(rc));
    memset(&m, 0, sizeof(m));
    m.qp_state = IBV_QPS_RTS;
    m.sq_psn = (uint32_t)(v->qp[peer]->qp_num * 2654435761u) & 0xffffff;
    m.timeout = 14;
    m.retry_cnt = 7;
    m.rnr_retry = 7;
    m.max_rd_atomic = 1;
    rc = t->modify_qp(v->qp[peer], &m,
                      IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                          IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
    if (rc)
        return hep_fail(HEP_ERR_VERBS, "ibv_modify_qp(%s, QP 0x%x to rank %d, RTS) failed: %s",
                        v->name, v->qp[peer]->qp_num, peer, strerror(rc));
    return HEP_OK;
}

static int vb_connect(hep_net *net, const hep_bootstrap *bs)
{
    vb_nic *v = (vb_nic *)net;
    size_t W = (size_t)net->world;
    vb_endpoint *mine = calloc(W, sizeof(*mine)), *all = calloc(W * W, sizeof(*all));
    int rc = HEP_OK;
    if (!mine || !all) {
        free(mine);
        free(all);
        return hep_fail(HEP_ERR_NOMEM, "verbs NIC: out of memory");
    }
    for (size_t r = 0; r < W; r++) {
        if (!v->qp[r])
            continue;
        mine[r].qpn = v->qp[r]->qp_num;
        mine[r].psn = (uint32_t)(v->qp[r]->qp_num * 2654435761u) & 0xffffff;
        mine[r].lid = v->port_attr.lid;
        mine[r].port = (uint8_t)v->port;
        mine[r].link_layer = v->port_attr.link_layer;
        mine[r].mtu = (uint8_t)v->port_attr.active_mtu;
        mine[r].gid_index = (uint8_t)v->gid_index;
        memcpy(mine[r].gid, v->gid.raw, 16);
    }
    rc = bs->allgather(bs->ctx, mine, all, W * sizeof(*mine));
    for (size_t r = 0; rc == HEP_OK && r < W; r++)
        if (v->qp[r])
            rc = to_rts(v, (int)r, &all[r * W + (size_t)net->rank]);
    free(mine);
    free(all);
    return rc;
}

static int vb_write(hep_net *net, int peer, uint32_t lkey, uint64_t laddr, uint32_t rkey,
                    uint64_t raddr, size_t len, uint64_t wr_id)
{
    vb_nic *v = (vb_nic *)net;
    struct ibv_sge sge = {laddr, (uint32_t)len, lkey};
    struct ibv_send_wr wr, *bad = NULL;
    int rc;
    if (peer < 0 || peer >= net->world || !v->qp[peer] || len > UINT32_MAX)
        return hep_fail(HEP_ERR_INVALID, "verbs NIC: bad write to rank %d (%zu bytes)", peer, len);
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = raddr; /* the original CUDA address, never ibv_mr::addr */
    wr.wr.rdma.rkey = rkey;
    rc = ibv_post_send(v->qp[peer], &wr, &bad);
    if (rc)
        return hep_fail(HEP_ERR_VERBS, "ibv_post_send(%s, QP 0x%x to rank %d, %zu bytes) failed: %s",
                        v->name, v->qp[peer]->qp_num, peer, len, strerror(rc));
    return HEP_OK;
}

static int vb_poll(hep_net *net, hep_net_completion *out, int max)
{
    vb_nic *v = (vb_nic *)net;
    struct ibv_wc wc[32];
    int n = ibv_poll_cq(v->cq, max < 32 ? max : 32, wc);
    if (n < 0)
        return -hep_fail(HEP_ERR_VERBS, "ibv_poll_cq(%s) failed", v->name);
    for (int i = 0; i < n; i++) {
        int peer = -1;
        for (int r = 0; r < net->world; r++)
            if (v->qp[r] && v->qp[r]->qp_num == wc[i].qp_num)
                peer = r;
        out[i].wr_id = wc[i].wr_id;
        out[i].peer = peer;
        out[i].status = HEP_OK;
        if (wc[i].status != IBV_WC_SUCCESS)
            out[i].status = hep_fail(HEP_ERR_VERBS,
                                     "RDMA write to rank %d failed on %s QP 0x%x: %s (wr_id %llu)",
                                     peer, v->name, wc[i].qp_num,
                                     hep_ibv()->wc_status_str
                                         ? hep_ibv()->wc_status_str(wc[i].status)
                                         : "error",
                                     (unsigned long long)wc[i].wr_id);
    }
    return n;
}

static void vb_destroy(hep_net *net)
{
    vb_nic *v = (vb_nic *)net;
    const hep_ibv_table *t = hep_ibv();
    int rc;
    for (int r = 0; v->qp && r < net->world; r++)
        if (v->qp[r] && (rc = t->destroy_qp(v->qp[r])) != 0)
            hep_log(HEP_LOG_WARN, "ibv_destroy_qp(%s) failed: %s", v->name, strerror(rc));
    if (v->cq && (rc = t->destroy_cq(v->cq)) != 0)
        hep_log(HEP_LOG_WARN, "ibv_destroy_cq(%s) failed: %s", v->name, strerror(rc));
    if (net->pd && (rc = t->dealloc_pd(net->pd)) != 0)
        hep_log(HEP_LOG_WARN, "ibv_dealloc_pd(%s) failed: %s", v->name, strerror(rc));
    if (v->ctx && (rc = t->close_device(v->ctx)) != 0)
        hep_log(HEP_LOG_WARN, "ibv_close_device(%s) failed: %s", v->name, strerror(rc));
    free(v->qp);
    free(v);
}

static const hep_net_vtbl vb_vtbl = {"verbs", vb_connect, vb_write, vb_poll, vb_destroy};

int hep_verbs_device_count(void)
{
    const hep_ibv_table *t = hep_ibv();
    struct ibv_device **list;
    int n = 0;
    if (!t->loaded || !t->get_device_list)
        return 0;
    list = t->get_device_list(&n);
    if (!list)
        return 0;
    t->free_device_list(list);
    return n;
}

int hep_verbs_create(int rank, int world, int cuda_device, hep_net **out)
{
    const hep_ibv_table *t = hep_ibv();
    struct ibv_device **list = NULL, *dev = NULL;
    vb_nic *v;
    int n = 0, rc;
    const char *need[] = {"ibv_get_device_list", "ibv_open_device", "ibv_alloc_pd",
                          "ibv_create_cq", "ibv_create_qp", "ibv_modify_qp", "ibv_query_gid"};
    const void *fn[] = {t->get_device_list, t->open_device, t->alloc_pd, t->create_cq,
                        t->create_qp, t->modify_qp, t->query_gid};
    for (size_t i = 0; i < sizeof(fn) / sizeof(fn[0]); i++)
        if ((rc = hep_ibv_require(fn[i], need[i])) != HEP_OK)
            return rc;
    list = t->get_device_list(&n);
    if (!list || n == 0) {
        if (list)
            t->free_device_list(list);
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "no RDMA device found (ibv_get_device_list: %s); a group with more than "
                        "one node needs one, or HEP_NIC=loopback for virtual nodes on one host",
                        list ? "0 devices" : strerror(errno));
    }
    v = calloc(1, sizeof(*v));
    if (!v) {
        t->free_device_list(list);
        return hep_fail(HEP_ERR_NOMEM, "verbs NIC: out of memory");
    }
    v->net.v = &vb_vtbl;
    v->net.rank = rank;
    v->net.world = world;
    v->net.mr_ops = *hep_gpu_mr_real_ops();
    rc = pick_device(t, cuda_device, list, n, &dev);
    if (rc == HEP_OK)
        rc = open_port(v, dev);
    t->free_device_list(list);
    if (rc == HEP_OK)
        rc = create_qps(v);
    if (rc != HEP_OK) {
        vb_destroy(&v->net);
        return rc;
    }
    hep_log(HEP_LOG_DEBUG, "rank %d uses RDMA device %s port %d (GID index %d) for GPU %d", rank,
            v->name, v->port, v->gid_index, cuda_device);
    *out = &v->net;
    return HEP_OK;
}
