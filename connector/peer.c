/*
 * Outgoing peers: one thread per peer connects, authenticates, sends finish
 * notices, matches their acknowledgements, pings, and reconnects. The control
 * thread sends a notice itself when it can do so at once (conn_peer_enqueue).
 *
 * Outcome agreement. A notice that never went out on any connection cannot
 * have been published by the peer: when it cannot be delivered within
 * peer_timeout_ms of reaching the connector it fails with "connection error"
 * (or the permanent reason: wrong token, layout or role mismatch, unknown
 * peer), and it is taken out of the queue, so it can never arrive later. A
 * notice that went out at least once is in doubt: the peer may have
 * published the arrival and died before its ack. It is sent again on every
 * new connection (the decode side answers a repeat from its journal, with
 * the status it published) and only that answer ends it; the sender bounds
 * the wait with a withdrawal (conn_peer_withdraw), which the peer answers the
 * same way. docs/ARCHITECTURE.md section 7 has the rules for both sides.
 *
 * Peers without work are retired after peer_idle_ms (thread, sockets, data
 * threads), and when the table is full an idle or unreachable peer makes room.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sockios.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"
#include "connector.h"
#include "err.h"
#include "log.h"
#include "xfer.h"

static void post_result(struct connector *cn, const struct notice *n, int status, const char *reason)
{
        if (!n->abort_notice) /* nobody waits for those */
                conn_write_result(cn, n->key, n->request_id, n->id_bin, status, reason, true);
}

static void post_state(struct peer *p, bool up, const char *reason)
{
        struct event *ev = calloc(1, sizeof(*ev));
        if (!ev)
                return;
        ev->kind = EV_PEER_STATE;
        ev->rec.type = KVF_RT_PEER_STATE;
        ev->rec.up = up;
        ev->rec.session = p->remote_session;
        snprintf(ev->rec.peer, sizeof(ev->rec.peer), "%s", p->name);
        snprintf(ev->rec.reason, sizeof(ev->rec.reason), "%s", reason ? reason : "");
        conn_post(p->cn, ev);
}

static void answer_connects(struct peer *p, int status, const char *reason)
{
        pthread_mutex_lock(&p->mu);
        for (unsigned i = 0; i < p->nconnect; i++) {
                conn_connect_result(p->cn, &p->connects[i], p->name, status, reason);
                free(p->connects[i].task_id);
        }
        p->nconnect = 0;
        pthread_mutex_unlock(&p->mu);
}

static void free_notice(struct notice *n)
{
        free(n->frame);
        free(n);
}

/*
 * Fail queued notices: all of them, or (older_than != 0) those waiting longer
 * than that. Notices in doubt (sent before) stay, unless the failure is
 * permanent (the peer refuses us now: whatever it published before, it will
 * never answer). A failed finish notice takes its network transfer with it.
 */
static void fail_queued(struct peer *p, int status, const char *reason, uint64_t older_than,
                        bool permanent)
{
        uint64_t forget[64];
        unsigned nforget = 0;
        pthread_mutex_lock(&p->mu);
        uint64_t now = kvf_now_ns();
        struct notice **pp = &p->queue, *n;
        p->queue_tail = NULL;
        while ((n = *pp)) {
                bool due = !older_than || kvf_elapsed(now, n->first_ns) > older_than;
                if (due && (!n->sent || permanent) && nforget < 64) {
                        *pp = n->next;
                        char doubt[KVF_REASON_MAX];
                        snprintf(doubt, sizeof(doubt), "%s (in doubt: the notice had reached the peer)",
                                 reason);
                        post_result(p->cn, n, status, n->sent ? doubt : reason);
                        if (!n->abort_notice)
                                forget[nforget++] = n->key;
                        free_notice(n);
                        continue;
                }
                p->queue_tail = n;
                pp = &n->next;
        }
        pthread_mutex_unlock(&p->mu);
        for (unsigned i = 0; i < nforget; i++)
                conn_xfer_forget(p, forget[i]);
}

