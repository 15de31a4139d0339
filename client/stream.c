/*
 * kvf_layer_done_on_stream: layer-done events from the engine's CUDA stream,
 * and the engine executor (executor 2): the layer's copies enqueued in the
 * engine's own CUDA context, following the plan the sender keeps in the
 * control segment (struct kvf_plan_entry in common/shm_layout.h).
 *
 * Signals. hostfn: a host function queued on the engine's stream stores the
 * word in this process, then publishes it exactly as kvf_layer_done() does
 * (monotonic max, doorbell), on CUDA's callback thread. writevalue: the GPU
 * writes the packed word into the progress word itself (cuStreamWriteValue64
 * into the mapped segment). It cannot do a CAS max; it needs none, because
 * one engine's steps and layers only grow and the writes land in stream
 * order. Nothing rings the doorbell then, so before queueing the write the
 * client raises `progress.enqueued` (CAS max) and rings once: the sender
 * polls while enqueued > word (sender/main.c).
 *
 * Engine executor. For layer L of step S, every open plan entry for step S
 * whose claimed count is at most L is claimed up to L + 1 (a CAS: the sender
 * may be closing it at the same moment, and exactly one of us wins), and its
 * layers [claimed, L] are copied: all claimed entries' runs in one kernel,
 * on the client's copier stream (a side stream of the engine's context,
 * highest priority), ordered after the engine's stream by an event. Then a
 * signal on the side stream sets exec.landed to PACK(S, L + 1), which tells
 * the sender every copy queued so far has landed. The step's last layer is
 * the exception, where several entries have runs and the GPU writes the
 * words (not host functions): one kernel per entry, the smallest first (at most
 * EACH_BATCHES: more entries go in that many groups of neighbours in size), each
 * followed by a write of the entry's own `landed` word, so that each
 * request's finish waits only for its own bytes (and the smaller entries'
 * queued before them); exec.landed still follows them all. A claim that
 * cannot be copied (a peer that cannot be mapped, a bad block id, CUDA refusing the
 * launch) sets the entry's `err` and `why`: the sender fails exactly that
 * request with "write error"; landed is still posted, so the sender knows
 * nothing of that layer is in flight.
 *
 * A step's first call waits briefly for the sender to read the tasks submitted before it
 * (await_plans), so that their plans are open when the step's layers are claimed.
 *
 * Peers: each peer instance's cache is opened once (IPC handle, peer access
 * when it lives on another GPU) and kept until detach, or until its segment
 * changes identity (the instance was started again), after the copies in
 * flight have landed.
 *
 * The engine's caches (--caches engine --backend cuda): the source is the
 * engine's own views as it registered them (kvf_client.reg_own, this
 * process's pointers); a peer of the engine's caches is its registration,
 * opened anew (after the copies in flight landed) when its engine registers
 * again, and an entry whose blocks were reserved in another generation of it
 * (kvf_plan_entry.peer_reg_gen) fails. Runs are cut where either side's
 * blocks are not back to back, each tensor its own region.
 *
 * One thread at a time (stream_mu); the host function touches only the
 * word and the progress word.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomics.h"
#include "client.h"
#include "clock.h"
#include "doorbell.h"
#include "err.h"
#include "layout.h"
#include "log.h"
#include "registration.h"
#include "tpsplit.h"

int kvf_set_layer_signal(struct kvf_client *c, int method)
{
        if (method != KVF_SIGNAL_DEFAULT && method != KVF_SIGNAL_HOSTFN && method != KVF_SIGNAL_WRITEVALUE)
                return kvf_err_set(-EINVAL, "layer signal method %d is not hostfn (1) or writevalue (2)", method);
        int rc = kvf_client_owned(c);
        if (rc < 0)
                return rc;
        pthread_mutex_lock(&c->stream_mu);
        if (c->stream)
                rc = kvf_err_set(-EBUSY, "the layer signal method is chosen at the first kvf_layer_done_on_stream");
        else
                c->signal_method = method;
        pthread_mutex_unlock(&c->stream_mu);
        return rc;
}

#ifndef KVF_HAVE_CUDA

int kvf_layer_done_on_stream(struct kvf_client *c, void *stream, uint64_t step, uint32_t layer)
{
        int rc = kvf_client_owned(c);
        if (rc < 0)
                return rc;
        (void)stream;
        (void)step;
        (void)layer;
        return kvf_err_set(-ENOTSUP, "this libkvferry was built without CUDA (no nvcc): use kvf_layer_done()");
}

void kvf_stream_detach(struct kvf_client *c)
{
        (void)c;
}

#else

#include "kvf_gpu.h"

#define MAX_PEERS 16u
#define ARENA_CHUNKS (1u << 18)
#define AGAIN_WAIT_NS 5000000000ull
/* A step's first layer-done call waits at most this long for the sender to read the tasks this
 * engine submitted before it (await_plans). */
#define PLAN_WAIT_NS 200000ull
#define DRAIN_WAIT_NS 5000000000ull
/* A step's last layer: at most this many copy batches, each with its entries' landed words. */
#define EACH_BATCHES 8u

struct speer {
        char name[KVF_INSTANCE_MAX];
        uint64_t created_ns;
        struct kvf_ctl ctl;     /* its segment, read-only */
        struct kvf_cache cache; /* its cache, opened for our device */
        struct kvf_tp_plan plan; /* another split or block size: the pieces (else npieces 0) */
        bool used;
};

