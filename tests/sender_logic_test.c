/*
 * The sender's request logic, driven in-process: no kvf-sender, no connector, no
 * supervisor. The test makes real control segments in /dev/shm (a prefill
 * instance and a same-host decode peer, host caches; and a pair with the
 * host-async backend, whose copies land later), plays the engine (tasks, chunks,
 * cancels, progress words into the real ring and words) and the connector (write
 * results, its generation), runs the sender's loop steps itself, and checks what
 * comes out: completions (status, reason), records to the connector (open, write
 * batch, finish notice, abort, withdrawal), the bytes in the peer's cache, and each
 * slot's state, in this process and in the shared table; and a stop (SIGTERM: refusals, the
 * drain window, withdrawals). A "restart" is a second
 * struct sender adopting the same segment after the first was dropped without a
 * word, as a crash would leave it.
 */
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cache.h"
#include "cache_host_alloc.h"
#include "check.h"
#include "clock.h"
#include "ctl.h"
#include "layout.h"
#include "records.h"
#include "sender.h"

#define LAYERS 4u
#define BLOCKS 32u
#define SLOTS 8u
#define TIMEOUT_NS (10ull * 1000000000ull)

struct inst {
        char name[KVF_INSTANCE_MAX];
        struct kvf_ctl ctl;     /* the test's view: engine, connector, allocator */
        struct kvf_cache cache; /* mapped read-write: fill (prefill), check (decode) */
        uint64_t engine;        /* the engine session the test plays */
        bool made;
};

static struct inst P, D, PA, DA; /* host: P -> D; host-async: PA -> DA */

static void cleanup(void)
{
        struct inst *all[] = {&P, &D, &PA, &DA};
        for (unsigned i = 0; i < 4; i++)
                if (all[i]->made)
                        kvf_ctl_unlink(all[i]->name);
}

/* A crash leaves no segments behind either (a CHECK exits, and atexit cleans up). */
static void on_fatal(int sig)
{
        cleanup();
        signal(sig, SIG_DFL);
        raise(sig);
}

static void inst_make(struct inst *in, const char *tag, uint32_t irole, uint32_t backend)
{
        struct kvf_ctl_params p = {
            .instance_role = irole, .backend = backend, .reqtab_slots = SLOTS, .max_blocks = 16};
        snprintf(in->name, sizeof(in->name), "slt-%s%d", tag, (int)getpid());
        p.instance = in->name;
        for (int i = 0; i < KVF_RING_COUNT; i++)
                p.ring_capacity[i] = KVF_RING_MIN_CAPACITY;
        CHECK(kvf_layout_make(&p.layout, LAYERS, 0, BLOCKS, 1, 4, 16, KVF_DTYPE_FP16, 0) == 0);
        kvf_ctl_unlink(in->name);
        CHECK(kvf_ctl_create(&p, &in->ctl) == 0);
        in->made = true;
        CHECK(kvf_cache_create(in->ctl.hdr, &(struct kvf_cache_opts){.huge_pages = KVF_HUGE_OFF}) ==
              0);
        kvf_role_begin(&in->ctl, KVF_ROLE_ALLOCATOR);
        kvf_ctl_publish(&in->ctl);
        CHECK(kvf_cache_map(in->ctl.hdr, true, &in->cache) == 0);
        /* Every byte of the cache says where it is: the peer's copy is checked against it. */
        for (uint64_t i = 0; i < in->cache.bytes; i++)
                in->cache.base[i] = (uint8_t)(i * 7 + (irole == KVF_IROLE_DECODE ? 3 : 1));
}

/* The engine attaches (a new session) or detaches. */
static void engine_attach(struct inst *in)
{
        in->engine = kvf_role_begin(&in->ctl, KVF_ROLE_ENGINE);
        kvf_ring_producer_attach(&in->ctl.rings[KVF_RING_ENGINE_TO_SENDER], in->engine);
}

/* The connector (re)starts: a new generation, producing its ring to the sender. */
static void connector_start(struct inst *in)
{
        uint64_t g = kvf_role_begin(&in->ctl, KVF_ROLE_CONNECTOR);
        kvf_ring_producer_attach(&in->ctl.rings[KVF_RING_CONNECTOR_TO_SENDER], g);
}

static void put(struct kvf_ring *ring, const struct kvf_record *r)
{
        static uint8_t buf[16384];
        int n = kvf_record_encode(r, buf, sizeof(buf));
        CHECK(n > 0);
        int rc = kvf_ring_write(ring, r->type, buf, (uint32_t)n, NULL);
        if (rc < 0) {
                fprintf(stderr, "writing the %s record of '%s' into ring %s: %s\n",
                        kvf_rec_type_name(r->type), r->request_id,
                        kvf_ring_name((int)ring->hdr->id), strerror(-rc));
                exit(1);
        }
}

static void task(struct inst *in, const char *id, const char *peer, int transport,
                 const uint32_t *src, uint32_t nsrc, const uint32_t *dst, uint32_t ndst,
                 uint64_t step, bool chunked)
{
        struct kvf_record t = {.type = KVF_REC_TASK,
                               .current_id = step,
                               .transport = transport,
                               .src = (uint32_t *)src,
                               .n_src = nsrc,
                               .dst = (uint32_t *)dst,
                               .n_dst = ndst,
                               .chunked = chunked};
        snprintf(t.request_id, sizeof(t.request_id), "%s", id);
        snprintf(t.peer, sizeof(t.peer), "%s", peer);
        put(&in->ctl.rings[KVF_RING_ENGINE_TO_SENDER], &t);
}

static void chunk(struct inst *in, const char *id, uint64_t step, uint64_t tokens, bool last)
{
        struct kvf_record c = {
            .type = KVF_REC_CHUNK, .current_id = step, .tokens = tokens, .last = last};
        snprintf(c.request_id, sizeof(c.request_id), "%s", id);
        put(&in->ctl.rings[KVF_RING_ENGINE_TO_SENDER], &c);
}

static void cancel(struct inst *in, const char *id)
{
        struct kvf_record c = {.type = KVF_REC_CANCEL};
        snprintf(c.request_id, sizeof(c.request_id), "%s", id);
        put(&in->ctl.rings[KVF_RING_ENGINE_TO_SENDER], &c);
}

static void write_result(struct inst *in, uint64_t key, const char *id, int status,
                         const char *reason)
{
        struct kvf_record w = {.type = KVF_RT_WRITE_RESULT, .key = key, .status = status};
        snprintf(w.request_id, sizeof(w.request_id), "%s", id);
        snprintf(w.reason, sizeof(w.reason), "%s", reason);
        put(&in->ctl.rings[KVF_RING_CONNECTOR_TO_SENDER], &w);
}

static void progress(struct inst *in, uint64_t step, uint32_t layers)
{
        kvf_store_relaxed(&in->ctl.progress->publish_ns, kvf_now_ns());
        kvf_store_release(&in->ctl.progress->word, KVF_PROGRESS_PACK(step, layers));
}

/* ---- what comes out ---- */

struct rec {
        uint16_t type;
        char id[KVF_REQ_ID_MAX];
        char reason[KVF_REASON_MAX];
        int status;
        uint64_t key, layer, layer_count, bytes;
        bool withdraw;
};

struct outs {
        struct rec r[256];
        unsigned n;
};

static int grab(void *ctx, uint16_t type, const uint8_t *p, uint32_t len, uint64_t pos)
{
        struct outs *o = ctx;
        struct kvf_record k;
        (void)pos;
        CHECK(kvf_record_decode(type, p, len, 0, &k) == 0);
        CHECK(o->n < sizeof(o->r) / sizeof(o->r[0]));
        struct rec *r = &o->r[o->n++];
        r->type = type;
        snprintf(r->id, sizeof(r->id), "%s", k.request_id);
        snprintf(r->reason, sizeof(r->reason), "%s", k.reason);
        r->status = k.status;
        r->key = k.key;
        r->layer = k.layer;
        r->layer_count = k.layer_count;
        r->bytes = k.bytes;
        r->withdraw = k.withdraw;
        kvf_record_free(&k);
        return 0;
}

/* Read what the sender wrote for the engine (completions) or the connector. */
static struct outs *drain(struct inst *in, int ring)
{
        static struct outs o;
        o.n = 0;
        while (kvf_ring_read(&in->ctl.rings[ring], grab, &o, 64) > 0) {
        }
        return &o;
}

static struct outs *completions(struct inst *in)
{
        return drain(in, KVF_RING_SENDER_TO_ENGINE);
}

static struct outs *to_connector(struct inst *in)
{
        return drain(in, KVF_RING_SENDER_TO_CONNECTOR);
}

static unsigned count_type(const struct outs *o, uint16_t type)
{
        unsigned n = 0;
        for (unsigned i = 0; i < o->n; i++)
                n += o->r[i].type == type;
        return n;
}

static const struct rec *find(const struct outs *o, uint16_t type, const char *id)
{
        for (unsigned i = 0; i < o->n; i++)
                if (o->r[i].type == type && !strcmp(o->r[i].id, id))
                        return &o->r[i];
        return NULL;
}

/* The one completion of `id` in `o`, with this status and a reason containing `has`. */
#define CHECK_DONE(o, id, st, has)                                                                 \
        do {                                                                                       \
                const struct rec *c_ = find((o), KVF_REC_COMPLETION, (id));                        \
                CHECK(c_);                                                                         \
                if (c_->status != (st) || !strstr(c_->reason, (has))) {                            \
                        fprintf(stderr,                                                            \
                                "%s:%d: %s: status %d reason \"%s\", expected %d \"%s\"\n",        \
                                __FILE__, __LINE__, (id), c_->status, c_->reason, (st), (has));    \
                        exit(1);                                                                   \
                }                                                                                  \
        } while (0)

/* ---- the sender ---- */

static void sender_up_with(struct sender *s, struct inst *in, bool notice_rings)
{
        memset(s, 0, sizeof(*s));
        const struct sender_opts o = {.request_timeout_ns = TIMEOUT_NS,
                                      .notice_rings = notice_rings};
        CHECK(sender_open(s, in->name, &o) == 0);
        CHECK(sender_start(s) == 0);
}

static void sender_up(struct sender *s, struct inst *in)
{
        sender_up_with(s, in, false);
}

/* One turn of kvf-sender's loop (main.c's run), less its waiting. */
static void turn(struct sender *s)
{
        uint64_t eg = kvf_load_acquire(&s->ctl.roles[KVF_ROLE_ENGINE].generation);
        if (eg != s->engine_gen_seen ||
            (s->session &&
             kvf_load_acquire(&s->ctl.roles[KVF_ROLE_ENGINE].state) == KVF_STATE_STOPPED)) {
                s->engine_gen_seen = eg;
                sender_sessions_check(s, true);
        }
        uint64_t w = kvf_load_acquire(&s->ctl.progress->word);
        if (w != s->progress) {
                sender_sessions_check(s, false);
                sender_req_progress(s, w, kvf_load_relaxed(&s->ctl.progress->publish_ns));
        }
        s->engine_blocked = false; /* (no 1 ms wait for a retry here) */
        sender_read_engine(s, 1000000);
        sender_read_connector(s);
}

/* Turns until nothing is left in flight or owed (bounded). */
static void settle(struct sender *s)
{
        uint64_t end = kvf_now_ns() + 3000000000ull;
        turn(s);
        while ((s->cp.flight || s->cp.nowes || s->sliced) && kvf_now_ns() < end) {
                kvf_sleep_ns(200000);
                turn(s);
        }
        turn(s);
}

static uint32_t slot_of(struct sender *s, const char *id)
{
        uint32_t slot = sender_map_find(s, id);
        CHECK(slot != UINT32_MAX);
        return slot;
}

#define CHECK_STATE(s, slot, st, shm)                                                              \
        do {                                                                                       \
                if (sender_req_state((s), (slot)) != (st) ||                                       \
                    kvf_load_acquire(&(s)->ctl.reqtab[(slot)].state) != (shm)) {                   \
                        fprintf(stderr, "%s:%d: slot %u is %s (shared %u), expected %s (%u)\n",    \
                                __FILE__, __LINE__, (slot),                                        \
                                sender_req_state_name(sender_req_state((s), (slot))),              \
                                (s)->ctl.reqtab[(slot)].state, sender_req_state_name(st),          \
                                (unsigned)(shm));                                                  \
                        exit(1);                                                                   \
                }                                                                                  \
        } while (0)

static uint64_t key_of(struct sender *s, uint32_t slot)
{
        return sender_key(slot, s->ctl.reqtab[slot].incarnation);
}

