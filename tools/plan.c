/* tools/plan.c: `hybridep plan` - the buffers a configuration allocates, before allocating
 * (through the public hep_plan_query). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "json.h"

/* The receive rows one rank needs under uniform top-K routing: each of the W x T tokens
 * of a call picks K distinct experts of E = E_l x W uniformly, so it reaches this rank
 * (one of its E_l experts) with p = 1 - C(E - E_l, K) / C(E, K), independently of the
 * others: the rows are Binomial(W x T, p). The quantile is the normal approximation
 * mean + z sd (z of the one-sided 99.99%), rounded up. */
#define ADVICE_QUANTILE 0.9999
#define ADVICE_Z 3.719016485 /* the standard normal's 99.99% quantile */

typedef struct advice {
    double p, mean, sd;
    long long quantile_rows, twice_mean_rows, worst_rows;
    long long row_bytes; /* receive-buffer bytes per row: tokens, probabilities, scales */
    /* total device memory per rank with max_recv_rows set to the quantile, to 2 x the mean,
     * and 0 (the worst case); -1 where the plan refused it */
    long long dev_quantile, dev_twice_mean, dev_worst;
} advice;

static long long device_bytes_at(const hep_config *c, int nodes, int rpn, long long rows)
{
    static hep_plan_info q; /* large: off the stack */
    hep_config k = *c;
    k.max_recv_rows = (int)rows;
    return hep_plan_query(&k, nodes, rpn, &q) == HEP_OK ? (long long)q.device_bytes : -1;
}

/* The same plan with one chunk of T per inter-node slot (--chunk 0), the other way. */
static long long device_bytes_one_chunk(const hep_config *c, int nodes, int rpn)
{
    static hep_plan_info q;
    hep_config k = *c;
    k.chunk_tokens = 0;
    return hep_plan_query(&k, nodes, rpn, &q) == HEP_OK ? (long long)q.device_bytes : -1;
}

/* The --chunk a plan used, in words: the option given, or the backend's default. */
static const char *chunk_words(const hep_config *c, const hep_plan_info *p)
{
    (void)p;
    static char w[160];
    if (c->chunk_tokens == HEP_CHUNK_DEFAULT && c->backend == HEP_BACKEND_HOST)
        snprintf(w, sizeof(w), "--chunk %d, the host backend's default", HEP_CHUNK_DEFAULT_HOST);
    else if (c->chunk_tokens == HEP_CHUNK_DEFAULT)
        snprintf(w, sizeof(w),
                 "the GPU backend's default chunk: T / 2 (combine: T / 4) while the slots fit "
                 "%llu MiB, else %d / (N - 1) tokens, 8 to %d",
                 HEP_GPU_WHOLE_SLOT_BYTES >> 20, HEP_CHUNK_GPU_RING_TOKENS, HEP_CHUNK_DEFAULT_GPU);
    else
        snprintf(w, sizeof(w), "--chunk %d", c->chunk_tokens);
    return w;
}

static void print_ring_text(const hep_plan_info *p, const hep_config *c)
{
    long long one = device_bytes_one_chunk(c, p->nodes, p->ranks_per_node);
    if (p->nodes < 2)
        return;
    if (p->ring_chunks == 1 && p->slot_tokens == (size_t)c->max_tokens)
        printf("inter-node slots: one chunk of T = %d rows per other node (%s)\n",
               c->max_tokens, chunk_words(c, p));
    else
        printf("inter-node slots: a ring of %d chunks of %d tokens = %zu rows per other node "
               "(%s); with one chunk of T = %d rows instead (--chunk 0): %lld bytes "
               "(%.3f GB) of device memory per rank\n",
               p->ring_chunks, p->chunk_tokens, p->slot_tokens, chunk_words(c, p),
               c->max_tokens, one, (double)one / 1e9);
}

