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

static uint64_t parse_u64(hep_env *e, const char *name, uint64_t def, uint64_t min)
{
    const char *v = getenv(name);
    char *end = NULL;
    unsigned long long x;
    if (!v || !*v)
        return def;
    errno = 0;
    x = strtoull(v, &end, 10);
    if (errno || *end || v[0] == '-' || x < min) {
        env_note(e, name, v, "a positive integer");
        return def;
    }
    return (uint64_t)x;
}

static void env_read(hep_env *e)
{
    static const char *const levels[] = {"error", "warn", "info", "debug"};
    static const char *const modes[] = {"auto", "dmabuf", "legacy"};
    static const char *const nics[] = {"auto", "loopback", "verbs"};
    const char *gid;

    memset(e, 0, sizeof(*e));
    e->log_level = parse_choice(e, "HEP_LOG_LEVEL", levels, 4, HEP_LOG_INFO);
    e->mr_mode = parse_choice(e, "HEP_GPU_MR_MODE", modes, 3, HEP_MR_MODE_AUTO);
    e->timeout_ms = parse_u64(e, "HEP_TIMEOUT_MS", 30000, 1);
    e->nic_map = getenv("HEP_NIC_MAP");
    e->ibverbs_lib = getenv("HEP_IBVERBS_LIB");
    if (!e->ibverbs_lib || !*e->ibverbs_lib)
        e->ibverbs_lib = "libibverbs.so.1";
    e->nic = nics[parse_choice(e, "HEP_NIC", nics, 3, 0)];
    gid = getenv("HEP_IB_GID_INDEX");
    e->gid_index = -1;
    if (gid && *gid)
        e->gid_index = (int)parse_u64(e, "HEP_IB_GID_INDEX", 0, 0);
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

const hep_env *hep_env_reload(void)
{
    pthread_mutex_lock(&env_lock);
    env_read(&env_value);
    env_loaded = 1;
    pthread_mutex_unlock(&env_lock);
    warn_once(1);
    return &env_value;
}
