#!/usr/bin/env bash
# What a request costs kvferry's own processes: CPU time (utime + stime of every role of both
# instances, from /proc/PID/stat) and ring records (every ring of both segments), per request,
# for one or more builds run alternately in the same session, so a change is judged against the
# build before it on the same machine at the same time.
#
#   bench/cost_bench.sh [--requests N] [--rounds R] [--transport ipc|tcp|both]
#                       [--layer-wait paced|spin|auto] [--max-tokens N] BUILD_DIR [BUILD_DIR...]
#
# Each round runs every build once per transport: a decode and a prefill instance
# (llama-3.1-8b, one rank of tp 8, 256 MiB caches), kvf-sim moves N requests of the conversation
# trace clipped to --max-tokens (default 256: small requests, so the copies' own memcpy does not
# drown what the processes spend on each request), every byte verified; the roles' CPU is read before and after kvf-sim. The default
# --layer-wait paced keeps the sender from polling while it waits for layers: a polling sender's
# CPU is the run's wall time and would hide what the work itself costs.
# Prints one line per (build, transport, round) and the median of the rounds per (build,
# transport), with lscpu's model line.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
N=400 ROUNDS=3 TOKENS=256 TRANSPORTS="ipc tcp" WAIT=paced BUILDS=()
usage() { echo "Usage: bench/cost_bench.sh [--requests N] [--rounds R] [--transport ipc|tcp|both] [--layer-wait paced|spin|auto] [--max-tokens N] BUILD_DIR..." >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) N=${2:?}; shift 2 ;;
    --rounds) ROUNDS=${2:?}; shift 2 ;;
    --transport) case "${2:-}" in ipc|tcp) TRANSPORTS=$2 ;; both) TRANSPORTS="ipc tcp" ;; *) usage ;; esac; shift 2 ;;
    --layer-wait) WAIT=${2:?}; shift 2 ;;
    --max-tokens) TOKENS=${2:?}; shift 2 ;;
    -h|--help) usage ;;
    -*) usage ;;
    *) [ -x "$1/kvf-sender" ] || { echo "cost_bench: $1 has no kvf-sender (not a build directory?)" >&2; exit 2; }
       BUILDS+=("$(cd "$1" && pwd)"); shift ;;
  esac
