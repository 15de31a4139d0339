/*
 * Outcome agreement (docs/ARCHITECTURE.md section 7): the prefill side never
 * reports a failure for a request whose arrival the decode side published as
 * finished, and each fault ends a request the way the rules there say. The
 * decode connector is stopped (SIGSTOP) around a step's finish notices: for
 * less than the peer timeout; for longer, then continued or killed (its
 * supervisor restarts it); past the requests' deadline, then continued or
 * killed; and before the notices, so that they never go out. Each scenario
 * moves PER requests over ipc and asserts the exact status of every
 * completion and every arrival (or that there is none), that the two sides
 * agree, and that no request gets a second completion or arrival. Where two
 * outcomes are both right (said at the scenario), it counts each.
 *
 * By default (notice rings, the senders' default) the notices go into the
 * decode segment's notice ring, which outlives the decode connector, and no
 * connection is involved; the scenarios then expect what ARCHITECTURE.md
 * section 7 says of that path (said at each). KVFERRY_NOTICE_RINGS=0 (up passes
 * --no-notice-rings; the agreement_sockets test) runs them over the
 * connectors' sockets, the path of tcp and rdma notices and of an ipc peer
 * that got no notice slot.
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

#define PER 3 /* requests per scenario, one step */
#define MAX_REQS 700
#define CANCELLED 400 /* and of them cancelled while moving: abort notices */
#define HELD 200 /* requests of the scenario whose decode engine stops reading */
#define NONE (-1) /* no completion or arrival (yet) */
#define PEER_TIMEOUT_MS 1000
#define REQUEST_TIMEOUT_MS 3000

static char P[64], D[64], E[64];
static bool rings; /* not KVFERRY_NOTICE_RINGS=0 */
static struct kvf_layout_info L;

struct req {
        char id[32];
        int c, a;      /* completion, arrival status; NONE */
        char why[240]; /* the completion's reason */
        char awhy[240]; /* the arrival's reason */
        bool judged;   /* its scenario checked it: nothing more may come for it */
};
static struct req reqs[MAX_REQS];
static unsigned nreqs;

/* An expected outcome: the completion's status and the arrival's (NONE: no arrival). */
struct outcome {
        int c, a;
};

static const char *sname(int st)
{
        return st == NONE ? "(none)" : kvf_status_name(st);
}

static int decode_connector(void)
{
        struct kvf_ctl c;
        CHECK_EQ(kvf_ctl_attach(D, false, &c), 0);
        int pid = c.roles[KVF_ROLE_CONNECTOR].pid;
        kvf_ctl_detach(&c);
        CHECK(pid > 0);
        return pid;
}

/* One event from c within ms, recorded against its request. Fails the test on an event for a
 * request never submitted, a second completion or arrival, or one after its scenario was judged. */
static int take(struct kvf_client *c, int ms)
{
        struct kvf_event ev;
        int rc = kvf_poll(c, &ev, ms);
        CHECK(rc >= 0);
        if (rc == 0)
                return 0;
        struct req *r = NULL;
        for (unsigned i = 0; i < nreqs && !r; i++)
                if (!strcmp(reqs[i].id, ev.request_id))
                        r = &reqs[i];
        const char *kind = ev.type == KVF_EVENT_COMPLETION ? "completion" : "arrival";
        if (!r || (ev.type != KVF_EVENT_COMPLETION && ev.type != KVF_EVENT_ARRIVAL)) {
                fprintf(stderr, "unexpected event (type %d) for '%s': %s: %s\n", ev.type,
                        ev.request_id, kvf_status_name(ev.status), ev.reason);
                exit(1);
        }
        int *st = ev.type == KVF_EVENT_COMPLETION ? &r->c : &r->a;
        if (*st != NONE || r->judged) {
                fprintf(stderr,
                        "%s: %s %s: %s, after %s (a second one, or one after its scenario ended)\n",
                        r->id, kind, kvf_status_name(ev.status), ev.reason, sname(*st));
                exit(1);
        }
        *st = ev.status;
        snprintf(ev.type == KVF_EVENT_COMPLETION ? r->why : r->awhy, sizeof(r->why), "%s", ev.reason);
        return 1;
}

/* Everything either side has now, waiting up to ms on each. */
static void pump(struct kvf_client *pc, struct kvf_client *dc, int ms)
{
        while (take(pc, ms) || take(dc, ms)) {
        }
}

