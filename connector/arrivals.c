/*
 * Arrivals, the decode side of a notice: a finish (or abort) notice from a
 * prefill instance is published to the decode engine as an arrival, once,
 * and acknowledged with its status.
 *
 * The journal (in the control segment) remembers, for the last
 * KVF_JOURNAL_ENTRIES arrivals, the hash of (prefill instance, its
 * incarnation, transfer key), where the arrival record was claimed in
 * connector->engine, its status and its engine session. A notice sent again
 * (prefill connector restarted, connection dropped before the ack, a
 * withdrawal) is answered from it without a second arrival if the first was
 * committed, and published if it was not (we crashed between claim and
 * commit).
 *
 * Engine sessions (docs/ARCHITECTURE.md 6b): a transfer is bound to the
 * decode engine session that reserved its blocks; once that session is over
 * its notice is answered "engine gone" and its frames are drained.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomics.h"
#include "clock.h"
#include "connector.h"
#include "err.h"
#include "landing.h"
#include "layout.h"
#include "log.h"
#include "transport.h"

#define JEMPTY UINT32_MAX

/* A transfer, across restarts of either side: the prefill instance, its incarnation, the key. */
static uint64_t journal_key(const struct kvf_record *n, uint64_t src_gen)
{
        char buf[KVF_PEER_MAX + 48];
        int len = snprintf(buf, sizeof(buf), "%s/%016llx/%016llx", n->peer, (unsigned long long)src_gen,
                           (unsigned long long)n->key);
        return kvf_hash64(buf, (size_t)len, 0x6a);
}

static void jidx_put(struct connector *cn, uint64_t h, uint32_t entry)
{
        uint32_t mask = cn->jidx_cap - 1;
        for (uint32_t i = (uint32_t)h & mask;; i = (i + 1) & mask)
                if (cn->jidx[i] == JEMPTY || cn->ctl.journal[cn->jidx[i]].key_hash == h) {
                        cn->jidx[i] = entry;
                        return;
                }
}

static uint32_t jidx_find(const struct connector *cn, uint64_t h)
{
        uint32_t mask = cn->jidx_cap - 1;
        for (uint32_t i = (uint32_t)h & mask;; i = (i + 1) & mask) {
                uint32_t e = cn->jidx[i];
                if (e == JEMPTY)
                        return JEMPTY;
                if (cn->ctl.journal[e].key_hash == h)
                        return e;
        }
}

/* Rebuild the index from the journal; entries overwritten later are stale and skipped. A key
 * with a published entry and a pending one (a crash as the pending one was published) is
 * indexed by the published one: the pending ones go in first. */
static void jidx_rebuild(struct connector *cn)
{
        memset(cn->jidx, 0xff, cn->jidx_cap * sizeof(uint32_t));
        for (int published = 0; published < 2; published++)
                for (uint32_t e = 0; e < KVF_JOURNAL_ENTRIES; e++)
                        if (cn->ctl.journal[e].key_hash &&
                            (cn->ctl.journal[e].ring_pos != KVF_JOURNAL_PENDING) == published)
                                jidx_put(cn, cn->ctl.journal[e].key_hash, e);
}

void conn_journal_init(struct connector *cn)
{
        cn->jidx_cap = 4 * KVF_JOURNAL_ENTRIES;
        cn->jidx = malloc(cn->jidx_cap * sizeof(uint32_t));
        if (!cn->jidx)
                abort();
        /* Continue after the newest entry: the one with the largest ring position. */
        uint64_t best = 0;
        cn->jnext = 0;
        for (uint32_t e = 0; e < KVF_JOURNAL_ENTRIES; e++)
                if (cn->ctl.journal[e].key_hash && cn->ctl.journal[e].ring_pos + 1 > best) {
                        best = cn->ctl.journal[e].ring_pos + 1;
                        cn->jnext = (e + 1) % KVF_JOURNAL_ENTRIES;
                }
        jidx_rebuild(cn);
}