static bool has_work(struct peer *p)
{
        pthread_mutex_lock(&p->mu);
        bool w = p->queue || p->inflight || p->nconnect;
        pthread_mutex_unlock(&p->mu);
        return w || conn_xfer_busy(p);
}

static void drain_wake(struct peer *p)
{
        uint64_t v;
        while (read(p->wake_fd, &v, sizeof(v)) == sizeof(v)) {
        }
}

int conn_peer_resolve(struct peer *p, char *host, size_t hostlen, uint16_t *port, int *status)
{
        if (strchr(p->name, ':')) {
                *status = KVF_STATUS_UNKNOWN_PEER;
                return kvf_net_parse(p->name, host, hostlen, port);
        }
        struct kvf_ctl c;
        int rc = kvf_ctl_attach(p->name, false, &c);
        if (rc < 0) {
                *status = KVF_STATUS_UNKNOWN_PEER;
                return rc;
        }
        uint32_t pt;
        rc = kvf_connector_info_read(&c, host, hostlen, &pt);
        kvf_ctl_detach(&c);
        if (rc < 0) {
                *status = KVF_STATUS_CONNECTION;
                return kvf_err_set(-EAGAIN, "instance '%s' has no connector listening yet", p->name);
        }
        *port = (uint16_t)pt;
        return 0;
}

/* A new connection's socket (a unix stream socket when local), for conn_peer_enqueue's
 * direct sends. */
static void set_socket(struct peer *p, int fd, bool local)
{
        pthread_mutex_lock(&p->wmu);
        pthread_mutex_lock(&p->mu);
        p->fd = fd;
        p->unix_stream = local;
        p->conn++;
        pthread_mutex_unlock(&p->mu);
        pthread_mutex_unlock(&p->wmu);
}

/*
 * Send every queued notice on the connection. Lock order, here and wherever
 * both are held: wmu (the socket's writes) before mu (the lists). 0, or
 * < 0 with `why` when the connection broke.
 */
static int send_queued(struct peer *p, int fd, uint64_t *last_tx, char *why, size_t whylen)
{
        struct connector *cn = p->cn;
        for (;;) {
                pthread_mutex_lock(&p->mu);
                struct notice *n = p->queue;
                if (n) {
                        p->queue = n->next;
                        if (!p->queue)
                                p->queue_tail = NULL;
                        n->sent = true; /* from here the peer may have it: in doubt */
                }
                pthread_mutex_unlock(&p->mu);
                if (!n)
                        return 0;
                pthread_mutex_lock(&p->wmu);
                int rc = kvf_net_send_frame(fd, KVF_RT_NOTICE, n->frame, n->len, cn->cfg.peer_timeout_ms);
                pthread_mutex_unlock(&p->wmu);
                pthread_mutex_lock(&p->mu);
                if (rc < 0 || !n->abort_notice) {
                        /* in flight (or to resend after reconnecting) */
                        n->next = p->inflight;
                        p->inflight = n;
                        n = NULL;
                }
                pthread_mutex_unlock(&p->mu);
                if (n)
                        free_notice(n);
                if (rc < 0) {
                        snprintf(why, whylen, "send: %s", strerror(-rc));
                        return rc;
                }
                *last_tx = kvf_now_ns();
        }
}

