/*
 * kvf-bench-scrape: a paced, bounded /metrics scraper for bench/metrics_bench.sh.
 *
 *   kvf-bench-scrape --port P [--port P ...] [--host 127.0.0.1] [--rate R]
 *                    [--count N] [--expect TEXT] [--path PATH] [--status CODE]
 *
 * One keep-alive HTTP/1.1 connection per port; GETs /metrics at R requests per
 * second in all (an absolute schedule, so a slow answer delays the next GET but
 * never makes a burst larger than one), alternating the ports, until N GETs
 * (0: until SIGTERM or SIGINT). Every answer must be status 200 with a
 * Content-Length body that contains TEXT (default "kvferry_up"); --path and
 * --status ask another page (e.g. a 404's, a server's cost floor). It then prints
 * one line: GETs, their rate, mean latency in microseconds, and this process's
 * own CPU time (user + system) per GET in microseconds, so that a benchmark can
 * tell the scraper's cost from the server's.
 *
 * Exit: 0 every answer verified; 1 a connection or an answer failed; 2 usage.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static const char *prog = "kvf-bench-scrape";

#define MAX_PORTS 8
#define MAX_ANSWER (4u << 20) /* a page far larger than kvf-metrics writes is an error */

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
        (void)sig;
        stop = 1;
}

static uint64_t now_ns(void)
{
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

struct conn {
        int fd;
        unsigned port;
        char req[160]; /* the GET, made once */
        int req_len;
        char *buf; /* bytes read and not yet consumed: buf[0, len) */
        size_t len, cap;
};

static const char *path = "/metrics";
static char want_status[8] = " 200 ";

static int conn_open(struct conn *c, const char *host)
{
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)c->port)};
        if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) {
                fprintf(stderr, "%s: --host '%s' is not an IPv4 address\n", prog, host);
                return -EINVAL;
        }
        c->req_len = snprintf(c->req, sizeof(c->req), "GET %s HTTP/1.1\r\nHost: %s:%u\r\n\r\n",
                              path, host, c->port);
        if (c->req_len <= 0 || c->req_len >= (int)sizeof(c->req)) {
                fprintf(stderr, "%s: --host or --path too long\n", prog);
                return -EINVAL;
        }
        c->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (c->fd < 0)
                return -errno;
        int one = 1;
        setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        if (connect(c->fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                int e = errno;
                fprintf(stderr, "%s: connect to %s:%u: %s\n", prog, host, c->port, strerror(e));
                close(c->fd);
                c->fd = -1;
                return -e;
        }
        return 0;
}

/* Reads more of the answer; 0 on success, <0 on EOF or error (message printed). */
static int conn_fill(struct conn *c)
{
        if (c->cap - c->len < 16384) {
                size_t cap = c->cap ? c->cap * 2 : 65536;
                if (cap > MAX_ANSWER) {
                        fprintf(stderr, "%s: port %u: answer over %u bytes\n", prog, c->port,
                                MAX_ANSWER);
                        return -EMSGSIZE;
                }
                char *b = realloc(c->buf, cap);
                if (!b)
                        return -ENOMEM;
                c->buf = b;
                c->cap = cap;
        }
        for (;;) {
                ssize_t n = read(c->fd, c->buf + c->len, c->cap - c->len);
                if (n > 0) {
                        c->len += (size_t)n;
                        return 0;
                }
                if (n < 0 && errno == EINTR)
                        continue;
                fprintf(stderr, "%s: port %u: %s\n", prog, c->port,
                        n == 0 ? "the server closed the connection" : strerror(errno));
                return n == 0 ? -ECONNRESET : -errno;
        }
}

/* One GET of /metrics and its whole answer, verified; 0 or <0 (message printed). */
static int get_once(struct conn *c, const char *expect, size_t expect_len)
{
        for (int off = 0; off < c->req_len;) {
                ssize_t n = write(c->fd, c->req + off, (size_t)(c->req_len - off));
                if (n < 0 && errno == EINTR)
                        continue;
                if (n <= 0) {
                        fprintf(stderr, "%s: port %u: send: %s\n", prog, c->port, strerror(errno));
                        return -EIO;
                }
                off += (int)n;
        }
        char *eoh;
        while (!c->len || !(eoh = memmem(c->buf, c->len, "\r\n\r\n", 4))) {
                int rc = conn_fill(c);
                if (rc < 0)
                        return rc;
        }
        size_t hlen = (size_t)(eoh - c->buf) + 4;
        *eoh = 0; /* the headers as a string (the body's first byte is read later, not here) */
        if (hlen < 16 || memcmp(c->buf, "HTTP/1.", 7) || memcmp(c->buf + 8, want_status, 5)) {
                fprintf(stderr, "%s: port %u: answer '%.40s', want status%.4s\n", prog, c->port,
                        c->buf, want_status);
                return -EPROTO;
        }
        long long clen = -1;
        for (char *l = strstr(c->buf, "\r\n"); l && l < eoh; l = strstr(l + 2, "\r\n")) {
                if (!strncasecmp(l + 2, "Content-Length:", 15))
                        clen = atoll(l + 17);
        }
        if (clen < 0 || clen > (long long)MAX_ANSWER) {
                fprintf(stderr, "%s: port %u: answer without a usable Content-Length\n", prog,
                        c->port);
                return -EPROTO;
        }
        *eoh = '\r';
        while (c->len < hlen + (size_t)clen) {
                int rc = conn_fill(c);
                if (rc < 0)
                        return rc;
        }
        if (!memmem(c->buf + hlen, (size_t)clen, expect, expect_len)) {
                fprintf(stderr, "%s: port %u: the page (%lld bytes) lacks '%s'\n", prog, c->port,
                        clen, expect);
                return -EPROTO;
        }
        size_t used = hlen + (size_t)clen;
        memmove(c->buf, c->buf + used, c->len - used);
        c->len -= used;
        return 0;
}

