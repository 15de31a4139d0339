/* Minimal assertions for test programs: print where and why, exit 1. Exit 77 = skipped. */
#ifndef KVF_TEST_CHECK_H
#define KVF_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "err.h"

#define CHECK(cond)                                                                                \
        do {                                                                                       \
                if (!(cond)) {                                                                     \
                        fprintf(stderr, "%s:%d: CHECK(%s) failed (last error: %s)\n", __FILE__,    \
                                __LINE__, #cond, kvf_err_msg());                                   \
                        exit(1);                                                                   \
                }                                                                                  \
        } while (0)

#define CHECK_EQ(a, b)                                                                             \
        do {                                                                                       \
                long long _a = (long long)(a), _b = (long long)(b);                                \
                if (_a != _b) {                                                                    \
                        fprintf(stderr, "%s:%d: %s == %s failed: %lld != %lld (last error: %s)\n", \
                                __FILE__, __LINE__, #a, #b, _a, _b, kvf_err_msg());                \
                        exit(1);                                                                   \
                }                                                                                  \
        } while (0)

/* The last error message contains `needle`. */
#define CHECK_ERR_HAS(needle)                                                                      \
        do {                                                                                       \
                if (!strstr(kvf_err_msg(), (needle))) {                                            \
                        fprintf(stderr, "%s:%d: error message \"%s\" lacks \"%s\"\n", __FILE__,    \
                                __LINE__, kvf_err_msg(), (needle));                                \
                        exit(1);                                                                   \
                }                                                                                  \
        } while (0)

#define SKIP(...)                                                                                  \
        do {                                                                                       \
                fprintf(stderr, "SKIP: " __VA_ARGS__);                                             \
                fprintf(stderr, "\n");                                                             \
                exit(77);                                                                          \
        } while (0)

#endif
