#include "records.h"

#include <errno.h>
#include <inttypes.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "mp_read.h"

enum fkind { F_STR, F_ID, F_U64, F_PORT, F_BOOL, F_IDS, F_STATUS, F_TRANSPORT, F_PORTS, F_BIN32 };

struct field {
        const char *name;
        enum fkind kind;
        size_t off;   /* of the value (F_IDS: of the pointer) */
        size_t aux;   /* F_STR: capacity; F_IDS: offset of the count */
};

#define FS(n, m) {n, F_STR, offsetof(struct kvf_record, m), sizeof(((struct kvf_record *)0)->m)}
#define FU(n, m) {n, F_U64, offsetof(struct kvf_record, m), 0}
#define FB(n, m) {n, F_BOOL, offsetof(struct kvf_record, m), 0}
#define FI(n, m, c) {n, F_IDS, offsetof(struct kvf_record, m), offsetof(struct kvf_record, c)}

enum fid {
        REQUEST_ID, TASK_ID, PEER, REASON, IP, PORT, RDMA_PORTS, CURRENT_ID, TOKENS_DONE, LAST,
        CHUNKED, SRC, DST, RUNS, KEY, LAYER, STATUS, PROTOCOL, BYTES, BLOCKS, ACCEPT_NS,
        LAST_LAYER_NS, DONE_NS, GENERATION, UP, INSTANCE, PURPOSE, ROLE, PROTO, BOOT_ID, NONCE,
        PROOF, LAYER_COUNT, L_LAYERS, L_EXTRA, L_BLOCKS, L_HEADS, L_BSIZE, L_HDIM, L_DTYPE, L_KEYONLY,
        L_RANK, L_NRANKS, L_TOKEN_MAJOR, L_SCALE_DTYPE, DECODE_TP,
        SESSION, WITHDRAW, DEVICE_IDS, PEER_SESSION, RDMA_PORT, RDMA_ADDR, RDMA_LEN, RDMA_RKEY,
        RDMA_TICKET, RDMA_PARTS, NFIELDS
};

static const struct field fields[NFIELDS] = {
        /* F_ID: a string, or (FastDeploy engines sending bytes) bin, echoed back as it came */
        [REQUEST_ID] = {"request_id", F_ID, offsetof(struct kvf_record, request_id), KVF_REQ_ID_MAX},
        [TASK_ID] = {"task_id", F_ID, offsetof(struct kvf_record, request_id), KVF_REQ_ID_MAX},
        [PEER] = FS("peer", peer),
        [REASON] = FS("reason", reason),
        [IP] = FS("ip", ip),
        /* FastDeploy reads ports with int(...): integers or decimal strings */
        [PORT] = {"port", F_PORT, offsetof(struct kvf_record, port), 0},
        [RDMA_PORTS] = {"rdma_ports", F_PORTS, offsetof(struct kvf_record, port), 0},
        [DEVICE_IDS] = {"device_ids", F_PORTS, offsetof(struct kvf_record, device), 0},
        [CURRENT_ID] = FU("current_id", current_id),
        [TOKENS_DONE] = FU("tokens_done", tokens),
        [LAST] = FB("last", last),
        [CHUNKED] = FB("chunked", chunked),
        [SRC] = FI("src_block_ids", src, n_src),
        [DST] = FI("dest_block_ids", dst, n_dst),
        [RUNS] = FI("runs", runs, n_runs),
        [KEY] = FU("key", key),
        [LAYER] = FU("layer", layer),
        [STATUS] = {"status", F_STATUS, offsetof(struct kvf_record, status), 0},
        [PROTOCOL] = {"transfer_protocol", F_TRANSPORT, offsetof(struct kvf_record, transport), 0},
        [BYTES] = FU("bytes", bytes),
        [BLOCKS] = FU("blocks", blocks),
        [ACCEPT_NS] = FU("accept_ns", accept_ns),
        [LAST_LAYER_NS] = FU("last_layer_ns", last_layer_ns),
        [DONE_NS] = FU("done_ns", done_ns),
        [GENERATION] = FU("generation", generation),
        [UP] = FB("up", up),
        [INSTANCE] = FS("instance", instance),
        [PURPOSE] = FS("purpose", purpose),
        [ROLE] = FU("role", role),
        [PROTO] = FU("proto", proto),
        [BOOT_ID] = FU("boot_id", boot_id),
        [NONCE] = {"nonce", F_BIN32, offsetof(struct kvf_record, nonce), 32},
        [PROOF] = {"proof", F_BIN32, offsetof(struct kvf_record, proof), 32},
        [LAYER_COUNT] = FU("layer_count", layer_count),
        [L_LAYERS] = FU("layers", lay_layers),
        [L_EXTRA] = FU("extra_layers", lay_extra),
        [L_BLOCKS] = FU("num_blocks", lay_blocks),
        [L_HEADS] = FU("kv_heads", lay_heads),
        [L_BSIZE] = FU("block_size", lay_bsize),
        [L_HDIM] = FU("head_dim", lay_hdim),
        [L_DTYPE] = FU("dtype", lay_dtype),
        [L_KEYONLY] = FU("key_only", lay_keyonly),
        [L_RANK] = FU("rank", lay_rank),
        [L_NRANKS] = FU("nranks", lay_nranks),
        [L_TOKEN_MAJOR] = FU("token_major", lay_token_major),
        [L_SCALE_DTYPE] = FU("scale_dtype", lay_scale_dtype),
        [DECODE_TP] = FU("decode_tp_size", decode_tp),
        [SESSION] = FU("session", session),
        [WITHDRAW] = FB("withdraw", withdraw),
        [PEER_SESSION] = FU("peer_session", peer_session),
        [RDMA_PORT] = FU("rdma_port", rdma_port),
        [RDMA_ADDR] = FU("rdma_addr", rdma_addr),
        [RDMA_LEN] = FU("rdma_len", rdma_len),
        [RDMA_RKEY] = FU("rdma_rkey", rdma_rkey),
        [RDMA_TICKET] = {"rdma_ticket", F_BIN32, offsetof(struct kvf_record, rdma_ticket), 32},
        [RDMA_PARTS] = FI("rdma_parts", rdma_parts, n_rdma_parts),
};
_Static_assert(NFIELDS <= 64, "fields are tracked in a 64-bit mask");

