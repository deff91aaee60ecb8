/* group/group.c: collective creation and destruction of an EP group. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "core/core.h"
#include "group/group.h"
#include "group/shm.h"

/* What each rank tells the others at creation. */
typedef struct rank_card {
    hep_config cfg;
    char host[64];
    int pid, device, sms;
    char pci[32];
    uint64_t shared_base;
    cudaIpcMemHandle_t ipc;
} rank_card;

int hep_group_agree(hep_group *g, int rc, int extra, int *extras)
{
    /* statuses first (8 bytes a rank), the failing rank's message only when there is one:
     * with 1024 ranks in one process, a message from every rank at every step held a
     * gigabyte at once */
    int mine[2] = {rc, extra}, *all, brc, fail = -1;
    char text[1016], got[1016 + 1];
    memset(text, 0, sizeof(text));
    if (rc)
        snprintf(text, sizeof(text), "%s", hep_last_error());
    all = calloc((size_t)g->world, sizeof(mine));
    if (!all)
        return hep_fail(HEP_ERR_NOMEM, "group: out of memory");
    brc = g->bs.allgather(g->bs.ctx, mine, all, sizeof(mine));
    if (brc) {
        free(all);
        return brc;
    }
    for (int r = 0; r < g->world && fail < 0; r++)
        if (all[2 * r])
            fail = r;
    for (int r = 0; extras && r < g->world; r++)
        extras[r] = all[2 * r + 1];
    if (fail >= 0) {
        /* every rank takes part (each saw the same statuses); only `fail`'s text is kept */
        char *texts = calloc((size_t)g->world, sizeof(text));
        rc = all[2 * fail];
        if (!texts) {
            free(all);
            return hep_fail(HEP_ERR_NOMEM, "group: out of memory");
        }
        brc = g->bs.allgather(g->bs.ctx, text, texts, sizeof(text));
        if (brc) {
            free(texts), free(all);
            return brc;
        }
        memcpy(got, texts + (size_t)fail * sizeof(text), sizeof(text));
        got[sizeof(text)] = 0;
        free(texts);
        if (fail != g->rank) {
            char line[1100];
            snprintf(line, sizeof(line), "rank %d: %s", fail, got);
            hep_set_error_text(line);
        }
    }
    free(all);
    return fail >= 0 ? rc : HEP_OK;
}

/* Names the first configuration field on which some rank differs from rank 0. */
static int compare_configs(const rank_card *cards, int world)
{
#define FIELD(f)                                                                                 \
    {                                                                                            \
#f, offsetof(hep_config, f)                                                              \
    }
    static const struct {
        const char *name;
        size_t off;
    } fields[] = {FIELD(hidden),         FIELD(max_tokens),   FIELD(experts_per_rank),
                  FIELD(max_topk),       FIELD(dtype),        FIELD(ranks_per_node),
                  FIELD(dispatch_sms),   FIELD(combine_sms),  FIELD(chunk_tokens),
                  FIELD(backend),        FIELD(max_recv_rows),
                  FIELD(max_permuted_rows)};
#undef FIELD
    for (size_t f = 0; f < sizeof(fields) / sizeof(fields[0]); f++) {
        int v0;
        memcpy(&v0, (const char *)&cards[0].cfg + fields[f].off, sizeof(int));
        for (int r = 1; r < world; r++) {
            int v;
            memcpy(&v, (const char *)&cards[r].cfg + fields[f].off, sizeof(int));
            if (v != v0)
                return hep_fail(HEP_ERR_MISMATCH,
                                "configuration differs across ranks: field '%s' is %d on rank 0 "
                                "but %d on rank %d",
                                fields[f].name, v0, v, r);
        }
    }
    return HEP_OK;
}

