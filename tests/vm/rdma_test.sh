#!/usr/bin/env bash
# The rdma transport for real: whole instances (tools/kvferry up: allocator, connector, sender
# under the supervisor) in the soft-RoCE VM of tests/vm/run.sh, the decode instance on
# 10.77.0.2 (rxe1), the prefill instance on 10.77.0.1 (rxe0), so every RDMA WRITE crosses the
# veth pair. Run by the rdma_vm_test ctest (tests/CMakeLists.txt), which brings this tree's
# tools/, tests/, data/ and binaries into the VM.
#
#   0. the registration of caches (rdma_reg_test): host memory, device memory through a dma-buf
#      or as peer memory, neither (refused with both reasons)
#   1. kvf-sim end to end over rdma, every byte verified, blocks in runs; caches with scale tensors
#   2. the work requests: one RDMA WRITE per run of blocks contiguous on both sides, per
#      (layer, tensor), and one done message per request (the connector's counters); a request
#      to the peer named by its address
#   3. thousands of small scattered blocks through a send queue 16 deep: no overflow
#   4. a peer with another token, a peer with another layout: refused, every request fails so
#   5. the peer's region deregistered: a completion error, the request ends "write error" on
#      both sides; the next one finishes over a new connection
#   6. the decode connector killed mid-transfer (its supervisor held): "connection error"; it
#      comes back, a new request finishes
#   7. another tensor-parallel split (GQA 1 -> 2 and 2 -> 4 ranks, MLA 2 -> 4; MLA 1 -> 2 with
#      --bench) against equal groups: every head verified, the work requests exactly what the
#      head slices imply; a prefill rank that sends a decode rank none of its heads: refused;
#      tokens regrouped from 32-token prefill blocks into 16-token decode blocks (GQA 1 -> 2,
#      MLA 2 -> 4): one work request per piece, the bytes exactly the pieces
#   8. the engine's own caches (--caches engine), registered host memory on both sides, one of
#      them blocks-first: verified, the work requests counted; registered anew on either side
#      mid-run; the decode side's registration gone: refused for now, then finished again
#   --part transport runs 0 to 6 and 8, --part mixed runs 7 (the ctest runs them as two commands of
#      one VM, each within its own time limit); neither: all.
#   --bench: also the work requests per request for the models of data/model-shapes.json, ours
#      against one per block, and the throughput (EMULATED: qemu TCG + soft-RoCE)
source "$(dirname "$0")/../lib.sh"
cd "$ROOT"
[ -n "${KVF_VM:-}" ] || { echo "SKIP: rdma_test.sh runs inside tests/vm/run.sh"; exit 77; }
BENCH=0 PART=all # --part transport: cases 0 to 6; --part mixed: case 7 (each its own VM command)
while [ $# -gt 0 ]; do
  case "$1" in
    --bench) BENCH=1; shift ;;
    --part) PART=$2; shift 2 ;;
    *) fail "rdma_test.sh: unknown argument $1" ;;
  esac
done

# No python in the VM: the flat keys of the simulator's summary and of ring-dump's counters.
json_get() { sed -n "s/.*\"$2\":\([^,}]*\).*/\1/p" "$1" | head -n 1; }
counter() {
  "$B/kvf-ringdump" --instance "$1" --json | tr ',{}' '\n\n\n' | sed -n "s/^ *\"$2\": *\([0-9]*\).*/\1/p" | head -n 1
}
sim() { # sim NAME ARGS...: kvf-sim with a JSON summary in $KVFERRY_RUN_DIR/NAME.json
  local name=$1; shift
  "$B/kvf-sim" --quiet --trace "$ROOT/data/mooncake-conversation-2000.jsonl" --json "$KVFERRY_RUN_DIR/$name.json" \
    "$@" >"$KVFERRY_RUN_DIR/$name.txt" 2>&1
}
sup_pid() { cat "$KVFERRY_RUN_DIR/$1/supervisor.pid"; }

