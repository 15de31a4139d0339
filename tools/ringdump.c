/*
 * kvf-ringdump: print the state of a kvferry instance from its control
 * segment, mapped read-only. Options and main() here; the printing is in
 * ringdump_print.c (so the fuzzer drives the same code).
 *
 * Exit status: 0 printed; 1 the segment is invalid, corrupt, truncated or not
 * ready; 2 bad usage; 3 no such instance or file; 4 could not read it
 * (permission, system error, output failed).
 */
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ctl.h"
#include "err.h"
#include "kvferry.h"
#include "ringdump_print.h"

#define PROG "kvf-ringdump"
#define SHM_DIR "/dev/shm"

enum {
        EXIT_PRINTED = 0,
        EXIT_CORRUPT = 1,
        EXIT_USAGE = 2,
        EXIT_NO_INSTANCE = 3,
        EXIT_CANNOT_READ = 4,
};

struct cfg {
        const char *instance;
        const char *file;
        bool all;
        bool watch;
        double interval_s;
        struct kvf_dump_opts opts;
};

static const char usage_text[] =
    "Usage: " PROG " --instance NAME [options]\n"
    "       " PROG " --file PATH [options]\n"
    "       " PROG " --all [--json] [--watch [SECONDS]]\n"
    "\n"
    "Print the state of a kvferry instance from its control segment\n"
    "(" SHM_DIR "/kvferry.NAME), mapped read-only: header and cache layout, the\n"
    "processes of each role, the six rings and their pending records, doorbells,\n"
    "counters, the error log and the request table. It never changes anything.\n"
    "\n"
    "  -i, --instance NAME     the instance to show\n"
    "  -f, --file PATH         read a segment file (a saved copy, or one in " SHM_DIR ")\n"
    "  -a, --all               one line per instance found in " SHM_DIR "\n"
    "  -j, --json              one JSON object per line instead of text\n"
    "  -w, --watch [SECONDS]   print again every SECONDS (default 1, fractions allowed)\n"
    "                          until Ctrl-C; the screen is cleared only on a terminal\n"
    "  -r, --records N         decode up to N pending records per ring (default 16, 0: none)\n"
    "  -v, --verbose           also print counters that are zero (text)\n"
    "  -h, --help              show this help\n"
    "  -V, --version           show the version\n"
    "\n"
    "Exit status: 0 printed; 1 the segment is invalid, corrupt, truncated or not\n"
    "ready; 2 bad usage; 3 no such instance or file; 4 could not read it\n"
    "(permission or system error). With --watch, errors are reported on stderr\n"
    "while watching goes on, and Ctrl-C exits 0.\n";

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int usage_error(const char *fmt, ...)
{
        va_list ap;

        fprintf(stderr, PROG ": ");
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
        fprintf(stderr, "\nTry '" PROG " --help' for the options.\n");
        return EXIT_USAGE;
}

static bool parse_records(const char *s, unsigned *out)
{
        char *end;
        errno = 0;
        unsigned long v = strtoul(s, &end, 10);
        if (errno || end == s || *end || s[0] == '-' || v > 1000000)
                return false;
        *out = (unsigned)v;
        return true;
}

static bool parse_seconds(const char *s, double *out)
{
        char *end;
        if (!s || !*s || !((*s >= '0' && *s <= '9') || *s == '.'))
                return false; /* no signs, "inf" or "nan" */
        errno = 0;
        double v = strtod(s, &end);
        if (errno || end == s || *end || !isfinite(v) || v < 0.01 || v > 86400)
                return false;
        *out = v;
        return true;
}

static int exit_code_for(int rc)
{
        switch (-rc) {
        case ENOENT:
                return EXIT_NO_INSTANCE;
        case EBADMSG:
        case EPROTO:
        case EAGAIN:
        case EINVAL:
                return EXIT_CORRUPT;
        default:
                return EXIT_CANNOT_READ;
        }
}

