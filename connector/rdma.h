/*
 * The rdma transport (transfer_protocol "rdma"): librdmacm connection setup,
 * RC queue pairs, one-sided RDMA WRITEs into the peer's cache.
 *
 * Setup. A peer's rdma data path first opens a tcp data connection with
 * purpose "rdma" and runs the authenticated handshake on it (token, identity,
 * layout). The decode side answers with the rdma fields of its WELCOME
 * (records.md): its rdma_cm port, the region this peer may write (its cache,
 * registered for this connection alone, in a protection domain of its own),
 * the region's remote key, and a ticket. The prefill side then connects with
 * rdma_cm (RC) to the address of that tcp connection, carrying the ticket as
 * private data; the decode side accepts only a connect whose ticket belongs
 * to a handshake still open. The tcp connection stays open as the rdma
 * connection's anchor: when either ends, both are torn down and the region is
 * deregistered.
 *
 * Data. Each frame (a run of blocks contiguous on both sides, one layer and
 * tensor) is one RDMA WRITE work request: local address and key of the
 * prefill cache's registration, remote address computed with the peer's own
 * layout. Work requests are posted in chains (one ibv_post_send), never more
 * outstanding than the send queue's depth, signalled every signal_every-th
 * and at the end of what there is to post. After a transfer's last write, and
 * once its finish notice is out, a SEND of 24 bytes {magic, key, session}
 * follows on the same queue pair: RC executes it after the writes before it,
 * so its receive completion on the decode side means every byte of the
 * transfer has landed (landing.c conn_landing_complete). The arrival itself
 * is still published by the finish notice on the control connection, as for
 * tcp (outcome agreement, journal): the SEND stands for tcp's full landing
 * bitmap.
 *
 * Completions. A successful signalled completion completes every work request
 * posted before it. An error completion names one work request: the writes
 * before it landed, its own transfer ends "write error" with the status, and
 * the queue pair is dead: everything after it is given back and goes again
 * on the next connection. Errors that say the peer or the link is gone
 * (retry exceeded, flushed) fail no transfer: the peer's timeout does, as for
 * tcp.
 */
#ifndef KVF_RDMA_H
#define KVF_RDMA_H

#include <stdint.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "cache.h"
#include "transport.h"

#define RDMA_DONE_MAGIC 0x6b766644u /* "kvfD" */

/* The done message, SENT after a transfer's last write (big-endian on the wire). status 0:
 * every write before it landed; else (a kvf_status) a write of the transfer failed after its
 * finish notice went out: the decode side answers that notice with this status. */
struct rdma_done_msg {
        uint32_t magic;
        uint16_t status;    /* enum kvf_status */
        uint16_t wc_status; /* status != 0: the work completion's status (enum ibv_wc_status) */
        uint64_t key;
        uint64_t session;
};
_Static_assert(sizeof(struct rdma_done_msg) == 24, "rdma done message is a wire format");

#define RDMA_TICKET_LEN 32u

/* rdma_dev.c: what both sides share */

/* The connector's rdma state (cn->transport[i]). */
struct rdma_state;
struct rdma_state *rdma_state(struct connector *cn);

/*
 * The IPv4 address of device `name`'s network interface (port 1), for
 * rdma_cm to bind to: 0, or -ENODEV with kvf_err set.
 */
int rdma_device_addr(const char *name, struct sockaddr_in *out);
/*
 * rdma_mr.c: register cache c in protection domain pd with `access`: host
 * memory as it is, GPU memory through a dma-buf, else as peer memory. The
 * region, and in *how (may be NULL) which way it went; NULL with kvf_err
 * saying why (both reasons for GPU memory, and what would make it work).
 * A cache in one allocation only (c->parts NULL).
 */
struct ibv_mr *rdma_reg_cache(struct ibv_pd *pd, struct kvf_cache *c, int access, const char **how);

/*
 * A cache registered with one protection domain, whatever its shape: one
 * memory region for a cache in one allocation; for a cache in parts (one GPU
 * allocation per tensor, or the engine's registered views) a region per span
 * of memory its parts cover (parts that overlap, as blocks-first views do, or
 * that follow each other in host memory, share one), and the region of each
 * part. Registering pins the pages: a registration of the engine's caches
 * holds the memory of the generation it was made of (reg_gen) until freed.
 */
