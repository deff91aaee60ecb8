/* core/version.c: the version and build features of the loaded library. */
#include "hybridep/version.h"

const char *hep_version(void)
{
    return HEP_VERSION_STRING;
}

int hep_has_gpu_backend(void)
{
#ifdef HEP_NO_CUDA
    return 0;
#else
    return 1;
#endif
}
