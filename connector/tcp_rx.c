/*
 * The tcp transport, receiving side (see tcp.h): the io_uring receive loop
 * of one data connection. Every frame header is checked (landing.c) before a
 * byte of its payload is received, and the payload goes only into the
 * blocks the header names.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <liburing.h>
#include <poll.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"
#include "err.h"
#include "landing.h"
#include "layout.h"
#include "log.h"
#include "tcp.h"
#include "tpsplit.h"

/*
 * Submit one receive (into mh's iovecs) and wait for it. Returns its result
 * (bytes, 0 at end of stream, -errno), or -ETIMEDOUT once timeout_ms (0 =
 * none) has passed since `start`, or -ECANCELED when the connector stops;
 * either way the pending receive is failed and collected first.
 */
static int recv_once(struct connector *cn, struct io_uring *ring, int fd, struct msghdr *mh, int flags,
                     uint64_t start, unsigned timeout_ms)
{
        struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
        io_uring_prep_recvmsg(sqe, fd, mh, (unsigned)flags);
        io_uring_submit(ring);
        for (;;) {
                struct io_uring_cqe *cqe;
                struct __kernel_timespec ts = {.tv_sec = 0, .tv_nsec = kvf_ms(CONN_POLL_MS)};
                int rc = io_uring_wait_cqe_timeout(ring, &cqe, &ts);
                if (rc == 0) {
                        int res = cqe->res;
                        io_uring_cqe_seen(ring, cqe);
                        return res;
                }
                if (rc != -ETIME)
                        return rc;
                if (conn_stopping(cn) || (timeout_ms && kvf_now_ns() - start > kvf_ms(timeout_ms))) {
                        shutdown(fd, SHUT_RDWR);
                        if (io_uring_wait_cqe(ring, &cqe) == 0)
                                io_uring_cqe_seen(ring, cqe);
                        return conn_stopping(cn) ? -ECANCELED : -ETIMEDOUT;
                }
        }
}

/* One receive of up to n bytes into p. */
static int recv_buf(struct connector *cn, struct io_uring *ring, int fd, void *p, uint32_t n, int flags,
                    uint64_t start, unsigned timeout_ms)
{
        struct iovec iov = {p, n};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
        return recv_once(cn, ring, fd, &mh, flags, start, timeout_ms);
}

/*
 * Receive exactly the bytes of iov[0..n) (consumed as they fill), within
 * timeout_ms of the start (0 = wait, watching conn_stopping(cn)). 0, or -errno.
 */
static int recv_iov(struct connector *cn, struct io_uring *ring, int fd, struct iovec *iov, size_t n,
                    unsigned timeout_ms)
{
        uint64_t start = kvf_now_ns();
        while (n > 0) {
                if (iov->iov_len == 0) {
                        iov++, n--;
                        continue;
                }
                struct msghdr mh = {.msg_iov = iov, .msg_iovlen = n};
                int res = recv_once(cn, ring, fd, &mh, MSG_WAITALL, start, timeout_ms);
                if (res <= 0)
                        return res == 0 ? -ECONNRESET : res;
                for (size_t got = (size_t)res; got > 0;) {
                        size_t k = got < iov->iov_len ? got : iov->iov_len;
                        iov->iov_base = (uint8_t *)iov->iov_base + k;
                        iov->iov_len -= k;
                        got -= k;
                        if (iov->iov_len == 0 && got > 0)
                                iov++, n--;
                }
        }
        return 0;
}

/* One receive of exactly n bytes into p, within timeout_ms (0 = wait, watching conn_stopping(cn)). */
static int recv_exact(struct connector *cn, struct io_uring *ring, int fd, void *p, uint32_t n,
                      unsigned timeout_ms)
{
        struct iovec iov = {p, n};
        return recv_iov(cn, ring, fd, &iov, 1, timeout_ms);
}

/*
 * Read-ahead: one receive takes whatever the socket has (many small
 * frames at once); a large payload goes from the read-ahead buffer into the cache (or its staging memory) for
 * the part already read and straight from the socket into the cache for the
 * rest.
 */
#define RBUF_LOOKAHEAD (4u << 10)

struct rbuf {
        uint8_t *b;
        uint32_t cap, off, len;
};

