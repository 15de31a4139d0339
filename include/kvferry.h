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
 *
 * GPU caches (an instance started with --backend cuda): kvf_cache_tensor()
 * returns device pointers, kvf_cache_device() says which GPU, and
 * kvf_layer_done_on_stream() publishes a layer from the engine's CUDA stream
 * without synchronising it. This header needs no CUDA header: streams are
 * `void *` (a cudaStream_t).
 */
#ifndef KVFERRY_H
#define KVFERRY_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVFERRY_VERSION "0.1.0"

/*
 * ABI: the public structs below grow only at their end, and every call that
 * writes into one or reads from one is told its size by the caller: the
 * function-like macros kvf_poll(), kvf_poll_previous(), kvf_group_poll(),
 * kvf_get_layout() and kvf_submit_task() pass sizeof(*ev) (etc.) to the
 * *_sized entry points. The library writes only what fits the caller's size
 * (zeroing what it has no field for) and reads only what the caller declared
 * (a field beyond the library's own struct must be zero, else -E2BIG). Sizes
 * below the ABI 1 struct are refused with -EINVAL. Programs linked before
 * these entry points existed reach libkvferry.map's KVFERRY_0 node (which
 * takes the ABI 1 structs as they were then, the struct sizes of this header
 * as first released with it) or, linked with no symbol versions at all, its
 * KVFERRY_PRE node: kvf_poll and kvf_group_poll refuse there with -ENOTSUP
 * (their struct kvf_event had one of two layouts that cannot be told apart),
 * kvf_submit_task reads only the fields every such header had.
 * docs/ARCHITECTURE.md, section 2c.
 */
#define KVFERRY_ABI 1

/* One status per request, exactly once. Names are what completions carry. */
enum kvf_status {
        KVF_STATUS_FINISHED = 0,       /* "finished": every byte landed */
        KVF_STATUS_BAD_TASK = 1,       /* "bad task": a field is missing, ill-typed or wrong */
        KVF_STATUS_BLOCK_RANGE = 2,    /* "block id out of range" */
        KVF_STATUS_UNKNOWN_PEER = 3,   /* "unknown peer" */
        KVF_STATUS_CONNECTION = 4,     /* "connection error": unreachable, lost, or peer died;
                                        * or the transport cannot be had between the two (rdma
                                        * without a device, or not built): at once, reason says */
        KVF_STATUS_LAYOUT_MISMATCH = 5,/* "peer layout mismatch" */
        KVF_STATUS_CANCELLED = 6,      /* "cancelled" */
        KVF_STATUS_TIMEOUT = 7,        /* "timed out" (the reason says where it stopped) */
        KVF_STATUS_WRITE = 8,          /* "write error" */
        KVF_STATUS_AUTH = 9,           /* "authentication failed" */
        KVF_STATUS_ENGINE_GONE = 10,   /* "engine gone": the engine session that owned the
                                        * request ended (detached, or its process died) */
        KVF_STATUS_PEER_ROLE = 11,     /* "peer role mismatch": the peer does not receive */
        KVF_STATUS_COUNT = 12,
};

/* The status's name ("finished", "bad task", ...), or "unknown status". */
const char *kvf_status_name(int status);
/* The status for a name, or -1. */
int kvf_status_from_name(const char *name);

enum kvf_transport {
        KVF_TRANSPORT_IPC = 1,  /* peer instance on the same host: the sender copies */
        KVF_TRANSPORT_TCP = 2,  /* the connectors stream frames over TCP */
        KVF_TRANSPORT_RDMA = 3, /* the connectors write with RDMA (RC, one-sided writes) */
};

struct kvf_layout_info {
        uint32_t num_layers;
        uint32_t extra_layers;
        uint32_t num_blocks;
        uint32_t kv_heads;
        uint32_t block_size;
        uint32_t head_dim;
        uint32_t dtype;    /* 1 bf16, 2 fp16, 3 fp8, 4 uint8, 5 fp32 */
        uint32_t key_only; /* 1: one tensor per layer (MLA) */
        uint64_t block_bytes;
        uint64_t cache_bytes; /* K/V of every layer, then the scale tensors when there are any */
        /* Per-block scale tensors (FastDeploy's block_wise_fp8 caches), one per K/V tensor of
         * each layer, [num_blocks, kv_heads, block_size] of scale_dtype, after every layer's
         * K/V (K/V offsets are those of a layout without them). 0 and 0: none. An engine built
         * against a header without these fields gets the struct up to cache_bytes. */
        uint32_t scale_dtype;
        uint32_t reserved;
        uint64_t scale_bytes;
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
        /* The decode engine session that reserved dest_block_ids: its kvf_session(), passed
         * along with the block ids. 0 = not known: kvferry then binds the transfer to the
         * decode session it last heard of (docs/ARCHITECTURE.md, "Engine sessions"). */
        uint64_t peer_session;
};

