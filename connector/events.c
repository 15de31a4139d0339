/*
 * The connector's events: what its threads learn and the rings must hear
 * (write results, peer states and connect results on the prefill side;
 * notices and completed network transfers on the decode side, arrivals.c).
 *
 * Any thread hands an event to conn_dispatch(), which writes it at once
 * under the ring's in-process producer mutex, or queues it for the control
 * thread (conn_events_run) when a ring is full. Order per ring is kept: once
 * something waits, what follows waits behind it.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomics.h"
#include "connector.h"
#include "doorbell.h"
#include "err.h"
#include "log.h"

void conn_post(struct connector *cn, struct event *ev)
{
        ev->next = NULL;
        pthread_mutex_lock(&cn->evmu);
        if (cn->events_tail)
                cn->events_tail->next = ev;
        else
                cn->events = ev;
        cn->events_tail = ev;
        kvf_store_release(&cn->nevents, cn->nevents + 1);
        pthread_mutex_unlock(&cn->evmu);
        kvf_doorbell_ring(&cn->ctl.bells[KVF_BELL_CONNECTOR]);
}

static struct event *take_events(struct connector *cn)
{
        pthread_mutex_lock(&cn->evmu);
        struct event *ev = cn->events;
        cn->events = cn->events_tail = NULL;
        kvf_store_release(&cn->nevents, 0);
        pthread_mutex_unlock(&cn->evmu);
        return ev;
}

/*
 * Write a record to one of the connector's outbound rings. -EAGAIN: the ring
 * is full, or memory ran out: keep the event and try again. A record that can
 * never fit the ring loses its optional block list first; if it still cannot,
 * it is dropped with an error-log line (0): nothing else can be done with it.
 */
static int ring_write_record(struct connector *cn, int ring, struct kvf_record *r)
{
        uint8_t *buf;
        size_t len;
        pthread_mutex_t *mu = ring == KVF_RING_CONNECTOR_TO_ENGINE ? &cn->engine_mu : &cn->sender_mu;
        for (;;) {
                if (kvf_record_encode_alloc(r, &buf, &len) < 0)
                        return -EAGAIN;
                pthread_mutex_lock(mu);
                int rc = kvf_ring_write(&cn->ctl.rings[ring], r->type, buf, (uint32_t)len, NULL);
                pthread_mutex_unlock(mu);
                free(buf);
                if (rc != -EMSGSIZE)
                        return rc;
                if (r->n_dst) {
                        r->n_dst = 0;
                        continue;
                }
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR,
                           "a %zu-byte %s record for '%s' can never fit ring %s: dropped", len,
                           kvf_rec_type_name(r->type), r->request_id, kvf_ring_name(ring));
                return 0;
        }
}

/* Prefill side: what the sender and the engine are told. */
static int prefill_event(struct connector *cn, struct event *ev)
{
        switch (ev->kind) {
        case EV_RESULT:
        case EV_PEER_STATE:
                return ring_write_record(cn, KVF_RING_CONNECTOR_TO_SENDER, &ev->rec);
        case EV_CONNECT:
                return ring_write_record(cn, KVF_RING_CONNECTOR_TO_ENGINE, &ev->rec);
        default:
                return 0;
        }
}

/* Handle one event; -EAGAIN = a ring is full, keep it for later. Any thread. */
static int handle_event(struct connector *cn, struct event *ev)
{
        switch (ev->kind) {
        case EV_NOTICE:
                return conn_arrival_notice(cn, ev); /* decode side: arrivals.c */
        case EV_DATA_DONE:
                return conn_arrival_data_done(cn, ev);
        default:
                return prefill_event(cn, ev);
        }
}

void conn_dispatch(struct connector *cn, struct event *ev)
{
        if (handle_event(cn, ev) == -EAGAIN) {
                conn_post(cn, ev);
                return;
        }
        kvf_record_free(&ev->rec);
        free(ev);
}

void conn_events_run(struct connector *cn)
{
        /* Deferred first, to keep order per ring. */
        struct event *ev = cn->deferred, *more = take_events(cn);
        if (cn->deferred_tail)
                cn->deferred_tail->next = more;
        else
                ev = more;
        cn->deferred = cn->deferred_tail = NULL;
        while (ev) {
                struct event *next = ev->next;
                if (handle_event(cn, ev) == -EAGAIN) {
                        /* keep this and everything after it */
                        cn->deferred = ev;
                        while (ev->next)
                                ev = ev->next;
                        cn->deferred_tail = ev;
                        return;
                }
                kvf_record_free(&ev->rec);
                free(ev);
                ev = next;
        }
}

void conn_write_result(struct connector *cn, uint64_t key, const char *request_id, bool id_bin,
                       int status, const char *reason, bool dispatch)
{
        struct event *ev = calloc(1, sizeof(*ev));
        if (!ev) {
                /* The sender times the request out in the end; say why here. */
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "req %s: out of memory for its write result (%s)",
                           request_id, kvf_status_name(status));
                return;
        }
        ev->kind = EV_RESULT;
        ev->rec.type = KVF_RT_WRITE_RESULT;
        ev->rec.key = key;
        ev->rec.status = status;
        ev->rec.id_bin = id_bin;
        snprintf(ev->rec.request_id, sizeof(ev->rec.request_id), "%s", request_id);
        snprintf(ev->rec.reason, sizeof(ev->rec.reason), "%s", reason ? reason : "");
        if (dispatch)
                conn_dispatch(cn, ev);
        else
                conn_post(cn, ev);
}

void conn_connect_result(struct connector *cn, const struct connect_wait *w, const char *peer,
                         int status, const char *reason)
{
        struct event *ev = calloc(1, sizeof(*ev));
        if (!ev) {
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "connect task %s: out of memory for its result",
                           w->task_id);
                return;
        }
        ev->kind = EV_CONNECT;
        ev->rec.type = KVF_RT_CONNECT_RESULT;
        ev->rec.status = status;
        ev->rec.session = w->session;
        ev->rec.id_bin = w->id_bin;
        snprintf(ev->rec.request_id, sizeof(ev->rec.request_id), "%s", w->task_id);
        snprintf(ev->rec.peer, sizeof(ev->rec.peer), "%s", peer ? peer : "");
        snprintf(ev->rec.reason, sizeof(ev->rec.reason), "%s", reason ? reason : "");
        conn_post(cn, ev);
}