/* Make at least `need` unread bytes available in the read-ahead buffer. */
static int rbuf_fill(struct connector *cn, struct io_uring *ring, int fd, struct rbuf *st,
                      uint32_t need, unsigned timeout_ms)
{
        if (st->len - st->off >= need)
                return 0;
        if (st->off > 0) {
                memmove(st->b, st->b + st->off, st->len - st->off);
                st->len -= st->off;
                st->off = 0;
        }
        uint64_t start = kvf_now_ns();
        while (st->len < need) {
                /* Read what is needed plus a little: enough to take several small frames
                 * in one receive, not so much that a large payload lands in the read-ahead buffer
                 * and must be copied again instead of going straight to the cache. */
                uint32_t want = need > RBUF_LOOKAHEAD ? need : RBUF_LOOKAHEAD;
                if (want > st->cap)
                        want = st->cap;
                /* Idle between frames is fine; inside a frame the bound applies. */
                int res = recv_buf(cn, ring, fd, st->b + st->len, want - st->len, 0, start,
                                   st->len > 0 ? timeout_ms : 0);
                if (res <= 0)
                        return res == 0 ? -ECONNRESET : res;
                st->len += (uint32_t)res;
        }
        return 0;
}

/* Move `n` payload bytes to dst (NULL: drop them): from the read-ahead buffer first, then the socket. */
static int rbuf_payload(struct connector *cn, struct io_uring *ring, int fd, struct rbuf *st,
                         uint8_t *dst, uint64_t n, unsigned timeout_ms)
{
        uint32_t have = st->len - st->off;
        uint64_t take = have < n ? have : n;
        if (dst && take)
                memcpy(dst, st->b + st->off, take);
        st->off += (uint32_t)take;
        n -= take;
        while (n > 0) {
                if (dst)
                        return recv_exact(cn, ring, fd, dst + take, (uint32_t)n, timeout_ms);
                uint32_t k = n < st->cap ? (uint32_t)n : st->cap;
                int rc = rbuf_fill(cn, ring, fd, st, k, timeout_ms);
                if (rc < 0)
                        return rc;
                st->off += k;
                n -= k;
        }
        return 0;
}

/* The blocks of a received run are in: counted, and marked in the landing bitmap. */
static void landed(struct connector *cn, const char *peer, uint64_t gen, const struct landing_run *run,
                   uint64_t bytes)
{
        kvf_count(&cn->ctl, KVF_CTR_BYTES_TCP_RECEIVED, bytes);
        if (conn_landing_mark(cn, peer, gen, run))
                conn_post_data_done(cn, peer, gen, run->key);
}

/*
 * Runs received into staging memory (a GPU cache) whose copy into the cache
 * has not been seen to land: marked only once it has, so a transfer is
 * never complete before its last byte is in the cache. The connection
 * receives the next frames meanwhile; it waits for the copies when the
 * list is full and before it waits for the network (pend_settle).
 */
#define PENDING_MAX 256u

struct pending {
        unsigned head, n;
        struct {
                uint64_t ticket, bytes;
                struct landing_run run;
        } q[PENDING_MAX];
};

struct rx {
        struct connector *cn;
        const char *peer, *remote;
        uint64_t gen;
        struct kvf_stager *sg;
        struct pending pend;
        /* The head slice of each block this peer sends (another tensor-parallel split): len
         * bytes at off; len 0: whole blocks. */
        uint32_t slice_off, slice_len;
        /* This peer's blocks are of another size: tokens regrouped by this plan (DATAR frames),
         * plan_bytes a group's pieces' bytes; plan.npieces 0: not regrouped. The frame's
         * pieces: where each lands, its mark, its receive vector. */
        struct kvf_tp_plan plan;
        uint32_t plan_bytes;
        uint32_t peer_bsize;
        struct kvf_io_run pio[KVF_DATAR_PIECES_MAX];
        struct landing_run pmark[KVF_DATAR_PIECES_MAX];
        struct iovec piov[KVF_DATAR_PIECES_MAX];
};

/* The connection ends for a failure of ours (kvf_err says which): logged. */
static void log_disconnect(const struct rx *rx)
{
        kvf_errlog(&rx->cn->ctl, KVF_ROLE_CONNECTOR, "data from '%s' (%s): %s: disconnected", rx->peer, rx->remote,
                   kvf_err_msg());
}

/* The peer closed or stalled inside a frame's payload. */
static void cut_short(const struct rx *rx)
{
        kvf_count(&rx->cn->ctl, KVF_CTR_FRAMES_REJECTED, 1);
        kvf_warn("peer '%s' (%s): data frame cut short", rx->peer, rx->remote);
}

