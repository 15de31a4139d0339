/*
 * A hostile (or broken) peer against a real decode connector: a client that
 * authenticates and then speaks the data protocol wrongly in each way the
 * connector must catch: data for a transfer never opened, block ids beyond
 * the cache, a run beyond the transfer, a layer beyond the cache, a length
 * beyond the blocks, non-contiguous blocks, a truncated frame, garbage, a
 * malformed notice, a wrong token, and (as root) another user against the
 * same-host unix socket: kept out by the directory's permissions, and closed
 * before the handshake when it gets past them. Each time the connector disconnects
 * and reports (frames_rejected, error log), nothing outside the
 * transfer's destination blocks is written (the cache is filled with a
 * canary first and compared after), and a correct transfer still lands.
 * Then two notices the connector must answer at once, with a reason in the
 * ack and the arrival: a withdrawn transfer whose data never came, and an
 * rdma transfer to a connector that takes no rdma; and notices it refuses at
 * once until the engine's arrival ring is full: the one that waits for room is
 * still refused when the engine reads again.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <grp.h>
#include <linux/capability.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "auth.h"
#include "check.h"
#include "clock.h"
#include "ctl.h"
#include "kvferry.h"
#include "layout.h"
#include "net.h"
#include "records.h"

static char D[64], cmd[2048], host[64];
static uint32_t port;
static struct kvf_client *eng;
static struct kvf_ctl ctl;
static struct kvf_layout_info L;
static uint8_t token[KVF_TOKEN_MAX];
static size_t toklen;

static void cleanup(void)
{
        snprintf(cmd, sizeof(cmd), "%s/tools/kvferry down --instance %s >/dev/null 2>&1", KVF_SOURCE_DIR, D);
        if (system(cmd) != 0)
                fprintf(stderr, "cleanup failed\n");
}

static int send_rec(int fd, struct kvf_record *r)
{
        uint8_t *b;
        size_t n;
        CHECK(kvf_record_encode_alloc(r, &b, &n) == 0);
        int rc = kvf_net_send_frame(fd, r->type, b, (uint32_t)n, 2000);
        free(b);
        return rc;
}

/* A record of type `want` within `ms`; another frame's type as -(type) - 1000. */
static int recv_rec_within(int fd, int want, struct kvf_record *r, unsigned ms)
{
        static uint8_t buf[65536];
        struct kvf_frame_hdr h;
        int rc = kvf_net_recv_frame(fd, &h, buf, sizeof(buf), ms);
        memset(r, 0, sizeof(*r));
        if (rc < 0)
                return rc;
        if (h.type != want)
                return -(int)h.type - 1000;
        return kvf_record_decode(want, buf, h.len, 0, r);
}

static int recv_rec(int fd, int want, struct kvf_record *r)
{
        return recv_rec_within(fd, want, r, 3000);
}

/* The rank fields dial() says it has (64-bit on the wire); 0 of 0 is one rank of one. */
static uint64_t dial_rank, dial_nranks;

/* Connect and authenticate as instance "evil" with our layout; -EACCES if refused. */
static int dial(const char *purpose, const uint8_t *tok, size_t tl)
{
        int fd = kvf_net_connect(host, (uint16_t)port, 2000);
        CHECK(fd >= 0);
        uint8_t nc[32], ns[32], want[32];
        struct kvf_record r = {.type = KVF_RT_HELLO, .proto = 4};
        kvf_random(nc, 32);
        memcpy(r.nonce, nc, 32);
        snprintf(r.purpose, sizeof(r.purpose), "%s", purpose);
        CHECK(send_rec(fd, &r) == 0);
        CHECK(recv_rec(fd, KVF_RT_CHALLENGE, &r) == 0);
        memcpy(ns, r.nonce, 32);
        kvf_auth_proof(tok, tl, "kvferry-server", nc, ns, want);
        bool server_ok = kvf_auth_equal(want, r.proof, 32);
        memset(&r, 0, sizeof(r));
        r.type = KVF_RT_AUTH;
        kvf_auth_proof(tok, tl, "kvferry-client", ns, nc, r.proof);
        snprintf(r.instance, sizeof(r.instance), "evil");
        r.role = 1;
        r.generation = 1;
        struct kvf_cache_layout cl;
        CHECK(kvf_layout_from_info(&cl, &L) == 0);
        kvf_layout_to_record(&cl, &r);
        r.lay_rank = dial_rank;
        r.lay_nranks = dial_nranks;
        CHECK(send_rec(fd, &r) == 0);
        int rc = recv_rec(fd, KVF_RT_WELCOME, &r);
        if (rc < 0 || !server_ok) {
                close(fd);
                return -EACCES;
        }
        return fd;
}

