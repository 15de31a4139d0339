/*
 * The CUDA backend: the cache is one device allocation (cudaMalloc, never
 * managed memory) on the instance's GPU, made and kept by the allocator for
 * the life of the instance: the memory dies with the allocator's process,
 * never with an engine's, so an engine that crashes and attaches again finds
 * its caches as it left them. Its CUDA IPC handle (one, for the whole cache)
 * and the GPU's UUID are in the control segment (cuda_handles_off,
 * cuda_uuid); every other process (sender, connector, the engine's client)
 * opens the handle once per mapping. `base` is then a device pointer and
 * kvf_layout_offset offsets apply unchanged.
 *
 * Why one allocation, not one per tensor: a copy run is an offset into a
 * region, so one region per cache keeps every batch's region table as long
 * as its list of peers; one handle to open per peer; and engines in other
 * languages need one handle and the layout to find every tensor.
 *
 * One allocation per tensor (the segment has layers x tensors handles, in
 * kvf_layout_offset order: an instance made for FastDeploy, whose workers
 * open each tensor's own handle and use the pointer as the tensor): every
 * mapping opens them all and keeps their addresses (kvf_cache.parts); a run
 * never crosses a tensor, so each run names the region of its tensor and an
 * offset in it, and a batch's region table has a region per tensor per
 * cache. GPUDirect RDMA registers one allocation and is refused there (tcp
 * and same-host copies carry such caches); copies run in the sender's
 * context (the engine executor's plans address one allocation).
 *
 * Copies (same host): one kernel launch per batch, through the gpu/ copier
 * (kvf_gpu_copy_submit: runs checked against their regions before anything
 * is launched, one event per batch, polled). The copier lives on the source
 * cache's mapping (the sender's own cache) and runs in this process's
 * context: executor 1, the sender's context (fast beside a busy engine under
 * MPS only; docs/GPU.md).
 *
 * Staged io (the tcp path, cache_stage.c): each connection thread has a
 * copier of its own (its own stream) and pinned host buffers the kernel
 * reads or writes over PCIe; a group of runs (a send batch, a received frame)
 * is one launch of the same copy kernel, the pinned buffer being one region
 * and the cache the other, so every run is checked against both before the
 * launch. The thread waits for a group's copy only when it needs the bytes.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache.h"
#include "clock.h"
#include "err.h"
#include "kvf_gpu.h"
#include "layout.h"
#include "log.h"
#include "registration.h"

_Static_assert(KVF_REG_HANDLE_SIZE == KVF_GPU_IPC_HANDLE_SIZE, "a registration's handle is CUDA's");

#define AGAIN_WAIT_NS 2000000000ull

struct cuda_map {
        int device; /* kernels that use this mapping run here */
        int owner;  /* the device holding the memory */
        void *ptr;  /* the IPC-opened pointer (base) */
        uint8_t **parts; /* one allocation per tensor: each tensor's IPC-opened pointer */
        uint32_t n_parts;
        void **opens;    /* the engine's caches: each registered allocation's open */
        uint32_t n_opens;
        int *dmabufs;     /* ... and its dma-buf (the engine exported it), -1 none */
        uint64_t *dmabuf_bytes;
        struct kvf_gpu_copier *copier; /* created at the first copy from this cache */
        struct kvf_gpu_run *runs;
        uint32_t cap_runs;
        struct kvf_gpu_region *dst;
        uint32_t cap_dst;
        struct kvf_gpu_region *src;
        uint32_t cap_src;
        uint32_t *dfirst; /* each destination cache's first region */
        uint32_t cap_dfirst;
        struct kvf_ctl_header hdr; /* the instance's, as mapped (names its dma-buf offer) */
};

static int gpu_err(int rc, const char *what)
{
        return kvf_err_set(rc, "%s: %s", what, kvf_gpu_err_msg());
}

int kvf_cache_cuda_gpus(void)
{
        int n = kvf_gpu_device_count();
        if (n <= 0)
                kvf_err_set(0, "no GPU visible: %s", kvf_gpu_err_msg());
        return n > 0 ? n : 0;
}

int kvf_cache_cuda_device_of(const uint8_t uuid[16])
{
        return kvf_gpu_device_by_uuid(uuid);
}

int kvf_cache_cuda_uuid(int device, uint8_t uuid[16])
{
        int rc = kvf_gpu_device_uuid(device, uuid);
        return rc < 0 ? gpu_err(rc, "GPU UUID") : 0;
}

int kvf_cache_cuda_mem_range(const void *p, uint64_t *base, uint64_t *bytes, int *device, int *vmm)
{
        int rc = kvf_gpu_mem_range(p, base, bytes, device, vmm);
        return rc < 0 ? kvf_err_set(rc, "%s", kvf_gpu_err_msg()) : 0;
}

int kvf_cache_cuda_ipc_export(void *base, uint8_t handle[64])
{
        int rc = kvf_gpu_ipc_export(base, handle);
        return rc < 0 ? kvf_err_set(rc, "%s", kvf_gpu_err_msg()) : 0;
}

