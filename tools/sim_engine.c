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

int kvf_sim_setup(struct sim *s)
{
        const struct sim_opts *o = &s->o;
        struct kvf_layout_info *L = &s->L;

        s->rng_state = o->seed;
        if (kvf_group_attach(o->prefill, o->ranks, 10000, &s->pg) < 0 ||
            kvf_group_attach(o->decode, o->ranks, 10000, &s->dg) < 0) {
                fprintf(stderr, "%s: %s\n", KVF_SIM_PROG, kvf_last_error());
                return -1;
        }
        if (o->session_log && simlog_open(o->session_log, kvf_session(kvf_group_member(s->pg, 0)),
                                          kvf_session(kvf_group_member(s->dg, 0))) < 0) {
                fprintf(stderr, "%s: --session-log %s: %s\n", KVF_SIM_PROG, o->session_log,
                        strerror(errno));
                return -1;
        }
        kvf_get_layout(kvf_group_member(s->pg, 0), L);
        struct kvf_layout_info DL;
        kvf_get_layout(kvf_group_member(s->dg, 0), &DL);
        s->layers = L->num_layers + L->extra_layers;
        s->tensors = L->key_only ? 1 : 2;
        if (pool_init(s, &s->psrc, L->num_blocks) < 0 || pool_init(s, &s->pdst, DL.num_blocks) < 0)
                return -1;
        /* The largest prompt the caches (and one request's block limit) can hold at once. */
        uint32_t cap_blocks = L->num_blocks < DL.num_blocks ? L->num_blocks : DL.num_blocks;
        uint64_t cap_tok = (uint64_t)(cap_blocks / 2) * L->block_size;
        uint64_t lim = 4096ull * L->block_size;
        if (cap_tok > lim)
                cap_tok = lim;
        if (!s->o.max_tokens || s->o.max_tokens > cap_tok)
                s->o.max_tokens = (unsigned)cap_tok;
        if (load_trace(s, o->trace, o->requests) < 0)
                return -1;
        s->tails = calloc(s->nreq, sizeof(*s->tails));

        for (unsigned i = 0; i < s->nreq; i++) {
                struct sim_req *r = &s->reqs[i];
                snprintf(r->id, sizeof(r->id), "r%u", i);
                r->n_src = (r->tokens + L->block_size - 1) / L->block_size;
                r->first = 0;
                if (r->n_src > 1 && rnd(s) % 100 < o->prefix_pct)
                        r->first = (uint32_t)(1 + rnd(s) % (r->n_src - 1) / 2);
                r->n_dst = r->n_src - r->first;
                r->src = malloc(r->n_src * sizeof(uint32_t));
                r->dst = malloc(r->n_dst * sizeof(uint32_t));
                r->completion = r->arrival = -1;
                r->src_freed = r->dst_freed = true; /* nothing reserved yet */
                r->late_task = o->chunk_tokens == 0 && rnd(s) % 100 < o->late_pct;
                r->cancel = rnd(s) % 100 < o->cancel_pct;
        }
        return 0;
}

static int submit_task(struct sim *s, struct sim_req *r, uint64_t step)
{
        for (unsigned k = 0; k < s->o.ranks; k++) {
                struct kvf_task t = {.request_id = r->id,
                                     .src_block_ids = r->src,
                                     .n_src = r->n_src,
                                     .dest_block_ids = r->dst,
                                     .n_dest = r->n_dst,
                                     .current_id = step,
                                     .transport = s->o.transport,
                                     .peer = s->o.peer[k],
                                     .chunked = s->o.chunk_tokens > 0,
                                     /* as an engine should: the decode session that reserved
                                      * the blocks, passed along with their ids (otherwise the
                                      * prefill side binds the transfer to the decode session it
                                      * last heard of, which a new decode engine makes stale
                                      * until its connector has told) */
                                     .peer_session = kvf_session(kvf_group_member(s->dg, k))};
                int rc;
                while ((rc = kvf_submit_task(kvf_group_member(s->pg, k), &t)) == -EAGAIN)
                        kvf_sim_poll_events(s, 1);
                if (rc < 0) {
                        fprintf(stderr, "%s: submit %s: %s\n", KVF_SIM_PROG, r->id,
                                kvf_last_error());
                        return rc;
                }
        }
        r->submitted = true;
        simlog_event('S', r->id, 0);
        return 0;
}

