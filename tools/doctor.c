/* tools/doctor.c: `hybridep doctor` - what this machine offers to hybridep. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "cli.h"
#include "hybridep/gpu_mr.h"
#include "ibv_dl.h"
#include "json.h"

#define MAX_GPUS 16
#define MAX_NICS 16
#define MAX_PORTS 4
#define MAX_GIDS 8

typedef struct doc_gpu {
    char name[256], pci[32], kernels[256];
    int cc_major, cc_minor, sms, dmabuf, gdr, kernels_ok;
    size_t mem;
} doc_gpu;

typedef struct doc_port {
    int num, lid, active_mtu, gid_count;
    char state[32], link_layer[16];
    char gid[MAX_GIDS][64];
    int gid_index[MAX_GIDS];
} doc_port;

typedef struct doc_nic {
    char name[64], pci[128], open_error[256];
    int nports;
    doc_port port[MAX_PORTS];
} doc_nic;

typedef struct doc_pair {
    int gpu, nic, legacy_ok, dmabuf_ok;
    char legacy[512], dmabuf[512];
} doc_pair;

typedef struct doctor {
    int driver, runtime, ngpus, nnics, npairs, peermem;
    char gpu_error[256], nic_error[512];
    doc_gpu gpu[MAX_GPUS];
    int p2p[MAX_GPUS][MAX_GPUS];
    doc_nic nic[MAX_NICS];
    doc_pair pair[MAX_GPUS * MAX_NICS];
    struct rlimit memlock;
} doctor;

static int peermem_loaded(void)
{
    char line[256];
    FILE *f;
    if (access("/sys/module/nvidia_peermem", F_OK) == 0)
        return 1;
    f = fopen("/proc/modules", "r");
    if (!f)
        return 0;
    while (fgets(line, sizeof(line), f))
        if (strncmp(line, "nvidia_peermem ", 15) == 0) {
            fclose(f);
            return 1;
        }
    fclose(f);
    return 0;
}

static void collect_gpus(doctor *d)
{
    int n = 0;
    cudaError_t e;
    if (cudaDriverGetVersion(&d->driver) != cudaSuccess)
        d->driver = 0;
    cudaRuntimeGetVersion(&d->runtime);
    e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        snprintf(d->gpu_error, sizeof(d->gpu_error), "%s%s: %s",
                 d->driver == 0 ? "no CUDA driver is installed; " : "", cudaGetErrorName(e),
                 cudaGetErrorString(e));
        (void)cudaGetLastError();
        return;
    }
    d->ngpus = n > MAX_GPUS ? MAX_GPUS : n;
    for (int i = 0; i < d->ngpus; i++) {
        doc_gpu *g = &d->gpu[i];
        struct cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, i) != cudaSuccess)
            continue;
        snprintf(g->name, sizeof(g->name), "%s", p.name);
        g->cc_major = p.major;
        g->cc_minor = p.minor;
        g->sms = p.multiProcessorCount;
        g->mem = p.totalGlobalMem;
        snprintf(g->pci, sizeof(g->pci), "%04x:%02x:%02x.0", p.pciDomainID, p.pciBusID,
                 p.pciDeviceID);
        g->dmabuf = g->gdr = -1;
        /* CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (124), ..._GPU_DIRECT_RDMA_SUPPORTED (116):
         * the runtime's attributes carry the driver's numbers */
        if (cudaDeviceGetAttribute(&g->dmabuf, (enum cudaDeviceAttr)124, i) != cudaSuccess)
            g->dmabuf = -1;
        if (cudaDeviceGetAttribute(&g->gdr, (enum cudaDeviceAttr)116, i) != cudaSuccess)
            g->gdr = -1;
        (void)cudaGetLastError();
        g->kernels_ok = hep_gpu_probe(i) == HEP_OK;
        snprintf(g->kernels, sizeof(g->kernels), "%s", g->kernels_ok ? "run" : hep_last_error());
        for (int j = 0; j < d->ngpus; j++) {
            int can = 0;
            if (i != j && cudaDeviceCanAccessPeer(&can, i, j) == cudaSuccess)
                d->p2p[i][j] = can;
        }
    }
}

