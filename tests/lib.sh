# Shared by the shell tests: start instances with the real supervisor, stop them whatever happens.
# Usage: source tests/lib.sh; then up NAME --role ... ; sim ... ; everything started is stopped at exit.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export KVFERRY_BUILD=${KVFERRY_BUILD:-$ROOT/build}
B=$KVFERRY_BUILD
if [ -z "${KVFERRY_RUN_DIR:-}" ]; then
  KVFERRY_RUN_DIR=$(mktemp -d /tmp/kvferry-test.XXXXXX)
  OWN_RUN_DIR=1 # ours: removed when the test passes
fi
export KVFERRY_RUN_DIR
export KVFERRY_TOKEN_FILE=${KVFERRY_TOKEN_FILE:-$KVFERRY_RUN_DIR/token}
# The senders' spin seats (--layer-wait auto) of this test's own: which of its instances spin
# does not depend on what other tests run beside it (common/cpus.h).
export KVFERRY_SPIN_SEATS=${KVFERRY_SPIN_SEATS:-$KVFERRY_RUN_DIR/spin-seat}
# Instances keep their caches in host memory unless a test says otherwise (`up` defaults to auto:
# a GPU where one is visible). KVFERRY_TEST_BACKEND=cuda runs the kvf-sim tests on GPU caches.
export KVFERRY_BACKEND=${KVFERRY_TEST_BACKEND:-host}
TAG=t$$
STARTED=()
AT_EXIT=()  # commands a test adds, run at exit before its instances are stopped
UP_WRAP=()  # a prefix for the supervisor command in up() (tcp_test: ip netns exec NS)

cleanup() {
  local rc=$?
  local c
  for c in "${AT_EXIT[@]}"; do eval "$c" || true; done
  if [ ${#STARTED[@]} -gt 0 ]; then
    local args=()
    for n in "${STARTED[@]}"; do args+=(--instance "$n"); done
    "$ROOT/tools/kvferry" down "${args[@]}" >/dev/null 2>&1 || true
  fi
  if [ $rc -ne 0 ] && [ -d "$KVFERRY_RUN_DIR" ]; then
    echo "---- logs ($KVFERRY_RUN_DIR) ----" >&2
    tail -n 20 "$KVFERRY_RUN_DIR"/*/*.log >&2 2>/dev/null || true
  elif [ $rc -eq 0 ] && [ -n "${OWN_RUN_DIR:-}" ]; then
    rm -rf "$KVFERRY_RUN_DIR"
  fi
  exit $rc
}
trap cleanup EXIT

up() {
  local name=$1; shift
  STARTED+=("$name")
  "${UP_WRAP[@]}" "$ROOT/tools/kvferry" up --instance "$name" "$@" >/dev/null
}

down() {
  "$ROOT/tools/kvferry" down --instance "$1" >/dev/null ||
    fail "instance '$1' did not stop cleanly (its supervisor.log says where it was)"
}

fail() { echo "FAIL: $*" >&2; exit 1; }
pass() { echo "ok: $*"; }

# json_get FILE KEY -> value of a top-level key in the simulator's JSON summary
json_get() {
  /usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"
}

# counter INSTANCE NAME -> the instance's counter NAME, from kvf-ringdump
counter() {
  "$B/kvf-ringdump" --instance "$1" --json |
    /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["counters"][sys.argv[1]])' "$2"
}

# wait_counter INSTANCE NAME MIN TIMEOUT_MS: until the instance's counter NAME (kvf-ringdump's) is
# at least MIN, read every 20 ms; status 1 after TIMEOUT_MS, saying on stderr where it stood. For
# a test to wait for the event it means ("the sender has the task", "bytes are moving") instead
# of sleeping.
wait_counter() {
  local t0 v
  t0=$(date +%s%N)
  while :; do
    v=$(counter "$1" "$2") || { echo "cannot read counter $2 of $1" >&2; return 1; }
    [ "$v" -ge "$3" ] && return 0
    if [ $(( ($(date +%s%N) - t0) / 1000000 )) -gt "$4" ]; then
      echo "timed out after $4 ms waiting for counter $2 of $1 to reach $3 (it is $v)" >&2
      return 1
    fi
    sleep 0.02
  done
}

# is_role PID ROLE INSTANCE: PID runs this build's kvf-ROLE for INSTANCE (not a zombie)
is_role() {
  local s a prev=""
  [ "$(readlink "/proc/$1/exe" 2>/dev/null)" = "$(readlink -f "$B/kvf-$2")" ] || return 1
  s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  s=${s##*) }; [ "${s%% *}" != Z ] || return 1
  while IFS= read -r -d '' a; do
    [ "$prev" = --instance ] && [ "$a" = "$3" ] && return 0
    prev=$a
  done 2>/dev/null <"/proc/$1/cmdline"
  return 1
}

# pid_of ROLE INSTANCE -> the pid of the instance's kvf-ROLE process, as its role slot in the
# control segment holds it (kvf-ringdump --json), if that process is alive: it exists, is no
# zombie, and is this build's kvf-ROLE for INSTANCE. Not whether its heartbeat is fresh: a
# role that is stopped or hung is found too. Empty and status 1 if none.
pid_of() {
  local p
  p=$("$B/kvf-ringdump" --instance "$2" --json --records 0 2>/dev/null |
    /usr/bin/python3 -c 'import json,sys
r=[x for x in json.load(sys.stdin)["roles"] if x["role"]==sys.argv[1]]
if len(r)==1 and r[0]["pid"]>0: print(r[0]["pid"])' "$1" 2>/dev/null) || true
  [ -n "$p" ] && is_role "$p" "$1" "$2" || return 1
  echo "$p"
}

# logged_running INSTANCE -> the roles its supervisor's log says it started that still run
# ("ROLE:PID" each), for when the control segment that names them is gone
logged_running() {
  local role p
  sed -n 's/.* started \([a-z]*\) (pid \([0-9]*\))$/\1 \2/p' "$KVFERRY_RUN_DIR/$1/supervisor.log" 2>/dev/null |
    while read -r role p; do is_role "$p" "$role" "$1" && echo "$role:$p"; done
  return 0
}

# kill_role ROLE INSTANCE: SIGKILL the role, wait until it is gone (a zombie counts as gone),
# then until the supervisor has it running again
kill_role() {
  local p; p=$(pid_of "$1" "$2") || true
  [ -n "$p" ] || fail "no $1 of $2 running"
  kill -KILL "$p"
  while kill -0 "$p" 2>/dev/null && [ "$(cut -d' ' -f3 /proc/$p/stat 2>/dev/null)" != Z ]; do sleep 0.01; done
  "$B/kvf-ctl" wait-ready --instance "$2" --roles "$1" --timeout-ms 15000 || fail "$1 of $2 did not come back"
}
