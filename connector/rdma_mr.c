/*
 * Registering a cache with an RDMA device (see rdma.h rdma_reg_cache).
 *
 * Host memory is registered as it is. GPU memory (the cuda backend) is
 * registered through a dma-buf the driver exports for the cache
 * (ibv_reg_dmabuf_mr: rdma-core 34 and Linux 5.12 on, NVIDIA's open kernel
 * module), else as peer memory (ibv_reg_mr on the device pointer, which
 * works where the nvidia_peermem module is loaded); where neither works the
 * message gives both reasons and the way out. Kept apart from the transport
 * so that a program can register a cache without a connector
 * (tests/rdma_reg_test.c).
 *
 * A cache in parts (rdma_reg_mrs) is registered a span at a time: the
 * parts' extents sorted by address and merged where they overlap (the
 * engine's blocks-first views interleave) or, in host memory, touch; GPU
 * spans are registered as peer memory, each allocation on its own.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "err.h"
#include "rdma.h"

struct ibv_mr *rdma_reg_cache(struct ibv_pd *pd, struct kvf_cache *c, int access, const char **how)
{
        const char *dev = ibv_get_device_name(pd->context->device);
        struct ibv_mr *mr;
        char dmabuf_why[200] = "";

        if (c->parts) { /* a region over base would span unrelated memory */
                kvf_err_set(-EINVAL, "the cache on %s is in parts: register it with rdma_reg_mrs", dev);
                return NULL;
        }
        if (c->host || !c->be->dmabuf) {
                mr = ibv_reg_mr(pd, c->base, c->bytes, access);
                if (!mr)
                        kvf_err_set(
                            -(errno ? errno : EIO), "registering the cache (%llu bytes) on %s: %s",
                            (unsigned long long)c->bytes, dev, strerror(errno ? errno : EIO));
                else if (how)
                        *how = "host memory";
                return mr;
        }
        int fd = -1;
        uint64_t len = 0;
        if (c->be->dmabuf(c, &fd, &len) == 0) {
                mr = ibv_reg_dmabuf_mr(pd, 0, len, (uint64_t)(uintptr_t)c->base, fd, access);
                int e = errno;
                close(fd); /* the registration holds its own reference */
                if (mr) {
                        if (how)
                                *how = "GPU memory through a dma-buf";
                        return mr;
                }
                snprintf(dmabuf_why, sizeof(dmabuf_why), "ibv_reg_dmabuf_mr: %s",
                         strerror(e ? e : EIO));
        } else {
                snprintf(dmabuf_why, sizeof(dmabuf_why), "%s", kvf_err_msg());
        }
        mr = ibv_reg_mr(pd, c->base, c->bytes, access);
        if (mr) {
                if (how)
                        *how = "GPU memory as peer memory (nvidia_peermem)";
                return mr;
        }
        int e = errno ? errno : EIO;
        kvf_err_set(
            -EOPNOTSUPP,
            "registering the GPU cache (%llu bytes, %s backend) on %s: through a dma-buf: %s; as "
            "peer "
            "memory: %s. RDMA from GPU memory needs NVIDIA's open kernel module with Linux 5.12 or "
            "later (dma-buf), or the nvidia_peermem module loaded; tcp carries GPU caches "
            "meanwhile",
            (unsigned long long)c->bytes, c->be->name, dev, dmabuf_why, strerror(e));
        return NULL;
}

/* The bytes from part i's address to the end of its last block. */
static uint64_t part_extent(const struct kvf_cache *c, uint32_t i)
{
        const uint64_t nb = c->layout.num_blocks;
        if (!c->strides || !nb)
                return kvf_layout_part_bytes(&c->layout, i);
        return (nb - 1) * c->strides[i] + kvf_layout_part_block_bytes(&c->layout, i);
}

struct extent {
        uintptr_t a, e;
        uint32_t part;
};

static int by_addr(const void *x, const void *y)
{
        const struct extent *p = x, *q = y;
        return p->a < q->a ? -1 : p->a > q->a;
}

void rdma_mrs_free(struct rdma_mrs *m)
{
        if (!m)
                return;
        for (uint32_t i = 0; i < m->n; i++)
                ibv_dereg_mr(m->mr[i]);
        free(m->mr);
        free(m->part_mr);
        free(m);
}

