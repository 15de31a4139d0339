#!/usr/bin/env bash
# The Python package (python/kvferry) as an engine on both sides: tests/python_engine.py against
# a decode and a prefill instance on host memory. Real processes, real rings, real copies.
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
/usr/bin/python3 -c 'import msgpack, numpy' 2>/dev/null ||
  fail "python3-msgpack or python3-numpy is missing (tools/kvferry setup installs them)"
L="--model llama-3.1-8b --tp 8 --cache-mib 64"
up $TAG-d --role decode $L
up $TAG-p --role prefill $L
PYTHONPATH="$ROOT/python" "$ROOT/tests/python_run.sh" "$ROOT/tests/python_engine.py" $TAG-p $TAG-d || fail "python engine"
pass "python engine: the kvferry package moved and verified its requests"