#ifndef HEP_NO_VERBS
static int read_line(const char *path, char *buf, size_t len)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    if (!fgets(buf, (int)len, f)) {
        fclose(f);
        return -1;
    }
    fclose(f);
    buf[strcspn(buf, "\n")] = '\0';
    return 0;
}

static const char *port_state(enum ibv_port_state s)
{
    switch (s) {
    case IBV_PORT_ACTIVE: return "ACTIVE";
    case IBV_PORT_DOWN: return "DOWN";
    case IBV_PORT_INIT: return "INIT";
    case IBV_PORT_ARMED: return "ARMED";
    default: return "other";
    }
}

static void collect_gids(const char *dev, doc_port *p, int tbl_len)
{
    char path[512], type[64], gid[64];
    for (int i = 0; i < tbl_len && p->gid_count < MAX_GIDS; i++) {
        snprintf(path, sizeof(path), "/sys/class/infiniband/%s/ports/%d/gid_attrs/types/%d", dev,
                 p->num, i);
        if (read_line(path, type, sizeof(type)) != 0 || strcmp(type, "RoCE v2") != 0)
            continue;
        snprintf(path, sizeof(path), "/sys/class/infiniband/%s/ports/%d/gids/%d", dev, p->num, i);
        if (read_line(path, gid, sizeof(gid)) != 0 || strncmp(gid, "0000:0000:0000:0000", 19) == 0)
            continue;
        p->gid_index[p->gid_count] = i;
        snprintf(p->gid[p->gid_count++], sizeof(p->gid[0]), "%s", gid);
    }
}

