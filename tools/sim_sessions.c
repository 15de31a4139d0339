/* kvf-sim's session log (sim_sessions.h). */
#include "sim_sessions.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static int log_fd = -1;

static void put(const char *line, int n)
{
        if (log_fd < 0 || n <= 0)
                return;
        /* One write per line (O_APPEND): nothing half-written survives a SIGKILL. */
        if (write(log_fd, line, (size_t)n) != n) {
                /* a full disk loses the log, not the run: the test notices the gap */
        }
}

int simlog_open(const char *path, uint64_t prefill_session, uint64_t decode_session)
{
        log_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
        if (log_fd < 0)
                return -errno;
        char line[96];
        put(line, snprintf(line, sizeof(line), "H %llu %llu\n", (unsigned long long)prefill_session,
                           (unsigned long long)decode_session));
        return 0;
}

void simlog_event(char kind, const char *id, int status)
{
        char line[192];
        put(line, snprintf(line, sizeof(line), "%c %s %d\n", kind, id, status));
}

static void previous_line(char kind, const struct kvf_event *ev)
{
        char line[512], reason[256];
        /* The reason, on one line. */
        snprintf(reason, sizeof(reason), "%s", ev->reason);
        for (char *p = reason; *p; p++)
                if (*p == '\n')
                        *p = ' ';
        put(line, snprintf(line, sizeof(line), "%c %llu %s %d %s\n", kind, (unsigned long long)ev->session,
                           ev->request_id, ev->status, reason));
}

unsigned simlog_previous(struct kvf_group *g, bool decode, unsigned ranks)
{
        struct kvf_event ev;
        unsigned n = 0;
        for (unsigned k = 0; k < ranks; k++)
                while (kvf_poll_previous(kvf_group_member(g, k), &ev) == 1) {
                        if (!decode && ev.type == KVF_EVENT_COMPLETION)
                                previous_line('P', &ev);
                        else if (decode && ev.type == KVF_EVENT_ARRIVAL)
                                previous_line('Q', &ev);
                        n++;
                }
        return n;
}
