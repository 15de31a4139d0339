/*
 * kvf-sim's verifying half (sim.h): the content every block is stamped
 * with, the events the engine receives, the check of every destination
 * block, and each request's accounting.
 *
 * A request counts as correct when its completion says "finished" and its
 * arrival verified; a completion "finished" whose bytes do not verify is a
 * corruption, and makes the run fail.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "sim.h"
#include "sim_gpu.h" /* GPU mode */
#include "sim_sessions.h"

#define pattern kvf_sim_word

/* The words of an n-word block that fill() and check() visit: all, or with --verify sample
 * the first 8 and the last 8 (k jumps from 8 to n - 8). */
static inline uint64_t next_word(uint64_t k, uint64_t n, bool sample_only)
{
        return sample_only && n > 16 && k == 7 ? n - 8 : k + 1;
}

void kvf_sim_fill(uint8_t *p, uint64_t bytes, uint64_t key, bool sample_only)
{
        uint64_t *w = (uint64_t *)(void *)p, n = bytes / 8;
        for (uint64_t k = 0; k < n; k = next_word(k, n, sample_only))
                w[k] = pattern(key, k);
}

bool kvf_sim_check(const uint8_t *p, uint64_t bytes, uint64_t key, bool sample_only)
{
        const uint64_t *w = (const uint64_t *)(const void *)p;
        uint64_t n = bytes / 8;
        for (uint64_t k = 0; k < n; k = next_word(k, n, sample_only))
                if (w[k] != pattern(key, k))
                        return false;
        return true;
}

static void free_src(struct sim *s, struct sim_req *r)
{
        if (!r->src_freed) {
                kvf_sim_pool_give(&s->pre[r->pi].pool, r->src, r->n_src);
                r->src_freed = true;
        }
}

static void free_dst(struct sim *s, struct sim_req *r)
{
        if (!r->dst_freed) {
                kvf_sim_pool_give(&s->dec[r->di].pool, r->dst, r->n_dst);
                r->dst_freed = true;
        }
}

/* Once both sides have said how r ended (or the grace period for a failed network
 * transfer ran out): free its blocks and count it, once. */
static void maybe_done(struct sim *s, struct sim_req *r)
{
        if (r->completion < 0 || r->verify_pending)
                return; /* (its blocks stay reserved until the batch check read them) */
        bool finished_ok = r->completion == KVF_STATUS_FINISHED;
        if (finished_ok && r->arrival < 0)
                return; /* the arrival is on its way */
        /* A failed network transfer: its frames may still be in flight. The decode side
         * frees the blocks on the error arrival (published after those frames are fenced
         * off), or after a grace period if the peer could not be told. */
        if (!finished_ok && s->o.transport != KVF_TRANSPORT_IPC && r->arrival < 0 &&
            kvf_now_ns() - r->completion_seen_ns < 10000000000ull)
                return;
        if (r->src_freed && r->dst_freed)
                return;
        free_src(s, r);
        free_dst(s, r);
        struct sim_inst *pre = &s->pre[r->pi], *dec = &s->dec[r->di];
        s->done_reqs++;
        pre->done++;
        dec->done++;
        if (finished_ok) {
                if (r->arrival != KVF_STATUS_FINISHED || !r->verified) {
                        s->corrupt++;
                        fprintf(stderr, "%s: CORRUPT: request %s reported finished but %s\n",
                                KVF_SIM_PROG, r->id,
                                r->arrival != KVF_STATUS_FINISHED ? "its arrival says otherwise"
                                                                  : "its bytes differ");
                } else {
                        s->finished++;
                        s->moved_bytes += r->bytes;
                        pre->finished++;
                        dec->finished++;
                        pre->bytes += r->bytes;
                        dec->bytes += r->bytes;
                        if (r->arrival_ns > r->last_layer_ns && r->last_layer_ns &&
                            r->completion_ns > r->last_layer_ns) {
                                s->tails[s->ntails++] = (struct sim_tail){
                                    .pi = r->pi,
                                    .di = r->di,
                                    .ns = r->arrival_ns - r->last_layer_ns,
                                    .cns = r->completion_ns - r->last_layer_ns,
                                    .left = r->late_task ? r->bytes
                                                         : (uint64_t)r->last_blocks *
                                                               kvf_sim_layer_block_bytes(&s->L) * s->o.ranks,
                                    .late = r->late_task,
                                    .seen_ns = r->sender_last_ns ? (int64_t)(r->sender_last_ns - r->last_layer_ns) : 0,
                                    .notice_ns = r->notice_ns ? (int64_t)(r->notice_ns - r->last_layer_ns) : 0,
                                    .seq = r->seq,
                                    .at_ns = r->last_layer_ns > s->t_start ? r->last_layer_ns - s->t_start : 0};
                        }
                }
        } else {
                s->failed++;
                pre->failed++;
                dec->failed++;
                s->unexpected_failures +=
                    !(r->completion == KVF_STATUS_CANCELLED && r->cancel_sent);
                s->fail_by_status[r->completion]++;
                if (r->arrival == KVF_STATUS_FINISHED)
                        s->bad_status_pairs++;
        }
}

