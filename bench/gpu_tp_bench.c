/*
 * gpu_tp_bench: throughput between tensor-parallel groups of different sizes on GPU caches,
 * with one engine process per rank, as a deployment runs them.
 *
 *   gpu_tp_bench P D [--heads N] [--head-dim N] [--layers N] [--bs P/D] [--tokens N]
 *                    [--requests N] [--passes N] [--warm] [--executor sender|engine]
 *                    [--backend cuda|host] [--mps] [--stats]
 *
 * Starts D decode and P prefill instances (tools/kvferry up, --tp/--rank/--nranks, one GPU),
 * then forks one engine process per rank before any CUDA call: each attaches to its own
 * instance alone (one engine session per rank). Prefill engines write their heads of every
 * request's blocks (a kernel per layer and tensor, gpu_tp_content.h) and submit one task per
 * decode rank they send to (common/tpsplit.h's split); decode engines zero their caches. Then,
 * timed: every prefill engine publishes the step's layers from its CUDA stream
 * (kvf_layer_done_on_stream: with --executor engine this also launches the copies, in that
 * engine's process) and waits for its completions. Each decode engine takes its arrivals and
 * checks every word of its heads of every token on the GPU. The time is from the first
 * engine's first layer-done to the last completion; the bytes are each decode rank's heads of
 * each token, once (the completions' sum must equal them). One line per run:
 *   tp P->D ...: N requests, B bytes in T ms (median of K passes, MIN to MAX), G GiB/s, ...
 * --mps: the instances start under NVIDIA's MPS (up --mps starts its daemon if none answers), so
 * every process's kernels, the engines' too, share the GPU side by side instead of taking turns.
 * --backend host runs the same on host caches (the content written and checked by the CPU), so
 * the driver itself is tested where there is no GPU. --stats adds a line per prefill rank: its
 * sender's copy batches, time submitting them and CPU time, per pass (the untimed one counted).
 * Exit 0 all verified, 1 a failure.
 */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu_tp_content.h"
#include "instances.h"
#include "kvferry.h"
#include "layout.h"
#include "tpsplit.h"

#define MAXR 8
#define MAXPASS 16

static struct {
        uint32_t p, d, heads, hdim, layers, bp, bd, tokens, nreq, passes, warm, mps, stats;
        const char *executor, *backend;
} o = {.heads = 8, .hdim = 128, .layers = 32, .bp = 64, .bd = 64, .tokens = 2048, .nreq = 100,
       .passes = 5, .executor = "engine", .backend = "cuda"};

/* Request q: tok[q] tokens (1 to 4 quarters of --tokens, every third one's last prefill block
 * half full) in nsrc[q] prefill blocks from src0[q] up, and ndst[q] decode blocks from dst0[q]
 * down (consecutive the other way, so whole blocks are never merged into one run). */
static uint32_t *tok, *nsrc, *ndst, *src0, *dst0, src_blocks, dst_blocks;

static void requests(void)
{
        tok = calloc(o.nreq, sizeof(*tok)), nsrc = calloc(o.nreq, sizeof(*nsrc));
        ndst = calloc(o.nreq, sizeof(*ndst)), src0 = calloc(o.nreq, sizeof(*src0));
        dst0 = calloc(o.nreq, sizeof(*dst0));
        CHECK(tok && nsrc && ndst && src0 && dst0);
        uint32_t s = 1, d = 1;
        for (uint32_t q = 0; q < o.nreq; q++) {
                uint32_t t = o.tokens / 4 * (4 - q % 4);
                t = (t + o.bp - 1) / o.bp * o.bp - (q % 3 == 1 ? o.bp / 2 : 0);
                tok[q] = t;
                nsrc[q] = (t + o.bp - 1) / o.bp;
                ndst[q] = (t + o.bd - 1) / o.bd;
                src0[q] = s, s += nsrc[q];
                d += ndst[q], dst0[q] = d - 1;
        }
        src_blocks = s + 1, dst_blocks = d + 1;
}

static uint32_t dst_block(uint32_t q, uint32_t b)
{
        return dst0[q] - b;
}

