/* tools/hybridep.c: the `hybridep` command: doctor, plan, bench. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

#define STR_(x) #x
#define STR(x) STR_(x)
#define HEADER_VERSION STR(HEP_VERSION_MAJOR) "." STR(HEP_VERSION_MINOR) "." STR(HEP_VERSION_PATCH)

static void usage(FILE *f)
{
    fprintf(f, "usage: hybridep <command> [options]   (hybridep <command> --help for its options)\n"
               "commands:\n"
               "  doctor   what this machine offers: GPUs, P2P, RDMA devices, which GPU memory\n"
               "           registration path works for each GPU and NIC\n"
               "  plan     the buffers a group allocates and the memory per rank\n"
               "  bench    verify against the host backend, then time dispatch and combine\n"
               "           against the same run's copy ceilings (whole GPU and same SMs)\n"
               "options: --help, --version\n");
}

int main(int argc, char **argv)
{
    /* one hardware queue per virtual rank's stream: co-dependent kernels never queue
     * behind each other (must be set before CUDA starts) */
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("hybridep %s (library %s, %s)\n", HEADER_VERSION, hep_version(),
               hep_has_gpu_backend() ? "GPU kernels built in"
                                     : "host backend only: built without CUDA");
        return 0;
    }
    if (strcmp(argv[1], "bench") == 0)
        return hep_cmd_bench(argc - 1, argv + 1);
    if (strcmp(argv[1], "plan") == 0)
        return hep_cmd_plan(argc - 1, argv + 1);
    if (strcmp(argv[1], "doctor") == 0)
        return hep_cmd_doctor(argc - 1, argv + 1);
    fprintf(stderr, "hybridep: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
