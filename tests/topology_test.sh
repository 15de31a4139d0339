#!/usr/bin/env bash
# Topologies beyond one pair, on one host with real processes: three prefill instances into one
# decode instance (fan-in: one decode engine hands out the blocks of all three sources from one
# pool) and one prefill instance into three decode instances (fan-out: the prefill engine sends
# each request to the decode instance with the most free blocks), over ipc and over tcp.
# kvf-sim verifies every byte of every request on its decode instance, checks that each arrival
# lands on the decode instance that reserved its blocks and names the prefill instance that sent
# it, and fails unless every request finished (it is strict with more than one instance per side).
# Here: every instance's own count of finished requests equals the requests it prefilled or
# received, and those add up to the requests sent.
source "$(dirname "$0")/lib.sh"
cd "$ROOT"

N=30
L="--model llama-3.1-8b --tp 8 --cache-mib 128" # 128 blocks of 1 MiB (32 layers x K, V x 16 KiB)
for i in 0 1 2; do
  up $TAG-p$i --role prefill $L
  up $TAG-d$i --role decode $L
done

# check WHAT JSON PREFILLS DECODES: the run's summary against the topology it ran.
check() {
  /usr/bin/python3 - "$@" <<'PY' || fail "$1"
import json, sys
what, path, npre, ndec, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
d = json.load(open(path))
bad = []
def want(cond, msg):
    if not cond:
        bad.append(msg)
want(d["ok"] is True and d["strict"] is True, "not ok (or not strict)")
want(d["requests"] == n and d["finished"] == n, f"{d['finished']} of {d['requests']} finished, want {n}")
want(d["corrupt"] == 0 and d["unaccounted"] == 0 and d["failed"] == 0,
     f"corrupt {d['corrupt']}, unaccounted {d['unaccounted']}, failed {d['failed']}")
want(d["verified_bytes"] > 0 and d["verified_bytes"] >= d["bytes"],
     f"verified {d['verified_bytes']} of {d['bytes']} bytes")
want((d["prefill_instances"], d["decode_instances"]) == (npre, ndec),
     f"{d['prefill_instances']} prefill and {d['decode_instances']} decode instances, want {npre} and {ndec}")
inst = d["instances"]
want(len(inst) == npre + ndec, f"{len(inst)} instance rows")
for role, count in (("prefill", npre), ("decode", ndec)):
    rows = [x for x in inst if x["role"] == role]
    want(len(rows) == count, f"{len(rows)} {role} rows, want {count}")
    want(sum(x["requests"] for x in rows) == n, f"the {role} instances' requests add up to "
         f"{sum(x['requests'] for x in rows)}, want {n}")
    want(sum(x["bytes"] for x in rows) == d["bytes"], f"the {role} instances' bytes do not add up")
    for x in rows:
        want(x["requests"] > 0, f"{role} {x['name']}: no request")
        want(x["finished"] == x["requests"] and x["failed"] == 0 and x["unaccounted"] == 0,
             f"{role} {x['name']}: {x['finished']} of {x['requests']} finished, {x['failed']} failed")
        want(x["tail_p50_ns"] > 0, f"{role} {x['name']}: no tail")
# Fan-in: request i is prefilled by prefill instance i mod npre.
if npre > 1:
    for k, x in enumerate(x for x in inst if x["role"] == "prefill"):
        want(x["requests"] == len(range(k, n, npre)), f"prefill {x['name']}: {x['requests']} requests")
if bad:
    print(f"{what}: " + "; ".join(bad), file=sys.stderr)
    sys.exit(1)
print(" ".join(f"{x['name']} {x['finished']}" for x in inst))
PY
}

