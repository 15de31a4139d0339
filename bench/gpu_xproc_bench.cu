/*
 * gpu_xproc_bench: how soon a copy issued by a second process lands while
 * another process keeps the GPU computing, by how the copy is made.
 *
 * Two processes on one GPU, as an engine and kvferry's sender: the "engine"
 * (the parent) queues --layers layer kernels back to back, each filling every
 * SM for --layer-us in waves of 10 us blocks, and after each a one-thread
 * kernel that stores the layer's number into a word in shared host memory.
 * The "sender" (a child forked before CUDA starts) spins on the word; when a
 * layer appears it copies one layer's worth of runs (--runs runs of
 * --run-kib, scattered in a buffer of the engine's opened by IPC handle, into
 * its own) on a stream of the highest priority, records an event and spins on
 * it. The figure per layer: the word seen -> the event complete (host clock),
 * p50 / p99, and how long the submission call took.
 *
 * Copy methods (each a row):
 *   kernel        one copy kernel over all runs (kvferry's copier does this);
 *   memcpy        one cudaMemcpyAsync per run, device to device;
 *   batch         one cuMemcpyBatchAsync of all runs;
 *   batch-ce      the same with CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
 *                 (the driver is asked to use the copy engines).
 * Each row runs twice: "idle" (the engine process computes nothing; the
 * sender copies every --layer-us: the reference) and "busy" (as above). The
 * ratio busy / idle is the cost of sharing the GPU with a computing process,
 * which without MPS means taking turns in time slices; with MPS started
 * (CUDA_MPS_PIPE_DIRECTORY seen by both) the processes share one context.
 * Every copy's last run is checked against the engine's fill pattern.
 */
#include <errno.h>
#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda.h>
#include <cuda_runtime.h>

#include "gpu_bench_common.h"

#define MAX_LAYERS 4096
#define WORD_END UINT64_MAX

enum method { M_KERNEL, M_MEMCPY, M_BATCH, M_BATCH_CE, M_COUNT };
static const char *const method_names[M_COUNT] = {"kernel", "memcpy", "batch", "batch-ce"};

/* Shared between the two processes (MAP_SHARED, made before fork). */
struct shared {
        volatile uint64_t word;      /* layers done (the engine's GPU stores it) */
        volatile uint64_t seq, ack;  /* the engine's command and the sender's answer */
        volatile int method, busy;   /* the row */
        volatile int published;      /* the engine's buffer has its IPC handle */
        volatile int ready;          /* the sender opened it */
        cudaIpcMemHandle_t handle;
        char why[256];               /* the sender's failure, if any */
        uint64_t lat_ns[MAX_LAYERS]; /* word seen -> landed, per layer */
        uint64_t issue_ns[MAX_LAYERS];
        uint32_t n;      /* layers measured */
        uint32_t skipped; /* layers the sender saw only with the next one */
        uint32_t bad;     /* copies whose check failed */
};

struct opts {
        unsigned layers, layer_us, runs, run_kib;
};

__global__ void __launch_bounds__(1024, 2) spin_kernel(unsigned long long ns)
{
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        while (t - t0 < ns);
}

__global__ void store_kernel(volatile unsigned long long *word, unsigned long long v)
{
        __threadfence();
        *word = v;
        __threadfence_system();
}

/* word k of the engine's buffer */
__global__ void fill_kernel(uint64_t *p, size_t n)
{
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
                p[i] = i * 0x9e3779b97f4a7c15ull + 1;
}

/* block (x, y): run x, slice y of it; 16-byte words */
__global__ void copy_kernel(const uint4 *src, uint4 *dst, size_t run_words)
{
        const uint4 *s = src + 2 * (size_t)blockIdx.x * run_words; /* runs are every other slot */
        uint4 *d = dst + (size_t)blockIdx.x * run_words;
        for (size_t i = blockIdx.y * (size_t)blockDim.x + threadIdx.x; i < run_words; i += (size_t)gridDim.y * blockDim.x)
                d[i] = s[i];
}

typedef CUresult (*batch_fn)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, size_t *,
                             size_t, CUstream);

static uint64_t wait_word(struct shared *sh, uint64_t last)
{
        uint64_t w;
        while ((w = sh->word) == last)
                ;
        return w;
}

