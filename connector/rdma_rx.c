/*
 * The rdma transport, receiving side (see rdma.h): the rdma_cm listener, the
 * per-peer region made in the handshake, and the session thread that owns
 * one peer's queue pair and turns its done messages into complete transfers.
 *
 * What a peer holding a key can reach: the region registered for its own
 * connection: this instance's cache, remote write only (never read), from its
 * own queue pair only (its own protection domain: the key is worth nothing on
 * any other queue pair), for as long as its authenticated tcp anchor and
 * queue pair live; then the region is deregistered. docs/ARCHITECTURE.md
 * section 8 says what that leaves open.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "atomics.h"
#include "auth.h"
#include "clock.h"
#include "err.h"
#include "landing.h"
#include "layout.h"
#include "log.h"
#include "rdma.h"
#include "rdma_state.h"

#define RECV_SLOTS 128u /* done messages that may arrive before we repost (then RNR retry) */

struct rx_conn {
        struct connector *cn;
        char peer[KVF_INSTANCE_MAX];
        uint64_t gen;
        uint8_t ticket[RDMA_TICKET_LEN];
        struct ibv_pd *pd;
        struct rdma_mrs *mrs; /* the peer's regions: the cache, remote write */
        struct rdma_cm_id *id; /* the peer's connect, set by the listener (st->mu) */
        struct rdma_event_channel *ec;
        struct ibv_comp_channel *cc;
        struct ibv_cq *cq;
        unsigned cq_events;
        struct rdma_done_msg *bufs;
        struct ibv_mr *buf_mr;
        struct rx_conn *next;
};

/* SIGUSR2 with --rdma-test-dereg: every peer's region goes (tests of the completion errors). */
static unsigned dereg_signals;

static void on_sigusr2(int sig)
{
        (void)sig;
        __atomic_add_fetch(&dereg_signals, 1, __ATOMIC_RELAXED);
}

static int listen_addr(struct connector *cn, struct sockaddr_storage *ss)
{
        const char *dev = cn->cfg.rdma.device;
        if (dev[0]) {
                struct sockaddr_in sin;
                int rc = rdma_device_addr(dev, &sin);
                if (rc < 0)
                        return rc;
                memcpy(ss, &sin, sizeof(sin));
                return 0;
        }
        struct addrinfo hints = {.ai_flags = AI_NUMERICHOST}, *ai;
        if (getaddrinfo(cn->cfg.listen_host, NULL, &hints, &ai) != 0)
                return kvf_err_set(-EINVAL, "the listen address %s is not a numeric address: give --rdma-device",
                                   cn->cfg.listen_host);
        memcpy(ss, ai->ai_addr, ai->ai_addrlen);
        freeaddrinfo(ai);
        return 0;
}

static void *listener_main(void *arg)
{
        struct rdma_state *st = arg;
        struct connector *cn = st->cn;
        while (!conn_stopping(cn)) {
                struct pollfd pf = {.fd = st->ec->fd, .events = POLLIN};
                if (poll(&pf, 1, CONN_POLL_MS) <= 0)
                        continue;
                struct rdma_cm_event *ev;
                if (rdma_get_cm_event(st->ec, &ev))
                        continue;
                if (ev->event != RDMA_CM_EVENT_CONNECT_REQUEST) {
                        rdma_ack_cm_event(ev);
                        continue;
                }
                /* The private data is input from the network: its ticket must be one a
                 * handshake just gave out, unused so far. */
                struct rdma_cm_id *id = ev->id;
                const uint8_t *pd = ev->param.conn.private_data;
                bool ok = false;
                pthread_mutex_lock(&st->mu);
                if (pd && ev->param.conn.private_data_len >= RDMA_TICKET_LEN)
                        for (struct rx_conn *c = st->pending; c; c = c->next)
                                if (!c->id && kvf_auth_equal(c->ticket, pd, RDMA_TICKET_LEN)) {
                                        c->id = id;
                                        ok = true;
                                        break;
                                }
                if (ok)
                        pthread_cond_broadcast(&st->cv);
                pthread_mutex_unlock(&st->mu);
                rdma_ack_cm_event(ev);
                if (!ok) {
                        kvf_count(&cn->ctl, KVF_CTR_AUTH_FAILURES, 1);
                        kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR,
                                   "rdma connect without a ticket of an authenticated handshake: rejected");
                        rdma_reject(id, NULL, 0);
                        rdma_destroy_id(id);
                }
        }
        return NULL;
}

