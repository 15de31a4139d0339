/*
 * Errors, devices, caches (cudaMalloc + IPC handles), peer access and the
 * layer-done signals.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda.h> /* types and enums of cuStreamWriteValue64 only: libcuda is never linked */
#include <cuda_runtime.h>

#include "atomics.h"
#include "internal.h"

static_assert(sizeof(cudaIpcMemHandle_t) == KVF_GPU_IPC_HANDLE_SIZE, "IPC handle size");

/* ---------------------------------------------------------------- errors */

static thread_local char err_buf[512];

extern "C" const char *kvf_gpu_err_msg(void)
{
        return err_buf;
}

int kvf_gpu_err_set(int rc, const char *fmt, ...)
{
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err_buf, sizeof(err_buf), fmt, ap);
        va_end(ap);
        return rc;
}

int kvf_gpu_err_cuda(cudaError_t e, const char *what)
{
        kvf_gpu_err_set(e == cudaErrorMemoryAllocation ? -ENOMEM : -EIO, "%s: %s (%s)", what,
                        cudaGetErrorString(e), cudaGetErrorName(e));
        /* Reset the runtime's per-thread error slot (a no-op for sticky errors,
         * which every later call reports anyway). */
        (void)cudaGetLastError();
        return e == cudaErrorMemoryAllocation ? -ENOMEM : -EIO;
}

int kvf_gpu_device_enter(int device, int *prev)
{
        int cur;
        cudaError_t e;

        *prev = -1;
        if ((e = cudaGetDevice(&cur)) != cudaSuccess)
                return kvf_gpu_err_cuda(e, "cudaGetDevice");
        if (cur == device)
                return 0;
        if ((e = cudaSetDevice(device)) != cudaSuccess) {
                char what[48];
                snprintf(what, sizeof(what), "cudaSetDevice(%d)", device);
                return kvf_gpu_err_cuda(e, what);
        }
        *prev = cur;
        return 0;
}

void kvf_gpu_device_leave(int prev)
{
        if (prev >= 0)
                (void)cudaSetDevice(prev);
}

/* ---------------------------------------------------------------- devices */

extern "C" int kvf_gpu_device_count(void)
{
        int n = 0;
        cudaError_t e = cudaGetDeviceCount(&n);
        if (e != cudaSuccess) {
                kvf_gpu_err_cuda(e, "cudaGetDeviceCount");
                return 0;
        }
        if (n == 0)
                kvf_gpu_err_set(0, "cudaGetDeviceCount: no device");
        return n;
}

extern "C" int kvf_gpu_current_device(void)
{
        int d = 0;
        cudaError_t e = cudaGetDevice(&d);
        return e == cudaSuccess ? d : kvf_gpu_err_cuda(e, "cudaGetDevice");
}

extern "C" int kvf_gpu_device_uuid(int device, uint8_t uuid[16])
{
        cudaDeviceProp p;
        cudaError_t e = cudaGetDeviceProperties(&p, device);
        if (e != cudaSuccess)
                return kvf_gpu_err_cuda(e, "cudaGetDeviceProperties");
        static_assert(sizeof(p.uuid.bytes) == 16, "uuid size");
        memcpy(uuid, p.uuid.bytes, 16);
        return 0;
}

extern "C" int kvf_gpu_device_by_uuid(const uint8_t uuid[16])
{
        int n = kvf_gpu_device_count();
        for (int d = 0; d < n; d++) {
                uint8_t u[16];
                int rc = kvf_gpu_device_uuid(d, u);
                if (rc < 0)
                        return rc;
                if (!memcmp(u, uuid, 16))
                        return d;
        }
        return kvf_gpu_err_set(-ENODEV, "no visible device has that UUID (%d devices)", n);
}

extern "C" int kvf_gpu_device_sms(int device)
{
        int v = 0;
        cudaError_t e = cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device);
        if (e != cudaSuccess)
                return kvf_gpu_err_cuda(e, "multiprocessor count");
        return v;
}

