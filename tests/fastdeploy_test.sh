#!/usr/bin/env bash
# kvferry as FastDeploy's cache messager (python3 -m kvferry.fastdeploy), driven through
# FastDeploy's interfaces alone by an emulated deployment (tests/fastdeploy_emu): two TP ranks
# of prefill and of decode, both layer-signal modes, ipc and tcp, trace requests verified byte
# for byte, FastDeploy's statuses for failures, connect tasks, bad input, a killed role.
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
/usr/bin/python3 -c 'import msgpack' 2>/dev/null ||
  fail "python3-msgpack is missing (tools/kvferry setup installs it)"
[ -d /opt ] || { echo "skipped: FastDeploy's per_chunk queue key needs /opt"; exit 77; }
[ -e "$B/libkvferry_fastdeploy.so.0" ] || fail "$B/libkvferry_fastdeploy.so.0 is not built"
T=(timeout 150 /usr/bin/python3 "$ROOT/tests/fastdeploy_test.py")
"${T[@]}" --mode per_chunk --protocol ipc --requests 200 --faults --kill || fail "per_chunk over ipc"
"${T[@]}" --mode per_query --protocol tcp --requests 60 --faults --older || fail "per_query over tcp"
pass "fastdeploy: both signal modes, ipc and tcp, through FastDeploy's interfaces"
