/*
 * Incoming connections (the decode side of a notice), and arrivals.
 *
 * The journal (in the control segment) remembers, for the last
 * KVF_JOURNAL_ENTRIES arrivals, the hash of (prefill instance, transfer key)
 * and where the arrival record was claimed in connector->engine. A notice
 * sent again (prefill connector restarted, connection dropped before the
 * ack) is acknowledged without a second arrival if the first was committed,
 * and published if it was not (we crashed between claim and commit).
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "atomics.h"
#include "clock.h"
#include "connector.h"
#include "data.h"
#include "err.h"
#include "layout.h"
#include "log.h"

#define JEMPTY UINT32_MAX

/* A transfer, across restarts of either side: the prefill instance, its incarnation, the key. */
static uint64_t journal_key(const struct kvf_record *n, uint64_t src_gen)
{
        char buf[KVF_PEER_MAX + 48];
        int len = snprintf(buf, sizeof(buf), "%s/%016llx/%016llx", n->peer, (unsigned long long)src_gen,
                           (unsigned long long)n->key);
        return kvf_hash64(buf, (size_t)len, 0x6a);
}

static void jidx_put(struct connector *cn, uint64_t h, uint32_t entry)
{
        uint32_t mask = cn->jidx_cap - 1;
        for (uint32_t i = (uint32_t)h & mask;; i = (i + 1) & mask)
                if (cn->jidx[i] == JEMPTY || cn->ctl.journal[cn->jidx[i]].key_hash == h) {
                        cn->jidx[i] = entry;
                        return;
                }
}

static uint32_t jidx_find(const struct connector *cn, uint64_t h)
{
        uint32_t mask = cn->jidx_cap - 1;
        for (uint32_t i = (uint32_t)h & mask;; i = (i + 1) & mask) {
                uint32_t e = cn->jidx[i];
                if (e == JEMPTY)
                        return JEMPTY;
                if (cn->ctl.journal[e].key_hash == h)
                        return e;
        }
}

/* Rebuild the index from the journal; entries overwritten later are stale and skipped. */
static void jidx_rebuild(struct connector *cn)
{
        memset(cn->jidx, 0xff, cn->jidx_cap * sizeof(uint32_t));
        for (uint32_t e = 0; e < KVF_JOURNAL_ENTRIES; e++)
                if (cn->ctl.journal[e].key_hash)
                        jidx_put(cn, cn->ctl.journal[e].key_hash, e);
}

void conn_journal_init(struct connector *cn)
{
        cn->jidx_cap = 4 * KVF_JOURNAL_ENTRIES;
        cn->jidx = malloc(cn->jidx_cap * sizeof(uint32_t));
        if (!cn->jidx)
                abort();
        /* Continue after the newest entry: the one with the largest ring position. */
        uint64_t best = 0;
        cn->jnext = 0;
        for (uint32_t e = 0; e < KVF_JOURNAL_ENTRIES; e++)
                if (cn->ctl.journal[e].key_hash && cn->ctl.journal[e].ring_pos + 1 > best) {
                        best = cn->ctl.journal[e].ring_pos + 1;
                        cn->jnext = (e + 1) % KVF_JOURNAL_ENTRIES;
                }
        jidx_rebuild(cn);
}

bool conn_arrival_published(struct connector *cn, const struct kvf_record *n, uint64_t src_gen)
{
        pthread_mutex_lock(&cn->engine_mu);
        uint32_t e = jidx_find(cn, journal_key(n, src_gen));
        bool yes = e != JEMPTY && kvf_ring_delivered(&cn->ctl.rings[KVF_RING_CONNECTOR_TO_ENGINE],
                                                     cn->ctl.journal[e].ring_pos);
        pthread_mutex_unlock(&cn->engine_mu);
        return yes;
}

static int publish_locked(struct connector *cn, const struct kvf_record *n, uint64_t src_gen,
                          int status, const char *why, uint64_t session, char *reason,
                          size_t reasonlen);

