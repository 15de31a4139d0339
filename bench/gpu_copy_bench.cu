/*
 * gpu_copy_bench: per-layer copy throughput of kvferry's batched kernel
 * against two references measured in the same run:
 *   (a) bulk      one cudaMemcpyAsync of the same byte count, device to
 *                 device, contiguous: the limit;
 *   (b) per-block one cudaMemcpyAsync per block (FastDeploy's method).
 *
 * A row is one layer's batch: `--requests` requests whose blocks are
 * scattered over the cache (random permutations of block ids on both sides,
 * so almost nothing merges), K and V (or the key-only latent), real block
 * sizes of the model shapes in data/model-shapes.json (via common/layout.c)
 * at tensor-parallel degrees 1 and 8, plus 16 KiB and 64 KiB blocks; batch
 * sizes 1 to 256 MiB. Shapes with the same (block bytes, tensors) are one
 * row, labelled with every model they stand for.
 *
 * Columns (payload bytes per second, GB = 1e9; each figure the median of
 * --reps):
 *   bulk        GPU time of (a), queued behind a gate so the GPU runs it back
 *               to back (no host time in it);
 *   staged      GPU time of one kvf_gpu_copy_submit with the descriptors
 *               copied to the device first (KVF_GPU_COPIER_STAGED_DESC, the
 *               first design), same gate;
 *   first       the default copier, a step's first layer: descriptors read
 *               from mapped host memory by the kernel, which leaves a copy on
 *               the device;
 *   next        the same requests' next layer: the copier runs the copy on
 *               the device, shifted (no descriptor written);
 *   step        bulk time / the mean layer of a 32-layer step (one first
 *               layer, 31 next ones): the per-layer throughput an engine sees
 *               (target >= 0.85 for >= 64 MiB);
 *   submit      host time of a first layer's submit call (planning + launch);
 *   k-e2e       host clock from the submit call to poll() == 1, no gate, the
 *               mean layer of a 32-layer step: what the sender sees;
 *   b-e2e       host clock of (a): one cudaMemcpyAsync of the batch's bytes,
 *               contiguous, to its event's completion, no gate: what the
 *               limit itself costs a caller that waits for it;
 *   per-block   host clock from the first cudaMemcpyAsync to its event's
 *               completion, no gate (the calls are what it costs);
 *   x pb        per-block / k-e2e (target >= 50 at 16 KiB blocks); the
 *               target lines also give per-block / b-e2e, how far the limit
 *               itself gets on the same host clock.
 * Every kernel result is checked on the GPU (every byte of every run);
 * a mismatch fails the run (exit 1). Targets missed are reported, exit 0.
 *
 * Small batches fit in the 60 MB L2 and are repeated, so their figures may
 * include L2 hits for every method alike.
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu_bench_common.h"
#include "gpu_shapes.h"

#define VERSION "2"
#define MAX_SIZES 16
#define MAX_SHAPES 32
#define ARENA_CHUNKS (1u << 20)
#define LAYERS_ALLOC 3u /* the batch is layer 1 of a 3-layer cache: offsets past layer 0 */

struct shape {
        char label[160];
        uint64_t block_bytes;
        uint32_t tensors;
};

struct row {
        const struct shape *sh;
        uint64_t bytes;
        size_t runs, chunks;
        double bulk_us, staged_us, first_us, next_us, submit_us, e2e_us, e2e_next_us, pb_us;
        double bulk_e2e_us;
        uint64_t bad;
};

struct opts {
        uint64_t sizes[MAX_SIZES];
        unsigned n_sizes;
        uint64_t blocks_extra[MAX_SIZES];
        unsigned n_blocks_extra;
        unsigned tps[8];
        unsigned n_tps;
        unsigned requests;
        unsigned reps;
        uint64_t perblock_max;
        int order_src; /* --order src: a batch's runs sorted by source offset */
        uint32_t chunk;  /* --chunk: the copier's chunk limit in bytes, 0 = per batch */
        unsigned hints;  /* --hints plain: KVF_GPU_COPIER_PLAIN */
        int device;
        const char *json;
};

