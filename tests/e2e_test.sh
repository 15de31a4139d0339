#!/usr/bin/env bash
# End to end on one host with real processes: per-query and chunked prefill, speculative extra
# layers, a key-only (MLA) layout, two ranks per instance with aggregated completions, and
# cancels in mid-transfer. kvf-sim verifies every byte that is reported finished.
source "$(dirname "$0")/lib.sh"
cd "$ROOT"

case_run() {
  local what=$1 json=$KVFERRY_RUN_DIR/$2.json txt=$KVFERRY_RUN_DIR/$2.txt; shift 2
  "$B/kvf-sim" --quiet --json "$json" --timeout-s 60 "$@" >"$txt" || { cat "$txt" >&2; fail "$what: kvf-sim failed"; }
  [ "$(json_get "$json" ok)" = True ] || fail "$what: not ok"
  [ "$(json_get "$json" corrupt)" = 0 ] || fail "$what: corrupt requests"
  echo "$json"
}

# all_accounted WHAT JSON N: every one of N requests ended once, finished (and verified) or
# cancelled, and only those the simulator cancelled (--cancel-pct) may say cancelled: a cancel
# that came after all of a request's bytes had landed leaves it finished.
all_accounted() {
  local what=$1 j=$2 n=$3 f c s
  f=$(json_get "$j" finished) c=$(json_get "$j" cancelled) s=$(json_get "$j" cancels_sent)
  [ "$(json_get "$j" requests)" = "$n" ] || fail "$what: $(json_get "$j" requests) requests, not $n"
  [ "$(json_get "$j" unaccounted)" = 0 ] || fail "$what: $(json_get "$j" unaccounted) requests without a completion"
  [ $((f + c)) = "$n" ] || fail "$what: $f finished + $c cancelled != $n requests ($(json_get "$j" failed) failed)"
  [ "$c" -le "$s" ] || fail "$what: $c cancelled, but the simulator cancelled only $s"
  [ "$f" -ge 1 ] || fail "$what: nothing finished"
}

L="--model llama-3.1-8b --tp 8 --cache-mib 256"
up $TAG-d0 --role decode $L
up $TAG-p0 --role prefill $L

j=$(case_run "per-query" pq --prefill $TAG-p0 --decode $TAG-d0 --requests 40 --layer-us 100 --late-pct 25 --prefix-pct 30)
[ "$(json_get "$j" finished)" = 40 ] || fail "per-query: not all 40 finished"
pass "per-query prefill: 40 requests finished and verified (25% of tasks after their layers, 30% prefix hits)"
# A same-host arrival says when the prefill sender posted its finish notice (accept_ns, one
# clock on one host): never after the arrival was published; a network one does not.
[ "$(json_get "$j" notice_n)" -ge 1 ] || fail "per-query: no arrival carried its notice's time"
[ "$(json_get "$j" notice_bad)" = 0 ] || fail "per-query: $(json_get "$j" notice_bad) notices stamped after their arrival"
pass "same-host arrivals carry their notice's time ($(json_get "$j" notice_n) requests in time, p50 $(json_get "$j" notice_p50_ns) ns after the last layer, none after the arrival)"
# Notice rings (the default; KVFERRY_NOTICE_RINGS=0 turns them off): ipc notices go into the
# decode segment's notice slots, so the unix control connection carries none of them. The socket
# path (tcp and rdma notices; an ipc peer that got no slot) is checked below on instances started
# with --no-notice-rings (a full control socket).
RINGS=${KVFERRY_NOTICE_RINGS:-1}
if [ "$RINGS" = 1 ]; then
  grep -q "peer '$TAG-d0': notice slot [0-9]*: finish notices go to its connector in one hop" "$KVFERRY_RUN_DIR/$TAG-p0/sender.log" ||
    fail "--notice-rings: the prefill sender holds no notice slot of '$TAG-d0'"
  "$B/kvf-ringdump" --instance $TAG-d0 | grep -q " $TAG-p0 " || fail "--notice-rings: ring-dump of '$TAG-d0' does not show the slot of '$TAG-p0'"
  pass "--notice-rings: the prefill sender holds a notice slot of the decode instance (ring-dump shows it)"
