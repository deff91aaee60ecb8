/* tools/plan.c: `hybridep plan` - the buffers a configuration allocates, before allocating. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "json.h"
#include "layout/plan.h"

static void print_text(const hep_plan *p, const hep_config *c)
{
    printf("hybridep plan: %d node(s) x %d rank(s) per node = %d ranks; H=%d T=%d E_l=%d K=%d "
           "%s\n",
           p->nodes, p->ranks_per_node, p->world, c->hidden, c->max_tokens, c->experts_per_rank,
           c->max_topk, c->dtype == HEP_DTYPE_FP8_E4M3 ? "fp8" : "bf16");
    printf("%-46s %-8s %-5s %14s %14s  %-30s %s\n", "buffer", "role", "elem", "count", "bytes",
           "memory", "offset / notes");
    for (int i = 0; i < HEP_BUF_COUNT; i++) {
        const hep_plan_buffer *b = &p->buf[i];
        char mem[64];
        if (!b->present)
            continue;
        snprintf(mem, sizeof(mem), "%s%s", hep_arena_name(b->arena),
                 b->registered ? ", RDMA-registered" : "");
        printf("%-46s %-8s %-5s %14zu %14zu  %-30s +%zu (align %zu)", b->name, b->role, b->elem,
               b->count, b->bytes, mem, b->offset, b->align);
        if (b->alias_of >= 0)
            printf(", shares bytes with %s", p->buf[b->alias_of].name);
        printf("\n");
    }
    printf("arenas: one allocation per memory kind; each RDMA registration covers exactly its own "
           "buffer\n");
    for (int a = 0; a < HEP_ARENA_COUNT; a++)
        printf("  %-20s %14zu bytes\n", hep_arena_name(a), p->arena_bytes[a]);
    printf("max received rows per rank: %zu\n", p->max_recv_rows);
    printf("total device memory per rank: %zu bytes (%.3f GB, %.3f GiB)\n", p->device_bytes,
           (double)p->device_bytes / 1e9, (double)p->device_bytes / (1 << 30));
    printf("total host memory per rank  : %zu bytes\n", p->host_bytes);
}

static void print_json(const hep_plan *p, const hep_config *c)
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
    for (int i = 0; i < HEP_BUF_COUNT; i++) {
        const hep_plan_buffer *b = &p->buf[i];
        if (!b->present)
            continue;
        json_obj(&j, NULL);
        json_str(&j, "name", b->name);
        json_str(&j, "role", b->role);
        json_str(&j, "elem", b->elem);
        json_int(&j, "count", (long long)b->count);
        json_int(&j, "bytes", (long long)b->bytes);
        json_str(&j, "memory", hep_arena_name(b->arena));
        json_bool(&j, "rdma_registered", b->registered);
        json_int(&j, "align", (long long)b->align);
        json_int(&j, "offset", (long long)b->offset);
        json_str(&j, "shares_bytes_with", b->alias_of >= 0 ? p->buf[b->alias_of].name : NULL);
        json_end_obj(&j);
    }
    json_end_arr(&j);
    json_int(&j, "device_bytes", (long long)p->device_bytes);
    json_int(&j, "host_bytes", (long long)p->host_bytes);
    json_end_obj(&j);
    json_finish(&j);
}

int cli_parse_int(const char *cmd, const char *opt, const char *v, int *out)
{
    char *end = NULL;
    long x;
    if (!v) {
        fprintf(stderr, "hybridep %s: %s needs a value\n", cmd, opt);
        return 2;
    }
    x = strtol(v, &end, 10);
    if (!*v || *end || x < -2147483647L || x > 2147483647L) {
        fprintf(stderr, "hybridep %s: %s '%s' is not an integer\n", cmd, opt, v);
        return 2;
    }
    *out = (int)x;
    return 0;
}

int cli_parse_dtype(const char *cmd, const char *v, hep_dtype *out)
{
    if (v && strcmp(v, "bf16") == 0)
        *out = HEP_DTYPE_BF16;
    else if (v && strcmp(v, "fp8") == 0)
        *out = HEP_DTYPE_FP8_E4M3;
    else {
        fprintf(stderr, "hybridep %s: --dtype must be bf16 or fp8\n", cmd);
        return 2;
    }
    return 0;
}

int hep_cmd_plan(int argc, char **argv)
{
    hep_config c;
    hep_plan p;
    int nodes = 1, rpn = 8, as_json = 0, rc = 0;
    hep_config_default(&c);
    c.hidden = 7168;
    c.max_tokens = 4096;
    c.experts_per_rank = 32;
    for (int i = 0; i < argc && rc == 0; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--json") == 0)
            as_json = 1;
        else if (strcmp(a, "--nodes") == 0 && ++i)
            rc = cli_parse_int("plan", a, v, &nodes);
        else if (strcmp(a, "--ranks-per-node") == 0 && ++i)
            rc = cli_parse_int("plan", a, v, &rpn);
        else if (strcmp(a, "--hidden") == 0 && ++i)
            rc = cli_parse_int("plan", a, v, &c.hidden);
        else if (strcmp(a, "--tokens") == 0 && ++i)
            rc = cli_parse_int("plan", a, v, &c.max_tokens);
        else if (strcmp(a, "--experts-per-rank") == 0 && ++i)
            rc = cli_parse_int("plan", a, v, &c.experts_per_rank);
        else if (strcmp(a, "--topk") == 0 && ++i)
            rc = cli_parse_int("plan", a, v, &c.max_topk);
        else if (strcmp(a, "--chunk") == 0 && ++i)
            rc = cli_parse_int("plan", a, v, &c.chunk_tokens);
        else if (strcmp(a, "--dtype") == 0 && ++i)
            rc = cli_parse_dtype("plan", v, &c.dtype);
        else
            return cli_usage_error("plan", a);
    }
    if (rc)
        return rc;
    c.ranks_per_node = rpn;
    if (hep_plan_make(&c, nodes, rpn, &p) != HEP_OK) {
        fprintf(stderr, "hybridep plan: invalid configuration: %s\n", hep_last_error());
        return 1;
    }
    if (as_json)
        print_json(&p, &c);
    else
        print_text(&p, &c);
    return 0;
}
