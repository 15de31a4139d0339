#!/usr/bin/env bash
# own_run_dir.sh PROGRAM [ARGS...]: run a test program that starts instances with tools/kvferry
# (the C tests; the shell tests have tests/lib.sh) with a run directory of its own, removed
# when it passes and kept, with its path said, when it fails; nothing goes to /tmp/kvferry-$UID.
set -uo pipefail
KVFERRY_RUN_DIR=$(mktemp -d /tmp/kvferry-test.XXXXXX) || exit 1
export KVFERRY_RUN_DIR
export KVFERRY_TOKEN_FILE=${KVFERRY_TOKEN_FILE:-$KVFERRY_RUN_DIR/token}
# the senders' spin seats (--layer-wait auto) of this test's own (common/cpus.h)
export KVFERRY_SPIN_SEATS=${KVFERRY_SPIN_SEATS:-$KVFERRY_RUN_DIR/spin-seat}
# The C tests read and write caches with the CPU: host memory, also where a GPU is visible.
export KVFERRY_BACKEND=host
"$@"
rc=$?
if [ $rc -eq 0 ] || [ $rc -eq 77 ]; then
  rm -rf "$KVFERRY_RUN_DIR"
else
  echo "logs kept in $KVFERRY_RUN_DIR" >&2
fi
exit $rc
