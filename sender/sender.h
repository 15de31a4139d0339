/*
 * The sender: consumes tasks, chunk progress, cancels and layer-done
 * progress; decides what to move when; copies same-host (ipc) transfers
 * itself; hands network writes and finish notices to the connector; and
 * reports one completion per request.
 *
 * Its request table lives in the control segment (struct kvf_req_slot), so a
 * restarted sender adopts every request in flight. What is kept only in
 * this process (the request-id map, the step buckets, the destination blocks
 * of live requests, peer mappings, a request's in-process state and what it
 * owes the rings) is rebuilt from the table at start.
 *
 * Files call downward only: main.c -> tasks.c (records in) -> request.c (a
 * request's states and transitions) -> progress.c, copies.c, plan.c,
 * outbox.c, sessions.c, peers.c, table.c, which return what happened and
 * never call back up. setup.c opens and closes a sender (main.c, tests).
 *
 * Single-threaded: everything here runs on the sender's one thread.
 */
#ifndef KVF_SENDER_H
#define KVF_SENDER_H

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "cache.h"
#include "cpus.h"
#include "ctl.h"
#include "notice.h"
#include "records.h"
#include "tpsplit.h"

#define SENDER_MAX_PEERS 64u
/* Bytes one request may move in one go before other requests' ready layers get their turn:
 * copies the sender's thread makes itself (host caches, same host) take their time, so they go
 * in smaller slices, and a layer of a request that is behind is cut by blocks (sender_advance). */
#define SENDER_SLICE_BYTES (4ull << 20)
#define SENDER_SLICE_BYTES_SYNC (1ull << 20)

/* How far into one layer a request's sliced copy got: valid while the slot still holds the
 * same request at the same layer and block range (kept in this process only; a restarted
 * sender copies that layer again from its start, the same bytes). */
struct layer_cut {
        uint64_t accept_ns; /* the request (kvf_req_slot.accept_ns) */
        uint32_t layer, b0; /* its layer (cur_layers) and first block (sent_full) */
        uint32_t done;      /* blocks [b0, b0 + done) of that layer are copied */
};

/* A copy batch in flight: its backend ticket and the requests it carries. */
struct copy_batch {
        uint64_t ticket;
        uint32_t *slots;
        uint32_t nslots;
        struct copy_batch *next;
};

/* Copies the engine's context owes a request (engine executor, plan.c): they have landed when
 * exec.landed reaches `word`. */
struct copy_owe {
        uint32_t slot;
        uint32_t gen;      /* the plan entry's gen when it was closed */
        uint64_t word;     /* PACK(step, claimed) */
        uint64_t session;  /* the engine session that queued them */
        uint64_t deadline_ns;
};

/* A same-host peer instance whose cache this sender writes into. */
struct ipc_peer {
        char name[KVF_PEER_MAX];
        struct kvf_ctl ctl;     /* read-only view of its control segment */
        struct kvf_cache cache; /* its cache, mapped read-write (by its backend) */
        uint64_t created_ns;    /* identity of the peer's segment we mapped */
        ino_t ino;
        bool in_use;
        /* --notice-rings: the notice slot we hold in the peer's segment (slot NULL: none,
         * its notices go through the connectors' sockets) */
        struct kvf_notice_end nend;
        /* A peer of another tensor-parallel split (or block size) of the same model: the
         * pieces of each block this rank sends it (common/tpsplit.h); npieces 0 when the
         * layouts are equal and whole blocks move. */
        struct kvf_tp_plan plan;
};

/* notice_gen of a finish notice committed to a peer's notice ring (not to our connector):
 * a restart of our connector does not lose it. Never a connector generation. */
#define SENDER_NOTICE_GEN_RING UINT64_MAX

/* One destination block of a live request: `block` of the peer whose name hashes to `tag`
 * (kvf_req_slot.peer of `slot` says which exactly); slot UINT32_MAX: an empty entry. */
struct booking {
        uint32_t tag, block, slot;
};

/* Requests armed at a forward step: their front chunk completes in that step. */
struct bucket {
        uint64_t step;
        uint32_t n, cap;
        uint32_t *slots;
};

/* What a tcp peer's connector last told about its decode engine session. */
#define SENDER_NET_PEERS 256u
struct net_peer {
        char name[KVF_PEER_MAX];
        uint64_t session;
        uint64_t seen_ns;
        uint32_t block_size; /* its tokens per block, as its connector last told (0 unknown) */
        /* a peer named by instance is on this host: its segment, read-only, says it exactly */
        struct kvf_ctl ctl;
        ino_t ino;
        bool mapped;
};

#define SENDER_PREWAKE_MAX 16u /* (prewakes started later: see SENDER_PREWAKE_LEAD_NS) */

