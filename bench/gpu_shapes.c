#include "gpu_shapes.h"

#include "layout.h"

unsigned kvf_bench_models(struct kvf_bench_model *out, unsigned cap)
{
        for (unsigned i = 0; i < kvf_models_count && i < cap; i++) {
                const struct kvf_model *m = &kvf_models[i];
                out[i] =
                    (struct kvf_bench_model){m->name,     m->layers,   m->kv_heads,
                                             m->head_dim, m->key_only, kvf_dtype_size(m->dtype)};
        }
        return kvf_models_count;
}
