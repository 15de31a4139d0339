/*
 * The control thread's event queue: how every other thread of the connector
 * hands it what the rings must hear (see connector.h, "evq.c").
 *
 * Many producers (session, data, peer I/O and handshake threads), one
 * consumer (the control thread), a mutex and a list: an event is a heap
 * record whose hand-off costs one lock and a doorbell ring. The queue calls
 * nothing but the doorbell; what an event does is events.c's, on the control
 * thread.
 *
 * Bound: `held` counts events queued or held back by the control thread (a
 * full ring). A notice from a socket (conn_post_wait) is admitted only while
 * held < ev_limit; its session thread waits for room, and while it waits it
 * reads no more of its socket, so the peer that sends too fast is the one
 * that waits. Events of the connector's own making (write results, peer
 * states, connect results, landed transfers) are admitted always: each
 * belongs to a transfer or task already admitted, so their number is
 * bounded by those, and refusing one would lose an outcome.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "atomics.h"
#include "clock.h"
#include "connector.h"
#include "doorbell.h"
#include "err.h"
#include "log.h"

int conn_evq_init(struct connector *cn, uint32_t limit)
{
        pthread_condattr_t ca;
        if (pthread_condattr_init(&ca) != 0)
                return -ENOMEM;
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        int rc = pthread_cond_init(&cn->evroom, &ca);
        pthread_condattr_destroy(&ca);
        if (rc != 0)
                return -rc;
        if ((rc = pthread_mutex_init(&cn->evmu, NULL)) != 0) {
                pthread_cond_destroy(&cn->evroom);
                return -rc;
        }
        cn->ev_limit = limit ? limit : CONN_EVENTS_MAX;
        return 0;
}

/* evmu held. */
static void append(struct connector *cn, struct event *ev)
{
        ev->next = NULL;
        if (cn->events_tail)
                cn->events_tail->next = ev;
        else
                cn->events = ev;
        cn->events_tail = ev;
        /* Pairs with the acquire loads of has_work and the control loop: the event is
         * linked before the count says so. */
        kvf_store_release(&cn->nevents, cn->nevents + 1);
        cn->ev_held++;
}

void conn_post(struct connector *cn, struct event *ev)
{
        pthread_mutex_lock(&cn->evmu);
        append(cn, ev);
        pthread_mutex_unlock(&cn->evmu);
        kvf_doorbell_ring(&cn->ctl.bells[KVF_BELL_CONNECTOR]);
}

int conn_post_wait(struct connector *cn, struct event *ev)
{
        int rc = 0;
        pthread_mutex_lock(&cn->evmu);
        if (cn->ev_held >= cn->ev_limit) {
                rc = 1;
                kvf_store_release(&cn->ev_waiting, cn->ev_waiting + 1);
                while (cn->ev_held >= cn->ev_limit && !conn_stopping(cn)) {
                        struct timespec until = kvf_ts_after(CLOCK_MONOTONIC, kvf_ms(CONN_POLL_MS));
                        pthread_cond_timedwait(&cn->evroom, &cn->evmu, &until);
                }
                kvf_store_release(&cn->ev_waiting, cn->ev_waiting - 1);
                if (conn_stopping(cn)) {
                        pthread_mutex_unlock(&cn->evmu);
                        kvf_record_free(&ev->rec);
                        free(ev);
                        return -ESHUTDOWN;
                }
        }
        append(cn, ev);
        pthread_mutex_unlock(&cn->evmu);
        kvf_doorbell_ring(&cn->ctl.bells[KVF_BELL_CONNECTOR]);
        return rc;
}

struct event *conn_evq_take(struct connector *cn)
{
        pthread_mutex_lock(&cn->evmu);
        struct event *ev = cn->events;
        cn->events = cn->events_tail = NULL;
        kvf_store_release(&cn->nevents, 0);
        pthread_mutex_unlock(&cn->evmu);
        return ev;
}

void conn_evq_done(struct connector *cn, uint64_t n)
{
        if (!n)
                return;
        pthread_mutex_lock(&cn->evmu);
        cn->ev_held -= n;
        if (kvf_load_relaxed(&cn->ev_waiting))
                pthread_cond_broadcast(&cn->evroom);
        pthread_mutex_unlock(&cn->evmu);
}

uint64_t conn_evq_held(struct connector *cn)
{
        pthread_mutex_lock(&cn->evmu);
        uint64_t n = cn->ev_held;
        pthread_mutex_unlock(&cn->evmu);
        return n;
}

void conn_post_write_result(struct connector *cn, uint64_t key, const char *request_id, bool id_bin,
                            int status, const char *reason)
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
        conn_post(cn, ev);
}

void conn_post_connect_result(struct connector *cn, const struct connect_wait *w, const char *peer,
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

void conn_post_data_done(struct connector *cn, const char *peer, uint64_t gen, uint64_t key)
{
        struct event *ev = calloc(1, sizeof(*ev));
        if (!ev) {
                /* The notice waits in the landing table; the prefill side sends it again
                 * on its next connection or withdraws it, and either publishes. */
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "transfer %016llx from %s: out of memory for its data-done event",
                           (unsigned long long)key, peer);
                return;
        }
        ev->kind = EV_DATA_DONE;
        ev->src_gen = gen;
        ev->rec.key = key;
        snprintf(ev->rec.peer, sizeof(ev->rec.peer), "%s", peer);
        conn_post(cn, ev);
}
