/*
 * kvferry client library: the inference engine's side of a kvferry instance.
 *
 * An instance serves one rank (one GPU, or one host-memory cache) and is three
 * processes (allocator, connector, sender) started by `tools/kvferry up`. The
 * engine attaches to it by name, maps its caches, submits one task per
 * request, publishes a layer-done event after each layer's cache write, and
 * reads completions (prefill side) and arrivals (decode side).
 *
 * Return values: >= 0 on success, -errno on failure; kvf_last_error() then
 * says why, with context. -EAGAIN from a submit means the ring is full
 * (back-pressure): nothing was written, try again later.
 *
 * Threads: one kvf_client may be used from several threads; submissions are
 * serialised by one mutex and polling by another (the rings are
 * single-producer single-consumer). kvf_layer_done() is lock-free and may be
 * called from a CUDA host callback.
 */
#ifndef KVFERRY_H
#define KVFERRY_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVFERRY_VERSION "0.1.0"

/* One status per request, exactly once. Names are what completions carry. */
enum kvf_status {
        KVF_STATUS_FINISHED = 0,       /* "finished": every byte landed */
        KVF_STATUS_BAD_TASK = 1,       /* "bad task": a field is missing, ill-typed or wrong */
        KVF_STATUS_BLOCK_RANGE = 2,    /* "block id out of range" */
        KVF_STATUS_UNKNOWN_PEER = 3,   /* "unknown peer" */
        KVF_STATUS_CONNECTION = 4,     /* "connection error": unreachable, lost, or peer died */
        KVF_STATUS_LAYOUT_MISMATCH = 5,/* "peer layout mismatch" */
        KVF_STATUS_CANCELLED = 6,      /* "cancelled" */
        KVF_STATUS_TIMEOUT = 7,        /* "timed out" */
        KVF_STATUS_WRITE = 8,          /* "write error" */
        KVF_STATUS_AUTH = 9,           /* "authentication failed" */
        KVF_STATUS_COUNT = 10,
};

/* The status's name ("finished", "bad task", ...), or "unknown status". */
const char *kvf_status_name(int status);
/* The status for a name, or -1. */
int kvf_status_from_name(const char *name);

enum kvf_transport {
        KVF_TRANSPORT_IPC = 1,  /* peer instance on the same host: the sender copies */
        KVF_TRANSPORT_TCP = 2,  /* the connectors stream frames over TCP */
        KVF_TRANSPORT_RDMA = 3, /* reserved */
};

struct kvf_layout_info {
        uint32_t num_layers;
        uint32_t extra_layers;
        uint32_t num_blocks;
        uint32_t kv_heads;
        uint32_t block_size;
        uint32_t head_dim;
        uint32_t dtype;    /* 1 bf16, 2 fp16, 3 fp8, 4 uint8 */
        uint32_t key_only; /* 1: one tensor per layer (MLA) */
        uint64_t block_bytes;
        uint64_t cache_bytes;
};

/* One request to move (FastDeploy's task dict, typed). */
struct kvf_task {
        const char *request_id;        /* unique among requests in flight */
        const uint32_t *src_block_ids; /* this instance's blocks, in token order */
        uint32_t n_src;
        const uint32_t *dest_block_ids; /* the peer's blocks; fewer than n_src = prefix hit */
        uint32_t n_dest;
        uint64_t current_id; /* forward step that prefills the request */
        int transport;       /* enum kvf_transport */
        const char *peer;    /* same-host instance name, or "host:port" of its connector */
        int chunked;         /* 1: blocks become ready through kvf_submit_chunk() */
};

enum kvf_event_type {
        KVF_EVENT_COMPLETION = 1,     /* prefill side: the request's transfer ended */
        KVF_EVENT_ARRIVAL = 2,        /* decode side: a request's cache has landed (or failed) */
        KVF_EVENT_CONNECT_RESULT = 3, /* answer to kvf_submit_connect() */
};

struct kvf_event {
        int type;   /* enum kvf_event_type */
        int status; /* enum kvf_status */
        char request_id[128]; /* or the connect task's id */
        char peer[112];       /* completion: the peer; arrival: the prefill instance */
        char reason[240];     /* empty when finished */
        uint64_t bytes;       /* bytes moved */
        uint32_t blocks;      /* destination blocks written */
        uint32_t rank;        /* group member that produced it (kvf_group_poll) */
        uint64_t accept_ns;     /* completion: task accepted (CLOCK_MONOTONIC) */
        uint64_t last_layer_ns; /* completion: the request's last layer became ready */
        uint64_t done_ns;       /* completion: status decided; arrival: published */
};

struct kvf_client;

/* The message of the last failure on this thread. */
const char *kvf_last_error(void);

/* Attach to instance `name`, waiting up to wait_ms for it to become ready. */
int kvf_attach(const char *name, unsigned wait_ms, struct kvf_client **out);
void kvf_detach(struct kvf_client *c);

int kvf_get_layout(struct kvf_client *c, struct kvf_layout_info *out);
/* Host backend: the tensor of `layer` (0 = K, 1 = V), [num_blocks, heads, block_size, head_dim]. */
void *kvf_cache_tensor(struct kvf_client *c, uint32_t layer, int v);

int kvf_submit_task(struct kvf_client *c, const struct kvf_task *t);
/* Chunked prefill: after `step`, tokens [0, tokens_done) are complete; last = final chunk. */
int kvf_submit_chunk(struct kvf_client *c, const char *request_id, uint64_t step,
                     uint64_t tokens_done, int last);
int kvf_submit_cancel(struct kvf_client *c, const char *request_id);
/* Pre-connect to a peer; the answer comes as a KVF_EVENT_CONNECT_RESULT. */
int kvf_submit_connect(struct kvf_client *c, const char *task_id, const char *peer);

enum kvf_target { KVF_TO_SENDER = 0, KVF_TO_CONNECTOR = 1 };
/* Record types an engine may write (see docs/records.md). */
enum kvf_record_type {
        KVF_REC_TASK = 1,
        KVF_REC_CHUNK = 2,
        KVF_REC_CANCEL = 3,
        KVF_REC_CONNECT = 5,
};
/* Submit a record already encoded as msgpack (engines in other languages). */
int kvf_submit_raw(struct kvf_client *c, int target, int record_type, const void *msgpack,
                   size_t len);

/*
 * Layers [0, layer] of forward step `step` are written. Monotonic; lock-free.
 * Steps only grow for the life of the instance: an engine that (re)attaches
 * numbers its steps from kvf_last_step() + 1, or its tasks would look as if
 * their layers were done already.
 */
int kvf_layer_done(struct kvf_client *c, uint64_t step, uint32_t layer);
/* The last step with a published layer-done event (0 if none). */
uint64_t kvf_last_step(struct kvf_client *c);

/* Next event: 1 = *ev filled, 0 = none within timeout_ms (-1 waits forever), < 0 error. */
int kvf_poll(struct kvf_client *c, struct kvf_event *ev, int timeout_ms);

/*
 * A group of instances, one per tensor-parallel rank. kvf_group_poll()
 * returns one completion (or arrival) per request id once every rank has
 * reported it; any error wins over "finished". Connect results pass through.
 */
struct kvf_group;
int kvf_group_attach(const char *const *names, unsigned n, unsigned wait_ms,
                     struct kvf_group **out);
void kvf_group_detach(struct kvf_group *g);
struct kvf_client *kvf_group_member(struct kvf_group *g, unsigned rank);
int kvf_group_poll(struct kvf_group *g, struct kvf_event *ev, int timeout_ms);

#ifdef __cplusplus
}
#endif

#endif
