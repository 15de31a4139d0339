/*
 * The sender's outbox: records for the connector (open, write batch, finish
 * notice) and the engine (completions), encoded into one scratch buffer and
 * written to their rings.
 *
 * A failed post is returned, and the caller (request.c) decides what it means
 * for the request: a full ring (-EAGAIN) or a failed allocation (-ENOMEM) is
 * back-pressure, and the slot tries again from the same place later; a record
 * that can never be encoded or never fit the ring (-ENOSPC, -EINVAL,
 * -EMSGSIZE) would be retried for ever, so its request fails with "write
 * error" and the reason.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomics.h"
#include "clock.h"
#include "doorbell.h"
#include "err.h"
#include "log.h"
#include "sender.h"

int sender_encode(struct sender *s, const struct kvf_record *r, size_t *len)
{
        size_t need = kvf_record_encoded_max(r);
        if (need > s->scratch_cap) {
                uint8_t *p = realloc(s->scratch, need);
                if (!p)
                        return kvf_err_set(-ENOMEM, "out of memory for a %zu-byte %s record", need,
                                           kvf_rec_type_name(r->type));
                s->scratch = p;
                s->scratch_cap = need;
        }
        int n = kvf_record_encode(r, s->scratch, s->scratch_cap);
        if (n < 0)
                return kvf_err_set(n, "cannot encode the %s record: %s", kvf_rec_type_name(r->type),
                                   strerror(-n));
        *len = (size_t)n;
        return 0;
}

int sender_post(struct sender *s, const struct kvf_record *r)
{
        size_t len = 0; /* set when sender_encode succeeds */
        int rc = sender_encode(s, r, &len);
        if (rc < 0)
                return rc;
        struct kvf_ring *ring = &s->ctl.rings[KVF_RING_SENDER_TO_CONNECTOR];
        rc = kvf_bells_write(&s->bells, ring, (uint16_t)r->type, s->scratch, (uint32_t)len);
        if (rc == -EMSGSIZE)
                return kvf_err_set(rc, "a %zu-byte %s record can never fit ring sender->connector (%llu bytes)",
                                   len, kvf_rec_type_name(r->type), (unsigned long long)ring->capacity);
        return rc;
}

void sender_count_status(struct sender *s, int status)
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

/*
 * Straight into the peer's notice ring, encoded as the notice its connector would get on
 * the socket: it names its source (us) and the decode connector reads the source's
 * incarnation from the slot. Once committed the notice outlives both connectors: it is
 * answered in the reply ring, or (the peer instance re-created) never (check_peers).
 */
static int post_to_ring(struct sender *s, struct ipc_peer *p, struct kvf_record *f)
{
        size_t len = 0;
        f->type = KVF_RT_NOTICE;
        snprintf(f->peer, sizeof(f->peer), "%s", s->ctl.hdr->instance);
        int rc = sender_encode(s, f, &len);
        if (rc < 0)
                return rc;
        /* Anything but a withdrawal (a finish notice, an abort) goes in only while the ring is
         * at most a third full: what is left holds the withdrawal of every finish notice in it
         * (a withdrawal, with its reason, is at most twice its notice), so a request whose
         * notice is held there can always be withdrawn at its deadline, and the decode
         * connector answers withdrawals while the notices ahead of them wait for room
         * (connector/notices.c). An abort past the third would take that room: it waits (at
         * most a second, flush_slot) like a finish notice. */
        if (!f->withdraw && kvf_ring_used(p->nend.notice.hdr) + kvf_ring_align(KVF_REC_HDR_SIZE + len) >
                                p->nend.notice.capacity / 3)
                return -EAGAIN;
        /* (A prewake's expectation is left to run out, never withdrawn here: other requests'
         * notices may be due under it, sender_expect_notice.) */
        rc = kvf_bells_write(&s->bells, &p->nend.notice, KVF_RT_NOTICE, s->scratch, (uint32_t)len);
        if (rc == -EMSGSIZE)
                return kvf_err_set(rc, "a %zu-byte notice can never fit the notice ring of '%s' (%llu bytes)",
                                   len, p->name, (unsigned long long)p->nend.notice.capacity);
        return rc < 0 ? rc : 1;
}

