#include "net.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "clock.h"
#include "ctl.h"
#include "err.h"

int kvf_net_parse(const char *s, char *host, size_t hostlen, uint16_t *port)
{
        const char *colon;
        size_t hl;
        if (s[0] == '[') {
                const char *end = strchr(s, ']');
                if (!end || end[1] != ':')
                        return kvf_err_set(-EINVAL, "address '%s': expected [ipv6]:port", s);
                hl = (size_t)(end - s - 1);
                s++;
                colon = end + 1;
        } else {
                colon = strrchr(s, ':');
                if (!colon)
                        return kvf_err_set(-EINVAL, "address '%s': expected host:port", s);
                hl = (size_t)(colon - s);
        }
        if (hl == 0 || hl >= hostlen)
                return kvf_err_set(-EINVAL, "address '%s': bad host part", s);
        memcpy(host, s, hl);
        host[hl] = '\0';
        char *end;
        errno = 0;
        unsigned long p = strtoul(colon + 1, &end, 10);
        if (errno || end == colon + 1 || *end || p > 65535)
                return kvf_err_set(-EINVAL, "address '%s': port must be 0 to 65535", s);
        *port = (uint16_t)p;
        return 0;
}

/* "connect to [::1]:7100" as the address was given, brackets and all, for messages. */
#define ADDR_FMT(host) (strchr(host, ':') ? "[" : ""), host, (strchr(host, ':') ? "]" : "")

static int resolve(const char *host, uint16_t port, bool passive, struct addrinfo **res)
{
        struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                                 .ai_flags = passive ? AI_PASSIVE : 0};
        char ps[8];
        snprintf(ps, sizeof(ps), "%u", port);
        int rc = getaddrinfo(host, ps, &hints, res);
        if (rc != 0)
                return kvf_err_set(-EHOSTUNREACH, "resolve '%s': %s", host, gai_strerror(rc));
        return 0;
}

int kvf_net_listen(const char *host, uint16_t port, int backlog, uint16_t *bound_port)
{
        struct addrinfo *res;
        int rc = resolve(host, port, true, &res), fd = -1;
        if (rc < 0)
                return rc;
        rc = -EADDRNOTAVAIL;
        for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
                fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, 0);
                if (fd < 0)
                        continue;
                int one = 1;
                setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
                if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, backlog) == 0) {
                        rc = 0;
                        break;
                }
                rc = -errno;
                close(fd);
                fd = -1;
        }
        freeaddrinfo(res);
        if (rc < 0)
                return kvf_err_set(rc, "listen on %s:%u: %s", host, port, strerror(-rc));
        struct sockaddr_storage ss;
        socklen_t sl = sizeof(ss);
        getsockname(fd, (struct sockaddr *)&ss, &sl);
        *bound_port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                     : ((struct sockaddr_in *)&ss)->sin_port);
        return fd;
}

static void tune(int fd)
{
        int one = 1, idle = 2, intvl = 1, cnt = 3;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        /* Kernel keepalive as a backstop; the connectors also ping each other. */
        setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
        setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
        setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
        setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
}

int kvf_net_accept(int listen_fd, bool tcp)
{
        int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0)
                return -errno;
        if (tcp)
                tune(fd);
        return fd;
}

static int wait_fd(int fd, short ev, uint64_t end)
{
        uint64_t now = kvf_now_ns();
        if (now >= end)
                return -ETIMEDOUT;
        struct pollfd p = {.fd = fd, .events = ev};
        int ms = (int)((end - now + KVF_NS_PER_MS - 1) / KVF_NS_PER_MS);
        int n = poll(&p, 1, ms);
        if (n < 0)
                return errno == EINTR ? 0 : -errno;
        if (n == 0)
                return -ETIMEDOUT;
        return 0;
}

/* "uid 65534 (nobody)": for messages about who owns what. */
static void owner_name(uid_t uid, char *buf, size_t len)
{
        struct passwd pw, *res = NULL;
        char tmp[1024];
        if (getpwuid_r(uid, &pw, tmp, sizeof(tmp), &res) == 0 && res)
                snprintf(buf, len, "uid %u (%s)", (unsigned)uid, res->pw_name);
        else
                snprintf(buf, len, "uid %u", (unsigned)uid);
}