else
# Same-host peers: the control connection is the connector's unix socket, not loopback tcp.
grep -q "peer '$TAG-d0' (instance $TAG-d0, same host) connected over a unix socket" "$KVFERRY_RUN_DIR/$TAG-p0/connector.log" ||
  fail "the prefill connector did not reach its same-host peer over the unix socket"
pass "same-host peers: the connectors' control connection is a unix socket"
fi

# The notice prewake (sender.h), forced on (auto leaves it off on fewer than 4 CPUs): the sender
# wakes the decode connector as a request's last layer but one is done (layers 100 us apart) and
# as its last copies start; every request still finishes and verifies, and the arrivals' notice
# times stay before the arrivals.
up $TAG-wd0 --role decode $L
up $TAG-wp0 --role prefill $L --notice-prewake on
grep -q "notice prewake: on (--notice-prewake on" "$KVFERRY_RUN_DIR/$TAG-wp0/sender.log" ||
  fail "--notice-prewake on: the sender does not say so"
j=$(case_run "notice prewake" pw --prefill $TAG-wp0 --decode $TAG-wd0 --requests 40 --layer-us 100 --late-pct 10 --step-tokens 1)
[ "$(json_get "$j" finished)" = 40 ] || fail "notice prewake: not all 40 finished"
[ "$(json_get "$j" notice_bad)" = 0 ] || fail "notice prewake: notices stamped after their arrivals"
w=$(counter $TAG-wp0 notice_prewakes)
[ "$w" -ge 36 ] || fail "notice prewake: the sender woke the decode connector $w times for 36 or more requests in time"
# While it polls for an expected notice, the decode connector rehearses the last one it handled
# (connector/notices.c): never a second arrival, never one more answer.
h=$(counter $TAG-wd0 notice_rehearsals)
[ "$h" -ge 1 ] || fail "notice prewake: the decode connector never rehearsed a notice while it polled for one"
[ "$(counter $TAG-wd0 arrivals)" = 40 ] || fail "notice prewake: $(counter $TAG-wd0 arrivals) arrivals published for 40 requests"
[ "$(counter $TAG-wd0 arrivals_deduplicated)" = 0 ] || fail "notice prewake: notices answered as repeats"
pass "notice prewake (forced on): 40 requests verified, the decode connector woken $w times ahead of their notices and $h rehearsals of the last one, 40 arrivals"
down $TAG-wp0; down $TAG-wd0

# A slower engine (layers 1 ms apart, more than the early prewake's 500 us): the wake-up is
# started a lead before the last layer can come, from the sender's loop (sender.h,
# SENDER_PREWAKE_LEAD_NS). Against the same run with the early prewakes switched off
# (KVF_AB_NO_EARLY_PREWAKE=1: the wake-up at the last layer only): more prewakes, all verified.
for arm in a b; do
  up $TAG-wd$arm --role decode $L
  [ $arm = b ] && export KVF_AB_NO_EARLY_PREWAKE=1
  up $TAG-wp$arm --role prefill $L --notice-prewake on
  unset KVF_AB_NO_EARLY_PREWAKE
  j=$(case_run "slow engine's prewake $arm" pws$arm --prefill $TAG-wp$arm --decode $TAG-wd$arm --requests 40 --layer-us 1000 --step-tokens 1)
  [ "$(json_get "$j" finished)" = 40 ] || fail "slow engine's prewake ($arm): not all 40 finished"
  [ "$(json_get "$j" notice_bad)" = 0 ] || fail "slow engine's prewake ($arm): notices stamped after their arrivals"
  eval "w$arm=$(counter $TAG-wp$arm notice_prewakes)"
  down $TAG-wp$arm; down $TAG-wd$arm
done
[ "$wa" -gt "$wb" ] ||
  fail "slow engine's prewake: $wa prewakes, $wb with the early ones off: none started ahead of the last layer"
pass "slow engine's prewake (layers 1 ms apart): $wa prewakes against $wb at the last layer only; 40 + 40 requests verified"

# A late task whose one layer is more than a slice (sender_advance): two requests of 8192 tokens
# (128 blocks x K and V x 16 KiB = 4 MiB per layer), every layer done before the task comes.
# The sender copies each layer in 1 MiB pieces, the loop's progress check between them: at
# least 4 pieces per layer (one layer per slice would be 31 slices per request).
printf '{"input_length": 8192}\n{"input_length": 8192}\n' >"$KVFERRY_RUN_DIR/long.jsonl"
s0=$(counter $TAG-p0 backlog_slices)
j=$(case_run "late long requests" late --prefill $TAG-p0 --decode $TAG-d0 --trace "$KVFERRY_RUN_DIR/long.jsonl" \
      --requests 2 --layer-us 100 --late-pct 100 --prefix-pct 0)
