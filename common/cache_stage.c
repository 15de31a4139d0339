/*
 * Staged io (cache.h): a connection thread's ring of staging buffers over a
 * backend's copy engine, for caches the CPU does not reach (GPU memory).
 *
 * Why a ring, and why groups: a tcp connection moves up to 4 MiB per batch;
 * a copy per frame waited for on the calling thread (the first design) cost
 * a launch and a synchronisation per 16 KiB block, and left the GPU idle
 * while the network moved bytes and the network idle while the GPU copied.
 * Here a group (a send batch, a received frame) is one copy launch, the
 * thread waits only when it needs the bytes (before a send; before it marks
 * a received run landed), and up to KVF_STAGE_SLOTS buffers are in use at
 * once, so the next batch's copy runs while this one is on the wire.
 *
 * A slot holds groups one after another until the next one does not fit;
 * it is filled again once every group in it is done (kvf_stage_done, or
 * kvf_stage_in_end) and its last copy landed. Tickets of one engine land in
 * order, so a slot's last ticket stands for all of its copies.
 */
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>

#include "cache.h"
#include "clock.h"
#include "err.h"

#define WAIT_MAX_NS 2000000000ull /* a copy not landed by then has failed */
#define WAIT_YIELD_NS 200000ull   /* a group's copy takes tens of microseconds: yield until
                                   * then, sleep after (a busy engine can hold the GPU for
                                   * milliseconds without MPS) */

struct slot {
        uint8_t *buf;
        uint64_t used;   /* bytes placed since the slot was last emptied */
        uint64_t ticket; /* the last copy into or out of it (0: none) */
        unsigned groups; /* placed and not yet done */
};

struct kvf_stager {
        struct kvf_cache *c;
        const struct kvf_stage_ops *ops;
        void *eng;
        unsigned cur; /* the slot groups go into */
        struct slot slot[KVF_STAGE_SLOTS];
};

int kvf_stager_open(struct kvf_cache *c, struct kvf_stager **out)
{
        *out = NULL;
        if (!c->be->stage)
                return 0;
        struct kvf_stager *s = calloc(1, sizeof(*s));
        if (!s)
                return kvf_err_set(-ENOMEM, "out of memory for a stager");
        s->c = c;
        s->ops = c->be->stage;
        /* This thread waits for copies of tens to hundreds of microseconds (kvf_stage_wait):
         * its short sleeps should not be stretched by the default 50 us timer slack. */
        prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
        int rc = s->ops->open(c, &s->eng);
        if (rc < 0) {
                free(s);
                return rc;
        }
        *out = s;
        return 0;
}

void kvf_stager_close(struct kvf_stager *s)
{
        if (!s)
                return;
        s->ops->close(s->eng); /* first: no copy may still use a buffer */
        for (unsigned i = 0; i < KVF_STAGE_SLOTS; i++)
                if (s->slot[i].buf)
                        s->ops->buf_free(s->eng, s->slot[i].buf);
        free(s);
}

/* The runs are in the cache; a staged group also fits a staging buffer (in place: any size). */
static int check(const struct kvf_cache *c, bool staged, const struct kvf_io_run *r, unsigned n,
                 uint64_t *bytes)
{
        uint64_t sum = 0;
        if (staged && n > KVF_STAGE_RUNS)
                return kvf_err_set(-E2BIG, "%u runs in one staged group, at most %u", n,
                                   KVF_STAGE_RUNS);
        for (unsigned i = 0; i < n; i++) {
                if (r[i].off > c->bytes || r[i].len > c->bytes - r[i].off)
                        return kvf_err_set(-ERANGE, "bytes [%llu, +%llu) are outside the cache",
                                           (unsigned long long)r[i].off,
                                           (unsigned long long)r[i].len);
                sum += r[i].len;
        }
        if (staged && sum > KVF_STAGE_BYTES)
                return kvf_err_set(-E2BIG, "a staged group of %llu bytes, at most %u",
                                   (unsigned long long)sum, KVF_STAGE_BYTES);
        *bytes = sum;
        return 0;
}

