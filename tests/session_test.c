/*
 * Engine sessions (docs/ARCHITECTURE.md 6b): a request belongs to the engine session
 * that submitted it. When that session ends (its process is killed, or it
 * detaches) its requests still moving end "engine gone" on both sides, and
 * nothing of it is delivered to the next engine: kvf_poll() of a new session
 * returns only its own events, kvf_poll_previous() tells what was lost.
 *
 * Real processes: instances started with tools/kvferry up; engines are
 * forked children that attach with the client library and are SIGKILLed.
 * Each case also checks the bytes: layers the dead engine never published
 * must never reach the decode cache. Where a step must have happened before
 * the next (the sender has the task, layers are copied, a request finished),
 * the test waits for the instance's counter that says so (tasks_accepted,
 * layers_sent, requests_finished: kvf-ringdump shows them) and fails, saying
 * what it waited for, if it does not move in time.
 */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "clock.h"
#include "ctl.h"
#include "instances.h"
#include "kvferry.h"

static char P[64], D[64], daddr[128];
static struct kvf_layout_info L;


/* A byte pattern per (request tag, layer, tensor, block index): what the prefill engine computed. */
static uint8_t pat(unsigned tag, uint32_t l, uint32_t t, uint32_t i)
{
        return (uint8_t)(1 + ((tag * 131u + l * 7u + t * 3u + i) % 250u));
}

static void fill_layer(struct kvf_client *c, unsigned tag, uint32_t l, const uint32_t *src, uint32_t n)
{
        uint32_t tensors = L.key_only ? 1 : 2;
        for (uint32_t t = 0; t < tensors; t++) {
                uint8_t *base = kvf_cache_tensor(c, l, (int)t);
                for (uint32_t i = 0; i < n; i++)
                        memset(base + (uint64_t)src[i] * L.block_bytes, pat(tag, l, t, i), L.block_bytes);
        }
}

/*
 * Decode side: layer l of dst blocks holds the request's bytes (want), or
 * none of them (zeroed before the case). Returns the number of blocks that
 * differ from the expectation.
 */
static uint32_t check_dst(struct kvf_client *dc, unsigned tag, uint32_t l, const uint32_t *dst, uint32_t n,
                          bool want)
{
        uint32_t tensors = L.key_only ? 1 : 2, bad = 0;
        for (uint32_t t = 0; t < tensors; t++) {
                const uint8_t *base = kvf_cache_tensor(dc, l, (int)t);
                for (uint32_t i = 0; i < n; i++) {
                        const uint8_t *b = base + (uint64_t)dst[i] * L.block_bytes;
                        uint8_t v = want ? pat(tag, l, t, i) : 0;
                        for (uint64_t k = 0; k < L.block_bytes; k++)
                                if (b[k] != v) {
                                        bad++;
                                        break;
                                }
                }
        }
        return bad;
}

static void zero_dst(struct kvf_client *dc, const uint32_t *dst, uint32_t n)
{
        uint32_t tensors = L.key_only ? 1 : 2;
        for (uint32_t l = 0; l < L.num_layers; l++)
                for (uint32_t t = 0; t < tensors; t++)
                        for (uint32_t i = 0; i < n; i++)
                                memset((uint8_t *)kvf_cache_tensor(dc, l, (int)t) +
                                               (uint64_t)dst[i] * L.block_bytes,
                                       0, L.block_bytes);
}

static int submit(struct kvf_client *c, const char *id, const uint32_t *src, const uint32_t *dst,
                  uint32_t n, uint64_t step, int transport)
{
        struct kvf_task t = {.request_id = id, .src_block_ids = src, .n_src = n, .dest_block_ids = dst,
                             .n_dest = n, .current_id = step, .transport = transport,
                             .peer = transport == KVF_TRANSPORT_TCP ? daddr : D};
        return kvf_submit_task(c, &t);
}

/* The next event of `type` for request `id` within timeout_ms; 1 found, 0 not. Others are kept
 * in `seen` (a bit per call site's purposes is enough: we only count them). */
