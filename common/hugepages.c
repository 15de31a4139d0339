#include "hugepages.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <mntent.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "err.h"

#define POOL_DIR "/sys/kernel/mm/hugepages/hugepages-2048kB"
#define HUGETLBFS_MAGIC_ 0x958458f6u /* linux/magic.h */

static int read_u64(const char *path, uint64_t *v)
{
        char buf[64];
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
                return -errno;
        ssize_t n = read(fd, buf, sizeof(buf) - 1);
        int e = errno;
        close(fd);
        if (n <= 0)
                return n < 0 ? -e : -EIO;
        buf[n] = '\0';
        unsigned long long x;
        if (sscanf(buf, "%llu", &x) != 1)
                return -EIO;
        *v = x;
        return 0;
}

int kvf_huge_pool_read(struct kvf_huge_pool *p)
{
        int rc;
        if ((rc = read_u64(POOL_DIR "/nr_hugepages", &p->total)) < 0 ||
            (rc = read_u64(POOL_DIR "/free_hugepages", &p->free)) < 0 ||
            (rc = read_u64(POOL_DIR "/resv_hugepages", &p->resv)) < 0)
                return kvf_err_set(rc, "this kernel has no pool of 2 MiB pages (%s): %s", POOL_DIR,
                                   strerror(-rc));
        return 0;
}

int kvf_huge_lock(void)
{
        int fd = open(POOL_DIR "/nr_hugepages", O_RDONLY | O_CLOEXEC);
        if (fd < 0)
                return kvf_err_set(-errno, "this kernel has no pool of 2 MiB pages (%s): %s",
                                   POOL_DIR, strerror(errno));
        /* Blocking: the holder only counts pages, grows the pool and fills one file. */
        while (flock(fd, LOCK_EX) < 0) {
                if (errno != EINTR) {
                        int rc = -errno;
                        close(fd);
                        return kvf_err_set(rc, "lock %s/nr_hugepages: %s", POOL_DIR, strerror(-rc));
                }
        }
        return fd;
}

void kvf_huge_unlock(int fd)
{
        if (fd >= 0)
                close(fd); /* drops the flock */
}

int kvf_huge_pool_grow(uint64_t total, uint64_t *got)
{
        char buf[32];
        int fd = open(POOL_DIR "/nr_hugepages", O_WRONLY | O_CLOEXEC);
        if (fd < 0)
                return kvf_err_set(-errno, "open %s/nr_hugepages for writing: %s", POOL_DIR,
                                   strerror(errno));
        int n = snprintf(buf, sizeof(buf), "%" PRIu64 "\n", total);
        ssize_t w = write(fd, buf, (size_t)n);
        int e = errno;
        close(fd);
        if (w != n)
                return kvf_err_set(w < 0 ? -e : -EIO, "write %" PRIu64 " to %s/nr_hugepages: %s",
                                   total, POOL_DIR, w < 0 ? strerror(e) : "short write");
        int rc = read_u64(POOL_DIR "/nr_hugepages", got);
        if (rc < 0)
                return kvf_err_set(rc, "read %s/nr_hugepages: %s", POOL_DIR, strerror(-rc));
        return 0;
}

/* 1: a hugetlbfs of 2 MiB pages, 0: of another size, -errno: cannot tell (cannot reach it) */
static int dir_is_hugetlbfs_2m(const char *dir)
{
        struct statfs sf;
        if (statfs(dir, &sf) < 0)
                return -errno;
        return (uint32_t)sf.f_type == HUGETLBFS_MAGIC_ &&
               (uint64_t)sf.f_bsize == KVF_HUGE_PAGE_SIZE;
}

bool kvf_huge_fd_is_hugetlbfs(int fd)
{
        struct statfs sf;
        return fstatfs(fd, &sf) == 0 && (uint32_t)sf.f_type == HUGETLBFS_MAGIC_ &&
               (uint64_t)sf.f_bsize == KVF_HUGE_PAGE_SIZE;
}

void kvf_huge_for_each_mount(void (*fn)(const char *dir, void *arg), void *arg)
{
        struct mntent me;
        char buf[4096];
        FILE *f = setmntent("/proc/self/mounts", "re");
        if (!f)
                return;
        while (getmntent_r(f, &me, buf, sizeof(buf)))
                if (!strcmp(me.mnt_type, "hugetlbfs"))
                        fn(me.mnt_dir, arg);
        endmntent(f);
}

struct find {
        char *dir;
        size_t len;
        char *why;
        size_t whylen;
        bool found, any, toolong;
};

static void consider(const char *dir, struct find *s)
{
        struct stat st;
        if (s->found)
                return;
        int is = dir_is_hugetlbfs_2m(dir);
        if (is == 0)
                return;
        s->any = true;
        if (is < 0) {
                if (s->why[0] == '\0')
                        snprintf(s->why, s->whylen, "hugetlbfs %s: %s", dir, strerror(-is));
                return;
        }
        /* Effective ids, as open(O_CREAT) will use; a read-only mount says EROFS. */
        if (faccessat(AT_FDCWD, dir, W_OK | X_OK, AT_EACCESS) < 0) {
                int e = errno;
                if (s->why[0] == '\0' && stat(dir, &st) == 0)
                        snprintf(
                            s->why, s->whylen,
                            "hugetlbfs %s is not writable by uid %u (owner uid %u, mode %04o%s)",
                            dir, (unsigned)geteuid(), (unsigned)st.st_uid,
                            (unsigned)(st.st_mode & 07777), e == EROFS ? ", read-only" : "");
                return;
        }
        if (strlen(dir) >= s->len) {
                s->toolong = true;
                return;
        }
        snprintf(s->dir, s->len, "%s", dir);
        s->found = true;
}

