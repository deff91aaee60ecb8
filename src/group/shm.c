/* group/shm.c: the host backend's node-shared memory across processes (see shm.h).
 *
 * Segment of one rank: [header page][shared arena][local arena][input staging][combine
 * layout], each part page-aligned. Node-mates have the same plan, so the same offsets; a mate's segment is
 * accepted only with the expected size, magic, rank and the key its owner sent through the
 * bootstrap (a stale or foreign segment of the same name is refused, never read). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/core.h"
#include "group/shm.h"

#define SHM_MAGIC 0x3130686d73706568ull /* "hepshm01" */
#define SHM_PAGE ((size_t)4096)

typedef struct seg_header {
    uint64_t magic, key, len;
    int32_t rank, world;
} seg_header;

typedef struct shm_card { /* what a rank tells its node-mates */
    char name[48];
    char host[64];
    uint64_t key, len;
    uint64_t local; /* its local arena's address in its own process (the NIC's window) */
} shm_card;

struct hep_shm {
    char name[48];
    int linked;
    char *base;
    size_t len;
    size_t off_local, off_stage, off_comb;       /* the shared arena starts at SHM_PAGE */
    size_t off_em, off_em_prob;                  /* N > 1: the expert-major staging (0: none) */
    size_t st_scales, st_idx, st_weights;        /* staging offsets (tokens at 0) */
    char *mate[HEP_MAX_LOCAL];                   /* node-mates' segments, mapped here */
    char **peer;                                 /* g->nic_xproc: [N] each other node's rank
                                                    of this local rank, mapped here */
    uint64_t *local_at;                          /* [world] each rank's local arena in its
                                                    own process (after hep_shm_map_mates) */
};

static size_t page_up(size_t n)
{
    return (n + SHM_PAGE - 1) & ~(SHM_PAGE - 1);
}
static size_t align16(size_t n)
{
    return (n + 15) & ~(size_t)15;
}

/* Offsets of the segment's parts; HEP_ERR_INVALID if its size would overflow. */
static int layout(const hep_group *g, struct hep_shm *s)
{
    const size_t T = (size_t)g->cfg.max_tokens, H = (size_t)g->cfg.hidden;
    const size_t K = (size_t)g->cfg.max_topk;
    const int fp8 = g->cfg.dtype == HEP_DTYPE_FP8_E4M3;
    const size_t rb = H * (fp8 ? 1 : 2), ns = fp8 ? H / HEP_FP8_BLOCK : 0;
    size_t shared = g->plan.arena_bytes[HEP_ARENA_SHARED];
    size_t local = g->plan.arena_bytes[HEP_ARENA_LOCAL];
    /* T, H, K are bounded by hep_config_check (65536, 65536, 32): no product overflows */
    size_t stage = align16(T * rb);
    s->st_scales = stage;
    stage = align16(stage + T * ns * 4);
    s->st_idx = stage;
    stage = align16(stage + T * K * 8);
    s->st_weights = stage;
    stage += T * K * 4;
    if (shared > SIZE_MAX / 4 || local > SIZE_MAX / 4)
        return hep_fail(HEP_ERR_INVALID, "host shared memory: arenas of %zu + %zu bytes", shared,
                        local);
    s->off_local = SHM_PAGE + page_up(shared);
    s->off_stage = s->off_local + page_up(local);
    s->off_comb = s->off_stage + page_up(stage);
    /* the combine layout (backend/backend.h, HEP_SHM_COMB_*): its words, then [W][E_l]
     * int32 (W < 2^31, E_l <= 1024: under 2^44 bytes, no overflow) */
    s->len = s->off_comb +
             page_up(HEP_SHM_COMB_WORDS * 8 + (size_t)g->world * (size_t)g->cfg.experts_per_rank * 4);
    /* across nodes, config.max_permuted_rows BF16 rows and their f32 probabilities: the
     * expert-major combine inputs that do not fit exchange.token (max_permuted_rows <= 2^30,
     * H <= 65536: under 2^48 bytes, no overflow) */
    if (g->N > 1 && g->cfg.max_permuted_rows > 0) {
        const size_t er = (size_t)g->cfg.max_permuted_rows;
        s->off_em = s->len;
        s->off_em_prob = s->off_em + page_up(er * H * 2);
        s->len = s->off_em_prob + page_up(er * 4);
    }
    return HEP_OK;
}

static uint64_t make_key(void)
{
    uint64_t k = 0;
    if (getrandom(&k, sizeof(k), 0) != (ssize_t)sizeof(k)) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        k = ((uint64_t)ts.tv_nsec << 20) ^ (uint64_t)ts.tv_sec ^ ((uint64_t)getpid() << 40);
    }
    return k | 1; /* never 0 */
}