static int wait_event(struct kvf_client *c, int type, const char *id, int timeout_ms, struct kvf_event *out,
                      unsigned *others)
{
        uint64_t end = kvf_now_ns() + (uint64_t)timeout_ms * 1000000ull;
        while (kvf_now_ns() < end) {
                struct kvf_event ev;
                int rc = kvf_poll(c, &ev, 50);
                CHECK(rc >= 0);
                if (rc == 0)
                        continue;
                if (ev.type == type && !strcmp(ev.request_id, id)) {
                        *out = ev;
                        return 1;
                }
                if (others)
                        (*others)++;
                fprintf(stderr, "  (event %d for '%s': %s: %s)\n", ev.type, ev.request_id,
                        kvf_status_name(ev.status), ev.reason);
        }
        return 0;
}

/* Earlier sessions' events until `id` of `type` shows up (timeout_ms); 1 found with *out. */
static int wait_previous(struct kvf_client *c, int type, const char *id, int timeout_ms,
                         struct kvf_event *out)
{
        uint64_t end = kvf_now_ns() + (uint64_t)timeout_ms * 1000000ull;
        for (;;) {
                struct kvf_event ev;
                while (kvf_poll_previous(c, &ev) == 1)
                        if (ev.type == type && !strcmp(ev.request_id, id)) {
                                *out = ev;
                                return 1;
                        }
                if (kvf_now_ns() >= end)
                        return 0;
                /* kvf_poll reads the rings; what belongs to earlier sessions lands in the list. */
                int rc = kvf_poll(c, &ev, 50);
                CHECK(rc >= 0);
                if (rc == 1)
                        fprintf(stderr, "  (unexpected own event %d for '%s': %s)\n", ev.type, ev.request_id,
                                kvf_status_name(ev.status));
                CHECK(rc == 0);
        }
}

/* Fork with a pipe from the child to the parent: *fd is its write end in the child (0 returned),
 * its read end in the parent (the child's pid returned). */
static pid_t fork_piped(int *fd)
{
        int pfd[2];
        CHECK(pipe(pfd) == 0);
        pid_t pid = fork();
        CHECK(pid >= 0);
        close(pfd[pid == 0 ? 0 : 1]);
        *fd = pfd[pid == 0 ? 1 : 0];
        return pid;
}

/* Parent: the child's report of `len` bytes, then the pipe closed. */
static void read_report(int fd, void *p, size_t len)
{
        CHECK(read(fd, p, len) == (ssize_t)len);
        close(fd);
}

/* Fork an engine that attaches to P, submits `id` at the next step, publishes `layers` layers,
 * waits until the sender has moved them (with all_then_wait: until the request finished, its
 * completion unread), (if `detach`) detaches cleanly; it then reports on `fd` and waits to be
 * killed. */
static pid_t engine_child(const char *id, unsigned tag, const uint32_t *src, const uint32_t *dst, uint32_t n,
                          int transport, uint32_t layers, bool detach, bool all_then_wait, uint64_t *session_out)
{
        int fd;
        pid_t pid = fork_piped(&fd);
        if (pid == 0) {
                struct kvf_client *c;
                if (kvf_attach(P, 5000, &c) < 0) {
                        fprintf(stderr, "child: attach: %s\n", kvf_last_error());
                        _exit(1);
                }
                uint64_t step = kvf_last_step(c) + 1, sess = kvf_session(c);
                /* (nothing else moves on P meanwhile: these count only this request) */
                int64_t acc0 = t_counter(P, KVF_CTR_TASKS_ACCEPTED),
                        lay0 = t_counter(P, KVF_CTR_LAYERS_SENT);
                int64_t fin0 = t_counter(P, KVF_CTR_REQUESTS_FINISHED);
                if (acc0 < 0 || lay0 < 0 || fin0 < 0 ||
                    submit(c, id, src, dst, n, step, transport) < 0)
                        _exit(1);
                for (uint32_t l = 0; l < layers; l++) {
                        fill_layer(c, tag, l, src, n);
                        if (kvf_layer_done(c, step, l) < 0)
                                _exit(1);
                }
                if (all_then_wait) {
                        /* every layer published: the request finishes, its completion unread */
                        if (t_wait_counter(P, KVF_CTR_REQUESTS_FINISHED, (uint64_t)fin0 + 1, 5000,
                                           "the request to finish") < 0)
                                _exit(1);
                } else if (layers) {
                        /* the layers it published are copied (ipc) or on their way (tcp) */
                        if (t_wait_counter(P, KVF_CTR_LAYERS_SENT, (uint64_t)lay0 + layers, 5000,
                                           "the sender to move the layers the engine published") <
                            0)
                                _exit(1);
                }
                if (detach) {
                        /* the sender has the task (else: "before it was read") */
                        if (t_wait_counter(P, KVF_CTR_TASKS_ACCEPTED, (uint64_t)acc0 + 1, 5000,
                                           "the sender to accept the task") < 0)
                                _exit(1);
                        kvf_detach(c);
                }
                if (write(fd, &sess, sizeof(sess)) != (ssize_t)sizeof(sess))
                        _exit(1);
                pause();
                _exit(0);
        }
        read_report(fd, session_out, sizeof(*session_out));
        return pid;
}

