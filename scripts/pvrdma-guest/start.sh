#!/usr/bin/env bash
# Boot pvrdma guest N in the background; return once its vmw_pvrdma port is ACTIVE with a
# RoCE v2 IPv4 GID and CMD (default: true) has been started in it.
#   scripts/pvrdma-guest/start.sh -i N [-l LIFETIME_S] [-x DIR] ['CMD']
# Guest N (1..8): IP 10.47.91.(20+N) on the rxe harness's bridge, MAC 52:54:00:4c:00:0N,
# TAP vrdtapN in netns rxens. Its device is served by its own `vrdma serve` (in rxens; uplink
# the TAP); both QEMU and the daemon are bounded by LIFETIME_S (default 3600). -x DIR: a daemon
# already serves the device on DIR/gN.vfio.sock and DIR/gN.net.sock (its TAP too; its PID in
# DIR/daemon.pid, if there); none is started, and stop.sh leaves it and the TAP alone. PVRDMA_REBOOT=1: a guest reboot restarts
# the guest (default: QEMU exits). The state, logs and share are in target/pvrdma-guest/run/gN/.
# More commands: exec.sh; stop: stop.sh.
set -uo pipefail
. "$(dirname "$0")/config.sh"
. "$PV_DIR/lib.sh"
need_root

N=""; LIFE=$PV_LIFETIME; EXT=""
while getopts "i:l:x:h" o; do
    case $o in
        i) N=$OPTARG ;; l) LIFE=$OPTARG ;; x) EXT=$OPTARG ;;
        *) sed -n '2,11p' "$0"; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
CMD="${*:-true}"
[ -n "$N" ] || { sed -n '2,11p' "$0"; exit 2; }
check_id "$N"
[[ "$LIFE" =~ ^[0-9]+$ ]] || die "lifetime must be seconds (got '$LIFE')"

[ -s "$PV_IMAGE" ] || die "no image $PV_IMAGE: run $PV_IMAGE_CMD first"
[ -s "$PV_KERNEL" ] && [ -s "$PV_INITRD" ] || die "no kernel/initrd $PV_KERNEL, $PV_INITRD: run $PV_IMAGE_CMD"
timeout 30 "$QEMU11" --version > /dev/null 2>&1 \
    || die "QEMU 11 does not run: run $QEMU11_DIR/setup.sh (scripts/pvrdma-guest/image.sh runs it)"
[ -x "$VRDMA" ] || die "no $VRDMA: cargo build --release -p vrdma"
timeout 10 "$VRDMA" serve --help > /dev/null 2>&1 || die "$VRDMA has no working 'serve' command"
[ -c /dev/net/tun ] || die "no /dev/net/tun"

if p=$(qemu_pid "$N"); then die "pvrdma guest $N is already running (qemu pid $p; stop.sh -i $N)"; fi
# leftovers of an earlier run: daemon, wrappers, TAP (not the TAP an external daemon holds)
if [ -n "$EXT" ]; then PV_KEEP_TAP=1 teardown "$N"; else teardown "$N"; fi

D=$(guest_dir "$N"); OUT=$D/share/out
TAP=$(pv_tap "$N"); MAC=$(pv_mac "$N"); IP=$(pv_ip "$N")
rm -rf "$D"
mkdir -p "$OUT" "$D/share/ctl/jobs"
[ -z "$EXT" ] || echo "$EXT" > "$D/external"
install -m 0755 "$PV_DIR/guest/guest-init.sh" "$D/share/guest-init.sh"
mkdir -p "$D/share/bin"
[ -d "$RXE_HARNESS/guest/bin" ] && cp -r "$RXE_HARNESS/guest/bin/." "$D/share/bin/"
printf '%s\n' "$CMD" > "$D/share/cmd.sh"
cat > "$D/share/guest.env" <<EOF
GUEST_ID=$N
GUEST_IP=$IP
GUEST_MAC=$MAC
HOST_IP=$HOST_IP
NET_PREFIX=$NET_PREFIX
MODE=daemon
CMD_TIMEOUT=$LIFE
READY_TIMEOUT=${PVRDMA_READY_TIMEOUT:-90}
RDMA_KIND=$PV_KIND
EOF
date +%s.%N > "$D/t_start"

fail_start() {
    log "guest $N: $*"
    [ -s "$OUT/setup-failed" ] && log "guest setup failed: $(cat "$OUT/setup-failed")"
    teardown "$N"
    print_debug_tail "$N"
    exit 1
}

# ---- the device daemon, unless one serves it already (-x) -------------------------------------
if [ -n "$EXT" ]; then
    SOCK=$EXT/g$N.vfio.sock; NETSOCK=$EXT/g$N.net.sock
    [ -S "$SOCK" ] && [ -S "$NETSOCK" ] || fail_start "-x $EXT: no sockets g$N.vfio.sock and g$N.net.sock there"
    # (DIR/daemon.pid, when the daemon's starter wrote one, says whether it lives)
    daemon_alive() { [ -S "$SOCK" ] && { [ ! -s "$EXT/daemon.pid" ] || kill -0 "$(cat "$EXT/daemon.pid")" 2>/dev/null; }; }
