/*
 * The SPSC ring and its doorbell, in a real control segment:
 * wrap with padding, full ring, oversized and empty records, 10 million
 * stamped records between two processes, an abandoned claim after a producer
 * dies, repair after a consumer dies while zeroing, no lost wake-ups, and
 * waits that time out.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <sys/prctl.h>
#include <sys/wait.h>

#include "check.h"
#include "atomics.h"
#include "clock.h"
#include "ctl.h"
#include "doorbell.h"
#include "ring.h"

static char inst[64];

static void cleanup(void)
{
        kvf_ctl_unlink(inst);
}

static void make_segment(struct kvf_ctl *c, uint64_t cap)
{
        struct kvf_ctl_params p = {.instance = inst, .instance_role = KVF_IROLE_MIXED,
                                   .backend = KVF_BACKEND_HOST, .reqtab_slots = 4, .max_blocks = 16};
        for (int i = 0; i < KVF_RING_COUNT; i++)
                p.ring_capacity[i] = cap;
        kvf_ctl_unlink(inst);
        CHECK(kvf_ctl_create(&p, c) == 0);
        kvf_ctl_publish(c);
}

/* Payload of record `seq`: its length and bytes follow from seq alone. */
static uint32_t stamp_len(uint64_t seq)
{
        return 8 + (uint32_t)((seq * 2654435761u) % 120);
}

static void stamp(uint8_t *p, uint64_t seq)
{
        uint32_t n = stamp_len(seq);
        memcpy(p, &seq, 8);
        for (uint32_t i = 8; i < n; i++)
                p[i] = (uint8_t)(seq * 31 + i);
}

struct reader {
        uint64_t next;
        uint64_t bad;
        uint64_t last_pos;
};

static int check_stamped(void *arg, uint16_t type, const uint8_t *p, uint32_t len, uint64_t pos)
{
        struct reader *rd = arg;
        uint64_t seq;
        uint8_t want[128];

        memcpy(&seq, p, 8);
        stamp(want, rd->next);
        if (type != 7 || seq != rd->next || len != stamp_len(rd->next) || memcmp(p, want, len) ||
            (rd->next && pos <= rd->last_pos)) {
                if (rd->bad++ < 5)
                        fprintf(stderr, "record %llu: got seq %llu len %u type %u\n",
                                (unsigned long long)rd->next, (unsigned long long)seq, len, type);
        }
        rd->next = seq + 1;
        rd->last_pos = pos;
        return 0;
}

static void test_wrap_and_full(void)
{
        struct kvf_ctl c;
        make_segment(&c, 4096);
        struct kvf_ring *r = &c.rings[KVF_RING_ENGINE_TO_SENDER];
        kvf_ring_producer_attach(r, 1);
        struct reader rd = {0};
        uint8_t buf[128];
        uint64_t seq = 0, pads_before = 0;

        /* Many laps of the 4 KiB ring with odd sizes: padding at every wrap. */
        for (int lap = 0; lap < 2000; lap++) {
                int wrote = 0;
                for (;;) {
                        stamp(buf, seq);
                        int rc = kvf_ring_write(r, 7, buf, stamp_len(seq), NULL);
                        if (rc == -EAGAIN)
                                break;
                        CHECK_EQ(rc, 0);
                        seq++;
                        wrote++;
                }
                CHECK(wrote > 0);
                /* Full: nothing was overwritten, everything reads back in order. */
                CHECK(kvf_ring_used(r->hdr) > 4096 - 136);
                int n = kvf_ring_read(r, check_stamped, &rd, 1000);
                CHECK_EQ(n, wrote);
                CHECK_EQ(kvf_ring_used(r->hdr), 0);
        }
        CHECK_EQ(rd.bad, 0);
        CHECK_EQ(rd.next, seq);
        CHECK(r->hdr->full_events >= 2000);
        (void)pads_before;
        /* Consumed bytes are zeroed. */
        for (uint64_t i = 0; i < r->capacity; i++)
                CHECK_EQ(r->data[i], 0);
        kvf_ctl_detach(&c);
        cleanup();
}

