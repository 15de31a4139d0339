/*
 * The engine's caches: host memory the engine allocated and registered
 * (kvf_register_caches). The allocator makes none; it holds the registration
 * (allocator/registry.c) and every role maps it from there
 * (registration.c). A (layer, tensor) is a view: its own address and block
 * stride, so copies are split where blocks are not back to back.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cache.h"
#include "err.h"
#include "registration.h"

/* Held for reading by every staged copy (a connection thread's), for writing while a mapping
 * is replaced: one per process, which maps one engine's caches of its own at most (a sender's
 * peers are copied by its one thread, outside staging). */
static pthread_rwlock_t map_lock = PTHREAD_RWLOCK_INITIALIZER;

static int remap(struct kvf_cache *c)
{
        uint64_t was = c->reg_gen;
        kvf_reg_unmap(c);
        int rc = kvf_reg_map(c->reg_hdr, c->writable, c);
        if (rc < 0)
                c->reg_gen = was; /* (tried again at the next use) */
        return rc < 0 ? rc : 1;
}

int kvf_cache_refresh(struct kvf_cache *c)
{
        if (!c->be || c->be->id != KVF_BACKEND_ENGINE || !c->reg_hdr ||
            !kvf_reg_stale(c->reg_hdr, c))
                return 0;
        pthread_rwlock_wrlock(&map_lock);
        int rc = kvf_reg_stale(c->reg_hdr, c) ? remap(c) : 0;
        pthread_rwlock_unlock(&map_lock);
        return rc;
}

static int engine_create(struct kvf_ctl_header *h, const struct kvf_cache_opts *o)
{
        (void)o;
        h->reg_generation = 0; /* waiting for the engine's caches */
        return 0;
}

static void engine_destroy(const struct kvf_ctl_header *h)
{
        (void)h;
}

static int engine_map(const struct kvf_ctl_header *h, bool writable, struct kvf_cache *out)
{
        return kvf_reg_map(h, writable, out);
}

static int engine_copy_submit(const struct kvf_copy_batch *b, uint64_t *ticket)
{
        *ticket = 0;
        return kvf_cache_copy_host(b);
}

static int engine_copy_poll(struct kvf_cache *src, uint64_t ticket)
{
        (void)src;
        (void)ticket;
        return 1;
}

/* ---- staged io: the connector's tcp threads gather and scatter strided blocks with memcpy
 * into staging buffers, so that no pointer into a mapping outlives the lock (a registration
 * may be replaced while a connection thread runs) ---- */

struct stage_eng {
        struct kvf_cache *c;
        uint64_t ticket;
};

static int stage_open(struct kvf_cache *c, void **eng)
{
        struct stage_eng *e = calloc(1, sizeof(*e));
        if (!e)
                return kvf_err_set(-ENOMEM, "out of memory");
        e->c = c;
        *eng = e;
        return 0;
}

static void stage_close(void *eng)
{
        free(eng);
}

static int stage_buf_alloc(void *eng, uint64_t bytes, uint8_t **out)
{
        (void)eng;
        void *p = NULL;
        if (posix_memalign(&p, 4096, bytes) != 0)
                return kvf_err_set(-ENOMEM, "out of memory for a staging buffer of %llu bytes",
                                   (unsigned long long)bytes);
        *out = p;
        return 0;
}

static void stage_buf_free(void *eng, uint8_t *p)
{
        (void)eng;
        free(p);
}

static int stage_copy(void *eng, bool to_cache, uint8_t *buf, const struct kvf_copy_run *runs,
                      unsigned n, uint64_t *ticket)
{
        struct stage_eng *e = eng;
        struct kvf_cache *c = e->c;
        int rc = 0;
        if (c->reg_hdr && kvf_reg_stale(c->reg_hdr, c))
                (void)kvf_cache_refresh(c);
        pthread_rwlock_rdlock(&map_lock);
        for (unsigned i = 0; rc == 0 && i < n; i++) {
                uint64_t off = to_cache ? runs[i].dst_off : runs[i].src_off;
                uint8_t *b = buf + (to_cache ? runs[i].src_off : runs[i].dst_off);
                uint64_t left = runs[i].bytes;
                while (left) {
                        uint64_t k = kvf_cache_contig(c, off);
                        if (k == 0) {
                                rc = kvf_err_set(
                                    -EIO,
                                    "the engine's caches are not mapped here (not registered, "
                                    "or dropped with their engine)");
                                break;
                        }
                        k = k < left ? k : left;
                        if (to_cache)
                                memcpy(kvf_cache_addr(c, off), b, k);
                        else
                                memcpy(b, kvf_cache_addr(c, off), k);
                        off += k, b += k, left -= k;
                }
        }
        pthread_rwlock_unlock(&map_lock);
        *ticket = ++e->ticket;
        return rc;
}

static int stage_poll(void *eng, uint64_t ticket)
{
        (void)eng;
        (void)ticket;
        return 1; /* copied before stage_copy returned */
}

static const struct kvf_stage_ops stage_ops = {
    .open = stage_open,
    .close = stage_close,
    .buf_alloc = stage_buf_alloc,
    .buf_free = stage_buf_free,
    .copy = stage_copy,
    .poll = stage_poll,
};

const struct kvf_cache_backend kvf_cache_engine = {
    .name = "engine",
    .id = KVF_BACKEND_ENGINE,
    .create = engine_create,
    .destroy = engine_destroy,
    .map = engine_map,
    .unmap = kvf_reg_unmap,
    .copy_submit = engine_copy_submit,
    .copy_poll = engine_copy_poll,
    .stage = &stage_ops,
};
