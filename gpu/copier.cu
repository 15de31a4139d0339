/*
 * The copier: descriptors, one kernel launch and one event per batch,
 * completion by polling.
 *
 * Descriptors: a ring ("arena") of chunk descriptors in pinned, mapped host
 * memory, and one device buffer of the same size. A batch takes one
 * contiguous stretch of the host ring (skipping the ring's tail end if the
 * stretch would wrap); the planner writes its descriptors straight there; the
 * kernel reads them through the mapping (each block its own, one PCIe read)
 * and stores a copy of each into the device buffer as it goes; the batch's
 * event is recorded after the kernel. Everything is on one stream, so batches
 * finish in submission order: the device buffer is rewritten only after the
 * kernel before has finished, and when the event of ticket t has completed,
 * every batch up to t has too: the host ring is reclaimed up to the end of
 * t's stretch.
 *
 * Reuse: a layer's batch is usually the batch of the layer before with every
 * offset moved by one layer (the same requests, the same blocks; offsets are
 * layer-major). The copier keeps the runs of the batch whose descriptors are
 * in the device buffer; a new batch with the same runs, each source offset
 * moved by one amount and each destination offset by another, writes no
 * descriptor: the kernel runs those in the device buffer again with the two
 * amounts added, reading them from device memory.
 *
 * Two other ways, for comparison (flags): KVF_GPU_COPIER_STAGED_DESC copies
 * every batch's descriptors to the device with cudaMemcpyAsync before its
 * kernel (the first design: a copy-engine round trip of about 12 us on the
 * H200 before the kernel may start, docs/GPU.md); KVF_GPU_COPIER_MAPPED_DESC
 * reads every batch from host memory and keeps nothing on the device.
 *
 * Host ring positions are 64-bit counters of chunks that only grow (`head`
 * where the next batch starts, `tail` the oldest chunk still in use); their
 * difference is the space in use, so no wrap bookkeeping beyond the skip.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

#include "internal.h"

#define ARENA_DEFAULT 65536u
#define DESTROY_WAIT_NS 10000000000ull

struct slot {
        cudaEvent_t ev;
        uint64_t ticket;    /* the batch this slot holds, 0 if none yet */
        uint64_t arena_end; /* head after the batch's stretch */
};

struct kvf_gpu_copier {
        int device;
        unsigned flags;
        int sms;
        uint32_t chunk_bytes; /* 0: per batch */
        cudaStream_t stream;
        int own_stream;
        cudaEvent_t after_ev; /* orders a batch after another stream's work */

        struct kvf_gpu_chunk *host_arena; /* pinned, mapped */
        struct kvf_gpu_chunk *host_dev;   /* host_arena's device alias */
        struct kvf_gpu_chunk *dev_arena;  /* the device buffer (none with MAPPED_DESC) */
        uint64_t cap;                     /* chunks */
        uint64_t head, tail;

        uint64_t next_ticket; /* the next batch's ticket; tickets start at 1 */
        uint64_t retired;     /* every ticket <= retired has landed */
        int broken;           /* a CUDA error was seen: every unfinished batch fails */
        char broken_msg[256];
        struct slot slots[KVF_GPU_MAX_INFLIGHT];
        /* The batch whose descriptors are in the device buffer (reuse). */
        struct {
                struct kvf_gpu_run *runs;
                struct kvf_gpu_region *regions; /* n_src sources, then n_dst destinations */
                size_t n_runs, cap_runs, cap_regions;
                uint32_t n_src, n_dst, chunk;
                uint64_t k;
                int valid;
        } last;
        uint64_t fresh, reused;
        /* by_source(): a batch's runs in source order, and the radix sort's scratch */
        struct kvf_gpu_run *sorted;
        uint32_t *order, *order2;
        uint64_t *keys;
        size_t cap_sorted;
};

