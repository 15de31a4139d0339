/*
 * kvf_register_caches: the engine's own caches handed to an instance started
 * with `--caches engine` (common/registration.h says what goes where). The
 * allocator checks them and holds the registration; this file only packs it.
 */
#include <dirent.h>
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "abi.h"
#include "cache.h"
#include "client.h"
#include "layout.h"
#include "err.h"
#include "fdpass.h"
#include "registration.h"

static int ask(struct kvf_client *c, const void *msg, size_t len, const int *fds, unsigned nfds,
               struct kvf_reg_msg *a)
{
        const struct kvf_ctl_header *h = c->ctl.hdr;
        char name[160];
        int rc = kvf_reg_sock_name(h, name, sizeof(name));
        if (rc < 0)
                return rc;
        /* The allocator maps every region before it answers: allow for large ones. */
        int s = kvf_fdpass_connect(name, 30000);
        if (s < 0)
                return kvf_err_ctx(s, "the allocator of '%s' does not answer", h->instance);
        unsigned got = 0;
        int tmp[1];
        ssize_t n;
        if ((rc = kvf_fdpass_send(s, msg, len, fds, nfds)) == 0 &&
            (n = kvf_fdpass_recv(s, a, sizeof(*a), tmp, 0, &got)) != (ssize_t)sizeof(*a))
                rc = n < 0 ? (int)n
                           : kvf_err_set(-EPROTO, "the allocator of '%s' gave no answer",
                                         h->instance);
        close(s);
        a->why[sizeof(a->why) - 1] = 0;
        return rc;
}

/*
 * GPU memory: the allocations behind the views (each found from its first byte; tensors of
 * PyTorch's caching allocator are sub-ranges of a cudaMalloc'd segment), each once, with its
 * IPC handle; or the regions given, each the start of an allocation. Fills rg (addr, bytes)
 * and handles; *nr the count.
 */
static int gpu_regions(const struct kvf_registration *r,
                       struct kvf_reg_wire_region *rg, uint8_t *handles, uint32_t *nr, uint8_t uuid[16])
{
#ifdef KVF_HAVE_CUDA
        uint32_t n = 0;
        uint32_t count = r->n_regions ? r->n_regions : r->n_views;
        for (uint32_t i = 0; i < count; i++) {
                void *p = r->n_regions ? r->regions[i].addr : r->views[i].addr;
                uint64_t base, bytes;
                int dev, vmm, rc;
                if ((rc = kvf_cache_cuda_mem_range(p, &base, &bytes, &dev, &vmm)) < 0)
                        return kvf_err_ctx(rc, "register caches: %s %u at %p is not GPU memory of this "
                                           "process", r->n_regions ? "region" : "view", i, p);
                if (vmm)
                        return kvf_err_set(-ENOTSUP,
                                           "register caches: %s %u at %p is in memory mapped with "
                                           "cuMemCreate/cuMemMap (PyTorch's expandable segments), "
                                           "which no CUDA IPC handle can name: set "
                                           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False before "
                                           "the caches are allocated, or let kvferry allocate them "
                                           "(up --backend cuda without --caches engine)",
                                           r->n_regions ? "region" : "view", i, p);
                if (dev != r->device)
                        return kvf_err_set(-EINVAL,
                                           "register caches: %s %u is on GPU %d, the registration "
                                           "says GPU %d: every tensor on one GPU",
                                           r->n_regions ? "region" : "view", i, dev, r->device);
                if (r->n_regions && base != (uint64_t)(uintptr_t)p)
                        return kvf_err_set(-EINVAL,
                                           "register caches: region %u at %p is not the start of its "
                                           "allocation (0x%llx): give whole allocations, or no "
                                           "regions (the library finds them)",
                                           i, p, (unsigned long long)base);
                uint32_t k = 0;
                while (k < n && rg[k].addr != base)
                        k++;
                if (k < n)
                        continue; /* another tensor of an allocation already found */
                if (n == KVF_FDPASS_MAX)
                        return kvf_err_set(-E2BIG, "register caches: more than %u allocations",
                                           KVF_FDPASS_MAX);
                rg[n] = (struct kvf_reg_wire_region){.addr = base, .bytes = bytes};
                if ((rc = kvf_cache_cuda_ipc_export((void *)(uintptr_t)base,
                                                    handles + (uint64_t)n * KVF_REG_HANDLE_SIZE)) < 0)
                        return kvf_err_ctx(rc, "register caches: the IPC handle of allocation 0x%llx (%llu "
                                           "bytes)", (unsigned long long)base, (unsigned long long)bytes);
                n++;
        }
        *nr = n;
        int rc = kvf_cache_cuda_uuid(r->device, uuid);
        return rc < 0 ? kvf_err_ctx(rc, "register caches") : 0;
#else
        (void)rg, (void)handles, (void)nr, (void)uuid;
        return kvf_err_set(-ENOTSUP, "register caches: GPU memory (device %d): this build has no CUDA",
                           r->device);
#endif
}

