/* The host backend across processes (run under mpirun -np 4 or 8, one rank per process):
 * the node-shared arenas go through POSIX shared memory, and with several (virtual) nodes
 * the loopback NIC across processes carries the inter-node path (the rings of chunks with
 * credits, the CPU proxy) between the processes' shared segments. Proves: dispatch and
 * combine of one node of all processes, and of 2 nodes (and, with 4 processes, 4 nodes of
 * one rank), equal the global oracle (BF16 and FP8, int32 and int64 ids, caller and
 * in-place combine inputs, repeated calls, ring chunks of 1 and 3 tokens, caller handles
 * combined twice, the second time with probabilities, each probs_out element checked);
 * the expert-major layout across nodes (pad 1 and 4, a budget that drops rows, BF16 and
 * FP8) equals the same calls with every rank a thread of one process, every output bit for
 * bit, also past max_recv_rows through the expert-major staging of config.max_permuted_rows
 * rows, and a budget above both is refused with HEP_ERR_INVALID; nothing stays
 * in /dev/shm once creation returned and nothing stays mapped or open after destroy, nor
 * after a creation across nodes that failed on one rank. With the argument "missing" the
 * last rank never dispatches: every other rank's dispatch fails with HEP_ERR_TIMEOUT
 * naming it, and destroy leaves nothing behind. */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <mpi.h>

#include "ep_case.h"
#include "group/group.h"
#include "hybridep/bootstrap_mpi.h"
#include "hybridep/hybridep.h"
#include "ranks.h"

static int rank = -1, size = 0, failures;
#define CHECK(cond, ...)                                                                         \
    do {                                                                                         \
        if (!(cond)) {                                                                           \
            failures++;                                                                          \
            fprintf(stderr, "rank %d: FAILED %s: ", rank, #cond);                                \
            fprintf(stderr, __VA_ARGS__);                                                        \
            fprintf(stderr, "\n");                                                               \
        }                                                                                        \
    } while (0)

static void config(hep_config *c, int fp8, int R)
{
    hep_config_default(c);
    c->hidden = fp8 ? 256 : 136;
    c->max_tokens = 24;
    c->experts_per_rank = 3;
    c->max_topk = 4;
    c->dtype = fp8 ? HEP_DTYPE_FP8_E4M3 : HEP_DTYPE_BF16;
    c->backend = HEP_BACKEND_HOST;
    c->ranks_per_node = R;
}

/* Segments of this process's groups still named in /dev/shm. */
static int shm_names_of_this_process(void)
{
    char prefix[64];
    int n = 0;
    DIR *d = opendir("/dev/shm");
    struct dirent *e;
    if (!d)
        return 0;
    snprintf(prefix, sizeof(prefix), "hybridep.%d.", (int)getpid());
    while ((e = readdir(d)))
        n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    closedir(d);
    return n;
}

/* Mappings of hybridep segments in this process. */
static int shm_mappings(void)
{
    char line[512];
    int n = 0;
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f)
        return 0;
    while (fgets(line, sizeof(line), f))
        n += strstr(line, "/dev/shm/hybridep.") != NULL;
    fclose(f);
    return n;
}

/* After a combine whose every rank d passed (d + 1) x its received probabilities: token
 * i's row of probs_out holds, for each expert e it chose, (e's rank + 1) x the sum of its
 * weights for e, and 0 for every other expert. */
static void check_probs_out(const ep_case *c, const float *pout)
{
    const ep_rank_in *in = &c->in[rank];
    const int El = c->cfg.experts_per_rank, E = El * size;
    int bad = 0;
    for (int i = 0; i < in->t; i++)
        for (int e = 0; e < E; e++) {
            float want = 0;
            for (int k = 0; k < c->K; k++) {
                long long id = c->index64 ? ((const int64_t *)in->idx)[i * c->K + k]
                                          : ((const int32_t *)in->idx)[i * c->K + k];
                if (id == e)
                    want += in->weights[i * c->K + k];
            }
            want *= (float)(e / El + 1);
            if (fabsf(pout[(size_t)i * E + e] - want) > 1e-6f * (1 + fabsf(want)) && bad++ < 3)
                fprintf(stderr, "rank %d: probs_out[%d][%d] = %g, expected %g\n", rank, i, e,
                        pout[(size_t)i * E + e], want);
        }
    CHECK(bad == 0, "%d probabilities differ", bad);
}

