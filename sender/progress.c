/*
 * Layer-done progress -> what to move now, for one request at a time
 * (request.c walks the step buckets and acts on what sender_advance returns).
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
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "atomics.h"
#include "clock.h"
#include "err.h"
#include "layout.h"
#include "log.h"
#include "sender.h"

/*
 * Send-blocks [b0, b1) of a request as runs contiguous on both sides, into
 * s->runs as (src block, send index, count) triples; returns the number of
 * words written.
 */
static uint32_t build_runs(struct sender *s, uint32_t slot, uint32_t b0, uint32_t b1)
{
        const struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        const uint32_t *src = kvf_slot_blocks(&s->ctl, slot) + (r->n_src - r->n_send);
        const uint32_t *dst = kvf_slot_blocks(&s->ctl, slot) + s->ctl.hdr->max_blocks;
        uint32_t *runs = s->runs, n = 0;

        for (uint32_t i = b0; i < b1;) {
                uint32_t k = 1;
                /* (Regrouped into another block size, n_dst: the copies map each position
                 * through the plan, and only the source side need be contiguous.) */
                while (i + k < b1 && src[i + k] == src[i] + k && (r->n_dst || dst[i + k] == dst[i] + k))
                        k++;
                runs[n++] = src[i];
                runs[n++] = i;
                runs[n++] = k;
                i += k;
        }
        return n;
}

/*
 * Copy layers [l0, l1) of send-blocks [b0, b1) of a same-host request (gathered: copies.c).
 * A step's last layer into GPU memory goes in a batch of the request's own (for the first
 * SENDER_OWN_BATCHES requests of a progress word): it lands, and its finish goes, when its own
 * bytes are in, not when the whole step's are.
 */
static int copy_ipc(struct sender *s, uint32_t slot, uint32_t l0, uint32_t l1, uint32_t b0,
                    uint32_t b1)
{
        bool alone = l1 == s->layers && s->own_landing && s->own_left;
        if (alone) {
                s->own_left--;
                sender_copies_flush(s);
        }
        int rc = sender_copies_add(s, slot, l0, l1, s->runs, build_runs(s, slot, b0, b1));
        if (alone && rc == 0)
                sender_copies_flush(s);
        return rc;
}

/*
 * Hand layers [l0, l1) of send-blocks [b0, b1) of a network request to the
 * connector as one write batch: runs contiguous on both sides, as (src, dst
 * index, count) triples (the receiver maps indexes to its own block ids).
 * 0, or -EAGAIN when the ring is full.
 */
static int post_batch(struct sender *s, uint32_t slot, uint32_t l0, uint32_t l1, uint32_t b0,
                      uint32_t b1)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        struct kvf_record w = {.type = KVF_RT_WRITE_BATCH, .key = sender_key(slot, r->incarnation),
                               .layer = l0, .layer_count = l1 - l0, .runs = s->runs,
                               .n_runs = build_runs(s, slot, b0, b1), .transport = (int)r->transport,
                               .id_bin = r->flags & KVF_REQF_ID_BIN};
        memcpy(w.request_id, r->request_id, sizeof(w.request_id));
        memcpy(w.peer, r->peer, sizeof(w.peer));
        int rc = sender_post(s, &w); /* the connector counts what it sends */
        /* Its descriptors: the frames (tcp) or work requests (rdma) the connector makes of
         * this batch (common/records.h); a batch handed again after a restart counts again. */
        if (rc == 0)
                r->descs += kvf_batch_frames(w.runs, w.n_runs, w.layer_count, kvf_layout_tensors(s->layout),
                                             s->layout->block_bytes, s->layout->scale_bytes,
                                             kvf_frame_max(w.transport));
        return rc;
}

int sender_post_open(struct sender *s, uint32_t slot)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        struct kvf_record o = {.type = KVF_RT_OPEN, .key = sender_key(slot, r->incarnation),
                               .transport = (int)r->transport,
                               .dst = kvf_slot_blocks(&s->ctl, slot) + s->ctl.hdr->max_blocks,
                               .n_dst = r->n_dst ? r->n_dst : r->n_send,
                               .bytes = sender_request_bytes(s, r),
                               .session = r->peer_session,
                               /* regrouped into another block size: the source blocks, each
                                * sent whole to the connector's plan (0: not regrouped) */
                               .blocks = r->n_dst ? r->n_send : 0,
                               .id_bin = r->flags & KVF_REQF_ID_BIN};
        memcpy(o.request_id, r->request_id, sizeof(o.request_id));
        memcpy(o.peer, r->peer, sizeof(o.peer));
        return sender_post(s, &o);
}

