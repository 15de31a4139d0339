/*
 * kvf_register_caches: the engine's own caches handed to an instance started
 * with `--caches engine` (common/registration.h says what goes where). The
 * allocator checks them and holds the registration; this file only packs it.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "abi.h"
#include "client.h"
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
        if (r->device >= 0)
                return kvf_err_set(
                    -ENOTSUP,
                    "register caches: GPU memory (device %d): this instance takes the "
                    "engine's host memory only",
                    r->device);
        if (r->n_regions == 0 || r->n_regions > KVF_FDPASS_MAX || !r->regions)
                return kvf_err_set(-EINVAL, "register caches: %u regions: give 1 to %u",
                                   r->n_regions, KVF_FDPASS_MAX);
        if (r->n_views == 0 || r->n_views > KVF_REG_MAX_VIEWS || !r->views)
                return kvf_err_set(
                    -EINVAL, "register caches: %u views: give one per (layer, tensor), at most %u",
                    r->n_views, KVF_REG_MAX_VIEWS);
        int fds[KVF_FDPASS_MAX];
        for (uint32_t i = 0; i < r->n_regions; i++) {
                if (r->regions[i].fd < 0)
                        return kvf_err_set(
                            -EINVAL,
                            "register caches: region %u has no descriptor: foreign memory; "
                            "host memory is shared as a file (a memfd or a /dev/shm file; Python: "
                            "kvferry.host_buffer)",
                            i);
                fds[i] = r->regions[i].fd;
        }
        size_t len = sizeof(struct kvf_reg_msg) +
                     r->n_regions * sizeof(struct kvf_reg_wire_region) +
                     r->n_views * sizeof(struct kvf_reg_wire_view);
        uint8_t *buf = calloc(1, len);
        if (!buf)
                return kvf_err_set(-ENOMEM, "out of memory");
        struct kvf_reg_msg q = {.op = KVF_REG_REGISTER,
                                .n_regions = r->n_regions,
                                .n_views = r->n_views,
                                .token_major = r->token_major ? 1 : 0,
                                .device = -1};
        memcpy(buf, &q, sizeof(q));
        struct kvf_reg_wire_region *rg = (void *)(buf + sizeof(q));
        struct kvf_reg_wire_view *v = (void *)(rg + r->n_regions);
        for (uint32_t i = 0; i < r->n_regions; i++)
                rg[i] =
                    (struct kvf_reg_wire_region){.addr = (uint64_t)(uintptr_t)r->regions[i].addr,
                                                 .bytes = r->regions[i].bytes,
                                                 .fd_offset = r->regions[i].fd_offset};
        for (uint32_t i = 0; i < r->n_views; i++)
                v[i] = (struct kvf_reg_wire_view){.layer = r->views[i].layer,
                                                  .tensor = r->views[i].tensor,
                                                  .addr = (uint64_t)(uintptr_t)r->views[i].addr,
                                                  .stride = r->views[i].block_stride};
        struct kvf_reg_msg a = {0};
        rc = ask(c, buf, len, fds, r->n_regions, &a);
        free(buf);
        if (rc < 0)
                return kvf_err_ctx(rc, "register caches with '%s'", h->instance);
        if (a.err < 0)
                return kvf_err_set(a.err, "register caches with '%s': %s", h->instance, a.why);
        c->registered = true;
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
        return 0;
}
