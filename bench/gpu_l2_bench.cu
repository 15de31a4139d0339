/*
 * gpu_l2_bench: what a copy beside the engine costs the engine, for the
 * copier's two cache-hint modes against cudaMemcpyAsync of the same bytes.
 *
 * The "engine" is a kernel of one 512-thread block per SM that reads a
 * working set of --working-set MiB over and over through L2 (ld.global.cg:
 * not L1, so every read is an L2 hit or a miss to HBM), as an engine's
 * activations and small weights live in L2. It runs alone, then beside
 * copies issued back to back on a second stream (the highest priority, as
 * the copier's), one every --every-us (a layer's copy per layer, as an engine
 * makes them; 0: back to back, the copies then take what bandwidth they can)
 * for as long as it runs:
 *   bulk         one cudaMemcpyAsync of the batch's bytes per copy: what
 *                cudaMemcpy (and FastDeploy's per-block copies) do to L2
 *   plain        kvferry's copier with KVF_GPU_COPIER_PLAIN: plain loads and
 *                stores, as cudaMemcpy's
 *   evict-first  the copier as it runs by default: loads and stores in their
 *                .cs forms (evict-first in L1 and L2)
 * The copier's batch is --batch MiB of --block KiB K and V blocks scattered
 * over both caches, as gpu_copy_bench's. Each figure: the engine's time
 * against alone in the same round (its slowdown), and the copy's GB/s while
 * the engine ran. Paced, every method moves the same bytes (the line says so
 * if one fell behind), so the slowdowns compare what each copy costs the
 * engine; back to back, they mostly say who takes the bandwidth. Rounds interleave the methods (the order rotates); medians.
 * The copier's last batch of each method is checked byte for byte.
 *
 * Exit: 0 done, 1 error or a wrong byte, 77 no GPU.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_bench_common.h"

#define VERSION "1"
#define MAX_WS 8
#define MAX_ROUNDS 32
#define INFLIGHT 2

enum method { M_ALONE, M_BULK, M_PLAIN, M_EVICT, M_COUNT };
static const char *const method_name[M_COUNT] = {"alone", "bulk", "plain", "evict-first"};

/* Reads `nvec` 16-byte words `iters` times through L2; the xor keeps the loads. */
__global__ void __launch_bounds__(512) engine_kernel(const uint4 *ws, uint64_t nvec, uint32_t iters,
                                                     uint4 *out)
{
        uint32_t a = 0, b = 0, c = 0, d = 0;
        uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
        for (uint32_t it = 0; it < iters; it++)
                for (uint64_t v = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; v < nvec;
                     v += stride) {
                        uint4 x;
                        asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                                     : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                                     : "l"(ws + v));
                        a ^= x.x;
                        b ^= x.y;
                        c ^= x.z;
                        d ^= x.w + it;
                }
        out[(uint64_t)blockIdx.x * blockDim.x + threadIdx.x] = make_uint4(a, b, c, d);
}

struct opts {
        uint64_t ws[MAX_WS];
        unsigned n_ws;
        uint64_t batch, block;
        unsigned rounds;
        double engine_ms;
        uint64_t every_ns;
        int device;
};

struct ctx {
        int sms;
        cudaStream_t es, cs; /* engine, copies (for bulk) */
        cudaEvent_t e0, e1, cev[INFLIGHT];
        uint4 *ws, *out;
        void *src, *dst;
        struct kvf_gpu_region rs, rd;
        struct kvf_gpu_run *runs;
        size_t n_runs;
        uint64_t batch_bytes, every_ns;
        struct kvf_gpu_copier *cp[2]; /* plain, evict-first */
};

struct result {
        double engine_ms, copy_gbs;
        uint64_t copies, late; /* copies done; paced: due times missed by more than one period */
};

static void usage(FILE *f)
{
        fprintf(f, "usage: gpu_l2_bench [options]\n"
                   "What copies beside an L2-resident engine kernel cost it: kvferry's copier\n"
                   "with plain and with evict-first loads and stores, against cudaMemcpyAsync.\n"
                   "  --working-set LIST  the engine's working sets, MiB (default 8,32,48)\n"
                   "  --batch MIB         bytes per copy (default 16)\n"
                   "  --every-us US       one copy every US microseconds (default 250); 0: back to\n"
                   "                      back, at most 2 in flight\n"
                   "  --block KIB         K and V block size of the copier's batch (default 16)\n"
                   "  --rounds N          rounds, methods interleaved (default 5)\n"
                   "  --engine-ms MS      the engine kernel's length alone (default 40)\n"
                   "  --device N          GPU (default 0)\n"
                   "  --help, --version\n"
                   "Exit: 0 done, 1 error or a wrong byte, 77 no GPU.\n");
}

