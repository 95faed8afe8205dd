#!/usr/bin/env bash
# Lifecycle of PVRDMA devices under real guests: one `vrdma serve` process serves two devices
# for pvrdma guests 1 and 2 (10.47.91.21, .22; they reach each other through its same-host
# shared memory), and each step checks that the daemon frees what a guest made and keeps serving:
#   1. both guests up; ibv_rc_pingpong pv1 <-> pv2; the objects the guest kernels hold noted
#   2. driver unload in pv1 (rmmod vmw_pvrdma): its device holds no object, reset counted;
#      reload (modprobe): port ACTIVE again, same objects as at boot; pingpong again
#   2b. (virtio-rdma) a process in pv1 holds a verbs context (PD, MR, CQ, RC QP, through the
#      provider; scripts/virtio-guest/guest/hold-context.py) while the driver is unloaded: the
#      unload does not wait for it, the process gets IB_EVENT_DEVICE_FATAL and closes, the
#      device holds nothing; reload and pingpong again
#   3. pv1 reboots (sysrq b: no driver teardown, QEMU resets the device) LIFECYCLE_REBOOTS
#      times (default 1; 5 for virtio-rdma guests) while pv2 runs ib_write_bw -D against the
#      host's `vrdma perf` (which must pass): same objects as at boot after each, nothing left
#      of before; pingpong again
#   4. QEMU of pv1 killed (SIGKILL) in the middle of an ib_write_bw against the host's
#      `vrdma perf`, while pv2 is in the middle of ibv_rc_pingpong against the host's
#      `vrdma pingpong` (on a second address of the namespace's bridge, 10.47.91.2):
#      pv2's run passes, the daemon lives on and its pv1 device holds nothing; a new QEMU
#      for pv1 connects to the same socket, boots, and pingpongs with pv2
#   The daemon is the same process from start to end (its PID checked after every step).
#   scripts/pvrdma-guest/lifecycle.sh      # about 4 minutes under TCG
#   PVRDMA_KIND=virtio-pci scripts/pvrdma-guest/lifecycle.sh   # virtio-rdma guests
# Builds vrdma unless PVRDMA_NO_BUILD=1. Exit: the number of failed checks (0: all passed),
# 125 the harness failed. Logs: target/pvrdma-guest/lifecycle/ (summary.txt, the daemon's log).
set -uo pipefail
. "$(dirname "$0")/config.sh"
. "$PV_DIR/lib.sh"
need_root
OUT=$PV_OUT/lifecycle
# the guests' driver, and the counter of the resets of their device
if [ "$PV_KIND" = virtio-pci ]; then DRV=virtio_rdma; RESETS=pci.resets; REBOOTS=${LIFECYCLE_REBOOTS:-5}
else DRV=vmw_pvrdma; RESETS=pvrdma.resets; REBOOTS=${LIFECYCLE_REBOOTS:-1}; fi
SERVE=$PV_RUN/serve            # the shared daemon's sockets, log and PID
LIFE=1800
rm -rf "$OUT"; mkdir -p "$OUT"
say() { echo "lifecycle: $*" >&2; }
FAILED=0
check() {   # check NAME CMD...: runs CMD, records ok/FAIL
    if "${@:2}" > "$OUT/check.$(echo "$1" | tr -c 'a-zA-Z0-9\n' _).log" 2>&1; then
        printf '%-64s ok\n' "$1" | tee -a "$OUT/summary.txt"
    else
        printf '%-64s FAIL\n' "$1" | tee -a "$OUT/summary.txt"
        FAILED=$((FAILED + 1))
    fi
}

if [ "${PVRDMA_NO_BUILD:-0}" != 1 ]; then
    cargo build --release --locked -p vrdma --manifest-path "$PROJECT_ROOT/Cargo.toml" > "$OUT/build.log" 2>&1 \
        || { tail -30 "$OUT/build.log"; exit 125; }
fi
pv_images > "$OUT/image.log" 2>&1 || { tail -30 "$OUT/image.log"; exit 125; }
for n in 1 2; do
    if qemu_pid "$n" > /dev/null && [ "${LIFECYCLE_FORCE:-0}" != 1 ]; then
        say "pvrdma guest $n is running (another suite?); LIFECYCLE_FORCE=1 stops it first"
        exit 125
    fi
done

# ---- one daemon, two devices -------------------------------------------------------------------
serve_pid() { shared_serve_pid "$SERVE"; }
cleanup() {
    "$PV_DIR/stop.sh" -i 1 > /dev/null 2>&1
    "$PV_DIR/stop.sh" -i 2 > /dev/null 2>&1
    for f in "$OUT"/host.*.pid; do [ -e "$f" ] && kill -- -"$(cat "$f")" 2>/dev/null; done
    ip -n "$NS" addr del "$NET_PREFIX.2/24" dev "$BR" 2>/dev/null
    shared_serve_stop "$SERVE" "$OUT/stat-final.txt"
    cp "$SERVE/daemon.log" "$OUT/daemon.log" 2>/dev/null
    return 0
}
trap cleanup EXIT
cleanup
shared_serve_start "$SERVE" $LIFE 2 || exit 125
DPID=$(serve_pid) || { say "the daemon did not start"; exit 125; }
say "vrdma serve pid $DPID: pvrdma-g1, pvrdma-g2"

