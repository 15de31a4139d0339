/*
 * Outgoing peers: one thread per peer connects, authenticates, sends finish
 * notices, matches their acknowledgements, pings, and reconnects. The control
 * thread sends a notice itself when it can do so at once (conn_peer_enqueue).
 *
 * A notice that cannot be delivered within peer_timeout_ms of reaching the
 * connector fails with "connection error" (or with the permanent reason:
 * wrong token, layout mismatch, unknown peer). A notice in flight when the
 * connection drops is sent again after reconnecting; the decode side
 * acknowledges a repeat without publishing a second arrival.
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
#include "data.h"
#include "err.h"
#include "log.h"

static void post_result(struct connector *cn, const struct notice *n, int status, const char *reason)
{
        if (!n->abort_notice) /* nobody waits for those */
                conn_write_result(cn, n->key, n->request_id, status, reason, true);
}

static void post_state(struct peer *p, bool up, const char *reason)
{
        struct event *ev = calloc(1, sizeof(*ev));
        if (!ev)
                return;
        ev->kind = EV_PEER_STATE;
        ev->rec.type = KVF_RT_PEER_STATE;
        ev->rec.up = up;
        snprintf(ev->rec.peer, sizeof(ev->rec.peer), "%s", p->name);
        snprintf(ev->rec.reason, sizeof(ev->rec.reason), "%s", reason ? reason : "");
        conn_post(p->cn, ev);
}

static void answer_connects(struct peer *p, int status, const char *reason)
{
        pthread_mutex_lock(&p->mu);
        for (unsigned i = 0; i < p->nconnect; i++) {
                conn_connect_result(p->cn, p->connect_ids[i], p->name, status, reason);
                free(p->connect_ids[i]);
        }
        p->nconnect = 0;
        pthread_mutex_unlock(&p->mu);
}

static void free_notice(struct notice *n)
{
        free(n->frame);
        free(n);
}

/* Fail queued notices: all of them, or (older_than != 0) those waiting longer than that. */
static void fail_queued(struct peer *p, int status, const char *reason, uint64_t older_than)
{
        pthread_mutex_lock(&p->mu);
        uint64_t now = kvf_now_ns();
        struct notice **pp = &p->queue, *n;
        p->queue_tail = NULL;
        while ((n = *pp)) {
                if (!older_than || kvf_elapsed(now, n->first_ns) > older_than) {
                        *pp = n->next;
                        post_result(p->cn, n, status, reason);
                        free_notice(n);
                        continue;
                }
                p->queue_tail = n;
                pp = &n->next;
        }
        pthread_mutex_unlock(&p->mu);
}