extern "C" int kvf_gpu_mps_enabled(int device)
{
        int v = 0;
        cudaError_t e = cudaDeviceGetAttribute(&v, cudaDevAttrMpsEnabled, device);
        if (e != cudaSuccess)
                return kvf_gpu_err_cuda(e, "cudaDevAttrMpsEnabled");
        return v != 0;
}

/* ---------------------------------------------------------------- caches */

extern "C" int kvf_gpu_alloc(int device, uint64_t bytes, void **out)
{
        int prev, rc;
        if (!out || !bytes)
                return kvf_gpu_err_set(-EINVAL, "alloc: nothing to allocate");
        *out = NULL;
        if ((rc = kvf_gpu_device_enter(device, &prev)) < 0)
                return rc;
        cudaError_t e = cudaMalloc(out, bytes);
        kvf_gpu_device_leave(prev);
        if (e != cudaSuccess) {
                char what[80];
                snprintf(what, sizeof(what), "cudaMalloc(%llu bytes) on GPU %d",
                         (unsigned long long)bytes, device);
                return kvf_gpu_err_cuda(e, what);
        }
        return 0;
}

extern "C" int kvf_gpu_free(int device, void *ptr)
{
        int prev, rc;
        if (!ptr)
                return 0;
        if ((rc = kvf_gpu_device_enter(device, &prev)) < 0)
                return rc;
        cudaError_t e = cudaFree(ptr);
        kvf_gpu_device_leave(prev);
        return e == cudaSuccess ? 0 : kvf_gpu_err_cuda(e, "cudaFree");
}

extern "C" int kvf_gpu_ipc_export(void *ptr, uint8_t handle[KVF_GPU_IPC_HANDLE_SIZE])
{
        cudaIpcMemHandle_t h;
        cudaError_t e = cudaIpcGetMemHandle(&h, ptr);
        if (e != cudaSuccess)
                return kvf_gpu_err_cuda(e, "cudaIpcGetMemHandle");
        memcpy(handle, &h, sizeof(h));
        return 0;
}

extern "C" int kvf_gpu_peer_enable(int device, int peer)
{
        int can = 0, prev, rc;
        cudaError_t e;

        if (device == peer)
                return 0;
        if ((e = cudaDeviceCanAccessPeer(&can, device, peer)) != cudaSuccess)
                return kvf_gpu_err_cuda(e, "cudaDeviceCanAccessPeer");
        if (!can)
                return kvf_gpu_err_set(-EXDEV,
                                       "GPU %d cannot access GPU %d's memory directly (no "
                                       "peer-to-peer path)",
                                       device, peer);
        if ((rc = kvf_gpu_device_enter(device, &prev)) < 0)
                return rc;
        e = cudaDeviceEnablePeerAccess(peer, 0);
        kvf_gpu_device_leave(prev);
        if (e == cudaErrorPeerAccessAlreadyEnabled) {
                (void)cudaGetLastError();
                return 0;
        }
        if (e != cudaSuccess) {
                char what[64];
                snprintf(what, sizeof(what), "cudaDeviceEnablePeerAccess(GPU %d -> GPU %d)", device,
                         peer);
                return kvf_gpu_err_cuda(e, what);
        }
        return 0;
}

extern "C" int kvf_gpu_ipc_open(int device, const uint8_t handle[KVF_GPU_IPC_HANDLE_SIZE],
                                void **out, int *owner_device)
{
        cudaIpcMemHandle_t h;
        cudaPointerAttributes a;
        void *p = NULL;
        int prev, rc;
        cudaError_t e;

        if (!out)
                return kvf_gpu_err_set(-EINVAL, "ipc open: no output");
        *out = NULL;
        memcpy(&h, handle, sizeof(h));
        if ((rc = kvf_gpu_device_enter(device, &prev)) < 0)
                return rc;
        /* Lazy peer access: CUDA enables it on the first use if the memory is on
         * another device; kvf_gpu_peer_enable below makes it explicit and turns
         * "impossible" into -EXDEV now rather than a fault in a kernel later. */
        e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
        if (e != cudaSuccess) {
                kvf_gpu_device_leave(prev);
                return kvf_gpu_err_cuda(e, "cudaIpcOpenMemHandle");
        }
        if ((e = cudaPointerGetAttributes(&a, p)) != cudaSuccess) {
                rc = kvf_gpu_err_cuda(e, "cudaPointerGetAttributes of the opened handle");
                goto fail;
        }
        if (a.device != device && (rc = kvf_gpu_peer_enable(device, a.device)) < 0)
                goto fail;
        kvf_gpu_device_leave(prev);
        if (owner_device)
                *owner_device = a.device;
        *out = p;
        return 0;
fail:
        (void)cudaIpcCloseMemHandle(p);
        kvf_gpu_device_leave(prev);
        return rc;
}