done
[ ${#BUILDS[@]} -gt 0 ] || usage
export KVFERRY_RUN_DIR=$(mktemp -d /tmp/kvferry-cost.XXXXXX)
export KVFERRY_TOKEN_FILE=$KVFERRY_RUN_DIR/token
export KVFERRY_BACKEND=host
STARTED=()
cleanup() {
  local a=(); for n in "${STARTED[@]}"; do a+=(--instance "$n"); done
  [ ${#a[@]} -gt 0 ] && "$ROOT/tools/kvferry" down "${a[@]}" >/dev/null 2>&1 || true
  rm -rf "$KVFERRY_RUN_DIR"
}
trap cleanup EXIT
# roles_json BUILD INSTANCE: ring-dump's JSON of the instance
roles_json() { "$1/kvf-ringdump" --instance "$2" --json; }
# snapshot BUILD INSTANCE...: a JSON object: CPU ticks per "instance/role" and "records", the
# ring records of every ring of the instances
snapshot() {
  local b=$1; shift
  local files=()
  for i in "$@"; do roles_json "$b" "$i" >"$KVFERRY_RUN_DIR/$i.json"; files+=("$KVFERRY_RUN_DIR/$i.json"); done
  /usr/bin/python3 - "${files[@]}" <<'EOF'
import json, sys
out = {"records": 0}
for f in sys.argv[1:]:
    d = json.load(open(f))
    for r in d["roles"]:
        if r["role"] == "engine" or not r["alive"]:
            continue
        with open(f"/proc/{r['pid']}/stat") as s:
            fields = s.read().rsplit(")", 1)[1].split()
        out[f"{d['instance']}/{r['role']}"] = int(fields[11]) + int(fields[12])  # utime, stime
    out["records"] += sum(g["records_written"] for g in d["rings"])
print(json.dumps(out))
EOF
}
HZ=$(getconf CLK_TCK)
echo "cost_bench: $N requests of at most $TOKENS tokens per run, $ROUNDS rounds, --layer-wait $WAIT; $(lscpu | grep 'Model name' | sed 's/  */ /g')"
printf '%-40s %-4s %5s %10s %12s %7s  %s\n' build tr round "cpu us/req" "records/req" "wall s" "cpu us/req by role (p: prefill, d: decode)"
RES=$KVFERRY_RUN_DIR/results
: >"$RES"
k=0
for ((r = 1; r <= ROUNDS; r++)); do
  for b in "${BUILDS[@]}"; do
    for t in $TRANSPORTS; do
      k=$((k + 1))
      d=cd$k-d p=cd$k-p
      STARTED+=("$d" "$p")
      KVFERRY_BUILD=$b "$ROOT/tools/kvferry" up --instance "$d" --role decode --model llama-3.1-8b --tp 8 \
        --cache-mib 256 --layer-wait "$WAIT" >/dev/null 2>&1
      KVFERRY_BUILD=$b "$ROOT/tools/kvferry" up --instance "$p" --role prefill --model llama-3.1-8b --tp 8 \
        --cache-mib 256 --layer-wait "$WAIT" >/dev/null 2>&1
      snapshot "$b" "$d" "$p" >"$KVFERRY_RUN_DIR/s0.json"
      t0=$(date +%s.%N)
      "$b/kvf-sim" --prefill "$p" --decode "$d" --requests "$N" --max-tokens "$TOKENS" --transport "$t" --quiet \
        --json "$KVFERRY_RUN_DIR/sim.json" >"$KVFERRY_RUN_DIR/sim.out" 2>&1 ||
        { cat "$KVFERRY_RUN_DIR/sim.out" >&2; echo "cost_bench: kvf-sim failed ($b, $t)" >&2; exit 1; }
      t1=$(date +%s.%N)
      snapshot "$b" "$d" "$p" >"$KVFERRY_RUN_DIR/s1.json"
      KVFERRY_BUILD=$b "$ROOT/tools/kvferry" down --instance "$p" --instance "$d" >/dev/null 2>&1
      read -r cpu recs wall roles < <(/usr/bin/python3 - "$KVFERRY_RUN_DIR/s0.json" "$KVFERRY_RUN_DIR/s1.json" \
        "$N" "$HZ" "$t0" "$t1" "$p" <<'EOF'
import json, sys
a, b = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
n, hz, t0, t1, p = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6]), sys.argv[7]
us = lambda k: (b.get(k, 0) - a.get(k, 0)) * 1e6 / hz / n
roles = [k for k in b if k != "records"]
cpu = sum(us(k) for k in roles)
short = ",".join(f"{'p' if k.startswith(p + '/') else 'd'}-{k.split('/')[1]}={us(k):.0f}" for k in sorted(roles))
print(f"{cpu:.1f} {(b['records'] - a['records']) / n:.2f} {t1 - t0:.2f} {short}")
EOF
)
      printf '%-40s %-4s %5s %10s %12s %7s  %s\n' "$b" "$t" "$r" "$cpu" "$recs" "$wall" "$roles"
      echo "$b $t $cpu $recs" >>"$RES"
    done
  done
done
echo
echo "median of $ROUNDS rounds:"
/usr/bin/python3 - "$RES" <<'EOF'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    b, t, cpu, recs = line.split()
    rows.setdefault((b, t), []).append((float(cpu), float(recs)))
first = {}
for (b, t), v in rows.items():
    cpu = statistics.median(x[0] for x in v)
    recs = statistics.median(x[1] for x in v)
    ref = first.setdefault(t, cpu)
    print(f"  {b:40s} {t:4s} cpu {cpu:9.1f} us/req ({cpu / ref:.2f} x the first build)  ring records {recs:.2f}/req")
EOF
