/* core: status, error message, logging, env knobs, checked arithmetic.
 * Lowest layer; everything else may include it. */
#ifndef HEP_CORE_H
#define HEP_CORE_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "hybridep/status.h"

#if defined(__GNUC__)
#define HEP_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define HEP_PRINTF(a, b)
#endif

/* Set this thread's error message and return status (so: `return hep_fail(...)`). */
int hep_fail(int status, const char *fmt, ...) HEP_PRINTF(2, 3);
/* Replace the message without a printf pass (used to carry another rank's text). */
void hep_set_error_text(const char *text);
/* Clear the message (at the start of a public call that succeeds). */
void hep_clear_error(void);

/* ---- logging ---- */
typedef enum { HEP_LOG_ERROR = 0, HEP_LOG_WARN = 1, HEP_LOG_INFO = 2, HEP_LOG_DEBUG = 3 } hep_log_level;
void hep_log(int level, const char *fmt, ...) HEP_PRINTF(2, 3);
int hep_log_enabled(int level);
/* Milliseconds of CLOCK_MONOTONIC (deadlines, and the times in debug lines). */
double hep_now_ms(void);
/* Tests capture log lines with a sink; NULL restores stderr. */
typedef void (*hep_log_sink)(void *ctx, int level, const char *line);
void hep_log_set_sink(hep_log_sink sink, void *ctx);

/* ---- env knobs: all read here, once, into one struct ---- */
typedef enum { HEP_MR_MODE_AUTO = 0, HEP_MR_MODE_DMABUF = 1, HEP_MR_MODE_LEGACY = 2 } hep_mr_mode;
typedef enum { HEP_STORES_AUTO = 0, HEP_STORES_PLAIN = 1, HEP_STORES_BULK = 2 } hep_stores_mode;
typedef struct hep_env {
    int log_level;          /* HEP_LOG_LEVEL: error|warn|info|debug (default info) */
    int mr_mode;            /* HEP_GPU_MR_MODE: auto|dmabuf|legacy (default auto) */
    uint64_t timeout_ms;    /* HEP_TIMEOUT_MS: bound of every wait (default 30000), 1..
                               HEP_TIMEOUT_MAX_MS (larger values are capped) */
    const char *nic_map;    /* HEP_NIC_MAP: "gpu:device,..." (NULL: nearest by PCI; a
                               malformed value is reported and ignored) */
    int gid_index;          /* HEP_IB_GID_INDEX: 0..255; -1 = pick RoCE v2 automatically */
    const char *ibverbs_lib;/* HEP_IBVERBS_LIB: path of libibverbs (default libibverbs.so.1) */
    const char *nic;        /* HEP_NIC: loopback|verbs|auto (default auto) */
    uint64_t jitter_us;     /* HEP_DEBUG_JITTER_US: 0 (default, off) or the most microseconds
                               of each random delay injected where the inter-node path
                               orders its writes (hep_debug_jitter; kernels: block start) */
    uint64_t jitter_seed;   /* HEP_DEBUG_JITTER_SEED: seed of those delays (default 1) */
    int dispatch_stores;    /* HEP_DISPATCH_STORES: auto|plain|bulk (default auto): how the
                               GPU dispatch kernel writes rows (backend_gpu.c) */
    char errors[512];       /* what could not be parsed, "" if all were fine */
} hep_env;
/* The parsed knobs (read on first use). */
const hep_env *hep_env_get(void);
/* Read the environment again (tests change variables between cases). */
const hep_env *hep_env_reload(void);

/* The largest HEP_TIMEOUT_MS (24 hours): in nanoseconds, times 2 plus an eighth (the
 * kernels' longest bound), it stays far below 2^64. */
#define HEP_TIMEOUT_MAX_MS 86400000ull
/* HEP_TIMEOUT_MS (capped) in ns, for the kernels' bound. */
uint64_t hep_timeout_ns(void);
/* The bound of a host-side wait on this thread: HEP_TIMEOUT_MS times the patience factor
 * (1 unless set: destroy waits longer, so that ranks still timing out in a call reach it). */
uint64_t hep_wait_limit_ms(void);
void hep_wait_patience(unsigned factor);

/* ---- debug jitter (core/jitter.c) ----
 * With HEP_DEBUG_JITTER_US = N > 0: sleep a pseudo-random 0..N us (a per-thread PRNG seeded
 * from HEP_DEBUG_JITTER_SEED and the thread's order of first use, so a run is
 * reproducible up to the threads' scheduling). With 0 (the default): one load and return. */
void hep_debug_jitter(void);
/* The next value of this thread's jitter PRNG (for tests that want the same sequence). */
uint64_t hep_debug_jitter_next(void);

/* ---- checked arithmetic (1 on overflow) ---- */
static inline int hep_mul_overflow(size_t a, size_t b, size_t *out)
{
    return __builtin_mul_overflow(a, b, out);
}
static inline int hep_add_overflow(size_t a, size_t b, size_t *out)
{
    return __builtin_add_overflow(a, b, out);
}

#endif
