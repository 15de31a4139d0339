/*
 * Logging: one line per event on stderr, "<time> <instance>/<role> <LEVEL> <message>".
 * Messages about a request start with "req <id>: ". Debug lines are off
 * unless KVFERRY_LOG=debug; nothing is logged per record on the hot path
 * above debug level.
 *
 * Repeated lines are rate-limited per cause, so that abuse (a flood of
 * unauthenticated connections, of bad tasks) cannot grow a log without bound:
 * a cause is the format string (kvf_log_keyed names it separately), and each
 * cause prints at most 10 lines per 10-second window. The lines past that are
 * counted, and the count is reported once the window is over: on the cause's
 * next line, as " (N similar lines suppressed in the last T s)", or by
 * kvf_log_flush(), which prints the last suppressed line with
 * " (at HH:MM:SS.mmmZ, the last of N similar lines suppressed in the last T s)".
 * Debug lines are not limited. Every function here may be called from any
 * thread.
 */
#ifndef KVF_LOG_H
#define KVF_LOG_H

enum kvf_log_level { KVF_LOG_DEBUG = 0, KVF_LOG_INFO = 1, KVF_LOG_WARN = 2, KVF_LOG_ERROR = 3 };

/* Set the prefix; reads the level from $KVFERRY_LOG (debug, info, warn, error). Call it first,
 * before other threads log. */
void kvf_log_setup(const char *instance, const char *role);
int kvf_log_enabled(int level);
/* One line; its cause (for the rate limit) is fmt. */
void kvf_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* One line whose cause is `cause` (e.g. the template of a message formatted earlier). */
void kvf_log_keyed(int level, const char *cause, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));
/*
 * Report the suppressed lines of every cause whose window is over, so that
 * no count waits for its cause to come back. Roles call it from their
 * heartbeat tick; cheap when there is nothing to report.
 */
void kvf_log_flush(void);

#define kvf_debug(...)                                                                             \
        do {                                                                                       \
                if (kvf_log_enabled(KVF_LOG_DEBUG))                                                \
                        kvf_log(KVF_LOG_DEBUG, __VA_ARGS__);                                       \
        } while (0)
#define kvf_info(...) kvf_log(KVF_LOG_INFO, __VA_ARGS__)
#define kvf_warn(...) kvf_log(KVF_LOG_WARN, __VA_ARGS__)
#define kvf_error(...) kvf_log(KVF_LOG_ERROR, __VA_ARGS__)

#endif
