/*
 * TCP data path, sending side (see data.h).
 *
 * Locking: one mutex per peer's data state guards its transfers, their
 * frames and the queue. Data threads hold frames (state FLIGHT) outside the
 * lock while io_uring sends them; a transfer forgotten meanwhile is only
 * marked dead and freed when its last frame comes back.
 */
#include <errno.h>
#include <liburing.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <arpa/inet.h>
#include <unistd.h>

#include "atomics.h"
#include "clock.h"
#include "data.h"
#include "doorbell.h"
#include "err.h"
#include "layout.h"
#include "log.h"

enum { F_QUEUED = 0, F_FLIGHT = 1, F_SENT = 2 };

struct xfer;

struct frame {
        struct xfer *x;
        uint32_t layer, index, nblocks;
        uint16_t tensor;
        uint8_t state;
        int8_t conn; /* the connection that carried it last, or -1 */
        uint64_t src_off;
        struct frame *qnext;
};

struct xfer {
        uint64_t key;
        char request_id[KVF_REQ_ID_MAX];
        uint32_t *dst;
        uint32_t n_dst;
        struct frame **fr;
        uint32_t nfr, capfr;
        uint8_t *xopen;  /* the XOPEN frame, sent first on each connection that carries the transfer */
        uint32_t xopen_len;
        uint64_t opened; /* bit per connection: XOPEN sent on it since it connected */
        uint64_t first_ns;
        uint32_t inflight;
        bool dead;
        bool checked; /* dst ids checked against the peer's block count */
        bool noticed; /* the finish notice is out: only its outcome ends the transfer */
        uint64_t session; /* the decode engine session it is bound to (0 unknown) */
        struct xfer *next;
};

#define MAX_STREAMS 16u
#define BATCH_FRAMES 32u
#define BATCH_BYTES (4u << 20)
#define QUEUE_LIMIT (64ull << 20) /* queued payload bytes before the control thread waits */

struct data_conn {
        struct peer_data *pd;
        unsigned idx;
        pthread_t thread;
        int fd;
};

struct peer_data {
        struct peer *p;
        pthread_mutex_t mu;
        pthread_cond_t cv;
        struct frame *qhead, *qtail;
        uint64_t qbytes;
        struct xfer *xfers;
        unsigned nxfers;
        uint64_t remote_blocks; /* from the handshake; 0 = not known yet */
        unsigned nconns;
        struct data_conn conns[MAX_STREAMS];
        bool stop;
};

static uint64_t frame_bytes(const struct connector *cn, const struct frame *f)
{
        return (uint64_t)f->nblocks * cn->ctl.hdr->layout.block_bytes;
}

static void post_result(struct connector *cn, const struct xfer *x, int status, const char *reason)
{
        conn_write_result(cn, x->key, x->request_id, status, reason, true);
}

/* With pd->mu held: wait for a broadcast on pd->cv (new frames, a new transfer), 200 ms at most. */
static void wait_a_while(struct peer_data *pd)
{
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 200000000;
        if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&pd->cv, &pd->mu, &ts);
}

static struct xfer *find(struct peer_data *pd, uint64_t key)
{
        for (struct xfer *x = pd->xfers; x; x = x->next)
                if (x->key == key && !x->dead)
                        return x;
        return NULL;
}

static void free_xfer(struct xfer *x)
{
        for (uint32_t i = 0; i < x->nfr; i++)
                free(x->fr[i]);
        free(x->fr);
        free(x->dst);
        free(x->xopen);
        free(x);
}

/* Append a frame to its transfer's list (which owns it); -ENOMEM leaves the list as it was. */
static int add_frame(struct xfer *x, struct frame *f)
{
        if (x->nfr == x->capfr) {
                uint32_t cap = x->capfr ? 2 * x->capfr : 64;
                struct frame **fr = realloc(x->fr, cap * sizeof(*fr));
                if (!fr)
                        return -ENOMEM;
                x->fr = fr;
                x->capfr = cap;
        }
        x->fr[x->nfr++] = f;
        return 0;
}