/* The heads of rank k of a group of n (replicated where the model has fewer than n). */
static void heads_of(uint32_t n, uint32_t k, uint32_t *first, uint32_t *count)
{
        CHECK_EQ(kvf_tp_heads(o.heads, n, k, first, count), 0);
}

/* Does prefill rank i send decode rank j any head? */
static int sends(uint32_t i, uint32_t j)
{
        uint32_t first, count;
        heads_of(o.d, j, &first, &count);
        for (uint32_t h = first; h < first + count; h++)
                if (kvf_tp_source(o.heads, o.p, o.d, j, h) == i)
                        return 1;
        return 0;
}

static char pname[MAXR][64], dname[MAXR][64];

/* ---- an engine process: lines from the driver in, lines out ---- */

struct eng {
        struct kvf_client *c;
        struct kvf_layout_info L;
        struct gtp_geom g;
        int dev; /* -1: host caches */
        void *stream;
        struct gtp_desc *descs, *ddescs;
        uint32_t ndesc;
        FILE *in, *out;
};

static void say(struct eng *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(struct eng *e, const char *fmt, ...)
{
        va_list ap;
        va_start(ap, fmt);
        vfprintf(e->out, fmt, ap);
        va_end(ap);
        fputc('\n', e->out);
        fflush(e->out);
}

/* A failure in an engine process: said to the driver, which stops the run. */
static void fail(struct eng *e, const char *fmt, ...) __attribute__((format(printf, 2, 3), noreturn));
static void fail(struct eng *e, const char *fmt, ...)
{
        char msg[512];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof(msg), fmt, ap);
        va_end(ap);
        say(e, "E %s", msg);
        _exit(1);
}

/* Attach to instance `name`, rank k of a group of n, with room for `blocks` descriptors. */
static void eng_open(struct eng *e, const char *name, uint32_t n, uint32_t k, uint32_t blocks)
{
        e->descs = calloc(blocks, sizeof(*e->descs));
        CHECK(e->descs);
        if (kvf_attach(name, 10000, &e->c) < 0)
                fail(e, "attach %s: %s", name, kvf_last_error());
        if (kvf_get_layout(e->c, &e->L) < 0)
                fail(e, "layout of %s: %s", name, kvf_last_error());
        heads_of(n, k, &e->g.first_head, &e->g.heads);
        e->g.block_bytes = e->L.block_bytes;
        e->g.block_tokens = e->L.block_size;
        e->g.row_words = o.hdim * 2 / 4;
        e->dev = kvf_cache_device(e->c);
        if ((e->dev < 0) != !strcmp(o.backend, "host"))
                fail(e, "%s: caches on device %d, wanted %s", name, e->dev, o.backend);
        if (e->dev >= 0 && gtp_gpu_open(e->dev, &e->stream) < 0)
                fail(e, "%s", gtp_gpu_error());
}

static void eng_descs(struct eng *e)
{
        if (e->dev >= 0 && gtp_gpu_descs(e->descs, e->ndesc, &e->ddescs) < 0)
                fail(e, "%s", gtp_gpu_error());
}

/* Write (check) every block of the descriptors in (layer l, tensor z): on the GPU, queued. */
static uint64_t content(struct eng *e, int check)
{
        uint64_t bad = 0;
        for (uint32_t l = 0; l < o.layers; l++)
                for (uint32_t z = 0; z < 2; z++) {
                        uint32_t *base = kvf_cache_tensor(e->c, l, (int)z);
                        if (!base)
                                fail(e, "no tensor (%u, %u)", l, z);
                        if (e->dev >= 0) {
                                int rc = check ? gtp_gpu_check(e->stream, base, e->ddescs, e->ndesc, e->g, l, z)
                                               : gtp_gpu_fill(e->stream, base, e->ddescs, e->ndesc, e->g, l, z);
                                if (rc < 0)
                                        fail(e, "%s", gtp_gpu_error());
                                continue;
                        }
                        for (uint32_t x = 0; x < e->ndesc; x++) {
                                const struct gtp_desc *d = &e->descs[x];
                                uint32_t *blk = base + (uint64_t)d->block * (e->g.block_bytes / 4);
                                for (uint32_t h = 0; h < e->g.heads; h++)
                                        for (uint32_t t = 0; t < e->g.block_tokens; t++) {
                                                uint32_t *row = blk + ((uint64_t)h * e->g.block_tokens + t) * e->g.row_words;
                                                if (check && t >= d->ntok)
                                                        continue;
                                                for (uint32_t w = 0; w < e->g.row_words; w++) {
                                                        uint32_t v = gtp_word(d->req, e->g.first_head + h,
                                                                              d->token0 + t, w, l, z);
                                                        if (!check)
                                                                row[w] = v;
                                                        else
                                                                bad += row[w] != v;
                                                }
                                        }
                        }
                }
        if (e->dev >= 0 && gtp_gpu_sync(e->stream, &bad) < 0)
                fail(e, "%s", gtp_gpu_error());
        return bad;
}