static int pick_layout(hep_group *g, const rank_card *cards)
{
    int R = g->cfg.ranks_per_node;
    if (R == 0) {
        R = 0;
        for (int r = 0; r < g->world; r++)
            R += strcmp(cards[r].host, cards[g->rank].host) == 0;
        for (int r = 0; r < g->world; r++) {
            int same = 0;
            for (int q = 0; q < g->world; q++)
                same += strcmp(cards[q].host, cards[r].host) == 0;
            if (same != R)
                return hep_fail(HEP_ERR_INVALID,
                                "ranks_per_node = 0 needs the same number of ranks on every host: "
                                "host '%s' has %d, host '%s' has %d",
                                cards[g->rank].host, R, cards[r].host, same);
        }
        if (g->world % R)
            return hep_fail(HEP_ERR_INVALID, "%d ranks per host does not divide %d ranks", R,
                            g->world);
    }
    if (R > HEP_MAX_LOCAL)
        return hep_fail(HEP_ERR_INVALID, "%d ranks per node exceeds %d", R, HEP_MAX_LOCAL);
    g->R = R;
    g->N = g->world / R;
    g->node = g->rank / R;
    g->local = g->rank % R;
    return HEP_OK;
}

static int check_sm_budget(const hep_group *g, const rank_card *cards)
{
    int need = 0, who = 0;
    char list[256] = "";
    size_t n = 0;
    if (g->cfg.backend == HEP_BACKEND_HOST)
        return HEP_OK;
    for (int r = 0; r < g->world; r++) {
        if (strcmp(cards[r].host, cards[g->rank].host) || strcmp(cards[r].pci, cards[g->rank].pci))
            continue;
        /* every combine block of every co-located rank waits for the others: they must be
         * resident together; a rank's preprocess never overlaps its own dispatch/combine */
        need += g->cfg.dispatch_sms > g->cfg.combine_sms ? g->cfg.dispatch_sms
                                                         : g->cfg.combine_sms;
        who++;
        if (n + 8 < sizeof(list))
            n += (size_t)snprintf(list + n, sizeof(list) - n, "%s%d", who > 1 ? "," : "", r);
    }
    if (need > cards[g->rank].sms)
        return hep_fail(HEP_ERR_INVALID,
                        "%d ranks (%s) share GPU %s with %d SMs, but their kernels need %d SMs "
                        "together (max(dispatch_sms, combine_sms) each): lower dispatch_sms / "
                        "combine_sms",
                        who, list, cards[g->rank].pci, cards[g->rank].sms, need);
    return HEP_OK;
}

/* 1 when every node-mate drives the same GPU as this rank (virtual ranks, or processes
 * sharing it): the kernels then order their flags at device scope. */
static int mates_share_gpu(const hep_group *g, const rank_card *cards)
{
    for (int l = 0; l < g->R; l++) {
        const rank_card *c = &cards[g->node * g->R + l];
        if (strcmp(c->host, cards[g->rank].host) || strcmp(c->pci, cards[g->rank].pci))
            return 0;
    }
    return 1;
}

/* 1 when every node-mate is a thread of this process. */
static int mates_in_process(const hep_group *g, const rank_card *cards)
{
    for (int l = 0; l < g->R; l++) {
        const rank_card *c = &cards[g->node * g->R + l];
        if (strcmp(c->host, cards[g->rank].host) || c->pid != cards[g->rank].pid)
            return 0;
    }
    return 1;
}

static int cuda_fail(cudaError_t e, const char *what, size_t bytes)
{
    int st = e == cudaErrorMemoryAllocation ? HEP_ERR_NOMEM : HEP_ERR_CUDA;
    (void)cudaGetLastError();
    return hep_fail(st, "%s of %zu bytes failed: %s (%s)", what, bytes, cudaGetErrorName(e),
                    cudaGetErrorString(e));
}

static int all_in_one_process(const rank_card *cards, int world);

