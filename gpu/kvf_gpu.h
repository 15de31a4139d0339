/*
 * kvf_gpu: the CUDA building blocks of kvferry's same-host GPU path.
 *
 * A plain C header: no CUDA header is needed to include it; streams are
 * `void *` (a cudaStream_t), device memory is `void *` or a 64-bit address.
 * Nothing here knows about instances, rings or requests: the cache backend
 * that wires this in maps requests to runs and tickets to requests.
 *
 *  - the batched copy: one kernel launch copies thousands of runs
 *    {source offset, destination offset, bytes} between any number of
 *    regions (own cache, peers' caches, K and V, several layers); a copier
 *    owns the descriptor staging, a stream and one CUDA event per batch;
 *    the caller polls tickets (cudaEventQuery, never a blocking sync);
 *  - caches: cudaMalloc, CUDA IPC handles (64 bytes, for shared memory),
 *    peer access between devices, device UUIDs;
 *  - layer-done signals: make a 64-bit word in host memory take a value when
 *    a stream reaches a point, by a host function, by a stream memory
 *    operation (cuStreamWriteValue64) or by a one-thread kernel.
 *
 * Return values: >= 0 on success, -errno on failure, and then
 * kvf_gpu_err_msg() says why, on the calling thread ("cudaIpcOpenMemHandle:
 * invalid argument (cudaErrorInvalidValue)"). Every failure of the CUDA
 * runtime or driver is -EIO (-ENOMEM for an allocation); arguments that are
 * wrong are -EINVAL, a run outside its region -ERANGE.
 *
 * Errors of CUDA work that already ran (a faulting kernel) are "sticky": the
 * process's context on that device is unusable afterwards and every later
 * call fails with -EIO. The copier therefore checks every run against its
 * region before it launches anything (kvf_gpu_plan), so a bad block id in a
 * task fails that batch at submit and nothing else.
 *
 * Threads: a copier is used by one thread at a time. The other functions
 * may be called from any thread. None may be called from a CUDA host
 * function (CUDA forbids CUDA calls there).
 */
#ifndef KVF_GPU_H
#define KVF_GPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- errors */

/* Why the last failing kvf_gpu call on this thread failed ("" if none). */
const char *kvf_gpu_err_msg(void);

/* ---------------------------------------------------------------- devices */

/*
 * Number of CUDA devices visible to this process; 0, with a message saying
 * why, when there is none or the runtime cannot start (no driver, a driver
 * older than the runtime), so callers can skip.
 */
int kvf_gpu_device_count(void);

/* The calling thread's current device (cudaGetDevice), or -EIO. */
int kvf_gpu_current_device(void);

/* The device's UUID (16 bytes), stable across processes whatever their
 * CUDA_VISIBLE_DEVICES: store it beside an IPC handle. */
int kvf_gpu_device_uuid(int device, uint8_t uuid[16]);
/* The index, in this process, of the device with this UUID, or -ENODEV. */
int kvf_gpu_device_by_uuid(const uint8_t uuid[16]);

/* Multiprocessor count of the device (132 on an H200 SXM). */
int kvf_gpu_device_sms(int device);

/* 1 when contexts created on this device are shared through MPS, 0 if not. */
int kvf_gpu_mps_enabled(int device);

/* ---------------------------------------------------------------- caches */

/* cudaMalloc on `device`; the memory is not cleared. */
int kvf_gpu_alloc(int device, uint64_t bytes, void **out);
int kvf_gpu_free(int device, void *ptr);

#define KVF_GPU_IPC_HANDLE_SIZE 64u

/*
 * The CUDA IPC handle of an allocation (cudaIpcGetMemHandle), 64 opaque
 * bytes to store in shared memory. `ptr` must be the start of an allocation
 * made by kvf_gpu_alloc (cudaMalloc): the handle names the whole allocation
 * and kvf_gpu_ipc_open returns its start.
 */
int kvf_gpu_ipc_export(void *ptr, uint8_t handle[KVF_GPU_IPC_HANDLE_SIZE]);

