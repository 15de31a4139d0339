#!/usr/bin/env bash
# kvferry as FastDeploy's cache messager (python3 -m kvferry.fastdeploy), driven through
# FastDeploy's interfaces alone by an emulated deployment (tests/fastdeploy_emu): two TP ranks
# of prefill and of decode, both layer-signal modes, ipc and tcp, trace requests verified byte
# for byte (block_wise_fp8's scale tensors too), FastDeploy's statuses for failures, connect
# tasks, bad input, a killed role.
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
# Debian's python3 (tools/kvferry setup installs its msgpack); KVF_PYTHON names another.
PY=${KVF_PYTHON:-/usr/bin/python3}
"$PY" -c 'import msgpack' 2>/dev/null ||
  fail "msgpack is missing for $PY (tools/kvferry setup installs python3-msgpack; KVF_PYTHON names another python3)"
[ -d /opt ] || { echo "skipped: FastDeploy's per_chunk queue key needs /opt"; exit 77; }
[ -e "$B/libkvferry_fastdeploy.so.0" ] || fail "$B/libkvferry_fastdeploy.so.0 is not built"
# tests/python_run.sh: $PY, with a sanitizer build's runtime preloaded for it and the messagers
# it starts.
T=(timeout 150 "$ROOT/tests/python_run.sh" "$ROOT/tests/fastdeploy_test.py")
"${T[@]}" --mode per_chunk --protocol ipc --requests 200 --faults --kill || fail "per_chunk over ipc"
"${T[@]}" --mode per_query --protocol tcp --requests 60 --faults --older || fail "per_query over tcp"
# block_wise_fp8: uint8 caches with a scale tensor beside each K and V, moved with their blocks
"${T[@]}" --scales --mode per_query --protocol ipc --requests 40 || fail "scale tensors over ipc"
"${T[@]}" --scales --mode per_chunk --protocol tcp --requests 40 --older || fail "scale tensors over tcp"
# GPU caches in FastDeploy's own format (one allocation per tensor, cudaIpcMemHandle records),
# where a GPU is visible and the build has CUDA: one rank, decode on the same GPU as prefill
# (FD_IPC_APPEND_SUFFIX) unless KVF_TEST_GPUS says there are two.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 &&
  [ -e "$B/gpu/libkvf_gpu.a" ]; then
  "${T[@]}" --gpu --tp 1 --mode per_chunk --protocol ipc --requests 40 --faults || fail "GPU, ipc"
  "${T[@]}" --gpu --tp 1 --mode per_query --protocol tcp --requests 20 || fail "GPU, tcp"
  "${T[@]}" --gpu --tp 1 --scales --mode per_chunk --protocol ipc --requests 20 || fail "GPU, scale tensors, ipc"
  "${T[@]}" --gpu --tp 1 --scales --mode per_query --protocol tcp --requests 20 || fail "GPU, scale tensors, tcp"
else
  echo "GPU part skipped: no GPU visible, or a build without CUDA"
fi
pass "fastdeploy: both signal modes, ipc and tcp, through FastDeploy's interfaces"