static void xopen(int fd, uint64_t key, const uint32_t *dst, uint32_t n)
{
        struct kvf_record r = {.type = KVF_RT_XOPEN, .key = key, .dst = (uint32_t *)dst, .n_dst = n};
        snprintf(r.request_id, sizeof(r.request_id), "evil-%llu", (unsigned long long)key);
        CHECK(send_rec(fd, &r) == 0);
}

/* A DATA frame; `declared` is the frame length put in the header, `payload` the bytes sent. */
static void data(int fd, uint64_t key, uint32_t layer, uint16_t tensor, uint32_t index, uint32_t nblocks,
                 uint32_t declared, uint32_t payload, uint8_t fillb)
{
        /* The data header packed by hand: the test checks the wire format, not tcp.h's struct. */
        uint8_t hb[KVF_FRAME_HDR + 24];
        uint16_t z = 0;
        kvf_net_put_hdr(hb, declared, KVF_RT_DATA, 0);
        uint64_t k = htobe64(key);
        uint32_t ly = htonl(layer), ix = htonl(index), nb = htonl(nblocks);
        uint16_t tn = htons(tensor);
        memcpy(hb + 8, &k, 8);
        memcpy(hb + 16, &ly, 4);
        memcpy(hb + 20, &tn, 2);
        memcpy(hb + 22, &z, 2);
        memcpy(hb + 24, &ix, 4);
        memcpy(hb + 28, &nb, 4);
        kvf_net_write_all(fd, hb, sizeof(hb), 2000);
        uint8_t *p = malloc(payload + 1);
        memset(p, fillb, payload + 1);
        kvf_net_write_all(fd, p, payload, 2000);
        free(p);
}

/*
 * A DATAV frame (type 49, packed by hand like data()): `nruns` in its header, the first `nsent`
 * entries of run[] = {layer, tensor, index, nblocks} as its table, `declared` as the frame
 * length, then `payload` bytes: from src, or 0xee.
 */
static void datav(int fd, uint64_t key, uint32_t nruns, const uint32_t (*run)[4], uint32_t nsent,
                  uint32_t declared, uint32_t payload, const uint8_t *src)
{
        size_t hl = KVF_FRAME_HDR + 16 + (size_t)nsent * 16;
        uint8_t *hb = calloc(1, hl);
        CHECK(hb != NULL);
        kvf_net_put_hdr(hb, declared, 49, 0);
        uint64_t k = htobe64(key);
        uint32_t nr = htonl(nruns);
        memcpy(hb + 8, &k, 8);
        memcpy(hb + 16, &nr, 4);
        for (uint32_t i = 0; i < nsent; i++) {
                uint8_t *e = hb + KVF_FRAME_HDR + 16 + 16 * i;
                uint32_t ly = htonl(run[i][0]), ix = htonl(run[i][2]), nb = htonl(run[i][3]);
                uint16_t tn = htons((uint16_t)run[i][1]);
                memcpy(e, &ly, 4);
                memcpy(e + 4, &tn, 2);
                memcpy(e + 8, &ix, 4);
                memcpy(e + 12, &nb, 4);
        }
        kvf_net_write_all(fd, hb, hl, 2000);
        free(hb);
        uint8_t *p = malloc(payload + 1);
        CHECK(p != NULL);
        if (src)
                memcpy(p, src, payload);
        else
                memset(p, 0xee, payload);
        kvf_net_write_all(fd, p, payload, 2000);
        free(p);
}