int rdma_rx_init(struct connector *cn, struct rdma_state *st)
{
        struct sockaddr_storage ss;
        int rc = listen_addr(cn, &ss);
        if (rc < 0)
                goto unavailable;
        st->ec = rdma_create_event_channel();
        if (!st->ec || rdma_create_id(st->ec, &st->listen_id, NULL, RDMA_PS_TCP)) {
                rc = kvf_err_set(-errno, "rdma_cm: %s", strerror(errno));
                goto unavailable;
        }
        if (rdma_bind_addr(st->listen_id, (struct sockaddr *)&ss)) {
                rc = kvf_err_set(-errno, "rdma_cm cannot bind %s: %s", cn->cfg.listen_host, strerror(errno));
                goto unavailable;
        }
        if (!st->listen_id->verbs) {
                rc = kvf_err_set(-ENODEV, "no rdma device has the address %s: listen on an address of an "
                                          "rdma interface, or give --rdma-device",
                                 cn->cfg.listen_host);
                goto unavailable;
        }
        if (rdma_listen(st->listen_id, 64)) {
                rc = kvf_err_set(-errno, "rdma_listen: %s", strerror(errno));
                goto unavailable;
        }
        st->ctx = st->listen_id->verbs;
        st->port = ntohs(rdma_get_src_port(st->listen_id));
        if (pthread_create(&st->listener, NULL, listener_main, st) != 0) {
                rc = kvf_err_set(-EAGAIN, "cannot start the rdma listener thread");
                goto unavailable;
        }
        kvf_store_release(&st->listening, 1);
        if (cn->cfg.rdma.test_dereg) {
                struct sigaction sa = {.sa_handler = on_sigusr2};
                sigemptyset(&sa.sa_mask);
                sigaction(SIGUSR2, &sa, NULL);
        }
        char a[INET6_ADDRSTRLEN] = "?";
        if (ss.ss_family == AF_INET)
                inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, a, sizeof(a));
        kvf_info("rdma: listening on %s (%s) rdma_cm port %u", ibv_get_device_name(st->ctx->device), a,
                 st->port);
        return 0;
unavailable:
        snprintf(st->unavailable, sizeof(st->unavailable), "%s", kvf_err_msg());
        kvf_warn("rdma: peers cannot send here over rdma: %s", st->unavailable);
        rdma_id_destroy(st->listen_id, st->ec);
        st->listen_id = NULL;
        st->ec = NULL;
        return rc;
}

void rdma_rx_fini(struct connector *cn, struct rdma_state *st)
{
        (void)cn;
        if (kvf_load_acquire(&st->listening))
                pthread_join(st->listener, NULL);
        /* Session threads end on conn_stopping and leave the pending list: wait a little. */
        for (int i = 0; i < 100; i++) {
                pthread_mutex_lock(&st->mu);
                bool empty = !st->pending;
                pthread_mutex_unlock(&st->mu);
                if (empty)
                        break;
                usleep(20000);
        }
        rdma_id_destroy(st->listen_id, st->ec);
}

static void conn_unlink(struct rdma_state *st, struct rx_conn *c)
{
        pthread_mutex_lock(&st->mu);
        for (struct rx_conn **pp = &st->pending; *pp; pp = &(*pp)->next)
                if (*pp == c) {
                        *pp = c->next;
                        break;
                }
        pthread_mutex_unlock(&st->mu);
}

/* Everything of one connection, in reverse order of creation; c is freed. */
static void conn_free(struct rdma_state *st, struct rx_conn *c)
{
        conn_unlink(st, c);
        rdma_qp_cq_destroy(c->id, c->cq, c->cq_events, c->cc);
        if (c->buf_mr)
                ibv_dereg_mr(c->buf_mr);
        free(c->bufs);
        rdma_mrs_free(c->mrs);
        rdma_id_destroy(c->id, c->ec);
        if (c->pd)
                ibv_dealloc_pd(c->pd);
        free(c);
}

