/*
 * Cache backends: what every role does with an instance's KV cache, in
 * whatever memory it lives.
 *
 *   allocator  creates the cache, keeps it alive        kvf_cache_create
 *   everyone   maps its own, or a same-host peer's       kvf_cache_map / kvf_cache_unmap
 *   engine     addresses a layer's tensor                kvf_cache_addr
 *   sender     copies runs of blocks into a peer's cache kvf_cache_copy_submit / _poll:
 *              a batch may complete later (a GPU kernel returns before its copy lands)
 *   connector  sends from / receives into blocks         kvf_cache_io_begin / _end:
 *              host memory gives the cache itself; a device backend gives a staging buffer
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

#include "shm_layout.h"

struct kvf_cache_backend;

/* A mapping of one instance's cache in this process. */
struct kvf_cache {
        const struct kvf_cache_backend *be;
        struct kvf_cache_layout layout;
        uint8_t *base;    /* the address this process uses: host memory, or a device pointer */
        uint64_t bytes;
        bool writable;
        bool host;        /* base is host memory the CPU may touch */
        int device;       /* GPU backends: the CUDA device (as this process numbers them) whose
                           * kernels use this mapping; -1 for host memory */
        void *priv;       /* the backend's */
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
        /*
         * Host memory for bytes [off, off + len) of the cache: to send from
         * (after io_begin) or to receive into (until io_end). NULL hooks: the
         * cache is host memory and base + off is it.
         */
        int (*io_begin)(struct kvf_cache *c, uint64_t off, uint64_t len, bool recv, uint8_t **p);
        int (*io_end)(struct kvf_cache *c, uint64_t off, uint64_t len, bool recv, uint8_t *p);
};

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
        return c->base ? c->base + off : (void *)0;
}

static inline int kvf_cache_copy_submit(const struct kvf_copy_batch *b, uint64_t *ticket)
{
        return b->src->be->copy_submit(b, ticket);
}

static inline int kvf_cache_copy_poll(struct kvf_cache *src, uint64_t ticket)
{
        return src->be->copy_poll(src, ticket);
}

static inline int kvf_cache_io_begin(struct kvf_cache *c, uint64_t off, uint64_t len, bool recv,
                                     uint8_t **p)
{
        if (!c->be->io_begin) {
                *p = c->base + off;
                return 0;
        }
        return c->be->io_begin(c, off, len, recv, p);
}

static inline int kvf_cache_io_end(struct kvf_cache *c, uint64_t off, uint64_t len, bool recv,
                                   uint8_t *p)
{
        return c->be->io_end ? c->be->io_end(c, off, len, recv, p) : 0;
}

/* The backends (cache_*.c). */
extern const struct kvf_cache_backend kvf_cache_host;
extern const struct kvf_cache_backend kvf_cache_host_async;
#ifdef KVF_HAVE_CUDA
extern const struct kvf_cache_backend kvf_cache_cuda;
/* cache_cuda.c: GPUs visible (kvf_cache_gpus); the device this process numbers `uuid`, or < 0. */
int kvf_cache_cuda_gpus(void);
int kvf_cache_cuda_device_of(const uint8_t uuid[16]);
#endif

#endif
