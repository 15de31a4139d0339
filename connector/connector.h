/*
 * The connector: owns every network endpoint of an instance.
 *
 * Threads (all in this process):
 *   control  - consumes engine->connector and sender->connector, publishes
 *              arrivals (with the journal that de-duplicates them), retries
 *              what a full ring refused, heartbeats;
 *   listener - accepts connections and starts a session thread for each;
 *   session  - one per incoming connection, at most --max-sessions (default
 *              1024) at once: handshake as server, then reads notices and
 *              pings (control) or a transport's data connection (tcp_rx.c:
 *              block frames);
 *   peer I/O - a fixed pool (--peer-threads, default 2) for every outgoing
 *              peer's control connection: each thread owns an io_uring and
 *              the peers hashed to it, and multiplexes their non-blocking
 *              connects, notices, acks, pings, timers and reconnections
 *              (peer.c); the number of peers sets no number of threads;
 *   handshake - a fixed pool (--handshake-threads, default 2) that runs the
 *              blocking client handshake on a connected socket (and a
 *              same-host peer's connect) and hands the authenticated socket
 *              back to the peer's I/O thread; it also stops a retired
 *              peer's data paths;
 *   data     - per outgoing peer and transport: the transport's data path
 *              (transport.h; tcp: --streams threads with io_uring, tcp_tx.c).
 * Only the control thread writes the two outbound rings (connector->engine,
 * connector->sender) and the journal: every other thread hands it events
 * through its queue (evq.c) and rings its doorbell; what a full ring refuses
 * waits on the control thread and is retried there. The answer to a socket
 * notice is decided there too and handed back to the session thread that
 * read the notice, through its outbox (session.c): the control thread never
 * writes to a socket.
 */
#ifndef KVF_CONNECTOR_H
#define KVF_CONNECTOR_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "atomics.h"
#include "auth.h"
#include "cache.h"
#include "ctl.h"
#include "net.h"
#include "rdma_config.h"
#include "records.h"
#include "tcp_config.h"

#define CONN_MAX_TRANSPORTS 4u /* transports in one build (transport.c) */

struct xfer_peer;

struct conn_config {
        char listen_host[64];
        uint16_t listen_port;
        uint8_t token[KVF_TOKEN_MAX];
        size_t token_len;
        unsigned connect_timeout_ms; /* also bounds each handshake step */
        unsigned keepalive_ms;
        unsigned peer_timeout_ms; /* silence (or unreachability) after which a peer is dead */
        unsigned peer_idle_ms;    /* a peer without work this long is retired (sockets, data threads) */
        unsigned peer_threads;    /* I/O threads for the peers' control connections */
        unsigned handshake_threads; /* threads running client handshakes */
        unsigned max_sessions;    /* incoming connections served at once; more are closed at accept */
        struct conn_tcp_config tcp;   /* the tcp transport's */
        struct conn_rdma_config rdma; /* the rdma transport's */
};

enum ev_kind {
        EV_NOTICE,      /* a session received a finish notice (decode side) */
        EV_RESULT,      /* a peer resolved a notice: write result for the sender */
        EV_CONNECT,     /* a peer answers a connect task */
        EV_PEER_STATE,  /* a peer went up or down */
        EV_DATA_DONE,   /* every block of a network transfer has landed (decode side) */
};

struct event {
        enum ev_kind kind;
        uint64_t session; /* EV_NOTICE: who to answer */
        uint32_t ring_slot; /* EV_NOTICE from notice slot ring_slot - 1 (notices.c); 0: from a
                             * socket session */
        uint64_t src_gen; /* EV_NOTICE, EV_DATA_DONE: the sending instance's incarnation (the
                           * created_ns it proved in the handshake): transfer keys restart
                           * when a prefill instance is re-created under the same name */
        bool answered; /* EV_NOTICE from a slot: a withdrawal answered ahead of its turn while
                        * the notice it withdrew waits for room (notices.c) */
        struct kvf_record rec;
        struct event *next;
};