/* Unlink from the list and the queue; free now, or when the data threads give its frames back. */
static void drop(struct peer_data *pd, struct xfer *x)
{
        for (struct xfer **pp = &pd->xfers; *pp; pp = &(*pp)->next)
                if (*pp == x) {
                        *pp = x->next;
                        break;
                }
        pd->nxfers--;
        struct frame **qp = &pd->qhead, *f;
        pd->qtail = NULL;
        while ((f = *qp)) {
                if (f->x == x) {
                        *qp = f->qnext;
                        pd->qbytes -= frame_bytes(pd->p->cn, f);
                        continue;
                }
                pd->qtail = f;
                qp = &f->qnext;
        }
        x->dead = true;
        if (x->inflight == 0)
                free_xfer(x);
}

static void enqueue(struct peer_data *pd, struct frame *f, bool front)
{
        f->state = F_QUEUED;
        f->qnext = NULL;
        if (front) {
                f->qnext = pd->qhead;
                pd->qhead = f;
                if (!pd->qtail)
                        pd->qtail = f;
        } else {
                if (pd->qtail)
                        pd->qtail->qnext = f;
                else
                        pd->qhead = f;
                pd->qtail = f;
        }
        pd->qbytes += frame_bytes(pd->p->cn, f);
}

/* Destination ids must exist on the peer; fail the transfer otherwise. Lock held. */
static bool check_dst(struct peer_data *pd, struct xfer *x)
{
        if (x->checked || !pd->remote_blocks)
                return true;
        for (uint32_t i = 0; i < x->n_dst; i++)
                if (x->dst[i] >= pd->remote_blocks) {
                        char why[KVF_REASON_MAX];
                        snprintf(why, sizeof(why),
                                 "dest_block_ids[%u] = %u is out of range: peer '%s' has %llu blocks", i,
                                 x->dst[i], pd->p->name, (unsigned long long)pd->remote_blocks);
                        post_result(pd->p->cn, x, KVF_STATUS_BLOCK_RANGE, why);
                        drop(pd, x);
                        return false;
                }
        x->checked = true;
        return true;
}

/* ---- data connection threads ---- */

struct sendbuf {
        uint8_t hdr[KVF_FRAME_HDR + sizeof(struct kvf_data_hdr)];
        uint8_t *src; /* the payload's host memory (kvf_cache_io_begin), released once sent */
        const uint8_t *xopen; /* the transfer's XOPEN frame, when this frame needs one first */
        uint32_t xopen_len;
        struct iovec iov[2];
        struct msghdr mh;
        struct iovec xiov;
        struct msghdr xmh;
};

/* The XOPEN frame (header + record) that names a transfer's destination blocks to the receiver. */
static int encode_xopen(struct xfer *x)
{
        struct kvf_record r = {.type = KVF_RT_XOPEN, .key = x->key, .dst = x->dst, .n_dst = x->n_dst,
                               .session = x->session};
        snprintf(r.request_id, sizeof(r.request_id), "%s", x->request_id);
        size_t cap = kvf_record_encoded_max(&r);
        uint8_t *b = malloc(KVF_FRAME_HDR + cap);
        if (!b)
                return -ENOMEM;
        int n = kvf_record_encode(&r, b + KVF_FRAME_HDR, cap);
        if (n < 0) {
                free(b);
                return n;
        }
        kvf_net_put_hdr(b, (uint32_t)n, KVF_RT_XOPEN, 0);
        x->xopen = b;
        x->xopen_len = KVF_FRAME_HDR + (uint32_t)n;
        return 0;
}

/* The payloads' host memory is no longer needed (sent, or given up). */
static void release_src(struct connector *cn, struct frame **fs, unsigned n, struct sendbuf *sb)
{
        for (unsigned i = 0; i < n; i++)
                kvf_cache_io_end(&cn->cache, fs[i]->src_off, frame_bytes(cn, fs[i]), false, sb[i].src);
}

/*
 * Send one batch of frames as a linked chain of sendmsg (so they go out in
 * order on the stream) and wait for all of it. 0, or -errno if the
 * connection must be dropped.
 */
