#!/usr/bin/env bash
# gpu_tail_ab.sh OUTDIR [ROUNDS]: the whole-request tail on GPU caches (the last layer's end on
# the GPU -> the arrival on the decode side; kvf-sim --gpu, llama-3.1-8b tp 1, busy GPU, as
# gpu_e2e_bench.sh step 2) with same-host finish notices through the connectors' sockets (A, the
# default) and through the decode segment's notice rings (B, `up --notice-rings`), alternated
# A B per executor and signal method, ROUNDS times (default 2). Prints p50 and p99 of every run
# and the medians per arm with the ratio B / A.
# Needs a GPU; binaries from $KVFERRY_BUILD (default build/). Raw output under OUTDIR.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
export KVFERRY_BUILD=${KVFERRY_BUILD:-$ROOT/build}
[ $# -ge 1 ] || { echo "usage: bench/gpu_tail_ab.sh OUTDIR [ROUNDS]" >&2; exit 2; }
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
ROUNDS=${2:-2}
export KVFERRY_RUN_DIR=$OUT/run KVFERRY_TOKEN_FILE=$OUT/run/token
mkdir -p "$KVFERRY_RUN_DIR" && chmod 700 "$KVFERRY_RUN_DIR"
[ "$("$KVFERRY_BUILD/kvf-ctl" gpus 2>/dev/null || echo 0)" -ge 1 ] 2>/dev/null || { echo "no GPU visible"; exit 77; }
MPSCTL=$(command -v nvidia-cuda-mps-control || echo /usr/local/nvidia/bin/nvidia-cuda-mps-control)
MPS_DIR=""
stop_mps() {
  [ -n "$MPS_DIR" ] || return 0
  CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR timeout 20 "$MPSCTL" <<<quit >/dev/null 2>&1
  rm -rf "$MPS_DIR"; MPS_DIR=""
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
trap stop_mps EXIT
# run NAME EXECUTOR ARM VAR=VALUE...: one kvf-sim --gpu run through gpu_e2e_bench.sh's own runner
run() {
  local name=$1 ex=$2 arm=$3 rings=0; shift 3
  [ "$arm" = B ] && rings=1
  BENCH_ID=$$r$r$arm BENCH_OUT=$OUT KVFERRY_NOTICE_RINGS=$rings \
    timeout --kill-after=10 90 "$HERE/gpu_e2e_bench.sh" __run_sim "$name" "$ex" "$@" >"$OUT/$name-$arm-$r.txt" 2>&1
  local rc=$?
  mv "$OUT/sim-$name.json" "$OUT/$name-$arm-$r.json" 2>/dev/null
  echo "$name $arm round $r rc=$rc"
}
for ((r = 1; r <= ROUNDS; r++)); do
  for arm in A B; do
    run engine-hostfn engine $arm KVFERRY_LAYER_SIGNAL=hostfn
    run engine-writevalue engine $arm KVFERRY_LAYER_SIGNAL=writevalue
    run sender sender $arm KVFERRY_LAYER_SIGNAL=hostfn
    if [ -x "$MPSCTL" ]; then
      MPS_DIR=$(mktemp -d /tmp/kvf-mps.XXXXXX)
      export CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR CUDA_MPS_LOG_DIRECTORY=$OUT/mps-log
      mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
      run sender-mps sender $arm KVFERRY_LAYER_SIGNAL=hostfn
      stop_mps
    fi
  done
done
python3 - "$OUT" <<'EOF'
import glob, json, os, statistics, sys
rows = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*-[AB]-*.json"))):
    name, arm, r = os.path.basename(f)[:-5].rsplit("-", 2)
    d = json.load(open(f))
    t50, t99 = d["tail_in_time_p50_ns"] / 1e3, d["tail_in_time_p99_ns"] / 1e3
    print(f"{name:18s} {arm} round {r}: tail p50 {t50:8.1f} us  p99 {t99:9.1f} us  finished {d['finished']}  ok {d['ok']}")
    rows.setdefault((name, arm), []).append((t50, t99))
print("\nmedians (A: sockets, B: notice rings)")
for name in sorted({n for n, _ in rows}):
    a, b = rows.get((name, "A"), []), rows.get((name, "B"), [])
    if not a or not b:
        continue
    m = lambda v, i: statistics.median(x[i] for x in v)
    print(f"{name:18s} p50 A {m(a,0):8.1f} B {m(b,0):8.1f} us (B/A {m(b,0)/m(a,0):.2f})   "
          f"p99 A {m(a,1):9.1f} B {m(b,1):9.1f} us (B/A {m(b,1)/m(a,1):.2f})")
EOF
