#include "layout.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "err.h"
#include "kvferry.h"
#include "records.h"

static const struct {
        const char *name;
        uint32_t size;
} dtypes[] = {[KVF_DTYPE_BF16] = {"bf16", 2},
              [KVF_DTYPE_FP16] = {"fp16", 2},
              [KVF_DTYPE_FP8] = {"fp8", 1},
              [KVF_DTYPE_UINT8] = {"uint8", 1},
              [KVF_DTYPE_FP32] = {"fp32", 4}};

uint32_t kvf_dtype_size(uint32_t dtype)
{
        return dtype >= KVF_DTYPE_BF16 && dtype <= KVF_DTYPE_FP32 ? dtypes[dtype].size : 0;
}

const char *kvf_dtype_name(uint32_t dtype)
{
        return dtype >= KVF_DTYPE_BF16 && dtype <= KVF_DTYPE_FP32 ? dtypes[dtype].name : "?";
}

int kvf_dtype_from_name(const char *s)
{
        for (int d = KVF_DTYPE_BF16; d <= KVF_DTYPE_FP32; d++)
                if (!strcmp(s, dtypes[d].name))
                        return d;
        if (!strcmp(s, "bfloat16"))
                return KVF_DTYPE_BF16;
        if (!strcmp(s, "float16"))
                return KVF_DTYPE_FP16;
        if (!strcmp(s, "float32"))
                return KVF_DTYPE_FP32;
        return -1;
}

int kvf_layout_make(struct kvf_cache_layout *l, uint32_t layers, uint32_t extra_layers,
                    uint32_t blocks, uint32_t kv_heads, uint32_t block_size, uint32_t head_dim,
                    uint32_t dtype, uint32_t key_only)
{
        memset(l, 0, sizeof(*l));
        if (layers == 0 || (uint64_t)layers + extra_layers > KVF_MAX_LAYERS)
                return kvf_err_set(-EINVAL, "layers (%u) + extra layers (%u) must be 1 to %u",
                                   layers, extra_layers, KVF_MAX_LAYERS);
        if (blocks == 0 || kv_heads == 0 || block_size == 0 || head_dim == 0)
                return kvf_err_set(-EINVAL,
                                   "blocks (%u), kv heads (%u), block size (%u) and head dim (%u) must all be positive",
                                   blocks, kv_heads, block_size, head_dim);
        if (kvf_dtype_size(dtype) == 0)
                return kvf_err_set(-EINVAL, "unknown dtype %u (bf16, fp16, fp8, uint8, fp32)", dtype);
        uint64_t bb = (uint64_t)kv_heads * block_size * head_dim * kvf_dtype_size(dtype);
        if (bb > (1ull << 32))
                return kvf_err_set(-EINVAL, "a block of %llu bytes is too large",
                                   (unsigned long long)bb);
        l->num_layers = layers;
        l->extra_layers = extra_layers;
        l->num_blocks = blocks;
        l->kv_heads = kv_heads;
        l->block_size = block_size;
        l->head_dim = head_dim;
        l->dtype = dtype;
        l->key_only = key_only ? 1 : 0;
        l->block_bytes = bb;
        l->cache_bytes = (uint64_t)kvf_layout_layers(l) * kvf_layout_tensors(l) * blocks * bb;
        return 0;
}

int kvf_layout_set_scales(struct kvf_cache_layout *l, uint32_t dtype)
{
        if (dtype != 0 && kvf_dtype_size(dtype) == 0)
                return kvf_err_set(-EINVAL, "unknown scale dtype %u (bf16, fp16, fp8, uint8, fp32)", dtype);
        l->scale_dtype = dtype;
        l->scale_bytes = dtype ? (uint64_t)l->kv_heads * l->block_size * kvf_dtype_size(dtype) : 0;
        l->cache_bytes = kvf_layout_kv_bytes(l) +
                         (uint64_t)kvf_layout_layers(l) * kvf_layout_tensors(l) * l->num_blocks * l->scale_bytes;
        return 0;
}

/* The engine's shape has the same fields: one added to one shape only fails here. */
_Static_assert(sizeof(struct kvf_layout_info) == sizeof(struct kvf_cache_layout),
               "kvf_layout_info and kvf_cache_layout differ: update the conversions below");

void kvf_layout_to_info(const struct kvf_cache_layout *l, struct kvf_layout_info *out)
{
        out->num_layers = l->num_layers;
        out->extra_layers = l->extra_layers;
        out->num_blocks = l->num_blocks;
        out->kv_heads = l->kv_heads;
        out->block_size = l->block_size;
        out->head_dim = l->head_dim;
        out->dtype = l->dtype;
        out->key_only = l->key_only;
        out->block_bytes = l->block_bytes;
        out->cache_bytes = l->cache_bytes;
        out->scale_dtype = l->scale_dtype;
        out->reserved = 0;
        out->scale_bytes = l->scale_bytes;
}