/* An entry claimed for this layer: its slot, the gen it was claimed under, its runs. */
struct mine {
        uint32_t slot, gen;
        size_t r0, r1; /* st->runs[r0, r1) */
        uint64_t bytes;
        bool posted; /* its own landed word is queued */
};

struct kvf_stream {
        int device;
        int method; /* enum kvf_layer_signal, resolved */
        uint64_t last; /* the last word queued: layers go in order */
        uint64_t word; /* hostfn: the value the host function publishes */
        struct kvf_gpu_signal *sig;
        /* engine executor */
        bool exec;
        struct kvf_gpu_copier *copier;
        struct kvf_gpu_signal *landed;
        uint64_t last_ticket;
        bool plan_wait;      /* await_plans on (KVF_AB_NO_PLAN_WAIT=1: off) */
        uint64_t stuck_head; /* the task ring's head when a wait for it ran out (UINT64_MAX: none) */
        struct speer peers[MAX_PEERS];
        struct kvf_gpu_run *runs;
        size_t nruns, cap_runs;
        struct kvf_gpu_run *byent; /* the runs again, entry by entry, smallest entry first */
        size_t cap_byent;
        struct kvf_gpu_region dst[MAX_PEERS];
        uint32_t dst_peer[MAX_PEERS], ndst;
        /* caches in parts (the engine's): the runs cut, and every region of both sides */
        struct kvf_gpu_run *cut;
        uint32_t cap_cut;
        struct kvf_gpu_region *regions;
        uint32_t cap_regions;
        struct mine *mine; /* entries claimed for this layer */
        uint32_t nmine;
        bool each; /* the landed signal may also store into each plan entry's own word */
};

/* On CUDA's callback thread, after the signal stored st->word: publish it. No CUDA call. */
static void on_hostfn(void *arg)
{
        struct kvf_client *c = arg;
        /* Acquire: pairs with the signal's release store of the word. */
        kvf_client_publish(c, kvf_load_acquire(&c->stream->word));
}

static int gpu_err(int rc, const char *what)
{
        return kvf_err_set(rc < 0 ? rc : -EIO, "%s: %s", what, kvf_gpu_err_msg());
}

/* The method $KVFERRY_LAYER_SIGNAL asks for; 0: none (the default). */
static int method_from_env(void)
{
        const char *e = getenv("KVFERRY_LAYER_SIGNAL");
        if (e && !strcmp(e, "writevalue"))
                return KVF_SIGNAL_WRITEVALUE;
        if (e && !strcmp(e, "hostfn"))
                return KVF_SIGNAL_HOSTFN;
        return 0;
}

/* A signal by the chosen method into `word` (or any word of the `span` bytes from it); the
 * stream write falls back to the one-thread kernel (same semantics) where stream memory
 * operations are missing. */
static int make_signal(struct kvf_stream *st, uint64_t *word, size_t span, void (*wake)(void *), void *arg,
                       struct kvf_gpu_signal **out)
{
        if (st->method == KVF_SIGNAL_HOSTFN)
                return kvf_gpu_signal_create_span(st->device, word, span, KVF_GPU_SIGNAL_HOST_FN, wake, arg, out);
        int rc = kvf_gpu_signal_create_span(st->device, word, span, KVF_GPU_SIGNAL_WRITE_VALUE, NULL, NULL, out);
        if (rc == -ENOSYS)
                rc = kvf_gpu_signal_create_span(st->device, word, span, KVF_GPU_SIGNAL_KERNEL, NULL, NULL, out);
        return rc;
}

/*
 * The engine executor's landed signal: exec.landed, and each plan entry's own landed word (one
 * span from exec.landed to the last entry's word, so that every post is in one stream order),
 * written by the GPU. Host functions (--layer-signal hostfn) run one after another on CUDA's
 * callback thread, so one per entry made the step's later ones wait (the tail p50 1.25x to
 * 1.4x longer, H100): they keep exec.landed alone, as where the span cannot be mapped for the
 * GPU (st->each false: every entry then waits for the layer's last batch).
 */
static int make_landed(struct kvf_client *c, struct kvf_stream *st)
{
        struct kvf_ctl *ctl = &c->ctl;
        uint64_t *first = &ctl->exec->landed;
        uint32_t n = ctl->hdr->plan_slots;
        const char *ab = getenv("KVF_AB_NO_OWN_LANDING"); /* an A/B switch of bench/gpu_tail_ab.sh */
        if (n && st->method != KVF_SIGNAL_HOSTFN && !(ab && !strcmp(ab, "1"))) {
                size_t span = (size_t)((char *)(&ctl->plan[n - 1].landed + 1) - (char *)first);
                if (make_signal(st, first, span, NULL, NULL, &st->landed) == 0) {
                        st->each = true;
                        return 0;
                }
                kvf_warn("engine executor: the plan entries' landed words cannot be mapped for the GPU (%s): "
                         "each layer's copies land together",
                         kvf_gpu_err_msg());
        }
        return make_signal(st, first, sizeof(*first), NULL, NULL, &st->landed);
}

static void stream_free(struct kvf_client *c, struct kvf_stream *st)
{
        /* Bounded: never free what a pending host function or a copy in flight still uses. */
        uint64_t end = kvf_now_ns() + DRAIN_WAIT_NS;
        while ((kvf_gpu_signal_pending(st->sig) || kvf_gpu_signal_pending(st->landed)) &&
               kvf_now_ns() < end)
                kvf_sleep_ns(100000);
        kvf_gpu_copier_destroy(st->copier); /* waits for its batches (bounded) */
        kvf_gpu_signal_destroy(st->landed);
        kvf_gpu_signal_destroy(st->sig);
        for (unsigned i = 0; i < MAX_PEERS; i++)
                if (st->peers[i].used) {
                        kvf_cache_unmap(&st->peers[i].cache);
                        kvf_ctl_detach(&st->peers[i].ctl);
                        kvf_tp_plan_free(&st->peers[i].plan);
                }
        free(st->runs);
        free(st->byent);
        free(st->cut);
        free(st->regions);
        free(st->mine);
        free(st);
        (void)c;
}