extern "C" int kvf_gpu_ipc_close(int device, void *ptr)
{
        int prev, rc;
        if (!ptr)
                return 0;
        if ((rc = kvf_gpu_device_enter(device, &prev)) < 0)
                return rc;
        cudaError_t e = cudaIpcCloseMemHandle(ptr);
        kvf_gpu_device_leave(prev);
        return e == cudaSuccess ? 0 : kvf_gpu_err_cuda(e, "cudaIpcCloseMemHandle");
}

/* ---------------------------------------------------------------- plain copies and host memory */

extern "C" int kvf_gpu_memcpy(int device, void *dst, const void *src, uint64_t bytes)
{
        int prev, rc;
        if (!bytes)
                return 0;
        if (!dst || !src)
                return kvf_gpu_err_set(-EINVAL, "memcpy: NULL pointer");
        if ((rc = kvf_gpu_device_enter(device, &prev)) < 0)
                return rc;
        cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);
        kvf_gpu_device_leave(prev);
        return e == cudaSuccess ? 0 : kvf_gpu_err_cuda(e, "cudaMemcpy");
}

extern "C" int kvf_gpu_memset(int device, void *ptr, int value, uint64_t bytes)
{
        int prev, rc;
        if (!bytes)
                return 0;
        if ((rc = kvf_gpu_device_enter(device, &prev)) < 0)
                return rc;
        cudaError_t e = cudaMemset(ptr, value, bytes);
        if (e == cudaSuccess)
                e = cudaDeviceSynchronize();
        kvf_gpu_device_leave(prev);
        return e == cudaSuccess ? 0 : kvf_gpu_err_cuda(e, "cudaMemset");
}

