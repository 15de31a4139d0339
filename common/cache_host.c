/*
 * The host backend: the cache is one file of host memory, made and kept by
 * the allocator (cache_host_alloc.c: in 2 MiB pages where they can be had),
 * mapped by everyone else where the header says it is: /dev/shm, or a
 * hugetlbfs mount (docs/ARCHITECTURE.md 3a). Copies are streamed memcpy
 * (copy.c) and complete at once.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache.h"
#include "cache_host_alloc.h"
#include "hugepages.h"
#include "copy.h"
#include "ctl.h"
#include "err.h"
#include "layout.h"

static int host_create(struct kvf_ctl_header *h, const struct kvf_cache_opts *o)
{
        uint8_t *keep = NULL;
        int rc = kvf_host_cache_create(h, (enum kvf_huge_mode)o->huge_pages, &keep);
        if (rc == 0 && o->keep_map)
                *o->keep_map = keep;
        else if (rc == 0)
                kvf_host_cache_unmap_raw(keep, h->layout.cache_bytes);
        return rc;
}

static void host_destroy(const struct kvf_ctl_header *h)
{
        shm_unlink(h->cache_name);
}

/*
 * The cache file of the segment whose header is h, opened and checked like the segment
 * itself: a regular file of ours, of the size the layout needs (hugetlbfs: rounded up to
 * its 2 MiB pages). A hugetlbfs cache must be named after the instance and live on a
 * hugetlbfs mount: the path comes from shared memory, and must not lead anywhere else.
 * Returns the descriptor; `path` says what was opened.
 */