/*
 * Stopping (SIGTERM or SIGINT: tools/kvferry down; request.c, docs/ARCHITECTURE.md 6, "Stopping").
 * From `at` on, a task read is refused ('connection error', `why`); requests in flight go on as
 * before until `window_end` (kvf-sender --stop-drain-ms). Then a request still moving ends
 * 'connection error' (its peer told with an abort notice, its completion after its copies in
 * flight), and a finish notice still unanswered is withdrawn (the peer's answer decides, as at
 * a deadline). A withdrawal unanswered at `answers_end` leaves its request in doubt ('timed
 * out'); at `end` the sender exits, whatever is left. Well within the supervisor's 5 s between
 * TERM and KILL (tools/kvferry stop_all): the window is at most SENDER_STOP_DRAIN_MS_MAX, and
 * `end` SENDER_STOP_LAST_NS after it.
 */
#define SENDER_STOP_DRAIN_MS_DEFAULT 2000u
#define SENDER_STOP_DRAIN_MS_MAX 3000u
#define SENDER_STOP_ANSWER_NS 500000000ull /* a live peer answers a withdrawal in microseconds */
#define SENDER_STOP_LAST_NS 1000000000ull
enum sender_stop_phase {
        SENDER_STOP_NONE = 0, /* running */
        SENDER_STOP_DRAIN,    /* requests in flight go on; new tasks are refused */
        SENDER_STOP_ANSWERS,  /* what was in flight is ended or withdrawn: its answers, its copies */
        SENDER_STOP_LAST,     /* withdrawals unanswered are in doubt: completions still owed go out */
};
struct sender_stop {
        uint64_t at, window_end, answers_end, end; /* CLOCK_MONOTONIC ns; at 0: running */
        uint64_t drain_ns;
        uint8_t phase;           /* enum sender_stop_phase */
        uint32_t in_flight;      /* requests in the table when it began */
        uint32_t finished;       /* completions posted since it began: finished, */
        uint32_t failed;         /* ... and failed (for whatever reason) */
        uint32_t ended;          /* requests it ended at the window's end, */
        uint32_t withdrawn;      /* ... finish notices it withdrew then, */
        uint32_t doubt;          /* ... and withdrawals unanswered at answers_end */
        uint32_t refused;        /* tasks refused since it began */
        char why[KVF_REASON_MAX]; /* "instance 'P' is stopping (tools/kvferry down)" */
};

struct sender {
        struct kvf_ctl ctl;
        uint64_t gen;
        const struct kvf_cache_layout *layout;
        uint32_t layers;  /* layers + extra layers */
        uint32_t tensors; /* every tensor of a layer (kvf_layout_all_tensors): K (and V), then their scales */
        struct kvf_cache own; /* own cache, read-only */

        /* request id -> slot: open addressing, 2x the slots, UINT32_MAX = empty */
        uint32_t *map;
        uint32_t map_cap;
        uint64_t *armed;  /* per slot: the step it is armed at, or UINT64_MAX */
        uint32_t armed_copies; /* armed slots whose bytes this sender copies (ipc): what
                                * --layer-wait auto spins for (main.c) */
        uint8_t *rq;      /* per slot: enum sender_req_state (request.c writes it, and only it) */
        uint8_t *flags;   /* per slot: SLOT_* below, what it owes the rings (request.c) */
        uint32_t *tmp;    /* scratch list of slots */
        uint32_t *resend; /* per slot: SLOT_RESEND cursor (see sender_resend) */
        struct layer_cut *cut; /* per slot: a layer copied in slices (sender_advance) */
        bool sync_copies;      /* same-host copies run on this thread (host backend) */
        bool own_landing;      /* a step's last layer: a copy batch per request (progress.c) */
        uint32_t own_batches;  /* at most so many of them a progress word (SENDER_OWN_BATCHES) */
        uint32_t own_left;     /* such batches left in this progress word's walk */
        bool spin_layers;      /* --layer-wait: poll while requests wait for layers (main.c) */
        /* --layer-wait auto: spin only while holding one of the host's spin seats (common/cpus.h),
         * taken when requests wait for layers, given back after SENDER_SEAT_IDLE_NS without */
        bool seat_auto;
        unsigned seats;
        struct kvf_spin_seat seat;
        uint64_t seat_busy_ns; /* when requests last waited for layers (a tick saw them) */
        uint64_t seat_try_ns;  /* the last try for a seat (main.c seat_want) */
        bool prewake;          /* the notice prewake: CPUs to spare for it (main.c, outbox.c) */
        uint64_t layer_gap_ns; /* the engine's pace: the next layer-done at most this long after
                                * the last (main.c; 0: no pace yet) */
        uint64_t layer_gap_lo_ns; /* ... and no sooner than this */
        uint64_t layer_event_ns;  /* when the last layer-done was published (or seen) */
        /* Prewakes started later, ahead of a slow engine's last layer (sender.h, progress.c): due
         * at prewake_due_ns (0: none), for these slots (main.c fires them). */
        uint64_t prewake_due_ns, prewake_lead_ns;
        uint32_t prewake_n;
        uint32_t prewake_slot[SENDER_PREWAKE_MAX];
        uint64_t prewake_bytes[SENDER_PREWAKE_MAX];
        uint32_t *runs;   /* scratch: (src, dst index, count) triples of one write batch */
        uint32_t *idset;  /* scratch: open-addressing set of block ids (id + 1; 0 = empty) */
        /* The destination blocks of live requests, (peer, block) -> slot (table.c): a task that
         * names one for another request is an engine's double booking. Open addressing,
         * at most half full; grows with the blocks booked (at most reqtab_slots x max_blocks). */
        struct booking *book;
        uint32_t book_cap, book_n, book_shift;
        uint8_t *booked;        /* per slot: its destination blocks are in `book` */
        uint64_t *abort_since;  /* per slot: when its abort notice first found its ring full */
        struct bucket *buckets; /* sorted by step */
        uint32_t nbuckets, capbuckets;

