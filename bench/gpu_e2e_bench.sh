#!/usr/bin/env bash
# gpu_e2e_bench.sh OUTDIR: every GPU figure docs/BENCHMARKS.md needs, in one go, on a machine
# with a GPU (expected 4 to 6 minutes; every step has a time limit). Results under OUTDIR.
#
#   1. bench/gpu_suite.sh OUTDIR/suite: gpu_copy_test; gpu_copy_bench (kvferry's kernel against
#      one bulk cudaMemcpy and against one cudaMemcpyAsync per block, real model shapes);
#      gpu_latency_bench (layer-done -> copy start / landed, engine idle and busy, the reference
#      in the engine's process against executor 1 in another process and executor 2 in the
#      engine's context; the signal methods); both again under MPS.
#   2. kvf-sim --gpu end to end, GPU caches on one GPU: the transfer tail of whole requests
#      (the last layer's end on the GPU -> the arrival on the decode side) against one layer's
#      copy of an average request at the bulk cudaMemcpy rate (--baseline), per executor:
#        engine-hostfn      executor 2, layer-done by host function
#        engine-writevalue  executor 2, layer-done written by the GPU (cuStreamWriteValue64, the default)
#        sender             executor 1 without MPS (the case MPS exists for), host function
#                           (its default)
#        sender-mps         executor 1 under MPS (tools/kvferry up --mps, a private daemon),
#                           the GPU-written word (its default)
#      for llama-3.1-8b at tp 1 (128 KiB blocks) with a busy GPU (every SM, 200 us per layer).
#   3. tools/kvferry demo (backend auto: the GPU), as a user runs it.
#
# Binaries: $KVFERRY_BUILD (default build/ of this repository), built where nvcc is. Needs
# nothing but the build, the repository and the driver (liburing.so.2 for the connector).
# KVF_SIM_ARGS: more kvf-sim options for step 2 (e.g. --layer-ns-per-token 250 --requests 200).
# summary.txt: one line per step with its exit code, then the tails table.
# Exit: 0 every step passed, 1 some failed, 2 usage, 77 no GPU.
# Raw output goes to OUTDIR, outside docs/: docs/results/ keeps only the small summaries that
# docs/BENCHMARKS.md ("Where the summaries are") describes; .gitignore refuses run output there.
set -uo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
export KVFERRY_BUILD=${KVFERRY_BUILD:-$ROOT/build}
B=$KVFERRY_BUILD
K=$ROOT/tools/kvferry
SHAPE="--model llama-3.1-8b --tp 1 --cache-mib 12288"
SIM="--requests 300 --layer-us 200 --late-pct 10 --prefix-pct 20 --baseline --timeout-s 60
     --trace $ROOT/data/mooncake-conversation-2000.jsonl ${KVF_SIM_ARGS:-}"

# __run_sim NAME EXECUTOR [VAR=VALUE...] (this script, run again under a time limit): a decode
# and a prefill instance (bd<id>-NAME, bp<id>-NAME), one kvf-sim --gpu run, both stopped again.
if [ "${1:-}" = __run_sim ]; then
  name=$2 ex=$3 d=bd$BENCH_ID-$2 p=bp$BENCH_ID-$2 mps=()
  shift 3
  [ "${name%-mps}" != "$name" ] && mps=(--mps)
  "$K" up --instance "$d" --role decode $SHAPE --backend cuda --executor "$ex" "${mps[@]}" &&
    "$K" up --instance "$p" --role prefill $SHAPE --backend cuda --executor "$ex" "${mps[@]}" &&
    env "$@" "$B/kvf-sim" --gpu --prefill "$p" --decode "$d" $SIM --json "$BENCH_OUT/sim-$name.json"
  rc=$?
  "$B/kvf-ringdump" --instance "$p" >"$BENCH_OUT/ringdump-$name.txt" 2>&1
  "$K" down --instance "$p" --instance "$d" >/dev/null 2>&1
  exit $rc
fi

[ $# -eq 1 ] || { echo "usage: bench/gpu_e2e_bench.sh OUTDIR" >&2; exit 2; }
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
export KVFERRY_RUN_DIR=$OUT/run
export KVFERRY_TOKEN_FILE=$OUT/run/token
mkdir -p "$KVFERRY_RUN_DIR" && chmod 700 "$KVFERRY_RUN_DIR"
T0=$(date +%s)
FAILS=0
note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME LIMIT_S CMD...: output to OUTDIR/NAME.txt, a summary line with the exit code
step() {
  local name=$1 limit=$2 t rc what=ok; shift 2
  t=$(date +%s)
  echo "== $name: $*" >"$OUT/$name.txt"
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$name.txt" 2>&1
  rc=$?
  case $rc in
    0) ;;
    77) what="skipped (no GPU)" ;;
    124|137) what="TIMED OUT after ${limit}s"; FAILS=$((FAILS + 1)) ;;
    *) what=FAILED; FAILS=$((FAILS + 1)) ;;
  esac
  note "$(printf '%-28s rc=%-3s %4ss  %s' "$name" "$rc" "$(($(date +%s) - t))" "$what")"
  return $rc
}

