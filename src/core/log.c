/* core/log.c: leveled logging to stderr, every line prefixed "[HybridEP] ". */
#include <pthread.h>
#include <stdio.h>
#include <time.h>

#include "core.h"

static hep_log_sink log_sink;
static void *log_sink_ctx;
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;

void hep_log_set_sink(hep_log_sink sink, void *ctx)
{
    pthread_mutex_lock(&log_lock);
    log_sink = sink;
    log_sink_ctx = ctx;
    pthread_mutex_unlock(&log_lock);
}

double hep_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

int hep_log_enabled(int level)
{
    return level <= hep_env_get()->log_level;
}

void hep_log(int level, const char *fmt, ...)
{
    static const char *const tag[] = {"error: ", "warning: ", "", "debug: "};
    char body[2048];
    char line[2100];
    va_list ap;

    if (!hep_log_enabled(level))
        return;
    va_start(ap, fmt);
    vsnprintf(body, sizeof(body), fmt, ap);
    va_end(ap);
    snprintf(line, sizeof(line), "[HybridEP] %s%s", tag[level & 3], body);
    pthread_mutex_lock(&log_lock);
    if (log_sink)
        log_sink(log_sink_ctx, level, line);
    else
        fprintf(stderr, "%s\n", line);
    pthread_mutex_unlock(&log_lock);
}
