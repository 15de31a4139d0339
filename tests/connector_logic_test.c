/*
 * The decode connector's event handling, driven in-process: no kvf-connector, no
 * sender, no supervisor. The test makes real control segments in /dev/shm (a
 * decode instance and a same-host prefill instance, host caches), claims a notice
 * slot of the decode segment as the prefill sender would, writes notices into its
 * ring, runs the connector's reading of the slots (conn_notices_read) itself, and
 * checks what comes out: arrivals in the connector->engine ring (status, blocks,
 * session), answers in the slot's reply ring (key, status, reason), the journal
 * (a repeat or a withdrawal is answered without a second arrival), and what waits
 * when a ring is full. A "restart" is a second struct connector over the same
 * segment after the first was dropped without a word, as a crash would leave it.
 *
 * Socket notices: sessions without threads of their own over socketpairs
 * (conn_session_open), notices posted to the event queue as session threads
 * post them (conn_post_wait, from several threads at once), the test playing
 * the control thread (conn_events_run), and the answers read at the other end
 * of each socketpair after the session's outbox is written (conn_session_flush).
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "cache.h"
#include "cache_host_alloc.h"
#include "check.h"
#include "clock.h"
#include "connector.h"
#include "ctl.h"
#include "doorbell.h"
#include "layout.h"
#include "net.h"
#include "notice.h"
#include "records.h"

#define LAYERS 4u
#define BLOCKS 32u
#define EVQ_LIMIT 64u /* the event queue's bound here: small, so that a test fills it */

struct inst {
        char name[KVF_INSTANCE_MAX];
        struct kvf_ctl ctl; /* the test's view: engine, allocator */
        uint64_t engine;    /* the engine session the test plays */
        bool made;
};

static struct inst P, D;

static void cleanup(void)
{
        if (P.made)
                kvf_ctl_unlink(P.name);
        if (D.made)
                kvf_ctl_unlink(D.name);
}

static void on_fatal(int sig)
{
        cleanup();
        signal(sig, SIG_DFL);
        raise(sig);
}

static void inst_make(struct inst *in, const char *tag, uint32_t irole)
{
        struct kvf_ctl_params p = {.instance_role = irole,
                                   .backend = KVF_BACKEND_HOST,
                                   .reqtab_slots = 8,
                                   .max_blocks = 16};
        snprintf(in->name, sizeof(in->name), "clt-%s%d", tag, (int)getpid());
        p.instance = in->name;
        for (int i = 0; i < KVF_RING_COUNT; i++)
                p.ring_capacity[i] = KVF_RING_MIN_CAPACITY;
        CHECK(kvf_layout_make(&p.layout, LAYERS, 0, BLOCKS, 1, 4, 16, KVF_DTYPE_FP16, 0) == 0);
        kvf_ctl_unlink(in->name);
        CHECK(kvf_ctl_create(&p, &in->ctl) == 0);
        in->made = true;
        CHECK(kvf_cache_create(in->ctl.hdr, &(struct kvf_cache_opts){.huge_pages = KVF_HUGE_OFF}) ==
              0);
        kvf_role_begin(&in->ctl, KVF_ROLE_ALLOCATOR);
        kvf_ctl_publish(&in->ctl);
}

static void engine_attach(struct inst *in)
{
        in->engine = kvf_role_begin(&in->ctl, KVF_ROLE_ENGINE);
}

/* The decode connector starts over D's segment, as main.c's start does (no sockets). */
static void connector_up(struct connector *cn)
{
        memset(cn, 0, sizeof(*cn));
        CHECK(kvf_ctl_attach(D.name, true, &cn->ctl) == 0);
        CHECK(conn_evq_init(cn, EVQ_LIMIT) == 0);
        pthread_mutex_init(&cn->smu, NULL);
        pthread_mutex_init(&cn->rxmu, NULL);
        cn->listen_fd = cn->unix_fd = -1;
        cn->gen = kvf_role_begin(&cn->ctl, KVF_ROLE_CONNECTOR);
        conn_journal_init(cn);
        CHECK(conn_notices_init(cn) == 0);
}

/* Dropped without a word (a crash): nothing of it is undone in the segment. */
static void connector_drop(struct connector *cn)
{
        conn_notices_close(cn);
        free(cn->jidx);
        kvf_ctl_detach(&cn->ctl);
}

/* ------------------------------------------------------------------ what comes out */

struct rec {
        uint16_t type;
        char id[KVF_REQ_ID_MAX];
        char reason[KVF_REASON_MAX];
        int status;
        uint64_t key, session, bytes;
        uint32_t n_dst, dst0;
};

struct outs {
        unsigned n;
        struct rec r[4096];
};

static int grab(void *ctx, uint16_t type, const uint8_t *p, uint32_t len, uint64_t pos)
{
        struct outs *o = ctx;
        struct kvf_record k;
        (void)pos;
        CHECK(kvf_record_decode(type, p, len, 0, &k) == 0);
        CHECK(o->n < sizeof(o->r) / sizeof(o->r[0]));
        struct rec *r = &o->r[o->n++];
        r->type = type;
        snprintf(r->id, sizeof(r->id), "%s", k.request_id);
        snprintf(r->reason, sizeof(r->reason), "%s", k.reason);
        r->status = k.status;
        r->key = k.key;
        r->session = k.session;
        r->bytes = k.bytes;
        r->n_dst = k.n_dst;
        r->dst0 = k.n_dst ? k.dst[0] : 0;
        kvf_record_free(&k);
        return 0;
}

