/*
 * The rdma transport between two running instances (tests/vm/rdma_test.sh starts them in the
 * soft-RoCE VM), as their engines: it writes known bytes into the prefill cache, submits
 * tasks with transfer_protocol "rdma", publishes the layers, and checks the completion, the
 * arrival and every byte of every destination block.
 *
 *   --case runs     blocks contiguous on both sides go as one RDMA WRITE per (layer, tensor);
 *                   scattered destination blocks as one per block: the prefill connector's
 *                   work-request counters must say exactly that (and one done message each)
 *   --case one --expect STATUS
 *                   one request; its completion must say STATUS (finished: bytes verified)
 *   --case dereg    the decode connector (started with --rdma-test-dereg) deregisters its
 *                   peers' regions on SIGUSR2: the next request's writes fail on the remote
 *                   key and it ends "write error" on both sides; the one after that, over a
 *                   new connection and region, finishes
 *   --case engine   instances of the engine's own caches (--caches engine): this process
 *                   registers host memory for both, the prefill side's every layer in one
 *                   file ([layers][K/V][blocks]), the decode side's blocks-first per layer
 *                   ([blocks][K/V], blocks not back to back: a work request per block); a
 *                   request finishes, verified; the decode engine registers new memory: the
 *                   next request lands there (the old connection and its regions went), and
 *                   so after the prefill engine does; with the decode side's registration
 *                   gone a request fails naming it, and once registered again finishes
 *   --case killmid --supervisor PID
 *                   mid-transfer, the decode supervisor is stopped and the decode connector
 *                   killed: the request ends "connection error" within the peer timeout;
 *                   the supervisor continues, restarts the connector, and a new request
 *                   finishes
 *
 * Exit: 0 pass, 1 fail, 2 usage.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"
#include "clock.h"
#include "ctl.h"
#include "kvferry.h"

static const char *P, *D, *peer;
static struct kvf_client *pc, *dc;
static struct kvf_layout_info L;
static uint32_t tensors;
static unsigned seq;

static uint64_t mix(uint64_t x)
{
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdull;
        x ^= x >> 33;
        x *= 0xc4ceb9fe1a85ec53ull;
        return x ^ (x >> 33);
}

/* --case engine: the caches this process registered for one side, a file each region. */
#define SIDE_MAX_REGIONS 64
struct side {
        struct kvf_client *c;
        bool blocks_first; /* [blocks][K/V] per layer, else every layer in one file */
        uint32_t nreg;
        uint8_t *mem[SIDE_MAX_REGIONS];
        uint64_t bytes[SIDE_MAX_REGIONS];
        int fd[SIDE_MAX_REGIONS];
        uint8_t *view[256]; /* (layer, tensor): block 0 */
        uint64_t stride;
};
static struct side *sides[2];

static uint8_t *block_at(struct kvf_client *c, uint32_t layer, uint32_t t, uint32_t b)
{
        for (int i = 0; i < 2; i++)
                if (sides[i] && sides[i]->c == c)
                        return sides[i]->view[layer * tensors + t] + (uint64_t)b * sides[i]->stride;
        return (uint8_t *)kvf_cache_tensor(c, layer, (int)t) + (uint64_t)b * L.block_bytes;
}

/* Request r's content of its i-th block in (layer, t). */
static void fill(uint8_t *p, unsigned r, uint32_t layer, uint32_t t, uint32_t i)
{
        for (uint64_t w = 0; w < L.block_bytes / 8; w++) {
                uint64_t v = mix(((uint64_t)r << 40) ^ ((uint64_t)layer << 24) ^ ((uint64_t)t << 20) ^
                                 ((uint64_t)i << 8) ^ w);
                memcpy(p + 8 * w, &v, 8);
        }
}

static uint64_t counter(const char *inst, const char *name)
{
        struct kvf_ctl c;
        CHECK_EQ(kvf_ctl_attach(inst, false, &c), 0);
        uint64_t v = UINT64_MAX;
        for (int i = 0; i < KVF_COUNTER_COUNT; i++)
                if (!strcmp(kvf_counter_names[i], name))
                        v = kvf_load_relaxed(&c.counters[i].value);
        kvf_ctl_detach(&c);
        CHECK(v != UINT64_MAX);
        return v;
}

