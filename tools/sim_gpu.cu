/*
 * kvf-sim's GPU mode: see tools/sim_gpu.h.
 *
 * Descriptors {block address, words, key} go into mapped pinned host memory
 * that the kernels read directly: the host never waits for the GPU to queue
 * a layer (a copy from pageable memory may wait for the stream), and the
 * arena is reused only after the step's sync (or after a sync when a step
 * outgrows it).
 *
 * Time: each layer kernel stamps its end (%globaltimer, atomicMax over its
 * blocks) into a word per rank; after the step's sync, rank 0's word is the
 * step's last layer end, converted to this host's CLOCK_MONOTONIC by a
 * ping through mapped memory (the GPU spins on a host word, stamps the moment
 * it changes; the fastest of 32 round trips is kept; redone every second
 * against drift). The error is about half that round trip, a microsecond or
 * two, printed by kvf-sim with the tails.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

#include "sim_gpu.h"
#include "sim_keys.h"

#define MAX_RANKS 8
#define BLOCK_US 10u       /* how long one block of a busy layer lives */
#define ARENA_INIT (1u << 20)
#define CALIB_ROUNDS 32
#define CALIB_EVERY_NS 1000000000ull
#define SPIN_TIMEOUT_NS 2000000000ull
#define PATTERN_STEP 0x9e3779b97f4a7c15ull /* tools/sim_verify.c pattern(): word k = key + k * this */

/* heads 0: words from ptr hold the pattern of key (equal layouts); heads > 0: a block's heads
 * (struct sim_gpu_heads, mixed mode), `words` words each in rows of rw, one after the other from
 * ptr, their keys made on the GPU (key unused) */
struct desc {
        unsigned long long ptr, words, key, rw;
        unsigned seq, head0, heads, layer, tensor, split, t0, pad;
};

struct side {
        int dev;
        int sms;
        cudaStream_t s;     /* NULL: the legacy default stream (--gpu-default-stream) */
        bool own_stream;
        struct desc *host;  /* mapped pinned arena */
        struct desc *dmap;  /* its device alias */
        size_t cap, used;   /* descriptors; [start, used) is the current batch */
        size_t start;
        bool heads;         /* the batch is heads entries (mixed mode: heads_kernel writes them) */
        unsigned long long *d_words; /* device: [0] layer end stamp (prefill) / bad count, [1] first bad */
        unsigned long long *h_words; /* pinned copy */
};

struct sim_gpu {
        unsigned ranks, dranks, layer_us; /* prefill ranks, decode ranks */
        struct side pre[MAX_RANKS], dec[MAX_RANKS];
        /* clock: a GPU time g and the host time h it corresponds to (prefill rank 0's GPU) */
        uint32_t *clk_host, *clk_dev;
        unsigned long long clk_g, clk_h, clk_rtt, clk_at;
        unsigned long long clk_drift_max; /* the largest correction a recalibration made */
        unsigned long long wait_ns;       /* spent in stream synchronizations (sync()) */
        bool timeline;
        uint64_t launched_ns;         /* rank 0's latest layer, launched */
        volatile uint64_t hostfn_ns;  /* ... and a host function queued after it ran */
};

static unsigned long long now_ns(void)
{
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}

/* A stream synchronization, its wait counted in g->wait_ns. */
static cudaError_t sync(struct sim_gpu *g, cudaStream_t s)
{
        unsigned long long t0 = now_ns();
        cudaError_t e = cudaStreamSynchronize(s);
        g->wait_ns += now_ns() - t0;
        return e;
}

static int cuda_fail(cudaError_t e, const char *what)
{
        fprintf(stderr, "kvf-sim: GPU: %s: %s (%s)\n", what, cudaGetErrorString(e), cudaGetErrorName(e));
        return -1;
}

#define CK(call, what)                                                                             \
        do {                                                                                       \
                cudaError_t e_ = (call);                                                           \
                if (e_ != cudaSuccess)                                                             \
                        return cuda_fail(e_, what);                                                \
        } while (0)