/* Every byte of src blocks -> dst blocks (every layer, both tensors) is in the peer's cache. */
static bool landed(struct inst *from, struct inst *to, const uint32_t *src, const uint32_t *dst,
                   uint32_t n)
{
        const struct kvf_cache_layout *L = &from->cache.layout;
        for (uint32_t l = 0; l < LAYERS; l++)
                for (uint32_t t = 0; t < 2; t++)
                        for (uint32_t i = 0; i < n; i++)
                                if (memcmp(to->cache.base +
                                               kvf_layout_offset(&to->cache.layout, l, t, dst[i]),
                                           from->cache.base + kvf_layout_offset(L, l, t, src[i]),
                                           L->block_bytes))
                                        return false;
        return true;
}

static bool layer_landed(struct inst *from, struct inst *to, uint32_t l, uint32_t src, uint32_t dst)
{
        const struct kvf_cache_layout *L = &from->cache.layout;
        return !memcmp(to->cache.base + kvf_layout_offset(&to->cache.layout, l, 0, dst),
                       from->cache.base + kvf_layout_offset(L, l, 0, src), L->block_bytes);
}

static uint64_t step_now = 100; /* steps only grow, as an engine's do */

static uint64_t next_step(void)
{
        return ++step_now;
}

static const char *tcp_peer = "192.0.2.7:7100"; /* a remote decode connector: never dialled here */
static const char *nobody = "no-such-instance-with-a-rather-long-name-0123";

/* The sender's per-transfer histograms and the failed-notification counter, as a case saw
 * them before it began: each checks what it added. */
struct figures {
        uint64_t n_bytes, bytes, n_descs, descs, n_xfer, notices_failed;
};

static struct figures figures(const struct sender *s)
{
        const struct kvf_histogram *h = s->ctl.sender->hist;
        return (struct figures){
            .n_bytes = h[KVF_HIST_REQ_BYTES].count, .bytes = h[KVF_HIST_REQ_BYTES].sum,
            .n_descs = h[KVF_HIST_REQ_DESCS].count, .descs = h[KVF_HIST_REQ_DESCS].sum,
            .n_xfer = h[KVF_HIST_REQ_XFER].count,
            .notices_failed = s->ctl.counters[KVF_CTR_NOTICES_FAILED].value};
}

/* ---- the cases ---- */

/* accepted -> layers -> landed -> notice -> acknowledged finished (ipc); the prefix rule. */
static void case_ipc_finished(struct sender *s)
{
        const uint32_t src[3] = {1, 2, 3}, dst[2] = {20, 22};
        uint64_t st = next_step();
        struct figures f0 = figures(s);
        task(&P, "ipc-ok", D.name, KVF_TRANSPORT_IPC, src, 3, dst, 2, st, false);
        turn(s);
        uint32_t slot = slot_of(s, "ipc-ok");
        CHECK_STATE(s, slot, SREQ_MOVING, KVF_REQ_ACTIVE);
        CHECK(!layer_landed(&P, &D, 0, 2, 20));
        progress(&P, st, 1);
        turn(s);
        CHECK_STATE(s, slot, SREQ_MOVING, KVF_REQ_ACTIVE);
        CHECK(layer_landed(&P, &D, 0, 2, 20) && !layer_landed(&P, &D, 1, 2, 20));
        CHECK_EQ(to_connector(&P)->n, 0); /* nothing is said before every byte has landed */
        progress(&P, st, LAYERS);
        turn(s);
        CHECK_STATE(s, slot, SREQ_LANDED, KVF_REQ_FINISHING);
        CHECK(landed(&P, &D, src + 1, dst, 2));
        CHECK(s->ctl.reqtab[slot].notice_gen != 0);
        struct outs *o = to_connector(&P);
        CHECK_EQ(o->n, 1);
        CHECK(o->r[0].type == KVF_RT_FINISH && o->r[0].status == KVF_STATUS_FINISHED &&
              !o->r[0].withdraw);
        CHECK_EQ(o->r[0].key, key_of(s, slot));
        CHECK_EQ(completions(&P)->n, 0); /* only the peer's answer decides */
        write_result(&P, key_of(s, slot), "ipc-ok", KVF_STATUS_FINISHED, "");
        turn(s);
        CHECK_STATE(s, slot, SREQ_FREE, KVF_REQ_FREE);
        o = completions(&P);
        CHECK_EQ(o->n, 1);
        CHECK_DONE(o, "ipc-ok", KVF_STATUS_FINISHED, "");
        CHECK_EQ(o->r[0].bytes, 2ull * LAYERS * 2 * P.cache.layout.block_bytes);
        /* One observation per transfer: its bytes; its descriptors, the copy runs: source
         * blocks 2, 3 go to 20, 22 (two runs) in every layer and tensor; its time. */
        struct figures f1 = figures(s);
        CHECK_EQ(f1.n_bytes, f0.n_bytes + 1);
        CHECK_EQ(f1.bytes, f0.bytes + 2ull * LAYERS * 2 * P.cache.layout.block_bytes);
        CHECK_EQ(f1.n_descs, f0.n_descs + 1);
        CHECK_EQ(f1.descs, f0.descs + 2ull * LAYERS * 2);
        CHECK_EQ(f1.n_xfer, f0.n_xfer + 1);
        CHECK_EQ(f1.notices_failed, f0.notices_failed);
}

/* Tasks that never get a slot: each a completion with its status and reason. */
static void case_bad_tasks(struct sender *s)
{
        const uint32_t src[2] = {1, 2}, dst[2] = {5, 6}, far[2] = {1, 999}, dfar[2] = {5, 999};
        uint64_t st = next_step();
        task(&P, "bad-empty", D.name, KVF_TRANSPORT_IPC, src, 2, dst, 0, st, false);
        task(&P, "bad-more", D.name, KVF_TRANSPORT_IPC, src, 1, dst, 2, st, false);
        task(&P, "bad-src-range", D.name, KVF_TRANSPORT_IPC, far, 2, dst, 2, st, false);
        task(&P, "bad-dst-range", D.name, KVF_TRANSPORT_IPC, src, 2, dfar, 2, st, false);
        task(&P, "bad-peer", "no-such-instance", KVF_TRANSPORT_IPC, src, 2, dst, 2, st, false);
        task(&P, "bad-self", P.name, KVF_TRANSPORT_IPC, src, 2, dst, 2, st, false);
        task(&P, "dup", tcp_peer, KVF_TRANSPORT_TCP, src, 2, dst, 2, st, false);
        task(&P, "dup", tcp_peer, KVF_TRANSPORT_TCP, src, 2, dst, 2, st, false);
        /* a record that does not decode still names its request */
        uint8_t junk[] = {0x81, 0xaa, 'r', 'e', 'q',  'u', 'e', 's',
                          't',  '_',  'i', 'd', 0xa3, 'b', 'a', 'd'};
        CHECK(kvf_ring_write(&P.ctl.rings[KVF_RING_ENGINE_TO_SENDER], KVF_REC_TASK, junk,
                             sizeof(junk), NULL) == 0);
        turn(s);
        struct outs *o = completions(&P);
        CHECK_DONE(o, "bad-empty", KVF_STATUS_BAD_TASK, "nothing to send");
        CHECK_DONE(o, "bad-more", KVF_STATUS_BAD_TASK, "more than the 1 of src_block_ids");
        CHECK_DONE(o, "bad-src-range", KVF_STATUS_BLOCK_RANGE, "src_block_ids[1] = 999");
        CHECK_DONE(o, "bad-dst-range", KVF_STATUS_BLOCK_RANGE, "dest_block_ids[1] = 999");
        CHECK_DONE(o, "bad-peer", KVF_STATUS_UNKNOWN_PEER, "no-such-instance");
        CHECK_DONE(o, "bad-self", KVF_STATUS_BAD_TASK, "this instance itself");
        CHECK_DONE(o, "dup", KVF_STATUS_BAD_TASK, "duplicate request_id");
        CHECK_DONE(o, "bad", KVF_STATUS_BAD_TASK, "");
        CHECK_EQ(o->n, 8);
        /* the first "dup" is in flight: cancel it (an open went to the connector) */
        uint32_t slot = slot_of(s, "dup");
        CHECK_STATE(s, slot, SREQ_MOVING, KVF_REQ_ACTIVE);
        cancel(&P, "dup");
        turn(s);
        CHECK_DONE(completions(&P), "dup", KVF_STATUS_CANCELLED, "cancelled by the engine");
        o = to_connector(&P);
        CHECK(find(o, KVF_RT_OPEN, "dup"));
        const struct rec *a = find(o, KVF_RT_FINISH, "dup");
        CHECK(a && a->status == KVF_STATUS_CANCELLED); /* the abort notice */
        CHECK_STATE(s, slot, SREQ_FREE, KVF_REQ_FREE);
}

static void peer_state(struct inst *in, const char *peer, bool up, uint32_t block_size)
{
        struct kvf_record r = {.type = KVF_RT_PEER_STATE, .up = up, .session = 1, .lay_bsize = block_size};
        snprintf(r.peer, sizeof(r.peer), "%s", peer);
        put(&in->ctl.rings[KVF_RING_CONNECTOR_TO_SENDER], &r);
}

/* A task opened to the connector (then cancelled, as nothing answers for the peer). */
static void check_opened(struct sender *s, const char *id)
{
        CHECK(find(to_connector(&P), KVF_RT_OPEN, id));
        cancel(&P, id);
        turn(s);
        CHECK_DONE(completions(&P), id, KVF_STATUS_CANCELLED, "cancelled by the engine");
        const struct rec *a = find(to_connector(&P), KVF_RT_FINISH, id);
        CHECK(a && a->status == KVF_STATUS_CANCELLED); /* its abort notice */
}

/*
 * tcp peers' block sizes (4 tokens here): one whose connector told of blocks of 2 has its
 * tasks' counts checked here; one not reached yet takes a task of more destination blocks than
 * source blocks as regrouped (its connector checks the counts once it knows the size); one
 * that went down is not known any more (what comes back at its address may have other blocks).
 */
static void case_net_block_size(struct sender *s)
{
        const char *known = "192.0.2.8:7100", *fresh = "192.0.2.9:7100";
        const uint32_t src[2] = {1, 2}, dst[4] = {3, 4, 5, 6};
        uint64_t st = next_step();
        peer_state(&P, known, true, 2);
        turn(s);
        task(&P, "bs-known", known, KVF_TRANSPORT_TCP, src, 2, dst, 2, st, false);
        task(&P, "bs-fresh", fresh, KVF_TRANSPORT_TCP, src, 2, dst, 4, st, false);
        turn(s);
        CHECK_DONE(completions(&P), "bs-known", KVF_STATUS_BAD_TASK, "fill 3 to 4 blocks of 2 tokens");
        check_opened(s, "bs-fresh");
        peer_state(&P, known, false, 0);
        turn(s);
        task(&P, "bs-gone", known, KVF_TRANSPORT_TCP, src, 2, dst, 2, next_step(), false);
        turn(s);
        check_opened(s, "bs-gone");
}

/* Cancel before every byte (moving: cancelled, abort notice) and after (landed: no effect). */
static void case_cancel(struct sender *s)
{
        const uint32_t src[2] = {4, 5}, dst[2] = {8, 9}, dst2[2] = {18, 19};
        uint64_t st = next_step();
        task(&P, "cx-early", D.name, KVF_TRANSPORT_IPC, src, 2, dst, 2, st, false);
        task(&P, "cx-late", D.name, KVF_TRANSPORT_IPC, src, 2, dst2, 2, st + 1, false);
        progress(&P, st, 2);
        turn(s);
        CHECK_STATE(s, slot_of(s, "cx-early"), SREQ_MOVING, KVF_REQ_ACTIVE);
        cancel(&P, "cx-early");
        turn(s);
        CHECK_DONE(completions(&P), "cx-early", KVF_STATUS_CANCELLED, "cancelled");
        const struct rec *a = find(to_connector(&P), KVF_RT_FINISH, "cx-early");
        CHECK(a && a->status == KVF_STATUS_CANCELLED && strstr(a->reason, "cancelled"));

        progress(&P, st + 1, LAYERS);
        turn(s);
        uint32_t slot = slot_of(s, "cx-late");
        CHECK_STATE(s, slot, SREQ_LANDED, KVF_REQ_FINISHING);
        CHECK(find(to_connector(&P), KVF_RT_FINISH, "cx-late"));
        cancel(&P, "cx-late");
        turn(s);
        CHECK_STATE(s, slot, SREQ_LANDED, KVF_REQ_FINISHING);
        CHECK_EQ(completions(&P)->n, 0);
        write_result(&P, key_of(s, slot), "cx-late", KVF_STATUS_FINISHED, "");
        turn(s);
        CHECK_DONE(completions(&P), "cx-late", KVF_STATUS_FINISHED, "");
}

