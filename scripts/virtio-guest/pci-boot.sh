#!/usr/bin/env bash
# Linux guests on vrdma's virtio-rdma device served as a whole virtio-pci function over vfio-user
# (docs/virtio-rdma.md §13.3; `vrdma serve --device kind=virtio-pci`). QEMU 11's vfio-user-pci
# attaches it at 00:05.0 beside a virtio-net (the sibling NIC, whose backend is the daemon's port)
# in a Debian 13 guest (trixie, kernel 6.12; TCG: this machine's Linux guests do not boot under
# KVM) whose image carries the project's virtio_rdma module and rdma-core provider
# (scripts/virtio-guest/image.sh). The guest reports:
#
# - before the module: the PCI function 1af4:106a bound to the stock virtio-pci, a virtio device
#   with ID 42 (0x002a) under it, found, reset and acknowledged (status 0x1);
# - after `modprobe virtio_rdma`: the driver bound (status 0xf: DRIVER_OK), the device's
#   attributes queried, the kernel's context made, the sibling netdev bound by its MAC, the
#   port ACTIVE event taken from the eventq, the RDMA device virtio_rdma0 registered with
#   ib_core — port ACTIVE, link layer Ethernet, netdev eth0 (`rdma link`), the RoCE v2 GID of
#   eth0's address set on the device (SET_GID), the MAD layer's GSI QP in RTS (`rdma resource`:
#   its CQ, QP and receive WQEs made and posted through the driver's kernel verbs), the port's
#   hardware counters the device's (`rdma statistic`, sysfs hw_counters: QUERY_STATS);
# - after `rmmod` (the device reset) and `modprobe` again: the same, from a clean device;
#
# and no complaint in its log. The daemon runs confined (--seccomp kill) and must stop with
# status 0 having counted no stray access of the guest's transport (pci.bad_accesses 0) and no
# panic. Root; about a minute under TCG once QEMU 11 and the images exist (made first when not).
#
#   scripts/virtio-guest/pci-boot.sh        # exit 0: every check passed
#
# Evidence in target/virtio-guest/pci-boot/: console.log, daemon.log, and the guest's
# share/out/ (pci.txt, virtio.txt, virtio-loaded.txt, virtio-reloaded.txt, dmesg.txt).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# the virtio kind's image, kernel and initrd (PV_IMAGE, PV_KERNEL, PV_INITRD: Debian 13's)
export PVRDMA_KIND=virtio-pci
source "$here/../pvrdma-guest/config.sh"
need_root
[ -x "$VRDMA" ] || (cd "$PROJECT_ROOT" && cargo build --release --locked -p vrdma)
if ! "$QEMU11" -version >/dev/null 2>&1; then
    timeout 1200 "$QEMU11_DIR/setup.sh" >/dev/null
fi
timeout 3600 "$here/image.sh" >/dev/null
IMAGE="$PV_IMAGE"
for f in "$IMAGE" "$PV_KERNEL" "$PV_INITRD"; do
    [ -s "$f" ] || die "no $f after scripts/virtio-guest/image.sh"
done

D="$PROJECT_ROOT/target/virtio-guest/pci-boot"
rm -rf "$D"
mkdir -p "$D/share/out" "$D/run"
MAC=52:54:00:4c:01:01
SOCK=$D/vfio.sock NETSOCK=$D/net.sock UPLINK=$D/uplink.sock
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
fail() {
    echo "pci-boot: FAIL: $*" >&2
    echo "--- console (tail)" >&2; tail -n 20 "$D/console.log" 2>/dev/null >&2 || true
    echo "--- daemon (tail)" >&2; tail -n 20 "$D/daemon.log" 2>/dev/null >&2 || true
    exit 1
}