int kvf_layout_from_info(struct kvf_cache_layout *l, const struct kvf_layout_info *in)
{
        int rc = kvf_layout_make(l, in->num_layers, in->extra_layers, in->num_blocks, in->kv_heads,
                                 in->block_size, in->head_dim, in->dtype, in->key_only);
        return rc < 0 ? rc : kvf_layout_set_scales(l, in->scale_dtype);
}

void kvf_layout_to_record(const struct kvf_cache_layout *l, struct kvf_record *r)
{
        r->lay_layers = l->num_layers;
        r->lay_extra = l->extra_layers;
        r->lay_blocks = l->num_blocks;
        r->lay_heads = l->kv_heads;
        r->lay_bsize = l->block_size;
        r->lay_hdim = l->head_dim;
        r->lay_dtype = l->dtype;
        r->lay_keyonly = l->key_only;
        r->lay_scale_dtype = l->scale_dtype;
}

int kvf_layout_from_record(struct kvf_cache_layout *l, const struct kvf_record *r)
{
        /* Hostile input: every count must fit its 32-bit field before kvf_layout_make checks it. */
        if (r->lay_layers > KVF_MAX_LAYERS || r->lay_extra > KVF_MAX_LAYERS ||
            r->lay_blocks > UINT32_MAX || r->lay_heads > UINT32_MAX || r->lay_bsize > UINT32_MAX ||
            r->lay_hdim > UINT32_MAX || r->lay_dtype > UINT32_MAX || r->lay_scale_dtype > UINT32_MAX)
                return kvf_err_set(-EPROTO, "peer sent an impossible layout");
        int rc = kvf_layout_make(l, (uint32_t)r->lay_layers, (uint32_t)r->lay_extra,
                                 (uint32_t)r->lay_blocks, (uint32_t)r->lay_heads,
                                 (uint32_t)r->lay_bsize, (uint32_t)r->lay_hdim,
                                 (uint32_t)r->lay_dtype, r->lay_keyonly ? 1 : 0);
        return rc < 0 ? rc : kvf_layout_set_scales(l, (uint32_t)r->lay_scale_dtype);
}

int kvf_layout_compatible(const struct kvf_cache_layout *a, const struct kvf_cache_layout *b,
                          char *why, size_t whylen)
{
#define DIFF(field, what)                                                                          \
        if (a->field != b->field) {                                                                \
                snprintf(why, whylen, "%u " what " here, %u there", a->field, b->field);           \
                return -EPROTO;                                                                    \
        }
        DIFF(num_layers, "layers");
        DIFF(extra_layers, "extra (speculative) layers");
        DIFF(kv_heads, "kv heads");
        DIFF(block_size, "tokens per block");
        DIFF(head_dim, "head dim");
        DIFF(key_only, "key-only flag");
#undef DIFF
        if (a->dtype != b->dtype) {
                snprintf(why, whylen, "dtype %s here, %s there", kvf_dtype_name(a->dtype),
                         kvf_dtype_name(b->dtype));
                return -EPROTO;
        }
        if (a->scale_dtype != b->scale_dtype) {
                snprintf(why, whylen, "%s scale tensors here, %s there",
                         a->scale_dtype ? kvf_dtype_name(a->scale_dtype) : "no",
                         b->scale_dtype ? kvf_dtype_name(b->scale_dtype) : "no");
                return -EPROTO;
        }
        if (a->block_bytes != b->block_bytes) {
                snprintf(why, whylen, "%llu-byte blocks here, %llu there",
                         (unsigned long long)a->block_bytes, (unsigned long long)b->block_bytes);
                return -EPROTO;
        }
        if (why && whylen)
                why[0] = '\0';
        return 0;
}

const struct kvf_model kvf_models[] = {
        {"llama-3.1-8b", 32, 8, 128, 0, KVF_DTYPE_BF16},
        {"llama-3.1-70b", 80, 8, 128, 0, KVF_DTYPE_BF16},
        {"qwen2.5-72b", 80, 8, 128, 0, KVF_DTYPE_BF16},
        {"deepseek-v3-mla", 61, 1, 576, 1, KVF_DTYPE_BF16},
};
const unsigned kvf_models_count = sizeof(kvf_models) / sizeof(kvf_models[0]);

const struct kvf_model *kvf_model_find(const char *name)
{
        for (unsigned i = 0; i < kvf_models_count; i++)
                if (!strcmp(kvf_models[i].name, name))
                        return &kvf_models[i];
        return NULL;
}

const char *kvf_fmt_bytes(uint64_t n, char *buf, size_t len)
{
        static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
        double v = (double)n;
        unsigned u = 0;
        while (v >= 1024 && u < 4) {
                v /= 1024;
                u++;
        }
        if (u == 0)
                snprintf(buf, len, "%llu B", (unsigned long long)n);
        else
                snprintf(buf, len, "%.2f %s", v, units[u]);
        return buf;
}
