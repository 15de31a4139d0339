#include "gpu_bench_common.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void bench_die(const char *fmt, ...)
{
        va_list ap;
        va_start(ap, fmt);
        fflush(stdout);
        vfprintf(stderr, fmt, ap);
        fputc('\n', stderr);
        va_end(ap);
        exit(1);
}

int bench_require_gpu(const char *prog)
{
        int n = kvf_gpu_device_count();
        if (n <= 0) {
                printf("%s: no GPU: %s\n", prog, kvf_gpu_err_msg());
                exit(77);
        }
        return n;
}

uint64_t bench_now_ns(void)
{
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

unsigned bench_parse_list(const char *s, uint64_t *out, unsigned cap, uint64_t unit)
{
        unsigned n = 0;
        char *end;
        while (*s && n < cap) {
                unsigned long long v = strtoull(s, &end, 10);
                if (end == s || v == 0)
                        bench_die("bad list element in \"%s\"", s);
                out[n++] = v * unit;
                s = *end == ',' ? end + 1 : end;
                if (*end && *end != ',')
                        bench_die("bad list \"%s\"", s);
        }
        return n;
}

uint64_t bench_rnd(struct bench_rng *r)
{
        uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
}

static void *xmalloc(size_t n)
{
        void *p = malloc(n ? n : 1);
        if (!p)
                bench_die("out of memory (%zu bytes)", n);
        return p;
}

static uint32_t *permutation(struct bench_rng *r, uint32_t n)
{
        uint32_t *p = (uint32_t *)xmalloc((size_t)n * sizeof(uint32_t));
        for (uint32_t i = 0; i < n; i++)
                p[i] = i;
        for (uint32_t i = n; i > 1; i--) {
                uint32_t j = (uint32_t)(bench_rnd(r) % i);
                uint32_t t = p[i - 1];
                p[i - 1] = p[j];
                p[j] = t;
        }
        return p;
}

size_t bench_layer_runs(const struct bench_layout *l, uint32_t layer, uint32_t nreq,
                        uint32_t blocks, uint64_t seed, struct kvf_gpu_run **out)
{
        struct bench_rng r = {seed};
        if (blocks > l->blocks)
                bench_die("bench_layer_runs: %u blocks of %u", blocks, l->blocks);
        if (nreq == 0)
                nreq = 1;
        if (nreq > blocks)
                nreq = blocks ? blocks : 1;
        uint32_t *sp = permutation(&r, l->blocks), *dp = permutation(&r, l->blocks);
        struct kvf_gpu_run *v =
            (struct kvf_gpu_run *)xmalloc((size_t)blocks * l->tensors * sizeof(*v));
        size_t n = 0;
        for (uint32_t q = 0; q < nreq; q++) {
                uint32_t b0 = (uint32_t)((uint64_t)blocks * q / nreq);
                uint32_t b1 = (uint32_t)((uint64_t)blocks * (q + 1) / nreq);
                for (uint32_t t = 0; t < l->tensors; t++)
                        for (uint32_t b = b0; b < b1; b++) {
                                uint64_t so = bench_off(l, layer, t, sp[b]);
                                uint64_t d = bench_off(l, layer, t, dp[b]);
                                if (n && v[n - 1].src_off + v[n - 1].bytes == so &&
                                    v[n - 1].dst_off + v[n - 1].bytes == d) {
                                        v[n - 1].bytes += l->block_bytes;
                                        continue;
                                }
                                v[n++] = (struct kvf_gpu_run){so, d, l->block_bytes, 0, 0};
                        }
        }
        free(sp);
        free(dp);
        *out = v;
        return n;
}

/* ---------------------------------------------------------------- fill and verify */

__device__ static inline uint64_t mix64(uint64_t z)
{
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
}

__global__ void bench_fill_kernel(uint64_t *p, uint64_t words, uint64_t seed)
{
        for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < words;
             i += (uint64_t)gridDim.x * blockDim.x)
                p[i] = mix64(i * 0x9e3779b97f4a7c15ull + seed);
}

void bench_fill(void *dev, uint64_t bytes, uint64_t seed, cudaStream_t stream)
{
        uint64_t words = bytes / 8;
        if (words) {
                bench_fill_kernel<<<1024, 256, 0, stream>>>((uint64_t *)dev, words, seed);
                BENCH_CUDA(cudaGetLastError());
        }
        if (bytes % 8)
                BENCH_CUDA(cudaMemsetAsync((char *)dev + words * 8, 0x3c, bytes % 8, stream));
}

__global__ void bench_verify_kernel(const struct kvf_gpu_chunk *c, uint32_t n,
                                    unsigned long long *bad)
{
        for (uint32_t i = blockIdx.x; i < n; i += gridDim.x) {
                const unsigned char *s = (const unsigned char *)(uintptr_t)c[i].src;
                const unsigned char *d = (const unsigned char *)(uintptr_t)c[i].dst;
                unsigned long long mine = 0;
                for (uint32_t j = threadIdx.x; j < c[i].bytes; j += blockDim.x)
                        mine += s[j] != d[j];
                if (mine)
                        atomicAdd(bad, mine);
        }
}