/* PER requests of scenario `tag` over ipc (blocks `first`...), one step, every layer published. */
static struct req *submit(struct kvf_client *pc, const char *tag, uint32_t first)
{
        CHECK(nreqs + PER <= MAX_REQS && first + PER <= 64);
        struct req *r = &reqs[nreqs];
        uint64_t step = kvf_last_step(pc) + 1;
        for (unsigned i = 0; i < PER; i++) {
                uint32_t b = first + i;
                snprintf(r[i].id, sizeof(r[i].id), "%s-%u", tag, i);
                r[i].c = r[i].a = NONE;
                struct kvf_task t = {.request_id = r[i].id,
                                     .src_block_ids = &b,
                                     .n_src = 1,
                                     .dest_block_ids = &b,
                                     .n_dest = 1,
                                     .current_id = step,
                                     .transport = KVF_TRANSPORT_IPC,
                                     .peer = D};
                CHECK_EQ(kvf_submit_task(pc, &t), 0);
                nreqs++;
        }
        for (uint32_t l = 0; l < L.num_layers; l++)
                CHECK_EQ(kvf_layer_done(pc, step, l), 0);
        return r;
}

/* Until each request has its completion and (if `arrivals`) its arrival; fails after timeout_ms. */
static void settle(struct kvf_client *pc, struct kvf_client *dc, struct req *r, bool arrivals,
                   unsigned timeout_ms)
{
        uint64_t end = kvf_now_ns() + (uint64_t)timeout_ms * 1000000ull;
        for (;;) {
                unsigned open = 0;
                for (unsigned i = 0; i < PER; i++)
                        open += r[i].c == NONE || (arrivals && r[i].a == NONE);
                if (!open)
                        return;
                if (kvf_now_ns() > end) {
                        for (unsigned i = 0; i < PER; i++)
                                fprintf(stderr, "  %s: completion %s, arrival %s\n", r[i].id,
                                        sname(r[i].c), sname(r[i].a));
                        fprintf(stderr, "%s...: no %s within %u ms\n", r->id,
                                arrivals ? "completion and arrival" : "completion", timeout_ms);
                        exit(1);
                }
                pump(pc, dc, 10);
        }
}

/*
 * Every request of the scenario ended as one of ok[0..nok): the sides agree, and each status is
 * exact. With more than one outcome allowed, print how many ended each way.
 */
static void judge(const char *what, struct req *r, const struct outcome *ok, unsigned nok)
{
        unsigned count[4] = {0};
        CHECK(nok >= 1 && nok <= 4);
        printf("  %s\n", what);
        for (unsigned i = 0; i < PER; i++) {
                printf("    %-18s completion %-16s arrival %-16s%s%s\n", r[i].id, sname(r[i].c),
                       sname(r[i].a), r[i].why[0] ? " -- " : "", r[i].why);
                /* Agreement: finished on one side only if finished on the other. */
                if ((r[i].c == KVF_STATUS_FINISHED) != (r[i].a == KVF_STATUS_FINISHED)) {
                        fprintf(stderr, "%s: the two sides disagree: completion %s, arrival %s\n",
                                r[i].id, sname(r[i].c), sname(r[i].a));
                        exit(1);
                }
                /* A failure (a timeout above all) always says why, on either side. */
                if ((r[i].c != KVF_STATUS_FINISHED && !r[i].why[0]) ||
                    (r[i].a != NONE && r[i].a != KVF_STATUS_FINISHED && !r[i].awhy[0])) {
                        fprintf(stderr, "%s: a failure without a reason: completion %s '%s', arrival %s '%s'\n",
                                r[i].id, sname(r[i].c), r[i].why, sname(r[i].a), r[i].awhy);
                        exit(1);
                }
                unsigned k = 0;
                while (k < nok && (ok[k].c != r[i].c || ok[k].a != r[i].a))
                        k++;
                if (k == nok) {
                        fprintf(stderr, "%s (%s): completion %s, arrival %s; expected", r[i].id,
                                what, sname(r[i].c), sname(r[i].a));
                        for (k = 0; k < nok; k++)
                                fprintf(stderr, "%s completion %s, arrival %s", k ? " or" : "",
                                        sname(ok[k].c), sname(ok[k].a));
                        fprintf(stderr, "\n");
                        exit(1);
                }
                count[k]++;
                r[i].judged = true;
        }
        if (nok > 1) {
                printf("    ->");
                for (unsigned k = 0; k < nok; k++)
                        printf("%s %u ended %s/%s", k ? "," : "", count[k], sname(ok[k].c),
                               sname(ok[k].a));
                printf("\n");
        }
}

