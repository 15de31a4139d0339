/* The allocator's registry of the engine's caches (registry.h). */
#include "registry.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

#include "atomics.h"
#include "cache.h"
#include "err.h"
#include "fdpass.h"
#include "layout.h"
#include "log.h"
#include "registration.h"

/* The registration held: only the registry's thread touches it. */
static struct {
        struct kvf_ctl *ctl;
        int lfd, pidfd, stop_pipe[2];
        pthread_t thread;
        bool held;
        pid_t pid;
        uint32_t nr;
        int fds[KVF_FDPASS_MAX];
        void *map[KVF_FDPASS_MAX];
        uint64_t maplen[KVF_FDPASS_MAX];
        struct kvf_reg_wire_region rg[KVF_FDPASS_MAX];
        struct kvf_reg_placed *placed;
        uint32_t nplaced;
        /* GPU memory: each region's IPC handle, and its open here (held: the handles are
         * proven to name live allocations, and what the roles open is what was checked) */
        bool gpu;
        int device;
        uint8_t (*handles)[KVF_REG_HANDLE_SIZE];
        void *opened[KVF_FDPASS_MAX];
} R = {.lfd = -1, .pidfd = -1, .stop_pipe = {-1, -1}};

static void publish(bool held, pid_t pid, uint64_t bytes, uint32_t token_major, bool strided)
{
        struct kvf_ctl_header *h = R.ctl->hdr;
        h->reg_pid = held ? pid : 0;
        h->reg_regions = held ? R.nr : 0;
        h->reg_bytes = bytes;
        h->reg_token_major = token_major;
        h->reg_strided = strided;
        /* Release: the fields above are seen by whoever acquires the new generation
         * (kvf_reg_map, status); a role's mapping of the previous one is stale from here. */
        kvf_store_release(&h->reg_generation, kvf_load_relaxed(&h->reg_generation) + 1);
}

static void drop(const char *why)
{
        if (!R.held)
                return;
        kvf_info("engine caches: dropped the registration of pid %d (%u regions): %s", (int)R.pid,
                 R.nr, why);
        if (R.gpu) {
#ifdef KVF_HAVE_CUDA
                kvf_cache_cuda_reg_close(R.device, R.opened, R.nr);
#endif
                free(R.handles);
                R.handles = NULL;
                R.gpu = false;
        }
        for (uint32_t i = 0; i < R.nr && R.fds[i] >= 0; i++) {
                if (R.map[i]) /* (GPU memory: a dma-buf, never mapped here) */
                        munmap(R.map[i], R.maplen[i]);
                close(R.fds[i]);
        }
        if (R.pidfd >= 0)
                close(R.pidfd);
        R.pidfd = -1;
        free(R.placed);
        R.placed = NULL;
        R.held = false;
        R.nr = 0;
        publish(false, 0, 0, 0, false);
}

static void answer(int c, int err, const char *why)
{
        struct kvf_reg_msg a = {.err = err,
                                .generation = kvf_load_acquire(&R.ctl->hdr->reg_generation)};
        if (why)
                snprintf(a.why, sizeof(a.why), "%s", why);
        (void)kvf_fdpass_send(c, &a, sizeof(a), NULL, 0);
}

static bool alive(pid_t pid)
{
        return kill(pid, 0) == 0 || errno == EPERM;
}

