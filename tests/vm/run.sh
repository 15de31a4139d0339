#!/usr/bin/env bash
# Runs test commands inside a Debian kernel booted with qemu under software emulation (no KVM, no
# RDMA NIC needed), with soft-RoCE (rdma_rxe) devices up and ACTIVE, and reports each command's
# exit status.
#
# Usage: tests/vm/run.sh [options] [--] COMMAND...
#
# Each COMMAND is one shell command line, run in the VM by /bin/sh (dash) in /tmp; its result is
# named by the base name of its first word (rdma_smoke), made unique with .2, .3 when repeated.
#   --bin PATH          put the program PATH at /bin/NAME in the VM (on PATH) with every library
#                       it needs (per ldd); repeatable
#   --file SRC[:DEST]   copy a file or directory into the VM as is (DEST default: /data/NAME)
#   --test NAME=CMD     a command with an explicit result name; commands run in the order given
#   --net pair|single   pair (default): veth0 10.77.0.1 with rxe0, veth1 10.77.0.2 with rxe1 and
#                       policy routing, so that RoCE packets really cross the veth pair;
#                       single: rxe0 on veth0 only, both peers on 10.77.0.1 (rxe's own loopback)
#   --module NAME       load one more kernel module, with what it depends on; repeatable
#   --tools             include ibv_devinfo, ibv_rc_pingpong, rping, ucmatose, ib_write_bw, ...
#   --timeout S         the whole VM run, boot to power-off (default 400)
#   --cmd-timeout S     each command (default 120); it gets SIGTERM, then SIGKILL after 5 s
#   --smp N --mem MIB   the VM (default 2 CPUs, 1024 MiB)
#   --cache DIR         the kernel cache (default $KVF_VM_CACHE, else ~/.cache/kvferry/vm)
#   --keep              keep the work directory (it is always kept on failure)
#   --quiet             print the guest's console only on failure
#   --verbose           the kernel's boot messages too (no "quiet" on its command line)
#   --no-install        never run apt-get for missing packages; skip (77) instead
#   --help
#
# In the VM, commands see KVF_VM=1, KVF_VM_SERVER_IP, KVF_VM_CLIENT_IP (the addresses a server and
# a client should use), KVF_VM_SERVER_DEV, KVF_VM_CLIENT_DEV (their rxe devices) and KVF_VM_NET.
# /bin/sh is dash; the other tools are busybox's, but ip and rdma are iproute2's.
#
# Exit codes: 0 every command exited 0; 1 a command failed, or the VM did (timeout, kernel panic,
# setup, missing result lines); 2 usage error; 77 skipped (a package is missing and we are not
# root, or no kernel can be fetched).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MA=$(gcc -print-multiarch 2>/dev/null || true)
MA=${MA:-x86_64-linux-gnu}
LIBDIR=/usr/lib/$MA

# What the harness needs on the host: "what to look for:package".
NEEDS=(/usr/bin/qemu-system-x86_64:qemu-system-x86 /bin/busybox:busybox-static /usr/bin/cpio:cpio /bin/dash:dash
       /usr/sbin/ip:iproute2 /usr/bin/rdma:iproute2 /etc/libibverbs.d/rxe.driver:ibverbs-providers
       "$LIBDIR/libibverbs.so.1:libibverbs1" "$LIBDIR/librdmacm.so.1:librdmacm1"
       /usr/bin/dpkg-deb:dpkg /usr/bin/apt-get:apt)
TOOL_NEEDS=(/usr/bin/ibv_devinfo:ibverbs-utils /usr/bin/rping:rdmacm-utils /usr/bin/ib_write_bw:perftest)
TOOLS=(ibv_devinfo ibv_devices ibv_rc_pingpong rping ucmatose udaddy rdma_server rdma_client
       ib_write_bw ib_write_lat ib_read_bw ib_send_bw)
# Modules loaded in the VM, with what they depend on (read from each module's .modinfo).
# crc32_generic is no declared dependency: rxe asks the crypto API for "crc32" at `rdma link add`
# ("failed to init crc32 algorithm" without it).
MODULES=(crc32_generic veth rdma_ucm ib_uverbs rdma_rxe)