bool conn_arrival_published(struct connector *cn, const struct kvf_record *n, uint64_t src_gen)
{
        uint32_t e = jidx_find(cn, journal_key(n, src_gen));
        return e != JEMPTY && kvf_ring_delivered(&cn->ctl.rings[KVF_RING_CONNECTOR_TO_ENGINE],
                                                 cn->ctl.journal[e].ring_pos);
}

/*
 * Decided ahead of its arrival: a withdrawal that came while the engine's ring was full is
 * answered at once (conn_publish_arrival) and its status kept here, pending, until the arrival
 * can be published; the notice it withdrew, still waiting, is then published with that status,
 * never as it came. Without this the withdrawal waited behind the notice, the sender ended the
 * request "in doubt" and the notice later arrived `finished`.
 */
static struct kvf_journal_entry *journal_pending(struct connector *cn, uint64_t key)
{
        uint32_t e = jidx_find(cn, key);
        if (e == JEMPTY || kvf_load_relaxed(&cn->ctl.journal[e].ring_pos) != KVF_JOURNAL_PENDING)
                return NULL;
        return &cn->ctl.journal[e];
}

/*
 * A pending entry is passed over by the journal's writer: its notice is still in its slot's
 * ring, and publishes it (at most a third of each of KVF_NOTICE_SLOTS rings of notices can be
 * pending, far fewer than the journal's entries). Were every entry pending, the next is
 * overwritten, and said.
 */
static uint32_t journal_slot(struct connector *cn)
{
        for (uint32_t i = 0;; i++) {
                uint32_t slot = cn->jnext;
                struct kvf_journal_entry *je = &cn->ctl.journal[slot];
                cn->jnext = (cn->jnext + 1) % KVF_JOURNAL_ENTRIES;
                if (!je->key_hash || je->ring_pos != KVF_JOURNAL_PENDING)
                        return slot;
                if (i >= KVF_JOURNAL_ENTRIES) {
                        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR,
                                   "every journal entry is a withdrawn arrival not yet published: one is overwritten");
                        return slot;
                }
        }
}

/* Write a journal entry (key last, so a reader never pairs a key with another's fields). */
static void journal_put(struct connector *cn, uint32_t slot, uint64_t key, uint64_t pos, int status,
                        uint64_t session)
{
        struct kvf_journal_entry *je = &cn->ctl.journal[slot];
        kvf_store_relaxed(&je->key_hash, 0);
        kvf_store_relaxed(&je->ring_pos, pos);
        kvf_store_relaxed(&je->status, (uint32_t)status);
        kvf_store_relaxed(&je->session, session);
        kvf_store_release(&je->key_hash, key);
        /* The overwritten entry's index position now points at the new key's
         * entry or at a stale hash; rebuild lazily when the index fills up. */
        jidx_put(cn, key, slot);
        if ((cn->jnext & 1023) == 0)
                jidx_rebuild(cn);
}

/* The first of notice n's destination blocks beyond this cache, or n_dst if none is. */
static uint32_t dst_beyond(const struct kvf_cache_layout *L, const struct kvf_record *n)
{
        uint32_t i = 0;
        while (i < n->n_dst && n->dst[i] < L->num_blocks)
                i++;
        return i;
}

/* Every byte of a finished arrival landed: its blocks in every layer and tensor (the notice's own
 * count is the sender's, which does not count tcp bytes). */
static uint64_t finished_bytes(const struct kvf_cache_layout *L, const struct kvf_record *n)
{
        return (uint64_t)n->n_dst * kvf_layout_layers(L) * kvf_layout_layer_block_bytes(L);
}

