#include "log.h"
#include "records.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define LINE_LEN 1024
#define LIMIT_LINES 10u                            /* per cause and window */
#define LIMIT_WINDOW_NS (10ull * 1000000000ull)
#define CAUSES 64u /* causes followed at once; the least recently used gives way */

struct cause {
        uint64_t key;        /* hash of (level, cause); 0 = free */
        uint64_t start_ns;   /* the window began (CLOCK_MONOTONIC) */
        uint64_t used_ns;    /* last seen */
        uint64_t suppressed; /* lines not printed in this window */
        uint32_t lines;      /* lines printed in this window */
        int level;
        struct timespec last_at; /* CLOCK_REALTIME */
        char last[LINE_LEN];     /* the last line not printed: kvf_log_flush prints it */
};

static char prefix[96] = "kvferry";
static int min_level = KVF_LOG_INFO;
/* Guards causes[] and orders the lines of the process's threads. */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct cause causes[CAUSES];

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

static uint64_t mono_ns(void)
{
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/*
 * msg into line[len..end) as one line of text: what a message quotes (a request id given as
 * bytes, a peer's name) may hold a newline that would forge a line of its own, terminal
 * escapes, or bytes that are not UTF-8; those go as \xNN (C0 and C1 controls, DEL, and each
 * byte of no valid sequence). Cut at a character's end. Returns the new length.
 */
static size_t escape_into(char *line, size_t len, size_t end, const char *msg)
{
        static const char hex[] = "0123456789abcdef";
        const uint8_t *p = (const uint8_t *)msg;
        for (size_t i = 0, n = strlen(msg); i < n;) {
                size_t k = kvf_utf8_seq(p + i, n - i);
                bool ctl = k == 0 || (k == 1 && (p[i] < 0x20 || p[i] == 0x7f)) ||
                           (k == 2 && p[i] == 0xc2 && p[i + 1] < 0xa0);
                if (!ctl) {
                        if (len + k > end)
                                break;
                        memcpy(line + len, p + i, k);
                        len += k;
                        i += k;
                        continue;
                }
                for (size_t j = 0; j < (k ? k : 1); j++) {
                        if (len + 4 > end)
                                return len;
                        line[len++] = '\\';
                        line[len++] = 'x';
                        line[len++] = hex[p[i + j] >> 4];
                        line[len++] = hex[p[i + j] & 15];
                }
                i += k ? k : 1;
        }
        return len;
}

/* One write per line, so lines of several processes sharing a log do not interleave. The
 * suffix is never cut: a long message is. */
static void emit(int level, const char *msg, const char *suffix)
{
        static const char *names[] = {"DEBUG", "INFO", "WARN", "ERROR"};
        char line[LINE_LEN + 128];
        struct timespec ts;
        struct tm tm;

        clock_gettime(CLOCK_REALTIME, &ts);
        gmtime_r(&ts.tv_sec, &tm);
        int n = snprintf(line, sizeof(line), "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %s %s ",
                         tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                         tm.tm_sec, ts.tv_nsec / 1000000, prefix, names[level & 3]);
        size_t len = n > 0 && (size_t)n < sizeof(line) ? (size_t)n : 0;
        if (!suffix)
                suffix = "";
        size_t sl = strlen(suffix);
        len = escape_into(line, len, sizeof(line) - 1 - sl, msg);
        memcpy(line + len, suffix, sl);
        len += sl;
        line[len++] = '\n';
        fwrite(line, 1, len, stderr);
        fflush(stderr);
}

static void summary(char *buf, size_t len, const char *what, uint64_t n, uint64_t ns)
{
        snprintf(buf, len, " (%s%llu similar line%s suppressed in the last %llu s)", what,
                 (unsigned long long)n, n == 1 ? "" : "s",
                 (unsigned long long)((ns + 500000000ull) / 1000000000ull));
}

/* The window is over and lines were suppressed: print the last of them with their count,
 * and start a new window. Under mu. */
static void flush_cause(struct cause *c, uint64_t now)
{
        char sfx[128], at[48];
        struct tm tm;
        gmtime_r(&c->last_at.tv_sec, &tm);
        /* Printed now, it happened then: say when. */
        snprintf(at, sizeof(at), "at %02d:%02d:%02d.%03ldZ, the last of ", tm.tm_hour, tm.tm_min, tm.tm_sec,
                 c->last_at.tv_nsec / 1000000);
        summary(sfx, sizeof(sfx), at, c->suppressed, now - c->start_ns);
        emit(c->level, c->last, sfx);
        c->suppressed = 0;
        c->lines = 0;
        c->start_ns = now;
}

/* The entry of this cause; a new one takes a free entry or the least recently used (whose
 * suppressed lines are reported first: no count is dropped). Under mu. */
static struct cause *find(uint64_t key, int level, uint64_t now)
{
        struct cause *victim = &causes[0];
        for (unsigned i = 0; i < CAUSES; i++) {
                if (causes[i].key == key)
                        return &causes[i];
                if (causes[i].key == 0) {
                        victim = &causes[i];
                        break;
                }
                if (causes[i].used_ns < victim->used_ns)
                        victim = &causes[i];
        }
        if (victim->key && victim->suppressed)
                flush_cause(victim, now);
        victim->key = key;
        victim->level = level;
        victim->start_ns = now;
        victim->lines = 0;
        victim->suppressed = 0;
        return victim;
}

static uint64_t cause_key(int level, const char *cause)
{
        uint64_t h = 14695981039346656037ull ^ (uint64_t)level; /* FNV-1a */
        for (const unsigned char *p = (const unsigned char *)cause; *p; p++)
                h = (h ^ *p) * 1099511628211ull;
        return h ? h : 1;
}

static void vlog(int level, const char *cause, const char *fmt, va_list ap)
{
        char msg[LINE_LEN], sfx[96] = "";

        if (level < min_level)
                return;
        vsnprintf(msg, sizeof(msg), fmt, ap);
        if (level == KVF_LOG_DEBUG) { /* not limited: off unless asked for */
                pthread_mutex_lock(&mu);
                emit(level, msg, NULL);
                pthread_mutex_unlock(&mu);
                return;
        }
        uint64_t key = cause_key(level, cause);
        pthread_mutex_lock(&mu);
        /* Read under mu: a window never starts after the `now` of a line that follows it. */
        uint64_t now = mono_ns();
        struct cause *c = find(key, level, now);
        c->used_ns = now;
        if (now - c->start_ns >= LIMIT_WINDOW_NS) {
                if (c->suppressed)
                        summary(sfx, sizeof(sfx), "", c->suppressed, now - c->start_ns);
                c->start_ns = now;
                c->lines = 0;
                c->suppressed = 0;
        }
        if (c->lines < LIMIT_LINES) {
                c->lines++;
                emit(level, msg, sfx);
        } else {
                c->suppressed++;
                clock_gettime(CLOCK_REALTIME, &c->last_at);
                memcpy(c->last, msg, strlen(msg) + 1);
        }
        pthread_mutex_unlock(&mu);
}

void kvf_log(int level, const char *fmt, ...)
{
        va_list ap;
        va_start(ap, fmt);
        vlog(level, fmt, fmt, ap);
        va_end(ap);
}

void kvf_log_keyed(int level, const char *cause, const char *fmt, ...)
{
        va_list ap;
        va_start(ap, fmt);
        vlog(level, cause, fmt, ap);
        va_end(ap);
}

void kvf_log_flush(void)
{
        pthread_mutex_lock(&mu);
        uint64_t now = mono_ns();
        for (unsigned i = 0; i < CAUSES && causes[i].key; i++)
                if (causes[i].suppressed && now - causes[i].start_ns >= LIMIT_WINDOW_NS)
                        flush_cause(&causes[i], now);
        pthread_mutex_unlock(&mu);
}
