#!/usr/bin/python3
"""Check the session logs of kvf-sim runs killed one after the other (tests/fault_test.sh).

  session_logs_check.py LOG1 LOG2 ... LOGn

Each LOGk is one kvf-sim run's --session-log (tools/sim_sessions.h), in the order the runs
attached; every run but the last was killed with SIGKILL. For every request a killed run
submitted, its end must be known and agree on both sides:
  - its completion reached that run (a C line) or a later run as an earlier session's event
    (a P line tagged with that run's prefill session), never both, never twice;
  - one that the run never saw ended 'finished' or 'engine gone' (status 10);
  - its arrival (an A line, or a Q line tagged with that run's decode session) is 'finished'
    exactly when the completion is, once at most; an 'engine gone' completion has an
    'engine gone' arrival, unless the sender never read the task ("before this task was read").
Prints a summary line and exits 1 on any violation.
"""
import collections
import sys

FINISHED, ENGINE_GONE = 0, 10


def parse(path):
    log = {"H": None, "S": [], "C": collections.defaultdict(list), "A": collections.defaultdict(list),
           "P": [], "Q": []}
    with open(path, errors="replace") as f:
        for line in f:
            parts = line.rstrip("\n").split(" ", 4)
            kind = parts[0]
            if kind == "H":
                log["H"] = (int(parts[1]), int(parts[2]))
            elif kind == "S":
                log["S"].append(parts[1])
            elif kind in "CA" and len(parts) >= 3:
                log[kind][parts[1]].append(int(parts[2]))
            elif kind in "PQ" and len(parts) >= 4:
                log[kind].append((int(parts[1]), parts[2], int(parts[3]), parts[4] if len(parts) > 4 else ""))
    return log


def main(paths):
    logs = [parse(p) for p in paths]
    prev_c = collections.defaultdict(list)  # (prefill session, id) -> [(status, reason)]
    prev_a = collections.defaultdict(list)  # (decode session, id) -> [status]
    for log in logs:
        for sess, rid, st, why in log["P"]:
            prev_c[(sess, rid)].append((st, why))
        for sess, rid, st, why in log["Q"]:
            prev_a[(sess, rid)].append(st)
    bad, missing, checked, gone, fin = [], [], 0, 0, 0
    for k, log in enumerate(logs[:-1]):
        if not log["H"]:
            bad.append("%s: no header line" % paths[k])
            continue
        ps, ds = log["H"]
        for rid in dict.fromkeys(log["S"]):
            checked += 1
            own, earlier = log["C"].get(rid, []), prev_c.get((ps, rid), [])
            where = "%s (run %d, sessions %d/%d)" % (rid, k + 1, ps, ds)
            if len(own) + len(earlier) > 1:
                bad.append("%s: %d completions" % (where, len(own) + len(earlier)))
                continue
            if not own and not earlier:
                missing.append("%s: no completion, neither to its run nor as an earlier session's" % where)
                continue
            st, why = (own[0], "") if own else earlier[0]
            if earlier and st not in (FINISHED, ENGINE_GONE):
                bad.append("%s: ended %d after its session, not 'finished' or 'engine gone': %s" % (where, st, why))
            arrivals = log["A"].get(rid, []) + prev_a.get((ds, rid), [])
            if len(arrivals) > 1:
                bad.append("%s: %d arrivals %s" % (where, len(arrivals), arrivals))
            elif st == FINISHED:
                fin += 1
                if arrivals != [FINISHED]:
                    (bad if arrivals else missing).append(
                        "%s: completion finished, arrival %s" % (where, arrivals or "none"))
            else:
                gone += st == ENGINE_GONE
                if FINISHED in arrivals:
                    bad.append("%s: completion %d, arrival finished" % (where, st))
                elif st == ENGINE_GONE and not arrivals and "before this task was read" not in why and earlier:
                    missing.append("%s: 'engine gone' with no arrival: %s" % (where, why))
    for m in missing + bad:
        print("  " + m, file=sys.stderr)
    print("session logs: %d killed runs, %d requests: %d finished, %d 'engine gone', %d missing, %d violations"
          % (len(logs) - 1, checked, fin, gone, len(missing), len(bad)))
    return 1 if missing or bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
