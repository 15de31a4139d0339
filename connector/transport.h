/*
 * Connector transports: how a network transfer's blocks get from this
 * instance's cache into a peer's (transfer_protocol "tcp", "rdma").
 *
 * The transport-independent part lives apart from every transport:
 *   xfer.c     (prefill side) the transfers of each peer: their runs as frames,
 *              the queue, what is in flight, resend after a broken data
 *              connection, forget on acknowledgement, fail, "noticed";
 *   landing.c  (decode side) the transfers landing here: registry,
 *              landing bitmap, checks, engine-session binding, expiry, and
 *              the data-complete mark the arrival waits for.
 * A transport moves frames (its data path) and may add fields of its own to
 * the handshake of its data connections. The control connection (notices,
 * acks, pings: peer.c, session.c) is the same for every transport.
 *
 * Files call downward only: main.c, peer.c, arrivals.c, session.c -> xfer.c,
 * landing.c, transport.c -> tcp_*.c, rdma_*.c -> xfer.h, landing.h helpers.
 */
#ifndef KVF_TRANSPORT_H
#define KVF_TRANSPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "connector.h"

struct xfer_peer;
struct xfer;

struct conn_transport {
        const char *name; /* "tcp": the transfer_protocol it serves */
        int id;           /* enum kvf_transport */
        /* The handshake's purpose for its data connections ("data" for tcp, for the wire's
         * sake; "rdma"). */
        const char *purpose;
        /* Payload bytes per frame: a longer run is split into several frames. */
        uint64_t frame_max;
        /* Blocks per frame at most (0: no limit but frame_max): tcp's head-slice frames give
         * each block its own receive vector. */
        uint32_t frame_blocks_max;

        /* The connector starts (after its cache is mapped, before it listens) and stops.
         * NULL: nothing to do. init fails the connector's start with kvf_err set. */
        int (*init)(struct connector *cn);
        void (*fini)(struct connector *cn);

        /* ---- prefill side: one xfer_peer per (peer, transport) ---- */
        /* Make xp->tp (its per-peer state); 0 or -ENOMEM. */
        int (*peer_init)(struct xfer_peer *xp);
        /* The peer's control connection is up: start the data path (threads), once. Called
         * again on every reconnection; later calls do nothing. */
        void (*start)(struct xfer_peer *xp);
        /* Stop the data path and join its threads (xp->stop is set). */
        void (*stop)(struct xfer_peer *xp);
        /* Release xp->tp (the data path is stopped). */
        void (*peer_free)(struct xfer_peer *xp);
        /* A transfer opened (xp->mu held): make x->tp, or leave it NULL. 0 or -ENOMEM. */
        int (*xfer_open)(struct xfer_peer *xp, struct xfer *x);
        void (*xfer_free)(struct xfer_peer *xp, struct xfer *x);
        /* The transfer's finish notice is out (xp->mu held): its last frame is queued. */
        void (*noticed)(struct xfer_peer *xp, struct xfer *x);
        /* Frames were queued or a transfer opened (xp->mu not held), for a data path that
         * cannot sleep on xp->cv; NULL: the broadcast on xp->cv is enough. */
        void (*wake)(struct xfer_peer *xp);
        /* Why this connector can never move a transfer of this transport, as the sending
         * side (`receive` false: no device, a cache it cannot register) or as the receiving
         * one (true: peers are refused), written into why; 0 when it can. NULL: always can.
         * A permanent condition: transfers fail at once with it instead of waiting for a
         * data path that will never come (xfer.c at open, arrivals.c at the notice). */
        int (*unavailable)(struct connector *cn, bool receive, char *why, size_t whylen);

        /* ---- handshake fields of its own, on its data connections ---- */
        /* Server side (decode): add fields to the WELCOME about to go out to the peer
         * `id`; *state is handed to serve. NULL: none. -errno refuses the peer with kvf_err:
         * -ENODATA for now only (nothing to receive into yet: the engine's caches are not
         * registered), which fails its transfers "engine gone" and lets it try again; any
         * other for good ("connection error"). */
        int (*welcome)(struct connector *cn, const struct peer_identity *id, struct kvf_record *w,
                       void **state);
        /* The WELCOME could not be sent: release what welcome made (serve never runs). */
        void (*welcome_undo)(struct connector *cn, void *state);

        /* ---- decode side ---- */
        /* An accepted data connection of this transport, authenticated: serve it until it
         * ends (session thread). `state` is what welcome made (its to free). */
        void (*serve)(struct connector *cn, int fd, const struct peer_identity *id,
                      const char *remote, void *state);
};

/* Every transport of this build, in the order of the list in transport.c. */
extern const struct conn_transport *const conn_transports[];
extern const unsigned conn_ntransports;

/* The transport serving transfer_protocol `id`, or NULL (ipc, which the sender does itself,
 * or a transport not in this build). */
const struct conn_transport *conn_transport_of(int id);
/* The transport whose data connections say `purpose` in their handshake, or NULL. */
const struct conn_transport *conn_transport_by_purpose(const char *purpose);
/* Its position in conn_transports[] (per-peer and per-connector state are indexed by it). */
unsigned conn_transport_index(const struct conn_transport *t);

/* Start every transport (main.c); -errno with kvf_err set. */
int conn_transports_init(struct connector *cn);
void conn_transports_fini(struct connector *cn);

/* The transports (one file each, or a pair: tcp_tx.c, tcp_rx.c). */
extern const struct conn_transport conn_tcp_transport;
#ifdef KVF_HAVE_RDMA
extern const struct conn_transport conn_rdma_transport;
#endif

#endif
