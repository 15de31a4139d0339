#!/usr/bin/env bash
# What tools/kvferry, kvf-ctl and kvf-ringdump tell a user, where they used to tell it wrong:
# the demo's exit status is 0 only when every request was verified; down of an unknown instance
# fails and says so; down finds an instance up under another run directory; up refuses a tp
# that splits the kv heads unevenly, a rank outside nranks, and a missing cache size or shape
# before anything starts; demo --gpu without GPU caches is refused first; up says what it waits
# for; ring-dump's device of a host cache is null; kvf-ctl names an unknown command; a stopped
# instance's state says stopped.
source "$(dirname "$0")/lib.sh"
K=$ROOT/tools/kvferry
R=$KVFERRY_RUN_DIR
L="--model llama-3.1-8b --tp 8 --cache-mib 64"

try() {
  local name=$1; shift
  rc=0
  "$@" >"$R/$name.out" 2>&1 || rc=$?
  out=$(cat "$R/$name.out")
}
has() { grep -qF -- "$1" <<<"$out" || fail "$2: the output lacks '$1':"$'\n'"$out"; }
lacks() { ! grep -qF -- "$1" <<<"$out" || fail "$2: the output has '$1':"$'\n'"$out"; }
want_rc() { [ "$rc" = "$1" ] || fail "$2: exit status $rc, want $1:"$'\n'"$out"; }

# ---- the demo's exit status ----
try demo-ok "$K" demo --requests 10 --cache-mib 128
want_rc 0 "demo --requests 10"
has "result       OK" "demo --requests 10"
try demo-bad "$K" demo --cache-mib 1 --requests 5
want_rc 1 "demo --cache-mib 1 (every request fails: bad task)"
lacks "result       OK" "demo --cache-mib 1"
has "the demo failed" "demo --cache-mib 1"
try demo-rdma "$K" demo --transport rdma --rdma-ip 127.0.0.1 --requests 3 --cache-mib 64
want_rc 1 "demo --transport rdma on 127.0.0.1 (no rdma there: connection errors)"
lacks "result       OK" "demo --transport rdma --rdma-ip 127.0.0.1"
pass "demo: 0 when every request is verified, 1 when any failed (bad task, connection errors)"

try demo-gpu env KVFERRY_RUN_DIR="$R/gpu" "$K" demo --gpu --backend host --requests 5
want_rc 2 "demo --gpu --backend host"
has "--gpu needs GPU caches" "demo --gpu --backend host"
[ ! -e "$R/gpu" ] || fail "demo --gpu --backend host started something ($R/gpu exists)"
if [ "$("$B/kvf-ctl" gpus 2>/dev/null)" = 0 ]; then
  try demo-gpu2 env KVFERRY_RUN_DIR="$R/gpu" KVFERRY_BACKEND=auto "$K" demo --gpu --requests 5
  want_rc 2 "demo --gpu without a GPU"
  has "sees no GPU" "demo --gpu without a GPU"
  [ ! -e "$R/gpu" ] || fail "demo --gpu without a GPU started something"
fi
pass "demo --gpu without GPU caches is refused before anything starts"

# ---- token: never through a link or into another user's file ----
mkdir -p "$R/tok"
ln -s "$R/tok/elsewhere" "$R/tok/link"
try token-link "$K" token --file "$R/tok/link"
want_rc 1 "token --file LINK"
has "is a symbolic link: refusing it" "token --file LINK"
[ ! -e "$R/tok/elsewhere" ] || fail "token --file LINK wrote where the link points"
if [ "$EUID" = 0 ]; then
  : >"$R/tok/theirs"; chmod 666 "$R/tok/theirs"; chown 12345 "$R/tok/theirs"
  try token-foreign "$K" token --file "$R/tok/theirs"
  want_rc 1 "token --file a file of another user's"
  has "belongs to" "token --file a file of another user's"
  [ ! -s "$R/tok/theirs" ] || fail "token --file wrote the token into another user's file"
fi
try token-new "$K" token --file "$R/tok/new"
want_rc 0 "token --file NEW"
[ "$(stat -c %a "$R/tok/new")" = 600 ] && [ "$(wc -c <"$R/tok/new")" = 64 ] || fail "token --file NEW: not 64 characters, mode 0600"
pass "token refuses a link and another user's file, and makes a new one 0600"

# ---- up: refused before anything starts ----
N=$R/never # a run directory that must not be made
for args in "--model llama-3.1-8b --tp 3 --cache-mib 64|--tp 3 does not fit llama-3.1-8b's 8 kv heads" \
            "--model llama-3.1-8b --tp 12 --cache-mib 64|--tp 12 does not fit" \
            "--layers 4 --kv-heads 6 --head-dim 64 --tp 4 --blocks 8|tp must divide them (1, 2, 3, 6)" \
            "$L --rank 3 --nranks 2|--rank 3 is not below --nranks 2" \
            "$L --rank 2|--rank 2 is not below --nranks 1" \
            "--model llama-3.1-8b --tp 8|give --cache-mib N or --blocks N" \
            "--cache-mib 64|give --model NAME, or --layers, --kv-heads and --head-dim" \
            "--layers 4 --kv-heads 8 --cache-mib 64|give --model NAME, or --layers, --kv-heads and --head-dim"; do
  try up-bad env KVFERRY_RUN_DIR="$N" "$K" up --instance $TAG-x --role decode ${args%%|*}
  want_rc 2 "up ${args%%|*}"
  has "${args#*|}" "up ${args%%|*}"
  [ ! -e "$N" ] || fail "up ${args%%|*}: a run directory was made"
  [ ! -e "/dev/shm/kvferry.$TAG-x" ] || fail "up ${args%%|*}: shared memory was made"
