/*
 * The doorbell's dense-producer path (common/doorbell.c), between two
 * processes on a ring of a real control segment. A producer that keeps
 * finding the consumer awake (64 rings in a row) enters the unfenced mode:
 * it rings with a compiler barrier only, counted in the bell's `unfenced`.
 * A consumer that goes to sleep while a producer is so runs membarrier(2)
 * in place of the fences skipped, and no wake-up may be lost.
 *
 * Each round: a burst of records the consumer reads without ever sleeping
 * (the producer must be unfenced after it), then one record sent at a varying
 * distance from the consumer's going to sleep (at once, after a short spin,
 * after 20 us, after 1 ms), which must arrive within a bound far below the
 * consumer's sleep timeout: a lost wake-up would show as a record that waited
 * for that timeout. Then a sparse phase (the consumer asleep before every
 * record) must bring the producer back to the fenced protocol: `unfenced`
 * back to 0. First, a producer in a process that never called
 * kvf_doorbell_register stays fenced through a burst.
 *
 * Skipped (77) where membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED) is
 * unavailable. The producer dies with its parent.
 */
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>

#include "check.h"
#include "atomics.h"
#include "clock.h"
#include "ctl.h"
#include "doorbell.h"
#include "ring.h"

#define ROUNDS 3000
#define BURST 100               /* records in a burst: more than the 64 rings to go dense */
#define SPARSE 200              /* records of the sparse phase, one per consumer sleep */
#define SPARSE_GAP_NS 300000ull /* between them */
#define SLEEP_NS 5000000000ull  /* the consumer's sleep timeout: a lost wake-up runs into it */
#define BOUND_NS 1000000000ull  /* commit to receipt at most; a wake takes microseconds */
#define STALL_NS 20000000000ull /* no record for this long: the producer is gone or stuck */
#define REC_TYPE 7
#define EXIT_SKIP 77

static char inst[64];

static void cleanup(void)
{
        kvf_ctl_unlink(inst);
}

/* Outside the segment, between the two processes. */
struct shared {
        uint32_t acked; /* rounds whose last record the consumer has taken */
};

struct rec {
        uint64_t seq;
        uint64_t commit_ns; /* CLOCK_MONOTONIC, taken just before the write */
};

/* ---- the producer (the child) ---- */

static void send(struct kvf_ring *r, uint64_t seq)
{
        struct rec x = {.seq = seq};
        int rc;

        do {
                x.commit_ns = kvf_now_ns();
                rc = kvf_ring_write(r, REC_TYPE, &x, sizeof(x), NULL);
        } while (rc == -EAGAIN);
        if (rc != 0)
                _exit(3);
}

static int producer(struct kvf_ring *r, struct shared *sh)
{
        uint64_t seq = 0, rnd = 0x9e3779b97f4a7c15ull;

        /* A producer process registers at its start (as the roles do in main); without
         * it the doorbell stays fenced, which would pass without testing anything. */
        if (kvf_doorbell_register() != 0)
                return EXIT_SKIP;
        kvf_ring_producer_attach(r, 1);
        for (uint32_t round = 0; round < ROUNDS; round++) {
                for (int i = 0; i < BURST; i++)
                        send(r, seq++);
                rnd ^= rnd << 13;
                rnd ^= rnd >> 7;
                rnd ^= rnd << 17;
                switch (rnd % 4) {
                case 0: /* at once: the consumer is still reading */
                        break;
                case 1: /* while it prepares to sleep */
                        for (unsigned k = (unsigned)(rnd >> 8) % 2048; k > 0; k--)
                                kvf_cpu_relax();
                        break;
                case 2:
                        kvf_sleep_ns(20000);
                        break;
                default: /* asleep by then */
                        kvf_sleep_ns(1000000);
                        break;
                }
                send(r, seq++);
                /* Acquire pairs with the consumer's release of `acked`. */
                while (kvf_load_acquire(&sh->acked) <= round)
                        kvf_sleep_ns(10000);
        }
        for (int i = 0; i < SPARSE; i++) {
                kvf_sleep_ns(SPARSE_GAP_NS);
                send(r, seq++);
        }
        return 0;
}

/* ---- the consumer (the parent) ---- */

static pid_t child;

struct reader {
        uint64_t next;    /* seq expected */
        uint64_t bad;     /* out of order, or not ours */
        uint64_t max_ns;  /* the longest commit-to-receipt */
        uint64_t last_ns; /* when the last record came */
};

