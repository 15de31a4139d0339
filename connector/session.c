/*
 * Incoming connections: the listener, and a session thread per connection
 * (server side of the handshake, then notices and pings on a control
 * connection, or a transport's data path on a data connection). Notices go to
 * arrivals.c through the event dispatch.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

int conn_session_send(struct connector *cn, uint64_t id, const struct kvf_record *r)
{
        int rc = -ENOENT;
        pthread_mutex_lock(&cn->smu);
        for (struct session *s = cn->sessions; s; s = s->next)
                if (s->id == id) {
                        pthread_mutex_lock(&s->wmu);
                        rc = conn_send_record(s->fd, r, cn->cfg.keepalive_ms);
                        pthread_mutex_unlock(&s->wmu);
                        break;
                }
        pthread_mutex_unlock(&cn->smu);
        return rc;
}

void conn_sessions_send_all(struct connector *cn, const struct kvf_record *r)
{
        pthread_mutex_lock(&cn->smu);
        for (struct session *s = cn->sessions; s; s = s->next) {
                pthread_mutex_lock(&s->wmu);
                conn_send_record(s->fd, r, cn->cfg.keepalive_ms);
                pthread_mutex_unlock(&s->wmu);
        }
        pthread_mutex_unlock(&cn->smu);
}

struct session_arg {
        struct connector *cn;
        int fd;
        bool unix_socket; /* accepted on the same-host listener */
        struct session_arg *next; /* cn->threads, under cn->smu */
};

/* Listener: a session thread about to start. */
static void thread_add(struct connector *cn, struct session_arg *sa)
{
        pthread_mutex_lock(&cn->smu);
        sa->next = cn->threads;
        cn->threads = sa;
        cn->nthreads++;
        pthread_mutex_unlock(&cn->smu);
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

static void *session_main(void *arg)
{
        struct session_arg *sa = arg;
        struct connector *cn = sa->cn;
        struct session *s = calloc(1, sizeof(*s));
        struct peer_identity id;
        struct kvf_reader rd = {0};
        uint64_t dead = kvf_ms(cn->cfg.peer_timeout_ms);

        if (!s)
                goto out_fd;
        s->fd = sa->fd;
        pthread_mutex_init(&s->wmu, NULL);
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
                struct pollfd pf = {.fd = s->fd, .events = POLLIN};
                int n = poll(&pf, 1, (int)cn->cfg.keepalive_ms);
                if (n < 0 && errno != EINTR)
                        break;
                if (n <= 0) {
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
                struct kvf_frame_hdr h;
                const uint8_t *pl;
                while ((rc = kvf_reader_next(&rd, &h, &pl)) == 1) {
                        if (h.type == KVF_RT_PING) {
                                struct kvf_record pong = {.type = KVF_RT_PONG,
                                                          .session = conn_engine_session(cn)};
                                pthread_mutex_lock(&s->wmu);
                                conn_send_record(s->fd, &pong, cn->cfg.keepalive_ms);
                                pthread_mutex_unlock(&s->wmu);
                                continue;
                        }
                        if (h.type == KVF_RT_PONG)
                                continue;
                        struct event *ev = calloc(1, sizeof(*ev));
                        if (!ev)
                                continue;
                        if (h.type != KVF_RT_NOTICE ||
                            kvf_record_decode(KVF_RT_NOTICE, pl, h.len, 0, &ev->rec) < 0) {
                                kvf_count(&cn->ctl, KVF_CTR_FRAMES_REJECTED, 1);
                                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR,
                                           "peer '%s' (%s) sent a bad frame (type %u): %s: disconnecting",
                                           s->instance, s->remote, h.type,
                                           h.type == KVF_RT_NOTICE ? kvf_err_msg() : "unexpected type");
                                kvf_record_free(&ev->rec);
                                free(ev);
                                goto out_session;
                        }
                        /* The notice names its sender by the authenticated instance. */
                        snprintf(ev->rec.peer, sizeof(ev->rec.peer), "%s", s->instance);
                        ev->kind = EV_NOTICE;
                        ev->session = s->id;
                        ev->src_gen = s->peer_gen;
                        conn_dispatch(cn, ev); /* publish and acknowledge from this thread */
                }
                if (rc < 0) {
                        kvf_count(&cn->ctl, KVF_CTR_FRAMES_REJECTED, 1);
                        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR,
                                   "peer '%s' (%s) announced a %u-byte frame: disconnecting", s->instance,
                                   s->remote, h.len);
                        break;
                }
        }
out_session:
        session_remove(cn, s);
        kvf_info("peer instance '%s' (%s) disconnected", s->instance, s->remote);
out_free:
        /* No one can reach s after session_remove: the control thread sends under smu. */
        kvf_reader_free(&rd);
        pthread_mutex_destroy(&s->wmu);
        free(s);
out_fd:
        thread_unlink(cn, sa);
        close(sa->fd);
        free(sa);
        thread_done(cn);
        return NULL;
}

void *conn_listener_main(void *arg)
{
        struct connector *cn = arg;
        while (!conn_stopping(cn)) {
                struct pollfd pf[2] = {{.fd = cn->listen_fd, .events = POLLIN},
                                       {.fd = cn->unix_fd, .events = POLLIN}}; /* (-1: ignored) */
                if (poll(pf, 2, CONN_POLL_MS) <= 0)
                        continue;
                bool from_unix = !(pf[0].revents & POLLIN);
                int fd = from_unix ? kvf_net_accept(cn->unix_fd, false) : kvf_net_accept(cn->listen_fd, true);
                if (fd < 0)
                        continue;
                struct session_arg *sa = malloc(sizeof(*sa));
                pthread_t t;
                pthread_attr_t at;
                if (!sa) {
                        close(fd);
                        continue;
                }
                sa->cn = cn;
                sa->fd = fd;
                sa->unix_socket = from_unix;
                pthread_attr_init(&at);
                pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
                thread_add(cn, sa);
                if (pthread_create(&t, &at, session_main, sa) != 0) {
                        thread_unlink(cn, sa);
                        close(fd);
                        free(sa);
                        thread_done(cn);
                }
                pthread_attr_destroy(&at);
        }
        return NULL;
}