/* An ack (or a pong) from the peer: its engine session; the notice it resolves. */
static void on_reply(struct peer *p, uint16_t type, const uint8_t *pl, uint32_t len)
{
        struct connector *cn = p->cn;
        struct kvf_record ack;
        if (kvf_record_decode(type, pl, len, 0, &ack) < 0) {
                kvf_count(&cn->ctl, KVF_CTR_FRAMES_REJECTED, 1);
                kvf_record_free(&ack);
                return;
        }
        /* The peer's decode engine session: the sender binds new tasks to it. */
        if (ack.session != p->remote_session) {
                kvf_store_relaxed(&p->remote_session, ack.session); /* (read by data paths) */
                post_state(p, true, NULL);
        }
        if (type == KVF_RT_ACK) {
                /* wmu: a direct send of this very notice may still be inside its sendmsg
                 * (on loopback the ack can come back before it returns). */
                pthread_mutex_lock(&p->wmu);
                pthread_mutex_lock(&p->mu);
                struct notice **pp = &p->inflight, *n;
                while ((n = *pp) && n->key != ack.key)
                        pp = &n->next;
                if (n)
                        *pp = n->next;
                pthread_mutex_unlock(&p->mu);
                pthread_mutex_unlock(&p->wmu);
                if (n) {
                        if (n->withdraw)
                                kvf_count(&cn->ctl, KVF_CTR_NOTICES_IN_DOUBT, 1);
                        post_result(cn, n, ack.status, ack.reason);
                        free_notice(n);
                }
                /* Acknowledged (or refused): the transfer's frames are no longer needed. */
                conn_xfer_forget(p, ack.key);
        }
        kvf_record_free(&ack);
}

/* Take in what the peer sent: pings answered, replies handled. 0, or < 0 with `why`. */
static int read_frames(struct peer *p, struct kvf_reader *rd, int fd, char *why, size_t whylen)
{
        struct connector *cn = p->cn;
        int rc = kvf_reader_fill(rd, fd);
        if (rc == 0 || (rc < 0 && rc != -EAGAIN)) {
                snprintf(why, whylen, "%s", rc == 0 ? "connection closed by the peer" : strerror(-rc));
                return rc == 0 ? -ECONNRESET : rc;
        }
        struct kvf_frame_hdr h;
        const uint8_t *pl;
        while ((rc = kvf_reader_next(rd, &h, &pl)) == 1) {
                if (h.type == KVF_RT_PING) {
                        struct kvf_record pong = {.type = KVF_RT_PONG};
                        pthread_mutex_lock(&p->wmu);
                        conn_send_record(fd, &pong, cn->cfg.peer_timeout_ms);
                        pthread_mutex_unlock(&p->wmu);
                } else if (h.type == KVF_RT_ACK || h.type == KVF_RT_PONG) {
                        on_reply(p, h.type, pl, h.len);
                }
        }
        if (rc < 0) {
                snprintf(why, whylen, "the peer sent a frame of %u bytes: protocol error", h.len);
                return -EPROTO;
        }
        return 0;
}

/*
 * The connection is over: no direct send is under way past this (wmu), none
 * starts on this socket, and notices in flight go back to the head of the
 * queue (in doubt: sent again on the next connection).
 */
static void end_connection(struct peer *p)
{
        pthread_mutex_lock(&p->wmu);
        pthread_mutex_lock(&p->mu);
        p->fd = -1;
        while (p->inflight) {
                struct notice *n = p->inflight;
                p->inflight = n->next;
                n->next = p->queue;
                p->queue = n;
                if (!p->queue_tail)
                        p->queue_tail = n;
        }
        pthread_mutex_unlock(&p->mu);
        pthread_mutex_unlock(&p->wmu);
}