A=${KVF_VM_CLIENT_IP:?} DIP=${KVF_VM_SERVER_IP:?}
if [ $PART != mixed ]; then
# Peer timeout: also how long an rdma connection may go without a completion. Emulated RDMA on a
# busy host resends for seconds (soft-RoCE's counters below), so 2 s dropped healthy connections.
PT=8000
L="--model llama-3.1-8b --tp 8 --cache-mib 64"
up $TAG-d --role decode $L --listen "$DIP:7100" --peer-timeout-ms $PT --keepalive-ms 250 --rdma-test-dereg
up $TAG-p --role prefill $L --listen "$A:0" --peer-timeout-ms $PT --keepalive-ms 250
grep -q "rdma: listening on rxe1" "$KVFERRY_RUN_DIR/$TAG-d/connector.log" ||
  fail "the decode connector does not listen for rdma on rxe1: $(grep rdma "$KVFERRY_RUN_DIR/$TAG-d/connector.log")"

# 0. Registration (connector/rdma_mr.c) on rxe0, every branch: host memory; device memory of a
# stand-in backend with a dma-buf (this kernel has no udmabuf, so its refusal is what registers
# it as peer memory), without one, and with neither (refused, both reasons in the message).
"$B/rdma_reg_test" >"$KVFERRY_RUN_DIR/reg.txt" 2>&1 || { cat "$KVFERRY_RUN_DIR/reg.txt"; fail "registration"; }
sed 's/^/  /' "$KVFERRY_RUN_DIR/reg.txt"
pass "cache registration, every branch: $(grep -c '^ok:' "$KVFERRY_RUN_DIR/reg.txt") cases"

# 1. End to end.
sim e2e --prefill $TAG-p --decode $TAG-d --transport rdma --requests 12 --max-tokens 1024 --layer-us 200 \
  --timeout-s 120 --baseline || { cat "$KVFERRY_RUN_DIR/e2e.txt"; fail "end to end over rdma"; }
[ "$(json_get "$KVFERRY_RUN_DIR/e2e.json" finished)" = 12 ] && [ "$(json_get "$KVFERRY_RUN_DIR/e2e.json" corrupt)" = 0 ] ||
  { cat "$KVFERRY_RUN_DIR/e2e.txt"; fail "end to end: not all 12 finished and verified"; }
grep -q "rdma to '$TAG-d' (instance $TAG-d) on rxe0" "$KVFERRY_RUN_DIR/$TAG-p/connector.log" ||
  fail "the prefill connector did not use rxe0"
w=$(counter $TAG-p rdma_write_requests) b=$(counter $TAG-p blocks_sent_rdma)
pass "kvf-sim over rdma (rxe0 -> rxe1 across the veth pair): 12 requests, every byte verified;" \
  "$w RDMA WRITEs for $b blocks x layers x tensors"
# ... and caches with scale tensors (FastDeploy's block_wise_fp8): each block's scales written
# beside it, from the part of the region after every layer's K/V; verified with them.
X="--layers 4 --kv-heads 2 --head-dim 64 --dtype uint8 --scale-dtype bf16 --block-size 16 --blocks 1024"
up $TAG-qd --role decode $X --listen "$DIP:7105" --peer-timeout-ms $PT
up $TAG-qp --role prefill $X --listen "$A:0" --peer-timeout-ms $PT
sim scales --prefill $TAG-qp --decode $TAG-qd --transport rdma --requests 8 --max-tokens 2048 --layer-us 200 \
  --timeout-s 120 || { cat "$KVFERRY_RUN_DIR/scales.txt"; fail "scale tensors over rdma"; }
[ "$(json_get "$KVFERRY_RUN_DIR/scales.json" finished)" = 8 ] && [ "$(json_get "$KVFERRY_RUN_DIR/scales.json" corrupt)" = 0 ] ||
  { cat "$KVFERRY_RUN_DIR/scales.txt"; fail "scale tensors over rdma: not all 8 finished and verified"; }
grep -q "every block verified with its scales" "$KVFERRY_RUN_DIR/scales.txt" || fail "scale tensors: not verified with them"
pass "caches with scale tensors over rdma: 8 requests, every block verified with its scales;" \
  "$(counter $TAG-qp rdma_write_requests) RDMA WRITEs"
