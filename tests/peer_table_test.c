/*
 * The connector's outgoing peers at scale: tcp tasks to 1000 distinct peers
 * that cannot be reached. The peers' control connections run on a fixed pool
 * of threads, so the connector's thread count must stay small (<= 16)
 * throughout; every request must fail with "connection error" and a reason
 * within its bound (peer timeout, plus one connect timeout and the back-off);
 * the connector's memory must stay bounded; idle peers must be retired; and a
 * reachable peer must still work, while the 1000 are pending and afterwards.
 *
 * As root the test runs in a network namespace of its own, and half of the
 * peers are addresses routed to a gateway whose frames land on an interface
 * with no address, where a SYN gets no answer (the connect times out); the other half are 127.1.x.y:9, where
 * nobody listens (refused at once). Otherwise all 1000 are of the second kind.
 *
 * Last, peers that accept and never answer hold both handshake workers for
 * their handshake timeout, one after another: a connected peer must go on
 * meanwhile (its requests finish at once, its connection stays up), since
 * its I/O thread never waits for a handshake.
 */
#include <dirent.h>
#include <errno.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "check.h"
#include "clock.h"
#include "ctl.h"
#include "instances.h"
#include "kvferry.h"

#define UNREACHABLE 1000
#define MAX_THREADS 16
#define PEER_TIMEOUT_MS 1000
#define CONNECT_TIMEOUT_MS 500
/* A request to an unreachable peer fails once a connection attempt fails past the peer
 * timeout: at most a back-off (1 s) and a connect timeout later; plus slack for a loaded
 * machine. */
#define FAIL_BOUND_MS (PEER_TIMEOUT_MS + CONNECT_TIMEOUT_MS + 1000 + 3000)
/* Growth of the connector's private memory while the 1000 are pending (about 17 KiB a peer);
 * a sanitizer's shadow memory multiplies it (the test is built as the connector is). */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVF_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVF_TEST_SANITIZED 1
#endif
#endif
#ifdef KVF_TEST_SANITIZED
#define RSS_BOUND_KIB (512 * 1024)
#else
#define RSS_BOUND_KIB (64 * 1024)
#endif

static char P[64], D[64];

/* Threads of a process: the entries of /proc/PID/task. */
static int threads_of(int pid)
{
        char path[64];
        snprintf(path, sizeof(path), "/proc/%d/task", pid);
        DIR *d = opendir(path);
        int n = 0;
        if (!d)
                return -1;
        for (struct dirent *e; (e = readdir(d));)
                n += e->d_name[0] != '.';
        closedir(d);
        return n;
}

/* Resident memory of a process, KiB: its private memory (RssAnon; the caches it maps are
 * shared memory, resident as much as they were touched). */
static long rss_kib(int pid)
{
        char path[64], line[256];
        snprintf(path, sizeof(path), "/proc/%d/status", pid);
        FILE *f = fopen(path, "r");
        long kib = -1;
        if (!f)
                return -1;
        while (fgets(line, sizeof(line), f))
                if (sscanf(line, "RssAnon: %ld", &kib) == 1)
                        break;
        fclose(f);
        return kib;
}

static int connector_pid(void)
{
        struct kvf_ctl c;
        CHECK_EQ(kvf_ctl_attach(P, false, &c), 0);
        int pid = c.roles[KVF_ROLE_CONNECTOR].pid;
        kvf_ctl_detach(&c);
        return pid;
}