static int alloc_arenas(hep_group *g)
{
    int host = g->cfg.backend == HEP_BACKEND_HOST;
    for (int a = 0; a < HEP_ARENA_COUNT; a++) {
        size_t bytes = g->plan.arena_bytes[a];
        cudaError_t e = cudaSuccess;
        void *p = NULL;
        if (bytes == 0 || g->arena[a]) /* already placed (host shared memory) */
            continue;
        if (host) {
            p = aligned_alloc(4096, bytes);
            if (!p)
                return hep_fail(HEP_ERR_NOMEM, "group: %zu bytes of host memory for the %s arena",
                                bytes, hep_arena_name(a));
            memset(p, 0, bytes);
        } else if (a == HEP_ARENA_SHARED || a == HEP_ARENA_LOCAL) {
            e = cudaMalloc(&p, bytes);
            if (e == cudaSuccess)
                e = cudaMemset(p, 0, bytes);
        } else if (a == HEP_ARENA_MAPPED) {
            e = cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
            if (e == cudaSuccess)
                memset(p, 0, bytes);
        } else {
            e = cudaMallocHost(&p, bytes);
            if (e == cudaSuccess)
                memset(p, 0, bytes);
        }
        if (e != cudaSuccess) {
            if (p)
                cudaFree(p);
            return cuda_fail(e, hep_arena_name(a), bytes);
        }
        g->arena[a] = p;
    }
    g->mapped_dev = g->arena[HEP_ARENA_MAPPED];
    if (!host && g->arena[HEP_ARENA_MAPPED]) {
        cudaError_t e = cudaHostGetDevicePointer((void **)&g->mapped_dev,
                                                 g->arena[HEP_ARENA_MAPPED], 0);
        if (e != cudaSuccess)
            return cuda_fail(e, "cudaHostGetDevicePointer", g->plan.arena_bytes[HEP_ARENA_MAPPED]);
    }
    if (!host) {
        cudaError_t e = cudaDeviceSynchronize(); /* the memsets are done before peers write */
        if (e != cudaSuccess)
            return cuda_fail(e, "cudaDeviceSynchronize after clearing the arenas", 0);
    }
    return HEP_OK;
}

static void free_arenas(hep_group *g)
{
    int host = g->cfg.backend == HEP_BACKEND_HOST;
    for (int a = HEP_ARENA_COUNT - 1; a >= 0; a--) {
        if (!g->arena[a])
            continue;
        if (host)
            free(g->arena[a]);
        else if (a == HEP_ARENA_SHARED || a == HEP_ARENA_LOCAL)
            cudaFree(g->arena[a]);
        else
            cudaFreeHost(g->arena[a]);
        g->arena[a] = NULL;
    }
}

/* Node-mates in this process share pointers; other processes go through CUDA IPC. */
static int map_peers(hep_group *g, const rank_card *cards)
{
    int base = g->node * g->R;
    if (g->shm)
        return hep_shm_map_mates(g); /* host backend across processes */
    for (int l = 0; l < g->R; l++) {
        const rank_card *c = &cards[base + l];
        if (l == g->local) {
            g->peer_shared[l] = g->arena[HEP_ARENA_SHARED];
            continue;
        }
        if (c->pid == cards[g->rank].pid && strcmp(c->host, cards[g->rank].host) == 0) {
            g->peer_shared[l] = (char *)(uintptr_t)c->shared_base;
            if (g->cfg.backend == HEP_BACKEND_GPU && c->device != g->device) {
                int can = 0;
                cudaError_t e = cudaDeviceCanAccessPeer(&can, g->device, c->device);
                if (e == cudaSuccess && !can)
                    return hep_fail(HEP_ERR_UNAVAILABLE,
                                    "GPU %d cannot access GPU %d of rank %d as a peer (no NVLink or "
                                    "P2P; see hybridep doctor)",
                                    g->device, c->device, base + l);
                if (e == cudaSuccess)
                    e = cudaDeviceEnablePeerAccess(c->device, 0);
                if (e == cudaErrorPeerAccessAlreadyEnabled)
                    e = cudaSuccess;
                (void)cudaGetLastError();
                if (e != cudaSuccess)
                    return hep_fail(HEP_ERR_CUDA, "enabling peer access from GPU %d to GPU %d: %s",
                                    g->device, c->device, cudaGetErrorString(e));
            }
            continue;
        }
        if (g->cfg.backend == HEP_BACKEND_HOST)
            return hep_fail(HEP_ERR_INVALID,
                            "the host backend needs all ranks of a node in one process; rank %d "
                            "is in another process",
                            base + l);
        {
            void *p = NULL;
            cudaError_t e = cudaIpcOpenMemHandle(&p, c->ipc, cudaIpcMemLazyEnablePeerAccess);
            if (e != cudaSuccess)
                return hep_fail(HEP_ERR_CUDA,
                                "cudaIpcOpenMemHandle of rank %d's shared buffers failed: %s "
                                "(are the GPUs peer-capable? see hybridep doctor)",
                                base + l, cudaGetErrorString(e));
            g->peer_shared[l] = p;
            g->ipc_opened[l] = 1;
        }
    }
    return HEP_OK;
}

