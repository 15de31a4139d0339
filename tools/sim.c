/*
 * kvf-sim: an inference-engine simulator for both roles, so the whole
 * pipeline runs and is verified byte for byte without an engine.
 *
 * Prefill side (one kvf_client per rank): admits requests whose prompt
 * lengths come from a trace, reserves source blocks, submits tasks (per
 * query, or chunked with chunk records), writes deterministic content per
 * (request, rank, layer, tensor, block) into its cache layer by layer, and
 * publishes a layer-done event after each layer at a chosen compute time.
 * Decode side: reserves destination blocks (fewer with a prefix hit),
 * receives arrivals, verifies every byte of every destination block, and
 * frees the blocks for reuse.
 *
 * A request counts as correct when its completion says "finished" and its
 * arrival verified; a completion "finished" whose bytes do not verify is a
 * corruption, and makes the run fail.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "ctl.h"
#include "err.h"
#include "kvferry.h"
#include "layout.h"
#include "opts.h"
#include "sim_sessions.h"

static const char *prog = "kvf-sim";

#define MAX_RANKS 8

struct req {
        uint32_t seq;
        char id[48];
        uint32_t tokens, n_src, n_dst, first;
        uint32_t *src, *dst;
        uint32_t done_tokens;   /* prefilled so far */
        uint64_t last_layer_ns; /* publish time of its final layer */
        uint32_t last_blocks;   /* blocks its final step sends per layer and tensor */
        bool late_task;         /* submit the task after its layers are published */
        bool cancel;            /* cancel it halfway through its step */
        bool cancel_sent;       /* ... and did (counted once in cancels_sent) */
        bool submitted, computed;
        int completion; /* -1 until known */
        int arrival;    /* -1 until known */
        bool verified;
        uint64_t bytes, arrival_ns, completion_ns, completion_seen_ns;
        bool src_freed, dst_freed;
        char reason[240];
};

struct pool {
        uint32_t *free;
        uint32_t n, cap;
};

struct opts {
        const char *prefill[MAX_RANKS], *decode[MAX_RANKS];
        const char *peer[MAX_RANKS]; /* what tasks name as the peer (default: the decode instance) */
        unsigned ranks;
        unsigned requests;
        const char *trace;
        unsigned layer_us;
        unsigned step_tokens;
        unsigned chunk_tokens;
        unsigned prefix_pct, late_pct, cancel_pct;
        unsigned max_tokens;
        unsigned timeout_s;
        int transport;
        uint64_t seed;
        const char *json;
        const char *session_log;
        unsigned drain_previous_s;
        bool quiet;
        bool baseline;
        bool warm_caches;
};

static struct opts o;
static struct kvf_group *pg, *dg;
static struct kvf_layout_info L;
static uint32_t layers, tensors;
static struct req *reqs;
static unsigned nreq;
static struct pool psrc, pdst;
static uint64_t corrupt, verified_bytes, moved_bytes, done_reqs, finished, failed, bad_status_pairs;
static uint64_t fail_by_status[KVF_STATUS_COUNT];
/* Requests the engine cancelled (--cancel-pct): each ends 'cancelled', or 'finished' when its
 * bytes had all landed before the cancel was read. */
static uint64_t cancels_sent;
/* Per finished request: its transfer tail, and what the tail had to carry. */
struct tail {
        uint64_t ns;   /* last layer-done -> arrival */
        uint64_t cns;  /* last layer-done -> completion (prefill side) */
        uint64_t left; /* bytes left to send at its last layer-done: its final step's share
                          of one layer, or all of it when its task came after the layers */
        bool late;     /* its task came after its last layer */
};
static struct tail *tails;
static unsigned ntails;
static uint64_t t_start;
static int stop; /* set by a signal (kvf_opt_signals): read with kvf_load_relaxed */ /* SIGTERM/SIGINT: admit no more, let what was admitted finish */

static uint64_t rng_state;
static uint64_t rnd(void)
{
        uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
}

static uint64_t mix(uint64_t x)
{
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdull;
        x ^= x >> 33;
        x *= 0xc4ceb9fe1a85ec53ull;
        x ^= x >> 33;
        return x;
}

/* The content of block j (in request token order) of one tensor; `partial` for an unfinished block. */
static uint64_t block_key(uint32_t seq, unsigned rank, uint32_t layer, uint32_t t, uint32_t j, bool partial)
{
        return mix(((uint64_t)seq << 20) ^ ((uint64_t)rank << 56) ^ ((uint64_t)layer << 40) ^
                   ((uint64_t)t << 39) ^ j ^ ((uint64_t)partial << 62));
}

/*
 * --verify full writes and checks every word of every block. --verify sample
 * does the first and last 64 bytes of each block only: every block still
 * carries its own key at both ends (a block sent to the wrong place, or too
 * early, or torn at either end, is caught) while the simulator stops eating
 * a core that a GPU engine would not use; benchmarks use it.
 */
static bool sample_only;

/* Word k of a block stamped with key. */
static inline uint64_t pattern(uint64_t key, uint64_t k)
{
        return key + k * 0x9e3779b97f4a7c15ull;
}

/* The words of an n-word block that fill() and check() visit: all, or with --verify sample
 * the first 8 and the last 8 (k jumps from 8 to n - 8). */
static inline uint64_t next_word(uint64_t k, uint64_t n)
{
        return sample_only && n > 16 && k == 7 ? n - 8 : k + 1;
}

static void fill(uint8_t *p, uint64_t bytes, uint64_t key)
{
        uint64_t *w = (uint64_t *)(void *)p, n = bytes / 8;
        for (uint64_t k = 0; k < n; k = next_word(k, n))
                w[k] = pattern(key, k);
}

static bool check(const uint8_t *p, uint64_t bytes, uint64_t key)
{
        const uint64_t *w = (const uint64_t *)(const void *)p;
        uint64_t n = bytes / 8;
        for (uint64_t k = 0; k < n; k = next_word(k, n))
                if (w[k] != pattern(key, k))
                        return false;
        return true;
}

static bool scatter; /* --scatter: block ids in random order, so no two are contiguous */

