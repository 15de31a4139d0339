/*
 * The rdma transport, sending side (see rdma.h): per peer, one thread that
 * connects (tcp anchor with the handshake, then rdma_cm RC), posts the peer's
 * frames as RDMA WRITE chains within the send queue's depth, posts each
 * noticed transfer's done message after its last write, and turns every
 * completion into what it means for exactly the frames it covers.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "atomics.h"
#include "clock.h"
#include "err.h"
#include "layout.h"
#include "log.h"
#include "rdma.h"
#include "rdma_state.h"
#include "tpsplit.h"
#include "xfer.h"

/* Pieces merged into one work request: at most this many bytes (a length is 32 bits). */
#define RDMA_WRITE_MAX (1ull << 30)

/* A transfer's rdma state (x->tp). */
struct rdma_xfer {
        struct xfer *x;
        uint64_t done_conn; /* the connection its done message went out on, 0 none */
        bool done_ok;       /* a done message of status 0 completed: the peer had every byte */
        int fail_status;    /* a write failed after its notice went out: its done message says so */
        int fail_wc;        /* ... with this completion status */
        bool listed;        /* on the peer's noticed list */
        struct rdma_xfer *prev, *next;
};

/* The peer's rdma state (xp->tp). Lists under xp->mu. */
struct rdma_peer {
        int wake_fd; /* eventfd: frames queued, a transfer noticed, stop */
        pthread_t thread;
        bool started; /* under xp->mu */
        uint64_t conns; /* connections made; the current one's number */
        struct rdma_xfer *noticed; /* transfers whose done message may be due */
};

/* One work request in the send queue: the write of frame f (the whole frame, or its last
 * block's head slice: the slot owns the frame); a head slice of f's blocks before its last
 * (part: f's transfer held as x, the frame owned by a later slot or c->cur); or x's done
 * message (f NULL, x held). */
struct slot {
        struct frame *f;
        struct xfer *x;
        bool part;
};

/* One rdma connection to the peer (the data thread's). */
struct rconn {
        struct xfer_peer *xp;
        uint64_t no; /* its number (rdma_peer.conns) */
        int fd;      /* the tcp anchor */
        struct rdma_event_channel *ec;
        struct rdma_cm_id *id;
        struct ibv_pd *pd;
        struct rdma_mrs *lm; /* this cache's registration (a reference to rdma_local_mrs's) */
        struct ibv_comp_channel *cc;
        struct ibv_cq *cq;
        unsigned cq_events;
        struct rdma_done_msg *msgs; /* one per slot */
        struct ibv_mr *msg_mr;
        struct slot *slots;
        struct ibv_send_wr *wrs;
        struct ibv_sge *sges;
        unsigned depth, sig;
        uint64_t next_seq, done_seq; /* posted [done_seq, next_seq) not yet completed */
        uint64_t last_done_ns;
        /* the peer's region and layout; its cache as addressed in the peer's process (rcache:
         * base, or a cache in parts with each (layer, tensor)'s address and block stride, the
         * key of each part in rkeys), for kvf_cache_addr */
        uint64_t raddr, rlen;
        uint32_t rkey;
        struct kvf_cache_layout rlay;
        struct kvf_cache rcache;
        uint32_t *rkeys;
        /* The peer is a rank of another tensor-parallel split (the handshake's identities): of
         * each block, slen bytes at soff go to doff of its destination block, one work request
         * per block. slen 0: whole blocks, one work request per frame (a run contiguous on both
         * sides). */
        uint32_t soff, doff, slen;
        /* The peer's blocks hold another number of tokens: the plan's pieces of each source
         * block into the destination blocks (frames indexed by source position, x->n_src), a
         * work request per piece; npieces 0 otherwise. */
        struct kvf_tp_plan plan;
        /* A frame whose slices or pieces are partly posted (the send queue was full): the
         * next is block cur_k's (and its piece cur_x). Owned here until its last is posted. */
        struct frame *cur;
        uint32_t cur_k, cur_x;
};

static void wake(struct rdma_peer *rp)
{
        uint64_t one = 1;
        if (write(rp->wake_fd, &one, sizeof(one)) < 0) {
                /* saturated: it is awake anyway */
        }
}

static void drain_wake(struct rdma_peer *rp)
{
        uint64_t v;
        while (read(rp->wake_fd, &v, sizeof(v)) == sizeof(v)) {
        }
}

void rdma_wake(struct xfer_peer *xp)
{
        wake(xp->tp);
}

int rdma_xfer_open(struct xfer_peer *xp, struct xfer *x)
{
        (void)xp;
        struct rdma_xfer *rx = calloc(1, sizeof(*rx));
        if (!rx)
                return -ENOMEM;
        rx->x = x;
        x->tp = rx;
        return 0;
}

static void unlist(struct rdma_peer *rp, struct rdma_xfer *rx)
{
        if (!rx->listed)
                return;
        if (rx->prev)
                rx->prev->next = rx->next;
        else
                rp->noticed = rx->next;
        if (rx->next)
                rx->next->prev = rx->prev;
        rx->listed = false;
        rx->prev = rx->next = NULL;
}

void rdma_xfer_free(struct xfer_peer *xp, struct xfer *x)
{
        struct rdma_xfer *rx = x->tp;
        unlist(xp->tp, rx);
        free(rx);
        x->tp = NULL;
}

void rdma_noticed(struct xfer_peer *xp, struct xfer *x)
{
        struct rdma_peer *rp = xp->tp;
        struct rdma_xfer *rx = x->tp;
        if (!rx->listed) {
                rx->next = rp->noticed;
                if (rp->noticed)
                        rp->noticed->prev = rx;
                rx->prev = NULL;
                rp->noticed = rx;
                rx->listed = true;
        }
        wake(rp);
}

/* ---- one connection ---- */

static void rconn_close(struct rconn *c)
{
        rdma_qp_cq_destroy(c->id, c->cq, c->cq_events, c->cc);
        if (c->msg_mr)
                ibv_dereg_mr(c->msg_mr);
        free(c->msgs);
        free(c->slots);
        free(c->wrs);
        free(c->sges);
        kvf_tp_plan_free(&c->plan);
        free(c->rcache.parts);
        free(c->rcache.strides);
        free(c->rkeys);
        /* (the protection domain stays: rdma_local_mrs's) */
        rdma_local_mrs_put(c->xp->p->cn, c->lm);
        rdma_id_destroy(c->id, c->ec);
        if (c->fd >= 0)
                close(c->fd);
}

/* The welcome's table of a peer's cache in parts (rdma.h RDMA_PART_WORDS a part): every part
 * where its blocks fit, each block inside the part's own extent. 0, or -EPROTO (kvf_err). */