static int cache_open(const struct kvf_ctl_header *h, bool writable, char *path, size_t len)
{
        uint32_t backing = h->cache_backing ? h->cache_backing : KVF_CACHE_SHM;
        uint64_t want = h->layout.cache_bytes;
        int flags = (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC | O_NOFOLLOW;
        struct stat st;
        int fd, rc;

        if (backing == KVF_CACHE_HUGETLBFS) {
                char base[96];
                const char *slash = strrchr(h->cache_path, '/');
                kvf_cache_shm_name(h->instance, base, sizeof(base));
                snprintf(path, len, "%s", h->cache_path);
                if (h->cache_path[0] != '/' || !slash || strcmp(slash, base))
                        return kvf_err_set(-EPROTO, "cache path '%s' is not <hugetlbfs mount>%s",
                                           path, base);
                fd = open(path, flags);
                want = (want + KVF_HUGE_PAGE_SIZE - 1) / KVF_HUGE_PAGE_SIZE * KVF_HUGE_PAGE_SIZE;
        } else {
                snprintf(path, len, "/dev/shm%s", h->cache_name);
                fd = shm_open(h->cache_name, flags, 0);
        }
        if (fd < 0)
                return kvf_err_set(-ENOENT, "open cache %s: %s", path, strerror(errno));
        if (fstat(fd, &st) < 0) {
                rc = kvf_err_set(-errno, "stat cache %s: %s", path, strerror(errno));
        } else if (!S_ISREG(st.st_mode)) {
                rc = kvf_err_set(-EPROTO, "cache %s is not a regular file", path);
        } else if (st.st_uid != geteuid()) {
                rc = kvf_err_set(-EPERM,
                                 "cache %s is owned by uid %u, we run as uid %u: refusing it", path,
                                 (unsigned)st.st_uid, (unsigned)geteuid());
        } else if (backing == KVF_CACHE_HUGETLBFS && !kvf_huge_fd_is_hugetlbfs(fd)) {
                rc = kvf_err_set(-EPROTO, "cache %s is not on a hugetlbfs mount of 2 MiB pages",
                                 path);
        } else if ((uint64_t)st.st_size != want) {
                rc = kvf_err_set(-EPROTO,
                                 "cache %s has the wrong size (the layout needs %llu bytes)", path,
                                 (unsigned long long)want);
        } else {
                return fd;
        }
        close(fd);
        return rc;
}

/*
 * Map `bytes` of the cache, populated. Transparent huge pages are mapped with 2 MiB
 * pages only at 2 MiB-aligned addresses, which mmap does not promise for a file of a
 * mount without huge pages (the pages may have been collapsed): so reserve 2 MiB more,
 * place the mapping on the boundary inside, and give back the rest. hugetlbfs mappings
 * are aligned by the kernel.
 */
static void *cache_mmap(int fd, uint64_t bytes, bool writable, uint32_t backing, bool populate)
{
        int prot = PROT_READ | (writable ? PROT_WRITE : 0);

        if (backing != KVF_CACHE_SHM_THP)
                return mmap(NULL, bytes, prot, MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
        uint64_t span = bytes + KVF_HUGE_PAGE_SIZE;
        uintptr_t mask = (uintptr_t)KVF_HUGE_PAGE_SIZE - 1;
        uint8_t *r = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1,
                          0);
        if (r == MAP_FAILED)
                return MAP_FAILED;
        uint8_t *a = (uint8_t *)(((uintptr_t)r + mask) & ~mask);
        void *p = mmap(a, bytes, prot, MAP_SHARED | MAP_FIXED, fd, 0);
        if (p == MAP_FAILED) {
                int e = errno;
                munmap(r, span);
                errno = e;
                return MAP_FAILED;
        }
        if (a > r)
                munmap(r, (size_t)(a - r));
        if (a + bytes < r + span)
                munmap(a + bytes, (size_t)(r + span - (a + bytes)));
        /* A mount with huge=advise faults them in only where advised; else it is a no-op. */
        madvise(p, bytes, MADV_HUGEPAGE);
        if (populate && madvise(p, bytes, MADV_POPULATE_READ) < 0 && errno != EINVAL) {
                int e = errno;
                munmap(p, bytes);
                errno = e;
                return MAP_FAILED;
        }
        return p;
}

static int map_file(const struct kvf_ctl_header *h, bool writable, bool populate, uint8_t **out)
{
        char path[KVF_CACHE_PATH_MAX + 16];
        uint64_t want = h->layout.cache_bytes;
        int fd = cache_open(h, writable, path, sizeof(path));
        if (fd < 0)
                return fd;
        void *p = cache_mmap(fd, want, writable, h->cache_backing, populate);
        int e = errno;
        close(fd);
        if (p == MAP_FAILED)
                return kvf_err_set(-ENOMEM, "map cache %s (%llu bytes): %s", path,
                                   (unsigned long long)want, strerror(e));
        *out = p;
        return 0;
}

int kvf_host_cache_map_raw(const struct kvf_ctl_header *h, bool writable, uint8_t **out)
{
        return map_file(h, writable, true, out);
}

/* A lazily mapped peer's cache, faulted in by a thread of its own. */
struct fault_in {
        uint8_t *p;
        uint64_t bytes;
};

static void *fault_in(void *arg)
{
        struct fault_in f = *(struct fault_in *)arg;
        free(arg);
        /* In 64 MiB steps, so that a mapping unmapped meanwhile (the peer went away) ends it at
         * the next step: madvise then fails (ENOMEM), or faults in pages of whatever is mapped
         * there now, which only reads them. */
        for (uint64_t off = 0; off < f.bytes; off += 64ull << 20) {
                uint64_t n = f.bytes - off < (64ull << 20) ? f.bytes - off : 64ull << 20;
                if (madvise(f.p + off, n, MADV_POPULATE_READ) < 0)
                        break;
        }
        return NULL;
}

static void start_fault_in(uint8_t *p, uint64_t bytes)
{
        struct fault_in *f = malloc(sizeof(*f));
        pthread_t t;
        pthread_attr_t a;
        if (!f)
                return; /* (the copies fault their pages in as they go) */
        *f = (struct fault_in){p, bytes};
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &a, fault_in, f) != 0)
                free(f);
        pthread_attr_destroy(&a);
}

void kvf_host_cache_unmap_raw(uint8_t *p, uint64_t bytes)
{
        /* A hugetlbfs mapping ends on a 2 MiB page: munmap refuses to cut one. */
        uint64_t whole = (bytes + KVF_HUGE_PAGE_SIZE - 1) / KVF_HUGE_PAGE_SIZE * KVF_HUGE_PAGE_SIZE;
        if (p && munmap(p, bytes) < 0 && errno == EINVAL)
                munmap(p, whole);
}

static int host_map(const struct kvf_ctl_header *h, bool writable, struct kvf_cache *out)
{
        int rc = map_file(h, writable, !out->lazy, &out->base);
        if (rc == 0 && out->lazy)
                start_fault_in(out->base, h->layout.cache_bytes);
        out->host = rc == 0;
        out->device = -1; /* host memory, whichever device the mapping was asked for */
        return rc;
}

static void host_unmap(struct kvf_cache *c)
{
        kvf_host_cache_unmap_raw(c->base, c->bytes);
}

/* Streamed copies, done before submit returns: every ticket is complete. A peer's cache may
 * be the engine's (strided blocks): kvf_cache_copy_host splits the runs there. */
static int host_copy_submit(const struct kvf_copy_batch *b, uint64_t *ticket)
{
        *ticket = 0;
        return kvf_cache_copy_host(b);
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
