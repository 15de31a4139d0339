#!/usr/bin/env bash
# GPU caches end to end on one host: prefill and decode instances with --backend cuda
# on one GPU, kvf-sim in GPU mode (each layer a kernel that writes the blocks and keeps every SM
# busy, signalled with kvf_layer_done_on_stream; every byte of every arrival checked on the GPU).
#   - both executors (the engine's context; the sender's context): per-query with late tasks and
#     prefix hits, chunked prefill, cancels; the engine executor must really have copied (its
#     plan claims counted in the segment); both layer signals (the GPU-written word, the host function);
#     the engine working on the legacy default stream (stream 0, as PyTorch does);
#   - key-only (MLA) and speculative extra layers, both executors;
#   - GPU caches over tcp (staged io), contiguous and scattered, and a decode connector killed;
#   - the sender SIGKILLed mid-transfer, again and again, each executor: one status per request,
#     nothing corrupt reported finished, the two sides agreeing;
#   - the engine killed: its caches intact when it attaches again (tests/gpu_reattach_test);
#     the engine (kvf-sim) killed mid-transfer with its copies queued, then a new engine;
#   - a Python engine through python/kvferry and PyTorch, both executors (skipped where python3
#     has no torch or no msgpack);
#   - a peer on another GPU of this host, through the same path with peer access (skipped with
#     one GPU visible);
#   - both executors under MPS (auto: the engine's), started by `tools/kvferry up --mps` with a
#     private pipe directory (skipped where nvidia-cuda-mps-control is not installed).
# Exit 77 (skipped) when no GPU is visible. Needs the build, the repository and the driver only
# (no python: the JSON is read with sed).
HERE=$(cd "$(dirname "$0")" && pwd)
B0=${KVFERRY_BUILD:-$HERE/../build}
NGPU=$("$B0/kvf-ctl" gpus 2>/dev/null || echo 0)
if ! [ "${NGPU:-0}" -ge 1 ] 2>/dev/null; then
  echo "gpu_e2e_test: skipped: no GPU visible ($("$B0/kvf-ctl" gpus 2>&1 >/dev/null | head -n1))"
  exit 77
fi
source "$HERE/lib.sh"
cd "$ROOT"
export KVFERRY_BACKEND=cuda
# The trace by path: kvf-sim's built-in default names the source tree it was built in, which a
# build carried to the GPU machine may not have.
TRACE=$ROOT/data/mooncake-conversation-2000.jsonl
[ -x "$B/tests/gpu_reattach_test" ] || fail "no $B/tests/gpu_reattach_test: was $B built with nvcc?"
echo "gpu_e2e_test: $NGPU GPU(s) visible"

# jv FILE KEY: a top-level value of kvf-sim's flat JSON summary
jv() { sed -n "s/.*\"$2\":\([^,}]*\).*/\1/p" "$1" | head -n1 | tr -d '"'; }
# rdv INSTANCE KEY: a numeric value from kvf-ringdump --json (keys used here are unique)
rdv() { "$B/kvf-ringdump" --instance "$1" --json | sed -n "s/.*\"$2\":\([0-9]*\).*/\1/p" | head -n1; }

# sim WHAT NAME [kvf-sim options]: one verified run; prints its JSON file
sim() {
  local what=$1 json=$KVFERRY_RUN_DIR/$2.json txt=$KVFERRY_RUN_DIR/$2.txt; shift 2
  "$B/kvf-sim" --gpu --trace "$TRACE" --quiet --json "$json" --timeout-s 60 "$@" >"$txt" 2>&1 || { cat "$txt" >&2; fail "$what: kvf-sim failed"; }
  [ "$(jv "$json" ok)" = true ] || { cat "$txt" >&2; fail "$what: not ok"; }
  [ "$(jv "$json" corrupt)" = 0 ] || fail "$what: corrupt requests"
  [ "$(jv "$json" gpu)" = true ] || fail "$what: kvf-sim did not run in GPU mode"
  echo "$json"
}
# all_finished WHAT JSON N
all_finished() { [ "$(jv "$2" finished)" = "$3" ] || fail "$1: $(jv "$2" finished) of $3 finished"; }

