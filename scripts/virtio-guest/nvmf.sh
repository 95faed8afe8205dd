#!/usr/bin/env bash
# A kernel ULP on virtio-rdma: NVMe over Fabrics with the RDMA transport between a Debian 13 guest
# (6.12) on vrdma's virtio-rdma device (the project's virtio_rdma driver, `vrdma serve --device
# kind=virtio-pci`, scripts/pvrdma-guest/start.sh with PVRDMA_KIND=virtio-pci: guest 3,
# 10.47.91.23; its image scripts/virtio-guest/image.sh) and a Debian 12 guest (6.1) on the
# kernel's rxe (the rxe harness's guest R, 10.47.91.(10+R)), on the rxe harness's bridge in its
# namespace. Both roles:
#
# 1. the rxe guest is the target (nvmet-rdma, a file-backed namespace), the virtio-rdma guest the
#    host (nvme-rdma, through /dev/nvme-fabrics): SIZE MiB written with O_DIRECT, read back, the
#    checksums equal on both sides and the target's file holding what was written; then
#    disconnect, `rmmod virtio_rdma` (ib_core takes the device away from nvme-rdma), reload,
#    reconnect, and the data read back again;
# 2. the virtio-rdma guest is the target (its receives on a shared receive queue: nvmet-rdma's
#    use_srq=1), the rxe guest the host: the same transfer and checks.
#
# The daemon runs confined (--seccomp kill). TCG guests (this machine's Linux guests do not boot
# under KVM). Root; about 3 minutes with SIZE 256 (the issue's), once the images exist.
#
#   scripts/virtio-guest/nvmf.sh            # exit: the number of failed checks (125: harness)
#
# Settings: NVMF_SIZE_MB (256), NVMF_RXE_ID (1; its run folder is this script's own,
# target/virtio-guest/rxe-run, so it never stops the guests of interop.sh or the matrix).
# Evidence: target/virtio-guest/nvmf/ (summary.txt, each step's output, both guests' dmesg).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export RXE_RUN_DIR="${RXE_RUN_DIR:-$(cd "$here/../.." && pwd)/target/virtio-guest/rxe-run}"
export PVRDMA_KIND=virtio-pci
source "$here/../pvrdma-guest/config.sh"
need_root
SIZE=${NVMF_SIZE_MB:-256}
R=${NVMF_RXE_ID:-1}
V=3
RIP="$NET_PREFIX.$((10 + R))"
VIP=$(pv_ip $V)
OUT="$PROJECT_ROOT/target/virtio-guest/nvmf"
rm -rf "$OUT"
mkdir -p "$OUT"
say() { echo "nvmf: $*" | tee -a "$OUT/summary.txt"; }
fails=0
check() { # $1 = what, $2 = its log, then the command
    local what=$1 log=$2
    shift 2
    if "$@" > "$log" 2>&1; then say "ok    $what"; else say "FAIL  $what (see $log)"; fails=$((fails + 1)); fi
}

[ -x "$VRDMA" ] || (cd "$PROJECT_ROOT" && cargo build --release --locked -p vrdma) || exit 125
if ! "$QEMU11" -version > /dev/null 2>&1; then
    timeout 1200 "$QEMU11_DIR/setup.sh" > "$OUT/qemu11-setup.log" 2>&1 || { tail -n 20 "$OUT/qemu11-setup.log"; exit 125; }
fi
# the virtio-rdma guest's Debian 13 image; the rxe guest's Debian 12 one (RXE_CACHE_DIR)
timeout 3600 "$here/image.sh" > "$OUT/image.log" 2>&1 || { tail -n 20 "$OUT/image.log"; exit 125; }
cache_locked "$RXE_CACHE_DIR" timeout 1800 "$RXE_HARNESS/build-image.sh" > "$OUT/rxe-image.log" 2>&1 || { tail -n 20 "$OUT/rxe-image.log"; exit 125; }