boot() {   # boot N: QEMU for guest N on the shared daemon's sockets
    PVRDMA_REBOOT=1 "$PV_DIR/start.sh" -i "$1" -l $LIFE -x "$SERVE" > "$OUT/start-pv$1.$(date +%s).log" 2>&1 \
        || { tail -40 "$OUT"/start-pv"$1".*.log; say "pvrdma guest $1 did not start"; exit 125; }
}
boot 1
boot 2

# ---- helpers -------------------------------------------------------------------------------------
X1="$PV_DIR/exec.sh -i 1"
X2="$PV_DIR/exec.sh -i 2"
# The daemon publishes its counters once a second: what a check reads must have been published
# after the step it checks (mark). stat_fresh N: `vrdma stat --all pvrdma-gN` published after
# the mark (10 s at most)
MARK=0
mark() { MARK=$(date +%s.%N); }
stat_fresh() {
    local out age i
    for ((i = 0; i < 50; i++)); do
        out=$(timeout 10 "$VRDMA" stat --all "pvrdma-g$1" 2>/dev/null)
        age=$(sed -n 's/.*(counters from \([0-9.]*\) s ago).*/\1/p' <<< "$out" | head -1)
        if [ -n "$age" ] && awk -v n="$(date +%s.%N)" -v a="$age" -v m="$MARK" 'BEGIN { exit !(n - a > m) }'; then
            echo "$out"; return 0
        fi
        sleep 0.2
    done
    echo "$out"; return 1
}
# objects N: the device's object counters ("pds=1 mrs=1 ..."; zeros are not listed)
# (fails when no counters published after the mark could be read)
objects() {
    local st; st=$(stat_fresh "$1") || return 1
    awk '$1 ~ /^objects\./ && $2 != 0 { sub("objects.", "", $1); printf "%s=%s ", $1, $2 }' <<< "$st"
}
counter() { stat_fresh "$1" | awk -v k="$2" '$1 == k { print $2 }'; }
none_held() { local o; o=$(objects "$1") || return 1; [ -z "$o" ]; }
daemon_same() { [ "$(serve_pid)" = "$DPID" ]; }
# pingpong: ibv_rc_pingpong, pv1 the server, pv2 the client
pingpong() {
    local job rc
    job=$($X1 -t 120 -b 'ibv_rc_pingpong -d $RXE_DEV -g $RXE_GID_IDX -n 50 -s 4096') || return 1
    $X1 -t 40 'wait-listen 18515 30' || return 1
    $X2 -t 120 "ibv_rc_pingpong -d \$RXE_DEV -g \$RXE_GID_IDX -n 50 -s 4096 $(pv_ip 1)" || return 1
    wait_for 60 test -e "$job.rc" || return 1
    rc=$(cat "$job.rc"); cat "$job.stdout" "$job.stderr"
    [ "$rc" = 0 ]
}
wait_port() {   # in the guest: vmw_pvrdma's port ACTIVE with its RoCE v2 GID
    local n=$1
    "$PV_DIR/exec.sh" -i "$n" -t 120 'for i in $(seq 600); do
        d=$(ls /sys/class/infiniband 2>/dev/null | head -1)
        [ -n "$d" ] && grep -q ACTIVE /sys/class/infiniband/$d/ports/1/state 2>/dev/null &&
          [ "$(cat /sys/class/infiniband/$d/ports/1/gid_attrs/types/$RXE_GID_IDX 2>/dev/null)" = "RoCE v2" ] && exit 0
        sleep 0.2; done; exit 1'
}
same_as_boot() { local o; o=$(objects 1) || return 1; [ -n "$BOOT1" ] && [ "$o" = "$BOOT1" ]; }
no_panic() {   # the guests' consoles (a panic reboots a guest of PVRDMA_REBOOT=1 silently)
    ! grep -h "Kernel panic" "$(guest_dir 1)/console.log" "$(guest_dir 2)/console.log"
}

# ---- 1. both up ----------------------------------------------------------------------------------
mark
BOOT1=$(objects 1)
echo "pv1's device at boot (the guest kernel's objects): $BOOT1" | tee -a "$OUT/summary.txt"
check "1. the guest kernel's objects on pv1's device ($BOOT1)" test -n "$BOOT1"
check "1. pv1 <-> pv2 ibv_rc_pingpong, one daemon for both" pingpong