static int remote_parts(struct rconn *c, const struct kvf_record *w, const char *peer)
{
        const struct kvf_cache_layout *L = &c->rlay;
        const uint32_t np = kvf_layout_parts(L);
        const uint64_t nb = L->num_blocks;
        struct kvf_cache *rc = &c->rcache;
        *rc = (struct kvf_cache){.layout = *L, .base = (uint8_t *)(uintptr_t)c->raddr, .bytes = c->rlen};
        if (!w->n_rdma_parts)
                return 0;
        if (w->n_rdma_parts != np * RDMA_PART_WORDS || !nb)
                return kvf_err_set(-EPROTO, "peer '%s' offers an rdma table of %u words for %u tensors: refused",
                                   peer, w->n_rdma_parts, np);
        if (!(rc->parts = calloc(np, sizeof(*rc->parts))) || !(rc->strides = calloc(np, sizeof(*rc->strides))) ||
            !(c->rkeys = calloc(np, sizeof(*c->rkeys))))
                return kvf_err_set(-ENOMEM, "out of memory");
        for (uint32_t i = 0; i < np; i++) {
                const uint32_t *q = w->rdma_parts + (size_t)i * RDMA_PART_WORDS;
                uint64_t a = (uint64_t)q[0] << 32 | q[1], st = (uint64_t)q[2] << 32 | q[3];
                uint64_t bb = kvf_layout_part_block_bytes(L, i);
                if (!a || st < bb || st > UINT64_MAX / nb || a + (nb - 1) * st + bb < a)
                        return kvf_err_set(-EPROTO, "peer '%s' offers an rdma table whose tensor %u (at %#llx, blocks "
                                           "%llu bytes apart) does not hold its blocks: refused", peer, i,
                                           (unsigned long long)a, (unsigned long long)st);
                rc->parts[i] = (uint8_t *)(uintptr_t)a;
                rc->strides[i] = st;
                c->rkeys[i] = q[4];
        }
        rc->n_parts = np;
        return 0;
}

/* Blocks of this cache that are not back to back (the engine's strided views). */
static bool strided(const struct kvf_cache *cache)
{
        if (cache->strides)
                for (uint32_t i = 0; i < cache->n_parts; i++)
                        if (cache->strides[i] != kvf_layout_part_block_bytes(&cache->layout, i))
                                return true;
        return false;
}

/* The peer's address of byte roff of its cache (in its layout's order), and its key. */
static uint64_t remote_at(const struct rconn *c, uint64_t roff, uint32_t *rkey)
{
        uint64_t rest;
        *rkey = c->rkeys ? c->rkeys[kvf_layout_part(&c->rcache.layout, roff, &rest)] : c->rkey;
        return (uintptr_t)kvf_cache_addr(&c->rcache, roff);
}

/* The peer's blocks hold another number of tokens: the plan of this rank's pieces towards it
 * (common/tpsplit.h). 0, or -EXDEV with kvf_err set. */
static int regroup_plan(struct rconn *c, const struct peer_identity *id)
{
        const struct kvf_ctl_header *me = c->xp->p->cn->ctl.hdr;
        const uint32_t p = me->nranks ? me->nranks : 1, d = id->nranks ? id->nranks : 1;
        char why[400];
        /* (Block sizes differ: never whole blocks, so a plan has pieces or is refused.) */
        if (kvf_tp_pair_plan(&me->layout, p, me->rank, &id->layout, d, id->rank, &c->plan, why, sizeof(why)) < 0)
                return kvf_err_set(-EXDEV, "%s", why);
        kvf_info("rdma to '%s' (rank %u of %u, %u tokens/block; this is rank %u of %u, %u tokens/block): "
                 "tokens regrouped, %u pieces per %u source blocks, a work request per piece",
                 c->xp->p->name, id->rank, d, id->layout.block_size, me->rank, p, me->layout.block_size,
                 c->plan.npieces, c->plan.src_per_group);
        return 0;
}

/*
 * The tcp anchor and its handshake (the peer's region and key in the WELCOME), then the
 * rdma_cm connection carrying the handshake's ticket. 0, or -errno with kvf_err set and
 * *status saying whether the peer refused (anything but KVF_STATUS_CONNECTION).
 */