static void uuid_str(const uint8_t u[16], char *out, size_t len)
{
        snprintf(out, len,
                 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                 u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
                 u[14], u[15]);
}

/* Tensors of the layout (scale tensors included): the handle count of an instance with one
 * allocation per tensor. */
static uint32_t layout_parts(const struct kvf_cache_layout *l)
{
        return kvf_layout_parts(l);
}

static uint64_t round_2m(uint64_t b)
{
        return (b + (2u << 20) - 1) & ~(uint64_t)((2u << 20) - 1);
}

/* One zeroed allocation per tensor, each handle in the segment's table. */
static int create_parts(struct kvf_ctl_header *h, int dev)
{
        const struct kvf_cache_layout *l = &h->layout;
        uint32_t n = h->cuda_handles_count;
        char need[32];
        void **p = calloc(n, sizeof(*p));
        int rc = 0;
        if (!p)
                return kvf_err_set(-ENOMEM, "out of memory");
        for (uint32_t i = 0; i < n; i++) {
                uint64_t tb = kvf_layout_part_bytes(l, i);
                kvf_fmt_bytes(tb, need, sizeof(need));
                if ((rc = kvf_gpu_alloc(dev, round_2m(tb), &p[i])) < 0) {
                        rc = kvf_err_set(rc, "allocate tensor %u of %u (%s) on GPU %d: %s%s", i, n, need, dev,
                                         kvf_gpu_err_msg(), rc == -ENOMEM ? "; use fewer --blocks" : "");
                        break;
                }
                if ((rc = kvf_gpu_memset(dev, p[i], 0, tb)) < 0 ||
                    (rc = kvf_gpu_ipc_export(p[i], (uint8_t *)h + h->cuda_handles_off +
                                                       (uint64_t)i * KVF_GPU_IPC_HANDLE_SIZE)) < 0) {
                        rc = gpu_err(rc, "cuda backend");
                        break;
                }
        }
        if (rc == 0 && (rc = kvf_gpu_device_uuid(dev, h->cuda_uuid)) < 0)
                rc = gpu_err(rc, "cuda backend");
        if (rc < 0)
                for (uint32_t i = 0; i < n && p[i]; i++)
                        kvf_gpu_free(dev, p[i]);
        free(p); /* the allocations live as long as this process */
        return rc;
}

static int cuda_create(struct kvf_ctl_header *h, const struct kvf_cache_opts *o)
{
        const struct kvf_cache_layout *l = &h->layout;
        int dev = (int)h->device, n = kvf_gpu_device_count();
        char need[32];
        void *p = NULL;
        int rc;

        (void)o; /* huge pages and a kept mapping are host-memory matters */
        if (n <= 0)
                return kvf_err_set(-ENODEV, "cuda backend: no GPU visible: %s", kvf_gpu_err_msg());
        if (h->device == KVF_DEVICE_NONE || dev >= n)
                return kvf_err_set(-ENODEV, "cuda backend: no GPU %u here (%d visible)", h->device, n);
        if (h->cuda_handles_count > 1 && h->cuda_handles_count == layout_parts(l))
                return create_parts(h, dev);
        if (h->cuda_handles_count != 1)
                return kvf_err_set(-EINVAL, "cuda backend: the segment has room for %u handles, needs 1 "
                                   "(or %u, one per tensor)", h->cuda_handles_count, layout_parts(l));
        kvf_fmt_bytes(l->cache_bytes, need, sizeof(need));
        /* Whole 2 MiB pages (the allocation's granularity): a dma-buf of the cache
         * (GPUDirect RDMA) covers whole host pages. */
        if ((rc = kvf_gpu_alloc(dev, (l->cache_bytes + (2u << 20) - 1) & ~(uint64_t)((2u << 20) - 1), &p)) < 0)
                return kvf_err_set(rc, "allocate a cache of %s on GPU %d: %s%s", need, dev,
                                   kvf_gpu_err_msg(), rc == -ENOMEM ? "; use fewer --blocks" : "");
        /* Zeroed, like the host backend's fresh file: what an engine reads before it wrote
         * anything is the same on both. */
        if ((rc = kvf_gpu_memset(dev, p, 0, l->cache_bytes)) < 0 ||
            (rc = kvf_gpu_device_uuid(dev, h->cuda_uuid)) < 0 ||
            (rc = kvf_gpu_ipc_export(p, (uint8_t *)h + h->cuda_handles_off)) < 0) {
                rc = gpu_err(rc, "cuda backend");
                kvf_gpu_free(dev, p);
                return rc;
        }
        /* For a NIC (GPUDirect RDMA): only this process can export the allocation's dma-buf. */
        kvf_cuda_dmabuf_offer(h, dev, p, l->cache_bytes);
        return 0; /* p lives as long as this process */
}

static void cuda_destroy(const struct kvf_ctl_header *h)
{
        (void)h;
        /* Nothing: the memory goes with the allocator's process. Freeing it while another
         * process still has it open (an engine that has not detached yet) is undefined in
         * CUDA; the driver releases it safely when the process exits. */
}

