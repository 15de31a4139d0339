/*
 * The GPU cache's dma-buf, from the process that allocated it to the roles
 * that register it with a NIC (GPUDirect RDMA, connector/rdma_mr.c).
 *
 * Why the allocator: the CUDA driver exports a dma-buf only for memory the
 * calling process allocated; for a mapping of another process's IPC handle
 * it answers "invalid argument" (driver 580 on an H200, docs/BENCHMARKS.md
 * section 4). So the allocator exports the whole allocation once, at
 * create, and hands a duplicate of the descriptor (SCM_RIGHTS) to whoever
 * asks over an abstract unix socket named after the instance and its
 * creation time (fdpass.h: both ends check that the other is the same user,
 * since the name is guessable). A refusal carries the export's reason.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "cache.h"
#include "err.h"
#include "fdpass.h"
#include "kvf_gpu.h"

struct offer_msg {
        int32_t err; /* 0: the descriptor comes with it; else -errno and why */
        uint32_t pad;
        uint64_t len;
        char why[240];
};

static int sock_name(const struct kvf_ctl_header *h, char *out, size_t len)
{
        int n = snprintf(out, len, "kvferry-dmabuf/%u/%s/%llu", h->owner_uid, h->instance,
                         (unsigned long long)h->created_ns);
        if (n < 0 || (size_t)n >= len)
                return kvf_err_set(-ENAMETOOLONG, "dma-buf socket name of instance '%s' too long", h->instance);
        return 0;
}

struct offer {
        int lfd, dmabuf;
        struct offer_msg msg;
};

static void *serve(void *arg)
{
        struct offer *o = arg;
        for (;;) {
                int c = accept4(o->lfd, NULL, NULL, SOCK_CLOEXEC);
                if (c < 0) {
                        if (errno == EINTR || errno == ECONNABORTED)
                                continue;
                        return NULL;
                }
                struct offer_msg m = o->msg;
                if (kvf_fdpass_peer(c, NULL) < 0) {
                        m = (struct offer_msg){.err = -EPERM};
                        snprintf(m.why, sizeof(m.why), "another user asked for this cache's dma-buf");
                }
                (void)kvf_fdpass_send(c, &m, sizeof(m), &o->dmabuf, m.err == 0 ? 1 : 0);
                close(c);
        }
}

void kvf_cuda_dmabuf_offer(const struct kvf_ctl_header *h, int device, void *ptr, uint64_t bytes)
{
        static struct offer o = {.lfd = -1, .dmabuf = -1}; /* one cache per allocator process */
        char name[160];
        o.msg.len = (bytes + 4095) & ~4095ull;
        int rc = kvf_gpu_dmabuf_export(device, ptr, o.msg.len, &o.dmabuf);
        if (rc < 0) {
                o.msg.err = rc;
                snprintf(o.msg.why, sizeof(o.msg.why), "the allocator could not export it: %s", kvf_gpu_err_msg());
        }
        pthread_t t;
        if (sock_name(h, name, sizeof(name)) < 0 || (o.lfd = kvf_fdpass_listen(name)) < 0 ||
            pthread_create(&t, NULL, serve, &o) != 0) {
                /* Nobody will be told why from here: the roles' own export attempt says it. */
                if (o.lfd >= 0)
                        close(o.lfd);
                o.lfd = -1;
                return;
        }
        pthread_detach(t);
}

int kvf_cuda_dmabuf_fetch(const struct kvf_ctl_header *h, int *fd, uint64_t *len)
{
        char name[160];
        int rc = sock_name(h, name, sizeof(name));
        if (rc < 0)
                return rc;
        int s = kvf_fdpass_connect(name, 2000);
        if (s < 0)
                return kvf_err_ctx(s, "the allocator of '%s' offers no dma-buf", h->instance);
        struct offer_msg m;
        unsigned nfds = 0;
        ssize_t n = kvf_fdpass_recv(s, &m, sizeof(m), fd, 1, &nfds);
        close(s);
        if (n < 0)
                return kvf_err_ctx((int)n, "the allocator of '%s' sent no dma-buf", h->instance);
        if (n != (ssize_t)sizeof(m) || m.err || nfds != 1) {
                if (nfds)
                        close(*fd);
                m.why[sizeof(m.why) - 1] = 0;
                if (n == (ssize_t)sizeof(m) && m.err)
                        return kvf_err_set(m.err, "%s", m.why);
                return kvf_err_set(-EIO, "the allocator of '%s' sent no dma-buf: %s", h->instance,
                                   n != (ssize_t)sizeof(m) ? "short message" : "no descriptor came with the answer");
        }
        *len = m.len;
        return 0;
}
