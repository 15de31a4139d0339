#!/usr/bin/env bash
# kvferry installed: `cmake --install` into a temp prefix gives the binaries, libkvferry (soname,
# only the public API exported), kvferry.h, kvferry.pc, the supervisor, the model shapes and the
# systemd unit; a C engine built with `pkg-config --cflags --libs kvferry` moves requests between
# instances the installed supervisor started; the Debian package (cpack -G DEB, from this build
# tree) installs with dpkg and its `kvferry demo --requests 20` passes; `pip install ./python`
# into a fresh venv, offline, imports against the installed library.
source "$(dirname "$0")/lib.sh"
R=$KVFERRY_RUN_DIR
P=$R/prefix
CC=${CC:-cc}
PY=/usr/bin/python3 # Debian's, with python3-msgpack, -setuptools, -wheel, -venv

# ---- cmake --install ----
cmake --install "$B" --prefix "$P" >"$R/install.out" 2>&1 || fail "cmake --install: $(tail -n 5 "$R/install.out")"
for f in bin/kvferry bin/kvf-allocator bin/kvf-connector bin/kvf-sender bin/kvf-ctl bin/kvf-sim \
         bin/kvf-ringdump bin/kvf-metrics include/kvferry.h lib/pkgconfig/kvferry.pc \
         share/kvferry/model-shapes.json share/kvferry/mooncake-conversation-2000.jsonl \
         lib/systemd/system/kvferry@.service share/doc/kvferry/OPERATIONS.md; do
  [ -e "$P/$f" ] || fail "cmake --install: $f is missing"
done
[ "$(readlink "$P/lib/libkvferry.so.0")" = "libkvferry.so.$(sed -n 's/^#define KVFERRY_VERSION "\(.*\)"/\1/p' "$ROOT/include/kvferry.h")" ] ||
  fail "libkvferry.so.0 -> $(readlink "$P/lib/libkvferry.so.0")"
[ "$(objdump -p "$P/lib/libkvferry.so.0" | awk '$1 == "SONAME" { print $2 }')" = libkvferry.so.0 ] || fail "soname is not libkvferry.so.0"
grep -q "^ExecStart=$P/bin/kvferry up --instance %i" "$P/lib/systemd/system/kvferry@.service" ||
  fail "the unit does not name the installed supervisor"
grep -q '^EnvironmentFile=/etc/kvferry/%i.conf' "$P/lib/systemd/system/kvferry@.service" || fail "the unit's EnvironmentFile"
# systemd's own check of the unit, as an instance of the template (where systemd is installed).
if command -v systemd-analyze >/dev/null; then
  cp "$P/lib/systemd/system/kvferry@.service" "$R/kvferry@check.service"
  sdv=$(systemd-analyze verify "$R/kvferry@check.service" 2>&1 | grep -F "kvferry@check.service" || true)
  [ -z "$sdv" ] || fail "systemd-analyze verify finds fault with the unit: $sdv"
fi
# Exported: exactly the functions kvferry.h declares.
exported=$(nm -D --defined-only "$P/lib/libkvferry.so.0" | awk '$2 == "T" { sub(/@.*/, "", $3); print $3 }' | sort -u)
# (a function-like macro over a _sized call is no export of its own unless the version map
# keeps it for programs linked before the sized calls: kvf_poll, ...)
macros_only=$(grep -oE '^#define kvf_[a-z_0-9]+\(' "$ROOT/include/kvferry.h" | sed 's/^#define //; s/($//' | sort -u |
  comm -23 - <(grep -oE '\bkvf_[a-z_0-9]+;' "$ROOT/packaging/libkvferry.map" | tr -d ';' | sort -u))
declared=$(grep -oE '\bkvf_[a-z_0-9]+ *\(' "$ROOT/include/kvferry.h" | tr -d '( ' | sort -u | comm -23 - <(echo "$macros_only"))
[ "$exported" = "$declared" ] || fail "libkvferry exports other than kvferry.h declares: $(diff <(echo "$declared") <(echo "$exported") | grep '^[<>]' | tr '\n' ' ')"
pyver=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/python/pyproject.toml")
[ "$pyver" = "$(PKG_CONFIG_PATH=$P/lib/pkgconfig pkg-config --modversion kvferry)" ] ||
  fail "python/pyproject.toml's version $pyver differs from kvferry.pc's"
