/*
 * The engine executor's plan (an instance with --backend cuda --executor
 * engine): the sender still decides what moves, the engine's context
 * executes. The protocol is in common/shm_layout.h (struct kvf_plan_entry);
 * the engine's side is client/stream.c.
 *
 * Per request slot one entry. It is published (opened) for the step of the
 * request's front chunk mark while that step is still to come, or under way
 * with layers [first, layers) left: the mark's send-blocks, the peer, where
 * the engine's claims start. When a progress word makes layers ready:
 *   - the engine claimed them all (claimed >= ready): they are the engine's,
 *     nothing to do; the entry stays open while the step goes on;
 *   - else, or the step's last layer is ready: the entry is closed (its
 *     claimed count is then final: exactly one of the sender's close and the
 *     engine's claim wins each CAS) and the sender copies every ready layer
 *     from there itself, in its own context (as executor 1 would).
 * The engine's layers [first, claimed) of a closed entry are an "owe" (copies.c):
 * the request counts as having copies in flight until exec.landed reaches
 * PACK(step, claimed), or the entry's own landed word is (gen, claimed), so it
 * goes FINISHING, and a failure is reported,
 * only once they have landed (or the engine session is over: its context,
 * and what it queued, is gone).
 *
 * A restarted sender closes every entry; the claimed layers of a request it
 * adopts become an owe again (KVF_REQF_ENGINE_COPY says there may be some),
 * and the request goes on: the engine's copies land whether or not the
 * sender lives.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "atomics.h"
#include "err.h"
#include "log.h"
#include "sender.h"

int sender_plan_init(struct sender *s)
{
        uint32_t n = s->ctl.hdr->reqtab_slots;
        s->plan_on = (s->own.be->id == KVF_BACKEND_CUDA || s->own.be->id == KVF_BACKEND_ENGINE) &&
                     s->ctl.hdr->executor == KVF_EXEC_ENGINE;
        if (!s->plan_on)
                return 0;
        if (!(s->pl_step = malloc(n * sizeof(*s->pl_step))))
                return kvf_err_set(-ENOMEM, "out of memory for the plan of %u slots", n);
        for (uint32_t i = 0; i < n; i++)
                s->pl_step[i] = UINT64_MAX;
        return 0;
}

/*
 * Close the slot's entry if it is open; its final claims then become an owe.
 * 1 when this call closed it, 0 when it was not open, < 0 (kvf_err the reason)
 * when the engine reported a failure of its copies or they cannot be waited
 * for: the request's bytes are then undefined.
 */
static int close_entry(struct sender *s, uint32_t slot)
{
        struct kvf_plan_entry *e = &s->ctl.plan[slot];
        uint64_t v = kvf_load_acquire(&e->ctl);
        /* acq_rel: pairs with the engine's claiming CAS; whichever comes second sees the
         * other's value, so the claimed count kept here is the final one. */
        while ((v & KVF_PLAN_OPEN) && !kvf_cas_acq_rel(&e->ctl, &v, v & ~KVF_PLAN_OPEN)) {
        }
        if (!(v & KVF_PLAN_OPEN))
                return 0;
        uint32_t c = KVF_PLAN_CLAIMED(v);
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        int rc = 1;
        if (c > e->first)
                rc = sender_copies_owe(s, slot, KVF_PROGRESS_PACK(e->step, c), KVF_PLAN_GEN(v));
        else if (!sender_copies_owing(s, slot))
                r->flags &= ~KVF_REQF_ENGINE_COPY;
        if (c < s->layers)
                kvf_fetch_add_relaxed(&s->ctl.exec->taken_back, 1);
        /* Acquire: pairs with the engine's release store of err (why is complete). */
        if (rc > 0 && kvf_load_acquire(&e->err))
                rc = kvf_err_set(-EIO, "copy into peer '%s' failed: %.*s", r->peer, (int)sizeof(e->why), e->why);
        return rc < 0 ? rc : 1;
}

