/*
 * A request's states and transitions: the one place that decides what
 * happens to a request (states and their invariants: sender.h).
 *
 * sender_req_event() takes an event and moves the request; everything below
 * it (progress.c, copies.c, plan.c, outbox.c, peers.c, sessions.c, table.c)
 * returns what happened (what a progress word made ready and whether it all
 * went, which copies landed or failed, whether a record was posted) and never
 * calls back up. This file is also the only writer of kvf_req_slot.state and
 * of the in-process state (s->rq) beside it.
 *
 * Exactly one completion per request, across sender crashes:
 *  - a task record is consumed one at a time, so at most one is re-read
 *    after a crash (tasks.c);
 *  - a decided request is COMPLETING; its completion's ring position is
 *    stored before the record is committed (outbox.c), and kvf_ring_delivered()
 *    tells a successor whether that record made it (sender_adopt).
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomics.h"
#include "clock.h"
#include "err.h"
#include "layout.h"
#include "log.h"
#include "sender.h"

static const char *const state_names[SREQ_COUNT] = {
    [SREQ_FREE] = "free",     [SREQ_MOVING] = "moving",      [SREQ_LANDING] = "landing",
    [SREQ_LANDED] = "landed", [SREQ_HANDED] = "handed over", [SREQ_DECIDED] = "decided",
};

const char *sender_req_state_name(enum sender_req_state st)
{
        return (unsigned)st < SREQ_COUNT ? state_names[st] : "invalid";
}

static bool live_state(enum sender_req_state st)
{
        return st != SREQ_FREE && st != SREQ_DECIDED;
}

static bool moving_state(enum sender_req_state st)
{
        return st == SREQ_MOVING || st == SREQ_LANDING;
}

static bool noticed_state(enum sender_req_state st)
{
        return st == SREQ_LANDED || st == SREQ_HANDED;
}

/* The one writer of a slot's state, in this process and in the shared table. */
static void set_state(struct sender *s, uint32_t slot, enum sender_req_state st)
{
        static const uint32_t shm[SREQ_COUNT] = {
            [SREQ_FREE] = KVF_REQ_FREE,          [SREQ_MOVING] = KVF_REQ_ACTIVE,
            [SREQ_LANDING] = KVF_REQ_ACTIVE,     [SREQ_LANDED] = KVF_REQ_FINISHING,
            [SREQ_HANDED] = KVF_REQ_HANDED_OVER, [SREQ_DECIDED] = KVF_REQ_COMPLETING,
        };
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        s->rq[slot] = (uint8_t)st;
        /* Release: what the new state promises (the task's fields, the copies landed, the
         * status and reason) is in place before a successor or a reader sees the state. */
        if (kvf_load_relaxed(&r->state) != shm[st])
                kvf_store_release(&r->state, shm[st]);
}

static void mark(struct sender *s, uint32_t slot, uint8_t flag)
{
        s->flags[slot] |= flag;
        s->pending = true;
}

static void free_slot(struct sender *s, uint32_t slot)
{
        sender_disarm(s, slot);
        sender_map_remove(s, slot);
        s->flags[slot] = 0;
        s->engine_blocked = false; /* a task waiting for a slot can have this one */
        /* Everything about the old request is done before the slot can be seen free. */
        set_state(s, slot, SREQ_FREE);
}

/* Decide a request's status; the completion is posted now or when the ring has room. */
static void decide(struct sender *s, uint32_t slot, int status, const char *reason)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        enum sender_req_state st = sender_req_state(s, slot);
        char why[KVF_REASON_MAX];
        if (!live_state(st))
                return;
        /* LANDED or HANDED, its finish notice not yet posted (a failure the connector reported
         * first, say a transport it cannot use): the peer has heard of it no more than of a
         * moving one, and is told the same way. */
        bool unnoticed = (st == SREQ_LANDED || st == SREQ_HANDED) && !r->notice_gen;
        /* The engine claims no more of it (its claims are awaited); a failure the engine
         * reported for its copies, or one that cannot be waited for, is the outcome. */
        if (sender_plan_close(s, slot) < 0) {
                snprintf(why, sizeof(why), "%s", kvf_err_msg());
                status = KVF_STATUS_WRITE;
                reason = why;
        }
        r->status = (uint32_t)status;
        /* A failure always says why: an engine (and an operator) cannot act on a bare status. */
        if (status != KVF_STATUS_FINISHED && (!reason || !reason[0]))
                reason = "no reason was recorded";
        if (reason != r->reason)
                snprintf(r->reason, sizeof(r->reason), "%s", reason ? reason : "");
        r->completion_pos = ~0ull;
        sender_disarm(s, slot);
        /* Ended while moving, whatever the status: its destination blocks may go to another
         * request. (The engines hear of the end, its abort notice and its completion, only
         * once copies of it still in flight have landed: flush_slot.) */
        sender_book_remove(s, slot);
        set_state(s, slot, SREQ_DECIDED);
        s->flags[slot] = 0;
        mark(s, slot, SLOT_NEEDS_COMPLETION);
        /* A request that fails while moving: tell the peer, so its engine can free the
         * blocks it reserved (best effort, not waited for). */
        if ((moving_state(st) || unnoticed) && status != KVF_STATUS_FINISHED &&
            (r->peer_idx != UINT32_MAX || r->transport != KVF_TRANSPORT_IPC))
                mark(s, slot, SLOT_ABORT_NOTICE);
}

void sender_fail(struct sender *s, uint32_t slot, int status, const char *fmt, ...)
{
        char reason[KVF_REASON_MAX];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(reason, sizeof(reason), fmt, ap);
        va_end(ap);
        sender_req_event(
            s, slot,
            &(struct sender_ev){.type = SENDER_EV_FAIL, .status = status, .reason = reason});
}