static char *next_line(struct eng *e, char *buf, size_t n)
{
        if (!fgets(buf, (int)n, e->in))
                _exit(1); /* the driver is gone */
        return buf;
}

/* The next event of `type` (event n of `of`), which must say finished: its bytes. */
static uint64_t finished(struct eng *e, int type, const char *what, uint32_t n, uint32_t of)
{
        struct kvf_event ev;
        do {
                int rc = kvf_poll(e->c, &ev, 60000);
                if (rc != 1)
                        fail(e, "%s %u of %u: %s", what, n, of, rc ? kvf_last_error() : "none in 60 s");
        } while (ev.type != type);
        if (ev.status != KVF_STATUS_FINISHED)
                fail(e, "%s: %s: %s", ev.request_id, kvf_status_name(ev.status), ev.reason);
        return ev.bytes;
}

static void prefill_engine(uint32_t i, FILE *in, FILE *out)
{
        struct eng e = {.in = in, .out = out};
        eng_open(&e, pname[i], o.p, i, src_blocks);
        for (uint32_t q = 0; q < o.nreq; q++)
                for (uint32_t b = 0; b < nsrc[q]; b++)
                        e.descs[e.ndesc++] = (struct gtp_desc){src0[q] + b, q, b * o.bp, o.bp};
        eng_descs(&e);
        content(&e, 0);
        uint32_t *src = calloc(src_blocks, sizeof(*src)), *dst = calloc(dst_blocks, sizeof(*dst));
        CHECK(src && dst);
        say(&e, "R");
        char line[64];
        uint32_t tasks = 0;
        uint64_t accepted = 0;
        while (next_line(&e, line, sizeof(line))[0] == 'T') {
                unsigned pass = (unsigned)atoi(line + 2);
                uint64_t step = kvf_last_step(e.c) + 1;
                tasks = 0;
                for (uint32_t q = 0; q < o.nreq; q++)
                        for (uint32_t j = 0; j < o.d; j++) {
                                if (!sends(i, j))
                                        continue;
                                for (uint32_t b = 0; b < nsrc[q]; b++)
                                        src[b] = src0[q] + b;
                                for (uint32_t b = 0; b < ndst[q]; b++)
                                        dst[b] = dst_block(q, b);
                                char id[64];
                                snprintf(id, sizeof(id), "p%u.q%u.d%u", pass, q, j);
                                struct kvf_task t = {.request_id = id,
                                                     .src_block_ids = src,
                                                     .n_src = nsrc[q],
                                                     .dest_block_ids = dst,
                                                     .n_dest = ndst[q],
                                                     .current_id = step,
                                                     .transport = KVF_TRANSPORT_IPC,
                                                     .peer = dname[j]};
                                if (kvf_submit_task(e.c, &t) < 0)
                                        fail(&e, "task %s: %s", id, kvf_last_error());
                                tasks++;
                        }
                /* the sender has every task (with --executor engine, its plan entries open) */
                accepted += tasks;
                if (t_wait_counter(pname[i], KVF_CTR_TASKS_ACCEPTED, accepted, 30000, "the tasks") < 0)
                        fail(&e, "the sender did not take the tasks");
                say(&e, "R");
                if (next_line(&e, line, sizeof(line))[0] != 'G')
                        fail(&e, "wanted G, got %s", line);
                uint64_t t0 = kvf_now_ns();
                for (uint32_t l = 0; l < o.layers; l++) {
                        int rc = e.dev >= 0 ? kvf_layer_done_on_stream(e.c, e.stream, step, l)
                                            : kvf_layer_done(e.c, step, l);
                        if (rc < 0)
                                fail(&e, "layer %u: %s", l, kvf_last_error());
                }
                uint64_t bytes = 0, tpub = kvf_now_ns(), tfirst = 0;
                for (uint32_t n = 0; n < tasks; n++) {
                        bytes += finished(&e, KVF_EVENT_COMPLETION, "completion", n, tasks);
                        if (!n)
                                tfirst = kvf_now_ns();
                }
                say(&e, "D %" PRIu64 " %" PRIu64 " %" PRIu64 " %u %" PRIu64 " %" PRIu64, t0, kvf_now_ns(), bytes,
                    tasks, tpub, tfirst);
        }
        if (e.dev >= 0)
                gtp_gpu_sync(e.stream, NULL);
        kvf_detach(e.c);
        _exit(0);
}

