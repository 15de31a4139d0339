#!/usr/bin/env bash
# What outgoing peers cost a prefill connector: its threads and its private memory (RssAnon) at
# most while tcp tasks to N distinct peers are pending, for N = 1000 against N = 1 measured in
# the same run (each case on a fresh prefill instance), for two kinds of peer:
#   unreachable  127.1.x.y:9, where nobody listens (each connect refused at once);
#   accepting    127.2.x.y:PORT, one helper process that accepts every connection and never
#                answers, so each peer's handshake runs to its timeout on a handshake worker.
# Usage: bench/peers_bench.sh [--peers N]   (default 1000)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=${KVFERRY_BUILD:-$ROOT/build}
N=1000
while [ $# -gt 0 ]; do
  case "$1" in
    --peers) N=$2; shift 2 ;;
    *) echo "Usage: bench/peers_bench.sh [--peers N]" >&2; exit 2 ;;
  esac
done
export KVFERRY_RUN_DIR=$(mktemp -d /tmp/kvferry-bench.XXXXXX)
export KVFERRY_TOKEN_FILE=$KVFERRY_RUN_DIR/token
HELPER= CUR=
cleanup() {
  [ -n "$HELPER" ] && kill "$HELPER" 2>/dev/null || true
  [ -n "$CUR" ] && "$ROOT/tools/kvferry" down --instance "$CUR" >/dev/null 2>&1 || true
  rm -rf "$KVFERRY_RUN_DIR"
}
trap cleanup EXIT
# The helper: one socket on every local address, accepting and holding every connection.
/usr/bin/python3 -c '
import resource, socket, sys
s, h = resource.getrlimit(resource.RLIMIT_NOFILE); resource.setrlimit(resource.RLIMIT_NOFILE, (h, h))
l = socket.socket(); l.bind(("0.0.0.0", 0)); l.listen(4096)
print(l.getsockname()[1], flush=True)
held = []
while True:
    held.append(l.accept()[0])
' > "$KVFERRY_RUN_DIR/helper.port" &
HELPER=$!
for _ in $(seq 50); do [ -s "$KVFERRY_RUN_DIR/helper.port" ] && break; sleep 0.1; done
HPORT=$(cat "$KVFERRY_RUN_DIR/helper.port")
I=0 LINE= TH= RSS=
run() { # run KIND COUNT ADDR: one line of figures (LINE, and TH, RSS at most), on a fresh prefill instance
  I=$((I + 1)); local inst="pb$$-$I"; CUR=$inst
  "$ROOT/tools/kvferry" up --instance "$inst" --role prefill --model llama-3.1-8b --tp 8 --blocks 256 \
    --max-requests 4096 --peer-timeout-ms 2000 --connect-timeout-ms 1000 >/dev/null 2>"$KVFERRY_RUN_DIR/up.err" ||
    { cat "$KVFERRY_RUN_DIR/up.err" >&2; exit 1; }
  LINE=$("$B/bench/kvf-bench-peers" --instance "$inst" --peers "$2" --addr "$3")
  "$ROOT/tools/kvferry" down --instance "$inst" >/dev/null 2>&1; CUR=
  printf '%-12s %s\n' "$1" "$LINE"
  read -r TH RSS <<<"$(echo "$LINE" | awk '{print $6, $10}')"
}
echo "connector of a prefill instance, tcp tasks to N distinct peers (--peer-threads 2, --handshake-threads 2)"
for kind in unreachable accepting; do
  if [ $kind = unreachable ]; then a1=127.1:9; else a1=127.2:$HPORT; fi
  run $kind 1 $a1; t1=$TH m1=$RSS
  run $kind "$N" $a1; tn=$TH mn=$RSS
  echo "$kind: $N peers against 1: threads $tn / $t1 = $(/usr/bin/python3 -c "print(round($tn/$t1, 2))"), private memory $mn / $m1 KiB = $(/usr/bin/python3 -c "print(round($mn/max($m1,1), 1))") (+$(( (mn - m1) / 1024 )) MiB, $(( (mn - m1) / N )) KiB a peer)"
done