/* The arrival record of notice n (a rehearsal's too: the same code, kept warm). */
static void arrival_record(struct kvf_record *a, const struct kvf_record *n, int status, uint64_t bytes,
                           uint64_t session, const char *why)
{
        *a = (struct kvf_record){.type = KVF_RT_ARRIVAL, .status = status, .bytes = bytes,
                                 .blocks = n->n_dst, .dst = n->dst, .n_dst = n->n_dst,
                                 .done_ns = kvf_now_ns(), .session = session, .id_bin = n->id_bin,
                                 /* Same host, one clock: when the sender posted the notice. */
                                 .accept_ns = n->transport == KVF_TRANSPORT_IPC ? n->done_ns : 0};
        snprintf(a->request_id, sizeof(a->request_id), "%s", n->request_id);
        snprintf(a->peer, sizeof(a->peer), "%s", n->peer);
        snprintf(a->reason, sizeof(a->reason), "%s",
                 why ? why : n->reason[0] || status == KVF_STATUS_FINISHED ? n->reason
                                                                           : "the prefill side gave no reason");
}

/* The answer to notice n: its status (or a write error) and why. */
static void ack_record(struct kvf_record *ack, const struct kvf_record *n, int st, uint64_t live,
                       const char *reason, const char *why)
{
        *ack = (struct kvf_record){.type = KVF_RT_ACK, .key = n->key, .status = st < 0 ? KVF_STATUS_WRITE : st,
                                   .id_bin = n->id_bin, .session = live};
        snprintf(ack->request_id, sizeof(ack->request_id), "%s", n->request_id);
        snprintf(ack->reason, sizeof(ack->reason), "%s",
                 st < 0 ? "the decode connector could not publish the arrival"
                        : reason[0] ? reason : why ? why : n->reason);
}

/* Control thread only: it is the one producer of connector->engine and the one writer of the
 * journal, so the two move together without a lock. */
int conn_publish_arrival(struct connector *cn, const struct kvf_record *n, uint64_t src_gen,
                         int status, const char *why, uint64_t session, char *reason,
                         size_t reasonlen, bool *owed)
{
        const struct kvf_ctl_header *h = cn->ctl.hdr;
        const struct kvf_cache_layout *L = &h->layout;
        struct kvf_ring *ring = &cn->ctl.rings[KVF_RING_CONNECTOR_TO_ENGINE];
        uint64_t key = journal_key(n, src_gen);
        uint32_t e = jidx_find(cn, key);
        struct kvf_journal_entry *pend = journal_pending(cn, key);

        reason[0] = '\0';
        if (owed)
                *owed = false;
        if (pend) {
                /* Withdrawn while it waited: published as the withdrawal was answered. */
                status = (int)pend->status;
                session = pend->session;
                why = "withdrawn by the prefill side at its deadline while this arrival waited for room in the engine's ring";
                if (!n->withdraw)
                        snprintf(reason, reasonlen, "the arrival was decided as '%s' already",
                                 kvf_status_name(status));
        } else if (e != JEMPTY && kvf_ring_delivered(ring, cn->ctl.journal[e].ring_pos)) {
                /* Published already: say how, so the sender's side agrees with ours. */
                kvf_count(&cn->ctl, KVF_CTR_ARRIVALS_DEDUPED, 1);
                int was = (int)cn->ctl.journal[e].status;
                if (was != KVF_STATUS_FINISHED)
                        snprintf(reason, reasonlen, "the arrival was published as '%s' already",
                                 kvf_status_name(was));
                return was;
        }
        if (status == KVF_STATUS_FINISHED) {
                if (n->transport == KVF_TRANSPORT_IPC && n->generation != h->created_ns) {
                        snprintf(reason, reasonlen,
                                 "instance '%s' was restarted during the transfer: the blocks went into its previous cache",
                                 h->instance);
                        return KVF_STATUS_CONNECTION;
                }
                uint32_t i = dst_beyond(L, n);
                if (i < n->n_dst) {
                        snprintf(reason, reasonlen, "dest_block_ids[%u] = %u is out of range: '%s' has %u blocks",
                                 i, n->dst[i], h->instance, L->num_blocks);
                        return KVF_STATUS_BLOCK_RANGE;
                }
        }
        uint64_t bytes = status == KVF_STATUS_FINISHED ? finished_bytes(L, n) : n->bytes;
        struct kvf_record a;
        arrival_record(&a, n, status, bytes, session, why);
        uint8_t *buf;
        size_t len;
        void *p;
        uint64_t pos;
        for (;;) {
                if (kvf_record_encode_alloc(&a, &buf, &len) < 0)
                        return -EAGAIN; /* out of memory for now: the notice waits */
                int rc = kvf_ring_claim(ring, KVF_RT_ARRIVAL, (uint32_t)len, &p, &pos);
                if (rc == 0)
                        break;
                free(buf);
                if (rc != -EMSGSIZE || !a.n_dst) {
                        if (!n->withdraw || !owed)
                                return -EAGAIN; /* full: the notice waits */
                        /* A withdrawal is answered now, the arrival owed (journal_pending). */
                        if (!pend)
                                journal_put(cn, journal_slot(cn), key, KVF_JOURNAL_PENDING, status,
                                            session);
                        snprintf(reason, reasonlen,
                                 "the decode engine is not reading its arrivals (ring full): it ends '%s' on both sides, the engine hears so when it reads again",
                                 kvf_status_name(status));
                        if (!pend)
                                kvf_count(&cn->ctl, KVF_CTR_ARRIVALS_PENDING, 1);
                        *owed = true;
                        return status;
                }
                /* Never fits this ring with its block list (optional): publish it without. */
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR,
                           "req %s: the arrival's %u block ids do not fit ring connector->engine: sent without them",
                           n->request_id, a.n_dst);
                a.n_dst = 0;
        }
        /* Journal before commit: a successor can then ask the ring whether it landed. The
         * pending entry goes once the published one is in (the journal's order is its
         * writes'; a successor continues after the newest). */
        uint32_t slot = journal_slot(cn);
        journal_put(cn, slot, key, pos, status, session);
        if (pend && slot != e)
                kvf_store_release(&pend->key_hash, 0);
        memcpy(p, buf, len);
        free(buf);
        kvf_bells_publish(&cn->bells, ring, pos);
        kvf_count(&cn->ctl, KVF_CTR_ARRIVALS, 1);
        if (session && session != conn_engine_session(cn))
                kvf_count(&cn->ctl, KVF_CTR_ARRIVALS_STALE, 1);
        kvf_debug("req %s: arrival from %s (%s), %llu bytes", n->request_id, n->peer,
                  kvf_status_name(status), (unsigned long long)bytes);
        /* The status this notice is answered with: the one just published. (An error
         * arrival acknowledges an abort; the sender decided that status already.) */
        return status;
}