v=$(env -u KVFERRY_BUILD "$P/bin/kvferry" --version) || fail "installed kvferry --version"
[ "$v" = "kvferry $pyver" ] || fail "installed kvferry --version says '$v'"
rc=0; out=$(env -u KVFERRY_BUILD "$P/bin/kvferry" setup 2>&1) || rc=$?
[ $rc = 1 ] && grep -q "this kvferry is installed in $P" <<<"$out" || fail "installed kvferry setup: exit $rc: $out"
pass "cmake --install: binaries, libkvferry (soname, only the header's API exported), header, kvferry.pc, supervisor, shapes, unit"

# A sanitizer build's libkvferry needs its runtime first: the engine is built with the same
# -fsanitize, and Python gets the runtimes preloaded (its own allocations are not ours to judge).
SAN=$(sed -n 's/^KVF_SANITIZE:[A-Z]*=//p' "$B/CMakeCache.txt" 2>/dev/null || true)
case "$SAN" in OFF|FALSE|NO|0) SAN="" ;; esac
PRE=()
for rt in asan ubsan tsan; do
  lib=$(ldd "$P/lib/libkvferry.so.0" | awk -v r="lib$rt.so" 'index($1, r) == 1 { print $3 }')
  [ -z "$lib" ] || PRE+=("$lib")
