/*
 * Tasks in, completions out.
 *
 * Exactly one completion per request, across sender crashes:
 *  - a task record is consumed one at a time, so at most one is re-read
 *    after a crash; an accepted task is recognised by its ring position
 *    (slot.task_pos), a rejected one by the sender area's reject_task_pos;
 *  - a decided request is COMPLETING; its completion's ring position is
 *    stored before the record is committed, and kvf_ring_delivered() tells a
 *    successor whether that record made it.
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

static void count_status(struct sender *s, int status)
{
        static const enum kvf_counter_id by_status[KVF_STATUS_COUNT] = {
                [KVF_STATUS_FINISHED] = KVF_CTR_REQUESTS_FINISHED,
                [KVF_STATUS_BAD_TASK] = KVF_CTR_FAILED_BAD_TASK,
                [KVF_STATUS_BLOCK_RANGE] = KVF_CTR_FAILED_BLOCK_RANGE,
                [KVF_STATUS_UNKNOWN_PEER] = KVF_CTR_FAILED_UNKNOWN_PEER,
                [KVF_STATUS_CONNECTION] = KVF_CTR_FAILED_CONNECTION,
                [KVF_STATUS_LAYOUT_MISMATCH] = KVF_CTR_FAILED_LAYOUT,
                [KVF_STATUS_CANCELLED] = KVF_CTR_FAILED_CANCELLED,
                [KVF_STATUS_TIMEOUT] = KVF_CTR_FAILED_TIMEOUT,
                [KVF_STATUS_WRITE] = KVF_CTR_FAILED_WRITE,
                [KVF_STATUS_AUTH] = KVF_CTR_FAILED_AUTH,
                [KVF_STATUS_ENGINE_GONE] = KVF_CTR_FAILED_ENGINE_GONE,
                [KVF_STATUS_PEER_ROLE] = KVF_CTR_FAILED_PEER_ROLE,
        };
        if (status < 0 || status >= KVF_STATUS_COUNT)
                return;
        kvf_count(&s->ctl, by_status[status], 1);
        if (status != KVF_STATUS_FINISHED)
                kvf_count(&s->ctl, KVF_CTR_REQUESTS_FAILED, 1);
}

static void free_slot(struct sender *s, uint32_t slot)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        sender_disarm(s, slot);
        sender_map_remove(s, slot);
        s->flags[slot] = 0;
        s->engine_blocked = false; /* a task waiting for a slot can have this one */
        /* Release: everything about the old request is done before the slot
         * can be seen free (and reused). */
        kvf_store_release(&r->state, KVF_REQ_FREE);
}

/* Post the completion of a decided (COMPLETING) slot; -EAGAIN if the ring is full. */
static int post_completion(struct sender *s, uint32_t slot)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        struct kvf_ring *ring = &s->ctl.rings[KVF_RING_SENDER_TO_ENGINE];
        /* Finished means every byte landed, once: report that amount (copies
         * repeated after a restart are not counted twice). */
        uint64_t full = sender_request_bytes(s, r);
        struct kvf_record c = {.type = KVF_REC_COMPLETION, .status = (int)r->status,
                               .bytes = r->status == KVF_STATUS_FINISHED ? full : r->bytes,
                               .blocks = r->n_send,
                               .accept_ns = r->accept_ns, .last_layer_ns = r->last_layer_ns,
                               .done_ns = kvf_now_ns()};
        size_t len;
        void *p;
        uint64_t pos;

        memcpy(c.request_id, r->request_id, sizeof(c.request_id));
        memcpy(c.peer, r->peer, sizeof(c.peer));
        memcpy(c.reason, r->reason, sizeof(c.reason));
        c.session = r->session;
        c.id_bin = r->flags & KVF_REQF_ID_BIN;
        if (sender_encode(s, &c, &len) < 0 || kvf_ring_claim(ring, KVF_REC_COMPLETION, (uint32_t)len, &p, &pos) < 0)
                return -EAGAIN;
        /* Crash window: with the position stored first, a successor can ask
         * the ring whether this record was committed. */
        kvf_store_release(&r->completion_pos, pos);
        memcpy(p, s->scratch, len);
        kvf_ring_commit(ring, pos);
        count_status(s, (int)r->status);
        if (r->status == KVF_STATUS_FINISHED) {
                if (r->last_layer_ns && c.done_ns > r->last_layer_ns)
                        kvf_hist_add(&s->ctl.sender->hist[KVF_HIST_LAST_TO_DONE],
                                     c.done_ns - r->last_layer_ns);
                kvf_debug("req %s: finished, %llu bytes", r->request_id, (unsigned long long)r->bytes);
        } else {
                kvf_info("req %s: %s: %s", r->request_id, kvf_status_name((int)r->status), r->reason);
        }
        free_slot(s, slot);
        return 0;
}

