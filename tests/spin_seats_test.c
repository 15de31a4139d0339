/*
 * The host's spin seats (common/cpus.h): how many senders may poll for layers at once.
 *   - seats are taken in order, the last one refused when all are held, and a dropped seat is
 *     free again;
 *   - a holder that is killed (SIGKILL) frees its seat with no cleanup; a program the holder
 *     starts (fork + exec) does not keep it;
 *   - a seat path that is a symbolic link or not a regular file is refused with a message;
 *   - instances (--layer-wait auto): the first prefill instance takes a seat at start, a decode
 *     instance none, each saying so in its log; with requests waiting for layers on three
 *     prefill instances min(3, CPUs / 2) seats are held, and all are free again once they have
 *     waited for none for 2 s; over tcp (the connectors move the bytes) none is taken.
 * $KVFERRY_SPIN_SEATS points every part at a folder of its own.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cpus.h"
#include "instances.h"

static char dir[] = "/tmp/kvf-seats.XXXXXX";

static void set_prefix(const char *name)
{
        char p[256];
        snprintf(p, sizeof(p), "%s/%s", dir, name);
        CHECK_EQ(setenv("KVFERRY_SPIN_SEATS", p, 1), 0);
}

static void in_order(void)
{
        set_prefix("order");
        struct kvf_spin_seat a = {0}, b = {0}, c = {0};
        CHECK_EQ(kvf_spin_seat_take(&a, 0), 0); /* no seats: none taken */
        CHECK(!a.held);
        CHECK_EQ(kvf_spin_seat_take(&a, 2), 1);
        CHECK_EQ(kvf_spin_seat_take(&b, 2), 1);
        CHECK(a.held && b.held && a.seat == 0 && b.seat == 1);
        CHECK_EQ(kvf_spin_seat_take(&a, 2), 1); /* held already: stays seat 0 */
        CHECK_EQ(a.seat, 0);
        CHECK_EQ(kvf_spin_seat_take(&c, 2), 0);
        CHECK(!c.held);
        kvf_spin_seat_drop(&a);
        CHECK(!a.held);
        CHECK_EQ(kvf_spin_seat_take(&c, 2), 1);
        CHECK_EQ(c.seat, 0);
        kvf_spin_seat_drop(&b);
        kvf_spin_seat_drop(&c);
        kvf_spin_seat_drop(&c); /* twice: nothing */
        printf("seats taken in order, refused when all are held, free again once dropped\n");
}

static void killed_and_exec(void)
{
        set_prefix("kill");
        int ready[2];
        CHECK_EQ(pipe(ready), 0);
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
                struct kvf_spin_seat s = {0};
                char ok = kvf_spin_seat_take(&s, 1) == 1 ? 'y' : 'n';
                if (write(ready[1], &ok, 1) != 1)
                        _exit(1);
                for (;;)
                        pause();
        }
        char ok = 0;
        CHECK_EQ(read(ready[0], &ok, 1), 1);
        CHECK_EQ(ok, 'y');
        struct kvf_spin_seat s = {0};
        CHECK_EQ(kvf_spin_seat_take(&s, 1), 0); /* the child holds it */
        CHECK_EQ(kill(pid, SIGKILL), 0);
        CHECK_EQ(waitpid(pid, NULL, 0), pid);
        CHECK_EQ(kvf_spin_seat_take(&s, 1), 1);
        printf("a holder killed with SIGKILL frees its seat\n");

        /* a program started while the seat is held does not keep it once the holder drops it */
        fflush(NULL);
        pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
                execl("/bin/sleep", "sleep", "30", (char *)NULL);
                _exit(127);
        }
        usleep(100000); /* (exec'd or not, it must not hold the lock) */
        kvf_spin_seat_drop(&s);
        struct kvf_spin_seat t = {0};
        CHECK_EQ(kvf_spin_seat_take(&t, 1), 1);
        kvf_spin_seat_drop(&t);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        close(ready[0]), close(ready[1]);
        printf("a program the holder started does not keep its seat\n");
}

static void refused(void)
{
        char p[256], q[256];
        set_prefix("link");
        snprintf(p, sizeof(p), "%s/link.0", dir);
        snprintf(q, sizeof(q), "%s/elsewhere", dir);
        CHECK_EQ(symlink(q, p), 0);
        struct kvf_spin_seat s = {0};
        CHECK(kvf_spin_seat_take(&s, 1) < 0);
        CHECK_ERR_HAS("spin seat");
        CHECK(!s.held);
        CHECK(access(q, F_OK) < 0); /* nothing made through the link */
        set_prefix("fifo");
        snprintf(p, sizeof(p), "%s/fifo.0", dir);
        CHECK_EQ(mkfifo(p, 0600), 0);
        CHECK(kvf_spin_seat_take(&s, 1) < 0);
        CHECK(!s.held);
        printf("a seat that is a symbolic link or a FIFO is refused: %s\n", kvf_err_msg());
}

/* How many of the instance's sender log lines hold `needle`. */
static int log_says(const char *name, const char *needle)
{
        char path[512], line[1024];
        snprintf(path, sizeof(path), "%s/%s/sender.log", getenv("KVFERRY_RUN_DIR"), name);
        FILE *f = fopen(path, "r");
        CHECK(f);
        int n = 0;
        while (fgets(line, sizeof(line), f))
                n += strstr(line, needle) != NULL;
        fclose(f);
        return n;
}

