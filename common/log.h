/*
 * Logging: one line per event on stderr, "<time> <instance>/<role> <LEVEL> <message>".
 * Messages about a request start with "req <id>: ". Debug lines are off
 * unless KVFERRY_LOG=debug; nothing is logged per record on the hot path
 * above debug level.
 */
#ifndef KVF_LOG_H
#define KVF_LOG_H

enum kvf_log_level { KVF_LOG_DEBUG = 0, KVF_LOG_INFO = 1, KVF_LOG_WARN = 2, KVF_LOG_ERROR = 3 };

/* Set the prefix; reads the level from $KVFERRY_LOG (debug, info, warn, error). */
void kvf_log_setup(const char *instance, const char *role);
int kvf_log_enabled(int level);
void kvf_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define kvf_debug(...)                                                                             \
        do {                                                                                       \
                if (kvf_log_enabled(KVF_LOG_DEBUG))                                                \
                        kvf_log(KVF_LOG_DEBUG, __VA_ARGS__);                                       \
        } while (0)
#define kvf_info(...) kvf_log(KVF_LOG_INFO, __VA_ARGS__)
#define kvf_warn(...) kvf_log(KVF_LOG_WARN, __VA_ARGS__)
#define kvf_error(...) kvf_log(KVF_LOG_ERROR, __VA_ARGS__)

#endif
