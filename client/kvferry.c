/*
 * libkvferry: the engine's side of an instance (include/kvferry.h).
 *
 * The engine is the producer of engine->sender and engine->connector, the
 * consumer of sender->engine and connector->engine, and the only writer of
 * the progress word. One engine client per instance: a second attach while
 * the first is alive is refused, because the rings are single-producer.
 */
#include "kvferry.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "atomics.h"
#include "cache.h"
#include "clock.h"
#include "ctl.h"
#include "doorbell.h"
#include "err.h"
#include "layout.h"
#include "records.h"

#include "abi.h"
#include "client.h"

const char *kvf_last_error(void)
{
        return kvf_err_msg();
}

int kvf_client_owned(const struct kvf_client *c)
{
        /* (getpid() is a system call since glibc 2.25, some tens of ns: cheap beside a
         * ring write, and nothing cached here can go stale across fork()) */
        pid_t me = getpid();
        if (me == c->pid)
                return 0;
        return kvf_err_set(-EBADF, "this client was attached by pid %d; after fork() attach anew in the child "
                                   "(pid %d)", (int)c->pid, (int)me);
}

static int map_cache(struct kvf_client *c)
{
        const struct kvf_ctl_header *h = c->ctl.hdr;
        /* The engine's caches are the engine's own: nothing of ours to map. */
        if (h->layout.cache_bytes == 0 || h->backend == KVF_BACKEND_ENGINE)
                return 0;
        return kvf_cache_map(h, true, &c->cache);
}

static int try_read(struct kvf_client *c, struct kvf_event *ev);
static void keep_previous(struct kvf_client *c, const struct kvf_event *ev);

/*
 * A new session: wait until the sender has ended the requests of the ones
 * before (it acknowledges in the sender area), taking the earlier sessions'
 * records out of the inbound rings meanwhile (a full completion ring would
 * otherwise hold the sender up). Bounded: a sender that is not running ends
 * them when it starts, before it reads any task of ours.
 */
static void wait_session_handover(struct kvf_client *c)
{
        struct kvf_ctl *ctl = &c->ctl;
        uint64_t end = kvf_now_ns() + kvf_ms(2000ull);
        struct kvf_event ev;
        pthread_mutex_lock(&c->poll_mu);
        for (;;) {
                /* An event of ours cannot come yet (nothing was submitted), but a
                 * record with no session (0) could: keep it as an earlier one's. */
                int rc;
                while ((rc = try_read(c, &ev)) > 0)
                        if (rc == 1)
                                keep_previous(c, &ev);
                if (kvf_load_acquire(&ctl->sender->engine_session_ack) >= c->session ||
                    !kvf_role_alive(ctl, KVF_ROLE_SENDER, kvf_now_ns()) || kvf_now_ns() > end)
                        break;
                kvf_sleep_ns(200000);
        }
        pthread_mutex_unlock(&c->poll_mu);
}

int kvf_attach(const char *name, unsigned wait_ms, struct kvf_client **out)
{
        struct kvf_client *c = calloc(1, sizeof(*c));
        int rc;

        if (!c)
                return kvf_err_set(-ENOMEM, "out of memory");
        rc = kvf_ctl_attach_wait(name, true, wait_ms, &c->ctl);
        if (rc < 0) {
                kvf_err_ctx(rc, "attach to instance '%s'", name);
                free(c);
                return rc;
        }
        struct kvf_ctl *ctl = &c->ctl;
        int64_t gen = kvf_role_claim(ctl, KVF_ROLE_ENGINE);
        if (gen < 0) {
                rc = kvf_err_ctx((int)gen, "attach to instance '%s' (one engine client per instance)", name);
                goto fail;
        }
        c->session = (uint64_t)gen;
        c->base_word = kvf_load_acquire(&ctl->roles[KVF_ROLE_ENGINE].session_base);
        c->pid = getpid();
        if ((rc = map_cache(c)) < 0) {
                kvf_err_ctx(rc, "attach to instance '%s'", name);
                goto fail;
        }
        pthread_mutex_init(&c->submit_mu, NULL);
        pthread_mutex_init(&c->poll_mu, NULL);
        pthread_mutex_init(&c->stream_mu, NULL);
        /* The sender checks the engine's slot when its doorbell rings: no need to wait
         * for its next heartbeat tick. */
        kvf_doorbell_ring(&c->ctl.bells[KVF_BELL_SENDER]);
        kvf_doorbell_ring(&c->ctl.bells[KVF_BELL_CONNECTOR]);
        wait_session_handover(c);
        *out = c;
        return 0;
fail:
        kvf_ctl_detach(&c->ctl);
        free(c);
        return rc;
}

