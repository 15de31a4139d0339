/*
 * Logs under abuse: 2000 connections to a connector that
 * never authenticate, and 2000 bad tasks to a sender. The control segment's
 * error log still counts every one, but a log file takes at most 10 lines of
 * a cause per 10 s: connector.log and sender.log hold a bounded number of
 * those lines, and once the window is over a summary line accounts for the
 * rest, to the line ("(at <time>, the last of N similar lines suppressed in the
 * last 10 s)" at the next heartbeat, or " (N similar lines ...)" on the cause's
 * next line).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "clock.h"
#include "ctl.h"
#include "kvferry.h"
#include "net.h"

#define FLOOD 2000u

static char P[64], cmd[2048], rundir[64] = "/tmp/kvf-logflood.XXXXXX";
static struct kvf_ctl ctl;
static int passed;

static void cleanup(void)
{
        snprintf(cmd, sizeof(cmd), "%s/tools/kvferry down --instance %s >/dev/null 2>&1", KVF_SOURCE_DIR, P);
        if (system(cmd) != 0)
                fprintf(stderr, "cleanup failed\n");
        if (passed) {
                snprintf(cmd, sizeof(cmd), "rm -rf %s", rundir);
                if (system(cmd) != 0)
                        fprintf(stderr, "cleanup: %s failed\n", cmd);
        } else {
                fprintf(stderr, "logs kept in %s\n", rundir);
        }
}

/* The error-log entry of `role` whose text contains `needle`: its count (0: none). */
static uint64_t errlog_count(int role, const char *needle)
{
        struct kvf_errlog_entry e;
        for (unsigned i = 0; i < KVF_ERRLOG_ENTRIES; i++)
                if (kvf_errlog_read(&ctl, role, i, &e) == 1 && strstr(e.text, needle))
                        return e.count;
        return 0;
}

/* The error log counts `n` of them within 30 s, and no more. */
static void wait_errlog(int role, const char *needle, uint64_t n)
{
        uint64_t end = kvf_now_ns() + 30000000000ull;
        while (errlog_count(role, needle) < n && kvf_now_ns() < end)
                usleep(20000);
        CHECK_EQ(errlog_count(role, needle), n);
}

/*
 * The lines of a log with `needle`: how many, how many of them are summaries,
 * and how many events they account for (a plain line 1; "... (N similar lines
 * suppressed ...)" 1 + N; "... (at T, the last of N similar lines ...)" N, itself
 * included).
 */
struct tally {
        unsigned lines, summaries;
        unsigned long long events;
};

static void tally(const char *log, const char *needle, struct tally *t)
{
        char path[256], line[4096];
        snprintf(path, sizeof(path), "%s/%s/%s", rundir, P, log);
        FILE *f = fopen(path, "r");
        CHECK(f != NULL);
        memset(t, 0, sizeof(*t));
        while (fgets(line, sizeof(line), f)) {
                if (!strstr(line, needle))
                        continue;
                t->lines++;
                char *s = strstr(line, " similar line");
                if (!s) {
                        t->events++;
                        continue;
                }
                while (s > line && s[-1] >= '0' && s[-1] <= '9')
                        s--;
                unsigned long long n = strtoull(s, NULL, 10);
                t->summaries++;
                if (s - line >= 8 && !strncmp(s - 8, "last of ", 8))
                        t->events += n;
                else if (s > line && s[-1] == '(')
                        t->events += 1 + n;
                else
                        CHECK(!"a summary line of an unknown form");
        }
        fclose(f);
}

/* At most 10 lines per 10 s window, plus one summary each, over the time the test has run. */
static void check_bounded(const char *log, const char *needle, uint64_t t0, struct tally *t)
{
        unsigned windows = (unsigned)((kvf_now_ns() - t0) / 10000000000ull) + 2;
        tally(log, needle, t);
        if (t->lines > 11 * windows) {
                fprintf(stderr, "%s: %u lines with \"%s\" for %u events: more than 11 per 10 s\n", log, t->lines,
                        needle, FLOOD);
                exit(1);
        }
}

