/* tools/plan.c: `hybridep plan` - the buffers a configuration allocates, before allocating
 * (through the public hep_plan_query). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "json.h"

static void print_text(const hep_plan_info *p, const hep_config *c)
{
    printf("hybridep plan: %d node(s) x %d rank(s) per node = %d ranks; H=%d T=%d E_l=%d K=%d "
           "%s\n",
           p->nodes, p->ranks_per_node, p->world, c->hidden, c->max_tokens, c->experts_per_rank,
           c->max_topk, c->dtype == HEP_DTYPE_FP8_E4M3 ? "fp8" : "bf16");
    printf("%-46s %-8s %-5s %14s %14s  %-30s %s\n", "buffer", "role", "elem", "count", "bytes",
           "memory", "offset / notes");
    for (int i = 0; i < p->num_buffers; i++) {
        const hep_plan_buffer_info *b = &p->buffers[i];
        char mem[64];
        snprintf(mem, sizeof(mem), "%s%s", b->memory, b->rdma_registered ? ", RDMA-registered" : "");
        printf("%-46s %-8s %-5s %14zu %14zu  %-30s +%zu (align %zu)", b->name, b->role, b->elem,
               b->count, b->bytes, mem, b->offset, b->align);
        if (b->shares_bytes_with)
            printf(", shares bytes with %s", b->shares_bytes_with);
        printf("\n");
    }
    printf("arenas: one allocation per memory kind; each RDMA registration covers exactly its own "
           "buffer\n");
    for (int a = 0; a < p->num_arenas; a++)
        printf("  %-20s %14zu bytes\n", p->arenas[a].name, p->arenas[a].bytes);
    printf("max received rows per rank: %zu\n", p->max_recv_rows);
    printf("total device memory per rank: %zu bytes (%.3f GB, %.3f GiB)\n", p->device_bytes,
           (double)p->device_bytes / 1e9, (double)p->device_bytes / (1 << 30));
    printf("total host memory per rank  : %zu bytes\n", p->host_bytes);
}

static void print_json(const hep_plan_info *p, const hep_config *c)
{
    hep_json j;
    json_begin(&j, stdout);
    json_obj(&j, NULL);
    json_int(&j, "nodes", p->nodes);
    json_int(&j, "ranks_per_node", p->ranks_per_node);
    json_int(&j, "world", p->world);
    json_int(&j, "hidden", c->hidden);
    json_int(&j, "max_tokens", c->max_tokens);
    json_int(&j, "experts_per_rank", c->experts_per_rank);
    json_int(&j, "max_topk", c->max_topk);
    json_str(&j, "dtype", c->dtype == HEP_DTYPE_FP8_E4M3 ? "fp8" : "bf16");
    json_int(&j, "max_recv_rows", (long long)p->max_recv_rows);
    json_arr(&j, "buffers");
    for (int i = 0; i < p->num_buffers; i++) {
        const hep_plan_buffer_info *b = &p->buffers[i];
        json_obj(&j, NULL);
        json_str(&j, "name", b->name);
        json_str(&j, "role", b->role);
        json_str(&j, "elem", b->elem);
        json_int(&j, "count", (long long)b->count);
        json_int(&j, "bytes", (long long)b->bytes);
        json_str(&j, "memory", b->memory);
        json_bool(&j, "rdma_registered", b->rdma_registered);
        json_int(&j, "align", (long long)b->align);
        json_int(&j, "offset", (long long)b->offset);
        json_str(&j, "shares_bytes_with", b->shares_bytes_with);
        json_end_obj(&j);
    }
    json_end_arr(&j);
    json_int(&j, "device_bytes", (long long)p->device_bytes);
    json_int(&j, "host_bytes", (long long)p->host_bytes);
    json_end_obj(&j);
    json_finish(&j);
}

int hep_cmd_plan(int argc, char **argv)
{
    static hep_plan_info p; /* large: off the stack */
    hep_config c;
    int nodes = 1, rpn = 8, as_json = 0, dtype = 0, rc;
    hep_config_default(&c);
    c.hidden = 7168;
    c.max_tokens = 4096;
    c.experts_per_rank = 32;
    {
        /* ranges wide enough to reach the library's own checks, which name the limits */
        const cli_opt opts[] = {
            {"nodes", CLI_INT, &nodes, 1, 4096, NULL, "N", "nodes"},
            {"ranks-per-node", CLI_INT, &rpn, 1, 4096, NULL, "R", "ranks per node"},
            {"hidden", CLI_INT, &c.hidden, 1, 1 << 30, NULL, "H", "channels per token"},
            {"tokens", CLI_INT, &c.max_tokens, 1, 1 << 30, NULL, "T", "most tokens per rank and call"},
            {"experts-per-rank", CLI_INT, &c.experts_per_rank, 1, 1 << 30, NULL, "E", "experts per rank"},
            {"topk", CLI_INT, &c.max_topk, 1, 1 << 30, NULL, "K", "experts per token"},
            {"chunk", CLI_INT, &c.chunk_tokens, 1, 1 << 30, NULL, "C", "tokens per chunk"},
            {"dtype", CLI_CHOICE, &dtype, 0, 0, "bf16|fp8", NULL, "dispatch payload"},
            {"json", CLI_FLAG, &as_json, 0, 0, NULL, NULL, "one JSON document on stdout"},
        };
        const cli_cmd cmd = {"plan", "every buffer a group would allocate, and the memory per rank",
                             opts, (int)(sizeof(opts) / sizeof(opts[0])),
                             "An invalid configuration exits 1 with the library's reason."};
        if ((rc = cli_parse(&cmd, argc, argv)))
            return rc < 0 ? 0 : rc;
    }
    c.dtype = dtype ? HEP_DTYPE_FP8_E4M3 : HEP_DTYPE_BF16;
    c.ranks_per_node = rpn;
    if (hep_plan_query(&c, nodes, rpn, &p) != HEP_OK)
        return cli_fail("plan", 1, "invalid configuration: %s", hep_last_error());
    if (as_json)
        print_json(&p, &c);
    else
        print_text(&p, &c);
    return 0;
}