static int count_len(void *arg, uint16_t type, const uint8_t *p, uint32_t len, uint64_t pos)
{
        (void)type, (void)p, (void)pos;
        ((int64_t *)arg)[0]++;
        ((int64_t *)arg)[1] = len;
        return 0;
}

static void test_sizes(void)
{
        struct kvf_ctl c;
        make_segment(&c, 4096);
        struct kvf_ring *r = &c.rings[KVF_RING_SENDER_TO_ENGINE];
        kvf_ring_producer_attach(r, 1);
        static uint8_t big[8192];
        int64_t got[2] = {0, 0};

        /* Larger than the ring: refused for good, not "full". */
        CHECK_EQ(kvf_ring_write(r, 1, big, 4096, NULL), -EMSGSIZE);
        CHECK_EQ(kvf_ring_write(r, 1, big, 8000, NULL), -EMSGSIZE);
        /* Empty record: a header with no payload. */
        CHECK_EQ(kvf_ring_write(r, 1, NULL, 0, NULL), 0);
        CHECK_EQ(kvf_ring_read(r, count_len, got, 10), 1);
        CHECK_EQ(got[0], 1);
        CHECK_EQ(got[1], 0);
        /* A record that fills the whole ring, written at a position that forces padding. */
        CHECK_EQ(kvf_ring_write(r, 1, big, 100, NULL), 0);
        CHECK_EQ(kvf_ring_read(r, count_len, got, 10), 1);
        /* The padding to the end goes in at once; the record waits until
         * the consumer has passed the padding, then takes the whole ring. */
        CHECK_EQ(kvf_ring_write(r, 1, big, 4096 - 8, NULL), -EAGAIN);
        CHECK_EQ(kvf_ring_read(r, count_len, got, 10), 0);
        CHECK_EQ(kvf_ring_write(r, 1, big, 4096 - 8, NULL), 0);
        CHECK_EQ(kvf_ring_read(r, count_len, got, 10), 1);
        CHECK_EQ(got[1], 4096 - 8);
        /* The padding type is reserved. */
        CHECK_EQ(kvf_ring_write(r, KVF_REC_TYPE_PAD, big, 8, NULL), -EMSGSIZE);
        kvf_ctl_detach(&c);
        cleanup();
}

static bool readable(void *arg)
{
        return kvf_ring_readable(arg);
}

static void test_two_processes(uint64_t total)
{
        struct kvf_ctl c;
        make_segment(&c, 1 << 16);
        struct kvf_ring *r = &c.rings[KVF_RING_ENGINE_TO_SENDER];
        uint64_t t0 = kvf_now_ns();

        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
                prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a failed test */
                kvf_ring_producer_attach(r, 1);
                uint8_t buf[128];
                for (uint64_t seq = 0; seq < total;) {
                        void *p;
                        uint64_t pos;
                        int rc = kvf_ring_claim(r, 7, stamp_len(seq), &p, &pos);
                        if (rc == -EAGAIN) {
                                kvf_cpu_relax();
                                continue;
                        }
                        if (rc != 0)
                                _exit(3);
                        stamp(buf, seq);
                        memcpy(p, buf, stamp_len(seq));
                        kvf_ring_commit(r, pos);
                        seq++;
                }
                _exit(0);
        }
        struct reader rd = {0};
        while (rd.next < total) {
                int n = kvf_ring_read(r, check_stamped, &rd, 256);
                CHECK(n >= 0);
                if (n == 0)
                        kvf_doorbell_wait(r->bell, readable, r, 256, 100000000ull);
        }
        int st;
        CHECK(waitpid(pid, &st, 0) == pid);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        CHECK_EQ(rd.bad, 0);
        CHECK_EQ(rd.next, total);
        CHECK_EQ(kvf_ring_used(r->hdr), 0);
        fprintf(stderr, "two processes: %llu records in %.2f s, none lost, duplicated or reordered\n",
                (unsigned long long)total, (double)(kvf_now_ns() - t0) / 1e9);
        kvf_ctl_detach(&c);
        cleanup();
}