/* The peer hangs up on us within 5 s. */
static bool dropped(int fd)
{
        uint8_t b[4096];
        uint64_t end = kvf_now_ns() + 5000000000ull;
        while (kvf_now_ns() < end) {
                struct pollfd pf = {.fd = fd, .events = POLLIN};
                if (poll(&pf, 1, 100) > 0) {
                        ssize_t n = recv(fd, b, sizeof(b), 0);
                        if (n <= 0)
                                return true;
                }
        }
        return false;
}

static uint64_t counter(int which)
{
        return __atomic_load_n(&ctl.counters[which].value, __ATOMIC_ACQUIRE);
}

static uint64_t rejected(void)
{
        return counter(KVF_CTR_FRAMES_REJECTED);
}

/* The connector counts what it refused within 3 s. */
static void wait_counter(int which, uint64_t before)
{
        uint64_t end = kvf_now_ns() + 3000000000ull;
        while (counter(which) <= before && kvf_now_ns() < end)
                usleep(10000);
        CHECK(counter(which) > before);
}

static void wait_rejected(uint64_t before)
{
        wait_counter(KVF_CTR_FRAMES_REJECTED, before);
}

static int ncase;

static bool in_errlog(const char *text)
{
        struct kvf_errlog_entry e;
        for (unsigned i = 0; i < KVF_ERRLOG_ENTRIES; i++)
                if (kvf_errlog_read(&ctl, KVF_ROLE_CONNECTOR, i, &e) == 1 && strstr(e.text, text))
                        return true;
        return false;
}

/*
 * As uid/gid 65534 (nobody), in a child: connect to the unix socket at path.
 * Without bypass the directory's permissions (0700, ours) must stop it: exit 0
 * if connect() fails with EACCES. With bypass the child keeps CAP_DAC_OVERRIDE,
 * standing for any way past the file permissions: exit 0 if it connects and
 * the connector closes the connection without a byte (SO_PEERCRED).
 */
static int connect_as_nobody(const char *path, bool bypass)
{
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
                struct __user_cap_header_struct ch = {.version = _LINUX_CAPABILITY_VERSION_3};
                struct __user_cap_data_struct cd[2] = {{0}};
                if (prctl(PR_SET_KEEPCAPS, 1) != 0 || setgroups(0, NULL) != 0 || setgid(65534) != 0 ||
                    setuid(65534) != 0)
                        _exit(2);
                cd[0].effective = cd[0].permitted = bypass ? 1u << CAP_DAC_OVERRIDE : 0;
                /* setuid kept every capability permitted: drop all but the one asked for */
                if (syscall(SYS_capset, &ch, cd) != 0)
                        _exit(3);
                struct sockaddr_un a = {.sun_family = AF_UNIX};
                snprintf(a.sun_path, sizeof(a.sun_path), "%s", path);
                int u = socket(AF_UNIX, SOCK_STREAM, 0);
                int rc = connect(u, (struct sockaddr *)&a, sizeof(a));
                if (!bypass)
                        _exit(rc < 0 && errno == EACCES ? 0 : 4);
                if (rc < 0)
                        _exit(5);
                struct pollfd pf = {.fd = u, .events = POLLIN};
                char c;
                /* closed by the connector: end of stream, not a byte */
                _exit(poll(&pf, 1, 3000) == 1 && read(u, &c, 1) == 0 ? 0 : 6);
        }
        int st;
        CHECK(waitpid(pid, &st, 0) == pid);
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/*
 * The same-host unix socket against another user: it cannot reach the socket
 * (the directory is 0700), and one that gets past the file permissions all
 * the same is closed before the handshake, counted and reported. Needs root
 * (to be another user); returns false when skipped.
 */