static int cuda_map(const struct kvf_ctl_header *h, bool writable, struct kvf_cache *out)
{
        char u[48];
        (void)writable; /* an IPC mapping is read-write; the roles keep to their side */
        uint32_t nparts = layout_parts(&h->layout);
        if (h->cuda_handles_count != 1 && h->cuda_handles_count != nparts)
                return kvf_err_set(-EPROTO, "instance '%s': %u CUDA handles, the cuda backend makes 1 "
                                   "(or %u, one per tensor)", h->instance, h->cuda_handles_count, nparts);
        uuid_str(h->cuda_uuid, u, sizeof(u));
        int owner = kvf_gpu_device_by_uuid(h->cuda_uuid);
        if (owner < 0)
                return kvf_err_set(-ENOENT,
                                   "instance '%s' keeps its cache on %s, which this process does not see "
                                   "(CUDA_VISIBLE_DEVICES?): %s",
                                   h->instance, u, kvf_gpu_err_msg());
        struct cuda_map *m = calloc(1, sizeof(*m));
        if (!m)
                return kvf_err_set(-ENOMEM, "out of memory");
        m->device = out->device >= 0 ? out->device : owner;
        m->hdr = *h;
        m->owner = owner;
        int rc;
        if (h->cuda_handles_count > 1) {
                m->n_parts = h->cuda_handles_count;
                if (!(m->parts = calloc(m->n_parts, sizeof(*m->parts)))) {
                        free(m);
                        return kvf_err_set(-ENOMEM, "out of memory");
                }
                rc = 0;
                for (uint32_t i = 0; i < m->n_parts && rc == 0; i++) {
                        void *q = NULL;
                        rc = kvf_gpu_ipc_open(m->device, (const uint8_t *)h + h->cuda_handles_off +
                                                                 (uint64_t)i * KVF_GPU_IPC_HANDLE_SIZE,
                                              &q, NULL);
                        m->parts[i] = q;
                }
                if (rc < 0)
                        for (uint32_t i = 0; i < m->n_parts && m->parts[i]; i++)
                                kvf_gpu_ipc_close(m->device, m->parts[i]);
                else
                        m->ptr = m->parts[0];
        } else {
                rc = kvf_gpu_ipc_open(m->device, (const uint8_t *)h + h->cuda_handles_off, &m->ptr, NULL);
        }
        if (rc < 0) {
                kvf_err_set(rc == -EXDEV ? -EXDEV : -ENOENT, "open the cache of instance '%s' (%s, GPU %d here)%s: %s",
                            h->instance, u, owner, m->device != owner ? " for copies from another GPU" : "",
                            kvf_gpu_err_msg());
                free(m->parts);
                free(m);
                return rc == -EXDEV ? -EXDEV : -ENOENT;
        }
        out->base = m->ptr;
        if (m->parts) {
                out->parts = m->parts;
                out->n_parts = m->n_parts;
        }
        out->host = false;
        out->device = m->device;
        out->priv = m;
        return 0;
}

static void cuda_unmap(struct kvf_cache *c)
{
        struct cuda_map *m = c->priv;
        if (!m)
                return;
        /* Waits (bounded) for the copies in flight: never close the mapping under them. */
        kvf_gpu_copier_destroy(m->copier);
        if (m->parts)
                for (uint32_t i = 0; i < m->n_parts; i++)
                        kvf_gpu_ipc_close(m->device, m->parts[i]);
        else
                kvf_gpu_ipc_close(m->device, m->ptr);
        free(m->parts);
        free(m->runs);
        free(m->dst);
        free(m->src);
        free(m->dfirst);
        free(m);
        c->priv = NULL;
}

static int grow(void **p, uint32_t *cap, uint32_t want, size_t size)
{
        if (want <= *cap)
                return 0;
        uint32_t n = *cap ? *cap : 256;
        while (n < want)
                n *= 2;
        void *q = realloc(*p, (size_t)n * size);
        if (!q)
                return -ENOMEM;
        *p = q;
        *cap = n;
        return 0;
}

/* Submit runs [0, n) as one batch; a batch larger than the copier's arena goes in halves
 * (batches of one copier land in order, so the last ticket stands for all of them). */
static int submit(struct kvf_gpu_copier *cp, struct kvf_gpu_batch *b, const struct kvf_gpu_run *runs,
                  size_t n, uint64_t *ticket)
{
        uint64_t start = 0;
        for (;;) {
                b->runs = runs;
                b->n_runs = n;
                int rc = kvf_gpu_copy_submit(cp, b, ticket);
                if (rc == -E2BIG && n > 1) {
                        size_t half = n / 2;
                        if ((rc = submit(cp, b, runs, half, ticket)) < 0)
                                return rc;
                        return submit(cp, b, runs + half, n - half, ticket);
                }
                if (rc != -EAGAIN)
                        return rc < 0 ? gpu_err(rc, "GPU copy") : 0;
                /* Every slot or the descriptor arena is taken by batches in flight: they
                 * land in microseconds; the copier reaps them on the next try. */
                if (!start)
                        start = kvf_now_ns();
                else if (kvf_now_ns() - start > AGAIN_WAIT_NS)
                        return kvf_err_set(-EIO, "GPU copies did not complete for 2 s: %s",
                                           kvf_gpu_err_msg());
                kvf_sleep_ns(10000);
        }
}