        uint64_t progress;     /* last progress word handled */
        uint64_t progress_ns;  /* its publish time */
        /* The last SENDER_WORDS_SEEN progress words handled and their publish times, oldest
         * first from words_at: when the layers a request has now became ready (progress.c). */
#define SENDER_WORDS_SEEN 64u
        uint64_t words[SENDER_WORDS_SEEN], words_ns[SENDER_WORDS_SEEN];
        uint32_t words_at, nwords;
        bool copy_timed;       /* the latency of this progress word is recorded */
        uint64_t connector_gen;
        uint64_t session;      /* the engine session served now (sessions.c), 0 none */
#define SENDER_SESSION_UNKNOWN UINT64_MAX /* at start: compare every request with the live one */
        uint64_t dead_session; /* a session whose process was found gone */
        uint64_t engine_gen_seen; /* the engine role's generation when last looked at */
        uint64_t request_timeout_ns;
        bool pending; /* some slot has flags set: sender_flush_pending() has work */
        bool sliced;  /* a backlog left a slice for the next turn of the loop */
        bool engine_blocked; /* the next task waits (table full, or its rejection has no room) */
        uint64_t engine_retry_ns; /* ...and is tried again then, or when a slot is freed */
        uint64_t held_pos; /* 1 + the ring position of the task counted as held back (table full) */

        struct ipc_peer peers[SENDER_MAX_PEERS];
        /* copies.c: the batch being gathered, and batches in flight */
        struct {
                struct kvf_copy_run *runs;
                uint32_t nruns, caprun;
                struct kvf_copy_run *sorted; /* submit's sort: as large as runs */
                uint32_t capsorted;
                struct kvf_cache *dst[SENDER_MAX_PEERS];
                uint32_t dst_peer[SENDER_MAX_PEERS];
                uint32_t ndst;
                uint32_t *slots;   /* in the batch being gathered */
                uint32_t nslots;
                struct copy_batch *flight; /* batches in flight, oldest first (a list) */
                struct copy_batch *flight_tail;
                uint32_t nflight;
                uint32_t *inflight; /* per slot: its batches in flight, the engine's owes included */
                uint8_t *state;     /* per slot: COPY_* */
                uint32_t *news;     /* slots with COPY_NEWS, a ring from news_at: what request.c
                                     * has to hear */
                uint32_t news_at, nnews;
                char (*why)[KVF_REASON_MAX]; /* per slot with COPY_FAILED: the first failure */
                struct copy_owe *owes; /* the engine's copies not yet seen landed */
                uint32_t nowes, capowes;
                uint32_t *owing;    /* per slot: its owes */
        } cp;
        bool notice_rings;   /* --notice-rings (peers.c, outbox.c) */
        /* plan.c: the engine executor */
        bool plan_on;
        uint64_t *pl_step; /* per slot: the step its plan entry was last published for, or ~0 */
        struct net_peer net_peers[SENDER_NET_PEERS];
        uint8_t *scratch; /* encode buffer */
        size_t scratch_cap;
        /* rings with records published and their consumers not yet rung: the engine's, the
         * connector's, the peers' notice rings (rung after each batch of the loop, main.c) */
        struct kvf_bells bells;
        struct sender_stop stop; /* SIGTERM, SIGINT: the stop under way (request.c) */
};

