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

#include "busguard.h"
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

void kvf_cache_hold(struct kvf_cache *c)
{
        if (c->be && c->be->id == KVF_BACKEND_ENGINE)
                pthread_rwlock_rdlock(&map_lock);
}

void kvf_cache_release(struct kvf_cache *c)
{
        if (c->be && c->be->id == KVF_BACKEND_ENGINE)
                pthread_rwlock_unlock(&map_lock);
}

static int engine_create(struct kvf_ctl_header *h, const struct kvf_cache_opts *o)
{
        (void)o;
        h->reg_generation = 0; /* waiting for the engine's caches */
        if (!h->reg_gpu)
                return 0;
#ifdef KVF_HAVE_CUDA
        /* GPU memory: registrations must be on this GPU, named by its UUID (numbers differ
         * between processes with CUDA_VISIBLE_DEVICES). */
        if (kvf_cache_cuda_gpus() <= (int)h->device)
                return kvf_err_set(-ENODEV, "--caches engine --backend cuda: no GPU %u here", h->device);
        if (kvf_cache_cuda_uuid((int)h->device, h->cuda_uuid) < 0)
                return kvf_err_set(-ENODEV, "--caches engine --backend cuda: the UUID of GPU %u: %s",
                                   h->device, kvf_err_msg());
        return 0;
#else
        return kvf_err_set(-ENOTSUP, "--caches engine --backend cuda: this build has no CUDA");
#endif
}

static void engine_destroy(const struct kvf_ctl_header *h)
{
        (void)h;
}

static int engine_map(const struct kvf_ctl_header *h, bool writable, struct kvf_cache *out)
{
        return kvf_reg_map(h, writable, out);
}

#ifdef KVF_HAVE_CUDA
/* GPU memory (an instance of --backend cuda): the cuda backend's kernels, which complete
 * later; host memory: memcpy, done before this returns. */
static bool on_gpu(const struct kvf_cache *c)
{
        return !c->host && c->priv && c->device >= 0;
}
#endif

static int engine_copy_submit(const struct kvf_copy_batch *b, uint64_t *ticket)
{
        *ticket = 0;
#ifdef KVF_HAVE_CUDA
        if (on_gpu(b->src))
                return kvf_cache_cuda.copy_submit(b, ticket);
#endif
        return kvf_cache_copy_host(b);
}

static int engine_copy_poll(struct kvf_cache *src, uint64_t ticket)
{
#ifdef KVF_HAVE_CUDA
        if (on_gpu(src) && ticket)
                return kvf_cache_cuda.copy_poll(src, ticket);
#endif
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
        void *gpu; /* GPU caches: the cuda backend's staging (pinned buffers, kernels) */
};

static int stage_open(struct kvf_cache *c, void **eng)
{
        struct stage_eng *e = calloc(1, sizeof(*e));
        if (!e)
                return kvf_err_set(-ENOMEM, "out of memory");
        e->c = c;
        if (c->reg_hdr && c->reg_hdr->reg_gpu) {
#ifdef KVF_HAVE_CUDA
                int rc = kvf_cache_cuda_stage_ops.open(c, &e->gpu);
#else
                int rc = kvf_err_set(-ENOTSUP, "the engine's caches of '%s' are GPU memory and this "
                                     "build has no CUDA", c->reg_hdr->instance);
#endif
                if (rc < 0) {
                        free(e);
                        return rc;
                }
        }
        *eng = e;
        return 0;
}

static void stage_close(void *eng)
{
        struct stage_eng *e = eng;
#ifdef KVF_HAVE_CUDA
        if (e->gpu)
                kvf_cache_cuda_stage_ops.close(e->gpu);
#endif
        free(e);
}

static int stage_buf_alloc(void *eng, uint64_t bytes, uint8_t **out)
{
#ifdef KVF_HAVE_CUDA
        struct stage_eng *e = eng;
        if (e->gpu)
                return kvf_cache_cuda_stage_ops.buf_alloc(e->gpu, bytes, out);
#else
        (void)eng;
#endif
        void *p = NULL;
        if (posix_memalign(&p, 4096, bytes) != 0)
                return kvf_err_set(-ENOMEM, "out of memory for a staging buffer of %llu bytes",
                                   (unsigned long long)bytes);
        *out = p;
        return 0;
}

