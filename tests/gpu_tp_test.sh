#!/usr/bin/env bash
# Tensor-parallel groups of different sizes and block sizes on GPU caches, on one GPU: for each
# case a prefill group of p instances and a decode group of d (one per rank, all --backend cuda on
# GPU 0), kvf-sim in GPU mode driving them (each prefill rank's layer kernels write every head's
# rows keyed by request, model head, token, layer and tensor; each decode rank's check kernel
# compares every row of every head of every block it holds). The ratios 1->2, 2->8, 8->2 and 4->4
# with 32 -> 16 tokens per block, for llama-3.1-8b (8 kv heads), a model of 4 kv heads (fewer than
# the 8 ranks: heads replicated) and deepseek-v3-mla (the latent on every rank), over ipc with
# both executors (--executor engine: the engine's context copies the head slices; sender: the
# sender's) and over tcp. Every request must finish and the verified byte count must be exactly
# the prompts' tokens x every decode rank's heads x layers x tensors x one head's row; with the
# engine executor over ipc the engines must have copied (their claimed layers counted, no error).
# Usage: tests/gpu_tp_test.sh [--list] [--host] [--only REGEX] [--requests N]
#   --list       print each case with its expected byte count and exit (no GPU needed)
#   --host       run the cases on host caches (kvf-sim's host mixed mode; executors do not apply)
#   --only RE    the cases whose name matches RE (bash regex)
# Exit 77 (skipped) when no GPU is visible and --host / --list are not given.
HERE=$(cd "$(dirname "$0")" && pwd)
B0=${KVFERRY_BUILD:-$HERE/../build}
TRACE=$HERE/../data/mooncake-conversation-2000.jsonl
MAXTOK=700
N=12
LIST=0 HOST=0 ONLY=""
usage() { echo "gpu_tp_test: $1 (usage: gpu_tp_test.sh [--list] [--host] [--only REGEX] [--requests N])" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --list) LIST=1; shift ;;
    --host) HOST=1; shift ;;
    --only) [ $# -ge 2 ] || usage "--only needs a regex"; ONLY=$2; shift 2 ;;
    --requests)
      [ $# -ge 2 ] && [[ "$2" =~ ^[1-9][0-9]{0,3}$ ]] || usage "--requests takes 1 to 9999"
      N=$2; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) usage "unknown option '$1'" ;;
  esac
done
[ -r "$TRACE" ] || { echo "gpu_tp_test: no trace $TRACE" >&2; exit 1; }

# Model shapes: kv heads (all ranks), layers, tensors, head dim (bf16: 2 bytes a value), and how
# `up` names the shape.
declare -A HEADS=([llama]=8 [kv4]=4 [mla]=1) LAYERS=([llama]=32 [kv4]=16 [mla]=61)
declare -A TENSORS=([llama]=2 [kv4]=2 [mla]=1) HDIM=([llama]=128 [kv4]=128 [mla]=576)
declare -A SHAPE=([llama]="--model llama-3.1-8b" [kv4]="--layers 16 --kv-heads 4 --head-dim 128 --dtype bf16"
                  [mla]="--model deepseek-v3-mla")

# The cases: NAME MODEL P D PREFILL_BLOCK DECODE_BLOCK TRANSPORT EXECUTOR
CASES=(
  "llama-1-2-ipc-engine    llama 1 2 64 64 ipc engine"
  "llama-1-2-tcp           llama 1 2 64 64 tcp sender"
  "llama-2-8-ipc-engine    llama 2 8 64 64 ipc engine"
  "llama-2-8-ipc-sender    llama 2 8 64 64 ipc sender"
  "llama-8-2-ipc-engine    llama 8 2 64 64 ipc engine"
  "llama-8-2-tcp           llama 8 2 64 64 tcp engine"
  "llama-4-4-32-16-engine  llama 4 4 32 16 ipc engine"
  "llama-4-4-32-16-sender  llama 4 4 32 16 ipc sender"
  "kv4-2-8-ipc-engine      kv4   2 8 64 64 ipc engine"
  "kv4-8-2-tcp             kv4   8 2 64 64 tcp sender"
  "kv4-1-2-32-16-sender    kv4   1 2 32 16 ipc sender"
  "mla-2-8-ipc-engine      mla   2 8 64 64 ipc engine"
  "mla-8-2-ipc-sender      mla   8 2 64 64 ipc sender"
  "mla-1-2-tcp             mla   1 2 64 64 tcp engine"
  "mla-4-4-32-16-engine    mla   4 4 32 16 ipc engine"
)

