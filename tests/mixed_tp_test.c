/*
 * Same-host (ipc) transfers between tensor-parallel groups of different sizes:
 * real instances (tools/kvferry up --tp T --rank R --nranks T), each prefill
 * rank's cache filled with content defined per (request, head, token, layer,
 * tensor), one task per (prefill rank, decode rank it sends to) as the split
 * says (common/tpsplit.h), and then every byte of every head of every block
 * on every decode rank checked. Mismatched splits are refused with both
 * layouts in the reason.
 *
 * mixed_tp_test P D HEADS [key-only] [tcp|both] [staged] [bs=P/D] [table=N]   a transfer, every byte
 *                                      checked (both: over ipc, then over tcp on the same
 *                                      instances; bs=P/D: P tokens per prefill block, D per
 *                                      decode block, tokens regrouped, over ipc or tcp; tcp:
 *                                      over the connectors' tcp data connections, frames of head
 *                                      slices; staged: caches on the host-async backend, whose
 *                                      frames go through staging memory as a GPU cache's do;
 *                                      table=N: N request slots on each prefill rank, fewer than
 *                                      its tasks: they wait for slots, counted, and all finish)
 * mixed_tp_test mismatch               the refusals
 * mixed_tp_test kill P D HEADS [tcp] [bs=P/D]   decode rank D-1 goes down mid-transfer: every
 *                                      task has exactly one completion, those to the other ranks
 *                                      finish (tcp: over the connectors; bs: tokens regrouped)
 * $MIXED_TP_REQUESTS sets the requests (default 12); the summary line gives the time from the
 * first layer-done to the last completion (bench/mixed_tp_bench.sh reads it): with
 * $MIXED_TP_WARMUP set, of a second pass (the first untimed); with $MIXED_TP_PASSES=N, the
 * median of N timed passes, each verified.
 */
#include <inttypes.h>
#include <msgpack.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "instances.h"
#include "kvferry.h"
#include "layout.h"
#include "tpsplit.h"

#define MAXR 8
#define NREQ_MAX 512
static uint32_t HDIM = 32; /* $MIXED_TP_HEAD_DIM */
static const char *BACKEND = ""; /* "staged": both sides' caches on the host-async backend */
/* The prefill ranks' request table (--max-requests; table=N): a rank takes a slot per task, so
 * one per decode rank it sends to. Smaller than its tasks, they wait in the ring as slots free. */
static uint32_t TABLE = 2100;
#define BSIZE 16
static uint32_t BP = BSIZE, BD = BSIZE; /* tokens per block: prefill, decode (bs=P/D) */
#define DMAX 64 /* destination blocks of a request at most */
#define LAYERS 3

static uint8_t content(uint32_t req, uint32_t head, uint32_t token, uint32_t y, uint32_t l,
                       uint32_t z)
{
        uint32_t x = req * 2246822519u ^ head * 2654435761u ^ token * 40503u ^ y * 97u ^ l * 7919u ^
                     z * 104729u;
        x ^= x >> 15;
        x *= 2246822519u;
        return (uint8_t)(x ^ x >> 13);
}

struct side {
        char name[MAXR][64];
        struct kvf_client *c[MAXR];
        struct kvf_layout_info L[MAXR];
        uint32_t first[MAXR], count[MAXR];
};

static void start_with(struct side *s, const char *tag, const char *role, uint32_t tp,
                       uint32_t heads, int key_only, uint32_t hdim, uint32_t bsize, uint32_t blocks)
{
        for (uint32_t k = 0; k < tp; k++) {
                snprintf(s->name[k], sizeof(s->name[k]), "mtp%d%s%u", (int)getpid(), tag, k);
                t_up_start(s->name[k],
                     "--role %s --layers %d --kv-heads %u --head-dim %u --dtype bf16 %s --tp %u "
                     "--rank %u --nranks %u --block-size %u --blocks %u --max-requests %u %s",
                     role, LAYERS, heads, hdim, key_only ? "--key-only" : "", tp, k, tp, bsize,
                     blocks, strcmp(role, "prefill") ? 2100 : TABLE, BACKEND);
        }
        t_up_wait();
}

static void start(struct side *s, const char *tag, const char *role, uint32_t tp, uint32_t heads,
                  int key_only, uint32_t blocks)
{
        start_with(s, tag, role, tp, heads, key_only, HDIM, strcmp(role, "prefill") ? BD : BP,
                   blocks);
        for (uint32_t k = 0; k < tp; k++) {
                CHECK_EQ(kvf_attach(s->name[k], 10000, &s->c[k]), 0);
                CHECK_EQ(kvf_get_layout(s->c[k], &s->L[k]), 0);
                CHECK_EQ(kvf_tp_heads(key_only ? 1 : heads, tp, k, &s->first[k], &s->count[k]), 0);
                CHECK_EQ(s->L[k].kv_heads, s->count[k]);
        }
}

/* Detach every client of a side still attached (a sanitizer build counts the rest as leaks). */
static void detach_all(struct side *s)
{
        for (uint32_t k = 0; k < sizeof(s->c) / sizeof(s->c[0]); k++)
                if (s->c[k]) {
                        kvf_detach(s->c[k]);
                        s->c[k] = NULL;
                }
}

