/*
 * The bad-input table: every task an engine can get wrong yields one
 * completion with its exact status and a message naming what is wrong,
 * and the instance keeps working (a good request after them finishes).
 * Real processes: instances are started with tools/kvferry up.
 */
#include <errno.h>
#include <msgpack.h>
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

static char P[64], P2[64], P3[64], D[64], D2[64], DX[64], G5[64], GX[64];
static struct kvf_client *c;

static void stale_cleanup(void)
{
        kvf_ctl_unlink(G5);
        kvf_ctl_unlink(GX);
}

/*
 * What an instance killed outright leaves in /dev/shm: its segment, its roles
 * still marked running under pids that are gone.
 */
static void stale_segment(const char *name, uint32_t device)
{
        struct kvf_ctl_params p = {.instance = name, .instance_role = KVF_IROLE_DECODE,
                                   .backend = KVF_BACKEND_HOST, .device = device, .reqtab_slots = 8,
                                   .max_blocks = 16};
        struct kvf_ctl sc;
        kvf_ctl_unlink(name);
        CHECK_EQ(kvf_ctl_create(&p, &sc), 0);
        kvf_ctl_publish(&sc);
        for (int r = 0; r < KVF_ROLE_ENGINE; r++) {
                kvf_role_begin(&sc, (enum kvf_role_id)r);
                sc.roles[r].pid = 0x7ffffff0; /* above any pid_max: no such process */
        }
        kvf_ctl_detach(&sc);
}


/* ---- building task records ---- */

struct pk {
        msgpack_sbuffer sb;
        msgpack_packer p;
};

static void pk_init(struct pk *k)
{
        msgpack_sbuffer_init(&k->sb);
        msgpack_packer_init(&k->p, &k->sb, msgpack_sbuffer_write);
}

static void str(struct pk *k, const char *s)
{
        msgpack_pack_str(&k->p, strlen(s));
        msgpack_pack_str_body(&k->p, s, strlen(s));
}

static void ids(struct pk *k, const long *v, int n)
{
        msgpack_pack_array(&k->p, (size_t)n);
        for (int i = 0; i < n; i++)
                msgpack_pack_int64(&k->p, v[i]);
}

/* A task map; NULL / n < 0 leaves a field out; cur_str sends current_id as a string. */
static void task(struct pk *k, const char *id, const long *src, int ns, const long *dst, int nd,
                 const char *proto, const char *peer, bool cur_str)
{
        int n = (id != NULL) + (ns >= 0) + (nd >= 0) + 1 + (proto != NULL) + (peer != NULL);
        pk_init(k);
        msgpack_pack_map(&k->p, (size_t)n);
        if (id) {
                str(k, "request_id");
                str(k, id);
        }
        if (ns >= 0) {
                str(k, "src_block_ids");
                ids(k, src, ns);
        }
        if (nd >= 0) {
                str(k, "dest_block_ids");
                ids(k, dst, nd);
        }
        str(k, "current_id");
        if (cur_str)
                str(k, "7");
        else
                msgpack_pack_uint64(&k->p, 1000000); /* far future: never ready by itself */
        if (proto) {
                str(k, "transfer_protocol");
                str(k, proto);
        }
        if (peer) {
                str(k, "peer");
                str(k, peer);
        }
}

/* Next completion, within 10 s. */
static void next_completion(struct kvf_event *ev)
{
        int rc;
        do {
                rc = kvf_poll(c, ev, 10000);
                CHECK(rc >= 0);
                CHECK(rc == 1);
        } while (ev->type != KVF_EVENT_COMPLETION);
}

static int ncase, rejected;
static uint64_t last_bytes; /* of the last completion expect() took */

static void expect(const char *what, const char *id, int status, const char *needle)
{
        struct kvf_event ev;
        next_completion(&ev);
        /* A rejection has no accept time: it never got a slot. */
        rejected += ev.accept_ns == 0;
        last_bytes = ev.bytes;
        if (strcmp(ev.request_id, id) || ev.status != status || !strstr(ev.reason, needle)) {
                fprintf(stderr,
                        "case '%s': got request '%s' status '%s' reason \"%s\"\n"
                        "         want request '%s' status '%s' reason containing \"%s\"\n",
                        what, ev.request_id, kvf_status_name(ev.status), ev.reason, id,
                        kvf_status_name(status), needle);
                exit(1);
        }
        printf("  %-34s -> %-22s \"%s\"\n", what, kvf_status_name(ev.status), ev.reason);
        ncase++;
}

/*
 * A task as FastDeploy builds it for a same-host (ipc) peer: no "peer", the
 * peer named by device_ids (ndev entries; ndev < 0 leaves it out) or by ip and
 * rdma_ports [port] (numbers as strings when port_str), with "port": also_port
 * before them when also_port >= 0, the request id as msgpack bin when id_bin.
 */