static void report(int rc, const struct cfg *cfg)
{
        fprintf(stderr, PROG ": %s\n", kvf_err_msg());
        if (rc == -ENOENT && cfg->instance)
                fprintf(stderr, PROG ": `" PROG " --all` lists the instances on this host\n");
        else if (rc == -EAGAIN)
                fprintf(stderr, PROG ": try again in a moment; if it stays so, the allocator "
                                     "died while creating it\n");
}

/*
 * A segment file truncated while we read it raises SIGBUS on the pages past
 * its new end; turn that into an error instead of a crash. Armed only while
 * attaching and dumping, code that touches the mapping outside of stdio and
 * malloc, so jumping out of the handler leaves both consistent. (The
 * mapping of that one attempt leaks: rare, and bounded by the attempts.)
 */
static sigjmp_buf bus_jmp;
static volatile sig_atomic_t bus_armed;

static void on_sigbus(int sig)
{
        if (bus_armed)
                siglongjmp(bus_jmp, 1);
        signal(sig, SIG_DFL);
        raise(sig);
}

/*
 * Attach (file or instance) read-only and print it, whole or brief, into
 * out: all of it, or nothing when it fails (it is printed into memory first).
 */
static int dump_segment(const char *file, const char *instance, bool brief, FILE *out,
                        const struct kvf_dump_opts *o)
{
        struct kvf_ctl c;
        char *buf = NULL;
        size_t len = 0;
        FILE *m = open_memstream(&buf, &len);
        int rc;

        if (!m)
                return kvf_err_set(-ENOMEM, "out of memory");
        if (sigsetjmp(bus_jmp, 1)) {
                bus_armed = 0;
                rc = kvf_err_set(-EBADMSG,
                                 "%s: the segment file shrank while it was being "
                                 "read (SIGBUS); try again",
                                 file ? file : instance);
                goto out;
        }
        bus_armed = 1;
        rc = file ? kvf_ctl_attach_path(file, false, &c) : kvf_ctl_attach(instance, false, &c);
        if (rc >= 0) {
                rc = brief ? kvf_dump_brief(c.base, c.size, m, o) : kvf_dump(c.base, c.size, m, o);
                if (rc < 0)
                        kvf_err_ctx(rc, "%s", file ? file : instance);
                kvf_ctl_detach(&c);
        }
        bus_armed = 0;
out:
        if (fclose(m) != 0 && rc >= 0)
                rc = kvf_err_set(-ENOMEM, "out of memory");
        if (rc >= 0)
                fwrite(buf, 1, len, out);
        free(buf);
        return rc;
}

/* One instance or file: the frame into out; returns an exit code. */
static int frame_one(const struct cfg *cfg, FILE *out)
{
        int rc = dump_segment(cfg->file, cfg->instance, false, out, &cfg->opts);

        if (rc < 0) {
                report(rc, cfg);
                return exit_code_for(rc);
        }
        return EXIT_PRINTED;
}