/*
 * Map another process's allocation into this process, for use by kernels
 * running on `device`. When the memory lives on another device, peer access
 * from `device` to it is enabled (kvf_gpu_peer_enable), and -EXDEV returned
 * if the two cannot reach each other. *owner_device (may be NULL) receives
 * the device that holds the memory, as numbered in this process.
 * A handle cannot be opened by the process that exported it (CUDA refuses);
 * open each peer's handle once and keep the mapping.
 */
int kvf_gpu_ipc_open(int device, const uint8_t handle[KVF_GPU_IPC_HANDLE_SIZE], void **out,
                     int *owner_device);
int kvf_gpu_ipc_close(int device, void *ptr);

/*
 * The allocation that holds device pointer `ptr` (an engine's tensor, a
 * sub-range of what its allocator got from the driver): *base and *bytes from
 * cuMemGetAddressRange, *device the GPU holding it (this process's number),
 * *vmm 1 when it was made by cuMemCreate/cuMemMap (PyTorch's expandable
 * segments: no CUDA IPC handle can name it), else 0. -EINVAL when `ptr` is
 * not device memory (host, managed), -errno with kvf_gpu_err_msg otherwise.
 */
int kvf_gpu_mem_range(const void *ptr, uint64_t *base, uint64_t *bytes, int *device, int *vmm);

/* Wait for all work this process queued on `device` (every stream). */
int kvf_gpu_device_sync(int device);

/* Let kernels on `device` access memory on `peer` (idempotent); -EXDEV if the
 * hardware cannot (then a copy must be staged through host memory). */
int kvf_gpu_peer_enable(int device, int peer);

/* ---------------------------------------------------------------- plain copies and host memory */

/*
 * Copy `bytes` between any two of host memory, device memory and mapped
 * memory (cudaMemcpy, direction inferred from the pointers), on `device`'s
 * context; returns when the bytes are in place. For staging (the tcp path)
 * and tests, never for a layer's blocks.
 */
int kvf_gpu_memcpy(int device, void *dst, const void *src, uint64_t bytes);
/* cudaMemset on `device`, synchronous. */
int kvf_gpu_memset(int device, void *ptr, int value, uint64_t bytes);
/* Pinned host memory (cudaHostAlloc, portable to every device and mapped: kernels use the same
 * address); free with kvf_gpu_host_free. */
int kvf_gpu_host_alloc(uint64_t bytes, void **out);
void kvf_gpu_host_free(void *ptr);

/* ---------------------------------------------------------------- GPUDirect RDMA */

/*
 * A dma-buf file descriptor for device memory [ptr, ptr + bytes) (the
 * driver's cuMemGetHandleForAddressRange), for ibv_reg_dmabuf_mr; ptr and
 * bytes must be multiples of the host page size. The caller closes it (a
 * memory region registered on it keeps its own reference). -ENOTSUP when the
 * GPU, the driver or the kernel cannot (the message says which).
 */
int kvf_gpu_dmabuf_export(int device, void *ptr, uint64_t bytes, int *fd);
/*
 * Make what a NIC wrote into `device`'s memory (completed RDMA writes)
 * visible to the work this process queues afterwards, on any stream
 * (cudaDeviceFlushGPUDirectRDMAWrites, to the owner); a no-op on GPUs that
 * order such writes themselves. 0, or -EIO.
 */
int kvf_gpu_rdma_flush(int device);

/* ---------------------------------------------------------------- runs and the plan */

/* A range of device memory runs may address: [base, base + bytes). */
struct kvf_gpu_region {
        uint64_t base; /* device address (a cudaMalloc'd, IPC-opened or peer pointer) */
        uint64_t bytes;
};

/*
 * One contiguous copy: src[src_region] + src_off -> dst[dst_region] + dst_off.
 * For a KV cache, offset(layer, tensor, block) =
 * ((layer * tensors + tensor) * num_blocks + block) * block_bytes, and blocks
 * contiguous on both sides merge into one run. Any byte count and alignment
 * is copied; 16-byte aligned starts and multiples of 16 bytes take the fast
 * path (every cache block is).
 */