/* The copier's form of runs (one source region; destination regions by run). */
static void gpu_runs(const struct kvf_copy_run *r, uint32_t n, struct kvf_gpu_run *out)
{
        for (uint32_t i = 0; i < n; i++)
                out[i] = (struct kvf_gpu_run){.src_off = r[i].src_off, .dst_off = r[i].dst_off,
                                              .bytes = r[i].bytes, .src_region = 0, .dst_region = r[i].dst};
}

/* A cache's regions: the one allocation, or one per tensor. */
static uint32_t cache_regions(const struct kvf_cache *c)
{
        return c->parts ? c->n_parts : 1;
}

static void put_regions(const struct kvf_cache *c, struct kvf_gpu_region *r)
{
        if (!c->parts) {
                r[0] = (struct kvf_gpu_region){.base = (uint64_t)(uintptr_t)c->base, .bytes = c->bytes};
                return;
        }
        uint64_t nb = c->layout.num_blocks;
        for (uint32_t i = 0; i < c->n_parts; i++)
                r[i] = (struct kvf_gpu_region){
                    .base = (uint64_t)(uintptr_t)c->parts[i],
                    .bytes = c->strides ? (nb - 1) * c->strides[i] + kvf_layout_part_block_bytes(&c->layout, i)
                                        : kvf_layout_part_bytes(&c->layout, i)};
}

/* An offset of cache c as (region, offset in it), region counted from `first`. An offset past
 * the last tensor gets region UINT32_MAX, which the copier refuses (never the next cache's). */
static void split_off(const struct kvf_cache *c, uint32_t first, uint64_t off, uint32_t *region,
                      uint64_t *rest)
{
        if (!c->parts) {
                *region = first;
                *rest = off;
                return;
        }
        uint64_t r;
        uint32_t i = kvf_layout_part(&c->layout, off, &r);
        uint64_t bb = i < c->n_parts ? kvf_layout_part_block_bytes(&c->layout, i) : 1;
        *region = i < c->n_parts ? first + i : UINT32_MAX;
        *rest = i < c->n_parts && c->strides ? r / bb * c->strides[i] + r % bb : r;
}

/* One side of a copy: a cache (its regions from `first` on), or a staging buffer (c NULL:
 * region `first`, contiguous). */
struct side {
        const struct kvf_cache *c;
        uint32_t first;
};

static uint64_t side_contig(const struct side *s, uint64_t off)
{
        return s->c ? kvf_cache_contig(s->c, off) : UINT64_MAX;
}

static void side_place(const struct side *s, uint64_t off, uint32_t *region, uint64_t *rest)
{
        if (s->c) {
                split_off(s->c, s->first, off, region, rest);
        } else {
                *region = s->first;
                *rest = off;
        }
}

/*
 * The copier's runs for run r, cut wherever either side is not contiguous (an engine's
 * blocks with a stride: one run per block), appended at (*out)[*n]. A side with nothing
 * mapped at an offset gets region UINT32_MAX for the rest, which the copier refuses.
 */
static int cut_run(const struct kvf_copy_run *r, const struct side *src, const struct side *dst,
                   struct kvf_gpu_run **out, uint32_t *cap, uint32_t *n)
{
        uint64_t so = r->src_off, dof = r->dst_off, left = r->bytes;
        while (left) {
                uint64_t k = left, cs = side_contig(src, so), cd = side_contig(dst, dof);
                k = k < cs ? k : cs;
                k = k < cd ? k : cd;
                if (k == 0)
                        k = left;
                if (*n >= *cap) {
                        uint32_t nc = *cap ? *cap * 2 : 256;
                        void *q = realloc(*out, (size_t)nc * sizeof(**out));
                        if (!q)
                                return -ENOMEM;
                        *out = q;
                        *cap = nc;
                }
                struct kvf_gpu_run *g = &(*out)[(*n)++];
                g->bytes = k;
                side_place(src, so, &g->src_region, &g->src_off);
                side_place(dst, dof, &g->dst_region, &g->dst_off);
                if (cs == 0)
                        g->src_region = UINT32_MAX;
                if (cd == 0)
                        g->dst_region = UINT32_MAX;
                so += k, dof += k, left -= k;
        }
        return 0;
}

uint32_t kvf_cache_cuda_regions(const struct kvf_cache *c, struct kvf_gpu_region *r)
{
        if (r)
                put_regions(c, r);
        return cache_regions(c);
}