__device__ static inline unsigned long long gtimer(void)
{
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        return t;
}

/*
 * Rows of rw words (mixed mode): word k holds key + (k / rw) * SIM_GPU_ROW_STEP + (k % rw) *
 * PATTERN_STEP. A thread visits k = threadIdx.x, + blockDim.x, ...: it divides once for its
 * first word, then steps its column (and row, on a wrap) by blockDim.x words: an add or two per
 * word, as the equal layouts' pattern costs, where a 64-bit division and remainder per word
 * cost tens of instructions and would charge the simulator's work to the rows of other splits.
 */
struct row_walk {
        unsigned long long v;     /* the current word's value */
        unsigned col, rw, scol;   /* its column, the row's words, the column step */
        unsigned long long dstep; /* the value's step without a wrap */
};

/* The walk from word k0 (< 2^32) of rows keyed from `key`. */
__device__ static inline struct row_walk walk_start(unsigned long long key, unsigned rw, unsigned k0)
{
        struct row_walk a;
        a.rw = rw;
        a.col = k0 % rw;
        a.scol = blockDim.x % rw;
        a.v = key + (unsigned long long)(k0 / rw) * SIM_GPU_ROW_STEP + a.col * PATTERN_STEP;
        a.dstep = (unsigned long long)(blockDim.x / rw) * SIM_GPU_ROW_STEP + a.scol * PATTERN_STEP;
        return a;
}

/* This thread's first word at or after `from` (its words are threadIdx.x + j * blockDim.x). */
__device__ static inline unsigned first_word(unsigned from)
{
        return from <= threadIdx.x ? threadIdx.x
                                   : threadIdx.x + (from - threadIdx.x + blockDim.x - 1) / blockDim.x * blockDim.x;
}

__device__ static inline void walk_next(struct row_walk *a)
{
        a->v += a->dstep;
        a->col += a->scol;
        if (a->col >= a->rw) { /* into the next row: one row on, rw columns back */
                a->col -= a->rw;
                a->v += SIM_GPU_ROW_STEP - (unsigned long long)a->rw * PATTERN_STEP;
        }
}

/* The key of head h of a heads entry's first row (token t0), full or partial. */
__device__ static inline unsigned long long entry_key(const struct desc *d, unsigned h, bool partial)
{
        return kvf_sim_head_key(d->seq, d->head0 + h, d->layer, d->tensor, partial) +
               (unsigned long long)d->t0 * SIM_GPU_ROW_STEP;
}

/*
 * One wave's block: write a share of the layer's blocks, then stay on its SM
 * until block_ns after it started; the layer's end is the last block's end.
 */
__global__ void __launch_bounds__(1024, 2)
    layer_kernel(const struct desc *d, unsigned n, unsigned long long block_ns, unsigned long long *end)
{
        unsigned long long t0 = gtimer();
        for (unsigned i = blockIdx.x; i < n; i += gridDim.x) {
                unsigned long long *w = (unsigned long long *)d[i].ptr;
                unsigned long long key = d[i].key, words = d[i].words;
                for (unsigned long long k = threadIdx.x; k < words; k += blockDim.x)
                        w[k] = key + k * PATTERN_STEP;
        }
        while (gtimer() - t0 < block_ns) {
        }
        __syncthreads();
        if (threadIdx.x == 0)
                atomicMax(end, gtimer());
}

/*
 * Mixed mode's layer content: heads entries (each head's rows below split with its key, the rest
 * with its partial key; an entry's words < 2^32: a block), in a kernel of its own ahead of the
 * layer kernel, which then only keeps the SMs busy (its register budget, 32 a thread for two
 * 1024-thread blocks per SM, leaves no room for the keys).
 */