static void decode_engine(uint32_t j, FILE *in, FILE *out)
{
        struct eng e = {.in = in, .out = out};
        eng_open(&e, dname[j], o.d, j, dst_blocks);
        for (uint32_t q = 0; q < o.nreq; q++)
                for (uint32_t b = 0; b < ndst[q]; b++) {
                        uint32_t left = tok[q] - b * o.bd;
                        e.descs[e.ndesc++] =
                            (struct gtp_desc){dst_block(q, b), q, b * o.bd, left < o.bd ? left : o.bd};
                }
        eng_descs(&e);
        const uint32_t sources = kvf_tp_sources(o.heads, o.p, o.d, j);
        const uint64_t tensor_bytes = (uint64_t)e.L.num_blocks * e.L.block_bytes;
        char line[64];
        for (;;) {
                next_line(&e, line, sizeof(line));
                if (line[0] == 'X')
                        break;
                if (line[0] == 'Z') { /* a stale pass's bytes must not pass the next check */
                        for (uint32_t l = 0; l < o.layers; l++)
                                for (uint32_t z = 0; z < 2; z++) {
                                        void *t = kvf_cache_tensor(e.c, l, (int)z);
                                        if (e.dev < 0)
                                                memset(t, 0, tensor_bytes);
                                        else if (gtp_gpu_zero(e.stream, t, tensor_bytes) < 0)
                                                fail(&e, "%s", gtp_gpu_error());
                                }
                        if (e.dev >= 0 && gtp_gpu_sync(e.stream, NULL) < 0)
                                fail(&e, "%s", gtp_gpu_error());
                        say(&e, "R");
                        continue;
                }
                /* W: every request's arrival from each source, then every word checked */
                for (uint32_t n = 0; n < o.nreq * sources; n++)
                        finished(&e, KVF_EVENT_ARRIVAL, "arrival", n, o.nreq * sources);
                uint64_t t = kvf_now_ns(), bad = content(&e, 1), words = 0;
                for (uint32_t x = 0; x < e.ndesc; x++)
                        words += (uint64_t)e.descs[x].ntok * e.g.heads * e.g.row_words * o.layers * 2;
                say(&e, "C %" PRIu64 " %" PRIu64 " %" PRIu64, t, words, bad);
        }
        kvf_detach(e.c);
        _exit(0);
}

/* ---- the driver ---- */

struct child {
        pid_t pid;
        FILE *to, *from;
};

static struct child spawn(void (*fn)(uint32_t, FILE *, FILE *), uint32_t k)
{
        int down[2], up[2];
        CHECK(pipe(down) == 0 && pipe(up) == 0);
        fflush(NULL);
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
                close(down[1]), close(up[0]);
                fn(k, fdopen(down[0], "r"), fdopen(up[1], "w"));
                _exit(0);
        }
        close(down[0]), close(up[1]);
        struct child c = {pid, fdopen(down[1], "w"), fdopen(up[0], "r")};
        CHECK(c.to && c.from);
        return c;
}

