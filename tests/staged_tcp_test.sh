#!/usr/bin/env bash
# Staged io over tcp, the path of GPU caches (common/cache_stage.c, docs/ARCHITECTURE.md section
# 7), run by the host-async test backend: every byte goes through staging buffers whose copies
# complete later on another thread (300 us out of the prefill cache; 20 ms into the decode
# cache, longer than the finish notice takes), so a send before its copy out of the cache, or a
# run marked landed before its copy into the cache, moves or publishes bytes that are not there
# yet, and the verification fails (tried: 20 of 20 requests corrupt without the send's wait, 4
# to 8 of 20 without the mark's). Loopback tcp, no root needed; CI also runs it under
# ThreadSanitizer (the connector's data threads, their stagers and the copy workers).
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
L="--model llama-3.1-8b --tp 8 --cache-mib 256"
KVFERRY_ASYNC_DELAY_US=20000 up $TAG-sd --role decode $L --backend host-async
KVFERRY_ASYNC_DELAY_US=300 up $TAG-sp --role prefill $L --backend host-async
for mode in contiguous scatter; do
  opt=(); [ $mode = scatter ] && opt=(--scatter)
  "$B/kvf-sim" --quiet --json "$KVFERRY_RUN_DIR/$mode.json" --prefill $TAG-sp --decode $TAG-sd --transport tcp \
    --requests 20 --layer-us 50 --timeout-s 120 "${opt[@]}" >"$KVFERRY_RUN_DIR/$mode.txt" 2>&1 ||
    { cat "$KVFERRY_RUN_DIR/$mode.txt"; fail "staged io, $mode blocks"; }
  [ "$(json_get "$KVFERRY_RUN_DIR/$mode.json" finished)" = 20 ] || fail "staged io, $mode blocks: not all 20 finished"
done
[ "$(counter $TAG-sp bytes_moved_ipc)" = 0 ] && [ "$(counter $TAG-sp bytes_sent_tcp)" -gt 0 ] ||
  fail "staged io: the bytes did not all go by tcp"
pass "staged io (copies completed later, as a GPU's): 40 requests over tcp, contiguous and scattered, verified"
# No role died, and (a sanitizer build) no report, also at exit: stop both first.
down $TAG-sp; down $TAG-sd
died=$(grep -h "exited with status" "$KVFERRY_RUN_DIR"/*/supervisor.log || true)
[ -z "$died" ] || fail "roles died: $died"
if grep -l -E "AddressSanitizer|LeakSanitizer|ThreadSanitizer|runtime error:" "$KVFERRY_RUN_DIR"/*/*.log; then
  grep -h -A20 -E "AddressSanitizer|LeakSanitizer|ThreadSanitizer|runtime error:" "$KVFERRY_RUN_DIR"/*/*.log | head -80
  fail "sanitizer reports in the roles' logs"
fi
pass "no role died, no sanitizer report in the roles' logs"
echo "staged_tcp_test: all passed"