/* Run this rank's share of case c (inputs identical on every process) `repeat` times;
 * with_handle: dispatch into a caller handle and combine with it twice (the second
 * combine's output is checked). */
static void run_mine(ep_case *c, const hep_bootstrap *bs, int with_handle)
{
    ep_rank_in *in = &c->in[rank];
    ep_rank_out *o = &c->out[rank];
    const int H = c->cfg.hidden, El = c->cfg.experts_per_rank;
    const size_t rb = (size_t)H * (c->cfg.dtype == HEP_DTYPE_FP8_E4M3 ? 1 : 2);
    hep_group *g = NULL;
    int rc = hep_group_create(&c->cfg, bs, 0, &g);
    CHECK(rc == 0, "create: %s", hep_last_error());
    if (rc) {
        o->rc_dispatch = rc;
        return;
    }
    CHECK(shm_names_of_this_process() == 0, "a segment is still named in /dev/shm");
    hep_handle *hd = NULL;
    if (with_handle)
        CHECK(hep_handle_create(g, &hd) == 0, "handle: %s", hep_last_error());
    for (int rep = 0; rep < c->repeat; rep++) {
        hep_dispatch_args da = {.num_tokens = in->t, .tokens = in->tokens, .scales = in->scales,
                                .topk_idx = in->idx, .topk = c->K, .topk_weights = in->weights,
                                .index_type = c->index64 ? HEP_INDEX_INT64 : HEP_INDEX_INT32};
        hep_dispatch_result dr;
        hep_combine_args ca;
        hep_dispatch_opts x;
        hep_combine_opts co;
        memset(&x, 0, sizeof(x));
        memset(&co, 0, sizeof(co));
        x.handle = hd;
        co.handle = hd;
        o->rc_dispatch = hd ? hep_dispatch_ex(g, &da, &x, &dr) : hep_dispatch(g, &da, &dr);
        CHECK(o->rc_dispatch == 0, "dispatch: %s", hep_last_error());
        if (o->rc_dispatch)
            break;
        free(o->tokens), free(o->probs), free(o->scales), free(o->tpe), free(o->expert_out);
        free(o->combined);
        o->num_recv = dr.num_recv;
        o->tpe = calloc((size_t)El, sizeof(int));
        memcpy(o->tpe, dr.host_counts + 1, (size_t)El * sizeof(int));
        o->tokens = malloc(rb * (size_t)dr.num_recv + 1);
        memcpy(o->tokens, dr.tokens, rb * (size_t)dr.num_recv);
        o->probs = malloc(sizeof(float) * (size_t)El * (size_t)dr.num_recv + 1);
        memcpy(o->probs, dr.probs, sizeof(float) * (size_t)El * (size_t)dr.num_recv);
        o->scales = calloc((size_t)(H / 128) * (size_t)dr.num_recv + 1, sizeof(float));
        if (dr.scales)
            memcpy(o->scales, dr.scales, sizeof(float) * (size_t)(H / 128) * (size_t)dr.num_recv);
        o->expert_out = malloc((size_t)H * 2 * (size_t)dr.num_recv + 16);
        for (int j = 0; j < dr.num_recv; j++)
            for (int h = 0; h < H; h++)
                o->expert_out[(size_t)j * H + h] =
                    bf16_of((float)((rank + 1) * 8 + rep + (j % 13)) + (float)(h % 5) * 0.25f);
        o->combined = malloc((size_t)H * 2 * (size_t)in->t + 16);
        memset(o->combined, 0xff, (size_t)H * 2 * (size_t)in->t);
        memset(&ca, 0, sizeof(ca));
        ca.handle = dr.handle;
        ca.out = o->combined;
        ca.expert_out = o->expert_out;
        if (c->zero_copy) {
            memcpy(hep_combine_input(g), o->expert_out, (size_t)H * 2 * (size_t)dr.num_recv);
            ca.expert_out = hep_combine_input(g);
        }
        o->rc_combine = hd ? hep_combine_ex(g, &ca, &co) : hep_combine(g, &ca);
        CHECK(o->rc_combine == 0, "combine: %s", hep_last_error());
        if (hd && o->rc_combine == 0) { /* once more with the same handle: the same sums */
            float *pin = malloc(sizeof(float) * (size_t)El * (size_t)dr.num_recv + 4);
            float *pout = malloc(sizeof(float) * (size_t)El * (size_t)size * (size_t)in->t + 4);
            for (size_t k = 0; k < (size_t)El * (size_t)dr.num_recv; k++)
                pin[k] = o->probs[k] * (float)(rank + 1);
            memset(o->combined, 0xff, (size_t)H * 2 * (size_t)in->t);
            co.probs_in = pin;
            co.probs_out = pout;
            o->rc_combine = hep_combine_ex(g, &ca, &co);
            CHECK(o->rc_combine == 0, "second combine: %s", hep_last_error());
            if (o->rc_combine == 0)
                check_probs_out(c, pout);
            free(pin), free(pout);
        }
        if (o->rc_combine)
            break;
    }
    if (c->cfg.ranks_per_node < size) { /* the inter-node path really ran, over the NIC */
        hep_group_stats st;
        memset(&st, 0, sizeof(st));
        CHECK(hep_group_get_stats(g, &st) == 0, "stats: %s", hep_last_error());
        CHECK(strcmp(st.transport, "loopback") == 0, "transport '%s'", st.transport);
        CHECK(st.net_data_writes > 0 && st.net_flags_done > 0, "%llu data writes, %llu flags",
              (unsigned long long)st.net_data_writes, (unsigned long long)st.net_flags_done);
    }
    hep_handle_destroy(hd);
    CHECK(hep_group_destroy(g) == 0, "destroy: %s", hep_last_error());
    CHECK(shm_names_of_this_process() == 0 && shm_mappings() == 0, "segments left after destroy");
}

