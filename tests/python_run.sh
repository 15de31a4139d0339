#!/usr/bin/env bash
# python_run.sh SCRIPT [ARGS...]: python3 ($KVF_PYTHON, default Debian's) on SCRIPT against
# $KVFERRY_BUILD's libkvferry. A sanitizer build's libkvferry needs its runtime loaded before the
# interpreter starts, in it and in every process it starts (exported), and the interpreter's own
# allocations are not ours to judge (leaks off; everything else stays on).
set -euo pipefail
lib=${KVFERRY_BUILD:?KVFERRY_BUILD names the build}/libkvferry.so.0
PRE=()
for rt in asan ubsan tsan; do
  so=$(ldd "$lib" 2>/dev/null | awk -v r="lib$rt.so" 'index($1, r) == 1 {print $3}')
  [ -z "$so" ] || PRE+=("$so")
done
if [ ${#PRE[@]} -gt 0 ]; then
  export LD_PRELOAD="${PRE[*]}" ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
fi
exec "${KVF_PYTHON:-/usr/bin/python3}" "$@"
