#!/usr/bin/env bash
# gpu_all.sh OUTDIR: the whole GPU run in one command, on a machine with a GPU (about 15
# minutes): the GPU tests (gpu_copy_test, tests/gpu_e2e_test.sh, tests/gpu_tp_test.sh), then every benchmark
# (bench/gpu_e2e_bench.sh OUTDIR/bench, bench/gpu_tp_bench.sh for each executor). The test programs run directly, not through ctest: a
# build carried from another machine has that machine's paths in its CTest files.
#
#   KVFERRY_BUILD   the build (default build/ of this repository), made where nvcc is
# Needs the build, the repository and the driver (and liburing.so.2 on LD_LIBRARY_PATH for the
# connector). OUTDIR/summary.txt: one line per part, then every "ok:"/"FAIL" line of the tests
# and the benchmarks' summary. Exit 0 all passed, 1 something failed, 77 no GPU.
# Raw output goes to OUTDIR, outside docs/: docs/results/ keeps only the small summaries that
# docs/BENCHMARKS.md ("Where the summaries are") describes; .gitignore refuses run output there.
set -uo pipefail
[ $# -eq 1 ] || { echo "usage: bench/gpu_all.sh OUTDIR" >&2; exit 2; }
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
export KVFERRY_BUILD=${KVFERRY_BUILD:-$ROOT/build}
[ -d /usr/local/nvidia/bin ] && PATH=$PATH:/usr/local/nvidia/bin
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
: >"$OUT/summary.txt"
FAILS=0 SKIPS=0

part() { # part NAME LIMIT_S CMD...
  local name=$1 limit=$2 t rc what; shift 2
  t=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.txt" 2>&1
  rc=$?
  case $rc in
    0) what=passed ;;
    77) what="skipped: $(tail -n 1 "$OUT/$name.txt")"; SKIPS=$((SKIPS + 1)) ;;
    124|137) what="TIMED OUT after ${limit}s"; FAILS=$((FAILS + 1)) ;;
    *) what=FAILED; FAILS=$((FAILS + 1)) ;;
  esac
  printf '%-16s rc=%-3s %4ss  %s\n' "$name" "$rc" "$(($(date +%s) - t))" "$what" | tee -a "$OUT/summary.txt"
}

echo "gpu_all: $(date -u +%FT%TZ) on $(hostname), build $KVFERRY_BUILD, commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)" |
  tee -a "$OUT/summary.txt"
part gpu_copy_test 200 "$KVFERRY_BUILD/gpu/gpu_copy_test"
part gpu_e2e_test 900 "$ROOT/tests/gpu_e2e_test.sh"
part gpu_tp_test 600 "$ROOT/tests/gpu_tp_test.sh"
part gpu_e2e_bench 600 "$HERE/gpu_e2e_bench.sh" "$OUT/bench"
part gpu_tp_engine 300 "$HERE/gpu_tp_bench.sh" --executor engine
part gpu_tp_sender 300 "$HERE/gpu_tp_bench.sh" --executor sender
{
  echo
  echo "--- tests"
  grep -h -E "^ok:|^FAIL|^skipped|PASS|all passed" "$OUT/gpu_copy_test.txt" "$OUT/gpu_e2e_test.txt" "$OUT/gpu_tp_test.txt" 2>/dev/null
  echo
  echo "--- benchmarks ($OUT/bench/summary.txt)"
  cat "$OUT/bench/summary.txt" 2>/dev/null
  echo
  echo "--- tensor-parallel splits, one engine process per rank (bench/gpu_tp_bench.sh)"
  tail -n 10 "$OUT/gpu_tp_engine.txt" "$OUT/gpu_tp_sender.txt" 2>/dev/null
} >>"$OUT/summary.txt"
echo "gpu_all: $FAILS part(s) failed, $SKIPS skipped; $OUT/summary.txt" | tee -a "$OUT/summary.txt"
[ $FAILS = 0 ] || exit 1
[ $SKIPS = 6 ] && exit 77
exit 0
