/*
 * The tcp transport, sending side (see tcp.h): data connection threads with
 * io_uring sends. The transfers, their frames and the queue are xfer.c's.
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
#include "err.h"
#include "layout.h"
#include "log.h"
#include "tcp.h"
#include "tpsplit.h"
#include "xfer.h"

#define MAX_STREAMS 16u

struct data_conn {
        struct xfer_peer *xp;
        unsigned idx;
        pthread_t thread;
        int fd;
        /* The peer is a rank of another tensor-parallel split (its handshake says): of each
         * block, only slen bytes at soff go, to doff of its block (DATAS frames). slen 0:
         * whole blocks. Set before serve(), for this connection's life. */
        uint32_t soff, doff, slen;
        /* The peer's blocks are of another size (one dividing the other): tokens regrouped into
         * them by this plan (DATAR frames; plan.npieces 0: not regrouped). Set before serve(). */
        struct kvf_tp_plan plan;
        uint32_t plan_bytes; /* a group's pieces' bytes */
        uint32_t peer_bsize; /* the peer's tokens per block (from its handshake) */
        uint32_t blocks_max; /* regrouped: source blocks a frame, so its pieces fit a frame */
};

/* The peer's tcp state (xp->tp); nconns and the threads' start under xp->mu. */
struct tcp_peer {
        unsigned nconns;
        struct data_conn conns[MAX_STREAMS];
};

/* A transfer's tcp state (x->tp). */
struct tcp_xfer {
        uint8_t *xopen;  /* the XOPEN frame, sent first on each connection that carries the transfer */
        uint32_t xopen_len;
        uint64_t opened; /* bit per connection: XOPEN sent on it since it connected */
};

/* The XOPEN frame (header + record) that names a transfer's destination blocks to the receiver. */
int tcp_xfer_open(struct xfer_peer *xp, struct xfer *x)
{
        (void)xp;
        struct tcp_xfer *tx = calloc(1, sizeof(*tx));
        if (!tx)
                return -ENOMEM;
        struct kvf_record r = {.type = KVF_RT_XOPEN, .key = x->key, .dst = x->dst, .n_dst = x->n_dst,
                               .session = x->session, .blocks = x->n_src, .id_bin = x->id_bin};
        snprintf(r.request_id, sizeof(r.request_id), "%s", x->request_id);
        size_t cap = kvf_record_encoded_max(&r);
        uint8_t *b = malloc(KVF_FRAME_HDR + cap);
        if (!b) {
                free(tx);
                return -ENOMEM;
        }
        int n = kvf_record_encode(&r, b + KVF_FRAME_HDR, cap);
        if (n < 0) {
                free(b);
                free(tx);
                return n;
        }
        kvf_net_put_hdr(b, (uint32_t)n, KVF_RT_XOPEN, 0);
        tx->xopen = b;
        tx->xopen_len = KVF_FRAME_HDR + (uint32_t)n;
        x->tp = tx;
        return 0;
}

void tcp_xfer_free(struct xfer_peer *xp, struct xfer *x)
{
        (void)xp;
        struct tcp_xfer *tx = x->tp;
        free(tx->xopen);
        free(tx);
        x->tp = NULL;
}

/* ---- data connection threads ---- */

#define BATCH_FRAMES 128u
#define BATCH_BYTES (4u << 20)
_Static_assert(BATCH_FRAMES <= KVF_STAGE_RUNS && BATCH_BYTES <= KVF_STAGE_BYTES,
               "a batch is one staged group");

/* A frame of the batch: its payload's host memory, and the XOPEN that goes before it. */
struct sendbuf {
        uint8_t *src; /* the cache itself, or staging memory (cache.h kvf_stage_out) */
        const uint8_t *xopen; /* the transfer's XOPEN frame, when this frame needs one first */
        uint32_t xopen_len;
};

/* A frame on the wire: DATA (one run), or DATAV (consecutive runs of one transfer). */
#define WIRE_HDR_MAX                                                                               \
        (KVF_FRAME_HDR + sizeof(struct kvf_datas_hdr) + KVF_DATAV_RUNS_MAX * sizeof(struct kvf_datav_run))
_Static_assert(sizeof(struct kvf_datas_hdr) >= sizeof(struct kvf_datav_hdr), "the larger header");
_Static_assert(KVF_DATAS_BLOCKS_MAX <= KVF_DATAV_RUNS_MAX, "a DATAS frame's vectors fit a wire's");
struct wire {
        uint8_t hdr[WIRE_HDR_MAX];
        struct iovec iov[1 + KVF_DATAV_RUNS_MAX]; /* (regrouped: the batch's riov) */
        struct msghdr mh;
        struct iovec xiov;
        struct msghdr xmh;
};