struct notice {
        uint64_t key;
        char request_id[KVF_REQ_ID_MAX];
        bool id_bin; /* the request id is bytes (msgpack bin): answered as it came */
        uint8_t *frame; /* encoded NOTICE record */
        uint32_t len;
        uint64_t first_ns; /* when the connector got it */
        bool abort_notice; /* fire and forget */
        uint64_t peer_gen; /* the peer incarnation its transfer was bound to: never sent to another
                            * (0: not bound) */
        bool withdraw;     /* the sender withdraws a finish notice: the ack says what the peer did */
        /* Sent on some connection at least once: the peer may have published the arrival,
         * so only the peer's answer may end it (in doubt), never a timeout here. */
        bool sent;
        struct notice *next;
};

/* An engine's connect task waiting for its peer. */
struct connect_wait {
        char *task_id;
        uint64_t session; /* the engine session that asked */
        bool id_bin;
        uint64_t since; /* when the peer took it (peer.c) */
};

struct peer_io;

struct peer {
        char name[KVF_PEER_MAX];
        struct connector *cn;
        struct peer_io *io; /* the I/O thread that owns its control connection (for life) */
        pthread_mutex_t mu;
        /* Writes on the control socket: the I/O thread's, and the control thread's
         * direct sends of notices (conn_peer_enqueue). Taken before mu. Never held
         * across a wait: the socket is non-blocking and what it does not take now
         * stays in obuf. */
        pthread_mutex_t wmu;
        /* changed under both wmu and mu: the connected control socket, or -1, and
         * which connection it is (a new number per connection) */
        int fd;
        uint64_t conn;
        /* under wmu: frames the I/O thread wrote that the socket has not taken yet
         * (obuf[ooff..olen)), and the abort notices among them (freed once out) */
        uint8_t *obuf;
        uint32_t olen, ooff, ocap;
        struct notice *oaborts;
        /* under mu */
        struct notice *queue, *queue_tail; /* to send */
        struct notice *inflight;           /* sent, waiting for an ack */
        struct connect_wait connects[64];  /* connect tasks waiting for an answer */
        unsigned nconnect;
        unsigned failures; /* connection attempts failed in a row */
        uint64_t remote_session; /* the decode engine session the peer last told us of (I/O thread) */
        /* The peer instance's incarnation (its segment's created_ns) its control connection
         * last proved; 0 before the first (written by the I/O thread, read by the control
         * thread at a transfer's open: atomic). A transfer is bound to one incarnation. */
        uint64_t remote_gen;
        bool up;
        bool stop; /* atomic (kvf_store_release / kvf_load_acquire): the peer is retired */
        /* per transport (transport.h: conn_transports[]), created on first use; set under mu */
        struct xfer_peer *xfers[CONN_MAX_TRANSPORTS];

        /* Its I/O thread's only (peer.c), except where a handshake worker has it (state
         * PS_HS: the worker reads host, port, cfd and writes the hs_ fields, handed over
         * under the pools' mutexes). */
        int state;
        int gauge; /* the peers gauge counting it (peer.c, pstate): the counter id, or 0 */
        uint32_t slot, ugen; /* its place in the I/O thread's table; completions' generation */
        bool armed_rd, armed_wr, armed_cn;
        int cfd; /* a connect under way (PS_CONNECTING) or done, for the handshake */
        bool hs_local;
        int hs_fd, hs_rc, hs_status;
        char hs_why[KVF_REASON_MAX];
        char hs_instance[KVF_INSTANCE_MAX];
        uint32_t hs_block_size; /* the peer's tokens per block (its handshake) */
        uint64_t hs_gen;        /* the peer's incarnation (its handshake) */
        char host[128];
        uint16_t port;
        uint64_t due, retry_at, conn_deadline, last_rx, last_tx, backoff_ms, last_fail_check;
        struct kvf_reader rd;
        /* under the I/O thread's mutex: news for it (a mailbox of peers) */
        unsigned mail;
        struct peer *mail_next;
        bool in_mail;
        /* under the handshake pool's mutex */
        int job;
        struct peer *job_next;

