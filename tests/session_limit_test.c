/*
 * Incoming connections against a decode connector started with
 * --max-sessions 16 and a 1 s connect timeout (so a connection has 2 s to
 * prove the token): a flood of 200 connections (tcp, and the same-host unix
 * socket) that never say a word, and one that trickles a hello a byte at a
 * time. The connector's threads stay within the limit plus its own, the
 * connections beyond the limit are closed at once and counted
 * (connections_over_limit), the log says so at most once a second with
 * counts that add up to the counter, the admitted ones are closed when no
 * hello comes within the connect timeout, the trickler (each part of its
 * frames within the connect timeout of the one before) within the 2 s all
 * the same, and then a real prefill instance transfers to it over tcp; its
 * authenticated connections stay past the deadline (a second transfer needs
 * no new control connection).
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "auth.h"
#include "check.h"
#include "clock.h"
#include "ctl.h"
#include "instances.h"
#include "kvferry.h"
#include "net.h"
#include "records.h"

#define LIMIT 16u
#define CTO_MS 1000u             /* --connect-timeout-ms of the decode instance */
#define DEADLINE_MS (2 * CTO_MS) /* to prove the token, from the accept */
#define NTCP 100u /* (below the listen backlog: no connect waits for a dropped SYN's resend) */
#define NUNIX 50u
#define SLACK 8u /* threads that come and go on their own (io_uring workers) */
#define NREQ 4u

static char P[64], D[64];

static unsigned threads_of(int pid)
{
        char path[64];
        snprintf(path, sizeof(path), "/proc/%d/task", pid);
        DIR *d = opendir(path);
        CHECK(d != NULL);
        unsigned n = 0;
        for (struct dirent *e; (e = readdir(d));)
                n += e->d_name[0] != '.';
        closedir(d);
        return n;
}

