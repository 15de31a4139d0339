/*
 * Incoming connections: the listener, and a session thread per connection
 * (server side of the handshake, then notices and pings on a control
 * connection, or a transport's data path on a data connection).
 *
 * At most --max-sessions session threads run at once; a connection beyond
 * them is accepted and closed at once, counted (connections_over_limit) and
 * said in the log once a second at most. A connection that has not proven the
 * token within twice the connect timeout ends (handshake.c), so a flood of
 * connections that never authenticate holds the slots for that long only;
 * an authenticated session holds its slot for as long as it lasts.
 *
 * A control session's thread is the only writer of its socket. It hands the
 * notices it reads to the control thread (evq.c), which publishes them and
 * puts the answers in the session's outbox, ringing its eventfd; the session
 * thread waits on its socket and that eventfd and writes what the outbox
 * holds. A peer that stops reading holds up its own session thread only; a
 * session that ends drops what its outbox still holds (the prefill side sends
 * those notices again and the journal answers them without a second arrival).
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "atomics.h"
#include "clock.h"
#include "connector.h"
#include "err.h"
#include "layout.h"
#include "log.h"
#include "transport.h"

/* ---- sessions ---- */

static void session_add(struct connector *cn, struct session *s)
{
        pthread_mutex_lock(&cn->smu);
        s->id = ++cn->next_session;
        s->next = cn->sessions;
        cn->sessions = s;
        pthread_mutex_unlock(&cn->smu);
}

static void session_remove(struct connector *cn, struct session *s)
{
        pthread_mutex_lock(&cn->smu);
        for (struct session **pp = &cn->sessions; *pp; pp = &(*pp)->next)
                if (*pp == s) {
                        *pp = s->next;
                        break;
                }
        pthread_mutex_unlock(&cn->smu);
}

static struct session *session_new(int fd)
{
        struct session *s = calloc(1, sizeof(*s));
        if (!s)
                return NULL;
        s->fd = fd;
        s->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (s->efd < 0) {
                free(s);
                return NULL;
        }
        pthread_mutex_init(&s->omu, NULL);
        return s;
}

/* After session_remove: nobody else can reach s. What its outbox holds is dropped. */
static void session_free(struct connector *cn, struct session *s)
{
        uint64_t dropped = 0;
        for (struct out_frame *f = s->out, *next; f; f = next) {
                next = f->next;
                dropped += f->type == KVF_RT_ACK;
                free(f);
        }
        if (dropped)
                kvf_fetch_add_relaxed(&cn->acks_dropped, dropped);
        close(s->efd);
        pthread_mutex_destroy(&s->omu);
        free(s);
}

static struct out_frame *frame_of(const struct kvf_record *r)
{
        uint8_t *buf;
        size_t len;
        if (kvf_record_encode_alloc(r, &buf, &len) < 0)
                return NULL;
        struct out_frame *f = malloc(sizeof(*f) + len);
        if (f) {
                f->next = NULL;
                f->type = r->type;
                f->len = (uint32_t)len;
                memcpy(f->payload, buf, len);
        }
        free(buf);
        return f;
}

/* smu held: queue f in s's outbox and wake its thread. */
static void outbox_put(struct session *s, struct out_frame *f)
{
        pthread_mutex_lock(&s->omu);
        if (s->out_tail)
                s->out_tail->next = f;
        else
                s->out = f;
        s->out_tail = f;
        pthread_mutex_unlock(&s->omu);
        uint64_t one = 1;
        /* A full counter (never, at 2^64 - 2) or EAGAIN still leaves it readable: the wake is
         * a hint, and the session thread also looks at its outbox every keepalive period. */
        ssize_t w = write(s->efd, &one, sizeof(one));
        (void)w;
}

int conn_session_send(struct connector *cn, uint64_t id, const struct kvf_record *r)
{
        struct out_frame *f = frame_of(r);
        if (!f)
                return -ENOMEM;
        pthread_mutex_lock(&cn->smu);
        struct session *s = cn->sessions;
        while (s && s->id != id)
                s = s->next;
        if (s)
                outbox_put(s, f);
        pthread_mutex_unlock(&cn->smu);
        if (s)
                return 0;
        free(f);
        if (r->type == KVF_RT_ACK)
                kvf_fetch_add_relaxed(&cn->acks_dropped, 1);
        return -ENOENT;
}

void conn_sessions_send_all(struct connector *cn, const struct kvf_record *r)
{
        pthread_mutex_lock(&cn->smu);
        for (struct session *s = cn->sessions; s; s = s->next) {
                struct out_frame *f = frame_of(r);
                if (f)
                        outbox_put(s, f);
        }
        pthread_mutex_unlock(&cn->smu);
}

