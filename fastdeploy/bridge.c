/*
 * FastDeploy's layer signals into kvferry events (bridge.h says what and why).
 */
#include "bridge.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ipc.h>
#include <sys/mman.h>
#include <sys/msg.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "atomics.h"
#include "kvferry.h"

/* FastDeploy's message: mtype 1, [count, layer_id, (slot, before, tokens) * count]. */
struct fd_msg {
        long mtype;
        int mtext[KVF_FD_MAX_SLOTS * 3 + 2];
};
/* The stop message the bridge sends itself: a type FastDeploy never uses. */
#define STOP_MTYPE 0x4b5646L

struct slot {
        char rid[128];
        bool active;   /* a task holds the slot */
        bool adopted;  /* the history below belongs to a task (now or before) */
        bool fresh;    /* the active task came before any chunk of its own */
        uint64_t need; /* need_prefill_tokens of the active task */
        /* The slot's chunks since its last chunk that did not continue the one before. */
        bool have;
        uint64_t first_step;
        bool have_prev;
        uint64_t prev_step, prev_end, last_step, last_end;
};

/* per_query: how long a layer value read with a new step must stand before it counts as the
 * new step's (the loop below says why). */
#define STALE_STAND_NS 5000000000ull

struct kvf_fd_bridge {
        struct kvf_client *c;
        struct kvf_fd_bridge_config cfg;
        pthread_t thread;
        bool started;
        int stop; /* atomic: set by kvf_fd_bridge_stop */
        /* per_query */
        int32_t *step_word, *layer_word;
        /* per_chunk */
        int msqid;
        struct fd_msg msg;

        pthread_mutex_t mu; /* slots, stats, err, steps */
        struct slot slots[KVF_FD_MAX_SLOTS];
        struct kvf_fd_bridge_stats st;
        uint64_t base;     /* the kvferry step of FastDeploy's (unwrapped) step -1 */
        int64_t unwrapped; /* per_query: FastDeploy's step without the wrap (-1: before any) */
        char err[320];
};

