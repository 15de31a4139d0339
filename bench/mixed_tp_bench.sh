#!/usr/bin/env bash
# Throughput between tensor-parallel groups of different sizes and between block sizes, over
# the host path (ipc) and over tcp, each against the same-TP transfer of its transport measured
# in the same run:
#   1->1  one prefill instance holding all 8 kv heads into one decode instance: the reference
#         of each transport, run first and last (A B ... A); each row is judged against the mean
#         of its transport's two
#   1->2  one prefill rank sends each decode rank its 4 heads (head slices of every block)
#   2->8  each of 2 prefill ranks sends 4 decode ranks one head each
#   8->2  each decode rank gathers its 4 heads from 4 prefill ranks
#   4->4  the same split on both sides (whole blocks), as a second reference
#   2->2, 8->8  the same split into the decode groups of 1->2 and 2->8 (the same decode ranks,
#         the same tasks per request): the last lines give 1->2 over 2->2, 2->8 over 8->8 and
#         8->2 over 2->2, what the other split costs beside the same-TP transfer of that group
#   4->4 bs 32/16  the same split, 32 tokens per prefill block regrouped into 16-token blocks
#                  (ipc: copy runs of the plan's pieces; tcp: DATAR frames of them); also
#                  judged against the 4->4 row of its transport (same split, one block size)
# Every run is tests/mixed_tp_test (built in $KVFERRY_BUILD, default build/): the same requests
# (1 to 4 source blocks of 16 tokens, every third one's last block half full, 3 layers, K and V,
# 8 kv heads of --head-dim, bf16), every byte of every head checked on every decode rank after
# the clock stops. Throughput is the bytes moved (each head of each token once: the same in
# every row but the block-size one, whose blocks hold twice the tokens) over the time from the
# first layer-done to the last completion on the prefill side; ratio = the row's throughput over
# the reference's (the mean 1->1 time), so >= 1 is faster. Descriptors per request: copy
# runs (ipc) or tcp frames sent (DATA/DATAV/DATAS). Target: >= 0.9 x the reference.
# --rounds N: everything N times (each round its own references); the last lines then give each
# ratio's median over the rounds (one round's ratios move by 0.3 or more on a shared VM).
# --block-tokens N: N tokens per block on both sides (default 16, vLLM's default; the llama shape
# of data/model-shapes.json is 64), the regrouped row 2N into N.
# --warm: every row moves its requests twice and times the second pass (the senders have mapped
# and touched their peers' caches by then, as a deployment past its first requests has; a first
# pass also pays each new mapping's page faults, more of them the more peers a sender maps).
# --passes N: every row times N passes of its requests on the same instances (after the untimed
# one of --warm), each verified, and takes their median time (one pass of 500 requests moves by
# 1.3x between passes on a shared 2-vCPU VM; the median of 7 by a few percent).
# Usage: bench/mixed_tp_bench.sh [--requests N] [--head-dim N] [--block-tokens N] [--warm] [--no-tcp]
#                                [--rounds N] [--passes N]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${KVFERRY_BUILD:-$ROOT/build}
REQ=400
HDIM=128
BT=16
TCP=1
ROUNDS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) REQ=$2; shift 2 ;;
    --head-dim) HDIM=$2; shift 2 ;;
    --block-tokens) BT=$2; shift 2 ;;
    --warm) export MIXED_TP_WARMUP=1; shift ;;
    --no-tcp) TCP=0; shift ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --passes) export MIXED_TP_PASSES=$2; shift 2 ;;
    -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
    *) echo "mixed_tp_bench.sh: unknown option '$1' (--requests N, --head-dim N, --block-tokens N, --warm, --no-tcp, --rounds N, --passes N)" >&2; exit 2 ;;
  esac
done
BIN=$BUILD/tests/mixed_tp_1_2_8_both
[ -x "$BIN" ] || { echo "mixed_tp_bench.sh: $BIN is not built (cmake --build build)" >&2; exit 1; }
[[ "$ROUNDS" =~ ^[1-9][0-9]?$ ]] || { echo "mixed_tp_bench.sh: --rounds takes 1 to 99" >&2; exit 2; }
[[ "${MIXED_TP_PASSES:-1}" =~ ^([1-9]|1[0-5])$ ]] || { echo "mixed_tp_bench.sh: --passes takes 1 to 15" >&2; exit 2; }
[[ "$BT" =~ ^(2|4|8|16|32|64|128)$ ]] || { echo "mixed_tp_bench.sh: --block-tokens takes a power of two, 2 to 128" >&2; exit 2; }
RATIOS=$(mktemp /tmp/mixed_tp_bench.XXXXXX)
trap 'rm -f "$RATIOS"' EXIT
export KVFERRY_BUILD=$BUILD MIXED_TP_REQUESTS=$REQ MIXED_TP_HEAD_DIM=$HDIM

# one P D [options]: prints "ms bytes descriptors_per_request"
one() {
  local out p=$1 d=$2
  shift 2
  local bs="bs=$BT/$BT"
  [[ " $* " == *" bs="* ]] && bs=""
  out=$("$ROOT/tests/own_run_dir.sh" "$BIN" "$p" "$d" 8 $bs "$@" 2>/dev/null | grep '^tp ') || {
    echo "mixed_tp_bench.sh: tp $p->$d $* failed" >&2; exit 1; }
  echo "$out" | sed -n 's/.* \([0-9]*\) bytes sent in \([0-9.]*\) ms.*; \([0-9.]*\) \(copy runs\|tcp frames\) per request/\2 \1 \3/p'
}

