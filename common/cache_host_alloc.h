/*
 * The host backend's files (cache_host.c, cache_host_alloc.c): the host cache
 * of an instance is one file that every role, the engine and the same-host
 * peers' senders map, in 2 MiB pages where they can be had.
 *
 * Where the pages come from, in order (docs/ARCHITECTURE.md, section 3):
 *   1. a file <mount>/kvferry.<instance>.cache on a hugetlbfs mount of 2 MiB
 *      pages that we can write (/dev/hugepages first); as root, when there is
 *      none, hugetlbfs is mounted on /dev/hugepages, and the pool of 2 MiB pages
 *      is grown by what the cache needs (nr_hugepages, only ever raised);
 *   2. /dev/shm/kvferry.<instance>.cache in transparent huge pages, when the
 *      /dev/shm mount allows them (huge=always, within_size or advise);
 *   3. /dev/shm/kvferry.<instance>.cache in 4 KiB pages.
 * Which one the cache got, and why, goes into the header (cache_backing,
 * cache_page_kib, cache_path, cache_note) and the log.
 */
#ifndef KVF_CACHE_HOST_ALLOC_H
#define KVF_CACHE_HOST_ALLOC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shm_layout.h"

enum kvf_huge_mode {
        KVF_HUGE_AUTO = 0, /* 2 MiB pages if free ones are there, else 4 KiB pages and the reason */
        KVF_HUGE_ON = 1,   /* 2 MiB pages or fail, saying why (as root: mount, reserve) */
        KVF_HUGE_OFF = 2,  /* 4 KiB pages */
};

/*
 * Create the cache file of the instance whose header h is filled but not yet
 * published, and record in h how it is backed. *map gets a read-only mapping
 * of it (the allocator keeps it: the page size checked in its own smaps).
 * Returns 0; -EEXIST when the name is taken (kvf_err says whose); else -errno
 * with kvf_err saying why (with KVF_HUGE_ON: why no 2 MiB pages could be had).
 */
int kvf_host_cache_create(struct kvf_ctl_header *h, enum kvf_huge_mode mode, uint8_t **map);

/* "256 MiB in 2 MiB pages (hugetlbfs /dev/hugepages/kvferry.p0.cache): <note>" */
void kvf_host_cache_describe(const struct kvf_ctl_header *h, char *buf, size_t len);

/*
 * Map the host cache file where the header says it is (MAP_SHARED,
 * populated; transparent huge pages at a 2 MiB-aligned address): a regular
 * file of ours, of the size the layout needs, a hugetlbfs one named after the
 * instance. 0, or -ENOENT, -EPERM, -EPROTO, -ENOMEM with kvf_err set.
 */
int kvf_host_cache_map_raw(const struct kvf_ctl_header *h, bool writable, uint8_t **out);
void kvf_host_cache_unmap_raw(uint8_t *p, uint64_t bytes);

#endif