/* A post that failed: back-pressure (true) leaves the work owed; a record that can never be
 * posted fails the request with "write error" (false). */
static bool post_failed(struct sender *s, uint32_t slot, int rc)
{
        char why[KVF_REASON_MAX];
        if (sender_post_again(rc))
                return true;
        kvf_errlog(&s->ctl, KVF_ROLE_SENDER, "req %s: %s", s->ctl.reqtab[slot].request_id,
                   kvf_err_msg());
        snprintf(why, sizeof(why), "%s", kvf_err_msg());
        decide(s, slot, KVF_STATUS_WRITE, why);
        return false;
}

/* Every byte has left this sender's hands (ipc: landed): the finish notice is owed. */
static void to_notice(struct sender *s, uint32_t slot)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        if (!r->last_layer_ns) /* (set as its layers became ready: sender/progress.c) */
                r->last_layer_ns =
                    s->progress_ns && s->progress_ns > r->accept_ns ? s->progress_ns : r->accept_ns;
        sender_disarm(s, slot);
        r->notice_gen = 0;
        /* Its destination blocks are let go here, not when it is decided: nothing of this
         * sender writes them any more, and once the arrival is published (before our answer
         * comes back) the decode engine may give them to its next request at once. */
        sender_book_remove(s, slot);
        set_state(s, slot, r->transport == KVF_TRANSPORT_IPC ? SREQ_LANDED : SREQ_HANDED);
        mark(s, slot, SLOT_NEEDS_NOTICE);
}

/* Every byte is handed over: LANDING while copies of it are still out, else on to the notice. */
static void all_sent(struct sender *s, uint32_t slot)
{
        if (sender_req_state(s, slot) != SREQ_MOVING)
                return;
        sender_disarm(s, slot);
        if (sender_copies_busy(s, slot)) {
                set_state(s, slot, SREQ_LANDING);
                /* (its copies out: about one layer of it) */
                sender_expect_notice(s, slot, 0, sender_request_bytes(s, &s->ctl.reqtab[slot]) / s->layers);
                return;
        }
        to_notice(s, slot);
}

/* Move what the progress word allows, and act on how it went. */
static void advance(struct sender *s, uint32_t slot)
{
        if (sender_req_state(s, slot) != SREQ_MOVING)
                return;
        int status = KVF_STATUS_WRITE;
        switch (sender_advance(s, slot, s->flags[slot] & SLOT_NET_BLOCKED, &status)) {
        case SENDER_ADV_WAIT:
                break;
        case SENDER_ADV_AGAIN:
                s->sliced = true;
                /* fallthrough */
        case SENDER_ADV_BLOCKED:
                mark(s, slot, SLOT_NEEDS_ADVANCE);
                sender_arm(s, slot);
                break;
        case SENDER_ADV_ALL_SENT:
                all_sent(s, slot);
                break;
        case SENDER_ADV_FAILED: {
                char why[KVF_REASON_MAX];
                snprintf(why, sizeof(why), "%s", kvf_err_msg());
                decide(s, slot, status, why);
                break;
        }
        }
}

/* The connector's generation moved from one that had run: it lost what it held. From 0 (no
 * connector had claimed its role when this sender started, as when `up` starts the sender
 * first) nothing was taken from the rings yet, and handing it all over again would only send
 * every byte twice. */
static bool connector_restarted(const struct sender *s, uint64_t cgen)
{
        return s->connector_gen && cgen != s->connector_gen;
}

/* The connector lost what it held: a network request is handed over again. */
static void redo_network(struct sender *s, uint32_t slot)
{
        s->resend[slot] = 0;
        mark(s, slot, SLOT_NEEDS_OPEN | SLOT_RESEND);
        if (noticed_state(sender_req_state(s, slot)))
                mark(s, slot, SLOT_NEEDS_NOTICE);
}

static int post_notice(struct sender *s, uint32_t slot, enum sender_notice kind)
{
        int rc = sender_post_notice(s, slot, kind);
        if (rc < 0)
                return rc;
        if (rc == 1) {
                if (kind != SENDER_NOTICE_ABORT)
                        s->ctl.reqtab[slot].notice_gen = SENDER_NOTICE_GEN_RING;
                return 0;
        }
        if (kind != SENDER_NOTICE_ABORT)
                s->ctl.reqtab[slot].notice_gen =
                    kvf_load_acquire(&s->ctl.roles[KVF_ROLE_CONNECTOR].generation);
        return 0;
}

#define ABORT_WAIT_NS 1000000000ull