/* The sender: one row per command, until seq is 0. */
static int sender(struct shared *sh, const struct opts *o)
{
        size_t rb = (size_t)o->run_kib << 10, total = rb * o->runs;
        char *src, *dst;
        cudaStream_t st;
        cudaEvent_t ev;
        int lo, hi;
        for (uint64_t end = bench_now_ns() + 60ull * 1000000000ull; !sh->published;)
                if (bench_now_ns() > end)
                        bench_die("sender: the engine process published no buffer in 60 s");
        BENCH_CUDA(cudaSetDevice(0));
        BENCH_CUDA(cudaIpcOpenMemHandle((void **)&src, sh->handle, cudaIpcMemLazyEnablePeerAccess));
        BENCH_CUDA(cudaMalloc(&dst, total));
        BENCH_CUDA(cudaDeviceGetStreamPriorityRange(&lo, &hi));
        BENCH_CUDA(cudaStreamCreateWithPriority(&st, cudaStreamNonBlocking, hi));
        BENCH_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        batch_fn batch = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuMemcpyBatchAsync", (void **)&batch, 13000, cudaEnableDefault, &q) !=
                    cudaSuccess ||
            q != cudaDriverEntryPointSuccess)
                batch = NULL;
        CUdeviceptr *dsts = (CUdeviceptr *)calloc(o->runs, sizeof(*dsts)), *srcs = (CUdeviceptr *)calloc(o->runs, sizeof(*srcs));
        size_t *sizes = (size_t *)calloc(o->runs, sizeof(*sizes));
        for (unsigned r = 0; r < o->runs; r++) {
                dsts[r] = (CUdeviceptr)(dst + r * rb);
                srcs[r] = (CUdeviceptr)(src + 2 * r * rb);
                sizes[r] = rb;
        }
        int dev_sms = 0;
        BENCH_CUDA(cudaDeviceGetAttribute(&dev_sms, cudaDevAttrMultiProcessorCount, 0));
        uint64_t *check = (uint64_t *)malloc(rb);
        sh->ready = 1;
        uint64_t seen = 0;
        for (;;) {
                while (sh->seq == seen)
                        ;
                seen = sh->seq;
                if (!seen)
                        break;
                int m = sh->method, busy = sh->busy;
                sh->n = sh->skipped = sh->bad = 0;
                if (m >= M_BATCH && !batch) {
                        snprintf(sh->why, sizeof(sh->why), "cuMemcpyBatchAsync is missing (a driver before CUDA 13)");
                        sh->ack = seen;
                        continue;
                }
                sh->why[0] = '\0';
                uint64_t last = 0, next = bench_now_ns();
                for (unsigned i = 0; i < o->layers; i++) {
                        uint64_t w;
                        if (busy) {
                                w = wait_word(sh, last);
                                if (w == WORD_END)
                                        break;
                                if (w > last + 1)
                                        sh->skipped += (uint32_t)(w - last - 1);
                                last = w;
                        } else {
                                next += (uint64_t)o->layer_us * 1000;
                                while (bench_now_ns() < next)
                                        ;
                        }
                        uint64_t t0 = bench_now_ns();
                        cudaError_t e = cudaSuccess;
                        CUresult ce = CUDA_SUCCESS;
                        if (m == M_KERNEL) {
                                dim3 grid(o->runs, (unsigned)(2 * dev_sms + o->runs - 1) / o->runs);
                                copy_kernel<<<grid, 256, 0, st>>>((const uint4 *)src, (uint4 *)dst, rb / 16);
                                e = cudaGetLastError();
                        } else if (m == M_MEMCPY) {
                                for (unsigned r = 0; r < o->runs && e == cudaSuccess; r++)
                                        e = cudaMemcpyAsync((void *)dsts[r], (const void *)srcs[r], rb,
                                                            cudaMemcpyDeviceToDevice, st);
                        } else {
                                CUmemcpyAttributes a;
                                memset(&a, 0, sizeof(a));
                                a.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
                                a.flags = m == M_BATCH_CE ? CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE : 0;
                                size_t idx = 0;
                                ce = batch(dsts, srcs, sizes, o->runs, &a, &idx, 1, (CUstream)st);
                        }
                        if (e == cudaSuccess && ce == CUDA_SUCCESS)
                                e = cudaEventRecord(ev, st);
                        uint64_t t1 = bench_now_ns();
                        if (e != cudaSuccess || ce != CUDA_SUCCESS) {
                                snprintf(sh->why, sizeof(sh->why), "%s: %s (driver %d)", method_names[m],
                                         cudaGetErrorString(e), (int)ce);
                                break;
                        }
                        while ((e = cudaEventQuery(ev)) == cudaErrorNotReady)
                                ;
                        uint64_t t2 = bench_now_ns();
                        if (e != cudaSuccess) {
                                snprintf(sh->why, sizeof(sh->why), "%s: %s", method_names[m], cudaGetErrorString(e));
                                break;
                        }
                        if (sh->n < MAX_LAYERS) {
                                sh->lat_ns[sh->n] = t2 - t0;
                                sh->issue_ns[sh->n] = t1 - t0;
                                sh->n++;
                        }
                }
                /* the last run as copied against the engine's pattern */
                size_t base = 2 * (size_t)(o->runs - 1) * rb / 8;
                if (cudaMemcpy(check, dst + (o->runs - 1) * rb, rb, cudaMemcpyDeviceToHost) == cudaSuccess) {
                        for (size_t k = 0; k < rb / 8; k++)
                                if (check[k] != (base + k) * 0x9e3779b97f4a7c15ull + 1) {
                                        sh->bad++;
                                        break;
                                }
                } else {
                        sh->bad++;
                }
                if (busy) /* drain the engine's remaining words */
                        while (sh->word != WORD_END)
                                ;
                sh->ack = seen;
        }
        return 0;
}