static bool has_work(struct peer *p)
{
        pthread_mutex_lock(&p->mu);
        bool w = p->queue || p->inflight || p->nconnect;
        pthread_mutex_unlock(&p->mu);
        return w || data_tx_busy(p);
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

/* A new connection's socket, for conn_peer_enqueue's direct sends. */
static void set_socket(struct peer *p, int fd)
{
        pthread_mutex_lock(&p->wmu);
        pthread_mutex_lock(&p->mu);
        p->fd = fd;
        p->conn++;
        pthread_mutex_unlock(&p->mu);
        pthread_mutex_unlock(&p->wmu);
}

/* Connected: move notices, match acks, ping. Returns why the connection ended. */
static int serve(struct peer *p, int fd, char *why, size_t whylen)
{
        struct connector *cn = p->cn;
        struct kvf_reader rd;
        uint64_t keep = (uint64_t)cn->cfg.keepalive_ms * 1000000ull;
        uint64_t dead = (uint64_t)cn->cfg.peer_timeout_ms * 1000000ull;
        uint64_t last_rx = kvf_now_ns(), last_tx = last_rx;
        int rc = 0;

        if (kvf_reader_init(&rd, 1 << 16) < 0) {
                snprintf(why, whylen, "out of memory");
                return -ENOMEM;
        }
        set_socket(p, fd);
        while (!p->stop && !cn->stop) {
                /* Send everything queued. */
                for (;;) {
                        pthread_mutex_lock(&p->mu);
                        struct notice *n = p->queue;
                        if (n) {
                                p->queue = n->next;
                                if (!p->queue)
                                        p->queue_tail = NULL;
                        }
                        pthread_mutex_unlock(&p->mu);
                        if (!n)
                                break;
                        pthread_mutex_lock(&p->wmu);
                        rc = kvf_net_send_frame(fd, KVF_RT_NOTICE, n->frame, n->len, cn->cfg.peer_timeout_ms);
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
                                goto out;
                        }
                        last_tx = kvf_now_ns();
                }
                uint64_t now = kvf_now_ns();
                if (now - last_rx > dead) {
                        snprintf(why, whylen, "no word from the peer for %u ms (dead, or the link is down)",
                                 cn->cfg.peer_timeout_ms);
                        rc = -ETIMEDOUT;
                        goto out;
                }
                if (now - last_tx >= keep) {
                        struct kvf_record ping = {.type = KVF_RT_PING};
                        pthread_mutex_lock(&p->wmu);
                        rc = conn_send_record(fd, &ping, cn->cfg.peer_timeout_ms);
                        pthread_mutex_unlock(&p->wmu);
                        if (rc < 0) {
                                snprintf(why, whylen, "%s", kvf_err_msg());
                                goto out;
                        }
                        last_tx = now;
                }
                struct pollfd pf[2] = {{.fd = fd, .events = POLLIN}, {.fd = p->wake_fd, .events = POLLIN}};
                uint64_t until_ping = keep - (now - last_tx);
                int ms = (int)(until_ping / 1000000ull) + 1;
                if (poll(pf, 2, ms) < 0 && errno != EINTR) {
                        rc = -errno;
                        snprintf(why, whylen, "poll: %s", strerror(errno));
                        goto out;
                }
                if (pf[1].revents & POLLIN)
                        drain_wake(p);
                if (!(pf[0].revents & (POLLIN | POLLHUP | POLLERR)))
                        continue;
                rc = kvf_reader_fill(&rd, fd);
                if (rc == 0 || (rc < 0 && rc != -EAGAIN)) {
                        snprintf(why, whylen, "%s", rc == 0 ? "connection closed by the peer" : strerror(-rc));
                        rc = rc == 0 ? -ECONNRESET : rc;
                        goto out;
                }
                last_rx = kvf_now_ns();
                struct kvf_frame_hdr h;
                const uint8_t *pl;
                while ((rc = kvf_reader_next(&rd, &h, &pl)) == 1) {
                        if (h.type == KVF_RT_PING) {
                                struct kvf_record pong = {.type = KVF_RT_PONG};
                                pthread_mutex_lock(&p->wmu);
                                conn_send_record(fd, &pong, cn->cfg.peer_timeout_ms);
                                pthread_mutex_unlock(&p->wmu);
                                continue;
                        }
                        if (h.type != KVF_RT_ACK)
                                continue;
                        struct kvf_record ack;
                        if (kvf_record_decode(KVF_RT_ACK, pl, h.len, 0, &ack) < 0) {
                                kvf_count(&cn->ctl, KVF_CTR_FRAMES_REJECTED, 1);
                                kvf_record_free(&ack);
                                continue;
                        }
                        /* wmu: a direct send of this very notice may still be inside its
                         * sendmsg (on loopback the ack can come back before it returns). */
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
                                post_result(cn, n, ack.status, ack.reason);
                                free_notice(n);
                        }
                        /* Acknowledged (or refused): the transfer's frames are no longer needed. */
                        data_tx_forget(p, ack.key);
                        kvf_record_free(&ack);
                }
                if (rc < 0) {
                        snprintf(why, whylen, "the peer sent a frame of %u bytes: protocol error", h.len);
                        goto out;
                }
        }
        rc = 0;
        snprintf(why, whylen, "stopping");