static void kill_child(pid_t pid)
{
        kill(pid, SIGKILL);
        int st;
        CHECK(waitpid(pid, &st, 0) == pid);
}

static const char *tname(int t)
{
        return t == KVF_TRANSPORT_TCP ? "tcp" : "ipc";
}

/*
 * Engine A submits X and publishes 7 of 32 layers, waits until they moved, then
 * is killed; engine B attaches and numbers its steps from kvf_last_step() + 1.
 * X must end "engine gone" on both sides, B must not see it, and layers 7 and
 * up of X must never reach the decode cache.
 */
static void case_killed(struct kvf_client *dc, int transport, bool detach)
{
        char x[32], y[32];
        uint32_t sx[4] = {0, 1, 2, 3}, dx[4] = {10, 11, 12, 13}, sy[4] = {20, 21, 22, 23},
                 dy[4] = {30, 31, 32, 33};
        const char *how = detach ? "detached" : "killed";
        snprintf(x, sizeof(x), "x-%s-%s", tname(transport), how);
        snprintf(y, sizeof(y), "y-%s-%s", tname(transport), how);
        zero_dst(dc, dx, 4);
        zero_dst(dc, dy, 4);
        uint64_t sa;
        int64_t gone = t_counter(P, KVF_CTR_FAILED_ENGINE_GONE);
        pid_t a = engine_child(x, 1, sx, dx, 4, transport, 7, detach, false, &sa);
        kill_child(a);
        /* A detached: B attaches once the sender has ended X for that (else, on a busy machine,
         * the sender may see B before A's detach, and say so: "another engine attached"). */
        if (detach)
                CHECK_EQ(t_wait_counter(P, KVF_CTR_FAILED_ENGINE_GONE, (uint64_t)gone + 1, 10000,
                                        "the sender to end X for its engine's detach"),
                         0);

        struct kvf_client *b;
        CHECK_EQ(kvf_attach(P, 5000, &b), 0);
        CHECK(kvf_session(b) > sa);
        uint64_t step = kvf_last_step(b) + 1;
        CHECK_EQ(submit(b, y, sy, dy, 4, step, transport), 0);
        for (uint32_t l = 0; l < L.num_layers; l++) {
                fill_layer(b, 2, l, sy, 4);
                CHECK_EQ(kvf_layer_done(b, step, l), 0);
        }
        struct kvf_event ev;
        unsigned others = 0;
        CHECK(wait_event(b, KVF_EVENT_COMPLETION, y, 10000, &ev, &others));
        CHECK_EQ(ev.status, KVF_STATUS_FINISHED);
        CHECK_EQ(others, 0); /* nothing of A's session */
        CHECK(wait_previous(b, KVF_EVENT_COMPLETION, x, 5000, &ev));
        if (ev.status != KVF_STATUS_ENGINE_GONE || ev.session != sa ||
            !strstr(ev.reason, detach ? "the engine detached" : "ended")) {
                fprintf(stderr, "%s: previous completion: %s (session %llu, A was %llu): %s\n", x,
                        kvf_status_name(ev.status), (unsigned long long)ev.session,
                        (unsigned long long)sa, ev.reason);
                exit(1);
        }
        printf("  prefill side: %-16s -> %s (session %llu): %s\n", x, kvf_status_name(ev.status),
               (unsigned long long)ev.session, ev.reason);
        /* Decode side: X's arrival says so, Y's is complete. */
        others = 0;
        CHECK(wait_event(dc, KVF_EVENT_ARRIVAL, x, 10000, &ev, &others));
        CHECK_EQ(ev.status, KVF_STATUS_ENGINE_GONE);
        printf("  decode side:  %-16s -> %s: %s\n", x, kvf_status_name(ev.status), ev.reason);
        CHECK(wait_event(dc, KVF_EVENT_ARRIVAL, y, 10000, &ev, &others));
        CHECK_EQ(ev.status, KVF_STATUS_FINISHED);
        for (uint32_t l = 0; l < L.num_layers; l++) {
                CHECK_EQ(check_dst(dc, 2, l, dy, 4, true), 0);
                /* Never a layer A did not compute: nothing from B's steps went into X's blocks. */
                if (l >= 7)
                        CHECK_EQ(check_dst(dc, 1, l, dx, 4, false), 0);
        }
        kvf_detach(b);
        printf("ok: %s: engine %s after 7 of %u layers: X ended 'engine gone' on both sides, the new "
               "engine saw only its own request, no stale byte landed\n",
               tname(transport), how, L.num_layers);
}

