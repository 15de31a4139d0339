#!/usr/bin/env bash
# A real model's KV cache through kvferry, token-exact: examples/tiny_llama/run.py runs a small
# Llama-like decoder (PyTorch, CPU) in one process, then as a prefill engine and a decode engine
# on two host instances, over ipc and over tcp, and compares every request's tokens and the
# decode side's K/V with the single process's. Skipped (77) where Debian's python3 has no torch.
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  echo "skipped: /usr/bin/python3 cannot import torch (Debian: python3-torch; tools/kvferry setup installs it)"
  exit 77
fi
/usr/bin/python3 -c 'import msgpack, numpy' 2>/dev/null ||
  fail "python3-msgpack or python3-numpy is missing (tools/kvferry setup installs them)"
export PYTHONPATH="$ROOT/python"
RUN=("$ROOT/tests/python_run.sh" "$ROOT/examples/tiny_llama/run.py")
# The model's cache layout (layers, kv heads, head dim, dtype, block size), from the model.
read -r -a SHAPE <<<"$("${RUN[@]}" --instance-flags)"
# The caches: the allocator's (own), and the engines' own (kvferry.host_buffer +
# Client.register_caches, instances up with --caches engine) where the package has them.
# KVF_MODEL_CACHES="own engine" (or one of them) chooses.
MODES=${KVF_MODEL_CACHES:-}
if [ -z "$MODES" ]; then
  MODES=own
  if "${RUN[0]}" -c 'import kvferry, sys; sys.exit(not hasattr(kvferry, "host_buffer"))' 2>/dev/null; then
    MODES="own engine"
  fi
fi
for mode in $MODES; do
  UP_CACHES=()
  [ "$mode" = own ] || UP_CACHES=(--caches "$mode")
  up $TAG-$mode-d --role decode "${SHAPE[@]}" --blocks 512 "${UP_CACHES[@]}"
  up $TAG-$mode-p --role prefill "${SHAPE[@]}" --blocks 512 "${UP_CACHES[@]}"
  "${RUN[@]}" --prefill $TAG-$mode-p --decode $TAG-$mode-d --transports ipc,tcp --prompts 20 \
    --caches "$mode" || fail "the tiny Llama through kvferry, caches $mode"
  down $TAG-$mode-p; down $TAG-$mode-d
done
