/*
 * A test backend: host memory like the host backend, but copies complete
 * later, on a worker thread, a little after they were submitted, the way a
 * GPU kernel returns before its copy lands. It exists to run the sender's
 * copies-in-flight path end to end where no GPU is (tests/e2e_test.sh), and the
 * connector's staged io the way a GPU cache needs it (tests/staged_tcp_test.sh); and to
 * show that a backend is one file plus one line in cache.c.
 *
 * KVFERRY_ASYNC_DELAY_US (default 200) delays each batch; KVFERRY_ASYNC_FAIL_EVERY=N fails
 * every Nth batch with -EIO (nothing copied), to exercise the error path.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "atomics.h"
#include "cache.h"
#include "clock.h"
#include "copy.h"
#include "err.h"

#define QUEUE 256u
/* A full queue waits for the worker this long before the batch is refused, as the GPU copier's
 * full slots do (cache_cuda.c): a worker thread the scheduler holds up is no failed copy. */
#define FULL_WAIT_NS 2000000000ull

struct job {
        struct kvf_copy_run *runs;
        uint32_t nruns;
        uint8_t *src;
        uint8_t *dst[64];
        uint64_t due_ns;
        bool fail;
};

struct async {
        pthread_mutex_t mu;
        pthread_cond_t cv;
        pthread_t worker;
        struct job q[QUEUE];
        uint64_t submitted, done; /* tickets are 1.. submitted; done <= submitted, atomic */
        uint64_t failed[QUEUE];  /* ticket of a failed job, by slot */
        uint64_t delay_ns, fail_every;
        bool started, stop;
};

static void *worker(void *arg)
{
        struct async *a = arg;
        pthread_mutex_lock(&a->mu);
        while (!a->stop) {
                uint64_t next = a->done + 1;
                if (next > a->submitted) {
                        pthread_cond_wait(&a->cv, &a->mu);
                        continue;
                }
                struct job *j = &a->q[next % QUEUE];
                pthread_mutex_unlock(&a->mu);
                uint64_t now = kvf_now_ns();
                if (j->due_ns > now)
                        kvf_sleep_ns(j->due_ns - now);
                if (!j->fail)
                        for (uint32_t i = 0; i < j->nruns; i++)
                                kvf_copy_stream(j->dst[j->runs[i].dst] + j->runs[i].dst_off,
                                                j->src + j->runs[i].src_off, j->runs[i].bytes);
                kvf_copy_fence();
                pthread_mutex_lock(&a->mu);
                free(j->runs);
                j->runs = NULL;
                a->failed[next % QUEUE] = j->fail ? next : 0;
                /* Release: the copied bytes before the ticket reads done (poll's acquire). */
                kvf_store_release(&a->done, next);
        }
        pthread_mutex_unlock(&a->mu);
        return NULL;
}

static struct async *async_new(void)
{
        struct async *a = calloc(1, sizeof(*a));
        if (!a)
                return NULL;
        pthread_mutex_init(&a->mu, NULL);
        pthread_cond_init(&a->cv, NULL);
        const char *d = getenv("KVFERRY_ASYNC_DELAY_US"), *f = getenv("KVFERRY_ASYNC_FAIL_EVERY");
        a->delay_ns = (d ? strtoull(d, NULL, 10) : 200) * 1000ull;
        a->fail_every = f ? strtoull(f, NULL, 10) : 0;
        return a;
}

static void async_free(struct async *a)
{
        if (!a)
                return;
        pthread_mutex_lock(&a->mu);
        a->stop = true;
        pthread_cond_broadcast(&a->cv);
        pthread_mutex_unlock(&a->mu);
        if (a->started)
                pthread_join(a->worker, NULL);
        for (unsigned i = 0; i < QUEUE; i++)
                free(a->q[i].runs);
        pthread_cond_destroy(&a->cv);
        pthread_mutex_destroy(&a->mu);
        free(a);
}

static int async_map(const struct kvf_ctl_header *h, bool writable, struct kvf_cache *out)
{
        int rc = kvf_cache_host.map(h, writable, out);
        if (rc < 0)
                return rc;
        struct async *a = async_new();
        if (!a) {
                kvf_cache_host.unmap(out);
                return kvf_err_set(-ENOMEM, "out of memory");
        }
        out->priv = a;
        return 0;
}

static void async_unmap(struct kvf_cache *c)
{
        async_free(c->priv);
        kvf_cache_host.unmap(c);
}