static void do_register(int c, pid_t pid, const uint8_t *buf, size_t n, int *fds, unsigned nfds)
{
        const struct kvf_cache_layout *L = &R.ctl->hdr->layout;
        struct kvf_reg_msg q;
        char why[KVF_REASON_MAX] = "";
        uint64_t size[KVF_FDPASS_MAX];
        int rc = 0;

        memcpy(&q, buf, sizeof(q));
        bool gpu = q.device >= 0;
        size_t need = sizeof(q) + (size_t)q.n_regions * sizeof(struct kvf_reg_wire_region) +
                      (size_t)q.n_views * sizeof(struct kvf_reg_wire_view) +
                      (gpu ? (size_t)q.n_regions * KVF_REG_HANDLE_SIZE : 0);
        /* (GPU memory: each allocation's dma-buf comes along when the engine could export it) */
        if (q.n_regions > KVF_FDPASS_MAX || q.n_views > KVF_REG_MAX_VIEWS || n != need ||
            (nfds != q.n_regions && !(gpu && nfds == 0))) {
                snprintf(
                    why, sizeof(why),
                    "a malformed registration: %u regions, %u descriptors, %u views in %zu bytes",
                    q.n_regions, nfds, q.n_views, n);
                rc = -EPROTO;
                goto out;
        }
        if ((rc = kvf_reg_check_device(R.ctl->hdr, q.device, q.uuid, why, sizeof(why))) < 0)
                goto out;
        if (R.held && R.pid != pid && alive(R.pid)) {
                snprintf(why, sizeof(why),
                         "pid %d registered caches already: it unregisters (or ends) first",
                         (int)R.pid);
                rc = -EBUSY;
                goto out;
        }
        bool dmabufs = gpu && nfds > 0;
        for (uint32_t i = 0; i < q.n_regions && gpu; i++) {
                const struct kvf_reg_wire_region *g =
                    (const struct kvf_reg_wire_region *)(buf + sizeof(q)) + i;
                /* An allocation is named by its handle from its start: no offset into it. */
                size[i] = g->fd_offset ? 0 : g->bytes;
                /* Its dma-buf (for NICs): the allocation's size at least, or none is kept. */
                off_t end = dmabufs ? lseek(fds[i], 0, SEEK_END) : -1;
                if (dmabufs && (end < 0 || (uint64_t)end < g->bytes)) {
                        kvf_warn("engine caches: the dma-buf of allocation %u is %lld bytes, not %llu: "
                                 "the registration keeps none (NICs register the memory as peer memory)",
                                 i, (long long)end, (unsigned long long)g->bytes);
                        dmabufs = false;
                }
        }
        for (uint32_t i = 0; i < q.n_regions && !gpu; i++) {
                struct stat st;
                if (fstat(fds[i], &st) < 0 || !S_ISREG(st.st_mode)) {
                        snprintf(why, sizeof(why),
                                 "region %u: foreign memory: its descriptor is not a file of "
                                 "shared memory (give a memfd or a /dev/shm file)",
                                 i);
                        rc = -EINVAL;
                        goto out;
                }
                size[i] = (uint64_t)st.st_size;
        }
        /* Sealed against shrinking where the file allows it (a memfd made with
         * MFD_ALLOW_SEALING): a file that shrinks under the roles' mappings makes their copies
         * fault (each such copy fails, common/busguard.h); a sealed one cannot. A /dev/shm file
         * or a memfd without sealing is taken as it is. */
        uint32_t sealed = 0;
        for (uint32_t i = 0; i < q.n_regions && !gpu; i++) {
                int seals = fcntl(fds[i], F_GET_SEALS);
                if (seals >= 0 && ((seals & F_SEAL_SHRINK) || fcntl(fds[i], F_ADD_SEALS, F_SEAL_SHRINK) == 0))
                        sealed++;
        }
        const struct kvf_reg_wire_region *rg = (const void *)(buf + sizeof(q));
        const struct kvf_reg_wire_view *v = (const void *)(rg + q.n_regions);
        uint32_t want = kvf_layout_layers(L) * kvf_layout_tensors(L);
        struct kvf_reg_placed *pl = calloc(want ? want : 1, sizeof(*pl));
        bool strided = false;
        if (!pl) {
                rc = -ENOMEM;
                snprintf(why, sizeof(why), "out of memory");
                goto out;
        }
        if ((rc = kvf_reg_validate(L, rg, q.n_regions, size, v, q.n_views, pl, &strided, why,
                                   sizeof(why))) < 0) {
                free(pl);
                goto out;
        }
        /* Map each region once: one that cannot be mapped is refused now, not at a role. */
        void *map[KVF_FDPASS_MAX], *opened[KVF_FDPASS_MAX];
        uint64_t len[KVF_FDPASS_MAX], bytes = 0;
        long page = sysconf(_SC_PAGESIZE);
        const uint8_t *handles = (const uint8_t *)(v + q.n_views);
        int device = -1;
        uint8_t(*hcopy)[KVF_REG_HANDLE_SIZE] = NULL;
        if (gpu) {
#ifdef KVF_HAVE_CUDA
                device = kvf_cache_cuda_device_of(R.ctl->hdr->cuda_uuid);
                if (device < 0) {
                        snprintf(why, sizeof(why), "the instance's GPU is not visible to its allocator");
                        rc = -ENODEV;
                } else if (!(hcopy = malloc((size_t)q.n_regions * KVF_REG_HANDLE_SIZE))) {
                        snprintf(why, sizeof(why), "out of memory");
                        rc = -ENOMEM;
                } else {
                        /* A process opens an allocation once: the registration it replaces
                         * (maybe of the same allocations) is closed first. */
                        drop("a new registration replaces it");
                        rc = kvf_cache_cuda_reg_hold(device, handles, q.n_regions, opened, why,
                                                     sizeof(why));
                }
#else
                snprintf(why, sizeof(why), "GPU memory: this build has no CUDA");
                rc = -ENOTSUP;
#endif
                if (rc < 0) {
                        free(hcopy);
                        free(pl);
                        goto out;
                }
                memcpy(hcopy, handles, (size_t)q.n_regions * KVF_REG_HANDLE_SIZE);
        }
        for (uint32_t i = 0; i < q.n_regions; i++) {
                if (gpu) {
                        map[i] = NULL;
                        len[i] = 0;
                        bytes += rg[i].bytes;
                        continue;
                }
                uint64_t al = rg[i].fd_offset & ~(uint64_t)(page - 1);
                len[i] = rg[i].bytes + (rg[i].fd_offset - al);
                map[i] = mmap(NULL, len[i], PROT_READ, MAP_SHARED, fds[i], (off_t)al);
                if (map[i] == MAP_FAILED) {
                        snprintf(why, sizeof(why), "region %u cannot be mapped: %s", i,
                                 strerror(errno));
                        while (i--)
                                munmap(map[i], len[i]);
                        free(pl);
                        rc = -EINVAL;
                        goto out;
                }
                bytes += rg[i].bytes;
        }
        int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
        if (pidfd < 0)
                kvf_warn("engine caches: pidfd_open(%d): %s: its end is noticed by polling",
                         (int)pid, strerror(errno));
        drop("a new registration replaces it");
        R.held = true;
        R.pid = pid;
        R.pidfd = pidfd;
        R.nr = q.n_regions;
        R.gpu = gpu;
        R.device = device;
        R.handles = hcopy;
        for (uint32_t i = 0; i < q.n_regions; i++) {
                R.opened[i] = gpu ? opened[i] : NULL;
                R.fds[i] = gpu && !dmabufs ? -1 : fds[i];
                if (!gpu || dmabufs)
                        fds[i] = -1; /* kept */
                R.map[i] = map[i];
                R.maplen[i] = len[i];
                R.rg[i] = (struct kvf_reg_wire_region){.bytes = rg[i].bytes,
                                                       .fd_offset = rg[i].fd_offset};
        }
        R.placed = pl;
        R.nplaced = want;
        publish(true, pid, bytes, q.token_major, strided);
        kvf_info("engine caches: registered by pid %d: %u regions (%u sealed against shrinking), %llu "
                 "bytes, %u views%s%s%s, generation %llu",
                 (int)pid, q.n_regions, sealed, (unsigned long long)bytes, q.n_views,
                 strided ? ", strided blocks" : "", q.token_major ? ", token-major blocks" : "",
                 !gpu ? "" : dmabufs ? ", each allocation's dma-buf kept for NICs" : ", no dma-buf",
                 (unsigned long long)R.ctl->hdr->reg_generation);
out:
        if (rc < 0)
                kvf_warn("engine caches: refused the registration of pid %d: %s", (int)pid, why);
        answer(c, rc, rc < 0 ? why : NULL);
}

