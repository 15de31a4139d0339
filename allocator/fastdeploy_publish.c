/*
 * FastDeploy's cache records (fastdeploy_publish.h says what and why).
 */
#include "fastdeploy_publish.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "err.h"
#include "layout.h"

#define HANDLE_BYTES 64

/* FastDeploy's record: a size_t, then the 64-byte cudaIpcMemHandle_t (72 bytes). */
struct fd_record {
        uint64_t nprocesses;
        uint8_t handle[HANDLE_BYTES];
};
_Static_assert(sizeof(struct fd_record) == 72, "FastDeploy's record is 72 bytes");

static const char *shm_dir(void)
{
        const char *d = getenv("KVFERRY_FD_SHM_DIR"); /* tests only */
        return d && d[0] ? d : "/dev/shm";
}

/* FastDeploy's name of handle i (kvf_layout_offset order: every layer's K/V, then their scale
 * tensors, key_cache_scales_{layer}_... and value_cache_scales_...); with FD_IPC_APPEND_SUFFIX
 * set (FastDeploy's own variable, for two instances on one GPU) ".<suffix>" follows. */
static void record_name(const struct kvf_ctl_header *h, uint32_t i, char *out, size_t len)
{
        uint32_t t = kvf_layout_tensors(&h->layout), kv = kvf_layout_layers(&h->layout) * t;
        bool scale = i >= kv;
        const char *sfx = getenv("FD_IPC_APPEND_SUFFIX");
        bool dot = sfx && sfx[0] && !strchr(sfx, '/');
        if (scale)
                i -= kv;
        snprintf(out, len, "%s_cache%s_%u_rank%u.device%u%s%s", i % t ? "value" : "key",
                 scale ? "_scales" : "s", i / t, h->rank, h->device, dot ? "." : "", dot ? sfx : "");
}

static const uint8_t *handle_of(const struct kvf_ctl_header *h, uint32_t i)
{
        return (const uint8_t *)h + h->cuda_handles_off + (uint64_t)i * HANDLE_BYTES;
}

int kvf_fd_publish(const struct kvf_ctl_header *h)
{
        char name[160], path[320], tmp[360];
        for (uint32_t i = 0; i < h->cuda_handles_count; i++) {
                struct fd_record r = {.nprocesses = 1};
                memcpy(r.handle, handle_of(h, i), HANDLE_BYTES);
                record_name(h, i, name, sizeof(name));
                snprintf(path, sizeof(path), "%s/%s", shm_dir(), name);
                snprintf(tmp, sizeof(tmp), "%s/.%s.%d", shm_dir(), name, (int)getpid());
                int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
                if (fd < 0)
                        return kvf_err_set(-errno, "FastDeploy record %s: %s", tmp,
                                           strerror(errno));
                ssize_t n = write(fd, &r, sizeof(r));
                int e = n == (ssize_t)sizeof(r) ? 0 : (n < 0 ? errno : EIO);
                close(fd);
                /* rename: a worker opening the name sees the old record or the new, never half */
                if (e || rename(tmp, path) < 0) {
                        e = e ? e : errno;
                        unlink(tmp);
                        return kvf_err_set(-e, "FastDeploy record %s: %s", path, strerror(e));
                }
        }
        return 0;
}

void kvf_fd_unpublish(const struct kvf_ctl_header *h)
{
        char name[160], path[320];
        for (uint32_t i = 0; i < h->cuda_handles_count; i++) {
                struct fd_record r;
                record_name(h, i, name, sizeof(name));
                snprintf(path, sizeof(path), "%s/%s", shm_dir(), name);
                int fd = open(path, O_RDONLY | O_CLOEXEC);
                if (fd < 0)
                        continue;
                ssize_t n = read(fd, &r, sizeof(r));
                close(fd);
                if (n == (ssize_t)sizeof(r) && !memcmp(r.handle, handle_of(h, i), HANDLE_BYTES))
                        unlink(path);
        }
}