void kvf_detach(struct kvf_client *c)
{
        if (!c)
                return;
        if (kvf_client_owned(c) < 0) {
                /* A forked child: the session is the parent's, which goes on using it. Release
                 * only what is this process's own: its copies of the mappings of the segment
                 * and (host) caches, and the memory. GPU mappings and the mutexes (another
                 * thread of the parent may have held one at the fork) are left alone. */
                if (c->cache.host)
                        kvf_cache_unmap(&c->cache);
                while (c->prev_head) {
                        struct previous *p = c->prev_head;
                        c->prev_head = p->next;
                        free(p);
                }
                free(c->dst);
                kvf_ctl_detach(&c->ctl);
                free(c);
                return;
        }
        kvf_stream_detach(c); /* (its copies and signals reference the cache and us) */
        /* A session another engine took over ends nothing: the slot and the registration are
         * the new session's now. */
        bool live = kvf_load_acquire(&c->ctl.roles[KVF_ROLE_ENGINE].generation) == c->session;
        if (c->registered && live)
                (void)kvf_unregister_caches(c); /* (a failure: the allocator sees us end anyway) */
        if (live)
                kvf_role_end(&c->ctl, KVF_ROLE_ENGINE);
        /* The session is over: the sender ends its requests now, not at its next tick. */
        kvf_doorbell_ring(&c->ctl.bells[KVF_BELL_SENDER]);
        kvf_doorbell_ring(&c->ctl.bells[KVF_BELL_CONNECTOR]);
        kvf_cache_unmap(&c->cache);
        while (c->prev_head) {
                struct previous *p = c->prev_head;
                c->prev_head = p->next;
                free(p);
        }
        free(c->dst);
        pthread_mutex_destroy(&c->submit_mu);
        pthread_mutex_destroy(&c->poll_mu);
        pthread_mutex_destroy(&c->stream_mu);
        kvf_ctl_detach(&c->ctl);
        free(c);
}

int kvf_get_layout_sized(struct kvf_client *c, struct kvf_layout_info *out, size_t out_size)
{
        int rc = kvf_abi_size_check(out_size, KVF_LAYOUT_INFO_SIZE_ABI1, "struct kvf_layout_info");
        if (rc < 0 || (rc = kvf_client_owned(c)) < 0)
                return rc;
        struct kvf_layout_info li;
        kvf_layout_to_info(&c->ctl.hdr->layout, &li);
        kvf_abi_copy_out(out, out_size, &li, sizeof(li));
        return 0;
}

void *kvf_cache_tensor(struct kvf_client *c, uint32_t layer, int v)
{
        if (kvf_client_owned(c) < 0)
                return NULL;
        const struct kvf_cache_layout *l = &c->ctl.hdr->layout;
        if (c->ctl.hdr->backend == KVF_BACKEND_ENGINE) {
                kvf_err_set(-ENOTSUP, "instance '%s' keeps the engine's own caches (--caches engine): the "
                            "engine addresses its tensors itself", c->ctl.hdr->instance);
                return NULL;
        }
        if (!c->cache.base || layer >= kvf_layout_layers(l) || v < 0 || (uint32_t)v >= kvf_layout_all_tensors(l))
                return NULL;
        return kvf_cache_addr(&c->cache, kvf_layout_offset(l, layer, (uint32_t)v, 0));
}

int kvf_cache_device(struct kvf_client *c)
{
        return c->cache.base && !c->cache.host ? c->cache.device : -1;
}

