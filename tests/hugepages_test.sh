#!/usr/bin/env bash
# Host caches in 2 MiB pages.
#  1. --huge-pages on, as root: `up` reserves the pages; the allocator, connector and sender of
#     a decode and a prefill instance and the engine (kvf-sim, moving requests between them)
#     all map both caches with 2 MiB pages (their /proc/PID/smaps); `down` removes the
#     hugetlbfs file and leaves the reserved pages alone.
#  2. --huge-pages auto when none can be had: 4 KiB pages, and the reason in up's output, the
#     allocator's log and ring-dump (text and --json).
#  3. --huge-pages on when none can be had: refused at once, saying why; nothing left behind.
#     As another user (no mount of theirs, no right to reserve): refused, saying why.
#  4. /dev/shm mounted huge=always: auto falls back to transparent huge pages there.
# "None can be had" without touching anyone else's pages: the test runs in a mount namespace
# of its own, where the only hugetlbfs mount is its own with a size= limit of one page, and
# /dev/shm is a tmpfs of its own. nr_hugepages is lowered at the end by what this test's
# allocators raised it (never below its value at the start).
# Needs root; elsewhere it exits 77 (skipped).
if [ "$(id -u)" != 0 ]; then echo "SKIP: reserving huge pages needs root"; exit 77; fi
POOL=/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages
grep -qw hugetlbfs /proc/filesystems && [ -w $POOL ] || { echo "SKIP: no 2 MiB huge pages in this kernel"; exit 77; }
if [ -z "${KVF_HUGE_NS:-}" ]; then
  unshare --mount --propagation private true 2>/dev/null || { echo "SKIP: no mount namespace (unshare)"; exit 77; }
  exec unshare --mount --propagation private env KVF_HUGE_NS=1 bash "$0"
fi
source "$(dirname "$0")/lib.sh"
cd "$ROOT"

NR0=$(cat $POOL)
# Our own /dev/shm (no huge pages: part 4 turns them on) and no hugetlbfs mount but ours.
mount -t tmpfs -o mode=1777,size=3g,huge=never kvf-huge-shm /dev/shm
while read -r _ dir type _; do
  [ "$type" = hugetlbfs ] && umount -l "$(printf '%b' "$dir")"
done < <(tac /proc/self/mounts)
# Outside the run directory (0700): part 3 looks at it as another user.
HUGE=$(mktemp -d /tmp/kvf-huge.XXXXXX)
chmod 755 "$HUGE"
mount -t hugetlbfs -o pagesize=2M,mode=0755 kvf-huge "$HUGE"
AT_EXIT+=("umount -l '$HUGE'; rmdir '$HUGE'")