/* The session's thread: write what its outbox holds, in order. A frame the socket does not
 * take within the keepalive period ends the session (the peer stopped reading). */
static int outbox_flush(struct connector *cn, struct session *s)
{
        uint64_t n;
        ssize_t rd = read(s->efd, &n, sizeof(n)); /* reset the wake before taking the outbox */
        (void)rd;
        pthread_mutex_lock(&s->omu);
        struct out_frame *f = s->out;
        s->out = s->out_tail = NULL;
        pthread_mutex_unlock(&s->omu);
        int rc = 0;
        while (f) {
                struct out_frame *next = f->next;
                if (rc == 0) {
                        rc = kvf_net_send_frame(s->fd, f->type, f->payload, f->len, cn->cfg.keepalive_ms);
                        if (rc < 0 && f->type == KVF_RT_ACK)
                                kvf_fetch_add_relaxed(&cn->acks_dropped, 1);
                } else if (f->type == KVF_RT_ACK) {
                        kvf_fetch_add_relaxed(&cn->acks_dropped, 1);
                }
                free(f);
                f = next;
        }
        return rc;
}

int conn_session_open(struct connector *cn, int fd, const char *instance, uint64_t peer_gen, uint64_t *id)
{
        struct session *s = session_new(fd);
        if (!s)
                return -ENOMEM;
        snprintf(s->instance, sizeof(s->instance), "%s", instance);
        s->peer_gen = peer_gen;
        session_add(cn, s);
        *id = s->id;
        return 0;
}

static struct session *session_take(struct connector *cn, uint64_t id, bool unlink)
{
        pthread_mutex_lock(&cn->smu);
        struct session **pp = &cn->sessions;
        while (*pp && (*pp)->id != id)
                pp = &(*pp)->next;
        struct session *s = *pp;
        if (s && unlink)
                *pp = s->next;
        pthread_mutex_unlock(&cn->smu);
        return s;
}

int conn_session_flush(struct connector *cn, uint64_t id)
{
        /* Tests: the session has no thread, so nobody frees it meanwhile. */
        struct session *s = session_take(cn, id, false);
        return s ? outbox_flush(cn, s) : -ENOENT;
}

void conn_session_close(struct connector *cn, uint64_t id)
{
        struct session *s = session_take(cn, id, true);
        if (s)
                session_free(cn, s);
}

struct session_arg {
        struct connector *cn;
        int fd;
        bool unix_socket; /* accepted on the same-host listener */
        struct session_arg *next; /* cn->threads, under cn->smu */
};

/* Listener: a session thread about to start, unless max_sessions are running: false then. The
 * listener is the only thread that adds, so the count it checks cannot grow past the limit. */
static bool thread_add(struct connector *cn, struct session_arg *sa)
{
        pthread_mutex_lock(&cn->smu);
        bool room = cn->nthreads < cn->cfg.max_sessions;
        if (room) {
                sa->next = cn->threads;
                cn->threads = sa;
                cn->nthreads++;
        }
        pthread_mutex_unlock(&cn->smu);
        return room;
}

/* Unlinked before its socket is closed: conn_sessions_stop shuts down only live sockets,
 * never a descriptor number another thread may have been given meanwhile. */
static void thread_unlink(struct connector *cn, struct session_arg *sa)
{
        pthread_mutex_lock(&cn->smu);
        for (struct session_arg **pp = &cn->threads; *pp; pp = &(*pp)->next)
                if (*pp == sa) {
                        *pp = sa->next;
                        break;
                }
        pthread_mutex_unlock(&cn->smu);
}

/* The thread's last touch of cn. */
static void thread_done(struct connector *cn)
{
        pthread_mutex_lock(&cn->smu);
        cn->nthreads--;
        pthread_cond_broadcast(&cn->threads_cv);
        pthread_mutex_unlock(&cn->smu);
}

bool conn_sessions_stop(struct connector *cn, unsigned wait_ms)
{
        struct timespec until = kvf_ts_after(CLOCK_MONOTONIC, kvf_ms(wait_ms));
        pthread_mutex_lock(&cn->smu);
        for (struct session_arg *sa = cn->threads; sa; sa = sa->next)
                shutdown(sa->fd, SHUT_RDWR);
        while (cn->nthreads &&
               pthread_cond_timedwait(&cn->threads_cv, &cn->smu, &until) != ETIMEDOUT) {
        }
        unsigned left = cn->nthreads;
        pthread_mutex_unlock(&cn->smu);
        return left == 0;
}

