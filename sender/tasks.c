/*
 * Records in: tasks, chunk progress and cancels from the engine; write
 * results and peer states from the connector. A task is validated here and
 * either rejected (a completion for a task that never got a slot) or put in a
 * slot; from then on every change of the request is an event for request.c.
 *
 * A task record is consumed one at a time, so at most one is re-read after a
 * crash; an accepted task is recognised by its ring position (slot.task_pos),
 * a rejected one by the sender area's reject_task_pos and
 * kvf_ring_delivered(reject_completion_pos).
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
        kvf_bells_publish(&s->bells, ring, pos);
        kvf_count(&s->ctl, KVF_CTR_TASKS_REJECTED, 1);
        sender_count_status(s, status);
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

/* Tokens regrouped from blocks of bs into the peer's of bd: the whole request goes, and its
 * destination blocks hold its tokens, the last one at least one of the last source block's.
 * 0, or KVF_STATUS_BAD_TASK with `why`. */
static int regroup_count(const struct kvf_record *t, uint32_t bs, uint32_t bd, char *why, size_t whylen)
{
        uint64_t hi = kvf_tp_dst_blocks(t->n_src, bs, bd), lo = kvf_tp_dst_blocks_min(t->n_src, bs, bd);
        if (t->n_dst < lo || t->n_dst > hi)
                return verdict(why, whylen, KVF_STATUS_BAD_TASK,
                               "dest_block_ids has %u entries: %u source blocks of %u tokens "
                               "fill %llu to %llu blocks of %u tokens at peer '%s'",
                               t->n_dst, t->n_src, bs, (unsigned long long)lo, (unsigned long long)hi, bd,
                               t->peer);
        return 0;
}

/*
 * Is a tcp or rdma task's request regrouped into its peer's blocks (docs/ARCHITECTURE.md 7b)?
 * Yes when the peer has another block size (*bd: that size, from its segment or its connector);
 * and when its size is not known yet (a peer on another host that the connector has not
 * reached, or that went down and may come back another instance) and the task names more
 * destination blocks than source blocks, which only smaller blocks there explain (*bd 0: the
 * connector checks the counts once its data connection knows the size). No when the sizes are
 * equal, or not known with no more destination blocks than source blocks: taken as equal (the
 * data connection fails the request, saying so, if they are not).
 */
