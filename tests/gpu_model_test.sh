#!/usr/bin/env bash
# Hugging Face transformers models (Llama with GQA, Qwen2, DeepSeek-V3 with MLA; small configs,
# seeded random weights, bf16) through kvferry on GPU caches, token-exact against
# model.generate in one process: examples/hf/run.py for each model over ipc and over tcp.
# Skipped (77) without a GPU, or where python3 lacks torch or transformers. Python: $KVF_PYTHON
# (default python3 on PATH, as the GPU tests use).
HERE=$(cd "$(dirname "$0")" && pwd)
B0=${KVFERRY_BUILD:-$HERE/../build}
NGPU=$("$B0/kvf-ctl" gpus 2>/dev/null || echo 0)
if ! [ "${NGPU:-0}" -ge 1 ] 2>/dev/null; then
  echo "gpu_model_test: skipped: no GPU visible ($("$B0/kvf-ctl" gpus 2>&1 >/dev/null | head -n1))"
  exit 77
fi
PY=${KVF_PYTHON:-python3}
if ! "$PY" -c 'import torch, transformers, msgpack' 2>/dev/null; then
  echo "gpu_model_test: skipped: $PY cannot import torch, transformers and msgpack"
  exit 77
fi
source "$HERE/lib.sh"
cd "$ROOT"
export KVFERRY_BACKEND=cuda PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
FAILED=()
for model in ${KVF_HF_MODELS:-llama qwen2 deepseek-v3}; do
  read -r -a SHAPE <<<"$("$PY" examples/hf/run.py --model "$model" --instance-flags)"
  # KVF_HF_UP_ARGS: more `up` options for both instances (e.g. --executor sender).
  # KVF_HF_CACHES=engine: the engines allocate their caches with PyTorch and register them.
  # KVF_HF_TRANSPORTS: the transports to run (default "ipc tcp").
  # shellcheck disable=SC2086
  up $TAG-$model-d --role decode --backend cuda "${SHAPE[@]}" --blocks 512 --caches ${KVF_HF_CACHES:-own} ${KVF_HF_UP_ARGS:-}
  # shellcheck disable=SC2086
  up $TAG-$model-p --role prefill --backend cuda "${SHAPE[@]}" --blocks 512 --caches ${KVF_HF_CACHES:-own} ${KVF_HF_UP_ARGS:-}
  for tr in ${KVF_HF_TRANSPORTS:-ipc tcp}; do
    out=$KVFERRY_RUN_DIR/hf-$model-$tr.txt
    "$PY" examples/hf/run.py --model "$model" --transport $tr --prompts "${KVF_HF_PROMPTS:-20}" --caches "${KVF_HF_CACHES:-own}" \
      --prefill $TAG-$model-p --decode $TAG-$model-d >"$out" 2>&1 ||
      { grep '^FAIL' "$out" >&2; echo "FAIL: $model over $tr" >&2; FAILED+=("$model/$tr"); continue; }
    claims=""
    if [ $tr = ipc ] && [[ " ${KVF_HF_UP_ARGS:-} " == *" --executor engine "* ]]; then
      # The copies must have run in the prefill engine's context (its claims), not the sender's.
      claims=$("$B0/kvf-ringdump" --instance $TAG-$model-p --json | tr ',{}' '\n\n\n' |
        sed -n 's/^ *"layers_claimed": *\([0-9]*\).*/\1/p' | head -n1)
      [ "${claims:-0}" -gt 0 ] ||
        { echo "FAIL: $model over ipc: the engine executor claimed no layer" >&2; FAILED+=("$model/exec"); continue; }
      claims="; the engine executor claimed $claims layers"
    fi
    pass "$(grep '^ok:' "$out" | sed 's/^ok: //')$claims"
  done
  down $TAG-$model-p; down $TAG-$model-d
done
[ ${#FAILED[@]} = 0 ] || fail "gpu model test: not token-exact: ${FAILED[*]}"
pass "gpu model test: every model, every transport run (${KVF_HF_TRANSPORTS:-ipc tcp}), token-exact"
