/*
 * bench/gpu_tp_bench.c's content on GPU caches: a fill kernel for a prefill rank's blocks and a
 * check kernel for a decode rank's, one launch per (layer, tensor) over all of a pass's blocks
 * (one CUDA block per cache block). Outside the timed window: speed is not their point.
 */
#include <stdio.h>

#include <cuda_runtime.h>

#include "gpu_tp_content.h"

static char err[256];
static unsigned long long *d_bad; /* words that differed, since the last gtp_gpu_sync */

#define TRY(expr)                                                                                  \
        do {                                                                                       \
                cudaError_t _e = (expr);                                                           \
                if (_e != cudaSuccess) {                                                           \
                        snprintf(err, sizeof(err), "%s: %s", #expr, cudaGetErrorString(_e));       \
                        return -1;                                                                 \
                }                                                                                  \
        } while (0)

extern "C" const char *gtp_gpu_error(void)
{
        return err;
}

extern "C" int gtp_gpu_open(int device, void **stream)
{
        cudaStream_t s;
        TRY(cudaSetDevice(device));
        TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        TRY(cudaMalloc(&d_bad, sizeof(*d_bad)));
        TRY(cudaMemset(d_bad, 0, sizeof(*d_bad)));
        *stream = s;
        return 0;
}

extern "C" int gtp_gpu_descs(const struct gtp_desc *d, uint32_t n, struct gtp_desc **out)
{
        TRY(cudaMalloc(out, (size_t)(n ? n : 1) * sizeof(*d)));
        TRY(cudaMemcpy(*out, d, (size_t)n * sizeof(*d), cudaMemcpyHostToDevice));
        return 0;
}

/* Row r of a block: head r / block_tokens, token r % block_tokens. */
__global__ void fill_kernel(uint32_t *base, const struct gtp_desc *descs, struct gtp_geom g,
                            uint32_t l, uint32_t z)
{
        const struct gtp_desc d = descs[blockIdx.x];
        uint32_t *blk = base + d.block * (g.block_bytes / 4);
        const uint32_t rows = g.heads * g.block_tokens;
        for (uint32_t r = threadIdx.y; r < rows; r += blockDim.y) {
                const uint32_t h = r / g.block_tokens, t = r % g.block_tokens;
                for (uint32_t w = threadIdx.x; w < g.row_words; w += blockDim.x)
                        blk[(size_t)r * g.row_words + w] =
                            gtp_word(d.req, g.first_head + h, d.token0 + t, w, l, z);
        }
}

__global__ void check_kernel(const uint32_t *base, const struct gtp_desc *descs, struct gtp_geom g,
                             uint32_t l, uint32_t z, unsigned long long *bad)
{
        const struct gtp_desc d = descs[blockIdx.x];
        const uint32_t *blk = base + d.block * (g.block_bytes / 4);
        const uint32_t rows = g.heads * g.block_tokens;
        unsigned long long n = 0;
        for (uint32_t r = threadIdx.y; r < rows; r += blockDim.y) {
                const uint32_t h = r / g.block_tokens, t = r % g.block_tokens;
                if (t >= d.ntok)
                        continue;
                for (uint32_t w = threadIdx.x; w < g.row_words; w += blockDim.x)
                        n += blk[(size_t)r * g.row_words + w] !=
                             gtp_word(d.req, g.first_head + h, d.token0 + t, w, l, z);
        }
        if (n)
                atomicAdd(bad, n);
}

static dim3 threads(struct gtp_geom g)
{
        unsigned x = g.row_words < 64 ? g.row_words : 64;
        return dim3(x, 256 / x);
}

extern "C" int gtp_gpu_fill(void *stream, void *tensor, const struct gtp_desc *dev_descs, uint32_t n,
                            struct gtp_geom g, uint32_t l, uint32_t z)
{
        if (!n)
                return 0;
        fill_kernel<<<n, threads(g), 0, (cudaStream_t)stream>>>((uint32_t *)tensor, dev_descs, g, l, z);
        TRY(cudaGetLastError());
        return 0;
}

extern "C" int gtp_gpu_check(void *stream, const void *tensor, const struct gtp_desc *dev_descs,
                             uint32_t n, struct gtp_geom g, uint32_t l, uint32_t z)
{
        if (!n)
                return 0;
        check_kernel<<<n, threads(g), 0, (cudaStream_t)stream>>>((const uint32_t *)tensor, dev_descs,
                                                                 g, l, z, d_bad);
        TRY(cudaGetLastError());
        return 0;
}

extern "C" int gtp_gpu_sync(void *stream, uint64_t *bad)
{
        unsigned long long b = 0;
        TRY(cudaStreamSynchronize((cudaStream_t)stream));
        TRY(cudaMemcpy(&b, d_bad, sizeof(b), cudaMemcpyDeviceToHost));
        TRY(cudaMemset(d_bad, 0, sizeof(*d_bad)));
        if (bad)
                *bad = b;
        return 0;
}

extern "C" int gtp_gpu_zero(void *stream, void *ptr, uint64_t bytes)
{
        TRY(cudaMemsetAsync(ptr, 0, bytes, (cudaStream_t)stream));
        return 0;
}