/* Run the engine once beside `m`'s copies; returns its time and the copies' rate. */
static struct result run_once(struct ctx *x, enum method m, uint64_t nvec, uint32_t iters)
{
        struct result r = {0, 0};
        struct kvf_gpu_copier *cp = m == M_PLAIN ? x->cp[0] : m == M_EVICT ? x->cp[1] : NULL;
        struct kvf_gpu_batch b = {x->runs, x->n_runs, &x->rs, 1, &x->rd, 1, NULL, NULL};
        uint64_t tickets[INFLIGHT] = {0};
        uint64_t copies = 0, t_first = 0, t_last = 0, due = 0;
        unsigned head = 0, busy = 0;

        BENCH_CUDA(cudaDeviceSynchronize());
        BENCH_CUDA(cudaEventRecord(x->e0, x->es));
        engine_kernel<<<x->sms, 512, 0, x->es>>>(x->ws, nvec, iters, x->out);
        BENCH_CUDA(cudaGetLastError());
        BENCH_CUDA(cudaEventRecord(x->e1, x->es));
        if (m != M_ALONE) {
                t_first = due = bench_now_ns();
                for (;;) {
                        int engine_done = cudaEventQuery(x->e1) == cudaSuccess;
                        /* Retire the oldest copy if it is done. */
                        if (busy) {
                                unsigned o = (head + INFLIGHT - busy) % INFLIGHT;
                                int done;
                                if (cp) {
                                        done = kvf_gpu_copy_poll(cp, tickets[o]);
                                        if (done < 0)
                                                bench_die("copy failed: %s", kvf_gpu_err_msg());
                                } else {
                                        cudaError_t e = cudaEventQuery(x->cev[o]);
                                        if (e != cudaSuccess && e != cudaErrorNotReady)
                                                BENCH_CUDA(e);
                                        done = e == cudaSuccess;
                                }
                                if (done) {
                                        busy--;
                                        copies++;
                                        t_last = bench_now_ns();
                                        continue;
                                }
                        }
                        if (engine_done && !busy)
                                break;
                        uint64_t now = x->every_ns ? bench_now_ns() : 0;
                        if (!engine_done && busy < INFLIGHT && now >= due) {
                                if (x->every_ns) {
                                        if (now - due > x->every_ns)
                                                r.late++;
                                        due += x->every_ns;
                                }
                                if (cp) {
                                        BENCH_KVF(kvf_gpu_copy_submit(cp, &b, &tickets[head]));
                                } else {
                                        BENCH_CUDA(cudaMemcpyAsync(x->dst, x->src, x->batch_bytes,
                                                                   cudaMemcpyDeviceToDevice, x->cs));
                                        BENCH_CUDA(cudaEventRecord(x->cev[head], x->cs));
                                }
                                head = (head + 1) % INFLIGHT;
                                busy++;
                        }
                }
        }
        BENCH_CUDA(cudaEventSynchronize(x->e1));
        float ms = 0;
        BENCH_CUDA(cudaEventElapsedTime(&ms, x->e0, x->e1));
        r.engine_ms = ms;
        r.copies = copies;
        if (copies && t_last > t_first)
                r.copy_gbs = (double)(copies * x->batch_bytes) / (double)(t_last - t_first);
        if (cp) {
                uint64_t bad = bench_verify_runs(x->runs, x->n_runs, &x->rs, 1, &x->rd, 1);
                if (bad)
                        bench_die("%s: %llu words of the batch differ", method_name[m],
                                  (unsigned long long)bad);
        }
        return r;
}

static double median(double *v, unsigned n)
{
        struct bench_pct p = bench_percentiles(v, n);
        return p.p50;
}