/* Mark the runs whose copies landed (all of them: wait when `block`). 0, or -EIO (logged). */
static int pend_settle(struct rx *rx, bool block)
{
        struct pending *pd = &rx->pend;
        while (pd->n) {
                unsigned i = pd->head;
                int rc = kvf_stage_wait(rx->sg, pd->q[i].ticket, block);
                if (rc == 0)
                        return 0;
                if (rc < 0) {
                        /* Not marked: the transfer never completes here; its sender times out. */
                        log_disconnect(rx);
                        pd->n = 0;
                        return -EIO;
                }
                landed(rx->cn, rx->peer, rx->gen, &pd->q[i].run, pd->q[i].bytes);
                pd->head = (i + 1) % PENDING_MAX;
                pd->n--;
        }
        return 0;
}

/* The runs' bytes are in their host memory (group): into the cache, and marked once there. */
static int receive_end(struct rx *rx, const struct kvf_io_run *io, const struct landing_run *runs, unsigned n,
                       unsigned group)
{
        uint64_t t;
        int rc = kvf_stage_in_end(rx->sg, io, n, group, &t);
        if (rc == -EFAULT) {
                /* The engine's caches cannot take them (their file shrank under the mapping):
                 * sending them again would fault again. Their transfers end "write error" with
                 * the cause, and the connection, whose stream is whole, goes on. */
                char why[KVF_REASON_MAX];
                snprintf(why, sizeof(why), "%s", kvf_err_msg());
                kvf_errlog(&rx->cn->ctl, KVF_ROLE_CONNECTOR, "data from '%s' (%s): %s", rx->peer, rx->remote, why);
                for (unsigned i = 0; i < n; i++)
                        if ((i == 0 || runs[i].key != runs[i - 1].key) &&
                            conn_landing_complete(rx->cn, rx->peer, rx->gen, runs[i].key, 0,
                                                  KVF_STATUS_WRITE, why) == 1)
                                conn_post_data_done(rx->cn, rx->peer, rx->gen, runs[i].key);
                return 0;
        }
        if (rc < 0) {
                log_disconnect(rx);
                return -EIO;
        }
        for (unsigned i = 0; i < n; i++) {
                if (!t) { /* in place: in the cache already */
                        landed(rx->cn, rx->peer, rx->gen, &runs[i], io[i].len);
                        continue;
                }
                struct pending *pd = &rx->pend;
                if (pd->n == PENDING_MAX && pend_settle(rx, true) < 0)
                        return -EIO;
                unsigned k = (pd->head + pd->n++) % PENDING_MAX;
                pd->q[k].ticket = t;
                pd->q[k].bytes = io[i].len;
                pd->q[k].run = runs[i];
        }
        return 0;
}

/*
 * The payload of a data frame whose runs were checked (io[i].off and .len set): plen bytes read
 * and dropped when `drop` (a closed transfer, or its engine session is over), else received into
 * the cache (staged or in place), what the read-ahead buffer holds first, then the rest straight
 * from the socket, and landed. 0; 1 the connection ends.
 */
static int receive_runs(struct rx *rx, struct io_uring *ring, int fd, struct rbuf *st, uint64_t plen,
                        unsigned to, bool drop, struct kvf_io_run *io, struct iovec *iov,
                        const struct landing_run *runs, uint32_t n)
{
        struct connector *cn = rx->cn;
        if (drop) {
                if (rbuf_payload(cn, ring, fd, st, NULL, plen, to) == 0)
                        return 0;
                cut_short(rx);
                return 1;
        }
        unsigned group;
        if (kvf_stage_in_begin(&cn->cache, rx->sg, io, n, &group) < 0) {
                log_disconnect(rx);
                return 1;
        }
        /* What the read-ahead buffer holds already, then the rest straight from the socket. */
        for (uint32_t i = 0; i < n; i++)
                iov[i] = (struct iovec){io[i].p, io[i].len};
        uint32_t i = 0;
        while (st->off < st->len && i < n) {
                size_t k = st->len - st->off < iov[i].iov_len ? st->len - st->off : iov[i].iov_len;
                memcpy(iov[i].iov_base, st->b + st->off, k);
                st->off += (uint32_t)k;
                iov[i].iov_base = (uint8_t *)iov[i].iov_base + k;
                if ((iov[i].iov_len -= k) == 0)
                        i++;
        }
        if (recv_iov(cn, ring, fd, iov + i, n - i, to) < 0) {
                /* What a failure left in staging memory goes nowhere; in a cache used in
                 * place it is in blocks of this transfer, unmarked, written again when its
                 * frames are sent again. */
                kvf_stage_done(rx->sg, group);
                cut_short(rx);
                return 1;
        }
        return receive_end(rx, io, runs, n, group) < 0 ? 1 : 0;
}