static void stage_buf_free(void *eng, uint8_t *p)
{
#ifdef KVF_HAVE_CUDA
        struct stage_eng *e = eng;
        if (e->gpu) {
                kvf_cache_cuda_stage_ops.buf_free(e->gpu, p);
                return;
        }
#else
        (void)eng;
#endif
        free(p);
}

/* Host memory: the runs between the mapping and the staging buffer, with memcpy. */
static int host_runs(struct kvf_cache *c, bool to_cache, uint8_t *buf, const struct kvf_copy_run *runs,
                     unsigned n)
{
        for (unsigned i = 0; i < n; i++) {
                uint64_t off = to_cache ? runs[i].dst_off : runs[i].src_off;
                uint8_t *b = buf + (to_cache ? runs[i].src_off : runs[i].dst_off);
                uint64_t left = runs[i].bytes;
                while (left) {
                        uint64_t k = kvf_cache_contig(c, off);
                        if (k == 0)
                                return kvf_err_set(-EIO, "the engine's caches are not mapped here (not "
                                                   "registered, or dropped with their engine)");
                        k = k < left ? k : left;
                        if (to_cache)
                                memcpy(kvf_cache_addr(c, off), b, k);
                        else
                                memcpy(b, kvf_cache_addr(c, off), k);
                        off += k, b += k, left -= k;
                }
        }
        return 0;
}

static int stage_copy(void *eng, bool to_cache, uint8_t *buf, const struct kvf_copy_run *runs,
                      unsigned n, uint64_t *ticket)
{
        struct stage_eng *e = eng;
        struct kvf_cache *c = e->c;
        if (c->reg_hdr && kvf_reg_stale(c->reg_hdr, c))
                (void)kvf_cache_refresh(c);
        pthread_rwlock_rdlock(&map_lock);
#ifdef KVF_HAVE_CUDA
        if (e->gpu) {
                /* Queued under the lock: a new mapping waits for the GPU before it closes the
                 * old one (kvf_cache_cuda_reg_unmap), so the kernel never runs on a closed one. */
                int rc = kvf_cache_cuda_stage_ops.copy(e->gpu, to_cache, buf, runs, n, ticket);
                pthread_rwlock_unlock(&map_lock);
                return rc;
        }
#endif
        /* The region file shrunk under the mapping faults: this copy fails, the connector
         * lives (busguard.h), and the lock is released either way. */
        struct kvf_busguard g;
        kvf_busguard_enter(&g);
        if (sigsetjmp(g.jb, 0)) {
                kvf_busguard_leave(&g);
                pthread_rwlock_unlock(&map_lock);
                return kvf_err_set(-EFAULT,
                                   "a staged copy touched %p, past the end of the engine's region file "
                                   "of '%s': it shrank after it was registered (seal it against "
                                   "shrinking, F_SEAL_SHRINK, as kvferry.host_buffer does, and register "
                                   "again)",
                                   kvf_busguard_addr(), c->reg_hdr ? c->reg_hdr->instance : "this instance");
        }
        int res = host_runs(c, to_cache, buf, runs, n);
        kvf_busguard_leave(&g);
        pthread_rwlock_unlock(&map_lock);
        *ticket = ++e->ticket;
        return res;
}

static int stage_poll(void *eng, uint64_t ticket)
{
        struct stage_eng *e = eng;
#ifdef KVF_HAVE_CUDA
        if (e->gpu)
                return kvf_cache_cuda_stage_ops.poll(e->gpu, ticket);
#endif
        (void)e;
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

/* GPU memory a NIC wrote (its engine's dma-bufs, or peer memory): visible to the GPU work
 * after it before the arrival is published, as for the cuda backend's own caches. */
static int engine_rdma_flush(struct kvf_cache *c)
{
        int rc = 0;
#ifdef KVF_HAVE_CUDA
        pthread_rwlock_rdlock(&map_lock);
        if (on_gpu(c))
                rc = kvf_cache_cuda.rdma_flush(c);
        pthread_rwlock_unlock(&map_lock);
#else
        (void)c;
#endif
        return rc;
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
    .stage = &stage_ops,
    .rdma_flush = engine_rdma_flush,
};
