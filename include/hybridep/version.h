/* hybridep/version.h: the version of the hybridep headers.
 *
 * The build reads the numbers below (CMakeLists.txt), so this file is the one place the
 * version is written. hep_version() gives the version of the library actually loaded,
 * which can differ from these macros when a program runs against another install. */
#ifndef HYBRIDEP_VERSION_H
#define HYBRIDEP_VERSION_H

#define HEP_VERSION_MAJOR 0
#define HEP_VERSION_MINOR 1
#define HEP_VERSION_PATCH 0
/* One number that orders versions: MAJOR * 10000 + MINOR * 100 + PATCH. */
#define HEP_VERSION (HEP_VERSION_MAJOR * 10000 + HEP_VERSION_MINOR * 100 + HEP_VERSION_PATCH)

#ifdef __cplusplus
extern "C" {
#endif

/* "MAJOR.MINOR.PATCH" of the loaded library. Never NULL; a static string. */
const char *hep_version(void);
/* 1 when the loaded library has the GPU backend (built with CUDA kernels), else 0: then
 * hep_group_create with HEP_BACKEND_GPU returns HEP_ERR_UNAVAILABLE. */
int hep_has_gpu_backend(void);

#ifdef __cplusplus
}
#endif
#endif
