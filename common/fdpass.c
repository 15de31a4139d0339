/* Descriptors between processes of one user over abstract unix sockets (fdpass.h). */
#include "fdpass.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "err.h"

static int addr_of(const char *name, struct sockaddr_un *a, socklen_t *alen)
{
        memset(a, 0, sizeof(*a));
        a->sun_family = AF_UNIX;
        size_t n = strlen(name);
        if (n == 0 || n >= sizeof(a->sun_path) - 1)
                return kvf_err_set(-ENAMETOOLONG, "socket name '%s' is empty or too long", name);
        memcpy(a->sun_path + 1, name, n); /* sun_path[0] = 0: abstract */
        *alen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
        return 0;
}

int kvf_fdpass_listen(const char *name)
{
        struct sockaddr_un a;
        socklen_t alen = 0;
        int rc = addr_of(name, &a, &alen);
        if (rc < 0)
                return rc;
        int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (s < 0)
                return kvf_err_set(-errno, "socket: %s", strerror(errno));
        if (bind(s, (struct sockaddr *)&a, alen) < 0 || listen(s, 16) < 0) {
                rc = kvf_err_set(-errno, "listen on @%s: %s", name, strerror(errno));
                close(s);
                return rc;
        }
        return s;
}

int kvf_fdpass_peer(int s, pid_t *pid)
{
        struct ucred cr;
        socklen_t l = sizeof(cr);
        if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cr, &l) < 0)
                return kvf_err_set(-errno, "SO_PEERCRED: %s", strerror(errno));
        if (cr.uid != getuid())
                return kvf_err_set(-EPERM, "the other end is uid %u, we run as uid %u",
                                   (unsigned)cr.uid, (unsigned)getuid());
        if (pid)
                *pid = cr.pid;
        return 0;
}

int kvf_fdpass_connect(const char *name, int timeout_ms)
{
        struct sockaddr_un a;
        socklen_t alen = 0;
        int rc = addr_of(name, &a, &alen);
        if (rc < 0)
                return rc;
        int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (s < 0)
                return kvf_err_set(-errno, "socket: %s", strerror(errno));
        struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
        setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
        if (connect(s, (struct sockaddr *)&a, alen) < 0) {
                rc = kvf_err_set(-errno, "connect to @%s: %s", name, strerror(errno));
                close(s);
                return rc;
        }
        if ((rc = kvf_fdpass_peer(s, NULL)) < 0) {
                close(s);
                return kvf_err_ctx(rc, "@%s", name);
        }
        return s;
}

int kvf_fdpass_send(int s, const void *buf, size_t len, const int *fds, unsigned nfds)
{
        if (nfds > KVF_FDPASS_MAX)
                return kvf_err_set(-E2BIG, "%u descriptors in one message, at most %u", nfds,
                                   KVF_FDPASS_MAX);
        struct iovec iov = {(void *)buf, len};
        union {
                char buf[CMSG_SPACE(sizeof(int) * KVF_FDPASS_MAX)];
                struct cmsghdr align;
        } u;
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
        if (nfds) {
                mh.msg_control = u.buf;
                mh.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
                struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
                cm->cmsg_level = SOL_SOCKET;
                cm->cmsg_type = SCM_RIGHTS;
                cm->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
                memcpy(CMSG_DATA(cm), fds, sizeof(int) * nfds);
        }
        ssize_t n = sendmsg(s, &mh, MSG_NOSIGNAL);
        if (n < 0)
                return kvf_err_set(-errno, "send: %s", strerror(errno));
        if ((size_t)n != len)
                return kvf_err_set(-EMSGSIZE, "sent %zd of %zu bytes", n, len);
        return 0;
}

ssize_t kvf_fdpass_recv(int s, void *buf, size_t cap, int *fds, unsigned maxfds, unsigned *nfds)
{
        struct iovec iov = {buf, cap};
        union {
                char buf[CMSG_SPACE(sizeof(int) * KVF_FDPASS_MAX)];
                struct cmsghdr align;
        } u;
        struct msghdr mh = {.msg_iov = &iov,
                            .msg_iovlen = 1,
                            .msg_control = u.buf,
                            .msg_controllen = sizeof(u.buf)};
        *nfds = 0;
        ssize_t n = recvmsg(s, &mh, MSG_CMSG_CLOEXEC);
        if (n < 0)
                return kvf_err_set(-errno, "receive: %s", strerror(errno));
        unsigned got = 0;
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
                if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
                        continue;
                unsigned k = (unsigned)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
                for (unsigned i = 0; i < k; i++) {
                        int fd;
                        memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
                        if (got < maxfds)
                                fds[got++] = fd;
                        else
                                close(fd);
                }
        }
        if (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
                for (unsigned i = 0; i < got; i++)
                        close(fds[i]);
                return kvf_err_set(-EMSGSIZE, "a message of more than %zu bytes or %u descriptors",
                                   cap, maxfds);
        }
        *nfds = got;
        return n;
}