stop_all() {
    [ -s "$PV_RUN/g$V/share/out/dmesg.log" ] && cp "$PV_RUN/g$V/share/out/dmesg.log" "$OUT/virtio-dmesg.log"
    [ -s "$RXE_RUN_DIR/g$R/share/out/dmesg.log" ] && cp "$RXE_RUN_DIR/g$R/share/out/dmesg.log" "$OUT/rxe-dmesg.log"
    "$PV_DIR/stop.sh" -i $V > "$OUT/stop-virtio.log" 2>&1
    "$RXE_HARNESS/stop.sh" -i "$R" > "$OUT/stop-rxe.log" 2>&1
}
trap stop_all EXIT
"$RXE_HARNESS/start.sh" -i "$R" -l 1800 > "$OUT/start-rxe.log" 2>&1 \
    || { cat "$OUT/start-rxe.log"; say "the rxe guest did not start"; exit 125; }
"$PV_DIR/start.sh" -i $V -l 1800 > "$OUT/start-virtio.log" 2>&1 \
    || { cat "$OUT/start-virtio.log"; say "the virtio-rdma guest did not start"; exit 125; }
say "guests up: rxe $RIP (rxe0), virtio-rdma $VIP ($(grep -o 'dev [a-z_0-9]*' "$OUT/start-virtio.log" | head -n1))"

on_rxe() { timeout 900 "$RXE_HARNESS/exec.sh" -i "$R" -t 800 "$1"; }
on_virtio() { timeout 900 "$PV_DIR/exec.sh" -i $V -t 800 "$1"; }

# A target: nvmet-rdma (module options OPTS) on ADDR, subsystem NQN, a file-backed namespace.
target_cmd() {
    cat <<EOF
set -e
mountpoint -q /sys/kernel/config || mount -t configfs none /sys/kernel/config
modprobe nvmet; modprobe nvmet-rdma ${3:-}
truncate -s $((2 * SIZE))M /root/ns.img
S=/sys/kernel/config/nvmet/subsystems/$2
mkdir \$S; echo 1 > \$S/attr_allow_any_host
mkdir \$S/namespaces/1; echo /root/ns.img > \$S/namespaces/1/device_path; echo 1 > \$S/namespaces/1/enable
P=/sys/kernel/config/nvmet/ports/1
mkdir \$P; echo $1 > \$P/addr_traddr; echo rdma > \$P/addr_trtype; echo 4420 > \$P/addr_trsvcid; echo ipv4 > \$P/addr_adrfam
ln -s \$S \$P/subsystems/$2
EOF
}

# A host: connects to ADDR's NQN and waits for the namespace.
connect_cmd() {
    cat <<EOF
set -e
modprobe nvme-rdma
echo "transport=rdma,traddr=$1,trsvcid=4420,nqn=$2" > /dev/nvme-fabrics
for i in \$(seq 1 100); do [ -b /dev/nvme0n1 ] && break; sleep 0.1; done
[ -b /dev/nvme0n1 ]
EOF
}

# Writes SIZE MiB of random data with O_DIRECT, reads it back (into a checksum: the guest's /tmp
# is half its RAM); prints both checksums.
transfer_cmd='set -e
head -c '"$((SIZE << 20))"' /dev/urandom > /tmp/data
dd if=/tmp/data of=/dev/nvme0n1 bs=1M oflag=direct 2>&1 | tail -n1 >&2
sha256sum < /tmp/data | cut -d" " -f1
rm /tmp/data
dd if=/dev/nvme0n1 bs=1M count='"$SIZE"' iflag=direct 2> /tmp/dd.err | sha256sum | cut -d" " -f1
tail -n1 /tmp/dd.err >&2'
file_sum="head -c $((SIZE << 20)) /root/ns.img | sha256sum | cut -d' ' -f1"
same() { [ -n "$1" ] && [ "$1" = "$2" ]; }