/*
 * A notice from a prefill instance (decode side): publish the arrival once and
 * acknowledge with its status. The transfer is bound to the decode engine
 * session that reserved its blocks (ipc: the one the sender saw; network: the one
 * live when the transfer opened here); if that session is over, the blocks
 * may be another request's now, so the arrival says "engine gone" and goes to
 * that ended session, never to a later one.
 */
int conn_arrival_notice(struct connector *cn, struct event *ev)
{
        struct kvf_record *n = &ev->rec;
        /* A network transfer (not ipc, which the sender copied itself): its data lands
         * through a transport, and the arrival waits for it (landing.c). */
        const struct conn_transport *t = conn_transport_of(n->transport);
        bool net = t != NULL;
        char reason[KVF_REASON_MAX], gone[KVF_REASON_MAX], no[KVF_REASON_MAX];
        /* The session the sender bound it to (the task's, or the last it heard of from us),
         * else (a network transfer) the one live when it first reached us. */
        uint64_t bound = n->session || !net ? n->session : conn_landing_session(cn, n->peer, ev->src_gen, n->key);
        uint64_t live = conn_engine_session(cn);
        int status = n->status;
        const char *why = NULL;

        /* A transport this connector cannot receive (not built in, or refused to every peer:
         * no device): its data never comes, so the finish notice of such a transfer (sent
         * before the prefill side heard of the refusal) is answered now, not at its timeout. */
        if (status == KVF_STATUS_FINISHED && n->transport != KVF_TRANSPORT_IPC &&
            (!t || (t->unavailable && t->unavailable(cn, true, no, sizeof(no)) < 0))) {
                if (!t)
                        snprintf(gone, sizeof(gone),
                                 "transfer_protocol '%s' is not supported by the connector of '%s' (not built in)",
                                 kvf_transport_name(n->transport), cn->ctl.hdr->instance);
                else
                        snprintf(gone, sizeof(gone), "%s is not available at '%s': %s", t->name,
                                 cn->ctl.hdr->instance, no);
                status = KVF_STATUS_CONNECTION;
                why = gone;
        }

        if (bound && bound != live && status == KVF_STATUS_FINISHED) {
                snprintf(gone, sizeof(gone),
                         "the decode engine session %llu that reserved the blocks ended before the transfer finished",
                         (unsigned long long)bound);
                status = KVF_STATUS_ENGINE_GONE;
                why = gone;
        }
        /* Withdrawn while it waited for room: published as the withdrawal was answered
         * (conn_publish_arrival), its data no longer waited for. */
        bool decided = journal_pending(cn, journal_key(n, ev->src_gen)) != NULL;
        /* An aborted (or withdrawn) network transfer: fence off its late frames before the
         * engine hears of it, so blocks it frees on the error arrival stay untouched. */
        if (net && (status != KVF_STATUS_FINISHED || decided))
                conn_landing_close(cn, n->peer, ev->src_gen, n->key, 0, NULL);
        int landed = KVF_STATUS_FINISHED;
        if (net && status == KVF_STATUS_FINISHED && !decided && !conn_arrival_published(cn, n, ev->src_gen) &&
            !conn_landing_notice(cn, n, ev->src_gen, ev->session, &landed, gone, sizeof(gone)))
                return 0; /* the data is not all in: the arrival waits for it */
        if (landed != KVF_STATUS_FINISHED) {
                /* Its transport says a write failed after the notice went out (rdma): the
                 * arrival says so, and the notice is answered with it. */
                if (!gone[0])
                        snprintf(gone, sizeof(gone), "the prefill side's %s writes of this request failed",
                                 kvf_transport_name(n->transport));
                status = landed;
                why = gone;
                /* (kept with it: a retry while the engine's ring is full is told the same) */
                conn_landing_close(cn, n->peer, ev->src_gen, n->key, status, why);
        }
        /* Answered ahead of its turn (notices.c): the notice it withdrew, ahead of it in the
         * same ring, has been published since; nothing more to do or to say. */
        if (ev->answered && !decided)
                return 0;
        /* A withdrawal may be decided while the engine's ring is full only where its notice
         * stays in a slot's ring until published (no socket notice is kept across a restart
         * of this connector). */
        bool owed = false;
        int st = conn_publish_arrival(cn, n, ev->src_gen, status, why, bound, reason, sizeof(reason),
                                      ev->ring_slot ? &owed : NULL);
        if (st == -EAGAIN)
                return -EAGAIN;
        if (ev->answered)
                return owed ? -EAGAIN : 0;
        struct kvf_record ack;
        ack_record(&ack, n, st, live, reason, why);
        if (ack.status != n->status)
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "req %s from %s: %s: %s", n->request_id,
                           n->peer, kvf_status_name(ack.status), ack.reason);
        if (n->withdraw)
                kvf_info("req %s from %s: withdrawn by the sender; the arrival is '%s'", n->request_id,
                         n->peer, kvf_status_name(ack.status));
        /* A notice from a slot: a reply ring with no room leaves the notice in its ring, read
         * again later and answered from the journal. From a socket: the answer goes to the
         * session's outbox, for its own thread to write; if the session is gone the answer
         * is dropped, the prefill side re-sends and the journal de-duplicates. */
        if (ev->ring_slot) {
                if (conn_notice_reply(cn, ev->ring_slot - 1, &ack) < 0)
                        return -EAGAIN;
        } else if (conn_session_send(cn, ev->session, &ack) == -ENOMEM) {
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR,
                           "req %s from %s: out of memory for its answer: the prefill side asks again",
                           n->request_id, n->peer);
        }
        if (owed) {
                /* Answered; its arrival still to publish: the record stays in its notice ring,
                 * behind the notice that publishes it once there is room. */
                ev->answered = true;
                return -EAGAIN;
        }
        if (net && status == KVF_STATUS_FINISHED)
                conn_landing_close(cn, n->peer, ev->src_gen, n->key, 0, NULL); /* aborts: above */
        return 0;
}