/* Decide a request's status; the completion is posted now or when the ring has room. */
static void decide(struct sender *s, uint32_t slot, int status, const char *reason)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        if (r->state == KVF_REQ_FREE || r->state == KVF_REQ_COMPLETING)
                return;
        bool was_active = r->state == KVF_REQ_ACTIVE;
        /* FINISHING, its finish notice not yet posted (a failure the connector reported
         * first, say a transport it cannot use): the peer has heard of it no more than of
         * an active one. */
        bool unnoticed = r->state == KVF_REQ_FINISHING && !r->notice_gen;
        sender_plan_close(s, slot); /* the engine claims no more of it (its claims are awaited) */
        if (r->state == KVF_REQ_COMPLETING)
                return; /* (closing it reported the engine's failure: decided already) */
        r->status = (uint32_t)status;
        /* A failure always says why: an engine (and an operator) cannot act on a bare status. */
        if (status != KVF_STATUS_FINISHED && (!reason || !reason[0]))
                reason = "no reason was recorded";
        snprintf(r->reason, sizeof(r->reason), "%s", reason ? reason : "");
        r->completion_pos = ~0ull;
        sender_disarm(s, slot);
        kvf_store_release(&r->state, KVF_REQ_COMPLETING);
        s->flags[slot] = 0;
        sender_mark(s, slot, SLOT_NEEDS_COMPLETION);
        /* A request that fails while moving: tell the peer, so its engine can
         * free the blocks it reserved (best effort, not waited for). */
        if ((was_active || unnoticed) && status != KVF_STATUS_FINISHED &&
            (r->peer_idx != UINT32_MAX || r->transport != KVF_TRANSPORT_IPC))
                sender_mark(s, slot, SLOT_ABORT_NOTICE);
}

void sender_fail(struct sender *s, uint32_t slot, int status, const char *fmt, ...)
{
        char reason[KVF_REASON_MAX];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(reason, sizeof(reason), fmt, ap);
        va_end(ap);
        decide(s, slot, status, reason);
}

enum notice_kind {
        NOTICE_FINISH,   /* every byte is written: the peer publishes the arrival */
        NOTICE_ABORT,    /* the request failed while moving: the peer frees its blocks (best effort) */
        NOTICE_WITHDRAW, /* FINISHING past its deadline: the peer says what it did (outcome agreement) */
};

/* A notice for the connector to deliver to the peer. */
static int post_notice(struct sender *s, uint32_t slot, enum notice_kind kind)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        struct kvf_record f = {.type = KVF_RT_FINISH,
                               .key = sender_key(slot, r->incarnation),
                               .transport = (int)r->transport,
                               .status = kind == NOTICE_FINISH ? KVF_STATUS_FINISHED
                                         : kind == NOTICE_WITHDRAW ? KVF_STATUS_TIMEOUT
                                                                   : (int)r->status,
                               .bytes = r->bytes,
                               .blocks = r->n_send,
                               .dst = kvf_slot_blocks(&s->ctl, slot) + s->ctl.hdr->max_blocks,
                               .n_dst = r->n_send,
                               .session = r->peer_session,
                               .withdraw = kind == NOTICE_WITHDRAW,
                               .id_bin = r->flags & KVF_REQF_ID_BIN};

        memcpy(f.request_id, r->request_id, sizeof(f.request_id));
        memcpy(f.peer, r->peer, sizeof(f.peer));
        if (kind == NOTICE_ABORT)
                memcpy(f.reason, r->reason, sizeof(f.reason));
        else if (kind == NOTICE_WITHDRAW)
                snprintf(f.reason, sizeof(f.reason),
                         "timed out after %llu ms waiting for the peer to confirm the arrival",
                         (unsigned long long)(s->request_timeout_ns / 1000000));
        if (r->transport == KVF_TRANSPORT_IPC && r->peer_idx < SENDER_MAX_PEERS &&
            s->peers[r->peer_idx].in_use)
                f.generation = s->peers[r->peer_idx].created_ns;
        int rc = sender_post(s, &f);
        if (rc < 0)
                return rc;
        sender_copies_expected(s);
        if (kind != NOTICE_ABORT)
                r->notice_gen = kvf_load_acquire(&s->ctl.roles[KVF_ROLE_CONNECTOR].generation);
        return 0;
}