static void sock_dir_name(char *dir, size_t len)
{
        snprintf(dir, len, "/dev/shm/kvferry-sock.%u", (unsigned)geteuid());
}

/*
 * The socket directory is ours to use only if it is a real directory (lstat:
 * not a symlink to one), owned by us, mode 0700: then no other user can
 * enter it, so no one else can bind a name in it, connect to what we bound,
 * or swap it (/dev/shm is sticky: only its owner may rename or remove it).
 * 0, -ENOENT if it does not exist, or -EPERM with kvf_err naming what is wrong.
 */
static int sock_dir_check(const char *dir)
{
        struct stat st;
        char who[96];
        if (lstat(dir, &st) < 0)
                return kvf_err_set(-errno, "unix socket directory %s: %s", dir, strerror(errno));
        owner_name(st.st_uid, who, sizeof(who));
        if (S_ISLNK(st.st_mode))
                return kvf_err_set(-EPERM, "unix socket directory %s is a symbolic link made by %s, not a directory",
                                   dir, who);
        if (!S_ISDIR(st.st_mode))
                return kvf_err_set(-EPERM, "unix socket directory %s is not a directory (owned by %s)", dir, who);
        if (st.st_uid != geteuid())
                return kvf_err_set(-EPERM, "unix socket directory %s is owned by %s, not by us (uid %u)", dir, who,
                                   (unsigned)geteuid());
        if ((st.st_mode & 07777) != 0700)
                return kvf_err_set(-EPERM, "unix socket directory %s has mode %04o, not 0700", dir,
                                   (unsigned)(st.st_mode & 07777));
        return 0;
}

int kvf_net_unix_path(const char *instance, char *buf, size_t len)
{
        char dir[64];
        int rc = kvf_instance_name_check(instance); /* no '/', no "..": a name, not a path */
        if (rc < 0)
                return rc;
        sock_dir_name(dir, sizeof(dir));
        int n = snprintf(buf, len, "%s/%s.ctl", dir, instance);
        if (n < 0 || (size_t)n >= len)
                return kvf_err_set(-ENAMETOOLONG, "unix socket path %s/%s.ctl is too long", dir, instance);
        return 0;
}

static int unix_addr(const char *instance, struct sockaddr_un *a)
{
        memset(a, 0, sizeof(*a));
        a->sun_family = AF_UNIX;
        return kvf_net_unix_path(instance, a->sun_path, sizeof(a->sun_path));
}

int kvf_net_listen_unix(const char *instance, struct kvf_unix_listener *ul)
{
        struct sockaddr_un a;
        struct stat st;
        char dir[64];
        int rc, fd;

        memset(ul, 0, sizeof(*ul));
        ul->fd = -1;
        if ((rc = unix_addr(instance, &a)) < 0)
                return rc;
        sock_dir_name(dir, sizeof(dir));
        /* Ours if we make it. chmod: the umask must not narrow 0700 (it cannot widen it). */
        if (mkdir(dir, 0700) == 0)
                chmod(dir, 0700);
        else if (errno != EEXIST)
                return kvf_err_set(-errno, "create unix socket directory %s: %s", dir, strerror(errno));
        if ((rc = sock_dir_check(dir)) < 0)
                return rc;
        /* A socket left by a predecessor that did not stop cleanly. The role claim (one
         * connector per instance) means no live connector of this instance bound it. */
        if (lstat(a.sun_path, &st) == 0) {
                if (!S_ISSOCK(st.st_mode))
                        return kvf_err_set(-EEXIST, "%s exists and is not a socket: leaving it alone", a.sun_path);
                if (unlink(a.sun_path) < 0)
                        return kvf_err_set(-errno, "remove the stale socket %s: %s", a.sun_path, strerror(errno));
        }
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0)
                return kvf_err_set(-errno, "unix socket: %s", strerror(errno));
        if (bind(fd, (struct sockaddr *)&a, sizeof(a)) < 0 || listen(fd, 128) < 0) {
                rc = -errno;
                close(fd);
                return kvf_err_set(rc, "listen on unix socket %s: %s", a.sun_path, strerror(-rc));
        }
        /* Remembered so that a clean stop removes this socket and nothing that replaced it. */
        if (lstat(a.sun_path, &st) == 0) {
                ul->dev = st.st_dev;
                ul->ino = st.st_ino;
        }
        snprintf(ul->path, sizeof(ul->path), "%s", a.sun_path);
        ul->fd = fd;
        return fd;
}

