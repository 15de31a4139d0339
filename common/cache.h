/*
 * Cache backends: what every role does with an instance's KV cache, in
 * whatever memory it lives.
 *
 *   allocator  creates the cache, keeps it alive        kvf_cache_create
 *   everyone   maps its own, or a same-host peer's       kvf_cache_map / kvf_cache_unmap
 *   engine     addresses a layer's tensor                kvf_cache_addr
 *   sender     copies runs of blocks into a peer's cache kvf_cache_copy_submit / _poll:
 *              a batch may complete later (a GPU kernel returns before its copy lands)
 *   connector  sends from / receives into blocks         kvf_stage_* (cache_stage.c):
 *              host memory gives the cache itself; a device backend gives pinned staging
 *              buffers that its copies fill or empty, later (a ring per connection thread)
 *
 * One backend per instance, named in the control segment's header
 * (`backend`). Backends: host (a shared-memory file), host-async (a test
 * backend), cuda (GPU memory: cache_cuda.c, built where nvcc is). Backends are listed once, in cache.c; a new one is a new file
 * plus one line there. Offsets are byte offsets in the layout's order
 * (kvf_layout_offset).
 *
 * Threads: a mapped cache may be used from several threads for io; copies of
 * one source cache are submitted and polled from one thread (the sender's).
 */
#ifndef KVF_CACHE_H
#define KVF_CACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "layout.h"
#include "shm_layout.h"

struct kvf_cache_backend;
struct kvf_stage_ops;

/* A mapping of one instance's cache in this process. */
struct kvf_cache {
        const struct kvf_cache_backend *be;
        struct kvf_cache_layout layout;
        uint8_t *base;    /* the address this process uses: host memory, or a device pointer */
        uint64_t bytes;
        bool writable;
        bool lazy;        /* set for a same-host peer's cache (kvf_cache_map_peer): mapped without
                           * faulting all of it in first, which for a large host cache takes
                           * seconds on the path of the first task to that peer; the host
                           * backends fault it in from a thread of their own meanwhile */
        bool host;        /* base is host memory the CPU may touch */
        int device;       /* GPU backends: the CUDA device (as this process numbers them) whose
                           * kernels use this mapping; -1 for host memory */
        void *priv;       /* the backend's */
        /* cuda, one allocation per tensor (an instance made for FastDeploy's workers, which
         * attach each tensor by its own IPC handle): the n_parts tensors' addresses in
         * kvf_layout_offset order (kvf_layout_part: which holds an offset, kvf_layout_part_bytes:
         * its size), base being the first; NULL when the cache is one allocation. A run never
         * crosses a tensor, so it stays in one part. */
        uint8_t **parts;
        uint32_t n_parts;
        /* The engine's caches (cache_engine.c): parts are the (layer, tensor) views of the
         * registration, and strides[i] the bytes between part i's blocks (NULL: every part's
         * blocks are back to back). A block is contiguous; blocks of a part need not be, so a
         * run over more than one block is split (kvf_cache_contig). reg_gen: the
         * registration mapped (odd), or the generation seen while waiting for one (even). */
        uint64_t *strides;
        uint64_t reg_gen;
        const struct kvf_ctl_header *reg_hdr; /* the segment whose registration this maps */
};

/* One run of contiguous bytes from the source cache to one of the batch's destinations. */
struct kvf_copy_run {
        uint32_t dst; /* index into kvf_copy_batch.dst */
        uint32_t pad;
        uint64_t src_off, dst_off, bytes;
};

struct kvf_copy_batch {
        struct kvf_cache *src;
        struct kvf_cache *const *dst;
        uint32_t ndst;
        const struct kvf_copy_run *runs;
        uint32_t nruns;
        /* NULL, or where a GPU backend adds the kernel launches of this batch that ran the
         * descriptors already on the device (the batch before, moved by a layer) */
        uint64_t *reused;
};

/* What the allocator asks of a new cache. */
struct kvf_cache_opts {
        int huge_pages;     /* host backends: enum kvf_huge_mode (cache_host_alloc.h) */
        uint8_t **keep_map; /* where to leave a read-only mapping the allocator keeps, or NULL */
};

