/*
 * The CPUs this process may use: how many of them its affinity allows, or fewer where a
 * cgroup's CPU quota says so (v2 cpu.max, v1 cpu.cfs_quota_us; a container's CPU limit
 * leaves the affinity whole), rounded up to whole CPUs. The sender's --layer-wait auto
 * decides by it whether it can spare a CPU to poll on.
 */
#ifndef KVF_CPUS_H
#define KVF_CPUS_H

/* At least 1. *why: "affinity" or "cgroup CPU quota", whichever decided. Reads /proc and
 * /sys: call it at start, not on a hot path. */
unsigned kvf_usable_cpus(const char **why);

#endif