int conn_arrival_data_done(struct connector *cn, struct event *ev)
{
        /* The last block of a network transfer is in: publish if its notice waits. */
        struct event n = {.kind = EV_NOTICE, .src_gen = ev->src_gen};
        if (!conn_landing_take_ready(cn, ev->rec.peer, ev->src_gen, ev->rec.key, &n.rec, &n.session))
                return 0;
        int rc = conn_arrival_notice(cn, &n);
        if (rc == -EAGAIN) {
                /* The ring is full: the notice waits as an event of its own. */
                struct event *nev = malloc(sizeof(*nev));
                if (nev) {
                        *nev = n;
                        conn_post(cn, nev);
                        return 0;
                }
                /* The prefill side sends the notice again on its next connection, or
                 * withdraws it at its deadline; the journal answers either. */
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "req %s from %s: out of memory: its notice waits for a repeat",
                           n.rec.request_id, n.rec.peer);
        }
        kvf_record_free(&n.rec);
        return 0;
}

/*
 * Each heartbeat, and when the engine's role slot changes: is the decode
 * engine's session still live? When it ended,
 * the transfers bound to it are closed (their frames are drained, never
 * written into blocks a later engine may have given to other requests), and
 * their waiting notices are answered "engine gone".
 */
void conn_engine_check(struct connector *cn)
{
        uint64_t ended;
        uint64_t live = kvf_engine_session_checked(&cn->ctl, &ended);
        if (ended)
                kvf_store_release(&cn->eng_dead, ended);
        if (live == cn->eng_seen)
                return;
        if (cn->eng_seen)
                kvf_info("decode engine session %llu ended%s", (unsigned long long)cn->eng_seen,
                         live ? "; a new one attached" : "");
        cn->eng_seen = live;
        /* Notices that waited for data that no longer matters: answered "engine gone" by the
         * events they come back as, in order behind what is queued. */
        for (struct event *ev = conn_landing_end_sessions(cn, live), *next; ev; ev = next) {
                next = ev->next;
                conn_post(cn, ev);
        }
        /* Tell the prefill instances connected to us: tasks they accept from now on are bound
         * to the new session (a pong is what the sender side reads it from, ack or not). */
        struct kvf_record pong = {.type = KVF_RT_PONG, .session = live};
        conn_sessions_send_all(cn, &pong);
}

