#!/usr/bin/env bash
# gpu_suite.sh [OUTDIR]: every GPU check and benchmark of gpu/ in one go, on a
# machine with a GPU, results under OUTDIR (default ./gpu-results).
#
#   1. gpu_copy_test                      correctness (exit 0 pass, 1 fail, 77 no GPU)
#   2. gpu_copy_bench --json              kernel vs bulk copy vs one copy per block
#      gpu_copy_bench --hints plain       the same with the bulk copy's cache policy
#      gpu_l2_bench                       what copies beside an L2-resident engine cost it
#   3. gpu_latency_bench --json           layer-done -> copy start / landed, no MPS
#   4. MPS on (a private control daemon):
#        gpu_latency_bench --modes ref,proc,ctx --json   executor (1) as designed
#        gpu_copy_test                                   IPC and kernels under MPS
#      MPS off again, checked. MPS is never left running: a trap stops it on
#      any exit, and the suite says whether it could.
#
# The binaries come from the build directory $KVFERRY_BUILD (default: the first
# of build-cuda/ and build/ beside this script's repository that holds
# gpu/gpu_copy_test). Build it where nvcc is (cmake -S . -B build-cuda), carry
# it along with the repository. Expected total: 1 to 3 minutes; every step has
# a time limit and the limits add up to under 10 minutes.
#
# MPS by hand, for reference:
#   export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
#   nvidia-cuda-mps-control -d              # start
#   echo quit | nvidia-cuda-mps-control     # stop
# Raw output goes to OUTDIR, outside docs/: docs/results/ keeps only the small summaries that
# docs/BENCHMARKS.md ("Where the summaries are") describes; .gitignore refuses run output there.
set -uo pipefail

# The driver's tools (nvidia-cuda-mps-control) are not always on PATH (/usr/local/nvidia/bin).
[[ -d /usr/local/nvidia/bin ]] && PATH=$PATH:/usr/local/nvidia/bin
OUT=${1:-./gpu-results}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
if [[ -z "${KVFERRY_BUILD:-}" ]]; then
  for d in "$ROOT/build-cuda" "$ROOT/build"; do
    if [[ -x "$d/gpu/gpu_copy_test" ]]; then KVFERRY_BUILD=$d; break; fi
  done
fi
BIN=${KVFERRY_BUILD:-}/gpu
if [[ -z "${KVFERRY_BUILD:-}" || ! -x "$BIN/gpu_copy_test" ]]; then
  echo "gpu_suite: no build with gpu/gpu_copy_test found (set KVFERRY_BUILD)" >&2
  exit 2
fi
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
T0=$(date +%s)
FAILS=0

note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME LIMIT_S CMD...: run with a time limit, output to OUTDIR/NAME.txt,
# a line in the summary with the exit code and how long it took.
step() {
  local name=$1 limit=$2; shift 2
  local t rc
  t=$(date +%s)
  echo "== $name: $*" >"$OUT/$name.txt"
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$name.txt" 2>&1
  rc=$?
  local what=ok
  case $rc in
    0) ;;
    77)
      what="skipped (no GPU)"
      # Under MPS the GPU was there a moment ago (the check saw it): a failure.
      if [[ $name == *_mps ]]; then what="FAILED (no GPU under MPS)"; FAILS=$((FAILS + 1)); fi
      ;;
    124|137) what="TIMED OUT after ${limit}s"; FAILS=$((FAILS + 1)) ;;
    *) what="FAILED"; FAILS=$((FAILS + 1)) ;;
  esac
  note "$(printf '%-26s rc=%-3s %4ss  %s' "$name" "$rc" "$(($(date +%s) - t))" "$what")"
  return $rc
}

note "gpu_suite: $(date -u +%FT%TZ) on $(hostname), build $KVFERRY_BUILD, results $OUT"
note "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
  note "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv,noheader 2>/dev/null | head -1)"
fi

step gpu_copy_test 90 "$BIN/gpu_copy_test"
if [[ $? == 77 ]]; then
  note "no GPU here: nothing else to run"
  exit 77
fi
step gpu_copy_bench 110 "$BIN/gpu_copy_bench" --json "$OUT/gpu_copy_bench.json"
step gpu_copy_bench_plain 60 "$BIN/gpu_copy_bench" --hints plain --json "$OUT/gpu_copy_bench_plain.json"
step gpu_l2_bench 60 "$BIN/gpu_l2_bench"
if "$BIN/gpu_latency_bench" --mps-check >"$OUT/mps-before.txt" 2>&1; then
  note "WARNING: MPS was already on before the suite: the no-MPS run below runs under it"
fi
step gpu_latency_bench 110 "$BIN/gpu_latency_bench" --json "$OUT/gpu_latency_bench.json"

# --- MPS: a private daemon (own pipe and log directories), always stopped.
MPS_STARTED=0
mps_stop() {
  if [[ $MPS_STARTED == 1 ]]; then
    echo quit | timeout 20 nvidia-cuda-mps-control >>"$OUT/mps-control.txt" 2>&1
    # The daemon exits once its server is gone; wait for its control pipe to stop answering.
    for _ in $(seq 1 50); do
      echo get_server_list | timeout 2 nvidia-cuda-mps-control >/dev/null 2>&1 || break
      sleep 0.2
    done
    MPS_STARTED=0
    rm -rf "$CUDA_MPS_PIPE_DIRECTORY"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    if "$BIN/gpu_latency_bench" --mps-check >"$OUT/mps-after.txt" 2>&1; then
      note "WARNING: MPS still reported on after quit: see $OUT/mps-control.txt"
    else
      note "mps: stopped (checked)"
    fi
  fi
}
trap 'mps_stop' EXIT
trap 'mps_stop; exit 130' INT TERM

if command -v nvidia-cuda-mps-control >/dev/null; then
  # The pipe directory holds sockets (short path, not among the results); the logs are kept.
  CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/kvf-mps.XXXXXX) || exit 2
  export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY=$OUT/mps-log
  mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d >>"$OUT/mps-control.txt" 2>&1; then
    MPS_STARTED=1
    if "$BIN/gpu_latency_bench" --mps-check >"$OUT/mps-on.txt" 2>&1; then
      note "mps: started, clients see it"
      step gpu_latency_bench_mps 90 "$BIN/gpu_latency_bench" --modes ref,proc,ctx \
        --json "$OUT/gpu_latency_bench_mps.json"
      step gpu_copy_test_mps 60 "$BIN/gpu_copy_test"
    else
      note "mps: daemon started but a client does not see MPS: $(cat "$OUT/mps-on.txt")"
      FAILS=$((FAILS + 1))
    fi
  else
    note "mps: nvidia-cuda-mps-control -d failed: $(tail -1 "$OUT/mps-control.txt")"
    FAILS=$((FAILS + 1))
  fi
  mps_stop
else
  note "mps: nvidia-cuda-mps-control not found: MPS runs skipped"
fi

{
  echo
  echo "--- targets and verdicts"
  grep -h -E "target|PASS|MISS|FAIL|WRONG" "$OUT"/gpu_copy_bench.txt "$OUT"/gpu_latency_bench*.txt \
    "$OUT"/gpu_copy_test*.txt 2>/dev/null
  grep -h -E "^target" "$OUT"/gpu_copy_bench_plain.txt 2>/dev/null | sed 's/^/(--hints plain) /'
} | tee -a "$SUMMARY"
note "gpu_suite: $FAILS step(s) failed, $(($(date +%s) - T0)) s in all"
[[ $FAILS == 0 ]]