static int pool_init(struct pool *p, uint32_t n)
{
        p->free = malloc(n * sizeof(uint32_t));
        if (!p->free)
                return -ENOMEM;
        /* Blocks handed out lowest first, like an engine's free list at start. */
        for (uint32_t i = 0; i < n; i++)
                p->free[i] = n - 1 - i;
        for (uint32_t i = n; scatter && i > 1; i--) {
                uint32_t j = (uint32_t)(rnd() % i), t = p->free[i - 1];
                p->free[i - 1] = p->free[j];
                p->free[j] = t;
        }
        p->n = p->cap = n;
        return 0;
}

static bool pool_take(struct pool *p, uint32_t n, uint32_t *out)
{
        if (p->n < n)
                return false;
        for (uint32_t i = 0; i < n; i++)
                out[i] = p->free[--p->n];
        return true;
}

static void pool_give(struct pool *p, const uint32_t *ids, uint32_t n)
{
        for (uint32_t i = n; i-- > 0;)
                p->free[p->n++] = ids[i];
}

static int load_trace(const char *path, unsigned want)
{
        FILE *f = fopen(path, "r");
        char line[65536];
        if (!f) {
                fprintf(stderr, "%s: trace %s: %s\n", prog, path, strerror(errno));
                return -1;
        }
        reqs = calloc(want, sizeof(*reqs));
        nreq = 0;
        uint32_t maxtok = o.max_tokens;
        while (nreq < want && fgets(line, sizeof(line), f)) {
                char *p = strstr(line, "\"input_length\"");
                if (!p)
                        continue;
                p = strchr(p, ':');
                unsigned long v = p ? strtoul(p + 1, NULL, 10) : 0;
                if (v == 0)
                        continue;
                struct req *r = &reqs[nreq];
                r->seq = nreq;
                r->tokens = v > maxtok ? maxtok : (uint32_t)v;
                nreq++;
        }
        fclose(f);
        if (nreq == 0) {
                fprintf(stderr, "%s: trace %s has no input_length entries\n", prog, path);
                return -1;
        }
        /* A short trace is replayed from the start. */
        for (unsigned i = nreq; i < want; i++) {
                reqs[i] = reqs[i % nreq];
                reqs[i].seq = i;
        }
        nreq = want;
        return 0;
}

static void free_src(struct req *r)
{
        if (!r->src_freed) {
                pool_give(&psrc, r->src, r->n_src);
                r->src_freed = true;
        }
}

static void free_dst(struct req *r)
{
        if (!r->dst_freed) {
                pool_give(&pdst, r->dst, r->n_dst);
                r->dst_freed = true;
        }
}

static void maybe_done(struct req *r)
{
        if (r->completion < 0)
                return;
        bool finished_ok = r->completion == KVF_STATUS_FINISHED;
        if (finished_ok && r->arrival < 0)
                return; /* the arrival is on its way */
        /* A failed network transfer: its frames may still be in flight. The decode side
         * frees the blocks on the error arrival (published after those frames are fenced
         * off), or after a grace period if the peer could not be told. */
        if (!finished_ok && o.transport != KVF_TRANSPORT_IPC && r->arrival < 0 &&
            kvf_now_ns() - r->completion_seen_ns < 10000000000ull)
                return;
        if (r->src_freed && r->dst_freed)
                return;
        free_src(r);
        free_dst(r);
        done_reqs++;
        if (finished_ok) {
                if (r->arrival != KVF_STATUS_FINISHED || !r->verified) {
                        corrupt++;
                        fprintf(stderr, "%s: CORRUPT: request %s reported finished but %s\n", prog, r->id,
                                r->arrival != KVF_STATUS_FINISHED ? "its arrival says otherwise"
                                                                   : "its bytes differ");
                } else {
                        finished++;
                        moved_bytes += r->bytes;
                        if (r->arrival_ns > r->last_layer_ns && r->last_layer_ns &&
                            r->completion_ns > r->last_layer_ns) {
                                tails[ntails++] = (struct tail){
                                    .ns = r->arrival_ns - r->last_layer_ns,
                                    .cns = r->completion_ns - r->last_layer_ns,
                                    .left = r->late_task ? r->bytes
                                                         : (uint64_t)r->last_blocks * tensors * L.block_bytes * o.ranks,
                                    .late = r->late_task};
                        }
                }
        } else {
                failed++;
                fail_by_status[r->completion]++;
                if (r->arrival == KVF_STATUS_FINISHED)
                        bad_status_pairs++;
        }
}

static struct req *find_req(const char *id)
{
        unsigned long v;
        if (id[0] != 'r')
                return NULL;
        v = strtoul(id + 1, NULL, 10);
        return v < nreq && !strcmp(reqs[v].id, id) ? &reqs[v] : NULL;
}

static void verify(struct req *r)
{
        r->verified = true;
        for (unsigned k = 0; k < o.ranks && r->verified; k++) {
                struct kvf_client *c = kvf_group_member(dg, k);
                for (uint32_t l = 0; l < layers && r->verified; l++)
                        for (uint32_t t = 0; t < tensors && r->verified; t++) {
                                const uint8_t *base = kvf_cache_tensor(c, l, (int)t);
                                for (uint32_t i = 0; i < r->n_dst; i++) {
                                        uint64_t key = block_key(r->seq, k, l, t, r->first + i, false);
                                        if (!check(base + (uint64_t)r->dst[i] * L.block_bytes, L.block_bytes, key)) {
                                                fprintf(stderr,
                                                        "%s: request %s: rank %u layer %u tensor %u dest block %u (#%u) differs\n",
                                                        prog, r->id, k, l, t, r->dst[i], i);
                                                r->verified = false;
                                                break;
                                        }
                                        verified_bytes += L.block_bytes;
                                }
                        }
        }
}