static bool unix_other_user(void)
{
        if (geteuid() != 0)
                return false;
        char path[108];
        CHECK(kvf_net_unix_path(D, path, sizeof(path)) == 0);
        uint64_t before = counter(KVF_CTR_AUTH_FAILURES);
        CHECK_EQ(connect_as_nobody(path, false), 0);
        printf("  %-36s -> no entry (the socket's directory is 0700)\n", "unix socket, another user");
        CHECK(counter(KVF_CTR_AUTH_FAILURES) == before);
        CHECK_EQ(connect_as_nobody(path, true), 0);
        wait_counter(KVF_CTR_AUTH_FAILURES, before);
        CHECK(in_errlog("runs as uid 65534"));
        printf("  %-36s -> closed before the handshake, reported\n", "... past the permissions anyway");
        return true;
}

static void expect_drop(const char *what, int fd, uint64_t before, const char *logged)
{
        if (!dropped(fd)) {
                fprintf(stderr, "case '%s': the connector did not disconnect us\n", what);
                exit(1);
        }
        close(fd);
        wait_rejected(before);
        if (!in_errlog(logged)) {
                fprintf(stderr, "case '%s': no error-log entry containing \"%s\"\n", what, logged);
                exit(1);
        }
        printf("  %-36s -> disconnected, reported (\"%s\")\n", what, logged);
        ncase++;
}

static uint8_t canary(uint32_t l, uint32_t t, uint32_t b, uint64_t i)
{
        return (uint8_t)(0xa5 ^ l ^ (t << 3) ^ b ^ (i * 7));
}