static void unmap_peers(hep_group *g)
{
    for (int l = 0; l < g->R; l++) {
        if (g->ipc_opened[l])
            cudaIpcCloseMemHandle(g->peer_shared[l]);
        g->ipc_opened[l] = 0;
        g->peer_shared[l] = NULL;
    }
}

static int fill_card(hep_group *g, rank_card *c)
{
    memset(c, 0, sizeof(*c));
    c->cfg = g->cfg;
    if (gethostname(c->host, sizeof(c->host) - 1) != 0)
        snprintf(c->host, sizeof(c->host), "unknown");
    c->pid = (int)getpid();
    c->device = g->device;
#ifdef HEP_NO_CUDA
    if (g->cfg.backend == HEP_BACKEND_GPU)
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "the GPU backend is not in this build of hybridep: it was configured "
                        "without a CUDA toolkit (nvcc 12.8 or newer), so the GPU kernels were "
                        "left out; use HEP_BACKEND_HOST or rebuild with CUDA");
#endif
    if (g->cfg.backend == HEP_BACKEND_GPU) {
        cudaError_t e = cudaSetDevice(g->device);
        if (e == cudaSuccess)
            e = cudaDeviceGetAttribute(&c->sms, cudaDevAttrMultiProcessorCount, g->device);
        if (e == cudaSuccess)
            e = cudaDeviceGetPCIBusId(c->pci, sizeof(c->pci), g->device);
        if (e != cudaSuccess)
            return cuda_fail(e, "selecting CUDA device", 0);
    }
    return HEP_OK;
}

static int transport_is_loopback(const hep_group_hooks *h)
{
    const char *nic = hep_env_get()->nic;
    if (h && h->transport)
        return h->transport == 1;
    if (strcmp(nic, "loopback") == 0)
        return 1;
    if (strcmp(nic, "verbs") == 0)
        return 0;
    return 0; /* auto: a real NIC; virtual nodes on one host need HEP_NIC=loopback */
}

static int all_in_one_process(const rank_card *cards, int world)
{
    for (int r = 1; r < world; r++)
        if (strcmp(cards[r].host, cards[0].host) || cards[r].pid != cards[0].pid)
            return 0;
    return 1;
}

static int all_on_one_host(const rank_card *cards, int world)
{
    for (int r = 1; r < world; r++)
        if (strcmp(cards[r].host, cards[0].host))
            return 0;
    return 1;
}

/* 1 when the nodes of this group talk through the loopback NIC across the processes of
 * one host: the host backend (host memory in shared segments), N > 1, every rank on this
 * host but not all in one process, and the loopback NIC chosen (HEP_NIC=loopback, the test
 * hook, or HEP_NIC=auto on a host without an RDMA device). */
static int loopback_across_processes(const hep_group *g, const rank_card *cards,
                                     const hep_group_hooks *hooks)
{
    if (g->N < 2 || g->cfg.backend != HEP_BACKEND_HOST || all_in_one_process(cards, g->world) ||
        !all_on_one_host(cards, g->world))
        return 0;
    if (transport_is_loopback(hooks))
        return 1;
    return (!hooks || !hooks->transport) && strcmp(hep_env_get()->nic, "auto") == 0 &&
           hep_verbs_device_count() == 0;
}

/* The loopback NIC copies device memory with cudaMemcpyAsync, which runs on the SMs that
 * the kernels leave free: measured on an H200 (bench/RESULTS.md), 8 virtual ranks' kernels
 * at 16 SMs each (4 of 132 SMs free) make every network write 4.5-5x slower than at 12 SMs
 * (36 free), and the 2 x 4 phases 2x slower. A real NIC needs no SM. Said once, by rank 0. */