static uint64_t retired(void)
{
        struct kvf_ctl c;
        CHECK_EQ(kvf_ctl_attach(P, false, &c), 0);
        uint64_t n = kvf_load_relaxed(&c.counters[KVF_CTR_PEERS_RETIRED].value);
        kvf_ctl_detach(&c);
        return n;
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

/* As root: a network namespace of our own (the instances start in it), with 10.99.0.0/16
 * routed over one end of a veth pair to a gateway nothing answers for (a fixed neighbour
 * entry: no ARP), so a SYN to it is dropped at the other end. */
static bool blackhole(void)
{
        if (geteuid() != 0 || unshare(CLONE_NEWNET) < 0)
                return false;
        return system("ip link set lo up && ip link add kvfbh0 type veth peer name kvfbh1 && "
                      "ip addr add 10.98.0.1/24 dev kvfbh0 && ip link set kvfbh0 up && ip link set kvfbh1 up && "
                      "ip neigh add 10.98.0.2 lladdr 02:00:00:00:00:02 dev kvfbh0 nud permanent && "
                      "ip route add 10.99.0.0/16 via 10.98.0.2 dev kvfbh0") == 0;
}

static int finished_or_die(struct kvf_client *c, const char *want, unsigned timeout_ms)
{
        uint64_t end = kvf_now_ns() + kvf_ms(timeout_ms);
        while (kvf_now_ns() < end) {
                struct kvf_event ev;
                if (kvf_poll(c, &ev, 100) != 1 || ev.type != KVF_EVENT_COMPLETION || strcmp(ev.request_id, want))
                        continue;
                if (ev.status != KVF_STATUS_FINISHED) {
                        fprintf(stderr, "%s: %s: %s\n", want, kvf_status_name(ev.status), ev.reason);
                        exit(1);
                }
                return 0;
        }
        fprintf(stderr, "%s: no completion within %u ms\n", want, timeout_ms);
        exit(1);
}

int main(void)
{
        bool bh = blackhole();
        snprintf(P, sizeof(P), "pt%d-p", (int)getpid());
        snprintf(D, sizeof(D), "pt%d-d", (int)getpid());
        const char *lay = "--model llama-3.1-8b --tp 8 --blocks 1100";
        t_up(D, "--role decode %s", lay);
        t_up(P, "--role prefill %s --max-requests 4096 --peer-timeout-ms %d --peer-idle-ms 1000 --connect-timeout-ms %d", lay,
             PEER_TIMEOUT_MS, CONNECT_TIMEOUT_MS);
        struct kvf_client *c;
        CHECK_EQ(kvf_attach(P, 5000, &c), 0);
        struct kvf_layout_info L;
        kvf_get_layout(c, &L);
        int cpid = connector_pid();
        int base = threads_of(cpid);
        long rss0 = rss_kib(cpid);
        uint64_t retired0 = retired();
        char daddr[128];
        t_connector_addr(D, daddr, sizeof(daddr));

        /* 1000 distinct peers nobody answers; then, while they are pending, a live one. */
        static uint64_t submitted[UNREACHABLE];
        uint64_t step = kvf_last_step(c) + 1;
        for (int i = 0; i < UNREACHABLE; i++) {
                char id[32], peer[64];
                snprintf(id, sizeof(id), "u%d", i);
                if (bh && i % 2)
                        snprintf(peer, sizeof(peer), "10.99.%d.%d:7000", i / 200, 1 + i % 200);
                else
                        snprintf(peer, sizeof(peer), "127.1.%d.%d:9", i / 200, 1 + i % 200);
                submitted[i] = kvf_now_ns();
                one(c, id, KVF_TRANSPORT_TCP, peer, (uint32_t)i, step);
        }
        one(c, "r-during", KVF_TRANSPORT_TCP, daddr, 1050, step);
        for (uint32_t l = 0; l < L.num_layers; l++)
                CHECK_EQ(kvf_layer_done(c, step, l), 0);
        int peak = 0, got = 0, conn_err = 0, late = 0, during = 0;
        long rss_peak = 0;
        uint64_t worst = 0;
        uint64_t end = kvf_now_ns() + 60000000000ull;
        while (got < UNREACHABLE && kvf_now_ns() < end) {
                struct kvf_event ev;
                int t = threads_of(cpid);
                long r = rss_kib(cpid);
                peak = t > peak ? t : peak;
                rss_peak = r > rss_peak ? r : rss_peak;
                if (t > MAX_THREADS) {
                        fprintf(stderr, "connector has %d threads with %d peers pending (at most %d)\n", t,
                                UNREACHABLE - got, MAX_THREADS);
                        return 1;
                }
                if (kvf_poll(c, &ev, 50) != 1 || ev.type != KVF_EVENT_COMPLETION)
                        continue;
                if (!strcmp(ev.request_id, "r-during")) {
                        if (ev.status != KVF_STATUS_FINISHED) {
                                fprintf(stderr, "r-during: %s: %s\n", kvf_status_name(ev.status), ev.reason);
                                return 1;
                        }
                        during = 1;
                        continue;
                }
                int i = atoi(ev.request_id + 1);
                CHECK(ev.request_id[0] == 'u' && i >= 0 && i < UNREACHABLE);
                uint64_t took = kvf_elapsed(kvf_now_ns(), submitted[i]);
                worst = took > worst ? took : worst;
                got++;
                bool ok = ev.status == KVF_STATUS_CONNECTION && ev.reason[0] &&
                          (strstr(ev.reason, "connect") || strstr(ev.reason, "peer"));
                conn_err += ok;
                if (took > kvf_ms(FAIL_BOUND_MS)) {
                        late++;
                        fprintf(stderr, "  %s: failed after %llu ms (bound %d ms)\n", ev.request_id,
                                (unsigned long long)(took / KVF_NS_PER_MS), FAIL_BOUND_MS);
                }
                if (!ok || got == 1 || (bh && got == UNREACHABLE))
                        fprintf(stderr, "  %s: %s: %s\n", ev.request_id, kvf_status_name(ev.status), ev.reason);
        }
        CHECK_EQ(got, UNREACHABLE);
        CHECK_EQ(conn_err, UNREACHABLE);
        CHECK_EQ(late, 0);
        printf("ok: %d tcp tasks to unreachable peers (%s): each 'connection error' with a reason, the "
               "slowest after %llu ms (bound %d ms)\n",
               UNREACHABLE, bh ? "half refused, half never answered" : "refused",
               (unsigned long long)(worst / KVF_NS_PER_MS), FAIL_BOUND_MS);
        printf("ok: connector threads %d before, %d at most during (bound %d); private RSS %ld KiB before, %ld KiB "
               "at most during (bound +%d KiB)\n",
               base, peak, MAX_THREADS, rss0, rss_peak, RSS_BOUND_KIB);
        CHECK(rss_peak - rss0 <= RSS_BOUND_KIB);
        if (!during)
                finished_or_die(c, "r-during", 10000);
        printf("ok: a reachable peer while the 1000 were pending: finished\n");

        /* Idle peers go (after --peer-idle-ms, within a few heartbeats). */
        end = kvf_now_ns() + 15000000000ull;
        uint64_t gone = 0;
        while (kvf_now_ns() < end && (gone = retired() - retired0) < UNREACHABLE)
                usleep(100000);
        if (gone < UNREACHABLE) {
                fprintf(stderr, "only %llu of %d idle peers retired\n", (unsigned long long)gone, UNREACHABLE);
                return 1;
        }
        int now = threads_of(cpid);
        CHECK(now <= MAX_THREADS);
        printf("ok: idle unreachable peers retired (%llu): %d threads, private RSS %ld KiB\n", (unsigned long long)gone,
               now, rss_kib(cpid));

        /* A reachable peer, by instance name (ipc) and by address (tcp), still works. */
        step = kvf_last_step(c) + 1;
        one(c, "r-tcp", KVF_TRANSPORT_TCP, daddr, 1060, step);
        one(c, "r-ipc", KVF_TRANSPORT_IPC, D, 1061, step);
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

        /* Hung handshakes: a socket that listens and never accepts (the kernel completes the
         * connects; nobody answers HELLO), 20 peers on it. */
        int lfd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY)};
        socklen_t sl = sizeof(sa);
        CHECK(lfd >= 0 && bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) == 0 && listen(lfd, 128) == 0 &&
              getsockname(lfd, (struct sockaddr *)&sa, &sl) == 0);
        step = kvf_last_step(c) + 1;
        one(c, "h-first", KVF_TRANSPORT_TCP, daddr, 1070, step);
        for (uint32_t l = 0; l < L.num_layers; l++)
                CHECK_EQ(kvf_layer_done(c, step, l), 0);
        finished_or_die(c, "h-first", 10000); /* the live peer's connection is up */
        step = kvf_last_step(c) + 1;
        for (int i = 0; i < 20; i++) {
                char id[32], peer[64];
                snprintf(id, sizeof(id), "h%d", i);
                snprintf(peer, sizeof(peer), "127.3.0.%d:%u", 1 + i, ntohs(sa.sin_port));
                submitted[i] = kvf_now_ns();
                one(c, id, KVF_TRANSPORT_TCP, peer, (uint32_t)(1020 + i), step);
        }
        for (uint32_t l = 0; l < L.num_layers; l++)
                CHECK_EQ(kvf_layer_done(c, step, l), 0);
        uint64_t slowest = 0;
        for (int r = 0; r < 8; r++) { /* 8 requests to the live peer while the workers are held */
                usleep(250000);
                char id[32];
                snprintf(id, sizeof(id), "h-live%d", r);
                step = kvf_last_step(c) + 1;
                one(c, id, KVF_TRANSPORT_TCP, daddr, 1080 + (uint32_t)r, step);
                uint64_t t0 = kvf_now_ns();
                for (uint32_t l = 0; l < L.num_layers; l++)
                        CHECK_EQ(kvf_layer_done(c, step, l), 0);
                for (;;) {
                        struct kvf_event ev;
                        CHECK_EQ(kvf_poll(c, &ev, 5000), 1);
                        if (ev.type != KVF_EVENT_COMPLETION)
                                continue;
                        if (ev.request_id[0] == 'h' && ev.request_id[1] != '-') {
                                int i = atoi(ev.request_id + 1);
                                CHECK(i >= 0 && i < 20);
                                if (ev.status != KVF_STATUS_CONNECTION || !strstr(ev.reason, "handshake")) {
                                        fprintf(stderr, "%s: %s: %s\n", ev.request_id,
                                                kvf_status_name(ev.status), ev.reason);
                                        return 1;
                                }
                                CHECK(kvf_elapsed(kvf_now_ns(), submitted[i]) <= kvf_ms(FAIL_BOUND_MS));
                                continue;
                        }
                        if (strcmp(ev.request_id, id))
                                continue;
                        if (ev.status != KVF_STATUS_FINISHED) {
                                fprintf(stderr, "%s: %s: %s\n", id, kvf_status_name(ev.status), ev.reason);
                                return 1;
                        }
                        break;
                }
                uint64_t took = kvf_elapsed(kvf_now_ns(), t0);
                slowest = took > slowest ? took : slowest;
        }
        close(lfd);
        /* Each live request needs no handshake: it must not wait for the workers (20 hung
         * handshakes of 500 ms on 2 workers hold them for 5 s). */
        CHECK(slowest < kvf_ms(1000));
        printf("ok: 20 peers that accept and never answer held the handshake workers; a connected peer's "
               "8 requests meanwhile finished, the slowest in %llu ms\n",
               (unsigned long long)(slowest / KVF_NS_PER_MS));
        kvf_detach(c);
        printf("peer_table_test: all passed\n");
        return 0;
}
