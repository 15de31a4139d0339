/*
 * Futex doorbells: how a consumer sleeps until a producer has work for it.
 *
 * A consumer spins briefly, then announces itself (waiters += 1, in the same
 * word as the futex word `seq`), re-checks for work, and sleeps on seq with a
 * timeout. A producer, after committing its record, rings: a full fence, then
 * only if a waiter is announced, seq += 1 with waiters = 0, and FUTEX_WAKE.
 * The store-fence-load on both sides (commit / fence / load the word against
 * announce / fence / load record) means at least one side sees the other, so
 * a wake cannot be lost; and every sleep has a timeout, so correctness never
 * depends on a wake arriving.
 *
 * Shared (not private) futex operations: the word is in a MAP_SHARED mapping
 * seen by several processes.
 */
#ifndef KVF_DOORBELL_H
#define KVF_DOORBELL_H

#include <stdbool.h>
#include <stdint.h>

#include "shm_layout.h"

/* The two halves of a doorbell's `state` word (ringdump, tests). */
static inline uint32_t kvf_doorbell_seq(uint64_t state)
{
        return (uint32_t)state;
}

static inline uint32_t kvf_doorbell_waiters(uint64_t state)
{
        return (uint32_t)(state >> 32);
}

/* Producer side: wake the consumer if it announced itself. Any thread, any process. */
void kvf_doorbell_ring(struct kvf_doorbell *bell);

/*
 * Dense traffic and the asymmetric barrier (membarrier(2)). The pair above
 * costs the producer a full fence per record, which under dense traffic is
 * most of a small record's cost. A producer thread that keeps finding the
 * consumer awake switches to ringing with a compiler barrier only, after
 * registering for MEMBARRIER_CMD_GLOBAL_EXPEDITED and announcing itself in
 * the bell's `unfenced` count; a consumer about to sleep while that count is
 * non-zero issues one membarrier, which runs the missing fence on every
 * registered process's CPU. Under sparse traffic (the consumer sleeps between
 * records) producers keep the fence and nobody pays for membarrier IPIs, so
 * wake-up latency is that of the plain pair. See doorbell.c for why no wake
 * can be lost across the switches.
 */
bool kvf_doorbell_asymmetric_supported(void);
/*
 * Register this process for the asymmetric barrier; a producer thread enters dense mode only in
 * a registered process. Call it once at the process's start, before it starts threads: there
 * the kernel registers at once, while in a process of several threads it waits for a grace
 * period (milliseconds), which on the ring that entered dense mode held up a record's consumer
 * that long. 0, or -ENOSYS where membarrier(2) refuses (dense mode stays off: every ring
 * fences). A child of fork() is not registered until it calls this itself. The roles call it;
 * the client library does not: an engine's thread rings at an engine's pace, where the fence
 * costs nothing that shows, and an engine process that is not registered takes no membarrier
 * IPIs on its CPUs.
 */
int kvf_doorbell_register(void);

/*
 * Consumer side, in this order:
 *   seq = kvf_doorbell_prepare(bell);
 *   if (work is visible) kvf_doorbell_cancel(bell, seq); else kvf_doorbell_sleep(bell, seq, ns);
 * prepare() announces the waiter and returns the word to sleep on; sleep()
 * returns 0 when woken or the word moved, -ETIMEDOUT on timeout. Either way
 * the announcement is gone afterwards: the producer that wakes a consumer
 * withdraws it (so a woken consumer writes nothing the producers share), and
 * otherwise sleep() and cancel() withdraw it.
 */
uint32_t kvf_doorbell_prepare(struct kvf_doorbell *bell);
void kvf_doorbell_cancel(struct kvf_doorbell *bell, uint32_t seq);
int kvf_doorbell_sleep(struct kvf_doorbell *bell, uint32_t seq, uint64_t timeout_ns);

/*
 * kvf_doorbell_sleep() without the timeout, for kvf-bench-ring's diagnostic
 * row only, which prices the timer every other wait arms. kvferry's own
 * processes and the client library never call it: their waits always time out.
 */
int kvf_doorbell_sleep_untimed(struct kvf_doorbell *bell, uint32_t seq);

/*
 * Producer side, ahead of a record: "I expect to ring before until_ns"
 * (CLOCK_MONOTONIC; 0 withdraws). A consumer about to sleep then polls
 * has_work() instead, until the expectation is withdrawn or passes, and never
 * longer than KVF_DOORBELL_EXPECT_MAX_NS per wait. It does not wake a
 * sleeping consumer: ring after it for that. Why: a consumer woken from a
 * futex runs tens of microseconds later (a halted vCPU: 55 us p50 on a 2-vCPU
 * EPYC VM), and a producer that knows when its record will come (the sender,
 * near the end of a request's last copy) can have that wake-up happen while
 * it finishes, instead of after. Costs the consumer's CPU for the window.
 */
#define KVF_DOORBELL_EXPECT_MAX_NS 1000000ull
void kvf_doorbell_expect(struct kvf_doorbell *bell, uint64_t until_ns);

/*
 * The whole pattern: spin `spins` times calling has_work(ctx), poll while a
 * producer expects to ring (kvf_doorbell_expect), then sleep up to
 * timeout_ns. Returns 1 if has_work() said yes (2: while polling for an
 * expected ring), 0 after a wake or timeout (the caller re-checks anyway).
 */
int kvf_doorbell_wait(struct kvf_doorbell *bell, bool (*has_work)(void *ctx), void *ctx,
                      unsigned spins, uint64_t timeout_ns);

/*
 * kvf_doorbell_wait() on up to KVF_DOORBELL_ANY_MAX doorbells at once (one thread consuming
 * several instances' rings: a group of ranks, kvf_poll_any): has_work(ctx) looks at all of
 * them; the sleep is one futex_waitv(2) (Linux 5.16) on every bell, so whichever rings wakes
 * it at once. Returns as kvf_doorbell_wait(), or -ENOSYS where the kernel or a seccomp filter
 * refuses futex_waitv (remembered for the process): the caller then sleeps on one bell at a
 * time, bounded, as before; -EINVAL for n of 0 or over the maximum.
 */
#define KVF_DOORBELL_ANY_MAX 64u
int kvf_doorbell_wait_any(struct kvf_doorbell *const *bells, unsigned n, bool (*has_work)(void *ctx),
                          void *ctx, unsigned spins, uint64_t timeout_ns);

#endif
