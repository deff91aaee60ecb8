/* examples/mpi_group.c: a hybridep group over MPI, one rank per process.
 *
 * Each process drives the GPU of its local rank (HEP_BACKEND_GPU) when the library has
 * the GPU backend and a GPU exists; otherwise a single process runs the host backend
 * (host-backend ranks of one node must share a process). It creates the group, prints
 * what it got and destroys it.
 *
 *   mpicc mpi_group.c $(pkg-config --cflags --libs hybridep-mpi) -o mpi_group
 *   mpirun -np 8 ./mpi_group
 */
#include <stdio.h>
#include <stdlib.h>

#include <mpi.h>

#include <hybridep/bootstrap_mpi.h>
#include <hybridep/hybridep.h>

int main(int argc, char **argv)
{
    hep_bootstrap bs;
    hep_config cfg;
    hep_group *g = NULL;
    hep_group_info info;
    int rank = 0, size = 1, local = 0, have_bs = 0, rc;
    MPI_Comm node;

    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local);

    hep_config_default(&cfg);
    cfg.hidden = 7168;
    cfg.max_tokens = 256;
    cfg.experts_per_rank = 4;
    cfg.max_topk = 8 < 4 * size ? 8 : 4 * size;
    /* the GPU backend where it exists (and the GPU works); else one host-backend process */
    cfg.backend = hep_has_gpu_backend() && hep_gpu_probe(local) == HEP_OK ? HEP_BACKEND_GPU
                                                                          : HEP_BACKEND_HOST;
    if (cfg.backend == HEP_BACKEND_HOST && size > 1) {
        if (rank == 0)
            fprintf(stderr, "no usable GPU here: run the host backend with one process "
                            "(mpirun -np 1), or on GPUs\n");
        MPI_Finalize();
        return 1;
    }
    rc = hep_bootstrap_mpi_create(MPI_COMM_WORLD, &bs);
    have_bs = rc == HEP_OK;
    if (rc == HEP_OK)
        rc = hep_group_create(&cfg, &bs, local, &g);
    if (rc == HEP_OK)
        rc = hep_group_get_info(g, &info);
    if (rc == HEP_OK)
        printf("rank %d of %d (node %d, local rank %d): %s backend, transport %s, up to %zu "
               "received rows, %zu bytes of device memory\n",
               info.rank, info.world, info.node, info.local_rank,
               cfg.backend == HEP_BACKEND_GPU ? "GPU" : "host", info.transport,
               info.max_recv_rows, info.device_bytes);
    else
        fprintf(stderr, "rank %d: %s: %s\n", rank, hep_status_name(rc), hep_last_error());
    hep_group_destroy(g);
    if (have_bs)
        hep_bootstrap_mpi_destroy(&bs);
    MPI_Comm_free(&node);
    MPI_Finalize();
    return rc == HEP_OK ? 0 : 1;
}