int rdma_welcome(struct connector *cn, const struct peer_identity *id, struct kvf_record *w, void **state)
{
        struct rdma_state *st = rdma_state(cn);
        if (!st || st->unavailable[0] || !st->ctx)
                return kvf_err_set(-EPROTONOSUPPORT, "rdma is not available at '%s': %s", cn->ctl.hdr->instance,
                                   st && st->unavailable[0] ? st->unavailable : "not a decode instance");
        struct rx_conn *c = calloc(1, sizeof(*c));
        if (!c)
                return kvf_err_set(-ENOMEM, "out of memory");
        c->cn = cn;
        snprintf(c->peer, sizeof(c->peer), "%s", id->instance);
        c->gen = id->created_ns;
        /* The peer's own region: its own protection domain, so its key is worth nothing on
         * any other peer's queue pair, and it goes when this connection ends. The engine's
         * caches: those registered now, and the connection ends when they are registered
         * anew (rdma_serve). */
        char why[KVF_REASON_MAX];
        int rc = kvf_cache_refresh(&cn->cache) < 0 ? kvf_err_ctx(-EIO, "rdma: the engine's caches") : 0;
        if (rc == 0 && (rc = rdma_engine_caches_why(cn, why, sizeof(why))) < 0)
                rc = kvf_err_set(rc, "rdma into '%s': %s", cn->ctl.hdr->instance, why); /* (-ENODATA: for now) */
        if (rc == 0 && !(c->pd = ibv_alloc_pd(st->ctx)))
                rc = kvf_err_set(-EIO, "rdma: no protection domain for peer '%s'", id->instance);
        if (rc == 0) {
                kvf_cache_hold(&cn->cache);
                rc = rdma_reg_mrs(c->pd, &cn->cache, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, &c->mrs, NULL);
                if (rc < 0)
                        rc = kvf_err_ctx(rc, "rdma: cannot register the cache for peer '%s'", id->instance);
                else if (cn->cache.parts)
                        rc = rdma_mrs_table(&cn->cache, c->mrs, &w->rdma_parts, &w->n_rdma_parts);
                w->rdma_addr = cn->cache.parts ? 0 : (uint64_t)(uintptr_t)cn->cache.base; /* (parts: the table) */
                kvf_cache_release(&cn->cache);
        }
        if (rc == 0 && kvf_random(c->ticket, sizeof(c->ticket)) < 0)
                rc = kvf_err_set(-EIO, "rdma: no random ticket for peer '%s'", id->instance);
        if (rc < 0) {
                conn_free(st, c);
                return rc;
        }
        w->rdma_port = st->port;
        /* (the peer's cache as its layout says: a cache in parts has its table besides) */
        w->rdma_len = cn->ctl.hdr->layout.cache_bytes;
        w->rdma_rkey = c->mrs->mr[0]->rkey;
        memcpy(w->rdma_ticket, c->ticket, RDMA_TICKET_LEN);
        pthread_mutex_lock(&st->mu);
        c->next = st->pending;
        st->pending = c;
        pthread_mutex_unlock(&st->mu);
        *state = c;
        return 0;
}

void rdma_welcome_undo(struct connector *cn, void *state)
{
        conn_free(rdma_state(cn), state);
}

static int post_recv(struct rx_conn *c, unsigned slot)
{
        struct ibv_sge sge = {.addr = (uintptr_t)&c->bufs[slot], .length = sizeof(c->bufs[slot]),
                              .lkey = c->buf_mr->lkey};
        struct ibv_recv_wr wr = {.wr_id = slot, .sg_list = &sge, .num_sge = 1}, *bad;
        int rc = ibv_post_recv(c->id->qp, &wr, &bad);
        return rc ? -rc : 0;
}

