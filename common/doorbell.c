#include "doorbell.h"

#include <errno.h>
#include <linux/futex.h>
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "atomics.h"

/*
 * At most one FUTEX_WAKE per sleep.
 *
 * `waiters` stays non-zero from a consumer's prepare() until it has woken,
 * been scheduled and cancelled; on a busy host that takes milliseconds, and a
 * producer committing records one by one would make a wake call (about a
 * microsecond, shared futex key) for each (kvf-bench-ring measured 314 wakes
 * per 1000 records for 0.17 sleeps). So the low bit of seq, ARMED, means "a
 * consumer has prepared to sleep on this value and nobody has moved it
 * since". prepare() sets it before announcing itself and sleeps on the armed
 * value. ring() fences and loads `waiters` first; then it bumps seq only if
 * it finds the bit set, and the bump, odd + 1, clears it. Finding waiters !=
 * 0 with the bit clear means a bump has happened since every announced
 * consumer armed: those consumers cannot block on their value (FUTEX_WAIT
 * checks it) or were woken by that bump's FUTEX_WAKE, and the caller of
 * kvf_doorbell_wait() re-checks its rings before sleeping again.
 *
 * Why no wake is lost: let F_p be the producer's fence, F_c the consumer's
 * fence in prepare(), in the single total order of seq_cst fences. F_p first:
 * the consumer's re-check sees the record. F_c first: the producer's loads of
 * `waiters` and `seq` see the consumer's increment and arming or later
 * values; a later value of seq means a bump after the arming, so that sleep
 * ends and the consumer's next prepare() is a new round, whose fence comes
 * after F_p and whose re-check therefore sees the record.
 *
 * Dense traffic (doorbell.h): a producer thread that keeps finding no waiter
 * rings with a compiler barrier only, counted in bell->unfenced; a consumer
 * about to sleep while that count is non-zero runs membarrier(2), which
 * fences every registered process's CPU, standing in for the fences those
 * producers skip. Entering dense mode: unfenced += 1; fence; load waiters.
 * Against the consumer's waiters += 1; fence; load unfenced, one of the two
 * sees the other: either the consumer runs membarrier (covering every later
 * unfenced ring), or the producer sees the waiter and wakes it (its next
 * sleep then sees the count). The first ring that finds a waiter leaves dense
 * mode: traffic has become sparse, and sparse traffic keeps the plain pair,
 * whose wake-up is cheaper than one that also pays for IPIs.
 */
#define ARMED 1u
#define DENSE_AFTER 64u  /* rings in a row without a waiter */
#define PRODUCER_SLOTS 8u

static long futex(uint32_t *uaddr, int op, uint32_t val, const struct timespec *ts)
{
        return syscall(SYS_futex, uaddr, op, val, ts, NULL, 0);
}

static int membarrier(int cmd)
{
        return (int)syscall(SYS_membarrier, cmd, 0, 0);
}

bool kvf_doorbell_asymmetric_supported(void)
{
        int m = membarrier(MEMBARRIER_CMD_QUERY);
        return m >= 0 && (m & MEMBARRIER_CMD_GLOBAL_EXPEDITED) &&
               (m & MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED);
}

static int registered; /* this process: 0 not tried, 1 registered, -1 cannot */

/* Per producer thread and bell. */
static _Thread_local struct {
        struct kvf_doorbell *bell;
        uint32_t streak;
        bool dense;
} mine[PRODUCER_SLOTS];

/* Set by prepare() when its membarrier failed: that sleep is kept short. */
static _Thread_local bool short_sleep;

static unsigned slot_of(struct kvf_doorbell *bell)
{
        unsigned free_slot = PRODUCER_SLOTS;
        for (unsigned i = 0; i < PRODUCER_SLOTS; i++) {
                if (mine[i].bell == bell)
                        return i;
                if (!mine[i].bell && free_slot == PRODUCER_SLOTS)
                        free_slot = i;
        }
        if (free_slot < PRODUCER_SLOTS)
                mine[free_slot].bell = bell;
        return free_slot; /* PRODUCER_SLOTS: too many bells on one thread, always fence */
}

/* Count a ring that found no waiter; maybe enter dense mode. Returns true if a waiter appeared. */
static bool no_waiter(struct kvf_doorbell *bell, unsigned me)
{
        if (me == PRODUCER_SLOTS || ++mine[me].streak < DENSE_AFTER)
                return false;
        if (registered == 0)
                registered = membarrier(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED) == 0 ? 1 : -1;
        if (registered != 1) {
                mine[me].streak = 0;
                return false;
        }
        kvf_fetch_add_acq_rel(&bell->unfenced, 1);
        mine[me].dense = true;
        /* Entering: the count is ordered before our look for waiters (see above). */
        kvf_fence_seq_cst();
        return kvf_load_relaxed(&bell->waiters) != 0;
}