static void consider_default(const char *dir, void *arg)
{
        if (!strcmp(dir, KVF_HUGE_DEFAULT_MOUNT))
                consider(dir, arg);
}

static void consider_any(const char *dir, void *arg)
{
        consider(dir, arg);
}

int kvf_huge_find_mount(char *dir, size_t len, char *why, size_t whylen)
{
        struct find s = {.dir = dir, .len = len, .why = why, .whylen = whylen};

        why[0] = '\0';
        kvf_huge_for_each_mount(consider_default, &s);
        kvf_huge_for_each_mount(consider_any, &s);
        if (s.found)
                return 0;
        if (s.toolong) {
                snprintf(why, whylen, "the path of every writable hugetlbfs mount is too long");
                return -ENAMETOOLONG;
        }
        if (!s.any) {
                snprintf(why, whylen, "no hugetlbfs mount of 2 MiB pages");
                return -ENOENT;
        }
        return -EACCES;
}

int kvf_huge_mount_default(void)
{
        if (mkdir(KVF_HUGE_DEFAULT_MOUNT, 0755) < 0 && errno != EEXIST)
                return kvf_err_set(-errno, "create %s: %s", KVF_HUGE_DEFAULT_MOUNT,
                                   strerror(errno));
        if (mount("hugetlbfs", KVF_HUGE_DEFAULT_MOUNT, "hugetlbfs", MS_NOSUID | MS_NODEV,
                  "pagesize=2M") < 0)
                return kvf_err_set(-errno, "mount hugetlbfs on %s: %s", KVF_HUGE_DEFAULT_MOUNT,
                                   strerror(errno));
        return 0;
}

/* The word in [brackets] of a sysfs choice file ("always within_size [never] ..."). */
static int sysfs_choice(const char *path, char *out, size_t len)
{
        char buf[256];
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
                return -errno;
        ssize_t n = read(fd, buf, sizeof(buf) - 1);
        close(fd);
        if (n <= 0)
                return -EIO;
        buf[n] = '\0';
        char *a = strchr(buf, '['), *b = a ? strchr(a, ']') : NULL;
        if (!a || !b || (size_t)(b - a - 1) >= len)
                return -EIO;
        memcpy(out, a + 1, (size_t)(b - a - 1));
        out[b - a - 1] = '\0';
        return 0;
}

enum kvf_shm_thp kvf_huge_shm_thp(char *why, size_t whylen)
{
        char global[32], huge[32] = "never";

        if (sysfs_choice("/sys/kernel/mm/transparent_hugepage/shmem_enabled", global,
                         sizeof(global)) < 0) {
                snprintf(why, whylen, "this kernel has no transparent huge pages for shmem");
                return KVF_SHM_THP_NEVER;
        }
        if (!strcmp(global, "deny")) {
                snprintf(why, whylen,
                         "transparent huge pages for shmem are denied (shmem_enabled)");
                return KVF_SHM_THP_NEVER;
        }
        if (!strcmp(global, "force"))
                return KVF_SHM_THP_ALWAYS;
        /* The last /dev/shm in the table is the one on top. */
        FILE *f = setmntent("/proc/self/mounts", "re");
        if (f) {
                struct mntent me;
                char buf[4096];
                while (getmntent_r(f, &me, buf, sizeof(buf))) {
                        if (strcmp(me.mnt_dir, "/dev/shm") || strcmp(me.mnt_type, "tmpfs"))
                                continue;
                        const char *o = hasmntopt(&me, "huge");
                        snprintf(huge, sizeof(huge), "%s", "never");
                        if (o && o[4] == '=')
                                snprintf(huge, sizeof(huge), "%.*s", (int)strcspn(o + 5, ","),
                                         o + 5);
                }
                endmntent(f);
        }
        if (!strcmp(huge, "always") || !strcmp(huge, "within_size"))
                return KVF_SHM_THP_ALWAYS;
        if (!strcmp(huge, "advise"))
                return KVF_SHM_THP_ADVISE;
        snprintf(why, whylen, "/dev/shm is mounted huge=%s", huge);
        return KVF_SHM_THP_NEVER;
}

int64_t kvf_huge_mapped_bytes(const void *addr)
{
        char line[512], start[32];
        FILE *f = fopen("/proc/self/smaps", "re");
        bool in = false, seen = false;
        uint64_t kib = 0;

        if (!f)
                return -errno;
        snprintf(start, sizeof(start), "%" PRIxPTR "-", (uintptr_t)addr);
        while (fgets(line, sizeof(line), f)) {
                /* A mapping's first line is "start-end perms ...", its fields "Name:   value kB".
                 */
                char *colon = strchr(line, ':'), *space = strchr(line, ' ');
                if (space && (!colon || colon > space)) {
                        if (seen)
                                break;
                        in = seen = !strncmp(line, start, strlen(start));
                        continue;
                }
                unsigned long long v;
                if (in && colon && sscanf(colon + 1, "%llu", &v) == 1 &&
                    (!strncmp(line, "Shared_Hugetlb:", 15) ||
                     !strncmp(line, "Private_Hugetlb:", 16) ||
                     !strncmp(line, "ShmemPmdMapped:", 15) || !strncmp(line, "FilePmdMapped:", 14)))
                        kib += v;
        }
        fclose(f);
        return seen ? (int64_t)(kib * 1024) : -ENOENT;
}

uint64_t kvf_mem_available(void)
{
        FILE *f = fopen("/proc/meminfo", "re");
        char line[256];
        unsigned long long kb = 0;
        if (!f)
                return 0;
        while (fgets(line, sizeof(line), f))
                if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1)
                        break;
        fclose(f);
        return kb * 1024;
}
