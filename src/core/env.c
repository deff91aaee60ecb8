/* core/env.c: every environment knob of hybridep is read here, and only here.
 * The README lists them; keep the two in step. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core.h"

static hep_env env_value;
static int env_loaded;
static pthread_mutex_t env_lock = PTHREAD_MUTEX_INITIALIZER;

static void env_note(hep_env *e, const char *name, const char *val, const char *expect)
{
    size_t n = strlen(e->errors);
    snprintf(e->errors + n, sizeof(e->errors) - n, "%s%s='%s' (expected %s)", n ? "; " : "", name,
             val, expect);
}

static int parse_choice(hep_env *e, const char *name, const char *const *names, int count, int def)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return def;
    for (int i = 0; i < count; i++)
        if (strcasecmp(v, names[i]) == 0)
            return i;
    env_note(e, name, v, names[0]);
    return def;
}

/* Decimal digits only: strtoull alone accepts leading blanks and a sign, and turns " -1"
 * into 2^64 - 1. A value above `max` is capped to it (and reported) when `cap` is set,
 * else rejected. */
static uint64_t parse_u64(hep_env *e, const char *name, uint64_t def, uint64_t min, uint64_t max,
                          const char *expect, int cap)
{
    const char *v = getenv(name);
    char *end = NULL;
    unsigned long long x;
    if (!v || !*v)
        return def;
    errno = 0;
    x = v[0] >= '0' && v[0] <= '9' ? strtoull(v, &end, 10) : 0;
    if (!end || *end || x < min || (errno && !cap) || (x > max && !cap)) {
        env_note(e, name, v, expect);
        return def;
    }
    if (errno || x > max) {
        char what[96];
        snprintf(what, sizeof(what), "at most %llu: capped to it", (unsigned long long)max);
        env_note(e, name, v, what);
        return max;
    }
    return (uint64_t)x;
}

/* "gpu:device,..." with gpu a decimal CUDA ordinal and device a non-empty name. */
static int nic_map_valid(const char *v)
{
    while (*v) {
        const char *colon = strchr(v, ':'), *comma;
        if (!colon || colon == v)
            return 0;
        for (const char *c = v; c < colon; c++)
            if (*c < '0' || *c > '9')
                return 0;
        comma = strchr(colon + 1, ',');
        if (comma == colon + 1 || colon[1] == '\0')
            return 0;
        if (!comma)
            return 1;
        v = comma + 1;
        if (!*v)
            return 0;
    }
    return 0;
}

static void env_read(hep_env *e)
{
    static const char *const levels[] = {"error", "warn", "info", "debug"};
    static const char *const modes[] = {"auto", "dmabuf", "legacy"};
    static const char *const nics[] = {"auto", "loopback", "verbs"};
    static const char *const stores[] = {"auto", "plain", "bulk"};
    const char *gid;

    memset(e, 0, sizeof(*e));
    e->log_level = parse_choice(e, "HEP_LOG_LEVEL", levels, 4, HEP_LOG_INFO);
    e->mr_mode = parse_choice(e, "HEP_GPU_MR_MODE", modes, 3, HEP_MR_MODE_AUTO);
    e->timeout_ms = parse_u64(e, "HEP_TIMEOUT_MS", 30000, 1, HEP_TIMEOUT_MAX_MS,
                              "an integer in 1..86400000", 1);
    e->nic_map = getenv("HEP_NIC_MAP");
    if (e->nic_map && !*e->nic_map)
        e->nic_map = NULL;
    if (e->nic_map && !nic_map_valid(e->nic_map)) {
        env_note(e, "HEP_NIC_MAP", e->nic_map, "gpu:device[,gpu:device...], e.g. 0:mlx5_0");
        e->nic_map = NULL;
    }
    e->ibverbs_lib = getenv("HEP_IBVERBS_LIB");
    if (!e->ibverbs_lib || !*e->ibverbs_lib)
        e->ibverbs_lib = "libibverbs.so.1";
    e->nic = nics[parse_choice(e, "HEP_NIC", nics, 3, 0)];
    e->jitter_us = parse_u64(e, "HEP_DEBUG_JITTER_US", 0, 0, 1000000,
                             "an integer in 0..1000000 (microseconds)", 0);
    e->jitter_seed = parse_u64(e, "HEP_DEBUG_JITTER_SEED", 1, 0, UINT64_MAX,
                               "a non-negative integer", 0);
    e->dispatch_stores = parse_choice(e, "HEP_DISPATCH_STORES", stores, 3, HEP_STORES_AUTO);
    gid = getenv("HEP_IB_GID_INDEX");
    e->gid_index = -1;
    if (gid && *gid)
        e->gid_index = (int)parse_u64(e, "HEP_IB_GID_INDEX", (uint64_t)-1, 0, 255,
                                      "an integer in 0..255", 0);
}

/* A value that could not be parsed is reported once, as a warning; its default is used.
 * (Logged after the lock is released: hep_log reads the knobs itself.) */
static void warn_once(int fresh)
{
    if (fresh && env_value.errors[0])
        hep_log(HEP_LOG_WARN, "ignoring environment: %s; the defaults are used",
                env_value.errors);
}

const hep_env *hep_env_get(void)
{
    int fresh = 0;
    pthread_mutex_lock(&env_lock);
    if (!env_loaded) {
        env_read(&env_value);
        env_loaded = 1;
        fresh = 1;
    }
    pthread_mutex_unlock(&env_lock);
    warn_once(fresh);
    return &env_value;
}

static _Thread_local unsigned wait_patience = 1;

void hep_wait_patience(unsigned factor)
{
    wait_patience = factor ? factor : 1;
}

uint64_t hep_wait_limit_ms(void)
{
    uint64_t ms = hep_env_get()->timeout_ms;
    return (ms < HEP_TIMEOUT_MAX_MS ? ms : HEP_TIMEOUT_MAX_MS) * wait_patience;
}

uint64_t hep_timeout_ns(void)
{
    uint64_t ms = hep_env_get()->timeout_ms;
    /* the kernels compute timeout_ns * 2 + timeout_ns / 8: capped, that cannot wrap */
    return (ms < HEP_TIMEOUT_MAX_MS ? ms : HEP_TIMEOUT_MAX_MS) * 1000000ull;
}

const hep_env *hep_env_reload(void)
{
    pthread_mutex_lock(&env_lock);
    env_read(&env_value);
    env_loaded = 1;
    pthread_mutex_unlock(&env_lock);
    warn_once(1);
    return &env_value;
}