static int cmp_names(const void *a, const void *b)
{
        return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Instance names in SHM_DIR, sorted; *n receives the count. */
static int list_instances(char ***out, size_t *n)
{
        DIR *dir = opendir(SHM_DIR);
        char **names = NULL;
        size_t cnt = 0, cap = 0;
        struct dirent *de;
        const char prefix[] = "kvferry.", suffix[] = ".cache";

        *out = NULL;
        *n = 0;
        if (!dir)
                return kvf_err_set(-errno, "cannot list " SHM_DIR ": %s", strerror(errno));
        while ((de = readdir(dir))) {
                size_t len = strlen(de->d_name);
                if (strncmp(de->d_name, prefix, sizeof(prefix) - 1) != 0)
                        continue;
                const char *name = de->d_name + sizeof(prefix) - 1;
                size_t nl = len - (sizeof(prefix) - 1);
                if (nl >= sizeof(suffix) - 1 &&
                    strcmp(name + nl - (sizeof(suffix) - 1), suffix) == 0)
                        continue; /* a host cache file */
                if (kvf_instance_name_check(name) < 0)
                        continue;
                if (cnt == cap) {
                        cap = cap ? cap * 2 : 16;
                        char **nn = realloc(names, cap * sizeof(*names));
                        if (!nn)
                                goto nomem;
                        names = nn;
                }
                if (!(names[cnt] = strdup(name)))
                        goto nomem;
                cnt++;
        }
        closedir(dir);
        if (cnt)
                qsort(names, cnt, sizeof(*names), cmp_names);
        *out = names;
        *n = cnt;
        kvf_err_clear();
        return 0;
nomem:
        closedir(dir);
        for (size_t i = 0; i < cnt; i++)
                free(names[i]);
        free(names);
        return kvf_err_set(-ENOMEM, "out of memory listing " SHM_DIR);
}

/* --all: one line (or JSON object) per instance. */
static int frame_all(const struct cfg *cfg, FILE *out)
{
        char **names;
        size_t n;
        int code = EXIT_PRINTED;
        int rc = list_instances(&names, &n);

        if (rc < 0) {
                fprintf(stderr, PROG ": %s\n", kvf_err_msg());
                return EXIT_CANNOT_READ;
        }
        if (cfg->opts.json)
                fputs("{\"instances\":[", out);
        else if (n)
                kvf_dump_brief_title(out);
        for (size_t i = 0; i < n; i++) {
                if (cfg->opts.json && i)
                        fputc(',', out);
                rc = dump_segment(NULL, names[i], true, out, &cfg->opts);
                if (rc < 0) {
                        kvf_dump_brief_error(out, names[i], rc, kvf_err_msg(), &cfg->opts);
                        /* Not ready is a normal moment of start-up, and one
                         * that vanished between listing and attaching is gone. */
                        if (rc != -EAGAIN && rc != -ENOENT && code == EXIT_PRINTED)
                                code = exit_code_for(rc);
                }
                free(names[i]);
        }
        free(names);
        if (cfg->opts.json)
                fputs("]}\n", out);
        if (!n) {
                fprintf(stderr, PROG ": no kvferry instances on this host (nothing named "
                                     "kvferry.* in " SHM_DIR ")\n");
                code = EXIT_NO_INSTANCE;
        }
        return code;
}

/* Render a frame into memory, then write it at once (no half frames). */
static int frame(const struct cfg *cfg, bool clear)
{
        char *buf = NULL;
        size_t len = 0;
        FILE *m = open_memstream(&buf, &len);
        int code;

        if (!m) {
                fprintf(stderr, PROG ": out of memory\n");
                return EXIT_CANNOT_READ;
        }
        code = cfg->all ? frame_all(cfg, m) : frame_one(cfg, m);
        if (fclose(m) != 0) {
                free(buf);
                fprintf(stderr, PROG ": out of memory\n");
                return EXIT_CANNOT_READ;
        }
        if (clear)
                fputs("\033[H\033[2J", stdout);
        if (clear && !cfg->opts.json) {
                char t[32];
                time_t now = time(NULL);
                struct tm tm;
                strftime(t, sizeof(t), "%H:%M:%S", localtime_r(&now, &tm));
                printf("%s every %g s, Ctrl-C to stop\n\n", t, cfg->interval_s);
        }
        fwrite(buf, 1, len, stdout);
        free(buf);
        if (fflush(stdout) != 0 || ferror(stdout)) {
                fprintf(stderr, PROG ": writing to standard output failed: %s\n", strerror(errno));
                return EXIT_CANNOT_READ;
        }
        return code;
}

static volatile sig_atomic_t stop;

static void on_stop(int sig)
{
        (void)sig;
        stop = 1;
}

static int watch(const struct cfg *cfg)
{
        struct sigaction sa;
        bool clear = !cfg->opts.json && isatty(STDOUT_FILENO);

        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = on_stop;
        sigemptyset(&sa.sa_mask);
        /* No SA_RESTART: the sleep below must end at Ctrl-C. */
        sigaction(SIGINT, &sa, NULL);
        sigaction(SIGTERM, &sa, NULL);
        while (!stop) {
                if (frame(cfg, clear) == EXIT_CANNOT_READ && ferror(stdout))
                        return EXIT_CANNOT_READ;
                uint64_t ns = (uint64_t)(cfg->interval_s * 1e9);
                struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ull),
                                      .tv_nsec = (long)(ns % 1000000000ull)};
                while (!stop && nanosleep(&ts, &ts) != 0 && errno == EINTR) {
                }
        }
        return EXIT_PRINTED;
}

