/*
 * What bench/gpu_tp_bench.c writes into a prefill rank's cache and checks in a decode rank's:
 * each 32-bit word of a head's token row is a function of (request, head, token, word, layer,
 * tensor), so any byte that lands in the wrong block, head, token or layer, or does not land,
 * differs. One definition for the host (host caches) and the GPU (gpu_tp_content.cu).
 */
#ifndef KVF_BENCH_GPU_TP_CONTENT_H
#define KVF_BENCH_GPU_TP_CONTENT_H

#include <stdint.h>

#include "sim_keys.h" /* (kvf_sim_mix, SIM_HD: the host's and the GPU's) */

/* Word w of the row of `token` of `head` in (layer l, tensor z) of request q: two rows that
 * differ in any field differ in every word. */
static inline SIM_HD uint32_t gtp_word(uint32_t q, uint32_t head, uint32_t token, uint32_t w,
                                       uint32_t l, uint32_t z)
{
        uint64_t x = kvf_sim_mix((uint64_t)q << 32 | head);
        x = kvf_sim_mix(x ^ ((uint64_t)token << 32 | w));
        return (uint32_t)kvf_sim_mix(x ^ ((uint64_t)l << 32 | z));
}

/* One block of one request: its id in the cache, the request, the request's token its first
 * row holds and how many of its rows are the request's (the rest are written, not checked). */
struct gtp_desc {
        uint32_t block, req, token0, ntok;
};

/* A rank's tensors: [blocks][heads][block_tokens][row_words] words, its heads from first_head. */
struct gtp_geom {
        uint64_t block_bytes;
        uint32_t heads, first_head, block_tokens, row_words;
};

#ifdef __cplusplus
extern "C" {
#endif
/* The GPU side (gpu_tp_content.cu); every call returns 0 or -1 with gtp_gpu_error() set. */
const char *gtp_gpu_error(void);
int gtp_gpu_open(int device, void **stream);
/* Copy n descriptors to the device (*out: device memory, freed at exit). */
int gtp_gpu_descs(const struct gtp_desc *d, uint32_t n, struct gtp_desc **out);
/* Write every row of the n blocks of tensor (layer l, tensor z), queued on stream. */
int gtp_gpu_fill(void *stream, void *tensor, const struct gtp_desc *dev_descs, uint32_t n,
                 struct gtp_geom g, uint32_t l, uint32_t z);
/* Compare the request's rows of the n blocks; differing words add to a device count. */
int gtp_gpu_check(void *stream, const void *tensor, const struct gtp_desc *dev_descs, uint32_t n,
                  struct gtp_geom g, uint32_t l, uint32_t z);
/* Wait for the stream; *bad: the words that differed since the last call (then reset). */
int gtp_gpu_sync(void *stream, uint64_t *bad);
int gtp_gpu_zero(void *stream, void *ptr, uint64_t bytes);
#ifdef __cplusplus
}
#endif

#endif