/* Queue the copy of runs (copied here) from src to dst[]; *ticket names it. */
static int queue_job(struct async *a, uint8_t *src, uint8_t *const *dst, uint32_t ndst,
                     const struct kvf_copy_run *r, uint32_t nruns, uint64_t *ticket)
{
        if (ndst > 64)
                return kvf_err_set(-EINVAL, "host-async: %u destinations in one batch, at most 64", ndst);
        struct kvf_copy_run *runs = malloc((nruns ? nruns : 1) * sizeof(*runs));
        if (!runs)
                return kvf_err_set(-ENOMEM, "host-async: out of memory for %u runs", nruns);
        memcpy(runs, r, nruns * sizeof(*runs));
        pthread_mutex_lock(&a->mu);
        if (!a->started && pthread_create(&a->worker, NULL, worker, a) == 0)
                a->started = true;
        for (uint64_t until = kvf_now_ns() + FULL_WAIT_NS;
             a->started && a->submitted - a->done >= QUEUE - 1 && kvf_now_ns() < until;) {
                pthread_mutex_unlock(&a->mu);
                kvf_sleep_ns(10000);
                pthread_mutex_lock(&a->mu);
        }
        if (!a->started || a->submitted - a->done >= QUEUE - 1) {
                pthread_mutex_unlock(&a->mu);
                free(runs);
                return kvf_err_set(-EAGAIN, "host-async: %s", a->started ? "queue full for 2 s" : "no worker thread");
        }
        uint64_t t = ++a->submitted;
        struct job *j = &a->q[t % QUEUE];
        j->runs = runs;
        j->nruns = nruns;
        j->src = src;
        for (uint32_t i = 0; i < ndst; i++)
                j->dst[i] = dst[i];
        j->due_ns = kvf_now_ns() + a->delay_ns;
        j->fail = a->fail_every && t % a->fail_every == 0;
        pthread_cond_signal(&a->cv);
        pthread_mutex_unlock(&a->mu);
        *ticket = t;
        return 0;
}

static int async_submit(const struct kvf_copy_batch *b, uint64_t *ticket)
{
        uint8_t *dst[64];
        for (uint32_t i = 0; i < b->ndst && i < 64; i++)
                dst[i] = b->dst[i]->base;
        return queue_job(b->src->priv, b->src->base, dst, b->ndst, b->runs, b->nruns, ticket);
}

static int poll_ticket(struct async *a, uint64_t ticket)
{
        if (kvf_load_acquire(&a->done) < ticket)
                return 0;
        pthread_mutex_lock(&a->mu);
        bool failed = a->failed[ticket % QUEUE] == ticket;
        pthread_mutex_unlock(&a->mu);
        if (failed)
                return kvf_err_set(-EIO, "host-async: copy batch %llu failed (KVFERRY_ASYNC_FAIL_EVERY)",
                                   (unsigned long long)ticket);
        return 1;
}

static int async_poll(struct kvf_cache *src, uint64_t ticket)
{
        return poll_ticket(src->priv, ticket);
}

/* ---- staged io (cache_stage.c): a worker of its own per connection thread, over malloc'd
 * buffers, so the tcp path's waits matter here as they do on a GPU and a test sees one missing. */

struct stage_eng {
        struct async *a;
        uint8_t *base;
};

static int stage_open(struct kvf_cache *c, void **eng)
{
        struct stage_eng *e = calloc(1, sizeof(*e));
        if (!e || !(e->a = async_new())) {
                free(e);
                return kvf_err_set(-ENOMEM, "host-async: out of memory for a stager");
        }
        e->base = c->base;
        *eng = e;
        return 0;
}

static void stage_close(void *eng)
{
        struct stage_eng *e = eng;
        async_free(e->a); /* after the job in progress; queued ones are dropped, as a dead context's */
        free(e);
}

static int stage_buf_alloc(void *eng, uint64_t bytes, uint8_t **out)
{
        (void)eng;
        *out = malloc(bytes);
        return *out ? 0 : kvf_err_set(-ENOMEM, "host-async: no staging buffer of %llu bytes",
                                      (unsigned long long)bytes);
}

static void stage_buf_free(void *eng, uint8_t *p)
{
        (void)eng;
        free(p);
}

static int stage_copy(void *eng, bool to_cache, uint8_t *buf, const struct kvf_copy_run *runs, unsigned n,
                      uint64_t *ticket)
{
        struct stage_eng *e = eng;
        uint8_t *dst = to_cache ? e->base : buf;
        return queue_job(e->a, to_cache ? buf : e->base, &dst, 1, runs, n, ticket);
}

static int stage_poll(void *eng, uint64_t ticket)
{
        return poll_ticket(((struct stage_eng *)eng)->a, ticket);
}

static const struct kvf_stage_ops stage_ops = {
        .open = stage_open,
        .close = stage_close,
        .buf_alloc = stage_buf_alloc,
        .buf_free = stage_buf_free,
        .copy = stage_copy,
        .poll = stage_poll,
};

static int async_create(struct kvf_ctl_header *h, const struct kvf_cache_opts *o)
{
        return kvf_cache_host.create(h, o);
}

static void async_destroy(const struct kvf_ctl_header *h)
{
        kvf_cache_host.destroy(h);
}

const struct kvf_cache_backend kvf_cache_host_async = {
        .name = "host-async",
        .id = KVF_BACKEND_HOST_ASYNC,
        .create = async_create,
        .destroy = async_destroy,
        .map = async_map,
        .unmap = async_unmap,
        .copy_submit = async_submit,
        .copy_poll = async_poll,
        .stage = &stage_ops,
};
