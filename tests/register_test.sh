#!/usr/bin/env bash
# The engine's own caches (up --caches engine), registered through the Python package:
# tests/register_engine.py against two instances of the engine's caches and one of its own.
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
/usr/bin/python3 -c 'import msgpack, numpy' 2>/dev/null ||
  fail "python3-msgpack or python3-numpy is missing (tools/kvferry setup installs them)"
L="--layers 4 --kv-heads 2 --head-dim 64 --block-size 16 --dtype fp16 --blocks 32"
# Refused before anything starts, with what to give instead.
out=$("$ROOT/tools/kvferry" up --instance $TAG-bad --role decode --caches everything $L 2>&1) &&
  fail "--caches everything was taken"
grep -q "caches is own .* or engine" <<<"$out" || fail "--caches everything: $out"
out=$("$ROOT/tools/kvferry" up --instance $TAG-bad --role decode --backend host-async --caches engine $L 2>&1) &&
  fail "--caches engine --backend host-async was taken"
grep -q "caches engine takes the engine's host memory .* or GPU memory" <<<"$out" ||
  fail "--caches engine --backend host-async: $out"
out=$("$ROOT/tools/kvferry" up --instance $TAG-bad --role decode --backend host --caches engine --executor engine $L 2>&1) &&
  fail "--caches engine --executor engine was taken for host caches"
grep -q "executor engine runs copies in the engine's GPU context: with --caches engine give --backend cuda" <<<"$out" ||
  fail "--caches engine --backend host --executor engine: $out"
if [ "$("$KVFERRY_BUILD/kvf-ctl" gpus 2>/dev/null || echo 0)" = 0 ]; then
  # GPU engine caches where no GPU is visible: refused when the instance starts, with why
  out=$("$ROOT/tools/kvferry" up --instance $TAG-bad --role decode --backend cuda --caches engine $L 2>&1) &&
    fail "--caches engine --backend cuda was taken without a GPU"
  # (a build without CUDA has no cuda backend at all, and says so)
  grep -qE "caches engine --backend cuda: no GPU visible|no cache backend 'cuda' \(this build has" <<<"$out" ||
    fail "--caches engine --backend cuda without a GPU: $out"
fi
up $TAG-rd --role decode --caches engine $L
up $TAG-rp --role prefill --caches engine $L
up $TAG-ro --role mixed $L
KVF_RINGDUMP="$KVFERRY_BUILD/kvf-ringdump" PYTHONPATH="$ROOT/python" "$ROOT/tests/python_run.sh" \
  "$ROOT/tests/register_engine.py" $TAG-rp $TAG-rd $TAG-ro || fail "register engine"
pass "engine caches: registered, refused, moved and verified, dropped when the engine died"
# Key-only caches (MLA's latent: one tensor a layer), registered on both sides, over ipc and tcp.
up $TAG-kd --role decode --caches engine $L --key-only
up $TAG-kp --role prefill --caches engine $L --key-only
PYTHONPATH="$ROOT/python" "$ROOT/tests/python_run.sh" "$ROOT/tests/register_engine.py" --key-only $TAG-kp $TAG-kd ||
  fail "key-only engine caches"
pass "key-only engine caches: registered, moved over ipc and tcp, verified"
# Token-major blocks between another split: refused by the data connection's handshake.
T="--layers 4 --head-dim 64 --block-size 16 --dtype fp16 --blocks 32"
up $TAG-td --role decode --caches engine $T --kv-heads 2 --rank 0 --nranks 2
up $TAG-tp --role prefill --caches engine $T --kv-heads 4
PYTHONPATH="$ROOT/python" "$ROOT/tests/python_run.sh" "$ROOT/tests/register_engine.py" --token-split $TAG-tp $TAG-td ||
  fail "token-major blocks to another split"
pass "token-major blocks to another tensor-parallel split: refused, naming it"