/* A's request finished while A was not reading: B never gets its completion, only as previous. */
static void case_unread(struct kvf_client *dc)
{
        uint32_t s[2] = {40, 41}, d[2] = {40, 41};
        uint64_t sa;
        zero_dst(dc, d, 2);
        pid_t a = engine_child("z-unread", 3, s, d, 2, KVF_TRANSPORT_IPC, L.num_layers, false, true, &sa);
        kill_child(a);
        struct kvf_client *b;
        CHECK_EQ(kvf_attach(P, 5000, &b), 0);
        struct kvf_event ev;
        CHECK_EQ(kvf_poll(b, &ev, 300), 0); /* (nothing comes: a span of time) */
        CHECK(wait_previous(b, KVF_EVENT_COMPLETION, "z-unread", 3000, &ev));
        CHECK_EQ(ev.status, KVF_STATUS_FINISHED);
        CHECK_EQ(ev.session, sa);
        CHECK(wait_event(dc, KVF_EVENT_ARRIVAL, "z-unread", 5000, &ev, NULL));
        CHECK_EQ(ev.status, KVF_STATUS_FINISHED);
        kvf_detach(b);
        printf("ok: a completion the killed engine never read goes to kvf_poll_previous, not to its successor\n");
}

/* An engine of the succession: attaches to `inst`, moves request `id` over the two blocks and
 * waits for its completion; its status, or -1 (no attach, no submit, no completion in 5 s). */
static int succession_engine(const char *inst, const char *id)
{
        uint32_t s[2] = {50, 51}, d[2] = {50, 51};
        struct kvf_client *c;
        int st = -1;
        if (kvf_attach(inst, 5000, &c) < 0)
                return -1;
        uint64_t step = kvf_last_step(c) + 1;
        if (submit(c, id, s, d, 2, step, KVF_TRANSPORT_IPC) == 0) {
                for (uint32_t l = 0; l < L.num_layers; l++)
                        kvf_layer_done(c, step, l);
                struct kvf_event ev;
                uint64_t end = kvf_now_ns() + 5000000000ull;
                while (st < 0 && kvf_now_ns() < end)
                        if (kvf_poll(c, &ev, 50) == 1 && ev.type == KVF_EVENT_COMPLETION && !strcmp(ev.request_id, id)) {
                                st = ev.status;
                                if (st != KVF_STATUS_FINISHED)
                                        fprintf(stderr, "  %s: %s: %s\n", id, kvf_status_name(st), ev.reason);
                        }
        }
        kvf_detach(c);
        return st;
}

/*
 * Engines in quick succession on an instance whose roles check the engine's process every
 * millisecond (--heartbeat-ms 1): each attaches as soon as the last one detached, moves one
 * request and waits for its completion: none may be lost. (What it guards: an attaching engine
 * stores its pid before its session number, and a check that judged the old session dead then
 * marked the generation it read afterwards, the new engine's, as dead; its request ended 'engine
 * gone' while it was alive. tcp_test hit that once; the window is a few microseconds, and this
 * case does not hit it reliably: kvf_engine_session_checked() is the fix.)
 */
