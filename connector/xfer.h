/*
 * Outgoing network transfers (prefill side), whatever the transport.
 *
 * The sender hands the connector an OPEN record per request (its
 * destination block ids), WRITE_BATCH records as layers complete, and a
 * FINISH. Each batch becomes frames, one per run of blocks contiguous on both
 * sides in one (layer, tensor) (split at the transport's frame_max), queued
 * on the peer's xfer_peer of the request's transport. The transport's data
 * path takes frames from the queue, moves them, and gives them back sent or
 * to be sent again. A transfer keeps its frames until the peer acknowledges
 * the finish notice, so frames that went over a data connection that broke
 * are sent again on the next one (writes are idempotent).
 *
 * Locking: xp->mu guards the transfers, their frames and the queue. Data
 * paths hold frames (state F_FLIGHT) outside the lock while they move them;
 * a transfer forgotten meanwhile is only marked dead and freed when its last
 * frame comes back (xfer_give_back).
 */
#ifndef KVF_XFER_H
#define KVF_XFER_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "connector.h"
#include "transport.h"

enum { F_QUEUED = 0, F_FLIGHT = 1, F_SENT = 2 };

struct frame {
        struct xfer *x;
        uint32_t layer, index, nblocks; /* index: first block's position in x->dst (regrouped:
                                         * the first source block's position) */
        uint16_t tensor;
        uint8_t state;
        int8_t conn; /* the data connection that carried it last, or -1 */
        uint8_t again; /* 1: sent on a connection that was lost, so queued again (its bytes go
                        * twice: bytes_resent_tcp counts the second time) */
        uint64_t src_off;
        struct frame *qnext;
};

struct xfer {
        uint64_t key;
        char request_id[KVF_REQ_ID_MAX];
        bool id_bin; /* the request id is bytes (msgpack bin): every record about it says so */
        uint32_t *dst;
        uint32_t n_dst;
        /* Regrouped into the peer's block size (OPEN's `blocks`): the source blocks, every one
         * sent, frames indexed by source position; 0: frames indexed by destination position. */
        uint32_t n_src;
        struct frame **fr;
        uint32_t nfr, capfr;
        uint64_t first_ns;
        uint32_t inflight; /* frames a data path holds (and holds by xfer_hold) */
        uint32_t queued;   /* its frames in the queue */
        bool dead;
        bool checked; /* dst ids checked against the peer's block count */
        bool noticed; /* the finish notice is out: only its outcome ends the transfer */
        uint64_t session; /* the decode engine session it is bound to (0 unknown) */
        uint64_t peer_gen; /* the peer incarnation it is bound to: its control connection's at the
                            * open, else its first data connection's (0 not yet) */
        uint64_t reg_gen; /* this instance's registration of the engine's caches when it opened
                           * (its bytes are in that memory; 0: kvferry's own caches) */
        void *tp;         /* the transport's (xfer_open) */
        struct xfer *next;
};

#define XFER_FAILED_KEPT 32u /* transfers this connector failed, remembered for their notice */

struct xfer_peer {
        struct peer *p;
        const struct conn_transport *t;
        pthread_mutex_t mu;
        pthread_cond_t cv; /* broadcast: new frames, a new transfer, stop */
        struct frame *qhead, *qtail;
        uint64_t qbytes;
        struct xfer *xfers;
        unsigned nxfers;
        uint64_t remote_blocks; /* from the handshake; 0 = not known yet */
        bool stop;              /* atomic: the data path is to end */
        void *tp;               /* the transport's (peer_init) */
        /* The peer refused this transport's data path for good (its handshake said it takes
         * none: no device, not built): transfers opened from now on fail at once with this
         * status and reason, until the control connection is made again (the peer may have
         * been restarted with it). Status 0: not refused. */
        int refused_status;
        char refused[KVF_REASON_MAX];
        /* Transfers this connector failed (its data path, the peer timeout): their write
         * result is out, but the sender's finish notice may already be in its ring, and must
         * then go to the peer as an abort (conn_xfer_noticed). A ring of the latest. */
        struct xfer_failed {
                uint64_t key;
                uint64_t peer_gen; /* the incarnation it was bound to (0: none yet) */
                int status;
                char reason[KVF_REASON_MAX];
        } failed[XFER_FAILED_KEPT];
        unsigned nfailed;
};

#define XFER_QUEUE_LIMIT (64ull << 20) /* queued payload bytes before the control thread waits */

/* ---- for the connector (main.c, peer.c): control thread, except where noted ---- */

/* The peer incarnation transfer `key` is (or was, when it failed) bound to; 0 when not known. */
uint64_t conn_xfer_gen(struct peer *p, uint64_t key);
/* After a handshake proved the peer's incarnation `gen` (a data path's: xfer_check_gen on its
 * own transport; the control connection's: conn_xfer_check_gen on every transport): transfers
 * not bound yet are bound to it; those bound to another fail ("peer re-created"), noticed ones
 * too, before anything is sent to it. */
void xfer_check_gen(struct xfer_peer *xp, uint64_t gen);
void conn_xfer_check_gen(struct peer *p, uint64_t gen);
/* A transfer to peer p begins (OPEN). 0 (the caller then kicks the peer, conn_peer_kick), or
 * -errno with why and the request's status (the one the peer refused with, when it did). */
int conn_xfer_open(struct peer *p, const struct kvf_record *open, int *status, char *why, size_t whylen);
/* Queue a write batch: 0; -EAGAIN back-pressure (leave it in the ring); -ENOENT the transfer
 * is gone (failed, its result went out); -EINVAL a bad batch; -ENOMEM. */