static int collect(void *arg, uint16_t type, const uint8_t *p, uint32_t len, uint64_t pos)
{
        uint64_t *seqs = arg;
        uint64_t s;
        (void)type, (void)len, (void)pos;
        memcpy(&s, p, 8);
        seqs[++seqs[0]] = s;
        return 0;
}

static void test_abandoned_claim(void)
{
        struct kvf_ctl c;
        make_segment(&c, 4096);
        struct kvf_ring *r = &c.rings[KVF_RING_ENGINE_TO_SENDER];
        uint64_t seqs[64] = {0};
        uint64_t committed_pos = 0, claimed_pos = 0;
        int fds[2];
        CHECK(pipe(fds) == 0);

        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
                /* Generation 1 writes two records, claims a third and dies. */
                kvf_ring_producer_attach(r, 1);
                uint64_t s = 1, pos[3];
                void *p;
                kvf_ring_write(r, 7, &s, 8, &pos[0]);
                s = 2;
                kvf_ring_write(r, 7, &s, 8, &pos[1]);
                kvf_ring_claim(r, 7, 8, &p, &pos[2]);
                memcpy(p, &(uint64_t){99}, 8);
                if (write(fds[1], pos, sizeof(pos)) != sizeof(pos))
                        _exit(2);
                raise(SIGKILL);
        }
        int st;
        uint64_t pos[3];
        CHECK(read(fds[0], pos, sizeof(pos)) == sizeof(pos));
        CHECK(waitpid(pid, &st, 0) == pid && WIFSIGNALED(st));
        committed_pos = pos[1];
        claimed_pos = pos[2];

        /* The consumer reads the two committed records and stops at the claim. */
        CHECK_EQ(kvf_ring_read(r, collect, seqs, 10), 2);
        CHECK(!kvf_ring_readable(r));
        CHECK_EQ(kvf_ring_read(r, collect, seqs, 10), 0);

        /* Generation 2 attaches: the claim is now known abandoned. */
        kvf_ring_producer_attach(r, 2);
        CHECK_EQ(kvf_ring_delivered(r, claimed_pos), 0);
        CHECK_EQ(kvf_ring_delivered(r, committed_pos), 1);
        CHECK(kvf_ring_readable(r));
        uint64_t s = 3, p3;
        CHECK_EQ(kvf_ring_write(r, 7, &s, 8, &p3), 0);
        CHECK_EQ(kvf_ring_delivered(r, p3), 1);
        CHECK_EQ(kvf_ring_read(r, collect, seqs, 10), 1);
        CHECK_EQ(seqs[0], 3);
        CHECK_EQ(seqs[1], 1);
        CHECK_EQ(seqs[2], 2);
        CHECK_EQ(seqs[3], 3);
        CHECK_EQ(r->hdr->abandoned, 1);
        CHECK_EQ(r->hdr->abandoned_pos, claimed_pos);
        /* After consumption the answers stay the same. */
        CHECK_EQ(kvf_ring_delivered(r, claimed_pos), 0);
        CHECK_EQ(kvf_ring_delivered(r, committed_pos), 1);
        CHECK_EQ(kvf_ring_delivered(r, p3), 1);
        CHECK_EQ(kvf_ring_delivered(r, p3 + 16), 0);
        close(fds[0]);
        close(fds[1]);
        kvf_ctl_detach(&c);
        cleanup();
}

static void test_consumer_repair(void)
{
        struct kvf_ctl c;
        make_segment(&c, 4096);
        struct kvf_ring *r = &c.rings[KVF_RING_ENGINE_TO_SENDER];
        uint64_t seqs[64] = {0}, pos[3];

        kvf_ring_producer_attach(r, 1);
        for (uint64_t s = 1; s <= 3; s++)
                CHECK_EQ(kvf_ring_write(r, 7, &s, 8, &pos[s - 1]), 0);
        /* A consumer handled records 1 and 2, said so, zeroed record 1 and died. */
        r->hdr->zeroing_to = pos[2];
        memset(r->data + (pos[0] & r->mask), 0, 16);
        CHECK(!kvf_ring_readable(r)); /* it looks empty: the wedge the repair prevents */
        CHECK_EQ(kvf_ring_consumer_attach(r), 1);
        CHECK_EQ(r->hdr->head, pos[2]);
        CHECK_EQ(kvf_ring_read(r, collect, seqs, 10), 1);
        CHECK_EQ(seqs[1], 3);
        CHECK_EQ(kvf_ring_consumer_attach(r), 0);
        kvf_ctl_detach(&c);
        cleanup();
}