static void fd_task(struct pk *k, const char *id, bool id_bin, const long *dst, int nd,
                    const long *dev, int ndev, const char *ip, long port, bool port_str,
                    long also_port)
{
        static const long src[] = {0, 1, 2};
        int n = 5 + (ndev >= 0) + 2 * (ip != NULL) + (also_port >= 0);
        pk_init(k);
        msgpack_pack_map(&k->p, (size_t)n);
        str(k, "request_id");
        if (id_bin) {
                msgpack_pack_bin(&k->p, strlen(id));
                msgpack_pack_bin_body(&k->p, id, strlen(id));
        } else {
                str(k, id);
        }
        str(k, "src_block_ids");
        ids(k, src, nd);
        str(k, "dest_block_ids");
        ids(k, dst, nd);
        str(k, "current_id");
        msgpack_pack_uint64(&k->p, 1000000);
        str(k, "transfer_protocol");
        str(k, "ipc");
        if (ndev >= 0) {
                str(k, "device_ids");
                msgpack_pack_array(&k->p, (size_t)ndev);
                for (int i = 0; i < ndev; i++) {
                        char d[24];
                        snprintf(d, sizeof(d), "%ld", dev[i]);
                        str(k, d); /* FastDeploy reads them with int(): strings happen */
                }
        }
        if (also_port >= 0) {
                str(k, "port");
                msgpack_pack_int64(&k->p, also_port);
        }
        if (ip) {
                str(k, "ip");
                str(k, ip);
                str(k, "rdma_ports");
                msgpack_pack_array(&k->p, 1);
                if (port_str) {
                        char ps[16];
                        snprintf(ps, sizeof(ps), "%ld", port);
                        str(k, ps);
                } else {
                        msgpack_pack_int64(&k->p, port);
                }
        }
}

static void submit_pk(struct pk *k)
{
        CHECK_EQ(kvf_submit_raw(c, KVF_TO_SENDER, KVF_REC_TASK, k->sb.data, k->sb.size), 0);
        msgpack_sbuffer_destroy(&k->sb);
}

static void bad(const char *what, const char *id_expected, int status, const char *needle,
                const char *id, const long *src, int ns, const long *dst, int nd, const char *proto,
                const char *peer, bool cur_str)
{
        struct pk k;
        task(&k, id, src, ns, dst, nd, proto, peer, cur_str);
        submit_pk(&k);
        expect(what, id_expected, status, needle);
}

/* An ipc task of `n` blocks src -> dst to `peer` for step `step`. */
static void ipc_task(const char *id, const uint32_t *src, const uint32_t *dst, uint32_t n,
                     uint64_t step, const char *peer)
{
        struct kvf_task t = {.request_id = id,
                             .src_block_ids = src,
                             .n_src = n,
                             .dest_block_ids = dst,
                             .n_dest = n,
                             .current_id = step,
                             .transport = KVF_TRANSPORT_IPC,
                             .peer = peer};
        CHECK_EQ(kvf_submit_task(c, &t), 0);
}

/* Every layer of `step` is written. */
static void publish(uint64_t step)
{
        struct kvf_layout_info li;
        kvf_get_layout(c, &li);
        for (uint32_t l = 0; l < li.num_layers + li.extra_layers; l++)
                CHECK_EQ(kvf_layer_done(c, step, l), 0);
}

/* What `n` whole blocks of every layer and tensor come to. */
static uint64_t blocks_bytes(uint32_t n)
{
        struct kvf_layout_info li;
        kvf_get_layout(c, &li);
        return (uint64_t)n * (li.num_layers + li.extra_layers) * (li.key_only ? 1 : 2) *
               li.block_bytes;
}

/* The next two completions, in either order: `a` and `b` finished with n blocks each. */
static void expect_two_finished(const char *what, const char *a, const char *b, uint32_t n)
{
        bool seen_a = false, seen_b = false;
        for (int k = 0; k < 2; k++) {
                struct kvf_event ev;
                next_completion(&ev);
                bool is_a = !strcmp(ev.request_id, a) && !seen_a,
                     is_b = !strcmp(ev.request_id, b) && !seen_b;
                if ((!is_a && !is_b) || ev.status != KVF_STATUS_FINISHED ||
                    ev.bytes != blocks_bytes(n)) {
                        fprintf(
                            stderr,
                            "case '%s': got request '%s' status '%s' (%llu bytes) reason \"%s\"\n"
                            "         want '%s' and '%s' finished, %llu bytes each\n",
                            what, ev.request_id, kvf_status_name(ev.status),
                            (unsigned long long)ev.bytes, ev.reason, a, b,
                            (unsigned long long)blocks_bytes(n));
                        exit(1);
                }
                seen_a |= is_a;
                seen_b |= is_b;
                printf("  %-34s -> %-22s (%s, %llu bytes)\n", what, kvf_status_name(ev.status),
                       ev.request_id, (unsigned long long)ev.bytes);
        }
        ncase++;
}

/*
 * Two live requests of this instance that name the same block of the same peer: the engines
 * booked it twice, and both would be reported finished with one's bytes in the other's block.
 * The second is refused naming the block, the peer and the first; the first goes on; once it
 * has ended its blocks may be booked again; the same blocks of another peer are that peer's.
 */
