/* hybridep: status codes and the per-thread error message.
 *
 * Every hybridep call that can fail returns a hep_status (0 on success). The failing
 * layer writes one message describing the failure, at the failure site; layers above
 * pass the status up unchanged and never rewrite the message. The message is
 * thread-local: read it with hep_last_error() on the thread that made the call.
 */
#ifndef HYBRIDEP_STATUS_H
#define HYBRIDEP_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum hep_status {
    HEP_OK = 0,
    HEP_ERR_INVALID = 1,     /* an argument or configuration is not valid */
    HEP_ERR_NOMEM = 2,       /* host or device memory exhausted */
    HEP_ERR_UNAVAILABLE = 3, /* a library, symbol, device or feature is missing */
    HEP_ERR_CUDA = 4,        /* a CUDA call failed */
    HEP_ERR_VERBS = 5,       /* a verbs call failed */
    HEP_ERR_TIMEOUT = 6,     /* a bounded wait expired; the message says who did not arrive */
    HEP_ERR_MISMATCH = 7,    /* ranks disagree on the configuration */
    HEP_ERR_BOOTSTRAP = 8,   /* the bootstrap (allgather/barrier) failed */
    HEP_ERR_REMOTE = 9,      /* another rank failed; the message carries its text */
    HEP_ERR_INTERNAL = 10,   /* a broken invariant: a bug in hybridep */
    HEP_WARN_IGNORED = 11,   /* the call completed, but part of its input was ignored (the
                                message names the first such input): unlike every
                                HEP_ERR_ status, the collective step happened, its outputs
                                are valid and the sequence goes on (after a dispatch, call
                                hep_combine; retrying the call would desynchronize the
                                group) */
    HEP_ERR_OVERFLOW = 12    /* a dispatch needed more receive rows than the capacity
                                (config.max_recv_rows) on some rank: it failed on every
                                rank, nothing was written past the capacity, and the group
                                stays usable (with HEP_ASYNC a rank-major dispatch drops
                                the rows past it instead: HEP_WARN_IGNORED) */
} hep_status;

/* Status rule: HEP_OK and HEP_WARN_IGNORED mean the call did its collective work; every
 * HEP_ERR_ status means it did not (the group's state is as before the call, or, after
 * HEP_ERR_TIMEOUT / HEP_ERR_VERBS from dispatch or combine, unusable: destroy it). */

/* The message of the last failure on this thread ("" if none). The pointer stays valid
 * until the next hybridep call on this thread. */
const char *hep_last_error(void);

/* A short constant name for a status ("HEP_ERR_INVALID"). Never NULL. */
const char *hep_status_name(int status);

/* Set this thread's message (printf format) and return `status`, so that code outside
 * hybridep that reports through it (a custom bootstrap's allgather or barrier, which must
 * return "a status with hep_last_error() set") can write `return hep_set_last_error(
 * HEP_ERR_BOOTSTRAP, "store: %s", why);`. The text is truncated to 2047 bytes. */
int hep_set_last_error(int status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

#ifdef __cplusplus
}
#endif
#endif