static struct outs *drain(struct kvf_ring *ring)
{
        static struct outs o;
        o.n = 0;
        while (kvf_ring_read(ring, grab, &o, 64) > 0) {
        }
        return &o;
}

/* The arrivals the decode engine gets. */
static struct outs *arrivals(void)
{
        return drain(&D.ctl.rings[KVF_RING_CONNECTOR_TO_ENGINE]);
}

static const struct rec *find(const struct outs *o, const char *id)
{
        for (unsigned i = 0; i < o->n; i++)
                if (!strcmp(o->r[i].id, id))
                        return &o->r[i];
        return NULL;
}

static uint64_t counter(enum kvf_counter_id id)
{
        return kvf_load_relaxed(&D.ctl.counters[id].value);
}

/* ------------------------------------------------------------------ the prefill sender's side */

static struct kvf_notice_end slot; /* P's sender's claim of a slot of D */
static struct kvf_ctl dview;       /* P's sender's mapping of D */

static void notice(const char *id, uint64_t key, int status, bool withdraw, uint64_t session,
                   uint64_t generation, uint32_t dst0)
{
        uint32_t dst[2] = {dst0, dst0 + 1};
        struct kvf_record n = {.type = KVF_RT_NOTICE,
                               .key = key,
                               .transport = KVF_TRANSPORT_IPC,
                               .status = status,
                               .bytes = 1,
                               .blocks = 2,
                               .dst = dst,
                               .n_dst = 2,
                               .session = session,
                               .withdraw = withdraw,
                               .generation = generation};
        snprintf(n.request_id, sizeof(n.request_id), "%s", id);
        snprintf(n.peer, sizeof(n.peer), "%s", P.name);
        if (status != KVF_STATUS_FINISHED)
                snprintf(n.reason, sizeof(n.reason), "%s",
                         withdraw ? "the sender timed out" : "it failed");
        static uint8_t buf[4096];
        int len = kvf_record_encode(&n, buf, sizeof(buf));
        CHECK(len > 0);
        CHECK_EQ(kvf_ring_write(&slot.notice, KVF_RT_NOTICE, buf, (uint32_t)len, NULL), 0);
}

static void finish(const char *id, uint64_t key, uint32_t dst0)
{
        notice(id, key, KVF_STATUS_FINISHED, false, D.engine, D.ctl.hdr->created_ns, dst0);
}

static struct outs *replies(void)
{
        return drain(&slot.reply);
}

static uint64_t notices_left(void)
{
        return kvf_load_acquire(&slot.notice.hdr->tail) - kvf_load_acquire(&slot.notice.hdr->head);
}

/* Fill a ring (through its producer's view) with dummy records until it is full; returns how many.
 */
static unsigned fill(struct kvf_ring *ring, uint16_t type)
{
        struct kvf_record a = {.type = type, .status = KVF_STATUS_FINISHED};
        snprintf(a.request_id, sizeof(a.request_id), "filler");
        snprintf(a.peer, sizeof(a.peer), "%s", P.name);
        uint8_t buf[512];
        int len = kvf_record_encode(&a, buf, sizeof(buf));
        CHECK(len > 0);
        unsigned n = 0;
        while (kvf_ring_write(ring, type, buf, (uint32_t)len, NULL) == 0)
                n++;
        return n;
}

/* ------------------------------------------------------------------ cases */

static struct connector C1, C2;

/* A finish notice: one arrival, finished, for the session it was bound to; one ack. */
static void case_publish(void)
{
        uint64_t a0 = counter(KVF_CTR_ARRIVALS);
        finish("pub-1", 101, 4);
        CHECK(conn_notices_readable(&C1));
        CHECK(conn_notices_read(&C1));
        CHECK(!conn_notices_readable(&C1));
        struct outs *o = arrivals();
        CHECK_EQ(o->n, 1);
        CHECK_EQ(o->r[0].type, KVF_RT_ARRIVAL);
        CHECK(!strcmp(o->r[0].id, "pub-1"));
        CHECK_EQ(o->r[0].status, KVF_STATUS_FINISHED);
        CHECK_EQ(o->r[0].session, D.engine);
        CHECK_EQ(o->r[0].n_dst, 2);
        CHECK_EQ(o->r[0].dst0, 4);
        /* every byte of both blocks in every layer and tensor, whatever the notice said */
        CHECK_EQ(o->r[0].bytes, 2ull * LAYERS * kvf_layout_tensors(&D.ctl.hdr->layout) *
                                    D.ctl.hdr->layout.block_bytes);
        CHECK_EQ(counter(KVF_CTR_ARRIVALS), a0 + 1);
        o = replies();
        CHECK_EQ(o->n, 1);
        CHECK_EQ(o->r[0].type, KVF_RT_ACK);
        CHECK_EQ(o->r[0].key, 101);
        CHECK_EQ(o->r[0].status, KVF_STATUS_FINISHED);
        CHECK_EQ(o->r[0].session, D.engine);
        CHECK_EQ(notices_left(), 0);
        printf("ok: a slot's finish notice: one arrival (finished, its blocks, every byte), one "
               "ack\n");
}

/* The same notice again (a restarted sender re-posts), and a withdrawal of it: answered from
 * the journal, no second arrival. */
