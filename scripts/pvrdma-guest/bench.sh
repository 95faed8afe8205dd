#!/usr/bin/env bash
# A guest's RDMA on vrdma against the same guest on the kernel's rxe, side by side in one run:
#   scripts/pvrdma-guest/bench.sh         # about 10 minutes under TCG; prints the table
# One pvrdma guest (QEMU 11, TCG, 2 vCPUs, vmxnet3 + vmw_pvrdma served by `vrdma serve`) runs
# perftest's ib_write_bw (64 KiB, 1 MiB) and ib_write_lat (2 B, 4 KiB), as the client, against
# `vrdma perf` on the host side of the namespace (10.47.91.1, the same peer every time):
#   vrdma   the guest's vmw_pvrdma device (the daemon's engine does the RoCE)
#   rxe     the same guest, same vmxnet3, with vmw_pvrdma unloaded and the kernel's rxe on eth0
#           (what a user runs today without our device; the daemon then passes every frame)
#   host    `vrdma perf` client to `vrdma perf` server, both on the host (engine direct, no
#           guest): the device path's overhead is the vrdma row against this one
# Each cell is the median of BENCH_REPS (3) runs. One guest has one of the two devices at a
# time: the vrdma runs come first, then rxe's, then the host's.
# PVRDMA_KIND=virtio-pci: the guest is a virtio-rdma guest instead (Debian 13, virtio-net +
# the project's virtio_rdma driver and provider; rxe then runs on its virtio-net), so the vrdma
# row is virtio-rdma's with kernel-bypass doorbells; PVRDMA_DEVICE_OPTS (e.g. doorbells=event)
# reaches the daemon's device as always. Compare guests of different kinds by their ratios to
# the rxe of their own guest: under TCG a Debian 13 guest is itself several times slower than a
# Debian 12 one (rxe against rxe, 4 KiB ibv_rc_pingpong: 15 ms against 4.3 ms a round trip).
# PVRDMA_GUEST=trixie runs the PVRDMA kind in that same Debian 13 image (Linux's vmw_pvrdma built
# into it), so that the two faces are measured under one guest kernel and user space.
# Results: target/pvrdma-guest/bench/ (results.md: the table; one log a run). PVRDMA_NO_BUILD=1
# skips the cargo build. Exit 0, or 1 when a run failed, 125 the harness failed.
set -uo pipefail
. "$(dirname "$0")/config.sh"
. "$PV_DIR/lib.sh"
need_root
OUT=$PV_OUT/bench${BENCH_TAG:+-$BENCH_TAG}
DRV=vmw_pvrdma; [ "$PV_KIND" = virtio-pci ] && DRV=virtio_rdma
REPS=${BENCH_REPS:-3}
MTU=1024
HOST2=$NET_PREFIX.2            # the host-side client's address for the engine-direct row
rm -rf "$OUT"; mkdir -p "$OUT"
say() { echo "bench: $*" >&2; }

if [ "${PVRDMA_NO_BUILD:-0}" != 1 ]; then
    cargo build --release --locked -p vrdma --manifest-path "$PROJECT_ROOT/Cargo.toml" > "$OUT/build.log" 2>&1 \
        || { tail -30 "$OUT/build.log"; exit 125; }
fi
pv_images > "$OUT/image.log" 2>&1 || { tail -30 "$OUT/image.log"; exit 125; }
if qemu_pid 1 > /dev/null && [ "${BENCH_FORCE:-0}" != 1 ]; then
    say "pvrdma guest 1 is running (another suite?); BENCH_FORCE=1 stops it first"; exit 125
fi
cleanup() {
    "$PV_DIR/stop.sh" -i 1 > /dev/null 2>&1
    ip -n "$NS" addr del "$HOST2/24" dev "$BR" 2>/dev/null
    return 0
}
trap cleanup EXIT
cleanup
"$PV_DIR/start.sh" -i 1 -l 3600 > "$OUT/start.log" 2>&1 || { cat "$OUT/start.log"; exit 125; }
ip -n "$NS" addr add "$HOST2/24" dev "$BR" || exit 125
X="$PV_DIR/exec.sh -i 1"
{
    echo "machine: $(nproc) cores, $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo), $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)"
    echo "commit: $(git -C "$PROJECT_ROOT" rev-parse --short HEAD)$(git -C "$PROJECT_ROOT" diff --quiet HEAD -- crates || echo '+changes')"
    echo "guest: QEMU $("$QEMU11" --version | head -1 | awk '{print $4}'), $(cat "$RXE_CACHE_DIR/accel" 2>/dev/null || echo tcg), $PV_CPUS vCPUs, $PV_MEM; kernel $($X 'uname -r'); device $PV_KIND ($DRV)${PVRDMA_DEVICE_OPTS:+, $PVRDMA_DEVICE_OPTS}"
    echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
} > "$OUT/machine.txt"