static int send_batch(struct data_conn *dc, struct io_uring *ring, struct frame **fs, unsigned n,
                      struct sendbuf *sb)
{
        struct peer_data *pd = dc->pd;
        struct connector *cn = pd->p->cn;
        unsigned ops = 0;
        int rc = 0;

        /* The blocks' bytes in host memory: the cache itself, or a staging buffer the
         * backend fills (cache.h); all of them before a single send is queued. */
        for (unsigned i = 0; i < n; i++) {
                if (kvf_cache_io_begin(&cn->cache, fs[i]->src_off, frame_bytes(cn, fs[i]), false, &sb[i].src) < 0) {
                        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "data for '%s': %s", pd->p->name,
                                   kvf_err_msg());
                        release_src(cn, fs, i, sb);
                        return -EIO;
                }
        }
        for (unsigned i = 0; i < n; i++) {
                struct frame *f = fs[i];
                struct sendbuf *b = &sb[i];
                struct io_uring_sqe *sqe;
                uint64_t len = frame_bytes(cn, f);
                if (b->xopen) {
                        b->xiov = (struct iovec){(void *)b->xopen, b->xopen_len};
                        b->xmh = (struct msghdr){.msg_iov = &b->xiov, .msg_iovlen = 1};
                        sqe = io_uring_get_sqe(ring);
                        io_uring_prep_sendmsg(sqe, dc->fd, &b->xmh, MSG_WAITALL | MSG_NOSIGNAL);
                        sqe->flags |= IOSQE_IO_LINK;
                        io_uring_sqe_set_data64(sqe, b->xopen_len);
                        ops++;
                }
                struct kvf_data_hdr h = {.key = htobe64(f->x->key), .layer = htonl(f->layer),
                                         .tensor = htons(f->tensor), .index = htonl(f->index),
                                         .nblocks = htonl(f->nblocks)};
                kvf_net_put_hdr(b->hdr, (uint32_t)(sizeof(h) + len), KVF_RT_DATA, 0);
                memcpy(b->hdr + KVF_FRAME_HDR, &h, sizeof(h));
                b->iov[0] = (struct iovec){b->hdr, sizeof(b->hdr)};
                b->iov[1] = (struct iovec){b->src, len};
                b->mh = (struct msghdr){.msg_iov = b->iov, .msg_iovlen = 2};
                sqe = io_uring_get_sqe(ring);
                if (cn->cfg.zerocopy)
                        io_uring_prep_sendmsg_zc(sqe, dc->fd, &b->mh, MSG_WAITALL | MSG_NOSIGNAL);
                else
                        io_uring_prep_sendmsg(sqe, dc->fd, &b->mh, MSG_WAITALL | MSG_NOSIGNAL);
                if (i + 1 < n)
                        sqe->flags |= IOSQE_IO_LINK;
                io_uring_sqe_set_data64(sqe, sizeof(b->hdr) + len);
                ops++;
        }
        io_uring_submit(ring);
        /* Results: one per op; zero-copy ops also send a notification when the
         * pages may be reused (IORING_CQE_F_MORE announces it). */
        unsigned results = 0, notifs = 0;
        struct __kernel_timespec ts = {.tv_sec = cn->cfg.peer_timeout_ms / 1000,
                                       .tv_nsec = (long)(cn->cfg.peer_timeout_ms % 1000) * 1000000};
        bool shut = false;
        while (results < ops || notifs > 0) {
                struct io_uring_cqe *cqe;
                int w = io_uring_wait_cqe_timeout(ring, &cqe, &ts);
                if (w == -ETIME) {
                        /* No progress for peer_timeout: the link or the peer is gone.
                         * Shutting the socket down fails what is pending. */
                        if (!shut) {
                                shutdown(dc->fd, SHUT_RDWR);
                                shut = true;
                                rc = -ETIMEDOUT;
                        }
                        continue;
                }
                if (w < 0) {
                        rc = w;
                        break;
                }
                if (cqe->flags & IORING_CQE_F_NOTIF) {
                        notifs--;
                } else {
                        results++;
                        if (cqe->flags & IORING_CQE_F_MORE)
                                notifs++;
                        if (cqe->res < 0 || (uint64_t)cqe->res != io_uring_cqe_get_data64(cqe))
                                if (rc == 0)
                                        rc = cqe->res < 0 ? cqe->res : -EPIPE;
                }
                io_uring_cqe_seen(ring, cqe);
        }
        /* (w < 0 left completions behind: the staging memory stays with the connection's
         * frames, which go again; a host cache has nothing to release anyway) */
        if (results == ops && notifs == 0)
                release_src(cn, fs, n, sb);
        return rc;
}