/* Per type: the fields it carries. R = required, D = accepted on decode only, Z = written
 * only when not zero (all its bytes). */
#define R 1u
#define D 2u
#define Z 4u
struct use {
        uint8_t f;
        uint8_t flags;
};
struct spec {
        const char *name;
        const struct use *uses;
        unsigned n;
        bool needs_peer; /* peer, or ip with port / rdma_ports */
};

#define USES(...) (const struct use[]){__VA_ARGS__}, sizeof((const struct use[]){__VA_ARGS__}) / sizeof(struct use)

#define LAYOUT_USES {L_LAYERS, R}, {L_EXTRA, R}, {L_BLOCKS, R}, {L_HEADS, R}, {L_BSIZE, R}, \
                {L_HDIM, R}, {L_DTYPE, R}, {L_KEYONLY, R}, {L_RANK, Z}, {L_NRANKS, Z}, \
                {L_TOKEN_MAJOR, Z}, {L_SCALE_DTYPE, Z}

static const struct spec specs[KVF_RT_WIRE_MAX + 1] = {
        [KVF_REC_TASK] = {"task",
                         USES({REQUEST_ID, R}, {SRC, R}, {DST, R}, {CURRENT_ID, R}, {PROTOCOL, R},
                              {PEER, 0}, {CHUNKED, 0}, {PEER_SESSION, 0}, {IP, D}, {PORT, D},
                              {RDMA_PORTS, D}, {DEVICE_IDS, D}, {DECODE_TP, D}),
                         true},
        [KVF_REC_CHUNK] = {"chunk", USES({REQUEST_ID, R}, {CURRENT_ID, R}, {TOKENS_DONE, R}, {LAST, 0}),
                          false},
        [KVF_REC_CANCEL] = {"cancel", USES({REQUEST_ID, R}), false},
        [KVF_REC_COMPLETION] = {"completion",
                               USES({REQUEST_ID, R}, {STATUS, R}, {REASON, 0}, {PEER, 0},
                                    {BYTES, 0}, {BLOCKS, 0}, {ACCEPT_NS, 0}, {LAST_LAYER_NS, 0},
                                    {DONE_NS, 0}, {SESSION, 0}),
                               false},
        [KVF_REC_CONNECT] = {"connect",
                            USES({TASK_ID, R}, {PEER, 0}, {PROTOCOL, 0}, {IP, D}, {PORT, D},
                                 {RDMA_PORTS, D}),
                            true},
        [KVF_REC_CONNECT_RESULT] = {"connect result",
                                   USES({TASK_ID, R}, {PEER, 0}, {STATUS, R}, {REASON, 0},
                                        {SESSION, 0}),
                                   false},
        [KVF_REC_ARRIVAL] = {"arrival",
                            USES({REQUEST_ID, R}, {STATUS, R}, {REASON, 0}, {PEER, 0}, {BYTES, 0},
                                 {BLOCKS, 0}, {DST, 0}, {DONE_NS, 0}, {SESSION, 0}, {ACCEPT_NS, Z}),
                            false},
        [KVF_RT_WRITE_BATCH] = {"write batch",
                                USES({KEY, R}, {REQUEST_ID, R}, {PEER, R}, {LAYER, R},
                                     {LAYER_COUNT, R}, {RUNS, R}, {PROTOCOL, R}),
                                false},
        [KVF_RT_FINISH] = {"finish",
                           USES({KEY, R}, {REQUEST_ID, R}, {PEER, R}, {PROTOCOL, R}, {DST, R},
                                {STATUS, R}, {REASON, 0}, {BYTES, 0}, {BLOCKS, 0}, {GENERATION, 0},
                                {SESSION, 0}, {WITHDRAW, 0}, {DONE_NS, Z}),
                           false},
        [KVF_RT_WRITE_RESULT] = {"write result",
                                 USES({KEY, R}, {REQUEST_ID, R}, {STATUS, R}, {REASON, 0},
                                      {BYTES, 0}),
                                 false},
        [KVF_RT_PEER_STATE] = {"peer state",
                               USES({PEER, R}, {UP, R}, {GENERATION, 0}, {REASON, 0}, {SESSION, 0},
                                    {L_BSIZE, Z}),
                               false},
        [KVF_RT_DISCONNECT] = {"disconnect", USES({PEER, R}), false},
        [KVF_RT_OPEN] = {"open",
                         USES({KEY, R}, {REQUEST_ID, R}, {PEER, R}, {PROTOCOL, R}, {DST, R},
                              {BYTES, 0}, {SESSION, 0}, {BLOCKS, Z}),
                         false},
        [KVF_RT_HELLO] = {"hello", USES({PROTO, R}, {NONCE, R}, {PURPOSE, R}), false},
        [KVF_RT_CHALLENGE] = {"challenge", USES({NONCE, R}, {PROOF, R}), false},
        [KVF_RT_AUTH] = {"auth",
                         USES({PROOF, R}, {INSTANCE, R}, {ROLE, R}, {GENERATION, R}, {BOOT_ID, R},
                              LAYOUT_USES),
                         false},
        [KVF_RT_WELCOME] = {"welcome",
                            USES({INSTANCE, R}, {ROLE, R}, {GENERATION, R}, {BOOT_ID, R},
                                 LAYOUT_USES, {RDMA_PORT, Z}, {RDMA_ADDR, Z}, {RDMA_LEN, Z},
                                 {RDMA_RKEY, Z}, {RDMA_TICKET, Z}, {RDMA_PARTS, Z}),
                            false},
        [KVF_RT_REFUSE] = {"refuse", USES({STATUS, R}, {REASON, 0}), false},
        [KVF_RT_NOTICE] = {"notice",
                           USES({KEY, R}, {REQUEST_ID, R}, {PEER, R}, {PROTOCOL, R}, {DST, R},
                                {STATUS, R}, {REASON, 0}, {BYTES, 0}, {BLOCKS, 0}, {GENERATION, 0},
                                {SESSION, 0}, {WITHDRAW, 0}, {DONE_NS, Z}),
                           false},
        [KVF_RT_ACK] = {"ack", USES({KEY, R}, {REQUEST_ID, R}, {STATUS, R}, {REASON, 0}, {SESSION, 0}),
                        false},
        [KVF_RT_PING] = {"ping", NULL, 0, false},
        [KVF_RT_PONG] = {"pong", USES({SESSION, 0}), false},
        [KVF_RT_XOPEN] = {"xopen", USES({KEY, R}, {REQUEST_ID, R}, {DST, R}, {SESSION, 0}, {BLOCKS, Z}),
                          false},
};