/* A record header that cannot be right (another process wrote over the ring): reported once,
 * then the ring reads as empty while it is there, so a consumer waits instead of spinning. */
static void test_corrupt_header(void)
{
        struct kvf_ctl c;
        make_segment(&c, 4096);
        struct kvf_ring *r = &c.rings[KVF_RING_ENGINE_TO_SENDER];
        uint64_t seqs[64] = {0}, pos;

        kvf_ring_producer_attach(r, 1);
        uint64_t one = 1;
        CHECK_EQ(kvf_ring_write(r, 7, &one, 8, &pos), 0);
        /* The next record's header says it is longer than the ring. */
        uint64_t *w = (uint64_t *)(void *)(r->data + ((pos + 16) & r->mask));
        *w = (uint64_t)7 << 32 | 100000u;
        CHECK(kvf_ring_readable(r));
        CHECK_EQ(kvf_ring_read(r, collect, seqs, 10), -EBADMSG);
        CHECK(strstr(kvf_err_msg(), "corrupt record header") != NULL);
        CHECK_EQ(seqs[0], 1); /* the good record before it was handed over */
        CHECK(!kvf_ring_readable(r));
        CHECK_EQ(kvf_ring_read(r, collect, seqs, 10), 0);
        CHECK(!kvf_ring_readable(r));
        kvf_ctl_detach(&c);
        cleanup();
}

static void test_timeout(void)
{
        struct kvf_ctl c;
        make_segment(&c, 4096);
        struct kvf_doorbell *b = &c.bells[KVF_BELL_SENDER];
        uint64_t t0 = kvf_now_ns();
        uint32_t seq = kvf_doorbell_prepare(b);
        CHECK_EQ(kvf_doorbell_sleep(b, seq, 50000000ull), -ETIMEDOUT);
        uint64_t dt = kvf_now_ns() - t0;
        CHECK(dt >= 45000000ull && dt < 2000000000ull);
        CHECK_EQ(kvf_doorbell_waiters(b->state), 0);
        /* A ring with no waiter does not touch the futex. */
        kvf_doorbell_ring(b);
        CHECK_EQ(b->wakes, 0);
        kvf_ctl_detach(&c);
        cleanup();
}

/*
 * A producer's expectation (kvf_doorbell_expect): a consumer about to sleep
 * polls instead while it stands, and sees the record without a sleep (wait
 * returns 2); a withdrawn or past expectation leaves the sleep as it was; one
 * set far ahead holds the consumer at most KVF_DOORBELL_EXPECT_MAX_NS.
 */
struct late_writer {
        struct kvf_ring *r;
        uint64_t after_ns;
};

static void *write_late(void *arg)
{
        struct late_writer *w = arg;
        kvf_sleep_ns(w->after_ns);
        uint64_t v = 42;
        CHECK_EQ(kvf_ring_write(w->r, 1, &v, sizeof(v), NULL), 0);
        return NULL;
}