static struct sim_req *find_req(struct sim *s, const char *id)
{
        unsigned long v;
        if (id[0] != 'r')
                return NULL;
        v = strtoul(id + 1, NULL, 10);
        return v < s->nreq && !strcmp(s->reqs[v].id, id) ? &s->reqs[v] : NULL;
}

/* Mixed mode: the request of task id "r<seq>.d<j>" and its decode rank *j. */
static struct sim_req *find_part(struct sim *s, const char *id, unsigned *j)
{
        char *end;
        unsigned long v;
        if (id[0] != 'r')
                return NULL;
        v = strtoul(id + 1, &end, 10);
        if (v >= s->nreq || strncmp(end, ".d", 2))
                return NULL;
        *j = (unsigned)strtoul(end + 2, NULL, 10);
        struct sim_req *r = &s->reqs[v];
        char want[64];
        kvf_sim_tp_task_id(r, *j, want, sizeof(want));
        return *j < s->o.dranks && !strcmp(want, id) ? r : NULL;
}

/* The prefill instance of the oldest admitted request still waiting for its completion
 * (completions come about in the order of admission). */
static unsigned likely_next(struct sim *s)
{
        while (s->oldest < s->nreq && s->reqs[s->oldest].completion >= 0)
                s->oldest++;
        for (unsigned i = s->oldest; i < s->nreq && i < s->oldest + 64; i++)
                if (s->reqs[i].admitted && s->reqs[i].completion < 0)
                        return s->reqs[i].pi;
        return 0;
}

/* The arrival names the prefill instance that sent r (kvferry.h: an arrival's peer is the
 * prefill instance): one of its ranks' names. */
static bool from_source(const struct sim *s, const struct sim_req *r, const char *peer)
{
        for (unsigned k = 0; k < s->o.ranks; k++)
                if (!strcmp(s->pre[r->pi].o->name[k], peer))
                        return true;
        return false;
}

/* GPU mode: queue r's destination blocks on decode rank k's check queue (checked by the next
 * sim_gpu_check of k); their bytes. */
static uint64_t expect_gpu(struct sim *s, const struct sim_req *r, unsigned k)
{
        const struct kvf_layout_info *L = &s->L;
        struct kvf_client *c = kvf_group_member(s->dec[r->di].g, k);
        for (uint32_t l = 0; l < s->layers; l++)
                for (uint32_t t = 0; t < s->tensors; t++) {
                        const uint8_t *base = kvf_cache_tensor(c, l, (int)t);
                        uint64_t tb = kvf_sim_tensor_bytes(L, t);
                        for (uint32_t i = 0; i < r->n_dst; i++) {
                                uint64_t key = kvf_sim_block_key(r->seq, k, l, t, r->first + i, false);
                                sim_gpu_expect(s->sg, k, base + (uint64_t)r->dst[i] * tb, tb, key);
                        }
                }
        return (uint64_t)s->layers * r->n_dst * kvf_sim_layer_block_bytes(L);
}

/* GPU mode: every byte of every destination block compared on the decode GPU, one request at a
 * time (after a batch check found a difference: which request, and where). */
static void verify_gpu(struct sim *s, struct sim_req *r)
{
        r->verified = true;
        for (unsigned k = 0; k < s->o.ranks && r->verified; k++) {
                uint64_t bytes = expect_gpu(s, r, k);
                uint64_t first = 0;
                long bad = sim_gpu_check(s->sg, k, &first);
                if (bad != 0) {
                        uint64_t i = first % r->n_dst, lt = first / r->n_dst;
                        fprintf(stderr,
                                "%s: request %s: rank %u: %ld blocks differ, the first layer %llu "
                                "tensor %llu dest block %u (#%llu)%s\n",
                                KVF_SIM_PROG, r->id, k, bad, (unsigned long long)(lt / s->tensors),
                                (unsigned long long)(lt % s->tensors), r->dst[i],
                                (unsigned long long)i, bad < 0 ? " (the check itself failed)" : "");
                        r->verified = false;
                } else {
                        s->verified_bytes += bytes;
                }
        }
}