/* Within 25 s (the window, then the next heartbeat's flush), the log accounts for all n. */
static void wait_accounted(const char *log, const char *needle, struct tally *t)
{
        uint64_t end = kvf_now_ns() + 25000000000ull;
        do {
                tally(log, needle, t);
                if (t->events >= FLOOD)
                        break;
                usleep(200000);
        } while (kvf_now_ns() < end);
        if (t->events != FLOOD || t->summaries == 0) {
                fprintf(stderr, "%s: %u lines with \"%s\", %u of them summaries, account for %llu events, not %u\n",
                        log, t->lines, needle, t->summaries, t->events, FLOOD);
                exit(1);
        }
}

int main(void)
{
        struct kvf_client *eng;
        char host[64];
        uint32_t port;

        CHECK(mkdtemp(rundir) != NULL);
        setenv("KVFERRY_RUN_DIR", rundir, 1);
        snprintf(P, sizeof(P), "lf%d-p", (int)getpid());
        atexit(cleanup);
        snprintf(cmd, sizeof(cmd), "%s/tools/kvferry up --instance %s --role prefill --layers 4 --kv-heads 2 "
                                   "--head-dim 64 --block-size 16 --blocks 64 >/dev/null",
                 KVF_SOURCE_DIR, P);
        CHECK(system(cmd) == 0);
        CHECK(kvf_attach(P, 5000, &eng) == 0);
        CHECK(kvf_ctl_attach(P, false, &ctl) == 0);
        CHECK(kvf_connector_info_read(&ctl, host, sizeof(host), &port) == 0);
        uint64_t t0 = kvf_now_ns();

        /* Connections that never say a word: each is refused and reported by the connector. */
        for (unsigned i = 0; i < FLOOD; i++) {
                int fd = kvf_net_connect(host, (uint16_t)port, 5000);
                CHECK(fd >= 0);
                close(fd);
        }
        /* Tasks that are not even msgpack: each is rejected and reported by the sender. */
        struct kvf_event ev;
        unsigned completions = 0;
        for (unsigned i = 0; i < FLOOD; i++) {
                while (kvf_submit_raw(eng, KVF_TO_SENDER, KVF_REC_TASK, "hello world", 11) != 0)
                        completions += kvf_poll(eng, &ev, 10) == 1 && ev.type == KVF_EVENT_COMPLETION;
                while (kvf_poll(eng, &ev, 0) == 1)
                        completions += ev.type == KVF_EVENT_COMPLETION;
        }
        uint64_t end = kvf_now_ns() + 30000000000ull;
        while (completions < FLOOD && kvf_now_ns() < end)
                if (kvf_poll(eng, &ev, 100) == 1)
                        completions += ev.type == KVF_EVENT_COMPLETION;
        CHECK_EQ(completions, FLOOD);
        printf("log flood against %s: %u unauthenticated connections and %u bad tasks in %.1f s\n", P, FLOOD,
               FLOOD, (double)(kvf_now_ns() - t0) / 1e9);

        /* The segment's error log counts every one, one entry per cause. */
        const char *conn_needle = "connection from 127.0.0.1:", *task_needle = "task rejected";
        wait_errlog(KVF_ROLE_CONNECTOR, conn_needle, FLOOD);
        wait_errlog(KVF_ROLE_SENDER, task_needle, FLOOD);
        printf("  error log in the segment: %u + %u counted\n", FLOOD, FLOOD);

        struct tally tc, ts;
        check_bounded("connector.log", conn_needle, t0, &tc);
        check_bounded("sender.log", task_needle, t0, &ts);
        printf("  right after the flood: %u lines in connector.log, %u in sender.log\n", tc.lines, ts.lines);
        wait_accounted("connector.log", conn_needle, &tc);
        wait_accounted("sender.log", task_needle, &ts);
        check_bounded("connector.log", conn_needle, t0, &tc);
        check_bounded("sender.log", task_needle, t0, &ts);
        printf("  once the window is over: connector.log %u lines (%u summaries), sender.log %u lines (%u "
               "summaries), accounting for %llu and %llu events\n",
               tc.lines, tc.summaries, ts.lines, ts.summaries, tc.events, ts.events);
        kvf_detach(eng);
        kvf_ctl_detach(&ctl);
        passed = 1;
        printf("log_flood_test: passed\n");
        return 0;
}