/* Post what one slot owes, in order; stop at the first ring that is full. */
static void flush_slot(struct sender *s, uint32_t i)
{
        uint8_t *f = &s->flags[i];
        /* Copies of its still gathered or in flight: no notice, no completion before they
         * land (an abort notice lets the peer's engine reuse the blocks). Their news marks
         * it pending again. More of a backlog may go behind them (copies.c's room). */
        if (sender_copies_busy(s, i)) {
                if ((*f & SLOT_NEEDS_ADVANCE) && !(*f & (SLOT_ABORT_NOTICE | SLOT_NEEDS_COMPLETION)) &&
                    sender_copies_room(s, i)) {
                        *f &= (uint8_t)~SLOT_NEEDS_ADVANCE;
                        advance(s, i);
                }
                return;
        }
        int rc;
        if (*f & SLOT_ABORT_NOTICE) {
                /* Best effort: one that can never be posted is given up (the peer times out),
                 * and so is one whose ring stays full for ABORT_WAIT_NS: a decode side that
                 * reads no notices (its engine not reading its arrivals) must not hold the
                 * completion our engine waits for. */
                if ((rc = post_notice(s, i, SENDER_NOTICE_ABORT)) < 0 && sender_post_again(rc)) {
                        uint64_t now = kvf_now_ns();
                        if (!s->abort_since[i])
                                s->abort_since[i] = now;
                        /* (a stopping sender's last phase waits for no ring: its completion) */
                        if (now - s->abort_since[i] < ABORT_WAIT_NS && s->stop.phase != SENDER_STOP_LAST)
                                return;
                        rc = kvf_err_set(rc, "no room for it in %llu ms: given up (the peer "
                                             "frees the blocks at its own timeout)",
                                         (unsigned long long)(ABORT_WAIT_NS / 1000000));
                }
                s->abort_since[i] = 0;
                if (rc < 0) {
                        kvf_count(&s->ctl, KVF_CTR_NOTICES_FAILED, 1);
                        kvf_errlog(&s->ctl, KVF_ROLE_SENDER, "req %s: abort notice: %s",
                                   s->ctl.reqtab[i].request_id, kvf_err_msg());
                }
                *f &= (uint8_t)~SLOT_ABORT_NOTICE;
        }
        if (*f & SLOT_NEEDS_COMPLETION) {
                if (sender_post_completion(s, i) == 0)
                        free_slot(s, i);
                return;
        }
        if (*f & SLOT_NEEDS_OPEN) {
                if ((rc = sender_post_open(s, i)) < 0) {
                        post_failed(s, i, rc);
                        return;
                }
                *f &= (uint8_t)~SLOT_NEEDS_OPEN;
        }
        if (*f & SLOT_RESEND) {
                if ((rc = sender_resend(s, i)) < 0) {
                        post_failed(s, i, rc);
                        return;
                }
                *f &= (uint8_t)~SLOT_RESEND;
        }
        if (*f & SLOT_NEEDS_ADVANCE) {
                *f &= (uint8_t)~SLOT_NEEDS_ADVANCE;
                advance(s, i); /* sets the flag again if the ring is still full */
                if (*f & SLOT_NEEDS_ADVANCE)
                        return;
        }
        if (*f & SLOT_NEEDS_NOTICE) {
                rc = post_notice(s, i,
                                 s->ctl.reqtab[i].withdraw_ns ? SENDER_NOTICE_WITHDRAW
                                                              : SENDER_NOTICE_FINISH);
                if (rc == 0) {
                        *f &= (uint8_t)~SLOT_NEEDS_NOTICE;
                } else if (!post_failed(s, i, rc)) {
                        /* (one that can never be posted decides it) */
                        kvf_count(&s->ctl, KVF_CTR_NOTICES_FAILED, 1);
                }
        }
}

/* flush_slot for a slot with flags; true if some are still left. */
static bool flush_flagged(struct sender *s, uint32_t i)
{
        if (!s->flags[i])
                return false;
        flush_slot(s, i);
        return s->flags[i] != 0;
}

void sender_flush_pending(struct sender *s)
{
        uint32_t n = s->ctl.hdr->reqtab_slots;
        bool left = false;
        s->pending = false;
        for (uint32_t i = 0; i < n; i++)
                left |= flush_flagged(s, i);
        s->pending |= left;
}

void sender_flush_slots(struct sender *s, const uint32_t *slots, uint32_t n)
{
        for (uint32_t k = 0; k < n; k++)
                s->pending |= flush_flagged(s, slots[k]);
}

/*
 * LANDED or HANDED past its deadline: its notice may have reached the peer, which may have
 * published the arrival. Never decide alone while the peer may still answer: withdraw the
 * notice (the peer then says what it did, from its journal), and decide on that answer. Only
 * a notice that never went to a connector, or a peer silent for a whole second timeout,
 * ends the request here.
 */
static void noticed_timeout(struct sender *s, uint32_t i, uint64_t now)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[i];
        unsigned long long ms = s->request_timeout_ns / 1000000;
        uint64_t w = s->progress;
        char why[KVF_REASON_MAX];
        if (!r->notice_gen) {
                snprintf(
                    why, sizeof(why),
                    "timed out after %llu ms before the finish notice could reach the connector "
                    "(%u of %u blocks written, step %llu layer %u)",
                    ms, r->sent_full, r->n_send, (unsigned long long)KVF_PROGRESS_STEP(w),
                    KVF_PROGRESS_LAYERS(w));
                kvf_count(&s->ctl, KVF_CTR_NOTICES_FAILED, 1); /* never delivered */
                decide(s, i, KVF_STATUS_TIMEOUT, why);
                return;
        }
        if (!r->withdraw_ns) {
                r->withdraw_ns = now;
                mark(s, i, SLOT_NEEDS_NOTICE); /* posted as a withdrawal (flush_slot) */
                kvf_warn(
                    "req %s: no confirmation from peer '%s' after %llu ms: asking it what it did",
                    r->request_id, r->peer, ms);
                return;
        }
        if (now - r->withdraw_ns > s->request_timeout_ns) {
                snprintf(why, sizeof(why),
                         "timed out after %llu ms: the peer never confirmed or denied the arrival "
                         "(in doubt: it may have published it)",
                         2 * ms);
                kvf_count(&s->ctl, KVF_CTR_NOTICES_FAILED, 1); /* its answer never came */
                decide(s, i, KVF_STATUS_TIMEOUT, why);
        }
}

/*
 * Stopping, the drain window over (SENDER_EV_STOP_WINDOW). A request still moving (or landing:
 * its copies out) ends now, 'connection error', its peer told with an abort notice; both wait
 * for its copies in flight (flush_slot), as for any failure. A notice that never reached a
 * connector or the peer's ring cannot have been published: the request ends the same way. A
 * notice out is withdrawn, as at a deadline (noticed_timeout): only the peer's answer decides,
 * so both sides agree. One withdrawn at its deadline before the stop waits for its answer.
 */