L="--model llama-3.1-8b --tp 8 --cache-mib 1024"
for ex in engine sender; do
  d=$TAG-d$ex p=$TAG-p$ex
  up $d --role decode $L --executor $ex
  up $p --role prefill $L --executor $ex
  "$B/kvf-ringdump" --instance $p | grep -q "cuda backend (GPU 0, copies in the $ex's context)" ||
    fail "$ex: ring-dump does not say the cache is on GPU 0 with the $ex executor"
  "$B/kvf-ringdump" --instance $p | grep -q "handle 0: [0-9a-f]\{128\}" || fail "$ex: ring-dump shows no IPC handle"
  "$B/kvf-ringdump" --instance $p --json | grep -q '"handles":\["[0-9a-f]\{128\}"\]' ||
    fail "$ex: ring-dump --json shows no IPC handle"

  j=$(sim "$ex: per-query" pq-$ex --prefill $p --decode $d --requests 40 --layer-us 100 --late-pct 25 --prefix-pct 30)
  all_finished "$ex: per-query" "$j" 40
  j=$(sim "$ex: chunked" ch-$ex --prefill $p --decode $d --requests 20 --layer-us 50 --chunk-tokens 1000 --step-tokens 3000)
  all_finished "$ex: chunked" "$j" 20
  j=$(sim "$ex: cancel" cx-$ex --prefill $p --decode $d --requests 30 --layer-us 300 --cancel-pct 40)
  [ "$(jv "$j" finished_but_failed_pairs)" = 0 ] || fail "$ex: a cancelled request also arrived finished"
  # The signal the default does not pick for this executor (without MPS: the GPU-written word for
  # the engine's, the host function for the sender's; include/kvferry.h)
  other=hostfn; [ $ex = sender ] && other=writevalue
  j=$(KVFERRY_LAYER_SIGNAL=$other sim "$ex: $other signal" sig-$ex --prefill $p --decode $d --requests 20 --layer-us 100)
  all_finished "$ex: $other signal" "$j" 20
  # The engine on the legacy default stream (stream 0: PyTorch's current stream unless the
  # engine made its own), which the engine executor's non-blocking side stream does not
  # follow unless it waits for it explicitly.
  j=$(sim "$ex: legacy default stream" ds-$ex --prefill $p --decode $d --requests 40 --layer-us 200 --gpu-default-stream)
  all_finished "$ex: legacy default stream" "$j" 40
  if [ $ex = engine ]; then
    claimed=$(rdv $p layers_claimed)
    [ "${claimed:-0}" -gt 0 ] || fail "engine executor: the engine claimed no layer (plans published: $(rdv $p plans_published))"
    [ "$(rdv $p copy_errors)" = 0 ] || fail "engine executor: the engine reported copy errors"
    pass "engine executor: $claimed layers copied in the engine's context ($(rdv $p copy_kernels) kernels, $(rdv $p plans_published) plans, $(rdv $p plans_taken_back) taken back by the sender)"
  fi
  pass "$ex executor: per-query (late tasks, prefix hits), chunked, cancels, both layer signals and the legacy default stream, every byte verified on the GPU"
  down $p; down $d
done

for ex in engine sender; do
  up $TAG-md$ex --role decode --model deepseek-v3-mla --cache-mib 1024 --executor $ex
  up $TAG-mp$ex --role prefill --model deepseek-v3-mla --cache-mib 1024 --executor $ex
  j=$(sim "$ex: key-only" mla-$ex --prefill $TAG-mp$ex --decode $TAG-md$ex --requests 12 --layer-us 50)
  all_finished "$ex: key-only" "$j" 12
  down $TAG-mp$ex; down $TAG-md$ex
  up $TAG-sd$ex --role decode $L --extra-layers 2 --executor $ex
  up $TAG-sp$ex --role prefill $L --extra-layers 2 --executor $ex
  j=$(sim "$ex: extra layers" sp-$ex --prefill $TAG-sp$ex --decode $TAG-sd$ex --requests 12 --layer-us 50)
  all_finished "$ex: extra layers" "$j" 12
  down $TAG-sp$ex; down $TAG-sd$ex
  pass "$ex executor: key-only (MLA, 61 layers x 1 tensor) and 32 + 2 extra layers verified"
done