/* One data connection's batch (heap: a few hundred KiB); a connection has two, so that
 * the next one's staging copy runs while this one is on the wire. */
struct batch {
        unsigned n;      /* frames taken (0: the batch is free) */
        uint64_t bytes;  /* their payload */
        uint64_t ticket; /* the staging copy of their payloads (0: none needed) */
        unsigned group;  /* their staging memory */
        struct frame *fs[BATCH_FRAMES];
        struct sendbuf sb[BATCH_FRAMES];
        struct kvf_io_run io[BATCH_FRAMES];
        struct wire w[BATCH_FRAMES];
        /* Regrouped (dc->plan): each frame's header and pieces, 1 + riov_per vectors a frame. */
        struct iovec *riov;
        size_t riov_per;
};

/*
 * The pieces of regrouped frame f that go (destination position below the transfer's count):
 * their number, and their bytes in *bytes; with src (the frame's source blocks in host
 * memory), their vectors in iov.
 */
static unsigned frame_pieces(const struct data_conn *dc, const struct frame *f, uint8_t *src,
                             struct iovec *iov, uint64_t *bytes)
{
        const struct kvf_tp_plan *pl = &dc->plan;
        const uint64_t bb = kvf_layout_tensor_bytes(&dc->xp->p->cn->ctl.hdr->layout, f->tensor);
        unsigned n = 0;
        *bytes = 0;
        for (uint32_t b = 0; b < f->nblocks; b++) {
                uint32_t pos = f->index + b, grp = pos / pl->src_per_group, sb = pos % pl->src_per_group;
                for (uint32_t i = 0; i < pl->npieces; i++) {
                        const struct kvf_tp_piece *pc = &pl->pieces[i];
                        if (pc->sblk != sb || (uint64_t)grp * pl->dst_per_group + pc->dblk >= f->x->n_dst)
                                continue;
                        if (iov)
                                iov[n] = (struct iovec){src + b * bb + pc->soff, pc->bytes};
                        n++;
                        *bytes += pc->bytes;
                }
        }
        return n;
}

/* The payload bytes frame f puts on the wire: its blocks, or their head slices. */
static uint64_t wire_bytes(const struct data_conn *dc, const struct frame *f)
{
        uint64_t bytes;
        if (dc->plan.npieces) {
                frame_pieces(dc, f, NULL, NULL, &bytes);
                return bytes;
        }
        return dc->slen ? (uint64_t)f->nblocks * dc->slen : xfer_frame_bytes(dc->xp, f);
}

/*
 * Frames [i, j) of the batch as one wire frame in w: a DATA frame for one,
 * a DATAV frame for several (one transfer's); to a rank of another split, a
 * DATAS frame of the blocks' head slices. Returns the bytes it sends.
 */