static int stream_init(struct kvf_client *c)
{
        const struct kvf_ctl_header *h = c->ctl.hdr;
        struct kvf_stream *st = calloc(1, sizeof(*st));
        int rc;

        if (!st || !(st->mine = calloc(h->plan_slots ? h->plan_slots : 1, sizeof(*st->mine)))) {
                free(st);
                return kvf_err_set(-ENOMEM, "out of memory");
        }
        st->device = h->backend == KVF_BACKEND_ENGINE && c->reg_own.n_parts ? c->reg_own.device : kvf_cache_device(c);
        if (st->device < 0 && (st->device = kvf_gpu_current_device()) < 0) {
                free(st->mine);
                free(st);
                return gpu_err(-EIO, "kvf_layer_done_on_stream");
        }
        st->method = c->signal_method ? c->signal_method : method_from_env();
        /* The default: the GPU writes the word. A host function ran 7 to 19 ms after its layer
         * in some steps (CUDA's callback thread), the GPU's write never did (docs/GPU.md);
         * where the word's page cannot be mapped for the GPU, host functions after all. One
         * exception: the sender's context copies (executor sender) and MPS is off, so its copy
         * kernels take turns with this engine's on the GPU; there the host function's tail was
         * the shorter (p50 285 us against 461 to 484, p99 0.5 ms against 12 to 22, H100). */
        bool chosen = st->method != 0;
        if (!chosen)
                st->method = h->executor == KVF_EXEC_SENDER && kvf_gpu_mps_enabled(st->device) == 0
                                     ? KVF_SIGNAL_HOSTFN
                                     : KVF_SIGNAL_WRITEVALUE;
        c->stream = st; /* the host function finds the word through it */
        rc = -EINVAL;
        if (st->method == KVF_SIGNAL_WRITEVALUE) {
                rc = make_signal(st, &c->ctl.progress->word, sizeof(uint64_t), NULL, NULL, &st->sig);
                if (rc < 0 && !chosen) {
                        kvf_warn("layer-done signal: the GPU cannot write the progress word (%s): "
                                 "host functions instead",
                                 kvf_gpu_err_msg());
                        st->method = KVF_SIGNAL_HOSTFN;
                }
        }
        if (st->method == KVF_SIGNAL_HOSTFN)
                rc = make_signal(st, &st->word, sizeof(st->word), on_hostfn, c, &st->sig);
        if (rc < 0) {
                rc = gpu_err(rc, "layer-done signal");
                goto fail;
        }
        st->exec = (h->backend == KVF_BACKEND_CUDA || (h->backend == KVF_BACKEND_ENGINE && h->reg_gpu)) &&
                   h->executor == KVF_EXEC_ENGINE;
        if (st->exec) {
                const char *ab = getenv("KVF_AB_NO_PLAN_WAIT"); /* an A/B switch of bench/gpu_tail_ab.sh */
                st->plan_wait = !(ab && !strcmp(ab, "1"));
                st->stuck_head = UINT64_MAX;
                struct kvf_gpu_copier_opts o = {.arena_chunks = ARENA_CHUNKS};
                if ((rc = kvf_gpu_copier_create(st->device, 0, &o, &st->copier)) < 0 ||
                    (rc = make_landed(c, st)) < 0) {
                        rc = gpu_err(rc, "the engine executor's copier");
                        goto fail;
                }
        }
        return 0;
fail:
        c->stream = NULL;
        stream_free(c, st);
        return rc;
}

void kvf_stream_detach(struct kvf_client *c)
{
        pthread_mutex_lock(&c->stream_mu);
        if (c->stream)
                stream_free(c, c->stream);
        c->stream = NULL;
        pthread_mutex_unlock(&c->stream_mu);
}

/* Wait until every batch queued so far has landed (bounded). */
static void drain(struct kvf_stream *st)
{
        uint64_t end = kvf_now_ns() + DRAIN_WAIT_NS;
        while (st->last_ticket && kvf_gpu_copy_poll(st->copier, st->last_ticket) == 0 && kvf_now_ns() < end)
                kvf_sleep_ns(20000);
}