struct rdma_mrs {
        uint32_t n;
        struct ibv_mr **mr;
        uint32_t *part_mr;   /* a cache in parts: part i's region is mr[part_mr[i]]; else NULL */
        uint32_t n_parts;
        struct kvf_cache_layout layout; /* the cache's, for the lookups (kvf_layout_part) */
        uint64_t reg_gen;    /* the cache's reg_gen when registered (0: not the engine's caches) */
        uint32_t dmabufs;    /* regions registered through a dma-buf */
        unsigned refs;       /* rdma_dev.c's sharing of the sending side's registration */
};
/* 0 and *out, or -errno with kvf_err set (nothing left registered). */
int rdma_reg_mrs(struct ibv_pd *pd, struct kvf_cache *c, int access, struct rdma_mrs **out, const char **how);
void rdma_mrs_free(struct rdma_mrs *m);
/* The region holding byte `off` of the cache (in kvf_layout_offset order, checked by the caller). */
static inline const struct ibv_mr *rdma_mrs_at(const struct rdma_mrs *m, uint64_t off)
{
        uint64_t rest;
        return m->mr[m->part_mr ? m->part_mr[kvf_layout_part(&m->layout, off, &rest)] : 0];
}

/* The engine's caches were registered anew (or dropped) since m was registered: m pins memory
 * that is no longer the cache. False for any other cache. */
bool rdma_mrs_stale(const struct connector *cn, const struct rdma_mrs *m);

/* The welcome's rdma_parts: per part, its address (high and low words), its block stride
 * (high, low) and its region's remote key. */
#define RDMA_PART_WORDS 5u
/* The table of cache c registered as m: 0 and *words (malloc'd, *n of them), or -ENOMEM. */
int rdma_mrs_table(const struct kvf_cache *c, const struct rdma_mrs *m, uint32_t **words, uint32_t *n);

/* The registration of this instance's own cache on `ctx` (prefill side: the source of
 * writes), made once per device and per registration of the engine's caches, shared by the
 * connections (a reference each: rdma_local_mrs_put): its PD in *pd. 0, or -errno (kvf_err). */
int rdma_local_mrs(struct connector *cn, struct ibv_context *ctx, struct ibv_pd **pd, struct rdma_mrs **out);
void rdma_local_mrs_put(struct connector *cn, struct rdma_mrs *m);
/* The engine's caches: can rdma carry them now? 0 (any other cache too); -ENODATA not
 * registered yet (or any more); why says it. */
int rdma_engine_caches_why(struct connector *cn, char *why, size_t whylen);
/* Wait (at most timeout_ms) for the next event on channel ec; it must be `want`. 0 and *ev
 * (the caller acks it), or -errno with kvf_err set. */
int rdma_cm_wait(struct rdma_event_channel *ec, enum rdma_cm_event_type want, unsigned timeout_ms,
                 struct rdma_cm_event **ev);
/* Teardown, any argument NULL: a connection's queue pair (on id), completion queue (its
 * cq_events acknowledged first) and completion channel; then, once its registrations are gone,
 * an rdma_cm id and its event channel. */
void rdma_qp_cq_destroy(struct rdma_cm_id *id, struct ibv_cq *cq, unsigned cq_events,
                        struct ibv_comp_channel *cc);
void rdma_id_destroy(struct rdma_cm_id *id, struct rdma_event_channel *ec);
/* Short name of a completion status, for reasons. */
const char *rdma_wc_str(enum ibv_wc_status st);
/* Does this completion status mean the peer or the link is gone (no request's fault)? */
int rdma_wc_is_link(enum ibv_wc_status st);

/* rdma_tx.c: prefill side ops */
int rdma_peer_init(struct xfer_peer *xp);
void rdma_start(struct xfer_peer *xp);
void rdma_stop(struct xfer_peer *xp);
void rdma_peer_free(struct xfer_peer *xp);
int rdma_xfer_open(struct xfer_peer *xp, struct xfer *x);
void rdma_xfer_free(struct xfer_peer *xp, struct xfer *x);
void rdma_noticed(struct xfer_peer *xp, struct xfer *x);
void rdma_wake(struct xfer_peer *xp);

/* rdma_rx.c: decode side */
int rdma_rx_init(struct connector *cn, struct rdma_state *st);
void rdma_rx_fini(struct connector *cn, struct rdma_state *st);
int rdma_welcome(struct connector *cn, const struct peer_identity *id, struct kvf_record *w,
                 void **state);
void rdma_welcome_undo(struct connector *cn, void *state);
void rdma_serve(struct connector *cn, int fd, const struct peer_identity *id, const char *remote,
                void *state);

#endif
