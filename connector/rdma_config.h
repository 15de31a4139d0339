/* The rdma transport's options (kvf-connector --rdma-*): part of conn_config. */
#ifndef KVF_RDMA_CONFIG_H
#define KVF_RDMA_CONFIG_H

#include <stdbool.h>

struct conn_rdma_config {
        char device[64];      /* --rdma-device: use this device (its netdev's address); "" = the
                               * interface of the listen address (decode) or of the route (prefill) */
        unsigned sq_depth;    /* --rdma-sq-depth: work requests outstanding per queue pair */
        unsigned signal_every; /* --rdma-signal-every: one signalled work request in this many */
        unsigned ack_timeout;  /* --rdma-ack-timeout: the queue pair's local ACK timeout, as the
                                * exponent of 4.096 us x 2^N (1..31); 0 = rdma_cm's own choice */
        bool test_dereg;      /* --rdma-test-dereg: SIGUSR2 deregisters every peer's region (tests) */
};

#endif
