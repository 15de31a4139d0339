/* A short scheduler slice for kvferry's threads (sched_slice.h says why). */
#include "sched_slice.h"

#include <errno.h>
#include <sched.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "err.h"
#include "log.h"
#include "opts.h"

/* struct sched_attr (sched_setattr(2)): glibc 2.36 has no wrapper or declaration. */
struct kvf_sched_attr {
        uint32_t size;
        uint32_t sched_policy;
        uint64_t sched_flags;
        int32_t sched_nice;
        uint32_t sched_priority;
        uint64_t sched_runtime;
        uint64_t sched_deadline;
        uint64_t sched_period;
};

static int get_attr(struct kvf_sched_attr *a)
{
        memset(a, 0, sizeof(*a));
        if (syscall(SYS_sched_getattr, 0, a, (unsigned)sizeof(*a), 0) != 0)
                return kvf_err_set(-errno, "sched_getattr: %s", strerror(errno));
        return 0;
}

int kvf_sched_slice(uint32_t us)
{
        struct kvf_sched_attr a;
        if (us == 0)
                return 0;
        if (us < KVF_SLICE_US_DEFAULT || us > KVF_SLICE_US_MAX)
                return kvf_err_set(-EINVAL, "slice of %u us: the kernel takes %u to %u us", us,
                                   KVF_SLICE_US_DEFAULT, KVF_SLICE_US_MAX);
        int rc = get_attr(&a);
        if (rc < 0)
                return rc;
        if (a.sched_policy != SCHED_OTHER)
                return 0; /* SCHED_BATCH, SCHED_IDLE or real-time: the user's choice stands */
        /* Same policy, same nice value (weight): only the slice changes. */
        a.size = sizeof(a);
        a.sched_flags = 0;
        a.sched_runtime = (uint64_t)us * 1000;
        if (syscall(SYS_sched_setattr, 0, &a, 0) != 0)
                return kvf_err_set(-errno, "sched_setattr: %s", strerror(errno));
        /* A kernel before 6.12 takes the call and ignores the runtime of a SCHED_OTHER
         * thread; one that honours it reports the slice back. */
        rc = get_attr(&a);
        if (rc < 0)
                return rc;
        if (a.sched_runtime == 0)
                return kvf_err_set(-EOPNOTSUPP, "this kernel ignores slice requests (Linux 6.12 "
                                                "or later honours them)");
        return (int)(a.sched_runtime / 1000);
}

uint32_t kvf_sched_slice_start(uint32_t us)
{
        int got = kvf_sched_slice(us);
        if (got > 0)
                kvf_info("scheduler slice %d us (asked %u us): a wake-up preempts a busy CPU's "
                         "thread instead of waiting out its slice",
                         got, us);
        else if (got == 0 && us)
                kvf_info("scheduler slice left as it is: this thread runs under another policy "
                         "than SCHED_OTHER");
        else if (got < 0)
                kvf_warn("scheduler slice left at the kernel's default (asked %u us): %s; a "
                         "wake-up on a busy CPU may wait out another thread's slice",
                         us, kvf_err_msg());
        return got > 0 ? (uint32_t)got : 0;
}

uint32_t kvf_sched_slice_opt(const char *prog, const char *arg)
{
        uint64_t us = kvf_opt_u64("slice-us", arg, 0, KVF_SLICE_US_MAX);
        if (us && us < KVF_SLICE_US_DEFAULT)
                kvf_opt_die(prog, "--slice-us: %llu us is below the kernel's floor of %u us (0: the "
                            "kernel's default)",
                            (unsigned long long)us, KVF_SLICE_US_DEFAULT);
        return (uint32_t)us;
}
