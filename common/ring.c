#include "ring.h"

#include <errno.h>
#include <string.h>

#include "atomics.h"
#include "doorbell.h"
#include "err.h"

static inline uint64_t *word_at(const struct kvf_ring *r, uint64_t pos)
{
        return (uint64_t *)(void *)(r->data + (pos & r->mask));
}

/*
 * Performance only: the producer asks for ownership of the cache lines it
 * will write a few records from now (kvf_ring_claim). Why: kvf_ring_commit()
 * rings the doorbell, whose full fence waits until every store of the record
 * has reached the cache; a line that the consumer zeroed on its last lap
 * still sits in the consumer's cache, so without this each commit stalls on
 * a cross-core miss. kvf-bench-ring (docs/BENCHMARKS.md), 64-byte records,
 * 16-vCPU Xeon VM, 3 runs interleaved with the same binary without this:
 * per-record commit 3.8-3.9 M -> 7.3-9.6 M records/s, batched publish
 * 8.8-14.7 M -> 29.6-34.4 M; 4 KiB records 1.44-1.67 M -> 1.49-1.53 M (no
 * change beyond noise). 256 bytes ahead, two lines: one line per record would
 * leave every ninth line of 72-byte records (64-byte payload + header)
 * unprefetched; 128 to 384 bytes, two or four lines, measured alike.
 * A prefetch changes no memory and orders nothing.
 */
#define PREFETCH_AHEAD 256u
#define PREFETCH_LINES 2u

static inline void prefetch_for_write(const void *p)
{
#if defined(__x86_64__)
        /* PREFETCHW is a hint (Intel CPUs without PRFCHW run it as a NOP).
         * __builtin_prefetch(p, 1) emits it only under -mprfchw and, built
         * without, emitted nothing at all here (GCC 12). */
        __asm__("prefetchw %0" : : "m"(*(const char *)p));
#else
        __builtin_prefetch(p, 1, 3);
#endif
}

void kvf_ring_format(struct kvf_ring_hdr *hdr, uint32_t id, uint32_t producer, uint32_t consumer,
                     uint32_t bell, uint64_t data_off, uint64_t capacity)
{
        memset(hdr, 0, sizeof(*hdr));
        hdr->capacity = capacity;
        hdr->data_off = data_off;
        hdr->id = id;
        hdr->producer = producer;
        hdr->consumer = consumer;
        hdr->bell = bell;
        hdr->abandoned_pos = ~0ull;
}

int kvf_ring_bind(struct kvf_ring *r, void *seg, uint64_t seg_size, struct kvf_ring_hdr *hdr,
                  struct kvf_doorbell *bell)
{
        uint64_t cap = kvf_load_relaxed(&hdr->capacity);
        uint64_t off = kvf_load_relaxed(&hdr->data_off);

        if (!kvf_ring_capacity_ok(cap))
                return kvf_err_set(-EINVAL, "ring %u: capacity %llu is not a power of two in [%u, %u]",
                                   hdr->id, (unsigned long long)cap, KVF_RING_MIN_CAPACITY,
                                   KVF_RING_MAX_CAPACITY);
        if (off % KVF_CACHE_LINE != 0 || off > seg_size || cap > seg_size - off)
                return kvf_err_set(-EINVAL, "ring %u: data [%llu, +%llu) is outside the %llu-byte segment",
                                   hdr->id, (unsigned long long)off, (unsigned long long)cap,
                                   (unsigned long long)seg_size);
        memset(r, 0, sizeof(*r));
        r->hdr = hdr;
        r->data = (uint8_t *)seg + off;
        r->capacity = cap;
        r->mask = cap - 1;
        r->bell = bell;
        r->full_ctr = NULL;
        r->head_cache = kvf_load_acquire(&hdr->head);
        return 0;
}

void kvf_ring_producer_attach(struct kvf_ring *r, uint64_t generation)
{
        r->gen16 = (uint16_t)generation;
        /* Release: a consumer that reads the new generation and then finds a
         * record stamped with an older one knows that record is abandoned. */
        kvf_store_release(&r->hdr->producer_gen, generation);
        r->head_cache = kvf_load_acquire(&r->hdr->head);
}

static void zero_range(struct kvf_ring *r, uint64_t from, uint64_t to)
{
        while (from < to) {
                uint64_t off = from & r->mask;
                uint64_t n = to - from;
                if (n > r->capacity - off)
                        n = r->capacity - off;
                memset(r->data + off, 0, n);
                from += n;
        }
}