static bool net_regrouped(struct sender *s, const struct kvf_record *t, uint32_t *bd)
{
        *bd = 0;
        if (t->transport != KVF_TRANSPORT_TCP && t->transport != KVF_TRANSPORT_RDMA)
                return false;
        uint32_t b = sender_net_peer_block_size(s, t->peer);
        if (!b)
                return t->n_dst > t->n_src;
        *bd = b != s->layout->block_size ? b : 0;
        return *bd != 0;
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
        if (t->n_dst > h->max_blocks)
                return verdict(why, whylen, KVF_STATUS_BAD_TASK,
                              "dest_block_ids has %u entries, more than this instance's limit of %u blocks per request",
                              t->n_dst, h->max_blocks);
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
        if (sender_caches_check(s, UINT32_MAX, UINT32_MAX, why, whylen) < 0)
                return KVF_STATUS_ENGINE_GONE; /* (why says it) */
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
                /* FastDeploy's decode_tp_size names the decode group: a peer that says which
                 * group it belongs to (--nranks) must be of that size, or the heads would be
                 * split for another group than the engine thinks (docs/ARCHITECTURE.md 7b). */
                const struct kvf_ctl_header *ph = s->peers[*pidx].ctl.hdr;
                if (t->decode_tp && ph->nranks > 1 && t->decode_tp != ph->nranks)
                        return verdict(why, whylen, KVF_STATUS_LAYOUT_MISMATCH,
                                      "decode_tp_size is %llu, but peer '%s' is rank %u of a group of %u",
                                      (unsigned long long)t->decode_tp, t->peer, ph->rank, ph->nranks);
                const uint32_t bs = s->layout->block_size, bd = ph->layout.block_size;
                if (bs != bd) { /* tokens regrouped into the peer's blocks (common/tpsplit.h) */
                        int st = regroup_count(t, bs, bd, why, whylen);
                        if (st)
                                return st;
                }
                rc = sender_caches_check(s, *pidx, UINT32_MAX, why, whylen);
                if (rc == -EXDEV)
                        return KVF_STATUS_LAYOUT_MISMATCH; /* (why says it) */
                if (rc < 0)
                        return KVF_STATUS_CONNECTION; /* (why says it) */
                uint32_t peer_blocks = s->peers[*pidx].ctl.hdr->layout.num_blocks;
                for (uint32_t i = 0; i < t->n_dst; i++)
                        if (t->dst[i] >= peer_blocks)
                                return verdict(why, whylen, KVF_STATUS_BLOCK_RANGE,
                                              "dest_block_ids[%u] = %u is out of range: peer '%s' has %u blocks",
                                              i, t->dst[i], t->peer, peer_blocks);
        }
        uint32_t nbd;
        const bool regrouped = net_regrouped(s, t, &nbd);
        if (nbd) {
                /* A tcp or rdma peer of another block size (its segment or its connector says): regrouped
                 * as over ipc, the receiver's connector checks the same counts. */
                const uint32_t bs = s->layout->block_size;
                if (bs % nbd && nbd % bs)
                        return verdict(why, whylen, KVF_STATUS_LAYOUT_MISMATCH,
                                      "block sizes %u and %u do not divide one another (peer '%s')",
                                      bs, nbd, t->peer);
                int st = regroup_count(t, bs, nbd, why, whylen);
                if (st)
                        return st;
        }
        if (t->n_dst > t->n_src && !regrouped &&
            (*pidx == UINT32_MAX || s->layout->block_size == s->peers[*pidx].ctl.hdr->layout.block_size))
                return verdict(why, whylen, KVF_STATUS_BAD_TASK,
                              "dest_block_ids has %u entries, more than the %u of src_block_ids",
                              t->n_dst, t->n_src);
        /* Blocks another live request of this sender is writing into at the same peer: the
         * engines booked them twice, and both requests would be reported finished with one's
         * bytes in the other's blocks. Keyed by the peer's name: a tensor-parallel task goes
         * to one decode rank's instance, and ranks are peers of their own. Other prefill
         * instances' requests are theirs to check. */
        uint32_t at, owner;
        if (sender_book_find(s, t->peer, t->dst, t->n_dst, t->request_id, &at, &owner))
                return verdict(why, whylen, KVF_STATUS_BAD_TASK,
                               "dest_block_ids[%u] = %u of peer '%s' is already the destination of "
                               "live request '%.*s'",
                               at, t->dst[at], t->peer,
                               (int)sizeof(s->ctl.reqtab[owner].request_id),
                               s->ctl.reqtab[owner].request_id);
        /* tcp, rdma: the connector checks the peer (reachable, token, layout, block ids), and
         * fails the request with the reason when its build has no such transport. */
        return KVF_STATUS_FINISHED;
}

/* `step` (of a `what`) of engine session `session` was published by an earlier session: its
 * layers would count as done for a new engine's unwritten blocks. True, with why. */
