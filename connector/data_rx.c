/*
 * TCP data path, receiving side (see data.h).
 *
 * Every frame header is checked before a byte of its payload is received,
 * and the payload goes only into the blocks the header names, which must
 * belong to a transfer the same peer opened. A peer that breaks a rule is
 * disconnected and reported; what it sent before stays in that transfer's
 * blocks (the decode engine never sees it as arrived, since the bitmap is
 * not full and no arrival is published).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <liburing.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"
#include "data.h"
#include "err.h"
#include "layout.h"
#include "log.h"

struct rx_xfer {
        char peer[KVF_INSTANCE_MAX];
        uint64_t gen; /* the peer's incarnation */
        uint64_t key;
        char request_id[KVF_REQ_ID_MAX];
        uint32_t *dst;
        uint32_t n_dst;
        uint8_t *got; /* bit per (layer, tensor, index) */
        uint64_t need, have;
        bool waiting; /* a finish notice waits for the data */
        bool closed;  /* published or aborted: late frames for it are drained, not written */
        uint64_t eng_session; /* the decode engine session that reserved the blocks, 0 none */
        uint64_t session;     /* the control connection whose notice waits */
        struct kvf_record notice;
        uint64_t touched_ns;
        struct rx_xfer *next;
};

static unsigned bucket(const char *peer, uint64_t key)
{
        return (unsigned)(kvf_hash64(peer, strlen(peer), key) % RX_BUCKETS);
}

static struct rx_xfer *rx_find(struct connector *cn, const char *peer, uint64_t gen, uint64_t key)
{
        for (struct rx_xfer *x = cn->rx[bucket(peer, key)]; x; x = x->next)
                if (x->key == key && x->gen == gen && !strcmp(x->peer, peer))
                        return x;
        return NULL;
}

/* A new transfer into the table. Lock held. */
static void rx_insert(struct connector *cn, struct rx_xfer *x)
{
        unsigned b = bucket(x->peer, x->key);
        x->next = cn->rx[b];
        cn->rx[b] = x;
}

static void rx_free(struct rx_xfer *x)
{
        if (x->waiting)
                kvf_record_free(&x->notice);
        free(x->dst);
        free(x->got);
        free(x);
}

/*
 * Register (or keep) a transfer, from its XOPEN or from its finish notice,
 * whichever comes first (they travel on different connections). -EPROTO if
 * its block ids are not ours to give.
 */
static int rx_open(struct connector *cn, const char *peer, uint64_t gen, const struct kvf_record *o,
                   char *why, size_t whylen)
{
        const struct kvf_cache_layout *L = &cn->ctl.hdr->layout;
        uint8_t *seen = calloc(L->num_blocks / 8 + 1, 1);
        if (!seen)
                return -ENOMEM;
        for (uint32_t i = 0; i < o->n_dst; i++) {
                uint32_t b = o->dst[i];
                if (b >= L->num_blocks || (seen[b / 8] & (1u << (b % 8)))) {
                        snprintf(why, whylen, "XOPEN for %s names block %u %s", o->request_id, b,
                                 b >= L->num_blocks ? "beyond this cache" : "twice");
                        free(seen);
                        return -EPROTO;
                }
                seen[b / 8] |= (uint8_t)(1u << (b % 8));
        }
        free(seen);
        pthread_mutex_lock(&cn->rxmu);
        struct rx_xfer *x = rx_find(cn, peer, gen, o->key);
        if (x && x->closed) {
                /* a late XOPEN of a transfer already published or aborted */
                pthread_mutex_unlock(&cn->rxmu);
                return 0;
        }
        if (x && (x->n_dst != o->n_dst || memcmp(x->dst, o->dst, o->n_dst * sizeof(uint32_t)))) {
                /* Same key, other blocks: cannot be a resend. */
                pthread_mutex_unlock(&cn->rxmu);
                snprintf(why, whylen, "XOPEN for %s changes the blocks of an open transfer", o->request_id);
                return -EPROTO;
        }
        if (!x) {
                uint64_t bits = (uint64_t)kvf_layout_layers(L) * kvf_layout_tensors(L) * o->n_dst;
                x = calloc(1, sizeof(*x));
                if (x) {
                        x->dst = malloc((o->n_dst ? o->n_dst : 1) * sizeof(uint32_t));
                        x->got = calloc(bits / 8 + 1, 1);
                }
                if (!x || !x->dst || !x->got) {
                        if (x)
                                rx_free(x);
                        pthread_mutex_unlock(&cn->rxmu);
                        return -ENOMEM;
                }
                snprintf(x->peer, sizeof(x->peer), "%s", peer);
                snprintf(x->request_id, sizeof(x->request_id), "%s", o->request_id);
                /* The session the sender bound it to; else the one live now. */
                x->eng_session = o->session ? o->session : conn_engine_session(cn);
                x->gen = gen;
                x->key = o->key;
                memcpy(x->dst, o->dst, o->n_dst * sizeof(uint32_t));
                x->n_dst = o->n_dst;
                x->need = bits;
                rx_insert(cn, x);
        }
        x->touched_ns = kvf_now_ns();
        pthread_mutex_unlock(&cn->rxmu);
        return 0;
}