enum kvf_event_type {
        KVF_EVENT_COMPLETION = 1,     /* prefill side: the request's transfer ended */
        KVF_EVENT_ARRIVAL = 2,        /* decode side: a request's cache has landed (or failed) */
        KVF_EVENT_CONNECT_RESULT = 3, /* answer to kvf_submit_connect() */
};

struct kvf_event {
        int type;   /* enum kvf_event_type */
        uint64_t session; /* the engine session it belongs to (kvf_session()); 0 = any */
        int status; /* enum kvf_status */
        char request_id[128]; /* or the connect task's id */
        char peer[112];       /* completion: the peer; arrival: the prefill instance */
        char reason[240];     /* empty when finished */
        uint64_t bytes;       /* bytes moved */
        uint32_t blocks;      /* destination blocks written */
        uint32_t rank;        /* group member that produced it (kvf_group_poll); the client's
                               * index in the array kvf_poll_any() took */
        uint64_t accept_ns;     /* completion: task accepted (CLOCK_MONOTONIC); arrival over ipc:
                                 * the prefill sender posted its finish notice (0 otherwise) */
        uint64_t last_layer_ns; /* completion: the request's last layer became ready */
        uint64_t done_ns;       /* completion: status decided; arrival: published */
        /* arrival: the destination blocks written, valid until the next poll on this client
         * (NULL when the arrival carries none) */
        const uint32_t *dest_block_ids;
        uint32_t n_dest;
        /* KVF_EVENT_ID_BIN: request_id came as msgpack bin (an engine's bytes id, not
         * necessarily UTF-8), and every record about the request carries it as bin */
        uint32_t flags;
};

#define KVF_EVENT_ID_BIN 1u

struct kvf_client;

/* The message of the last failure on this thread. */
const char *kvf_last_error(void);

/*
 * Attach to instance `name`, waiting up to wait_ms for it to become ready.
 *
 * Each attach starts a new engine session (kvf_session()). A request belongs
 * to the session that submitted it. When a session ends (kvf_detach, or the
 * engine's process dies), its requests still moving end with "engine gone"
 * on both sides, and nothing of that session is delivered to a later one:
 * kvf_poll() returns only this session's completions and arrivals. Before
 * returning, kvf_attach waits (up to 2 s) until the sender has ended the
 * previous session's requests, so a restarted engine that submits the same
 * request ids again never collides with them. What became of the previous
 * sessions' requests is told by kvf_poll_previous().
 *
 * A client belongs to the process that attached it. In a child after fork(),
 * every call that touches the instance returns -EBADF with kvf_last_error()
 * "this client was attached by pid N; after fork() attach anew in the child"
 * (kvf_cache_tensor returns NULL and kvf_last_step 0, with that message), and
 * kvf_detach releases only the child's own copies: the parent's session goes on.
 */
int kvf_attach(const char *name, unsigned wait_ms, struct kvf_client **out);
void kvf_detach(struct kvf_client *c);
/* This client's engine session: a number that grows with every attach to the instance. */
uint64_t kvf_session(struct kvf_client *c);
/*
 * Completions and arrivals of earlier engine sessions, which kvf_poll() kept
 * apart: what a restarted engine lost (status "engine gone"), or what ended
 * after its predecessor stopped reading. 1 = *ev filled (ev->session names
 * the session), 0 = none kept. Those still in the rings are found by kvf_poll()
 * and kvf_attach(); at most 65536 are kept (kvf_previous_dropped() counts the rest).
 */
int kvf_poll_previous_sized(struct kvf_client *c, struct kvf_event *ev, size_t ev_size);
#define kvf_poll_previous(c, ev) kvf_poll_previous_sized((c), (ev), sizeof(*(ev)))
uint64_t kvf_previous_dropped(struct kvf_client *c);

int kvf_get_layout_sized(struct kvf_client *c, struct kvf_layout_info *out, size_t out_size);
#define kvf_get_layout(c, out) kvf_get_layout_sized((c), (out), sizeof(*(out)))
/*
 * The tensor of `layer` (0 = K, 1 = V), [num_blocks, heads, block_size, head_dim],
 * contiguous; in a layout with scale tensors (scale_dtype) the next numbers are their
 * scales (2 = K's, 3 = V's; 1 = K's when key_only), [num_blocks, heads, block_size] of
 * scale_dtype: host memory for a host instance, a device pointer (on the GPU
 * kvf_cache_device() names) for a cuda instance. NULL for a layer or tensor
 * out of range, or for an instance of the engine's own caches (--caches engine,
 * kvf_register_caches below). The caches are the allocator's: they outlive the engine, so
 * an engine that attaches again finds them as it left them.
 */