static void case_duplicates(void)
{
        uint64_t d0 = counter(KVF_CTR_ARRIVALS_DEDUPED);
        finish("pub-1", 101, 4);
        notice("pub-1", 101, KVF_STATUS_TIMEOUT, true, D.engine, D.ctl.hdr->created_ns, 4);
        CHECK(conn_notices_read(&C1));
        CHECK_EQ(arrivals()->n, 0);
        struct outs *o = replies();
        CHECK_EQ(o->n, 2);
        CHECK(o->r[0].key == 101 && o->r[0].status == KVF_STATUS_FINISHED);
        CHECK(o->r[1].key == 101 && o->r[1].status == KVF_STATUS_FINISHED);
        CHECK_EQ(counter(KVF_CTR_ARRIVALS_DEDUPED), d0 + 2);
        /* a withdrawal of a notice never published: the timeout is published, and said */
        notice("wd-1", 102, KVF_STATUS_TIMEOUT, true, D.engine, D.ctl.hdr->created_ns, 6);
        CHECK(conn_notices_read(&C1));
        o = arrivals();
        CHECK(o->n == 1 && !strcmp(o->r[0].id, "wd-1") && o->r[0].status == KVF_STATUS_TIMEOUT);
        o = replies();
        CHECK(o->n == 1 && o->r[0].key == 102 && o->r[0].status == KVF_STATUS_TIMEOUT);
        /* an abort: its error arrival, acknowledged with the same status */
        notice("ab-1", 103, KVF_STATUS_WRITE, false, D.engine, D.ctl.hdr->created_ns, 8);
        CHECK(conn_notices_read(&C1));
        o = arrivals();
        CHECK(o->n == 1 && o->r[0].status == KVF_STATUS_WRITE &&
              strstr(o->r[0].reason, "it failed"));
        o = replies();
        CHECK(o->n == 1 && o->r[0].key == 103 && o->r[0].status == KVF_STATUS_WRITE);
        printf("ok: a repeated notice and a withdrawal answered from the journal without a second "
               "arrival; an unpublished withdrawal and an abort published with their status\n");
}

/* The rehearsal (notices.c): while a notice is expected, the last finished one read is handled
 * again without its effects, at most every CONN_REHEARSE_NS: no arrival, no answer, the journal
 * as it was; nothing without an expectation, nothing when switched off; the next notice as ever. */
static void case_rehearsal(void)
{
        static struct kvf_journal_entry before[KVF_JOURNAL_ENTRIES];
        struct kvf_doorbell *bell = &C1.ctl.bells[KVF_BELL_CONNECTOR];
        memcpy(before, C1.ctl.journal, sizeof(before));
        uint32_t jnext = C1.jnext;
        uint64_t r0 = counter(KVF_CTR_NOTICE_REHEARSALS), a0 = counter(KVF_CTR_ARRIVALS);
        uint64_t d0 = counter(KVF_CTR_ARRIVALS_DEDUPED);
        CHECK(C1.rehearsal.len > 0); /* (pub-1, the last finished notice read) */
        kvf_doorbell_expect(bell, 0);
        for (int i = 0; i < 1000; i++)
                conn_notices_rehearse(&C1);
        CHECK_EQ(counter(KVF_CTR_NOTICE_REHEARSALS), r0); /* no expectation: nothing */
        kvf_doorbell_expect(bell, kvf_now_ns() + 1000000000ull);
        uint64_t t0 = kvf_now_ns();
        while (counter(KVF_CTR_NOTICE_REHEARSALS) < r0 + 5 && kvf_now_ns() - t0 < 2000000000ull)
                conn_notices_rehearse(&C1);
        uint64_t n = counter(KVF_CTR_NOTICE_REHEARSALS) - r0;
        uint64_t took = kvf_now_ns() - t0;
        CHECK(n >= 5);
        CHECK(took >= (n - 1) * CONN_REHEARSE_NS); /* at most one per CONN_REHEARSE_NS */
        CHECK_EQ(arrivals()->n, 0);
        CHECK_EQ(replies()->n, 0);
        CHECK_EQ(counter(KVF_CTR_ARRIVALS), a0);
        CHECK_EQ(counter(KVF_CTR_ARRIVALS_DEDUPED), d0);
        CHECK(!memcmp(before, C1.ctl.journal, sizeof(before)));
        CHECK_EQ(C1.jnext, jnext);
        CHECK(!conn_notices_readable(&C1));
        /* switched off (KVF_AB_NO_REHEARSAL=1): nothing, the expectation or not */
        C1.rehearsal.off = true;
        uint64_t r1 = counter(KVF_CTR_NOTICE_REHEARSALS);
        t0 = kvf_now_ns();
        while (kvf_now_ns() - t0 < 5 * CONN_REHEARSE_NS)
                conn_notices_rehearse(&C1);
        CHECK_EQ(counter(KVF_CTR_NOTICE_REHEARSALS), r1);
        C1.rehearsal.off = false;
        /* the next notice, read while still expected: published and answered once */
        finish("reh-1", 104, 10);
        conn_notices_rehearse(&C1);
        CHECK(conn_notices_read(&C1));
        struct outs *o = arrivals();
        CHECK(o->n == 1 && !strcmp(o->r[0].id, "reh-1") && o->r[0].status == KVF_STATUS_FINISHED);
        o = replies();
        CHECK(o->n == 1 && o->r[0].key == 104 && o->r[0].status == KVF_STATUS_FINISHED);
        kvf_doorbell_expect(bell, 0);
        printf("ok: a notice rehearsed %llu times while expected (at most one per %llu us): no "
               "arrival, no answer, the journal untouched; none without an expectation or switched "
               "off; the next notice published and answered once\n",
               (unsigned long long)n, CONN_REHEARSE_NS / 1000);
}