static int reg_parts(struct ibv_pd *pd, struct kvf_cache *c, int access, struct rdma_mrs *m)
{
        const char *dev = ibv_get_device_name(pd->context->device);
        const uint32_t np = c->n_parts;
        struct extent *x = calloc(np, sizeof(*x));
        m->part_mr = calloc(np, sizeof(*m->part_mr));
        m->mr = calloc(np, sizeof(*m->mr));
        if (!x || !m->part_mr || !m->mr) {
                free(x);
                return kvf_err_set(-ENOMEM, "out of memory");
        }
        m->n_parts = np;
        for (uint32_t i = 0; i < np; i++) {
                if (!c->parts[i]) {
                        free(x);
                        return kvf_err_set(-EINVAL, "part %u of the cache is not mapped", i);
                }
                x[i] = (struct extent){.a = (uintptr_t)c->parts[i], .e = (uintptr_t)c->parts[i] + part_extent(c, i),
                                       .part = i};
        }
        qsort(x, np, sizeof(*x), by_addr);
        int rc = 0;
        for (uint32_t i = 0, j; i < np && rc == 0; i = j) {
                uintptr_t end = x[i].e;
                /* GPU allocations never merge (a region may not cross one); host memory does */
                for (j = i + 1; j < np && (x[j].a < end || (c->host && x[j].a == end)); j++)
                        if (x[j].e > end)
                                end = x[j].e;
                struct ibv_mr *mr = NULL;
                char dmabuf_why[200] = "";
#ifdef KVF_HAVE_CUDA
                int fd;
                uint64_t off;
                /* The engine's GPU caches: the allocation's dma-buf its engine exported, first. */
                if (!c->host && c->be->id == KVF_BACKEND_ENGINE) {
                        if (kvf_cache_cuda_dmabuf_at(c, x[i].a, end - x[i].a, &fd, &off) == 0) {
                                mr = ibv_reg_dmabuf_mr(pd, off, end - x[i].a, x[i].a, fd, access);
                                if (!mr)
                                        snprintf(dmabuf_why, sizeof(dmabuf_why), "ibv_reg_dmabuf_mr: %s",
                                                 strerror(errno ? errno : EIO));
                                else
                                        m->dmabufs++;
                        } else {
                                snprintf(dmabuf_why, sizeof(dmabuf_why), "%s", kvf_err_msg());
                        }
                }
#endif
                if (!mr)
                        mr = ibv_reg_mr(pd, (void *)x[i].a, end - x[i].a, access);
                if (!mr) {
                        int e = errno ? errno : EIO;
                        if (c->host)
                                rc = kvf_err_set(-e, "registering the cache's memory at %#llx (%llu bytes, parts of "
                                                 "%u tensors) on %s: %s",
                                                 (unsigned long long)x[i].a, (unsigned long long)(end - x[i].a),
                                                 j - i, dev, strerror(e));
                        else
                                rc = kvf_err_set(-EOPNOTSUPP, "registering the GPU cache's allocation at %#llx (%llu "
                                                 "bytes) on %s%s%s; as peer memory: %s. RDMA from a GPU cache "
                                                 "in parts needs a dma-buf of each allocation (the engine's "
                                                 "caches, where its driver exports one) or the nvidia_peermem "
                                                 "module; tcp carries it meanwhile",
                                                 (unsigned long long)x[i].a, (unsigned long long)(end - x[i].a),
                                                 dev, dmabuf_why[0] ? ": through a dma-buf: " : "", dmabuf_why,
                                                 strerror(e));
                        break;
                }
                for (uint32_t k = i; k < j; k++)
                        m->part_mr[x[k].part] = m->n;
                m->mr[m->n++] = mr;
        }
        free(x);
        return rc;
}

int rdma_reg_mrs(struct ibv_pd *pd, struct kvf_cache *c, int access, struct rdma_mrs **out, const char **how)
{
        struct rdma_mrs *m = calloc(1, sizeof(*m));
        if (!m)
                return kvf_err_set(-ENOMEM, "out of memory");
        m->reg_gen = c->reg_gen;
        m->layout = c->layout;
        int rc = 0;
        if (!c->parts) {
                if (!(m->mr = calloc(1, sizeof(*m->mr))))
                        rc = kvf_err_set(-ENOMEM, "out of memory");
                else if (!(m->mr[0] = rdma_reg_cache(pd, c, access, how)))
                        rc = -EIO; /* (kvf_err says why) */
                else
                        m->n = 1;
        } else if ((rc = reg_parts(pd, c, access, m)) == 0 && how) {
                *how = c->host       ? "host memory, in parts"
                       : m->dmabufs ? "GPU memory in parts, through the engine's dma-bufs"
                                    : "GPU memory in parts, as peer memory (nvidia_peermem)";
        }
        if (rc < 0) {
                rdma_mrs_free(m);
                return rc;
        }
        *out = m;
        return 0;
}

int rdma_mrs_table(const struct kvf_cache *c, const struct rdma_mrs *m, uint32_t **words, uint32_t *n)
{
        uint32_t *w = calloc((size_t)c->n_parts * RDMA_PART_WORDS, sizeof(*w));
        if (!w)
                return kvf_err_set(-ENOMEM, "out of memory");
        for (uint32_t i = 0; i < c->n_parts; i++) {
                uint64_t a = (uintptr_t)c->parts[i], st = c->strides ? c->strides[i] : kvf_layout_part_block_bytes(&c->layout, i);
                uint32_t *p = w + (size_t)i * RDMA_PART_WORDS;
                p[0] = (uint32_t)(a >> 32);
                p[1] = (uint32_t)a;
                p[2] = (uint32_t)(st >> 32);
                p[3] = (uint32_t)st;
                p[4] = m->mr[m->part_mr[i]]->rkey;
        }
        *words = w;
        *n = c->n_parts * RDMA_PART_WORDS;
        return 0;
}
