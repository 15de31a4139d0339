#!/usr/bin/env bash
# What one scrape costs kvf-metrics, against another build of it in the same run: both servers
# serve the same instance (llama-3.1-8b, tp 8, idle), and kvf-bench-scrape makes GETS paced GETs
# of each in turn (A B A B ...), every page verified. Prints, per round, each server's CPU time
# (user + system, from /proc/PID/task/*/schedstat) per GET and their ratio, then the medians;
# and, as a floor, A's CPU per GET of a 404 (libmicrohttpd, the wake-up and the system calls of a
# request, without a page). REF is a kvf-metrics binary of another build (e.g. an older commit's).
# Usage: bench/metrics_cpu_ab.sh --ref PATH [--rounds N] [--gets N] [--rate R]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=${KVFERRY_BUILD:-$ROOT/build}
ROUNDS=5 GETS=2000 RATE=400 REF=""
usage() { echo "Usage: bench/metrics_cpu_ab.sh --ref PATH [--rounds N] [--gets N] [--rate R]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --ref) [ -x "${2:-}" ] || usage; REF=$2; shift 2 ;;
    --rounds) [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || usage; ROUNDS=$2; shift 2 ;;
    --gets) [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || usage; GETS=$2; shift 2 ;;
    --rate) [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || usage; RATE=$2; shift 2 ;;
    -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) usage ;;
  esac
done
[ -n "$REF" ] || usage
export KVFERRY_RUN_DIR=$(mktemp -d /tmp/kvferry-bench.XXXXXX)
export KVFERRY_TOKEN_FILE=$KVFERRY_RUN_DIR/token
export KVFERRY_BACKEND=host
R=$KVFERRY_RUN_DIR I=mc$$
PA="" PB=""
cleanup() {
  local p
  for p in $PA $PB; do kill "$p" 2>/dev/null || true; done
  "$ROOT/tools/kvferry" down --instance $I >/dev/null 2>&1 || true
  rm -rf "$R"
}
trap cleanup EXIT
"$ROOT/tools/kvferry" up --instance $I --role decode --model llama-3.1-8b --tp 8 --cache-mib 64 >/dev/null 2>&1
# serve BIN LOG: starts a metrics server of the instance; prints its pid and port (the caller
# keeps the pid: cleanup stops it)
serve() {
  "$1" --instance $I --listen 127.0.0.1:0 2>"$2" &
  local p=$! port=""
  for _ in $(seq 500); do
    port=$(sed -n 's/.*(port \([0-9]*\)).*/\1/p' "$2")
    [ -n "$port" ] && break
    sleep 0.01
  done
  [ -n "$port" ] || { kill "$p" 2>/dev/null || true; echo "metrics_cpu_ab: $1 did not listen: $(cat "$2")" >&2; exit 1; }
  echo "$p $port"
}
read -r PA PORTA < <(serve "$B/kvf-metrics" "$R/a.log")
read -r PB PORTB < <(serve "$REF" "$R/b.log")
[ -n "${PORTA:-}" ] && [ -n "${PORTB:-}" ] || exit 1
# run_ns PID: CPU time of all its threads so far, ns
run_ns() { local t=0 f; for f in /proc/$1/task/*/schedstat; do t=$((t + $(cut -d' ' -f1 "$f"))); done; echo $t; }
# per_get PID PORT [SCRAPER OPTIONS]: the server's CPU µs per GET over GETS paced GETs
per_get() {
  local t0 t1 pid=$1 port=$2
  shift 2
  t0=$(run_ns "$pid")
  "$B/bench/kvf-bench-scrape" --port "$port" --rate "$RATE" --count "$GETS" "$@" >/dev/null ||
    { echo "metrics_cpu_ab: scraping port $port failed" >&2; exit 1; }
  t1=$(run_ns "$pid")
  /usr/bin/python3 -c "print('%.1f' % (($t1 - $t0) / 1e3 / $GETS))"
}
per_get "$PA" "$PORTA" >/dev/null # each maps the segment and makes its first page
per_get "$PB" "$PORTB" >/dev/null
echo "kvf-metrics CPU per GET: $(nproc) CPUs, $(lscpu | grep 'Model name' | sed 's/.*: *//'), Linux $(uname -r), $(date -u +%F), load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "A: $B/kvf-metrics; B (reference): $REF; $GETS GETs at $RATE/s each, $ROUNDS rounds alternated"
A=() S=() Q=() F=()
FLOOR=(--path /nosuch --status 404 --expect "not found")
for i in $(seq "$ROUNDS"); do
  a=$(per_get "$PA" "$PORTA")
  b=$(per_get "$PB" "$PORTB")
  f=$(per_get "$PA" "$PORTA" "${FLOOR[@]}")
  q=$(/usr/bin/python3 -c "print('%.3f' % ($a / $b))")
  echo "round $i: A $a us, B $b us per GET (A/B $q); A's 404 $f us"
  A+=("$a") S+=("$b") Q+=("$q") F+=("$f")
done
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
echo "median: A $(median "${A[@]}") us, B $(median "${S[@]}") us per GET; A/B $(median "${Q[@]}") (median of the rounds' ratios); A's 404 $(median "${F[@]}") us; load average after $(cut -d' ' -f1-3 /proc/loadavg)"