static void collect_nic(const doc_ibv *t, struct ibv_device *dev, doc_nic *n)
{
    struct ibv_device_attr da;
    struct ibv_context *ctx;
    char path[256], real[4096];
    snprintf(n->name, sizeof(n->name), "%s", t->get_device_name(dev));
    snprintf(path, sizeof(path), "/sys/class/infiniband/%s/device", n->name);
    if (realpath(path, real))
        snprintf(n->pci, sizeof(n->pci), "%s", strrchr(real, '/') + 1);
    ctx = t->open_device(dev);
    if (!ctx) {
        snprintf(n->open_error, sizeof(n->open_error), "ibv_open_device: %s", strerror(errno));
        return;
    }
    if (t->query_device(ctx, &da) == 0) {
        n->nports = da.phys_port_cnt > MAX_PORTS ? MAX_PORTS : da.phys_port_cnt;
        for (int p = 0; p < n->nports; p++) {
            struct ibv_port_attr pa;
            doc_port *dp = &n->port[p];
            dp->num = p + 1;
            if (doc_ibv_query_port(t, ctx, (uint8_t)(p + 1), &pa) != 0) {
                snprintf(dp->state, sizeof(dp->state), "query failed");
                continue;
            }
            snprintf(dp->state, sizeof(dp->state), "%s", port_state(pa.state));
            snprintf(dp->link_layer, sizeof(dp->link_layer), "%s",
                     pa.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand");
            dp->lid = pa.lid;
            dp->active_mtu = 128 << pa.active_mtu;
            collect_gids(n->name, dp, pa.gid_tbl_len);
        }
    }
    t->close_device(ctx);
}

/* Register a small real cudaMalloc buffer on each path, one policy at a time. */
static void probe_pair(const doc_ibv *t, struct ibv_device *dev, doc_pair *pr)
{
    struct ibv_context *ctx = t->open_device(dev);
    struct ibv_pd *pd = ctx ? t->alloc_pd(ctx) : NULL;
    const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    void *buf = NULL;
    cudaError_t e;
    hep_gpu_mr mr;

    if (!pd) {
        snprintf(pr->legacy, sizeof(pr->legacy), "cannot open device / allocate PD: %s",
                 strerror(errno));
        memcpy(pr->dmabuf, pr->legacy, sizeof(pr->dmabuf));
        goto out;
    }
    e = cudaSetDevice(pr->gpu);
    if (e == cudaSuccess)
        e = cudaMalloc(&buf, 3696); /* odd size on purpose: the export covers its pages */
    if (e != cudaSuccess) {
        snprintf(pr->legacy, sizeof(pr->legacy), "cudaMalloc: %s", cudaGetErrorString(e));
        memcpy(pr->dmabuf, pr->legacy, sizeof(pr->dmabuf));
        goto out;
    }
    pr->legacy_ok = hep_gpu_mr_register_path(NULL, HEP_MR_LEGACY, pd, pr->gpu, buf, 3696,
                                             access, "doctor.probe", &mr) == HEP_OK;
    snprintf(pr->legacy, sizeof(pr->legacy), "%s", pr->legacy_ok ? "works" : hep_last_error());
    hep_gpu_mr_deregister(&mr);
    pr->dmabuf_ok = hep_gpu_mr_register_path(NULL, HEP_MR_DMABUF, pd, pr->gpu, buf, 3696,
                                             access, "doctor.probe", &mr) == HEP_OK;
    snprintf(pr->dmabuf, sizeof(pr->dmabuf), "%s", pr->dmabuf_ok ? "works" : hep_last_error());
    hep_gpu_mr_deregister(&mr);
out:
    if (buf)
        cudaFree(buf);
    if (pd)
        t->dealloc_pd(pd);
    if (ctx)
        t->close_device(ctx);
}

#endif

static void collect_nics(doctor *d)
{
#ifdef HEP_NO_VERBS
    snprintf(d->nic_error, sizeof(d->nic_error),
             "not in this build: the libibverbs headers (Debian: libibverbs-dev) were missing "
             "when it was built, so the verbs NIC and these checks were left out");
}
#else
    const doc_ibv *t = doc_ibv_get();
    struct ibv_device **list;
    int n = 0;
    if (!t->loaded) {
        snprintf(d->nic_error, sizeof(d->nic_error), "%s", t->error);
        return;
    }
    list = t->get_device_list(&n);
    if (!list) {
        int err = errno;
        snprintf(d->nic_error, sizeof(d->nic_error), "%sibv_get_device_list: %s",
                 err == ENOSYS ? "this kernel has no RDMA support (no /sys/class/infiniband); "
                               : "",
                 strerror(err));
        return;
    }
    d->nnics = n > MAX_NICS ? MAX_NICS : n;
    if (n == 0)
        snprintf(d->nic_error, sizeof(d->nic_error), "no RDMA device found");
    for (int i = 0; i < d->nnics; i++) {
        collect_nic(t, list[i], &d->nic[i]);
        for (int g = 0; g < d->ngpus; g++) {
            doc_pair *pr = &d->pair[d->npairs++];
            pr->gpu = g;
            pr->nic = i;
            probe_pair(t, list[i], pr);
        }
    }
    t->free_device_list(list);
}
#endif

static void print_limit(FILE *f, rlim_t v)
{
    if (v == RLIM_INFINITY)
        fprintf(f, "unlimited");
    else
        fprintf(f, "%llu KiB", (unsigned long long)v / 1024);
}