/* Give frames back after a batch: sent, or queued again at the front. */
static void give_back(struct peer_data *pd, struct frame **fs, unsigned n, bool sent)
{
        for (unsigned i = n; i-- > 0;) {
                struct frame *f = fs[i];
                struct xfer *x = f->x;
                x->inflight--;
                if (x->dead) {
                        if (x->inflight == 0)
                                free_xfer(x);
                        continue;
                }
                if (sent)
                        f->state = F_SENT;
                else
                        enqueue(pd, f, true);
        }
}

/*
 * The receiver never writes on a data connection, so an idle one shows its
 * end only as end-of-stream or an error on a read; a send would show it too,
 * but only once there is something to send.
 */
static bool closed_by_peer(int fd)
{
        char c;
        ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

static void serve(struct data_conn *dc, struct io_uring *ring)
{
        struct peer_data *pd = dc->pd;
        struct connector *cn = pd->p->cn;
        struct frame *fs[BATCH_FRAMES];
        struct sendbuf sb[BATCH_FRAMES];
        uint64_t bit = 1ull << dc->idx;

        for (;;) {
                unsigned n = 0;
                uint64_t bytes = 0;
                pthread_mutex_lock(&pd->mu);
                while (!pd->qhead && !kvf_load_acquire(&pd->stop) && !conn_stopping(cn)) {
                        wait_a_while(pd);
                        if (!pd->qhead && closed_by_peer(dc->fd)) {
                                /* The receiver restarted (or went away) while we had nothing to
                                 * send: what we sent it may be lost; conn_main re-queues it. */
                                pthread_mutex_unlock(&pd->mu);
                                kvf_warn("data connection %u to '%s' closed by the peer", dc->idx,
                                         pd->p->name);
                                return;
                        }
                }
                while (pd->qhead && n < BATCH_FRAMES && bytes < BATCH_BYTES) {
                        struct frame *f = pd->qhead;
                        pd->qhead = f->qnext;
                        if (!pd->qhead)
                                pd->qtail = NULL;
                        pd->qbytes -= frame_bytes(cn, f);
                        f->state = F_FLIGHT;
                        f->conn = (int8_t)dc->idx;
                        f->x->inflight++;
                        memset(&sb[n], 0, sizeof(sb[n]));
                        if (!(f->x->opened & bit)) {
                                f->x->opened |= bit;
                                sb[n].xopen = f->x->xopen;
                                sb[n].xopen_len = f->x->xopen_len;
                        }
                        bytes += frame_bytes(cn, f);
                        fs[n++] = f;
                }
                bool stopping = kvf_load_acquire(&pd->stop) || conn_stopping(cn);
                bool room = pd->qbytes < QUEUE_LIMIT / 2;
                pthread_mutex_unlock(&pd->mu);
                /* The control thread holds a write batch back while the queue is full:
                 * tell it there is room again. */
                if (room && kvf_load_acquire(&cn->tx_blocked)) {
                        kvf_store_release(&cn->tx_blocked, 0);
                        kvf_doorbell_ring(&cn->ctl.bells[KVF_BELL_CONNECTOR]);
                }
                if (n == 0) {
                        if (stopping)
                                return;
                        continue;
                }
                int rc = send_batch(dc, ring, fs, n, sb);
                pthread_mutex_lock(&pd->mu);
                give_back(pd, fs, n, rc == 0);
                pthread_mutex_unlock(&pd->mu);
                if (rc < 0) {
                        kvf_warn("data connection %u to '%s' lost: %s", dc->idx, pd->p->name,
                                 strerror(-rc));
                        return;
                }
                kvf_count(&cn->ctl, KVF_CTR_BYTES_TCP, bytes);
                kvf_count(&cn->ctl, KVF_CTR_BLOCKS_TCP, bytes / cn->ctl.hdr->layout.block_bytes);
        }
}

static void *conn_main(void *arg)
{
        struct data_conn *dc = arg;
        struct peer_data *pd = dc->pd;
        struct peer *p = pd->p;
        struct connector *cn = p->cn;
        struct io_uring ring;
        unsigned backoff_ms = 50;
        char host[128];
        uint16_t port;

        if (io_uring_queue_init(4 * BATCH_FRAMES, &ring, 0) < 0) {
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "io_uring_queue_init failed: data connection %u to '%s' not started",
                           dc->idx, p->name);
                return NULL;
        }
        while (!kvf_load_acquire(&pd->stop) && !conn_stopping(cn)) {
                /* Connect only while there are transfers to carry. */
                pthread_mutex_lock(&pd->mu);
                bool idle = pd->nxfers == 0;
                if (idle)
                        wait_a_while(pd);
                pthread_mutex_unlock(&pd->mu);
                if (idle)
                        continue;
                int status = KVF_STATUS_CONNECTION;
                struct peer_identity id;
                int fd = -1, rc = conn_peer_resolve(p, host, sizeof(host), &port, &status);
                if (rc == 0)
                        rc = fd = kvf_net_connect(host, port, cn->cfg.connect_timeout_ms);
                if (rc >= 0)
                        rc = conn_handshake_client(cn, fd, "data", &id, &status);
                if (rc < 0) {
                        /* The control connection reports and fails work; just retry. */
                        kvf_debug("data connection %u to '%s': %s", dc->idx, p->name, kvf_err_msg());
                        if (fd >= 0)
                                close(fd);
                        usleep(backoff_ms * 1000);
                        backoff_ms = backoff_ms * 2 > 1000 ? 1000 : backoff_ms * 2;
                        continue;
                }
                backoff_ms = 50;
                dc->fd = fd;
                uint64_t bit = 1ull << dc->idx;
                pthread_mutex_lock(&pd->mu);
                pd->remote_blocks = id.layout.num_blocks;
                for (struct xfer *x = pd->xfers, *nx; x; x = nx) {
                        nx = x->next;
                        x->opened &= ~bit;
                        check_dst(pd, x);
                }
                pthread_mutex_unlock(&pd->mu);
                kvf_debug("data connection %u to '%s' up", dc->idx, p->name);
                serve(dc, &ring);
                close(fd);
                dc->fd = -1;
                /* What went over this connection and is not acknowledged may be lost. */
                pthread_mutex_lock(&pd->mu);
                for (struct xfer *x = pd->xfers; x; x = x->next)
                        for (uint32_t i = 0; i < x->nfr; i++)
                                if (x->fr[i]->state == F_SENT && x->fr[i]->conn == (int8_t)dc->idx)
                                        enqueue(pd, x->fr[i], false);
                pthread_cond_broadcast(&pd->cv);
                pthread_mutex_unlock(&pd->mu);
        }
        io_uring_queue_exit(&ring);
        return NULL;
}