/* Place `bytes` in the current slot, or the next one once it is free; sets the runs' p. */
static int place(struct kvf_stager *s, struct kvf_io_run *r, unsigned n, uint64_t bytes,
                 unsigned *group)
{
        struct slot *sl = &s->slot[s->cur];
        if (sl->used + bytes > KVF_STAGE_BYTES) {
                unsigned next = (s->cur + 1) % KVF_STAGE_SLOTS;
                struct slot *ns = &s->slot[next];
                if (ns->groups)
                        return kvf_err_set(-EBUSY,
                                           "every staging buffer is in use (%u groups held)",
                                           KVF_STAGE_SLOTS);
                int rc = kvf_stage_wait(s, ns->ticket, true);
                if (rc < 0)
                        return rc;
                ns->ticket = 0;
                ns->used = 0;
                s->cur = next;
                sl = ns;
        }
        if (!sl->buf) {
                int rc = s->ops->buf_alloc(s->eng, KVF_STAGE_BYTES, &sl->buf);
                if (rc < 0)
                        return rc;
        }
        for (unsigned i = 0; i < n; i++) {
                r[i].p = sl->buf + sl->used;
                sl->used += r[i].len;
        }
        sl->groups++;
        *group = s->cur;
        return 0;
}

/* Queue the copies of a group placed in slot `group`, and make them the slot's last. */
static int copy_group(struct kvf_stager *s, bool to_cache, const struct kvf_io_run *r, unsigned n,
                      unsigned group, uint64_t *ticket)
{
        struct kvf_copy_run runs[KVF_STAGE_RUNS];
        uint8_t *buf = s->slot[group].buf;
        for (unsigned i = 0; i < n; i++) {
                uint64_t b = (uint64_t)(r[i].p - buf);
                runs[i] = (struct kvf_copy_run){.src_off = to_cache ? b : r[i].off,
                                                .dst_off = to_cache ? r[i].off : b, .bytes = r[i].len};
        }
        int rc = s->ops->copy(s->eng, to_cache, buf, runs, n, ticket);
        if (rc == 0)
                s->slot[group].ticket = *ticket;
        return rc;
}

static int in_place(struct kvf_cache *c, struct kvf_io_run *r, unsigned n)
{
        uint64_t bytes;
        int rc = check(c, false, r, n, &bytes);
        for (unsigned i = 0; rc == 0 && i < n; i++)
                r[i].p = c->base + r[i].off;
        return rc;
}

int kvf_stage_out(struct kvf_cache *c, struct kvf_stager *s, struct kvf_io_run *runs, unsigned n,
                  uint64_t *ticket, unsigned *group)
{
        uint64_t bytes;
        *ticket = 0;
        *group = 0;
        if (!s)
                return in_place(c, runs, n);
        int rc = check(c, true, runs, n, &bytes);
        if (rc < 0 || (rc = place(s, runs, n, bytes, group)) < 0)
                return rc;
        if ((rc = copy_group(s, false, runs, n, *group, ticket)) < 0)
                s->slot[*group].groups--;
        return rc;
}

int kvf_stage_in_begin(struct kvf_cache *c, struct kvf_stager *s, struct kvf_io_run *runs,
                       unsigned n, unsigned *group)
{
        uint64_t bytes;
        *group = 0;
        if (!s)
                return in_place(c, runs, n);
        int rc = check(c, true, runs, n, &bytes);
        return rc < 0 ? rc : place(s, runs, n, bytes, group);
}

int kvf_stage_in_end(struct kvf_stager *s, const struct kvf_io_run *runs, unsigned n,
                     unsigned group, uint64_t *ticket)
{
        *ticket = 0;
        if (!s)
                return 0;
        int rc = copy_group(s, true, runs, n, group, ticket);
        kvf_stage_done(s, group);
        return rc;
}

void kvf_stage_done(struct kvf_stager *s, unsigned group)
{
        if (s && group < KVF_STAGE_SLOTS && s->slot[group].groups)
                s->slot[group].groups--;
}

int kvf_stage_wait(struct kvf_stager *s, uint64_t ticket, bool block)
{
        if (!s || !ticket)
                return 1;
        uint64_t start = kvf_now_ns(), waited;
        for (;;) {
                int rc = s->ops->poll(s->eng, ticket);
                if (rc != 0 || !block)
                        return rc;
                if ((waited = kvf_now_ns() - start) > WAIT_MAX_NS)
                        return kvf_err_set(-EIO, "a staging copy did not complete in 2 s");
                if (waited < WAIT_YIELD_NS)
                        sched_yield();
                else
                        kvf_sleep_ns(5000);
        }
}