static int take(void *arg, uint16_t type, const uint8_t *p, uint32_t len, uint64_t pos)
{
        struct reader *rd = arg;
        struct rec x;
        uint64_t now = kvf_now_ns();

        (void)pos;
        if (type != REC_TYPE || len != sizeof(x)) {
                rd->bad++;
                return 0;
        }
        memcpy(&x, p, sizeof(x));
        if (x.seq != rd->next && rd->bad++ < 5)
                fprintf(stderr, "record %llu arrived where %llu was due\n",
                        (unsigned long long)x.seq, (unsigned long long)rd->next);
        rd->next = x.seq + 1;
        if (now > x.commit_ns && now - x.commit_ns > rd->max_ns)
                rd->max_ns = now - x.commit_ns;
        if (now > x.commit_ns && now - x.commit_ns > BOUND_NS) {
                fprintf(stderr,
                        "record %llu took %.3f s from commit to receipt (bound %.3f s): "
                        "a wake-up was lost\n",
                        (unsigned long long)x.seq, (double)(now - x.commit_ns) / 1e9,
                        (double)BOUND_NS / 1e9);
                exit(1);
        }
        rd->last_ns = now;
        return 0;
}

/* Nothing for too long: say why (the producer skipped, failed or hangs). */
static void check_stall(const struct reader *rd)
{
        int st;

        if (kvf_now_ns() - rd->last_ns < STALL_NS)
                return;
        if (waitpid(child, &st, WNOHANG) == child && WIFEXITED(st) && WEXITSTATUS(st) == EXIT_SKIP)
                SKIP("membarrier(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED) failed in the producer");
        fprintf(stderr, "no record for %.0f s after record %llu (producer %s)\n",
                (double)STALL_NS / 1e9, (unsigned long long)rd->next,
                kill(child, 0) == 0 ? "still running" : "gone");
        exit(1);
}

/* Up to record `until`, spinning: the producer never finds us announced. */
static void read_awake(struct kvf_ring *r, struct reader *rd, uint64_t until)
{
        while (rd->next < until) {
                int n = kvf_ring_read(r, take, rd, 256);
                CHECK(n >= 0);
                if (n == 0) {
                        check_stall(rd);
                        kvf_cpu_relax();
                }
        }
}

struct sleeps {
        uint64_t slept;    /* futex waits */
        uint64_t unfenced; /* ... entered while a producer rang unfenced: membarrier ran first */
        uint64_t cancels;  /* the re-check after announcing found the record */
        uint64_t timeouts;
};

/* Up to record `until`, going to sleep whenever the ring is empty. */
static void read_sleeping(struct kvf_ring *r, struct reader *rd, uint64_t until, struct sleeps *s)
{
        while (rd->next < until) {
                int n = kvf_ring_read(r, take, rd, 256);
                CHECK(n >= 0);
                if (n > 0)
                        continue;
                check_stall(rd);
                bool dense = kvf_load_relaxed(&r->bell->unfenced) > 0;
                uint32_t seq = kvf_doorbell_prepare(r->bell);
                if (kvf_ring_readable(r)) {
                        kvf_doorbell_cancel(r->bell, seq);
                        s->cancels++;
                        continue;
                }
                s->slept++;
                s->unfenced += dense;
                if (kvf_doorbell_sleep(r->bell, seq, SLEEP_NS) == -ETIMEDOUT)
                        s->timeouts++; /* the record, when it comes, says how late */
        }
}

/*
 * A producer in a process that never registered stays fenced through a burst: the ring that
 * would enter dense mode does not register on its own (in a process of several threads that
 * waits for a grace period, and the consumer of the record waited with it).
 */
static void unregistered_stays_fenced(struct kvf_ring *r)
{
        CHECK(r->bell->asymmetric);
        pid_t p = fork();
        CHECK(p >= 0);
        if (p == 0) {
                prctl(PR_SET_PDEATHSIG, SIGKILL);
                kvf_ring_producer_attach(r, 1);
                for (int i = 0; i < BURST; i++)
                        send(r, (uint64_t)i);
                _exit(0);
        }
        struct reader rd = {.last_ns = kvf_now_ns()};
        read_awake(r, &rd, BURST);
        int st;
        CHECK(waitpid(p, &st, 0) == p);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        CHECK_EQ(rd.bad, 0);
        CHECK_EQ(kvf_load_relaxed(&r->bell->unfenced), 0);
        fprintf(stderr, "unregistered: %d records read awake, the producer stayed fenced\n", BURST);
}

