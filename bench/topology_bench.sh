#!/usr/bin/env bash
# Fan-in and fan-out against one pair, all measured in the same run on one host:
#   pair 1->1       one prefill instance into one decode instance: the reference
#   fan-in N->1     N prefill instances into one decode instance (one decode engine hands out
#                   the blocks of every source from one pool)
#   fan-out 1->N    one prefill instance into N decode instances (each request to the decode
#                   instance with the most free blocks)
# over ipc and over tcp on loopback. The pair is the topology's first prefill and first decode
# instance, run just before and just after it (A B A); each topology is judged against the
# mean of its two pair runs, so that the host's load drifting over the run (other work on the
# same CPUs) moves both. Two figures, each next to the pair's:
#   throughput      aggregate bytes moved per second with no compute time between layers
#                   (every engine as fast as it can go); target >= 0.9 x the pair's
#   transfer tail   last layer-done -> arrival, p50 and p99, one request per step at the pair's
#                   offered load: the pair's engine computes a layer in --layer-us (twice that
#                   over tcp); N prefill engines each take N times as long (they start a fraction
#                   of a layer apart), so the decode side receives what the pair's does. Late
#                   tasks off, so that p99 is not the trace's late tasks (e2e_bench.sh shows
#                   those). Target "unchanged", judged as p50 and p99 <= 1.2 x the pair's.
# Every instance runs llama-3.1-8b, one tp-8 rank (16 KiB block tensors, 1 MiB per block over
# 32 layers x K and V) with --cache-mib of cache (default 512: N + 1 instances are 3 (N + 1)
# processes and N + 1 caches on one host). kvf-sim verifies both ends of every block
# (--verify sample, as e2e_bench.sh), touches every cache page before its clock starts
# (--warm-caches), and fails unless every request finished (--strict); a first run of each
# topology's requests maps the peers' caches and opens the connections before the measured
# ones. With --quick about 3 minutes on 2 CPUs; without it three times the requests, and the time.
# Usage: bench/topology_bench.sh [--quick] [--fan N] [--cache-mib M] [--layer-us US]
#                                [--huge-pages auto|on|off]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=${KVFERRY_BUILD:-$ROOT/build}
N=60 FAN=8 MIB=512 LUS=3000 HUGE=auto
usage() { echo "Usage: bench/topology_bench.sh [--quick] [--fan N] [--cache-mib M] [--layer-us US] [--huge-pages auto|on|off]" >&2; exit 2; }
num() { [[ "${2:-}" =~ ^[0-9]+$ ]] && [ "$2" -ge "$3" ] && [ "$2" -le "$4" ] || { echo "topology_bench: $1 is a number from $3 to $4" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) N=20; shift ;;
    --fan) num "$1" "${2:-}" 2 16; FAN=$2; shift 2 ;;
    --cache-mib) num "$1" "${2:-}" 64 65536; MIB=$2; shift 2 ;;
    --layer-us) num "$1" "${2:-}" 100 100000; LUS=$2; shift 2 ;;
    --huge-pages)
      case "${2:-}" in auto|on|off) HUGE=$2; shift 2 ;;
        *) echo "topology_bench: --huge-pages is auto, on or off" >&2; exit 2 ;; esac ;;
    *) usage ;;
  esac