#define HEP_LOOPBACK_FREE_SMS 32
static void warn_loopback_sms(const hep_group *g, const rank_card *cards)
{
    int on_gpu = 0, sms = cards[0].sms;
    const int per = g->cfg.dispatch_sms > g->cfg.combine_sms ? g->cfg.dispatch_sms
                                                             : g->cfg.combine_sms;
    for (int r = 0; r < g->world; r++)
        on_gpu += cards[r].device == cards[0].device && cards[r].pid == cards[0].pid &&
                  strcmp(cards[r].host, cards[0].host) == 0;
    if (sms > 0 && (long)on_gpu * per > sms - HEP_LOOPBACK_FREE_SMS)
        hep_log(HEP_LOG_WARN,
                "loopback NIC: %d ranks on GPU %d x %d SMs leave %d of its %d SMs free; its "
                "copies (cudaMemcpyAsync) run on free SMs and slow down below %d free: "
                "dispatch_sms/combine_sms <= %d leave enough",
                on_gpu, cards[0].device, per, sms - on_gpu * per > 0 ? sms - on_gpu * per : 0,
                sms, HEP_LOOPBACK_FREE_SMS,
                (sms - HEP_LOOPBACK_FREE_SMS) / on_gpu > 0 ? (sms - HEP_LOOPBACK_FREE_SMS) / on_gpu : 1);
}

static int setup_internode(hep_group *g, const rank_card *cards, const hep_group_hooks *hooks,
                           int *dmabuf)
{
    hep_coord_options o = {0, NULL, 0, NULL};
    hep_loopback_window *win = NULL;
    int rc;
    o.host_memory = g->cfg.backend == HEP_BACKEND_HOST;
    o.loopback = transport_is_loopback(hooks);
    if (!hooks || !hooks->transport)
        if (strcmp(hep_env_get()->nic, "auto") == 0 && all_in_one_process(cards, g->world) &&
            hep_verbs_device_count() == 0)
            o.loopback = 1; /* virtual nodes in one process, no NIC: the loopback NIC */
    o.mr_override = hooks ? hooks->mr_override : NULL;
    if (g->nic_xproc) { /* host memory in shared segments, mapped by the peers */
        win = calloc((size_t)g->world, sizeof(*win));
        if (!win)
            return hep_fail(HEP_ERR_NOMEM, "group: out of memory");
        hep_shm_nic_windows(g, win);
        o.loopback = 1;
        o.windows = win;
    } else if (!all_in_one_process(cards, g->world) &&
               (o.loopback || hep_verbs_device_count() == 0)) {
        if (g->cfg.backend == HEP_BACKEND_GPU)
            return hep_fail(HEP_ERR_UNAVAILABLE,
                            "%d nodes of the GPU backend across processes need a verbs NIC: "
                            "with GPU buffers (device memory) the loopback NIC joins ranks of one "
                            "process only; across the processes of one host it serves the host "
                            "backend only%s (run virtual nodes in one process, or one node per "
                            "host with an RDMA device)",
                            g->N, o.loopback ? "" : ", and this host has no RDMA device");
        if (all_on_one_host(cards, g->world)) /* the verbs NIC asked for, none here */
            return hep_fail(HEP_ERR_UNAVAILABLE,
                            "%d nodes across processes: the verbs NIC was asked for "
                            "(HEP_NIC=verbs), and this host has no RDMA device (HEP_NIC=loopback "
                            "or auto joins the processes of one host through the loopback NIC)",
                            g->N);
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "%d nodes across hosts need a verbs NIC: the loopback NIC joins the "
                        "ranks of one host only%s (run the nodes on one host, or one node per "
                        "host with an RDMA device)",
                        g->N, o.loopback ? "" : ", and this host has no RDMA device");
    }
    if (o.loopback && g->cfg.backend == HEP_BACKEND_GPU && g->rank == 0)
        warn_loopback_sms(g, cards);
    rc = hep_coord_create(&g->plan, g->arena[HEP_ARENA_LOCAL], &g->bs, g->device, &o, &g->coord);
    free(win); /* the NIC keeps a copy */
    if (rc == HEP_OK)
        *dmabuf = g->coord->dmabuf;
    return rc;
}

