/* examples/host_inproc.c: a whole expert-parallel step with hybridep, in one process.
 *
 * Four ranks are threads sharing the in-process bootstrap; the host backend moves the
 * data (it needs no GPU; with GPUs, set HEP_BACKEND_GPU and pass device memory and a
 * stream). Each rank routes its tokens to two experts, the "experts" double their rows,
 * and combine brings the sums back; the program checks every output element.
 *
 *   cc host_inproc.c $(pkg-config --cflags --libs hybridep) -lpthread -o host_inproc
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <hybridep/hybridep.h>

#define RANKS 4
#define TOKENS 16
#define HIDDEN 64
#define EXPERTS_PER_RANK 2
#define TOPK 2

typedef struct rank_arg {
    hep_inproc_world *world;
    int rank, ok;
} rank_arg;

static uint16_t bf16(float f) /* BF16 of a small integer-valued float: exact */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static float f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void *run_rank(void *p)
{
    rank_arg *a = p;
    hep_config cfg;
    hep_bootstrap bs;
    hep_group *g = NULL;
    static _Thread_local uint16_t x[TOKENS * HIDDEN], y[TOKENS * HIDDEN];
    int idx[TOKENS * TOPK];
    float w[TOKENS * TOPK];
    hep_dispatch_result dr;
    int rc;

    hep_config_default(&cfg);
    cfg.hidden = HIDDEN;
    cfg.max_tokens = TOKENS;
    cfg.experts_per_rank = EXPERTS_PER_RANK;
    cfg.max_topk = TOPK;
    cfg.backend = HEP_BACKEND_HOST;
    for (int t = 0; t < TOKENS; t++) {
        for (int h = 0; h < HIDDEN; h++)
            x[t * HIDDEN + h] = bf16((float)(a->rank + t % 4));
        for (int k = 0; k < TOPK; k++) { /* two different experts on two different ranks */
            idx[t * TOPK + k] = ((a->rank + t + k) % RANKS) * EXPERTS_PER_RANK + k % 2;
            w[t * TOPK + k] = 0.5f;
        }
    }
    hep_inproc_bootstrap(a->world, a->rank, &bs);
    rc = hep_group_create(&cfg, &bs, 0, &g);
    if (rc == HEP_OK) {
        hep_dispatch_args da = {.num_tokens = TOKENS, .tokens = x, .topk_idx = idx,
                                .index_type = HEP_INDEX_INT32, .topk = TOPK, .topk_weights = w};
        rc = hep_dispatch(g, &da, &dr);
    }
    if (rc == HEP_OK) {
        /* the experts: each received row doubled, written where combine reads it */
        uint16_t *in = dr.tokens, *out = hep_combine_input(g);
        for (size_t i = 0; i < (size_t)dr.num_recv * HIDDEN; i++)
            out[i] = bf16(2 * f32(in[i]));
        hep_combine_args ca = {.handle = dr.handle, .expert_out = out, .out = y};
        rc = hep_combine(g, &ca);
    }
    if (rc == HEP_OK) { /* each token went to two ranks: 2 x 2 x its value */
        a->ok = 1;
        for (int t = 0; t < TOKENS; t++)
            for (int h = 0; h < HIDDEN; h++)
                a->ok &= f32(y[t * HIDDEN + h]) == 4.0f * (float)(a->rank + t % 4);
        printf("rank %d: received %d rows, combine %s\n", a->rank, dr.num_recv,
               a->ok ? "correct" : "WRONG");
    } else {
        fprintf(stderr, "rank %d: %s: %s\n", a->rank, hep_status_name(rc), hep_last_error());
    }
    hep_group_destroy(g);
    return NULL;
}

int main(void)
{
    hep_inproc_world *world = NULL;
    pthread_t th[RANKS];
    rank_arg args[RANKS];
    int ok = 1;
    printf("hybridep %s: %d ranks in one process, host backend\n", hep_version(), RANKS);
    if (hep_inproc_world_create(RANKS, &world) != HEP_OK) {
        fprintf(stderr, "%s\n", hep_last_error());
        return 1;
    }
    for (int r = 0; r < RANKS; r++) {
        args[r] = (rank_arg){world, r, 0};
        if (pthread_create(&th[r], NULL, run_rank, &args[r]) != 0)
            return 1;
    }
    for (int r = 0; r < RANKS; r++) {
        pthread_join(th[r], NULL);
        ok &= args[r].ok;
    }
    hep_inproc_world_destroy(world);
    printf("%s\n", ok ? "OK" : "FAILED");
    return ok ? 0 : 1;
}
