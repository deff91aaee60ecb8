/* bootstrap/inproc.c: the in-process bootstrap (threads), every wait bounded. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/core.h"
#include "hybridep/bootstrap.h"

struct hep_inproc_world {
    int size;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    unsigned long generation; /* completed collectives */
    int arrived;
    unsigned char *present;   /* who arrived in the current collective */
    unsigned char *buf;       /* the current allgather's data */
    size_t bytes;
    int broken;               /* a collective failed: every later one fails too */
    int why_rc;               /* ... with this status */
    char why[512];            /* ... and this message */
};

typedef struct inproc_rank {
    hep_inproc_world *world;
    int rank;
} inproc_rank;

static void deadline_after(struct timespec *ts, uint64_t ms)
{
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += (time_t)(ms / 1000);
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

static int missing_ranks(hep_inproc_world *w, char *out, size_t len)
{
    size_t n = 0;
    int count = 0;
    out[0] = '\0';
    for (int r = 0; r < w->size && n + 16 < len; r++)
        if (!w->present[r]) {
            n += (size_t)snprintf(out + n, len - n, "%s%d", count ? ", " : "", r);
            count++;
        }
    return count;
}

/* Called with the lock held; releases it. Every rank reports the first failure. */
static int broken_status(hep_inproc_world *w)
{
    char why[512];
    int rc = w->why_rc;
    snprintf(why, sizeof(why), "%s", w->why);
    pthread_mutex_unlock(&w->lock);
    return hep_fail(rc, "%s", why);
}

/* One collective: each rank deposits `bytes` at its slot; the last one wakes the others;
 * all copy the whole buffer out before the next collective can start. */
static int collective(inproc_rank *me, const void *send, void *recv, size_t bytes, const char *what)
{
    hep_inproc_world *w = me->world;
    struct timespec dl;
    unsigned long gen;
    int rc = HEP_OK;

    deadline_after(&dl, hep_wait_limit_ms());
    pthread_mutex_lock(&w->lock);
    if (w->broken)
        return broken_status(w);
    /* wait until the previous collective has been read by everyone */
    while (w->arrived < 0 && rc == 0 && !w->broken)
        rc = pthread_cond_timedwait(&w->cond, &w->lock, &dl);
    if (w->broken)
        return broken_status(w);
    if (rc == 0 && w->arrived == 0) {
        free(w->buf);
        w->buf = calloc((size_t)w->size, bytes ? bytes : 1);
        w->bytes = bytes;
        memset(w->present, 0, (size_t)w->size);
        if (!w->buf)
            rc = ENOMEM;
    }
    if (rc == 0 && w->bytes != bytes) {
        w->broken = 1;
        w->why_rc = HEP_ERR_BOOTSTRAP;
        snprintf(w->why, sizeof(w->why),
                 "in-process bootstrap: rank %d called %s with %zu bytes, others with %zu",
                 me->rank, what, bytes, w->bytes);
        pthread_cond_broadcast(&w->cond);
        return broken_status(w);
    }
    if (rc == 0) {
        if (bytes)
            memcpy(w->buf + (size_t)me->rank * bytes, send, bytes);
        w->present[me->rank] = 1;
        gen = w->generation;
        if (++w->arrived == w->size) {
            w->generation++;
            w->arrived = -w->size; /* now draining: each reader counts back to 0 */
            pthread_cond_broadcast(&w->cond);
        }
        while (w->generation == gen && rc == 0 && !w->broken)
            rc = pthread_cond_timedwait(&w->cond, &w->lock, &dl);
    }
    if (rc == 0 && !w->broken) {
        if (bytes && recv)
            memcpy(recv, w->buf, (size_t)w->size * bytes);
        if (++w->arrived == 0)
            pthread_cond_broadcast(&w->cond);
        pthread_mutex_unlock(&w->lock);
        return HEP_OK;
    }
    if (!w->broken) {
        w->broken = 1;
        if (rc == ETIMEDOUT) {
            char who[256];
            int n = missing_ranks(w, who, sizeof(who));
            w->why_rc = HEP_ERR_TIMEOUT;
            snprintf(w->why, sizeof(w->why),
                     "in-process bootstrap: %s timed out after %llu ms (HEP_TIMEOUT_MS); %d "
                     "rank(s) did not arrive: %s",
                     what, (unsigned long long)hep_wait_limit_ms(), n,
                     n ? who : "none (a reader was late)");
        } else {
            w->why_rc = rc == ENOMEM ? HEP_ERR_NOMEM : HEP_ERR_BOOTSTRAP;
            snprintf(w->why, sizeof(w->why), "in-process bootstrap: %s failed on rank %d: %s",
                     what, me->rank, strerror(rc));
        }
        pthread_cond_broadcast(&w->cond);
    }
    return broken_status(w);
}

static int inproc_allgather(void *ctx, const void *send, void *recv, size_t bytes)
{
    return collective(ctx, send, recv, bytes, "allgather");
}

static int inproc_barrier(void *ctx)
{
    return collective(ctx, NULL, NULL, 0, "barrier");
}

int hep_inproc_world_create(int size, hep_inproc_world **world)
{
    hep_inproc_world *w;
    if (!world)
        return hep_fail(HEP_ERR_INVALID, "in-process world: the output pointer is NULL");
    *world = NULL;
    if (size <= 0 || size > HEP_INPROC_MAX_RANKS)
        return hep_fail(HEP_ERR_INVALID, "in-process world: size %d is not in 1..%d", size,
                        HEP_INPROC_MAX_RANKS);
    w = calloc(1, sizeof(*w) + (size_t)size * sizeof(inproc_rank));
    if (!w)
        return hep_fail(HEP_ERR_NOMEM, "in-process world: out of memory");
    w->present = calloc((size_t)size, 1);
    if (!w->present) {
        free(w);
        return hep_fail(HEP_ERR_NOMEM, "in-process world: out of memory");
    }
    w->size = size;
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->cond, NULL);
    for (int r = 0; r < size; r++) {
        inproc_rank *slot = (inproc_rank *)(w + 1) + r;
        slot->world = w;
        slot->rank = r;
    }
    *world = w;
    return HEP_OK;
}

int hep_inproc_bootstrap(hep_inproc_world *world, int rank, hep_bootstrap *bs)
{
    if (!world || !bs || rank < 0 || rank >= world->size)
        return hep_fail(HEP_ERR_INVALID, "in-process bootstrap: rank %d is not in the world",
                        rank);
    bs->rank = rank;
    bs->size = world->size;
    bs->ctx = (inproc_rank *)(world + 1) + rank;
    bs->allgather = inproc_allgather;
    bs->barrier = inproc_barrier;
    return HEP_OK;
}

void hep_inproc_world_destroy(hep_inproc_world *world)
{
    if (!world)
        return;
    pthread_mutex_destroy(&world->lock);
    pthread_cond_destroy(&world->cond);
    free(world->buf);
    free(world->present);
    free(world);
}
