#include "doorbell.h"

#include <errno.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "atomics.h"

static long futex(uint32_t *uaddr, int op, uint32_t val, const struct timespec *ts)
{
        return syscall(SYS_futex, uaddr, op, val, ts, NULL, 0);
}

void kvf_doorbell_ring(struct kvf_doorbell *bell)
{
        /* Pairs with the fence in kvf_doorbell_prepare(): our record's commit
         * (a release store before this call) is ordered before the load of
         * `waiters`. */
        kvf_fence_seq_cst();
        if (kvf_load_relaxed(&bell->waiters) == 0)
                return;
        /* Release: a consumer that sees the new seq also sees the commit. */
        __atomic_fetch_add(&bell->seq, 1, __ATOMIC_RELEASE);
        kvf_fetch_add_relaxed(&bell->wakes, 1);
        futex(&bell->seq, FUTEX_WAKE, 0x7fffffff, NULL);
}

uint32_t kvf_doorbell_prepare(struct kvf_doorbell *bell)
{
        uint32_t seq = kvf_load_acquire(&bell->seq);

        kvf_fetch_add_relaxed(&bell->waiters, 1);
        /* Pairs with the fence in kvf_doorbell_ring(): the announcement is
         * ordered before the caller's re-check of the ring. */
        kvf_fence_seq_cst();
        return seq;
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