static void tell(struct child *c, const char *line)
{
        fprintf(c->to, "%s\n", line);
        fflush(c->to);
}

static void hear(struct child *c, const char *who, char want, char *buf, size_t n)
{
        if (!fgets(buf, (int)n, c->from)) {
                fprintf(stderr, "gpu_tp_bench: %s ended without a word\n", who);
                exit(1);
        }
        if (buf[0] != want) {
                fprintf(stderr, "gpu_tp_bench: %s: %s", who, buf[0] == 'E' ? buf + 2 : buf);
                exit(1);
        }
}

static int cmp_u64(const void *a, const void *b)
{
        uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
        return x < y ? -1 : x > y;
}

/* Begin the n instances of a group (their names into names[]); with MPS the very first is waited
 * for, as it starts the MPS daemon that the others then find. */
static void start_group(char names[][64], const char *role, uint32_t n, uint32_t bsize,
                        uint32_t blocks, uint32_t table, const char *exec)
{
        for (uint32_t k = 0; k < n; k++) {
                snprintf(names[k], 64, "gtp%d%c%u", (int)getpid(), role[0], k);
                t_up_start(names[k],
                           "--role %s --layers %u --kv-heads %u --head-dim %u --dtype bf16 --tp %u --rank %u "
                           "--nranks %u --block-size %u --blocks %u --max-requests %u --backend %s %s",
                           role, o.layers, o.heads, o.hdim, n, k, n, bsize, blocks, table, o.backend, exec);
                if (o.mps && t_ninstances == 1)
                        t_up_wait();
        }
}

/* The sender's CPU time (utime + stime) in ms, from /proc; -1 when it cannot be read. */
static double cpu_ms(int pid)
{
        char path[64], buf[1024];
        snprintf(path, sizeof(path), "/proc/%d/stat", pid);
        FILE *f = fopen(path, "r");
        size_t n = f ? fread(buf, 1, sizeof(buf) - 1, f) : 0;
        if (f)
                fclose(f);
        buf[n] = 0;
        char *p = strrchr(buf, ')');
        unsigned long ut, st;
        if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
                return -1;
        return (ut + st) * 1000.0 / (double)sysconf(_SC_CLK_TCK);
}

/* A histogram's p99, never above its max (a bucket's upper bound may be). */
static double q99(const struct kvf_histogram *h)
{
        uint64_t q = kvf_hist_quantile(h, 0.99);
        return (double)(q < h->max ? q : h->max);
}

/* --stats: what each prefill sender did, per pass (the untimed one included): its copy batches
 * (with the sender's executor, one kernel each), its time submitting them (building the runs'
 * descriptors and launching, kvf-ringdump's copy_batch_ns), and its CPU time. */
static void sender_stats(uint32_t npasses)
{
        for (uint32_t i = 0; i < o.p; i++) {
                struct kvf_ctl c;
                if (kvf_ctl_attach(pname[i], false, &c) < 0) {
                        printf("stats %s: %s\n", pname[i], kvf_err_msg());
                        continue;
                }
                struct kvf_histogram h, lc, ld;
                memcpy(&h, &c.sender->hist[KVF_HIST_COPY], sizeof(h));
                memcpy(&lc, &c.sender->hist[KVF_HIST_LAYER_TO_COPY], sizeof(lc));
                memcpy(&ld, &c.sender->hist[KVF_HIST_LAST_TO_DONE], sizeof(ld));
                int pid = (int)kvf_load_relaxed(&c.roles[KVF_ROLE_SENDER].pid);
                uint64_t descs = kvf_load_relaxed(&c.counters[KVF_CTR_BLOCKS_IPC].value);
                uint64_t slices = kvf_load_relaxed(&c.counters[KVF_CTR_COPY_SLICES].value);
                uint64_t reused = kvf_load_relaxed(&c.counters[KVF_CTR_COPY_BATCHES_REUSED].value);
                kvf_ctl_detach(&c);
                double cpu = cpu_ms(pid);
                printf("stats prefill rank %u: %.1f copy batches a pass, %.3f ms submitting them "
                       "(%.1f us each, max %.1f us; %.1f ran the descriptors of the batch before), %.1f backlog slices, %.0f blocks; sender CPU %.1f ms a pass\n",
                       i, (double)h.count / npasses, h.sum / 1e6 / npasses,
                       h.count ? h.sum / 1e3 / (double)h.count : 0.0, h.max / 1e3, (double)reused / npasses, (double)slices / npasses,
                       (double)descs / npasses, cpu < 0 ? -1.0 : cpu / npasses);
                printf("stats prefill rank %u: layer-done -> its copy started p50 %.1f us, p99 %.1f, max %.1f; a "
                       "request's last layer -> its completion p50 %.1f us, p99 %.1f, max %.1f\n",
                       i, kvf_hist_quantile(&lc, 0.5) / 1e3, q99(&lc) / 1e3, lc.max / 1e3,
                       kvf_hist_quantile(&ld, 0.5) / 1e3, q99(&ld) / 1e3, ld.max / 1e3);
        }
}