/* A tag per group of this process, in every handle, so that one group refuses another's
 * handle although both count their calls from 1. Never 0 (0 is "no handle"). */
static uint64_t next_handle_tag(void)
{
    static uint64_t counter;
    uint64_t t;
    do
        t = __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED) & HEP_HANDLE_TAG_MASK;
    while (t == 0);
    return t;
}

static void teardown(hep_group *g)
{
    hep_ep_teardown(g);
    if (g->coord) {
        hep_coord_destroy(g->coord);
        g->coord = NULL;
    }
    unmap_peers(g);
    hep_shm_destroy(g); /* before free_arenas: the shared-memory arenas are not malloc'ed */
    free_arenas(g);
}

int hep_group_create_ex(const hep_config *cfg, const hep_bootstrap *bs, int cuda_device,
                        const hep_group_hooks *hooks, hep_group **out)
{
    hep_group *g;
    rank_card mine, *cards = NULL;
    int rc, *dmabuf = NULL, my_dmabuf = 0;

    if (!out || !bs || !bs->allgather || !bs->barrier || bs->size < 1 || bs->rank < 0 ||
        bs->rank >= bs->size)
        return hep_fail(HEP_ERR_INVALID, "hep_group_create: NULL output or invalid bootstrap");
    *out = NULL;
    g = calloc(1, sizeof(*g));
    cards = calloc((size_t)bs->size, sizeof(*cards));
    dmabuf = calloc((size_t)bs->size, sizeof(int));
    if (!g || !cards || !dmabuf) {
        free(g);
        free(cards);
        free(dmabuf);
        return hep_fail(HEP_ERR_NOMEM, "hep_group_create: out of memory");
    }
    g->bs = *bs;
    g->be.handle_tag = next_handle_tag();
    g->rank = bs->rank;
    g->world = bs->size;
    g->device = cuda_device;
    g->hold_credits = hooks ? hooks->hold_credits : 0;
    if (cfg)
        g->cfg = *cfg;

    /* 1. every rank's configuration and identity, checked together */
    rc = cfg ? hep_config_check(cfg, g->world) : hep_fail(HEP_ERR_INVALID, "config is NULL");
    if (rc == HEP_OK)
        rc = fill_card(g, &mine);
    else
        memset(&mine, 0, sizeof(mine));
    rc = hep_group_agree(g, rc, 0, NULL);
    if (rc == HEP_OK)
        rc = g->bs.allgather(g->bs.ctx, &mine, cards, sizeof(mine));
    if (rc == HEP_OK) {
        rc = compare_configs(cards, g->world);
        if (rc == HEP_OK)
            rc = pick_layout(g, cards);
        if (rc == HEP_OK)
            rc = hep_plan_make(&g->cfg, g->N, g->R, &g->plan);
        if (rc == HEP_OK)
            rc = check_sm_budget(g, cards);
        if (rc == HEP_OK)
            g->mates_one_gpu = mates_share_gpu(g, cards);
        if (rc == HEP_OK)
            g->mates_one_process = mates_in_process(g, cards);
        if (rc == HEP_OK)
            g->nic_xproc = loopback_across_processes(g, cards, hooks);
        /* 2. this rank's memory (host backend across processes: in shared memory) */
        if (rc == HEP_OK && g->cfg.backend == HEP_BACKEND_HOST && !all_in_one_process(cards, g->world))
            rc = hep_shm_create(g);
        if (rc == HEP_OK)
            rc = alloc_arenas(g);
        if (rc == HEP_OK && g->cfg.backend == HEP_BACKEND_GPU &&
            cudaIpcGetMemHandle(&mine.ipc, g->arena[HEP_ARENA_SHARED]) != cudaSuccess) {
            (void)cudaGetLastError();
            memset(&mine.ipc, 0, sizeof(mine.ipc)); /* only needed across processes */
        }
        mine.shared_base = (uint64_t)(uintptr_t)g->arena[HEP_ARENA_SHARED];
        rc = hep_group_agree(g, rc, 0, NULL);
    }
    /* 3. the node-mates' shared memory */
    if (rc == HEP_OK)
        rc = g->bs.allgather(g->bs.ctx, &mine, cards, sizeof(mine));
    if (rc == HEP_OK)
        rc = hep_group_agree(g, map_peers(g, cards), 0, NULL);
    /* 4. the inter-node transport and registrations */
    if (rc == HEP_OK && g->N > 1) {
        rc = setup_internode(g, cards, hooks, &my_dmabuf);
        rc = hep_group_agree(g, rc, my_dmabuf, dmabuf);
        if (rc == HEP_OK)
            rc = hep_group_agree(g, hep_coord_connect(g->coord, &g->bs), 0, NULL);
        if (rc == HEP_OK && g->local == 0) {
            int any = 0;
            for (int l = 0; l < g->R; l++)
                any |= dmabuf[g->node * g->R + l] > 0;
            if (any) {
                hep_log(HEP_LOG_INFO, "legacy GPU memory registration is unavailable; using "
                                      "DMA-BUF registration");
                g->dmabuf_banner = 1;
            }
        }
    }
    if (rc == HEP_OK)
        rc = hep_group_agree(g, hep_ep_setup(g), 0, NULL);
    if (rc == HEP_OK)
        rc = g->bs.barrier(g->bs.ctx);
    free(cards);
    free(dmabuf);
    if (rc != HEP_OK) {
        char keep[2048];
        snprintf(keep, sizeof(keep), "%s", hep_last_error());
        teardown(g);
        free(g);
        hep_set_error_text(keep);
        return rc;
    }
    *out = g;
    return HEP_OK;
}