const char *kvf_rec_type_name(int type)
{
        return type > 0 && type <= KVF_RT_WIRE_MAX && specs[type].name ? specs[type].name : "unknown";
}

static const char *const transports[] = {NULL, "ipc", "tcp", "rdma"};

const char *kvf_transport_name(int t)
{
        return t >= KVF_TRANSPORT_IPC && t <= KVF_TRANSPORT_RDMA ? transports[t] : "?";
}

int kvf_transport_from_name(const char *s, size_t n)
{
        for (int t = KVF_TRANSPORT_IPC; t <= KVF_TRANSPORT_RDMA; t++)
                if (strlen(transports[t]) == n && !memcmp(s, transports[t], n))
                        return t;
        return -1;
}

void kvf_record_free(struct kvf_record *r)
{
        free(r->src);
        free(r->dst);
        free(r->runs);
        free(r->rdma_parts);
        r->src = r->dst = r->runs = r->rdma_parts = NULL;
        r->n_src = r->n_dst = r->n_runs = r->n_rdma_parts = 0;
}

/* ---- decoding ---- */

static int type_err(const char *field, const char *want, const struct kvf_mp *m)
{
        return kvf_err_set(-EBADMSG, "field '%s' must be %s, found %s", field, want,
                           kvf_mp_kind_name(kvf_mp_peek(m)));
}

size_t kvf_utf8_seq(const uint8_t *p, size_t n)
{
        uint8_t c = p[0];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!len || len > n)
                return 0;
        uint32_t cp = len == 1 ? c : c & (0x7f >> len);
        for (size_t k = 1; k < len; k++) {
                if ((p[k] & 0xc0) != 0x80)
                        return 0;
                cp = (cp << 6) | (p[k] & 0x3f);
        }
        /* no overlong forms, no surrogates, nothing past U+10FFFF */
        static const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < min[len] || (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff)
                return 0;
        return len;
}

/*
 * Strings come back to engines (a completion echoes the request id), and a
 * Python engine decoding with raw=False fails on invalid UTF-8: refuse it here.
 */
static bool utf8_ok(const uint8_t *p, uint32_t n)
{
        for (size_t i = 0, len; i < n; i += len)
                if (!(len = kvf_utf8_seq(p + i, n - i)))
                        return false;
        return true;
}

