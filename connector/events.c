/*
 * The connector's events: what its threads learn and the rings must hear
 * (write results, peer states and connect results on the prefill side;
 * notices and completed network transfers on the decode side, arrivals.c).
 *
 * Every thread hands its events to the queue (evq.c); the control thread
 * alone handles them here (conn_events_run), so it is the one producer of
 * connector->engine, connector->sender and the journal, and needs no lock
 * for them. What a full ring refuses is held back and retried; order per
 * ring is kept: once something waits, what follows waits behind it.
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
        for (;;) {
                if (kvf_record_encode_alloc(r, &buf, &len) < 0)
                        return -EAGAIN;
                int rc = kvf_bells_write(&cn->bells, &cn->ctl.rings[ring], r->type, buf, (uint32_t)len);
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

/* Handle one event; -EAGAIN = a ring is full, keep it for later. Control thread. */
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

void conn_events_run(struct connector *cn)
{
        /* Deferred first, to keep order per ring. */
        struct event *ev = cn->deferred, *more = conn_evq_take(cn);
        if (cn->deferred_tail)
                cn->deferred_tail->next = more;
        else
                ev = more;
        cn->deferred = cn->deferred_tail = NULL;
        uint64_t done = 0;
        while (ev) {
                struct event *next = ev->next;
                if (handle_event(cn, ev) == -EAGAIN) {
                        /* keep this and everything after it */
                        cn->deferred = ev;
                        while (ev->next)
                                ev = ev->next;
                        cn->deferred_tail = ev;
                        break;
                }
                kvf_record_free(&ev->rec);
                free(ev);
                done++;
                ev = next;
        }
        /* Held-back events still count against the queue's bound (evq.c). */
        conn_evq_done(cn, done);
}
