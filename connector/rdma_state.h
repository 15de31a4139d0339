/* The rdma transport's per-connector state (rdma_dev.c, rdma_rx.c, rdma_tx.c only). */
#ifndef KVF_RDMA_STATE_H
#define KVF_RDMA_STATE_H

#include <pthread.h>
#include <stdint.h>

#include "rdma.h"

/* This cache's registration on one device, for sending (prefill side): of the engine's
 * caches, the registration's newest (older ones live as long as connections use them). */
struct rdma_dev {
        struct ibv_context *ctx;
        struct ibv_pd *pd;
        struct rdma_mrs *mrs; /* a reference of its own; NULL until the first connection */
        struct rdma_dev *next;
};

struct rx_conn;

struct rdma_state {
        struct connector *cn;
        pthread_mutex_t mu; /* devs, pending, and each pending rx_conn's id */
        pthread_cond_t cv;  /* a pending handshake's rdma_cm connect arrived */
        struct rdma_dev *devs;
        /* Why this connector's cache cannot be written or read by rdma at all (tasks
         * fail with it, and the handshake of an rdma data connection is refused), or "". */
        char no_cache[192];
        /* Why peers cannot send here over rdma (the handshake is refused with it), or "". */
        char unavailable[192];
        /* prefill side, control thread only (rdma_unavailable): the rdma devices this host
         * has, and when they were counted (counted again after a second) */
        int ndevices;
        uint64_t devices_ns;
        /* decode side: the rdma_cm listener */
        struct rdma_event_channel *ec;
        struct rdma_cm_id *listen_id;
        uint16_t port;
        struct ibv_context *ctx; /* the device the listener is bound to */
        pthread_t listener;
        int listening; /* atomic: the listener thread runs */
        struct rx_conn *pending; /* connections from handshake to teardown */
};

#endif