# table NAME REF1 REF2 ROWS...: each row "label ms bytes desc", judged against the refs' mean
table() {
  local name=$1 r1=$2 r2=$3
  shift 3
  local refms refby
  refms=$(awk -v a="${r1%% *}" -v b="${r2%% *}" 'BEGIN { print (a + b) / 2 }')
  refby=$(echo "$r1" | awk '{ print $2 }')
  echo "== $name"
  printf '%-16s %10s %12s %10s %8s %12s\n' tp ms MiB MiB/s ratio desc/request
  for r in "1->1_(first) $r1" "$@" "1->1_(last) $r2"; do
    set -- $r
    awk -v l="$1" -v ms="$2" -v by="$3" -v desc="$4" -v ref="$refms" -v refby="$refby" 'BEGIN {
      printf "%-16s %10.1f %12.1f %10.1f %8.2f %12.1f\n", l, ms, by / 1048576,
             by / 1048576 / (ms / 1000), (by / ms) / (refby / ref), desc }'
    awk -v t="${name%% *}" -v l="$1" -v ms="$2" -v by="$3" -v ref="$refms" -v refby="$refby" \
      'BEGIN { printf "%s %s %.4f\n", t, l, (by / ms) / (refby / ref) }' >>"$RATIOS"
  done
}

lscpu | grep 'Model name' || true
echo "requests: $REQ, head dim $HDIM, 8 kv heads, $BT tokens/block, 3 layers, K and V, bf16, $ROUNDS round(s)$([ -n "${MIXED_TP_WARMUP:-}" ] && echo ", warm (a first pass untimed)")$([ "${MIXED_TP_PASSES:-1}" -gt 1 ] && echo ", median of $MIXED_TP_PASSES timed passes")"
# one row against another of the same transport, throughput ratio: OVER A B ROWS... (A's MiB/s over B's)
over() {
  local a=$1 b=$2 x="" y="" r
  shift 2
  for r in "$@"; do
    set -- $r
    [ "$1" = "$a" ] && x="$2 $3"
    [ "$1" = "$b" ] && y="$2 $3"
  done
  awk -v a="$x" -v b="$y" 'BEGIN { split(a, x); split(b, y); printf "%.2f", (x[2] / x[1]) / (y[2] / y[1]) }'
}
for ((round = 1; round <= ROUNDS; round++)); do
  [ "$ROUNDS" = 1 ] || echo "-- round $round of $ROUNDS"
  ref1=$(one 1 1)
  rows=()
  for pd in "2 2" "1 2" "8 8" "2 8" "8 2" "4 4"; do rows+=("${pd/ /->} $(one $pd)"); done
  rows+=("4->4_bs_$((2 * BT))/$BT $(one 4 4 bs=$((2 * BT))/$BT)")
  ref2=$(one 1 1)
  table "ipc (copy runs per request)" "$ref1" "$ref2" "${rows[@]}"
  if [ "$TCP" = 1 ]; then
    tref1=$(one 1 1 tcp)
    trows=()
    for pd in "2 2" "1 2" "8 8" "2 8" "8 2" "4 4"; do trows+=("${pd/ /->} $(one $pd tcp)"); done
    trows+=("4->4_bs_$((2 * BT))/$BT $(one 4 4 tcp bs=$((2 * BT))/$BT)")
    tref2=$(one 1 1 tcp)
    table "tcp (frames per request)" "$tref1" "$tref2" "${trows[@]}"
  fi
  # against the same split into the same decode group (the same decode ranks, the same tasks per
  # request), and regrouped against the same split with one block size
  for t in ipc tcp; do
    [ $t = tcp ] && { [ "$TCP" = 1 ] || continue; r=("${trows[@]}"); } || r=("${rows[@]}")
    o=("1->2 2->2" "2->8 8->8" "8->2 2->2" "4->4_bs_$((2 * BT))/$BT 4->4")
    line="$t:"
    for x in "${o[@]}"; do
      v=$(over ${x% *} ${x#* } "${r[@]}")
      line="$line ${x% *} over ${x#* } $v,"
      echo "$t ${x% *}/${x#* } $v" >>"$RATIOS"
    done
    echo "${line%,} (throughput)"
  done
done
if [ "$ROUNDS" -gt 1 ]; then
  echo "== medians over $ROUNDS rounds (ratio against 1->1 of the round; a/b: row a over row b of the round)"
  awk '{ k = $1 " " $2; v[k, ++n[k]] = $3; if (!(k in seen)) { seen[k] = 1; order[++m] = k } }
    END {
      for (i = 1; i <= m; i++) {
        k = order[i]; c = n[k]
        for (a = 1; a <= c; a++) x[a] = v[k, a]
        for (a = 1; a <= c; a++) for (b = a + 1; b <= c; b++) if (x[b] < x[a]) { t = x[a]; x[a] = x[b]; x[b] = t }
        med = c % 2 ? x[(c + 1) / 2] : (x[c / 2] + x[c / 2 + 1]) / 2
        printf "%-28s median %5.2f  (min %5.2f, max %5.2f, %d rounds)\n", k, med, x[1], x[c], c
      }
    }' "$RATIOS"
fi
true
