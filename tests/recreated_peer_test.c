/*
 * A decode instance stopped and started again at the same tcp address while transfers to it
 * are mid-step (the prefill engine has published half of its layers). The new incarnation's
 * engine (whose session is numbered 1 again, as the one before) never reserved those blocks:
 * it must hear nothing of those requests (no arrival, not even a failed one) and its cache
 * must not change; the prefill engine hears one status per request, never "finished". Then a
 * request to the new incarnation finishes, its bytes checked.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "check.h"
#include "clock.h"
#include "ctl.h"
#include "instances.h"
#include "kvferry.h"

#define NREQ 8

static char P[64], D[64];

/* Every byte of blocks [0, 2 * NREQ) of every layer tensor: set to v, or checked against it. */
static uint64_t blocks(struct kvf_client *c, unsigned char v, bool check)
{
        struct kvf_layout_info li;
        CHECK_EQ(kvf_get_layout(c, &li), 0);
        uint64_t bad = 0;
        for (uint32_t l = 0; l < li.num_layers; l++)
                for (int t = 0; t < (li.key_only ? 1 : 2); t++) {
                        unsigned char *b = kvf_cache_tensor(c, l, t);
                        CHECK(b != NULL);
                        for (uint64_t i = 0; i < 2 * NREQ * li.block_bytes; i++) {
                                if (!check)
                                        b[i] = v;
                                else
                                        bad += b[i] != v;
                        }
                }
        return bad;
}

static void publish(struct kvf_client *c, uint64_t step, uint32_t from, uint32_t to)
{
        for (uint32_t l = from; l < to; l++)
                CHECK_EQ(kvf_layer_done(c, step, l), 0);
}

static void submit(struct kvf_client *p, const char *tag, uint64_t step, const char *addr)
{
        for (uint32_t i = 0; i < NREQ; i++) {
                char id[32];
                uint32_t s[2] = {2 * i, 2 * i + 1}, d[2] = {2 * i, 2 * i + 1};
                snprintf(id, sizeof(id), "%s%u", tag, i);
                struct kvf_task t = {.request_id = id, .src_block_ids = s, .n_src = 2, .dest_block_ids = d,
                                     .n_dest = 2, .current_id = step, .transport = KVF_TRANSPORT_TCP,
                                     .peer = addr};
                CHECK_EQ(kvf_submit_task(p, &t), 0);
        }
}

int main(void)
{
        snprintf(P, sizeof(P), "rp%d-p", (int)getpid());
        snprintf(D, sizeof(D), "rp%d-d", (int)getpid());
        const char *L = "--model llama-3.1-8b --tp 8 --blocks 64 --backend host";
        unsigned port = t_free_port();
        char addr[64], down[512];
        snprintf(addr, sizeof(addr), "127.0.0.1:%u", port);
        snprintf(down, sizeof(down), "%s/tools/kvferry down --instance %s >/dev/null 2>&1", KVF_SOURCE_DIR, D);
        t_up(D, "--role decode %s --listen %s", L, addr);
        t_up(P, "--role prefill %s", L);
        struct kvf_client *p, *d1, *d2;
        CHECK_EQ(kvf_attach(P, 5000, &p), 0);
        CHECK_EQ(kvf_attach(D, 5000, &d1), 0);
        struct kvf_layout_info li;
        CHECK_EQ(kvf_get_layout(p, &li), 0);
        blocks(p, 0x11, false);

        /* Half the layers go; some bytes are on the wire to the first incarnation. */
        uint64_t step = kvf_last_step(p) + 1;
        submit(p, "old", step, addr);
        publish(p, step, 0, li.num_layers / 2);
        CHECK_EQ(t_wait_counter(P, KVF_CTR_BYTES_TCP, 1, 20000, "bytes sent to the first incarnation"), 0);

        /* The decode instance again, at its address: a new engine with blocks of its own. */
        CHECK(system(down) == 0);
        kvf_detach(d1);
        t_up(D, "--role decode %s --listen %s", L, addr);
        CHECK_EQ(kvf_attach(D, 5000, &d2), 0);
        blocks(d2, 0x5a, false);
        publish(p, step, li.num_layers / 2, li.num_layers);

        unsigned ended = 0;
        uint64_t end = kvf_now_ns() + 60000000000ull;
        while (ended < NREQ && kvf_now_ns() < end) {
                struct kvf_event ev;
                int rc = kvf_poll(p, &ev, 1000);
                CHECK(rc >= 0);
                if (rc == 0 || ev.type != KVF_EVENT_COMPLETION)
                        continue;
                printf("  %s: %s \"%s\"\n", ev.request_id, kvf_status_name(ev.status), ev.reason);
                if (ev.status == KVF_STATUS_FINISHED) {
                        fprintf(stderr, "recreated_peer_test: %s finished, but its decode instance was "
                                        "re-created mid-transfer\n", ev.request_id);
                        return 1;
                }
                ended++;
        }
        CHECK_EQ(ended, NREQ);
        /* Nothing of them reaches the new engine (watched a while longer: notices come late). */
        end = kvf_now_ns() + 2000000000ull;
        while (kvf_now_ns() < end) {
                struct kvf_event ev;
                int rc = kvf_poll(d2, &ev, 200);
                CHECK(rc >= 0);
                if (rc == 1 && ev.type == KVF_EVENT_ARRIVAL) {
                        fprintf(stderr, "recreated_peer_test: the new incarnation's engine got an arrival "
                                        "for '%s' (%s: %s), a request it never had\n", ev.request_id,
                                kvf_status_name(ev.status), ev.reason);
                        return 1;
                }
        }
        uint64_t bad = blocks(d2, 0x5a, true);
        if (bad) {
                fprintf(stderr, "recreated_peer_test: %llu bytes of the new incarnation's blocks were "
                                "overwritten by the one before's transfers\n", (unsigned long long)bad);
                return 1;
        }

        /* The new incarnation works: a request to it finishes, every byte there. */
        step = kvf_last_step(p) + 1;
        submit(p, "new", step, addr);
        publish(p, step, 0, li.num_layers);
        for (unsigned n = 0; n < NREQ;) {
                struct kvf_event ev;
                CHECK_EQ(kvf_poll(p, &ev, 30000), 1);
                if (ev.type != KVF_EVENT_COMPLETION)
                        continue;
                CHECK(ev.status == KVF_STATUS_FINISHED);
                n++;
        }
        for (unsigned n = 0; n < NREQ;) {
                struct kvf_event ev;
                CHECK_EQ(kvf_poll(d2, &ev, 30000), 1);
                if (ev.type != KVF_EVENT_ARRIVAL)
                        continue;
                CHECK(ev.status == KVF_STATUS_FINISHED && !strncmp(ev.request_id, "new", 3));
                n++;
        }
        CHECK_EQ(blocks(d2, 0x11, true), 0);
        kvf_detach(p);
        kvf_detach(d2);
        printf("recreated_peer_test: %u transfers to a re-created peer ended without reaching it; "
               "%u to the new incarnation finished\n", NREQ, NREQ);
        return 0;
}
