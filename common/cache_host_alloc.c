#include "cache_host_alloc.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "ctl.h"
#include "err.h"
#include "hugepages.h"
#include "layout.h"
#include "log.h"

#define HP KVF_HUGE_PAGE_SIZE
/* Growing the pool must leave the host this much memory available besides. */
#define POOL_GROW_MARGIN (512ull << 20)

static void set_note(struct kvf_ctl_header *h, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void set_note(struct kvf_ctl_header *h, const char *fmt, ...)
{
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(h->cache_note, sizeof(h->cache_note), fmt, ap);
        va_end(ap);
}

/* Refuse a /dev/shm cache that cannot fit, saying by how much. */
static int check_fits(const struct kvf_cache_layout *l)
{
        struct statvfs sv;
        char need[32], shm[32], avail[32];
        uint64_t shm_free = statvfs("/dev/shm", &sv) == 0 ? (uint64_t)sv.f_bavail * sv.f_frsize : 0;
        uint64_t mem = kvf_mem_available();

        kvf_fmt_bytes(l->cache_bytes, need, sizeof(need));
        kvf_fmt_bytes(shm_free, shm, sizeof(shm));
        kvf_fmt_bytes(mem, avail, sizeof(avail));
        if ((shm_free && l->cache_bytes > shm_free) || (mem && l->cache_bytes > mem))
                return kvf_err_set(
                    -ENOMEM,
                    "a cache of %s (%u layers x %u tensors x %u blocks x %llu bytes) does not fit: "
                    "/dev/shm has %s free and the host %s available; use fewer --blocks",
                    need, kvf_layout_layers(l), kvf_layout_tensors(l), l->num_blocks,
                    (unsigned long long)l->block_bytes, shm, avail);
        return 0;
}

/* /dev/shm<cache_name>, created and sized (not yet allocated); its descriptor. */
static int shm_create(struct kvf_ctl_header *h)
{
        char name[96];
        int fd;

        kvf_cache_shm_name(h->instance, name, sizeof(name));
        snprintf(h->cache_name, sizeof(h->cache_name), "%s", name);
        snprintf(h->cache_path, sizeof(h->cache_path), "/dev/shm%s", name);
        fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0 && errno == EEXIST)
                return kvf_ctl_exists_err(h->instance, name);
        if (fd < 0)
                return kvf_err_set(-errno, "create cache /dev/shm%s: %s", name, strerror(errno));
        /* fchmod: the umask must not widen or narrow 0600. */
        if (fchmod(fd, 0600) < 0 || ftruncate(fd, (off_t)h->layout.cache_bytes) < 0) {
                int rc = -errno;
                shm_unlink(name);
                close(fd);
                return kvf_err_set(rc, "size cache /dev/shm%s: %s", name, strerror(-rc));
        }
        return fd;
}

/* Reserve every page now: tmpfs then fails here with ENOSPC rather than with SIGBUS in
 * whoever touches the page first. */
static int shm_allocate(const struct kvf_ctl_header *h, int fd)
{
        int rc = -posix_fallocate(fd, 0, (off_t)h->layout.cache_bytes);
        if (rc < 0) {
                char need[32];
                return kvf_err_set(rc, "reserve %s for cache %s: %s",
                                   kvf_fmt_bytes(h->layout.cache_bytes, need, sizeof(need)),
                                   h->cache_path, strerror(-rc));
        }
        return 0;
}

/* 4 KiB pages in /dev/shm; `note` says why. */
static int create_shm(struct kvf_ctl_header *h, uint8_t **map)
{
        int rc, fd;

        if ((rc = check_fits(&h->layout)) < 0)
                return rc;
        if ((fd = shm_create(h)) < 0)
                return fd;
        h->cache_backing = KVF_CACHE_SHM;
        h->cache_page_kib = 4;
        rc = shm_allocate(h, fd);
        close(fd);
        if (rc == 0 && (rc = kvf_host_cache_map_raw(h, false, map)) == 0)
                return 0;
        shm_unlink(h->cache_name);
        return rc;
}