extern "C" int kvf_gpu_host_alloc(uint64_t bytes, void **out)
{
        if (!out || !bytes)
                return kvf_gpu_err_set(-EINVAL, "host alloc: nothing to allocate");
        *out = NULL;
        cudaError_t e = cudaHostAlloc(out, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
        if (e != cudaSuccess) {
                *out = NULL;
                return kvf_gpu_err_cuda(e, "cudaHostAlloc");
        }
        return 0;
}

extern "C" void kvf_gpu_host_free(void *ptr)
{
        if (ptr && cudaFreeHost(ptr) != cudaSuccess)
                (void)cudaGetLastError();
}

/* ---------------------------------------------------------------- layer-done signals */

#define HOSTFN_SLOTS 1024u

typedef CUresult (*write_value64_fn)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
typedef CUresult (*dev_attr_fn)(int *, CUdevice_attribute, CUdevice);
typedef CUresult (*err_string_fn)(CUresult, const char **);

/* A driver API function by name, through the runtime (no link against libcuda).
 * 12000: the CUDA 12 ABI of the symbol (cuStreamWriteValue64 is then _v2). */
static int driver_fn(const char *name, void **fp)
{
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        *fp = NULL;
        cudaError_t e = cudaGetDriverEntryPointByVersion(name, fp, 12000, cudaEnableDefault, &q);
        if (e != cudaSuccess)
                return kvf_gpu_err_cuda(e, "cudaGetDriverEntryPointByVersion");
        if (q != cudaDriverEntryPointSuccess || !*fp)
                return kvf_gpu_err_set(-ENOSYS, "the driver has no %s (query result %d)", name,
                                       (int)q);
        return 0;
}

static const char *cu_err_string(CUresult r)
{
        void *fp = NULL;
        const char *s = NULL;
        if (driver_fn("cuGetErrorString", &fp) == 0 && ((err_string_fn)fp)(r, &s) == CUDA_SUCCESS &&
            s)
                return s;
        return "unknown driver error";
}

/* ---------------------------------------------------------------- GPUDirect RDMA */

typedef CUresult (*range_handle_fn)(void *, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long);

extern "C" int kvf_gpu_dmabuf_export(int device, void *ptr, uint64_t bytes, int *fd)
{
        int prev, rc, can = 0;
        void *fp;
        *fd = -1;
        if (!ptr || !bytes || ((uintptr_t)ptr | bytes) % 4096)
                return kvf_gpu_err_set(-EINVAL, "dma-buf: [%p, +%llu) is not page-aligned device memory", ptr,
                                       (unsigned long long)bytes);
        if ((rc = kvf_gpu_device_enter(device, &prev)) < 0)
                return rc;
        if ((rc = driver_fn("cuDeviceGetAttribute", &fp)) < 0) {
                kvf_gpu_device_leave(prev);
                return rc == -ENOSYS ? -ENOTSUP : rc;
        }
        CUresult r = ((dev_attr_fn)fp)(&can, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, (CUdevice)device);
        if (r != CUDA_SUCCESS || !can) {
                kvf_gpu_device_leave(prev);
                return kvf_gpu_err_set(-ENOTSUP, "GPU %d: the driver offers no dma-buf export of device "
                                       "memory (%s)", device,
                                       r != CUDA_SUCCESS ? cu_err_string(r)
                                                         : "it needs the open kernel module and Linux 5.12 or later");
        }
        if ((rc = driver_fn("cuMemGetHandleForAddressRange", &fp)) < 0) {
                kvf_gpu_device_leave(prev);
                return rc == -ENOSYS ? -ENOTSUP : rc;
        }
        int out = -1;
        r = ((range_handle_fn)fp)(&out, (CUdeviceptr)(uintptr_t)ptr, bytes,
                                           CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
        kvf_gpu_device_leave(prev);
        if (r != CUDA_SUCCESS || out < 0)
                return kvf_gpu_err_set(r == CUDA_ERROR_NOT_SUPPORTED ? -ENOTSUP : -EIO,
                                       "cuMemGetHandleForAddressRange(dma-buf, %llu bytes) on GPU %d: %s",
                                       (unsigned long long)bytes, device, cu_err_string(r));
        *fd = out;
        return 0;
}

/* ---------------------------------------------------------------- an engine's allocations */

typedef CUresult (*addr_range_fn)(CUdeviceptr *, size_t *, CUdeviceptr);
typedef CUresult (*retain_fn)(CUmemGenericAllocationHandle *, void *);
typedef CUresult (*release_fn)(CUmemGenericAllocationHandle);

extern "C" int kvf_gpu_mem_range(const void *ptr, uint64_t *base, uint64_t *bytes, int *device, int *vmm)
{
        cudaPointerAttributes a;
        void *fr, *fret, *frel;
        int rc;
        cudaError_t e = cudaPointerGetAttributes(&a, ptr);
        if (e != cudaSuccess)
                return kvf_gpu_err_cuda(e, "cudaPointerGetAttributes");
        if (a.type != cudaMemoryTypeDevice)
                return kvf_gpu_err_set(-EINVAL, "%p is not device memory (%s)", ptr,
                                       a.type == cudaMemoryTypeManaged ? "managed memory"
                                       : a.type == cudaMemoryTypeHost  ? "pinned host memory"
                                                                       : "not known to CUDA");
        if ((rc = driver_fn("cuMemGetAddressRange", &fr)) < 0 ||
            (rc = driver_fn("cuMemRetainAllocationHandle", &fret)) < 0 ||
            (rc = driver_fn("cuMemRelease", &frel)) < 0)
                return rc;
        int prev;
        if ((rc = kvf_gpu_device_enter(a.device, &prev)) < 0)
                return rc;
        CUdeviceptr b = 0;
        size_t n = 0;
        CUresult r = ((addr_range_fn)fr)(&b, &n, (CUdeviceptr)(uintptr_t)ptr);
        if (r != CUDA_SUCCESS) {
                kvf_gpu_device_leave(prev);
                return kvf_gpu_err_set(-EINVAL, "cuMemGetAddressRange(%p): %s", ptr, cu_err_string(r));
        }
        /* Only memory mapped through the virtual memory management API has an allocation
         * handle to retain; cudaMalloc'd memory has none. */
        CUmemGenericAllocationHandle h;
        r = ((retain_fn)fret)(&h, (void *)(uintptr_t)b);
        if (r == CUDA_SUCCESS)
                ((release_fn)frel)(h);
        kvf_gpu_device_leave(prev);
        *base = (uint64_t)b;
        *bytes = (uint64_t)n;
        *device = a.device;
        *vmm = r == CUDA_SUCCESS;
        return 0;
}

extern "C" int kvf_gpu_device_sync(int device)
{
        int prev, rc;
        if ((rc = kvf_gpu_device_enter(device, &prev)) < 0)
                return rc;
        cudaError_t e = cudaDeviceSynchronize();
        kvf_gpu_device_leave(prev);
        return e == cudaSuccess ? 0 : kvf_gpu_err_cuda(e, "cudaDeviceSynchronize");
}

extern "C" int kvf_gpu_rdma_flush(int device)
{
        int prev, rc;
        if ((rc = kvf_gpu_device_enter(device, &prev)) < 0)
                return rc;
        cudaError_t e = cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                                                           cudaFlushGPUDirectRDMAWritesToOwner);
        kvf_gpu_device_leave(prev);
        return e == cudaSuccess ? 0 : kvf_gpu_err_cuda(e, "cudaDeviceFlushGPUDirectRDMAWrites");
}

struct hostfn_slot {
        struct kvf_gpu_signal *s;
        uint64_t *word;
        uint64_t value;
};

struct kvf_gpu_signal {
        int device;
        int method;
        uint64_t *word;
        size_t span;        /* bytes from `word` that posts may store into */
        uint64_t *dev_word; /* device address of the mapped word (WRITE_VALUE, KERNEL) */
        void *registered;   /* pages registered here, unregistered at destroy; or NULL */
        void (*wake)(void *);
        void *wake_arg;
        write_value64_fn write64;
        uint64_t posted; /* host functions queued (the posting thread only) */
        uint64_t ran;    /* host functions finished (CUDA's callback thread) */
        struct hostfn_slot slots[HOSTFN_SLOTS];
};

extern "C" const char *kvf_gpu_signal_method_name(int method)
{
        switch (method) {
        case KVF_GPU_SIGNAL_HOST_FN:
                return "hostfn";
        case KVF_GPU_SIGNAL_WRITE_VALUE:
                return "writevalue";
        case KVF_GPU_SIGNAL_KERNEL:
                return "kernel";
        default:
                return "?";
        }
}

static void CUDART_CB signal_hostfn(void *arg)
{
        struct hostfn_slot *slot = (struct hostfn_slot *)arg;
        struct kvf_gpu_signal *s = slot->s;
        /* The stream's earlier work is complete when CUDA calls us. Release:
         * pairs with the waiter's acquire load of the word. */
        kvf_store_release(slot->word, slot->value);
        if (s->wake)
                s->wake(s->wake_arg);
        /* Release: the slot may be reused once the poster's acquire load of
         * `ran` sees this (we no longer read it). */
        kvf_fetch_add_acq_rel(&s->ran, 1);
}

__global__ void kvf_signal_kernel(uint64_t *word, uint64_t value)
{
        /* System-scope release: the host sees the value only after everything
         * this thread saw, and the kernel starts only after the stream's earlier
         * work ended. */
        asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(word), "l"(value) : "memory");
}

