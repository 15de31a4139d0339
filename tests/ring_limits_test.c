/*
 * Records that can never fit their ring: nothing anyone waits for
 * may vanish, nor be retried for ever as if the ring were only full.
 *
 *  - prefill side: a write batch too large for ring sender->connector (a task
 *    of many scattered blocks, 8 KiB rings) used to be retried as
 *    back-pressure until the request timed out a minute later; it fails at
 *    once with "write error" and says why.
 *  - decode side: an arrival whose block list cannot fit ring
 *    connector->engine used to be dropped without a trace; it is published
 *    without its (optional) block list, and the error log says so.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "clock.h"
#include "instances.h"
#include "kvferry.h"

#define SMALL "--layers 2 --kv-heads 1 --head-dim 64 --block-size 16 --blocks 4096 --max-blocks-per-request 4096"

static char P[64], D[64], DS[64], PS[64];

static int next_event(struct kvf_client *c, int type, const char *id, int timeout_ms, struct kvf_event *ev)
{
        uint64_t end = kvf_now_ns() + kvf_ms((uint64_t)timeout_ms);
        while (kvf_now_ns() < end)
                if (kvf_poll(c, ev, 100) == 1 && ev->type == type && !strcmp(ev->request_id, id))
                        return 1;
        return 0;
}

/* n blocks, scattered (every other block, dst in reverse): no two contiguous on both sides. */
static void submit_scattered(struct kvf_client *c, const char *id, const char *peer, uint32_t n, int transport)
{
        uint32_t *src = malloc(n * sizeof(*src)), *dst = malloc(n * sizeof(*dst));
        CHECK(src && dst);
        for (uint32_t i = 0; i < n; i++) {
                src[i] = 2 * i;
                dst[i] = 2 * (n - 1 - i);
        }
        uint64_t step = kvf_last_step(c) + 1;
        struct kvf_task t = {.request_id = id, .src_block_ids = src, .n_src = n, .dest_block_ids = dst,
                             .n_dest = n, .current_id = step, .transport = transport, .peer = peer};
        int rc = kvf_submit_task(c, &t);
        if (rc < 0)
                fprintf(stderr, "submit %s: %s\n", id, kvf_last_error());
        CHECK_EQ(rc, 0);
        for (uint32_t l = 0; l < 2; l++)
                CHECK_EQ(kvf_layer_done(c, step, l), 0);
        free(src);
        free(dst);
}

int main(void)
{
        snprintf(P, sizeof(P), "rl%d-p", (int)getpid());
        snprintf(D, sizeof(D), "rl%d-d", (int)getpid());
        snprintf(PS, sizeof(PS), "rl%d-ps", (int)getpid());
        snprintf(DS, sizeof(DS), "rl%d-ds", (int)getpid());

        /* 1. Prefill side, 8 KiB rings: the task (1300 ids each way, 6 bytes a block) fits ring engine->sender,
         *    its write batch (1300 runs of three numbers, 7 bytes a block) cannot fit ring sender->connector. */
        t_up(D, "--role decode " SMALL);
        t_up(PS, "--role prefill " SMALL " --ring-kib 8");
        struct kvf_client *pc, *dc;
        CHECK_EQ(kvf_attach(PS, 5000, &pc), 0);
        uint64_t t0 = kvf_now_ns();
        submit_scattered(pc, "too-big-batch", D, 1300, KVF_TRANSPORT_TCP);
        struct kvf_event ev;
        CHECK(next_event(pc, KVF_EVENT_COMPLETION, "too-big-batch", 10000, &ev));
        printf("  %-24s -> %s after %.1f ms: %s\n", "too-big-batch", kvf_status_name(ev.status),
               (double)(kvf_now_ns() - t0) / 1e6, ev.reason);
        CHECK_EQ(ev.status, KVF_STATUS_WRITE);
        CHECK(strstr(ev.reason, "can never fit ring sender->connector") != NULL);
        /* ...and the instance keeps working: a request of a size that fits finishes. */
        submit_scattered(pc, "fits", D, 100, KVF_TRANSPORT_TCP);
        CHECK(next_event(pc, KVF_EVENT_COMPLETION, "fits", 10000, &ev));
        CHECK_EQ(ev.status, KVF_STATUS_FINISHED);
        kvf_detach(pc);
        printf("ok: a write batch that can never fit its ring fails its request at once; the next one finishes\n");

        /* 2. Decode side, 8 KiB rings: an arrival listing 3000 blocks (3 bytes an id) cannot
         *    fit ring connector->engine; it comes without the list. */
        t_up(DS, "--role decode " SMALL " --ring-kib 8");
        t_up(P, "--role prefill " SMALL);
        CHECK_EQ(kvf_attach(DS, 5000, &dc), 0);
        CHECK_EQ(kvf_attach(P, 5000, &pc), 0);
        uint32_t n = 3000;
        uint32_t *src = malloc(n * sizeof(*src)), *dst = malloc(n * sizeof(*dst));
        CHECK(src && dst);
        for (uint32_t i = 0; i < n; i++)
                src[i] = dst[i] = i;
        uint64_t step = kvf_last_step(pc) + 1;
        struct kvf_task t = {.request_id = "big-arrival", .src_block_ids = src, .n_src = n,
                             .dest_block_ids = dst, .n_dest = n, .current_id = step,
                             .transport = KVF_TRANSPORT_IPC, .peer = DS};
        CHECK_EQ(kvf_submit_task(pc, &t), 0);
        for (uint32_t l = 0; l < 2; l++)
                CHECK_EQ(kvf_layer_done(pc, step, l), 0);
        CHECK(next_event(pc, KVF_EVENT_COMPLETION, "big-arrival", 10000, &ev));
        CHECK_EQ(ev.status, KVF_STATUS_FINISHED);
        CHECK(next_event(dc, KVF_EVENT_ARRIVAL, "big-arrival", 10000, &ev));
        CHECK_EQ(ev.status, KVF_STATUS_FINISHED);
        CHECK_EQ(ev.n_dest, 0); /* the list could not come with it */
        CHECK_EQ(ev.blocks, n);
        printf("  %-24s -> arrival %s, %u blocks, without its block list\n", "big-arrival",
               kvf_status_name(ev.status), ev.blocks);
        kvf_detach(pc);
        kvf_detach(dc);
        free(src);
        free(dst);
        /* The error log of the decode instance says why. */
        struct kvf_ctl ctl;
        CHECK_EQ(kvf_ctl_attach(DS, false, &ctl), 0);
        bool said = false;
        for (unsigned i = 0; i < KVF_ERRLOG_ENTRIES && !said; i++) {
                struct kvf_errlog_entry e;
                if (kvf_errlog_read(&ctl, KVF_ROLE_CONNECTOR, i, &e) == 1 && strstr(e.text, "do not fit ring"))
                        said = true;
        }
        kvf_ctl_detach(&ctl);
        CHECK(said);
        printf("ok: an arrival too large for its ring comes without its block list, and the error log says so\n");
        printf("ring_limits_test: all passed\n");
        return 0;
}