static void print_text(const doctor *d)
{
    printf("hybridep doctor\n");
    printf("hybridep     : library %s, %s\n", hep_version(),
           hep_has_gpu_backend() ? "GPU kernels built in" : "host backend only (built without CUDA)");
    printf("CUDA driver  : %s", d->driver ? "" : "none");
    if (d->driver)
        printf("%d.%d", d->driver / 1000, (d->driver % 1000) / 10);
    printf("\nCUDA runtime : %d.%d (linked)\n", d->runtime / 1000, (d->runtime % 1000) / 10);
    if (d->ngpus == 0)
        printf("GPUs         : none (%s)\n", d->gpu_error[0] ? d->gpu_error : "no device");
    for (int i = 0; i < d->ngpus; i++) {
        const doc_gpu *g = &d->gpu[i];
        printf("GPU %d        : %s, sm_%d%d, %d SMs, %.1f GiB, PCI %s, DMA_BUF_SUPPORTED=%d, "
               "GPUDirect RDMA=%d, kernels: %s\n",
               i, g->name, g->cc_major, g->cc_minor, g->sms, (double)g->mem / (1 << 30), g->pci,
               g->dmabuf, g->gdr, g->kernels);
    }
    if (d->ngpus > 1) {
        printf("P2P access   :");
        for (int j = 0; j < d->ngpus; j++)
            printf(" %3d", j);
        printf("\n");
        for (int i = 0; i < d->ngpus; i++) {
            printf("         %3d :", i);
            for (int j = 0; j < d->ngpus; j++)
                printf(" %3s", i == j ? "-" : d->p2p[i][j] ? "yes" : "no");
            printf("\n");
        }
    }
    printf("nvidia_peermem: %s\n", d->peermem ? "loaded" : "not loaded");
    printf("RLIMIT_MEMLOCK: soft ");
    print_limit(stdout, d->memlock.rlim_cur);
    printf(", hard ");
    print_limit(stdout, d->memlock.rlim_max);
    printf("\n");
    if (d->nnics == 0)
        printf("RDMA devices : none (%s)\n", d->nic_error);
    for (int i = 0; i < d->nnics; i++) {
        const doc_nic *n = &d->nic[i];
        printf("NIC %-9s: PCI %s%s%s\n", n->name, n->pci[0] ? n->pci : "?",
               n->open_error[0] ? ", " : "", n->open_error);
        for (int p = 0; p < n->nports; p++) {
            const doc_port *dp = &n->port[p];
            printf("  port %d     : %s, %s, LID %d, MTU %d, RoCE v2 GIDs:", dp->num, dp->state,
                   dp->link_layer, dp->lid, dp->active_mtu);
            if (dp->gid_count == 0)
                printf(" none");
            for (int k = 0; k < dp->gid_count; k++)
                printf(" [%d] %s", dp->gid_index[k], dp->gid[k]);
            printf("\n");
        }
    }
    for (int i = 0; i < d->npairs; i++) {
        const doc_pair *p = &d->pair[i];
        printf("GPU %d + %s: legacy ibv_reg_mr: %s\n", p->gpu, d->nic[p->nic].name, p->legacy);
        printf("GPU %d + %s: DMA-BUF         : %s\n", p->gpu, d->nic[p->nic].name, p->dmabuf);
    }
    if (d->npairs == 0)
        printf("registration : not probed (needs a GPU and an RDMA device)\n");
}

