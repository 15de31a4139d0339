#!/usr/bin/env bash
# Faults under a sustained transfer: SIGKILL the prefill sender, the prefill connector and the
# decode connector at random moments, many times each, while kvf-sim moves requests between a
# prefill and a decode instance. The supervisor restarts each role; every request must end with
# exactly one completion (the simulator counts duplicates as corruption), nothing whose bytes
# differ may be reported finished, and nothing may hang.
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
KILLS=${KVF_FAULT_KILLS:-8}   # per role

L="--model llama-3.1-8b --tp 8 --cache-mib 256"
up $TAG-d0 --role decode $L --peer-timeout-ms 3000
up $TAG-p0 --role prefill $L --peer-timeout-ms 3000
json=$KVFERRY_RUN_DIR/fault.json
"$B/kvf-sim" --prefill $TAG-p0 --decode $TAG-d0 --requests 100000 --layer-us 300 --quiet \
  --timeout-s 90 --json "$json" >"$KVFERRY_RUN_DIR/sim.txt" 2>&1 &
sim=$!

kills=0
for round in $(seq "$KILLS"); do
  for target in "sender $TAG-p0" "connector $TAG-p0" "connector $TAG-d0"; do
    set -- $target
    sleep "0.$(( RANDOM % 6 + 2 ))"
    kill -0 $sim 2>/dev/null || fail "the simulator stopped early: $(tail -n 5 "$KVFERRY_RUN_DIR/sim.txt")"
    # the supervisor brings it back (it backs off when a role keeps dying)
    kill_role "$1" "$2"
    kills=$((kills + 1))
  done
done
echo "killed $kills roles; stopping the simulator"
kill -TERM $sim 2>/dev/null || true
rc=0; wait $sim || rc=$?
cat "$KVFERRY_RUN_DIR/sim.txt" | tail -n 12
[ -f "$json" ] || fail "no summary from the simulator (rc $rc)"
[ "$(json_get "$json" corrupt)" = 0 ] || fail "a request was reported finished with bytes that differ, or twice"
[ "$(json_get "$json" unaccounted)" = 0 ] || fail "requests without a completion: $(json_get "$json" unaccounted)"
[ "$(json_get "$json" finished)" -ge 10 ] || fail "too few requests finished under faults"
restarts=$(counter $TAG-p0 restarts)
[ "$restarts" -ge "$KILLS" ] || fail "prefill instance counted only $restarts restarts"
pass "$kills SIGKILLs: $(json_get "$json" finished) finished and verified, $(json_get "$json" failed) failed with a status, none corrupt, none lost"