int main(int argc, char **argv)
{
        struct opts o;
        memset(&o, 0, sizeof(o));
        o.ws[0] = 8ull << 20;
        o.ws[1] = 32ull << 20;
        o.ws[2] = 48ull << 20;
        o.n_ws = 3;
        o.batch = 16ull << 20;
        o.every_ns = 250000;
        o.block = 16ull << 10;
        o.rounds = 5;
        o.engine_ms = 40;
        static const struct option lo[] = {{"working-set", required_argument, NULL, 'w'},
                                           {"batch", required_argument, NULL, 'b'},
                                           {"block", required_argument, NULL, 'k'},
                                           {"rounds", required_argument, NULL, 'r'},
                                           {"engine-ms", required_argument, NULL, 'e'},
                                           {"every-us", required_argument, NULL, 'u'},
                                           {"device", required_argument, NULL, 'd'},
                                           {"help", no_argument, NULL, 'h'},
                                           {"version", no_argument, NULL, 'V'},
                                           {NULL, 0, NULL, 0}};
        int ch;
        while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
                switch (ch) {
                case 'w':
                        o.n_ws = bench_parse_list(optarg, o.ws, MAX_WS, 1ull << 20);
                        break;
                case 'b':
                        o.batch = strtoull(optarg, NULL, 10) << 20;
                        break;
                case 'k':
                        o.block = strtoull(optarg, NULL, 10) << 10;
                        break;
                case 'r':
                        o.rounds = (unsigned)atoi(optarg);
                        break;
                case 'e':
                        o.engine_ms = atof(optarg);
                        break;
                case 'u':
                        o.every_ns = strtoull(optarg, NULL, 10) * 1000;
                        break;
                case 'd':
                        o.device = atoi(optarg);
                        break;
                case 'h':
                        usage(stdout);
                        return 0;
                case 'V':
                        printf("gpu_l2_bench %s\n", VERSION);
                        return 0;
                default:
                        usage(stderr);
                        return 1;
                }
        }
        if (!o.n_ws || !o.batch || !o.block || o.block % 16 || !o.rounds || o.rounds > MAX_ROUNDS ||
            o.engine_ms <= 0)
                bench_die("bad options (--help)");
        bench_require_gpu("gpu_l2_bench");
        BENCH_CUDA(cudaSetDevice(o.device));

        struct ctx x;
        memset(&x, 0, sizeof(x));
        x.sms = kvf_gpu_device_sms(o.device);
        if (x.sms <= 0)
                bench_die("device %d: no SM count: %s", o.device, kvf_gpu_err_msg());
        char desc[256];
        bench_describe_device(o.device, desc, sizeof(desc));
        printf("gpu_l2_bench %s: %s\n", VERSION, desc);

        int lo_prio, hi_prio;
        BENCH_CUDA(cudaDeviceGetStreamPriorityRange(&lo_prio, &hi_prio));
        BENCH_CUDA(cudaStreamCreateWithPriority(&x.es, cudaStreamNonBlocking, lo_prio));
        BENCH_CUDA(cudaStreamCreateWithPriority(&x.cs, cudaStreamNonBlocking, hi_prio));
        BENCH_CUDA(cudaEventCreate(&x.e0));
        BENCH_CUDA(cudaEventCreate(&x.e1));
        for (unsigned i = 0; i < INFLIGHT; i++)
                BENCH_CUDA(cudaEventCreateWithFlags(&x.cev[i], cudaEventDisableTiming));

        uint64_t ws_max = 0;
        for (unsigned i = 0; i < o.n_ws; i++)
                ws_max = o.ws[i] > ws_max ? o.ws[i] : ws_max;
        BENCH_KVF(kvf_gpu_alloc(o.device, ws_max, (void **)&x.ws));
        BENCH_KVF(kvf_gpu_alloc(o.device, (uint64_t)x.sms * 512 * sizeof(uint4), (void **)&x.out));
        bench_fill(x.ws, ws_max, 0x15, x.es);

        /* The copier's batch: layer 1 of a 3-layer cache, twice the blocks it needs. */
        uint32_t blocks = (uint32_t)(o.batch / (2 * o.block));
        if (!blocks)
                bench_die("--batch smaller than one K and V block");
        struct bench_layout l = {3, 2, 2 * blocks + 16, o.block};
        uint64_t cache = bench_cache_bytes(&l);
        BENCH_KVF(kvf_gpu_alloc(o.device, cache, &x.src));
        BENCH_KVF(kvf_gpu_alloc(o.device, cache, &x.dst));
        bench_fill(x.src, cache, 0x5eed, x.es);
        x.rs = (struct kvf_gpu_region){(uint64_t)(uintptr_t)x.src, cache};
        x.rd = (struct kvf_gpu_region){(uint64_t)(uintptr_t)x.dst, cache};
        x.n_runs = bench_layer_runs(&l, 1, 8, blocks, 0xb10c, &x.runs);
        x.batch_bytes = (uint64_t)blocks * 2 * o.block;
        x.every_ns = o.every_ns;
        BENCH_KVF(kvf_gpu_copier_create(o.device, KVF_GPU_COPIER_PLAIN, NULL, &x.cp[0]));
        BENCH_KVF(kvf_gpu_copier_create(o.device, 0, NULL, &x.cp[1]));
        BENCH_CUDA(cudaDeviceSynchronize());
        printf("engine: %d blocks of 512 threads reading its working set through L2; copies: "
               "%.0f MiB of %llu KiB K and V blocks (%zu runs), ",
               x.sms, (double)x.batch_bytes / (1 << 20), (unsigned long long)(o.block >> 10),
               x.n_runs);
        if (x.every_ns)
                printf("one every %.0f us\n\n", (double)x.every_ns / 1e3);
        else
                printf("back to back, %d in flight\n\n", INFLIGHT);
        printf("%8s %12s | %10s %8s | %10s %8s %9s | %10s %8s %9s | %10s %8s %9s\n", "ws MiB",
               "alone GB/s", "alone ms", "", "bulk ms", "x alone", "copy GB/s", "plain ms",
               "x alone", "copy GB/s", "evict ms", "x alone", "copy GB/s");

        for (unsigned wi = 0; wi < o.n_ws; wi++) {
                uint64_t nvec = o.ws[wi] / 16;
                /* Calibrate: one pass, then the iterations that take --engine-ms alone. */
                struct result one = run_once(&x, M_ALONE, nvec, 20);
                uint32_t iters = (uint32_t)(20.0 * o.engine_ms / (one.engine_ms > 0.01 ? one.engine_ms
                                                                                      : 0.01));
                if (iters < 1)
                        iters = 1;
                double ms[M_COUNT][MAX_ROUNDS], gbs[M_COUNT][MAX_ROUNDS], ratio[M_COUNT][MAX_ROUNDS];
                uint64_t ncopies[M_COUNT] = {0}, late[M_COUNT] = {0};
                for (unsigned ri = 0; ri < o.rounds; ri++) {
                        struct result rr[M_COUNT];
                        for (unsigned k = 0; k < M_COUNT; k++) {
                                enum method m = (enum method)((k + ri) % M_COUNT);
                                rr[m] = run_once(&x, m, nvec, iters);
                        }
                        for (unsigned m = 0; m < M_COUNT; m++) {
                                ms[m][ri] = rr[m].engine_ms;
                                gbs[m][ri] = rr[m].copy_gbs;
                                ratio[m][ri] = rr[m].engine_ms / rr[M_ALONE].engine_ms;
                                ncopies[m] += rr[m].copies;
                                late[m] += rr[m].late;
                        }
                }
                double med_ms[M_COUNT], med_gbs[M_COUNT], med_ratio[M_COUNT];
                for (unsigned m = 0; m < M_COUNT; m++) {
                        med_ms[m] = median(ms[m], o.rounds);
                        med_gbs[m] = median(gbs[m], o.rounds);
                        med_ratio[m] = median(ratio[m], o.rounds);
                }
                double alone_gbs = (double)o.ws[wi] * iters / (med_ms[M_ALONE] * 1e6);
                printf("%8llu %12.0f | %10.2f %8s | %10.2f %8.3f %9.0f | %10.2f %8.3f %9.0f | %10.2f "
                       "%8.3f %9.0f\n",
                       (unsigned long long)(o.ws[wi] >> 20), alone_gbs, med_ms[M_ALONE], "",
                       med_ms[M_BULK], med_ratio[M_BULK], med_gbs[M_BULK], med_ms[M_PLAIN],
                       med_ratio[M_PLAIN], med_gbs[M_PLAIN], med_ms[M_EVICT], med_ratio[M_EVICT],
                       med_gbs[M_EVICT]);
                printf("%8s copies per round: bulk %.0f, plain %.0f, evict-first %.0f", "",
                       (double)ncopies[M_BULK] / o.rounds, (double)ncopies[M_PLAIN] / o.rounds,
                       (double)ncopies[M_EVICT] / o.rounds);
                if (x.every_ns)
                        printf("; due times missed by over a period: %llu, %llu, %llu",
                               (unsigned long long)late[M_BULK], (unsigned long long)late[M_PLAIN],
                               (unsigned long long)late[M_EVICT]);
                printf("\n");
                fflush(stdout);
        }
        printf("\n'x alone': the engine's time beside the copies against alone in the same round "
               "(median of %u rounds); 'copy GB/s': the copies' bytes over the host time from the "
               "first submit to the last completion. The copier's last batch of every run was "
               "checked byte for byte: ok.\n",
               o.rounds);
        kvf_gpu_copier_destroy(x.cp[0]);
        kvf_gpu_copier_destroy(x.cp[1]);
        free(x.runs);
        return 0;
}
