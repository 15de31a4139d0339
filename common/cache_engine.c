/*
 * The engine's caches: host memory the engine allocated and registered
 * (kvf_register_caches). The allocator makes none; it holds the registration
 * (allocator/registry.c) and every role maps it from there
 * (registration.c). A (layer, tensor) is a view: its own address and block
 * stride, so copies are split where blocks are not back to back.
 */
#include <errno.h>

#include "cache.h"
#include "registration.h"

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

const struct kvf_cache_backend kvf_cache_engine = {
        .name = "engine",
        .id = KVF_BACKEND_ENGINE,
        .create = engine_create,
        .destroy = engine_destroy,
        .map = engine_map,
        .unmap = kvf_reg_unmap,
        .copy_submit = engine_copy_submit,
        .copy_poll = engine_copy_poll,
};