/* Post what one slot owes, in order; stop at the first ring that is full. */
static void flush_slot(struct sender *s, uint32_t i)
{
        uint8_t *f = &s->flags[i];
        /* Copies of its still gathered or in flight: no notice, no completion before they
         * land (an abort notice lets the peer's engine reuse the blocks). copies.c marks
         * pending again when they do. */
        if (sender_copies_busy(s, i))
                return;
        int rc;
        if (*f & SLOT_ABORT_NOTICE) {
                /* Best effort: one that can never be posted is given up (the peer times out). */
                if ((rc = post_notice(s, i, NOTICE_ABORT)) < 0 && (rc == -EAGAIN || rc == -ENOMEM))
                        return;
                if (rc < 0)
                        kvf_errlog(&s->ctl, KVF_ROLE_SENDER, "req %s: abort notice: %s",
                                   s->ctl.reqtab[i].request_id, kvf_err_msg());
                *f &= (uint8_t)~SLOT_ABORT_NOTICE;
        }
        if (*f & SLOT_NEEDS_COMPLETION) {
                post_completion(s, i); /* frees the slot and its flags */
                return;
        }
        if (*f & SLOT_NEEDS_OPEN) {
                if ((rc = sender_post_open(s, i)) < 0) {
                        sender_post_retry(s, i, rc);
                        return;
                }
                *f &= (uint8_t)~SLOT_NEEDS_OPEN;
        }
        if (*f & SLOT_RESEND) {
                if ((rc = sender_resend(s, i)) < 0) {
                        sender_post_retry(s, i, rc);
                        return;
                }
                *f &= (uint8_t)~SLOT_RESEND;
        }
        if (*f & SLOT_NEEDS_ADVANCE) {
                *f &= (uint8_t)~SLOT_NEEDS_ADVANCE;
                sender_advance(s, i); /* sets the flag again if the ring is still full */
                if (*f & SLOT_NEEDS_ADVANCE)
                        return;
        }
        if (*f & SLOT_NEEDS_NOTICE) {
                rc = post_notice(s, i, s->ctl.reqtab[i].withdraw_ns ? NOTICE_WITHDRAW : NOTICE_FINISH);
                if (rc == 0)
                        *f &= (uint8_t)~SLOT_NEEDS_NOTICE;
                else
                        sender_post_retry(s, i, rc); /* (a FINISHING request that fails is decided) */
        }
}

/*
 * A request whose last copy just landed owes only its finish notice: post it now, not on the
 * loop's next pass over pending slots (measured on the EPYC VM: that pass came 10 to 30 us
 * after the copy, at times 200 to 300 us, behind the engine ring's tasks and the connector
 * ring's results; now about 6 us). Anything else it owes first, or a full ring, is left to
 * sender_flush_pending.
 */
void sender_notice_now(struct sender *s, uint32_t slot)
{
        if (s->flags[slot] == SLOT_NEEDS_NOTICE)
                flush_slot(s, slot);
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

/* The connector lost what it held: a network request must be handed over again. */
static void redo_network(struct sender *s, uint32_t slot)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        s->resend[slot] = 0;
        sender_mark(s, slot, SLOT_NEEDS_OPEN | SLOT_RESEND);
        if (r->state == KVF_REQ_FINISHING)
                sender_mark(s, slot, SLOT_NEEDS_NOTICE);
}

/* ---- rejections: a completion for a task that never got a slot ---- */

/* What a rejection answers: the task's position, its request id (and how it came), its session. */
struct task_ref {
        uint64_t pos;
        const char *request_id;
        bool id_bin;
        uint64_t session;
};

static int reject(struct sender *s, const struct task_ref *t, const char *peer, int status,
                  const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static int reject(struct sender *s, const struct task_ref *t, const char *peer, int status,
                  const char *fmt, ...)
{
        struct kvf_sender_area *a = s->ctl.sender;
        struct kvf_ring *ring = &s->ctl.rings[KVF_RING_SENDER_TO_ENGINE];
        struct kvf_record c = {.type = KVF_REC_COMPLETION, .status = status, .done_ns = kvf_now_ns(),
                               .session = t->session, .id_bin = t->id_bin};
        uint64_t task_pos = t->pos;
        const char *request_id = t->request_id;
        va_list ap;
        size_t len;
        void *p;
        uint64_t pos;

        /* Re-read after a crash: was this rejection already delivered? */
        if (kvf_load_acquire(&a->reject_task_pos) == task_pos &&
            kvf_ring_delivered(ring, kvf_load_acquire(&a->reject_completion_pos)))
                return 0;
        snprintf(c.request_id, sizeof(c.request_id), "%s",
                 request_id && request_id[0] ? request_id : "<unknown>");
        snprintf(c.peer, sizeof(c.peer), "%s", peer ? peer : "");
        va_start(ap, fmt);
        vsnprintf(c.reason, sizeof(c.reason), fmt, ap);
        va_end(ap);
        if (sender_encode(s, &c, &len) < 0 || kvf_ring_claim(ring, KVF_REC_COMPLETION, (uint32_t)len, &p, &pos) < 0)
                return -EAGAIN; /* the task stays in its ring; retried later */
        kvf_store_release(&a->reject_completion_pos, pos);
        kvf_store_release(&a->reject_task_pos, task_pos);
        memcpy(p, s->scratch, len);
        kvf_ring_commit(ring, pos);
        kvf_count(&s->ctl, KVF_CTR_TASKS_REJECTED, 1);
        count_status(s, status);
        kvf_errlog(&s->ctl, KVF_ROLE_SENDER, "req %s: task rejected: %s: %s", c.request_id,
                   kvf_status_name(status), c.reason);
        return 0;
}

/* ---- tasks ---- */

/* The first of ids[0..n) (n <= max_blocks) that appeared earlier in the list; ids too large
 * for any cache are left to the range check. */
static bool has_duplicate(struct sender *s, const uint32_t *ids, uint32_t n, uint32_t *dup)
{
        uint32_t cap = 1;
        while (cap < 2 * n)
                cap <<= 1;
        uint32_t *set = s->idset, mask = cap - 1;
        bool found = false;
        for (uint32_t i = 0; i < n && !found; i++) {
                if (ids[i] >= UINT32_MAX / 2)
                        continue;
                uint32_t h = (ids[i] * 2654435761u) & mask;
                while (set[h] && set[h] != ids[i] + 1u)
                        h = (h + 1) & mask;
                if (set[h]) {
                        *dup = ids[i];
                        found = true;
                }
                set[h] = ids[i] + 1u;
        }
        memset(set, 0, cap * sizeof(*set));
        return found;
}

/* A status with its reason, for validate_task. */
static int verdict(char *why, size_t whylen, int status, const char *fmt, ...)
        __attribute__((format(printf, 4, 5)));
static int verdict(char *why, size_t whylen, int status, const char *fmt, ...)
{
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, whylen, fmt, ap);
        va_end(ap);
        return status;
}

