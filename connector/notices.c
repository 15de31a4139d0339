/*
 * Same-host notices in one hop (decode side): prefill senders on this host
 * commit finish notices, withdrawals and aborts to the notice slots of this
 * instance's segment (common/notice.h); the control thread reads them here,
 * publishes their arrivals through the one commit point every transport uses
 * (conn_arrival_notice -> conn_publish_arrival, with the journal), and writes
 * the answer into the slot's reply ring, ringing the holder's sender doorbell.
 *
 * Crashes: a notice is consumed (head moved) only after its answer is
 * committed to the reply ring, so a connector that dies after publishing and
 * before answering leaves the notice in the ring; its successor reads it
 * again and the journal answers it without a second arrival.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomics.h"
#include "clock.h"
#include "connector.h"
#include "err.h"
#include "log.h"
#include "notice.h"

int conn_notices_init(struct connector *cn)
{
        struct kvf_ring notice[KVF_NOTICE_SLOTS], reply[KVF_NOTICE_SLOTS];
        int rc = kvf_notice_connector_attach(&cn->ctl, notice, reply, cn->gen);
        if (rc < 0)
                return rc;
        if (rc > 0) {
                kvf_count(&cn->ctl, KVF_CTR_RING_REPAIRS, (uint64_t)rc);
                kvf_warn("repaired %d notice rings after a crash", rc);
        }
        const char *ab = getenv("KVF_AB_NO_REHEARSAL");
        cn->rehearsal.off = ab && !strcmp(ab, "1");
        for (uint32_t s = 0; s < KVF_NOTICE_SLOTS; s++) {
                cn->nslots[s].notice = notice[s];
                cn->nslots[s].reply = reply[s];
                cn->nslots[s].holder.fd = -1;
        }
        return 0;
}

/* Map the holder's segment for its sender's doorbell (once per claim of the slot). Without
 * it the answer is still in the reply ring; the sender finds it on its next turn. */
static void holder_bell(struct connector *cn, uint32_t s, const char *owner, uint64_t created_ns,
                        uint64_t gen)
{
        struct conn_notice_slot *v = &cn->nslots[s];
        if (v->holder_gen == gen)
                return;
        if (v->mapped) {
                kvf_ctl_detach(&v->holder);
                v->mapped = false;
        }
        v->reply.bell = &cn->ctl.notices[s].reply_bell;
        v->holder_gen = gen;
        if (kvf_ctl_attach_peer(owner, true, &v->holder) < 0) {
                kvf_warn("notice slot %u: cannot map '%s' to wake its sender: %s", s, owner, kvf_err_msg());
                return;
        }
        if (v->holder.hdr->created_ns != created_ns) {
                kvf_warn("notice slot %u: '%s' was re-created since it claimed the slot", s, owner);
                kvf_ctl_detach(&v->holder);
                return;
        }
        v->mapped = true;
        v->reply.bell = &v->holder.bells[KVF_BELL_SENDER];
        kvf_info("notice slot %u: held by the sender of '%s'", s, owner);
}

struct rd {
        struct connector *cn;
        uint32_t s;
        char owner[KVF_INSTANCE_MAX];
        uint64_t owner_gen;
        bool held; /* a notice stayed in the ring for want of room */
};

/* The notice in a slot's record, named by the slot's holder; false: not one (counted and said
 * when `say`, i.e. in its turn). */
static bool notice_of(struct rd *x, uint16_t type, const uint8_t *pl, uint32_t len, struct event *ev,
                      bool say)
{
        struct connector *cn = x->cn;
        *ev = (struct event){.kind = EV_NOTICE, .ring_slot = x->s + 1, .src_gen = x->owner_gen};
        if (type != KVF_RT_NOTICE || kvf_record_decode(KVF_RT_NOTICE, pl, len, 0, &ev->rec) < 0) {
                if (type == KVF_RT_NOTICE)
                        kvf_record_free(&ev->rec);
                if (!say)
                        return false;
                kvf_count(&cn->ctl, KVF_CTR_BAD_RECORDS, 1);
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "notice slot %u: bad %s record: %s", x->s,
                           kvf_rec_type_name(type), type == KVF_RT_NOTICE ? kvf_err_msg() : "unexpected type");
                return false;
        }
        /* The notice names its source by the slot's holder, as a socket notice by the
         * instance its handshake proved (a slot with notices left in it is never claimed by
         * another instance: common/notice.c). */
        snprintf(ev->rec.peer, sizeof(ev->rec.peer), "%s", x->owner);
        return true;
}