/* A control connection's frames: pings answered here, notices to the control thread.
 * 0 to go on, -1 to end the session. */
static int session_frames(struct connector *cn, struct session *s, struct kvf_reader *rd)
{
        struct kvf_frame_hdr h;
        const uint8_t *pl;
        int rc;
        while ((rc = kvf_reader_next(rd, &h, &pl)) == 1) {
                if (h.type == KVF_RT_PING) {
                        /* Behind the answers already decided: the socket has one writer. */
                        if (outbox_flush(cn, s) < 0)
                                return -1;
                        struct kvf_record pong = {.type = KVF_RT_PONG, .session = conn_engine_session(cn)};
                        if (conn_send_record(s->fd, &pong, cn->cfg.keepalive_ms) < 0)
                                return -1;
                        continue;
                }
                if (h.type == KVF_RT_PONG)
                        continue;
                struct event *ev = calloc(1, sizeof(*ev));
                if (!ev)
                        continue; /* the prefill side sends it again */
                if (h.type != KVF_RT_NOTICE || kvf_record_decode(KVF_RT_NOTICE, pl, h.len, 0, &ev->rec) < 0) {
                        kvf_count(&cn->ctl, KVF_CTR_FRAMES_REJECTED, 1);
                        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR,
                                   "peer '%s' (%s) sent a bad frame (type %u): %s: disconnecting", s->instance,
                                   s->remote, h.type, h.type == KVF_RT_NOTICE ? kvf_err_msg() : "unexpected type");
                        kvf_record_free(&ev->rec);
                        free(ev);
                        return -1;
                }
                /* The notice names its sender by the authenticated instance. */
                snprintf(ev->rec.peer, sizeof(ev->rec.peer), "%s", s->instance);
                ev->kind = EV_NOTICE;
                ev->session = s->id;
                ev->src_gen = s->peer_gen;
                /* The control thread publishes it and answers through the outbox. A full queue
                 * holds this thread (and so this peer's socket) until there is room. */
                if (conn_post_wait(cn, ev) < 0)
                        return -1;
        }
        if (rc < 0) {
                kvf_count(&cn->ctl, KVF_CTR_FRAMES_REJECTED, 1);
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "peer '%s' (%s) announced a %u-byte frame: disconnecting",
                           s->instance, s->remote, h.len);
                return -1;
        }
        return 0;
}

static void *session_main(void *arg)
{
        struct session_arg *sa = arg;
        struct connector *cn = sa->cn;
        struct session *s = session_new(sa->fd);
        struct peer_identity id;
        struct kvf_reader rd = {0};
        uint64_t dead = kvf_ms(cn->cfg.peer_timeout_ms);

        if (!s)
                goto out_fd;
        kvf_net_peer_name(s->fd, s->remote, sizeof(s->remote));
        if (sa->unix_socket && kvf_net_unix_same_user(s->fd) < 0) {
                kvf_count(&cn->ctl, KVF_CTR_AUTH_FAILURES, 1);
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "unix connection refused: %s", kvf_err_msg());
                goto out_free;
        }
        char purpose[16];
        void *tstate = NULL;
        if (conn_handshake_server(cn, s->fd, &id, purpose, sizeof(purpose), &tstate) < 0) {
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "connection from %s refused: %s", s->remote,
                           kvf_err_msg());
                goto out_free;
        }
        snprintf(s->instance, sizeof(s->instance), "%s", id.instance);
        s->peer_gen = id.created_ns;
        const struct conn_transport *t = conn_transport_by_purpose(purpose);
        if (t) {
                /* A data connection of transport t. */
                t->serve(cn, s->fd, &id, s->remote, tstate);
                goto out_free;
        }
        kvf_info("peer instance '%s' connected from %s", s->instance, s->remote);
        if (kvf_reader_init(&rd, KVF_FRAME_MAX + KVF_FRAME_HDR) < 0)
                goto out_free;
        session_add(cn, s);
        uint64_t last_rx = kvf_now_ns();
        while (!conn_stopping(cn)) {
                struct pollfd pf[2] = {{.fd = s->fd, .events = POLLIN}, {.fd = s->efd, .events = POLLIN}};
                int n = poll(pf, 2, (int)cn->cfg.keepalive_ms);
                if (n < 0 && errno != EINTR)
                        break;
                /* The answers first: they end requests on the prefill side. */
                if (outbox_flush(cn, s) < 0) {
                        kvf_warn("peer instance '%s' (%s): %s: closing", s->instance, s->remote, kvf_err_msg());
                        break;
                }
                if (n <= 0 || !(pf[0].revents & (POLLIN | POLLHUP | POLLERR))) {
                        if (kvf_now_ns() - last_rx > dead) {
                                kvf_warn("peer instance '%s' (%s) silent for %u ms: closing", s->instance,
                                         s->remote, cn->cfg.peer_timeout_ms);
                                break;
                        }
                        continue;
                }
                int rc = kvf_reader_fill(&rd, s->fd);
                if (rc == -EAGAIN)
                        continue;
                if (rc <= 0)
                        break;
                last_rx = kvf_now_ns();
                if (session_frames(cn, s, &rd) < 0)
                        break;
        }
        session_remove(cn, s);
        kvf_info("peer instance '%s' (%s) disconnected", s->instance, s->remote);