static pid_t connector_pid(const char *inst)
{
        struct kvf_ctl c;
        CHECK_EQ(kvf_ctl_attach(inst, false, &c), 0);
        pid_t pid = c.roles[KVF_ROLE_CONNECTOR].pid;
        kvf_ctl_detach(&c);
        return pid;
}

struct req {
        char id[32];
        uint32_t n;
        uint32_t src[512], dst[512];
        uint64_t step;
};

/* A request of n blocks; scattered: every other destination block (no two contiguous). Its
 * destination blocks are zeroed unless the decode side has no caches to zero (keep_dst). */
static void make_to(struct req *q, uint32_t n, uint32_t src0, uint32_t dst0, bool scattered, bool keep_dst)
{
        CHECK(n <= 512);
        memset(q, 0, sizeof(*q));
        snprintf(q->id, sizeof(q->id), "rt-%d-%u", (int)getpid(), ++seq);
        q->n = n;
        for (uint32_t i = 0; i < n; i++) {
                q->src[i] = src0 + i;
                q->dst[i] = dst0 + (scattered ? 2 * i : i);
                CHECK(q->src[i] < L.num_blocks && q->dst[i] < L.num_blocks);
        }
        for (uint32_t l = 0; l < L.num_layers + L.extra_layers; l++)
                for (uint32_t t = 0; t < tensors; t++)
                        for (uint32_t i = 0; i < n; i++) {
                                fill(block_at(pc, l, t, q->src[i]), seq, l, t, i);
                                if (!keep_dst)
                                        memset(block_at(dc, l, t, q->dst[i]), 0, L.block_bytes);
                        }
}

static void make(struct req *q, uint32_t n, uint32_t src0, uint32_t dst0, bool scattered)
{
        make_to(q, n, src0, dst0, scattered, false);
}

static void make_unregistered(struct req *q, uint32_t n)
{
        make_to(q, n, 0, 1, false, true);
}

static void submit(struct req *q, uint32_t layers)
{
        q->step = kvf_last_step(pc) + 1;
        struct kvf_task t = {.request_id = q->id, .src_block_ids = q->src, .n_src = q->n,
                             .dest_block_ids = q->dst, .n_dest = q->n, .current_id = q->step,
                             .transport = KVF_TRANSPORT_RDMA, .peer = peer};
        CHECK_EQ(kvf_submit_task(pc, &t), 0);
        for (uint32_t l = 0; l < layers; l++)
                CHECK_EQ(kvf_layer_done(pc, q->step, l), 0);
}

static void publish_rest(struct req *q, uint32_t from)
{
        for (uint32_t l = from; l < L.num_layers + L.extra_layers; l++)
                CHECK_EQ(kvf_layer_done(pc, q->step, l), 0);
}

/* The completion of q within timeout_ms (its status), and its arrival if one comes soon. */
static int outcome(struct req *q, int timeout_ms, int *arrival, char *why, size_t whylen)
{
        struct kvf_event ev;
        int c = -1;
        *arrival = -1;
        uint64_t end = kvf_now_ns() + (uint64_t)timeout_ms * 1000000ull;
        while (c < 0 && kvf_now_ns() < end)
                if (kvf_poll(pc, &ev, 100) == 1 && ev.type == KVF_EVENT_COMPLETION && !strcmp(ev.request_id, q->id)) {
                        c = ev.status;
                        snprintf(why, whylen, "%s", ev.reason);
                }
        end = kvf_now_ns() + (c == KVF_STATUS_FINISHED ? 10000000000ull : 3000000000ull);
        while (*arrival < 0 && kvf_now_ns() < end)
                if (kvf_poll(dc, &ev, 100) == 1 && ev.type == KVF_EVENT_ARRIVAL && !strcmp(ev.request_id, q->id))
                        *arrival = ev.status;
        return c;
}

