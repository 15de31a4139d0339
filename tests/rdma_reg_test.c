/*
 * rdma_reg_test: registering a cache with an RDMA device (connector/rdma_mr.c,
 * rdma_reg_cache), every branch, with real verbs:
 *   - host memory: registered as it is;
 *   - "GPU" memory of a stand-in backend (host memory the CPU is told not to
 *     use, host = false) whose dma-buf export works: a real dma-buf made by
 *     udmabuf from a memfd, registered with ibv_reg_dmabuf_mr where the device
 *     takes dma-bufs, else registered as peer memory after that refusal;
 *   - the same backend with no dma-buf: registered as peer memory;
 *   - neither (no dma-buf, and an address range no device can pin): refused
 *     with both reasons and the way out in the message;
 *   - caches in parts (rdma_reg_mrs): host parts that interleave (blocks-first
 *     views) or follow each other share a region, a part elsewhere has its
 *     own, every part's region covers its blocks and its key is in the
 *     welcome's table; "GPU" parts that touch are never merged (a region
 *     may not cross an allocation); a part whose pages cannot be pinned is
 *     refused with the way out;
 *   - with --instance NAME, that instance's real cache (a GPU cache on a GPU
 *     machine): its dma-buf export (the file's size must be the cache's) and,
 *     where an RDMA device is, its registration; for the engine's GPU caches
 *     (--caches engine --backend cuda, registered), every tensor inside the
 *     dma-buf of an allocation its engine exported.
 * Runs inside the soft-RoCE VM (tests/vm/rdma_test.sh) and on the GPU machine
 * (tests/gpu_e2e_test.sh). Exit 0 pass, 1 fail, 77 no RDMA device and no
 * instance to check.
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/udmabuf.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cache.h"
#include "check.h"
#include "ctl.h"
#include "err.h"
#include "rdma.h"

#define BYTES (4u << 20)

static int memfd = -1;
static bool fake_has_dmabuf;

/* A dma-buf of the memfd behind the stand-in cache (udmabuf), or -ENOTSUP. */
static int fake_dmabuf(struct kvf_cache *c, int *fd, uint64_t *len)
{
        *len = c->bytes;
        if (!fake_has_dmabuf)
                return kvf_err_set(-ENOTSUP, "stand-in backend: no dma-buf here");
        int dev = open("/dev/udmabuf", O_RDWR | O_CLOEXEC);
        if (dev < 0)
                return kvf_err_set(-ENOTSUP, "stand-in backend: /dev/udmabuf: %s", strerror(errno));
        struct udmabuf_create cr = {.memfd = (uint32_t)memfd,
                                    .flags = UDMABUF_FLAGS_CLOEXEC,
                                    .offset = 0,
                                    .size = c->bytes};
        *fd = ioctl(dev, UDMABUF_CREATE, &cr);
        int e = errno;
        close(dev);
        return *fd < 0 ? kvf_err_set(-ENOTSUP, "stand-in backend: UDMABUF_CREATE: %s", strerror(e))
                       : 0;
}

static const struct kvf_cache_backend fake = {.name = "stand-in", .dmabuf = fake_dmabuf};

static struct ibv_mr *reg(struct ibv_pd *pd, struct kvf_cache *c, const char **how)
{
        *how = "";
        kvf_err_clear();
        return rdma_reg_cache(pd, c, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, how);
}

static void check_mr(struct ibv_mr *mr, const struct kvf_cache *c, const char *how,
                     const char *what)
{
        if (!mr) {
                fprintf(stderr, "%s: not registered: %s\n", what, kvf_err_msg());
                exit(1);
        }
        CHECK(mr->addr == (void *)c->base ||
              mr->addr == NULL); /* a dma-buf region reports its iova */
        CHECK(mr->length >= c->bytes);
        printf("ok: %s: %llu bytes registered (%s), lkey %#x rkey %#x\n", what,
               (unsigned long long)mr->length, how, mr->lkey, mr->rkey);
        CHECK_EQ(ibv_dereg_mr(mr), 0);
}

/* Every part's blocks inside its region; the welcome's table says each part's address,
 * stride and key. */
