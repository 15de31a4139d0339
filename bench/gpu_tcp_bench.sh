#!/usr/bin/env bash
# gpu_tcp_bench.sh OUTDIR [ROUNDS [scatter]]: GPU caches over tcp against host caches over tcp, on one
# machine with a GPU, run alternately (ROUNDS each, default 3). Each run: a decode and a prefill
# instance on this host (tools/kvferry up, llama-3.1-8b tp 8, 3 GiB of cache each), kvf-sim
# --transport tcp between them (the connectors' data over loopback tcp), 120 requests of the
# conversation trace, --layer-us 0 (the transfer's rate, not the simulated compute's), then
# the prefill instance's counters (bytes_sent_tcp and bytes_moved_ipc: every byte went by tcp)
# and both instances stopped. --backend cuda: kvf-sim's GPU mode, caches in GPU memory, every
# byte verified on the GPU, the connectors staging through rings of pinned host buffers
# (common/cache_stage.c). `scatter`: blocks handed out in random order (kvf-sim --scatter), so
# every frame is a gathered one of up to 64 runs and every staging copy scatters or gathers.
# --backend host: host caches, --verify sample (both ends of every block: full verification
# on the CPU would make the simulator, not the transport, the bottleneck, as bench/e2e_bench.sh
# says).
#
# Prints one line per run and the ratio of the medians (cuda / host); OUTDIR keeps each run's
# output, JSON summary and ring-dump. Exit 0 every run verified and all by tcp, 1 a run failed,
# 2 usage, 77 no GPU.
# Raw output goes to OUTDIR, outside docs/: docs/results/ keeps only the small summaries that
# docs/BENCHMARKS.md ("Where the summaries are") describes; .gitignore refuses run output there.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: bench/gpu_tcp_bench.sh OUTDIR [ROUNDS [scatter]]" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd) ROUNDS=${2:-3}
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || { echo "no GPU"; exit 77; }
B=${KVFERRY_BUILD:-$ROOT/build} K=$ROOT/tools/kvferry
export KVFERRY_RUN_DIR=$OUT/run KVFERRY_TOKEN_FILE=$OUT/run/token
mkdir -p "$KVFERRY_RUN_DIR" && chmod 700 "$KVFERRY_RUN_DIR"
SHAPE=(--model llama-3.1-8b --tp 8 --cache-mib 3072)
SIM=(--transport tcp --requests 120 --layer-us 0 --trace "$ROOT/data/mooncake-conversation-2000.jsonl")
[ "${3:-}" = scatter ] && SIM+=(--scatter)
ctr() { /usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["counters"][sys.argv[2]])' "$1" "$2"; }
fails=0
for r in $(seq 1 "$ROUNDS"); do
  for be in cuda host; do
    j=$OUT/$be-$r.json d=gtd$$-$be-$r p=gtp$$-$be-$r mode=(--gpu)
    [ "$be" = host ] && mode=(--verify sample)
    "$K" up --instance "$d" --role decode "${SHAPE[@]}" --backend "$be" >"$OUT/$be-$r.txt" 2>&1 &&
      "$K" up --instance "$p" --role prefill "${SHAPE[@]}" --backend "$be" >>"$OUT/$be-$r.txt" 2>&1 &&
      timeout --kill-after=10 150 "$B/kvf-sim" "${mode[@]}" --prefill "$p" --decode "$d" "${SIM[@]}" \
        --json "$j" >>"$OUT/$be-$r.txt" 2>&1
    rc=$?
    "$B/kvf-ringdump" --instance "$p" --json >"$OUT/$be-$r.ringdump.json" 2>/dev/null
    tcp=$(ctr "$OUT/$be-$r.ringdump.json" bytes_sent_tcp 2>/dev/null || echo ?)
    ipc=$(ctr "$OUT/$be-$r.ringdump.json" bytes_moved_ipc 2>/dev/null || echo ?)
    "$K" down --instance "$p" --instance "$d" >/dev/null 2>&1
    rate=$(/usr/bin/python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("%.3f" % (d["rate_bps"] / 2**30) if d["ok"] else "bad")' "$j" 2>/dev/null || echo none)
    [ "$rc" = 0 ] && [ "$rate" != bad ] && [ "$rate" != none ] && [ "$ipc" = 0 ] && [ "$tcp" != 0 ] || fails=$((fails + 1))
    printf 'round %s  %-4s  rc=%s  %s GiB/s  (prefill counters: bytes_sent_tcp %s, bytes_moved_ipc %s)\n' \
      "$r" "$be" "$rc" "$rate" "$tcp" "$ipc" | tee -a "$OUT/summary.txt"
  done
done
/usr/bin/python3 - "$OUT" "$ROUNDS" <<'PY' | tee -a "$OUT/summary.txt"
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def rates(be):
    v = []
    for r in range(1, rounds + 1):
        try:
            d = json.load(open("%s/%s-%d.json" % (out, be, r)))
            if d["ok"]:
                v.append(d["rate_bps"])
        except Exception:
            pass
    return v
c, h = rates("cuda"), rates("host")
if c and h:
    print("median: cuda %.3f GiB/s, host %.3f GiB/s, cuda/host %.2f (target >= 0.85)" %
          (statistics.median(c) / 2**30, statistics.median(h) / 2**30, statistics.median(c) / statistics.median(h)))
else:
    print("no ratio: a backend had no verified run")
PY
[ "$fails" = 0 ]