/*
 * A DATAV frame whose frame header is in the read-ahead buffer (len: the
 * bytes after it): every run checked before a byte of payload is read, then
 * all of them received with one receive, from the read-ahead buffer first.
 * 0; 1 the connection ends (closed, stopping, cut short; reported); -EPROTO
 * a violation (why).
 */
static int serve_datav(struct rx *rx, struct io_uring *ring, int fd, struct rbuf *st, uint32_t len, unsigned to,
                       char *why, size_t whylen)
{
        struct connector *cn = rx->cn;
        const struct kvf_cache_layout *L = &cn->ctl.hdr->layout;
        struct landing_run runs[KVF_DATAV_RUNS_MAX];
        struct kvf_io_run io[KVF_DATAV_RUNS_MAX];
        struct iovec iov[KVF_DATAV_RUNS_MAX];
        struct kvf_datav_hdr h;

        if (len < sizeof(h)) {
                snprintf(why, whylen, "gathered data frame of %u bytes", len);
                return -EPROTO;
        }
        if (rbuf_fill(cn, ring, fd, st, KVF_FRAME_HDR + sizeof(h), to) < 0)
                return 1;
        memcpy(&h, st->b + st->off + KVF_FRAME_HDR, sizeof(h));
        uint32_t n = ntohl(h.nruns);
        uint64_t table = sizeof(h) + (uint64_t)n * sizeof(struct kvf_datav_run);
        if (n == 0 || n > KVF_DATAV_RUNS_MAX || len < table) {
                snprintf(why, whylen, "gathered data frame of %u runs in %u bytes (1 to %u runs)", n, len,
                         KVF_DATAV_RUNS_MAX);
                return -EPROTO;
        }
        if (rbuf_fill(cn, ring, fd, st, KVF_FRAME_HDR + (uint32_t)table, to) < 0)
                return 1;
        const uint8_t *t = st->b + st->off + KVF_FRAME_HDR + sizeof(h);
        uint64_t key = be64toh(h.key), runs_bytes = 0, plen = len - table;
        for (uint32_t i = 0; i < n; i++) {
                struct kvf_datav_run w;
                memcpy(&w, t + i * sizeof(w), sizeof(w));
                runs[i] = (struct landing_run){.key = key, .layer = ntohl(w.layer), .tensor = ntohs(w.tensor),
                                               .index = ntohl(w.index), .nblocks = ntohl(w.nblocks)};
                /* (a tensor out of range is refused by conn_landing_check below) */
                runs_bytes += runs[i].nblocks * kvf_layout_tensor_bytes(L, runs[i].tensor);
        }
        st->off += KVF_FRAME_HDR + (uint32_t)table;
        if (runs_bytes != plen || plen > KVF_DATA_FRAME_MAX) {
                snprintf(why, whylen, "gathered data frame of %llu payload bytes for runs of %llu (at most %u)",
                         (unsigned long long)plen, (unsigned long long)runs_bytes, KVF_DATA_FRAME_MAX);
                return -EPROTO;
        }
        bool drop = false;
        for (uint32_t i = 0; i < n; i++) {
                io[i].len = runs[i].nblocks * kvf_layout_tensor_bytes(L, runs[i].tensor);
                int rc = conn_landing_check(cn, rx->peer, rx->gen, &runs[i], io[i].len, &io[i].off, why, whylen);
                if (rc < 0)
                        return -EPROTO;
                drop |= rc == 1;
        }
        return receive_runs(rx, ring, fd, st, plen, to, drop, io, iov, runs, n);
}

/*
 * A DATAS frame (head slices, tcp.h) whose frame header is in the read-ahead
 * buffer: as serve_datav, each block of each run its own slice of `len`
 * bytes at `dst` of its block, which must be the slice this peer sends this
 * rank (rx->slice_*). 0; 1 the connection ends; -EPROTO a violation (why).
 */