static int submit_bytes(struct kvf_client *c, int ring, int type, const void *buf, size_t len)
{
        struct kvf_ring *r = &c->ctl.rings[ring];
        int rc;

        if ((rc = kvf_client_owned(c)) < 0)
                return rc;
        if (len > UINT32_MAX)
                return kvf_err_set(-EMSGSIZE, "record of %zu bytes is too large", len);
        pthread_mutex_lock(&c->submit_mu);
        rc = kvf_ring_write(r, (uint16_t)type, buf, (uint32_t)len, NULL);
        pthread_mutex_unlock(&c->submit_mu);
        if (rc == -EAGAIN)
                return kvf_err_set(rc, "ring %s is full (%llu of %llu bytes used): its consumer is behind or not running",
                                   kvf_ring_name(ring), (unsigned long long)kvf_ring_used(r->hdr),
                                   (unsigned long long)r->capacity);
        if (rc == -EMSGSIZE)
                return kvf_err_set(rc, "a %zu-byte record can never fit ring %s (%llu bytes)", len,
                                   kvf_ring_name(ring), (unsigned long long)r->capacity);
        return rc;
}

static int submit_record(struct kvf_client *c, int ring, const struct kvf_record *rec)
{
        uint8_t *buf;
        size_t len;
        int rc = kvf_record_encode_alloc(rec, &buf, &len);
        if (rc < 0)
                return kvf_err_set(rc, "encode %s record: %s", kvf_rec_type_name(rec->type),
                                   strerror(-rc));
        rc = submit_bytes(c, ring, rec->type, buf, len);
        free(buf);
        return rc;
}

static int copy_str(char *dst, size_t cap, const char *src, const char *what)
{
        size_t n = src ? strlen(src) : 0;
        if (n == 0 || n >= cap)
                return kvf_err_set(-EINVAL, "%s must be 1 to %zu bytes", what, cap - 1);
        memcpy(dst, src, n + 1);
        return 0;
}

int kvf_client_submit_task(struct kvf_client *c, const struct kvf_task *caller, size_t size)
{
        struct kvf_record r = {.type = KVF_REC_TASK};
        struct kvf_task task, *t = &task;
        int rc = kvf_abi_copy_in(&task, sizeof(task), caller, size, "struct kvf_task");

        if (rc < 0)
                return rc;
        if ((rc = copy_str(r.request_id, sizeof(r.request_id), t->request_id, "request_id")) < 0 ||
            (rc = copy_str(r.peer, sizeof(r.peer), t->peer, "peer")) < 0)
                return rc;
        r.src = (uint32_t *)t->src_block_ids;
        r.n_src = t->n_src;
        r.dst = (uint32_t *)t->dest_block_ids;
        r.n_dst = t->n_dest;
        r.current_id = t->current_id;
        r.transport = t->transport;
        r.chunked = t->chunked != 0;
        r.peer_session = t->peer_session;
        if (kvf_transport_name(r.transport)[0] == '?')
                return kvf_err_set(-EINVAL, "transport %d is not ipc, tcp or rdma", t->transport);
        /* (a chunked task's steps come with its chunks) */
        if (!r.chunked && ((rc = kvf_client_owned(c)) < 0 ||
                           (rc = kvf_client_step_check(c, r.current_id, "task")) < 0))
                return rc;
        return submit_record(c, KVF_RING_ENGINE_TO_SENDER, &r);
}

int kvf_submit_task_sized(struct kvf_client *c, const struct kvf_task *t, size_t t_size)
{
        int rc = kvf_abi_size_check(t_size, KVF_TASK_SIZE_ABI1, "struct kvf_task");
        return rc < 0 ? rc : kvf_client_submit_task(c, t, t_size);
}

int kvf_submit_chunk(struct kvf_client *c, const char *request_id, uint64_t step,
                     uint64_t tokens_done, int last)
{
        struct kvf_record r = {.type = KVF_REC_CHUNK, .current_id = step, .tokens = tokens_done,
                               .last = last != 0};
        int rc = copy_str(r.request_id, sizeof(r.request_id), request_id, "request_id");
        if (rc == 0 && (rc = kvf_client_owned(c)) == 0)
                rc = kvf_client_step_check(c, step, "chunk");
        return rc < 0 ? rc : submit_record(c, KVF_RING_ENGINE_TO_SENDER, &r);
}

int kvf_submit_cancel(struct kvf_client *c, const char *request_id)
{
        struct kvf_record r = {.type = KVF_REC_CANCEL};
        int rc = copy_str(r.request_id, sizeof(r.request_id), request_id, "request_id");
        return rc < 0 ? rc : submit_record(c, KVF_RING_ENGINE_TO_SENDER, &r);
}