static int rconn_open(struct rconn *c, int *status)
{
        struct xfer_peer *xp = c->xp;
        struct peer *p = xp->p;
        struct connector *cn = p->cn;
        unsigned to = cn->cfg.connect_timeout_ms;
        char host[128];
        uint16_t port;
        struct peer_identity id;
        struct kvf_record w;
        int rc;

        *status = KVF_STATUS_CONNECTION;
        if ((rc = conn_peer_resolve(p, host, sizeof(host), &port, status)) < 0)
                return rc;
        *status = KVF_STATUS_CONNECTION;
        if ((rc = c->fd = kvf_net_connect(host, port, to)) < 0)
                return rc;
        if ((rc = conn_handshake_client(cn, c->fd, conn_rdma_transport.purpose, &id, &w, status)) < 0)
                return rc;
        *status = KVF_STATUS_CONNECTION;
        /* The region must be the peer's whole cache as its layout says (checked in the
         * handshake against ours): every write's remote address is computed from it. */
        uint64_t want = id.layout.cache_bytes;
        if (!w.rdma_rkey || w.rdma_rkey > UINT32_MAX || !w.rdma_port || w.rdma_port > 65535 ||
            w.rdma_len != want || w.rdma_addr + w.rdma_len < w.rdma_addr) {
                kvf_record_free(&w);
                return kvf_err_set(-EPROTO, "peer '%s' offers an rdma region of %llu bytes (its cache has %llu), "
                                            "port %llu, key %llu: refused",
                                   id.instance, (unsigned long long)w.rdma_len, (unsigned long long)want,
                                   (unsigned long long)w.rdma_port, (unsigned long long)w.rdma_rkey);
        }
        c->raddr = w.rdma_addr;
        c->rlen = w.rdma_len;
        c->rkey = (uint32_t)w.rdma_rkey;
        c->rlay = id.layout;
        xfer_check_gen(xp, id.created_ns); /* (nothing was written yet on this connection) */
        rc = remote_parts(c, &w, id.instance);
        kvf_record_free(&w);
        if (rc < 0)
                return rc;
        const struct kvf_ctl_header *me = cn->ctl.hdr;
        if (id.layout.block_size != me->layout.block_size) {
                if ((rc = regroup_plan(c, &id)) < 0) {
                        *status = KVF_STATUS_LAYOUT_MISMATCH;
                        return kvf_err_set(-EPROTO, "peer layout mismatch: %s", kvf_err_msg());
                }
        } else if (kvf_tp_slice(&me->layout, me->nranks, me->rank, &id.layout, id.nranks, id.rank, &c->soff,
                                &c->doff, &c->slen) < 0) {
                /* (The peer's handshake refuses what this refuses; this holds against one that
                 * does not.) */
                *status = KVF_STATUS_LAYOUT_MISMATCH;
                return kvf_err_set(-EPROTO, "peer layout mismatch: %s", kvf_err_msg());
        }
        if (c->slen)
                kvf_info("rdma to '%s' (rank %u of %u; this is rank %u of %u): %u of each block's %llu "
                         "bytes, at %u, to %u of its blocks: a work request per block",
                         p->name, id.rank, id.nranks, me->rank, me->nranks, c->slen,
                         (unsigned long long)me->layout.block_bytes, c->soff, c->doff);

        /* rdma_cm to the address the anchor reached, from the address it left from (the
         * route's interface), or from --rdma-device's. */
        struct sockaddr_storage src, dst;
        socklen_t sl = sizeof(src), dl = sizeof(dst);
        if (getsockname(c->fd, (struct sockaddr *)&src, &sl) || getpeername(c->fd, (struct sockaddr *)&dst, &dl))
                return kvf_err_set(-errno, "getsockname: %s", strerror(errno));
        struct in_addr lh;
        if (cn->cfg.rdma.device[0]) {
                struct sockaddr_in sin;
                if ((rc = rdma_device_addr(cn->cfg.rdma.device, &sin)) < 0)
                        return rc;
                memcpy(&src, &sin, sizeof(sin));
        } else if (inet_pton(AF_INET, cn->cfg.listen_host, &lh) == 1 && lh.s_addr != htonl(INADDR_ANY) &&
                   (ntohl(lh.s_addr) >> 24) != 127) {
                /* The interface of our listen address, as on the decode side. */
                src = (struct sockaddr_storage){0};
                struct sockaddr_in *s4 = (struct sockaddr_in *)&src;
                s4->sin_family = AF_INET;
                s4->sin_addr = lh;
        }
        if (src.ss_family == AF_INET)
                ((struct sockaddr_in *)&src)->sin_port = 0;
        else
                ((struct sockaddr_in6 *)&src)->sin6_port = 0;
        if (dst.ss_family == AF_INET)
                ((struct sockaddr_in *)&dst)->sin_port = htons((uint16_t)w.rdma_port);
        else
                ((struct sockaddr_in6 *)&dst)->sin6_port = htons((uint16_t)w.rdma_port);
        c->ec = rdma_create_event_channel();
        if (!c->ec || rdma_create_id(c->ec, &c->id, NULL, RDMA_PS_TCP))
                return kvf_err_set(-errno, "rdma_cm: %s", strerror(errno));
        struct rdma_cm_event *ev;
        if (rdma_resolve_addr(c->id, (struct sockaddr *)&src, (struct sockaddr *)&dst, (int)to))
                return kvf_err_set(-errno, "rdma_resolve_addr to %s: %s", host, strerror(errno));
        if ((rc = rdma_cm_wait(c->ec, RDMA_CM_EVENT_ADDR_RESOLVED, to + 500, &ev)) < 0)
                return kvf_err_ctx(rc, "rdma to %s", host);
        rdma_ack_cm_event(ev);
        if (rdma_resolve_route(c->id, (int)to))
                return kvf_err_set(-errno, "rdma_resolve_route to %s: %s", host, strerror(errno));
        if ((rc = rdma_cm_wait(c->ec, RDMA_CM_EVENT_ROUTE_RESOLVED, to + 500, &ev)) < 0)
                return kvf_err_ctx(rc, "rdma to %s", host);
        rdma_ack_cm_event(ev);
        struct ibv_context *ctx = c->id->verbs;
        if ((rc = rdma_local_mrs(cn, ctx, &c->pd, &c->lm)) < 0)
                return rc;
        /* Blocks not back to back on either side (the engine's blocks-first views): a work
         * request per block, as for head slices, each its whole block. */
        kvf_cache_hold(&cn->cache);
        bool lstrided = strided(&cn->cache);
        kvf_cache_release(&cn->cache);
        bool rstrided = strided(&c->rcache);
        if (!c->slen && !c->plan.npieces && (lstrided || rstrided)) {
                c->slen = (uint32_t)me->layout.block_bytes;
                kvf_info("rdma to '%s': the blocks of %s are not back to back: a work request per block",
                         p->name, rstrided ? "the peer's cache" : "this cache");
        }

        /* The send queue: as deep as asked, as deep as the device allows. */
        struct ibv_device_attr da;
        c->depth = cn->cfg.rdma.sq_depth;
        if (ibv_query_device(ctx, &da) == 0 && da.max_qp_wr > 0 && (unsigned)da.max_qp_wr < c->depth)
                c->depth = (unsigned)da.max_qp_wr;
        c->sig = cn->cfg.rdma.signal_every;
        if (c->sig > c->depth / 2)
                c->sig = c->depth / 2 ? c->depth / 2 : 1; /* a signal in every half queue */
        c->cc = ibv_create_comp_channel(ctx);
        c->cq = c->cc ? ibv_create_cq(ctx, (int)c->depth + 8, NULL, c->cc, 0) : NULL;
        if (!c->cq)
                return kvf_err_set(-errno, "ibv_create_cq: %s", strerror(errno));
        struct ibv_qp_init_attr qa = {.send_cq = c->cq, .recv_cq = c->cq,
                                      .cap = {.max_send_wr = c->depth, .max_recv_wr = 1,
                                              .max_send_sge = 1, .max_recv_sge = 1},
                                      .qp_type = IBV_QPT_RC,
                                      .sq_sig_all = 0}; /* selective signalling */
        if (rdma_create_qp(c->id, c->pd, &qa))
                return kvf_err_set(-errno, "rdma_create_qp (%u work requests): %s", c->depth, strerror(errno));
        c->msgs = calloc(c->depth, sizeof(*c->msgs));
        c->slots = calloc(c->depth, sizeof(*c->slots));
        c->wrs = calloc(c->depth, sizeof(*c->wrs));
        c->sges = calloc(c->depth, sizeof(*c->sges));
        c->msg_mr = c->msgs ? ibv_reg_mr(c->pd, c->msgs, c->depth * sizeof(*c->msgs), IBV_ACCESS_LOCAL_WRITE) : NULL;
        if (!c->slots || !c->wrs || !c->sges || !c->msg_mr)
                return kvf_err_set(-ENOMEM, "out of memory for the send queue");
        if (cn->cfg.rdma.ack_timeout) {
                uint8_t t = (uint8_t)cn->cfg.rdma.ack_timeout;
                if (rdma_set_option(c->id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &t, sizeof(t)))
                        return kvf_err_set(-errno, "rdma ack timeout %u: %s", t, strerror(errno));
        }
        struct rdma_conn_param cp = {.private_data = w.rdma_ticket, .private_data_len = RDMA_TICKET_LEN,
                                     .responder_resources = 0, .initiator_depth = 0,
                                     .retry_count = 7, .rnr_retry_count = 7};
        if (rdma_connect(c->id, &cp))
                return kvf_err_set(-errno, "rdma_connect to %s: %s", host, strerror(errno));
        if ((rc = rdma_cm_wait(c->ec, RDMA_CM_EVENT_ESTABLISHED, 2 * to, &ev)) < 0)
                return kvf_err_ctx(rc, "rdma to %s", host);
        rdma_ack_cm_event(ev);
        if (ibv_req_notify_cq(c->cq, 0))
                return kvf_err_set(-errno, "ibv_req_notify_cq: %s", strerror(errno));
        kvf_info("rdma to '%s' (instance %s) on %s: region of %llu bytes, send queue %u deep, a signal every %u",
                 p->name, id.instance, ibv_get_device_name(ctx->device), (unsigned long long)c->rlen,
                 c->depth, c->sig);
        pthread_mutex_lock(&xp->mu);
        xfer_set_remote_blocks(xp, id.layout.num_blocks);
        pthread_mutex_unlock(&xp->mu);
        return 0;
}

