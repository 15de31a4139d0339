/*
 * Outgoing network transfers, whatever the transport (see xfer.h).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "atomics.h"
#include "clock.h"
#include "doorbell.h"
#include "err.h"
#include "layout.h"
#include "log.h"
#include "tpsplit.h"
#include "xfer.h"

uint64_t xfer_frame_bytes(const struct xfer_peer *xp, const struct frame *f)
{
        return (uint64_t)f->nblocks * kvf_layout_tensor_bytes(&xp->p->cn->ctl.hdr->layout, f->tensor);
}

static void post_result(struct connector *cn, const struct xfer *x, int status, const char *reason)
{
        conn_post_write_result(cn, x->key, x->request_id, x->id_bin, status, reason);
}

/* xp->mu held: x is failed here (its result is posted): remember it for conn_xfer_noticed. */
static void remember_failed(struct xfer_peer *xp, uint64_t key, uint64_t gen, int status,
                            const char *reason)
{
        struct xfer_failed *f = &xp->failed[xp->nfailed++ % XFER_FAILED_KEPT];
        f->key = key;
        f->peer_gen = gen;
        f->status = status;
        snprintf(f->reason, sizeof(f->reason), "%s", reason);
}

/* xp->mu held: the failed transfer of `key` this connector still remembers, or NULL. */
static const struct xfer_failed *failed_of(const struct xfer_peer *xp, uint64_t key)
{
        const struct xfer_failed *f = NULL;
        unsigned n = xp->nfailed < XFER_FAILED_KEPT ? xp->nfailed : XFER_FAILED_KEPT;
        for (unsigned k = 0; k < n; k++)
                if (xp->failed[k].key == key)
                        f = &xp->failed[k];
        return f;
}

static void fail_xfer(struct xfer_peer *xp, const struct xfer *x, int status, const char *reason)
{
        remember_failed(xp, x->key, x->peer_gen, status, reason);
        post_result(xp->p->cn, x, status, reason);
}

void xfer_wait(struct xfer_peer *xp)
{
        struct timespec ts = kvf_ts_after(CLOCK_REALTIME, kvf_ms(CONN_POLL_MS));
        pthread_cond_timedwait(&xp->cv, &xp->mu, &ts);
}

bool xfer_stopping(struct xfer_peer *xp)
{
        return kvf_load_acquire(&xp->stop) || conn_stopping(xp->p->cn);
}

static struct xfer *find(struct xfer_peer *xp, uint64_t key)
{
        for (struct xfer *x = xp->xfers; x; x = x->next)
                if (x->key == key && !x->dead)
                        return x;
        return NULL;
}

