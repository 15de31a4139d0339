#!/usr/bin/env bash
# The engine's caches (up --caches engine) against the allocator's own caches in the same run:
# ipc throughput of the two pairs, alternating, and the time to register 100 layers x K/V as one
# allocation and as 200 (bench/register_bench.py says what is measured).
#
#   bench/register_bench.sh [--rounds R] [--blocks-per-request N]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=5 BLOCKS=64
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=${2:?}; shift 2 ;;
    --blocks-per-request) BLOCKS=${2:?}; shift 2 ;;
    *) echo "Usage: bench/register_bench.sh [--rounds R] [--blocks-per-request N]" >&2; exit 2 ;;
  esac
done
export KVFERRY_RUN_DIR=$(mktemp -d /tmp/kvferry-regbench.XXXXXX)
export KVFERRY_TOKEN_FILE=$KVFERRY_RUN_DIR/token
T=rb$$
STARTED=()
cleanup() {
  for n in "${STARTED[@]}"; do "$ROOT/tools/kvferry" down --instance "$n" >/dev/null 2>&1 || true; done
  rm -rf "$KVFERRY_RUN_DIR"
}
trap cleanup EXIT
up() { STARTED+=("$1"); "$ROOT/tools/kvferry" up --instance "$@" >/dev/null; }
L="--model llama-3.1-8b --tp 8 --cache-mib 256"
up $T-op --role prefill $L
up $T-od --role decode $L
up $T-ep --role prefill --caches engine $L
up $T-ed --role decode --caches engine $L
up $T-r100 --role prefill --caches engine --layers 100 --kv-heads 1 --head-dim 128 --blocks 64
lscpu | grep 'Model name'
KVFERRY_BUILD=${KVFERRY_BUILD:-$ROOT/build} PYTHONPATH="$ROOT/python" /usr/bin/python3 \
  "$ROOT/bench/register_bench.py" $T-op $T-od $T-ep $T-ed $T-r100 "$ROUNDS" "$BLOCKS"
