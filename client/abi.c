/*
 * libkvferry's ABI: caller-declared struct sizes and what the library reports
 * about its own structs and constants (kvf_abi_info), so that a binding which
 * repeats the header (python/kvferry) can check itself against the library.
 */
#include "abi.h"

#include <errno.h>
#include <string.h>

#include "err.h"
#include "records.h"
#include "shm_layout.h"

/* The public strings are the internal ones: an event never truncates what a record carried. */
#define FIELD_SIZE(type, f) sizeof(((type *)0)->f)
_Static_assert(FIELD_SIZE(struct kvf_event, request_id) == KVF_REQ_ID_MAX, "kvf_event.request_id is KVF_REQ_ID_MAX");
_Static_assert(FIELD_SIZE(struct kvf_event, peer) == KVF_PEER_MAX, "kvf_event.peer is KVF_PEER_MAX");
_Static_assert(FIELD_SIZE(struct kvf_event, reason) == KVF_REASON_MAX, "kvf_event.reason is KVF_REASON_MAX");
_Static_assert(FIELD_SIZE(struct kvf_record, request_id) == FIELD_SIZE(struct kvf_event, request_id) &&
                       FIELD_SIZE(struct kvf_record, peer) == FIELD_SIZE(struct kvf_event, peer) &&
                       FIELD_SIZE(struct kvf_record, reason) == FIELD_SIZE(struct kvf_event, reason),
               "records and events carry strings of one size");
/* Enum values the records carry as they are. */
_Static_assert(KVF_STATUS_COUNT == 12 && KVF_STATUS_PEER_ROLE == KVF_STATUS_COUNT - 1,
               "a status added is added to the Python package's check (kvf_abi_info) too");
_Static_assert((int)KVF_REC_ARRIVAL < (int)KVF_RT_WRITE_BATCH, "the engine's record types come first");
_Static_assert(KVF_TO_SENDER == 0 && KVF_TO_CONNECTOR == 1, "kvf_submit_raw targets");

#if UINTPTR_MAX == UINT64_MAX
/* ABI 1 as first released (x86-64, aarch64): programs linked against libkvferry.so.0's
 * KVFERRY_0 node have these sizes compiled in. A change here breaks them. */
_Static_assert(KVF_EVENT_SIZE_ABI1 == 560 && offsetof(struct kvf_event, session) == 8 &&
                       offsetof(struct kvf_event, status) == 16 &&
                       offsetof(struct kvf_event, request_id) == 20 &&
                       offsetof(struct kvf_event, bytes) == 504 &&
                       offsetof(struct kvf_event, dest_block_ids) == 544 &&
                       offsetof(struct kvf_event, flags) == 556,
               "struct kvf_event of ABI 1");
_Static_assert(KVF_TASK_SIZE_ABI1 == 80 && KVF_TASK_SIZE_PRE == 68, "struct kvf_task of ABI 1");
_Static_assert(KVF_LAYOUT_INFO_SIZE_ABI1 == 48, "struct kvf_layout_info of ABI 1");
#endif

int kvf_abi_size_check(size_t size, size_t min, const char *what)
{
        if (size >= min)
                return 0;
        return kvf_err_set(-EINVAL,
                           "%s of %zu bytes: this library (kvferry %s, ABI %d) needs at least %zu; "
                           "rebuild against its kvferry.h",
                           what, size, KVFERRY_VERSION, KVFERRY_ABI, min);
}

void kvf_abi_copy_out(void *dst, size_t dst_size, const void *src, size_t src_size)
{
        memcpy(dst, src, dst_size < src_size ? dst_size : src_size);
        if (dst_size > src_size)
                memset((char *)dst + src_size, 0, dst_size - src_size);
}

int kvf_abi_copy_in(void *dst, size_t dst_size, const void *src, size_t src_size, const char *what)
{
        memset(dst, 0, dst_size);
        if (src_size > dst_size) {
                const unsigned char *p = (const unsigned char *)src;
                for (size_t i = dst_size; i < src_size; i++)
                        if (p[i])
                                return kvf_err_set(-E2BIG,
                                                   "%s of %zu bytes sets a field at byte %zu that this library "
                                                   "(kvferry %s, ABI %d, %zu bytes) does not know",
                                                   what, src_size, i, KVFERRY_VERSION, KVFERRY_ABI, dst_size);
        }
        memcpy(dst, src, dst_size < src_size ? dst_size : src_size);
        return 0;
}

struct abi_entry {
        const char *name;
        int64_t value;
};

