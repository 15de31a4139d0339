#include "opts.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kvf_opt_die(const char *prog, const char *fmt, ...)
{
        va_list ap;
        fprintf(stderr, "%s: ", prog);
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
        fprintf(stderr, "\nTry '%s --help'.\n", prog);
        exit(2);
}

uint64_t kvf_opt_u64(const char *opt, const char *s, uint64_t min, uint64_t max)
{
        char *end;
        errno = 0;
        unsigned long long v = strtoull(s, &end, 10);
        if (errno || end == s || *end || s[0] == '-' || v < min || v > max)
                kvf_opt_die(program_invocation_short_name, /* glibc: from argv[0] */
                            "--%s wants a whole number from %llu to %llu, not '%s'", opt,
                            (unsigned long long)min, (unsigned long long)max, s);
        return v;
}

static int *stop_flag;

static void on_signal(int sig)
{
        (void)sig;
        if (stop_flag) /* lock-free atomic: async-signal-safe */
                __atomic_store_n(stop_flag, 1, __ATOMIC_RELAXED);
}

void kvf_opt_signals(int *flag)
{
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        stop_flag = flag;
        sa.sa_handler = on_signal;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGTERM, &sa, NULL);
        sigaction(SIGINT, &sa, NULL);
        signal(SIGPIPE, SIG_IGN);
}
