#!/usr/bin/env bash
# Another local user against the same-host control sockets. The user
# `nobody` squats every name it can: the old abstract socket name @kvferry.<instance>.ctl, and
# the socket directory /dev/shm/kvferry-sock.<uid> itself (made first, with a socket inside whose
# backlog is full). Same-host transfers must still finish promptly, the connectors must say why
# they did not use the unix socket, and once the directory is theirs again they use it, whatever
# sits at the abstract name.
# Needs root (to be another user, and for a private /dev/shm: the squatted directory must not
# disturb other instances of this host); elsewhere it exits 77 (skipped).
if [ "$(id -u)" != 0 ]; then echo "SKIP: acting as another user needs root"; exit 77; fi
if [ -z "${KVF_SQUAT_NS:-}" ]; then
  unshare --mount --propagation private true 2>/dev/null || { echo "SKIP: no mount namespace (unshare)"; exit 77; }
  # The test itself, and every process it starts, in a mount namespace with a /dev/shm of its own.
  exec unshare --mount --propagation private env KVF_SQUAT_NS=1 \
    bash -c 'mount -t tmpfs -o mode=1777,size=2g kvf-squat /dev/shm && exec bash "$0"' "$0"
fi
source "$(dirname "$0")/lib.sh"
cd "$ROOT"

SOCKDIR=/dev/shm/kvferry-sock.0
as_nobody() { setpriv --reuid=nobody --regid=nogroup --clear-groups "$@"; }

# squat NAME OUT [USER]: as USER (default nobody), listen on unix socket NAME ("@..." = abstract)
# and fill its backlog (no accept, ever); "ready N" goes to OUT once N connections sit in the
# full queue. setpriv itself goes in the background (not a function): $SQUATTER is its pid.
squat() {
  local user=${3:-nobody}
  setpriv --reuid="$user" --regid="$(id -gn "$user")" --clear-groups /usr/bin/python3 -c '
import socket, sys, time
name = sys.argv[1]
addr = "\0" + name[1:] if name.startswith("@") else name
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(addr)
s.listen(0)
held = []
while True:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.setblocking(False)
    try:
        c.connect(addr)
    except BlockingIOError:
        break
    held.append(c)
print("ready", len(held), flush=True)
time.sleep(600)
' "$1" >"$2" 2>&1 &
  SQUATTER=$!
  AT_EXIT+=("kill $SQUATTER 2>/dev/null")
  for _ in $(seq 100); do grep -q ready "$2" 2>/dev/null && return 0; sleep 0.05; done
  cat "$2" >&2
  fail "the squatter on $1 did not start"
}

# run_sim NAME: 10 requests, within 10 s in all (a stalled control connection would take the
# 3 s request timeout, or hang), all finished
run_sim() {
  local t0=$SECONDS
  "$B/kvf-sim" --quiet --json "$KVFERRY_RUN_DIR/$1.json" --prefill $TAG-p --decode $TAG-d --requests 10 \
    --layer-us 50 --timeout-s 10 >"$KVFERRY_RUN_DIR/$1.txt" 2>&1 || { cat "$KVFERRY_RUN_DIR/$1.txt"; fail "$1: kvf-sim failed"; }
  [ "$(json_get "$KVFERRY_RUN_DIR/$1.json" finished)" = 10 ] || fail "$1: not all 10 requests finished"
  [ $((SECONDS - t0)) -le 10 ] || fail "$1: 10 requests took $((SECONDS - t0)) s"
}

L="--layers 4 --kv-heads 2 --head-dim 64 --block-size 16 --blocks 256"
CLOG=$KVFERRY_RUN_DIR/$TAG-d/connector.log
PLOG=$KVFERRY_RUN_DIR/$TAG-p/connector.log