static void free_xfer(struct xfer_peer *xp, struct xfer *x)
{
        for (uint32_t i = 0; i < x->nfr; i++)
                free(x->fr[i]);
        free(x->fr);
        free(x->dst);
        if (x->tp && xp->t->xfer_free)
                xp->t->xfer_free((struct xfer_peer *)xp, x);
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

/* Unlink from the list and the queue; free now, or when the data paths give its frames back. */
static void drop(struct xfer_peer *xp, struct xfer *x)
{
        for (struct xfer **pp = &xp->xfers; *pp; pp = &(*pp)->next)
                if (*pp == x) {
                        *pp = x->next;
                        break;
                }
        xp->nxfers--;
        struct frame **qp = &xp->qhead, *f;
        xp->qtail = NULL;
        while ((f = *qp)) {
                if (f->x == x) {
                        *qp = f->qnext;
                        xp->qbytes -= xfer_frame_bytes(xp, f);
                        x->queued--;
                        continue;
                }
                xp->qtail = f;
                qp = &f->qnext;
        }
        x->dead = true;
        if (x->inflight == 0)
                free_xfer(xp, x);
}

void xfer_enqueue(struct xfer_peer *xp, struct frame *f, bool front)
{
        f->state = F_QUEUED;
        f->qnext = NULL;
        if (front) {
                f->qnext = xp->qhead;
                xp->qhead = f;
                if (!xp->qtail)
                        xp->qtail = f;
        } else {
                if (xp->qtail)
                        xp->qtail->qnext = f;
                else
                        xp->qhead = f;
                xp->qtail = f;
        }
        xp->qbytes += xfer_frame_bytes(xp, f);
        f->x->queued++;
}

int xfer_split_head(struct xfer_peer *xp, uint32_t k)
{
        struct frame *f = xp->qhead, *g;
        if (!f || k == 0 || k >= f->nblocks)
                return 0;
        if (!(g = malloc(sizeof(*g))) || add_frame(f->x, g) < 0) {
                free(g);
                return -ENOMEM;
        }
        *g = *f;
        g->index += k;
        g->nblocks -= k;
        /* a run of source blocks */
        g->src_off += (uint64_t)k * kvf_layout_tensor_bytes(&xp->p->cn->ctl.hdr->layout, f->tensor);
        f->nblocks = k;
        g->qnext = f->qnext;
        f->qnext = g;
        if (xp->qtail == f)
                xp->qtail = g;
        f->x->queued++; /* (the queue's bytes are the same) */
        return 0;
}

struct frame *xfer_dequeue(struct xfer_peer *xp, int conn)
{
        struct frame *f = xp->qhead;
        if (!f)
                return NULL;
        xp->qhead = f->qnext;
        if (!xp->qhead)
                xp->qtail = NULL;
        xp->qbytes -= xfer_frame_bytes(xp, f);
        f->state = F_FLIGHT;
        f->conn = (int8_t)conn;
        f->x->inflight++;
        f->x->queued--;
        return f;
}

void xfer_hold(struct xfer *x)
{
        x->inflight++;
}

void xfer_release(struct xfer_peer *xp, struct xfer *x)
{
        if (--x->inflight == 0 && x->dead)
                free_xfer(xp, x);
}

bool xfer_session_over(const struct xfer_peer *xp, const struct xfer *x)
{
        uint64_t now = kvf_load_relaxed(&xp->p->remote_session);
        return x->session && now && now != x->session;
}

void xfer_give_back(struct xfer_peer *xp, struct frame **fs, unsigned n, bool sent)
{
        for (unsigned i = n; i-- > 0;) {
                struct frame *f = fs[i];
                struct xfer *x = f->x;
                x->inflight--;
                if (x->dead) {
                        if (x->inflight == 0)
                                free_xfer(xp, x);
                        continue;
                }
                if (sent)
                        f->state = F_SENT;
                else
                        xfer_enqueue(xp, f, true);
        }
}

void xfer_requeue_conn(struct xfer_peer *xp, int conn)
{
        for (struct xfer *x = xp->xfers; x; x = x->next)
                for (uint32_t i = 0; i < x->nfr; i++)
                        if (x->fr[i]->state == F_SENT && x->fr[i]->conn == (int8_t)conn) {
                                x->fr[i]->again = 1;
                                xfer_enqueue(xp, x->fr[i], false);
                        }
        pthread_cond_broadcast(&xp->cv);
}

bool xfer_has_room(const struct xfer_peer *xp)
{
        return xp->qbytes < XFER_QUEUE_LIMIT / 2;
}

void xfer_room(struct xfer_peer *xp, bool room)
{
        struct connector *cn = xp->p->cn;
        /* The control thread holds a write batch back while the queue is full:
         * tell it there is room again. */
        if (room && kvf_load_acquire(&cn->tx_blocked)) {
                kvf_store_release(&cn->tx_blocked, 0);
                kvf_doorbell_ring(&cn->ctl.bells[KVF_BELL_CONNECTOR]);
        }
}

void xfer_fail_one(struct xfer_peer *xp, struct xfer *x, int status, const char *reason)
{
        if (x->dead)
                return;
        fail_xfer(xp, x, status, reason);
        drop(xp, x);
}

/* Destination ids must exist on the peer; fail the transfer otherwise. Lock held. */
static bool check_dst(struct xfer_peer *xp, struct xfer *x)
{
        if (x->checked || !xp->remote_blocks)
                return true;
        for (uint32_t i = 0; i < x->n_dst; i++)
                if (x->dst[i] >= xp->remote_blocks) {
                        char why[KVF_REASON_MAX];
                        snprintf(why, sizeof(why),
                                 "dest_block_ids[%u] = %u is out of range: peer '%s' has %llu blocks", i,
                                 x->dst[i], xp->p->name, (unsigned long long)xp->remote_blocks);
                        fail_xfer(xp, x, KVF_STATUS_BLOCK_RANGE, why);
                        drop(xp, x);
                        return false;
                }
        x->checked = true;
        return true;
}

void xfer_set_remote_blocks(struct xfer_peer *xp, uint64_t num_blocks)
{
        xp->remote_blocks = num_blocks;
        for (struct xfer *x = xp->xfers, *nx; x; x = nx) {
                nx = x->next;
                check_dst(xp, x);
        }
}

/* ---- the peer's state per transport ---- */

static struct xfer_peer **slot_of(struct peer *p, const struct conn_transport *t)
{
        return &p->xfers[conn_transport_index(t)];
}

static void start_one(struct xfer_peer *xp)
{
        /* A new control connection: the peer may be another incarnation, which takes the
         * transport it refused before; its data path says so again if it does not. */
        pthread_mutex_lock(&xp->mu);
        xp->refused_status = 0;
        pthread_mutex_unlock(&xp->mu);
        if (xp->t->start)
                xp->t->start(xp);
}

/* The peer's state for transport t, created on first use (control thread). */
static struct xfer_peer *xfer_peer(struct peer *p, const struct conn_transport *t)
{
        struct xfer_peer **slot = slot_of(p, t);
        if (*slot)
                return *slot;
        struct xfer_peer *xp = calloc(1, sizeof(*xp));
        if (!xp)
                return NULL;
        xp->p = p;
        xp->t = t;
        pthread_mutex_init(&xp->mu, NULL);
        pthread_cond_init(&xp->cv, NULL);
        if (t->peer_init && t->peer_init(xp) < 0) {
                pthread_cond_destroy(&xp->cv);
                pthread_mutex_destroy(&xp->mu);
                free(xp);
                return NULL;
        }
        /* The data path starts when the peer's control connection is up (conn_xfer_start):
         * a peer that cannot be reached costs no thread at all. Under p->mu with the
         * I/O thread's setting of `up`: of the two, whichever comes second starts it. */
        pthread_mutex_lock(&p->mu);
        *slot = xp;
        bool up = p->up;
        pthread_mutex_unlock(&p->mu);
        if (up)
                start_one(xp);
        return xp;
}

/* The peer's state for transport i (NULL: none yet), from any thread: the control thread
 * creates it under p->mu while the peer's I/O thread and others may look. Never with p->mu held. */
static struct xfer_peer *xfer_peer_get(struct peer *p, unsigned i)
{
        pthread_mutex_lock(&p->mu);
        struct xfer_peer *xp = p->xfers[i];
        pthread_mutex_unlock(&p->mu);
        return xp;
}

void conn_xfer_start(struct peer *p)
{
        for (unsigned i = 0; i < conn_ntransports; i++) {
                struct xfer_peer *xp = xfer_peer_get(p, i);
                if (xp)
                        start_one(xp);
        }
}

static const struct conn_transport *transport_for(const struct kvf_record *r, char *why, size_t whylen)
{
        const struct conn_transport *t = conn_transport_of(r->transport);
        if (!t)
                snprintf(why, whylen, "transfer_protocol '%s' is not supported by this connector",
                         kvf_transport_name(r->transport));
        return t;
}

int conn_xfer_open(struct peer *p, const struct kvf_record *o, int *status, char *why, size_t whylen)
{
        struct connector *cn = p->cn;
        *status = KVF_STATUS_CONNECTION;
        const struct conn_transport *t = transport_for(o, why, whylen);
        if (!t)
                return -EPROTONOSUPPORT;
        struct xfer_peer *xp = xfer_peer(p, t);
        if (!xp) {
                snprintf(why, whylen, "the connector is out of memory");
                return -ENOMEM;
        }
        /* A new transfer this side cannot send over the transport at all, or that the peer
         * refused for good: fail now, not when the request times out. Remembered as failed,
         * so a finish notice already on its way goes to the peer as an abort
         * (conn_xfer_noticed). (An open sent again for a transfer we have is no new one:
         * its notice may be in doubt, and only the peer's answer ends it.) */
        char no[KVF_REASON_MAX];
        bool cannot = t->unavailable && t->unavailable(cn, false, no, sizeof(no)) < 0;
        pthread_mutex_lock(&xp->mu);
        struct xfer *x = find(xp, o->key);
        if (!x && (cannot || xp->refused_status)) {
                if (cannot)
                        snprintf(why, whylen, "%s is not available at '%s': %s", t->name,
                                 cn->ctl.hdr->instance, no);
                else /* with the peer's status: a layout it refused is no connection error */
                        snprintf(why, whylen, "%s", xp->refused), *status = xp->refused_status;
                remember_failed(xp, o->key, 0, *status, why);
                pthread_mutex_unlock(&xp->mu);
                return -EPROTONOSUPPORT;
        }
        if (!x) {
                x = calloc(1, sizeof(*x));
                uint32_t *dst = malloc((o->n_dst ? o->n_dst : 1) * sizeof(uint32_t));
                if (!x || !dst) {
                        free(x);
                        free(dst);
                        pthread_mutex_unlock(&xp->mu);
                        snprintf(why, whylen, "the connector is out of memory");
                        return -ENOMEM;
                }
                memcpy(dst, o->dst, o->n_dst * sizeof(uint32_t));
                x->key = o->key;
                x->session = o->session;
                x->peer_gen = kvf_load_acquire(&p->remote_gen);
                x->reg_gen = kvf_load_acquire(&cn->ctl.hdr->reg_generation);
                x->dst = dst;
                x->n_dst = o->n_dst;
                x->n_src = (uint32_t)o->blocks;
                x->first_ns = kvf_now_ns();
                snprintf(x->request_id, sizeof(x->request_id), "%s", o->request_id);
                x->id_bin = o->id_bin;
                if (t->xfer_open && t->xfer_open(xp, x) < 0) {
                        free(dst);
                        free(x);
                        pthread_mutex_unlock(&xp->mu);
                        snprintf(why, whylen, "the connector is out of memory");
                        return -ENOMEM;
                }
                x->next = xp->xfers;
                xp->xfers = x;
                xp->nxfers++;
                check_dst(xp, x);
                pthread_cond_broadcast(&xp->cv); /* idle data paths connect now */
        }
        pthread_mutex_unlock(&xp->mu);
        if (t->wake)
                t->wake(xp);
        return 0; /* the caller kicks the peer: its control connection carries the notice later */
}

int conn_xfer_batch(struct peer *p, const struct kvf_record *w)
{
        struct connector *cn = p->cn;
        const struct conn_transport *t = conn_transport_of(w->transport);
        if (!t)
                return -ENOENT; /* its open failed the request already */
        const struct kvf_cache_layout *L = &cn->ctl.hdr->layout;
        struct xfer_peer *xp = xfer_peer(p, t);
        if (!xp)
                return -ENOMEM;
        pthread_mutex_lock(&xp->mu);
        if (xp->qbytes > XFER_QUEUE_LIMIT) {
                pthread_mutex_unlock(&xp->mu);
                return -EAGAIN; /* back-pressure: the record waits in its ring */
        }
        struct xfer *x = find(xp, w->key);
        int rc = 0;
        if (!x) {
                pthread_mutex_unlock(&xp->mu);
                return -ENOENT; /* forgotten (failed) or never opened */
        }
        uint32_t layers = kvf_layout_layers(L), tensors = kvf_layout_all_tensors(L);
        bool valid = (uint64_t)w->layer + w->layer_count <= layers && w->n_runs % 3 == 0;
        for (uint32_t r = 0; valid && r < w->n_runs; r += 3)
                valid = (uint64_t)w->runs[r] + w->runs[r + 2] <= L->num_blocks &&
                        (uint64_t)w->runs[r + 1] + w->runs[r + 2] <= (x->n_src ? x->n_src : x->n_dst);
        if (!valid) { /* checked whole, so a bad batch queues nothing */
                pthread_mutex_unlock(&xp->mu);
                return -EINVAL;
        }
        for (uint64_t l = w->layer; l < w->layer + w->layer_count; l++)
                for (uint32_t tn = 0; tn < tensors; tn++) {
                        /* blocks a frame holds: as many as frame_max bytes of this tensor's */
                        uint64_t per64 = t->frame_max / kvf_layout_tensor_bytes(L, tn);
                        uint32_t per = per64 == 0 ? 1 : per64 > UINT32_MAX ? UINT32_MAX : (uint32_t)per64;
                        if (t->frame_blocks_max && per > t->frame_blocks_max)
                                per = t->frame_blocks_max;
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
                                        f->tensor = (uint16_t)tn;
                                        f->index = idx + off;
                                        f->nblocks = n - off < per ? n - off : per;
                                        f->src_off = kvf_layout_offset(L, (uint32_t)l, tn, src + off);
                                        f->conn = -1;
                                        xfer_enqueue(xp, f, false);
                                }
                        }
                }