/*
 * Can this task be accepted? KVF_STATUS_FINISHED if so (an ipc peer is then
 * open at *pidx), else the status it is rejected with and the reason in
 * `why`. Changes nothing but the peer's name when FastDeploy named it by its
 * device or address, and the sender's cache of peer mappings.
 */
static int validate_task(struct sender *s, struct kvf_record *t, uint32_t *pidx, char *why, size_t whylen)
{
        const struct kvf_ctl_header *h = s->ctl.hdr;
        uint32_t dup;

        if (h->instance_role == KVF_IROLE_DECODE)
                return verdict(why, whylen, KVF_STATUS_BAD_TASK,
                              "instance '%s' is a decode instance: it receives, it does not send",
                              h->instance);
        if (t->transport != KVF_TRANSPORT_IPC && t->transport != KVF_TRANSPORT_TCP &&
            t->transport != KVF_TRANSPORT_RDMA)
                return verdict(why, whylen, KVF_STATUS_BAD_TASK,
                              "transfer_protocol '%s' is not one of ipc, tcp and rdma",
                              kvf_transport_name(t->transport));
        if (t->n_src == 0)
                return verdict(why, whylen, KVF_STATUS_BAD_TASK, "src_block_ids is empty");
        if (t->n_dst == 0)
                return verdict(why, whylen, KVF_STATUS_BAD_TASK,
                              "dest_block_ids is empty: nothing to send");
        if (t->n_dst > t->n_src)
                return verdict(why, whylen, KVF_STATUS_BAD_TASK,
                              "dest_block_ids has %u entries, more than the %u of src_block_ids",
                              t->n_dst, t->n_src);
        if (t->n_src > h->max_blocks)
                return verdict(why, whylen, KVF_STATUS_BAD_TASK,
                              "src_block_ids has %u entries, more than this instance's limit of %u blocks per request",
                              t->n_src, h->max_blocks);
        for (uint32_t i = 0; i < t->n_src; i++)
                if (t->src[i] >= s->layout->num_blocks)
                        return verdict(why, whylen, KVF_STATUS_BLOCK_RANGE,
                                      "src_block_ids[%u] = %u is out of range: this instance has %u blocks",
                                      i, t->src[i], s->layout->num_blocks);
        if (has_duplicate(s, t->dst, t->n_dst, &dup))
                return verdict(why, whylen, KVF_STATUS_BAD_TASK,
                              "dest_block_ids names block %u twice", dup);
        if (t->transport == KVF_TRANSPORT_IPC) {
                /* FastDeploy names an ipc peer by its device, or by ip and port: find
                 * the same-host instance; then t->peer is its name. */
                int rc = sender_peer_resolve(s, t, why, whylen);
                if (rc == -ENOENT)
                        return KVF_STATUS_UNKNOWN_PEER; /* (why says it) */
                if (rc < 0)
                        return KVF_STATUS_BAD_TASK; /* (why says it) */
        }
        if (!strcmp(t->peer, h->instance))
                return verdict(why, whylen, KVF_STATUS_BAD_TASK,
                              "peer '%s' is this instance itself", t->peer);
        if (t->transport == KVF_TRANSPORT_IPC) {
                int rc = sender_peer_get(s, t->peer, pidx, why, whylen);
                if (rc == -ENOENT)
                        return KVF_STATUS_UNKNOWN_PEER; /* (why says it) */
                if (rc == -EXDEV)
                        return KVF_STATUS_LAYOUT_MISMATCH; /* (why says it) */
                if (rc == -EPERM)
                        return KVF_STATUS_PEER_ROLE; /* (why says it) */
                if (rc < 0)
                        return KVF_STATUS_CONNECTION; /* (why says it) */
                uint32_t peer_blocks = s->peers[*pidx].ctl.hdr->layout.num_blocks;
                for (uint32_t i = 0; i < t->n_dst; i++)
                        if (t->dst[i] >= peer_blocks)
                                return verdict(why, whylen, KVF_STATUS_BLOCK_RANGE,
                                              "dest_block_ids[%u] = %u is out of range: peer '%s' has %u blocks",
                                              i, t->dst[i], t->peer, peer_blocks);
        }
        /* tcp, rdma: the connector checks the peer (reachable, token, layout, block ids), and
         * fails the request with the reason when its build has no such transport. */
        return KVF_STATUS_FINISHED;
}

