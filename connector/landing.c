/*
 * Incoming network transfers, whatever the transport (see landing.h).
 *
 * Runs are checked before a byte of them is received, and land only in the
 * blocks they name, which must belong to a transfer the same peer opened. A
 * peer that breaks a rule is disconnected by its data path; what it sent
 * before stays in that transfer's blocks (the decode engine never sees it as
 * arrived, since the transfer is not complete and no arrival is published).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "err.h"
#include "landing.h"
#include "layout.h"
#include "log.h"
#include "tpsplit.h"

struct rx_xfer {
        char peer[KVF_INSTANCE_MAX];
        uint64_t gen; /* the peer's incarnation */
        uint64_t key;
        char request_id[KVF_REQ_ID_MAX];
        uint32_t *dst;
        uint32_t n_dst;
        /* Regrouped into this cache's block size (its open's `blocks`): the source blocks, and
         * the map is per source position; 0: per destination position. */
        uint32_t n_src;
        uint8_t *got; /* bit per (layer, tensor, position); NULL once complete by its transport */
        uint64_t need, have;
        bool waiting; /* a finish notice waits for the data */
        bool closed;  /* published or aborted: late data for it is drained, not written */
        int status;   /* complete: finished, or what its transport said went wrong ... */
        char *why;    /* ... and why (malloc'd, or NULL) */
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
        free(x->why);
        if (x->waiting)
                kvf_record_free(&x->notice);
        free(x->dst);
        free(x->got);
        free(x);
}

