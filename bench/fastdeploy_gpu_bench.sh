#!/usr/bin/env bash
# kvferry as FastDeploy's cache messager on GPU caches: how soon a layer signal becomes a copy,
# in both of FastDeploy's signal modes, over ipc, against the emulated deployment
# (tests/fastdeploy_emu) whose worker writes each layer on a stream of its own and raises the
# signal from a cudaLaunchHostFunc host function queued after the write, as FastDeploy's does.
#
#   KVF_PYTHON=$(command -v python3) KVFERRY_BUILD=$PWD/gpubuild bench/fastdeploy_gpu_bench.sh [N] [BLOCKS]
#
# N requests (default 200) of BLOCKS blocks (default 8), one at a time, on one GPU (decode on
# the same GPU under FD_IPC_APPEND_SUFFIX, or on the next one with KVF_TEST_GPUS=2), tp 1.
# Per mode it prints, and gives as one "BENCH {json}" line:
#   - layer signal -> copy start, p50/p99: the prefill sender's histogram (kvf-ringdump --json);
#   - last layer's signal (the host function's clock) -> the last block seen in decode's cache
#     (a cudaMemcpy poll of the driver), p50/p99;
#   - the sender's last layer -> done, p50/p99 (kvf-ringdump --json);
#   - beside FastDeploy's own messager's 1 ms poll of its layer signal, as the ratio
#     1000 us / kvferry's p50 (a figure from its code, not a measurement: it needs Paddle).
# Every request is verified byte for byte on decode. Exits 77 without a GPU or a CUDA build.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
N=${1:-200}
BLOCKS=${2:-8}
export KVFERRY_BUILD=${KVFERRY_BUILD:-$ROOT/build}
PY=${KVF_PYTHON:-/usr/bin/python3}
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "skipped: no GPU visible"; exit 77
fi
if [ ! -e "$KVFERRY_BUILD/gpu/libkvf_gpu.a" ]; then
  echo "skipped: $KVFERRY_BUILD is a build without CUDA"; exit 77
fi
"$PY" -c 'import msgpack' || { echo "msgpack is missing for $PY" >&2; exit 1; }
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1)"
echo "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
rc=0
for mode in per_query per_chunk; do
  echo "== $mode over ipc, GPU caches: $N requests x $BLOCKS blocks"
  KVF_PYTHON=$PY timeout 600 "$ROOT/tests/python_run.sh" "$ROOT/tests/fastdeploy_test.py" \
    --gpu --tp 1 --mode "$mode" --protocol ipc --bench "$N" --bench-blocks "$BLOCKS" || rc=1
done
exit $rc