static void check_parts(const struct kvf_cache *c, const struct rdma_mrs *m)
{
        uint32_t *w, nw;
        CHECK_EQ(rdma_mrs_table(c, m, &w, &nw), 0);
        CHECK_EQ(nw, c->n_parts * RDMA_PART_WORDS);
        for (uint32_t i = 0; i < c->n_parts; i++) {
                const struct ibv_mr *mr = m->mr[m->part_mr[i]];
                uint64_t bb = kvf_layout_part_block_bytes(&c->layout, i);
                uint64_t st = c->strides ? c->strides[i] : bb;
                uintptr_t a = (uintptr_t)c->parts[i], e = a + (c->layout.num_blocks - 1) * st + bb;
                CHECK(a >= (uintptr_t)mr->addr && e <= (uintptr_t)mr->addr + mr->length);
                /* the last byte of part i, in kvf_layout_offset order */
                uint64_t last = 0;
                for (uint32_t k = 0; k <= i; k++)
                        last += kvf_layout_part_bytes(&c->layout, k);
                CHECK(rdma_mrs_at(m, last - 1) == mr);
                const uint32_t *q = w + (size_t)i * RDMA_PART_WORDS;
                CHECK_EQ((uint64_t)q[0] << 32 | q[1], (uint64_t)a);
                CHECK_EQ((uint64_t)q[2] << 32 | q[3], st);
                CHECK_EQ(q[4], mr->rkey);
        }
        free(w);
}

