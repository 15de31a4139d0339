/*
 * Single-producer single-consumer ring of variable-length records in shared
 * memory (see docs/ARCHITECTURE.md section 4).
 *
 * Record: an 8-byte header word {int32 length, u16 type, u16 generation}
 * followed by the payload, padded to 8 bytes. The length word is the commit
 * flag: 0 never written, < 0 claimed and being written, > 0 committed.
 * length counts the header, so an empty record has length 8. A record never
 * crosses the end of the buffer: a padding record fills the rest instead.
 * The consumer zeroes what it consumed before it moves `head`.
 *
 * Crashes:
 *  - producer dies between claim and commit: the record carries the old
 *    producer generation; once a new producer attaches (new generation), the
 *    consumer skips it ("abandoned") and notes its position.
 *  - consumer dies while zeroing: `zeroing_to` records the head it was
 *    moving to; kvf_ring_consumer_attach() finishes the job.
 *  - consumer dies before moving head: the records are read again by the
 *    next consumer; handlers must be idempotent on `pos` (positions are
 *    unique for the life of the segment).
 *
 * Threading: one producer thread and one consumer thread per ring at a time
 * (callers in one process serialise with their own mutex).
 */
#ifndef KVF_RING_H
#define KVF_RING_H

#include <stdbool.h>
#include <stdint.h>

#include "shm_layout.h"

#define KVF_RING_MIN_CAPACITY 4096u
#define KVF_RING_MAX_CAPACITY (1u << 30)

/* A ring's capacity is a power of two in [KVF_RING_MIN_CAPACITY, KVF_RING_MAX_CAPACITY]. */
static inline bool kvf_ring_capacity_ok(uint64_t cap)
{
        return cap >= KVF_RING_MIN_CAPACITY && cap <= KVF_RING_MAX_CAPACITY && (cap & (cap - 1)) == 0;
}

struct kvf_ring {
        struct kvf_ring_hdr *hdr;
        uint8_t *data;
        uint64_t capacity;
        uint64_t mask;
        struct kvf_doorbell *bell; /* the consumer's doorbell */
        uint64_t head_cache;       /* producer: last head seen */
        uint16_t gen16;            /* producer: generation stamped on records */
        uint64_t *full_ctr;        /* also counted here when a claim finds the ring full (or NULL) */
        /* consumer: a corrupt record header met at bad_pos (its word bad_word), reported once;
         * while it is there the ring reads as empty (a consumer waits instead of spinning on it) */
        bool bad;
        uint64_t bad_pos, bad_word;
};

/* Format a ring header (the allocator, before the segment is published). */
void kvf_ring_format(struct kvf_ring_hdr *hdr, uint32_t id, uint32_t producer, uint32_t consumer,
                     uint32_t bell, uint64_t data_off, uint64_t capacity);

/*
 * Build a process-local view. Validates the header's constants against the
 * segment (power-of-two capacity in range, data inside the segment); returns
 * 0 or -EINVAL with kvf_err set.
 */
int kvf_ring_bind(struct kvf_ring *r, void *seg, uint64_t seg_size, struct kvf_ring_hdr *hdr,
                  struct kvf_doorbell *bell);

/* The producer announces its generation before it writes anything. */
void kvf_ring_producer_attach(struct kvf_ring *r, uint64_t generation);

/* The consumer repairs an interrupted zeroing; returns 1 if it did, else 0. */
int kvf_ring_consumer_attach(struct kvf_ring *r);

/*
 * Claim space for a record with `len` payload bytes. On success *payload
 * points at the payload (8-byte aligned) and *pos is the record's position.
 * Returns 0, -EAGAIN when the ring is full (nothing changed, retry later),
 * -EMSGSIZE when the record can never fit.
 */
int kvf_ring_claim(struct kvf_ring *r, uint16_t type, uint32_t len, void **payload, uint64_t *pos);
/* Publish a claimed record and ring the consumer's doorbell. */
void kvf_ring_commit(struct kvf_ring *r, uint64_t pos);
/*
 * Batching: kvf_ring_publish() commits without ringing the doorbell;
 * kvf_ring_notify() rings it once for everything published so far.
 */