out:
        pthread_cond_broadcast(&xp->cv);
        pthread_mutex_unlock(&xp->mu);
        if (t->wake)
                t->wake(xp);
        return rc;
}

void conn_xfer_forget(struct peer *p, uint64_t key)
{
        for (unsigned i = 0; i < conn_ntransports; i++) {
                struct xfer_peer *xp = xfer_peer_get(p, i);
                if (!xp)
                        continue;
                pthread_mutex_lock(&xp->mu);
                struct xfer *x = find(xp, key);
                if (x)
                        drop(xp, x);
                pthread_mutex_unlock(&xp->mu);
        }
}

int conn_xfer_noticed(struct peer *p, uint64_t key, char *why, size_t whylen)
{
        int status = KVF_STATUS_FINISHED;
        for (unsigned i = 0; i < conn_ntransports; i++) {
                struct xfer_peer *xp = xfer_peer_get(p, i);
                if (!xp)
                        continue;
                pthread_mutex_lock(&xp->mu);
                struct xfer *x = find(xp, key);
                if (x) {
                        x->noticed = true;
                        if (xp->t->noticed)
                                xp->t->noticed(xp, x);
                } else {
                        const struct xfer_failed *f = failed_of(xp, key);
                        if (f) {
                                status = f->status;
                                snprintf(why, whylen, "%s", f->reason);
                        }
                }
                pthread_mutex_unlock(&xp->mu);
        }
        return status;
}