__global__ void heads_kernel(const struct desc *d, unsigned n)
{
        for (unsigned i = blockIdx.x; i < n; i += gridDim.x) {
                unsigned long long *w = (unsigned long long *)d[i].ptr;
                unsigned hw = (unsigned)d[i].words, rw = (unsigned)d[i].rw, sw = d[i].split * rw;
                for (unsigned h = 0; h < d[i].heads; h++, w += hw) {
                        struct row_walk a = walk_start(entry_key(&d[i], h, false), rw, threadIdx.x);
                        unsigned k = threadIdx.x;
                        for (; k < sw; k += blockDim.x, walk_next(&a))
                                w[k] = a.v;
                        a = walk_start(entry_key(&d[i], h, true), rw, first_word(sw));
                        for (k = first_word(sw); k < hw; k += blockDim.x, walk_next(&a))
                                w[k] = a.v;
                }
        }
}

__global__ void check_kernel(const struct desc *d, unsigned n, unsigned long long *res)
{
        for (unsigned i = blockIdx.x; i < n; i += gridDim.x) {
                const unsigned long long *w = (const unsigned long long *)d[i].ptr;
                unsigned long long key = d[i].key, words = d[i].words, rw = d[i].rw;
                int bad = 0;
                if (d[i].heads) {
                        unsigned hw = (unsigned)words, sw = d[i].split * (unsigned)rw;
                        for (unsigned h = 0; h < d[i].heads; h++, w += hw) {
                                struct row_walk a = walk_start(entry_key(&d[i], h, false), (unsigned)rw, threadIdx.x);
                                unsigned k = threadIdx.x;
                                for (; k < sw; k += blockDim.x, walk_next(&a))
                                        bad |= w[k] != a.v;
                                a = walk_start(entry_key(&d[i], h, true), (unsigned)rw, first_word(sw));
                                for (k = first_word(sw); k < hw; k += blockDim.x, walk_next(&a))
                                        bad |= w[k] != a.v;
                        }
                } else {
                        for (unsigned long long k = threadIdx.x; k < words; k += blockDim.x)
                                bad |= w[k] != key + k * PATTERN_STEP;
                }
                if (__syncthreads_or(bad) && threadIdx.x == 0) {
                        atomicAdd(&res[0], 1ull);
                        atomicMin(&res[1], (unsigned long long)i);
                }
        }
}

/* w[0]: ping (host -> GPU), w[1]: pong (GPU -> host), w[2..3]: the GPU's time at the ping. */
__global__ void clock_kernel(uint32_t *w, int rounds)
{
        unsigned long long *g = (unsigned long long *)(w + 2);
        for (int i = 1; i <= rounds; i++) {
                unsigned long long t0 = gtimer(), t;
                uint32_t v;
                do {
                        asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(&w[0]) : "memory");
                        if (gtimer() - t0 > SPIN_TIMEOUT_NS)
                                return;
                } while (v != (uint32_t)i);
                t = gtimer();
                asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(g), "l"(t) : "memory");
                asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(&w[1]), "r"((uint32_t)i) : "memory");
        }
}

