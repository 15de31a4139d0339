#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static char prefix[96] = "kvferry";
static int min_level = KVF_LOG_INFO;

void kvf_log_setup(const char *instance, const char *role)
{
        const char *lv = getenv("KVFERRY_LOG");

        snprintf(prefix, sizeof(prefix), "%s/%s", instance ? instance : "-", role ? role : "-");
        if (!lv)
                return;
        if (!strcmp(lv, "debug"))
                min_level = KVF_LOG_DEBUG;
        else if (!strcmp(lv, "warn"))
                min_level = KVF_LOG_WARN;
        else if (!strcmp(lv, "error"))
                min_level = KVF_LOG_ERROR;
}

int kvf_log_enabled(int level)
{
        return level >= min_level;
}

void kvf_log(int level, const char *fmt, ...)
{
        static const char *names[] = {"DEBUG", "INFO", "WARN", "ERROR"};
        char line[1024];
        struct timespec ts;
        struct tm tm;
        va_list ap;
        int n;

        if (level < min_level)
                return;
        clock_gettime(CLOCK_REALTIME, &ts);
        gmtime_r(&ts.tv_sec, &tm);
        n = snprintf(line, sizeof(line), "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %s %s ",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, prefix, names[level & 3]);
        va_start(ap, fmt);
        if (n > 0 && (size_t)n < sizeof(line))
                vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
        va_end(ap);
        /* One write per line, so lines of several processes sharing a log do not interleave. */
        size_t len = strnlen(line, sizeof(line) - 2);
        line[len++] = '\n';
        fwrite(line, 1, len, stderr);
        fflush(stderr);
}