# per_token MODEL D: bytes of one token on all d decode ranks together: each rank's heads (the
# model's split over d, one replicated head each when d exceeds them) x layers x tensors x row.
per_token() {
  local m=$1 d=$2 h=${HEADS[$1]} kv
  if (( d <= h )); then kv=$((h / d)); else kv=1; fi
  echo $((d * kv * LAYERS[$m] * TENSORS[$m] * HDIM[$m] * 2))
}

# want_bytes N PER_TOKEN: every token of the first N prompts with tokens (clipped to MAXTOK).
want_bytes() {
  /usr/bin/python3 - "$TRACE" "$1" "$MAXTOK" "$2" <<'PY'
import json, sys
path, n, cap, per = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
toks = []
for line in open(path):
    if len(toks) == n:
        break
    v = json.loads(line).get("input_length", 0)
    if v:
        toks.append(min(v, cap))
print(sum(toks) * per)
PY
}

# Check the table before anything runs: known model, groups that split its heads, block sizes that
# divide one another, other block sizes over ipc only, a known transport and executor.
for c in "${CASES[@]}"; do
  set -- $c
  name=$1 m=$2 p=$3 d=$4 pb=$5 db=$6 tr=$7 ex=$8
  [ -n "${HEADS[$m]:-}" ] || { echo "gpu_tp_test: case $name: unknown model $m" >&2; exit 1; }
  for t in $p $d; do
    h=${HEADS[$m]}
    if (( t <= h && h % t != 0 )) || (( t > h && t % h != 0 )); then
      echo "gpu_tp_test: case $name: tp $t does not split $h kv heads" >&2; exit 1
    fi
  done
  (( pb % db == 0 || db % pb == 0 )) || { echo "gpu_tp_test: case $name: block sizes" >&2; exit 1; }
  [ "$pb" = "$db" ] || [ "$tr" = ipc ] || { echo "gpu_tp_test: case $name: other block sizes over $tr" >&2; exit 1; }
  case "$tr/$ex" in ipc/engine|ipc/sender|tcp/engine|tcp/sender) ;; *) echo "gpu_tp_test: case $name: $tr/$ex" >&2; exit 1 ;; esac
done
set --

selected() { [ -z "$ONLY" ] || [[ "$1" =~ $ONLY ]]; }

if [ $LIST = 1 ]; then
  printf '%-24s %-6s %3s %3s %9s %-4s %-7s %14s\n' case model p d blocks over exec verified_bytes
  for c in "${CASES[@]}"; do
    set -- $c
    selected "$1" || continue
    printf '%-24s %-6s %3s %3s %9s %-4s %-7s %14s\n' "$1" "$2" "$3" "$4" "$5->$6" "$7" "$8" \
      "$(want_bytes "$N" "$(per_token "$2" "$4")")"
  done
  exit 0
fi

if [ $HOST = 0 ]; then
  NGPU=$("$B0/kvf-ctl" gpus 2>/dev/null || echo 0)
  if ! [ "${NGPU:-0}" -ge 1 ] 2>/dev/null; then
    echo "gpu_tp_test: skipped: no GPU visible ($("$B0/kvf-ctl" gpus 2>&1 >/dev/null | head -n1))"
    exit 77
  fi
fi
source "$HERE/lib.sh"
cd "$ROOT"
if [ $HOST = 0 ]; then
  export KVFERRY_BACKEND=cuda
  MIB=1024 SIMX=(--gpu)
else
  export KVFERRY_BACKEND=host
  MIB=256 SIMX=()
fi
rdv() { "$B/kvf-ringdump" --instance "$1" --json | sed -n "s/.*\"$2\":\([0-9]*\).*/\1/p" | head -n1; }