for t in ipc tcp; do
  for topo in "fan-in 3->1|--prefill $TAG-p0 --prefill $TAG-p1 --prefill $TAG-p2 --decode $TAG-d0|3|1" \
              "fan-out 1->3|--prefill $TAG-p0 --decode $TAG-d0 --decode $TAG-d1 --decode $TAG-d2|1|3"; do
    IFS='|' read -r what args npre ndec <<<"$topo"
    name=${what%% *}-$t json=$KVFERRY_RUN_DIR/$name.json txt=$KVFERRY_RUN_DIR/$name.txt
    # shellcheck disable=SC2086 # $args: the instances' options
    "$B/kvf-sim" --quiet --json "$json" --timeout-s 60 --transport $t $args --requests $N \
      --layer-us 100 --late-pct 20 --prefix-pct 30 >"$txt" 2>&1 || { cat "$txt" >&2; fail "$what over $t: kvf-sim failed"; }
    rows=$(check "$what over $t" "$json" "$npre" "$ndec" "$N") || { cat "$txt" >&2; exit 1; }
    pass "$what over $t: $N requests, every byte verified; finished per instance: $rows"
  done
done

# The same decode engine's blocks for several sources at once, with chunked prefill and
# cancels: every request either finished (verified) or ended 'cancelled' after kvf-sim
# cancelled it; nothing else fails (strict), nothing is corrupt.
j=$KVFERRY_RUN_DIR/fan-in-chunked.json
"$B/kvf-sim" --quiet --json "$j" --timeout-s 60 --prefill $TAG-p0 --prefill $TAG-p1 --prefill $TAG-p2 \
  --decode $TAG-d0 --requests $N --layer-us 100 --chunk-tokens 1000 --step-tokens 3000 --cancel-pct 20 \
  >"$KVFERRY_RUN_DIR/fan-in-chunked.txt" 2>&1 || { cat "$KVFERRY_RUN_DIR/fan-in-chunked.txt" >&2; fail "fan-in, chunked, cancels: kvf-sim failed"; }
f=$(json_get "$j" finished) c=$(json_get "$j" cancelled)
[ $((f + c)) = $N ] && [ "$(json_get "$j" corrupt)" = 0 ] && [ "$(json_get "$j" unexpected_failures)" = 0 ] ||
  fail "fan-in, chunked, cancels: $f finished + $c cancelled of $N"
pass "fan-in 3->1 with chunked prefill and cancels (ipc): $f finished and verified, $c cancelled by the engine"

# Strict: with more than one instance per side kvf-sim fails unless every request finished. A
# prefill instance whose layout is not the decode instances' (28 layers): every request ends
# 'peer layout mismatch', accounted for and not corrupt. Fan-out fails; the pair still exits 0
# (failed requests accounted for, as the fault tests want) unless --strict.
up $TAG-xp --role prefill --layers 28 --kv-heads 1 --head-dim 128 --cache-mib 64
x() { "$B/kvf-sim" --quiet --json "$KVFERRY_RUN_DIR/x.json" --timeout-s 20 --prefill $TAG-xp --requests 3 --layer-us 50 "$@" \
  >"$KVFERRY_RUN_DIR/x.txt" 2>&1; }
rc=0; x --decode $TAG-d0 --decode $TAG-d1 || rc=$?
[ $rc = 1 ] || { cat "$KVFERRY_RUN_DIR/x.txt" >&2; fail "fan-out with every request failed: kvf-sim exited $rc, want 1"; }
grep -q "peer layout mismatch" "$KVFERRY_RUN_DIR/x.txt" || { cat "$KVFERRY_RUN_DIR/x.txt" >&2; fail "no 'peer layout mismatch'"; }
[ "$(json_get "$KVFERRY_RUN_DIR/x.json" unexpected_failures)" = 3 ] || fail "fan-out, failed requests: not 3 unexpected failures"
x --decode $TAG-d0 || { cat "$KVFERRY_RUN_DIR/x.txt" >&2; fail "a pair whose requests failed (accounted for) exited non-zero"; }
rc=0; x --decode $TAG-d0 --strict || rc=$?
[ $rc = 1 ] || fail "a pair with --strict whose requests failed: kvf-sim exited $rc, want 1"
pass "strict: fan-out whose requests all failed exits 1; a pair exits 0 (accounted for), 1 with --strict"
echo "topology_test: all passed"