/* Timeout while moving (abort) and while landed (withdrawal, the peer's answer or doubt). */
static void case_timeout(struct sender *s)
{
        const uint32_t src[1] = {7}, dst[3] = {11, 12, 13};
        uint64_t st = next_step();
        struct figures f0 = figures(s);
        task(&P, "to-moving", D.name, KVF_TRANSPORT_IPC, src, 1, dst, 1, st + 5, false);
        task(&P, "to-landed", D.name, KVF_TRANSPORT_IPC, src, 1, dst + 1, 1, st, false);
        task(&P, "to-answered", D.name, KVF_TRANSPORT_IPC, src, 1, dst + 2, 1, st, false);
        progress(&P, st, LAYERS);
        turn(s);
        uint32_t m = slot_of(s, "to-moving"), l = slot_of(s, "to-landed"),
                 a = slot_of(s, "to-answered");
        CHECK_STATE(s, l, SREQ_LANDED, KVF_REQ_FINISHING);
        to_connector(&P);
        uint64_t t = s->ctl.reqtab[a].deadline_ns + 1; /* (the latest of the three) */
        sender_tick(s, t);
        turn(s);
        struct outs *o = completions(&P);
        CHECK_EQ(o->n, 1);
        CHECK_DONE(o, "to-moving", KVF_STATUS_TIMEOUT, "0 of 1 blocks sent for every layer");
        CHECK_STATE(s, m, SREQ_FREE, KVF_REQ_FREE);
        o = to_connector(&P);
        const struct rec *ab = find(o, KVF_RT_FINISH, "to-moving");
        CHECK(ab && ab->status == KVF_STATUS_TIMEOUT && !ab->withdraw);
        const struct rec *w = find(o, KVF_RT_FINISH, "to-landed");
        CHECK(w && w->withdraw && w->status == KVF_STATUS_TIMEOUT);
        CHECK(find(o, KVF_RT_FINISH, "to-answered") &&
              find(o, KVF_RT_FINISH, "to-answered")->withdraw);
        CHECK_STATE(s, l, SREQ_LANDED, KVF_REQ_FINISHING);
        CHECK(s->ctl.reqtab[l].withdraw_ns == t);
        /* the peer answers one withdrawal: it had published the arrival */
        write_result(&P, key_of(s, a), "to-answered", KVF_STATUS_FINISHED, "");
        turn(s);
        CHECK_DONE(completions(&P), "to-answered", KVF_STATUS_FINISHED, "");
        CHECK_EQ(figures(s).notices_failed, f0.notices_failed); /* answered: delivered */
        /* the other is never answered: in doubt after a second timeout */
        sender_tick(s, t + TIMEOUT_NS / 2);
        turn(s);
        CHECK_STATE(s, l, SREQ_LANDED, KVF_REQ_FINISHING);
        sender_tick(s, t + TIMEOUT_NS + 1);
        turn(s);
        CHECK_DONE(completions(&P), "to-landed", KVF_STATUS_TIMEOUT, "in doubt");
        CHECK_STATE(s, l, SREQ_FREE, KVF_REQ_FREE);
        /* its answer never came and it failed: one failed notification; the timed-out
         * transfers are not observed in the per-transfer histograms, the answered one is */
        struct figures f1 = figures(s);
        CHECK_EQ(f1.notices_failed, f0.notices_failed + 1);
        CHECK_EQ(f1.n_bytes, f0.n_bytes + 1);
}

/* tcp: open, write batches, handed over, notice; the connector's write result decides. */
static void case_tcp(struct sender *s)
{
        const uint32_t src[3] = {1, 2, 9}, dst[3] = {3, 4, 5}, dok[3] = {13, 14, 15},
                       dfail[3] = {23, 24, 25};
        uint64_t st = next_step();
        struct figures f0 = figures(s);
        task(&P, "tcp-ok", tcp_peer, KVF_TRANSPORT_TCP, src, 3, dok, 3, st, false);
        task(&P, "tcp-fail", tcp_peer, KVF_TRANSPORT_TCP, src, 3, dfail, 3, st, false);
        task(&P, "tcp-cancel", tcp_peer, KVF_TRANSPORT_TCP, src, 3, dst, 3, st, false);
        turn(s);
        uint32_t ok = slot_of(s, "tcp-ok"), f = slot_of(s, "tcp-fail"),
                 c = slot_of(s, "tcp-cancel");
        struct outs *o = to_connector(&P);
        CHECK_EQ(count_type(o, KVF_RT_OPEN), 3);
        /* a failure the connector reports while it moves ends it (an abort follows) */
        write_result(&P, key_of(s, f), "tcp-fail", KVF_STATUS_CONNECTION,
                     "peer unreachable for 5000 ms");
        /* a "finished" for a request still moving is not believed */
        write_result(&P, key_of(s, ok), "tcp-ok", KVF_STATUS_FINISHED, "");
        progress(&P, st, 2);
        turn(s);
        CHECK_DONE(completions(&P), "tcp-fail", KVF_STATUS_CONNECTION, "unreachable");
        CHECK_STATE(s, ok, SREQ_MOVING, KVF_REQ_ACTIVE);
        o = to_connector(&P);
        CHECK(find(o, KVF_RT_FINISH, "tcp-fail") &&
              find(o, KVF_RT_FINISH, "tcp-fail")->status == KVF_STATUS_CONNECTION);
        const struct rec *b = find(o, KVF_RT_WRITE_BATCH, "tcp-ok");
        CHECK(b && b->layer == 0 && b->layer_count == 2);
        progress(&P, st, LAYERS);
        turn(s);
        CHECK_STATE(s, ok, SREQ_HANDED, KVF_REQ_HANDED_OVER);
        CHECK_STATE(s, c, SREQ_HANDED, KVF_REQ_HANDED_OVER);
        o = to_connector(&P);
        CHECK_EQ(count_type(o, KVF_RT_WRITE_BATCH), 2);
        CHECK_EQ(count_type(o, KVF_RT_FINISH), 2);
        /* handed over: a cancel no longer stops it; the peer's answer decides */
        cancel(&P, "tcp-cancel");
        turn(s);
        CHECK_STATE(s, c, SREQ_HANDED, KVF_REQ_HANDED_OVER);
        write_result(&P, key_of(s, c), "tcp-cancel", KVF_STATUS_FINISHED, "");
        write_result(&P, key_of(s, ok), "tcp-ok", KVF_STATUS_WRITE, "");
        turn(s);
        o = completions(&P);
        CHECK_DONE(o, "tcp-cancel", KVF_STATUS_FINISHED, "");
        CHECK_DONE(o, "tcp-ok", KVF_STATUS_WRITE, "the connector gave no reason");
        CHECK_EQ(count_type(to_connector(&P), KVF_RT_FINISH), 0); /* no abort once handed over */
        /* One transfer finished (tcp-cancel): its descriptors are the frames its batches
         * make, runs 1-2 -> 3-4 and 9 -> 5 in every layer and tensor; the failed ones are not
         * observed. */
        struct figures f1 = figures(s);
        CHECK_EQ(f1.n_bytes, f0.n_bytes + 1);
        CHECK_EQ(f1.bytes, f0.bytes + 3ull * LAYERS * 2 * P.cache.layout.block_bytes);
        CHECK_EQ(f1.n_descs, f0.n_descs + 1);
        CHECK_EQ(f1.descs, f0.descs + 2ull * LAYERS * 2);
        CHECK_EQ(f1.n_xfer, f0.n_xfer + 1);
}

/* Chunked prefill: a mark per chunk; a chunk whose step goes backwards fails it. */
static void case_chunks(struct sender *s)
{
        const uint32_t src[4] = {12, 13, 14, 15}, dst[4] = {24, 25, 26, 27};
        uint64_t st = next_step();
        step_now += 3;
        task(&P, "chunked", D.name, KVF_TRANSPORT_IPC, src, 4, dst, 4, st, true);
        chunk(&P, "chunked", st, 8, false); /* 2 full blocks of 4 tokens */
        turn(s);
        uint32_t slot = slot_of(s, "chunked");
        progress(&P, st, LAYERS);
        turn(s);
        CHECK_STATE(s, slot, SREQ_MOVING, KVF_REQ_ACTIVE);
        CHECK_EQ(s->ctl.reqtab[slot].sent_full, 2);
        chunk(&P, "chunked", st + 1, 14, true);
        progress(&P, st + 1, LAYERS);
        turn(s);
        CHECK_STATE(s, slot, SREQ_LANDED, KVF_REQ_FINISHING);
        CHECK(landed(&P, &D, src, dst, 4));
        to_connector(&P);
        write_result(&P, key_of(s, slot), "chunked", KVF_STATUS_FINISHED, "");
        turn(s);
        CHECK_DONE(completions(&P), "chunked", KVF_STATUS_FINISHED, "");

        task(&P, "backwards", D.name, KVF_TRANSPORT_IPC, src, 4, dst, 4, st + 3, true);
        chunk(&P, "backwards", st + 3, 4, false);
        chunk(&P, "backwards", st + 2, 8, false);
        turn(s);
        CHECK_DONE(completions(&P), "backwards", KVF_STATUS_BAD_TASK, "must not go backwards");
        to_connector(&P);
}

/* The engine session ends: moving requests end "engine gone", landed ones are left to finish;
 * a task the ended session left in the ring is rejected. */
static void case_engine_gone(struct sender *s)
{
        const uint32_t src[1] = {3}, dst[1] = {30}, dst2[1] = {29};
        uint64_t st = next_step();
        task(&P, "eg-moving", D.name, KVF_TRANSPORT_IPC, src, 1, dst, 1, st + 1, false);
        task(&P, "eg-landed", D.name, KVF_TRANSPORT_IPC, src, 1, dst2, 1, st, false);
        progress(&P, st, LAYERS);
        turn(s);
        uint32_t l = slot_of(s, "eg-landed");
        CHECK_STATE(s, l, SREQ_LANDED, KVF_REQ_FINISHING);
        uint64_t key = key_of(s, l);
        task(&P, "eg-unread", D.name, KVF_TRANSPORT_IPC, src, 1, dst, 1, st + 1, false);
        kvf_role_end(&P.ctl, KVF_ROLE_ENGINE); /* the engine detaches */
        engine_attach(&P);                     /* and another one attaches */
        turn(s);
        struct outs *o = completions(&P);
        CHECK_DONE(o, "eg-moving", KVF_STATUS_ENGINE_GONE, "another engine attached");
        CHECK_DONE(o, "eg-unread", KVF_STATUS_ENGINE_GONE, "before this task was read");
        CHECK(!find(o, KVF_REC_COMPLETION, "eg-landed"));
        CHECK_STATE(s, l, SREQ_LANDED, KVF_REQ_FINISHING);
        CHECK(sender_map_find(s, "eg-landed") ==
              UINT32_MAX); /* its id is free for the new engine */
        CHECK_EQ(s->ctl.sender->engine_session_ack, P.engine);
        o = to_connector(&P);
        CHECK(find(o, KVF_RT_FINISH, "eg-moving")->status == KVF_STATUS_ENGINE_GONE);
        write_result(&P, key, "eg-landed", KVF_STATUS_FINISHED, "");
        turn(s);
        CHECK_DONE(completions(&P), "eg-landed", KVF_STATUS_FINISHED, "");
}