# ---- 2. driver unload / reload ------------------------------------------------------------------
mark
resets=$(counter 1 $RESETS)
check "2. rmmod $DRV in pv1" $X1 -t 120 "rmmod $DRV"
mark
check "2. pv1's device holds no object after rmmod ($(objects 1))" none_held 1
check "2. the unload reset the device ($RESETS $resets -> $(counter 1 $RESETS))" \
    test "$(counter 1 $RESETS)" -gt "${resets:-0}"
reload() { $X1 -t 120 "modprobe $DRV" && wait_port 1; }
check "2. modprobe $DRV; port ACTIVE with its GID" reload
mark
check "2. pv1's device holds what it held at boot ($(objects 1))" same_as_boot
check "2. pv1 <-> pv2 ibv_rc_pingpong after the reload" pingpong

# ---- 2b. a process holds a context while the driver goes (virtio-rdma) ------------------------
if [ "$PV_KIND" = virtio-pci ]; then
    cp "$PROJECT_ROOT/scripts/virtio-guest/guest/hold-context.py" "$(guest_dir 1)/share/bin/"
    JH=$($X1 -t 200 -b 'python3 /harness/bin/hold-context.py $RXE_DEV 150')
    held() { grep -q '^ready' "$JH.stdout" 2>/dev/null; }
    check "2b. a process in pv1 holds a context: PD, MR, CQ, RC QP" wait_for 120 held
    mark
    held_objects=$(objects 1)
    check "2b. the device holds its objects besides the kernel's ($held_objects)" \
        test "$held_objects" != "$BOOT1"
    check "2b. rmmod $DRV under it returns" $X1 -t 120 "rmmod $DRV"
    fatal() { wait_for 60 test -e "$JH.rc"; cat "$JH.stdout" "$JH.stderr"; [ "$(cat "$JH.rc")" = 0 ] &&
        grep -q 'device fatal seen' "$JH.stdout"; }
    check "2b. the process got IB_EVENT_DEVICE_FATAL, closed its objects and exited 0" fatal
    mark
    check "2b. pv1's device holds no object ($(objects 1))" none_held 1
    check "2b. modprobe $DRV; port ACTIVE with its GID" reload
    mark
    check "2b. pv1's device holds what it held at boot ($(objects 1))" same_as_boot
    check "2b. pv1 <-> pv2 ibv_rc_pingpong after the reload" pingpong
fi

host_bg() {   # host_bg NAME ARGS...: `vrdma ARGS` in the namespace, in the background, in a
    # session of its own (host.NAME.pid: its leader, so that cleanup stops the whole group)
    local name=$1; shift
    setsid bash -c 'timeout 600 ip netns exec "$0" "${@:2}" > "$1.out" 2>&1; echo $? > "$1.rc"' \
        "$NS" "$OUT/host.$name" "$VRDMA" "$@" < /dev/null > /dev/null 2>&1 &
    echo $! > "$OUT/host.$name.pid"
}

# ---- 3. guest reboots ----------------------------------------------------------------------------
D1=$(guest_dir 1)
# meanwhile pv2 writes to the host for as long as the reboots take (about 25 s each here)
DUR=$((30 + 25 * REBOOTS))
host_bg dbw perf write_bw -e -m 1024 -s 65536 -D "$DUR" -p 18603 --timeout 60
wait_for 30 bash -c "ip netns exec $NS ss -Hltn 'sport = :18603' | grep -q ." || { say "the host's server did not listen"; exit 125; }
JW=$($X2 -t $((DUR + 120)) -b "ib_write_bw -d \$RXE_DEV -x \$RXE_GID_IDX -F -m 1024 -s 65536 -D $DUR -p 18603 $HOST_IP")
for ((r = 1; r <= REBOOTS; r++)); do
    mark
    resets=$(counter 1 $RESETS)
    J=$($X1 -b 'sync; echo b > /proc/sysrq-trigger')
    # once the guest took the job (renamed it), its old "ready" goes; the reboot's init writes it anew
    wait_for 30 test -e "$J.started" && rm -f "$D1/share/out/ready"
    check "3. reboot $r: pv1 rebooted (sysrq b) and is ready again" wait_for 300 test -e "$D1/share/out/ready"
    mark
    check "3. reboot $r: the reboot reset the device ($RESETS $resets -> $(counter 1 $RESETS))" \
        test "$(counter 1 $RESETS)" -gt "${resets:-0}"
    check "3. reboot $r: pv1's device holds what it held at boot ($(objects 1))" same_as_boot
done
wrote() { wait_for $((DUR + 120)) test -e "$JW.rc"; tail -5 "$JW.stdout" "$JW.stderr"
    [ "$(cat "$JW.rc")" = 0 ] && wait_for 60 test -e "$OUT/host.dbw.rc" && [ "$(cat "$OUT/host.dbw.rc")" = 0 ]; }