/* Connected: move notices, match acks, ping. Returns why the connection ended. */
static int serve(struct peer *p, int fd, bool local, char *why, size_t whylen)
{
        struct connector *cn = p->cn;
        struct kvf_reader rd;
        uint64_t keep = kvf_ms(cn->cfg.keepalive_ms);
        uint64_t dead = kvf_ms(cn->cfg.peer_timeout_ms);
        uint64_t last_rx = kvf_now_ns(), last_tx = last_rx;
        int rc = 0;

        if (kvf_reader_init(&rd, 1 << 16) < 0) {
                snprintf(why, whylen, "out of memory");
                return -ENOMEM;
        }
        set_socket(p, fd, local);
        while (!kvf_load_acquire(&p->stop) && !conn_stopping(cn)) {
                if ((rc = send_queued(p, fd, &last_tx, why, whylen)) < 0)
                        break;
                uint64_t now = kvf_now_ns();
                if (now - last_rx > dead) {
                        snprintf(why, whylen, "no word from the peer for %u ms (dead, or the link is down)",
                                 cn->cfg.peer_timeout_ms);
                        rc = -ETIMEDOUT;
                        break;
                }
                if (now - last_tx >= keep) {
                        struct kvf_record ping = {.type = KVF_RT_PING};
                        pthread_mutex_lock(&p->wmu);
                        rc = conn_send_record(fd, &ping, cn->cfg.peer_timeout_ms);
                        pthread_mutex_unlock(&p->wmu);
                        if (rc < 0) {
                                snprintf(why, whylen, "%s", kvf_err_msg());
                                break;
                        }
                        last_tx = now;
                }
                struct pollfd pf[2] = {{.fd = fd, .events = POLLIN}, {.fd = p->wake_fd, .events = POLLIN}};
                int ms = (int)((keep - (now - last_tx)) / KVF_NS_PER_MS) + 1;
                if (poll(pf, 2, ms) < 0 && errno != EINTR) {
                        rc = -errno;
                        snprintf(why, whylen, "poll: %s", strerror(errno));
                        break;
                }
                if (pf[1].revents & POLLIN)
                        drain_wake(p);
                if (!(pf[0].revents & (POLLIN | POLLHUP | POLLERR)))
                        continue;
                if ((rc = read_frames(p, &rd, fd, why, whylen)) < 0)
                        break;
                last_rx = kvf_now_ns();
        }
        if (rc == 0)
                snprintf(why, whylen, "stopping");
        kvf_reader_free(&rd);
        end_connection(p);
        return rc;
}

/*
 * A peer named by instance (not host:port) lives on this host: its connector's
 * unix socket, if it listens on one in our socket directory and runs as our
 * user; else -1 (then tcp), with a warning unless simply nobody listens there.
 */
static int connect_local(struct peer *p)
{
        if (strchr(p->name, ':'))
                return -1;
        int fd = kvf_net_connect_unix(p->name, p->cn->cfg.connect_timeout_ms);
        if (fd == -ENOENT || fd == -ECONNREFUSED)
                return -1; /* nobody listens there */
        if (fd >= 0 && kvf_net_unix_same_user(fd) < 0) {
                close(fd);
                fd = -EPERM;
        }
        if (fd < 0) {
                kvf_warn("peer '%s': %s: using tcp", p->name, kvf_err_msg());
                return -1;
        }
        return fd;
}

