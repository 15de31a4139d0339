/*
 * kvf-sim --session-log FILE: what an engine killed mid-run leaves behind,
 * for the fault test to check that every request of an ended engine session
 * ended the same way on both sides.
 *
 * The log is one line per event, written with one write(2) each, so a
 * SIGKILL loses nothing already logged:
 *   H <prefill session> <decode session>   first line: this run's engine sessions
 *   S <id>                                 a task submitted
 *   C <id> <status>                        its completion (status as a number)
 *   A <id> <status>                        its arrival
 *   P <session> <id> <status> <reason>     a completion of an earlier session (kvf_poll_previous)
 *   Q <session> <id> <status> <reason>     an arrival of an earlier session
 * tests/fault_test.sh reads all the logs of a run.
 */
#ifndef KVF_SIM_SESSIONS_H
#define KVF_SIM_SESSIONS_H

#include <stdbool.h>
#include <stdint.h>

#include "kvferry.h"

/* Open the log (append) and write the header; 0 or -errno. */
int simlog_open(const char *path, uint64_t prefill_session, uint64_t decode_session);
/* One event line; no-op without a log. */
void simlog_event(char kind, const char *id, int status);
/* Take every earlier session's event one instance's clients kept (its completions for a
 * prefill instance, its arrivals for a decode one) and log it; returns how many. */
unsigned simlog_previous(struct kvf_group *g, bool decode, unsigned ranks);

#endif
