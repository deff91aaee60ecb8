/* nocuda/kernels_stub.c: the entry points of kernels/ for a build without CUDA. The group
 * refuses the GPU backend before any of them is reached (HEP_ERR_UNAVAILABLE); these keep
 * the link whole and fail the same way if a path ever gets here. Keep in step with
 * kernels/kernels.h and kernels/ep_kernels.h: the CI configure without CUDA links them. */
#include <stdio.h>

#include "cuda_runtime_api.h"
#include "kernels/ep_kernels.h"
#include "kernels/kernels.h"

int hep_stream_touch(void *stream) { return (void)stream, cudaErrorNoDevice; }
int hep_kernels_probe(int device, char *why, size_t why_len)
{
    (void)device;
    if (why && why_len)
        snprintf(why, why_len, "%s", cudaGetErrorString(cudaErrorNoDevice));
    return -1;
}

int hep_launch_dispatch(const hep_kargs *a, int blocks, void *stream)
{
    return (void)a, (void)blocks, (void)stream, cudaErrorNoDevice;
}
int hep_launch_dispatch_bulk(const hep_kargs *a, int blocks, void *stream)
{
    return (void)a, (void)blocks, (void)stream, cudaErrorNoDevice;
}
int hep_launch_combine(const hep_kargs *a, int blocks, void *stream)
{
    return (void)a, (void)blocks, (void)stream, cudaErrorNoDevice;
}
int hep_launch_copy_in(const hep_kargs *a, int blocks, void *stream)
{
    return (void)a, (void)blocks, (void)stream, cudaErrorNoDevice;
}
int hep_launch_copy_out(const hep_kargs *a, int blocks, void *stream)
{
    return (void)a, (void)blocks, (void)stream, cudaErrorNoDevice;
}
int hep_launch_em_stage_out(const hep_kargs *a, int blocks, void *stream)
{
    return (void)a, (void)blocks, (void)stream, cudaErrorNoDevice;
}
int hep_launch_em_stage_in(const hep_kargs *a, int blocks, void *stream)
{
    return (void)a, (void)blocks, (void)stream, cudaErrorNoDevice;
}
int hep_launch_node_pack(const hep_kargs *a, int blocks, void *stream)
{
    return (void)a, (void)blocks, (void)stream, cudaErrorNoDevice;
}
int hep_kernels_warm(const hep_kargs *a, int bulk) { return (void)a, (void)bulk, cudaErrorNoDevice; }
size_t hep_dispatch_smem(int R, int El) { return (void)R, (void)El, 0; }
size_t hep_dispatch_smem_bulk(int R, int El) { return (void)R, (void)El, 0; }
size_t hep_node_pack_smem(int N, int R, int El) { return (void)N, (void)R, (void)El, 0; }