int hep_group_create(const hep_config *cfg, const hep_bootstrap *bs, int cuda_device,
                     hep_group **out)
{
    return hep_group_create_ex(cfg, bs, cuda_device, NULL, out);
}

/* Ranks still inside a call that is timing out return within about 2 x HEP_TIMEOUT_MS
 * (a kernel's wait on a node-mate runs 2 + 1/8 bounds): destroy waits longer than that,
 * so that when every rank reaches it, the barrier holds and everything is freed. */
#define HEP_DESTROY_PATIENCE 4

/* Arenas a failed destroy could not free, kept reachable (and counted) rather than lost. */
typedef struct kept_arena {
    struct kept_arena *next;
    void *p;
    size_t bytes;
} kept_arena;
static kept_arena *kept_list;
static size_t kept_total;
static pthread_mutex_t kept_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t keep_arena(hep_group *g, int a)
{
    kept_arena *k = malloc(sizeof(*k));
    size_t bytes = g->plan.arena_bytes[a];
    if (!g->arena[a])
        return 0;
    pthread_mutex_lock(&kept_lock);
    if (k) {
        k->p = g->arena[a];
        k->bytes = bytes;
        k->next = kept_list;
        kept_list = k;
    }
    kept_total += bytes;
    pthread_mutex_unlock(&kept_lock);
    g->arena[a] = NULL;
    return bytes;
}

size_t hep_group_kept_bytes(void)
{
    size_t n;
    pthread_mutex_lock(&kept_lock);
    n = kept_total;
    pthread_mutex_unlock(&kept_lock);
    return n;
}

/* Host backend: tell every node-mate that this rank no longer reads its memory. After
 * this store nothing of mate l is touched again (l may free it as soon as it sees it). */
static void mark_departed(hep_group *g)
{
    for (int l = 0; l < g->R; l++)
        if (l != g->local)
            __atomic_store_n((uint64_t *)hep_peer_buf(g, l, HEP_BUF_MAILBOX) + HEP_MB_DEPARTED +
                                 g->local,
                             1, __ATOMIC_RELEASE);
}

