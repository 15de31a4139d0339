/*
 * The entry points of programs linked before KVFERRY_ABI's caller-declared
 * sizes (shared library only; packaging/libkvferry.map names the nodes).
 *
 * KVFERRY_0: libkvferry.so.0 as first released with symbol versions. Its
 * header's structs are the ABI 1 structs, so these pass the ABI 1 sizes.
 *
 * KVFERRY_PRE: what a reference with no symbol version binds to (the dynamic
 * linker takes the library's first version node for it): programs linked
 * against a libkvferry built without a version script. Their struct
 * kvf_event had one of two layouts, 528 bytes (status at offset 4) or
 * 560 (a session before it), and nothing in the call says which: kvf_poll
 * and kvf_group_poll refuse rather than write either. kvf_submit_task reads
 * the fields both had; kvf_poll_previous came with the 560-byte layout only,
 * whose fields ABI 1 kept (flags took its tail padding).
 */
#include <errno.h>

#include "abi.h"
#include "err.h"

#undef kvf_poll
#undef kvf_poll_previous
#undef kvf_group_poll
#undef kvf_get_layout
#undef kvf_submit_task

/* The .symver directive rather than GCC's symver attribute, which clang does not have: fn@node
 * names impl, the definition that follows, in the library's dynamic symbol table. */
#define LEGACY(fn, impl, node)                                                                     \
        __asm__(".symver " #impl ", " #fn "@" node);                                               \
        __attribute__((used, visibility("default")))

/* Defined here only, under their versioned names: no header declares them. */
int kvf_poll_abi0(struct kvf_client *c, struct kvf_event *ev, int timeout_ms);
int kvf_poll_previous_abi0(struct kvf_client *c, struct kvf_event *ev);
int kvf_group_poll_abi0(struct kvf_group *g, struct kvf_event *ev, int timeout_ms);
int kvf_get_layout_abi0(struct kvf_client *c, struct kvf_layout_info *out);
int kvf_submit_task_abi0(struct kvf_client *c, const struct kvf_task *t);
int kvf_poll_pre(struct kvf_client *c, struct kvf_event *ev, int timeout_ms);
int kvf_poll_previous_pre(struct kvf_client *c, struct kvf_event *ev);
int kvf_group_poll_pre(struct kvf_group *g, struct kvf_event *ev, int timeout_ms);
int kvf_get_layout_pre(struct kvf_client *c, struct kvf_layout_info *out);
int kvf_submit_task_pre(struct kvf_client *c, const struct kvf_task *t);

LEGACY(kvf_poll, kvf_poll_abi0, "KVFERRY_0")
int kvf_poll_abi0(struct kvf_client *c, struct kvf_event *ev, int timeout_ms)
{
        return kvf_poll_sized(c, ev, KVF_EVENT_SIZE_ABI1, timeout_ms);
}

LEGACY(kvf_poll_previous, kvf_poll_previous_abi0, "KVFERRY_0")
int kvf_poll_previous_abi0(struct kvf_client *c, struct kvf_event *ev)
{
        return kvf_poll_previous_sized(c, ev, KVF_EVENT_SIZE_ABI1);
}

LEGACY(kvf_group_poll, kvf_group_poll_abi0, "KVFERRY_0")
int kvf_group_poll_abi0(struct kvf_group *g, struct kvf_event *ev, int timeout_ms)
{
        return kvf_group_poll_sized(g, ev, KVF_EVENT_SIZE_ABI1, timeout_ms);
}

LEGACY(kvf_get_layout, kvf_get_layout_abi0, "KVFERRY_0")
int kvf_get_layout_abi0(struct kvf_client *c, struct kvf_layout_info *out)
{
        return kvf_get_layout_sized(c, out, KVF_LAYOUT_INFO_SIZE_ABI1);
}

LEGACY(kvf_submit_task, kvf_submit_task_abi0, "KVFERRY_0")
int kvf_submit_task_abi0(struct kvf_client *c, const struct kvf_task *t)
{
        return kvf_submit_task_sized(c, t, KVF_TASK_SIZE_ABI1);
}

static int refuse_event(const char *fn)
{
        return kvf_err_set(-ENOTSUP,
                           "%s: this program was linked against a libkvferry without symbol versions, "
                           "whose struct kvf_event this library (kvferry %s, ABI %d) cannot tell from "
                           "another layout: nothing was written; rebuild the program against kvferry.h",
                           fn, KVFERRY_VERSION, KVFERRY_ABI);
}

LEGACY(kvf_poll, kvf_poll_pre, "KVFERRY_PRE")
int kvf_poll_pre(struct kvf_client *c, struct kvf_event *ev, int timeout_ms)
{
        (void)c, (void)ev, (void)timeout_ms;
        return refuse_event("kvf_poll");
}

LEGACY(kvf_poll_previous, kvf_poll_previous_pre, "KVFERRY_PRE")
int kvf_poll_previous_pre(struct kvf_client *c, struct kvf_event *ev)
{
        return kvf_poll_previous_sized(c, ev, KVF_EVENT_SIZE_ABI1);
}

LEGACY(kvf_group_poll, kvf_group_poll_pre, "KVFERRY_PRE")
int kvf_group_poll_pre(struct kvf_group *g, struct kvf_event *ev, int timeout_ms)
{
        (void)g, (void)ev, (void)timeout_ms;
        return refuse_event("kvf_group_poll");
}

LEGACY(kvf_get_layout, kvf_get_layout_pre, "KVFERRY_PRE")
int kvf_get_layout_pre(struct kvf_client *c, struct kvf_layout_info *out)
{
        return kvf_get_layout_sized(c, out, KVF_LAYOUT_INFO_SIZE_ABI1);
}

LEGACY(kvf_submit_task, kvf_submit_task_pre, "KVFERRY_PRE")
int kvf_submit_task_pre(struct kvf_client *c, const struct kvf_task *t)
{
        /* (the size check is for callers that declare one; this size is the library's own) */
        return kvf_client_submit_task(c, t, KVF_TASK_SIZE_PRE);
}