/* The peer's engine session ends, or the peer instance goes: moving requests to it fail. */
static void case_peer_gone(struct sender *s)
{
        const uint32_t src[1] = {6}, dst[1] = {7};
        uint64_t st = next_step();
        engine_attach(&D);
        task(&P, "pg-session", D.name, KVF_TRANSPORT_IPC, src, 1, dst, 1, st, false);
        turn(s);
        CHECK(s->ctl.reqtab[slot_of(s, "pg-session")].peer_session == D.engine);
        kvf_role_end(&D.ctl, KVF_ROLE_ENGINE);
        progress(&P, st, 1); /* the next copy finds the blocks no longer reserved */
        turn(s);
        CHECK_DONE(completions(&P), "pg-session", KVF_STATUS_ENGINE_GONE, "no longer reserved");
        to_connector(&P);
        engine_attach(&D);
        task(&P, "pg-tick", D.name, KVF_TRANSPORT_IPC, src, 1, dst, 1, st + 1, false);
        turn(s);
        kvf_role_end(&D.ctl, KVF_ROLE_ENGINE);
        sender_tick(s, kvf_now_ns());
        turn(s);
        CHECK_DONE(completions(&P), "pg-tick", KVF_STATUS_ENGINE_GONE, "no longer reserved");
        to_connector(&P);

        task(&P, "pg-gone", D.name, KVF_TRANSPORT_IPC, src, 1, dst, 1, st + 1, false);
        turn(s);
        uint32_t slot = slot_of(s, "pg-gone");
        CHECK_STATE(s, slot, SREQ_MOVING, KVF_REQ_ACTIVE);
        /* the peer instance is re-created under its name: another segment file */
        char seg[96];
        kvf_ctl_shm_name(D.name, seg, sizeof(seg));
        CHECK(shm_unlink(seg) == 0);
        sender_tick(s, kvf_now_ns());
        turn(s);
        CHECK_DONE(completions(&P), "pg-gone", KVF_STATUS_CONNECTION, "went away or was restarted");
        to_connector(&P);
        kvf_cache_unmap(&D.cache);
        kvf_ctl_detach(&D.ctl);
        kvf_ctl_unlink(D.name);
        inst_make(&D, "d", KVF_IROLE_DECODE, KVF_BACKEND_HOST);
        step_now += 2;
}

/* Full rings: back-pressure, then everything goes once there is room. */
static void case_full_rings(struct sender *s)
{
        const uint32_t src[2] = {1, 2}, dst[2] = {3, 4};
        char id[160];
        uint64_t st = next_step();
        /* completions: rejections wait in their task's place, nothing is lost */
        for (int i = 0; i < 20; i++) { /* (a rejection is larger than its task: the peer, twice) */
                snprintf(id, sizeof(id), "full-%02d", i);
                task(&P, id, nobody, KVF_TRANSPORT_IPC, src, 2, dst, 2, st, false);
        }
        turn(s);
        CHECK(s->engine_blocked || kvf_ring_readable(&s->ctl.rings[KVF_RING_ENGINE_TO_SENDER]));
        unsigned got = completions(&P)->n;
        CHECK(got > 0 && got < 20);
        for (int k = 0; k < 10 && got < 20; k++) {
                turn(s);
                got += completions(&P)->n;
        }
        CHECK_EQ(got, 20);

        /* the connector's ring: write batches and notices wait, then go from where they stopped */
        for (int i = 0; i < 6; i++) {
                const uint32_t d[2] = {3 + 2 * (uint32_t)i, 4 + 2 * (uint32_t)i}; /* each its own */
                snprintf(id, sizeof(id), "fc-%02d-%0100d", i, 0);
                task(&P, id, tcp_peer, KVF_TRANSPORT_TCP, src, 2, d, 2, st, false);
        }
        turn(s);
        for (uint32_t l = 1; l <= LAYERS; l++) {
                progress(&P, st, l);
                turn(s);
        }
        unsigned opens = 0, finishes = 0, layers = 0;
        bool backed_up = false;
        for (int k = 0; k < 100 && finishes < 6; k++) {
                for (int i = 0; i < 6; i++) {
                        snprintf(id, sizeof(id), "fc-%02d-%0100d", i, 0);
                        backed_up |= s->flags[slot_of(s, id)] != 0;
                }
                struct outs *o = to_connector(&P);
                for (unsigned i = 0; i < o->n; i++) {
                        opens += o->r[i].type == KVF_RT_OPEN;
                        finishes += o->r[i].type == KVF_RT_FINISH;
                        layers +=
                            o->r[i].type == KVF_RT_WRITE_BATCH ? (unsigned)o->r[i].layer_count : 0;
                }
                turn(s);
        }
        CHECK(backed_up);
        CHECK_EQ(opens, 6);
        CHECK_EQ(layers, 6 * LAYERS); /* every layer once, none twice */
        CHECK_EQ(finishes, 6);
        for (int i = 0; i < 6; i++) {
                snprintf(id, sizeof(id), "fc-%02d-%0100d", i, 0);
                uint32_t slot = slot_of(s, id);
                CHECK_STATE(s, slot, SREQ_HANDED, KVF_REQ_HANDED_OVER);
                CHECK_EQ(s->flags[slot], 0);
                write_result(&P, key_of(s, slot), id, KVF_STATUS_FINISHED, "");
        }
        turn(s);
        CHECK_EQ(count_type(completions(&P), KVF_REC_COMPLETION), 6);

        /* a notice that never reached the connector (its ring stayed full): the deadline ends it
         * with no withdrawal, since the peer cannot have published anything */
        st = next_step();
        for (int i = 0; i < 6; i++) {
                const uint32_t d[2] = {3 + 2 * (uint32_t)i, 4 + 2 * (uint32_t)i};
                snprintf(id, sizeof(id), "fn-%02d-%0100d", i, 0);
                task(&P, id, tcp_peer, KVF_TRANSPORT_TCP, src, 2, d, 2, st, false);
        }
        task(&P, "nt-owed", D.name, KVF_TRANSPORT_IPC, src, 2, dst, 2, st, false);
        for (uint32_t l = 1; l <= LAYERS; l++) {
                progress(&P, st, l);
                turn(s);
        }
        uint32_t nt = slot_of(s, "nt-owed");
        CHECK_STATE(s, nt, SREQ_LANDED, KVF_REQ_FINISHING);
        CHECK(s->flags[nt] & SLOT_NEEDS_NOTICE);
        CHECK_EQ(s->ctl.reqtab[nt].notice_gen, 0);
        sender_tick(s, s->ctl.reqtab[nt].deadline_ns + 1);
        turn(s);
        unsigned ended = 0, withdrawals = 0;
        for (int k = 0; k < 20 && ended < 7; k++) {
                struct outs *o = completions(&P);
                for (unsigned i = 0; i < o->n; i++) {
                        if (!strcmp(o->r[i].id, "nt-owed"))
                                CHECK_DONE(o, "nt-owed", KVF_STATUS_TIMEOUT,
                                           "before the finish notice could reach the connector");
                        else
                                CHECK(o->r[i].status == KVF_STATUS_TIMEOUT); /* the moving ones */
                        ended++;
                }
                o = to_connector(&P);
                for (unsigned i = 0; i < o->n; i++)
                        withdrawals += o->r[i].withdraw;
                turn(s);
        }
        CHECK_EQ(ended, 7);
        CHECK_EQ(withdrawals, 0);
}

static struct sender A, B;

/* ---- same-host notices in one hop: the test plays D's connector on D's notice slots ---- */

struct slot_peer {
        struct kvf_ring notice, reply; /* D's connector's views */
};

static void slot_peer_bind(struct slot_peer *sp, uint32_t s)
{
        CHECK(kvf_notice_bind(&D.ctl, s, &sp->notice, &sp->reply) == 0);
        kvf_ring_producer_attach(&sp->reply, 7);
}

/* What the sender committed to the slot's notice ring: NOTICE records naming their source. */
static struct outs *slot_notices(struct slot_peer *sp)
{
        static struct outs o;
        o.n = 0;
        while (kvf_ring_read(&sp->notice, grab, &o, 64) > 0) {
        }
        return &o;
}

static void slot_ack(struct slot_peer *sp, uint64_t key, const char *id, int status, const char *why)
{
        struct kvf_record a = {.type = KVF_RT_ACK, .key = key, .status = status, .session = D.engine};
        snprintf(a.request_id, sizeof(a.request_id), "%s", id);
        snprintf(a.reason, sizeof(a.reason), "%s", why);
        put(&sp->reply, &a);
}