/*
 * ---- request.c: a request's states and the one function that moves them ----
 *
 * Every state means the same for every transport. The shared table keeps what a
 * restarted sender needs (kvf_req_slot.state and its fields); the split of ACTIVE
 * into MOVING and LANDING, and what a slot owes the rings (SLOT_*), are kept in this
 * process only and recomputed at adoption.
 *
 *   state          kvf_req_slot.state  meaning (invariants)
 *   SREQ_FREE      FREE                no request; no flags, not armed, not in the id map,
 *                                      no destination blocks booked
 *   SREQ_MOVING    ACTIVE              accepted; some (layer, block) is not yet handed over
 *                                      (submitted to a copy batch, ipc; posted as a write
 *                                      batch, tcp/rdma). Armed at its front mark's step
 *                                      while it waits for layers. No finish notice exists.
 *   SREQ_LANDING   ACTIVE + COPY_PENDING  ipc: every byte handed over, some copy of it not
 *                                      yet seen landed (batches in flight, the engine's
 *                                      owes). Not armed. No notice exists.
 *   SREQ_LANDED    FINISHING           ipc: every byte has landed in the peer's cache. The
 *                                      finish notice is owed (notice_gen 0) or out (the
 *                                      connector generation it went to, or
 *                                      SENDER_NOTICE_GEN_RING: committed to the peer's
 *                                      notice ring); withdraw_ns != 0:
 *                                      withdrawn, waiting for the peer's answer.
 *   SREQ_HANDED    HANDED_OVER         tcp/rdma: every write batch is in the connector's
 *                                      hands (or owed again after a restart: SLOT_RESEND);
 *                                      the connector writes them. Notice as in LANDED; the
 *                                      connector's write result says whether every byte
 *                                      was written and the arrival published.
 *   SREQ_DECIDED   COMPLETING          status and reason stored; the completion is owed, or
 *                                      was claimed at completion_pos; then FREE.
 *   Destination blocks are booked (sender_book_*) in MOVING and LANDING only: from LANDED or
 *   HANDED on this sender writes them no more, and the decode engine may reuse them as soon
 *   as the arrival is published, before the answer reaches us.
 *
 * A cancel, a timeout, an ended engine session or a lost peer fail MOVING and LANDING
 * (with an abort notice to the peer, after copies in flight land); in LANDED and HANDED
 * only the peer's answer decides (a timeout withdraws the notice; see ARCHITECTURE.md 6).
 */
enum sender_req_state {
        SREQ_FREE = 0,
        SREQ_MOVING,
        SREQ_LANDING,
        SREQ_LANDED,
        SREQ_HANDED,
        SREQ_DECIDED,
        SREQ_COUNT
};

enum sender_ev_type {
        SENDER_EV_ACCEPTED,      /* its task is in the slot (tasks.c): it starts moving */
        SENDER_EV_LAYERS,        /* a chunk mark or the progress word may have made layers ready */
        SENDER_EV_COPIES,        /* copies.c has news: a batch failed, or every copy landed */
        SENDER_EV_WRITE_RESULT,  /* the connector's answer for its key: status, reason */
        SENDER_EV_CANCEL,        /* the engine cancelled it */
        SENDER_EV_FAIL,          /* it cannot go on: status, reason (a bad chunk, a lost peer...) */
        SENDER_EV_ENGINE_GONE,   /* its engine session is over: reason */
        SENDER_EV_TIMEOUT,       /* its deadline passed: now */
        SENDER_EV_CONNECTOR_NEW, /* the connector restarted: what it held for us is lost */
        SENDER_EV_RETRY,         /* rings may have room: post what it owes (SLOT_*) */
        SENDER_EV_ADOPT,         /* a restarted sender found it in the table */
        SENDER_EV_STOP_WINDOW,   /* stopping: the drain window is over (struct sender_stop) */
        SENDER_EV_STOP_ANSWERS,  /* stopping: the time for withdrawals' answers is over */
        SENDER_EV_COUNT
};

struct sender_ev {
        enum sender_ev_type type;
        int status;         /* WRITE_RESULT, FAIL */
        const char *reason; /* WRITE_RESULT, FAIL, ENGINE_GONE */
        uint64_t now;       /* TIMEOUT */
};

/* The one transition function: what `ev` does to the request in `slot`. */
void sender_req_event(struct sender *s, uint32_t slot, const struct sender_ev *ev);
static inline enum sender_req_state sender_req_state(const struct sender *s, uint32_t slot)
{
        return (enum sender_req_state)s->rq[slot];
}
const char *sender_req_state_name(enum sender_req_state st);
/* Fail a request (SENDER_EV_FAIL) with a formatted reason. */
void sender_fail(struct sender *s, uint32_t slot, int status, const char *fmt, ...)
        __attribute__((format(printf, 4, 5)));
/* A new progress word: advance the requests armed at or below its step; their copies go as
 * one batch, and the notices they make possible are posted. */
void sender_req_progress(struct sender *s, uint64_t word, uint64_t publish_ns);
/* Submit the gathered copy batch, poll batches in flight, and apply what landed or failed. */
void sender_req_copies(struct sender *s, bool flush);
/* What slots owe the rings: all of them, or these (their finish notices now). */
void sender_flush_pending(struct sender *s);
void sender_flush_slots(struct sender *s, const uint32_t *slots, uint32_t n);
/* End the requests of engine sessions that are over; check_process reads /proc (ticks). */
void sender_sessions_check(struct sender *s, bool check_process);
/* At start: take over every request of the table. */
void sender_adopt(struct sender *s);
/* Every heartbeat: liveness, peers, deadlines, a restarted connector. */
void sender_tick(struct sender *s, uint64_t now);
/*
 * Stopping (struct sender_stop). sender_stop_begin: the stop begins at `now` with a drain
 * window of drain_ns and `why` as the reason its failures carry (a second call does nothing).
 * sender_stop_step, on each turn of the loop: moves the stop on at `now` (the window's end, the
 * answers' end); true once the sender may exit: every request has had its completion and no
 * copy is in flight, or `end` has passed. sender_stop_due: when the next of those comes (the
 * loop sleeps no longer). sender_stop_report: the one line saying how it went.
 */