/* ---- posting ---- */

/* xp->mu held: the next transfer whose done message is due on this connection: noticed,
 * none of its frames queued (those in the send queue go before it, in order). */
static struct xfer *done_due(struct rconn *c)
{
        struct rdma_peer *rp = c->xp->tp;
        for (struct rdma_xfer *rx = rp->noticed; rx; rx = rx->next)
                if (!rx->x->dead && rx->done_conn != c->no && (rx->fail_status || rx->x->queued == 0))
                        return rx->x;
        return NULL;
}

/* xp->mu held: each piece of regrouped frame f (its source blocks at positions index..) lands
 * inside the peer's block it goes to. False if not (its transfer failed). */
static bool check_pieces(struct rconn *c, struct frame *f)
{
        struct xfer *x = f->x;
        uint32_t dpos;
        for (uint32_t k = 0; k < f->nblocks; k++)
                for (uint32_t i = 0; kvf_tp_piece_next(&c->plan, f->index + k, x->n_dst, &i, &dpos); i++) {
                        const struct kvf_tp_piece *pc = &c->plan.pieces[i];
                        uint32_t d = x->dst[dpos];
                        if (d >= c->rlay.num_blocks || (uint64_t)pc->doff + pc->bytes > c->rlay.block_bytes ||
                            kvf_layout_offset(&c->rlay, f->layer, f->tensor, d) + pc->doff + pc->bytes > c->rlen) {
                                xfer_fail_one(c->xp, x, KVF_STATUS_BLOCK_RANGE,
                                              "destination blocks beyond the peer's cache");
                                return false;
                        }
                }
        return true;
}

/* Regrouped frame f: from block cur_k's piece cur_x on, the next piece that goes (true, with
 * cur_k, cur_x and its destination position in *dpos), or none is left. */
static bool piece_at(struct rconn *c, const struct frame *f, uint32_t *dpos)
{
        for (; c->cur_k < f->nblocks; c->cur_k++, c->cur_x = 0)
                if (kvf_tp_piece_next(&c->plan, f->index + c->cur_k, f->x->n_dst, &c->cur_x, dpos))
                        return true;
        return false;
}

/* xp->mu held: may frame f go? One-sided: nothing on the other side checks a write, so every
 * one is checked here: a run contiguous in destination ids, inside the peer's region (a head
 * slice's bytes inside the last block's). False if not (its transfer failed). */
static bool check_write(struct rconn *c, struct frame *f)
{
        struct xfer_peer *xp = c->xp;
        struct xfer *x = f->x;
        char why[KVF_REASON_MAX];
        if (xfer_regroup_mismatch(xp, x, c->rlay.block_size, c->plan.npieces != 0, why, sizeof(why))) {
                kvf_errlog(&xp->p->cn->ctl, KVF_ROLE_CONNECTOR, "%s", why);
                xfer_fail_one(xp, x, KVF_STATUS_LAYOUT_MISMATCH, why);
                return false;
        }
        if (c->plan.npieces)
                return check_pieces(c, f);
        uint32_t d0 = x->dst[f->index];
        for (uint32_t k = 1; k < f->nblocks; k++)
                if (x->dst[f->index + k] != d0 + k) {
                        xfer_fail_one(xp, x, KVF_STATUS_WRITE,
                                      "a run over destination blocks that are not contiguous");
                        return false;
                }
        uint64_t end;
        if (c->slen)
                end = kvf_layout_offset(&c->rlay, f->layer, f->tensor, d0 + f->nblocks - 1) + c->doff +
                      c->slen;
        else
                end = kvf_layout_offset(&c->rlay, f->layer, f->tensor, d0) + xfer_frame_bytes(xp, f);
        if (d0 + (uint64_t)f->nblocks > c->rlay.num_blocks || end > c->rlen ||
            (c->slen && (uint64_t)c->doff + c->slen > c->rlay.block_bytes)) {
                xfer_fail_one(xp, x, KVF_STATUS_BLOCK_RANGE, "destination blocks beyond the peer's cache");
                return false;
        }
        return true;
}

/* Regrouped frame f: piece cur_x of its source block k (consecutive in the source) into the
 * destination block at position dpos: its byte in this cache, in the peer's, and its length. */
static void piece_addr(const struct rconn *c, const struct frame *f, uint32_t k, uint32_t dpos, uint64_t *src,
                       uint64_t *roff, uint64_t *len)
{
        const struct connector *cn = c->xp->p->cn;
        const struct kvf_tp_piece *pc = &c->plan.pieces[c->cur_x];
        *src = f->src_off + (uint64_t)k * kvf_layout_tensor_bytes(&cn->ctl.hdr->layout, f->tensor) + pc->soff;
        *roff = kvf_layout_offset(&c->rlay, f->layer, f->tensor, f->x->dst[dpos]) + pc->doff;
        *len = pc->bytes;
}

/* Work request i: the write of len bytes from byte src of this cache to byte roff of the
 * peer's (both in their layouts' order, checked, contiguous on both sides), with the keys of
 * the regions that hold them. The cache's mapping is held (post_some). */
