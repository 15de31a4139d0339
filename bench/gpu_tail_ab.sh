#!/usr/bin/env bash
# gpu_tail_ab.sh OUTDIR [ROUNDS]: the whole-request tail on GPU caches (the last layer's end on
# the GPU -> the arrival on the decode side; kvf-sim --gpu, llama-3.1-8b tp 1, busy GPU, as
# gpu_e2e_bench.sh step 2) for two arms of the same build, alternated A B per executor and
# signal method, ROUNDS times (default 2), each run on fresh instances. An arm is an environment
# for its instances' roles: ENV_A and ENV_B (space-separated VAR=VALUE, e.g.
# ENV_B="KVF_AB_NO_NOTICE_EXPECT=1"); A alone is empty. ROWS picks rows (default "engine-hostfn
# engine-writevalue sender sender-mps"; sender-wv, sender-wv-mps: the sender's copies without
# and under MPS with the layer-done word written by the GPU, the default signal; engine-wv-mps: the
# engine's copies, the GPU-written word, under MPS). Prints, per
# run and as medians per arm with the ratio B / A: the in-time tail p50 and p99, and the stages
# of the p50: the signal (the last layer's end -> the sender saw it), the notice (-> the
# sender posted the finish notice) and the publication (per request, the notice posted -> the
# decode connector published the arrival: its share of the tail); per run also the engine
# thread's time in its layer-done calls (kvf-sim's `layer` phase) and, from the prefill
# instance's ring dump, the engine executor's plans and how many the sender took back, and how
# many of the 10 slowest requests had their arrival published over 1 ms after their notice.
# Needs a GPU; binaries from $KVFERRY_BUILD (default build/). Raw output under OUTDIR.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
export KVFERRY_BUILD=${KVFERRY_BUILD:-$ROOT/build}
[ $# -ge 1 ] || { echo "usage: [ENV_A=...] [ENV_B=...] [ROWS=...] bench/gpu_tail_ab.sh OUTDIR [ROUNDS]" >&2; exit 2; }
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
ROUNDS=${2:-2}
ROWS=${ROWS:-engine-hostfn engine-writevalue sender sender-mps}
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
# run NAME EXECUTOR ARM VAR=VALUE...: one kvf-sim --gpu run through gpu_e2e_bench.sh's own runner,
# the arm's environment given to `up` (so to every role) and to kvf-sim
run() {
  local name=$1 ex=$2 arm=$3 envs; shift 3
  [ "$arm" = A ] && envs=${ENV_A:-} || envs=${ENV_B:-}
  # shellcheck disable=SC2086 # ENV_A/ENV_B are lists of VAR=VALUE words
  env $envs BENCH_ID=$$r$r$arm BENCH_OUT=$OUT \
    timeout --kill-after=10 90 "$HERE/gpu_e2e_bench.sh" __run_sim "$name" "$ex" "$@" >"$OUT/$name-$arm-$r.txt" 2>&1
  local rc=$?
  mv "$OUT/sim-$name.json" "$OUT/$name-$arm-$r.json" 2>/dev/null
  mv "$OUT/ringdump-$name.txt" "$OUT/$name-$arm-$r.ringdump.txt" 2>/dev/null
  echo "$name $arm round $r rc=$rc"
}
row() { # row NAME ARM
  case $1 in
    engine-hostfn) run engine-hostfn engine "$2" KVFERRY_LAYER_SIGNAL=hostfn ;;
    engine-writevalue) run engine-writevalue engine "$2" KVFERRY_LAYER_SIGNAL=writevalue ;;
    sender) run sender sender "$2" KVFERRY_LAYER_SIGNAL=hostfn ;;
    sender-wv) run sender-wv sender "$2" KVFERRY_LAYER_SIGNAL=writevalue ;;
    sender-mps|sender-wv-mps|engine-wv-mps) # under MPS: the sender's copies (the layer signal
      # by host function or written by the GPU), or the engine's with the GPU-written word (the
      # sender's own copies, of requests whose plan came too late, then run beside the engine's
      # kernels instead of taking turns with them)
      [ -x "$MPSCTL" ] || { echo "$1: skipped (no nvidia-cuda-mps-control)"; return; }
      MPS_DIR=$(mktemp -d /tmp/kvf-mps.XXXXXX)
      export CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR CUDA_MPS_LOG_DIRECTORY=$OUT/mps-log
      mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
      local sig=hostfn ex=sender
      [ "$1" != sender-mps ] && sig=writevalue
      [ "$1" = engine-wv-mps ] && ex=engine
      run "$1" $ex "$2" KVFERRY_LAYER_SIGNAL=$sig
      stop_mps ;;
    *) echo "gpu_tail_ab.sh: unknown row '$1'" >&2; exit 2 ;;
  esac
}
for ((r = 1; r <= ROUNDS; r++)); do
  for name in $ROWS; do
    # A first in odd rounds, B first in even ones: neither arm always runs on a warmer GPU
    if ((r % 2)); then row "$name" A; row "$name" B; else row "$name" B; row "$name" A; fi
  done