/* The peer of a plan entry, opened for our device: its index, or -1 with `why`. */
static int peer_get(struct kvf_client *c, struct kvf_stream *st, const char *name, uint64_t created_ns,
                    char *why, size_t whylen)
{
        struct speer *freep = NULL;
        for (unsigned i = 0; i < MAX_PEERS; i++) {
                struct speer *p = &st->peers[i];
                if (!p->used) {
                        if (!freep)
                                freep = p;
                        continue;
                }
                if (strcmp(p->name, name))
                        continue;
                if (p->created_ns == created_ns)
                        return (int)i;
                /* Started again since: the old mapping goes once nothing writes through it. */
                drain(st);
                kvf_cache_unmap(&p->cache);
                kvf_ctl_detach(&p->ctl);
                kvf_tp_plan_free(&p->plan);
                memset(p, 0, sizeof(*p));
                if (!freep)
                        freep = p;
        }
        if (!freep) {
                snprintf(why, whylen, "the engine has %u same-host peers open already", MAX_PEERS);
                return -1;
        }
        struct speer *p = freep;
        int rc;
        char diff[400];
        const struct kvf_ctl_header *me = c->ctl.hdr;
        if (kvf_ctl_attach(name, false, &p->ctl) < 0) {
                snprintf(why, whylen, "engine executor: %s", kvf_err_msg());
                return -1;
        }
        const struct kvf_ctl_header *h = p->ctl.hdr;
        const struct kvf_cache near = {.device = st->device};
        if (h->created_ns != created_ns)
                snprintf(why, whylen, "engine executor: peer '%s' was started again", name);
        else if (h->backend != KVF_BACKEND_CUDA && !(h->backend == KVF_BACKEND_ENGINE && h->reg_gpu))
                snprintf(why, whylen, "engine executor: peer '%s' keeps its cache in host memory", name);
        else if ((rc = kvf_tp_pair_plan(&me->layout, me->nranks, me->rank, &h->layout, h->nranks,
                                        h->rank, &p->plan, diff, sizeof(diff))) < 0)
                snprintf(why, whylen, rc == -EXDEV ? "engine executor: peer layout mismatch with '%s': %s"
                                                   : "engine executor: peer '%s': %s",
                         name, diff);
        else if (kvf_cache_map_peer(h, true, &near, &p->cache) < 0)
                snprintf(why, whylen, "engine executor: peer '%s': %s", name, kvf_err_msg());
        else {
                snprintf(p->name, sizeof(p->name), "%s", name);
                p->created_ns = created_ns;
                p->used = true;
                return (int)(p - st->peers);
        }
        kvf_ctl_detach(&p->ctl);
        kvf_tp_plan_free(&p->plan);
        memset(p, 0, sizeof(*p));
        return -1;
}

/* The engine's caches: open anew every peer whose engine registered again since it was
 * opened, once the copies in flight (into its old memory) have landed. Before any entry of
 * a layer is claimed, so that no run of one batch meets two generations of a peer. */
static void peers_refresh(struct kvf_stream *st)
{
        bool drained = false;
        for (unsigned i = 0; i < MAX_PEERS; i++) {
                struct speer *p = &st->peers[i];
                if (!p->used || p->ctl.hdr->backend != KVF_BACKEND_ENGINE || !kvf_reg_stale(p->ctl.hdr, &p->cache))
                        continue;
                if (!drained)
                        drain(st);
                drained = true;
                kvf_cache_unmap(&p->cache);
                const struct kvf_cache near = {.device = st->device};
                if (kvf_cache_map_peer(p->ctl.hdr, true, &near, &p->cache) < 0)
                        memset(&p->cache, 0, sizeof(p->cache)); /* (its entries fail: not mapped) */
        }
}

/* A peer of the engine's caches: mapped (its engine registered them), and in the generation
 * the entry's blocks were reserved in. 0, or -1 with `why`. */
static int peer_gen_check(const struct speer *p, const struct kvf_plan_entry *e, char *why, size_t whylen)
{
        if (p->ctl.hdr->backend != KVF_BACKEND_ENGINE)
                return 0;
        if (!p->cache.parts) {
                snprintf(why, whylen, "engine executor: peer '%s' is waiting for its engine's caches", p->name);
                return -1;
        }
        if (e->peer_reg_gen && p->cache.reg_gen != e->peer_reg_gen) {
                snprintf(why, whylen, "engine executor: the engine's caches of peer '%s' were registered anew "
                         "during the transfer: its blocks are not the ones reserved", p->name);
                return -1;
        }
        return 0;
}

/* The claimed entry cannot be copied: the sender fails its request ("write error"). */
static void entry_fail(struct kvf_client *c, struct kvf_plan_entry *e, const char *why)
{
        snprintf(e->why, sizeof(e->why), "%s", why);
        /* Release: pairs with the sender's acquire load of err; `why` is complete first. */
        kvf_store_release(&e->err, 1u);
        kvf_fetch_add_relaxed(&c->ctl.exec->errors, 1);
}

static int grow_runs(struct kvf_stream *st, size_t more)
{
        if (st->nruns + more <= st->cap_runs)
                return 0;
        size_t cap = st->cap_runs ? st->cap_runs : 4096;
        while (cap < st->nruns + more)
                cap *= 2;
        struct kvf_gpu_run *r = realloc(st->runs, cap * sizeof(*r));
        if (!r)
                return -ENOMEM;
        st->runs = r;
        st->cap_runs = cap;
        return 0;
}

static uint32_t dst_region(struct kvf_stream *st, int pi)
{
        uint32_t di = 0;
        while (di < st->ndst && st->dst_peer[di] != (uint32_t)pi)
                di++;
        if (di == st->ndst) {
                st->dst_peer[di] = (uint32_t)pi;
                st->dst[di] = (struct kvf_gpu_region){.base = (uint64_t)(uintptr_t)st->peers[pi].cache.base,
                                                      .bytes = st->peers[pi].cache.bytes};
                st->ndst++;
        }
        return di;
}

/*
 * The runs of a peer of another tensor-parallel split or block size: the plan's pieces of each
 * send-block (kvf_tp_piece_next, the walk the sender's copies make), into the request's
 * destination blocks: n_dst of them (the peer's block size), or n_send. 0, or -1 with `why`.
 */