int main(void)
{
        snprintf(D, sizeof(D), "hp%d-d", (int)getpid());
        atexit(cleanup);
        snprintf(cmd, sizeof(cmd), "%s/tools/kvferry up --instance %s --role decode --layers 4 --kv-heads 2 "
                                   "--head-dim 64 --block-size 16 --blocks 64 >/dev/null",
                 KVF_SOURCE_DIR, D);
        CHECK(system(cmd) == 0);
        char tf[512];
        kvf_token_default_path(tf, sizeof(tf));
        CHECK(kvf_token_load(tf, token, &toklen) == 0);
        CHECK(kvf_attach(D, 5000, &eng) == 0);
        CHECK(kvf_ctl_attach(D, false, &ctl) == 0);
        CHECK(kvf_connector_info_read(&ctl, host, sizeof(host), &port) == 0);
        kvf_get_layout(eng, &L);
        uint32_t layers = L.num_layers + L.extra_layers, tensors = L.key_only ? 1 : 2;
        for (uint32_t l = 0; l < layers; l++)
                for (uint32_t t = 0; t < tensors; t++) {
                        uint8_t *base = kvf_cache_tensor(eng, l, (int)t);
                        for (uint32_t b = 0; b < L.num_blocks; b++)
                                for (uint64_t i = 0; i < L.block_bytes; i++)
                                        base[b * L.block_bytes + i] = canary(l, t, b, i);
                }
        uint32_t bb = (uint32_t)L.block_bytes;
        printf("hostile peer against %s (%s:%u), %u blocks of %u bytes:\n", D, host, port, L.num_blocks, bb);

        uint64_t before;
        int fd;
        static const uint32_t d3[3] = {10, 11, 12}, big[2] = {5, 64}, gaps[3] = {20, 22, 24};

        before = rejected();
        fd = dial("data", token, toklen);
        data(fd, 1, 0, 0, 0, 1, 24 + bb, bb, 0xee);
        expect_drop("data for a transfer never opened", fd, before, "which was never opened");

        before = rejected();
        fd = dial("data", token, toklen);
        xopen(fd, 2, big, 2);
        expect_drop("open naming a block beyond the cache", fd, before, "names block 64 beyond this cache");

        before = rejected();
        fd = dial("data", token, toklen);
        xopen(fd, 3, d3, 3);
        data(fd, 3, 0, 0, 2, 2, 24 + 2 * bb, 2 * bb, 0xee);
        expect_drop("run past the transfer's blocks", fd, before, "data for blocks [2, +2)");

        before = rejected();
        fd = dial("data", token, toklen);
        xopen(fd, 4, d3, 3);
        data(fd, 4, layers, 0, 0, 1, 24 + bb, bb, 0xee);
        expect_drop("layer beyond the cache", fd, before, "this cache has 4 layers");

        before = rejected();
        fd = dial("data", token, toklen);
        xopen(fd, 5, d3, 3);
        data(fd, 5, 0, 0, 0, 1, 24 + bb + 100, bb + 100, 0xee);
        expect_drop("length beyond the block", fd, before, "for 1 blocks of");

        before = rejected();
        fd = dial("data", token, toklen);
        xopen(fd, 6, gaps, 3);
        data(fd, 6, 0, 0, 0, 2, 24 + 2 * bb, 2 * bb, 0xee);
        expect_drop("run over non-contiguous blocks", fd, before, "not contiguous");

        /* A payload above a frame's 4 MiB (what a GPU cache's staging buffer holds), refused from its
         * header before any payload is read. */
        before = rejected();
        fd = dial("data", token, toklen);
        xopen(fd, 7, d3, 3);
        data(fd, 7, 0, 0, 0, 1, 24 + (4u << 20) + 16, 0, 0xee);
        expect_drop("data frame above 4 MiB", fd, before, "(data: at most 4194328)");

        /* Gathered frames (DATAV): every run is checked before a byte is written. */
        before = rejected();
        fd = dial("data", token, toklen);
        datav(fd, 8, 0, NULL, 0, 16, 0, NULL);
        expect_drop("gathered frame of no runs", fd, before, "gathered data frame of 0 runs");

        before = rejected();
        fd = dial("data", token, toklen);
        datav(fd, 8, 65, NULL, 0, 16 + 65 * 16, 0, NULL);
        expect_drop("gathered frame of 65 runs", fd, before, "gathered data frame of 65 runs");

        {
                static const uint32_t two[2][4] = {{0, 0, 0, 1}, {0, 1, 0, 1}};
                before = rejected();
                fd = dial("data", token, toklen);
                xopen(fd, 8, d3, 3);
                datav(fd, 8, 2, two, 2, 16 + 32 + bb, bb, NULL);
                expect_drop("gathered runs longer than the frame", fd, before, "payload bytes for runs of");

                /* The first run is good and names blocks 10 and 11: nothing of it may land. */
                static const uint32_t past[2][4] = {{1, 0, 0, 2}, {1, 0, 2, 2}};
                before = rejected();
                fd = dial("data", token, toklen);
                xopen(fd, 9, d3, 3);
                datav(fd, 9, 2, past, 2, 16 + 32 + 4 * bb, 4 * bb, NULL);
                expect_drop("gathered run past the transfer", fd, before, "data for blocks [2, +2)");
        }

        before = rejected();
        fd = dial("data", token, toklen);
        {
                uint8_t junk[64];
                kvf_random(junk, sizeof(junk));
                junk[4] = 0x7f; /* no such frame type */
                kvf_net_write_all(fd, junk, sizeof(junk), 2000);
        }
        expect_drop("garbage", fd, before, "on a data connection");

        before = rejected();
        fd = dial("control", token, toklen);
        kvf_net_send_frame(fd, KVF_RT_NOTICE, "\x81\xa3key\xa1x", 7, 2000);
        expect_drop("malformed notice", fd, before, "sent a bad frame");

        /* Truncated: half a block for blocks[0] of layer 0, then hang up. Only that block may change. */
        before = rejected();
        fd = dial("data", token, toklen);
        xopen(fd, 7, d3, 3);
        data(fd, 7, 0, 0, 0, 1, 24 + bb, bb / 2, 0x5a);
        usleep(100000);
        close(fd);
        wait_rejected(before);
        printf("  %-36s -> dropped; only its own block touched\n", "frame cut short");
        ncase++;

        /* Wrong token: refused before anything is accepted. */
        CHECK(dial("data", (const uint8_t *)"not-the-token-at-all", 20) == -EACCES);
        printf("  %-36s -> refused at the handshake\n", "wrong token");

        /* A peer with the token whose rank fields are no rank of a group: they are 64-bit on the
         * wire, and rank 2^32 of 2^32 + 1 was taken as rank 0 of 1. */
        static const uint64_t ranks[][2] = {{1ull << 32, (1ull << 32) + 1}, {3, 2}, {0, 1ull << 40}};
        for (unsigned i = 0; i < 3; i++) {
                dial_rank = ranks[i][0];
                dial_nranks = ranks[i][1];
                CHECK(dial("data", token, toklen) == -EACCES);
                printf("  %-36s -> refused at the handshake\n", i == 0 ? "rank 2^32 of 2^32 + 1"
                                                                  : i == 1 ? "rank 3 of 2" : "rank 0 of 2^40");
        }
        dial_rank = dial_nranks = 0;
        ncase++;

        if (unix_other_user()) {
                ncase += 2;
        } else {
                printf("  %-36s -> skipped (needs root to be another user)\n", "unix socket, another user");
        }

        /* Nothing outside the truncated frame's destination block was written. */
        uint64_t changed = 0;
        for (uint32_t l = 0; l < layers; l++)
                for (uint32_t t = 0; t < tensors; t++) {
                        const uint8_t *base = kvf_cache_tensor(eng, l, (int)t);
                        for (uint32_t b = 0; b < L.num_blocks; b++)
                                for (uint64_t i = 0; i < L.block_bytes; i++)
                                        if (base[b * L.block_bytes + i] != canary(l, t, b, i)) {
                                                CHECK(l == 0 && t == 0 && b == 10 && i < bb / 2);
                                                changed++;
                                        }
                }
        printf("  cache outside the request's destination blocks: untouched (%llu bytes of block 10 written by the cut frame)\n",
               (unsigned long long)changed);

        /* The connector still works: a correct transfer of 3 blocks x all layers, then its notice. */
        int dfd = dial("data", token, toklen), cfd = dial("control", token, toklen);
        CHECK(dfd >= 0 && cfd >= 0);
        xopen(dfd, 99, d3, 3);
        /* Layers 0 and 1 in data frames; the rest gathered: one frame of a run per
         * (layer, tensor), blocks 10 and 11 as one run and block 12 as another. */
        uint32_t gathered[64][4], ng = 0;
        uint8_t *gp = malloc((size_t)32 * 3 * bb); /* 3 blocks per (layer, tensor) */
        CHECK(gp != NULL);
        for (uint32_t l = 0; l < layers; l++)
                for (uint16_t t = 0; t < tensors; t++) {
                        uint8_t fill = (uint8_t)(l * 2 + t + 1);
                        if (l < 2) {
                                data(dfd, 99, l, t, 0, 3, 24 + 3 * bb, 3 * bb, fill);
                                continue;
                        }
                        CHECK(ng + 2 <= 64);
                        memset(gp + (size_t)(ng / 2) * 3 * bb, fill, 3 * bb); /* 2 runs per (l, t) */
                        memcpy(gathered[ng++], (uint32_t[4]){l, t, 0, 2}, sizeof(gathered[0]));
                        memcpy(gathered[ng++], (uint32_t[4]){l, t, 2, 1}, sizeof(gathered[0]));
                }
        CHECK(ng >= 2);
        datav(dfd, 99, ng, (const uint32_t(*)[4])gathered, ng, 16 + 16 * ng + (ng / 2) * 3 * bb,
              (ng / 2) * 3 * bb, gp);
        free(gp);
        struct kvf_record n = {.type = KVF_RT_NOTICE, .key = 99, .transport = KVF_TRANSPORT_TCP,
                               .status = KVF_STATUS_FINISHED, .dst = (uint32_t *)d3, .n_dst = 3,
                               .bytes = (uint64_t)3 * bb * layers * tensors, .blocks = 3};
        snprintf(n.request_id, sizeof(n.request_id), "good-after-evil");
        snprintf(n.peer, sizeof(n.peer), "evil");
        CHECK(send_rec(cfd, &n) == 0);
        struct kvf_record ack;
        int rc;
        do
                rc = recv_rec(cfd, KVF_RT_ACK, &ack);
        while (rc == -(KVF_RT_PING) - 1000 || rc == -(KVF_RT_PONG) - 1000);
        CHECK(rc == 0);
        CHECK(ack.status == KVF_STATUS_FINISHED);
        struct kvf_event ev;
        CHECK(kvf_poll(eng, &ev, 5000) == 1);
        CHECK(ev.type == KVF_EVENT_ARRIVAL && !strcmp(ev.request_id, "good-after-evil") &&
              ev.status == KVF_STATUS_FINISHED && !strcmp(ev.peer, "evil"));
        /* A tcp arrival counts what landed and lists where. */
        CHECK_EQ(ev.bytes, (uint64_t)3 * bb * layers * tensors);
        CHECK_EQ(ev.blocks, 3);
        CHECK(ev.n_dest == 3 && ev.dest_block_ids[0] == 10 && ev.dest_block_ids[1] == 11 &&
              ev.dest_block_ids[2] == 12);
        const uint8_t *k0 = kvf_cache_tensor(eng, 3, 1);
        CHECK(k0[11 * bb] == 3 * 2 + 1 + 1);
        const uint8_t *g = kvf_cache_tensor(eng, 2, 0), *d = kvf_cache_tensor(eng, 1, 1);
        for (uint64_t i = 0; i < 3 * (uint64_t)bb; i++) /* blocks 10..12: gathered and plain */
                CHECK(g[10 * bb + i] == 2 * 2 + 0 + 1 && d[10 * bb + i] == 1 * 2 + 1 + 1);

        /* A finish notice the peer can never complete, then answered on the spot: a transfer
         * whose data never came, withdrawn (as the sender does past its deadline), and an rdma
         * transfer to this connector, which listens on no rdma device. Each ends at once
         * with a failure that says why, in the ack and in the arrival alike. */
        static const uint32_t d2[1] = {20}, d4[1] = {21};
        xopen(dfd, 100, d2, 1);
        struct kvf_record f = {.type = KVF_RT_NOTICE, .key = 100, .transport = KVF_TRANSPORT_TCP,
                               .status = KVF_STATUS_FINISHED, .dst = (uint32_t *)d2, .n_dst = 1, .blocks = 1};
        snprintf(f.request_id, sizeof(f.request_id), "evil-100");
        snprintf(f.peer, sizeof(f.peer), "evil");
        CHECK(send_rec(cfd, &f) == 0); /* (waits for its data) */
        f.status = KVF_STATUS_TIMEOUT;
        f.withdraw = true;
        snprintf(f.reason, sizeof(f.reason), "timed out after 3000 ms waiting for the peer to confirm the arrival");
        CHECK(send_rec(cfd, &f) == 0);
        struct kvf_record r = {.type = KVF_RT_NOTICE, .key = 101, .transport = KVF_TRANSPORT_RDMA,
                               .status = KVF_STATUS_FINISHED, .dst = (uint32_t *)d4, .n_dst = 1, .blocks = 1};
        snprintf(r.request_id, sizeof(r.request_id), "evil-101");
        snprintf(r.peer, sizeof(r.peer), "evil");
        CHECK(send_rec(cfd, &r) == 0);
        for (int k = 0; k < 2; k++) {
                do
                        rc = recv_rec(cfd, KVF_RT_ACK, &ack);
                while (rc == -(KVF_RT_PING) - 1000 || rc == -(KVF_RT_PONG) - 1000);
                CHECK(rc == 0);
                printf("  ack of %s: %s: %s\n", ack.request_id, kvf_status_name(ack.status), ack.reason);
                if (ack.key == 100)
                        CHECK(ack.status == KVF_STATUS_TIMEOUT && ack.reason[0]);
                else
                        CHECK(ack.key == 101 && ack.status == KVF_STATUS_CONNECTION && strstr(ack.reason, "rdma"));
                CHECK(kvf_poll(eng, &ev, 5000) == 1);
                CHECK(ev.type == KVF_EVENT_ARRIVAL && !strcmp(ev.request_id, ack.request_id));
                CHECK(ev.status == ack.status && !strcmp(ev.reason, ack.reason));
        }
        printf("  a withdrawn transfer and an rdma one this connector cannot take: answered at once, "
               "with the same reason in the ack and the arrival\n");

        /* Notices this connector refuses at once ('bad task': 1000 source blocks for one block
         * of 16 tokens) while the engine reads nothing: once its arrival ring is full, the next
         * one waits for room, and when the engine reads again it must still be 'bad task' in
         * the ack and the arrival (its transfer closed at the refusal, the retry was taken for
         * a repeat of a published one and told 'finished', with no byte ever sent). */
        uint64_t key = 1000, waiting = 0;
        for (; key < 1000 + 200000 && !waiting; key++) {
                static uint32_t one[1];
                one[0] = (uint32_t)(key % 60);
                struct kvf_record b = {.type = KVF_RT_NOTICE, .key = key, .transport = KVF_TRANSPORT_TCP,
                                       .status = KVF_STATUS_FINISHED, .dst = one, .n_dst = 1, .blocks = 1000};
                snprintf(b.request_id, sizeof(b.request_id), "refused-%llu", (unsigned long long)key);
                snprintf(b.peer, sizeof(b.peer), "evil");
                CHECK(send_rec(cfd, &b) == 0);
                do
                        rc = recv_rec_within(cfd, KVF_RT_ACK, &ack, 500);
                while (rc == -(KVF_RT_PING) - 1000 || rc == -(KVF_RT_PONG) - 1000);
                if (rc < 0)
                        waiting = key; /* (no answer: the engine's ring is full) */
                else
                        CHECK(ack.key == key && ack.status == KVF_STATUS_BAD_TASK);
        }
        CHECK(waiting);
        unsigned drained = 0;
        while (kvf_poll(eng, &ev, 1000) == 1) {
                CHECK(ev.type != KVF_EVENT_ARRIVAL || ev.status == KVF_STATUS_BAD_TASK);
                drained++;
        }
        do
                rc = recv_rec_within(cfd, KVF_RT_ACK, &ack, 5000);
        while (rc == -(KVF_RT_PING) - 1000 || rc == -(KVF_RT_PONG) - 1000);
        CHECK(rc == 0 && ack.key == waiting);
        if (ack.status != KVF_STATUS_BAD_TASK || !strstr(ack.reason, "1000 source blocks")) {
                fprintf(stderr, "the refused notice that waited for room: ack '%s' \"%s\"\n",
                        kvf_status_name(ack.status), ack.reason);
                exit(1);
        }
        printf("  %llu refused notices, the last waiting for room in the engine's ring: 'bad task' in its ack "
               "and in all %u arrivals\n",
               (unsigned long long)(waiting - 1000 + 1), drained);
        close(dfd);
        close(cfd);
        printf("hostile_peer_test: %d cases refused; a correct transfer afterwards arrived\n", ncase);
        kvf_detach(eng);
        kvf_ctl_detach(&ctl);
        return 0;
}