void conn_xfer_fail_transport(struct xfer_peer *xp, int status, const char *reason, uint64_t older_than)
{
        pthread_mutex_lock(&xp->mu);
        uint64_t now = kvf_now_ns();
        for (struct xfer *x = xp->xfers, *nx; x; x = nx) {
                nx = x->next;
                if (x->noticed || (older_than && kvf_elapsed(now, x->first_ns) <= older_than))
                        continue;
                fail_xfer(xp, x, status, reason);
                drop(xp, x);
        }
        pthread_mutex_unlock(&xp->mu);
}

void conn_xfer_refuse(struct xfer_peer *xp, int status, const char *reason)
{
        pthread_mutex_lock(&xp->mu);
        xp->refused_status = status;
        snprintf(xp->refused, sizeof(xp->refused), "%s", reason);
        pthread_mutex_unlock(&xp->mu);
        conn_xfer_fail_transport(xp, status, reason, 0);
}

static void fail_all(struct xfer_peer *xp, int status, const char *reason, bool sticky)
{
        /* Noticed ones too: the peer refuses every data connection, so no byte of them can land
         * and it can never publish them finished; failing them here cannot disagree with it. */
        pthread_mutex_lock(&xp->mu);
        if (sticky) {
                xp->refused_status = status;
                snprintf(xp->refused, sizeof(xp->refused), "%s", reason);
        }
        for (struct xfer *x = xp->xfers, *nx; x; x = nx) {
                nx = x->next;
                fail_xfer(xp, x, status, reason);
                drop(xp, x);
        }
        pthread_mutex_unlock(&xp->mu);
}