static int add_pieces(struct kvf_client *c, struct kvf_stream *st, uint32_t slot, const struct kvf_plan_entry *e,
                      int pi, uint32_t l0, uint32_t l1, char *why, size_t whylen)
{
        const struct kvf_ctl_header *h = c->ctl.hdr;
        const struct kvf_cache_layout *L = &h->layout, *PL = &st->peers[pi].cache.layout;
        const struct kvf_tp_plan *pl = &st->peers[pi].plan;
        const uint32_t *src = kvf_slot_blocks(&c->ctl, slot) + e->src_first;
        const uint32_t *dst = kvf_slot_blocks(&c->ctl, slot) + h->max_blocks;
        const struct kvf_req_slot *r = &c->ctl.reqtab[slot];
        /* Written with the task, before the sender opened the entry (the acquire load of its
         * ctl word orders them); fixed until the request is freed, which closes the entry. */
        uint32_t ndst = r->n_dst ? r->n_dst : r->n_send, tensors = kvf_layout_tensors(L), dpos;

        if (ndst > h->max_blocks) {
                snprintf(why, whylen, "engine executor: %u destination blocks (at most %u)", ndst, h->max_blocks);
                return -1;
        }
        for (uint32_t i = e->b0; i < e->b1; i++) {
                if (src[i] >= L->num_blocks) {
                        snprintf(why, whylen, "engine executor: source block %u is outside the cache (%u blocks)",
                                 src[i], L->num_blocks);
                        return -1;
                }
                for (uint32_t x = 0; kvf_tp_piece_next(pl, i, ndst, &x, &dpos); x++)
                        if (dst[dpos] >= PL->num_blocks) {
                                snprintf(why, whylen, "engine executor: block %u -> %u is outside the peer's cache "
                                         "(%u blocks)", src[i], dst[dpos], PL->num_blocks);
                                return -1;
                        }
        }
        uint32_t di = dst_region(st, pi);
        if (grow_runs(st, (size_t)(l1 - l0 + 1) * tensors * (e->b1 - e->b0) * pl->npieces) < 0) {
                snprintf(why, whylen, "engine executor: out of memory for the runs");
                return -1;
        }
        for (uint32_t l = l0; l <= l1; l++)
                for (uint32_t t = 0; t < tensors; t++)
                        for (uint32_t i = e->b0; i < e->b1; i++)
                                for (uint32_t x = 0; kvf_tp_piece_next(pl, i, ndst, &x, &dpos); x++) {
                                        const struct kvf_tp_piece *pc = &pl->pieces[x];
                                        st->runs[st->nruns++] = (struct kvf_gpu_run){
                                                .src_off = kvf_layout_offset(L, l, t, src[i]) + pc->soff,
                                                .dst_off = kvf_layout_offset(PL, l, t, dst[dpos]) + pc->doff,
                                                .bytes = pc->bytes,
                                                .src_region = 0,
                                                .dst_region = di};
                                }
        return 0;
}

/*
 * Add the runs of layers [l0, l1] of a claimed entry (a snapshot of it) to the
 * batch. 0, or -1 with `why` (nothing added).
 */
static int add_runs(struct kvf_client *c, struct kvf_stream *st, uint32_t slot, const struct kvf_plan_entry *e,
                    int pi, uint32_t l0, uint32_t l1, char *why, size_t whylen)
{
        const struct kvf_ctl_header *h = c->ctl.hdr;
        const struct kvf_cache_layout *L = &h->layout, *PL = &st->peers[pi].cache.layout;
        const uint32_t *src = kvf_slot_blocks(&c->ctl, slot) + e->src_first;
        const uint32_t *dst = kvf_slot_blocks(&c->ctl, slot) + h->max_blocks;
        uint32_t tensors = kvf_layout_all_tensors(L); /* (scale tensors: equal layouts only, no plan) */

        if (st->peers[pi].plan.npieces)
                return add_pieces(c, st, slot, e, pi, l0, l1, why, whylen);
        for (uint32_t i = e->b0; i < e->b1; i++)
                if (src[i] >= L->num_blocks || dst[i] >= PL->num_blocks) {
                        snprintf(why, whylen, "engine executor: block %u -> %u is outside the caches (%u, %u blocks)",
                                 src[i], dst[i], L->num_blocks, PL->num_blocks);
                        return -1;
                }
        uint32_t di = dst_region(st, pi);
        if (grow_runs(st, (size_t)(l1 - l0 + 1) * tensors * (e->b1 - e->b0)) < 0) {
                snprintf(why, whylen, "engine executor: out of memory for the runs");
                return -1;
        }
        for (uint32_t l = l0; l <= l1; l++)
                for (uint32_t t = 0; t < tensors; t++)
                        for (uint32_t i = e->b0; i < e->b1;) {
                                uint32_t k = 1;
                                while (i + k < e->b1 && src[i + k] == src[i] + k && dst[i + k] == dst[i] + k)
                                        k++;
                                st->runs[st->nruns++] = (struct kvf_gpu_run){
                                        .src_off = kvf_layout_offset(L, l, t, src[i]),
                                        .dst_off = kvf_layout_offset(PL, l, t, dst[i]),
                                        .bytes = (uint64_t)k * kvf_layout_tensor_bytes(L, t),
                                        .src_region = 0,
                                        .dst_region = di};
                                i += k;
                        }
        return 0;
}

/* Caches in parts (the engine's, either side): runs [0, n) cut where either side is not
 * contiguous, each tensor its own region (own's, then each destination peer's). 0, or -ENOMEM. */