static uint64_t now_ns(void)
{
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

extern "C" void *kvf_gpu_copier_stream(const struct kvf_gpu_copier *c)
{
        return (void *)c->stream;
}

static void release(struct kvf_gpu_copier *c)
{
        free(c->last.runs);
        free(c->last.regions);
        free(c->sorted);
        free(c->order);
        free(c->order2);
        free(c->keys);
        for (unsigned i = 0; i < KVF_GPU_MAX_INFLIGHT; i++)
                if (c->slots[i].ev)
                        (void)cudaEventDestroy(c->slots[i].ev);
        if (c->after_ev)
                (void)cudaEventDestroy(c->after_ev);
        if (c->dev_arena)
                (void)cudaFree(c->dev_arena);
        if (c->host_arena)
                (void)cudaFreeHost(c->host_arena);
        if (c->own_stream && c->stream)
                (void)cudaStreamDestroy(c->stream);
        (void)cudaGetLastError();
        free(c);
}

extern "C" int kvf_gpu_copier_create(int device, unsigned flags,
                                     const struct kvf_gpu_copier_opts *opts,
                                     struct kvf_gpu_copier **out)
{
        struct kvf_gpu_copier *c;
        cudaError_t e;
        int prev, rc;

        if (!out)
                return kvf_gpu_err_set(-EINVAL, "copier: no output");
        *out = NULL;
        if (flags & ~(unsigned)(KVF_GPU_COPIER_MAPPED_DESC | KVF_GPU_COPIER_NORMAL_PRIORITY |
                                KVF_GPU_COPIER_STAGED_DESC | KVF_GPU_COPIER_PLAIN) ||
            (flags & KVF_GPU_COPIER_MAPPED_DESC && flags & KVF_GPU_COPIER_STAGED_DESC))
                return kvf_gpu_err_set(-EINVAL, "copier: unknown flags 0x%x", flags);
        if (opts && opts->chunk_bytes &&
            (opts->chunk_bytes % 16 || opts->chunk_bytes > KVF_GPU_CHUNK_MAX))
                return kvf_gpu_err_set(-EINVAL, "copier: chunk size %u", opts->chunk_bytes);
        if (!(c = (struct kvf_gpu_copier *)calloc(1, sizeof(*c))))
                return kvf_gpu_err_set(-ENOMEM, "copier: out of memory");
        c->device = device;
        c->flags = flags;
        c->cap = opts && opts->arena_chunks ? opts->arena_chunks : ARENA_DEFAULT;
        c->chunk_bytes = opts ? opts->chunk_bytes : 0;
        c->next_ticket = 1;

        if ((rc = kvf_gpu_device_enter(device, &prev)) < 0) {
                free(c);
                return rc;
        }
        if ((rc = kvf_gpu_device_sms(device)) < 0)
                goto fail;
        c->sms = rc;
        if ((rc = kvf_gpu_copy_kernels_load()) < 0)
                goto fail;
        if (opts && opts->stream) {
                c->stream = (cudaStream_t)opts->stream;
        } else {
                int lo = 0, hi = 0;
                if ((e = cudaDeviceGetStreamPriorityRange(&lo, &hi)) != cudaSuccess) {
                        rc = kvf_gpu_err_cuda(e, "cudaDeviceGetStreamPriorityRange");
                        goto fail;
                }
                /* Numerically lowest is the greatest priority. */
                int prio = (flags & KVF_GPU_COPIER_NORMAL_PRIORITY) ? lo : hi;
                e = cudaStreamCreateWithPriority(&c->stream, cudaStreamNonBlocking, prio);
                if (e != cudaSuccess) {
                        rc = kvf_gpu_err_cuda(e, "cudaStreamCreateWithPriority");
                        goto fail;
                }
                c->own_stream = 1;
        }
        if ((e = cudaEventCreateWithFlags(&c->after_ev, cudaEventDisableTiming)) != cudaSuccess) {
                rc = kvf_gpu_err_cuda(e, "cudaEventCreate");
                goto fail;
        }
        for (unsigned i = 0; i < KVF_GPU_MAX_INFLIGHT; i++) {
                e = cudaEventCreateWithFlags(&c->slots[i].ev, cudaEventDisableTiming);
                if (e != cudaSuccess) {
                        rc = kvf_gpu_err_cuda(e, "cudaEventCreate");
                        goto fail;
                }
        }
        {
                size_t bytes = (size_t)c->cap * sizeof(struct kvf_gpu_chunk);
                e = cudaHostAlloc((void **)&c->host_arena, bytes, cudaHostAllocMapped);
                if (e != cudaSuccess) {
                        rc = kvf_gpu_err_cuda(e, "cudaHostAlloc (descriptor arena)");
                        goto fail;
                }
                e = cudaHostGetDevicePointer((void **)&c->host_dev, c->host_arena, 0);
                if (e == cudaSuccess && !(flags & KVF_GPU_COPIER_MAPPED_DESC))
                        e = cudaMalloc((void **)&c->dev_arena, bytes);
                if (e != cudaSuccess) {
                        rc = kvf_gpu_err_cuda(e, "descriptor arena on the device");
                        goto fail;
                }
        }
        kvf_gpu_device_leave(prev);
        *out = c;
        return 0;
fail:
        kvf_gpu_device_leave(prev);
        release(c);
        return rc;
}

static int set_broken(struct kvf_gpu_copier *c, cudaError_t e, const char *what)
{
        int rc = kvf_gpu_err_cuda(e, what);
        if (!c->broken) {
                c->broken = 1;
                snprintf(c->broken_msg, sizeof(c->broken_msg), "%s", kvf_gpu_err_msg());
        }
        return rc == -ENOMEM ? -EIO : rc;
}

/* Ticket t is complete: so is everything before it (one stream). */
static void retire_upto(struct kvf_gpu_copier *c, uint64_t t)
{
        if (t <= c->retired)
                return;
        c->retired = t;
        /* Monotonic: an empty batch's end can lie before a stretch that
         * arena_take moved to the ring's start meanwhile. */
        uint64_t end = c->slots[t % KVF_GPU_MAX_INFLIGHT].arena_end;
        if (end > c->tail)
                c->tail = end;
}

/*
 * Query the events of unfinished batches, oldest first, and retire those
 * that are done; stop at the first pending one. Returns 0, or -EIO after a
 * CUDA error (the copier is then broken).
 */
static int reap(struct kvf_gpu_copier *c)
{
        while (c->retired + 1 < c->next_ticket && !c->broken) {
                uint64_t t = c->retired + 1;
                cudaError_t e = cudaEventQuery(c->slots[t % KVF_GPU_MAX_INFLIGHT].ev);
                if (e == cudaErrorNotReady)
                        return 0;
                if (e != cudaSuccess)
                        return set_broken(c, e, "copy batch");
                retire_upto(c, t);
        }
        return c->broken ? -EIO : 0;
}

int kvf_gpu_arena_fit(uint64_t *head, uint64_t *tail, uint64_t cap, uint64_t k, uint64_t *start)
{
        if (*tail == *head && (*head % cap) + k > cap) {
                /* Nothing in use: start the next stretch at the ring's start rather
                 * than count the skipped end as in use (which would refuse, for
                 * ever, a batch that fits an empty ring). */
                *head += cap - *head % cap;
                *tail = *head;
        }
        uint64_t pos = *head, off = pos % cap;
        if (off + k > cap)
                pos += cap - off; /* a stretch never wraps: skip the ring's end */
        if (pos + k - *tail > cap)
                return -EAGAIN;
        *start = pos;
        return 0;
}

/* Room for k chunks in one stretch? *start receives where it begins. */
static int arena_take(struct kvf_gpu_copier *c, uint64_t k, uint64_t *start)
{
        for (int attempt = 0; attempt < 2; attempt++) {
                if (kvf_gpu_arena_fit(&c->head, &c->tail, c->cap, k, start) == 0)
                        return 0;
                int rc = reap(c);
                if (rc < 0)
                        return rc;
        }
        return kvf_gpu_err_set(-EAGAIN,
                               "copier: descriptor arena full (%llu batches in flight, %llu of "
                               "%llu chunks in use, %llu wanted)",
                               (unsigned long long)(c->next_ticket - 1 - c->retired),
                               (unsigned long long)(c->head - c->tail), (unsigned long long)c->cap,
                               (unsigned long long)k);
}

static int same_region(const struct kvf_gpu_region *a, const struct kvf_gpu_region *b)
{
        return a->base == b->base && a->bytes == b->bytes;
}

/*
 * Is batch b the last staged batch with every source offset moved by *ds and
 * every destination offset by *dd (the same two amounts for all runs)? This is
 * also the check of a reused batch, in place of kvf_gpu_plan's first pass: the
 * regions, their indexes, the byte counts and the chunk size are those of the
 * last batch (which that pass checked), so each run only needs its moved
 * offsets inside its regions; the same byte counts and chunk size then cut the
 * same pieces, c->last.k of them. A run outside answers no, and the full plan
 * reports it.
 */
static int shift_of(const struct kvf_gpu_copier *c, const struct kvf_gpu_batch *b, uint32_t chunk,
                    uint64_t *ds, uint64_t *dd)
{
        if (!c->last.valid || c->last.n_runs != b->n_runs || c->last.chunk != chunk ||
            c->last.n_src != b->n_src || c->last.n_dst != b->n_dst)
                return 0;
        for (uint32_t i = 0; i < b->n_src; i++)
                if (!same_region(&c->last.regions[i], &b->src[i]))
                        return 0;
        for (uint32_t i = 0; i < b->n_dst; i++)
                if (!same_region(&c->last.regions[b->n_src + i], &b->dst[i]))
                        return 0;
        int have = 0;
        uint64_t s = 0, d = 0; /* *ds and *dd are written only for a yes */
        for (size_t i = 0; i < b->n_runs; i++) {
                const struct kvf_gpu_run *r = &b->runs[i], *o = &c->last.runs[i];
                if (r->bytes != o->bytes || r->src_region != o->src_region ||
                    r->dst_region != o->dst_region)
                        return 0;
                if (!r->bytes)
                        continue;
                if (!kvf_gpu_inside(r->src_off, r->bytes, b->src[r->src_region].bytes) ||
                    !kvf_gpu_inside(r->dst_off, r->bytes, b->dst[r->dst_region].bytes))
                        return 0;
                if (!have) {
                        s = r->src_off - o->src_off;
                        d = r->dst_off - o->dst_off;
                        have = 1;
                } else if (r->src_off - o->src_off != s || r->dst_off - o->dst_off != d) {
                        return 0;
                }
        }
        if (have) {
                *ds = s;
                *dd = d;
        }
        return have;
}

/* Remember batch b as the one whose descriptors are on the device. */
static void remember(struct kvf_gpu_copier *c, const struct kvf_gpu_batch *b, uint32_t chunk,
                     uint64_t k)
{
        size_t nreg = (size_t)b->n_src + b->n_dst;
        c->last.valid = 0;
        if (b->n_runs > c->last.cap_runs) {
                void *p = realloc(c->last.runs, b->n_runs * sizeof(*b->runs));
                if (!p)
                        return; /* no reuse for this one: correct, only slower */
                c->last.runs = (struct kvf_gpu_run *)p;
                c->last.cap_runs = b->n_runs;
        }
        if (nreg > c->last.cap_regions) {
                void *p = realloc(c->last.regions, nreg * sizeof(*b->src));
                if (!p)
                        return;
                c->last.regions = (struct kvf_gpu_region *)p;
                c->last.cap_regions = nreg;
        }
        memcpy(c->last.runs, b->runs, b->n_runs * sizeof(*b->runs));
        memcpy(c->last.regions, b->src, b->n_src * sizeof(*b->src));
        memcpy(c->last.regions + b->n_src, b->dst, b->n_dst * sizeof(*b->dst));
        c->last.n_runs = b->n_runs;
        c->last.n_src = b->n_src;
        c->last.n_dst = b->n_dst;
        c->last.chunk = chunk;
        c->last.k = k;
        c->last.valid = 1;
}

extern "C" void kvf_gpu_copier_counts(const struct kvf_gpu_copier *c, uint64_t *fresh,
                                      uint64_t *reused)
{
        if (fresh)
                *fresh = c->fresh;
        if (reused)
                *reused = c->reused;
}

/*
 * A batch's runs in the order of their source addresses, for the planner's
 * emit pass: thread blocks that run side by side then read nearby memory.
 * Measured on the H200 (docs/BENCHMARKS.md section 4): scattered
 * 16 KiB blocks copied 1.5 to 2 % faster, which took the 64 MiB row over the
 * 0.85 x bulk target in every round instead of one in four. Only for a batch
 * whose descriptors are written fresh (the layers after reuse them, already
 * in that order), and only from SORT_MIN runs: an LSD radix sort, 8 bits a
 * pass, on (source region, 64 KiB piece of the region): two or three passes
 * for caches up to 16 GiB. NULL (plan as given) when the scratch cannot be
 * had.
 * The runs were checked against their regions by the counting pass.
 */
#define SORT_MIN 256u
static const struct kvf_gpu_run *by_source(struct kvf_gpu_copier *c, const struct kvf_gpu_batch *b)
{
        size_t n = b->n_runs;
        if (n < SORT_MIN || n > UINT32_MAX)
                return NULL;
        if (n > c->cap_sorted) {
                free(c->sorted);
                free(c->order);
                free(c->order2);
                free(c->keys);
                c->sorted = (struct kvf_gpu_run *)malloc(n * sizeof(*c->sorted));
                c->order = (uint32_t *)malloc(n * sizeof(*c->order));
                c->order2 = (uint32_t *)malloc(n * sizeof(*c->order2));
                c->keys = (uint64_t *)malloc(n * sizeof(*c->keys));
                c->cap_sorted = c->sorted && c->order && c->order2 && c->keys ? n : 0;
                if (!c->cap_sorted)
                        return NULL;
        }
        uint64_t hi = 0;
        for (size_t i = 0; i < n; i++) {
                const struct kvf_gpu_run *r = &b->runs[i];
                c->keys[i] = (uint64_t)r->src_region << 48 | r->src_off >> 16;
                hi |= c->keys[i];
                c->order[i] = (uint32_t)i;
        }
        uint32_t *from = c->order, *to = c->order2;
        for (unsigned shift = 0; shift < 64 && (hi >> shift); shift += 8) {
                uint32_t count[257] = {0};
                for (size_t i = 0; i < n; i++)
                        count[((c->keys[from[i]] >> shift) & 255u) + 1]++;
                for (unsigned d = 0; d < 256; d++)
                        count[d + 1] += count[d];
                for (size_t i = 0; i < n; i++) /* stable: equal digits keep their order */
                        to[count[(c->keys[from[i]] >> shift) & 255u]++] = from[i];
                uint32_t *t = from;
                from = to;
                to = t;
        }
        for (size_t i = 0; i < n; i++)
                c->sorted[i] = b->runs[from[i]];
        return c->sorted;
}

extern "C" int kvf_gpu_copy_submit(struct kvf_gpu_copier *c, const struct kvf_gpu_batch *b,
                                   uint64_t *ticket)
{
        uint64_t start = 0, ds = 0, dd = 0;
        size_t k = 0;
        int prev, rc, reuse = 0;
        cudaError_t e;

        if (!b || !ticket)
                return kvf_gpu_err_set(-EINVAL, "submit: no batch or no ticket");
        *ticket = 0;
        if (c->broken)
                return kvf_gpu_err_set(-EIO, "copier unusable after an earlier failure: %s",
                                       c->broken_msg);
        /* Size the chunks, check every run and count (no CUDA call yet). */
        uint64_t total = 0;
        for (size_t i = 0; i < b->n_runs; i++)
                total += b->runs ? b->runs[i].bytes : 0;
        uint32_t chunk = c->chunk_bytes ? c->chunk_bytes : kvf_gpu_chunk_bytes_for(total, c->sms);
        const int keep = !(c->flags & (KVF_GPU_COPIER_MAPPED_DESC | KVF_GPU_COPIER_STAGED_DESC));
        /* A layer's batch is usually the last one shifted: then shift_of is the whole
         * check, and the count is the last one's (no division per run on the way to the
         * launch). Anything else is planned and checked in full. */
        if (keep && c->last.valid && c->last.k && b->runs && b->n_runs && (b->src || !b->n_src) &&
            (b->dst || !b->n_dst) && (reuse = shift_of(c, b, chunk, &ds, &dd)))
                k = (size_t)c->last.k;
        else if ((rc = kvf_gpu_plan(b->runs, b->n_runs, b->src, b->n_src, b->dst, b->n_dst, chunk,
                                    NULL, 0, &k)) < 0)
                return rc;
        if (k > c->cap)
                return kvf_gpu_err_set(-E2BIG,
                                       "batch of %zu runs needs %zu chunks, the copier's arena "
                                       "holds %llu: split it",
                                       b->n_runs, k, (unsigned long long)c->cap);
        if (k > UINT32_MAX)
                return kvf_gpu_err_set(-E2BIG, "batch needs %zu chunks", k);
        if (c->next_ticket - 1 - c->retired >= KVF_GPU_MAX_INFLIGHT) {
                if ((rc = reap(c)) < 0)
                        return rc;
                if (c->next_ticket - 1 - c->retired >= KVF_GPU_MAX_INFLIGHT)
                        return kvf_gpu_err_set(-EAGAIN, "copier: %u batches in flight",
                                               KVF_GPU_MAX_INFLIGHT);
        }
        if (k && !reuse && (rc = arena_take(c, k, &start)) < 0)
                return rc;
        struct kvf_gpu_chunk *h = c->host_arena + start % c->cap;
        /* What the kernel reads, and where it leaves a copy for the next layers. */
        const struct kvf_gpu_chunk *from = reuse || (c->flags & KVF_GPU_COPIER_STAGED_DESC)
                                               ? c->dev_arena
                                               : c->host_dev + start % c->cap;
        struct kvf_gpu_chunk *save = k && !reuse && keep ? c->dev_arena : NULL;
        size_t k2 = 0;
        if (k && !reuse) {
                const struct kvf_gpu_run *emit = by_source(c, b);
                if ((rc = kvf_gpu_plan(emit ? emit : b->runs, b->n_runs, b->src, b->n_src, b->dst,
                                       b->n_dst, chunk, h, k, &k2)) < 0)
                        return rc;
        }
        if ((rc = kvf_gpu_device_enter(c->device, &prev)) < 0)
                return rc;
        if (save)
                c->last.valid = 0; /* the device buffer is being rewritten */
        if (k && (c->flags & KVF_GPU_COPIER_STAGED_DESC)) {
                /* Before the wait for the engine's stream: it needs nothing of it. */
                e = cudaMemcpyAsync(c->dev_arena, h, k * sizeof(*h), cudaMemcpyHostToDevice,
                                    c->stream);
                if (e != cudaSuccess) {
                        rc = kvf_gpu_err_cuda(e, "staging the copy descriptors");
                        goto out;
                }
        }
        if (b->after_stream || b->after) {
                if ((e = cudaEventRecord(c->after_ev, (cudaStream_t)b->after_stream)) !=
                    cudaSuccess) {
                        rc = kvf_gpu_err_cuda(e, "cudaEventRecord on the engine's stream");
                        goto out;
                }
                if ((e = cudaStreamWaitEvent(c->stream, c->after_ev, 0)) != cudaSuccess) {
                        rc = kvf_gpu_err_cuda(e, "cudaStreamWaitEvent");
                        goto out;
                }
        }
        if ((rc = kvf_gpu_copy_launch_ex(from, (uint32_t)k, ds, dd, save,
                                         !(c->flags & KVF_GPU_COPIER_PLAIN), c->stream,
                                         b->stamps)) < 0)
                goto out;
        if (save)
                remember(c, b, chunk, k);
        if (k)
                reuse ? c->reused++ : c->fresh++;
        {
                uint64_t t = c->next_ticket;
                struct slot *s = &c->slots[t % KVF_GPU_MAX_INFLIGHT];
                if ((e = cudaEventRecord(s->ev, c->stream)) != cudaSuccess) {
                        /* The kernel is queued but nobody can learn when it ends:
                         * treat the copier as failed (the caller fails this batch). */
                        rc = set_broken(c, e, "cudaEventRecord after the copy");
                        goto out;
                }
                s->ticket = t;
                s->arena_end = k && !reuse ? start + k : c->head;
                if (k && !reuse)
                        c->head = start + k;
                c->next_ticket = t + 1;
                *ticket = t;
        }
        rc = 0;
out:
        kvf_gpu_device_leave(prev);
        return rc;
}

extern "C" int kvf_gpu_copy_poll(struct kvf_gpu_copier *c, uint64_t ticket)
{
        if (ticket == 0 || ticket >= c->next_ticket)
                return kvf_gpu_err_set(-EINVAL, "poll: ticket %llu was never issued",
                                       (unsigned long long)ticket);
        if (ticket <= c->retired)
                return 1;
        if (c->broken)
                return kvf_gpu_err_set(-EIO, "%s", c->broken_msg);
        /* Only tickets newer than `retired` are here, and fewer than
         * KVF_GPU_MAX_INFLIGHT of them exist, so the slot still holds `ticket`. */
        cudaError_t e = cudaEventQuery(c->slots[ticket % KVF_GPU_MAX_INFLIGHT].ev);
        if (e == cudaErrorNotReady)
                return 0;
        if (e != cudaSuccess)
                return set_broken(c, e, "copy batch");
        retire_upto(c, ticket);
        return 1;
}

extern "C" void kvf_gpu_copier_destroy(struct kvf_gpu_copier *c)
{
        if (!c)
                return;
        int prev;
        if (kvf_gpu_device_enter(c->device, &prev) == 0) {
                /* Bounded wait: freeing the arenas under a running kernel would be
                 * a use after free on the GPU; a stuck GPU must not hang us. */
                uint64_t until = now_ns() + DESTROY_WAIT_NS;
                while (!c->broken && c->retired + 1 < c->next_ticket && now_ns() < until) {
                        if (kvf_gpu_copy_poll(c, c->next_ticket - 1) != 0)
                                break;
                        struct timespec ts = {0, 100000};
                        nanosleep(&ts, NULL);
                }
                kvf_gpu_device_leave(prev);
        }
        release(c);
}