/* The connector closed fd: end of stream or a reset, without waiting. */
static bool closed_by_peer(int fd)
{
        uint8_t b[256];
        ssize_t n = recv(fd, b, sizeof(b), MSG_DONTWAIT);
        return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

/* connector.log's "closed at accept" lines: how many, and the connections they account for. */
static void over_limit_lines(unsigned *lines, unsigned long long *sum)
{
        char path[512], line[1024];
        const char *rd = getenv("KVFERRY_RUN_DIR");
        CHECK(rd != NULL);
        snprintf(path, sizeof(path), "%s/%s/connector.log", rd, D);
        FILE *f = fopen(path, "r");
        CHECK(f != NULL);
        *lines = 0;
        *sum = 0;
        while (fgets(line, sizeof(line), f)) {
                char *s = strstr(line, " incoming connection(s) closed at accept in the last ");
                if (!s)
                        continue;
                CHECK(!strstr(line, "similar line")); /* one a second: never rate-limited */
                while (s > line && s[-1] >= '0' && s[-1] <= '9')
                        s--;
                (*lines)++;
                *sum += strtoull(s, NULL, 10);
        }
        fclose(f);
}

static bool in_errlog(struct kvf_ctl *c, const char *text)
{
        struct kvf_errlog_entry e;
        for (unsigned i = 0; i < KVF_ERRLOG_ENTRIES; i++)
                if (kvf_errlog_read(c, KVF_ROLE_CONNECTOR, i, &e) == 1 && strstr(e.text, text))
                        return true;
        return false;
}

/* A frame of record r, encoded into a buffer of its own (free it). */
static uint8_t *frame_of(struct kvf_record *r, size_t *len)
{
        uint8_t *pl, *f;
        size_t n;
        CHECK(kvf_record_encode_alloc(r, &pl, &n) == 0);
        f = malloc(KVF_FRAME_HDR + n);
        CHECK(f != NULL);
        kvf_net_put_hdr(f, (uint32_t)n, r->type, 0);
        memcpy(f + KVF_FRAME_HDR, pl, n);
        free(pl);
        *len = KVF_FRAME_HDR + n;
        return f;
}

/*
 * The trickler: a hello, then (if a challenge comes) an authentication frame, each sent a byte at
 * a time, its 8-byte header over 0.8 s and its payload over the next 0.8 s: each part comes within
 * the connect timeout of the one before, the whole handshake takes 3.2 s. Only a deadline for the
 * whole (frames, and the handshake before the token is proven) ends it within 2 s.
 */
struct trickle {
        int fd;
        uint64_t start, phase_start, closed_ns;
        uint8_t *frame[2];
        size_t len[2], sent;
        int phase; /* 0 hello, 1 auth */
        uint8_t in[512];
        size_t got;
};

#define PART_NS (800 * KVF_NS_PER_MS)

static void trickle_step(struct trickle *t, uint64_t now)
{
        if (t->closed_ns)
                return;
        ssize_t n = recv(t->fd, t->in + t->got, sizeof(t->in) - t->got, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
                t->closed_ns = now;
                return;
        }
        if (n > 0)
                t->got += (size_t)n;
        if (t->phase == 0 && t->sent == t->len[0] && t->got >= KVF_FRAME_HDR) {
                struct kvf_frame_hdr h;
                kvf_net_get_hdr(t->in, &h);
                CHECK_EQ(h.type, KVF_RT_CHALLENGE);
                t->phase = 1;
                t->sent = 0;
                t->phase_start = now;
        }
        double e = (double)(now - t->phase_start) / PART_NS; /* 0..1 the header, 1..2 the payload */
        size_t len = t->len[t->phase], body = len - KVF_FRAME_HDR;
        size_t due = e < 1 ? (size_t)(KVF_FRAME_HDR * e) : KVF_FRAME_HDR + (size_t)((double)body * (e - 1));
        if (due > len)
                due = len;
        while (t->sent < due) {
                n = send(t->fd, t->frame[t->phase] + t->sent, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
                if (n != 1)
                        break;
                t->sent++;
        }
}

/* Blocks [8i, 8i + 2) of every layer tensor of c: set to v, or the bytes that differ from v. */
static uint64_t blocks(struct kvf_client *c, unsigned i, uint8_t v, bool check)
{
        struct kvf_layout_info li;
        CHECK_EQ(kvf_get_layout(c, &li), 0);
        uint64_t bad = 0;
        for (uint32_t l = 0; l < li.num_layers; l++)
                for (int k = 0; k < (li.key_only ? 1 : 2); k++) {
                        uint8_t *b = (uint8_t *)kvf_cache_tensor(c, l, k) + 8 * i * li.block_bytes;
                        for (uint64_t j = 0; j < 2 * li.block_bytes; j++) {
                                if (!check)
                                        b[j] = v;
                                else
                                        bad += b[j] != v;
                        }
                }
        return bad;
}

/* NREQ requests of 2 blocks each from p to d over tcp, every byte checked. */
static void transfer(struct kvf_client *p, struct kvf_client *d, const char *addr, const char *tag)
{
        struct kvf_layout_info li;
        CHECK_EQ(kvf_get_layout(p, &li), 0);
        uint64_t step = kvf_last_step(p) + 1;
        for (unsigned i = 0; i < NREQ; i++) {
                char id[32];
                uint32_t s[2] = {8 * i, 8 * i + 1};
                snprintf(id, sizeof(id), "%s%u", tag, i);
                blocks(p, i, (uint8_t)(tag[0] + i), false);
                blocks(d, i, 0, false);
                struct kvf_task t = {.request_id = id, .src_block_ids = s, .n_src = 2, .dest_block_ids = s,
                                     .n_dest = 2, .current_id = step, .transport = KVF_TRANSPORT_TCP,
                                     .peer = addr};
                CHECK_EQ(kvf_submit_task(p, &t), 0);
        }
        for (uint32_t l = 0; l < li.num_layers; l++)
                CHECK_EQ(kvf_layer_done(p, step, l), 0);
        for (unsigned n = 0; n < NREQ;) {
                struct kvf_event ev;
                CHECK_EQ(kvf_poll(p, &ev, 20000), 1);
                if (ev.type != KVF_EVENT_COMPLETION)
                        continue;
                if (ev.status != KVF_STATUS_FINISHED) {
                        fprintf(stderr, "session_limit_test: %s: %s: %s\n", ev.request_id,
                                kvf_status_name(ev.status), ev.reason);
                        exit(1);
                }
                n++;
        }
        for (unsigned n = 0; n < NREQ;) {
                struct kvf_event ev;
                CHECK_EQ(kvf_poll(d, &ev, 20000), 1);
                if (ev.type != KVF_EVENT_ARRIVAL)
                        continue;
                CHECK(ev.status == KVF_STATUS_FINISHED && !strncmp(ev.request_id, tag, strlen(tag)));
                n++;
        }
        for (unsigned i = 0; i < NREQ; i++)
                CHECK_EQ(blocks(d, i, (uint8_t)(tag[0] + i), true), 0);
}

int main(void)
{
        snprintf(P, sizeof(P), "sl%d-p", (int)getpid());
        snprintf(D, sizeof(D), "sl%d-d", (int)getpid());
        const char *L = "--layers 4 --kv-heads 2 --head-dim 64 --block-size 16 --blocks 64 --backend host";
        unsigned port = t_free_port();
        char addr[64];
        snprintf(addr, sizeof(addr), "127.0.0.1:%u", port);
        t_up_start(D, "--role decode %s --listen %s --max-sessions %u --connect-timeout-ms %u", L, addr,
                   LIMIT, CTO_MS);
        t_up_start(P, "--role prefill %s", L);
        t_up_wait();
        struct kvf_client *p, *d;
        struct kvf_ctl dc;
        CHECK_EQ(kvf_attach(P, 5000, &p), 0);
        CHECK_EQ(kvf_attach(D, 5000, &d), 0);
        CHECK_EQ(kvf_ctl_attach(D, false, &dc), 0);
        int pid = kvf_load_acquire(&dc.roles[KVF_ROLE_CONNECTOR].pid);
        CHECK(pid > 0);
        usleep(200000); /* (its threads started) */
        unsigned t0 = threads_of(pid);
        printf("decode connector (pid %d, --max-sessions %u): %u threads at rest\n", pid, LIMIT, t0);

        /* The trickler first, so that it holds one of the 16 slots. */
        struct kvf_record r = {.type = KVF_RT_HELLO, .proto = 4};
        kvf_random(r.nonce, sizeof(r.nonce));
        snprintf(r.purpose, sizeof(r.purpose), "control");
        struct trickle tr = {0};
        tr.frame[0] = frame_of(&r, &tr.len[0]);
        memset(&r, 0, sizeof(r));
        r.type = KVF_RT_AUTH;
        snprintf(r.instance, sizeof(r.instance), "trickler"); /* (a wrong proof: all zeros) */
        tr.frame[1] = frame_of(&r, &tr.len[1]);
        tr.fd = kvf_net_connect("127.0.0.1", (uint16_t)port, 2000);
        CHECK(tr.fd >= 0);
        tr.start = tr.phase_start = kvf_now_ns();
        usleep(50000); /* (accepted before the flood) */

        /* The flood: connections that never say a word. */
        static int fds[NTCP + NUNIX];
        static uint64_t closed_at[NTCP + NUNIX];
        unsigned nfd = 0, nunix = 0;
        uint64_t t_flood = kvf_now_ns();
        for (unsigned i = 0; i < NTCP; i++) {
                fds[nfd] = kvf_net_connect("127.0.0.1", (uint16_t)port, 2000);
                CHECK(fds[nfd] >= 0);
                nfd++;
        }
        uint64_t tcp_ns = kvf_now_ns() - t_flood;
        for (unsigned i = 0; i < NUNIX; i++) {
                int u = kvf_net_connect_unix(D, 2000);
                if (u < 0) {
                        printf("  unix socket: %s: tcp only\n", kvf_err_msg());
                        break;
                }
                fds[nfd++] = u;
                nunix++;
        }
        uint64_t flood_ns = kvf_now_ns() - t_flood;
        printf("  %u idle connections opened (%u tcp in %.0f ms, %u unix) in %.0f ms, and a trickler\n",
               nfd, NTCP, (double)tcp_ns / 1e6, nunix, (double)flood_ns / 1e6);

        /* Watch: threads, which connections the connector closes and when, the trickler. */
        unsigned tmax = 0, open = nfd;
        bool tr_done = false;
        uint64_t end = t_flood + kvf_ms(DEADLINE_MS + 2000);
        while ((open || !tr_done) && kvf_now_ns() < end) {
                uint64_t now = kvf_now_ns();
                unsigned t = threads_of(pid);
                tmax = t > tmax ? t : tmax;
                for (unsigned i = 0; i < nfd; i++)
                        if (!closed_at[i] && closed_by_peer(fds[i])) {
                                closed_at[i] = now;
                                open--;
                        }
                trickle_step(&tr, now);
                tr_done = tr.closed_ns != 0;
                usleep(5000);
        }
        /* Closed at once: by the first look after the flood, or soon after (an admitted one
         * waits a connect timeout for its hello). */
        unsigned early = 0, late = 0;
        uint64_t last = 0, t_watch = t_flood + flood_ns;
        for (unsigned i = 0; i < nfd; i++) {
                if (!closed_at[i])
                        continue;
                if (closed_at[i] - t_watch < kvf_ms(CTO_MS / 4))
                        early++;
                else
                        late++;
                last = closed_at[i] > last ? closed_at[i] : last;
        }
        printf("  threads: at most %u (at rest %u, limit %u)\n", tmax, t0, LIMIT);
        if (tmax > t0 + LIMIT + SLACK) {
                fprintf(stderr, "session_limit_test: the connector ran %u threads for %u connections: more "
                                "than its %u at rest and the %u sessions of --max-sessions\n",
                        tmax, nfd + 1, t0, LIMIT);
                return 1;
        }
        printf("  closed by the connector: %u at once, %u later (the last %.2f s after the flood began), "
               "%u still open\n", early, late, (double)(last - t_flood) / 1e9, open);
        CHECK_EQ(open, 0);
        CHECK(last - t_flood <= kvf_ms(DEADLINE_MS + 1000));
        /* The trickler's bytes each came in time; the whole handshake did not. */
        CHECK(tr_done);
        printf("  trickler (hello %zu bytes, auth %zu bytes, each over %.1f s): closed after %.2f s, "
               "in the %s\n", tr.len[0], tr.len[1], 2.0 * PART_NS / 1e9,
               (double)(tr.closed_ns - tr.start) / 1e9, tr.phase ? "authentication" : "hello");
        CHECK(tr.closed_ns - tr.start <= kvf_ms(DEADLINE_MS + 400));

        /* Counted: everything beyond the 16 the connector took (all 16 when the flood came within
         * the deadline: nothing freed a slot meanwhile). */
        uint64_t over = (uint64_t)t_counter(D, KVF_CTR_CONNECTIONS_OVER_LIMIT);
        printf("  connections_over_limit: %llu\n", (unsigned long long)over);
        CHECK(over <= nfd + 1 - LIMIT);
        if (flood_ns < kvf_ms(CTO_MS / 2)) {
                CHECK_EQ(over, nfd + 1 - LIMIT);
                CHECK_EQ(early, over);
        } else {
                CHECK(over >= nfd / 2);
        }

        /* Said in the log at most once a second, each line counting those since the line before:
         * the lines add up to the counter once the last second is over. */
        unsigned lines = 0;
        unsigned long long sum = 0;
        end = kvf_now_ns() + 3000 * KVF_NS_PER_MS;
        do {
                over_limit_lines(&lines, &sum);
                if (sum == over)
                        break;
                usleep(100000);
        } while (kvf_now_ns() < end);
        unsigned secs = (unsigned)((kvf_now_ns() - t_flood) / KVF_NS_PER_S);
        printf("  connector.log: %u line(s) in %u s, accounting for %llu connections\n", lines, secs, sum);
        CHECK_EQ(sum, over);
        CHECK(lines >= 1 && lines <= secs + 2);
        CHECK(in_errlog(&dc, "(--max-sessions) were being served"));
        CHECK(in_errlog(&dc, "no answer within the handshake timeout"));

        /* Every slot is free again: the threads went with them. */
        end = kvf_now_ns() + 2000 * KVF_NS_PER_MS;
        while (threads_of(pid) > t0 + SLACK && kvf_now_ns() < end)
                usleep(10000);
        CHECK(threads_of(pid) <= t0 + SLACK);
        for (unsigned i = 0; i < nfd; i++)
                close(fds[i]);
        close(tr.fd);
        free(tr.frame[0]);
        free(tr.frame[1]);

        /* A real peer gets through, and its authenticated connections outlive the deadline. */
        transfer(p, d, addr, "a");
        uint64_t connects = (uint64_t)t_counter(P, KVF_CTR_PEER_CONNECTS);
        uint64_t failures = (uint64_t)t_counter(P, KVF_CTR_PEER_FAILURES);
        printf("  a prefill instance's %u transfers over tcp: finished (%llu control connection(s))\n", NREQ,
               (unsigned long long)connects);
        usleep((DEADLINE_MS + 1000) * 1000);
        transfer(p, d, addr, "b");
        CHECK_EQ(t_counter(P, KVF_CTR_PEER_CONNECTS), connects);
        CHECK_EQ(t_counter(P, KVF_CTR_PEER_FAILURES), failures);
        CHECK_EQ(t_counter(D, KVF_CTR_CONNECTIONS_OVER_LIMIT), over);
        printf("  %.1f s later, %u more over the same connections\n", (double)(DEADLINE_MS + 1000) / 1e3,
               NREQ);

        kvf_ctl_detach(&dc);
        kvf_detach(p);
        kvf_detach(d);
        printf("session_limit_test: passed\n");
        return 0;
}