int conn_xfer_batch(struct peer *p, const struct kvf_record *batch);
/*
 * The transfer's finish notice is handed to the peer: from now on only
 * the notice's outcome ends it (conn_xfer_fail leaves it alone; the notice's
 * failure or acknowledgement forgets it). Returns KVF_STATUS_FINISHED, or, for
 * a transfer this connector failed already (its write result went out before
 * the sender's finish notice was read), that status with its reason in why:
 * the notice must then go as an abort, so the peer publishes the same failure.
 */
int conn_xfer_noticed(struct peer *p, uint64_t key, char *why, size_t whylen);
/* Any thread: the notice for `key` was acknowledged, or the transfer failed: forget it. */
void conn_xfer_forget(struct peer *p, uint64_t key);
/* The peer's I/O thread: fail transfers waiting longer than older_than (0 = all) with status, except
 * those whose notice is out (conn_xfer_noticed). */
void conn_xfer_fail(struct peer *p, int status, const char *reason, uint64_t older_than);
bool conn_xfer_busy(struct peer *p);
/* The peer's I/O thread: its control connection is up; start the data paths (once). */
void conn_xfer_start(struct peer *p);
/* Stop the peer's data paths (joined); conn_xfer_free releases what is left. */
void conn_xfer_stop(struct peer *p);
void conn_xfer_free(struct peer *p);

/* ---- for transports ---- */

uint64_t xfer_frame_bytes(const struct xfer_peer *xp, const struct frame *f);
/* xp->mu held: wait for a broadcast on xp->cv (new frames, a transfer, stop), 200 ms at most. */
void xfer_wait(struct xfer_peer *xp);
/* xp->mu held: the next queued frame, now F_FLIGHT on data connection `conn`, or NULL. */
struct frame *xfer_dequeue(struct xfer_peer *xp, int conn);
/* xp->mu held: split the queue's first frame after k of its blocks (a data path that carries
 * fewer a frame for this peer); the rest follows it. 0, or -ENOMEM. */
int xfer_split_head(struct xfer_peer *xp, uint32_t k);
/* xp->mu held: put f back in the queue (at the front: it goes first). */
void xfer_enqueue(struct xfer_peer *xp, struct frame *f, bool front);
/* xp->mu held: frames back from a data path, sent or to be sent again (front of the queue). */
void xfer_give_back(struct xfer_peer *xp, struct frame **fs, unsigned n, bool sent);
/* xp->mu held: everything data connection `conn` sent that is not acknowledged may be lost:
 * queue it again. */
void xfer_requeue_conn(struct xfer_peer *xp, int conn);
/* xp->mu held: the peer's block count (from a handshake): transfers naming blocks it does
 * not have fail now. */
void xfer_set_remote_blocks(struct xfer_peer *xp, uint64_t num_blocks);
/* xp->mu not held: conn_xfer_fail for this transport's transfers only (its data path cannot
 * be had: the peer refuses it, or it failed past the peer timeout). */
void conn_xfer_fail_transport(struct xfer_peer *xp, int status, const char *reason, uint64_t older_than);
/* xp->mu not held: the data path can never be had from this peer (a permanent refusal):
 * fail what is not noticed (conn_xfer_fail_transport) and every transfer opened from now on,
 * at its open, until the control connection is made again. A noticed transfer is answered
 * by the peer, which refuses it for the same reason (arrivals.c). */
void conn_xfer_refuse(struct xfer_peer *xp, int status, const char *reason);
/* As conn_xfer_refuse, and transfers whose notice is out fail too: for a refusal of every data
 * connection (the peer's layout is one this transport cannot carry), where nothing can land. */
void conn_xfer_refuse_all(struct xfer_peer *xp, int status, const char *reason);
/* As conn_xfer_refuse_all, for a refusal that holds for now only: later transfers try again. */
void conn_xfer_fail_all(struct xfer_peer *xp, int status, const char *reason);
/* xp->mu held: end transfer x now with `status` (a write error its data path met). */
void xfer_fail_one(struct xfer_peer *xp, struct xfer *x, int status, const char *reason);
/* Transfer x cannot go to a peer of peer_bsize tokens per block (this side's layout: ours):
 * opened to be regrouped (x->n_src) for a peer whose blocks are ours, or for blocks of one size
 * to a peer of another (`regrouped`: this data path moves the plan's pieces), or with
 * destination blocks its source blocks cannot fill. True with why. xp->mu held. */
bool xfer_regroup_mismatch(const struct xfer_peer *xp, const struct xfer *x, uint32_t peer_bsize, bool regrouped,
                           char *why, size_t whylen);
/* xp->mu held: keep x allocated while a data path refers to it outside a frame (rdma: its
 * done message in the send queue); xfer_release gives it up (and frees a dead one). */
void xfer_hold(struct xfer *x);
void xfer_release(struct xfer_peer *xp, struct xfer *x);
/* xp->mu held: the peer's decode engine session has moved past the one x is bound to, so its
 * blocks may be another request's now (docs/ARCHITECTURE.md 6b). */
bool xfer_session_over(const struct xfer_peer *xp, const struct xfer *x);
/* xp->mu not held: the queue has room again; a write batch the control thread held back for
 * want of it may go now. `room` is what the caller saw under the lock. */
void xfer_room(struct xfer_peer *xp, bool room);
/* xp->mu held: the queue is below half its limit. */
bool xfer_has_room(const struct xfer_peer *xp);
/* The data path should end: the peer is stopping, or the connector. */
bool xfer_stopping(struct xfer_peer *xp);

#endif