/* stream_mu held: forget the views kept for the engine executor. */
static void drop_views_locked(struct kvf_client *c)
{
        free(c->reg_own.parts);
        free(c->reg_own.strides);
        memset(&c->reg_own, 0, sizeof(c->reg_own));
}

/* GPU memory: keep the views as this process addresses them (the allocator checked that each
 * (layer, tensor) is there once), for the engine executor's copies (stream.c). */
static void keep_views(struct kvf_client *c, const struct kvf_registration *r)
{
        const struct kvf_cache_layout *L = &c->ctl.hdr->layout;
        const uint32_t nt = kvf_layout_tensors(L), n = kvf_layout_layers(L) * nt;
        uint8_t **parts = calloc(n, sizeof(*parts));
        uint64_t *strides = calloc(n, sizeof(*strides));
        pthread_mutex_lock(&c->stream_mu);
        drop_views_locked(c);
        if (parts && strides) {
                for (uint32_t i = 0; i < r->n_views; i++) {
                        uint64_t k = (uint64_t)r->views[i].layer * nt + r->views[i].tensor;
                        if (k < n) {
                                parts[k] = r->views[i].addr;
                                strides[k] = r->views[i].block_stride;
                        }
                }
                c->reg_own = (struct kvf_cache){.layout = *L, .base = parts[0], .host = false, .device = r->device,
                                                .parts = parts, .strides = strides, .n_parts = n};
                parts = NULL;
                strides = NULL;
        }
        pthread_mutex_unlock(&c->stream_mu);
        free(parts);
        free(strides);
}

#ifdef KVF_HAVE_CUDA
/* Export dma-bufs at registration? KVFERRY_DMABUF=always or never; by default (auto) where
 * this host has an RDMA device, the only users of them. */
static bool want_dmabufs(void)
{
        const char *e = getenv("KVFERRY_DMABUF");
        if (e && !strcmp(e, "always"))
                return true;
        if (e && !strcmp(e, "never"))
                return false;
        DIR *d = opendir("/sys/class/infiniband");
        bool any = false;
        for (struct dirent *de; d && !any && (de = readdir(d));)
                any = de->d_name[0] != '.';
        if (d)
                closedir(d);
        return any;
}
#endif

/* GPU memory: each allocation's dma-buf, which only this process can export (the driver
 * refuses for IPC-opened memory), for the instance's NICs (GPUDirect RDMA). All of them, or
 * none (where the driver or the kernel has no dma-buf: NICs then use peer memory). */
static unsigned gpu_dmabufs(int device, const struct kvf_reg_wire_region *rg, uint32_t nr, int *fds)
{
#ifdef KVF_HAVE_CUDA
        if (!want_dmabufs())
                return 0;
        for (uint32_t i = 0; i < nr; i++)
                if (kvf_cache_cuda_dmabuf_export(device, (void *)(uintptr_t)rg[i].addr, rg[i].bytes, &fds[i]) < 0) {
                        while (i--)
                                close(fds[i]);
                        return 0;
                }
        return nr;
#else
        (void)device, (void)rg, (void)nr, (void)fds;
        return 0;
#endif
}