struct kvf_cache_backend {
        const char *name;
        uint32_t id; /* enum kvf_backend */
        /* Allocator: make the storage for header h (not yet published), say in h how it is
         * backed, and keep it; a backend whose storage is named by handles writes them into
         * the segment (the header's cuda_* fields) there too. */
        int (*create)(struct kvf_ctl_header *h, const struct kvf_cache_opts *o);
        /* Remove what create made (the instance goes down). */
        void (*destroy)(const struct kvf_ctl_header *h);
        /* out->device on entry: the device whose kernels will use the mapping (a peer's
         * cache mapped for copies from ours), or -1: the device that holds it. */
        int (*map)(const struct kvf_ctl_header *h, bool writable, struct kvf_cache *out);
        void (*unmap)(struct kvf_cache *c);
        /* Copy a batch; *ticket identifies it for poll. The batches of one source cache
         * complete in the order they were submitted. */
        int (*copy_submit)(const struct kvf_copy_batch *b, uint64_t *ticket);
        /* 1 done, 0 in flight, -EIO failed (kvf_err says why; the batch's bytes are undefined). */
        int (*copy_poll)(struct kvf_cache *src, uint64_t ticket);
        /* Staged io (cache_stage.c), NULL when the cache is host memory used in place. */
        const struct kvf_stage_ops *stage;
        /*
         * GPUDirect RDMA, NULL for host memory (registered as it is): a dma-buf fd for the
         * whole mapping, *len its bytes (the cache's, up to a page); -ENOTSUP, with the
         * reason, where the driver has none. And the flush that makes what a NIC wrote
         * visible to the GPU work queued after it (before an arrival is published).
         */
        int (*dmabuf)(struct kvf_cache *c, int *fd, uint64_t *len);
        int (*rdma_flush)(struct kvf_cache *c);
};

/* ---- staged io: a connection thread's bytes between the cache and the network ---- */

/* One run of the cache's bytes and the host memory that holds them for the network. */
struct kvf_io_run {
        uint64_t off, len; /* in the cache */
        uint8_t *p;        /* set by kvf_stage_out / kvf_stage_in_begin */
};

/* A group's bytes at most (a tcp frame's payload, a send batch), and its runs at most. */
#define KVF_STAGE_BYTES (4u << 20)
#define KVF_STAGE_RUNS 128u

/*
 * What a backend whose memory the CPU does not reach offers (cache_cuda.c,
 * and cache_host_async.c to run the same path without a GPU): a copy engine
 * of the calling thread's own (a GPU stream), buffers it copies to and from,
 * and copies of a group of runs that complete later, in submission order.
 */
struct kvf_stage_ops {
        int (*open)(struct kvf_cache *c, void **eng);
        void (*close)(void *eng); /* waits (bounded) for the copies in flight */
        int (*buf_alloc)(void *eng, uint64_t bytes, uint8_t **out);
        void (*buf_free)(void *eng, uint8_t *p);
        /* Queue the copy of runs between the cache and staging buffer `buf` (one of
         * buf_alloc's, KVF_STAGE_BYTES): into the cache (to_cache: src_off in buf,
         * dst_off in the cache) or out of it; dst is 0. *ticket names the copy (from 1,
         * in order). */
        int (*copy)(void *eng, bool to_cache, uint8_t *buf, const struct kvf_copy_run *runs, unsigned n,
                    uint64_t *ticket);
        /* 1 landed, 0 not yet, -EIO failed (kvf_err says why). Never blocks. */
        int (*poll)(void *eng, uint64_t ticket);
};

/*
 * A connection thread's staging: a ring of KVF_STAGE_SLOTS buffers of
 * KVF_STAGE_BYTES; groups of runs are placed one after another in a slot,
 * and a slot is filled again once every group in it is done and its copies
 * landed. NULL for a cache used in place (the host backend): then every call
 * below gives the cache's own memory and ticket 0, which has always landed.
 */
struct kvf_stager;
#define KVF_STAGE_SLOTS 3u

/* *out = NULL when the cache needs no staging. 0, or -errno with kvf_err set. */
int kvf_stager_open(struct kvf_cache *c, struct kvf_stager **out);
void kvf_stager_close(struct kvf_stager *s);
/*
 * Send: host memory for a group of runs (at most KVF_STAGE_RUNS runs and
 * KVF_STAGE_BYTES): sets runs[i].p, and queues the copies out of the cache;
 * the bytes are there once *ticket landed (kvf_stage_wait). *group names the
 * memory for kvf_stage_done.
 */
int kvf_stage_out(struct kvf_cache *c, struct kvf_stager *s, struct kvf_io_run *runs, unsigned n,
                  uint64_t *ticket, unsigned *group);
/* Receive: host memory to receive a group of runs into (sets runs[i].p). */
int kvf_stage_in_begin(struct kvf_cache *c, struct kvf_stager *s, struct kvf_io_run *runs, unsigned n,
                       unsigned *group);
/* Receive: the group's bytes are in its host memory: queue their copies into the cache
 * (in place: nothing to do); they are in the cache once *ticket landed. Ends the group. */
int kvf_stage_in_end(struct kvf_stager *s, const struct kvf_io_run *runs, unsigned n, unsigned group,
                     uint64_t *ticket);