void sender_stop_begin(struct sender *s, uint64_t now, uint64_t drain_ns, const char *why);
bool sender_stop_step(struct sender *s, uint64_t now);
uint64_t sender_stop_due(const struct sender *s);
void sender_stop_report(struct sender *s, uint64_t now);
/* A withdrawal the stop made: its notice and its request's completion say why. The window's
 * sweep stamps withdraw_ns with window_end exactly (a deadline's withdrawal has its tick's
 * time). */
static inline bool sender_stop_withdrawn(const struct sender *s, const struct kvf_req_slot *r)
{
        return s->stop.at && r->withdraw_ns == s->stop.window_end;
}

/*
 * Work a slot still owes the rings, because a ring was full or the connector
 * restarted. Kept in this process only: a restarted sender recomputes it.
 */
#define SLOT_NEEDS_NOTICE 1u     /* LANDED/HANDED, finish notice not yet in the ring */
#define SLOT_NEEDS_COMPLETION 2u /* DECIDED, completion not yet in the ring */
#define SLOT_ABORT_NOTICE 4u     /* failed while moving: tell the peer (best effort) */
#define SLOT_NEEDS_OPEN 8u       /* network transfer: the open record is not in the ring */
#define SLOT_RESEND 16u          /* network transfer: hand everything sent so far again */
#define SLOT_NEEDS_ADVANCE 32u   /* a write batch did not fit, or a slice is left: advance again */
#define SLOT_NET_BLOCKED (SLOT_NEEDS_OPEN | SLOT_RESEND)

/* setup.c: a sender on an instance's segment (main.c, tests) */
struct sender_opts {
        uint64_t request_timeout_ns;
        bool notice_rings;       /* post ipc notices into the decode segment's notice slots */
        unsigned attach_wait_ms; /* wait this long for the segment to be ready */
};
/* Attach (writable), map the own cache, make the in-process tables. 0, or < 0 with kvf_err
 * set (what was made is freed). */
int sender_open(struct sender *s, const char *instance, const struct sender_opts *o);
/* Claim the sender role (a predecessor's ring ends are repaired) and adopt the table. */
int sender_start(struct sender *s);
/* Stopping: end the role, wait (bounded) for copies in flight, then sender_free. */
void sender_close(struct sender *s);
/* Unmap, detach and free what this process holds, writing nothing into its own segment (the
 * notice slots it holds in peers' segments are given back). */
void sender_free(struct sender *s);

/* tasks.c: records in */
int sender_on_engine_record(void *ctx, uint16_t type, const uint8_t *p, uint32_t len, uint64_t pos);
int sender_on_connector_record(void *ctx, uint16_t type, const uint8_t *p, uint32_t len,
                               uint64_t pos);
/* Read the engine's records (tasks one at a time; false: nothing read) and the connector's. */
bool sender_read_engine(struct sender *s, uint64_t beat);
bool sender_read_connector(struct sender *s);

/* table.c */
int sender_table_init(struct sender *s);
void sender_table_free(struct sender *s);
uint32_t sender_map_find(const struct sender *s, const char *request_id);
void sender_map_insert(struct sender *s, uint32_t slot);
void sender_map_remove(struct sender *s, uint32_t slot);
uint32_t sender_slot_alloc(struct sender *s); /* UINT32_MAX if full */
void sender_arm(struct sender *s, uint32_t slot);
void sender_disarm(struct sender *s, uint32_t slot);
/*
 * Destination blocks booked by moving requests (accepted, not yet all landed or handed over,
 * not decided). sender_book_find:
 * true when one of dst[0..n) of `peer` is booked by a live request of another id than
 * `request_id` (its own id is the same request, never a double booking): *at is its index in
 * dst, *owner that request's slot. O(n). sender_book_add books the slot's destination blocks
 * (its kvf_req_slot and block arena say which): 0, or -ENOMEM (kvf_err set; nothing booked).
 * sender_book_remove lets them go; nothing for a slot that holds none.
 */
bool sender_book_find(const struct sender *s, const char *peer, const uint32_t *dst, uint32_t n,
                      const char *request_id, uint32_t *at, uint32_t *owner);
int sender_book_add(struct sender *s, uint32_t slot);
void sender_book_remove(struct sender *s, uint32_t slot);
static inline uint64_t sender_key(uint32_t slot, uint64_t incarnation)
{
        return ((uint64_t)slot << 40) | (incarnation & ((1ull << 40) - 1));
}