static void set_write(struct rconn *c, unsigned i, uint64_t src, uint64_t roff, uint64_t len)
{
        struct connector *cn = c->xp->p->cn;
        uint32_t rkey;
        c->sges[i] = (struct ibv_sge){.addr = (uintptr_t)kvf_cache_addr(&cn->cache, src), .length = (uint32_t)len,
                                      .lkey = rdma_mrs_at(c->lm, src)->lkey};
        c->wrs[i] = (struct ibv_send_wr){.opcode = IBV_WR_RDMA_WRITE, .sg_list = &c->sges[i], .num_sge = 1};
        c->wrs[i].wr.rdma.remote_addr = remote_at(c, roff, &rkey);
        c->wrs[i].wr.rdma.rkey = rkey;
}

/* Does the write of len bytes from src to roff continue work request i on both sides (same
 * regions, the bytes right after its own)? */
static bool continues(const struct rconn *c, unsigned i, uint64_t src, uint64_t roff, uint64_t len)
{
        const struct connector *cn = c->xp->p->cn;
        uint32_t rkey;
        uint64_t ra = remote_at(c, roff, &rkey);
        return (uintptr_t)kvf_cache_addr(&cn->cache, src) == c->sges[i].addr + c->sges[i].length &&
               rdma_mrs_at(c->lm, src)->lkey == c->sges[i].lkey &&
               ra == c->wrs[i].wr.rdma.remote_addr + c->sges[i].length && rkey == c->wrs[i].wr.rdma.rkey &&
               c->sges[i].length + len <= RDMA_WRITE_MAX;
}

/* xp->mu held: fill work request i with the write of frame f (checked): the whole run; to a
 * rank of another split (or blocks not back to back), block k's head slice (its whole block);
 * to a peer of another block size, piece cur_x of block k into the destination block at
 * position dpos. */
static void fill_write(struct rconn *c, unsigned i, struct frame *f, uint32_t k, uint32_t dpos)
{
        struct connector *cn = c->xp->p->cn;
        uint64_t src = f->src_off, len = xfer_frame_bytes(c->xp, f);
        uint64_t roff = kvf_layout_offset(&c->rlay, f->layer, f->tensor, f->x->dst[f->index]);
        if (c->plan.npieces) {
                piece_addr(c, f, k, dpos, &src, &roff, &len);
        } else if (c->slen) {
                /* A frame's blocks are consecutive in the source and (checked) the destination. */
                src += (uint64_t)k * kvf_layout_tensor_bytes(&cn->ctl.hdr->layout, f->tensor) + c->soff;
                roff += (uint64_t)k * kvf_layout_tensor_bytes(&c->rlay, f->tensor) + c->doff;
                len = c->slen;
        }
        set_write(c, i, src, roff, len);
}

/* xp->mu held: fill work request i with x's done message (slot s). */
static void fill_done(struct rconn *c, unsigned i, unsigned s, struct xfer *x)
{
        struct rdma_xfer *rx = x->tp;
        c->msgs[s] = (struct rdma_done_msg){.magic = htonl(RDMA_DONE_MAGIC),
                                            .status = htons((uint16_t)rx->fail_status),
                                            .wc_status = htons((uint16_t)rx->fail_wc),
                                            .key = htobe64(x->key), .session = htobe64(x->session)};
        c->sges[i] = (struct ibv_sge){.addr = (uintptr_t)&c->msgs[s], .length = sizeof(c->msgs[s]),
                                      .lkey = c->msg_mr->lkey};
        c->wrs[i] = (struct ibv_send_wr){.opcode = IBV_WR_SEND, .sg_list = &c->sges[i], .num_sge = 1};
}

/* xp->mu held: slot sl holds a write of c->cur's frame f, the last of it (the slot owns the
 * frame) or one before its last (f's transfer held; the frame stays c->cur's). */
static void slot_own(struct rconn *c, struct slot *sl, struct frame *f, bool last)
{
        sl->f = f;
        if (last) {
                c->cur = NULL;
        } else {
                sl->part = true;
                sl->x = f->x;
                xfer_hold(f->x);
        }
}

/* xp->mu held: slot s is finished: its frame sent (or given back), its done message let go. */
static void slot_end(struct rconn *c, uint64_t seq, bool sent)
{
        struct xfer_peer *xp = c->xp;
        struct slot *sl = &c->slots[seq % c->depth];
        if (sl->part) {
                xfer_release(xp, sl->x); /* (the frame's last slice decides what becomes of it) */
        } else if (sl->f) {
                xfer_give_back(xp, &sl->f, 1, sent);
        } else if (sl->x) {
                struct rdma_xfer *rx = sl->x->tp;
                if (!sl->x->dead && !sent)
                        rx->done_conn = 0; /* goes again */
                if (!sl->x->dead && sent && !rx->fail_status)
                        rx->done_ok = true;
                xfer_release(xp, sl->x);
        }
        *sl = (struct slot){0};
}

/* The engine's caches were registered anew since this connection registered them (or this
 * process has not mapped the new ones yet): its regions are not the cache's memory now. */
static bool local_stale(const struct rconn *c)
{
        const struct connector *cn = c->xp->p->cn;
        return rdma_mrs_stale(cn, c->lm) ||
               (cn->cache.be->id == KVF_BACKEND_ENGINE && c->lm->reg_gen != cn->cache.reg_gen);
}

/*
 * Post what fits in the send queue as one chain: queued frames first, then
 * the done messages now due. Signalled: every sig-th work request, and the
 * last of each chain, so that the completion of everything posted is always
 * seen (what follows a chain may never come: frames skipped, transfers
 * forgotten meanwhile). Returns the work requests posted, or -errno when the
 * queue pair is broken.
 */
