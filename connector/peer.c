/*
 * Outgoing peers: their table, their notices, and the threads that carry
 * their control connections.
 *
 * Threads. A fixed pool of I/O threads (cfg.peer_threads) carries every
 * peer's control connection; a peer belongs to one of them for life (round
 * robin at creation). Each I/O thread owns an io_uring: a multishot poll per
 * connected socket (acks, pongs, pings from the peer, end of stream), a
 * one-shot poll for a socket whose send buffer is full or whose connect is
 * under way, and a multishot poll on its eventfd (its mailbox: news from
 * other threads). Timers (pings, the peer timeout, connect deadlines,
 * reconnection back-off) are each peer's `due`, scanned when the earliest
 * one is due; the ring's wait ends then. A socket is non-blocking and never
 * waited on: what it does not take stays in the peer's obuf for its next
 * POLLOUT, and only a bounded amount of notices is moved there, so a peer
 * that stops reading keeps its notices queued and no other peer waits.
 *
 * The client handshake (handshake.c) is a blocking exchange bounded by the
 * connect timeout per step. It runs on a second small pool, the handshake
 * workers (cfg.handshake_threads): an I/O thread connects (non-blocking), hands
 * the connected socket over, and gets it back authenticated, or the failure,
 * through its mailbox. Peers wait their turn in one FIFO; a hung or hostile
 * peer holds one worker for at most its handshake timeout, and never an I/O
 * thread. (We kept one handshake for both sides and every connection
 * purpose, rather than a second, non-blocking copy of the protocol here;
 * handshakes are once per connection.) Same-host peers (named by instance)
 * are connected by the worker too: a unix socket first, then tcp.
 *
 * Who owns what: the control thread owns the table (a hash by name that
 * doubles as it fills: no fixed number of peers) and retirement; an I/O
 * thread owns its peers' connection state (the pool-only fields of struct
 * peer); p->mu guards the notice lists and p->wmu the socket's writes, as
 * before. Lock order: wmu, mu; an I/O thread's mailbox mutex and the
 * handshake pool's mutex are taken with neither held, or innermost.
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
 * Peers without work are retired after peer_idle_ms (sockets, data threads).
 */
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sockios.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"
#include "connector.h"
#include "err.h"
#include "log.h"
#include "xfer.h"

/* A peer's connection, as its I/O thread sees it. */
enum { PS_IDLE, PS_CONNECTING, PS_HS, PS_UP, PS_GONE };
/*
 * Set p's state and keep the segment's peer gauges (common/counters.h) in step: a peer counts
 * as connected (PS_UP), connecting (a connect or handshake under way) or failed (idle after
 * attempts that failed, in its back-off), else in none. Only p's I/O thread calls it (and the
 * stop, after the threads are joined); the gauges are shared by every I/O thread: atomic adds.
 */
static void pstate(struct peer *p, int st)
{
        p->state = st;
        int g = st == PS_UP                           ? KVF_CTR_PEERS_CONNECTED
                : st == PS_CONNECTING || st == PS_HS  ? KVF_CTR_PEERS_CONNECTING
                : st == PS_IDLE && p->failures        ? KVF_CTR_PEERS_FAILED
                                                      : 0;
        if (g == p->gauge)
                return;
        if (p->gauge)
                kvf_count(&p->cn->ctl, (enum kvf_counter_id)p->gauge, UINT64_MAX); /* - 1 */
        if (g)
                kvf_count(&p->cn->ctl, (enum kvf_counter_id)g, 1);
        p->gauge = g;
}

/* Mailbox news (p->mail). */
enum { M_WAKE = 1, M_HS = 2, M_STOP = 4 };
/* Handshake pool jobs (p->job). */
enum { J_HS = 1, J_REAP = 2 };
/* Completions: user_data = ugen << 32 | slot << 8 | kind. */
enum { K_WAKE = 1, K_RD, K_WR, K_CN, K_CANCEL };
#define SLOT_NONE 0xffffffu

/* Notice bytes moved to a peer's obuf at a time: the rest waits in its queue. */
#define OBUF_HIGH (64u << 10)
#define READER_CAP (16u << 10) /* acks and pongs are small; a larger frame is a violation */
#define RING_ENTRIES 256u
#define HS_FAIL_CHECK_MS 200u /* while a peer waits for a handshake worker */

struct peer_io {
        struct connector *cn;
        struct peer_pool *pool;
        pthread_t thread;
        bool started;
        struct io_uring ring;
        int efd;
        pthread_mutex_t mu; /* the mailbox */
        struct peer *mail, *mail_tail;
        /* thread only */
        struct peer **slots;
        uint32_t nslots, capslots, nfree, *free;
        uint64_t next_due;
};

struct peer_pool {
        int stop; /* atomic: the threads end */
        unsigned nio, next_io, nhs;
        struct peer_io *io;
        pthread_t *hs;
        unsigned hs_started;
        pthread_mutex_t mu; /* the handshake FIFO */
        pthread_cond_t cv;
        struct peer *jobs, *jobs_tail;
};

static bool pool_stopping(const struct peer_pool *pl, const struct connector *cn)
{
        return kvf_load_acquire(&pl->stop) || conn_stopping(cn);
}

/* ------------------------------------------------------------------ notices */

static void post_result(struct connector *cn, const struct notice *n, int status, const char *reason)
{
        if (!n->abort_notice) /* nobody waits for those */
                conn_post_write_result(cn, n->key, n->request_id, n->id_bin, status, reason);
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
        ev->rec.lay_bsize = up ? p->hs_block_size : 0; /* the sender regroups tokens by it */
        snprintf(ev->rec.peer, sizeof(ev->rec.peer), "%s", p->name);
        snprintf(ev->rec.reason, sizeof(ev->rec.reason), "%s", reason ? reason : "");
        conn_post(p->cn, ev);
}

/* Answer the connect tasks waiting for p: all, or (older_than != 0) those waiting longer. */
static void answer_connects_older(struct peer *p, int status, const char *reason, uint64_t older_than)
{
        pthread_mutex_lock(&p->mu);
        uint64_t now = kvf_now_ns();
        unsigned keep = 0;
        for (unsigned i = 0; i < p->nconnect; i++) {
                if (older_than && kvf_elapsed(now, p->connects[i].since) <= older_than) {
                        p->connects[keep++] = p->connects[i];
                        continue;
                }
                conn_post_connect_result(p->cn, &p->connects[i], p->name, status, reason);
                free(p->connects[i].task_id);
        }
        p->nconnect = keep;
        pthread_mutex_unlock(&p->mu);
}