static void stop_window(struct sender *s, uint32_t i)
{
        struct sender_stop *t = &s->stop;
        struct kvf_req_slot *r = &s->ctl.reqtab[i];
        enum sender_req_state st = sender_req_state(s, i);
        unsigned long long ms = t->drain_ns / 1000000;
        uint64_t w = s->progress;
        char why[KVF_REASON_MAX];
        if (st == SREQ_LANDING) {
                snprintf(why, sizeof(why), "%s: its last copies had not landed at the end of its %llu ms drain window",
                         t->why, ms);
        } else if (st == SREQ_MOVING) {
                snprintf(why, sizeof(why),
                         "%s: still moving at the end of its %llu ms drain window (%u of %u blocks sent for every "
                         "layer; progress is at step %llu layer %u)",
                         t->why, ms, r->sent_full, r->n_send, (unsigned long long)KVF_PROGRESS_STEP(w),
                         KVF_PROGRESS_LAYERS(w));
        } else if (noticed_state(st) && !r->notice_gen) {
                snprintf(why, sizeof(why),
                         "%s: every byte had %s, but the finish notice had not reached the connector at the end of "
                         "its %llu ms drain window",
                         t->why, st == SREQ_LANDED ? "landed" : "been handed to the connector", ms);
                kvf_count(&s->ctl, KVF_CTR_NOTICES_FAILED, 1); /* never delivered */
        } else {
                if (noticed_state(st) && !r->withdraw_ns) {
                        r->withdraw_ns = t->window_end; /* (sender_stop_withdrawn) */
                        mark(s, i, SLOT_NEEDS_NOTICE);  /* posted as a withdrawal (flush_slot) */
                        t->withdrawn++;
                }
                return;
        }
        decide(s, i, KVF_STATUS_CONNECTION, why);
        t->ended++;
}

/* Stopping, SENDER_STOP_ANSWER_NS after the window (SENDER_EV_STOP_ANSWERS): a withdrawal the peer
 * has not answered leaves its request in doubt, as a deadline's second timeout does. */
static void stop_answers(struct sender *s, uint32_t i)
{
        char why[KVF_REASON_MAX];
        if (!noticed_state(sender_req_state(s, i)) || !s->ctl.reqtab[i].withdraw_ns)
                return;
        snprintf(why, sizeof(why),
                 "%s: the peer had not answered the withdrawal of the finish notice %llu ms after the drain "
                 "window (in doubt: it may have published the arrival)",
                 s->stop.why, (unsigned long long)(SENDER_STOP_ANSWER_NS / 1000000));
        kvf_count(&s->ctl, KVF_CTR_NOTICES_FAILED, 1); /* its answer never came */
        decide(s, i, KVF_STATUS_TIMEOUT, why);
        s->stop.doubt++;
}

/* The request's destination blocks are booked while it lives (tasks.c refuses another request
 * into them). Without memory for that it goes on unbooked: the check is there for an engine's
 * mistake, never a reason to fail a good request. */
static void book(struct sender *s, uint32_t slot)
{
        if (sender_book_add(s, slot) < 0)
                kvf_warn(
                    "req %s: %s: its destination blocks are not checked against other requests'",
                    s->ctl.reqtab[slot].request_id, kvf_err_msg());
}

/* A restarted sender found the slot in the table: take it over (shared state in `st`). */
static void adopt_slot(struct sender *s, uint32_t i)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[i];
        struct kvf_ring *ring = &s->ctl.rings[KVF_RING_SENDER_TO_ENGINE];
        enum sender_req_state st = sender_req_state(s, i);
        char why[KVF_REASON_MAX];

        if (st != SREQ_DECIDED && r->transport == KVF_TRANSPORT_IPC &&
            sender_peer_get(s, r->peer, &r->peer_idx, why, sizeof(why)) < 0) {
                decide(s, i, KVF_STATUS_CONNECTION, why);
                return;
        }
        /* Copies of its were gathered, submitted or in flight when the sender died: whether
         * they ran is unknown (a batch not yet flushed never ran, a kernel may have gone with
         * the dead sender's context), while its progress says they did. It cannot be
         * reported finished. */
        if ((r->flags & KVF_REQF_COPY_PENDING) && st != SREQ_DECIDED) {
                r->flags &= ~KVF_REQF_COPY_PENDING;
                decide(s, i, KVF_STATUS_WRITE,
                       "the sender restarted while a copy of this request was being made");
                return;
        }
        switch (st) {
        case SREQ_MOVING:
                /* What we handed the connector may be lost with us: hand it again. */
                if (r->transport != KVF_TRANSPORT_IPC)
                        redo_network(s, i);
                advance(s, i);
                break;
        case SREQ_LANDED:
        case SREQ_HANDED:
                /* The notice may be lost with us; the peer de-duplicates. */
                if (r->transport != KVF_TRANSPORT_IPC)
                        redo_network(s, i);
                mark(s, i, SLOT_NEEDS_NOTICE);
                kvf_count(&s->ctl, KVF_CTR_NOTICES_REISSUED, 1);
                break;
        case SREQ_DECIDED:
                if (r->completion_pos != ~0ull && kvf_ring_delivered(ring, r->completion_pos))
                        free_slot(s, i);
                else
                        mark(s, i, SLOT_NEEDS_COMPLETION);
                break;
        default:
                break;
        }
}

