#!/usr/bin/env bash
# Throughput between tensor-parallel groups of different sizes on GPU caches, one engine process
# per rank (build/bench/gpu_tp_bench), each row beside the same-TP transfer in the same run:
#   1->1  one prefill instance holding all 8 kv heads into one decode instance: the reference,
#         run first and last; "ratio" is each row over the mean of the two
#   1->2  one prefill rank sends each decode rank its 4 heads (head slices of every block)
#   2->8  each of 2 prefill ranks sends 4 decode ranks one head each
#   2->2, 8->8  the same split into the decode groups of 1->2 and 2->8 (first and last):
#         "same-d" is 1->2 over 2->2 and 2->8 over 8->8 (the same decode ranks and tasks);
#         "same-p" is 1->2 over 1->1 and 2->8 over 2->2 (the same prefill ranks: on one GPU,
#         without MPS, the prefill engines' (or senders') copy kernels take turns on it, one
#         process at a time, which a group with a GPU per rank does not pay)
# Every row: llama-3.1-8b's cache (32 layers, 8 kv heads of 128, bf16), 64 tokens a block,
# --requests requests of a quarter to all of --tokens tokens, all tasks in one step, the
# layers published from each prefill engine's CUDA stream at once (the copies then run as fast
# as the path allows), every word of every token checked on every decode rank's GPU after each
# pass. Time: the median of --passes passes after one untimed pass, from the first layer-done to
# the last completion. Target: >= 0.9 x 1->1 for 1->2 and 2->8.
# Usage: bench/gpu_tp_bench.sh [--executor engine|sender] [--requests N] [--tokens N] [--passes N]
#                              [--backend cuda|host] [--rows "1-1 1-2 ..."] [--mps]
# --mps: every instance, and so every process on the GPU, under NVIDIA's MPS (side by side).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${KVFERRY_BUILD:-$ROOT/build}
EXEC=engine
REQ=100
TOK=2048
PASSES=5
BACKEND=cuda
MPS=()
ROWS="1-1 2-2 8-8 1-2 2-8 8-8 2-2 1-1"
while [ $# -gt 0 ]; do
  case "$1" in
    --executor) EXEC=$2; shift 2 ;;
    --requests) REQ=$2; shift 2 ;;
    --tokens) TOK=$2; shift 2 ;;
    --passes) PASSES=$2; shift 2 ;;
    --backend) BACKEND=$2; shift 2 ;;
    --rows) ROWS=$2; shift 2 ;;
    --mps) MPS=(--mps); shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "gpu_tp_bench.sh: unknown option '$1' (--executor E, --requests N, --tokens N, --passes N, --backend B, --rows R, --mps)" >&2; exit 2 ;;
  esac
done
BIN=$BUILD/bench/gpu_tp_bench
[ -x "$BIN" ] || { echo "gpu_tp_bench.sh: $BIN is not built (a build with CUDA: cmake --build build)" >&2; exit 1; }
export KVFERRY_BUILD=$BUILD
if [ "$BACKEND" = cuda ] && ! [ "$("$BUILD/kvf-ctl" gpus 2>/dev/null || echo 0)" -ge 1 ] 2>/dev/null; then
  echo "gpu_tp_bench.sh: no GPU visible (--backend host runs the same on host caches)"; exit 77
fi
lscpu | grep 'Model name' || true
[ "$BACKEND" = cuda ] && { nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 || true; }
echo "executor $EXEC${MPS:+ under MPS}, $REQ requests of up to $TOK tokens, $BACKEND caches, median of $PASSES passes"
out=()
for r in $ROWS; do
  line=$("$ROOT/tests/own_run_dir.sh" "$BIN" "${r%-*}" "${r#*-}" --executor "$EXEC" --requests "$REQ" \
           --tokens "$TOK" --passes "$PASSES" --warm --backend "$BACKEND" "${MPS[@]}" 2>&1 | grep -v '^kvferry:') || {
    echo "$line" >&2; echo "gpu_tp_bench.sh: $r failed" >&2; exit 1; }
  echo "$line"
  out+=("$r $(echo "$line" | sed -n 's/.* bytes in \([0-9.]*\) ms.*, \([0-9.]*\) GiB\/s.*; \([0-9.]*\) copy runs, \([0-9]*\) tasks.*/\1 \2 \3 \4/p')")
done
printf '%s\n' "${out[@]}" | awk '
  { l[NR] = $1; ms[NR] = $2; g[NR] = $3; runs[NR] = $4; t[NR] = $5
    split($1, pd, "-"); p[NR] = pd[1]; d[NR] = pd[2]
    if (p[NR] == d[NR]) { sum[d[NR]] += $3; n[d[NR]]++ } }
  END {
    base = sum[1] / n[1]
    printf "%-6s %9s %8s %7s %7s %7s %10s %6s\n", "tp", "ms", "GiB/s", "ratio", "same-d", "same-p", "runs/req", "tasks"
    for (i = 1; i <= NR; i++) {
      sd = (d[i] in n && p[i] != d[i]) ? sprintf("%7.2f", g[i] / (sum[d[i]] / n[d[i]])) : sprintf("%7s", "-")
      sp = (p[i] in n && p[i] != d[i]) ? sprintf("%7.2f", g[i] / (sum[p[i]] / n[p[i]])) : sprintf("%7s", "-")
      printf "%-6s %9.3f %8.2f %7.2f %s %s %10.1f %6d\n", l[i], ms[i], g[i], g[i] / base, sd, sp, runs[i], t[i]
    }
  }'