out:
        kvf_reader_free(&rd);
        /* No direct send is under way past this (wmu), and none starts on this socket. */
        pthread_mutex_lock(&p->wmu);
        pthread_mutex_lock(&p->mu);
        p->fd = -1;
        /* In-flight notices go back to the head of the queue. */
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
        uint64_t dead = (uint64_t)cn->cfg.peer_timeout_ms * 1000000ull;
        char host[128], why[KVF_REASON_MAX];
        uint16_t port;
        int status;

        while (!p->stop && !cn->stop) {
                if (!has_work(p)) {
                        struct pollfd pf = {.fd = p->wake_fd, .events = POLLIN};
                        poll(&pf, 1, 200);
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
                        rc = conn_handshake_client(cn, fd, "control", &id, &status);
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
                        fail_queued(p, status, why, permanent ? 0 : dead);
                        data_tx_fail(p, status, why, permanent ? 0 : dead);
                        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "peer %s: %s", p->name, why);
                        struct pollfd pf = {.fd = p->wake_fd, .events = POLLIN};
                        poll(&pf, 1, (int)backoff_ms);
                        drain_wake(p);
                        backoff_ms = backoff_ms * 2 > 1000 ? 1000 : backoff_ms * 2;
                        continue;
                }
                backoff_ms = 50;
                kvf_count(&cn->ctl, KVF_CTR_PEER_CONNECTS, 1);
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
                rc = serve(p, fd, why, sizeof(why));
                close(fd);
                pthread_mutex_lock(&p->mu);
                p->up = false;
                pthread_mutex_unlock(&p->mu);
                if (rc < 0) {
                        kvf_warn("peer '%s' lost: %s", p->name, why);
                        post_state(p, false, why);
                }
        }
        fail_queued(p, KVF_STATUS_CONNECTION, "the connector is stopping", 0);
        return NULL;
}

struct peer *conn_peer_get(struct connector *cn, const char *name)
{
        for (unsigned i = 0; i < cn->npeers; i++)
                if (!strcmp(cn->peers[i]->name, name))
                        return cn->peers[i];
        if (cn->npeers == MAX_PEERS)
                return NULL;
        struct peer *p = calloc(1, sizeof(*p));
        if (!p)
                return NULL;
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
                return NULL;
        }
        cn->peers[cn->npeers++] = p;
        return p;
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
 */
static bool has_room(int fd, uint32_t len)
{
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
        if (p->conn == conn && p->fd == fd)
                rc = has_room(fd, n->len) ? kvf_net_try_send_frame(fd, KVF_RT_NOTICE, n->frame, n->len,
                                                                   p->cn->cfg.peer_timeout_ms)
                                          : 0;
        if (rc == 0)
                requeue_first(p, n); /* no room now */
        pthread_mutex_unlock(&p->wmu);
        /* Sent: n may be acknowledged and freed already; touch it no more. A send
         * error: the peer thread finds the connection broken and sends n again. */
        if (rc != 1)
                wake(p);
}

void conn_peer_connect_task(struct peer *p, const char *task_id)
{
        pthread_mutex_lock(&p->mu);
        bool up = p->up, queued = false;
        if (!up && p->nconnect < sizeof(p->connect_ids) / sizeof(p->connect_ids[0]) &&
            (p->connect_ids[p->nconnect] = strdup(task_id))) {
                p->nconnect++;
                queued = true;
        }
        pthread_mutex_unlock(&p->mu);
        if (up)
                conn_connect_result(p->cn, task_id, p->name, KVF_STATUS_FINISHED, NULL);
        else if (!queued)
                conn_connect_result(p->cn, task_id, p->name, KVF_STATUS_CONNECTION,
                                    "too many connect tasks wait for this peer already");
        wake(p);
}

void conn_peer_kick(struct peer *p)
{
        wake(p);
}

void conn_peers_stop(struct connector *cn)
{
        for (unsigned i = 0; i < cn->npeers; i++) {
                cn->peers[i]->stop = true;
                wake(cn->peers[i]);
                data_tx_stop(cn->peers[i]);
        }
        for (unsigned i = 0; i < cn->npeers; i++) {
                pthread_join(cn->peers[i]->thread, NULL);
                close(cn->peers[i]->wake_fd);
        }
}