/* Copy runs of one task (every layer and tensor) from prefill rank i to decode rank j: the
 * split's pieces of each source block that land in one of its ndst destination blocks, as
 * sender/copies.c makes them (whole blocks when the plan is one whole block). */
static uint64_t task_runs(const struct side *P, uint32_t p, uint32_t i, const struct side *D,
                          uint32_t d, uint32_t j, uint32_t heads, int key_only, uint32_t nsrc,
                          uint32_t ndst, uint32_t tensors)
{
        struct kvf_cache_layout pl, dl;
        struct kvf_tp_plan plan;
        CHECK_EQ(kvf_layout_make(&pl, LAYERS, 0, 64, P->count[i], BP, HDIM, KVF_DTYPE_BF16,
                                 (uint32_t)key_only),
                 0);
        CHECK_EQ(kvf_layout_make(&dl, LAYERS, 0, 64, D->count[j], BD, HDIM, KVF_DTYPE_BF16,
                                 (uint32_t)key_only),
                 0);
        CHECK_EQ(kvf_tp_plan(&pl, p, i, &dl, d, j, heads, &plan), 0);
        uint64_t n = 0;
        for (uint32_t b = 0; b < nsrc; b++)
                for (uint32_t x = 0; x < plan.npieces; x++)
                        n += plan.pieces[x].sblk == b % plan.src_per_group &&
                             b / plan.src_per_group * plan.dst_per_group + plan.pieces[x].dblk <
                                 ndst;
        kvf_tp_plan_free(&plan);
        return n * LAYERS * tensors;
}

static uint8_t *at(struct kvf_client *c, const struct kvf_layout_info *L, uint32_t l, uint32_t z,
                   uint32_t block, uint32_t h, uint32_t t)
{
        uint8_t *base = kvf_cache_tensor(c, l, (int)z);
        CHECK(base);
        return base + (uint64_t)block * L->block_bytes +
               ((uint64_t)h * L->block_size + t) * HDIM * 2;
}

static struct kvf_event wait_event(struct kvf_client *c, int type)
{
        struct kvf_event ev;
        for (;;) {
                int rc = kvf_poll(c, &ev, 20000);
                CHECK(rc == 1);
                if (ev.type == type)
                        return ev;
        }
}

/* Prefill instance client c connects to decode peer `peer` (host:port) and hears it is up: its
 * connector then told the sender the peer's block size (tokens regrouped over tcp). */
static void connect_to(struct kvf_client *c, const char *peer)
{
        char id[160];
        snprintf(id, sizeof(id), "connect-%s", peer);
        CHECK_EQ(kvf_submit_connect(c, id, peer), 0);
        for (;;) {
                struct kvf_event ev = wait_event(c, KVF_EVENT_CONNECT_RESULT);
                if (strcmp(ev.request_id, id))
                        continue;
                if (ev.status != KVF_STATUS_FINISHED) {
                        fprintf(stderr, "connect to %s: %s: %s\n", peer, kvf_status_name(ev.status),
                                ev.reason);
                        exit(1);
                }
                return;
        }
}

/* The completion of a task of ns source blocks and nd destination blocks from prefill instance
 * `from` to decode instance `to` (over tcp, to its connector's address; `connect`: connected
 * first, so that the sender knows the peer's block size). */
static struct kvf_event one_task(const char *from, const char *to, int transport, uint32_t ns,
                                 uint32_t nd, bool connect)
{
        struct kvf_client *c;
        char peer[128];
        CHECK_EQ(kvf_attach(from, 10000, &c), 0);
        snprintf(peer, sizeof(peer), "%s", to);
        if (transport == KVF_TRANSPORT_TCP) {
                t_connector_addr(to, peer, sizeof(peer));
                if (connect)
                        connect_to(c, peer);
        }
        uint32_t sb[4] = {3, 4, 5, 6}, db[4] = {7, 9, 11, 13};
        CHECK(ns <= 4 && nd <= 4);
        struct kvf_task t = {.request_id = "refused",
                             .src_block_ids = sb,
                             .n_src = ns,
                             .dest_block_ids = db,
                             .n_dest = nd,
                             .current_id = kvf_last_step(c) + 1,
                             .transport = transport,
                             .peer = peer};
        CHECK_EQ(kvf_submit_task(c, &t), 0);
        CHECK_EQ(kvf_layer_done(c, t.current_id, LAYERS - 1), 0);
        struct kvf_event ev = wait_event(c, KVF_EVENT_COMPLETION);
        kvf_detach(c);
        return ev;
}

/* A task of ns source blocks and nd destination blocks from prefill instance `from` to decode
 * instance `to` ends with `status` and a reason that holds `needle`. */
static void refused_as(const char *from, const char *to, int transport, const char *needle,
                       uint32_t ns, uint32_t nd, int status)
{
        /* a bad task for a peer's block size: the sender must know it (connected) */
        struct kvf_event ev = one_task(from, to, transport, ns, nd, status == KVF_STATUS_BAD_TASK);
        if (ev.status != status || !strstr(ev.reason, needle)) {
                fprintf(stderr, "%s -> %s: %s: \"%s\", wanted %s with \"%s\"\n", from, to,
                        kvf_status_name(ev.status), ev.reason, kvf_status_name(status), needle);
                exit(1);
        }
        printf("refused as it should be: %s -> %s: %s\n", from, to, ev.reason);
}