say() { printf 'vm: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }
skip() { say "skipped: $*"; exit 77; }
usage() { sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; }
bad_usage() { say "$*"; say "try: $0 --help"; exit 2; }

BINS=() FILES=() NAMES=() CMDS=() EXTRA_MODULES=()
NET=pair WITH_TOOLS=0 TIMEOUT=400 CMD_TIMEOUT=120 SMP=2 MEM=1024 KEEP=0 QUIET=0 VERBOSE=0 INSTALL=1
CACHE=${KVF_VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvferry/vm}

add_cmd() { # add_cmd NAME CMD: NAME may be empty (derived from CMD)
  local name=$1 cmd=$2 base n=2 i
  if [ -z "$name" ]; then
    read -r base _ <<<"$cmd" || true
    base=$(basename -- "${base:-cmd}")
    base=${base//[^A-Za-z0-9._-]/_}
    name=$base
  fi
  [[ $name =~ ^[A-Za-z0-9._-]+$ ]] || bad_usage "bad test name '$name' (letters, digits, . _ - only)"
  base=$name
  while printf '%s\n' "${NAMES[@]}" | grep -qxF -- "$name"; do name=$base.$n; n=$((n + 1)); done
  NAMES+=("$name") CMDS+=("$cmd")
}

posint() { [[ $2 =~ ^[1-9][0-9]*$ ]] || bad_usage "$1 wants a positive integer, not '$2'"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --bin) [ $# -ge 2 ] || bad_usage "--bin needs a path"; BINS+=("$2"); shift 2 ;;
    --file) [ $# -ge 2 ] || bad_usage "--file needs SRC[:DEST]"; FILES+=("$2"); shift 2 ;;
    --test)
      if [ $# -lt 2 ] || [[ $2 != *=* ]]; then bad_usage "--test wants NAME=COMMAND"; fi
      add_cmd "${2%%=*}" "${2#*=}"; shift 2 ;;
    --net) [ $# -ge 2 ] || bad_usage "--net needs pair or single"; NET=$2; shift 2
      [ "$NET" = pair ] || [ "$NET" = single ] || bad_usage "--net: pair or single, not '$NET'" ;;
    --module) [ $# -ge 2 ] || bad_usage "--module needs a name"; EXTRA_MODULES+=("${2//-/_}"); shift 2 ;;
    --tools) WITH_TOOLS=1; shift ;;
    --timeout) posint "$1" "${2:-}"; TIMEOUT=$2; shift 2 ;;
    --cmd-timeout) posint "$1" "${2:-}"; CMD_TIMEOUT=$2; shift 2 ;;
    --smp) posint "$1" "${2:-}"; SMP=$2; shift 2 ;;
    --mem) posint "$1" "${2:-}"; MEM=$2; shift 2 ;;
    --cache) [ $# -ge 2 ] || bad_usage "--cache needs a directory"; CACHE=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --quiet) QUIET=1; shift ;;
    --verbose) VERBOSE=1; shift ;;
    --no-install) INSTALL=0; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; for c in "$@"; do add_cmd "" "$c"; done; break ;;
    -*) bad_usage "unknown option $1" ;;
    *) add_cmd "" "$1"; shift ;;
  esac