static bool earlier_step(struct sender *s, uint64_t session, uint64_t step, const char *what, char *why,
                         size_t whylen)
{
        uint64_t base = sender_session_base(s, session);
        if (!base || step > KVF_PROGRESS_STEP(base))
                return false;
        snprintf(why, whylen,
                 "%s %llu: steps up to %llu were published by an earlier engine session, so their layers "
                 "count as done: number this session's steps from %llu",
                 what, (unsigned long long)step, (unsigned long long)KVF_PROGRESS_STEP(base),
                 (unsigned long long)KVF_PROGRESS_STEP(base) + 1);
        return true;
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
        if (s->stop.at) {
                /* Stopping: no new request, answered now rather than left in the ring for the
                 * engine to wait out (request.c, sender_stop_begin). */
                int rc = reject(s, ref, t->peer, KVF_STATUS_CONNECTION, "%s: it takes no new tasks", s->stop.why);
                if (rc == 0)
                        s->stop.refused++;
                return rc;
        }
        if (slot != UINT32_MAX)
                return reject(s, ref, t->peer, KVF_STATUS_BAD_TASK,
                              "duplicate request_id '%s': a request with this id is in flight", id);
        /* (the client library refuses it too; raw records come here) */
        if (!t->chunked && earlier_step(s, ref->session, t->current_id, "step", why, sizeof(why)))
                return reject(s, ref, t->peer, KVF_STATUS_BAD_TASK, "%s", why);
        int st = validate_task(s, t, &pidx, why, sizeof(why));
        if (st != KVF_STATUS_FINISHED)
                return reject(s, ref, t->peer, st, "%s", why);

        slot = sender_slot_alloc(s);
        if (slot == UINT32_MAX) {
                /* Table full: back-pressure, the task waits in its ring. Counted and said once
                 * per task held (it is tried again as slots free). */
                if (s->held_pos != pos + 1) {
                        s->held_pos = pos + 1;
                        kvf_count(&s->ctl, KVF_CTR_TASKS_HELD_BACK, 1);
                        kvf_info("request table full (%u slots, --max-requests): tasks wait in the "
                                 "engine's ring until requests end; a prefill rank takes one slot "
                                 "per task, so one per decode rank it sends to under another "
                                 "tensor-parallel split",
                                 h->reqtab_slots);
                }
                return -EAGAIN;
        }

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
        r->own_reg_gen = r->peer_reg_gen = 0; /* set by the first copy (sender_caches_check) */
        r->last_layer_ns = 0;
        r->deadline_ns = r->accept_ns + s->request_timeout_ns;
        r->bytes = 0;
        r->xfer_start_ns = 0;
        r->descs = 0;
        r->notice_gen = 0;
        r->transport = (uint32_t)t->transport;
        r->n_src = t->n_src;
        r->n_send = t->n_dst;
        r->n_dst = 0;
        if (pidx != UINT32_MAX && s->peers[pidx].plan.src_per_group != s->peers[pidx].plan.dst_per_group) {
                r->n_send = t->n_src; /* another block size: every source block, regrouped */
                r->n_dst = t->n_dst;
        }
        uint32_t nbd;
        if (pidx == UINT32_MAX && net_regrouped(s, t, &nbd)) {
                r->n_send = t->n_src; /* a tcp or rdma peer of another block size: the same */
                r->n_dst = t->n_dst;
        }
        r->sent_full = 0;
        r->cur_layers = 0;
        r->chunk_head = r->chunk_tail = 0;
        r->last_chunk_seen = 0;
        r->peer_idx = pidx;
        if (!t->chunked) {
                /* Per-query prefill: every block completes in step current_id. */
                r->chunks[0].step = t->current_id;
                r->chunks[0].block_end = r->n_send;
                r->chunk_tail = 1;
                r->last_chunk_seen = 1;
        }
        snprintf(r->request_id, sizeof(r->request_id), "%s", id);
        snprintf(r->peer, sizeof(r->peer), "%s", t->peer);
        r->reason[0] = '\0';
        kvf_debug("req %s: accepted, %u of %u blocks to '%s', step %llu", id, t->n_dst, t->n_src,
                  t->peer, (unsigned long long)t->current_id);
        sender_req_event(s, slot, &(struct sender_ev){.type = SENDER_EV_ACCEPTED});
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
        if (sender_req_state(s, slot) != SREQ_MOVING || r->last_chunk_seen)
                return; /* already complete (or a re-read after restart) */
        char why[KVF_REASON_MAX];
        if (earlier_step(s, r->session, c->current_id, "chunk for step", why, sizeof(why))) {
                kvf_errlog(&s->ctl, KVF_ROLE_SENDER, "req %s: %s: request failed", r->request_id, why);
                sender_fail(s, slot, KVF_STATUS_BAD_TASK, "%s", why);
                return;
        }
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
                        sender_req_event(s, slot, &(struct sender_ev){.type = SENDER_EV_LAYERS});
                        return;
                }
        }
        struct kvf_chunk_mark *m = &r->chunks[r->chunk_tail % KVF_CHUNKS_MAX];
        m->step = c->current_id;
        m->block_end = end;
        r->chunk_tail++;
        sender_req_event(s, slot, &(struct sender_ev){.type = SENDER_EV_LAYERS});
}

