/*
 * Same-host copies (ipc): the runs of every request a progress word (or a
 * task, a chunk) makes ready are gathered into one batch, submitted to the
 * cache backend at once (a GPU backend runs one kernel for it). What happened
 * to a request's copies goes up as news (sender_copies_news), never as a call:
 * request.c moves a request from LANDING to LANDED once no copy of it is
 * gathered or in flight, and fails exactly the requests a failed batch
 * carried ("write error"). The host backend completes a batch before submit
 * returns.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "doorbell.h"
#include "err.h"
#include "layout.h"
#include "log.h"
#include "registration.h"
#include "sender.h"

int sender_copies_init(struct sender *s)
{
        uint32_t n = s->ctl.hdr->reqtab_slots;
        s->cp.inflight = calloc(n, sizeof(*s->cp.inflight));
        s->cp.state = calloc(n, 1);
        s->cp.slots = malloc(n * sizeof(*s->cp.slots));
        s->cp.owing = calloc(n, sizeof(*s->cp.owing));
        s->cp.news = malloc(n * sizeof(*s->cp.news));
        s->cp.why = calloc(n, sizeof(*s->cp.why));
        if (!s->cp.inflight || !s->cp.state || !s->cp.slots || !s->cp.owing || !s->cp.news || !s->cp.why)
                return kvf_err_set(-ENOMEM, "out of memory for the copy batches of %u slots", n);
        return 0;
}

void sender_copies_free(struct sender *s)
{
        while (s->cp.flight) {
                struct copy_batch *cb = s->cp.flight;
                s->cp.flight = cb->next;
                free(cb->slots);
                free(cb);
        }
        s->cp.flight_tail = NULL;
        s->cp.nflight = 0;
        free(s->cp.runs);
        free(s->cp.sorted);
        free(s->cp.inflight);
        free(s->cp.state);
        free(s->cp.slots);
        free(s->cp.owing);
        free(s->cp.owes);
        free(s->cp.news);
        free(s->cp.why);
        memset(&s->cp, 0, sizeof(s->cp));
}

/* Tell request.c about the slot (once per slot until it has heard). */
static void news(struct sender *s, uint32_t slot)
{
        if (s->cp.state[slot] & COPY_NEWS)
                return;
        s->cp.state[slot] |= COPY_NEWS;
        /* A ring of one entry per slot: a slot is in it at most once (COPY_NEWS). */
        s->cp.news[(s->cp.news_at + s->cp.nnews++) % s->ctl.hdr->reqtab_slots] = slot;
}

/* A copy of the slot failed: its bytes are undefined (the first failure is the reason). */
static void failed(struct sender *s, uint32_t slot, const char *why)
{
        if (!(s->cp.state[slot] & COPY_FAILED)) {
                s->cp.state[slot] |= COPY_FAILED;
                snprintf(s->cp.why[slot], sizeof(s->cp.why[slot]), "copy into peer '%s' failed: %s",
                         s->ctl.reqtab[slot].peer, why);
        }
        news(s, slot);
}

