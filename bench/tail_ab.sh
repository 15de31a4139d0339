#!/usr/bin/env bash
# A/B of the host path: two built trees (each with build/), run alternately, the same kvf-sim
# binary (the second tree's, or $KVF_SIM) driving both, or each tree's own (KVF_SIM=own: for
# trees whose segment layouts differ). Per run: a prefill and a
# decode instance of the tree, 10 warm-up requests, then the measured run; one line per run.
# Usage: bench/tail_ab.sh TREE_A TREE_B [ROUNDS] [-- kvf-sim options]
#   UP_A, UP_B: extra options of `tools/kvferry up` for A's and B's instances (the same tree
#   twice with UP_A="--slice-us 0" compares an option, not two builds).
#   ENV_A, ENV_B: NAME=VALUE words put in the environment of A's and B's instances (the A/B
#   switches KVF_AB_*: docs/BENCHMARKS.md section 13).
#   default kvf-sim options: 200 requests clipped to 2048 tokens (transfer overhead, not copy,
#   dominates), 1000 us per layer, one request per step.
set -euo pipefail
A=$(cd "$1" && pwd); B=$(cd "$2" && pwd); ROUNDS=${3:-4}
shift $(( $# >= 3 ? 3 : $# ))
[ "${1:-}" = -- ] && shift
ARGS=("$@"); [ ${#ARGS[@]} -eq 0 ] && ARGS=(--requests 200 --max-tokens 2048 --layer-us 1000 --step-tokens 1)
SIM=${KVF_SIM:-$B/build/kvf-sim}
[ "$SIM" = own ] && SIM=
L8="--model llama-3.1-8b --tp 8 --cache-mib 2048"
CUR_ROOT= CUR_T=
cleanup() {
  [ -n "$CUR_T" ] && "$CUR_ROOT/tools/kvferry" down --instance $CUR_T-p --instance $CUR_T-d >/dev/null 2>&1
  [ -n "$CUR_T" ] && rm -rf "$KVFERRY_RUN_DIR"
  return 0
}
trap cleanup EXIT
one() {
  local root=$1 t=ab$$x$RANDOM up_extra env_extra
  read -r -a up_extra <<<"$2"
  read -r -a env_extra <<<"$3"
  export KVFERRY_RUN_DIR; KVFERRY_RUN_DIR=$(mktemp -d /tmp/kvferry-ab.XXXXXX)
  export KVFERRY_TOKEN_FILE=$KVFERRY_RUN_DIR/token
  CUR_ROOT=$root CUR_T=$t
  env "${env_extra[@]}" "$root/tools/kvferry" up --instance $t-d --role decode $L8 "${up_extra[@]}" >/dev/null 2>&1
  env "${env_extra[@]}" "$root/tools/kvferry" up --instance $t-p --role prefill $L8 "${up_extra[@]}" >/dev/null 2>&1
  local sim=${SIM:-$root/build/kvf-sim}
  "$sim" --quiet --verify sample --prefill $t-p --decode $t-d --requests 10 --layer-us 0 >/dev/null
  "$sim" --quiet --verify sample --prefill $t-p --decode $t-d --baseline --json "$KVFERRY_RUN_DIR/o.json" "${ARGS[@]}" >/dev/null
  /usr/bin/python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print('tail, tasks in time: p50 %5.0f us p99 %6.0f us | late tasks %d | all: p50 %5.0f us p99 %6.0f us | '
      'copy start p50 %5.1f us p99 %6.1f us | published p50 %5.1f us | rate/memcpy %.2f | ok %s' % (
  d['tail_in_time_p50_ns']/1e3, d['tail_in_time_p99_ns']/1e3, d['late_tasks'], d['tail_p50_ns']/1e3,
  d['tail_p99_ns']/1e3, d['layer_to_copy_p50_ns']/1e3, d['layer_to_copy_p99_ns']/1e3,
  d.get('published_p50_ns', 0)/1e3,
  d['rate_bps']/d['memcpy_bps'] if d['memcpy_bps'] else 0, d['ok']))" "$KVFERRY_RUN_DIR/o.json"
  cleanup
  CUR_T=
}
for i in $(seq "$ROUNDS"); do
  echo -n "A $i  "; one "$A" "${UP_A:-}" "${ENV_A:-}"
  echo -n "B $i  "; one "$B" "${UP_B:-}" "${ENV_B:-}"
done