static void poll_events(int timeout_ms)
{
        struct kvf_event ev;
        int rc;
        static uint64_t last_sweep;
        if (kvf_now_ns() - last_sweep > 100000000ull) {
                /* failed network transfers whose grace period ran out */
                last_sweep = kvf_now_ns();
                for (unsigned i = 0; i < nreq; i++)
                        if (reqs[i].completion > 0 && !reqs[i].dst_freed)
                                maybe_done(&reqs[i]);
        }
        simlog_previous(pg, dg, o.ranks);
        while ((rc = kvf_group_poll(pg, &ev, timeout_ms)) > 0) {
                struct req *r = find_req(ev.request_id);
                timeout_ms = 0;
                if (!r || ev.type != KVF_EVENT_COMPLETION) {
                        if (ev.type == KVF_EVENT_COMPLETION)
                                fprintf(stderr, "%s: completion for unknown request '%s': %s: %s\n", prog,
                                        ev.request_id, kvf_status_name(ev.status), ev.reason);
                        continue;
                }
                if (r->completion >= 0) {
                        fprintf(stderr, "%s: DUPLICATE completion for %s\n", prog, r->id);
                        corrupt++;
                        continue;
                }
                r->completion = ev.status;
                simlog_event('C', r->id, ev.status);
                r->completion_seen_ns = kvf_now_ns();
                r->bytes = ev.bytes;
                r->completion_ns = ev.done_ns;
                snprintf(r->reason, sizeof(r->reason), "%s", ev.reason);
                if (ev.status != KVF_STATUS_FINISHED && !o.quiet && !r->cancel)
                        fprintf(stderr, "%s: request %s: %s: %s\n", prog, r->id,
                                kvf_status_name(ev.status), ev.reason);
                maybe_done(r);
        }
        while ((rc = kvf_group_poll(dg, &ev, 0)) > 0) {
                struct req *r = find_req(ev.request_id);
                if (!r || ev.type != KVF_EVENT_ARRIVAL)
                        continue;
                if (r->arrival >= 0 && r->arrival == KVF_STATUS_FINISHED) {
                        fprintf(stderr, "%s: DUPLICATE arrival for %s\n", prog, r->id);
                        corrupt++;
                        continue;
                }
                simlog_event('A', r->id, ev.status);
                /* A finished arrival after the completion said otherwise: the two sides
                 * disagree (maybe_done counts it when the arrival came first). */
                if (ev.status == KVF_STATUS_FINISHED && r->completion > 0 && r->dst_freed) {
                        fprintf(stderr, "%s: request %s: completion '%s' but arrival 'finished'\n", prog, r->id,
                                kvf_status_name(r->completion));
                        bad_status_pairs++;
                }
                r->arrival = ev.status;
                r->arrival_ns = ev.done_ns;
                if (ev.status == KVF_STATUS_FINISHED && !r->dst_freed)
                        verify(r);
                maybe_done(r);
        }
}

static int submit_task(struct req *r, uint64_t step)
{
        for (unsigned k = 0; k < o.ranks; k++) {
                struct kvf_task t = {.request_id = r->id, .src_block_ids = r->src, .n_src = r->n_src,
                                     .dest_block_ids = r->dst, .n_dest = r->n_dst, .current_id = step,
                                     .transport = o.transport, .peer = o.peer[k],
                                     .chunked = o.chunk_tokens > 0};
                int rc;
                while ((rc = kvf_submit_task(kvf_group_member(pg, k), &t)) == -EAGAIN)
                        poll_events(1);
                if (rc < 0) {
                        fprintf(stderr, "%s: submit %s: %s\n", prog, r->id, kvf_last_error());
                        return rc;
                }
        }
        r->submitted = true;
        simlog_event('S', r->id, 0);
        return 0;
}

/* Write layer l of request r's blocks covered by tokens [from, to) (all ranks). */
static void write_layer(struct req *r, uint32_t l, uint32_t from, uint32_t to)
{
        uint32_t j0 = from / L.block_size, j1 = (to + L.block_size - 1) / L.block_size;
        bool last = to >= r->tokens;
        for (unsigned k = 0; k < o.ranks; k++) {
                struct kvf_client *c = kvf_group_member(pg, k);
                for (uint32_t t = 0; t < tensors; t++) {
                        uint8_t *base = kvf_cache_tensor(c, l, (int)t);
                        for (uint32_t j = j0; j < j1 && j < r->n_src; j++) {
                                /* A block the chunk leaves incomplete gets other bytes: sending it
                                 * before the chunk that completes it would show up in verify. */
                                bool partial = !last && (uint64_t)(j + 1) * L.block_size > to;
                                fill(base + (uint64_t)r->src[j] * L.block_bytes, L.block_bytes,
                                     block_key(r->seq, k, l, t, j, partial));
                        }
                }
        }
}

static void progress_line(bool final)
{
        double s = (double)(kvf_now_ns() - t_start) / 1e9;
        fprintf(stderr, "%s[%6.1fs] %llu/%u requests done (finished %llu, failed %llu), %.2f GiB moved, %.2f GiB/s%s",
                final ? "" : "\r", s, (unsigned long long)done_reqs, nreq, (unsigned long long)finished,
                (unsigned long long)failed, (double)moved_bytes / (1 << 30),
                s > 0 ? (double)moved_bytes / (1 << 30) / s : 0.0, final ? "\n" : "   ");
}

struct spread {
        unsigned n;
        double p50, p99, max;
};