static int calibrate(struct sim_gpu *g)
{
        struct side *p = &g->pre[0];
        unsigned long long old_g = g->clk_g, old_h = g->clk_h;
        CK(cudaSetDevice(p->dev), "cudaSetDevice");
        memset(g->clk_host, 0, 64);
        clock_kernel<<<1, 1, 0, p->s>>>(g->clk_dev, CALIB_ROUNDS);
        CK(cudaGetLastError(), "clock kernel");
        unsigned long long best = ~0ull;
        for (int i = 1; i <= CALIB_ROUNDS; i++) {
                unsigned long long h0 = now_ns(), until = h0 + SPIN_TIMEOUT_NS;
                /* Release/acquire: pair with the kernel's acquire load and release stores. */
                __atomic_store_n(&g->clk_host[0], (uint32_t)i, __ATOMIC_RELEASE);
                while (__atomic_load_n(&g->clk_host[1], __ATOMIC_ACQUIRE) != (uint32_t)i)
                        if (now_ns() > until) {
                                fprintf(stderr, "kvf-sim: GPU clock calibration: no answer to ping %d\n", i);
                                return -1;
                        }
                unsigned long long h1 = now_ns();
                unsigned long long gt = __atomic_load_n((unsigned long long *)(g->clk_host + 2), __ATOMIC_ACQUIRE);
                if (h1 - h0 < best) {
                        best = h1 - h0;
                        g->clk_g = gt;
                        g->clk_h = h0 + (h1 - h0) / 2;
                }
        }
        CK(cudaStreamSynchronize(p->s), "clock calibration");
        if (g->clk_at) { /* how far the old mapping had drifted: the GPU's time against ours */
                long long d = (long long)(g->clk_g - old_g) - (long long)(g->clk_h - old_h);
                unsigned long long a = (unsigned long long)(d < 0 ? -d : d);
                if (a > g->clk_drift_max)
                        g->clk_drift_max = a;
        }
        g->clk_rtt = best;
        g->clk_at = now_ns();
        return 0;
}

static int side_init(struct side *x, int dev, bool prefill, bool default_stream)
{
        x->dev = dev;
        CK(cudaSetDevice(dev), "cudaSetDevice");
        CK(cudaDeviceGetAttribute(&x->sms, cudaDevAttrMultiProcessorCount, dev), "multiprocessor count");
        /* The engine's stream: normal priority (kvferry's copies take the highest); or the
         * legacy default stream, as an engine that never made one works (PyTorch). */
        if (!(prefill && default_stream)) {
                CK(cudaStreamCreateWithFlags(&x->s, cudaStreamNonBlocking), "cudaStreamCreate");
                x->own_stream = true;
        }
        x->cap = ARENA_INIT;
        CK(cudaHostAlloc((void **)&x->host, x->cap * sizeof(struct desc), cudaHostAllocMapped | cudaHostAllocPortable),
           "cudaHostAlloc (descriptors)");
        CK(cudaHostGetDevicePointer((void **)&x->dmap, x->host, 0), "cudaHostGetDevicePointer");
        CK(cudaMalloc((void **)&x->d_words, 2 * sizeof(unsigned long long)), "cudaMalloc");
        CK(cudaHostAlloc((void **)&x->h_words, 2 * sizeof(unsigned long long), cudaHostAllocPortable), "cudaHostAlloc");
        if (prefill)
                CK(cudaMemsetAsync(x->d_words, 0, 2 * sizeof(unsigned long long), x->s), "cudaMemset");
        return 0;
}

static void side_free(struct side *x)
{
        if (!x->host && !x->own_stream)
                return;
        cudaSetDevice(x->dev);
        cudaStreamSynchronize(x->s);
        if (x->own_stream)
                cudaStreamDestroy(x->s);
        cudaFreeHost(x->host);
        cudaFree(x->d_words);
        cudaFreeHost(x->h_words);
        memset(x, 0, sizeof(*x));
}

