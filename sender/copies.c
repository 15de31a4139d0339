/*
 * Same-host copies (ipc): the runs of every request a progress word (or a
 * task, a chunk) makes ready are gathered into one batch, submitted to the
 * cache backend at once (a GPU backend runs one kernel for it), and a request
 * goes FINISHING only once the batch that carried its last bytes has
 * completed (copies in flight). The host backend completes a batch before
 * submit returns; a failed batch becomes "write error" for exactly the
 * requests it carried.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "err.h"
#include "layout.h"
#include "log.h"
#include "sender.h"

int sender_copies_init(struct sender *s)
{
        uint32_t n = s->ctl.hdr->reqtab_slots;
        s->cp.inflight = calloc(n, sizeof(*s->cp.inflight));
        s->cp.state = calloc(n, 1);
        s->cp.slots = malloc(n * sizeof(*s->cp.slots));
        if (!s->cp.inflight || !s->cp.state || !s->cp.slots)
                return kvf_err_set(-ENOMEM, "out of memory for the copy batches of %u slots", n);
        return 0;
}

static int grow_runs(struct sender *s, uint32_t more)
{
        if (s->cp.nruns + more <= s->cp.caprun)
                return 0;
        uint32_t cap = s->cp.caprun ? s->cp.caprun : 1024;
        while (cap < s->cp.nruns + more)
                cap *= 2;
        struct kvf_copy_run *r = realloc(s->cp.runs, cap * sizeof(*r));
        if (!r)
                return -ENOMEM;
        s->cp.runs = r;
        s->cp.caprun = cap;
        return 0;
}

/* The batch's index of peer p's cache. */
static uint32_t dst_index(struct sender *s, uint32_t peer_idx)
{
        for (uint32_t i = 0; i < s->cp.ndst; i++)
                if (s->cp.dst_peer[i] == peer_idx)
                        return i;
        s->cp.dst_peer[s->cp.ndst] = peer_idx;
        s->cp.dst[s->cp.ndst] = &s->peers[peer_idx].cache;
        return s->cp.ndst++;
}

int sender_copies_add(struct sender *s, uint32_t slot, uint32_t l0, uint32_t l1, const uint32_t *runs,
                      uint32_t nwords)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        const struct ipc_peer *p = &s->peers[r->peer_idx];
        const struct kvf_cache_layout *L = s->layout, *PL = &p->cache.layout;
        const uint32_t *dst = kvf_slot_blocks(&s->ctl, slot) + s->ctl.hdr->max_blocks;
        uint64_t bb = L->block_bytes, blocks = 0;

        if (grow_runs(s, (l1 - l0) * s->tensors * (nwords / 3)) < 0)
                return kvf_err_set(-ENOMEM, "out of memory for a copy batch");
        uint32_t di = dst_index(s, r->peer_idx);
        for (uint32_t l = l0; l < l1; l++)
                for (uint32_t t = 0; t < s->tensors; t++)
                        for (uint32_t k = 0; k < nwords; k += 3) {
                                s->cp.runs[s->cp.nruns++] = (struct kvf_copy_run){
                                        .dst = di,
                                        .src_off = kvf_layout_offset(L, l, t, runs[k]),
                                        .dst_off = kvf_layout_offset(PL, l, t, dst[runs[k + 1]]),
                                        .bytes = runs[k + 2] * bb};
                                blocks += runs[k + 2];
                        }
        if (!(s->cp.state[slot] & COPY_IN_BATCH)) {
                s->cp.state[slot] |= COPY_IN_BATCH;
                s->cp.slots[s->cp.nslots++] = slot;
        }
        kvf_count(&s->ctl, KVF_CTR_BLOCKS_IPC, blocks);
        kvf_count(&s->ctl, KVF_CTR_BYTES_IPC, blocks * bb);
        r->bytes += blocks * bb;
        return 0;
}

/* Fail every request of the batch being built (or that was just refused). */
static void fail_batch(struct sender *s, const char *why)
{
        for (uint32_t i = 0; i < s->cp.nslots; i++) {
                uint32_t slot = s->cp.slots[i];
                s->cp.state[slot] &= (uint8_t)~COPY_IN_BATCH;
                sender_fail(s, slot, KVF_STATUS_WRITE, "copy into peer '%s' failed: %s",
                            s->ctl.reqtab[slot].peer, why);
        }
}