int kvf_ring_consumer_attach(struct kvf_ring *r)
{
        uint64_t head = kvf_load_relaxed(&r->hdr->head);
        uint64_t to = kvf_load_relaxed(&r->hdr->zeroing_to);

        if (to <= head || to - head > r->capacity)
                return 0;
        /* The last consumer handled [head, to) and died while zeroing it. */
        zero_range(r, head, to);
        /* Pairs with the acquire load of head in kvf_ring_claim(). */
        kvf_store_release(&r->hdr->head, to);
        return 1;
}

static int write_pad(struct kvf_ring *r, uint64_t tail, uint64_t pad)
{
        /* Padding is committed at once: it carries no payload. Tail first, so
         * a consumer that sees the header (acquire, pairs with this release)
         * also sees a tail that covers it. */
        kvf_store_release(&r->hdr->tail, tail + pad);
        kvf_store_release(word_at(r, tail), KVF_REC_PACK(pad, KVF_REC_TYPE_PAD, r->gen16));
        return 0;
}

static bool fits(struct kvf_ring *r, uint64_t tail, uint64_t need)
{
        if (tail + need - r->head_cache <= r->capacity)
                return true;
        /* Pairs with the release store of head in kvf_ring_read(): the space
         * we are about to reuse has been zeroed. */
        r->head_cache = kvf_load_acquire(&r->hdr->head);
        return tail + need - r->head_cache <= r->capacity;
}

int kvf_ring_claim(struct kvf_ring *r, uint16_t type, uint32_t len, void **payload, uint64_t *pos)
{
        uint64_t size = kvf_ring_align((uint64_t)KVF_REC_HDR_SIZE + len);

        if (type == KVF_REC_TYPE_PAD || size > r->capacity || size > INT32_MAX)
                return -EMSGSIZE;
        uint64_t tail = kvf_load_relaxed(&r->hdr->tail);
        uint64_t to_end = r->capacity - (tail & r->mask);
        if (size > to_end) {
                /* Pad to the end on its own if only the padding fits: the
                 * record is then retried from offset 0 and can use the whole
                 * ring once the consumer catches up. */
                if (!fits(r, tail, to_end))
                        goto full;
                write_pad(r, tail, to_end);
                tail += to_end;
        }
        if (!fits(r, tail, size))
                goto full;
        kvf_store_relaxed(word_at(r, tail), KVF_REC_PACK(-(int32_t)(KVF_REC_HDR_SIZE + len), type,
                                                         r->gen16));
        /* Release: a consumer that sees this tail (abandoned-record check)
         * also sees the claimed header above. */
        kvf_store_release(&r->hdr->tail, tail + size);
        *payload = r->data + (tail & r->mask) + KVF_REC_HDR_SIZE;
        *pos = tail;
        /* Only free space: never pull a line the consumer has yet to read
         * (head_cache may lag head, which only makes this more careful). */
        uint64_t ahead = tail + size + PREFETCH_AHEAD;
        if (ahead + PREFETCH_LINES * KVF_CACHE_LINE - r->head_cache <= r->capacity)
                for (unsigned i = 0; i < PREFETCH_LINES; i++)
                        prefetch_for_write(r->data + ((ahead + i * KVF_CACHE_LINE) & r->mask));
        return 0;
full:
        kvf_fetch_add_relaxed(&r->hdr->full_events, 1);
        if (r->full_ctr)
                kvf_fetch_add_relaxed(r->full_ctr, 1);
        return -EAGAIN;
}

void kvf_ring_publish(struct kvf_ring *r, uint64_t pos)
{
        uint64_t *w = word_at(r, pos);
        uint64_t claimed = kvf_load_relaxed(w);

        /* Release pairs with the consumer's acquire load of the header: the
         * payload written before this store is visible once length > 0. */
        kvf_store_release(w, KVF_REC_PACK(-KVF_REC_LEN(claimed), KVF_REC_TYPE(claimed), r->gen16));
        /* Producer's own line; plain add, read only by tools. */
        kvf_store_relaxed(&r->hdr->records_written, kvf_load_relaxed(&r->hdr->records_written) + 1);
}

void kvf_ring_notify(struct kvf_ring *r)
{
        kvf_doorbell_ring(r->bell);
}