static void make_advice(const hep_plan_info *p, const hep_config *c, advice *a)
{
    const double E = (double)c->experts_per_rank * p->world, El = c->experts_per_rank;
    const double n = (double)p->world * c->max_tokens;
    double miss = 1; /* C(E - El, K) / C(E, K) as a product, without huge binomials */
    for (int i = 0; i < c->max_topk; i++)
        miss *= E - El - i > 0 ? (E - El - i) / (E - i) : 0;
    a->p = 1 - miss;
    a->mean = n * a->p;
    a->sd = sqrt(n * a->p * (1 - a->p));
    a->worst_rows = (long long)n;
    a->quantile_rows = (long long)ceil(a->mean + ADVICE_Z * a->sd);
    if (a->quantile_rows > a->worst_rows)
        a->quantile_rows = a->worst_rows;
    a->twice_mean_rows = (long long)ceil(2 * a->mean);
    if (a->twice_mean_rows > a->worst_rows)
        a->twice_mean_rows = a->worst_rows;
    a->dev_quantile = device_bytes_at(c, p->nodes, p->ranks_per_node, a->quantile_rows);
    a->dev_twice_mean = device_bytes_at(c, p->nodes, p->ranks_per_node, a->twice_mean_rows);
    a->dev_worst = device_bytes_at(c, p->nodes, p->ranks_per_node, 0);
    a->row_bytes = 2LL * c->hidden + 4LL * c->experts_per_rank +
                   (c->dtype == HEP_DTYPE_FP8_E4M3 ? 4LL * (c->hidden / HEP_FP8_BLOCK) : 0);
}

static void print_advice_text(const advice *a, const hep_config *c, const hep_plan_info *p,
                              int world)
{
    printf("receive capacity for uniform top-%d routing over %d experts (a token reaches this "
           "rank with p = %.6f; rows ~ Binomial(%lld, p); %lld receive-buffer bytes a row):\n",
           c->max_topk, c->experts_per_rank * world, a->p, a->worst_rows, a->row_bytes);
    printf("  %-40s %12s %16s %20s\n", "", "rows", "receive bytes", "device bytes/rank");
    printf("  %-40s %12.1f %16.0f\n", "mean (W x T x p)", a->mean,
           ceil(a->mean) * (double)a->row_bytes);
    printf("  %-40s %12lld %16lld %20lld\n", "99.99% quantile (normal approximation)",
           a->quantile_rows, a->quantile_rows * a->row_bytes, a->dev_quantile);
    printf("  %-40s %12lld %16lld %20lld\n", "2 x mean", a->twice_mean_rows,
           a->twice_mean_rows * a->row_bytes, a->dev_twice_mean);
    printf("  %-40s %12lld %16lld %20lld\n", "worst case (W x T, max_recv_rows = 0)",
           a->worst_rows, a->worst_rows * a->row_bytes, a->dev_worst);
    printf("  (pass one as --max-recv-rows, config.max_recv_rows: both backends, any number of "
           "nodes; these totals use %s)\n",
           chunk_words(c, p));
}

static void print_advice_json(hep_json *j, const advice *a)
{
    json_obj(j, "capacity_advice");
    json_str(j, "routing", "uniform top-K, K distinct experts");
    json_num(j, "p", a->p);
    json_num(j, "mean_rows", a->mean);
    json_num(j, "quantile", ADVICE_QUANTILE);
    json_str(j, "quantile_method", "normal approximation of the binomial, rounded up");
    json_int(j, "quantile_rows", a->quantile_rows);
    json_int(j, "twice_mean_rows", a->twice_mean_rows);
    json_int(j, "worst_case_rows", a->worst_rows);
    json_int(j, "recv_bytes_per_row", a->row_bytes);
    json_int(j, "recv_bytes_quantile", a->quantile_rows * a->row_bytes);
    json_int(j, "recv_bytes_twice_mean", a->twice_mean_rows * a->row_bytes);
    json_int(j, "recv_bytes_worst_case", a->worst_rows * a->row_bytes);
    json_int(j, "device_bytes_quantile", a->dev_quantile);
    json_int(j, "device_bytes_twice_mean", a->dev_twice_mean);
    json_int(j, "device_bytes_worst_case", a->dev_worst);
    json_end_obj(j);
}