static void verify(const struct req *q, unsigned r)
{
        uint8_t *want = malloc(L.block_bytes);
        CHECK(want != NULL);
        for (uint32_t l = 0; l < L.num_layers + L.extra_layers; l++)
                for (uint32_t t = 0; t < tensors; t++)
                        for (uint32_t i = 0; i < q->n; i++) {
                                fill(want, r, l, t, i);
                                if (memcmp(want, block_at(dc, l, t, q->dst[i]), L.block_bytes)) {
                                        fprintf(stderr, "FAIL: %s: layer %u tensor %u block %u (dest %u) differs\n",
                                                q->id, l, t, i, q->dst[i]);
                                        exit(1);
                                }
                        }
        free(want);
}

/* Request q start to end, unverified: its completion status (the sides agree on it). */
static int run_req(struct req *q, int timeout_ms, char *why, size_t whylen)
{
        submit(q, L.num_layers + L.extra_layers);
        int a, c = outcome(q, timeout_ms, &a, why, whylen);
        CHECK((c == KVF_STATUS_FINISHED) == (a == KVF_STATUS_FINISHED));
        return c;
}

/* One request start to end; returns the completion status, and checks the arrival agrees. */
static int run_one(uint32_t n, bool scattered, int timeout_ms, char *why, size_t whylen)
{
        struct req q;
        make(&q, n, 0, 1, scattered);
        unsigned r = seq;
        submit(&q, L.num_layers + L.extra_layers);
        int a, c = outcome(&q, timeout_ms, &a, why, whylen);
        printf("  %s: %u blocks%s: completion '%s', arrival '%s'%s%s\n", q.id, n, scattered ? " (scattered)" : "",
               c < 0 ? "(none)" : kvf_status_name(c), a < 0 ? "(none)" : kvf_status_name(a),
               why[0] ? ": " : "", why);
        CHECK((c == KVF_STATUS_FINISHED) == (a == KVF_STATUS_FINISHED)); /* the sides agree */
        if (c == KVF_STATUS_FINISHED)
                verify(&q, r);
        return c;
}

static void case_runs(void)
{
        char why[256];
        uint32_t n = L.num_blocks / 4 < 64 ? L.num_blocks / 4 : 64;
        uint64_t per = (uint64_t)(L.num_layers + L.extra_layers) * tensors;
        for (int scattered = 0; scattered <= 1; scattered++) {
                uint64_t w0 = counter(P, "rdma_write_requests"), d0 = counter(P, "rdma_done_messages_sent"),
                         b0 = counter(P, "blocks_sent_rdma");
                CHECK_EQ(run_one(n, scattered, 60000, why, sizeof(why)), KVF_STATUS_FINISHED);
                uint64_t writes = counter(P, "rdma_write_requests") - w0,
                         dones = counter(P, "rdma_done_messages_sent") - d0,
                         blocks = counter(P, "blocks_sent_rdma") - b0;
                uint64_t want = scattered ? per * n : per; /* one run of n blocks per (layer, tensor) */
                printf("ok: %s: %llu RDMA WRITEs for %llu blocks x layers x tensors (one per block would be %llu), "
                       "%llu done message\n",
                       scattered ? "scattered destination blocks" : "blocks contiguous on both sides",
                       (unsigned long long)writes, (unsigned long long)blocks, (unsigned long long)per * n,
                       (unsigned long long)dones);
                CHECK_EQ(writes, want);
                CHECK_EQ(blocks, per * n);
                CHECK_EQ(dones, 1);
        }
}

