/* Small helpers shared by the command-line programs. */
#ifndef KVF_OPTS_H
#define KVF_OPTS_H

#include <stdint.h>

/* Parse a whole decimal number in [min, max]; exits with status 2 and a message otherwise. */
uint64_t kvf_opt_u64(const char *opt, const char *s, uint64_t min, uint64_t max);
/* Exit 2 with "<prog>: <message>\nTry '<prog> --help'." */
void kvf_opt_die(const char *prog, const char *fmt, ...) __attribute__((format(printf, 2, 3), noreturn));
/* Install SIGTERM/SIGINT handlers that set *flag; SIGPIPE ignored. */
/* SIGTERM/SIGINT set *flag to 1 (an atomic store); read it with kvf_load_relaxed. */
void kvf_opt_signals(int *flag);

#endif