done
export KVFERRY_RUN_DIR=$(mktemp -d /tmp/kvferry-bench.XXXXXX)
export KVFERRY_TOKEN_FILE=$KVFERRY_RUN_DIR/token
STARTED=()
cleanup() {
  local a=(); for n in "${STARTED[@]}"; do a+=(--instance "$n"); done
  [ ${#a[@]} -gt 0 ] && "$ROOT/tools/kvferry" down "${a[@]}" >/dev/null 2>&1 || true
  rm -rf "$KVFERRY_RUN_DIR"
}
trap cleanup EXIT
up() {
  local n=$1; shift; STARTED+=("$n")
  "$ROOT/tools/kvferry" up --instance "$n" --huge-pages "$HUGE" "$@" >/dev/null 2>"$KVFERRY_RUN_DIR/up.err" ||
    { cat "$KVFERRY_RUN_DIR/up.err" >&2; exit 1; }
}
down() { local a=(); for n in "$@"; do a+=(--instance "$n"); done; "$ROOT/tools/kvferry" down "${a[@]}" >/dev/null 2>&1 || true; }
# j FILE KEY...: the keys' values from a JSON summary, space-separated, in one read of the file.
j() { /usr/bin/python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(*(d[k] for k in sys.argv[2:]))' "$@"; }
# spread FILE: the lowest and highest of the instances' own GiB/s on the side with more than one
spread() { /usr/bin/python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); r=[x["rate_bps"] for x in d["instances"] if x["role"]==("prefill" if d["prefill_instances"]>1 else "decode")]; print(round(min(r)/2**30,2), round(max(r)/2**30,2))' "$1"; }
py() { /usr/bin/python3 -c "print($1)"; }
# sim OUT ARGS...: one kvf-sim run, its JSON in OUT; its text shown if it fails
sim() {
  local out=$1; shift
  "$B/kvf-sim" --quiet --strict --verify sample --warm-caches --json "$out" "$@" >"$out.txt" 2>&1 ||
    { cat "$out.txt" >&2; echo "topology_bench: kvf-sim failed: $*" >&2; exit 1; }
}
MET=0 MISSED=()
target() { if [ "$2" = True ]; then MET=$((MET + 1)); else MISSED+=("$1"); fi; }

R=$KVFERRY_RUN_DIR
T=t$$
M="--model llama-3.1-8b --tp 8 --cache-mib $MIB"
echo "kvferry fan-in and fan-out against one pair: $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p' | head -n1), Linux $(uname -r), $(date -u +%F), --huge-pages $HUGE"
echo "llama-3.1-8b, one tp-8 rank (16 KiB block tensors), $MIB MiB of cache per instance; requests of the conversation trace: $((N * 3)) per throughput run (no compute time), $N per tail run (one request per step; the pair's engine computes a layer in $LUS us over ipc, $((2 * LUS)) us over tcp)"

# lus TRANSPORT NPRE: each prefill engine's compute time per layer in a tail run: the pair's
# load, shared by NPRE engines. Over tcp twice the time: at the ipc pace a tp-8 rank's requests
# load loopback tcp near its rate, and the tail is then queueing (e2e_bench.sh does the same).
lus() { local l=$LUS; [ "$1" = tcp ] && l=$((2 * LUS)); echo $((l * $2)); }
# run KIND TRANSPORT NPRE OUT ARGS...: one throughput (tp) or tail run
run() {
  local kind=$1 t=$2 npre=$3 out=$4; shift 4
  if [ "$kind" = tp ]; then
    sim "$out" "$@" --transport "$t" --requests $((N * 3)) --layer-us 0
  else
    sim "$out" "$@" --transport "$t" --requests "$N" --layer-us "$(lus "$t" "$npre")" --step-tokens 1 --late-pct 0
  fi
}
# stat KEY FILE...: the mean, lowest and highest of KEY over the runs' summaries
stat() { /usr/bin/python3 -c 'import json,sys; v=[json.load(open(f))[sys.argv[1]] for f in sys.argv[2:]]; print(sum(v)/len(v), min(v), max(v))' "$@"; }

P=(); D=()
for i in $(seq 0 $((FAN - 1))); do P+=("$T-p$i"); D+=("$T-d$i"); done
PAIR=(--prefill "${P[0]}" --decode "${D[0]}")
declare -A ROWS PAIR_TP PAIR_TAIL

# phase LABEL NPRE ARGS...: for each transport, a first run of the topology (the senders map the
# peers' caches, the connectors connect), then the pair, the topology, the pair again, for
# throughput and then for the tail: the topology against the mean of the two pair runs around
# it, so that the host's load drifting over the run (other work on the same CPUs) moves both.
phase() {
  local label=$1 npre=$2; shift 2
  local t f kind rate rps a b50 b99 a50 a99 lo hi
  for t in ipc tcp; do
    f=$R/${label%% *}-$t
    sim "$f.warm.json" "$@" --transport "$t" --requests $((N * 3)) --layer-us 0
    for kind in tp tail; do
      run $kind "$t" 1 "$f.a1.$kind.json" "${PAIR[@]}"
      run $kind "$t" "$npre" "$f.b.$kind.json" "$@"
      run $kind "$t" 1 "$f.a2.$kind.json" "${PAIR[@]}"
      echo "  measured: $t $label, $kind" >&2
    done
    PAIR_TP[$t]+=" $f.a1.tp.json $f.a2.tp.json"
    PAIR_TAIL[$t]+=" $f.a1.tail.json $f.a2.tail.json"
    read -r rate rps < <(j "$f.b.tp.json" rate_bps requests_per_s)
    read -r a _ < <(stat rate_bps "$f.a1.tp.json" "$f.a2.tp.json")
    read -r b50 b99 < <(j "$f.b.tail.json" tail_p50_ns tail_p99_ns)
    read -r a50 _ < <(stat tail_p50_ns "$f.a1.tail.json" "$f.a2.tail.json")
    read -r a99 _ < <(stat tail_p99_ns "$f.a1.tail.json" "$f.a2.tail.json")
    read -r lo hi < <(spread "$f.b.tp.json")
    target "$label $t throughput >= 0.9 x pair" "$(py "$rate/$a >= 0.9")"
    target "$label $t tail p50 <= 1.2 x pair" "$(py "$b50/$a50 <= 1.2")"
    target "$label $t tail p99 <= 1.2 x pair" "$(py "$b99/$a99 <= 1.2")"
    ROWS[$t]+="| $label | $(py "round($rate/2**30,2)") | $(py "round($rate/$a,2)") (pair $(py "round($a/2**30,2)")) | $(py "round($rps,1)") | $lo to $hi | $(py "round($b50/1e3)") | $(py "round($b50/$a50,2)") (pair $(py "round($a50/1e3)")) | $(py "round($b99/1e3)") | $(py "round($b99/$a99,2)") (pair $(py "round($a99/1e3)")) |"$'\n'
  done
}

up "${D[0]}" --role decode $M
up "${P[0]}" --role prefill $M
for n in "${P[@]:1}"; do up "$n" --role prefill $M; done
phase "fan-in $FAN->1" "$FAN" $(for n in "${P[@]}"; do printf -- '--prefill %s ' "$n"; done) --decode "${D[0]}"
down "${P[@]:1}"
for n in "${D[@]:1}"; do up "$n" --role decode $M; done
phase "fan-out 1->$FAN" 1 --prefill "${P[0]}" $(for n in "${D[@]}"; do printf -- '--decode %s ' "$n"; done)
down "${D[@]}" "${P[0]}"

for t in ipc tcp; do
  echo
  [ $t = ipc ] && echo "## Host path (ipc)" || echo "## TCP on loopback"
  echo "| topology | GiB/s, all instances | / pair (the pair runs around it) | requests/s | per instance GiB/s, lowest to highest | tail p50 us | / pair | tail p99 us | / pair |"
  echo "|---|---|---|---|---|---|---|---|---|"
  # shellcheck disable=SC2086 # the lists of files
  {
    read -r m lo hi < <(stat rate_bps ${PAIR_TP[$t]})
    read -r rps _ < <(stat requests_per_s ${PAIR_TP[$t]})
    read -r m50 lo50 hi50 < <(stat tail_p50_ns ${PAIR_TAIL[$t]})
    read -r m99 lo99 hi99 < <(stat tail_p99_ns ${PAIR_TAIL[$t]})
  }
  echo "| pair 1->1, 4 runs (reference) | $(py "round($m/2**30,2)") ($(py "round($lo/2**30,2)") to $(py "round($hi/2**30,2)")) | 1 | $(py "round($rps,1)") | - | $(py "round($m50/1e3)") ($(py "round($lo50/1e3)") to $(py "round($hi50/1e3)")) | 1 | $(py "round($m99/1e3)") ($(py "round($lo99/1e3)") to $(py "round($hi99/1e3)")) | 1 |"
  printf '%s' "${ROWS[$t]}"
done
echo
echo "targets: $MET of $((MET + ${#MISSED[@]})) met$([ ${#MISSED[@]} -gt 0 ] && printf '; missed: %s' "$(IFS=';'; echo "${MISSED[*]}")")"
