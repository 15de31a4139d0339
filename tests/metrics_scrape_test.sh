#!/usr/bin/env bash
# kvf-metrics across scrapes: a page rendered from its kept text has every line of a page
# rendered in full, with freshly read numbers; a role whose process exited shows down (its pidfd)
# and up again once restarted, with its restart counted; the instance gone answers kvferry_up 0
# and the instance started again under the same name is mapped afresh. kvf-bench-scrape (the
# benchmark's scraper) makes its paced GETs, verifies each page and fails on a page without the
# series it expects or with another status than the one it asks for.
source "$(dirname "$0")/lib.sh"
R=$KVFERRY_RUN_DIR
L="--model llama-3.1-8b --tp 8 --cache-mib 64"
I=$TAG-s
PIDS=()
SUP=""
AT_EXIT+=('[ -n "$SUP" ] && kill -CONT "$SUP" 2>/dev/null; for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done')

command -v curl >/dev/null || fail "curl is missing (tools/kvferry setup installs it)"
[ -x "$B/bench/kvf-bench-scrape" ] || fail "no $B/bench/kvf-bench-scrape (build it)"

up "$I" --role decode $L
# A metrics server of its own (not the supervisor's), so that it outlives the instance.
"$B/kvf-metrics" --instance "$I" --listen 127.0.0.1:0 2>"$R/metrics.log" &
PIDS+=("$!")
for _ in $(seq 500); do grep -q "serving http" "$R/metrics.log" && break; sleep 0.01; done
PORT=$(sed -n 's/.*(port \([0-9]*\)).*/\1/p' "$R/metrics.log")
[ -n "$PORT" ] || fail "kvf-metrics did not listen: $(cat "$R/metrics.log")"
scrape() { curl -sf --max-time 5 "http://127.0.0.1:$PORT/metrics"; }
value() { awk -v s="$2" '$1 == s { print $2 }' <<<"$1"; }
# shape TEXT: the page without its numbers
shape() { sed -E '/^#/!s/ [^ ]+$//' <<<"$1"; }
role_up() { value "$1" "kvferry_role_up{instance=\"$I\",role=\"$2\"}"; }
# until_role ROLE V: scrape until the role's kvferry_role_up is V (10 s at most)
until_role() {
  local t0=$SECONDS t
  while :; do
    t=$(scrape) || fail "a scrape failed"
    [ "$(role_up "$t" "$1")" = "$2" ] && return 0
    [ $((SECONDS - t0)) -lt 10 ] || fail "kvferry_role_up of $1 is not $2 after 10 s"
    sleep 0.02
  done
}

# ---- the first page is rendered in full, later ones from its kept text ----
p1=$(scrape) || fail "the first scrape failed"
p2=$(scrape) || fail "the second scrape failed"
[ "$(value "$p1" "kvferry_up{instance=\"$I\"}")" = 1 ] || fail "kvferry_up is not 1"
n1=$(grep -cv '^#' <<<"$p1")
[ "$n1" -gt 200 ] || fail "the page has $n1 series lines, want over 200"
[ "$(shape "$p1")" = "$(shape "$p2")" ] || {
  diff <(shape "$p1") <(shape "$p2") >&2
  fail "a page from the kept text differs from the page rendered in full"
}
for r in allocator connector sender; do
  [ "$(role_up "$p2" $r)" = 1 ] || fail "kvferry_role_up of $r is '$(role_up "$p2" $r)', want 1"
done
[ "$(role_up "$p2" engine)" = 0 ] || fail "kvferry_role_up of the engine is not 0 (none attached)"
pass "pages 1 and 2 have the same $n1 series; allocator, connector, sender up; no engine"

# ---- kvf-bench-scrape: paced, verified ----
out=$("$B/bench/kvf-bench-scrape" --port "$PORT" --rate 2000 --count 300) ||
  fail "kvf-bench-scrape failed against a good server"
[ "${out%% *}" = 300 ] || fail "kvf-bench-scrape made '${out%% *}' GETs, want 300"
if "$B/bench/kvf-bench-scrape" --port "$PORT" --count 2 --expect kvferry_nosuch 2>"$R/scrape.err"; then
  fail "kvf-bench-scrape accepted a page without the series it expects"
fi
grep -q "lacks 'kvferry_nosuch'" "$R/scrape.err" || fail "kvf-bench-scrape said: $(cat "$R/scrape.err")"
if "$B/bench/kvf-bench-scrape" --port "$PORT" --count 2 --path /nosuch 2>"$R/scrape.err"; then
  fail "kvf-bench-scrape accepted a 404 where it wants 200"
fi
grep -q "want status 200" "$R/scrape.err" || fail "kvf-bench-scrape said: $(cat "$R/scrape.err")"
out=$("$B/bench/kvf-bench-scrape" --port "$PORT" --count 5 --path /nosuch --status 404 \
  --expect "not found") || fail "kvf-bench-scrape --path /nosuch --status 404 failed"
pass "kvf-bench-scrape: 300 GETs verified; a page without the expected series, or a 404 where 200 is wanted, fails; a 404 asked for passes"

# ---- a role's process exits: down at once (its supervisor held still), then restarted ----
sp=$(pid_of sender "$I") || fail "no sender of $I"
SUP=$(awk '/^PPid:/ { print $2 }' "/proc/$sp/status")
kill -STOP "$SUP" # the sender stays a zombie, its slot says running, and no restart comes
kill -KILL "$sp"
until_role sender 0
t=$(scrape)
[ "$(role_up "$t" connector)" = 1 ] || fail "the connector shows down while only the sender died"
kill -CONT "$SUP"
SUP=""
"$B/kvf-ctl" wait-ready --instance "$I" --roles sender --timeout-ms 15000 || fail "the sender did not come back"
until_role sender 1
t=$(scrape)
rs=$(value "$t" "kvferry_role_restarts_total{instance=\"$I\",role=\"sender\"}")
[ "$rs" = 1 ] || fail "kvferry_role_restarts_total of the sender is '$rs', want 1"
pass "a killed sender shows down, then up once restarted, its restart counted"

# ---- the instance gone, then started again under its name ----
down "$I"
t=$(scrape) || fail "a scrape with the instance down failed"
[ "$(value "$t" "kvferry_up{instance=\"$I\"}")" = 0 ] || fail "kvferry_up is not 0 with the instance down"
[ "$(grep -cv '^#' <<<"$t")" = 1 ] || fail "the page with the instance down has more than kvferry_up"
up "$I" --role decode $L
t=$(scrape) || fail "a scrape after the instance came back failed"
[ "$(value "$t" "kvferry_up{instance=\"$I\"}")" = 1 ] || fail "kvferry_up is not 1 once the instance is back"
[ "$(shape "$t")" = "$(shape "$p1")" ] || fail "the page of the new instance differs from the first"
rs=$(value "$t" "kvferry_role_restarts_total{instance=\"$I\",role=\"sender\"}")
[ "$rs" = 0 ] || fail "the new instance's sender restarts read '$rs' (the old segment's?), want 0"
until_role sender 1
pass "instance down: kvferry_up 0; up again: mapped afresh (sender restarts 0), roles up"