static void case_notice_rings(void)
{
        const uint32_t src[2] = {3, 4}, dst[2] = {30, 31}, d2[2] = {24, 25}, d3[2] = {26, 27},
                       d4[2] = {28, 29};
        struct slot_peer sp;
        uint64_t st = next_step();
        step_now += 4;
        sender_up_with(&A, &P, true);
        task(&P, "nr-ok", D.name, KVF_TRANSPORT_IPC, src, 2, dst, 2, st, false);
        task(&P, "nr-fail", D.name, KVF_TRANSPORT_IPC, src, 2, d2, 2, st, false);
        task(&P, "nr-doubt", D.name, KVF_TRANSPORT_IPC, src, 2, d3, 2, st, false);
        task(&P, "nr-withdrawn", D.name, KVF_TRANSPORT_IPC, src, 2, d4, 2, st, false);
        progress(&P, st, LAYERS);
        turn(&A);
        /* the peer was mapped and a slot claimed: the one this instance holds */
        uint32_t ok = slot_of(&A, "nr-ok"), fl = slot_of(&A, "nr-fail"), db = slot_of(&A, "nr-doubt"),
                 wd = slot_of(&A, "nr-withdrawn");
        uint32_t pi = A.ctl.reqtab[ok].peer_idx;
        CHECK(pi < SENDER_MAX_PEERS && A.peers[pi].nend.slot != NULL);
        uint32_t ns = A.peers[pi].nend.idx;
        CHECK(!strcmp(D.ctl.notices[ns].owner, P.name));
        CHECK_EQ(D.ctl.notices[ns].pid, getpid());
        CHECK_EQ(D.ctl.notices[ns].owner_created_ns, P.ctl.hdr->created_ns);
        slot_peer_bind(&sp, ns);
        CHECK_STATE(&A, ok, SREQ_LANDED, KVF_REQ_FINISHING);
        CHECK(A.ctl.reqtab[ok].notice_gen == SENDER_NOTICE_GEN_RING);
        /* nothing for our own connector: the notices are in the decode segment's ring */
        CHECK_EQ(count_type(to_connector(&P), KVF_RT_FINISH), 0);
        struct outs *o = slot_notices(&sp);
        CHECK_EQ(o->n, 4);
        const struct rec *n0 = find(o, KVF_RT_NOTICE, "nr-ok");
        CHECK(n0 && n0->status == KVF_STATUS_FINISHED && !n0->withdraw && n0->key == key_of(&A, ok));
        /* finished, and failed, as the decode connector answers */
        slot_ack(&sp, key_of(&A, ok), "nr-ok", KVF_STATUS_FINISHED, "");
        slot_ack(&sp, key_of(&A, fl), "nr-fail", KVF_STATUS_ENGINE_GONE, "the decode engine session ended");
        turn(&A);
        o = completions(&P);
        CHECK_DONE(o, "nr-ok", KVF_STATUS_FINISHED, "");
        CHECK_DONE(o, "nr-fail", KVF_STATUS_ENGINE_GONE, "session ended");
        CHECK_STATE(&A, ok, SREQ_FREE, KVF_REQ_FREE);
        /* our connector restarts: a notice in the peer's ring is not lost with it, none re-posted */
        connector_start(&P);
        sender_tick(&A, kvf_now_ns());
        turn(&A);
        CHECK_EQ(to_connector(&P)->n, 0);
        CHECK_EQ(slot_notices(&sp)->n, 0);
        /* past the deadline: withdrawals go the same way; one answered, one never (in doubt) */
        uint64_t t = A.ctl.reqtab[wd].deadline_ns + 1;
        if (A.ctl.reqtab[db].deadline_ns + 1 > t)
                t = A.ctl.reqtab[db].deadline_ns + 1;
        sender_tick(&A, t);
        turn(&A);
        o = slot_notices(&sp);
        CHECK(find(o, KVF_RT_NOTICE, "nr-withdrawn") && find(o, KVF_RT_NOTICE, "nr-withdrawn")->withdraw);
        CHECK(find(o, KVF_RT_NOTICE, "nr-doubt") && find(o, KVF_RT_NOTICE, "nr-doubt")->withdraw);
        CHECK_EQ(count_type(to_connector(&P), KVF_RT_FINISH), 0);
        slot_ack(&sp, key_of(&A, wd), "nr-withdrawn", KVF_STATUS_FINISHED, "");
        turn(&A);
        CHECK_DONE(completions(&P), "nr-withdrawn", KVF_STATUS_FINISHED, "");
        sender_tick(&A, t + TIMEOUT_NS + 1);
        turn(&A);
        CHECK_DONE(completions(&P), "nr-doubt", KVF_STATUS_TIMEOUT, "in doubt");
        /* the sender dies with a LANDED request; its successor re-claims the same slot and
         * re-posts the notice (the decode journal answers a repeat) */
        task(&P, "nr-restart", D.name, KVF_TRANSPORT_IPC, src, 2, dst, 2, st + 1, false);
        progress(&P, st + 1, LAYERS);
        turn(&A);
        uint32_t rs = slot_of(&A, "nr-restart");
        CHECK_STATE(&A, rs, SREQ_LANDED, KVF_REQ_FINISHING);
        CHECK(find(slot_notices(&sp), KVF_RT_NOTICE, "nr-restart"));
        uint64_t gen0 = D.ctl.notices[ns].generation;
        sender_free(&A); /* dies (gives the slot back as it unmaps the peer) */
        sender_up_with(&B, &P, true);
        turn(&B);
        CHECK_STATE(&B, rs, SREQ_LANDED, KVF_REQ_FINISHING);
        pi = B.ctl.reqtab[rs].peer_idx;
        CHECK(pi < SENDER_MAX_PEERS && B.peers[pi].nend.slot && B.peers[pi].nend.idx == ns);
        CHECK(D.ctl.notices[ns].generation > gen0);
        o = slot_notices(&sp);
        CHECK(find(o, KVF_RT_NOTICE, "nr-restart") && !find(o, KVF_RT_NOTICE, "nr-restart")->withdraw);
        slot_ack(&sp, key_of(&B, rs), "nr-restart", KVF_STATUS_FINISHED, "");
        turn(&B);
        CHECK_DONE(completions(&P), "nr-restart", KVF_STATUS_FINISHED, "");
        sender_close(&B);

        /* every slot held by a live process of another instance: the socket path */
        struct kvf_notice_slot keep[KVF_NOTICE_SLOTS];
        memcpy(keep, D.ctl.notices, sizeof(keep));
        for (uint32_t s = 0; s < KVF_NOTICE_SLOTS; s++) {
                struct kvf_notice_slot *x = &D.ctl.notices[s];
                x->pid = 1; /* init: alive, and never us */
                x->pid_starttime = kvf_pid_starttime(1);
                x->heartbeat_ns = kvf_now_ns() + 60ull * 1000000000ull;
                x->state = KVF_STATE_RUNNING;
                x->generation++;
                snprintf(x->owner, sizeof(x->owner), "someone-else");
        }
        sender_up_with(&A, &P, true);
        st = next_step();
        task(&P, "nr-socket", D.name, KVF_TRANSPORT_IPC, src, 2, dst, 2, st, false);
        progress(&P, st, LAYERS);
        turn(&A);
        uint32_t sk = slot_of(&A, "nr-socket");
        CHECK(A.peers[A.ctl.reqtab[sk].peer_idx].nend.slot == NULL);
        CHECK(A.ctl.reqtab[sk].notice_gen != SENDER_NOTICE_GEN_RING && A.ctl.reqtab[sk].notice_gen != 0);
        o = to_connector(&P);
        CHECK(find(o, KVF_RT_FINISH, "nr-socket"));
        write_result(&P, key_of(&A, sk), "nr-socket", KVF_STATUS_FINISHED, "");
        turn(&A);
        CHECK_DONE(completions(&P), "nr-socket", KVF_STATUS_FINISHED, "");
        sender_close(&A);

        /* the holder of one of them was killed (another instance's sender, its ring read
         * empty): that slot is reclaimed, the others stay with their live holders */
        pid_t dead = fork();
        CHECK(dead >= 0);
        if (dead == 0)
                _exit(0);
        CHECK(waitpid(dead, NULL, 0) == dead);
        const uint32_t rs2 = KVF_NOTICE_SLOTS - 1;
        D.ctl.notices[rs2].pid = dead;
        D.ctl.notices[rs2].pid_starttime = 0;
        snprintf(D.ctl.notices[rs2].owner, sizeof(D.ctl.notices[rs2].owner), "killed-one");
        sender_up_with(&A, &P, true);
        st = next_step();
        task(&P, "nr-reclaimed", D.name, KVF_TRANSPORT_IPC, src, 2, dst, 2, st, false);
        progress(&P, st, LAYERS);
        turn(&A);
        uint32_t rc2 = slot_of(&A, "nr-reclaimed");
        pi = A.ctl.reqtab[rc2].peer_idx;
        CHECK(A.peers[pi].nend.slot != NULL && A.peers[pi].nend.idx == rs2);
        CHECK_EQ(D.ctl.notices[rs2].pid, getpid());
        CHECK(!strcmp(D.ctl.notices[rs2].owner, P.name));
        CHECK(A.ctl.reqtab[rc2].notice_gen == SENDER_NOTICE_GEN_RING);
        struct slot_peer sp2;
        slot_peer_bind(&sp2, rs2);
        CHECK(find(slot_notices(&sp2), KVF_RT_NOTICE, "nr-reclaimed"));
        slot_ack(&sp2, key_of(&A, rc2), "nr-reclaimed", KVF_STATUS_FINISHED, "");
        turn(&A);
        CHECK_DONE(completions(&P), "nr-reclaimed", KVF_STATUS_FINISHED, "");
        sender_close(&A);
        memcpy(D.ctl.notices, keep, sizeof(keep));

        /* the decode instance re-created (a new segment) while a notice sits unanswered in its
         * old slot ring: nobody reads that ring any more, so the request ends "connection
         * error" here, once; the new instance refuses a notice of its predecessor's blocks
         * (connector_logic_test), so no arrival says otherwise */
        sender_up_with(&A, &P, true);
        st = next_step();
        task(&P, "nr-recreated", D.name, KVF_TRANSPORT_IPC, src, 2, dst, 2, st, false);
        progress(&P, st, LAYERS);
        turn(&A);
        uint32_t rr = slot_of(&A, "nr-recreated");
        CHECK_STATE(&A, rr, SREQ_LANDED, KVF_REQ_FINISHING);
        CHECK(A.ctl.reqtab[rr].notice_gen == SENDER_NOTICE_GEN_RING);
        kvf_cache_unmap(&D.cache);
        kvf_ctl_detach(&D.ctl);
        kvf_ctl_unlink(D.name);
        inst_make(&D, "d", KVF_IROLE_DECODE, KVF_BACKEND_HOST);
        sender_tick(&A, kvf_now_ns());
        turn(&A);
        o = completions(&P);
        CHECK_DONE(o, "nr-recreated", KVF_STATUS_CONNECTION, "before it answered the finish notice");
        CHECK_EQ(o->n, 1);
        CHECK_STATE(&A, rr, SREQ_FREE, KVF_REQ_FREE);
        sender_tick(&A, kvf_now_ns() + 2 * TIMEOUT_NS);
        turn(&A);
        CHECK_EQ(completions(&P)->n, 0); /* and nothing more of it, even past its deadline */
        sender_close(&A);
}

/* A sender dies (nothing more written) and a successor adopts the table, in each state. */
static void case_restart(void)
{
        const uint32_t src[2] = {10, 11}, dst[2] = {12, 13}, dst2[2] = {16, 17}, dtm[2] = {20, 21},
                       ddl[2] = {22, 23}, dud[2] = {24, 25};
        uint64_t st = next_step();
        step_now++;
        sender_up(&A, &P);
        /* (the same blocks at two peers: each peer's own) */
        task(&P, "rs-landed", D.name, KVF_TRANSPORT_IPC, src, 2, dst, 2, st, false);
        task(&P, "rs-handed", tcp_peer, KVF_TRANSPORT_TCP, src, 2, dst, 2, st, false);
        task(&P, "rs-moving", D.name, KVF_TRANSPORT_IPC, src, 2, dst2, 2, st + 1, false);
        task(&P, "rs-tcp-moving", tcp_peer, KVF_TRANSPORT_TCP, src, 2, dtm, 2, st + 1, false);
        task(&P, "rs-delivered", tcp_peer, KVF_TRANSPORT_TCP, src, 2, ddl, 2, st + 1, false);
        task(&P, "rs-undelivered", tcp_peer, KVF_TRANSPORT_TCP, src, 2, dud, 2, st + 1, false);
        progress(&P, st, LAYERS);
        turn(&A);
        progress(&P, st + 1, 2);
        turn(&A);
        uint32_t ld = slot_of(&A, "rs-landed"), hd = slot_of(&A, "rs-handed"),
                 mv = slot_of(&A, "rs-moving"), tm = slot_of(&A, "rs-tcp-moving"),
                 dl = slot_of(&A, "rs-delivered"), ud = slot_of(&A, "rs-undelivered");
        CHECK_STATE(&A, ld, SREQ_LANDED, KVF_REQ_FINISHING);
        CHECK_STATE(&A, hd, SREQ_HANDED, KVF_REQ_HANDED_OVER);
        CHECK_STATE(&A, mv, SREQ_MOVING, KVF_REQ_ACTIVE);
        CHECK(layer_landed(&P, &D, 1, 10, 16) && !layer_landed(&P, &D, 2, 10, 16));
        /* rs-delivered: its completion is committed, and the sender dies before freeing the slot */
        uint64_t dkey = key_of(&A, dl);
        write_result(&P, dkey, "rs-delivered", KVF_STATUS_CONNECTION, "refused");
        turn(&A);
        CHECK(find(completions(&P), KVF_REC_COMPLETION, "rs-delivered"));
        CHECK_STATE(&A, dl, SREQ_FREE, KVF_REQ_FREE);
        CHECK(A.ctl.reqtab[dl].completion_pos != ~0ull);
        A.ctl.reqtab[dl].state =
            KVF_REQ_COMPLETING; /* (the crash window between commit and free) */
        /* rs-undelivered: decided while the completion ring is full */
        char id[160];
        for (int i = 0; i < 20; i++) {
                snprintf(id, sizeof(id), "rs-fill-%02d", i);
                task(&P, id, nobody, KVF_TRANSPORT_IPC, src, 2, dst, 2, st, false);
        }
        turn(&A);
        write_result(&P, key_of(&A, ud), "rs-undelivered", KVF_STATUS_CONNECTION, "refused");
        turn(&A);
        CHECK_STATE(&A, ud, SREQ_DECIDED, KVF_REQ_COMPLETING);
        CHECK(A.ctl.reqtab[ud].completion_pos == ~0ull);
        sender_free(&A); /* dies */
        struct outs *o = to_connector(&P);
        CHECK(find(o, KVF_RT_FINISH, "rs-landed") && find(o, KVF_RT_FINISH, "rs-handed"));

        sender_up(&B, &P);
        CHECK_STATE(&B, ld, SREQ_LANDED, KVF_REQ_FINISHING);
        CHECK_STATE(&B, hd, SREQ_HANDED, KVF_REQ_HANDED_OVER);
        CHECK_STATE(&B, mv, SREQ_MOVING, KVF_REQ_ACTIVE);
        CHECK_STATE(&B, tm, SREQ_MOVING, KVF_REQ_ACTIVE);
        CHECK_STATE(&B, dl, SREQ_FREE, KVF_REQ_FREE);
        CHECK_STATE(&B, ud, SREQ_DECIDED, KVF_REQ_COMPLETING);
        unsigned fills = 0, undelivered = 0, delivered = 0;
        for (int k = 0; k < 10; k++) {
                turn(&B);
                o = completions(&P);
                for (unsigned i = 0; i < o->n; i++) {
                        fills += !strncmp(o->r[i].id, "rs-fill-", 8);
                        undelivered += !strcmp(o->r[i].id, "rs-undelivered");
                        delivered += !strcmp(o->r[i].id, "rs-delivered");
                }
        }
        CHECK_EQ(undelivered, 1);
        CHECK_EQ(delivered, 0);
        CHECK_EQ(fills, 20); /* each exactly once, across the restart */
        o = to_connector(&P);
        /* handed again: a notice may be lost with the dead sender; the peer de-duplicates */
        CHECK(find(o, KVF_RT_FINISH, "rs-landed"));
        CHECK(find(o, KVF_RT_OPEN, "rs-handed") && find(o, KVF_RT_FINISH, "rs-handed"));
        /* rs-handed: every layer of both blocks again; rs-tcp-moving: its two layers again */
        CHECK_EQ(count_type(o, KVF_RT_WRITE_BATCH), LAYERS + 2);
        /* The successor knows whose blocks are whose: the moving requests' bookings were rebuilt
         * from the table; a decided one's blocks are free, and so are those of one whose every
         * byte has landed (its arrival may be out: the decode engine may reuse them now). */
        task(&P, "rs-twice", D.name, KVF_TRANSPORT_IPC, src, 2, dst2, 2, st + 1, false);
        task(&P, "rs-twice-tcp", tcp_peer, KVF_TRANSPORT_TCP, src, 2, dtm, 2, st + 1, false);
        task(&P, "rs-after-decided", tcp_peer, KVF_TRANSPORT_TCP, src, 2, dud, 2, st + 1, false);
        task(&P, "rs-after-landed", D.name, KVF_TRANSPORT_IPC, src, 2, dst, 2, st + 1, false);
        turn(&B);
        o = completions(&P);
        CHECK_DONE(o, "rs-twice", KVF_STATUS_BAD_TASK,
                   "is already the destination of live request 'rs-moving'");
        CHECK_DONE(o, "rs-twice-tcp", KVF_STATUS_BAD_TASK,
                   "dest_block_ids[0] = 20 of peer '192.0.2.7:7100' is already the destination of "
                   "live request 'rs-tcp-moving'");
        CHECK_EQ(o->n, 2);
        uint32_t ad = slot_of(&B, "rs-after-decided"), al = slot_of(&B, "rs-after-landed");
        CHECK_STATE(&B, ad, SREQ_MOVING, KVF_REQ_ACTIVE);
        CHECK_STATE(&B, al, SREQ_MOVING, KVF_REQ_ACTIVE);
        cancel(&P, "rs-after-decided");
        cancel(&P, "rs-after-landed");
        turn(&B);
        o = completions(&P);
        CHECK_DONE(o, "rs-after-decided", KVF_STATUS_CANCELLED, "cancelled");
        CHECK_DONE(o, "rs-after-landed", KVF_STATUS_CANCELLED, "cancelled");
        o = to_connector(&P);
        CHECK(find(o, KVF_RT_OPEN, "rs-after-decided"));
        progress(&P, st + 1, LAYERS);
        turn(&B);
        CHECK_STATE(&B, mv, SREQ_LANDED, KVF_REQ_FINISHING);
        CHECK(landed(&P, &D, src, dst2, 2));
        CHECK_STATE(&B, tm, SREQ_HANDED, KVF_REQ_HANDED_OVER);
        o = to_connector(&P);
        CHECK(find(o, KVF_RT_FINISH, "rs-moving") && find(o, KVF_RT_FINISH, "rs-tcp-moving"));

        /* the connector restarts: what it held is handed over again */
        connector_start(&P);
        sender_tick(&B, kvf_now_ns());
        turn(&B);
        o = to_connector(&P);
        CHECK(find(o, KVF_RT_OPEN, "rs-handed") && find(o, KVF_RT_FINISH, "rs-handed"));
        CHECK(find(o, KVF_RT_OPEN, "rs-tcp-moving") && find(o, KVF_RT_FINISH, "rs-tcp-moving"));
        CHECK(find(o, KVF_RT_FINISH, "rs-landed") && find(o, KVF_RT_FINISH, "rs-moving"));
        CHECK(B.ctl.reqtab[ld].notice_gen == B.ctl.roles[KVF_ROLE_CONNECTOR].generation);
        const char *ids[] = {"rs-landed", "rs-handed", "rs-moving", "rs-tcp-moving"};
        const uint32_t slots[] = {ld, hd, mv, tm};
        for (int i = 0; i < 4; i++)
                write_result(&P, key_of(&B, slots[i]), ids[i], KVF_STATUS_FINISHED, "");
        turn(&B);
        o = completions(&P);
        for (int i = 0; i < 4; i++)
                CHECK_DONE(o, ids[i], KVF_STATUS_FINISHED, "");
        CHECK_EQ(B.book_n, 0); /* every ended request let its blocks go */
}

