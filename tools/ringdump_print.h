/*
 * The printing half of kvf-ringdump, separate from main() so the fuzzer can
 * drive it on arbitrary bytes.
 *
 * Every function here only reads the segment bytes it is given: a read-only
 * mapping of a live segment, a copy, or fuzz input. Nothing in those bytes is
 * trusted beyond what kvf_ctl_validate() checked, and even those checks are
 * not relied on for memory safety where a concurrent writer could change a
 * value after it was validated: sizes and indexes are re-checked against the
 * segment size, and strings are clamped to their arrays.
 *
 * `base` must be 8-byte aligned (mmap gives page alignment). Output goes to
 * `out` only; nothing is written to `out` when the bytes are not a valid
 * segment. Not thread-safe with respect to `out`; kvf_err is thread-local.
 */
#ifndef KVF_RINGDUMP_PRINT_H
#define KVF_RINGDUMP_PRINT_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#define KVF_DUMP_DEFAULT_RECORDS 16u
#define KVF_DUMP_TEXT_REQUESTS 20u /* active requests listed in text mode */

struct kvf_dump_opts {
        bool json;            /* one JSON object (one line) instead of text */
        bool records;         /* decode and print pending ring records */
        unsigned max_records; /* per ring; 0 = default (KVF_DUMP_DEFAULT_RECORDS) */
        uint64_t now_ns;      /* CLOCK_MONOTONIC "now" for heartbeat ages; 0 = read the clock */
        bool check_pids;      /* probe whether role pids are alive (off in the fuzzer) */
        bool verbose;         /* text: also print zero counters */
};

/*
 * Validate `size` bytes at `base` as a control segment (owner check skipped;
 * the caller did it) and print it to `out`. Never writes to `base`. Returns
 * 0, or the negative errno of kvf_ctl_validate() with kvf_err saying what is
 * wrong (nothing printed; the caller reports it). o may be NULL (defaults).
 */
int kvf_dump(void *base, uint64_t size, FILE *out, const struct kvf_dump_opts *o);

/*
 * One line per instance for `--all`: text (after kvf_dump_brief_title()) or
 * one JSON object without a trailing newline (the caller joins them into an
 * array). Same contract as kvf_dump().
 */
int kvf_dump_brief(void *base, uint64_t size, FILE *out, const struct kvf_dump_opts *o);
void kvf_dump_brief_title(FILE *out);
/* The `--all` line of an instance that could not be read (rc: -errno, msg: why). */
void kvf_dump_brief_error(FILE *out, const char *name, int rc, const char *msg,
                          const struct kvf_dump_opts *o);

/*
 * Write n bytes of s as the body of a JSON string (no quotes): quotes,
 * backslashes and control bytes escaped, invalid UTF-8 replaced by U+FFFD.
 */
void kvf_dump_json_str(FILE *out, const char *s, size_t n);

#endif