# The guest: lists what its kernel made of the PCI functions and virtio devices, then powers off.
cat > "$D/share/guest-init.sh" <<'EOF'
#!/bin/bash
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
OUT=/harness/out
log() { echo "[guest $(cut -d' ' -f1 /proc/uptime)s] $*" > /dev/console; }
virtio_list() {
    for d in /sys/bus/virtio/devices/*; do
        drv=-
        [ -e "$d/driver" ] && drv=$(basename "$(readlink "$d/driver")")
        parent=$(basename "$(dirname "$(readlink -f "$d")")")
        echo "${d##*/} vendor $(cat "$d/vendor") device $(cat "$d/device") status $(cat "$d/status") driver $drv pci $parent"
    done
}
# Waits (20 s at most) until the port is ACTIVE and the netdev bound, $1 times since boot.
wait_up() {
    for _ in $(seq 1 200); do
        [ "$(dmesg | grep -c 'virtio_rdma.*port 1 active')" = "$1" ] \
            && [ "$(dmesg | grep -c 'virtio_rdma.*bound to')" = "$1" ] && return 0
        sleep 0.1
    done
    return 1
}
ip link set lo up
modprobe -q virtio_net
for _ in $(seq 1 50); do ip -o link | grep -q 52:54:00:4c:01:01 && break; sleep 0.1; done
for d in /sys/bus/pci/devices/*; do
    drv=-
    [ -e "$d/driver" ] && drv=$(basename "$(readlink "$d/driver")")
    echo "${d##*/} $(cat "$d/vendor"):$(cat "$d/device") rev $(cat "$d/revision") $drv"
done > $OUT/pci.txt
virtio_list > $OUT/virtio.txt
ip -o link > $OUT/net.txt 2>&1
log "modprobe virtio_rdma"
{ modprobe virtio_rdma > $OUT/modprobe.txt 2>&1 && wait_up 1; } || echo "first load" >> $OUT/failed
virtio_list > $OUT/virtio-loaded.txt
# The RDMA device: its port, link layer and netdev; the RoCE v2 GID of eth0's address; the
# kernel's GSI QP (the MAD layer's).
ip addr add 10.99.0.2/24 dev eth0 && ip link set eth0 up
for _ in $(seq 1 100); do
    grep -qs '0000:0000:0000:0000:0000:ffff:0a63:0002' /sys/class/infiniband/virtio_rdma0/ports/1/gids/* && break
    sleep 0.1
done
{
    echo "state: $(cat /sys/class/infiniband/virtio_rdma0/ports/1/state)"
    echo "link_layer: $(cat /sys/class/infiniband/virtio_rdma0/ports/1/link_layer)"
    echo "node_type: $(cat /sys/class/infiniband/virtio_rdma0/node_type)"
    for g in /sys/class/infiniband/virtio_rdma0/ports/1/gids/*; do
        i=${g##*/}
        gid=$(cat "$g")
        [ "$gid" = 0000:0000:0000:0000:0000:0000:0000:0000 ] && continue
        echo "gid $i $gid $(cat /sys/class/infiniband/virtio_rdma0/ports/1/gid_attrs/types/$i 2>/dev/null)" \
            "$(cat /sys/class/infiniband/virtio_rdma0/ports/1/gid_attrs/ndevs/$i 2>/dev/null)"
    done
    rdma link show 2>&1
    rdma resource show qp 2>&1
    # (one counter a line: joined into one)
    echo "$(rdma statistic show link virtio_rdma0/1 2>&1 | tr -s ' \n' '  ')"
    echo "hw_counters: $(ls /sys/class/infiniband/virtio_rdma0/ports/1/hw_counters 2>&1 | tr '\n' ' ')"
} > $OUT/ib.txt
log "rmmod virtio_rdma"
rmmod virtio_rdma > $OUT/rmmod.txt 2>&1 || echo "rmmod" >> $OUT/failed
virtio_list > $OUT/virtio-removed.txt
log "modprobe virtio_rdma again"
{ modprobe virtio_rdma >> $OUT/modprobe.txt 2>&1 && wait_up 2; } || echo "second load" >> $OUT/failed
virtio_list > $OUT/virtio-reloaded.txt
dmesg > $OUT/dmesg.txt
echo done > $OUT/done
sync
cd /
umount /harness
echo o > /proc/sysrq-trigger
sleep 30
EOF

# The uplink: a stream socket the daemon connects to; its frames are read and dropped.
python3 -c '
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1]); s.listen(1)
c, _ = s.accept()
while c.recv(65536):
    pass
' "$UPLINK" &
pids+=($!)
for _ in $(seq 1 100); do [ -S "$UPLINK" ] && break; sleep 0.05; done