static int cut_runs(struct kvf_stream *st, const struct kvf_cache *own, struct kvf_gpu_batch *b,
                    const struct kvf_gpu_run *runs, size_t n, uint32_t *ncut)
{
        uint32_t nsrc = kvf_cache_cuda_regions(own, NULL), ndr = 0, dfirst[MAX_PEERS];
        for (uint32_t d = 0; d < st->ndst; d++) {
                dfirst[d] = ndr;
                ndr += kvf_cache_cuda_regions(&st->peers[st->dst_peer[d]].cache, NULL);
        }
        if (nsrc + ndr > st->cap_regions) {
                struct kvf_gpu_region *r = realloc(st->regions, (size_t)(nsrc + ndr) * sizeof(*r));
                if (!r)
                        return -ENOMEM;
                st->regions = r;
                st->cap_regions = nsrc + ndr;
        }
        kvf_cache_cuda_regions(own, st->regions);
        for (uint32_t d = 0; d < st->ndst; d++)
                kvf_cache_cuda_regions(&st->peers[st->dst_peer[d]].cache, st->regions + nsrc + dfirst[d]);
        *ncut = 0;
        for (size_t i = 0; i < n; i++) {
                const struct kvf_gpu_run *r = &runs[i];
                if (kvf_cache_cuda_cut(own, 0, r->src_off, &st->peers[st->dst_peer[r->dst_region]].cache,
                                       dfirst[r->dst_region], r->dst_off, r->bytes, &st->cut, &st->cap_cut, ncut) < 0)
                        return -ENOMEM;
        }
        b->src = st->regions;
        b->n_src = nsrc;
        b->dst = st->regions + nsrc;
        b->n_dst = ndr;
        return 0;
}

/* Submit runs [0, n); larger than the arena: in halves (one stream: they land in order). */
static int submit(struct kvf_stream *st, struct kvf_gpu_batch *b, const struct kvf_gpu_run *runs, size_t n)
{
        uint64_t start = 0;
        for (;;) {
                b->runs = runs;
                b->n_runs = n;
                int rc = kvf_gpu_copy_submit(st->copier, b, &st->last_ticket);
                if (rc == -E2BIG && n > 1) {
                        if ((rc = submit(st, b, runs, n / 2)) < 0)
                                return rc;
                        b->after_stream = NULL; /* the first half waits for the engine already */
                        b->after = false;
                        return submit(st, b, runs + n / 2, n - n / 2);
                }
                if (rc != -EAGAIN)
                        return rc;
                /* Every slot of the copier is in flight: the GPU is far behind the engine's
                 * thread. Wait for it, bounded. */
                if (!start)
                        start = kvf_now_ns();
                else if (kvf_now_ns() - start > AGAIN_WAIT_NS)
                        return rc;
                kvf_sleep_ns(20000);
        }
}

/* Copy `n` runs on the side stream, after the engine's `stream` when `after`. 0 or < 0. */
static int copy_runs(struct kvf_stream *st, const struct kvf_cache *own, void *stream, bool after,
                     const struct kvf_gpu_run *runs, size_t n)
{
        struct kvf_gpu_region src = {.base = (uint64_t)(uintptr_t)own->base, .bytes = own->bytes};
        struct kvf_gpu_batch b = {.src = &src, .n_src = 1, .dst = st->dst, .n_dst = st->ndst,
                                  .after_stream = after ? stream : NULL, .after = after};
        bool parts = own->parts != NULL;
        for (uint32_t d = 0; d < st->ndst && !parts; d++)
                parts = st->peers[st->dst_peer[d]].cache.parts != NULL;
        if (!parts)
                return submit(st, &b, runs, n);
        uint32_t ncut = 0;
        int rc = cut_runs(st, own, &b, runs, n, &ncut);
        return rc < 0 ? rc : submit(st, &b, st->cut, ncut);
}

static void copy_failed(char *why, size_t len, uint32_t layer, int rc)
{
        snprintf(why, len, "engine executor: GPU copy of layer %u: %s", layer,
                 rc == -ENOMEM ? "out of memory for the runs" : kvf_gpu_err_msg());
}

static int by_bytes(const void *a, const void *b)
{
        uint64_t x = ((const struct mine *)a)->bytes, y = ((const struct mine *)b)->bytes;
        return x < y ? -1 : x > y;
}