/* Caches in parts, as the engine's registrations and FastDeploy's tensors make them. */
static void parts_cases(struct ibv_pd *pd)
{
        enum { NB = 16, BB = 4096, PB = NB * BB };
        /* One mapping, so that what lies between the parts is known: a gap after each group. */
        uint8_t *all = mmap(NULL, 7 * PB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        CHECK(all != MAP_FAILED);
        uint8_t *a = all, *b = all + 3 * PB, *c1 = all + 6 * PB;
        /* parts 0, 1: blocks-first in a (K and V of a block side by side); 2, 3: back to back
         * in b; 4: alone in c1 */
        uint8_t *parts[5] = {a, a + BB, b, b + PB, c1};
        uint64_t strides[5] = {2 * BB, 2 * BB, BB, BB, BB};
        struct kvf_cache hc = {.be = &kvf_cache_host, .host = true, .device = -1, .parts = parts, .n_parts = 5,
                               .strides = strides};
        /* five layers of K only, blocks of 1 x 16 x 128 fp16 = BB */
        CHECK_EQ(kvf_layout_make(&hc.layout, 5, 0, NB, 1, 16, 128, KVF_DTYPE_FP16, 1), 0);
        CHECK_EQ(hc.layout.block_bytes, BB);
        struct rdma_mrs *m = NULL;
        const char *how = "";
        CHECK_EQ(rdma_reg_mrs(pd, &hc, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, &m, &how), 0);
        CHECK_EQ(m->n, 3);
        CHECK(m->part_mr[0] == m->part_mr[1] && m->part_mr[2] == m->part_mr[3] && m->part_mr[0] != m->part_mr[2] &&
              m->part_mr[4] != m->part_mr[0] && m->part_mr[4] != m->part_mr[2]);
        check_parts(&hc, m);
        printf("ok: host memory in 5 parts (2 interleaved, 2 back to back, 1 apart): %u regions (%s)\n", m->n, how);
        rdma_mrs_free(m);

        /* "GPU" parts (the stand-in backend): the two back to back in b stay apart. */
        uint8_t *gparts[2] = {b, b + PB};
        struct kvf_cache gc = {.be = &fake, .host = false, .device = 0, .parts = gparts, .n_parts = 2};
        CHECK_EQ(kvf_layout_make(&gc.layout, 1, 0, NB, 1, 16, 128, KVF_DTYPE_FP16, 0), 0);
        CHECK_EQ(rdma_reg_mrs(pd, &gc, IBV_ACCESS_LOCAL_WRITE, &m, &how), 0);
        CHECK_EQ(m->n, 2);
        CHECK(strstr(how, "peer memory"));
        check_parts(&gc, m);
        printf("ok: device memory in 2 parts that touch: %u regions, never one across them (%s)\n", m->n, how);
        rdma_mrs_free(m);

        /* Scale tensors (FastDeploy's block_wise_fp8): K, V, then their scales, a part of
         * another size each; K and the V scales back to back, V and the K scales apart. */
        struct kvf_cache sc = {.be = &kvf_cache_host, .host = true, .device = -1, .n_parts = 4};
        CHECK_EQ(kvf_layout_make(&sc.layout, 1, 0, NB, 2, 16, 128, KVF_DTYPE_UINT8, 0), 0);
        CHECK_EQ(kvf_layout_set_scales(&sc.layout, KVF_DTYPE_BF16), 0);
        CHECK_EQ(sc.layout.block_bytes, BB);
        CHECK_EQ(sc.layout.scale_bytes, 2 * 16 * 2);
        CHECK_EQ(kvf_layout_parts(&sc.layout), 4);
        uint8_t *sparts[4] = {a, b, b + 2 * PB, a + PB};
        sc.parts = sparts;
        CHECK_EQ(rdma_reg_mrs(pd, &sc, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, &m, &how), 0);
        CHECK_EQ(m->n, 3);
        CHECK(m->part_mr[0] == m->part_mr[3] && m->part_mr[1] != m->part_mr[0] && m->part_mr[2] != m->part_mr[0] &&
              m->part_mr[1] != m->part_mr[2]);
        check_parts(&sc, m);
        printf("ok: K/V and their scale tensors in 4 parts of 2 sizes: %u regions\n", m->n);
        rdma_mrs_free(m);

        /* A part nobody can pin: refused, nothing left registered. */
        uint8_t *none = mmap(NULL, PB, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        CHECK(none != MAP_FAILED);
        gparts[1] = none;
        m = NULL;
        CHECK(rdma_reg_mrs(pd, &gc, IBV_ACCESS_LOCAL_WRITE, &m, &how) < 0 && m == NULL);
        CHECK(strstr(kvf_err_msg(), "nvidia_peermem") && strstr(kvf_err_msg(), "tcp carries it"));
        printf("ok: a part that cannot be pinned: refused: %s\n", kvf_err_msg());
        munmap(none, PB);
        munmap(all, 7 * PB);
}

/* The instance's real cache: its dma-buf (checked through /proc/self/fdinfo) and, on pd, its
 * registration. */
static int check_instance(const char *name, struct ibv_pd *pd)
{
        struct kvf_ctl ctl;
        struct kvf_cache c;
        CHECK(kvf_ctl_attach(name, false, &ctl) == 0);
        CHECK(kvf_cache_map(ctl.hdr, true, &c) == 0);
        printf("instance %s: %llu bytes, %s backend\n", name, (unsigned long long)c.bytes,
               c.be->name);
        if (c.be->dmabuf) {
                int fd;
                uint64_t len;
                if (c.be->dmabuf(&c, &fd, &len) == 0) {
                        char path[64], line[256];
                        unsigned long long size = 0;
                        snprintf(path, sizeof(path), "/proc/self/fdinfo/%d", fd);
                        FILE *f = fopen(path, "r");
                        CHECK(f);
                        while (fgets(line, sizeof(line), f))
                                if (sscanf(line, "size: %llu", &size) == 1 ||
                                    strncmp(line, "exp_name:", 9) == 0)
                                        printf("  dma-buf %s", line);
                        fclose(f);
                        if (size < c.bytes || size != len) {
                                fprintf(
                                    stderr,
                                    "the dma-buf is %llu bytes, the cache %llu (exported %llu)\n",
                                    size, (unsigned long long)c.bytes, (unsigned long long)len);
                                return 1;
                        }
                        close(fd);
                        printf(
                            "ok: instance %s: its GPU cache exports as a dma-buf of %llu bytes\n",
                            name, size);
                } else {
                        printf("ok: instance %s: no dma-buf of its cache here, said clearly: %s\n",
                               name, kvf_err_msg());
                }
        }
#ifdef KVF_HAVE_CUDA
        if (c.be->id == KVF_BACKEND_ENGINE && !c.host && c.parts) {
                /* (its engine exported them: registered with KVFERRY_DMABUF=always, or on a host
                 * with an RDMA device) */
                uint32_t inside = 0;
                for (uint32_t i = 0; i < c.n_parts; i++) {
                        uint64_t st = c.strides ? c.strides[i] : c.layout.block_bytes, off;
                        uint64_t ext = (c.layout.num_blocks - 1) * st + c.layout.block_bytes;
                        int fd;
                        if (kvf_cache_cuda_dmabuf_at(&c, (uintptr_t)c.parts[i], ext, &fd, &off) < 0) {
                                fprintf(stderr, "tensor %u of the engine's GPU caches: %s\n", i, kvf_err_msg());
                                return 1;
                        }
                        off_t size = lseek(fd, 0, SEEK_END);
                        CHECK(size >= 0 && off + ext <= (uint64_t)size);
                        inside++;
                }
                printf("ok: instance %s: the engine's GPU caches: all %u tensors inside the dma-bufs its engine "
                       "exported\n", name, inside);
        }
#endif
        if (pd && c.parts) {
                struct rdma_mrs *m;
                const char *how = "";
                if (rdma_reg_mrs(pd, &c, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, &m, &how) == 0) {
                        printf("ok: the instance's cache in %u parts registered: %u regions (%s)\n", c.n_parts, m->n,
                               how);
                        rdma_mrs_free(m);
                } else {
                        printf("ok: the instance's cache is not registrable here, said clearly: %s\n", kvf_err_msg());
                }
        } else if (pd) {
                const char *how;
                struct ibv_mr *mr = reg(pd, &c, &how);
                if (mr)
                        check_mr(mr, &c, how, "the instance's cache");
                else
                        printf(
                            "ok: the instance's cache is not registrable here, said clearly: %s\n",
                            kvf_err_msg());
        }
        kvf_cache_unmap(&c);
        kvf_ctl_detach(&ctl);
        return 0;
}

int main(int argc, char **argv)
{
        const char *instance = argc == 3 && !strcmp(argv[1], "--instance") ? argv[2] : NULL;
        if (argc != 1 && !instance) {
                fprintf(stderr, "usage: %s [--instance NAME]\n", argv[0]);
                return 2;
        }
        int n = 0;
        struct ibv_device **list = ibv_get_device_list(&n);
        struct ibv_context *ctx = list && n > 0 ? ibv_open_device(list[0]) : NULL;
        struct ibv_pd *pd = ctx ? ibv_alloc_pd(ctx) : NULL;
        if (!pd) {
                printf("no RDMA device to register on (%d devices)\n", n);
                if (list)
                        ibv_free_device_list(list);
                return instance ? check_instance(instance, NULL) : 77;
        }
        printf("registering on %s\n", ibv_get_device_name(ctx->device));
        const char *how;

        /* Host memory. */
        uint8_t *host = aligned_alloc(4096, BYTES);
        CHECK(host);
        struct kvf_cache hc = {
            .be = &kvf_cache_host, .base = host, .bytes = BYTES, .host = true, .device = -1};
        struct ibv_mr *mr = reg(pd, &hc, &how);
        CHECK(mr && !strcmp(how, "host memory"));
        check_mr(mr, &hc, how, "host memory");

        /* The stand-in "GPU" cache: memory of a memfd (sealed against shrinking, as udmabuf needs).
         */
        memfd = memfd_create("kvf-rdma-reg", MFD_ALLOW_SEALING);
        CHECK(memfd >= 0 && ftruncate(memfd, BYTES) == 0 &&
              fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
        uint8_t *dev = mmap(NULL, BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
        CHECK(dev != MAP_FAILED);
        struct kvf_cache gc = {
            .be = &fake, .base = dev, .bytes = BYTES, .host = false, .device = 0};

        fake_has_dmabuf = true;
        mr = reg(pd, &gc, &how);
        if (mr && !strcmp(how, "GPU memory through a dma-buf")) {
                check_mr(mr, &gc, how, "device memory with a dma-buf");
        } else if (mr) {
                /* A device without dma-buf registration (rxe), or no udmabuf: peer memory after it.
                 */
                CHECK(strstr(how, "peer memory"));
                check_mr(mr, &gc, how,
                         "device memory whose dma-buf the device refused (or that had none)");
        } else {
                fprintf(stderr, "device memory with a dma-buf: not registered: %s\n",
                        kvf_err_msg());
                return 1;
        }

        fake_has_dmabuf = false;
        mr = reg(pd, &gc, &how);
        CHECK(mr && strstr(how, "peer memory"));
        check_mr(mr, &gc, how, "device memory without a dma-buf");

        /* Neither: no dma-buf, and pages nobody can pin (PROT_NONE). */
        uint8_t *none = mmap(NULL, BYTES, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        CHECK(none != MAP_FAILED);
        struct kvf_cache nc = {
            .be = &fake, .base = none, .bytes = BYTES, .host = false, .device = 0};
        mr = reg(pd, &nc, &how);
        if (mr) {
                fprintf(stderr, "memory nobody can pin was registered (%s)\n", how);
                return 1;
        }
        const char *m = kvf_err_msg();
        CHECK(strstr(m, "stand-in backend: no dma-buf here") && strstr(m, "as peer memory:") &&
              strstr(m, "nvidia_peermem") && strstr(m, "tcp carries GPU caches"));
        printf("ok: neither a dma-buf nor peer memory: refused: %s\n", m);
        parts_cases(pd);

        int rc = instance ? check_instance(instance, pd) : 0;
        ibv_dealloc_pd(pd);
        ibv_close_device(ctx);
        ibv_free_device_list(list);
        munmap(dev, BYTES);
        munmap(none, BYTES);
        free(host);
        if (rc == 0)
                printf("rdma_reg_test: all passed\n");
        return rc;
}