else
    # ---- network: the rxe harness's namespace and bridge, a persistent TAP for the daemon ---------
    timeout 30 "$RXE_HARNESS/net.sh" up > /dev/null || die "rxe harness net.sh up failed"
    ip -n "$NS" link show "$TAP" > /dev/null 2>&1 || ip -n "$NS" tuntap add dev "$TAP" mode tap \
        || die "cannot create TAP $TAP in $NS"
    ip -n "$NS" link set "$TAP" master "$BR" txqueuelen 10000 up || die "cannot attach $TAP to $BR"

    # ---- the device daemon -----------------------------------------------------------------------
    SOCK=$D/vfio.sock; NETSOCK=$D/net.sock
    # Every guest of the harness is on one virtual network (the namespace's bridge), given its address:
    # daemons that join a rendezvous (MATRIX_SHM=2) exchange through memory within it.
    SPEC="kind=$PV_KIND,socket=$SOCK,netdev=$NETSOCK,uplink=tap:$TAP,mac=$MAC,name=pvrdma-g$N,net=${PV_NET:-pvnet},ip=$(pv_ip "$N")${PVRDMA_DEVICE_OPTS:+,$PVRDMA_DEVICE_OPTS}"
    echo "VRDMA_LOG=$PV_LOG $VRDMA serve --device $SPEC ${PVRDMA_SERVE_ARGS:-}" > "$D/daemon.cmd"
    # shellcheck disable=SC2086 # PVRDMA_SERVE_ARGS: extra options, split on spaces
    setsid nohup timeout -k 10 $((LIFE + 60)) ip netns exec "$NS" env VRDMA_LOG="$PV_LOG" NO_COLOR=1 RUST_BACKTRACE=1 \
        "$VRDMA" serve --device "$SPEC" ${PVRDMA_SERVE_ARGS:-} > "$D/daemon.log" 2>&1 < /dev/null &
    TPID=$!
    echo "$TPID" > "$D/daemon-timeout.pid"
    wait_for 10 bash -c "pgrep -P $TPID > '$D/daemon.pid' || ! kill -0 $TPID 2>/dev/null"
    [ -s "$D/daemon.pid" ] || fail_start "the daemon exited at once or did not start"
    DPID=$(cat "$D/daemon.pid")
    if ! wait_for 30 bash -c "[ -S '$SOCK' ] && [ -S '$NETSOCK' ] || ! kill -0 $DPID 2>/dev/null"; then
        fail_start "the daemon's sockets did not appear within 30 s ($SOCK, $NETSOCK)"
    fi
    daemon_pid "$N" > /dev/null || fail_start "the daemon exited (rc in $D/daemon.log)"

    daemon_alive() { daemon_pid "$N" > /dev/null; }
fi

# ---- QEMU 11 -----------------------------------------------------------------------------------
# The NIC at function 0 (vmw_pvrdma pairs with a vmxnet3 there; virtio_rdma finds its sibling by
# MAC wherever it is), the RDMA function at 1.
NIC=vmxnet3
[ "$PV_KIND" = virtio-pci ] && NIC=virtio-net-pci
ARGS=(
    -name "pvrdma-guest-$N"
    -nodefaults -no-user-config
    -display none -vga none -monitor none
    -accel tcg -cpu max -smp "$PV_CPUS" -m "$PV_MEM"
    -object "memory-backend-memfd,id=mem,size=$PV_MEM,share=on"
    -machine "$PV_MACHINE,memory-backend=mem"
    -kernel "$PV_KERNEL" -initrd "$PV_INITRD"
    -append "console=ttyS0 root=/dev/vda rw init=/sbin/rxe-harness-init panic=-1 quiet loglevel=4 net.ifnames=0 ${PVRDMA_KAPPEND:-}"
    -drive "file=$PV_IMAGE,if=none,id=d0,format=raw,snapshot=on"
    -device "virtio-blk-pci,drive=d0,addr=0x3"
    -fsdev "local,id=hshare,path=$D/share,security_model=none"
    -device "virtio-9p-pci,fsdev=hshare,mount_tag=harness,addr=0x4"
    -netdev "stream,id=n0,server=off,addr.type=unix,addr.path=$NETSOCK"
    -device "$NIC,netdev=n0,mac=$MAC,addr=0x5.0,multifunction=on,romfile="
    -device "{\"driver\":\"vfio-user-pci\",\"socket\":{\"type\":\"unix\",\"path\":\"$SOCK\"},\"addr\":\"0x5.1\",\"x-no-posted-writes\":true}"
    -device "virtio-rng-pci,addr=0x6"
    -serial "file:$D/console.log"
    -pidfile "$D/qemu.pid"
)
[ "${PVRDMA_REBOOT:-0}" = 1 ] || ARGS+=(-no-reboot)
printf '%q ' "$QEMU11" "${ARGS[@]}" > "$D/qemu.cmd"; echo >> "$D/qemu.cmd"
setsid nohup timeout -k 10 "$LIFE" "$QEMU11" "${ARGS[@]}" > "$D/qemu.log" 2>&1 < /dev/null &
echo $! > "$D/qemu-timeout.pid"
QT=$!

# ---- wait for the guest ----------------------------------------------------------------------
end=$(( $(date +%s) + PV_BOOT_TIMEOUT ))
while [ ! -e "$OUT/ready" ]; do
    [ -e "$OUT/setup-failed" ] && fail_start "setup failed in the guest"
    kill -0 "$QT" 2>/dev/null || fail_start "QEMU exited before the guest was ready"
    daemon_alive || fail_start "the daemon exited before the guest was ready"
    [ "$(date +%s)" -lt "$end" ] || fail_start "not ready within ${PV_BOOT_TIMEOUT}s"
    sleep 0.2
done
. <(grep -E '^(RXE_DEV|RXE_GID_IDX|RXE_NETDEV)=' "$OUT/rxe.env")
log "pv$N up: ip $IP dev ${RXE_DEV:-?} gid_idx ${RXE_GID_IDX:-?} netdev ${RXE_NETDEV:-?} ready in $(elapsed_since "$D/t_start")s;" \
    "qemu pid $(qemu_pid "$N"), daemon pid $(if [ -n "$EXT" ]; then echo "external ($EXT)"; else daemon_pid "$N"; fi), tap $TAP; lifetime ${LIFE}s; output in $OUT"