void sender_copies_flush(struct sender *s)
{
        if (!s->cp.nruns && !s->cp.nslots)
                return;
        struct kvf_copy_batch b = {.src = &s->own, .dst = s->cp.dst, .ndst = s->cp.ndst,
                                   .runs = s->cp.runs, .nruns = s->cp.nruns};
        uint64_t t0 = kvf_now_ns(), ticket = 0;
        struct copy_batch *cb = calloc(1, sizeof(*cb));
        uint32_t *slots = cb ? malloc(s->cp.nslots * sizeof(*slots) + 1) : NULL;
        int rc = !slots ? kvf_err_set(-ENOMEM, "out of memory for a copy batch")
                        : s->cp.nruns ? kvf_cache_copy_submit(&b, &ticket) : 0;
        if (rc < 0) {
                kvf_errlog(&s->ctl, KVF_ROLE_SENDER, "copy batch of %u runs refused: %s", s->cp.nruns,
                           kvf_err_msg());
                fail_batch(s, kvf_err_msg());
                free(slots);
                free(cb);
        } else {
                kvf_hist_add(&s->ctl.sender->hist[KVF_HIST_COPY], kvf_now_ns() - t0);
                cb->ticket = ticket;
                cb->slots = slots;
                cb->nslots = s->cp.nslots;
                for (uint32_t i = 0; i < s->cp.nslots; i++) {
                        uint32_t slot = s->cp.slots[i];
                        slots[i] = slot;
                        s->cp.state[slot] = (uint8_t)(s->cp.state[slot] & ~COPY_IN_BATCH);
                        s->cp.inflight[slot]++;
                        s->ctl.reqtab[slot].flags |= KVF_REQF_COPY_PENDING;
                }
                if (s->cp.flight_tail)
                        s->cp.flight_tail->next = cb;
                else
                        s->cp.flight = cb;
                s->cp.flight_tail = cb;
                s->cp.nflight++;
        }
        s->cp.nruns = s->cp.nslots = s->cp.ndst = 0;
        sender_copies_poll(s);
}

/* One of the slot's batches is done (failed, or landed). */
static void batch_done(struct sender *s, uint32_t slot, int rc)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        if (rc < 0) /* its bytes are undefined: never finished (decide ignores a decided slot) */
                sender_fail(s, slot, KVF_STATUS_WRITE, "copy into peer '%s' failed: %s", r->peer, kvf_err_msg());
        if (--s->cp.inflight[slot] || (s->cp.state[slot] & COPY_IN_BATCH))
                return; /* more of its copies still to land */
        bool waited = s->cp.state[slot] & COPY_AWAITED;
        s->cp.state[slot] = 0;
        r->flags &= ~KVF_REQF_COPY_PENDING;
        if (s->flags[slot])
                s->pending = true; /* what flush_slot held back for the copies */
        if (waited)
                sender_all_sent(s, slot); /* its last bytes have landed (no-op once decided) */
}

void sender_copies_poll(struct sender *s)
{
        /* Oldest first; a batch still in flight stops the scan (they land in order). */
        while (s->cp.flight) {
                struct copy_batch *cb = s->cp.flight;
                int rc = kvf_cache_copy_poll(&s->own, cb->ticket);
                if (rc == 0)
                        break;
                if (rc < 0)
                        kvf_errlog(&s->ctl, KVF_ROLE_SENDER, "copy batch of %u requests failed: %s",
                                   cb->nslots, kvf_err_msg());
                s->cp.flight = cb->next;
                if (!s->cp.flight)
                        s->cp.flight_tail = NULL;
                s->cp.nflight--;
                for (uint32_t i = 0; i < cb->nslots; i++)
                        batch_done(s, cb->slots[i], rc);
                free(cb->slots);
                free(cb);
        }
}

bool sender_copies_busy(const struct sender *s, uint32_t slot)
{
        return (s->cp.state[slot] & COPY_IN_BATCH) || s->cp.inflight[slot];
}

void sender_copies_await(struct sender *s, uint32_t slot)
{
        s->cp.state[slot] |= COPY_AWAITED;
}

void sender_copies_drain(struct sender *s, uint64_t timeout_ns)
{
        sender_copies_flush(s);
        uint64_t end = kvf_now_ns() + timeout_ns;
        while (s->cp.flight && kvf_now_ns() < end) {
                sender_copies_poll(s);
                if (s->cp.flight)
                        kvf_sleep_ns(100000);
        }
}