void conn_xfer_refuse_all(struct xfer_peer *xp, int status, const char *reason)
{
        fail_all(xp, status, reason, true);
}

void conn_xfer_fail_all(struct xfer_peer *xp, int status, const char *reason)
{
        fail_all(xp, status, reason, false);
}

uint64_t conn_xfer_gen(struct peer *p, uint64_t key)
{
        uint64_t gen = 0;
        for (unsigned i = 0; i < conn_ntransports && !gen; i++) {
                struct xfer_peer *xp = xfer_peer_get(p, i);
                if (!xp)
                        continue;
                pthread_mutex_lock(&xp->mu);
                struct xfer *x = find(xp, key);
                const struct xfer_failed *f = x ? NULL : failed_of(xp, key);
                gen = x ? x->peer_gen : f ? f->peer_gen : 0;
                pthread_mutex_unlock(&xp->mu);
        }
        return gen;
}

void xfer_check_gen(struct xfer_peer *xp, uint64_t gen)
{
        char why[KVF_REASON_MAX];
        snprintf(why, sizeof(why), "peer '%s' was re-created during the transfer (another incarnation "
                 "answers at its address): the blocks reserved were in the one before", xp->p->name);
        pthread_mutex_lock(&xp->mu);
        for (struct xfer *x = xp->xfers, *nx; x; x = nx) {
                nx = x->next;
                if (!x->peer_gen) {
                        x->peer_gen = gen;
                } else if (x->peer_gen != gen) {
                        /* A noticed one ends with its notice, which is never sent to this
                         * incarnation (send_queued answers it): one result per request. */
                        if (!x->noticed)
                                fail_xfer(xp, x, KVF_STATUS_CONNECTION, why);
                        drop(xp, x);
                }
        }
        pthread_mutex_unlock(&xp->mu);
}

