/*
 * The model shapes the tools know (common/layout.c, checked against
 * data/model-shapes.json by tests/models_test.sh), for the GPU benchmarks,
 * whose CUDA C++ cannot include the C-only layout header.
 */
#ifndef KVF_BENCH_GPU_SHAPES_H
#define KVF_BENCH_GPU_SHAPES_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct kvf_bench_model {
        const char *name;
        uint32_t layers;
        uint32_t kv_heads; /* all ranks together */
        uint32_t head_dim;
        uint32_t key_only;
        uint32_t elem_bytes;
};

/* Block size in tokens of the shapes file. */
#define KVF_BENCH_BLOCK_TOKENS 64u

/* Fills up to `cap` models; returns how many there are. */
unsigned kvf_bench_models(struct kvf_bench_model *out, unsigned cap);

#ifdef __cplusplus
}
#endif

#endif
