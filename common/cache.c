/* The list of cache backends, and what every backend shares (cache.h). */
#include "cache.h"

#include <errno.h>
#include <string.h>

#include "err.h"
#include "layout.h"

/* Every backend built in: one line each. */
static const struct kvf_cache_backend *const backends[] = {
        &kvf_cache_host,
        &kvf_cache_host_async, /* a test backend: host memory, copies completed later */
#ifdef KVF_HAVE_CUDA
        &kvf_cache_cuda,
#endif
};
#define NBACKENDS (sizeof(backends) / sizeof(backends[0]))

const char *kvf_cache_backend_names(void)
{
        static char names[128];
        if (!names[0])
                for (unsigned i = 0; i < NBACKENDS; i++) {
                        if (i)
                                strncat(names, ", ", sizeof(names) - strlen(names) - 1);
                        strncat(names, backends[i]->name, sizeof(names) - strlen(names) - 1);
                }
        return names;
}

const struct kvf_cache_backend *kvf_cache_backend(uint32_t id)
{
        for (unsigned i = 0; i < NBACKENDS; i++)
                if (backends[i]->id == id)
                        return backends[i];
        kvf_err_set(-EPROTO, "cache backend %u is not in this build (it has %s)", id, kvf_cache_backend_names());
        return NULL;
}

const struct kvf_cache_backend *kvf_cache_backend_named(const char *name)
{
        for (unsigned i = 0; i < NBACKENDS; i++)
                if (!strcmp(backends[i]->name, name))
                        return backends[i];
        kvf_err_set(-EINVAL, "no cache backend '%s' (this build has %s)", name, kvf_cache_backend_names());
        return NULL;
}

int kvf_cache_gpus(void)
{
#ifdef KVF_HAVE_CUDA
        return kvf_cache_cuda_gpus();
#else
        kvf_err_set(0, "this build has no CUDA (nvcc was not found when it was built)");
        return 0;
#endif
}

int kvf_cache_create(struct kvf_ctl_header *h, const struct kvf_cache_opts *o)
{
        const struct kvf_cache_backend *be = kvf_cache_backend(h->backend);
        return be ? be->create(h, o) : -EPROTO;
}

void kvf_cache_destroy(const struct kvf_ctl_header *h)
{
        const struct kvf_cache_backend *be = kvf_cache_backend(h->backend);
        if (be)
                be->destroy(h);
}

static int map_for(const struct kvf_ctl_header *h, bool writable, int device, struct kvf_cache *out)
{
        memset(out, 0, sizeof(*out));
        out->device = device;
        const struct kvf_cache_backend *be = kvf_cache_backend(h->backend);
        if (!be)
                return kvf_err_ctx(-EPROTO, "instance '%s'", h->instance);
        out->be = be;
        out->layout = h->layout;
        out->bytes = h->layout.cache_bytes;
        out->writable = writable;
        int rc = be->map(h, writable, out);
        if (rc < 0)
                memset(out, 0, sizeof(*out));
        return rc;
}

int kvf_cache_map(const struct kvf_ctl_header *h, bool writable, struct kvf_cache *out)
{
        return map_for(h, writable, -1, out);
}

int kvf_cache_map_peer(const struct kvf_ctl_header *h, bool writable, const struct kvf_cache *near,
                       struct kvf_cache *out)
{
        return map_for(h, writable, near ? near->device : -1, out);
}

void kvf_cache_unmap(struct kvf_cache *c)
{
        if (c->be)
                c->be->unmap(c);
        memset(c, 0, sizeof(*c));
}
