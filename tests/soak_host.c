/* A bounded soak of dispatch + combine on the host backend: random shapes (one and several
 * virtual nodes, BF16 and FP8, int32 and int64 ids), random routing with unused, duplicate
 * and out-of-range ids, sometimes ids reused by the caller before combine; each case
 * checked against the test's own oracle (ep_case_check), every status checked.
 * HEP_SOAK_SECONDS (default 3) bounds it; the seed of a failing case is printed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/core.h"
#include "ep_case.h"
#include "fake_mr.h"

static unsigned next(unsigned *s)
{
    *s ^= *s << 13, *s ^= *s >> 17, *s ^= *s << 5;
    return *s;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* Returns the number of failures of the case of `seed`. */
static int soak_case(unsigned seed)
{
    static ep_case c;
    static const int worlds[] = {1, 2, 3, 4, 6, 8};
    unsigned s = seed * 2654435761u + 1;
    int bad = 0, fp8, W, R, invalid[EP_MAX_RANKS] = {0};
    memset(&c, 0, sizeof(c));
    W = worlds[next(&s) % 6];
    do
        R = 1 + (int)(next(&s) % (unsigned)W);
    while (W % R);
    fp8 = next(&s) % 3 == 0;
    c.cfg = test_config(fp8 ? 128 * (1 + (int)(next(&s) % 2)) : 8 * (1 + (int)(next(&s) % 16)),
                        1 + (int)(next(&s) % 12), 1 + (int)(next(&s) % 3), 1,
                        fp8 ? HEP_DTYPE_FP8_E4M3 : HEP_DTYPE_BF16);
    c.cfg.backend = HEP_BACKEND_HOST;
    c.cfg.ranks_per_node = R == W && next(&s) % 2 ? 0 : R;
    c.K = 1 + (int)(next(&s) % 4);
    if (c.K > c.cfg.experts_per_rank * W)
        c.K = c.cfg.experts_per_rank * W;
    c.cfg.max_topk = c.K + (int)(next(&s) % 2);
    if (c.cfg.max_topk > c.cfg.experts_per_rank * W)
        c.cfg.max_topk = c.K;
    c.world = W;
    c.index64 = next(&s) % 2;
    c.zero_copy = next(&s) % 2;
    c.repeat = 1 + (int)(next(&s) % 2);
    c.clobber_ids = next(&s) % 4 == 0 ? 1 + (int)(next(&s) % 2) : 0;
    c.skip_rank = -1;
    ep_case_random(&c, seed, (int)(next(&s) % 3));
    /* a few ids out of range: reported by their rank as ignored, dropped everywhere */
    for (int r = 0; r < W; r++)
        if (c.in[r].t && next(&s) % 5 == 0) {
            size_t at = next(&s) % ((size_t)c.in[r].t * (size_t)c.K);
            long long v = next(&s) % 2 ? -2 - (long long)(next(&s) % 100)
                                       : (long long)c.cfg.experts_per_rank * W + next(&s) % 100;
            if (c.index64)
                ((long long *)c.in[r].idx)[at] = v;
            else
                ((int *)c.in[r].idx)[at] = (int)v;
            invalid[r] = 1;
        }
    if (ep_case_run(&c)) {
        fprintf(stderr, "soak seed %u: could not run the ranks\n", seed);
        return 1;
    }
    for (int r = 0; r < W; r++) {
        int want = invalid[r] ? HEP_WARN_IGNORED : HEP_OK;
        if (c.out[r].rc_dispatch != want || c.out[r].rc_combine != HEP_OK) {
            fprintf(stderr, "soak seed %u (W %d R %d): rank %d dispatch %s (expected %s), "
                            "combine %s: %s\n",
                    seed, W, R, r, hep_status_name(c.out[r].rc_dispatch), hep_status_name(want),
                    hep_status_name(c.out[r].rc_combine), c.out[r].err);
            bad++;
        }
        for (size_t q = 0; invalid[r] && q < (size_t)c.in[r].t * (size_t)c.K; q++) {
            long long v = c.index64 ? ((long long *)c.in[r].idx)[q] : ((int *)c.in[r].idx)[q];
            if (v < -1 || v >= (long long)c.cfg.experts_per_rank * W) {
                if (c.index64)
                    ((long long *)c.in[r].idx)[q] = -1;
                else
                    ((int *)c.in[r].idx)[q] = -1;
            }
        }
    }
    if (!bad && ep_case_check(&c)) {
        fprintf(stderr, "soak seed %u (W %d R %d K %d H %d): outputs differ from the oracle\n",
                seed, W, R, c.K, c.cfg.hidden);
        bad++;
    }
    ep_case_free(&c);
    return bad;
}

int main(int argc, char **argv)
{
    double limit = getenv("HEP_SOAK_SECONDS") ? atof(getenv("HEP_SOAK_SECONDS")) : 3.0;
    double start = now_s();
    unsigned seed = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 10) : 1;
    int cases = 0, bad = 0;
    if (argc > 1) /* one case, to reproduce a failure */
        return soak_case(seed) ? 1 : 0;
    while (now_s() - start < limit && bad == 0) {
        bad += soak_case(seed++);
        cases++;
    }
    printf("soak: %d random cases in %.1f s, %d failed\n", cases, now_s() - start, bad);
    return bad || cases == 0 ? 1 : 0;
}