static uint64_t wire_frame(const struct data_conn *dc, struct batch *b, unsigned i, unsigned j, struct wire *w)
{
        struct xfer_peer *xp = dc->xp;
        uint64_t payload = 0;
        for (unsigned k = i; k < j; k++)
                payload += wire_bytes(dc, b->fs[k]);
        size_t hl;
        if (dc->plan.npieces) {
                /* One source run per frame (gather_end): its pieces, as the plan says. */
                const struct frame *f = b->fs[i];
                struct kvf_datas_hdr h = {.key = htobe64(f->x->key), .nruns = htonl(1),
                                          .dst = htonl(dc->plan.npieces), .len = htonl(dc->plan_bytes)};
                struct kvf_datav_run run = {.layer = htonl(f->layer), .tensor = htons(f->tensor),
                                            .index = htonl(f->index), .nblocks = htonl(f->nblocks)};
                hl = KVF_FRAME_HDR + sizeof(h) + sizeof(run);
                kvf_net_put_hdr(w->hdr, (uint32_t)(hl - KVF_FRAME_HDR + payload), KVF_RT_DATAR, 0);
                memcpy(w->hdr + KVF_FRAME_HDR, &h, sizeof(h));
                memcpy(w->hdr + KVF_FRAME_HDR + sizeof(h), &run, sizeof(run));
                struct iovec *v = b->riov + (size_t)i * (1 + b->riov_per);
                uint64_t bytes;
                v[0] = (struct iovec){w->hdr, hl};
                unsigned np = frame_pieces(dc, f, b->sb[i].src, v + 1, &bytes);
                w->mh = (struct msghdr){.msg_iov = v, .msg_iovlen = 1 + np};
                return hl + payload;
        }
        if (dc->slen) {
                struct kvf_datas_hdr h = {.key = htobe64(b->fs[i]->x->key), .nruns = htonl(j - i),
                                          .dst = htonl(dc->doff), .len = htonl(dc->slen)};
                hl = KVF_FRAME_HDR + sizeof(h) + (j - i) * sizeof(struct kvf_datav_run);
                kvf_net_put_hdr(w->hdr, (uint32_t)(hl - KVF_FRAME_HDR + payload), KVF_RT_DATAS, 0);
                memcpy(w->hdr + KVF_FRAME_HDR, &h, sizeof(h));
        } else if (j - i == 1) {
                const struct frame *f = b->fs[i];
                struct kvf_data_hdr h = {.key = htobe64(f->x->key), .layer = htonl(f->layer),
                                         .tensor = htons(f->tensor), .index = htonl(f->index),
                                         .nblocks = htonl(f->nblocks)};
                hl = KVF_FRAME_HDR + sizeof(h);
                kvf_net_put_hdr(w->hdr, (uint32_t)(sizeof(h) + payload), KVF_RT_DATA, 0);
                memcpy(w->hdr + KVF_FRAME_HDR, &h, sizeof(h));
        } else {
                struct kvf_datav_hdr h = {.key = htobe64(b->fs[i]->x->key), .nruns = htonl(j - i)};
                hl = KVF_FRAME_HDR + sizeof(h) + (j - i) * sizeof(struct kvf_datav_run);
                kvf_net_put_hdr(w->hdr, (uint32_t)(hl - KVF_FRAME_HDR + payload), KVF_RT_DATAV, 0);
                memcpy(w->hdr + KVF_FRAME_HDR, &h, sizeof(h));
        }
        if (dc->slen || j - i > 1) {
                uint8_t *r = w->hdr + hl - (j - i) * sizeof(struct kvf_datav_run);
                for (unsigned k = i; k < j; k++, r += sizeof(struct kvf_datav_run)) {
                        const struct frame *f = b->fs[k];
                        struct kvf_datav_run run = {.layer = htonl(f->layer), .tensor = htons(f->tensor),
                                                    .index = htonl(f->index), .nblocks = htonl(f->nblocks)};
                        memcpy(r, &run, sizeof(run));
                }
        }
        w->iov[0] = (struct iovec){w->hdr, hl};
        unsigned v = 1;
        if (dc->slen) {
                /* Each block's slice: blocks of a frame are consecutive in the source (staged as
                 * one run), and the slice is at the same offset in each. */
                for (unsigned k = i; k < j; k++) {
                        const uint64_t bb = kvf_layout_tensor_bytes(&xp->p->cn->ctl.hdr->layout, b->fs[k]->tensor);
                        for (uint32_t n = 0; n < b->fs[k]->nblocks; n++)
                                w->iov[v++] = (struct iovec){b->sb[k].src + n * bb + dc->soff, dc->slen};
                }
        } else {
                for (unsigned k = i; k < j; k++)
                        w->iov[v++] = (struct iovec){b->sb[k].src, xfer_frame_bytes(xp, b->fs[k])};
        }
        w->mh = (struct msghdr){.msg_iov = w->iov, .msg_iovlen = v};
        return hl + payload;
}

/* Where the wire frame that starts at frame i ends: the frames after it of the same transfer
 * that need no XOPEN of their own, within the run, block and byte limits of its kind. */
static unsigned gather_end(const struct data_conn *dc, const struct batch *b, unsigned i, unsigned n)
{
        uint64_t bytes = wire_bytes(dc, b->fs[i]);
        uint32_t blocks = b->fs[i]->nblocks;
        unsigned j = i + 1;
        if (dc->plan.npieces)
                return j; /* a DATAR frame carries one run */
        while (j < n && j - i < KVF_DATAV_RUNS_MAX && b->fs[j]->x == b->fs[i]->x && !b->sb[j].xopen &&
               bytes + wire_bytes(dc, b->fs[j]) <= KVF_DATA_FRAME_MAX &&
               (!dc->slen || blocks + b->fs[j]->nblocks <= KVF_DATAS_BLOCKS_MAX)) {
                bytes += wire_bytes(dc, b->fs[j]);
                blocks += b->fs[j++]->nblocks;
        }
        return j;
}

/* Stage batch b's payloads: host memory for each frame (the cache itself, or staging memory
 * whose copy out of the cache is queued). 0; -EFAULT: the engine's caches cannot be read (their
 * file shrank), the batch's transfers failed and the connection goes on; -EIO (logged). */