static void double_booking(void)
{
        const uint32_t sa[3] = {7, 8, 9}, da[3] = {50, 51, 52}, sb[2] = {10, 11}, db[2] = {53, 51},
                       se[2] = {12, 13}, de[2] = {60, 61};
        char want[160];

        uint64_t step = kvf_last_step(c) + 1;
        ipc_task("ov-a", sa, da, 3, step, D); /* live: its step is not yet written */
        ipc_task("ov-b", sb, db, 2, step, D);
        snprintf(
            want, sizeof(want),
            "dest_block_ids[1] = 51 of peer '%s' is already the destination of live request 'ov-a'",
            D);
        expect("dest block of a live request", "ov-b", KVF_STATUS_BAD_TASK, want);
        publish(step);
        expect("the live request goes on", "ov-a", KVF_STATUS_FINISHED, "");
        CHECK_EQ(last_bytes, blocks_bytes(3));

        /* ov-a has ended: its blocks are free for the next request. */
        step++;
        ipc_task("ov-c", sa, da, 3, step, D);
        publish(step);
        expect("its blocks once it has ended", "ov-c", KVF_STATUS_FINISHED, "");
        CHECK_EQ(last_bytes, blocks_bytes(3));

        /* The same blocks at two decode instances: no conflict. ov-g, refused, says ov-e was
         * live when ov-f was read (tasks are read in order). */
        step++;
        ipc_task("ov-e", se, de, 2, step, D);
        ipc_task("ov-f", se, de, 2, step, D2);
        ipc_task("ov-g", se, de + 1, 1, step, D);
        snprintf(
            want, sizeof(want),
            "dest_block_ids[0] = 61 of peer '%s' is already the destination of live request 'ov-e'",
            D);
        expect("the other peer's request is its own", "ov-g", KVF_STATUS_BAD_TASK, want);
        publish(step);
        expect_two_finished("the same blocks at another peer", "ov-e", "ov-f", 2);
}

/* An ipc task of one block whose request id goes as msgpack bin (bytes, not UTF-8). */
static void bin_task(const char *id, long src, long dst, uint64_t step, const char *peer)
{
        struct pk k;
        pk_init(&k);
        msgpack_pack_map(&k.p, 6);
        str(&k, "request_id");
        msgpack_pack_bin(&k.p, strlen(id));
        msgpack_pack_bin_body(&k.p, id, strlen(id));
        str(&k, "src_block_ids");
        ids(&k, &src, 1);
        str(&k, "dest_block_ids");
        ids(&k, &dst, 1);
        str(&k, "current_id");
        msgpack_pack_uint64(&k.p, step);
        str(&k, "transfer_protocol");
        str(&k, "ipc");
        str(&k, "peer");
        str(&k, peer);
        submit_pk(&k);
}

/*
 * A reason that quotes an id given as bytes (here the live request's, in the double-booking
 * refusal), and one cut where a character is longer than the room left: the completion still
 * reaches the engine (readers refuse a str that is not UTF-8; the engine's poll failed with
 * "field 'reason' is not valid UTF-8" and the refusal was lost), with the bytes as \xNN.
 */
static void reasons_as_text(void)
{
        char live[96], want[200];
        uint64_t step = kvf_last_step(c) + 1;
        /* 'é' is two bytes: at an odd offset the reason's 239-byte cut falls inside one. */
        snprintf(live, sizeof(live), "bytes-\xff\xfe-");
        for (size_t n = strlen(live); n + 2 < 90; n += 2)
                strcat(live, "\xc3\xa9");
        bin_task(live, 14, 40, step, D);
        bin_task("bytes-\xff-second", 15, 40, step, D);
        snprintf(want, sizeof(want), "is already the destination of live request 'bytes-\\xff\\xfe-\xc3\xa9");
        expect("a reason quoting a bytes id", "bytes-\xff-second", KVF_STATUS_BAD_TASK, want);
        publish(step);
        expect("the bytes-id request goes on", live, KVF_STATUS_FINISHED, "");
}

/*
 * The decode engine gives a request's block to its next request as soon as the arrival says
 * `finished`, before the prefill side has heard the answer: that next task is no double
 * booking (the first request's bytes have all landed) and must go through, round after round.
 * From a prefill instance whose notices go through the connectors' sockets, where the answer
 * takes longest to come back (with the blocks held until it came, about every other round was
 * refused).
 */
static void block_reuse(const char *L)
{
        enum { ROUNDS = 60 };
        struct kvf_client *dc, *keep = c;
        snprintf(P3, sizeof(P3), "bt%d-p3", (int)getpid());
        t_up(P3, "--role prefill %s --no-notice-rings", L);
        CHECK_EQ(kvf_attach(P3, 5000, &c), 0);
        CHECK_EQ(kvf_attach(D2, 5000, &dc), 0);
        const uint32_t src[1] = {14}, dst[1] = {40};
        for (int i = 0; i < ROUNDS; i++) {
                char id[32];
                snprintf(id, sizeof(id), "reuse-%d", i);
                uint64_t step = kvf_last_step(c) + 1;
                ipc_task(id, src, dst, 1, step, D2);
                publish(step);
                struct kvf_event ev;
                do { /* its arrival, then the next task into the same block at once */
                        CHECK_EQ(kvf_poll(dc, &ev, 10000), 1);
                } while (ev.type != KVF_EVENT_ARRIVAL || strcmp(ev.request_id, id));
                CHECK_EQ(ev.status, KVF_STATUS_FINISHED);
        }
        for (int i = 0; i < ROUNDS; i++) {
                struct kvf_event ev;
                next_completion(&ev);
                if (ev.status != KVF_STATUS_FINISHED) {
                        fprintf(stderr, "block reuse: %s %s: %s\n", ev.request_id,
                                kvf_status_name(ev.status), ev.reason);
                        exit(1);
                }
        }
        kvf_detach(dc);
        kvf_detach(c);
        c = keep;
        printf("  %-34s -> %d of %d finished\n", "a block reused at each arrival", ROUNDS, ROUNDS);
        ncase++;
}

