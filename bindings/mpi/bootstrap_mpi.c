/* bindings/mpi/bootstrap_mpi.c: hep_bootstrap over MPI (its own library, so the core has
 * no MPI dependency). */
#include <stdint.h>
#include <stdlib.h>

#include "hybridep/status.h"
#include "hybridep/bootstrap_mpi.h"

static int mpi_error(int rc, const char *what)
{
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    return hep_set_last_error(HEP_ERR_BOOTSTRAP, "MPI bootstrap: %s failed: %s", what, text);
}

static int mpi_allgather(void *ctx, const void *send, void *recv, size_t bytes)
{
    MPI_Comm comm = *(MPI_Comm *)ctx;
    int rc;
    if (bytes > (size_t)INT32_MAX)
        return hep_set_last_error(HEP_ERR_INVALID, "MPI bootstrap: allgather of %zu bytes is too large",
                        bytes);
    rc = MPI_Allgather(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, comm);
    return rc == MPI_SUCCESS ? HEP_OK : mpi_error(rc, "MPI_Allgather");
}

static int mpi_barrier(void *ctx)
{
    int rc = MPI_Barrier(*(MPI_Comm *)ctx);
    return rc == MPI_SUCCESS ? HEP_OK : mpi_error(rc, "MPI_Barrier");
}

int hep_bootstrap_mpi_create(MPI_Comm comm, hep_bootstrap *bs)
{
    MPI_Comm *dup;
    int init = 0, rc;
    if (!bs)
        return hep_set_last_error(HEP_ERR_INVALID, "MPI bootstrap: output is NULL");
    MPI_Initialized(&init);
    if (!init)
        return hep_set_last_error(HEP_ERR_INVALID, "MPI bootstrap: MPI is not initialized");
    dup = malloc(sizeof(*dup));
    if (!dup)
        return hep_set_last_error(HEP_ERR_NOMEM, "MPI bootstrap: out of memory");
    rc = MPI_Comm_dup(comm, dup);
    if (rc != MPI_SUCCESS) {
        free(dup);
        return mpi_error(rc, "MPI_Comm_dup");
    }
    MPI_Comm_set_errhandler(*dup, MPI_ERRORS_RETURN);
    MPI_Comm_rank(*dup, &bs->rank);
    MPI_Comm_size(*dup, &bs->size);
    bs->ctx = dup;
    bs->allgather = mpi_allgather;
    bs->barrier = mpi_barrier;
    return HEP_OK;
}

void hep_bootstrap_mpi_destroy(hep_bootstrap *bs)
{
    if (!bs || !bs->ctx)
        return;
    MPI_Comm_free((MPI_Comm *)bs->ctx);
    free(bs->ctx);
    bs->ctx = NULL;
}