/*
 * /dev/shm in transparent huge pages. With huge=advise the kernel allocates them only
 * when a mapping advised with MADV_HUGEPAGE faults them in, so map first (kvf_cache_map
 * advises and populates), then fallocate what is left; otherwise fallocate allocates them.
 * Then count in our own smaps what the kernel really gave.
 */
static int try_thp(struct kvf_ctl_header *h, enum kvf_shm_thp pol, enum kvf_huge_mode mode,
                   uint8_t **map, char *why, size_t whylen)
{
        uint64_t bytes = h->layout.cache_bytes;
        char sz[32];
        int rc, fd;

        if ((rc = check_fits(&h->layout)) < 0) {
                snprintf(why, whylen, "%s", kvf_err_msg());
                return rc;
        }
        if ((fd = shm_create(h)) < 0) {
                if (fd != -EEXIST)
                        snprintf(why, whylen, "%s", kvf_err_msg());
                return fd;
        }
        h->cache_backing = KVF_CACHE_SHM_THP;
        h->cache_page_kib = 4;
        if (pol == KVF_SHM_THP_ADVISE) {
                if ((rc = kvf_host_cache_map_raw(h, false, map)) == 0)
                        rc = shm_allocate(h, fd);
        } else if ((rc = shm_allocate(h, fd)) == 0) {
                rc = kvf_host_cache_map_raw(h, false, map);
        }
        close(fd);
        if (rc < 0) {
                snprintf(why, whylen, "%s", kvf_err_msg());
                goto fail;
        }
        /* Only whole 2 MiB pages of the file can be mapped as such: not a shorter tail. */
        int64_t huge = kvf_huge_mapped_bytes(*map);
        uint64_t whole = bytes / HP * HP;
        kvf_fmt_bytes(bytes, sz, sizeof(sz));
        if (huge > 0 && (uint64_t)huge >= whole) {
                h->cache_page_kib = 2048;
                set_note(h, "transparent huge pages (/dev/shm allows them)");
                return 0;
        }
        snprintf(why, whylen,
                 "transparent huge pages: the kernel gave %lld MiB of the %s in 2 MiB pages",
                 (long long)(huge > 0 ? huge >> 20 : 0), sz);
        if (mode == KVF_HUGE_AUTO) {
                set_note(h, "%s", why);
                return 0;
        }
        rc = -ENOMEM;
fail:
        if (*map)
                kvf_host_cache_unmap_raw(*map, bytes);
        *map = NULL;
        shm_unlink(h->cache_name);
        return rc;
}

/*
 * hugetlbfs: find (as root: make) a mount, count the pool's pages (as root: grow it), create
 * <mount>/kvferry.<instance>.cache and take its pages with fallocate, all under the pool's
 * lock so that two allocators never count the same free pages. Fails with `why` set, or
 * -EEXIST when the name is taken.
 */
