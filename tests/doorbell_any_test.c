/*
 * kvf_doorbell_wait_any (common/doorbell.c): one consumer asleep on the three doorbells of a
 * real control segment at once, a producer in another process. Each round the producer posts
 * work for one bell (in turn), after a pause long enough that the consumer is asleep, and rings
 * that bell only; the consumer must wake within BOUND_NS (its sleep's timeout is 5 s: a ring the
 * sleep did not hear would run into it), in a few waits a round (a sleep that returned at once
 * would spin), and leave no announcement on any bell. Also: the
 * timeout with nothing rung, work already there (no sleep), and n out of range.
 *
 * Skipped (77) where the kernel or a seccomp filter refuses futex_waitv (Linux < 5.16): the
 * callers then sleep on one bell at a time, which the other tests cover.
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

#define ROUNDS 60
#define PAUSE_NS 3000000ull    /* before each post: the consumer is asleep by then */
#define SLEEP_NS 5000000000ull /* the consumer's timeout: a lost wake-up runs into it */
#define BOUND_NS 1000000000ull /* post to wake at most; a wake takes microseconds */

static char inst[64];

static void cleanup(void)
{
        kvf_ctl_unlink(inst);
}

/* Between the two processes, outside the segment. */
struct shared {
        uint32_t work[KVF_BELL_COUNT]; /* posted, not yet taken */
        uint64_t post_ns;              /* when the last was posted */
        uint32_t taken;                /* rounds the consumer has finished */
};

static bool any_work(void *arg)
{
        struct shared *sh = arg;
        for (unsigned i = 0; i < KVF_BELL_COUNT; i++)
                if (kvf_load_acquire(&sh->work[i]))
                        return true;
        return false;
}

static void no_waiters(struct kvf_doorbell *const *bells, const char *when)
{
        for (unsigned i = 0; i < KVF_BELL_COUNT; i++) {
                uint32_t w = kvf_doorbell_waiters(kvf_load_relaxed(&bells[i]->state));
                if (w) {
                        fprintf(stderr, "%s: bell %u still counts %u waiter(s)\n", when, i, w);
                        exit(1);
                }
        }
}

static int producer(struct kvf_doorbell *const *bells, struct shared *sh)
{
        for (uint32_t round = 0; round < ROUNDS; round++) {
                while (kvf_load_acquire(&sh->taken) < round)
                        kvf_sleep_ns(50000);
                kvf_sleep_ns(PAUSE_NS);
                unsigned b = round % KVF_BELL_COUNT;
                kvf_store_relaxed(&sh->post_ns, kvf_now_ns());
                kvf_store_release(&sh->work[b], 1);
                kvf_doorbell_ring(bells[b]);
        }
        return 0;
}

int main(void)
{
        struct kvf_ctl c;
        struct kvf_ctl_params p = {.instance = inst,
                                   .instance_role = KVF_IROLE_MIXED,
                                   .backend = KVF_BACKEND_HOST,
                                   .reqtab_slots = 4,
                                   .max_blocks = 16};

        snprintf(inst, sizeof(inst), "t-bellany-%d", (int)getpid());
        atexit(cleanup);
        for (int i = 0; i < KVF_RING_COUNT; i++)
                p.ring_capacity[i] = 1 << 12;
        kvf_ctl_unlink(inst);
        CHECK(kvf_ctl_create(&p, &c) == 0);
        kvf_ctl_publish(&c);
        struct kvf_doorbell *bells[KVF_BELL_COUNT];
        for (unsigned i = 0; i < KVF_BELL_COUNT; i++)
                bells[i] = &c.bells[i];
        struct shared *sh =
            mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        CHECK(sh != MAP_FAILED);

        /* n out of range */
        CHECK_EQ(kvf_doorbell_wait_any(bells, 0, any_work, sh, 0, 1000), -EINVAL);
        CHECK_EQ(kvf_doorbell_wait_any(bells, KVF_DOORBELL_ANY_MAX + 1, any_work, sh, 0, 1000), -EINVAL);

        /* Nothing rings: the timeout, and every announcement withdrawn. */
        uint64_t t0 = kvf_now_ns();
        int rc = kvf_doorbell_wait_any(bells, KVF_BELL_COUNT, any_work, sh, 0, 30000000ull);
        if (rc == -ENOSYS)
                SKIP("futex_waitv is not available here (Linux 5.16 or later, no seccomp filter "
                     "refusing it)");
        CHECK_EQ(rc, 0);
        CHECK(kvf_now_ns() - t0 >= 25000000ull);
        no_waiters(bells, "after a timeout");

        /* Work already posted: found before any sleep. */
        kvf_store_release(&sh->work[1], 1);
        CHECK_EQ(kvf_doorbell_wait_any(bells, KVF_BELL_COUNT, any_work, sh, 0, SLEEP_NS), 1);
        kvf_store_relaxed(&sh->work[1], 0);
        no_waiters(bells, "with work posted");

        pid_t child = fork();
        CHECK(child >= 0);
        if (child == 0) {
                prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a failed test */
                _exit(producer(bells, sh));
        }
        uint64_t worst = 0, calls = 0, sleeps0 = kvf_load_relaxed(&bells[0]->sleeps);
        for (uint32_t round = 0; round < ROUNDS; round++) {
                unsigned b = round % KVF_BELL_COUNT;
                while (!kvf_load_acquire(&sh->work[b])) {
                        rc = kvf_doorbell_wait_any(bells, KVF_BELL_COUNT, any_work, sh, 0, SLEEP_NS);
                        CHECK(rc >= 0);
                        calls++;
                }
                uint64_t took = kvf_now_ns() - kvf_load_relaxed(&sh->post_ns);
                if (took > BOUND_NS) {
                        fprintf(stderr, "round %u: bell %u's ring woke the sleep %.1f ms after the post\n",
                                round, b, (double)took / 1e6);
                        return 1;
                }
                worst = took > worst ? took : worst;
                kvf_store_relaxed(&sh->work[b], 0);
                no_waiters(bells, "after a wake");
                kvf_store_release(&sh->taken, round + 1);
        }
        int st;
        CHECK(waitpid(child, &st, 0) == child);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        /* The consumer did sleep (the pause puts it to sleep before each post), and each sleep
         * lasted until a ring: a sleep that returns at once (a wrong word, a value that never
         * matches) would spin through thousands of calls a round. */
        uint64_t slept = kvf_load_relaxed(&bells[0]->sleeps) - sleeps0;
        fprintf(stderr, "%d rounds over %d bells: %llu waits, %llu sleeps, slowest post-to-wake %.1f us\n",
                ROUNDS, KVF_BELL_COUNT, (unsigned long long)calls, (unsigned long long)slept,
                (double)worst / 1e3);
        CHECK(slept >= ROUNDS / 2);
        CHECK(calls <= 4 * ROUNDS);
        kvf_ctl_detach(&c);
        fprintf(stderr, "doorbell_any_test: all passed\n");
        return 0;
}