# shellcheck disable=SC2086 # PVRDMA_SERVE_ARGS: options, split on spaces
VRDMA_RUN_DIR="$D/run" timeout -k 5 600 "$VRDMA" serve ${PVRDMA_SERVE_ARGS:-} --device \
    "kind=virtio-pci,name=vpci-boot,socket=$SOCK,netdev=$NETSOCK,uplink=stream:$UPLINK,mac=$MAC" \
    > "$D/daemon.log" 2>&1 &
DAEMON=$!
pids+=("$DAEMON")
for _ in $(seq 1 200); do grep -q "ready" "$D/daemon.log" 2>/dev/null && break; sleep 0.05; done
grep -q "ready" "$D/daemon.log" || fail "vrdma serve did not start"

start=$(date +%s)
timeout -k 5 "$PV_BOOT_TIMEOUT" "$QEMU11" \
    -name virtio-pci-boot -nodefaults -no-user-config -display none -vga none -monitor none \
    -accel tcg -cpu max -smp 2 -m 1G \
    -object memory-backend-memfd,id=mem,size=1G,share=on -machine q35,memory-backend=mem \
    -kernel "$PV_KERNEL" -initrd "$PV_INITRD" \
    -append "console=ttyS0 root=/dev/vda rw init=/sbin/rxe-harness-init panic=-1 quiet loglevel=4 net.ifnames=0" \
    -drive "file=$IMAGE,if=none,id=d0,format=raw,snapshot=on" \
    -device virtio-blk-pci,drive=d0,addr=0x3 \
    -fsdev "local,id=hshare,path=$D/share,security_model=none" \
    -device virtio-9p-pci,fsdev=hshare,mount_tag=harness,addr=0x4 \
    -netdev "stream,id=n0,server=off,addr.type=unix,addr.path=$NETSOCK" \
    -device "virtio-net-pci,netdev=n0,mac=$MAC,addr=0x6" \
    -device "{\"driver\":\"vfio-user-pci\",\"socket\":{\"type\":\"unix\",\"path\":\"$SOCK\"},\"addr\":\"0x5.0\",\"x-no-posted-writes\":true}" \
    -serial "file:$D/console.log" -no-reboot > "$D/qemu.log" 2>&1 || fail "QEMU: $(tail -n 5 "$D/qemu.log")"
echo "pci-boot: the guest booted and powered off in $(( $(date +%s) - start )) s (TCG)"
[ -e "$D/share/out/done" ] || fail "the guest did not report"
out="$D/share/out"
echo "--- the guest's PCI functions"; cat "$out/pci.txt"
echo "--- its virtio devices"; cat "$out/virtio.txt"

# The function: 1af4:106a, revision 1, bound to the stock virtio-pci driver.
grep -E '^0000:00:05\.0 0x1af4:0x106a rev 0x01 virtio-pci$' "$out/pci.txt" >/dev/null \
    || fail "00:05.0 is not 1af4:106a bound to virtio-pci"
# Its virtio device: ID 42, found and acknowledged (status ACKNOWLEDGE, no driver of its own yet).
line=$(grep ' pci 0000:00:05.0$' "$out/virtio.txt") || fail "no virtio device under 00:05.0"
case "$line" in
    *"vendor 0x1af4 device 0x002a status 0x00000001 driver -"*) ;;
    *) fail "the virtio device under 00:05.0: $line" ;;
esac
# The sibling NIC is there with its MAC.
grep -q "$MAC" "$out/net.txt" || fail "no NIC with $MAC"
# The driver.
[ ! -e "$out/failed" ] || fail "in the guest: $(tr '\n' ' ' < "$out/failed")"
for f in virtio-loaded virtio-reloaded; do
    echo "--- $f"; grep ' pci 0000:00:05.0$' "$out/$f.txt" || true
    grep -q 'device 0x002a status 0x0000000f driver virtio_rdma pci 0000:00:05.0$' "$out/$f.txt" \
        || fail "$f: virtio_rdma not bound with DRIVER_OK"
done
grep -q 'device 0x002a status 0x00000001 driver - pci 0000:00:05.0$' "$out/virtio-removed.txt" \
    || fail "after rmmod: $(grep ' pci 0000:00:05.0$' "$out/virtio-removed.txt")"