extern "C" int sim_gpu_open(struct sim_gpu **out, unsigned ranks, unsigned dranks, const int *prefill_dev,
                            const int *decode_dev, unsigned layer_us, bool default_stream, bool timeline)
{
        struct sim_gpu *g = (struct sim_gpu *)calloc(1, sizeof(*g));
        *out = NULL;
        if (!g || ranks > MAX_RANKS || dranks > MAX_RANKS) {
                free(g);
                fprintf(stderr, "kvf-sim: GPU mode: out of memory or too many ranks\n");
                return -1;
        }
        g->ranks = ranks;
        g->dranks = dranks;
        g->layer_us = layer_us;
        g->timeline = timeline;
        for (unsigned k = 0; k < ranks || k < dranks; k++)
                if ((k < ranks && side_init(&g->pre[k], prefill_dev[k], true, default_stream) < 0) ||
                    (k < dranks && side_init(&g->dec[k], decode_dev[k], false, false) < 0)) {
                        sim_gpu_close(g);
                        return -1;
                }
        /* Load every kernel now: CUDA loads a module at its first launch, which holds up this
         * process's other CUDA work (the layer-done host functions too) for milliseconds; an
         * engine that serves has long done so. */
        const void *const kernels[] = {(const void *)layer_kernel, (const void *)check_kernel,
                                       (const void *)clock_kernel, (const void *)heads_kernel};
        for (unsigned i = 0; i < sizeof(kernels) / sizeof(kernels[0]); i++) {
                struct cudaFuncAttributes a;
                if (cudaFuncGetAttributes(&a, kernels[i]) != cudaSuccess) {
                        fprintf(stderr, "kvf-sim: GPU mode: loading the kernels failed\n");
                        sim_gpu_close(g);
                        return -1;
                }
        }
        cudaError_t e = cudaHostAlloc((void **)&g->clk_host, 64, cudaHostAllocMapped | cudaHostAllocPortable);
        if (e == cudaSuccess)
                e = cudaHostGetDevicePointer((void **)&g->clk_dev, g->clk_host, 0);
        if (e != cudaSuccess || calibrate(g) < 0) {
                if (e != cudaSuccess)
                        cuda_fail(e, "clock words");
                sim_gpu_close(g);
                return -1;
        }
        *out = g;
        return 0;
}

extern "C" void sim_gpu_close(struct sim_gpu *g)
{
        if (!g)
                return;
        for (unsigned k = 0; k < MAX_RANKS; k++) {
                side_free(&g->pre[k]);
                side_free(&g->dec[k]);
        }
        if (g->clk_host)
                cudaFreeHost(g->clk_host);
        free(g);
}

/* --timeline: when CUDA's callback thread got to the host function queued after a layer. */
static void CUDART_CB stamp_hostfn(void *arg)
{
        ((struct sim_gpu *)arg)->hostfn_ns = now_ns();
}

/* Room for one more descriptor in x's arena; when full, wait for the stream (its kernels read
 * the arena) and start over, carrying the batch being built; grow if that batch fills it. */
static int room(struct sim_gpu *g, struct side *x)
{
        if (x->used < x->cap)
                return 0;
        CK(cudaSetDevice(x->dev), "cudaSetDevice");
        CK(sync(g, x->s), "cudaStreamSynchronize");
        size_t n = x->used - x->start;
        if (x->start) {
                memmove(x->host, x->host + x->start, n * sizeof(struct desc));
        } else {
                struct desc *h = NULL, *d = NULL;
                CK(cudaHostAlloc((void **)&h, 2 * x->cap * sizeof(struct desc), cudaHostAllocMapped | cudaHostAllocPortable),
                   "cudaHostAlloc (descriptors)");
                CK(cudaHostGetDevicePointer((void **)&d, h, 0), "cudaHostGetDevicePointer");
                memcpy(h, x->host, n * sizeof(struct desc));
                cudaFreeHost(x->host);
                x->host = h;
                x->dmap = d;
                x->cap *= 2;
        }
        x->start = 0;
        x->used = n;
        return 0;
}

static int queue(struct sim_gpu *g, struct side *x, const void *ptr, uint64_t bytes, uint64_t key)
{
        if (room(g, x) < 0)
                return -1;
        x->host[x->used++] = (struct desc){(unsigned long long)(uintptr_t)ptr, bytes / 8, key, bytes / 8};
        return 0;
}

