/*
 * kvf-bench-floor: how soon can any process on this machine notice a word that
 * another process publishes at an engine's pace? The floor under the sender's
 * "layer-done -> copy start" (docs/BENCHMARKS.md section 3), measured without
 * kvferry, so that a figure of kvferry's can be read next to it from the same
 * run of bench/e2e_bench.sh.
 *
 * Two processes (fork), not pinned (kvferry's roles are not):
 *   publisher  the engine as kvf-sim plays it: sleeps until 60 us before the
 *              next layer is due, spins to it, then stores the time and the
 *              layer's number in shared memory (one slot per layer), every
 *              --gap-us;
 *   watcher    spins on the number without ever sleeping (the best a sender
 *              can do) and takes, for every layer, now - its publish time.
 *              A layer it did not see before the next one came is still
 *              counted, from its own publish time.
 * Also printed: the share of its time the watcher spent in stalls of more
 * than 50 us (its clock jumped between two reads: it was not running), and
 * the host's steal time over the run (/proc/stat: the time the hypervisor
 * ran something else while this VM's CPUs had work).
 */
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "atomics.h"
#include "clock.h"
#include "opts.h"

#define STALL_NS 50000ull

static void usage(void)
{
        printf("Usage: kvf-bench-floor [OPTION]...\n"
               "How soon a process that only spins notices a word another process publishes\n"
               "every --gap-us (the floor under kvferry's layer-done -> copy start).\n\n"
               "  --events N   layers published (default 2000)\n"
               "  --gap-us N   time between layers (default 3000)\n"
               "  --json       one JSON object on stdout instead of the text\n"
               "  --help\n\n"
               "Exit status: 0 measured; 1 the run failed; 2 bad usage.\n");
}

static int cmp_u64(const void *a, const void *b)
{
        uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
        return x < y ? -1 : x > y;
}

/* Steal ticks (USER_HZ) of all CPUs so far, from /proc/stat's first line; -1 unknown. */
static long long steal_ticks(void)
{
        FILE *f = fopen("/proc/stat", "r");
        long long v[8] = {0};
        int n = f ? fscanf(f, "cpu %lld %lld %lld %lld %lld %lld %lld %lld", &v[0], &v[1], &v[2],
                           &v[3], &v[4], &v[5], &v[6], &v[7])
                  : 0;
        if (f)
                fclose(f);
        return n == 8 ? v[7] : -1;
}

/* The engine: layer i is published at start + (i + 1) * gap. */
static void publish(volatile uint64_t *seq, volatile uint64_t *at, unsigned events, uint64_t gap_ns)
{
        uint64_t next = kvf_now_ns() + gap_ns;
        for (unsigned i = 0; i < events; i++, next += gap_ns) {
                uint64_t now = kvf_now_ns();
                if (next > now + 60000)
                        kvf_sleep_ns(next - now - 60000);
                while (kvf_now_ns() < next)
                        kvf_cpu_relax();
                at[i] = kvf_now_ns();
                kvf_store_release(seq, (uint64_t)i + 1);
        }
}