static void answer_connects(struct peer *p, int status, const char *reason)
{
        answer_connects_older(p, status, reason, 0);
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
                        kvf_count(&p->cn->ctl, KVF_CTR_NOTICES_FAILED, 1); /* not delivered */
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

/* ------------------------------------------------------------------ mailboxes */

/* Tell p's I/O thread something (any thread; p->mu and p->wmu not held). */
static void mail(struct peer *p, unsigned what)
{
        struct peer_io *io = p->io;
        pthread_mutex_lock(&io->mu);
        bool ring = !io->mail;
        p->mail |= what;
        if (!p->in_mail) {
                p->in_mail = true;
                p->mail_next = NULL;
                if (io->mail_tail)
                        io->mail_tail->mail_next = p;
                else
                        io->mail = p;
                io->mail_tail = p;
        }
        pthread_mutex_unlock(&io->mu);
        /* Only the first news of a batch rings: the thread takes the whole list after the
         * ring (under io->mu), so news added later find it empty and ring again. */
        if (ring) {
                uint64_t one = 1;
                if (write(io->efd, &one, sizeof(one)) < 0) {
                        /* counter saturated: the thread is awake anyway */
                }
        }
}

static void wake(struct peer *p)
{
        mail(p, M_WAKE);
}

/* Hand p to the handshake pool (its I/O thread, or the control thread for J_REAP). */
static void job_push(struct peer_pool *pl, struct peer *p, int job)
{
        pthread_mutex_lock(&pl->mu);
        p->job = job;
        p->job_next = NULL;
        if (pl->jobs_tail)
                pl->jobs_tail->job_next = p;
        else
                pl->jobs = p;
        pl->jobs_tail = p;
        pthread_cond_signal(&pl->cv);
        pthread_mutex_unlock(&pl->mu);
}

/* ------------------------------------------------------------------ the ring */

static uint64_t ud(const struct peer *p, int kind)
{
        return (uint64_t)p->ugen << 32 | (uint64_t)p->slot << 8 | (uint64_t)kind;
}

static struct io_uring_sqe *sqe_get(struct peer_io *io)
{
        struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring);
        while (!sqe) {
                io_uring_submit(&io->ring); /* the queue is full: make room */
                sqe = io_uring_get_sqe(&io->ring);
        }
        return sqe;
}

static void arm(struct peer_io *io, struct peer *p, int fd, int kind)
{
        struct io_uring_sqe *sqe = sqe_get(io);
        if (kind == K_RD) {
                io_uring_prep_poll_multishot(sqe, fd, POLLIN | POLLRDHUP);
                p->armed_rd = true;
        } else {
                io_uring_prep_poll_add(sqe, fd, POLLOUT);
                if (kind == K_WR)
                        p->armed_wr = true;
                else
                        p->armed_cn = true;
        }
        io_uring_sqe_set_data64(sqe, ud(p, kind));
}

/*
 * Cancel whatever is armed for p's current socket and make every completion
 * still to come for it stale (a new generation). A poll holds its own
 * reference to the socket, so the fd may be closed right after this: the
 * socket goes when the cancel completes.
 */
static void disarm(struct peer_io *io, struct peer *p)
{
        bool armed[3] = {p->armed_rd, p->armed_wr, p->armed_cn};
        int kinds[3] = {K_RD, K_WR, K_CN};
        for (int i = 0; i < 3; i++) {
                if (!armed[i])
                        continue;
                struct io_uring_sqe *sqe = sqe_get(io);
                io_uring_prep_poll_remove(sqe, ud(p, kinds[i]));
                io_uring_sqe_set_data64(sqe, K_CANCEL);
        }
        p->armed_rd = p->armed_wr = p->armed_cn = false;
        p->ugen++;
}

static void set_due(struct peer_io *io, struct peer *p, uint64_t due)
{
        p->due = due;
        if (due < io->next_due)
                io->next_due = due;
}

/* ------------------------------------------------------------------ a connection */

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

/* wmu held: append a frame to obuf. 0 or -ENOMEM. */
static int obuf_put(struct peer *p, uint16_t type, const void *pl, uint32_t len)
{
        uint64_t need = (uint64_t)p->olen + KVF_FRAME_HDR + len;
        if (p->ooff == p->olen)
                p->ooff = p->olen = 0;
        need = (uint64_t)p->olen + KVF_FRAME_HDR + len;
        if (need > p->ocap) {
                uint64_t cap = p->ocap ? p->ocap : 4096;
                while (cap < need)
                        cap *= 2;
                uint8_t *b = realloc(p->obuf, cap);
                if (!b)
                        return -ENOMEM;
                p->obuf = b;
                p->ocap = (uint32_t)cap;
        }
        kvf_net_put_hdr(p->obuf + p->olen, len, type, 0);
        if (len)
                memcpy(p->obuf + p->olen + KVF_FRAME_HDR, pl, len);
        p->olen += KVF_FRAME_HDR + len;
        return 0;
}

/* wmu held: give the socket what it takes now. 0 all out, 1 some left (arm POLLOUT), -errno. */
static int obuf_flush(struct peer *p, int fd, uint64_t *last_tx)
{
        while (p->ooff < p->olen) {
                ssize_t w = send(fd, p->obuf + p->ooff, p->olen - p->ooff, MSG_NOSIGNAL | MSG_DONTWAIT);
                if (w < 0) {
                        if (errno == EINTR)
                                continue;
                        return errno == EAGAIN ? 1 : -errno;
                }
                p->ooff += (uint32_t)w;
                *last_tx = kvf_now_ns();
        }
        p->ooff = p->olen = 0;
        while (p->oaborts) { /* out whole: fire and forget */
                struct notice *n = p->oaborts;
                p->oaborts = n->next;
                free_notice(n);
        }
        /* A burst's large buffer is not kept for an idle peer. */
        if (p->ocap > 4 * OBUF_HIGH) {
                free(p->obuf);
                p->obuf = NULL;
                p->ocap = 0;
        }
        return 0;
}

/*
 * Move queued notices to obuf (up to OBUF_HIGH bytes waiting there) and give
 * the socket what it takes. A notice is in doubt from the moment its frame
 * is in obuf: the peer may have it once any of it is out. 0, or -errno with
 * `why` when the connection broke.
 */