void kvf_ring_commit(struct kvf_ring *r, uint64_t pos)
{
        kvf_ring_publish(r, pos);
        kvf_doorbell_ring(r->bell);
}

/* Claim and fill a record, not yet published. */
static int claim_copy(struct kvf_ring *r, uint16_t type, const void *payload, uint32_t len, uint64_t *at)
{
        void *p;
        int rc = kvf_ring_claim(r, type, len, &p, at);

        if (rc < 0)
                return rc;
        if (len)
                memcpy(p, payload, len);
        return 0;
}

int kvf_ring_write(struct kvf_ring *r, uint16_t type, const void *payload, uint32_t len,
                   uint64_t *pos)
{
        uint64_t at;
        int rc = claim_copy(r, type, payload, len, &at);

        if (rc < 0)
                return rc;
        kvf_ring_commit(r, at);
        if (pos)
                *pos = at;
        return 0;
}

void kvf_bells_publish(struct kvf_bells *b, struct kvf_ring *r, uint64_t pos)
{
        kvf_ring_publish(r, pos);
        for (uint32_t i = 0; i < b->n; i++)
                if (b->r[i] == r)
                        return;
        if (b->n == KVF_BELLS_MAX)
                kvf_bells_ring(b);
        b->r[b->n++] = r;
}

void kvf_bells_ring(struct kvf_bells *b)
{
        for (uint32_t i = 0; i < b->n; i++)
                kvf_ring_notify(b->r[i]);
        b->n = 0;
}

int kvf_bells_write(struct kvf_bells *b, struct kvf_ring *r, uint16_t type, const void *payload,
                    uint32_t len)
{
        uint64_t pos;
        int rc = claim_copy(r, type, payload, len, &pos);
        if (rc < 0)
                return rc;
        kvf_bells_publish(b, r, pos);
        return 0;
}

/* A claimed record left behind by a producer generation that is gone. */
static bool is_abandoned(struct kvf_ring *r, uint64_t pos, uint64_t w)
{
        uint64_t gen = kvf_load_acquire(&r->hdr->producer_gen);

        if (KVF_REC_GEN(w) == (uint16_t)gen)
                return false;
        /* Pairs with the release store of tail in kvf_ring_claim(). */
        uint64_t tail = kvf_load_acquire(&r->hdr->tail);
        /* Re-read after tail: a new producer may have re-claimed this spot
         * (its predecessor died before moving tail). */
        if (kvf_load_acquire(word_at(r, pos)) != w)
                return false;
        uint64_t size = kvf_ring_align((uint64_t)-(int64_t)KVF_REC_LEN(w));
        return pos + size <= tail && (pos & r->mask) + size <= r->capacity;
}

bool kvf_ring_readable(struct kvf_ring *r)
{
        uint64_t head = kvf_load_relaxed(&r->hdr->head);
        uint64_t w = kvf_load_acquire(word_at(r, head));
        int32_t len = KVF_REC_LEN(w);

        if (r->bad && r->bad_pos == head && r->bad_word == w)
                return false; /* the corrupt record kvf_ring_read reported, still there */
        return len > 0 || (len < 0 && is_abandoned(r, head, w));
}

/*
 * Hand the committed records from *posp on (a record boundary at or after head) to fn, up to
 * `max` of them and within one lap of head; *posp ends after the last one handled, *np says how
 * many. `consume`: kvf_ring_read's walk (abandoned records counted, a corrupt header reported:
 * -EBADMSG); otherwise a look ahead that leaves the ring as it is. Returns 0 or -EBADMSG.
 */