int sender_plan_offer(struct sender *s, uint32_t slot)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        if (!s->plan_on || r->transport != KVF_TRANSPORT_IPC ||
            r->peer_idx >= SENDER_MAX_PEERS || !s->peers[r->peer_idx].in_use || r->chunk_head == r->chunk_tail)
                return 0;
        const struct kvf_chunk_mark *m = &r->chunks[r->chunk_head % KVF_CHUNKS_MAX];
        /* Its layers are ready already (advance copies them), published for this step
         * already (open, or taken back: the sender finishes that step), or nothing to move. */
        if (m->step < KVF_PROGRESS_STEP(s->progress) || s->pl_step[slot] == m->step ||
            m->block_end <= r->sent_full || r->cur_layers >= s->layers)
                return 0;
        struct kvf_plan_entry *e = &s->ctl.plan[slot];
        uint64_t v = kvf_load_acquire(&e->ctl);
        int rc;
        if ((v & KVF_PLAN_OPEN) && (rc = close_entry(s, slot)) < 0) /* (closed at the end of every step; never here) */
                return rc;
        /* The engine's caches: the registrations the request is bound to (its first copy's,
         * whoever makes it), checked here as before the sender's own copies. */
        char why[KVF_REASON_MAX];
        if (sender_caches_check(s, r->peer_idx, slot, why, sizeof(why)) < 0)
                return 0; /* (the sender's own copy meets it and fails the request) */
        const struct ipc_peer *p = &s->peers[r->peer_idx];
        /* Both instances' caches registered by one process: CUDA opens no IPC handle of a
         * process's own memory there, so these copies stay the sender's. */
        int32_t mine = kvf_load_acquire(&s->ctl.hdr->reg_pid), theirs = kvf_load_acquire(&p->ctl.hdr->reg_pid);
        if (s->ctl.hdr->reg_gpu && mine > 0 && mine == theirs)
                return 0;
        e->peer_reg_gen = r->peer_reg_gen;
        e->step = m->step;
        e->b0 = r->sent_full;
        e->b1 = m->block_end;
        e->src_first = r->n_src - r->n_send;
        e->first = r->cur_layers; /* 0 for a step still to come; else the layers ready so far */
        e->peer_created_ns = p->created_ns;
        e->peer_session = r->peer_session;
        memset(e->peer, 0, sizeof(e->peer));
        memcpy(e->peer, p->name, strnlen(p->name, sizeof(e->peer) - 1));
        e->err = 0;
        e->why[0] = '\0';
        uint32_t gen = KVF_PLAN_GEN(v) + 1;
        r->flags |= KVF_REQF_ENGINE_COPY; /* before the engine can claim anything */
        /* Release: pairs with the engine's acquire load of ctl; the fields above are
         * complete before it sees the entry open. */
        kvf_store_release(&e->ctl, KVF_PLAN_CTL(gen ? gen : 1, 1, e->first));
        if (kvf_load_relaxed(&s->ctl.exec->hi) <= slot)
                kvf_store_release(&s->ctl.exec->hi, slot + 1); /* (after the entry: the engine's acquire) */
        kvf_fetch_add_relaxed(&s->ctl.exec->published, 1);
        s->pl_step[slot] = m->step;
        return 0;
}

int sender_plan_take(struct sender *s, uint32_t slot, uint64_t step, uint32_t b0, uint32_t b1, uint32_t l0,
                     uint32_t l1, uint32_t *from)
{
        *from = l0;
        if (!s->plan_on || s->pl_step[slot] != step)
                return 0;
        struct kvf_plan_entry *e = &s->ctl.plan[slot];
        /* Acquire: pairs with the engine's claiming CAS. */
        uint64_t v = kvf_load_acquire(&e->ctl);
        if (!(v & KVF_PLAN_OPEN))
                return 0; /* taken back before: the engine's layers ended below l0 */
        int rc;
        if (e->b0 != b0 || e->b1 != b1) {
                /* The mark grew after the entry was published (a second chunk record for
                 * the same step): the engine copies the old blocks only. Take it back and
                 * copy every layer since `first` for all of them (the engine's share again:
                 * the same bytes, harmless). */
                if ((rc = close_entry(s, slot)) < 0)
                        return rc;
                *from = e->first < l0 ? e->first : l0;
                return 0;
        }
        if (KVF_PLAN_CLAIMED(v) >= l1 && l1 < s->layers) {
                *from = l1; /* the engine's, and the step goes on */
                return 0;
        }
        if ((rc = close_entry(s, slot)) < 0)
                return rc;
        uint32_t c = KVF_PLAN_CLAIMED(kvf_load_relaxed(&e->ctl));
        *from = c > l0 ? (c < l1 ? c : l1) : l0;
        return 0;
}

int sender_plan_close(struct sender *s, uint32_t slot)
{
        int rc = s->plan_on ? close_entry(s, slot) : 0;
        return rc < 0 ? rc : 0;
}

void sender_plan_adopt_all(struct sender *s, uint8_t *failed)
{
        uint32_t n = s->ctl.hdr->reqtab_slots;
        for (uint32_t i = 0; i < n; i++) {
                struct kvf_req_slot *r = &s->ctl.reqtab[i];
                struct kvf_plan_entry *e = &s->ctl.plan[i];
                uint64_t v = kvf_load_acquire(&e->ctl);
                if (!s->plan_on) {
                        r->flags &= ~KVF_REQF_ENGINE_COPY;
                        continue;
                }
                if (kvf_load_acquire(&r->state) == KVF_REQ_FREE) {
                        /* (decided requests close their entry first: none should be open) */
                        while ((v & KVF_PLAN_OPEN) && !kvf_cas_acq_rel(&e->ctl, &v, v & ~KVF_PLAN_OPEN)) {
                        }
                        continue;
                }
                if (!(r->flags & KVF_REQF_ENGINE_COPY))
                        continue;
                /* The engine may have claimed layers of this entry, open or closed by our
                 * predecessor (whose owe died with it): wait for them again. */
                while ((v & KVF_PLAN_OPEN) && !kvf_cas_acq_rel(&e->ctl, &v, v & ~KVF_PLAN_OPEN)) {
                }
                s->pl_step[i] = e->step; /* that step is the sender's from here */
                if (KVF_PLAN_CLAIMED(v) > e->first) {
                        if (sender_copies_owe(s, i, KVF_PROGRESS_PACK(e->step, KVF_PLAN_CLAIMED(v)),
                                              KVF_PLAN_GEN(v)) < 0 && failed)
                                failed[i] = 1;
                } else
                        r->flags &= ~KVF_REQF_ENGINE_COPY;
        }
}