static int stage_batch(struct data_conn *dc, struct kvf_stager *st, struct batch *b)
{
        struct xfer_peer *xp = dc->xp;
        struct connector *cn = xp->p->cn;
        for (unsigned i = 0; i < b->n; i++)
                b->io[i] = (struct kvf_io_run){.off = b->fs[i]->src_off, .len = xfer_frame_bytes(xp, b->fs[i])};
        int rc = kvf_stage_out(&cn->cache, st, b->io, b->n, &b->ticket, &b->group);
        if (rc < 0)
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "data for '%s': %s", xp->p->name, kvf_err_msg());
        if (rc == -EFAULT) {
                /* Reading them again would fault again: their requests end "write error". */
                char why[KVF_REASON_MAX];
                snprintf(why, sizeof(why), "%s", kvf_err_msg());
                pthread_mutex_lock(&xp->mu);
                for (unsigned i = 0; i < b->n; i++)
                        xfer_fail_one(xp, b->fs[i]->x, KVF_STATUS_WRITE, why);
                pthread_mutex_unlock(&xp->mu);
                return -EFAULT;
        }
        if (rc < 0)
                return -EIO;
        for (unsigned i = 0; i < b->n; i++)
                b->sb[i].src = b->io[i].p;
        return 0;
}

/*
 * Queue batch b's frames as a linked chain of sendmsg (so they go out in
 * order on the stream), once its payloads are in host memory. The number of
 * ops queued (*nwire: wire frames), or -errno.
 */
static int send_submit(struct data_conn *dc, struct io_uring *ring, struct kvf_stager *st, struct batch *b,
                       unsigned *nwire)
{
        struct xfer_peer *xp = dc->xp;
        struct connector *cn = xp->p->cn;
        unsigned ops = 0, n = b->n;

        if (kvf_stage_wait(st, b->ticket, true) < 0) {
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "data for '%s': %s", xp->p->name, kvf_err_msg());
                return -EIO;
        }
        *nwire = 0;
        for (unsigned i = 0, j; i < n; i = j) {
                j = gather_end(dc, b, i, n);
                struct wire *w = &b->w[(*nwire)++];
                struct io_uring_sqe *sqe;
                if (b->sb[i].xopen) {
                        w->xiov = (struct iovec){(void *)b->sb[i].xopen, b->sb[i].xopen_len};
                        w->xmh = (struct msghdr){.msg_iov = &w->xiov, .msg_iovlen = 1};
                        sqe = io_uring_get_sqe(ring);
                        io_uring_prep_sendmsg(sqe, dc->fd, &w->xmh, MSG_WAITALL | MSG_NOSIGNAL);
                        sqe->flags |= IOSQE_IO_LINK;
                        io_uring_sqe_set_data64(sqe, b->sb[i].xopen_len);
                        ops++;
                }
                uint64_t len = wire_frame(dc, b, i, j, w);
                sqe = io_uring_get_sqe(ring);
                if (cn->cfg.tcp.zerocopy)
                        io_uring_prep_sendmsg_zc(sqe, dc->fd, &w->mh, MSG_WAITALL | MSG_NOSIGNAL);
                else
                        io_uring_prep_sendmsg(sqe, dc->fd, &w->mh, MSG_WAITALL | MSG_NOSIGNAL);
                if (j < n)
                        sqe->flags |= IOSQE_IO_LINK;
                io_uring_sqe_set_data64(sqe, len);
                ops++;
        }
        io_uring_submit(ring);
        return (int)ops;
}

/*
 * Wait for the `ops` sends queued. 0, or -errno if the connection must be
 * dropped; *all false when completions were left behind (the kernel may
 * still read the payloads' memory).
 */