static int send_queued(struct peer_io *io, struct peer *p, char *why, size_t whylen)
{
        int fd = p->fd, rc = 0;
        pthread_mutex_lock(&p->wmu);
        while (p->olen - p->ooff < OBUF_HIGH) {
                pthread_mutex_lock(&p->mu);
                struct notice *n = p->queue;
                uint64_t gen = kvf_load_relaxed(&p->remote_gen);
                if (n && n->peer_gen && n->peer_gen != gen) {
                        /* Its blocks were reserved in an incarnation of the peer that is gone:
                         * this one never heard of the request. */
                        p->queue = n->next;
                        if (!p->queue)
                                p->queue_tail = NULL;
                        post_result(p->cn, n, KVF_STATUS_CONNECTION,
                                    n->sent ? "the peer was re-created during the transfer: the blocks reserved "
                                              "were in the incarnation before (in doubt: the notice had reached it)"
                                            : "the peer was re-created during the transfer: the blocks reserved "
                                              "were in the incarnation before");
                        kvf_count(&p->cn->ctl, KVF_CTR_NOTICES_FAILED, 1);
                        free_notice(n);
                        pthread_mutex_unlock(&p->mu);
                        continue;
                }
                if (n && obuf_put(p, KVF_RT_NOTICE, n->frame, n->len) == 0) {
                        p->queue = n->next;
                        if (!p->queue)
                                p->queue_tail = NULL;
                        n->sent = true;
                        if (n->abort_notice) {
                                n->next = p->oaborts;
                                p->oaborts = n;
                        } else {
                                n->next = p->inflight; /* its ack may come at any moment */
                                p->inflight = n;
                        }
                } else {
                        n = NULL; /* (out of memory: they wait in the queue) */
                }
                pthread_mutex_unlock(&p->mu);
                if (!n)
                        break;
        }
        if (p->olen > p->ooff)
                rc = obuf_flush(p, fd, &p->last_tx);
        pthread_mutex_unlock(&p->wmu);
        if (rc < 0) {
                snprintf(why, whylen, "send: %s", strerror(-rc));
                return rc;
        }
        if (rc == 1 && !p->armed_wr)
                arm(io, p, fd, K_WR);
        return 0;
}

/* A control frame of ours (ping, pong) to the peer, after what is waiting. */
static int send_record(struct peer_io *io, struct peer *p, const struct kvf_record *r, char *why,
                       size_t whylen)
{
        uint8_t *buf;
        size_t len;
        int rc = kvf_record_encode_alloc(r, &buf, &len);
        if (rc < 0) {
                snprintf(why, whylen, "encode %s: %s", kvf_rec_type_name(r->type), strerror(-rc));
                return rc;
        }
        pthread_mutex_lock(&p->wmu);
        rc = obuf_put(p, (uint16_t)r->type, buf, (uint32_t)len);
        if (rc == 0)
                rc = obuf_flush(p, p->fd, &p->last_tx);
        pthread_mutex_unlock(&p->wmu);
        free(buf);
        if (rc < 0) {
                snprintf(why, whylen, "send %s: %s", kvf_rec_type_name(r->type), strerror(-rc));
                return rc;
        }
        if (rc == 1 && !p->armed_wr)
                arm(io, p, p->fd, K_WR);
        return 0;
}

/* Take in what the peer sent: pings answered, replies handled. 0, or < 0 with `why`. */
static int read_frames(struct peer_io *io, struct peer *p, char *why, size_t whylen)
{
        for (;;) {
                int rc = kvf_reader_fill(&p->rd, p->fd);
                if (rc == -EAGAIN)
                        return 0;
                if (rc == 0 || rc == -EMSGSIZE || rc < 0) {
                        snprintf(why, whylen, "%s",
                                 rc == 0 ? "connection closed by the peer"
                                 : rc == -EMSGSIZE ? "the peer sent a frame too large: protocol error"
                                                   : strerror(-rc));
                        return rc == 0 ? -ECONNRESET : rc;
                }
                p->last_rx = kvf_now_ns();
                struct kvf_frame_hdr h;
                const uint8_t *pl;
                while ((rc = kvf_reader_next(&p->rd, &h, &pl)) == 1) {
                        if (h.type == KVF_RT_PING) {
                                struct kvf_record pong = {.type = KVF_RT_PONG};
                                if ((rc = send_record(io, p, &pong, why, whylen)) < 0)
                                        return rc;
                        } else if (h.type == KVF_RT_ACK || h.type == KVF_RT_PONG) {
                                on_reply(p, h.type, pl, h.len);
                        }
                }
                if (rc < 0) {
                        snprintf(why, whylen, "the peer sent a frame of %u bytes: protocol error", h.len);
                        return -EPROTO;
                }
        }
}

/*
 * The connection is over: no direct send is under way past this (wmu), none
 * starts on this socket, and notices in flight (and abort notices not out
 * whole) go back to the head of the queue (in doubt: sent again on the next
 * connection).
 */
static void end_connection(struct peer *p)
{
        pthread_mutex_lock(&p->wmu);
        pthread_mutex_lock(&p->mu);
        p->fd = -1;
        p->olen = p->ooff = 0;
        struct notice *lists[2] = {p->inflight, p->oaborts};
        p->inflight = p->oaborts = NULL;
        for (int i = 0; i < 2; i++)
                while (lists[i]) {
                        struct notice *n = lists[i];
                        lists[i] = n->next;
                        queue_push(p, n, true);
                }
        p->up = false;
        pthread_mutex_unlock(&p->mu);
        pthread_mutex_unlock(&p->wmu);
}

/* p's connection ended (rc < 0: lost, with why) or is being closed (rc 0). */
static void lost(struct peer_io *io, struct peer *p, int rc, const char *why)
{
        int fd = p->fd;
        disarm(io, p);
        end_connection(p);
        if (fd >= 0) {
                shutdown(fd, SHUT_RDWR); /* the peer sees the end now, not when the cancel lands */
                close(fd);
        }
        kvf_reader_free(&p->rd);
        memset(&p->rd, 0, sizeof(p->rd));
        pstate(p, PS_IDLE);
        p->retry_at = 0; /* reconnect at once if there is work, as after any lost connection */
        if (rc < 0) {
                kvf_warn("peer '%s' lost: %s", p->name, why);
                post_state(p, false, why);
        }
        set_due(io, p, kvf_now_ns());
}

/* A connection attempt failed (connect or handshake). */
static void failed(struct peer_io *io, struct peer *p, int status, const char *reason)
{
        struct connector *cn = p->cn;
        char why[KVF_REASON_MAX]; /* (reason may be kvf_err's, which what follows may change) */
        snprintf(why, sizeof(why), "%s", reason);
        kvf_count(&cn->ctl, KVF_CTR_PEER_FAILURES, 1);
        answer_connects(p, status, why);
        /* Wrong token, layout, unknown peer: retrying will not help the work queued now.
         * Unreachable: give it peer_timeout. */
        bool permanent = status != KVF_STATUS_CONNECTION;
        uint64_t dead = kvf_ms(cn->cfg.peer_timeout_ms);
        pthread_mutex_lock(&p->mu);
        p->failures++;
        pthread_mutex_unlock(&p->mu);
        fail_queued(p, status, why, permanent ? 0 : dead, permanent);
        conn_xfer_fail(p, status, why, permanent ? 0 : dead);
        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "peer %s: %s", p->name, why);
        uint64_t now = kvf_now_ns();
        pstate(p, PS_IDLE);
        p->retry_at = now + kvf_ms(p->backoff_ms);
        p->backoff_ms = p->backoff_ms * 2 > 1000 ? 1000 : p->backoff_ms * 2;
        set_due(io, p, p->retry_at);
}