# TESTS: name, perftest test, its arguments, the result's column (BW average or t_typical)
TESTS=(
    "write_bw.64KiB|write_bw|-s 65536 -n 2000|bw"
    "write_bw.1MiB|write_bw|-s 1048576 -n 200|bw"
    "write_lat.2B|write_lat|-s 2 -n 2000|lat"
    "write_lat.4KiB|write_lat|-s 4096 -n 1000|lat"
)
FAILED=0
GPRE=''
# one CONFIG NAME TEST ARGS KIND REP: the host's server, then the client (guest, or host at HOST2)
one() {
    local cfg=$1 name=$2 t=$3 args=$4 kind=$5 rep=$6 log srv spid v i
    log=$OUT/$cfg.$name.$rep
    for i in 1 2 3; do   # perftest's clock calibration can fail under TCG ("inf"): again
        # (against a guest the host's server sleeps for completions, -e: busy-polling it takes
        # a core from the emulated guest and a polling daemon, and on two cores four busy
        # threads wait out the scheduler's slices, milliseconds a round trip; the host row's
        # two tools, with no guest running, poll)
        ev=-e; [ "$cfg" = host ] && ev=
        # shellcheck disable=SC2086 # $args: perftest options
        timeout 300 ip netns exec "$NS" "$VRDMA" perf "$t" -m $MTU $args $ev --timeout 120 > "$log.server" 2>&1 &
        spid=$!
        wait_for 30 bash -c "ip netns exec $NS ss -Hltn 'sport = :18515' | grep -q ." || { say "the server did not listen"; kill $spid; return 1; }
        if [ "$cfg" = host ]; then
            # shellcheck disable=SC2086
            timeout 300 ip netns exec "$NS" "$VRDMA" perf "$t" -m $MTU $args -d "$HOST2" --timeout 120 "$HOST_IP" > "$log.client" 2>&1
        else
            $X -t 280 "${GPRE}ib_$t -d \$RXE_DEV -x \$RXE_GID_IDX -F -m $MTU $args $HOST_IP" > "$log.client" 2>&1
        fi
        wait $spid
        v=$(perftest_value "$log.client" "$kind")
        [ -n "$v" ] && { echo "$v"; return 0; }
    done
    say "$cfg $name run $rep: no result (see $log.client)"
    return 1
}
declare -A MED
run_config() {
    local cfg=$1 spec name t args kind r v
    for spec in "${TESTS[@]}"; do
        IFS='|' read -r name t args kind <<< "$spec"
        : > "$OUT/$cfg.$name.values"
        for ((r = 1; r <= REPS; r++)); do
            if v=$(one "$cfg" "$name" "$t" "$args" "$kind" "$r"); then
                echo "$v" >> "$OUT/$cfg.$name.values"
            else
                FAILED=1
            fi
        done
        MED[$cfg.$name]=$(median < "$OUT/$cfg.$name.values")
        say "$cfg $name: $(tr '\n' ' ' < "$OUT/$cfg.$name.values")-> median ${MED[$cfg.$name]}"
    done
}

# ---- vrdma: the guest's vmw_pvrdma or virtio_rdma ----------------------------------------------
$X 'ibv_devinfo -d $RXE_DEV | grep -E "hca_id|active_mtu"' > "$OUT/vrdma.devinfo" 2>&1
run_config vrdma
# ---- rxe: the same guest, its vrdma driver gone, rxe on the same NIC (vmxnet3 or virtio-net) ----
# (rxe's table holds RoCE v1 and v2 GIDs, for the link-local address too: its RoCE v2 IPv4 GID
# is found by value, not by vmw_pvrdma's index)
$X -t 120 "rmmod $DRV"' && modprobe rdma_rxe && rdma link add rxe0 type rxe netdev $RXE_NETDEV || exit 1
    want=$(printf "0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x" ${GUEST_IP//./ })
    P=/sys/class/infiniband/rxe0/ports/1
    for k in $(seq 300); do
        if grep -q ACTIVE $P/state; then
            for i in $(seq 0 15); do
                [ "$(cat $P/gids/$i 2>/dev/null)" = "$want" ] &&
                  [ "$(cat $P/gid_attrs/types/$i 2>/dev/null)" = "RoCE v2" ] && { echo "$i"; exit 0; }
            done
        fi
        sleep 0.2
    done; exit 1' > "$OUT/rxe.setup" 2>&1 || { cat "$OUT/rxe.setup"; say "rxe did not come up in the guest"; exit 125; }
RXE_IDX=$(grep -xE '[0-9]+' "$OUT/rxe.setup" | tail -1)
[ -n "$RXE_IDX" ] || { cat "$OUT/rxe.setup"; say "no RoCE v2 GID index for rxe0"; exit 125; }
$X 'ibv_devinfo -d rxe0 | grep -E "hca_id|active_mtu"' > "$OUT/rxe.devinfo" 2>&1
GPRE="RXE_DEV=rxe0; RXE_GID_IDX=$RXE_IDX; "    # the jobs' variables name the vrdma device
run_config rxe
# ---- host: engine direct ---------------------------------------------------------------------------
run_config host

# ---- the table ---------------------------------------------------------------------------------------
{
    echo "| test | rxe in the guest | vrdma in the guest | vrdma / rxe | vrdma engine direct (host) | guest vrdma / host |"
    echo "| --- | ---: | ---: | ---: | ---: | ---: |"
    for spec in "${TESTS[@]}"; do
        IFS='|' read -r name t args kind <<< "$spec"
        r=${MED[rxe.$name]:-}; v=${MED[vrdma.$name]:-}; h=${MED[host.$name]:-}
        if [ "$kind" = bw ]; then
            # bandwidth: higher is better, ratios of MB/s
            echo "| ib_$t ${args} (MB/s) | $r | $v | $(ratio "$v" "$r") | $h | $(ratio "$v" "$h") |"
        else
            # latency: lower is better; the ratios are speed-ups (rxe's time / vrdma's)
            echo "| ib_$t ${args} (t_typical µs) | $r | $v | $(ratio "$r" "$v") | $h | $(ratio "$h" "$v") |"
        fi
    done
} > "$OUT/results.md"
cat "$OUT/machine.txt"; echo; cat "$OUT/results.md"
exit $FAILED
