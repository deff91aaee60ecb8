/* tools/hybridep.c: the `hybridep` command: doctor (and more subcommands). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: hybridep <command> [options]\n"
               "commands:\n"
               "  doctor [--json]   what this machine offers: GPUs, P2P, RDMA devices, which GPU\n"
               "                    memory registration path works for each GPU and NIC\n"
               "  plan [--nodes N] [--ranks-per-node R] [--hidden H] [--tokens T]\n"
               "       [--experts-per-rank E] [--topk K] [--dtype bf16|fp8] [--chunk C] [--json]\n"
               "                    the buffers a group allocates and the memory per rank\n"
               "  bench [--ranks-per-node R] [--hidden H] [--tokens T] [--experts-per-rank E]\n"
               "        [--topk K] [--dtype bf16|fp8] [--sms S] [--iters I] [--warmup W]\n"
               "        [--backend gpu|host] [--routing uniform|skewed] [--gpus G] [--seed S]\n"
               "        [--dump-routing FILE] [--json] [--json-file FILE]\n"
               "                    verify against the host backend, then time dispatch and\n"
               "                    combine against the same run's copy ceiling\n");
}

int cli_usage_error(const char *cmd, const char *arg)
{
    fprintf(stderr, "hybridep %s: unknown argument '%s' (see hybridep --help)\n", cmd, arg);
    return 2;
}

int main(int argc, char **argv)
{
    /* one hardware queue per virtual rank's stream: co-dependent kernels never queue
     * behind each other (must be set before CUDA starts) */
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (strcmp(argv[1], "bench") == 0)
        return hep_cmd_bench(argc - 2, argv + 2);
    if (strcmp(argv[1], "plan") == 0)
        return hep_cmd_plan(argc - 2, argv + 2);
    if (strcmp(argv[1], "doctor") == 0)
        return hep_cmd_doctor(argc - 2, argv + 2);
    fprintf(stderr, "hybridep: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