/*
 * Check a DATA header; on success *dst_off is where its payload goes. Returns
 * 0, 1 when the frame belongs to a transfer already closed (drain it: a
 * resend that crossed the acknowledgement, or frames that were in flight when
 * the transfer was aborted), or -EPROTO. Lock not held.
 */
static int rx_check(struct connector *cn, const char *peer, uint64_t gen, const struct kvf_data_hdr *h,
                    uint32_t frame_len, uint64_t *dst_off, char *why, size_t whylen)
{
        const struct kvf_cache_layout *L = &cn->ctl.hdr->layout;
        uint32_t layers = kvf_layout_layers(L), tensors = kvf_layout_tensors(L);
        int rc = -EPROTO;

        uint64_t live = conn_engine_session(cn);
        pthread_mutex_lock(&cn->rxmu);
        struct rx_xfer *x = rx_find(cn, peer, gen, h->key);
        if (x && x->closed)
                rc = 1;
        else if (x && x->eng_session && x->eng_session != live)
                rc = 1; /* its engine session is over: the blocks are not its any more */
        else if (!x)
                snprintf(why, whylen, "data for transfer %016llx, which was never opened",
                         (unsigned long long)h->key);
        else if (h->layer >= layers || h->tensor >= tensors)
                snprintf(why, whylen, "data for layer %u tensor %u: this cache has %u layers, %u tensors",
                         h->layer, h->tensor, layers, tensors);
        else if (h->nblocks == 0 || (uint64_t)h->index + h->nblocks > x->n_dst)
                snprintf(why, whylen, "data for blocks [%u, +%u) of %s, which has %u", h->index,
                         h->nblocks, x->request_id, x->n_dst);
        else if ((uint64_t)frame_len != sizeof(*h) + (uint64_t)h->nblocks * L->block_bytes)
                snprintf(why, whylen, "frame of %u bytes for %u blocks of %llu bytes", frame_len,
                         h->nblocks, (unsigned long long)L->block_bytes);
        else {
                rc = 0;
                for (uint32_t i = 1; i < h->nblocks; i++)
                        if (x->dst[h->index + i] != x->dst[h->index] + i) {
                                snprintf(why, whylen, "data run over destination blocks that are not contiguous");
                                rc = -EPROTO;
                                break;
                        }
                if (rc == 0)
                        *dst_off = kvf_layout_offset(L, h->layer, h->tensor, x->dst[h->index]);
        }
        pthread_mutex_unlock(&cn->rxmu);
        return rc;
}

/* Mark blocks received; returns 1 if this completed the transfer. */
static int rx_mark(struct connector *cn, const char *peer, uint64_t gen, const struct kvf_data_hdr *h)
{
        const struct kvf_cache_layout *L = &cn->ctl.hdr->layout;
        int done = 0;
        pthread_mutex_lock(&cn->rxmu);
        struct rx_xfer *x = rx_find(cn, peer, gen, h->key);
        /* Closed while its payload was being received (the lock is not held across
         * it): an abort, or its engine session ended; its bitmap is gone. */
        if (x && !x->closed && x->got && x->have < x->need) {
                uint64_t base = ((uint64_t)h->layer * kvf_layout_tensors(L) + h->tensor) * x->n_dst;
                for (uint32_t i = 0; i < h->nblocks; i++) {
                        uint64_t bit = base + h->index + i;
                        if (!(x->got[bit / 8] & (1u << (bit % 8)))) {
                                x->got[bit / 8] |= (uint8_t)(1u << (bit % 8));
                                x->have++;
                        }
                }
                x->touched_ns = kvf_now_ns();
                done = x->have == x->need;
        }
        pthread_mutex_unlock(&cn->rxmu);
        return done;
}