struct kvf_gpu_run {
        uint64_t src_off;
        uint64_t dst_off;
        uint64_t bytes;
        uint32_t src_region;
        uint32_t dst_region;
};

/*
 * The kernel's unit of work: a run, or a piece of one, with absolute
 * addresses. One thread block copies one chunk at a time. 24 bytes.
 */
struct kvf_gpu_chunk {
        uint64_t src;
        uint64_t dst;
        uint32_t bytes;
        uint32_t reserved; /* 0 */
};

/* Largest chunk the planner makes; larger runs are cut into chunks. */
#define KVF_GPU_CHUNK_MAX (1u << 20)

/*
 * Check every run against its regions and cut the runs into chunks of at
 * most `chunk_bytes` (a multiple of 16, 16 .. KVF_GPU_CHUNK_MAX), cut at
 * multiples of 16 bytes from the run's start. Pure host code, no CUDA call.
 *
 * out == NULL: only check and count. Otherwise at most `cap` chunks are
 * written. *n_chunks receives the count in both cases.
 * Returns 0; -EINVAL for a region index out of range or a region whose end
 * overflows; -ERANGE for a run outside its region (the message names the
 * run, the region and both ranges); -E2BIG when more than `cap` chunks are
 * needed (nothing useful is in `out` then). Zero-byte runs make no chunk.
 * Not checked: overlaps between a run's source and destination or between
 * destinations of different runs (the result is then undefined).
 */
int kvf_gpu_plan(const struct kvf_gpu_run *runs, size_t n_runs, const struct kvf_gpu_region *src,
                 uint32_t n_src, const struct kvf_gpu_region *dst, uint32_t n_dst,
                 uint32_t chunk_bytes, struct kvf_gpu_chunk *out, size_t cap, size_t *n_chunks);

/*
 * The chunk size the copier uses for a batch of `total_bytes` on a device
 * with `sms` multiprocessors: the power of two, 4 KiB to 64 KiB, that makes
 * about eight chunks per multiprocessor (at most), so that small batches
 * still spread over every SM and large ones keep blocks busy.
 */
uint32_t kvf_gpu_chunk_bytes_for(uint64_t total_bytes, int sms);

/* Load the copy kernels now rather than at their first launch (CUDA's lazy module loading
 * stalls the process's other CUDA work then); kvf_gpu_copier_create does it. 0 or -EIO. */
int kvf_gpu_copy_kernels_load(void);

/*
 * Launch the copy kernel over `n` chunks that are already in memory the
 * device can read (device memory, or the device pointer of mapped pinned
 * host memory), on `stream`. No check of the chunks: use kvf_gpu_plan.
 * stamps: NULL, or a device pointer to two 64-bit words that receive the
 * earliest block start (atomicMin) and the latest block end (atomicMax,
 * after the block's stores are visible device-wide) in %globaltimer
 * nanoseconds; the caller initialises them to UINT64_MAX and 0.
 * Returns 0 or -EIO (launch failure: the work was not queued).
 */
int kvf_gpu_copy_launch(const struct kvf_gpu_chunk *dev_chunks, uint32_t n, void *stream,
                        uint64_t *stamps);
/* The same with `dsrc` and `ddst` added (modulo 2^64) to every chunk's source
 * and destination address (descriptors of one layer, run for another), and,
 * when `save` is not NULL, every descriptor as read also stored at the same
 * index of `save` (device memory, room for n). `evict_first`: the data's
 * loads and stores marked evict-first in L2 (the copier's default). */
int kvf_gpu_copy_launch_ex(const struct kvf_gpu_chunk *dev_chunks, uint32_t n, uint64_t dsrc,
                           uint64_t ddst, struct kvf_gpu_chunk *save, int evict_first,
                           void *stream, uint64_t *stamps);

/* The kernel's own code run on the host, thread by thread, over chunks with
 * host addresses: lets tests check the index arithmetic without a GPU.
 * `threads` emulated threads per block (the kernel uses KVF_GPU_THREADS). */
void kvf_gpu_copy_emulate(const struct kvf_gpu_chunk *chunks, size_t n, uint32_t threads);

#define KVF_GPU_THREADS 512u