static void test_doorbell_expect(void)
{
        struct kvf_ctl c;
        make_segment(&c, 4096);
        struct kvf_ring *r = &c.rings[KVF_RING_SENDER_TO_CONNECTOR];
        struct kvf_doorbell *b = r->bell;
        uint64_t seqs[4];

        /* Expected, written 100 us later: found by polling, no sleep. The poll lasts at most
         * the cap (1 ms) from the wait, and a loaded machine may start the writer later than
         * that: then the record wakes the sleep as usual. One of 20 tries must poll it. */
        uint64_t sleeps = 0;
        int polled = 0;
        for (int i = 0; i < 20 && !polled; i++) {
                sleeps = b->sleeps;
                kvf_doorbell_expect(b, kvf_now_ns() + 200000000ull);
                struct late_writer w = {r, 100000};
                pthread_t th;
                CHECK_EQ(pthread_create(&th, NULL, write_late, &w), 0);
                int rc = kvf_doorbell_wait(b, readable, r, 0, 5000000000ull);
                CHECK_EQ(pthread_join(th, NULL), 0);
                seqs[0] = 0;
                CHECK_EQ(kvf_ring_read(r, collect, seqs, 4), 1);
                CHECK_EQ(seqs[1], 42);
                if (rc == 2) {
                        CHECK_EQ(b->sleeps, sleeps);
                        polled = 1;
                }
        }
        CHECK(polled);
        sleeps = b->sleeps;

        /* Withdrawn, and in the past: the consumer sleeps its timeout. */
        kvf_doorbell_expect(b, kvf_now_ns() + 1000000000ull);
        kvf_doorbell_expect(b, 0);
        uint64_t t0 = kvf_now_ns();
        CHECK_EQ(kvf_doorbell_wait(b, readable, r, 0, 20000000ull), 0);
        CHECK(kvf_now_ns() - t0 >= 15000000ull);
        CHECK_EQ(b->sleeps, sleeps + 1);
        kvf_doorbell_expect(b, kvf_now_ns() - 1);
        CHECK_EQ(kvf_doorbell_wait(b, readable, r, 0, 20000000ull), 0);
        CHECK_EQ(b->sleeps, sleeps + 2);

        /* A word far in the future (a producer gone wrong): polled for at most the cap,
         * then the usual sleep. */
        kvf_doorbell_expect(b, UINT64_MAX - 1);
        t0 = kvf_now_ns();
        CHECK_EQ(kvf_doorbell_wait(b, readable, r, 0, 1000000ull), 0);
        uint64_t dt = kvf_now_ns() - t0;
        CHECK(dt >= KVF_DOORBELL_EXPECT_MAX_NS);
        CHECK(dt < 1000000000ull);
        CHECK_EQ(b->sleeps, sleeps + 3);
        kvf_doorbell_expect(b, 0);
        kvf_ctl_detach(&c);
        cleanup();
}

/*
 * The announcement count in the doorbell word: a wake withdraws every
 * announcement it answers, a cancel withdraws only its own and only if no
 * wake came in between, and a count left behind (a consumer woken by a wake
 * that came before its arming keeps its count) costs one spare wake, then
 * is gone.
 */
static void test_doorbell_count(void)
{
        struct kvf_ctl c;
        make_segment(&c, 4096);
        struct kvf_doorbell *b = &c.bells[KVF_BELL_SENDER];

        uint32_t s1 = kvf_doorbell_prepare(b);
        uint32_t s2 = kvf_doorbell_prepare(b);
        CHECK_EQ(s1, s2);
        CHECK_EQ(s1 & 1u, 1u); /* armed */
        CHECK_EQ(kvf_doorbell_waiters(b->state), 2);
        kvf_doorbell_cancel(b, s2);
        CHECK_EQ(kvf_doorbell_waiters(b->state), 1);
        /* The wake answers the one left and clears the count. */
        kvf_doorbell_ring(b);
        CHECK_EQ(b->wakes, 1);
        CHECK_EQ(kvf_doorbell_waiters(b->state), 0);
        CHECK_EQ(kvf_doorbell_seq(b->state), s1 + 1);
        /* A late cancel of an answered announcement takes nothing away. */
        kvf_doorbell_cancel(b, s1);
        CHECK_EQ(kvf_doorbell_waiters(b->state), 0);
        /* Nobody announced: no wake. */
        kvf_doorbell_ring(b);
        CHECK_EQ(b->wakes, 1);
        /* A count left behind: one spare wake clears it. */
        uint32_t s3 = kvf_doorbell_prepare(b);
        CHECK(s3 != s1);
        kvf_doorbell_ring(b);
        kvf_doorbell_ring(b);
        CHECK_EQ(b->wakes, 2);
        CHECK_EQ(kvf_doorbell_waiters(b->state), 0);
        /* A sleep on a moved word returns at once and leaves no count. */
        CHECK_EQ(kvf_doorbell_sleep(b, s3, 5000000000ull), 0);
        CHECK_EQ(kvf_doorbell_waiters(b->state), 0);
        kvf_ctl_detach(&c);
        cleanup();
}