void sender_req_event(struct sender *s, uint32_t slot, const struct sender_ev *ev)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        enum sender_req_state st = sender_req_state(s, slot);

        switch (ev->type) {
        case SENDER_EV_ACCEPTED: {
                if (st != SREQ_FREE)
                        return;
                set_state(s, slot, SREQ_MOVING); /* the slot is complete before it is seen active */
                sender_map_insert(s, slot);
                book(s, slot);
                kvf_count(&s->ctl, KVF_CTR_TASKS_ACCEPTED, 1);
                int rc;
                if (r->transport != KVF_TRANSPORT_IPC && (rc = sender_post_open(s, slot)) < 0) {
                        if (!post_failed(s, slot, rc))
                                return; /* failed: its completion says why */
                        mark(s, slot, SLOT_NEEDS_OPEN);
                }
                /* Its layers may be done already (task after layer-done): move them now. */
                advance(s, slot);
                return;
        }
        case SENDER_EV_LAYERS:
                advance(s, slot);
                return;
        case SENDER_EV_COPIES:
                if (ev->status != KVF_STATUS_FINISHED)
                        decide(s, slot, ev->status, ev->reason); /* its bytes are undefined */
                if (sender_copies_busy(s, slot))
                        return; /* more of its copies still to land */
                if (s->flags[slot])
                        s->pending = true; /* what flush_slot held back for the copies */
                if (sender_req_state(s, slot) == SREQ_LANDING)
                        to_notice(s, slot); /* its last bytes have landed */
                return;
        case SENDER_EV_WRITE_RESULT: {
                /* Finished only once every byte has left us (LANDED, HANDED); an error (a
                 * network transfer that failed early) ends a moving one too. */
                if (!noticed_state(st) && !(moving_state(st) && ev->status != KVF_STATUS_FINISHED))
                        return;
                const char *why = ev->status == KVF_STATUS_FINISHED ? ""
                                  : ev->reason && ev->reason[0]     ? ev->reason
                                                                    : "the connector gave no reason";
                char both[KVF_REASON_MAX];
                /* Withdrawn by the stop and not published as finished by the peer: the peer's
                 * answer is the outcome (its status too), and the stop is why it came to that.
                 * A peer that publishes our withdrawal answers with its reason, the stop's. */
                if (noticed_state(st) && ev->status != KVF_STATUS_FINISHED && sender_stop_withdrawn(s, r)) {
                        snprintf(both, sizeof(both),
                                 "%s: its finish notice was withdrawn, unanswered at the end of the %llu ms drain "
                                 "window; %s%s",
                                 s->stop.why, (unsigned long long)(s->stop.drain_ns / 1000000),
                                 strcmp(why, s->stop.why) ? "the peer's answer: " : "",
                                 strcmp(why, s->stop.why) ? why
                                                          : "the peer had not published the arrival, and publishes "
                                                            "this failure");
                        why = both;
                }
                decide(s, slot, ev->status, why);
                return;
        }
        case SENDER_EV_CANCEL:
                /* LANDED, HANDED: the notice commits it; the completion says what the peer did. */
                if (moving_state(st))
                        decide(s, slot, KVF_STATUS_CANCELLED, "cancelled by the engine");
                return;
        case SENDER_EV_FAIL:
                decide(s, slot, ev->status, ev->reason);
                return;
        case SENDER_EV_ENGINE_GONE:
                /* LANDED, HANDED: every byte left us from layers its own engine published. */
                if (moving_state(st))
                        decide(s, slot, KVF_STATUS_ENGINE_GONE, ev->reason);
                return;
        case SENDER_EV_TIMEOUT:
                if (moving_state(st)) {
                        char why[KVF_REASON_MAX];
                        uint64_t w = s->progress;
                        snprintf(why, sizeof(why),
                                 "timed out after %llu ms: %u of %u blocks sent for every layer; "
                                 "progress is at step %llu layer %u",
                                 (unsigned long long)(s->request_timeout_ns / 1000000),
                                 r->sent_full, r->n_send, (unsigned long long)KVF_PROGRESS_STEP(w),
                                 KVF_PROGRESS_LAYERS(w));
                        decide(s, slot, KVF_STATUS_TIMEOUT, why);
                } else if (noticed_state(st)) {
                        noticed_timeout(s, slot, ev->now);
                }
                return;
        case SENDER_EV_CONNECTOR_NEW: {
                /* A connector restart loses what it held: notices, and for network transfers
                 * every block not yet acknowledged. Hand them over again. */
                uint64_t cgen = kvf_load_acquire(&s->ctl.roles[KVF_ROLE_CONNECTOR].generation);
                if (!live_state(st))
                        return;
                if (connector_restarted(s, cgen) && r->transport != KVF_TRANSPORT_IPC) {
                        redo_network(s, slot);
                        kvf_count(&s->ctl, KVF_CTR_NOTICES_REISSUED, 1);
                } else if (noticed_state(st) && r->notice_gen && r->notice_gen != cgen &&
                           r->notice_gen != SENDER_NOTICE_GEN_RING &&
                           !(s->flags[slot] & SLOT_NEEDS_NOTICE)) {
                        mark(s, slot, SLOT_NEEDS_NOTICE);
                        kvf_count(&s->ctl, KVF_CTR_NOTICES_REISSUED, 1);
                }
                return;
        }
        case SENDER_EV_RETRY:
                flush_flagged(s, slot);
                return;
        case SENDER_EV_ADOPT:
                adopt_slot(s, slot);
                return;
        case SENDER_EV_STOP_WINDOW:
                if (live_state(st))
                        stop_window(s, slot);
                return;
        case SENDER_EV_STOP_ANSWERS:
                stop_answers(s, slot);
                return;
        case SENDER_EV_COUNT:
                break;
        }
}

/* ---- what the slots hear from below: copies, progress, sessions, peers ---- */

