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
    HEP_ERR_INTERNAL = 10    /* a broken invariant: a bug in hybridep */
} hep_status;

/* The message of the last failure on this thread ("" if none). The pointer stays valid
 * until the next hybridep call on this thread. */
const char *hep_last_error(void);

/* A short constant name for a status ("HEP_ERR_INVALID"). Never NULL. */
const char *hep_status_name(int status);

/* Set this thread's hep_last_error() text (printf format) and return `status`: for code
 * outside the library that hybridep calls back (a custom bootstrap's allgather or barrier,
 * for example), so that its failure carries a message like the library's own. */
int hep_set_last_error(int status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

#ifdef __cplusplus
}
#endif
#endif
