/*
 * The TCP data path (transfer_protocol "tcp").
 *
 * Prefill side (data_tx.c): the sender hands the connector an OPEN record
 * per request (its destination block ids), WRITE_BATCH records as layers
 * complete, and a FINISH. The connector turns batches into frames, one per
 * contiguous run of blocks of one (layer, tensor), and moves them over
 * `streams` data connections per peer, each with its own thread and
 * io_uring. A transfer (xfer) keeps its frames until the peer acknowledges
 * the finish notice, so anything sent over a connection that broke is sent
 * again after reconnecting (writes are idempotent).
 *
 * Decode side (data_rx.c): each data connection has a receiver thread with
 * its own io_uring. An XOPEN frame registers a transfer's destination
 * blocks; a DATA frame's header is validated against it (known transfer,
 * layer and tensor in range, destination run inside the transfer and
 * contiguous, exact length) before its payload is received straight into
 * the cache; anything else disconnects the peer. A bitmap of (layer, tensor,
 * block) received makes repeats harmless; the arrival is published when the
 * bitmap is full and the finish notice has come.
 *
 * Wire: the 8-byte frame header of net.h, then for DATA a 24-byte
 * kvf_data_hdr (network byte order) and nblocks * block_bytes of payload.
 */
#ifndef KVF_DATA_H
#define KVF_DATA_H

#include <stdint.h>

#include "connector.h"

struct kvf_data_hdr {
        uint64_t key;
        uint32_t layer;
        uint16_t tensor;
        uint16_t pad;
        uint32_t index;   /* first block's position in the transfer's destination list */
        uint32_t nblocks; /* contiguous destination blocks */
};
_Static_assert(sizeof(struct kvf_data_hdr) == 24, "data header size");

#define KVF_DATA_FRAME_MAX (4u << 20) /* payload bytes per frame (a run is split above it) */
#define KVF_XOPEN_MAX (1u << 20)      /* bytes of an XOPEN record */

/* data_tx.c (control thread, except where noted) */
int data_tx_open(struct connector *cn, const struct kvf_record *open, char *why, size_t whylen);
int data_tx_batch(struct connector *cn, const struct kvf_record *batch);
/*
 * The transfer's finish notice is handed to the peer thread: from now on only
 * the notice's outcome ends it (data_tx_fail leaves it alone; the notice's
 * failure or acknowledgement forgets it).
 */
void data_tx_noticed(struct peer *p, uint64_t key);
/* Peer thread: the notice for `key` was acknowledged, or the transfer failed: forget it. */
void data_tx_forget(struct peer *p, uint64_t key);
/* Peer thread: fail transfers waiting longer than older_than (0 = all) with status, except
 * those whose notice is out (data_tx_noticed). */
void data_tx_fail(struct peer *p, int status, const char *reason, uint64_t older_than);
bool data_tx_busy(struct peer *p);
/* Peer thread: its control connection is up; start the data connections' threads (once). */
void data_tx_start(struct peer *p);
/* Stop the peer's data threads (joined); data_tx_free releases what is left. */
void data_tx_stop(struct peer *p);
void data_tx_free(struct peer *p);

/* data_rx.c */
void data_rx_serve(struct connector *cn, int fd, const char *peer_instance, uint64_t peer_gen,
                   const char *remote);
/* Control thread: a notice for a tcp transfer; returns 1 if complete (publish now), 0 if it waits. */
int data_rx_notice(struct connector *cn, const struct kvf_record *notice, uint64_t gen, uint64_t session);
/* Control thread: take the waiting notice of a transfer whose data is complete. */
int data_rx_take_ready(struct connector *cn, const char *peer, uint64_t gen, uint64_t key,
                       struct kvf_record *notice, uint64_t *session);
/*
 * Control thread: the transfer's arrival is published, or it was aborted:
 * from now on its frames are read and dropped, never written (late resends,
 * frames in flight when it was aborted), until it expires.
 */
void data_rx_close(struct connector *cn, const char *peer, uint64_t gen, uint64_t key);
/* Drop transfers open and silent longer than open_ns, closed ones after closed_ns. */
void data_rx_expire(struct connector *cn, uint64_t open_ns, uint64_t closed_ns);
/* The decode engine session a transfer is bound to (the live one if it is not open yet). */
uint64_t data_rx_session(struct connector *cn, const char *peer, uint64_t gen, uint64_t key);
/*
 * Control thread: engine sessions other than `live` are over. Their open
 * transfers are closed (frames drained from now on), and a notice that waited
 * for their data is dispatched now, to be answered "engine gone".
 */
void data_rx_end_sessions(struct connector *cn, uint64_t live);

#endif
