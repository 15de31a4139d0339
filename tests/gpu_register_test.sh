#!/usr/bin/env bash
# gpu_register_test.sh [OUTDIR]: the engine's caches in GPU memory, registered from PyTorch
# (tests/gpu_register_engine.py) with two instances of `--caches engine --backend cuda` on one
# GPU: per-layer K/V tensors (prefill; PyTorch's caching allocator packs several into one
# segment, registered once) and stacked [2, blocks, ...] tensors (decode); transfers over ipc
# and tcp with every byte compared on the GPU; the prefill engine SIGKILLed mid-transfer, its
# GPU memory back (cudaMemGetInfo) once the roles closed their IPC opens, and a new engine
# registering and moving bytes again; expandable segments refused at registration with the
# cause and the fix. OUTDIR (default: the run directory) gets gpu_register_test.json.
# Exit 77 (skipped) with no GPU visible or no torch in $KVF_PYTHON (default python3).
HERE=$(cd "$(dirname "$0")" && pwd)
B0=${KVFERRY_BUILD:-$HERE/../build}
NGPU=$("$B0/kvf-ctl" gpus 2>/dev/null || echo 0)
if ! [ "${NGPU:-0}" -ge 1 ] 2>/dev/null; then
  echo "gpu_register_test: skipped: no GPU visible ($("$B0/kvf-ctl" gpus 2>&1 >/dev/null | head -n1))"
  exit 77
fi
PY=${KVF_PYTHON:-python3}
if ! "$PY" -c 'import torch, msgpack; assert torch.cuda.is_available()' 2>/dev/null; then
  echo "gpu_register_test: skipped: $PY has no torch with CUDA, or no msgpack"
  exit 77
fi
source "$HERE/lib.sh"
cd "$ROOT"
OUT=${1:-$KVFERRY_RUN_DIR}
mkdir -p "$OUT"
L="--layers 8 --kv-heads 2 --head-dim 64 --block-size 16 --dtype fp16 --blocks 2048"
up $TAG-gd --role decode --caches engine --backend cuda $L
up $TAG-gp --role prefill --caches engine --backend cuda $L
KVFERRY_DMABUF=always KVF_RDMA_REG_TEST="$KVFERRY_BUILD/tests/rdma_reg_test" KVF_PYTHON=$PY PYTHONPATH="$ROOT/python" "$ROOT/tests/python_run.sh" \
  "$ROOT/tests/gpu_register_engine.py" test $TAG-gp $TAG-gd "$OUT" || fail "gpu register engine"
pass "GPU engine caches: registered from PyTorch, moved over ipc and tcp, verified on the GPU, freed when the engine died"
down $TAG-gp; down $TAG-gd
# The engine executor on registered caches: the copies run in the prefill engine's context.
up $TAG-xd --role decode --caches engine --backend cuda $L
up $TAG-xp --role prefill --caches engine --backend cuda --executor engine $L
KVF_RINGDUMP="$KVFERRY_BUILD/kvf-ringdump" KVF_PYTHON=$PY PYTHONPATH="$ROOT/python" "$ROOT/tests/python_run.sh" \
  "$ROOT/tests/gpu_register_engine.py" exec $TAG-xp $TAG-xd || fail "gpu register engine: the engine executor"
pass "GPU engine caches with the engine executor: copies in the engine's context, verified on the GPU, a decode re-registration followed"