static void usage(FILE *f)
{
        fprintf(f,
                "usage: gpu_copy_bench [options]\n"
                "Per-layer copy throughput: kvferry's batched kernel against one bulk\n"
                "cudaMemcpyAsync of the same bytes and one cudaMemcpyAsync per block.\n"
                "  --sizes LIST        batch sizes in MiB (default 1,4,16,64,256)\n"
                "  --blocks LIST       extra block sizes in KiB, K and V (default 16,64)\n"
                "  --tp LIST           tensor-parallel degrees for the model shapes (default 1,8)\n"
                "  --requests N        requests per layer batch (default 8)\n"
                "  --reps N            repetitions per figure, median reported (default 10)\n"
                "  --perblock-max MIB  largest batch measured per block (default 256)\n"
                "  --order given|src   a batch's runs as the requests list them (default), or\n"
                "                      sorted by source offset\n"
                "  --chunk KIB         the copier's chunk limit (default: chosen per batch)\n"
                "  --hints evict-first|plain  the kernel's loads and stores (default evict-first)\n"
                "  --device N          GPU (default 0)\n"
                "  --json PATH         also write the results as JSON\n"
                "  --help, --version\n"
                "Exit: 0 done (targets missed are reported), 1 error or a wrong byte,\n"
                "77 no GPU.\n");
}

static unsigned make_shapes(const struct opts *o, struct shape *sh)
{
        struct kvf_bench_model m[16];
        unsigned nm = kvf_bench_models(m, 16), n = 0;
        if (nm > 16)
                nm = 16;
        for (unsigned t = 0; t < o->n_tps; t++)
                for (unsigned i = 0; i < nm; i++) {
                        uint32_t heads = m[i].kv_heads / o->tps[t];
                        if (heads < 1)
                                heads = 1;
                        uint64_t bb = (uint64_t)heads * KVF_BENCH_BLOCK_TOKENS * m[i].head_dim *
                                      m[i].elem_bytes;
                        uint32_t tens = m[i].key_only ? 1 : 2;
                        char name[64];
                        snprintf(name, sizeof(name), "%s/tp%u", m[i].name, o->tps[t]);
                        unsigned j;
                        for (j = 0; j < n; j++)
                                if (sh[j].block_bytes == bb && sh[j].tensors == tens)
                                        break;
                        if (j == n) {
                                if (n == MAX_SHAPES)
                                        continue;
                                sh[n].block_bytes = bb;
                                sh[n].tensors = tens;
                                sh[n].label[0] = 0;
                                n++;
                        }
                        size_t len = strlen(sh[j].label);
                        /* One model name per (model, tp) pair whose shape this row is. */
                        if (!strstr(sh[j].label, name))
                                snprintf(sh[j].label + len, sizeof(sh[j].label) - len, "%s%s",
                                         len ? " " : "", name);
                }
        for (unsigned i = 0; i < o->n_blocks_extra; i++) {
                unsigned j;
                for (j = 0; j < n; j++)
                        if (sh[j].block_bytes == o->blocks_extra[i] && sh[j].tensors == 2)
                                break;
                char name[32];
                snprintf(name, sizeof(name), "%llu KiB K/V",
                         (unsigned long long)(o->blocks_extra[i] >> 10));
                if (j == n) {
                        if (n == MAX_SHAPES)
                                continue;
                        sh[n].block_bytes = o->blocks_extra[i];
                        sh[n].tensors = 2;
                        sh[n].label[0] = 0;
                        n++;
                }
                size_t len = strlen(sh[j].label);
                snprintf(sh[j].label + len, sizeof(sh[j].label) - len, "%s%s", len ? " " : "",
                         name);
        }
        return n;
}

static double median_us(double *v, size_t n)
{
        return bench_percentiles(v, n).p50;
}

/* GPU time of each rep's submit, all queued behind one gate. With `alt`, the
 * reps alternate between b and alt (two layers of the same requests), after one
 * untimed submit of b: with reuse, every timed rep runs descriptors shifted. */
