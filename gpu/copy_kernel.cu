/*
 * The batched gather/scatter copy: the planner that turns runs into chunks,
 * the kernel that copies chunks, and the same kernel body run on the host
 * for tests.
 *
 * Why chunks with absolute addresses: the kernel then needs no region
 * tables, no division and no search; each thread block takes one chunk (at
 * most 64 KiB by default), so the hardware's block scheduler balances runs of
 * any size over every SM, and a batch of thousands of 16 KiB blocks is one
 * launch whose blocks retire in a few microseconds each. Planning is a
 * linear pass on the host, where every run is checked against its region
 * first: a bad offset must never reach the GPU, where it would be a sticky
 * fault that ends the context for every request.
 */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include <cuda_runtime.h>

#include "internal.h"

static_assert(sizeof(struct kvf_gpu_chunk) == 24, "chunk descriptor is 24 bytes");
static_assert(sizeof(struct kvf_gpu_run) == 32, "run is 32 bytes");
static_assert(KVF_GPU_CHUNK_MAX % 16 == 0, "chunk limit in 16-byte units");
/* Chunk byte counts are 32-bit; the vector index below is bytes / 16 plus
 * four strides, so it cannot wrap for any chunk the planner makes. */
static_assert(KVF_GPU_CHUNK_MAX <= (1u << 30), "vector index headroom");

#define CHUNK_MIN_AUTO 4096u
#define CHUNK_MAX_AUTO 65536u
#define CHUNKS_PER_SM 8u /* two waves of 512-thread blocks at full occupancy */

/* ---------------------------------------------------------------- planning (host) */

/*
 * The piece size for a run: cut `bytes` into k = ceil(bytes / chunk) pieces
 * of nearly equal size, rounded up to 16 bytes (so every cut is 16-byte
 * aligned relative to the run's start). piece <= chunk, and
 * (k - 1) * piece < bytes, so the last piece is never empty and
 * ceil(bytes / piece) <= k.
 */
static uint64_t run_piece(uint64_t bytes, uint32_t chunk)
{
        uint64_t k = (bytes - 1) / chunk + 1;
        uint64_t per = (bytes - 1) / k + 1; /* <= chunk */
        return (per + 15) & ~(uint64_t)15;  /* <= chunk: chunk is a multiple of 16 */
}

/* run_piece and the piece count of the last run size seen (bytes 0: none yet). */
struct piece_memo {
        uint64_t bytes, piece, k;
};

static const struct piece_memo *piece_of(struct piece_memo *m, uint64_t bytes, uint32_t chunk)
{
        if (bytes != m->bytes) {
                m->bytes = bytes;
                m->piece = run_piece(bytes, chunk);
                m->k = (bytes - 1) / m->piece + 1;
        }
        return m;
}

static int check_regions(const struct kvf_gpu_region *r, uint32_t n, const char *side)
{
        for (uint32_t i = 0; i < n; i++) {
                if (r[i].bytes && !r[i].base)
                        return kvf_gpu_err_set(-EINVAL, "%s region %u: no base address", side, i);
                if (r[i].bytes > UINT64_MAX - r[i].base)
                        return kvf_gpu_err_set(-EINVAL,
                                               "%s region %u: end overflows (base 0x%llx, %llu "
                                               "bytes)",
                                               side, i, (unsigned long long)r[i].base,
                                               (unsigned long long)r[i].bytes);
        }
        return 0;
}

extern "C" int kvf_gpu_plan(const struct kvf_gpu_run *runs, size_t n_runs,
                            const struct kvf_gpu_region *src, uint32_t n_src,
                            const struct kvf_gpu_region *dst, uint32_t n_dst, uint32_t chunk_bytes,
                            struct kvf_gpu_chunk *out, size_t cap, size_t *n_chunks)
{
        int rc;
        size_t total = 0;

        if (n_chunks)
                *n_chunks = 0;
        if (chunk_bytes < 16 || chunk_bytes % 16 || chunk_bytes > KVF_GPU_CHUNK_MAX)
                return kvf_gpu_err_set(-EINVAL, "chunk size %u: must be a multiple of 16 in 16..%u",
                                       chunk_bytes, KVF_GPU_CHUNK_MAX);
        if ((n_runs && !runs) || (n_src && !src) || (n_dst && !dst) || !n_chunks)
                return kvf_gpu_err_set(-EINVAL, "plan: missing array");
        if ((rc = check_regions(src, n_src, "source")) < 0 ||
            (rc = check_regions(dst, n_dst, "destination")) < 0)
                return rc;

