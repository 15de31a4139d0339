/*
 * The CPUs this process may use: how many of them its affinity allows, or fewer where a
 * cgroup's CPU quota says so (v2 cpu.max, v1 cpu.cfs_quota_us; a container's CPU limit
 * leaves the affinity whole), rounded up to whole CPUs; and the spin seats that share them
 * among this host's senders. The sender's --layer-wait auto decides by them whether it can
 * spare a CPU to poll on.
 */
#ifndef KVF_CPUS_H
#define KVF_CPUS_H

#include <stdbool.h>

/* At least 1. *why: "affinity" or "cgroup CPU quota", whichever decided. Reads /proc and
 * /sys: call it at start, not on a hot path. */
unsigned kvf_usable_cpus(const char **why);

/*
 * Spin seats: how many senders of this host may poll for layers at once, one per two usable
 * CPUs, shared by every instance of this user (one or many groups) instead of counted per
 * group. Seat k is an exclusive flock on the file "<prefix>.<k>", prefix
 * $KVFERRY_SPIN_SEATS or /dev/shm/kvferry-spin-<uid>: the kernel releases it when its holder
 * exits or dies, so a crashed sender never keeps one. A file that is not this user's own
 * regular file is not used (another local user cannot hand us theirs).
 */
struct kvf_spin_seat {
        int fd;    /* the held seat's file, when held */
        int seat;  /* its number */
        bool held;
};
/* Take the first free seat of `seats`: 1 taken, 0 all held (or seats is 0), < 0 the seats
 * cannot be used here (kvf_err_msg says why). */
int kvf_spin_seat_take(struct kvf_spin_seat *s, unsigned seats);
void kvf_spin_seat_drop(struct kvf_spin_seat *s);

#endif
