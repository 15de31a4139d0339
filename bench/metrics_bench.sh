#!/usr/bin/env bash
# What scraping /metrics costs the data path: kvf-sim's end-to-end throughput (ipc, llama-3.1-8b,
# one tp-8 rank, the conversation trace) with kvf-bench-scrape hitting both instances' /metrics at
# RATE GETs per second (loopback, one keep-alive connection per instance, paced, so bounded),
# against the same run without it, same session, same instances, alternated (A B A B ...).
# Prints every run, the medians, the unscraped runs' spread, the ratio scraped / unscraped, and
# a page's size and CPU (user + system) per GET: both kvf-metrics servers', and the scraper's.
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

# The scraper (kvf-bench-scrape): paced GETs of /metrics, alternating the two instances, each
# over its own keep-alive connection, every page verified (200, kvferry_up in it), until SIGTERM;
# then it writes how many it made, their rate, mean latency and its own CPU per GET to $1.
scraper() { exec "$B/bench/kvf-bench-scrape" --rate "$RATE" --port "$PP" --port "$PD" >"$1"; }

run() { # run KIND I: one kvf-sim run; prints its GiB/s and requests/s
  "$B/kvf-sim" --prefill $T-p --decode $T-d --requests "$REQS" --quiet --verify sample --warm-caches \
    --strict --json "$R/$1.$2.json" >/dev/null
  /usr/bin/python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("%.3f %.1f" % (d["rate_bps"] / 2**30, d["requests_per_s"]))' "$R/$1.$2.json"
}

echo "kvferry metrics scraping: $(nproc) CPUs, $(lscpu | grep 'Model name' | sed 's/.*: *//'), Linux $(uname -r), $(date -u +%F)"
echo "kvf-sim --requests $REQS (ipc, llama-3.1-8b tp 8, conversation trace), $ROUNDS rounds alternated; scraper: $RATE GETs/s over both instances' /metrics"
run warmup 0 >/dev/null # the sender maps the peer's cache on its first task
A=() S=() C=() K=() Q=()
for i in $(seq "$ROUNDS"); do
  a=$(run plain "$i")
  c0=$(cpu_ticks)
  scraper "$R/scrape.$i" &
  SCRAPER=$!
  sleep 0.3
  s=$(run scraped "$i")
  kill -TERM "$SCRAPER"; wait "$SCRAPER" || { echo "metrics_bench: the scraper failed" >&2; exit 1; }; SCRAPER=""
  c1=$(cpu_ticks)
  read -r n rps lat_us cl_us <"$R/scrape.$i"
  cpu_us=$(/usr/bin/python3 -c "print('%.0f' % (1e6 * ($c1 - $c0) / $TICK / $n))")
  echo "round $i: unscraped ${a% *} GiB/s ${a#* } req/s | scraped ${s% *} GiB/s ${s#* } req/s (scraper: $n GETs, $rps/s, mean $lat_us us, its own CPU $cl_us us per GET; kvf-metrics $cpu_us us CPU per GET)"
  A+=("${a% *}") S+=("${s% *}") C+=("$cpu_us") K+=("$cl_us")
  Q+=("$(/usr/bin/python3 -c "print('%.4f' % (${s% *} / ${a% *}))")")
done
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
ma=$(median "${A[@]}") ms=$(median "${S[@]}")
bytes=$(curl -sf --max-time 5 "http://127.0.0.1:$PP/metrics" | wc -c)
echo "a page: $bytes bytes (prefill, after the runs); CPU per GET, medians: kvf-metrics $(median "${C[@]}") us (both servers), the scraper $(median "${K[@]}") us"
echo "unscraped runs: $(printf '%s\n' "${A[@]}" | sort -g | awk -v m="$ma" 'NR == 1 { lo = $1 } { hi = $1 } END { printf "min %.3f max %.3f GiB/s, %.1f %% to %+.1f %% of their median", lo, hi, 100 * (lo / m - 1), 100 * (hi / m - 1) }')"
echo "median: unscraped $ma GiB/s, scraped $ms GiB/s; ratio scraped/unscraped $(/usr/bin/python3 -c "print('%.3f' % ($ms / $ma))") (median of the rounds' own ratios $(median "${Q[@]}"))"
# What the scrapes took from the two vCPUs the runs share: both servers and the scraper, at RATE.
echo "scraping's CPU: $(/usr/bin/python3 -c "print('%.1f' % (($(median "${C[@]}") + $(median "${K[@]}")) * $RATE / 1e6 / $(nproc) * 100))") % of the $(nproc) CPUs at $RATE GETs/s (medians: kvf-metrics + the scraper per GET)"
