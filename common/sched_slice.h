/*
 * A short scheduler slice for kvferry's own threads.
 *
 * Why: Linux's fair scheduler (EEVDF, 6.6 and later) lets a running thread finish
 * its slice before a thread it woke may run on that CPU; on a host whose CPUs are
 * busy, a role woken to copy a layer or pass a finish notice on waited out the
 * rest of another thread's slice (about 1.4 ms on the 2-vCPU VMs of BENCHMARKS.md
 * section 3: 734 us p50 of a request's tail). Since Linux 6.12 a thread may ask for
 * a shorter slice (sched_attr.sched_runtime under SCHED_OTHER): its deadline comes
 * sooner, so a wake-up runs it at once. The slice changes when a thread runs, not
 * how much CPU it gets (its weight, i.e. its nice value, is kept).
 *
 * Thread safety: applies to the calling thread; threads it creates afterwards
 * inherit the slice, so each role calls it first thing in main().
 */
#ifndef KVF_SCHED_SLICE_H
#define KVF_SCHED_SLICE_H

#include <stdint.h>

#define KVF_SLICE_US_DEFAULT 100 /* the kernel's floor is 100 us */
#define KVF_SLICE_US_MAX 100000  /* and its ceiling 100 ms */

/*
 * Ask for a slice of `us` microseconds (0: leave the kernel's default). Returns the
 * slice now in force in microseconds (> 0), 0 when nothing was asked for or the thread
 * runs under another policy than SCHED_OTHER (left as the user chose: chrt, nice
 * batch), or -errno. -EOPNOTSUPP: this kernel ignores slice requests (before 6.12).
 * kvf_err says why on failure.
 */
int kvf_sched_slice(uint32_t us);

/* The option every role takes, and its line of usage. */
#define KVF_SLICE_USAGE                                                                            \
        "  --slice-us N              ask the scheduler for an N us slice, 100 to 100000, so that a\n" \
        "                            wake-up is not held behind a busy CPU's thread; 0: the kernel's\n" \
        "                            default (default 100)\n"
/* --slice-us's value, or exit with a message. */
uint32_t kvf_sched_slice_opt(const char *prog, const char *arg);

/* kvf_sched_slice() at a role's start, with one line in its log saying what it got and,
 * when not the slice asked for, why. Returns the slice in force (0: the kernel's default). */
uint32_t kvf_sched_slice_start(uint32_t us);

#endif