/*
 * The first tcp task to a peer whose block count this sender has not learnt yet, naming a block
 * beyond that peer's cache: the sender cannot check it, and its finish notice can reach the
 * decode connector before the prefill connector refuses the transfer. Both sides must end it
 * `block id out of range`, the decode engine with an arrival (the refused notice used to be
 * dropped: the decode engine heard nothing, in 5 of 6 fresh starts). A fresh prefill instance
 * per round, so each round's task is its sender's first to that peer.
 */
static void tcp_block_beyond_unknown_size(const char *L)
{
        enum { ROUNDS = 3 };
        struct kvf_client *dc, *keep = c;
        char addr[128], cmd[512];
        t_connector_addr(D2, addr, sizeof(addr));
        CHECK_EQ(kvf_attach(D2, 5000, &dc), 0);
        snprintf(P3, sizeof(P3), "bt%d-p4", (int)getpid());
        for (int round = 0; round < ROUNDS; round++) {
                t_up(P3, "--role prefill %s", L);
                CHECK_EQ(kvf_attach(P3, 5000, &c), 0);
                char id[32];
                snprintf(id, sizeof(id), "beyond-%d", round);
                static const uint32_t src[1] = {3}, dst[1] = {65}; /* D2 has 64 blocks */
                uint64_t step = kvf_last_step(c) + 1;
                struct kvf_task t = {.request_id = id,
                                     .src_block_ids = src,
                                     .n_src = 1,
                                     .dest_block_ids = dst,
                                     .n_dest = 1,
                                     .current_id = step,
                                     .transport = KVF_TRANSPORT_TCP,
                                     .peer = addr};
                CHECK_EQ(kvf_submit_task(c, &t), 0);
                publish(step);
                expect("tcp: block beyond a peer's cache", id, KVF_STATUS_BLOCK_RANGE, "65");
                struct kvf_event ev;
                do {
                        int rc = kvf_poll(dc, &ev, 10000);
                        if (rc != 1) {
                                fprintf(stderr, "tcp block beyond the cache, round %d: the decode engine got no "
                                        "arrival of '%s' in 10 s\n", round, id);
                                exit(1);
                        }
                } while (ev.type != KVF_EVENT_ARRIVAL || strcmp(ev.request_id, id));
                if (ev.status != KVF_STATUS_BLOCK_RANGE) {
                        fprintf(stderr, "tcp block beyond the cache: arrival '%s' %s: %s\n", id,
                                kvf_status_name(ev.status), ev.reason);
                        exit(1);
                }
                printf("  %-34s -> arrival %-14s \"%s\"\n", "  ...and on the decode side", kvf_status_name(ev.status),
                       ev.reason);
                kvf_detach(c);
                if (round + 1 < ROUNDS) { /* (the last one is stopped at exit) */
                        snprintf(cmd, sizeof(cmd), "%s/tools/kvferry down --instance %s >/dev/null 2>&1",
                                 KVF_SOURCE_DIR, P3);
                        CHECK_EQ(system(cmd), 0);
                }
        }
        kvf_detach(dc);
        c = keep;
}