static int serve_datas(struct rx *rx, struct io_uring *ring, int fd, struct rbuf *st, uint32_t len, unsigned to,
                       char *why, size_t whylen)
{
        struct connector *cn = rx->cn;
        struct landing_run runs[KVF_DATAS_BLOCKS_MAX];
        struct kvf_io_run io[KVF_DATAS_BLOCKS_MAX];
        struct iovec iov[KVF_DATAS_BLOCKS_MAX];
        struct kvf_datas_hdr h;

        if (len < sizeof(h)) {
                snprintf(why, whylen, "head-slice data frame of %u bytes", len);
                return -EPROTO;
        }
        if (rbuf_fill(cn, ring, fd, st, KVF_FRAME_HDR + sizeof(h), to) < 0)
                return 1;
        memcpy(&h, st->b + st->off + KVF_FRAME_HDR, sizeof(h));
        uint32_t n = ntohl(h.nruns), off = ntohl(h.dst), slen = ntohl(h.len);
        uint64_t table = sizeof(h) + (uint64_t)n * sizeof(struct kvf_datav_run);
        if (n == 0 || n > KVF_DATAV_RUNS_MAX || len < table) {
                snprintf(why, whylen, "head-slice data frame of %u runs in %u bytes (1 to %u runs)", n, len,
                         KVF_DATAV_RUNS_MAX);
                return -EPROTO;
        }
        if (!rx->slice_len || off != rx->slice_off || slen != rx->slice_len) {
                snprintf(why, whylen,
                         "head slice of %u bytes at %u, where this peer sends %s (%u bytes at %u)", slen,
                         off, rx->slice_len ? "this rank a slice" : "whole blocks", rx->slice_len,
                         rx->slice_off);
                return -EPROTO;
        }
        if (rbuf_fill(cn, ring, fd, st, KVF_FRAME_HDR + (uint32_t)table, to) < 0)
                return 1;
        const uint8_t *t = st->b + st->off + KVF_FRAME_HDR + sizeof(h);
        uint64_t key = be64toh(h.key), plen = len - table;
        uint32_t nb = 0;
        for (uint32_t i = 0; i < n; i++) {
                struct kvf_datav_run w;
                memcpy(&w, t + i * sizeof(w), sizeof(w));
                uint32_t blocks = ntohl(w.nblocks), index = ntohl(w.index);
                if (blocks == 0 || blocks > KVF_DATAS_BLOCKS_MAX - nb) {
                        snprintf(why, whylen, "head-slice data frame of more than %u blocks",
                                 KVF_DATAS_BLOCKS_MAX);
                        return -EPROTO;
                }
                for (uint32_t b = 0; b < blocks; b++, nb++)
                        runs[nb] = (struct landing_run){.key = key, .layer = ntohl(w.layer),
                                                        .tensor = ntohs(w.tensor), .index = index + b,
                                                        .nblocks = 1, .off = off, .len = slen};
        }
        st->off += KVF_FRAME_HDR + (uint32_t)table;
        if ((uint64_t)nb * slen != plen) {
                snprintf(why, whylen, "head-slice data frame of %llu payload bytes for %u slices of %u",
                         (unsigned long long)plen, nb, slen);
                return -EPROTO;
        }
        bool drop = false;
        for (uint32_t i = 0; i < nb; i++) {
                io[i].len = slen;
                int rc = conn_landing_check(cn, rx->peer, rx->gen, &runs[i], slen, &io[i].off, why, whylen);
                if (rc < 0)
                        return -EPROTO;
                drop |= rc == 1;
        }
        return receive_runs(rx, ring, fd, st, plen, to, drop, io, iov, runs, nb);
}

/*
 * A DATAR frame (tokens regrouped into this cache's block size, tcp.h) whose frame header is
 * in the read-ahead buffer: its header must name this rank's plan of this peer, and its run
 * a transfer this peer opened; each source block's pieces (from the plan, not the wire) are
 * received straight into their places, staged in groups of at most KVF_STAGE_RUNS pieces.
 * 0; 1 the connection ends; -EPROTO a violation (why).
 */
