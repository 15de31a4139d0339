/*
 * The records that cross the rings, as msgpack maps with string keys
 * (docs/records.md is the schema). One C struct holds the fields of every
 * record type; a table per type says which fields it has, which are
 * required, and how each is typed, and drives both the encoder and the
 * decoder.
 *
 * Decoding: unknown keys are ignored; a missing or ill-typed required field,
 * a duplicate field, a non-map, a non-string key, truncated or trailing bytes
 * reject the record with a message naming the field. Arrays are allocated
 * (kvf_record_free releases them); nothing else is.
 */
#ifndef KVF_RECORDS_H
#define KVF_RECORDS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvferry.h"
#include "shm_layout.h"

/*
 * A write batch's runs (WRITE_BATCH: (src, dst index, count) triples) become
 * one unit per run per (layer, tensor) in the connector, a run longer than the
 * transport's unit split into several (connector/xfer.c): a frame (tcp, at most
 * KVF_FRAME_MAX_TCP payload bytes) or an RDMA write work request (at most
 * KVF_FRAME_MAX_RDMA). These are a network transfer's descriptors.
 */
#define KVF_FRAME_MAX_TCP (4u << 20)
#define KVF_FRAME_MAX_RDMA (1u << 30) /* a work request's length (mlx5's max_msg_sz; rxe takes 2 GiB) */

static inline uint64_t kvf_frame_max(int transport)
{
        return transport == KVF_TRANSPORT_RDMA ? KVF_FRAME_MAX_RDMA : KVF_FRAME_MAX_TCP;
}

/* The units of one tensor's runs (n_runs words) in blocks of block_bytes, at most frame_max
 * bytes a unit. */
static inline uint64_t kvf_runs_frames(const uint32_t *runs, uint32_t n_runs, uint64_t block_bytes,
                                       uint64_t frame_max)
{
        uint64_t per = block_bytes ? frame_max / block_bytes : 1, n = 0;
        if (per == 0)
                per = 1;
        for (uint32_t r = 0; r + 2 < n_runs; r += 3)
                n += (runs[r + 2] + per - 1) / per;
        return n;
}

/* The units (descriptors) a write batch of `layers` layers, `tensors` K/V tensors (and as
 * many scale tensors when scale_bytes) and these runs (n_runs words) becomes on a transport
 * whose unit holds at most frame_max bytes. */
static inline uint64_t kvf_batch_frames(const uint32_t *runs, uint32_t n_runs, uint32_t layers,
                                        uint32_t tensors, uint64_t block_bytes, uint64_t scale_bytes,
                                        uint64_t frame_max)
{
        uint64_t n = kvf_runs_frames(runs, n_runs, block_bytes, frame_max);
        if (scale_bytes)
                n += kvf_runs_frames(runs, n_runs, scale_bytes, frame_max);
        return n * layers * tensors;
}

/*
 * The record types kvferry's own processes exchange. The types an engine sees
 * (1 to 7) are enum kvf_record_type in kvferry.h, under their public names
 * KVF_REC_*; these follow them.
 */