int conn_publish_arrival(struct connector *cn, const struct kvf_record *n, uint64_t src_gen,
                         int status, const char *why, uint64_t session, char *reason,
                         size_t reasonlen)
{
        /* The journal and the ring's producer side move together. */
        pthread_mutex_lock(&cn->engine_mu);
        int rc = publish_locked(cn, n, src_gen, status, why, session, reason, reasonlen);
        pthread_mutex_unlock(&cn->engine_mu);
        return rc;
}

static int publish_locked(struct connector *cn, const struct kvf_record *n, uint64_t src_gen,
                          int status, const char *why, uint64_t session, char *reason,
                          size_t reasonlen)
{
        const struct kvf_ctl_header *h = cn->ctl.hdr;
        const struct kvf_cache_layout *L = &h->layout;
        struct kvf_ring *ring = &cn->ctl.rings[KVF_RING_CONNECTOR_TO_ENGINE];
        uint64_t key = journal_key(n, src_gen);
        uint32_t e = jidx_find(cn, key);

        reason[0] = '\0';
        if (e != JEMPTY && kvf_ring_delivered(ring, cn->ctl.journal[e].ring_pos)) {
                /* Published already: say how, so the sender's side agrees with ours. */
                kvf_count(&cn->ctl, KVF_CTR_ARRIVALS_DEDUPED, 1);
                int was = (int)cn->ctl.journal[e].status;
                if (was != KVF_STATUS_FINISHED)
                        snprintf(reason, reasonlen, "the arrival was published as '%s' already",
                                 kvf_status_name(was));
                return was;
        }
        if (status == KVF_STATUS_FINISHED) {
                if (n->transport == KVF_TRANSPORT_IPC && n->generation != h->created_ns) {
                        snprintf(reason, reasonlen,
                                 "instance '%s' was restarted during the transfer: the blocks went into its previous cache",
                                 h->instance);
                        return KVF_STATUS_CONNECTION;
                }
                for (uint32_t i = 0; i < n->n_dst; i++)
                        if (n->dst[i] >= L->num_blocks) {
                                snprintf(reason, reasonlen,
                                         "dest_block_ids[%u] = %u is out of range: '%s' has %u blocks", i,
                                         n->dst[i], h->instance, L->num_blocks);
                                return KVF_STATUS_BLOCK_RANGE;
                        }
        }
        /* Every byte of a finished arrival landed: its blocks in every layer and tensor
         * (the notice's own count is the sender's, which does not count tcp bytes). */
        uint64_t bytes = status == KVF_STATUS_FINISHED
                                 ? (uint64_t)n->n_dst * kvf_layout_layers(L) * kvf_layout_tensors(L) *
                                           L->block_bytes
                                 : n->bytes;
        struct kvf_record a = {.type = KVF_RT_ARRIVAL, .status = status, .bytes = bytes,
                               .blocks = n->n_dst, .dst = n->dst, .n_dst = n->n_dst,
                               .done_ns = kvf_now_ns(), .session = session, .id_bin = n->id_bin};
        snprintf(a.request_id, sizeof(a.request_id), "%s", n->request_id);
        snprintf(a.peer, sizeof(a.peer), "%s", n->peer);
        snprintf(a.reason, sizeof(a.reason), "%s", why ? why : n->reason);
        uint8_t *buf;
        size_t len;
        void *p;
        uint64_t pos;
        if (kvf_record_encode_alloc(&a, &buf, &len) < 0)
                return -ENOMEM;
        if (kvf_ring_claim(ring, KVF_RT_ARRIVAL, (uint32_t)len, &p, &pos) < 0) {
                free(buf);
                return -EAGAIN;
        }
        /* Journal before commit: a successor can then ask the ring whether it landed. */
        uint32_t slot = cn->jnext;
        cn->jnext = (cn->jnext + 1) % KVF_JOURNAL_ENTRIES;
        struct kvf_journal_entry *je = &cn->ctl.journal[slot];
        kvf_store_relaxed(&je->key_hash, 0);
        kvf_store_relaxed(&je->ring_pos, pos);
        kvf_store_relaxed(&je->status, (uint32_t)status);
        kvf_store_relaxed(&je->session, session);
        kvf_store_release(&je->key_hash, key);
        /* The overwritten entry's index position now points at the new key's
         * entry or at a stale hash; rebuild lazily when the index fills up. */
        jidx_put(cn, key, slot);
        if ((cn->jnext & 1023) == 0)
                jidx_rebuild(cn);
        memcpy(p, buf, len);
        free(buf);
        kvf_ring_commit(ring, pos);
        kvf_count(&cn->ctl, KVF_CTR_ARRIVALS, 1);
        if (session && session != conn_engine_session(cn))
                kvf_count(&cn->ctl, KVF_CTR_ARRIVALS_STALE, 1);
        kvf_debug("req %s: arrival from %s (%s), %llu bytes", n->request_id, n->peer,
                  kvf_status_name(status), (unsigned long long)bytes);
        /* The status this notice is answered with: the one just published. (An error
         * arrival acknowledges an abort; the sender decided that status already.) */
        return status;
}