/* The group's host memory is no longer needed (a send completed, or was given up). */
void kvf_stage_done(struct kvf_stager *s, unsigned group);
/* 1 the copy named by ticket landed, 0 not yet (only when !block), -EIO failed (kvf_err). */
int kvf_stage_wait(struct kvf_stager *s, uint64_t ticket, bool block);

/* The backend of this id, or NULL (kvf_err says which exist). */
const struct kvf_cache_backend *kvf_cache_backend(uint32_t id);
/* The backend of this name ("host", ...), or NULL. */
const struct kvf_cache_backend *kvf_cache_backend_named(const char *name);
/* Names of the backends built in, for messages: "host, host-async". */
const char *kvf_cache_backend_names(void);

/*
 * GPUs visible to this process: > 0, or 0 when there is none or this build
 * has no CUDA (kvf_err then says which). For `--backend auto`.
 */
int kvf_cache_gpus(void);

/* Allocator: create the cache of header h with its backend. */
int kvf_cache_create(struct kvf_ctl_header *h, const struct kvf_cache_opts *o);
void kvf_cache_destroy(const struct kvf_ctl_header *h);

/*
 * Map the cache of the instance whose header is h (read-only or
 * read-write), after checking it against the layout. 0, or -ENOENT (cannot
 * open), -EPROTO (wrong size or unknown backend), -ENOMEM, with kvf_err set.
 */
int kvf_cache_map(const struct kvf_ctl_header *h, bool writable, struct kvf_cache *out);
/*
 * Map a same-host peer's cache for copies from `near` (a cache of ours): a GPU
 * backend opens it for `near`'s device, with peer access when it lives on
 * another GPU (-EXDEV when the two GPUs cannot reach each other).
 */
int kvf_cache_map_peer(const struct kvf_ctl_header *h, bool writable, const struct kvf_cache *near,
                       struct kvf_cache *out);
void kvf_cache_unmap(struct kvf_cache *c);

/* The address of byte `off` of the cache, as this process uses it (host or device). */
static inline void *kvf_cache_addr(const struct kvf_cache *c, uint64_t off)
{
        if (c->parts) {
                uint64_t r;
                uint32_t i = kvf_layout_part(&c->layout, off, &r);
                if (i >= c->n_parts)
                        return (void *)0;
                if (c->strides) {
                        uint64_t bb = kvf_layout_part_block_bytes(&c->layout, i);
                        return c->parts[i] + r / bb * c->strides[i] + r % bb;
                }
                return c->parts[i] + r;
        }
        return c->base && off < c->bytes ? c->base + off : (void *)0;
}

/* Bytes contiguous in memory from byte `off` of the cache on (to the end of its block when
 * the blocks are strided, of its tensor when in parts); 0 when off is outside the cache. */
static inline uint64_t kvf_cache_contig(const struct kvf_cache *c, uint64_t off)
{
        if (c->parts) {
                uint64_t r;
                uint32_t i = kvf_layout_part(&c->layout, off, &r);
                if (i >= c->n_parts)
                        return 0;
                uint64_t bb = kvf_layout_part_block_bytes(&c->layout, i);
                if (c->strides && c->strides[i] != bb)
                        return bb - r % bb;
                return kvf_layout_part_bytes(&c->layout, i) - r;
        }
        return c->base && off < c->bytes ? c->bytes - off : 0;
}

/*
 * The engine's caches: map the registration the header names now when c maps an older one
 * (or none), under the lock the connection threads' staged copies hold (cache_engine.c), so
 * no copy runs on a mapping being replaced. 1 remapped, 0 nothing to do, -errno (kvf_err).
 * Any other backend: 0.
 */
int kvf_cache_refresh(struct kvf_cache *c);
/*
 * Keep c's mapping as it is between these two (the engine's caches: no refresh replaces it
 * meanwhile; the lock of the staged copies, held for reading). Any other backend: nothing.
 */
void kvf_cache_hold(struct kvf_cache *c);
void kvf_cache_release(struct kvf_cache *c);

/* Host memory on both sides: copy a batch's runs with the CPU, each run split where either
 * cache's memory is not contiguous. 0, or -EIO (a cache not mapped there: kvf_err says). */
int kvf_cache_copy_host(const struct kvf_copy_batch *b);
/* Whether same-host copies between caches of these two backends can run (host memory both,
 * or the same backend). */
bool kvf_cache_backends_compatible(uint32_t a, uint32_t b);

static inline int kvf_cache_copy_submit(const struct kvf_copy_batch *b, uint64_t *ticket)
{
        return b->src->be->copy_submit(b, ticket);
}

static inline int kvf_cache_copy_poll(struct kvf_cache *src, uint64_t ticket)
{
        return src->be->copy_poll(src, ticket);
}