void kvf_net_close_unix(struct kvf_unix_listener *ul)
{
        struct stat st;
        if (ul->fd < 0)
                return;
        if (lstat(ul->path, &st) == 0 && st.st_dev == ul->dev && st.st_ino == ul->ino)
                unlink(ul->path);
        close(ul->fd);
        ul->fd = -1;
}

int kvf_net_connect_unix(const char *instance, unsigned timeout_ms)
{
        struct sockaddr_un a;
        char dir[64];
        int rc, fd;

        if ((rc = unix_addr(instance, &a)) < 0)
                return rc;
        sock_dir_name(dir, sizeof(dir));
        if ((rc = sock_dir_check(dir)) < 0)
                return rc;
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0)
                return kvf_err_set(-errno, "unix socket: %s", strerror(errno));
        /* Never a blocking connect: with the listener's backlog full, one would wait for as
         * long as the listener does not accept. A full backlog answers EAGAIN (the socket is
         * not connecting: try again); retried until the connect timeout. */
        uint64_t end = kvf_now_ns() + kvf_ms(timeout_ms);
        for (;;) {
                if (connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0) {
                        rc = 0;
                        break;
                }
                rc = -errno;
                if (rc == -EINTR)
                        continue;
                if (rc == -EINPROGRESS) { /* not what AF_UNIX does today; handled all the same */
                        int err = 0;
                        socklen_t el = sizeof(err);
                        rc = wait_fd(fd, POLLOUT, end);
                        if (rc == 0 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) < 0)
                                rc = -errno;
                        else if (rc == 0)
                                rc = -err;
                        break;
                }
                if (rc != -EAGAIN)
                        break;
                uint64_t now = kvf_now_ns();
                if (now >= end) {
                        rc = -ETIMEDOUT;
                        break;
                }
                uint64_t left_ms = (end - now) / KVF_NS_PER_MS;
                poll(NULL, 0, left_ms < 5 ? (int)left_ms + 1 : 5);
        }
        if (rc < 0) {
                close(fd);
                return kvf_err_set(rc, "connect to unix socket %s: %s", a.sun_path,
                                   rc == -ETIMEDOUT ? "its backlog stayed full (timed out)" : strerror(-rc));
        }
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
        return fd;
}

int kvf_net_unix_same_user(int fd)
{
        struct ucred cr;
        socklen_t l = sizeof(cr);
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &l) < 0)
                return kvf_err_set(-errno, "SO_PEERCRED: %s", strerror(errno));
        if (cr.uid != geteuid())
                return kvf_err_set(-EPERM, "the other end (pid %d) runs as uid %u, we run as uid %u",
                                   (int)cr.pid, (unsigned)cr.uid, (unsigned)geteuid());
        return 0;
}

int kvf_net_connect(const char *host, uint16_t port, unsigned timeout_ms)
{
        struct addrinfo *res;
        int rc = resolve(host, port, false, &res), fd = -1;
        if (rc < 0)
                return rc;
        rc = -ECONNREFUSED;
        for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
                fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
                if (fd < 0) {
                        rc = -errno;
                        continue;
                }
                if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
                        rc = 0;
                } else if (errno == EINPROGRESS) {
                        struct pollfd p = {.fd = fd, .events = POLLOUT};
                        int n = poll(&p, 1, (int)timeout_ms);
                        int err = 0;
                        socklen_t el = sizeof(err);
                        if (n == 0)
                                rc = -ETIMEDOUT;
                        else if (n < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) < 0)
                                rc = -errno;
                        else
                                rc = -err;
                } else {
                        rc = -errno;
                }
                if (rc == 0)
                        break;
                close(fd);
                fd = -1;
        }
        freeaddrinfo(res);
        if (rc < 0)
                return kvf_err_set(rc, "connect to %s%s%s:%u: %s", ADDR_FMT(host), port,
                                   rc == -ETIMEDOUT ? "no answer (timed out)" : strerror(-rc));
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
        tune(fd);
        return fd;
}

