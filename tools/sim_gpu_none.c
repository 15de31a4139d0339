/* kvf-sim's GPU mode in a build without CUDA (tools/sim_gpu.h): every call fails, saying so. */
#include <stdio.h>

#include "sim_gpu.h"

int sim_gpu_open(struct sim_gpu **out, unsigned ranks, unsigned dranks, const int *prefill_dev,
                 const int *decode_dev, unsigned layer_us, bool default_stream, bool timeline)
{
        (void)dranks;
        (void)default_stream;
        (void)timeline;
        (void)ranks;
        (void)prefill_dev;
        (void)decode_dev;
        (void)layer_us;
        *out = NULL;
        fprintf(stderr, "kvf-sim: this build has no CUDA (nvcc was not found when it was built): no --gpu\n");
        return -1;
}

void sim_gpu_close(struct sim_gpu *g)
{
        (void)g;
}

int sim_gpu_fill(struct sim_gpu *g, unsigned rank, void *ptr, uint64_t bytes, uint64_t key)
{
        (void)g, (void)rank, (void)ptr, (void)bytes, (void)key;
        return -1;
}

int sim_gpu_layer(struct sim_gpu *g, unsigned rank, struct kvf_client *c, uint64_t step, uint32_t layer,
                  uint64_t layer_ns)
{
        (void)g, (void)rank, (void)c, (void)step, (void)layer, (void)layer_ns;
        return -1;
}

int sim_gpu_step_end(struct sim_gpu *g, uint64_t *last_ns)
{
        (void)g;
        *last_ns = 0;
        return -1;
}

uint64_t sim_gpu_clock_drift(const struct sim_gpu *g)
{
        (void)g;
        return 0;
}

uint64_t sim_gpu_wait_ns(const struct sim_gpu *g)
{
        (void)g;
        return 0;
}

int sim_gpu_expect(struct sim_gpu *g, unsigned rank, const void *ptr, uint64_t bytes, uint64_t key)
{
        (void)g, (void)rank, (void)ptr, (void)bytes, (void)key;
        return -1;
}

long sim_gpu_check(struct sim_gpu *g, unsigned rank, uint64_t *first_bad)
{
        (void)g, (void)rank;
        *first_bad = 0;
        return -1;
}

double sim_gpu_copy_rate(struct sim_gpu *g, uint64_t bytes)
{
        (void)g, (void)bytes;
        return 0;
}

void sim_gpu_step_times(const struct sim_gpu *g, uint64_t *launched_ns, uint64_t *hostfn_ns)
{
        (void)g;
        *launched_ns = *hostfn_ns = 0;
}

int sim_gpu_fill_heads(struct sim_gpu *g, unsigned rank, void *ptr, const struct sim_gpu_heads *h)
{
        (void)g, (void)rank, (void)ptr, (void)h;
        return -1;
}

int sim_gpu_expect_heads(struct sim_gpu *g, unsigned rank, const void *ptr, const struct sim_gpu_heads *h)
{
        (void)g, (void)rank, (void)ptr, (void)h;
        return -1;
}

int sim_gpu_read(struct sim_gpu *g, unsigned rank, const void *ptr, uint64_t bytes, void *out)
{
        (void)g, (void)rank, (void)ptr, (void)bytes, (void)out;
        return -1;
}