void data_tx_start(struct peer *p);

static struct peer_data *peer_data(struct peer *p)
{
        if (p->data)
                return p->data;
        struct peer_data *pd = calloc(1, sizeof(*pd));
        if (!pd)
                return NULL;
        pd->p = p;
        pthread_mutex_init(&pd->mu, NULL);
        pthread_cond_init(&pd->cv, NULL);
        /* The data threads start when the peer's control connection is up (data_tx_start):
         * a peer that cannot be reached costs no threads but its own. Under p->mu with the
         * peer thread's setting of `up`: of the two, whichever comes second starts them. */
        pthread_mutex_lock(&p->mu);
        p->data = pd;
        bool up = p->up;
        pthread_mutex_unlock(&p->mu);
        if (up)
                data_tx_start(p);
        return pd;
}

void data_tx_start(struct peer *p)
{
        pthread_mutex_lock(&p->mu);
        struct peer_data *pd = p->data;
        pthread_mutex_unlock(&p->mu);
        if (!pd)
                return;
        pthread_mutex_lock(&pd->mu);
        unsigned want = p->cn->cfg.streams < MAX_STREAMS ? p->cn->cfg.streams : MAX_STREAMS;
        for (unsigned i = pd->nconns; i < want && !pd->stop; i++) {
                pd->conns[i] = (struct data_conn){.pd = pd, .idx = i, .fd = -1};
                if (pthread_create(&pd->conns[i].thread, NULL, conn_main, &pd->conns[i]) != 0)
                        break;
                pd->nconns = i + 1;
        }
        pthread_mutex_unlock(&pd->mu);
}

