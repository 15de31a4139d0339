#include "doorbell.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <linux/futex.h>
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "atomics.h"
#include "clock.h"

/*
 * The state word. A doorbell's low 32 bits, seq, are the futex word; the
 * high 32 bits count the consumers announced as about to sleep. Both halves
 * change together, by CAS, so that a wake can withdraw the announcements it
 * answers: a woken consumer then writes nothing on the producers' line, and
 * the wake-up's critical path has no cross-core miss for bookkeeping
 * (kvf-bench-ring measured the old per-consumer withdrawal, a locked
 * decrement of a line the waking producer had just written).
 *
 * At most one FUTEX_WAKE per sleep. The low bit of seq, ARMED, means "a
 * consumer has prepared to sleep on this value and nobody has moved it
 * since". prepare() arms and announces in one CAS and sleeps on the armed
 * value. ring() fences and loads the word; it makes the call only if it finds
 * a waiter and the bit set, and its CAS moves seq (odd + 1: disarmed) and
 * clears the count in one step, so of several producers exactly one makes
 * the call. Without this, a producer committing records one by one while a
 * woken consumer has yet to run would make a wake call (about a microsecond,
 * shared futex key) for each (kvf-bench-ring measured 314 wakes per 1000
 * records for 0.17 sleeps).
 *
 * The count can only be too high, never too low, and only for a while: a
 * consumer woken by a FUTEX_WAKE whose bump happened before it armed (the
 * producer was preempted between its CAS and its call) leaves its count in
 * the word. The next ring() then bumps and calls once for nobody, which
 * clears it. A consumer that returns from FUTEX_WAIT any other way (timeout,
 * signal, seq already moved) or cancels withdraws its own count, and only if
 * seq is still the value it armed: a moved seq means a bump cleared it.
 *
 * Why no wake is lost: let F_p be the producer's fence, F_c the consumer's
 * fence in prepare(), in the single total order of seq_cst fences. F_p first:
 * the consumer's re-check sees the record. F_c first: the producer's load of
 * the word sees the consumer's announcement and arming or later values; a
 * later seq means a bump after the arming, which woke that sleep (or made
 * FUTEX_WAIT return at once), and the consumer's next prepare() is a new
 * round, whose fence comes after F_p and whose re-check therefore sees the
 * record.
 *
 * Dense traffic (doorbell.h): a producer thread that keeps finding no waiter
 * rings with a compiler barrier only, counted in bell->unfenced; a consumer
 * about to sleep while that count is non-zero runs membarrier(2), which
 * fences every registered process's CPU, standing in for the fences those
 * producers skip. Entering dense mode: unfenced += 1; fence; load the word.
 * Against the consumer's announce; fence; load unfenced, one of the two
 * sees the other: either the consumer runs membarrier (covering every later
 * unfenced ring), or the producer sees the waiter and wakes it (its next
 * sleep then sees the count). The first ring that finds a waiter leaves dense
 * mode: traffic has become sparse, and sparse traffic keeps the plain pair,
 * whose wake-up is cheaper than one that also pays for IPIs.
 */
#define ARMED 1u
#define WAITER (1ull << 32) /* one announced consumer, in the high half */
#define DENSE_AFTER 64u  /* rings in a row without a waiter */
#define PRODUCER_SLOTS 8u
#define SHORT_SLEEP_NS 1000000ull /* the bound on a sleep whose membarrier failed */

static long futex(uint32_t *uaddr, int op, uint32_t val, const struct timespec *ts)
{
        return syscall(SYS_futex, uaddr, op, val, ts, NULL, 0);
}

/* seq, the low half of state: where the futex word lies in memory. */
static uint32_t *futex_word(struct kvf_doorbell *bell)
{
        return (uint32_t *)(void *)&bell->state + (__BYTE_ORDER__ == __ORDER_BIG_ENDIAN__);
}