static void print_json(const doctor *d)
{
    hep_json j;
    json_begin(&j, stdout);
    json_obj(&j, NULL);
    json_str(&j, "hybridep_version", hep_version());
    json_bool(&j, "gpu_backend_built", hep_has_gpu_backend());
    json_int(&j, "cuda_driver_version", d->driver);
    json_int(&j, "cuda_runtime_version", d->runtime);
    json_str(&j, "gpu_error", d->ngpus ? NULL : d->gpu_error);
    json_arr(&j, "gpus");
    for (int i = 0; i < d->ngpus; i++) {
        const doc_gpu *g = &d->gpu[i];
        char cc[16];
        snprintf(cc, sizeof(cc), "%d.%d", g->cc_major, g->cc_minor);
        json_obj(&j, NULL);
        json_int(&j, "index", i);
        json_str(&j, "name", g->name);
        json_str(&j, "compute_capability", cc);
        json_int(&j, "sms", g->sms);
        json_int(&j, "memory_bytes", (long long)g->mem);
        json_str(&j, "pci", g->pci);
        json_int(&j, "dma_buf_supported", g->dmabuf);
        json_int(&j, "gpudirect_rdma_supported", g->gdr);
        json_bool(&j, "kernels_run", g->kernels_ok);
        json_str(&j, "kernels", g->kernels);
        json_arr(&j, "p2p");
        for (int k = 0; k < d->ngpus; k++)
            json_bool(&j, NULL, d->p2p[i][k]);
        json_end_arr(&j);
        json_end_obj(&j);
    }
    json_end_arr(&j);
    json_bool(&j, "nvidia_peermem_loaded", d->peermem);
    json_obj(&j, "rlimit_memlock");
    json_int(&j, "soft", d->memlock.rlim_cur == RLIM_INFINITY ? -1 : (long long)d->memlock.rlim_cur);
    json_int(&j, "hard", d->memlock.rlim_max == RLIM_INFINITY ? -1 : (long long)d->memlock.rlim_max);
    json_end_obj(&j);
    json_str(&j, "rdma_error", d->nnics ? NULL : d->nic_error);
    json_arr(&j, "rdma_devices");
    for (int i = 0; i < d->nnics; i++) {
        const doc_nic *n = &d->nic[i];
        json_obj(&j, NULL);
        json_str(&j, "name", n->name);
        json_str(&j, "pci", n->pci);
        json_str(&j, "open_error", n->open_error[0] ? n->open_error : NULL);
        json_arr(&j, "ports");
        for (int p = 0; p < n->nports; p++) {
            const doc_port *dp = &n->port[p];
            json_obj(&j, NULL);
            json_int(&j, "port", dp->num);
            json_str(&j, "state", dp->state);
            json_str(&j, "link_layer", dp->link_layer);
            json_int(&j, "lid", dp->lid);
            json_int(&j, "active_mtu", dp->active_mtu);
            json_arr(&j, "rocev2_gids");
            for (int k = 0; k < dp->gid_count; k++) {
                json_obj(&j, NULL);
                json_int(&j, "index", dp->gid_index[k]);
                json_str(&j, "gid", dp->gid[k]);
                json_end_obj(&j);
            }
            json_end_arr(&j);
            json_end_obj(&j);
        }
        json_end_arr(&j);
        json_end_obj(&j);
    }
    json_end_arr(&j);
    json_arr(&j, "registration");
    for (int i = 0; i < d->npairs; i++) {
        const doc_pair *p = &d->pair[i];
        json_obj(&j, NULL);
        json_int(&j, "gpu", p->gpu);
        json_str(&j, "nic", d->nic[p->nic].name);
        json_bool(&j, "legacy_works", p->legacy_ok);
        json_str(&j, "legacy", p->legacy);
        json_bool(&j, "dmabuf_works", p->dmabuf_ok);
        json_str(&j, "dmabuf", p->dmabuf);
        json_end_obj(&j);
    }
    json_end_arr(&j);
    json_end_obj(&j);
    json_finish(&j);
}

int hep_cmd_doctor(int argc, char **argv)
{
    static doctor d; /* large: keep it off the stack */
    int as_json = 0, rc;
    const cli_opt opts[] = {
        {"json", CLI_FLAG, &as_json, 0, 0, NULL, NULL, "one JSON document on stdout"},
    };
    const cli_cmd cmd = {"doctor", "what this machine offers to hybridep: GPUs, P2P, RDMA "
                                   "devices, which GPU memory registration path works",
                         opts, 1, "Exits 0 with no GPU or no NIC (and says so)."};
    if ((rc = cli_parse(&cmd, argc, argv)))
        return rc < 0 ? 0 : rc;
    memset(&d, 0, sizeof(d));
    collect_gpus(&d);
    d.peermem = peermem_loaded();
    getrlimit(RLIMIT_MEMLOCK, &d.memlock);
    collect_nics(&d);
    if (as_json)
        print_json(&d);
    else
        print_text(&d);
    return 0;
}