/* Notices the decode side must refuse: each an error arrival (or none) and an ack that says why. */
static void case_failures(void)
{
        /* blocks of the previous incarnation of D's cache */
        notice("old-gen", 201, KVF_STATUS_FINISHED, false, D.engine, D.ctl.hdr->created_ns - 1, 4);
        CHECK(conn_notices_read(&C1));
        CHECK_EQ(arrivals()->n, 0);
        struct outs *o = replies();
        CHECK(o->n == 1 && o->r[0].key == 201 && o->r[0].status == KVF_STATUS_CONNECTION);
        CHECK(strstr(o->r[0].reason, "was restarted during the transfer"));
        /* blocks out of range */
        finish("range", 202, BLOCKS - 1);
        CHECK(conn_notices_read(&C1));
        CHECK_EQ(arrivals()->n, 0);
        o = replies();
        CHECK(o->n == 1 && o->r[0].status == KVF_STATUS_BLOCK_RANGE &&
              strstr(o->r[0].reason, "out of range"));
        /* bound to an engine session that has ended: "engine gone", for that session */
        uint64_t old = D.engine;
        kvf_role_end(&D.ctl, KVF_ROLE_ENGINE);
        engine_attach(&D);
        CHECK(D.engine != old);
        notice("gone", 203, KVF_STATUS_FINISHED, false, old, D.ctl.hdr->created_ns, 10);
        CHECK(conn_notices_read(&C1));
        o = arrivals();
        CHECK(o->n == 1 && o->r[0].status == KVF_STATUS_ENGINE_GONE && o->r[0].session == old);
        o = replies();
        CHECK(o->n == 1 && o->r[0].key == 203 && o->r[0].status == KVF_STATUS_ENGINE_GONE);
        CHECK_EQ(o->r[0].session, D.engine); /* the ack says which session is live now */
        /* a record that is not a notice: counted, skipped; the next notice still goes */
        uint64_t b0 = counter(KVF_CTR_BAD_RECORDS);
        uint8_t junk[16] = {0xc1, 0xc1, 0xc1};
        CHECK_EQ(kvf_ring_write(&slot.notice, KVF_RT_NOTICE, junk, sizeof(junk), NULL), 0);
        CHECK_EQ(kvf_ring_write(&slot.notice, KVF_RT_ACK, junk, sizeof(junk), NULL), 0);
        finish("after-junk", 204, 12);
        CHECK(conn_notices_read(&C1));
        CHECK_EQ(counter(KVF_CTR_BAD_RECORDS), b0 + 2);
        o = arrivals();
        CHECK(o->n == 1 && !strcmp(o->r[0].id, "after-junk") &&
              o->r[0].status == KVF_STATUS_FINISHED);
        CHECK_EQ(replies()->n, 1);
        CHECK_EQ(notices_left(), 0);
        printf(
            "ok: refused notices (a previous cache, blocks out of range, an ended engine session) "
            "answered with their status and reason; bad records skipped and counted\n");
}

/* A full reply ring: the notice is published once and stays in its ring until the answer fits. */
static void case_full_reply(void)
{
        unsigned n = fill(&C1.nslots[slot.idx].reply, KVF_RT_ACK);
        CHECK(n > 0);
        finish("full-reply", 301, 14);
        conn_notices_read(&C1);
        CHECK(C1.notices_blocked);
        struct outs *o = arrivals();
        CHECK(o->n == 1 && !strcmp(o->r[0].id, "full-reply"));
        CHECK_EQ(notices_left() > 0, 1);
        conn_notices_read(&C1); /* again: still no room, still no second arrival */
        CHECK(C1.notices_blocked);
        CHECK_EQ(arrivals()->n, 0);
        o = replies();
        CHECK_EQ(o->n, n); /* the sender reads its replies: room */
        CHECK(conn_notices_read(&C1));
        CHECK(!C1.notices_blocked);
        CHECK_EQ(arrivals()->n, 0);
        o = replies();
        CHECK(o->n == 1 && o->r[0].key == 301 && o->r[0].status == KVF_STATUS_FINISHED);
        CHECK_EQ(notices_left(), 0);
        printf(
            "ok: a notice whose reply ring was full (%u answers unread): published once, left in "
            "its ring, answered from the journal once there was room\n",
            n);
}

/* A full arrival ring: nothing published, nothing answered; the notice waits in its ring. */
static void case_full_arrivals(void)
{
        unsigned n = fill(&C1.ctl.rings[KVF_RING_CONNECTOR_TO_ENGINE], KVF_RT_ARRIVAL);
        CHECK(n > 0);
        finish("full-arr", 401, 16);
        conn_notices_read(&C1);
        CHECK(C1.notices_blocked);
        CHECK_EQ(replies()->n, 0);
        CHECK(notices_left() > 0);
        CHECK_EQ(arrivals()->n, n); /* the engine reads: room */
        CHECK(conn_notices_read(&C1));
        struct outs *o = arrivals();
        CHECK(o->n == 1 && !strcmp(o->r[0].id, "full-arr") &&
              o->r[0].status == KVF_STATUS_FINISHED);
        o = replies();
        CHECK(o->n == 1 && o->r[0].key == 401);
        printf(
            "ok: a notice whose arrival ring was full waited in its slot, then was published and "
            "answered once\n");
}