static void usage(void)
{
        fprintf(stderr, "usage: gpu_tp_bench P D [--heads N] [--head-dim N] [--layers N] [--bs P/D] "
                        "[--tokens N] [--requests N] [--passes N] [--warm] [--executor sender|engine] "
                        "[--backend cuda|host] [--mps] [--stats]\n");
        exit(2);
}

int main(int argc, char **argv)
{
        if (argc < 3)
                usage();
        o.p = (uint32_t)atoi(argv[1]), o.d = (uint32_t)atoi(argv[2]);
        for (int a = 3; a < argc; a++) {
                const char *v = a + 1 < argc ? argv[a + 1] : NULL;
                if (!strcmp(argv[a], "--warm") || !strcmp(argv[a], "--mps") || !strcmp(argv[a], "--stats")) {
                        *(argv[a][2] == 'w' ? &o.warm : argv[a][2] == 'm' ? &o.mps : &o.stats) = 1;
                        continue;
                }
                if (!v)
                        usage();
                a++;
                if (!strcmp(argv[a - 1], "--heads"))
                        o.heads = (uint32_t)atoi(v);
                else if (!strcmp(argv[a - 1], "--head-dim"))
                        o.hdim = (uint32_t)atoi(v);
                else if (!strcmp(argv[a - 1], "--layers"))
                        o.layers = (uint32_t)atoi(v);
                else if (!strcmp(argv[a - 1], "--bs")) {
                        if (sscanf(v, "%u/%u", &o.bp, &o.bd) != 2)
                                usage();
                } else if (!strcmp(argv[a - 1], "--tokens"))
                        o.tokens = (uint32_t)atoi(v);
                else if (!strcmp(argv[a - 1], "--requests"))
                        o.nreq = (uint32_t)atoi(v);
                else if (!strcmp(argv[a - 1], "--passes"))
                        o.passes = (uint32_t)atoi(v);
                else if (!strcmp(argv[a - 1], "--executor"))
                        o.executor = v;
                else if (!strcmp(argv[a - 1], "--backend"))
                        o.backend = v;
                else
                        usage();
        }
        if (o.p < 1 || o.p > MAXR || o.d < 1 || o.d > MAXR || o.heads < 1 || o.hdim < 2 || o.hdim % 2 ||
            o.layers < 1 || o.bp < 2 || o.bd < 2 || (o.bp % o.bd && o.bd % o.bp) || o.tokens < 4 * o.bp ||
            o.nreq < 1 || o.passes < 1 || o.passes + o.warm > MAXPASS ||
            (strcmp(o.backend, "cuda") && strcmp(o.backend, "host")) ||
            (strcmp(o.executor, "engine") && strcmp(o.executor, "sender"))) {
                fprintf(stderr, "gpu_tp_bench: an option is out of range\n");
                usage();
        }
        requests();
        /* one request's tasks from each prefill rank: the sender's table holds a pass */
        uint32_t table = o.nreq * o.d + 16;
        char exec[64] = "";
        if (!strcmp(o.backend, "cuda"))
                snprintf(exec, sizeof(exec), "--executor %s%s", o.executor, o.mps ? " --mps" : "");
        start_group(dname, "decode", o.d, o.bd, dst_blocks, table, exec);
        start_group(pname, "prefill", o.p, o.bp, src_blocks, table, exec);
        t_up_wait();
        /* no CUDA in this process: the engines fork from it */
        struct child P[MAXR], D[MAXR];
        char line[256], who[64];
        for (uint32_t j = 0; j < o.d; j++)
                D[j] = spawn(decode_engine, j);
        for (uint32_t i = 0; i < o.p; i++)
                P[i] = spawn(prefill_engine, i);
        for (uint32_t i = 0; i < o.p; i++) {
                snprintf(who, sizeof(who), "prefill rank %u", i);
                hear(&P[i], who, 'R', line, sizeof(line)); /* its content written */
        }
        /* the bytes every pass must move: each decode rank's heads of each token, once */
        uint64_t want = 0, tokens = 0, runs = 0;
        for (uint32_t j = 0; j < o.d; j++) {
                uint32_t first, count;
                heads_of(o.d, j, &first, &count);
                for (uint32_t q = 0; q < o.nreq; q++) {
                        tokens += (uint64_t)tok[q] * count * o.hdim * 2 * 2 * o.layers;
                        /* the copies move whole source blocks' rows, as far as the
                         * destination blocks reach (a half-full last block's rows too) */
                        for (uint32_t b = 0; b < ndst[q]; b++) {
                                uint32_t in = nsrc[q] * o.bp - b * o.bd;
                                want += (uint64_t)(in < o.bd ? in : o.bd) * count * o.hdim * 2 * 2 * o.layers;
                        }
                }
        }
        /* copy runs per request: the plan's pieces of each source block (sender/copies.c's runs) */
        for (uint32_t i = 0; i < o.p; i++)
                for (uint32_t j = 0; j < o.d; j++) {
                        if (!sends(i, j))
                                continue;
                        struct kvf_cache_layout pl, dl;
                        struct kvf_tp_plan plan;
                        uint32_t pf, pc, df, dc;
                        heads_of(o.p, i, &pf, &pc);
                        heads_of(o.d, j, &df, &dc);
                        CHECK_EQ(kvf_layout_make(&pl, o.layers, 0, 64, pc, o.bp, o.hdim, KVF_DTYPE_BF16, 0), 0);
                        CHECK_EQ(kvf_layout_make(&dl, o.layers, 0, 64, dc, o.bd, o.hdim, KVF_DTYPE_BF16, 0), 0);
                        CHECK_EQ(kvf_tp_plan(&pl, o.p, i, &dl, o.d, j, o.heads, &plan), 0);
                        for (uint32_t q = 0; q < o.nreq; q++)
                                for (uint32_t b = 0; b < nsrc[q]; b++)
                                        for (uint32_t x = 0; x < plan.npieces; x++)
                                                runs += plan.pieces[x].sblk == b % plan.src_per_group &&
                                                        b / plan.src_per_group * plan.dst_per_group +
                                                                plan.pieces[x].dblk < ndst[q];
                        kvf_tp_plan_free(&plan);
                }
        runs *= 2ull * o.layers;
        uint32_t pairs = 0; /* tasks per request: (prefill rank, decode rank it sends to) */
        for (uint32_t i = 0; i < o.p; i++)
                for (uint32_t j = 0; j < o.d; j++)
                        pairs += (uint32_t)sends(i, j);
        uint64_t times[MAXPASS];
        for (uint32_t pass = 0; pass < o.warm + o.passes; pass++) {
                for (uint32_t j = 0; j < o.d; j++)
                        tell(&D[j], "Z");
                for (uint32_t j = 0; j < o.d; j++) {
                        snprintf(who, sizeof(who), "decode rank %u", j);
                        hear(&D[j], who, 'R', line, sizeof(line));
                }
                snprintf(line, sizeof(line), "T %u", pass);
                for (uint32_t i = 0; i < o.p; i++)
                        tell(&P[i], line);
                for (uint32_t i = 0; i < o.p; i++) {
                        snprintf(who, sizeof(who), "prefill rank %u", i);
                        hear(&P[i], who, 'R', line, sizeof(line));
                }
                for (uint32_t j = 0; j < o.d; j++)
                        tell(&D[j], "W");
                for (uint32_t i = 0; i < o.p; i++)
                        tell(&P[i], "G");
                uint64_t first = UINT64_MAX, last = 0, bytes = 0;
                for (uint32_t i = 0; i < o.p; i++) {
                        uint64_t t0, t1, b, tpub, tfirst;
                        unsigned n;
                        snprintf(who, sizeof(who), "prefill rank %u", i);
                        hear(&P[i], who, 'D', line, sizeof(line));
                        CHECK(sscanf(line + 2, "%" SCNu64 " %" SCNu64 " %" SCNu64 " %u %" SCNu64 " %" SCNu64, &t0, &t1,
                                     &b, &n, &tpub, &tfirst) == 6);
                        if (o.stats)
                                printf("timeline pass %u prefill rank %u: layers published %.3f ms, first completion "
                                       "%.3f ms, last %.3f ms (from its first layer-done)\n",
                                       pass, i, (tpub - t0) / 1e6, (tfirst - t0) / 1e6, (t1 - t0) / 1e6);
                        first = t0 < first ? t0 : first;
                        last = t1 > last ? t1 : last;
                        bytes += b;
                }
                uint64_t checked = 0;
                for (uint32_t j = 0; j < o.d; j++) {
                        uint64_t t, words, bad;
                        snprintf(who, sizeof(who), "decode rank %u", j);
                        hear(&D[j], who, 'C', line, sizeof(line));
                        CHECK(sscanf(line + 2, "%" SCNu64 " %" SCNu64 " %" SCNu64, &t, &words, &bad) == 3);
                        if (bad) {
                                fprintf(stderr, "gpu_tp_bench: tp %u->%u pass %u: %" PRIu64 " of %" PRIu64
                                                " words differ on decode rank %u\n", o.p, o.d, pass, bad, words, j);
                                return 1;
                        }
                        checked += words * 4;
                }
                if (bytes != want || checked != tokens) {
                        fprintf(stderr, "gpu_tp_bench: tp %u->%u pass %u: completions say %" PRIu64
                                        " bytes (wanted %" PRIu64 "), %" PRIu64 " checked (wanted %" PRIu64 ")\n",
                                o.p, o.d, pass, bytes, want, checked, tokens);
                        return 1;
                }
                if (pass >= o.warm)
                        times[pass - o.warm] = last - first;
        }
        if (o.stats)
                sender_stats(o.warm + o.passes);
        for (uint32_t i = 0; i < o.p; i++)
                tell(&P[i], "X");
        for (uint32_t j = 0; j < o.d; j++)
                tell(&D[j], "X");
        int ok = 1;
        for (uint32_t k = 0; k < o.p + o.d; k++) {
                int st;
                pid_t pid = k < o.p ? P[k].pid : D[k - o.p].pid;
                ok &= waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0;
        }
        CHECK(ok);
        qsort(times, o.passes, sizeof(times[0]), cmp_u64);
        uint64_t med = times[o.passes / 2];
        printf("tp %u->%u, %u kv heads, %u/%u tokens/block, %u layers, %s caches, executor %s%s: %u requests, "
               "%" PRIu64 " bytes in %.3f ms (median of %u passes, %.3f to %.3f), %.2f GiB/s, %" PRIu64
               " bytes of tokens verified a pass; %.1f copy runs, %.0f tasks per request\n",
               o.p, o.d, o.heads, o.bp, o.bd, o.layers, o.backend, !strcmp(o.backend, "host") ? "sender" : o.executor, o.mps ? " under MPS" : "", o.nreq, want, med / 1e6,
               o.passes, times[0] / 1e6, times[o.passes - 1] / 1e6, want / (med / 1e9) / (1 << 30), tokens,
               (double)runs / o.nreq, (double)pairs);
        return 0;
}