/* The handshake worker is done with p (M_HS). */
static void hs_done(struct peer_io *io, struct peer *p)
{
        struct connector *cn = p->cn;
        if (p->hs_rc == -ECANCELED) { /* no work left, or stopping: nothing was tried */
                pstate(p, PS_IDLE);
                p->retry_at = 0;
                set_due(io, p, kvf_now_ns());
                return;
        }
        if (p->hs_rc < 0) {
                pstate(p, PS_IDLE);
                failed(io, p, p->hs_status, p->hs_why);
                return;
        }
        int fd = p->hs_fd;
        p->hs_fd = -1; /* (the connection's now: p->fd) */
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
        if (kvf_reader_init(&p->rd, READER_CAP) < 0) {
                close(fd);
                failed(io, p, KVF_STATUS_CONNECTION, "the connector is out of memory");
                return;
        }
        p->backoff_ms = 50;
        kvf_count(&cn->ctl, KVF_CTR_PEER_CONNECTS, 1);
        uint64_t was = kvf_load_relaxed(&p->remote_gen);
        if (was && was != p->hs_gen)
                kvf_warn("peer '%s' was re-created (instance %s at its address is another incarnation): "
                         "transfers and notices bound to the one before fail", p->name, p->hs_instance);
        /* Another incarnation answers at the peer's address (it was stopped and started
         * again): the transfers bound to the one before fail now (their blocks were reserved
         * there, by an engine that is gone), and their notices are never sent (send_queued);
         * those not bound yet are this one's. */
        kvf_store_release(&p->remote_gen, p->hs_gen);
        conn_xfer_check_gen(p, p->hs_gen);
        if (p->hs_local)
                kvf_info("peer '%s' (instance %s, same host) connected over a unix socket", p->name,
                         p->hs_instance);
        else
                kvf_info("peer '%s' (instance %s at %s:%u) connected", p->name, p->hs_instance, p->host,
                         p->port);
        set_socket(p, fd);
        pthread_mutex_lock(&p->mu);
        p->failures = 0;
        p->up = true;
        pthread_mutex_unlock(&p->mu);
        pstate(p, PS_UP);
        p->last_rx = p->last_tx = kvf_now_ns();
        arm(io, p, fd, K_RD);
        post_state(p, true, NULL);
        answer_connects(p, KVF_STATUS_FINISHED, NULL);
        conn_xfer_start(p);
        char why[KVF_REASON_MAX];
        int rc = send_queued(io, p, why, sizeof(why));
        if (rc < 0)
                lost(io, p, rc, why);
        else
                set_due(io, p, p->last_tx + kvf_ms(cn->cfg.keepalive_ms));
}

/* p has no connection: connect if it has work and its back-off is over. */
static void kick(struct peer_io *io, struct peer *p, uint64_t now)
{
        struct connector *cn = p->cn;
        if (now < p->retry_at) {
                set_due(io, p, p->retry_at);
                return;
        }
        if (!has_work(p)) {
                set_due(io, p, now + kvf_ms(1000)); /* (work wakes it; this is a backstop) */
                return;
        }
        int status;
        int rc = conn_peer_resolve(p, p->host, sizeof(p->host), &p->port, &status);
        if (rc < 0) {
                failed(io, p, status, kvf_err_msg());
                return;
        }
        p->cfd = -1;
        if (strchr(p->name, ':')) {
                bool done = false;
                int fd = kvf_net_connect_start(p->host, p->port, &done);
                if (fd < 0 && fd != -EINVAL) {
                        failed(io, p, KVF_STATUS_CONNECTION, kvf_err_msg());
                        return;
                }
                if (fd >= 0 && !done) {
                        p->cfd = fd;
                        pstate(p, PS_CONNECTING);
                        p->conn_deadline = now + kvf_ms(cn->cfg.connect_timeout_ms);
                        arm(io, p, fd, K_CN);
                        set_due(io, p, p->conn_deadline);
                        return;
                }
                if (fd >= 0 && kvf_net_connect_finish(fd, p->host, p->port) < 0) {
                        close(fd);
                        failed(io, p, KVF_STATUS_CONNECTION, kvf_err_msg());
                        return;
                }
                p->cfd = fd; /* connected, or -1: a name the worker resolves and connects */
        }
        pstate(p, PS_HS);
        p->last_fail_check = now;
        set_due(io, p, now + kvf_ms(HS_FAIL_CHECK_MS));
        job_push(io->pool, p, J_HS);
}

/* p's connect completed (or failed): on to the handshake. */
static void connected(struct peer_io *io, struct peer *p)
{
        int fd = p->cfd;
        disarm(io, p);
        if (kvf_net_connect_finish(fd, p->host, p->port) < 0) {
                close(fd);
                p->cfd = -1;
                failed(io, p, KVF_STATUS_CONNECTION, kvf_err_msg());
                return;
        }
        uint64_t now = kvf_now_ns();
        pstate(p, PS_HS);
        p->last_fail_check = now;
        set_due(io, p, now + kvf_ms(HS_FAIL_CHECK_MS));
        job_push(io->pool, p, J_HS);
}

/* The I/O thread lets go of p (retired): its data paths are stopped by a worker. */
static void let_go(struct peer_io *io, struct peer *p)
{
        if (p->state == PS_UP)
                lost(io, p, 0, NULL);
        if (p->state == PS_CONNECTING) {
                disarm(io, p);
                close(p->cfd);
                p->cfd = -1;
        }
        pstate(p, PS_GONE);
        io->slots[p->slot] = NULL;
        io->free[io->nfree++] = p->slot;
        p->slot = SLOT_NONE;
        if (!pool_stopping(io->pool, io->cn))
                job_push(io->pool, p, J_REAP);
        /* else conn_peers_stop does what the job would */
}