int kvf_cache_cuda_cut(const struct kvf_cache *src, uint32_t src_first, uint64_t src_off,
                       const struct kvf_cache *dst, uint32_t dst_first, uint64_t dst_off, uint64_t bytes,
                       struct kvf_gpu_run **out, uint32_t *cap, uint32_t *n)
{
        const struct kvf_copy_run r = {.src_off = src_off, .dst_off = dst_off, .bytes = bytes};
        const struct side s = {src, src_first}, d = {dst, dst_first};
        return cut_run(&r, &s, &d, out, cap, n);
}

/* A cache the copier may address on GPU `device`: a cuda mapping, or the engine's caches in
 * GPU memory (kvf_cache_cuda_reg_map). */
static bool gpu_mapped(const struct kvf_cache *c, int device)
{
        bool cuda = c->be == &kvf_cache_cuda ||
                    (c->be && c->be->id == KVF_BACKEND_ENGINE && !c->host && c->priv);
        return cuda && c->device == device;
}

static int cuda_copy_submit(const struct kvf_copy_batch *b, uint64_t *ticket)
{
        struct cuda_map *m = b->src->priv;
        int rc;

        if (!m->copier && (rc = kvf_gpu_copier_create(m->device, 0, NULL, &m->copier)) < 0)
                return gpu_err(rc, "create the GPU copier");
        uint32_t ndr = 0;
        for (uint32_t i = 0; i < b->ndst; i++)
                ndr += cache_regions(b->dst[i]);
        if (grow((void **)&m->runs, &m->cap_runs, b->nruns, sizeof(*m->runs)) < 0 ||
            grow((void **)&m->dst, &m->cap_dst, ndr ? ndr : 1, sizeof(*m->dst)) < 0 ||
            grow((void **)&m->dfirst, &m->cap_dfirst, b->ndst ? b->ndst : 1, sizeof(*m->dfirst)) < 0 ||
            grow((void **)&m->src, &m->cap_src, cache_regions(b->src), sizeof(*m->src)) < 0)
                return kvf_err_set(-ENOMEM, "out of memory for a copy batch of %u runs", b->nruns);
        ndr = 0;
        for (uint32_t i = 0; i < b->ndst; i++) {
                const struct kvf_cache *d = b->dst[i];
                if (!gpu_mapped(d, m->device))
                        return kvf_err_set(-EXDEV, "a GPU copy's destination %u is not mapped for GPU %d",
                                           i, m->device);
                m->dfirst[i] = ndr;
                put_regions(d, m->dst + ndr);
                ndr += cache_regions(d);
        }
        put_regions(b->src, m->src);
        uint32_t nruns = b->nruns;
        if (!b->src->parts && ndr == b->ndst) {
                gpu_runs(b->runs, b->nruns, m->runs);
        } else {
                struct side src = {b->src, 0};
                nruns = 0;
                for (uint32_t i = 0; i < b->nruns; i++) {
                        const struct kvf_copy_run *r = &b->runs[i];
                        struct side dst = {r->dst < b->ndst ? b->dst[r->dst] : NULL,
                                           r->dst < b->ndst ? m->dfirst[r->dst] : UINT32_MAX};
                        if (cut_run(r, &src, &dst, &m->runs, &m->cap_runs, &nruns) < 0)
                                return kvf_err_set(-ENOMEM, "out of memory for a copy batch of %u runs",
                                                   b->nruns);
                }
        }
        struct kvf_gpu_batch gb = {.src = m->src, .n_src = cache_regions(b->src), .dst = m->dst, .n_dst = ndr};
        uint64_t r0 = 0, r1 = 0;
        kvf_gpu_copier_counts(m->copier, NULL, &r0);
        rc = submit(m->copier, &gb, m->runs, nruns, ticket);
        kvf_gpu_copier_counts(m->copier, NULL, &r1);
        if (b->reused)
                *b->reused += r1 - r0;
        return rc;
}

static int cuda_copy_poll(struct kvf_cache *src, uint64_t ticket)
{
        struct cuda_map *m = src->priv;
        if (!m->copier)
                return kvf_err_set(-EINVAL, "GPU copy ticket %llu: no copy was ever submitted",
                                   (unsigned long long)ticket);
        int rc = kvf_gpu_copy_poll(m->copier, ticket);
        return rc < 0 ? gpu_err(-EIO, "GPU copy") : rc;
}

/* ---- staged io (cache_stage.c) ---- */

struct stage_eng {
        struct kvf_gpu_copier *copier;
        /* the cache's regions (one, or one per tensor), then the group's staging buffer */
        struct kvf_gpu_region *region;
        uint32_t n_cache;
        struct kvf_cache cache; /* a copy: parts live as long as the mapping, which outlives this */
        int device;
        /* The engine's caches: the mapping itself, whose regions are taken anew at every copy
         * (a registration may be replaced meanwhile, under the lock the caller holds). */
        const struct kvf_cache *live;
        struct kvf_gpu_run *runs; /* the runs cut where blocks are strided */
        uint32_t cap_runs;
};

