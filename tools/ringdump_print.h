/*
 * The printing half of kvf-ringdump, separate from main() so the fuzzer can
 * drive it on arbitrary bytes.
 */
#ifndef KVF_RINGDUMP_PRINT_H
#define KVF_RINGDUMP_PRINT_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

struct kvf_dump_opts {
        bool json;        /* one JSON object instead of text */
        bool records;     /* decode and print pending ring records */
        unsigned max_records; /* per ring; 0 = default (16) */
        uint64_t now_ns;  /* CLOCK_MONOTONIC "now" for heartbeat ages; 0 = read the clock */
        bool check_pids;  /* probe whether role pids are alive (off in the fuzzer) */
};

/*
 * Validate `size` bytes at `base` as a control segment (owner check skipped;
 * the caller did it) and print it to `out`. Never writes to `base`. Returns
 * 0, or a negative errno with a message printed (and in kvf_err) when the
 * bytes are not a valid segment.
 */
int kvf_dump(void *base, uint64_t size, FILE *out, const struct kvf_dump_opts *o);

#endif