void sender_req_copies(struct sender *s, bool flush)
{
        uint32_t slot;
        bool failed;
        char why[KVF_REASON_MAX];
        if (flush)
                sender_copies_flush(s);
        else
                sender_copies_poll(s);
        while (sender_copies_news(s, &slot, &failed, why, sizeof(why)))
                sender_req_event(
                    s, slot,
                    &(struct sender_ev){.type = SENDER_EV_COPIES,
                                        .status = failed ? KVF_STATUS_WRITE : KVF_STATUS_FINISHED,
                                        .reason = failed ? why : NULL});
}

/* This word (the step's last layer) completes the request: its front mark is its last one,
 * covering every block, and it is of this step. */
static bool finishes_now(const struct sender *s, uint32_t slot, uint64_t step)
{
        if (sender_req_state(s, slot) != SREQ_MOVING)
                return false;
        const struct kvf_chunk_mark *m = sender_last_mark(&s->ctl.reqtab[slot]);
        return m && m->step == step;
}

void sender_req_progress(struct sender *s, uint64_t word, uint64_t publish_ns)
{
        static const struct sender_ev layers_ready = {.type = SENDER_EV_LAYERS};
        s->progress = word;
        s->progress_ns = publish_ns;
        uint32_t at = (s->words_at + s->nwords) % SENDER_WORDS_SEEN;
        s->words[at] = word;
        s->words_ns[at] = publish_ns;
        if (s->nwords < SENDER_WORDS_SEEN)
                s->nwords++;
        else
                s->words_at = (s->words_at + 1) % SENDER_WORDS_SEEN;
        s->copy_timed = false;
        s->own_left = s->own_batches;
        uint64_t step = KVF_PROGRESS_STEP(word);

        /* Requests armed at earlier steps: all their layers are ready; each advances once
         * here (buckets move while we work, so from a list taken first). One whose backlog is
         * left re-arms at the same step and goes on from flush_pending in the next turns, a
         * slice at a time as sender_advance cuts it, not all of it into this word's batch. */
        uint32_t nold = 0;
        for (uint32_t bi = 0; bi < s->nbuckets && s->buckets[bi].step < step; bi++)
                for (uint32_t k = 0; k < s->buckets[bi].n; k++)
                        s->tmp[nold++] = s->buckets[bi].slots[k];
        for (uint32_t k = 0; k < nold; k++) {
                uint32_t slot = s->tmp[k];
                if (s->armed[slot] >= step)
                        continue; /* (re-armed since: at this step or later) */
                sender_disarm(s, slot);
                sender_req_event(s, slot, &layers_ready);
        }
        /* This step's bucket, after any still left at an earlier step (those go on from
         * flush_pending): its requests advance but may stay in it. */
        uint32_t bi = 0;
        while (bi < s->nbuckets && s->buckets[bi].step < step)
                bi++;
        if (bi < s->nbuckets && s->buckets[bi].step == step) {
                struct bucket *b = &s->buckets[bi];
                uint32_t n = b->n, nf = 0;
                memcpy(s->tmp, b->slots, n * sizeof(uint32_t));
                /* The step's last layer: the requests it completes go first, as a batch of
                 * their own, and their finish notices go out before the others' copies (a
                 * chunked step ends one request and starts the next: the ended one's tail
                 * must not wait for the next one's first chunk). */
                if (KVF_PROGRESS_LAYERS(word) >= s->layers)
                        for (uint32_t k = 0; k < n; k++)
                                if (finishes_now(s, s->tmp[k], step)) {
                                        uint32_t t = s->tmp[nf];
                                        s->tmp[nf++] = s->tmp[k];
                                        s->tmp[k] = t;
                                }
                for (uint32_t k = 0; k < n; k++) {
                        sender_req_event(s, s->tmp[k], &layers_ready);
                        if (k + 1 == nf && nf < n) {
                                sender_req_copies(s, true);
                                sender_flush_slots(s, s->tmp, nf);
                        }
                }
        }
        sender_req_copies(s, true); /* the layer's copies of every request: one batch */
        /* Finish notices before new tasks: a request whose last layer was just copied waits
         * for its notice, a new task's first layer is a layer's compute away (kvf-sim
         * measured the notice behind the next step's task: 40 to 100 us later). */
        if (s->pending)
                sender_flush_pending(s);
}

void sender_sessions_check(struct sender *s, bool check_process)
{
        uint64_t live = sender_session_live(s, check_process);
        if (live == s->session)
                return;
        uint64_t old = s->session;
        char why[KVF_REASON_MAX], reason[KVF_REASON_MAX];
        uint32_t ended = 0, n = s->ctl.hdr->reqtab_slots;
        for (uint32_t i = 0; i < n; i++) {
                struct kvf_req_slot *r = &s->ctl.reqtab[i];
                if (sender_req_state(s, i) == SREQ_FREE || r->session == live)
                        continue;
                /* Its id is free for the new session (a restarted engine submits it again);
                 * write results still find the slot by its key. */
                sender_map_remove(s, i);
                if (!moving_state(sender_req_state(s, i)))
                        continue;
                if (!ended)
                        sender_session_why_ended(s, r->session, live, why, sizeof(why));
                snprintf(reason, sizeof(reason), "%s before the transfer finished", why);
                sender_req_event(
                    s, i, &(struct sender_ev){.type = SENDER_EV_ENGINE_GONE, .reason = reason});
                ended++;
        }
        if (old && old != SENDER_SESSION_UNKNOWN)
                kvf_count(&s->ctl, KVF_CTR_SESSIONS_ENDED, 1);
        if (old == SENDER_SESSION_UNKNOWN)
                old = 0; /* (a sender starting: the log says 0 -> live) */
        if (old || ended)
                kvf_info("engine session %llu -> %llu: %u requests of earlier sessions end with "
                         "'engine gone'",
                         (unsigned long long)old, (unsigned long long)live, ended);
        s->session = live;
        /* Release: the requests above are decided before the new engine's attach (which
         * waits for this) goes on. Their completions follow as the ring allows, tagged with
         * their own session. */
        if (live)
                kvf_store_release(&s->ctl.sender->engine_session_ack, live);
}

