/* The sender's in-process indexes over the shared request table. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "sender.h"

#define EMPTY UINT32_MAX

int sender_table_init(struct sender *s)
{
        uint32_t n = s->ctl.hdr->reqtab_slots;
        s->map_cap = 1;
        while (s->map_cap < 2 * n)
                s->map_cap <<= 1;
        s->map = malloc(s->map_cap * sizeof(*s->map));
        s->armed = malloc(n * sizeof(*s->armed));
        s->rq = calloc(n, 1);
        s->flags = calloc(n, 1);
        s->tmp = malloc(n * sizeof(*s->tmp));
        s->resend = calloc(n, sizeof(*s->resend));
        s->cut = calloc(n, sizeof(*s->cut));
        s->runs = malloc(3ull * s->ctl.hdr->max_blocks * sizeof(*s->runs));
        uint32_t idset_cap = 1; /* a power of two, at least 2x the blocks of a request */
        while (idset_cap < 2 * s->ctl.hdr->max_blocks)
                idset_cap <<= 1;
        s->idset = calloc(idset_cap, sizeof(*s->idset));
        s->booked = calloc(n, 1);
        s->abort_since = calloc(n, sizeof(*s->abort_since));
        if (!s->map || !s->armed || !s->rq || !s->flags || !s->tmp || !s->resend || !s->cut ||
            !s->runs || !s->idset || !s->booked || !s->abort_since)
                return kvf_err_set(-ENOMEM, "out of memory for a %u-slot request table", n);
        memset(s->map, 0xff, s->map_cap * sizeof(*s->map));
        for (uint32_t i = 0; i < n; i++)
                s->armed[i] = UINT64_MAX;
        return 0;
}

void sender_table_free(struct sender *s)
{
        for (uint32_t i = 0; i < s->nbuckets; i++)
                free(s->buckets[i].slots);
        free(s->buckets);
        s->buckets = NULL;
        s->nbuckets = s->capbuckets = 0;
        free(s->map);
        free(s->armed);
        free(s->rq);
        free(s->flags);
        free(s->tmp);
        free(s->resend);
        free(s->cut);
        free(s->runs);
        free(s->idset);
        free(s->book);
        free(s->booked);
        free(s->abort_since);
        s->abort_since = NULL;
        s->book = NULL;
        s->booked = NULL;
        s->book_cap = s->book_n = s->book_shift = 0;
        s->map = NULL;
        s->armed = NULL;
        s->rq = s->flags = NULL;
        s->armed_copies = 0;
        s->tmp = s->resend = s->runs = s->idset = NULL;
        s->cut = NULL;
}

static uint32_t home(const struct sender *s, const char *id)
{
        return (uint32_t)kvf_hash64(id, strlen(id), 7) & (s->map_cap - 1);
}

uint32_t sender_map_find(const struct sender *s, const char *request_id)
{
        for (uint32_t i = home(s, request_id);; i = (i + 1) & (s->map_cap - 1)) {
                uint32_t slot = s->map[i];
                if (slot == EMPTY)
                        return EMPTY;
                if (!strcmp(s->ctl.reqtab[slot].request_id, request_id))
                        return slot;
        }
}

void sender_map_insert(struct sender *s, uint32_t slot)
{
        uint32_t i = home(s, s->ctl.reqtab[slot].request_id);
        while (s->map[i] != EMPTY)
                i = (i + 1) & (s->map_cap - 1);
        s->map[i] = slot;
}

void sender_map_remove(struct sender *s, uint32_t slot)
{
        uint32_t mask = s->map_cap - 1;
        uint32_t i = home(s, s->ctl.reqtab[slot].request_id);

        while (s->map[i] != slot) {
                if (s->map[i] == EMPTY)
                        return;
                i = (i + 1) & mask;
        }
        /* Backward-shift deletion keeps every probe chain unbroken. */
        for (uint32_t j = (i + 1) & mask; s->map[j] != EMPTY; j = (j + 1) & mask) {
                uint32_t h = home(s, s->ctl.reqtab[s->map[j]].request_id);
                /* Move j into the hole at i unless its home lies cyclically in (i, j]. */
                bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
                if (!stays) {
                        s->map[i] = s->map[j];
                        i = j;
                }
        }
        s->map[i] = EMPTY;
}