enum kvf_rec_type {
        KVF_RT_WRITE_BATCH = 8,         /* sender -> connector */
        KVF_RT_FINISH = 9,              /* sender -> connector */
        KVF_RT_WRITE_RESULT = 10,       /* connector -> sender */
        KVF_RT_PEER_STATE = 11,         /* connector -> sender */
        KVF_RT_DISCONNECT = 12,         /* engine -> connector */
        KVF_RT_OPEN = 13,               /* sender -> connector: a network transfer begins */
        KVF_RT_MAX = 13, /* last ring record type */
        /* Wire records: between two connectors, never on a ring. */
        KVF_RT_HELLO = 32,     /* client -> server: proto, nonce, purpose */
        KVF_RT_CHALLENGE = 33, /* server -> client: nonce, proof */
        KVF_RT_AUTH = 34,      /* client -> server: proof, identity, layout */
        KVF_RT_WELCOME = 35,   /* server -> client: identity, layout */
        KVF_RT_REFUSE = 36,    /* either way: status, reason; then close */
        KVF_RT_NOTICE = 37,    /* prefill -> decode: a request's blocks have landed (or failed) */
        KVF_RT_ACK = 38,       /* decode -> prefill: the notice's outcome */
        KVF_RT_PING = 39,
        KVF_RT_PONG = 40,
        KVF_RT_XOPEN = 41,     /* prefill -> decode, data connection: a transfer's destination blocks */
        KVF_RT_WIRE_MAX = 41,
        /* Data frames carry a binary header and block bytes, not a record (connector/tcp.h). */
        KVF_RT_DATA = 48,
        KVF_RT_DATAV = 49, /* several runs of one transfer gathered in one frame */
        KVF_RT_DATAS = 50, /* head slices of blocks, to a rank of another tensor-parallel split */
        KVF_RT_DATAR = 51, /* source blocks' pieces regrouped into another block size */
};

_Static_assert((int)KVF_REC_ARRIVAL < (int)KVF_RT_WRITE_BATCH, "the engine's record types come first");

/*
 * Until connector/ and sender/ name the engine's types KVF_REC_*: their old
 * internal names. Nothing else uses these; remove them with the last use.
 */
#define KVF_RT_TASK KVF_REC_TASK
#define KVF_RT_CHUNK KVF_REC_CHUNK
#define KVF_RT_CANCEL KVF_REC_CANCEL
#define KVF_RT_COMPLETION KVF_REC_COMPLETION
#define KVF_RT_CONNECT KVF_REC_CONNECT
#define KVF_RT_CONNECT_RESULT KVF_REC_CONNECT_RESULT
#define KVF_RT_ARRIVAL KVF_REC_ARRIVAL

#define KVF_MAX_RECORD_IDS (1u << 20) /* block ids (or run ints) in one record */

struct kvf_record {
        uint16_t type;
        char request_id[KVF_REQ_ID_MAX]; /* connect: the connect task's id */
        char peer[KVF_PEER_MAX];
        char reason[KVF_REASON_MAX];
        char ip[64];    /* decode only: ip + port (or rdma_ports) form `peer` */
        uint64_t port;  /* decode only */
        uint64_t current_id; /* task: prefill step; chunk: the step */
        uint64_t tokens;     /* chunk: tokens complete after the step */
        uint64_t key;        /* transfer key (sender slot and incarnation) */
        uint64_t bytes;
        uint64_t accept_ns, last_layer_ns, done_ns;
        uint64_t generation; /* finish/notice/auth/welcome: the segment's created_ns */
        uint64_t session;    /* completion, connect result: the engine session it answers;
                              * arrival: the decode engine session it is for; finish, notice, open,
                              * xopen: the decode engine session the transfer is bound to (0
                              * unknown); ack, pong, peer state: the decode engine session live
                              * at the decode side when it was sent */
        uint64_t device;     /* decode only: device_ids[rank], a same-host peer's device (ipc) */
        uint64_t peer_session; /* task: the decode engine session that reserved dest_block_ids (0 unknown) */
        uint64_t decode_tp;    /* task: FastDeploy's decode_tp_size, the decode group's size (0 not given) */
        /* handshake */
        char instance[KVF_INSTANCE_MAX];
        char purpose[16];
        uint64_t role, proto, boot_id;
        uint8_t nonce[32], proof[32];
        uint64_t lay_layers, lay_extra, lay_blocks, lay_heads, lay_bsize, lay_hdim, lay_dtype,
                lay_keyonly;
        uint64_t lay_rank, lay_nranks; /* the instance's tensor-parallel rank and group size
                                        * (omitted when zero; absent: rank 0 of 1) */
        uint64_t lay_token_major; /* the engine's caches: 1 when a block is [block_size, heads, head_dim] */
        uint64_t lay_scale_dtype; /* the layout's scale tensors' dtype (omitted when none) */
        /* welcome of an rdma data connection (omitted when zero): the decode connector's
         * rdma_cm port, its region for this peer (address, length, remote key), and the
         * ticket the peer's rdma_cm connect must carry (binds it to this handshake) */
        uint64_t rdma_port, rdma_addr, rdma_len, rdma_rkey;
        uint8_t rdma_ticket[32];
        /* ... and a cache in parts (one allocation per tensor, or the engine's views): per
         * (layer, tensor) in kvf_layout_offset order, RDMA_PART_WORDS words (rdma.h) */
        uint32_t *rdma_parts;
        uint32_t n_rdma_parts;
        uint64_t layer;
        uint64_t layer_count; /* write batch: layers [layer, layer + layer_count) */
        uint64_t blocks;
        int status;    /* enum kvf_status */
        int transport; /* enum kvf_transport */
        bool last;
        bool chunked;
        bool up; /* peer state */
        bool withdraw; /* finish, notice (status not finished): the sender gave up waiting and asks
                        * what became of the transfer; the answer is the arrival's real status */
        bool id_bin;   /* request_id / task_id came (and goes back) as msgpack bin, not str */
        bool peer_formed; /* decode only: `peer` was built from ip and port, not given */
        bool device_given; /* decode only: device_ids was present (`device` holds our rank's) */
        uint32_t n_device_ids; /* decode only: device_ids's entries, when none is our rank's */
        uint32_t *src; /* src_block_ids */
        uint32_t n_src;
        uint32_t *dst; /* dest_block_ids */
        uint32_t n_dst;
        uint32_t *runs; /* write batch: (src, dst, count) triples, flattened */
        uint32_t n_runs;
        /* decode only: which fields were present */
        uint64_t present;
};

