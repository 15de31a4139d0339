#include "doorbell.h"

#include <errno.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "atomics.h"

/*
 * Performance only: at most one FUTEX_WAKE per sleep.
 *
 * Before, every kvf_doorbell_ring() that found `waiters` != 0 bumped seq
 * and made a FUTEX_WAKE system call. `waiters` stays non-zero from the
 * consumer's prepare() until it has woken up, been scheduled and cancelled;
 * on a busy host that takes milliseconds, and a producer committing records
 * one by one made a wake call (about a microsecond, shared futex key) for
 * each of them. kvf-bench-ring on the 2-vCPU VM, with other work running:
 * 314 futex wakes per 1000 records for 0.17 consumer sleeps; a 16-vCPU VM
 * with a spinner on the consumer's CPU: 18 wakes per 1000 records (72 once
 * commits got faster) for 0.02 sleeps. After: 0.03 wakes per 1000.
 *
 * How: the low bit of seq, ARMED, means "a consumer has prepared to sleep on
 * this value and nobody has moved it since". prepare() sets it (once; if it
 * is set already it stays) before announcing itself, and sleeps on the armed
 * value. ring() still fences and loads `waiters` first; then it bumps seq
 * only if it finds the bit set, and the bump, odd + 1, clears it. Finding
 * waiters != 0 with the bit clear means a bump has happened since every
 * announced consumer armed: those consumers cannot block on their value
 * (FUTEX_WAIT checks it) or were woken by that bump's FUTEX_WAKE, and the
 * caller of kvf_doorbell_wait() re-checks its rings before sleeping again,
 * so the call would wake nobody.
 *
 * Why no wake is lost (the documented promise): let F_p be the producer's
 * fence, F_c the consumer's fence in prepare(), in the single total order of
 * seq_cst fences. F_p first: the consumer's re-check sees the record. F_c
 * first: the producer's loads of `waiters` and `seq` see the consumer's
 * increment and arming or later values; a later value of seq means a bump
 * after the arming, so that sleep ends and the consumer's next prepare() is
 * a new round, whose fence comes after F_p (else the producer would have
 * seen that arming) and whose re-check therefore sees the record.
 * Timeouts are unchanged, and several producers (CAS) or several consumer
 * threads on one bell (the count) are covered by the same argument.
 */
#define ARMED 1u

static long futex(uint32_t *uaddr, int op, uint32_t val, const struct timespec *ts)
{
        return syscall(SYS_futex, uaddr, op, val, ts, NULL, 0);
}

void kvf_doorbell_ring(struct kvf_doorbell *bell)
{
        /* Pairs with the fence in kvf_doorbell_prepare(): our record's commit
         * (a release store before this call) is ordered before the loads of
         * `waiters` and `seq`. */
        kvf_fence_seq_cst();
        if (kvf_load_relaxed(&bell->waiters) == 0)
                return;
        uint32_t seq = kvf_load_relaxed(&bell->seq);
        do {
                if (!(seq & ARMED))
                        return; /* moved since every announced consumer armed: see above */
                /* Release: a consumer that sees the new seq also sees the
                 * commit. Odd + 1: moves the word and disarms it in one step,
                 * so of several producers exactly one makes the call. */
        } while (!kvf_cas_acq_rel(&bell->seq, &seq, seq + 1));
        kvf_fetch_add_relaxed(&bell->wakes, 1);
        futex(&bell->seq, FUTEX_WAKE, 0x7fffffff, NULL);
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
        return seq | ARMED;
}

void kvf_doorbell_cancel(struct kvf_doorbell *bell)
{
        kvf_fetch_sub_acq_rel(&bell->waiters, 1);
}

int kvf_doorbell_sleep(struct kvf_doorbell *bell, uint32_t seq, uint64_t timeout_ns)
{
        struct timespec ts = {.tv_sec = (time_t)(timeout_ns / 1000000000ull),
                              .tv_nsec = (long)(timeout_ns % 1000000000ull)};
        int rc = 0;

        kvf_fetch_add_relaxed(&bell->sleeps, 1);
        /* FUTEX_WAIT returns at once (EAGAIN) if seq already moved: the wake
         * raced ahead of us and is not lost. */
        if (futex(&bell->seq, FUTEX_WAIT, seq, &ts) != 0 && errno == ETIMEDOUT)
                rc = -ETIMEDOUT;
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