static int stage_open(struct kvf_cache *c, void **eng)
{
        bool engine = c->be && c->be->id == KVF_BACKEND_ENGINE;
        uint32_t nreg = engine ? layout_parts(&c->layout) : cache_regions(c);
        int dev = c->device;
        if (engine && c->reg_hdr && (dev = kvf_gpu_device_by_uuid(c->reg_hdr->cuda_uuid)) < 0)
                return kvf_err_set(-ENODEV, "the engine's caches of '%s' are on a GPU this process "
                                   "does not see (CUDA_VISIBLE_DEVICES?)", c->reg_hdr->instance);
        struct stage_eng *e = calloc(1, sizeof(*e));
        if (e && !(e->region = calloc(nreg + 1, sizeof(*e->region)))) {
                free(e);
                e = NULL;
        }
        if (!e)
                return kvf_err_set(-ENOMEM, "out of memory for a stager");
        /* A batch is at most 4 MiB in 4 KiB chunks and its runs' ends. */
        struct kvf_gpu_copier_opts o = {.arena_chunks = 4 * ((KVF_STAGE_BYTES >> 12) + KVF_STAGE_RUNS)};
        int rc = kvf_gpu_copier_create(dev, 0, &o, &e->copier);
        if (rc < 0) {
                free(e->region);
                free(e);
                return gpu_err(rc, "create a staging copier");
        }
        e->device = dev;
        e->cache = *c;
        e->live = engine ? c : NULL;
        e->n_cache = cache_regions(c);
        put_regions(c, e->region);
        *eng = e;
        return 0;
}

static void stage_close(void *eng)
{
        struct stage_eng *e = eng;
        kvf_gpu_copier_destroy(e->copier); /* waits (bounded) for its copies */
        free(e->region);
        free(e->runs);
        free(e);
}

static int stage_buf_alloc(void *eng, uint64_t bytes, uint8_t **out)
{
        (void)eng;
        /* Pinned and mapped: the copy kernel reaches it at the same address (unified
         * addressing, every 64-bit platform CUDA 13 runs on). */
        int rc = kvf_gpu_host_alloc(bytes, (void **)out);
        return rc < 0 ? gpu_err(rc, "pinned staging buffer") : 0;
}

static void stage_buf_free(void *eng, uint8_t *p)
{
        (void)eng;
        kvf_gpu_host_free(p);
}

static int stage_copy(void *eng, bool to_cache, uint8_t *buf, const struct kvf_copy_run *r, unsigned n,
                      uint64_t *ticket)
{
        struct stage_eng *e = eng;
        struct kvf_gpu_run runs[KVF_STAGE_RUNS];
        if (n > KVF_STAGE_RUNS)
                return kvf_err_set(-EINVAL, "a staged group of %u runs", n);
        if (e->live) {
                e->cache = *e->live;
                if (!e->cache.parts || e->cache.host || e->cache.device != e->device)
                        return kvf_err_set(-EIO, "the engine's caches are not mapped here (not registered, "
                                           "or dropped with their engine)");
                e->n_cache = cache_regions(&e->cache);
                put_regions(&e->cache, e->region);
        }
        uint32_t nb = e->n_cache; /* the buffer's region */
        e->region[nb] = (struct kvf_gpu_region){.base = (uint64_t)(uintptr_t)buf, .bytes = KVF_STAGE_BYTES};
        if (e->cache.strides) {
                struct side cs = {&e->cache, 0}, bs = {NULL, nb};
                uint32_t k = 0;
                for (unsigned i = 0; i < n; i++)
                        if (cut_run(&r[i], to_cache ? &bs : &cs, to_cache ? &cs : &bs, &e->runs, &e->cap_runs,
                                    &k) < 0)
                                return kvf_err_set(-ENOMEM, "out of memory for a staged group of %u runs", n);
                struct kvf_gpu_batch gb = {.src = e->region, .n_src = nb + 1, .dst = e->region, .n_dst = nb + 1};
                return submit(e->copier, &gb, e->runs, k, ticket);
        }
        if (nb == 1) {
                gpu_runs(r, n, runs);
                struct kvf_gpu_batch gb = {.src = &e->region[to_cache ? 1 : 0], .n_src = 1,
                                           .dst = &e->region[to_cache ? 0 : 1], .n_dst = 1};
                return submit(e->copier, &gb, runs, n, ticket);
        }
        /* One table for both sides: the cache's tensors, then the buffer. */
        for (unsigned i = 0; i < n; i++) {
                runs[i].bytes = r[i].bytes;
                if (to_cache) {
                        runs[i].src_region = nb;
                        runs[i].src_off = r[i].src_off;
                        split_off(&e->cache, 0, r[i].dst_off, &runs[i].dst_region, &runs[i].dst_off);
                } else {
                        split_off(&e->cache, 0, r[i].src_off, &runs[i].src_region, &runs[i].src_off);
                        runs[i].dst_region = nb;
                        runs[i].dst_off = r[i].dst_off;
                }
        }
        struct kvf_gpu_batch gb = {.src = e->region, .n_src = nb + 1, .dst = e->region, .n_dst = nb + 1};
        return submit(e->copier, &gb, runs, n, ticket);
}