/* Check every destination block of r on every rank; sets r->verified. */
static void verify(struct sim *s, struct sim_req *r)
{
        const struct kvf_layout_info *L = &s->L;
        if (s->mixed) { /* (GPU mode too: its rows are keyed by head and token) */
                r->verified = kvf_sim_tp_verify(s, r);
                return;
        }
        if (s->sg) {
                verify_gpu(s, r);
                return;
        }
        r->verified = true;
        for (unsigned k = 0; k < s->o.ranks && r->verified; k++) {
                struct kvf_client *c = kvf_group_member(s->dec[r->di].g, k);
                for (uint32_t l = 0; l < s->layers && r->verified; l++)
                        for (uint32_t t = 0; t < s->tensors && r->verified; t++) {
                                const uint8_t *base = kvf_cache_tensor(c, l, (int)t);
                                uint64_t tb = kvf_sim_tensor_bytes(L, t);
                                for (uint32_t i = 0; i < r->n_dst; i++) {
                                        uint64_t key =
                                            kvf_sim_block_key(r->seq, k, l, t, r->first + i, false);
                                        if (!kvf_sim_check(base + (uint64_t)r->dst[i] * tb, tb, key,
                                                           s->o.sample_only)) {
                                                fprintf(stderr,
                                                        "%s: request %s: rank %u layer %u "
                                                        "tensor %u dest block %u (#%u) differs\n",
                                                        KVF_SIM_PROG, r->id, k, l, t, r->dst[i], i);
                                                r->verified = false;
                                                break;
                                        }
                                        s->verified_bytes += tb;
                                }
                        }
        }
}

static void completed(struct sim *s, struct sim_req *r);

/* A completion from prefill instance p. */
static void on_completion(struct sim *s, unsigned p, const struct kvf_event *ev)
{
        struct sim_req *r = find_req(s, ev->request_id);
        if (!r || ev->type != KVF_EVENT_COMPLETION) {
                if (ev->type == KVF_EVENT_COMPLETION)
                        fprintf(stderr, "%s: completion for unknown request '%s': %s: %s\n",
                                KVF_SIM_PROG, ev->request_id, kvf_status_name(ev->status),
                                ev->reason);
                return;
        }
        if (!r->admitted || r->pi != p) {
                fprintf(stderr,
                        "%s: CORRUPT: a completion of %s from prefill instance %s, which "
                        "did not submit it\n",
                        KVF_SIM_PROG, r->id, s->pre[p].o->name[0]);
                s->corrupt++;
                return;
        }
        if (r->completion >= 0) {
                fprintf(stderr, "%s: DUPLICATE completion for %s\n", KVF_SIM_PROG, r->id);
                s->corrupt++;
                return;
        }
        r->completion = ev->status;
        simlog_event('C', r->id, ev->status);
        r->completion_seen_ns = kvf_now_ns();
        r->bytes = ev->bytes;
        r->completion_ns = ev->done_ns;
        r->sender_last_ns = ev->last_layer_ns;
        snprintf(r->reason, sizeof(r->reason), "%s", ev->reason);
        completed(s, r);
}

/* r's completion is known (every part's, in mixed mode): report a failure, count it. */
static void completed(struct sim *s, struct sim_req *r)
{
        if (r->completion != KVF_STATUS_FINISHED && !s->o.quiet && !r->cancel)
                fprintf(stderr, "%s: request %s: %s: %s\n", KVF_SIM_PROG, r->id,
                        kvf_status_name(r->completion), r->reason);
        maybe_done(s, r);
}

/* Mixed mode: a completion from rank i of prefill instance p, for one task of a request; the
 * request's completion once every task's came (the first status other than finished wins). */