static void on_cancel(struct sender *s, const struct kvf_record *c)
{
        uint32_t slot = sender_map_find(s, c->request_id);
        if (slot == UINT32_MAX) {
                kvf_warn("req %s: cancel for a request that is not in flight: ignored", c->request_id);
                return;
        }
        /* Moving: it fails; once every byte has left us the notice commits it, and the
         * completion says what the peer did. */
        sender_req_event(s, slot, &(struct sender_ev){.type = SENDER_EV_CANCEL});
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
                        if (sender_key(slot, q->incarnation) == r.key)
                                sender_req_event(s, slot,
                                                 &(struct sender_ev){.type = SENDER_EV_WRITE_RESULT,
                                                                     .status = r.status, .reason = r.reason});
                }
        } else if (type == KVF_RT_PEER_STATE) {
                sender_net_peer_note(s, r.peer, r.up, r.session, (uint32_t)r.lay_bsize);
                kvf_info("peer '%s' is %s%s%s (decode engine session %llu)", r.peer, r.up ? "up" : "down",
                         r.reason[0] ? ": " : "", r.reason, (unsigned long long)r.session);
        }
        kvf_record_free(&r);
        return 0;
}

/* ---- the loop's readers (main.c; tests drive them directly) ---- */

/*
 * Tasks one at a time: a crash re-reads at most one. A task held back (table full, or its
 * rejection waits for room in the completion ring) is tried again when a slot is freed, or
 * after 1 ms, not on every spin.
 */
bool sender_read_engine(struct sender *s, uint64_t beat)
{
        struct kvf_ring *in = &s->ctl.rings[KVF_RING_ENGINE_TO_SENDER];
        bool worked = false;
        if (s->engine_blocked && kvf_now_ns() >= s->engine_retry_ns)
                s->engine_blocked = false;
        for (int i = 0; i < 64 && !s->engine_blocked; i++) {
                uint64_t head = kvf_load_relaxed(&in->hdr->head);
                int n = kvf_ring_read(in, sender_on_engine_record, s, 1);
                if (n == 0 && kvf_ring_readable(in) && kvf_load_relaxed(&in->hdr->head) == head) {
                        s->engine_blocked = true; /* a record is there, but waits */
                        s->engine_retry_ns = kvf_now_ns() + 1000000;
                        break;
                }
                if (n < 0) {
                        kvf_errlog(&s->ctl, KVF_ROLE_SENDER, "ring engine->sender: %s", kvf_err_msg());
                        kvf_sleep_ns(beat);
                        break;
                }
                if (n == 0)
                        break;
                worked = true;
        }
        sender_req_copies(s, true); /* a late task's layers, a chunk's blocks */
        return worked;
}

/* Write results and peer states; then what slots owe the rings, and copies in flight. */
bool sender_read_connector(struct sender *s)
{
        struct kvf_ring *from_conn = &s->ctl.rings[KVF_RING_CONNECTOR_TO_SENDER];
        bool worked = false;
        int n = kvf_ring_read(from_conn, sender_on_connector_record, s, 256);
        if (n > 0)
                worked = true;
        else if (n < 0)
                kvf_errlog(&s->ctl, KVF_ROLE_SENDER, "ring connector->sender: %s", kvf_err_msg());
        if (s->notice_rings && sender_read_replies(s))
                worked = true;
        if (s->pending)
                sender_flush_pending(s);
        sender_req_copies(s, true);
        if (s->sliced) {
                s->sliced = false;
                worked = true; /* more of a backlog: after the next progress check */
        }
        if (s->cp.flight || s->cp.nowes) {
                sender_req_copies(s, false);
                worked = true; /* batches in flight: keep looking (no wake-up comes) */
        }
        return worked;
}
