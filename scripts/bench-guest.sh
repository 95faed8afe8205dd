#!/usr/bin/env bash
# vrdma <-> vrdma against rxe <-> rxe inside the interop guest, on the same
# emulated CPU: perftest's ib_write_bw (1 MiB) and ib_write_lat (64 B) over
# the kernel's rxe on the guest's own address, and `vrdma perf` with the
# same options over two vrdma devices on the guest's loopback. Both pairs
# run in one guest, one after the other; prints the table BENCHMARKS.md
# records, with ratios.
#
#   scripts/bench-guest.sh          # as root; the harness beside the checkout
#
# The guest runs under whatever accelerator the harness found (TCG here):
# absolute numbers are emulation numbers, the ratios are the point.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
H=${RXE_HARNESS:-$ROOT/../shared/interop/rxe-guest}
. "$ROOT/scripts/lib/cache.sh"
export RXE_CACHE_DIR=${RXE_CACHE_DIR:-$VRDMA_CACHE_DIR/rxe-cache}
export RXE_RUN_DIR=${RXE_RUN_DIR:-$ROOT/target/rxe-run}
OUT=$ROOT/target/bench-guest
BW_ITERS=${BW_ITERS:-200}
LAT_ITERS=${LAT_ITERS:-2000}

[ -x "$H/start.sh" ] || { echo "no interop harness at $H" >&2; exit 125; }
[ "$(id -u)" = 0 ] || { echo "the guest needs root (namespaces, TAP, QEMU)" >&2; exit 125; }
mkdir -p "$OUT"
cargo build --release --locked -p vrdma --manifest-path "$ROOT/Cargo.toml"
"$H/setup-host.sh" > "$OUT/setup.log" 2>&1
cache_locked "$RXE_CACHE_DIR" "$H/build-image.sh" >> "$OUT/setup.log" 2>&1
cache_locked "$RXE_CACHE_DIR" "$H/probe-accel.sh" >> "$OUT/setup.log" 2>&1
trap '"$H/stop.sh" -i 1 > /dev/null 2>&1' EXIT
"$H/stop.sh" -i 1 > /dev/null 2>&1 || true
"$H/start.sh" -i 1 > "$OUT/start.log" 2>&1
# The guest mounts its share at /harness.
cp "$ROOT/target/release/vrdma" "$RXE_RUN_DIR/g1/share/vrdma"
# rxe's active MTU follows its netdev: 9000 bytes give it 4096, what the
# guest's loopback gives vrdma. Both pairs then run at MTU 4096.
"$H/exec.sh" -i 1 'ip link set eth0 mtu 9000' > /dev/null

# pair NAME 'SERVER ARGS' 'CLIENT ARGS' CMD: runs the pair in the guest.
pair() {
    local name=$1 server=$2 client=$3
    "$H/exec.sh" -i 1 -t 900 "rxe-pair '$server' '$client'" > "$OUT/$name.txt" 2>&1 || {
        echo "$name failed: $OUT/$name.txt" >&2
        exit 1
    }
}
bw="-m 4096 -s 1048576 -n $BW_ITERS"
lat="-m 4096 -s 64 -n $LAT_ITERS"
# rxe's RoCEv2 IPv4 GID is index 1; guest 1 is 10.47.91.11 (the harness's).
rxe='-d rxe0 -x 1 -F'
pair rxe-write_bw "ib_write_bw $rxe $bw" "ib_write_bw $rxe $bw 10.47.91.11"
# perftest's TSC calibration can fail under TCG and print "inf": retry.
for _ in 1 2 3; do
    pair rxe-write_lat "ib_write_lat $rxe $lat" "ib_write_lat $rxe $lat 10.47.91.11"
    grep -q inf "$OUT/rxe-write_lat.txt" || break
done
# rxe holds UDP port 4791 on every address while its module is loaded:
# vrdma's turn comes after it is gone.
"$H/exec.sh" -i 1 'rdma link delete rxe0; modprobe -r rdma_rxe' > /dev/null
pair vrdma-write_bw "/harness/vrdma perf write_bw -d 127.0.0.2 $bw" \
    "/harness/vrdma perf write_bw -d 127.0.0.3 $bw 127.0.0.2"
pair vrdma-write_lat "/harness/vrdma perf write_lat -d 127.0.0.2 $lat" \
    "/harness/vrdma perf write_lat -d 127.0.0.3 $lat 127.0.0.2"

# The client's row (the first after the client's header): BW average in
# MiB/s (column 4), latency typical in µs (column 5).
row() { awk '/^### client/ {c = 1} c && /#bytes/ {getline; print; exit}' "$OUT/$1.txt"; }
rbw=$(row rxe-write_bw | awk '{print $4}')
vbw=$(row vrdma-write_bw | awk '{print $4}')
rlat=$(row rxe-write_lat | awk '{print $5}')
vlat=$(row vrdma-write_lat | awk '{print $5}')
cpus=$("$H/exec.sh" -i 1 'nproc' | tail -1)
accel=$(cat "$RXE_CACHE_DIR/accel" 2> /dev/null || echo '?')
echo "inside the interop guest ($accel, $cpus vCPUs, MTU 4096): both sides of each pair in the one guest"
printf ' %-40s %14s %14s %8s\n' "" "rxe <-> rxe" "vrdma <-> vrdma" "ratio"
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }
printf ' %-40s %14s %14s %7sx\n' "ib_write_bw 1 MiB, BW average [MiB/s]" "$rbw" "$vbw" \
    "$(ratio "$vbw" "$rbw")"
printf ' %-40s %14s %14s %7sx\n' "ib_write_lat 64 B, typical [us]" "$rlat" "$vlat" \
    "$(ratio "$vlat" "$rlat")"
echo "outputs: $OUT/"
