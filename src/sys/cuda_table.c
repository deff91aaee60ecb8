/* sys/cuda_table.c: CUDA driver entry points through cudaGetDriverEntryPointByVersion,
 * so the library never links libcuda and loads on machines without a driver. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/core.h"
#include "sys.h"

static hep_cu_table cu_table;
static pthread_once_t cu_once = PTHREAD_ONCE_INIT;

/* Entry points are requested at the ABI version they were introduced with. */
static void *entry(const char *name, unsigned version)
{
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t e = cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) {
        hep_log(HEP_LOG_DEBUG, "CUDA driver lacks %s (v%u): %s", name, version,
                cudaGetErrorString(e));
        return NULL;
    }
    return fn;
}

static void cu_load(void)
{
    hep_cu_table *t = &cu_table;
    int v = 0;
    cudaError_t e = cudaDriverGetVersion(&v);
    if (e != cudaSuccess || v == 0) {
        snprintf(t->load_error, sizeof(t->load_error), "no CUDA driver (%s)",
                 e != cudaSuccess ? cudaGetErrorString(e) : "cudaDriverGetVersion reports 0");
        (void)cudaGetLastError();
        return;
    }
    t->driver_version = v;
    *(void **)&t->get_error_name = entry("cuGetErrorName", 6000);
    *(void **)&t->get_error_string = entry("cuGetErrorString", 6000);
    *(void **)&t->device_get = entry("cuDeviceGet", 2000);
    *(void **)&t->device_get_attribute = entry("cuDeviceGetAttribute", 2000);
    *(void **)&t->mem_get_handle_for_address_range = entry("cuMemGetHandleForAddressRange", 11070);
    *(void **)&t->pointer_get_attribute = entry("cuPointerGetAttribute", 4000);
    t->loaded = t->device_get_attribute != NULL;
    if (!t->loaded)
        snprintf(t->load_error, sizeof(t->load_error),
                 "CUDA driver %d.%d does not provide cuDeviceGetAttribute", v / 1000,
                 (v % 1000) / 10);
    (void)cudaGetLastError();
}

const hep_cu_table *hep_cu(void)
{
    pthread_once(&cu_once, cu_load);
    return &cu_table;
}

int hep_cu_require(const void *fn, const char *what)
{
    const hep_cu_table *t = hep_cu();
    if (!t->loaded)
        return hep_fail(HEP_ERR_UNAVAILABLE, "%s is unavailable: %s", what, t->load_error);
    if (!fn)
        return hep_fail(HEP_ERR_UNAVAILABLE, "%s is unavailable: CUDA driver %d lacks it", what,
                        t->driver_version);
    return HEP_OK;
}

void hep_cu_error_text(hep_cu_result r, const char **name, const char **desc)
{
    const hep_cu_table *t = hep_cu();
    *name = "CUDA_ERROR_UNKNOWN";
    *desc = "unknown CUDA driver error";
    if (t->get_error_name && t->get_error_name(r, name) != 0)
        *name = "CUDA_ERROR_UNKNOWN";
    if (t->get_error_string && t->get_error_string(r, desc) != 0)
        *desc = "unknown CUDA driver error";
    if (!*name)
        *name = "CUDA_ERROR_UNKNOWN";
    if (!*desc)
        *desc = "unknown CUDA driver error";
}
