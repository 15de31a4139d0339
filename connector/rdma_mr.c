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
 * (tests/gpu_rdma_reg_test.c).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "err.h"
#include "rdma.h"

struct ibv_mr *rdma_reg_cache(struct ibv_pd *pd, struct kvf_cache *c, int access, const char **how)
{
        const char *dev = ibv_get_device_name(pd->context->device);
        struct ibv_mr *mr;
        char dmabuf_why[200] = "";

        if (c->parts) { /* one allocation per tensor: a region here would span unrelated memory */
                kvf_err_set(-EOPNOTSUPP, "the cache on %s is one GPU allocation per tensor (made for "
                            "FastDeploy's workers): rdma needs one; tcp carries it", dev);
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