static uint8_t *region(struct side *sd, uint64_t bytes)
{
        CHECK(sd->nreg < SIDE_MAX_REGIONS);
        int fd = memfd_create("kvf-rdma-engine", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        CHECK(fd >= 0 && ftruncate(fd, (off_t)bytes) == 0 && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
        uint8_t *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        CHECK(p != MAP_FAILED);
        sd->mem[sd->nreg] = p;
        sd->bytes[sd->nreg] = bytes;
        sd->fd[sd->nreg++] = fd;
        return p;
}

/* Register new memory (zeros) for sd's instance, replacing what it had. */
static void side_register(struct side *sd)
{
        const uint32_t nl = L.num_layers + L.extra_layers, nt = tensors;
        const uint64_t bb = L.block_bytes, nb = L.num_blocks;
        struct side old = *sd;
        sd->nreg = 0;
        if (sd->blocks_first) {
                sd->stride = nt * bb;
                for (uint32_t l = 0; l < nl; l++) {
                        uint8_t *p = region(sd, nb * nt * bb);
                        for (uint32_t t = 0; t < nt; t++)
                                sd->view[l * nt + t] = p + t * bb;
                }
        } else {
                sd->stride = bb;
                uint8_t *p = region(sd, (uint64_t)nl * nt * nb * bb);
                for (uint32_t i = 0; i < nl * nt; i++)
                        sd->view[i] = p + (uint64_t)i * nb * bb;
        }
        struct kvf_reg_region rg[SIDE_MAX_REGIONS];
        struct kvf_reg_view vw[256];
        for (uint32_t i = 0; i < sd->nreg; i++)
                rg[i] = (struct kvf_reg_region){.addr = sd->mem[i], .bytes = sd->bytes[i], .fd = sd->fd[i]};
        for (uint32_t i = 0; i < nl * nt; i++)
                vw[i] = (struct kvf_reg_view){.layer = i / nt, .tensor = i % nt, .addr = sd->view[i],
                                              .block_stride = sd->stride};
        struct kvf_registration r = {.regions = rg, .n_regions = sd->nreg, .views = vw, .n_views = nl * nt,
                                     .device = -1};
        if (old.nreg)
                CHECK_EQ(kvf_unregister_caches(sd->c), 0);
        if (kvf_register_caches_sized(sd->c, &r, sizeof(r)) != 0) {
                fprintf(stderr, "FAIL: register: %s\n", kvf_last_error());
                exit(1);
        }
        for (uint32_t i = 0; i < old.nreg; i++) {
                munmap(old.mem[i], old.bytes[i]);
                close(old.fd[i]);
        }
}

/* The instances' counters of writes and blocks, for one request of n blocks. */
static void expect_writes(uint32_t n, uint64_t want, const char *what)
{
        char why[256] = "";
        uint64_t w0 = counter(P, "rdma_write_requests"), b0 = counter(P, "blocks_sent_rdma");
        int got = run_one(n, false, 60000, why, sizeof(why));
        if (got != KVF_STATUS_FINISHED) {
                fprintf(stderr, "FAIL: %s: '%s': %s\n", what, kvf_status_name(got), why);
                exit(1);
        }
        uint64_t writes = counter(P, "rdma_write_requests") - w0, blocks = counter(P, "blocks_sent_rdma") - b0;
        printf("ok: %s: finished, every byte verified; %llu RDMA WRITEs for %llu blocks x layers x tensors\n", what,
               (unsigned long long)writes, (unsigned long long)blocks);
        CHECK_EQ(writes, want);
}

/* The outcome of q, whose caches were registered anew while it moved: finished with every byte
 * the request's, or "engine gone" on both sides. */
static void mid_transfer(struct req *q, unsigned r, const char *what, char *why, size_t whylen)
{
        int a, got = outcome(q, 60000, &a, why, whylen);
        printf("ok: %s: '%s', arrival '%s'%s%s\n", what, kvf_status_name(got), a < 0 ? "(none)" : kvf_status_name(a),
               why[0] ? ": " : "", why);
        CHECK((got == KVF_STATUS_FINISHED) == (a == KVF_STATUS_FINISHED));
        CHECK(got == KVF_STATUS_FINISHED || got == KVF_STATUS_ENGINE_GONE);
        if (got == KVF_STATUS_FINISHED)
                verify(q, r);
        else
                CHECK(strstr(why, "registered anew") || strstr(why, "gave it up"));
}

static void case_engine(uint32_t n)
{
        static struct side ps, ds;
        ps = (struct side){.c = pc};
        ds = (struct side){.c = dc, .blocks_first = true};
        sides[0] = &ps;
        sides[1] = &ds;
        CHECK((L.num_layers + L.extra_layers) * tensors <= 256);
        /* Nothing registered on the decode side yet: refused, saying so. */
        side_register(&ps);
        char why[256] = "";
        struct req q;
        make_unregistered(&q, n);
        int got = run_req(&q, 30000, why, sizeof(why));
        printf("ok: the decode side's caches not registered: '%s': %s\n", kvf_status_name(got), why);
        CHECK(got != KVF_STATUS_FINISHED && strstr(why, "waiting for the engine's caches"));
        side_register(&ds);
        const uint64_t per = (uint64_t)(L.num_layers + L.extra_layers) * tensors;
        expect_writes(n, per * n, "registered caches, the decode side's blocks-first (a write per block)");
        uint8_t *old = ds.view[0];
        side_register(&ds);
        CHECK(ds.view[0] != old);
        usleep(600000); /* the decode connector's rdma loop looks every 200 ms */
        expect_writes(n, per * n, "the decode engine registered new memory: the request landed there");
        /* Registered anew mid-transfer: every byte in the new memory (the connection that
         * wrote into the old went, and all of it went again), or "engine gone" on both sides;
         * never finished with bytes in the old memory. */
        make(&q, n, 0, 1, false);
        unsigned r = seq, half = (L.num_layers + L.extra_layers) / 2;
        submit(&q, half);
        usleep(300000);
        side_register(&ds);
        publish_rest(&q, half);
        mid_transfer(&q, r, "the decode engine registered new memory mid-transfer", why, sizeof(why));
        side_register(&ps);
        expect_writes(n, per * n, "the prefill engine registered new memory: the request came from there");
        /* The prefill side's, mid-transfer: what is not yet written would come from new
         * memory (zeros here), never the request's: "engine gone", or every byte the request's. */
        make(&q, n, 0, 1, false);
        r = seq;
        submit(&q, half);
        usleep(300000);
        side_register(&ps);
        publish_rest(&q, half);
        mid_transfer(&q, r, "the prefill engine registered new memory mid-transfer", why, sizeof(why));
        CHECK_EQ(kvf_unregister_caches(dc), 0);
        ds.nreg = 0; /* (its memory stays mapped here: a leak the test does not mind) */
        usleep(600000); /* (the connection into it goes first: a request now is refused) */
        make_unregistered(&q, n);
        got = run_req(&q, 30000, why, sizeof(why));
        printf("ok: the decode engine's registration dropped: '%s': %s\n", kvf_status_name(got), why);
        CHECK(got != KVF_STATUS_FINISHED && strstr(why, "waiting for the engine's caches"));
        side_register(&ds);
        expect_writes(n, per * n, "registered again: finished");
}

static int status_named(const char *s)
{
        int st = kvf_status_from_name(s);
        if (st < 0) {
                fprintf(stderr, "unknown status '%s'\n", s);
                exit(2);
        }
        return st;
}

int main(int argc, char **argv)
{
        static const struct option lo[] = {{"prefill", required_argument, 0, 'p'},
                                           {"decode", required_argument, 0, 'd'},
                                           {"peer", required_argument, 0, 'a'},
                                           {"case", required_argument, 0, 'c'},
                                           {"expect", required_argument, 0, 'e'},
                                           {"blocks", required_argument, 0, 'n'},
                                           {"supervisor", required_argument, 0, 's'},
                                           {"timeout-ms", required_argument, 0, 't'},
                                           {0, 0, 0, 0}};
        const char *cs = NULL, *expect = "finished";
        int c, timeout_ms = 60000;
        uint32_t n = 16;
        pid_t sup = 0;
        while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
                switch (c) {
                case 'p': P = optarg; break;
                case 'd': D = optarg; break;
                case 'a': peer = optarg; break;
                case 'c': cs = optarg; break;
                case 'e': expect = optarg; break;
                case 'n': n = (uint32_t)atoi(optarg); break;
                case 's': sup = (pid_t)atoi(optarg); break;
                case 't': timeout_ms = atoi(optarg); break;
                default: return 2;
                }
        }
        if (!P || !D || !cs) {
                fprintf(stderr, "usage: rdma_transport_test --prefill P --decode D [--peer ADDR] --case runs|one|dereg|killmid\n");
                return 2;
        }
        if (!peer)
                peer = D;
        CHECK_EQ(kvf_attach(D, 10000, &dc), 0);
        CHECK_EQ(kvf_attach(P, 10000, &pc), 0);
        kvf_get_layout(pc, &L);
        tensors = L.key_only ? 1 : 2;
        char why[256] = "";

        if (!strcmp(cs, "runs")) {
                case_runs();
        } else if (!strcmp(cs, "one")) {
                int want = status_named(expect);
                int got = run_one(n, false, timeout_ms, why, sizeof(why));
                CHECK_EQ(got, want);
                printf("ok: one request over rdma: '%s'%s%s\n", kvf_status_name(got), why[0] ? ": " : "", why);
        } else if (!strcmp(cs, "dereg")) {
                CHECK_EQ(run_one(n, false, timeout_ms, why, sizeof(why)), KVF_STATUS_FINISHED);
                pid_t dpid = connector_pid(D);
                CHECK(dpid > 0);
                CHECK_EQ(kill(dpid, SIGUSR2), 0);
                usleep(600000); /* the decode connector's loop looks every 200 ms */
                uint64_t e0 = counter(P, "rdma_completion_errors");
                int got = run_one(n, false, timeout_ms, why, sizeof(why));
                printf("ok: the peer's region deregistered: '%s': %s (%llu completion error)\n",
                       kvf_status_name(got), why, (unsigned long long)(counter(P, "rdma_completion_errors") - e0));
                CHECK_EQ(got, KVF_STATUS_WRITE);
                CHECK(strstr(why, "remote access") != NULL); /* the completion status, carried */
                CHECK(counter(P, "rdma_completion_errors") > e0);
                CHECK_EQ(run_one(n, false, timeout_ms, why, sizeof(why)), KVF_STATUS_FINISHED);
                printf("ok: the next request, over a new connection and region: finished, verified\n");
        } else if (!strcmp(cs, "engine")) {
                case_engine(n);
        } else if (!strcmp(cs, "killmid")) {
                CHECK(sup > 0);
                struct req q;
                make(&q, n, 0, 1, false);
                unsigned half = (L.num_layers + L.extra_layers) / 2;
                submit(&q, half);
                usleep(300000); /* some layers are in flight or written */
                pid_t dpid = connector_pid(D);
                CHECK_EQ(kill(sup, SIGSTOP), 0); /* no restart for now */
                CHECK_EQ(kill(dpid, SIGKILL), 0);
                uint64_t t0 = kvf_now_ns();
                /* The other layers come later than the peer timeout: the transfer fails
                 * before its finish notice exists (a notice sent on a connection that broke
                 * is in doubt, and only the peer's answer or the request's deadline ends it:
                 * agreement_test covers that). */
                int a, got = outcome(&q, timeout_ms, &a, why, sizeof(why));
                publish_rest(&q, half);
                printf("ok: decode connector killed mid-transfer: '%s' after %llu ms: %s\n",
                       got < 0 ? "(none)" : kvf_status_name(got),
                       (unsigned long long)((kvf_now_ns() - t0) / 1000000), why);
                kill(sup, SIGCONT);
                CHECK_EQ(got, KVF_STATUS_CONNECTION);
                /* The supervisor restarts the connector; the prefill side reconnects. */
                for (int i = 0; i < 100 && connector_pid(D) == dpid; i++)
                        usleep(100000);
                usleep(1500000);
                CHECK_EQ(run_one(n, false, timeout_ms, why, sizeof(why)), KVF_STATUS_FINISHED);
                printf("ok: after the connector came back: a new request finished, verified\n");
        } else {
                fprintf(stderr, "unknown case '%s'\n", cs);
                return 2;
        }
        kvf_detach(pc);
        kvf_detach(dc);
        return 0;
}