int conn_landing_open(struct connector *cn, const char *peer, uint64_t gen, const struct kvf_record *o,
                      int *status, char *why, size_t whylen)
{
        const struct kvf_cache_layout *L = &cn->ctl.hdr->layout;
        int dummy;
        status = status ? status : &dummy;
        *status = KVF_STATUS_BAD_TASK;
        uint8_t *seen = calloc(L->num_blocks / 8 + 1, 1);
        if (!seen)
                return -ENOMEM;
        for (uint32_t i = 0; i < o->n_dst; i++) {
                uint32_t b = o->dst[i];
                if (b >= L->num_blocks || (seen[b / 8] & (1u << (b % 8)))) {
                        snprintf(why, whylen, "%s for %s names block %u %s (this cache has %u blocks)",
                                 kvf_rec_type_name(o->type), o->request_id, b,
                                 b >= L->num_blocks ? "beyond this cache" : "twice", L->num_blocks);
                        if (b >= L->num_blocks)
                                *status = KVF_STATUS_BLOCK_RANGE;
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
        /* A notice's `blocks` is the sender's send count, which equals the destination count
         * unless the transfer is regrouped; an XOPEN's is 0 unless it is. */
        const uint32_t n_src = o->blocks && o->blocks != o->n_dst ? (uint32_t)o->blocks
                               : o->type == KVF_RT_XOPEN ? (uint32_t)o->blocks : 0;
        if ((uint64_t)n_src > (uint64_t)o->n_dst * L->block_size) {
                /* (each source block holds a token at least, each of ours block_size at most) */
                pthread_mutex_unlock(&cn->rxmu);
                snprintf(why, whylen, "%s for %s names %u source blocks for %u blocks here",
                         kvf_rec_type_name(o->type), o->request_id, n_src, o->n_dst);
                return -EPROTO;
        }
        if (x && x->dst && x->got && n_src && !x->n_src && n_src == x->n_dst)
                x->n_src = n_src; /* opened by its notice, which cannot tell: the same map */
        if (x && x->dst && x->got && n_src && x->n_src != n_src) {
                pthread_mutex_unlock(&cn->rxmu);
                snprintf(why, whylen, "XOPEN for %s changes the source block count of an open transfer",
                         o->request_id);
                return -EPROTO;
        }
        if (x && x->dst && (x->n_dst != o->n_dst || memcmp(x->dst, o->dst, o->n_dst * sizeof(uint32_t)))) {
                /* Same key, other blocks: cannot be a resend. */
                pthread_mutex_unlock(&cn->rxmu);
                snprintf(why, whylen, "XOPEN for %s changes the blocks of an open transfer", o->request_id);
                return -EPROTO;
        }
        if (x && !x->dst) {
                /* Complete before its blocks were known (its transport's done came first). */
                x->dst = malloc((o->n_dst ? o->n_dst : 1) * sizeof(uint32_t));
                if (!x->dst) {
                        pthread_mutex_unlock(&cn->rxmu);
                        return -ENOMEM;
                }
                memcpy(x->dst, o->dst, o->n_dst * sizeof(uint32_t));
                x->n_dst = o->n_dst;
                snprintf(x->request_id, sizeof(x->request_id), "%s", o->request_id);
        }
        if (!x) {
                uint64_t bits = (uint64_t)kvf_layout_layers(L) * kvf_layout_all_tensors(L) *
                                (n_src ? n_src : o->n_dst);
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
                x->n_src = n_src;
                x->need = bits;
                rx_insert(cn, x);
        }
        x->touched_ns = kvf_now_ns();
        pthread_mutex_unlock(&cn->rxmu);
        return 0;
}

/* rxmu held: the open transfer run h's data is for, checked for this cache's layers and tensors:
 * 0 with *out; 1 when the data is to be drained (closed, or its engine session `live` is over:
 * the blocks are not its any more); -EPROTO with why. */
static int rx_for_data(struct connector *cn, const char *peer, uint64_t gen, const struct landing_run *h,
                       uint64_t live, struct rx_xfer **out, char *why, size_t whylen)
{
        const struct kvf_cache_layout *L = &cn->ctl.hdr->layout;
        uint32_t layers = kvf_layout_layers(L), tensors = kvf_layout_all_tensors(L);
        struct rx_xfer *x = rx_find(cn, peer, gen, h->key);
        *out = x;
        if (x && (x->closed || (x->eng_session && x->eng_session != live)))
                return 1;
        if (!x || !x->dst) {
                snprintf(why, whylen, "data for transfer %016llx, which was never opened",
                         (unsigned long long)h->key);
                return -EPROTO;
        }
        if (h->layer >= layers || h->tensor >= tensors) {
                snprintf(why, whylen, "data for layer %u tensor %u: this cache has %u layers, %u tensors",
                         h->layer, h->tensor, layers, tensors);
                return -EPROTO;
        }
        return 0;
}

int conn_landing_check(struct connector *cn, const char *peer, uint64_t gen, const struct landing_run *h,
                       uint64_t bytes, uint64_t *dst_off, char *why, size_t whylen)
{
        const struct kvf_cache_layout *L = &cn->ctl.hdr->layout;
        uint64_t live = conn_engine_session(cn);
        struct rx_xfer *x;

        pthread_mutex_lock(&cn->rxmu);
        int rc = rx_for_data(cn, peer, gen, h, live, &x, why, whylen);
        if (rc == 0) {
                rc = -EPROTO;
                if (x->n_src)
                        snprintf(why, whylen, "whole blocks or slices for %s, whose tokens are regrouped",
                                 x->request_id);
                else if (h->nblocks == 0 || (uint64_t)h->index + h->nblocks > x->n_dst)
                        snprintf(why, whylen, "data for blocks [%u, +%u) of %s, which has %u", h->index,
                                 h->nblocks, x->request_id, x->n_dst);
                else if (h->len && (h->nblocks != 1 || h->len != bytes ||
                                    (uint64_t)h->off + h->len > kvf_layout_tensor_bytes(L, h->tensor)))
                        snprintf(why, whylen, "a slice of %u bytes at %u of %u block(s) of %llu bytes", h->len,
                                 h->off, h->nblocks, (unsigned long long)kvf_layout_tensor_bytes(L, h->tensor));
                else if (!h->len && bytes != (uint64_t)h->nblocks * kvf_layout_tensor_bytes(L, h->tensor))
                        snprintf(why, whylen, "%llu bytes of data for %u blocks of %llu bytes",
                                 (unsigned long long)bytes, h->nblocks,
                                 (unsigned long long)kvf_layout_tensor_bytes(L, h->tensor));
                else
                        rc = 0;
                for (uint32_t i = 1; rc == 0 && i < h->nblocks; i++)
                        if (x->dst[h->index + i] != x->dst[h->index] + i) {
                                snprintf(why, whylen, "data run over destination blocks that are not contiguous");
                                rc = -EPROTO;
                        }
                if (rc == 0)
                        *dst_off = kvf_layout_offset(L, h->layer, h->tensor, x->dst[h->index]) + h->off;
        }
        pthread_mutex_unlock(&cn->rxmu);
        return rc;
}

int conn_landing_pieces(struct connector *cn, const char *peer, uint64_t gen, const struct landing_run *h,
                        const struct kvf_tp_plan *pl, struct kvf_io_run *io, struct landing_run *marks,
                        unsigned max, unsigned *n, char *why, size_t whylen)
{
        const struct kvf_cache_layout *L = &cn->ctl.hdr->layout;
        uint64_t live = conn_engine_session(cn);
        struct rx_xfer *x;
        *n = 0;

        pthread_mutex_lock(&cn->rxmu);
        int rc = rx_for_data(cn, peer, gen, h, live, &x, why, whylen);
        if (rc == 0 && !x->n_src) {
                snprintf(why, whylen, "regrouped data for %s, which was opened without its source blocks",
                         x->request_id);
                rc = -EPROTO;
        } else if (rc == 0 && (h->nblocks == 0 || (uint64_t)h->index + h->nblocks > x->n_src)) {
                snprintf(why, whylen, "data for source blocks [%u, +%u) of %s, which has %u", h->index,
                         h->nblocks, x->request_id, x->n_src);
                rc = -EPROTO;
        }
        /* Each source block's pieces that land (kvf_tp_piece_next, the walk the sender's copies
         * and the engine executor make): a piece past the last destination block does not. */
        for (uint32_t b = 0; rc == 0 && b < h->nblocks; b++) {
                uint32_t pos = h->index + b, d;
                unsigned first = *n;
                for (uint32_t i = 0; rc == 0 && kvf_tp_piece_next(pl, pos, x->n_dst, &i, &d); i++) {
                        const struct kvf_tp_piece *pc = &pl->pieces[i];
                        if (*n == max) {
                                snprintf(why, whylen, "more than %u pieces in one frame", max);
                                rc = -EPROTO;
                                break;
                        }
                        io[*n] = (struct kvf_io_run){
                            .off = kvf_layout_offset(L, h->layer, h->tensor, x->dst[d]) + pc->doff,
                            .len = pc->bytes};
                        marks[(*n)++] = (struct landing_run){.key = h->key, .layer = h->layer,
                                                             .tensor = h->tensor, .index = pos};
                }
                if (rc == 0 && *n == first) {
                        snprintf(why, whylen, "source block %u of %s lands in none of its %u "
                                 "destination blocks", pos, x->request_id, x->n_dst);
                        rc = -EPROTO;
                }
                if (rc == 0)
                        marks[*n - 1].nblocks = 1; /* its last piece marks the block */
        }
        pthread_mutex_unlock(&cn->rxmu);
        return rc;
}

bool conn_landing_mark(struct connector *cn, const char *peer, uint64_t gen, const struct landing_run *h)
{
        const struct kvf_cache_layout *L = &cn->ctl.hdr->layout;
        int done = 0;
        pthread_mutex_lock(&cn->rxmu);
        struct rx_xfer *x = rx_find(cn, peer, gen, h->key);
        /* Closed while its payload was being received (the lock is not held across
         * it): an abort, or its engine session ended; its bitmap is gone. */
        if (x && !x->closed && x->got && x->have < x->need) {
                uint64_t base = ((uint64_t)h->layer * kvf_layout_all_tensors(L) + h->tensor) *
                                (x->n_src ? x->n_src : x->n_dst);
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

int conn_landing_complete(struct connector *cn, const char *peer, uint64_t gen, uint64_t key,
                          uint64_t session, int status, const char *why)
{
        pthread_mutex_lock(&cn->rxmu);
        struct rx_xfer *x = rx_find(cn, peer, gen, key);
        if (!x) {
                /* Before its notice: remember it complete; the notice brings its blocks. */
                x = calloc(1, sizeof(*x));
                if (!x) {
                        pthread_mutex_unlock(&cn->rxmu);
                        return -ENOMEM;
                }
                snprintf(x->peer, sizeof(x->peer), "%s", peer);
                x->gen = gen;
                x->key = key;
                x->eng_session = session ? session : conn_engine_session(cn);
                rx_insert(cn, x);
        }
        bool done = !x->closed && (x->have < x->need || !x->need);
        if (done) {
                free(x->got);
                x->got = NULL;
                x->need = x->have = 1; /* complete: the notice publishes at once */
                x->status = status;
                if (status != KVF_STATUS_FINISHED && why)
                        x->why = strdup(why);
        }
        x->touched_ns = kvf_now_ns();
        pthread_mutex_unlock(&cn->rxmu);
        return done ? 1 : 0;
}

int conn_landing_notice(struct connector *cn, const struct kvf_record *n, uint64_t gen, uint64_t session,
                        int *status, char *whyout, size_t whyoutlen)
{
        int ready = 0, refused;
        *status = KVF_STATUS_FINISHED;
        char why[KVF_REASON_MAX];
        /* The notice can overtake the transfer's open: open it from the notice. One whose
         * blocks are not ours to give (the prefill side could not check them: it did not know
         * this cache's size yet) is decided now, with the reason, and answered so: no data of
         * it can ever be taken, and waiting would leave the decode engine without an arrival. */
        int rc = conn_landing_open(cn, n->peer, gen, n, &refused, why, sizeof(why));
        if (rc < 0) {
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "notice from '%s': %s", n->peer,
                           rc == -ENOMEM ? "out of memory" : why);
                *status = rc == -ENOMEM ? KVF_STATUS_WRITE : refused;
                snprintf(whyout, whyoutlen, "%s", rc == -ENOMEM ? "out of memory for the transfer" : why);
                return 1;
        }
        pthread_mutex_lock(&cn->rxmu);
        struct rx_xfer *x = rx_find(cn, n->peer, gen, n->key);
        if (x && x->closed) {
                ready = 1; /* the journal answers the repeat, or what decided it here does */
                if (x->status && x->status != KVF_STATUS_FINISHED) {
                        *status = x->status;
                        snprintf(whyout, whyoutlen, "%s", x->why ? x->why : "");
                }
        } else if (x && x->have == x->need) {
                ready = 1;
                *status = x->status;
                snprintf(whyout, whyoutlen, "%s", x->why ? x->why : "");
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

int conn_landing_take_ready(struct connector *cn, const char *peer, uint64_t gen, uint64_t key,
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

void conn_landing_close(struct connector *cn, const char *peer, uint64_t gen, uint64_t key, int status,
                        const char *why)
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
        if (x && status && status != KVF_STATUS_FINISHED) {
                x->status = status;
                free(x->why);
                x->why = why ? strdup(why) : NULL;
        }
        if (x)
                x->touched_ns = kvf_now_ns();
        pthread_mutex_unlock(&cn->rxmu);
}

void conn_landing_expire(struct connector *cn, uint64_t open_ns, uint64_t closed_ns)
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

uint64_t conn_landing_session(struct connector *cn, const char *peer, uint64_t gen, uint64_t key)
{
        uint64_t live = conn_engine_session(cn);
        pthread_mutex_lock(&cn->rxmu);
        struct rx_xfer *x = rx_find(cn, peer, gen, key);
        uint64_t s = x ? x->eng_session : live;
        pthread_mutex_unlock(&cn->rxmu);
        return s;
}

struct event *conn_landing_end_sessions(struct connector *cn, uint64_t live)
{
        struct event *ready = NULL;
        pthread_mutex_lock(&cn->rxmu);
        for (unsigned b = 0; b < RX_BUCKETS; b++)
                for (struct rx_xfer *x = cn->rx[b]; x; x = x->next) {
                        if (x->closed || !x->eng_session || x->eng_session == live || !x->waiting)
                                continue;
                        /* Its notice waited for data that no longer matters: answer it now
                         * (on_notice sees the session is over). The transfer stays open
                         * until then; conn_landing_check already drains its data. */
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
        return ready;
}