/* A heads entry (sim_gpu_fill_heads, sim_gpu_expect_heads). */
static int queue_heads(struct sim_gpu *g, struct side *x, void *ptr, const struct sim_gpu_heads *h)
{
        if (!h->heads || !h->rows || !h->row_bytes || h->row_bytes % 8 || h->split > h->rows) {
                fprintf(stderr, "kvf-sim: GPU: %u heads of %u rows of %llu bytes, %u full (rows of a "
                                "multiple of 8 bytes, at least one head and row, at most every row full)\n",
                        h->heads, h->rows, (unsigned long long)h->row_bytes, h->split);
                return -1;
        }
        if (room(g, x) < 0)
                return -1;
        struct desc d = {};
        d.ptr = (unsigned long long)(uintptr_t)ptr;
        d.rw = h->row_bytes / 8;
        d.words = (unsigned long long)h->rows * d.rw;
        d.seq = h->seq;
        d.head0 = h->head0;
        d.heads = h->heads;
        d.layer = h->layer;
        d.tensor = h->tensor;
        d.split = h->split;
        d.t0 = h->t0;
        x->host[x->used++] = d;
        x->heads = true;
        return 0;
}

extern "C" int sim_gpu_fill_heads(struct sim_gpu *g, unsigned rank, void *ptr, const struct sim_gpu_heads *h)
{
        return queue_heads(g, &g->pre[rank], ptr, h);
}

extern "C" int sim_gpu_expect_heads(struct sim_gpu *g, unsigned rank, const void *ptr, const struct sim_gpu_heads *h)
{
        return queue_heads(g, &g->dec[rank], (void *)ptr, h);
}

extern "C" int sim_gpu_fill(struct sim_gpu *g, unsigned rank, void *ptr, uint64_t bytes, uint64_t key)
{
        return queue(g, &g->pre[rank], ptr, bytes, key);
}

extern "C" int sim_gpu_layer(struct sim_gpu *g, unsigned rank, struct kvf_client *c, uint64_t step, uint32_t layer,
                             uint64_t layer_ns)
{
        struct side *x = &g->pre[rank];
        unsigned long long us = layer_ns / 1000;
        unsigned waves = us / BLOCK_US ? (unsigned)(us / BLOCK_US) : 1;
        unsigned long long block_ns = layer_ns / waves;
        unsigned n = (unsigned)(x->used - x->start);
        CK(cudaSetDevice(x->dev), "cudaSetDevice");
        if (x->heads && n) {
                heads_kernel<<<n < 8u * (unsigned)x->sms ? n : 8u * (unsigned)x->sms, 512, 0, x->s>>>(x->dmap + x->start, n);
                CK(cudaGetLastError(), "heads kernel launch");
                n = 0;
        }
        /* Two 1024-thread blocks per SM fill every thread slot; `waves` of them in a row. */
        layer_kernel<<<waves * 2u * (unsigned)x->sms, 1024, 0, x->s>>>(x->dmap + x->start, n, block_ns, x->d_words);
        CK(cudaGetLastError(), "layer kernel launch");
        x->start = x->used;
        x->heads = false;
        if (kvf_layer_done_on_stream(c, (void *)x->s, step, layer) < 0) {
                fprintf(stderr, "kvf-sim: kvf_layer_done_on_stream(step %llu, layer %u): %s\n",
                        (unsigned long long)step, layer, kvf_last_error());
                return -1;
        }
        if (g->timeline && rank == 0) {
                g->launched_ns = now_ns();
                CK(cudaLaunchHostFunc(x->s, stamp_hostfn, g), "cudaLaunchHostFunc (timeline)");
        }
        return 0;
}

extern "C" void sim_gpu_step_times(const struct sim_gpu *g, uint64_t *launched_ns, uint64_t *hostfn_ns)
{
        *launched_ns = g->launched_ns;
        *hostfn_ns = g->hostfn_ns;
}