int kvf_submit_connect(struct kvf_client *c, const char *task_id, const char *peer)
{
        struct kvf_record r = {.type = KVF_REC_CONNECT};
        int rc;
        if ((rc = copy_str(r.request_id, sizeof(r.request_id), task_id, "task_id")) < 0 ||
            (rc = copy_str(r.peer, sizeof(r.peer), peer, "peer")) < 0)
                return rc;
        return submit_record(c, KVF_RING_ENGINE_TO_CONNECTOR, &r);
}

int kvf_submit_raw(struct kvf_client *c, int target, int record_type, const void *msgpack,
                   size_t len)
{
        if (target != KVF_TO_SENDER && target != KVF_TO_CONNECTOR)
                return kvf_err_set(-EINVAL, "target %d is not KVF_TO_SENDER or KVF_TO_CONNECTOR",
                                   target);
        if (record_type <= 0 || record_type > 0xfffe)
                return kvf_err_set(-EINVAL, "record type %d is out of range", record_type);
        return submit_bytes(c, target == KVF_TO_SENDER ? KVF_RING_ENGINE_TO_SENDER
                                                       : KVF_RING_ENGINE_TO_CONNECTOR,
                            record_type, msgpack, len);
}

int kvf_client_step_check(struct kvf_client *c, uint64_t step, const char *what)
{
        if (c->base_word && step <= KVF_PROGRESS_STEP(c->base_word))
                return kvf_err_set(-EINVAL,
                                   "%s for step %llu: steps up to %llu were published by an earlier engine "
                                   "session of this instance, so their layers count as done: number this "
                                   "session's steps from %llu (kvf_last_step() + 1 at attach)",
                                   what, (unsigned long long)step,
                                   (unsigned long long)KVF_PROGRESS_STEP(c->base_word),
                                   (unsigned long long)KVF_PROGRESS_STEP(c->base_word) + 1);
        return 0;
}

int kvf_client_layer_check(struct kvf_client *c, uint64_t step, uint32_t layer)
{
        int rc = kvf_client_owned(c);
        if (rc < 0)
                return rc;
        const struct kvf_cache_layout *l = &c->ctl.hdr->layout;
        if (layer >= kvf_layout_layers(l))
                return kvf_err_set(-EINVAL, "layer %u is beyond the %u layers of this instance", layer,
                                   kvf_layout_layers(l));
        if (step >= (1ull << (64 - KVF_PROGRESS_LAYER_BITS)))
                return kvf_err_set(-EINVAL, "step %llu is too large", (unsigned long long)step);
        /* A session another engine took over publishes nothing: its words would count as
         * the new session's layers. (A word published between this check and the store can
         * still slip through; the sender ends the old session's requests either way.) */
        uint64_t live = kvf_load_acquire(&c->ctl.roles[KVF_ROLE_ENGINE].generation);
        if (live != c->session)
                return kvf_err_set(-ESTALE,
                                   "layer-done: engine session %llu of instance '%s' ended (session %llu "
                                   "holds it now): attach again",
                                   (unsigned long long)c->session, c->ctl.hdr->instance,
                                   (unsigned long long)live);
        if ((rc = kvf_client_step_check(c, step, "layer-done")) < 0)
                return rc;
        uint64_t cur = kvf_load_relaxed(&c->ctl.progress->word);
        if (step < KVF_PROGRESS_STEP(cur))
                return kvf_err_set(-EINVAL,
                                   "layer-done for step %llu after step %llu was published: steps only grow "
                                   "(an engine that attaches again numbers its steps from kvf_last_step() + 1)",
                                   (unsigned long long)step, (unsigned long long)KVF_PROGRESS_STEP(cur));
        return 0;
}

void kvf_client_publish(struct kvf_client *c, uint64_t want)
{
        struct kvf_progress *pg = c->ctl.progress;
        uint64_t cur = kvf_load_relaxed(&pg->word);
        /* Before the word: a sender that sees the word reads a publish time at
         * least this late (statistics only, so relaxed is enough). */
        kvf_store_relaxed(&pg->publish_ns, kvf_now_ns());
        /* Monotonic max. Release: the engine's cache writes for this layer
         * happen before the sender can see the new word (its acquire load). */
        while (cur < want && !kvf_cas_acq_rel(&pg->word, &cur, want)) {
        }
        kvf_fetch_add_relaxed(&pg->events, 1);
        kvf_doorbell_ring(&c->ctl.bells[KVF_BELL_SENDER]);
}