/* The connect with this handshake's ticket, its queue pair, accepted. 0 or -errno (kvf_err). */
static int accept_conn(struct rdma_state *st, struct rx_conn *c, int fd)
{
        struct connector *cn = c->cn;
        uint64_t end = kvf_now_ns() + kvf_ms(2ull * cn->cfg.connect_timeout_ms);
        pthread_mutex_lock(&st->mu);
        while (!c->id && !conn_stopping(cn) && kvf_now_ns() < end) {
                struct timespec ts = kvf_ts_after(CLOCK_REALTIME, kvf_ms(100));
                pthread_cond_timedwait(&st->cv, &st->mu, &ts);
        }
        pthread_mutex_unlock(&st->mu);
        (void)fd;
        if (!c->id)
                return kvf_err_set(-ETIMEDOUT, "no rdma_cm connect with this handshake's ticket");
        c->ec = rdma_create_event_channel();
        if (!c->ec || rdma_migrate_id(c->id, c->ec))
                return kvf_err_set(-errno, "rdma_cm: %s", strerror(errno));
        c->cc = ibv_create_comp_channel(c->id->verbs);
        c->cq = c->cc ? ibv_create_cq(c->id->verbs, RECV_SLOTS + 8, NULL, c->cc, 0) : NULL;
        if (!c->cq)
                return kvf_err_set(-errno, "ibv_create_cq: %s", strerror(errno));
        struct ibv_qp_init_attr qa = {.send_cq = c->cq, .recv_cq = c->cq,
                                      .cap = {.max_send_wr = 4, .max_recv_wr = RECV_SLOTS,
                                              .max_send_sge = 1, .max_recv_sge = 1},
                                      .qp_type = IBV_QPT_RC};
        if (rdma_create_qp(c->id, c->pd, &qa))
                return kvf_err_set(-errno, "rdma_create_qp: %s", strerror(errno));
        c->bufs = calloc(RECV_SLOTS, sizeof(*c->bufs));
        c->buf_mr = c->bufs ? ibv_reg_mr(c->pd, c->bufs, RECV_SLOTS * sizeof(*c->bufs), IBV_ACCESS_LOCAL_WRITE)
                            : NULL;
        if (!c->buf_mr)
                return kvf_err_set(-ENOMEM, "cannot register the receive buffers");
        for (unsigned i = 0; i < RECV_SLOTS; i++)
                if (post_recv(c, i) < 0)
                        return kvf_err_set(-EIO, "ibv_post_recv failed");
        if (ibv_req_notify_cq(c->cq, 0))
                return kvf_err_set(-errno, "ibv_req_notify_cq: %s", strerror(errno));
        struct rdma_conn_param cp = {.responder_resources = 0, .initiator_depth = 0, .rnr_retry_count = 7};
        if (rdma_accept(c->id, &cp))
                return kvf_err_set(-errno, "rdma_accept: %s", strerror(errno));
        struct rdma_cm_event *ev;
        int rc = rdma_cm_wait(c->ec, RDMA_CM_EVENT_ESTABLISHED, cn->cfg.connect_timeout_ms, &ev);
        if (rc < 0)
                return rc;
        rdma_ack_cm_event(ev);
        return 0;
}

/* Take what the completion queue has. 0 while the connection is fine; < 0 (why) when it ends. */
static int take_completions(struct rx_conn *c, char *why, size_t whylen)
{
        struct connector *cn = c->cn;
        struct ibv_wc wc[16];
        int n;
        while ((n = ibv_poll_cq(c->cq, 16, wc)) > 0)
                for (int i = 0; i < n; i++) {
                        if (wc[i].status != IBV_WC_SUCCESS) {
                                snprintf(why, whylen, "receive completion: %s", rdma_wc_str(wc[i].status));
                                return -EIO;
                        }
                        unsigned slot = (unsigned)wc[i].wr_id;
                        if (slot >= RECV_SLOTS || !(wc[i].opcode & IBV_WC_RECV)) {
                                snprintf(why, whylen, "an unexpected completion (opcode %d)", wc[i].opcode);
                                return -EPROTO;
                        }
                        struct rdma_done_msg m = c->bufs[slot];
                        if (wc[i].byte_len != sizeof(m) || ntohl(m.magic) != RDMA_DONE_MAGIC ||
                            ntohs(m.status) >= KVF_STATUS_COUNT) {
                                snprintf(why, whylen, "a message of %u bytes that is no done message",
                                         wc[i].byte_len);
                                kvf_count(&cn->ctl, KVF_CTR_FRAMES_REJECTED, 1);
                                return -EPROTO;
                        }
                        kvf_count(&cn->ctl, KVF_CTR_RDMA_DONE_RECEIVED, 1);
                        /* Every write of the transfer before this SEND has landed (RC order). */
                        char fwhy[KVF_REASON_MAX] = "";
                        int status = ntohs(m.status);
                        if (status && ntohs(m.wc_status))
                                snprintf(fwhy, sizeof(fwhy), "the prefill side's rdma write of this request failed: %s",
                                         rdma_wc_str((enum ibv_wc_status)ntohs(m.wc_status)));
                        else if (status) /* (given up before its writes: the prefill engine's caches went) */
                                snprintf(fwhy, sizeof(fwhy), "the prefill side gave it up: %s", kvf_status_name(status));
                        /* GPU memory: what the NIC wrote is made visible to the GPU work after it
                         * (the engine's kernels) before the arrival can be published. */
                        else if (cn->cache.be->rdma_flush && cn->cache.be->rdma_flush(&cn->cache) < 0) {
                                status = KVF_STATUS_WRITE;
                                snprintf(fwhy, sizeof(fwhy), "%s", kvf_err_msg());
                        } else if (rdma_mrs_stale(c->cn, c->mrs)) {
                                status = KVF_STATUS_ENGINE_GONE;
                                snprintf(fwhy, sizeof(fwhy), "the engine's caches of '%s' were %s during the "
                                         "transfer: its bytes went to the old ones", cn->ctl.hdr->instance,
                                         kvf_load_acquire(&cn->ctl.hdr->reg_generation) & 1 ? "registered anew"
                                                                                           : "dropped");
                        }
                        int crc = conn_landing_complete(cn, c->peer, c->gen, be64toh(m.key),
                                                        be64toh(m.session), status, fwhy);
                        if (crc < 0)
                                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "rdma: out of memory for a done message");
                        else if (crc == 1)
                                conn_post_data_done(cn, c->peer, c->gen, be64toh(m.key));
                        if (post_recv(c, slot) < 0) {
                                snprintf(why, whylen, "ibv_post_recv failed");
                                return -EIO;
                        }
                }
        if (n < 0) {
                snprintf(why, whylen, "ibv_poll_cq failed");
                return -EIO;
        }
        return 0;
}