static void exec_layer(struct kvf_client *c, struct kvf_stream *st, void *stream, uint64_t step, uint32_t layer)
{
        struct kvf_ctl *ctl = &c->ctl;
        uint32_t hi = kvf_load_acquire(&ctl->exec->hi);
        char why[400];

        if (hi > ctl->hdr->plan_slots)
                hi = ctl->hdr->plan_slots;
        st->nruns = st->ndst = st->nmine = 0;
        /* The source: the cache this instance's allocator made, or the engine's own views. */
        const bool engine = ctl->hdr->backend == KVF_BACKEND_ENGINE;
        const struct kvf_cache *own = engine ? &c->reg_own : &c->cache;
        if (engine)
                peers_refresh(st);
        for (uint32_t i = 0; i < hi; i++) {
                struct kvf_plan_entry *e = &ctl->plan[i];
                /* Acquire: pairs with the sender's release store that opened the entry; its
                 * fields are complete. */
                uint64_t v = kvf_load_acquire(&e->ctl);
                if (!(v & KVF_PLAN_OPEN) || KVF_PLAN_CLAIMED(v) > layer || e->step != step)
                        continue;
                struct kvf_plan_entry snap;
                memcpy(&snap, e, sizeof(snap));
                /* The claim validates the snapshot: the sender rewrites an entry only after
                 * closing it, and opens it again under a new gen. */
                uint32_t from = KVF_PLAN_CLAIMED(v);
                if (!kvf_cas_acq_rel(&e->ctl, &v, KVF_PLAN_CTL(KVF_PLAN_GEN(v), 1, layer + 1)))
                        continue; /* the sender closed it first: the sender copies those layers */
                kvf_fetch_add_relaxed(&ctl->exec->claims, layer + 1 - from);
                struct mine *m = &st->mine[st->nmine++];
                *m = (struct mine){.slot = i, .gen = KVF_PLAN_GEN(v), .r0 = st->nruns, .r1 = st->nruns};
                snap.peer[sizeof(snap.peer) - 1] = '\0';
                if (snap.b0 >= snap.b1 || snap.b1 > ctl->hdr->max_blocks ||
                    snap.src_first > ctl->hdr->max_blocks - snap.b1) {
                        snprintf(why, sizeof(why), "engine executor: plan entry %u names blocks [%u, %u) + %u", i,
                                 snap.b0, snap.b1, snap.src_first);
                        entry_fail(c, e, why);
                        continue;
                }
                int pi = peer_get(c, st, snap.peer, snap.peer_created_ns, why, sizeof(why));
                if (pi < 0) {
                        entry_fail(c, e, why);
                        continue;
                }
                /* The blocks belong to the peer engine session of the task's time; once it is
                 * over they may be another request's (the sender checks the same before its
                 * own copies). */
                uint64_t ps = snap.peer_session ? kvf_engine_session(&st->peers[pi].ctl, false) : 0;
                if (ps != snap.peer_session) {
                        snprintf(why, sizeof(why),
                                 "the engine session %llu of peer '%s' ended during the transfer: its blocks are no longer reserved",
                                 (unsigned long long)snap.peer_session, snap.peer);
                        entry_fail(c, e, why);
                        continue;
                }
                if (engine && !own->n_parts) {
                        snprintf(why, sizeof(why), "engine executor: this engine's caches are not registered "
                                 "(kvf_register_caches)");
                        entry_fail(c, e, why);
                        continue;
                }
                if (peer_gen_check(&st->peers[pi], &snap, why, sizeof(why)) < 0) {
                        entry_fail(c, e, why);
                        continue;
                }
                if (add_runs(c, st, i, &snap, pi, from, layer, why, sizeof(why)) < 0) {
                        entry_fail(c, e, why);
                        continue;
                }
                m->r1 = st->nruns;
                for (size_t r = m->r0; r < m->r1; r++)
                        m->bytes += st->runs[r].bytes;
        }
        if (!st->nmine)
                return;
        /* A step's last layer: each entry its own batch (up to EACH_BATCHES), the smallest
         * first, and its own landed word after it, so a request's finish waits for its own bytes
         * only (and for the smaller ones queued before it), not for the whole step's. */
        uint32_t with_runs = 0;
        for (uint32_t k = 0; k < st->nmine; k++)
                with_runs += st->mine[k].r1 > st->mine[k].r0;
        bool each = st->each && with_runs > 1 && layer + 1 == kvf_layout_layers(&ctl->hdr->layout);
        /* At most EACH_BATCHES batches: a step of many small requests goes in that many groups of
         * neighbours in size (their runs gathered in st->byent), not a kernel launch each. */
        uint32_t per = (with_runs + EACH_BATCHES - 1) / EACH_BATCHES;
        if (each && per > 1 && st->cap_byent < st->nruns) {
                struct kvf_gpu_run *r = realloc(st->byent, st->nruns * sizeof(*r));
                if (r) {
                        st->byent = r;
                        st->cap_byent = st->nruns;
                } else {
                        each = false; /* (one batch for them all, as at other layers) */
                }
        }
        if (each) {
                qsort(st->mine, st->nmine, sizeof(*st->mine), by_bytes);
                bool waited = false;
                for (uint32_t k = 0; k < st->nmine;) {
                        uint32_t k0 = k, in = 0;
                        const struct kvf_gpu_run *runs = NULL;
                        size_t n = 0;
                        for (; k < st->nmine && in < per; k++) {
                                const struct mine *m = &st->mine[k];
                                if (m->r1 == m->r0)
                                        continue;
                                if (per > 1) {
                                        memcpy(st->byent + n, st->runs + m->r0, (m->r1 - m->r0) * sizeof(*st->byent));
                                        runs = st->byent;
                                } else {
                                        runs = st->runs + m->r0; /* one entry: its runs as they are */
                                }
                                n += m->r1 - m->r0;
                                in++;
                        }
                        if (!n)
                                continue;
                        int rc = copy_runs(st, own, stream, !waited, runs, n);
                        if (rc < 0)
                                copy_failed(why, sizeof(why), layer, rc);
                        else
                                kvf_fetch_add_relaxed(&ctl->exec->batches, 1);
                        waited |= rc == 0;
                        for (uint32_t j = k0; j < k; j++) {
                                struct mine *m = &st->mine[j];
                                struct kvf_plan_entry *e = &ctl->plan[m->slot];
                                if (m->r1 == m->r0)
                                        continue;
                                if (rc < 0) {
                                        entry_fail(c, e, why);
                                        continue;
                                }
                                /* (Refused: exec.landed below says it for this entry too.) */
                                m->posted = kvf_gpu_signal_post_at(st->landed, kvf_gpu_copier_stream(st->copier),
                                                                   &e->landed, KVF_PLAN_CTL(m->gen, 0, layer + 1)) == 0;
                        }
                }
        } else if (st->nruns) {
                int rc = copy_runs(st, own, stream, true, st->runs, st->nruns);
                if (rc < 0) {
                        copy_failed(why, sizeof(why), layer, rc);
                        for (uint32_t k = 0; k < st->nmine; k++)
                                if (!kvf_load_relaxed(&ctl->plan[st->mine[k].slot].err))
                                        entry_fail(c, &ctl->plan[st->mine[k].slot], why);
                } else {
                        kvf_fetch_add_relaxed(&ctl->exec->batches, 1);
                }
        }
        /* Everything queued on the side stream so far (this layer's batches, if they went) is
         * done when this lands; posted even when nothing went, so the sender waits for
         * nothing that will never come. */
        int rc = kvf_gpu_signal_post(st->landed, kvf_gpu_copier_stream(st->copier), KVF_PROGRESS_PACK(step, layer + 1));
        for (uint64_t end = kvf_now_ns() + AGAIN_WAIT_NS; rc == -EAGAIN && kvf_now_ns() < end;) {
                kvf_sleep_ns(20000);
                rc = kvf_gpu_signal_post(st->landed, kvf_gpu_copier_stream(st->copier), KVF_PROGRESS_PACK(step, layer + 1));
        }
        if (rc < 0) {
                /* An entry whose own landed word is on its way needs nothing more. */
                snprintf(why, sizeof(why), "engine executor: the landed signal of layer %u: %s", layer, kvf_gpu_err_msg());
                for (uint32_t k = 0; k < st->nmine; k++)
                        if (!st->mine[k].posted && !kvf_load_relaxed(&ctl->plan[st->mine[k].slot].err))
                                entry_fail(c, &ctl->plan[st->mine[k].slot], why);
        }
}

