/* A fuzz target for the buffer plan and the configuration check: any bytes become a
 * configuration and a shape; either the call refuses it with HEP_ERR_INVALID and a
 * message, or the plan it returns is within the backend's limits, its rings' shapes fit
 * their slots, its buffers are aligned, inside their arenas and apart unless aliased, and
 * its sizes add up.
 * Built two ways: with clang -fsanitize=fuzzer (define HEP_LIBFUZZER) for libFuzzer, and
 * with any C compiler as a deterministic random loop (AFL-style mutations of a few
 * seeds) bounded by HEP_FUZZ_SECONDS (default 3), which CI runs. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/core.h"
#include "layout/plan.h"

static int take(const uint8_t **d, size_t *n)
{
    int32_t v = 0;
    size_t k = *n < 4 ? *n : 4;
    memcpy(&v, *d, k);
    *d += k;
    *n -= k;
    /* mostly small values, sometimes any int: both find the edges */
    return (v & 0x30000000) ? v : v % 300;
}

static void check_plan(const hep_config *c, const hep_plan *p, int nodes, int R)
{
    size_t dev = p->arena_bytes[HEP_ARENA_SHARED] + p->arena_bytes[HEP_ARENA_LOCAL];
    int maxR = c->backend == HEP_BACKEND_HOST ? HEP_MAX_RANKS_PER_NODE_HOST
                                              : HEP_MAX_RANKS_PER_NODE_GPU;
    int maxN = c->backend == HEP_BACKEND_HOST ? HEP_MAX_NODES_HOST : HEP_MAX_NODES_GPU;
    if (R > maxR || nodes > maxN || p->world != nodes * R ||
        p->max_recv_rows != (c->max_recv_rows ? (size_t)c->max_recv_rows
                                              : (size_t)p->world * (size_t)c->max_tokens) ||
        p->max_recv_rows > (size_t)p->world * (size_t)c->max_tokens || p->device_bytes != dev)
        abort();
    /* the rings: dispatch's sizes the slot; combine's lies in the same slot, holds it whole
     * exactly where dispatch's does (the kernels pick their WHOLE instances by it), and
     * differs only on the GPU */
    if (p->ring < 1 || p->ring > HEP_RING_POSITIONS || p->cring < 1 || p->cring > HEP_RING_DEPTH ||
        p->slot_tokens != (size_t)p->ring * (size_t)p->chunk ||
        (size_t)p->cring * (size_t)p->cchunk > p->slot_tokens ||
        ((size_t)p->cring * (size_t)p->cchunk >= (size_t)c->max_tokens) !=
            (p->slot_tokens >= (size_t)c->max_tokens) ||
        (c->backend == HEP_BACKEND_HOST && (p->cchunk != p->chunk || p->cring != p->ring)))
        abort();
    for (int i = 0; i < HEP_BUF_COUNT; i++) {
        const hep_plan_buffer *b = &p->buf[i];
        if (!b->present)
            continue;
        if (b->offset % b->align || b->offset > p->arena_bytes[b->arena] ||
            b->bytes > p->arena_bytes[b->arena] - b->offset)
            abort();
        for (int j = i + 1; j < HEP_BUF_COUNT; j++) {
            const hep_plan_buffer *o = &p->buf[j];
            if (!o->present || o->arena != b->arena || b->alias_of == j || o->alias_of == i ||
                !b->bytes || !o->bytes)
                continue;
            if (b->offset < o->offset + o->bytes && o->offset < b->offset + b->bytes)
                abort();
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    hep_config c;
    hep_plan p;
    int nodes, R, world, rc;
    hep_config_default(&c);
    c.hidden = take(&data, &size);
    if (c.hidden > -300 && c.hidden < 300)
        c.hidden *= 8; /* small values: mostly multiples of 8, as valid ones are */
    c.max_tokens = take(&data, &size);
    c.experts_per_rank = take(&data, &size);
    c.max_topk = take(&data, &size);
    c.dtype = (hep_dtype)(take(&data, &size) % 3);
    c.ranks_per_node = take(&data, &size) % 80;
    c.dispatch_sms = take(&data, &size);
    c.combine_sms = take(&data, &size);
    c.chunk_tokens = take(&data, &size);
    c.backend = (hep_backend)(take(&data, &size) % 3);
    nodes = take(&data, &size);
    R = take(&data, &size);
    world = take(&data, &size);
    c.max_recv_rows = take(&data, &size);
    rc = hep_config_check(&c, world);
    if (rc != HEP_OK && (rc != HEP_ERR_INVALID || !hep_last_error()[0]))
        abort();
    if (rc == HEP_OK && hep_last_error()[0])
        abort(); /* a valid check leaves no message behind */
    rc = hep_plan_make(&c, nodes, R, &p);
    if (rc != HEP_OK && (rc != HEP_ERR_INVALID || !hep_last_error()[0]))
        abort();
    if (rc == HEP_OK)
        check_plan(&c, &p, nodes, R);
    return 0;
}

#ifndef HEP_LIBFUZZER
static uint32_t rnd(uint64_t *s)
{
    *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
    return (uint32_t)(*s >> 32);
}

int main(void)
{
    /* seeds: a valid single-node and a valid two-node shape, then mutations of them */
    static const int32_t seeds[2][14] = {{896, 64, 4, 8, 0, 8, 16, 16, 128, 0, 1, 8, 8, 0},
                                         {16, 16, 2, 2, 1, 2, 8, 8, 128, 1, 2, 2, 4, 5}};
    const char *env = getenv("HEP_FUZZ_SECONDS");
    double limit = env ? atof(env) : 3.0;
    struct timespec t0, t;
    uint64_t s = 0x9e3779b97f4a7c15ull;
    long runs = 0;
    uint8_t buf[64];
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        size_t n = sizeof(seeds[0]);
        memcpy(buf, seeds[rnd(&s) % 2], n);
        for (int m = 1 + (int)(rnd(&s) % 4); m > 0; m--) { /* bit flips, bytes, ints */
            size_t at = rnd(&s) % n;
            switch (rnd(&s) % 4) {
            case 0: buf[at] ^= (uint8_t)(1u << (rnd(&s) % 8)); break;
            case 1: buf[at] = (uint8_t)rnd(&s); break;
            case 2: { int32_t v = (int32_t)rnd(&s); memcpy(buf + at / 4 * 4, &v, 4); break; }
            default: { int32_t v = (int32_t)(rnd(&s) % 9) - 2; memcpy(buf + at / 4 * 4, &v, 4); }
            }
        }
        LLVMFuzzerTestOneInput(buf, rnd(&s) % 8 ? n : rnd(&s) % n);
        runs++;
        clock_gettime(CLOCK_MONOTONIC, &t);
        if ((double)(t.tv_sec - t0.tv_sec) + (double)(t.tv_nsec - t0.tv_nsec) / 1e9 > limit)
            break;
    }
    printf("fuzz_plan: %ld inputs in %.1f s, no failure\n", runs, limit);
    return runs > 0 ? 0 : 1;
}
#endif