static void case_succession(struct kvf_client *dc, const char *inst, unsigned rounds)
{
        unsigned bad = 0;
        for (unsigned i = 0; i < rounds; i++) {
                char id[32];
                snprintf(id, sizeof(id), "q-%u", i);
                int fd;
                pid_t pid = fork_piped(&fd);
                if (pid == 0) {
                        int st = succession_engine(inst, id);
                        _exit(write(fd, &st, sizeof(st)) == (ssize_t)sizeof(st) ? 0 : 1);
                }
                int st = -2;
                read_report(fd, &st, sizeof(st));
                int ws;
                CHECK(waitpid(pid, &ws, 0) == pid);
                struct kvf_event ev;
                if (st != KVF_STATUS_FINISHED || !wait_event(dc, KVF_EVENT_ARRIVAL, id, 5000, &ev, NULL) ||
                    ev.status != KVF_STATUS_FINISHED)
                        bad++;
        }
        if (bad) {
                fprintf(stderr, "%u of %u engines in quick succession lost their request\n", bad, rounds);
                exit(1);
        }
        printf("ok: %u engines in quick succession, process checked every millisecond: every request finished on both sides\n",
               rounds);
}

/* The decode engine that reserved the blocks is killed and replaced mid-transfer. */
static void case_decode_engine(struct kvf_client **dcp, int transport)
{
        char w[32];
        uint32_t s[3] = {50, 51, 52}, d[3] = {50, 51, 52};
        snprintf(w, sizeof(w), "w-%s", tname(transport));
        kvf_detach(*dcp); /* the decode engine is a child for this case */
        int pfd[2];
        CHECK(pipe(pfd) == 0);
        pid_t e1 = fork();
        CHECK(e1 >= 0);
        if (e1 == 0) {
                struct kvf_client *c;
                if (kvf_attach(D, 5000, &c) < 0)
                        _exit(1);
                zero_dst(c, d, 3);
                char ok = 1;
                if (write(pfd[1], &ok, 1) != 1)
                        _exit(1);
                pause();
                _exit(0);
        }
        char ok;
        CHECK(read(pfd[0], &ok, 1) == 1);
        close(pfd[0]);
        close(pfd[1]);
        struct kvf_client *pc;
        CHECK_EQ(kvf_attach(P, 5000, &pc), 0);
        uint64_t step = kvf_last_step(pc) + 1;
        int64_t lay0 = t_counter(P, KVF_CTR_LAYERS_SENT);
        CHECK(lay0 >= 0);
        CHECK_EQ(submit(pc, w, s, d, 3, step, transport), 0);
        for (uint32_t l = 0; l < 3; l++) {
                fill_layer(pc, 4, l, s, 3);
                CHECK_EQ(kvf_layer_done(pc, step, l), 0);
        }
        /* Layers 0-2 are copied (ipc) or on their way (tcp) before the engine that reserved the
         * blocks goes. */
        CHECK_EQ(t_wait_counter(P, KVF_CTR_LAYERS_SENT, (uint64_t)lay0 + 3, 5000,
                                "the sender to move layers 0-2 of the request"),
                 0);
        kill_child(e1);
        struct kvf_client *e2;
        CHECK_EQ(kvf_attach(D, 5000, &e2), 0); /* a new decode engine: the blocks are its now */
        for (uint32_t l = 3; l < L.num_layers; l++) {
                fill_layer(pc, 4, l, s, 3);
                CHECK_EQ(kvf_layer_done(pc, step, l), 0);
        }
        struct kvf_event ev;
        CHECK(wait_event(pc, KVF_EVENT_COMPLETION, w, 10000, &ev, NULL));
        if (ev.status != KVF_STATUS_ENGINE_GONE) {
                fprintf(stderr, "%s: completion %s: %s\n", w, kvf_status_name(ev.status), ev.reason);
                exit(1);
        }
        printf("  prefill side: %-16s -> %s: %s\n", w, kvf_status_name(ev.status), ev.reason);
        /* The new decode engine never hears of W; nothing after the kill reached its blocks. */
        CHECK_EQ(kvf_poll(e2, &ev, 500), 0); /* (nothing comes: a span of time) */
        for (uint32_t l = 3; l < L.num_layers; l++)
                CHECK_EQ(check_dst(e2, 4, l, d, 3, false), 0);
        kvf_detach(pc);
        *dcp = e2;
        printf("ok: %s: the decode engine that reserved the blocks was replaced: 'engine gone', its "
               "successor got nothing, no byte landed in its blocks after\n",
               tname(transport));
}

