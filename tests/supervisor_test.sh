#!/usr/bin/env bash
# tools/kvferry as a user meets it: exact help texts; bad options, names and addresses refused
# before anything starts, or reported within seconds with this run's message; status and down
# with nothing running; a private run directory; /dev/shm names another user holds refused and
# left alone; no noise in the supervisor's log when a role dies; the demo's options checked and
# its logs removed; kvf-sim's default trace found from any folder.
source "$(dirname "$0")/lib.sh"
K=$ROOT/tools/kvferry
R=$KVFERRY_RUN_DIR
L="--model llama-3.1-8b --tp 8 --cache-mib 64"
SLOW_MS=5000 # "at once": the old supervisor took 30 s; this leaves room for a loaded host

# try NAME CMD...: run CMD; its output in $out (and $R/NAME.out), exit status in $rc, time in $ms
try() {
  local name=$1 t0; shift
  t0=$(date +%s%N)
  rc=0
  "$@" >"$R/$name.out" 2>&1 || rc=$?
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  out=$(cat "$R/$name.out")
}
# has TEXT WHAT / lacks TEXT WHAT: about the last try's output
has() { grep -qF -- "$1" <<<"$out" || fail "$2: the output lacks '$1':"$'\n'"$out"; }
lacks() { ! grep -qF -- "$1" <<<"$out" || fail "$2: the output has '$1':"$'\n'"$out"; }
want_rc() { [ "$rc" = "$1" ] || fail "$2: exit status $rc, want $1:"$'\n'"$out"; }
quick() { [ "$ms" -lt $SLOW_MS ] || fail "$1: took $ms ms"; }
# gone NAME: nothing of a failed up is left running or in /dev/shm
gone() {
  [ ! -e "$R/$1/supervisor.pid" ] || fail "$1: a supervisor pid file is left"
  # The roles its segment names, and (once the segment is gone) those its supervisor logged.
  local left
  left="$(pid_of allocator "$1")$(pid_of connector "$1")$(pid_of sender "$1")$(logged_running "$1")" || true
  [ -z "$left" ] || fail "$1: a role is left running: $left"
  [ ! -e "/dev/shm/kvferry.$1" ] && [ ! -e "/dev/shm/kvferry.$1.cache" ] || fail "$1: shared memory is left"
}
as_nobody() { setpriv --reuid=nobody --regid=nogroup --clear-groups "$@"; }
ROOT_USER=0; [ "$(id -u)" = 0 ] && ROOT_USER=1

# ---- 1. help ----
try help "$K" --help
want_rc 0 "--help"
[ "$(head -n1 <<<"$out")" = "Usage: tools/kvferry COMMAND [options]       (tools/kvferry COMMAND --help: its options)" ] ||
  fail "--help: first line is '$(head -n1 <<<"$out")'"
lacks 'set -euo' "--help (the script's source)"
lacks 'ROOT=' "--help (the script's source)"
top=$out
for c in demo test setup up down status token; do
  grep -q "^  $c " <<<"$top" || fail "--help does not list $c"
  try help-$c "$K" $c --help
  want_rc 0 "$c --help"
  [[ $(head -n1 <<<"$out") == "Usage: tools/kvferry $c"* ]] || fail "$c --help: first line is '$(head -n1 <<<"$out")'"
  lacks 'set -euo' "$c --help"
done
try help-up "$K" up --help
for tool in allocator connector sender; do
  for o in $("$B/kvf-$tool" --help | grep -o -- '--[a-z][a-z-]*' | sort -u); do
    case $o in --instance|--help|--version|--adopt) continue ;; esac
    has "$o" "up --help documents kvf-$tool's $o"
  done
done
has "--streams" "up --help"; has "--zerocopy" "up --help"
try help-demo "$K" demo --help
has "demo-d<PID>" "demo --help names the instances as they are named"
lacks "demo-d0" "demo --help"
try bad-cmd "$K" bogus
want_rc 2 "an unknown command"
pass "help: exact top-level text, every command's own --help, up's lists every option of the roles"

# ---- 2. status and down with nothing running ----
# Other instances on this host may be unreadable to this build (their lines say why): exit 1;
# one being created or gone meanwhile is not an error (kvf-ringdump --all).
json_status() {
  /usr/bin/python3 -c 'import errno,json,sys
inst = json.loads(sys.argv[1])["instances"]
bad = [i for i in inst if i.get("error") and i["errno"] not in (errno.EAGAIN, errno.ENOENT)]
assert sys.argv[2] == ("1" if bad else "0"), "exit status %s with %d unreadable" % (sys.argv[2], len(bad))
names = [i["instance"] for i in inst]
assert not sys.argv[3] or sys.argv[3] in names, names' "$out" "$rc" "${1:-}" || fail "status --json: exit $rc: $out"
}
try status-json "$K" status --json
json_status
if [ $ROOT_USER = 1 ] && unshare -m true 2>/dev/null; then
  # An empty /dev/shm of our own: other instances on this host cannot be stopped for the test.
  try status-none unshare -m sh -c 'mount -t tmpfs none /dev/shm && "$0" status' "$K"
  want_rc 0 "status with nothing running"
  has "no instances are running" "status with nothing running"
  try status-none-json unshare -m sh -c 'mount -t tmpfs none /dev/shm && "$0" status --json' "$K"
  want_rc 0 "status --json with nothing running"
  [ "$out" = '{"instances":[]}' ] || fail "status --json with nothing running: $out"
  pass "status with nothing running: says so, exit 0; --json: {\"instances\":[]}"
else
  echo "skipped: status with nothing running (needs root for a private /dev/shm)"