[ "$(json_get "$j" finished)" = 2 ] || fail "late long requests: not both finished"
pieces=$(( $(counter $TAG-p0 backlog_slices) - s0 ))
[ "$pieces" -ge $((2 * 4 * 31)) ] || fail "late long requests: $pieces slices, want >= $((2 * 4 * 31)) (1 MiB pieces of 4 MiB layers)"
pass "a late task's 4 MiB layers copied in 1 MiB pieces ($pieces slices for 2 requests), every byte verified"

# The prefill instance re-created under the same name while the decode instance stays: its
# transfer keys start over, and the decode side must not take them for repeats of old ones.
down $TAG-p0
up $TAG-p0 --role prefill $L
for t in ipc tcp; do
  j=$(case_run "re-created prefill ($t)" re-$t --prefill $TAG-p0 --decode $TAG-d0 --requests 10 --layer-us 50 --transport $t)
  [ "$(json_get "$j" finished)" = 10 ] || fail "re-created prefill ($t): not all 10 finished"
done
pass "a prefill instance re-created under the same name: new transfers arrive (ipc and tcp)"

j=$(case_run "chunked" ch --prefill $TAG-p0 --decode $TAG-d0 --requests 20 --layer-us 50 --chunk-tokens 1000 --step-tokens 3000)
[ "$(json_get "$j" finished)" = 20 ] || fail "chunked: not all finished"
pass "chunked prefill: 20 requests in 1000-token chunks, partial blocks never sent early"

j=$(case_run "cancel" cx --prefill $TAG-p0 --decode $TAG-d0 --requests 40 --layer-us 300 --cancel-pct 40)
all_accounted "cancel" "$j" 40
c=$(json_get "$j" cancelled)
[ "$c" -gt 0 ] || fail "cancel: no request was cancelled"
[ "$(json_get "$j" finished_but_failed_pairs)" = 0 ] || fail "cancel: a cancelled request also arrived as finished"
pass "cancel mid-transfer: $c cancelled (of $(json_get "$j" cancels_sent) cancels), the rest finished and verified"

# A full control socket (the socket path: instances with --no-notice-rings). A notice the socket
# has no room for is held back for the peer thread, which sends it later. The decode connector
# stopped while 500 one-block requests finish in one step: the socket fills (a small notice takes
# about 780 bytes of its 208 KiB), notices are held back; then it goes on, and every request must
# finish, verified, each once.
LF="--model llama-3.1-8b --tp 8 --cache-mib 512" # 512 blocks: 500 requests of one block at once
# (a peer timeout longer than the stop can last under the sanitizers' slowness)
up $TAG-fd --role decode $LF --peer-timeout-ms 120000
up $TAG-fp --role prefill $LF --peer-timeout-ms 120000 --no-notice-rings
case_run "full socket, warm-up" fw --prefill $TAG-fp --decode $TAG-fd --requests 5 --layer-us 0 >/dev/null
dc=$(pid_of connector $TAG-fd) || fail "full socket: no decode connector"
h0=$(counter $TAG-fp notices_held_back)
kill -STOP "$dc"
"$B/kvf-sim" --quiet --json "$KVFERRY_RUN_DIR/full.json" --timeout-s 120 --prefill $TAG-fp --decode $TAG-fd \
  --requests 500 --max-tokens 64 --step-tokens 65536 --layer-us 0 --prefix-pct 0 >"$KVFERRY_RUN_DIR/full.txt" &
