/*
 * A sender on an instance's control segment: what main.c starts and stops,
 * and what the in-process tests (tests/sender_logic_test.c) build on a
 * segment of their own.
 */
#include <stdlib.h>
#include <string.h>

#include "atomics.h"
#include "clock.h"
#include "err.h"
#include "layout.h"
#include "log.h"
#include "sender.h"

int sender_open(struct sender *s, const char *instance, const struct sender_opts *o)
{
        int rc = kvf_ctl_attach_wait(instance, true, o->attach_wait_ms, &s->ctl);
        if (rc < 0)
                return rc;
        s->layout = &s->ctl.hdr->layout;
        s->layers = kvf_layout_layers(s->layout);
        s->tensors = kvf_layout_all_tensors(s->layout);
        s->request_timeout_ns = o->request_timeout_ns;
        s->notice_rings = o->notice_rings;
        for (uint32_t i = 0; i < SENDER_MAX_PEERS; i++)
                s->peers[i].ctl.fd = -1;
        if ((rc = kvf_cache_map(s->ctl.hdr, false, &s->own)) < 0) {
                kvf_ctl_detach(&s->ctl);
                return rc;
        }
        if ((rc = sender_table_init(s)) < 0 || (rc = sender_copies_init(s)) < 0 ||
            (rc = sender_plan_init(s)) < 0) {
                sender_free(s);
                return rc;
        }
        /* host memory, copied by this thread (the engine's caches stage only for the connector;
         * in GPU memory they are copied by kernels, which complete later) */
        s->sync_copies = s->own.be->stage == NULL ||
                         (s->own.be->id == KVF_BACKEND_ENGINE && !s->ctl.hdr->reg_gpu);
        /* A step's last layer in a batch per request (progress.c copy_ipc), where copies land
         * later than they are submitted; KVF_AB_NO_OWN_LANDING=1 (an A/B switch of
         * bench/gpu_tail_ab.sh) keeps one batch for the whole step. */
        const char *ab = getenv("KVF_AB_NO_OWN_LANDING");
        s->own_landing = !s->sync_copies && !(ab && !strcmp(ab, "1"));
        s->own_batches = SENDER_OWN_BATCHES;
        return 0;
}

int sender_start(struct sender *s)
{
        int64_t gen = kvf_role_claim(&s->ctl, KVF_ROLE_SENDER);
        if (gen < 0)
                return (int)gen;
        s->gen = (uint64_t)gen;
        s->connector_gen = kvf_load_acquire(&s->ctl.roles[KVF_ROLE_CONNECTOR].generation);
        /* Adopted requests advance against the real progress word, nothing later. */
        s->progress = kvf_load_acquire(&s->ctl.progress->word);
        s->progress_ns = kvf_load_relaxed(&s->ctl.progress->publish_ns);
        s->copy_timed = true;
        sender_adopt(s);
        return 0;
}

void sender_close(struct sender *s)
{
        kvf_role_end(&s->ctl, KVF_ROLE_SENDER);
        sender_copies_drain(s, kvf_ms(2000)); /* never unmap under a copy in flight */
        sender_free(s);
}

void sender_free(struct sender *s)
{
        /* The own cache first: its backend's copy engine (a worker thread, a GPU stream) may
         * still be writing into a peer's cache, which must stay mapped until it has stopped. */
        kvf_cache_unmap(&s->own);
        sender_copies_free(s);
        sender_table_free(s);
        free(s->pl_step);
        s->pl_step = NULL;
        free(s->scratch);
        s->scratch = NULL;
        s->scratch_cap = 0;
        sender_net_peers_close(s);
        sender_peers_close(s);
        kvf_ctl_detach(&s->ctl);
}