static int send_reap(struct data_conn *dc, struct io_uring *ring, unsigned ops, bool *all)
{
        struct connector *cn = dc->xp->p->cn;
        /* Results: one per op; zero-copy ops also send a notification when the
         * pages may be reused (IORING_CQE_F_MORE announces it). */
        unsigned results = 0, notifs = 0;
        struct __kernel_timespec ts = {.tv_sec = cn->cfg.peer_timeout_ms / 1000,
                                       .tv_nsec = (long)(cn->cfg.peer_timeout_ms % 1000) * 1000000};
        bool shut = false;
        int rc = 0;
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
                if (w == -EINTR)
                        continue;
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
        *all = results == ops && notifs == 0;
        return rc;
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

/*
 * Take frames off the peer's queue into the free batch b, waiting for some
 * when `wait`. A staged batch stays within one staging group's bytes. The
 * frames taken (0: none; the connector stops when *stopping), or -1 when the
 * peer closed the connection while there was nothing to send.
 */
static int take(struct data_conn *dc, struct batch *b, bool wait, bool staged, bool *stopping)
{
        struct xfer_peer *xp = dc->xp;
        uint64_t bit = 1ull << dc->idx;
        unsigned n = 0;
        uint64_t bytes = 0;

        pthread_mutex_lock(&xp->mu);
        while (wait && !xp->qhead && !xfer_stopping(xp)) {
                xfer_wait(xp);
                if (!xp->qhead && closed_by_peer(dc->fd)) {
                        /* The receiver restarted (or went away) while we had nothing to
                         * send: what we sent it may be lost; conn_main re-queues it. */
                        pthread_mutex_unlock(&xp->mu);
                        kvf_warn("data connection %u to '%s' closed by the peer", dc->idx, xp->p->name);
                        return -1;
                }
        }
        while (xp->qhead && n < BATCH_FRAMES && bytes < BATCH_BYTES &&
               (!staged || n == 0 || bytes + xfer_frame_bytes(xp, xp->qhead) <= BATCH_BYTES)) {
                char why[KVF_REASON_MAX];
                if (xfer_regroup_mismatch(xp, xp->qhead->x, dc->peer_bsize, dc->plan.npieces != 0, why, sizeof(why))) {
                        kvf_errlog(&xp->p->cn->ctl, KVF_ROLE_CONNECTOR, "%s", why);
                        xfer_fail_one(xp, xp->qhead->x, KVF_STATUS_LAYOUT_MISMATCH, why);
                        continue; /* (its frames left the queue) */
                }
                if (dc->plan.npieces && xfer_split_head(xp, dc->blocks_max) < 0) {
                        xfer_fail_one(xp, xp->qhead->x, KVF_STATUS_CONNECTION, "the connector is out of memory");
                        continue;
                }
                struct frame *f = xfer_dequeue(xp, (int)dc->idx);
                struct tcp_xfer *tx = f->x->tp;
                b->sb[n] = (struct sendbuf){0};
                if (!(tx->opened & bit)) {
                        tx->opened |= bit;
                        b->sb[n].xopen = tx->xopen;
                        b->sb[n].xopen_len = tx->xopen_len;
                }
                bytes += xfer_frame_bytes(xp, f);
                b->fs[n++] = f;
        }
        *stopping = xfer_stopping(xp);
        bool room = xfer_has_room(xp);
        pthread_mutex_unlock(&xp->mu);
        xfer_room(xp, room);
        b->n = n;
        b->bytes = bytes;
        return (int)n;
}

/* Batch b's frames go back to the transfers (sent, or to go again), and b is free. */
static void give_back(struct data_conn *dc, struct kvf_stager *st, struct batch *b, bool sent)
{
        struct xfer_peer *xp = dc->xp;
        kvf_stage_done(st, b->group);
        pthread_mutex_lock(&xp->mu);
        xfer_give_back(xp, b->fs, b->n, sent);
        pthread_mutex_unlock(&xp->mu);
        b->n = 0;
}

/*
 * Send batches until the connection fails or the connector stops. With a
 * stager (a GPU cache), the next batch is taken and its copy out of the
 * cache queued while this one is on the wire. Returns false when the
 * stager's memory may still be in the kernel's hands (a send left behind):
 * the caller must not reuse or free it.
 */
static bool serve(struct data_conn *dc, struct io_uring *ring, struct batch *bs[2], struct kvf_stager *st)
{
        struct xfer_peer *xp = dc->xp;
        struct connector *cn = xp->p->cn;
        unsigned cur = 0;
        bool stopping, all = true;

        bs[0]->n = bs[1]->n = 0;
        for (;;) {
                struct batch *b = bs[cur], *nb = bs[!cur];
                int rc = 0;
                if (!b->n) {
                        int t = take(dc, b, true, st != NULL, &stopping);
                        if (t < 0 || (t == 0 && stopping))
                                return true;
                        if (t == 0)
                                continue;
                        if ((rc = stage_batch(dc, st, b)) < 0) {
                                give_back(dc, st, b, false);
                                if (rc == -EFAULT)
                                        continue; /* (those transfers failed; the stream is whole) */
                                return true;
                        }
                }
                unsigned nwire = 0;
                int ops = send_submit(dc, ring, st, b, &nwire);
                if (ops < 0)
                        rc = ops;
                else if (st && !nb->n && take(dc, nb, false, true, &stopping) > 0 && stage_batch(dc, st, nb) < 0)
                        give_back(dc, st, nb, false); /* (logged; this batch still goes) */
                if (ops > 0)
                        rc = send_reap(dc, ring, (unsigned)ops, &all);
                /* the bytes of frames sent once before, on a connection that was lost (read
                 * before the frames go back: a transfer may then be freed) */
                uint64_t again = 0, wire = 0, blocks = 0;
                for (unsigned i = 0; i < b->n; i++) {
                        uint64_t k = wire_bytes(dc, b->fs[i]);
                        blocks += b->fs[i]->nblocks;
                        wire += k;
                        again += b->fs[i]->again ? k : 0;
                }
                /* (not all reaped: the staging memory stays with the kernel's sends, not done) */
                give_back(dc, all ? st : NULL, b, rc == 0);
                if (rc < 0) {
                        if (nb->n)
                                give_back(dc, st, nb, false);
                        kvf_warn("data connection %u to '%s' lost: %s", dc->idx, xp->p->name, strerror(-rc));
                        return all;
                }
                kvf_count(&cn->ctl, KVF_CTR_FRAMES_TCP, nwire);
                kvf_count(&cn->ctl, KVF_CTR_BYTES_TCP, wire);
                kvf_count(&cn->ctl, KVF_CTR_BYTES_TCP_RESENT, again);
                kvf_count(&cn->ctl, KVF_CTR_BLOCKS_TCP, blocks);
                cur = !cur;
        }
}

/*
 * The plan of a connection to a peer of another block size (tokens regrouped), and the
 * batches' vectors for it; no plan for a peer of the same block size. 0, or -EXDEV / -ENOMEM
 * (kvf_err says why).
 */
static int regroup_plan(struct data_conn *dc, struct batch *bs[2], const struct peer_identity *id)
{
        const struct kvf_ctl_header *me = dc->xp->p->cn->ctl.hdr;
        char why[400];
        uint32_t heads;
        kvf_tp_plan_free(&dc->plan);
        dc->plan_bytes = 0;
        dc->soff = dc->doff = dc->slen = 0;
        dc->peer_bsize = id->layout.block_size;
        if (id->layout.block_size == me->layout.block_size)
                return 0;
        if (kvf_tp_check(&me->layout, me->nranks ? me->nranks : 1, &id->layout, id->nranks ? id->nranks : 1, 0,
                         &heads, why, sizeof(why)) < 0)
                return kvf_err_set(-EXDEV, "%s", why);
        if (kvf_tp_plan(&me->layout, me->nranks ? me->nranks : 1, me->rank, &id->layout,
                        id->nranks ? id->nranks : 1, id->rank, heads, &dc->plan) < 0)
                return kvf_err_set(-EXDEV, "%s", kvf_err_msg());
        uint32_t most = 0; /* pieces of one source block, at most */
        for (uint32_t sb = 0; sb < dc->plan.src_per_group; sb++) {
                uint32_t n = 0;
                for (uint32_t i = 0; i < dc->plan.npieces; i++) {
                        n += dc->plan.pieces[i].sblk == sb;
                        dc->plan_bytes += dc->plan.pieces[i].sblk == sb ? dc->plan.pieces[i].bytes : 0;
                }
                most = n > most ? n : most;
        }
        int rc = 0;
        if (!dc->plan.npieces)
                rc = kvf_err_set(-EXDEV, "prefill rank %u of %u sends decode rank %u of %u none of its heads",
                                 me->rank, me->nranks, id->rank, id->nranks);
        else if (most > KVF_DATAR_PIECES_MAX)
                rc = kvf_err_set(-EXDEV, "%u pieces per source block (%u tokens/block here, %u there): "
                                 "more than a frame's %u vectors", most, me->layout.block_size,
                                 id->layout.block_size, KVF_DATAR_PIECES_MAX);
        /* Frames of more source blocks than this are split as they are taken (xfer_split_head). */
        dc->blocks_max = most ? KVF_DATAR_PIECES_MAX / most : 1;
        if (dc->blocks_max > KVF_DATAS_BLOCKS_MAX)
                dc->blocks_max = KVF_DATAS_BLOCKS_MAX;
        for (int k = 0; k < 2 && rc == 0; k++) {
                size_t per = (size_t)most * dc->blocks_max;
                if (bs[k]->riov_per < per) {
                        struct iovec *v = realloc(bs[k]->riov, BATCH_FRAMES * (1 + per) * sizeof(*v));
                        if (!v) {
                                rc = kvf_err_set(-ENOMEM, "out of memory for regrouped frames");
                                break;
                        }
                        bs[k]->riov = v;
                        bs[k]->riov_per = per;
                }
        }
        if (rc < 0)
                kvf_tp_plan_free(&dc->plan);
        return rc;
}

static void *conn_main(void *arg)
{
        struct data_conn *dc = arg;
        struct xfer_peer *xp = dc->xp;
        struct peer *p = xp->p;
        struct connector *cn = p->cn;
        struct io_uring ring;
        unsigned backoff_ms = 50;
        char host[128];
        uint16_t port;

        struct batch *bs[2] = {calloc(1, sizeof(struct batch)), calloc(1, sizeof(struct batch))};
        struct kvf_stager *st = NULL;
        const char *why = !bs[0] || !bs[1] ? "out of memory" : NULL;
        if (!why && kvf_stager_open(&cn->cache, &st) < 0)
                why = kvf_err_msg();
        if (!why && io_uring_queue_init(4 * BATCH_FRAMES, &ring, 0) < 0)
                why = "io_uring_queue_init failed";
        if (why) {
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "%s: data connection %u to '%s' not started", why,
                           dc->idx, p->name);
                kvf_stager_close(st);
                free(bs[0]);
                free(bs[1]);
                return NULL;
        }
        while (!xfer_stopping(xp)) {
                /* Connect only while there are transfers to carry. */
                pthread_mutex_lock(&xp->mu);
                bool idle = xp->nxfers == 0;
                if (idle)
                        xfer_wait(xp);
                pthread_mutex_unlock(&xp->mu);
                if (idle)
                        continue;
                int status = KVF_STATUS_CONNECTION;
                struct peer_identity id;
                int fd = -1, rc = conn_peer_resolve(p, host, sizeof(host), &port, &status);
                if (rc == 0)
                        rc = fd = kvf_net_connect(host, port, cn->cfg.connect_timeout_ms);
                if (rc >= 0)
                        rc = conn_handshake_client(cn, fd, conn_tcp_transport.purpose, &id, NULL, &status);
                if (rc < 0 && status == KVF_STATUS_LAYOUT_MISMATCH) {
                        /* The peer's layout is one the control connection takes but tcp frames
                         * do not (a decode rank this prefill rank sends no head, another block
                         * size): retrying cannot help. Its transfers fail now, with
                         * the peer's reason, and so do those opened later, until the control
                         * connection is made anew. */
                        char refusal[KVF_REASON_MAX];
                        snprintf(refusal, sizeof(refusal), "tcp to '%s': %s", p->name, kvf_err_msg());
                        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "%s", refusal);
                        conn_xfer_refuse_all(xp, status, refusal);
                        if (fd >= 0)
                                close(fd);
                        usleep(backoff_ms * 1000);
                        backoff_ms = backoff_ms * 2 > 1000 ? 1000 : backoff_ms * 2;
                        continue;
                }
                if (rc < 0) {
                        /* The control connection reports and fails work; just retry. */
                        kvf_debug("data connection %u to '%s': %s", dc->idx, p->name, kvf_err_msg());
                        if (fd >= 0)
                                close(fd);
                        usleep(backoff_ms * 1000);
                        backoff_ms = backoff_ms * 2 > 1000 ? 1000 : backoff_ms * 2;
                        continue;
                }
                const struct kvf_ctl_header *me = cn->ctl.hdr;
                if (regroup_plan(dc, bs, &id) < 0 ||
                    (!dc->plan.npieces && kvf_tp_slice(&me->layout, me->nranks, me->rank, &id.layout, id.nranks,
                                                       id.rank, &dc->soff, &dc->doff, &dc->slen) < 0)) {
                        /* (The peer's handshake refuses what this refuses; this holds against one
                         * that does not.) */
                        char refusal[KVF_REASON_MAX];
                        snprintf(refusal, sizeof(refusal), "tcp to '%s': peer layout mismatch: %s", p->name,
                                 kvf_err_msg());
                        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "%s", refusal);
                        conn_xfer_refuse_all(xp, KVF_STATUS_LAYOUT_MISMATCH, refusal);
                        close(fd);
                        usleep(backoff_ms * 1000);
                        backoff_ms = backoff_ms * 2 > 1000 ? 1000 : backoff_ms * 2;
                        continue;
                }
                if (dc->plan.npieces && dc->idx == 0)
                        kvf_info("tcp to '%s' (rank %u of %u, %u tokens/block; this is rank %u of %u, %u): "
                                 "tokens regrouped, %u piece(s) per group of %u source block(s)", p->name,
                                 id.rank, id.nranks, id.layout.block_size, me->rank, me->nranks,
                                 me->layout.block_size, dc->plan.npieces, dc->plan.src_per_group);
                if (dc->slen && dc->idx == 0)
                        kvf_info("tcp to '%s' (rank %u of %u; this is rank %u of %u): %u of each block's "
                                 "%llu bytes, at %u, to %u of its blocks", p->name, id.rank, id.nranks, me->rank,
                                 me->nranks, dc->slen, (unsigned long long)me->layout.block_bytes, dc->soff,
                                 dc->doff);
                backoff_ms = 50;
                xfer_check_gen(xp, id.created_ns);
                uint64_t bit = 1ull << dc->idx;
                pthread_mutex_lock(&xp->mu);
                dc->fd = fd; /* under xp->mu: tcp_stop shuts it down */
                for (struct xfer *x = xp->xfers; x; x = x->next)
                        ((struct tcp_xfer *)x->tp)->opened &= ~bit;
                xfer_set_remote_blocks(xp, id.layout.num_blocks);
                pthread_mutex_unlock(&xp->mu);
                kvf_debug("data connection %u to '%s' up", dc->idx, p->name);
                if (!serve(dc, &ring, bs, st)) {
                        /* A send was left in the kernel: its staging memory may still be read.
                         * Left to it (leaked, a rare loss of a few MiB); a fresh stager goes on. */
                        struct kvf_stager *fresh = NULL;
                        if (st && kvf_stager_open(&cn->cache, &fresh) == 0)
                                st = fresh;
                }
                /* What went over this connection and is not acknowledged may be lost. Closed
                 * under xp->mu: tcp_stop never shuts down a descriptor number reused meanwhile. */
                pthread_mutex_lock(&xp->mu);
                dc->fd = -1;
                close(fd);
                xfer_requeue_conn(xp, (int)dc->idx);
                pthread_mutex_unlock(&xp->mu);
        }
        io_uring_queue_exit(&ring);
        kvf_stager_close(st);
        kvf_tp_plan_free(&dc->plan);
        free(bs[0]->riov);
        free(bs[1]->riov);
        free(bs[0]);
        free(bs[1]);
        return NULL;
}