static int walk(struct kvf_ring *r, uint64_t head, uint64_t *posp, int *np, kvf_ring_handler fn,
                void *ctx, unsigned max, bool consume)
{
        struct kvf_ring_hdr *h = r->hdr;
        uint64_t pos = *posp;
        int n = 0, rc = 0;

        /* Stop after one lap: bytes handled in this call are not zeroed yet,
         * so a full lap would bring us back to a record we just handled. */
        while ((unsigned)n < max && pos - head < r->capacity) {
                /* A record's payload usually runs into the next line: ask for
                 * it now rather than after the header says how long it is. */
                __builtin_prefetch(r->data + ((pos + KVF_CACHE_LINE) & r->mask));
                /* Pairs with the release store in kvf_ring_commit(). */
                uint64_t w = kvf_load_acquire(word_at(r, pos));
                int32_t len = KVF_REC_LEN(w);
                uint64_t off = pos & r->mask;

                if (len == 0)
                        break;
                if (len < 0) {
                        if (!is_abandoned(r, pos, w))
                                break;
                        if (consume) {
                                kvf_store_relaxed(&h->abandoned_pos, pos);
                                kvf_fetch_add_relaxed(&h->abandoned, 1);
                        }
                        pos += kvf_ring_align((uint64_t)-(int64_t)len);
                        continue;
                }
                uint64_t size = kvf_ring_align((uint64_t)len);
                /* Bounds only: a record inside the buffer and inside this lap. Not
                 * checked against `tail`, the producer's hot line: reading it for
                 * every record would bounce it between the two cores. */
                if ((uint32_t)len < KVF_REC_HDR_SIZE || off + size > r->capacity ||
                    pos + size - head > r->capacity) {
                        if (!consume || (r->bad && r->bad_pos == pos && r->bad_word == w))
                                break; /* (said already, or kvf_ring_read's to say) */
                        r->bad = true;
                        r->bad_pos = pos;
                        r->bad_word = w;
                        rc = kvf_err_set(-EBADMSG,
                                         "ring %u: corrupt record header at position %llu (length %d)",
                                         h->id, (unsigned long long)pos, len);
                        break;
                }
                if (KVF_REC_TYPE(w) != KVF_REC_TYPE_PAD) {
                        int hr = fn(ctx, KVF_REC_TYPE(w), r->data + off + KVF_REC_HDR_SIZE,
                                    (uint32_t)len - KVF_REC_HDR_SIZE, pos);
                        if (hr == -EAGAIN)
                                break;
                        n++;
                }
                pos += size;
        }
        *posp = pos;
        *np = n;
        return rc;
}

int kvf_ring_read(struct kvf_ring *r, kvf_ring_handler fn, void *ctx, unsigned max)
{
        struct kvf_ring_hdr *h = r->hdr;
        uint64_t head = kvf_load_relaxed(&h->head);
        uint64_t pos = head;
        int n, rc = walk(r, head, &pos, &n, fn, ctx, max, true);

        if (pos != head) {
                /* Crash window: records [head, pos) are handled. Say so before
                 * zeroing, so a successor finishes the zeroing instead of
                 * finding zeros at head and a ring that looks empty. */
                kvf_store_relaxed(&h->zeroing_to, pos);
                zero_range(r, head, pos);
                kvf_store_relaxed(&h->records_read, kvf_load_relaxed(&h->records_read) + (uint64_t)n);
                /* Pairs with the acquire load of head in fits(). */
                kvf_store_release(&h->head, pos);
        }
        return rc < 0 ? rc : n;
}

int kvf_ring_peek(struct kvf_ring *r, uint64_t *from, kvf_ring_handler fn, void *ctx, unsigned max)
{
        uint64_t head = kvf_load_relaxed(&r->hdr->head);
        int n;
        if (*from < head)
                *from = head;
        walk(r, head, from, &n, fn, ctx, max, false);
        return n;
}

uint16_t kvf_ring_record_gen(const struct kvf_ring *r, uint64_t pos)
{
        /* The consumer's own record, committed and not yet zeroed: no race. */
        return KVF_REC_GEN(kvf_load_relaxed(word_at(r, pos)));
}

uint64_t kvf_ring_used(const struct kvf_ring_hdr *hdr)
{
        uint64_t head = kvf_load_acquire(&hdr->head);
        uint64_t tail = kvf_load_acquire(&hdr->tail);
        return tail > head ? tail - head : 0;
}

int kvf_ring_delivered(struct kvf_ring *r, uint64_t pos)
{
        struct kvf_ring_hdr *h = r->hdr;

        if (pos == ~0ull || pos >= kvf_load_acquire(&h->tail))
                return 0;
        for (;;) {
                uint64_t head = kvf_load_acquire(&h->head);
                if (pos < head)
                        /* Consumed: delivered unless the consumer skipped it. */
                        return kvf_load_acquire(&h->abandoned_pos) != pos;
                uint64_t w = kvf_load_acquire(word_at(r, pos));
                int32_t len = KVF_REC_LEN(w);
                if (len > 0)
                        return 1;
                if (len < 0)
                        return 0; /* claimed by an earlier generation, never committed */
                /* Zeroed under our feet: consumed in the meantime; look again. */
        }
}