done
[ ${#CMDS[@]} -gt 0 ] || bad_usage "no command to run in the VM"

# ---- host packages ----

apt_install() { # apt_install PKG...: as root, or skip with the line to run
  local line="apt-get update && apt-get install -y --no-install-recommends $*"
  [ "$INSTALL" = 1 ] || skip "missing packages (--no-install); run as root: $line"
  [ "$(id -u)" = 0 ] || skip "missing packages; run as root: $line"
  say "installing: $*"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q -o DPkg::Lock::Timeout=300 >&2 || die "apt-get update failed"
  apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=300 "$@" >&2 ||
    die "could not install: $*"
}

check_host() {
  local n miss=() all=("${NEEDS[@]}")
  [ "$WITH_TOOLS" = 0 ] || all+=("${TOOL_NEEDS[@]}")
  for n in "${all[@]}"; do
    [ -e "${n%%:*}" ] || miss+=("${n##*:}")
  done
  if [ ${#miss[@]} -gt 0 ]; then
    mapfile -t miss < <(printf '%s\n' "${miss[@]}" | sort -u)
    apt_install "${miss[@]}"
  fi
  for n in "${all[@]}"; do
    [ -e "${n%%:*}" ] || die "${n%%:*} still missing after installing ${n##*:}"
  done
}

# ---- the kernel: Debian's image package, downloaded once, never installed ----

# Sets KDIR (vmlinuz, modules/ = lib/modules/<release>/) to the kernel that linux-image-amd64
# depends on, downloading and unpacking it into $CACHE when it is not there yet. Offline, the
# newest kernel already in the cache does.
fetch_kernel() {
  local pkg ver key tmp deb
  mkdir -p "$CACHE" || die "cannot create the cache directory $CACHE"
  exec 9>"$CACHE/lock"
  flock -w 900 9 || die "another run holds $CACHE/lock for more than 15 minutes"
  read -r pkg ver < <(wanted_kernel) || true
  if [ -z "${pkg:-}" ] && [ "$(id -u)" = 0 ] && [ "$INSTALL" = 1 ] && [ -z "$(cached_kernels)" ]; then
    apt-get update -q -o DPkg::Lock::Timeout=300 >&2 || true
    read -r pkg ver < <(wanted_kernel) || true
  fi
  if [ -n "${pkg:-}" ] && [ -n "${ver:-}" ]; then
    key=${pkg}_${ver}
    if [ ! -e "$CACHE/$key/.complete" ]; then
      say "downloading $pkg $ver (about 70 MB, once; cached in $CACHE)"
      tmp=$(mktemp -d "$CACHE/tmp.XXXXXX")
      local -a sandbox=()
      [ "$(id -u)" != 0 ] || sandbox=(-o APT::Sandbox::User=root)
      if (cd "$tmp" && apt-get download -q "${sandbox[@]}" "$pkg=$ver" >&2); then
        deb=$(echo "$tmp"/*.deb)
        dpkg-deb -x "$deb" "$tmp/x" || die "cannot unpack $deb"
        rm -f "$deb"
        unpack_kernel "$tmp/x" "$tmp/$key"
        rm -rf "${CACHE:?}/$key"
        mv "$tmp/$key" "$CACHE/$key"
        touch "$CACHE/$key/.complete"
        # Older kernels go: the cache holds one (about 400 MB unpacked).
        local d
        for d in "$CACHE"/linux-image-*; do
          [ "$d" = "$CACHE/$key" ] || rm -rf "$d"
        done
      else
        say "could not download $pkg $ver"
      fi
      rm -rf "$tmp"
    fi
  fi
  if [ -n "${key:-}" ] && [ -e "$CACHE/$key/.complete" ]; then
    KDIR=$CACHE/$key
  else
    KDIR=$(cached_kernels | tail -n 1)
    [ -n "$KDIR" ] || skip "no kernel in $CACHE and none could be downloaded (is apt's package list there? apt-get update)"
    say "using the cached kernel $(basename "$KDIR")"
  fi
  exec 9>&-
}

wanted_kernel() { # prints "package version" of the image linux-image-amd64 depends on
  apt-cache show --no-all-versions linux-image-amd64 2>/dev/null |
    sed -n 's/^Depends:.*\(linux-image-[0-9][^ ,]*\) (= \([^)]*\)).*/\1 \2/p' | head -n 1
}

cached_kernels() {
  local d
  for d in "$CACHE"/linux-image-*/; do
    [ -e "$d/.complete" ] && echo "${d%/}"
  done | sort -V
}

unpack_kernel() { # unpack_kernel TREE OUT: vmlinuz and the modules tree of one unpacked package
  local tree=$1 out=$2 rel
  rel=$(find "$tree/lib/modules" -mindepth 1 -maxdepth 1 -printf '%f\n' 2>/dev/null | head -n 1)
  if [ -z "$rel" ] || [ ! -f "$tree/boot/vmlinuz-$rel" ]; then
    die "no vmlinuz-<release> and lib/modules/<release> in the kernel package"
  fi
  mkdir -p "$out"
  mv "$tree/boot/vmlinuz-$rel" "$out/vmlinuz"
  mv "$tree/lib/modules/$rel" "$out/modules"
  echo "$rel" >"$out/release"
}

# ---- modules: the closure of what we load, in dependency order ----

declare -A MOD_PATH=() MOD_SEEN=()
MOD_ORDER=()

mod_index() {
  local f n
  while IFS= read -r f; do
    n=${f##*/}; n=${n%%.ko*}; n=${n//-/_}
    MOD_PATH[$n]=$f
  done < <(find "$KDIR/modules" -name '*.ko' -o -name '*.ko.xz' -o -name '*.ko.zst' -o -name '*.ko.gz')
}

mod_cat() { # the module's ELF file, decompressed
  case "$1" in
    *.xz) xz -dc -- "$1" ;;
    *.zst) zstd -q -dc -- "$1" ;;
    *.gz) gzip -dc -- "$1" ;;
    *) cat -- "$1" ;;
  esac
}

mod_visit() {
  local m=$1 f deps d
  [ -z "${MOD_SEEN[$m]:-}" ] || return 0
  MOD_SEEN[$m]=1
  f=${MOD_PATH[$m]:-}
  if [ -z "$f" ]; then
    # Built into this kernel: nothing to load.
    grep -q "/${m//_/[-_]}\.ko\$" "$KDIR/modules/modules.builtin" 2>/dev/null && return 0
    die "kernel module $m: not in $KDIR/modules and not built in"
  fi
  deps=$(mod_cat "$f" | tr '\0' '\n' | grep -a -m 1 '^depends=' | cut -d= -f2) || true
  for d in ${deps//,/ }; do mod_visit "${d//-/_}"; done
  MOD_ORDER+=("$m")
}

# ---- the initramfs ----

copy_in() { # copy_in SRC DEST-in-image: the file SRC points to, at DEST, parents created
  mkdir -p "$IMG$(dirname "$2")"
  cp -L --preserve=mode -- "$1" "$IMG$2"
}

add_elf() { # add_elf PATH DEST: PATH at DEST with every library ldd lists
  local path=$1 dest=$2 line lib
  copy_in "$path" "$dest"
  file_is_elf "$path" || return 0
  local out
  out=$(ldd -- "$path" 2>&1) || {
    [[ $out == *"not a dynamic executable"* || $out == *"statically linked"* ]] && return 0
    die "ldd $path: $out"
  }
  while IFS= read -r line; do
    case "$line" in
      *"not found"*) die "$path needs a library that is not here: ${line//	/}" ;;
      *"=> /"*) lib=${line#*=> }; lib=${lib%% (*} ;;
      *"/"*" ("*) lib=${line%% (*}; lib=${lib//[[:space:]]/} ;;
      *) continue ;;
    esac
    [ -e "$IMG$lib" ] || copy_in "$lib" "$lib"
  done <<<"$out"
}

file_is_elf() { [ "$(head -c 4 -- "$1" | od -An -c | tr -d ' ')" = '177ELF' ]; }

build_image() {
  local d
  IMG=$WORK/root
  mkdir -p "$IMG"/{usr/bin,usr/sbin,usr/lib/modules,usr/lib64,proc,sys,dev,tmp,run,data,etc/kvf-vm/tests}
  # Merged /usr, as on the host: ldd's /lib/... and /lib64/... paths land where they should.
  for d in bin sbin lib lib64; do ln -s "usr/$d" "$IMG/$d"; done

  # The shell is dash: busybox's sh runs its own applets before anything on PATH, so `ip` in a
  # command would be busybox's, which knows neither veth nor `ip rule` details.
  add_elf /bin/dash /usr/bin/dash
  ln -s dash "$IMG/usr/bin/sh"
  add_elf /usr/sbin/ip /usr/sbin/ip
  add_elf /usr/bin/rdma /usr/bin/rdma
  add_elf /bin/busybox /usr/bin/busybox
  local a
  while IFS= read -r a; do
    [ -e "$IMG/$a" ] || [ -L "$IMG/$a" ] || ln -s /usr/bin/busybox "$IMG/$a"
  done < <(/bin/busybox --list-full | sed 's,^usr/,,; s,^,usr/,')
  # Threads unwind through libgcc_s, which glibc dlopens: ldd never lists it. awk reads to the
  # end: an early exit would kill ldconfig with SIGPIPE (and this script, under pipefail) once
  # the cache's listing outgrows the pipe (python3-torch's libraries make it over 64 KiB).
  local gcc_s
  gcc_s=$(/sbin/ldconfig -p 2>/dev/null | awk '$1 == "libgcc_s.so.1" && /x86-64/ && !f {print $NF; f = 1}')
  add_elf "${gcc_s:-$LIBDIR/libgcc_s.so.1}" "$LIBDIR/libgcc_s.so.1"
  # libibverbs finds its providers through /etc/libibverbs.d and dlopens them.
  copy_in /etc/libibverbs.d/rxe.driver /etc/libibverbs.d/rxe.driver
  for d in "$LIBDIR"/libibverbs/librxe-rdmav*.so; do
    [ -e "$d" ] || die "no rxe provider in $LIBDIR/libibverbs (ibverbs-providers)"
    add_elf "$d" "$d"
  done
  add_elf "$LIBDIR/librdmacm.so.1" "$LIBDIR/librdmacm.so.1"
  if [ "$WITH_TOOLS" = 1 ]; then
    for a in "${TOOLS[@]}"; do
      [ -x "/usr/bin/$a" ] && add_elf "/usr/bin/$a" "/usr/bin/$a"
    done
  fi
  for a in "${BINS[@]}"; do
    [ -f "$a" ] || die "--bin $a: no such file"
    add_elf "$a" "/usr/bin/$(basename "$a")"
    chmod +x "$IMG/usr/bin/$(basename "$a")"
  done
  for a in "${FILES[@]}"; do
    local src=${a%%:*} dest
    if [[ $a == *:* ]]; then dest=${a#*:}; else dest=/data/$(basename "$src"); fi
    [ -e "$src" ] || die "--file $src: no such file or directory"
    mkdir -p "$IMG$(dirname "$dest")"
    cp -a -- "$src" "$IMG$dest"
  done

  local i=0 m
  : >"$IMG/etc/kvf-vm/modules"
  for m in "${MOD_ORDER[@]}"; do
    i=$((i + 1))
    mod_cat "${MOD_PATH[$m]}" >"$IMG/usr/lib/modules/$(printf '%02d' $i)-$m.ko"
    printf '%02d-%s.ko\n' $i "$m" >>"$IMG/etc/kvf-vm/modules"
  done

  i=0
  for m in "${!CMDS[@]}"; do
    i=$((i + 1))
    printf '%s\n' "${NAMES[$m]}" >"$IMG/etc/kvf-vm/tests/$(printf '%03d' $i).name"
    printf '%s\n' "${CMDS[$m]}" >"$IMG/etc/kvf-vm/tests/$(printf '%03d' $i).cmd"
  done
  cat >"$IMG/etc/kvf-vm/conf" <<EOF
NET=$NET
CMD_TIMEOUT=$CMD_TIMEOUT
EOF
  cp "$HERE/init.sh" "$IMG/init"
  chmod 755 "$IMG/init"
  (cd "$IMG" && find . -print0 | LC_ALL=C sort -z |
     cpio --null -o -H newc -R 0:0 --quiet) >"$WORK/initramfs.cpio" || die "cpio failed"
}

# ---- boot, and read what the guest said ----

TP=$(date +%s.%N)
check_host
fetch_kernel
mod_index
for m in "${MODULES[@]}" "${EXTRA_MODULES[@]}"; do mod_visit "$m"; done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvf-vm.XXXXXX")
T0=$(date +%s.%N)
build_image
T1=$(date +%s.%N)

APPEND="console=ttyS0 rdinit=/init panic=-1 oops=panic mitigations=off"
[ "$VERBOSE" = 1 ] || APPEND+=" quiet"
say "booting $(cat "$KDIR/release") (qemu, software emulation, -smp $SMP -m $MEM, timeout ${TIMEOUT}s): ${NAMES[*]}"
QEMU=(qemu-system-x86_64 -nodefaults -no-user-config -machine pc -accel tcg -smp "$SMP" -m "$MEM"
      -nic none -display none -monitor none -no-reboot
      -serial stdio -serial "file:$WORK/results.log" -pidfile "$WORK/qemu.pid"
      -kernel "$KDIR/vmlinuz" -initrd "$WORK/initramfs.cpio" -append "$APPEND")
# ttyS0 is the console (kernel and commands); ttyS1 carries only the guest's result lines, so
# neither kernel messages nor a command's output can garble or forge them.
# Stopped ourselves (Ctrl-C, ctest's timeout): the VM goes too, by its pid. The VM runs in the
# background because bash runs a trap only once the foreground command is over, but at once
# during `wait`.
# shellcheck disable=SC2317 # a trap
stop_vm() {
  local pid
  pid=$(cat "$WORK/qemu.pid" 2>/dev/null) && kill "$pid" 2>/dev/null
  say "stopped; work directory kept: $WORK"
  exit 1
}
trap stop_vm INT TERM
if [ "$QUIET" = 1 ]; then
  timeout -k 5 "$TIMEOUT" "${QEMU[@]}" </dev/null >"$WORK/console.raw" 2>"$WORK/qemu.err" &
  wait $! && QRC=0 || QRC=$?
else
  { set +e; timeout -k 5 "$TIMEOUT" "${QEMU[@]}" </dev/null 2>"$WORK/qemu.err"; echo $? >"$WORK/qemu.rc"; } |
    tee "$WORK/console.raw" | sed -u 's/\r$//; s/^/vm| /' &
  wait $! || true
  QRC=$(cat "$WORK/qemu.rc" 2>/dev/null || echo 1)
fi
trap - INT TERM
T2=$(date +%s.%N)
tr -d '\r' <"$WORK/console.raw" >"$WORK/console.log"
tr -d '\r' <"$WORK/results.log" 2>/dev/null >"$WORK/results.txt" || : >"$WORK/results.txt"

show_console() {
  [ "$QUIET" = 1 ] || return 0
  say "---- guest console ----"
  sed 's/^/vm| /' "$WORK/console.log" >&2
}
fail() {
  say "FAIL: $*"
  show_console
  rm -f "$WORK/initramfs.cpio" # root/ is what it held
  say "work directory kept: $WORK (console.log, results.txt, qemu.err, root/ = the VM's files)"
  exit 1
}

[ ! -s "$WORK/qemu.err" ] || { say "qemu said:"; sed 's/^/  /' "$WORK/qemu.err" >&2; }
grep '^KVF-VM-' "$WORK/results.txt" | sed 's/^/  /' >&2 || true
# Kernel messages only (their "[ seconds]" stamp): a command may print "BUG: " itself.
panic=$(grep -m 1 -E '\] (Kernel panic - not syncing|BUG: |Oops: )' "$WORK/console.log" || true)
[ -z "$panic" ] || fail "the guest kernel crashed: $panic"
if [ "$QRC" = 124 ] || [ "$QRC" = 137 ]; then
  last=$(grep -v '^$' "$WORK/console.log" | tail -n 3 | sed 's/^/    /' || true)
  fail "the VM did not power off within ${TIMEOUT}s (a command or the guest hung); its last console lines:
${last:-    (none)}"
fi
[ "$QRC" = 0 ] || fail "qemu exited with status $QRC"
setup=$(grep -m 1 '^KVF-VM-SETUP-FAILED' "$WORK/results.txt" || true)
[ -z "$setup" ] || fail "VM setup: ${setup#KVF-VM-SETUP-FAILED }"

failed=() missing=()
for i in "${!NAMES[@]}"; do
  line=$(grep -m 1 "^KVF-VM-RESULT name=${NAMES[$i]//./\\.} " "$WORK/results.txt" || true)
  if [ -z "$line" ]; then
    missing+=("${NAMES[$i]}")
  elif [[ $line =~ \ rc=77( |$) ]]; then
    failed+=("${line#KVF-VM-RESULT } (77: skipped inside the VM, where all it needs should be)")
  elif [[ ! $line =~ \ rc=0( |$) ]]; then
    failed+=("${line#KVF-VM-RESULT }")
  fi
done
ready=$(grep -m 1 '^KVF-VM-READY' "$WORK/results.txt" || true)
say "$(awk -v p="$TP" -v a="$T0" -v b="$T1" -v c="$T2" -v r="${ready##*uptime=}" 'BEGIN {
  printf "timing: packages and kernel %.1f s, image %.1f s, VM %.1f s boot to power-off", a - p, b - a, c - b
  if (r != "") printf " (rxe ready at %s s of guest time)", r }')"
[ ${#missing[@]} -eq 0 ] || fail "no result line for: ${missing[*]} (the guest stopped early; see its console)"
grep -q '^KVF-VM-DONE' "$WORK/results.txt" || fail "no KVF-VM-DONE line (the guest stopped early; see its console)"
[ ${#failed[@]} -eq 0 ] || fail "$(printf '%s\n' "${failed[@]}" | sed '2,$s/^/    /')"
say "PASS: ${#NAMES[@]} command(s) in the VM: ${NAMES[*]}"
if [ "$KEEP" = 1 ]; then say "work directory kept: $WORK"; else rm -rf "$WORK"; fi
exit 0
