/*
 * FastDeploy's cache records for an instance whose GPU cache is one
 * allocation per tensor (`kvf-allocator --fastdeploy`, docs/FASTDEPLOY.md).
 *
 * FastDeploy's model worker attaches each layer's K and V tensor by name: a
 * POSIX shared-memory object key_caches_{layer}_rank{rank}.device{device}
 * (value_caches_... for V) holding struct { size_t nprocesses;
 * cudaIpcMemHandle_t handle; }, and uses the opened pointer as the tensor;
 * with block_wise_fp8 caches also each tensor's per-block scales,
 * key_cache_scales_{layer}_rank{rank}.device{device} (value_cache_scales_...).
 * The handles are the ones the cuda backend put in the control segment, in
 * kvf_layout_offset order. Called by the allocator only, which owns them.
 */
#ifndef KVF_FASTDEPLOY_PUBLISH_H
#define KVF_FASTDEPLOY_PUBLISH_H

#include "shm_layout.h"

/* Write every record, each replacing atomically one a crashed run left. 0, or -errno
 * with kvf_err saying which record. */
int kvf_fd_publish(const struct kvf_ctl_header *h);
/* Remove the records that still hold this instance's handles (a newer instance's stay). */
void kvf_fd_unpublish(const struct kvf_ctl_header *h);

#endif