static int map_word(struct kvf_gpu_signal *s)
{
        uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
        uintptr_t first = (uintptr_t)s->word & ~(pg - 1);
        uintptr_t end = ((uintptr_t)s->word + s->span + pg - 1) & ~(pg - 1);
        void *page = (void *)first;
        cudaError_t e = cudaHostRegister(page, (size_t)(end - first),
                                         cudaHostRegisterMapped | cudaHostRegisterPortable);
        if (e == cudaSuccess) {
                s->registered = page;
        } else if (e == cudaErrorHostMemoryAlreadyRegistered) {
                (void)cudaGetLastError(); /* the caller registered it: use that */
        } else {
                return kvf_gpu_err_cuda(e, "cudaHostRegister of the signal word's pages");
        }
        void *dp = NULL, *dl = NULL;
        e = cudaHostGetDevicePointer(&dp, s->word, 0);
        if (e != cudaSuccess)
                return kvf_gpu_err_cuda(e, "cudaHostGetDevicePointer of the signal word "
                                           "(registered without cudaHostRegisterMapped?)");
        /* A span the caller registered in pieces has no one device address range. */
        uint64_t *last = s->word + (s->span / 8 - 1);
        if (last != s->word && (cudaHostGetDevicePointer(&dl, last, 0) != cudaSuccess ||
                                (char *)dl - (char *)dp != (char *)last - (char *)s->word)) {
                (void)cudaGetLastError();
                return kvf_gpu_err_set(-EINVAL, "signal: the %zu bytes of its words are not one registered mapping",
                                       s->span);
        }
        s->dev_word = (uint64_t *)dp;
        return 0;
}