/* ---- sessions ---- */

static void session_add(struct connector *cn, struct session *s)
{
        pthread_mutex_lock(&cn->smu);
        s->id = ++cn->next_session;
        s->next = cn->sessions;
        cn->sessions = s;
        pthread_mutex_unlock(&cn->smu);
}

static void session_remove(struct connector *cn, struct session *s)
{
        pthread_mutex_lock(&cn->smu);
        for (struct session **pp = &cn->sessions; *pp; pp = &(*pp)->next)
                if (*pp == s) {
                        *pp = s->next;
                        break;
                }
        pthread_mutex_unlock(&cn->smu);
}

int conn_session_send(struct connector *cn, uint64_t id, const struct kvf_record *r)
{
        int rc = -ENOENT;
        pthread_mutex_lock(&cn->smu);
        for (struct session *s = cn->sessions; s; s = s->next)
                if (s->id == id) {
                        pthread_mutex_lock(&s->wmu);
                        rc = conn_send_record(s->fd, r, cn->cfg.keepalive_ms);
                        pthread_mutex_unlock(&s->wmu);
                        break;
                }
        pthread_mutex_unlock(&cn->smu);
        return rc;
}

void conn_sessions_send_all(struct connector *cn, const struct kvf_record *r)
{
        pthread_mutex_lock(&cn->smu);
        for (struct session *s = cn->sessions; s; s = s->next) {
                pthread_mutex_lock(&s->wmu);
                conn_send_record(s->fd, r, cn->cfg.keepalive_ms);
                pthread_mutex_unlock(&s->wmu);
        }
        pthread_mutex_unlock(&cn->smu);
}

struct session_arg {
        struct connector *cn;
        int fd;
        bool unix_socket; /* accepted on the same-host listener */
};