# GPU caches over tcp: each connector thread stages through a ring of pinned host
# buffers (common/cache_stage.c), one copy kernel per send batch and per received frame, the next
# batch's copy running while this one is on the wire; contiguous and scattered blocks, every byte
# verified on the GPU, all of them by tcp; then the decode connector killed mid-transfer.
up $TAG-td --role decode $L
up $TAG-tp --role prefill $L
for mode in contiguous scatter; do
  opt=(); [ $mode = scatter ] && opt=(--scatter)
  j=$(sim "tcp, $mode blocks" tcp-$mode --prefill $TAG-tp --decode $TAG-td --transport tcp --requests 30 --layer-us 100 \
        --late-pct 20 "${opt[@]}")
  all_finished "tcp, $mode blocks" "$j" 30
done
[ "$(rdv $TAG-tp bytes_moved_ipc)" = 0 ] && [ "$(rdv $TAG-tp bytes_sent_tcp)" -gt 0 ] ||
  fail "tcp: not every byte went by tcp (ipc $(rdv $TAG-tp bytes_moved_ipc), tcp $(rdv $TAG-tp bytes_sent_tcp))"
# GPUDirect RDMA's first step on this machine: can the GPU cache be handed to a NIC? The decode
# connector says so at start (rdma_dev.c); rdma_reg_test exports the cache as a dma-buf and checks
# its size (and registers it where an RDMA device is).
if [ -x "$B/tests/rdma_reg_test" ]; then
  line=$(grep -E "rdma: the GPU cache (exports|does not export) as a dma-buf" "$KVFERRY_RUN_DIR/$TAG-td/connector.log") ||
    fail "the connector did not say whether its GPU cache exports as a dma-buf"
  "$B/tests/rdma_reg_test" --instance $TAG-td >"$KVFERRY_RUN_DIR/rdma-reg.txt" 2>&1 ||
    fail "rdma_reg_test on the GPU cache: $(cat "$KVFERRY_RUN_DIR/rdma-reg.txt")"
  sed 's/^/  /' "$KVFERRY_RUN_DIR/rdma-reg.txt"
  pass "GPU cache and RDMA: ${line#*INFO }"
fi
json=$KVFERRY_RUN_DIR/tcp-kill.json
"$B/kvf-sim" --gpu --trace "$TRACE" --prefill $TAG-tp --decode $TAG-td --transport tcp --requests 100000 --layer-us 300 \
  --quiet --timeout-s 60 --json "$json" >"$KVFERRY_RUN_DIR/tcp-kill.txt" 2>&1 &
simpid=$!
sleep 1.5
kill_role connector $TAG-td
sleep 2
kill -TERM $simpid 2>/dev/null || true
wait $simpid || true
[ -f "$json" ] || fail "tcp: no summary after the connector kill: $(tail -n 5 "$KVFERRY_RUN_DIR/tcp-kill.txt")"
[ "$(jv "$json" corrupt)" = 0 ] && [ "$(jv "$json" unaccounted)" = 0 ] || fail "tcp: decode connector kill: corrupt or lost"
j=$(sim "tcp after the kill" tcp-after --prefill $TAG-tp --decode $TAG-td --transport tcp --requests 10 --layer-us 100)
all_finished "tcp after the kill" "$j" 10
down $TAG-tp; down $TAG-td
pass "GPU caches over tcp (staged through pinned host memory): 60 requests, contiguous and scattered blocks, verified on the GPU; the decode connector killed mid-transfer: $(jv "$json" finished) finished, none corrupt or lost, then 10 more finished"

