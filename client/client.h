/*
 * What the files of libkvferry share (client/kvferry.c, client/stream.c);
 * engines see include/kvferry.h only.
 */
#ifndef KVF_CLIENT_H
#define KVF_CLIENT_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "cache.h"
#include "ctl.h"
#include "kvferry.h"

/* Events of earlier engine sessions, kept for kvf_poll_previous(). */
#define PREVIOUS_MAX 65536u
struct previous {
        struct kvf_event ev;
        struct previous *next;
};

struct kvf_stream; /* stream.c: signals on CUDA streams, the engine executor */

struct kvf_client {
        struct kvf_ctl ctl;
        uint64_t session; /* the engine role generation this attach claimed */
        /* The progress word when this session began (its role slot's session_base): steps up
         * to its step are earlier sessions'; this one numbers its steps above it. 0: none. */
        uint64_t base_word;
        /* The process that attached. A child forked from it shares its mappings of the
         * segment and the caches but is not the engine the session belongs to: what it
         * submitted or polled would go into (or be taken from) the parent's session. */
        pid_t pid;
        pthread_mutex_t submit_mu;
        pthread_mutex_t poll_mu; /* also guards the previous-session list and dst */
        pthread_mutex_t stream_mu; /* kvf_layer_done_on_stream and the stream state */
        struct kvf_cache cache;
        unsigned next_ring; /* poll fairness between the two inbound rings */
        uint32_t *dst;      /* the last arrival's destination blocks (kvf_event.dest_block_ids) */
        struct previous *prev_head, *prev_tail;
        uint32_t nprev;
        uint64_t prev_dropped;
        int signal_method;        /* enum kvf_layer_signal chosen (0: not yet) */
        struct kvf_stream *stream; /* created at the first kvf_layer_done_on_stream */
        bool registered;           /* this client registered the engine's caches (register.c) */
        /* The engine's GPU caches as this process registered them: its own views (parts and
         * strides in layout order), the engine executor's source; n_parts 0 when none.
         * Under stream_mu. */
        struct kvf_cache reg_own;
};

/* kvferry.c: 0 in the process that attached c, else -EBADF with kvf_err saying why (a child
 * after fork()). Every public call that touches the segment or the caches starts with it. */
int kvf_client_owned(const struct kvf_client *c);
/* kvferry.c: `step` is this session's to use (`what`, a task, chunk or layer-done, names it in
 * the message): above the last one published before the session began; else -EINVAL. */
int kvf_client_step_check(struct kvf_client *c, uint64_t step, const char *what);
/* kvferry.c: a layer-done event is valid (layer in range, steps not going back): 0 or -EINVAL. */
int kvf_client_layer_check(struct kvf_client *c, uint64_t step, uint32_t layer);
/* kvferry.c: publish progress word `want` (monotonic max) and ring the sender's doorbell.
 * Lock-free, no CUDA call: may run on CUDA's callback thread. */
void kvf_client_publish(struct kvf_client *c, uint64_t want);
/* stream.c: wait (bounded) for what kvf_layer_done_on_stream queued, free it. */
void kvf_stream_detach(struct kvf_client *c);

#endif
