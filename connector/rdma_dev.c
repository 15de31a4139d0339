/*
 * The rdma transport: what both sides share (see rdma.h). Devices, the
 * registration of this instance's own cache, rdma_cm event waits, and the
 * transport's table of ops.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "atomics.h"
#include "clock.h"
#include "err.h"
#include "layout.h"
#include "log.h"
#include "rdma.h"
#include "rdma_state.h"

void rdma_qp_cq_destroy(struct rdma_cm_id *id, struct ibv_cq *cq, unsigned cq_events,
                        struct ibv_comp_channel *cc)
{
        if (id && id->qp)
                rdma_destroy_qp(id);
        if (cq) {
                ibv_ack_cq_events(cq, cq_events);
                ibv_destroy_cq(cq);
        }
        if (cc)
                ibv_destroy_comp_channel(cc);
}

void rdma_id_destroy(struct rdma_cm_id *id, struct rdma_event_channel *ec)
{
        if (id)
                rdma_destroy_id(id);
        if (ec)
                rdma_destroy_event_channel(ec);
}

struct rdma_state *rdma_state(struct connector *cn)
{
        return cn->transport[conn_transport_index(&conn_rdma_transport)];
}

int rdma_device_addr(const char *name, struct sockaddr_in *out)
{
        int n = 0, rc = -ENODEV;
        struct ibv_device **list = ibv_get_device_list(&n);
        if (!list)
                return kvf_err_set(-ENODEV, "rdma device '%s': no rdma devices here (%s)", name,
                                   strerror(errno));
        for (int i = 0; i < n && rc == -ENODEV; i++) {
                if (strcmp(ibv_get_device_name(list[i]), name))
                        continue;
                struct ibv_context *ctx = ibv_open_device(list[i]);
                if (!ctx)
                        break;
                struct ibv_port_attr pa;
                if (ibv_query_port(ctx, 1, &pa) == 0)
                        for (int g = 0; g < pa.gid_tbl_len && g < 64; g++) {
                                union ibv_gid gid;
                                static const uint8_t v4mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
                                if (ibv_query_gid(ctx, 1, g, &gid) || memcmp(gid.raw, v4mapped, 12))
                                        continue;
                                /* A RoCE v2 GID of an IPv4 address: the interface's address. */
                                *out = (struct sockaddr_in){.sin_family = AF_INET};
                                memcpy(&out->sin_addr, gid.raw + 12, 4);
                                rc = 0;
                                break;
                        }
                ibv_close_device(ctx);
        }
        ibv_free_device_list(list);
        if (rc < 0)
                return kvf_err_set(rc, "rdma device '%s': not found, or its port 1 has no IPv4 address", name);
        return 0;
}

bool rdma_mrs_stale(const struct connector *cn, const struct rdma_mrs *m)
{
        return cn->cache.be->id == KVF_BACKEND_ENGINE && m &&
               m->reg_gen != kvf_load_acquire(&cn->ctl.hdr->reg_generation);
}

/* st->mu held: drop a reference; the last one deregisters. */
static void mrs_put_locked(struct rdma_mrs *m)
{
        if (m && --m->refs == 0)
                rdma_mrs_free(m);
}

void rdma_local_mrs_put(struct connector *cn, struct rdma_mrs *m)
{
        struct rdma_state *st = rdma_state(cn);
        if (!m)
                return;
        pthread_mutex_lock(&st->mu);
        mrs_put_locked(m);
        pthread_mutex_unlock(&st->mu);
}

int rdma_engine_caches_why(struct connector *cn, char *why, size_t whylen)
{
        const struct kvf_ctl_header *h = cn->ctl.hdr;
        why[0] = 0;
        if (cn->cache.be->id != KVF_BACKEND_ENGINE)
                return 0;
        if (!(kvf_load_acquire(&h->reg_generation) & 1)) {
                snprintf(why, whylen, "instance '%s' is waiting for the engine's caches: register them first "
                         "(kvf_register_caches, Client.register_caches)", h->instance);
                return -ENODATA;
        }
        return 0;
}

