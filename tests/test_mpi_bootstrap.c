/* The MPI bootstrap across processes (run under mpirun -np 4): collectives, and a group
 * whose ranks disagree on the configuration fails on every rank naming the field. */
#include <stdio.h>
#include <string.h>

#include <mpi.h>

#include "hybridep/bootstrap_mpi.h"
#include "hybridep/hybridep.h"

static int failures;
#define CHECK(cond, ...)                                                                         \
    do {                                                                                         \
        if (!(cond)) {                                                                           \
            failures++;                                                                          \
            fprintf(stderr, "rank %d: FAILED %s: ", rank, #cond);                                \
            fprintf(stderr, __VA_ARGS__);                                                        \
            fprintf(stderr, "\n");                                                               \
        }                                                                                        \
    } while (0)

int main(int argc, char **argv)
{
    hep_bootstrap bs;
    hep_config c;
    hep_group *g = NULL;
    int rank = -1, size = 0, all[64], total = 0, rc;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    rc = hep_bootstrap_mpi_create(MPI_COMM_WORLD, &bs);
    CHECK(rc == 0, "%s", hep_last_error());
    CHECK(bs.rank == rank && bs.size == size, "rank %d size %d", bs.rank, bs.size);
    for (int round = 0; round < 10 && size <= 64; round++) {
        int v = rank * 100 + round;
        CHECK(bs.allgather(bs.ctx, &v, all, sizeof(v)) == 0, "%s", hep_last_error());
        for (int r = 0; r < size; r++)
            CHECK(all[r] == r * 100 + round, "slot %d = %d", r, all[r]);
        CHECK(bs.barrier(bs.ctx) == 0, "%s", hep_last_error());
    }
    hep_config_default(&c);
    c.hidden = 256;
    c.max_tokens = 8;
    c.experts_per_rank = 2;
    c.max_topk = 2;
    c.backend = HEP_BACKEND_HOST;
    c.ranks_per_node = 1;
    if (rank == size - 1)
        c.chunk_tokens = 64;
    rc = hep_group_create(&c, &bs, 0, &g);
    CHECK(rc == HEP_ERR_MISMATCH, "status %d: %s", rc, hep_last_error());
    CHECK(strstr(hep_last_error(), "field 'chunk_tokens'") != NULL, "%s", hep_last_error());
    CHECK(g == NULL, "group returned on failure");
    hep_bootstrap_mpi_destroy(&bs);
    MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
        printf("%d passed, %d failed\n", total ? 0 : 1, total ? 1 : 0);
    MPI_Finalize();
    return total ? 1 : 0;
}