int main(void)
{
        struct kvf_ctl c;
        struct kvf_ctl_params p = {.instance = inst,
                                   .instance_role = KVF_IROLE_MIXED,
                                   .backend = KVF_BACKEND_HOST,
                                   .reqtab_slots = 4,
                                   .max_blocks = 16};

        if (!kvf_doorbell_asymmetric_supported())
                SKIP("membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED) is not available here: the "
                     "doorbell never leaves the fenced protocol");
        snprintf(inst, sizeof(inst), "t-bell-%d", (int)getpid());
        atexit(cleanup);
        for (int i = 0; i < KVF_RING_COUNT; i++)
                p.ring_capacity[i] = 1 << 16;
        kvf_ctl_unlink(inst);
        CHECK(kvf_ctl_create(&p, &c) == 0);
        kvf_ctl_publish(&c);
        struct kvf_ring *r = &c.rings[KVF_RING_ENGINE_TO_SENDER];
        CHECK(r->bell->asymmetric);
        struct shared *sh =
            mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        CHECK(sh != MAP_FAILED);
        unregistered_stays_fenced(&c.rings[KVF_RING_SENDER_TO_ENGINE]);

        uint64_t t0 = kvf_now_ns();
        child = fork();
        CHECK(child >= 0);
        if (child == 0) {
                prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a failed test */
                _exit(producer(r, sh));
        }

        struct reader rd = {.last_ns = kvf_now_ns()};
        struct sleeps dense = {0}, sparse = {0};
        uint64_t wakes0 = kvf_load_relaxed(&r->bell->wakes);
        for (uint32_t round = 0; round < ROUNDS; round++) {
                uint64_t first = (uint64_t)round * (BURST + 1);
                read_awake(r, &rd, first + BURST);
                /* The burst's 64th ring came before its 65th record's commit, which we have
                 * read (acquire): the producer counted itself unfenced by then, and stays so
                 * while it finds nobody asleep. One producer thread: one count. */
                uint32_t u = kvf_load_relaxed(&r->bell->unfenced);
                if (u != 1) {
                        fprintf(stderr,
                                "round %u: unfenced is %u after a burst of %d records read "
                                "without sleeping, expected 1\n",
                                round, u, BURST);
                        exit(1);
                }
                read_sleeping(r, &rd, first + BURST + 1, &dense);
                /* Release pairs with the producer's acquire: the next burst starts now. */
                kvf_store_release(&sh->acked, round + 1);
        }
        uint64_t wakes_dense = kvf_load_relaxed(&r->bell->wakes) - wakes0;
        uint64_t end_dense = (uint64_t)ROUNDS * (BURST + 1);
        read_sleeping(r, &rd, end_dense + SPARSE, &sparse);
        uint32_t u = kvf_load_relaxed(&r->bell->unfenced);

        int st;
        CHECK(waitpid(child, &st, 0) == child);
        if (WIFEXITED(st) && WEXITSTATUS(st) == EXIT_SKIP)
                SKIP("membarrier(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED) failed in the producer");
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        CHECK_EQ(rd.bad, 0);
        CHECK_EQ(rd.next, end_dense + SPARSE);
        fprintf(stderr,
                "dense: %u rounds of %d + 1 records; the producer unfenced after every burst; the "
                "consumer slept %llu times, %llu of them with the producer unfenced (membarrier), "
                "re-check found the record %llu times, %llu futex wakes, %llu timeouts\n",
                ROUNDS, BURST, (unsigned long long)dense.slept, (unsigned long long)dense.unfenced,
                (unsigned long long)dense.cancels, (unsigned long long)wakes_dense,
                (unsigned long long)dense.timeouts);
        fprintf(stderr,
                "sparse: %d records, the consumer slept %llu times; unfenced now %u; longest "
                "commit-to-receipt %.1f us; %.2f s in all\n",
                SPARSE, (unsigned long long)sparse.slept, u, (double)rd.max_ns / 1e3,
                (double)(kvf_now_ns() - t0) / 1e9);
        /* The path was taken: the consumer went to sleep while the producer rang unfenced (in
         * a quarter of the rounds the last record comes 1 ms after the burst), and such
         * sleeps were woken. */
        CHECK(dense.unfenced >= ROUNDS / 10);
        CHECK(wakes_dense >= ROUNDS / 10);
        CHECK_EQ(dense.timeouts, 0);
        /* Sparse traffic rings with the fence again: the first ring that found the consumer
         * asleep left the unfenced mode, and 64 in a row without a sleeper never came. */
        CHECK_EQ(u, 0);
        CHECK(sparse.slept >= SPARSE / 2);
        CHECK_EQ(sparse.timeouts, 0);
        kvf_ctl_detach(&c);
        fprintf(stderr, "doorbell_test: all passed\n");
        return 0;
}