static int try_hugetlbfs(struct kvf_ctl_header *h, enum kvf_huge_mode mode, uint8_t **map, char *why,
                         size_t whylen)
{
        uint64_t need = (h->layout.cache_bytes + HP - 1) / HP;
        char dir[KVF_CACHE_PATH_MAX], base[96], path[KVF_CACHE_PATH_MAX + 96], how[128] = "";
        struct kvf_huge_pool pool;
        struct statfs sf;
        int rc, fd = -1;

        int lock = kvf_huge_lock();
        if (lock < 0) {
                snprintf(why, whylen, "%s", kvf_err_msg());
                return lock;
        }
        rc = kvf_huge_find_mount(dir, sizeof(dir), why, whylen);
        if (rc == -ENOENT && geteuid() == 0 && mode == KVF_HUGE_ON) {
                if ((rc = kvf_huge_mount_default()) < 0) {
                        snprintf(why, whylen, "no hugetlbfs mount of 2 MiB pages, and %s",
                                 kvf_err_msg());
                        goto out;
                }
                kvf_info("mounted hugetlbfs (2 MiB pages) on %s, as systemd does at boot; it stays",
                         KVF_HUGE_DEFAULT_MOUNT);
                snprintf(how, sizeof(how), "mounted %s, ", KVF_HUGE_DEFAULT_MOUNT);
                rc = kvf_huge_find_mount(dir, sizeof(dir), why, whylen);
        }
        if (rc < 0)
                goto out;
        /* A mount's own size= limit, which no growth of the pool lifts. */
        if (statfs(dir, &sf) == 0 && sf.f_blocks > 0 && (uint64_t)sf.f_bfree < need) {
                snprintf(why, whylen,
                         "hugetlbfs %s has room for %llu more 2 MiB pages (its size= limit), the "
                         "cache needs %llu",
                         dir, (unsigned long long)sf.f_bfree, (unsigned long long)need);
                rc = -ENOSPC;
                goto out;
        }
        if ((rc = kvf_huge_pool_read(&pool)) < 0) {
                snprintf(why, whylen, "%s", kvf_err_msg());
                goto out;
        }
        uint64_t avail = pool.free > pool.resv ? pool.free - pool.resv : 0;
        if (avail < need && (geteuid() != 0 || mode != KVF_HUGE_ON)) {
                snprintf(why, whylen,
                         "nr_hugepages is %llu with %llu free, the cache needs %llu, and %s",
                         (unsigned long long)pool.total, (unsigned long long)avail,
                         (unsigned long long)need,
                         geteuid() ? "only root may reserve more"
                                   : "only --huge-pages on reserves more (auto takes what is free)");
                rc = -ENOMEM;
                goto out;
        }
        if (avail < need) {
                uint64_t more = need - avail, got = 0, mem = kvf_mem_available();
                if (mem && more * HP + POOL_GROW_MARGIN > mem) {
                        snprintf(why, whylen,
                                 "nr_hugepages is %llu with %llu free, and reserving %llu MiB more "
                                 "would leave less than %llu MiB of memory available",
                                 (unsigned long long)pool.total, (unsigned long long)avail,
                                 (unsigned long long)(more * HP >> 20),
                                 (unsigned long long)(POOL_GROW_MARGIN >> 20));
                        rc = -ENOMEM;
                        goto out;
                }
                if ((rc = kvf_huge_pool_grow(pool.total + more, &got)) < 0) {
                        snprintf(why, whylen, "nr_hugepages is %llu with %llu free, and %s",
                                 (unsigned long long)pool.total, (unsigned long long)avail,
                                 kvf_err_msg());
                        goto out;
                }
                kvf_info("reserved huge pages: nr_hugepages %llu -> %llu (the cache needs %llu, "
                         "%llu were free); they stay the system's",
                         (unsigned long long)pool.total, (unsigned long long)got,
                         (unsigned long long)need, (unsigned long long)avail);
                size_t hl = strlen(how);
                snprintf(how + hl, sizeof(how) - hl, "raised nr_hugepages %llu -> %llu, ",
                         (unsigned long long)pool.total, (unsigned long long)got);
                if (got < pool.total + more) {
                        snprintf(why, whylen,
                                 "asked the kernel for %llu more 2 MiB pages (nr_hugepages %llu -> "
                                 "%llu), it found %llu: too little free memory, or too fragmented",
                                 (unsigned long long)more, (unsigned long long)pool.total,
                                 (unsigned long long)(pool.total + more),
                                 (unsigned long long)(got > pool.total ? got - pool.total : 0));
                        rc = -ENOMEM;
                        goto out;
                }
        }
        kvf_cache_shm_name(h->instance, base, sizeof(base));
        snprintf(path, sizeof(path), "%s%s", dir, base);
        if (strlen(path) >= sizeof(h->cache_path)) {
                snprintf(why, whylen, "the cache's path on hugetlbfs %s would be too long", dir);
                rc = -ENAMETOOLONG;
                goto out;
        }
        fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd < 0) {
                rc = -errno;
                if (rc == -EEXIST)
                        rc = kvf_ctl_exists_path_err(h->instance, path);
                else
                        snprintf(why, whylen, "create %s: %s", path, strerror(-rc));
                goto out;
        }
        /* A hugetlbfs file is a whole number of its pages long; fallocate takes them now, so a
         * pool that runs short fails here rather than as SIGBUS in a process that maps it. */
        if (fchmod(fd, 0600) < 0 || ftruncate(fd, (off_t)(need * HP)) < 0 ||
            fallocate(fd, 0, 0, (off_t)(need * HP)) < 0) {
                rc = -errno;
                snprintf(why, whylen, "take %llu 2 MiB pages for %s: %s", (unsigned long long)need,
                         path, strerror(-rc));
                unlink(path);
                goto out;
        }
        snprintf(h->cache_path, sizeof(h->cache_path), "%s", path);
        h->cache_backing = KVF_CACHE_HUGETLBFS;
        h->cache_page_kib = 2048;
        set_note(h, "%s%llu pages of the pool", how, (unsigned long long)need);
        if ((rc = kvf_host_cache_map_raw(h, false, map)) < 0) {
                snprintf(why, whylen, "%s", kvf_err_msg());
                unlink(path);
                goto out;
        }
        rc = 0;
