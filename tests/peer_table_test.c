/*
 * The connector's peer table (issue 9, item 6): tcp tasks to 300 addresses
 * where nobody listens must not leave 300 peers and their threads behind,
 * and must never make the connector refuse a reachable peer afterwards.
 * Peers without work are retired after --peer-idle-ms; a full table retires
 * an idle or unreachable peer to make room.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "clock.h"
#include "ctl.h"
#include "instances.h"
#include "kvferry.h"

#define UNREACHABLE 300

static char P[64], D[64];


/* Threads of a process, from /proc/PID/status. */
static int threads_of(int pid)
{
        char path[64], line[256];
        snprintf(path, sizeof(path), "/proc/%d/status", pid);
        FILE *f = fopen(path, "r");
        int n = -1;
        if (!f)
                return -1;
        while (fgets(line, sizeof(line), f))
                if (sscanf(line, "Threads: %d", &n) == 1)
                        break;
        fclose(f);
        return n;
}

static int connector_pid(void)
{
        struct kvf_ctl c;
        CHECK_EQ(kvf_ctl_attach(P, false, &c), 0);
        int pid = c.roles[KVF_ROLE_CONNECTOR].pid;
        kvf_ctl_detach(&c);
        return pid;
}

static void one(struct kvf_client *c, const char *id, int transport, const char *peer, uint32_t blk,
                uint64_t step)
{
        uint32_t s = blk, d = blk;
        struct kvf_task t = {.request_id = id, .src_block_ids = &s, .n_src = 1, .dest_block_ids = &d,
                             .n_dest = 1, .current_id = step, .transport = transport, .peer = peer};
        int rc;
        while ((rc = kvf_submit_task(c, &t)) == -EAGAIN)
                usleep(1000);
        CHECK_EQ(rc, 0);
}

