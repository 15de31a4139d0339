/*
 * The sender's outbox: records for the connector (open, write batch, finish),
 * encoded into one scratch buffer and written to ring sender->connector.
 *
 * What a failed post means decides what happens to the request: a full ring
 * (-EAGAIN) or a failed allocation (-ENOMEM) is back-pressure, and the slot
 * tries again from the same place later; a record that can never be encoded
 * or never fit the ring (-ENOSPC, -EINVAL, -EMSGSIZE) would be retried for
 * ever, so its request fails now with "write error" and the reason.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "log.h"
#include "sender.h"

int sender_encode(struct sender *s, const struct kvf_record *r, size_t *len)
{
        size_t need = kvf_record_encoded_max(r);
        if (need > s->scratch_cap) {
                uint8_t *p = realloc(s->scratch, need);
                if (!p)
                        return kvf_err_set(-ENOMEM, "out of memory for a %zu-byte %s record", need,
                                           kvf_rec_type_name(r->type));
                s->scratch = p;
                s->scratch_cap = need;
        }
        int n = kvf_record_encode(r, s->scratch, s->scratch_cap);
        if (n < 0)
                return kvf_err_set(n, "cannot encode the %s record: %s", kvf_rec_type_name(r->type),
                                   strerror(-n));
        *len = (size_t)n;
        return 0;
}

int sender_post(struct sender *s, const struct kvf_record *r)
{
        size_t len = 0; /* set when sender_encode succeeds */
        int rc = sender_encode(s, r, &len);
        if (rc < 0)
                return rc;
        struct kvf_ring *ring = &s->ctl.rings[KVF_RING_SENDER_TO_CONNECTOR];
        rc = kvf_ring_write(ring, (uint16_t)r->type, s->scratch, (uint32_t)len, NULL);
        if (rc == -EMSGSIZE)
                return kvf_err_set(rc, "a %zu-byte %s record can never fit ring sender->connector (%llu bytes)",
                                   len, kvf_rec_type_name(r->type), (unsigned long long)ring->capacity);
        return rc;
}

bool sender_post_retry(struct sender *s, uint32_t slot, int rc)
{
        if (rc == -EAGAIN || rc == -ENOMEM)
                return true;
        kvf_errlog(&s->ctl, KVF_ROLE_SENDER, "req %s: %s", s->ctl.reqtab[slot].request_id, kvf_err_msg());
        sender_fail(s, slot, KVF_STATUS_WRITE, "%s", kvf_err_msg());
        return false;
}