down $TAG-qp; down $TAG-qd

# 2. Work requests, exactly. Then the peer named by its address (FastDeploy's ip with
# rdma_ports become "ip:port"): the control connection is tcp too.
"$B/rdma_transport_test" --prefill $TAG-p --decode $TAG-d --case runs || fail "work requests per run"
"$B/rdma_transport_test" --prefill $TAG-p --decode $TAG-d --peer "$DIP:7100" --case one ||
  fail "the peer named by address"

# 3. Thousands of small scattered blocks through a shallow send queue.
S="--layers 4 --kv-heads 1 --head-dim 8 --block-size 16 --blocks 16384"
up $TAG-sd --role decode $S --listen "$DIP:7101" --peer-timeout-ms $PT --request-timeout-ms 900000
# Emulated RDMA runs at a few thousand writes a second, its speed differs by more than twice
# between the machines this runs on, and soft-RoCE loses and resends packets when the VM is busy
# (its counters below): the requests' own timeout is far above the run. The ACK timeout is set
# (1 s, rdma_cm's own is about 0.5 s) so that the option is used somewhere.
up $TAG-sp --role prefill $S --listen "$A:0" --peer-timeout-ms $PT --rdma-sq-depth 16 --rdma-signal-every 4 \
  --rdma-ack-timeout 18 --request-timeout-ms 900000
sim scatter --prefill $TAG-sp --decode $TAG-sd --transport rdma --requests 24 --scatter --max-tokens 8192 \
  --prefix-pct 0 --layer-us 100 --timeout-s 150 || { cat "$KVFERRY_RUN_DIR/scatter.txt"; fail "scattered blocks"; }
[ "$(json_get "$KVFERRY_RUN_DIR/scatter.json" finished)" = 24 ] || { cat "$KVFERRY_RUN_DIR/scatter.txt"; fail "scatter: not all finished"; }
w=$(counter $TAG-sp rdma_write_requests) posts=$(counter $TAG-sp rdma_post_calls) sig=$(counter $TAG-sp rdma_signalled_requests)
[ "$(counter $TAG-sp rdma_post_errors)" = 0 ] || fail "scatter: ibv_post_send refused work requests (a full send queue)"
[ "$w" -ge 40000 ] || fail "scatter: only $w work requests: not thousands of small ones"
pass "$w scattered 256-byte blocks' writes (24 requests) through a send queue 16 deep: no overflow," \
  "$posts ibv_post_send calls, $sig signalled; every byte verified ($(json_get "$KVFERRY_RUN_DIR/scatter.json" seconds) s)"
# soft-RoCE's own counters of packets lost and resent: what a slow run spent its time on.
for dev in rxe0 rxe1; do
  c=/sys/class/infiniband/$dev/ports/1/hw_counters
  [ -d "$c" ] || continue
  echo "  $dev: $(for k in rcvd_seq_err duplicate_request completer_retry_err retry_exceeded_err rcvd_rnr_err send_rnr_err out_of_sequence; do
    [ -r "$c/$k" ] && printf '%s %s ' "$k" "$(cat "$c/$k")"; done)"
done