/* Counter `id` of `inst` moved past `base` since (else the scenario did not do what it says). */
static void grew(const char *inst, enum kvf_counter_id id, int64_t base, int64_t by,
                 const char *meaning)
{
        int64_t v = t_counter(inst, id);
        if (v < base + by) {
                fprintf(stderr, "counter %s of '%s' went from %lld to %lld, wanted +%lld: %s\n",
                        kvf_counter_names[id], inst, (long long)base, (long long)v, (long long)by,
                        meaning);
                exit(1);
        }
}

static const struct outcome FINISHED = {KVF_STATUS_FINISHED, KVF_STATUS_FINISHED};
static const struct outcome TIMED_OUT = {KVF_STATUS_TIMEOUT, KVF_STATUS_TIMEOUT};

/*
 * 6. No process fails: the decode engine stops reading its arrivals (another decode instance, E,
 *    whose rings hold a few dozen records) while HELD requests come, more than its notice ring
 *    holds. Its arrival ring fills, the decode connector holds the notices in the notice ring
 *    (the sender keeps the rest until there is room), and at the requests' deadline the sender
 *    withdraws those in the ring and ends the others itself. Each withdrawal is answered at
 *    once, 'timed out', although it is behind a held notice; so every request has its
 *    completion within the deadline plus a margin, never "in doubt", and when the engine reads
 *    again each arrival says what its completion said: 'finished' for those published before
 *    the ring filled, 'timed out' for those withdrawn, none for those never posted, never
 *    'finished' for a request its prefill side ended 'timed out'. Notice rings only: over the
 *    sockets a withdrawal waits behind the held notices (ARCHITECTURE.md section 7).
 */