/*
 * Hand a network request's blocks to the connector again (it restarted, or
 * we did): position p < layers re-sends layer p of blocks [0, sent_full);
 * then the front chunk's blocks for layers [0, cur_layers). Resumable: the
 * cursor moves only past what made it into the ring.
 */
int sender_resend(struct sender *s, uint32_t slot)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        uint32_t front_end = r->chunk_head != r->chunk_tail
                                     ? r->chunks[r->chunk_head % KVF_CHUNKS_MAX].block_end
                                     : r->sent_full;
        for (uint32_t *p = &s->resend[slot]; *p < s->layers + r->cur_layers; (*p)++) {
                int rc = *p < s->layers
                                 ? (r->sent_full ? post_batch(s, slot, *p, *p + 1, 0, r->sent_full) : 0)
                                 : (front_end > r->sent_full
                                            ? post_batch(s, slot, *p - s->layers, *p - s->layers + 1,
                                                         r->sent_full, front_end)
                                            : 0);
                if (rc < 0)
                        return rc;
        }
        return 0;
}

/*
 * Hand over layers [l0, l1) of send-blocks [b0, b1): 0, -EAGAIN (a ring is full: again later
 * from the same place), or -ECANCELED: the request cannot go on (*status, kvf_err the reason).
 */
static int send_range(struct sender *s, uint32_t slot, uint32_t l0, uint32_t l1, uint32_t b0,
                      uint32_t b1, bool net_blocked, int *status)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        if (l0 >= l1 || b0 >= b1)
                return 0;
        uint64_t t0 = kvf_now_ns();
        if (!s->copy_timed && s->progress_ns && t0 >= s->progress_ns) {
                /* first copy caused by this progress word */
                kvf_hist_add(&s->ctl.sender->hist[KVF_HIST_LAYER_TO_COPY], t0 - s->progress_ns);
                s->copy_timed = true;
        }
        if (r->transport == KVF_TRANSPORT_IPC) {
                /* The blocks were reserved by the peer's engine session of the task's time:
                 * once that session is over they may belong to another request. */
                const struct ipc_peer *p = &s->peers[r->peer_idx];
                uint64_t ps = r->peer_session ? kvf_engine_session(&p->ctl, false) : 0;
                if (ps != r->peer_session) {
                        *status = KVF_STATUS_ENGINE_GONE;
                        return kvf_err_set(-ECANCELED,
                                           "the engine session %llu of peer '%s' ended during the transfer: its blocks are no longer reserved",
                                           (unsigned long long)r->peer_session, r->peer);
                }
                char why[KVF_REASON_MAX];
                if (sender_caches_check(s, r->peer_idx, slot, why, sizeof(why)) < 0) {
                        *status = KVF_STATUS_ENGINE_GONE;
                        return kvf_err_set(-ECANCELED, "%s", why);
                }
                if (copy_ipc(s, slot, l0, l1, b0, b1) < 0) {
                        *status = KVF_STATUS_WRITE;
                        return -ECANCELED; /* (kvf_err says why) */
                }
        } else {
                if (net_blocked)
                        return -EAGAIN; /* the open record (or a resend) goes first */
                int rc = post_batch(s, slot, l0, l1, b0, b1);
                if (rc < 0 && sender_post_again(rc))
                        return -EAGAIN;
                if (rc < 0) {
                        kvf_errlog(&s->ctl, KVF_ROLE_SENDER, "req %s: %s", r->request_id, kvf_err_msg());
                        *status = KVF_STATUS_WRITE;
                        return -ECANCELED; /* a record that can never be posted */
                }
        }
        if (!r->xfer_start_ns)
                r->xfer_start_ns = t0; /* its transfer time runs from here (KVF_HIST_REQ_XFER) */
        if (r->transport != KVF_TRANSPORT_IPC) /* (an ipc batch is timed when it is submitted) */
                kvf_hist_add(&s->ctl.sender->hist[KVF_HIST_COPY], kvf_now_ns() - t0);
        kvf_count(&s->ctl, KVF_CTR_COPY_BATCHES, 1);
        kvf_count(&s->ctl, KVF_CTR_LAYERS_SENT, l1 - l0);
        return 0;
}

/*
 * The next piece of layer `layer` of a request whose one layer is more than a slice
 * (blocks [sent_full, block_end)): at most `max_blocks` blocks from where its last piece
 * ended. 1: that was the layer's last piece; 0: more is left; < 0 as send_range.
 */