/* Write layer l of request r's blocks covered by tokens [from, to) (all ranks). */
static void write_layer(struct sim *s, struct sim_req *r, uint32_t l, uint32_t from, uint32_t to)
{
        const struct kvf_layout_info *L = &s->L;
        uint32_t j0 = from / L->block_size, j1 = (to + L->block_size - 1) / L->block_size;
        bool last = to >= r->tokens;
        for (unsigned k = 0; k < s->o.ranks; k++) {
                struct kvf_client *c = kvf_group_member(s->pg, k);
                for (uint32_t t = 0; t < s->tensors; t++) {
                        uint8_t *base = kvf_cache_tensor(c, l, (int)t);
                        for (uint32_t j = j0; j < j1 && j < r->n_src; j++) {
                                /* A block the chunk leaves incomplete gets other bytes: sending it
                                 * before the chunk that completes it would show up in verify. */
                                bool partial = !last && (uint64_t)(j + 1) * L->block_size > to;
                                uint64_t key = kvf_sim_block_key(r->seq, k, l, t, j, partial);
                                uint8_t *p = base + (uint64_t)r->src[j] * L->block_bytes;
                                if (s->sg) /* GPU mode: written by the layer's kernel */
                                        sim_gpu_fill(s->sg, k, p, L->block_bytes, key);
                                else
                                        kvf_sim_fill(p, L->block_bytes, key, s->o.sample_only);
                        }
                }
        }
}

/* The tokens of r one step prefills: a chunk, or all it has left. */
static uint32_t step_share(const struct sim *s, const struct sim_req *r)
{
        uint32_t left = r->tokens - r->done_tokens;
        return s->o.chunk_tokens && left > s->o.chunk_tokens ? s->o.chunk_tokens : left;
}

/* One forward step of the active requests: chunk records, then every layer written,
 * waited for and published, with the cancels at the middle layer. 0, or -1 when (GPU mode) a
 * layer's kernel or the step's end failed (after a message). */
static int run_step(struct sim *s, struct sim_req **active, unsigned nactive, const uint32_t *from,
                    const uint32_t *to, uint64_t step)
{
        uint64_t layer_ns = (uint64_t)s->o.layer_us * 1000;
        for (uint32_t l = 0; l < s->layers; l++) {
                uint64_t t0 = kvf_now_ns();
                for (unsigned i = 0; i < nactive; i++)
                        write_layer(s, active[i], l, from[i], to[i]);
                /* The rest of the layer's compute time: the engine's CPU thread
                 * waits on its GPU, so sleep, spinning only the last stretch. */
                for (uint64_t el; !s->sg && (el = kvf_now_ns() - t0) < layer_ns;)
                        if (layer_ns - el > 60000)
                                kvf_sleep_ns(layer_ns - el - 50000);
                for (unsigned k = 0; k < s->o.ranks; k++)
                        if (!s->sg)
                                kvf_layer_done(kvf_group_member(s->pg, k), step, l);
                        else if (sim_gpu_layer(s->sg, k, kvf_group_member(s->pg, k), step, l) < 0)
                                return -1; /* GPU mode: a kernel, layer-done on its stream */
                uint64_t pub = s->sg ? 0 : kvf_now_ns(); /* GPU mode: known at the step's end */
                if (l == s->layers / 2)
                        for (unsigned i = 0; i < nactive; i++)
                                if (active[i]->cancel && active[i]->submitted) {
                                        for (unsigned k = 0; k < s->o.ranks; k++)
                                                kvf_submit_cancel(kvf_group_member(s->pg, k),
                                                                  active[i]->id);
                                        s->cancels_sent += !active[i]->cancel_sent;
                                        active[i]->cancel_sent = true;
                                }
                if (l == s->layers - 1)
                        for (unsigned i = 0; i < nactive; i++)
                                if (to[i] >= active[i]->tokens) {
                                        struct sim_req *r = active[i];
                                        uint32_t b0 = from[i] / s->L.block_size;
                                        r->last_layer_ns = pub;
                                        r->last_blocks = r->n_src - (b0 > r->first ? b0 : r->first);
                                }
                kvf_sim_poll_events(s, 0);
        }
        if (s->sg) { /* GPU mode: the step's end, and when its last layer ended */
                uint64_t end_ns;
                if (sim_gpu_step_end(s->sg, &end_ns) < 0)
                        return -1;
                for (unsigned i = 0; i < nactive; i++)
                        if (to[i] >= active[i]->tokens && !active[i]->last_layer_ns)
                                active[i]->last_layer_ns = end_ns;
        }
        return 0;
}