/* peers.c */
int sender_peer_get(struct sender *s, const char *name, uint32_t *idx, char *why, size_t whylen);
/* Peer i: 1 and its live engine session (0 none) while its segment is the one mapped,
 * 0 when the entry is not in use, -ENOENT when it went away or was replaced, -ESRCH when
 * none of its roles runs (killed whole, its segment left behind). */
int sender_peer_check(struct sender *s, uint32_t i, uint64_t *live);
void sender_peer_drop(struct sender *s, uint32_t i);
/*
 * An ipc task that names its peer FastDeploy's way (device_ids, or ip and
 * port of a connector of this host): find the instance and put its name in
 * t->peer. 0 (t->peer is an instance name), -ENOENT (none), -EINVAL (several);
 * `why` says it in words.
 */
int sender_peer_resolve(struct sender *s, struct kvf_record *t, char *why, size_t whylen);
void sender_peers_close(struct sender *s);

/* outbox.c: records out */
/* Encode into the scratch buffer: 0, -ENOMEM (try again), or < 0 for a record that cannot be. */
int sender_encode(struct sender *s, const struct kvf_record *r, size_t *len);
/* Encode and write to ring sender->connector: 0, -EAGAIN (full), -ENOMEM, or a permanent error
 * (-EMSGSIZE: never fits; an encoding error), kvf_err set. */
int sender_post(struct sender *s, const struct kvf_record *r);
/* A failed post's rc: true = back-pressure (full ring, no memory: try again later); false = the
 * record can never be posted (kvf_err says why). */
static inline bool sender_post_again(int rc)
{
        return rc == -EAGAIN || rc == -ENOMEM;
}
enum sender_notice {
        SENDER_NOTICE_FINISH,   /* every byte is written: the peer publishes the arrival */
        SENDER_NOTICE_ABORT,    /* failed while moving: the peer frees its blocks (best effort) */
        SENDER_NOTICE_WITHDRAW, /* LANDED/HANDED past its deadline: the peer says what it did */
};
/* 0: posted to our connector; 1: committed to the peer's notice ring (ipc, --notice-rings);
 * < 0 as sender_post. */
int sender_post_notice(struct sender *s, uint32_t slot, enum sender_notice kind);
/*
 * A same-host request's last copies (`bytes` of them) are starting, or are out and the engine
 * makes them: its finish notice goes into the peer's notice ring as they land. The decode
 * connector, woken now if it sleeps, polls for it until then (kvf_doorbell_expect): its
 * wake-up from a futex comes tens of microseconds after the ring (55 µs p50 on a 2-vCPU VM; on
 * the H200's host the notice → arrival stage was 50 to 84 µs at p50), so it happens while the
 * copies run instead of after them. The window: SENDER_NOTICE_EXPECT_NS plus the bytes at SENDER_NOTICE_EXPECT_BPNS bytes
 * per ns (slower than any copy here, so rather too long), at most
 * KVF_DOORBELL_EXPECT_MAX_NS; one deadline per doorbell covers every request expected, so it is
 * only extended, and left to run out rather than withdrawn as a notice is posted (withdrawn, it
 * left the next notices of a step to a sleeping connector).
 */
#define SENDER_NOTICE_EXPECT_NS 100000ull
#define SENDER_NOTICE_EXPECT_BPNS 4ull
/*
 * Earlier still: when the engine's layers come at most SENDER_EARLY_PREWAKE_GAP_NS apart
 * (layer_gap_ns) and a request is one layer from its end, the wake-up is started then, with
 * `lead_ns` (the gap) added to the window: a connector's wake-up can take longer than the
 * last layer's copies (the H200's host: 35 to 45 µs of the tail were still the connector's
 * with the wake-up started at the last layer). Slower engines are left to the wake-up at the
 * last layer: the window would pass the 1 ms a connector ever polls.
 * Either only with CPUs to spare (prewake: at least 4, and 2 per rank): on 2 vCPUs the
 * connector's polling took the CPU the sender and the engine needed (200 µs layers: p50 0.64x
 * with both wake-ups, but p99 1.4 to 10.6x; with the last layer's alone p99 2.7 to 7.8x).
 */
#define SENDER_EARLY_PREWAKE_GAP_NS 500000ull
/*
 * A slower engine (layers more than SENDER_EARLY_PREWAKE_GAP_NS apart): the wake-up is started
 * SENDER_PREWAKE_LEAD_NS before the last layer can come (the last layer-done seen + the pace's
 * shortest gap), with the pace's spread (longest gap - shortest) and the lead as its window, when
 * that spread is at most SENDER_EARLY_PREWAKE_GAP_NS; the sender fires it from its loop
 * (sender_prewake_fire). Up to SENDER_PREWAKE_MAX requests of a step (more: the first ones; one
 * doorbell per peer serves them all).
 */
#define SENDER_PREWAKE_LEAD_NS 100000ull
/* --layer-wait auto: a spin seat held this long with no request waiting for layers goes back
 * to the host's other senders (main.c seat_tick). */
