/* Histograms in the control segment (ctl.h): log2 buckets, 8 sub-buckets each. */
#include "ctl.h"

#include "atomics.h"

static unsigned hist_bucket(uint64_t v)
{
        if (v < 8)
                return (unsigned)v;
        unsigned lg = 63u - (unsigned)__builtin_clzll(v);
        unsigned b = (lg - 2) * 8 + (unsigned)((v >> (lg - 3)) & 7);
        return b < KVF_HIST_BUCKETS ? b : KVF_HIST_BUCKETS - 1;
}

static uint64_t hist_bucket_low(unsigned b)
{
        if (b < 8)
                return b;
        unsigned lg = b / 8 + 2;
        return (1ull << lg) | ((uint64_t)(b % 8) << (lg - 3));
}

void kvf_hist_add(struct kvf_histogram *h, uint64_t v)
{
        kvf_fetch_add_relaxed(&h->count, 1);
        kvf_fetch_add_relaxed(&h->sum, v);
        uint64_t m = kvf_load_relaxed(&h->max);
        if (v > m)
                kvf_store_relaxed(&h->max, v);
        kvf_fetch_add_relaxed(&h->buckets[hist_bucket(v)], 1);
}

/* A size (bytes, descriptors): bucketed by v - 1, so that a bucket is (low, high] and a bound
 * at a power of two, as Prometheus' `le`, counts a value equal to it (shm_layout.h). */
void kvf_hist_add_size(struct kvf_histogram *h, uint64_t v)
{
        kvf_fetch_add_relaxed(&h->count, 1);
        kvf_fetch_add_relaxed(&h->sum, v);
        uint64_t m = kvf_load_relaxed(&h->max);
        if (v > m)
                kvf_store_relaxed(&h->max, v);
        kvf_fetch_add_relaxed(&h->buckets[hist_bucket(v ? v - 1 : 0)], 1);
}

uint64_t kvf_hist_quantile(const struct kvf_histogram *h, double q)
{
        uint64_t n = 0, total = 0;
        for (unsigned i = 0; i < KVF_HIST_BUCKETS; i++)
                total += kvf_load_relaxed(&h->buckets[i]);
        if (total == 0)
                return 0;
        uint64_t want = (uint64_t)(q * (double)total);
        if (want >= total)
                want = total - 1;
        for (unsigned i = 0; i < KVF_HIST_BUCKETS; i++) {
                n += kvf_load_relaxed(&h->buckets[i]);
                if (n > want) {
                        /* midpoint of the bucket */
                        uint64_t lo = hist_bucket_low(i);
                        uint64_t hi = i + 1 < KVF_HIST_BUCKETS ? hist_bucket_low(i + 1) : lo;
                        return lo + (hi - lo) / 2;
                }
        }
        return kvf_load_relaxed(&h->max);
}

