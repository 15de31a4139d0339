#!/usr/bin/env bash
# gpu_register_bench.sh OUTDIR: the engine's caches in GPU memory, on one GPU, 64 layers x K/V
# (block 4 KiB, 4096 blocks: 16 MiB a tensor, so PyTorch gives each its own cudaMalloc segment):
#   - registration time (median of 5): all 128 tensors in one allocation; 128 tensors of their
#     own; and the reference, 128 registration calls (one per tensor, each of one allocation);
#     ratio reference / 128 tensors in one call; the same for 200 separate buffers (an instance
#     of 100 layers x K/V, each tensor its own segment) against 200 registration calls;
#   - transfer throughput (ipc, every block of every layer, best of 10) between two instances
#     of registered caches (--caches engine --backend cuda) and between two of the allocator's
#     own (--backend cuda --executor sender: copies in the sender's context, as for registered caches) of the same layout, in the same run; ratio registered / own.
# Writes OUTDIR/gpu_register_bench.json and prints it. Exit 0 done, 1 failed, 77 no GPU/torch.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: bench/gpu_register_bench.sh OUTDIR" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
B=${KVFERRY_BUILD:-$ROOT/build} K=$ROOT/tools/kvferry PY=${KVF_PYTHON:-python3}
n=$("$B/kvf-ctl" gpus 2>/dev/null || echo 0)
[ "${n:-0}" -ge 1 ] 2>/dev/null || { echo "gpu_register_bench: no GPU visible"; exit 77; }
"$PY" -c 'import torch, msgpack; assert torch.cuda.is_available()' 2>/dev/null ||
  { echo "gpu_register_bench: $PY has no torch with CUDA, or no msgpack"; exit 77; }
export KVFERRY_RUN_DIR=$OUT/run KVFERRY_TOKEN_FILE=$OUT/run/token KVFERRY_BUILD=$B
mkdir -p "$KVFERRY_RUN_DIR" && chmod 700 "$KVFERRY_RUN_DIR"
T=gb$$
L=(--layers 64 --kv-heads 2 --head-dim 64 --block-size 16 --dtype fp16 --blocks 4096)
cleanup() { for i in $T-rp $T-rd $T-op $T-od $T-h; do "$K" down --instance $i >/dev/null 2>&1; done; }
trap cleanup EXIT
"$K" up --instance $T-rd --role decode --caches engine --backend cuda "${L[@]}" >/dev/null &&
  "$K" up --instance $T-rp --role prefill --caches engine --backend cuda "${L[@]}" >/dev/null &&
  "$K" up --instance $T-od --role decode --backend cuda --executor sender "${L[@]}" >/dev/null &&
  "$K" up --instance $T-op --role prefill --backend cuda --executor sender "${L[@]}" >/dev/null &&
  "$K" up --instance $T-h --role prefill --caches engine --backend cuda --layers 100 --kv-heads 2 --head-dim 64 \
    --block-size 16 --dtype fp16 --blocks 4096 >/dev/null || { echo "up failed"; exit 1; }
echo "command: bench/gpu_register_bench.sh $1"
lscpu | grep 'Model name' || true
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n1
KVF_PYTHON=$PY PYTHONPATH="$ROOT/python" "$ROOT/tests/python_run.sh" \
  "$ROOT/tests/gpu_register_engine.py" bench $T-rp $T-rd $T-op $T-od "$OUT" $T-h