#define SENDER_SEAT_IDLE_NS 2000000000ull
/* ... and a sender without one, whose requests wait for layers, tries for one this often. */
#define SENDER_SEAT_RETRY_NS 10000000ull
void sender_expect_notice(struct sender *s, uint32_t slot, uint64_t lead_ns, uint64_t bytes);
/* A slower engine's request one layer from its end: its prewake at `due` (progress.c). */
void sender_prewake_later(struct sender *s, uint32_t slot, uint64_t due, uint64_t lead_ns, uint64_t bytes);
/* The prewakes due by `now`, started (main.c's loop). */
void sender_prewake_fire(struct sender *s, uint64_t now);
/* Answers in the notice slots' reply rings (peers.c): true if any was read. */
bool sender_read_replies(struct sender *s);
/* Whether some reply ring has an answer to read (the loop's wait). */
bool sender_replies_readable(struct sender *s);
/* The completion of a DECIDED slot: 0 (committed; completion_pos stored before the commit) or
 * -EAGAIN (the ring is full, or no memory). */
int sender_post_completion(struct sender *s, uint32_t slot);
void sender_count_status(struct sender *s, int status);

/* The request's front chunk mark if it is its last one and covers every block (its layers
 * then finish the request), else NULL. */
static inline const struct kvf_chunk_mark *sender_last_mark(const struct kvf_req_slot *r)
{
        if (!r->last_chunk_seen || r->chunk_tail - r->chunk_head != 1)
                return NULL;
        const struct kvf_chunk_mark *m = &r->chunks[r->chunk_head % KVF_CHUNKS_MAX];
        return m->block_end >= r->n_send ? m : NULL;
}

/* Every byte a request moves: its send-blocks in every layer and tensor (to a peer of another
 * tensor-parallel split, only the head slices this rank sends it). */
static inline uint64_t sender_request_bytes(const struct sender *s, const struct kvf_req_slot *r)
{
        if (r->transport == KVF_TRANSPORT_IPC && r->peer_idx < SENDER_MAX_PEERS &&
            s->peers[r->peer_idx].plan.npieces) {
                const struct kvf_tp_plan *pl = &s->peers[r->peer_idx].plan;
                if (r->n_dst) {
                        /* Regrouped: each source block's pieces, less those past the last
                         * destination block (tokens beyond the request's). */
                        uint64_t sum = 0;
                        for (uint32_t b = 0; b < r->n_send; b++)
                                for (uint32_t i = 0; i < pl->npieces; i++)
                                        if (pl->pieces[i].sblk == b % pl->src_per_group &&
                                            (b / pl->src_per_group) * pl->dst_per_group +
                                                    pl->pieces[i].dblk < r->n_dst)
                                                sum += pl->pieces[i].bytes;
                        return sum * s->layers * s->tensors;
                }
                uint64_t per_block = 0;
                for (uint32_t i = 0; i < pl->npieces; i++)
                        per_block += pl->pieces[i].bytes;
                return (uint64_t)r->n_send * s->layers * s->tensors * per_block;
        }
        return (uint64_t)r->n_send * s->layers * kvf_layout_layer_block_bytes(s->layout);
}

/* sessions.c */
/* tcp peers: note the decode engine session a peer's connector told of; look it up (0 unknown). */
void sender_net_peer_note(struct sender *s, const char *peer, bool up, uint64_t session, uint32_t block_size);
uint64_t sender_net_peer_session(struct sender *s, const char *peer);
/* A tcp peer's tokens per block: on this host (named by instance) from its segment, else as
 * the connector told when the peer's control connection came up; 0 when not known. */
uint32_t sender_net_peer_block_size(struct sender *s, const char *peer);
void sender_net_peers_close(struct sender *s);
/* The engine session of the engine->sender record at `pos` (inside a ring handler). */
uint64_t sender_record_session(struct sender *s, uint64_t pos);
/* The engine session live now (0 none); check_process reads /proc and remembers a dead one. */
uint64_t sender_session_live(struct sender *s, bool check_process);
/* The progress word when engine session `session` began (steps up to its step are earlier
 * sessions'), while that session is the live one; 0 otherwise or when none came before. */
uint64_t sender_session_base(struct sender *s, uint64_t session);
/* How session `old` ended, in words, for the reason of its requests. */
void sender_session_why_ended(struct sender *s, uint64_t old, uint64_t live, char *buf, size_t len);

/* copies.c: same-host copy batches; results go to request.c as news, never up by a call */
#define COPY_IN_BATCH 1u /* has runs in the batch being gathered */
#define COPY_NEWS 8u     /* in cp.news: request.c has not yet heard of its batches */
#define COPY_FAILED 16u  /* a batch of it failed (cp.why says how) */
int sender_copies_init(struct sender *s);
void sender_copies_free(struct sender *s);
/* Gather layers [l0, l1) of runs (src, dst index, count triples, nwords of them) of an ipc slot. */
int sender_copies_add(struct sender *s, uint32_t slot, uint32_t l0, uint32_t l1, const uint32_t *runs,
                      uint32_t nwords);