int main(void)
{
        static const long s3[] = {0, 1, 2}, s4[] = {3, 4, 5, 6}, d3[] = {10, 11, 12},
                          neg[] = {1, -2, 3}, big[] = {0, 1, 100000}, dbig[] = {100000, 1, 2},
                          twice[] = {5, 6, 5};
        long many[80];
        for (int i = 0; i < 80; i++)
                many[i] = i;

        snprintf(P, sizeof(P), "bt%d-p", (int)getpid());
        snprintf(D, sizeof(D), "bt%d-d", (int)getpid());
        snprintf(D2, sizeof(D2), "bt%d-d2", (int)getpid());
        snprintf(DX, sizeof(DX), "bt%d-dx", (int)getpid());
        snprintf(P2, sizeof(P2), "bt%d-p2", (int)getpid());
        snprintf(G5, sizeof(G5), "bt%d-g5", (int)getpid());
        snprintf(GX, sizeof(GX), "bt%d-gx", (int)getpid());
        atexit(stale_cleanup);
        const char *L = "--model llama-3.1-8b --tp 8 --blocks 64";
        /* --device: FastDeploy names an ipc peer by the GPU it serves */
        t_up(D, "--role decode %s --device 5", L);
        t_up(D2, "--role decode %s", L);
        t_up(P2, "--role prefill %s", L);
        t_up(DX, "--role decode --layers 28 --kv-heads 1 --head-dim 128 --blocks 64");
        t_up(P, "--role prefill %s --max-blocks-per-request 64", L);
        CHECK_EQ(kvf_attach(P, 5000, &c), 0);
        printf("bad task table (instance %s):\n", P);

        {
                CHECK_EQ(kvf_submit_raw(c, KVF_TO_SENDER, KVF_REC_TASK, "hello world", 11), 0);
                expect("garbage bytes", "<unknown>", KVF_STATUS_BAD_TASK, "not a msgpack map (found integer)");
                static const uint8_t junk[] = {0xc1, 0x00, 0x17};
                CHECK_EQ(kvf_submit_raw(c, KVF_TO_SENDER, KVF_REC_TASK, junk, sizeof(junk)), 0);
                expect("invalid msgpack byte 0xc1", "<unknown>", KVF_STATUS_BAD_TASK, "invalid byte 0xc1");
                struct pk k;
                pk_init(&k);
                msgpack_pack_array(&k.p, 2);
                str(&k, "request_id");
                str(&k, "x");
                submit_pk(&k);
                expect("array instead of a map", "<unknown>", KVF_STATUS_BAD_TASK, "found array");
        }
        bad("missing request_id", "<unknown>", KVF_STATUS_BAD_TASK, "missing field 'request_id'", NULL,
            s3, 3, d3, 3, "ipc", D, false);
        bad("missing dest_block_ids", "m1", KVF_STATUS_BAD_TASK, "missing field 'dest_block_ids'", "m1",
            s3, 3, NULL, -1, "ipc", D, false);
        bad("missing peer", "m2", KVF_STATUS_BAD_TASK, "missing field 'peer'", "m2", s3, 3, d3, 3,
            "ipc", NULL, false);
        bad("current_id is a string", "m3", KVF_STATUS_BAD_TASK,
            "field 'current_id' must be a non-negative integer, found string", "m3", s3, 3, d3, 3, "ipc",
            D, true);
        bad("negative block id", "m4", KVF_STATUS_BAD_TASK, "field 'src_block_ids'[1] is negative", "m4",
            neg, 3, d3, 3, "ipc", D, false);
        bad("unknown transfer_protocol", "m5", KVF_STATUS_BAD_TASK, "'udp': expected ipc, tcp or rdma",
            "m5", s3, 3, d3, 3, "udp", D, false);
        {
                char longid[201];
                memset(longid, 'a', 200);
                longid[200] = '\0';
                bad("request_id of 200 bytes", "<unknown>", KVF_STATUS_BAD_TASK, "at most 127 allowed",
                    longid, s3, 3, d3, 3, "ipc", D, false);
        }
        bad("empty src_block_ids", "m6", KVF_STATUS_BAD_TASK, "src_block_ids is empty", "m6", s3, 0, d3,
            0, "ipc", D, false);
        bad("more dest than src blocks", "m7", KVF_STATUS_BAD_TASK,
            "dest_block_ids has 4 entries, more than the 3 of src_block_ids", "m7", s3, 3, s4, 4, "ipc",
            D, false);
        bad("more blocks than the limit", "m8", KVF_STATUS_BAD_TASK, "limit of 64 blocks per request",
            "m8", many, 80, many, 80, "ipc", D, false);
        bad("src block id out of range", "m9", KVF_STATUS_BLOCK_RANGE,
            "src_block_ids[2] = 100000 is out of range: this instance has 64 blocks", "m9", big, 3, d3,
            3, "ipc", D, false);
        bad("dest block id out of range", "m10", KVF_STATUS_BLOCK_RANGE,
            "dest_block_ids[0] = 100000 is out of range", "m10", s3, 3, dbig, 3, "ipc", D, false);
        bad("dest block named twice", "m11", KVF_STATUS_BAD_TASK, "names block 5 twice", "m11", s3, 3,
            twice, 3, "ipc", D, false);
        bad("unknown peer", "m12", KVF_STATUS_UNKNOWN_PEER, "no instance 'nosuch-peer' on this host",
            "m12", s3, 3, d3, 3, "ipc", "nosuch-peer", false);
        /* a name no instance can have: unknown, as over tcp (it was a connection error, which
         * an engine would retry) */
        bad("peer name no instance can have", "m12b", KVF_STATUS_UNKNOWN_PEER,
            "instance name 'bad name!': only letters", "m12b", s3, 3, d3, 3, "ipc", "bad name!", false);
        bad("peer layout mismatch", "m13", KVF_STATUS_LAYOUT_MISMATCH, "32 layers here, 28 there", "m13",
            s3, 3, d3, 3, "ipc", DX, false);
        bad("peer is this instance", "m14", KVF_STATUS_BAD_TASK, "is this instance itself", "m14", s3, 3,
            d3, 3, "ipc", P, false);
        bad("ipc peer at an address nobody has", "m15", KVF_STATUS_UNKNOWN_PEER,
            "no decode instance of this host listens on 127.0.0.1:1", "m15", s3, 3, d3, 3, "ipc",
            "127.0.0.1:1", false);
        bad("ipc peer at another host's address", "m15b", KVF_STATUS_UNKNOWN_PEER,
            "192.0.2.1 is not an address of this host", "m15b", s3, 3, d3, 3, "ipc", "192.0.2.1:7000",
            false);
        /* rdma is the connector's to refuse: this decode instance listens on loopback, where
         * no rdma device is (or this build has no rdma at all). */
        bad("rdma to a peer without rdma", "m16", KVF_STATUS_CONNECTION, "rdma", "m16", s3, 3, d3, 3, "rdma",
            D, false);
        /* Only an instance that receives may be written into. */
        bad("peer is a prefill instance (ipc)", "m17", KVF_STATUS_PEER_ROLE, "is a prefill instance", "m17",
            s3, 3, d3, 3, "ipc", P2, false);
        {
                char addr[128];
                t_connector_addr(P2, addr, sizeof(addr));
                bad("peer is a prefill instance (tcp)", "m18", KVF_STATUS_PEER_ROLE, "is a prefill instance",
                    "m18", s3, 3, d3, 3, "tcp", addr, false);
                /* ...and that prefill instance's engine never hears of them. */
                struct kvf_client *c2;
                struct kvf_event ev;
                CHECK_EQ(kvf_attach(P2, 5000, &c2), 0);
                CHECK_EQ(kvf_poll(c2, &ev, 500), 0);
                kvf_detach(c2);
        }
        /* FastDeploy's ipc task: the peer named by device_ids[rank] or by ip + port of
         * this host, numbers as strings, the request id as bytes (echoed back). The dest
         * ids are out of range on purpose: the message names the instance it resolved. */
        {
                static const long dev5[] = {5}, dev9[] = {9}, devnone[] = {4294967295};
                struct pk k;
                fd_task(&k, "fd-dev", true, dbig, 3, dev5, 1, NULL, 0, false, -1);
                submit_pk(&k);
                char want[96];
                snprintf(want, sizeof(want), "peer '%s' has 64 blocks", D);
                expect("ipc peer by device_ids (id as bin)", "fd-dev", KVF_STATUS_BLOCK_RANGE, want);
                fd_task(&k, "fd-nodev", false, d3, 3, dev9, 1, NULL, 0, false, -1);
                submit_pk(&k);
                expect("ipc peer by an unused device", "fd-nodev", KVF_STATUS_UNKNOWN_PEER,
                       "no decode instance on this host uses device 9");
                /* This instance is rank 0: a list without entry 0 names no peer. */
                fd_task(&k, "fd-devs0", false, d3, 3, NULL, 0, NULL, 0, false, -1);
                submit_pk(&k);
                expect("device_ids, none for this rank", "fd-devs0", KVF_STATUS_BAD_TASK,
                       "field 'device_ids' has 0 entries, none for rank 0");
                /* 2^32 - 1 is what an instance without --device (DX) says it uses. */
                fd_task(&k, "fd-devnone", false, d3, 3, devnone, 1, NULL, 0, false, -1);
                submit_pk(&k);
                expect("device_ids [4294967295]", "fd-devnone", KVF_STATUS_BAD_TASK,
                       "field 'device_ids'[0] = 4294967295 is not a device (0 to 65535)");
                /* Segments of killed instances: one beside D on its device, one alone on a
                 * device no other test's instance uses. Neither is a peer. */
                const long gdev[] = {1000 + getpid() % 60000};
                stale_segment(G5, 5);
                stale_segment(GX, (uint32_t)gdev[0]);
                fd_task(&k, "fd-dev-stale", false, dbig, 3, dev5, 1, NULL, 0, false, -1);
                submit_pk(&k);
                expect("device_ids, a dead instance beside D", "fd-dev-stale", KVF_STATUS_BLOCK_RANGE,
                       want);
                fd_task(&k, "fd-dead", false, d3, 3, gdev, 1, NULL, 0, false, -1);
                submit_pk(&k);
                char dead[128];
                snprintf(dead, sizeof(dead), "(instance '%s' does, but it is not running)", GX);
                expect("device_ids of a dead instance only", "fd-dead", KVF_STATUS_UNKNOWN_PEER,
                       dead);
                char host[64];
                uint32_t port = 0;
                struct kvf_ctl dc;
                CHECK_EQ(kvf_ctl_attach(D, false, &dc), 0);
                CHECK_EQ(kvf_connector_info_read(&dc, host, sizeof(host), &port), 0);
                kvf_ctl_detach(&dc);
                fd_task(&k, "fd-ip", false, dbig, 3, NULL, -1, "127.0.0.1", port, true, -1);
                submit_pk(&k);
                expect("ipc peer by ip + rdma_ports (strings)", "fd-ip", KVF_STATUS_BLOCK_RANGE, want);
                /* port and rdma_ports may both come: equal, one peer; else none, whatever
                 * their order in the map (rdma_ports, naming D, comes last). */
                fd_task(&k, "fd-ports", false, dbig, 3, NULL, -1, "127.0.0.1", port, false, port);
                submit_pk(&k);
                expect("port and rdma_ports, equal", "fd-ports", KVF_STATUS_BLOCK_RANGE, want);
                fd_task(&k, "fd-ports2", false, dbig, 3, NULL, -1, "127.0.0.1", port, false, 1);
                submit_pk(&k);
                expect("port and rdma_ports that disagree", "fd-ports2", KVF_STATUS_BAD_TASK,
                       "fields 'port' (1) and 'rdma_ports'[0]");
        }
        /* Engine bugs are refused at once, never left to time out. */
        {
                uint32_t cs[3] = {0, 1, 2}, cd[3] = {30, 31, 32};
                uint64_t far = kvf_last_step(c) + 1000;
                struct kvf_task ct = {.request_id = "chunky", .src_block_ids = cs, .n_src = 3,
                                      .dest_block_ids = cd, .n_dest = 3, .current_id = far,
                                      .transport = KVF_TRANSPORT_IPC, .peer = D, .chunked = 1};
                CHECK_EQ(kvf_submit_task(c, &ct), 0);
                CHECK_EQ(kvf_submit_chunk(c, "chunky", far + 10, 64, 0), 0);
                CHECK_EQ(kvf_submit_chunk(c, "chunky", far + 5, 128, 0), 0);
                expect("chunk whose step goes backwards", "chunky", KVF_STATUS_BAD_TASK,
                       "chunk for step");
                uint64_t now = kvf_last_step(c) + 1;
                CHECK_EQ(kvf_layer_done(c, now + 1, 0), 0);
                CHECK_EQ(kvf_layer_done(c, now, 3), -EINVAL);
                CHECK(strstr(kvf_last_error(), "steps only grow") != NULL);
                CHECK_EQ(kvf_layer_done(c, now + 1, 0), 0); /* a repeat is fine */
                printf("  %-34s -> %-22s \"%s\"\n", "layer-done for an earlier step", "-EINVAL",
                       kvf_last_error());
        }

        /* Duplicate request id: the first is in flight (its step is far away). */
        {
                struct pk k;
                task(&k, "dup", s3, 3, d3, 3, "ipc", D, false);
                submit_pk(&k);
                task(&k, "dup", s4, 4, d3, 3, "ipc", D, false);
                submit_pk(&k);
                expect("duplicate request_id", "dup", KVF_STATUS_BAD_TASK,
                       "duplicate request_id 'dup': a request with this id is in flight");
                CHECK_EQ(kvf_submit_cancel(c, "dup"), 0);
                expect("cancel of the first one", "dup", KVF_STATUS_CANCELLED, "cancelled by the engine");
        }
        double_booking();
        reasons_as_text();

        /* Records that have no completion to give: counted and logged, nothing else. */
        struct kvf_ctl ctl;
        CHECK_EQ(kvf_ctl_attach(P, false, &ctl), 0);
        uint64_t bad_before = ctl.counters[KVF_CTR_BAD_RECORDS].value;
        CHECK_EQ(kvf_submit_raw(c, KVF_TO_SENDER, 8, "\x80", 1), 0);
        CHECK_EQ(kvf_submit_cancel(c, "never-submitted"), 0);
        {
                struct pk k;
                pk_init(&k);
                msgpack_pack_map(&k.p, 1);
                str(&k, "request_id");
                msgpack_pack_uint64(&k.p, 5);
                CHECK_EQ(kvf_submit_raw(c, KVF_TO_SENDER, KVF_REC_CHUNK, k.sb.data, k.sb.size), 0);
                msgpack_sbuffer_destroy(&k.sb);
        }

        /* A good request still finishes. */
        uint64_t step = kvf_last_step(c) + 1;
        uint32_t src[3] = {7, 8, 9}, dst[2] = {20, 21};
        struct kvf_task t = {.request_id = "good", .src_block_ids = src, .n_src = 3,
                             .dest_block_ids = dst, .n_dest = 2, .current_id = step,
                             .transport = KVF_TRANSPORT_IPC, .peer = D};
        CHECK_EQ(kvf_submit_task(c, &t), 0);
        struct kvf_layout_info li;
        kvf_get_layout(c, &li);
        for (uint32_t l = 0; l < li.num_layers; l++)
                CHECK_EQ(kvf_layer_done(c, step, l), 0);
        expect("a good request after all of them", "good", KVF_STATUS_FINISHED, "");
        uint64_t t0 = kvf_now_ns();
        while (ctl.counters[KVF_CTR_BAD_RECORDS].value < bad_before + 2 && kvf_now_ns() - t0 < 5000000000ull)
                usleep(10000);
        CHECK_EQ(ctl.counters[KVF_CTR_BAD_RECORDS].value, bad_before + 2);
        /* Every case above but the four whose task was accepted first (the chunk, the
         * duplicate's original) or never became a task: exactly the rejected ones. */
        CHECK_EQ(ctl.counters[KVF_CTR_TASKS_REJECTED].value, (uint64_t)rejected);
        kvf_ctl_detach(&ctl);

        /* Connect tasks with a bad peer get an answer too. */
        CHECK_EQ(kvf_submit_connect(c, "c1", "nosuch-peer"), 0);
        CHECK_EQ(kvf_submit_connect(c, "c2", "127.0.0.1:1"), 0);
        CHECK_EQ(kvf_submit_connect(c, "c3", D), 0);
        int got = 0;
        while (got < 3) {
                struct kvf_event ev;
                CHECK_EQ(kvf_poll(c, &ev, 10000), 1);
                if (ev.type != KVF_EVENT_CONNECT_RESULT)
                        continue;
                printf("  connect %-26s -> %-22s \"%s\"\n", ev.peer, kvf_status_name(ev.status), ev.reason);
                if (!strcmp(ev.request_id, "c1"))
                        CHECK(ev.status == KVF_STATUS_UNKNOWN_PEER && strstr(ev.reason, "no instance 'nosuch-peer'"));
                else if (!strcmp(ev.request_id, "c2"))
                        CHECK(ev.status == KVF_STATUS_CONNECTION && strstr(ev.reason, "connect to 127.0.0.1:1"));
                else
                        CHECK(ev.status == KVF_STATUS_FINISHED);
                got++;
        }

        /* A new engine session may not use the steps of the one before: their layers count as
         * done, and its blocks would go as they are, unwritten by it. The session it took over
         * publishes nothing more, and its detach leaves the new one alone. */
        {
                uint64_t last = kvf_last_step(c);
                struct kvf_client *old = c;
                CHECK_EQ(kvf_attach(P, 5000, &c), 0);
                CHECK_EQ(kvf_layer_done(old, last + 1, 0), -ESTALE);
                CHECK(strstr(kvf_last_error(), "ended (session") != NULL);
                printf("  %-34s -> %-22s \"%s\"\n", "layer-done of a session taken over", "-ESTALE",
                       kvf_last_error());
                kvf_detach(old);
                uint32_t s1[2] = {40, 41}, d1[2] = {40, 41};
                struct kvf_task ot = {.request_id = "old-step", .src_block_ids = s1, .n_src = 2,
                                      .dest_block_ids = d1, .n_dest = 2, .current_id = last,
                                      .transport = KVF_TRANSPORT_IPC, .peer = D};
                CHECK_EQ(kvf_submit_task(c, &ot), -EINVAL);
                CHECK(strstr(kvf_last_error(), "published by an earlier engine session") != NULL);
                printf("  %-34s -> %-22s \"%s\"\n", "task for an earlier session's step", "-EINVAL",
                       kvf_last_error());
                CHECK_EQ(kvf_layer_done(c, last, 0), -EINVAL);
                CHECK_EQ(kvf_submit_chunk(c, "old-step", last, 64, 0), -EINVAL);
                /* The same as raw records, which only the sender checks. */
                struct pk k;
                pk_init(&k);
                msgpack_pack_map(&k.p, 6);
                str(&k, "request_id");
                str(&k, "old-step-raw");
                str(&k, "transfer_protocol");
                str(&k, "ipc");
                str(&k, "src_block_ids");
                ids(&k, (const long[]){40, 41}, 2);
                str(&k, "dest_block_ids");
                ids(&k, (const long[]){40, 41}, 2);
                str(&k, "current_id");
                msgpack_pack_uint64(&k.p, last);
                str(&k, "peer");
                str(&k, D);
                submit_pk(&k);
                expect("raw task, an earlier session's step", "old-step-raw", KVF_STATUS_BAD_TASK,
                       "published by an earlier engine session");
                struct kvf_task ct = {.request_id = "old-chunk", .src_block_ids = s1, .n_src = 2,
                                      .dest_block_ids = d1, .n_dest = 2, .current_id = last + 1,
                                      .transport = KVF_TRANSPORT_IPC, .peer = D, .chunked = 1};
                CHECK_EQ(kvf_submit_task(c, &ct), 0);
                pk_init(&k);
                msgpack_pack_map(&k.p, 3);
                str(&k, "request_id");
                str(&k, "old-chunk");
                str(&k, "current_id");
                msgpack_pack_uint64(&k.p, last);
                str(&k, "tokens_done");
                msgpack_pack_uint64(&k.p, 64);
                CHECK_EQ(kvf_submit_raw(c, KVF_TO_SENDER, KVF_REC_CHUNK, k.sb.data, k.sb.size), 0);
                msgpack_sbuffer_destroy(&k.sb);
                expect("raw chunk, an earlier session's step", "old-chunk", KVF_STATUS_BAD_TASK,
                       "chunk for step");
                /* The new session's own steps work. */
                struct kvf_task nt = ot;
                nt.request_id = "new-step";
                nt.current_id = last + 1;
                CHECK_EQ(kvf_submit_task(c, &nt), 0);
                struct kvf_layout_info nl;
                kvf_get_layout(c, &nl);
                for (uint32_t l = 0; l < nl.num_layers; l++)
                        CHECK_EQ(kvf_layer_done(c, last + 1, l), 0);
                expect("the new session's own step", "new-step", KVF_STATUS_FINISHED, "");
        }
        block_reuse(L);
        tcp_block_beyond_unknown_size(L);
        kvf_detach(c);
        printf("bad_tasks_test: %d cases, each with its status and message; the good request finished\n", ncase);
        return 0;
}