int data_tx_open(struct connector *cn, const struct kvf_record *o, char *why, size_t whylen)
{
        struct peer *p = conn_peer_get(cn, o->peer, why, whylen);
        struct peer_data *pd = p ? peer_data(p) : NULL;
        if (!pd) {
                if (p)
                        snprintf(why, whylen, "the connector is out of memory");
                return -ENOMEM;
        }
        pthread_mutex_lock(&pd->mu);
        struct xfer *x = find(pd, o->key);
        if (!x) {
                x = calloc(1, sizeof(*x));
                uint32_t *dst = malloc((o->n_dst ? o->n_dst : 1) * sizeof(uint32_t));
                if (!x || !dst) {
                        free(x);
                        free(dst);
                        pthread_mutex_unlock(&pd->mu);
                        snprintf(why, whylen, "the connector is out of memory");
                        return -ENOMEM;
                }
                memcpy(dst, o->dst, o->n_dst * sizeof(uint32_t));
                x->key = o->key;
                x->session = o->session;
                x->dst = dst;
                x->n_dst = o->n_dst;
                x->first_ns = kvf_now_ns();
                snprintf(x->request_id, sizeof(x->request_id), "%s", o->request_id);
                if (encode_xopen(x) < 0) {
                        free(dst);
                        free(x);
                        pthread_mutex_unlock(&pd->mu);
                        snprintf(why, whylen, "the connector is out of memory");
                        return -ENOMEM;
                }
                x->next = pd->xfers;
                pd->xfers = x;
                pd->nxfers++;
                check_dst(pd, x);
                pthread_cond_broadcast(&pd->cv); /* idle data threads connect now */
        }
        pthread_mutex_unlock(&pd->mu);
        conn_peer_kick(p); /* the control connection carries the notice later */
        return 0;
}

int data_tx_batch(struct connector *cn, const struct kvf_record *w)
{
        const struct kvf_cache_layout *L = &cn->ctl.hdr->layout;
        char why[KVF_REASON_MAX];
        struct peer *p = conn_peer_get(cn, w->peer, why, sizeof(why));
        struct peer_data *pd = p ? peer_data(p) : NULL;
        if (!pd)
                return -ENOMEM;
        uint32_t per = (uint32_t)(KVF_DATA_FRAME_MAX / L->block_bytes);
        if (per == 0)
                per = 1;
        pthread_mutex_lock(&pd->mu);
        if (pd->qbytes > QUEUE_LIMIT) {
                pthread_mutex_unlock(&pd->mu);
                return -EAGAIN; /* back-pressure: the record waits in its ring */
        }
        struct xfer *x = find(pd, w->key);
        int rc = 0;
        if (!x) {
                pthread_mutex_unlock(&pd->mu);
                return -ENOENT; /* forgotten (failed) or never opened */
        }
        uint32_t layers = kvf_layout_layers(L), tensors = kvf_layout_tensors(L);
        bool valid = (uint64_t)w->layer + w->layer_count <= layers && w->n_runs % 3 == 0;
        for (uint32_t r = 0; valid && r < w->n_runs; r += 3)
                valid = (uint64_t)w->runs[r] + w->runs[r + 2] <= L->num_blocks &&
                        (uint64_t)w->runs[r + 1] + w->runs[r + 2] <= x->n_dst;
        if (!valid) { /* checked whole, so a bad batch queues nothing */
                pthread_mutex_unlock(&pd->mu);
                return -EINVAL;
        }
        for (uint64_t l = w->layer; l < w->layer + w->layer_count; l++)
                for (uint32_t t = 0; t < tensors; t++)
                        for (uint32_t r = 0; r < w->n_runs; r += 3) {
                                uint32_t src = w->runs[r], idx = w->runs[r + 1], n = w->runs[r + 2];
                                for (uint32_t off = 0; off < n; off += per) {
                                        struct frame *f = calloc(1, sizeof(*f));
                                        if (!f || add_frame(x, f) < 0) {
                                                free(f);
                                                rc = -ENOMEM;
                                                goto out;
                                        }
                                        f->x = x;
                                        f->layer = (uint32_t)l;
                                        f->tensor = (uint16_t)t;
                                        f->index = idx + off;
                                        f->nblocks = n - off < per ? n - off : per;
                                        f->src_off = kvf_layout_offset(L, (uint32_t)l, t, src + off);
                                        f->conn = -1;
                                        enqueue(pd, f, false);
                                }
                        }
out:
        pthread_cond_broadcast(&pd->cv);
        pthread_mutex_unlock(&pd->mu);
        return rc;
}