static int copy_layer_piece(struct sender *s, uint32_t slot, uint32_t layer, uint32_t block_end,
                            uint32_t max_blocks, int *status)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        struct layer_cut *c = &s->cut[slot];
        if (c->accept_ns != r->accept_ns || c->layer != layer || c->b0 != r->sent_full)
                *c = (struct layer_cut){.accept_ns = r->accept_ns, .layer = layer, .b0 = r->sent_full};
        uint32_t b0 = r->sent_full + c->done;
        uint32_t n = block_end - b0 < max_blocks ? block_end - b0 : max_blocks;
        int rc = send_range(s, slot, layer, layer + 1, b0, b0 + n, false, status);
        if (rc < 0)
                return rc;
        if (b0 + n < block_end) {
                c->done += n;
                return 0;
        }
        *c = (struct layer_cut){0};
        return 1;
}

/* The publish time of the first progress word handled that covers `want` (the oldest kept if
 * even that one does), or 0 when none is kept. Newest first: it is nearly always the latest. */
static uint64_t ready_ns(const struct sender *s, uint64_t want)
{
        uint64_t at = 0;
        for (uint32_t k = s->nwords; k-- > 0;) {
                uint32_t i = (s->words_at + k) % SENDER_WORDS_SEEN;
                if (s->words[i] < want)
                        break;
                at = s->words_ns[i];
        }
        return at ? at : s->progress_ns;
}

/*
 * Move whatever the current progress word allows for one MOVING request, and say how it
 * went; request.c acts on it. WAIT leaves the request armed at its front mark's step.
 */
enum sender_adv sender_advance(struct sender *s, uint32_t slot, bool net_blocked, int *status)
{
        struct kvf_req_slot *r = &s->ctl.reqtab[slot];
        uint64_t step = KVF_PROGRESS_STEP(s->progress);
        uint32_t done = KVF_PROGRESS_LAYERS(s->progress);
        /* A backlog goes in slices: a late task's every layer, or a chunk that completes
         * many blocks, would otherwise hold up the next layer-done of every other request
         * for as long as its copy takes. What is left waits for the loop's next turn
         * (SENDER_ADV_AGAIN), after that turn's progress word: newly ready layers of
         * in-time requests go first. Copies this thread makes itself (host caches, same
         * host) go in slices of SENDER_SLICE_BYTES_SYNC, and a layer of a backlog larger
         * than that is cut by blocks (copy_layer_piece); otherwise one layer is never split.
         * Copies that complete later (kernels on one GPU stream), while other requests move
         * too: one layer a turn. Every request then moves by one layer from a turn's batch to
         * the next, so the next batch is the one before moved by a layer, whose descriptors
         * the copier runs again instead of writing new ones (gpu/copier.cu), and a batch holds
         * a layer of each request, not its whole backlog (the descriptor arena's room). */
        const bool cut_ok = s->sync_copies && !s->plan_on && r->transport == KVF_TRANSPORT_IPC;
        const uint32_t others = s->armed_copies - (s->armed[slot] != UINT64_MAX); /* (this one disarmed or not) */
        const bool layer_turns = !s->sync_copies && r->transport == KVF_TRANSPORT_IPC && others > 0;
        uint64_t budget = cut_ok ? SENDER_SLICE_BYTES_SYNC : SENDER_SLICE_BYTES;
        int rc;