static double time_kernel(struct kvf_gpu_copier *c, const struct kvf_gpu_batch *b,
                          const struct kvf_gpu_batch *alt, unsigned reps, struct bench_gate *gate,
                          double *submit_us)
{
        cudaStream_t s = (cudaStream_t)kvf_gpu_copier_stream(c);
        cudaEvent_t ev[2 * 64];
        double t[64], sub[64];
        uint64_t last = 0;
        if (reps > 64)
                reps = 64;
        for (unsigned i = 0; i < 2 * reps; i++)
                BENCH_CUDA(cudaEventCreate(&ev[i]));
        if (alt) {
                BENCH_KVF(kvf_gpu_copy_submit(c, b, &last));
                BENCH_CUDA(cudaStreamSynchronize(s));
        }
        bench_gate_close(gate, s);
        for (unsigned i = 0; i < reps; i++) {
                BENCH_CUDA(cudaEventRecord(ev[2 * i], s));
                uint64_t h0 = bench_now_ns();
                BENCH_KVF(kvf_gpu_copy_submit(c, alt && !(i & 1) ? alt : b, &last));
                sub[i] = (double)(bench_now_ns() - h0) / 1e3;
                BENCH_CUDA(cudaEventRecord(ev[2 * i + 1], s));
        }
        if (bench_gate_open(gate) < 0)
                bench_die("the gate timed out: queueing %u submits took over 5 s", reps);
        BENCH_CUDA(cudaStreamSynchronize(s));
        if (kvf_gpu_copy_poll(c, last) != 1)
                bench_die("copy failed: %s", kvf_gpu_err_msg());
        for (unsigned i = 0; i < reps; i++) {
                float ms = 0;
                BENCH_CUDA(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
                t[i] = ms * 1e3;
        }
        for (unsigned i = 0; i < 2 * reps; i++)
                BENCH_CUDA(cudaEventDestroy(ev[i]));
        if (submit_us)
                *submit_us = median_us(sub, reps);
        return median_us(t, reps);
}

static double time_bulk(cudaStream_t s, void *dst, const void *src, uint64_t bytes, unsigned reps,
                        struct bench_gate *gate)
{
        cudaEvent_t ev[2 * 64];
        double t[64];
        if (reps > 64)
                reps = 64;
        for (unsigned i = 0; i < 2 * reps; i++)
                BENCH_CUDA(cudaEventCreate(&ev[i]));
        bench_gate_close(gate, s);
        for (unsigned i = 0; i < reps; i++) {
                BENCH_CUDA(cudaEventRecord(ev[2 * i], s));
                BENCH_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
                BENCH_CUDA(cudaEventRecord(ev[2 * i + 1], s));
        }
        if (bench_gate_open(gate) < 0)
                bench_die("the gate timed out");
        BENCH_CUDA(cudaStreamSynchronize(s));
        for (unsigned i = 0; i < reps; i++) {
                float ms = 0;
                BENCH_CUDA(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
                t[i] = ms * 1e3;
        }
        for (unsigned i = 0; i < 2 * reps; i++)
                BENCH_CUDA(cudaEventDestroy(ev[i]));
        return median_us(t, reps);
}

/* Host clock of the limit: one contiguous cudaMemcpyAsync, its event polled
 * as kvf_gpu_copy_poll polls a batch's. */
static double time_bulk_e2e(cudaStream_t s, void *dst, const void *src, uint64_t bytes,
                            unsigned reps)
{
        double t[64];
        cudaEvent_t ev;
        BENCH_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        if (reps > 64)
                reps = 64;
        BENCH_CUDA(cudaStreamSynchronize(s));
        for (unsigned i = 0; i < reps; i++) {
                uint64_t h0 = bench_now_ns();
                BENCH_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
                BENCH_CUDA(cudaEventRecord(ev, s));
                cudaError_t e;
                while ((e = cudaEventQuery(ev)) == cudaErrorNotReady) {
                }
                BENCH_CUDA(e);
                t[i] = (double)(bench_now_ns() - h0) / 1e3;
        }
        BENCH_CUDA(cudaEventDestroy(ev));
        return median_us(t, reps);
}

/* Host clock, submit to poll() == 1; with `alt`, alternating as time_kernel does. */
static double time_e2e(struct kvf_gpu_copier *c, const struct kvf_gpu_batch *b,
                       const struct kvf_gpu_batch *alt, unsigned reps)
{
        double t[64];
        if (reps > 64)
                reps = 64;
        if (alt) {
                uint64_t tk = 0;
                BENCH_KVF(kvf_gpu_copy_submit(c, b, &tk));
                while (kvf_gpu_copy_poll(c, tk) == 0) {
                }
        }
        for (unsigned i = 0; i < reps; i++) {
                uint64_t tk = 0, h0 = bench_now_ns();
                BENCH_KVF(kvf_gpu_copy_submit(c, alt && !(i & 1) ? alt : b, &tk));
                int rc;
                while ((rc = kvf_gpu_copy_poll(c, tk)) == 0) {
                }
                if (rc < 0)
                        bench_die("copy failed: %s", kvf_gpu_err_msg());
                t[i] = (double)(bench_now_ns() - h0) / 1e3;
        }
        return median_us(t, reps);
}

/* One call per cache block, as FastDeploy does: runs are cut back into blocks. */
static double time_perblock(cudaStream_t s, const struct kvf_gpu_run *runs, size_t n,
                            uint64_t block_bytes, uint64_t sbase, uint64_t dbase, unsigned reps)
{
        double t[64];
        cudaEvent_t ev;
        BENCH_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        if (reps > 64)
                reps = 64;
        for (unsigned i = 0; i < reps; i++) {
                BENCH_CUDA(cudaStreamSynchronize(s));
                uint64_t h0 = bench_now_ns();
                for (size_t j = 0; j < n; j++)
                        for (uint64_t off = 0; off < runs[j].bytes; off += block_bytes)
                                BENCH_CUDA(cudaMemcpyAsync(
                                    (void *)(uintptr_t)(dbase + runs[j].dst_off + off),
                                    (const void *)(uintptr_t)(sbase + runs[j].src_off + off),
                                    block_bytes, cudaMemcpyDeviceToDevice, s));
                BENCH_CUDA(cudaEventRecord(ev, s));
                BENCH_CUDA(cudaEventSynchronize(ev));
                t[i] = (double)(bench_now_ns() - h0) / 1e3;
        }
        BENCH_CUDA(cudaEventDestroy(ev));
        return median_us(t, reps);
}

static int by_src(const void *a, const void *b)
{
        uint64_t x = ((const struct kvf_gpu_run *)a)->src_off, y = ((const struct kvf_gpu_run *)b)->src_off;
        return x < y ? -1 : x > y;
}

/* A step of STEP_LAYERS layers: the first stages its descriptors, the rest reuse them. */
#define STEP_LAYERS 32
static double step_us(const struct row *r)
{
        return (r->first_us + (STEP_LAYERS - 1) * r->next_us) / STEP_LAYERS;
}

static double step_e2e_us(const struct row *r)
{
        return (r->e2e_us + (STEP_LAYERS - 1) * r->e2e_next_us) / STEP_LAYERS;
}

static double gbps(uint64_t bytes, double us)
{
        return us > 0 ? (double)bytes / (us * 1e3) : NAN;
}

static void fmt_or_dash(char *buf, size_t len, const char *fmt, double v)
{
        if (isnan(v))
                snprintf(buf, len, "-");
        else
                snprintf(buf, len, fmt, v);
}

int main(int argc, char **argv)
{
        struct opts o;
        memset(&o, 0, sizeof(o));
        o.n_sizes = bench_parse_list("1,4,16,64,256", o.sizes, MAX_SIZES, 1ull << 20);
        o.n_blocks_extra = bench_parse_list("16,64", o.blocks_extra, MAX_SIZES, 1024);
        o.tps[0] = 1;
        o.tps[1] = 8;
        o.n_tps = 2;
        o.requests = 8;
        o.reps = 10;
        o.perblock_max = 256ull << 20;

        static const struct option lo[] = {{"sizes", required_argument, NULL, 's'},
                                           {"blocks", required_argument, NULL, 'b'},
                                           {"tp", required_argument, NULL, 't'},
                                           {"requests", required_argument, NULL, 'r'},
                                           {"reps", required_argument, NULL, 'n'},
                                           {"perblock-max", required_argument, NULL, 'p'},
                                           {"order", required_argument, NULL, 'o'},
                                           {"chunk", required_argument, NULL, 'c'},
                                           {"hints", required_argument, NULL, 'H'},
                                           {"device", required_argument, NULL, 'd'},
                                           {"json", required_argument, NULL, 'j'},
                                           {"help", no_argument, NULL, 'h'},
                                           {"version", no_argument, NULL, 'V'},
                                           {NULL, 0, NULL, 0}};
        int ch;
        while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
                uint64_t tmp[8];
                switch (ch) {
                case 's':
                        o.n_sizes = bench_parse_list(optarg, o.sizes, MAX_SIZES, 1ull << 20);
                        break;
                case 'b':
                        o.n_blocks_extra = bench_parse_list(optarg, o.blocks_extra, MAX_SIZES, 1024);
                        break;
                case 't':
                        o.n_tps = bench_parse_list(optarg, tmp, 8, 1);
                        for (unsigned i = 0; i < o.n_tps; i++)
                                o.tps[i] = (unsigned)tmp[i];
                        break;
                case 'r':
                        o.requests = (unsigned)atoi(optarg);
                        break;
                case 'n':
                        o.reps = (unsigned)atoi(optarg);
                        break;
                case 'o':
                        if (strcmp(optarg, "given") && strcmp(optarg, "src"))
                                bench_die("--order is given or src, not '%s'", optarg);
                        o.order_src = !strcmp(optarg, "src");
                        break;
                case 'c': {
                        unsigned long long kib = strtoull(optarg, NULL, 10);
                        if (!kib || kib > KVF_GPU_CHUNK_MAX / 1024)
                                bench_die("--chunk %s: 1 to %u KiB", optarg, KVF_GPU_CHUNK_MAX / 1024);
                        o.chunk = (uint32_t)(kib * 1024);
                        break;
                }
                case 'H':
                        if (strcmp(optarg, "plain") && strcmp(optarg, "evict-first"))
                                bench_die("--hints is plain or evict-first, not '%s'", optarg);
                        o.hints = strcmp(optarg, "plain") ? 0 : KVF_GPU_COPIER_PLAIN;
                        break;
                case 'p':
                        o.perblock_max = strtoull(optarg, NULL, 10) << 20;
                        break;
                case 'd':
                        o.device = atoi(optarg);
                        break;
                case 'j':
                        o.json = optarg;
                        break;
                case 'h':
                        usage(stdout);
                        return 0;
                case 'V':
                        printf("gpu_copy_bench %s\n", VERSION);
                        return 0;
                default:
                        usage(stderr);
                        return 2;
                }
        }
        if (optind != argc || !o.reps || !o.requests) {
                usage(stderr);
                return 2;
        }
        if (o.reps > 64)
                o.reps = 64;
        setvbuf(stdout, NULL, _IOLBF, 0);

        int n_dev = bench_require_gpu("gpu_copy_bench");
        if (o.device >= n_dev)
                bench_die("--device %d: %d devices", o.device, n_dev);
        BENCH_CUDA(cudaSetDevice(o.device));
        char desc[256];
        bench_describe_device(o.device, desc, sizeof(desc));
        printf("gpu_copy_bench %s: %s\n", VERSION, desc);

        struct shape shapes[MAX_SHAPES];
        unsigned n_shapes = make_shapes(&o, shapes);
        uint64_t max_size = 0;
        for (unsigned i = 0; i < o.n_sizes; i++)
                if (o.sizes[i] > max_size)
                        max_size = o.sizes[i];

        /* cs copies every batch's descriptors to the device first (the first design),
         * cm reads them from mapped host memory, cr is the default: mapped for a
         * step's first layer, kept on the device and reused shifted for the others. */
        struct kvf_gpu_copier *cs = NULL, *cm = NULL, *cr = NULL;
        struct kvf_gpu_copier_opts co = {NULL, ARENA_CHUNKS, o.chunk};
        BENCH_KVF(kvf_gpu_copier_create(o.device, KVF_GPU_COPIER_STAGED_DESC | o.hints, &co, &cs));
        BENCH_KVF(kvf_gpu_copier_create(o.device, KVF_GPU_COPIER_MAPPED_DESC | o.hints, &co, &cm));
        BENCH_KVF(kvf_gpu_copier_create(o.device, o.hints, &co, &cr));
        cudaStream_t s = (cudaStream_t)kvf_gpu_copier_stream(cs);
        struct bench_gate *gate = bench_gate_create();

        struct row *rows = (struct row *)calloc((size_t)n_shapes * o.n_sizes, sizeof(struct row));
        size_t n_rows = 0;
        int bad_rows = 0;
        uint64_t t_start = bench_now_ns();

        if (o.order_src)
                printf("runs in a batch: sorted by source offset (--order src)\n");
        if (o.chunk)
                printf("chunks of at most %u KiB (--chunk)\n", o.chunk / 1024);
        if (o.hints)
                printf("plain loads and stores, not evict-first (--hints plain)\n");
        printf("\nshapes (block = kv_heads/tp x %u tokens x head_dim x dtype):\n",
               KVF_BENCH_BLOCK_TOKENS);
        for (unsigned si = 0; si < n_shapes; si++)
                printf("  [%u] %llu KiB x %u tensor%s: %s\n", si + 1,
                       (unsigned long long)(shapes[si].block_bytes >> 10), shapes[si].tensors,
                       shapes[si].tensors > 1 ? "s (K, V)" : " (key only)", shapes[si].label);
        printf("\n%5s %6s %4s %8s %6s %6s | %8s %8s %6s %8s %6s %8s %6s %6s | %8s %8s %8s %9s %8s "
               "%6s | %s\n",
               "shape", "block", "tens", "batch", "runs", "chunks", "bulk", "staged", "x bulk",
               "first", "x bulk", "next", "x bulk", "step", "submit", "k-e2e", "b-e2e", "per-block",
               "per-blk", "x pb", "check");
        printf("%5s %6s %4s %8s %6s %6s | %8s %8s %6s %8s %6s %8s %6s %6s | %8s %8s %8s %9s %8s "
               "%6s |\n",
               "", "KiB", "", "MiB", "", "", "GB/s", "GB/s", "", "GB/s", "", "GB/s", "", "", "us",
               "us", "us", "us", "GB/s", "");
        for (unsigned si = 0; si < n_shapes; si++) {
                const struct shape *sh = &shapes[si];
                /* Twice the blocks the largest batch needs, so the scatter has room. */
                uint64_t per_tensor = max_size / ((uint64_t)sh->tensors * sh->block_bytes);
                struct bench_layout l = {LAYERS_ALLOC, sh->tensors, (uint32_t)(2 * per_tensor + 16),
                                         sh->block_bytes};
                uint64_t cache = bench_cache_bytes(&l);
                void *src = NULL, *dst = NULL;
                BENCH_KVF(kvf_gpu_alloc(o.device, cache, &src));
                BENCH_KVF(kvf_gpu_alloc(o.device, cache, &dst));
                bench_fill(src, cache, 0x5eed + si, s);
                BENCH_CUDA(cudaStreamSynchronize(s));
                struct kvf_gpu_region rs = {(uint64_t)(uintptr_t)src, cache};
                struct kvf_gpu_region rd = {(uint64_t)(uintptr_t)dst, cache};
                for (unsigned zi = 0; zi < o.n_sizes; zi++) {
                        uint32_t blocks =
                            (uint32_t)(o.sizes[zi] / ((uint64_t)sh->tensors * sh->block_bytes));
                        if (!blocks)
                                continue;
                        struct row *r = &rows[n_rows++];
                        r->sh = sh;
                        struct kvf_gpu_run *runs = NULL;
                        r->runs = bench_layer_runs(&l, 1, o.requests, blocks,
                                                   0xb10c + zi * 977 + si, &runs);
                        r->bytes = (uint64_t)blocks * sh->tensors * sh->block_bytes;
                        if (o.order_src)
                                qsort(runs, r->runs, sizeof(*runs), by_src);
                        BENCH_KVF(kvf_gpu_plan(
                            runs, r->runs, &rs, 1, &rd, 1,
                            o.chunk ? o.chunk
                                    : kvf_gpu_chunk_bytes_for(r->bytes, kvf_gpu_device_sms(o.device)),
                            NULL,
                            0, &r->chunks));
                        struct kvf_gpu_batch b = {runs, r->runs, &rs, 1, &rd, 1, NULL, NULL};
                        /* The same requests' next layer: every offset one layer on. */
                        uint64_t stride = (uint64_t)l.tensors * l.blocks * l.block_bytes;
                        struct kvf_gpu_run *runs2 =
                            (struct kvf_gpu_run *)malloc(r->runs * sizeof(*runs2));
                        if (!runs2)
                                bench_die("out of memory");
                        for (size_t i = 0; i < r->runs; i++) {
                                runs2[i] = runs[i];
                                runs2[i].src_off += stride;
                                runs2[i].dst_off += stride;
                        }
                        struct kvf_gpu_batch b2 = {runs2, r->runs, &rs, 1, &rd, 1, NULL, NULL};
                        /* The same runs in reverse order: not a shift of b, so every submit
                         * alternating between them writes fresh descriptors (a first layer). */
                        struct kvf_gpu_run *rrev =
                            (struct kvf_gpu_run *)malloc(r->runs * sizeof(*rrev));
                        if (!rrev)
                                bench_die("out of memory");
                        for (size_t i = 0; i < r->runs; i++)
                                rrev[i] = runs[r->runs - 1 - i];
                        struct kvf_gpu_batch brev = {rrev, r->runs, &rs, 1, &rd, 1, NULL, NULL};

                        /* Correctness first, for every descriptor path; cr copies layer 1
                         * staged, then layer 2 through the shifted descriptors. */
                        struct kvf_gpu_copier *both[4] = {cs, cm, cr, cr};
                        const struct kvf_gpu_batch *which[4] = {&b, &b, &b, &b2};
                        for (int k = 0; k < 4; k++) {
                                BENCH_CUDA(cudaMemsetAsync(dst, 0, cache, s));
                                BENCH_CUDA(cudaStreamSynchronize(s));
                                uint64_t tk = 0;
                                BENCH_KVF(kvf_gpu_copy_submit(both[k], which[k], &tk));
                                int rc;
                                while ((rc = kvf_gpu_copy_poll(both[k], tk)) == 0) {
                                }
                                if (rc < 0)
                                        bench_die("copy failed: %s", kvf_gpu_err_msg());
                                r->bad += bench_verify_runs(which[k]->runs, r->runs, &rs, 1, &rd, 1);
                        }
                        uint64_t n_staged = 0, n_reused = 0;
                        kvf_gpu_copier_counts(cr, &n_staged, &n_reused);
                        if (!n_reused)
                                bench_die("the next layer's batch was staged again: no reuse");
                        bad_rows += r->bad != 0;

                        /* Reps that fit the arena with a margin (16 K chunks for 256 MiB
                         * of 16 KiB blocks: 64 of those would not). */
                        unsigned reps = o.reps;
                        while (reps > 1 && (uint64_t)reps * r->chunks > ARENA_CHUNKS / 2)
                                reps--;
                        r->bulk_us = time_bulk(s, dst, src, r->bytes, reps, gate);
                        r->staged_us = time_kernel(cs, &b, NULL, reps, gate, NULL);
                        uint64_t f0, u0, f1, u1, f2, u2;
                        kvf_gpu_copier_counts(cr, &f0, &u0);
                        r->first_us = time_kernel(cr, &b, &brev, reps, gate, &r->submit_us);
                        kvf_gpu_copier_counts(cr, &f1, &u1);
                        r->next_us = time_kernel(cr, &b, &b2, reps, gate, NULL);
                        kvf_gpu_copier_counts(cr, &f2, &u2);
                        /* What each figure claims to be: every timed 'first' rep wrote
                         * fresh descriptors, every timed 'next' rep reused them (the untimed
                         * submit before each may do either). */
                        if (u1 - u0 > 1 || u2 - u1 < reps)
                                bench_die("row %zu: %llu reuses among the first layers, %llu of "
                                          "%u next layers reused",
                                          n_rows, (unsigned long long)(u1 - u0),
                                          (unsigned long long)(u2 - u1), reps);
                        r->e2e_us = time_e2e(cr, &b, &brev, reps);
                        r->e2e_next_us = time_e2e(cr, &b, &b2, reps);
                        r->bulk_e2e_us = time_bulk_e2e(s, dst, src, r->bytes, reps);
                        r->pb_us = NAN;
                        if (r->bytes <= o.perblock_max) {
                                /* At ~6 us a call, keep each figure to about a second. */
                                double est = (double)blocks * sh->tensors * 6.5;
                                unsigned pr =
                                    est * o.reps > 1.5e6 ? (unsigned)(1.5e6 / est) : o.reps;
                                r->pb_us = time_perblock(s, runs, r->runs, sh->block_bytes, rs.base,
                                                         rd.base, pr ? pr : 1);
                        }
                        free(runs);
                        free(runs2);
                        free(rrev);

                        char x_pb[16], pbt[16], pbg[16];
                        fmt_or_dash(pbt, sizeof(pbt), "%.0f", r->pb_us);
                        fmt_or_dash(pbg, sizeof(pbg), "%.1f", gbps(r->bytes, r->pb_us));
                        fmt_or_dash(x_pb, sizeof(x_pb), "%.0f", r->pb_us / step_e2e_us(r));
                        char sid[8];
                        snprintf(sid, sizeof(sid), "[%u]", si + 1);
                        printf("%5s %6llu %4u %8.2f %6zu %6zu | %8.0f %8.0f %6.2f %8.0f %6.2f %8.0f "
                               "%6.2f %6.2f | %8.1f %8.1f %8.1f %9s %8s %6s | %s\n",
                               sid, (unsigned long long)(sh->block_bytes >> 10), sh->tensors,
                               (double)r->bytes / (1 << 20), r->runs, r->chunks,
                               gbps(r->bytes, r->bulk_us), gbps(r->bytes, r->staged_us),
                               r->bulk_us / r->staged_us, gbps(r->bytes, r->first_us),
                               r->bulk_us / r->first_us, gbps(r->bytes, r->next_us),
                               r->bulk_us / r->next_us, r->bulk_us / step_us(r), r->submit_us,
                               step_e2e_us(r), r->bulk_e2e_us, pbt, pbg, x_pb,
                               r->bad ? "WRONG BYTES" : "ok");
                }
                BENCH_KVF(kvf_gpu_free(o.device, src));
                BENCH_KVF(kvf_gpu_free(o.device, dst));
        }

        /* Targets. */
        unsigned t1 = 0, t1_ok = 0, t1_first = 0, t2 = 0, t2_ok = 0, t2_limit_ok = 0;
        double worst1 = INFINITY, worst2 = INFINITY, worst1_first = INFINITY;
        char t2_misses[1024] = "";
        size_t t2m = 0;
        for (size_t i = 0; i < n_rows; i++) {
                const struct row *r = &rows[i];
                if (r->bytes >= (64ull << 20)) {
                        double x = r->bulk_us / step_us(r), xf = r->bulk_us / r->first_us;
                        t1++;
                        t1_ok += x >= 0.85;
                        t1_first += xf >= 0.85;
                        worst1 = fmin(worst1, x);
                        worst1_first = fmin(worst1_first, xf);
                }
                if (r->sh->block_bytes == 16384 && !isnan(r->pb_us)) {
                        double x = r->pb_us / step_e2e_us(r);
                        double lim = r->pb_us / r->bulk_e2e_us;
                        t2++;
                        t2_ok += x >= 50;
                        t2_limit_ok += lim >= 50;
                        worst2 = fmin(worst2, x);
                        if (x < 50 && t2m < sizeof(t2_misses))
                                t2m += (size_t)snprintf(
                                    t2_misses + t2m, sizeof(t2_misses) - t2m,
                                    "  %.2f MiB: kernel %.0f x per-block; the limit itself (one "
                                    "bulk cudaMemcpyAsync, b-e2e) %.0f x\n",
                                    (double)r->bytes / (1 << 20), x, lim);
                }
        }
        printf("\ntarget kernel >= 0.85 x bulk for batches >= 64 MiB (per layer over a step of %d "
               "layers, 'step'): %u of %u rows (worst %.2f) %s\n",
               STEP_LAYERS, t1_ok, t1, worst1, t1 && t1_ok == t1 ? "PASS" : "MISS");
        printf("  a step's first layer alone ('first'): %u of %u rows at "
               ">= 0.85 (worst %.2f)\n",
               t1_first, t1, worst1_first);
        printf("target kernel >= 50 x per-block at 16 KiB blocks (per-block vs k-e2e over a step): %u of %u "
               "rows (worst %.0f) %s\n",
               t2_ok, t2, worst2, t2 && t2_ok == t2 ? "PASS" : "MISS");
        printf("  the limit (one bulk cudaMemcpyAsync of the same bytes, host clock) reaches 50 x "
               "per-block in %u of those %u rows\n%s",
               t2_limit_ok, t2, t2_misses);
        printf("check: %s (%d rows with wrong bytes); %.1f s\n",
               bad_rows ? "FAIL" : "every byte of every kernel copy verified", bad_rows,
               (double)(bench_now_ns() - t_start) / 1e9);

        if (o.json) {
                FILE *f = fopen(o.json, "w");
                if (!f)
                        bench_die("%s: %s", o.json, strerror(errno));
                fprintf(f,
                        "{\"bench\": \"gpu_copy_bench\", \"version\": %s, \"device\": ", VERSION);
                bench_json_str(f, desc);
                fprintf(f, ", \"requests\": %u, \"reps\": %u, \"rows\": [\n", o.requests, o.reps);
                for (size_t i = 0; i < n_rows; i++) {
                        const struct row *r = &rows[i];
                        fprintf(f, "  {\"shape\": ");
                        bench_json_str(f, r->sh->label);
                        fprintf(f,
                                ", \"block_bytes\": %llu, \"tensors\": %u, \"bytes\": %llu, "
                                "\"runs\": %zu, \"chunks\": %zu, \"bulk_us\": %.3f, "
                                "\"kernel_staged_us\": %.3f, \"kernel_first_layer_us\": %.3f, "
                                "\"kernel_next_layer_us\": %.3f, "
                                "\"submit_us\": %.3f, \"kernel_e2e_first_layer_us\": %.3f, "
                                "\"kernel_e2e_next_layer_us\": %.3f, \"bulk_e2e_us\": %.3f, ",
                                (unsigned long long)r->sh->block_bytes, r->sh->tensors,
                                (unsigned long long)r->bytes, r->runs, r->chunks, r->bulk_us,
                                r->staged_us, r->first_us, r->next_us, r->submit_us, r->e2e_us,
                                r->e2e_next_us, r->bulk_e2e_us);
                        if (isnan(r->pb_us))
                                fprintf(f, "\"perblock_us\": null, ");
                        else
                                fprintf(f, "\"perblock_us\": %.3f, ", r->pb_us);
                        fprintf(f, "\"x_bulk\": %.4f, \"wrong_bytes\": %llu}%s\n",
                                r->bulk_us / step_us(r), (unsigned long long)r->bad,
                                i + 1 < n_rows ? "," : "");
                }
                fprintf(f,
                        "], \"targets\": {\"x_bulk_ge_0.85_at_64MiB\": {\"rows\": %u, \"ok\": %u}, "
                        "\"x_perblock_ge_50_at_16KiB\": {\"rows\": %u, \"ok\": %u}}}\n",
                        t1, t1_ok, t2, t2_ok);
                fclose(f);
                printf("json: %s\n", o.json);
        }
        bench_gate_destroy(gate);
        kvf_gpu_copier_destroy(cs);
        kvf_gpu_copier_destroy(cr);
        kvf_gpu_copier_destroy(cm);
        free(rows);
        return bad_rows ? 1 : 0;
}
