#!/usr/bin/env bash
# Host-path (ipc) throughput between tensor-parallel groups of different sizes, against the
# same-TP transfer measured in the same run:
#   1->1  one prefill instance holding all 8 kv heads into one decode instance: the reference,
#         run first and last (A B ... A); each mixed row is judged against the mean of the two
#   1->2  one prefill rank sends each decode rank its 4 heads (head slices of every block)
#   2->8  each of 2 prefill ranks sends 4 decode ranks one head each
#   4->4  the same split on both sides (whole blocks), as a second reference
# Every run is tests/mixed_tp_test (built in $KVFERRY_BUILD, default build/): the same requests
# (1 to 4 blocks of 16 tokens, 3 layers, K and V, 8 kv heads of --head-dim, bf16), every byte of
# every head checked on every decode rank after the clock stops. Throughput is the bytes of all
# requests over the time from the first layer-done to the last completion on the prefill side
# (the same bytes in every row: each head moves once). Target: >= 0.9 x the reference.
# Usage: bench/mixed_tp_bench.sh [--requests N] [--head-dim N]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${KVFERRY_BUILD:-$ROOT/build}
REQ=400
HDIM=128
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) REQ=$2; shift 2 ;;
    --head-dim) HDIM=$2; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "mixed_tp_bench.sh: unknown option '$1' (--requests N, --head-dim N)" >&2; exit 2 ;;
  esac
done
BIN=$BUILD/tests/mixed_tp_1_2_8
[ -x "$BIN" ] || { echo "mixed_tp_bench.sh: $BIN is not built (cmake --build build)" >&2; exit 1; }
export KVFERRY_BUILD=$BUILD MIXED_TP_REQUESTS=$REQ MIXED_TP_HEAD_DIM=$HDIM

# one P D: prints "ms bytes runs_per_request"
one() {
  local out
  out=$("$ROOT/tests/own_run_dir.sh" "$BIN" "$1" "$2" 8 2>/dev/null | grep '^tp ') || {
    echo "mixed_tp_bench.sh: tp $1->$2 failed" >&2; exit 1; }
  echo "$out" | sed -n 's/.* \([0-9]*\) bytes sent in \([0-9.]*\) ms.*; \([0-9.]*\) copy runs per request/\2 \1 \3/p'
}

lscpu | grep 'Model name' || true
echo "requests: $REQ, head dim $HDIM, 8 kv heads, 16 tokens/block, 3 layers, K and V, bf16"
ref1=$(one 1 1)
rows=()
for pd in "1 2" "2 8" "4 4"; do rows+=("$pd $(one $pd)"); done
ref2=$(one 1 1)
refms=$(awk -v a="${ref1%% *}" -v b="${ref2%% *}" 'BEGIN { print (a + b) / 2 }')
printf '%-6s %10s %12s %10s %8s %12s\n' tp ms MiB MiB/s ratio runs/request
for r in "1 1 $ref1" "${rows[@]}" "1 1 $ref2"; do
  set -- $r
  awk -v p="$1" -v d="$2" -v ms="$3" -v by="$4" -v runs="$5" -v ref="$refms" 'BEGIN {
    printf "%-6s %10.1f %12.1f %10.1f %8.2f %12.1f\n", p "->" d, ms, by / 1048576,
           by / 1048576 / (ms / 1000), ref / ms, runs }'
done
