/*
 * kvf-sim's engine half (sim.h), what an inference engine does with kvferry.
 *
 * Prefill side (one kvf_client per rank): admits requests whose prompt
 * lengths come from a trace, reserves source blocks, submits tasks (per
 * query, or chunked with chunk records), writes deterministic content per
 * (request, rank, layer, tensor, block) into its cache layer by layer, and
 * publishes a layer-done event after each layer at a chosen compute time.
 * Decode side: reserves destination blocks (fewer with a prefix hit); its
 * arrivals are sim_verify.c's.
 * GPU mode (s->sg, tools/sim_gpu.h): the content is written by each layer's
 * kernel, which also keeps the GPU busy for the layer's compute time, and
 * the layer-done goes on its stream (kvf_layer_done_on_stream).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomics.h"
#include "clock.h"
#include "opts.h"
#include "sim.h"
#include "sim_gpu.h" /* GPU mode */
#include "sim_sessions.h"

static uint64_t rnd(struct sim *s)
{
        uint64_t z = (s->rng_state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
}

static int pool_init(struct sim *s, struct sim_pool *p, uint32_t n)
{
        p->free = malloc(n * sizeof(uint32_t));
        if (!p->free)
                return -ENOMEM;
        /* Blocks handed out lowest first, like an engine's free list at start. */
        for (uint32_t i = 0; i < n; i++)
                p->free[i] = n - 1 - i;
        for (uint32_t i = n; s->o.scatter && i > 1; i--) {
                uint32_t j = (uint32_t)(rnd(s) % i), t = p->free[i - 1];
                p->free[i - 1] = p->free[j];
                p->free[j] = t;
        }
        p->n = p->cap = n;
        return 0;
}

static bool pool_take(struct sim_pool *p, uint32_t n, uint32_t *out)
{
        if (p->n < n)
                return false;
        for (uint32_t i = 0; i < n; i++)
                out[i] = p->free[--p->n];
        return true;
}

void kvf_sim_pool_give(struct sim_pool *p, const uint32_t *ids, uint32_t n)
{
        for (uint32_t i = n; i-- > 0;)
                p->free[p->n++] = ids[i];
}

static int load_trace(struct sim *s, const char *path, unsigned want)
{
        FILE *f = fopen(path, "r");
        char line[65536];
        if (!f) {
                fprintf(stderr, "%s: trace %s: %s\n", KVF_SIM_PROG, path, strerror(errno));
                return -1;
        }
        s->reqs = calloc(want, sizeof(*s->reqs));
        s->nreq = 0;
        uint32_t maxtok = s->o.max_tokens;
        while (s->nreq < want && fgets(line, sizeof(line), f)) {
                char *p = strstr(line, "\"input_length\"");
                if (!p)
                        continue;
                p = strchr(p, ':');
                unsigned long v = p ? strtoul(p + 1, NULL, 10) : 0;
                if (v == 0)
                        continue;
                struct sim_req *r = &s->reqs[s->nreq];
                r->seq = s->nreq;
                r->tokens = v > maxtok ? maxtok : (uint32_t)v;
                s->nreq++;
        }
        fclose(f);
        if (s->nreq == 0) {
                fprintf(stderr, "%s: trace %s has no input_length entries\n", KVF_SIM_PROG, path);
                return -1;
        }
        /* A short trace is replayed from the start. */
        for (unsigned i = s->nreq; i < want; i++) {
                s->reqs[i] = s->reqs[i % s->nreq];
                s->reqs[i].seq = i;
        }
        s->nreq = want;
        return 0;
}

/* The same shape of layers and blocks (the block counts may differ). */
static bool same_shape(const struct kvf_layout_info *a, const struct kvf_layout_info *b)
{
        return a->num_layers == b->num_layers && a->extra_layers == b->extra_layers &&
               a->key_only == b->key_only && a->block_size == b->block_size &&
               a->block_bytes == b->block_bytes;
}

/* Attach one instance (its ranks as a group), read its layout, make its pool. The instances of
 * a side share one layout: `first` is that side's first instance (NULL for itself). 0, or -1
 * after a message. */
static int attach_instance(struct sim *s, struct sim_inst *in, const struct sim_inst_opts *io,
                           const char *role, const struct sim_inst *first)
{
        in->o = io;
        unsigned ranks = strcmp(role, "decode") ? s->o.ranks : s->o.dranks;
        if (kvf_group_attach(io->name, ranks, 10000, &in->g) < 0) {
                fprintf(stderr, "%s: %s\n", KVF_SIM_PROG, kvf_last_error());
                return -1;
        }
        kvf_get_layout(kvf_group_member(in->g, 0), &in->L);
        if (first && !same_shape(&first->L, &in->L)) {
                fprintf(stderr,
                        "%s: %s instance %s: its layout is not that of %s (the %s instances must "
                        "share one layout; only their block counts may differ)\n",
                        KVF_SIM_PROG, role, io->name[0], first->o->name[0], role);
                return -1;
        }
        if (pool_init(s, &in->pool, in->L.num_blocks) < 0) {
                fprintf(stderr, "%s: %s instance %s: out of memory for %u block ids\n",
                        KVF_SIM_PROG, role, io->name[0], in->L.num_blocks);
                return -1;
        }
        return 0;
}

int kvf_sim_setup(struct sim *s)
{
        const struct sim_opts *o = &s->o;
        struct kvf_layout_info *L = &s->L;

        s->rng_state = o->seed;
        s->npre = o->nprefill;
        s->ndec = o->ndecode;
        for (unsigned i = 0; i < s->npre; i++)
                if (attach_instance(s, &s->pre[i], &o->prefill[i], "prefill",
                                    i ? &s->pre[0] : NULL) < 0)
                        return -1;
        for (unsigned i = 0; i < s->ndec; i++)
                if (attach_instance(s, &s->dec[i], &o->decode[i], "decode", i ? &s->dec[0] : NULL) <
                    0)
                        return -1;
        if (o->session_log &&
            simlog_open(o->session_log, kvf_session(kvf_group_member(s->pre[0].g, 0)),
                        kvf_session(kvf_group_member(s->dec[0].g, 0))) < 0) {
                fprintf(stderr, "%s: --session-log %s: %s\n", KVF_SIM_PROG, o->session_log,
                        strerror(errno));
                return -1;
        }
        *L = s->pre[0].L;
        s->Ld = s->dec[0].L;
        s->layers = L->num_layers + L->extra_layers;
        s->tensors = kvf_sim_kv_tensors(L) * (L->scale_bytes ? 2 : 1);
        if (kvf_sim_tp_setup(s) < 0)
                return -1;
        if (s->mixed && L->scale_bytes) {
                fprintf(stderr, "%s: caches with scale tensors move between equal layouts only\n", KVF_SIM_PROG);
                return -1;
        }
        /* The largest prompt every cache (and one request's block limit) can hold at once: half
         * of the smallest cache of each side, in that side's blocks. */
        uint64_t cap_tok = 4096ull * L->block_size;
        for (unsigned i = 0; i < s->npre + s->ndec; i++) {
                const struct sim_inst *in = i < s->npre ? &s->pre[i] : &s->dec[i - s->npre];
                uint64_t t = (uint64_t)(in->L.num_blocks / 2) * in->L.block_size;
                cap_tok = t < cap_tok ? t : cap_tok;
        }
        if (!s->o.max_tokens || s->o.max_tokens > cap_tok)
                s->o.max_tokens = (unsigned)cap_tok;
        if (load_trace(s, o->trace, o->requests) < 0)
                return -1;
        s->tails = calloc(s->nreq, sizeof(*s->tails));

        for (unsigned i = 0; i < s->nreq; i++) {
                struct sim_req *r = &s->reqs[i];
                snprintf(r->id, sizeof(r->id), "r%u", i);
                r->pi = i % s->npre;
                r->n_src = (r->tokens + L->block_size - 1) / L->block_size;
                r->first = 0;
                if (r->n_src > 1 && rnd(s) % 100 < o->prefix_pct &&
                    s->Ld.block_size == L->block_size) /* (no prefix in regrouped blocks) */
                        r->first = (uint32_t)(1 + rnd(s) % (r->n_src - 1) / 2);
                /* the decode side's blocks: as many as its block size needs for the tokens */
                r->n_dst = (r->tokens + s->Ld.block_size - 1) / s->Ld.block_size - r->first;
                r->src = malloc(r->n_src * sizeof(uint32_t));
                r->dst = malloc(r->n_dst * sizeof(uint32_t));
                r->completion = r->arrival = -1;
                r->src_freed = r->dst_freed = true; /* nothing reserved yet */
                r->late_task = o->chunk_tokens == 0 && rnd(s) % 100 < o->late_pct;
                r->cancel = rnd(s) % 100 < o->cancel_pct;
        }
        return 0;
}

/* The engine's ring is full: take events meanwhile (room comes as requests end). -ECANCELED
 * once stopped (a signal), -ETIMEDOUT after --timeout-s with no room: a wedged instance must not
 * hold the simulator (and whoever waits for it) forever. */
static int ring_full_wait(struct sim *s, uint64_t *since, const char *id)
{
        uint64_t now = kvf_now_ns();
        if (!*since)
                *since = now;
        if (kvf_load_relaxed(&s->stop))
                return -ECANCELED;
        if (now - *since > (uint64_t)s->o.timeout_s * 1000000000ull) {
                fprintf(stderr, "%s: %s: the engine's ring stayed full for %u s: giving up\n", KVF_SIM_PROG, id,
                        s->o.timeout_s);
                return -ETIMEDOUT;
        }
        kvf_sim_poll_events(s, 1);
        return 0;
}

/* Mixed mode: prefill rank k's tasks of r, one per decode rank it sends to. */
static int submit_mixed(struct sim *s, struct sim_req *r, uint64_t step, unsigned k)
{
        const struct sim_inst *pre = &s->pre[r->pi], *dec = &s->dec[r->di];
        for (unsigned j = 0; j < s->o.dranks; j++) {
                if (!s->sends[k][j])
                        continue;
                char id[64];
                kvf_sim_tp_task_id(r, j, id, sizeof(id));
                struct kvf_task t = {.request_id = id,
                                     .src_block_ids = r->src,
                                     .n_src = r->n_src,
                                     .dest_block_ids = r->dst,
                                     .n_dest = r->n_dst,
                                     .current_id = step,
                                     .transport = s->o.transport,
                                     .peer = dec->o->peer[j],
                                     .chunked = s->o.chunk_tokens > 0,
                                     .peer_session = kvf_session(kvf_group_member(dec->g, j))};
                int rc;
                uint64_t since = 0;
                while ((rc = kvf_submit_task(kvf_group_member(pre->g, k), &t)) == -EAGAIN)
                        if ((rc = ring_full_wait(s, &since, id)) < 0)
                                return rc;
                if (rc < 0) {
                        fprintf(stderr, "%s: submit %s to %s: %s\n", KVF_SIM_PROG, id,
                                pre->o->name[k], kvf_last_error());
                        return rc;
                }
        }
        return 0;
}

/* fn(client, task id, arg) for each of prefill rank k's tasks of r (a chunk record or a
 * cancel): its one task, or in mixed mode one per decode rank it sends to; retried while the
 * ring is full. */
static void each_task(struct sim *s, const struct sim_req *r, unsigned k,
                      int (*fn)(struct sim *, struct kvf_client *, const char *, void *), void *arg)
{
        struct kvf_client *c = kvf_group_member(s->pre[r->pi].g, k);
        uint64_t since = 0;
        if (!s->mixed) {
                while (fn(s, c, r->id, arg) == -EAGAIN)
                        if (ring_full_wait(s, &since, r->id) < 0)
                                return;
                return;
        }
        for (unsigned j = 0; j < s->o.dranks; j++) {
                char id[64];
                if (!s->sends[k][j])
                        continue;
                kvf_sim_tp_task_id(r, j, id, sizeof(id));
                since = 0;
                while (fn(s, c, id, arg) == -EAGAIN)
                        if (ring_full_wait(s, &since, id) < 0)
                                return;
        }
}

struct chunk_arg {
        uint64_t step;
        uint32_t to;
        bool last;
};

static int chunk_one(struct sim *s, struct kvf_client *c, const char *id, void *arg)
{
        const struct chunk_arg *a = arg;
        (void)s;
        return kvf_submit_chunk(c, id, a->step, a->to, a->last);
}

static int cancel_one(struct sim *s, struct kvf_client *c, const char *id, void *arg)
{
        (void)s, (void)arg;
        kvf_submit_cancel(c, id); /* (best effort, as before: the request may be over) */
        return 0;
}

static int submit_task_(struct sim *s, struct sim_req *r, uint64_t step);

static int submit_task(struct sim *s, struct sim_req *r, uint64_t step)
{
        uint64_t t0 = kvf_now_ns();
        int rc = submit_task_(s, r, step);
        s->phase_ns[SIM_PH_SUBMIT] += kvf_now_ns() - t0;
        return rc;
}

static int submit_task_(struct sim *s, struct sim_req *r, uint64_t step)
{
        const struct sim_inst *pre = &s->pre[r->pi], *dec = &s->dec[r->di];
        for (unsigned k = 0; s->mixed && k < s->o.ranks; k++)
                if (submit_mixed(s, r, step, k) < 0)
                        return -1;
        for (unsigned k = 0; !s->mixed && k < s->o.ranks; k++) {
                struct kvf_task t = {.request_id = r->id,
                                     .src_block_ids = r->src,
                                     .n_src = r->n_src,
                                     .dest_block_ids = r->dst,
                                     .n_dest = r->n_dst,
                                     .current_id = step,
                                     .transport = s->o.transport,
                                     .peer = dec->o->peer[k],
                                     .chunked = s->o.chunk_tokens > 0,
                                     /* as an engine should: the decode session that reserved
                                      * the blocks, passed along with their ids (otherwise the
                                      * prefill side binds the transfer to the decode session it
                                      * last heard of, which a new decode engine makes stale
                                      * until its connector has told) */
                                     .peer_session = kvf_session(kvf_group_member(dec->g, k))};
                int rc;
                uint64_t since = 0;
                while ((rc = kvf_submit_task(kvf_group_member(pre->g, k), &t)) == -EAGAIN)
                        if ((rc = ring_full_wait(s, &since, r->id)) < 0)
                                return rc;
                if (rc < 0) {
                        fprintf(stderr, "%s: submit %s to %s: %s\n", KVF_SIM_PROG, r->id,
                                pre->o->name[k], kvf_last_error());
                        return rc;
                }
        }
        r->submitted = true;
        simlog_event('S', r->id, 0);
        return 0;
}

/* Write layer l of request r's blocks covered by tokens [from, to) (all ranks). Not once the
 * request has ended (cancelled, failed) and its blocks were given back: they may be another
 * request's now, and an engine computes nothing more of a request it let go. */
static void write_layer(struct sim *s, struct sim_req *r, uint32_t l, uint32_t from, uint32_t to)
{
        if (r->src_freed)
                return;
        const uint64_t t0 = kvf_now_ns();
        const struct kvf_layout_info *L = &s->L;
        uint32_t j0 = from / L->block_size, j1 = (to + L->block_size - 1) / L->block_size;
        bool last = to >= r->tokens;
        for (unsigned k = 0; k < s->o.ranks; k++) {
                struct kvf_client *c = kvf_group_member(s->pre[r->pi].g, k);
                for (uint32_t t = 0; t < s->tensors; t++) {
                        uint8_t *base = kvf_cache_tensor(c, l, (int)t);
                        uint64_t tb = kvf_sim_tensor_bytes(L, t);
                        for (uint32_t j = j0; s->mixed && j < j1 && j < r->n_src; j++)
                                kvf_sim_tp_write(s, r, k, base, l, t, j, to, last);
                        for (uint32_t j = j0; !s->mixed && j < j1 && j < r->n_src; j++) {
                                /* A block the chunk leaves incomplete gets other bytes: sending it
                                 * before the chunk that completes it would show up in verify. */
                                bool partial = !last && (uint64_t)(j + 1) * L->block_size > to;
                                uint64_t key = kvf_sim_block_key(r->seq, k, l, t, j, partial);
                                uint8_t *p = base + (uint64_t)r->src[j] * tb;
                                if (s->sg) /* GPU mode: written by the layer's kernel */
                                        sim_gpu_fill(s->sg, k, p, tb, key);
                                else
                                        kvf_sim_fill(p, tb, key, s->o.sample_only);
                        }
                }
        }
        s->phase_ns[SIM_PH_WRITE] += kvf_now_ns() - t0;
}

/* The tokens of r one step prefills: a chunk, or all it has left. */
static uint32_t step_share(const struct sim *s, const struct sim_req *r)
{
        uint32_t left = r->tokens - r->done_tokens;
        return s->o.chunk_tokens && left > s->o.chunk_tokens ? s->o.chunk_tokens : left;
}

/*
 * One prefill engine: its instance, its forward steps. Each engine runs its own steps, one
 * layer at a time, as a GPU of its own would; kvf_sim_run interleaves them on this thread,
 * always publishing the layer-done that is due first. Engines of several prefill instances
 * start a fraction of a layer apart, as independent engines are not in step with each other.
 */
struct engine {
        struct sim_inst *in;
        unsigned next;           /* its next request to admit (its own: i mod npre = its index) */
        struct sim_req **active; /* the requests of its current step */
        uint32_t *from, *to;     /* ... and the tokens [from, to) this step prefills of each */
        unsigned nactive;
        uint64_t step; /* its current (or next) step */
        bool in_step;
        uint32_t layer;      /* in a step: the layer being computed */
        uint64_t due;        /* ... and when its compute time is over (its layer-done) */
        uint64_t not_before; /* its first step's start */
};

/* The decode instance for r: of those with room for it, the one with the most free blocks,
 * the next in turn after the last chosen on a tie. -1 when none has room now. */
static int pick_decode(const struct sim *s, const struct sim_req *r)
{
        int best = -1;
        for (unsigned j = 1; j <= s->ndec; j++) {
                unsigned d = (s->last_di + j) % s->ndec;
                uint32_t n = s->dec[d].pool.n;
                if (n >= r->n_dst && (best < 0 || n > s->dec[best].pool.n))
                        best = (int)d;
        }
        return best;
}

/* One layer's compute time in e's step: --layer-us, plus --layer-ns-per-token for each token
 * the step prefills (an engine's layer takes longer the more tokens it computes). */
static uint64_t sim_layer_ns(const struct sim *s, const struct engine *e)
{
        uint64_t tokens = 0;
        for (unsigned i = 0; i < e->nactive; i++)
                tokens += e->to[i] - e->from[i];
        return (uint64_t)s->o.layer_us * 1000 + tokens * s->o.layer_ns_per_token;
}

/* Start the layer e->layer of e's step: write every active request's share of it. The layer's
 * compute time runs from here (GPU mode: the kernel's, not this thread's). */
static void begin_layer(struct sim *s, struct engine *e)
{
        uint64_t t0 = kvf_now_ns();
        for (unsigned i = 0; i < e->nactive; i++)
                write_layer(s, e->active[i], e->layer, e->from[i], e->to[i]);
        e->due = s->sg ? t0 : t0 + sim_layer_ns(s, e);
}

/* Start e's next forward step: admit what its step budget and the free blocks allow, then its
 * chunk records and its first layer. 1 when it runs a step, 0 when it has nothing to run now,
 * < 0 when a submission failed (after a message). */
static int start_step(struct sim *s, struct engine *e)
{
        const struct sim_opts *o = &s->o;
        uint64_t budget = o->step_tokens;
        for (unsigned i = 0; i < e->nactive; i++) {
                uint32_t take = step_share(s, e->active[i]);
                budget = budget > take ? budget - take : 0;
        }
        while (!kvf_load_relaxed(&s->stop) && e->next < s->nreq &&
               (budget > 0 || e->nactive == 0)) {
                struct sim_req *r = &s->reqs[e->next];
                int d = pick_decode(s, r);
                if (e->in->pool.n < r->n_src || d < 0)
                        break;
                pool_take(&e->in->pool, r->n_src, r->src);
                pool_take(&s->dec[d].pool, r->n_dst, r->dst);
                r->di = (unsigned)d;
                s->last_di = (unsigned)d;
                r->src_freed = r->dst_freed = false;
                r->admitted = true;
                s->admitted++;
                e->in->admitted++;
                s->dec[d].admitted++;
                if (!r->late_task && submit_task(s, r, e->step) < 0)
                        return -1;
                e->active[e->nactive++] = r;
                uint32_t take = step_share(s, r);
                budget = budget > take ? budget - take : 0;
                e->next += s->npre;
        }
        if (e->nactive == 0)
                return 0;
        /* This step's share of each active request. */
        for (unsigned i = 0; i < e->nactive; i++) {
                struct sim_req *r = e->active[i];
                e->from[i] = r->done_tokens;
                e->to[i] = r->done_tokens + step_share(s, r);
                struct chunk_arg ca = {
                    .step = e->step, .to = e->to[i], .last = e->to[i] >= r->tokens};
                if (o->chunk_tokens)
                        for (unsigned k = 0; k < o->ranks; k++)
                                each_task(s, r, k, chunk_one, &ca);
        }
        e->in_step = true;
        e->layer = 0;
        begin_layer(s, e);
        return 1;
}

/* e's layer is computed (its due time has come): publish its layer-done, with the cancels at
 * the middle layer; then the next layer, or the step's end (the tasks that come after their
 * layers). 0, or -1 when a submission or (GPU mode) a layer's kernel or the step's end failed
 * (after a message). */
static int end_layer(struct sim *s, struct engine *e)
{
        uint32_t l = e->layer;
        uint64_t t0 = kvf_now_ns();
        for (unsigned k = 0; k < s->o.ranks; k++)
                if (!s->sg)
                        kvf_layer_done(kvf_group_member(e->in->g, k), e->step, l);
                else if (sim_gpu_layer(s->sg, k, kvf_group_member(e->in->g, k), e->step, l, sim_layer_ns(s, e)) < 0)
                        return -1;               /* GPU mode: a kernel, layer-done on its stream */
        s->phase_ns[SIM_PH_LAYER] += kvf_now_ns() - t0;
        uint64_t pub = s->sg ? 0 : kvf_now_ns(); /* GPU mode: known at the step's end */
        if (l == s->layers / 2)
                for (unsigned i = 0; i < e->nactive; i++) {
                        struct sim_req *r = e->active[i];
                        if (!r->cancel || !r->submitted)
                                continue;
                        for (unsigned k = 0; k < s->o.ranks; k++)
                                each_task(s, r, k, cancel_one, NULL);
                        s->cancels_sent += !r->cancel_sent;
                        r->cancel_sent = true;
                }
        if (l == s->layers - 1)
                for (unsigned i = 0; i < e->nactive; i++)
                        if (e->to[i] >= e->active[i]->tokens) {
                                struct sim_req *r = e->active[i];
                                uint32_t b0 = e->from[i] / s->L.block_size;
                                r->last_layer_ns = pub;
                                r->last_blocks = r->n_src - (b0 > r->first ? b0 : r->first);
                        }
        kvf_sim_poll_events(s, 0);
        if (++e->layer < s->layers) {
                begin_layer(s, e);
                return 0;
        }
        if (s->sg) { /* GPU mode: the step's end, and when its last layer ended */
                uint64_t end_ns, t1 = kvf_now_ns();
                if (sim_gpu_step_end(s->sg, &end_ns) < 0)
                        return -1;
                s->phase_ns[SIM_PH_STEP_END] += kvf_now_ns() - t1;
                for (unsigned i = 0; i < e->nactive; i++)
                        if (e->to[i] >= e->active[i]->tokens && !e->active[i]->last_layer_ns)
                                e->active[i]->last_layer_ns = end_ns;
                if (s->timeline && e->in == &s->pre[0]) {
                        uint64_t launched, hostfn, t = kvf_now_ns(), tokens = 0;
                        sim_gpu_step_times(s->sg, &launched, &hostfn);
                        for (unsigned i = 0; i < e->nactive; i++)
                                tokens += e->to[i] - e->from[i];
                        fprintf(s->timeline, "%llu %u %llu %lld %lld %lld %lld\n", (unsigned long long)e->step,
                                e->nactive, (unsigned long long)tokens, (long long)(launched - s->t_start),
                                (long long)(end_ns - s->t_start), (long long)(hostfn - s->t_start),
                                (long long)(t - s->t_start));
                }
        }
        /* Tasks that arrive after their layers are done. */
        unsigned keep = 0;
        for (unsigned i = 0; i < e->nactive; i++) {
                struct sim_req *r = e->active[i];
                r->done_tokens = e->to[i];
                if (!r->submitted && submit_task(s, r, e->step) < 0)
                        return -1;
                if (r->done_tokens < r->tokens && !r->src_freed) /* (an ended one: no more steps) */
                        e->active[keep++] = r;
        }
        e->nactive = keep;
        e->step++;
        e->in_step = false;
        return 0;
}

/* Until `due`: the engine's CPU thread waits on its GPU, so sleep, spinning only the last
 * stretch. */
static void wait_until(uint64_t due)
{
        for (uint64_t now; (now = kvf_now_ns()) < due;)
                if (due - now > 60000)
                        kvf_sleep_ns(due - now - 50000);
}

/*
 * --warm-caches: every 4 KiB page of the caches touched through this process's mappings, as a
 * long-running engine has touched them: a write (of the byte already there) to each page of
 * the prefill caches, which the engine computes into, a read of each page of the decode caches,
 * which it only reads here. On a VM where the first write through each new mapping of a page
 * is slow this is what a fresh engine process pays once and a steady state does not.
 */
static void warm_caches(struct sim *s)
{
        if (s->sg) {
                /* GPU mode: the caches are device memory; an engine's kernels fault nothing in. */
                fprintf(stderr, "%s: --warm-caches: the caches are on GPUs: nothing to touch\n",
                        KVF_SIM_PROG);
                return;
        }
        uint64_t t0 = kvf_now_ns();
        for (unsigned i = 0; i < s->npre + s->ndec; i++) {
                bool decode = i >= s->npre;
                const struct sim_inst *in = decode ? &s->dec[i - s->npre] : &s->pre[i];
                for (unsigned k = 0; k < (decode ? s->o.dranks : s->o.ranks); k++) {
                        struct kvf_client *c = kvf_group_member(in->g, k);
                        struct kvf_layout_info li;
                        uint8_t *p = c ? kvf_cache_tensor(c, 0, 0) : NULL;
                        if (!p || kvf_get_layout(c, &li) < 0)
                                continue;
                        /* Relaxed atomics: the compiler must make every access, nothing more. */
                        for (uint64_t off = 0; off < li.cache_bytes; off += 4096) {
                                uint8_t v = __atomic_load_n(p + off, __ATOMIC_RELAXED);
                                if (!decode)
                                        __atomic_store_n(p + off, v, __ATOMIC_RELAXED);
                        }
                        s->warm_bytes += li.cache_bytes;
                }
        }
        s->warm_ns = kvf_now_ns() - t0;
}

/* Earlier sessions' events still on their way (the fault test's last run): take them until
 * none came for --drain-previous-s. */
static void drain_previous(struct sim *s)
{
        for (uint64_t quiet_since = kvf_now_ns();
             kvf_now_ns() - quiet_since < s->o.drain_previous_s * 1000000000ull;) {
                struct kvf_event ev;
                bool any = false;
                for (unsigned i = 0; i < s->npre + s->ndec; i++) {
                        struct sim_inst *in = i < s->npre ? &s->pre[i] : &s->dec[i - s->npre];
                        any |= kvf_group_poll(in->g, &ev, i == 0 ? 50 : 0) > 0;
                        any |= simlog_previous(in->g, i >= s->npre,
                                               i >= s->npre ? s->o.dranks : s->o.ranks) > 0;
                }
                if (any)
                        quiet_since = kvf_now_ns();
        }
}

static void free_engines(struct engine *e, unsigned n)
{
        for (unsigned i = 0; e && i < n; i++) {
                free(e[i].active);
                free(e[i].from);
                free(e[i].to);
        }
        free(e);
}

int kvf_sim_run(struct sim *s)
{
        const struct sim_opts *o = &s->o;
        uint64_t layer_ns = (uint64_t)o->layer_us * 1000;
        int rc = 0;

        struct engine *eng = calloc(s->npre, sizeof(*eng));
        for (unsigned p = 0; eng && p < s->npre; p++) {
                struct engine *e = &eng[p];
                unsigned mine = s->nreq > p ? (s->nreq - p - 1) / s->npre + 1 : 1;
                e->in = &s->pre[p];
                e->next = p;
                e->active = calloc(mine, sizeof(*e->active));
                e->from = calloc(mine, sizeof(*e->from));
                e->to = calloc(mine, sizeof(*e->to));
                if (!e->active || !e->from || !e->to) {
                        free_engines(eng, s->npre);
                        eng = NULL;
                }
        }
        if (!eng) {
                fprintf(stderr, "%s: out of memory for the engines' step state\n", KVF_SIM_PROG);
                return -1;
        }
        if (o->timeline && s->sg && !(s->timeline = fopen(o->timeline, "w"))) {
                fprintf(stderr, "%s: --timeline %s: %s\n", KVF_SIM_PROG, o->timeline, strerror(errno));
                free_engines(eng, s->npre);
                return -1;
        }
        if (s->timeline)
                fprintf(s->timeline, "# step requests tokens last_layer_launched last_layer_end_gpu "
                                     "hostfn_after_it step_end_seen (ns from the run's start)\n");
        if (o->warm_caches)
                warm_caches(s);
        s->t_start = kvf_now_ns();
        s->cpu_start_s = kvf_sim_cpu_s();
        s->event_wait_ns = 0;
        memset(s->phase_ns, 0, sizeof(s->phase_ns));
        s->gpu_wait_start_ns = s->sg ? sim_gpu_wait_ns(s->sg) : 0;
        for (unsigned p = 0; p < s->npre; p++) {
                struct engine *e = &eng[p];
                /* Steps grow for the life of an instance: continue after the last one published. */
                e->step = 1;
                for (unsigned k = 0; k < o->ranks; k++)
                        if (kvf_last_step(kvf_group_member(e->in->g, k)) >= e->step)
                                e->step = kvf_last_step(kvf_group_member(e->in->g, k)) + 1;
                e->not_before = s->t_start + layer_ns * p / s->npre;
        }
        uint64_t last_progress = kvf_now_ns(), last_line = 0;
        unsigned turn = 0; /* which engine looks for blocks first: each in turn */

        kvf_opt_signals(&s->stop);
        while (s->done_reqs < (kvf_load_relaxed(&s->stop) ? s->admitted : s->nreq)) {
                /* Every engine between steps starts its next one if it can; then the layer
                 * that is due first. */
                uint64_t now = kvf_now_ns(), start_at = UINT64_MAX;
                struct engine *due = NULL;
                turn = (turn + 1) % s->npre;
                for (unsigned j = 0; j < s->npre; j++) {
                        struct engine *e = &eng[(turn + j) % s->npre];
                        if (!e->in_step && e->not_before > now) {
                                start_at = e->not_before < start_at ? e->not_before : start_at;
                                continue;
                        }
                        if (!e->in_step && start_step(s, e) < 0) {
                                rc = -1;
                                goto out;
                        }
                        if (e->in_step && (!due || e->due < due->due))
                                due = e;
                }
                if (start_at < (due ? due->due : UINT64_MAX)) {
                        /* an engine's first step, a fraction of a layer after the others':
                         * at its time, not at the next layer-done (which would put it in step) */
                        kvf_sim_poll_events(s, 0);
                        wait_until(start_at);
                } else if (due) {
                        wait_until(due->due);
                        if (end_layer(s, due) < 0) {
                                rc = -1;
                                goto out;
                        }
                        if (!due->in_step)
                                last_progress = kvf_now_ns();
                } else {
                        /* No engine has a step to run: waiting for blocks, or for the last
                         * requests to land. */
                        uint64_t before = s->done_reqs;
                        kvf_sim_poll_events(s, 10);
                        if (s->done_reqs != before)
                                last_progress = kvf_now_ns();
                        if (kvf_now_ns() - last_progress > (uint64_t)o->timeout_s * 1000000000ull) {
                                fprintf(stderr,
                                        "\n%s: no progress for %u s: "
                                        "giving up with %llu of %u requests done\n",
                                        KVF_SIM_PROG, o->timeout_s,
                                        (unsigned long long)s->done_reqs, kvf_sim_counted(s));
                                break;
                        }
                }
                if (!o->quiet && kvf_now_ns() - last_line > 1000000000ull) {
                        kvf_sim_progress_line(s, false);
                        last_line = kvf_now_ns();
                }
        }
        /* Let stragglers land. After a stop, only what was admitted counts. */
        if (kvf_load_relaxed(&s->stop))
                s->stopped = true;
        uint64_t end = kvf_now_ns() + (uint64_t)o->timeout_s * 1000000000ull;
        while (s->done_reqs < kvf_sim_counted(s) && kvf_now_ns() < end)
                kvf_sim_poll_events(s, 10);
        s->secs = (double)(kvf_now_ns() - s->t_start) / 1e9;
        s->event_wait_s = (double)s->event_wait_ns / 1e9;
        s->gpu_wait_s = s->sg ? (double)(sim_gpu_wait_ns(s->sg) - s->gpu_wait_start_ns) / 1e9 : 0;
        drain_previous(s);
        if (!o->quiet)
                kvf_sim_progress_line(s, true);
out:
        free_engines(eng, s->npre);
        if (s->timeline)
                fclose(s->timeline);
        s->timeline = NULL;
        return rc;
}

void kvf_sim_free(struct sim *s)
{
        for (unsigned i = 0; i < s->npre; i++) {
                kvf_group_detach(s->pre[i].g);
                free(s->pre[i].pool.free);
        }
        for (unsigned i = 0; i < s->ndec; i++) {
                kvf_group_detach(s->dec[i].g);
                free(s->dec[i].pool.free);
        }
        for (unsigned i = 0; s->reqs && i < s->nreq; i++) {
                free(s->reqs[i].src);
                free(s->reqs[i].dst);
        }
        free(s->reqs);
        free(s->vq);
        free(s->tails);
}