sim=$!
for _ in $(seq 300); do [ "$(counter $TAG-fp notices_held_back)" -gt "$h0" ] && break; sleep 0.05; done
held=$(( $(counter $TAG-fp notices_held_back) - h0 ))
kill -CONT "$dc"
wait $sim || { cat "$KVFERRY_RUN_DIR/full.txt" >&2; fail "full socket: kvf-sim failed"; }
[ "$held" -gt 0 ] || fail "full socket: no notice was held back (the socket never filled?)"
j=$KVFERRY_RUN_DIR/full.json
[ "$(json_get "$j" finished)" = 500 ] || fail "full socket: $(json_get "$j" finished) of 500 finished"
[ "$(json_get "$j" corrupt)" = 0 ] || fail "full socket: corrupt requests"
[ "$(json_get "$j" unaccounted)" = 0 ] || fail "full socket: requests without a completion"
pass "a full control socket: the decode connector stopped, a notice met the full socket ($held held back) and the peer thread sent the queue after; 500 requests finished and verified"
down $TAG-fp; down $TAG-fd
down $TAG-p0; down $TAG-d0

up $TAG-sd0 --role decode --model llama-3.1-8b --tp 8 --extra-layers 1 --cache-mib 128
up $TAG-sp0 --role prefill --model llama-3.1-8b --tp 8 --extra-layers 1 --cache-mib 128
j=$(case_run "speculative" sp --prefill $TAG-sp0 --decode $TAG-sd0 --requests 10 --layer-us 50)
[ "$(json_get "$j" finished)" = 10 ] || fail "speculative: not all finished"
pass "speculative decoding: 32 + 1 extra layers moved and verified"
down $TAG-sp0; down $TAG-sd0

up $TAG-md0 --role decode --model deepseek-v3-mla --cache-mib 256
up $TAG-mp0 --role prefill --model deepseek-v3-mla --cache-mib 256
j=$(case_run "key-only" mla --prefill $TAG-mp0 --decode $TAG-md0 --requests 10 --layer-us 50)
[ "$(json_get "$j" finished)" = 10 ] || fail "key-only: not all finished"
pass "key-only (MLA) layout: 61 layers x 1 tensor moved and verified"
down $TAG-mp0; down $TAG-md0

# Scale tensors (FastDeploy's block_wise_fp8): uint8 K/V with a bf16 scale tensor beside each,
# chunked prefill over ipc and tcp, every block verified with its scales; an instance without
# scales is refused as a peer on both, naming the difference.
S="--layers 4 --kv-heads 2 --head-dim 64 --dtype uint8 --block-size 16 --blocks 2048"
up $TAG-xd0 --role decode $S --scale-dtype bf16
up $TAG-xp0 --role prefill $S --scale-dtype bf16
up $TAG-xn0 --role decode $S
"$B/kvf-ringdump" --instance $TAG-xp0 | grep -q "scale tensors: bf16, 64 bytes a block" ||
  fail "scale tensors: ring-dump does not show them"
for t in ipc tcp; do
  j=$(case_run "scale tensors ($t)" sc-$t --prefill $TAG-xp0 --decode $TAG-xd0 --requests 30 --max-tokens 4096 \
        --layer-us 50 --chunk-tokens 1000 --step-tokens 3000 --transport $t)
  [ "$(json_get "$j" finished)" = 30 ] || fail "scale tensors ($t): not all 30 finished"
  [ $t = ipc ] || [ "$(json_get "$j" notice_n)" = 0 ] || fail "scale tensors (tcp): an arrival over tcp carried a notice time"
  grep -q "every block verified with its scales" "$KVFERRY_RUN_DIR/sc-$t.txt" || fail "scale tensors ($t): not verified with them"
  "$B/kvf-sim" --json "$KVFERRY_RUN_DIR/scn-$t.json" --timeout-s 30 --prefill $TAG-xp0 --decode $TAG-xn0 \
    --requests 3 --layer-us 50 --transport $t >"$KVFERRY_RUN_DIR/scn-$t.txt" 2>&1 || true
  [ "$(json_get "$KVFERRY_RUN_DIR/scn-$t.json" finished)" = 0 ] || fail "scale tensors ($t): a peer without them took a request"
  grep -q "peer layout mismatch.*scale tensors: bf16 on prefill, none on decode" "$KVFERRY_RUN_DIR/scn-$t.txt" ||
    { cat "$KVFERRY_RUN_DIR/scn-$t.txt" >&2; fail "scale tensors ($t): the refusal does not name them"; }
done
pass "scale tensors (block_wise_fp8): 30 chunked requests over ipc and over tcp, every block verified with its scales; a peer without them refused on both"
down $TAG-xp0; down $TAG-xd0; down $TAG-xn0