/*
 * A finished same-host notice's handling without its effects (notices.c conn_notices_rehearse):
 * the journal lookups, the checks, the arrival's and the answer's records encoded into `scratch`.
 * Nothing is published, journaled or answered; the arrival of the notice rehearsed (published
 * long since) is only looked up.
 */
void conn_arrival_rehearse(struct connector *cn, const struct kvf_record *n, uint64_t src_gen, uint8_t *scratch,
                           size_t cap)
{
        const struct kvf_cache_layout *L = &cn->ctl.hdr->layout;
        uint64_t live = conn_engine_session(cn);
        /* (published long since: the real handling would answer it from the journal; each lookup
         * ends in an atomic load of the segment, which the compiler keeps) */
        (void)conn_arrival_published(cn, n, src_gen);
        (void)journal_pending(cn, journal_key(n, src_gen));
        int status = dst_beyond(L, n) < n->n_dst ? KVF_STATUS_BLOCK_RANGE : KVF_STATUS_FINISHED;
        struct kvf_record r;
        arrival_record(&r, n, status, finished_bytes(L, n), live, NULL);
        (void)kvf_record_encode(&r, scratch, cap);
        ack_record(&r, n, status, live, "", NULL);
        (void)kvf_record_encode(&r, scratch, cap);
}