/* host-async copies land later: LANDING until they have; a failed batch is a write error; a
 * sender that dies with copies in flight cannot report them finished. */
static void case_async(void)
{
        const uint32_t src[2] = {2, 3}, dst[2] = {14, 15};
        uint64_t st = next_step();
        engine_attach(&PA);
        connector_start(&PA);
        setenv("KVFERRY_ASYNC_DELAY_US", "100000",
               1); /* (lands well after the checks of LANDING) */
        sender_up(&A, &PA);
        CHECK(!A.sync_copies);
        task(&PA, "as-ok", DA.name, KVF_TRANSPORT_IPC, src, 2, dst, 2, st, false);
        progress(&PA, st, LAYERS);
        turn(&A);
        uint32_t slot = slot_of(&A, "as-ok");
        CHECK_STATE(&A, slot, SREQ_LANDING, KVF_REQ_ACTIVE);
        CHECK(A.ctl.reqtab[slot].flags & KVF_REQF_COPY_PENDING);
        CHECK_EQ(to_connector(&PA)->n, 0);
        cancel(&PA, "as-ok"); /* not every byte has landed: a cancel still ends it */
        task(&PA, "as-ok2", DA.name, KVF_TRANSPORT_IPC, src, 2, dst, 2, st, false);
        turn(&A);
        CHECK_STATE(&A, slot, SREQ_DECIDED, KVF_REQ_COMPLETING);
        CHECK_EQ(completions(&PA)->n, 0); /* nothing is said before its copies land */
        settle(&A);
        CHECK_DONE(completions(&PA), "as-ok", KVF_STATUS_CANCELLED, "cancelled");
        uint32_t s2 = slot_of(&A, "as-ok2");
        CHECK_STATE(&A, s2, SREQ_LANDED, KVF_REQ_FINISHING);
        CHECK(!(A.ctl.reqtab[s2].flags & KVF_REQF_COPY_PENDING));
        CHECK(landed(&PA, &DA, src, dst, 2));
        struct outs *o = to_connector(&PA);
        CHECK(find(o, KVF_RT_FINISH, "as-ok")->status == KVF_STATUS_CANCELLED);
        CHECK(find(o, KVF_RT_FINISH, "as-ok2")->status == KVF_STATUS_FINISHED);
        write_result(&PA, key_of(&A, s2), "as-ok2", KVF_STATUS_FINISHED, "");
        turn(&A);
        CHECK_DONE(completions(&PA), "as-ok2", KVF_STATUS_FINISHED, "");
        sender_close(&A);

        /* every batch fails */
        setenv("KVFERRY_ASYNC_DELAY_US", "1000", 1);
        setenv("KVFERRY_ASYNC_FAIL_EVERY", "1", 1);
        sender_up(&A, &PA);
        unsetenv("KVFERRY_ASYNC_FAIL_EVERY");
        task(&PA, "as-fail", DA.name, KVF_TRANSPORT_IPC, src, 2, dst, 2, st + 1, false);
        progress(&PA, st + 1, 2);
        settle(&A);
        CHECK_DONE(completions(&PA), "as-fail", KVF_STATUS_WRITE, "copy into peer");
        CHECK(find(to_connector(&PA), KVF_RT_FINISH, "as-fail")->status == KVF_STATUS_WRITE);
        sender_close(&A);

        /* the sender dies with a copy in flight */
        setenv("KVFERRY_ASYNC_DELAY_US", "300000", 1);
        sender_up(&A, &PA);
        task(&PA, "as-died", DA.name, KVF_TRANSPORT_IPC, src, 2, dst, 2, st + 2, false);
        progress(&PA, st + 2, LAYERS);
        turn(&A);
        slot = slot_of(&A, "as-died");
        CHECK_STATE(&A, slot, SREQ_LANDING, KVF_REQ_ACTIVE);
        sender_free(&A);
        setenv("KVFERRY_ASYNC_DELAY_US", "1000", 1);
        sender_up(&B, &PA);
        turn(&B);
        CHECK_DONE(completions(&PA), "as-died", KVF_STATUS_WRITE, "restarted while a copy");
        sender_close(&B);
        step_now += 3;
}

/* Two ipc requests of the host-async pair that moved every layer: both finish notices out, the
 * bytes landed, the connector's results back, both completions 'finished'. */
static void finish_two(const char *ia, uint32_t a, const uint32_t *sa, const uint32_t *da, const char *ib,
                       uint32_t b, const uint32_t *sb, const uint32_t *db)
{
        settle(&A);
        struct outs *o = to_connector(&PA);
        CHECK(find(o, KVF_RT_FINISH, ia)->status == KVF_STATUS_FINISHED);
        CHECK(find(o, KVF_RT_FINISH, ib)->status == KVF_STATUS_FINISHED);
        CHECK(landed(&PA, &DA, sa, da, 2));
        CHECK(landed(&PA, &DA, sb, db, 2));
        write_result(&PA, key_of(&A, a), ia, KVF_STATUS_FINISHED, "");
        write_result(&PA, key_of(&A, b), ib, KVF_STATUS_FINISHED, "");
        settle(&A);
        struct outs *cd = completions(&PA);
        CHECK_DONE(cd, ia, KVF_STATUS_FINISHED, "");
        CHECK_DONE(cd, ib, KVF_STATUS_FINISHED, "");
}

/* Copies that land later (kernels on a GPU stream) with several requests moving: a backlog goes
 * one layer a turn for each, so each batch is the one before moved by a layer (the GPU copier
 * runs its descriptors again); a request moving alone takes its backlog in one slice. */
static void case_layer_turns(void)
{
        const uint32_t s1[2] = {4, 5}, d1[2] = {20, 21}, s2[2] = {6, 7}, d2[2] = {22, 23};
        uint64_t st = next_step();
        engine_attach(&PA);
        connector_start(&PA);
        setenv("KVFERRY_ASYNC_DELAY_US", "1000", 1);
        sender_up(&A, &PA);
        task(&PA, "lt-a", DA.name, KVF_TRANSPORT_IPC, s1, 2, d1, 2, st, false);
        task(&PA, "lt-b", DA.name, KVF_TRANSPORT_IPC, s2, 2, d2, 2, st, false);
        turn(&A);
        uint32_t a = slot_of(&A, "lt-a"), b = slot_of(&A, "lt-b"), turns = 0, deepest = 0;
        progress(&PA, st, LAYERS); /* every layer ready at once: a backlog for both */
        turn(&A);
        /* not the whole backlog at once: a layer a batch, SENDER_COPY_DEPTH batches out */
        CHECK(sender_req_state(&A, a) == SREQ_MOVING && A.ctl.reqtab[a].cur_layers == SENDER_COPY_DEPTH);
        while (sender_req_state(&A, a) == SREQ_MOVING && turns++ < 1000) {
                /* both by the same layers a turn; at most SENDER_COPY_DEPTH batches of each out */
                CHECK_EQ(A.ctl.reqtab[a].cur_layers, A.ctl.reqtab[b].cur_layers);
                CHECK(A.cp.inflight[a] <= SENDER_COPY_DEPTH);
                deepest = A.cp.inflight[a] > deepest ? A.cp.inflight[a] : deepest;
                kvf_sleep_ns(100000);
                turn(&A);
        }
        CHECK(sender_req_state(&A, b) != SREQ_MOVING);
        /* the next slice went while one was still copying: the copies never wait on the planning */
        CHECK_EQ(deepest, SENDER_COPY_DEPTH);
        finish_two("lt-a", a, s1, d1, "lt-b", b, s2, d2);

        /* alone: its whole backlog (a few KiB) in the first turn */
        task(&PA, "lt-c", DA.name, KVF_TRANSPORT_IPC, s1, 2, d1, 2, st + 1, false);
        turn(&A);
        uint32_t c = slot_of(&A, "lt-c");
        progress(&PA, st + 1, LAYERS);
        turn(&A);
        CHECK(A.ctl.reqtab[c].cur_layers == LAYERS || sender_req_state(&A, c) != SREQ_MOVING);
        settle(&A);
        CHECK(find(to_connector(&PA), KVF_RT_FINISH, "lt-c")->status == KVF_STATUS_FINISHED);
        write_result(&PA, key_of(&A, c), "lt-c", KVF_STATUS_FINISHED, "");
        settle(&A);
        CHECK_DONE(completions(&PA), "lt-c", KVF_STATUS_FINISHED, "");

        /* a backlog left at an earlier step does not hold up the next step's requests */
        task(&PA, "lt-x", DA.name, KVF_TRANSPORT_IPC, s1, 2, d1, 2, st + 2, false);
        task(&PA, "lt-y", DA.name, KVF_TRANSPORT_IPC, s2, 2, d2, 2, st + 3, false);
        turn(&A);
        uint32_t x = slot_of(&A, "lt-x"), y = slot_of(&A, "lt-y");
        progress(&PA, st + 2, LAYERS);
        turn(&A);
        CHECK(sender_req_state(&A, x) == SREQ_MOVING); /* layers of it left */
        progress(&PA, st + 3, 1);
        turn(&A);
        CHECK_EQ(A.ctl.reqtab[y].cur_layers, 1);
        progress(&PA, st + 3, LAYERS);
        finish_two("lt-x", x, s1, d1, "lt-y", y, s2, d2);
        sender_close(&A);
        step_now += 4;
}