static void *peer_main(void *arg)
{
        struct peer *p = arg;
        struct connector *cn = p->cn;
        uint64_t backoff_ms = 50;
        uint64_t dead = kvf_ms(cn->cfg.peer_timeout_ms);
        char host[128], why[KVF_REASON_MAX];
        uint16_t port;
        int status;

        while (!kvf_load_acquire(&p->stop) && !conn_stopping(cn)) {
                if (!has_work(p)) {
                        struct pollfd pf = {.fd = p->wake_fd, .events = POLLIN};
                        poll(&pf, 1, CONN_POLL_MS);
                        drain_wake(p);
                        continue;
                }
                int rc = conn_peer_resolve(p, host, sizeof(host), &port, &status);
                int fd = -1;
                bool local = false;
                if (rc == 0) {
                        status = KVF_STATUS_CONNECTION;
                        fd = connect_local(p);
                        local = fd >= 0;
                        if (!local)
                                fd = kvf_net_connect(host, port, cn->cfg.connect_timeout_ms);
                        rc = fd;
                }
                struct peer_identity id;
                if (rc >= 0) {
                        rc = conn_handshake_client(cn, fd, "control", &id, NULL, &status);
                        if (rc < 0)
                                kvf_err_ctx(rc, "peer '%s' at %s:%u", p->name, host, port);
                }
                if (rc < 0) {
                        snprintf(why, sizeof(why), "%s", kvf_err_msg());
                        if (fd >= 0)
                                close(fd);
                        kvf_count(&cn->ctl, KVF_CTR_PEER_FAILURES, 1);
                        answer_connects(p, status, why);
                        /* Wrong token, layout, unknown peer: retrying will not help the
                         * work queued now. Unreachable: give it peer_timeout. */
                        bool permanent = status != KVF_STATUS_CONNECTION;
                        pthread_mutex_lock(&p->mu);
                        p->failures++;
                        pthread_mutex_unlock(&p->mu);
                        fail_queued(p, status, why, permanent ? 0 : dead, permanent);
                        conn_xfer_fail(p, status, why, permanent ? 0 : dead);
                        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "peer %s: %s", p->name, why);
                        struct pollfd pf = {.fd = p->wake_fd, .events = POLLIN};
                        poll(&pf, 1, (int)backoff_ms);
                        drain_wake(p);
                        backoff_ms = backoff_ms * 2 > 1000 ? 1000 : backoff_ms * 2;
                        continue;
                }
                backoff_ms = 50;
                kvf_count(&cn->ctl, KVF_CTR_PEER_CONNECTS, 1);
                pthread_mutex_lock(&p->mu);
                p->failures = 0;
                pthread_mutex_unlock(&p->mu);
                if (local)
                        kvf_info("peer '%s' (instance %s, same host) connected over a unix socket", p->name,
                                 id.instance);
                else
                        kvf_info("peer '%s' (instance %s at %s:%u) connected", p->name, id.instance, host, port);
                pthread_mutex_lock(&p->mu);
                p->up = true;
                pthread_mutex_unlock(&p->mu);
                post_state(p, true, NULL);
                answer_connects(p, KVF_STATUS_FINISHED, NULL);
                conn_xfer_start(p);
                rc = serve(p, fd, local, why, sizeof(why));
                close(fd);
                pthread_mutex_lock(&p->mu);
                p->up = false;
                pthread_mutex_unlock(&p->mu);
                if (rc < 0) {
                        kvf_warn("peer '%s' lost: %s", p->name, why);
                        post_state(p, false, why);
                }
        }
        /* Retired (no work by definition) or the connector is stopping: a successor
         * connector gets everything unacknowledged again from the sender. */
        fail_queued(p, KVF_STATUS_CONNECTION, "the connector is stopping", 0, false);
        conn_xfer_stop(p);
        kvf_store_release(&p->exited, 1);
        return NULL;
}

static void wake(struct peer *p);

/* Take p out of the table and stop it; conn_peers_tick joins and frees it later. */
static void retire(struct connector *cn, unsigned i, const char *why)
{
        struct peer *p = cn->peers[i];
        cn->peers[i] = cn->peers[--cn->npeers];
        kvf_info("peer '%s' retired: %s", p->name, why);
        kvf_count(&cn->ctl, KVF_CTR_PEERS_RETIRED, 1);
        pthread_mutex_lock(&p->mu);
        kvf_store_release(&p->stop, true);
        pthread_mutex_unlock(&p->mu);
        wake(p);
        p->next_retired = cn->retired;
        cn->retired = p;
}

static bool has_work_now(struct peer *p)
{
        return has_work(p);
}

/*
 * The table is full: make room. An idle peer first (the longest idle); else
 * one that cannot be reached (its work fails now, as it would at its timeout).
 */