uint32_t sender_slot_alloc(struct sender *s)
{
        /* Linear scan from a rotating hint: cheap next to a task's decode. */
        static uint32_t hint;
        uint32_t n = s->ctl.hdr->reqtab_slots;
        for (uint32_t k = 0; k < n; k++) {
                uint32_t i = (hint + k) % n;
                if (s->rq[i] == SREQ_FREE && s->ctl.reqtab[i].state == KVF_REQ_FREE && s->flags[i] == 0) {
                        hint = i + 1;
                        return i;
                }
        }
        return EMPTY;
}

/* ---- destination blocks of live requests ---- */

static uint32_t peer_tag(const char *peer)
{
        return (uint32_t)kvf_hash64(peer, strnlen(peer, KVF_PEER_MAX), 11);
}

/* Fibonacci hashing: the top bits of the product, which every bit of the key reaches (a
 * request's blocks are often consecutive ids). */
static uint32_t book_home(const struct sender *s, uint32_t tag, uint32_t block)
{
        return (uint32_t)(((uint64_t)tag << 32 | block) * 0x9e3779b97f4a7c15ull >> s->book_shift);
}

/* The slot's destination blocks (what its task named): their count, 0 for a count the table
 * cannot hold (a predecessor's table is read as it was left). */
static uint32_t slot_dests(const struct sender *s, uint32_t slot, const uint32_t **dst)
{
        const struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        uint32_t n =
            r->n_dst ? r->n_dst : r->n_send; /* (n_dst: regrouped into another block size) */
        *dst = kvf_slot_blocks(&s->ctl, slot) + s->ctl.hdr->max_blocks;
        return n <= s->ctl.hdr->max_blocks ? n : 0;
}

static void book_put(struct sender *s, struct booking b)
{
        uint32_t i = book_home(s, b.tag, b.block), mask = s->book_cap - 1;
        while (s->book[i].slot != EMPTY)
                i = (i + 1) & mask;
        s->book[i] = b;
}

/* Room for `need` entries, at most half full. Bounded by the table: a live slot books at most
 * max_blocks, so the index never holds more than reqtab_slots x max_blocks entries. */
static int book_grow(struct sender *s, uint64_t need)
{
        uint32_t cap = 1024, shift = 64 - 10;
        if (need > 1u << 30)
                return kvf_err_set(-ENOMEM, "%llu destination blocks are too many to book",
                                   (unsigned long long)need);
        while (cap < 2 * need) {
                cap <<= 1;
                shift--;
        }
        if (cap <= s->book_cap)
                return 0;
        struct booking *old = s->book, *nb = malloc((size_t)cap * sizeof(*nb));
        uint32_t oldcap = s->book_cap;
        if (!nb)
                return kvf_err_set(-ENOMEM, "out of memory for %u booked destination blocks",
                                   cap / 2);
        for (uint32_t i = 0; i < cap; i++)
                nb[i].slot = EMPTY;
        s->book = nb;
        s->book_cap = cap;
        s->book_shift = shift;
        for (uint32_t i = 0; i < oldcap; i++)
                if (old[i].slot != EMPTY)
                        book_put(s, old[i]);
        free(old);
        return 0;
}

bool sender_book_find(const struct sender *s, const char *peer, const uint32_t *dst, uint32_t n,
                      const char *request_id, uint32_t *at, uint32_t *owner)
{
        if (!s->book_n)
                return false;
        uint32_t tag = peer_tag(peer), mask = s->book_cap - 1;
        for (uint32_t k = 0; k < n; k++)
                for (uint32_t i = book_home(s, tag, dst[k]); s->book[i].slot != EMPTY;
                     i = (i + 1) & mask) {
                        const struct booking *b = &s->book[i];
                        const struct kvf_req_slot *r = &s->ctl.reqtab[b->slot];
                        if (b->block == dst[k] && b->tag == tag &&
                            !strncmp(r->peer, peer, KVF_PEER_MAX) &&
                            strncmp(r->request_id, request_id, KVF_REQ_ID_MAX)) {
                                *at = k;
                                *owner = b->slot;
                                return true;
                        }
                }
        return false;
}

int sender_book_add(struct sender *s, uint32_t slot)
{
        const uint32_t *dst;
        uint32_t n = slot_dests(s, slot, &dst);
        if (s->booked[slot])
                return 0;
        if (2ull * (s->book_n + n) > s->book_cap && book_grow(s, (uint64_t)s->book_n + n) < 0)
                return -ENOMEM;
        uint32_t tag = peer_tag(s->ctl.reqtab[slot].peer);
        /* Blocks already booked under the same key (the same request id, or a predecessor's
         * table) are booked again: each entry leaves with its own slot. */
        for (uint32_t k = 0; k < n; k++)
                book_put(s, (struct booking){.tag = tag, .block = dst[k], .slot = slot});
        s->book_n += n;
        s->booked[slot] = 1;
        return 0;
}

