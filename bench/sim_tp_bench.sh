#!/usr/bin/env bash
# The user-facing path between tensor-parallel groups of different sizes: tools/kvferry demo
# (kvf-sim driving real instances like engines) with --prefill-tp/--decode-tp, against the same
# split on both sides (d -> d, kvf-sim's path for equal groups: one task per rank pair), each
# reference run before and after the rows it judges, in the same invocation. Each row moves the
# same requests (llama-3.1-8b, the conversation trace clipped to --max-tokens, no decode-side
# prefix, no compute time) and checks every head of every token on every decode rank (--verify
# sample: the first and last 64 bytes of each row of the mixed rows, of each block of the
# reference's). Throughput = requests per second of kvf-sim's run (the same requests, so the
# same tokens, in every row). Two ratios, >= 1 faster: "ratio" over the mean of the first and
# last rows (2 -> 2 on host caches, 1 -> 1 on GPUs), and "same-d" over the mean of the rows
# of the same split into the same decode group (2 -> 8 against 8 -> 8: the same decode ranks,
# the same tasks per request, so what is left is what the other split costs). Tasks per
# request: prefill rank -> decode rank pairs (each a task, a notice and an arrival).
# --gpu: the GPU path: every instance's cache on GPU 0 (--backend cuda, the demo's default
# device), kvf-sim in GPU mode (layer kernels write, check kernels verify every byte on the GPU),
# rows 1 -> 2 and 2 -> 8 against 1 -> 1, 2 -> 2 and 8 -> 8, and against 1 -> 1 with --per-head
# (kvf-sim's content per head and token, its way for every other split);
# --executor E (engine, sender, auto) says where same-host copies run.
# --max-tokens N clips the prompts (default 1024: small requests, where the cost per task sets
# the rate; larger ones move more bytes per task). GiB/s: the bytes moved per second of the run;
# sim cpu: kvf-sim's CPU time over the run's (its one thread drives every rank of every
# instance; CUDA spins in its waits, so 1.0 alone does not say the thread was the limit); ev
# wait: the share of the run it waited in kvf_poll for a completion or an arrival (the
# transfer); gpu wait: the share it waited for its own GPU work (layer and check kernels).
# --cache-mib N: each rank's cache (default 512; large prompts need room for a few in flight).
# Usage: bench/sim_tp_bench.sh [--requests N] [--max-tokens N] [--cache-mib N] [--transport ipc|tcp]
#                              [--gpu [--executor E]]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REQ=200
MAXTOK=1024
CMIB=512
TR=ipc
GPU=0
EXEC=()
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) REQ=$2; shift 2 ;;
    --max-tokens) MAXTOK=$2; shift 2 ;;
    --cache-mib) CMIB=$2; shift 2 ;;
    --transport) TR=$2; shift 2 ;;
    --gpu) GPU=1; shift ;;
    --executor) EXEC=(--executor "$2"); shift 2 ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "sim_tp_bench.sh: unknown option '$1' (--requests N, --max-tokens N, --cache-mib N, --transport ipc|tcp, --gpu, --executor E)" >&2; exit 2 ;;
  esac
