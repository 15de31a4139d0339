/*
 * The engine's caches: the checks a registration must pass, and a role's
 * mapping of the registration the allocator holds (registration.h).
 */
#include "registration.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "atomics.h"
#include "cache.h"
#include "err.h"
#include "fdpass.h"
#include "layout.h"

int kvf_reg_sock_name(const struct kvf_ctl_header *h, char *out, size_t len)
{
        int n = snprintf(out, len, "kvferry-reg/%u/%s/%llu", h->owner_uid, h->instance,
                         (unsigned long long)h->created_ns);
        if (n < 0 || (size_t)n >= len)
                return kvf_err_set(-ENAMETOOLONG, "registration socket name of '%s' too long",
                                   h->instance);
        return 0;
}

static int refuse(char *why, size_t whylen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int refuse(char *why, size_t whylen, const char *fmt, ...)
{
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, whylen, fmt, ap);
        va_end(ap);
        return -EINVAL;
}

static const char *tname(uint32_t t)
{
        return t == 0 ? "K" : t == 1 ? "V" : "?";
}

struct span {
        uint64_t lo, hi, stride; /* [lo, hi): first block's start to last block's end */
        uint32_t view;
};

static int span_cmp(const void *a, const void *b)
{
        const struct span *x = a, *y = b;
        return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* Two views' blocks share a byte: spans overlap and, with one stride s, the offset between
 * them modulo s is within a block of either side; with different strides, refused as such. */
static bool blocks_overlap(const struct span *a, const struct span *b, uint64_t bb, uint64_t nb)
{
        if (b->lo >= a->hi || a->lo >= b->hi)
                return false;
        if (a->stride != b->stride || nb == 1)
                return true;
        uint64_t d = (b->lo - a->lo) % a->stride; /* b->lo >= a->lo: sorted */
        return d < bb || a->stride - d < bb;
}

int kvf_reg_validate(const struct kvf_cache_layout *L, const struct kvf_reg_wire_region *rg,
                     uint32_t nr, const uint64_t *fd_size, const struct kvf_reg_wire_view *v,
                     uint32_t nv, struct kvf_reg_placed *out, bool *strided, char *why,
                     size_t whylen)
{
        uint32_t layers = kvf_layout_layers(L), tensors = kvf_layout_tensors(L),
                 want = layers * tensors;
        uint64_t bb = L->block_bytes, nb = L->num_blocks;
        struct span *sp = NULL;
        uint8_t *seen = NULL;
        int rc = 0;

        *strided = false;
        if (nr == 0 || nr > KVF_FDPASS_MAX)
                return refuse(why, whylen,
                              "%u regions: give 1 to %u (whole allocations, not one per tensor)",
                              nr, KVF_FDPASS_MAX);
        for (uint32_t i = 0; i < nr; i++) {
                if (rg[i].bytes == 0)
                        return refuse(why, whylen, "region %u has 0 bytes", i);
                if (rg[i].addr + rg[i].bytes < rg[i].addr ||
                    rg[i].fd_offset + rg[i].bytes < rg[i].fd_offset)
                        return refuse(why, whylen, "region %u wraps around the address space", i);
                if (rg[i].fd_offset + rg[i].bytes > fd_size[i])
                        return refuse(why, whylen,
                                      "region %u: its file has %llu bytes, but fd_offset %llu + "
                                      "%llu bytes needs %llu: "
                                      "foreign memory, or the wrong size (share the memory the "
                                      "views are in as a "
                                      "file of at least that size)",
                                      i, (unsigned long long)fd_size[i],
                                      (unsigned long long)rg[i].fd_offset,
                                      (unsigned long long)rg[i].bytes,
                                      (unsigned long long)(rg[i].fd_offset + rg[i].bytes));
                for (uint32_t j = 0; j < i; j++)
                        if (rg[i].addr < rg[j].addr + rg[j].bytes &&
                            rg[j].addr < rg[i].addr + rg[i].bytes)
                                return refuse(
                                    why, whylen,
                                    "regions %u and %u overlap: give each allocation once", j, i);
        }
        if (nv != want)
                rc = refuse(
                    why, whylen, "%u views, but the instance has %u layers x %u tensors = %u%s", nv,
                    layers, tensors, want, L->key_only ? " (key only: one tensor per layer)" : "");
        if (rc == 0 && (!(sp = calloc(nv, sizeof(*sp))) || !(seen = calloc(want, 1))))
                rc = kvf_err_set(-ENOMEM, "out of memory");
        for (uint32_t i = 0; rc == 0 && i < nv; i++) {
                const struct kvf_reg_wire_view *w = &v[i];
                if (w->layer >= layers || w->tensor >= tensors) {
                        rc = refuse(
                            why, whylen,
                            "view %u names (layer %u, %s): the instance has layers 0 to %u and %s",
                            i, w->layer, tname(w->tensor), layers - 1,
                            tensors == 1 ? "only K (key only)" : "K and V");
                        break;
                }
                uint32_t k = w->layer * tensors + w->tensor;
                if (seen[k]) {
                        rc = refuse(why, whylen, "(layer %u, %s) is given twice", w->layer,
                                    tname(w->tensor));
                        break;
                }
                seen[k] = 1;
                if (w->stride < bb) {
                        rc = refuse(why, whylen,
                                    "(layer %u, %s): block stride %llu is less than a block (%llu "
                                    "bytes): a block must "
                                    "be contiguous and blocks must not overlap",
                                    w->layer, tname(w->tensor), (unsigned long long)w->stride,
                                    (unsigned long long)bb);
                        break;
                }
                if (w->stride != bb)
                        *strided = true;
                uint64_t lo = w->addr, hi = w->addr + (nb - 1) * w->stride + bb;
                if (hi < lo || (nb > 1 && w->stride > (UINT64_MAX - bb) / (nb - 1))) {
                        rc = refuse(why, whylen, "(layer %u, %s) wraps around the address space",
                                    w->layer, tname(w->tensor));
                        break;
                }
                uint32_t r = 0;
                while (r < nr && !(lo >= rg[r].addr && hi <= rg[r].addr + rg[r].bytes))
                        r++;
                if (r == nr) {
                        rc = refuse(why, whylen,
                                    "(layer %u, %s): its %llu blocks (0x%llx to 0x%llx) are not "
                                    "inside one region: "
                                    "give a region that covers them (the whole allocation), or "
                                    "check num_blocks "
                                    "and the block size (%llu bytes)",
                                    w->layer, tname(w->tensor), (unsigned long long)nb,
                                    (unsigned long long)lo, (unsigned long long)hi,
                                    (unsigned long long)bb);
                        break;
                }
                out[k] = (struct kvf_reg_placed){
                    .region = r, .off = lo - rg[r].addr, .stride = w->stride};
                sp[i] = (struct span){lo, hi, w->stride, i};
        }
        if (rc == 0) {
                qsort(sp, nv, sizeof(*sp), span_cmp);
                for (uint32_t i = 0; rc == 0 && i < nv; i++)
                        for (uint32_t j = i + 1; rc == 0 && j < nv && sp[j].lo < sp[i].hi; j++)
                                if (blocks_overlap(&sp[i], &sp[j], bb, nb)) {
                                        const struct kvf_reg_wire_view *a = &v[sp[i].view],
                                                                       *b = &v[sp[j].view];
                                        rc = refuse(why, whylen,
                                                    "(layer %u, %s) and (layer %u, %s) overlap: "
                                                    "their blocks share "
                                                    "memory%s",
                                                    a->layer, tname(a->tensor), b->layer,
                                                    tname(b->tensor),
                                                    a->stride != b->stride
                                                        ? " (or interleave with different block "
                                                          "strides, which is not supported)"
                                                        : "");
                                }
        }
        free(sp);
        free(seen);
        return rc;
}

void kvf_reg_uuid_str(const uint8_t u[16], char *out, size_t len)
{
        snprintf(out, len,
                 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                 u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
                 u[14], u[15]);
}

int kvf_reg_check_device(const struct kvf_ctl_header *h, int32_t device, const uint8_t uuid[16],
                         char *why, size_t whylen)
{
        char have[48], given[48];
        if (device < 0 && h->reg_gpu)
                return refuse(why, whylen,
                              "host memory given to instance '%s', whose engine caches are GPU "
                              "memory (up --caches engine --backend cuda): give tensors on its GPU",
                              h->instance);
        if (device < 0)
                return 0;
        if (!h->reg_gpu)
                return refuse(why, whylen,
                              "GPU memory (device %d) given to instance '%s', whose engine caches "
                              "are host memory: give host memory (kvferry.host_buffer), or start "
                              "the instance with --caches engine --backend cuda",
                              device, h->instance);
        if (memcmp(uuid, h->cuda_uuid, 16) != 0) {
                kvf_reg_uuid_str(h->cuda_uuid, have, sizeof(have));
                kvf_reg_uuid_str(uuid, given, sizeof(given));
                return refuse(why, whylen,
                              "the tensors are on %s (device %d of the engine), but instance '%s' "
                              "serves %s: give tensors on the instance's GPU (or start the "
                              "instance with that --device)",
                              given, device, h->instance, have);
        }
        return 0;
}

/* ---- a role's mapping ---- */

struct reg_map {
        uint32_t n;
        uint8_t *map[KVF_FDPASS_MAX]; /* as mmap gave them */
        uint64_t len[KVF_FDPASS_MAX];
};

bool kvf_reg_stale(const struct kvf_ctl_header *h, const struct kvf_cache *c)
{
        return kvf_load_acquire(&h->reg_generation) != c->reg_gen;
}

void kvf_reg_unmap(struct kvf_cache *c)
{
        if (c->priv && !c->host && c->device >= 0) {
#ifdef KVF_HAVE_CUDA
                kvf_cache_cuda_reg_unmap(c); /* closes the IPC opens, frees priv */
#endif
                c->priv = NULL;
        }
        struct reg_map *m = c->priv;
        if (m)
                for (uint32_t i = 0; i < m->n; i++)
                        munmap(m->map[i], m->len[i]);
        free(m);
        free(c->parts);
        free(c->strides);
        c->priv = NULL;
        c->parts = NULL;
        c->strides = NULL;
        c->n_parts = 0;
        c->host = false;
}

int kvf_reg_map(const struct kvf_ctl_header *h, bool writable, struct kvf_cache *out)
{
        const struct kvf_cache_layout *L = &h->layout;
        uint32_t want = kvf_layout_layers(L) * kvf_layout_tensors(L);
        char name[160];
        int fds[KVF_FDPASS_MAX];
        unsigned nfds = 0;
        uint8_t *buf = NULL;
        struct reg_map *m = NULL;
        int rc, s = -1;
        int near = out->device; /* a peer's caches: the device whose kernels copy into them */

        out->device = -1;
        out->reg_hdr = h;
        out->reg_gen = kvf_load_acquire(&h->reg_generation);
        if (!(out->reg_gen & 1))
                return 0; /* waiting for the engine's caches: nothing to map */
        if ((rc = kvf_reg_sock_name(h, name, sizeof(name))) < 0)
                return rc;
        if ((s = kvf_fdpass_connect(name, 2000)) < 0)
                return kvf_err_ctx(s,
                                   "the allocator of '%s' does not answer for the engine's caches",
                                   h->instance);
        struct kvf_reg_msg q = {.op = KVF_REG_FETCH};
        if ((rc = kvf_fdpass_send(s, &q, sizeof(q), NULL, 0)) < 0)
                goto out;
        if (!(buf = malloc(KVF_REG_MSG_MAX)) || !(m = calloc(1, sizeof(*m)))) {
                rc = kvf_err_set(-ENOMEM, "out of memory");
                goto out;
        }
        ssize_t n = kvf_fdpass_recv(s, buf, KVF_REG_MSG_MAX, fds, KVF_FDPASS_MAX, &nfds);
        if (n < 0) {
                rc = (int)n;
                goto out;
        }
        struct kvf_reg_msg a;
        if ((size_t)n < sizeof(a)) {
                rc = kvf_err_set(-EPROTO, "a short answer (%zd bytes) from the allocator of '%s'",
                                 n, h->instance);
                goto out;
        }
        memcpy(&a, buf, sizeof(a));
        a.why[sizeof(a.why) - 1] = 0;
        if (a.err == -EAGAIN) { /* dropped since the header said otherwise */
                out->reg_gen = a.generation;
                rc = 0;
                goto out;
        }
        if (a.err < 0) {
                rc = kvf_err_set(a.err, "the engine's caches of '%s': %s", h->instance, a.why);
                goto out;
        }
        bool gpu = a.device >= 0;
        size_t need = sizeof(a) + (size_t)a.n_regions * sizeof(struct kvf_reg_wire_region) +
                      (size_t)want * sizeof(struct kvf_reg_placed) +
                      (gpu ? (size_t)a.n_regions * KVF_REG_HANDLE_SIZE : 0);
        /* (GPU memory: the allocations' dma-bufs come along when its engine exported them) */
        if (a.n_regions == 0 || a.n_regions > KVF_FDPASS_MAX || (nfds != a.n_regions && !(gpu && nfds == 0)) ||
            a.n_views != want || (size_t)n != need) {
                rc = kvf_err_set(
                    -EPROTO,
                    "the allocator of '%s' answered %u regions with %u descriptors and %u "
                    "views in %zd bytes (want %u views)",
                    h->instance, a.n_regions, nfds, a.n_views, n, want);
                goto out;
        }
        const struct kvf_reg_wire_region *rg = (const void *)(buf + sizeof(a));
        const struct kvf_reg_placed *pl = (const void *)(rg + a.n_regions);
        for (uint32_t k = 0; k < want; k++) {
                /* Hostile input, however trusted the allocator: every block inside its region. */
                if (pl[k].region >= a.n_regions || pl[k].stride < L->block_bytes ||
                    pl[k].off + (L->num_blocks - 1) * pl[k].stride + L->block_bytes >
                        rg[pl[k].region].bytes) {
                        rc = kvf_err_set(-EPROTO,
                                         "the allocator of '%s' placed view %u outside its region",
                                         h->instance, k);
                        goto out;
                }
        }
        if (gpu) {
                free(m); /* (the host mappings' record) */
                m = NULL;
#ifdef KVF_HAVE_CUDA
                const uint8_t *handles = (const uint8_t *)(pl + want);
                if ((rc = kvf_cache_cuda_reg_map(h, near, handles, rg, a.n_regions, pl, want, nfds ? fds : NULL,
                                                 out)) == 0)
                        out->reg_gen = a.generation;
#else
                (void)near;
                rc = kvf_err_set(-ENOTSUP,
                                 "the engine's caches of '%s' are GPU memory and this build has no "
                                 "CUDA",
                                 h->instance);
#endif
                goto out;
        }
        long page = sysconf(_SC_PAGESIZE);
        uint8_t *base[KVF_FDPASS_MAX];
        int prot = PROT_READ | (writable ? PROT_WRITE : 0);
        for (uint32_t i = 0; i < a.n_regions; i++) {
                uint64_t al = rg[i].fd_offset & ~(uint64_t)(page - 1), skip = rg[i].fd_offset - al;
                void *p = mmap(NULL, rg[i].bytes + skip, prot, MAP_SHARED, fds[i], (off_t)al);
                if (p == MAP_FAILED) {
                        rc = kvf_err_set(
                            -ENOMEM,
                            "map region %u of the engine's caches of '%s' (%llu bytes): %s", i,
                            h->instance, (unsigned long long)rg[i].bytes, strerror(errno));
                        goto out;
                }
                m->map[m->n] = p;
                m->len[m->n++] = rg[i].bytes + skip;
                base[i] = (uint8_t *)p + skip;
        }
        if (!(out->parts = calloc(want, sizeof(*out->parts))) ||
            !(out->strides = calloc(want, sizeof(uint64_t)))) {
                rc = kvf_err_set(-ENOMEM, "out of memory");
                goto out;
        }
        bool strided = false;
        for (uint32_t k = 0; k < want; k++) {
                out->parts[k] = base[pl[k].region] + pl[k].off;
                out->strides[k] = pl[k].stride;
                strided |= pl[k].stride != L->block_bytes;
        }
        if (!strided) {
                free(out->strides);
                out->strides = NULL;
        }
        out->n_parts = want;
        out->priv = m;
        out->host = true;
        out->reg_gen = a.generation;
        m = NULL;
        rc = 0;
out:
        if (m) {
                out->priv = m;
                kvf_reg_unmap(out);
        }
        for (unsigned i = 0; i < nfds; i++)
                close(fds[i]); /* the mappings keep the memory */
        free(buf);
        if (s >= 0)
                close(s);
        return rc;
}