done
ENV_A=${ENV_A:-} ENV_B=${ENV_B:-} python3 - "$OUT" <<'EOF'
import glob, json, os, re, statistics, sys
rows = {}
def late_pub(d):  # of the 10 slowest in-time requests: arrival published > 1 ms after its notice
    return sum(1 for x in d.get("slowest_in_time", []) if x[7] > 0 and x[1] - x[7] > 1e6)
def plans(f):  # the engine executor's plans: "published/taken back by the sender", from ringdump
    try:
        m = re.search(r"plans (\d+) published, (\d+) taken back", open(f[:-5] + ".ringdump.txt").read())
    except OSError:
        m = None
    return f"  plans {m.group(1)}, taken back {m.group(2)}" if m else ""
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*-[AB]-*.json"))):
    name, arm, r = os.path.basename(f)[:-5].rsplit("-", 2)
    d = json.load(open(f))
    v = (d["tail_in_time_p50_ns"] / 1e3, d["tail_in_time_p99_ns"] / 1e3,
         d.get("seen_p50_ns", 0) / 1e3, d.get("notice_p50_ns", 0) / 1e3, d.get("published_p50_ns", 0) / 1e3)
    # the target: one layer of an average request at this run's bulk copy rate + 50 us
    goal = d["avg_layer_bytes"] / d["memcpy_bps"] * 1e6 + 50 if d.get("memcpy_bps") else 0
    met = "p50 met" if goal and v[0] <= goal else "p50 missed"
    print(f"{name:18s} {arm} round {r}: tail p50 {v[0]:7.1f} us  p99 {v[1]:8.1f} us  "
          f"seen p50 {v[2]:6.1f}  notice p50 {v[3]:7.1f}  published p50 {v[4]:6.1f}  finished {d['finished']}  "
          f"ok {d['ok']}  target {goal:.1f} us ({met}, p99 {'met' if v[1] <= 1000 else 'missed'})"
          f"  engine's layer calls {d.get('sim_phase_s', {}).get('layer', 0):.3f} s{plans(f)}"
          f"  published > 1 ms after the notice: {late_pub(d)}")
    rows.setdefault((name, arm), []).append(v)
print(f"\nmedians (A: '{os.environ['ENV_A']}', B: '{os.environ['ENV_B']}')")
for name in sorted({n for n, _ in rows}):
    a, b = rows.get((name, "A"), []), rows.get((name, "B"), [])
    if not a or not b:
        continue
    m = lambda v, i: statistics.median(x[i] for x in v)
    print(f"{name:18s} p50 A {m(a,0):7.1f} B {m(b,0):7.1f} us (B/A {m(b,0)/m(a,0):.2f})  "
          f"p99 A {m(a,1):8.1f} B {m(b,1):8.1f} us (B/A {m(b,1)/m(a,1):.2f})  "
          f"notice p50 A {m(a,3):6.1f} B {m(b,3):6.1f}  published p50 A {m(a,4):5.1f} B {m(b,4):5.1f}  "
          f"seen p50 A {m(a,2):5.1f} B {m(b,2):5.1f}")
EOF
