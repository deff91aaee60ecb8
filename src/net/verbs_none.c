/* net/verbs_none.c: the verbs NIC of a build without the libibverbs headers: none. Group
 * creation across nodes then says so (the loopback NIC still works). */
#include "core/core.h"
#include "net/net.h"

int hep_verbs_device_count(void)
{
    return 0;
}

int hep_verbs_create(int rank, int world, int cuda_device, hep_net **out)
{
    (void)rank, (void)world, (void)cuda_device;
    if (out)
        *out = NULL;
    return hep_fail(HEP_ERR_UNAVAILABLE,
                    "the verbs NIC is not in this build of hybridep: the libibverbs headers "
                    "(Debian: libibverbs-dev) were missing when it was built; install them and "
                    "rebuild, or use the loopback NIC (HEP_NIC=loopback) for virtual nodes");
}