/* The copy batches (histogram KVF_HIST_COPY counts one per batch submitted). */
static uint64_t batches(struct sender *s)
{
        return kvf_load_relaxed(&s->ctl.sender->hist[KVF_HIST_COPY].count);
}

/* Copies that land later: the layers of a step before its last go in one batch for the requests
 * of the step, the last layer in a batch per request, so that each request's finish waits for its
 * own bytes (KVF_AB_NO_OWN_LANDING=1: one batch). Then the engine executor's side: an owe ends
 * when the plan entry's own landed word names its gen and claimed layers, and not before. */
static void case_own_landing(void)
{
        const uint32_t s1[2] = {4, 5}, d1[2] = {20, 21}, s2[2] = {6, 7}, d2[2] = {22, 23};
        char ia[32], ib[32];
        engine_attach(&PA);
        connector_start(&PA);
        setenv("KVFERRY_ASYNC_DELAY_US", "2000", 1);
        for (int ab = 0; ab < 2; ab++) {
                uint64_t st = next_step();
                if (ab)
                        setenv("KVF_AB_NO_OWN_LANDING", "1", 1);
                sender_up(&A, &PA);
                unsetenv("KVF_AB_NO_OWN_LANDING");
                CHECK(A.own_landing == !ab);
                snprintf(ia, sizeof(ia), "ol-a%d", ab);
                snprintf(ib, sizeof(ib), "ol-b%d", ab);
                task(&PA, ia, DA.name, KVF_TRANSPORT_IPC, s1, 2, d1, 2, st, false);
                task(&PA, ib, DA.name, KVF_TRANSPORT_IPC, s2, 2, d2, 2, st, false);
                turn(&A);
                uint32_t a = slot_of(&A, ia), b = slot_of(&A, ib);
                for (uint32_t l = 1; l < LAYERS; l++) {
                        uint64_t n = batches(&A);
                        progress(&PA, st, l);
                        turn(&A);
                        CHECK_EQ(batches(&A) - n, 1); /* one layer of both */
                        settle(&A);
                }
                uint64_t n = batches(&A);
                progress(&PA, st, LAYERS);
                turn(&A);
                CHECK_EQ(batches(&A) - n, ab ? 1u : 2u);
                finish_two(ia, a, s1, d1, ib, b, s2, d2);
                sender_close(&A);
        }

        /* At most own_batches requests of a progress word alone: four requests with room for
         * two, so two batches of one and one of the other two; every byte lands. */
        {
                const uint32_t src[4][2] = {{4, 5}, {6, 7}, {8, 9}, {10, 11}};
                const uint32_t dst[4][2] = {{20, 21}, {22, 23}, {24, 25}, {26, 27}};
                uint32_t slot[4];
                uint64_t st = next_step();
                sender_up(&A, &PA);
                A.own_batches = 2;
                for (int i = 0; i < 4; i++) {
                        snprintf(ia, sizeof(ia), "ol-cap%d", i);
                        task(&PA, ia, DA.name, KVF_TRANSPORT_IPC, src[i], 2, dst[i], 2, st, false);
                }
                turn(&A);
                for (int i = 0; i < 4; i++) {
                        snprintf(ia, sizeof(ia), "ol-cap%d", i);
                        slot[i] = slot_of(&A, ia);
                }
                progress(&PA, st, LAYERS - 1);
                turn(&A);
                settle(&A);
                uint64_t n = batches(&A);
                progress(&PA, st, LAYERS);
                turn(&A);
                CHECK_EQ(batches(&A) - n, 3);
                settle(&A);
                struct outs *o = to_connector(&PA);
                for (int i = 0; i < 4; i++) {
                        snprintf(ia, sizeof(ia), "ol-cap%d", i);
                        CHECK(find(o, KVF_RT_FINISH, ia)->status == KVF_STATUS_FINISHED);
                        CHECK(landed(&PA, &DA, src[i], dst[i], 2));
                        write_result(&PA, key_of(&A, slot[i]), ia, KVF_STATUS_FINISHED, "");
                }
                settle(&A);
                struct outs *cd = completions(&PA);
                for (int i = 0; i < 4; i++) {
                        snprintf(ia, sizeof(ia), "ol-cap%d", i);
                        CHECK_DONE(cd, ia, KVF_STATUS_FINISHED, "");
                }
                sender_close(&A);
        }

        /* The engine's own landed word for an owe of gen 7, its 4 layers claimed. */
        sender_up(&A, &PA);
        const uint32_t slot = SLOTS - 1;
        struct kvf_plan_entry *e = &A.ctl.plan[slot];
        struct kvf_req_slot *r = &A.ctl.reqtab[slot];
        CHECK_STATE(&A, slot, SREQ_FREE, KVF_REQ_FREE);
        r->session = kvf_engine_session(&A.ctl, false);
        const uint64_t word = KVF_PROGRESS_PACK(next_step() + 1000, LAYERS); /* exec.landed is far below */
        uint32_t got;
        bool fail;
        char why[KVF_REASON_MAX];
        CHECK_EQ(sender_copies_owe(&A, slot, word, 7), 0);
        const uint64_t wrong[] = {KVF_PLAN_CTL(6, 0, LAYERS), KVF_PLAN_CTL(7, 0, LAYERS - 1),
                                  KVF_PLAN_CTL(8, 0, LAYERS), KVF_PLAN_CTL(7, 1, LAYERS)};
        for (unsigned i = 0; i < sizeof(wrong) / sizeof(wrong[0]); i++) {
                kvf_store_release(&e->landed, wrong[i]);
                sender_copies_poll(&A);
                CHECK(sender_copies_owing(&A, slot));
                CHECK(!sender_copies_news(&A, &got, &fail, why, sizeof(why)));
        }
        kvf_store_release(&e->landed, KVF_PLAN_CTL(7, 0, LAYERS));
        sender_copies_poll(&A);
        CHECK(!sender_copies_owing(&A, slot));
        CHECK(sender_copies_news(&A, &got, &fail, why, sizeof(why)));
        CHECK(got == slot && !fail);
        CHECK(!(r->flags & KVF_REQF_ENGINE_COPY));
        /* the same with the engine's failure recorded in the entry: the owe ends failed, its reason */
        e->ctl = KVF_PLAN_CTL(9, 0, LAYERS);
        snprintf(e->why, sizeof(e->why), "engine executor: a test's failure");
        kvf_store_release(&e->err, 1u);
        CHECK_EQ(sender_copies_owe(&A, slot, word, 9), 0);
        sender_copies_poll(&A);
        CHECK(sender_copies_owing(&A, slot));
        kvf_store_release(&e->landed, KVF_PLAN_CTL(9, 0, LAYERS));
        sender_copies_poll(&A);
        CHECK(!sender_copies_owing(&A, slot));
        CHECK(sender_copies_news(&A, &got, &fail, why, sizeof(why)));
        CHECK(got == slot && fail && strstr(why, "a test's failure"));
        memset(e, 0, sizeof(*e));
        r->session = 0;
        r->flags = 0;
        sender_close(&A);
}

/* Stopping (SIGTERM: tools/kvferry down). New tasks are refused at once; requests in flight go on
 * through the drain window; at its end one still moving ends 'connection error' (an abort tells
 * the peer), and finish notices still unanswered are withdrawn: the peer's answer decides
 * (finished if it had published), and a withdrawal never answered leaves its request in doubt.
 * A request whose copies are out is reported only once they land. The sender may exit once
 * every request has had its completion, or at the stop's end. */
static void case_stop(void)
{
        const uint32_t src[1] = {5}, dfin[1] = {3}, dmov[1] = {4}, dwd[1] = {6}, dwf[1] = {7}, ddb[1] = {8},
                       dtcp[1] = {9}, dlate[1] = {10};
        const char *why = "instance 'x' is stopping (tools/kvferry down)";
        const uint64_t drain = 1000000000ull;
        uint64_t st = next_step();
        step_now += 5;
        sender_up(&A, &P);
        task(&P, "sp-fin", D.name, KVF_TRANSPORT_IPC, src, 1, dfin, 1, st, false);
        task(&P, "sp-moving", D.name, KVF_TRANSPORT_IPC, src, 1, dmov, 1, st + 5, false);
        task(&P, "sp-wd", D.name, KVF_TRANSPORT_IPC, src, 1, dwd, 1, st - 1, false);
        task(&P, "sp-wd-fin", D.name, KVF_TRANSPORT_IPC, src, 1, dwf, 1, st - 1, false);
        task(&P, "sp-doubt", D.name, KVF_TRANSPORT_IPC, src, 1, ddb, 1, st - 1, false);
        task(&P, "sp-tcp", tcp_peer, KVF_TRANSPORT_TCP, src, 1, dtcp, 1, st - 1, false);
        progress(&P, st - 1, LAYERS);
        turn(&A);
        progress(&P, st, 2);
        turn(&A);
        uint32_t fin = slot_of(&A, "sp-fin"), mov = slot_of(&A, "sp-moving"), wd = slot_of(&A, "sp-wd"),
                 wf = slot_of(&A, "sp-wd-fin"), db = slot_of(&A, "sp-doubt"), tc = slot_of(&A, "sp-tcp");
        CHECK_STATE(&A, fin, SREQ_MOVING, KVF_REQ_ACTIVE);
        CHECK_STATE(&A, wd, SREQ_LANDED, KVF_REQ_FINISHING);
        CHECK_STATE(&A, tc, SREQ_HANDED, KVF_REQ_HANDED_OVER);
        CHECK_EQ(count_type(to_connector(&P), KVF_RT_FINISH), 4); /* four notices out, unanswered */
        CHECK_EQ(completions(&P)->n, 0);

        uint64_t t0 = kvf_now_ns();
        sender_stop_begin(&A, t0, drain, why);
        CHECK_EQ(A.stop.in_flight, 6);
        CHECK(!sender_stop_step(&A, t0 + 1));
        CHECK_EQ(sender_stop_due(&A), t0 + drain);
        /* a task read now is refused at once; a request in flight finishes as before */
        task(&P, "sp-late", D.name, KVF_TRANSPORT_IPC, src, 1, dlate, 1, st + 1, false);
        progress(&P, st, LAYERS);
        turn(&A);
        struct outs *o = completions(&P);
        CHECK_EQ(o->n, 1);
        CHECK_DONE(o, "sp-late", KVF_STATUS_CONNECTION, "is stopping (tools/kvferry down): it takes no new tasks");
        CHECK_STATE(&A, fin, SREQ_LANDED, KVF_REQ_FINISHING);
        CHECK(landed(&P, &D, src, dfin, 1));
        write_result(&P, key_of(&A, fin), "sp-fin", KVF_STATUS_FINISHED, "");
        turn(&A);
        CHECK_DONE(completions(&P), "sp-fin", KVF_STATUS_FINISHED, "");
        CHECK(!sender_stop_step(&A, t0 + drain - 1));
        o = to_connector(&P);
        CHECK(find(o, KVF_RT_FINISH, "sp-fin") && !find(o, KVF_RT_FINISH, "sp-wd"));

        /* the window's end */
        CHECK(!sender_stop_step(&A, t0 + drain));
        CHECK_EQ(sender_stop_due(&A), t0 + drain + SENDER_STOP_ANSWER_NS);
        o = completions(&P);
        CHECK_EQ(o->n, 1);
        CHECK_DONE(o, "sp-moving", KVF_STATUS_CONNECTION, "still moving at the end of its 1000 ms drain window");
        CHECK(strstr(find(o, KVF_REC_COMPLETION, "sp-moving")->reason, why));
        CHECK_STATE(&A, mov, SREQ_FREE, KVF_REQ_FREE);
        o = to_connector(&P);
        const struct rec *ab = find(o, KVF_RT_FINISH, "sp-moving");
        CHECK(ab && ab->status == KVF_STATUS_CONNECTION && !ab->withdraw && strstr(ab->reason, why));
        const char *wds[4] = {"sp-wd", "sp-wd-fin", "sp-doubt", "sp-tcp"};
        for (unsigned i = 0; i < 4; i++) {
                const struct rec *w = find(o, KVF_RT_FINISH, wds[i]);
                CHECK(w && w->withdraw && w->status == KVF_STATUS_CONNECTION && !strcmp(w->reason, why));
        }
        CHECK_STATE(&A, wd, SREQ_LANDED, KVF_REQ_FINISHING); /* only the peer's answer decides */
        /* the peer publishes our withdrawal (it had not published), or had published; a tcp
         * notice that never left our connector is dropped there */
        write_result(&P, key_of(&A, wd), "sp-wd", KVF_STATUS_CONNECTION, why);
        write_result(&P, key_of(&A, wf), "sp-wd-fin", KVF_STATUS_FINISHED, "");
        write_result(&P, key_of(&A, tc), "sp-tcp", KVF_STATUS_TIMEOUT,
                     "timed out: the finish notice never reached the peer (withdrawn)");
        turn(&A);
        o = completions(&P);
        CHECK_EQ(o->n, 3);
        CHECK_DONE(o, "sp-wd", KVF_STATUS_CONNECTION, "the peer had not published the arrival, and publishes");
        CHECK_DONE(o, "sp-wd-fin", KVF_STATUS_FINISHED, "");
        CHECK_DONE(o, "sp-tcp", KVF_STATUS_TIMEOUT, "the peer's answer: timed out: the finish notice never reached");
        CHECK(strstr(find(o, KVF_REC_COMPLETION, "sp-tcp")->reason, why));
        CHECK(!sender_stop_step(&A, t0 + drain + SENDER_STOP_ANSWER_NS - 1));

        CHECK_STATE(&A, db, SREQ_LANDED, KVF_REQ_FINISHING);
        /* the answers' end: a withdrawal never answered is in doubt; then every request has had
         * its completion, and the sender may exit */
        CHECK(sender_stop_step(&A, t0 + drain + SENDER_STOP_ANSWER_NS));
        o = completions(&P);
        CHECK_EQ(o->n, 1);
        CHECK_DONE(o, "sp-doubt", KVF_STATUS_TIMEOUT, "had not answered the withdrawal of the finish notice");
        CHECK(strstr(find(o, KVF_REC_COMPLETION, "sp-doubt")->reason, "in doubt"));
        CHECK_STATE(&A, db, SREQ_FREE, KVF_REQ_FREE);
        CHECK_EQ(A.stop.finished, 2);
        CHECK_EQ(A.stop.failed, 4);
        CHECK_EQ(A.stop.ended, 1);
        CHECK_EQ(A.stop.withdrawn, 4);
        CHECK_EQ(A.stop.doubt, 1);
        CHECK_EQ(A.stop.refused, 1);
        sender_stop_report(&A, t0 + drain + SENDER_STOP_ANSWER_NS + 1);
        to_connector(&P);
        sender_close(&A);

        /* copies in flight at the window's end: decided, but reported only once they land */
        const uint32_t as[2] = {2, 3}, ad[2] = {16, 17};
        uint64_t sa = next_step();
        setenv("KVFERRY_ASYNC_DELAY_US", "200000", 1);
        sender_up(&A, &PA);
        task(&PA, "sp-landing", DA.name, KVF_TRANSPORT_IPC, as, 2, ad, 2, sa, false);
        progress(&PA, sa, LAYERS);
        turn(&A);
        uint32_t ld = slot_of(&A, "sp-landing");
        CHECK_STATE(&A, ld, SREQ_LANDING, KVF_REQ_ACTIVE);
        t0 = kvf_now_ns();
        sender_stop_begin(&A, t0, 0, why); /* --stop-drain-ms 0 */
        CHECK(!sender_stop_step(&A, t0)); /* its copies are out */
        CHECK_STATE(&A, ld, SREQ_DECIDED, KVF_REQ_COMPLETING);
        CHECK_EQ(completions(&PA)->n, 0);
        CHECK_EQ(to_connector(&PA)->n, 0); /* no abort either: the peer may not reuse the blocks yet */
        settle(&A);
        CHECK_DONE(completions(&PA), "sp-landing", KVF_STATUS_CONNECTION, "its last copies had not landed");
        ab = find(to_connector(&PA), KVF_RT_FINISH, "sp-landing");
        CHECK(ab && ab->status == KVF_STATUS_CONNECTION && !ab->withdraw);
        CHECK(sender_stop_step(&A, kvf_now_ns()));
        /* and a stop with nothing in flight may exit at once */
        sender_close(&A);
        sender_up(&A, &PA);
        sender_stop_begin(&A, kvf_now_ns(), drain, why);
        CHECK(sender_stop_step(&A, kvf_now_ns()));
        sender_close(&A);
        setenv("KVFERRY_ASYNC_DELAY_US", "1000", 1);
        step_now += 2;
}