void *kvf_cache_tensor(struct kvf_client *c, uint32_t layer, int v);
/* -1: the caches are host memory; else the CUDA device, as this process numbers devices
 * (CUDA_VISIBLE_DEVICES), that holds them. */
int kvf_cache_device(struct kvf_client *c);

/*
 * Caches the engine allocated itself (an instance started with `--caches engine`,
 * whose allocator makes none): every (layer, tensor) handed over in one call, so
 * the allocator checks the whole set at once (each (layer, tensor) exactly once,
 * no two blocks overlapping, every block inside one region) and the roles map it
 * in one step; a registration is never half there.
 *
 * Host memory is shared as files: each region is `bytes` at `addr` in this
 * process, mapped from descriptor `fd` (a memfd or /dev/shm file) at
 * `fd_offset`. GPU memory (device >= 0, fd = -1) needs a build with CUDA.
 */
struct kvf_reg_region {
        void *addr;
        uint64_t bytes;
        int fd;
        uint32_t pad;
        uint64_t fd_offset;
};
/* (layer, tensor 0 = K / 1 = V): block b is block_bytes contiguous bytes at addr + b * block_stride
 * (per-layer tensors: block_stride = block_bytes; blocks-first [blocks, 2, ...]: 2 * block_bytes). */
struct kvf_reg_view {
        uint32_t layer;
        uint32_t tensor;
        void *addr;
        uint64_t block_stride;
};
struct kvf_registration {
        const struct kvf_reg_region *regions;
        uint32_t n_regions;
        uint32_t pad;
        const struct kvf_reg_view *views;
        uint32_t n_views;
        uint32_t token_major; /* 1: a block is [block_size, heads, head_dim] (vLLM), else
                               * [heads, block_size, head_dim] */
        int device;           /* -1 host memory, else the CUDA device as this process numbers it */
        uint32_t pad2;
};
/*
 * Register the engine's caches with the instance: 0, or -errno with kvf_last_error()
 * saying what to change (-EINVAL a view or region that does not fit, -EBUSY another
 * process holds a registration, -ENOTSUP not an instance of the engine's caches).
 * The registration lasts until kvf_unregister_caches, kvf_detach, or this process's
 * end; meanwhile the allocator and the roles keep the regions mapped. Call it with
 * r_size = sizeof(struct kvf_registration) (one call of a release that came with its own
 * library: no macro, so that the library exports exactly what this header declares).
 */
int kvf_register_caches_sized(struct kvf_client *c, const struct kvf_registration *r, size_t r_size);
int kvf_unregister_caches(struct kvf_client *c);

int kvf_submit_task_sized(struct kvf_client *c, const struct kvf_task *t, size_t t_size);
#define kvf_submit_task(c, t) kvf_submit_task_sized((c), (t), sizeof(*(t)))
/* Chunked prefill: after `step`, tokens [0, tokens_done) are complete; last = final chunk. */
int kvf_submit_chunk(struct kvf_client *c, const char *request_id, uint64_t step,
                     uint64_t tokens_done, int last);
int kvf_submit_cancel(struct kvf_client *c, const char *request_id);
/* Pre-connect to a peer; the answer comes as a KVF_EVENT_CONNECT_RESULT. */
int kvf_submit_connect(struct kvf_client *c, const char *task_id, const char *peer);

enum kvf_target { KVF_TO_SENDER = 0, KVF_TO_CONNECTOR = 1 };
/*
 * The record types an engine sees on its rings (docs/records.md): it may write
 * task, chunk, cancel and connect (kvf_submit_raw); it reads completion,
 * connect result and arrival. The types kvferry's own processes exchange
 * follow these (common/records.h).
 */
enum kvf_record_type {
        KVF_REC_TASK = 1,           /* engine -> sender */
        KVF_REC_CHUNK = 2,          /* engine -> sender */
        KVF_REC_CANCEL = 3,         /* engine -> sender */
        KVF_REC_COMPLETION = 4,     /* sender -> engine */
        KVF_REC_CONNECT = 5,        /* engine -> connector */
        KVF_REC_CONNECT_RESULT = 6, /* connector -> engine */
        KVF_REC_ARRIVAL = 7,        /* connector -> engine (decode side) */
};
/* Submit a record already encoded as msgpack (engines in other languages). */
int kvf_submit_raw(struct kvf_client *c, int target, int record_type, const void *msgpack,
                   size_t len);