static void on_completion_part(struct sim *s, unsigned p, unsigned i, const struct kvf_event *ev)
{
        unsigned j = 0;
        if (ev->type != KVF_EVENT_COMPLETION)
                return;
        struct sim_req *r = find_part(s, ev->request_id, &j);
        if (!r) {
                fprintf(stderr, "%s: completion for unknown request '%s': %s: %s\n", KVF_SIM_PROG,
                        ev->request_id, kvf_status_name(ev->status), ev->reason);
                return;
        }
        uint64_t bit = 1ull << (i * KVF_SIM_MAX_RANKS + j);
        if (!r->admitted || r->pi != p || !s->sends[i][j] || (r->cparts & bit)) {
                fprintf(stderr,
                        "%s: CORRUPT: %s completion of %s from rank %u of prefill instance %s%s\n",
                        KVF_SIM_PROG, r->cparts & bit ? "a second" : "a", ev->request_id, i,
                        s->pre[p].o->name[0],
                        r->cparts & bit ? "" : ", which did not submit it");
                s->corrupt++;
                return;
        }
        r->cparts |= bit;
        r->bytes += ev->bytes;
        r->completion_ns = ev->done_ns > r->completion_ns ? ev->done_ns : r->completion_ns;
        if (ev->last_layer_ns > r->sender_last_ns)
                r->sender_last_ns = ev->last_layer_ns;
        if (ev->status != KVF_STATUS_FINISHED && r->cstat == KVF_STATUS_FINISHED) {
                r->cstat = ev->status;
                snprintf(r->reason, sizeof(r->reason), "%s: %s", ev->request_id, ev->reason);
        }
        if ((unsigned)__builtin_popcountll(r->cparts) < s->ntasks)
                return;
        r->completion = r->cstat;
        simlog_event('C', r->id, r->cstat);
        r->completion_seen_ns = kvf_now_ns();
        completed(s, r);
}

static void arrived(struct sim *s, struct sim_req *r, int status);

/*
 * GPU mode: finished arrivals are checked in batches. Each check is a kernel and a wait for
 * it on every decode rank; one per request and rank put the simulator's own waits on the
 * path it measures, growing with the decode ranks (a 2 -> 8 split: eight per request). So a
 * request's blocks are queued on each rank's check queue as it arrives, and one check per
 * rank reads up to VERIFY_BATCH requests; its blocks stay reserved until then. A batch with a
 * difference is checked again one request at a time, which says where. The batch is checked
 * when it is full and whenever the simulator waits (kvf_sim_poll_events with a timeout), so
 * no request waits on a batch that is not filling.
 */
#define VERIFY_BATCH 64

/* The decode ranks a request lands on: the decode group's (mixed mode), else the run's. */
static unsigned decode_ranks(const struct sim *s)
{
        return s->mixed ? s->o.dranks : s->o.ranks;
}

/* Queue r for the batch check: true, or false (no room: verify it now). */
static bool queue_verify(struct sim *s, struct sim_req *r)
{
        if (s->nvq == s->vcap) {
                unsigned cap = s->vcap ? 2 * s->vcap : VERIFY_BATCH;
                struct sim_req **q = realloc(s->vq, cap * sizeof(*q));
                if (!q)
                        return false;
                s->vq = q;
                s->vcap = cap;
        }
        uint64_t bytes = 0;
        for (unsigned k = 0; k < decode_ranks(s); k++)
                bytes += s->mixed ? kvf_sim_tp_expect_gpu(s, r, k) : expect_gpu(s, r, k);
        r->verify_pending = true;
        r->verify_bytes = bytes;
        s->vq[s->nvq++] = r;
        return true;
}

/* Check the batch on every decode rank; then each of its requests is done. */
static void flush_verify(struct sim *s)
{
        if (!s->nvq)
                return;
        unsigned ranks = decode_ranks(s), n = s->nvq;
        bool clean = true;
        for (unsigned k = 0; k < ranks; k++) {
                uint64_t first;
                if (sim_gpu_check(s->sg, k, &first) != 0)
                        clean = false;
        }
        s->nvq = 0;
        for (unsigned i = 0; i < n; i++) {
                struct sim_req *r = s->vq[i];
                r->verify_pending = false;
                if (clean) {
                        r->verified = !s->mixed || kvf_sim_tp_gpu_content(s, r);
                        s->verified_bytes += r->verified ? r->verify_bytes : 0;
                } else {
                        verify(s, r); /* one at a time: which, and where */
                }
                maybe_done(s, r);
        }
}