/* A/B switches of bench/gpu_tail_ab.sh and tail_ab.sh: KVF_AB_NO_NOTICE_EXPECT=1 leaves the
 * decode connector to sleep until the notice rings it; KVF_AB_NO_EARLY_PREWAKE=1 wakes it at
 * the last layer only. */
static bool ab_no_expect, ab_no_early;

__attribute__((constructor)) static void ab_switches(void)
{
        const char *v = getenv("KVF_AB_NO_NOTICE_EXPECT");
        ab_no_expect = v && !strcmp(v, "1");
        v = getenv("KVF_AB_NO_EARLY_PREWAKE");
        ab_no_early = v && !strcmp(v, "1");
}

void sender_expect_notice(struct sender *s, uint32_t slot, uint64_t lead_ns, uint64_t bytes)
{
        const struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        if (!s->prewake || ab_no_expect || (lead_ns && ab_no_early) || r->transport != KVF_TRANSPORT_IPC ||
            r->peer_idx >= SENDER_MAX_PEERS)
                return;
        struct ipc_peer *p = &s->peers[r->peer_idx];
        if (!p->in_use || !p->nend.slot || !kvf_notice_held(&p->nend))
                return;
        /* One deadline per doorbell, for every request expected: extended, never shortened
         * (a race with another sender's store costs a wake-up, never a notice). */
        uint64_t now = kvf_now_ns();
        uint64_t until = now + lead_ns + SENDER_NOTICE_EXPECT_NS + bytes / SENDER_NOTICE_EXPECT_BPNS;
        uint64_t was = kvf_load_relaxed(&p->nend.notice.bell->expect_until);
        if (was > until && was <= now + KVF_DOORBELL_EXPECT_MAX_NS)
                until = was;
        kvf_doorbell_expect(p->nend.notice.bell, until);
        /* A connector asleep now would not see the expectation: wake it (a system call only
         * when it sleeps), so that its wake-up runs beside the copies instead of after them. */
        kvf_doorbell_ring(p->nend.notice.bell);
        kvf_count(&s->ctl, KVF_CTR_NOTICE_PREWAKES, 1);
}

void sender_prewake_later(struct sender *s, uint32_t slot, uint64_t due, uint64_t lead_ns, uint64_t bytes)
{
        if (!s->prewake || ab_no_expect || ab_no_early || s->ctl.reqtab[slot].transport != KVF_TRANSPORT_IPC)
                return;
        for (uint32_t i = 0; i < s->prewake_n; i++)
                if (s->prewake_slot[i] == slot)
                        return;
        if (s->prewake_n == SENDER_PREWAKE_MAX)
                return;
        /* (one step's requests share the due time: the earliest is kept, the widest window) */
        if (!s->prewake_due_ns || due < s->prewake_due_ns)
                s->prewake_due_ns = due;
        if (lead_ns > s->prewake_lead_ns)
                s->prewake_lead_ns = lead_ns;
        s->prewake_slot[s->prewake_n] = slot;
        s->prewake_bytes[s->prewake_n++] = bytes;
}

void sender_prewake_fire(struct sender *s, uint64_t now)
{
        if (!s->prewake_due_ns || now < s->prewake_due_ns)
                return;
        for (uint32_t i = 0; i < s->prewake_n; i++) {
                const struct kvf_req_slot *r = &s->ctl.reqtab[s->prewake_slot[i]];
                /* (still moving: a request that finished or failed meanwhile needs none) */
                if (kvf_load_relaxed(&r->state) == KVF_REQ_ACTIVE)
                        sender_expect_notice(s, s->prewake_slot[i], s->prewake_lead_ns, s->prewake_bytes[i]);
        }
        s->prewake_due_ns = s->prewake_lead_ns = 0;
        s->prewake_n = 0;
}