/* p's timers. */
static void tick(struct peer_io *io, struct peer *p, uint64_t now)
{
        struct connector *cn = p->cn;
        char why[KVF_REASON_MAX];
        if (kvf_load_acquire(&p->stop) && p->state != PS_HS) {
                let_go(io, p);
                return;
        }
        switch (p->state) {
        case PS_IDLE:
                kick(io, p, now);
                break;
        case PS_CONNECTING:
                if (now < p->conn_deadline) {
                        set_due(io, p, p->conn_deadline);
                        break;
                }
                disarm(io, p);
                close(p->cfd);
                p->cfd = -1;
                snprintf(why, sizeof(why), "connect to %s%s%s:%u: no answer (timed out)",
                         strchr(p->host, ':') ? "[" : "", p->host, strchr(p->host, ':') ? "]" : "", p->port);
                failed(io, p, KVF_STATUS_CONNECTION, why);
                break;
        case PS_HS:
                /* Waiting for a worker, or in a handshake: queued work still fails at the peer
                 * timeout. */
                if (now - p->last_fail_check >= kvf_ms(HS_FAIL_CHECK_MS)) {
                        uint64_t dead = kvf_ms(cn->cfg.peer_timeout_ms);
                        const char *why_hs = "no connection to the peer within the peer timeout "
                                             "(its handshake is pending)";
                        p->last_fail_check = now;
                        fail_queued(p, KVF_STATUS_CONNECTION, why_hs, dead, false);
                        conn_xfer_fail(p, KVF_STATUS_CONNECTION, why_hs, dead);
                        answer_connects_older(p, KVF_STATUS_CONNECTION, why_hs, dead);
                }
                set_due(io, p, p->last_fail_check + kvf_ms(HS_FAIL_CHECK_MS));
                break;
        case PS_UP: {
                uint64_t keep = kvf_ms(cn->cfg.keepalive_ms), dead = kvf_ms(cn->cfg.peer_timeout_ms);
                if (now - p->last_rx > dead) {
                        snprintf(why, sizeof(why), "no word from the peer for %u ms (dead, or the link is down)",
                                 cn->cfg.peer_timeout_ms);
                        lost(io, p, -ETIMEDOUT, why);
                        break;
                }
                /* (Every path that queues a notice wakes us; this is a backstop.) */
                int rc = send_queued(io, p, why, sizeof(why));
                if (rc < 0) {
                        lost(io, p, rc, why);
                        break;
                }
                pthread_mutex_lock(&p->wmu);
                bool quiet = p->olen == p->ooff; /* (a full socket gets no ping on top) */
                pthread_mutex_unlock(&p->wmu);
                if (now - p->last_tx >= keep && quiet) {
                        struct kvf_record ping = {.type = KVF_RT_PING};
                        rc = send_record(io, p, &ping, why, sizeof(why));
                        if (rc < 0) {
                                lost(io, p, rc, why);
                                break;
                        }
                        p->last_tx = now;
                }
                uint64_t a = p->last_tx + keep, b = p->last_rx + dead + 1;
                set_due(io, p, a < b ? (a > now ? a : now + kvf_ms(10)) : b);
                break;
        }
        default:
                break;
        }
}

/* News from the mailbox for p. */
static void news(struct peer_io *io, struct peer *p, unsigned what, uint64_t now)
{
        if (p->state == PS_GONE)
                return; /* (nothing mails a peer after its thread let go of it) */
        if (p->slot == SLOT_NONE) { /* its first news: a place in the table */
                if (!io->nfree) {
                        uint32_t cap = io->capslots ? io->capslots * 2 : 64;
                        struct peer **s = realloc(io->slots, cap * sizeof(*s));
                        uint32_t *f = s ? realloc(io->free, cap * sizeof(*f)) : NULL;
                        if (s) {
                                io->slots = s;
                                memset(s + io->capslots, 0, (cap - io->capslots) * sizeof(*s));
                        }
                        if (!f) {
                                /* Out of memory: try again with its next news. */
                                kvf_errlog(&io->cn->ctl, KVF_ROLE_CONNECTOR,
                                           "peer %s: out of memory for its connection", p->name);
                                return;
                        }
                        io->free = f;
                        for (uint32_t i = cap; i > io->capslots; i--)
                                io->free[io->nfree++] = i - 1;
                        io->capslots = cap;
                }
                p->slot = io->free[--io->nfree];
                io->slots[p->slot] = p;
                pstate(p, PS_IDLE);
                p->backoff_ms = 50;
        }
        if (what & M_HS)
                hs_done(io, p);
        if (kvf_load_acquire(&p->stop) || p->state == PS_IDLE) {
                tick(io, p, now);
        } else if ((what & M_WAKE) && p->state == PS_UP) {
                char why[KVF_REASON_MAX];
                int rc = send_queued(io, p, why, sizeof(why));
                if (rc < 0)
                        lost(io, p, rc, why);
        }
}

static void completion(struct peer_io *io, struct io_uring_cqe *cqe)
{
        uint64_t u = io_uring_cqe_get_data64(cqe);
        int kind = (int)(u & 0xff);
        if (kind == K_CANCEL)
                return;
        if (kind == K_WAKE) {
                uint64_t v;
                if (read(io->efd, &v, sizeof(v)) < 0) {
                        /* (nothing to read: a spurious wake) */
                }
                if (!(cqe->flags & IORING_CQE_F_MORE)) {
                        struct io_uring_sqe *sqe = sqe_get(io);
                        io_uring_prep_poll_multishot(sqe, io->efd, POLLIN);
                        io_uring_sqe_set_data64(sqe, K_WAKE);
                }
                return;
        }
        uint32_t slot = (uint32_t)(u >> 8) & SLOT_NONE;
        struct peer *p = slot < io->capslots ? io->slots[slot] : NULL;
        if (!p || p->ugen != (uint32_t)(u >> 32))
                return; /* for a socket since closed */
        char why[KVF_REASON_MAX];
        int rc;
        switch (kind) {
        case K_CN:
                p->armed_cn = false;
                connected(io, p);
                break;
        case K_WR:
                p->armed_wr = false;
                if ((rc = send_queued(io, p, why, sizeof(why))) < 0)
                        lost(io, p, rc, why);
                break;
        case K_RD:
                if (!(cqe->flags & IORING_CQE_F_MORE))
                        p->armed_rd = false;
                if (cqe->res < 0 && cqe->res != -ECANCELED) {
                        snprintf(why, sizeof(why), "poll: %s", strerror(-cqe->res));
                        lost(io, p, cqe->res, why);
                        break;
                }
                if ((rc = read_frames(io, p, why, sizeof(why))) < 0) {
                        lost(io, p, rc, why);
                        break;
                }
                if (!p->armed_rd)
                        arm(io, p, p->fd, K_RD);
                break;
        default:
                break;
        }
}