bool sender_copies_news(struct sender *s, uint32_t *slot, bool *fail, char *why, size_t whylen)
{
        if (!s->cp.nnews)
                return false;
        /* Oldest first: the order the batches completed in. */
        uint32_t i = s->cp.news[s->cp.news_at];
        s->cp.news_at = (s->cp.news_at + 1) % s->ctl.hdr->reqtab_slots;
        s->cp.nnews--;
        *slot = i;
        *fail = s->cp.state[i] & COPY_FAILED;
        if (*fail)
                snprintf(why, whylen, "%s", s->cp.why[i]);
        s->cp.state[i] &= (uint8_t)~(COPY_NEWS | COPY_FAILED);
        return true;
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
        uint64_t blocks = 0;

        uint32_t di = dst_index(s, r->peer_idx), nruns = nwords / 3;
        const struct kvf_tp_plan *pl = &p->plan;
        uint64_t bytes = 0;
        const uint32_t ndst = r->n_dst ? r->n_dst : r->n_send;
        if (pl->npieces) {
                /* Another tensor-parallel split or block size: the plan's pieces of each source
                 * block, one run each (slices of consecutive blocks are never contiguous).
                 * Send position i is piece group i / src_per_group; a piece past the last
                 * destination block (tokens beyond the request's) is not copied. */
                nruns = 0;
                for (uint32_t k = 0; k < nwords; k += 3)
                        nruns += runs[k + 2] * pl->npieces;
        }
        if (grow_runs(s, (l1 - l0) * s->tensors * nruns) < 0)
                return kvf_err_set(-ENOMEM, "out of memory for a copy batch");
        for (uint32_t l = l0; l < l1; l++)
                for (uint32_t t = 0; t < s->tensors; t++)
                        for (uint32_t k = 0; k < nwords; k += 3) {
                                uint64_t bb = kvf_layout_tensor_bytes(L, t);
                                if (!pl->npieces) {
                                        s->cp.runs[s->cp.nruns++] = (struct kvf_copy_run){
                                                .dst = di,
                                                .src_off = kvf_layout_offset(L, l, t, runs[k]),
                                                .dst_off = kvf_layout_offset(PL, l, t, dst[runs[k + 1]]),
                                                .bytes = runs[k + 2] * bb};
                                        blocks += runs[k + 2];
                                        bytes += runs[k + 2] * bb;
                                        continue;
                                }
                                for (uint32_t b = 0; b < runs[k + 2]; b++) {
                                        uint32_t dpos;
                                        for (uint32_t x = 0; kvf_tp_piece_next(pl, runs[k + 1] + b, ndst, &x, &dpos); x++) {
                                                const struct kvf_tp_piece *c = &pl->pieces[x];
                                                s->cp.runs[s->cp.nruns++] = (struct kvf_copy_run){
                                                        .dst = di,
                                                        .src_off = kvf_layout_offset(L, l, t, runs[k] + b) + c->soff,
                                                        .dst_off = kvf_layout_offset(PL, l, t, dst[dpos]) + c->doff,
                                                        .bytes = c->bytes};
                                                bytes += c->bytes;
                                        }
                                }
                                blocks += runs[k + 2];
                        }
        if (!(s->cp.state[slot] & COPY_IN_BATCH)) {
                s->cp.state[slot] |= COPY_IN_BATCH;
                s->cp.slots[s->cp.nslots++] = slot;
        }
        /* In the shared table before the caller moves the request's progress on: a
         * sender killed from here until the batch completes leaves copies that may
         * never have run (the batch not flushed yet, or its kernel gone with our
         * context) behind progress that says they did. The next sender sees the flag
         * and never reports the request finished. */
        r->flags |= KVF_REQF_COPY_PENDING;
        atomic_signal_fence(memory_order_seq_cst);
        r->descs += (uint64_t)(l1 - l0) * s->tensors * nruns; /* its descriptors: the copy runs */
        kvf_count(&s->ctl, KVF_CTR_BLOCKS_IPC, blocks);
        kvf_count(&s->ctl, KVF_CTR_BYTES_IPC, bytes);
        r->bytes += bytes;
        return 0;
}

/* Every request of the batch being built (or that was just refused) failed. */
static void fail_batch(struct sender *s, const char *why)
{
        for (uint32_t i = 0; i < s->cp.nslots; i++) {
                uint32_t slot = s->cp.slots[i];
                s->cp.state[slot] &= (uint8_t)~COPY_IN_BATCH;
                if (!s->cp.inflight[slot]) {
                        s->ctl.reqtab[slot].flags &= ~KVF_REQF_COPY_PENDING;
                }
                failed(s, slot, why);
        }
}

/*
 * The batch's runs by source offset, stable: least significant digit first, 11 bits a pass, as
 * many passes as the offsets have bits (a 1 GiB cache: 3), a pass skipped where every run has
 * the same digit. Into cp.sorted (as large as cp.runs), the two swapped after an odd number of
 * passes. A step's batch of 500 requests into 2 -> 8 is 30,000 runs: qsort's merge sort of
 * them was a tenth of the sender's time. -ENOMEM: left unsorted (only slower).
 */