# The sender SIGKILLed mid-transfer. Its copies in flight die with its context (the requests that
# had one end 'write error'); the engine's copies do not (they are waited for again).
for ex in engine sender; do
  d=$TAG-kd$ex p=$TAG-kp$ex
  up $d --role decode $L --executor $ex
  up $p --role prefill $L --executor $ex
  json=$KVFERRY_RUN_DIR/kill-$ex.json
  "$B/kvf-sim" --gpu --trace "$TRACE" --prefill $p --decode $d --requests 100000 --layer-us 300 --quiet --timeout-s 60 \
    --json "$json" >"$KVFERRY_RUN_DIR/kill-$ex.txt" 2>&1 &
  simpid=$!
  for k in 1 2 3 4; do
    sleep "0.$(( RANDOM % 7 + 3 ))"
    kill -0 $simpid 2>/dev/null || fail "$ex: the simulator stopped early: $(tail -n 5 "$KVFERRY_RUN_DIR/kill-$ex.txt")"
    kill_role sender $p
  done
  sleep 1
  kill -TERM $simpid 2>/dev/null || true
  rc=0; wait $simpid || rc=$?
  [ -f "$json" ] || fail "$ex: no summary from the simulator (rc $rc): $(tail -n 5 "$KVFERRY_RUN_DIR/kill-$ex.txt")"
  [ "$(jv "$json" corrupt)" = 0 ] || fail "$ex: sender kills: a request reported finished with bytes that differ, or twice"
  [ "$(jv "$json" unaccounted)" = 0 ] || fail "$ex: sender kills: $(jv "$json" unaccounted) requests without a status"
  [ "$(jv "$json" finished_but_failed_pairs)" = 0 ] || fail "$ex: sender kills: the two sides disagree"
  [ "$(jv "$json" finished)" -ge 10 ] || fail "$ex: sender kills: only $(jv "$json" finished) finished"
  pass "$ex executor: 4 sender SIGKILLs mid-transfer: $(jv "$json" finished) finished and verified, $(jv "$json" failed) failed with a status, none corrupt, none lost"
  if [ $ex = engine ]; then
    # The engine killed with its copies queued on its side stream, three times; then a new one.
    logs=()
    for run in 1 2 3; do
      log=$KVFERRY_RUN_DIR/engine-kill-$run.log
      logs+=("$log")
      "$B/kvf-sim" --gpu --trace "$TRACE" --prefill $p --decode $d --requests 100000 --layer-us 300 --quiet --late-pct 20 \
        --session-log "$log" --timeout-s 60 >"$KVFERRY_RUN_DIR/engine-kill-$run.txt" 2>&1 &
      esim=$!
      sleep "1.$(( RANDOM % 10 ))"
      kill -0 $esim 2>/dev/null || fail "engine run $run stopped early: $(tail -n 5 "$KVFERRY_RUN_DIR/engine-kill-$run.txt")"
      kill -KILL $esim
      wait $esim 2>/dev/null || true
    done
    log=$KVFERRY_RUN_DIR/engine-kill-last.log
    logs+=("$log")
    j=$(sim "engine killed, then a new one" engine-last --prefill $p --decode $d --requests 40 --layer-us 300 \
          --session-log "$log" --drain-previous-s 3)
    all_finished "engine killed, then a new one" "$j" 40
    NOPY=""
    if [ -x /usr/bin/python3 ]; then
      /usr/bin/python3 "$ROOT/tests/session_logs_check.py" "${logs[@]}" ||
        fail "requests of killed engine sessions did not end the same way on both sides"
      NOPY="; every killed session's requests ended the same way on both sides"
    else
      NOPY=" (no python3 here: the killed sessions' logs were not checked)"
    fi
    pass "engine (kvf-sim --gpu) killed 3 times with copies queued in its context: a new engine's 40 requests verified$NOPY"
  fi
  # The engine killed and attached again: its caches are as it left them.
  out=$KVFERRY_RUN_DIR/reattach-$ex
  seed=$(( (RANDOM << 15) | RANDOM ))
  "$B/tests/gpu_reattach_test" write $p $seed >"$out.write" 2>&1 &
  w=$!
  for _ in $(seq 600); do
    grep -q '^written' "$out.write" && break
    kill -0 $w 2>/dev/null || fail "gpu_reattach_test write: $(cat "$out.write")"
    sleep 0.1
  done
  grep -q '^written' "$out.write" || fail "gpu_reattach_test write did not finish: $(cat "$out.write")"
  kill -KILL $w
  wait $w 2>/dev/null || true
  "$B/tests/gpu_reattach_test" check $p $seed >"$out.check" 2>&1 ||
    fail "$ex: the engine attached again and found its caches changed: $(cat "$out.check")"
  pass "$ex: an engine SIGKILLed after writing its caches attached again and found them intact ($(cat "$out.check"))"
  down $p; down $d
done