check "3. pv2's ib_write_bw -D $DUR against the host passed through pv1's $REBOOTS reboot(s)" wrote
check "3. pv1 <-> pv2 ibv_rc_pingpong after the reboots" pingpong
check "3. the same daemon serves (pid $DPID)" daemon_same
check "3. no kernel panic in the guests" no_panic

# ---- 4. QEMU killed mid-transfer -----------------------------------------------------------------
# host: a write_bw server for pv1 (port 18601, on 10.47.91.1) and a pingpong server for pv2
# (18602, on a second address of the bridge, HOST2: each host tool is a device of its own, on
# UDP port 4791 of its address)
HOST2=$NET_PREFIX.2
ip -n "$NS" addr add "$HOST2/24" dev "$BR" 2>/dev/null
host_listens() { wait_for 30 bash -c "ip netns exec $NS ss -Hltn 'sport = :$1' | grep -q ."; }
# (both sleep for completions: two busy-polling host tools take both of this machine's cores
# from the emulated guests and the daemon, and the write_bw server, starved, let pv1's RC QP
# time out until its retries ran out — RETRY_EXC_ERR in the guest, old daemon and new alike)
host_bg bw perf write_bw -e -m 1024 -s 1048576 -n 100000 -p 18601 --timeout 30
host_bg pp pingpong rc -e -m 1024 -s 4096 -n 20000 -p 18602 --timeout 120
host_listens 18601 && host_listens 18602 || { say "the host's servers did not listen"; exit 125; }
J1=$($X1 -t 280 -b "ib_write_bw -d \$RXE_DEV -x \$RXE_GID_IDX -F -m 1024 -s 1048576 -n 100000 -p 18601 $HOST_IP")
# mid-transfer: pv1's device has moved data, and keeps moving it
tx() { counter "$1" engine.tx_packets; }
base2=$(tx 2)
busy() { mark; [ "$(tx 1)" -gt 2000 ] 2>/dev/null; }
wait_for 60 busy
# pv2's pingpong (20 000 round trips, several seconds here), under way before pv1 goes
J2=$($X2 -t 280 -b "ibv_rc_pingpong -d \$RXE_DEV -g \$RXE_GID_IDX -m 1024 -s 4096 -n 20000 -p 18602 $HOST2")
busy2() { mark; [ "$(tx 2)" -gt $((${base2:-0} + 500)) ] 2>/dev/null; }
wait_for 60 busy2
# pv1's transfer moves on: a later publication (within five, a second apart: an RC retry after
# a loss on this loaded host can pause it for a few hundred milliseconds) shows more packets
mark; t1=$(tx 1); t2=$t1
for _ in 1 2 3 4 5; do mark; t2=$(tx 1); [ "${t2:-0}" -gt "${t1:-0}" ] && break; done
echo "pv1 mid-transfer: engine.tx_packets $t1 -> $t2" | tee -a "$OUT/summary.txt"
check "4. pv1 is mid-transfer when its QEMU is killed ($t1 -> $t2 packets)" test "${t2:-0}" -gt "${t1:-0}"
check "4. pv1's ib_write_bw is still running" test ! -e "$J1.rc"
check "4. pv2's pingpong is under way when pv1's QEMU is killed" test ! -e "$J2.rc"
kill -KILL "$(qemu_pid 1)"
mark
passed() {   # passed PREFIX OUTPUT...: waits (300 s) for PREFIX.rc, shows the output, rc 0?
    wait_for 300 test -e "$1.rc"; cat "${@:2}"; [ "$(cat "$1.rc" 2>/dev/null)" = 0 ]
}
check "4. pv2's ibv_rc_pingpong against the host passes meanwhile" passed "$J2" "$J2.stdout" "$J2.stderr"
check "4. the host's pingpong server passes" passed "$OUT/host.pp" "$OUT/host.pp.out"
check "4. the same daemon serves (pid $DPID)" daemon_same
check "4. pv1's device holds no object after its QEMU died ($(objects 1))" none_held 1
check "4. no kernel panic in the guests" no_panic
kill -- -"$(cat "$OUT/host.bw.pid")" 2>/dev/null
"$PV_DIR/stop.sh" -i 1 > /dev/null 2>&1
boot 1
mark
check "4. a new QEMU for pv1 on the same socket: same objects as at boot ($(objects 1))" same_as_boot
check "4. pv1 <-> pv2 ibv_rc_pingpong with the new pv1" pingpong
check "4. the same daemon serves (pid $DPID)" daemon_same
check "the daemon logged no panic" bash -c "! grep -q panicked '$SERVE/daemon.log'"
check "no kernel panic in the guests" no_panic
echo "lifecycle: $FAILED check(s) failed; logs in $OUT"
exit $FAILED
