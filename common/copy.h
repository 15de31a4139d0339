/*
 * Bulk copies of KV blocks into another process's cache.
 *
 * The destination is written once and not read by this process again, so
 * the copy streams it past the cache (non-temporal stores on x86-64): no
 * read-for-ownership of each destination line, no eviction of what the
 * engine is using. Non-temporal stores are weakly ordered: kvf_copy_fence()
 * must run after a batch and before anything that says "these bytes are
 * there" (a release store, a ring commit).
 */
#ifndef KVF_COPY_H
#define KVF_COPY_H

#include <stddef.h>

void kvf_copy_stream(void *dst, const void *src, size_t n);
void kvf_copy_fence(void);

#endif
