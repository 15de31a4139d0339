/*
 * Outcome agreement (issue 9, item 3): the prefill side never reports a
 * failure for a request whose arrival the decode side published as finished.
 * A finish notice that reached the peer is in doubt until the peer answers;
 * the decode connector is stopped (SIGSTOP) right after it received one, for
 * longer than the peer timeout, then continued or killed (its supervisor
 * restarts it), and both sides must agree on every request.
 */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "clock.h"
#include "ctl.h"
#include "instances.h"
#include "kvferry.h"

static char P[64], D[64];
static struct kvf_layout_info L;


static int decode_connector(void)
{
        struct kvf_ctl c;
        CHECK_EQ(kvf_ctl_attach(D, false, &c), 0);
        int pid = c.roles[KVF_ROLE_CONNECTOR].pid;
        kvf_ctl_detach(&c);
        return pid;
}

/* One request over ipc, all layers published at once. */
static void run_one(struct kvf_client *pc, const char *id, uint32_t blk)
{
        uint32_t s = blk, d = blk;
        uint64_t step = kvf_last_step(pc) + 1;
        struct kvf_task t = {.request_id = id, .src_block_ids = &s, .n_src = 1, .dest_block_ids = &d,
                             .n_dest = 1, .current_id = step, .transport = KVF_TRANSPORT_IPC, .peer = D};
        CHECK_EQ(kvf_submit_task(pc, &t), 0);
        for (uint32_t l = 0; l < L.num_layers; l++)
                CHECK_EQ(kvf_layer_done(pc, step, l), 0);
}

/* The completion and the arrival of `id` (within timeout_ms each); statuses in *c, *a (-1 none). */
static void outcome(struct kvf_client *pc, struct kvf_client *dc, const char *id, int timeout_ms, int *c,
                    int *a, char *why, size_t whylen, char *awhy, size_t awhylen)
{
        struct kvf_event ev;
        *c = *a = -1;
        uint64_t end = kvf_now_ns() + (uint64_t)timeout_ms * 1000000ull;
        while (*c < 0 && kvf_now_ns() < end)
                if (kvf_poll(pc, &ev, 100) == 1 && ev.type == KVF_EVENT_COMPLETION && !strcmp(ev.request_id, id)) {
                        *c = ev.status;
                        snprintf(why, whylen, "%s", ev.reason);
                }
        end = kvf_now_ns() + 3000000000ull;
        while (kvf_now_ns() < end) {
                if (kvf_poll(dc, &ev, 100) != 1 || ev.type != KVF_EVENT_ARRIVAL || strcmp(ev.request_id, id))
                        continue;
                CHECK(*a < 0); /* one arrival */
                *a = ev.status;
                snprintf(awhy, awhylen, "%s", ev.reason);
        }
}

static void expect_agree(struct kvf_client *pc, struct kvf_client *dc, const char *id, const char *what)
{
        int c, a;
        char why[256] = "", awhy[256] = "";
        outcome(pc, dc, id, 20000, &c, &a, why, sizeof(why), awhy, sizeof(awhy));
        printf("  %-44s completion %-16s arrival %s%s%s\n", what, c < 0 ? "(none)" : kvf_status_name(c),
               a < 0 ? "(none)" : kvf_status_name(a), why[0] ? " -- " : "", why);
        CHECK(c >= 0);
        /* Agreement: finished on one side only if finished on the other. */
        CHECK((c == KVF_STATUS_FINISHED) == (a == KVF_STATUS_FINISHED));
        /* A failure (a timeout above all) always says why, on either side. */
        CHECK(c == KVF_STATUS_FINISHED || why[0]);
        CHECK(a < 0 || a == KVF_STATUS_FINISHED || awhy[0]);
}

int main(void)
{
        snprintf(P, sizeof(P), "ag%d-p", (int)getpid());
        snprintf(D, sizeof(D), "ag%d-d", (int)getpid());
        const char *lay = "--model llama-3.1-8b --tp 8 --blocks 64";
        t_up(D, "--role decode %s --peer-timeout-ms 1000", lay);
        t_up(P, "--role prefill %s --peer-timeout-ms 1000 --connect-timeout-ms 500 --request-timeout-ms 3000", lay);
        struct kvf_client *pc, *dc;
        CHECK_EQ(kvf_attach(D, 5000, &dc), 0);
        CHECK_EQ(kvf_attach(P, 5000, &pc), 0);
        kvf_get_layout(pc, &L);

        /* The control connection is up: a warm-up request. */
        run_one(pc, "warm", 1);
        expect_agree(pc, dc, "warm", "warm-up");

        /* 1. The notice reached the stopped decode connector; the peer timeout passes (the
         *    connection is given up); the connector continues and publishes the arrival. */
        int dpid = decode_connector();
        kill(dpid, SIGSTOP);
        run_one(pc, "stopped", 2);
        usleep(2500000); /* > the prefill's peer timeout: it gave up the connection */
        kill(dpid, SIGCONT);
        expect_agree(pc, dc, "stopped", "stopped past the peer timeout, continued");

        /* 2. The same, killed instead of continued at the moment the timeout expires: the restarted
         *    connector never saw the notice; the prefill side sends it again. */
        dpid = decode_connector();
        kill(dpid, SIGSTOP);
        run_one(pc, "killed", 3);
        usleep(1100000);
        kill(dpid, SIGKILL);
        expect_agree(pc, dc, "killed", "stopped, killed as the peer timeout expired");

        /* 3. Past the request's deadline (3 s) the sender withdraws the notice; the peer, back in
         *    time, answers with what it published: the arrival, so the request is finished. */
        dpid = decode_connector();
        kill(dpid, SIGSTOP);
        run_one(pc, "withdrawn", 4);
        usleep(4000000);
        kill(dpid, SIGCONT);
        expect_agree(pc, dc, "withdrawn", "stopped past the request's deadline, continued");

        kvf_detach(pc);
        kvf_detach(dc);
        printf("agreement_test: both sides agreed on every request\n");
        return 0;
}