int kvf_net_connect_start(const char *host, uint16_t port, bool *done)
{
        struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                                 .ai_flags = AI_NUMERICHOST | AI_NUMERICSERV};
        struct addrinfo *res;
        char ps[8];
        snprintf(ps, sizeof(ps), "%u", port);
        if (getaddrinfo(host, ps, &hints, &res) != 0)
                return -EINVAL; /* a name: resolving it may block, so the caller does it elsewhere */
        int fd = socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        int rc = fd < 0 ? -errno : 0;
        if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) < 0)
                rc = errno == EINPROGRESS ? 1 : -errno;
        freeaddrinfo(res);
        if (rc < 0) {
                if (fd >= 0)
                        close(fd);
                return kvf_err_set(rc, "connect to %s%s%s:%u: %s", ADDR_FMT(host), port, strerror(-rc));
        }
        *done = rc == 0;
        return fd;
}

int kvf_net_connect_finish(int fd, const char *host, uint16_t port)
{
        int err = 0;
        socklen_t el = sizeof(err);
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) < 0)
                err = errno;
        if (err)
                return kvf_err_set(-err, "connect to %s%s%s:%u: %s", ADDR_FMT(host), port, strerror(err));
        tune(fd);
        return 0;
}

int kvf_net_write_all(int fd, const void *p, size_t n, unsigned timeout_ms)
{
        const uint8_t *b = p;
        uint64_t end = kvf_now_ns() + kvf_ms(timeout_ms);
        while (n > 0) {
                ssize_t w = send(fd, b, n, MSG_NOSIGNAL | MSG_DONTWAIT);
                if (w > 0) {
                        b += w;
                        n -= (size_t)w;
                        continue;
                }
                if (w < 0 && errno != EAGAIN && errno != EINTR)
                        return -errno;
                int rc = wait_fd(fd, POLLOUT, end);
                if (rc < 0)
                        return rc;
        }
        return 0;
}

int kvf_net_read_all(int fd, void *p, size_t n, unsigned timeout_ms)
{
        uint8_t *b = p;
        uint64_t end = kvf_now_ns() + kvf_ms(timeout_ms);
        while (n > 0) {
                ssize_t r = recv(fd, b, n, MSG_DONTWAIT);
                if (r > 0) {
                        b += r;
                        n -= (size_t)r;
                        continue;
                }
                if (r == 0)
                        return -ECONNRESET;
                if (errno != EAGAIN && errno != EINTR)
                        return -errno;
                int rc = wait_fd(fd, POLLIN, end);
                if (rc < 0)
                        return rc;
        }
        return 0;
}

void kvf_net_put_hdr(uint8_t *b, uint32_t len, uint16_t type, uint16_t flags)
{
        uint32_t l = htonl(len);
        uint16_t t = htons(type), f = htons(flags);
        memcpy(b, &l, 4);
        memcpy(b + 4, &t, 2);
        memcpy(b + 6, &f, 2);
}

void kvf_net_get_hdr(const uint8_t *b, struct kvf_frame_hdr *h)
{
        uint32_t l;
        uint16_t t, f;
        memcpy(&l, b, 4);
        memcpy(&t, b + 4, 2);
        memcpy(&f, b + 6, 2);
        h->len = ntohl(l);
        h->type = ntohs(t);
        h->flags = ntohs(f);
}

int kvf_net_try_send_frame(int fd, uint16_t type, const void *payload, uint32_t len, unsigned timeout_ms)
{
        uint8_t hdr[KVF_FRAME_HDR];
        kvf_net_put_hdr(hdr, len, type, 0);
        struct iovec iov[2] = {{hdr, sizeof(hdr)}, {(void *)payload, len}};
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = len ? 2 : 1};
        /* Usually one sendmsg does it; a frame taken in part is finished with write_all. */
        ssize_t w = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0)
                return errno == EAGAIN || errno == EINTR ? 0 : -errno;
        size_t done = (size_t)w;
        if (done < sizeof(hdr)) {
                int rc = kvf_net_write_all(fd, hdr + done, sizeof(hdr) - done, timeout_ms);
                if (rc < 0)
                        return rc;
                done = sizeof(hdr);
        }
        int rc = kvf_net_write_all(fd, (const uint8_t *)payload + (done - sizeof(hdr)),
                                   len - (done - sizeof(hdr)), timeout_ms);
        return rc < 0 ? rc : 1;
}