void kvf_doorbell_ring(struct kvf_doorbell *bell)
{
        unsigned me = bell->asymmetric ? slot_of(bell) : PRODUCER_SLOTS;

        if (me < PRODUCER_SLOTS && mine[me].dense) {
                /* A consumer that announced itself has run membarrier: a full
                 * fence on our CPU between our commit and this load. */
                __atomic_signal_fence(__ATOMIC_SEQ_CST);
                if (kvf_load_relaxed(&bell->waiters) == 0)
                        return;
                mine[me].dense = false; /* it sleeps: traffic is sparse again */
                mine[me].streak = 0;
                kvf_fetch_sub_acq_rel(&bell->unfenced, 1);
        }
        /* Pairs with the fence in kvf_doorbell_prepare(): our record's commit
         * (a release store before this call) is ordered before the loads of
         * `waiters` and `seq`. */
        kvf_fence_seq_cst();
        if (kvf_load_relaxed(&bell->waiters) == 0) {
                if (!no_waiter(bell, me))
                        return;
        } else if (me < PRODUCER_SLOTS) {
                mine[me].streak = 0;
        }
        uint32_t seq = kvf_load_relaxed(&bell->seq);
        do {
                if (!(seq & ARMED))
                        return; /* moved since every announced consumer armed: see above */
                /* Release: a consumer that sees the new seq also sees the
                 * commit. Odd + 1: moves the word and disarms it in one step,
                 * so of several producers exactly one makes the call. */
        } while (!kvf_cas_acq_rel(&bell->seq, &seq, seq + 1));
        futex(&bell->seq, FUTEX_WAKE, 0x7fffffff, NULL);
        /* Statistics: a plain increment, after the wake and without a locked
         * instruction; concurrent producers may lose a count. */
        kvf_store_relaxed(&bell->wakes, kvf_load_relaxed(&bell->wakes) + 1);
}

uint32_t kvf_doorbell_prepare(struct kvf_doorbell *bell)
{
        uint32_t seq = kvf_load_relaxed(&bell->seq);

        /* Arm before announcing: a producer that sees the announcement sees
         * the arming too (both before the fence below). No write when armed
         * already (a timed-out sleep, or another consumer thread). */
        while (!(seq & ARMED) && !kvf_cas_acq_rel(&bell->seq, &seq, seq | ARMED)) {
        }
        kvf_fetch_add_relaxed(&bell->waiters, 1);
        /* Pairs with the fence in kvf_doorbell_ring(): the arming and the
         * announcement are ordered before the producer's loads of them, or
         * the caller's re-check of the ring is ordered after its commit. This
         * fence after the load of seq also acquires: a consumer that sees a
         * moved seq sees the commit that moved it. */
        kvf_fence_seq_cst();
        /* Producers in dense mode skip their fence: run it on their CPUs. If
         * that fails a wake may be missed, so sleep short. */
        short_sleep = kvf_load_relaxed(&bell->unfenced) > 0 &&
                      membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED) != 0;
        return seq | ARMED;
}

void kvf_doorbell_cancel(struct kvf_doorbell *bell)
{
        kvf_fetch_sub_acq_rel(&bell->waiters, 1);
}

int kvf_doorbell_sleep(struct kvf_doorbell *bell, uint32_t seq, uint64_t timeout_ns)
{
        if (short_sleep && timeout_ns > 1000000)
                timeout_ns = 1000000;
        struct timespec ts = {.tv_sec = (time_t)(timeout_ns / 1000000000ull),
                              .tv_nsec = (long)(timeout_ns % 1000000000ull)};
        int rc = 0;

        /* FUTEX_WAIT returns at once (EAGAIN) if seq already moved: the wake
         * raced ahead of us and is not lost. */
        if (futex(&bell->seq, FUTEX_WAIT, seq, &ts) != 0 && errno == ETIMEDOUT)
                rc = -ETIMEDOUT;
        kvf_store_relaxed(&bell->sleeps, kvf_load_relaxed(&bell->sleeps) + 1); /* statistics */
        kvf_doorbell_cancel(bell);
        return rc;
}

int kvf_doorbell_wait(struct kvf_doorbell *bell, bool (*has_work)(void *ctx), void *ctx,
                      unsigned spins, uint64_t timeout_ns)
{
        for (unsigned i = 0; i < spins; i++) {
                if (has_work(ctx))
                        return 1;
                kvf_cpu_relax();
        }
        uint32_t seq = kvf_doorbell_prepare(bell);
        if (has_work(ctx)) {
                kvf_doorbell_cancel(bell);
                return 1;
        }
        kvf_doorbell_sleep(bell, seq, timeout_ns);
        return 0;
}