static void refused(const char *from, const char *to, int transport, const char *needle)
{
        refused_as(from, to, transport, needle, 1, 1, KVF_STATUS_LAYOUT_MISMATCH);
}

/*
 * Over tcp to a peer whose block size the sender does not know yet (never reached): a task with
 * more destination blocks than source blocks is regrouped, its counts checked by the connector
 * once it knows the size (a wrong count refused there, naming both sizes; a right one finishes).
 * Then the peer goes down and another instance, of another block size, comes up at its address:
 * the size learnt before is forgotten with the peer's going down, so a task for the new one's
 * equal blocks finishes (tried for up to 10 s, as the prefill side may hear of the restart late),
 * never refused for the old size for good.
 */
static void unknown_block_size(const char *from)
{
        char name[64], addr[128];
        snprintf(name, sizeof(name), "mtp%dh", (int)getpid());
        const char *args = "--role decode --layers %d --kv-heads 8 --head-dim %u --dtype bf16 --tp 2 "
                           "--rank 0 --nranks 2 --block-size %u --blocks 64 %s";
        t_up(name, args, LAYERS, HDIM, BSIZE / 2, "");
        t_connector_addr(name, addr, sizeof(addr));
        /* 1 source block of 16 tokens fills 1 to 2 blocks of 8: 3 is wrong, 2 right */
        refused_as(from, name, KVF_TRANSPORT_TCP, "3 destination blocks of 8 tokens for 1 source blocks of 16",
                   1, 3, KVF_STATUS_LAYOUT_MISMATCH);
        refused_as(from, name, KVF_TRANSPORT_TCP, "", 1, 2, KVF_STATUS_FINISHED);
        char cmd[512], listen[160];
        snprintf(cmd, sizeof(cmd), "%s/tools/kvferry down --instance %s >/dev/null 2>&1", KVF_SOURCE_DIR, name);
        CHECK_EQ(system(cmd), 0);
        snprintf(listen, sizeof(listen), "--listen %s", addr);
        t_up(name, args, LAYERS, HDIM, BSIZE, listen);
        uint64_t until = kvf_now_ns() + 10000000000ull;
        unsigned tries = 0;
        for (;; tries++) {
                struct kvf_event ev = one_task(from, name, KVF_TRANSPORT_TCP, 1, 1, false);
                if (ev.status == KVF_STATUS_FINISHED)
                        break;
                printf("try %u: %s: %s\n", tries, kvf_status_name(ev.status), ev.reason);
                if (kvf_now_ns() > until) {
                        fprintf(stderr, "%s -> %s restarted with equal blocks: %s: \"%s\"\n", from, addr,
                                kvf_status_name(ev.status), ev.reason);
                        exit(1);
                }
                usleep(200000);
        }
        printf("a peer restarted with another block size at its address: its equal blocks taken\n");
}

/* An ipc task whose decode_tp_size is not the peer's group: refused, naming both. */
static void refused_tp(const char *from, const char *to, unsigned decode_tp)
{
        struct kvf_client *c;
        msgpack_sbuffer sb;
        msgpack_packer pk;
        CHECK_EQ(kvf_attach(from, 10000, &c), 0);
        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_map(&pk, 7);
#define KEY(k) msgpack_pack_str_with_body(&pk, k, strlen(k))
        KEY("request_id");
        KEY("tp-refused");
        KEY("src_block_ids");
        msgpack_pack_array(&pk, 1);
        msgpack_pack_uint32(&pk, 3);
        KEY("dest_block_ids");
        msgpack_pack_array(&pk, 1);
        msgpack_pack_uint32(&pk, 3);
        KEY("current_id");
        msgpack_pack_uint64(&pk, kvf_last_step(c) + 1);
        KEY("transfer_protocol");
        KEY("ipc");
        KEY("peer");
        KEY(to);
        KEY("decode_tp_size");
        msgpack_pack_uint32(&pk, decode_tp);
#undef KEY
        CHECK_EQ(kvf_submit_raw(c, KVF_TO_SENDER, KVF_REC_TASK, sb.data, sb.size), 0);
        msgpack_sbuffer_destroy(&sb);
        struct kvf_event ev = wait_event(c, KVF_EVENT_COMPLETION);
        if (ev.status != KVF_STATUS_LAYOUT_MISMATCH || !strstr(ev.reason, "decode_tp_size is")) {
                fprintf(stderr, "decode_tp_size %u: %s: \"%s\"\n", decode_tp,
                        kvf_status_name(ev.status), ev.reason);
                exit(1);
        }
        printf("refused as it should be: %s -> %s: %s\n", from, to, ev.reason);
        kvf_detach(c);
}