static int on_notice(void *ctx, uint16_t type, const uint8_t *pl, uint32_t len, uint64_t pos)
{
        struct rd *x = ctx;
        struct connector *cn = x->cn;
        struct event ev;

        if (!notice_of(x, type, pl, len, &ev, true))
                return 0;
        if (!ev.rec.withdraw && ev.rec.status == KVF_STATUS_FINISHED && len <= CONN_REHEARSE_REC) {
                struct conn_rehearsal *h = &cn->rehearsal;
                memcpy(h->rec, pl, len);
                h->len = len;
                memcpy(h->owner, x->owner, sizeof(h->owner));
                h->src_gen = x->owner_gen;
        }
        ev.answered = ev.rec.withdraw && pos < cn->nslots[x->s].early_to;
        int rc = conn_arrival_notice(cn, &ev);
        kvf_record_free(&ev.rec);
        if (rc == -EAGAIN) {
                cn->notices_blocked = true;
                x->held = true;
                return -EAGAIN;
        }
        return 0;
}

/*
 * Behind a notice held for room: the withdrawals are answered now, not after it
 * (conn_publish_arrival decides them while the engine's ring is full), so a sender that
 * gave up on a request hears how it ended before its second deadline. They stay in the ring
 * and are read in their turn, their answers not sent twice (early_to).
 */
static int on_early(void *ctx, uint16_t type, const uint8_t *pl, uint32_t len, uint64_t pos)
{
        struct rd *x = ctx;
        struct event ev;
        (void)pos;

        if (!notice_of(x, type, pl, len, &ev, false))
                return 0;
        int rc = 0;
        if (ev.rec.withdraw) {
                rc = conn_arrival_notice(x->cn, &ev);
                if (rc == -EAGAIN && ev.answered)
                        rc = 0;
        }
        kvf_record_free(&ev.rec);
        return rc; /* -EAGAIN: its answer found no room: looked at again next time */
}

/* A notice nobody can be answered for (its slot's holder is no instance): dropped, counted. */
static int drop_notice(void *ctx, uint16_t type, const uint8_t *p, uint32_t len, uint64_t pos)
{
        struct connector *cn = ctx;
        (void)type, (void)p, (void)len, (void)pos;
        kvf_count(&cn->ctl, KVF_CTR_BAD_RECORDS, 1);
        return 0;
}

bool conn_notices_read(struct connector *cn)
{
        bool worked = false;
        cn->notices_blocked = false;
        for (uint32_t s = 0; s < KVF_NOTICE_SLOTS; s++) {
                struct kvf_notice_slot *ns = &cn->ctl.notices[s];
                struct conn_notice_slot *v = &cn->nslots[s];
                if (!kvf_ring_readable(&v->notice))
                        continue;
                /* Pairs with the release store of generation in the claim: owner and its
                 * incarnation are those of this generation's holder. */
                struct rd x = {.cn = cn, .s = s};
                uint64_t gen = kvf_load_acquire(&ns->generation);
                memcpy(x.owner, ns->owner, sizeof(x.owner));
                x.owner[sizeof(x.owner) - 1] = '\0';
                x.owner_gen = kvf_load_relaxed(&ns->owner_created_ns);
                if (kvf_instance_name_check(x.owner) < 0) {
                        /* Dropped, not left in the ring: left, they would keep the control
                         * thread from ever sleeping. Its sender, if any, hears nothing and
                         * falls back as for a lost notice (the request's own timeout). */
                        int n = kvf_ring_read(&v->notice, drop_notice, cn, 64);
                        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR,
                                   "notice slot %u: its holder's name is not an instance name: %d notice(s) dropped",
                                   s, n);
                        continue;
                }
                holder_bell(cn, s, x.owner, x.owner_gen, gen);
                if (v->early_gen != gen) {
                        v->early_gen = gen;
                        v->early_to = 0;
                }
                int n = kvf_ring_read(&v->notice, on_notice, &x, 64);
                if (n > 0)
                        worked = true;
                else if (n < 0)
                        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "notice slot %u: %s", s, kvf_err_msg());
                if (x.held)
                        kvf_ring_peek(&v->notice, &v->early_to, on_early, &x, 256);
        }
        return worked;
}

