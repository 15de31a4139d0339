/*
 * Errors with context. Functions return >= 0 or -errno; where they know why,
 * they also leave a message in a thread-local buffer, and callers up the
 * stack prepend what they were doing, so the top level prints the chain:
 * "connect to 10.0.0.2:7000: handshake: layout mismatch: 32 layers here, 28 there".
 */
#ifndef KVF_ERR_H
#define KVF_ERR_H

#include <stddef.h>

#define KVF_ERR_MAX 512

/* Replace the message; returns rc so callers can `return kvf_err_set(-EINVAL, ...)`. */
int kvf_err_set(int rc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prepend "<context>: " to the message (or set it from strerror(-rc) if empty); returns rc. */
int kvf_err_ctx(int rc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The message of the last failure on this thread ("" if none). */
const char *kvf_err_msg(void);
void kvf_err_clear(void);

#endif