# A peer on another GPU of this host: the same path, with peer access.
if [ "$NGPU" -ge 2 ]; then
  for ex in engine sender; do
    up $TAG-xd$ex --role decode $L --executor $ex --device 1
    up $TAG-xp$ex --role prefill $L --executor $ex --device 0
    j=$(sim "$ex: peer on GPU 1" x-$ex --prefill $TAG-xp$ex --decode $TAG-xd$ex --requests 30 --layer-us 100 --late-pct 20)
    all_finished "$ex: peer on GPU 1" "$j" 30
    down $TAG-xp$ex; down $TAG-xd$ex
  done
  pass "a peer on another GPU (prefill on GPU 0, decode on GPU 1), both executors: every byte verified"
else
  echo "skipped: a peer on another GPU (only one GPU visible)"
fi

# A Python engine through the package (python/kvferry) and PyTorch, both executors: the caches
# as torch tensors (no copy), layer-done on torch's stream. Skipped where python3 lacks either.
if python3 -c 'import torch, msgpack' 2>/dev/null; then
  for ex in engine sender; do
    up $TAG-yd$ex --role decode $L --executor $ex
    up $TAG-yp$ex --role prefill $L --executor $ex
    out=$KVFERRY_RUN_DIR/python-$ex.txt
    PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" python3 "$ROOT/tests/gpu_python_engine.py" \
      $TAG-yp$ex $TAG-yd$ex >"$out" 2>&1 || { cat "$out" >&2; fail "$ex: the Python engine on GPU caches"; }
    pass "$ex executor: $(grep '^ok:' "$out" | sed 's/^ok: //')"
    down $TAG-yp$ex; down $TAG-yd$ex
  done
else
  echo "skipped: a Python engine on GPU caches (python3 has no torch or no msgpack)"
fi

# Under MPS, as `tools/kvferry up --mps` starts it (a private pipe directory, so no other MPS user
# of this host is touched; stopped again at the end): --executor auto (the engine's context) and
# --executor sender.
MPSCTL=$(command -v nvidia-cuda-mps-control || true)
[ -z "$MPSCTL" ] && [ -x /usr/local/nvidia/bin/nvidia-cuda-mps-control ] && MPSCTL=/usr/local/nvidia/bin/nvidia-cuda-mps-control
if [ -n "$MPSCTL" ]; then
  export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/kvf-mps.XXXXXX)
  export CUDA_MPS_LOG_DIRECTORY=$KVFERRY_RUN_DIR/mps-log
  mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
  mps_quit() { echo quit | timeout 20 "$MPSCTL" >/dev/null 2>&1 || true; rm -rf "$CUDA_MPS_PIPE_DIRECTORY"; }
  AT_EXIT+=("'$ROOT/tools/kvferry' down --instance $TAG-mdauto --instance $TAG-mpauto --instance $TAG-mdsender --instance $TAG-mpsender >/dev/null 2>&1; mps_quit")
  for ex in auto sender; do
    want=$ex
    [ $ex = auto ] && want=engine
    up $TAG-md$ex --role decode $L --mps --executor $ex
    up $TAG-mp$ex --role prefill $L --mps --executor $ex
    "$B/kvf-ringdump" --instance $TAG-mp$ex | grep -q "copies in the $want's context" ||
      fail "under MPS, --executor $ex did not choose the $want's context"
    if [ $want = sender ]; then
      grep -q "under MPS" "$KVFERRY_RUN_DIR/$TAG-mp$ex/sender.log" ||
        fail "the sender does not see MPS: $(grep GPU "$KVFERRY_RUN_DIR/$TAG-mp$ex/sender.log")"
    fi
    j=$(sim "$want executor under MPS" mps$ex --prefill $TAG-mp$ex --decode $TAG-md$ex --requests 40 --layer-us 200 --late-pct 20)
    all_finished "$want executor under MPS" "$j" 40
    down $TAG-mp$ex; down $TAG-md$ex
  done
  mps_quit
  AT_EXIT=()
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  pass "up --mps started MPS; --executor auto chose the engine's context and --executor sender the sender's; 40 requests verified under MPS with each"
else
  echo "skipped: MPS (nvidia-cuda-mps-control is not installed)"
fi
echo "gpu_e2e_test: all passed"
