#!/usr/bin/env bash
# up --metrics: kvf-metrics serves Prometheus text that promtool accepts; its figures after a
# kvf-sim run equal what kvf-sim counted; it is scraped while requests move; it maps the
# segment read-only; every series is documented; the per-transfer histograms (bytes,
# descriptors, time) have one observation per finished request (ipc, tcp); a notice to an
# unreachable peer or to a decode instance killed mid-transfer counts as a failed notification;
# kvferry_peers shows the one connected peer over tcp; 100 stalled connections leave the data
# path alone; it is restarted like a role, and a role's restart shows in it; Debian's Prometheus
# server scrapes it and answers a kvferry series through its HTTP API. Only the Prometheus server
# part is skipped (77, at the end) where the binary is missing.
source "$(dirname "$0")/lib.sh"
R=$KVFERRY_RUN_DIR
L="--model llama-3.1-8b --tp 8 --cache-mib 64"
D=$TAG-d P=$TAG-p
PIDS=()
AT_EXIT+=('for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done')

command -v curl >/dev/null || fail "curl is missing (tools/kvferry setup installs it)"
command -v promtool >/dev/null || fail "promtool is missing (Debian's prometheus; tools/kvferry setup installs it)"

# port_of NAME: the port its metrics server reported
port_of() { sed -n 's/.*(port \([0-9]*\)).*/\1/p' "$R/$1/metrics.log" | tail -n1; }
scrape() { curl -sf --max-time 5 "http://127.0.0.1:$(port_of "$1")/metrics"; }
# value TEXT SERIES: the value of one exact series line (name{labels}) in TEXT
value() { awk -v s="$2" '$1 == s { print $2 }' <<<"$1"; }

up "$D" --role decode $L --metrics 127.0.0.1:0
# Its ipc notices through the connectors (not the decode instance's notice slots, the default),
# so that the prefill connector connects to its peer and peer_connects counts it.
up "$P" --role prefill $L --metrics 127.0.0.1:0 --no-notice-rings
[ -n "$(port_of "$D")" ] && [ -n "$(port_of "$P")" ] || fail "no metrics port in metrics.log"

# ---- read-only, and the format ----
mp=$(pgrep -f "kvf-metrics --instance $P " | head -n1) || fail "no kvf-metrics for $P"
scrape "$P" >/dev/null || fail "the first scrape failed" # it maps the segment on the first scrape
perm=$(awk -v f="/dev/shm/kvferry.$P" '$6 == f { print $2 }' "/proc/$mp/maps" | sort -u)
[ "$perm" = "r--s" ] || fail "kvf-metrics maps the segment '$perm', not read-only (r--s)"
[ -z "$(awk '$6 ~ /\.cache$/' "/proc/$mp/maps")" ] || fail "kvf-metrics maps the cache"
pass "kvf-metrics maps the control segment read-only and not the cache"
scrape "$P" | promtool check metrics || fail "promtool check metrics refuses the prefill page"
scrape "$D" | promtool check metrics || fail "promtool check metrics refuses the decode page"
code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$(port_of "$P")/nosuch")
[ "$code" = 404 ] || fail "/nosuch answered $code, want 404"
code=$(curl -s -o /dev/null -w '%{http_code}' -X POST -d x "http://127.0.0.1:$(port_of "$P")/metrics")
[ "$code" = 405 ] || fail "POST /metrics answered $code, want 405"
pass "promtool accepts both pages; 404 elsewhere, 405 for POST"

# ---- scraped while kvf-sim moves requests; then equal to its summary ----
"$B/kvf-sim" --prefill "$P" --decode "$D" --requests 200 --layer-us 100 --quiet --strict \
  --json "$R/sim.json" >"$R/sim.out" 2>&1 &
sim=$!
PIDS+=("$sim")
n=0 last=0 moving=0
while kill -0 "$sim" 2>/dev/null; do
  t=$(scrape "$P") || fail "a scrape during the run failed"
  f=$(value "$t" "kvferry_transfers_total{instance=\"$P\",status=\"finished\"}")
  [ "$f" -ge "$last" ] || fail "finished went back from $last to $f"
  [ "$f" -gt 0 ] && [ "$f" -lt 200 ] && moving=1
  last=$f n=$((n + 1))