extern "C" int sim_gpu_step_end(struct sim_gpu *g, uint64_t *last_ns)
{
        *last_ns = 0;
        for (unsigned k = 0; k < g->ranks; k++) {
                struct side *x = &g->pre[k];
                CK(cudaSetDevice(x->dev), "cudaSetDevice");
                CK(sync(g, x->s), "the step's kernels");
                x->start = x->used = 0;
        }
        struct side *p = &g->pre[0];
        CK(cudaSetDevice(p->dev), "cudaSetDevice");
        CK(cudaMemcpy(p->h_words, p->d_words, sizeof(unsigned long long), cudaMemcpyDeviceToHost), "read the layer end");
        CK(cudaMemsetAsync(p->d_words, 0, sizeof(unsigned long long), p->s), "cudaMemset");
        unsigned long long end = p->h_words[0];
        if (now_ns() - g->clk_at > CALIB_EVERY_NS && calibrate(g) < 0)
                return -1;
        if (end)
                *last_ns = end - g->clk_g + g->clk_h;
        return 0;
}

extern "C" uint64_t sim_gpu_wait_ns(const struct sim_gpu *g)
{
        return g->wait_ns;
}

extern "C" uint64_t sim_gpu_clock_drift(const struct sim_gpu *g)
{
        return g->clk_drift_max;
}

extern "C" int sim_gpu_expect(struct sim_gpu *g, unsigned rank, const void *ptr, uint64_t bytes, uint64_t key)
{
        return queue(g, &g->dec[rank], ptr, bytes, key);
}

extern "C" int sim_gpu_read(struct sim_gpu *g, unsigned rank, const void *ptr, uint64_t bytes, void *out)
{
        struct side *x = &g->dec[rank];
        CK(cudaSetDevice(x->dev), "cudaSetDevice");
        CK(cudaMemcpy(out, ptr, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy (a block, to the host)");
        return 0;
}

extern "C" long sim_gpu_check(struct sim_gpu *g, unsigned rank, uint64_t *first_bad)
{
        struct side *x = &g->dec[rank];
        unsigned n = (unsigned)(x->used - x->start);
        *first_bad = 0;
        if (!n)
                return 0;
        CK(cudaSetDevice(x->dev), "cudaSetDevice");
        unsigned long long init[2] = {0, ~0ull};
        CK(cudaMemcpyAsync(x->d_words, init, sizeof(init), cudaMemcpyHostToDevice, x->s), "cudaMemcpy");
        unsigned blocks = n < 8u * (unsigned)x->sms ? n : 8u * (unsigned)x->sms;
        check_kernel<<<blocks, 256, 0, x->s>>>(x->dmap + x->start, n, x->d_words);
        CK(cudaGetLastError(), "check kernel launch");
        CK(cudaMemcpyAsync(x->h_words, x->d_words, 2 * sizeof(unsigned long long), cudaMemcpyDeviceToHost, x->s),
           "cudaMemcpy");
        CK(sync(g, x->s), "the check kernel");
        x->start = x->used = 0;
        *first_bad = x->h_words[1];
        return (long)x->h_words[0];
}

extern "C" double sim_gpu_copy_rate(struct sim_gpu *g, uint64_t bytes)
{
        struct side *p = &g->pre[0];
        void *a = NULL, *b = NULL;
        cudaEvent_t e0, e1;
        float ms = 0;
        double rate = 0;
        if (bytes < (1u << 20))
                bytes = 1u << 20;
        if (bytes > (2ull << 30))
                bytes = 2ull << 30;
        if (cudaSetDevice(p->dev) != cudaSuccess || cudaMalloc(&a, bytes) != cudaSuccess ||
            cudaMalloc(&b, bytes) != cudaSuccess || cudaEventCreate(&e0) != cudaSuccess)
                goto out;
        if (cudaEventCreate(&e1) == cudaSuccess) {
                cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, p->s); /* warm-up */
                cudaEventRecord(e0, p->s);
                for (int i = 0; i < 5; i++)
                        cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, p->s);
                cudaEventRecord(e1, p->s);
                if (cudaEventSynchronize(e1) == cudaSuccess && cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess && ms > 0)
                        rate = 5.0 * (double)bytes / (ms / 1e3);
                cudaEventDestroy(e1);
        }
        cudaEventDestroy(e0);
out:
        cudaFree(a);
        cudaFree(b);
        (void)cudaGetLastError();
        return rate;
}