/* The connector dies after publishing, before answering (the reply ring was full); its successor
 * finds the notice still in the ring and answers it from the journal: no second arrival. */
static void case_restart(void)
{
        unsigned n = fill(&C1.nslots[slot.idx].reply, KVF_RT_ACK);
        finish("restart", 501, 18);
        finish("restart-2", 502, 20);
        conn_notices_read(&C1);
        struct outs *o = arrivals();
        CHECK(o->n == 1 && !strcmp(o->r[0].id, "restart"));
        CHECK(notices_left() > 0);
        connector_drop(&C1); /* dies */
        CHECK_EQ(replies()->n, n);
        connector_up(&C2);
        CHECK(conn_notices_readable(&C2));
        CHECK(conn_notices_read(&C2));
        o = arrivals();
        CHECK(o->n == 1 && !strcmp(o->r[0].id, "restart-2"));
        o = replies();
        CHECK_EQ(o->n, 2);
        CHECK(find(o, "restart") && find(o, "restart")->status == KVF_STATUS_FINISHED);
        CHECK(find(o, "restart-2") && find(o, "restart-2")->status == KVF_STATUS_FINISHED);
        CHECK_EQ(notices_left(), 0);
        printf(
            "ok: the connector died with a published notice unanswered: its successor answered it "
            "from the journal (no second arrival) and published the next\n");
}

/* ------------------------------------------------------------------ socket notices */

/* A prefill instance's control connection, as a session without a thread: the connector's
 * end is registered, the test reads the answers at the other end. */
struct sock {
        int fd[2];
        uint64_t id;
};

static void sock_open(struct connector *cn, struct sock *k)
{
        CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, k->fd) == 0);
        CHECK(conn_session_open(cn, k->fd[0], P.name, P.ctl.hdr->created_ns, &k->id) == 0);
}

/* The session ends (its thread would): what its outbox holds is dropped. */
static void sock_close(struct connector *cn, struct sock *k)
{
        conn_session_close(cn, k->id);
        close(k->fd[0]);
        close(k->fd[1]);
}

/* A notice as a session thread hands it over (session.c). */
static struct event *sock_notice(const struct sock *k, const char *id, uint64_t key, uint32_t dst0)
{
        struct event *ev = calloc(1, sizeof(*ev));
        CHECK(ev != NULL);
        ev->kind = EV_NOTICE;
        ev->session = k->id;
        ev->src_gen = P.ctl.hdr->created_ns;
        struct kvf_record *n = &ev->rec;
        n->type = KVF_RT_NOTICE;
        n->key = key;
        n->transport = KVF_TRANSPORT_IPC;
        n->status = KVF_STATUS_FINISHED;
        n->session = D.engine;
        n->generation = D.ctl.hdr->created_ns;
        n->bytes = 1;
        n->blocks = 2;
        n->n_dst = 2;
        n->dst = malloc(2 * sizeof(uint32_t));
        CHECK(n->dst != NULL);
        n->dst[0] = dst0;
        n->dst[1] = dst0 + 1;
        snprintf(n->request_id, sizeof(n->request_id), "%s", id);
        snprintf(n->peer, sizeof(n->peer), "%s", P.name);
        return ev;
}

/* The session's thread writes its outbox; the test reads every answer that came. */
static struct outs *sock_acks(struct connector *cn, struct sock *k)
{
        static struct outs o;
        static uint8_t buf[8192];
        o.n = 0;
        CHECK_EQ(conn_session_flush(cn, k->id), 0);
        struct kvf_frame_hdr h;
        while (kvf_net_recv_frame(k->fd[1], &h, buf, sizeof(buf), 50) == 0)
                CHECK_EQ(grab(&o, h.type, buf, h.len, 0), 0);
        return &o;
}

/* The control thread until the queue is empty, the engine reading arrivals as they come (the
 * arrival ring holds fewer than a full queue). All arrivals read. */
static struct outs *run_all(struct connector *cn)
{
        static struct outs all;
        all.n = 0;
        uint64_t until = kvf_now_ns() + 10 * KVF_NS_PER_S;
        do {
                conn_events_run(cn);
                struct outs *o = arrivals();
                for (unsigned i = 0; i < o->n; i++)
                        all.r[all.n++] = o->r[i];
                CHECK(kvf_now_ns() < until);
        } while (conn_evq_held(cn) || cn->deferred);
        return &all;
}

/* Wait (bounded) until the queue has `n` producers waiting for room. */
static void wait_waiting(struct connector *cn, uint32_t n)
{
        uint64_t until = kvf_now_ns() + 5 * KVF_NS_PER_S;
        while (kvf_load_acquire(&cn->ev_waiting) != n) {
                CHECK(kvf_now_ns() < until);
                nanosleep(&(struct timespec){0, 100000}, NULL);
        }
}

#define PRODUCERS 4
#define PER_PRODUCER 40 /* 160 notices through a queue of 64: producers wait their turn */

struct producer {
        struct connector *cn;
        struct sock *k;
        int t;
        int waited; /* conn_post_wait said it waited at least once */
        int rc;
        int done; /* atomic */
};

