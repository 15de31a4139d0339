/*
 * gpu_reattach_test: an engine that dies and attaches again finds its GPU
 * caches as it left them (the allocator owns them, not the engine).
 *
 *   gpu_reattach_test write INSTANCE SEED   attach, write a pattern into every
 *        tensor of every layer (through the CUDA backend's device pointers),
 *        print "written", then wait to be killed (tests/gpu_e2e_test.sh sends
 *        SIGKILL: no detach, no cleanup)
 *   gpu_reattach_test check INSTANCE SEED   attach as a new engine session,
 *        read every tensor back and compare
 *
 * Exit: 0 written / intact, 1 a difference or an error (said on stderr),
 * 2 usage, 77 the instance's caches are not on a GPU.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvf_gpu.h"
#include "kvferry.h"

static uint64_t word_of(uint64_t seed, uint32_t layer, uint32_t t, uint64_t k)
{
        uint64_t x = seed ^ ((uint64_t)layer << 40) ^ ((uint64_t)t << 39);
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdull;
        x ^= x >> 33;
        return x + k * 0x9e3779b97f4a7c15ull;
}

int main(int argc, char **argv)
{
        if (argc != 4 || (strcmp(argv[1], "write") && strcmp(argv[1], "check"))) {
                fprintf(stderr, "usage: %s write|check INSTANCE SEED\n", argv[0]);
                return 2;
        }
        bool write = !strcmp(argv[1], "write");
        uint64_t seed = strtoull(argv[3], NULL, 0);
        struct kvf_client *c;
        struct kvf_layout_info L;
        if (kvf_attach(argv[2], 10000, &c) < 0) {
                fprintf(stderr, "gpu_reattach_test: %s\n", kvf_last_error());
                return 1;
        }
        kvf_get_layout(c, &L);
        int dev = kvf_cache_device(c);
        if (dev < 0) {
                fprintf(stderr, "gpu_reattach_test: instance %s keeps its cache in host memory\n", argv[2]);
                return 77;
        }
        uint32_t layers = L.num_layers + L.extra_layers, tensors = L.key_only ? 1 : 2;
        uint64_t bytes = (uint64_t)L.num_blocks * L.block_bytes, words = bytes / 8;
        uint64_t *buf = malloc(bytes ? bytes : 8);
        if (!buf) {
                fprintf(stderr, "gpu_reattach_test: out of memory\n");
                return 1;
        }
        uint64_t bad = 0;
        for (uint32_t l = 0; l < layers; l++)
                for (uint32_t t = 0; t < tensors; t++) {
                        void *d = kvf_cache_tensor(c, l, (int)t);
                        int rc;
                        if (write) {
                                for (uint64_t k = 0; k < words; k++)
                                        buf[k] = word_of(seed, l, t, k);
                                rc = kvf_gpu_memcpy(dev, d, buf, bytes);
                        } else {
                                rc = kvf_gpu_memcpy(dev, buf, d, bytes);
                                for (uint64_t k = 0; rc == 0 && k < words; k++)
                                        if (buf[k] != word_of(seed, l, t, k) && bad++ < 5)
                                                fprintf(stderr, "gpu_reattach_test: layer %u tensor %u word %llu differs\n",
                                                        l, t, (unsigned long long)k);
                        }
                        if (rc < 0) {
                                fprintf(stderr, "gpu_reattach_test: layer %u tensor %u: %s\n", l, t, kvf_gpu_err_msg());
                                return 1;
                        }
                }
        if (write) {
                printf("written %llu bytes on GPU %d, session %llu\n",
                       (unsigned long long)bytes * layers * tensors, dev, (unsigned long long)kvf_session(c));
                fflush(stdout);
                for (;;)
                        pause(); /* killed here */
        }
        printf("%s: %llu bytes read back on GPU %d, session %llu, %llu words differ\n", bad ? "CHANGED" : "intact",
               (unsigned long long)bytes * layers * tensors, dev, (unsigned long long)kvf_session(c),
               (unsigned long long)bad);
        free(buf);
        kvf_detach(c);
        return bad ? 1 : 0;
}
