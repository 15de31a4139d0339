/*
 * The rules a registration of the engine's caches must pass (kvf_reg_validate,
 * common/registration.c), in-process: each shape engines use is accepted and
 * placed where its blocks are; each broken one is refused with the message
 * that says what to change. And a strided cache's addresses and the split of
 * a copy across its blocks (kvf_cache_addr, kvf_cache_contig, kvf_cache_copy_host), and a
 * copy through a region file that shrank (common/busguard.h).
 */
#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cache.h"
#include "check.h"
#include "layout.h"
#include "registration.h"

#define NL 3u
#define NB 5u
#define BB 256u
#define BASE 0x100000ull

static struct kvf_cache_layout L;
static char why[KVF_REASON_MAX];
static struct kvf_reg_placed out[2 * NL];

static int check(const struct kvf_reg_wire_region *rg, uint32_t nr, const uint64_t *sz,
                 const struct kvf_reg_wire_view *v, uint32_t nv, bool *strided)
{
        why[0] = 0;
        return kvf_reg_validate(&L, rg, nr, sz, v, nv, out, strided, why, sizeof(why));
}

#define REFUSED(needle, ...)                                                                       \
        do {                                                                                       \
                bool st_;                                                                          \
                CHECK_EQ(check(__VA_ARGS__, &st_), -EINVAL);                                       \
                if (!strstr(why, (needle))) {                                                      \
                        fprintf(stderr, "%s:%d: \"%s\" lacks \"%s\"\n", __FILE__, __LINE__, why,   \
                                (needle));                                                         \
                        exit(1);                                                                   \
                }                                                                                  \
        } while (0)

/* Views of layers-first [layers, 2, blocks] in one region (stride BB), or blocks-first per
 * layer [layers][blocks, 2] (stride 2 BB). */
static void views_of(struct kvf_reg_wire_view *v, bool blocks_first)
{
        for (uint32_t l = 0; l < NL; l++)
                for (uint32_t t = 0; t < 2; t++)
                        v[l * 2 + t] =
                            blocks_first
                                ? (struct kvf_reg_wire_view){l, t, BASE + (l * 2ull * NB + t) * BB,
                                                             2 * BB}
                                : (struct kvf_reg_wire_view){l, t,
                                                             BASE + ((l * 2ull + t) * NB) * BB, BB};
}

/*
 * The engine's region file shrunk under a mapping (ftruncate): a copy through it fails with
 * -EFAULT, both ways, and this process lives and copies again once the file has its size back;
 * SIGBUS outside a guarded copy still kills (a child shows it).
 */
static void shrunk_file(const struct kvf_cache_layout *lay, uint64_t total, struct kvf_cache *fc,
                        const struct kvf_copy_run *run)
{
        int fd = memfd_create("kvferry-test-shrunk", MFD_CLOEXEC);
        CHECK(fd >= 0);
        CHECK_EQ(ftruncate(fd, (off_t)total), 0);
        uint8_t *m = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        CHECK(m != MAP_FAILED);
        struct kvf_cache rc = {.layout = *lay, .bytes = total, .base = m, .host = true};
        struct kvf_cache *d[1] = {&rc};
        struct kvf_copy_batch b = {.src = fc, .dst = d, .ndst = 1, .runs = run, .nruns = 1};
        CHECK_EQ(kvf_cache_copy_host(&b), 0);
        CHECK_EQ(ftruncate(fd, 0), 0);
        for (int i = 0; i < 3; i++) { /* into it, and out of it, more than once */
                b = (struct kvf_copy_batch){.src = fc, .dst = d, .ndst = 1, .runs = run, .nruns = 1};
                CHECK_EQ(kvf_cache_copy_host(&b), -EFAULT);
                CHECK_ERR_HAS("shrank after it was registered");
                struct kvf_cache *back[1] = {fc};
                b = (struct kvf_copy_batch){.src = &rc, .dst = back, .ndst = 1, .runs = run, .nruns = 1};
                CHECK_EQ(kvf_cache_copy_host(&b), -EFAULT);
        }
        CHECK_EQ(ftruncate(fd, (off_t)total), 0);
        b = (struct kvf_copy_batch){.src = fc, .dst = d, .ndst = 1, .runs = run, .nruns = 1};
        CHECK_EQ(kvf_cache_copy_host(&b), 0);
        CHECK(!memcmp(m + run->dst_off, fc->base + run->src_off, run->bytes));
        CHECK_EQ(ftruncate(fd, 0), 0);
        printf("register_rules_test: a child now dies of SIGBUS on purpose (a sanitizer reports it)\n");
        fflush(stdout);
        pid_t kid = fork();
        CHECK(kid >= 0);
        if (kid == 0) {
                volatile uint8_t *p = m;
                p[0] = 1; /* not guarded: the signal's default action */
                _exit(0);
        }
        int st;
        CHECK_EQ(waitpid(kid, &st, 0), kid);
        /* (under AddressSanitizer its own handler reports the fault and exits non-zero) */
        CHECK(WIFSIGNALED(st) ? WTERMSIG(st) == SIGBUS : WEXITSTATUS(st) != 0);
        munmap(m, total);
        close(fd);
        printf("register_rules_test: a shrunk region file fails the copy (-EFAULT), both ways; "
               "unguarded, SIGBUS still kills\n");
}

