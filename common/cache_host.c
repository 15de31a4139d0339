/*
 * The host backend: the cache is one shared-memory file, /dev/shm/kvferry.<instance>.cache
 * (0600), made and kept by the allocator, mapped by name by everyone else.
 * Copies are streamed memcpy (copy.c) and complete at once.
 */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache.h"
#include "copy.h"
#include "ctl.h"
#include "err.h"
#include "layout.h"

static int host_create(struct kvf_ctl_header *h)
{
        const struct kvf_cache_layout *l = &h->layout;
        const char *name = h->cache_name;
        int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0 && errno == EEXIST)
                return kvf_ctl_exists_err(h->instance, name);
        if (fd < 0)
                return kvf_err_set(-errno, "create cache /dev/shm%s: %s", name, strerror(errno));
        int rc = 0;
        if (fchmod(fd, 0600) < 0 || ftruncate(fd, (off_t)l->cache_bytes) < 0)
                rc = -errno;
        /* Reserve every page now: tmpfs then fails here with ENOSPC rather
         * than with SIGBUS in whoever touches the page first. */
        if (rc == 0)
                rc = -posix_fallocate(fd, 0, (off_t)l->cache_bytes);
        close(fd);
        if (rc < 0) {
                shm_unlink(name);
                char need[32];
                return kvf_err_set(rc, "reserve %s for cache /dev/shm%s: %s",
                                   kvf_fmt_bytes(l->cache_bytes, need, sizeof(need)), name, strerror(-rc));
        }
        return 0;
}

static void host_destroy(const struct kvf_ctl_header *h)
{
        shm_unlink(h->cache_name);
}

static int host_map(const struct kvf_ctl_header *h, bool writable, struct kvf_cache *out)
{
        uint64_t want = h->layout.cache_bytes;
        int fd = shm_open(h->cache_name, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC, 0);
        if (fd < 0)
                return kvf_err_set(-ENOENT, "open cache /dev/shm%s: %s", h->cache_name, strerror(errno));
        struct stat st;
        if (fstat(fd, &st) < 0 || (uint64_t)st.st_size != want) {
                close(fd);
                return kvf_err_set(-EPROTO, "cache /dev/shm%s has the wrong size (the layout needs %llu bytes)",
                                   h->cache_name, (unsigned long long)want);
        }
        void *p = mmap(NULL, want, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED | MAP_POPULATE, fd, 0);
        int e = errno;
        close(fd);
        if (p == MAP_FAILED)
                return kvf_err_set(-ENOMEM, "map cache /dev/shm%s (%llu bytes): %s", h->cache_name,
                                   (unsigned long long)want, strerror(e));
        out->base = p;
        out->host = true;
        out->device = -1;
        return 0;
}

static void host_unmap(struct kvf_cache *c)
{
        if (c->base)
                munmap(c->base, c->bytes);
}

/* Streamed copies, done before submit returns: every ticket is complete. */
static int host_copy_submit(const struct kvf_copy_batch *b, uint64_t *ticket)
{
        for (uint32_t i = 0; i < b->nruns; i++) {
                const struct kvf_copy_run *r = &b->runs[i];
                kvf_copy_stream(b->dst[r->dst]->base + r->dst_off, b->src->base + r->src_off, r->bytes);
        }
        /* The streamed stores are visible before anything that says the bytes are there. */
        kvf_copy_fence();
        *ticket = 0;
        return 0;
}

static int host_copy_poll(struct kvf_cache *src, uint64_t ticket)
{
        (void)src;
        (void)ticket;
        return 1;
}

const struct kvf_cache_backend kvf_cache_host = {
        .name = "host",
        .id = KVF_BACKEND_HOST,
        .create = host_create,
        .destroy = host_destroy,
        .map = host_map,
        .unmap = host_unmap,
        .copy_submit = host_copy_submit,
        .copy_poll = host_copy_poll,
};