/* Same-host peers: an ended engine session there, or a segment gone or replaced, fails the
 * requests still moving to it. */
static void check_peers(struct sender *s)
{
        uint32_t n = s->ctl.hdr->reqtab_slots;
        for (uint32_t i = 0; i < SENDER_MAX_PEERS; i++) {
                uint64_t live = 0;
                int rc = sender_peer_check(s, i, &live);
                if (rc == 0)
                        continue;
                const char *name = s->peers[i].name;
                if (rc > 0) {
                        /* The peer's engine: a session that ended frees the blocks it reserved. */
                        for (uint32_t k = 0; k < n; k++) {
                                struct kvf_req_slot *r = &s->ctl.reqtab[k];
                                if (moving_state(sender_req_state(s, k)) && r->peer_idx == i &&
                                    r->transport == KVF_TRANSPORT_IPC && r->peer_session &&
                                    r->peer_session != live)
                                        sender_fail(
                                            s, k, KVF_STATUS_ENGINE_GONE,
                                            "the engine session %llu of peer '%s' ended during the "
                                            "transfer: its blocks are no longer reserved",
                                            (unsigned long long)r->peer_session, name);
                        }
                        continue;
                }
                if (rc == -ESRCH)
                        kvf_warn("peer '%s': none of its roles runs any more (killed, its supervisor too): "
                                 "dropping its mapping", name);
                else
                        kvf_warn("peer '%s' went away or was restarted: dropping its mapping", name);
                sender_copies_drain(s, kvf_ms(1000)); /* never unmap under a copy in flight */
                sender_req_copies(s, false);
                for (uint32_t k = 0; k < n; k++) {
                        struct kvf_req_slot *r = &s->ctl.reqtab[k];
                        if (moving_state(sender_req_state(s, k)) && r->peer_idx == i &&
                            r->transport == KVF_TRANSPORT_IPC)
                                sender_fail(s, k, KVF_STATUS_CONNECTION,
                                            rc == -ESRCH ? "peer instance '%s' stopped running during the "
                                                           "transfer (none of its roles is alive)"
                                                         : "peer instance '%s' went away or was restarted during "
                                                           "the transfer",
                                            name);
                        /* Its notice is in the notice ring of a segment nobody reads any more:
                         * no answer comes, and the re-created instance (another incarnation)
                         * never publishes an arrival for blocks of its predecessor's cache. */
                        else if (r->peer_idx == i && r->transport == KVF_TRANSPORT_IPC &&
                                 noticed_state(sender_req_state(s, k)) &&
                                 r->notice_gen == SENDER_NOTICE_GEN_RING) {
                                char why[KVF_REASON_MAX];
                                snprintf(why, sizeof(why),
                                         "peer instance '%s' went away or was restarted before it answered "
                                         "the finish notice: the blocks went into its previous cache",
                                         name);
                                kvf_count(&s->ctl, KVF_CTR_NOTICES_FAILED, 1); /* no answer comes */
                                decide(s, k, KVF_STATUS_CONNECTION, why);
                        }
                }
                sender_peer_drop(s, i);
        }
}

void sender_adopt(struct sender *s)
{
        uint32_t n = s->ctl.hdr->reqtab_slots, adopted = 0;
        uint8_t *lost = calloc(n, 1);

        /* The shared state says where each request was; the in-process split follows. */
        for (uint32_t i = 0; i < n; i++) {
                uint32_t st = kvf_load_acquire(&s->ctl.reqtab[i].state);
                s->rq[i] = st == KVF_REQ_FREE          ? SREQ_FREE
                           : st == KVF_REQ_FINISHING   ? SREQ_LANDED
                           : st == KVF_REQ_HANDED_OVER ? SREQ_HANDED
                           : st == KVF_REQ_COMPLETING  ? SREQ_DECIDED
                                                       : SREQ_MOVING;
        }
        /* The engine executor's entries: closed; what the engine claimed is waited for. */
        sender_plan_adopt_all(s, lost);
        for (uint32_t i = 0; i < n; i++) {
                struct kvf_req_slot *r = &s->ctl.reqtab[i];
                uint32_t st = kvf_load_acquire(&r->state);
                if (st == KVF_REQ_FREE)
                        continue;
                adopted++;
                sender_map_insert(s, i);
                r->peer_idx = UINT32_MAX;
                /* The bookings of the requests still moving are rebuilt from the table (the
                 * blocks of one whose notice is owed or out are free already: to_notice). */
                if (moving_state(sender_req_state(s, i)))
                        book(s, i);
                if (st > KVF_REQ_HANDED_OVER) {
                        decide(s, i, KVF_STATUS_WRITE, "request slot in an unknown state");
                        continue;
                }
                if (lost && lost[i]) {
                        decide(s, i, KVF_STATUS_WRITE,
                               "out of memory to track the engine's copies");
                        continue;
                }
                sender_req_event(s, i, &(struct sender_ev){.type = SENDER_EV_ADOPT});
        }
        free(lost);
        if (adopted) {
                kvf_count(&s->ctl, KVF_CTR_REQUESTS_ADOPTED, adopted);
                kvf_info("adopted %u requests from the table", adopted);
        }
        /* Requests of an engine session that ended while no sender ran end now. */
        s->session = SENDER_SESSION_UNKNOWN;
        sender_sessions_check(s, true);
}

