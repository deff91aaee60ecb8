/* hybridep/bootstrap_mpi.h: a bootstrap over an MPI communicator (libhybridep_mpi). */
#ifndef HYBRIDEP_BOOTSTRAP_MPI_H
#define HYBRIDEP_BOOTSTRAP_MPI_H

#include <mpi.h>

#include "hybridep/bootstrap.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Fill *bs with collectives over `comm` (MPI must be initialized; the communicator is
 * duplicated, so hybridep's traffic never mixes with the caller's). Release with
 * hep_bootstrap_mpi_destroy. Returns 0, HEP_ERR_INVALID or HEP_ERR_BOOTSTRAP. */
int hep_bootstrap_mpi_create(MPI_Comm comm, hep_bootstrap *bs);
void hep_bootstrap_mpi_destroy(hep_bootstrap *bs);

#ifdef __cplusplus
}
#endif
#endif