static int cmp_double(const void *a, const void *b)
{
        double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

/* Percentiles of v[0..n), which this sorts. */
static struct spread spread_of(double *v, unsigned n)
{
        if (!n)
                return (struct spread){0};
        qsort(v, n, sizeof(*v), cmp_double);
        return (struct spread){.n = n,
                               .p50 = v[(unsigned)(0.5 * (n - 1) + 0.5)],
                               .p99 = v[(unsigned)(0.99 * (n - 1) + 0.5)],
                               .max = v[n - 1]};
}

struct tail_figures {
        struct spread all, in_time, late, completion;
        struct spread norm; /* tail / (2 x its bytes left at memcpy rate + 50 us); with a baseline */
};

/*
 * The tail figures. A late task's tail carries its whole request (the task
 * came after every layer was done), so it is shown apart from the tails of
 * requests whose task came in time; the ratio puts each request's tail next
 * to what it had left to send.
 */
static struct tail_figures tail_figures(double memcpy_bps)
{
        struct tail_figures f = {0};
        unsigned m = ntails ? ntails : 1, n_in = 0, n_late = 0;
        double *all = calloc(m, sizeof(double)), *in_time = calloc(m, sizeof(double));
        double *late = calloc(m, sizeof(double)), *comp = calloc(m, sizeof(double));
        double *norm = calloc(m, sizeof(double));

        if (all && in_time && late && comp && norm) {
                for (unsigned i = 0; i < ntails; i++) {
                        const struct tail *t = &tails[i];
                        all[i] = (double)t->ns;
                        comp[i] = (double)t->cns;
                        if (t->late)
                                late[n_late++] = (double)t->ns;
                        else
                                in_time[n_in++] = (double)t->ns;
                        if (memcpy_bps > 0)
                                norm[i] = (double)t->ns / (2e9 * (double)t->left / memcpy_bps + 50e3);
                }
                f.all = spread_of(all, ntails);
                f.in_time = spread_of(in_time, n_in);
                f.late = spread_of(late, n_late);
                f.completion = spread_of(comp, ntails);
                if (memcpy_bps > 0)
                        f.norm = spread_of(norm, ntails);
        }
        free(all);
        free(in_time);
        free(late);
        free(comp);
        free(norm);
        return f;
}

/*
 * The reference: one plain memcpy of the same number of bytes, 256 MiB at a
 * time between two buffers touched beforehand. Contiguous, so it is the
 * upper bound for copying these bytes on this machine, not a model of
 * kvferry's block-wise copies.
 */
static double memcpy_rate(uint64_t bytes)
{
        uint64_t buf = 256ull << 20;
        uint8_t *a = malloc(buf), *b = malloc(buf);
        if (!a || !b) {
                free(a);
                free(b);
                return 0;
        }
        memset(a, 1, buf);
        memset(b, 2, buf);
        uint64_t done = 0, t0 = kvf_now_ns();
        while (done < bytes) {
                uint64_t n = bytes - done < buf ? bytes - done : buf;
                memcpy(b, a, n);
                /* b is never read again: without this the copies are dead stores */
                __asm__ volatile("" : : "r"(b) : "memory");
                done += n;
        }
        double dt = (double)(kvf_now_ns() - t0) / 1e9;
        free(a);
        free(b);
        return (double)done / dt;
}

/*
 * --warm-caches: every 4 KiB page of the caches touched through this process's mappings, as a
 * long-running engine has touched them: a write (of the byte already there) to each page of
 * the prefill caches, which the engine computes into, a read of each page of the decode caches,
 * which it only reads here. On a VM where the first write through each new mapping of a page
 * is slow (issue 14) this is what a fresh engine process pays once and a steady state does not.
 */
static uint64_t warm_bytes, warm_ns;
static void warm_caches(void)
{
        uint64_t t0 = kvf_now_ns();
        for (unsigned k = 0; k < o.ranks; k++) {
                for (int decode = 0; decode < 2; decode++) {
                        struct kvf_client *c = kvf_group_member(decode ? dg : pg, k);
                        struct kvf_layout_info li;
                        uint8_t *p = c ? kvf_cache_tensor(c, 0, 0) : NULL;
                        if (!p || kvf_get_layout(c, &li) < 0)
                                continue;
                        /* Relaxed atomics: the compiler must make every access, nothing more. */
                        for (uint64_t off = 0; off < li.cache_bytes; off += 4096) {
                                uint8_t v = __atomic_load_n(p + off, __ATOMIC_RELAXED);
                                if (!decode)
                                        __atomic_store_n(p + off, v, __ATOMIC_RELAXED);
                        }
                        warm_bytes += li.cache_bytes;
                }
        }
        warm_ns = kvf_now_ns() - t0;
}

static void split_list(const char *s, const char **out, unsigned *n)
{
        char *dup = strdup(s);
        *n = 0;
        for (char *save = NULL, *p = strtok_r(dup, ",", &save); p && *n < MAX_RANKS;
             p = strtok_r(NULL, ",", &save))
                out[(*n)++] = p;
}

/* The default trace, from the source tree this binary was built from, else from data/ next to
 * the binary (a copy installed with it): a relative path would work from the repository's
 * root only. NULL, with a message, when neither has it. */
static const char *default_trace(void)
{
        static const char file[] = "mooncake-conversation-2000.jsonl";
        static char path[4200];
        char exe[4096] = "(unknown)";
        const char *src = "(not built from a source tree)";

#ifdef KVF_SOURCE_DIR
        src = KVF_SOURCE_DIR;
        snprintf(path, sizeof(path), "%s/data/%s", src, file);
        if (access(path, R_OK) == 0)
                return path;
#endif
        ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
        if (n > 0) {
                exe[n] = '\0';
                char *slash = strrchr(exe, '/');
                if (slash)
                        *slash = '\0';
                snprintf(path, sizeof(path), "%s/data/%s", exe, file);
                if (access(path, R_OK) == 0)
                        return path;
        }
        fprintf(stderr, "%s: the default trace %s is neither in %s/data nor in %s/data; give --trace FILE\n",
                prog, file, src, exe);
        return NULL;
}

static void usage(void)
{
        printf("Usage: %s --prefill P0[,P1..] --decode D0[,D1..] [options]\n"
               "Drive a prefill and a decode instance like an inference engine and verify every byte.\n\n"
               "  --requests N        requests to move (default 100)\n"
               "  --trace FILE        JSON lines with input_length (default data/mooncake-conversation-2000.jsonl\n"
               "                      of the source tree)\n"
               "  --max-tokens N      clip prompts to N tokens (default: what the caches allow)\n"
               "  --layer-us N        compute time per layer, microseconds (default 200)\n"
               "  --step-tokens N     tokens prefilled per forward step (default 16384)\n"
               "  --chunk-tokens N    chunked prefill: at most N tokens of a request per step (default off)\n"
               "  --prefix-pct P      P%% of requests hit a decode-side prefix (fewer dest blocks) (default 20)\n"
               "  --late-pct P        P%% of tasks arrive after their layers are done (default 10)\n"
               "  --cancel-pct P      P%% of requests are cancelled mid-step (default 0)\n"
               "  --transport T       ipc, tcp or rdma (default ipc)\n"
               "  --peer-map D=ADDR   name decode instance D in tasks as host:port ADDR (tcp, rdma across hosts)\n"
               "  --seed N            (default 1)\n"
               "  --timeout-s N       give up after N seconds without progress (default 60)\n"
               "  --baseline          also time one plain memcpy of the same number of bytes, for the ratio\n"
               "  --warm-caches       before the clock starts, touch every 4 KiB page of the caches through\n"
               "                      this process's mappings, as a long-running engine has (timed, reported)\n"
               "  --verify MODE       full (every byte, default) or sample (both ends of every block)\n"
               "  --scatter           hand out blocks in random order: no contiguous runs\n"
               "  --json FILE         write the summary as JSON too\n"
               "  --session-log FILE  log submissions, completions, arrivals, and the events of earlier\n"
               "                      engine sessions (tools/sim_sessions.h; the fault test reads it)\n"
               "  --drain-previous-s N  at the end, keep taking earlier sessions' events until none came\n"
               "                      for N seconds (default 0)\n"
               "  --quiet             no progress line\n"
               "  --check-options     check the options (and the trace's presence), run nothing\n"
               "Exit: 0 all requests accounted for and nothing corrupt; 1 otherwise; 2 usage.\n",
               prog);
}

int main(int argc, char **argv)
{
        enum { O_P = 1000, O_D, O_N, O_TRACE, O_MAXTOK, O_LUS, O_STEP, O_CHUNK, O_PREFIX, O_LATE,
               O_CANCEL, O_TRANSPORT, O_SEED, O_TO, O_BASE, O_JSON, O_QUIET, O_VERSION, O_PEERMAP, O_VERIFY, O_SCATTER, O_CHECK,
               O_SLOG, O_DRAIN, O_WARM };
        static const struct option lo[] = {
                {"prefill", required_argument, 0, O_P},  {"decode", required_argument, 0, O_D},
                {"requests", required_argument, 0, O_N}, {"trace", required_argument, 0, O_TRACE},
                {"max-tokens", required_argument, 0, O_MAXTOK},
                {"layer-us", required_argument, 0, O_LUS},
                {"step-tokens", required_argument, 0, O_STEP},
                {"chunk-tokens", required_argument, 0, O_CHUNK},
                {"prefix-pct", required_argument, 0, O_PREFIX},
                {"late-pct", required_argument, 0, O_LATE},
                {"cancel-pct", required_argument, 0, O_CANCEL},
                {"transport", required_argument, 0, O_TRANSPORT},
                {"peer-map", required_argument, 0, O_PEERMAP},
                {"verify", required_argument, 0, O_VERIFY},
                {"scatter", no_argument, 0, O_SCATTER},
                {"seed", required_argument, 0, O_SEED}, {"timeout-s", required_argument, 0, O_TO},
                {"baseline", no_argument, 0, O_BASE},    {"json", required_argument, 0, O_JSON},
                {"warm-caches", no_argument, 0, O_WARM},
                {"quiet", no_argument, 0, O_QUIET},      {"help", no_argument, 0, 'h'},
                {"check-options", no_argument, 0, O_CHECK},
                {"session-log", required_argument, 0, O_SLOG},
                {"drain-previous-s", required_argument, 0, O_DRAIN},
                {"version", no_argument, 0, O_VERSION},  {0, 0, 0, 0}};
        unsigned np = 0, nd = 0;
        const char *peermap = NULL;
        bool check_only = false;
        int c;

        o.requests = 100;
        o.layer_us = 200;
        o.step_tokens = 16384;
        o.prefix_pct = 20;
        o.late_pct = 10;
        o.transport = KVF_TRANSPORT_IPC;
        o.seed = 1;
        o.timeout_s = 60;
        while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
                switch (c) {
                case O_P: split_list(optarg, o.prefill, &np); break;
                case O_D: split_list(optarg, o.decode, &nd); break;
                case O_N: o.requests = (unsigned)kvf_opt_u64("requests", optarg, 1, 10000000); break;
                case O_TRACE: o.trace = optarg; break;
                case O_MAXTOK: o.max_tokens = (unsigned)kvf_opt_u64("max-tokens", optarg, 1, 1u << 30); break;
                case O_LUS: o.layer_us = (unsigned)kvf_opt_u64("layer-us", optarg, 0, 10000000); break;
                case O_STEP: o.step_tokens = (unsigned)kvf_opt_u64("step-tokens", optarg, 1, 1u << 30); break;
                case O_CHUNK: o.chunk_tokens = (unsigned)kvf_opt_u64("chunk-tokens", optarg, 1, 1u << 30); break;
                case O_PREFIX: o.prefix_pct = (unsigned)kvf_opt_u64("prefix-pct", optarg, 0, 100); break;
                case O_LATE: o.late_pct = (unsigned)kvf_opt_u64("late-pct", optarg, 0, 100); break;
                case O_CANCEL: o.cancel_pct = (unsigned)kvf_opt_u64("cancel-pct", optarg, 0, 100); break;
                case O_TRANSPORT:
                        if (!strcmp(optarg, "ipc"))
                                o.transport = KVF_TRANSPORT_IPC;
                        else if (!strcmp(optarg, "tcp"))
                                o.transport = KVF_TRANSPORT_TCP;
                        else if (!strcmp(optarg, "rdma"))
                                o.transport = KVF_TRANSPORT_RDMA;
                        else
                                kvf_opt_die(prog, "--transport is ipc, tcp or rdma");
                        break;
                case O_SEED: o.seed = kvf_opt_u64("seed", optarg, 0, UINT64_MAX); break;
                case O_PEERMAP: peermap = optarg; break;
                case O_SCATTER: scatter = true; break;
                case O_VERIFY:
                        if (strcmp(optarg, "full") && strcmp(optarg, "sample"))
                                kvf_opt_die(prog, "--verify is full or sample");
                        sample_only = !strcmp(optarg, "sample");
                        break;
                case O_TO: o.timeout_s = (unsigned)kvf_opt_u64("timeout-s", optarg, 1, 86400); break;
                case O_BASE: o.baseline = true; break;
                case O_WARM: o.warm_caches = true; break;
                case O_JSON: o.json = optarg; break;
                case O_QUIET: o.quiet = true; break;
                case O_CHECK: check_only = true; break;
                case O_SLOG: o.session_log = optarg; break;
                case O_DRAIN: o.drain_previous_s = (unsigned)kvf_opt_u64("drain-previous-s", optarg, 0, 3600); break;
                case 'h': usage(); return 0;
                case O_VERSION: printf("%s %s\n", prog, KVFERRY_VERSION); return 0;
                default: kvf_opt_die(prog, "unknown option");
                }
        }
        if (!np || np != nd)
                kvf_opt_die(prog, "give --prefill and --decode with the same number of ranks");
        o.ranks = np;
        rng_state = o.seed;
        for (unsigned k = 0; k < nd; k++)
                o.peer[k] = o.decode[k];
        if (peermap) {
                const char *m[MAX_RANKS];
                unsigned nm;
                split_list(peermap, m, &nm);
                for (unsigned i = 0; i < nm; i++) {
                        char *eq = strchr(m[i], '=');
                        if (!eq)
                                kvf_opt_die(prog, "--peer-map wants DECODE=HOST:PORT, not '%s'", m[i]);
                        *eq = '\0';
                        for (unsigned k = 0; k < nd; k++)
                                if (!strcmp(o.decode[k], m[i]))
                                        o.peer[k] = eq + 1;
                }
        }
        if (!o.trace && !(o.trace = default_trace()))
                return 1;
        if (check_only) {
                if (access(o.trace, R_OK) == 0)
                        return 0;
                fprintf(stderr, "%s: trace %s: %s\n", prog, o.trace, strerror(errno));
                return 1;
        }

        if (kvf_group_attach(o.prefill, np, 10000, &pg) < 0 || kvf_group_attach(o.decode, nd, 10000, &dg) < 0) {
                fprintf(stderr, "%s: %s\n", prog, kvf_last_error());
                return 1;
        }
        if (o.session_log &&
            simlog_open(o.session_log, kvf_session(kvf_group_member(pg, 0)), kvf_session(kvf_group_member(dg, 0))) < 0) {
                fprintf(stderr, "%s: --session-log %s: %s\n", prog, o.session_log, strerror(errno));
                return 1;
        }
        kvf_get_layout(kvf_group_member(pg, 0), &L);
        struct kvf_layout_info DL;
        kvf_get_layout(kvf_group_member(dg, 0), &DL);
        layers = L.num_layers + L.extra_layers;
        tensors = L.key_only ? 1 : 2;
        if (pool_init(&psrc, L.num_blocks) < 0 || pool_init(&pdst, DL.num_blocks) < 0)
                return 1;
        /* The largest prompt the caches (and one request's block limit) can hold at once. */
        uint32_t cap_blocks = L.num_blocks < DL.num_blocks ? L.num_blocks : DL.num_blocks;
        uint64_t cap_tok = (uint64_t)(cap_blocks / 2) * L.block_size;
        uint64_t lim = 4096ull * L.block_size;
        if (cap_tok > lim)
                cap_tok = lim;
        if (!o.max_tokens || o.max_tokens > cap_tok)
                o.max_tokens = (unsigned)cap_tok;
        if (load_trace(o.trace, o.requests) < 0)
                return 1;
        tails = calloc(nreq, sizeof(*tails));

        for (unsigned i = 0; i < nreq; i++) {
                struct req *r = &reqs[i];
                snprintf(r->id, sizeof(r->id), "r%u", i);
                r->n_src = (r->tokens + L.block_size - 1) / L.block_size;
                r->first = 0;
                if (r->n_src > 1 && rnd() % 100 < o.prefix_pct)
                        r->first = (uint32_t)(1 + rnd() % (r->n_src - 1) / 2);
                r->n_dst = r->n_src - r->first;
                r->src = malloc(r->n_src * sizeof(uint32_t));
                r->dst = malloc(r->n_dst * sizeof(uint32_t));
                r->completion = r->arrival = -1;
                r->src_freed = r->dst_freed = true; /* nothing reserved yet */
                r->late_task = o.chunk_tokens == 0 && rnd() % 100 < o.late_pct;
                r->cancel = rnd() % 100 < o.cancel_pct;
        }

        /* The sender's layer-done -> copy-start histogram lives as long as the instance:
         * this run's share is what it holds at the end less what it holds now. */
        static struct kvf_histogram l2c_before;
        struct kvf_ctl pc;
        if (kvf_ctl_attach(o.prefill[0], false, &pc) == 0) {
                memcpy(&l2c_before, &pc.sender->hist[KVF_HIST_LAYER_TO_COPY], sizeof(l2c_before));
                kvf_ctl_detach(&pc);
        }
        if (o.warm_caches)
                warm_caches();
        t_start = kvf_now_ns();
        /* Steps grow for the life of an instance: continue after the last one published. */
        uint64_t step = 1, last_progress = kvf_now_ns(), last_line = 0;
        for (unsigned k = 0; k < o.ranks; k++)
                if (kvf_last_step(kvf_group_member(pg, k)) >= step)
                        step = kvf_last_step(kvf_group_member(pg, k)) + 1;
        unsigned next = 0;
        struct req **active = calloc(nreq, sizeof(*active));
        unsigned nactive = 0;
        uint64_t layer_ns = (uint64_t)o.layer_us * 1000;

        kvf_opt_signals(&stop);
        while (done_reqs < (kvf_load_relaxed(&stop) ? next : nreq)) {
                /* Admit what the step budget and the free blocks allow. */
                uint64_t budget = o.step_tokens;
                for (unsigned i = 0; i < nactive; i++) {
                        uint32_t left = active[i]->tokens - active[i]->done_tokens;
                        uint32_t take = o.chunk_tokens && left > o.chunk_tokens ? o.chunk_tokens : left;
                        budget = budget > take ? budget - take : 0;
                }
                while (!kvf_load_relaxed(&stop) && next < nreq && (budget > 0 || nactive == 0)) {
                        struct req *r = &reqs[next];
                        if (psrc.n < r->n_src || pdst.n < r->n_dst)
                                break;
                        pool_take(&psrc, r->n_src, r->src);
                        pool_take(&pdst, r->n_dst, r->dst);
                        r->src_freed = r->dst_freed = false;
                        if (!r->late_task && submit_task(r, step) < 0)
                                return 1;
                        active[nactive++] = r;
                        uint32_t take = o.chunk_tokens && r->tokens > o.chunk_tokens ? o.chunk_tokens : r->tokens;
                        budget = budget > take ? budget - take : 0;
                        next++;
                }
                if (nactive == 0) {
                        uint64_t before = done_reqs;
                        poll_events(10);
                        if (done_reqs != before)
                                last_progress = kvf_now_ns();
                        if (kvf_now_ns() - last_progress > (uint64_t)o.timeout_s * 1000000000ull) {
                                fprintf(stderr, "\n%s: no progress for %u s: giving up with %llu of %u requests done\n",
                                        prog, o.timeout_s, (unsigned long long)done_reqs, nreq);
                                break;
                        }
                } else {
                        /* This step's share of each active request. */
                        uint32_t from[nactive], to[nactive];
                        for (unsigned i = 0; i < nactive; i++) {
                                struct req *r = active[i];
                                uint32_t left = r->tokens - r->done_tokens;
                                from[i] = r->done_tokens;
                                to[i] = r->done_tokens + (o.chunk_tokens && left > o.chunk_tokens ? o.chunk_tokens : left);
                                if (o.chunk_tokens)
                                        for (unsigned k = 0; k < o.ranks; k++)
                                                while (kvf_submit_chunk(kvf_group_member(pg, k), r->id, step, to[i],
                                                                        to[i] >= r->tokens) == -EAGAIN)
                                                        poll_events(1);
                        }
                        for (uint32_t l = 0; l < layers; l++) {
                                uint64_t t0 = kvf_now_ns();
                                for (unsigned i = 0; i < nactive; i++)
                                        write_layer(active[i], l, from[i], to[i]);
                                /* The rest of the layer's compute time: the engine's CPU thread
                                 * waits on its GPU, so sleep, spinning only the last stretch. */
                                for (uint64_t el; (el = kvf_now_ns() - t0) < layer_ns;)
                                        if (layer_ns - el > 60000)
                                                kvf_sleep_ns(layer_ns - el - 50000);
                                for (unsigned k = 0; k < o.ranks; k++)
                                        kvf_layer_done(kvf_group_member(pg, k), step, l);
                                uint64_t pub = kvf_now_ns();
                                if (l == layers / 2)
                                        for (unsigned i = 0; i < nactive; i++)
                                                if (active[i]->cancel && active[i]->submitted) {
                                                        for (unsigned k = 0; k < o.ranks; k++)
                                                                kvf_submit_cancel(kvf_group_member(pg, k), active[i]->id);
                                                        cancels_sent += !active[i]->cancel_sent;
                                                        active[i]->cancel_sent = true;
                                                }
                                if (l == layers - 1)
                                        for (unsigned i = 0; i < nactive; i++)
                                                if (to[i] >= active[i]->tokens) {
                                                        struct req *r = active[i];
                                                        uint32_t b0 = from[i] / L.block_size;
                                                        r->last_layer_ns = pub;
                                                        r->last_blocks = r->n_src - (b0 > r->first ? b0 : r->first);
                                                }
                                poll_events(0);
                        }
                        /* Tasks that arrive after their layers are done. */
                        unsigned keep = 0;
                        for (unsigned i = 0; i < nactive; i++) {
                                struct req *r = active[i];
                                r->done_tokens = to[i];
                                if (!r->submitted && submit_task(r, step) < 0)
                                        return 1;
                                if (r->done_tokens < r->tokens)
                                        active[keep++] = r;
                        }
                        nactive = keep;
                        step++;
                        last_progress = kvf_now_ns();
                }
                if (!o.quiet && kvf_now_ns() - last_line > 1000000000ull) {
                        progress_line(false);
                        last_line = kvf_now_ns();
                }
        }
        /* Let stragglers land. After a stop, only what was admitted counts. */
        if (kvf_load_relaxed(&stop))
                nreq = next;
        uint64_t end = kvf_now_ns() + (uint64_t)o.timeout_s * 1000000000ull;
        while (done_reqs < nreq && kvf_now_ns() < end)
                poll_events(10);
        double secs = (double)(kvf_now_ns() - t_start) / 1e9;
        /* Earlier sessions' events still on their way (the fault test's last run). */
        for (uint64_t quiet_since = kvf_now_ns();
             o.drain_previous_s && kvf_now_ns() - quiet_since < o.drain_previous_s * 1000000000ull;) {
                struct kvf_event ev;
                if (kvf_group_poll(pg, &ev, 50) > 0 || kvf_group_poll(dg, &ev, 0) > 0 ||
                    simlog_previous(pg, dg, o.ranks) > 0)
                        quiet_since = kvf_now_ns();
        }
        if (!o.quiet)
                progress_line(true);

        uint64_t l2c50 = 0, l2c99 = 0;
        if (kvf_ctl_attach(o.prefill[0], false, &pc) == 0) {
                static struct kvf_histogram run;
                const struct kvf_histogram *now = &pc.sender->hist[KVF_HIST_LAYER_TO_COPY];
                for (unsigned i = 0; i < KVF_HIST_BUCKETS; i++) /* (a re-created instance starts at 0) */
                        run.buckets[i] = now->buckets[i] >= l2c_before.buckets[i]
                                                 ? now->buckets[i] - l2c_before.buckets[i]
                                                 : now->buckets[i];
                l2c50 = kvf_hist_quantile(&run, 0.50);
                l2c99 = kvf_hist_quantile(&run, 0.99);
                kvf_ctl_detach(&pc);
        }
        double rate = secs > 0 ? (double)moved_bytes / secs : 0;
        double base = o.baseline ? memcpy_rate(moved_bytes ? moved_bytes : (1ull << 30)) : 0;
        /* One layer of an average request, at the memcpy rate (or the run's rate). */
        double avg_send = 0;
        for (unsigned i = 0; i < nreq; i++)
                avg_send += reqs[i].n_dst;
        avg_send /= nreq;
        double layer_bytes = avg_send * tensors * (double)L.block_bytes * o.ranks;
        struct tail_figures tf = tail_figures(base);
        unsigned unaccounted = nreq - (unsigned)done_reqs;
        bool ok = corrupt == 0 && unaccounted == 0;
        char gib[32];

        printf("kvferry simulation summary\n");
        printf("  layout       %u+%u layers x %u tensor(s), %u kv head(s) x %u tokens x %u dims %s = %s per block, %u rank(s)\n",
               L.num_layers, L.extra_layers, tensors, L.kv_heads, L.block_size, L.head_dim,
               kvf_dtype_name(L.dtype), kvf_fmt_bytes(L.block_bytes, gib, sizeof(gib)), o.ranks);
        printf("  requests     %u: %llu finished, %llu failed, %u unaccounted, %llu corrupt\n", nreq,
               (unsigned long long)finished, (unsigned long long)failed, unaccounted,
               (unsigned long long)corrupt);
        for (int s = 1; s < KVF_STATUS_COUNT; s++)
                if (fail_by_status[s])
                        printf("               %llu %s\n", (unsigned long long)fail_by_status[s], kvf_status_name(s));
        printf("  moved        %s in %.2f s = %.2f GiB/s; %s verified %s\n",
               kvf_fmt_bytes(moved_bytes, gib, sizeof(gib)), secs, rate / (1 << 30),
               kvf_fmt_bytes(verified_bytes, (char[32]){0}, 32),
               sample_only ? "at both ends of every block (--verify sample)" : "byte for byte");
        printf("  tail         last layer-done -> arrival: p50 %.1f us, p99 %.1f us (one layer of an average request: %s)\n",
               tf.all.p50 / 1e3, tf.all.p99 / 1e3, kvf_fmt_bytes((uint64_t)layer_bytes, (char[32]){0}, 32));
        printf("               %u with the task in time: p50 %.1f us, p99 %.1f us; %u late tasks (every layer "
               "left to send): p50 %.1f us, p99 %.1f us\n",
               tf.in_time.n, tf.in_time.p50 / 1e3, tf.in_time.p99 / 1e3, tf.late.n, tf.late.p50 / 1e3,
               tf.late.p99 / 1e3);
        if (base > 0)
                printf("               per request, tail / (2 x its bytes left at memcpy rate + 50 us): p50 %.2f, "
                       "p99 %.2f, max %.2f\n",
                       tf.norm.p50, tf.norm.p99, tf.norm.max);
        printf("               last layer-done -> completion (prefill side): p50 %.1f us, p99 %.1f us\n",
               tf.completion.p50 / 1e3, tf.completion.p99 / 1e3);
        printf("  copy start   layer-done -> copy start: p50 %.1f us, p99 %.1f us\n", (double)l2c50 / 1e3,
               (double)l2c99 / 1e3);
        if (o.warm_caches)
                printf("  warm-up      touched %s of the caches through this process's mappings in %.3f s "
                       "(%.2f us per 4 KiB page), before the clock started\n",
                       kvf_fmt_bytes(warm_bytes, gib, sizeof(gib)), (double)warm_ns / 1e9,
                       warm_bytes ? (double)warm_ns / 1e3 / (double)(warm_bytes / 4096) : 0);
        if (o.baseline)
                printf("  baseline     memcpy of the same bytes: %.2f GiB/s; kvferry/memcpy = %.2f; one layer at memcpy rate = %.1f us\n",
                       base / (1 << 30), base > 0 ? rate / base : 0, base > 0 ? layer_bytes / base * 1e6 : 0);
        printf("  result       %s\n", ok ? "OK: every finished request verified, every request accounted for"
                                          : "FAILED");
        if (o.json) {
                FILE *f = fopen(o.json, "w");
                if (f) {
                        fprintf(f,
                                "{\"requests\":%u,\"finished\":%llu,\"failed\":%llu,\"unaccounted\":%u,\"corrupt\":%llu,"
                                "\"bytes\":%llu,\"verified_bytes\":%llu,\"seconds\":%.6f,\"rate_bps\":%.1f,"
                                "\"tail_p50_ns\":%.0f,\"tail_p99_ns\":%.0f,\"tail_in_time_p50_ns\":%.0f,"
                                "\"tail_in_time_p99_ns\":%.0f,\"late_tasks\":%u,\"tail_late_p50_ns\":%.0f,"
                                "\"tail_late_p99_ns\":%.0f,\"tail_norm_p50\":%.3f,\"tail_norm_p99\":%.3f,"
                                "\"tail_norm_max\":%.3f,\"completion_tail_p50_ns\":%.0f,"
                                "\"completion_tail_p99_ns\":%.0f,\"layer_to_copy_p50_ns\":%llu,"
                                "\"layer_to_copy_p99_ns\":%llu,\"memcpy_bps\":%.1f,\"avg_layer_bytes\":%.1f,\"ok\":%s,"
                                "\"cancelled\":%llu,\"cancels_sent\":%llu,\"timed_out\":%llu,\"connection_errors\":%llu,\"finished_but_failed_pairs\":%llu,"
                                "\"warm_bytes\":%llu,\"warm_ns\":%llu}\n",
                                nreq, (unsigned long long)finished, (unsigned long long)failed, unaccounted,
                                (unsigned long long)corrupt, (unsigned long long)moved_bytes,
                                (unsigned long long)verified_bytes, secs, rate,
                                tf.all.p50, tf.all.p99, tf.in_time.p50, tf.in_time.p99, tf.late.n,
                                tf.late.p50, tf.late.p99, tf.norm.p50, tf.norm.p99, tf.norm.max,
                                tf.completion.p50, tf.completion.p99, (unsigned long long)l2c50,
                                (unsigned long long)l2c99, base, layer_bytes, ok ? "true" : "false",
                                (unsigned long long)fail_by_status[KVF_STATUS_CANCELLED],
                                (unsigned long long)cancels_sent,
                                (unsigned long long)fail_by_status[KVF_STATUS_TIMEOUT],
                                (unsigned long long)fail_by_status[KVF_STATUS_CONNECTION],
                                (unsigned long long)bad_status_pairs, (unsigned long long)warm_bytes,
                                (unsigned long long)warm_ns);
                        fclose(f);
                }
        }
        kvf_group_detach(pg);
        kvf_group_detach(dg);
        for (unsigned i = 0; i < o.requests; i++) {
                free(reqs[i].src);
                free(reqs[i].dst);
        }
        free(reqs);
        free(tails);
        free(active);
        free(psrc.free);
        free(pdst.free);
        return ok ? 0 : 1;
}