void sender_tick(struct sender *s, uint64_t now)
{
        uint32_t n = s->ctl.hdr->reqtab_slots;
        uint64_t cgen = kvf_load_acquire(&s->ctl.roles[KVF_ROLE_CONNECTOR].generation);

        kvf_role_heartbeat(&s->ctl, KVF_ROLE_SENDER);
        sender_sessions_check(s, true);
        kvf_log_flush(); /* suppressed lines, once their window is over */
        check_peers(s);
        sender_caches_tick(s);
        for (uint32_t i = 0; i < n; i++) {
                struct kvf_req_slot *r = &s->ctl.reqtab[i];
                enum sender_req_state st = sender_req_state(s, i);
                if (!live_state(st))
                        continue;
                if (now > r->deadline_ns) {
                        sender_req_event(
                            s, i, &(struct sender_ev){.type = SENDER_EV_TIMEOUT, .now = now});
                        if (!noticed_state(sender_req_state(s, i)))
                                continue;
                }
                if ((connector_restarted(s, cgen) && r->transport != KVF_TRANSPORT_IPC) ||
                    (noticed_state(st) && r->notice_gen && r->notice_gen != cgen &&
                     r->notice_gen != SENDER_NOTICE_GEN_RING))
                        sender_req_event(s, i,
                                         &(struct sender_ev){.type = SENDER_EV_CONNECTOR_NEW});
        }
        s->connector_gen = cgen;
}

/* ---- stopping (SIGTERM, SIGINT: sender.h, struct sender_stop) ---- */

void sender_stop_begin(struct sender *s, uint64_t now, uint64_t drain_ns, const char *why)
{
        struct sender_stop *t = &s->stop;
        if (t->at)
                return;
        uint32_t n = s->ctl.hdr->reqtab_slots;
        t->at = now ? now : 1;
        t->drain_ns = drain_ns;
        t->window_end = t->at + drain_ns;
        t->answers_end = t->window_end + SENDER_STOP_ANSWER_NS;
        t->end = t->window_end + SENDER_STOP_LAST_NS;
        t->phase = SENDER_STOP_DRAIN;
        snprintf(t->why, sizeof(t->why), "%s", why);
        for (uint32_t i = 0; i < n; i++)
                t->in_flight += sender_req_state(s, i) != SREQ_FREE;
        if (t->in_flight)
                kvf_info("stopping: %u requests in flight get up to %llu ms to finish (--stop-drain-ms); "
                         "new tasks are refused ('connection error': %s)",
                         t->in_flight, (unsigned long long)(drain_ns / 1000000), t->why);
}

/* Every request in the table hears of the stop's next phase. */
static void stop_event(struct sender *s, enum sender_ev_type type)
{
        uint32_t n = s->ctl.hdr->reqtab_slots;
        for (uint32_t i = 0; i < n; i++)
                if (sender_req_state(s, i) != SREQ_FREE)
                        sender_req_event(s, i, &(struct sender_ev){.type = type});
        if (s->pending)
                sender_flush_pending(s);
}

bool sender_stop_step(struct sender *s, uint64_t now)
{
        struct sender_stop *t = &s->stop;
        if (!t->at)
                return false;
        if (t->phase == SENDER_STOP_DRAIN && now >= t->window_end) {
                t->phase = SENDER_STOP_ANSWERS;
                stop_event(s, SENDER_EV_STOP_WINDOW);
                if (t->ended || t->withdrawn)
                        kvf_info("stopping: the %llu ms drain window is over: %u requests ended ('connection "
                                 "error'), %u finish notices withdrawn (the peer's answer decides)",
                                 (unsigned long long)(t->drain_ns / 1000000), t->ended, t->withdrawn);
        }
        if (t->phase == SENDER_STOP_ANSWERS && now >= t->answers_end) {
                t->phase = SENDER_STOP_LAST;
                stop_event(s, SENDER_EV_STOP_ANSWERS);
        }
        if (now >= t->end)
                return true;
        if (s->cp.flight || s->cp.nowes)
                return false;
        uint32_t n = s->ctl.hdr->reqtab_slots;
        for (uint32_t i = 0; i < n; i++)
                if (sender_req_state(s, i) != SREQ_FREE)
                        return false;
        return true;
}

uint64_t sender_stop_due(const struct sender *s)
{
        const struct sender_stop *t = &s->stop;
        return t->phase == SENDER_STOP_DRAIN     ? t->window_end
               : t->phase == SENDER_STOP_ANSWERS ? t->answers_end
                                                 : t->end;
}

void sender_stop_report(struct sender *s, uint64_t now)
{
        const struct sender_stop *t = &s->stop;
        if (!t->at)
                return;
        uint32_t n = s->ctl.hdr->reqtab_slots, left = 0, copying = 0;
        for (uint32_t i = 0; i < n; i++)
                if (sender_req_state(s, i) != SREQ_FREE) {
                        left++;
                        copying += sender_copies_busy(s, i);
                }
        char tail[160];
        if (!left)
                snprintf(tail, sizeof(tail), "every request has had its completion");
        else
                snprintf(tail, sizeof(tail),
                         "%u requests left without a completion (%u with copies still in flight, the rest: the "
                         "engine's ring full)",
                         left, copying);
        kvf_log(left ? KVF_LOG_WARN : KVF_LOG_INFO,
                "stopped in %llu ms: of %u requests in flight, %u finished and %u failed (%u ended at the end of "
                "the %llu ms drain window, %u finish notices withdrawn then, %u requests in doubt); %u new tasks "
                "refused; %s",
                (unsigned long long)((now - t->at) / 1000000), t->in_flight, t->finished, t->failed, t->ended,
                (unsigned long long)(t->drain_ns / 1000000), t->withdrawn, t->doubt, t->refused, tail);
}