#define SIZE(s) {"sizeof " #s, (int64_t)sizeof(struct s)}
#define FIELD(s, f) {"offsetof " #s "." #f, (int64_t)offsetof(struct s, f)}, \
                    {"sizeof " #s "." #f, (int64_t)FIELD_SIZE(struct s, f)}
#define CONST(c) {#c, (int64_t)(c)}

static const struct abi_entry abi_table[] = {
        {"abi", KVFERRY_ABI},
        SIZE(kvf_event),
        FIELD(kvf_event, type), FIELD(kvf_event, session), FIELD(kvf_event, status),
        FIELD(kvf_event, request_id), FIELD(kvf_event, peer), FIELD(kvf_event, reason),
        FIELD(kvf_event, bytes), FIELD(kvf_event, blocks), FIELD(kvf_event, rank),
        FIELD(kvf_event, accept_ns), FIELD(kvf_event, last_layer_ns), FIELD(kvf_event, done_ns),
        FIELD(kvf_event, dest_block_ids), FIELD(kvf_event, n_dest), FIELD(kvf_event, flags),
        SIZE(kvf_task),
        FIELD(kvf_task, request_id), FIELD(kvf_task, src_block_ids), FIELD(kvf_task, n_src),
        FIELD(kvf_task, dest_block_ids), FIELD(kvf_task, n_dest), FIELD(kvf_task, current_id),
        FIELD(kvf_task, transport), FIELD(kvf_task, peer), FIELD(kvf_task, chunked),
        FIELD(kvf_task, peer_session),
        SIZE(kvf_layout_info),
        FIELD(kvf_layout_info, num_layers), FIELD(kvf_layout_info, extra_layers),
        FIELD(kvf_layout_info, num_blocks), FIELD(kvf_layout_info, kv_heads),
        FIELD(kvf_layout_info, block_size), FIELD(kvf_layout_info, head_dim),
        FIELD(kvf_layout_info, dtype), FIELD(kvf_layout_info, key_only),
        FIELD(kvf_layout_info, block_bytes), FIELD(kvf_layout_info, cache_bytes),
        FIELD(kvf_layout_info, scale_dtype), FIELD(kvf_layout_info, reserved),
        FIELD(kvf_layout_info, scale_bytes),
        SIZE(kvf_reg_region),
        FIELD(kvf_reg_region, addr), FIELD(kvf_reg_region, bytes), FIELD(kvf_reg_region, fd),
        FIELD(kvf_reg_region, pad), FIELD(kvf_reg_region, fd_offset),
        SIZE(kvf_reg_view),
        FIELD(kvf_reg_view, layer), FIELD(kvf_reg_view, tensor), FIELD(kvf_reg_view, addr),
        FIELD(kvf_reg_view, block_stride),
        SIZE(kvf_registration),
        FIELD(kvf_registration, regions), FIELD(kvf_registration, n_regions), FIELD(kvf_registration, pad),
        FIELD(kvf_registration, views), FIELD(kvf_registration, n_views),
        FIELD(kvf_registration, token_major), FIELD(kvf_registration, device), FIELD(kvf_registration, pad2),
        CONST(KVF_STATUS_COUNT), CONST(KVF_EVENT_ID_BIN),
        CONST(KVF_EVENT_COMPLETION), CONST(KVF_EVENT_ARRIVAL), CONST(KVF_EVENT_CONNECT_RESULT),
        CONST(KVF_TRANSPORT_IPC), CONST(KVF_TRANSPORT_TCP), CONST(KVF_TRANSPORT_RDMA),
        CONST(KVF_TO_SENDER), CONST(KVF_TO_CONNECTOR),
        CONST(KVF_REC_TASK), CONST(KVF_REC_CHUNK), CONST(KVF_REC_CANCEL), CONST(KVF_REC_COMPLETION),
        CONST(KVF_REC_CONNECT), CONST(KVF_REC_CONNECT_RESULT), CONST(KVF_REC_ARRIVAL),
        CONST(KVF_SIGNAL_DEFAULT), CONST(KVF_SIGNAL_HOSTFN), CONST(KVF_SIGNAL_WRITEVALUE),
};

int64_t kvf_abi_info(const char *name)
{
        for (size_t i = 0; name && i < sizeof(abi_table) / sizeof(abi_table[0]); i++)
                if (!strcmp(abi_table[i].name, name))
                        return abi_table[i].value;
        return kvf_err_set(-ENOENT, "kvf_abi_info: no '%s' in kvferry %s (ABI %d)", name ? name : "(null)",
                           KVFERRY_VERSION, KVFERRY_ABI);
}

const char *kvf_version(void)
{
        return KVFERRY_VERSION;
}
