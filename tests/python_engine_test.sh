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
# A sanitizer build's libkvferry needs its runtime loaded before the interpreter starts, and the
# interpreter's own allocations are not ours to judge (leaks off; everything else stays on).
PRE=()
for rt in asan ubsan tsan; do
  if ldd "$B/libkvferry.so.0" 2>/dev/null | grep -q "lib$rt\.so"; then
    PRE+=("$(ldd "$B/libkvferry.so.0" | awk -v r="lib$rt.so" 'index($1, r) == 1 {print $3}')")
  fi
done
ENV=(PYTHONPATH="$ROOT/python")
[ ${#PRE[@]} -eq 0 ] || ENV+=(LD_PRELOAD="${PRE[*]}" ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0")
env "${ENV[@]}" /usr/bin/python3 "$ROOT/tests/python_engine.py" $TAG-p $TAG-d || fail "python engine"
pass "python engine: the kvferry package moved and verified its requests"