done
# Replicated heads (tp a multiple of the heads) and an even split come up.
up $TAG-r --role decode --model llama-3.1-8b --tp 16 --cache-mib 64 --rank 15 --nranks 16
"$B/kvf-ringdump" --instance $TAG-r | grep -q " 1 kv heads," || fail "tp 16 of 8 heads: not one head per rank"
down $TAG-r
pass "up refuses a tp that splits the heads unevenly, a rank >= nranks, a missing size or shape, before anything starts; tp 16 of 8 heads replicates"

# ---- up says what it waits for ----
W=$R/slowbin
mkdir -p "$W"
for f in "$B"/kvf-*; do ln -s "$f" "$W/"; done
rm -f "$W/kvf-allocator"
printf '#!/bin/sh\nsleep 3\nexec "%s" "$@"\n' "$B/kvf-allocator" >"$W/kvf-allocator"
chmod +x "$W/kvf-allocator"
STARTED+=($TAG-slow)
try up-slow env KVFERRY_BUILD="$W" "$K" up --instance $TAG-slow --role decode $L
want_rc 0 "up with a slow allocator"
has "the allocator is creating and touching the cache (64 MiB)" "up with a slow allocator"
pass "up prints what it waits for while the cache is made"

# ---- state, ring-dump's device, down from another run directory, down of an unknown instance ----
[ "$(cat "$R/$TAG-slow/state")" = running ] || fail "state of a running instance: $(cat "$R/$TAG-slow/state")"
"$B/kvf-ringdump" --instance $TAG-slow --json --records 0 | /usr/bin/python3 -c 'import json,sys
d=json.load(sys.stdin); h=d.get("header", d)
assert "device" in h and h["device"] is None, h.get("device")' || fail "ring-dump --json: device of a host cache is not null"
pass "ring-dump --json: a host cache's device is null"

try down-other env KVFERRY_RUN_DIR="$R/elsewhere" "$K" down --instance $TAG-slow
want_rc 0 "down from another run directory"
has "runs under the run directory $R" "down from another run directory"
[ ! -e "/dev/shm/kvferry.$TAG-slow" ] || fail "down from another run directory left the instance running"
[ "$(cat "$R/$TAG-slow/state")" = stopped ] || fail "state after down: $(cat "$R/$TAG-slow/state")"
pass "down from another run directory finds the instance by its segment and stops it; state says stopped"

# A careless `up` of a running name under another run directory (a service's instance and a
# hand-run one): it fails, and must leave the running instance alone (its failure path used to
# `down` the name, which found and stopped the other run directory's supervisor).
up $TAG-o --role decode $L
try up-other env KVFERRY_RUN_DIR="$R/elsewhere" "$K" up --instance $TAG-o --role decode $L
want_rc 1 "up of a running name under another run directory"
for role in allocator connector sender; do
  "$B/kvf-ctl" alive --instance $TAG-o --role $role || fail "a failed up under another run directory stopped the running instance's $role"
done
[ "$(cat "$R/$TAG-o/state")" = running ] || fail "a failed up under another run directory: the running instance's state says $(cat "$R/$TAG-o/state")"
down $TAG-o
pass "a failed up of a running name under another run directory leaves that instance running"

# Two `up`s of one name at once: one comes up, the other says so; nothing is left after down
# (both used to fail, and an orphaned supervisor and allocator stayed 30 s, unseen by down).
for i in 1 2; do
  STARTED+=($TAG-race)
  "$K" up --instance $TAG-race --role decode $L >"$R/race1.out" 2>&1 & a=$!
  "$K" up --instance $TAG-race --role decode $L >"$R/race2.out" 2>&1 & b=$!
  ra=0; rb=0; wait $a || ra=$?; wait $b || rb=$?
  out=$(cat "$R/race1.out" "$R/race2.out")
  [ $((ra + rb)) = 1 ] || fail "two ups at once, round $i: exit statuses $ra and $rb, want one 0 and one 1:"$'\n'"$out"
  grep -qE "being started by another|already up" <<<"$out" || fail "two ups at once: the second does not say why:"$'\n'"$out"
  down $TAG-race
  sleep 0.2
  ! pgrep -f "__supervise $TAG-race " >/dev/null || fail "two ups at once: a supervisor is left after down"
  ! pgrep -f "kvf-allocator --instance $TAG-race " >/dev/null || fail "two ups at once: an allocator is left after down"
done
pass "two ups of one name at once: one comes up, the other says it is being started; nothing left after down"

up $TAG-s --role decode $L
down $TAG-s
[ "$(cat "$R/$TAG-s/state")" = stopped ] || fail "state after down: $(cat "$R/$TAG-s/state")"
try down-nosuch "$K" down --instance nosuch-$TAG
want_rc 1 "down --instance nosuch"
has "is not running" "down --instance nosuch"
lacks "is down" "down --instance nosuch"
pass "down of an unknown instance says it is not running, exit 1; state says stopped after down"

# ---- kvf-ctl ----
try ctl-bogus "$B/kvf-ctl" bogus
want_rc 2 "kvf-ctl bogus"
has "unknown command 'bogus'" "kvf-ctl bogus"
has "wait-ready, unlink, alive and gpus" "kvf-ctl bogus"
lacks "--instance is required" "kvf-ctl bogus"
pass "kvf-ctl names an unknown command and lists the commands"