int tcp_peer_init(struct xfer_peer *xp)
{
        xp->tp = calloc(1, sizeof(struct tcp_peer));
        return xp->tp ? 0 : -ENOMEM;
}

void tcp_start(struct xfer_peer *xp)
{
        struct tcp_peer *tp = xp->tp;
        struct connector *cn = xp->p->cn;
        pthread_mutex_lock(&xp->mu);
        unsigned want = cn->cfg.tcp.streams < MAX_STREAMS ? cn->cfg.tcp.streams : MAX_STREAMS;
        for (unsigned i = tp->nconns; i < want && !xp->stop; i++) {
                tp->conns[i] = (struct data_conn){.xp = xp, .idx = i, .fd = -1};
                if (pthread_create(&tp->conns[i].thread, NULL, conn_main, &tp->conns[i]) != 0)
                        break;
                tp->nconns = i + 1;
        }
        pthread_mutex_unlock(&xp->mu);
}

void tcp_stop(struct xfer_peer *xp)
{
        struct tcp_peer *tp = xp->tp;
        pthread_mutex_lock(&xp->mu);
        unsigned n = tp->nconns;
        for (unsigned i = 0; i < n; i++)
                if (tp->conns[i].fd >= 0)
                        shutdown(tp->conns[i].fd, SHUT_RDWR);
        pthread_mutex_unlock(&xp->mu);
        for (unsigned i = 0; i < n; i++)
                pthread_join(tp->conns[i].thread, NULL);
}

void tcp_peer_free(struct xfer_peer *xp)
{
        free(xp->tp);
        xp->tp = NULL;
}

const struct conn_transport conn_tcp_transport = {
        .name = "tcp",
        .id = KVF_TRANSPORT_TCP,
        .purpose = "data",
        .frame_max = KVF_DATA_FRAME_MAX,
        .frame_blocks_max = KVF_DATAS_BLOCKS_MAX,
        .peer_init = tcp_peer_init,
        .start = tcp_start,
        .stop = tcp_stop,
        .peer_free = tcp_peer_free,
        .xfer_open = tcp_xfer_open,
        .xfer_free = tcp_xfer_free,
        .serve = tcp_serve,
};