static void *io_main(void *arg)
{
        struct peer_io *io = arg;
        struct connector *cn = io->cn;
        struct io_uring_sqe *sqe = sqe_get(io);
        io_uring_prep_poll_multishot(sqe, io->efd, POLLIN);
        io_uring_sqe_set_data64(sqe, K_WAKE);
        io->next_due = 0;
        while (!pool_stopping(io->pool, cn)) {
                uint64_t now = kvf_now_ns();
                /* Sleep until the earliest timer, or CONN_POLL_MS to look at the stop flags. */
                uint64_t wait = io->next_due > now ? io->next_due - now : 0;
                if (wait > kvf_ms(CONN_POLL_MS))
                        wait = kvf_ms(CONN_POLL_MS);
                struct __kernel_timespec ts = {.tv_sec = (long long)(wait / 1000000000ull),
                                               .tv_nsec = (long long)(wait % 1000000000ull)};
                struct io_uring_cqe *cqe;
                if (wait)
                        io_uring_submit_and_wait_timeout(&io->ring, &cqe, 1, &ts, NULL);
                else
                        io_uring_submit(&io->ring);
                unsigned head, n = 0;
                io_uring_for_each_cqe(&io->ring, head, cqe)
                {
                        completion(io, cqe);
                        n++;
                }
                io_uring_cq_advance(&io->ring, n);

                pthread_mutex_lock(&io->mu);
                struct peer *m = io->mail;
                io->mail = io->mail_tail = NULL;
                pthread_mutex_unlock(&io->mu);
                now = kvf_now_ns();
                while (m) {
                        pthread_mutex_lock(&io->mu);
                        struct peer *p = m;
                        m = p->mail_next;
                        unsigned what = p->mail;
                        p->mail = 0;
                        p->in_mail = false;
                        pthread_mutex_unlock(&io->mu);
                        news(io, p, what, now);
                }

                now = kvf_now_ns();
                if (now < io->next_due)
                        continue;
                io->next_due = UINT64_MAX;
                for (uint32_t i = 0; i < io->capslots; i++) {
                        struct peer *p = io->slots[i];
                        if (!p)
                                continue;
                        if (p->due <= now)
                                tick(io, p, now);
                        else if (p->due < io->next_due)
                                io->next_due = p->due;
                }
        }
        /* Stopping: every connection ends here; conn_peers_stop does the rest. */
        for (uint32_t i = 0; i < io->capslots; i++) {
                struct peer *p = io->slots[i];
                if (!p)
                        continue;
                if (p->state == PS_UP)
                        lost(io, p, 0, NULL);
                if (p->state == PS_CONNECTING) {
                        disarm(io, p);
                        close(p->cfd);
                        p->cfd = -1;
                        pstate(p, PS_IDLE);
                }
        }
        io_uring_submit(&io->ring);
        return NULL;
}

/* ------------------------------------------------------------------ handshake workers */

/*
 * A peer named by instance (not host:port) lives on this host: its connector's
 * unix socket, if it listens on one in our socket directory and runs as our
 * user; else -1 (then tcp), with a warning unless simply nobody listens there.
 */
