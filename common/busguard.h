/*
 * Copies through a shared mapping whose file shrank: a fault, not a crash.
 *
 * A host cache the engine registered is its file (a memfd or a /dev/shm file) mapped in our
 * address space. If that file is truncated while mapped (the engine resizing its buffer, or
 * any process of the user with the descriptor), touching the lost pages raises SIGBUS, which
 * would kill the role doing the copy: a prefill sender copying into a decode instance's
 * caches would die of the decode engine's mistake. A copy that can touch such memory runs
 * guarded: SIGBUS inside it jumps back to the guard, which returns an error for that copy.
 *
 *     struct kvf_busguard g;
 *     kvf_busguard_enter(&g);
 *     if (sigsetjmp(g.jb, 0)) {            // the copy faulted
 *             kvf_busguard_leave(&g);
 *             return kvf_err_set(-EFAULT, ...);
 *     }
 *     ... memcpy through the mapping, no locks taken, nothing to undo ...
 *     kvf_busguard_leave(&g);
 *
 * sigsetjmp must be called in the guarded function's own frame (it cannot be wrapped), and a
 * local changed between it and the fault is unreliable after the jump unless volatile. The
 * handler is installed once per process (kvf_busguard_enter does it) with SA_NODEFER, so the
 * jump leaves no signal blocked and sigsetjmp need not save the mask (no system call per
 * copy). SIGBUS outside a guard goes to the handler that was there before (a sanitizer's), or
 * takes its default action.
 */
#ifndef KVF_BUSGUARD_H
#define KVF_BUSGUARD_H

#include <setjmp.h>

struct kvf_busguard {
        sigjmp_buf jb;
        struct kvf_busguard *prev; /* guards nest (a guarded copy calling another) */
};

void kvf_busguard_enter(struct kvf_busguard *g);
void kvf_busguard_leave(struct kvf_busguard *g);
/* The address of the last fault a guard of this thread caught. */
void *kvf_busguard_addr(void);

#endif
