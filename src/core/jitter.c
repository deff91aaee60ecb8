/* core/jitter.c: random delays for stress runs of the inter-node path (HEP_DEBUG_JITTER_US,
 * off by default). The proxy thread calls hep_debug_jitter before it reads a ready word, and
 * the loopback NIC before, inside and after a write, so that orderings which ordinary runs
 * never show (a ready word read late, a flag landing long after its data was posted) come
 * up in a few thousand calls. */
#include <time.h>

#include "core.h"

static uint64_t next_thread_stream; /* the order of first use, mixed into each thread's seed */
static _Thread_local uint64_t jitter_state;
static _Thread_local int jitter_seeded;

/* splitmix64: small, and every seed gives a full-period sequence */
static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t hep_debug_jitter_next(void)
{
    if (!jitter_seeded) {
        uint64_t stream = __atomic_fetch_add(&next_thread_stream, 1, __ATOMIC_RELAXED);
        jitter_state = hep_env_get()->jitter_seed * 0x100000001b3ull + stream;
        jitter_seeded = 1;
    }
    return splitmix(&jitter_state);
}

void hep_debug_jitter(void)
{
    /* the knobs' struct lives as long as the process: no lock on this path when it is off */
    static const hep_env *env;
    const hep_env *e = __atomic_load_n(&env, __ATOMIC_ACQUIRE);
    uint64_t us, max_us;
    struct timespec ts;
    if (!e) {
        e = hep_env_get();
        __atomic_store_n(&env, e, __ATOMIC_RELEASE);
    }
    max_us = e->jitter_us;
    if (max_us == 0)
        return;
    us = hep_debug_jitter_next() % (max_us + 1);
    if (us == 0)
        return;
    ts.tv_sec = (time_t)(us / 1000000);
    ts.tv_nsec = (long)(us % 1000000) * 1000;
    nanosleep(&ts, NULL);
}
