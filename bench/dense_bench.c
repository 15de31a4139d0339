/*
 * kvf-bench-dense: what entering the doorbell's dense mode costs the producer thread that
 * enters it, and the records behind it, when its process registers for membarrier(2) at its
 * start (kvf_doorbell_register, as every role does; the client library does not) against
 * registering on the ring that enters dense mode (KVF_AB_LAZY_MEMBARRIER=1, as before).
 * Measured in one run, each arm in a fresh process (a process registers once).
 *
 * An arm: a producer process that runs --threads idle threads besides its own (as a connector
 * or an engine does; a process of one thread registers at once either way) writes --records
 * records, one every --gap-us, into a ring of a real control segment whose consumer, a child
 * process, spins and never sleeps: every ring finds no waiter, and the 64th enters dense mode.
 * Printed per arm: the slowest kvf_ring_write (claim, commit, ring) and the record it was, and
 * the slowest commit-to-receipt the consumer saw.
 */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "atomics.h"
#include "clock.h"
#include "ctl.h"
#include "doorbell.h"
#include "err.h"
#include "opts.h"
#include "ring.h"

#define REC_TYPE 9

struct rec {
        uint64_t seq, commit_ns;
};

struct result {
        uint64_t write_max_ns, write_max_at, recv_max_ns, recv_max_at, received;
};

static char inst[64];
static unsigned n_records = 300, n_threads = 3, gap_us = 20;

static void *idle(void *arg)
{
        (void)arg;
        pause();
        return NULL;
}

struct reader {
        struct result *res;
        uint64_t next;
};

static int take(void *ctx, uint16_t type, const uint8_t *p, uint32_t len, uint64_t pos)
{
        struct reader *rd = ctx;
        struct rec x;
        (void)pos;
        if (type != REC_TYPE || len != sizeof(x))
                return 0;
        memcpy(&x, p, sizeof(x));
        uint64_t d = kvf_now_ns() - x.commit_ns;
        if (d > rd->res->recv_max_ns) {
                rd->res->recv_max_ns = d;
                rd->res->recv_max_at = x.seq;
        }
        rd->next++;
        return 0;
}