int rdma_local_mrs(struct connector *cn, struct ibv_context *ctx, struct ibv_pd **pd, struct rdma_mrs **out)
{
        struct rdma_state *st = rdma_state(cn);
        char why[KVF_REASON_MAX];
        int rc = 0;
        /* The engine's caches: the registration mapped now (one the engine made since the last
         * use replaces the old mapping here, and its memory gets its own regions below). */
        if (kvf_cache_refresh(&cn->cache) < 0)
                return kvf_err_ctx(-EIO, "rdma: the engine's caches");
        if ((rc = rdma_engine_caches_why(cn, why, sizeof(why))) < 0)
                return kvf_err_set(rc, "%s", why);
        pthread_mutex_lock(&st->mu);
        struct rdma_dev *d = st->devs;
        while (d && d->ctx != ctx)
                d = d->next;
        if (!d) {
                d = calloc(1, sizeof(*d));
                if (!d) {
                        rc = kvf_err_set(-ENOMEM, "rdma: out of memory");
                        goto out;
                }
                d->ctx = ctx;
                if (!(d->pd = ibv_alloc_pd(ctx))) {
                        rc = kvf_err_set(-EIO, "rdma: no protection domain on %s", ibv_get_device_name(ctx->device));
                        free(d);
                        goto out;
                }
                d->next = st->devs;
                st->devs = d;
        }
        kvf_cache_hold(&cn->cache);
        if (d->mrs && d->mrs->reg_gen != cn->cache.reg_gen) {
                /* Registered anew: new connections use the new memory; the old regions go with
                 * the last connection that used them. */
                mrs_put_locked(d->mrs);
                d->mrs = NULL;
        }
        if (!d->mrs) {
                /* The source of writes only: no remote access at all. */
                const char *how = NULL;
                struct rdma_mrs *m;
                if ((rc = rdma_reg_mrs(d->pd, &cn->cache, IBV_ACCESS_LOCAL_WRITE, &m, &how)) < 0) {
                        kvf_cache_release(&cn->cache);
                        rc = kvf_err_ctx(rc, "rdma");
                        goto out;
                }
                m->refs = 1; /* the device's own */
                d->mrs = m;
                kvf_info("rdma: this cache (%llu bytes, %s) registered on %s for sending: %u region%s",
                         (unsigned long long)cn->ctl.hdr->layout.cache_bytes,
                         how, ibv_get_device_name(ctx->device), m->n, m->n == 1 ? "" : "s");
        }
        kvf_cache_release(&cn->cache);
        d->mrs->refs++;
        *pd = d->pd;
        *out = d->mrs;
out:
        pthread_mutex_unlock(&st->mu);
        return rc;
}

int rdma_cm_wait(struct rdma_event_channel *ec, enum rdma_cm_event_type want, unsigned timeout_ms,
                 struct rdma_cm_event **out)
{
        struct pollfd pf = {.fd = ec->fd, .events = POLLIN};
        int rc = poll(&pf, 1, (int)timeout_ms);
        if (rc < 0)
                return kvf_err_set(-errno, "waiting for %s: %s", rdma_event_str(want), strerror(errno));
        if (rc == 0)
                return kvf_err_set(-ETIMEDOUT, "no %s within %u ms", rdma_event_str(want), timeout_ms);
        struct rdma_cm_event *ev;
        if (rdma_get_cm_event(ec, &ev))
                return kvf_err_set(-errno, "rdma_get_cm_event: %s", strerror(errno));
        if (ev->event != want) {
                int st = ev->status;
                enum rdma_cm_event_type got = ev->event;
                rdma_ack_cm_event(ev);
                return kvf_err_set(got == RDMA_CM_EVENT_REJECTED ? -ECONNREFUSED : -ECONNABORTED,
                                   "expected %s, got %s (status %d%s%s)", rdma_event_str(want),
                                   rdma_event_str(got), st, st < 0 ? ": " : "", st < 0 ? strerror(-st) : "");
        }
        *out = ev;
        return 0;
}

const char *rdma_wc_str(enum ibv_wc_status st)
{
        return ibv_wc_status_str(st);
}

int rdma_wc_is_link(enum ibv_wc_status st)
{
        /* The peer, the link or the queue pair is gone: no request's own fault. */
        return st == IBV_WC_WR_FLUSH_ERR || st == IBV_WC_RETRY_EXC_ERR ||
               st == IBV_WC_RNR_RETRY_EXC_ERR || st == IBV_WC_RESP_TIMEOUT_ERR ||
               st == IBV_WC_FATAL_ERR;
}

/*
 * --rdma-device names a device of this host, or the connector does not start: a
 * typo would otherwise leave an instance up that refuses every rdma transfer.
 * The message lists the devices there are.
 */
static int check_device(const char *name)
{
        int n = 0;
        struct ibv_device **list = ibv_get_device_list(&n);
        char have[160] = "";
        size_t used = 0;
        bool found = false;
        for (int i = 0; list && i < n; i++) {
                const char *d = ibv_get_device_name(list[i]);
                found |= !strcmp(d, name);
                int w = snprintf(have + used, sizeof(have) - used, "%s%s", used ? ", " : "", d);
                if (w > 0 && (size_t)w < sizeof(have) - used)
                        used += (size_t)w;
        }
        if (list)
                ibv_free_device_list(list);
        if (found)
                return 0;
        if (!used)
                return kvf_err_set(-ENODEV, "--rdma-device %s: this host has no rdma device (leave "
                                            "--rdma-device out to run without rdma)", name);
        return kvf_err_set(-ENODEV, "--rdma-device %s: no such rdma device on this host; it has: %s", name,
                           have);
}