# ---- 1: the rxe guest serves, the virtio-rdma guest is the host --------------------------------
check "rxe target on $RIP" "$OUT/1-target.log" on_rxe "$(target_cmd "$RIP" vrdma-nvmf-1)"
check "virtio-rdma host connects (nvme-rdma)" "$OUT/1-connect.log" on_virtio "$(connect_cmd "$RIP" vrdma-nvmf-1)"
on_virtio "$transfer_cmd" > "$OUT/1-transfer.log" 2>&1
mapfile -t sums < <(grep -E '^[0-9a-f]{64}$' "$OUT/1-transfer.log")
written=$(on_rxe "$file_sum" 2> /dev/null | grep -E '^[0-9a-f]{64}$')
check "$SIZE MiB written and read back by the virtio-rdma host" /dev/null same "${sums[0]:-}" "${sums[1]:-x}"
check "the rxe target's file holds what was written" /dev/null same "${sums[0]:-}" "${written:-x}"
check "disconnect, rmmod virtio_rdma, modprobe, reconnect" "$OUT/1-reload.log" on_virtio "set -e
echo 1 > /sys/class/nvme/nvme0/delete_controller
for i in \$(seq 1 50); do [ -e /dev/nvme0 ] || break; sleep 0.1; done
rmmod virtio_rdma
modprobe virtio_rdma
for i in \$(seq 1 100); do grep -qs \$(printf 'ffff:%02x%02x:%02x%02x' ${VIP//./ }) /sys/class/infiniband/virtio_rdma0/ports/1/gids/* && break; sleep 0.1; done
$(connect_cmd "$RIP" vrdma-nvmf-1)"
again=$(on_virtio "dd if=/dev/nvme0n1 bs=1M count=$SIZE iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1" 2> /dev/null | grep -E '^[0-9a-f]{64}$')
check "the data read again after the reload" /dev/null same "${sums[0]:-}" "${again:-x}"
on_virtio "echo 1 > /sys/class/nvme/nvme0/delete_controller" > /dev/null 2>&1

# ---- 2: the virtio-rdma guest serves, the rxe guest is the host --------------------------------
check "virtio-rdma target on $VIP (nvmet-rdma, its receives on an SRQ)" "$OUT/2-target.log" on_virtio "$(target_cmd "$VIP" vrdma-nvmf-2 use_srq=1)"
check "rxe host connects" "$OUT/2-connect.log" on_rxe "$(connect_cmd "$VIP" vrdma-nvmf-2)"
check "the virtio-rdma target's receives on an SRQ (rdma resource)" "$OUT/2-srq.log" \
    on_virtio "rdma resource show srq | tee /dev/stderr | grep -q 'dev virtio_rdma0'"
on_rxe "$transfer_cmd" > "$OUT/2-transfer.log" 2>&1
mapfile -t sums < <(grep -E '^[0-9a-f]{64}$' "$OUT/2-transfer.log")
written=$(on_virtio "$file_sum" 2> /dev/null | grep -E '^[0-9a-f]{64}$')
check "$SIZE MiB written and read back by the rxe host" /dev/null same "${sums[0]:-}" "${sums[1]:-x}"
check "the virtio-rdma target's file holds what was written" /dev/null same "${sums[0]:-}" "${written:-x}"
on_rxe "echo 1 > /sys/class/nvme/nvme0/delete_controller" > /dev/null 2>&1

grep -h 'copied' "$OUT"/1-transfer.log "$OUT"/2-transfer.log | sed 's/^/nvmf: dd: /' | tee -a "$OUT/summary.txt"
if grep -hE 'BUG:|WARNING:|Oops|Call Trace|virtio_rdma.*(needs a reset|: -[0-9])' \
    "$PV_RUN/g$V/share/out/dmesg.log" > "$OUT/complaints.txt" 2>/dev/null; then
    say "FAIL  the virtio-rdma guest's kernel complained ($OUT/complaints.txt)"
    fails=$((fails + 1))
fi
say "$fails failed"
exit "$fails"