static int connect_local(struct peer *p)
{
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

/* Connect (where the I/O thread could not) and authenticate p's control connection. */
static void handshake(struct peer *p)
{
        struct connector *cn = p->cn;
        int fd = p->cfd, rc = 0;
        p->cfd = -1;
        p->hs_local = false;
        p->hs_status = KVF_STATUS_CONNECTION;
        if (kvf_load_acquire(&p->stop) || pool_stopping(cn->pool, cn) || !has_work(p)) {
                if (fd >= 0)
                        close(fd);
                p->hs_rc = -ECANCELED;
                return;
        }
        if (fd < 0 && !strchr(p->name, ':')) {
                fd = connect_local(p);
                p->hs_local = fd >= 0;
        }
        if (fd < 0)
                fd = rc = kvf_net_connect(p->host, p->port, cn->cfg.connect_timeout_ms);
        struct peer_identity id;
        if (rc >= 0) {
                rc = conn_handshake_client(cn, fd, "control", &id, NULL, &p->hs_status);
                if (rc < 0)
                        kvf_err_ctx(rc, "peer '%s' at %s:%u", p->name, p->host, p->port);
        }
        if (rc < 0) {
                snprintf(p->hs_why, sizeof(p->hs_why), "%s", kvf_err_msg());
                if (fd >= 0)
                        close(fd);
                p->hs_fd = -1;
                p->hs_rc = rc;
                return;
        }
        snprintf(p->hs_instance, sizeof(p->hs_instance), "%s", id.instance);
        p->hs_block_size = id.layout.block_size;
        p->hs_gen = id.created_ns;
        p->hs_fd = fd;
        p->hs_rc = 0;
}

static void *hs_main(void *arg)
{
        struct connector *cn = arg;
        struct peer_pool *pl = cn->pool;
        for (;;) {
                pthread_mutex_lock(&pl->mu);
                while (!pl->jobs && !pool_stopping(pl, cn)) {
                        struct timespec ts;
                        clock_gettime(CLOCK_MONOTONIC, &ts);
                        ts.tv_nsec += CONN_POLL_MS * 1000000L;
                        if (ts.tv_nsec >= 1000000000L) {
                                ts.tv_sec++;
                                ts.tv_nsec -= 1000000000L;
                        }
                        pthread_cond_timedwait(&pl->cv, &pl->mu, &ts);
                }
                struct peer *p = pl->jobs;
                if (!p || pool_stopping(pl, cn)) {
                        pthread_mutex_unlock(&pl->mu);
                        return NULL; /* jobs left are conn_peers_stop's */
                }
                pl->jobs = p->job_next;
                if (!pl->jobs)
                        pl->jobs_tail = NULL;
                int job = p->job;
                p->job = 0;
                pthread_mutex_unlock(&pl->mu);
                if (job == J_HS) {
                        handshake(p);
                        mail(p, M_HS);
                } else {
                        /* Retired: a successor connector gets everything unacknowledged again
                         * from the sender. */
                        fail_queued(p, KVF_STATUS_CONNECTION, "the connector is stopping", 0, false);
                        conn_xfer_stop(p);
                        kvf_store_release(&p->exited, 1);
                }
        }
}

/* ------------------------------------------------------------------ the table */

static uint64_t name_hash(const char *s)
{
        uint64_t h = 1469598103934665603ull; /* FNV-1a */
        for (; *s; s++)
                h = (h ^ (uint8_t)*s) * 1099511628211ull;
        return h;
}

/* Double the table (control thread). False when out of memory (the old one stays). */
static bool table_grow(struct connector *cn)
{
        unsigned cap = cn->ptab_cap ? cn->ptab_cap * 2 : 256;
        struct peer **t = calloc(cap, sizeof(*t));
        if (!t)
                return false;
        for (unsigned i = 0; i < cn->ptab_cap; i++)
                while (cn->ptab[i]) {
                        struct peer *p = cn->ptab[i];
                        cn->ptab[i] = p->hnext;
                        unsigned b = (unsigned)(name_hash(p->name) & (cap - 1));
                        p->hnext = t[b];
                        t[b] = p;
                }
        free(cn->ptab);
        cn->ptab = t;
        cn->ptab_cap = cap;
        return true;
}

struct peer *conn_peer_get(struct connector *cn, const char *name, char *why, size_t whylen)
{
        uint64_t h = name_hash(name);
        if (cn->ptab_cap)
                for (struct peer *p = cn->ptab[h & (cn->ptab_cap - 1)]; p; p = p->hnext)
                        if (!strcmp(p->name, name)) {
                                p->idle_since = 0; /* work is coming */
                                return p;
                        }
        /* Chains of two on average at most; a failed doubling only makes them longer. */
        if (cn->npeers >= 2 * cn->ptab_cap && !table_grow(cn) && !cn->ptab_cap) {
                snprintf(why, whylen, "the connector is out of memory for another peer (%u peers)",
                         cn->npeers);
                return NULL;
        }
        struct peer *p = calloc(1, sizeof(*p));
        if (!p) {
                snprintf(why, whylen, "the connector is out of memory for another peer (%u peers)",
                         cn->npeers);
                return NULL;
        }
        snprintf(p->name, sizeof(p->name), "%s", name);
        p->cn = cn;
        pthread_mutex_init(&p->mu, NULL);
        pthread_mutex_init(&p->wmu, NULL);
        p->fd = p->cfd = p->hs_fd = -1;
        p->slot = SLOT_NONE;
        struct peer_pool *pl = cn->pool;
        p->io = &pl->io[pl->next_io++ % pl->nio];
        unsigned b = (unsigned)(h & (cn->ptab_cap - 1));
        p->hnext = cn->ptab[b];
        cn->ptab[b] = p;
        cn->npeers++;
        wake(p); /* its I/O thread takes it in */
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
        kvf_reader_free(&p->rd);
        free(p->obuf);
        pthread_mutex_destroy(&p->mu);
        pthread_mutex_destroy(&p->wmu);
        free(p);
}

/* Take p out of the table and hand it to its I/O thread to let go; freed once done. */
static void retire(struct connector *cn, struct peer **pp, const char *why)
{
        struct peer *p = *pp;
        *pp = p->hnext;
        cn->npeers--;
        kvf_info("peer '%s' retired: %s", p->name, why);
        kvf_count(&cn->ctl, KVF_CTR_PEERS_RETIRED, 1);
        pthread_mutex_lock(&p->mu);
        kvf_store_release(&p->stop, true);
        pthread_mutex_unlock(&p->mu);
        mail(p, M_STOP);
        p->next_retired = cn->retired;
        cn->retired = p;
}

void conn_peers_tick(struct connector *cn, uint64_t now)
{
        uint64_t idle = kvf_ms(cn->cfg.peer_idle_ms);
        for (unsigned b = 0; b < cn->ptab_cap; b++)
                for (struct peer **pp = &cn->ptab[b], *p; (p = *pp);) {
                        if (has_work(p)) {
                                p->idle_since = 0;
                        } else if (!p->idle_since) {
                                p->idle_since = now;
                        } else if (now - p->idle_since > idle) {
                                retire(cn, pp, "no work"); /* (*pp is the next one now) */
                                continue;
                        }
                        pp = &p->hnext;
                }
        for (struct peer **pp = &cn->retired, *p; (p = *pp);) {
                if (!kvf_load_acquire(&p->exited)) {
                        pp = &p->next_retired;
                        continue;
                }
                *pp = p->next_retired;
                free_peer(p);
        }
}

/* ------------------------------------------------------------------ the control thread's side */

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
 * head of the queue, for the I/O thread. Unsent, it cannot have been
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

/* A/B switch of bench/tail_ab.sh (ENV_A, ENV_B): KVF_AB_NO_DIRECT_NOTICES=1 hands every notice
 * to the I/O thread. */
static bool ab_no_direct;

__attribute__((constructor)) static void ab_switches(void)
{
        const char *v = getenv("KVF_AB_NO_DIRECT_NOTICES");
        ab_no_direct = v && !strcmp(v, "1");
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
 * wmu held, the socket's output buffer empty: send n's frame without waiting.
 * 0 nothing sent (no room), 1 all of it, 2 part of it: the rest is the first
 * thing in obuf now, for the I/O thread (the peer cannot answer a frame it
 * has not read whole, so n is not acknowledged before that), < 0 an error.
 */
static int direct_send(struct peer *p, int fd, const struct notice *n)
{
        uint8_t hdr[KVF_FRAME_HDR];
        kvf_net_put_hdr(hdr, n->len, KVF_RT_NOTICE, 0);
        struct iovec iov[2] = {{hdr, sizeof(hdr)}, {n->frame, n->len}};
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = n->len ? 2 : 1};
        ssize_t w = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0)
                return errno == EAGAIN || errno == EINTR ? 0 : -errno;
        size_t done = (size_t)w, total = sizeof(hdr) + n->len;
        if (done == total)
                return 1;
        if (obuf_put(p, KVF_RT_NOTICE, n->frame, n->len) < 0) {
                /* Out of memory for the rest: finish it here, bounded by the peer timeout. */
                int rc = done < sizeof(hdr) ? kvf_net_write_all(fd, hdr + done, sizeof(hdr) - done,
                                                                 p->cn->cfg.peer_timeout_ms)
                                            : 0;
                size_t off = done < sizeof(hdr) ? 0 : done - sizeof(hdr);
                if (rc == 0)
                        rc = kvf_net_write_all(fd, n->frame + off, n->len - off, p->cn->cfg.peer_timeout_ms);
                return rc < 0 ? rc : 1;
        }
        p->ooff += (uint32_t)done; /* (obuf was empty: the frame is all there is) */
        return 2;
}

/*
 * A notice for the peer. When the peer is connected and nothing waits before
 * it, the calling thread sends it at once: handing it to the I/O thread costs
 * a thread wake-up on the transfer's tail. Otherwise, and for abort notices,
 * the I/O thread sends it. A socket without room now is never waited on here
 * (what it does not take of the frame goes to obuf), and wmu is only tried:
 * its holder never waits either, but a wait here would put the control
 * thread behind another thread's system call.
 */
