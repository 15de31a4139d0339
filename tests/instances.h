/*
 * For the C tests that start instances with the real supervisor: t_up()
 * starts one (tools/kvferry up) and fails the test when it does not come up
 * (t_up_start() and t_up_wait(): several side by side);
 * every instance started is stopped at exit; t_connector_addr() reads where
 * an instance's connector listens; t_counter() and t_wait_counter() read an
 * instance's counters (those kvf-ringdump shows) through a read-only mapping
 * of its control segment, so a test waits for the event it means instead of
 * sleeping. The repository is KVF_SOURCE_DIR; the build comes from
 * $KVFERRY_BUILD (tests/CMakeLists.txt sets both). t_free_port() names a loopback port free
 * a moment ago, for a --listen the test must know in advance.
 */
#ifndef KVF_TEST_INSTANCES_H
#define KVF_TEST_INSTANCES_H

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "atomics.h"
#include "check.h"
#include "clock.h"
#include "ctl.h"

#define T_MAX_INSTANCES 24

static char t_names[T_MAX_INSTANCES][64];
static unsigned t_ninstances;

static void t_down_all(void)
{
        char cmd[4096];
        int n = snprintf(cmd, sizeof(cmd), "%s/tools/kvferry down", KVF_SOURCE_DIR);
        for (unsigned i = 0; i < t_ninstances; i++)
                n += snprintf(cmd + n, sizeof(cmd) - (size_t)n, " --instance %s", t_names[i]);
        snprintf(cmd + n, sizeof(cmd) - (size_t)n, " >/dev/null 2>&1");
        if (t_ninstances && system(cmd) != 0)
                fprintf(stderr, "cleanup: %s failed\n", cmd);
}

/*
 * t_up_start(NAME, ARGS...) begins `tools/kvferry up --instance NAME ARGS...` and returns at once;
 * t_up_wait() waits for every one begun and fails the test if one did not come up. A
 * tensor-parallel group's instances start side by side this way (each `up` mostly waits for its
 * roles to be ready); t_up() is one of them, waited for.
 */
static pid_t t_starting[T_MAX_INSTANCES];
static char t_start_cmd[T_MAX_INSTANCES][2048];
static unsigned t_nstarting;

static void t_vup_start(const char *name, const char *fmt, va_list ap)
{
        char args[1024];
        vsnprintf(args, sizeof(args), fmt, ap);
        if (t_ninstances == 0)
                atexit(t_down_all);
        CHECK(t_ninstances < T_MAX_INSTANCES && t_nstarting < T_MAX_INSTANCES);
        unsigned known = 0; /* (an instance started again under its name is stopped once) */
        while (known < t_ninstances && strcmp(t_names[known], name))
                known++;
        if (known == t_ninstances)
                snprintf(t_names[t_ninstances++], sizeof(t_names[0]), "%s", name);
        char *cmd = t_start_cmd[t_nstarting];
        snprintf(cmd, sizeof(t_start_cmd[0]), "%s/tools/kvferry up --instance %s %s >/dev/null",
                 KVF_SOURCE_DIR, name, args);
        fflush(NULL);
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
                execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
                _exit(127);
        }
        t_starting[t_nstarting++] = pid;
}

__attribute__((unused)) static void t_up_start(const char *name, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
__attribute__((unused)) static void t_up_start(const char *name, const char *fmt, ...)
{
        va_list ap;
        va_start(ap, fmt);
        t_vup_start(name, fmt, ap);
        va_end(ap);
}

static void t_up_wait(void)
{
        bool failed = false;
        for (unsigned i = 0; i < t_nstarting; i++) {
                int st = 0;
                CHECK_EQ(waitpid(t_starting[i], &st, 0), t_starting[i]);
                if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
                        fprintf(stderr, "command failed: %s\n", t_start_cmd[i]);
                        failed = true;
                }
        }
        t_nstarting = 0;
        if (failed)
                exit(1);
}

/* tools/kvferry up --instance NAME ARGS...; the test fails if it does not come up. */
__attribute__((unused)) static void t_up(const char *name, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
__attribute__((unused)) static void t_up(const char *name, const char *fmt, ...)
{
        va_list ap;
        va_start(ap, fmt);
        t_vup_start(name, fmt, ap);
        va_end(ap);
        t_up_wait();
}

/* "host:port" where the connector of instance `name` listens. */
__attribute__((unused)) static void t_connector_addr(const char *name, char *out, size_t len)
{
        char host[64];
        uint32_t port = 0;
        struct kvf_ctl c;
        CHECK_EQ(kvf_ctl_attach(name, false, &c), 0);
        CHECK_EQ(kvf_connector_info_read(&c, host, sizeof(host), &port), 0);
        kvf_ctl_detach(&c);
        snprintf(out, len, "%s:%u", host, port);
}

/* A loopback tcp port that was free a moment ago. */
__attribute__((unused)) static unsigned t_free_port(void)
{
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        socklen_t len = sizeof(a);
        CHECK(fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
              getsockname(fd, (struct sockaddr *)&a, &len) == 0);
        close(fd);
        return ntohs(a.sin_port);
}

/* The instance's counter `id` now; -1 if its segment cannot be attached. Safe in a forked child
 * (never exits). */
__attribute__((unused)) static int64_t t_counter(const char *name, enum kvf_counter_id id)
{
        struct kvf_ctl c;
        if (kvf_ctl_attach(name, false, &c) < 0)
                return -1;
        int64_t v = (int64_t)kvf_load_relaxed(&c.counters[id].value);
        kvf_ctl_detach(&c);
        return v;
}

/*
 * Wait until counter `id` of instance `name` is at least `min`, polling every millisecond, for at
 * most timeout_ms. 0 when it is; -ETIMEDOUT after saying on stderr what was awaited (`what`) and
 * where the counter stood. Safe in a forked child (never exits: the caller decides).
 */
__attribute__((unused)) static int t_wait_counter(const char *name, enum kvf_counter_id id,
                                                  uint64_t min, unsigned timeout_ms,
                                                  const char *what)
{
        struct kvf_ctl c;
        if (kvf_ctl_attach(name, false, &c) < 0) {
                fprintf(stderr, "waiting for %s: cannot attach instance '%s': %s\n", what, name,
                        kvf_err_msg());
                return -ENOENT;
        }
        uint64_t end = kvf_now_ns() + (uint64_t)timeout_ms * 1000000ull, v;
        while ((v = kvf_load_relaxed(&c.counters[id].value)) < min && kvf_now_ns() < end)
                usleep(1000);
        kvf_ctl_detach(&c);
        if (v >= min)
                return 0;
        fprintf(stderr,
                "timed out after %u ms waiting for %s: counter %s of '%s' is %llu, wanted %llu\n",
                timeout_ms, what, kvf_counter_names[id], name, (unsigned long long)v,
                (unsigned long long)min);
        return -ETIMEDOUT;
}

#endif