size_t kvf_text_clean(char *dst, size_t cap, const char *src, size_t n)
{
        static const char hex[] = "0123456789abcdef";
        const uint8_t *p = (const uint8_t *)src;
        size_t o = 0;
        if (!cap)
                return 0;
        for (size_t i = 0; i < n && p[i];) {
                size_t len = kvf_utf8_seq(p + i, n - i);
                if (len) {
                        if (o + len >= cap)
                                break; /* never half a character */
                        memcpy(dst + o, p + i, len);
                        o += len;
                        i += len;
                        continue;
                }
                if (o + 4 >= cap)
                        break;
                dst[o++] = '\\';
                dst[o++] = 'x';
                dst[o++] = hex[p[i] >> 4];
                dst[o++] = hex[p[i] & 15];
                i++;
        }
        dst[o] = '\0';
        return o;
}

static int dec_str(struct kvf_mp *m, const struct field *f, char *dst, const char **raw,
                   uint32_t *rawlen)
{
        const char *s;
        uint32_t n;
        if (kvf_mp_peek(m) != KVF_MP_STR)
                return type_err(f->name, "a string", m);
        if (kvf_mp_str(m, &s, &n) < 0)
                return kvf_err_set(-EBADMSG, "field '%s': string runs past the end of the record",
                                   f->name);
        if (raw) {
                *raw = s;
                *rawlen = n;
                return 0;
        }
        if (n == 0)
                return kvf_err_set(-EBADMSG, "field '%s' is empty", f->name);
        if (n >= f->aux)
                return kvf_err_set(-EBADMSG, "field '%s' is %u bytes long, at most %zu allowed",
                                   f->name, n, f->aux - 1);
        if (memchr(s, 0, n))
                return kvf_err_set(-EBADMSG, "field '%s' contains a NUL byte", f->name);
        if (!utf8_ok((const uint8_t *)s, n))
                return kvf_err_set(-EBADMSG, "field '%s' is not valid UTF-8", f->name);
        memcpy(dst, s, n);
        dst[n] = '\0';
        return 0;
}

/* A reason: text for people, never refused for its bytes (a peer's reason may quote an id
 * given as bytes, or be another build's): kept as valid UTF-8, other bytes as \\xNN, cut at
 * a character's end when it does not fit. */
static int dec_text(struct kvf_mp *m, const struct field *f, char *dst)
{
        const char *s;
        uint32_t n;
        if (kvf_mp_peek(m) != KVF_MP_STR)
                return type_err(f->name, "a string", m);
        if (kvf_mp_str(m, &s, &n) < 0)
                return kvf_err_set(-EBADMSG, "field '%s': string runs past the end of the record", f->name);
        kvf_text_clean(dst, f->aux, s, n);
        return 0;
}

static int dec_u64(struct kvf_mp *m, const char *name, uint64_t *v)
{
        enum kvf_mp_kind k = kvf_mp_peek(m);
        if (k != KVF_MP_UINT && k != KVF_MP_NINT)
                return type_err(name, "a non-negative integer", m);
        int64_t s;
        struct kvf_mp save = *m;
        if (kvf_mp_uint(m, v) == 0)
                return 0;
        if (kvf_mp_int(&save, &s) == 0)
                return kvf_err_set(-EBADMSG, "field '%s' must be a non-negative integer, found %" PRId64,
                                   name, s);
        return kvf_err_set(-EBADMSG, "field '%s': integer runs past the end of the record", name);
}

/*
 * A request or task id: a string as any other, or msgpack bin (a Python engine
 * packing bytes ids): 1 to cap - 1 bytes without NUL, not necessarily UTF-8,
 * since it goes back as bin.
 */
static int dec_id(struct kvf_mp *m, const struct field *f, struct kvf_record *r)
{
        const uint8_t *b;
        uint32_t n;
        if (kvf_mp_peek(m) != KVF_MP_BIN)
                return dec_str(m, f, (char *)r + f->off, NULL, NULL);
        if (kvf_mp_bin(m, &b, &n) < 0)
                return kvf_err_set(-EBADMSG, "field '%s': binary runs past the end of the record",
                                   f->name);
        if (n == 0)
                return kvf_err_set(-EBADMSG, "field '%s' is empty", f->name);
        if (n >= f->aux)
                return kvf_err_set(-EBADMSG, "field '%s' is %u bytes long, at most %zu allowed",
                                   f->name, n, f->aux - 1);
        if (memchr(b, 0, n))
                return kvf_err_set(-EBADMSG, "field '%s' contains a NUL byte", f->name);
        memcpy((char *)r + f->off, b, n);
        ((char *)r + f->off)[n] = '\0';
        r->id_bin = true;
        return 0;
}

/*
 * A port or device number as FastDeploy passes it (it reads them with int()):
 * a non-negative integer, or a string of 1 to 10 decimal digits.
 */
static int dec_number(struct kvf_mp *m, const char *name, uint64_t *v)
{
        const char *s;
        uint32_t n;
        if (kvf_mp_peek(m) != KVF_MP_STR)
                return dec_u64(m, name, v);
        if (kvf_mp_str(m, &s, &n) < 0)
                return kvf_err_set(-EBADMSG, "field '%s': string runs past the end of the record", name);
        uint64_t x = 0;
        for (uint32_t i = 0; i < n; i++) {
                if (s[i] < '0' || s[i] > '9' || n > 10)
                        return kvf_err_set(-EBADMSG, "field '%s' is '%.*s': not a decimal number", name,
                                           (int)(n > 32 ? 32 : n), s);
                x = x * 10 + (uint64_t)(s[i] - '0');
        }
        if (n == 0)
                return kvf_err_set(-EBADMSG, "field '%s' is an empty string, not a number", name);
        *v = x;
        return 0;
}

