/*
 * Cross-process atomics: the only place that spells out memory orders.
 *
 * Every use names, in a comment at the call site, the barrier it pairs with.
 * Plain loads and stores of shared memory are allowed only for data that is
 * published by one of these (a release store) and read after the matching
 * acquire load. A bare `volatile` is a bug.
 */
#ifndef KVF_ATOMICS_H
#define KVF_ATOMICS_H

#include <stdint.h>

#define kvf_load_relaxed(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define kvf_load_acquire(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define kvf_store_relaxed(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#define kvf_store_release(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define kvf_fetch_add_relaxed(p, v) __atomic_fetch_add((p), (v), __ATOMIC_RELAXED)
#define kvf_fetch_add_acq_rel(p, v) __atomic_fetch_add((p), (v), __ATOMIC_ACQ_REL)
#define kvf_fetch_sub_acq_rel(p, v) __atomic_fetch_sub((p), (v), __ATOMIC_ACQ_REL)
#define kvf_exchange_acq_rel(p, v) __atomic_exchange_n((p), (v), __ATOMIC_ACQ_REL)
/* Strong CAS; `expected` is a pointer and receives the current value on failure. */
#define kvf_cas_acq_rel(p, expected, desired)                                                      \
        __atomic_compare_exchange_n((p), (expected), (desired), 0, __ATOMIC_ACQ_REL,              \
                                    __ATOMIC_ACQUIRE)
/* Full barrier: orders an earlier store before a later load (Dekker pattern). */
#define kvf_fence_seq_cst() __atomic_thread_fence(__ATOMIC_SEQ_CST)

static inline void kvf_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ __volatile__("yield" ::: "memory");
#endif
}

#endif