/* ---------------------------------------------------------------- the copier */

struct kvf_gpu_copier;

enum kvf_gpu_copier_flags {
        /*
         * Default (no flag): the kernel reads a batch's descriptors from mapped
         * pinned host memory (no copy before the launch; each block's first
         * read crosses PCIe) and leaves a copy in device memory; the next
         * batch, when it is the same runs shifted by a layer, runs that copy.
         *
         * MAPPED_DESC: read every batch from host memory, keep nothing on the
         * device (no reuse). For comparison.
         */
        KVF_GPU_COPIER_MAPPED_DESC = 1u << 0,
        /* Create the stream at normal priority (default: the highest, so the
         * copy's blocks are scheduled before an engine's pending blocks). */
        KVF_GPU_COPIER_NORMAL_PRIORITY = 1u << 1,
        /* Copy every batch's descriptors to device memory with cudaMemcpyAsync
         * before its kernel, no reuse: the first design, for comparison. Not
         * with MAPPED_DESC. */
        KVF_GPU_COPIER_STAGED_DESC = 1u << 2,
        /* Plain loads and stores of the data, as cudaMemcpy. Default: the .cs
         * forms (evict-first). On the H200 plain copies 1.5 to 3.5 % faster and
         * costs an engine kernel beside paced copies 2 to 5 % more of its time
         * (bench/gpu_l2_bench.cu, docs/GPU.md). */
        KVF_GPU_COPIER_PLAIN = 1u << 3,
};

struct kvf_gpu_copier_opts {
        void *stream;          /* NULL: the copier creates its own non-blocking stream;
                                  else every batch goes on this one (not destroyed) */
        uint32_t arena_chunks; /* descriptor staging, chunks; 0: 65536 (1.5 MiB) */
        uint32_t chunk_bytes;  /* 0: kvf_gpu_chunk_bytes_for() per batch */
};

/* Create a copier on `device`. opts may be NULL (defaults). */
int kvf_gpu_copier_create(int device, unsigned flags, const struct kvf_gpu_copier_opts *opts,
                          struct kvf_gpu_copier **out);
/* Waits (bounded, 10 s) for the batches in flight, then frees everything. */
void kvf_gpu_copier_destroy(struct kvf_gpu_copier *c);
/* The stream the copier's batches run on (a cudaStream_t). */
void *kvf_gpu_copier_stream(const struct kvf_gpu_copier *c);
/* Batches (with at least one chunk) whose descriptors came from the host, and
 * those that ran the descriptors already on the device, shifted by a layer. */
void kvf_gpu_copier_counts(const struct kvf_gpu_copier *c, uint64_t *fresh, uint64_t *reused);

/* Most batches in flight (submitted, not yet seen complete by a poll). */
#define KVF_GPU_MAX_INFLIGHT 256u

struct kvf_gpu_batch {
        const struct kvf_gpu_run *runs;
        size_t n_runs;
        const struct kvf_gpu_region *src;
        uint32_t n_src;
        const struct kvf_gpu_region *dst;
        uint32_t n_dst;
        /* A stream (of the copier's device) whose work queued so far must
         * finish before this batch starts: the engine's compute stream, for a
         * copy on a side stream that follows the layer's kernel. Waited for
         * when it is not NULL, or when `after` is set: NULL is then the
         * legacy default stream (PyTorch's current stream unless the engine
         * made its own), which the copier's non-blocking stream does not
         * follow by itself. */
        void *after_stream;
        /* NULL, or the stamps of kvf_gpu_copy_launch (benchmarks). */
        uint64_t *stamps;
        bool after;
};

/*
 * Plan the batch, write its descriptors (unless the batch before had the same
 * runs shifted by one amount per side: then its descriptors run again), wait
 * for `after_stream`, launch one kernel and record the batch's event, all on
 * the copier's stream; *ticket identifies the batch
 * (tickets count up from 1). Never blocks on the GPU.
 * Returns 0; -EINVAL/-ERANGE for a bad run (nothing queued: fail exactly the
 * requests of this batch); -EAGAIN when KVF_GPU_MAX_INFLIGHT batches are in
 * flight or the descriptor arena has no room yet (poll, then try again);
 * -E2BIG when the batch needs more chunks than the whole arena (split it);
 * -EIO when CUDA refused the work (the batch did not run).
 * An empty batch (no runs, or only empty ones) gets a ticket too.
 */