static int rdma_init(struct connector *cn)
{
        if (cn->cfg.rdma.device[0]) {
                int rc = check_device(cn->cfg.rdma.device);
                if (rc < 0)
                        return rc;
        }
        struct rdma_state *st = calloc(1, sizeof(*st));
        if (!st)
                return kvf_err_set(-ENOMEM, "rdma: out of memory");
        st->cn = cn;
        pthread_mutex_init(&st->mu, NULL);
        pthread_cond_init(&st->cv, NULL);
        cn->transport[conn_transport_index(&conn_rdma_transport)] = st;
        /* One-sided writes need the cache's own memory, registered: host memory, or GPU
         * memory a NIC can reach (rdma_mr.c). */
        if (cn->cache.be->id == KVF_BACKEND_ENGINE) {
                /* The engine's caches: their memory is known once registered, and registered
                 * with a NIC at each connection (rdma_engine_caches_why, rdma_reg_mrs). */
                if (cn->ctl.hdr->reg_gpu)
                        kvf_info("rdma: the engine's GPU caches are registered with NICs through the dma-buf "
                                 "of each allocation its engine exported, else as peer memory "
                                 "(nvidia_peermem)");
        } else if (!cn->cache.host && !cn->cache.be->dmabuf) {
                snprintf(st->no_cache, sizeof(st->no_cache),
                         "rdma needs a host cache used in place; this one (backend %s) is not",
                         cn->cache.be->name);
                snprintf(st->unavailable, sizeof(st->unavailable), "%s", st->no_cache);
                kvf_info("rdma: %s", st->no_cache);
                return 0;
        }
        if (cn->cache.parts && !cn->cache.host) {
                kvf_info("rdma: the GPU cache is one allocation per tensor: NICs register each as peer memory "
                         "(nvidia_peermem)");
        } else if (!cn->cache.host && cn->cache.be->dmabuf) { /* GPU memory: can a NIC be given it? */
                int fd;
                uint64_t len;
                if (cn->cache.be->dmabuf(&cn->cache, &fd, &len) == 0) {
                        close(fd);
                        kvf_info("rdma: the GPU cache exports as a dma-buf (%llu bytes): NICs register it "
                                 "with ibv_reg_dmabuf_mr", (unsigned long long)len);
                } else {
                        kvf_info("rdma: the GPU cache does not export as a dma-buf (%s): registration will "
                                 "try peer memory (nvidia_peermem)", kvf_err_msg());
                }
        }
        uint32_t role = cn->ctl.hdr->instance_role;
        if (role == KVF_IROLE_DECODE || role == KVF_IROLE_MIXED)
                rdma_rx_init(cn, st); /* (not fatal: tcp still works; the reason is kept) */
        return 0;
}

static int rdma_unavailable(struct connector *cn, bool receive, char *why, size_t whylen)
{
        struct rdma_state *st = rdma_state(cn);
        if (!st) {
                snprintf(why, whylen, "the rdma transport did not start");
                return -ENODEV;
        }
        if (receive) {
                if (st->unavailable[0] || !st->ctx) {
                        snprintf(why, whylen, "%s", st->unavailable[0] ? st->unavailable : "not a decode instance");
                        return -EPROTONOSUPPORT;
                }
                return 0;
        }
        if (st->no_cache[0]) {
                snprintf(why, whylen, "%s", st->no_cache);
                return -EPROTONOSUPPORT;
        }
        /* A device may be added while the connector runs (a soft-RoCE link): count again
         * now and then, not on every transfer. */
        uint64_t now = kvf_now_ns();
        if (!st->devices_ns || kvf_elapsed(now, st->devices_ns) > kvf_ms(1000)) {
                int n = 0;
                struct ibv_device **l = ibv_get_device_list(&n);
                st->ndevices = l ? n : 0;
                if (l)
                        ibv_free_device_list(l);
                st->devices_ns = now;
        }
        if (st->ndevices <= 0) {
                snprintf(why, whylen, "no rdma device on this host");
                return -ENODEV;
        }
        return 0;
}

static void rdma_fini(struct connector *cn)
{
        struct rdma_state *st = rdma_state(cn);
        if (!st)
                return;
        rdma_rx_fini(cn, st);
        while (st->devs) {
                struct rdma_dev *d = st->devs;
                st->devs = d->next;
                mrs_put_locked(d->mrs); /* (connections are gone: the last reference) */
                ibv_dealloc_pd(d->pd);
                free(d);
        }
        pthread_cond_destroy(&st->cv);
        pthread_mutex_destroy(&st->mu);
        free(st);
        cn->transport[conn_transport_index(&conn_rdma_transport)] = NULL;
}

const struct conn_transport conn_rdma_transport = {
        .name = "rdma",
        .id = KVF_TRANSPORT_RDMA,
        .purpose = "rdma",
        .frame_max = KVF_FRAME_MAX_RDMA, /* a work request's length (common/records.h) */
        .init = rdma_init,
        .fini = rdma_fini,
        .peer_init = rdma_peer_init,
        .start = rdma_start,
        .stop = rdma_stop,
        .peer_free = rdma_peer_free,
        .xfer_open = rdma_xfer_open,
        .xfer_free = rdma_xfer_free,
        .noticed = rdma_noticed,
        .wake = rdma_wake,
        .unavailable = rdma_unavailable,
        .welcome = rdma_welcome,
        .welcome_undo = rdma_welcome_undo,
        .serve = rdma_serve,
};