static bool make_room(struct connector *cn)
{
        int best = -1;
        for (unsigned i = 0; i < cn->npeers; i++) {
                struct peer *q = cn->peers[i];
                if (!q->idle_since && has_work_now(q))
                        continue;
                if (!q->idle_since)
                        q->idle_since = kvf_now_ns();
                if (best < 0 || q->idle_since < cn->peers[best]->idle_since)
                        best = (int)i;
        }
        if (best >= 0) {
                retire(cn, (unsigned)best, "the peer table is full and it had no work");
                return true;
        }
        for (unsigned i = 0; i < cn->npeers; i++) {
                struct peer *q = cn->peers[i];
                pthread_mutex_lock(&q->mu);
                bool dead = !q->up && q->failures > 0;
                pthread_mutex_unlock(&q->mu);
                if (!dead)
                        continue;
                fail_queued(q, KVF_STATUS_CONNECTION,
                            "unreachable, and its place in the full peer table went to another peer", 0, true);
                conn_xfer_fail(q, KVF_STATUS_CONNECTION,
                             "unreachable, and its place in the full peer table went to another peer", 0);
                answer_connects(q, KVF_STATUS_CONNECTION, "unreachable; retired to make room for another peer");
                retire(cn, i, "the peer table is full and it cannot be reached");
                return true;
        }
        return false;
}

struct peer *conn_peer_get(struct connector *cn, const char *name, char *why, size_t whylen)
{
        for (unsigned i = 0; i < cn->npeers; i++)
                if (!strcmp(cn->peers[i]->name, name)) {
                        cn->peers[i]->idle_since = 0; /* work is coming */
                        return cn->peers[i];
                }
        if (cn->npeers == MAX_PEERS && !make_room(cn)) {
                snprintf(why, whylen, "the connector has %u peers with work in flight, the most it keeps",
                         MAX_PEERS);
                return NULL;
        }
        struct peer *p = calloc(1, sizeof(*p));
        if (!p) {
                snprintf(why, whylen, "the connector is out of memory");
                return NULL;
        }
        snprintf(p->name, sizeof(p->name), "%s", name);
        p->cn = cn;
        pthread_mutex_init(&p->mu, NULL);
        pthread_mutex_init(&p->wmu, NULL);
        p->fd = -1;
        p->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (p->wake_fd < 0 || pthread_create(&p->thread, NULL, peer_main, p) != 0) {
                if (p->wake_fd >= 0)
                        close(p->wake_fd);
                free(p);
                snprintf(why, whylen, "the connector cannot start a thread for the peer");
                return NULL;
        }
        cn->peers[cn->npeers++] = p;
        return p;
}

static void free_peer(struct peer *p)
{
        conn_xfer_free(p);
        while (p->queue) {
                struct notice *n = p->queue;
                p->queue = n->next;
                free_notice(n);
        }
        close(p->wake_fd);
        pthread_mutex_destroy(&p->mu);
        pthread_mutex_destroy(&p->wmu);
        free(p);
}

void conn_peers_tick(struct connector *cn, uint64_t now)
{
        uint64_t idle = kvf_ms(cn->cfg.peer_idle_ms);
        for (unsigned i = 0; i < cn->npeers;) {
                struct peer *p = cn->peers[i];
                if (has_work_now(p)) {
                        p->idle_since = 0;
                } else if (!p->idle_since) {
                        p->idle_since = now;
                } else if (now - p->idle_since > idle) {
                        retire(cn, i, "no work"); /* (moves another peer into slot i) */
                        continue;
                }
                i++;
        }
        for (struct peer **pp = &cn->retired, *p; (p = *pp);) {
                if (!kvf_load_acquire(&p->exited)) {
                        pp = &p->next_retired;
                        continue;
                }
                *pp = p->next_retired;
                pthread_join(p->thread, NULL);
                free_peer(p);
        }
}

static void wake(struct peer *p)
{
        uint64_t one = 1;
        if (write(p->wake_fd, &one, sizeof(one)) < 0) {
                /* counter saturated: the thread is awake anyway */
        }
}

static void queue_push(struct peer *p, struct notice *n, bool at_head)
{
        if (at_head) {
                n->next = p->queue;
                p->queue = n;
                if (!p->queue_tail)
                        p->queue_tail = n;
                return;
        }
        n->next = NULL;
        if (p->queue_tail)
                p->queue_tail->next = n;
        else
                p->queue = n;
        p->queue_tail = n;
}

