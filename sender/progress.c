/*
 * Layer-done progress -> what to move now.
 *
 * The engine publishes one word: (step, layers done in that step). A request
 * waits on chunk marks (step, block_end): after `step`, its blocks
 * [.., block_end) are complete. A request is armed in the bucket of its
 * front mark's step, so a progress word touches only the requests whose
 * marks it completes or advances: O(affected requests), never a scan of the
 * table.
 *
 * Per request, blocks [0, sent_full) are sent for every layer, and layers
 * [0, cur_layers) are sent for the front mark's blocks [sent_full,
 * block_end). Each (layer, block) is therefore sent exactly once, and a
 * restarted sender resumes from these two numbers (re-sending at most the
 * batch in flight when it died; writes are idempotent).
 */
#include <string.h>

#include "atomics.h"
#include "clock.h"
#include "layout.h"
#include "log.h"
#include "sender.h"

/* Copy layers [l0, l1) of send-blocks [b0, b1) of a same-host request. */
static void copy_ipc(struct sender *s, uint32_t slot, uint32_t l0, uint32_t l1, uint32_t b0,
                     uint32_t b1)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        const struct ipc_peer *p = &s->peers[r->peer_idx];
        const struct kvf_cache_layout *L = s->layout;
        const struct kvf_cache_layout *PL = &p->ctl.hdr->layout;
        const uint32_t *src = kvf_slot_blocks(&s->ctl, slot) + (r->n_src - r->n_send);
        const uint32_t *dst = kvf_slot_blocks(&s->ctl, slot) + s->ctl.hdr->max_blocks;
        uint64_t bb = L->block_bytes;

        for (uint32_t l = l0; l < l1; l++)
                for (uint32_t t = 0; t < s->tensors; t++)
                        for (uint32_t i = b0; i < b1;) {
                                /* a run: contiguous on both sides */
                                uint32_t n = 1;
                                while (i + n < b1 && src[i + n] == src[i] + n && dst[i + n] == dst[i] + n)
                                        n++;
                                memcpy(p->cache + kvf_layout_offset(PL, l, t, dst[i]),
                                       s->cache + kvf_layout_offset(L, l, t, src[i]), n * bb);
                                i += n;
                        }
        uint64_t blocks = (uint64_t)(l1 - l0) * s->tensors * (b1 - b0);
        kvf_count(&s->ctl, KVF_CTR_BLOCKS_IPC, blocks);
        kvf_count(&s->ctl, KVF_CTR_BYTES_IPC, blocks * bb);
        r->bytes += blocks * bb;
}

static void send_range(struct sender *s, uint32_t slot, uint32_t l0, uint32_t l1, uint32_t b0,
                       uint32_t b1)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        if (l0 >= l1 || b0 >= b1)
                return;
        uint64_t t0 = kvf_now_ns();
        if (!s->copy_timed && s->progress_ns && t0 >= s->progress_ns) {
                /* first copy caused by this progress word */
                kvf_hist_add(&s->ctl.sender->hist[KVF_HIST_LAYER_TO_COPY], t0 - s->progress_ns);
                s->copy_timed = true;
        }
        if (!r->first_copy_ns)
                r->first_copy_ns = t0;
        copy_ipc(s, slot, l0, l1, b0, b1);
        kvf_hist_add(&s->ctl.sender->hist[KVF_HIST_COPY], kvf_now_ns() - t0);
        kvf_count(&s->ctl, KVF_CTR_COPY_BATCHES, 1);
        kvf_count(&s->ctl, KVF_CTR_LAYERS_SENT, l1 - l0);
}

/* Every byte of the request is written: ask the connector to tell the peer. */
static void all_sent(struct sender *s, uint32_t slot)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        r->last_layer_ns = s->progress_ns && s->progress_ns > r->accept_ns ? s->progress_ns
                                                                           : r->accept_ns;
        sender_disarm(s, slot);
        /* Release: the copies above are complete before anyone sees FINISHING. */
        kvf_store_release(&r->state, KVF_REQ_FINISHING);
        r->notice_gen = 0;
        s->flags[slot] |= SLOT_NEEDS_NOTICE;
        s->pending++;
}

/* Move whatever the current progress word allows for one request. */
void sender_advance(struct sender *s, uint32_t slot)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        uint64_t step = KVF_PROGRESS_STEP(s->progress);
        uint32_t done = KVF_PROGRESS_LAYERS(s->progress);

        if (r->state != KVF_REQ_ACTIVE)
                return;
        while (r->chunk_head != r->chunk_tail) {
                struct kvf_chunk_mark *m = &r->chunks[r->chunk_head % KVF_CHUNKS_MAX];
                uint32_t ready;
                if (m->step < step)
                        ready = s->layers;
                else if (m->step == step)
                        ready = done < s->layers ? done : s->layers;
                else
                        break;
                if (ready > r->cur_layers) {
                        send_range(s, slot, r->cur_layers, ready, r->sent_full, m->block_end);
                        if (r->state != KVF_REQ_ACTIVE)
                                return;
                        r->cur_layers = ready;
                }
                if (r->cur_layers < s->layers)
                        break;
                /* This mark is complete for every layer. */
                if (m->block_end > r->sent_full)
                        r->sent_full = m->block_end;
                r->cur_layers = 0;
                r->chunk_head++;
        }
        if (r->chunk_head == r->chunk_tail && r->last_chunk_seen && r->sent_full >= r->n_send)
                all_sent(s, slot);
        else
                sender_arm(s, slot);
}

void sender_on_progress(struct sender *s, uint64_t word, uint64_t publish_ns)
{
        s->progress = word;
        s->progress_ns = publish_ns;
        s->copy_timed = false;
        uint64_t step = KVF_PROGRESS_STEP(word);

        /* Buckets move while we work (requests re-arm at later steps), so
         * take the first bucket again after each request. */
        for (;;) {
                if (s->nbuckets == 0 || s->buckets[0].step > step)
                        break;
                if (s->buckets[0].step < step) {
                        /* every request here completes its mark and re-arms elsewhere */
                        uint32_t slot = s->buckets[0].slots[0];
                        sender_disarm(s, slot);
                        sender_advance(s, slot);
                        continue;
                }
                /* bucket == step: requests advance but may stay in it */
                struct bucket *b = &s->buckets[0];
                uint32_t n = b->n;
                memcpy(s->tmp, b->slots, n * sizeof(uint32_t));
                for (uint32_t k = 0; k < n; k++)
                        sender_advance(s, s->tmp[k]);
                break;
        }
        kvf_store_relaxed(&s->ctl.sender->progress_seen, word);
}