note "gpu_e2e_bench: $(date -u +%FT%TZ) on $(hostname), build $B, results $OUT"
note "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
NGPU=$("$B/kvf-ctl" gpus 2>"$OUT/gpus.txt" || echo 0)
if ! [ "${NGPU:-0}" -ge 1 ] 2>/dev/null; then
  note "no GPU visible: $(cat "$OUT/gpus.txt")"
  exit 77
fi
command -v nvidia-smi >/dev/null && note "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"

# ---- 1. the building blocks
step gpu_suite 400 "$HERE/gpu_suite.sh" "$OUT/suite"

# ---- 2. whole requests through kvferry
INSTANCES=()
MPSCTL=$(command -v nvidia-cuda-mps-control || true)
[ -z "$MPSCTL" ] && [ -x /usr/local/nvidia/bin/nvidia-cuda-mps-control ] && MPSCTL=/usr/local/nvidia/bin/nvidia-cuda-mps-control
MPS_DIR=""
cleanup_instances() {
  local n args=()
  for n in "${INSTANCES[@]}"; do
    [ -e "/dev/shm/kvferry.$n" ] || [ -f "$KVFERRY_RUN_DIR/$n/supervisor.pid" ] && args+=(--instance "$n")
  done
  [ ${#args[@]} = 0 ] || "$K" down "${args[@]}" >/dev/null 2>&1
  INSTANCES=()
}
cleanup() {
  cleanup_instances
  if [ -n "$MPS_DIR" ]; then
    CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR timeout 20 "$MPSCTL" <<<quit >/dev/null 2>&1
    rm -rf "$MPS_DIR"
    MPS_DIR=""
  fi
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT TERM

export BENCH_ID=$$ BENCH_OUT=$OUT

sim_step() { # sim_step NAME LIMIT EXECUTOR [VAR=VALUE...]
  local name=$1 limit=$2; shift 2
  INSTANCES=("bd$BENCH_ID-$name" "bp$BENCH_ID-$name")
  step "sim-$name" "$limit" "$0" __run_sim "$name" "$@"
  cleanup_instances
}
sim_step engine-hostfn 75 engine KVFERRY_LAYER_SIGNAL=hostfn
sim_step engine-writevalue 75 engine KVFERRY_LAYER_SIGNAL=writevalue
sim_step sender 90 sender KVFERRY_LAYER_SIGNAL=hostfn
if [ -n "$MPSCTL" ]; then
  MPS_DIR=$(mktemp -d /tmp/kvf-mps.XXXXXX)
  export CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR CUDA_MPS_LOG_DIRECTORY=$OUT/mps-log
  mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
  sim_step sender-mps 75 sender KVFERRY_LAYER_SIGNAL=writevalue
  cleanup
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
else
  note "sim-sender-mps: skipped (nvidia-cuda-mps-control not installed)"
fi

# ---- 3. the demo, as a user runs it
step demo 150 "$K" demo --requests 200

# ---- the tails, side by side
jv() { sed -n "s/.*\"$2\":\([^,}]*\).*/\1/p" "$1" 2>/dev/null | head -n1; }
{
  echo
  echo "--- transfer tail of whole requests, kvf-sim --gpu, llama-3.1-8b tp1, 300 requests, 200 us/layer (busy GPU)"
  printf '%-20s %8s %10s %10s %10s %10s %10s %12s %8s\n' run finished "tail p50" "tail p99" \
    "compl p50" "copy p50" "1 layer" "tail/layer" ok
  for f in "$OUT"/sim-*.json; do
    [ -f "$f" ] || continue
    n=$(basename "$f" .json); n=${n#sim-}
    awk -v n="$n" -v fin="$(jv "$f" finished)" -v t50="$(jv "$f" tail_in_time_p50_ns)" \
      -v t99="$(jv "$f" tail_in_time_p99_ns)" -v c50="$(jv "$f" completion_tail_p50_ns)" \
      -v l2c="$(jv "$f" layer_to_copy_p50_ns)" -v bps="$(jv "$f" memcpy_bps)" \
      -v lb="$(jv "$f" avg_layer_bytes)" -v ok="$(jv "$f" ok)" 'BEGIN {
        layer = bps > 0 ? lb / bps * 1e6 : 0;
        printf "%-20s %8s %8.1fus %8.1fus %8.1fus %8.1fus %8.1fus %12.2f %8s\n", n, fin, t50 / 1e3,
               t99 / 1e3, c50 / 1e3, l2c / 1e3, layer, (layer > 0 ? t50 / 1e3 / layer : 0), ok }'
  done
  echo "(tail: the last layer's end on the GPU -> the arrival, requests whose task came in time;"
  echo " compl: -> the completion on the prefill side; copy: the sender's layer-done -> copy start"
  echo " (its own copies only); 1 layer: an average request's layer at the bulk cudaMemcpy rate)"
  grep -h "ran on" "$OUT/demo.txt" 2>/dev/null | sed 's/^/demo: /'
} | tee -a "$SUMMARY"
note "gpu_e2e_bench: $FAILS step(s) failed, $(($(date +%s) - T0)) s in all"
[ $FAILS = 0 ]