static int dec_ids(struct kvf_mp *m, const char *name, uint32_t **out, uint32_t *count)
{
        /* Stays 0 when the header itself is cut short (kvf_mp_array then leaves it unset). */
        uint32_t n = 0;
        if (kvf_mp_peek(m) != KVF_MP_ARRAY)
                return type_err(name, "an array of block ids", m);
        if (kvf_mp_array(m, &n) < 0) {
                if (n == 0)
                        return kvf_err_set(-EBADMSG,
                                           "field '%s': array header runs past the end of the record",
                                           name);
                return kvf_err_set(-EBADMSG, "field '%s': array of %u runs past the end of the record",
                                   name, n);
        }
        if (n > KVF_MAX_RECORD_IDS)
                return kvf_err_set(-EBADMSG, "field '%s' has %u entries, at most %u allowed", name, n,
                                   KVF_MAX_RECORD_IDS);
        uint32_t *ids = malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
        if (!ids)
                return kvf_err_set(-ENOMEM, "field '%s': out of memory for %u ids", name, n);
        for (uint32_t i = 0; i < n; i++) {
                uint64_t v;
                enum kvf_mp_kind k = kvf_mp_peek(m);
                int64_t s;
                struct kvf_mp save = *m;
                if (k != KVF_MP_UINT && k != KVF_MP_NINT) {
                        kvf_err_set(-EBADMSG, "field '%s'[%u] must be a non-negative integer, found %s",
                                    name, i, kvf_mp_kind_name(k));
                        goto fail;
                }
                if (kvf_mp_uint(m, &v) < 0) {
                        if (kvf_mp_int(&save, &s) == 0)
                                kvf_err_set(-EBADMSG, "field '%s'[%u] is negative (%" PRId64 ")", name,
                                            i, s);
                        else
                                kvf_err_set(-EBADMSG, "field '%s'[%u]: integer runs past the end",
                                            name, i);
                        goto fail;
                }
                if (v > UINT32_MAX) {
                        kvf_err_set(-EBADMSG, "field '%s'[%u] = %" PRIu64 " does not fit 32 bits",
                                    name, i, v);
                        goto fail;
                }
                ids[i] = (uint32_t)v;
        }
        free(*out);
        *out = ids;
        *count = n;
        return 0;
fail:
        free(ids);
        return -EBADMSG;
}

/* A per-rank list (rdma_ports, device_ids) that stops before this rank's entry. */
static int no_rank_entry(const char *name, uint32_t n, uint32_t rank)
{
        return kvf_err_set(-EBADMSG, "field '%s' has %u entries, none for rank %u", name, n, rank);
}