/* Submit what was gathered (one batch), then poll. */
void sender_copies_flush(struct sender *s);
/* The gathered runs (cp.runs, cp.nruns of them) in source-offset order, stable (a host batch
 * into several peers is copied so); 0, or -ENOMEM with the runs as they were. */
int sender_copies_sort(struct sender *s);
/*
 * The engine's caches: map the registration that is there now, ours (own) and the peer's
 * (peer_idx, or UINT32_MAX for none), when the mapping is behind it. 0, or -errno with why:
 * a cache that waits for its engine's registration, token orders that differ, a head split of
 * token-major blocks. With slot != UINT32_MAX, also that the registrations are the ones the
 * request's first copy used (a new one holds other blocks).
 */
int sender_caches_check(struct sender *s, uint32_t peer_idx, uint32_t slot, char *why, size_t whylen);
/* Every heartbeat: remap the engine's caches (ours, our peers') whose registration moved on, so
 * that a dropped one's memory is let go within a heartbeat, not at the next task. */
void sender_caches_tick(struct sender *s);
/* Batches (and the engine's owes) that completed: news for their slots. */
void sender_copies_poll(struct sender *s);
/*
 * The next slot with news, oldest first: true, and *failed when a batch of it failed (`why`
 * says how); sender_copies_busy() then says whether copies of it are still out. false when
 * there is none.
 */
bool sender_copies_news(struct sender *s, uint32_t *slot, bool *failed, char *why, size_t whylen);
/* The slot has copies gathered or in flight: nothing may be said about it yet. */
bool sender_copies_busy(const struct sender *s, uint32_t slot);
/*
 * The next slice of the slot's backlog may be gathered while its copies are out: none gathered
 * now, none failed, fewer than SENDER_COPY_DEPTH of its batches in flight. Copies of one cache
 * land in order; two slices queued keep the GPU copying while the sender plans the next,
 * and a new layer of another request waits behind at most two slices of a backlog.
 */
#define SENDER_COPY_DEPTH 2u
/* A step's last layer: at most this many requests a progress word copies in batches of their own
 * (progress.c copy_ipc); the rest share one, so a step of many small requests is not a kernel
 * launch each. */
#define SENDER_OWN_BATCHES 8u
bool sender_copies_room(const struct sender *s, uint32_t slot);
/* Flush, then wait up to timeout_ns for every batch in flight (a peer going, the sender stopping). */
void sender_copies_drain(struct sender *s, uint64_t timeout_ns);
/* The engine's context owes the slot copies that have landed once exec.landed >= word.
 * 0, or -ENOMEM (kvf_err set): they cannot be waited for. */
int sender_copies_owe(struct sender *s, uint32_t slot, uint64_t word, uint32_t gen);
bool sender_copies_owing(const struct sender *s, uint32_t slot);

/* plan.c: the engine executor (KVF_EXEC_ENGINE). Failures are returned (< 0, kvf_err the
 * reason; the request fails with "write error"). */
int sender_plan_init(struct sender *s);
/* Publish the slot's entry for its front mark's step, if that step is still to come. */
int sender_plan_offer(struct sender *s, uint32_t slot);
/* Layers [l0, l1) of send-blocks [b0, b1) of the slot's `step` are ready: *from is the first
 * layer the sender copies itself (the engine has the ones below). */
int sender_plan_take(struct sender *s, uint32_t slot, uint64_t step, uint32_t b0, uint32_t b1, uint32_t l0,
                     uint32_t l1, uint32_t *from);
/* The request is decided: no more claims; what the engine claimed is waited for. */
int sender_plan_close(struct sender *s, uint32_t slot);
/* At start: close every entry; the engine's claims of adopted requests are waited for again.
 * Slots whose owe could not be kept get their bit in `failed` (one byte per slot). */
void sender_plan_adopt_all(struct sender *s, uint8_t *failed);

/* progress.c: what the progress word makes ready for one request, handed over */
enum sender_adv {
        SENDER_ADV_WAIT,     /* waits for layers (armed at its front mark's step) */
        SENDER_ADV_AGAIN,    /* a slice is left: the loop's next turn, at once */
        SENDER_ADV_BLOCKED,  /* a ring is full: again when it has room */
        SENDER_ADV_ALL_SENT, /* every byte is handed over */
        SENDER_ADV_FAILED,   /* it cannot go on: *status, kvf_err the reason */
};
/* Move what the current progress word allows for a MOVING request; net_blocked: its open
 * record (or a resend) is still owed, so no write batch may go before it. */
enum sender_adv sender_advance(struct sender *s, uint32_t slot, bool net_blocked, int *status);
/* Network transfers: the open record, and handing everything sent so far again. 0, or a failed
 * post's rc (sender_post_again says which). */
int sender_post_open(struct sender *s, uint32_t slot);
int sender_resend(struct sender *s, uint32_t slot);

#endif