void rdma_serve(struct connector *cn, int fd, const struct peer_identity *id, const char *remote, void *state)
{
        struct rdma_state *st = rdma_state(cn);
        struct rx_conn *c = state;
        char why[KVF_REASON_MAX] = "stopping";
        if (!c)
                return;
        if (accept_conn(st, c, fd) < 0) {
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "rdma connection from '%s' (%s): %s", id->instance,
                           remote, kvf_err_msg());
                conn_free(st, c);
                return;
        }
        kvf_info("rdma connection from '%s' (%s) on %s: its region is this cache, %llu bytes, for remote writes",
                 id->instance, remote, ibv_get_device_name(c->id->verbs->device),
                 (unsigned long long)cn->cache.bytes);
        unsigned seen = __atomic_load_n(&dereg_signals, __ATOMIC_RELAXED);
        while (!conn_stopping(cn)) {
                struct pollfd pf[3] = {{.fd = fd, .events = POLLIN}, {.fd = c->cc->fd, .events = POLLIN},
                                       {.fd = c->ec->fd, .events = POLLIN}};
                int n = poll(pf, 3, CONN_POLL_MS);
                if (n < 0 && errno != EINTR) {
                        snprintf(why, sizeof(why), "poll: %s", strerror(errno));
                        break;
                }
                unsigned d = __atomic_load_n(&dereg_signals, __ATOMIC_RELAXED);
                if (d != seen && c->mrs) {
                        /* Test hook (--rdma-test-dereg): the peer's writes now fail remotely. */
                        seen = d;
                        rdma_mrs_free(c->mrs);
                        c->mrs = NULL;
                        kvf_warn("rdma: test: the region of peer '%s' deregistered (SIGUSR2)", id->instance);
                }
                if (rdma_mrs_stale(c->cn, c->mrs)) {
                        /* Its regions pin the old memory: they go now (what completed before
                         * is answered first, "engine gone"); the peer connects again and
                         * registers the new memory. */
                        if (take_completions(c, why, sizeof(why)) == 0)
                                snprintf(why, sizeof(why), "the engine's caches were registered anew");
                        break;
                }
                if (n <= 0)
                        continue;
                if (pf[0].revents) {
                        /* The peer never writes on its anchor: end of stream or an error ends it,
                         * anything else is a protocol violation. */
                        char b;
                        ssize_t r = recv(fd, &b, 1, MSG_DONTWAIT);
                        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
                                snprintf(why, sizeof(why), "its tcp anchor closed");
                                break;
                        }
                        if (r > 0) {
                                snprintf(why, sizeof(why), "it wrote on its tcp anchor: protocol error");
                                break;
                        }
                }
                if (pf[2].revents) {
                        struct rdma_cm_event *ev;
                        if (rdma_get_cm_event(c->ec, &ev) == 0) {
                                enum rdma_cm_event_type t = ev->event;
                                rdma_ack_cm_event(ev);
                                if (t == RDMA_CM_EVENT_DISCONNECTED || t == RDMA_CM_EVENT_DEVICE_REMOVAL) {
                                        snprintf(why, sizeof(why), "%s", rdma_event_str(t));
                                        break;
                                }
                        }
                }
                if (pf[1].revents) {
                        struct ibv_cq *cq;
                        void *ctx;
                        if (ibv_get_cq_event(c->cc, &cq, &ctx) == 0)
                                c->cq_events++;
                        if (ibv_req_notify_cq(c->cq, 0)) {
                                snprintf(why, sizeof(why), "ibv_req_notify_cq failed");
                                break;
                        }
                }
                /* (also after re-arming: a completion between the poll and the arming
                 * raises no event) */
                if (take_completions(c, why, sizeof(why)) < 0)
                        break;
        }
        kvf_info("rdma connection from '%s' (%s) ended: %s", id->instance, remote, why);
        rdma_disconnect(c->id);
        conn_free(st, c);
}