fi
mkdir "$R/empty"
try down-none env KVFERRY_RUN_DIR="$R/empty" "$K" down --all
want_rc 0 "down --all with nothing up"
has "no instances are up" "down --all with nothing up"
try down-none2 env KVFERRY_RUN_DIR="$R/nonexistent" "$K" down --all
want_rc 0 "down --all without a run directory"
[ ! -e "$R/nonexistent" ] || fail "down --all created the run directory"
pass "status --json lists every instance; down --all with nothing up says so, exit 0"

# ---- 3. bad up options: refused before anything starts, or at once with this run's message ----
for bad in "--model bogus" "--cache-mib abc" "--cache-mib 0" "--cache-mib -5" "--role bogus" \
           "--tp 0" "--streams 99" "--ring-kib 12" "--dtype fp64" "--bogus 1" "--slice-us 50" \
           "--slice-us 100001" "--layer-wait nope"; do
  # shellcheck disable=SC2086
  try bad-opt "$K" up --instance $TAG-b --role decode $L $bad
  want_rc 2 "up $bad"
  quick "up $bad"
  has "${bad%% *}" "up $bad names the option"
  [ ! -e "$R/$TAG-b" ] || fail "up $bad created the instance's folder"
done
try bad-model "$K" up --instance $TAG-b --role decode --model bogus
has "llama-3.1-8b, llama-3.1-70b, qwen2.5-72b, deepseek-v3-mla" "unknown model lists the models"
try bad-role "$K" up --instance $TAG-b --role bogus
has "prefill, decode or mixed" "--role bogus lists the roles"
# The allocator's own refusals, one after the other under one name: each shows its own error.
try no-block "$K" up --instance $TAG-b --role decode --model llama-3.1-70b --tp 8 --cache-mib 1
want_rc 1 "up --cache-mib 1 (no block fits)"
quick "up --cache-mib 1 (no block fits)"
has "holds no block" "up --cache-mib 1"
gone $TAG-b
try too-big "$K" up --instance $TAG-b --role decode $L --cache-mib 99999999
want_rc 1 "up --cache-mib 99999999"
quick "up --cache-mib 99999999"
has "does not fit" "up --cache-mib 99999999"
has "too large" "up --cache-mib 99999999"
has "smaller --cache-mib" "up --cache-mib 99999999"
lacks "holds no block" "up --cache-mib 99999999 (shows the previous run's error)"
lacks "Try 'kvf-allocator --help'" "up --cache-mib 99999999"
gone $TAG-b
pass "bad up options refused at once, naming the option and the valid values; the allocator's errors shown within $ms ms, this run's only"

# ---- 4. instance names ----
for n in "../$TAG-esc" ".$TAG" "$TAG/x" "$(printf 'n%.0s' {1..48})" ""; do
  for c in "up --role decode" "down" "status"; do
    # shellcheck disable=SC2086
    try bad-name "$K" $c --instance "$n"
    want_rc 2 "$c --instance '$n'"
    has "instance name" "$c --instance '$n'"
  done
done
[ ! -e "$(dirname "$R")/$TAG-esc" ] || { rm -rf "$(dirname "$R")/$TAG-esc"; fail "--instance ../x made a folder outside the run directory"; }
pass "instance names checked before anything is made (up, down, status)"

# ---- 6. listen addresses that can never bind ----
try listen-nonlocal "$K" up --instance $TAG-l --role decode $L --listen 192.0.2.1:7100 # TEST-NET-1
want_rc 1 "up --listen 192.0.2.1:7100"
quick "up --listen 192.0.2.1:7100"
has "Cannot assign requested address" "up --listen 192.0.2.1:7100 shows the connector's error"
has "not an address of this host" "up --listen 192.0.2.1:7100"
gone $TAG-l
/usr/bin/python3 -c 'import socket,sys,time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True); time.sleep(120)' >"$R/port" &
holder=$!
AT_EXIT+=("kill $holder 2>/dev/null")
for _ in $(seq 100); do [ -s "$R/port" ] && break; sleep 0.05; done
try listen-busy "$K" up --instance $TAG-l --role decode $L --listen "127.0.0.1:$(cat "$R/port")"
kill $holder 2>/dev/null || true
want_rc 1 "up --listen on a port in use"
quick "up --listen on a port in use"
has "Address already in use" "up --listen on a port in use"
gone $TAG-l
pass "--listen that cannot bind: up fails at once with the connector's message, nothing left running"

