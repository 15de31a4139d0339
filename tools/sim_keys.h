/*
 * kvf-sim's content keys, one definition for the host (sim_verify.c, sim_tp.c) and the GPU
 * (sim_gpu.cu's kernels): a key names what a block, or a head's rows, must hold, so the side
 * that writes and the side that checks make the same key wherever they run.
 */
#ifndef KVF_SIM_KEYS_H
#define KVF_SIM_KEYS_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __CUDACC__
#define SIM_HD __host__ __device__
#else
#define SIM_HD
#endif

static inline SIM_HD uint64_t kvf_sim_mix(uint64_t x)
{
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdull;
        x ^= x >> 33;
        x *= 0xc4ceb9fe1a85ec53ull;
        x ^= x >> 33;
        return x;
}

/* The content of block j (in request token order) of one tensor; `partial` for a block a chunk
 * leaves unfinished. */
static inline SIM_HD uint64_t kvf_sim_block_key(uint32_t seq, unsigned rank, uint32_t layer, uint32_t t,
                                                uint32_t j, bool partial)
{
        return kvf_sim_mix(((uint64_t)seq << 20) ^ ((uint64_t)rank << 56) ^ ((uint64_t)layer << 40) ^
                           ((uint64_t)t << 39) ^ j ^ ((uint64_t)partial << 62));
}

/* Mixed mode: the key of one head's rows (tools/sim_tp.c). Each token's row is keyed head key +
 * token * SIM_GPU_ROW_STEP, so two tokens' rows differ in every word (and heads, layers,
 * tensors, requests, and rows a chunk left unfinished, by their mixed head key). */
static inline SIM_HD uint64_t kvf_sim_head_key(uint32_t seq, uint32_t head, uint32_t l, uint32_t t,
                                               bool partial)
{
        return kvf_sim_mix(kvf_sim_block_key(seq, head, l, t, 0, partial) ^ 0x5851f42d4c957f2dull);
}

#endif