out_free:
        /* No one can reach s after session_remove: the control thread hands answers over
         * under smu. */
        kvf_reader_free(&rd);
        if (s)
                session_free(cn, s);
out_fd:
        thread_unlink(cn, sa);
        close(sa->fd);
        free(sa);
        thread_done(cn);
        return NULL;
}

/* Connections closed at accept because max_sessions were being served (listener only): how
 * many since the last line that said so, and when that was (at first: the listener's start). */
struct over_limit {
        uint64_t closed;
        uint64_t line_ns;
};

/* At most one line a second, however fast they come; each line's count is of those since the
 * line before, so the lines add up to the counter. */
static void over_limit_say(struct connector *cn, struct over_limit *ol, uint64_t now)
{
        if (!ol->closed || now - ol->line_ns < KVF_NS_PER_S)
                return;
        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR,
                   "%llu incoming connection(s) closed at accept in the last %.1f s: %u sessions "
                   "(--max-sessions) were being served", (unsigned long long)ol->closed,
                   (double)(now - ol->line_ns) / 1e9, cn->cfg.max_sessions);
        ol->closed = 0;
        ol->line_ns = now;
}

/* One connection from listening socket lfd: a session thread for it, or closed at once. */
static void accept_one(struct connector *cn, struct over_limit *ol, int lfd, bool from_unix)
{
        int fd = kvf_net_accept(lfd, !from_unix);
        if (fd == -EMFILE || fd == -ENFILE) {
                /* The connection stays in the backlog and poll says so again at once: wait for
                 * descriptors instead of spinning on it. */
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "accept: %s: incoming connections wait",
                           strerror(-fd));
                poll(NULL, 0, CONN_POLL_MS / 4);
                return;
        }
        if (fd < 0)
                return;
        struct session_arg *sa = malloc(sizeof(*sa));
        pthread_t t;
        pthread_attr_t at;
        if (!sa) {
                close(fd);
                return;
        }
        sa->cn = cn;
        sa->fd = fd;
        sa->unix_socket = from_unix;
        if (!thread_add(cn, sa)) {
                /* Accepted and closed at once, not left in the backlog: a full backlog would
                 * stall every peer's connect, the authenticated ones' too, for as long as the
                 * flood lasts. */
                close(fd);
                free(sa);
                kvf_count(&cn->ctl, KVF_CTR_CONNECTIONS_OVER_LIMIT, 1);
                ol->closed++;
                over_limit_say(cn, ol, kvf_now_ns());
                return;
        }
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &at, session_main, sa) != 0) {
                thread_unlink(cn, sa);
                close(fd);
                free(sa);
                thread_done(cn);
        }
        pthread_attr_destroy(&at);
}

void *conn_listener_main(void *arg)
{
        struct connector *cn = arg;
        struct over_limit ol = {.line_ns = kvf_now_ns()};
        while (!conn_stopping(cn)) {
                struct pollfd pf[2] = {{.fd = cn->listen_fd, .events = POLLIN},
                                       {.fd = cn->unix_fd, .events = POLLIN}}; /* (-1: ignored) */
                int n = poll(pf, 2, CONN_POLL_MS);
                over_limit_say(cn, &ol, kvf_now_ns()); /* (the poll's timeout: within 1.2 s) */
                if (n <= 0)
                        continue;
                /* One from each listener that has one: a tcp flood does not keep same-host
                 * peers' connections waiting in the unix backlog. */
                if (pf[0].revents & POLLIN)
                        accept_one(cn, &ol, cn->listen_fd, false);
                if (pf[1].revents & POLLIN)
                        accept_one(cn, &ol, cn->unix_fd, true);
        }
        return NULL;
}