static int post_some(struct rconn *c)
{
        struct xfer_peer *xp = c->xp;
        struct connector *cn = xp->p->cn;
        unsigned room = c->depth - (unsigned)(c->next_seq - c->done_seq), n = 0, writes = 0;
        uint64_t bytes = 0, blocks = 0;

        /* The addresses come from the cache's mapping: the one this connection registered. */
        kvf_cache_hold(&cn->cache);
        if (local_stale(c)) {
                kvf_cache_release(&cn->cache);
                return -ESTALE;
        }
        pthread_mutex_lock(&xp->mu);
        while (n < room) {
                uint64_t seq = c->next_seq + n;
                struct slot *sl = &c->slots[seq % c->depth];
                struct frame *f = c->cur;
                if (f && (f->x->dead || ((struct rdma_xfer *)f->x->tp)->fail_status ||
                          xfer_session_over(xp, f->x))) {
                        /* Its transfer ended or failed, or its engine went, between two of its
                         * slices: the rest is not written (as below). */
                        xfer_give_back(xp, &c->cur, 1, true);
                        c->cur = NULL;
                        continue;
                }
                if (!f && (f = xp->qhead ? xfer_dequeue(xp, 0) : NULL)) {
                        if (((struct rdma_xfer *)f->x->tp)->fail_status) {
                                /* A write of it failed after its notice went out: nothing more
                                 * of it is written (the decode engine frees its blocks on the
                                 * error arrival); its done message says why. */
                                xfer_give_back(xp, &f, 1, true);
                                continue;
                        }
                        if (xfer_session_over(xp, f->x)) {
                                /* The decode engine that reserved its blocks is gone: they may
                                 * be another request's now. Never written; the decode side
                                 * answers its notice "engine gone". */
                                xfer_give_back(xp, &f, 1, true);
                                continue;
                        }
                        if (!check_write(c, f)) {
                                xfer_give_back(xp, &f, 1, true); /* (its transfer failed: freed) */
                                continue;
                        }
                        if (c->slen || c->plan.npieces) {
                                c->cur = f;
                                c->cur_k = c->cur_x = 0;
                        }
                }
                uint32_t dpos = 0;
                if (f && c->plan.npieces && !piece_at(c, f, &dpos)) {
                        /* No piece of it goes (its blocks hold no token of the request's
                         * destination blocks): done, as if written. */
                        xfer_give_back(xp, &c->cur, 1, true);
                        c->cur = NULL;
                        continue;
                }
                if (f && c->plan.npieces) {
                        /* A work request per piece, and the pieces after it that continue it
                         * on both sides (a head's rows whose next piece follows it in both
                         * caches: one head per rank, MLA's latent, consecutive block ids). */
                        fill_write(c, n, f, c->cur_k, dpos);
                        c->cur_x++;
                        uint64_t src, roff, len;
                        while (piece_at(c, f, &dpos)) {
                                piece_addr(c, f, c->cur_k, dpos, &src, &roff, &len);
                                if (!continues(c, n, src, roff, len))
                                        break;
                                c->sges[n].length += (uint32_t)len;
                                blocks++;
                                c->cur_x++;
                        }
                        slot_own(c, sl, f, !piece_at(c, f, &dpos));
                        blocks++;
                        bytes += c->sges[n].length;
                        writes++;
                } else if (f) {
                        if (!c->slen) {
                                fill_write(c, n, f, 0, 0);
                                sl->f = f;
                                blocks += f->nblocks;
                        } else {
                                /* One work request per block's head slice: slices of consecutive
                                 * blocks are never contiguous (a slice shorter than its block). */
                                fill_write(c, n, f, c->cur_k++, 0);
                                slot_own(c, sl, f, c->cur_k == f->nblocks);
                                blocks++;
                        }
                        bytes += c->sges[n].length;
                        writes++;
                } else {
                        struct xfer *x = done_due(c);
                        if (!x)
                                break;
                        ((struct rdma_xfer *)x->tp)->done_conn = c->no;
                        xfer_hold(x);
                        sl->x = x;
                        fill_done(c, n, (unsigned)(seq % c->depth), x);
                }
                c->wrs[n].wr_id = seq;
                if (n > 0)
                        c->wrs[n - 1].next = &c->wrs[n];
                n++;
        }
        bool qroom = xfer_has_room(xp);
        pthread_mutex_unlock(&xp->mu);
        kvf_cache_release(&cn->cache);
        xfer_room(xp, qroom);
        if (n == 0)
                return 0;
        unsigned signalled = 0;
        for (unsigned i = 0; i < n; i++) {
                uint64_t seq = c->next_seq + i;
                if ((seq + 1) % c->sig == 0 || i + 1 == n) {
                        c->wrs[i].send_flags = IBV_SEND_SIGNALED;
                        signalled++;
                }
        }
        c->wrs[n - 1].next = NULL;
        /* Counted before the post: once posted, the transfer may complete (and its engine read
         * these counters) before this thread runs again. (A post that takes fewer, never
         * expected, leaves them counted: rdma_post_errors says so.) */
        kvf_count(&cn->ctl, KVF_CTR_RDMA_POSTS, 1);
        kvf_count(&cn->ctl, KVF_CTR_RDMA_WRITES, writes);
        kvf_count(&cn->ctl, KVF_CTR_RDMA_SENDS, n - writes);
        kvf_count(&cn->ctl, KVF_CTR_RDMA_SIGNALLED, signalled);
        kvf_count(&cn->ctl, KVF_CTR_BYTES_RDMA, bytes);
        kvf_count(&cn->ctl, KVF_CTR_BLOCKS_RDMA, blocks);
        struct ibv_send_wr *bad = NULL;
        int rc = ibv_post_send(c->id->qp, c->wrs, &bad);
        unsigned posted = n;
        if (rc) {
                /* Never expected (the queue's room is counted): what was not taken goes back. */
                posted = bad ? (unsigned)(bad - c->wrs) : 0;
                kvf_count(&cn->ctl, KVF_CTR_RDMA_POST_ERRORS, 1);
                pthread_mutex_lock(&xp->mu);
                if (c->cur) {
                        /* Slices of it may be among those not taken: all of it goes again (after
                         * the frames before it, given back below to the queue's front). */
                        xfer_give_back(xp, &c->cur, 1, false);
                        c->cur = NULL;
                }
                pthread_mutex_unlock(&xp->mu);
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR,
                           "rdma to '%s': ibv_post_send took %u of %u work requests: %s (%d outstanding of %u)",
                           xp->p->name, posted, n, strerror(rc), (int)(c->next_seq - c->done_seq), c->depth);
                pthread_mutex_lock(&xp->mu);
                for (unsigned i = n; i-- > posted;)
                        slot_end(c, c->next_seq + i, false);
                pthread_mutex_unlock(&xp->mu);
        }
        c->next_seq += posted;
        if (rc && posted == 0)
                return -rc;
        return (int)posted;
}

/*
 * Take what the completion queue has. A successful completion completes
 * every work request posted before it (one send queue, in order). An error
 * names one work request: those before it completed; its own transfer fails
 * "write error" unless the status says the link or the peer is gone; the
 * queue pair is dead (-EIO). Returns completions taken, or -EIO.
 */