/* The backends (cache_*.c). */
extern const struct kvf_cache_backend kvf_cache_host;
extern const struct kvf_cache_backend kvf_cache_host_async;
extern const struct kvf_cache_backend kvf_cache_engine;
#ifdef KVF_HAVE_CUDA
extern const struct kvf_cache_backend kvf_cache_cuda;
/* cache_cuda.c: GPUs visible (kvf_cache_gpus); the device this process numbers `uuid`, or < 0. */
int kvf_cache_cuda_gpus(void);
int kvf_cache_cuda_device_of(const uint8_t uuid[16]);
/* The UUID of this process's device `device`: 0, or -errno (kvf_err). */
int kvf_cache_cuda_uuid(int device, uint8_t uuid[16]);
/* The allocation holding device pointer p (kvf_gpu_mem_range): 0, or -errno (kvf_err). */
int kvf_cache_cuda_mem_range(const void *p, uint64_t *base, uint64_t *bytes, int *device, int *vmm);
/* The CUDA IPC handle of the allocation starting at base: 0, or -errno (kvf_err). */
int kvf_cache_cuda_ipc_export(void *base, uint8_t handle[64]);
/* cache_cuda_dmabuf.c: the allocator offers its allocation's dma-buf (never fails: a refusal
 * carries the reason); another process of the same user fetches a descriptor of it. */
void kvf_cuda_dmabuf_offer(const struct kvf_ctl_header *h, int device, void *ptr, uint64_t bytes);
int kvf_cuda_dmabuf_fetch(const struct kvf_ctl_header *h, int *fd, uint64_t *len);
/*
 * The engine's caches in GPU memory (registration.h): open each of the nr
 * allocations' IPC handles once, for kernels on device `near` (-1: the GPU of
 * the instance, header cuda_uuid), and place the want views (parts, strides)
 * at opened base + offset. out then copies and stages like a cuda cache in
 * parts (the engine backend hands its batches to the cuda backend's). 0, or
 * -errno (kvf_err) with nothing left open.
 */
struct kvf_reg_wire_region;
struct kvf_reg_placed;
int kvf_cache_cuda_reg_map(const struct kvf_ctl_header *h, int near, const uint8_t *handles,
                           const struct kvf_reg_wire_region *rg, uint32_t nr,
                           const struct kvf_reg_placed *pl, uint32_t want, const int *dmabufs,
                           struct kvf_cache *out);
/* dmabufs (NULL: none): the dma-buf of each allocation, as its engine exported it (the driver
 * exports only from the allocating process); the mapping keeps duplicates, for NICs. The one
 * holding [addr, addr + len) of mapping c: its descriptor (the mapping's) and addr's offset in
 * it; -ENOENT (kvf_err) when there is none. */
int kvf_cache_cuda_dmabuf_at(const struct kvf_cache *c, uint64_t addr, uint64_t len, int *fd, uint64_t *off);
/* The engine, at registration: a dma-buf of its allocation at base (kvf_gpu_dmabuf_export). */
int kvf_cache_cuda_dmabuf_export(int device, void *base, uint64_t bytes, int *fd);
/* Close what kvf_cache_cuda_reg_map opened, after every copy of this process on that GPU
 * (the connector's staging copies run on streams of their own) has finished. */
void kvf_cache_cuda_reg_unmap(struct kvf_cache *c);
/* The allocator: open a registration's handles (proving they name live allocations of that
 * GPU) and keep them open until kvf_cache_cuda_reg_close: 0, or -errno with `why`. */
int kvf_cache_cuda_reg_hold(int device, const uint8_t *handles, uint32_t nr, void **opened,
                            char *why, size_t whylen);
void kvf_cache_cuda_reg_close(int device, void **opened, uint32_t nr);
/* The GPU copier's regions of cache c (its one allocation, or one per tensor) into r (NULL:
 * only count them): how many. */
struct kvf_gpu_region;
struct kvf_gpu_run;
uint32_t kvf_cache_cuda_regions(const struct kvf_cache *c, struct kvf_gpu_region *r);
/* The copier's runs of `bytes` from byte src_off of cache src (its regions numbered from
 * src_first) to dst_off of dst (from dst_first), cut wherever either side is not contiguous,
 * appended at (*out)[*n] (grown: *cap). 0, or -ENOMEM. */
int kvf_cache_cuda_cut(const struct kvf_cache *src, uint32_t src_first, uint64_t src_off,
                       const struct kvf_cache *dst, uint32_t dst_first, uint64_t dst_off, uint64_t bytes,
                       struct kvf_gpu_run **out, uint32_t *cap, uint32_t *n);
/* The connector's staging for the engine's GPU caches: the cuda backend's staging ops, which
 * take the regions of the mapping anew when it was replaced since the last copy. */
extern const struct kvf_stage_ops kvf_cache_cuda_stage_ops;
#endif

#endif