uint64_t bench_verify_runs(const struct kvf_gpu_run *runs, size_t n,
                           const struct kvf_gpu_region *src, uint32_t n_src,
                           const struct kvf_gpu_region *dst, uint32_t n_dst)
{
        size_t k = 0;
        BENCH_KVF(kvf_gpu_plan(runs, n, src, n_src, dst, n_dst, 65536, NULL, 0, &k));
        if (!k)
                return 0;
        struct kvf_gpu_chunk *h = (struct kvf_gpu_chunk *)xmalloc(k * sizeof(*h)), *d = NULL;
        BENCH_KVF(kvf_gpu_plan(runs, n, src, n_src, dst, n_dst, 65536, h, k, &k));
        unsigned long long *bad = NULL, hb = 0;
        BENCH_CUDA(cudaMalloc((void **)&d, k * sizeof(*d)));
        BENCH_CUDA(cudaMalloc((void **)&bad, sizeof(*bad)));
        BENCH_CUDA(cudaMemcpy(d, h, k * sizeof(*d), cudaMemcpyHostToDevice));
        BENCH_CUDA(cudaMemset(bad, 0, sizeof(*bad)));
        bench_verify_kernel<<<(unsigned)(k < 65535 ? k : 65535), 256>>>(d, (uint32_t)k, bad);
        BENCH_CUDA(cudaGetLastError());
        BENCH_CUDA(cudaMemcpy(&hb, bad, sizeof(hb), cudaMemcpyDeviceToHost));
        BENCH_CUDA(cudaFree(d));
        BENCH_CUDA(cudaFree(bad));
        free(h);
        return hb;
}

/* ---------------------------------------------------------------- gate */

#define GATE_TIMEOUT_NS 5000000000ull

__device__ static inline unsigned long long gtimer(void)
{
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        return t;
}

__device__ static inline uint32_t ld_acquire_sys(const uint32_t *p)
{
        uint32_t v;
        asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
        return v;
}