static int serve_datar(struct rx *rx, struct io_uring *ring, int fd, struct rbuf *st, uint32_t len, unsigned to,
                       char *why, size_t whylen)
{
        struct kvf_datas_hdr h;
        struct kvf_datav_run w;
        const uint32_t hl = sizeof(h) + sizeof(w);
        if (!rx->plan.npieces) {
                snprintf(why, whylen, "regrouped data frame from a peer of this block size");
                return -EPROTO;
        }
        if (len < hl) {
                snprintf(why, whylen, "regrouped data frame of %u bytes", len);
                return -EPROTO;
        }
        if (rbuf_fill(rx->cn, ring, fd, st, KVF_FRAME_HDR + hl, to) < 0)
                return 1;
        memcpy(&h, st->b + st->off + KVF_FRAME_HDR, sizeof(h));
        memcpy(&w, st->b + st->off + KVF_FRAME_HDR + sizeof(h), sizeof(w));
        st->off += KVF_FRAME_HDR + hl;
        uint32_t npieces = ntohl(h.dst), gbytes = ntohl(h.len);
        if (ntohl(h.nruns) != 1 || npieces != rx->plan.npieces || gbytes != rx->plan_bytes) {
                snprintf(why, whylen,
                         "regrouped data frame of %u run(s), %u pieces of %u bytes a group, where this "
                         "peer sends this rank one run, %u pieces of %u bytes", ntohl(h.nruns), npieces,
                         gbytes, rx->plan.npieces, rx->plan_bytes);
                return -EPROTO;
        }
        struct landing_run run = {.key = be64toh(h.key), .layer = ntohl(w.layer), .tensor = ntohs(w.tensor),
                                  .index = ntohl(w.index), .nblocks = ntohl(w.nblocks)};
        uint64_t plen = len - hl, sum = 0;
        if (run.nblocks > KVF_DATAS_BLOCKS_MAX) {
                snprintf(why, whylen, "regrouped data frame of %u blocks (at most %u)", run.nblocks,
                         KVF_DATAS_BLOCKS_MAX);
                return -EPROTO;
        }
        unsigned n;
        int rc = conn_landing_pieces(rx->cn, rx->peer, rx->gen, &run, &rx->plan, rx->pio, rx->pmark,
                                     KVF_DATAR_PIECES_MAX, &n, why, whylen);
        if (rc < 0)
                return -EPROTO;
        if (rc == 1)
                return receive_runs(rx, ring, fd, st, plen, to, true, NULL, NULL, NULL, 0);
        for (unsigned i = 0; i < n; i++)
                sum += rx->pio[i].len;
        if (sum != plen) {
                snprintf(why, whylen, "regrouped data frame of %llu payload bytes for pieces of %llu",
                         (unsigned long long)plen, (unsigned long long)sum);
                return -EPROTO;
        }
        for (unsigned i = 0, k; i < n; i += k) {
                uint64_t bytes = 0;
                for (k = 0; i + k < n && (k == 0 || (k < KVF_STAGE_RUNS &&
                                                     bytes + rx->pio[i + k].len <= KVF_STAGE_BYTES)); k++)
                        bytes += rx->pio[i + k].len;
                uint64_t part = 0;
                for (unsigned j = 0; j < k; j++)
                        part += rx->pio[i + j].len;
                rc = receive_runs(rx, ring, fd, st, part, to, false, rx->pio + i, rx->piov + i, rx->pmark + i, k);
                if (rc != 0)
                        return rc;
        }
        return 0;
}

/* Before waiting for the network: the copies of what was received land first (a transfer
 * whose last frame is in must not wait for more data to be marked), unless more data comes
 * within about a copy's time: then it is received while the copies run. 0, or -EIO. */
#define SETTLE_AFTER_NS 50000

static int settle_if_idle(struct rx *rx, const struct rbuf *st, int fd)
{
        if (!rx->pend.n)
                return 0;
        if (pend_settle(rx, false) < 0)
                return -EIO;
        if (!rx->pend.n || st->len - st->off >= KVF_FRAME_HDR)
                return 0;
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        struct timespec ts = {.tv_nsec = SETTLE_AFTER_NS};
        if (ppoll(&pf, 1, &ts, NULL) == 1)
                return 0;
        return pend_settle(rx, true);
}

/* The plan of a peer of another block size (none for one of this size). 0, or -EXDEV. */
static int regroup_plan(struct rx *rx, const struct peer_identity *id)
{
        const struct kvf_ctl_header *me = rx->cn->ctl.hdr;
        const uint32_t p = id->nranks ? id->nranks : 1, d = me->nranks ? me->nranks : 1;
        char why[400];
        uint32_t heads;
        rx->peer_bsize = id->layout.block_size;
        if (id->layout.block_size == me->layout.block_size)
                return 0;
        if (kvf_tp_check(&id->layout, p, &me->layout, d, 0, &heads, why, sizeof(why)) < 0)
                return kvf_err_set(-EXDEV, "%s", why);
        if (kvf_tp_plan(&id->layout, p, id->rank, &me->layout, d, me->rank, heads, &rx->plan) < 0)
                return kvf_err_set(-EXDEV, "%s", kvf_err_msg());
        if (!rx->plan.npieces)
                return kvf_err_set(-EXDEV, "prefill rank %u of %u sends decode rank %u of %u none of its heads",
                                   id->rank, p, me->rank, d);
        for (uint32_t i = 0; i < rx->plan.npieces; i++)
                rx->plan_bytes += rx->plan.pieces[i].bytes;
        return 0;
}