int kvf_gpu_copy_submit(struct kvf_gpu_copier *c, const struct kvf_gpu_batch *b, uint64_t *ticket);

/*
 * Has the batch landed? 1: yes, every byte is in place (visible to later
 * work on any stream of the device, and to peers); 0: not yet; -EIO: the
 * batch failed (the message says how) and so will every batch submitted
 * before or after it whose completion was not yet seen: a failed copy is
 * sticky in CUDA. Polling tickets out of order is allowed; a ticket seen
 * complete stays complete. -EINVAL for a ticket never issued.
 */
int kvf_gpu_copy_poll(struct kvf_gpu_copier *c, uint64_t ticket);

/* ---------------------------------------------------------------- layer-done signals */

enum kvf_gpu_signal_method {
        /* cudaLaunchHostFunc: CUDA's callback thread stores the value (and
         * calls `wake`, e.g. to ring a futex doorbell). Any host memory. */
        KVF_GPU_SIGNAL_HOST_FN = 1,
        /* cuStreamWriteValue64 (driver API, found through the runtime, so no
         * link against libcuda): the GPU writes the value into the word,
         * which is registered with cudaHostRegister(mapped). No `wake`: a
         * waiter must poll the word. */
        KVF_GPU_SIGNAL_WRITE_VALUE = 2,
        /* A one-thread kernel does a system-scope release store into the
         * mapped word. Same as WRITE_VALUE for waiters; a fallback where
         * stream memory operations are unavailable. */
        KVF_GPU_SIGNAL_KERNEL = 3,
};

struct kvf_gpu_signal;

/*
 * A signal that stores values into the 64-bit, 8-byte aligned word `word`
 * (host memory: private, or a MAP_SHARED mapping such as kvferry's control
 * segment). For WRITE_VALUE and KERNEL the word's page is registered with
 * CUDA (or found already registered); unregistered at destroy if it was
 * registered here. `wake` (HOST_FN only, may be NULL) runs on CUDA's
 * callback thread after each store, with `wake_arg`.
 */
int kvf_gpu_signal_create(int device, uint64_t *word, int method, void (*wake)(void *),
                          void *wake_arg, struct kvf_gpu_signal **out);
/*
 * The same, for the words of [word, word + span) (span bytes, at least 8):
 * kvf_gpu_signal_post_at may store into any 8-byte aligned word of it. For
 * WRITE_VALUE and KERNEL every page of the span is registered here, or must
 * have been registered by the caller as one mapping (else -EINVAL).
 */
int kvf_gpu_signal_create_span(int device, uint64_t *word, size_t span, int method, void (*wake)(void *),
                               void *wake_arg, struct kvf_gpu_signal **out);
/*
 * When `stream` reaches this point (all work queued on it before has
 * finished), the word takes `value` (a release store: whoever reads the
 * value with an acquire load sees everything the stream did before it).
 * Stores happen in stream order; use one signal per stream.
 * -EAGAIN (HOST_FN) when 1024 host functions of this signal are pending.
 */
int kvf_gpu_signal_post(struct kvf_gpu_signal *s, void *stream, uint64_t value);
/* As kvf_gpu_signal_post, into `word` of the signal's span (-EINVAL outside it). Posts of one
 * signal land in stream order whatever their words. */
int kvf_gpu_signal_post_at(struct kvf_gpu_signal *s, void *stream, uint64_t *word, uint64_t value);
/* HOST_FN: host functions posted that have not finished yet (0 for the other methods). */
uint64_t kvf_gpu_signal_pending(struct kvf_gpu_signal *s);
/* The caller has made sure no post is still pending (stream synchronised). */
void kvf_gpu_signal_destroy(struct kvf_gpu_signal *s);
const char *kvf_gpu_signal_method_name(int method);

#ifdef __cplusplus
}
#endif

#endif
