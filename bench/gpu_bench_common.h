/*
 * What the two GPU benchmarks share: skipping without a GPU, cache layouts
 * and scattered per-layer runs, a pattern fill and an on-GPU check of
 * copied runs, a gate that holds a stream until everything is queued,
 * percentiles, and %globaltimer against the host clock.
 */
#ifndef KVF_BENCH_GPU_COMMON_H
#define KVF_BENCH_GPU_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <cuda_runtime.h>

#include "kvf_gpu.h"

/* Exit 1 with the call and CUDA's message. */
#define BENCH_CUDA(expr)                                                                           \
        do {                                                                                       \
                cudaError_t _e = (expr);                                                           \
                if (_e != cudaSuccess)                                                             \
                        bench_die("%s:%d: %s: %s (%s)", __FILE__, __LINE__, #expr,                 \
                                  cudaGetErrorString(_e), cudaGetErrorName(_e));                   \
        } while (0)
/* Exit 1 when a kvf_gpu call fails, with its message. */
#define BENCH_KVF(expr)                                                                            \
        do {                                                                                       \
                int _rc = (expr);                                                                  \
                if (_rc < 0)                                                                       \
                        bench_die("%s:%d: %s: %d: %s", __FILE__, __LINE__, #expr, _rc,             \
                                  kvf_gpu_err_msg());                                              \
        } while (0)

void bench_die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

/* No usable GPU: print "<prog>: no GPU: <why>" and exit 77. Else returns the count. */
int bench_require_gpu(const char *prog);

uint64_t bench_now_ns(void);

/* A comma-separated list of positive integers, each times `unit`, into out (at most cap);
 * exits with a message on a bad element. Returns the count. */
unsigned bench_parse_list(const char *s, uint64_t *out, unsigned cap, uint64_t unit);

struct bench_rng {
        uint64_t s;
};
uint64_t bench_rnd(struct bench_rng *r);

/* ---------------------------------------------------------------- layouts and runs */

struct bench_layout {
        uint32_t layers; /* layers + extra layers */
        uint32_t tensors;
        uint32_t blocks; /* per tensor */
        uint64_t block_bytes;
};

static inline uint64_t bench_off(const struct bench_layout *l, uint32_t layer, uint32_t t,
                                 uint32_t b)
{
        return (((uint64_t)layer * l->tensors + t) * l->blocks + b) * l->block_bytes;
}
static inline uint64_t bench_cache_bytes(const struct bench_layout *l)
{
        return (uint64_t)l->layers * l->tensors * l->blocks * l->block_bytes;
}

/*
 * The runs of one layer for `nreq` requests sharing `blocks` blocks per
 * tensor: source and destination block ids are two random permutations of
 * the layout's blocks (scattered, as a paged cache is after a while),
 * request q takes the q-th slice; every tensor; runs contiguous on both
 * sides merged. Region 0 on both sides. Returns the run count; *out is
 * malloc'd.
 */
size_t bench_layer_runs(const struct bench_layout *l, uint32_t layer, uint32_t nreq,
                        uint32_t blocks, uint64_t seed, struct kvf_gpu_run **out);

/* Fill device memory with a position-dependent pattern (no two 8-byte words
 * of one fill alike), on `stream`. */
void bench_fill(void *dev, uint64_t bytes, uint64_t seed, cudaStream_t stream);

/* Count the 16-byte words (and tail bytes) where a run's destination differs
 * from its source, on the GPU; synchronises. 0 means every byte landed. */
uint64_t bench_verify_runs(const struct kvf_gpu_run *runs, size_t n,
                           const struct kvf_gpu_region *src, uint32_t n_src,
                           const struct kvf_gpu_region *dst, uint32_t n_dst);

/* ---------------------------------------------------------------- a gate for streams */

/*
 * A one-thread kernel that holds its stream until bench_gate_open(), so
 * that work queued behind it runs back to back at GPU speed and events
 * around each piece time the GPU alone (not the host's enqueueing). Gives
 * up after 5 s (then bench_gate_open reports it and the timings are void).
 */
struct bench_gate;
struct bench_gate *bench_gate_create(void);
void bench_gate_close(struct bench_gate *g, cudaStream_t stream);
/* Opens; returns 0, or -1 if the gate had timed out already. */
int bench_gate_open(struct bench_gate *g);
void bench_gate_destroy(struct bench_gate *g);

/* ---------------------------------------------------------------- statistics */

struct bench_pct {
        size_t n;
        double p50, p99, max, min, mean;
};
/* Sorts `v` in place. NaN entries (no sample) are dropped. */
struct bench_pct bench_percentiles(double *v, size_t n);

/* ---------------------------------------------------------------- clocks */

/*
 * %globaltimer (a GPU-wide nanosecond counter, the same for every context on
 * the device) against CLOCK_MONOTONIC (the same for every process of the
 * host), measured like NTP: the host writes a ping into mapped host memory
 * and notes h0, a kernel spinning on that memory reads %globaltimer the
 * moment it sees the ping and writes it back with a pong, the host notes h1
 * when it sees the pong. The GPU's reading lies within [h0, h1]; the
 * midpoint is taken, so the error is at most (h1 - h0) / 2, and the ping
 * with the smallest round trip of `rounds` is kept. Two such points, before
 * and after a measurement, give offset and drift (linear).
 * Run it on an idle GPU: the kernel needs an SM at once.
 */
struct bench_clock_point {
        uint64_t g, h; /* GPU and host time of the same instant */
        uint64_t rtt;  /* round trip of the best ping: the error bound is rtt / 2 */
};
struct bench_clock_point bench_clock_measure(int rounds);

struct bench_clock_map {
        struct bench_clock_point a, b;
};
/* Host nanoseconds of GPU time g. */
double bench_clock_to_host(const struct bench_clock_map *m, uint64_t g);

/* Smallest step of %globaltimer seen (ns): its resolution on this GPU. */
uint64_t bench_globaltimer_step(void);

/* One line describing the device, for the report headers. */
void bench_describe_device(int dev, char *buf, size_t len);

/* JSON string escaping for names (they are plain ASCII here). */
void bench_json_str(FILE *f, const char *s);

#endif