        /* control thread only: the table (peer.c), retirement (conn_peers_tick) */
        struct peer *hnext;
        uint64_t idle_since; /* no work since then, 0 = busy */
        struct peer *next_retired;
        int exited; /* atomic: its I/O thread and its data paths are done with it (it may be freed) */
};

/* A frame for a session's own thread to write (session.c). */
struct out_frame {
        struct out_frame *next;
        uint16_t type;
        uint32_t len;
        uint8_t payload[];
};

struct session {
        uint64_t id;
        int fd;    /* written by its session thread only */
        int efd;   /* eventfd: the outbox has frames */
        pthread_mutex_t omu; /* the outbox: filled by the control thread, emptied by the session */
        struct out_frame *out, *out_tail;
        char remote[64];
        char instance[KVF_INSTANCE_MAX];
        uint64_t peer_gen; /* the peer's incarnation, from the handshake */
        struct session *next;
};

/* How often a thread blocked in poll(), a ring wait or a condition variable looks at the stop
 * flags (and, where it has one, its own deadline): the bound on how long a stop waits for it. */
#define CONN_POLL_MS 200
/* How long a stopping connector waits for its session threads (conn_sessions_stop). */
#define STOP_WAIT_MS 3000u
/*
 * Incoming connections served at once (--max-sessions): a decode instance serves a few hundred
 * prefill ranks at most, each with a control connection and --streams tcp data connections
 * (default 2; or an rdma connection's tcp anchor): 1024 is about 340 peers at the defaults.
 */
#define CONN_MAX_SESSIONS_DEFAULT 1024u

struct rx_xfer;
#define RX_BUCKETS 1024u /* landing.c's transfer table, hashed by (peer, key) */

/*
 * The last same-host notice read, rehearsed while the next is expected (notices.c
 * conn_notices_rehearse): a notice record of at most CONN_REHEARSE_REC bytes, its source's
 * incarnation, and a scratch buffer for the records the rehearsal encodes.
 */
#define CONN_REHEARSE_REC 1024u
#define CONN_REHEARSE_NS 10000ull /* at most one rehearsal per this many ns of polling */
struct conn_rehearsal {
        uint8_t rec[CONN_REHEARSE_REC];
        uint32_t len; /* 0: nothing to rehearse yet */
        char owner[KVF_INSTANCE_MAX]; /* its source, as the slot named it */
        uint64_t src_gen;
        uint64_t at_ns; /* the last one */
        bool off;       /* KVF_AB_NO_REHEARSAL=1 (an A/B switch) */
        uint8_t scratch[4 * CONN_REHEARSE_REC];
};

/* A notice slot as the decode connector sees it (notices.c). */
struct conn_notice_slot {
        struct kvf_ring notice, reply;
        uint64_t holder_gen;   /* the slot generation `holder` was mapped for; 0 none */
        struct kvf_ctl holder; /* the holder's own segment, for its sender's doorbell */
        bool mapped;
        /* Withdrawals behind a notice held by a full ring are answered ahead of their turn
         * (notices.c): the records before `early_to` were looked at, in generation early_gen. */
        uint64_t early_to, early_gen;
};

struct connector {
        struct kvf_ctl ctl;
        struct conn_notice_slot nslots[KVF_NOTICE_SLOTS];
        bool notices_blocked; /* a notice waits for room (arrival or reply ring): retry in 1 ms */
        struct conn_rehearsal rehearsal; /* control thread (notices.c) */
        struct kvf_cache cache; /* own cache: sent from (prefill), landed into (decode) */
        pthread_mutex_t rxmu; /* landing.c's table */
        struct rx_xfer *rx[RX_BUCKETS];
        uint64_t gen;
        struct conn_config cfg;
        int listen_fd;
        int unix_fd; /* same-host control connections (net.h), or -1 */
        int stop; /* atomic: set once when the connector stops (conn_stopping) */