# A second cache backend (common/cache_host_async.c): host memory whose copies complete later, on
# a worker thread, as a GPU kernel's do. Requests go FINISHING only once their last batch has
# landed; a failed batch fails exactly the requests it carried, never one reported finished.
up $TAG-ad0 --role decode $L --backend host-async
KVFERRY_ASYNC_DELAY_US=300 up $TAG-ap0 --role prefill $L --backend host-async
j=$(case_run "async copies" as --prefill $TAG-ap0 --decode $TAG-ad0 --requests 30 --layer-us 100 --late-pct 20)
[ "$(json_get "$j" finished)" = 30 ] || fail "async copies: not all 30 finished"
[ "$(json_get "$j" notice_n)" -ge 1 ] && [ "$(json_get "$j" notice_bad)" = 0 ] ||
  fail "async copies: notice times missing or after their arrivals"
j=$(case_run "async copies, chunked" asc --prefill $TAG-ap0 --decode $TAG-ad0 --requests 15 --layer-us 50 --chunk-tokens 1000 --step-tokens 3000)
[ "$(json_get "$j" finished)" = 15 ] || fail "async copies, chunked: not all 15 finished"
grep -q "host-async" <("$B/kvf-ringdump" --instance $TAG-ap0) || fail "ring-dump does not name the backend"
down $TAG-ap0
# Backlogs (every layer at once, late tasks) of chunked requests, half of them cancelled while
# their copies are out (1.5 ms a batch): each ends once, the finished ones verified. (The
# simulator's engine once went on computing a cancelled request into blocks it had given back,
# which showed up here as another request's bytes.)
KVFERRY_ASYNC_DELAY_US=1500 up $TAG-ap0 --role prefill $L --backend host-async
j=$(case_run "async copies, chunked backlogs with cancels" ascc --prefill $TAG-ap0 --decode $TAG-ad0 --requests 300 \
  --layer-us 0 --chunk-tokens 1000 --step-tokens 3000 --late-pct 30 --cancel-pct 50 --seed 1)
all_accounted "async copies, chunked backlogs with cancels" "$j" 300
down $TAG-ap0
KVFERRY_ASYNC_FAIL_EVERY=5 up $TAG-ap0 --role prefill $L --backend host-async
j=$KVFERRY_RUN_DIR/asf.json
"$B/kvf-sim" --quiet --json "$j" --timeout-s 60 --prefill $TAG-ap0 --decode $TAG-ad0 --requests 30 --layer-us 100 \
  >"$KVFERRY_RUN_DIR/asf.txt" || true
[ "$(json_get "$j" corrupt)" = 0 ] || fail "async copies that fail: a request was reported finished with bytes that differ"
[ "$(json_get "$j" unaccounted)" = 0 ] || fail "async copies that fail: requests without a completion"
grep -q "write error" "$KVFERRY_RUN_DIR/asf.txt" || fail "async copies that fail: no request ended 'write error'"
[ "$(json_get "$j" finished_but_failed_pairs)" = 0 ] || fail "async copies that fail: the two sides disagree"
pass "a second cache backend with copies completed later: 45 requests verified, 300 chunked backlogs with cancels accounted for; every 5th batch failed: $(json_get "$j" failed) requests 'write error', the rest verified, none corrupt"
down $TAG-ap0; down $TAG-ad0

for r in 0 1; do
  up $TAG-rd$r --role decode $L --rank $r --nranks 2
  up $TAG-rp$r --role prefill $L --rank $r --nranks 2
done
j=$(case_run "two ranks" tp --prefill $TAG-rp0,$TAG-rp1 --decode $TAG-rd0,$TAG-rd1 --requests 20 --layer-us 50 --cancel-pct 20)
all_accounted "two ranks" "$j" 20
[ "$(json_get "$j" cancels_sent)" -gt 0 ] || fail "two ranks: the simulator cancelled nothing"
[ "$(json_get "$j" finished_but_failed_pairs)" = 0 ] || fail "two ranks: a cancelled request also arrived as finished"
pass "two ranks per instance: completions and arrivals aggregated across ranks, all 20 accounted for ($(json_get "$j" finished) finished, $(json_get "$j" cancelled) cancelled of $(json_get "$j" cancels_sent) cancels)"
echo "e2e_test: all passed"