/* A task the killed engine wrote but the sender had not read yet: rejected for its own session. */
static void case_unread_task(void)
{
        struct kvf_ctl ctl;
        CHECK_EQ(kvf_ctl_attach(P, false, &ctl), 0);
        pid_t sender = ctl.roles[KVF_ROLE_SENDER].pid;
        kvf_ctl_detach(&ctl);
        CHECK(sender > 0);
        kill(sender, SIGSTOP);
        uint32_t s[2] = {60, 61}, d[2] = {60, 61};
        uint64_t sa;
        pid_t a = engine_child("t-in-ring", 5, s, d, 2, KVF_TRANSPORT_IPC, 0, false, false, &sa);
        kill_child(a);
        struct kvf_client *b;
        /* (waits for a stopped sender no longer than it looks alive) */
        CHECK_EQ(kvf_attach(P, 5000, &b), 0);
        kill(sender, SIGCONT);
        struct kvf_event ev;
        CHECK(wait_previous(b, KVF_EVENT_COMPLETION, "t-in-ring", 5000, &ev));
        CHECK_EQ(ev.status, KVF_STATUS_ENGINE_GONE);
        CHECK_EQ(ev.session, sa);
        printf("  prefill side: %-16s -> %s: %s\n", "t-in-ring", kvf_status_name(ev.status), ev.reason);
        /* The new engine's own task of the same id is no duplicate of it. */
        uint64_t step = kvf_last_step(b) + 1;
        CHECK_EQ(submit(b, "t-in-ring", s, d, 2, step, KVF_TRANSPORT_IPC), 0);
        for (uint32_t l = 0; l < L.num_layers; l++)
                CHECK_EQ(kvf_layer_done(b, step, l), 0);
        CHECK(wait_event(b, KVF_EVENT_COMPLETION, "t-in-ring", 10000, &ev, NULL));
        CHECK_EQ(ev.status, KVF_STATUS_FINISHED);
        kvf_detach(b);
        printf("ok: a task left in the ring by a killed engine ends 'engine gone' for that session; the "
               "new engine's request with the same id finishes\n");
}

/* The child's side of case_fork: every call on the parent's client is refused with the same
 * message; returns the number of calls that were not. */