        /* A batch's runs mostly have one size (a block, or a head slice of one): the
         * piece and count are worked out once per size met, not with three divisions a
         * run in each pass. */
        struct piece_memo m = {0, 0, 0};

        /* Pass 1: check everything and count, so a bad run leaves `out` untouched
         * by a half-written plan and the caller learns the size it needs. */
        for (size_t i = 0; i < n_runs; i++) {
                const struct kvf_gpu_run *r = &runs[i];
                if (r->src_region >= n_src)
                        return kvf_gpu_err_set(-EINVAL, "run %zu: source region %u, only %u", i,
                                               r->src_region, n_src);
                if (r->dst_region >= n_dst)
                        return kvf_gpu_err_set(-EINVAL, "run %zu: destination region %u, only %u",
                                               i, r->dst_region, n_dst);
                if (!r->bytes)
                        continue;
                const struct kvf_gpu_region *s = &src[r->src_region], *d = &dst[r->dst_region];
                if (!kvf_gpu_inside(r->src_off, r->bytes, s->bytes))
                        return kvf_gpu_err_set(
                            -ERANGE,
                            "run %zu: source bytes [%llu, +%llu) outside region %u (%llu bytes)", i,
                            (unsigned long long)r->src_off, (unsigned long long)r->bytes,
                            r->src_region, (unsigned long long)s->bytes);
                if (!kvf_gpu_inside(r->dst_off, r->bytes, d->bytes))
                        return kvf_gpu_err_set(-ERANGE,
                                               "run %zu: destination bytes [%llu, +%llu) "
                                               "outside region %u (%llu bytes)",
                                               i, (unsigned long long)r->dst_off,
                                               (unsigned long long)r->bytes, r->dst_region,
                                               (unsigned long long)d->bytes);
                uint64_t k = piece_of(&m, r->bytes, chunk_bytes)->k;
                if (k > SIZE_MAX - total)
                        return kvf_gpu_err_set(-E2BIG, "run %zu: chunk count overflows", i);
                total += (size_t)k;
        }
        *n_chunks = total;
        if (!out)
                return 0;
        if (total > cap)
                return kvf_gpu_err_set(-E2BIG, "batch needs %zu chunks, room for %zu", total, cap);

        /* Pass 2: emit. Every address below is within [base, base + bytes) of its
         * region, which pass 1 and check_regions proved cannot wrap. */
        size_t o = 0;
        for (size_t i = 0; i < n_runs; i++) {
                const struct kvf_gpu_run *r = &runs[i];
                if (!r->bytes)
                        continue;
                uint64_t s = src[r->src_region].base + r->src_off;
                uint64_t d = dst[r->dst_region].base + r->dst_off;
                const uint64_t piece = piece_of(&m, r->bytes, chunk_bytes)->piece;
                for (uint64_t off = 0; off < r->bytes; off += piece) {
                        uint64_t len = r->bytes - off < piece ? r->bytes - off : piece;
                        out[o].src = s + off;
                        out[o].dst = d + off;
                        out[o].bytes = (uint32_t)len; /* <= piece <= chunk_bytes <= 1 MiB */
                        out[o].reserved = 0;
                        o++;
                }
        }
        return 0;
}

/* A power of two, so that cache blocks (powers of two, or sums of a few)
 * cut into equal chunks whose 16-byte vectors fill whole unrolled rounds. */
extern "C" uint32_t kvf_gpu_chunk_bytes_for(uint64_t total_bytes, int sms)
{
        uint64_t target = (uint64_t)(sms > 0 ? sms : 132) * CHUNKS_PER_SM;
        uint64_t per = total_bytes / target;
        uint32_t chunk = CHUNK_MIN_AUTO;
        while (chunk < CHUNK_MAX_AUTO && chunk < per)
                chunk *= 2;
        return chunk;
}

/* ---------------------------------------------------------------- the kernel body */

/*
 * One 16-byte vector. EVICT_FIRST (the default): the .cs ("cache streaming")
 * forms, lines evict-first in L1 and L2; otherwise plain loads and stores, as
 * cudaMemcpy's own copy. On the H200 plain copied 1.5 to 3.5 % faster, and an
 * engine kernel beside paced copies lost 2 to 5 % more of its time to them
 * (bench/gpu_l2_bench.cu). Variants measured there say both come from the
 * copy's lines allocated in L1 on the SMs it shares with the engine, not
 * from the L2 policy (docs/GPU.md).
 */