extern "C" int kvf_gpu_signal_create(int device, uint64_t *word, int method, void (*wake)(void *),
                                     void *wake_arg, struct kvf_gpu_signal **out)
{
        return kvf_gpu_signal_create_span(device, word, sizeof(*word), method, wake, wake_arg, out);
}

extern "C" int kvf_gpu_signal_create_span(int device, uint64_t *word, size_t span, int method,
                                          void (*wake)(void *), void *wake_arg, struct kvf_gpu_signal **out)
{
        struct kvf_gpu_signal *s;
        int prev, rc;

        if (!out)
                return kvf_gpu_err_set(-EINVAL, "signal: no output");
        *out = NULL;
        if (!word || ((uintptr_t)word & 7u))
                return kvf_gpu_err_set(-EINVAL, "signal: the word must be 8-byte aligned");
        if (span < sizeof(*word) || span > ((size_t)1 << 40))
                return kvf_gpu_err_set(-EINVAL, "signal: a span of %zu bytes", span);
        if (method != KVF_GPU_SIGNAL_HOST_FN && method != KVF_GPU_SIGNAL_WRITE_VALUE &&
            method != KVF_GPU_SIGNAL_KERNEL)
                return kvf_gpu_err_set(-EINVAL, "signal: unknown method %d", method);
        if (wake && method != KVF_GPU_SIGNAL_HOST_FN)
                return kvf_gpu_err_set(-EINVAL, "signal: only a host function can wake anyone");
        if (!(s = (struct kvf_gpu_signal *)calloc(1, sizeof(*s))))
                return kvf_gpu_err_set(-ENOMEM, "signal: out of memory");
        s->device = device;
        s->method = method;
        s->word = word;
        s->span = span & ~(size_t)7;
        s->wake = wake;
        s->wake_arg = wake_arg;
        for (unsigned i = 0; i < HOSTFN_SLOTS; i++)
                s->slots[i].s = s;
        if ((rc = kvf_gpu_device_enter(device, &prev)) < 0)
                goto fail;
        if (method != KVF_GPU_SIGNAL_HOST_FN && (rc = map_word(s)) < 0)
                goto fail_dev;
        if (method == KVF_GPU_SIGNAL_WRITE_VALUE) {
                void *fp = NULL;
                int can = 0;
                if ((rc = driver_fn("cuDeviceGetAttribute", &fp)) < 0)
                        goto fail_map;
                /* The runtime's device index is the driver's ordinal in one process. */
                CUresult r = ((dev_attr_fn)fp)(
                    &can, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, (CUdevice)device);
                if (r != CUDA_SUCCESS || !can) {
                        rc = kvf_gpu_err_set(
                            -ENOSYS,
                            "GPU %d: no 64-bit stream memory operations "
                            "(cuStreamWriteValue64): %s",
                            device, r != CUDA_SUCCESS ? cu_err_string(r) : "not supported here");
                        goto fail_map;
                }
                if ((rc = driver_fn("cuStreamWriteValue64", &fp)) < 0)
                        goto fail_map;
                s->write64 = (write_value64_fn)fp;
        }
        kvf_gpu_device_leave(prev);
        *out = s;
        return 0;
fail_map:
        if (s->registered)
                (void)cudaHostUnregister(s->registered);
fail_dev:
        kvf_gpu_device_leave(prev);
fail:
        free(s);
        return rc;
}