/* Take n out of the in-flight list; false if it is no longer there. */
static bool inflight_take(struct peer *p, struct notice *n)
{
        struct notice **pp = &p->inflight;
        while (*pp && *pp != n)
                pp = &(*pp)->next;
        if (!*pp)
                return false;
        *pp = n->next;
        return true;
}

/*
 * A notice put in flight for a direct send that did not happen goes to the
 * head of the queue, for the peer thread. Unsent, it cannot have been
 * acknowledged. If the connection ended meanwhile, that end already moved it
 * to the queue and it is no longer in flight (it stays there); if a new
 * connection has even sent it again, it goes once more, and the decode side
 * acknowledges the repeat without a second arrival. Only the control thread
 * makes notices, so the pointer cannot name another one.
 */
static void requeue_first(struct peer *p, struct notice *n)
{
        pthread_mutex_lock(&p->mu);
        if (inflight_take(p, n))
                queue_push(p, n, true);
        pthread_mutex_unlock(&p->mu);
}

/*
 * Room for len more bytes in fd's send buffer, with a margin for the kernel's
 * per-buffer overhead: then one non-blocking send takes the whole frame and
 * the calling thread never waits on a peer that stopped reading.
 *
 * A unix stream socket needs no such check for a small frame: it cuts a send
 * into buffers of half its send buffer size, and Linux allows no send buffer
 * under 4.5 KiB, so a frame of up to UNIX_ONE_BUFFER bytes (header included)
 * is one buffer, which a non-blocking send queues whole or not at all
 * (EAGAIN: the peer thread sends it later). That saves two system calls
 * (SIOCOUTQ, SO_SNDBUF) on a same-host transfer's tail: about 8 us on a
 * 2-vCPU EPYC VM, where code that slept for milliseconds runs cold.
 */
#define UNIX_ONE_BUFFER 2048u

static bool has_room(const struct peer *p, int fd, uint32_t len)
{
        if (p->unix_stream && len <= UNIX_ONE_BUFFER - KVF_FRAME_HDR)
                return true;
        int queued = 0, sndbuf = 0;
        socklen_t sl = sizeof(sndbuf);
        if (ioctl(fd, SIOCOUTQ, &queued) < 0 || getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, &sl) < 0)
                return false;
        return sndbuf > queued && (uint64_t)(sndbuf - queued) >= 2ull * len + 4096;
}

/*
 * A notice for the peer. When the peer is connected and nothing waits before
 * it, the calling thread sends it at once: handing it to the peer thread cost
 * a thread wake-up on the transfer's tail (kvf-sim measured 60 to 100 us on a
 * loaded 2-vCPU machine). Otherwise, and for abort notices, the peer thread
 * sends it. A socket without room now is never waited on here.
 */
void conn_peer_enqueue(struct peer *p, struct notice *n)
{
        pthread_mutex_lock(&p->mu);
        int fd = p->fd;
        uint64_t conn = p->conn;
        bool direct = fd >= 0 && !p->queue && !n->abort_notice;
        if (direct) {
                /* In flight before it is sent: its ack can come back at once. */
                n->next = p->inflight;
                p->inflight = n;
        } else {
                queue_push(p, n, false);
        }
        pthread_mutex_unlock(&p->mu);
        if (!direct) {
                wake(p);
                return;
        }
        if (pthread_mutex_trylock(&p->wmu) != 0) {
                /* The peer thread is writing, perhaps blocked on a full socket: never
                 * wait for it here. */
                requeue_first(p, n);
                wake(p);
                return;
        }
        int rc = -ENOTCONN;
        /* Still the same connection? If not, its end moved n back to the queue. */
        if (p->conn == conn && p->fd == fd && has_room(p, fd, n->len)) {
                /* From here the peer may have it: in doubt (fail_queued). Set before the
                 * send: once sent, its ack may free it at any moment. */
                pthread_mutex_lock(&p->mu);
                n->sent = true;
                pthread_mutex_unlock(&p->mu);
                rc = kvf_net_try_send_frame(fd, KVF_RT_NOTICE, n->frame, n->len, p->cn->cfg.peer_timeout_ms);
        } else if (p->conn == conn && p->fd == fd) {
                rc = 0;
        }
        if (rc == 0) {
                /* No room now (or a full unix socket said EAGAIN): the peer thread sends it. */
                kvf_count(&p->cn->ctl, KVF_CTR_NOTICES_HELD_BACK, 1);
                requeue_first(p, n);
        }
        pthread_mutex_unlock(&p->wmu);
        /* Sent: n may be acknowledged and freed already; touch it no more. A send
         * error: the peer thread finds the connection broken and sends n again. */
        if (rc != 1)
                wake(p);
}