template <bool EVICT_FIRST> __host__ __device__ static inline uint4 ld16(const uint4 *p)
{
#ifdef __CUDA_ARCH__
        return EVICT_FIRST ? __ldcs(p) : *p;
#else
        uint4 v;
        memcpy(&v, p, sizeof(v));
        return v;
#endif
}

template <bool EVICT_FIRST> __host__ __device__ static inline void st16(uint4 *p, uint4 v)
{
#ifdef __CUDA_ARCH__
        if (EVICT_FIRST)
                __stcs(p, v);
        else
                *p = v;
#else
        memcpy(p, &v, sizeof(v));
#endif
}

/*
 * Thread `tid` of `nthr` copies its share of [src, src + bytes) to dst.
 *
 * When src and dst have the same alignment modulo 16 (always, for cache
 * blocks: cudaMalloc returns 256-byte aligned memory and block sizes are
 * multiples of 16), a scalar head reaches 16-byte alignment, the body moves
 * in 16-byte vectors, four independent loads in flight per thread before the
 * first store, consecutive threads on consecutive vectors (coalesced), and a
 * scalar tail finishes. Different alignments copy byte by byte: correct,
 * slow, and never produced by a cache layout.
 *
 * Each byte is written by exactly one thread and read only from src, so the
 * order in which threads run does not matter: the host emulation runs them
 * one after the other and must produce the same bytes.
 */
template <bool EVICT_FIRST>
__host__ __device__ static inline void copy_range(unsigned char *dst, const unsigned char *src,
                                                  uint32_t bytes, uint32_t tid, uint32_t nthr)
{
        uintptr_t s = (uintptr_t)src, d = (uintptr_t)dst;

        if (((s ^ d) & 15u) != 0) {
                for (uint32_t j = tid; j < bytes; j += nthr)
                        dst[j] = src[j];
                return;
        }
        uint32_t head = (uint32_t)((16u - (s & 15u)) & 15u);
        if (head > bytes)
                head = bytes;
        for (uint32_t j = tid; j < head; j += nthr)
                dst[j] = src[j];

        uint32_t nvec = (bytes - head) / 16u;
        const uint4 *vs = (const uint4 *)(src + head);
        uint4 *vd = (uint4 *)(dst + head);
        uint32_t v = tid;
        /* nvec < 2^28 (bytes is 32-bit), so v + 4 * nthr never wraps for any block size. */
        for (; v + 3u * nthr < nvec; v += 4u * nthr) {
                uint4 a = ld16<EVICT_FIRST>(vs + v);
                uint4 b = ld16<EVICT_FIRST>(vs + v + nthr);
                uint4 c = ld16<EVICT_FIRST>(vs + v + 2u * nthr);
                uint4 e = ld16<EVICT_FIRST>(vs + v + 3u * nthr);
                st16<EVICT_FIRST>(vd + v, a);
                st16<EVICT_FIRST>(vd + v + nthr, b);
                st16<EVICT_FIRST>(vd + v + 2u * nthr, c);
                st16<EVICT_FIRST>(vd + v + 3u * nthr, e);
        }
        for (; v < nvec; v += nthr)
                st16<EVICT_FIRST>(vd + v, ld16<EVICT_FIRST>(vs + v));

        uint32_t done = head + nvec * 16u;
        for (uint32_t j = done + tid; j < bytes; j += nthr)
                dst[j] = src[j];
}

__device__ static inline unsigned long long globaltimer_ns(void)
{
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        return t;
}

/*
 * One block per chunk (a grid-stride loop only if the grid had to be
 * capped). Thread 0 reads the descriptor into shared memory once: the
 * descriptors may live in mapped host memory, where every read crosses PCIe.
 * `dsrc`/`ddst` are added to every chunk's addresses (modulo 2^64): the
 * copier runs the descriptors of an earlier batch again, shifted by a layer.
 * `save`, if not NULL, receives a copy of every descriptor as read (device
 * memory): a batch read from mapped host memory leaves its descriptors on the
 * device for the next layers, with no copy of its own.
 * __launch_bounds__(512, 4): 4 blocks per SM, the whole SM's 2048 threads,
 * which caps registers at 32 per thread (the body needs about 24). 512
 * threads per block measured 3 to 5 % faster than 256 on the H200 for
 * batches of 64 MiB and more (docs/GPU.md).
 */
template <bool STAMP, bool EVICT_FIRST>
__global__ void __launch_bounds__(KVF_GPU_THREADS, 2048 / KVF_GPU_THREADS)
    kvf_copy_kernel(const struct kvf_gpu_chunk *chunks, uint32_t n, uint64_t dsrc, uint64_t ddst,
                    struct kvf_gpu_chunk *save, unsigned long long *stamps)
{
        __shared__ struct kvf_gpu_chunk c;