        /* The control thread's event queue (evq.c), under evmu. */
        pthread_mutex_t evmu;
        pthread_cond_t evroom; /* a notice waits for room (conn_post_wait) */
        struct event *events, *events_tail;
        uint64_t nevents; /* queued, for the doorbell's has_work (release store, acquire loads) */
        uint64_t ev_held; /* queued or held back by the control thread (deferred) */
        uint32_t ev_limit; /* notices wait while ev_held is at this */
        uint32_t ev_waiting; /* atomic: producers waiting for room (tests read it) */

        pthread_mutex_t smu;
        struct session *sessions;
        uint64_t next_session;
        /* Every session thread, control or data, from its start to its end (under smu):
         * stopping shuts their sockets down and waits for them (conn_sessions_stop). */
        struct session_arg *threads;
        unsigned nthreads;
        pthread_cond_t threads_cv;

        /* The peers (control thread): a hash table by name that doubles as it fills. */
        struct peer **ptab;
        unsigned ptab_cap, npeers;
        struct peer *retired; /* stopping, to be freed once their threads let go (control thread) */
        struct peer_pool *pool; /* the I/O and handshake threads (peer.c) */

        /* The decode engine's session (connector.h conn_engine_session): the control
         * thread reads /proc each heartbeat; a dead one is remembered here. */
        uint64_t eng_dead; /* atomic */
        uint64_t eng_seen; /* control thread: the session at the last tick */
        uint64_t eng_gen_seen; /* control thread: the engine role's generation last looked at */

        /* journal index (control thread): key_hash -> journal entry, open addressing */
        uint32_t *jidx;
        uint32_t jidx_cap;
        uint32_t jnext;

        struct event *deferred, *deferred_tail; /* events waiting for ring space (control thread) */
        uint32_t tx_blocked;       /* a write batch waits for room in a peer's send queue */
        void *transport[CONN_MAX_TRANSPORTS]; /* each transport's own state (its init) */
        uint64_t acks_dropped; /* atomic: answers for a session that had closed (session.c) */
        /* rings with records published and their consumers not yet rung (control thread):
         * connector->engine, connector->sender, the notice slots' reply rings (main.c) */
        struct kvf_bells bells;
};

static inline bool conn_stopping(const struct connector *cn)
{
        return kvf_load_relaxed(&cn->stop);
}

/*
 * The decode engine's session that is live now, or 0 (see ctl.h): a
 * transfer into this instance is bound to the session live when it opened,
 * since that session reserved its blocks. Any thread; no /proc read (the
 * control thread's heartbeat does that, conn_engine_check, and sets eng_dead).
 */
static inline uint64_t conn_engine_session(struct connector *cn)
{
        uint64_t s = kvf_engine_session(&cn->ctl, false);
        return s && s == kvf_load_acquire(&cn->eng_dead) ? 0 : s;
}

/* evq.c: the control thread's event queue; calls nothing but the doorbell */
#define CONN_EVENTS_MAX 4096u /* notices from sockets queued before their sessions wait */
/* Set up the queue (before any thread starts): 0 or -errno. limit 0: CONN_EVENTS_MAX. */
int conn_evq_init(struct connector *cn, uint32_t limit);
/* Any thread: queue an event for the control thread and ring its doorbell; never waits.
 * Takes ownership of ev. For the connector's own events (results, states, landed data). */
void conn_post(struct connector *cn, struct event *ev);
/*
 * A session thread: queue a notice read from its socket, waiting while the queue
 * holds its limit (the peer that sends too fast is the one that waits). 0, 1 when
 * it had to wait, -ESHUTDOWN when the connector stops meanwhile (ev is freed; the
 * prefill side sends the notice again to the next connector, and the journal
 * answers it). Takes ownership of ev.
 */