int main(void)
{
        snprintf(P, sizeof(P), "pt%d-p", (int)getpid());
        snprintf(D, sizeof(D), "pt%d-d", (int)getpid());
        const char *lay = "--model llama-3.1-8b --tp 8 --blocks 512";
        t_up(D, "--role decode %s", lay);
        t_up(P, "--role prefill %s --peer-timeout-ms 1000 --peer-idle-ms 1000 --connect-timeout-ms 500", lay);
        struct kvf_client *c;
        CHECK_EQ(kvf_attach(P, 5000, &c), 0);
        struct kvf_layout_info L;
        kvf_get_layout(c, &L);
        int cpid = connector_pid();
        int base = threads_of(cpid);

        /* 300 peers where nobody listens (port 9 on 127.1.x.y: refused at once). */
        uint64_t step = kvf_last_step(c) + 1;
        for (int i = 0; i < UNREACHABLE; i++) {
                char id[32], peer[64];
                snprintf(id, sizeof(id), "u%d", i);
                snprintf(peer, sizeof(peer), "127.1.%d.%d:9", i / 200, 1 + i % 200);
                one(c, id, KVF_TRANSPORT_TCP, peer, (uint32_t)i, step);
        }
        for (uint32_t l = 0; l < L.num_layers; l++)
                CHECK_EQ(kvf_layer_done(c, step, l), 0);
        int peak = 0, got = 0, conn_err = 0;
        uint64_t end = kvf_now_ns() + 60000000000ull;
        while (got < UNREACHABLE && kvf_now_ns() < end) {
                struct kvf_event ev;
                int t = threads_of(cpid);
                peak = t > peak ? t : peak;
                if (kvf_poll(c, &ev, 100) != 1 || ev.type != KVF_EVENT_COMPLETION)
                        continue;
                got++;
                conn_err += ev.status == KVF_STATUS_CONNECTION;
                if (ev.status != KVF_STATUS_CONNECTION)
                        fprintf(stderr, "  %s: %s: %s\n", ev.request_id, kvf_status_name(ev.status), ev.reason);
        }
        CHECK_EQ(got, UNREACHABLE);
        CHECK_EQ(conn_err, UNREACHABLE);
        /* Bounded: one thread per peer in the table (256 at most; data threads start only once a
         * peer is connected), plus retired ones on their way out. */
        CHECK(peak <= 256 + 64);
        printf("ok: %d tcp tasks to unreachable peers: each 'connection error'; connector threads %d before, "
               "%d at most during\n",
               UNREACHABLE, base, peak);

        /* Idle peers go: within the idle period plus a few heartbeats, threads are back near where
         * they started (the old tree kept 770 threads and refused every new peer). */
        int now = 0;
        end = kvf_now_ns() + 10000000000ull;
        while (kvf_now_ns() < end) {
                now = threads_of(cpid);
                if (now <= base + 2)
                        break;
                usleep(100000);
        }
        if (now > base + 2) {
                fprintf(stderr, "connector still has %d threads (%d before the unreachable peers)\n", now, base);
                return 1;
        }
        printf("ok: idle unreachable peers retired: %d threads (%d before)\n", now, base);

        /* A reachable peer, by instance name (ipc) and by address (tcp), still works. */
        char daddr[128];
        t_connector_addr(D, daddr, sizeof(daddr));
        step = kvf_last_step(c) + 1;
        one(c, "r-tcp", KVF_TRANSPORT_TCP, daddr, 400, step);
        one(c, "r-ipc", KVF_TRANSPORT_IPC, D, 401, step);
        for (uint32_t l = 0; l < L.num_layers; l++)
                CHECK_EQ(kvf_layer_done(c, step, l), 0);
        for (int n = 0; n < 2;) {
                struct kvf_event ev;
                CHECK_EQ(kvf_poll(c, &ev, 10000), 1);
                if (ev.type != KVF_EVENT_COMPLETION)
                        continue;
                if (ev.status != KVF_STATUS_FINISHED) {
                        fprintf(stderr, "%s: %s: %s\n", ev.request_id, kvf_status_name(ev.status), ev.reason);
                        return 1;
                }
                n++;
        }
        printf("ok: a reachable peer afterwards: tcp and ipc requests finished\n");

        /* A full table (256 peers) of unreachable ones still takes a reachable peer. */
        step = kvf_last_step(c) + 1;
        for (int i = 0; i < 256; i++) {
                char id[32], peer[64];
                snprintf(id, sizeof(id), "f%d", i);
                snprintf(peer, sizeof(peer), "127.2.%d.%d:9", i / 200, 1 + i % 200);
                one(c, id, KVF_TRANSPORT_TCP, peer, (uint32_t)i, step);
        }
        for (uint32_t l = 0; l < L.num_layers; l++)
                CHECK_EQ(kvf_layer_done(c, step, l), 0);
        usleep(300000); /* they have tried once and failed: unreachable, with work still pending */
        step = kvf_last_step(c) + 1;
        one(c, "r-full", KVF_TRANSPORT_TCP, daddr, 402, step);
        for (uint32_t l = 0; l < L.num_layers; l++)
                CHECK_EQ(kvf_layer_done(c, step, l), 0);
        int full_done = 0;
        end = kvf_now_ns() + 30000000000ull;
        while (!full_done && kvf_now_ns() < end) {
                struct kvf_event ev;
                if (kvf_poll(c, &ev, 100) != 1 || ev.type != KVF_EVENT_COMPLETION ||
                    strcmp(ev.request_id, "r-full"))
                        continue;
                if (ev.status != KVF_STATUS_FINISHED) {
                        fprintf(stderr, "r-full: %s: %s\n", kvf_status_name(ev.status), ev.reason);
                        return 1;
                }
                full_done = 1;
        }
        CHECK(full_done);
        printf("ok: a table full of unreachable peers made room for a reachable one\n");
        kvf_detach(c);
        printf("peer_table_test: all passed\n");
        return 0;
}