# What this test's allocators added to the pool: removed again at exit (pages still in use
# become surplus pages and go back to the system when freed).
raised() {
  cat "$KVFERRY_RUN_DIR"/*/allocator.log 2>/dev/null |
    sed -n 's/.*reserved huge pages: nr_hugepages \([0-9]*\) -> \([0-9]*\).*/\1 \2/p' |
    awk '{ s += $2 - $1 } END { print s + 0 }'
}
restore_pool() {
  local a=() n
  for n in "${STARTED[@]}"; do a+=(--instance "$n"); done
  [ ${#a[@]} -eq 0 ] || "$ROOT/tools/kvferry" down "${a[@]}" >/dev/null 2>&1 || true
  local cur want; cur=$(cat $POOL); want=$((cur - $(raised)))
  [ $want -ge "$NR0" ] || want=$NR0
  [ $want -ge "$cur" ] || echo $want >$POOL
}
AT_EXIT+=(restore_pool)

L="--model llama-3.1-8b --tp 8 --cache-mib 256"   # 128 pages of 2 MiB per instance
# up_out NAME ARGS...: tools/kvferry up, its messages in $OUT
up_out() {
  local name=$1; shift
  STARTED+=("$name")
  OUT=$("$ROOT/tools/kvferry" up --instance "$name" "$@" 2>&1)
}
# huge_maps PID PATH...: every mapping of each PATH in PID's smaps is in 2 MiB pages (hugetlb:
# KernelPageSize 2048 kB and Shared/Private_Hugetlb; THP: ShmemPmdMapped); says what it saw.
huge_maps() {
  /usr/bin/python3 - "$@" <<'EOF'
import re, sys
pid, paths = sys.argv[1], sys.argv[2:]
maps, cur = [], None
for line in open(f"/proc/{pid}/smaps"):
    m = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$", line)
    if m:
        cur = {"path": m.group(1).strip()}
        maps.append(cur)
    elif cur is not None and ":" in line:
        k, v = line.split(":", 1)
        if v.strip().endswith("kB"):
            cur[k] = int(v.split()[0])
ok = True
for p in paths:
    mine = [m for m in maps if m["path"] == p]
    if not mine:
        print(f"pid {pid}: no mapping of {p}"); ok = False
    for m in mine:
        huge = m.get("Shared_Hugetlb", 0) + m.get("Private_Hugetlb", 0) + m.get("ShmemPmdMapped", 0)
        print(f"pid {pid}: {p}: Size {m['Size']} kB, KernelPageSize {m['KernelPageSize']} kB, in 2 MiB pages {huge} kB")
        if huge == 0 or (m.get("ShmemPmdMapped", 0) == 0 and m["KernelPageSize"] != 2048):
            ok = False
sys.exit(0 if ok else 1)
EOF
}
# small_maps PID PATH: PID maps PATH, in 4 KiB pages only
small_maps() {
  grep -A30 " $2\$" "/proc/$1/smaps" | awk -v p="$2" '
    /^[0-9a-f]+-/ { inmap = index($0, " " p) > 0 } inmap && /^KernelPageSize:/ { seen = 1; if ($2 != 4) bad = 1 }
    inmap && /_Hugetlb:|PmdMapped:/ { if ($2 != 0) bad = 1 }
    END { exit !(seen && !bad) }'
}
cache_json() { # cache_json INSTANCE KEY
  "$B/kvf-ringdump" --instance "$1" --json | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["cache"][sys.argv[1]])' "$2"
}

# ---- 1. 2 MiB pages everywhere ----
D=$TAG-hd; P=$TAG-hp
up_out $D --role decode $L --huge-pages on || { echo "$OUT" >&2; fail "up --huge-pages on (decode)"; }
grep -q "cache 256.00 MiB in 2 MiB pages (hugetlbfs $HUGE/kvferry.$D.cache)" <<<"$OUT" ||
  { echo "$OUT" >&2; fail "up does not say the decode cache is in 2 MiB pages"; }
up_out $P --role prefill $L --huge-pages on || { echo "$OUT" >&2; fail "up --huge-pages on (prefill)"; }
echo "$OUT" | grep "cache"
[ "$(cat $POOL)" -ge $((NR0 + 0)) ] || fail "nr_hugepages went down"
[ "$(raised)" -gt 0 ] || [ "$NR0" -gt 0 ] || fail "nothing was reserved, yet the pool was empty"
[ "$(cache_json $D backing)" = hugetlbfs ] && [ "$(cache_json $P page_bytes)" = 2097152 ] ||
  fail "ring-dump --json does not say hugetlbfs, 2 MiB pages"
"$B/kvf-ringdump" --instance $D | grep -q "  cache: 256.0 MiB in 2 MiB pages (hugetlbfs $HUGE/kvferry.$D.cache)" ||
  { "$B/kvf-ringdump" --instance $D | grep cache >&2; fail "ring-dump's text does not say 2 MiB pages"; }
[ "$(stat -c '%a %U' "$HUGE/kvferry.$D.cache")" = "600 root" ] || fail "the hugetlbfs cache file is not 0600 and ours"

DC=$HUGE/kvferry.$D.cache; PC=$HUGE/kvferry.$P.cache
# The engine: enough requests to look at it while it moves them.
"$B/kvf-sim" --quiet --json "$KVFERRY_RUN_DIR/sim.json" --timeout-s 60 --prefill $P --decode $D \
  --requests 400 --layer-us 300 --verify sample >"$KVFERRY_RUN_DIR/sim.txt" 2>&1 &
SIM=$!
AT_EXIT+=("kill $SIM 2>/dev/null || true")
for _ in $(seq 200); do
  grep -q " $DC\$" /proc/$SIM/smaps 2>/dev/null && grep -q " $PC\$" /proc/$SIM/smaps && break
  sleep 0.05
done
huge_maps $SIM "$PC" "$DC" || fail "the engine (kvf-sim) does not map both caches in 2 MiB pages"
for inst in $D $P; do
  for role in allocator connector sender; do
    pid=$(pid_of $role $inst)
    [ -n "$pid" ] || fail "no $role of $inst"
    huge_maps "$pid" "$HUGE/kvferry.$inst.cache" || fail "the $role of $inst does not map its cache in 2 MiB pages"
  done
done
# The prefill sender maps its same-host peer's cache too (ipc copies), once it has a task for it.
huge_maps "$(pid_of sender $P)" "$DC" || fail "the prefill sender does not map the decode cache in 2 MiB pages"
wait $SIM || { cat "$KVFERRY_RUN_DIR/sim.txt" >&2; fail "kvf-sim failed"; }
[ "$(json_get "$KVFERRY_RUN_DIR/sim.json" finished)" = 400 ] || fail "not all 400 requests finished"
pass "--huge-pages on: the allocator, connector and sender of both instances and the engine map the caches in 2 MiB pages (hugetlbfs); 400 requests moved and verified"

before=$(cat $POOL)
down $P; down $D
[ ! -e "$DC" ] && [ ! -e "$PC" ] || fail "down left a cache file on hugetlbfs"
[ "$(cat $POOL)" -ge "$before" ] || fail "down shrank the pool"
pass "down removes the hugetlbfs cache files and leaves the reserved pages to the system"

# ---- 2. none can be had: auto falls back ----
umount "$HUGE"
mount -t hugetlbfs -o pagesize=2M,size=2M kvf-huge-small "$HUGE"
A=$TAG-ha
r0=$(raised)
up_out $A --role decode $L || { echo "$OUT" >&2; fail "up --huge-pages auto, no pages to be had"; }
why="huge pages unavailable: hugetlbfs $HUGE has room for 1 more 2 MiB pages (its size= limit), the cache needs 128"
grep -qF "cache 256.00 MiB in 4 KiB pages (/dev/shm/kvferry.$A.cache): $why" <<<"$OUT" ||
  { echo "$OUT" >&2; fail "up does not say the cache fell back to 4 KiB pages, and why"; }
grep -qF "WARN no 2 MiB pages for the 256.00 MiB cache, using 4 KiB pages: hugetlbfs $HUGE has room" "$KVFERRY_RUN_DIR/$A/allocator.log" ||
  fail "the allocator's log does not say why it fell back"
"$B/kvf-ringdump" --instance $A | grep -qF "  cache: 256.0 MiB in 4 KiB pages (/dev/shm/kvferry.$A.cache): $why" ||
  { "$B/kvf-ringdump" --instance $A | grep cache >&2; fail "ring-dump's text does not say 4 KiB pages and why"; }
[ "$(cache_json $A backing)" = shm ] && [ "$(cache_json $A page_bytes)" = 4096 ] &&
  [ "$(cache_json $A note)" = "$why" ] || fail "ring-dump --json does not say shm, 4 KiB pages, and why"
for role in allocator connector sender; do
  small_maps "$(pid_of $role $A)" "/dev/shm/kvferry.$A.cache" || fail "the $role of $A does not map its cache in 4 KiB pages"
done
[ "$(raised)" = "$r0" ] || fail "the pool was grown for a cache that could not have its pages"
down $A
pass "--huge-pages auto with no pages to be had: 4 KiB pages, and why (up, the allocator's log, ring-dump)"

# ---- 3. none can be had: on is refused ----
O=$TAG-ho
t0=$SECONDS
if up_out $O --role decode $L --huge-pages on; then fail "--huge-pages on came up without huge pages"; fi
grep -qF -- "--huge-pages on: no 2 MiB pages for the 256.00 MiB cache: hugetlbfs $HUGE has room for 1 more 2 MiB pages (its size= limit), the cache needs 128" <<<"$OUT" ||
  { echo "$OUT" >&2; fail "up --huge-pages on does not say why it failed"; }
[ $((SECONDS - t0)) -lt 15 ] || fail "up --huge-pages on took $((SECONDS - t0)) s to fail"
[ ! -e "/dev/shm/kvferry.$O" ] && [ ! -e "/dev/shm/kvferry.$O.cache" ] && [ ! -e "$HUGE/kvferry.$O.cache" ] ||
  fail "a refused --huge-pages on left files behind"
if setpriv --reuid=nobody --regid=nogroup --clear-groups test -x "$B/kvf-allocator"; then
  umount "$HUGE"
  mount -t hugetlbfs -o pagesize=2M,mode=0755 kvf-huge "$HUGE"
  msg=$(setpriv --reuid=nobody --regid=nogroup --clear-groups "$B/kvf-allocator" --instance $TAG-hn \
          --model llama-3.1-8b --tp 8 --cache-mib 64 --huge-pages on 2>&1) && fail "--huge-pages on as nobody came up"
  grep -qF -- "--huge-pages on: no 2 MiB pages for the 64.00 MiB cache: hugetlbfs $HUGE is not writable by uid 65534 (owner uid 0, mode 0755)" <<<"$msg" ||
    { echo "$msg" >&2; fail "--huge-pages on as nobody does not say why it failed"; }
  [ ! -e "/dev/shm/kvferry.$TAG-hn" ] || fail "nobody's refused allocator left its segment"
  umount "$HUGE"
  mount -t hugetlbfs -o pagesize=2M,size=2M kvf-huge-small "$HUGE"
fi
pass "--huge-pages on with no pages to be had: refused at once, saying why"

# ---- 4. /dev/shm with transparent huge pages ----
if [ -e /sys/kernel/mm/transparent_hugepage/shmem_enabled ] &&
   ! grep -q '\[deny\]' /sys/kernel/mm/transparent_hugepage/shmem_enabled; then
  mount -o remount,huge=always /dev/shm
  T=$TAG-ht
  up_out $T --role decode $L || { echo "$OUT" >&2; fail "up with /dev/shm huge=always"; }
  grep -qF "cache 256.00 MiB in 2 MiB pages (shmem THP /dev/shm/kvferry.$T.cache)" <<<"$OUT" ||
    { echo "$OUT" >&2; fail "up does not say the cache is in transparent huge pages"; }
  for role in allocator connector sender; do
    huge_maps "$(pid_of $role $T)" "/dev/shm/kvferry.$T.cache" || fail "the $role of $T does not map its cache in 2 MiB pages"
  done
  [ "$(cache_json $T backing)" = shm-thp ] || fail "ring-dump --json does not say shm-thp"
  down $T
  mount -o remount,huge=never /dev/shm
  pass "/dev/shm mounted huge=always: auto falls back to transparent huge pages, mapped in 2 MiB pages by every role"
fi
echo "hugepages_test: all passed"
