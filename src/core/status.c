/* core/status.c: the thread-local error message. */
#include <stdio.h>
#include <string.h>

#include "core.h"

#define HEP_ERR_LEN 2048
static _Thread_local char hep_err[HEP_ERR_LEN];

const char *hep_last_error(void)
{
    return hep_err;
}

static int fail_v(int status, const char *fmt, va_list ap)
{
    vsnprintf(hep_err, sizeof(hep_err), fmt ? fmt : "", ap);
    hep_log(HEP_LOG_DEBUG, "error %s: %s", hep_status_name(status), hep_err);
    return status;
}

int hep_fail(int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    status = fail_v(status, fmt, ap);
    va_end(ap);
    return status;
}

int hep_set_last_error(int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    status = fail_v(status, fmt, ap);
    va_end(ap);
    return status;
}

void hep_set_error_text(const char *text)
{
    snprintf(hep_err, sizeof(hep_err), "%s", text ? text : "");
}

void hep_clear_error(void)
{
    hep_err[0] = '\0';
}

const char *hep_status_name(int status)
{
    switch (status) {
    case HEP_OK: return "HEP_OK";
    case HEP_ERR_INVALID: return "HEP_ERR_INVALID";
    case HEP_ERR_NOMEM: return "HEP_ERR_NOMEM";
    case HEP_ERR_UNAVAILABLE: return "HEP_ERR_UNAVAILABLE";
    case HEP_ERR_CUDA: return "HEP_ERR_CUDA";
    case HEP_ERR_VERBS: return "HEP_ERR_VERBS";
    case HEP_ERR_TIMEOUT: return "HEP_ERR_TIMEOUT";
    case HEP_ERR_MISMATCH: return "HEP_ERR_MISMATCH";
    case HEP_ERR_BOOTSTRAP: return "HEP_ERR_BOOTSTRAP";
    case HEP_ERR_REMOTE: return "HEP_ERR_REMOTE";
    case HEP_ERR_INTERNAL: return "HEP_ERR_INTERNAL";
    case HEP_WARN_IGNORED: return "HEP_WARN_IGNORED";
    case HEP_ERR_OVERFLOW: return "HEP_ERR_OVERFLOW";
    default: return "HEP_ERR_UNKNOWN";
    }
}