void conn_xfer_check_gen(struct peer *p, uint64_t gen)
{
        for (unsigned i = 0; i < conn_ntransports; i++) {
                struct xfer_peer *xp = xfer_peer_get(p, i);
                if (xp)
                        xfer_check_gen(xp, gen);
        }
}

void conn_xfer_fail(struct peer *p, int status, const char *reason, uint64_t older_than)
{
        for (unsigned i = 0; i < conn_ntransports; i++) {
                struct xfer_peer *xp = xfer_peer_get(p, i);
                if (xp)
                        conn_xfer_fail_transport(xp, status, reason, older_than);
        }
}

bool conn_xfer_busy(struct peer *p)
{
        bool busy = false;
        for (unsigned i = 0; i < conn_ntransports && !busy; i++) {
                struct xfer_peer *xp = xfer_peer_get(p, i);
                if (!xp)
                        continue;
                pthread_mutex_lock(&xp->mu);
                busy = xp->nxfers > 0;
                pthread_mutex_unlock(&xp->mu);
        }
        return busy;
}

void conn_xfer_stop(struct peer *p)
{
        for (unsigned i = 0; i < conn_ntransports; i++) {
                struct xfer_peer *xp = xfer_peer_get(p, i);
                if (!xp)
                        continue;
                pthread_mutex_lock(&xp->mu);
                kvf_store_release(&xp->stop, true); /* (no start after this starts a thread) */
                pthread_cond_broadcast(&xp->cv);
                pthread_mutex_unlock(&xp->mu);
                if (xp->t->stop)
                        xp->t->stop(xp);
        }
}

void conn_xfer_free(struct peer *p)
{
        for (unsigned i = 0; i < conn_ntransports; i++) {
                struct xfer_peer *xp = p->xfers[i];
                if (!xp)
                        continue;
                /* The data path is stopped (conn_xfer_stop): no frame is in flight. */
                while (xp->xfers) {
                        struct xfer *x = xp->xfers;
                        xp->xfers = x->next;
                        free_xfer(xp, x);
                }
                if (xp->t->peer_free)
                        xp->t->peer_free(xp);
                pthread_cond_destroy(&xp->cv);
                pthread_mutex_destroy(&xp->mu);
                free(xp);
                p->xfers[i] = NULL;
        }
}

bool xfer_regroup_mismatch(const struct xfer_peer *xp, const struct xfer *x, uint32_t peer_bsize, bool regrouped,
                           char *why, size_t whylen)
{
        const uint32_t bs = xp->p->cn->ctl.hdr->layout.block_size, bd = peer_bsize;
        if (!regrouped && x->n_src)
                snprintf(why, whylen, "req %s to '%s': opened to be regrouped into another block size, "
                         "but the peer's blocks are of %u tokens as here", x->request_id, xp->p->name, bd);
        else if (regrouped && !x->n_src)
                snprintf(why, whylen, "req %s to '%s': peer layout mismatch: %u tokens/block there, %u "
                         "here, and the task was accepted for blocks of one size (the sender regroups "
                         "tokens for a peer whose block size it knows: on this host, or reached by "
                         "this connector before the task)", x->request_id, xp->p->name, bd, bs);
        else if (regrouped && (x->n_dst < kvf_tp_dst_blocks_min(x->n_src, bs, bd) ||
                               x->n_dst > kvf_tp_dst_blocks(x->n_src, bs, bd)))
                snprintf(why, whylen, "req %s to '%s': %u destination blocks of %u tokens for %u source "
                         "blocks of %u", x->request_id, xp->p->name, x->n_dst, bd, x->n_src, bs);
        else
                return false;
        return true;
}