out:
        if (fd >= 0)
                close(fd);
        kvf_huge_unlock(lock);
        return rc;
}

int kvf_host_cache_create(struct kvf_ctl_header *h, enum kvf_huge_mode mode, uint8_t **map)
{
        char why[KVF_CACHE_NOTE_MAX] = "", why2[KVF_CACHE_NOTE_MAX] = "", sz[32];
        int rc;

        *map = NULL;
        h->cache_path[0] = h->cache_note[0] = '\0';
        /* /dev/shm/kvferry.<instance>.cache is the instance's name whatever backs the cache:
         * another user's file there holds the name (and `down` removes nothing while it does). */
        char shm[96], path[128];
        struct stat st;
        kvf_cache_shm_name(h->instance, shm, sizeof(shm));
        snprintf(path, sizeof(path), "/dev/shm%s", shm);
        if (lstat(path, &st) == 0)
                return kvf_ctl_exists_err(h->instance, shm);
        if (mode == KVF_HUGE_OFF) {
                set_note(h, "--huge-pages off");
                return create_shm(h, map);
        }
        rc = try_hugetlbfs(h, mode, map, why, sizeof(why));
        if (rc == 0 || rc == -EEXIST)
                return rc;
        enum kvf_shm_thp pol = kvf_huge_shm_thp(why2, sizeof(why2));
        if (pol != KVF_SHM_THP_NEVER) {
                kvf_info("no hugetlbfs pages (%s): trying transparent huge pages in /dev/shm", why);
                rc = try_thp(h, pol, mode, map, why2, sizeof(why2));
                if (rc == 0 || rc == -EEXIST)
                        return rc;
        }
        kvf_fmt_bytes(h->layout.cache_bytes, sz, sizeof(sz));
        if (mode == KVF_HUGE_ON)
                return kvf_err_set(-ENOMEM,
                                   "--huge-pages on: no 2 MiB pages for the %s cache: %s; %s", sz,
                                   why, why2);
        kvf_warn("no 2 MiB pages for the %s cache, using 4 KiB pages: %s; %s", sz, why, why2);
        set_note(h, "huge pages unavailable: %s", why);
        return create_shm(h, map);
}

void kvf_host_cache_describe(const struct kvf_ctl_header *h, char *buf, size_t len)
{
        char sz[32];
        const char *what = h->cache_backing == KVF_CACHE_HUGETLBFS ? "hugetlbfs "
                           : h->cache_backing == KVF_CACHE_SHM_THP ? "shmem THP "
                                                                   : "";
        snprintf(buf, len, "%s in %s pages (%s%s)%s%s",
                 kvf_fmt_bytes(h->layout.cache_bytes, sz, sizeof(sz)),
                 h->cache_page_kib == 2048 ? "2 MiB" : "4 KiB", what, h->cache_path,
                 h->cache_note[0] ? ": " : "", h->cache_note);
}