echo "--- the RDMA device"; cat "$out/ib.txt"
grep -qx 'state: 4: ACTIVE' "$out/ib.txt" || fail "port 1 not ACTIVE"
grep -qx 'link_layer: Ethernet' "$out/ib.txt" || fail "link layer not Ethernet"
grep -q '^gid [0-9]* 0000:0000:0000:0000:0000:ffff:0a63:0002 RoCE v2 eth0$' "$out/ib.txt" \
    || fail "no RoCE v2 GID of eth0's 10.99.0.2"
grep -q 'link virtio_rdma0/1 state ACTIVE physical_state LINK_UP netdev eth0' "$out/ib.txt" \
    || fail "rdma link: not virtio_rdma0/1 ACTIVE on eth0"
grep -qE 'link virtio_rdma0/1 lqpn 1 type GSI state RTS' "$out/ib.txt" \
    || fail "no GSI QP in RTS on virtio_rdma0"
# The port's hardware counters are the device's (VIRTIO_RDMA_F_STATS, QUERY_STATS: §6.31).
grep -qE '^link virtio_rdma0/1 rx_packets [0-9]+ tx_packets [0-9]+ .*refused_commands [0-9]+ refused_send_wqes [0-9]+ refused_recv_wqes [0-9]+ broken_rings [0-9]+' "$out/ib.txt" \
    || fail "rdma statistic: not the device's counters"
grep -q '^hw_counters: .*refused_send_wqes' "$out/ib.txt" || fail "no hw_counters in sysfs"
echo "--- the driver's log"; grep virtio_rdma "$out/dmesg.txt" || true
[ "$(grep -c 'virtio_rdma.*virtio-rdma device 1af4:106a: .* kernel context 1$' "$out/dmesg.txt")" = 2 ] \
    || fail "the device's attributes and the kernel context, once per load"
[ "$(grep -c "virtio_rdma.*bound to eth0 ($MAC)" "$out/dmesg.txt")" = 2 ] || fail "the netdev, by MAC, once per load"
# (An out-of-tree module taints the kernel unsigned: that line is no complaint.)
if grep -v 'module verification failed' "$out/dmesg.txt" \
    | grep -E '(virtio|05\.0).*([Ee]rror|[Ff]ail|leaving for legacy)|virtio_rdma.*(: -[0-9]|needs a reset)|BUG:|WARNING:|Oops|Call Trace'; then
    fail "the guest's kernel complained (above)"
fi

kill -TERM "$DAEMON"
rc=0
wait "$DAEMON" || rc=$?
[ "$rc" = 0 ] || fail "vrdma serve stopped with status $rc"
VRDMA_RUN_DIR="$D/run" "$VRDMA" stat --all > "$D/stat.txt" 2>&1 || true
# (a daemon that becomes another user, --user, publishes in a directory named after it)
STAT=$(ls "$D/run/vpci-boot.stat" "$D"/run/*/vpci-boot.stat 2> /dev/null | head -n1 || true)
stat_of() { awk -v k="$1" '$1 == k { print $2 }' "$STAT"; }
[ -s "$STAT" ] || fail "no counters published"
echo "--- the daemon: clients $(stat_of vfio.clients), messages $(stat_of vfio.messages), commands $(stat_of virtio.commands) (refused $(stat_of virtio.refused)), kicks $(stat_of pci.kicks), interrupts $(stat_of pci.interrupts), resets $(stat_of pci.resets), bad accesses $(stat_of pci.bad_accesses)"
[ "$(stat_of pci.bad_accesses)" = 0 ] || fail "the guest's transport made stray accesses"
[ "$(stat_of pci.panics)" = 0 ] || fail "a panic in the device"
[ "$(stat_of vfio.clients)" = 1 ] || fail "clients: $(stat_of vfio.clients)"
[ "$(stat_of virtio.commands)" -ge 6 ] || fail "commands: $(stat_of virtio.commands)"
echo "pci-boot: ok (a Debian guest's stock virtio-pci found virtio device 42 on vrdma's function, and virtio_rdma bound, brought it up, was removed and loaded again; TCG)"
