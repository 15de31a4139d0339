/*
 * An engine built against an older kvferry.h (KVF_OLD_HEADER, a copy kept in
 * tests/abi/) and linked against a stand-in of the library of its time
 * (tests/abi/stub.c), run against this build's libkvferry.
 *
 * KVF_OLD_PRE: kvferry.h before engine sessions (struct kvf_event of 528
 * bytes, status at offset 4), linked with no symbol versions. Its tasks still
 * move; kvf_poll must refuse (-ENOTSUP, kvf_last_error saying to rebuild)
 * and write nothing: not into the event, not past it.
 *
 * Else: kvferry.h as libkvferry.so.0 was first released with symbol versions
 * (KVFERRY_0). Its completions and arrivals must come intact, and nothing
 * past its struct may be written.
 *
 * Instances are started as the other C tests start them (tools/kvferry up).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include KVF_OLD_HEADER

#define CHECK(x)                                                                              \
        do {                                                                                  \
                if (!(x)) {                                                                   \
                        fprintf(stderr, "%s:%d: CHECK(%s) failed (last error: %s)\n", __FILE__, \
                                __LINE__, #x, kvf_last_error());                              \
                        exit(1);                                                              \
                }                                                                             \
        } while (0)

#define NREQ 3
#define CANARY 0xA5
#define LAYERS 4

static char P[64], D[64];
static int nup;

static void down_all(void)
{
        char cmd[512];
        snprintf(cmd, sizeof(cmd), "%s/tools/kvferry down --instance %s --instance %s >/dev/null 2>&1",
                 KVF_SOURCE_DIR, P, D);
        if (nup && system(cmd) != 0)
                fprintf(stderr, "cleanup: %s failed\n", cmd);
}

static void up(const char *name, const char *role)
{
        char cmd[1024];
        if (nup++ == 0)
                atexit(down_all);
        snprintf(cmd, sizeof(cmd),
                 "%s/tools/kvferry up --instance %s --role %s --layers %d --kv-heads 1 --head-dim 64 "
                 "--blocks 32 >/dev/null",
                 KVF_SOURCE_DIR, name, role, LAYERS);
        if (system(cmd) != 0) {
                fprintf(stderr, "command failed: %s\n", cmd);
                exit(1);
        }
}

/* The event, and what follows it in the engine's memory. */
struct guarded {
        struct kvf_event ev;
        unsigned char after[256];
};

static void guard(struct guarded *g)
{
        memset(g, CANARY, sizeof(*g));
}

static int untouched(const unsigned char *p, size_t n)
{
        for (size_t i = 0; i < n; i++)
                if (p[i] != CANARY)
                        return 0;
        return 1;
}

#ifndef KVF_OLD_PRE
static double now_s(void)
{
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}
#endif

int main(void)
{
        struct kvf_client *pc, *dc;
        uint32_t src[NREQ][2], dst[NREQ][2];
        char ids[NREQ][32];

        snprintf(P, sizeof(P), "abi%d-p", (int)getpid());
        snprintf(D, sizeof(D), "abi%d-d", (int)getpid());
        up(D, "decode");
        up(P, "prefill");
        CHECK(kvf_attach(P, 5000, &pc) == 0);
        CHECK(kvf_attach(D, 5000, &dc) == 0);
        struct kvf_layout_info li;
        CHECK(kvf_get_layout(pc, &li) == 0);
        CHECK(li.num_layers == LAYERS && li.num_blocks == 32 && li.head_dim == 64);

        for (int i = 0; i < NREQ; i++) {
                snprintf(ids[i], sizeof(ids[i]), "old-%d", i);
                src[i][0] = 2u * i, src[i][1] = 2u * i + 1;
                dst[i][0] = 20u + 2u * i, dst[i][1] = 21u + 2u * i;
                struct kvf_task t = {.request_id = ids[i], .src_block_ids = src[i], .n_src = 2,
                                     .dest_block_ids = dst[i], .n_dest = 2, .current_id = 1,
                                     .transport = KVF_TRANSPORT_IPC, .peer = D};
                CHECK(kvf_submit_task(pc, &t) == 0);
        }
        for (uint32_t l = 0; l < LAYERS; l++)
                CHECK(kvf_layer_done(pc, 1, l) == 0);

        struct guarded g;
#ifdef KVF_OLD_PRE
        guard(&g);
        int rc = kvf_poll(pc, &g.ev, 2000);
        CHECK(rc == -ENOTSUP);
        CHECK(strstr(kvf_last_error(), "rebuild") != NULL);
        CHECK(untouched((const unsigned char *)&g, sizeof(g)));
        guard(&g);
        CHECK(kvf_poll(dc, &g.ev, 0) == -ENOTSUP);
        CHECK(untouched((const unsigned char *)&g, sizeof(g)));
        printf("old_engine (pre-versions header, %zu-byte event): tasks accepted; kvf_poll refused: %s\n",
               sizeof(g.ev), kvf_last_error());
#else
        int completions = 0, arrivals = 0;
        double end = now_s() + 30;
        while ((completions < NREQ || arrivals < NREQ) && now_s() < end) {
                struct kvf_client *c = completions < NREQ ? pc : dc;
                guard(&g);
                int rc = kvf_poll(c, &g.ev, 200);
                CHECK(rc >= 0);
                CHECK(untouched(g.after, sizeof(g.after)));
                if (rc == 0)
                        continue;
                int i = -1;
                for (int k = 0; k < NREQ; k++)
                        if (!strcmp(g.ev.request_id, ids[k]))
                                i = k;
                CHECK(i >= 0);
                CHECK(g.ev.status == KVF_STATUS_FINISHED);
                CHECK(g.ev.reason[0] == '\0');
                CHECK(g.ev.flags == 0);
                CHECK(g.ev.blocks == 2);
                if (c == pc) {
                        CHECK(g.ev.type == KVF_EVENT_COMPLETION);
                        CHECK(!strcmp(g.ev.peer, D));
                        CHECK(g.ev.session == kvf_session(pc));
                        CHECK(g.ev.bytes == 2 * li.block_bytes * (li.key_only ? 1 : 2) * LAYERS);
                        CHECK(g.ev.accept_ns && g.ev.accept_ns <= g.ev.done_ns);
                        completions++;
                } else {
                        CHECK(g.ev.type == KVF_EVENT_ARRIVAL);
                        CHECK(!strcmp(g.ev.peer, P));
                        CHECK(g.ev.n_dest == 2 && g.ev.dest_block_ids);
                        CHECK(g.ev.dest_block_ids[0] == dst[i][0] && g.ev.dest_block_ids[1] == dst[i][1]);
                        arrivals++;
                }
        }
        CHECK(completions == NREQ && arrivals == NREQ);
        printf("old_engine (KVFERRY_0 header, %zu-byte event): %d completions and %d arrivals intact, "
               "nothing written past the event\n",
               sizeof(g.ev), completions, arrivals);
#endif
        kvf_detach(dc);
        kvf_detach(pc);
        return 0;
}