/*
 * Rehearsal. A notice's handling (decode, journal, checks, the arrival's and the answer's
 * records) took 12 to 17 us at p50 where its code and data had left the caches, against 3 to 5
 * us where they had not (docs/BENCHMARKS.md): between two steps' notices the control thread
 * sleeps and moves between CPUs, and on host caches the sender's copies stream through the
 * caches meanwhile. A sender that expects to post a notice soon says so on the doorbell
 * (kvf_doorbell_expect) and the control thread polls for it; while it does, it handles the last
 * notice it read again, every CONN_REHEARSE_NS, with conn_arrival_rehearse: the same decoding,
 * lookups and record building, with nothing published, journaled or answered.
 */
void conn_notices_rehearse(struct connector *cn)
{
        struct conn_rehearsal *h = &cn->rehearsal;
        if (!h->len || h->off)
                return;
        uint64_t until = kvf_load_relaxed(&cn->ctl.bells[KVF_BELL_CONNECTOR].expect_until);
        if (!until)
                return;
        uint64_t now = kvf_now_ns();
        if (now >= until || now - h->at_ns < CONN_REHEARSE_NS)
                return;
        h->at_ns = now;
        struct kvf_record r;
        if (kvf_record_decode(KVF_RT_NOTICE, h->rec, h->len, 0, &r) == 0) {
                snprintf(r.peer, sizeof(r.peer), "%s", h->owner);
                conn_arrival_rehearse(cn, &r, h->src_gen, h->scratch, sizeof(h->scratch));
                kvf_count(&cn->ctl, KVF_CTR_NOTICE_REHEARSALS, 1);
        }
        kvf_record_free(&r);
}

bool conn_notices_readable(struct connector *cn)
{
        for (uint32_t s = 0; s < KVF_NOTICE_SLOTS; s++)
                if (kvf_ring_readable(&cn->nslots[s].notice))
                        return true;
        return false;
}

int conn_notice_reply(struct connector *cn, uint32_t s, const struct kvf_record *ack)
{
        uint8_t *buf;
        size_t len;
        if (s >= KVF_NOTICE_SLOTS)
                return -EINVAL;
        if (kvf_record_encode_alloc(ack, &buf, &len) < 0)
                return -EAGAIN;
        int rc = kvf_bells_write(&cn->bells, &cn->nslots[s].reply, KVF_RT_ACK, buf, (uint32_t)len);
        free(buf);
        if (rc == -EAGAIN) {
                cn->notices_blocked = true;
                return -EAGAIN;
        }
        if (rc < 0) { /* never fits: the sender withdraws at its deadline, the journal answers */
                kvf_count(&cn->ctl, KVF_CTR_NOTICES_FAILED, 1);
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "req %s: notice slot %u: reply: %s",
                           ack->request_id, s, kvf_err_msg());
        }
        return 0;
}

void conn_notices_close(struct connector *cn)
{
        for (uint32_t s = 0; s < KVF_NOTICE_SLOTS; s++)
                if (cn->nslots[s].mapped) {
                        kvf_ctl_detach(&cn->nslots[s].holder);
                        cn->nslots[s].mapped = false;
                }
}