static int take_completions(struct rconn *c, char *why, size_t whylen)
{
        struct xfer_peer *xp = c->xp;
        struct connector *cn = xp->p->cn;
        struct ibv_wc wc[32];
        int n, total = 0, rc = 0;
        while (rc == 0 && (n = ibv_poll_cq(c->cq, 32, wc)) > 0) {
                total += n;
                pthread_mutex_lock(&xp->mu);
                for (int i = 0; i < n && rc == 0; i++) {
                        uint64_t seq = wc[i].wr_id;
                        if (seq < c->done_seq || seq >= c->next_seq) {
                                snprintf(why, whylen, "a completion for work request %llu, not outstanding",
                                         (unsigned long long)seq);
                                rc = -EIO;
                                break;
                        }
                        while (c->done_seq < seq)
                                slot_end(c, c->done_seq++, true);
                        if (wc[i].status == IBV_WC_SUCCESS) {
                                slot_end(c, c->done_seq++, true);
                                c->last_done_ns = kvf_now_ns();
                                continue;
                        }
                        struct slot *sl = &c->slots[seq % c->depth];
                        struct xfer *x = sl->f ? sl->f->x : sl->x;
                        kvf_count(&cn->ctl, KVF_CTR_RDMA_COMPLETION_ERRORS, 1);
                        if (rdma_wc_is_link(wc[i].status) || !x || x->dead) {
                                snprintf(why, whylen, "%s", rdma_wc_str(wc[i].status));
                        } else {
                                char reason[KVF_REASON_MAX];
                                if (sl->f)
                                        snprintf(reason, sizeof(reason),
                                                 "rdma write of layer %u tensor %u, %u blocks, to '%s' failed: %s (vendor error 0x%x)",
                                                 sl->f->layer, sl->f->tensor, sl->f->nblocks, xp->p->name,
                                                 rdma_wc_str(wc[i].status), wc[i].vendor_err);
                                else
                                        snprintf(reason, sizeof(reason),
                                                 "rdma done message to '%s' failed: %s (vendor error 0x%x)",
                                                 xp->p->name, rdma_wc_str(wc[i].status), wc[i].vendor_err);
                                snprintf(why, whylen, "%s", reason);
                                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "req %s: %s", x->request_id, reason);
                                struct rdma_xfer *rx = x->tp;
                                if (!x->noticed)
                                        xfer_fail_one(xp, x, KVF_STATUS_WRITE, reason);
                                else if (!rx->done_ok)
                                        /* Its notice is out: only the notice's answer may end it.
                                         * Its done message will tell the peer to answer "write
                                         * error" (the peer cannot have published it: its done
                                         * message never landed). */
                                {
                                        rx->fail_status = KVF_STATUS_WRITE;
                                        rx->fail_wc = (int)wc[i].status;
                                }
                                /* (done_ok: the peer had every byte once; this was a resend) */
                        }
                        slot_end(c, c->done_seq++, false);
                        rc = -EIO;
                }
                pthread_mutex_unlock(&xp->mu);
        }
        if (rc == 0 && n < 0) {
                snprintf(why, whylen, "ibv_poll_cq failed");
                rc = -EIO;
        }
        return rc < 0 ? rc : total;
}

/* This instance's engine caches were registered anew: what is not yet written of a transfer
 * opened before would come from memory that holds no request's computation. Every such
 * transfer the peer has not had whole ends "engine gone": now, or (its notice out) by its done
 * message, which tells the peer to answer so; nothing more of it is written. (One whose done
 * message completed stays finished: its bytes came from the memory it was computed in. One
 * opened since goes on the next connection, which registers the new memory.) */
static void give_up_stale(struct rconn *c, const char *why)
{
        struct xfer_peer *xp = c->xp;
        const uint64_t now = kvf_load_acquire(&xp->p->cn->ctl.hdr->reg_generation);
        pthread_mutex_lock(&xp->mu);
        for (struct xfer *x = xp->xfers, *nx; x; x = nx) {
                nx = x->next;
                struct rdma_xfer *rx = x->tp;
                if (x->dead || rx->done_ok || x->reg_gen == now)
                        continue;
                if (!x->noticed) {
                        xfer_fail_one(xp, x, KVF_STATUS_ENGINE_GONE, why);
                } else if (!rx->fail_status) {
                        rx->fail_status = KVF_STATUS_ENGINE_GONE;
                        rx->fail_wc = 0;
                }
        }
        pthread_mutex_unlock(&xp->mu);
}

/* Connected: post, complete, wait. Returns why it ended. */
static int serve(struct rconn *c, char *why, size_t whylen)
{
        struct xfer_peer *xp = c->xp;
        struct rdma_peer *rp = xp->tp;
        struct connector *cn = xp->p->cn;
        uint64_t dead = kvf_ms(cn->cfg.peer_timeout_ms);
        c->last_done_ns = kvf_now_ns();
        while (!xfer_stopping(xp)) {
                /* The completion clock runs from the oldest work request outstanding. */
                if (c->next_seq == c->done_seq)
                        c->last_done_ns = kvf_now_ns();
                int posted = post_some(c);
                if (posted == -ESTALE) {
                        /* (The connection goes; the next registers the new memory.) */
                        snprintf(why, whylen, "the engine's caches of '%s' were registered anew during the "
                                 "transfer", cn->ctl.hdr->instance);
                        give_up_stale(c, why);
                        return posted;
                }
                if (posted < 0) {
                        snprintf(why, whylen, "ibv_post_send: %s", strerror(-posted));
                        return posted;
                }
                int done = take_completions(c, why, whylen);
                if (done < 0)
                        return done;
                if (posted > 0 || done > 0)
                        continue;
                bool outstanding = c->next_seq != c->done_seq;
                if (outstanding && kvf_elapsed(kvf_now_ns(), c->last_done_ns) > dead) {
                        snprintf(why, whylen, "no completion for %u ms", cn->cfg.peer_timeout_ms);
                        return -ETIMEDOUT;
                }
                /* Nothing to do: sleep until a completion, new work, the peer's end. */
                struct pollfd pf[4] = {{.fd = c->cc->fd, .events = POLLIN},
                                       {.fd = rp->wake_fd, .events = POLLIN},
                                       {.fd = c->ec->fd, .events = POLLIN},
                                       {.fd = c->fd, .events = POLLIN}};
                if (poll(pf, 4, CONN_POLL_MS) < 0 && errno != EINTR) {
                        snprintf(why, whylen, "poll: %s", strerror(errno));
                        return -errno;
                }
                if (pf[0].revents) {
                        struct ibv_cq *cq;
                        void *ctx;
                        if (ibv_get_cq_event(c->cc, &cq, &ctx) == 0)
                                c->cq_events++;
                        if (ibv_req_notify_cq(c->cq, 0)) {
                                snprintf(why, whylen, "ibv_req_notify_cq failed");
                                return -EIO;
                        }
                }
                if (pf[1].revents)
                        drain_wake(rp);
                if (pf[2].revents) {
                        struct rdma_cm_event *ev;
                        if (rdma_get_cm_event(c->ec, &ev) == 0) {
                                enum rdma_cm_event_type t = ev->event;
                                rdma_ack_cm_event(ev);
                                if (t == RDMA_CM_EVENT_DISCONNECTED || t == RDMA_CM_EVENT_DEVICE_REMOVAL) {
                                        snprintf(why, whylen, "%s", rdma_event_str(t));
                                        return -ECONNRESET;
                                }
                        }
                }
                if (pf[3].revents) {
                        /* The decode side never writes on the anchor: its end is the peer's. */
                        char b;
                        ssize_t r = recv(c->fd, &b, 1, MSG_DONTWAIT);
                        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
                                snprintf(why, whylen, "the tcp anchor closed");
                                return -ECONNRESET;
                        }
                }
        }
        snprintf(why, whylen, "stopping");
        return 0;
}