# 4. Refusals.
echo "a-different-token-0123456789abcdef" >"$KVFERRY_RUN_DIR/other-token"; chmod 600 "$KVFERRY_RUN_DIR/other-token"
up $TAG-wd --role decode $L --listen "$DIP:7102" --token-file "$KVFERRY_RUN_DIR/other-token"
up $TAG-xd --role decode --layers 28 --kv-heads 1 --head-dim 128 --cache-mib 32 --listen "$DIP:7103"
for case in "wd:authentication failed" "xd:peer layout mismatch"; do
  d=$TAG-${case%%:*} want=${case#*:}
  sim bad --prefill $TAG-p --decode $d --transport rdma --requests 3 --layer-us 50 --timeout-s 30 || true
  grep -q "$want" "$KVFERRY_RUN_DIR/bad.txt" || { cat "$KVFERRY_RUN_DIR/bad.txt"; fail "$d: no '$want'"; }
  [ "$(json_get "$KVFERRY_RUN_DIR/bad.json" finished)" = 0 ] || fail "$d: a request finished"
  pass "rdma to a peer with $([ ${case%%:*} = wd ] && echo 'another token' || echo '28 layers'): refused, every request fails with '$want'"
done

# 5. The peer's region deregistered under the writes.
"$B/rdma_transport_test" --prefill $TAG-p --decode $TAG-d --case dereg || fail "deregistered region"

# 6. The decode connector killed mid-transfer.
"$B/rdma_transport_test" --prefill $TAG-p --decode $TAG-d --case killmid --blocks 32 \
  --supervisor "$(sup_pid $TAG-d)" --timeout-ms 30000 || fail "decode connector killed"

# 8. The engine's own caches (--caches engine) over rdma: host memory the test registers for
# both sides (every prefill layer in one file; the decode side's blocks-first, blocks not back to
# back), a region per file in each connection, registered anew when the engine registers new
# memory; a decode side with nothing registered refuses for now, naming it.
E="--layers 4 --kv-heads 2 --head-dim 64 --block-size 16 --dtype fp16 --blocks 64"
up $TAG-ed --role decode --caches engine $E --listen "$DIP:7104" --peer-timeout-ms $PT
up $TAG-ep --role prefill --caches engine $E --listen "$A:0" --peer-timeout-ms $PT
"$B/rdma_transport_test" --prefill $TAG-ep --decode $TAG-ed --case engine --blocks 12 || fail "engine caches over rdma"
grep -q "registered on rxe0 for sending: 1 region" "$KVFERRY_RUN_DIR/$TAG-ep/connector.log" ||
  fail "the prefill engine's one file is not one region: $(grep 'for sending' "$KVFERRY_RUN_DIR/$TAG-ep/connector.log")"
pass "the engine's caches over rdma: registered host memory on both sides, blocks-first on decode" \
  "(a write per block), registered anew on either side, unregistered: refused for now"

fi # cases 0 to 6

if [ $PART != transport ]; then
# 7. Another tensor-parallel split: prefill and decode groups of different sizes (one instance
# per rank, --rank/--nranks), kvf-sim in mixed mode, every head of every token verified on every
# decode rank. A GQA shape (8 kv heads, llama's head dim, 4 layers) and an MLA one (key-only
# latent of 576, the same on every rank). GQA: each decode rank gets a head slice of every block
# from its one source, never contiguous across blocks, so exactly one RDMA WRITE per (layer,
# tensor, block) per decode rank (against equal groups of the same shape, measured first). MLA:
# whole blocks, merged into runs as for equal groups: at most that many, at least one per
# (layer, tensor, request, decode rank). The bytes written are
# exactly the heads: all of them once (GQA), the latent once per decode rank (MLA).
MREQ=4 MTOK=256 MBS=16
# Six instances keep the emulated VM busy enough that soft-RoCE resends for seconds: a queue pair
# given up for "no completion" would send its frames again (verified, but not the exact count).
MPT=30000
# blocks of the first MREQ prompts of the trace, clipped to MTOK tokens (as kvf-sim reads them)
mblocks=$(awk -v n=$MREQ -v cap=$MTOK -v b=$MBS '{ if (c == n) exit;
  if (match($0, /"input_length": *[0-9]+/)) { v = substr($0, RSTART, RLENGTH); sub(/.*: */, "", v); v += 0;
    if (v > 0) { c++; if (v > cap) v = cap; t += int((v + b - 1) / b) } } } END { print t }' \
  "$ROOT/data/mooncake-conversation-2000.jsonl")
[ "${mblocks:-0}" -gt 0 ] || fail "mixed: no prompts read from the trace"
mixed() { # mixed KIND P D [PBS]: KIND gqa or mla, P prefill ranks -> D decode ranks; PBS: tokens
  # per prefill block (MBS by default; the decode side's are MBS)
  local kind=$1 p=$2 d=$3 pbs=${4:-$MBS} shape tensors bpt k names_p="" names_d="" w=0 b=0 by=0 port t0=$SECONDS
  # bpt: one token's bytes of one tensor, all the model's heads
  if [ $kind = gqa ]; then
    shape="--layers 4 --kv-heads 8 --head-dim 128" tensors=2 bpt=$((8 * 128 * 2))
  else
    shape="--layers 4 --kv-heads 1 --head-dim 576 --key-only" tensors=1 bpt=$((576 * 2))
  fi
  # The group's instances start together (one at a time costs seconds each in the VM).
  local pids=() pid
  for k in $(seq 0 $((d - 1))); do
    port=$((7110 + k))
    up $TAG-m${kind}d$k --role decode $shape --block-size $MBS --tp $d --rank $k --nranks $d --cache-mib 16 \
      --listen "$DIP:$port" --peer-timeout-ms $MPT &
    pids+=($!)
    STARTED+=($TAG-m${kind}d$k) # (up's own entry is its subshell's)
    names_d=${names_d:+$names_d,}$TAG-m${kind}d$k
  done
  for k in $(seq 0 $((p - 1))); do
    up $TAG-m${kind}p$k --role prefill $shape --block-size $pbs --tp $p --rank $k --nranks $p --cache-mib 16 \
      --listen "$A:0" --peer-timeout-ms $MPT &
    pids+=($!)
    STARTED+=($TAG-m${kind}p$k)
    names_p=${names_p:+$names_p,}$TAG-m${kind}p$k
  done
  for pid in "${pids[@]}"; do wait $pid || fail "$kind tp $p -> $d: an instance did not start"; done
  sim mixed --prefill $names_p --decode $names_d --prefill-tp $p --decode-tp $d --transport rdma \
    --requests $MREQ --max-tokens $MTOK --prefix-pct 0 --layer-us 50 --timeout-s 120 ||
    { cat "$KVFERRY_RUN_DIR/mixed.txt"; fail "$kind tp $p -> $d over rdma"; }
  [ "$(json_get "$KVFERRY_RUN_DIR/mixed.json" finished)" = $MREQ ] &&
    [ "$(json_get "$KVFERRY_RUN_DIR/mixed.json" corrupt)" = 0 ] ||
    { cat "$KVFERRY_RUN_DIR/mixed.txt"; fail "$kind tp $p -> $d: not all $MREQ finished and verified"; }
  [ $p = $d ] || grep -q "every head of every token checked on every decode rank" "$KVFERRY_RUN_DIR/mixed.txt" ||
    { cat "$KVFERRY_RUN_DIR/mixed.txt"; fail "$kind tp $p -> $d: kvf-sim did not check every head"; }
  for k in $(seq 0 $((p - 1))); do
    w=$((w + $(counter $TAG-m${kind}p$k rdma_write_requests)))
    b=$((b + $(counter $TAG-m${kind}p$k blocks_sent_rdma)))
    by=$((by + $(counter $TAG-m${kind}p$k bytes_sent_rdma)))
  done
  local slices=$((d * 4 * tensors * mblocks)) want_by what="tp $p -> $d"
  [ $pbs = $MBS ] || what="$what, $pbs -> $MBS tokens/block"
  if [ $pbs != $MBS ]; then
    # Tokens regrouped: the plan's pieces that land, a head's rows of one source block inside
    # one decode block, so per decode block (mblocks of them: the decode side's size), layer and
    # tensor, one per head it holds: the model's 8 heads over all decode ranks (GQA), the latent
    # once per decode rank (MLA); the bytes are those rows. A work request per piece, merged
    # with the next where both sides continue (MLA's latent into consecutive blocks; never a
    # head of several).
    local heads=8
    [ $kind = mla ] && heads=$d
    slices=$((heads * 4 * tensors * mblocks))
    want_by=$((4 * tensors * mblocks * MBS * bpt))
    [ $kind = gqa ] || want_by=$((d * want_by))
    if [ $kind = gqa ]; then
      [ $w = $slices ] || fail "$kind $what: $w RDMA WRITEs, not $slices (one per layer, tensor, decode block, head)"
    else
      [ $w -lt $slices ] && [ $w -ge $((d * 4 * MREQ)) ] ||
        fail "$kind $what: $w RDMA WRITEs, not fewer than the $slices pieces and at least $((d * 4 * MREQ))"
    fi
    grep -q "tokens regrouped" "$KVFERRY_RUN_DIR/$TAG-m${kind}p0/connector.log" ||
      fail "$kind $what: the prefill connector does not say it regroups tokens"
  elif [ $kind = gqa ] && [ $p != $d ]; then
    want_by=$((4 * tensors * mblocks * MBS * bpt))
    [ $w = $slices ] || fail "$kind tp $p -> $d: $w RDMA WRITEs, not $slices (one per layer, tensor, block, decode rank)"
    grep -q "a work request per block" "$KVFERRY_RUN_DIR/$TAG-m${kind}p0/connector.log" ||
      fail "$kind tp $p -> $d: the prefill connector does not say it sends head slices"
  else
    # whole blocks (MLA, or the reference: equal groups), every head once per decode rank
    want_by=$((d * 4 * tensors * mblocks * MBS * bpt))
    [ $kind = mla ] || want_by=$((4 * tensors * mblocks * MBS * bpt))
    [ $w -le $slices ] && [ $w -ge $((d * 4 * MREQ)) ] ||
      fail "$kind tp $p -> $d: $w RDMA WRITEs, not between $((d * 4 * MREQ)) and $slices"
  fi
  [ $b = $slices ] || fail "$kind tp $p -> $d: $b blocks written, not $slices"
  [ $by = $want_by ] || fail "$kind tp $p -> $d: $by bytes written, not $want_by (every head once per decode rank that holds it)"
  [ "$(counter $TAG-m${kind}p0 rdma_post_errors)" = 0 ] || fail "$kind tp $p -> $d: post errors"
  pass "$kind $what over rdma: $MREQ requests, every head of every token verified" \
    "($(json_get "$KVFERRY_RUN_DIR/mixed.json" verified_bytes) bytes); $w RDMA WRITEs ($((w / MREQ)) per request)" \
    "for $b blocks x layers x tensors x decode ranks, $by bytes written ($((SECONDS - t0)) s with the instances' start)"
  if [ $kind = gqa ] && [ $p = 2 ] && [ $d = 4 ]; then
    # Decode rank 0's heads (0 and 1) come from prefill rank 0: rank 1 sends it none, and the
    # rdma data connection's handshake refuses the pair with both ranks in the reason.
    "$B/rdma_transport_test" --prefill $TAG-mgqap1 --decode $TAG-mgqad0 --case one --blocks 2 \
      --expect "peer layout mismatch" --timeout-ms 30000 >"$KVFERRY_RUN_DIR/none.txt" 2>&1 &&
      grep -q "prefill rank 1 of 2 sends it none of its heads" "$KVFERRY_RUN_DIR/none.txt" ||
      { cat "$KVFERRY_RUN_DIR/none.txt"; fail "prefill rank 1 -> decode rank 0 of 4 over rdma: not refused so"; }
    pass "prefill rank 1 of 2 -> decode rank 0 of 4 over rdma: $(grep -o "refused: peer layout mismatch.*" "$KVFERRY_RUN_DIR/none.txt" | head -n 1)"
  fi
  if [ $kind = gqa ] && [ $pbs != $MBS ]; then
    # A task to the decode rank named by its address, which this sender has not heard of: it
    # cannot know the peer's block size, so it sends whole blocks; the connector, which knows,
    # fails the transfer before any write (a one-sided write of 32-token blocks into 16-token
    # ones would land wrong) and both sides say so.
    "$B/rdma_transport_test" --prefill $TAG-mgqap0 --decode $TAG-mgqad0 --peer "$DIP:7110" --case one --blocks 2 \
      --expect "peer layout mismatch" --timeout-ms 30000 >"$KVFERRY_RUN_DIR/bs.txt" 2>&1 &&
      grep -q "tokens/block there, $pbs here, and the task was accepted for blocks of one size" "$KVFERRY_RUN_DIR/bs.txt" ||
      { cat "$KVFERRY_RUN_DIR/bs.txt"; fail "$kind $what: a task of whole blocks to a peer of unknown block size not refused so"; }
    pass "$kind $what: whole blocks to a peer whose block size the sender did not know: $(sed -n 's/^ok: one request over rdma: //p' "$KVFERRY_RUN_DIR/bs.txt" | head -n 1)"
  fi
  pids=()
  for k in $(seq 0 $((p - 1))); do down $TAG-m${kind}p$k & pids+=($!); done
  for k in $(seq 0 $((d - 1))); do down $TAG-m${kind}d$k & pids+=($!); done
  for pid in "${pids[@]}"; do wait $pid || fail "$kind tp $p -> $d: an instance did not stop"; done
}
mixed gqa 1 1 # the reference: equal groups, the same shape, whole-block runs
mixed gqa 1 2
mixed gqa 2 4
[ $BENCH = 0 ] || mixed mla 1 2 # (2 -> 4 below covers MLA; this one with --bench)
mixed mla 2 4
# Tokens regrouped into the decode side's blocks: 32-token prefill blocks into 16-token ones.
mixed gqa 1 2 32
mixed mla 2 4 32
fi # case 7

# No role died but the connector killed on purpose, and (an ASan build) no sanitizer report,
# also at exit: stop everything first.
[ $PART = mixed ] || for n in d p sd sp wd xd ed ep; do down $TAG-$n; done
died=$(grep -h "exited with status" "$KVFERRY_RUN_DIR"/*/supervisor.log | grep -v "$TAG-d/supervisor connector" || true)
[ -z "$died" ] || fail "roles died: $died"
if grep -l -E "AddressSanitizer|LeakSanitizer|runtime error:" "$KVFERRY_RUN_DIR"/*/*.log; then
  grep -h -A20 -E "AddressSanitizer|LeakSanitizer|runtime error:" "$KVFERRY_RUN_DIR"/*/*.log | head -80
  fail "sanitizer reports in the roles' logs"
fi
pass "no role died but the one killed, no sanitizer report"

if [ $BENCH = 1 ]; then
  # Work requests per request for real model shapes (one tp-8 rank: kv_heads / 8, at least 1),
  # requests of the conversation trace (up to 2048 tokens, the caches' room), blocks from the
  # simulator's pool as an engine would hand them out, then in random order (--scatter); and the
  # throughput with no compute time, against a memcpy of the same bytes in the same VM.
  for m in llama-3.1-8b llama-3.1-70b qwen2.5-72b deepseek-v3-mla; do
    for mode in pool --scatter; do
      up $TAG-bd --role decode --model $m --tp 8 --cache-mib 320 --listen "$DIP:7104"
      up $TAG-bp --role prefill --model $m --tp 8 --cache-mib 320 --listen "$A:0"
      sim bench --prefill $TAG-bp --decode $TAG-bd --transport rdma --requests 8 --max-tokens 2048 \
        --layer-us 0 --late-pct 0 --timeout-s 300 --verify sample --baseline $([ $mode = pool ] || echo --scatter) ||
        { cat "$KVFERRY_RUN_DIR/bench.txt"; fail "bench $m"; }
      w=$(counter $TAG-bp rdma_write_requests) b=$(counter $TAG-bp blocks_sent_rdma) d=$(counter $TAG-bp rdma_done_messages_sent)
      n=$(json_get "$KVFERRY_RUN_DIR/bench.json" finished)
      r=$(json_get "$KVFERRY_RUN_DIR/bench.json" rate_bps) c=$(json_get "$KVFERRY_RUN_DIR/bench.json" memcpy_bps)
      pass "BENCH $m tp8 ${mode#--}: $n requests, $w RDMA WRITEs + $d done messages; one per block (FastDeploy) $b;" \
        "per request $((w / n)) against $((b / n)); rdma ${r%.*} B/s, memcpy ${c%.*} B/s (EMULATED: qemu TCG + soft-RoCE)"
      down $TAG-bp; down $TAG-bd
    done
  done
fi