void kvf_ring_publish(struct kvf_ring *r, uint64_t pos);
void kvf_ring_notify(struct kvf_ring *r);
/* Claim, copy, commit. */
int kvf_ring_write(struct kvf_ring *r, uint16_t type, const void *payload, uint32_t len,
                   uint64_t *pos);

/*
 * Bells owed, one thread's: a producer that writes several rings in a turn of its loop
 * publishes with kvf_bells_publish() (or kvf_bells_write: claim, copy, publish) and, after each
 * batch, rings each of those rings' consumers once for all it published to it with
 * kvf_bells_ring(). A burst of records into one consumer (a step's finish notices into a
 * decode connector) then wakes it once, not once per record. More rings than KVF_BELLS_MAX
 * are rung early, never lost.
 */
#define KVF_BELLS_MAX 72u
struct kvf_bells {
        struct kvf_ring *r[KVF_BELLS_MAX];
        uint32_t n;
};
void kvf_bells_publish(struct kvf_bells *b, struct kvf_ring *r, uint64_t pos);
void kvf_bells_ring(struct kvf_bells *b);
/* 0, or kvf_ring_claim's error (nothing written). */
int kvf_bells_write(struct kvf_bells *b, struct kvf_ring *r, uint16_t type, const void *payload,
                    uint32_t len);

/*
 * A handler sees one committed record. Returning -EAGAIN stops the read and
 * leaves that record (and the rest) in the ring; any other value consumes it.
 */
typedef int (*kvf_ring_handler)(void *ctx, uint16_t type, const uint8_t *payload, uint32_t len,
                                uint64_t pos);

/*
 * Hand up to `max` committed records to fn, then zero them and move head.
 * Returns the number of records handed to fn (>= 0), or -EBADMSG when the
 * ring holds a header that cannot be right (the ring is then left as is).
 * A corrupt header is reported once: while it stays at head the ring reads as
 * empty (kvf_ring_readable false, kvf_ring_read 0), so its consumer sleeps on
 * its doorbell instead of spinning on it.
 */
int kvf_ring_read(struct kvf_ring *r, kvf_ring_handler fn, void *ctx, unsigned max);

/*
 * The consumer's look ahead: hand the committed records from *from on (a position an earlier
 * peek returned, or anything at or below head, which means head) to fn without consuming them,
 * up to `max`; *from ends after the last record handled, so the next peek goes on from there.
 * fn returning -EAGAIN stops it before that record. Returns the number handled. The records
 * stay in the ring for kvf_ring_read, which hands them over again.
 */
int kvf_ring_peek(struct kvf_ring *r, uint64_t *from, kvf_ring_handler fn, void *ctx, unsigned max);

/*
 * Inside a handler: the low 16 bits of the generation of the producer that
 * wrote the record at `pos` (the engine session of an engine's record).
 */
uint16_t kvf_ring_record_gen(const struct kvf_ring *r, uint64_t pos);

/*
 * The full generation whose low 16 bits are gen16, counting back from `cur`
 * (the producer's generation now): records are read in order and a producer
 * restarts far fewer than 65536 times while one of its records waits.
 */
static inline uint64_t kvf_gen_from16(uint64_t cur, uint16_t gen16)
{
        uint64_t back = (uint16_t)((uint16_t)cur - gen16);
        return cur >= back ? cur - back : 0;
}

/* True when the next record is committed or abandoned (consumer side). */
bool kvf_ring_readable(struct kvf_ring *r);

/* Bytes claimed and not yet consumed (any side, approximate under motion). */
uint64_t kvf_ring_used(const struct kvf_ring_hdr *hdr);

/*
 * For exactly-once hand-over by a restarted producer: 1 if the record claimed
 * at `pos` was committed (whether or not consumed yet), 0 if it was never
 * claimed or was abandoned. Call after kvf_ring_producer_attach().
 */
int kvf_ring_delivered(struct kvf_ring *r, uint64_t pos);

static inline uint64_t kvf_ring_align(uint64_t n)
{
        return (n + KVF_REC_ALIGN - 1) & ~(uint64_t)(KVF_REC_ALIGN - 1);
}

#endif