/* The seats of `seats` free now: taken by this process all at once, then given back. */
static unsigned free_seats(unsigned seats)
{
        struct kvf_spin_seat s[64] = {{0}};
        unsigned n = 0;
        CHECK(seats <= 64);
        while (n < seats && kvf_spin_seat_take(&s[n], seats) == 1)
                n++;
        for (unsigned k = 0; k < n; k++)
                kvf_spin_seat_drop(&s[k]);
        return n;
}

/* Wait until every seat is free, 6 s at most: the seconds it took. */
static double wait_all_free(unsigned seats)
{
        uint64_t t0 = kvf_now_ns();
        while (free_seats(seats) < seats && kvf_now_ns() - t0 < 6000000000ull)
                usleep(50000);
        return (double)(kvf_now_ns() - t0) / 1e9;
}

/* kvf-sim moves `requests` requests over `transport` from prefill instances name[0..2] into
 * name[3], a request a step, while this process looks at the seats every 20 ms: the fewest it
 * found free (*probes: how often it looked). */
static unsigned sim_probing(const char *transport, unsigned requests, char name[4][64], unsigned seats,
                            unsigned *probes)
{
        char cmd[1024];
        snprintf(cmd, sizeof(cmd),
                 "%s/kvf-sim --quiet --transport %s --prefill %s --prefill %s --prefill %s --decode %s "
                 "--requests %u --layer-us 1500 --step-tokens 1 --late-pct 0 >/dev/null",
                 getenv("KVFERRY_BUILD") ? getenv("KVFERRY_BUILD") : KVF_SOURCE_DIR "/build", transport,
                 name[0], name[1], name[2], name[3], requests);
        fflush(NULL);
        pid_t sim = fork();
        CHECK(sim >= 0);
        if (sim == 0) {
                execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
                _exit(127);
        }
        unsigned least = seats;
        int st = 0;
        for (*probes = 0; waitpid(sim, &st, WNOHANG) == 0; ++*probes) {
                unsigned f = free_seats(seats);
                least = f < least ? f : least;
                usleep(20000);
        }
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        return least;
}

static void instances(void)
{
        set_prefix("inst");
        const char *why;
        unsigned cpus = kvf_usable_cpus(&why), seats = cpus / 2, busy = seats < 3 ? seats : 3;
        char name[4][64];
        /* the decode instance first, so that a seat it took would be missing below */
        static const int order[] = {3, 0, 1, 2};
        for (int x = 0; x < 4; x++) {
                const int k = order[x];
                snprintf(name[k], sizeof(name[k]), "seat%d%c%d", (int)getpid(), k < 3 ? 'p' : 'd', k);
                t_up(name[k], "--role %s --model llama-3.1-8b --tp 8 --cache-mib 64 --layer-wait auto",
                     k < 3 ? "prefill" : "decode");
        }
        CHECK_EQ(log_says(name[3], "layer wait: paced (--layer-wait auto:"), 1);
        CHECK_EQ(log_says(name[3], seats ? "a decode instance takes one only" : "fewer than 2 CPUs"), 1);
        /* the first prefill instance found every seat free */
        CHECK_EQ(log_says(name[0], seats ? "layer wait: spin (--layer-wait auto: spin seat 0 of"
                                         : "fewer than 2 CPUs"),
                 1);
        for (int k = 0; k < 3; k++)
                CHECK_EQ(log_says(name[k], "layer wait: spin (--layer-wait auto:") +
                             log_says(name[k], "layer wait: paced (--layer-wait auto:"),
                         1);
        if (!seats) {
                printf("%u CPU: no spin seats, every sender paced\n", cpus);
                return;
        }
        /* Idle for 2 s, the first gives its seat back; then requests waiting for layers on all
         * three: within a heartbeat or two each takes a seat while one is free, so min(seats, 3)
         * are held while they run; after 2 s with none waiting they are given back again. */
        wait_all_free(seats);
        CHECK_EQ(free_seats(seats), seats);
        unsigned probes, least = sim_probing("ipc", 90, name, seats, &probes);
        CHECK_EQ(least, seats - busy);
        double after = wait_all_free(seats);
        unsigned back = free_seats(seats);
        CHECK_EQ(back, seats);
        printf("%u CPUs, %u spin seats: the first prefill instance took one at start, the decode instance "
               "none; with requests waiting on three, %u held; all %u free again %.1f s after the run\n",
               cpus, seats, busy, back, after);
        /* Over tcp the connectors move the bytes: a sender would spin for nothing, and takes none. */
        least = sim_probing("tcp", 60, name, seats, &probes);
        CHECK(probes >= 10);
        CHECK_EQ(least, seats);
        printf("over tcp, with requests waiting on three for %u probes, no seat taken\n", probes);
}

int main(void)
{
        CHECK(mkdtemp(dir));
        in_order();
        killed_and_exec();
        refused();
        instances();
        char cmd[300];
        snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
        CHECK_EQ(system(cmd), 0);
        return 0;
}
