#!/usr/bin/env bash
# Faults under a sustained transfer: SIGKILL the prefill sender, the prefill connector and the
# decode connector at random moments, many times each, while kvf-sim moves requests between a
# prefill and a decode instance. The supervisor restarts each role; every request must end with
# exactly one completion (the simulator counts duplicates as corruption), nothing whose bytes
# differ may be reported finished, nothing may hang, and the two sides must agree: no request
# reported failed whose arrival was finished (the decode connector is also stopped for its
# peer's whole timeout and killed at the moment it expires). Then the engine itself (the
# simulator) is killed and restarted mid-run, again and again: every request of a killed engine
# session must end 'finished' or 'engine gone', the same on both sides, once, and never be
# delivered to the next session as its own (tests/session_logs_check.py reads their logs).
# Every random choice (which role next, when, for how long, the simulators' workloads) comes from
# one seed: KVF_FAULT_SEED, else a random one; it is printed at the start and in a failure, so a
# run can be replayed (the same faults at the same moments; the timing of the system itself
# still varies).
SEED=${KVF_FAULT_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
[[ $SEED =~ ^[0-9]+$ ]] || { echo "KVF_FAULT_SEED must be a decimal number, not '$SEED'" >&2; exit 1; }
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
RANDOM=$SEED
echo "fault_test: seed $SEED (replay with KVF_FAULT_SEED=$SEED)"
fail() { failed=1; echo "FAIL: $* (replay with KVF_FAULT_SEED=$SEED)" >&2; exit 1; }
# Any other way out with an error says it too (run by lib.sh's cleanup, whose exit status is $rc).
said_seed() { [ "$rc" = 0 ] || [ -n "${failed:-}" ] || echo "fault_test failed: replay with KVF_FAULT_SEED=$SEED" >&2; }
AT_EXIT+=(said_seed)
# sim_seed: $simseed, a seed for the next kvf-sim, from ours (in this shell: a subshell's RANDOM is
# seeded afresh)
sim_seed() { simseed=$(( RANDOM * 32768 + RANDOM )); }
KILLS=${KVF_FAULT_KILLS:-8}          # per role
STOPS=${KVF_FAULT_STOPS:-3}          # decode connector stopped past the peer timeout, then killed
ENGINE_KILLS=${KVF_FAULT_ENGINE_KILLS:-6}

L="--model llama-3.1-8b --tp 8 --cache-mib 256"
PTO=3000
up $TAG-d0 --role decode $L --peer-timeout-ms $PTO
up $TAG-p0 --role prefill $L --peer-timeout-ms $PTO
json=$KVFERRY_RUN_DIR/fault.json
sim_seed
"$B/kvf-sim" --prefill $TAG-p0 --decode $TAG-d0 --requests 100000 --layer-us 300 --quiet \
  --timeout-s 90 --seed $simseed --json "$json" >"$KVFERRY_RUN_DIR/sim.txt" 2>&1 &
sim=$!

kills=0
declare -A killed=() # "ROLE INSTANCE" -> SIGKILLs made
targets=("sender $TAG-p0" "connector $TAG-p0" "connector $TAG-d0")
for round in $(seq "$KILLS"); do
  # each role once a round, in an order drawn from the seed
  order=("${targets[@]}")
  for i in 2 1; do
    j=$(( RANDOM % (i + 1) )) t=${order[$i]}
    order[$i]=${order[$j]} order[$j]=$t
  done
  for target in "${order[@]}"; do
    set -- $target
    sleep "0.$(( RANDOM % 6 + 2 ))"
    kill -0 $sim 2>/dev/null || fail "the simulator stopped early: $(tail -n 5 "$KVFERRY_RUN_DIR/sim.txt")"
    # the supervisor brings it back (it backs off when a role keeps dying)
    kill_role "$1" "$2"
    kills=$((kills + 1))
    killed[$target]=$(( ${killed[$target]:-0} + 1 ))
  done
done
# A decode connector that hangs for the prefill side's whole peer timeout and is killed as it
# expires: notices it received but had not answered are in doubt, never failed on their own.
for round in $(seq "$STOPS"); do
  sleep "0.$(( RANDOM % 6 + 2 ))"
  p=$(pid_of connector $TAG-d0) || fail "no connector of $TAG-d0 running"
  kill -STOP "$p"
  sleep "$(( PTO / 1000 )).$(( RANDOM % 3 ))"
  kill_role connector $TAG-d0
  kills=$((kills + 1))
  killed["connector $TAG-d0"]=$(( ${killed["connector $TAG-d0"]:-0} + 1 ))
done
echo "killed $kills roles; stopping the simulator"
kill -TERM $sim 2>/dev/null || true
rc=0; wait $sim || rc=$?
cat "$KVFERRY_RUN_DIR/sim.txt" | tail -n 12
[ -f "$json" ] || fail "no summary from the simulator (rc $rc)"
[ "$(json_get "$json" corrupt)" = 0 ] || fail "a request was reported finished with bytes that differ, or twice"
[ "$(json_get "$json" unaccounted)" = 0 ] || fail "requests without a completion: $(json_get "$json" unaccounted)"
[ "$(json_get "$json" finished_but_failed_pairs)" = 0 ] ||
  fail "the two sides disagree: $(json_get "$json" finished_but_failed_pairs) requests failed on the prefill side but arrived finished"
[ "$(json_get "$json" finished)" -ge 10 ] || fail "too few requests finished under faults"
# crashes INSTANCE -> the supervisor's lines about a role that died of a signal other than our
# SIGKILL (exit status 128 + the signal)
crashes() {
  awk '/exited with status/ { for (i = 1; i < NF; i++) if ($i == "status" && $(i + 1) + 0 > 128 && $(i + 1) + 0 != 137) print }' \
    "$KVFERRY_RUN_DIR/$1/supervisor.log"
}
# Whatever fails, a crash is said (it is likely the cause).
said_crashes() {
  local inst c
  for inst in $TAG-p0 $TAG-d0; do
    c=$(crashes $inst)
    [ -z "$c" ] || echo "NOTE: a role of $inst crashed:"$'\n'"$c" >&2
  done
}
AT_EXIT+=(said_crashes)
# restarts: every kill is a restart, counted by the instance and in the role's slot. More is
# possible only if a role died of something else: said, with the supervisor's account of it;
# a role that died of a signal other than our SIGKILL crashed, which fails the test. Sets $said.
restarts() {
  local inst want role got slots n
  said=""
  for inst in $TAG-p0 $TAG-d0; do
    want=0
    for role in allocator connector sender; do want=$((want + ${killed["$role $inst"]:-0})); done
    got=$(counter $inst restarts)
    [ "$got" -ge "$want" ] || fail "$inst counted $got restarts, after $want kills"
    slots=$("$B/kvf-ringdump" --instance $inst --json --records 0 |
      /usr/bin/python3 -c 'import json,sys; print(" ".join("%s:%d" % (r["role"], r["restarts"]) for r in json.load(sys.stdin)["roles"]))')
    for role in allocator connector sender; do
      n=$(tr ' ' '\n' <<<"$slots" | sed -n "s/^$role://p")
      [ "$n" -ge "${killed["$role $inst"]:-0}" ] || fail "$inst: the $role's slot counts $n restarts, after ${killed["$role $inst"]:-0} kills"
    done
    if [ "$got" != "$want" ]; then
      echo "NOTE: $inst restarted $((got - want)) more times than it was killed ($got restarts, $want kills; slots: $slots); its supervisor says:"
      grep "exited with status" "$KVFERRY_RUN_DIR/$inst/supervisor.log" | sed 's/^/  /'
    fi
    [ -z "$(crashes $inst)" ] || fail "$inst: a role crashed"
    said+="${said:+, }$inst $got restarts for $want kills"
  done
}
restarts
pass "$kills SIGKILLs: $(json_get "$json" finished) finished and verified, $(json_get "$json" failed) failed with a status, none corrupt, none lost, both sides agreeing; $said"

# The engine killed and restarted, ipc and tcp: each run attaches as a new engine session.
for transport in ipc tcp; do
  logs=()
  for run in $(seq "$ENGINE_KILLS"); do
    log=$KVFERRY_RUN_DIR/engine-$transport-$run.log
    logs+=("$log")
    sim_seed
    "$B/kvf-sim" --prefill $TAG-p0 --decode $TAG-d0 --requests 100000 --layer-us 300 --quiet \
      --transport $transport --late-pct 20 --session-log "$log" --timeout-s 60 --seed $simseed \
      >"$KVFERRY_RUN_DIR/engine-$transport-$run.txt" 2>&1 &
    esim=$!
    sleep "$(( RANDOM % 2 + 1 )).$(( RANDOM % 10 ))"
    kill -0 $esim 2>/dev/null || fail "engine run $run stopped early: $(tail -n 5 "$KVFERRY_RUN_DIR/engine-$transport-$run.txt")"
    kill -KILL $esim
    wait $esim 2>/dev/null || true
  done
  # The last run finishes, and takes what is left of the earlier sessions' events.
  log=$KVFERRY_RUN_DIR/engine-$transport-last.log
  logs+=("$log")
  ejson=$KVFERRY_RUN_DIR/engine-$transport.json
  sim_seed
  "$B/kvf-sim" --prefill $TAG-p0 --decode $TAG-d0 --requests 60 --layer-us 300 --quiet \
    --transport $transport --session-log "$log" --drain-previous-s 3 --seed $simseed --json "$ejson" \
    >"$KVFERRY_RUN_DIR/engine-$transport-last.txt" 2>&1 ||
    fail "the engine's last run ($transport) failed: $(tail -n 5 "$KVFERRY_RUN_DIR/engine-$transport-last.txt")"
  [ "$(json_get "$ejson" corrupt)" = 0 ] || fail "$transport: a request of a new engine session was corrupt"
  [ "$(json_get "$ejson" finished)" = 60 ] || fail "$transport: the new engine's requests did not all finish"
  /usr/bin/python3 "$ROOT/tests/session_logs_check.py" "${logs[@]}" ||
    fail "$transport: requests of killed engine sessions did not end the same way on both sides"
  pass "engine killed and restarted $ENGINE_KILLS times ($transport): every request of a killed session ended 'finished' or 'engine gone' on both sides, once; the last session's 60 verified"
done
restarts
pass "no role restarted but those killed, none crashed: $said"
