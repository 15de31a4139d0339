#!/bin/sh
# PID 1 of the test VM (dash; the tools are busybox's), put at /init by tests/vm/run.sh: mounts, loads the modules,
# creates the veth pair and the rxe device(s), waits for them to be ACTIVE, runs the commands in
# /etc/kvf-vm/tests in order, reports, powers off.
#
# Result lines go to the console and to /dev/ttyS1, which only run.sh reads (the kernel never
# writes there, so nothing can garble or forge them):
#   KVF-VM-READY net=pair devices=rxe0,rxe1 uptime=3.12
#   KVF-VM-RESULT name=NAME rc=RC secs=S [timeout=1]
#   KVF-VM-DONE commands=N failed=F
#   KVF-VM-SETUP-FAILED step=STEP (instead of READY; then power-off)
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
IP=/usr/sbin/ip # iproute2's: busybox's applets that run programs would pick their own ip
RDMA=/usr/bin/rdma
# PID 1 starts with no /dev/console when the initramfs has no device nodes (built without root).
mount -t devtmpfs dev /dev 2>/dev/null
exec </dev/console >/dev/console 2>&1

RES=/dev/ttyS1
result() {
        echo "$*"
        echo "$*" >"$RES"
}
off() {
        sync
        poweroff -f
        sleep 10 # poweroff -f does not return; should it, the kernel panics when init exits
}
setup_failed() { # setup_failed STEP MESSAGE
        echo "kvf-vm: setup failed: $1: $2"
        result "KVF-VM-SETUP-FAILED step=$1"
        off
}
run() { # run STEP COMMAND...: a setup step that must work
        step=$1
        shift
        "$@" || setup_failed "$step" "$* (exit $?)"
}
uptime_s() { cut -d' ' -f1 /proc/uptime; }

mkdir -p /proc /sys /dev/shm /dev/pts /tmp /run
run mount mount -t proc proc /proc
run mount mount -t sysfs sys /sys
run mount mount -t tmpfs -o mode=1777 shm /dev/shm
run mount mount -t tmpfs -o mode=1777 tmp /tmp
run mount mount -t tmpfs run /run
mount -t devpts devpts /dev/pts 2>/dev/null
# shellcheck source=/dev/null # written by run.sh: NET, CMD_TIMEOUT
. /etc/kvf-vm/conf

while read -r m; do
        # insmod, not modprobe: the image has no modules.dep; run.sh put them in dependency order.
        out=$(insmod "/lib/modules/$m" 2>&1) || setup_failed "insmod-${m#*-}" "$out"
done </etc/kvf-vm/modules
run mount mount -t configfs configfs /sys/kernel/config

A=10.77.0.1
B=10.77.0.2
run net $IP link set lo up
run net $IP link add veth0 type veth peer name veth1
run net $IP addr add $A/24 dev veth0
run net $IP addr add $B/24 dev veth1
run net $IP link set veth0 up
run net $IP link set veth1 up
if [ "$NET" = pair ]; then
        # Both addresses are local, so the kernel would deliver A -> B through lo, where rxe never
        # sees it (and rdma_cm refuses lo). Rules for locally generated packets (iif lo) send them
        # out of the other end of the pair instead; the local table moves behind those rules; the
        # receiving end must accept packets whose source is one of our own addresses.
        run route $IP rule add pref 10 iif lo from $A to $B lookup 101
        run route $IP rule add pref 10 iif lo from $B to $A lookup 102
        run route $IP route add $B dev veth0 src $A table 101
        run route $IP route add $A dev veth1 src $B table 102
        run route $IP rule add pref 100 lookup local
        run route $IP rule del pref 0 lookup local
        for c in all veth0 veth1; do
                echo 1 >/proc/sys/net/ipv4/conf/$c/accept_local
                echo 0 >/proc/sys/net/ipv4/conf/$c/rp_filter
        done
        # Static neighbours: veth answers ARP at once, inside the window in which rdma_cm's
        # address resolution has sent its request but not yet queued itself for the answer's
        # notification, and the first connection would then wait out the resolve timeout.
        run neigh $IP neigh replace $B lladdr "$(cat /sys/class/net/veth1/address)" dev veth0 nud permanent
        run neigh $IP neigh replace $A lladdr "$(cat /sys/class/net/veth0/address)" dev veth1 nud permanent
        run rxe $RDMA link add rxe0 type rxe netdev veth0
        run rxe $RDMA link add rxe1 type rxe netdev veth1
        DEVS="rxe0 rxe1"
        export KVF_VM_CLIENT_IP=$A KVF_VM_SERVER_IP=$B KVF_VM_CLIENT_DEV=rxe0 KVF_VM_SERVER_DEV=rxe1
else
        # One device: both peers on A; rxe loops the packets back itself (they never reach veth).
        run rxe $RDMA link add rxe0 type rxe netdev veth0
        DEVS=rxe0
        export KVF_VM_CLIENT_IP=$A KVF_VM_SERVER_IP=$A KVF_VM_CLIENT_DEV=rxe0 KVF_VM_SERVER_DEV=rxe0
fi
export KVF_VM=1 KVF_VM_NET="$NET"

for d in $DEVS; do
        n=0
        until $RDMA link show "$d/1" 2>/dev/null | grep -q 'state ACTIVE'; do
                n=$((n + 1))
                [ $n -le 300 ] || setup_failed "rxe-active" "$d not ACTIVE after 30 s: $($RDMA link show 2>&1)"
                sleep 0.1
        done
done
$RDMA link show
$IP -br addr show
result "KVF-VM-READY net=$NET devices=$(echo "$DEVS" | tr ' ' ,) uptime=$(uptime_s)"

total=0
failed=0
for f in /etc/kvf-vm/tests/*.cmd; do
        [ -e "$f" ] || continue
        name=$(cat "${f%.cmd}.name")
        total=$((total + 1))
        echo "==== kvf-vm: $name: $(cat "$f")"
        t0=$(uptime_s)
        rm -f /run/kvf-vm-timeout
        # Its own session, so that the watchdog can end the command and whatever it started.
        (cd /tmp && exec setsid /bin/sh "$f" </dev/null) &
        pid=$!
        (
                sleep "$CMD_TIMEOUT"
                touch /run/kvf-vm-timeout
                echo "kvf-vm: $name: still running after ${CMD_TIMEOUT}s: SIGTERM"
                kill -TERM -$pid 2>/dev/null || kill -TERM $pid 2>/dev/null
                sleep 5
                kill -KILL -$pid 2>/dev/null || kill -KILL $pid 2>/dev/null
        ) &
        dog=$!
        wait $pid
        rc=$?
        kill $dog 2>/dev/null
        wait $dog 2>/dev/null
        secs=$(awk -v a="$t0" -v b="$(uptime_s)" 'BEGIN { printf "%.2f", b - a }')
        extra=
        [ ! -e /run/kvf-vm-timeout ] || extra=" timeout=1"
        [ $rc -eq 0 ] || failed=$((failed + 1))
        result "KVF-VM-RESULT name=$name rc=$rc secs=$secs$extra"
done
result "KVF-VM-DONE commands=$total failed=$failed"
off
