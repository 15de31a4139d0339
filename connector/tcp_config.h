/* The tcp transport's options (kvf-connector --streams, --zerocopy): part of conn_config. */
#ifndef KVF_TCP_CONFIG_H
#define KVF_TCP_CONFIG_H

#include <stdbool.h>

struct conn_tcp_config {
        unsigned streams; /* data connections per peer */
        bool zerocopy;    /* send data frames with MSG_ZEROCOPY (io_uring send_zc) */
};

#endif