int hep_shm_create(hep_group *g)
{
    static unsigned seq;
    struct hep_shm *s = calloc(1, sizeof(*s));
    seg_header *h;
    int fd, err, rc;
    if (!s)
        return hep_fail(HEP_ERR_NOMEM, "host shared memory: out of memory");
    rc = layout(g, s);
    if (rc) {
        free(s);
        return rc;
    }
    snprintf(s->name, sizeof(s->name), "/hybridep.%d.%u.%d", (int)getpid(),
             __atomic_fetch_add(&seq, 1, __ATOMIC_RELAXED), g->rank);
    fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        err = errno;
        rc = hep_fail(err == ENOSPC || err == ENOMEM ? HEP_ERR_NOMEM : HEP_ERR_UNAVAILABLE,
                      "host shared memory: shm_open('%s') failed: %s (is /dev/shm mounted "
                      "and writable?)",
                      s->name, strerror(err));
        free(s);
        return rc;
    }
    s->linked = 1;
    err = ftruncate(fd, (off_t)s->len) ? errno : 0;
    /* reserve the pages now: a full /dev/shm is an error here, not a SIGBUS later */
    if (!err) {
        err = posix_fallocate(fd, 0, (off_t)s->len);
        if (err == EOPNOTSUPP || err == EINVAL)
            err = 0;
    }
    if (!err) {
        void *p = mmap(NULL, s->len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED)
            err = errno;
        else
            s->base = p;
    }
    close(fd); /* the mapping keeps the segment; no fd outlives this call */
    if (err) {
        shm_unlink(s->name);
        rc = hep_fail(err == ENOSPC || err == ENOMEM ? HEP_ERR_NOMEM : HEP_ERR_UNAVAILABLE,
                      "host shared memory: %zu bytes for segment '%s' failed: %s (/dev/shm too "
                      "small? docker: --shm-size)",
                      s->len, s->name, strerror(err));
        free(s);
        return rc;
    }
    h = (seg_header *)s->base;
    h->key = make_key();
    h->len = s->len;
    h->rank = g->rank;
    h->world = g->world;
    h->magic = SHM_MAGIC;
    g->shm = s;
    if (g->plan.arena_bytes[HEP_ARENA_SHARED])
        g->arena[HEP_ARENA_SHARED] = s->base + SHM_PAGE;
    if (g->plan.arena_bytes[HEP_ARENA_LOCAL])
        g->arena[HEP_ARENA_LOCAL] = s->base + s->off_local;
    return HEP_OK;
}

/* Map node-mate `rank`'s segment as its card describes it; every field is checked. */
static int open_mate(const hep_group *g, int rank, const shm_card *c, char **out)
{
    const struct hep_shm *s = g->shm;
    struct stat st;
    const seg_header *h;
    void *p;
    int fd, err;
    if (c->len != s->len)
        return hep_fail(HEP_ERR_MISMATCH,
                        "host shared memory: rank %d's segment '%.47s' has %llu bytes, this "
                        "rank's %zu (different builds?)",
                        rank, c->name, (unsigned long long)c->len, s->len);
    fd = shm_open(c->name, O_RDWR, 0);
    if (fd < 0) {
        err = errno;
        return hep_fail(HEP_ERR_UNAVAILABLE,
                        "host shared memory: cannot open rank %d's segment '%.47s': %s (another "
                        "user, container or mount namespace?)",
                        rank, c->name, strerror(err));
    }
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != c->len) {
        close(fd);
        return hep_fail(HEP_ERR_MISMATCH,
                        "host shared memory: rank %d's segment '%.47s' is not %llu bytes long",
                        rank, c->name, (unsigned long long)c->len);
    }
    p = mmap(NULL, s->len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    err = p == MAP_FAILED ? errno : 0;
    close(fd);
    if (err)
        return hep_fail(HEP_ERR_NOMEM, "host shared memory: mapping rank %d's segment: %s", rank,
                        strerror(err));
    h = p;
    if (h->magic != SHM_MAGIC || h->key != c->key || h->len != c->len || h->rank != rank ||
        h->world != g->world) {
        munmap(p, s->len);
        return hep_fail(HEP_ERR_MISMATCH,
                        "host shared memory: segment '%.47s' is not rank %d's of this group "
                        "(wrong key, rank or size)",
                        c->name, rank);
    }
    *out = p;
    return HEP_OK;
}

/* open_mate for rank r, which must be on this rank's host (`need` says why it must). */
static int open_on_host(const hep_group *g, int r, const shm_card *all, const shm_card *mine,
                        const char *need, char **out)
{
    if (strcmp(all[r].host, mine->host) != 0)
        return hep_fail(HEP_ERR_INVALID, "%s: rank %d is on '%.63s', rank %d on '%.63s'", need,
                        g->rank, mine->host, r, all[r].host);
    return open_mate(g, r, &all[r], out);
}