static int forked_calls(struct kvf_client *c, pid_t parent)
{
        char want[128];
        snprintf(want, sizeof(want), "this client was attached by pid %d; after fork() attach anew in the child",
                 (int)parent);
        uint32_t s[1] = {62}, d[1] = {62};
        struct kvf_event ev;
        struct kvf_layout_info li;
        int bad = 0, rc;
#define REFUSED(call)                                                                              \
        do {                                                                                       \
                rc = (call);                                                                       \
                if (rc != -EBADF || !strstr(kvf_last_error(), want)) {                             \
                        fprintf(stderr, "child: %s returned %d (%s)\n", #call, rc, kvf_last_error()); \
                        bad++;                                                                     \
                }                                                                                  \
        } while (0)
        REFUSED(submit(c, "t-forked", s, d, 1, 1u << 30, KVF_TRANSPORT_IPC));
        REFUSED(kvf_submit_chunk(c, "t-forked", 1, 16, 1));
        REFUSED(kvf_submit_cancel(c, "t-forked"));
        REFUSED(kvf_submit_connect(c, "t-forked-connect", D));
        REFUSED(kvf_submit_raw(c, KVF_TO_SENDER, KVF_REC_CANCEL, "\x81\xaarequest_id\xa1x", 14));
        REFUSED(kvf_layer_done(c, 1u << 30, 0));
        REFUSED(kvf_layer_done_on_stream(c, NULL, 1u << 30, 0));
        REFUSED(kvf_set_layer_signal(c, KVF_SIGNAL_HOSTFN));
        REFUSED(kvf_poll(c, &ev, 10));
        REFUSED(kvf_poll_previous(c, &ev));
        REFUSED(kvf_get_layout(c, &li));
#undef REFUSED
        if (kvf_cache_tensor(c, 0, 0) || !strstr(kvf_last_error(), want)) {
                fprintf(stderr, "child: kvf_cache_tensor gave the parent's cache (%s)\n", kvf_last_error());
                bad++;
        }
        if (kvf_last_step(c) != 0 || !strstr(kvf_last_error(), want)) {
                fprintf(stderr, "child: kvf_last_step was answered (%s)\n", kvf_last_error());
                bad++;
        }
        printf("  child: %s\n", kvf_last_error());
        fflush(stdout);
        kvf_detach(c); /* its own copies only: the parent's session goes on */
        return bad;
}

/*
 * A client used in a child after fork() would publish into the parent's engine session: every
 * call of the child is refused, naming the pid that attached, and its detach ends nothing. The
 * parent's session goes on (a request of it finishes; nothing of the child's reaches anyone).
 */
static void case_fork(struct kvf_client *dc)
{
        struct kvf_client *c;
        CHECK_EQ(kvf_attach(P, 5000, &c), 0);
        uint64_t session = kvf_session(c);
        fflush(stdout);
        pid_t kid = fork();
        CHECK(kid >= 0);
        if (kid == 0)
                _exit(forked_calls(c, getppid()) ? 1 : 0);
        int st;
        CHECK(waitpid(kid, &st, 0) == kid);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        CHECK_EQ(kvf_session(c), session);
        uint32_t s[1] = {62}, d[1] = {62};
        uint64_t step = kvf_last_step(c) + 1;
        CHECK_EQ(submit(c, "t-after-fork", s, d, 1, step, KVF_TRANSPORT_IPC), 0);
        for (uint32_t l = 0; l < L.num_layers; l++)
                CHECK_EQ(kvf_layer_done(c, step, l), 0);
        struct kvf_event ev;
        unsigned others = 0;
        CHECK(wait_event(c, KVF_EVENT_COMPLETION, "t-after-fork", 10000, &ev, &others));
        CHECK_EQ(ev.status, KVF_STATUS_FINISHED);
        CHECK_EQ(others, 0); /* nothing of the child's reached the parent's session */
        /* (the decode engine may still hold an earlier case's arrival: not counted) */
        CHECK(wait_event(dc, KVF_EVENT_ARRIVAL, "t-after-fork", 10000, &ev, NULL));
        CHECK_EQ(ev.status, KVF_STATUS_FINISHED);
        kvf_detach(c);
        printf("ok: a client used in a child after fork(): every call refused, naming the pid that attached; "
               "the parent's session went on (its request finished on both sides)\n");
}

int main(void)
{
        snprintf(P, sizeof(P), "se%d-p", (int)getpid());
        snprintf(D, sizeof(D), "se%d-d", (int)getpid());
        const char *lay = "--model llama-3.1-8b --tp 8 --blocks 64";
        t_up(D, "--role decode %s", lay);
        t_up(P, "--role prefill %s", lay);
        struct kvf_client *dc;
        CHECK_EQ(kvf_attach(D, 5000, &dc), 0);
        CHECK_EQ(kvf_get_layout(dc, &L), 0);
        t_connector_addr(D, daddr, sizeof(daddr));
        for (int t = KVF_TRANSPORT_IPC; t <= KVF_TRANSPORT_TCP; t++) {
                case_killed(dc, t, false);
                case_killed(dc, t, true);
        }
        case_unread(dc);
        case_unread_task();
        case_fork(dc);
        case_decode_engine(&dc, KVF_TRANSPORT_IPC);
        case_decode_engine(&dc, KVF_TRANSPORT_TCP);
        char H[64];
        snprintf(H, sizeof(H), "se%d-h", (int)getpid());
        t_up(H, "--role prefill %s --heartbeat-ms 1", lay);
        case_succession(dc, H, 100);
        kvf_detach(dc);
        printf("session_test: all passed\n");
        return 0;
}
