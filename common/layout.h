/*
 * Cache layout math: sizes, offsets, compatibility between two instances,
 * dtype names and the model shapes the tools know by name.
 *
 * The host cache file holds, layer after layer, the layer's K tensor then
 * its V tensor (K only when key_only), each [num_blocks, kv_heads,
 * block_size, head_dim] of dtype, so one block of one tensor is block_bytes
 * contiguous bytes. A layout with scale tensors (FastDeploy's block_wise_fp8
 * caches) has, after every layer's K/V, one scale tensor per K/V tensor in
 * the same order, [num_blocks, kv_heads, block_size] of scale_dtype: a block's
 * scales are scale_bytes contiguous bytes, and move with the block.
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

/* The cache's tensors of a layer: K and V, or K only (MLA). */
static inline uint32_t kvf_layout_tensors(const struct kvf_cache_layout *l)
{
        return l->key_only ? 1u : 2u;
}

/* Every tensor a layer moves: its cache tensors, then (when the layout has scales) a scale
 * tensor for each, numbered tensors .. 2 * tensors - 1. */
static inline uint32_t kvf_layout_all_tensors(const struct kvf_cache_layout *l)
{
        return kvf_layout_tensors(l) * (l->scale_bytes ? 2u : 1u);
}

/* Bytes of one block of tensor t (a cache tensor or a scale tensor). */
static inline uint64_t kvf_layout_tensor_bytes(const struct kvf_cache_layout *l, uint32_t t)
{
        return t < kvf_layout_tensors(l) ? l->block_bytes : l->scale_bytes;
}

/* Bytes of one block across every tensor of one layer. */
static inline uint64_t kvf_layout_layer_block_bytes(const struct kvf_cache_layout *l)
{
        return (uint64_t)kvf_layout_tensors(l) * (l->block_bytes + l->scale_bytes);
}

/* Bytes of every layer's K/V tensors: where the scale tensors start. */
static inline uint64_t kvf_layout_kv_bytes(const struct kvf_cache_layout *l)
{
        return (uint64_t)kvf_layout_layers(l) * kvf_layout_tensors(l) * l->num_blocks * l->block_bytes;
}

/*
 * Byte offset of (layer, tensor, block) in the host cache file: every layer's K/V first
 * (layer 0 K, layer 0 V, layer 1 K, ...), then the scale tensors in the same order. A layout
 * without scales has the K/V offsets a layout with them has.
 */
static inline uint64_t kvf_layout_offset(const struct kvf_cache_layout *l, uint32_t layer,
                                         uint32_t tensor, uint32_t block)
{
        uint32_t nt = kvf_layout_tensors(l);
        if (tensor < nt)
                return (((uint64_t)layer * nt + tensor) * l->num_blocks + block) * l->block_bytes;
        return kvf_layout_kv_bytes(l) +
               (((uint64_t)layer * nt + tensor - nt) * l->num_blocks + block) * l->scale_bytes;
}

/* The layout's tensors, each one part of a cache held one allocation per tensor, numbered in
 * kvf_layout_offset order: layers x tensors cache tensors, then as many scale tensors. */
static inline uint32_t kvf_layout_parts(const struct kvf_cache_layout *l)
{
        return kvf_layout_layers(l) * kvf_layout_all_tensors(l);
}

/* Bytes of one block of part i. */
static inline uint64_t kvf_layout_part_block_bytes(const struct kvf_cache_layout *l, uint32_t i)
{
        return i < kvf_layout_layers(l) * kvf_layout_tensors(l) ? l->block_bytes : l->scale_bytes;
}

/* Bytes of part i (its num_blocks blocks). */
static inline uint64_t kvf_layout_part_bytes(const struct kvf_cache_layout *l, uint32_t i)
{
        return (uint64_t)l->num_blocks * kvf_layout_part_block_bytes(l, i);
}

/* The part holding byte `off` of the cache, *rest the offset in it; kvf_layout_parts(l)
 * (one past the last) when off is past the cache. */
static inline uint32_t kvf_layout_part(const struct kvf_cache_layout *l, uint64_t off, uint64_t *rest)
{
        uint64_t kv = kvf_layout_kv_bytes(l), pb = (uint64_t)l->num_blocks * l->block_bytes;
        uint32_t nkv = kvf_layout_layers(l) * kvf_layout_tensors(l), n = kvf_layout_parts(l);
        uint64_t i = off < kv ? off / pb : nkv + (l->scale_bytes ? (off - kv) / (l->num_blocks * l->scale_bytes) : n);
        if (i >= n) {
                *rest = 0;
                return n;
        }
        *rest = off < kv ? off % pb : (off - kv) % (l->num_blocks * l->scale_bytes);
        return (uint32_t)i;
}

/* Give the layout scale tensors of dtype (a block's scales: kv_heads x block_size of it);
 * 0 removes them. Recomputes scale_bytes and cache_bytes. 0 or -EINVAL (kvf_err). */
int kvf_layout_set_scales(struct kvf_cache_layout *l, uint32_t dtype);

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
