/*
 * Huge pages for host caches: where 2 MiB pages can be had on this host (a
 * hugetlbfs mount, the kernel's pool of 2 MiB pages, a /dev/shm that allows
 * transparent huge pages), growing the pool (root only; never shrinking it),
 * and how much of a mapping the kernel really maps with 2 MiB pages.
 *
 * Why: on some virtual machines the first write through each new mapping of a
 * 4 KiB page costs microseconds, and every process of an instance,
 * its peers' senders and the engine map the caches; with 2 MiB pages there are
 * 512 times fewer such first touches.
 *
 * Thread safety: none needed; every function here is called at start-up or
 * tear-down. Functions return >= 0 or -errno, with kvf_err set where a caller
 * would print it.
 */
#ifndef KVF_HUGEPAGES_H
#define KVF_HUGEPAGES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVF_HUGE_PAGE_SIZE (2ull << 20)
#define KVF_HUGE_DEFAULT_MOUNT "/dev/hugepages"

/* The kernel's pool of 2 MiB pages (/sys/kernel/mm/hugepages/hugepages-2048kB). */
struct kvf_huge_pool {
        uint64_t total; /* nr_hugepages: the pool's size */
        uint64_t free;  /* free_hugepages: not in any file or mapping */
        uint64_t resv;  /* resv_hugepages: free, but promised to mappings already */
};

/* Read the pool. -ENOENT: this kernel has no pool of 2 MiB pages. */
int kvf_huge_pool_read(struct kvf_huge_pool *p);

/*
 * Serialise "look at the pool, grow it, take the pages" between the kvferry
 * allocators of this host: an exclusive flock on the pool's nr_hugepages file
 * (others' processes do not take it; it only keeps two allocators from both
 * counting the same free pages). Returns a descriptor for kvf_huge_unlock(),
 * or -errno (no pool).
 */
int kvf_huge_lock(void);
void kvf_huge_unlock(int fd);

/*
 * Grow the pool to `total` pages (root only): writes nr_hugepages, which only
 * ever grows here, and reads back what the kernel found; *got is the new
 * nr_hugepages, which may be short of `total` (memory too fragmented or too
 * little free). Pages added stay the system's.
 */
int kvf_huge_pool_grow(uint64_t total, uint64_t *got);

/*
 * A hugetlbfs mount of 2 MiB pages where this process can create files:
 * /dev/hugepages first, then the others in mount order. 0 with `dir` filled;
 * -ENOENT when there is none at all, -EACCES when there are only ones we
 * cannot write (`why` says which, and why), -ENAMETOOLONG if `dir` is too
 * small.
 */
int kvf_huge_find_mount(char *dir, size_t len, char *why, size_t whylen);

/*
 * As root: mount hugetlbfs (2 MiB pages) on /dev/hugepages, creating the
 * folder, as systemd's dev-hugepages.mount does at boot. The mount stays.
 */
int kvf_huge_mount_default(void);

/* Call fn for the folder of every hugetlbfs mount (any page size). */
void kvf_huge_for_each_mount(void (*fn)(const char *dir, void *arg), void *arg);

/* True when fd is a file on a hugetlbfs mount of 2 MiB pages. */
bool kvf_huge_fd_is_hugetlbfs(int fd);

/* Whether files created in /dev/shm get transparent huge pages. */
enum kvf_shm_thp {
        KVF_SHM_THP_NEVER = 0,
        KVF_SHM_THP_ADVISE = 1, /* on madvise(MADV_HUGEPAGE) of a mapping that faults them in */
        KVF_SHM_THP_ALWAYS =
            2, /* at allocation (huge=always or within_size, or shmem_enabled force) */
};
/* /dev/shm's policy; for NEVER, `why` says what forbids them. */
enum kvf_shm_thp kvf_huge_shm_thp(char *why, size_t whylen);

/*
 * Bytes of this process's mapping that starts at addr which the kernel maps
 * with 2 MiB pages (hugetlb pages, or PMD-mapped transparent huge pages), read
 * from /proc/self/smaps. -ENOENT if no mapping starts there.
 */
int64_t kvf_huge_mapped_bytes(const void *addr);

/* MemAvailable of /proc/meminfo in bytes, 0 if unknown. */
uint64_t kvf_mem_available(void);

#endif