static int mismatches(void)
{
        struct side P = {0}, D = {0}, E = {0}, F = {0}, G = {0}, Q = {0};
        start(&P, "p", "prefill", 2, 8, 0, 64); /* 8 heads, 4 per rank */
        start_with(&Q, "q", "decode", 2, 8, 0, HDIM, BSIZE, 64); /* P's own split */
        start(&D, "d", "decode", 8, 8, 0, 64);  /* 8 heads, 1 per rank */
        start_with(&E, "e", "decode", 2, 4, 0, HDIM, BSIZE,
                   64); /* 4 heads, 2 per rank: another model */
        start_with(&F, "f", "decode", 2, 8, 0, HDIM, 24, 64); /* 8 heads, 24 tokens/block */
        start_with(&G, "g", "decode", 2, 8, 0, HDIM, 32, 64); /* 8 heads, 32 tokens/block */
        refused(P.name[0], E.name[0], KVF_TRANSPORT_IPC, "not one split of 8 kv heads");
        refused(P.name[0], F.name[0], KVF_TRANSPORT_IPC,
                "block sizes 16 and 24 do not divide one another");
        /* 16 -> 32 tokens/block: 3 source blocks fill 2 destination blocks, not 1 or 3 */
        refused_as(P.name[0], G.name[0], KVF_TRANSPORT_IPC, "fill 2 to 2 blocks", 3, 1,
                   KVF_STATUS_BAD_TASK);
        refused_as(P.name[0], G.name[0], KVF_TRANSPORT_IPC, "fill 2 to 2 blocks", 3, 3,
                   KVF_STATUS_BAD_TASK);
        refused(P.name[0], D.name[7], KVF_TRANSPORT_IPC, "sends it none of its heads");
        /* equal groups, the other rank: its cache holds heads 4 to 7, not rank 0's */
        refused(P.name[0], Q.name[1], KVF_TRANSPORT_IPC, "between equal groups rank r sends to rank r");
        refused_tp(P.name[0], D.name[0], 4);
        /* Over tcp, at once (the data connection's handshake), not at the request's timeout:
         * a rank that gets none of this rank's heads, and block sizes that do not divide. */
        uint64_t t0 = kvf_now_ns();
        refused(P.name[0], D.name[7], KVF_TRANSPORT_TCP, "sends it none of its heads");
        /* and again: the peer's refusal stands, with its status (no 'connection error') */
        refused(P.name[0], D.name[7], KVF_TRANSPORT_TCP, "sends it none of its heads");
        refused(P.name[1], Q.name[0], KVF_TRANSPORT_TCP, "between equal groups rank r sends to rank r");
        refused(P.name[0], F.name[0], KVF_TRANSPORT_TCP, "block sizes 16 and 24 do not divide");
        /* 16 -> 32 tokens/block over tcp to a peer the sender has not heard of yet: accepted
         * for one block size, then failed by the data connection, which knows the peer's */
        refused(P.name[0], G.name[0], KVF_TRANSPORT_TCP, "accepted for blocks of one size");
        /* 16 -> 32 tokens/block over tcp: the sender knows the peer's block size from its
         * connector (connected first), and checks the counts as over ipc */
        refused_as(P.name[0], G.name[0], KVF_TRANSPORT_TCP, "fill 2 to 2 blocks", 3, 1,
                   KVF_STATUS_BAD_TASK);
        CHECK(kvf_now_ns() - t0 < 10000000000ull);
        unknown_block_size(P.name[0]);
        detach_all(&P), detach_all(&D), detach_all(&E), detach_all(&F), detach_all(&G), detach_all(&Q);
        return 0;
}

/* Decode rank d-1 goes down after layer 0 of 40 requests: every task gets exactly one
 * completion; those to the other decode ranks finish, and those ranks get their arrivals. */