/* The connection ended: what it had not completed goes again, and so does what it sent
 * (the peer may have lost it: a restarted decode connector knows nothing of it). */
static void give_all_back(struct rconn *c)
{
        struct xfer_peer *xp = c->xp;
        pthread_mutex_lock(&xp->mu);
        if (c->cur) {
                /* Partly posted: all of it goes again, after what was posted before it. */
                xfer_give_back(xp, &c->cur, 1, false);
                c->cur = NULL;
        }
        while (c->next_seq != c->done_seq)
                slot_end(c, --c->next_seq, false); /* (last first: the queue keeps its order) */
        xfer_requeue_conn(xp, 0);
        pthread_mutex_unlock(&xp->mu);
}

static void *rdma_main(void *arg)
{
        struct xfer_peer *xp = arg;
        struct rdma_peer *rp = xp->tp;
        struct peer *p = xp->p;
        struct connector *cn = p->cn;
        struct rdma_state *st = rdma_state(cn);
        unsigned backoff_ms = 50;
        uint64_t failing_since = 0;
        char why[KVF_REASON_MAX];

        while (!xfer_stopping(xp)) {
                /* Connect only while there are transfers to carry. */
                pthread_mutex_lock(&xp->mu);
                bool idle = xp->nxfers == 0;
                pthread_mutex_unlock(&xp->mu);
                if (idle) {
                        struct pollfd pf = {.fd = rp->wake_fd, .events = POLLIN};
                        poll(&pf, 1, CONN_POLL_MS);
                        drain_wake(rp);
                        continue;
                }
                struct rconn c = {.xp = xp, .fd = -1, .no = ++rp->conns};
                int status = KVF_STATUS_CONNECTION;
                int rc = st->no_cache[0] ? kvf_err_set(-EPROTONOSUPPORT, "%s", st->no_cache)
                                         : rconn_open(&c, &status);
                if (rc < 0) {
                        snprintf(why, sizeof(why), "rdma to '%s': %s", p->name, kvf_err_msg());
                        rconn_close(&c);
                        uint64_t now = kvf_now_ns();
                        if (!failing_since)
                                failing_since = now;
                        /* The peer refuses rdma (or cannot be had at all), or we have been failing
                         * past the peer timeout: the transfers not yet noticed fail now; the
                         * control connection handles the rest (as for tcp). */
                        bool permanent = status != KVF_STATUS_CONNECTION || rc == -EACCES ||
                                         rc == -EPROTONOSUPPORT || rc == -EPROTO || rc == -ENODEV;
                        if (status == KVF_STATUS_ENGINE_GONE || rc == -ENODATA) {
                                /* The engine's caches, here or there, are not registered: no
                                 * byte of any transfer can land, those noticed included; for
                                 * now only: later ones try again. */
                                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "%s", why);
                                conn_xfer_fail_all(xp, KVF_STATUS_ENGINE_GONE, why);
                        } else if (permanent) {
                                /* Retrying will not help: fail the transfers, and those
                                 * opened after them at their open (until the peer is
                                 * connected anew), not after the request's timeout. */
                                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "%s", why);
                                if (status == KVF_STATUS_LAYOUT_MISMATCH)
                                        /* (Another split this pair cannot carry, as for tcp: no
                                         * byte can land, so noticed transfers fail too.) */
                                        conn_xfer_refuse_all(xp, status, why);
                                else
                                        conn_xfer_refuse(xp, status, why);
                        } else if (kvf_elapsed(now, failing_since) > kvf_ms(cn->cfg.peer_timeout_ms)) {
                                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "%s", why);
                                conn_xfer_fail_transport(xp, status, why, kvf_ms(cn->cfg.peer_timeout_ms));
                        } else {
                                kvf_debug("%s", why);
                        }
                        struct pollfd pf = {.fd = rp->wake_fd, .events = POLLIN};
                        poll(&pf, 1, (int)backoff_ms);
                        drain_wake(rp);
                        backoff_ms = backoff_ms * 2 > 1000 ? 1000 : backoff_ms * 2;
                        continue;
                }
                backoff_ms = 50;
                failing_since = 0;
                rc = serve(&c, why, sizeof(why));
                if (rc < 0)
                        kvf_warn("rdma to '%s' lost: %s", p->name, why);
                rdma_disconnect(c.id);
                give_all_back(&c);
                rconn_close(&c);
        }
        return NULL;
}

int rdma_peer_init(struct xfer_peer *xp)
{
        struct rdma_peer *rp = calloc(1, sizeof(*rp));
        if (!rp)
                return -ENOMEM;
        rp->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (rp->wake_fd < 0) {
                free(rp);
                return -errno;
        }
        xp->tp = rp;
        return 0;
}

void rdma_start(struct xfer_peer *xp)
{
        struct rdma_peer *rp = xp->tp;
        pthread_mutex_lock(&xp->mu);
        if (!rp->started && !xp->stop && pthread_create(&rp->thread, NULL, rdma_main, xp) == 0)
                rp->started = true;
        pthread_mutex_unlock(&xp->mu);
}

void rdma_stop(struct xfer_peer *xp)
{
        struct rdma_peer *rp = xp->tp;
        wake(rp);
        pthread_mutex_lock(&xp->mu);
        bool started = rp->started;
        pthread_mutex_unlock(&xp->mu);
        if (started)
                pthread_join(rp->thread, NULL);
}

void rdma_peer_free(struct xfer_peer *xp)
{
        struct rdma_peer *rp = xp->tp;
        close(rp->wake_fd);
        free(rp);
        xp->tp = NULL;
}
