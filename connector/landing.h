/*
 * Incoming network transfers (decode side), whatever the transport.
 *
 * A transfer landing here is known by (prefill instance, its incarnation,
 * key). It is registered by whichever comes first: its transport's open (tcp:
 * the XOPEN on a data connection; rdma: the transfer's done message) or its
 * finish notice on the control connection. Its data is complete when the
 * landing bitmap of (layer, tensor, block) is full (tcp marks each frame's
 * blocks) or when its transport says every byte is in (rdma: the done message
 * after the last write). The arrival is published once the data is complete
 * and the notice is in (arrivals.c), whichever comes second.
 *
 * A transfer is bound to the decode engine session that reserved its blocks
 * (docs/ARCHITECTURE.md 6b); once that session is over, or once the transfer
 * is closed (published, aborted), its data is drained, never written.
 *
 * Threads: data paths (session threads) and the control thread; one mutex
 * (cn->rxmu) guards the table. Nothing here calls up: what a data path
 * learns (a transfer complete) is returned, and the data path posts it.
 */
#ifndef KVF_LANDING_H
#define KVF_LANDING_H

#include <stdbool.h>
#include <stdint.h>

#include "clock.h"
#include "connector.h"

/* A run of blocks a data path is about to receive: where it lands. */
struct landing_run {
        uint64_t key;
        uint32_t layer;
        uint16_t tensor;
        uint32_t index;   /* first block's position in the transfer's destination list */
        uint32_t nblocks; /* contiguous destination blocks */
        /* A head slice (another tensor-parallel split): `len` bytes at `off` of the one block
         * (nblocks 1); len 0: the whole blocks. */
        uint32_t off, len;
};

/*
 * Register (or keep) a transfer, from its transport's open or its finish
 * notice. 0; -EPROTO (why says so, and *status the request's outcome when
 * status is not NULL) if its block ids are not ours to give (beyond the cache:
 * "block id out of range"; twice, or other blocks than those already open
 * under this key: "bad task"); -ENOMEM.
 */
int conn_landing_open(struct connector *cn, const char *peer, uint64_t gen, const struct kvf_record *o,
                      int *status, char *why, size_t whylen);
/*
 * Check a run before a byte of it is received: the transfer is open, layer
 * and tensor in range, the run inside the transfer and contiguous in
 * destination ids (a slice: one block, inside it), `bytes` exactly its length. 0 with *dst_off where it goes
 * in the cache; 1 when the transfer is closed or its engine session is over
 * (drain the bytes); -EPROTO with why.
 */
int conn_landing_check(struct connector *cn, const char *peer, uint64_t gen, const struct landing_run *h,
                       uint64_t bytes, uint64_t *dst_off, char *why, size_t whylen);
/*
 * A run of a regrouped transfer (index: the first source position; nblocks: source blocks)
 * before a byte of it is received: checked as conn_landing_check, then each source block's
 * pieces of plan `pl` (the one this peer's and this rank's identities give) whose destination
 * position is below the transfer's count, in plan order: where each lands (io[i].off, .len)
 * and a mark per piece (nblocks 1 on a block's last piece, 0 on the others), *n of them, at
 * most max. 0; 1 drain (closed, or its session is over); -EPROTO with why.
 */
struct kvf_tp_plan;
struct kvf_io_run;
int conn_landing_pieces(struct connector *cn, const char *peer, uint64_t gen, const struct landing_run *h,
                        const struct kvf_tp_plan *pl, struct kvf_io_run *io, struct landing_run *marks,
                        unsigned max, unsigned *n, char *why, size_t whylen);
/* The run's blocks are in: mark them (index is a source position for a regrouped transfer;
 * nblocks 0 marks nothing). True when this run made the transfer complete: the
 * caller posts its data-done event (conn_post_data_done). */
bool conn_landing_mark(struct connector *cn, const char *peer, uint64_t gen, const struct landing_run *h);
/*
 * Every byte of the transfer is in (a transport that does not mark runs;
 * status KVF_STATUS_FINISHED), or its sender says it will never be (status:
 * why, for a transfer whose notice is out): registers it if need be (bound to
 * `session`, else the engine session live now). 1 when it is complete now (the
 * caller posts its data-done event, conn_post_data_done), 0 when it was
 * already (it stays complete), -ENOMEM.
 */
int conn_landing_complete(struct connector *cn, const char *peer, uint64_t gen, uint64_t key,
                          uint64_t session, int status, const char *why);

/* Control thread: a notice for a network transfer; returns 1 if its data is complete
 * (publish now, with *status: finished, or what its transport said went wrong, and why in
 * why[whylen]), 0 if it waits for the data. */
int conn_landing_notice(struct connector *cn, const struct kvf_record *notice, uint64_t gen,
                        uint64_t session, int *status, char *why, size_t whylen);
/* Control thread: take the waiting notice of a transfer whose data is complete. */
int conn_landing_take_ready(struct connector *cn, const char *peer, uint64_t gen, uint64_t key,
                            struct kvf_record *notice, uint64_t *session);
/*
 * Control thread: the transfer's arrival is published, or it was aborted, or
 * it is decided here (status not 0: not finished, with why): from now on its
 * data is drained, never written (late resends, frames in flight when it was
 * aborted), until it expires. A decided status answers its notice again
 * (conn_landing_notice) while its arrival waits for room in the engine's ring.
 */
void conn_landing_close(struct connector *cn, const char *peer, uint64_t gen, uint64_t key, int status,
                        const char *why);
/* Drop transfers open and silent longer than open_ns, closed ones after closed_ns. The
 * connector's: an incoming transfer silent for 5 minutes is not coming; a closed one is kept 2
 * minutes so that late frames and a resent notice still find it (and are refused). */
#define LANDING_OPEN_MAX_NS (300ull * KVF_NS_PER_S)
#define LANDING_CLOSED_KEEP_NS (120ull * KVF_NS_PER_S)
void conn_landing_expire(struct connector *cn, uint64_t open_ns, uint64_t closed_ns);
/* The decode engine session a transfer is bound to (the live one if it is not open yet). */
uint64_t conn_landing_session(struct connector *cn, const char *peer, uint64_t gen, uint64_t key);
/*
 * Control thread: engine sessions other than `live` are over. Their open
 * transfers are drained from now on; the notices that waited for their data
 * are returned (a list through ev->next, the caller's), to be answered
 * "engine gone".
 */
struct event *conn_landing_end_sessions(struct connector *cn, uint64_t live);

#endif