static int accept_task(struct sender *s, struct kvf_record *t, const struct task_ref *ref)
{
        const struct kvf_ctl_header *h = s->ctl.hdr;
        const char *id = t->request_id;
        uint64_t pos = ref->pos;
        uint32_t slot = sender_map_find(s, id), pidx = UINT32_MAX;
        char why[KVF_REASON_MAX];

        if (slot != UINT32_MAX && s->ctl.reqtab[slot].task_pos == pos)
                return 0; /* this very record, re-read after a restart: already accepted */
        if (ref->session != s->session)
                return reject(s, ref, t->peer, KVF_STATUS_ENGINE_GONE,
                              "engine session %llu ended before this task was read",
                              (unsigned long long)ref->session);
        if (slot != UINT32_MAX)
                return reject(s, ref, t->peer, KVF_STATUS_BAD_TASK,
                              "duplicate request_id '%s': a request with this id is in flight", id);
        int st = validate_task(s, t, &pidx, why, sizeof(why));
        if (st != KVF_STATUS_FINISHED)
                return reject(s, ref, t->peer, st, "%s", why);

        slot = sender_slot_alloc(s);
        if (slot == UINT32_MAX)
                return -EAGAIN; /* table full: back-pressure, the task waits in its ring */

        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        uint32_t *blocks = kvf_slot_blocks(&s->ctl, slot);
        memcpy(blocks, t->src, t->n_src * sizeof(uint32_t));
        memcpy(blocks + h->max_blocks, t->dst, t->n_dst * sizeof(uint32_t));
        r->status = KVF_STATUS_FINISHED;
        r->incarnation++;
        r->task_pos = pos;
        r->completion_pos = ~0ull;
        r->accept_ns = kvf_now_ns();
        r->session = ref->session;
        r->flags = t->id_bin ? KVF_REQF_ID_BIN : 0;
        /* The decode engine session that reserved the blocks: as the engine says, else the
         * one live now (ipc: read from the peer's segment; tcp: the last its connector told). */
        r->peer_session = t->peer_session          ? t->peer_session
                          : pidx != UINT32_MAX     ? kvf_engine_session(&s->peers[pidx].ctl, false)
                                                   : sender_net_peer_session(s, t->peer);
        r->withdraw_ns = 0;
        r->last_layer_ns = 0;
        r->deadline_ns = r->accept_ns + s->request_timeout_ns;
        r->bytes = 0;
        r->notice_gen = 0;
        r->transport = (uint32_t)t->transport;
        r->n_src = t->n_src;
        r->n_send = t->n_dst;
        r->sent_full = 0;
        r->cur_layers = 0;
        r->chunk_head = r->chunk_tail = 0;
        r->last_chunk_seen = 0;
        r->peer_idx = pidx;
        if (!t->chunked) {
                /* Per-query prefill: every block completes in step current_id. */
                r->chunks[0].step = t->current_id;
                r->chunks[0].block_end = t->n_dst;
                r->chunk_tail = 1;
                r->last_chunk_seen = 1;
        }
        snprintf(r->request_id, sizeof(r->request_id), "%s", id);
        snprintf(r->peer, sizeof(r->peer), "%s", t->peer);
        r->reason[0] = '\0';
        /* Release: the slot is complete before it is seen active. */
        kvf_store_release(&r->state, KVF_REQ_ACTIVE);
        sender_map_insert(s, slot);
        kvf_count(&s->ctl, KVF_CTR_TASKS_ACCEPTED, 1);
        int rc;
        if (r->transport != KVF_TRANSPORT_IPC && (rc = sender_post_open(s, slot)) < 0) {
                if (!sender_post_retry(s, slot, rc))
                        return 0; /* failed: its completion says why */
                sender_mark(s, slot, SLOT_NEEDS_OPEN);
        }
        kvf_debug("req %s: accepted, %u of %u blocks to '%s', step %llu", id, t->n_dst, t->n_src,
                  t->peer, (unsigned long long)t->current_id);
        /* Its layers may be done already (task after layer-done): move them now. */
        sender_advance(s, slot);
        return 0;
}