int main(int argc, char **argv)
{
        static const struct option opts[] = {{"events", required_argument, 0, 'n'},
                                             {"gap-us", required_argument, 0, 'g'},
                                             {"json", no_argument, 0, 'j'},
                                             {"help", no_argument, 0, 'h'},
                                             {0, 0, 0, 0}};
        unsigned events = 2000;
        uint64_t gap_us = 3000;
        bool json = false;
        int c;
        while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
                switch (c) {
                case 'n': events = (unsigned)kvf_opt_u64("events", optarg, 10, 10000000); break;
                case 'g': gap_us = kvf_opt_u64("gap-us", optarg, 100, 1000000); break;
                case 'j': json = true; break;
                case 'h': usage(); return 0;
                default: fprintf(stderr, "Try 'kvf-bench-floor --help'.\n"); return 2;
                }
        }
        if (optind < argc) {
                fprintf(stderr, "kvf-bench-floor: unexpected argument '%s'\n", argv[optind]);
                return 2;
        }
        /* seq, then one publish time per layer */
        size_t bytes = ((size_t)events + 1) * sizeof(uint64_t);
        uint64_t *shm = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        uint64_t *lat = malloc((size_t)events * sizeof(*lat));
        if (shm == MAP_FAILED || !lat) {
                perror("kvf-bench-floor: memory");
                return 1;
        }
        memset(shm, 0, bytes);
        volatile uint64_t *seq = &shm[0], *at = &shm[1];
        long long steal0 = steal_ticks();
        uint64_t t0 = kvf_now_ns();
        pid_t pub = fork();
        if (pub < 0) {
                perror("kvf-bench-floor: fork");
                return 1;
        }
        if (pub == 0) {
                publish(seq, at, events, gap_us * 1000);
                _exit(0);
        }
        /* The watcher. The publisher is given twice the run's time, then we give up. */
        uint64_t deadline = t0 + 2 * (uint64_t)events * gap_us * 1000 + 5000000000ull;
        uint64_t seen = 0, prev = kvf_now_ns(), stall = 0, stalls = 0;
        while (seen < events) {
                uint64_t now = kvf_now_ns();
                if (now - prev > STALL_NS) {
                        stall += now - prev;
                        stalls++;
                }
                prev = now;
                uint64_t q = kvf_load_acquire(seq);
                if (q != seen) {
                        uint64_t t = kvf_now_ns();
                        for (; seen < q; seen++)
                                lat[seen] = t > at[seen] ? t - at[seen] : 0;
                        prev = t;
                } else if (now > deadline) {
                        fprintf(stderr, "kvf-bench-floor: the publisher stopped after %" PRIu64 " of %u layers\n",
                                seen, events);
                        kill(pub, SIGKILL);
                        waitpid(pub, NULL, 0);
                        return 1;
                }
                kvf_cpu_relax();
        }
        uint64_t wall = kvf_now_ns() - t0;
        int st = 0;
        if (waitpid(pub, &st, 0) != pub || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
                fprintf(stderr, "kvf-bench-floor: the publisher failed\n");
                return 1;
        }
        long long steal1 = steal_ticks();
        long cpus = sysconf(_SC_NPROCESSORS_ONLN), hz = sysconf(_SC_CLK_TCK);
        double steal_pct = steal0 >= 0 && steal1 >= 0 && cpus > 0 && hz > 0
                                   ? 100.0 * (double)(steal1 - steal0) / (double)hz /
                                             ((double)wall / 1e9 * (double)cpus)
                                   : -1;
        qsort(lat, events, sizeof(*lat), cmp_u64);
        uint64_t p50 = lat[events / 2], p99 = lat[(uint64_t)events * 99 / 100],
                 p999 = lat[(uint64_t)events * 999 / 1000], max = lat[events - 1];
        double stall_pct = 100.0 * (double)stall / (double)wall;
        if (json) {
                printf("{\"events\":%u,\"gap_us\":%" PRIu64 ",\"p50_ns\":%" PRIu64 ",\"p99_ns\":%" PRIu64
                       ",\"p999_ns\":%" PRIu64 ",\"max_ns\":%" PRIu64 ",\"stall_pct\":%.3f,\"stalls\":%" PRIu64
                       ",\"steal_pct\":%.3f}\n",
                       events, gap_us, p50, p99, p999, max, stall_pct, stalls, steal_pct);
        } else {
                printf("kvf-bench-floor: %u layers, one every %" PRIu64 " us; a process that only spins saw each\n"
                       "  p50 %.1f us, p99 %.1f us, p99.9 %.1f us, max %.1f us after its publish\n"
                       "  the spinner stood still (stalls > 50 us) %.2f %% of its time, %" PRIu64 " times\n",
                       events, gap_us, p50 / 1e3, p99 / 1e3, p999 / 1e3, max / 1e3, stall_pct, stalls);
                if (steal_pct >= 0)
                        printf("  steal (the hypervisor ran something else): %.2f %% of the CPUs' time\n", steal_pct);
        }
        return 0;
}