done
PYENV=()
[ ${#PRE[@]} -eq 0 ] || PYENV=(LD_PRELOAD="${PRE[*]}" ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0")

# ---- a C engine from pkg-config, against instances of the installed supervisor ----
flags="$(PKG_CONFIG_PATH=$P/lib/pkgconfig pkg-config --cflags --libs kvferry)${SAN:+ -fsanitize=$SAN}"
libdir=$(PKG_CONFIG_PATH=$P/lib/pkgconfig pkg-config --variable=libdir kvferry)
# shellcheck disable=SC2086
$CC -std=c17 -Wall -Wextra -Werror -o "$R/engine" "$ROOT/tests/install_engine.c" $flags -Wl,-rpath,"$libdir" ||
  fail "the engine does not build with pkg-config --cflags --libs kvferry ($flags)"
loaded=$(ldd "$R/engine" | awk '$1 == "libkvferry.so.0" { print $3 }')
[ "$(readlink -f "$loaded")" = "$(readlink -f "$P/lib/libkvferry.so.0")" ] ||
  fail "the engine does not load the installed libkvferry: $(ldd "$R/engine")"
IK=(env -u KVFERRY_BUILD "$P/bin/kvferry")
STARTED+=($TAG-d $TAG-p)
"${IK[@]}" up --instance $TAG-d --role decode --model llama-3.1-8b --tp 8 --cache-mib 64 >/dev/null 2>"$R/up.err" ||
  fail "installed kvferry up: $(cat "$R/up.err")"
"${IK[@]}" up --instance $TAG-p --role prefill --model llama-3.1-8b --tp 8 --cache-mib 64 >/dev/null 2>"$R/up.err" ||
  fail "installed kvferry up: $(cat "$R/up.err")"
apid=$(sed -n 's/.* started allocator (pid \([0-9]*\))$/\1/p' "$R/$TAG-p/supervisor.log" | tail -n1)
[ "$(readlink -f "/proc/$apid/exe")" = "$(readlink -f "$P/bin/kvf-allocator")" ] ||
  fail "the installed supervisor did not start the installed allocator (pid $apid: $(readlink -f "/proc/$apid/exe"))"
"$R/engine" $TAG-p $TAG-d 6 || fail "the engine's requests"
pass "a C engine built with pkg-config moved 6 verified requests between instances the installed supervisor started"

# ---- pip install ./python into a fresh venv, offline ----
$PY -m venv --system-site-packages "$R/venv" || fail "python3 -m venv"
cp -r "$ROOT/python" "$R/pysrc" # pip builds in the source folder: leave the tree clean
"$R/venv/bin/pip" install -q --no-index --no-build-isolation "$R/pysrc" >"$R/pip.out" 2>&1 ||
  fail "pip install ./python: $(tail -n 5 "$R/pip.out")"
# Found through the dynamic linker's path, and through the prefix's lib/ (the C library
# installed into the venv's prefix).
got=$(cd / && env -u KVFERRY_BUILD "${PYENV[@]}" LD_LIBRARY_PATH="$P/lib" "$R/venv/bin/python" -c '
import kvferry, sys
with kvferry.Client(sys.argv[1]) as c:
    print(kvferry.library_path(), c.layout.num_layers)' $TAG-p) || fail "import kvferry in the venv (LD_LIBRARY_PATH)"
[ "$(awk '{print $2}' <<<"$got")" = 32 ] || fail "the venv's kvferry read a wrong layout: $got"
cmake --install "$B" --prefix "$R/venv" >/dev/null 2>&1 || fail "cmake --install into the venv"
got=$(cd / && env -u KVFERRY_BUILD "${PYENV[@]}" "$R/venv/bin/python" -c 'import kvferry; print(kvferry.library_path())') ||
  fail "import kvferry in the venv (the prefix's lib)"
[ "$got" = "$R/venv/lib/libkvferry.so.0" ] || fail "the venv's kvferry took $got, not the prefix's lib"
show=$("$R/venv/bin/pip" show kvferry 2>/dev/null) || fail "pip show kvferry"
grep -q "^Version: $pyver" <<<"$show" || fail "pip show kvferry: not version $pyver: $show"
grep -q "^Requires: msgpack" <<<"$show" || fail "pip show kvferry: msgpack not required: $show"
pass "pip install ./python (offline, fresh venv): imports and attaches through LD_LIBRARY_PATH and the prefix's lib"
"${IK[@]}" down --instance $TAG-p --instance $TAG-d >/dev/null 2>&1 || fail "installed kvferry down"

# ---- the Debian package ----
if [ "$(id -u)" != 0 ]; then
  echo "skipped: the Debian package part (dpkg -i needs root)"
  exit 77
fi
if dpkg-query -W -f='${Status}' kvferry 2>/dev/null | grep -q 'install ok installed'; then
  fail "a kvferry package is installed already; this test installs and removes its own (dpkg -r kvferry first)"
fi
(cd "$B" && cpack -G DEB) >"$R/cpack.out" 2>&1 || fail "cpack -G DEB: $(tail -n 5 "$R/cpack.out")"
deb=$(ls -t "$B"/kvferry_*.deb | head -n1)
AT_EXIT+=("dpkg -P kvferry >/dev/null 2>&1 || true")
dpkg -i "$deb" >"$R/dpkg.out" 2>&1 || fail "dpkg -i $deb: $(tail -n 5 "$R/dpkg.out")"
for f in /usr/bin/kvferry /usr/bin/kvf-metrics /usr/lib/libkvferry.so.0 /usr/include/kvferry.h \
         /usr/lib/pkgconfig/kvferry.pc /usr/share/kvferry/model-shapes.json /usr/lib/systemd/system/kvferry@.service; do
  [ -e "$f" ] || fail "the package lacks $f"
done
grep -q '^ExecStart=/usr/bin/kvferry up' /usr/lib/systemd/system/kvferry@.service || fail "the packaged unit's ExecStart"
(cd / && env -u KVFERRY_BUILD KVFERRY_RUN_DIR="$R/deb-run" kvferry demo --requests 20 --cache-mib 128 --quiet) >"$R/demo.out" 2>&1 ||
  fail "the package's kvferry demo: $(tail -n 8 "$R/demo.out")"
grep -q "result       OK" "$R/demo.out" || fail "the package's demo did not say OK"
dpkg -r kvferry >/dev/null 2>&1 || fail "dpkg -r kvferry"
dpkg -P kvferry >/dev/null 2>&1 || true # nothing of the test left in dpkg's database
[ ! -e /usr/bin/kvferry ] || fail "dpkg -r left /usr/bin/kvferry"
pass "cpack -G DEB: dpkg -i, its kvferry demo --requests 20 verified every request, dpkg -r"