void data_tx_forget(struct peer *p, uint64_t key)
{
        struct peer_data *pd = p->data;
        if (!pd)
                return;
        pthread_mutex_lock(&pd->mu);
        struct xfer *x = find(pd, key);
        if (x)
                drop(pd, x);
        pthread_mutex_unlock(&pd->mu);
}

void data_tx_noticed(struct peer *p, uint64_t key)
{
        struct peer_data *pd = p->data;
        if (!pd)
                return;
        pthread_mutex_lock(&pd->mu);
        struct xfer *x = find(pd, key);
        if (x)
                x->noticed = true;
        pthread_mutex_unlock(&pd->mu);
}

void data_tx_fail(struct peer *p, int status, const char *reason, uint64_t older_than)
{
        struct peer_data *pd = p->data;
        if (!pd)
                return;
        pthread_mutex_lock(&pd->mu);
        uint64_t now = kvf_now_ns();
        for (struct xfer *x = pd->xfers, *nx; x; x = nx) {
                nx = x->next;
                if (x->noticed || (older_than && kvf_elapsed(now, x->first_ns) <= older_than))
                        continue;
                post_result(p->cn, x, status, reason);
                drop(pd, x);
        }
        pthread_mutex_unlock(&pd->mu);
}

bool data_tx_busy(struct peer *p)
{
        struct peer_data *pd = p->data;
        if (!pd)
                return false;
        pthread_mutex_lock(&pd->mu);
        bool busy = pd->nxfers > 0;
        pthread_mutex_unlock(&pd->mu);
        return busy;
}

void data_tx_stop(struct peer *p)
{
        struct peer_data *pd = p->data;
        if (!pd)
                return;
        pthread_mutex_lock(&pd->mu);
        kvf_store_release(&pd->stop, true); /* (no data_tx_start after this starts a thread) */
        pthread_cond_broadcast(&pd->cv);
        unsigned n = pd->nconns;
        pthread_mutex_unlock(&pd->mu);
        for (unsigned i = 0; i < n; i++) {
                if (pd->conns[i].fd >= 0)
                        shutdown(pd->conns[i].fd, SHUT_RDWR);
                pthread_join(pd->conns[i].thread, NULL);
        }
}

void data_tx_free(struct peer *p)
{
        struct peer_data *pd = p->data;
        if (!pd)
                return;
        /* The data threads are joined (data_tx_stop): no frame is in flight. */
        while (pd->xfers) {
                struct xfer *x = pd->xfers;
                pd->xfers = x->next;
                free_xfer(x);
        }
        pthread_cond_destroy(&pd->cv);
        pthread_mutex_destroy(&pd->mu);
        free(pd);
        p->data = NULL;
}