        while (r->chunk_head != r->chunk_tail) {
                struct kvf_chunk_mark *m = &r->chunks[r->chunk_head % KVF_CHUNKS_MAX];
                uint32_t ready;
                if (m->step < step)
                        ready = s->layers;
                else if (m->step == step)
                        ready = done < s->layers ? done : s->layers;
                else
                        break;
                /* Its last mark, one layer from the end, with the engine's layers close
                 * together: its notice follows the next layer-done (sender.h). */
                const bool last = sender_last_mark(r) == m;
                if (last && ready + 1 == s->layers && m->step == step && s->layer_gap_ns) {
                        const uint64_t bytes = (uint64_t)(m->block_end > r->sent_full ? m->block_end - r->sent_full : 0) *
                                               kvf_layout_layer_block_bytes(s->layout);
                        const uint64_t spread = s->layer_gap_ns - s->layer_gap_lo_ns;
                        if (s->layer_gap_ns <= SENDER_EARLY_PREWAKE_GAP_NS)
                                sender_expect_notice(s, slot, s->layer_gap_ns, bytes);
                        else if (spread <= SENDER_EARLY_PREWAKE_GAP_NS && s->layer_gap_lo_ns > SENDER_PREWAKE_LEAD_NS)
                                /* a slower engine: started a lead before its last layer can come */
                                sender_prewake_later(s, slot,
                                                     s->layer_event_ns + s->layer_gap_lo_ns - SENDER_PREWAKE_LEAD_NS,
                                                     spread + SENDER_PREWAKE_LEAD_NS, bytes);
                }
                if (ready > r->cur_layers) {
                        /* When the layers that are its last so far became ready (the first
                         * word that made them so, or the task's arrival if they were ready
                         * before it): copies that lag behind do not move it. */
                        uint64_t at = ready_ns(s, KVF_PROGRESS_PACK(m->step, ready));
                        r->last_layer_ns = at > r->accept_ns ? at : r->accept_ns;
                        /* Engine executor: the layers the engine claimed are its own (plan.c);
                         * the sender copies [from, ready), in slices. */
                        uint32_t from = r->cur_layers;
                        if (r->transport == KVF_TRANSPORT_IPC &&
                            sender_plan_take(s, slot, m->step, r->sent_full, m->block_end, r->cur_layers, ready,
                                             &from) < 0) {
                                *status = KVF_STATUS_WRITE;
                                return SENDER_ADV_FAILED;
                        }
                        if (from > r->cur_layers) {
                                /* The engine copied layers [cur_layers, from): their runs are
                                 * the request's descriptors too, and its transfer began no
                                 * later than the layer-done word that made them ready. */
                                uint32_t words = build_runs(s, slot, r->sent_full, m->block_end);
                                r->descs += (uint64_t)(from - r->cur_layers) * s->tensors * (words / 3);
                                if (!r->xfer_start_ns)
                                        r->xfer_start_ns = s->progress_ns ? s->progress_ns : kvf_now_ns();
                        }
                        uint64_t block = kvf_layout_layer_block_bytes(s->layout);
                        uint64_t per_layer = (uint64_t)(m->block_end > r->sent_full ? m->block_end - r->sent_full : 0) * block;
                        if (cut_ok && per_layer > SENDER_SLICE_BYTES_SYNC && ready - from >= 2) {
                                /* A backlog whose one layer is more than a slice: copy it in
                                 * pieces. (A request that is not behind, with one layer ready,
                                 * copies it whole: every other request ready now came with the
                                 * same progress word, and pieces would only delay them all.) */
                                if (budget < block) /* this turn's slice is spent */
                                        return SENDER_ADV_AGAIN;
                                rc = copy_layer_piece(s, slot, from, m->block_end, (uint32_t)(budget / block),
                                                      status);
                                if (rc == -ECANCELED)
                                        return SENDER_ADV_FAILED;
                                if (rc < 0)
                                        return SENDER_ADV_BLOCKED;
                                if (rc == 1) /* the layer's last piece (more layers are ready) */
                                        r->cur_layers = from + 1;
                                kvf_count(&s->ctl, KVF_CTR_COPY_SLICES, 1);
                                return SENDER_ADV_AGAIN; /* the next slice */
                        }
                        uint64_t fit = layer_turns ? 1 : per_layer ? budget / per_layer : ready - from;
                        uint32_t upto = ready;
                        if (fit < ready - from)
                                upto = from + (fit ? (uint32_t)fit : 1);
                        if (last && from < upto && upto == s->layers)
                                sender_expect_notice(s, slot, 0, per_layer * (upto - from)); /* its last */
                        if (from < upto &&
                            (rc = send_range(s, slot, from, upto, r->sent_full, m->block_end, net_blocked, status)) < 0)
                                /* a full ring: again from the same place later */
                                return rc == -ECANCELED ? SENDER_ADV_FAILED : SENDER_ADV_BLOCKED;
                        uint64_t spent = per_layer * (upto - from);
                        r->cur_layers = upto;
                        if (upto < ready) {
                                kvf_count(&s->ctl, KVF_CTR_COPY_SLICES, 1);
                                return SENDER_ADV_AGAIN; /* the next slice */
                        }
                        budget = budget > spent ? budget - spent : 0;
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
                return SENDER_ADV_ALL_SENT;
        /* engine executor: the next step's plan */
        if (sender_plan_offer(s, slot) < 0) {
                *status = KVF_STATUS_WRITE;
                return SENDER_ADV_FAILED;
        }
        sender_arm(s, slot);
        return SENDER_ADV_WAIT;
}