static bool has_waiter(const struct kvf_doorbell *bell)
{
        return kvf_doorbell_waiters(kvf_load_relaxed(&bell->state)) != 0;
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

/* this process: 0 not tried, 1 registered, -1 cannot. Atomic: every thread that rings a bell
 * may be the first to try (registering twice is harmless: the call is idempotent). */
static int registered;

/* Per producer thread and bell. */
static _Thread_local struct {
        struct kvf_doorbell *bell;
        uint32_t streak;
        bool dense;
} mine[PRODUCER_SLOTS];

/* KVF_AB_LAZY_MEMBARRIER=1 (an A/B switch of bench/gpu_tail_ab.sh and tail_ab.sh): register on
 * the ring that enters dense mode, as before kvf_doorbell_register existed. */
static bool ab_lazy;

__attribute__((constructor)) static void ab_switch(void)
{
        const char *v = getenv("KVF_AB_LAZY_MEMBARRIER");
        ab_lazy = v && !strcmp(v, "1");
}

/* A child of fork() registers anew (kvf_doorbell_register) before it goes dense: its own
 * process, whatever the kernel kept of the parent's registration; the thread that forked starts
 * the child fenced (the parent's count in each bell's `unfenced` is the parent's own). */
static void forget_registration(void)
{
        kvf_store_relaxed(&registered, 0);
        memset(mine, 0, sizeof(mine));
}

static void install_atfork(void)
{
        (void)pthread_atfork(NULL, NULL, forget_registration);
}

static int do_register(void)
{
        static pthread_once_t atfork = PTHREAD_ONCE_INIT;
        int reg = kvf_load_acquire(&registered); /* pairs with the release below */
        if (reg == 0) {
                reg = membarrier(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED) == 0 ? 1 : -1;
                kvf_store_release(&registered, reg); /* after the registration returned */
                if (reg == 1)
                        (void)pthread_once(&atfork, install_atfork);
        }
        return reg;
}

int kvf_doorbell_register(void)
{
        if (ab_lazy)
                return 0;
        return do_register() == 1 ? 0 : -ENOSYS;
}

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
        /* Registered at the process's start (kvf_doorbell_register), never here: in a process
         * of several threads the registration waits for a grace period (8.8 to 13.3 ms,
         * Linux 6.18, 2 CPUs: bench/dense_bench.c), and on a ring that is a record's consumer
         * waiting. */
        int reg = ab_lazy ? do_register() : kvf_load_acquire(&registered);
        if (reg != 1) {
                mine[me].streak = 0;
                return false;
        }
        kvf_fetch_add_acq_rel(&bell->unfenced, 1);
        mine[me].dense = true;
        /* Entering: the count is ordered before our look for waiters (see above). */
        kvf_fence_seq_cst();
        return has_waiter(bell);
}

void kvf_doorbell_ring(struct kvf_doorbell *bell)
{
        unsigned me = bell->asymmetric ? slot_of(bell) : PRODUCER_SLOTS;

        if (me < PRODUCER_SLOTS && mine[me].dense) {
                /* A consumer that announced itself has run membarrier: a full
                 * fence on our CPU between our commit and this load. */
                __atomic_signal_fence(__ATOMIC_SEQ_CST);
                if (!has_waiter(bell))
                        return;
                mine[me].dense = false; /* it sleeps: traffic is sparse again */
                mine[me].streak = 0;
                kvf_fetch_sub_acq_rel(&bell->unfenced, 1);
        }
        /* Pairs with the fence in kvf_doorbell_prepare(): our record's commit
         * (a release store before this call) is ordered before the load of
         * the word. */
        kvf_fence_seq_cst();
        uint64_t s = kvf_load_relaxed(&bell->state);
        if (kvf_doorbell_waiters(s) == 0) {
                if (!no_waiter(bell, me))
                        return;
                s = kvf_load_relaxed(&bell->state);
        } else if (me < PRODUCER_SLOTS) {
                mine[me].streak = 0;
        }
        do {
                if (!(s & ARMED))
                        return; /* moved since every announced consumer armed: see above */
                /* Release: a consumer that sees the new seq also sees the
                 * commit. Odd + 1 disarms; the high half, the count, goes to
                 * zero: this wake answers every announcement. */
        } while (!kvf_cas_acq_rel(&bell->state, &s, (uint64_t)(uint32_t)(s + 1)));
        futex(futex_word(bell), FUTEX_WAKE, 0x7fffffff, NULL);
        /* Statistics: a plain increment, after the wake and without a locked
         * instruction; concurrent producers may lose a count. */
        kvf_store_relaxed(&bell->wakes, kvf_load_relaxed(&bell->wakes) + 1);
}

