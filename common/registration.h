/*
 * The engine's caches (backend "engine"): what goes between the engine's
 * client, the allocator that holds the registration, and the roles that map
 * it. All of it travels over the allocator's registration socket (fdpass.h),
 * an abstract name made of the user, the instance and its creation time:
 *
 *   client -> allocator   REGISTER: regions (with their descriptors) and views
 *                         UNREGISTER
 *   role   -> allocator   FETCH: the allocator answers with the regions'
 *                         descriptors and every (layer, tensor) placed in them
 *
 * Every message starts with struct kvf_reg_msg; `err` < 0 in an answer is
 * -errno with `why`.
 *
 * GPU memory (an instance whose header says reg_gpu: up --caches engine
 * --backend cuda): a region is one allocation of the engine's (cudaMalloc'd,
 * as PyTorch's caching allocator makes them: tensors are sub-ranges of it),
 * named by its CUDA IPC handle instead of a descriptor. REGISTER and the
 * FETCH answer carry n_regions handles of KVF_REG_HANDLE_SIZE bytes after
 * everything else, `device` >= 0 and `uuid` the GPU's; no descriptor travels.
 * Each process opens each handle once and places the views at opened base +
 * offset, so tensors that share an allocation share one open.
 */
#ifndef KVF_REGISTRATION_H
#define KVF_REGISTRATION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shm_layout.h"

struct kvf_cache;

enum kvf_reg_op {
        KVF_REG_REGISTER = 1,
        KVF_REG_UNREGISTER = 2,
        KVF_REG_FETCH = 3,
};

struct kvf_reg_msg {
        uint32_t op; /* enum kvf_reg_op */
        int32_t err; /* answers: 0, or -errno and why */
        uint32_t n_regions;
        uint32_t n_views;
        uint32_t token_major;
        int32_t device;      /* -1 host; else GPU memory (the number the sender used) */
        uint64_t generation; /* answers: the registration's (header reg_generation) */
        uint8_t uuid[16];    /* device >= 0: the UUID of the GPU holding every region */
        char why[KVF_REASON_MAX];
};

/* REGISTER: n_regions of these (their descriptors in the same order), then n_views views. */
struct kvf_reg_wire_region {
        uint64_t addr; /* in the registering process (0 in a FETCH answer) */
        uint64_t bytes;
        uint64_t fd_offset;
};
struct kvf_reg_wire_view {
        uint32_t layer, tensor;
        uint64_t addr; /* in the registering process */
        uint64_t stride;
};
/* FETCH answer: n_regions regions, then layers x tensors of these, in kvf_layout_offset order. */
struct kvf_reg_placed {
        uint32_t region;
        uint32_t pad;
        uint64_t off;    /* of block 0, in the region */
        uint64_t stride; /* between blocks */
};

/* A region of GPU memory: its CUDA IPC handle (cudaIpcMemHandle_t). */
#define KVF_REG_HANDLE_SIZE 64u

/* Views a registration holds at most (every layer's K and V). */
#define KVF_REG_MAX_VIEWS (2u * KVF_MAX_LAYERS)
/* The largest message: header, regions, views, handles. */
#define KVF_REG_MSG_MAX                                                                            \
        (sizeof(struct kvf_reg_msg) + 250u * sizeof(struct kvf_reg_wire_region) +                  \
         KVF_REG_MAX_VIEWS * sizeof(struct kvf_reg_wire_view) + 250u * KVF_REG_HANDLE_SIZE)

/* The allocator's socket name for the instance of header h. */
int kvf_reg_sock_name(const struct kvf_ctl_header *h, char *out, size_t len);

/*
 * Check a registration against layout L: fd_size[i] is the size of region i's
 * file. Fills out[layers x tensors] (kvf_layout_offset order). 0, or -EINVAL
 * with `why` saying what is wrong and what to change. Pure: no system call.
 */
int kvf_reg_validate(const struct kvf_cache_layout *L, const struct kvf_reg_wire_region *rg,
                     uint32_t nr, const uint64_t *fd_size, const struct kvf_reg_wire_view *v,
                     uint32_t nv, struct kvf_reg_placed *out, bool *strided, char *why,
                     size_t whylen);

/*
 * Whether memory of this kind may be registered with the instance of header h:
 * host memory (device < 0) with an instance of host caches, GPU memory with an
 * instance of GPU caches whose GPU is `uuid`. 0, or -EINVAL with `why` naming
 * what was given, what the instance takes and what to change. Pure.
 */
int kvf_reg_check_device(const struct kvf_ctl_header *h, int32_t device, const uint8_t uuid[16],
                         char *why, size_t whylen);

/* "GPU-xxxxxxxx-xxxx-...", as nvidia-smi writes a UUID. */
void kvf_reg_uuid_str(const uint8_t u[16], char *out, size_t len);

/*
 * A role: map the registration the allocator of header h holds (FETCH) into out,
 * which kvf_cache_map set up (be, layout). While the instance waits for the
 * engine's caches, out is left empty (no parts: kvf_cache_addr gives NULL) with
 * out->reg_gen = the (even) generation: 0 either way, -errno when the allocator
 * cannot be asked or a region cannot be mapped.
 */
int kvf_reg_map(const struct kvf_ctl_header *h, bool writable, struct kvf_cache *out);
void kvf_reg_unmap(struct kvf_cache *c);

/* Whether a mapping of an engine's caches is behind the registration the header names now. */
bool kvf_reg_stale(const struct kvf_ctl_header *h, const struct kvf_cache *c);

#endif