static void on_chunk(struct sender *s, const struct kvf_record *c)
{
        uint32_t slot = sender_map_find(s, c->request_id);
        if (slot == UINT32_MAX) {
                kvf_errlog(&s->ctl, KVF_ROLE_SENDER,
                           "req %s: chunk progress for a request that is not in flight (send the task first)",
                           c->request_id);
                return;
        }
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        if (r->state != KVF_REQ_ACTIVE || r->last_chunk_seen)
                return; /* already complete (or a re-read after restart) */
        uint64_t full = c->tokens / s->layout->block_size;
        uint64_t first = r->n_src - r->n_send; /* prefix the peer already holds */
        uint32_t end = c->last ? r->n_send
                               : (uint32_t)(full > first ? (full - first < r->n_send ? full - first : r->n_send) : 0);
        if (c->last || end >= r->n_send) {
                end = r->n_send;
                r->last_chunk_seen = 1;
        }
        if (r->chunk_tail != r->chunk_head) {
                struct kvf_chunk_mark *back = &r->chunks[(r->chunk_tail - 1) % KVF_CHUNKS_MAX];
                if (c->current_id < back->step) {
                        /* An engine bug; waiting would only end in a timeout a minute later. */
                        kvf_errlog(&s->ctl, KVF_ROLE_SENDER,
                                   "req %s: chunk for step %llu after one for step %llu: request failed",
                                   r->request_id, (unsigned long long)c->current_id,
                                   (unsigned long long)back->step);
                        sender_fail(s, slot, KVF_STATUS_BAD_TASK,
                                    "chunk for step %llu after one for step %llu: a request's chunk steps must not go backwards",
                                    (unsigned long long)c->current_id, (unsigned long long)back->step);
                        return;
                }
                if (c->current_id == back->step || r->chunk_tail - r->chunk_head == KVF_CHUNKS_MAX) {
                        /* same step, or queue full: extend the last mark (later, never wrong) */
                        back->step = c->current_id;
                        if (end > back->block_end)
                                back->block_end = end;
                        sender_advance(s, slot);
                        return;
                }
        }
        struct kvf_chunk_mark *m = &r->chunks[r->chunk_tail % KVF_CHUNKS_MAX];
        m->step = c->current_id;
        m->block_end = end;
        r->chunk_tail++;
        sender_advance(s, slot);
}

static void on_cancel(struct sender *s, const struct kvf_record *c)
{
        uint32_t slot = sender_map_find(s, c->request_id);
        if (slot == UINT32_MAX) {
                kvf_warn("req %s: cancel for a request that is not in flight: ignored", c->request_id);
                return;
        }
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        if (r->state == KVF_REQ_ACTIVE)
                decide(s, slot, KVF_STATUS_CANCELLED, "cancelled by the engine");
        /* FINISHING: every byte has landed; the completion will say finished. */
}

int sender_on_engine_record(void *ctx, uint16_t type, const uint8_t *p, uint32_t len, uint64_t pos)
{
        struct sender *s = ctx;
        struct kvf_record r;
        int rc = 0;
        struct task_ref ref = {.pos = pos, .session = sender_record_session(s, pos)};

        /* A record of a session we do not serve: a new engine may have attached. */
        if (ref.session != s->session)
                sender_sessions_check(s, true);
        if (type != KVF_REC_TASK && type != KVF_REC_CHUNK && type != KVF_REC_CANCEL) {
                kvf_count(&s->ctl, KVF_CTR_BAD_RECORDS, 1);
                kvf_errlog(&s->ctl, KVF_ROLE_SENDER,
                           "record type %u (%s) does not belong on ring engine->sender: dropped", type,
                           kvf_rec_type_name(type));
                return 0;
        }
        if (kvf_record_decode(type, p, len, s->ctl.hdr->rank, &r) < 0) {
                kvf_count(&s->ctl, KVF_CTR_BAD_RECORDS, 1);
                if (type == KVF_REC_TASK) {
                        char why[KVF_ERR_MAX];
                        snprintf(why, sizeof(why), "%s", kvf_err_msg());
                        /* The bad field may come before request_id: look for it anyway. */
                        if (!r.request_id[0])
                                kvf_record_peek_request_id(p, len, r.request_id, sizeof(r.request_id),
                                                           &r.id_bin);
                        ref.request_id = r.request_id;
                        ref.id_bin = r.id_bin;
                        rc = reject(s, &ref, r.peer, KVF_STATUS_BAD_TASK, "%s", why);
                }
                else
                        kvf_errlog(&s->ctl, KVF_ROLE_SENDER, "malformed %s record: %s",
                                   kvf_rec_type_name(type), kvf_err_msg());
                kvf_record_free(&r);
                return rc;
        }
        ref.request_id = r.request_id;
        ref.id_bin = r.id_bin;
        if (type != KVF_REC_TASK && ref.session != s->session) {
                kvf_debug("req %s: %s record of ended engine session %llu: ignored", r.request_id,
                          kvf_rec_type_name(type), (unsigned long long)ref.session);
                kvf_record_free(&r);
                return 0;
        }
        switch (type) {
        case KVF_REC_TASK:
                rc = accept_task(s, &r, &ref);
                break;
        case KVF_REC_CHUNK:
                kvf_count(&s->ctl, KVF_CTR_CHUNK_RECORDS, 1);
                on_chunk(s, &r);
                break;
        case KVF_REC_CANCEL:
                kvf_count(&s->ctl, KVF_CTR_CANCEL_RECORDS, 1);
                on_cancel(s, &r);
                break;
        }
        kvf_record_free(&r);
        return rc;
}