int main(int argc, char **argv)
{
        static const struct option longopts[] = {
            {"instance", required_argument, NULL, 'i'},
            {"file", required_argument, NULL, 'f'},
            {"all", no_argument, NULL, 'a'},
            {"json", no_argument, NULL, 'j'},
            {"watch", optional_argument, NULL, 'w'},
            {"records", required_argument, NULL, 'r'},
            {"verbose", no_argument, NULL, 'v'},
            {"help", no_argument, NULL, 'h'},
            {"version", no_argument, NULL, 'V'},
            {NULL, 0, NULL, 0},
        };
        struct cfg cfg = {
            .interval_s = 1.0,
            .opts = {.records = true, .max_records = KVF_DUMP_DEFAULT_RECORDS, .check_pids = true}};
        int ch;

        while ((ch = getopt_long(argc, argv, "i:f:ajw::r:vhV", longopts, NULL)) != -1) {
                switch (ch) {
                case 'i':
                        if (kvf_instance_name_check(optarg) < 0)
                                return usage_error("--instance: %s", kvf_err_msg());
                        cfg.instance = optarg;
                        break;
                case 'f':
                        if (!*optarg)
                                return usage_error("--file needs a path");
                        cfg.file = optarg;
                        break;
                case 'a':
                        cfg.all = true;
                        break;
                case 'j':
                        cfg.opts.json = true;
                        break;
                case 'w':
                        cfg.watch = true;
                        /* "--watch 2" as well as "--watch=2" */
                        if (!optarg && optind < argc &&
                            parse_seconds(argv[optind], &cfg.interval_s))
                                optind++;
                        else if (optarg && !parse_seconds(optarg, &cfg.interval_s))
                                return usage_error("--watch: '%s' is not a number of seconds in "
                                                   "[0.01, 86400]",
                                                   optarg);
                        break;
                case 'r':
                        if (!parse_records(optarg, &cfg.opts.max_records))
                                return usage_error("--records: '%s' is not a count in [0, 1000000]",
                                                   optarg);
                        cfg.opts.records = cfg.opts.max_records > 0;
                        break;
                case 'v':
                        cfg.opts.verbose = true;
                        break;
                case 'h':
                        fputs(usage_text, stdout);
                        return EXIT_PRINTED;
                case 'V':
                        printf(PROG " (kvferry) %s, control segment layout version %u\n",
                               KVFERRY_VERSION, KVF_LAYOUT_VERSION);
                        return EXIT_PRINTED;
                default:
                        fprintf(stderr, "Try '" PROG " --help' for the options.\n");
                        return EXIT_USAGE;
                }
        }
        if (optind < argc)
                return usage_error("unexpected argument '%s' (instances are named with "
                                   "--instance NAME)",
                                   argv[optind]);
        if ((cfg.instance != NULL) + (cfg.file != NULL) + cfg.all != 1)
                return usage_error("name exactly one of --instance NAME, --file PATH or --all");

        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = on_sigbus;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGBUS, &sa, NULL);

        if (cfg.watch)
                return watch(&cfg);
        return frame(&cfg, false);
}