static int stage_poll(void *eng, uint64_t ticket)
{
        int rc = kvf_gpu_copy_poll(((struct stage_eng *)eng)->copier, ticket);
        return rc < 0 ? gpu_err(-EIO, "staging copy") : rc;
}

/* ---- GPUDirect RDMA (connector/rdma_mr.c) ---- */

/* The allocator's dma-buf of the cache; else one exported here (which the driver may refuse
 * for a mapping of another process's allocation). */
static int cuda_dmabuf(struct kvf_cache *c, int *fd, uint64_t *len)
{
        struct cuda_map *m = c->priv;
        char first[KVF_ERR_MAX];
        if (m->parts)
                return kvf_err_set(-ENOTSUP, "the cache is one allocation per tensor (%u of them, made for "
                                   "FastDeploy's workers) and GPUDirect RDMA registers one: use tcp",
                                   m->n_parts);
        if (kvf_cuda_dmabuf_fetch(&m->hdr, fd, len) == 0)
                return 0;
        snprintf(first, sizeof(first), "%s", kvf_err_msg());
        *len = (c->bytes + 4095) & ~4095ull; /* inside the allocation: cuda_create rounds to 2 MiB */
        int rc = kvf_gpu_dmabuf_export(m->owner, c->base, *len, fd);
        return rc < 0 ? kvf_err_set(rc, "%s; exported here: %s", first, kvf_gpu_err_msg()) : 0;
}

static int cuda_rdma_flush(struct kvf_cache *c)
{
        struct cuda_map *m = c->priv;
        return kvf_gpu_rdma_flush(m->owner) < 0 ? gpu_err(-EIO, "flush GPUDirect RDMA writes") : 0;
}

const struct kvf_stage_ops kvf_cache_cuda_stage_ops = {
        .open = stage_open,
        .close = stage_close,
        .buf_alloc = stage_buf_alloc,
        .buf_free = stage_buf_free,
        .copy = stage_copy,
        .poll = stage_poll,
};

const struct kvf_cache_backend kvf_cache_cuda = {
        .name = "cuda",
        .id = KVF_BACKEND_CUDA,
        .create = cuda_create,
        .destroy = cuda_destroy,
        .map = cuda_map,
        .unmap = cuda_unmap,
        .copy_submit = cuda_copy_submit,
        .copy_poll = cuda_copy_poll,
        .stage = &kvf_cache_cuda_stage_ops,
        .dmabuf = cuda_dmabuf,
        .rdma_flush = cuda_rdma_flush,
};

/* ---- the engine's caches in GPU memory (registration.h) ---- */

int kvf_cache_cuda_reg_hold(int device, const uint8_t *handles, uint32_t nr, void **opened,
                            char *why, size_t whylen)
{
        for (uint32_t i = 0; i < nr; i++) {
                int owner = -1;
                opened[i] = NULL;
                int rc = kvf_gpu_ipc_open(device, handles + (uint64_t)i * KVF_GPU_IPC_HANDLE_SIZE,
                                          &opened[i], &owner);
                if (rc == 0 && owner != device) {
                        kvf_gpu_ipc_close(device, opened[i]);
                        opened[i] = NULL;
                        snprintf(why, whylen, "region %u is on GPU %d here, not the instance's GPU %d: "
                                 "give tensors on the instance's GPU", i, owner, device);
                        rc = -EINVAL;
                } else if (rc < 0) {
                        snprintf(why, whylen, "region %u: its CUDA IPC handle cannot be opened (%s): "
                                 "give whole cudaMalloc allocations of a live process (PyTorch: "
                                 "expandable segments off)", i, kvf_gpu_err_msg());
                        rc = -EINVAL;
                }
                if (rc < 0) {
                        kvf_cache_cuda_reg_close(device, opened, i);
                        return rc;
                }
        }
        return 0;
}

void kvf_cache_cuda_reg_close(int device, void **opened, uint32_t nr)
{
        for (uint32_t i = 0; i < nr; i++)
                if (opened[i])
                        kvf_gpu_ipc_close(device, opened[i]);
}

/* The engine's dma-bufs of the registration (one per allocation, or NULL): kept, duplicated. */
static void keep_dmabufs(struct cuda_map *m, const int *dmabufs, const struct kvf_reg_wire_region *rg,
                         uint32_t nr)
{
        if (!dmabufs || !(m->dmabufs = malloc(nr * sizeof(int))) ||
            !(m->dmabuf_bytes = malloc(nr * sizeof(uint64_t)))) {
                free(m->dmabufs);
                m->dmabufs = NULL;
                return;
        }
        for (uint32_t i = 0; i < nr; i++) {
                m->dmabufs[i] = dmabufs[i] >= 0 ? fcntl(dmabufs[i], F_DUPFD_CLOEXEC, 3) : -1;
                m->dmabuf_bytes[i] = rg[i].bytes;
        }
}