/* Rank 0 receives every rank's outputs into c->out[] (sizes from the oracle's inputs). */
static void gather_outputs(ep_case *c)
{
    const int H = c->cfg.hidden, El = c->cfg.experts_per_rank, ns = H / 128;
    const int esz = c->cfg.dtype == HEP_DTYPE_FP8_E4M3 ? 1 : 2;
    for (int r = 1; r < size; r++) {
        ep_rank_out *o = &c->out[r];
        int n = 0, t = c->in[r].t;
        if (rank == r)
            MPI_Send(&o->num_recv, 1, MPI_INT, 0, 1, MPI_COMM_WORLD);
        if (rank == 0) {
            MPI_Recv(&n, 1, MPI_INT, r, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            o->num_recv = n;
            o->tpe = calloc((size_t)El, sizeof(int));
            o->tokens = calloc((size_t)n * (size_t)H * (size_t)esz + 1, 1);
            o->probs = calloc((size_t)n * (size_t)El + 1, sizeof(float));
            o->scales = calloc((size_t)n * (size_t)ns + 1, sizeof(float));
            o->expert_out = calloc((size_t)n * (size_t)H + 1, 2);
            o->combined = calloc((size_t)t * (size_t)H + 1, 2);
        }
        if (rank == 0 || rank == r) {
            n = o->num_recv;
            struct {
                void *p;
                int count;
                MPI_Datatype ty;
            } parts[] = {{o->tpe, El, MPI_INT},
                         {o->tokens, n * H * esz, MPI_BYTE},
                         {o->probs, n * El, MPI_FLOAT},
                         {o->scales, n * ns, MPI_FLOAT},
                         {o->expert_out, n * H, MPI_UINT16_T},
                         {o->combined, t * H, MPI_UINT16_T}};
            for (size_t k = 0; k < sizeof(parts) / sizeof(parts[0]); k++) {
                if (rank == r)
                    MPI_Send(parts[k].p, parts[k].count, parts[k].ty, 0, 2 + (int)k, MPI_COMM_WORLD);
                else
                    MPI_Recv(parts[k].p, parts[k].count, parts[k].ty, r, 2 + (int)k,
                             MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            }
        }
    }
}

/* R ranks per node (size: one node), ring chunks of `chunk` tokens (0: the default). */
static void oracle_case(const char *name, int fp8, int index64, int zero_copy, unsigned seed,
                        int R, int chunk, int with_handle, const hep_bootstrap *bs)
{
    static ep_case c;
    char label[256];
    int bad = 0;
    memset(&c, 0, sizeof(c));
    config(&c.cfg, fp8, R);
    if (chunk)
        c.cfg.chunk_tokens = chunk;
    snprintf(label, sizeof(label), "%d x %d across processes, %s", size / R, R, name);
    name = label;
    c.world = size;
    c.K = 3;
    c.index64 = index64;
    c.zero_copy = zero_copy;
    c.repeat = 3;
    c.skip_rank = -1;
    ep_case_random(&c, seed, R < size ? EP_ROUTE_NODES : 0);
    run_mine(&c, bs, with_handle);
    gather_outputs(&c);
    if (rank == 0) {
        bad = ep_case_check(&c);
        CHECK(bad == 0, "%s: %d mismatches against the oracle", name, bad);
        printf("%s: %s\n", bad ? "FAILED" : "ok", name);
    }
    ep_case_free(&c);
}

/* ---------------------------------------------------------------- expert-major
 * Across nodes and processes against the same calls on the same inputs with every rank a
 * thread of one process (virtual nodes over the in-process loopback NIC, checked against
 * an oracle by tests/test_train.c): every output, bit for bit. */
typedef struct em_res {
    int rc, num_permuted, overflow, overflow_rows;
    int64_t tpe[16];
    unsigned char *tok;
    float *prob, *scale, *pout;
    uint16_t *combined;
    char err[1024];
} em_res;

typedef struct em_case {
    ep_case c;
    int pad, budget;
    em_res ref[EP_MAX_RANKS]; /* the one-process run */
} em_case;

static void em_free(em_res *o)
{
    free(o->tok), free(o->prob), free(o->scale), free(o->pout), free(o->combined);
    memset(o, 0, sizeof(*o));
}

/* Rank r's expert-major dispatch into a caller handle, then its combine with
 * probabilities ((r + 1) x the received ones), into o. */
static void em_rank(const hep_bootstrap *bs, int r, const em_case *e, em_res *o)
{
    const hep_config *cfg = &e->c.cfg;
    const ep_rank_in *in = &e->c.in[r];
    const int H = cfg->hidden, El = cfg->experts_per_rank, B = e->budget;
    const int fp8 = cfg->dtype == HEP_DTYPE_FP8_E4M3, ns = H / 128;
    const size_t rb = (size_t)H * (fp8 ? 1 : 2), E = (size_t)El * (size_t)bs->size;
    hep_group_hooks hk;
    hep_group *g = NULL;
    hep_handle *h = NULL;
    hep_dispatch_opts x;
    hep_dispatch_result dr;
    hep_combine_args ca;
    hep_combine_opts co;
    uint16_t *eo;
    float *pin;
    memset(&hk, 0, sizeof(hk));
    hk.transport = 1;
    memset(o, 0, sizeof(*o));
    o->rc = hep_group_create_ex(cfg, bs, 0, &hk, &g);
    if (o->rc == 0)
        o->rc = hep_handle_create(g, &h);
    o->tok = calloc((size_t)B, rb);
    o->prob = calloc((size_t)B, sizeof(float));
    o->scale = calloc((size_t)B * (size_t)ns + 1, sizeof(float));
    o->combined = calloc((size_t)in->t * (size_t)H + 1, 2);
    o->pout = calloc((size_t)in->t * E + 1, sizeof(float));
    eo = malloc((size_t)B * (size_t)H * 2);
    pin = malloc((size_t)B * sizeof(float));
    if (o->rc == 0) {
        hep_dispatch_args da = {.num_tokens = in->t, .tokens = in->tokens, .scales = in->scales,
                                .topk_idx = in->idx, .topk = e->c.K,
                                .topk_weights = in->weights,
                                .index_type = e->c.index64 ? HEP_INDEX_INT64 : HEP_INDEX_INT32};
        memset(&x, 0, sizeof(x));
        x.handle = h;
        x.layout = HEP_LAYOUT_EXPERT_MAJOR;
        x.pad_multiple = e->pad;
        x.num_permuted_tokens = B;
        x.recv_tokens = o->tok;
        x.recv_probs = o->prob;
        x.recv_scales = fp8 ? o->scale : NULL;
        o->rc = hep_dispatch_ex(g, &da, &x, &dr);
    }
    if (o->rc == 0) {
        o->num_permuted = x.num_permuted;
        o->overflow = x.overflow;
        o->overflow_rows = x.overflow_rows;
        for (int k = 0; k < El && k < 16; k++)
            o->tpe[k] = x.tokens_per_expert[k];
        for (int p = 0; p < B; p++) {
            pin[p] = o->prob[p] * (float)(r + 1);
            for (int c = 0; c < H; c++)
                eo[(size_t)p * H + c] = ep_expert_value(r, p, c);
        }
        memset(&ca, 0, sizeof(ca));
        ca.out = o->combined;
        ca.expert_out = eo;
        memset(&co, 0, sizeof(co));
        co.handle = h;
        co.probs_in = pin;
        co.probs_out = o->pout;
        o->rc = hep_combine_ex(g, &ca, &co);
    }
    if (o->rc)
        snprintf(o->err, sizeof(o->err), "%s", hep_last_error());
    free(eo), free(pin);
    hep_handle_destroy(h);
    if (g && hep_group_destroy(g) && o->rc == 0)
        o->rc = -1;
}

static int em_thread(rank_ctx *r)
{
    em_case *e = r->arg;
    em_rank(&r->bs, r->rank, e, &e->ref[r->rank]);
    return e->ref[r->rank].rc;
}

/* em_rows: config.max_permuted_rows (the expert-major staging across processes), and then
 * config.max_recv_rows = recv_rows, fewer than the expert-major rows. */
static void expert_major_case(const char *name, int fp8, int index64, int pad, int budget,
                              int em_rows, int recv_rows, unsigned seed,
                              const hep_bootstrap *bs)
{
    static em_case e;
    static rank_ctx ctx[EP_MAX_RANKS];
    em_res mine;
    const int H = fp8 ? 256 : 136, El = 3, R = size / 2;
    const size_t rb = (size_t)H * (fp8 ? 1 : 2), E = (size_t)El * (size_t)size;
    int bad = 0, total = 0, most = 0, f0 = failures;
    memset(&e, 0, sizeof(e));
    config(&e.c.cfg, fp8, R);
    e.c.cfg.chunk_tokens = 3;
    e.c.cfg.max_permuted_rows = em_rows;
    e.c.cfg.max_recv_rows = em_rows ? recv_rows : 0;
    e.c.world = size;
    e.c.K = 3;
    e.c.index64 = index64;
    e.c.skip_rank = -1;
    e.pad = pad;
    e.budget = budget;
    ep_case_random(&e.c, seed, EP_ROUTE_NODES);
    em_rank(bs, rank, &e, &mine);
    CHECK(mine.rc == 0, "%s: %s", name, mine.err);
    /* the one-process run, one process at a time (2 cores) */
    for (int k = 0; k < size; k++) {
        if (k == rank) {
            CHECK(run_ranks(size, em_thread, &e, ctx) == 0, "threads did not run");
            CHECK(e.ref[rank].rc == 0, "one process: %s", e.ref[rank].err);
        }
        MPI_Barrier(MPI_COMM_WORLD);
    }
    if (mine.rc == 0 && e.ref[rank].rc == 0) {
        const em_res *w = &e.ref[rank];
        const int t = e.c.in[rank].t, n = w->num_permuted;
        bad += mine.num_permuted != n || mine.overflow != w->overflow ||
               mine.overflow_rows != w->overflow_rows;
        bad += memcmp(mine.tpe, w->tpe, sizeof(w->tpe)) != 0;
        if (!bad) {
            bad += memcmp(mine.tok, w->tok, (size_t)n * rb) != 0;
            bad += memcmp(mine.prob, w->prob, (size_t)n * sizeof(float)) != 0;
            bad += fp8 && memcmp(mine.scale, w->scale, (size_t)n * (H / 128) * sizeof(float));
            bad += memcmp(mine.combined, w->combined, (size_t)t * H * 2) != 0;
            bad += memcmp(mine.pout, w->pout, (size_t)t * E * sizeof(float)) != 0;
        }
        CHECK(bad == 0, "%s: %d of the outputs differ from one process's (rows %d vs %d)", name,
              bad, mine.num_permuted, n);
        total = w->overflow_rows;
        most = mine.num_permuted;
    }
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &most, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    /* the case is what its name says: rows past max_recv_rows (the staging), rows dropped */
    if (em_rows)
        CHECK(most > recv_rows, "%s: at most %d rows on a rank, not past max_recv_rows %d", name,
              most, recv_rows);
    if (strstr(name, "drops"))
        CHECK(total > 0, "%s: no row dropped", name);
    bad = failures - f0;
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
        printf("%s: 2 x %d across processes, expert-major, %s (pad %d, budget %d, up to %d rows "
               "on a rank, %d dropped in all): as in one process\n",
               bad ? "FAILED" : "ok", R, name, pad, budget, most, total);
    em_free(&mine);
    for (int r = 0; r < size; r++)
        em_free(&e.ref[r]);
    ep_case_free(&e.c);
}

/* Across nodes with a node's ranks in several processes: an expert-major budget above
 * max_recv_rows and config.max_permuted_rows (0 here) is refused (HEP_ERR_INVALID);
 * rank-major into a handle, with probabilities back through combine, works. */
static void expert_major_budget_above_the_receive_rows_is_refused(const hep_bootstrap *bs)
{
    hep_config c;
    hep_group *g = NULL;
    hep_handle *h = NULL;
    ep_case ec;
    char why[1024] = "";
    int rc;
    config(&c, 0, size / 2);
    rc = hep_group_create(&c, bs, 0, &g);
    CHECK(rc == 0, "create: %s", hep_last_error());
    if (rc)
        return;
    CHECK(hep_handle_create(g, &h) == 0, "handle: %s", hep_last_error());
    memset(&ec, 0, sizeof(ec));
    ec.cfg = c;
    ec.world = size;
    ec.K = 2;
    ep_case_random(&ec, 5, 0);
    {
        ep_rank_in *in = &ec.in[rank];
        const int H = c.hidden, El = c.experts_per_rank;
        uint16_t *rt = calloc((size_t)64 * H, 2), *out = calloc((size_t)c.max_tokens * H + 8, 2);
        float *rp = calloc(64, sizeof(float));
        float *pin = calloc((size_t)c.max_tokens * (size_t)size * (size_t)El + 8, 4);
        float *pout = calloc((size_t)c.max_tokens * El * size + 8, 4);
        hep_dispatch_args da = {.num_tokens = in->t, .tokens = in->tokens, .topk_idx = in->idx,
                                .topk = ec.K, .topk_weights = in->weights,
                                .index_type = HEP_INDEX_INT32};
        hep_dispatch_opts x;
        hep_dispatch_result dr;
        hep_combine_args ca;
        hep_combine_opts co;
        hep_group_info info;
        CHECK(hep_group_get_info(g, &info) == 0, "info: %s", hep_last_error());
        memset(&x, 0, sizeof(x));
        x.handle = h;
        x.layout = HEP_LAYOUT_EXPERT_MAJOR;
        x.num_permuted_tokens = (int)info.max_recv_rows + 1;
        x.recv_tokens = rt;
        x.recv_probs = rp;
        rc = hep_dispatch_ex(g, &da, &x, &dr);
        CHECK(rc == HEP_ERR_INVALID, "expert-major budget above max_recv_rows: status %d: %s",
              rc, hep_last_error());
        CHECK(strstr(hep_last_error(), "max_recv_rows") != NULL, "%s", hep_last_error());
        snprintf(why, sizeof(why), "%s", hep_last_error());
        /* rank-major into the handle works, with probabilities back through combine */
        memset(&x, 0, sizeof(x));
        x.handle = h;
        rc = hep_dispatch_ex(g, &da, &x, &dr);
        CHECK(rc == 0, "dispatch: %s", hep_last_error());
        memset(&ca, 0, sizeof(ca));
        ca.out = out;
        ca.expert_out = dr.tokens;
        memset(&co, 0, sizeof(co));
        co.handle = h;
        co.probs_in = pin;
        co.probs_out = pout;
        rc = hep_combine_ex(g, &ca, &co);
        CHECK(rc == 0, "combine with probabilities: %s", hep_last_error());
        if (rank == 0)
            printf("ok: across nodes and processes an expert-major budget above max_recv_rows "
                   "is refused: %s\n", why);
        free(rt), free(out), free(rp), free(pin), free(pout);
    }
    ep_case_free(&ec);
    hep_handle_destroy(h);
    CHECK(hep_group_destroy(g) == 0, "destroy: %s", hep_last_error());
}

/* The last rank creates the group but never dispatches: the others time out naming it. */
static void a_rank_that_never_arrives_is_named(const hep_bootstrap *bs)
{
    hep_config c;
    hep_group *g = NULL;
    ep_case ec;
    char want[64];
    int rc, missing = size - 1;
    config(&c, 0, size / 2);
    c.chunk_tokens = 3;
    rc = hep_group_create(&c, bs, 0, &g);
    CHECK(rc == 0, "create: %s", hep_last_error());
    if (rc)
        return;
    memset(&ec, 0, sizeof(ec));
    ec.cfg = c;
    ec.world = size;
    ec.K = 3;
    ep_case_random(&ec, 13, EP_ROUTE_NODES);
    snprintf(want, sizeof(want), "rank %d did not arrive", missing);
    if (rank != missing) {
        ep_rank_in *in = &ec.in[rank];
        hep_dispatch_args da = {.num_tokens = in->t, .tokens = in->tokens, .topk_idx = in->idx,
                                .topk = ec.K, .topk_weights = in->weights,
                                .index_type = HEP_INDEX_INT32};
        hep_dispatch_result dr;
        rc = hep_dispatch(g, &da, &dr);
        CHECK(rc == HEP_ERR_TIMEOUT, "status %d: %s", rc, hep_last_error());
        CHECK(strstr(hep_last_error(), want) != NULL, "the message does not name rank %d: %s",
              missing, hep_last_error());
        printf("rank %d: ok: %s\n", rank, hep_last_error());
    }
    ep_case_free(&ec);
    rc = hep_group_destroy(g);
    CHECK(rc == 0, "destroy: %s", hep_last_error());
    CHECK(shm_names_of_this_process() == 0 && shm_mappings() == 0, "segments left after destroy");
}

static struct ibv_mr *no_reg_mr(void *ctx, struct ibv_pd *pd, void *a, size_t l, int acc)
{
    (void)ctx, (void)pd, (void)a, (void)l, (void)acc;
    errno = ENOMEM;
    return NULL;
}
static int no_dmabuf(void *ctx, int dev)
{
    (void)ctx, (void)dev;
    return 0;
}

/* 2 nodes whose creation fails on the last rank after every segment was mapped and its
 * loopback NIC made (its registrations fail): every rank fails with that rank's message,
 * and nothing stays named, mapped or open. */
static void a_failed_creation_leaves_nothing(const hep_bootstrap *bs)
{
    hep_config c;
    hep_group *g = NULL;
    hep_gpu_mr_ops ops;
    hep_group_hooks hk;
    char want[32];
    int fds0 = count_fds(), rc;
    memset(&ops, 0, sizeof(ops));
    ops.reg_mr = no_reg_mr;
    ops.dmabuf_supported = no_dmabuf;
    memset(&hk, 0, sizeof(hk));
    hk.transport = 1;
    hk.mr_override = rank == size - 1 ? &ops : NULL;
    config(&c, 1, size / 2);
    rc = hep_group_create_ex(&c, bs, 0, &hk, &g);
    CHECK(rc != 0 && g == NULL, "created (status %d)", rc);
    snprintf(want, sizeof(want), "rank %d: ", size - 1);
    if (rank != size - 1)
        CHECK(strstr(hep_last_error(), want) != NULL, "not the last rank's failure: %s",
              hep_last_error());
    CHECK(shm_names_of_this_process() == 0, "segments left in /dev/shm");
    CHECK(shm_mappings() == 0, "%d segments mapped after the failure", shm_mappings());
    CHECK(count_fds() == fds0, "%d fds before, %d after", fds0, count_fds());
    if (rank == 0)
        printf("ok: a creation of 2 nodes failing on rank %d leaves nothing: %s\n", size - 1,
               hep_last_error());
}

static void create_destroy_leaves_nothing(const hep_bootstrap *bs)
{
    hep_config c;
    int fds0 = count_fds();
    config(&c, 1, size);
    for (int i = 0; i < 5; i++) {
        hep_group *g = NULL;
        int rc = hep_group_create(&c, bs, 0, &g);
        CHECK(rc == 0, "create %d: %s", i, hep_last_error());
        CHECK(shm_mappings() == size, "%d segments mapped, expected %d", shm_mappings(), size);
        CHECK(hep_group_destroy(g) == 0, "destroy: %s", hep_last_error());
    }
    config(&c, 0, size / 2);
    for (int i = 0; i < 5; i++) { /* 2 nodes: node-mates' and the peer's segments */
        hep_group *g = NULL;
        int rc = hep_group_create(&c, bs, 0, &g);
        CHECK(rc == 0, "create %d: %s", i, hep_last_error());
        CHECK(shm_mappings() == size / 2 + 1, "%d segments mapped, expected %d", shm_mappings(),
              size / 2 + 1);
        CHECK(hep_group_destroy(g) == 0, "destroy: %s", hep_last_error());
    }
    CHECK(shm_mappings() == 0, "%d segments still mapped after destroy", shm_mappings());
    CHECK(shm_names_of_this_process() == 0, "segments left in /dev/shm");
    CHECK(count_fds() == fds0, "%d fds before, %d after", fds0, count_fds());
    if (rank == 0)
        printf("ok: create/destroy x5 (1 and 2 nodes) leaves no segment, mapping or fd\n");
}

int main(int argc, char **argv)
{
    hep_bootstrap bs;
    int total = 0, rc;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size > EP_MAX_RANKS) {
        fprintf(stderr, "run with at most %d processes\n", EP_MAX_RANKS);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    rc = hep_bootstrap_mpi_create(MPI_COMM_WORLD, &bs);
    CHECK(rc == 0, "%s", hep_last_error());
    if (argc > 1 && strcmp(argv[1], "missing") == 0) {
        a_rank_that_never_arrives_is_named(&bs);
    } else {
        oracle_case("BF16, int32 ids, caller's combine input", 0, 0, 0, 7, size, 0, 0, &bs);
        oracle_case("FP8, int64 ids, in-place combine input", 1, 1, 1, 11, size, 0, 0, &bs);
        oracle_case("BF16, int32 ids, chunks of 1 token", 0, 0, 0, 17, size / 2, 1, 0, &bs);
        oracle_case("FP8, int64 ids, in-place, chunks of 3", 1, 1, 1, 19, size / 2, 3, 0, &bs);
        oracle_case("BF16, int64 ids, caller handle combined twice (probabilities), chunks of 3",
                    0, 1, 0, 23, size / 2, 3, 1, &bs);
        oracle_case("FP8, int32 ids, caller handle combined twice (probabilities), one node", 1,
                    0, 0, 31, size, 0, 1, &bs);
        if (size == 4)
            oracle_case("FP8, int32 ids, chunks of 1", 1, 0, 0, 29, 1, 1, 0, &bs);
        expert_major_case("BF16, int32 ids", 0, 0, 1, size * 24, 0, 0, 41, &bs);
        expert_major_case("FP8, int64 ids, a budget that drops rows", 1, 1, 4, 16, 0, 0, 43, &bs);
        /* more rows than max_recv_rows: through the expert-major staging */
        expert_major_case("BF16, int64 ids, in the staging of max_permuted_rows", 0, 1, 16,
                          size * 24 * 3 + 48, size * 24 * 3 + 48, 48, 47, &bs);
        expert_major_case("FP8, int32 ids, in the staging of max_permuted_rows", 1, 0, 16, 64,
                          64, 44, 53, &bs);
        expert_major_budget_above_the_receive_rows_is_refused(&bs);
        a_failed_creation_leaves_nothing(&bs);
        create_destroy_leaves_nothing(&bs);
    }
    hep_bootstrap_mpi_destroy(&bs);
    MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
        printf("%s\n", total ? "FAILED" : "all passed");
    MPI_Finalize();
    return total ? 1 : 0;
}