void conn_peer_enqueue(struct peer *p, struct notice *n)
{
        pthread_mutex_lock(&p->mu);
        int fd = p->fd;
        uint64_t conn = p->conn;
        bool direct = !ab_no_direct && fd >= 0 && !p->queue && !n->abort_notice;
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
                requeue_first(p, n);
                wake(p);
                return;
        }
        int rc = -ENOTCONN;
        /* Still the same connection, and nothing of the I/O thread's waiting before it? If
         * the connection changed, its end moved n back to the queue. */
        bool same = p->conn == conn && p->fd == fd;
        if (same && p->olen == p->ooff && has_room(fd, n->len)) {
                /* From here the peer may have it: in doubt (fail_queued). Set before the
                 * send: once sent, its ack may free it at any moment. */
                pthread_mutex_lock(&p->mu);
                n->sent = true;
                pthread_mutex_unlock(&p->mu);
                rc = direct_send(p, fd, n);
        } else if (same) {
                rc = 0;
        }
        if (rc == 0) {
                /* No room now (or a full unix socket said EAGAIN): the I/O thread sends it. */
                kvf_count(&p->cn->ctl, KVF_CTR_NOTICES_HELD_BACK, 1);
                requeue_first(p, n);
        }
        pthread_mutex_unlock(&p->wmu);
        /* Sent: n may be acknowledged and freed already; touch it no more. Sent in part:
         * the I/O thread sends the rest. A send error: the I/O thread finds the
         * connection broken and sends n again. */
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
                p->connects[p->nconnect].since = kvf_now_ns();
                p->nconnect++;
                queued = true;
        }
        pthread_mutex_unlock(&p->mu);
        if (up)
                conn_post_connect_result(p->cn, w, p->name, KVF_STATUS_FINISHED, NULL);
        else if (!queued)
                conn_post_connect_result(p->cn, w, p->name, KVF_STATUS_CONNECTION,
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
                kvf_count(&p->cn->ctl, KVF_CTR_NOTICES_FAILED, 1); /* it never reached the peer */
                conn_post_write_result(p->cn, n->key, n->request_id, n->id_bin, KVF_STATUS_TIMEOUT,
                                  "timed out: the finish notice never reached the peer (withdrawn)");
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

/* ------------------------------------------------------------------ start, stop */

int conn_peers_start(struct connector *cn)
{
        struct peer_pool *pl = calloc(1, sizeof(*pl));
        unsigned nio = cn->cfg.peer_threads ? cn->cfg.peer_threads : 2;
        unsigned nhs = cn->cfg.handshake_threads ? cn->cfg.handshake_threads : 2;
        if (!pl || !(pl->io = calloc(nio, sizeof(*pl->io))) || !(pl->hs = calloc(nhs, sizeof(*pl->hs)))) {
                if (pl)
                        free(pl->io);
                free(pl);
                return kvf_err_set(-ENOMEM, "peers: out of memory");
        }
        /* Every connected peer holds a socket, and so does one waiting for a handshake
         * worker: the descriptors, not the threads, now grow with the peers. */
        struct rlimit rl;
        if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
                rl.rlim_cur = rl.rlim_max;
                setrlimit(RLIMIT_NOFILE, &rl);
        }
        pthread_mutex_init(&pl->mu, NULL);
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&pl->cv, &ca);
        pthread_condattr_destroy(&ca);
        pl->nio = nio;
        pl->nhs = nhs;
        cn->pool = pl;
        if (!table_grow(cn))
                return kvf_err_set(-ENOMEM, "peers: out of memory");
        for (unsigned i = 0; i < nio; i++) {
                struct peer_io *io = &pl->io[i];
                io->cn = cn;
                io->pool = pl;
                pthread_mutex_init(&io->mu, NULL);
                struct io_uring_params prm = {.flags = IORING_SETUP_CQSIZE, .cq_entries = 8 * RING_ENTRIES};
                int rc = io_uring_queue_init_params(RING_ENTRIES, &io->ring, &prm);
                if (rc < 0)
                        return kvf_err_set(rc, "peers: io_uring: %s", strerror(-rc));
                io->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
                if (io->efd < 0)
                        return kvf_err_set(-errno, "peers: eventfd: %s", strerror(errno));
                if (pthread_create(&io->thread, NULL, io_main, io) != 0)
                        return kvf_err_set(-EAGAIN, "peers: cannot start an I/O thread");
                io->started = true;
        }
        for (unsigned i = 0; i < nhs; i++) {
                if (pthread_create(&pl->hs[i], NULL, hs_main, cn) != 0)
                        return kvf_err_set(-EAGAIN, "peers: cannot start a handshake thread");
                pl->hs_started++;
        }
        return 0;
}

/* At stop, all threads of the pool joined: what an I/O thread and a reap job would do. */
static void stop_peer(struct peer *p)
{
        if (p->hs_fd >= 0 && p->state == PS_HS) /* (a handshake's result nobody took) */
                close(p->hs_fd);
        if (p->cfd >= 0)
                close(p->cfd);
        p->cfd = p->hs_fd = -1;
        if (p->fd >= 0) {
                int fd = p->fd;
                end_connection(p);
                close(fd);
        }
        fail_queued(p, KVF_STATUS_CONNECTION, "the connector is stopping", 0, false);
        conn_xfer_stop(p);
}

void conn_peers_stop(struct connector *cn)
{
        struct peer_pool *pl = cn->pool;
        if (!pl)
                return;
        kvf_store_release(&pl->stop, 1);
        pthread_mutex_lock(&pl->mu);
        pthread_cond_broadcast(&pl->cv);
        pthread_mutex_unlock(&pl->mu);
        /* Workers first: a handshake in progress ends within its timeout, and its result
         * lands in a mailbox nobody reads any more (stop_peer closes its socket). */
        for (unsigned i = 0; i < pl->hs_started; i++)
                pthread_join(pl->hs[i], NULL);
        for (unsigned i = 0; i < pl->nio; i++) {
                struct peer_io *io = &pl->io[i];
                if (!io->started)
                        continue;
                uint64_t one = 1;
                if (write(io->efd, &one, sizeof(one)) < 0) {
                        /* it looks at the stop flag within CONN_POLL_MS anyway */
                }
                pthread_join(io->thread, NULL);
        }
        for (unsigned b = 0; b < cn->ptab_cap; b++)
                for (struct peer *p = cn->ptab[b]; p; p = p->hnext)
                        stop_peer(p);
        for (struct peer *p = cn->retired; p; p = p->next_retired)
                if (!kvf_load_acquire(&p->exited))
                        stop_peer(p);
        for (unsigned i = 0; i < pl->nio; i++)
                if (pl->io[i].started) {
                        io_uring_queue_exit(&pl->io[i].ring);
                        close(pl->io[i].efd);
                }
}