/*
 * Submit one receive and wait for it. Returns its result (bytes, 0 at end of
 * stream, -errno), or -ETIMEDOUT once timeout_ms (0 = none) has passed since
 * `start`, or -ECANCELED when the connector stops; either way the pending
 * receive is failed and collected first.
 */
static int recv_once(struct connector *cn, struct io_uring *ring, int fd, void *p, uint32_t n,
                     int flags, uint64_t start, unsigned timeout_ms)
{
        struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
        io_uring_prep_recv(sqe, fd, p, n, flags);
        io_uring_submit(ring);
        for (;;) {
                struct io_uring_cqe *cqe;
                struct __kernel_timespec ts = {.tv_sec = 0, .tv_nsec = 200000000};
                int rc = io_uring_wait_cqe_timeout(ring, &cqe, &ts);
                if (rc == 0) {
                        int res = cqe->res;
                        io_uring_cqe_seen(ring, cqe);
                        return res;
                }
                if (rc != -ETIME)
                        return rc;
                if (conn_stopping(cn) || (timeout_ms && kvf_now_ns() - start > (uint64_t)timeout_ms * 1000000ull)) {
                        shutdown(fd, SHUT_RDWR);
                        if (io_uring_wait_cqe(ring, &cqe) == 0)
                                io_uring_cqe_seen(ring, cqe);
                        return conn_stopping(cn) ? -ECANCELED : -ETIMEDOUT;
                }
        }
}

/* One receive of exactly n bytes into p, within timeout_ms (0 = wait, watching conn_stopping(cn)). */
static int recv_exact(struct connector *cn, struct io_uring *ring, int fd, void *p, uint32_t n,
                      unsigned timeout_ms)
{
        int res = recv_once(cn, ring, fd, p, n, MSG_WAITALL, kvf_now_ns(), timeout_ms);
        if (res < 0)
                return res;
        return (uint32_t)res == n ? 0 : (res == 0 ? -ECONNRESET : -EPIPE);
}

static void post_done(struct connector *cn, const char *peer, uint64_t gen, uint64_t key)
{
        struct event *ev = calloc(1, sizeof(*ev));
        if (!ev)
                return;
        ev->kind = EV_DATA_DONE;
        ev->src_gen = gen;
        ev->rec.key = key;
        snprintf(ev->rec.peer, sizeof(ev->rec.peer), "%s", peer);
        conn_dispatch(cn, ev);
}

/*
 * Staged reading: one receive takes whatever the socket has (many small
 * frames at once); a large payload goes from the stage into the cache for
 * the part already read and straight from the socket into the cache for the
 * rest.
 */
#define STAGE_LOOKAHEAD (4u << 10)

struct stage {
        uint8_t *b;
        uint32_t cap, off, len;
};

/* Make at least `need` unread bytes available in the stage. */
static int stage_fill(struct connector *cn, struct io_uring *ring, int fd, struct stage *st,
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
                 * in one receive, not so much that a large payload lands in the stage
                 * and must be copied again instead of going straight to the cache. */
                uint32_t want = need > STAGE_LOOKAHEAD ? need : STAGE_LOOKAHEAD;
                if (want > st->cap)
                        want = st->cap;
                /* Idle between frames is fine; inside a frame the bound applies. */
                int res = recv_once(cn, ring, fd, st->b + st->len, want - st->len, 0, start,
                                    st->len > 0 ? timeout_ms : 0);
                if (res <= 0)
                        return res == 0 ? -ECONNRESET : res;
                st->len += (uint32_t)res;
        }
        return 0;
}

/* Move `n` payload bytes to dst (NULL: drop them): from the stage first, then the socket. */
static int stage_payload(struct connector *cn, struct io_uring *ring, int fd, struct stage *st,
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
                int rc = stage_fill(cn, ring, fd, st, k, timeout_ms);
                if (rc < 0)
                        return rc;
                st->off += k;
                n -= k;
        }
        return 0;
}

