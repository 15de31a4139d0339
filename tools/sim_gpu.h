/*
 * kvf-sim's GPU mode (kvf-sim --gpu, or instances whose caches are on a GPU):
 * the engine's work on the GPU, in tools/sim_gpu.cu (tools/sim_gpu_none.c in
 * a build without CUDA: every call fails, saying so).
 *
 * Prefill: per rank and layer, one kernel writes the layer's deterministic
 * content into the blocks queued with sim_gpu_fill (the pattern of
 * tools/sim_verify.c: word k of a block with key K is K + k * 0x9e3779b97f4a7c15)
 * while keeping every SM busy for --layer-us (waves of 2 x 1024-thread
 * blocks per SM, each block living about 10 us, as an engine's tiles do),
 * then kvf_layer_done_on_stream() on the same stream. The host never waits
 * for the GPU inside a step; sim_gpu_step_end() waits at its end, as an
 * engine does before sampling.
 * Decode: sim_gpu_expect queues blocks with their keys, sim_gpu_check
 * compares every byte on the GPU and counts the blocks that differ.
 * Mixed mode (other tensor-parallel sizes or block sizes on the two sides):
 * the same kernels, with a queue entry per block for the rank's heads, each
 * head's rows (one per token) keyed by head and token on the GPU
 * (sim_gpu_fill_heads, sim_gpu_expect_heads), so the content is what host
 * mixed mode writes and checks, whichever rank holds it.
 *
 * Single-threaded (kvf-sim's main thread). Functions return >= 0, or -1
 * after printing why on stderr.
 */
#ifndef KVF_SIM_GPU_H
#define KVF_SIM_GPU_H

#include <stdbool.h>
#include <stdint.h>

#include "kvferry.h"

#ifdef __cplusplus
extern "C" {
#endif

struct sim_gpu;

/* The key step from one token's row to the next in mixed mode (tools/sim_tp.c row_key). */
#define SIM_GPU_ROW_STEP 0xd1342543de82ef95ull

/* GPUs of the prefill and decode members (kvf_cache_device of each): `ranks` prefill ranks,
 * `dranks` decode ranks (other sizes in mixed mode). default_stream: the prefill side's work goes
 * on the legacy default stream (NULL) instead of a stream of its own. */
int sim_gpu_open(struct sim_gpu **out, unsigned ranks, unsigned dranks, const int *prefill_dev,
                 const int *decode_dev, unsigned layer_us, bool default_stream, bool timeline);
/* With `timeline`: after sim_gpu_step_end, when rank 0's last layer was launched (after its
 * kvf_layer_done_on_stream returned) and when a host function queued after it ran. */
void sim_gpu_step_times(const struct sim_gpu *g, uint64_t *launched_ns, uint64_t *hostfn_ns);
void sim_gpu_close(struct sim_gpu *g);

/* Prefill: block `ptr` (device memory) of `bytes` gets the pattern of `key` in rank's next layer. */
int sim_gpu_fill(struct sim_gpu *g, unsigned rank, void *ptr, uint64_t bytes, uint64_t key);
/* Mixed mode, one entry per block: `heads` heads of the model from head0 (the rank's), each
 * `rows` rows (tokens) of row_bytes, one after another from ptr; head h's row r holds the
 * pattern of kvf_sim_head_key(seq, head0 + h, layer, tensor, r >= split) + (t0 + r) *
 * SIM_GPU_ROW_STEP (word k of a row: + k * the pattern's step), the keys made on the GPU (one
 * entry per block, not per head: the host's work per block is that of equal layouts). Rows of
 * a multiple of 8 bytes. */
struct sim_gpu_heads {
        uint32_t seq, head0, heads, layer, tensor;
        uint32_t rows, split, t0;
        uint64_t row_bytes;
};
int sim_gpu_fill_heads(struct sim_gpu *g, unsigned rank, void *ptr, const struct sim_gpu_heads *h);
int sim_gpu_expect_heads(struct sim_gpu *g, unsigned rank, const void *ptr, const struct sim_gpu_heads *h);

/* Launch rank's layer kernel (what sim_gpu_fill queued), keeping every SM busy for layer_ns, then
 * kvf_layer_done_on_stream(c, step, layer). */
int sim_gpu_layer(struct sim_gpu *g, unsigned rank, struct kvf_client *c, uint64_t step, uint32_t layer,
                  uint64_t layer_ns);
/* End of a step: wait for every rank's stream. *last_ns: when rank 0's last layer ended on the
 * GPU, as CLOCK_MONOTONIC of this host (0 if unknown). */
int sim_gpu_step_end(struct sim_gpu *g, uint64_t *last_ns);

/* Decode: queue block `ptr` of `bytes`, expected to hold the pattern of `key`. */
/* The largest correction of the GPU clock's mapping to ours at a recalibration (every second):
 * how far a GPU end time may be off. */
uint64_t sim_gpu_clock_drift(const struct sim_gpu *g);
/* The time this process spent waiting for the GPU so far (stream synchronizations), ns. */
uint64_t sim_gpu_wait_ns(const struct sim_gpu *g);
int sim_gpu_expect(struct sim_gpu *g, unsigned rank, const void *ptr, uint64_t bytes, uint64_t key);
/* Copy `bytes` of decode rank's device memory at ptr into out (host): 0 or -1. */
int sim_gpu_read(struct sim_gpu *g, unsigned rank, const void *ptr, uint64_t bytes, void *out);
/* Compare what rank's queue holds, on the GPU: the number of blocks that differ (the queue is
 * emptied), *first_bad the queue index of the first of them. */
long sim_gpu_check(struct sim_gpu *g, unsigned rank, uint64_t *first_bad);

/* One bulk device-to-device copy of `bytes` on prefill rank 0's GPU: bytes per second (the
 * reference for one layer's copy time). */
double sim_gpu_copy_rate(struct sim_gpu *g, uint64_t bytes);

#ifdef __cplusplus
}
#endif

#endif