static void *producer_main(void *arg)
{
        struct producer *pr = arg;
        for (int i = 0; i < PER_PRODUCER; i++) {
                char id[32];
                snprintf(id, sizeof(id), "mt-%d-%d", pr->t, i);
                int rc = conn_post_wait(pr->cn, sock_notice(pr->k, id, 1000u + (uint64_t)pr->t * 100 + (uint64_t)i,
                                                            (uint32_t)(i % 15) * 2));
                if (rc < 0) {
                        pr->rc = rc;
                        break;
                }
                pr->waited |= rc == 1;
        }
        kvf_store_release(&pr->done, 1);
        return NULL;
}

/* Notices from several session threads at once: the control thread alone publishes each once
 * and answers each on its own session, in the order each session sent them. */
static void case_threads(struct connector *cn)
{
        struct sock k[PRODUCERS];
        struct producer pr[PRODUCERS];
        pthread_t th[PRODUCERS];
        uint64_t a0 = counter(KVF_CTR_ARRIVALS);
        for (int t = 0; t < PRODUCERS; t++) {
                sock_open(cn, &k[t]);
                pr[t] = (struct producer){.cn = cn, .k = &k[t], .t = t};
                CHECK(pthread_create(&th[t], NULL, producer_main, &pr[t]) == 0);
        }
        /* The control thread's loop: run the events until every producer is done and the
         * queue is empty; the engine reads arrivals as they come. */
        static struct outs all;
        all.n = 0;
        uint64_t until = kvf_now_ns() + 20 * KVF_NS_PER_S;
        for (;;) {
                int done = 0;
                for (int t = 0; t < PRODUCERS; t++)
                        done += kvf_load_acquire(&pr[t].done);
                conn_events_run(cn);
                struct outs *o = arrivals();
                for (unsigned i = 0; i < o->n; i++)
                        all.r[all.n++] = o->r[i];
                if (done == PRODUCERS && conn_evq_held(cn) == 0 && !cn->deferred)
                        break;
                CHECK(kvf_now_ns() < until);
        }
        int waited = 0;
        for (int t = 0; t < PRODUCERS; t++) {
                pthread_join(th[t], NULL);
                CHECK_EQ(pr[t].rc, 0);
                waited += pr[t].waited;
        }
        CHECK_EQ(all.n, PRODUCERS * PER_PRODUCER);
        CHECK_EQ(counter(KVF_CTR_ARRIVALS), a0 + PRODUCERS * PER_PRODUCER);
        /* each producer's notices in its order, each once */
        int next[PRODUCERS] = {0};
        for (unsigned i = 0; i < all.n; i++) {
                int t, n;
                CHECK(sscanf(all.r[i].id, "mt-%d-%d", &t, &n) == 2 && t >= 0 && t < PRODUCERS);
                CHECK_EQ(n, next[t]);
                next[t]++;
                CHECK_EQ(all.r[i].status, KVF_STATUS_FINISHED);
        }
        for (int t = 0; t < PRODUCERS; t++) {
                /* The control thread wrote nothing to a socket: every answer waits in the
                 * session's outbox for the session's own thread. */
                char b;
                CHECK(recv(k[t].fd[1], &b, 1, MSG_DONTWAIT) < 0 && errno == EAGAIN);
                struct outs *o = sock_acks(cn, &k[t]);
                CHECK_EQ(o->n, PER_PRODUCER);
                for (unsigned i = 0; i < o->n; i++) {
                        CHECK_EQ(o->r[i].type, KVF_RT_ACK);
                        CHECK_EQ(o->r[i].key, 1000u + (uint64_t)t * 100 + i);
                        CHECK_EQ(o->r[i].status, KVF_STATUS_FINISHED);
                }
                sock_close(cn, &k[t]);
        }
        printf("ok: %d session threads, %d notices each through a queue of %u (%d waited for room): "
               "each published once by the control thread, answered on its own session in order\n",
               PRODUCERS, PER_PRODUCER, EVQ_LIMIT, waited);
}

static struct producer one;
static void *one_main(void *arg)
{
        struct sock *k = arg;
        one.rc = conn_post_wait(one.cn, sock_notice(k, "full-q-last", 2999, 30));
        kvf_store_release(&one.done, 1);
        return NULL;
}

/* A full queue: the session thread that brings one more notice waits (its peer's socket is not
 * read meanwhile) until the control thread makes room; the connector's own events still go in.
 * A connector that stops while it waits lets it go with -ESHUTDOWN (the notice is sent again to
 * the next connector, and the journal answers it). */