int sender_on_connector_record(void *ctx, uint16_t type, const uint8_t *p, uint32_t len,
                               uint64_t pos)
{
        struct sender *s = ctx;
        struct kvf_record r;
        (void)pos;

        if (kvf_record_decode(type, p, len, 0, &r) < 0) {
                kvf_count(&s->ctl, KVF_CTR_BAD_RECORDS, 1);
                kvf_errlog(&s->ctl, KVF_ROLE_SENDER, "malformed %s record from the connector: %s",
                           kvf_rec_type_name(type), kvf_err_msg());
                kvf_record_free(&r);
                return 0;
        }
        if (type == KVF_RT_WRITE_RESULT) {
                uint32_t slot = (uint32_t)(r.key >> 40);
                if (slot < s->ctl.hdr->reqtab_slots) {
                        struct kvf_req_slot *q = &s->ctl.reqtab[slot];
                        /* Finished only once every byte is written (FINISHING); an error
                         * (a network transfer that failed early) ends an active one too. */
                        bool ours = sender_key(slot, q->incarnation) == r.key;
                        if (ours && (q->state == KVF_REQ_FINISHING ||
                                     (q->state == KVF_REQ_ACTIVE && r.status != KVF_STATUS_FINISHED)))
                                decide(s, slot, r.status,
                                       r.status == KVF_STATUS_FINISHED ? ""
                                       : r.reason[0]                   ? r.reason
                                                                       : "the connector gave no reason");
                }
        } else if (type == KVF_RT_PEER_STATE) {
                if (r.up)
                        sender_net_peer_note(s, r.peer, r.session);
                kvf_info("peer '%s' is %s%s%s (decode engine session %llu)", r.peer, r.up ? "up" : "down",
                         r.reason[0] ? ": " : "", r.reason, (unsigned long long)r.session);
        }
        kvf_record_free(&r);
        return 0;
}

/* ---- restart and housekeeping ---- */

void sender_adopt(struct sender *s)
{
        struct kvf_ring *ring = &s->ctl.rings[KVF_RING_SENDER_TO_ENGINE];
        uint32_t n = s->ctl.hdr->reqtab_slots, adopted = 0;
        char why[KVF_REASON_MAX];

        /* The engine executor's entries: closed; what the engine claimed is waited for. */
        sender_plan_adopt_all(s);
        for (uint32_t i = 0; i < n; i++) {
                struct kvf_req_slot *r = &s->ctl.reqtab[i];
                uint32_t st = kvf_load_acquire(&r->state);
                if (st == KVF_REQ_FREE)
                        continue;
                adopted++;
                sender_map_insert(s, i);
                r->peer_idx = UINT32_MAX;
                if (st != KVF_REQ_COMPLETING && r->transport == KVF_TRANSPORT_IPC &&
                    sender_peer_get(s, r->peer, &r->peer_idx, why, sizeof(why)) < 0) {
                        decide(s, i, KVF_STATUS_CONNECTION, why);
                        continue;
                }
                /* Copies of its were gathered, submitted or in flight when the sender
                 * died: whether they ran is unknown (a batch not yet flushed never ran,
                 * a kernel may have gone with the dead sender's context), while its
                 * progress says they did. It cannot be reported finished. */
                if ((r->flags & KVF_REQF_COPY_PENDING) && st != KVF_REQ_COMPLETING) {
                        r->flags &= ~KVF_REQF_COPY_PENDING;
                        decide(s, i, KVF_STATUS_WRITE,
                               "the sender restarted while a copy of this request was being made");
                        continue;
                }
                switch (st) {
                case KVF_REQ_ACTIVE:
                        /* What we handed the connector may be lost with us: hand it again. */
                        if (r->transport != KVF_TRANSPORT_IPC)
                                redo_network(s, i);
                        sender_advance(s, i);
                        break;
                case KVF_REQ_FINISHING:
                        /* The notice may be lost with us; the peer de-duplicates. */
                        if (r->transport != KVF_TRANSPORT_IPC)
                                redo_network(s, i);
                        sender_mark(s, i, SLOT_NEEDS_NOTICE);
                        kvf_count(&s->ctl, KVF_CTR_NOTICES_REISSUED, 1);
                        break;
                case KVF_REQ_COMPLETING:
                        if (r->completion_pos != ~0ull && kvf_ring_delivered(ring, r->completion_pos))
                                free_slot(s, i);
                        else
                                sender_mark(s, i, SLOT_NEEDS_COMPLETION);
                        break;
                default:
                        decide(s, i, KVF_STATUS_WRITE, "request slot in an unknown state");
                }
        }
        if (adopted) {
                kvf_count(&s->ctl, KVF_CTR_REQUESTS_ADOPTED, adopted);
                kvf_info("adopted %u requests from the table", adopted);
        }
        /* Requests of an engine session that ended while no sender ran end now. */
        s->session = SENDER_SESSION_UNKNOWN;
        sender_sessions_check(s, true);
}