int conn_post_wait(struct connector *cn, struct event *ev);
/* Control thread: take everything queued, in order; then say how many it is done with
 * (handled or dropped, not held back) so that waiting producers get room. */
struct event *conn_evq_take(struct connector *cn);
void conn_evq_done(struct connector *cn, uint64_t n);
uint64_t conn_evq_held(struct connector *cn);
/* Any thread: tell the sender how a network transfer ended (WRITE_RESULT). */
void conn_post_write_result(struct connector *cn, uint64_t key, const char *request_id, bool id_bin,
                            int status, const char *reason);
/* Any thread: answer an engine's connect task (CONNECT_RESULT). */
void conn_post_connect_result(struct connector *cn, const struct connect_wait *w, const char *peer,
                              int status, const char *reason);
/* Any thread: every block of a network transfer has landed (EV_DATA_DONE). */
void conn_post_data_done(struct connector *cn, const char *peer, uint64_t gen, uint64_t key);

/* events.c: what an event does, on the control thread only */
/* Control thread: handle what is queued (and what a full ring held back before). */
void conn_events_run(struct connector *cn);

/* handshake.c: 0 with the peer's identity in *out, or -errno with kvf_err set and (client)
 * *status (enum kvf_status) saying what kind of failure it was. */
struct peer_identity {
        char instance[KVF_INSTANCE_MAX];
        struct kvf_cache_layout layout;
        uint64_t created_ns;
        uint32_t rank, nranks; /* its place in its tensor-parallel group (nranks >= 1) */
};
/* purpose: "control" (notices, acks, pings) or a transport's data connection (its purpose,
 * transport.h). welcome (may be NULL) receives the server's WELCOME, whose fields a transport
 * may read; release it with kvf_record_free. */
int conn_handshake_client(struct connector *cn, int fd, const char *purpose,
                          struct peer_identity *out, struct kvf_record *welcome, int *status);
/* *tstate: what the transport of a data connection made for it in the handshake (or NULL). */
int conn_handshake_server(struct connector *cn, int fd, struct peer_identity *out, char *purpose,
                          size_t purposelen, void **tstate);
int conn_send_record(int fd, const struct kvf_record *r, unsigned timeout_ms);

/* peer.c */
/* Start the peers' I/O and handshake threads (main.c, before the control loop): 0 or -errno
 * with kvf_err set. */
int conn_peers_start(struct connector *cn);
/*
 * The peer named `name`, created on first use (control thread). NULL only when
 * the connector is out of memory (*why says so): the table has no fixed size.
 */
struct peer *conn_peer_get(struct connector *cn, const char *name, char *why, size_t whylen);
void conn_peer_enqueue(struct peer *p, struct notice *n);
/* The sender withdraws the finish notice of n->key (n is the withdrawal): see peer.c. */
void conn_peer_withdraw(struct peer *p, struct notice *n);
void conn_peer_connect_task(struct peer *p, const struct connect_wait *w);
/* Control thread, each heartbeat: retire peers idle longer than peer_idle_ms, free retired ones. */
void conn_peers_tick(struct connector *cn, uint64_t now);
/* At stop (after the session threads): end every connection and thread of the peers. */
void conn_peers_stop(struct connector *cn);
/* Any thread: the peer has work (a transfer opened) and should connect. */
void conn_peer_kick(struct peer *p);
/* Where to connect: "host:port" as given, or a same-host instance's published address. On
 * failure *status says how a task for this peer fails (unknown peer, or connection error). */
int conn_peer_resolve(struct peer *p, char *host, size_t hostlen, uint16_t *port, int *status);

/* session.c */
struct session_arg;
void *conn_listener_main(void *arg);
/* At stop, after the listener thread has ended: shut down every session thread's socket and
 * wait for them, up to wait_ms. True when none is left (else the caller must keep what they
 * use, the control segment above all, mapped). */