static void do_fetch(int c)
{
        if (!R.held) {
                answer(c, -EAGAIN, "waiting for the engine's caches");
                return;
        }
        size_t n = sizeof(struct kvf_reg_msg) + R.nr * sizeof(struct kvf_reg_wire_region) +
                   R.nplaced * sizeof(struct kvf_reg_placed) + (R.gpu ? R.nr * KVF_REG_HANDLE_SIZE : 0);
        uint8_t *buf = malloc(n);
        if (!buf) {
                answer(c, -ENOMEM, "out of memory");
                return;
        }
        struct kvf_reg_msg a = {.n_regions = R.nr,
                                .n_views = R.nplaced,
                                .token_major = R.ctl->hdr->reg_token_major,
                                .device = R.gpu ? R.device : -1,
                                .generation = kvf_load_acquire(&R.ctl->hdr->reg_generation)};
        if (R.gpu)
                memcpy(a.uuid, R.ctl->hdr->cuda_uuid, sizeof(a.uuid));
        memcpy(buf, &a, sizeof(a));
        memcpy(buf + sizeof(a), R.rg, R.nr * sizeof(struct kvf_reg_wire_region));
        memcpy(buf + sizeof(a) + R.nr * sizeof(struct kvf_reg_wire_region), R.placed,
               R.nplaced * sizeof(struct kvf_reg_placed));
        if (R.gpu)
                memcpy(buf + n - R.nr * KVF_REG_HANDLE_SIZE, R.handles, R.nr * KVF_REG_HANDLE_SIZE);
        bool fds = !R.gpu || R.fds[0] >= 0; /* (GPU memory: the dma-bufs, when kept) */
        (void)kvf_fdpass_send(c, buf, n, fds ? R.fds : NULL, fds ? R.nr : 0);
        free(buf);
}