static void usage(const char *p)
{
        printf("Usage: %s [--layers N] [--layer-us N] [--runs N] [--run-kib N]\n"
               "A copy from a second process beside a computing one, per copy method (kernel,\n"
               "memcpy, batch, batch-ce), the engine idle (the reference) and busy.\n"
               "  --layers N    layers per row (default 400)\n"
               "  --layer-us N  one layer's compute (default 200)\n"
               "  --runs N      runs per layer's copy (default 64)\n"
               "  --run-kib N   KiB per run (default 128)\n",
               p);
}

int main(int argc, char **argv)
{
        struct opts o = {400, 200, 64, 128};
        static const struct option lo[] = {{"layers", required_argument, 0, 'l'}, {"layer-us", required_argument, 0, 'u'},
                                            {"runs", required_argument, 0, 'r'},   {"run-kib", required_argument, 0, 'k'},
                                            {"help", no_argument, 0, 'h'},         {0, 0, 0, 0}};
        int c;
        while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
                switch (c) {
                case 'l': o.layers = (unsigned)atoi(optarg); break;
                case 'u': o.layer_us = (unsigned)atoi(optarg); break;
                case 'r': o.runs = (unsigned)atoi(optarg); break;
                case 'k': o.run_kib = (unsigned)atoi(optarg); break;
                case 'h': usage(argv[0]); return 0;
                default: usage(argv[0]); return 2;
                }
        }
        if (o.layers < 20 || o.layers > MAX_LAYERS || !o.layer_us || !o.runs || !o.run_kib || o.run_kib % 16) {
                fprintf(stderr, "%s: --layers 20..%d, --layer-us, --runs > 0, --run-kib a multiple of 16\n", argv[0],
                        MAX_LAYERS);
                return 2;
        }
        struct shared *sh = (struct shared *)mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (sh == MAP_FAILED)
                bench_die("mmap: %s", strerror(errno));
        pid_t pid = fork(); /* before CUDA starts in either process */
        if (pid < 0)
                bench_die("fork: %s", strerror(errno));
        if (pid == 0) {
                prctl(PR_SET_PDEATHSIG, SIGKILL);
                alarm(240); /* a wedged row ends the run, not the machine's time */
                _exit(sender(sh, &o));
        }
        alarm(240);
        setvbuf(stdout, NULL, _IOLBF, 0);
        bench_require_gpu(argv[0]);
        size_t rb = (size_t)o.run_kib << 10, total = 2 * rb * o.runs;
        uint64_t *src;
        cudaStream_t st;
        int sms = 0;
        BENCH_CUDA(cudaSetDevice(0));
        BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        BENCH_CUDA(cudaMalloc(&src, total));
        fill_kernel<<<1024, 256>>>(src, total / 8);
        BENCH_CUDA(cudaDeviceSynchronize());
        BENCH_CUDA(cudaIpcGetMemHandle(&sh->handle, src));
        __sync_synchronize();
        sh->published = 1;
        BENCH_CUDA(cudaHostRegister((void *)sh, sizeof(*sh), cudaHostRegisterMapped));
        unsigned long long *dword;
        BENCH_CUDA(cudaHostGetDevicePointer((void **)&dword, (void *)&sh->word, 0));
        BENCH_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        uint64_t t_end = bench_now_ns() + 60ull * 1000000000ull;
        while (!sh->ready && bench_now_ns() < t_end)
                usleep(1000);
        if (!sh->ready)
                bench_die("the sender process did not open the buffer");
        char dev[256];
        bench_describe_device(0, dev, sizeof(dev));
        int mps = 0;
        cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, 0);
        printf("gpu_xproc_bench: %s, MPS %s; %u layers of %u us per row, a copy of %u runs x %u KiB (%.1f MiB)\n", dev,
               mps ? "on" : "off", o.layers, o.layer_us, o.runs, o.run_kib, rb * o.runs / 1048576.0);
        printf("%-9s %-4s %9s %9s %9s %8s %8s\n", "method", "eng", "p50 us", "p99 us", "issue us", "skipped", "x idle");
        /* waves of 10 us blocks, two 1024-thread blocks per SM, --layer-us in all */
        unsigned waves = o.layer_us / 10 ? o.layer_us / 10 : 1;
        double idle_p50[M_COUNT] = {0};
        uint64_t seq = 0;
        int failed = 0;
        for (int m = 0; m < M_COUNT; m++) {
                for (int busy = 0; busy < 2; busy++) {
                        sh->word = 0;
                        sh->method = m;
                        sh->busy = busy;
                        sh->ack = 0;
                        __sync_synchronize();
                        sh->seq = ++seq;
                        if (busy) {
                                for (unsigned i = 0; i < o.layers; i++) {
                                        spin_kernel<<<2 * sms * waves, 1024, 0, st>>>(10000);
                                        store_kernel<<<1, 1, 0, st>>>(dword, i + 1);
                                }
                                BENCH_CUDA(cudaGetLastError());
                                BENCH_CUDA(cudaStreamSynchronize(st));
                                sh->word = WORD_END;
                        }
                        while (sh->ack != seq) {
                                int stt;
                                if (waitpid(pid, &stt, WNOHANG) == pid)
                                        bench_die("the sender process ended (status %d)", stt);
                        }
                        if (sh->why[0]) {
                                printf("%-9s %-4s FAILED: %s\n", method_names[m], busy ? "busy" : "idle", sh->why);
                                failed = 1;
                                continue;
                        }
                        /* the first 10 layers warm up */
                        uint32_t n = sh->n > 10 ? sh->n - 10 : 0;
                        double *v = (double *)malloc((n + 1) * sizeof(double)), *w = (double *)malloc((n + 1) * sizeof(double));
                        for (uint32_t i = 0; i < n; i++) {
                                v[i] = sh->lat_ns[i + 10] / 1e3;
                                w[i] = sh->issue_ns[i + 10] / 1e3;
                        }
                        struct bench_pct p = bench_percentiles(v, n), pi = bench_percentiles(w, n);
                        if (!busy)
                                idle_p50[m] = p.p50;
                        printf("%-9s %-4s %9.1f %9.1f %9.1f %8u %8.2f%s\n", method_names[m], busy ? "busy" : "idle",
                               p.p50, p.p99, pi.p50, sh->skipped, idle_p50[m] > 0 ? p.p50 / idle_p50[m] : 0.0,
                               sh->bad ? "  CHECK FAILED" : "");
                        failed |= sh->bad != 0;
                        free(v);
                        free(w);
                }
        }
        sh->seq = 0;
        int status = 0;
        waitpid(pid, &status, 0);
        return failed || !WIFEXITED(status) || WEXITSTATUS(status) ? 1 : 0;
}