const char *kvf_rec_type_name(int type);

/*
 * Decode `len` bytes as a record of `type`. `rank` picks the element of
 * `rdma_ports` for a peer given FastDeploy-style. Returns 0, or -EBADMSG with
 * kvf_err describing the problem (field named). *out must be released with
 * kvf_record_free() either way.
 */
int kvf_record_decode(int type, const void *buf, size_t len, uint32_t rank,
                      struct kvf_record *out);
void kvf_record_free(struct kvf_record *r);

/*
 * Best effort, for a record that failed to decode: find a valid string
 * "request_id" (or bin) at the top level, so the rejection can name the request.
 * 0 and *out filled, or < 0.
 */
int kvf_record_peek_request_id(const void *buf, size_t len, char *out, size_t cap, bool *is_bin);

/*
 * Encode into buf (cap bytes). Returns the length, -ENOSPC if it does not
 * fit, -EINVAL for an unknown type.
 */
int kvf_record_encode(const struct kvf_record *r, void *buf, size_t cap);

/* The length (1 to 4) of the valid UTF-8 sequence at p[0..n), n > 0; 0 when it is not one
 * (overlong forms, surrogates and code points past U+10FFFF are not). */
size_t kvf_utf8_seq(const uint8_t *p, size_t n);

/* src[0..n) (up to a NUL) as valid UTF-8 text into dst (cap bytes with the NUL): a byte that
 * starts no valid sequence becomes \xNN; cut at a character's end when it does not fit.
 * Returns the length written. What kvferry packs as str goes through it. */
size_t kvf_text_clean(char *dst, size_t cap, const char *src, size_t n);

/* Encode into a fresh malloc'd buffer; *len receives its length. */
int kvf_record_encode_alloc(const struct kvf_record *r, uint8_t **buf, size_t *len);
/* A buffer this large always holds the record's encoding. */
size_t kvf_record_encoded_max(const struct kvf_record *r);

const char *kvf_transport_name(int t);
int kvf_transport_from_name(const char *s, size_t n);

#endif