static int dec_field(struct kvf_mp *m, const struct field *f, struct kvf_record *r, uint32_t rank)
{
        char *base = (char *)r;
        const char *s = NULL; /* set by dec_str before any use; -O3 cannot tell (Release) */
        uint32_t n = 0;
        uint64_t v;
        int rc;

        switch (f->kind) {
        case F_STR:
                if (f == &fields[REASON])
                        return dec_text(m, f, base + f->off);
                return dec_str(m, f, base + f->off, NULL, NULL);
        case F_ID:
                return dec_id(m, f, r);
        case F_U64:
                return dec_u64(m, f->name, (uint64_t *)(void *)(base + f->off));
        case F_PORT:
                return dec_number(m, f->name, (uint64_t *)(void *)(base + f->off));
        case F_BOOL: {
                bool b;
                if (kvf_mp_peek(m) == KVF_MP_BOOL) {
                        kvf_mp_bool(m, &b);
                } else if (kvf_mp_peek(m) == KVF_MP_UINT) {
                        /* Python engines sometimes send 0/1 */
                        if (dec_u64(m, f->name, &v) < 0 || v > 1)
                                return kvf_err_set(-EBADMSG, "field '%s' must be a boolean", f->name);
                        b = v == 1;
                } else {
                        return type_err(f->name, "a boolean", m);
                }
                *(bool *)(base + f->off) = b;
                return 0;
        }
        case F_IDS:
                return dec_ids(m, f->name, (uint32_t **)(void *)(base + f->off),
                               (uint32_t *)(void *)(base + f->aux));
        case F_STATUS:
                if ((rc = dec_str(m, f, NULL, &s, &n)) < 0)
                        return rc;
                for (int st = 0; st < KVF_STATUS_COUNT; st++) {
                        const char *name = kvf_status_name(st);
                        if (strlen(name) == n && !memcmp(name, s, n)) {
                                r->status = st;
                                return 0;
                        }
                }
                return kvf_err_set(-EBADMSG, "field 'status' is '%.*s', not a known status",
                                   (int)(n > 64 ? 64 : n), s);
        case F_TRANSPORT:
                if ((rc = dec_str(m, f, NULL, &s, &n)) < 0)
                        return rc;
                r->transport = kvf_transport_from_name(s, n);
                if (r->transport < 0)
                        return kvf_err_set(-EBADMSG,
                                           "field 'transfer_protocol' is '%.*s': expected ipc, tcp or rdma",
                                           (int)(n > 64 ? 64 : n), s);
                return 0;
        case F_BIN32: {
                const uint8_t *b;
                if (kvf_mp_peek(m) != KVF_MP_BIN)
                        return type_err(f->name, "binary", m);
                if (kvf_mp_bin(m, &b, &n) < 0)
                        return kvf_err_set(-EBADMSG, "field '%s': binary runs past the end of the record",
                                           f->name);
                if (n != f->aux)
                        return kvf_err_set(-EBADMSG, "field '%s' is %u bytes, must be %zu", f->name, n,
                                           f->aux);
                memcpy(base + f->off, b, n);
                return 0;
        }
        case F_PORTS: {
                /* One entry per rank, integers or decimal strings; only ours is kept. */
                bool dev = f->off == offsetof(struct kvf_record, device);
                uint32_t np = 0;
                if (kvf_mp_peek(m) != KVF_MP_ARRAY)
                        return type_err(f->name, "an array", m);
                if (kvf_mp_array(m, &np) < 0)
                        return kvf_err_set(-EBADMSG, "field '%s': array runs past the end of the record",
                                           f->name);
                char elem[48];
                for (uint32_t i = 0; i < np; i++) {
                        snprintf(elem, sizeof(elem), "%s[%u]", f->name, i);
                        if ((rc = dec_number(m, elem, &v)) < 0)
                                return rc;
                        if (v > UINT32_MAX)
                                return kvf_err_set(-EBADMSG, "field '%s'[%u] = %llu does not fit 32 bits",
                                                   f->name, i, (unsigned long long)v);
                        /* Instances take --device 0 to 65535; above is no device, and 2^32 - 1
                         * is what an instance without --device says it uses (KVF_DEVICE_NONE). */
                        if (dev && v > 65535)
                                return kvf_err_set(-EBADMSG,
                                                   "field '%s'[%u] = %llu is not a device (0 to 65535)",
                                                   f->name, i, (unsigned long long)v);
                        if (i == rank)
                                *(uint64_t *)(void *)(base + f->off) = v;
                }
                if (rank >= np && dev) {
                        /* Needed only by an ipc task without a peer (checked there). */
                        r->device = UINT64_MAX;
                        r->n_device_ids = np;
                        return 0;
                }
                if (rank >= np)
                        return no_rank_entry(f->name, np, rank);
                return 0;
        }
        }
        return -EINVAL;
}

int kvf_record_decode(int type, const void *buf, size_t len, uint32_t rank,
                      struct kvf_record *out)
{
        struct kvf_mp m = {.p = buf, .end = (const uint8_t *)buf + len};
        /* Stays 0 when the map header itself is cut short: an empty map never fails. */
        uint32_t n = 0;
        int rc;