int sender_copies_sort(struct sender *s)
{
        enum { BITS = 11, DIGITS = 1u << BITS };
        uint32_t n = s->cp.nruns;
        if (s->cp.capsorted < s->cp.caprun) {
                struct kvf_copy_run *t = realloc(s->cp.sorted, s->cp.caprun * sizeof(*t));
                if (!t)
                        return -ENOMEM;
                s->cp.sorted = t;
                s->cp.capsorted = s->cp.caprun;
        }
        struct kvf_copy_run *a = s->cp.runs, *b = s->cp.sorted;
        uint64_t bits = 0;
        for (uint32_t i = 0; i < n; i++)
                bits |= a[i].src_off;
        for (unsigned shift = 0; shift < 64 && (bits >> shift); shift += BITS) {
                uint32_t count[DIGITS] = {0};
                for (uint32_t i = 0; i < n; i++)
                        count[(a[i].src_off >> shift) & (DIGITS - 1)]++;
                if (count[(a[0].src_off >> shift) & (DIGITS - 1)] == n)
                        continue;
                for (uint32_t d = 0, sum = 0; d < DIGITS; d++) {
                        uint32_t c = count[d];
                        count[d] = sum;
                        sum += c;
                }
                for (uint32_t i = 0; i < n; i++)
                        b[count[(a[i].src_off >> shift) & (DIGITS - 1)]++] = a[i];
                struct kvf_copy_run *t = a;
                a = b;
                b = t;
        }
        if (a != s->cp.runs) {
                uint32_t cap = s->cp.caprun;
                s->cp.sorted = s->cp.runs;
                s->cp.runs = a;
                s->cp.caprun = s->cp.capsorted;
                s->cp.capsorted = cap;
        }
        return 0;
}

static int submit(struct sender *s, uint64_t *ticket)
{
        bool host = s->cp.ndst > 1 && s->own.host;
        for (uint32_t i = 0; host && i < s->cp.ndst; i++)
                host = s->cp.dst[i]->host;
        if (host && s->cp.nruns > 1)
                sender_copies_sort(s);
        uint64_t reused = 0;
        struct kvf_copy_batch b = {.src = &s->own, .dst = s->cp.dst, .ndst = s->cp.ndst,
                                   .runs = s->cp.runs, .nruns = s->cp.nruns, .reused = &reused};
        int rc = kvf_cache_copy_submit(&b, ticket);
        kvf_count(&s->ctl, KVF_CTR_COPY_BATCHES_REUSED, reused);
        return rc;
}