/*
 * --warm-caches: every 4 KiB page of the caches touched through this process's mappings, as a
 * long-running engine has touched them: a write (of the byte already there) to each page of
 * the prefill caches, which the engine computes into, a read of each page of the decode caches,
 * which it only reads here. On a VM where the first write through each new mapping of a page
 * is slow (issue 14) this is what a fresh engine process pays once and a steady state does not.
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
        for (unsigned k = 0; k < s->o.ranks; k++) {
                for (int decode = 0; decode < 2; decode++) {
                        struct kvf_client *c = kvf_group_member(decode ? s->dg : s->pg, k);
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

int kvf_sim_run(struct sim *s)
{
        const struct sim_opts *o = &s->o;
        int rc = 0;

        if (o->warm_caches)
                warm_caches(s);
        s->t_start = kvf_now_ns();
        /* Steps grow for the life of an instance: continue after the last one published. */
        uint64_t step = 1, last_progress = kvf_now_ns(), last_line = 0;
        for (unsigned k = 0; k < o->ranks; k++)
                if (kvf_last_step(kvf_group_member(s->pg, k)) >= step)
                        step = kvf_last_step(kvf_group_member(s->pg, k)) + 1;
        unsigned next = 0;
        struct sim_req **active = calloc(s->nreq, sizeof(*active));
        unsigned nactive = 0;

        kvf_opt_signals(&s->stop);
        while (s->done_reqs < (kvf_load_relaxed(&s->stop) ? next : s->nreq)) {
                /* Admit what the step budget and the free blocks allow. */
                uint64_t budget = o->step_tokens;
                for (unsigned i = 0; i < nactive; i++) {
                        uint32_t take = step_share(s, active[i]);
                        budget = budget > take ? budget - take : 0;
                }
                while (!kvf_load_relaxed(&s->stop) && next < s->nreq && (budget > 0 || nactive == 0)) {
                        struct sim_req *r = &s->reqs[next];
                        if (s->psrc.n < r->n_src || s->pdst.n < r->n_dst)
                                break;
                        pool_take(&s->psrc, r->n_src, r->src);
                        pool_take(&s->pdst, r->n_dst, r->dst);
                        r->src_freed = r->dst_freed = false;
                        if (!r->late_task && submit_task(s, r, step) < 0) {
                                rc = -1;
                                goto out;
                        }
                        active[nactive++] = r;
                        uint32_t take = step_share(s, r);
                        budget = budget > take ? budget - take : 0;
                        next++;
                }
                if (nactive == 0) {
                        uint64_t before = s->done_reqs;
                        kvf_sim_poll_events(s, 10);
                        if (s->done_reqs != before)
                                last_progress = kvf_now_ns();
                        if (kvf_now_ns() - last_progress > (uint64_t)o->timeout_s * 1000000000ull) {
                                fprintf(stderr,
                                        "\n%s: no progress for %u s: "
                                        "giving up with %llu of %u requests done\n",
                                        KVF_SIM_PROG, o->timeout_s,
                                        (unsigned long long)s->done_reqs, s->nreq);
                                break;
                        }
                } else {
                        /* This step's share of each active request. */
                        uint32_t from[nactive], to[nactive];
                        for (unsigned i = 0; i < nactive; i++) {
                                struct sim_req *r = active[i];
                                from[i] = r->done_tokens;
                                to[i] = r->done_tokens + step_share(s, r);
                                if (o->chunk_tokens)
                                        for (unsigned k = 0; k < o->ranks; k++)
                                                while (kvf_submit_chunk(
                                                           kvf_group_member(s->pg, k), r->id, step,
                                                           to[i], to[i] >= r->tokens) == -EAGAIN)
                                                        kvf_sim_poll_events(s, 1);
                        }
                        if (run_step(s, active, nactive, from, to, step) < 0) {
                                rc = -1;
                                goto out;
                        }
                        /* Tasks that arrive after their layers are done. */
                        unsigned keep = 0;
                        for (unsigned i = 0; i < nactive; i++) {
                                struct sim_req *r = active[i];
                                r->done_tokens = to[i];
                                if (!r->submitted && submit_task(s, r, step) < 0) {
                                        rc = -1;
                                        goto out;
                                }
                                if (r->done_tokens < r->tokens)
                                        active[keep++] = r;
                        }
                        nactive = keep;
                        step++;
                        last_progress = kvf_now_ns();
                }
                if (!o->quiet && kvf_now_ns() - last_line > 1000000000ull) {
                        kvf_sim_progress_line(s, false);
                        last_line = kvf_now_ns();
                }
        }
        /* Let stragglers land. After a stop, only what was admitted counts. */
        if (kvf_load_relaxed(&s->stop))
                s->nreq = next;
        uint64_t end = kvf_now_ns() + (uint64_t)o->timeout_s * 1000000000ull;
        while (s->done_reqs < s->nreq && kvf_now_ns() < end)
                kvf_sim_poll_events(s, 10);
        s->secs = (double)(kvf_now_ns() - s->t_start) / 1e9;
        /* Earlier sessions' events still on their way (the fault test's last run). */
        for (uint64_t quiet_since = kvf_now_ns();
             o->drain_previous_s &&
             kvf_now_ns() - quiet_since < o->drain_previous_s * 1000000000ull;) {
                struct kvf_event ev;
                if (kvf_group_poll(s->pg, &ev, 50) > 0 || kvf_group_poll(s->dg, &ev, 0) > 0 ||
                    simlog_previous(s->pg, s->dg, o->ranks) > 0)
                        quiet_since = kvf_now_ns();
        }
        if (!o->quiet)
                kvf_sim_progress_line(s, true);
out:
        free(active);
        return rc;
}

void kvf_sim_free(struct sim *s)
{
        kvf_group_detach(s->pg);
        kvf_group_detach(s->dg);
        /* All of them: after a stop nreq counts only those admitted. */
        for (unsigned i = 0; s->reqs && i < s->o.requests; i++) {
                free(s->reqs[i].src);
                free(s->reqs[i].dst);
        }
        free(s->reqs);
        free(s->tails);
        free(s->psrc.free);
        free(s->pdst.free);
}