        memset(out, 0, sizeof(*out));
        if (type <= 0 || type > KVF_RT_WIRE_MAX || !specs[type].name)
                return kvf_err_set(-EBADMSG, "unknown record type %d", type);
        out->type = (uint16_t)type;
        const struct spec *sp = &specs[type];
        if (len == 0)
                return kvf_err_set(-EBADMSG, "empty %s record", sp->name);
        if (kvf_mp_peek(&m) != KVF_MP_MAP)
                return kvf_err_set(-EBADMSG, "%s record is not a msgpack map (found %s)", sp->name,
                                   kvf_mp_kind_name(kvf_mp_peek(&m)));
        if (kvf_mp_map(&m, &n) < 0) {
                if (n == 0)
                        return kvf_err_set(-EBADMSG, "%s record: map header runs past the end (%zu bytes)",
                                           sp->name, len);
                return kvf_err_set(-EBADMSG, "%s record: map of %u entries runs past the end (%zu bytes)",
                                   sp->name, n, len);
        }
        for (uint32_t i = 0; i < n; i++) {
                const char *k;
                uint32_t kl;
                if (kvf_mp_peek(&m) != KVF_MP_STR)
                        return kvf_err_set(-EBADMSG, "%s record: key #%u is not a string (found %s)",
                                           sp->name, i, kvf_mp_kind_name(kvf_mp_peek(&m)));
                if (kvf_mp_str(&m, &k, &kl) < 0)
                        return kvf_err_set(-EBADMSG, "%s record: key #%u runs past the end", sp->name,
                                           i);
                const struct field *f = NULL;
                unsigned fid = 0;
                for (unsigned u = 0; u < sp->n; u++) {
                        const struct field *c = &fields[sp->uses[u].f];
                        if (strlen(c->name) == kl && !memcmp(c->name, k, kl)) {
                                f = c;
                                fid = sp->uses[u].f;
                                break;
                        }
                }
                if (!f) {
                        if (kvf_mp_skip(&m, 16) < 0)
                                return kvf_err_set(-EBADMSG,
                                                   "%s record: value of unknown key '%.*s' is malformed or nested too deep",
                                                   sp->name, (int)(kl > 64 ? 64 : kl), k);
                        continue;
                }
                if (out->present & (1ull << fid))
                        return kvf_err_set(-EBADMSG, "%s record: field '%s' appears twice", sp->name,
                                           f->name);
                uint64_t before = out->port;
                if ((rc = dec_field(&m, f, out, rank)) < 0)
                        return kvf_err_ctx(rc, "%s record", sp->name);
                out->present |= 1ull << fid;
                /* port and rdma_ports[rank] both fill `port`: FastDeploy may send both, but
                 * two different ports name no peer (and map order must not pick one). */
                const uint64_t both = (1ull << PORT) | (1ull << RDMA_PORTS);
                if ((fid == PORT || fid == RDMA_PORTS) && (out->present & both) == both &&
                    out->port != before) {
                        uint64_t p = fid == PORT ? out->port : before;
                        uint64_t rp = fid == PORT ? before : out->port;
                        return kvf_err_set(-EBADMSG,
                                           "%s record: fields 'port' (%llu) and 'rdma_ports'[%u] (%llu) disagree",
                                           sp->name, (unsigned long long)p, rank, (unsigned long long)rp);
                }
        }
        if (m.p != m.end)
                return kvf_err_set(-EBADMSG, "%s record: %zu trailing bytes after the map", sp->name,
                                   (size_t)(m.end - m.p));
        for (unsigned u = 0; u < sp->n; u++)
                if ((sp->uses[u].flags & R) && !(out->present & (1ull << sp->uses[u].f)))
                        return kvf_err_set(-EBADMSG, "%s record: missing field '%s'", sp->name,
                                           fields[sp->uses[u].f].name);
        out->device_given = (out->present & (1ull << DEVICE_IDS)) && out->device != UINT64_MAX;
        if (sp->needs_peer && !(out->present & (1ull << PEER))) {
                bool have_port = out->present & ((1ull << PORT) | (1ull << RDMA_PORTS));
                bool have_ip = out->present & (1ull << IP);
                /* FastDeploy's ipc tasks name the peer by its device alone: the sender finds it. */
                if ((out->present & (1ull << DEVICE_IDS)) && out->transport == KVF_TRANSPORT_IPC &&
                    !(have_ip && have_port)) {
                        if (!out->device_given) {
                                rc = no_rank_entry("device_ids", out->n_device_ids, rank);
                                return kvf_err_ctx(rc, "%s record", sp->name);
                        }
                        return 0;
                }
                if (!have_ip || !have_port)
                        return kvf_err_set(-EBADMSG,
                                           "%s record: missing field 'peer' (or 'ip' with 'port' or 'rdma_ports'%s)",
                                           sp->name, type == KVF_REC_TASK ? ", or 'device_ids' for ipc" : "");
                if (out->port == 0 || out->port > 65535)
                        return kvf_err_set(-EBADMSG, "%s record: port %llu is not in [1, 65535]",
                                           sp->name, (unsigned long long)out->port);
                int w = snprintf(out->peer, sizeof(out->peer), "%s:%llu", out->ip,
                                 (unsigned long long)out->port);
                if (w < 0 || (size_t)w >= sizeof(out->peer))
                        return kvf_err_set(-EBADMSG, "%s record: 'ip' is too long", sp->name);
                out->peer_formed = true;
        }
        return 0;
}

/* ---- encoding ---- */

struct sink {
        uint8_t *p;
        size_t len, cap;
        bool overflow;
};

static int sink_write(void *data, const char *buf, size_t len)
{
        struct sink *s = data;
        if (s->overflow || len > s->cap - s->len) {
                s->overflow = true;
                return -1;
        }
        memcpy(s->p + s->len, buf, len);
        s->len += len;
        return 0;
}

static void pack_str(msgpack_packer *pk, const char *s)
{
        size_t n = strlen(s);
        msgpack_pack_str(pk, n);
        msgpack_pack_str_body(pk, s, n);
}

static bool all_zero(const void *p, size_t n)
{
        const uint8_t *b = p;
        for (size_t i = 0; i < n; i++)
                if (b[i])
                        return false;
        return true;
}

static bool has_value(const struct field *f, unsigned flags, const struct kvf_record *r)
{
        const char *base = (const char *)r;
        if (flags & Z)
                return !all_zero(base + f->off, f->kind == F_BIN32 ? f->aux : sizeof(uint64_t));
        switch (f->kind) {
        case F_STR:
        case F_ID:
                return base[f->off] != '\0';
        case F_TRANSPORT:
                return r->transport >= KVF_TRANSPORT_IPC && r->transport <= KVF_TRANSPORT_RDMA;
        default:
                return true;
        }
}