static void *session_main(void *arg)
{
        struct session_arg *sa = arg;
        struct connector *cn = sa->cn;
        struct session *s = calloc(1, sizeof(*s));
        struct peer_identity id;
        struct kvf_reader rd = {0};
        uint64_t dead = (uint64_t)cn->cfg.peer_timeout_ms * 1000000ull;

        if (!s)
                goto out_fd;
        s->fd = sa->fd;
        pthread_mutex_init(&s->wmu, NULL);
        kvf_net_peer_name(s->fd, s->remote, sizeof(s->remote));
        if (sa->unix_socket && kvf_net_unix_same_user(s->fd) < 0) {
                kvf_count(&cn->ctl, KVF_CTR_AUTH_FAILURES, 1);
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "unix connection refused: %s", kvf_err_msg());
                goto out_free;
        }
        char purpose[16];
        if (conn_handshake_server(cn, s->fd, &id, purpose, sizeof(purpose)) < 0) {
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "connection from %s refused: %s", s->remote,
                           kvf_err_msg());
                goto out_free;
        }
        snprintf(s->instance, sizeof(s->instance), "%s", id.instance);
        s->peer_gen = id.created_ns;
        if (!strcmp(purpose, "data")) {
                data_rx_serve(cn, s->fd, s->instance, s->peer_gen, s->remote);
                goto out_free;
        }
        kvf_info("peer instance '%s' connected from %s", s->instance, s->remote);
        if (kvf_reader_init(&rd, KVF_FRAME_MAX + KVF_FRAME_HDR) < 0)
                goto out_free;
        session_add(cn, s);
        uint64_t last_rx = kvf_now_ns();
        while (!cn->stop) {
                struct pollfd pf = {.fd = s->fd, .events = POLLIN};
                int n = poll(&pf, 1, (int)cn->cfg.keepalive_ms);
                if (n < 0 && errno != EINTR)
                        break;
                if (n <= 0) {
                        if (kvf_now_ns() - last_rx > dead) {
                                kvf_warn("peer instance '%s' (%s) silent for %u ms: closing", s->instance,
                                         s->remote, cn->cfg.peer_timeout_ms);
                                break;
                        }
                        continue;
                }
                int rc = kvf_reader_fill(&rd, s->fd);
                if (rc == -EAGAIN)
                        continue;
                if (rc <= 0)
                        break;
                last_rx = kvf_now_ns();
                struct kvf_frame_hdr h;
                const uint8_t *pl;
                while ((rc = kvf_reader_next(&rd, &h, &pl)) == 1) {
                        if (h.type == KVF_RT_PING) {
                                struct kvf_record pong = {.type = KVF_RT_PONG,
                                                          .session = conn_engine_session(cn)};
                                pthread_mutex_lock(&s->wmu);
                                conn_send_record(s->fd, &pong, cn->cfg.keepalive_ms);
                                pthread_mutex_unlock(&s->wmu);
                                continue;
                        }
                        if (h.type == KVF_RT_PONG)
                                continue;
                        struct event *ev = calloc(1, sizeof(*ev));
                        if (!ev)
                                continue;
                        if (h.type != KVF_RT_NOTICE ||
                            kvf_record_decode(KVF_RT_NOTICE, pl, h.len, 0, &ev->rec) < 0) {
                                kvf_count(&cn->ctl, KVF_CTR_FRAMES_REJECTED, 1);
                                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR,
                                           "peer '%s' (%s) sent a bad frame (type %u): %s: disconnecting",
                                           s->instance, s->remote, h.type,
                                           h.type == KVF_RT_NOTICE ? kvf_err_msg() : "unexpected type");
                                kvf_record_free(&ev->rec);
                                free(ev);
                                goto out_session;
                        }
                        /* The notice names its sender by the authenticated instance. */
                        snprintf(ev->rec.peer, sizeof(ev->rec.peer), "%s", s->instance);
                        ev->kind = EV_NOTICE;
                        ev->session = s->id;
                        ev->src_gen = s->peer_gen;
                        conn_dispatch(cn, ev); /* publish and acknowledge from this thread */
                }
                if (rc < 0) {
                        kvf_count(&cn->ctl, KVF_CTR_FRAMES_REJECTED, 1);
                        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR,
                                   "peer '%s' (%s) announced a %u-byte frame: disconnecting", s->instance,
                                   s->remote, h.len);
                        break;
                }
        }
out_session:
        session_remove(cn, s);
        kvf_info("peer instance '%s' (%s) disconnected", s->instance, s->remote);
out_free:
        /* No one can reach s after session_remove: the control thread sends under smu. */
        kvf_reader_free(&rd);
        pthread_mutex_destroy(&s->wmu);
        free(s);
out_fd:
        close(sa->fd);
        free(sa);
        return NULL;
}

void *conn_listener_main(void *arg)
{
        struct connector *cn = arg;
        while (!cn->stop) {
                struct pollfd pf[2] = {{.fd = cn->listen_fd, .events = POLLIN},
                                       {.fd = cn->unix_fd, .events = POLLIN}}; /* (-1: ignored) */
                if (poll(pf, 2, 200) <= 0)
                        continue;
                bool from_unix = !(pf[0].revents & POLLIN);
                int fd = from_unix ? kvf_net_accept(cn->unix_fd, false) : kvf_net_accept(cn->listen_fd, true);
                if (fd < 0)
                        continue;
                struct session_arg *sa = malloc(sizeof(*sa));
                pthread_t t;
                pthread_attr_t at;
                if (!sa) {
                        close(fd);
                        continue;
                }
                sa->cn = cn;
                sa->fd = fd;
                sa->unix_socket = from_unix;
                pthread_attr_init(&at);
                pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
                if (pthread_create(&t, &at, session_main, sa) != 0) {
                        close(fd);
                        free(sa);
                }
                pthread_attr_destroy(&at);
        }
        return NULL;
}
