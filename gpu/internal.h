/*
 * What the kvf_gpu sources share and callers never see: the thread-local
 * error message and the translation of CUDA errors into -errno.
 */
#ifndef KVF_GPU_INTERNAL_H
#define KVF_GPU_INTERNAL_H

#include <stdint.h>

#include <cuda_runtime.h>

#include "kvf_gpu.h"

/* Replace this thread's message; returns rc. */
int kvf_gpu_err_set(int rc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/*
 * A failed CUDA runtime call: "what: <error string> (<error name>)", and
 * -ENOMEM for an allocation failure, -EIO for everything else. Clears the
 * runtime's last-error slot for non-sticky errors, so that one refused call
 * does not surface again from an unrelated cudaGetLastError() later.
 */
int kvf_gpu_err_cuda(cudaError_t e, const char *what);

/* Is [off, off + bytes) inside a region of `size` bytes? Written so nothing wraps. */
static inline int kvf_gpu_inside(uint64_t off, uint64_t bytes, uint64_t size)
{
        return bytes <= size && off <= size - bytes;
}

/* Make `device` current on this thread, remembering the previous one in *prev
 * (restore with kvf_gpu_device_leave). Engines' threads call into this
 * library (the engine-context executor), so their current device is kept. */
int kvf_gpu_device_enter(int device, int *prev);
void kvf_gpu_device_leave(int prev);

/*
 * The copier's descriptor ring: positions are chunk counters that only grow,
 * [tail, head) is in use. Is there a stretch of k <= cap chunks that does not
 * wrap? 0 and *start (the stretch is [start, start + k); the caller then sets
 * head to its end), or -EAGAIN. May move head and tail together when the ring
 * is empty. Pure arithmetic, exposed for the test.
 */
int kvf_gpu_arena_fit(uint64_t *head, uint64_t *tail, uint64_t cap, uint64_t k, uint64_t *start);

#endif