int kvf_record_encode(const struct kvf_record *r, void *buf, size_t cap)
{
        struct sink s = {.p = buf, .cap = cap};
        msgpack_packer pk;
        const char *base = (const char *)r;

        if (r->type == 0 || r->type > KVF_RT_WIRE_MAX || !specs[r->type].name)
                return kvf_err_set(-EINVAL, "cannot encode record type %d", r->type);
        const struct spec *sp = &specs[r->type];
        msgpack_packer_init(&pk, &s, sink_write);
        unsigned n = 0;
        for (unsigned u = 0; u < sp->n; u++)
                if (!(sp->uses[u].flags & D) && has_value(&fields[sp->uses[u].f], sp->uses[u].flags, r))
                        n++;
        msgpack_pack_map(&pk, n);
        for (unsigned u = 0; u < sp->n; u++) {
                const struct field *f = &fields[sp->uses[u].f];
                if ((sp->uses[u].flags & D) || !has_value(f, sp->uses[u].flags, r))
                        continue;
                pack_str(&pk, f->name);
                switch (f->kind) {
                case F_STR: {
                        /* What kvferry writes is UTF-8 whatever it quotes (a reason names an id
                         * given as bytes, or was cut mid-character): readers refuse other str. */
                        const char *v = base + f->off;
                        size_t vn = strnlen(v, f->aux);
                        char clean[256]; /* (every str field is smaller: records.h) */
                        if (!utf8_ok((const uint8_t *)v, (uint32_t)vn)) {
                                kvf_text_clean(clean, f->aux < sizeof(clean) ? f->aux : sizeof(clean), v, vn);
                                v = clean;
                        }
                        pack_str(&pk, v);
                        break;
                }
                case F_ID:
                        if (r->id_bin) {
                                size_t idn = strlen(base + f->off);
                                msgpack_pack_bin(&pk, idn);
                                msgpack_pack_bin_body(&pk, base + f->off, idn);
                        } else {
                                pack_str(&pk, base + f->off);
                        }
                        break;
                case F_PORT:
                case F_U64:
                        msgpack_pack_uint64(&pk, *(const uint64_t *)(const void *)(base + f->off));
                        break;
                case F_BOOL:
                        if (*(const bool *)(base + f->off)) {
                                msgpack_pack_true(&pk);
                        } else {
                                msgpack_pack_false(&pk);
                        }
                        break;
                case F_IDS: {
                        const uint32_t *ids = *(uint32_t *const *)(const void *)(base + f->off);
                        uint32_t cnt = *(const uint32_t *)(const void *)(base + f->aux);
                        msgpack_pack_array(&pk, cnt);
                        for (uint32_t i = 0; i < cnt; i++)
                                msgpack_pack_uint32(&pk, ids[i]);
                        break;
                }
                case F_STATUS:
                        pack_str(&pk, kvf_status_name(r->status));
                        break;
                case F_TRANSPORT:
                        pack_str(&pk, kvf_transport_name(r->transport));
                        break;
                case F_BIN32:
                        msgpack_pack_bin(&pk, f->aux);
                        msgpack_pack_bin_body(&pk, base + f->off, f->aux);
                        break;
                case F_PORTS:
                        break;
                }
        }
        if (s.overflow)
                return -ENOSPC;
        return (int)s.len;
}

size_t kvf_record_encoded_max(const struct kvf_record *r)
{
        return 1024 + ((size_t)r->n_src + r->n_dst + r->n_runs + r->n_rdma_parts) * 5;
}

int kvf_record_encode_alloc(const struct kvf_record *r, uint8_t **buf, size_t *len)
{
        size_t cap = kvf_record_encoded_max(r);
        uint8_t *b = malloc(cap);
        if (!b)
                return -ENOMEM;
        int n = kvf_record_encode(r, b, cap);
        if (n < 0) {
                free(b);
                return n;
        }
        *buf = b;
        *len = (size_t)n;
        return 0;
}

int kvf_record_peek_request_id(const void *buf, size_t len, char *out, size_t cap, bool *is_bin)
{
        struct kvf_mp m = {.p = buf, .end = (const uint8_t *)buf + len};
        uint32_t n;
        if (cap == 0 || kvf_mp_map(&m, &n) < 0)
                return -EBADMSG;
        for (uint32_t i = 0; i < n; i++) {
                const char *k, *v;
                uint32_t kl, vl;
                if (kvf_mp_str(&m, &k, &kl) < 0)
                        return -EBADMSG;
                if (kl == 10 && !memcmp(k, "request_id", 10) && kvf_mp_peek(&m) == KVF_MP_STR &&
                    kvf_mp_str(&m, &v, &vl) == 0) {
                        if (vl == 0 || vl >= cap || memchr(v, 0, vl) || !utf8_ok((const uint8_t *)v, vl))
                                return -EBADMSG;
                        memcpy(out, v, vl);
                        out[vl] = '\0';
                        *is_bin = false;
                        return 0;
                }
                const uint8_t *bv;
                if (kl == 10 && !memcmp(k, "request_id", 10) && kvf_mp_peek(&m) == KVF_MP_BIN &&
                    kvf_mp_bin(&m, &bv, &vl) == 0) {
                        if (vl == 0 || vl >= cap || memchr(bv, 0, vl))
                                return -EBADMSG;
                        memcpy(out, bv, vl);
                        out[vl] = '\0';
                        *is_bin = true;
                        return 0;
                }
                if (kvf_mp_skip(&m, 16) < 0)
                        return -EBADMSG;
        }
        return -ENOENT;
}