int main(void)
{
        CHECK_EQ(kvf_layout_make(&L, NL, 0, NB, 1, 2, 64, KVF_DTYPE_FP16, 0), 0);
        CHECK_EQ(L.block_bytes, BB);
        const uint64_t total = NL * 2ull * NB * BB;
        struct kvf_reg_wire_region one = {BASE, total, 0};
        uint64_t sz = total, small = total - 1;
        struct kvf_reg_wire_view v[2 * NL + 1];
        bool strided;

        /* layers-first, one region: accepted, each view placed at its offset */
        views_of(v, false);
        CHECK_EQ(check(&one, 1, &sz, v, 2 * NL, &strided), 0);
        CHECK(!strided);
        CHECK_EQ(out[1 * 2 + 1].off, (1 * 2 + 1) * NB * BB);
        CHECK_EQ(out[1 * 2 + 1].stride, BB);
        /* blocks-first: K and V interleave block by block without sharing a byte */
        views_of(v, true);
        CHECK_EQ(check(&one, 1, &sz, v, 2 * NL, &strided), 0);
        CHECK(strided);
        CHECK_EQ(out[2 * 2 + 1].off, (2 * 2ull * NB + 1) * BB);
        /* a region given with an offset into its file */
        struct kvf_reg_wire_region off = {BASE, total, 4096};
        uint64_t bigger = total + 4096;
        CHECK_EQ(check(&off, 1, &bigger, v, 2 * NL, &strided), 0);
        REFUSED("its file has", &off, 1, &sz, v, 2 * NL);

        views_of(v, false);
        REFUSED("foreign memory, or the wrong size", &one, 1, &small, v, 2 * NL);
        REFUSED("5 views, but", &one, 1, &sz, v, 2 * NL - 1);
        v[2 * NL] = v[0];
        REFUSED("views, but the instance has 3 layers x 2 tensors", &one, 1, &sz, v, 2 * NL + 1);
        struct kvf_reg_wire_view twice[2 * NL];
        memcpy(twice, v, sizeof(twice));
        twice[5] = twice[4];
        REFUSED("(layer 2, K) is given twice", &one, 1, &sz, twice, 2 * NL);
        memcpy(twice, v, sizeof(twice));
        twice[1].addr = twice[0].addr + BB; /* V of layer 0 on K's second block */
        REFUSED("(layer 0, K) and (layer 0, V) overlap", &one, 1, &sz, twice, 2 * NL);
        memcpy(twice, v, sizeof(twice));
        twice[1].addr = twice[0].addr + BB / 2; /* half a block apart, stride 2 BB: still shared */
        twice[0].stride = twice[1].stride = 2 * BB;
        REFUSED("overlap", &one, 1, &sz, twice, 2 * NL);
        memcpy(twice, v, sizeof(twice));
        twice[3].stride = BB - 2;
        REFUSED("block stride 254 is less than a block (256 bytes)", &one, 1, &sz, twice, 2 * NL);
        memcpy(twice, v, sizeof(twice));
        twice[4].layer = NL;
        REFUSED("names (layer 3, K)", &one, 1, &sz, twice, 2 * NL);
        struct kvf_reg_wire_region short_rg = {BASE, total - BB, 0};
        REFUSED("(layer 2, V): its 5 blocks", &short_rg, 1, &sz, v, 2 * NL);
        /* two regions: every view's blocks inside one of them */
        struct kvf_reg_wire_region two[2] = {{BASE, total / 2, 0},
                                             {BASE + total / 2, total / 2, 0}};
        uint64_t sz2[2] = {total / 2, total / 2};
        CHECK_EQ(check(two, 2, sz2, v, 2 * NL, &strided), 0);
        CHECK_EQ(out[5].region, 1);
        CHECK_EQ(out[5].off, total / 2 - NB * BB);
        struct kvf_reg_wire_region ovl[2] = {{BASE, total, 0}, {BASE + BB, total, 0}};
        uint64_t szo[2] = {total, total};
        REFUSED("regions 0 and 1 overlap", ovl, 2, szo, v, 2 * NL);
        REFUSED("0 regions", &one, 0, &sz, v, 2 * NL);

        /* A strided cache: addresses per block, copies split at block boundaries. */
        uint8_t *mem = calloc(1, total), *flat = malloc(total);
        CHECK(mem && flat);
        uint8_t *parts[2 * NL];
        uint64_t strides[2 * NL];
        for (uint32_t k = 0; k < 2 * NL; k++) {
                parts[k] = mem + (k / 2) * 2ull * NB * BB + (k % 2) * BB;
                strides[k] = 2 * BB;
        }
        struct kvf_cache sc = {.layout = L,
                               .bytes = total,
                               .parts = parts,
                               .n_parts = 2 * NL,
                               .strides = strides,
                               .host = true};
        struct kvf_cache fc = {.layout = L, .bytes = total, .base = flat, .host = true};
        CHECK(kvf_cache_addr(&sc, kvf_layout_offset(&L, 1, 1, 3) + 7) ==
              mem + (2 * NB + 3 * 2 + 1) * BB + 7);
        CHECK_EQ(kvf_cache_contig(&sc, kvf_layout_offset(&L, 1, 1, 3) + 7), BB - 7);
        CHECK_EQ(kvf_cache_contig(&sc, total), 0);
        for (uint64_t i = 0; i < total; i++)
                flat[i] = (uint8_t)(i * 7 + i / BB);
        /* one run of 4 blocks of layer 2's V, flat -> strided, then back into zeroed memory */
        struct kvf_cache *dsts[1] = {&sc};
        struct kvf_copy_run run = {.dst = 0,
                                   .src_off = kvf_layout_offset(&L, 2, 1, 1),
                                   .dst_off = kvf_layout_offset(&L, 2, 1, 1),
                                   .bytes = 4 * BB};
        struct kvf_copy_batch b = {.src = &fc, .dst = dsts, .ndst = 1, .runs = &run, .nruns = 1};
        CHECK_EQ(kvf_cache_copy_host(&b), 0);
        for (uint32_t blk = 1; blk < 5; blk++)
                CHECK(!memcmp(mem + (2 * 2 * NB + blk * 2 + 1) * BB,
                              flat + kvf_layout_offset(&L, 2, 1, blk), BB));
        CHECK(mem[(2 * 2 * NB + 1 * 2) * BB] == 0); /* K's block between them untouched */
        memset(flat, 0, total);
        struct kvf_cache *back[1] = {&fc};
        b = (struct kvf_copy_batch){.src = &sc, .dst = back, .ndst = 1, .runs = &run, .nruns = 1};
        CHECK_EQ(kvf_cache_copy_host(&b), 0);
        for (uint32_t blk = 1; blk < 5; blk++)
                CHECK(!memcmp(mem + (2 * 2 * NB + blk * 2 + 1) * BB,
                              flat + kvf_layout_offset(&L, 2, 1, blk), BB));
        /* a cache waiting for its registration: the copy is refused, not a crash */
        struct kvf_cache empty = {.layout = L, .bytes = total};
        dsts[0] = &empty;
        b = (struct kvf_copy_batch){.src = &fc, .dst = dsts, .ndst = 1, .runs = &run, .nruns = 1};
        CHECK_EQ(kvf_cache_copy_host(&b), -EIO);
        CHECK_ERR_HAS("not mapped");
        /* a host copy into GPU memory (the engine's caches of a GPU instance) is refused, never a
         * memcpy into a device pointer */
        struct kvf_cache gpu = sc;
        gpu.host = false;
        gpu.device = 0;
        dsts[0] = &gpu;
        b = (struct kvf_copy_batch){.src = &fc, .dst = dsts, .ndst = 1, .runs = &run, .nruns = 1};
        CHECK_EQ(kvf_cache_copy_host(&b), -EXDEV);
        CHECK_ERR_HAS("into GPU memory");
        shrunk_file(&L, total, &fc, &run);

        /* GPU registrations: a region is an allocation (PyTorch's caching allocator: a
         * segment holding several tensors), its size from the driver and no file; tensors
         * are placed at their offsets in it, two allocations apart. */
        {
                uint64_t seg = 2 * NL * NB * BB + 3 * BB; /* with slack, as a segment has */
                struct kvf_reg_wire_region g[2] = {{.addr = 0x7f0000200000ull, .bytes = seg},
                                                   {.addr = 0x7f0000800000ull, .bytes = seg}};
                uint64_t gs[2] = {g[0].bytes, g[1].bytes};
                struct kvf_reg_wire_view gv[2 * NL];
                for (uint32_t l = 0; l < NL; l++)
                        for (uint32_t t = 0; t < 2; t++)
                                gv[l * 2 + t] = (struct kvf_reg_wire_view){
                                    .layer = l, .tensor = t, .stride = BB,
                                    .addr = g[t].addr + BB + (uint64_t)l * NB * BB};
                bool st;
                CHECK_EQ(check(g, 2, gs, gv, 2 * NL, &st), 0);
                CHECK_EQ(out[2 * 2 + 1].region, 1);
                CHECK_EQ(out[2 * 2 + 1].off, BB + 2ull * NB * BB);
                CHECK_EQ(out[1 * 2 + 0].region, 0);
                /* a tensor past its allocation's end (a view over two segments) */
                gv[5].addr = g[1].addr + seg - NB * BB + BB;
                REFUSED("not inside one region", g, 2, gs, gv, 2 * NL);
        }

        /* The kind of memory and the GPU: host memory to a GPU instance, GPU memory to a host
         * one, and tensors on another GPU than the instance's, each refused with the fix. */
        {
                struct kvf_ctl_header *h = calloc(1, sizeof(*h));
                CHECK(h != NULL);
                snprintf(h->instance, sizeof(h->instance), "gpu-rules");
                uint8_t u0[16] = {0xde, 0xad}, u1[16] = {0xbe, 0xef};
                CHECK_EQ(kvf_reg_check_device(h, -1, u0, why, sizeof(why)), 0);
                CHECK_EQ(kvf_reg_check_device(h, 0, u0, why, sizeof(why)), -EINVAL);
                CHECK(strstr(why, "GPU memory (device 0) given to instance 'gpu-rules'") &&
                      strstr(why, "--caches engine --backend cuda"));
                h->reg_gpu = 1;
                memcpy(h->cuda_uuid, u0, 16);
                CHECK_EQ(kvf_reg_check_device(h, 0, u0, why, sizeof(why)), 0);
                CHECK_EQ(kvf_reg_check_device(h, -1, u0, why, sizeof(why)), -EINVAL);
                CHECK(strstr(why, "host memory given to instance 'gpu-rules'") != NULL);
                CHECK_EQ(kvf_reg_check_device(h, 1, u1, why, sizeof(why)), -EINVAL);
                CHECK(strstr(why, "GPU-beef0000-") && strstr(why, "serves GPU-dead0000-") &&
                      strstr(why, "(device 1 of the engine)"));
                free(h);
        }
        free(mem);
        free(flat);
        printf("ok: registration rules and strided copies\n");
        return 0;
}
