#!/usr/bin/env bash
# What scraping /metrics costs the data path: kvf-sim's end-to-end throughput (ipc, llama-3.1-8b,
# one tp-8 rank, the conversation trace) with a scraper hitting both instances' /metrics at RATE
# requests per second (loopback, one keep-alive connection per instance, paced, so bounded),
# against the same run without it, in the same session on the same instances, alternated
# (A B A B ...). Prints every run, the medians and the ratio scraped / unscraped, and what one
# page costs kvf-metrics: its size and the CPU time (user + system) both servers spent per GET.
# Usage: bench/metrics_bench.sh [--rounds N] [--rate R] [--requests N]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=${KVFERRY_BUILD:-$ROOT/build}
ROUNDS=5 RATE=400 REQS=200
usage() { echo "Usage: bench/metrics_bench.sh [--rounds N] [--rate R] [--requests N]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || usage; ROUNDS=$2; shift 2 ;;
    --rate) [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || usage; RATE=$2; shift 2 ;;
    --requests) [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || usage; REQS=$2; shift 2 ;;
    -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) usage ;;
  esac
done
export KVFERRY_RUN_DIR=$(mktemp -d /tmp/kvferry-bench.XXXXXX)
export KVFERRY_TOKEN_FILE=$KVFERRY_RUN_DIR/token
export KVFERRY_BACKEND=host
R=$KVFERRY_RUN_DIR T=m$$
SCRAPER=""
cleanup() {
  [ -n "$SCRAPER" ] && kill "$SCRAPER" 2>/dev/null || true
  "$ROOT/tools/kvferry" down --instance $T-p --instance $T-d >/dev/null 2>&1 || true
  rm -rf "$R"
}
trap cleanup EXIT
port_of() { sed -n 's/.*(port \([0-9]*\)).*/\1/p' "$R/$1/metrics.log" | tail -n1; }
L="--model llama-3.1-8b --tp 8 --cache-mib 2048"
"$ROOT/tools/kvferry" up --instance $T-d --role decode $L --metrics 127.0.0.1:0 >/dev/null 2>&1
"$ROOT/tools/kvferry" up --instance $T-p --role prefill $L --metrics 127.0.0.1:0 >/dev/null 2>&1
PD=$(port_of $T-d) PP=$(port_of $T-p)
[ -n "$PD" ] && [ -n "$PP" ] || { echo "metrics_bench: no metrics port in $R/*/metrics.log" >&2; exit 1; }
MPIDS="$(pgrep -f "kvf-metrics --instance $T-p " | head -n1) $(pgrep -f "kvf-metrics --instance $T-d " | head -n1)"
# cpu_ticks: user + system clock ticks of both kvf-metrics processes so far
cpu_ticks() { local t=0 p; for p in $MPIDS; do t=$((t + $(awk '{ print $14 + $15 }' "/proc/$p/stat"))); done; echo $t; }
TICK=$(getconf CLK_TCK)

# The scraper: paced GETs of /metrics, alternating the two instances, each over its own
# keep-alive connection, until the file $1.stop exists; then writes how many it made, their rate
# and mean latency to $1.
scraper() {
  exec /usr/bin/python3 - "$RATE" "$PP" "$PD" "$1" <<'EOF'
import http.client, os, sys, time
rate, ports, out = float(sys.argv[1]), sys.argv[2:4], sys.argv[4]
conns = [http.client.HTTPConnection("127.0.0.1", int(p), timeout=5) for p in ports]
n, lat = 0, 0.0
t0 = time.monotonic()
while not (n % 16 == 0 and os.path.exists(out + ".stop")):
    c = conns[n % 2]
    t = time.monotonic()
    c.request("GET", "/metrics")
    r = c.getresponse()
    body = r.read()
    if r.status != 200 or b"kvferry_up" not in body:
        sys.exit("scrape failed: %d" % r.status)
    lat += time.monotonic() - t
    n += 1
    nxt = t0 + n / rate
    d = nxt - time.monotonic()
    if d > 0:
        time.sleep(d)
el = time.monotonic() - t0
open(out, "w").write("%d %.1f %.1f\n" % (n, n / el, 1e6 * lat / max(n, 1)))
EOF
}

run() { # run KIND I: one kvf-sim run; prints its GiB/s and requests/s
  "$B/kvf-sim" --prefill $T-p --decode $T-d --requests "$REQS" --quiet --verify sample --warm-caches \
    --strict --json "$R/$1.$2.json" >/dev/null
  /usr/bin/python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("%.3f %.1f" % (d["rate_bps"] / 2**30, d["requests_per_s"]))' "$R/$1.$2.json"
}

echo "kvferry metrics scraping: $(nproc) CPUs, $(lscpu | grep 'Model name' | sed 's/.*: *//'), Linux $(uname -r), $(date -u +%F)"
echo "kvf-sim --requests $REQS (ipc, llama-3.1-8b tp 8, conversation trace), $ROUNDS rounds alternated; scraper: $RATE GETs/s over both instances' /metrics"
run warmup 0 >/dev/null # the sender maps the peer's cache on its first task
A=() S=() C=()
for i in $(seq "$ROUNDS"); do
  a=$(run plain "$i")
  c0=$(cpu_ticks)
  scraper "$R/scrape.$i" &
  SCRAPER=$!
  sleep 0.3
  s=$(run scraped "$i")
  touch "$R/scrape.$i.stop"; wait "$SCRAPER" || { echo "metrics_bench: the scraper failed" >&2; exit 1; }; SCRAPER=""
  c1=$(cpu_ticks)
  read -r n rps lat_us <"$R/scrape.$i"
  cpu_us=$(/usr/bin/python3 -c "print('%.0f' % (1e6 * ($c1 - $c0) / $TICK / $n))")
  echo "round $i: unscraped ${a% *} GiB/s ${a#* } req/s | scraped ${s% *} GiB/s ${s#* } req/s (scraper: $n GETs, $rps/s, mean $lat_us us; kvf-metrics $cpu_us us CPU per GET)"
  A+=("${a% *}") S+=("${s% *}") C+=("$cpu_us")
done
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
ma=$(median "${A[@]}") ms=$(median "${S[@]}")
bytes=$(curl -sf --max-time 5 "http://127.0.0.1:$PP/metrics" | wc -c)
echo "a page: $bytes bytes (prefill, after the runs); kvf-metrics CPU per GET, median $(median "${C[@]}") us"
echo "median: unscraped $ma GiB/s, scraped $ms GiB/s; ratio scraped/unscraped $(/usr/bin/python3 -c "print('%.3f' % ($ms / $ma))")"