/* Host backend: -1 if every node-mate has entered destroy, else the first that has not. */
static int first_absent_mate(hep_group *g)
{
    const uint64_t *mb = (const uint64_t *)hep_my_buf(g, HEP_BUF_MAILBOX);
    for (int l = 0; l < g->R; l++)
        if (l != g->local && !__atomic_load_n(mb + HEP_MB_DEPARTED + l, __ATOMIC_ACQUIRE))
            return g->node * g->R + l;
    return -1;
}

/* Ranks still inside a call that is timing out return within about 2 x HEP_TIMEOUT_MS
 * (a kernel's wait on a node-mate runs 2 + 1/8 bounds): destroy waits longer than that,
 * so that when every rank reaches it, the barrier holds and everything is freed. */
#define HEP_DESTROY_PATIENCE 4

int hep_group_destroy(hep_group *g)
{
    int rc, host, absent = -1;
    size_t kept = 0;
    char why[1024];
    if (!g)
        return HEP_OK;
    host = g->cfg.backend == HEP_BACKEND_HOST;
    /* nobody may still read or write this rank's memory */
    if (!host) {
        cudaSetDevice(g->device);
        cudaDeviceSynchronize();
        (void)cudaGetLastError();
    } else if (g->arena[HEP_ARENA_SHARED]) {
        mark_departed(g);
    }
    hep_wait_patience(HEP_DESTROY_PATIENCE);
    rc = g->bs.barrier(g->bs.ctx);
    hep_wait_patience(1);
    if (rc == HEP_OK || g->R == 1) {
        teardown(g);
        free(g);
        return rc;
    }
    snprintf(why, sizeof(why), "%s", hep_last_error());
    /* Host backend: node-mates poll each other's shared and local arenas; those that
     * entered destroy have stopped. GPU: a node-mate's kernels may still reach the shared
     * arena (the only one they map), and a node-mate in another process cannot be asked. */
    absent = host ? first_absent_mate(g) : g->node * g->R + (g->local + 1) % g->R;
    if (absent >= 0) {
        kept = keep_arena(g, HEP_ARENA_SHARED);
        if (host)
            kept += keep_arena(g, HEP_ARENA_LOCAL);
    }
    teardown(g);
    if (absent < 0)
        rc = hep_fail(rc, "rank %d: destroy barrier failed (%s); every node-mate had entered "
                          "destroy, so everything was freed", g->rank, why);
    else if (host)
        rc = hep_fail(rc,
                      "rank %d: destroy barrier failed (%s); node-mate rank %d did not enter "
                      "destroy and may still read this rank's memory, so its %zu bytes of "
                      "node-shared and local arenas were kept allocated; everything else was "
                      "freed",
                      g->rank, why, absent, kept);
    else
        rc = hep_fail(rc,
                      "rank %d: destroy barrier failed (%s); a node-mate's kernels may still "
                      "read or write this rank's node-shared arena, so its %zu bytes were kept "
                      "allocated; everything else was freed",
                      g->rank, why, kept);
    hep_log(HEP_LOG_WARN, "%s", hep_last_error());
    free(g);
    return rc;
}

int hep_group_get_info(const hep_group *g, hep_group_info *i)
{
    if (!g || !i)
        return hep_fail(HEP_ERR_INVALID, "hep_group_get_info: NULL argument");
    memset(i, 0, sizeof(*i));
    i->rank = g->rank;
    i->world = g->world;
    i->nodes = g->N;
    i->ranks_per_node = g->R;
    i->node = g->node;
    i->local_rank = g->local;
    i->max_recv_rows = g->plan.max_recv_rows;
    i->device_bytes = g->cfg.backend == HEP_BACKEND_GPU ? g->plan.device_bytes : 0;
    i->host_bytes = g->cfg.backend == HEP_BACKEND_GPU ? g->plan.host_bytes
                                                      : g->plan.device_bytes + g->plan.host_bytes;
    i->registrations = g->coord ? g->coord->registered : 0;
    i->dmabuf_registrations = g->coord ? g->coord->dmabuf : 0;
    i->transport = g->coord ? g->coord->net->v->name : "none";
    return HEP_OK;
}