t_all=$(date +%s)
for c in "${CASES[@]}"; do
  set -- $c
  name=$1 m=$2 p=$3 d=$4 pb=$5 db=$6 tr=$7 ex=$8
  selected "$name" || continue
  t0=$(date +%s)
  P=() D=() upx=()
  [ $HOST = 1 ] || upx=(--executor "$ex")
  # shellcheck disable=SC2206 # the shape is words
  shape=(${SHAPE[$m]})
  for ((k = 0; k < d; k++)); do
    D+=("$TAG-$name-d$k")
    up "${D[k]}" --role decode "${shape[@]}" --tp "$d" --rank $k --nranks "$d" --block-size "$db" \
      --cache-mib $MIB "${upx[@]}"
  done
  for ((k = 0; k < p; k++)); do
    P+=("$TAG-$name-p$k")
    up "${P[k]}" --role prefill "${shape[@]}" --tp "$p" --rank $k --nranks "$p" --block-size "$pb" \
      --cache-mib $MIB "${upx[@]}"
  done
  if [ $HOST = 0 ] && [ "$tr" = ipc ]; then
    "$B/kvf-ringdump" --instance "${P[0]}" | grep -q "cuda backend (GPU [0-9]*, copies in the $ex's context)" ||
      fail "$name: ring-dump does not say the cache is on a GPU with the $ex executor"
  fi
  json=$KVFERRY_RUN_DIR/$name.json txt=$KVFERRY_RUN_DIR/$name.txt
  plist=$(IFS=,; echo "${P[*]}") dlist=$(IFS=,; echo "${D[*]}")
  "$B/kvf-sim" "${SIMX[@]}" --prefill "$plist" --decode "$dlist" --prefill-tp "$p" --decode-tp "$d" \
    --requests "$N" --trace "$TRACE" --layer-us 50 --transport "$tr" --prefix-pct 0 \
    --max-tokens $MAXTOK --strict --quiet --timeout-s 60 --json "$json" >"$txt" 2>&1 ||
    { cat "$txt" >&2; fail "$name: kvf-sim failed"; }
  [ "$(json_get "$json" ok)" = True ] || { cat "$txt" >&2; fail "$name: not ok"; }
  [ "$(json_get "$json" finished)" = "$N" ] || fail "$name: $(json_get "$json" finished) of $N finished"
  [ "$(json_get "$json" corrupt)" = 0 ] || fail "$name: corrupt requests"
  [ "$(json_get "$json" gpu)" = "$([ $HOST = 0 ] && echo True || echo False)" ] ||
    fail "$name: kvf-sim's GPU mode is $(json_get "$json" gpu)"
  [ "$(json_get "$json" prefill_tp)" = "$p" ] && [ "$(json_get "$json" decode_tp)" = "$d" ] ||
    fail "$name: the JSON's groups"
  grep -q "every head of every token checked on every decode rank" "$txt" ||
    { cat "$txt" >&2; fail "$name: the summary has no tp line"; }
  want=$(want_bytes "$N" "$(per_token "$m" "$d")") got=$(json_get "$json" verified_bytes)
  [ "$got" = "$want" ] || fail "$name: $got bytes verified, not $want (every head of every token)"
  extra=""
  if [ $HOST = 0 ] && [ "$tr" = ipc ] && [ "$ex" = engine ]; then
    claimed=0
    for k in "${P[@]}"; do
      [ "$(rdv "$k" copy_errors)" = 0 ] || fail "$name: engine executor of $k reported copy errors"
      claimed=$((claimed + $(rdv "$k" layers_claimed)))
    done
    [ $claimed -gt 0 ] || fail "$name: the engines claimed no layer (the sender copied everything)"
    extra=", $claimed layers copied in the engines' contexts"
  fi
  for k in "${P[@]}" "${D[@]}"; do down "$k"; done
  pass "$name: $m tp $p -> $d, $pb -> $db tokens/block over $tr ($([ $HOST = 0 ] && echo "GPU, $ex executor" || echo host)): $N requests, $got bytes verified$extra ($(( $(date +%s) - t0 )) s)"
done
echo "gpu_tp_test: ok ($(( $(date +%s) - t_all )) s)"