static void print_text(const hep_plan_info *p, const hep_config *c)
{
    advice adv;
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
    if (c->max_recv_rows)
        printf("max received rows per rank: %zu (--max-recv-rows; the worst case W x T is %lld)\n",
               p->max_recv_rows, (long long)p->world * c->max_tokens);
    else
        printf("max received rows per rank: %zu (W x T, the worst case)\n", p->max_recv_rows);
    if (c->max_permuted_rows && c->backend != HEP_BACKEND_HOST)
        printf("expert-major staging per rank: %d rows (--max-permuted-rows: the most "
               "num_permuted_tokens of an expert-major dispatch across processes)\n",
               c->max_permuted_rows);
    printf("total device memory per rank: %zu bytes (%.3f GB, %.3f GiB)\n", p->device_bytes,
           (double)p->device_bytes / 1e9, (double)p->device_bytes / (1 << 30));
    printf("total host memory per rank  : %zu bytes\n", p->host_bytes);
    print_ring_text(p, c);
    make_advice(p, c, &adv);
    if (c->max_recv_rows)
        printf("with the worst case instead (max_recv_rows = 0): %lld bytes (%.3f GB) of device "
               "memory per rank\n",
               adv.dev_worst, (double)adv.dev_worst / 1e9);
    print_advice_text(&adv, c, p, p->world);
}

static void print_json(const hep_plan_info *p, const hep_config *c)
{
    hep_json j;
    advice adv;
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
    json_int(&j, "max_recv_rows_option", c->max_recv_rows);
    json_int(&j, "max_permuted_rows", c->backend != HEP_BACKEND_HOST ? c->max_permuted_rows : 0);
    json_str(&j, "backend", c->backend == HEP_BACKEND_HOST ? "host" : "gpu");
    json_int(&j, "chunk_option", c->chunk_tokens);
    json_int(&j, "chunk_tokens", p->chunk_tokens);
    json_int(&j, "ring_chunks", p->ring_chunks);
    json_int(&j, "slot_tokens", (long long)p->slot_tokens);
    json_int(&j, "device_bytes_one_chunk_per_slot",
             device_bytes_one_chunk(c, p->nodes, p->ranks_per_node));
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
    make_advice(p, c, &adv);
    print_advice_json(&j, &adv);
    json_end_obj(&j);
    json_finish(&j);
}

int hep_cmd_plan(int argc, char **argv)
{
    static hep_plan_info p; /* large: off the stack */
    hep_config c;
    int nodes = 1, rpn = 8, as_json = 0, dtype = 0, backend = 0, rc;
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
            {"max-recv-rows", CLI_INT, &c.max_recv_rows, 0, 1 << 30, NULL, "N",
             "receive capacity per rank (0 = W x T, the worst case)"},
            {"max-permuted-rows", CLI_INT, &c.max_permuted_rows, 0, 1 << 30, NULL, "N",
             "rows of the expert-major staging (GPU, the node's ranks in several processes; "
             "0 = none)"},
            {"chunk", CLI_INT, &c.chunk_tokens, 0, 1 << 30, NULL, "C",
             "tokens per chunk of the inter-node rings (0 = one chunk of T per slot; default: "
             "the backend's: on the GPU T / 2 (combine: T / 4) while the slots fit 640 MiB, "
             "else 3584 / (N - 1) tokens, 8 to 512; 8 on the host)"},
            {"backend", CLI_CHOICE, &backend, 0, 0, "gpu|host", NULL,
             "whose plan"},
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
    c.backend = backend ? HEP_BACKEND_HOST : HEP_BACKEND_GPU;
    c.ranks_per_node = rpn;
    if (hep_plan_query(&c, nodes, rpn, &p) != HEP_OK)
        return cli_fail("plan", 1, "invalid configuration: %s", hep_last_error());
    if (as_json)
        print_json(&p, &c);
    else
        print_text(&p, &c);
    return 0;
}