void data_rx_serve(struct connector *cn, int fd, const char *peer, uint64_t gen, const char *remote)
{
        struct io_uring ring;
        struct stage st = {.cap = KVF_XOPEN_MAX + KVF_FRAME_HDR};
        char why[KVF_REASON_MAX] = "";
        unsigned to = cn->cfg.peer_timeout_ms;

        st.b = malloc(st.cap);
        if (!st.b || io_uring_queue_init(8, &ring, 0) < 0) {
                free(st.b);
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "data connection from '%s': no io_uring", peer);
                return;
        }
        for (;;) {
                if (stage_fill(cn, &ring, fd, &st, KVF_FRAME_HDR, 0) < 0)
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
                        if (stage_fill(cn, &ring, fd, &st, KVF_FRAME_HDR + len, to) < 0)
                                break;
                        int rc = kvf_record_decode(KVF_RT_XOPEN, st.b + st.off + KVF_FRAME_HDR, len, 0, &o);
                        st.off += KVF_FRAME_HDR + len;
                        if (rc < 0) {
                                snprintf(why, sizeof(why), "malformed XOPEN: %s", kvf_err_msg());
                                kvf_record_free(&o);
                                goto violation;
                        }
                        rc = rx_open(cn, peer, gen, &o, why, sizeof(why));
                        kvf_record_free(&o);
                        if (rc == -EPROTO)
                                goto violation;
                        if (rc < 0)
                                break;
                        continue;
                }
                if (type != KVF_RT_DATA || len < sizeof(struct kvf_data_hdr)) {
                        snprintf(why, sizeof(why), "frame of type %u and %u bytes on a data connection", type, len);
                        goto violation;
                }
                if (stage_fill(cn, &ring, fd, &st, KVF_FRAME_HDR + sizeof(struct kvf_data_hdr), to) < 0)
                        break;
                struct kvf_data_hdr h;
                memcpy(&h, st.b + st.off + KVF_FRAME_HDR, sizeof(h));
                st.off += KVF_FRAME_HDR + sizeof(h);
                h.key = be64toh(h.key);
                h.layer = ntohl(h.layer);
                h.tensor = ntohs(h.tensor);
                h.index = ntohl(h.index);
                h.nblocks = ntohl(h.nblocks);
                uint64_t off;
                uint64_t plen = len - sizeof(h);
                int rc = rx_check(cn, peer, gen, &h, len, &off, why, sizeof(why));
                if (rc < 0)
                        goto violation;
                /* rc 1: a closed transfer, whose payload is read and dropped. Else
                 * straight into the cache (or the backend's staging buffer): the header
                 * named these blocks, and they are ours. */
                uint8_t *dst = NULL;
                if (rc == 0 && kvf_cache_io_begin(&cn->cache, off, plen, true, &dst) < 0) {
                        snprintf(why, sizeof(why), "%s", kvf_err_msg());
                        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "data from '%s' (%s): %s: disconnected",
                                   peer, remote, why);
                        break;
                }
                if (stage_payload(cn, &ring, fd, &st, dst, plen, to) < 0) {
                        kvf_count(&cn->ctl, KVF_CTR_FRAMES_REJECTED, 1);
                        kvf_warn("peer '%s' (%s): data frame cut short", peer, remote);
                        break;
                }
                if (rc == 1)
                        continue;
                if (kvf_cache_io_end(&cn->cache, off, plen, true, dst) < 0) {
                        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "data from '%s' (%s): %s: disconnected",
                                   peer, remote, kvf_err_msg());
                        break;
                }
                kvf_count(&cn->ctl, KVF_CTR_BYTES_TCP_RECEIVED, plen);
                if (rx_mark(cn, peer, gen, &h))
                        post_done(cn, peer, gen, h.key);
        }
        goto out;
violation:
        kvf_count(&cn->ctl, KVF_CTR_FRAMES_REJECTED, 1);
        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "peer '%s' (%s) broke the data protocol: %s: disconnected",
                   peer, remote, why);
out:
        io_uring_queue_exit(&ring);
        free(st.b);
}

int data_rx_notice(struct connector *cn, const struct kvf_record *n, uint64_t gen, uint64_t session)
{
        int ready = 0;
        char why[KVF_REASON_MAX];
        /* The notice can overtake the transfer's XOPEN: open it from the notice. */
        if (rx_open(cn, n->peer, gen, n, why, sizeof(why)) < 0)
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "notice from '%s': %s", n->peer, why);
        pthread_mutex_lock(&cn->rxmu);
        struct rx_xfer *x = rx_find(cn, n->peer, gen, n->key);
        if (x && x->closed) {
                ready = 1; /* the journal answers the repeat */
        } else if (x && x->have == x->need) {
                ready = 1;
        } else if (x) {
                /* Keep the notice until the last block is in. */
                if (x->waiting)
                        kvf_record_free(&x->notice);
                x->notice = *n;
                x->notice.dst = malloc((n->n_dst ? n->n_dst : 1) * sizeof(uint32_t));
                x->notice.src = NULL;
                x->notice.runs = NULL;
                if (x->notice.dst)
                        memcpy(x->notice.dst, n->dst, n->n_dst * sizeof(uint32_t));
                else
                        x->notice.n_dst = 0;
                x->waiting = true;
                x->session = session;
                x->touched_ns = kvf_now_ns();
        }
        pthread_mutex_unlock(&cn->rxmu);
        return ready;
}