/*
 * The engine executor claims plan entries only in layer-done calls, and an engine's thread
 * queues a whole step's layers at once, ahead of its GPU. A task submitted just before the step
 * whose plan the sender opens after the step's last call is then copied by the sender in its
 * own context (without MPS, in the GPU's time slices: milliseconds behind the layer). So a
 * step's first call waits, at most PLAN_WAIT_NS, until the sender has read every task this
 * engine submitted before it (the task ring's head reaches the tail seen here: the sender
 * advances the head after a task's plan is open). A sender that did not read anything during a
 * whole wait is not waited for again until it does.
 */
static void await_plans(struct kvf_client *c, struct kvf_stream *st)
{
        const struct kvf_ring_hdr *h = c->ctl.rings[KVF_RING_ENGINE_TO_SENDER].hdr;
        /* Acquire: pairs with the sender's release store of head (its plans are open). */
        uint64_t want = kvf_load_acquire(&h->tail), head = kvf_load_acquire(&h->head);
        if (head >= want || head == st->stuck_head)
                return;
        for (uint64_t end = kvf_now_ns() + PLAN_WAIT_NS; (head = kvf_load_acquire(&h->head)) < want;) {
                if (kvf_now_ns() > end) {
                        st->stuck_head = head;
                        return;
                }
                kvf_cpu_relax();
        }
        st->stuck_head = UINT64_MAX;
}

static int post(struct kvf_client *c, struct kvf_stream *st, void *stream, uint64_t want)
{
        if (st->method != KVF_SIGNAL_HOSTFN) {
                /* The sender polls while a word it has not seen is queued (no doorbell will ring
                 * when the GPU writes it): raise `enqueued` first, then wake it once. */
                uint64_t cur = kvf_load_relaxed(&c->ctl.progress->enqueued);
                while (cur < want && !kvf_cas_acq_rel(&c->ctl.progress->enqueued, &cur, want)) {
                }
                kvf_doorbell_ring(&c->ctl.bells[KVF_BELL_SENDER]);
        }
        int rc = kvf_gpu_signal_post(st->sig, stream, want);
        for (uint64_t end = kvf_now_ns() + AGAIN_WAIT_NS; rc == -EAGAIN && kvf_now_ns() < end;) {
                kvf_sleep_ns(20000); /* 1024 host functions pending: the GPU is far behind */
                rc = kvf_gpu_signal_post(st->sig, stream, want);
        }
        return rc < 0 ? gpu_err(rc, "layer-done signal") : 0;
}

int kvf_layer_done_on_stream(struct kvf_client *c, void *stream, uint64_t step, uint32_t layer)
{
        int rc = kvf_client_layer_check(c, step, layer);
        if (rc < 0)
                return rc;
        uint64_t want = KVF_PROGRESS_PACK(step, layer + 1);
        pthread_mutex_lock(&c->stream_mu);
        if (!c->stream && (rc = stream_init(c)) < 0)
                goto out;
        struct kvf_stream *st = c->stream;
        if (want <= st->last) {
                rc = kvf_err_set(-EINVAL, "layer %u of step %llu: layer %u of step %llu was signalled on a stream "
                                 "already (layers go in order)", layer, (unsigned long long)step,
                                 KVF_PROGRESS_LAYERS(st->last) - 1, (unsigned long long)KVF_PROGRESS_STEP(st->last));
                goto out;
        }
        if (st->exec && st->plan_wait && step != KVF_PROGRESS_STEP(st->last))
                await_plans(c, st);
        if (st->exec)
                exec_layer(c, st, stream, step, layer);
        if ((rc = post(c, st, stream, want)) == 0)
                st->last = want;
out:
        pthread_mutex_unlock(&c->stream_mu);
        return rc;
}

#endif