int hep_shm_map_mates(hep_group *g)
{
    struct hep_shm *s = g->shm;
    shm_card mine, *all;
    int rc, gathered;
    memset(&mine, 0, sizeof(mine));
    snprintf(mine.name, sizeof(mine.name), "%s", s->name);
    if (gethostname(mine.host, sizeof(mine.host) - 1) != 0)
        snprintf(mine.host, sizeof(mine.host), "unknown");
    mine.key = ((const seg_header *)s->base)->key;
    mine.len = s->len;
    mine.local = (uint64_t)(uintptr_t)(s->base + s->off_local);
    all = calloc((size_t)g->world, sizeof(*all));
    s->local_at = calloc((size_t)g->world, sizeof(*s->local_at));
    if (g->nic_xproc && !s->peer)
        s->peer = calloc((size_t)g->N, sizeof(*s->peer));
    if (!all || !s->local_at || (g->nic_xproc && !s->peer)) {
        free(all);
        return hep_fail(HEP_ERR_NOMEM, "host shared memory: out of memory");
    }
    rc = g->bs.allgather(g->bs.ctx, &mine, all, sizeof(mine));
    gathered = rc == HEP_OK;
    for (int l = 0; rc == HEP_OK && l < g->R; l++) {
        if (l == g->local)
            continue;
        rc = open_on_host(g, g->node * g->R + l, all, &mine, "the host backend needs the ranks "
                          "of a node on one host", &s->mate[l]);
        g->peer_shared[l] = s->mate[l] ? s->mate[l] + SHM_PAGE : NULL;
    }
    /* the loopback NIC across processes: the rank of each other node that this rank's
     * proxy writes to (the same local rank), mapped as node-mates are */
    for (int m = 0; rc == HEP_OK && g->nic_xproc && m < g->N; m++)
        if (m != g->node)
            rc = open_on_host(g, m * g->R + g->local, all, &mine, "the loopback NIC across "
                              "processes needs every rank on one host", &s->peer[m]);
    for (int r = 0; gathered && r < g->world; r++)
        s->local_at[r] = all[r].local;
    g->peer_shared[g->local] = g->arena[HEP_ARENA_SHARED];
    free(all);
    /* once every rank is past its mapping, the name is not needed: nothing stays in
     * /dev/shm (after a failed allgather nobody will map it either) */
    if (gathered)
        rc = hep_group_agree(g, rc, 0, NULL);
    shm_unlink(s->name);
    s->linked = 0;
    return rc;
}

void hep_shm_destroy(hep_group *g)
{
    struct hep_shm *s = g->shm;
    if (!s)
        return;
    for (int l = 0; l < HEP_MAX_LOCAL; l++)
        if (s->mate[l]) {
            munmap(s->mate[l], s->len);
            s->mate[l] = NULL;
            if (l < g->R && l != g->local)
                g->peer_shared[l] = NULL;
        }
    for (int m = 0; s->peer && m < g->N; m++)
        if (s->peer[m])
            munmap(s->peer[m], s->len);
    free(s->peer);
    free(s->local_at);
    if (s->linked)
        shm_unlink(s->name);
    /* a late node-mate keeps its own mapping: unmapping here cannot make it fault */
    munmap(s->base, s->len);
    g->arena[HEP_ARENA_SHARED] = NULL;
    g->arena[HEP_ARENA_LOCAL] = NULL;
    g->peer_shared[g->local] = NULL;
    free(s);
    g->shm = NULL;
}

void hep_shm_fill_view(const hep_group *g, hep_backend_ctx *b)
{
    const struct hep_shm *s = g->shm;
    b->shm = s;
    if (!s)
        return;
    for (int l = 0; l < g->R; l++) {
        b->shm_local[l] = l == g->local ? g->arena[HEP_ARENA_LOCAL]
                          : s->mate[l]   ? s->mate[l] + s->off_local
                                         : NULL;
        b->shm_stage[l] = l == g->local ? s->base + s->off_stage
                          : s->mate[l]   ? s->mate[l] + s->off_stage
                                         : NULL;
        b->shm_comb[l] = l == g->local ? s->base + s->off_comb
                         : s->mate[l]   ? s->mate[l] + s->off_comb
                                        : NULL;
        b->shm_em[l] = !s->off_em        ? NULL
                       : l == g->local ? s->base + s->off_em
                       : s->mate[l]     ? s->mate[l] + s->off_em
                                        : NULL;
    }
    b->shm_st_scales = s->st_scales;
    b->shm_st_idx = s->st_idx;
    b->shm_st_weights = s->st_weights;
    b->shm_em_prob = s->off_em_prob - s->off_em;
    b->shm_em_rows = s->off_em ? (size_t)g->cfg.max_permuted_rows : 0;
}

void hep_shm_nic_windows(const hep_group *g, hep_loopback_window *win)
{
    const struct hep_shm *s = g->shm;
    for (int r = 0; r < g->world; r++) {
        const int n = r / g->R, l = r % g->R;
        char *seg = r == g->rank     ? s->base
                    : n == g->node   ? s->mate[l]
                    : l == g->local && s->peer ? s->peer[n]
                                     : NULL;
        win[r].base = s->local_at ? s->local_at[r] : 0;
        win[r].len = g->plan.arena_bytes[HEP_ARENA_LOCAL];
        win[r].here = seg ? seg + s->off_local : NULL;
    }
}