uint32_t kvf_doorbell_prepare(struct kvf_doorbell *bell)
{
        uint64_t s = kvf_load_relaxed(&bell->state), n;

        /* Arm and announce in one step: a producer that sees the count sees
         * the arming too. */
        do {
                n = (s | ARMED) + WAITER;
        } while (!kvf_cas_acq_rel(&bell->state, &s, n));
        /* Pairs with the fence in kvf_doorbell_ring(): the announcement is
         * ordered before the producer's load of it, or the caller's re-check
         * of the ring is ordered after its commit. The CAS acquires: a
         * consumer that saw a moved seq sees the commit that moved it. */
        kvf_fence_seq_cst();
        /* Producers in dense mode skip their fence: run it on their CPUs. If
         * that fails a wake may be missed, so sleep short. */
        short_sleep = kvf_load_relaxed(&bell->unfenced) > 0 &&
                      membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED) != 0;
        return (uint32_t)n;
}

void kvf_doorbell_cancel(struct kvf_doorbell *bell, uint32_t seq)
{
        uint64_t s = kvf_load_relaxed(&bell->state);

        /* Ours is still counted only if nobody has bumped seq since we armed. */
        while ((uint32_t)s == seq && kvf_doorbell_waiters(s) != 0 &&
               !kvf_cas_acq_rel(&bell->state, &s, s - WAITER)) {
        }
}

static int sleep_on(struct kvf_doorbell *bell, uint32_t seq, const struct timespec *ts)
{
        /* FUTEX_WAIT returns at once (EAGAIN) if seq already moved: the wake
         * raced ahead of us and is not lost. */
        long rc = futex(futex_word(bell), FUTEX_WAIT, seq, ts);
        int err = rc == 0 ? 0 : errno;
        /* Statistics, on the consumers' own line. */
        kvf_store_relaxed(&bell->sleeps, kvf_load_relaxed(&bell->sleeps) + 1);
        if (err == 0)
                return 0; /* woken: the waker's bump withdrew us */
        kvf_doorbell_cancel(bell, seq);
        return err == ETIMEDOUT ? -ETIMEDOUT : 0;
}

int kvf_doorbell_sleep(struct kvf_doorbell *bell, uint32_t seq, uint64_t timeout_ns)
{
        if (short_sleep && timeout_ns > SHORT_SLEEP_NS)
                timeout_ns = SHORT_SLEEP_NS;
        struct timespec ts = {.tv_sec = (time_t)(timeout_ns / 1000000000ull),
                              .tv_nsec = (long)(timeout_ns % 1000000000ull)};
        return sleep_on(bell, seq, &ts);
}

int kvf_doorbell_sleep_untimed(struct kvf_doorbell *bell, uint32_t seq)
{
        return sleep_on(bell, seq, short_sleep ? &(struct timespec){.tv_nsec = SHORT_SLEEP_NS} : NULL);
}

void kvf_doorbell_expect(struct kvf_doorbell *bell, uint64_t until_ns)
{
        /* Release: a consumer that sees the withdrawal (0) sees the records
         * committed before it. */
        kvf_store_release(&bell->expect_until, until_ns);
}

/* Poll has_work() while a producer expects to ring: 1 work came, 0 the
 * expectation was withdrawn or ran out. */
static int poll_expected(struct kvf_doorbell *bell, bool (*has_work)(void *ctx), void *ctx)
{
        uint64_t until = kvf_load_acquire(&bell->expect_until);
        if (!until)
                return 0;
        uint64_t now = kvf_now_ns();
        if (until > now + KVF_DOORBELL_EXPECT_MAX_NS)
                until = now + KVF_DOORBELL_EXPECT_MAX_NS; /* a bad word never holds a CPU long */
        while (now < until) {
                for (unsigned i = 0; i < 64; i++) {
                        if (has_work(ctx))
                                return 1;
                        kvf_cpu_relax();
                }
                if (!kvf_load_acquire(&bell->expect_until))
                        return 0; /* withdrawn: the record came (the caller re-checks) */
                /* The producer may be waiting for this CPU (woken, we were placed where
                 * it runs): let it have it. Returns at once when nobody else is runnable. */
                sched_yield();
                now = kvf_now_ns();
        }
        return 0;
}