static void held_engine(struct kvf_client *pc)
{
        struct kvf_client *ec;
        if (!rings) {
                printf("  (the decode engine that stops reading: a scenario of the notice rings)\n");
                return;
        }
        t_up(E, "--role decode --model llama-3.1-8b --tp 8 --blocks 1024 --ring-kib 4");
        CHECK_EQ(kvf_attach(E, 5000, &ec), 0); /* attached, and never polled until below */
        CHECK(nreqs + HELD <= MAX_REQS);
        struct req *r = &reqs[nreqs];
        uint64_t step = kvf_last_step(pc) + 1, t0 = kvf_now_ns();
        for (unsigned i = 0; i < HELD; i++) {
                uint32_t b = i, src = i % 64;
                snprintf(r[i].id, sizeof(r[i].id), "held-%u", i);
                r[i].c = r[i].a = NONE;
                struct kvf_task t = {.request_id = r[i].id, .src_block_ids = &src, .n_src = 1,
                                     .dest_block_ids = &b, .n_dest = 1, .current_id = step,
                                     .transport = KVF_TRANSPORT_IPC, .peer = E};
                CHECK_EQ(kvf_submit_task(pc, &t), 0);
                nreqs++;
        }
        for (uint32_t l = 0; l < L.num_layers; l++)
                CHECK_EQ(kvf_layer_done(pc, step, l), 0);
        /* And CANCELLED more for the next step, never published, cancelled while the notices
         * above are held: their abort notices must not take the room the withdrawals need. */
        struct req *x = &reqs[nreqs];
        CHECK(nreqs + CANCELLED <= MAX_REQS);
        for (unsigned i = 0; i < CANCELLED; i++) {
                uint32_t b = HELD + i, src = i % 64;
                snprintf(x[i].id, sizeof(x[i].id), "held-x%u", i);
                x[i].c = x[i].a = NONE;
                struct kvf_task t = {.request_id = x[i].id, .src_block_ids = &src, .n_src = 1,
                                     .dest_block_ids = &b, .n_dest = 1, .current_id = step + 1,
                                     .transport = KVF_TRANSPORT_IPC, .peer = E};
                CHECK_EQ(kvf_submit_task(pc, &t), 0);
                nreqs++;
        }
        usleep(300000);
        for (unsigned i = 0; i < CANCELLED; i++)
                CHECK_EQ(kvf_submit_cancel(pc, x[i].id), 0);
        /* Every completion, the engine not reading: by the deadline plus a margin (the in-doubt
         * bound, a second deadline, is not reached): a request never posted waits a second for
         * room for its abort notice, then its completion goes without it. */
        uint64_t end = t0 + (uint64_t)(REQUEST_TIMEOUT_MS * 3 / 2 + 1000) * 1000000ull;
        unsigned open = HELD + CANCELLED;
        while (open && kvf_now_ns() < end) {
                take(pc, 10);
                open = 0;
                for (unsigned i = 0; i < HELD; i++)
                        open += r[i].c == NONE;
                for (unsigned i = 0; i < CANCELLED; i++)
                        open += x[i].c == NONE;
        }
        unsigned ms = (unsigned)((kvf_now_ns() - t0) / 1000000);
        for (unsigned i = 0; i < CANCELLED && open; i++)
                if (x[i].c == NONE)
                        fprintf(stderr, "%s: no completion within %u ms\n", x[i].id, ms);
        for (unsigned i = 0; i < HELD && open; i++)
                if (r[i].c == NONE)
                        fprintf(stderr, "%s: no completion within %u ms (deadline %u ms)\n", r[i].id,
                                ms, REQUEST_TIMEOUT_MS);
        CHECK_EQ(open, 0);
        /* The engine reads again: every arrival there is to come (for a request whose notice
         * never went into the ring, ended here 'timed out' "before the finish notice could
         * reach" the decode side, only its abort notice's 'timed out', if it found room). */
        unsigned want = 0, got = 0;
        for (unsigned i = 0; i < HELD; i++)
                want += !strstr(r[i].why, "before the finish notice");
        end = kvf_now_ns() + 10000000000ull;
        while (got < want && kvf_now_ns() < end) {
                take(ec, 10);
                got = 0;
                for (unsigned i = 0; i < HELD; i++)
                        got += r[i].a != NONE;
        }
        while (take(ec, 200)) { /* (and nothing more: a second arrival fails in take) */
        }
        for (unsigned i = 0; i < CANCELLED; i++) {
                if (x[i].c != KVF_STATUS_CANCELLED ||
                    (x[i].a != NONE && x[i].a != KVF_STATUS_CANCELLED)) {
                        fprintf(stderr, "%s: completion %s (%s), arrival %s (%s)\n", x[i].id,
                                sname(x[i].c), x[i].why, sname(x[i].a), x[i].awhy);
                        exit(1);
                }
                x[i].judged = true;
        }
        unsigned fin = 0, tout = 0, unposted = 0;
        for (unsigned i = 0; i < HELD; i++) {
                bool never = strstr(r[i].why, "before the finish notice") != NULL;
                unposted += never;
                if ((never ? (r[i].a != NONE && r[i].a != KVF_STATUS_TIMEOUT) ||
                                 r[i].c != KVF_STATUS_TIMEOUT
                           : r[i].a == NONE || r[i].c != r[i].a) ||
                    (r[i].c != KVF_STATUS_FINISHED && r[i].c != KVF_STATUS_TIMEOUT) ||
                    strstr(r[i].why, "in doubt")) {
                        fprintf(stderr, "%s: completion %s (%s), arrival %s (%s)\n", r[i].id,
                                sname(r[i].c), r[i].why, sname(r[i].a), r[i].awhy);
                        exit(1);
                }
                fin += r[i].c == KVF_STATUS_FINISHED;
                tout += r[i].c == KVF_STATUS_TIMEOUT;
                r[i].judged = true;
        }
        printf("  the decode engine stopped reading (its arrival ring full), %u requests: %u "
               "finished, %u timed out on both sides (%u of them never posted), %u more "
               "cancelled while moving, every completion within %u ms\n",
               HELD, fin, tout, unposted, CANCELLED, ms);
        CHECK(tout > unposted); /* else its ring never filled: the scenario did not happen */
        CHECK(unposted > 0);    /* else its notice ring never filled */
        kvf_detach(ec);
}

