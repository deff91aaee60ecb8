/* examples/train_step.c: the training API of hybridep, in one process.
 *
 * Four ranks are threads over the in-process bootstrap, on the host backend (no GPU). A
 * layer's forward records its layout in a handle and receives its rows in the
 * expert-major layout (each local expert's rows contiguous, padded to a multiple of
 * PAD); the experts scale their rows; combine sums each token's rows and brings back the
 * gradient of the row probabilities to each token's expert slots; the backward then
 * dispatches again with the same layout (HEP_REUSE_LAYOUT: no routing pass). The program
 * checks every output.
 *
 *   cc train_step.c $(pkg-config --cflags --libs hybridep) -lpthread -o train_step
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <hybridep/hybridep.h>

#define RANKS 4
#define TOKENS 16
#define HIDDEN 64
#define EXPERTS_PER_RANK 2
#define TOPK 2
#define PAD 12
#define BUDGET 48 /* rows a rank may receive: 2 experts x 16 rows, each padded to 24 */
#define E (RANKS * EXPERTS_PER_RANK)

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

static int check(int rank, int ok, const char *what)
{
    if (!ok)
        fprintf(stderr, "rank %d: %s: WRONG\n", rank, what);
    return ok;
}

static void *run_rank(void *p)
{
    rank_arg *a = p;
    hep_config cfg;
    hep_bootstrap bs;
    hep_group *g = NULL;
    hep_handle *h = NULL;
    static _Thread_local uint16_t x[TOKENS * HIDDEN], y[TOKENS * HIDDEN];
    static _Thread_local uint16_t rows[BUDGET * HIDDEN], rows2[BUDGET * HIDDEN];
    static _Thread_local uint16_t eout[BUDGET * HIDDEN];
    static _Thread_local float rprob[BUDGET], rprob2[BUDGET], gprob[BUDGET], gout[TOKENS * E];
    int idx[TOKENS * TOPK], rc, ok = 1;
    float w[TOKENS * TOPK];
    hep_dispatch_result dr;
    hep_dispatch_opts xo;
    int64_t tpe[EXPERTS_PER_RANK];

    hep_config_default(&cfg);
    cfg.hidden = HIDDEN;
    cfg.max_tokens = TOKENS;
    cfg.experts_per_rank = EXPERTS_PER_RANK;
    cfg.max_topk = TOPK;
    cfg.backend = HEP_BACKEND_HOST;
    for (int t = 0; t < TOKENS; t++) {
        for (int c = 0; c < HIDDEN; c++)
            x[t * HIDDEN + c] = bf16((float)(a->rank + t % 4));
        for (int k = 0; k < TOPK; k++) { /* local expert k of two different ranks */
            idx[t * TOPK + k] = ((a->rank + t + k) % RANKS) * EXPERTS_PER_RANK + k;
            w[t * TOPK + k] = 0.25f * (float)(k + 1);
        }
    }
    hep_inproc_bootstrap(a->world, a->rank, &bs);
    rc = hep_group_create(&cfg, &bs, 0, &g);
    if (rc == HEP_OK)
        rc = hep_handle_create(g, &h);
    /* forward: dispatch into the expert-major layout, recorded in h */
    hep_dispatch_args da = {.num_tokens = TOKENS, .tokens = x, .topk_idx = idx,
                            .index_type = HEP_INDEX_INT32, .topk = TOPK, .topk_weights = w};
    memset(&xo, 0, sizeof(xo));
    xo.handle = h, xo.layout = HEP_LAYOUT_EXPERT_MAJOR, xo.pad_multiple = PAD;
    xo.num_permuted_tokens = BUDGET, xo.recv_tokens = rows, xo.recv_probs = rprob;
    if (rc == HEP_OK)
        rc = hep_dispatch_ex(g, &da, &xo, &dr);
    if (rc == HEP_OK) {
        memcpy(tpe, xo.tokens_per_expert, sizeof(tpe));
        /* every rank gets 16 rows on each local expert, padded to 24; no row dropped */
        ok &= check(a->rank, xo.num_permuted == BUDGET && !xo.overflow && tpe[0] == 24 &&
                                 tpe[1] == 24,
                    "rows and tokens per expert");
        /* the experts: local expert e scales its rows by e + 1 (padding rows are zeros);
         * the gradient of a row's probability is twice the probability */
        for (int r = 0; r < BUDGET; r++) {
            const int e = r < tpe[0] ? 0 : 1;
            for (int c = 0; c < HIDDEN; c++)
                eout[r * HIDDEN + c] = bf16((float)(e + 1) * f32(rows[r * HIDDEN + c]));
            gprob[r] = 2.0f * rprob[r];
        }
        hep_combine_args ca = {.expert_out = eout, .out = y};
        hep_combine_opts co = {.handle = h, .probs_in = gprob, .probs_out = gout};
        rc = hep_combine_ex(g, &ca, &co);
    }
    if (rc == HEP_OK) {
        /* a token's rows: x on expert slot 0 (scaled by 1) plus x on slot 1 (by 2) */
        for (int t = 0; t < TOKENS; t++)
            for (int c = 0; c < HIDDEN; c++)
                ok &= f32(y[t * HIDDEN + c]) == 3.0f * (float)(a->rank + t % 4);
        ok = check(a->rank, ok, "combined tokens");
        /* the probabilities' gradient: 2 x the slot's weight at the slot's expert, else 0 */
        for (int t = 0; t < TOKENS; t++)
            for (int e = 0; e < E; e++) {
                float want = 0.f;
                for (int k = 0; k < TOPK; k++)
                    if (idx[t * TOPK + k] == e)
                        want = 2.0f * w[t * TOPK + k];
                ok &= gout[t * E + e] == want;
            }
        ok = check(a->rank, ok, "probabilities through combine");
        /* backward of combine: the same layout again, no routing; the same rows */
        da.flags = HEP_REUSE_LAYOUT, da.topk_idx = NULL, da.topk = 0, da.topk_weights = NULL;
        xo.recv_tokens = rows2, xo.recv_probs = rprob2;
        rc = hep_dispatch_ex(g, &da, &xo, &dr);
    }
    if (rc == HEP_OK) {
        ok &= check(a->rank, !memcmp(rows, rows2, sizeof(rows)) &&
                                 !memcmp(rprob, rprob2, sizeof(rprob)),
                    "dispatch with the reused layout");
        printf("rank %d: %d expert-major rows (%lld + %lld), combine and gradients %s\n",
               a->rank, xo.num_permuted, (long long)tpe[0], (long long)tpe[1],
               ok ? "correct" : "WRONG");
        a->ok = ok;
    } else {
        fprintf(stderr, "rank %d: %s: %s\n", a->rank, hep_status_name(rc), hep_last_error());
    }
    hep_handle_destroy(h);
    hep_group_destroy(g);
    return NULL;
}

int main(void)
{
    hep_inproc_world *world = NULL;
    pthread_t th[RANKS];
    rank_arg args[RANKS];
    int ok = 1;
    printf("hybridep %s: a training step of %d ranks in one process, host backend\n",
           hep_version(), RANKS);
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
