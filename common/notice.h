/*
 * Notice slots of a decode instance's control segment (shm_layout.h, struct
 * kvf_notice_slot): the same-host path for finish notices and their answers,
 * in one hop instead of through two connectors and a unix socket.
 *
 * Holder side (a prefill sender, with the decode segment mapped read-write):
 * kvf_notice_claim() finds the slot this prefill instance held before (same
 * instance name and incarnation) or a free one, and takes it by a CAS of its
 * pid, refused while another live process holds it. The holder then produces
 * into `notice` and consumes `reply`; it must call kvf_notice_heartbeat() at
 * the heartbeat period of the decode segment, or the slot may be taken from it.
 *
 * Consumer side (the decode connector): kvf_notice_bind() gives a view of
 * slot s's rings; kvf_notice_connector_attach() (once, after the connector
 * claimed its role) repairs a predecessor's half-done consume of every notice
 * ring and produces replies under the connector's generation.
 *
 * Thread safety: one thread per end of each ring, as for every ring.
 */
#ifndef KVF_NOTICE_H
#define KVF_NOTICE_H

#include <stdbool.h>
#include <stdint.h>

#include "ctl.h"
#include "ring.h"

struct kvf_notice_end {
        struct kvf_ctl *peer;         /* the decode instance's segment (not owned) */
        struct kvf_notice_slot *slot; /* NULL: none held */
        uint32_t idx;
        uint64_t generation;          /* ours, as stored in the slot */
        uint64_t peer_created_ns;     /* the decode segment's identity when claimed */
        int32_t pid;                  /* the process that claimed it (asked once, not per notice) */
        struct kvf_ring notice;       /* we produce */
        struct kvf_ring reply;        /* we consume */
};

/*
 * Claim a slot of `peer` for prefill instance `owner` whose own segment was
 * created at `owner_created_ns`. Returns the slot index (>= 0) and fills
 * `out`, or -EBUSY with kvf_err set when every slot is held by a live process
 * (the caller falls back to the socket path), or -EINVAL.
 */
int kvf_notice_claim(struct kvf_ctl *peer, const char *owner, uint64_t owner_created_ns,
                     struct kvf_notice_end *out);
/* Refresh the holder's heartbeat. */
void kvf_notice_heartbeat(struct kvf_notice_end *e);
/* True while we still hold the slot and the decode segment is the one we claimed in. */
bool kvf_notice_held(const struct kvf_notice_end *e);
/* Give the slot back (clean exit): state STOPPED, then pid 0. Notices still in
 * the ring stay there for the connector. */
void kvf_notice_release(struct kvf_notice_end *e);

/* Whether slot s's holder is a live process (pid, start time, heartbeat). */
bool kvf_notice_holder_alive(const struct kvf_ctl *c, uint32_t s, uint64_t now_ns);

/* The connector's view of slot s's rings: it consumes `notice`, produces `reply`. */
int kvf_notice_bind(struct kvf_ctl *c, uint32_t s, struct kvf_ring *notice, struct kvf_ring *reply);
/* Connector start: finish a predecessor's consume of every notice ring and produce
 * replies under `generation`. Returns the number of rings repaired. */
int kvf_notice_connector_attach(struct kvf_ctl *c, struct kvf_ring notice[KVF_NOTICE_SLOTS],
                                struct kvf_ring reply[KVF_NOTICE_SLOTS], uint64_t generation);

#endif