/*
 * Layers [0, layer] of forward step `step` are written. Monotonic; lock-free.
 * Steps only grow for the life of the instance: an engine that (re)attaches
 * numbers its steps from kvf_last_step() + 1, or its tasks would look as if
 * their layers were done already. A step below the last one published is an
 * engine bug: -EINVAL, nothing published (kvf_last_error() says which steps);
 * so is a step up to the last one published before this attach (a task or
 * chunk of such a step: -EINVAL too). After another engine attached to the
 * instance, -ESTALE: this session is over.
 */
int kvf_layer_done(struct kvf_client *c, uint64_t step, uint32_t layer);
/* The last step with a published layer-done event (0 if none). */
uint64_t kvf_last_step(struct kvf_client *c);

/*
 * kvf_layer_done() when the engine's CUDA `stream` (a cudaStream_t of the
 * device kvf_cache_device() names) reaches this point: the call only
 * enqueues, the engine never waits for its GPU. Use one stream per client,
 * layers in order; do not mix with kvf_layer_done() for the same steps.
 * When the instance's copies run in the engine's context (the allocator's
 * --executor engine), this also enqueues the layer's copy of every request
 * the sender has planned, on a side stream ordered after `stream`: one
 * kernel for all of them. Synchronise `stream` before kvf_detach().
 * Returns 0; -EINVAL as kvf_layer_done(); -ENOTSUP in a build without CUDA;
 * -EIO when CUDA refused the signal (kvf_last_error() says why).
 */
int kvf_layer_done_on_stream(struct kvf_client *c, void *stream, uint64_t step, uint32_t layer);

/* How kvf_layer_done_on_stream() signals the sender. */
enum kvf_layer_signal {
        KVF_SIGNAL_DEFAULT = 0,    /* $KVFERRY_LAYER_SIGNAL ("hostfn" or "writevalue"), else
                                    * writevalue (hostfn where the GPU cannot write the word,
                                    * and where the sender's context copies without MPS) */
        KVF_SIGNAL_HOSTFN = 1,     /* a CUDA host function publishes the word and rings the
                                    * sender's doorbell (CUDA's callback thread does it) */
        KVF_SIGNAL_WRITEVALUE = 2, /* the GPU writes the word itself (cuStreamWriteValue64); no
                                    * doorbell: the sender polls while layers are queued */
};
/* Choose before the first kvf_layer_done_on_stream(); -EINVAL for an unknown method, -EBUSY after. */
int kvf_set_layer_signal(struct kvf_client *c, int method);

/* Next event (ev_size: the caller's sizeof(*ev), see KVFERRY_ABI): 1 = *ev filled, 0 = none within timeout_ms (-1 waits forever), < 0 error. */
int kvf_poll_sized(struct kvf_client *c, struct kvf_event *ev, size_t ev_size, int timeout_ms);
#define kvf_poll(c, ev, timeout_ms) kvf_poll_sized((c), (ev), sizeof(*(ev)), (timeout_ms))

/*
 * The next event of any of n clients (1 to 64), for one thread that drives several instances
 * and takes their events one by one (the ranks of a group without kvf_group_poll's folding,
 * or instances of different groups): 1 = *ev filled and ev->rank = its client's index in cs,
 * 0 = none within timeout_ms (-1 waits forever), < 0 error (kvf_last_error() names the
 * client). Clients are served in turn, so a busy one cannot starve the rest. The wait sleeps
 * on every client's doorbell at once (futex_waitv, Linux 5.16 and later), so an event on any
 * of them ends it; where the kernel lacks that call, on each in turn for at most 1 ms.
 */
int kvf_poll_any_sized(struct kvf_client *const *cs, unsigned n, struct kvf_event *ev, size_t ev_size,
                       int timeout_ms);
#define kvf_poll_any(cs, n, ev, timeout_ms) kvf_poll_any_sized((cs), (n), (ev), sizeof(*(ev)), (timeout_ms))

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
int kvf_group_poll_sized(struct kvf_group *g, struct kvf_event *ev, size_t ev_size,
                         int timeout_ms);
#define kvf_group_poll(g, ev, timeout_ms)                                                     \
        kvf_group_poll_sized((g), (ev), sizeof(*(ev)), (timeout_ms))

/*
 * What this library was built with, for bindings that repeat the header (the
 * Python package): KVFERRY_ABI for "abi", sizeof for "sizeof kvf_event" (also
 * kvf_task, kvf_layout_info), a field's offset for "offsetof kvf_event.peer"
 * and its size for "sizeof kvf_event.peer", a constant's value for its name
 * ("KVF_STATUS_COUNT", "KVF_EVENT_ID_BIN", "KVF_REC_TASK", "KVF_TO_SENDER",
 * ...). -ENOENT for a name it does not know.
 */
int64_t kvf_abi_info(const char *name);
/* KVFERRY_VERSION as the library was built. */
const char *kvf_version(void);

#ifdef __cplusplus
}
#endif

#endif