# 1. nobody got there first: the old abstract name (full backlog), and the socket directory,
#    made 0700 by nobody with a socket at the decode instance's name (full backlog).
squat "@kvferry.$TAG-d.ctl" "$KVFERRY_RUN_DIR/squat-abstract.txt"
as_nobody mkdir -m 0700 "$SOCKDIR"
squat "$SOCKDIR/$TAG-d.ctl" "$KVFERRY_RUN_DIR/squat-dir.txt"
up $TAG-d --role decode $L
# (its ipc notices through the connectors, not the decode instance's notice slots: the connectors'
# same-host control connection is what is squatted)
up $TAG-p --role prefill $L --request-timeout-ms 3000 --connect-timeout-ms 500 --no-notice-rings
run_sim squatted
why="unix socket directory $SOCKDIR is owned by uid 65534 (nobody)"
grep -q "$why" "$CLOG" || fail "the decode connector did not log why it has no unix socket ('$why')"
grep -q "$why" "$PLOG" || fail "the prefill connector did not log why it did not use the unix socket"
grep -q "peer '$TAG-d' (instance $TAG-d at 127.0.0.1:[0-9]*) connected" "$PLOG" ||
  fail "the prefill connector did not reach its peer over tcp"
pass "directory and abstract name squatted by another user: 10 requests finished in time over tcp, and both connectors said why"

# logged PATTERN FILE: the line appears in FILE within 5 s (a role restarted by kill_role may be
# ready a moment before its log line about the socket directory is written).
logged() {
  for _ in $(seq 100); do grep -q "$1" "$2" && return 0; sleep 0.05; done
  return 1
}

# 2. A symlink in its place (nobody's, to a directory of ours with the right mode) is refused too.
kill "$SQUATTER" # the squatter inside the directory
rm -rf "$SOCKDIR"
mkdir -m 0700 /dev/shm/kvf-elsewhere
as_nobody ln -s /dev/shm/kvf-elsewhere "$SOCKDIR"
kill_role connector $TAG-d
logged "unix socket directory $SOCKDIR is a symbolic link" "$CLOG" ||
  fail "the decode connector did not refuse a symlinked socket directory"
pass "a symlink at the socket directory's name: refused, logged"

# 3. The directory is ours again: the control connection is a unix socket, and the squatter
#    still sitting at the old abstract name changes nothing.
rm -f "$SOCKDIR"
kill_role connector $TAG-d
kill_role connector $TAG-p # reconnects to its peer when the next task comes
[ "$(stat -c '%U %a %F' "$SOCKDIR")" = "root 700 directory" ] || fail "socket directory: $(stat -c '%U %a %F' "$SOCKDIR")"
[ -S "$SOCKDIR/$TAG-d.ctl" ] || fail "no socket at $SOCKDIR/$TAG-d.ctl"
run_sim unix
grep -q "peer '$TAG-d' (instance $TAG-d, same host) connected over a unix socket" "$PLOG" ||
  fail "the prefill connector did not use the unix socket once the directory was in order"
pass "socket directory in order: 10 requests over the unix socket, the abstract-name squatter ignored"

# 4. A listener of our own user in the connector's place that never accepts (backlog full):
#    the connect gives up at the connect timeout (500 ms) instead of blocking, and tcp takes over.
rm "$SOCKDIR/$TAG-d.ctl"
squat "$SOCKDIR/$TAG-d.ctl" "$KVFERRY_RUN_DIR/squat-own.txt" root
kill_role connector $TAG-p
run_sim stuck
grep -q "peer '$TAG-d': connect to unix socket $SOCKDIR/$TAG-d.ctl: its backlog stayed full (timed out): using tcp" "$PLOG" ||
  fail "the prefill connector did not say why it gave up on the unix socket"
pass "a unix listener that never accepts: the connect timed out, 10 requests finished in time over tcp"

# 5. A clean stop removes the connector's own socket file, not one that took its place; a stale
#    one is replaced at the next start.
down $TAG-d
[ -S "$SOCKDIR/$TAG-d.ctl" ] || fail "a clean stop removed a socket file that was not the connector's"
kill "$SQUATTER"
up $TAG-d --role decode $L # (up starts the logs afresh)
logged "and on a unix socket" "$CLOG" || fail "the stale socket file was not replaced"
down $TAG-d
[ ! -e "$SOCKDIR/$TAG-d.ctl" ] || fail "the socket file is still there after a clean stop"
pass "a clean stop removes the connector's socket file (and only that); a stale one is replaced"
echo "local_squat_test: all passed"