        if (STAMP && threadIdx.x == 0)
                atomicMin(&stamps[0], globaltimer_ns());
        for (uint32_t i = blockIdx.x; i < n; i += gridDim.x) {
                if (threadIdx.x == 0) {
                        /* .cg: through L2 only. The descriptors change between
                         * launches (the host rewrites the arena), and may be host
                         * memory; never read them through the non-coherent path. */
                        uint64_t src = __ldcg(&chunks[i].src), dst = __ldcg(&chunks[i].dst);
                        uint32_t bytes = __ldcg(&chunks[i].bytes);
                        if (save) {
                                __stcg(&save[i].src, src);
                                __stcg(&save[i].dst, dst);
                                __stcg(&save[i].bytes, bytes);
                        }
                        c.src = src + dsrc;
                        c.dst = dst + ddst;
                        c.bytes = bytes;
                }
                __syncthreads();
                copy_range<EVICT_FIRST>((unsigned char *)(uintptr_t)c.dst,
                           (const unsigned char *)(uintptr_t)c.src, c.bytes, threadIdx.x,
                           blockDim.x);
                /* Nobody may still read `c` when thread 0 overwrites it. */
                __syncthreads();
        }
        if (STAMP) {
                /* The end stamp means "landed": make this thread's stores visible
                 * device-wide, wait for every thread of the block, then stamp. */
                __threadfence();
                __syncthreads();
                if (threadIdx.x == 0)
                        atomicMax(&stamps[1], globaltimer_ns());
        }
}

#define GRID_MAX 0x7fffffffu

extern "C" int kvf_gpu_copy_launch(const struct kvf_gpu_chunk *dev_chunks, uint32_t n, void *stream,
                                   uint64_t *stamps)
{
        return kvf_gpu_copy_launch_ex(dev_chunks, n, 0, 0, NULL, 0, stream, stamps);
}

extern "C" int kvf_gpu_copy_launch_ex(const struct kvf_gpu_chunk *dev_chunks, uint32_t n,
                                      uint64_t dsrc, uint64_t ddst, struct kvf_gpu_chunk *save,
                                      int evict_first, void *stream, uint64_t *stamps)
{
        if (!n)
                return 0;
        unsigned long long *st = (unsigned long long *)stamps;
        void *args[] = {(void *)&dev_chunks, (void *)&n,    (void *)&dsrc,
                        (void *)&ddst,       (void *)&save, (void *)&st};
        static const void *const fns[2][2] = {
            {(const void *)kvf_copy_kernel<false, false>, (const void *)kvf_copy_kernel<false, true>},
            {(const void *)kvf_copy_kernel<true, false>, (const void *)kvf_copy_kernel<true, true>}};
        const void *fn = fns[stamps != NULL][evict_first != 0];
        dim3 grid(n < GRID_MAX ? n : GRID_MAX), block(KVF_GPU_THREADS);
        cudaError_t e = cudaLaunchKernel(fn, grid, block, args, 0, (cudaStream_t)stream);
        if (e != cudaSuccess)
                return kvf_gpu_err_cuda(e, "copy kernel launch");
        return 0;
}

/* Load the copy kernels' module now (CUDA loads modules lazily, at a kernel's first launch, and
 * that load holds up the process's other CUDA work, host functions included, for milliseconds):
 * at a copier's creation, not at the first request's copy. */
extern "C" int kvf_gpu_copy_kernels_load(void)
{
        static const void *const fns[4] = {
            (const void *)kvf_copy_kernel<false, false>, (const void *)kvf_copy_kernel<false, true>,
            (const void *)kvf_copy_kernel<true, false>, (const void *)kvf_copy_kernel<true, true>};
        for (unsigned i = 0; i < 4; i++) {
                struct cudaFuncAttributes a;
                cudaError_t e = cudaFuncGetAttributes(&a, fns[i]);
                if (e != cudaSuccess)
                        return kvf_gpu_err_cuda(e, "loading the copy kernel");
        }
        return 0;
}

extern "C" void kvf_gpu_copy_emulate(const struct kvf_gpu_chunk *chunks, size_t n, uint32_t threads)
{
        if (!threads)
                threads = KVF_GPU_THREADS;
        for (size_t i = 0; i < n; i++)
                for (uint32_t t = 0; t < threads; t++)
                        copy_range<false>((unsigned char *)(uintptr_t)chunks[i].dst,
                                   (const unsigned char *)(uintptr_t)chunks[i].src, chunks[i].bytes,
                                   t, threads);
}