void conn_peer_connect_task(struct peer *p, const struct connect_wait *w)
{
        pthread_mutex_lock(&p->mu);
        bool up = p->up, queued = false;
        if (!up && p->nconnect < sizeof(p->connects) / sizeof(p->connects[0]) &&
            (p->connects[p->nconnect].task_id = strdup(w->task_id))) {
                p->connects[p->nconnect].session = w->session;
                p->connects[p->nconnect].id_bin = w->id_bin;
                p->nconnect++;
                queued = true;
        }
        pthread_mutex_unlock(&p->mu);
        if (up)
                conn_connect_result(p->cn, w, p->name, KVF_STATUS_FINISHED, NULL);
        else if (!queued)
                conn_connect_result(p->cn, w, p->name, KVF_STATUS_CONNECTION,
                                    "too many connect tasks wait for this peer already");
        wake(p);
}

/*
 * The sender withdraws the finish notice of n->key (it waited past its
 * deadline). A finish notice that never went out is dropped and the request
 * ends "timed out" here: the peer cannot have it. Otherwise the withdrawal
 * takes its place and goes out: the peer answers with what it published (the
 * arrival, if it had published it; else it publishes the timeout), and that
 * answer is the request's outcome. A withdrawal for a notice this connector
 * never saw (it restarted) is in doubt as well.
 */
void conn_peer_withdraw(struct peer *p, struct notice *n)
{
        bool dropped = false;
        pthread_mutex_lock(&p->mu);
        struct notice **pp = &p->queue, *old = NULL, *prev = NULL;
        for (; *pp; prev = *pp, pp = &(*pp)->next)
                if ((*pp)->key == n->key) {
                        old = *pp;
                        *pp = old->next;
                        if (p->queue_tail == old)
                                p->queue_tail = prev;
                        break;
                }
        if (!old)
                for (pp = &p->inflight; *pp; pp = &(*pp)->next)
                        if ((*pp)->key == n->key) {
                                old = *pp;
                                *pp = old->next;
                                break;
                        }
        if (old && !old->sent && !old->abort_notice) {
                dropped = true;
        } else {
                n->sent = true; /* in doubt: only the peer's answer ends it */
                queue_push(p, n, true);
        }
        pthread_mutex_unlock(&p->mu);
        if (old)
                free_notice(old);
        if (dropped) {
                conn_write_result(p->cn, n->key, n->request_id, n->id_bin, KVF_STATUS_TIMEOUT,
                                  "timed out: the finish notice never reached the peer (withdrawn)", false);
                conn_xfer_forget(p, n->key);
                free_notice(n);
                return;
        }
        wake(p);
}

void conn_peer_kick(struct peer *p)
{
        wake(p);
}

void conn_peers_stop(struct connector *cn)
{
        for (unsigned i = 0; i < cn->npeers; i++) {
                kvf_store_release(&cn->peers[i]->stop, true);
                wake(cn->peers[i]);
        }
        for (unsigned i = 0; i < cn->npeers; i++) {
                pthread_join(cn->peers[i]->thread, NULL);
                close(cn->peers[i]->wake_fd);
        }
        for (struct peer *p = cn->retired; p; p = p->next_retired)
                pthread_join(p->thread, NULL);
}