bool conn_sessions_stop(struct connector *cn, unsigned wait_ms);
/*
 * Control thread: hand r to the session's own thread to write (its outbox), never
 * waiting on the socket. 0; -ENOENT when the session has closed (the answer is
 * dropped and counted in acks_dropped: the prefill side sends its notice again on
 * its next connection and the journal answers it); -ENOMEM.
 */
int conn_session_send(struct connector *cn, uint64_t session, const struct kvf_record *r);
/* Control thread: r for every incoming control connection, through their outboxes. */
void conn_sessions_send_all(struct connector *cn, const struct kvf_record *r);
/* A session without a thread of its own (tests): registered on fd, its id in *id. 0 or -errno. */
int conn_session_open(struct connector *cn, int fd, const char *instance, uint64_t peer_gen, uint64_t *id);
/* Write what the session's outbox holds, as its thread does: 0, or -errno (the socket failed). */
int conn_session_flush(struct connector *cn, uint64_t id);
void conn_session_close(struct connector *cn, uint64_t id);

/* notices.c: same-host notices in one hop, read by the control thread */
/* Bind the notice slots' rings (after the role claim): repairs a predecessor's consume. */
int conn_notices_init(struct connector *cn);
/* Handle the notices committed to every claimed slot; true if any was read. */
bool conn_notices_read(struct connector *cn);
bool conn_notices_readable(struct connector *cn);
/* Answer a notice that came from slot s: 0, or -EAGAIN when its reply ring is full. */
int conn_notice_reply(struct connector *cn, uint32_t s, const struct kvf_record *ack);
/* While a prefill sender expects to post a notice here (the doorbell's expectation): handle the
 * last notice read again without its effects, at most every CONN_REHEARSE_NS, so the next
 * one's handling finds its code and data in the caches. Control thread, from its polling. */
void conn_notices_rehearse(struct connector *cn);
void conn_notices_close(struct connector *cn);

/* arrivals.c: the decode side of a notice */
void conn_journal_init(struct connector *cn);
/* A notice (EV_NOTICE): publish its arrival once and acknowledge it; -EAGAIN when the ring is full. */
int conn_arrival_notice(struct connector *cn, struct event *ev);
/* Every block of a network transfer is in (EV_DATA_DONE): publish if its notice waits. */
int conn_arrival_data_done(struct connector *cn, struct event *ev);
/* Control thread: notice a decode engine session that ended or began. */
void conn_engine_check(struct connector *cn);
/* Was the arrival for this notice published already (and committed)? */
bool conn_arrival_published(struct connector *cn, const struct kvf_record *notice, uint64_t src_gen);
/*
 * Publish the arrival for a notice, once, with `status` and `why` (the
 * notice's own for NULL) for the decode engine session `session`. Returns the
 * status to acknowledge with: for a repeat, the status the arrival was
 * published with (so a withdrawn notice learns what really happened);
 * -EAGAIN when the ring is full, -ENOMEM. With `owed` (a withdrawal read from a
 * notice slot's ring, where the notice it withdrew stays until published), a
 * full ring decides it instead: its status is kept pending in the journal,
 * *owed set, and the notice ahead of it publishes that status once there is
 * room. NULL `owed` (a socket notice): -EAGAIN as for any notice.
 */
int conn_publish_arrival(struct connector *cn, const struct kvf_record *notice, uint64_t src_gen,
                         int status, const char *why, uint64_t session, char *reason,
                         size_t reasonlen, bool *owed);
/* The handling of a finished notice without its effects: lookups, checks, records encoded into
 * scratch (conn_notices_rehearse). Publishes, journals and answers nothing. */
void conn_arrival_rehearse(struct connector *cn, const struct kvf_record *notice, uint64_t src_gen,
                           uint8_t *scratch, size_t cap);

#endif
