/* The CPUs this process may use (cpus.h). */
#include "cpus.h"

#include <errno.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

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