int sender_post_notice(struct sender *s, uint32_t slot, enum sender_notice kind)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        /* Withdrawn by a stop, not at a deadline: a peer that had not published the arrival
         * publishes this status and reason (the instance stopping), and answers with them. */
        const bool stopping = kind == SENDER_NOTICE_WITHDRAW && sender_stop_withdrawn(s, r);
        struct kvf_record f = {.type = KVF_RT_FINISH,
                               .key = sender_key(slot, r->incarnation),
                               .transport = (int)r->transport,
                               .status = kind == SENDER_NOTICE_FINISH ? KVF_STATUS_FINISHED
                                         : stopping                   ? KVF_STATUS_CONNECTION
                                         : kind == SENDER_NOTICE_WITHDRAW ? KVF_STATUS_TIMEOUT
                                                                          : (int)r->status,
                               .bytes = r->bytes,
                               .blocks = r->n_send,
                               .dst = kvf_slot_blocks(&s->ctl, slot) + s->ctl.hdr->max_blocks,
                               .n_dst = r->n_dst ? r->n_dst : r->n_send,
                               .session = r->peer_session,
                               .withdraw = kind == SENDER_NOTICE_WITHDRAW,
                               .id_bin = r->flags & KVF_REQF_ID_BIN,
                               .done_ns = kvf_now_ns()};

        memcpy(f.request_id, r->request_id, sizeof(f.request_id));
        memcpy(f.peer, r->peer, sizeof(f.peer));
        if (kind == SENDER_NOTICE_ABORT)
                memcpy(f.reason, r->reason, sizeof(f.reason));
        else if (stopping) /* (short: a withdrawal fits the room post_to_ring keeps for it) */
                snprintf(f.reason, sizeof(f.reason), "%s", s->stop.why);
        else if (kind == SENDER_NOTICE_WITHDRAW)
                snprintf(f.reason, sizeof(f.reason),
                         "timed out after %llu ms waiting for the peer to confirm the arrival",
                         (unsigned long long)(s->request_timeout_ns / 1000000));
        if (r->transport == KVF_TRANSPORT_IPC && r->peer_idx < SENDER_MAX_PEERS && s->peers[r->peer_idx].in_use) {
                struct ipc_peer *p = &s->peers[r->peer_idx];
                f.generation = p->created_ns;
                if (p->nend.slot && kvf_notice_held(&p->nend))
                        return post_to_ring(s, p, &f);
        }
        return sender_post(s, &f);
}

int sender_post_completion(struct sender *s, uint32_t slot)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        struct kvf_ring *ring = &s->ctl.rings[KVF_RING_SENDER_TO_ENGINE];
        /* Finished means every byte landed, once: report that amount (copies repeated after
         * a restart are not counted twice). */
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
        /* Crash window: with the position stored first, a successor can ask the ring whether
         * this record was committed. */
        kvf_store_release(&r->completion_pos, pos);
        memcpy(p, s->scratch, len);
        kvf_bells_publish(&s->bells, ring, pos);
        sender_count_status(s, (int)r->status);
        if (s->stop.at) { /* (sender_stop_report) */
                if (r->status == KVF_STATUS_FINISHED)
                        s->stop.finished++;
                else
                        s->stop.failed++;
        }
        if (r->status == KVF_STATUS_FINISHED) {
                if (r->last_layer_ns && c.done_ns > r->last_layer_ns)
                        kvf_hist_add(&s->ctl.sender->hist[KVF_HIST_LAST_TO_DONE], c.done_ns - r->last_layer_ns);
                /* Per transfer, as vLLM's NIXL connector counts: its bytes, its descriptors,
                 * and its time from the first bytes handed over (else its task) to now. */
                struct kvf_histogram *h = s->ctl.sender->hist;
                uint64_t t0 = r->xfer_start_ns ? r->xfer_start_ns : r->accept_ns;
                kvf_hist_add_size(&h[KVF_HIST_REQ_BYTES], full);
                kvf_hist_add_size(&h[KVF_HIST_REQ_DESCS], r->descs);
                kvf_hist_add(&h[KVF_HIST_REQ_XFER], c.done_ns > t0 ? c.done_ns - t0 : 0);
                kvf_debug("req %s: finished, %llu bytes", r->request_id, (unsigned long long)r->bytes);
        } else {
                kvf_info("req %s: %s: %s", r->request_id, kvf_status_name((int)r->status), r->reason);
        }
        return 0;
}
