#!/usr/bin/env bash
# Same-host notices in one hop (notice rings, the default) under crashes, with real instances:
# - the prefill sender killed while it holds a notice slot whose notices are not answered yet
#   (the decode connector stopped): its successor re-claims the same slot and every request
#   ends once, finished, on both sides;
# - the decode connector killed while notices sit in a slot's ring: its successor reads them
#   from the ring (they outlive it) and answers each once;
# - the decode instance re-created under the same name (a new segment): the prefill sender
#   drops the old mapping and its slot, claims one in the new segment, and new requests finish.
# kvf-sim verifies every byte of what is reported finished, and that nothing ends twice.
source "$(dirname "$0")/lib.sh"
cd "$ROOT"

L="--model llama-3.1-8b --tp 8 --cache-mib 128"
# Peer and request timeouts far above what a stop lasts here, so that every request finishes.
up $TAG-d --role decode $L --peer-timeout-ms 120000
up $TAG-p --role prefill $L --peer-timeout-ms 120000

# slot_field DECODE OWNER FIELD -> FIELD of the notice slot OWNER holds in DECODE's segment
slot_field() {
  "$B/kvf-ringdump" --instance "$1" --json --records 0 |
    /usr/bin/python3 -c 'import json,sys
s=[x for x in json.load(sys.stdin)["notice_slots"] if x["owner"]==sys.argv[1]]
print(s[0][sys.argv[2]] if len(s)==1 else "")' "$2" "$3"
}

# sim_ok WHAT JSON N: all N requests finished, verified, each once, the sides agreeing
sim_ok() {
  local what=$1 j=$2 n=$3
  [ "$(json_get "$j" finished)" = "$n" ] || fail "$what: $(json_get "$j" finished) of $n finished ($(json_get "$j" failed) failed)"
  [ "$(json_get "$j" corrupt)" = 0 ] || fail "$what: a request was reported finished with bytes that differ, or twice"
  [ "$(json_get "$j" unaccounted)" = 0 ] || fail "$what: requests without a completion"
  [ "$(json_get "$j" finished_but_failed_pairs)" = 0 ] || fail "$what: the two sides disagree"
}

# start_held NAME N: the decode connector stopped, kvf-sim moves N requests whose notices then sit
# unanswered in the slot's notice ring; returns once all N are written there (sim pid in $sim)
start_held() {
  local name=$1 n=$2 w0 t0
  w0=$(slot_field $TAG-d $TAG-p notice_written)
  dc=$(pid_of connector $TAG-d) || fail "$name: no decode connector"
  kill -STOP "$dc"
  "$B/kvf-sim" --quiet --json "$KVFERRY_RUN_DIR/$name.json" --timeout-s 120 --prefill $TAG-p --decode $TAG-d \
    --requests "$n" --max-tokens 64 --step-tokens 65536 --layer-us 0 --prefix-pct 0 --late-pct 0 >"$KVFERRY_RUN_DIR/$name.txt" &
  sim=$!
  t0=$SECONDS
  until [ "$(slot_field $TAG-d $TAG-p notice_written)" -ge $((w0 + n)) ]; do
    [ $((SECONDS - t0)) -lt 60 ] || { kill -CONT "$dc"; fail "$name: the notices never reached the slot's ring"; }
    sleep 0.02
  done
  [ "$(slot_field $TAG-d $TAG-p notice_used)" -gt 0 ] || fail "$name: the slot's notice ring is empty"
}

finish_sim() {
  local name=$1
  wait $sim || { cat "$KVFERRY_RUN_DIR/$name.txt" >&2; fail "$name: kvf-sim failed"; }
}

"$B/kvf-sim" --quiet --json "$KVFERRY_RUN_DIR/warm.json" --prefill $TAG-p --decode $TAG-d --requests 5 \
  --layer-us 0 >/dev/null || fail "warm-up failed"
slot=$(slot_field $TAG-d $TAG-p slot)
[ -n "$slot" ] || fail "the prefill sender holds no notice slot of the decode instance"
pass "the prefill sender holds notice slot $slot of the decode instance"

# 1. The prefill sender dies holding the slot, its notices unanswered.
start_held sender-killed 20
claims0=$(slot_field $TAG-d $TAG-p claims)
kill_role sender $TAG-p
sp=$(pid_of sender $TAG-p) || fail "sender-killed: no sender after the restart"
[ "$(slot_field $TAG-d $TAG-p slot)" = "$slot" ] || fail "sender-killed: the successor holds slot '$(slot_field $TAG-d $TAG-p slot)', not $slot"
[ "$(slot_field $TAG-d $TAG-p pid)" = "$sp" ] || fail "sender-killed: slot $slot is held by pid $(slot_field $TAG-d $TAG-p pid), not the new sender $sp"
[ "$(slot_field $TAG-d $TAG-p claims)" -gt "$claims0" ] || fail "sender-killed: the slot was not claimed again"
kill -CONT "$dc"
finish_sim sender-killed
sim_ok "sender killed holding the slot" "$KVFERRY_RUN_DIR/sender-killed.json" 20
pass "the prefill sender killed while holding slot $slot with 20 notices unanswered: its successor re-claimed the slot, all 20 finished once on both sides"

# 2. The decode connector dies while notices sit in the slot's ring.
start_held connector-killed 20
r0=$(slot_field $TAG-d $TAG-p notice_read)
kill_role connector $TAG-d
finish_sim connector-killed
sim_ok "decode connector killed" "$KVFERRY_RUN_DIR/connector-killed.json" 20
[ "$(slot_field $TAG-d $TAG-p notice_used)" = 0 ] || fail "connector-killed: notices left in the ring"
[ "$(slot_field $TAG-d $TAG-p notice_read)" -ge $((r0 + 20)) ] || fail "connector-killed: the successor read $(( $(slot_field $TAG-d $TAG-p notice_read) - r0 )) notices, not 20"
pass "the decode connector killed with 20 notices in the slot's ring: its successor read and answered them, all 20 finished once"

# 3. The decode instance re-created under the same name: a new segment, new slots.
down $TAG-d
up $TAG-d --role decode $L --peer-timeout-ms 120000
"$B/kvf-sim" --quiet --json "$KVFERRY_RUN_DIR/recreated.json" --timeout-s 60 --prefill $TAG-p --decode $TAG-d \
  --requests 10 --layer-us 0 >"$KVFERRY_RUN_DIR/recreated.txt" || { cat "$KVFERRY_RUN_DIR/recreated.txt" >&2; fail "re-created decode: kvf-sim failed"; }
sim_ok "re-created decode instance" "$KVFERRY_RUN_DIR/recreated.json" 10
[ -n "$(slot_field $TAG-d $TAG-p slot)" ] || fail "re-created decode: the prefill sender holds no slot of the new segment"
[ "$(slot_field $TAG-d $TAG-p notice_written)" -ge 10 ] || fail "re-created decode: the notices did not go through the new segment's slot"
pass "the decode instance re-created: the prefill sender claimed a slot of the new segment, 10 requests finished through it"