static void set_err(struct kvf_fd_bridge *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void set_err(struct kvf_fd_bridge *b, const char *fmt, ...)
{
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(b->err, sizeof(b->err), fmt, ap);
        va_end(ap);
}

static uint64_t now_ns(void)
{
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void nap_us(unsigned us)
{
        struct timespec ts = {.tv_sec = us / 1000000, .tv_nsec = (long)(us % 1000000) * 1000};
        nanosleep(&ts, NULL);
}

/* A submit that retries while the ring is full (the sender drains it in microseconds). */
static int retry_full(int rc_first, int (*again)(void *), void *arg)
{
        int rc = rc_first;
        for (int i = 0; rc == -EAGAIN && i < 20000; i++) {
                nap_us(50);
                rc = again(arg);
        }
        return rc;
}

struct chunk_args {
        struct kvf_fd_bridge *b;
        const char *rid;
        uint64_t step, tokens;
        int last;
};

static int chunk_once(void *p)
{
        struct chunk_args *a = p;
        return kvf_submit_chunk(a->b->c, a->rid, a->step, a->tokens, a->last);
}

/* With b->mu held. After the request's last chunk the slot is free for the next request: the
 * request itself goes on moving (its completion comes from the sender). */
static void put_chunk(struct kvf_fd_bridge *b, struct slot *s, uint64_t step, uint64_t end)
{
        struct chunk_args a = {b, s->rid, step, end, s->need && end >= s->need};
        int rc = retry_full(chunk_once(&a), chunk_once, &a);
        if (rc < 0) {
                b->st.errors++;
                set_err(b, "chunk of request %s (step %llu, %llu tokens): %s", s->rid,
                        (unsigned long long)step, (unsigned long long)end, kvf_last_error());
                return;
        }
        b->st.chunks++;
        if (a.last)
                s->active = false;
}

/* One (slot, before, tokens) triple of forward step `step`, with b->mu held. */
static void slot_chunk(struct kvf_fd_bridge *b, unsigned idx, uint64_t step, uint64_t before,
                       uint64_t tokens)
{
        struct slot *s = &b->slots[idx];
        uint64_t end = before + tokens;
        bool cont = s->have && !s->fresh && before == s->last_end;
        if (s->active && !s->fresh && !cont) {
                /* Another request's chunk before this one's last: FastDeploy gave the slot to a
                 * new request, and this one will get no more (the sender times it out). */
                b->st.errors++;
                set_err(b,
                        "slot %u: request %s had %llu of %llu tokens when a chunk of another "
                        "request came (%llu tokens from %llu)",
                        idx, s->rid, (unsigned long long)s->last_end, (unsigned long long)s->need,
                        (unsigned long long)tokens, (unsigned long long)before);
                s->active = false;
        }
        if (!cont) {
                /* A request's first chunk here (or the slot's history restarts): a task that
                 * comes later adopts the history from this chunk on. */
                s->have = true;
                s->fresh = false;
                s->adopted = s->active;
                s->first_step = step;
                s->have_prev = false;
        } else if (s->last_step != step) {
                s->have_prev = true;
                s->prev_step = s->last_step;
                s->prev_end = s->last_end;
        }
        s->last_step = step;
        s->last_end = end;
        if (s->active)
                put_chunk(b, s, step, end);
        else
                b->st.unknown_slots++;
}

static int publish(struct kvf_fd_bridge *b, uint64_t step, uint32_t layer)
{
        int rc = kvf_layer_done(b->c, step, layer);
        pthread_mutex_lock(&b->mu);
        if (rc < 0) {
                b->st.errors++;
                set_err(b, "layer-done of step %llu layer %u: %s", (unsigned long long)step, layer,
                        kvf_last_error());
        } else {
                b->st.layer_events++;
        }
        pthread_mutex_unlock(&b->mu);
        return rc;
}

/* ---- per_chunk: a System V message queue, read blocking ---- */

static void *chunk_thread(void *arg)
{
        struct kvf_fd_bridge *b = arg;
        int prev_layer = -1;
        bool in_step = false;
        while (!__atomic_load_n(&b->stop, __ATOMIC_ACQUIRE)) {
                ssize_t n = msgrcv(b->msqid, &b->msg, sizeof(b->msg.mtext), 0, 0);
                if (n < 0) {
                        if (errno == EINTR)
                                continue;
                        /* The queue was removed (an engine restarting): make it again. */
                        pthread_mutex_lock(&b->mu);
                        b->st.errors++;
                        set_err(b, "msgrcv on queue key 0x%x: %s; making it again", b->cfg.msg_key,
                                strerror(errno));
                        pthread_mutex_unlock(&b->mu);
                        nap_us(100000);
                        int q = msgget(b->cfg.msg_key, IPC_CREAT | 0666);
                        if (q >= 0)
                                b->msqid = q;
                        continue;
                }
                if (b->msg.mtype == STOP_MTYPE)
                        continue; /* the loop condition says whether to stop */
                const int *t = b->msg.mtext;
                int count = n >= 8 ? t[0] : -1, layer = n >= 8 ? t[1] : -1;
                pthread_mutex_lock(&b->mu);
                b->st.signals++;
                if (count < 0 || count > KVF_FD_MAX_SLOTS ||
                    (size_t)n < (size_t)(2 + 3 * count) * 4 || layer < 0 ||
                    (unsigned)layer >= b->cfg.layers) {
                        b->st.bad_signals++;
                        set_err(
                            b,
                            "refused a layer message of %zd bytes: count %d, layer %d (%u layers)",
                            n, count, layer, b->cfg.layers);
                        pthread_mutex_unlock(&b->mu);
                        continue;
                }
                if (!in_step || layer <= prev_layer) {
                        /* A new forward pass: its chunks go in before its first layer-done, so
                         * the sender knows the blocks when the layer's event comes. */
                        in_step = true;
                        b->st.steps++;
                        b->st.kvf_step++;
                        for (int i = 0; i < count; i++) {
                                int slot = t[2 + 3 * i], before = t[3 + 3 * i], tok = t[4 + 3 * i];
                                if (slot < 0 || slot >= KVF_FD_MAX_SLOTS || before < 0 || tok < 0) {
                                        b->st.bad_signals++;
                                        set_err(b,
                                                "refused a chunk triple (slot %d, before %d, "
                                                "tokens %d)",
                                                slot, before, tok);
                                        continue;
                                }
                                slot_chunk(b, (unsigned)slot, b->st.kvf_step, (uint64_t)before,
                                           (uint64_t)tok);
                        }
                }
                prev_layer = layer;
                uint64_t step = b->st.kvf_step;
                pthread_mutex_unlock(&b->mu);
                publish(b, step, (uint32_t)layer);
        }
        return NULL;
}

/* ---- per_query: two int32 values in POSIX shared memory, polled ---- */

static int map_word(struct kvf_fd_bridge *b, const char *what, int32_t **out, char *err,
                    size_t errlen)
{
        char path[512];
        snprintf(path, sizeof(path), "%s/splitwise_complete_prefilled_%s_%u.%u",
                 b->cfg.shm_dir ? b->cfg.shm_dir : "/dev/shm", what, b->cfg.rank_id, b->cfg.device);
        int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        if (fd < 0) {
                snprintf(err, errlen, "open %s: %s", path, strerror(errno));
                return -errno;
        }
        struct stat sb;
        bool made = fstat(fd, &sb) == 0 && sb.st_size == 0;
        if (made && ftruncate(fd, 4) < 0) {
                int e = errno;
                snprintf(err, errlen, "size %s: %s", path, strerror(e));
                close(fd);
                return -e;
        }
        if (!made && sb.st_size < 4) {
                snprintf(err, errlen, "%s holds %lld bytes, not an int32", path,
                         (long long)sb.st_size);
                close(fd);
                return -EPROTO;
        }
        void *p = mmap(NULL, 4, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        int e = errno;
        close(fd);
        if (p == MAP_FAILED) {
                snprintf(err, errlen, "map %s: %s", path, strerror(e));
                return -e;
        }
        *out = p;
        if (made) /* what FastDeploy's messager leaves before the first step */
                __atomic_store_n(*out, -1, __ATOMIC_RELAXED);
        return 0;
}

static void *query_thread(void *arg)
{
        struct kvf_fd_bridge *b = arg;
        const int64_t M = KVF_FD_STEP_MODULO;
        unsigned poll_us = b->cfg.poll_us ? b->cfg.poll_us : 50;
        int32_t last_raw = __atomic_load_n(b->step_word, __ATOMIC_RELAXED);
        int32_t last_layer = __atomic_load_n(b->layer_word, __ATOMIC_RELAXED);
        /* After a step change, a layer value other than -1 read with the change may be the old
         * step's (the engine writes the step and then the -1): it counts once a -1 or another
         * value has been read, or once it has stood for STALE_STAND_NS. Only a whole step
         * written between two reads of this loop (50 µs apart at most) and nothing after it
         * needs the stand; an old value taken for the new step's sends blocks not written
         * yet, so the stand is long: an engine thread held up between its two stores (1 ms,
         * then 100 ms, then 1 s were the stand, and a test's engine, descheduled, outlasted
         * each) must not pass for a finished step. */
        bool trusted = true;
        uint64_t change_ns = 0;
        int32_t published = -1;
        unsigned idle = 0;
        while (!__atomic_load_n(&b->stop, __ATOMIC_ACQUIRE)) {
                /* Relaxed: the values are FastDeploy's plain stores from a CUDA host callback;
                 * the cache writes they announce were completed before the callback ran. Each
                 * must be one store: a writer that clears the bytes first (Python's
                 * struct.pack_into) passes through 0, which is a layer value (FASTDEPLOY.md). */
                int32_t s1 = __atomic_load_n(b->step_word, __ATOMIC_ACQUIRE);
                int32_t l = __atomic_load_n(b->layer_word, __ATOMIC_ACQUIRE);
                int32_t s2 = __atomic_load_n(b->step_word, __ATOMIC_ACQUIRE);
                if (s1 != s2)
                        continue;
                bool changed = false;
                pthread_mutex_lock(&b->mu);
                if (s1 != last_raw) {
                        if (s1 < 0 || s1 >= M) {
                                if (s1 != -1) {
                                        b->st.bad_signals++;
                                        set_err(b, "step value %d is outside 0..%lld", s1,
                                                (long long)M - 1);
                                }
                        } else {
                                int64_t prev = last_raw < 0 ? -1 : last_raw;
                                int64_t d = ((int64_t)s1 - prev) % M;
                                if (d <= 0)
                                        d += M;
                                if (b->unwrapped < 0 && last_raw < 0)
                                        d = (int64_t)s1 + 1; /* the first step seen */
                                b->unwrapped += d;
                                b->st.steps++;
                                b->st.fd_step = s1;
                                b->st.kvf_step = b->base + (uint64_t)(b->unwrapped + 1);
                                trusted = l == -1;
                                change_ns = now_ns();
                                published = -1;
                        }
                        last_raw = s1;
                        last_layer = l;
                        changed = true;
                } else if (l != last_layer) {
                        trusted = true;
                        last_layer = l;
                        changed = true;
                        b->st.signals++;
                } else if (!trusted && now_ns() - change_ns > STALE_STAND_NS) {
                        trusted = true;
                        changed = true;
                }
                uint64_t step = b->st.kvf_step;
                bool go = false;
                if (changed && trusted && l >= 0 && l > published && b->unwrapped >= 0) {
                        if ((unsigned)l >= b->cfg.layers) {
                                b->st.bad_signals++;
                                set_err(b, "layer value %d: this instance has %u layers", l,
                                        b->cfg.layers);
                        } else {
                                go = true;
                                published = l;
                        }
                }
                pthread_mutex_unlock(&b->mu);
                if (go)
                        publish(b, step, (uint32_t)l);
                if (changed) {
                        idle = 0;
                } else if (++idle > 2000) {
                        nap_us(poll_us);
                } else {
                        for (int i = 0; i < 16; i++)
                                kvf_cpu_relax();
                }
        }
        return NULL;
}

/* ---- the calls ---- */

int kvf_fd_bridge_start(struct kvf_client *c, const struct kvf_fd_bridge_config *cfg,
                        struct kvf_fd_bridge **out, char *err, size_t errlen)
{
        if (!c || !cfg || !out) {
                snprintf(err, errlen, "no client or configuration");
                return -EINVAL;
        }
        if (cfg->mode != KVF_FD_PER_QUERY && cfg->mode != KVF_FD_PER_CHUNK) {
                snprintf(err, errlen, "signal mode %d is neither per_query (1) nor per_chunk (2)",
                         cfg->mode);
                return -EINVAL;
        }
        if (cfg->layers == 0 || cfg->layers > 100000) {
                snprintf(err, errlen, "%u layers", cfg->layers);
                return -EINVAL;
        }
        struct kvf_fd_bridge *b = calloc(1, sizeof(*b));
        if (!b) {
                snprintf(err, errlen, "out of memory");
                return -ENOMEM;
        }
        b->c = c;
        b->cfg = *cfg;
        b->cfg.shm_dir = NULL; /* used only below, while the caller's string lives */
        b->msqid = -1;
        b->unwrapped = -1;
        b->st.fd_step = -1;
        b->base = kvf_last_step(c) + 1;
        b->st.kvf_step = b->base;
        pthread_mutex_init(&b->mu, NULL);
        int rc;
        if (cfg->mode == KVF_FD_PER_QUERY) {
                b->cfg.shm_dir = cfg->shm_dir;
                if ((rc = map_word(b, "step", &b->step_word, err, errlen)) < 0 ||
                    (rc = map_word(b, "layer", &b->layer_word, err, errlen)) < 0)
                        goto fail;
                b->cfg.shm_dir = NULL;
                int32_t s = __atomic_load_n(b->step_word, __ATOMIC_RELAXED);
                if (s >= 0 && s < KVF_FD_STEP_MODULO) {
                        /* The engine is past step s already: that one counts as seen. */
                        b->unwrapped = s;
                        b->st.fd_step = s;
                        b->st.kvf_step = b->base + (uint64_t)s + 1;
                }
        } else {
                b->msqid = msgget(cfg->msg_key, IPC_CREAT | 0666);
                if (b->msqid < 0) {
                        rc = -errno;
                        snprintf(err, errlen, "message queue key 0x%x: %s", cfg->msg_key,
                                 strerror(errno));
                        goto fail;
                }
                /* Messages a previous run left would name slots of requests long gone. */
                while (msgrcv(b->msqid, &b->msg, sizeof(b->msg.mtext), 0, IPC_NOWAIT) >= 0) {
                }
        }
        rc = -pthread_create(&b->thread, NULL,
                             cfg->mode == KVF_FD_PER_QUERY ? query_thread : chunk_thread, b);
        if (rc < 0) {
                snprintf(err, errlen, "start the bridge's thread: %s", strerror(-rc));
                goto fail;
        }
        b->started = true;
        *out = b;
        return 0;
fail:
        if (b->step_word)
                munmap(b->step_word, 4);
        if (b->layer_word)
                munmap(b->layer_word, 4);
        pthread_mutex_destroy(&b->mu);
        free(b);
        return rc;
}

void kvf_fd_bridge_stop(struct kvf_fd_bridge *b)
{
        if (!b)
                return;
        /* Release: pairs with the threads' acquire loads of stop. */
        __atomic_store_n(&b->stop, 1, __ATOMIC_RELEASE);
        if (b->started && b->cfg.mode == KVF_FD_PER_CHUNK) {
                struct {
                        long mtype;
                        int v;
                } m = {STOP_MTYPE, 0};
                /* Wakes msgrcv; should the queue be gone or full, the thread is left behind,
                 * blocked, and the process ends it (it touches nothing but the queue). */
                if (msgsnd(b->msqid, &m, sizeof(m.v), IPC_NOWAIT) < 0) {
                        pthread_detach(b->thread);
                        return;
                }
        }
        if (b->started)
                pthread_join(b->thread, NULL);
        if (b->step_word)
                munmap(b->step_word, 4);
        if (b->layer_word)
                munmap(b->layer_word, 4);
        pthread_mutex_destroy(&b->mu);
        free(b);
}

int64_t kvf_fd_bridge_step_of(struct kvf_fd_bridge *b, int64_t fd_step)
{
        const int64_t M = KVF_FD_STEP_MODULO;
        if (fd_step < 0 || fd_step >= M)
                return -EINVAL;
        pthread_mutex_lock(&b->mu);
        int64_t cur = b->unwrapped;
        int64_t base = (int64_t)b->base;
        pthread_mutex_unlock(&b->mu);
        int64_t d = ((fd_step - cur) % M + M) % M; /* forward distance */
        if (d > M / 2)
                d -= M;
        int64_t u = cur + d;
        if (u < -1)
                u = -1; /* before the first step the bridge counts: the first one */
        return base + u + 1;
}

struct task_args {
        struct kvf_fd_bridge *b;
        const void *buf;
        size_t len;
};

static int task_once(void *p)
{
        struct task_args *a = p;
        return kvf_submit_raw(a->b->c, KVF_TO_SENDER, KVF_REC_TASK, a->buf, a->len);
}

int kvf_fd_bridge_submit_slot(struct kvf_fd_bridge *b, unsigned slot, const char *request_id,
                              uint64_t need_tokens, const void *task, size_t len, size_t step_off)
{
        if (slot >= KVF_FD_MAX_SLOTS)
                return -ERANGE;
        if (!request_id || !request_id[0] || strlen(request_id) >= sizeof(b->slots[0].rid))
                return -EINVAL;
        if (!task || step_off + 9 > len || ((const uint8_t *)task)[step_off] != 0xcf)
                return -EINVAL;
        uint8_t *buf = malloc(len);
        if (!buf)
                return -ENOMEM;
        memcpy(buf, task, len);
        pthread_mutex_lock(&b->mu);
        struct slot *s = &b->slots[slot];
        if (s->active) {
                set_err(b, "slot %u: request %s is still there, %s refused", slot, s->rid,
                        request_id);
                pthread_mutex_unlock(&b->mu);
                free(buf);
                return -EBUSY;
        }
        bool adopt = s->have && !s->adopted;
        uint64_t step = adopt ? s->first_step : b->st.kvf_step + 1;
        for (int i = 0; i < 8; i++) /* msgpack uint64: big-endian */
                buf[step_off + 1 + i] = (uint8_t)(step >> (56 - 8 * i));
        struct task_args a = {b, buf, len};
        int rc = retry_full(task_once(&a), task_once, &a);
        if (rc < 0) {
                b->st.errors++;
                set_err(b, "task %s: %s", request_id, kvf_last_error());
                pthread_mutex_unlock(&b->mu);
                free(buf);
                return rc;
        }
        b->st.tasks++;
        snprintf(s->rid, sizeof(s->rid), "%s", request_id);
        s->active = true;
        s->need = need_tokens;
        if (adopt) {
                s->adopted = true;
                if (s->have_prev)
                        put_chunk(b, s, s->prev_step, s->prev_end);
                put_chunk(b, s, s->last_step, s->last_end);
        } else {
                s->fresh = true;
        }
        pthread_mutex_unlock(&b->mu);
        free(buf);
        return 0;
}

int kvf_fd_bridge_release_slot(struct kvf_fd_bridge *b, unsigned slot, const char *request_id)
{
        if (slot >= KVF_FD_MAX_SLOTS)
                return -ERANGE;
        pthread_mutex_lock(&b->mu);
        struct slot *s = &b->slots[slot];
        int rc = 0;
        if (s->active && request_id && !strcmp(s->rid, request_id))
                s->active = false;
        else
                rc = -ENOENT;
        pthread_mutex_unlock(&b->mu);
        return rc;
}

void kvf_fd_bridge_get_stats(struct kvf_fd_bridge *b, struct kvf_fd_bridge_stats *out)
{
        pthread_mutex_lock(&b->mu);
        *out = b->st;
        pthread_mutex_unlock(&b->mu);
}

void kvf_fd_bridge_error(struct kvf_fd_bridge *b, char *buf, size_t len)
{
        pthread_mutex_lock(&b->mu);
        snprintf(buf, len, "%s", b->err);
        pthread_mutex_unlock(&b->mu);
}
