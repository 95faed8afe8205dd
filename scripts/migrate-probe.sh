#!/usr/bin/env bash
# What QEMU 11.1 does when told to migrate a VM with a vrdma device (issue 34 item 4): for each
# face (pvrdma and virtio-pci over vfio-user-pci, virtio over vhost-user-test-device-pci), a
# `vrdma serve` device and a paused QEMU 11 (no guest, -S) with it attached; QMP `migrate` to
# `exec:cat > /dev/null`, then `query-migrate` until it ends. Prints, per face, whether QEMU
# refused, failed or completed the migration and what it carried of the device (`vfio`'s bytes).
#   scripts/migrate-probe.sh [pvrdma virtio-pci virtio]
# Root (the daemon makes a TAP for its uplink); seconds. Logs in target/migrate-probe/.
set -euo pipefail
. "$(dirname "$0")/pvrdma-guest/config.sh"
need_root
OUT="$PROJECT_ROOT/target/migrate-probe"
mkdir -p "$OUT"
[ -x "$VRDMA" ] || (cd "$PROJECT_ROOT" && cargo build --release --locked -p vrdma)
"$QEMU11" -version > /dev/null 2>&1 || die "no QEMU 11 at $QEMU11 (scripts/pvrdma-guest/image.sh installs it)"
run() {
    local kind=$1 dev d=$OUT/$1
    rm -rf "$d"
    mkdir -p "$d"
    local mac=52:54:00:4c:00:3f
    case $kind in
        pvrdma | virtio-pci)
            local nic=vmxnet3
            [ "$kind" = virtio-pci ] && nic=virtio-net-pci
            dev=(-device "$nic,netdev=n0,mac=$mac,addr=0x5.0,multifunction=on,romfile="
                -device "{\"driver\":\"vfio-user-pci\",\"socket\":{\"type\":\"unix\",\"path\":\"$d/dev.sock\"},\"addr\":\"0x5.1\"}") ;;
        virtio)
            dev=(-device "virtio-net-pci,netdev=n0,mac=$mac,addr=0x5.0"
                -chardev "socket,id=rdma0,path=$d/dev.sock"
                -device "vhost-user-test-device-pci,chardev=rdma0,virtio-id=30,num_vqs=4,config_size=64,page-per-vq=on") ;;
        *) die "no face $kind (pvrdma, virtio-pci, virtio)" ;;
    esac
    "$VRDMA" serve --device "kind=$kind,socket=$d/dev.sock,netdev=$d/net.sock,uplink=tap:vrdmig0,mac=$mac" \
        > "$d/daemon.log" 2>&1 &
    local dp=$!
    local i
    for i in $(seq 100); do [ -S "$d/dev.sock" ] && [ -S "$d/net.sock" ] && break; sleep 0.1; done
    timeout 60 "$QEMU11" -nodefaults -no-user-config -display none -vga none -monitor none -S \
        -accel tcg -m 256M -object memory-backend-memfd,id=mem,size=256M,share=on \
        -machine q35,memory-backend=mem \
        -netdev "stream,id=n0,server=off,addr.type=unix,addr.path=$d/net.sock" "${dev[@]}" \
        -qmp "unix:$d/qmp.sock,server=on,wait=off" > "$d/qemu.log" 2>&1 &
    local qp=$!
    for i in $(seq 100); do [ -S "$d/qmp.sock" ] && break; sleep 0.1; done
    python3 - "$d/qmp.sock" "$kind" << 'PY' | tee "$d/result.txt"
import json, socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rw")
def reply():
    while True:
        m = json.loads(f.readline())
        if "event" not in m:
            return m
def cmd(c, **a):
    f.write(json.dumps({"execute": c, "arguments": a} if a else {"execute": c}) + "\n")
    f.flush()
    return reply()
reply()
cmd("qmp_capabilities")
r = cmd("migrate", uri="exec:cat > /dev/null")
if "error" in r:
    print(f"{sys.argv[2]}: refused: {r['error']['desc']}")
else:
    for _ in range(100):
        q = cmd("query-migrate")["return"]
        if q.get("status") in ("completed", "failed", "cancelled"):
            break
        time.sleep(0.1)
    carried = q.get("vfio", {}).get("transferred", "-")
    print(f"{sys.argv[2]}: {q.get('status')}; device state carried: {carried} bytes (vfio); RAM {q['ram']['transferred']} bytes")
cmd("quit")
PY
    wait "$qp" 2> /dev/null || true
    kill "$dp" 2> /dev/null || true
    wait "$dp" 2> /dev/null || true
}
for k in "${@:-pvrdma virtio-pci virtio}"; do
    for kind in $k; do run "$kind"; done
done
