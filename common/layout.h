/*
 * Cache layout math: sizes, offsets, compatibility between two instances,
 * dtype names and the model shapes the tools know by name.
 *
 * The host cache file holds, layer after layer, the layer's K tensor then
 * its V tensor (K only when key_only), each [num_blocks, kv_heads,
 * block_size, head_dim] of dtype, so one block of one tensor is block_bytes
 * contiguous bytes.
 */
#ifndef KVF_LAYOUT_H
#define KVF_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "shm_layout.h"

/* Fill *l from the shape; computes block_bytes and cache_bytes. 0 or -EINVAL (kvf_err). */
int kvf_layout_make(struct kvf_cache_layout *l, uint32_t layers, uint32_t extra_layers,
                    uint32_t blocks, uint32_t kv_heads, uint32_t block_size, uint32_t head_dim,
                    uint32_t dtype, uint32_t key_only);

static inline uint32_t kvf_layout_layers(const struct kvf_cache_layout *l)
{
        return l->num_layers + l->extra_layers;
}

static inline uint32_t kvf_layout_tensors(const struct kvf_cache_layout *l)
{
        return l->key_only ? 1u : 2u;
}

/* Byte offset of (layer, tensor, block) in the host cache file. */
static inline uint64_t kvf_layout_offset(const struct kvf_cache_layout *l, uint32_t layer,
                                         uint32_t tensor, uint32_t block)
{
        return (((uint64_t)layer * kvf_layout_tensors(l) + tensor) * l->num_blocks + block) *
               l->block_bytes;
}

/*
 * The layout has three shapes: this one (the control segment's), the engine's
 * (struct kvf_layout_info, include/kvferry.h) and the handshake's (the lay_*
 * fields of struct kvf_record, common/records.h). These four functions are the
 * only places that copy between them; a field added to one shape is added to
 * the others here.
 */
struct kvf_layout_info;
struct kvf_record;

/* The engine's copy of l (kvf_get_layout). */
void kvf_layout_to_info(const struct kvf_cache_layout *l, struct kvf_layout_info *out);
/* *l from an engine's copy, through kvf_layout_make: block_bytes and cache_bytes are computed,
 * not copied. 0 or -EINVAL (kvf_err). */
int kvf_layout_from_info(struct kvf_cache_layout *l, const struct kvf_layout_info *in);
/* l into the lay_* fields of a handshake record (auth, welcome); the other fields untouched. */
void kvf_layout_to_record(const struct kvf_cache_layout *l, struct kvf_record *r);
/* *l from a peer's handshake record: each field checked to fit (-EPROTO, "peer sent an
 * impossible layout"), then kvf_layout_make (-EINVAL). kvf_err says why. */
int kvf_layout_from_record(struct kvf_cache_layout *l, const struct kvf_record *r);

/*
 * Can two instances exchange blocks? Everything but the block count must be
 * equal. Returns 0, or -EPROTO with `why` saying what differs, as
 * "32 layers here, 28 there".
 */
int kvf_layout_compatible(const struct kvf_cache_layout *here, const struct kvf_cache_layout *there,
                          char *why, size_t whylen);

uint32_t kvf_dtype_size(uint32_t dtype);
const char *kvf_dtype_name(uint32_t dtype);
int kvf_dtype_from_name(const char *s);

struct kvf_model {
        const char *name;
        uint32_t layers;
        uint32_t kv_heads; /* all ranks together */
        uint32_t head_dim;
        uint32_t key_only;
        uint32_t dtype;
};

/* Shapes from data/model-shapes.json (tests/models_test checks they agree). */
extern const struct kvf_model kvf_models[];
extern const unsigned kvf_models_count;
const struct kvf_model *kvf_model_find(const char *name);

/* "1.50 GiB" style, into buf. */
const char *kvf_fmt_bytes(uint64_t n, char *buf, size_t len);

#endif