# ---- 6b. an rdma device this host does not have ----
AT_EXIT+=("'$K' down --instance $TAG-r >/dev/null 2>&1") # (should an up wrongly succeed)
devs=()
for d in /sys/class/infiniband/*; do [ -e "$d" ] && devs+=("${d##*/}"); done
try rdma-device "$K" up --instance $TAG-r --role decode $L --rdma-device kvf-no-such-dev7
want_rc 1 "up --rdma-device kvf-no-such-dev7"
quick "up --rdma-device kvf-no-such-dev7"
has "--rdma-device kvf-no-such-dev7" "up --rdma-device kvf-no-such-dev7 names the device"
if [ ${#devs[@]} = 0 ]; then
  has "this host has no rdma device" "up --rdma-device kvf-no-such-dev7 on a host without rdma"
else
  has "no such rdma device on this host; it has: ${devs[*]}" "up --rdma-device kvf-no-such-dev7 lists the devices"
fi
gone $TAG-r
[ ! -e "$R/$TAG-r" ] || fail "up --rdma-device kvf-no-such-dev7 left a run directory $R/$TAG-r"
# The connector refuses it too, at its start (a supervisor other than tools/kvferry's): against
# an instance of an allocator alone.
"$B/kvf-allocator" --instance $TAG-r --role decode $L --backend host >"$R/rdma-alloc.log" 2>&1 &
alloc=$!
AT_EXIT+=("kill $alloc 2>/dev/null; wait $alloc 2>/dev/null; '$B/kvf-ctl' unlink --instance $TAG-r --force 2>/dev/null")
"$B/kvf-ctl" wait-ready --instance $TAG-r --roles allocator --timeout-ms 10000 ||
  fail "the allocator of $TAG-r did not become ready: $(cat "$R/rdma-alloc.log")"
try rdma-device-connector timeout 20 "$B/kvf-connector" --instance $TAG-r --rdma-device kvf-no-such-dev7
has "--rdma-device kvf-no-such-dev7" "kvf-connector --rdma-device kvf-no-such-dev7 names the device"
# (ldd read whole: grep -q may close the pipe early, and pipefail would count the SIGPIPE)
if ! grep -q libibverbs <<<"$(ldd "$B/kvf-connector")"; then
  want_rc 2 "kvf-connector --rdma-device kvf-no-such-dev7 (built without rdma)"
  has "built without rdma" "kvf-connector --rdma-device kvf-no-such-dev7 (built without rdma)"
elif [ ${#devs[@]} = 0 ]; then
  want_rc 1 "kvf-connector --rdma-device kvf-no-such-dev7"
  has "this host has no rdma device" "kvf-connector --rdma-device kvf-no-such-dev7 on a host without rdma"
else
  want_rc 1 "kvf-connector --rdma-device kvf-no-such-dev7"
  has "no such rdma device on this host; it has:" "kvf-connector --rdma-device kvf-no-such-dev7 lists the devices"
fi
kill $alloc 2>/dev/null || true
wait $alloc 2>/dev/null || true
"$B/kvf-ctl" unlink --instance $TAG-r 2>/dev/null || true
pass "--rdma-device naming no device of this host: up refuses it before anything starts, the connector at its start (${devs[*]:-no rdma device here})"

# ---- 8. the run directory and its files are ours alone ----
chmod 755 "$R" # as the old script left it
mkdir -m 755 "$R/$TAG-d"
echo "an old line" >"$R/$TAG-d/allocator.log"; chmod 644 "$R/$TAG-d/allocator.log"
up $TAG-d --role decode $L
up $TAG-p --role prefill $L
[ "$(stat -c %a "$R")" = 700 ] || fail "the run directory is $(stat -c %a "$R"), not 700"
for n in $TAG-d $TAG-p; do
  [ "$(stat -c %a "$R/$n")" = 700 ] || fail "$R/$n is $(stat -c %a "$R/$n"), not 700"
  for f in "$R/$n"/*; do
    [ "$(stat -c %a "$f")" = 600 ] || fail "$f is $(stat -c %a "$f"), not 600"
  done
  [ -f "$R/$n/supervisor.pid" ] && [ -f "$R/$n/state" ] && [ -s "$R/$n/allocator.log" ] || fail "$n: files missing"
done
! grep -q "an old line" "$R/$TAG-d/allocator.log" || fail "up appended to the last run's allocator.log"
pass "run directory and instance folders 0700, logs, state and pid files 0600 (existing ones too); logs start afresh"

if [ $ROOT_USER = 1 ]; then
  mkdir "$R/foreign"; chown nobody "$R/foreign"
  try foreign-dir env KVFERRY_RUN_DIR="$R/foreign" "$K" up --instance $TAG-f --role decode $L
  want_rc 1 "up with a run directory of another user"
  has "belongs to user nobody (uid 65534)" "up with a run directory of another user"
  [ -z "$(ls -A "$R/foreign")" ] || fail "up wrote into another user's run directory"
  gone $TAG-f
  try foreign-dir-down env KVFERRY_RUN_DIR="$R/foreign" "$K" down --all
  want_rc 1 "down --all with a run directory of another user"
  has "belongs to user nobody" "down --all with a run directory of another user"

  # Names another user holds: the allocator says whose, at once, and root unlinks nothing.
  for f in "/dev/shm/kvferry.$TAG-sq.cache" "/dev/shm/kvferry.$TAG-sq"; do
    AT_EXIT+=("rm -f '$f'")
    as_nobody touch "$f"
    try squat "$K" up --instance $TAG-sq --role decode $L
    want_rc 1 "up with $f held by nobody"
    quick "up with $f held by nobody"
    has "$f exists and belongs to user nobody (uid 65534): another user holds this instance name; pick another --instance or ask them to remove it" \
      "up with $f held by nobody"
    [ "$(stat -c %U "$f" 2>/dev/null)" = nobody ] || fail "$f of nobody was removed"
    try squat-down "$K" down --instance $TAG-sq
    [ "$(stat -c %U "$f" 2>/dev/null)" = nobody ] || fail "down removed $f of nobody"
    rm -f "$f"
    gone $TAG-sq
  done
  # The same as a user who is not root (a name root holds), where the build allows it.
  if as_nobody test -x "$B/kvf-allocator" -a -r "$ROOT/tools/kvferry" 2>/dev/null; then
    N=$(mktemp -d /tmp/kvferry-test-nobody.XXXXXX); chown nobody:nogroup "$N"
    AT_EXIT+=("rm -rf '$N'" "rm -f /dev/shm/kvferry.$TAG-sn.cache /dev/shm/kvferry.$TAG-sn")
    touch "/dev/shm/kvferry.$TAG-sn.cache"
    try squat-nobody as_nobody env HOME="$N" KVFERRY_RUN_DIR="$N/run" KVFERRY_TOKEN_FILE="$N/token" \
      "$K" up --instance $TAG-sn --role decode $L
    want_rc 1 "up as nobody with a name root holds"
    quick "up as nobody with a name root holds"
    has "/dev/shm/kvferry.$TAG-sn.cache exists and belongs to user root (uid 0): another user holds this instance name" \
      "up as nobody with a name root holds"
    [ -e "/dev/shm/kvferry.$TAG-sn.cache" ] || fail "root's file was removed"
    rm -rf "$N" "/dev/shm/kvferry.$TAG-sn.cache"
    gone $TAG-sn
  else
    echo "skipped: up as a user who is not root (the build is not readable by nobody)"
  fi
  pass "a run directory of another user is refused; names another user holds are refused at once, saying whose, and left alone"
else
  echo "skipped: run directories and names of another user (need root to make them)"
fi

# ---- 7. a role that dies: restarted, and no noise in the supervisor's log ----
kill_role sender $TAG-p
kill_role connector $TAG-d
for n in $TAG-d $TAG-p; do
  grep -q "exited with status 137" "$R/$n/supervisor.log" || fail "$n: no restart logged"
  ! grep -q "No such file" "$R/$n/supervisor.log" || fail "$n: $(grep "No such file" "$R/$n/supervisor.log")"
done
pass "a role killed is restarted, and the supervisor's log says only that"

# ---- 8. a decode instance killed whole (its supervisor too): its segment stays in /dev/shm ----
# The prefill sender must stop using it: its requests in flight end at once ('connection error'),
# and new tasks 'unknown peer', naming the leftover. It used to copy each new request into the
# dead cache and leave it to its request timeout ('timed out', 5 s here).
up $TAG-kd --role decode $L
up $TAG-kp --role prefill $L --request-timeout-ms 5000
"$B/kvf-sim" --quiet --prefill $TAG-kp --decode $TAG-kd --requests 300 --layer-us 200 --timeout-s 60 \
  --json "$R/killed.json" >"$R/killed.txt" 2>&1 &
sim=$!
sleep 1.5
kill -9 "$(cat "$R/$TAG-kd/supervisor.pid")" $(pgrep -f -- "--instance $TAG-kd( |\$)") 2>/dev/null
wait $sim || true
[ "$(json_get "$R/killed.json" unaccounted)" = 0 ] || fail "decode instance killed whole: requests without a completion"
[ "$(json_get "$R/killed.json" corrupt)" = 0 ] || fail "decode instance killed whole: a request reported finished with other bytes"
[ "$(json_get "$R/killed.json" timed_out)" = 0 ] ||
  fail "decode instance killed whole: $(json_get "$R/killed.json" timed_out) requests waited out their timeout"
grep -q "unknown peer" "$R/killed.txt" || fail "decode instance killed whole: no later task ended 'unknown peer':"$'\n'"$(cat "$R/killed.txt")"
grep -q "instance '$TAG-kd' is not running (none of its roles is alive" "$R/$TAG-kp/sender.log" ||
  fail "decode instance killed whole: the sender does not say why it refuses it"
down $TAG-kp
"$K" down --instance $TAG-kd >/dev/null 2>&1 || true # (its leftover shared memory)
pass "a decode instance killed whole: its requests in flight end at once, later tasks 'unknown peer' naming the leftover; none waits out its timeout"

# ---- 8c. down of a prefill instance with requests in flight ----
# Every request it accepted ends with one completion that says how. Its sender refuses new tasks
# at once, gives those in flight up to --stop-drain-ms (2 s) to finish, ends the rest 'connection
# error' saying the instance is stopping (the decode side's arrival says the same), and the
# engine reads every completion after the sender has exited; down returns within the
# supervisor's 5 s grace. (The sender used to exit on SIGTERM at once: no completion at all, and
# the engine waited out its own timeout.) tests/stop_engine.py plays both engines and runs down.
up $TAG-sd --role decode $L
up $TAG-sp --role prefill $L
PYTHONPATH="$ROOT/python" "$ROOT/tests/python_run.sh" "$ROOT/tests/stop_engine.py" $TAG-sp $TAG-sd >"$R/stop.txt" 2>&1 ||
  fail "down of a prefill instance with requests in flight: $(cat "$R/stop.txt")"
grep -q "stopped in [0-9]* ms: of 10 requests in flight, 6 finished and 4 failed (4 ended at the end of the 2000 ms drain window, 0 finish notices withdrawn then, 0 requests in doubt); 1 new tasks refused; every request has had its completion" \
  "$R/$TAG-sp/sender.log" || fail "down of a prefill instance: the sender's last line: $(grep stop "$R/$TAG-sp/sender.log")"
gone $TAG-sp
down $TAG-sd
pass "$(tail -n 1 "$R/stop.txt" | sed 's/^ok: //')"

# ---- 8b. a supervisor killed alone (kill -9, the OOM killer): its roles run on, unsupervised ----
# down stops them itself, as the supervisor would, signalling only processes of ours running
# kvf-ROLE --instance NAME; until then up of the name is refused, naming down; status says so. A
# sleep stands for an unrelated process that down must never signal.
# exited PID: the process is gone, or a zombie (its parent, init now, reaps it when it gets to it)
exited() { ! kill -0 "$1" 2>/dev/null || [ "$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null)" = Z ]; }
# is_ours PID ROLE NAME: tools/kvferry's own check of a pid before down signals it
is_ours() { bash -c 'source "$1"; shift; our_role "$@"' _ "$K" "$@"; }
sleep 60 & bystander=$!
AT_EXIT+=("kill $bystander 2>/dev/null")
up $TAG-ks --role decode $L --metrics 127.0.0.1:0
ks=()
for role in allocator connector sender; do
  p=$(pid_of $role $TAG-ks) || fail "supervisor killed: no $role of $TAG-ks running"
  ks+=("$p")
done
mp=$(logged_running $TAG-ks | sed -n 's/^metrics://p')
[ -n "$mp" ] || fail "supervisor killed: no metrics server of $TAG-ks running"
sup=$(cat "$R/$TAG-ks/supervisor.pid")
kill -KILL "$sup"
for _ in $(seq 500); do exited "$sup" && break; sleep 0.01; done
exited "$sup" || fail "supervisor killed: pid $sup still runs"
for p in "${ks[@]}" "$mp"; do ! exited "$p" || fail "supervisor killed: its role pid $p went with it"; done
try ks-status "$K" status --instance $TAG-ks
want_rc 0 "status of an instance whose supervisor was killed"
has "its supervisor (pid $sup) is gone (killed?)" "status of an instance whose supervisor was killed"
# Its pid taken since by another process (here the sleep's: pid reuse, as after a long time): a
# pid file is not enough to take a process for the supervisor, let alone to signal it.
echo $bystander >"$R/$TAG-ks/supervisor.pid"
try ks-up "$K" up --instance $TAG-ks --role decode $L
want_rc 1 "up of a name whose supervisor was killed, its roles running"
quick "up of a name whose supervisor was killed, its roles running"
has "still running, but without its supervisor" "up of a name whose supervisor was killed"
has "'tools/kvferry down --instance $TAG-ks' first" "up of a name whose supervisor was killed"
grep -q "started metrics (pid $mp)" "$R/$TAG-ks/supervisor.log" || fail "the refused up replaced the last run's supervisor.log"
for p in "${ks[@]}" "$mp"; do ! exited "$p" || fail "the refused up stopped role pid $p"; done
# The check itself: the role it names, of this instance, alive, ours; nothing else.
is_ours "${ks[2]}" sender $TAG-ks || fail "our_role: the sender of $TAG-ks (pid ${ks[2]}) is not taken for it"
is_ours "$mp" metrics $TAG-ks || fail "our_role: the metrics server of $TAG-ks (pid $mp) is not taken for it"
! is_ours "${ks[2]}" connector $TAG-ks || fail "our_role: a sender taken for a connector"
! is_ours "${ks[2]}" sender $TAG-k || fail "our_role: the sender of $TAG-ks taken for one of $TAG-k"
! is_ours $bystander sender $TAG-ks || fail "our_role: a sleep (pid $bystander) taken for a sender"
if [ $ROOT_USER = 1 ]; then
  # A process of another user that runs as kvf-sender --instance NAME: not ours, never signalled.
  # (setpriv itself, not the function as_nobody: $! is then the stand-in's own pid)
  setpriv --reuid=nobody --regid=nogroup --clear-groups \
    bash -c 'cd / && exec -a kvf-sender /usr/bin/python3 -c "import time; time.sleep(60)" --instance "$0"' $TAG-ks &
  np=$!
  AT_EXIT+=("kill $np 2>/dev/null")
  want="kvf-sender -c import time; time.sleep(60) --instance $TAG-ks "
  for _ in $(seq 200); do [ "$(tr '\0' ' ' 2>/dev/null <"/proc/$np/cmdline")" = "$want" ] && break; sleep 0.01; done
  [ "$(tr '\0' ' ' 2>/dev/null <"/proc/$np/cmdline")" = "$want" ] || fail "our_role: the stand-in does not run as '$want'"
  [ "$(stat -c %U "/proc/$np")" = nobody ] || fail "our_role: the stand-in does not run as nobody"
  ! is_ours $np sender $TAG-ks || fail "our_role: a process of user nobody taken for a sender of ours"
  kill $np
fi
try ks-down "$K" down --instance $TAG-ks
want_rc 0 "down of an instance whose supervisor was killed"
quick "down of an instance whose supervisor was killed"
has "instance '$TAG-ks': its supervisor (pid $bystander) is gone (killed?); stopped its roles directly (allocator pid ${ks[0]}, connector pid ${ks[1]}, sender pid ${ks[2]}, metrics pid $mp)" \
  "down of an instance whose supervisor was killed"
has "instance '$TAG-ks' is down" "down of an instance whose supervisor was killed"
for _ in $(seq 100); do
  left=""
  for p in "${ks[@]}" "$mp"; do exited "$p" || left="$left $p"; done
  [ -z "$left" ] && break
  sleep 0.02
done
[ -z "$left" ] || fail "down of an instance whose supervisor was killed: role pids left running:$left"
gone $TAG-ks
[ "$(cat "$R/$TAG-ks/state")" = stopped ] || fail "state after down: $(cat "$R/$TAG-ks/state")"
! exited $bystander || fail "down of an instance whose supervisor was killed stopped an unrelated sleep"
up $TAG-ks --role decode $L
try ks-down2 "$K" down --instance $TAG-ks
want_rc 0 "down after a fresh up of the name"
lacks "directly" "down after a fresh up of the name (its supervisor runs)"
gone $TAG-ks
# A live role that is some other program (an allocator run under a wrapper's name): down and up
# refuse as before, and nothing is signalled.
bash -c 'exec -a kvf-wrapped "$0" --instance "$1" --role decode --model llama-3.1-8b --tp 8 --cache-mib 64 --backend host' \
  "$B/kvf-allocator" $TAG-kw >"$R/kw.log" 2>&1 &
kw=$!
AT_EXIT+=("kill $kw 2>/dev/null; wait $kw 2>/dev/null; '$B/kvf-ctl' unlink --instance $TAG-kw --force 2>/dev/null")
"$B/kvf-ctl" wait-ready --instance $TAG-kw --roles allocator --timeout-ms 15000 || fail "a wrapped allocator: $(cat "$R/kw.log")"
try kw-down "$K" down --instance $TAG-kw
want_rc 1 "down of an instance whose allocator is another program"
has "not under a supervisor of yours that down can find" "down of an instance whose allocator is another program"
lacks "directly" "down of an instance whose allocator is another program"
! exited $kw || fail "down stopped an allocator run under another program's name"
try kw-up "$K" up --instance $TAG-kw --role decode $L
want_rc 1 "up of a name an allocator of another program holds"
has "not under a supervisor of yours" "up of a name an allocator of another program holds"
! exited $kw || fail "up stopped an allocator run under another program's name"
kill $kw; wait $kw 2>/dev/null || true
"$K" down --instance $TAG-kw >/dev/null 2>&1 || true # (its shared memory)
[ ! -e "/dev/shm/kvferry.$TAG-kw" ] || fail "a wrapped allocator's shared memory is left"
kill $bystander
pass "a supervisor killed alone: status says so, up is refused naming down, down stops its roles and metrics (pids checked: a sleep, in the supervisor's pid file too, another user's process, a role of another name or kind are not taken) and a fresh up works; a role that is another program is left alone"

# ---- 10b. a role that does not stop: the logs say where it was ----
# A stopped sender (SIGSTOP: it cannot act on TERM) is named with its state after 4 s and killed
# after 5; a stopped supervisor is killed with its group by down after 10 s, each process named.
up $TAG-hs --role prefill $L
hp=$(pid_of sender $TAG-hs) || fail "no sender pid for $TAG-hs"
kill -STOP "$hp"
try hs-down "$K" down --instance $TAG-hs
want_rc 0 "down of an instance whose sender is stopped"
SL="$R/$TAG-hs/supervisor.log"
grep -q "the sender has not stopped in 4 s: kvf-sender (pid $hp, state T" "$SL" ||
  fail "the supervisor did not name the stopped sender: $(tail -n 4 "$SL")"
grep -q "not stopped in 5 s, killing: kvf-sender (pid $hp, state T" "$SL" ||
  fail "the supervisor did not name what it killed: $(tail -n 4 "$SL")"
! kill -0 "$hp" 2>/dev/null || fail "the stopped sender (pid $hp) still runs after down"
up $TAG-hs --role prefill $L
kill -STOP "$(cat "$R/$TAG-hs/supervisor.pid")"
try hs-down2 "$K" down --instance $TAG-hs
has "supervisor did not stop in 10 s; killing its process group: bash (pid" "down of a stopped supervisor"
has "kvf-sender (pid" "down of a stopped supervisor (its roles named)"
pass "a role or supervisor that does not stop: the supervisor's log and down name each process left with its state and kernel wait, then kill it"

# ---- 11. the scheduler slice (common/sched_slice.h) ----
# slices NAME: "role:slice_us:kernel" for sender, connector, allocator, where kernel is the se.slice
# (us) every thread of the role has in /proc/PID/task/*/sched ("-" where that file is not
# there; "mixed" when the threads differ).
slices() {
  "$B/kvf-ringdump" --instance "$1" --json --records 0 | /usr/bin/python3 -c '
import glob, json, sys
for r in json.load(sys.stdin)["roles"]:
    if r["role"] == "engine": continue
    k = set()
    for f in glob.glob("/proc/%d/task/*/sched" % r["pid"]):
        for line in open(f):
            if line.startswith("se.slice"): k.add(int(line.split(":")[1]) // 1000)
    kern = "-" if not k else str(k.pop()) if len(k) == 1 else "mixed"
    print("%s:%d:%s" % (r["role"], r["slice_us"], kern))'
}
got=$(slices $TAG-p)
if grep -q "scheduler slice left at the kernel's default" "$R/$TAG-p/sender.log"; then
  # A kernel before 6.12 (or a sandbox that refuses sched_setattr): said in the log, shown as
  # the default, and nothing else changes.
  grep -qx "sender:0:.*" <<<"$got" || fail "slice on a kernel that ignores it: $got"
  pass "scheduler slice: not to be had here ($(grep -o "asked 100 us): [^;]*" "$R/$TAG-p/sender.log" | head -1)); the roles say so and run on"
else
  for want in "sender:100:" "connector:100:"; do
    grep -q "^$want" <<<"$got" || fail "slice: want $want in ring-dump: $got"
    grep -q "^$want\(100\|-\)$" <<<"$got" || fail "slice: the kernel's view differs from ring-dump (or between threads): $got"
  done
  grep -q "^allocator:0:" <<<"$got" || fail "slice: the allocator keeps the kernel's default: $got"
  # (the restarted sender of section 7 is among them: a restart asks again)
  grep -q "scheduler slice 100 us" "$R/$TAG-p/connector.log" || fail "slice: the connector's log does not say it"
  # 0: the kernel's default; a policy the user chose (SCHED_BATCH through chrt) is left alone.
  up $TAG-s --role decode $L --slice-us 0
  got=$(slices $TAG-s)
  grep -q "^sender:0:" <<<"$got" && grep -q "^connector:0:" <<<"$got" || fail "--slice-us 0: $got"
  ! grep -q "scheduler slice" "$R/$TAG-s/sender.log" || fail "--slice-us 0 logged a slice"
  down $TAG-s
  STARTED+=("$TAG-s")
  chrt --batch 0 "$K" up --instance $TAG-s --role decode $L >/dev/null || fail "up under chrt --batch"
  got=$(slices $TAG-s)
  grep -q "^sender:0:" <<<"$got" || fail "SCHED_BATCH roles: $got"
  grep -q "another policy than SCHED_OTHER" "$R/$TAG-s/sender.log" || fail "SCHED_BATCH: the sender's log does not say why"
  [ "$(chrt -p "$(pid_of sender $TAG-s)" | grep -c SCHED_BATCH)" = 1 ] || fail "SCHED_BATCH: the sender's policy changed"
  down $TAG-s
  pass "scheduler slice: sender and connector (every thread) at 100 us, a restarted role too, shown by ring-dump; 0 and a user's SCHED_BATCH left alone"
fi

# ---- 12. the sender's wait for layers (--layer-wait) ----
# auto spins while it holds one of the host's spin seats (one per 2 CPUs, shared by every sender
# of this user: common/cpus.h; this test's own under $KVFERRY_SPIN_SEATS), and the sender's log
# says which it took and why. auto_ok NAME OTHERS: the log's line of auto follows the rule, with
# at most OTHERS seats held by other senders; the CPUs it counted are the affinity's (or fewer,
# by a cgroup's quota). Echoes the CPUs and by what.
affinity=$(/usr/bin/python3 -c 'import os; print(len(os.sched_getaffinity(0)))')
auto_ok() {
  local line mode n by seats
  line=$(grep 'layer wait:' "$R/$1/sender.log") || fail "$1: no 'layer wait' line in the sender's log"
  if [[ "$line" == *"layer wait: spin (--layer-wait auto: spin seat "* ]]; then
    mode=spin
    read -r seats n by < <(sed -n 's/.*spin seat [0-9]* of \([0-9]*\): one per 2 of \([0-9]*\) CPUs (by \([A-Za-z ]*\)),.*/\1 \2 \3/p' <<<"$line")
  else
    mode=paced
    read -r n seats by < <(sed -n 's/.*layer wait: paced (--layer-wait auto: \([0-9]*\) CPUs (by \([A-Za-z ]*\)) make \([0-9]*\) spin seats;.*/\1 \3 \2/p' <<<"$line")
  fi
  [ -n "$seats" ] && [ "$seats" = $((n / 2)) ] || fail "$1: auto's seats are not one per 2 CPUs: $line"
  if [ "$seats" -gt "$2" ]; then
    [ $mode = spin ] || fail "$1: a spin seat was free, and auto did not take it: $line"
  elif [ $mode = paced ] && [ "$seats" -gt 0 ]; then
    [[ "$line" == *"all held by other senders"* ]] || fail "$1: paced without saying why: $line"
  elif [ $mode = paced ]; then
    [[ "$line" == *"fewer than 2 CPUs"* ]] || fail "$1: no seats, not said: $line"
  fi
  case "$by" in
    affinity) [ "$n" = "$affinity" ] || fail "$1: $n CPUs by affinity, the affinity has $affinity: $line" ;;
    "cgroup CPU quota") [ "$n" -lt "$affinity" ] || fail "$1: a quota of $n CPUs chosen over $affinity: $line" ;;
    *) fail "$1: CPUs counted by '$by': $line" ;;
  esac
  echo "$n CPUs by $by, $mode"
}
got=$(auto_ok $TAG-p 0)
up $TAG-g --role prefill $L --rank 0 --nranks 2
auto_ok $TAG-g 1 >/dev/null
down $TAG-g
# A container's CPU limit leaves the affinity whole: the sender counts the cgroup's quota.
# Here a cgroup of one CPU (v1's cpu controller, or v2 where it is enabled), as root.
# one_cpu_cgroup: a new cgroup of one CPU that a process of ours can join, in $cg; status 1
# (and none left) where this machine does not let us make one.
one_cpu_cgroup() {
  cg=""
  if [ -w /sys/fs/cgroup/cpu/cpu.cfs_quota_us ] && mkdir /sys/fs/cgroup/cpu/$TAG 2>/dev/null; then
    cg=/sys/fs/cgroup/cpu/$TAG
    { echo 100000 >$cg/cpu.cfs_period_us && echo 100000 >$cg/cpu.cfs_quota_us; } 2>/dev/null || { rmdir $cg; cg=""; }
  elif grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null && mkdir /sys/fs/cgroup/$TAG 2>/dev/null; then
    cg=/sys/fs/cgroup/$TAG
    echo "100000 100000" 2>/dev/null >$cg/cpu.max || { rmdir $cg; cg=""; }
  fi
  [ -n "$cg" ] || return 1
  (echo $BASHPID >$cg/cgroup.procs) 2>/dev/null && return 0 # (a subshell that joins, then ends)
  rmdir $cg; cg=""
  return 1
}
cg=""
if [ $ROOT_USER = 1 ] && one_cpu_cgroup; then
  # (up runs in a subshell that joined the cgroup: the instance is recorded here, and whatever
  # happens the cgroup goes once its processes have)
  STARTED+=("$TAG-q")
  AT_EXIT+=("'$K' down --instance $TAG-q >/dev/null 2>&1; for _ in 1 2 3 4 5 6 7 8 9 10; do rmdir $cg 2>/dev/null && break; sleep 0.2; done")
  (echo $BASHPID >$cg/cgroup.procs && up $TAG-q --role prefill $L) || fail "up in a cgroup of one CPU"
  got_q=$(auto_ok $TAG-q 2)
  grep -q "layer wait: paced (--layer-wait auto: 1 CPUs" "$R/$TAG-q/sender.log" || fail "one CPU by quota: $got_q"
  down $TAG-q
  for _ in 1 2 3 4 5 6 7 8 9 10; do rmdir $cg 2>/dev/null && break; sleep 0.2; done
  [ ! -d $cg ] || fail "the test's cgroup $cg still has processes: $(cat $cg/cgroup.procs)"
  got="$got; in a cgroup of one CPU: paced ($got_q)"
else
  got="$got; a cgroup quota not tried (needs root and a cpu controller that takes a new cgroup)"
fi
# What it does: a spinning sender keeps its CPU between a step's layers; a paced one sleeps
# (about once a layer). Its voluntary context switches over the same run of 640 layers tell.
# And once no layer comes, a spinning sender stops within 20 ms: a second idle costs it almost
# no CPU.
# vcsw NAME: the instance's sender's voluntary context switches so far, all threads
vcsw() {
  local p t n=0; p=$(pid_of sender "$1") || fail "no sender for $1"
  for t in /proc/$p/task/*/status; do n=$((n + $(sed -n 's/^voluntary_ctxt_switches:[[:space:]]*//p' "$t"))); done
  echo $n
}
# cpu_ms NAME: the CPU time of the instance's sender so far (user + system), ms
cpu_ms() {
  local p; p=$(pid_of sender "$1") || fail "no sender for $1"
  /usr/bin/python3 -c 'import os,sys; f=open("/proc/%s/stat" % sys.argv[1]).read().rsplit(")",1)[1].split(); print((int(f[11]) + int(f[12])) * 1000 // os.sysconf("SC_CLK_TCK"))' "$p"
}
declare -A sw
for mode in spin paced; do
  up $TAG-w --role prefill $L --layer-wait $mode
  grep -q "layer wait: $mode (--layer-wait $mode)" "$R/$TAG-w/sender.log" || fail "--layer-wait $mode: not in the log"
  v0=$(vcsw $TAG-w)
  "$B/kvf-sim" --quiet --verify sample --prefill $TAG-w --decode $TAG-d --requests 20 --max-tokens 2048 \
    --layer-us 2000 --step-tokens 1 --json "$R/lw.json" >"$R/lw.out" 2>&1 || fail "kvf-sim, --layer-wait $mode: $(cat "$R/lw.out")"
  [ "$(json_get "$R/lw.json" finished)" = 20 ] || fail "--layer-wait $mode: $(cat "$R/lw.out")"
  sw[$mode]=$(( $(vcsw $TAG-w) - v0 ))
  if [ $mode = spin ]; then
    c0=$(cpu_ms $TAG-w); sleep 1; idle_ms=$(( $(cpu_ms $TAG-w) - c0 ))
    [ $idle_ms -lt 300 ] || fail "--layer-wait spin: the sender used $idle_ms ms of CPU in 1 s with no layer coming"
  fi
  down $TAG-w
done
[ $(( sw[spin] * 3 )) -lt "${sw[paced]}" ] ||
  fail "--layer-wait: the sender slept ${sw[spin]} times spinning and ${sw[paced]} times paced over 640 layers"
pass "--layer-wait: auto spins on a free spin seat (one per 2 CPUs of the host) and says so ($got); over 640 layers a spinning sender slept ${sw[spin]} times, a paced one ${sw[paced]}; idle afterwards it used $idle_ms ms of CPU in 1 s"

# ---- 10. kvf-sim's default trace, from a folder that is not the repository ----
(cd / && "$B/kvf-sim" --quiet --prefill $TAG-p --decode $TAG-d --requests 5 >"$R/sim.out" 2>&1) ||
  fail "kvf-sim from / without --trace: $(cat "$R/sim.out")"
pass "kvf-sim finds its default trace from /"

# ---- 2 again: status of a running instance ----
try status-one "$K" status --instance $TAG-d
want_rc 0 "status --instance"
has "instance $TAG-d" "status --instance"
try status-json "$K" status --json
json_status $TAG-d
down $TAG-d
try status-gone "$K" status --instance $TAG-d
want_rc 1 "status --instance of an instance that is down"
pass "status --instance and --json show running instances; an instance that is down: exit 1"

# ---- 5. the demo ----
try dm-bad "$K" demo --bogus 1
want_rc 2 "demo --bogus 1"
quick "demo --bogus 1"
has "--bogus" "demo --bogus 1"
try dm-bad2 "$K" demo --requests 0
want_rc 2 "demo --requests 0"
try dm-bad3 "$K" demo --cache-mib 64 --verify everything
want_rc 2 "demo --verify everything"
has "--verify is full or sample" "demo --verify everything (kvf-sim's message)"
! ls -d "$R"/demo-*/ >/dev/null 2>&1 || fail "a refused demo left instance folders"
try dm-run bash -c 'cd / && exec "$0" demo --requests 10 --cache-mib 64 --quiet' "$K"
want_rc 0 "demo --requests 10 --cache-mib 64"
has "OK: every request finished and verified" "demo (strict: every request must finish)"
has "starting decode instance demo-d" "demo"
! ls -d "$R"/demo-*/ >/dev/null 2>&1 || fail "the demo left its instances' folders: $(ls -d "$R"/demo-*/)"
pass "demo: its options and kvf-sim's checked before anything starts; a run from / passes and removes its logs"

# ---- 9. nothing of ours outside our run directory ----
if ls -d "/tmp/kvferry-$(id -u)/$TAG"-* >/dev/null 2>&1; then
  fail "instances logged into /tmp/kvferry-$(id -u): $(ls -d "/tmp/kvferry-$(id -u)/$TAG"-*)"
fi
pass "every instance logged into this test's run directory"
