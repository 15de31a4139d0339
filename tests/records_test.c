/*
 * Records: every record type survives encode -> decode field for field; a
 * table of malformed inputs, each rejected with -EBADMSG and the message an
 * operator needs to find the fault; unknown keys (FastDeploy's extras)
 * ignored; the peer built from ip + port or ip + rdma_ports[rank].
 *
 *   records_test                        the tests above
 *   records_test --python SCRIPT FILE   records written by Debian's python3-msgpack with
 *                                       FastDeploy's field names decode as expected, and
 *                                       records kvferry writes read back in Python
 *
 * The second form fails (never skips) when /usr/bin/python3 has no msgpack:
 * Python engines are a supported client, and `tools/kvferry setup` installs it.
 */
#include <errno.h>
#include <fcntl.h>
#include <msgpack.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "check.h"
#include "clock.h"
#include "layout.h"
#include "mp_read.h"
#include "record_fields.h"
#include "records.h"

#define PYTHON "/usr/bin/python3"

/* ---- comparing records ---- */

#define CHECK_STREQ(what, a, b)                                                                    \
        do {                                                                                       \
                if (strcmp((a), (b))) {                                                            \
                        fprintf(stderr, "%s:%d: %s: %s differs: \"%s\" != \"%s\"\n", __FILE__,     \
                                __LINE__, (what), #a, (a), (b));                                   \
                        exit(1);                                                                   \
                }                                                                                  \
        } while (0)

#define CHECK_U64(what, a, b)                                                                      \
        do {                                                                                       \
                unsigned long long _x = (a), _y = (b);                                             \
                if (_x != _y) {                                                                    \
                        fprintf(stderr, "%s:%d: %s: %s differs: %llu != %llu\n", __FILE__,         \
                                __LINE__, (what), #a, _x, _y);                                     \
                        exit(1);                                                                   \
                }                                                                                  \
        } while (0)

static void check_ids(const char *what, const char *field, const uint32_t *a, uint32_t na,
                      const uint32_t *b, uint32_t nb)
{
        if (na != nb) {
                fprintf(stderr, "%s: %s: %u entries != %u\n", what, field, na, nb);
                exit(1);
        }
        for (uint32_t i = 0; i < na; i++)
                if (a[i] != b[i]) {
                        fprintf(stderr, "%s: %s[%u]: %u != %u\n", what, field, i, a[i], b[i]);
                        exit(1);
                }
}

/* Everything the encoder carries (record_fields.h). */
static void check_same(const char *what, const struct kvf_record *a, const struct kvf_record *b)
{
#define SAME_NUM(f) CHECK_U64(what, a->f, b->f);
#define SAME_STR(f) CHECK_STREQ(what, a->f, b->f);
#define SAME_BIN(f) CHECK(memcmp(a->f, b->f, sizeof(a->f)) == 0);
#define SAME_IDS(p, n, name) check_ids(what, name, a->p, a->n, b->p, b->n);
        KVF_RECORD_FIELDS(SAME_NUM, SAME_STR, SAME_BIN, SAME_IDS)
#undef SAME_NUM
#undef SAME_STR
#undef SAME_BIN
#undef SAME_IDS
}

/* The keys of an encoded map, comma-separated, in order: pins the wire names. */
static void keys_of(const uint8_t *buf, size_t len, char *out, size_t cap)
{
        struct kvf_mp m = {.p = buf, .end = buf + len};
        uint32_t n;
        size_t w = 0;

        out[0] = '\0';
        CHECK(kvf_mp_map(&m, &n) == 0);
        for (uint32_t i = 0; i < n; i++) {
                const char *k;
                uint32_t kl;
                CHECK(kvf_mp_str(&m, &k, &kl) == 0);
                int r = snprintf(out + w, cap - w, "%s%.*s", i ? "," : "", (int)kl, k);
                CHECK(r > 0 && (size_t)r < cap - w);
                w += (size_t)r;
                CHECK(kvf_mp_skip(&m, 4) == 0);
        }
        CHECK(m.p == m.end);
}

/* Types round_trip() has seen: every type the codec knows must be among them. */
static bool covered[KVF_RT_WIRE_MAX + 1];

/*
 * Encode, check the wire keys, decode, compare. Also: the exact length fits
 * and one byte less is -ENOSPC, so callers can size buffers from a first try.
 */
static void round_trip(const char *what, const struct kvf_record *in, const char *keys)
{
        uint8_t *buf;
        size_t len;
        struct kvf_record out;
        char got[512];

        CHECK(kvf_record_encode_alloc(in, &buf, &len) == 0);
        uint8_t *exact = malloc(len);
        CHECK(exact);
        CHECK_EQ(kvf_record_encode(in, exact, len), (long long)len);
        CHECK(memcmp(exact, buf, len) == 0);
        CHECK_EQ(kvf_record_encode(in, exact, len - 1), -ENOSPC);
        free(exact);

        keys_of(buf, len, got, sizeof(got));
        CHECK_STREQ(what, got, keys);

        int rc = kvf_record_decode(in->type, buf, len, 0, &out);
        if (rc != 0) {
                fprintf(stderr, "%s: decode failed: %d %s\n", what, rc, kvf_err_msg());
                exit(1);
        }
        check_same(what, in, &out);
        kvf_record_free(&out);
        free(buf);
        covered[in->type] = true;
}

static void fill(char *dst, size_t cap, const char *s)
{
        CHECK(strlen(s) < cap);
        memcpy(dst, s, strlen(s) + 1);
}

/* A string of exactly n bytes (n < cap), distinctive at both ends. */
static void fill_long(char *dst, size_t cap, size_t n, char tag)
{
        CHECK(n < cap && n >= 2);
        for (size_t i = 0; i < n; i++)
                dst[i] = (char)('a' + (i * 7 + (size_t)tag) % 26);
        dst[0] = tag;
        dst[n - 1] = '$';
        dst[n] = '\0';
}

/* n ids that differ from their neighbours and cover the whole uint32 range. */
static uint32_t *make_ids(uint32_t n, uint32_t seed)
{
        uint32_t *v = malloc((size_t)(n ? n : 1) * sizeof(*v));
        CHECK(v);
        for (uint32_t i = 0; i < n; i++)
                v[i] = (i * 2654435761u) ^ seed;
        if (n > 0)
                v[0] = 0;
        if (n > 1)
                v[n - 1] = UINT32_MAX;
        return v;
}

/* A small valid record of each type, every field it carries set. */
static void sample(int type, struct kvf_record *r)
{
        memset(r, 0, sizeof(*r));
        r->type = (uint16_t)type;
        fill(r->request_id, sizeof(r->request_id), "req-sample");
        fill(r->peer, sizeof(r->peer), "10.0.0.2:7100");
        fill(r->reason, sizeof(r->reason), "because");
        r->current_id = 3;
        r->tokens = 4;
        r->key = 5;
        r->bytes = 6;
        r->accept_ns = 7;
        r->last_layer_ns = 8;
        r->done_ns = 9;
        r->generation = 10;
        r->layer = 11;
        r->blocks = 12;
        r->status = KVF_STATUS_CANCELLED;
        r->transport = KVF_TRANSPORT_TCP;
        r->last = r->chunked = r->up = true;
        r->src = make_ids(r->n_src = 3, 1);
        r->dst = make_ids(r->n_dst = 2, 2);
        r->runs = make_ids(r->n_runs = 6, 3);
        fill(r->instance, sizeof(r->instance), "d0");
        fill(r->purpose, sizeof(r->purpose), "control");
        r->role = 13;
        r->proto = 14;
        r->boot_id = 15;
        memset(r->nonce, 0x11, sizeof(r->nonce));
        memset(r->proof, 0x22, sizeof(r->proof));
        r->lay_layers = 16;
        r->lay_extra = 17;
        r->lay_blocks = 18;
        r->lay_heads = 19;
        r->lay_bsize = 20;
        r->lay_hdim = 21;
        r->lay_dtype = 22;
        r->lay_keyonly = 23;
        /*
         * Keep only what the type carries, so later comparisons hold: pass it
         * through the codec (whose round trips test_round_trips() has checked).
         */
        uint8_t *buf;
        size_t len;
        struct kvf_record d;
        CHECK(kvf_record_encode_alloc(r, &buf, &len) == 0);
        CHECK(kvf_record_decode(type, buf, len, 0, &d) == 0);
        free(buf);
        kvf_record_free(r);
        *r = d;
}

/* ---- round trips ---- */

/* Connector-to-connector records: they come from the network, before and after authentication. */
static void test_wire_round_trips(void)
{
        const char *const layout_keys =
                "layers,extra_layers,num_blocks,kv_heads,block_size,head_dim,dtype,key_only";
        char keys[512];

        {
                struct kvf_record r = {.type = KVF_RT_HELLO, .proto = UINT64_MAX};
                for (unsigned i = 0; i < sizeof(r.nonce); i++)
                        r.nonce[i] = (uint8_t)(0xff - i);
                fill_long(r.purpose, sizeof(r.purpose), sizeof(r.purpose) - 1, 'c');
                round_trip("hello", &r, "proto,nonce,purpose");
        }
        {
                struct kvf_record r = {.type = KVF_RT_CHALLENGE};
                memset(r.nonce, 0, sizeof(r.nonce)); /* all-zero bytes survive as binary */
                for (unsigned i = 0; i < sizeof(r.proof); i++)
                        r.proof[i] = (uint8_t)(i * 37);
                round_trip("challenge", &r, "nonce,proof");
        }
        for (int welcome = 0; welcome <= 1; welcome++) {
                struct kvf_record r = {.type = welcome ? KVF_RT_WELCOME : KVF_RT_AUTH,
                                       .role = 2, .generation = 1700000000987654321ull,
                                       .boot_id = 0xfeedfacecafebeefull, .lay_layers = 61,
                                       .lay_extra = 1, .lay_blocks = 1u << 20, .lay_heads = 8,
                                       .lay_bsize = 64, .lay_hdim = 128, .lay_dtype = 1,
                                       .lay_keyonly = 1};
                if (!welcome) /* only auth carries a proof */
                        memset(r.proof, 0xa5, sizeof(r.proof));
                fill_long(r.instance, sizeof(r.instance), KVF_INSTANCE_MAX - 1, 'I');
                snprintf(keys, sizeof(keys), "%sinstance,role,generation,boot_id,%s",
                         welcome ? "" : "proof,", layout_keys);
                round_trip(welcome ? "welcome" : "auth", &r, keys);
                if (!welcome)
                        continue;
                /* An rdma data connection's welcome: the region and its key, the ticket. */
                r.rdma_port = 65535;
                r.rdma_addr = 0x7f0012345000ull;
                r.rdma_len = 1ull << 40;
                r.rdma_rkey = UINT32_MAX;
                for (unsigned i = 0; i < sizeof(r.rdma_ticket); i++)
                        r.rdma_ticket[i] = (uint8_t)(i * 11 + 1);
                snprintf(keys, sizeof(keys),
                         "instance,role,generation,boot_id,%s,rdma_port,rdma_addr,rdma_len,rdma_rkey,rdma_ticket",
                         layout_keys);
                round_trip("welcome (rdma)", &r, keys);
                /* ... of a cache in parts: a table of words per (layer, tensor). */
                r.rdma_parts = make_ids(r.n_rdma_parts = 62 * 5, 0x9e3779b1u);
                snprintf(keys, sizeof(keys),
                         "instance,role,generation,boot_id,%s,rdma_port,rdma_addr,rdma_len,rdma_rkey,rdma_ticket,"
                         "rdma_parts",
                         layout_keys);
                round_trip("welcome (rdma, in parts)", &r, keys);
                kvf_record_free(&r);
        }
        for (int st = 0; st < KVF_STATUS_COUNT; st++) {
                struct kvf_record r = {.type = KVF_RT_REFUSE, .status = st};
                fill(r.reason, sizeof(r.reason), "peer layout mismatch (as seen by 'd0'): 32 layers here, 28 there");
                round_trip("refuse", &r, "status,reason");
        }
        {
                struct kvf_record r = {.type = KVF_RT_NOTICE, .key = 77, .transport = KVF_TRANSPORT_TCP,
                                       .status = KVF_STATUS_FINISHED, .bytes = 1ull << 36,
                                       .blocks = 5000, .generation = 3};
                fill(r.request_id, sizeof(r.request_id), "req-notice");
                fill(r.peer, sizeof(r.peer), "p0");
                r.dst = make_ids(r.n_dst = 5000, 4);
                round_trip("notice", &r,
                           "key,request_id,peer,transfer_protocol,dest_block_ids,status,bytes,blocks,"
                           "generation,session,withdraw");
                kvf_record_free(&r);
        }
        {
                struct kvf_record r = {.type = KVF_RT_ACK, .key = 77, .status = KVF_STATUS_BLOCK_RANGE};
                fill(r.request_id, sizeof(r.request_id), "req-notice");
                fill(r.reason, sizeof(r.reason), "block 5000 >= 4096 blocks");
                round_trip("ack", &r, "key,request_id,status,reason,session");
        }
        {
                struct kvf_record r = {.type = KVF_RT_PING};
                round_trip("ping", &r, "");
                r.type = KVF_RT_PONG;
                round_trip("pong", &r, "session");
        }
}

static void test_round_trips(void)
{
        static const uint32_t sizes[] = {0, 1, 3, 5000};
        const char *const task_keys =
                "request_id,src_block_ids,dest_block_ids,current_id,transfer_protocol,peer,chunked,peer_session";
        char what[96];

        /* task: each transport, each array size (empty, prefix hit, 5000 ids) */
        for (int t = KVF_TRANSPORT_IPC; t <= KVF_TRANSPORT_RDMA; t++)
                for (unsigned s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
                        struct kvf_record r = {.type = KVF_REC_TASK};
                        snprintf(r.request_id, sizeof(r.request_id), "chatcmpl-%d-%u-Ω", t, s);
                        fill(r.peer, sizeof(r.peer), t == KVF_TRANSPORT_IPC ? "d0" : "10.0.0.2:7100");
                        r.n_src = sizes[s];
                        r.src = make_ids(r.n_src, 0x5a5a0000u + (uint32_t)t);
                        r.n_dst = sizes[s] > 1 ? sizes[s] - 1 : sizes[s];
                        r.dst = make_ids(r.n_dst, 0x00a5a5a5u);
                        r.current_id = UINT64_MAX - (uint64_t)s;
                        r.transport = t;
                        r.chunked = s & 1;
                        snprintf(what, sizeof(what), "task %s %u ids", kvf_transport_name(t), sizes[s]);
                        round_trip(what, &r, task_keys);
                        kvf_record_free(&r);
                }
        {       /* longest strings each field allows */
                struct kvf_record r = {.type = KVF_REC_TASK, .transport = KVF_TRANSPORT_TCP};
                fill_long(r.request_id, sizeof(r.request_id), KVF_REQ_ID_MAX - 1, 'R');
                fill_long(r.peer, sizeof(r.peer), KVF_PEER_MAX - 1, 'P');
                r.src = make_ids(r.n_src = 2, 1);
                r.dst = make_ids(r.n_dst = 2, 2);
                round_trip("task, longest strings", &r, task_keys);
                kvf_record_free(&r);
        }

        for (int last = 0; last <= 1; last++) {
                struct kvf_record r = {.type = KVF_REC_CHUNK, .current_id = 1234567890123ull,
                                       .tokens = 65536 + (uint64_t)last, .last = last};
                fill(r.request_id, sizeof(r.request_id), "req-chunk");
                round_trip("chunk", &r, "request_id,current_id,tokens_done,last");
        }

        {
                struct kvf_record r = {.type = KVF_REC_CANCEL};
                fill(r.request_id, sizeof(r.request_id), "req-cancel/1");
                round_trip("cancel", &r, "request_id");
        }

        /* completion: every status, reason present or not (empty reasons are left out) */
        for (int st = 0; st < KVF_STATUS_COUNT; st++) {
                struct kvf_record r = {.type = KVF_REC_COMPLETION, .status = st,
                                       .bytes = (1ull << 40) + (uint64_t)st, .blocks = 4096,
                                       .accept_ns = 111111111111ull, .last_layer_ns = 222222222222ull,
                                       .done_ns = UINT64_MAX};
                snprintf(r.request_id, sizeof(r.request_id), "req-done-%d", st);
                fill(r.peer, sizeof(r.peer), "10.1.2.3:65535");
                if (st != KVF_STATUS_FINISHED)
                        fill_long(r.reason, sizeof(r.reason), KVF_REASON_MAX - 1, 'E');
                snprintf(what, sizeof(what), "completion '%s'", kvf_status_name(st));
                round_trip(what, &r,
                           st ? "request_id,status,reason,peer,bytes,blocks,accept_ns,last_layer_ns,done_ns,session"
                              : "request_id,status,peer,bytes,blocks,accept_ns,last_layer_ns,done_ns,session");
        }

        for (int t = 0; t <= KVF_TRANSPORT_RDMA; t++) {
                struct kvf_record r = {.type = KVF_REC_CONNECT, .transport = t};
                fill(r.request_id, sizeof(r.request_id), "connect-task-9");
                fill(r.peer, sizeof(r.peer), "decode-host.example:7100");
                /* transport 0 = not given: the connector picks */
                round_trip("connect", &r, t ? "task_id,peer,transfer_protocol" : "task_id,peer");
        }

        {
                struct kvf_record r = {.type = KVF_REC_CONNECT_RESULT, .status = KVF_STATUS_AUTH};
                fill(r.request_id, sizeof(r.request_id), "connect-task-9");
                fill(r.peer, sizeof(r.peer), "decode-host.example:7100");
                fill(r.reason, sizeof(r.reason), "token rejected by 10.0.0.2:7100");
                round_trip("connect result", &r, "task_id,peer,status,reason,session");
        }

        for (unsigned s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
                struct kvf_record r = {.type = KVF_REC_ARRIVAL, .status = KVF_STATUS_CONNECTION,
                                       .bytes = 987654321, .blocks = sizes[s], .done_ns = 42};
                fill(r.request_id, sizeof(r.request_id), "req-arrived");
                fill(r.peer, sizeof(r.peer), "p0");
                fill(r.reason, sizeof(r.reason), "peer p0 died (generation 3 -> 4)");
                r.dst = make_ids(r.n_dst = sizes[s], 77);
                round_trip("arrival", &r,
                           "request_id,status,reason,peer,bytes,blocks,dest_block_ids,done_ns,session");
                kvf_record_free(&r);
        }

        for (unsigned s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
                struct kvf_record r = {.type = KVF_RT_WRITE_BATCH, .key = 0x0123456789abcdefull,
                                       .layer = 61, .layer_count = 3, .transport = KVF_TRANSPORT_TCP};
                fill(r.request_id, sizeof(r.request_id), "req-batch");
                fill(r.peer, sizeof(r.peer), "10.0.0.2:7100");
                r.runs = make_ids(r.n_runs = sizes[s] * 3, 3);
                round_trip("write batch", &r,
                           "key,request_id,peer,layer,layer_count,runs,transfer_protocol");
                kvf_record_free(&r);
        }

        for (unsigned s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
                struct kvf_record r = {.type = KVF_RT_OPEN, .key = 0xfedcba9876543210ull,
                                       .transport = KVF_TRANSPORT_TCP, .bytes = 123456789012ull};
                fill(r.request_id, sizeof(r.request_id), "req-open");
                fill(r.peer, sizeof(r.peer), "10.0.0.2:7100");
                r.dst = make_ids(r.n_dst = sizes[s], 11);
                round_trip("open", &r, "key,request_id,peer,transfer_protocol,dest_block_ids,bytes,session");
                kvf_record_free(&r);
        }

        {
                struct kvf_record r = {.type = KVF_RT_XOPEN, .key = 99};
                fill(r.request_id, sizeof(r.request_id), "req-xopen");
                r.dst = make_ids(r.n_dst = 5000, 13);
                round_trip("xopen", &r, "key,request_id,dest_block_ids,session");
                kvf_record_free(&r);
        }

        {
                struct kvf_record r = {.type = KVF_RT_FINISH, .key = 1, .transport = KVF_TRANSPORT_RDMA,
                                       .status = KVF_STATUS_WRITE, .bytes = 5, .blocks = 6,
                                       .generation = 1700000000123456789ull};
                fill(r.request_id, sizeof(r.request_id), "req-finish");
                fill(r.peer, sizeof(r.peer), "[fd00::2]:7100");
                fill(r.reason, sizeof(r.reason), "RDMA write: remote access error");
                r.dst = make_ids(r.n_dst = 5000, 9);
                round_trip("finish", &r,
                           "key,request_id,peer,transfer_protocol,dest_block_ids,status,reason,bytes,blocks,"
                           "generation,session,withdraw");
                kvf_record_free(&r);
        }

        {
                struct kvf_record r = {.type = KVF_RT_WRITE_RESULT, .key = UINT64_MAX,
                                       .status = KVF_STATUS_BLOCK_RANGE, .bytes = 0};
                fill(r.request_id, sizeof(r.request_id), "req-wr");
                fill(r.reason, sizeof(r.reason), "block 70000 >= 65536 blocks");
                round_trip("write result", &r, "key,request_id,status,reason,bytes");
        }

        for (int up = 0; up <= 1; up++) {
                struct kvf_record r = {.type = KVF_RT_PEER_STATE, .up = up, .generation = 7u + (unsigned)up};
                fill(r.peer, sizeof(r.peer), "10.0.0.9:7100");
                if (!up)
                        fill(r.reason, sizeof(r.reason), "heartbeat lost for 3000 ms");
                round_trip("peer state", &r, up ? "peer,up,generation,session" : "peer,up,generation,reason,session");
        }

        {
                struct kvf_record r = {.type = KVF_RT_DISCONNECT};
                fill(r.peer, sizeof(r.peer), "10.0.0.9:7100");
                round_trip("disconnect", &r, "peer");
        }

        test_wire_round_trips();

        /* Every type the codec knows has been through a round trip above. */
        for (int t = 0; t <= KVF_RT_WIRE_MAX; t++) {
                bool named = strcmp(kvf_rec_type_name(t), "unknown") != 0;
                if (named != covered[t]) {
                        fprintf(stderr, "record type %d (%s): %s\n", t, kvf_rec_type_name(t),
                                named ? "no round trip in this test" : "tested but unknown");
                        exit(1);
                }
        }
        for (int t = 1; t <= KVF_RT_MAX; t++)
                CHECK(covered[t]);
        CHECK(strcmp(kvf_rec_type_name(KVF_RT_MAX + 1), "unknown") == 0);
        CHECK(strcmp(kvf_rec_type_name(KVF_RT_WIRE_MAX + 1), "unknown") == 0);
}

static void test_encode_errors(void)
{
        struct kvf_record r = {.type = 0};
        uint8_t buf[64];
        CHECK_EQ(kvf_record_encode(&r, buf, sizeof(buf)), -EINVAL);
        r.type = KVF_RT_MAX + 1;
        CHECK_EQ(kvf_record_encode(&r, buf, sizeof(buf)), -EINVAL);
        r.type = KVF_REC_CANCEL;
        fill(r.request_id, sizeof(r.request_id), "x");
        CHECK_EQ(kvf_record_encode(&r, buf, 0), -ENOSPC);
        CHECK(kvf_record_encode(&r, buf, sizeof(buf)) > 0);
}

/* Reasons are text for people: what kvferry writes is UTF-8 whatever it quotes, and a reason of
 * other bytes from a peer is kept as \xNN rather than the record refused. */
static void test_reason_text(void)
{
        char out[16];
        CHECK_EQ(kvf_text_clean(out, sizeof(out), "ok \xc3\xa9", 5), 5u);
        CHECK_STREQ("valid text unchanged", out, "ok \xc3\xa9");
        kvf_text_clean(out, sizeof(out), "a\xff" "b\xc0\xaf", 5);
        CHECK_STREQ("bytes as \\xNN", out, "a\\xffb\\xc0\\xaf");
        /* 15 bytes fit: 14 digits + 'é' would need 16 */
        CHECK_EQ(kvf_text_clean(out, sizeof(out), "01234567890123\xc3\xa9", 16), 14u);
        CHECK_STREQ("never half a character", out, "01234567890123");
        CHECK_EQ(kvf_text_clean(out, sizeof(out), "0123456789012\xff", 14), 13u);
        CHECK_STREQ("never half an escape", out, "0123456789012");
        CHECK_EQ(kvf_text_clean(out, sizeof(out), "\xe2\x82", 2), 8u); /* a sequence cut short */
        CHECK_STREQ("a cut sequence", out, "\\xe2\\x82");

        /* encoded: a completion whose reason quotes bytes and was cut mid-character */
        struct kvf_record r = {.type = KVF_REC_COMPLETION}, back;
        uint8_t buf[1024];
        fill(r.request_id, sizeof(r.request_id), "rq");
        r.status = KVF_STATUS_BAD_TASK;
        memset(r.reason, 'x', sizeof(r.reason) - 1);
        memcpy(r.reason, "live '\xff'", 8);
        r.reason[sizeof(r.reason) - 2] = '\xc3'; /* the first byte of 'é', cut */
        r.reason[sizeof(r.reason) - 1] = '\0';
        int n = kvf_record_encode(&r, buf, sizeof(buf));
        CHECK(n > 0);
        CHECK_EQ(kvf_record_decode(KVF_REC_COMPLETION, buf, (size_t)n, 0, &back), 0);
        CHECK(!strncmp(back.reason, "live '\\xff'xxx", 14));
        CHECK(strlen(back.reason) < sizeof(back.reason));
        kvf_record_free(&back);

        /* decoded: a peer's reason of other bytes is kept, not the record refused */
        msgpack_sbuffer sb;
        msgpack_packer pk;
        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_map(&pk, 3);
        msgpack_pack_str_with_body(&pk, "request_id", 10);
        msgpack_pack_str_with_body(&pk, "rq", 2);
        msgpack_pack_str_with_body(&pk, "status", 6);
        msgpack_pack_str_with_body(&pk, "bad task", 8);
        msgpack_pack_str_with_body(&pk, "reason", 6);
        msgpack_pack_str_with_body(&pk, "caf\xe9", 4);
        CHECK_EQ(kvf_record_decode(KVF_REC_COMPLETION, sb.data, sb.size, 0, &back), 0);
        CHECK_STREQ("a peer's Latin-1 reason", back.reason, "caf\\xe9");
        kvf_record_free(&back);
        msgpack_sbuffer_destroy(&sb);
}

/* ---- malformed inputs ---- */

static void v_int(msgpack_packer *pk) { msgpack_pack_int(pk, 5); }
static void v_empty_str(msgpack_packer *pk) { msgpack_pack_str_with_body(pk, "", 0); }
static void v_nil(msgpack_packer *pk) { msgpack_pack_nil(pk); }
static void v_float(msgpack_packer *pk) { msgpack_pack_double(pk, 1.5); }
static void v_neg(msgpack_packer *pk) { msgpack_pack_int(pk, -3); }
static void v_str_num(msgpack_packer *pk) { msgpack_pack_str_with_body(pk, "17", 2); }
static void v_udp(msgpack_packer *pk) { msgpack_pack_str_with_body(pk, "udp", 3); }
static void v_c1(msgpack_packer *pk) { msgpack_pack_str_body(pk, "\xc1", 1); }

static void v_str200(msgpack_packer *pk)
{
        char s[200];
        memset(s, 'x', sizeof(s));
        msgpack_pack_str_with_body(pk, s, sizeof(s));
}

/* One byte over the limit: the terminating NUL would land outside the field. */
static void v_str(msgpack_packer *pk, size_t n)
{
        char s[KVF_REASON_MAX + 1];
        CHECK(n <= sizeof(s));
        memset(s, 'y', n);
        msgpack_pack_str_with_body(pk, s, n);
}

static void v_str128(msgpack_packer *pk) { v_str(pk, KVF_REQ_ID_MAX); }
static void v_str112(msgpack_packer *pk) { v_str(pk, KVF_PEER_MAX); }

static void v_str_nul(msgpack_packer *pk) { msgpack_pack_str_with_body(pk, "req\0evil", 8); }
static void v_str_latin1(msgpack_packer *pk) { msgpack_pack_str_with_body(pk, "caf\xe9", 4); }
static void v_str_overlong(msgpack_packer *pk) { msgpack_pack_str_with_body(pk, "a\xc0\xaf", 3); }
static void v_str_surrogate(msgpack_packer *pk) { msgpack_pack_str_with_body(pk, "\xed\xa0\x80", 3); }

static void v_ids_neg(msgpack_packer *pk)
{
        msgpack_pack_array(pk, 3);
        msgpack_pack_int(pk, 4);
        msgpack_pack_int(pk, -1);
        msgpack_pack_int(pk, 6);
}

static void v_ids_str(msgpack_packer *pk)
{
        msgpack_pack_array(pk, 1);
        msgpack_pack_str_with_body(pk, "4", 1);
}

static void v_ids_wide(msgpack_packer *pk)
{
        msgpack_pack_array(pk, 1);
        msgpack_pack_uint64(pk, 1ull << 32);
}

/* Claims 2^32-1 elements; the buffer holds a few bytes. */
static void v_ids_huge(msgpack_packer *pk) { msgpack_pack_array(pk, UINT32_MAX); }

static void v_ids_too_many(msgpack_packer *pk)
{
        msgpack_pack_array(pk, KVF_MAX_RECORD_IDS + 1);
        for (uint32_t i = 0; i <= KVF_MAX_RECORD_IDS; i++)
                msgpack_pack_uint32(pk, 1);
}

static void v_ports_short(msgpack_packer *pk)
{
        msgpack_pack_array(pk, 2);
        msgpack_pack_uint32(pk, 7100);
        msgpack_pack_uint32(pk, 7101);
}

static void v_nest(msgpack_packer *pk, unsigned depth)
{
        for (unsigned i = 0; i < depth; i++)
                msgpack_pack_array(pk, 1);
        msgpack_pack_int(pk, 1);
}

static void v_nest100(msgpack_packer *pk) { v_nest(pk, 100); }
/* docs/records.md: unknown values nest up to 16 levels. */
static void v_nest16(msgpack_packer *pk) { v_nest(pk, 16); }
static void v_nest17(msgpack_packer *pk) { v_nest(pk, 17); }

static void v_bool_str(msgpack_packer *pk) { msgpack_pack_str_with_body(pk, "yes", 3); }
static void v_two(msgpack_packer *pk) { msgpack_pack_int(pk, 2); }

static void v_trunc_ext(msgpack_packer *pk)
{
        /* ext 32 claiming 4 GiB */
        msgpack_pack_str_body(pk, "\xc9\xff\xff\xff\xff\x01", 6);
}

/* The value of one key of the base task, by name, or NULL for none. */
static void pack_base_value(msgpack_packer *pk, const char *key)
{
        if (!strcmp(key, "request_id")) {
                msgpack_pack_str_with_body(pk, "req-1", 5);
        } else if (!strcmp(key, "src_block_ids") || !strcmp(key, "dest_block_ids")) {
                msgpack_pack_array(pk, 3);
                for (int i = 1; i <= 3; i++)
                        msgpack_pack_int(pk, i);
        } else if (!strcmp(key, "current_id")) {
                msgpack_pack_int(pk, 42);
        } else if (!strcmp(key, "transfer_protocol")) {
                msgpack_pack_str_with_body(pk, "tcp", 3);
        } else if (!strcmp(key, "peer")) {
                msgpack_pack_str_with_body(pk, "10.0.0.2:7100", 13);
        }
}

static const char *const base_keys[] = {"request_id", "src_block_ids", "dest_block_ids",
                                        "current_id", "transfer_protocol", "peer"};
#define N_BASE (sizeof(base_keys) / sizeof(base_keys[0]))

enum how { REPLACE, OMIT, ADD };

/* A valid task with `key` replaced (or left out, or added once more at the end). */
static void pack_task(msgpack_packer *pk, const char *key, enum how how, void (*val)(msgpack_packer *))
{
        bool is_base = false;
        for (unsigned i = 0; i < N_BASE; i++)
                is_base |= key && !strcmp(key, base_keys[i]);
        size_t n = N_BASE;
        if (how == OMIT)
                n--;
        else if (key && (how == ADD || !is_base))
                n++;
        msgpack_pack_map(pk, n);
        for (unsigned i = 0; i < N_BASE; i++) {
                bool hit = key && !strcmp(key, base_keys[i]);
                if (hit && how == OMIT)
                        continue;
                msgpack_pack_str_with_body(pk, base_keys[i], strlen(base_keys[i]));
                if (hit && how == REPLACE)
                        val(pk);
                else
                        pack_base_value(pk, base_keys[i]);
        }
        if (key && (how == ADD || !is_base)) {
                msgpack_pack_str_with_body(pk, key, strlen(key));
                if (val)
                        val(pk);
                else
                        pack_base_value(pk, key);
        }
}

static void pack_kv_str(msgpack_packer *pk, const char *k, const char *v)
{
        msgpack_pack_str_with_body(pk, k, strlen(k));
        msgpack_pack_str_with_body(pk, v, strlen(v));
}

static void raw_top_array(msgpack_packer *pk)
{
        msgpack_pack_array(pk, 1);
        pack_kv_str(pk, "request_id", "x");
}

static void raw_int_key(msgpack_packer *pk)
{
        msgpack_pack_map(pk, 1);
        msgpack_pack_int(pk, 1);
        msgpack_pack_str_with_body(pk, "req-1", 5);
}

/* A map whose last field is cut short, as when a record is copied out of a ring half-written. */
static void raw_cut_map(msgpack_packer *pk)
{
        msgpack_pack_map(pk, 3);
        pack_kv_str(pk, "request_id", "req-1");
        msgpack_pack_str_with_body(pk, "current_id", 10);
}

static void raw_cut_string(msgpack_packer *pk)
{
        msgpack_pack_map(pk, 1);
        msgpack_pack_str_with_body(pk, "request_id", 10);
        msgpack_pack_str(pk, 10);
        msgpack_pack_str_body(pk, "abc", 3);
}

static void raw_cut_key(msgpack_packer *pk)
{
        msgpack_pack_map(pk, 1);
        msgpack_pack_str(pk, 10);
        msgpack_pack_str_body(pk, "requ", 4);
}

static void raw_cut_int(msgpack_packer *pk)
{
        msgpack_pack_map(pk, 1);
        msgpack_pack_str_with_body(pk, "current_id", 10);
        msgpack_pack_str_body(pk, "\xcf\x00\x00\x01", 4);
}

static void raw_cut_ids_header(msgpack_packer *pk)
{
        msgpack_pack_map(pk, 1);
        msgpack_pack_str_with_body(pk, "src_block_ids", 13);
        msgpack_pack_str_body(pk, "\xdd\x00\x00", 3);
}

static void raw_trailing(msgpack_packer *pk)
{
        pack_task(pk, NULL, REPLACE, NULL);
        msgpack_pack_nil(pk);
}

/* FastDeploy-style peer, but the rank has no port. */
/* Every base key of a task but the last, "peer", with its value. */
static void pack_base_but_peer(msgpack_packer *pk)
{
        for (unsigned i = 0; i < N_BASE - 1; i++) {
                msgpack_pack_str_with_body(pk, base_keys[i], strlen(base_keys[i]));
                pack_base_value(pk, base_keys[i]);
        }
}

static void raw_ports_short(msgpack_packer *pk)
{
        msgpack_pack_map(pk, 7);
        pack_base_but_peer(pk);
        pack_kv_str(pk, "ip", "10.0.0.2");
        msgpack_pack_str_with_body(pk, "rdma_ports", 10);
        v_ports_short(pk);
}

static void raw_ip_port0(msgpack_packer *pk)
{
        msgpack_pack_map(pk, 7);
        pack_base_but_peer(pk);
        pack_kv_str(pk, "ip", "10.0.0.2");
        msgpack_pack_str_with_body(pk, "port", 4);
        msgpack_pack_int(pk, 0);
}

static void raw_ip_no_port(msgpack_packer *pk)
{
        msgpack_pack_map(pk, 6);
        pack_base_but_peer(pk);
        pack_kv_str(pk, "ip", "10.0.0.2");
}

static void raw_completion_status(msgpack_packer *pk)
{
        msgpack_pack_map(pk, 2);
        pack_kv_str(pk, "request_id", "req-1");
        pack_kv_str(pk, "status", "done");
}

static void raw_chunk_last(msgpack_packer *pk, void (*val)(msgpack_packer *))
{
        msgpack_pack_map(pk, 4);
        pack_kv_str(pk, "request_id", "req-1");
        msgpack_pack_str_with_body(pk, "current_id", 10);
        msgpack_pack_int(pk, 3);
        msgpack_pack_str_with_body(pk, "tokens_done", 11);
        msgpack_pack_int(pk, 512);
        msgpack_pack_str_with_body(pk, "last", 4);
        val(pk);
}

static void raw_chunk_last_str(msgpack_packer *pk) { raw_chunk_last(pk, v_bool_str); }
static void raw_chunk_last_two(msgpack_packer *pk) { raw_chunk_last(pk, v_two); }

static void raw_batch_no_peer(msgpack_packer *pk)
{
        msgpack_pack_map(pk, 5);
        msgpack_pack_str_with_body(pk, "key", 3);
        msgpack_pack_uint64(pk, 9);
        pack_kv_str(pk, "request_id", "req-1");
        msgpack_pack_str_with_body(pk, "layer", 5);
        msgpack_pack_int(pk, 0);
        msgpack_pack_str_with_body(pk, "runs", 4);
        msgpack_pack_array(pk, 0);
        pack_kv_str(pk, "transfer_protocol", "tcp");
}

static void raw_big_map(msgpack_packer *pk)
{
        msgpack_pack_map(pk, 1000);
        pack_kv_str(pk, "request_id", "r");
}

/* hello, with the nonce given by `nonce` */
static void raw_hello(msgpack_packer *pk, void (*nonce)(msgpack_packer *))
{
        msgpack_pack_map(pk, 3);
        msgpack_pack_str_with_body(pk, "proto", 5);
        msgpack_pack_int(pk, 1);
        msgpack_pack_str_with_body(pk, "nonce", 5);
        nonce(pk);
        pack_kv_str(pk, "purpose", "control");
}

static void v_bin31(msgpack_packer *pk)
{
        char b[31] = {0};
        msgpack_pack_bin_with_body(pk, b, sizeof(b));
}

static void v_str32(msgpack_packer *pk) { v_str(pk, 32); }

/* bin 32 header claiming 4 GiB */
static void v_bin_huge(msgpack_packer *pk) { msgpack_pack_str_body(pk, "\xc6\xff\xff\xff\xff\x00", 6); }

static void raw_hello_short_nonce(msgpack_packer *pk) { raw_hello(pk, v_bin31); }
static void raw_hello_str_nonce(msgpack_packer *pk) { raw_hello(pk, v_str32); }
static void raw_hello_huge_nonce(msgpack_packer *pk) { raw_hello(pk, v_bin_huge); }

static void raw_good_task(msgpack_packer *pk) { pack_task(pk, NULL, REPLACE, NULL); }

struct bad {
        const char *what;
        int type;
        uint32_t rank;
        /* one of: */
        const char *hex;                  /* raw bytes */
        void (*raw)(msgpack_packer *);    /* the whole record */
        const char *key;                  /* a task with this key... */
        enum how how;                     /* ...replaced, left out or added */
        void (*val)(msgpack_packer *);    /* ...with this value */
        const char *msg;                  /* kvf_err_msg() contains this */
};

#define T KVF_REC_TASK
static const struct bad bads[] = {
        {"empty bytes", T, 0, "", NULL, NULL, 0, NULL, "empty task record"},
        {"array at top level", T, 0, NULL, raw_top_array, NULL, 0, NULL,
         "task record is not a msgpack map (found array)"},
        {"nil at top level", KVF_REC_CANCEL, 0, "c0", NULL, NULL, 0, NULL,
         "cancel record is not a msgpack map (found nil)"},
        {"invalid byte 0xc1 at top level", T, 0, "c1", NULL, NULL, 0, NULL,
         "task record is not a msgpack map (found invalid byte 0xc1)"},
        {"map header cut short", T, 0, "de00", NULL, NULL, 0, NULL,
         "task record: map header runs past the end (2 bytes)"},
        {"map claims 1000 entries in a few bytes", T, 0, NULL, raw_big_map, NULL, 0, NULL,
         "task record: map of 1000 entries runs past the end"},
        {"map cut after a key", T, 0, NULL, raw_cut_map, NULL, 0, NULL,
         "task record: field 'current_id' must be a non-negative integer, found end of data"},
        {"key that is not a string", T, 0, NULL, raw_int_key, NULL, 0, NULL,
         "task record: key #0 is not a string (found integer)"},
        {"key cut short", T, 0, NULL, raw_cut_key, NULL, 0, NULL, "task record: key #0 runs past the end"},
        {"string cut short", T, 0, NULL, raw_cut_string, NULL, 0, NULL,
         "task record: field 'request_id': string runs past the end of the record"},
        {"integer cut short", KVF_REC_CHUNK, 0, NULL, raw_cut_int, NULL, 0, NULL,
         "chunk record: field 'current_id': integer runs past the end of the record"},
        {"missing src_block_ids", T, 0, NULL, NULL, "src_block_ids", OMIT, NULL,
         "task record: missing field 'src_block_ids'"},
        {"missing request_id", T, 0, NULL, NULL, "request_id", OMIT, NULL,
         "task record: missing field 'request_id'"},
        {"missing transfer_protocol", T, 0, NULL, NULL, "transfer_protocol", OMIT, NULL,
         "task record: missing field 'transfer_protocol'"},
        {"request_id an integer", T, 0, NULL, NULL, "request_id", REPLACE, v_int,
         "task record: field 'request_id' must be a string, found integer"},
        {"request_id nil", T, 0, NULL, NULL, "request_id", REPLACE, v_nil,
         "task record: field 'request_id' must be a string, found nil"},
        {"request_id empty", T, 0, NULL, NULL, "request_id", REPLACE, v_empty_str,
         "task record: field 'request_id' is empty"},
        {"request_id 200 bytes", T, 0, NULL, NULL, "request_id", REPLACE, v_str200,
         "task record: field 'request_id' is 200 bytes long, at most 127 allowed"},
        {"request_id 128 bytes", T, 0, NULL, NULL, "request_id", REPLACE, v_str128,
         "task record: field 'request_id' is 128 bytes long, at most 127 allowed"},
        {"peer 112 bytes", T, 0, NULL, NULL, "peer", REPLACE, v_str112,
         "task record: field 'peer' is 112 bytes long, at most 111 allowed"},
        {"peer 200 bytes", T, 0, NULL, NULL, "peer", REPLACE, v_str200,
         "task record: field 'peer' is 200 bytes long, at most 111 allowed"},
        {"string with a NUL byte", T, 0, NULL, NULL, "request_id", REPLACE, v_str_nul,
         "task record: field 'request_id' contains a NUL byte"},
        {"string in Latin-1, not UTF-8", T, 0, NULL, NULL, "request_id", REPLACE, v_str_latin1,
         "task record: field 'request_id' is not valid UTF-8"},
        {"overlong UTF-8", T, 0, NULL, NULL, "peer", REPLACE, v_str_overlong,
         "task record: field 'peer' is not valid UTF-8"},
        {"UTF-8 surrogate", T, 0, NULL, NULL, "request_id", REPLACE, v_str_surrogate,
         "task record: field 'request_id' is not valid UTF-8"},
        {"current_id negative", T, 0, NULL, NULL, "current_id", REPLACE, v_neg,
         "task record: field 'current_id' must be a non-negative integer, found -3"},
        {"current_id a string", T, 0, NULL, NULL, "current_id", REPLACE, v_str_num,
         "task record: field 'current_id' must be a non-negative integer, found string"},
        {"current_id a float", T, 0, NULL, NULL, "current_id", REPLACE, v_float,
         "task record: field 'current_id' must be a non-negative integer, found float"},
        {"current_id invalid byte 0xc1", T, 0, NULL, NULL, "current_id", REPLACE, v_c1,
         "task record: field 'current_id' must be a non-negative integer, found invalid byte 0xc1"},
        {"src_block_ids not an array", T, 0, NULL, NULL, "src_block_ids", REPLACE, v_int,
         "task record: field 'src_block_ids' must be an array of block ids, found integer"},
        {"src_block_ids element negative", T, 0, NULL, NULL, "src_block_ids", REPLACE, v_ids_neg,
         "task record: field 'src_block_ids'[1] is negative (-1)"},
        {"src_block_ids element a string", T, 0, NULL, NULL, "src_block_ids", REPLACE, v_ids_str,
         "task record: field 'src_block_ids'[0] must be a non-negative integer, found string"},
        {"src_block_ids element 2^32", T, 0, NULL, NULL, "src_block_ids", REPLACE, v_ids_wide,
         "task record: field 'src_block_ids'[0] = 4294967296 does not fit 32 bits"},
        /* The bound is checked against the bytes left before anything is allocated:
         * this message comes only from that check, never from an element loop. */
        {"dest_block_ids claims 2^32-1 elements", T, 0, NULL, NULL, "dest_block_ids", REPLACE,
         v_ids_huge, "task record: field 'dest_block_ids': array of 4294967295 runs past the end"},
        {"array header cut short", T, 0, NULL, raw_cut_ids_header, NULL, 0, NULL,
         "task record: field 'src_block_ids': array header runs past the end of the record"},
        {"src_block_ids over the id limit", T, 0, NULL, NULL, "src_block_ids", REPLACE, v_ids_too_many,
         "task record: field 'src_block_ids' has 1048577 entries, at most 1048576 allowed"},
        {"transfer_protocol udp", T, 0, NULL, NULL, "transfer_protocol", REPLACE, v_udp,
         "task record: field 'transfer_protocol' is 'udp': expected ipc, tcp or rdma"},
        {"duplicate field", T, 0, NULL, NULL, "request_id", ADD, NULL,
         "task record: field 'request_id' appears twice"},
        {"trailing bytes after the map", T, 0, NULL, raw_trailing, NULL, 0, NULL,
         "task record: 1 trailing bytes after the map"},
        {"record type 0", 0, 0, NULL, raw_good_task, NULL, 0, NULL, "unknown record type 0"},
        {"record type 255", 255, 0, NULL, raw_good_task, NULL, 0, NULL, "unknown record type 255"},
        {"record type 0xffff (ring padding)", KVF_REC_TYPE_PAD, 0, NULL, raw_good_task, NULL, 0, NULL,
         "unknown record type 65535"},
        {"record type -1", -1, 0, NULL, raw_good_task, NULL, 0, NULL, "unknown record type -1"},
        {"rdma_ports without the rank", T, 2, NULL, raw_ports_short, NULL, 0, NULL,
         "task record: field 'rdma_ports' has 2 entries, none for rank 2"},
        {"ip with port 0", T, 0, NULL, raw_ip_port0, NULL, 0, NULL,
         "task record: port 0 is not in [1, 65535]"},
        {"ip without a port", T, 0, NULL, raw_ip_no_port, NULL, 0, NULL,
         "task record: missing field 'peer' (or 'ip' with 'port' or 'rdma_ports', or 'device_ids' for ipc)"},
        {"missing peer and ip", T, 0, NULL, NULL, "peer", OMIT, NULL,
         "task record: missing field 'peer' (or 'ip' with 'port' or 'rdma_ports', or 'device_ids' for ipc)"},
        {"unknown key, 100 nested arrays", T, 0, NULL, NULL, "extra", ADD, v_nest100,
         "task record: value of unknown key 'extra' is malformed or nested too deep"},
        {"unknown key, 17 nested arrays", T, 0, NULL, NULL, "extra", ADD, v_nest17,
         "task record: value of unknown key 'extra' is malformed or nested too deep"},
        {"unknown key, ext claiming 4 GiB", T, 0, NULL, NULL, "ext", ADD, v_trunc_ext,
         "task record: value of unknown key 'ext' is malformed or nested too deep"},
        {"unknown key, invalid byte 0xc1", T, 0, NULL, NULL, "need_prefill_tokens", ADD, v_c1,
         "task record: value of unknown key 'need_prefill_tokens' is malformed"},
        {"status not a known status", KVF_REC_COMPLETION, 0, NULL, raw_completion_status, NULL, 0, NULL,
         "completion record: field 'status' is 'done', not a known status"},
        {"bool field a string", KVF_REC_CHUNK, 0, NULL, raw_chunk_last_str, NULL, 0, NULL,
         "chunk record: field 'last' must be a boolean, found string"},
        {"bool field 2", KVF_REC_CHUNK, 0, NULL, raw_chunk_last_two, NULL, 0, NULL,
         "chunk record: field 'last' must be a boolean"},
        {"hello: nonce of 31 bytes", KVF_RT_HELLO, 0, NULL, raw_hello_short_nonce, NULL, 0, NULL,
         "hello record: field 'nonce' is 31 bytes, must be 32"},
        {"hello: nonce a string", KVF_RT_HELLO, 0, NULL, raw_hello_str_nonce, NULL, 0, NULL,
         "hello record: field 'nonce' must be binary, found string"},
        {"hello: nonce claiming 4 GiB", KVF_RT_HELLO, 0, NULL, raw_hello_huge_nonce, NULL, 0, NULL,
         "hello record: field 'nonce': binary runs past the end of the record"},
        {"ping with a byte after the map", KVF_RT_PING, 0, "80c0", NULL, NULL, 0, NULL,
         "ping record: 1 trailing bytes after the map"},
        {"pong not a map", KVF_RT_PONG, 0, "90", NULL, NULL, 0, NULL,
         "pong record is not a msgpack map (found array)"},
        {"record type 1000", 1000, 0, "80", NULL, NULL, 0, NULL, "unknown record type 1000"},
        {"write batch without peer", KVF_RT_WRITE_BATCH, 0, NULL, raw_batch_no_peer, NULL, 0, NULL,
         "write batch record: missing field 'peer'"},
};
#undef T

static size_t from_hex(const char *hex, uint8_t *out, size_t cap)
{
        size_t n = strlen(hex) / 2;
        CHECK(n <= cap);
        for (size_t i = 0; i < n; i++) {
                unsigned v;
                CHECK(sscanf(hex + 2 * i, "%2x", &v) == 1);
                out[i] = (uint8_t)v;
        }
        return n;
}

static void test_malformed(void)
{
        unsigned n = sizeof(bads) / sizeof(bads[0]);
        CHECK(n >= 18);
        for (unsigned i = 0; i < n; i++) {
                const struct bad *b = &bads[i];
                msgpack_sbuffer sb;
                msgpack_packer pk;
                uint8_t hexbuf[64];
                const void *data;
                size_t len;

                msgpack_sbuffer_init(&sb);
                msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
                if (b->hex) {
                        len = from_hex(b->hex, hexbuf, sizeof(hexbuf));
                        data = hexbuf;
                } else {
                        if (b->raw)
                                b->raw(&pk);
                        else
                                pack_task(&pk, b->key, b->how, b->val);
                        data = sb.data;
                        len = sb.size;
                }
                /* A copy of exactly len bytes, so ASan sees any read past the end. */
                uint8_t *copy = malloc(len ? len : 1);
                CHECK(copy);
                if (len)
                        memcpy(copy, data, len);

                struct kvf_record r;
                kvf_err_clear();
                uint64_t t0 = kvf_now_ns();
                int rc = kvf_record_decode(b->type, copy, len, b->rank, &r);
                double dt = (double)(kvf_now_ns() - t0) / 1e9;
                if (rc != -EBADMSG || !strstr(kvf_err_msg(), b->msg)) {
                        fprintf(stderr, "malformed #%u (%s): rc %d, message \"%s\", wanted -EBADMSG "
                                        "and \"%s\"\n",
                                i, b->what, rc, kvf_err_msg(), b->msg);
                        exit(1);
                }
                /* Fail fast: a record of a few bytes never costs a walk over 2^32 entries. */
                if (dt > 0.5 && len < 4096) {
                        fprintf(stderr, "malformed #%u (%s): took %.3f s\n", i, b->what, dt);
                        exit(1);
                }
                kvf_record_free(&r);
                CHECK(r.src == NULL && r.dst == NULL && r.runs == NULL);
                free(copy);
                msgpack_sbuffer_destroy(&sb);
                printf("ok: rejected %-40s %s\n", b->what, kvf_err_msg());
        }

        /* A failure leaves no state behind: the next good record decodes. */
        msgpack_sbuffer sb;
        msgpack_packer pk;
        struct kvf_record r;
        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        raw_good_task(&pk);
        CHECK_EQ(kvf_record_decode(KVF_REC_TASK, sb.data, sb.size, 0, &r), 0);
        CHECK_STREQ("good task", r.request_id, "req-1");
        CHECK_STREQ("good task", r.peer, "10.0.0.2:7100");
        CHECK_EQ(r.n_src, 3);
        CHECK_EQ(r.src[2], 3);
        CHECK_EQ(r.current_id, 42);
        CHECK_EQ(r.transport, KVF_TRANSPORT_TCP);
        kvf_record_free(&r);
        msgpack_sbuffer_destroy(&sb);
}

/* A task whose earlier arrays were decoded before a later field failed releases them. */
static void test_partial_free(void)
{
        msgpack_sbuffer sb;
        msgpack_packer pk;
        struct kvf_record r;
        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        pack_task(&pk, "transfer_protocol", REPLACE, v_udp);
        CHECK_EQ(kvf_record_decode(KVF_REC_TASK, sb.data, sb.size, 0, &r), -EBADMSG);
        CHECK(r.src != NULL); /* decoded before the failure; freed below (ASan: no leak) */
        kvf_record_free(&r);
        CHECK(r.src == NULL && r.n_src == 0);
        kvf_record_free(&r); /* twice is harmless */
        msgpack_sbuffer_destroy(&sb);
}

/* ---- unknown keys and FastDeploy's spellings ---- */

/* FastDeploy keys kvferry does not use (device_ids only names an ipc peer without one;
 * decode_tp_size is checked against an ipc peer's group, so a task carries it once). */
static void pack_fd_extras(msgpack_packer *pk, bool with_status, bool with_devices)
{
        if (with_devices) {
                msgpack_pack_str_with_body(pk, "device_ids", 10);
                msgpack_pack_array(pk, 2);
                msgpack_pack_int(pk, 0);
                msgpack_pack_int(pk, 1);
                msgpack_pack_str_with_body(pk, "decode_tp_size", 14);
                msgpack_pack_int(pk, 2);
        } else {
                msgpack_pack_str_with_body(pk, "no_devices", 10);
                msgpack_pack_nil(pk);
                msgpack_pack_str_with_body(pk, "no_tp_size", 10);
                msgpack_pack_int(pk, 2);
        }
        if (with_status)
                pack_kv_str(pk, "status", "init"); /* FastDeploy's runtime state, not a task field */
        msgpack_pack_str_with_body(pk, "meta", 4);
        msgpack_pack_map(pk, 3);
        pack_kv_str(pk, "a", "b");
        msgpack_pack_int(pk, -7); /* non-string keys are fine inside unknown values */
        msgpack_pack_array(pk, 3);
        msgpack_pack_nil(pk);
        msgpack_pack_double(pk, 2.5);
        msgpack_pack_bin_with_body(pk, "\x00\x01", 2);
        msgpack_pack_str_with_body(pk, "deep", 4);
        v_nest(pk, 8);
        msgpack_pack_str_with_body(pk, "ext", 3);
        msgpack_pack_ext_with_body(pk, "abcd", 4, 5);
        msgpack_pack_str_with_body(pk, "", 0); /* an empty key */
        msgpack_pack_true(pk);
}

static void test_unknown_keys(void)
{
        msgpack_sbuffer sb;
        msgpack_packer pk;
        struct kvf_record r;

        /* FastDeploy's merged task dict, peer as ip + rdma_ports, extras interleaved */
        for (uint32_t rank = 0; rank < 3; rank++) {
                msgpack_sbuffer_init(&sb);
                msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
                msgpack_pack_map(&pk, 13);
                pack_fd_extras(&pk, true, true);
                pack_kv_str(&pk, "request_id", "fd-1");
                pack_kv_str(&pk, "transfer_protocol", "rdma");
                msgpack_pack_str_with_body(&pk, "src_block_ids", 13);
                msgpack_pack_array(&pk, 2);
                msgpack_pack_int(&pk, 10);
                msgpack_pack_int(&pk, 11);
                msgpack_pack_str_with_body(&pk, "dest_block_ids", 14);
                msgpack_pack_array(&pk, 1);
                msgpack_pack_int(&pk, 20);
                msgpack_pack_str_with_body(&pk, "current_id", 10);
                msgpack_pack_str_body(&pk, "\xd0\x05", 2); /* int8 5: signed encoding, value >= 0 */
                pack_kv_str(&pk, "ip", "10.0.0.2");
                msgpack_pack_str_with_body(&pk, "rdma_ports", 10);
                msgpack_pack_array(&pk, 3);
                msgpack_pack_int(&pk, 7100);
                msgpack_pack_int(&pk, 7101);
                msgpack_pack_int(&pk, 7102);
                int rc = kvf_record_decode(KVF_REC_TASK, sb.data, sb.size, rank, &r);
                if (rc) {
                        fprintf(stderr, "FastDeploy task, rank %u: %s\n", rank, kvf_err_msg());
                        exit(1);
                }
                char want[32];
                snprintf(want, sizeof(want), "10.0.0.2:%u", 7100 + rank);
                CHECK_STREQ("FastDeploy task", r.peer, want);
                CHECK_STREQ("FastDeploy task", r.request_id, "fd-1");
                CHECK_EQ(r.transport, KVF_TRANSPORT_RDMA);
                CHECK_EQ(r.current_id, 5);
                CHECK_EQ(r.n_src, 2);
                CHECK_EQ(r.src[1], 11);
                CHECK_EQ(r.n_dst, 1);
                CHECK_EQ(r.dst[0], 20);
                CHECK_EQ(r.chunked, 0);
                kvf_record_free(&r);
                msgpack_sbuffer_destroy(&sb);
        }

        /* ip + port; "chunked" as Python's 1 */
        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_map(&pk, 8);
        pack_base_but_peer(&pk);
        pack_kv_str(&pk, "ip", "192.168.7.7");
        msgpack_pack_str_with_body(&pk, "port", 4);
        msgpack_pack_uint64(&pk, 65535);
        msgpack_pack_str_with_body(&pk, "chunked", 7);
        msgpack_pack_int(&pk, 1);
        CHECK_EQ(kvf_record_decode(KVF_REC_TASK, sb.data, sb.size, 0, &r), 0);
        CHECK_STREQ("ip + port", r.peer, "192.168.7.7:65535");
        CHECK_EQ(r.chunked, 1);
        kvf_record_free(&r);
        msgpack_sbuffer_destroy(&sb);

        /* The deepest unknown value allowed. */
        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        pack_task(&pk, "extra", ADD, v_nest16);
        CHECK_EQ(kvf_record_decode(KVF_REC_TASK, sb.data, sb.size, 0, &r), 0);
        kvf_record_free(&r);
        msgpack_sbuffer_destroy(&sb);

        /* Every record type ignores unknown keys, before, between and after its own. */
        for (int t = 1; t <= KVF_RT_WIRE_MAX; t++) {
                if (!strcmp(kvf_rec_type_name(t), "unknown"))
                        continue;
                struct kvf_record in;
                uint8_t *enc;
                size_t enc_len;
                sample(t, &in);
                CHECK(kvf_record_encode_alloc(&in, &enc, &enc_len) == 0);
                struct kvf_mp m = {.p = enc, .end = enc + enc_len};
                uint32_t n;
                CHECK(kvf_mp_map(&m, &n) == 0);
                const uint8_t *first = m.p;
                if (n > 0) /* ping and pong have no fields */
                        CHECK(kvf_mp_skip(&m, 8) == 0 && kvf_mp_skip(&m, 8) == 0);
                const uint8_t *rest = m.p;

                msgpack_sbuffer_init(&sb);
                msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
                msgpack_pack_map(&pk, n + 15);
                /* (device_ids and decode_tp_size are a task's keys: once only) */
                pack_fd_extras(&pk, false, true);
                msgpack_sbuffer_write(&sb, (const char *)first, (size_t)(rest - first));
                pack_fd_extras(&pk, false, t != KVF_REC_TASK);
                msgpack_sbuffer_write(&sb, (const char *)rest, (size_t)(enc + enc_len - rest));
                pack_fd_extras(&pk, false, t != KVF_REC_TASK);
                int rc = kvf_record_decode(t, sb.data, sb.size, 0, &r);
                if (rc) {
                        fprintf(stderr, "%s with unknown keys: %s\n", kvf_rec_type_name(t),
                                kvf_err_msg());
                        exit(1);
                }
                check_same(kvf_rec_type_name(t), &in, &r);
                kvf_record_free(&r);
                kvf_record_free(&in);
                free(enc);
                msgpack_sbuffer_destroy(&sb);
        }
}

/* ---- Python ---- */

static int run_python(const char *script, const char *mode, const char *file)
{
        pid_t pid = fork();
        if (pid < 0)
                return -errno;
        if (pid == 0) {
                execl(PYTHON, PYTHON, script, mode, file, (char *)NULL);
                fprintf(stderr, "records_python: cannot run %s: %s (install python3 and "
                                "python3-msgpack: tools/kvferry setup)\n",
                        PYTHON, strerror(errno));
                _exit(127);
        }
        int st;
        while (waitpid(pid, &st, 0) < 0)
                if (errno != EINTR)
                        return -errno;
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
                fprintf(stderr, "records_python: %s %s %s failed (status 0x%x)\n", script, mode, file,
                        st);
                return -EIO;
        }
        return 0;
}

static uint8_t *read_file(const char *path, size_t *len)
{
        FILE *f = fopen(path, "rb");
        CHECK(f);
        CHECK(fseek(f, 0, SEEK_END) == 0);
        long n = ftell(f);
        CHECK(n >= 0);
        rewind(f);
        uint8_t *buf = malloc((size_t)n + 1);
        CHECK(buf);
        CHECK(fread(buf, 1, (size_t)n, f) == (size_t)n);
        fclose(f);
        *len = (size_t)n;
        return buf;
}

static uint32_t le32(const uint8_t *p)
{
        return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* What records_python.py writes, in order: (type, rank to decode with, checks). */
static void check_py_record(unsigned idx, uint32_t type, const uint8_t *p, uint32_t len)
{
        struct kvf_record r;
        uint32_t rank = idx == 1 ? 1 : 0; /* record 1 repeats record 0, read as rank 1 */
        char what[32];
        snprintf(what, sizeof(what), "python record #%u", idx);

        int rc = kvf_record_decode((int)type, p, len, rank, &r);
        if (rc) {
                fprintf(stderr, "%s (%s): %s\n", what, kvf_rec_type_name((int)type), kvf_err_msg());
                exit(1);
        }
        switch (idx) {
        case 0: /* FastDeploy merged task, RDMA: ip + rdma_ports */
        case 1:
                CHECK_EQ(type, KVF_REC_TASK);
                CHECK_STREQ(what, r.request_id, "fd-rdma-1");
                CHECK_STREQ(what, r.peer, idx == 0 ? "10.0.0.2:7100" : "10.0.0.2:7101");
                CHECK_EQ(r.transport, KVF_TRANSPORT_RDMA);
                CHECK_EQ(r.current_id, 17);
                CHECK_EQ(r.n_src, 4);
                for (uint32_t i = 0; i < 4; i++)
                        CHECK_EQ(r.src[i], 100 + i);
                CHECK_EQ(r.n_dst, 3);
                CHECK_EQ(r.dst[0], 7);
                CHECK_EQ(r.dst[2], 300);
                CHECK_EQ(r.chunked, 0);
                break;
        case 2: /* ip + port, chunked True */
                CHECK_EQ(type, KVF_REC_TASK);
                CHECK_STREQ(what, r.request_id, "fd-tcp-2");
                CHECK_STREQ(what, r.peer, "192.168.1.20:7200");
                CHECK_EQ(r.transport, KVF_TRANSPORT_TCP);
                CHECK_EQ(r.current_id, 0);
                CHECK_EQ(r.n_src, 0);
                CHECK_EQ(r.n_dst, 0);
                CHECK_EQ(r.chunked, 1);
                break;
        case 3: /* peer by instance name, 5000 ids, 64-bit step, chunked 1 */
                CHECK_EQ(type, KVF_REC_TASK);
                CHECK_STREQ(what, r.request_id, "fd-ipc-3-\xc3\xa9"); /* "é" as UTF-8 */
                CHECK_STREQ(what, r.peer, "d0");
                CHECK_EQ(r.transport, KVF_TRANSPORT_IPC);
                CHECK(r.current_id == (1ull << 40) + 5);
                CHECK_EQ(r.n_src, 5000);
                CHECK_EQ(r.n_dst, 5000);
                for (uint32_t i = 0; i < 5000; i++) {
                        CHECK_EQ(r.src[i], i * 65537u);
                        CHECK_EQ(r.dst[i], 4999 - i);
                }
                CHECK_EQ(r.chunked, 1);
                break;
        case 4:
                CHECK_EQ(type, KVF_REC_CHUNK);
                CHECK_STREQ(what, r.request_id, "fd-tcp-2");
                CHECK_EQ(r.current_id, 18);
                CHECK_EQ(r.tokens, 2048);
                CHECK_EQ(r.last, 0);
                break;
        case 5:
                CHECK_EQ(type, KVF_REC_CHUNK);
                CHECK_EQ(r.current_id, 19);
                CHECK_EQ(r.tokens, 4000);
                CHECK_EQ(r.last, 1);
                break;
        case 6:
                CHECK_EQ(type, KVF_REC_CANCEL);
                CHECK_STREQ(what, r.request_id, "fd-rdma-1");
                break;
        case 9: /* ipc by device_ids only; request_id as bin; device as a string */
                CHECK_EQ(type, KVF_REC_TASK);
                CHECK_STREQ(what, r.request_id, "fd-bytes-4");
                CHECK(r.id_bin);
                CHECK(r.device_given);
                CHECK_EQ(r.device, 6);
                CHECK_STREQ(what, r.peer, "");
                CHECK_EQ(r.transport, KVF_TRANSPORT_IPC);
                break;
        case 10: /* rdma_ports as decimal strings */
                CHECK_EQ(type, KVF_REC_TASK);
                CHECK_STREQ(what, r.peer, "10.0.0.2:7100");
                CHECK(r.peer_formed);
                CHECK(!r.id_bin);
                break;
        case 11: /* connect: task_id as bin, port as a string */
                CHECK_EQ(type, KVF_REC_CONNECT);
                CHECK_STREQ(what, r.request_id, "conn-3");
                CHECK(r.id_bin);
                CHECK_STREQ(what, r.peer, "10.0.0.3:7300");
                break;
        case 7: /* FastDeploy connect task: task_id + ip + rdma_ports */
                CHECK_EQ(type, KVF_REC_CONNECT);
                CHECK_STREQ(what, r.request_id, "conn-1");
                CHECK_STREQ(what, r.peer, "10.0.0.3:7300");
                CHECK_EQ(r.transport, KVF_TRANSPORT_RDMA);
                break;
        case 8:
                CHECK_EQ(type, KVF_REC_CONNECT);
                CHECK_STREQ(what, r.request_id, "conn-2");
                CHECK_STREQ(what, r.peer, "d1");
                CHECK_EQ(r.transport, 0);
                break;
        default:
                fprintf(stderr, "%s: more records than expected\n", what);
                exit(1);
        }
        kvf_record_free(&r);
}

#define PY_RECORDS 12

static void write_frame(FILE *f, const struct kvf_record *r)
{
        uint8_t *buf, hdr[8];
        size_t len;
        CHECK(kvf_record_encode_alloc(r, &buf, &len) == 0);
        for (int i = 0; i < 4; i++) {
                hdr[i] = (uint8_t)(r->type >> (8 * i));
                hdr[4 + i] = (uint8_t)(len >> (8 * i));
        }
        CHECK(fwrite(hdr, 1, 8, f) == 8);
        CHECK(fwrite(buf, 1, len, f) == len);
        free(buf);
}

static int python_main(const char *script, const char *base)
{
        char in[4096], out[4096];
        snprintf(in, sizeof(in), "%s.from-python", base);
        snprintf(out, sizeof(out), "%s.from-c", base);
        unlink(in);

        /* Python -> C: what a Python engine submits with kvf_submit_raw(). */
        if (run_python(script, "write", in) < 0) {
                fprintf(stderr, "FAIL: %s could not write records; is python3-msgpack installed "
                                "for %s? (tools/kvferry setup installs it)\n",
                        script, PYTHON);
                return 1;
        }
        size_t len;
        uint8_t *buf = read_file(in, &len);
        size_t off = 0;
        unsigned idx = 0;
        while (off < len) {
                CHECK(len - off >= 8);
                uint32_t type = le32(buf + off), n = le32(buf + off + 4);
                CHECK(n <= len - off - 8);
                /* Exactly n bytes, so ASan catches a read past the record. */
                uint8_t *rec = malloc(n ? n : 1);
                CHECK(rec);
                memcpy(rec, buf + off + 8, n);
                check_py_record(idx++, type, rec, n);
                free(rec);
                off += 8 + (size_t)n;
        }
        CHECK_EQ(idx, PY_RECORDS);
        free(buf);
        printf("ok: %u records from python3-msgpack decoded\n", idx);

        /* C -> Python: what a Python engine reads back. */
        FILE *f = fopen(out, "wb");
        CHECK(f);
        struct kvf_record c = {.type = KVF_REC_COMPLETION, .status = KVF_STATUS_FINISHED,
                               .bytes = 1ull << 33, .blocks = 12, .accept_ns = 1, .last_layer_ns = 2,
                               .done_ns = 3};
        fill(c.request_id, sizeof(c.request_id), "fd-rdma-1");
        fill(c.peer, sizeof(c.peer), "10.0.0.2:7100");
        write_frame(f, &c);
        struct kvf_record a = {.type = KVF_REC_ARRIVAL, .status = KVF_STATUS_TIMEOUT, .bytes = 4096,
                               .blocks = 2, .done_ns = UINT64_MAX};
        uint32_t dst[] = {5, 4294967295u};
        a.dst = dst;
        a.n_dst = 2;
        fill(a.request_id, sizeof(a.request_id), "fd-tcp-2");
        fill(a.peer, sizeof(a.peer), "p0");
        fill(a.reason, sizeof(a.reason), "no layer for 30000 ms");
        write_frame(f, &a);
        struct kvf_record cr = {.type = KVF_REC_CONNECT_RESULT, .status = KVF_STATUS_CONNECTION};
        fill(cr.request_id, sizeof(cr.request_id), "conn-1");
        fill(cr.peer, sizeof(cr.peer), "10.0.0.3:7300");
        fill(cr.reason, sizeof(cr.reason), "connect to 10.0.0.3:7300: Connection refused");
        write_frame(f, &cr);
        struct kvf_record cb = {.type = KVF_REC_COMPLETION, .status = KVF_STATUS_ENGINE_GONE, .blocks = 1,
                                .done_ns = 9, .session = 5, .id_bin = true};
        fill(cb.request_id, sizeof(cb.request_id), "fd-bytes-4");
        fill(cb.reason, sizeof(cb.reason), "engine session 5 ended");
        write_frame(f, &cb);
        CHECK(fclose(f) == 0);
        if (run_python(script, "check", out) < 0)
                return 1;
        printf("ok: records kvferry writes read back in python3-msgpack\n");
        unlink(in);
        unlink(out);
        return 0;
}

/* A rejected task still names its request when the bad field comes before request_id. */
static void test_peek_request_id(void)
{
        msgpack_sbuffer sb;
        msgpack_packer pk;
        struct kvf_record r;
        char id[KVF_REQ_ID_MAX];
        bool isbin = true;

        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_map(&pk, 3);
        msgpack_pack_str_with_body(&pk, "current_id", 10);
        msgpack_pack_str_with_body(&pk, "soon", 4);
        msgpack_pack_str_with_body(&pk, "device_ids", 10);
        msgpack_pack_array(&pk, 1);
        msgpack_pack_int(&pk, 0);
        msgpack_pack_str_with_body(&pk, "request_id", 10);
        msgpack_pack_str_with_body(&pk, "req-late", 8);
        CHECK(kvf_record_decode(KVF_REC_TASK, sb.data, sb.size, 0, &r) == -EBADMSG);
        CHECK(r.request_id[0] == '\0');
        kvf_record_free(&r);
        CHECK(kvf_record_peek_request_id(sb.data, sb.size, id, sizeof(id), &isbin) == 0);
        CHECK(!strcmp(id, "req-late") && !isbin);
        CHECK(kvf_record_peek_request_id(sb.data, sb.size - 3, id, sizeof(id), &isbin) < 0);
        CHECK(kvf_record_peek_request_id("\x91\x01", 2, id, sizeof(id), &isbin) < 0);
        msgpack_sbuffer_destroy(&sb);
        printf("ok: request_id found in a task that fails before it\n");
}

/* ---- the layout's three shapes (common/layout.h) ---- */

static void test_layout_shapes(void)
{
        struct kvf_cache_layout l, back;
        struct kvf_layout_info info;
        CHECK(kvf_layout_make(&l, 61, 1, 1u << 20, 8, 64, 128, KVF_DTYPE_FP8, 1) == 0);

        /* engine shape and back */
        kvf_layout_to_info(&l, &info);
        CHECK_EQ(info.num_layers, 61);
        CHECK_EQ(info.extra_layers, 1);
        CHECK_EQ(info.num_blocks, 1u << 20);
        CHECK_EQ(info.kv_heads, 8);
        CHECK_EQ(info.block_size, 64);
        CHECK_EQ(info.head_dim, 128);
        CHECK_EQ(info.dtype, KVF_DTYPE_FP8);
        CHECK_EQ(info.key_only, 1);
        CHECK_EQ(info.block_bytes, l.block_bytes);
        CHECK_EQ(info.cache_bytes, l.cache_bytes);
        CHECK(kvf_layout_from_info(&back, &info) == 0);
        CHECK(memcmp(&l, &back, sizeof(l)) == 0);
        info.dtype = 99; /* an engine's bad shape is refused, not copied */
        CHECK(kvf_layout_from_info(&back, &info) == -EINVAL);

        /* handshake shape, through the encoder and the decoder, and back */
        struct kvf_record r = {.type = KVF_RT_AUTH, .role = 1, .generation = 1}, d;
        uint8_t buf[1024];
        fill(r.instance, sizeof(r.instance), "p0");
        kvf_layout_to_record(&l, &r);
        int n = kvf_record_encode(&r, buf, sizeof(buf));
        CHECK(n > 0);
        CHECK(kvf_record_decode(KVF_RT_AUTH, buf, (size_t)n, 0, &d) == 0);
        CHECK(kvf_layout_from_record(&back, &d) == 0);
        CHECK(memcmp(&l, &back, sizeof(l)) == 0);
        kvf_record_free(&d);

        /* a peer's impossible or wrong layout */
        struct kvf_record bad = r;
        bad.lay_blocks = 1ull << 32;
        CHECK(kvf_layout_from_record(&back, &bad) == -EPROTO);
        CHECK_ERR_HAS("impossible layout");
        bad = r;
        bad.lay_layers = KVF_MAX_LAYERS + 1;
        CHECK(kvf_layout_from_record(&back, &bad) == -EPROTO);
        bad = r;
        bad.lay_heads = 0;
        CHECK(kvf_layout_from_record(&back, &bad) == -EINVAL);
        bad = r;
        bad.lay_keyonly = 7; /* any non-zero is key-only */
        CHECK(kvf_layout_from_record(&back, &bad) == 0);
        CHECK_EQ(back.key_only, 1);
        printf("ok: layout shapes convert both ways\n");
}

int main(int argc, char **argv)
{
        if (argc == 4 && !strcmp(argv[1], "--python"))
                return python_main(argv[2], argv[3]);
        if (argc != 1) {
                fprintf(stderr, "usage: records_test [--python SCRIPT FILE]\n");
                return 2;
        }
        test_round_trips();
        int ntypes = 0;
        for (int t = 0; t <= KVF_RT_WIRE_MAX; t++)
                ntypes += covered[t];
        printf("ok: round trips of all %d record types\n", ntypes);
        test_encode_errors();
        test_reason_text();
        test_malformed();
        test_partial_free();
        test_unknown_keys();
        printf("ok: unknown keys ignored\n");
        test_peek_request_id();
        test_layout_shapes();
        return 0;
}