/*
 * A FINISHING request past its deadline: its notice may have reached the peer,
 * which may have published the arrival. Never decide alone while the peer
 * may still answer: ask the connector to withdraw the notice (the peer then
 * says what it did, from its journal), and decide on that answer. Only a
 * notice that never went to a connector, or a peer silent for a whole second
 * timeout, ends the request here.
 */
static void finishing_timeout(struct sender *s, uint32_t i, uint64_t now, uint64_t w)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[i];
        unsigned long long ms = s->request_timeout_ns / 1000000;
        if (!r->notice_gen) {
                sender_fail(s, i, KVF_STATUS_TIMEOUT,
                            "timed out after %llu ms before the finish notice could reach the connector "
                            "(%u of %u blocks written, step %llu layer %u)",
                            ms, r->sent_full, r->n_send, (unsigned long long)KVF_PROGRESS_STEP(w),
                            KVF_PROGRESS_LAYERS(w));
                return;
        }
        if (!r->withdraw_ns) {
                r->withdraw_ns = now;
                sender_mark(s, i, SLOT_NEEDS_NOTICE); /* posted as a withdrawal (flush_slot) */
                kvf_warn("req %s: no confirmation from peer '%s' after %llu ms: asking it what it did",
                         r->request_id, r->peer, ms);
                return;
        }
        if (now - r->withdraw_ns > s->request_timeout_ns)
                sender_fail(s, i, KVF_STATUS_TIMEOUT,
                            "timed out after %llu ms: the peer never confirmed or denied the arrival "
                            "(in doubt: it may have published it)",
                            2 * ms);
}

void sender_tick(struct sender *s, uint64_t now)
{
        uint32_t n = s->ctl.hdr->reqtab_slots;
        uint64_t cgen = kvf_load_acquire(&s->ctl.roles[KVF_ROLE_CONNECTOR].generation);

        kvf_role_heartbeat(&s->ctl, KVF_ROLE_SENDER);
        sender_sessions_check(s, true);
        kvf_log_flush(); /* suppressed lines, once their window is over */
        sender_peers_check(s);
        for (uint32_t i = 0; i < n; i++) {
                struct kvf_req_slot *r = &s->ctl.reqtab[i];
                uint32_t st = r->state;
                if (st != KVF_REQ_ACTIVE && st != KVF_REQ_FINISHING)
                        continue;
                if (now > r->deadline_ns) {
                        uint64_t w = s->progress;
                        if (st == KVF_REQ_FINISHING) {
                                finishing_timeout(s, i, now, w);
                                if (r->state != KVF_REQ_FINISHING)
                                        continue;
                        } else {
                                sender_fail(s, i, KVF_STATUS_TIMEOUT,
                                            "timed out after %llu ms: %u of %u blocks sent for every layer; "
                                            "progress is at step %llu layer %u",
                                            (unsigned long long)(s->request_timeout_ns / 1000000),
                                            r->sent_full, r->n_send, (unsigned long long)KVF_PROGRESS_STEP(w),
                                            KVF_PROGRESS_LAYERS(w));
                                continue;
                        }
                }
                /* A connector restart loses what it held: notices, and for network
                 * transfers every block not yet acknowledged. Hand them over again. */
                if (cgen != s->connector_gen && r->transport != KVF_TRANSPORT_IPC) {
                        redo_network(s, i);
                        kvf_count(&s->ctl, KVF_CTR_NOTICES_REISSUED, 1);
                } else if (st == KVF_REQ_FINISHING && r->notice_gen && r->notice_gen != cgen &&
                           !(s->flags[i] & SLOT_NEEDS_NOTICE)) {
                        sender_mark(s, i, SLOT_NEEDS_NOTICE);
                        kvf_count(&s->ctl, KVF_CTR_NOTICES_REISSUED, 1);
                }
        }
        s->connector_gen = cgen;
}