static void serve_one(int c)
{
        pid_t pid = 0;
        int fds[KVF_FDPASS_MAX];
        unsigned nfds = 0;
        uint8_t *buf = malloc(KVF_REG_MSG_MAX);
        if (!buf)
                return;
        if (kvf_fdpass_peer(c, &pid) < 0) {
                answer(c, -EPERM, "another user asked for this instance's caches");
                goto out;
        }
        ssize_t n = kvf_fdpass_recv(c, buf, KVF_REG_MSG_MAX, fds, KVF_FDPASS_MAX, &nfds);
        if (n < (ssize_t)sizeof(struct kvf_reg_msg)) {
                if (n >= 0)
                        answer(c, -EPROTO, "a message shorter than its header");
                else
                        answer(c, (int)n, kvf_err_msg());
                goto out;
        }
        uint32_t op;
        memcpy(&op, buf, sizeof(op));
        if (op == KVF_REG_REGISTER) {
                do_register(c, pid, buf, (size_t)n, fds, nfds);
        } else if (op == KVF_REG_UNREGISTER) {
                if (R.held && R.pid == pid) {
                        drop("unregistered");
                        answer(c, 0, NULL);
                } else {
                        answer(c, R.held ? -EPERM : -ENOENT,
                               R.held ? "the caches were registered by another process"
                                      : "no caches registered");
                }
        } else if (op == KVF_REG_FETCH) {
                do_fetch(c);
        } else {
                answer(c, -EPROTO, "unknown request");
        }
out:
        for (unsigned i = 0; i < nfds; i++)
                if (fds[i] >= 0)
                        close(fds[i]);
        free(buf);
}

static void *run(void *arg)
{
        (void)arg;
        for (;;) {
                struct pollfd p[3] = {
                    {R.lfd, POLLIN, 0}, {R.stop_pipe[0], POLLIN, 0}, {R.pidfd, POLLIN, 0}};
                int n = poll(p, R.pidfd >= 0 ? 3 : 2, 500);
                if (n < 0 && errno != EINTR)
                        break;
                if (p[1].revents)
                        break;
                /* A pidfd is readable once the process has ended; without one, ask. */
                if (R.held && ((R.pidfd >= 0 && p[2].revents) || (R.pidfd < 0 && !alive(R.pid))))
                        drop("the registering process ended");
                if (p[0].revents & POLLIN) {
                        int c = accept4(R.lfd, NULL, NULL, SOCK_CLOEXEC);
                        if (c >= 0) {
                                struct timeval tv = {.tv_sec = 2};
                                setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
                                setsockopt(c, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
                                serve_one(c);
                                close(c);
                        }
                }
        }
        return NULL;
}

int kvf_registry_start(struct kvf_ctl *ctl)
{
        char name[160];
        int rc = kvf_reg_sock_name(ctl->hdr, name, sizeof(name));
        if (rc < 0)
                return rc;
        R.ctl = ctl;
        if ((R.lfd = kvf_fdpass_listen(name)) < 0)
                return kvf_err_ctx(R.lfd, "the engine caches' registration socket");
        if (pipe2(R.stop_pipe, O_CLOEXEC) < 0 || pthread_create(&R.thread, NULL, run, NULL) != 0) {
                rc = kvf_err_set(-errno ? -errno : -EAGAIN, "start the registry: %s",
                                 strerror(errno));
                close(R.lfd);
                R.lfd = -1;
                return rc;
        }
        return 0;
}

void kvf_registry_stop(void)
{
        if (R.lfd < 0)
                return;
        (void)!write(R.stop_pipe[1], "x", 1);
        pthread_join(R.thread, NULL);
        drop("the allocator stops");
        close(R.lfd);
        R.lfd = -1;
}