int kvf_net_send_frame(int fd, uint16_t type, const void *payload, uint32_t len, unsigned timeout_ms)
{
        int rc = kvf_net_try_send_frame(fd, type, payload, len, timeout_ms);
        if (rc != 0)
                return rc < 0 ? rc : 0;
        /* The socket took nothing: wait for it, for the whole frame. */
        uint8_t hdr[KVF_FRAME_HDR];
        kvf_net_put_hdr(hdr, len, type, 0);
        if ((rc = kvf_net_write_all(fd, hdr, sizeof(hdr), timeout_ms)) < 0)
                return rc;
        return kvf_net_write_all(fd, payload, len, timeout_ms);
}

int kvf_net_recv_frame(int fd, struct kvf_frame_hdr *h, void *buf, uint32_t cap, unsigned timeout_ms)
{
        uint8_t hdr[KVF_FRAME_HDR];
        uint64_t end = kvf_now_ns() + kvf_ms(timeout_ms);
        int rc = kvf_net_read_all(fd, hdr, sizeof(hdr), timeout_ms);
        if (rc < 0)
                return rc;
        kvf_net_get_hdr(hdr, h);
        if (h->len > cap)
                return -EMSGSIZE;
        /* The payload gets what the header left of timeout_ms, not a timeout of its own: a peer
         * that trickles a frame holds the reader for timeout_ms, never twice that. */
        uint64_t now = kvf_now_ns();
        unsigned left = now < end ? (unsigned)((end - now + KVF_NS_PER_MS - 1) / KVF_NS_PER_MS) : 0;
        return kvf_net_read_all(fd, buf, h->len, left);
}

void kvf_net_peer_name(int fd, char *buf, size_t len)
{
        struct sockaddr_storage ss;
        socklen_t sl = sizeof(ss);
        char host[64] = "?";
        unsigned port = 0;
        if (getpeername(fd, (struct sockaddr *)&ss, &sl) == 0) {
                if (ss.ss_family == AF_INET) {
                        struct sockaddr_in *a = (struct sockaddr_in *)&ss;
                        inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
                        port = ntohs(a->sin_port);
                } else if (ss.ss_family == AF_INET6) {
                        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
                        inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
                        port = ntohs(a->sin6_port);
                } else if (ss.ss_family == AF_UNIX) {
                        struct ucred cr;
                        socklen_t l = sizeof(cr);
                        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &l) == 0)
                                snprintf(buf, len, "unix:pid %d", (int)cr.pid);
                        else
                                snprintf(buf, len, "unix");
                        return;
                }
        }
        snprintf(buf, len, "%s:%u", host, port);
}

int kvf_reader_init(struct kvf_reader *r, uint32_t cap)
{
        memset(r, 0, sizeof(*r));
        r->buf = malloc(cap);
        if (!r->buf)
                return -ENOMEM;
        r->cap = cap;
        return 0;
}

void kvf_reader_free(struct kvf_reader *r)
{
        free(r->buf);
        memset(r, 0, sizeof(*r));
}

int kvf_reader_fill(struct kvf_reader *r, int fd)
{
        if (r->off > 0) {
                /* compact: whole frames before off were consumed */
                memmove(r->buf, r->buf + r->off, r->len - r->off);
                r->len -= r->off;
                r->off = 0;
        }
        if (r->len == r->cap)
                return -EMSGSIZE;
        ssize_t n = recv(fd, r->buf + r->len, r->cap - r->len, MSG_DONTWAIT);
        if (n > 0) {
                r->len += (uint32_t)n;
                return (int)n;
        }
        if (n == 0)
                return 0;
        return errno == EAGAIN || errno == EINTR ? -EAGAIN : -errno;
}

int kvf_reader_next(struct kvf_reader *r, struct kvf_frame_hdr *h, const uint8_t **payload)
{
        uint32_t have = r->len - r->off;
        if (have < KVF_FRAME_HDR)
                return 0;
        kvf_net_get_hdr(r->buf + r->off, h);
        if (h->len > r->cap - KVF_FRAME_HDR)
                return -EMSGSIZE;
        if (have - KVF_FRAME_HDR < h->len)
                return 0;
        *payload = r->buf + r->off + KVF_FRAME_HDR;
        r->off += KVF_FRAME_HDR + h->len;
        return 1;
}