int kvf_layer_done(struct kvf_client *c, uint64_t step, uint32_t layer)
{
        int rc = kvf_client_layer_check(c, step, layer);
        if (rc < 0)
                return rc;
        kvf_client_publish(c, KVF_PROGRESS_PACK(step, layer + 1));
        return 0;
}

uint64_t kvf_last_step(struct kvf_client *c)
{
        if (kvf_client_owned(c) < 0)
                return 0;
        return KVF_PROGRESS_STEP(kvf_load_acquire(&c->ctl.progress->word));
}

struct poll_ctx {
        struct kvf_client *c;
        struct kvf_event *ev;
        int rc;
};

static void fill_event(struct kvf_client *c, struct kvf_event *ev, struct kvf_record *r)
{
        memset(ev, 0, sizeof(*ev));
        switch (r->type) {
        case KVF_REC_COMPLETION:
                ev->type = KVF_EVENT_COMPLETION;
                break;
        case KVF_REC_ARRIVAL:
                ev->type = KVF_EVENT_ARRIVAL;
                break;
        default:
                ev->type = KVF_EVENT_CONNECT_RESULT;
                break;
        }
        ev->session = r->session;
        ev->status = r->status;
        ev->flags = r->id_bin ? KVF_EVENT_ID_BIN : 0;
        snprintf(ev->request_id, sizeof(ev->request_id), "%s", r->request_id);
        snprintf(ev->peer, sizeof(ev->peer), "%s", r->peer);
        snprintf(ev->reason, sizeof(ev->reason), "%s", r->reason);
        ev->bytes = r->bytes;
        ev->blocks = (uint32_t)r->blocks;
        ev->accept_ns = r->accept_ns;
        ev->last_layer_ns = r->last_layer_ns;
        ev->done_ns = r->done_ns;
        if (r->type == KVF_REC_ARRIVAL && r->n_dst) {
                /* The client keeps the last arrival's list (poll_mu held by the caller). */
                free(c->dst);
                c->dst = r->dst;
                r->dst = NULL;
                ev->dest_block_ids = c->dst;
                ev->n_dest = r->n_dst;
                r->n_dst = 0;
        }
}

/* Keep an event of an earlier engine session for kvf_poll_previous() (poll_mu held). */
static void keep_previous(struct kvf_client *c, const struct kvf_event *ev)
{
        struct previous *p = c->nprev < PREVIOUS_MAX ? malloc(sizeof(*p)) : NULL;
        if (!p) {
                c->prev_dropped++;
                return;
        }
        p->ev = *ev;
        p->ev.dest_block_ids = NULL; /* not kept: the list is only valid until the next poll */
        p->ev.n_dest = 0;
        p->next = NULL;
        if (c->prev_tail)
                c->prev_tail->next = p;
        else
                c->prev_head = p;
        c->prev_tail = p;
        c->nprev++;
}

static int on_record(void *arg, uint16_t type, const uint8_t *p, uint32_t len, uint64_t pos)
{
        struct poll_ctx *pc = arg;
        struct kvf_record r;
        (void)pos;

        if (type != KVF_REC_COMPLETION && type != KVF_REC_ARRIVAL && type != KVF_REC_CONNECT_RESULT) {
                pc->rc = kvf_err_set(-EBADMSG, "unexpected record type %u on an engine ring", type);
                return 0;
        }
        int rc = kvf_record_decode(type, p, len, 0, &r);
        if (rc == 0) {
                fill_event(pc->c, pc->ev, &r);
                /* Another session's: never this session's event (kvf_attach). */
                if (r.session && r.session != pc->c->session) {
                        keep_previous(pc->c, pc->ev);
                        pc->rc = 2;
                }
        } else {
                pc->rc = kvf_err_ctx(rc, "malformed record from kvferry");
        }
        kvf_record_free(&r);
        pc->rc = pc->rc ? pc->rc : 1;
        return 0;
}