extern "C" int kvf_gpu_signal_post(struct kvf_gpu_signal *s, void *stream, uint64_t value)
{
        return kvf_gpu_signal_post_at(s, stream, s->word, value);
}

extern "C" int kvf_gpu_signal_post_at(struct kvf_gpu_signal *s, void *stream, uint64_t *word, uint64_t value)
{
        cudaError_t e;
        size_t off = (size_t)((uintptr_t)word - (uintptr_t)s->word);

        if ((uintptr_t)word < (uintptr_t)s->word || off >= s->span || (off & 7u))
                return kvf_gpu_err_set(-EINVAL, "signal: word %p is not one of its %zu bytes from %p", (void *)word,
                                       s->span, (void *)s->word);
        uint64_t *dev = (uint64_t *)((uintptr_t)s->dev_word + off); /* (WRITE_VALUE, KERNEL) */

        switch (s->method) {
        case KVF_GPU_SIGNAL_HOST_FN: {
                /* Acquire: pairs with the callback's release increment of `ran`;
                 * slots are reused only after their host function finished. */
                if (s->posted - kvf_load_acquire(&s->ran) >= HOSTFN_SLOTS)
                        return kvf_gpu_err_set(-EAGAIN, "signal: %u host functions pending",
                                               HOSTFN_SLOTS);
                struct hostfn_slot *slot = &s->slots[s->posted % HOSTFN_SLOTS];
                slot->word = word;
                slot->value = value;
                e = cudaLaunchHostFunc((cudaStream_t)stream, signal_hostfn, slot);
                if (e != cudaSuccess)
                        return kvf_gpu_err_cuda(e, "cudaLaunchHostFunc (layer-done signal)");
                s->posted++;
                return 0;
        }
        case KVF_GPU_SIGNAL_WRITE_VALUE: {
                /* Default flags: a memory barrier precedes the write, so the
                 * stream's earlier writes are visible before the value is. */
                CUresult r = s->write64((CUstream)stream, (CUdeviceptr)(uintptr_t)dev,
                                        (cuuint64_t)value, CU_STREAM_WRITE_VALUE_DEFAULT);
                if (r != CUDA_SUCCESS)
                        return kvf_gpu_err_set(-EIO,
                                               "cuStreamWriteValue64 (layer-done signal): %s "
                                               "(CUresult %d)",
                                               cu_err_string(r), (int)r);
                return 0;
        }
        case KVF_GPU_SIGNAL_KERNEL: {
                uint64_t *w = dev;
                void *args[] = {(void *)&w, (void *)&value};
                e = cudaLaunchKernel((const void *)kvf_signal_kernel, dim3(1), dim3(1), args, 0,
                                     (cudaStream_t)stream);
                if (e != cudaSuccess)
                        return kvf_gpu_err_cuda(e, "signal kernel launch");
                return 0;
        }
        }
        return kvf_gpu_err_set(-EINVAL, "signal: unknown method %d", s->method);
}

extern "C" uint64_t kvf_gpu_signal_pending(struct kvf_gpu_signal *s)
{
        if (!s || s->method != KVF_GPU_SIGNAL_HOST_FN)
                return 0;
        /* Acquire: pairs with the host function's release increment of `ran`. */
        return s->posted - kvf_load_acquire(&s->ran);
}

extern "C" void kvf_gpu_signal_destroy(struct kvf_gpu_signal *s)
{
        if (!s)
                return;
        if (s->registered) {
                int prev;
                if (kvf_gpu_device_enter(s->device, &prev) == 0) {
                        (void)cudaHostUnregister(s->registered);
                        kvf_gpu_device_leave(prev);
                }
        }
        free(s);
}