int data_rx_take_ready(struct connector *cn, const char *peer, uint64_t gen, uint64_t key,
                       struct kvf_record *notice, uint64_t *session)
{
        int got = 0;
        pthread_mutex_lock(&cn->rxmu);
        struct rx_xfer *x = rx_find(cn, peer, gen, key);
        if (x && x->waiting && x->have == x->need) {
                *notice = x->notice;
                *session = x->session;
                x->waiting = false;
                got = 1;
        }
        pthread_mutex_unlock(&cn->rxmu);
        return got;
}

void data_rx_close(struct connector *cn, const char *peer, uint64_t gen, uint64_t key)
{
        pthread_mutex_lock(&cn->rxmu);
        struct rx_xfer *x = rx_find(cn, peer, gen, key);
        if (!x && (x = calloc(1, sizeof(*x)))) {
                /* closed before anything came (an abort): remember it all the same */
                snprintf(x->peer, sizeof(x->peer), "%s", peer);
                x->gen = gen;
                x->key = key;
                x->eng_session = conn_engine_session(cn);
                rx_insert(cn, x);
        }
        if (x && !x->closed) {
                if (x->waiting)
                        kvf_record_free(&x->notice);
                x->waiting = false;
                free(x->dst);
                free(x->got);
                x->dst = NULL;
                x->got = NULL;
                x->n_dst = 0;
                x->closed = true;
        }
        if (x)
                x->touched_ns = kvf_now_ns();
        pthread_mutex_unlock(&cn->rxmu);
}

void data_rx_expire(struct connector *cn, uint64_t open_ns, uint64_t closed_ns)
{
        pthread_mutex_lock(&cn->rxmu);
        uint64_t now = kvf_now_ns();
        for (unsigned b = 0; b < RX_BUCKETS; b++)
                for (struct rx_xfer **pp = &cn->rx[b]; *pp;) {
                        struct rx_xfer *x = *pp;
                        if (kvf_elapsed(now, x->touched_ns) > (x->closed ? closed_ns : open_ns)) {
                                *pp = x->next;
                                if (!x->closed)
                                        kvf_warn("req %s from %s: transfer abandoned by its sender (%llu of %llu blocks): dropped",
                                                 x->request_id, x->peer, (unsigned long long)x->have,
                                                 (unsigned long long)x->need);
                                rx_free(x);
                                continue;
                        }
                        pp = &x->next;
                }
        pthread_mutex_unlock(&cn->rxmu);
}

uint64_t data_rx_session(struct connector *cn, const char *peer, uint64_t gen, uint64_t key)
{
        uint64_t live = conn_engine_session(cn);
        pthread_mutex_lock(&cn->rxmu);
        struct rx_xfer *x = rx_find(cn, peer, gen, key);
        uint64_t s = x ? x->eng_session : live;
        pthread_mutex_unlock(&cn->rxmu);
        return s;
}

void data_rx_end_sessions(struct connector *cn, uint64_t live)
{
        struct event *ready = NULL;
        pthread_mutex_lock(&cn->rxmu);
        for (unsigned b = 0; b < RX_BUCKETS; b++)
                for (struct rx_xfer *x = cn->rx[b]; x; x = x->next) {
                        if (x->closed || !x->eng_session || x->eng_session == live || !x->waiting)
                                continue;
                        /* Its notice waited for data that no longer matters: answer it now
                         * (on_notice sees the session is over). The transfer stays open
                         * until then; rx_check already drains its frames. */
                        struct event *ev = calloc(1, sizeof(*ev));
                        if (!ev)
                                continue;
                        ev->kind = EV_NOTICE;
                        ev->session = x->session;
                        ev->src_gen = x->gen;
                        ev->rec = x->notice;
                        x->waiting = false;
                        ev->next = ready;
                        ready = ev;
                }
        pthread_mutex_unlock(&cn->rxmu);
        while (ready) {
                struct event *ev = ready;
                ready = ev->next;
                conn_dispatch(cn, ev);
        }
}