/* One record: 1 = an event of this session in *ev, 2 = one of an earlier session (kept), 0 none. */
static int try_read(struct kvf_client *c, struct kvf_event *ev)
{
        static const int rings[2] = {KVF_RING_SENDER_TO_ENGINE, KVF_RING_CONNECTOR_TO_ENGINE};
        for (int i = 0; i < 2; i++) {
                struct poll_ctx pc = {.c = c, .ev = ev};
                int ring = rings[(c->next_ring + (unsigned)i) & 1];
                int n = kvf_ring_read(&c->ctl.rings[ring], on_record, &pc, 1);
                if (n < 0)
                        return kvf_err_ctx(n, "read ring %s", kvf_ring_name(ring));
                if (n > 0) {
                        c->next_ring++;
                        return pc.rc;
                }
        }
        return 0;
}

uint64_t kvf_session(struct kvf_client *c)
{
        return c->session;
}

int kvf_poll_previous_sized(struct kvf_client *c, struct kvf_event *out, size_t ev_size)
{
        struct kvf_event event, *ev = &event;
        int rc = kvf_abi_size_check(ev_size, KVF_EVENT_SIZE_ABI1, "struct kvf_event");
        if (rc < 0 || (rc = kvf_client_owned(c)) < 0)
                return rc;
        pthread_mutex_lock(&c->poll_mu);
        struct previous *p = c->prev_head;
        if (p) {
                c->prev_head = p->next;
                if (!c->prev_head)
                        c->prev_tail = NULL;
                c->nprev--;
                *ev = p->ev;
        }
        pthread_mutex_unlock(&c->poll_mu);
        if (p)
                kvf_abi_copy_out(out, ev_size, ev, sizeof(*ev));
        free(p);
        return p != NULL;
}

uint64_t kvf_previous_dropped(struct kvf_client *c)
{
        pthread_mutex_lock(&c->poll_mu);
        uint64_t n = c->prev_dropped;
        pthread_mutex_unlock(&c->poll_mu);
        return n;
}

static bool engine_has_work(void *arg)
{
        struct kvf_client *c = arg;
        return kvf_ring_readable(&c->ctl.rings[KVF_RING_SENDER_TO_ENGINE]) ||
               kvf_ring_readable(&c->ctl.rings[KVF_RING_CONNECTOR_TO_ENGINE]);
}

/* kvf_poll into the library's own struct (the caller's size is applied by the wrappers). */
static int poll_event(struct kvf_client *c, struct kvf_event *ev, int timeout_ms)
{
        uint64_t end = timeout_ms < 0 ? UINT64_MAX : kvf_now_ns() + kvf_ms(timeout_ms);
        int rc = kvf_client_owned(c);
        if (rc < 0)
                return rc;
        uint64_t beat = kvf_ms(c->ctl.hdr->heartbeat_ms);

        pthread_mutex_lock(&c->poll_mu);
        for (;;) {
                rc = try_read(c, ev);
                if (rc == 2)
                        continue; /* an earlier session's: kept apart, read on */
                if (rc != 0)
                        break;
                kvf_role_heartbeat(&c->ctl, KVF_ROLE_ENGINE);
                uint64_t now = kvf_now_ns();
                if (now >= end)
                        break;
                uint64_t wait = end - now < beat ? end - now : beat;
                kvf_doorbell_wait(&c->ctl.bells[KVF_BELL_ENGINE], engine_has_work, c, 64, wait);
        }
        pthread_mutex_unlock(&c->poll_mu);
        return rc;
}

int kvf_poll_sized(struct kvf_client *c, struct kvf_event *ev, size_t ev_size, int timeout_ms)
{
        struct kvf_event e;
        int rc = kvf_abi_size_check(ev_size, KVF_EVENT_SIZE_ABI1, "struct kvf_event");
        if (rc < 0 || (rc = poll_event(c, &e, timeout_ms)) <= 0)
                return rc;
        kvf_abi_copy_out(ev, ev_size, &e, sizeof(e));
        return rc;
}

/* ---- groups: one instance per tensor-parallel rank ---- */

struct pending {
        int type;
        char id[sizeof(((struct kvf_event *)0)->request_id)];
        uint64_t members; /* bit per rank that reported (ranks < 64) */
        struct kvf_event agg;
        struct pending *next;
};

