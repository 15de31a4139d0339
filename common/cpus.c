/* The CPUs this process may use, and the spin seats (cpus.h). */
#include "cpus.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "err.h"

/* A whole number from the first line of `path`; false when it has none ("max", "-1", none). */
static bool read_u64(const char *path, unsigned long long *v, unsigned long long *second)
{
        char line[64];
        FILE *f = fopen(path, "r");
        if (!f)
                return false;
        bool got = fgets(line, sizeof(line), f) &&
                   (second ? sscanf(line, "%llu %llu", v, second) == 2 : sscanf(line, "%llu", v) == 1);
        fclose(f);
        return got;
}

/* The CPU quota of cgroup `dir` under `mnt`, in whole CPUs rounded up; 0 none. v2: cpu.max
 * ("QUOTA PERIOD", or "max PERIOD"); v1: cpu.cfs_quota_us (-1: none) and cpu.cfs_period_us. */
static unsigned cgroup_quota(const char *mnt, const char *dir, bool v2)
{
        char path[640];
        unsigned long long quota = 0, period = 0;
        bool got;
        if (v2) {
                snprintf(path, sizeof(path), "%s%s/cpu.max", mnt, dir);
                got = read_u64(path, &quota, &period);
        } else {
                snprintf(path, sizeof(path), "%s%s/cpu.cfs_quota_us", mnt, dir);
                got = read_u64(path, &quota, NULL);
                snprintf(path, sizeof(path), "%s%s/cpu.cfs_period_us", mnt, dir);
                got = got && read_u64(path, &period, NULL);
        }
        return got && period > 0 && quota > 0 ? (unsigned)((quota + period - 1) / period) : 0;
}

/* The smallest quota of cgroup `dir` (a path from /proc/self/cgroup) and every one above it. */
static unsigned cgroup_quota_up(const char *mnt, const char *path, bool v2)
{
        char dir[512];
        unsigned best = 0;
        snprintf(dir, sizeof(dir), "%s", path);
        for (char *slash; dir[0] == '/';) {
                unsigned q = cgroup_quota(mnt, strcmp(dir, "/") ? dir : "", v2);
                if (q && (!best || q < best))
                        best = q;
                if (!strcmp(dir, "/"))
                        break;
                slash = strrchr(dir, '/');
                slash[slash == dir] = 0; /* "/a/b" -> "/a", "/a" -> "/" */
        }
        return best;
}

unsigned kvf_usable_cpus(const char **why)
{
        unsigned n = 0;
        for (int size = 1024; size <= 65536 && !n; size *= 4) { /* more than 1024 CPUs: grow */
                cpu_set_t *set = CPU_ALLOC(size);
                size_t bytes = CPU_ALLOC_SIZE(size);
                if (!set)
                        break;
                int rc = sched_getaffinity(0, bytes, set);
                if (rc == 0)
                        n = (unsigned)CPU_COUNT_S(bytes, set);
                CPU_FREE(set);
                if (rc < 0 && errno != EINVAL)
                        break;
        }
        if (!n) {
                long on = sysconf(_SC_NPROCESSORS_ONLN);
                n = on > 0 ? (unsigned)on : 1;
        }
        *why = "affinity";
        /* "0::/path" (v2), "N:cpu,cpuacct:/path" (v1's cpu controller) */
        char line[512];
        FILE *f = fopen("/proc/self/cgroup", "r");
        while (f && fgets(line, sizeof(line), f)) {
                line[strcspn(line, "\n")] = 0;
                char *ctrl = strchr(line, ':'), *path = ctrl ? strchr(ctrl + 1, ':') : NULL;
                if (!path)
                        continue;
                *path++ = 0;
                ctrl++;
                unsigned q = 0;
                if (!*ctrl) {
                        q = cgroup_quota_up("/sys/fs/cgroup", path, true);
                        unsigned u = cgroup_quota_up("/sys/fs/cgroup/unified", path, true);
                        q = u && (!q || u < q) ? u : q;
                } else {
                        for (char *c = strtok(ctrl, ","); c; c = strtok(NULL, ","))
                                if (!strcmp(c, "cpu"))
                                        q = cgroup_quota_up("/sys/fs/cgroup/cpu", path, false);
                }
                if (q && q < n) {
                        n = q;
                        *why = "cgroup CPU quota";
                }
        }
        if (f)
                fclose(f);
        return n;
}

int kvf_spin_seat_take(struct kvf_spin_seat *s, unsigned seats)
{
        if (s->held)
                return 1;
        const char *env = getenv("KVFERRY_SPIN_SEATS");
        char prefix[200], path[240];
        if (env && *env)
                snprintf(prefix, sizeof(prefix), "%s", env);
        else
                snprintf(prefix, sizeof(prefix), "/dev/shm/kvferry-spin-%u", (unsigned)getuid());
        for (unsigned k = 0; k < seats; k++) {
                snprintf(path, sizeof(path), "%s.%u", prefix, k);
                int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
                if (fd < 0)
                        return kvf_err_set(-errno, "spin seat %s: %s", path, strerror(errno));
                struct stat st;
                if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_uid != getuid()) {
                        close(fd);
                        return kvf_err_set(-EPERM, "spin seat %s is not this user's own file", path);
                }
                if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
                        *s = (struct kvf_spin_seat){.fd = fd, .seat = (int)k, .held = true};
                        return 1;
                }
                int e = errno;
                close(fd);
                if (e != EWOULDBLOCK)
                        return kvf_err_set(-e, "spin seat %s: flock: %s", path, strerror(e));
        }
        return 0;
}

void kvf_spin_seat_drop(struct kvf_spin_seat *s)
{
        if (s->held)
                close(s->fd); /* the lock goes with the last descriptor of its open file */
        *s = (struct kvf_spin_seat){0};
}
