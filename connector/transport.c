/*
 * The transports of this build: one line each (transport.h).
 */
#include <string.h>

#include "transport.h"

const struct conn_transport *const conn_transports[] = {
        &conn_tcp_transport,
#ifdef KVF_HAVE_RDMA
        &conn_rdma_transport,
#endif
};
const unsigned conn_ntransports = sizeof(conn_transports) / sizeof(conn_transports[0]);
_Static_assert(sizeof(conn_transports) / sizeof(conn_transports[0]) <= CONN_MAX_TRANSPORTS,
               "raise CONN_MAX_TRANSPORTS");

const struct conn_transport *conn_transport_of(int id)
{
        for (unsigned i = 0; i < conn_ntransports; i++)
                if (conn_transports[i]->id == id)
                        return conn_transports[i];
        return NULL;
}

const struct conn_transport *conn_transport_by_purpose(const char *purpose)
{
        for (unsigned i = 0; i < conn_ntransports; i++)
                if (!strcmp(conn_transports[i]->purpose, purpose))
                        return conn_transports[i];
        return NULL;
}

unsigned conn_transport_index(const struct conn_transport *t)
{
        for (unsigned i = 0; i < conn_ntransports; i++)
                if (conn_transports[i] == t)
                        return i;
        return 0;
}

int conn_transports_init(struct connector *cn)
{
        for (unsigned i = 0; i < conn_ntransports; i++) {
                if (!conn_transports[i]->init)
                        continue;
                int rc = conn_transports[i]->init(cn);
                if (rc < 0) {
                        while (i-- > 0)
                                if (conn_transports[i]->fini)
                                        conn_transports[i]->fini(cn);
                        return rc;
                }
        }
        return 0;
}

void conn_transports_fini(struct connector *cn)
{
        for (unsigned i = conn_ntransports; i-- > 0;)
                if (conn_transports[i]->fini)
                        conn_transports[i]->fini(cn);
}