static void case_full_queue(struct connector *cn)
{
        struct sock k;
        sock_open(cn, &k);
        for (uint32_t i = 0; i < EVQ_LIMIT; i++) {
                char id[32];
                snprintf(id, sizeof(id), "full-q-%u", i);
                CHECK_EQ(conn_post_wait(cn, sock_notice(&k, id, 2000u + i, (i % 15) * 2)), 0);
        }
        CHECK_EQ(conn_evq_held(cn), EVQ_LIMIT);
        one = (struct producer){.cn = cn};
        pthread_t th;
        CHECK(pthread_create(&th, NULL, one_main, &k) == 0);
        wait_waiting(cn, 1);
        CHECK(!kvf_load_acquire(&one.done));
        CHECK_EQ(conn_evq_held(cn), EVQ_LIMIT);
        /* A landed transfer (a data thread's event) is admitted all the same. */
        conn_post_data_done(cn, P.name, P.ctl.hdr->created_ns, 77);
        CHECK_EQ(conn_evq_held(cn), EVQ_LIMIT + 1);
        struct outs *o = arrivals(); /* nothing published before the control thread runs */
        CHECK_EQ(o->n, 0);
        conn_events_run(cn); /* room */
        pthread_join(th, NULL);
        CHECK_EQ(one.rc, 1);
        uint32_t before = arrivals()->n;
        o = run_all(cn);
        CHECK_EQ(o->n + before, EVQ_LIMIT + 1);
        CHECK(!strcmp(o->r[o->n - 1].id, "full-q-last")); /* behind the queue it waited for */
        o = sock_acks(cn, &k);
        CHECK_EQ(o->n, EVQ_LIMIT + 1);
        CHECK_EQ(o->r[EVQ_LIMIT].key, 2999);

        /* Full again, and the connector stops while one waits. */
        for (uint32_t i = 0; i < EVQ_LIMIT; i++) {
                char id[32];
                snprintf(id, sizeof(id), "full-s-%u", i);
                CHECK_EQ(conn_post_wait(cn, sock_notice(&k, id, 3000u + i, (i % 15) * 2)), 0);
        }
        one = (struct producer){.cn = cn};
        CHECK(pthread_create(&th, NULL, one_main, &k) == 0);
        wait_waiting(cn, 1);
        kvf_store_release(&cn->stop, 1);
        pthread_join(th, NULL);
        CHECK_EQ(one.rc, -ESHUTDOWN);
        kvf_store_release(&cn->stop, 0);
        CHECK_EQ(run_all(cn)->n, EVQ_LIMIT);
        CHECK_EQ(sock_acks(cn, &k)->n, EVQ_LIMIT);
        sock_close(cn, &k);
        printf("ok: a full queue (%u): the next notice's session waited until the control thread "
               "made room, a data thread's event went in meanwhile; a stop released a waiting "
               "session with -ESHUTDOWN\n", EVQ_LIMIT);
}

/* Answers for a session that closed are dropped, queued or not; the prefill side's repeat on
 * its next connection is answered from the journal without a second arrival. */
static void case_closed_session(struct connector *cn)
{
        uint64_t d0 = counter(KVF_CTR_ARRIVALS_DEDUPED);
        uint64_t x0 = kvf_load_relaxed(&cn->acks_dropped);
        struct sock a, b, c;
        sock_open(cn, &a);
        sock_open(cn, &b);
        /* closed before the control thread answered */
        CHECK_EQ(conn_post_wait(cn, sock_notice(&a, "gone-1", 4001, 2)), 0);
        /* closed with its answer in the outbox */
        CHECK_EQ(conn_post_wait(cn, sock_notice(&b, "gone-2", 4002, 4)), 0);
        sock_close(cn, &a);
        struct outs *o = run_all(cn);
        sock_close(cn, &b);
        CHECK(o->n == 2 && find(o, "gone-1") && find(o, "gone-2"));
        CHECK_EQ(kvf_load_relaxed(&cn->acks_dropped), x0 + 2);
        /* the repeats, on a new connection */
        sock_open(cn, &c);
        CHECK_EQ(conn_post_wait(cn, sock_notice(&c, "gone-1", 4001, 2)), 0);
        CHECK_EQ(conn_post_wait(cn, sock_notice(&c, "gone-2", 4002, 4)), 0);
        CHECK_EQ(run_all(cn)->n, 0);
        CHECK_EQ(counter(KVF_CTR_ARRIVALS_DEDUPED), d0 + 2);
        o = sock_acks(cn, &c);
        CHECK_EQ(o->n, 2);
        CHECK(o->r[0].key == 4001 && o->r[0].status == KVF_STATUS_FINISHED);
        CHECK(o->r[1].key == 4002 && o->r[1].status == KVF_STATUS_FINISHED);
        sock_close(cn, &c);
        printf("ok: answers for closed sessions dropped (before and after they were decided); the "
               "repeats on a new connection answered from the journal, no second arrival\n");
}

/*
 * A decode engine that stops reading: the arrival ring fills, a finish notice waits in its slot,
 * and the sender withdraws it at its deadline. The withdrawal is answered at once, `timed out`,
 * although it is behind the held notice; the notice is then published `timed out`, never
 * `finished`, when the engine reads again, also through a connector restart in between.
 */