int main(void)
{
        setvbuf(stdout, NULL, _IOLBF, 0); /* in order with stderr in the test log */
        rings = !getenv("KVFERRY_NOTICE_RINGS") || strcmp(getenv("KVFERRY_NOTICE_RINGS"), "0");
        printf(rings ? "notices through the decode segment's notice rings (the default)\n"
                     : "notices through the connectors' sockets (--no-notice-rings)\n");
        snprintf(P, sizeof(P), "ag%d-p", (int)getpid());
        snprintf(D, sizeof(D), "ag%d-d", (int)getpid());
        snprintf(E, sizeof(E), "ag%d-e", (int)getpid());
        const char *lay = "--model llama-3.1-8b --tp 8 --blocks 64";
        t_up(D, "--role decode %s --peer-timeout-ms %d", lay, PEER_TIMEOUT_MS);
        t_up(P,
             "--role prefill %s --max-requests 1024 --peer-timeout-ms %d --connect-timeout-ms 500 --request-timeout-ms "
             "%d",
             lay, PEER_TIMEOUT_MS, REQUEST_TIMEOUT_MS);
        struct kvf_client *pc, *dc;
        CHECK_EQ(kvf_attach(D, 5000, &dc), 0);
        CHECK_EQ(kvf_attach(P, 5000, &pc), 0);
        kvf_get_layout(pc, &L);
        struct req *r;

        /* The control connection is up: a warm-up. */
        r = submit(pc, "warm", 1);
        settle(pc, dc, r, true, 10000);
        judge("warm-up", r, &FINISHED, 1);

        /* 0. Stopped for less than the peer timeout (the stop is a span of time, shorter than the
         *    timeout), continued: the connection never broke; the notices are read late, published,
         *    acknowledged. */
        int dpid = decode_connector();
        kill(dpid, SIGSTOP);
        r = submit(pc, "short", 4);
        usleep(PEER_TIMEOUT_MS * 1000 / 3);
        kill(dpid, SIGCONT);
        settle(pc, dc, r, true, 10000);
        judge("stopped for a third of the peer timeout, continued", r, &FINISHED, 1);

        /* 1. The notices reached the stopped decode connector's socket; the peer timeout passes
         *    (the prefill side gives the connection up: the stop is a span of time, past the
         *    timeout, before the deadline); the connector continues. The notices are in doubt,
         * never failed alone: the connector reads them from the old socket and publishes them, and
         *    answers the repeat on the new connection from its journal. Only 'finished' is right:
         *    even a withdrawal (were the deadline to pass first) is answered with the arrival the
         *    continued connector publishes from the notice ahead of it. */
        int64_t fails = t_counter(P, KVF_CTR_PEER_FAILURES);
        dpid = decode_connector();
        kill(dpid, SIGSTOP);
        r = submit(pc, "stopped", 7);
        usleep(PEER_TIMEOUT_MS * 2500);
        /* (and, on a slow host, until the prefill side has given the connection up and failed to
         * reach the peer again; rings: no connection carries the notices) */
        if (!rings)
                CHECK_EQ(t_wait_counter(P, KVF_CTR_PEER_FAILURES, (uint64_t)fails + 1, 5000,
                                        "the prefill connector to give up the stopped decode connector"),
                         0);
        kill(dpid, SIGCONT);
        settle(pc, dc, r, true, 10000);
        judge("stopped past the peer timeout, continued", r, &FINISHED, 1);

        /* 2. The same, killed instead of continued as the peer timeout expires (a span of time):
         *    the restarted connector never saw the notices; the prefill side sends them again on
         *    its new connection and they are published 'finished'. Both sides 'timed out' is right
         *    as well, but only when that connection came too late: past the deadline the sender
         *    withdraws the notices, and the new connector, which never published them, publishes
         *    the timeout. So: reached before the deadline (with a margin for the answer), only
         *    'finished'; else either, counted. */
        int64_t connects = t_counter(P, KVF_CTR_PEER_CONNECTS);
        dpid = decode_connector();
        kill(dpid, SIGSTOP);
        uint64_t t0 = kvf_now_ns();
        r = submit(pc, "killed", 10);
        usleep(PEER_TIMEOUT_MS * 1100);
        kill(dpid, SIGKILL);
        /* rings: the restarted connector finds the notices in the ring, unread: only 'finished' */
        if (!rings)
                CHECK_EQ(t_wait_counter(P, KVF_CTR_PEER_CONNECTS, (uint64_t)connects + 1, 10000,
                                        "the prefill connector to reach the restarted decode connector"),
                         0);
        unsigned reached_ms = (unsigned)((kvf_now_ns() - t0) / 1000000);
        settle(pc, dc, r, true, 10000);
        const struct outcome killed_ok[] = {FINISHED, TIMED_OUT};
        bool in_time = rings || reached_ms + 500 < REQUEST_TIMEOUT_MS;
        printf("  (the restarted decode connector was reached %u ms after the submit; deadline %u "
               "ms)\n",
               reached_ms, REQUEST_TIMEOUT_MS);
        judge("stopped, killed as the peer timeout expired", r, killed_ok, in_time ? 1 : 2);

        /* 3. Past the requests' deadline (a span of time: 4 s against 3), continued: the sender has
         *    withdrawn the notices; the connector, continued, publishes the notices ahead in its
         * old socket, and answers the withdrawals on the new connection from its journal:
         * 'finished'. The answers count in notices_in_doubt_resolved (prefill) and
         * arrivals_deduplicated (decode): the withdrawal, not a repeat of the notice, decided. */
        int64_t resolved = t_counter(P, KVF_CTR_NOTICES_IN_DOUBT);
        int64_t deduped = t_counter(D, KVF_CTR_ARRIVALS_DEDUPED);
        dpid = decode_connector();
        kill(dpid, SIGSTOP);
        r = submit(pc, "withdrawn", 13);
        usleep(REQUEST_TIMEOUT_MS * 1000 + 1000000);
        kill(dpid, SIGCONT);
        settle(pc, dc, r, true, 10000);
        judge("stopped past the requests' deadline, continued", r, &FINISHED, 1);
        grew(P, KVF_CTR_NOTICES_IN_DOUBT, resolved, PER,
             "the withdrawals were not what the peer answered");
        grew(D, KVF_CTR_ARRIVALS_DEDUPED, deduped, PER,
             "the withdrawals were not answered from the journal");

        /* 4. Past the deadline, killed: the withdrawals go to a restarted connector that never saw
         *    the notices; it publishes the timeout and says so: 'timed out' on both sides.
         *    Rings: the notices are still in the ring, ahead of the withdrawals; the restarted
         *    connector publishes them and answers the withdrawals from its journal: 'finished'. */
        resolved = t_counter(P, KVF_CTR_NOTICES_IN_DOUBT);
        dpid = decode_connector();
        kill(dpid, SIGSTOP);
        r = submit(pc, "withdrawn-killed", 16);
        usleep(REQUEST_TIMEOUT_MS * 1000 + 1000000);
        kill(dpid, SIGKILL);
        settle(pc, dc, r, true, 10000);
        judge("stopped past the requests' deadline, killed", r, rings ? &FINISHED : &TIMED_OUT, 1);
        grew(P, KVF_CTR_NOTICES_IN_DOUBT, resolved, PER,
             "the withdrawals were not what the peer answered");

        /* 5. Stopped past the peer timeout before the requests (a span of time: the prefill side
         *    notices the silence within the timeout plus a keepalive, 1.5 s at most; nothing counts
         *    it while it has no work for the peer), and only then the requests:
         *    their notices never go out on any connection, so they fail 'connection error' at the
         *    peer timeout, and the decode side never publishes them, not even once it is continued
         *    (checked until the end of the test). */
        fails = t_counter(P, KVF_CTR_PEER_FAILURES);
        dpid = decode_connector();
        kill(dpid, SIGSTOP);
        usleep(PEER_TIMEOUT_MS * 2500);
        if (rings) {
                /* Rings: a notice is committed to the ring, never "unsent"; continued within the
                 * deadline, the connector reads them: 'finished'. (Continued only after the
                 * in-doubt bound, two request timeouts, the prefill side would have ended them
                 * 'timed out', in doubt, and the arrivals would still come: the in-doubt case.) */
                r = submit(pc, "unsent", 19);
                usleep(REQUEST_TIMEOUT_MS * 1000 / 3);
                kill(dpid, SIGCONT);
                settle(pc, dc, r, true, 10000);
                judge("stopped past the peer timeout before the notices, continued", r, &FINISHED, 1);
                goto after;
        }
        r = submit(pc, "unsent", 19);
        settle(pc, dc, r, false, 10000);
        kill(dpid, SIGCONT);
        const struct outcome unsent = {KVF_STATUS_CONNECTION, NONE};
        judge("notices never sent: the peer stopped past its timeout before them", r, &unsent, 1);
        grew(P, KVF_CTR_PEER_FAILURES, fails, 1,
             "the prefill side never tried to reach the stopped peer");

after:
        held_engine(pc);

        /* The connector continued: later requests reconnect and finish. */
        r = submit(pc, "after", 22);
        settle(pc, dc, r, true, 10000);
        judge("after the faults", r, &FINISHED, 1);

        /* Anything late: a second completion or arrival, an arrival for 'unsent' (waiting for
         * nothing to come is a span of time). */
        uint64_t end = kvf_now_ns() + 500000000ull;
        while (kvf_now_ns() < end)
                pump(pc, dc, 10);
        kvf_detach(pc);
        kvf_detach(dc);
        printf("agreement_test: every request ended as the rules say, the same on both sides\n");
        return 0;
}