struct kvf_group {
        unsigned n;
        struct kvf_client **m;
        struct pending *pending;
        unsigned next;
};

int kvf_group_attach(const char *const *names, unsigned n, unsigned wait_ms, struct kvf_group **out)
{
        if (n == 0 || n > 64)
                return kvf_err_set(-EINVAL, "a group has 1 to 64 ranks, not %u", n);
        struct kvf_group *g = calloc(1, sizeof(*g));
        if (!g || !(g->m = calloc(n, sizeof(*g->m)))) {
                free(g);
                return kvf_err_set(-ENOMEM, "out of memory");
        }
        for (unsigned i = 0; i < n; i++) {
                int rc = kvf_attach(names[i], wait_ms, &g->m[i]);
                if (rc < 0) {
                        g->n = i;
                        kvf_group_detach(g);
                        return kvf_err_ctx(rc, "rank %u", i);
                }
        }
        g->n = n;
        *out = g;
        return 0;
}

void kvf_group_detach(struct kvf_group *g)
{
        if (!g)
                return;
        for (unsigned i = 0; i < g->n; i++)
                kvf_detach(g->m[i]);
        while (g->pending) {
                struct pending *p = g->pending;
                g->pending = p->next;
                free(p);
        }
        free(g->m);
        free(g);
}

struct kvf_client *kvf_group_member(struct kvf_group *g, unsigned rank)
{
        return rank < g->n ? g->m[rank] : NULL;
}

/* Fold one member's event in; returns 1 when the aggregate is complete in *ev. */
static int fold(struct kvf_group *g, unsigned rank, struct kvf_event *ev)
{
        struct pending **pp = &g->pending, *p;

        for (; (p = *pp); pp = &p->next)
                if (p->type == ev->type && !strcmp(p->id, ev->request_id))
                        break;
        if (!p) {
                if (!(p = calloc(1, sizeof(*p))))
                        return kvf_err_set(-ENOMEM, "out of memory");
                p->type = ev->type;
                snprintf(p->id, sizeof(p->id), "%s", ev->request_id);
                p->agg = *ev;
                p->agg.dest_block_ids = NULL; /* a member's list, valid until its next poll */
                p->agg.n_dest = 0;
                p->agg.bytes = 0;
                p->agg.blocks = 0;
                p->agg.status = KVF_STATUS_FINISHED;
                p->agg.reason[0] = '\0';
                p->next = g->pending;
                g->pending = p;
                pp = &g->pending;
        }
        if (p->members & (1ull << rank))
                return 0; /* a rank reports each request once; ignore a repeat */
        p->members |= 1ull << rank;
        p->agg.bytes += ev->bytes;
        p->agg.blocks += ev->blocks;
        if (ev->accept_ns && (!p->agg.accept_ns || ev->accept_ns < p->agg.accept_ns))
                p->agg.accept_ns = ev->accept_ns;
        if (ev->last_layer_ns > p->agg.last_layer_ns)
                p->agg.last_layer_ns = ev->last_layer_ns;
        if (ev->done_ns > p->agg.done_ns)
                p->agg.done_ns = ev->done_ns;
        if (ev->status != KVF_STATUS_FINISHED && p->agg.status == KVF_STATUS_FINISHED) {
                p->agg.status = ev->status;
                snprintf(p->agg.reason, sizeof(p->agg.reason), "rank %u: %s", rank, ev->reason);
        }
        if ((unsigned)__builtin_popcountll(p->members) < g->n)
                return 0;
        *ev = p->agg;
        ev->rank = 0;
        *pp = p->next;
        free(p);
        return 1;
}

struct members {
        struct kvf_client *const *m;
        unsigned n;
};

static bool members_have_work(void *arg)
{
        const struct members *ms = arg;
        for (unsigned i = 0; i < ms->n; i++)
                if (engine_has_work(ms->m[i]))
                        return true;
        return false;
}

/*
 * Sleep until one of n instances has an event for the engine, or `left` ns (at most a
 * heartbeat: the caller's poll_event() beats between waits). On every engine doorbell at once
 * where the kernel has futex_waitv; else on each in turn (*turn) for at most a millisecond.
 */