/* An XOPEN from this peer: a regrouped transfer (another block size) names its source blocks,
 * whose tokens its destination blocks hold; any other names none. 0, or -EPROTO with why. */
static int xopen_check(const struct rx *rx, const struct kvf_record *o, char *why, size_t whylen)
{
        const uint32_t bd = rx->cn->ctl.hdr->layout.block_size, bs = rx->peer_bsize;
        if (!rx->plan.npieces) {
                if (!o->blocks)
                        return 0;
                snprintf(why, whylen, "XOPEN for %s names %llu source blocks to regroup, from a peer of "
                         "this block size", o->request_id, (unsigned long long)o->blocks);
                return -EPROTO;
        }
        if (!o->blocks || o->blocks > UINT32_MAX || o->n_dst == 0 ||
            o->n_dst < kvf_tp_dst_blocks_min((uint32_t)o->blocks, bs, bd) ||
            o->n_dst > kvf_tp_dst_blocks((uint32_t)o->blocks, bs, bd)) {
                snprintf(why, whylen, "XOPEN for %s: %u destination blocks of %u tokens for %llu source "
                         "blocks of %u", o->request_id, o->n_dst, bd, (unsigned long long)o->blocks, bs);
                return -EPROTO;
        }
        return 0;
}

void tcp_serve(struct connector *cn, int fd, const struct peer_identity *id, const char *remote,
               void *state)
{
        struct io_uring ring;
        struct rbuf st = {.cap = KVF_XOPEN_MAX + KVF_FRAME_HDR};
        char why[KVF_REASON_MAX] = "";
        unsigned to = cn->cfg.peer_timeout_ms;
        (void)state;

        struct rx *rx = calloc(1, sizeof(*rx));
        st.b = malloc(st.cap);
        const char *fail = !rx || !st.b ? "out of memory" : NULL;
        if (!fail && kvf_stager_open(&cn->cache, &rx->sg) < 0)
                fail = kvf_err_msg();
        if (!fail && io_uring_queue_init(8, &ring, 0) < 0)
                fail = "no io_uring";
        if (fail) {
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "data connection from '%s': %s", id->instance, fail);
                if (rx)
                        kvf_stager_close(rx->sg);
                free(rx);
                free(st.b);
                return;
        }
        rx->cn = cn;
        rx->peer = id->instance;
        rx->remote = remote;
        rx->gen = id->created_ns;
        /* The handshake accepted the peer's split (handshake.c), so this only says which slice,
         * or which plan. */
        uint32_t soff;
        if (regroup_plan(rx, id) < 0 ||
            (!rx->plan.npieces && kvf_tp_slice(&id->layout, id->nranks, id->rank, &cn->ctl.hdr->layout,
                                               cn->ctl.hdr->nranks, cn->ctl.hdr->rank, &soff, &rx->slice_off,
                                               &rx->slice_len) < 0)) {
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "data connection from '%s': %s", id->instance,
                           kvf_err_msg());
                kvf_stager_close(rx->sg);
                io_uring_queue_exit(&ring);
                kvf_tp_plan_free(&rx->plan);
                free(rx);
                free(st.b);
                return;
        }
        const char *peer = rx->peer;
        uint64_t gen = rx->gen;
        for (;;) {
                if (settle_if_idle(rx, &st, fd) < 0)
                        break;
                if (rbuf_fill(cn, &ring, fd, &st, KVF_FRAME_HDR, 0) < 0)
                        break; /* closed, or stopping */
                struct kvf_frame_hdr fh;
                kvf_net_get_hdr(st.b + st.off, &fh);
                uint32_t len = fh.len;
                uint16_t type = fh.type;
                if (type == KVF_RT_XOPEN) {
                        struct kvf_record o;
                        if (len > KVF_XOPEN_MAX) {
                                snprintf(why, sizeof(why), "XOPEN of %u bytes", len);
                                goto violation;
                        }
                        if (rbuf_fill(cn, &ring, fd, &st, KVF_FRAME_HDR + len, to) < 0)
                                break;
                        int rc = kvf_record_decode(KVF_RT_XOPEN, st.b + st.off + KVF_FRAME_HDR, len, 0, &o);
                        st.off += KVF_FRAME_HDR + len;
                        if (rc < 0) {
                                snprintf(why, sizeof(why), "malformed XOPEN: %s", kvf_err_msg());
                                kvf_record_free(&o);
                                goto violation;
                        }
                        if (xopen_check(rx, &o, why, sizeof(why)) < 0) {
                                kvf_record_free(&o);
                                goto violation;
                        }
                        rc = conn_landing_open(cn, peer, gen, &o, NULL, why, sizeof(why));
                        kvf_record_free(&o);
                        if (rc == -EPROTO)
                                goto violation;
                        if (rc < 0)
                                break;
                        continue;
                }
                if (type == KVF_RT_DATAR) {
                        int rc = serve_datar(rx, &ring, fd, &st, len, to, why, sizeof(why));
                        if (rc == -EPROTO)
                                goto violation;
                        if (rc != 0)
                                break;
                        continue;
                }
                if (rx->plan.npieces) {
                        snprintf(why, sizeof(why),
                                 "a frame of type %u from a peer of %u tokens/block, whose tokens are "
                                 "regrouped into this cache's %u", type, rx->peer_bsize,
                                 cn->ctl.hdr->layout.block_size);
                        goto violation;
                }
                if (type == KVF_RT_DATAS) {
                        int rc = serve_datas(rx, &ring, fd, &st, len, to, why, sizeof(why));
                        if (rc == -EPROTO)
                                goto violation;
                        if (rc != 0)
                                break;
                        continue;
                }
                if ((type == KVF_RT_DATAV || type == KVF_RT_DATA) && rx->slice_len) {
                        snprintf(why, sizeof(why),
                                 "whole blocks from a rank of another tensor-parallel split, which sends "
                                 "this rank %u bytes at %u of each block", rx->slice_len, rx->slice_off);
                        goto violation;
                }
                if (type == KVF_RT_DATAV) {
                        int rc = serve_datav(rx, &ring, fd, &st, len, to, why, sizeof(why));
                        if (rc == -EPROTO)
                                goto violation;
                        if (rc != 0)
                                break;
                        continue;
                }
                if (type != KVF_RT_DATA || len < sizeof(struct kvf_data_hdr) ||
                    len - sizeof(struct kvf_data_hdr) > KVF_DATA_FRAME_MAX) {
                        snprintf(why, sizeof(why), "frame of type %u and %u bytes on a data connection (data: at most %u)",
                                 type, len, KVF_DATA_FRAME_MAX + (unsigned)sizeof(struct kvf_data_hdr));
                        goto violation;
                }
                if (rbuf_fill(cn, &ring, fd, &st, KVF_FRAME_HDR + sizeof(struct kvf_data_hdr), to) < 0)
                        break;
                struct kvf_data_hdr h;
                memcpy(&h, st.b + st.off + KVF_FRAME_HDR, sizeof(h));
                st.off += KVF_FRAME_HDR + sizeof(h);
                struct landing_run run = {.key = be64toh(h.key), .layer = ntohl(h.layer),
                                          .tensor = ntohs(h.tensor), .index = ntohl(h.index),
                                          .nblocks = ntohl(h.nblocks)};
                struct kvf_io_run io = {.len = len - sizeof(h)};
                int rc = conn_landing_check(cn, peer, gen, &run, io.len, &io.off, why, sizeof(why));
                if (rc < 0)
                        goto violation;
                /* rc 1: a closed transfer, whose payload is read and dropped. Else
                 * straight into the cache (or its staging memory): the header named
                 * these blocks, and they are ours. */
                unsigned group = 0;
                if (rc == 0 && kvf_stage_in_begin(&cn->cache, rx->sg, &io, 1, &group) < 0) {
                        log_disconnect(rx);
                        break;
                }
                if (rbuf_payload(cn, &ring, fd, &st, rc == 0 ? io.p : NULL, io.len, to) < 0) {
                        if (rc == 0)
                                kvf_stage_done(rx->sg, group);
                        cut_short(rx);
                        break;
                }
                if (rc == 0 && receive_end(rx, &io, &run, 1, group) < 0)
                        break;
        }
        goto out;
violation:
        kvf_count(&cn->ctl, KVF_CTR_FRAMES_REJECTED, 1);
        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "peer '%s' (%s) broke the data protocol: %s: disconnected",
                   peer, remote, why);
out:
        pend_settle(rx, true); /* what was received in full lands, and is marked */
        io_uring_queue_exit(&ring);
        kvf_stager_close(rx->sg);
        kvf_tp_plan_free(&rx->plan);
        free(rx);
        free(st.b);
}