static int kill_one(uint32_t p, uint32_t d, uint32_t heads, int tcp)
{
        struct side P = {0}, D = {0};
        const uint32_t nreq = 40, ndst = 4 * BP / BD; /* 4 whole source blocks */
        CHECK(ndst <= 16);
        start(&D, "d", "decode", d, heads, 0, 16 * nreq);
        start(&P, "p", "prefill", p, heads, 0, 16 * nreq);
        char daddr[MAXR][128];
        for (uint32_t j = 0; j < d; j++) {
                snprintf(daddr[j], sizeof(daddr[j]), "%s", D.name[j]);
                if (tcp) {
                        t_connector_addr(D.name[j], daddr[j], sizeof(daddr[j]));
                        for (uint32_t i = 0; BP != BD && i < p; i++)
                                connect_to(P.c[i], daddr[j]);
                }
        }
        uint64_t step = 0;
        for (uint32_t i = 0; i < p; i++)
                if (kvf_last_step(P.c[i]) > step)
                        step = kvf_last_step(P.c[i]);
        step++;
        uint32_t tasks[MAXR] = {0}, to_dead[MAXR] = {0};
        for (uint32_t q = 0; q < nreq; q++) {
                uint32_t src[4] = {4 * q, 4 * q + 1, 4 * q + 2, 4 * q + 3}, dst[16];
                for (uint32_t b = 0; b < ndst; b++)
                        dst[b] = 16 * nreq - 1 - ndst * q - b;
                for (uint32_t j = 0; j < d; j++)
                        for (uint32_t i = 0; i < p; i++) {
                                int sends = 0;
                                for (uint32_t h = D.first[j]; h < D.first[j] + D.count[j]; h++)
                                        sends |= kvf_tp_source(heads, p, d, j, h) == i;
                                if (!sends)
                                        continue;
                                char id[64];
                                snprintf(id, sizeof(id), "k%u.d%u", q, j);
                                struct kvf_task t = {.request_id = id,
                                                     .src_block_ids = src,
                                                     .n_src = 4,
                                                     .dest_block_ids = dst,
                                                     .n_dest = ndst,
                                                     .current_id = step,
                                                     .transport = tcp ? KVF_TRANSPORT_TCP
                                                                      : KVF_TRANSPORT_IPC,
                                                     .peer = daddr[j]};
                                CHECK_EQ(kvf_submit_task(P.c[i], &t), 0);
                                tasks[i]++;
                                to_dead[i] += j == d - 1;
                        }
        }
        for (uint32_t i = 0; i < p; i++)
                CHECK_EQ(kvf_layer_done(P.c[i], step, 0), 0);
        kvf_detach(D.c[d - 1]);
        D.c[d - 1] = NULL;
        char cmd[512];
        snprintf(cmd, sizeof(cmd), "%s/tools/kvferry down --instance %s >/dev/null 2>&1",
                 KVF_SOURCE_DIR, D.name[d - 1]);
        CHECK_EQ(system(cmd), 0);
        for (unsigned k = 0; k < t_ninstances; k++) /* down already: not stopped again at exit */
                if (!strcmp(t_names[k], D.name[d - 1])) {
                        memcpy(t_names[k], t_names[--t_ninstances], sizeof(t_names[k]));
                        break;
                }
        for (uint32_t i = 0; i < p; i++)
                for (uint32_t l = 1; l < LAYERS; l++)
                        CHECK_EQ(kvf_layer_done(P.c[i], step, l), 0);
        for (uint32_t i = 0; i < p; i++) {
                uint32_t fin = 0, failed = 0;
                char seen[64 * 40][16];
                for (uint32_t n = 0; n < tasks[i]; n++) {
                        struct kvf_event ev = wait_event(P.c[i], KVF_EVENT_COMPLETION);
                        for (uint32_t k = 0; k < n; k++)
                                if (!strcmp(seen[k], ev.request_id)) {
                                        fprintf(stderr, "prefill rank %u: two completions of %s\n",
                                                i, ev.request_id);
                                        return 1;
                                }
                        snprintf(seen[n], sizeof(seen[n]), "%s", ev.request_id);
                        char dead[16];
                        snprintf(dead, sizeof(dead), ".d%u", d - 1);
                        int to_it = strstr(ev.request_id, dead) != NULL;
                        if (ev.status == KVF_STATUS_FINISHED)
                                fin++;
                        else if (to_it)
                                failed++;
                        else {
                                fprintf(stderr, "prefill rank %u: %s to a live rank: %s: %s\n", i,
                                        ev.request_id, kvf_status_name(ev.status), ev.reason);
                                return 1;
                        }
                }
                struct kvf_event ev;
                CHECK_EQ(kvf_poll(P.c[i], &ev, 1000), 0); /* nothing more */
                printf("prefill rank %u: %u tasks, %u finished, %u to the rank that went down "
                       "failed\n",
                       i, tasks[i], fin, failed);
                CHECK(fin >= tasks[i] - to_dead[i]);
        }
        for (uint32_t j = 0; j + 1 < d; j++)
                for (uint32_t n = 0; n < nreq * kvf_tp_sources(heads, p, d, j); n++) {
                        struct kvf_event ev = wait_event(D.c[j], KVF_EVENT_ARRIVAL);
                        CHECK_EQ(ev.status, KVF_STATUS_FINISHED);
                }
        detach_all(&P), detach_all(&D);
        return 0;
}