__device__ static inline void st_release_sys32(uint32_t *p, uint32_t v)
{
        asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ static inline void st_release_sys64(uint64_t *p, uint64_t v)
{
        asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* word[0]: host -> GPU "open" generation; word[1]: GPU -> host "timed out". */
__global__ void bench_gate_kernel(uint32_t *word, uint32_t gen)
{
        unsigned long long t0 = gtimer();
        while (ld_acquire_sys(&word[0]) != gen)
                if (gtimer() - t0 > GATE_TIMEOUT_NS) {
                        st_release_sys32(&word[1], gen);
                        return;
                }
}

struct bench_gate {
        uint32_t *host; /* mapped pinned: [0] open generation, [1] timed-out generation */
        uint32_t *dev;
        uint32_t gen;
};

struct bench_gate *bench_gate_create(void)
{
        struct bench_gate *g = (struct bench_gate *)xmalloc(sizeof(*g));
        BENCH_CUDA(cudaHostAlloc((void **)&g->host, 64, cudaHostAllocMapped));
        BENCH_CUDA(cudaHostGetDevicePointer((void **)&g->dev, g->host, 0));
        memset(g->host, 0, 64);
        g->gen = 0;
        return g;
}

void bench_gate_close(struct bench_gate *g, cudaStream_t stream)
{
        g->gen++;
        bench_gate_kernel<<<1, 1, 0, stream>>>(g->dev, g->gen);
        BENCH_CUDA(cudaGetLastError());
}

int bench_gate_open(struct bench_gate *g)
{
        /* Release: pairs with the kernel's acquire load. */
        __atomic_store_n(&g->host[0], g->gen, __ATOMIC_RELEASE);
        return __atomic_load_n(&g->host[1], __ATOMIC_ACQUIRE) == g->gen ? -1 : 0;
}

void bench_gate_destroy(struct bench_gate *g)
{
        if (!g)
                return;
        cudaFreeHost(g->host);
        free(g);
}

/* ---------------------------------------------------------------- statistics */

static int cmp_double(const void *a, const void *b)
{
        double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

struct bench_pct bench_percentiles(double *v, size_t n)
{
        struct bench_pct p;
        memset(&p, 0, sizeof(p));
        size_t m = 0;
        for (size_t i = 0; i < n; i++)
                if (!isnan(v[i]))
                        v[m++] = v[i];
        p.n = m;
        if (!m) {
                p.p50 = p.p99 = p.max = p.min = p.mean = NAN;
                return p;
        }
        qsort(v, m, sizeof(double), cmp_double);
        /* Nearest rank. */
        p.p50 = v[(size_t)ceil(0.50 * (double)m) - 1];
        p.p99 = v[(size_t)ceil(0.99 * (double)m) - 1];
        p.min = v[0];
        p.max = v[m - 1];
        double s = 0;
        for (size_t i = 0; i < m; i++)
                s += v[i];
        p.mean = s / (double)m;
        return p;
}

/* ---------------------------------------------------------------- clocks */

/* w[0]: ping (host -> GPU), w[1]: pong (GPU -> host), w[2..3]: GPU time. */
__global__ void bench_clock_kernel(uint32_t *w, int rounds)
{
        uint64_t *g = (uint64_t *)(w + 2);
        for (int i = 1; i <= rounds; i++) {
                unsigned long long t0 = gtimer(), t;
                while (ld_acquire_sys(&w[0]) != (uint32_t)i) {
                        if (gtimer() - t0 > GATE_TIMEOUT_NS)
                                return;
                }
                t = gtimer();
                st_release_sys64(g, t);
                st_release_sys32(&w[1], (uint32_t)i);
        }
}

struct bench_clock_point bench_clock_measure(int rounds)
{
        uint32_t *hw = NULL, *dw = NULL;
        struct bench_clock_point best = {0, 0, UINT64_MAX};
        BENCH_CUDA(cudaHostAlloc((void **)&hw, 64, cudaHostAllocMapped));
        BENCH_CUDA(cudaHostGetDevicePointer((void **)&dw, hw, 0));
        memset(hw, 0, 64);
        cudaStream_t s;
        BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        bench_clock_kernel<<<1, 1, 0, s>>>(dw, rounds);
        BENCH_CUDA(cudaGetLastError());
        uint64_t *hg = (uint64_t *)(hw + 2);
        for (int i = 1; i <= rounds; i++) {
                uint64_t h0 = bench_now_ns();
                /* Release/acquire pair with the kernel's acquire/release. */
                __atomic_store_n(&hw[0], (uint32_t)i, __ATOMIC_RELEASE);
                uint64_t until = h0 + GATE_TIMEOUT_NS;
                while (__atomic_load_n(&hw[1], __ATOMIC_ACQUIRE) != (uint32_t)i)
                        if (bench_now_ns() > until)
                                bench_die("clock calibration: the GPU did not answer ping %d", i);
                uint64_t h1 = bench_now_ns();
                uint64_t g = __atomic_load_n(hg, __ATOMIC_ACQUIRE);
                if (h1 - h0 < best.rtt)
                        best = (struct bench_clock_point){g, h0 + (h1 - h0) / 2, h1 - h0};
        }
        BENCH_CUDA(cudaStreamSynchronize(s));
        BENCH_CUDA(cudaStreamDestroy(s));
        BENCH_CUDA(cudaFreeHost(hw));
        return best;
}

double bench_clock_to_host(const struct bench_clock_map *m, uint64_t g)
{
        double dg = (double)m->b.g - (double)m->a.g;
        double rate = dg > 0 ? ((double)m->b.h - (double)m->a.h) / dg : 1.0;
        return (double)m->a.h + ((double)g - (double)m->a.g) * rate;
}

__global__ void bench_step_kernel(unsigned long long *out)
{
        unsigned long long prev = gtimer(), best = ~0ull;
        for (int i = 0; i < 20000; i++) {
                unsigned long long t = gtimer();
                if (t != prev && t - prev < best)
                        best = t - prev;
                prev = t;
        }
        *out = best;
}

uint64_t bench_globaltimer_step(void)
{
        unsigned long long *d = NULL, h = 0;
        BENCH_CUDA(cudaMalloc((void **)&d, sizeof(*d)));
        bench_step_kernel<<<1, 1>>>(d);
        BENCH_CUDA(cudaGetLastError());
        BENCH_CUDA(cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost));
        BENCH_CUDA(cudaFree(d));
        return h;
}

void bench_describe_device(int dev, char *buf, size_t len)
{
        cudaDeviceProp p;
        int drv = 0, rt = 0;
        BENCH_CUDA(cudaGetDeviceProperties(&p, dev));
        BENCH_CUDA(cudaDriverGetVersion(&drv));
        BENCH_CUDA(cudaRuntimeGetVersion(&rt));
        int mps = kvf_gpu_mps_enabled(dev);
        snprintf(buf, len,
                 "GPU %d: %s, sm_%d%d, %d SMs, %.1f GiB, L2 %d MiB, driver %d.%d, runtime %d.%d, "
                 "MPS %s",
                 dev, p.name, p.major, p.minor, p.multiProcessorCount,
                 (double)p.totalGlobalMem / (1 << 30), p.l2CacheSize >> 20, drv / 1000,
                 (drv % 1000) / 10, rt / 1000, (rt % 1000) / 10, mps > 0 ? "on" : "off");
}

void bench_json_str(FILE *f, const char *s)
{
        fputc('"', f);
        for (; *s; s++) {
                if (*s == '"' || *s == '\\')
                        fputc('\\', f);
                if ((unsigned char)*s >= 0x20)
                        fputc(*s, f);
        }
        fputc('"', f);
}