void sender_book_remove(struct sender *s, uint32_t slot)
{
        const uint32_t *dst;
        uint32_t n = slot_dests(s, slot, &dst), mask = s->book_cap - 1;
        if (!s->booked[slot])
                return;
        s->booked[slot] = 0;
        /* (the arena still holds what was booked: a slot's blocks change only when it is taken
         * again, FREE) */
        uint32_t tag = peer_tag(s->ctl.reqtab[slot].peer);
        for (uint32_t k = 0; k < n; k++) {
                uint32_t i = book_home(s, tag, dst[k]);
                while (s->book[i].slot != EMPTY &&
                       (s->book[i].slot != slot || s->book[i].block != dst[k] ||
                        s->book[i].tag != tag))
                        i = (i + 1) & mask;
                if (s->book[i].slot == EMPTY)
                        continue;
                s->book_n--;
                /* Backward-shift deletion, as for the id map. */
                for (uint32_t j = (i + 1) & mask; s->book[j].slot != EMPTY; j = (j + 1) & mask) {
                        uint32_t h = book_home(s, s->book[j].tag, s->book[j].block);
                        bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
                        if (!stays) {
                                s->book[i] = s->book[j];
                                i = j;
                        }
                }
                s->book[i].slot = EMPTY;
        }
}

static struct bucket *find_bucket(struct sender *s, uint64_t step, bool create)
{
        uint32_t i = 0;
        while (i < s->nbuckets && s->buckets[i].step < step)
                i++;
        if (i < s->nbuckets && s->buckets[i].step == step)
                return &s->buckets[i];
        if (!create)
                return NULL;
        if (s->nbuckets == s->capbuckets) {
                uint32_t cap = s->capbuckets ? 2 * s->capbuckets : 16;
                struct bucket *b = realloc(s->buckets, cap * sizeof(*b));
                if (!b)
                        abort(); /* a few dozen bytes: nothing sensible to do without them */
                s->buckets = b;
                s->capbuckets = cap;
        }
        memmove(&s->buckets[i + 1], &s->buckets[i], (s->nbuckets - i) * sizeof(*s->buckets));
        s->nbuckets++;
        memset(&s->buckets[i], 0, sizeof(s->buckets[i]));
        s->buckets[i].step = step;
        return &s->buckets[i];
}

void sender_disarm(struct sender *s, uint32_t slot)
{
        uint64_t step = s->armed[slot];
        if (step == UINT64_MAX)
                return;
        s->armed[slot] = UINT64_MAX;
        s->armed_copies -= s->ctl.reqtab[slot].transport == KVF_TRANSPORT_IPC;
        struct bucket *b = find_bucket(s, step, false);
        if (!b)
                return;
        for (uint32_t k = 0; k < b->n; k++)
                if (b->slots[k] == slot) {
                        b->slots[k] = b->slots[--b->n];
                        break;
                }
        if (b->n == 0) {
                free(b->slots);
                uint32_t i = (uint32_t)(b - s->buckets);
                memmove(&s->buckets[i], &s->buckets[i + 1],
                        (s->nbuckets - i - 1) * sizeof(*s->buckets));
                s->nbuckets--;
        }
}

/* Put the slot in the bucket of its front chunk's step (or nowhere: only a MOVING request
 * waits for layers). */
void sender_arm(struct sender *s, uint32_t slot)
{
        const struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        if (s->rq[slot] != SREQ_MOVING || r->chunk_head == r->chunk_tail) {
                sender_disarm(s, slot);
                return;
        }
        uint64_t step = r->chunks[r->chunk_head % KVF_CHUNKS_MAX].step;
        if (s->armed[slot] == step)
                return;
        sender_disarm(s, slot);
        struct bucket *b = find_bucket(s, step, true);
        if (b->n == b->cap) {
                uint32_t cap = b->cap ? 2 * b->cap : 8;
                uint32_t *p = realloc(b->slots, cap * sizeof(*p));
                if (!p)
                        abort();
                b->slots = p;
                b->cap = cap;
        }
        b->slots[b->n++] = slot;
        s->armed[slot] = step;
        /* same host: this sender moves its bytes itself, as soon as it sees the layers (a slot's
         * transport is its request's while it is armed: a slot is freed only disarmed) */
        s->armed_copies += r->transport == KVF_TRANSPORT_IPC;
}