done
wait "$sim" || fail "kvf-sim failed: $(tail -n 5 "$R/sim.out")"
[ $moving = 1 ] || echo "note: no scrape fell while requests were half done ($n scrapes)"
pass "$n scrapes while kvf-sim ran, finished never went back"

tp=$(scrape "$P") td=$(scrape "$D")
sim_get() { /usr/bin/python3 -c 'import json,sys
j=json.load(open(sys.argv[1])); print([i for i in j["instances"] if i["role"]==sys.argv[2]][0][sys.argv[3]])' "$R/sim.json" "$@"; }
eq() { [ "$2" = "$3" ] || fail "$1: metrics say '$2', kvf-sim counted '$3'"; }
eq "finished (prefill)" "$(value "$tp" "kvferry_transfers_total{instance=\"$P\",status=\"finished\"}")" "$(sim_get prefill finished)"
eq "failed (prefill)" "$(value "$tp" "kvferry_num_failed_transfers_total{instance=\"$P\"}")" "$(sim_get prefill failed)"
eq "bytes (prefill, ipc)" "$(value "$tp" "kvferry_transport_bytes_total{instance=\"$P\",transport=\"ipc\"}")" "$(sim_get prefill bytes)"
eq "bytes_transferred_sum" "$(value "$tp" "kvferry_bytes_transferred_sum{instance=\"$P\"}")" "$(sim_get prefill bytes)"
eq "bytes_transferred_count" "$(value "$tp" "kvferry_bytes_transferred_count{instance=\"$P\"}")" "$(sim_get prefill finished)"
eq "arrivals (decode)" "$(value "$td" "kvferry_arrivals_total{instance=\"$D\"}")" "$(sim_get decode finished)"
eq "tail histogram count" "$(value "$tp" "kvferry_tail_seconds_count{instance=\"$P\"}")" "$(sim_get prefill finished)"
eq "tail +Inf bucket" "$(value "$tp" "kvferry_tail_seconds_bucket{instance=\"$P\",le=\"+Inf\"}")" "$(sim_get prefill finished)"
eq "expired" "$(value "$tp" "kvferry_num_kv_expired_reqs_total{instance=\"$P\"}")" 0
eq "peers" "$(value "$tp" "kvferry_peer_connects_total{instance=\"$P\"}")" 1
# One observation per finished transfer: bytes (sum: every byte), descriptors, transfer time.
fin=$(sim_get prefill finished)
eq "bytes_transferred +Inf" "$(value "$tp" "kvferry_bytes_transferred_bucket{instance=\"$P\",le=\"+Inf\"}")" "$fin"
eq "bytes_transferred le=4 GiB" "$(value "$tp" "kvferry_bytes_transferred_bucket{instance=\"$P\",le=\"4294967296\"}")" "$fin"
eq "num_descriptors_count" "$(value "$tp" "kvferry_num_descriptors_count{instance=\"$P\"}")" "$fin"
eq "xfer_time_seconds_count" "$(value "$tp" "kvferry_xfer_time_seconds_count{instance=\"$P\"}")" "$fin"
# ipc descriptors are copy runs, one at least per layer and tensor: llama-3.1-8b has 32 layers,
# K and V, so at least 64 per request; a request's blocks at most add one run each.
dsum=$(value "$tp" "kvferry_num_descriptors_sum{instance=\"$P\"}")
blocks=$(value "$tp" "kvferry_segment_events_total{instance=\"$P\",counter=\"blocks_moved_ipc\"}")
[ "$dsum" -ge $((fin * 64)) ] && [ "$dsum" -le "$blocks" ] ||
  fail "num_descriptors_sum $dsum: want at least 64 per request ($((fin * 64))) and at most the blocks moved ($blocks)"
[ "$(value "$tp" "kvferry_num_descriptors_bucket{instance=\"$P\",le=\"32\"}")" = 0 ] ||
  fail "a transfer of fewer than 64 descriptors: $(grep '^kvferry_num_descriptors_bucket' <<<"$tp")"
# Each transfer's time lies within the run: the sum of transfer times is at most finished x the
# run's wall time.
wall=$(json_get "$R/sim.json" seconds)
/usr/bin/python3 -c 'import sys; s, n, w = map(float, sys.argv[1:]); sys.exit(not (0 < s <= n * w))' \
  "$(value "$tp" "kvferry_xfer_time_seconds_sum{instance=\"$P\"}")" "$fin" "$wall" ||
  fail "xfer_time_seconds_sum is not within finished x the run's time ($wall s)"
# Cumulative buckets never decrease.
for h in kvferry_xfer_time_seconds kvferry_bytes_transferred kvferry_num_descriptors; do
  awk -v s="${h}_bucket{" 'index($1, s) == 1 { if ($2 < prev) bad = 1; prev = $2 } END { exit bad }' <<<"$tp" ||
    fail "$h buckets are not cumulative"
done
eq "failed notifications (all delivered)" "$(value "$tp" "kvferry_num_failed_notifications_total{instance=\"$P\"}")" 0
eq "peers connected" "$(value "$tp" "kvferry_peers{instance=\"$P\",state=\"connected\"}")" 1
for s in kvferry_xfer_time_seconds kvferry_bytes_transferred kvferry_num_descriptors kvferry_num_failed_transfers_total \
         kvferry_num_failed_notifications_total kvferry_num_kv_expired_reqs_total; do
  grep -q "^# TYPE $s " <<<"$tp" || fail "no TYPE line for $s"
  grep -q "^# HELP $s " <<<"$tp" || fail "no HELP line for $s"
done
pass "after the run the figures equal kvf-sim's summary (finished, failed, bytes, arrivals, tails, per-transfer histograms)"

# ---- tcp: descriptors are the connector's frames; one connected peer ----
f0=$(value "$tp" "kvferry_num_descriptors_sum{instance=\"$P\"}")
"$B/kvf-sim" --prefill "$P" --decode "$D" --transport tcp --requests 20 --layer-us 100 --quiet --strict \
  --json "$R/simtcp.json" >"$R/simtcp.out" 2>&1 || fail "kvf-sim over tcp failed: $(tail -n 5 "$R/simtcp.out")"
t=$(scrape "$P")
eq "bytes_transferred_count (tcp)" "$(value "$t" "kvferry_bytes_transferred_count{instance=\"$P\"}")" $((fin + 20))
eq "num_descriptors_count (tcp)" "$(value "$t" "kvferry_num_descriptors_count{instance=\"$P\"}")" $((fin + 20))
eq "bytes_transferred_sum (ipc + tcp)" "$(value "$t" "kvferry_bytes_transferred_sum{instance=\"$P\"}")" \
  $(( $(sim_get prefill bytes) + $(json_get "$R/simtcp.json" bytes) ))
# A tcp frame holds one run of one layer and tensor, up to 4 MiB: the frames of 20 requests lie
# between 64 per request and the blocks sent (blocks of 64 KiB or less here: none is split).
fd=$(( $(value "$t" "kvferry_num_descriptors_sum{instance=\"$P\"}") - f0 ))
bt=$(value "$t" "kvferry_segment_events_total{instance=\"$P\",counter=\"blocks_sent_tcp\"}")
[ "$fd" -ge $((20 * 64)) ] && [ "$fd" -le "$bt" ] || fail "tcp descriptors $fd: want 1280 to $bt (blocks sent)"
eq "peers connected (tcp)" "$(value "$t" "kvferry_peers{instance=\"$P\",state=\"connected\"}")" 1
eq "peers failed (tcp)" "$(value "$t" "kvferry_peers{instance=\"$P\",state=\"failed\"}")" 0
pass "tcp: 20 more transfers observed, $fd descriptors (frames), kvferry_peers{state=\"connected\"} = 1"

# ---- a peer that cannot be reached: its notices fail, and count ----
# (Through the connectors' sockets: a same-host notice in a notice ring is counted failed in
# sender_logic_test.)
P3=$TAG-u
# (A request timeout of 2 s: a finish notice in doubt when its peer died is given up after two.)
up "$P3" --role prefill $L --metrics 127.0.0.1:0 --peer-timeout-ms 300 --connect-timeout-ms 200 --no-notice-rings \
  --request-timeout-ms 2000
dead=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$B/kvf-sim" --prefill "$P3" --decode "$D" --transport tcp --peer-map "$D=127.0.0.1:$dead" --requests 2 \
  --layer-us 100 --quiet --json "$R/simdead.json" >"$R/simdead.out" 2>&1 || true
[ "$(json_get "$R/simdead.json" failed)" = 2 ] || fail "2 requests to an unreachable peer: $(tail -n 5 "$R/simdead.out")"
wait_counter "$P3" notices_failed 1 5000 || fail "no failed notification counted for an unreachable peer"
t=$(scrape "$P3")
nf=$(value "$t" "kvferry_num_failed_notifications_total{instance=\"$P3\"}")
[ "$nf" -ge 1 ] || fail "kvferry_num_failed_notifications_total is $nf after notices to an unreachable peer"
eq "finished (unreachable)" "$(value "$t" "kvferry_bytes_transferred_count{instance=\"$P3\"}")" 0
[ "$(value "$t" "kvferry_peers{instance=\"$P3\",state=\"connected\"}")" = 0 ] || fail "an unreachable peer counted connected"
scrape "$P3" | promtool check metrics || fail "promtool check metrics refuses the page after failures"
pass "notices to an unreachable peer: $nf failed notifications counted; no transfer observed"

# ---- a decode instance killed mid-transfer: the notices to it fail, and count ----
D2=$TAG-k
up "$D2" --role decode $L
acc0=$(counter "$P3" tasks_accepted) nf0=$(counter "$P3" notices_failed)
"$B/kvf-sim" --prefill "$P3" --decode "$D2" --requests 100000 --layer-us 3000 --quiet --timeout-s 20 \
  >"$R/simkill.out" 2>&1 &
ks=$!
PIDS+=("$ks")
wait_counter "$P3" tasks_accepted $((acc0 + 3)) 10000 || fail "no transfer to $D2 started"
# Its connector frozen first, so that a finish notice is outstanding when it dies: a request
# whose bytes all landed waits for the answer ('finishing' in the request table). Without the
# freeze the kill may fall between notices; the requests then fail while moving, with no
# notice to count. A notice that reached the peer is in doubt (the peer may have published
# the arrival, and a restarted one answers from its journal): it fails, and counts, once the
# withdrawal goes unanswered for a request timeout too.
cp=$(pid_of connector "$D2") || fail "no connector for $D2"
kill -STOP "$cp"
finishing() { "$B/kvf-ringdump" --instance "$P3" --json --records 0 | grep -o '"state":"finishing"' | wc -l; }
for _ in $(seq 100); do [ "$(finishing)" -ge 1 ] && break; sleep 0.1; done
[ "$(finishing)" -ge 1 ] || fail "no request to $D2 waiting for its notice's answer after its connector froze"
kp=$(cat "$R/$D2/supervisor.pid")
kill -KILL "$kp"
for r in allocator connector sender; do p=$(pid_of $r "$D2") && kill -KILL "$p"; done
kill -KILL "$cp" 2>/dev/null || true
wait_counter "$P3" notices_failed $((nf0 + 1)) 15000 ||
  fail "no failed notification counted after $D2 was killed mid-transfer"
kill "$ks" 2>/dev/null || true
wait "$ks" 2>/dev/null || true
for _ in $(seq 100); do grep -q "never confirmed or denied the arrival" "$R/$P3/sender.log" && break; sleep 0.1; done
grep -q "never confirmed or denied the arrival" "$R/$P3/sender.log" ||
  fail "the request whose notice was in doubt did not end 'timed out ... in doubt'"
t=$(scrape "$P3")
[ "$(value "$t" "kvferry_num_failed_notifications_total{instance=\"$P3\"}")" -gt "$nf0" ] ||
  fail "kvferry_num_failed_notifications_total did not grow after $D2 was killed"
"$ROOT/tools/kvferry" down --instance "$D2" >/dev/null 2>&1 || true # (its leftover shared memory)
pass "a decode instance killed mid-transfer: $(( $(counter "$P3" notices_failed) - nf0 )) failed notifications counted (the one in doubt once its withdrawal went unanswered)"

# Every family on the page is documented.
for f in $(sed -n 's/^# TYPE \([a-z_]*\) .*/\1/p' <<<"$tp" | sort -u); do
  grep -qF "\`$f\`" "$ROOT/docs/OPERATIONS.md" || fail "$f is not documented in docs/OPERATIONS.md"
done
pass "every series on the page is documented in docs/OPERATIONS.md"

# ---- a hostile scraper: 100 connections that send half a request and stall ----
/usr/bin/python3 - "$(port_of "$P")" "$R/stall.ready" <<'EOF' &
import socket, sys, time
conns = []
for _ in range(100):
    try:
        s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
        conns.append(s)
    except OSError:
        pass
open(sys.argv[2], "w").write("%d\n" % len(conns))
time.sleep(6)
EOF
stall=$!
PIDS+=("$stall")
for _ in $(seq 100); do [ -s "$R/stall.ready" ] && break; sleep 0.05; done
"$B/kvf-sim" --prefill "$P" --decode "$D" --requests 40 --quiet --strict >"$R/sim2.out" 2>&1 ||
  fail "kvf-sim failed while /metrics was flooded: $(tail -n 5 "$R/sim2.out")"
wait "$stall" || true
t=$(scrape "$P") || fail "no scrape after the stalled connections went"
f=$(value "$t" "kvferry_transfers_total{instance=\"$P\",status=\"finished\"}")
[ "$f" = 260 ] || fail "finished after 260 requests (200 + 20 tcp + 40): $f"
pass "100 stalled connections to /metrics: 40 more requests moved (strict), and /metrics answers after"

# ---- restarts: a role's shows, and the metrics server is restarted like a role ----
kill_role sender "$P"
t=$(scrape "$P")
eq "sender restarts" "$(value "$t" "kvferry_role_restarts_total{instance=\"$P\",role=\"sender\"}")" 1
kill -KILL "$mp"
for _ in $(seq 100); do t=$(scrape "$P" 2>/dev/null) && break; sleep 0.1; done
[ -n "${t:-}" ] || fail "kvf-metrics was not restarted within 10 s"
grep -q "metrics (pid $mp) exited" "$R/$P/supervisor.log" || fail "the supervisor did not log the metrics restart"
pass "a sender restart shows in kvferry_role_restarts_total; a killed kvf-metrics is restarted"

# ---- a bad --metrics is refused; a port in use fails up with the reason ----
out=$("$ROOT/tools/kvferry" up --instance "$TAG-x" --role decode $L --metrics nohost 2>&1) && fail "--metrics nohost accepted"
grep -q "HOST:PORT" <<<"$out" || fail "--metrics nohost: unclear message: $out"
STARTED+=("$TAG-x")
out=$("$ROOT/tools/kvferry" up --instance "$TAG-x" --role decode $L --metrics "127.0.0.1:$(port_of "$P")" 2>&1) &&
  fail "--metrics on a port in use came up"
grep -q "could not start" <<<"$out" || fail "--metrics on a port in use: unclear message: $out"
[ ! -e "/dev/shm/kvferry.$TAG-x" ] || fail "a failed up left its segment"
pass "--metrics: a bad address is refused, a port in use fails up with the reason"

# ---- Debian's Prometheus server ----
PROM=$(command -v prometheus || true)
if [ -z "$PROM" ]; then
  echo "skipped: the Prometheus server part (no prometheus binary; Debian package prometheus)"
  exit 77
fi
pp=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
mkdir -p "$R/prom"
cat >"$R/prom/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: kvferry
    honor_labels: true
    static_configs:
      - targets: ['127.0.0.1:$(port_of "$P")', '127.0.0.1:$(port_of "$D")']
EOF
"$PROM" --config.file="$R/prom/prometheus.yml" --storage.tsdb.path="$R/prom/data" \
  --web.listen-address="127.0.0.1:$pp" >"$R/prom/prometheus.log" 2>&1 &
PIDS+=($!)
got=""
for _ in $(seq 300); do
  got=$(curl -sf --max-time 2 "http://127.0.0.1:$pp/api/v1/query" \
          --data-urlencode "query=kvferry_transfers_total{instance=\"$P\",status=\"finished\"}" 2>/dev/null || true)
  grep -q '"value"' <<<"$got" && break
  sleep 0.1
done
grep -q '"value":\[[0-9.]*,"260"\]' <<<"$got" ||
  fail "Prometheus did not return kvferry_transfers_total = 260: $got; $(tail -n 5 "$R/prom/prometheus.log")"
pass "Prometheus scraped the instance: /api/v1/query returns kvferry_transfers_total{status=\"finished\"} = 260"
