#!/usr/bin/env bash
# The demo (and kvf-sim under it) between tensor-parallel groups of different sizes and block
# sizes, with real instances started by the supervisor (host caches unless KVFERRY_TEST_BACKEND
# says cuda; tests/gpu_tp_test.sh runs the ratios on GPU caches with both executors):
# --prefill-tp/--decode-tp start one instance per rank, each prefill rank sends each decode rank
# its heads, and kvf-sim checks every head of every token on every decode rank. The verified byte count must be exactly the prompts'
# tokens x the model's heads x layers x tensors x one head's row, and the usage errors say why.
source "$(dirname "$0")/lib.sh"
cd "$ROOT"

TRACE=$ROOT/data/mooncake-conversation-2000.jsonl
MAXTOK=700

# Bytes of one token on all decode ranks together: llama-3.1-8b, its 8 kv heads split over the
# ranks: 8 heads x 32 layers x 2 tensors x 128 dims x 2 bytes; deepseek-v3-mla on 4 decode ranks,
# each holding the latent: 4 x 61 layers x 1 tensor x 576 dims x 2 bytes.
LLAMA=$((8 * 32 * 2 * 128 * 2)) MLA4=$((4 * 61 * 576 * 2))

# want_bytes N [BLOCK [PER_TOKEN]]: every head's row of every token of the first N prompts
# (clipped to MAXTOK; with BLOCK > 1, rounded up to whole blocks of BLOCK tokens), PER_TOKEN
# bytes each (default llama-3.1-8b's).
want_bytes() {
  /usr/bin/python3 - "$TRACE" "$1" "$MAXTOK" "${2:-1}" "${3:-$LLAMA}" <<'PY'
import json, sys
path, n, cap, b, per = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
toks = []
for line in open(path):
    if len(toks) == n:
        break
    v = json.loads(line).get("input_length", 0)
    if v:
        toks.append((min(v, cap) + b - 1) // b * b)
print(sum(toks) * per)
PY
}

# demo WHAT N JSON PER_TOKEN MIB [demo options]: the demo moves N requests; every one finished,
# none corrupt, exactly the bytes of every head of every token verified.
demo() {
  local what=$1 n=$2 json=$KVFERRY_RUN_DIR/$3.json txt=$KVFERRY_RUN_DIR/$3.txt per=$4 mib=$5; shift 5
  "$ROOT/tools/kvferry" demo --requests "$n" --cache-mib "$mib" --layer-us 100 --quiet \
    --prefix-pct 0 --max-tokens $MAXTOK --json "$json" "$@" >"$txt" 2>&1 ||
    { cat "$txt" >&2; fail "$what: the demo failed"; }
  grep -q "every head of every token checked on every decode rank" "$txt" ||
    { cat "$txt" >&2; fail "$what: the summary has no tp line"; }
  [ "$(json_get "$json" ok)" = True ] || fail "$what: not ok"
  [ "$(json_get "$json" finished)" = "$n" ] || fail "$what: $(json_get "$json" finished) of $n finished"
  [ "$(json_get "$json" corrupt)" = 0 ] || fail "$what: corrupt requests"
  local want got
  want=$(want_bytes "$n" 1 "$per") got=$(json_get "$json" verified_bytes)
  [ "$got" = "$want" ] || fail "$what: $got bytes verified, not $want (every head of every token)"
  echo "$json"
}

# 2 -> 4 over ipc: 4 heads per prefill rank, 2 per decode rank, one source each.
j=$(demo "tp 2 -> 4 (ipc)" 24 a $LLAMA 256 --prefill-tp 2 --decode-tp 4)
[ "$(json_get "$j" prefill_tp)" = 2 ] && [ "$(json_get "$j" decode_tp)" = 4 ] || fail "tp 2 -> 4: the JSON's groups"
[ "$(json_get "$j" tasks_per_request)" = 4 ] || fail "tp 2 -> 4: $(json_get "$j" tasks_per_request) tasks per request, not 4"
# over ipc the completions count each byte copied once: every head of the requests' whole blocks
[ "$(json_get "$j" bytes)" = "$(want_bytes 24 64)" ] || fail "tp 2 -> 4: $(json_get "$j" bytes) bytes moved, not $(want_bytes 24 64)"
pass "tp 2 -> 4 over ipc: 24 requests, $(json_get "$j" verified_bytes) bytes verified"

# 4 -> 2 over tcp, chunked prefill: each decode rank gathers its heads from two prefill ranks.
# --verify sample: both ends of each piece's first and last rows (the bytes they cover count).
j=$(demo "tp 4 -> 2 (tcp, chunked)" 16 b $LLAMA 256 --prefill-tp 4 --decode-tp 2 --transport tcp --chunk-tokens 256 --verify sample)
[ "$(json_get "$j" tasks_per_request)" = 4 ] || fail "tp 4 -> 2: $(json_get "$j" tasks_per_request) tasks per request, not 4"
pass "tp 4 -> 2 over tcp, chunked: 16 requests, $(json_get "$j" verified_bytes) bytes verified"

# 1 -> 2 with 16 tokens per prefill block and 64 per decode block: tokens regrouped.
j=$(demo "tp 1 -> 2, 16 -> 64 tokens/block" 24 c $LLAMA 256 --prefill-tp 1 --decode-tp 2 \
  --prefill-block-tokens 16 --decode-block-tokens 64)
[ "$(json_get "$j" prefill_block_tokens)" = 16 ] && [ "$(json_get "$j" decode_block_tokens)" = 64 ] ||
  fail "16 -> 64: the JSON's block sizes"
pass "tp 1 -> 2, 16 -> 64 tokens/block over ipc: $(json_get "$j" verified_bytes) bytes verified"

# The same regrouping over tcp: 4 -> 4 at 32 -> 16 tokens per block (chunked prefill), and 1 -> 2
# at 16 -> 64 on host-async caches (frames through staging memory): every byte verified.
j=$(demo "tp 4 -> 4, 32 -> 16 tokens/block (tcp, chunked)" 16 c2 $LLAMA 256 --prefill-tp 4 --decode-tp 4 \
  --prefill-block-tokens 32 --decode-block-tokens 16 --transport tcp --chunk-tokens 256)
pass "tp 4 -> 4, 32 -> 16 tokens/block over tcp, chunked: $(json_get "$j" verified_bytes) bytes verified"
j=$(demo "tp 1 -> 2, 16 -> 64 tokens/block (tcp, staged)" 16 c3 $LLAMA 256 --prefill-tp 1 --decode-tp 2 \
  --prefill-block-tokens 16 --decode-block-tokens 64 --transport tcp --backend host-async)
pass "tp 1 -> 2, 16 -> 64 tokens/block over tcp, host-async: $(json_get "$j" verified_bytes) bytes verified"

# MLA 2 -> 4: the latent is on every rank; decode rank j receives it from prefill rank j mod 2.
j=$(demo "deepseek-v3-mla tp 2 -> 4" 12 d $MLA4 512 --model deepseek-v3-mla --prefill-tp 2 --decode-tp 4)
[ "$(json_get "$j" tasks_per_request)" = 4 ] || fail "MLA 2 -> 4: $(json_get "$j" tasks_per_request) tasks per request, not 4"
pass "deepseek-v3-mla tp 2 -> 4 over ipc: $(json_get "$j" verified_bytes) bytes verified"

# Cancels mid-step, 2 -> 4: each of a request's four tasks is cancelled; the request ends once,
# cancelled (every pair's completion and arrival in) or finished and verified, never corrupt.
j=$KVFERRY_RUN_DIR/e.json
"$ROOT/tools/kvferry" demo --requests 30 --cache-mib 256 --layer-us 100 --quiet --prefix-pct 0 \
  --max-tokens $MAXTOK --cancel-pct 40 --json "$j" --prefill-tp 2 --decode-tp 4 >"$KVFERRY_RUN_DIR/e.txt" 2>&1 ||
  { cat "$KVFERRY_RUN_DIR/e.txt" >&2; fail "cancels: the demo failed"; }
f=$(json_get "$j" finished) c=$(json_get "$j" cancelled)
[ $((f + c)) = 30 ] || fail "cancels: $f finished + $c cancelled != 30"
[ "$(json_get "$j" unaccounted)" = 0 ] && [ "$(json_get "$j" corrupt)" = 0 ] &&
  [ "$(json_get "$j" unexpected_failures)" = 0 ] && [ "$(json_get "$j" finished_but_failed_pairs)" = 0 ] ||
  fail "cancels: unaccounted, corrupt, unexpected failures or disagreeing sides"
[ "$c" -ge 1 ] && [ "$c" -le "$(json_get "$j" cancels_sent)" ] || fail "cancels: $c cancelled of $(json_get "$j" cancels_sent) cancels sent"
pass "cancels, tp 2 -> 4: $f finished and verified, $c cancelled"

# Usage errors: refused before anything starts, with their reason, status 2.
usage_case() {
  local what=$1 needle=$2 out rc=0; shift 2
  out=$("$@" 2>&1) || rc=$?
  [ $rc = 2 ] || { echo "$out" >&2; fail "$what: status $rc, not 2"; }
  grep -qF -- "$needle" <<<"$out" || { echo "$out" >&2; fail "$what: no \"$needle\" in its message"; }
  pass "$what: $(grep -F -- "$needle" <<<"$out" | head -n1)"
}
usage_case "--tp with --prefill-tp" "with --prefill-tp/--decode-tp leave it out" \
  tools/kvferry demo --tp 8 --prefill-tp 2
usage_case "--decode-tp 3" "--decode-tp 3 does not fit llama-3.1-8b's 8 kv heads" \
  tools/kvferry demo --prefill-tp 2 --decode-tp 3
usage_case "block sizes 64 and 48" "one must divide the other" \
  tools/kvferry demo --prefill-tp 2 --decode-block-tokens 48
usage_case "block sizes 64 and 48 over rdma" "one must divide the other" \
  tools/kvferry demo --prefill-tp 2 --decode-block-tokens 48 --transport rdma
usage_case "block sizes 64 and 48 over tcp" "one must divide the other" \
  tools/kvferry demo --prefill-tp 2 --decode-block-tokens 48 --transport tcp
usage_case "--executor engine on host caches" "--backend host puts the caches in host memory" \
  tools/kvferry demo --prefill-tp 2 --decode-tp 4 --backend host --executor engine
usage_case "--executor bogus" "--executor is auto, sender or engine, not 'bogus'" \
  tools/kvferry demo --prefill-tp 2 --decode-tp 4 --executor bogus
usage_case "kvf-sim --prefill-tp 2, one name" "give 2 names separated by commas" \
  "$B/kvf-sim" --prefill a --decode b,c --prefill-tp 2 --check-options
echo "sim_tp_test: ok"
