#!/usr/bin/env bash
# The engine's own caches (up --caches engine), registered through the Python package:
# tests/register_engine.py against two instances of the engine's caches and one of its own.
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
/usr/bin/python3 -c 'import msgpack, numpy' 2>/dev/null ||
  fail "python3-msgpack or python3-numpy is missing (tools/kvferry setup installs them)"
L="--layers 4 --kv-heads 2 --head-dim 64 --block-size 16 --dtype fp16 --blocks 32"
up $TAG-rd --role decode --caches engine $L
up $TAG-rp --role prefill --caches engine $L
up $TAG-ro --role mixed $L
KVF_RINGDUMP="$KVFERRY_BUILD/kvf-ringdump" PYTHONPATH="$ROOT/python" "$ROOT/tests/python_run.sh" \
  "$ROOT/tests/register_engine.py" $TAG-rp $TAG-rd $TAG-ro || fail "register engine"
pass "engine caches: registered, refused, moved and verified, dropped when the engine died"