void sender_copies_flush(struct sender *s)
{
        if (!s->cp.nruns && !s->cp.nslots)
                return;
        uint64_t t0 = kvf_now_ns(), ticket = 0;
        struct copy_batch *cb = calloc(1, sizeof(*cb));
        uint32_t *slots = cb ? malloc(s->cp.nslots * sizeof(*slots) + 1) : NULL;
        int rc = !slots ? kvf_err_set(-ENOMEM, "out of memory for a copy batch")
                        : s->cp.nruns ? submit(s, &ticket) : 0;
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

/* One of the slot's batches is done (failed, or landed): news for request.c. */
static void batch_done(struct sender *s, uint32_t slot, int rc)
{
        if (rc < 0)
                failed(s, slot, kvf_err_msg());
        if (--s->cp.inflight[slot] || (s->cp.state[slot] & COPY_IN_BATCH))
                return; /* more of its copies still to land */
        s->ctl.reqtab[slot].flags &= ~KVF_REQF_COPY_PENDING;
        news(s, slot); /* no copy of it is out any more */
}

int sender_copies_owe(struct sender *s, uint32_t slot, uint64_t word, uint32_t gen)
{
        if (s->cp.nowes == s->cp.capowes) {
                uint32_t cap = s->cp.capowes ? 2 * s->cp.capowes : 64;
                struct copy_owe *o = realloc(s->cp.owes, cap * sizeof(*o));
                if (!o) /* cannot wait for them: the request cannot be reported finished */
                        return kvf_err_set(-ENOMEM, "out of memory to track the engine's copies");
                s->cp.owes = o;
                s->cp.capowes = cap;
        }
        s->cp.owes[s->cp.nowes++] = (struct copy_owe){
                .slot = slot, .gen = gen, .word = word, .session = s->ctl.reqtab[slot].session,
                .deadline_ns = kvf_now_ns() + 2 * s->request_timeout_ns};
        s->cp.inflight[slot]++;
        s->cp.owing[slot]++;
        s->ctl.reqtab[slot].flags |= KVF_REQF_ENGINE_COPY;
        return 0;
}

bool sender_copies_owing(const struct sender *s, uint32_t slot)
{
        return s->cp.owing[slot] != 0;
}

/* The engine's copies that have landed, or never will (its session is over). */
static void poll_owes(struct sender *s)
{
        /* Acquire: pairs with the engine's release store of landed (a host function's
         * store, or the GPU's write after the copies): their bytes are in place. */
        uint64_t landed = kvf_load_acquire(&s->ctl.exec->landed), now = 0;
        uint64_t live = kvf_engine_session(&s->ctl, false);
        for (uint32_t i = 0; i < s->cp.nowes;) {
                struct copy_owe *o = &s->cp.owes[i];
                const struct kvf_plan_entry *e = &s->ctl.plan[o->slot];
                int rc = 1;
                /* Or the entry's own landed word (the engine's batch of a step's last layer for
                 * this entry alone): the same claimed layers of the same gen have landed. Acquire,
                 * as for exec.landed. */
                if (landed >= o->word ||
                    kvf_load_acquire(&e->landed) == KVF_PLAN_CTL(o->gen, 0, KVF_PROGRESS_LAYERS(o->word))) {
                        /* Acquire: pairs with the engine's release store of err. */
                        if (KVF_PLAN_GEN(kvf_load_relaxed(&e->ctl)) == o->gen && kvf_load_acquire(&e->err))
                                rc = kvf_err_set(-EIO, "%.*s", (int)sizeof(e->why), e->why);
                        else
                                rc = 0;
                } else if (o->session != live || o->session == s->dead_session) {
                        /* Its context is gone, and what it had queued with it. */
                        rc = kvf_err_set(-EIO, "the engine session that was copying it ended");
                } else if ((now ? now : (now = kvf_now_ns())) > o->deadline_ns) {
                        rc = kvf_err_set(-EIO, "the engine's copies did not land in %llu ms",
                                         (unsigned long long)(2 * s->request_timeout_ns / 1000000));
                        kvf_errlog(&s->ctl, KVF_ROLE_SENDER, "req %s: %s", s->ctl.reqtab[o->slot].request_id,
                                   kvf_err_msg());
                }
                if (rc > 0) {
                        i++;
                        continue;
                }
                uint32_t slot = o->slot;
                s->cp.owes[i] = s->cp.owes[--s->cp.nowes];
                if (!--s->cp.owing[slot] && !(kvf_load_relaxed(&s->ctl.plan[slot].ctl) & KVF_PLAN_OPEN))
                        s->ctl.reqtab[slot].flags &= ~KVF_REQF_ENGINE_COPY;
                batch_done(s, slot, rc);
        }
}

void sender_copies_poll(struct sender *s)
{
        if (s->cp.nowes)
                poll_owes(s);
        /* Oldest first; a batch still in flight stops the scan (they land in order). */
        while (s->cp.flight) {
                struct copy_batch *cb = s->cp.flight;
                int rc = kvf_cache_copy_poll(&s->own, cb->ticket);
                if (rc == 0)
                        break; /* (batches land in order: the oldest is the one to watch) */
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

bool sender_copies_room(const struct sender *s, uint32_t slot)
{
        return !(s->cp.state[slot] & (COPY_IN_BATCH | COPY_FAILED)) && s->cp.inflight[slot] < SENDER_COPY_DEPTH;
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

static bool is_engine(const struct kvf_cache *c)
{
        return c->be && c->be->id == KVF_BACKEND_ENGINE;
}

static bool ready(const struct kvf_cache *c)
{
        return c->base || c->parts;
}

static uint32_t token_major(const struct kvf_ctl_header *h)
{
        return h->backend == KVF_BACKEND_ENGINE ? kvf_load_acquire(&h->reg_token_major) : 0;
}

/* Remap an engine's caches that moved on. Host copies complete before submit returns, so
 * nothing is in flight from the old mapping; runs gathered but not submitted are flushed first.
 * GPU copies complete later: every one in flight lands (or fails) before the old mapping's
 * allocations are closed. */
static int refresh(struct sender *s, struct kvf_cache *c)
{
        if (!is_engine(c) || !kvf_reg_stale(c->reg_hdr, c))
                return 0;
        if (c->reg_hdr->reg_gpu)
                sender_copies_drain(s, 2000000000ull);
        else if (s->cp.nruns)
                sender_copies_flush(s);
        uint64_t was = c->reg_gen;
        int rc = kvf_cache_refresh(c);
        if (rc < 0) {
                kvf_warn("the engine's caches of '%s': %s", c->reg_hdr->instance, kvf_err_msg());
                return rc;
        }
        kvf_info("the engine's caches of '%s': generation %llu -> %llu (%s)", c->reg_hdr->instance,
                 (unsigned long long)was, (unsigned long long)c->reg_gen, ready(c) ? "mapped" : "waiting for the engine");
        return 0;
}

int sender_caches_check(struct sender *s, uint32_t peer_idx, uint32_t slot, char *why, size_t whylen)
{
        const struct kvf_ctl_header *me = s->ctl.hdr;
        int rc = refresh(s, &s->own);
        if (rc < 0) {
                snprintf(why, whylen, "instance '%s': %s", me->instance, kvf_err_msg());
                return rc;
        }
        if (!ready(&s->own)) {
                snprintf(why, whylen, "instance '%s' is waiting for the engine's caches: register them first "
                         "(kvf_register_caches, Client.register_caches)", me->instance);
                return -ENODEV;
        }
        if (peer_idx == UINT32_MAX)
                return 0;
        struct ipc_peer *p = &s->peers[peer_idx];
        const struct kvf_ctl_header *ph = p->ctl.hdr;
        if ((rc = refresh(s, &p->cache)) < 0) {
                snprintf(why, whylen, "peer '%s': %s", p->name, kvf_err_msg());
                return rc;
        }
        if (!ready(&p->cache)) {
                snprintf(why, whylen, "peer '%s' is waiting for its engine's caches (its engine has not registered "
                         "them)", p->name);
                return -ENODEV;
        }
        uint32_t tm = token_major(me), ptm = token_major(ph);
        if (tm != ptm) {
                snprintf(why, whylen, "peer layout mismatch with '%s': its blocks are %s, here %s: both engines "
                         "must lay blocks out the same way (token_major)", p->name,
                         ptm ? "token-major [block_size, heads, head_dim]" : "head-major [heads, block_size, head_dim]",
                         tm ? "token-major" : "head-major");
                return -EXDEV;
        }
        if (tm && p->plan.npieces) {
                snprintf(why, whylen, "peer layout mismatch with '%s': another tensor-parallel split, whose head "
                         "slices of token-major blocks are not contiguous: not supported", p->name);
                return -EXDEV;
        }
        if (slot == UINT32_MAX)
                return 0;
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        if (!r->own_reg_gen && !r->peer_reg_gen) {
                r->own_reg_gen = s->own.reg_gen;
                r->peer_reg_gen = p->cache.reg_gen;
        } else if (r->own_reg_gen != s->own.reg_gen) {
                snprintf(why, whylen, "the engine's caches of '%s' were registered anew during the transfer", me->instance);
                return -ESTALE;
        } else if (r->peer_reg_gen != p->cache.reg_gen) {
                snprintf(why, whylen, "the engine's caches of peer '%s' were registered anew during the transfer: "
                         "its blocks are not the ones reserved", p->name);
                return -ESTALE;
        }
        return 0;
}

void sender_caches_tick(struct sender *s)
{
        (void)refresh(s, &s->own);
        for (uint32_t i = 0; i < SENDER_MAX_PEERS; i++)
                if (s->peers[i].in_use)
                        (void)refresh(s, &s->peers[i].cache);
}