/*
 * Ping-pong where each side always goes to sleep: a lost wake-up would show
 * as a sleep that ran into its (long) timeout.
 */
static void test_no_lost_wakeups(unsigned rounds)
{
        struct kvf_ctl c;
        make_segment(&c, 1 << 16);
        struct kvf_ring *ping = &c.rings[KVF_RING_ENGINE_TO_SENDER];   /* bell: sender */
        struct kvf_ring *pong = &c.rings[KVF_RING_SENDER_TO_ENGINE];   /* bell: engine */
        uint64_t t0 = kvf_now_ns();

        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
                prctl(PR_SET_PDEATHSIG, SIGKILL);
                kvf_ring_producer_attach(pong, 1);
                uint64_t seqs[4];
                unsigned timeouts = 0;
                for (unsigned i = 0; i < rounds; i++) {
                        for (;;) {
                                seqs[0] = 0;
                                if (kvf_ring_read(ping, collect, seqs, 1) == 1)
                                        break;
                                uint32_t s = kvf_doorbell_prepare(ping->bell);
                                if (kvf_ring_readable(ping)) {
                                        kvf_doorbell_cancel(ping->bell, s);
                                        continue;
                                }
                                if (kvf_doorbell_sleep(ping->bell, s, 5000000000ull) == -ETIMEDOUT)
                                        timeouts++;
                        }
                        uint64_t v = seqs[1];
                        while (kvf_ring_write(pong, 7, &v, 8, NULL) == -EAGAIN) {
                        }
                }
                _exit(timeouts == 0 ? 0 : 4);
        }
        kvf_ring_producer_attach(ping, 1);
        unsigned timeouts = 0;
        for (unsigned i = 0; i < rounds; i++) {
                uint64_t v = i, seqs[4];
                CHECK_EQ(kvf_ring_write(ping, 7, &v, 8, NULL), 0);
                for (;;) {
                        seqs[0] = 0;
                        if (kvf_ring_read(pong, collect, seqs, 1) == 1)
                                break;
                        uint32_t s = kvf_doorbell_prepare(pong->bell);
                        if (kvf_ring_readable(pong)) {
                                kvf_doorbell_cancel(pong->bell, s);
                                continue;
                        }
                        if (kvf_doorbell_sleep(pong->bell, s, 5000000000ull) == -ETIMEDOUT)
                                timeouts++;
                }
                CHECK_EQ(seqs[1], i);
        }
        int st;
        CHECK(waitpid(pid, &st, 0) == pid);
        CHECK(WIFEXITED(st));
        CHECK_EQ(WEXITSTATUS(st), 0);
        CHECK_EQ(timeouts, 0);
        fprintf(stderr, "doorbell: %u sleeping round trips in %.2f s, no wake-up lost (%llu + %llu futex wakes)\n",
                rounds, (double)(kvf_now_ns() - t0) / 1e9,
                (unsigned long long)c.bells[KVF_BELL_SENDER].wakes,
                (unsigned long long)c.bells[KVF_BELL_ENGINE].wakes);
        CHECK(c.bells[KVF_BELL_SENDER].wakes > 0);
        kvf_ctl_detach(&c);
        cleanup();
}

int main(int argc, char **argv)
{
        uint64_t total = argc > 1 ? strtoull(argv[1], NULL, 10) : 10000000ull;
        snprintf(inst, sizeof(inst), "t-ring-%d", (int)getpid());
        atexit(cleanup);
        test_sizes();
        test_wrap_and_full();
        test_abandoned_claim();
        test_consumer_repair();
        test_corrupt_header();
        test_timeout();
        test_doorbell_count();
        test_doorbell_expect();
        test_no_lost_wakeups(20000);
        test_two_processes(total);
        fprintf(stderr, "ring_test: all passed\n");
        return 0;
}