int kvf_cache_cuda_dmabuf_at(const struct kvf_cache *c, uint64_t addr, uint64_t len, int *fd, uint64_t *off)
{
        const struct cuda_map *m = c->priv;
        if (!m || !m->dmabufs || c->be->id != KVF_BACKEND_ENGINE)
                return kvf_err_set(-ENOENT, "no dma-buf of the engine's allocations here (its engine exported "
                                   "none)");
        for (uint32_t i = 0; i < m->n_opens; i++) {
                uint64_t b = (uint64_t)(uintptr_t)m->opens[i];
                if (addr >= b && addr + len <= b + m->dmabuf_bytes[i] && m->dmabufs[i] >= 0) {
                        *fd = m->dmabufs[i];
                        *off = addr - b;
                        return 0;
                }
        }
        return kvf_err_set(-ENOENT, "no dma-buf of the engine's allocation at %#llx", (unsigned long long)addr);
}

int kvf_cache_cuda_dmabuf_export(int device, void *base, uint64_t bytes, int *fd)
{
        int rc = kvf_gpu_dmabuf_export(device, base, bytes, fd);
        return rc < 0 ? gpu_err(rc, "dma-buf export") : 0;
}

int kvf_cache_cuda_reg_map(const struct kvf_ctl_header *h, int near, const uint8_t *handles,
                           const struct kvf_reg_wire_region *rg, uint32_t nr,
                           const struct kvf_reg_placed *pl, uint32_t want, const int *dmabufs,
                           struct kvf_cache *out)
{
        const struct kvf_cache_layout *L = &h->layout;
        char u[48];
        int owner = kvf_gpu_device_by_uuid(h->cuda_uuid);
        kvf_reg_uuid_str(h->cuda_uuid, u, sizeof(u));
        if (owner < 0)
                return kvf_err_set(-ENOENT, "the engine's caches of '%s' are on %s, which this process "
                                   "does not see (CUDA_VISIBLE_DEVICES?)", h->instance, u);
        struct cuda_map *m = calloc(1, sizeof(*m));
        if (!m || !(m->opens = calloc(nr, sizeof(*m->opens))) ||
            !(out->parts = calloc(want, sizeof(*out->parts))) ||
            !(out->strides = calloc(want, sizeof(*out->strides)))) {
                if (m)
                        free(m->opens);
                free(m);
                free(out->parts);
                out->parts = NULL;
                return kvf_err_set(-ENOMEM, "out of memory");
        }
        m->device = near >= 0 ? near : owner;
        m->owner = owner;
        m->hdr = *h;
        int rc = 0;
        for (uint32_t i = 0; i < nr && rc == 0; i++) {
                rc = kvf_gpu_ipc_open(m->device, handles + (uint64_t)i * KVF_GPU_IPC_HANDLE_SIZE,
                                      &m->opens[i], NULL);
                if (rc == 0)
                        m->n_opens++;
                else
                        kvf_err_set(rc == -EXDEV ? -EXDEV : -ENOENT,
                                    "open region %u of %u of the engine's caches of '%s' (%llu bytes on "
                                    "%s, for GPU %d): %s", i, nr, h->instance,
                                    (unsigned long long)rg[i].bytes, u, m->device, kvf_gpu_err_msg());
        }
        if (rc < 0) {
                kvf_cache_cuda_reg_close(m->device, m->opens, m->n_opens);
                free(m->opens);
                free(m);
                free(out->parts);
                free(out->strides);
                out->parts = NULL;
                out->strides = NULL;
                return rc == -EXDEV ? -EXDEV : -ENOENT;
        }
        bool strided = false;
        for (uint32_t k = 0; k < want; k++) {
                out->parts[k] = (uint8_t *)m->opens[pl[k].region] + pl[k].off;
                out->strides[k] = pl[k].stride;
                strided |= pl[k].stride != L->block_bytes;
        }
        if (!strided) {
                free(out->strides);
                out->strides = NULL;
        }
        out->n_parts = want;
        out->base = out->parts[0];
        out->host = false;
        out->device = m->device;
        out->priv = m;
        keep_dmabufs(m, dmabufs, rg, nr);
        return 0;
}

void kvf_cache_cuda_reg_unmap(struct kvf_cache *c)
{
        struct cuda_map *m = c->priv;
        if (!m)
                return;
        kvf_gpu_copier_destroy(m->copier); /* waits (bounded) for the copies in flight */
        /* Copies of other threads (the connector's staging streams) may still read or write
         * the allocations: their callers hold the mapping's lock for writing now, so none
         * starts; wait for those queued before closing what they address. */
        if (kvf_gpu_device_sync(m->device) < 0)
                kvf_warn("the engine's caches: waiting for GPU %d before closing them: %s", m->device,
                         kvf_gpu_err_msg());
        kvf_cache_cuda_reg_close(m->device, m->opens, m->n_opens);
        for (uint32_t i = 0; m->dmabufs && i < m->n_opens; i++)
                if (m->dmabufs[i] >= 0)
                        close(m->dmabufs[i]);
        free(m->dmabufs);
        free(m->dmabuf_bytes);
        free(m->opens);
        free(m->runs);
        free(m->dst);
        free(m->src);
        free(m->dfirst);
        free(m);
        c->priv = NULL;
        c->base = NULL;
}