/* An arrival on decode instance d. */
static void on_arrival(struct sim *s, unsigned d, const struct kvf_event *ev)
{
        struct sim_req *r = find_req(s, ev->request_id);
        if (!r || ev->type != KVF_EVENT_ARRIVAL)
                return;
        /* Blocks that land on a decode instance other than the one that reserved them (or
         * from another source) land on blocks that are another request's. */
        if (!r->admitted || r->di != d || !from_source(s, r, ev->peer)) {
                fprintf(stderr,
                        "%s: CORRUPT: an arrival of %s on decode instance %s from '%s'; it was "
                        "sent by %s to %s\n",
                        KVF_SIM_PROG, r->id, s->dec[d].o->name[0], ev->peer,
                        s->pre[r->pi].o->name[0], r->admitted ? s->dec[r->di].o->name[0] : "none");
                s->corrupt++;
                return;
        }
        if (r->arrival == KVF_STATUS_FINISHED) {
                fprintf(stderr, "%s: DUPLICATE arrival for %s\n", KVF_SIM_PROG, r->id);
                s->corrupt++;
                return;
        }
        r->arrival_ns = ev->done_ns;
        r->notice_ns = ev->accept_ns;
        arrived(s, r, ev->status);
}

/* r's arrival is known (every part's, in mixed mode): check its blocks, count it. */
static void arrived(struct sim *s, struct sim_req *r, int status)
{
        simlog_event('A', r->id, status);
        /* A finished arrival after the completion said otherwise: the two sides
         * disagree (maybe_done counts it when the arrival came first). */
        if (status == KVF_STATUS_FINISHED && r->completion > 0 && r->dst_freed) {
                fprintf(stderr, "%s: request %s: completion '%s' but arrival 'finished'\n",
                        KVF_SIM_PROG, r->id, kvf_status_name(r->completion));
                s->bad_status_pairs++;
        }
        r->arrival = status;
        if (status == KVF_STATUS_FINISHED && !r->dst_freed && s->sg && queue_verify(s, r))
                return; /* maybe_done once the batch is checked */
        if (status == KVF_STATUS_FINISHED && !r->dst_freed)
                verify(s, r);
        maybe_done(s, r);
}

/* Mixed mode: an arrival on rank j of decode instance d, of one task of a request; the
 * request's arrival once every task's came. */
static void on_arrival_part(struct sim *s, unsigned d, unsigned j, const struct kvf_event *ev)
{
        unsigned jj = 0;
        if (ev->type != KVF_EVENT_ARRIVAL)
                return;
        struct sim_req *r = find_part(s, ev->request_id, &jj);
        if (!r)
                return;
        int i = r->admitted ? kvf_sim_tp_prefill_rank(s, r, ev->peer) : -1;
        uint64_t bit = i < 0 ? 0 : 1ull << ((unsigned)i * KVF_SIM_MAX_RANKS + j);
        if (i < 0 || r->di != d || jj != j || !s->sends[i][j]) {
                fprintf(stderr,
                        "%s: CORRUPT: an arrival of %s on rank %u of decode instance %s from "
                        "'%s'; it was sent by %s to %s\n",
                        KVF_SIM_PROG, ev->request_id, j, s->dec[d].o->name[0], ev->peer,
                        s->pre[r->pi].o->name[0], r->admitted ? s->dec[r->di].o->name[0] : "none");
                s->corrupt++;
                return;
        }
        if (r->aparts & bit) {
                fprintf(stderr, "%s: DUPLICATE arrival for %s from %s\n", KVF_SIM_PROG,
                        ev->request_id, ev->peer);
                s->corrupt++;
                return;
        }
        r->aparts |= bit;
        if (ev->done_ns > r->arrival_ns)
                r->arrival_ns = ev->done_ns;
        if (ev->status != KVF_STATUS_FINISHED && r->astat == KVF_STATUS_FINISHED)
                r->astat = ev->status;
        if ((unsigned)__builtin_popcountll(r->aparts) < s->ntasks)
                return;
        arrived(s, r, r->astat);
}

/* Mixed mode: every rank's events, taken one by one (a task's parts come from some ranks of
 * a group, not all). 1 when there was any. */
static int take_parts(struct sim *s)
{
        struct kvf_event ev;
        int any = 0;
        for (unsigned p = 0; p < s->npre; p++)
                for (unsigned i = 0; i < s->o.ranks; i++)
                        while (kvf_poll(kvf_group_member(s->pre[p].g, i), &ev, 0) > 0) {
                                on_completion_part(s, p, i, &ev);
                                any = 1;
                        }
        for (unsigned d = 0; d < s->ndec; d++)
                for (unsigned j = 0; j < s->o.dranks; j++)
                        while (kvf_poll(kvf_group_member(s->dec[d].g, j), &ev, 0) > 0) {
                                on_arrival_part(s, d, j, &ev);
                                any = 1;
                        }
        return any;
}