done
[ $GPU = 1 ] || [ ${#EXEC[@]} = 0 ] || { echo "sim_tp_bench.sh: --executor is for --gpu" >&2; exit 2; }
BACKEND=(--backend host)
[ $GPU = 1 ] && BACKEND=(--backend cuda "${EXEC[@]}" --gpu)
OUT=$(mktemp -d /tmp/sim_tp_bench.XXXXXX)
trap 'rm -rf "$OUT"' EXIT

# one LABEL [demo options]: prints "label seconds requests_per_s tasks_per_request GiB_per_s sim_cpu
# event_wait gpu_wait" (the last three as shares of the run)
one() {
  local label=$1 j=$OUT/$1.json
  shift
  "$ROOT/tools/kvferry" demo --requests "$REQ" --cache-mib "$CMIB" --layer-us 0 --max-tokens "$MAXTOK" \
    --prefix-pct 0 --late-pct 0 --verify sample --transport "$TR" --quiet --json "$j" "${BACKEND[@]}" "$@" \
    >"$OUT/$label.txt" 2>&1 || { cat "$OUT/$label.txt" >&2; echo "sim_tp_bench.sh: $label failed" >&2; exit 1; }
  /usr/bin/python3 -c 'import json,sys; d=json.load(open(sys.argv[1]))
assert d["ok"] and d["finished"] == d["requests"] and d["corrupt"] == 0, "not every request verified"
assert d["gpu"] == (sys.argv[3] == "1"), "kvf-sim ran in the wrong mode"
print(sys.argv[2], d["seconds"], d["requests_per_s"], d["tasks_per_request"], d["rate_bps"] / 2**30,
      d["sim_cpu_s"] / d["seconds"], d["sim_event_wait_s"] / d["seconds"], d["sim_gpu_wait_s"] / d["seconds"])
ph = d["sim_phase_s"]
with open(sys.argv[4], "a") as f:
    print(sys.argv[2], *("%.2f" % (ph[k] / d["seconds"]) for k in ("write", "layer", "step_end", "submit", "poll")), file=f)
' "$j" "$label" "$GPU" "$OUT/phases.txt"
}

lscpu | grep 'Model name' || true
echo "requests: $REQ over $TR, llama-3.1-8b, prompts clipped to $MAXTOK tokens, no compute time, $([ $GPU = 1 ] && echo "GPU caches (GPU 0) ${EXEC[*]}" || echo "host caches")"
if [ $GPU = 1 ]; then
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 || true
  order=(1-1_first 1-1_ph_first 2-2_first 8-8_first 1-2 2-8 8-8_last 2-2_last 1-1_ph_last 1-1_last)
else
  order=(2-2_first 8-8_first 2-4 4-2 1-2 1-2_bs16-64 2-8 8-8_last 2-2_last)
  [ "$TR" = ipc ] || order=("${order[@]/1-2_bs16-64}")
fi
rows=()
for label in "${order[@]}"; do
  [ -n "$label" ] || continue
  pd=${label%%_*} x=()
  [ "$label" = 1-2_bs16-64 ] && x=(--prefill-block-tokens 16 --decode-block-tokens 64)
  case $label in *_ph_*) x=(--per-head) ;; esac
  rows+=("$(one "$label" --prefill-tp "${pd%-*}" --decode-tp "${pd#*-}" "${x[@]}")")
done
# ratio: over the mean of the base rows (the first and last rows: 1 -> 1 on GPUs, 2 -> 2 on
# host caches); same-d: over the mean of the rows of the same split with the row's decode group
# (d -> d: the same decode ranks, the same tasks per request), where the run has them;
# per-head (GPU rows): over the mean of the 1 -> 1 rows run with --per-head (kvf-sim writing and
# checking a row per head and token as it does for every other split, so the same simulator work
# per byte on both sides: what is left is the transfer's).
printf '%s\n' "${rows[@]}" | awk '
  { l[NR] = $1; s[NR] = $2; r[NR] = $3; t[NR] = $4; g[NR] = $5; c[NR] = $6; ew[NR] = $7; gw[NR] = $8
    split($1, a, "_"); split(a[1], pd, "-"); p[NR] = pd[1]; d[NR] = pd[2]
    if ($1 ~ /_ph_/) { phs += $3; phn++ }
    else if (pd[1] == pd[2]) { sum[pd[2]] += $3; n[pd[2]]++ } }
  END {
    base = (r[1] + r[NR]) / 2
    printf "%-16s %9s %10s %8s %7s %7s %8s %10s %8s %8s %8s\n", "tp", "s", "req/s", "GiB/s", "ratio", "same-d", "per-head", "tasks/req", "sim cpu", "ev wait", "gpu wait"
    for (i = 1; i <= NR; i++) {
      sd = (d[i] in n && p[i] != d[i]) ? sprintf("%7.2f", r[i] / (sum[d[i]] / n[d[i]])) : sprintf("%7s", "-")
      ph = (phn && p[i] != d[i]) ? sprintf("%8.2f", r[i] / (phs / phn)) : sprintf("%8s", "-")
      printf "%-16s %9.3f %10.1f %8.2f %7.2f %s %s %10d %8.2f %8.2f %8.2f\n", l[i], s[i], r[i], g[i], r[i] / base, sd, ph, t[i], c[i], ew[i], gw[i]
    }
  }'
echo "where kvf-sim's thread went, as shares of each run: writing or queueing layers' content, layer-done"
echo "calls (with the engine executor its copies' plans and launches), waiting for a step's kernels,"
echo "task records, events and verification (with their waits):"
awk '{ printf "%-16s write %5s  layer %5s  step end %5s  submit %5s  poll %5s\n", $1, $2, $3, $4, $5, $6 }' "$OUT/phases.txt"