static void usage(void)
{
        printf("Usage: %s --port P [--port P ...] [--host ADDR] [--rate R] [--count N] "
               "[--expect TEXT]\n"
               "GET http://ADDR:P/metrics at R requests per second in all (default 400), "
               "alternating the\n"
               "ports, one keep-alive connection each, until N GETs (default 0: until "
               "SIGTERM/SIGINT).\n"
               "Each answer must be 200 with a body containing TEXT (default kvferry_up).\n"
               "--path PATH (default /metrics) and --status CODE (default 200) ask another page.\n"
               "Prints: GETS RATE MEAN_LATENCY_US CPU_US_PER_GET (this process's user + system).\n"
               "Exit: 0 every answer verified; 1 a failure; 2 usage.\n",
               prog);
}

int main(int argc, char **argv)
{
        struct conn conns[MAX_PORTS] = {0};
        unsigned nports = 0;
        const char *host = "127.0.0.1", *expect = "kvferry_up";
        double rate = 400;
        unsigned long long count = 0;
        enum { O_PORT = 1, O_HOST, O_RATE, O_COUNT, O_EXPECT, O_PATH, O_STATUS, O_HELP };
        static const struct option opts[] = {
            {"port", required_argument, 0, O_PORT},   {"host", required_argument, 0, O_HOST},
            {"rate", required_argument, 0, O_RATE},   {"count", required_argument, 0, O_COUNT},
            {"expect", required_argument, 0, O_EXPECT}, {"path", required_argument, 0, O_PATH},
            {"status", required_argument, 0, O_STATUS}, {"help", no_argument, 0, O_HELP},
            {0, 0, 0, 0}};
        int ch;
        char *end;
        while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
                switch (ch) {
                case O_PORT: {
                        unsigned long p = strtoul(optarg, &end, 10);
                        if (*end || !p || p > 65535 || nports == MAX_PORTS) {
                                fprintf(stderr, "%s: --port '%s': want 1 to 65535, at most %d\n",
                                        prog, optarg, MAX_PORTS);
                                return 2;
                        }
                        conns[nports].fd = -1;
                        conns[nports++].port = (unsigned)p;
                        break;
                }
                case O_HOST:
                        host = optarg;
                        break;
                case O_RATE:
                        rate = strtod(optarg, &end);
                        if (*end || !(rate > 0 && rate <= 1e6)) {
                                fprintf(stderr, "%s: --rate '%s': want 0 < R <= 1000000\n", prog,
                                        optarg);
                                return 2;
                        }
                        break;
                case O_COUNT:
                        count = strtoull(optarg, &end, 10);
                        if (*end || optarg[0] == '-') {
                                fprintf(stderr, "%s: --count '%s': want a number\n", prog, optarg);
                                return 2;
                        }
                        break;
                case O_EXPECT:
                        expect = optarg;
                        break;
                case O_PATH:
                        if (optarg[0] != '/' || strpbrk(optarg, " \r\n")) {
                                fprintf(stderr, "%s: --path '%s': want /PATH without spaces\n",
                                        prog, optarg);
                                return 2;
                        }
                        path = optarg;
                        break;
                case O_STATUS: {
                        unsigned long st = strtoul(optarg, &end, 10);
                        if (*end || st < 100 || st > 599) {
                                fprintf(stderr, "%s: --status '%s': want 100 to 599\n", prog,
                                        optarg);
                                return 2;
                        }
                        snprintf(want_status, sizeof(want_status), " %lu ", st);
                        break;
                }
                case O_HELP:
                        usage();
                        return 0;
                default:
                        fprintf(stderr, "Try '%s --help'.\n", prog);
                        return 2;
                }
        }
        if (optind < argc || !nports) {
                fprintf(stderr, "%s: %s\n", prog,
                        nports ? "unexpected argument" : "at least one --port is required");
                return 2;
        }
        struct sigaction sa = {.sa_handler = on_signal};
        sigaction(SIGTERM, &sa, NULL);
        sigaction(SIGINT, &sa, NULL);
        signal(SIGPIPE, SIG_IGN);

        int rc = 0;
        for (unsigned i = 0; i < nports; i++) {
                if (conn_open(&conns[i], host) < 0) {
                        rc = 1;
                        goto out;
                }
        }
        uint64_t period = (uint64_t)(1e9 / rate), lat = 0, t0 = now_ns();
        unsigned long long n = 0;
        while (!stop && (!count || n < count)) {
                uint64_t t = now_ns();
                if (get_once(&conns[n % nports], expect, strlen(expect)) < 0) {
                        rc = 1;
                        goto out;
                }
                lat += now_ns() - t;
                n++;
                uint64_t next = t0 + n * period;
                struct timespec ts = {(time_t)(next / 1000000000ull),
                                      (long)(next % 1000000000ull)};
                while (!stop && now_ns() < next &&
                       clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
                        ;
        }
        double el = (double)(now_ns() - t0) / 1e9;
        struct rusage ru;
        getrusage(RUSAGE_SELF, &ru);
        double cpu_us = (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e6 +
                        (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
        printf("%llu %.1f %.1f %.1f\n", n, el > 0 ? (double)n / el : 0.0,
               n ? (double)lat / 1e3 / (double)n : 0.0, n ? cpu_us / (double)n : 0.0);
out:
        for (unsigned i = 0; i < nports; i++) {
                if (conns[i].fd >= 0)
                        close(conns[i].fd);
                free(conns[i].buf);
        }
        return rc;
}