static void wait_members(struct kvf_client *const *m, unsigned n, unsigned *turn, uint64_t left)
{
        uint64_t beat = kvf_ms(m[0]->ctl.hdr->heartbeat_ms);
        if (left > beat)
                left = beat;
        if (n <= KVF_DOORBELL_ANY_MAX) {
                struct kvf_doorbell *bells[KVF_DOORBELL_ANY_MAX] = {0}; /* (n of them set) */
                for (unsigned i = 0; i < n; i++)
                        bells[i] = &m[i]->ctl.bells[KVF_BELL_ENGINE];
                struct members ms = {m, n};
                if (kvf_doorbell_wait_any(bells, n, members_have_work, &ms, 0, left) != -ENOSYS)
                        return;
        }
        struct kvf_client *c = m[(*turn)++ % n];
        kvf_doorbell_wait(&c->ctl.bells[KVF_BELL_ENGINE], engine_has_work, c, 0,
                          left < 1000000ull ? left : 1000000ull);
}

static int group_poll(struct kvf_group *g, struct kvf_event *ev, int timeout_ms)
{
        uint64_t end = timeout_ms < 0 ? UINT64_MAX : kvf_now_ns() + kvf_ms(timeout_ms);

        for (;;) {
                bool any = false;
                for (unsigned k = 0; k < g->n; k++) {
                        unsigned i = (g->next + k) % g->n;
                        int rc = poll_event(g->m[i], ev, 0);
                        if (rc < 0)
                                return kvf_err_ctx(rc, "rank %u", i);
                        if (rc == 0)
                                continue;
                        any = true;
                        ev->rank = i;
                        if (ev->type == KVF_EVENT_CONNECT_RESULT)
                                return 1;
                        rc = fold(g, i, ev);
                        if (rc != 0) {
                                g->next = i + 1;
                                return rc;
                        }
                }
                if (any)
                        continue;
                uint64_t now = kvf_now_ns();
                if (now >= end)
                        return 0;
                wait_members(g->m, g->n, &g->next, end - now);
        }
}

/* Served in turn across calls (per thread): a busy client cannot starve the others. */
static _Thread_local unsigned any_turn;

static int poll_any(struct kvf_client *const *cs, unsigned n, struct kvf_event *ev, int timeout_ms)
{
        if (!cs || n == 0 || n > KVF_DOORBELL_ANY_MAX)
                return kvf_err_set(-EINVAL, "kvf_poll_any: 1 to %u clients, not %u", KVF_DOORBELL_ANY_MAX, n);
        for (unsigned i = 0; i < n; i++)
                if (!cs[i])
                        return kvf_err_set(-EINVAL, "kvf_poll_any: client %u is NULL", i);
        uint64_t end = timeout_ms < 0 ? UINT64_MAX : kvf_now_ns() + kvf_ms(timeout_ms);
        for (;;) {
                for (unsigned k = 0; k < n; k++) {
                        unsigned i = (any_turn + k) % n;
                        int rc = poll_event(cs[i], ev, 0);
                        if (rc < 0)
                                return kvf_err_ctx(rc, "client %u", i);
                        if (rc > 0) {
                                ev->rank = i;
                                any_turn = i + 1;
                                return 1;
                        }
                }
                uint64_t now = kvf_now_ns();
                if (now >= end)
                        return 0;
                wait_members(cs, n, &any_turn, end - now);
        }
}

int kvf_poll_any_sized(struct kvf_client *const *cs, unsigned n, struct kvf_event *ev, size_t ev_size,
                       int timeout_ms)
{
        struct kvf_event e;
        int rc = kvf_abi_size_check(ev_size, KVF_EVENT_SIZE_ABI1, "struct kvf_event");
        if (rc < 0 || (rc = poll_any(cs, n, &e, timeout_ms)) <= 0)
                return rc;
        kvf_abi_copy_out(ev, ev_size, &e, sizeof(e));
        return rc;
}

int kvf_group_poll_sized(struct kvf_group *g, struct kvf_event *ev, size_t ev_size, int timeout_ms)
{
        struct kvf_event e;
        int rc = kvf_abi_size_check(ev_size, KVF_EVENT_SIZE_ABI1, "struct kvf_event");
        if (rc < 0 || (rc = group_poll(g, &e, timeout_ms)) <= 0)
                return rc;
        kvf_abi_copy_out(ev, ev_size, &e, sizeof(e));
        return rc;
}