/* A copy batch's runs in source order: sorted, stable, none lost or repeated, at every size a
 * step makes (one run; offsets of a few bits, where passes are skipped; offsets past 2^40). */
static void case_copy_sort(void)
{
        static const struct {
                uint32_t n;
                uint64_t span, base; /* offsets base + [0, span) */
        } sizes[] = {{1, 1, 0}, {2, 1, 0}, {7, 3, 64}, {1000, 1u << 20, 0},
                     {30000, 1ull << 41, 4096}, {5000, 256, 1ull << 40}};
        uint64_t x = 88172645463325252ull;
        for (unsigned k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
                struct sender s;
                memset(&s, 0, sizeof(s));
                uint32_t n = sizes[k].n;
                s.cp.caprun = n + 3;
                s.cp.runs = calloc(s.cp.caprun, sizeof(*s.cp.runs));
                CHECK(s.cp.runs);
                for (uint32_t i = 0; i < n; i++) {
                        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                        s.cp.runs[i] = (struct kvf_copy_run){.dst = i, .src_off = sizes[k].base + x % sizes[k].span,
                                                             .dst_off = i * 3ull, .bytes = i + 1};
                }
                s.cp.nruns = n;
                CHECK_EQ(sender_copies_sort(&s), 0);
                CHECK(s.cp.caprun >= n && s.cp.nruns == n);
                uint8_t *seen = calloc(n, 1);
                CHECK(seen);
                for (uint32_t i = 0; i < n; i++) {
                        const struct kvf_copy_run *r = &s.cp.runs[i];
                        CHECK(r->dst < n && !seen[r->dst]);
                        seen[r->dst] = 1;
                        CHECK(r->dst_off == r->dst * 3ull && r->bytes == r->dst + 1ull);
                        if (i) { /* ascending; equal offsets keep their order */
                                const struct kvf_copy_run *q = &s.cp.runs[i - 1];
                                CHECK(q->src_off < r->src_off || (q->src_off == r->src_off && q->dst < r->dst));
                        }
                }
                free(seen);
                /* The capacity kept is the array's own (AddressSanitizer checks this write). */
                s.cp.runs[s.cp.caprun - 1].bytes = 1;
                free(s.cp.runs);
                free(s.cp.sorted);
        }
}

/* The index of booked destination blocks on its own, larger than a table of SLOTS makes it: it
 * grows past its first size, and after removals (backward shifts across colliding entries)
 * every block left is found, every one let go is not, and nothing is left at the end. */
static void case_book(void)
{
        struct sender s;
        struct kvf_ctl_header h;
        memset(&s, 0, sizeof(s));
        memset(&h, 0, sizeof(h));
        h.reqtab_slots = 64;
        h.max_blocks = 64;
        s.ctl.hdr = &h;
        s.ctl.reqtab = calloc(h.reqtab_slots, sizeof(*s.ctl.reqtab));
        s.ctl.blocks = calloc((size_t)h.reqtab_slots * h.max_blocks * 2, sizeof(uint32_t));
        CHECK(s.ctl.reqtab && s.ctl.blocks && sender_table_init(&s) == 0);
        const char *peers[2] = {"d0", "d1"};
        /* slot i: peer i % 2, blocks i / 2 * 64 + [0, 64) there, so every block of a peer once */
        for (uint32_t i = 0; i < h.reqtab_slots; i++) {
                struct kvf_req_slot *r = &s.ctl.reqtab[i];
                snprintf(r->request_id, sizeof(r->request_id), "b%u", i);
                snprintf(r->peer, sizeof(r->peer), "%s", peers[i % 2]);
                r->n_send = h.max_blocks;
                uint32_t *dst = kvf_slot_blocks(&s.ctl, i) + h.max_blocks;
                for (uint32_t k = 0; k < h.max_blocks; k++)
                        dst[k] = i / 2 * h.max_blocks + k;
                CHECK_EQ(sender_book_add(&s, i), 0);
        }
        CHECK_EQ(s.book_n, h.reqtab_slots * h.max_blocks);
        CHECK(s.book_cap >= 2 * s.book_n);
        for (uint32_t i = 0; i < h.reqtab_slots; i += 4)
                sender_book_remove(&s, i);
        sender_book_remove(&s, 0); /* (twice: nothing more) */
        CHECK_EQ(s.book_n, h.reqtab_slots * h.max_blocks * 3 / 4);
        for (uint32_t i = 0; i < h.reqtab_slots; i++)
                for (uint32_t k = 0; k < h.max_blocks; k++) {
                        uint32_t b = i / 2 * h.max_blocks + k, at = 99, owner = 99;
                        bool found =
                            sender_book_find(&s, peers[i % 2], &b, 1, "other", &at, &owner);
                        CHECK(found == (i % 4 != 0));
                        CHECK(!found || (at == 0 && owner == i));
                        /* its own id is the same request, never a double booking */
                        CHECK(!sender_book_find(&s, peers[i % 2], &b, 1, s.ctl.reqtab[i].request_id,
                                                &at, &owner));
                }
        uint32_t past = h.reqtab_slots / 2 * h.max_blocks, at, owner; /* no slot's block */
        CHECK(!sender_book_find(&s, "d0", &past, 1, "other", &at, &owner));
        CHECK(!sender_book_find(&s, "d2", (const uint32_t[]){70}, 1, "other", &at, &owner));
        for (uint32_t i = 0; i < h.reqtab_slots; i++)
                sender_book_remove(&s, i);
        CHECK_EQ(s.book_n, 0);
        for (uint32_t i = 0; i < s.book_cap; i++)
                CHECK_EQ(s.book[i].slot, UINT32_MAX);
        sender_table_free(&s);
        free(s.ctl.reqtab);
        free(s.ctl.blocks);
}

int main(void)
{
        uint64_t t0 = kvf_now_ns();
        atexit(cleanup);
#ifdef __SANITIZE_ADDRESS__
        const int fatal[] = {SIGABRT, SIGTERM, SIGINT}; /* (AddressSanitizer reports the others) */
#else
        const int fatal[] = {SIGSEGV, SIGBUS, SIGABRT, SIGTERM, SIGINT};
#endif
        for (unsigned i = 0; i < sizeof(fatal) / sizeof(fatal[0]); i++)
                signal(fatal[i], on_fatal);
        case_copy_sort();
        case_book();
        inst_make(&P, "p", KVF_IROLE_PREFILL, KVF_BACKEND_HOST);
        inst_make(&D, "d", KVF_IROLE_DECODE, KVF_BACKEND_HOST);
        inst_make(&PA, "pa", KVF_IROLE_PREFILL, KVF_BACKEND_HOST_ASYNC);
        inst_make(&DA, "da", KVF_IROLE_DECODE, KVF_BACKEND_HOST_ASYNC);
        engine_attach(&P);
        connector_start(&P);

        static struct sender S;
        sender_up(&S, &P);
        case_ipc_finished(&S);
        case_bad_tasks(&S);
        case_cancel(&S);
        case_timeout(&S);
        case_tcp(&S);
        case_chunks(&S);
        case_engine_gone(&S);
        case_peer_gone(&S);
        case_full_rings(&S);
        case_net_block_size(&S);
        for (uint32_t i = 0; i < SLOTS; i++)
                CHECK_STATE(&S, i, SREQ_FREE, KVF_REQ_FREE);
        CHECK_EQ(S.book_n, 0); /* every ended request let its blocks go */
        sender_close(&S);
        case_restart();
        sender_close(&B);
        case_notice_rings();
        case_async();
        case_layer_turns();
        case_own_landing();
        case_stop();

        kvf_cache_unmap(&P.cache);
        kvf_cache_unmap(&D.cache);
        kvf_cache_unmap(&PA.cache);
        kvf_cache_unmap(&DA.cache);
        kvf_ctl_detach(&P.ctl);
        kvf_ctl_detach(&D.ctl);
        kvf_ctl_detach(&PA.ctl);
        kvf_ctl_detach(&DA.ctl);
        printf("sender_logic_test: ok (%.0f ms)\n", (double)(kvf_now_ns() - t0) / 1e6);
        return 0;
}