int kvf_register_caches_sized(struct kvf_client *c, const struct kvf_registration *r, size_t r_size)
{
        int rc =
            kvf_abi_size_check(r_size, sizeof(struct kvf_registration), "struct kvf_registration");
        if (rc < 0 || (rc = kvf_client_owned(c)) < 0)
                return rc;
        const struct kvf_ctl_header *h = c->ctl.hdr;
        if (h->backend != KVF_BACKEND_ENGINE)
                return kvf_err_set(
                    -ENOTSUP,
                    "register caches: instance '%s' keeps caches of its own (start it with "
                    "--caches engine to give it the engine's)",
                    h->instance);
        char why[KVF_REASON_MAX];
        /* (the GPU's identity is checked by the allocator: here only the kind of memory) */
        if ((rc = kvf_reg_check_device(h, r->device, h->cuda_uuid, why, sizeof(why))) < 0)
                return kvf_err_set(-ENOTSUP, "register caches: %s", why);
        bool gpu = r->device >= 0;
        if ((!gpu || r->n_regions) &&
            (r->n_regions == 0 || r->n_regions > KVF_FDPASS_MAX || !r->regions))
                return kvf_err_set(-EINVAL, "register caches: %u regions: give 1 to %u",
                                   r->n_regions, KVF_FDPASS_MAX);
        if (r->n_views == 0 || r->n_views > KVF_REG_MAX_VIEWS || !r->views)
                return kvf_err_set(
                    -EINVAL, "register caches: %u views: give one per (layer, tensor), at most %u",
                    r->n_views, KVF_REG_MAX_VIEWS);
        int fds[KVF_FDPASS_MAX];
        for (uint32_t i = 0; i < r->n_regions && !gpu; i++) {
                if (r->regions[i].fd < 0)
                        return kvf_err_set(
                            -EINVAL,
                            "register caches: region %u has no descriptor: foreign memory; "
                            "host memory is shared as a file (a memfd or a /dev/shm file; Python: "
                            "kvferry.host_buffer)",
                            i);
                fds[i] = r->regions[i].fd;
        }
        struct kvf_reg_wire_region grg[KVF_FDPASS_MAX];
        uint8_t *handles = NULL;
        uint32_t nr = r->n_regions;
        struct kvf_reg_msg q = {.op = KVF_REG_REGISTER,
                                .n_views = r->n_views,
                                .token_major = r->token_major ? 1 : 0,
                                .device = gpu ? r->device : -1};
        unsigned nfds = gpu ? 0 : nr;
        if (gpu) {
                if (!(handles = malloc((size_t)KVF_FDPASS_MAX * KVF_REG_HANDLE_SIZE)))
                        return kvf_err_set(-ENOMEM, "out of memory");
                if ((rc = gpu_regions(r, grg, handles, &nr, q.uuid)) < 0) {
                        free(handles);
                        return rc;
                }
                nfds = gpu_dmabufs(r->device, grg, nr, fds);
        }
        q.n_regions = nr;
        size_t len = sizeof(struct kvf_reg_msg) + nr * sizeof(struct kvf_reg_wire_region) +
                     r->n_views * sizeof(struct kvf_reg_wire_view) +
                     (gpu ? (size_t)nr * KVF_REG_HANDLE_SIZE : 0);
        uint8_t *buf = calloc(1, len);
        if (!buf) {
                free(handles);
                return kvf_err_set(-ENOMEM, "out of memory");
        }
        memcpy(buf, &q, sizeof(q));
        struct kvf_reg_wire_region *rg = (void *)(buf + sizeof(q));
        struct kvf_reg_wire_view *v = (void *)(rg + nr);
        for (uint32_t i = 0; i < nr; i++)
                rg[i] = gpu ? grg[i]
                            : (struct kvf_reg_wire_region){
                                  .addr = (uint64_t)(uintptr_t)r->regions[i].addr,
                                  .bytes = r->regions[i].bytes,
                                  .fd_offset = r->regions[i].fd_offset};
        if (gpu) {
                memcpy(v + r->n_views, handles, (size_t)nr * KVF_REG_HANDLE_SIZE);
                free(handles);
        }
        for (uint32_t i = 0; i < r->n_views; i++)
                v[i] = (struct kvf_reg_wire_view){.layer = r->views[i].layer,
                                                  .tensor = r->views[i].tensor,
                                                  .addr = (uint64_t)(uintptr_t)r->views[i].addr,
                                                  .stride = r->views[i].block_stride};
        struct kvf_reg_msg a = {0};
        rc = ask(c, buf, len, fds, nfds, &a);
        free(buf);
        for (unsigned i = 0; gpu && i < nfds; i++)
                close(fds[i]); /* (the allocator has its own) */
        if (rc < 0)
                return kvf_err_ctx(rc, "register caches with '%s'", h->instance);
        if (a.err < 0)
                return kvf_err_set(a.err, "register caches with '%s': %s", h->instance, a.why);
        c->registered = true;
        if (gpu)
                keep_views(c, r);
        return 0;
}

int kvf_unregister_caches(struct kvf_client *c)
{
        int rc = kvf_client_owned(c);
        if (rc < 0)
                return rc;
        struct kvf_reg_msg q = {.op = KVF_REG_UNREGISTER}, a = {0};
        if ((rc = ask(c, &q, sizeof(q), NULL, 0, &a)) < 0)
                return kvf_err_ctx(rc, "unregister caches");
        if (a.err < 0)
                return kvf_err_set(a.err, "unregister caches: %s", a.why);
        c->registered = false;
        pthread_mutex_lock(&c->stream_mu);
        drop_views_locked(c);
        pthread_mutex_unlock(&c->stream_mu);
        return 0;
}
