/* The real verbs NIC: two ranks of this process connect RC QPs on one RDMA device and
 * RDMA-write a buffer registered on each path (host memory; GPU memory on the legacy and
 * the DMA-BUF path when a GPU exists). Without an RDMA device it skips with the reason. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <infiniband/verbs.h>

#include "core/core.h"
#include "ep_case.h"
#include "fake_mr.h"
#include "mr/mr.h"
#include "net/net.h"
#include "ranks.h"
#include "sys/sys.h"

#define ACC (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)
#define LEN 65536

typedef struct shared {
    hep_net *nic[2];
    hep_gpu_mr mr[2];
    int mode, gpu;
    char *buf[2];
} shared;

static int rank_main(rank_ctx *r)
{
    shared *s = r->arg;
    int me = r->rank, rc;
    uint64_t info[3], all[6];
    rc = hep_verbs_create(me, 2, 0, &s->nic[me]);
    if (rc)
        return rc;
    rc = s->nic[me]->v->connect(s->nic[me], &r->bs);
    if (rc == 0)
        rc = hep_gpu_mr_register_mode(&s->nic[me]->mr_ops, s->mode, s->nic[me]->pd, 0,
                                      s->buf[me], LEN, ACC, me ? "dst" : "src", &s->mr[me]);
    info[0] = s->mr[me].addr, info[1] = s->mr[me].rkey, info[2] = (uint64_t)rc;
    if (r->bs.allgather(r->bs.ctx, info, all, sizeof(info)) || all[2] || all[5])
        return rc ? rc : HEP_ERR_REMOTE;
    if (me == 0) {
        hep_net_completion c;
        int n = 0;
        rc = s->nic[0]->v->write(s->nic[0], 1, s->mr[0].lkey, s->mr[0].addr, (uint32_t)all[4],
                                 all[3] + 100, LEN - 200, 1);
        for (long spin = 0; rc == 0 && n == 0 && spin < 100000000L; spin++)
            n = s->nic[0]->v->poll(s->nic[0], &c, 1);
        if (rc == 0 && (n != 1 || c.status))
            rc = n < 0 ? -n : HEP_ERR_TIMEOUT;
    }
    r->bs.barrier(r->bs.ctx);
    hep_gpu_mr_deregister(&s->mr[me]);
    s->nic[me]->v->destroy(s->nic[me]);
    return rc;
}

static int one_path(int gpu, int mode, const char *label)
{
    static shared s;
    rank_ctx ctx[2];
    int bad = 0;
    memset(&s, 0, sizeof(s));
    s.mode = mode;
    for (int i = 0; i < 2; i++) {
        if (gpu) {
            cudaMalloc((void **)&s.buf[i], LEN);
            cudaMemset(s.buf[i], i ? 0 : 0x3c, LEN);
        } else {
            s.buf[i] = calloc(1, LEN);
            memset(s.buf[i], i ? 0 : 0x3c, i ? 0 : LEN);
        }
    }
    run_ranks(2, rank_main, &s, ctx);
    if (ctx[0].rc || ctx[1].rc) {
        printf("%s: FAILED: %s %s\n", label, ctx[0].err, ctx[1].err);
        bad = 1;
    } else {
        unsigned char *h = malloc(LEN);
        if (gpu)
            cudaMemcpy(h, s.buf[1], LEN, cudaMemcpyDeviceToHost);
        else
            memcpy(h, s.buf[1], LEN);
        for (int k = 0; k < LEN && !bad; k++)
            bad = h[k] != ((k >= 100 && k < LEN - 100) ? 0x3c : 0);
        printf("%s: %s\n", label, bad ? "FAILED: data did not land" : "ok");
        free(h);
    }
    for (int i = 0; i < 2; i++)
        gpu ? (void)cudaFree(s.buf[i]) : free(s.buf[i]);
    return bad;
}

/* The hierarchical dispatch and combine of the virtual-node tests, over the real NIC:
 * 2 nodes x 2 ranks of this process on the host backend, against the oracle. (The GPU
 * tests' virtual nodes take the real NIC by themselves where one exists: HEP_NIC=auto
 * uses the loopback NIC only when there is no RDMA device.) */
static int internode_over_real_nic(hep_backend backend, hep_dtype dt, const char *label)
{
    static ep_case c;
    int bad;
    memset(&c, 0, sizeof(c));
    c.cfg = test_config(512, 64, 4, 8, dt);
    c.cfg.ranks_per_node = 2;
    c.cfg.backend = backend;
    c.world = 4;
    c.K = 8;
    c.skip_rank = -1;
    c.repeat = 2;
    ep_case_random(&c, 1234u, EP_ROUTE_NODES);
    setenv("HEP_NIC", "verbs", 1);
    hep_env_reload();
    bad = ep_case_run(&c) != 0;
    for (int r = 0; r < c.world; r++)
        if (c.out[r].rc_dispatch || c.out[r].rc_combine) {
            printf("%s: rank %d: %s\n", label, r, c.out[r].err);
            bad = 1;
        }
    if (!bad)
        bad = ep_case_check(&c) != 0;
    unsetenv("HEP_NIC");
    hep_env_reload();
    printf("%s: %s\n", label, bad ? "FAILED" : "ok (equal to the oracle)");
    ep_case_free(&c);
    return bad;
}

int main(void)
{
    int n = hep_verbs_device_count(), gpus = 0, bad = 0, runs = 0;
    if (n == 0) {
        printf("skipped: no RDMA device (%s)\n",
               hep_ibv()->loaded ? "ibv_get_device_list found none" : hep_ibv()->load_error);
        return 77;
    }
    if (cudaGetDeviceCount(&gpus) != cudaSuccess)
        gpus = 0;
    bad += one_path(0, HEP_MR_MODE_LEGACY, "host memory, ibv_reg_mr"), runs++;
    if (gpus > 0) {
        bad += one_path(1, HEP_MR_MODE_LEGACY, "GPU memory, legacy ibv_reg_mr"), runs++;
        bad += one_path(1, HEP_MR_MODE_DMABUF, "GPU memory, DMA-BUF"), runs++;
    }
    bad += internode_over_real_nic(HEP_BACKEND_HOST, HEP_DTYPE_BF16,
                                   "2 x 2 nodes, host backend, BF16"), runs++;
    bad += internode_over_real_nic(HEP_BACKEND_HOST, HEP_DTYPE_FP8_E4M3,
                                   "2 x 2 nodes, host backend, FP8"), runs++;
    printf("%d passed, %d failed\n", runs - bad, bad);
    return bad ? 1 : 0;
}
