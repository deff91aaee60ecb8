/* The host backend across processes (run under mpirun -np 4, one rank per process): the
 * node-shared arenas go through POSIX shared memory. Proves: dispatch and combine of one
 * node of 4 processes equal the global oracle (BF16 and FP8, int32 and int64 ids, caller
 * and in-place combine inputs, repeated calls); nothing stays in /dev/shm once creation
 * returned and nothing stays mapped or open after destroy; several nodes across processes
 * without a NIC are refused with HEP_ERR_UNAVAILABLE naming the loopback NIC. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <mpi.h>

#include "ep_case.h"
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

/* Run this rank's share of case c (inputs identical on every process) `repeat` times. */
static void run_mine(ep_case *c, const hep_bootstrap *bs)
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
    for (int rep = 0; rep < c->repeat; rep++) {
        hep_dispatch_args da = {.num_tokens = in->t, .tokens = in->tokens, .scales = in->scales,
                                .topk_idx = in->idx, .topk = c->K, .topk_weights = in->weights,
                                .index_type = c->index64 ? HEP_INDEX_INT64 : HEP_INDEX_INT32};
        hep_dispatch_result dr;
        hep_combine_args ca;
        o->rc_dispatch = hep_dispatch(g, &da, &dr);
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
        o->rc_combine = hep_combine(g, &ca);
        CHECK(o->rc_combine == 0, "combine: %s", hep_last_error());
        if (o->rc_combine)
            break;
    }
    CHECK(hep_group_destroy(g) == 0, "destroy: %s", hep_last_error());
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

static void oracle_case(const char *name, int fp8, int index64, int zero_copy, unsigned seed,
                        const hep_bootstrap *bs)
{
    static ep_case c;
    int bad = 0;
    memset(&c, 0, sizeof(c));
    config(&c.cfg, fp8, size);
    c.world = size;
    c.K = 3;
    c.index64 = index64;
    c.zero_copy = zero_copy;
    c.repeat = 3;
    c.skip_rank = -1;
    ep_case_random(&c, seed, 0);
    run_mine(&c, bs);
    gather_outputs(&c);
    if (rank == 0) {
        bad = ep_case_check(&c);
        CHECK(bad == 0, "%s: %d mismatches against the oracle", name, bad);
        printf("%s: %s\n", bad ? "FAILED" : "ok", name);
    }
    ep_case_free(&c);
}

static void refuses_nodes_across_processes(const hep_bootstrap *bs)
{
    hep_config c;
    hep_group *g = NULL;
    int rc;
    config(&c, 0, 2);
    rc = hep_group_create(&c, bs, 0, &g);
    CHECK(rc == HEP_ERR_UNAVAILABLE, "status %d: %s", rc, hep_last_error());
    CHECK(strstr(hep_last_error(), "loopback NIC joins ranks of one process only") != NULL, "%s",
          hep_last_error());
    CHECK(g == NULL, "a group was returned");
    CHECK(shm_names_of_this_process() == 0 && shm_mappings() == 0, "segments left after a failure");
    if (rank == 0)
        printf("ok: two nodes across processes without a NIC are refused: %s\n", hep_last_error());
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
    CHECK(shm_mappings() == 0, "%d segments still mapped after destroy", shm_mappings());
    CHECK(shm_names_of_this_process() == 0, "segments left in /dev/shm");
    CHECK(count_fds() == fds0, "%d fds before, %d after", fds0, count_fds());
    if (rank == 0)
        printf("ok: create/destroy x5 leaves no segment, mapping or fd\n");
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
    oracle_case("one node across processes, BF16, int32 ids, caller's combine input", 0, 0, 0, 7,
                &bs);
    oracle_case("one node across processes, FP8, int64 ids, in-place combine input", 1, 1, 1, 11,
                &bs);
    refuses_nodes_across_processes(&bs);
    create_destroy_leaves_nothing(&bs);
    hep_bootstrap_mpi_destroy(&bs);
    MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
        printf("%s\n", total ? "FAILED" : "all passed");
    MPI_Finalize();
    return total ? 1 : 0;
}