static void case_withdraw_held_ring(void)
{
        struct connector *cn = &C2;
        uint64_t p0 = counter(KVF_CTR_ARRIVALS_PENDING);
        unsigned n = fill(&cn->ctl.rings[KVF_RING_CONNECTOR_TO_ENGINE], KVF_RT_ARRIVAL);
        CHECK(n > 0);
        finish("held-1", 701, 2);
        finish("held-2", 702, 4);
        notice("held-1", 701, KVF_STATUS_TIMEOUT, true, D.engine, D.ctl.hdr->created_ns, 2);
        conn_notices_read(cn);
        CHECK(cn->notices_blocked);
        struct outs *o = replies();
        CHECK_EQ(o->n, 1);
        CHECK(o->r[0].key == 701 && o->r[0].status == KVF_STATUS_TIMEOUT);
        CHECK(strstr(o->r[0].reason, "not reading its arrivals"));
        CHECK_EQ(counter(KVF_CTR_ARRIVALS_PENDING), p0 + 1);
        conn_notices_read(cn); /* read again while still full: not answered twice */
        CHECK_EQ(replies()->n, 0);
        CHECK_EQ(notices_left() > 0, 1);

        connector_drop(cn); /* dies with the decision pending */
        connector_up(&C1);
        cn = &C1;
        conn_notices_read(cn); /* its successor answers the same (the journal kept it) */
        o = replies();
        CHECK(o->n == 1 && o->r[0].key == 701 && o->r[0].status == KVF_STATUS_TIMEOUT);
        CHECK_EQ(counter(KVF_CTR_ARRIVALS_PENDING), p0 + 1);

        CHECK_EQ(arrivals()->n, n); /* the engine reads again */
        CHECK(conn_notices_read(cn));
        o = arrivals();
        CHECK_EQ(o->n, 2);
        CHECK(!strcmp(o->r[0].id, "held-1") && o->r[0].status == KVF_STATUS_TIMEOUT);
        CHECK(strstr(o->r[0].reason, "withdrawn by the prefill side"));
        CHECK(!strcmp(o->r[1].id, "held-2") && o->r[1].status == KVF_STATUS_FINISHED);
        o = replies(); /* held-1's notice (decided already) and held-2's; the withdrawal's not again */
        CHECK_EQ(o->n, 2);
        CHECK(find(o, "held-1") && find(o, "held-1")->status == KVF_STATUS_TIMEOUT);
        CHECK(find(o, "held-2") && find(o, "held-2")->status == KVF_STATUS_FINISHED);
        CHECK_EQ(notices_left(), 0);
        /* a repeat of the withdrawn notice later: answered from the journal, not published */
        finish("held-1", 701, 2);
        CHECK(conn_notices_read(cn));
        CHECK_EQ(arrivals()->n, 0);
        o = replies();
        CHECK(o->n == 1 && o->r[0].status == KVF_STATUS_TIMEOUT);
        printf("ok: a withdrawal behind a notice held by a full arrival ring answered at once "
               "('timed out', once, again by a restarted connector); the notice then published "
               "'timed out', never 'finished'\n");
}

/* Over a socket session a withdrawal waits behind a held notice (a socket notice is not kept
 * across a restart of the connector, so nothing is decided ahead of it): once there is room the
 * notice is published and the withdrawal answered from the journal; a withdrawal with nothing
 * ahead of it for its key publishes its own arrival. */
static void case_withdraw_held_socket(struct connector *cn)
{
        struct sock k;
        sock_open(cn, &k);
        unsigned n = fill(&cn->ctl.rings[KVF_RING_CONNECTOR_TO_ENGINE], KVF_RT_ARRIVAL);
        CHECK(n > 0);
        uint64_t p0 = counter(KVF_CTR_ARRIVALS_PENDING);
        CHECK_EQ(conn_post_wait(cn, sock_notice(&k, "sheld-1", 801, 2)), 0);
        for (uint64_t key = 801; key <= 802; key++) {
                struct event *w = sock_notice(&k, key == 801 ? "sheld-1" : "sheld-2", key,
                                              key == 801 ? 2 : 6);
                w->rec.withdraw = true;
                w->rec.status = KVF_STATUS_TIMEOUT;
                snprintf(w->rec.reason, sizeof(w->rec.reason), "the sender timed out");
                CHECK_EQ(conn_post_wait(cn, w), 0);
        }
        conn_events_run(cn);
        CHECK_EQ(sock_acks(cn, &k)->n, 0);
        CHECK_EQ(counter(KVF_CTR_ARRIVALS_PENDING), p0);
        CHECK_EQ(arrivals()->n, n); /* the engine reads again */
        struct outs *o = run_all(cn);
        CHECK_EQ(o->n, 2);
        CHECK(find(o, "sheld-1") && find(o, "sheld-1")->status == KVF_STATUS_FINISHED);
        CHECK(find(o, "sheld-2") && find(o, "sheld-2")->status == KVF_STATUS_TIMEOUT);
        o = sock_acks(cn, &k);
        CHECK_EQ(o->n, 3);
        CHECK(o->r[0].key == 801 && o->r[0].status == KVF_STATUS_FINISHED);
        CHECK(o->r[1].key == 801 && o->r[1].status == KVF_STATUS_FINISHED);
        CHECK(o->r[2].key == 802 && o->r[2].status == KVF_STATUS_TIMEOUT);
        sock_close(cn, &k);
        printf("ok: over a socket session, withdrawals behind a held notice waited for room, then "
               "the notice published and the withdrawal answered from the journal\n");
}

int main(void)
{
        setvbuf(stdout, NULL, _IOLBF, 0);
        atexit(cleanup);
        signal(SIGSEGV, on_fatal);
        signal(SIGABRT, on_fatal);
        inst_make(&D, "d", KVF_IROLE_DECODE);
        inst_make(&P, "p", KVF_IROLE_PREFILL);
        engine_attach(&D);
        connector_up(&C1);
        CHECK(kvf_ctl_attach(D.name, true, &dview) == 0);
        int s = kvf_notice_claim(&dview, P.name, P.ctl.hdr->created_ns, &slot);
        CHECK(s >= 0);
        case_publish();
        case_duplicates();
        case_rehearsal();
        case_failures();
        case_full_reply();
        case_full_arrivals();
        case_restart();
        case_threads(&C2);
        case_full_queue(&C2);
        case_closed_session(&C2);
        case_withdraw_held_socket(&C2);
        case_withdraw_held_ring(); /* C2 dies in it; C1 follows */
        kvf_notice_release(&slot);
        connector_drop(&C1);
        kvf_ctl_detach(&dview);
        printf("connector_logic_test: all cases passed\n");
        return 0;
}
