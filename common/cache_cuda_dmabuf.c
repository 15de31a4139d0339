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
 * creation time. Both ends check that the other is the same user
 * (SO_PEERCRED): the name is guessable, the descriptor is not given away.
 * A refusal carries the export's reason.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "cache.h"
#include "err.h"
#include "kvf_gpu.h"

struct offer_msg {
        int32_t err; /* 0: the descriptor comes with it; else -errno and why */
        uint32_t pad;
        uint64_t len;
        char why[240];
};

static int sock_addr(const struct kvf_ctl_header *h, struct sockaddr_un *a, socklen_t *alen)
{
        memset(a, 0, sizeof(*a));
        a->sun_family = AF_UNIX;
        /* Abstract (sun_path[0] = 0): nothing in the file system to leave behind or squat. */
        int n = snprintf(a->sun_path + 1, sizeof(a->sun_path) - 1, "kvferry-dmabuf/%u/%s/%llu", h->owner_uid,
                         h->instance, (unsigned long long)h->created_ns);
        if (n < 0 || (size_t)n >= sizeof(a->sun_path) - 1)
                return kvf_err_set(-ENAMETOOLONG, "dma-buf socket name of instance '%s' too long", h->instance);
        *alen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
        return 0;
}

static bool same_user(int fd)
{
        struct ucred cr;
        socklen_t l = sizeof(cr);
        return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &l) == 0 && cr.uid == getuid();
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
                if (!same_user(c)) {
                        m = (struct offer_msg){.err = -EPERM};
                        snprintf(m.why, sizeof(m.why), "another user asked for this cache's dma-buf");
                }
                struct iovec iov = {&m, sizeof(m)};
                union {
                        char buf[CMSG_SPACE(sizeof(int))];
                        struct cmsghdr align;
                } u;
                struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
                if (m.err == 0) {
                        mh.msg_control = u.buf;
                        mh.msg_controllen = sizeof(u.buf);
                        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
                        cm->cmsg_level = SOL_SOCKET;
                        cm->cmsg_type = SCM_RIGHTS;
                        cm->cmsg_len = CMSG_LEN(sizeof(int));
                        memcpy(CMSG_DATA(cm), &o->dmabuf, sizeof(int));
                }
                (void)!sendmsg(c, &mh, MSG_NOSIGNAL);
                close(c);
        }
}

void kvf_cuda_dmabuf_offer(const struct kvf_ctl_header *h, int device, void *ptr, uint64_t bytes)
{
        static struct offer o = {.lfd = -1, .dmabuf = -1}; /* one cache per allocator process */
        struct sockaddr_un a;
        socklen_t alen = 0; /* set by sock_addr on success; -O3 cannot tell */
        o.msg.len = (bytes + 4095) & ~4095ull;
        int rc = kvf_gpu_dmabuf_export(device, ptr, o.msg.len, &o.dmabuf);
        if (rc < 0) {
                o.msg.err = rc;
                snprintf(o.msg.why, sizeof(o.msg.why), "the allocator could not export it: %s", kvf_gpu_err_msg());
        }
        pthread_t t;
        if (sock_addr(h, &a, &alen) < 0 || (o.lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0)) < 0 ||
            bind(o.lfd, (struct sockaddr *)&a, alen) < 0 || listen(o.lfd, 16) < 0 ||
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
        struct sockaddr_un a;
        socklen_t alen = 0;
        int rc = sock_addr(h, &a, &alen);
        if (rc < 0)
                return rc;
        int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (s < 0)
                return kvf_err_set(-errno, "socket: %s", strerror(errno));
        struct timeval tv = {.tv_sec = 2};
        setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        if (connect(s, (struct sockaddr *)&a, alen) < 0) {
                rc = kvf_err_set(-errno, "the allocator of '%s' offers no dma-buf: %s", h->instance, strerror(errno));
                close(s);
                return rc;
        }
        if (!same_user(s)) {
                close(s);
                return kvf_err_set(-EPERM, "the dma-buf socket of '%s' is another user's", h->instance);
        }
        struct offer_msg m;
        struct iovec iov = {&m, sizeof(m)};
        union {
                char buf[CMSG_SPACE(sizeof(int))];
                struct cmsghdr align;
        } u;
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof(u.buf)};
        ssize_t n = recvmsg(s, &mh, MSG_CMSG_CLOEXEC);
        int e = errno;
        close(s);
        if (n != (ssize_t)sizeof(m))
                return kvf_err_set(-EIO, "the allocator of '%s' sent no dma-buf: %s", h->instance,
                                   n < 0 ? strerror(e) : "short message");
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        if (m.err || !cm || cm->cmsg_type != SCM_RIGHTS || cm->cmsg_len != CMSG_LEN(sizeof(int))) {
                m.why[sizeof(m.why) - 1] = 0;
                return kvf_err_set(m.err ? m.err : -EIO, "%s", m.err ? m.why : "no descriptor came with the answer");
        }
        memcpy(fd, CMSG_DATA(cm), sizeof(int));
        *len = m.len;
        return 0;
}
