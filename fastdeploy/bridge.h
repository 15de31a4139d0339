/*
 * FastDeploy's layer signals, read in C and turned into kvferry events.
 *
 * A FastDeploy prefill worker says "layer L of this forward step is in the
 * cache" in one of two ways (docs/FASTDEPLOY.md, section 4):
 *
 *   per_query  two int32 POSIX shared-memory values per rank,
 *              splitwise_complete_prefilled_step_{rank_id}.{device} (the step,
 *              counting modulo 100003) and ..._layer_{rank_id}.{device} (-1 at a
 *              step's start, then the last layer written); nothing wakes a reader,
 *              so the bridge polls them.
 *   per_chunk  a System V message queue: after every layer one message
 *              [count, layer_id, (batch_slot, tokens_before, chunk_tokens) * count];
 *              the bridge blocks in msgrcv.
 *
 * The bridge is a thread of the process that holds the kvferry client (the
 * messager, python/kvferry/fastdeploy.py, through ctypes). It calls
 * kvf_layer_done() itself, so a layer's copies start within microseconds of
 * the signal, with no Python in the path. kvferry's steps only grow: the
 * bridge numbers them from kvf_last_step() + 1 and maps FastDeploy's steps
 * (per_query: the wrapped counter; per_chunk: one step per forward pass, a pass
 * starting with a message whose layer is not above the previous one) onto them.
 *
 * per_chunk requests are known by their batch slot: kvf_fd_bridge_submit_slot()
 * hands the bridge the request's task (its slot is FastDeploy's current_id) and
 * the bridge writes the task and its chunk records, with the chunks it saw in
 * that slot before the task came (a slot's history is kept from its last
 * chunk that does not continue the previous one). A slot is free for the next
 * request once its request's last chunk is written (or its completion came).
 *
 * Threads: every function may be called from any thread; the bridge's own
 * thread only ever calls kvf_layer_done() and the submit calls of the client.
 * Return values: >= 0 on success, -errno on failure with a message in
 * kvf_fd_bridge_error() (per bridge) or in `err` of the start call.
 */
#ifndef KVF_FASTDEPLOY_BRIDGE_H
#define KVF_FASTDEPLOY_BRIDGE_H

#include <stddef.h>
#include <stdint.h>

struct kvf_client;
struct kvf_fd_bridge;

enum kvf_fd_mode { KVF_FD_PER_QUERY = 1, KVF_FD_PER_CHUNK = 2 };

#define KVF_FD_MAX_SLOTS 512      /* FastDeploy's batch: 512 (slot, offset, length) triples */
#define KVF_FD_STEP_MODULO 100003 /* per_query's step counter wraps at this */

struct kvf_fd_bridge_config {
        int mode;            /* enum kvf_fd_mode */
        unsigned rank_id;    /* rank + data_parallel_id * nranks: the signals' rank */
        unsigned device;     /* the signals' device suffix */
        unsigned layers;     /* the instance's layers (model + extra): larger ids are refused */
        int msg_key;         /* per_chunk: the System V key (FastDeploy's ftok value) */
        unsigned poll_us;    /* per_query: sleep between idle polls (0: 50) */
        const char *shm_dir; /* per_query: where POSIX shm lives (NULL: /dev/shm) */
};

struct kvf_fd_bridge_stats {
        uint64_t signals;       /* messages (per_chunk) or layer changes (per_query) read */
        uint64_t steps;         /* forward steps seen */
        uint64_t layer_events;  /* kvf_layer_done calls made */
        uint64_t chunks;        /* chunk records written */
        uint64_t tasks;         /* tasks written */
        uint64_t bad_signals;   /* messages refused (bad count, layer or slot) */
        uint64_t unknown_slots; /* chunk triples for a slot no task claimed yet (kept) */
        uint64_t errors;        /* failed calls into kvferry (the last one's message kept) */
        int64_t fd_step;        /* per_query: the last FastDeploy step read (-1: none) */
        uint64_t kvf_step;      /* the kvferry step of the current forward pass */
};

/* Start the bridge's thread on client c (which must outlive the bridge). Creates
 * the shared-memory values or the queue if the engine has not yet. On failure
 * err (errlen bytes) says why. */
int kvf_fd_bridge_start(struct kvf_client *c, const struct kvf_fd_bridge_config *cfg,
                        struct kvf_fd_bridge **out, char *err, size_t errlen);
/* Stop the thread and free the bridge; per_query's values stay (the engine owns them). */
void kvf_fd_bridge_stop(struct kvf_fd_bridge *b);

/* per_query: the kvferry step of a task whose current_id is FastDeploy step `fd_step`
 * (the one nearest to the step now, modulo 100003). */
int64_t kvf_fd_bridge_step_of(struct kvf_fd_bridge *b, int64_t fd_step);

/* per_chunk: the task of the request in `slot`, as a msgpack map with a uint64
 * placeholder (0xcf and 8 bytes) at `step_off` for current_id and "chunked": true;
 * need_tokens is FastDeploy's need_prefill_tokens. The bridge fills the step, writes
 * the task and then the chunks already seen, and from then on a chunk record per
 * forward pass that includes the slot. -EBUSY: another request holds the slot. */
int kvf_fd_bridge_submit_slot(struct kvf_fd_bridge *b, unsigned slot, const char *request_id,
                              uint64_t need_tokens, const void *task, size_t len, size_t step_off);
/* The request in `slot` ended (its completion came): the slot is free again. */
int kvf_fd_bridge_release_slot(struct kvf_fd_bridge *b, unsigned slot, const char *request_id);

void kvf_fd_bridge_get_stats(struct kvf_fd_bridge *b, struct kvf_fd_bridge_stats *out);
/* The last asynchronous error (a refused signal, a failed call), or "" if none; the
 * text is copied into buf. */
void kvf_fd_bridge_error(struct kvf_fd_bridge *b, char *buf, size_t len);

#endif
