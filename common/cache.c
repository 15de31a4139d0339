/* The list of cache backends, and what every backend shares (cache.h). */
#include "cache.h"

#include <errno.h>
#include <string.h>

#include "busguard.h"
#include "copy.h"
#include "err.h"
#include "layout.h"

/* Every backend built in: one line each. */
static const struct kvf_cache_backend *const backends[] = {
        &kvf_cache_host,
        &kvf_cache_host_async, /* a test backend: host memory, copies completed later */
        &kvf_cache_engine,     /* host memory the engine registered */
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

static int map_for(const struct kvf_ctl_header *h, bool writable, int device, bool lazy,
                   struct kvf_cache *out)
{
        memset(out, 0, sizeof(*out));
        out->device = device;
        out->lazy = lazy;
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
        return map_for(h, writable, -1, false, out);
}

int kvf_cache_map_peer(const struct kvf_ctl_header *h, bool writable, const struct kvf_cache *near,
                       struct kvf_cache *out)
{
        return map_for(h, writable, near ? near->device : -1, true, out);
}

void kvf_cache_unmap(struct kvf_cache *c)
{
        if (c->be)
                c->be->unmap(c);
        memset(c, 0, sizeof(*c));
}

int kvf_cache_copy_host(const struct kvf_copy_batch *b)
{
        /* The engine's caches may be GPU memory under the engine backend's id: never memcpy
         * into a device pointer. */
        if (!b->src->host && b->src->parts)
                return kvf_err_set(-EXDEV, "a host copy from GPU memory (the engine's caches)");
        for (uint32_t i = 0; i < b->ndst; i++)
                if (!b->dst[i]->host && b->dst[i]->parts)
                        return kvf_err_set(-EXDEV, "a host copy into GPU memory (the engine's caches of "
                                           "a peer): both sides' caches must be of one kind");
        /* A mapping whose file shrank (the engine's caches) faults: that copy fails, the
         * process lives (busguard.h). Nothing read after the jump changed since sigsetjmp. */
        struct kvf_busguard g;
        kvf_busguard_enter(&g);
        if (sigsetjmp(g.jb, 0)) {
                kvf_busguard_leave(&g);
                return kvf_err_set(-EFAULT,
                                   "a copy of %u runs touched %p, past the end of its cache's file: "
                                   "the engine's region file shrank after it was registered (seal it "
                                   "against shrinking, F_SEAL_SHRINK, as kvferry.host_buffer does, and "
                                   "register again)",
                                   b->nruns, kvf_busguard_addr());
        }
        for (uint32_t i = 0; i < b->nruns; i++) {
                const struct kvf_copy_run *r = &b->runs[i];
                const struct kvf_cache *d = b->dst[r->dst];
                uint64_t so = r->src_off, dof = r->dst_off, left = r->bytes;
                while (left) {
                        uint64_t n = left, cs = kvf_cache_contig(b->src, so), cd = kvf_cache_contig(d, dof);
                        n = n < cs ? n : cs;
                        n = n < cd ? n : cd;
                        if (n == 0) {
                                kvf_busguard_leave(&g);
                                return kvf_err_set(-EIO, "copy of %llu bytes at %llu to %llu: %s cache not mapped "
                                                   "there (the engine's caches were dropped?)",
                                                   (unsigned long long)left, (unsigned long long)so,
                                                   (unsigned long long)dof, cs == 0 ? "the source" : "the destination");
                        }
                        kvf_copy_stream(kvf_cache_addr(d, dof), kvf_cache_addr(b->src, so), n);
                        so += n, dof += n, left -= n;
                }
        }
        kvf_busguard_leave(&g);
        /* The streamed stores are visible before anything that says the bytes are there. */
        kvf_copy_fence();
        return 0;
}

bool kvf_cache_backends_compatible(uint32_t a, uint32_t b)
{
        bool ha = a == KVF_BACKEND_HOST || a == KVF_BACKEND_ENGINE;
        bool hb = b == KVF_BACKEND_HOST || b == KVF_BACKEND_ENGINE;
        return a == b || (ha && hb);
}