#ifndef SYS_futex_waitv
#define SYS_futex_waitv 449 /* the generic and x86-64 number (Linux 5.16) */
#endif
#ifndef FUTEX2_SIZE_U32
#define FUTEX2_SIZE_U32 0x02
#endif

/* The vector futex_waitv(2) takes (linux/futex.h's struct futex_waitv, kept here for headers
 * older than 5.16). */
struct waitv {
        uint64_t val;
        uint64_t uaddr;
        uint32_t flags;
        uint32_t reserved;
};

static int waitv_missing; /* futex_waitv refused once: every later call says -ENOSYS */

int kvf_doorbell_wait_any(struct kvf_doorbell *const *bells, unsigned n, bool (*has_work)(void *ctx),
                          void *ctx, unsigned spins, uint64_t timeout_ns)
{
        if (n == 0 || n > KVF_DOORBELL_ANY_MAX)
                return -EINVAL;
        if (kvf_load_relaxed(&waitv_missing))
                return -ENOSYS;
        for (unsigned i = 0; i < spins; i++) {
                if (has_work(ctx))
                        return 1;
                kvf_cpu_relax();
        }
        for (unsigned i = 0; i < n; i++)
                if (poll_expected(bells[i], has_work, ctx))
                        return 2;
        struct waitv w[KVF_DOORBELL_ANY_MAX];
        bool shorter = false;
        for (unsigned i = 0; i < n; i++) {
                uint32_t seq = kvf_doorbell_prepare(bells[i]);
                shorter |= short_sleep;
                /* shared futexes (no FUTEX_PRIVATE_FLAG): the words are in MAP_SHARED
                 * mappings, woken by the producers' FUTEX_WAKE on the same key */
                w[i] = (struct waitv){.val = seq, .uaddr = (uint64_t)(uintptr_t)futex_word(bells[i]),
                                      .flags = FUTEX2_SIZE_U32};
        }
        if (has_work(ctx)) {
                for (unsigned i = 0; i < n; i++)
                        kvf_doorbell_cancel(bells[i], (uint32_t)w[i].val);
                return 1;
        }
        if (shorter && timeout_ns > SHORT_SLEEP_NS)
                timeout_ns = SHORT_SLEEP_NS;
        /* an absolute CLOCK_MONOTONIC deadline */
        uint64_t until = kvf_now_ns() + timeout_ns;
        struct timespec ts = {.tv_sec = (time_t)(until / 1000000000ull), .tv_nsec = (long)(until % 1000000000ull)};
        long rc = syscall(SYS_futex_waitv, w, n, 0, &ts, CLOCK_MONOTONIC);
        int err = rc < 0 ? errno : 0;
        /* Withdraw every announcement a wake did not (a bell whose seq moved was bumped,
         * and the bump withdrew it). */
        for (unsigned i = 0; i < n; i++) {
                kvf_doorbell_cancel(bells[i], (uint32_t)w[i].val);
                kvf_store_relaxed(&bells[i]->sleeps, kvf_load_relaxed(&bells[i]->sleeps) + 1);
        }
        /* woken (rc: which), a word already moved (EAGAIN), a timeout or a signal: a round;
         * anything else (ENOSYS, a seccomp filter's EPERM) says the call is not there */
        if (err && err != EAGAIN && err != ETIMEDOUT && err != EINTR) {
                kvf_store_relaxed(&waitv_missing, 1);
                return -ENOSYS;
        }
        return 0;
}

int kvf_doorbell_wait(struct kvf_doorbell *bell, bool (*has_work)(void *ctx), void *ctx,
                      unsigned spins, uint64_t timeout_ns)
{
        for (unsigned i = 0; i < spins; i++) {
                if (has_work(ctx))
                        return 1;
                kvf_cpu_relax();
        }
        if (poll_expected(bell, has_work, ctx))
                return 2;
        uint32_t seq = kvf_doorbell_prepare(bell);
        if (has_work(ctx)) {
                kvf_doorbell_cancel(bell, seq);
                return 1;
        }
        kvf_doorbell_sleep(bell, seq, timeout_ns);
        return 0;
}