int main(int argc, char **argv)
{
        if (argc == 2 && !strcmp(argv[1], "mismatch"))
                return mismatches();
        if (argc >= 5 && !strcmp(argv[1], "kill")) {
                int tcp = 0;
                for (int a = 5; a < argc; a++) {
                        if (!strcmp(argv[a], "tcp"))
                                tcp = 1;
                        else if (sscanf(argv[a], "bs=%u/%u", &BP, &BD) == 2)
                                CHECK(BP >= 2 && BD >= 2 && (BP % BD == 0 || BD % BP == 0) &&
                                      4 * BP / BD >= 1 && 4 * BP % BD == 0);
                        else
                                return fprintf(stderr, "mixed_tp_test: unknown option '%s'\n", argv[a]), 2;
                }
                return kill_one((uint32_t)atoi(argv[2]), (uint32_t)atoi(argv[3]),
                                (uint32_t)atoi(argv[4]), tcp);
        }
        if (argc < 4)
                return fprintf(stderr, "usage: mixed_tp_test P D HEADS [key-only] [tcp|both] [staged] [bs=P/D] [table=N]\n"), 2;
        uint32_t p = (uint32_t)atoi(argv[1]), d = (uint32_t)atoi(argv[2]),
                 heads = (uint32_t)atoi(argv[3]);
        int key_only = 0, use_ipc = 1, use_tcp = 0;
        for (int a = 4; a < argc; a++) {
                if (!strcmp(argv[a], "key-only"))
                        key_only = 1;
                else if (!strcmp(argv[a], "tcp"))
                        use_ipc = 0, use_tcp = 1;
                else if (!strcmp(argv[a], "both"))
                        use_ipc = 1, use_tcp = 1;
                else if (sscanf(argv[a], "bs=%u/%u", &BP, &BD) == 2)
                        CHECK(BP >= 2 && BD >= 2 && (BP % BD == 0 || BD % BP == 0) &&
                              (BP > BD ? BP / BD : BD / BP) * 4 <= DMAX);
                else if (!strcmp(argv[a], "staged"))
                        BACKEND = "--backend host-async"; /* tcp frames through staging memory */
                else if (sscanf(argv[a], "table=%u", &TABLE) == 1)
                        CHECK(TABLE >= 1 && TABLE <= 2100);
                else
                        return fprintf(stderr, "mixed_tp_test: unknown option '%s'\n", argv[a]), 2;
        }
        uint32_t H = key_only ? 1 : heads;
        struct side P = {0}, D = {0};
        if (getenv("MIXED_TP_HEAD_DIM"))
                HDIM = (uint32_t)atoi(getenv("MIXED_TP_HEAD_DIM"));
        CHECK(HDIM >= 1 && HDIM <= 1024);
        const char *nr = getenv("MIXED_TP_REQUESTS");
        const uint32_t NREQ = nr ? (uint32_t)atoi(nr) : 12;
        CHECK(NREQ >= 1 && NREQ <= NREQ_MAX);
        /* Request q: nb[q] source blocks (1 to 4) at 2 + 5q.., holding tok[q] tokens (every
         * third request's last block half full); its ndst[q] destination blocks (the decode
         * side's block size) every other block, descending from the top. */
        static uint32_t src[NREQ_MAX][4], dst[NREQ_MAX][DMAX], nb[NREQ_MAX], tok[NREQ_MAX],
            ndst[NREQ_MAX];
        uint32_t dblocks = 16;
        for (uint32_t q = 0; q < NREQ; q++) {
                nb[q] = 1 + q % 4;
                tok[q] = nb[q] * BP - (q % 3 == 1 ? BP / 2 : 0);
                ndst[q] = (tok[q] + BD - 1) / BD;
                dblocks += 2 * ndst[q];
        }
        start(&D, "d", "decode", d, heads, key_only, dblocks);
        start(&P, "p", "prefill", p, heads, key_only, 10 * NREQ + 16);
        /* One round per transport asked for (both: ipc, then tcp, on the same instances); with
         * MIXED_TP_WARMUP set, each round's requests go twice, and only the second pass is timed
         * and printed: the senders have mapped and touched their peers' caches by then, as in a
         * deployment past its first requests (a first pass pays each new mapping's page faults,
         * and a sender that maps more peers pays more of them). */
        const int warmup = getenv("MIXED_TP_WARMUP") ? 1 : 0;
        const int timed = getenv("MIXED_TP_PASSES") ? atoi(getenv("MIXED_TP_PASSES")) : 1;
        CHECK(timed >= 1 && timed <= 15);
        const int passes = warmup + timed;
        uint64_t times[16];
        for (int it = 0; it < 2 * passes; it++) {
                const int round = it / passes, tcp = round == 1, pass = it % passes;
                const bool warm = pass < warmup;
                if (tcp ? !use_tcp : !use_ipc)
                        continue;
                char daddr[MAXR][128];
                for (uint32_t j = 0; j < d; j++) {
                        snprintf(daddr[j], sizeof(daddr[j]), "%s", D.name[j]);
                        if (tcp)
                                t_connector_addr(D.name[j], daddr[j], sizeof(daddr[j]));
                        /* another block size: the sender learns the peer's from its connector */
                        for (uint32_t i = 0; tcp && BP != BD && i < p; i++)
                                connect_to(P.c[i], daddr[j]);
                }
                const uint32_t tensors = key_only ? 1 : 2;
                uint64_t step = 0;
                for (uint32_t i = 0; i < p; i++)
                        if (kvf_last_step(P.c[i]) > step)
                                step = kvf_last_step(P.c[i]);
                step++;

                for (uint32_t q = 0, top = dblocks; q < NREQ; q++) {
                        for (uint32_t b = 0; b < nb[q]; b++)
                                src[q][b] = 2 + 5 * q + b;
                        for (uint32_t b = 0; b < ndst[q]; b++)
                                dst[q][b] = top - 1 - 2 * b;
                        top -= 2 * ndst[q];
                        for (uint32_t i = 0; i < p; i++)
                                for (uint32_t l = 0; l < LAYERS; l++)
                                        for (uint32_t z = 0; z < tensors; z++)
                                                for (uint32_t b = 0; b < nb[q]; b++)
                                                        for (uint32_t h = 0; h < P.count[i]; h++)
                                                                for (uint32_t t = 0; t < BP; t++) {
                                                                        uint8_t *o = at(P.c[i], &P.L[i], l,
                                                                                        z, src[q][b], h, t);
                                                                        for (uint32_t y = 0; y < HDIM * 2;
                                                                             y++)
                                                                                o[y] = content(
                                                                                    q, P.first[i] + h,
                                                                                    b * BP + t, y, l, z);
                                                                }
                        for (uint32_t j = 0; j < d; j++)
                                for (uint32_t l = 0; l < LAYERS; l++)
                                        for (uint32_t z = 0; z < tensors; z++)
                                                for (uint32_t b = 0; b < ndst[q]; b++)
                                                        memset(at(D.c[j], &D.L[j], l, z, dst[q][b], 0, 0),
                                                               0, D.L[j].block_bytes);
                }

                /* One task per (prefill rank, decode rank it sends to); the id names the decode rank. */
                uint32_t tasks[MAXR] = {0}, expect_parts[MAXR] = {0};
                uint64_t src_bytes = 0; /* whole source blocks of every task */
                uint64_t runs = 0; /* copy runs: one per (layer, tensor, block, source) with head slices;
                                    * whole blocks merge only where both sides' ids are consecutive */
                for (uint32_t q = 0; q < NREQ; q++)
                        for (uint32_t j = 0; j < d; j++) {
                                expect_parts[j] = kvf_tp_sources(H, p, d, j);
                                for (uint32_t i = 0; i < p; i++) {
                                        int sends = 0;
                                        for (uint32_t h = D.first[j]; h < D.first[j] + D.count[j]; h++)
                                                sends |= kvf_tp_source(H, p, d, j, h) == i;
                                        if (!sends)
                                                continue;
                                        char id[64];
                                        snprintf(id, sizeof(id), "%d%sq%u.d%u", pass, tcp ? "t" : "", q, j);
                                        struct kvf_task t = {.request_id = id,
                                                             .src_block_ids = src[q],
                                                             .n_src = nb[q],
                                                             .dest_block_ids = dst[q],
                                                             .n_dest = ndst[q],
                                                             .current_id = step,
                                                             .transport = tcp ? KVF_TRANSPORT_TCP
                                                                              : KVF_TRANSPORT_IPC,
                                                             .peer = daddr[j]};
                                        CHECK_EQ(kvf_submit_task(P.c[i], &t), 0);
                                        tasks[i]++;
                                        src_bytes += (uint64_t)nb[q] * LAYERS * tensors * P.L[i].block_bytes;
                                        runs += task_runs(&P, p, i, &D, d, j, H, key_only, nb[q], ndst[q],
                                                          tensors);
                                }
                        }
                uint64_t t0 = kvf_now_ns();
                for (uint32_t i = 0; i < p; i++)
                        for (uint32_t l = 0; l < LAYERS; l++)
                                CHECK_EQ(kvf_layer_done(P.c[i], step, l), 0);
                uint64_t bytes = 0;
                for (uint32_t i = 0; i < p; i++)
                        for (uint32_t n = 0; n < tasks[i]; n++) {
                                struct kvf_event ev = wait_event(P.c[i], KVF_EVENT_COMPLETION);
                                if (ev.status != KVF_STATUS_FINISHED) {
                                        fprintf(stderr, "prefill rank %u: %s: %s: %s\n", i, ev.request_id,
                                                kvf_status_name(ev.status), ev.reason);
                                        return 1;
                                }
                                bytes += ev.bytes;
                        }
                uint64_t elapsed = kvf_now_ns() - t0;
                /* A table smaller than a rank's tasks: they waited for slots, and say so. */
                for (uint32_t i = 0; i < p; i++)
                        if (tasks[i] > TABLE) {
                                int64_t held = t_counter(P.name[i], KVF_CTR_TASKS_HELD_BACK);
                                CHECK(held >= 1);
                                if (pass == 0)
                                        printf("prefill rank %u: %u tasks through a table of %u slots, "
                                               "%" PRId64 " held back until slots freed, all finished\n",
                                               i, tasks[i], TABLE, held);
                        }
                if (getenv("MIXED_TP_WINDOW") && !warm) /* for a profile of the window (perf -k CLOCK_MONOTONIC) */
                        fprintf(stderr, "window %" PRIu64 ".%06" PRIu64 ",%" PRIu64 ".%06" PRIu64 "\n",
                                t0 / 1000000000, t0 % 1000000000 / 1000, (t0 + elapsed) / 1000000000,
                                (t0 + elapsed) % 1000000000 / 1000);
                /* Completions count each byte once: every decode rank's heads of every block. (Over
                 * tcp the sender does not know the peer's split, and counts whole source blocks.) */
                uint64_t want = 0;
                for (uint32_t q = 0; q < NREQ; q++)
                        for (uint32_t j = 0; j < d; j++)
                                for (uint32_t b = 0; b < ndst[q]; b++) {
                                        /* the destination block's tokens some source block holds */
                                        uint32_t in = nb[q] * BP - b * BD < BD ? nb[q] * BP - b * BD : BD;
                                        want += (uint64_t)LAYERS * tensors * D.L[j].block_bytes / BD * in;
                                }
                CHECK_EQ(bytes, tcp ? src_bytes : want);
                /* Over tcp, the frames carried exactly the decode ranks' heads: the prefill
                 * connectors' byte counters. A frame sent on a data connection that was lost
                 * goes again (bytes_resent_tcp counts it the second time): the bytes sent are at
                 * least the heads, and exactly the heads once the resent bytes are taken out. */
                uint64_t frames = 0;
                if (tcp) {
                        /* A data connection counts a batch once its sends are reaped, which
                         * may be after the arrival and the completion: wait for the counters
                         * (20 s at most), then they must be exactly the heads. */
                        uint64_t sent = 0, again = 0, until = kvf_now_ns() + 20000000000ull;
                        for (;;) {
                                sent = frames = again = 0;
                                for (uint32_t i = 0; i < p; i++) {
                                        sent += (uint64_t)t_counter(P.name[i], KVF_CTR_BYTES_TCP);
                                        again += (uint64_t)t_counter(P.name[i], KVF_CTR_BYTES_TCP_RESENT);
                                        frames += (uint64_t)t_counter(P.name[i], KVF_CTR_FRAMES_TCP);
                                }
                                if (sent - again >= want || kvf_now_ns() > until)
                                        break;
                                usleep(1000);
                        }
                        CHECK(sent >= want);
                        CHECK_EQ(sent - again, want);
                        if (again)
                                printf("(%" PRIu64 " bytes sent again after a data connection was lost)\n", again);
                }
                /* Every decode rank hears of each request once per source. */
                for (uint32_t j = 0; j < d; j++)
                        for (uint32_t n = 0; n < NREQ * expect_parts[j]; n++) {
                                struct kvf_event ev = wait_event(D.c[j], KVF_EVENT_ARRIVAL);
                                if (ev.status != KVF_STATUS_FINISHED) {
                                        fprintf(stderr, "decode rank %u: %s: %s: %s\n", j, ev.request_id,
                                                kvf_status_name(ev.status), ev.reason);
                                        return 1;
                                }
                        }
                /* Every byte of every head of every block on every decode rank. */
                uint64_t checked = 0;
                for (uint32_t q = 0; q < NREQ; q++)
                        for (uint32_t j = 0; j < d; j++)
                                for (uint32_t l = 0; l < LAYERS; l++)
                                        for (uint32_t z = 0; z < tensors; z++)
                                                for (uint32_t b = 0; b < ndst[q]; b++)
                                                        for (uint32_t h = 0; h < D.count[j]; h++)
                                                                for (uint32_t t = 0;
                                                                     t < BD && b * BD + t < tok[q]; t++) {
                                                                        const uint8_t *o =
                                                                            at(D.c[j], &D.L[j], l, z,
                                                                               dst[q][b], h, t);
                                                                        for (uint32_t y = 0; y < HDIM * 2;
                                                                             y++, checked++)
                                                                                if (o[y] !=
                                                                                    content(q,
                                                                                            D.first[j] + h,
                                                                                            b * BD + t,
                                                                                            y, l, z)) {
                                                                                        fprintf(
                                                                                            stderr,
                                                                                            "tp %u->%u: "
                                                                                            "request %u "
                                                                                            "decode rank "
                                                                                            "%u layer %u "
                                                                                            "tensor %u "
                                                                                            "block %u head "
                                                                                            "%u token %u "
                                                                                            "byte %u "
                                                                                            "differs\n",
                                                                                            p, d, q, j, l,
                                                                                            z, b,
                                                                                            D.first[j] + h,
                                                                                            b * BD + t,
                                                                                            y);
                                                                                        return 1;
                                                                                }
                                                                }
                /* (bytes moved: each decode rank's heads of the tokens its blocks hold, once) */
                if (!warm)
                        times[pass - warmup] = elapsed;
                if (pass + 1 < passes)
                        continue;
                /* The median of the timed passes (each verified), with the least and the most. */
                for (int a = 1; a < timed; a++)
                        for (int b = a; b > 0 && times[b - 1] > times[b]; b--) {
                                uint64_t x = times[b];
                                times[b] = times[b - 1], times[b - 1] = x;
                        }
                char spread[96] = "";
                if (timed > 1)
                        snprintf(spread, sizeof(spread), " (median of %d passes, %.3f to %.3f)", timed,
                                 times[0] / 1e6, times[timed - 1] / 1e6);
                printf("tp %u->%u, %u kv heads%s%s, %u/%u tokens/block: %u requests, %" PRIu64
                       " bytes sent in %.3f ms%s, %" PRIu64 " bytes verified on %u decode ranks; %.1f %s per request\n",
                       p, d, heads, key_only ? " (key-only)" : "", tcp ? " over tcp" : "", BP, BD, NREQ, want,
                       times[timed / 2] / 1e6, spread, checked, d, (double)(tcp ? frames : runs) / NREQ,
                       tcp ? "tcp frames" : "copy runs");
        }
        for (uint32_t k = 0; k < p; k++)
                kvf_detach(P.c[k]);
        for (uint32_t k = 0; k < d; k++)
                kvf_detach(D.c[k]);
        return 0;
}