/* One arm, in this process: the consumer child, the idle threads, the records. */
static int arm(void)
{
        struct kvf_ctl c;
        struct kvf_ctl_params p = {.instance = inst, .instance_role = KVF_IROLE_MIXED,
                                   .backend = KVF_BACKEND_HOST, .reqtab_slots = 4, .max_blocks = 16};
        /* As the roles do: before any thread exists (a no-op in the lazy arm). */
        (void)kvf_doorbell_register();
        snprintf(inst, sizeof(inst), "b-dense-%d", (int)getpid());
        for (int i = 0; i < KVF_RING_COUNT; i++)
                p.ring_capacity[i] = 1 << 20;
        kvf_ctl_unlink(inst);
        if (kvf_ctl_create(&p, &c) < 0) {
                fprintf(stderr, "control segment: %s\n", kvf_err_msg());
                return 1;
        }
        kvf_ctl_publish(&c);
        struct kvf_ring *r = &c.rings[KVF_RING_ENGINE_TO_SENDER];
        struct result *res = mmap(NULL, sizeof(*res), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (res == MAP_FAILED)
                return 1;
        memset(res, 0, sizeof(*res));
        pid_t child = fork();
        if (child == 0) {
                prctl(PR_SET_PDEATHSIG, SIGKILL);
                struct reader rd = {.res = res};
                while (rd.next < n_records)
                        if (kvf_ring_read(r, take, &rd, 64) <= 0)
                                kvf_cpu_relax();
                res->received = rd.next;
                _exit(0);
        }
        pthread_t t[64];
        for (unsigned i = 0; i < n_threads; i++)
                pthread_create(&t[i], NULL, idle, NULL);
        kvf_ring_producer_attach(r, 1);
        kvf_sleep_ns(10000000); /* the consumer spinning */
        for (uint64_t seq = 0; seq < n_records; seq++) {
                uint64_t due = kvf_now_ns() + (uint64_t)gap_us * 1000;
                struct rec x = {.seq = seq, .commit_ns = kvf_now_ns()};
                int rc;
                while ((rc = kvf_ring_write(r, REC_TYPE, &x, sizeof(x), NULL)) == -EAGAIN)
                        x.commit_ns = kvf_now_ns();
                uint64_t took = kvf_now_ns() - x.commit_ns;
                if (rc < 0) {
                        fprintf(stderr, "write: %d\n", rc);
                        break;
                }
                if (took > res->write_max_ns) {
                        res->write_max_ns = took;
                        res->write_max_at = seq;
                }
                while (kvf_now_ns() < due)
                        kvf_cpu_relax();
        }
        int st;
        waitpid(child, &st, 0);
        printf("%-30s slowest write %9.1f us (record %3llu)  slowest commit-to-receipt %9.1f us (record %3llu)  "
               "%llu of %u received  dense now: %s\n",
               getenv("KVF_AB_LAZY_MEMBARRIER") ? "registered on the 64th ring" : "registered at the start",
               (double)res->write_max_ns / 1e3, (unsigned long long)res->write_max_at,
               (double)res->recv_max_ns / 1e3, (unsigned long long)res->recv_max_at,
               (unsigned long long)res->received, n_records,
               kvf_load_relaxed(&r->bell->unfenced) ? "yes" : "no");
        kvf_ctl_unlink(inst);
        return res->received == n_records ? 0 : 1;
}

int main(int argc, char **argv)
{
        static const struct option opts[] = {{"records", required_argument, 0, 'n'},
                                             {"threads", required_argument, 0, 't'},
                                             {"gap-us", required_argument, 0, 'g'},
                                             {"arm", no_argument, 0, 'a'},
                                             {"help", no_argument, 0, 'h'},
                                             {0, 0, 0, 0}};
        bool one = false;
        for (int o; (o = getopt_long(argc, argv, "", opts, NULL)) != -1;) {
                switch (o) {
                case 'n': n_records = (unsigned)kvf_opt_u64("records", optarg, 65, 100000); break;
                case 't': n_threads = (unsigned)kvf_opt_u64("threads", optarg, 0, 64); break;
                case 'g': gap_us = (unsigned)kvf_opt_u64("gap-us", optarg, 0, 1000000); break;
                case 'a': one = true; break;
                case 'h':
                        printf("usage: kvf-bench-dense [--records N] [--threads N] [--gap-us N]\n"
                               "  both arms, each in a fresh process: registered at the start, and on\n"
                               "  the ring that enters dense mode (KVF_AB_LAZY_MEMBARRIER=1)\n");
                        return 0;
                default:
                        return 2;
                }
        }
        if (one)
                return arm();
        if (!kvf_doorbell_asymmetric_supported()) {
                printf("membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED) is not available here: no dense mode\n");
                return 77;
        }
        printf("%u records, one every %u us, a producer process of %u threads + 1, its consumer spinning\n",
               n_records, gap_us, n_threads);
        char nr[16], nt[16], ng[16];
        snprintf(nr, sizeof(nr), "%u", n_records);
        snprintf(nt, sizeof(nt), "%u", n_threads);
        snprintf(ng, sizeof(ng), "%u", gap_us);
        int rc = 0;
        for (int lazy = 0; lazy < 2; lazy++) {
                fflush(stdout);
                pid_t pid = fork();
                if (pid == 0) {
                        if (lazy)
                                setenv("KVF_AB_LAZY_MEMBARRIER", "1", 1);
                        else
                                unsetenv("KVF_AB_LAZY_MEMBARRIER");
                        execl("/proc/self/exe", argv[0], "--arm", "--records", nr, "--threads", nt, "--gap-us", ng,
                              (char *)NULL);
                        _exit(127);
                }
                int st;
                if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
                        rc = 1;
        }
        return rc;
}