/* Mixed mode: rank k of every rank of every instance, prefill ranks first. */
static struct kvf_client *part_client(struct sim *s, unsigned k)
{
        const unsigned np = s->npre * s->o.ranks;
        return k < np ? kvf_group_member(s->pre[k / s->o.ranks].g, k % s->o.ranks)
                      : kvf_group_member(s->dec[(k - np) / s->o.dranks].g, (k - np) % s->o.dranks);
}

static void on_part(struct sim *s, unsigned k, const struct kvf_event *ev)
{
        const unsigned np = s->npre * s->o.ranks;
        if (k < np)
                on_completion_part(s, k / s->o.ranks, k % s->o.ranks, ev);
        else
                on_arrival_part(s, (k - np) / s->o.dranks, (k - np) % s->o.dranks, ev);
}

/* Mixed mode: take every event there is; when there is none, wait up to timeout_ms for one,
 * on every rank's doorbell at once (kvf_poll_any); with more ranks than it takes, on each in
 * turn, at most a millisecond at a time. */
static void poll_parts(struct sim *s, int timeout_ms)
{
        if (take_parts(s) || timeout_ms <= 0)
                return;
        const unsigned n = s->npre * s->o.ranks + s->ndec * s->o.dranks;
        uint64_t end = kvf_now_ns() + (uint64_t)timeout_ms * 1000000ull;
        const bool any = n <= 64; /* what kvf_poll_any takes */
        struct kvf_client *cs[64];
        for (unsigned k = 0; any && k < n; k++)
                cs[k] = part_client(s, k);
        do {
                uint64_t now = kvf_now_ns();
                if (now >= end)
                        return;
                struct kvf_event ev;
                unsigned k = any ? 0 : s->poll_turn++ % n;
                int left_ms = (int)((end - now + 999999) / 1000000);
                uint64_t t0 = kvf_now_ns();
                int got = any ? kvf_poll_any(cs, n, &ev, left_ms) : kvf_poll(part_client(s, k), &ev, 1);
                s->event_wait_ns += kvf_now_ns() - t0;
                if (got > 0) {
                        /* (an event found here is handled at once, by the rank's own handler) */
                        on_part(s, any ? ev.rank : k, &ev);
                        take_parts(s);
                        return;
                }
        } while (!take_parts(s));
}

static void poll_events(struct sim *s, int timeout_ms);

void kvf_sim_poll_events(struct sim *s, int timeout_ms)
{
        uint64_t t0 = kvf_now_ns();
        poll_events(s, timeout_ms);
        s->phase_ns[SIM_PH_POLL] += kvf_now_ns() - t0;
}

static void poll_events(struct sim *s, int timeout_ms)
{
        struct kvf_event ev;
        const bool waits = timeout_ms > 0; /* the simulator waits for something: check the batch */
        if (kvf_now_ns() - s->last_sweep > 100000000ull) {
                /* failed network transfers whose grace period ran out */
                s->last_sweep = kvf_now_ns();
                for (unsigned i = 0; i < s->nreq; i++)
                        if (s->reqs[i].completion > 0 && !s->reqs[i].dst_freed)
                                maybe_done(s, &s->reqs[i]);
        }
        for (unsigned i = 0; i < s->npre; i++)
                simlog_previous(s->pre[i].g, false, s->o.ranks);
        for (unsigned i = 0; i < s->ndec; i++)
                simlog_previous(s->dec[i].g, true, s->o.dranks);
        if (s->mixed) {
                poll_parts(s, timeout_ms);
                if (s->nvq >= VERIFY_BATCH || (s->nvq && waits))
                        flush_verify(s);
                return;
        }
        /* One doorbell per instance and no way to sleep on several: wait on the prefill
         * instance whose completion is likely next, then take what every one has. */
        unsigned w = s->npre > 1 && timeout_ms ? likely_next(s) : 0;
        for (;;) {
                uint64_t t0 = kvf_now_ns();
                int got = kvf_group_poll(s->pre[w].g, &ev, timeout_ms);
                if (timeout_ms)
                        s->event_wait_ns += kvf_now_ns() - t0;
                if (got <= 0)
                        break;
                timeout_ms = 0;
                on_completion(s, w, &ev);
        }
        for (unsigned p = 0; p < s->npre; p++)
                while (p != w && kvf_group_poll(s->pre[p].g, &ev, 0) > 0)
                        on_completion(s, p, &ev);
        for (unsigned d = 0; d < s->ndec; d++)
                while (kvf_group_poll(s->dec[d].g, &ev, 0) > 0)
                        on_arrival(s, d, &ev);
        if (s->nvq >= VERIFY_BATCH || (s->nvq && waits))
                flush_verify(s);
}
