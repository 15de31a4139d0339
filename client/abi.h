/*
 * The caller-declared struct sizes of libkvferry's public API (KVFERRY_ABI in
 * include/kvferry.h): what a caller's size may be, and the two copies that
 * honour it.
 */
#ifndef KVF_CLIENT_ABI_H
#define KVF_CLIENT_ABI_H

#include <stddef.h>
#include <stdint.h>

#include "kvferry.h"

/* The structs as KVFERRY_ABI 1 defined them: the smallest size a caller may declare. A field
 * added later goes after these, so these values never change. */
#define KVF_EVENT_SIZE_ABI1 (offsetof(struct kvf_event, flags) + sizeof(uint32_t))
#define KVF_TASK_SIZE_ABI1 (offsetof(struct kvf_task, peer_session) + sizeof(uint64_t))
#define KVF_LAYOUT_INFO_SIZE_ABI1 (offsetof(struct kvf_layout_info, cache_bytes) + sizeof(uint64_t))
/* struct kvf_task as every header before KVFERRY_ABI had it (no peer_session). */
#define KVF_TASK_SIZE_PRE (offsetof(struct kvf_task, chunked) + sizeof(int))

/* 0 when a caller's size is at least min, else -EINVAL with kvf_last_error() naming both. */
int kvf_abi_size_check(size_t size, size_t min, const char *what);
/* Write src (the library's struct, src_size bytes) into the caller's dst of dst_size bytes:
 * what fits, and zeros past src_size. */
void kvf_abi_copy_out(void *dst, size_t dst_size, const void *src, size_t src_size);
/* Read the caller's src of src_size bytes into the library's dst (dst_size bytes): dst's
 * fields past src_size are zero; bytes of src past dst_size (fields of a newer header) must
 * be zero, else -E2BIG. 0 on success. */
int kvf_abi_copy_in(void *dst, size_t dst_size, const void *src, size_t src_size, const char *what);

/* kvferry.c: kvf_submit_task for a caller's struct of `size` bytes (checked by the caller). */
struct kvf_client;
int kvf_client_submit_task(struct kvf_client *c, const struct kvf_task *t, size_t size);

#endif
