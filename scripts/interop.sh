#!/usr/bin/env bash
# vrdma <-> Linux kernel Soft-RoCE (rdma_rxe), over the wire.
#
# Boots a Debian guest with rdma_rxe and rdma-core under QEMU with the
# interop harness beside the checkout (../shared/interop/rxe-guest, or
# $RXE_HARNESS), on a TAP device in the network namespace "rxens". vrdma
# runs in that namespace on 10.47.91.1; the guest is 10.47.91.11. Every
# pair runs in both roles (rxe server / vrdma client, vrdma server / rxe
# client), each exchange is captured whole (a capture that lost packets
# fails its pair), and each capture must decode cleanly with `vrdma decode`
# and with tshark.
#
#   scripts/interop.sh              # every pair, MTU 1024 and 4096
#   scripts/interop.sh 1024         # one MTU
#   INTEROP_ONLY='^perf-read' scripts/interop.sh 1024   # pairs matching a regex
#
# INTEROP_PEER names another program to run in vrdma's place (taking `vrdma
# pingpong`/`vrdma perf`'s arguments) and INTEROP_OUT another output folder:
# scripts/virtio-guest/rxe.sh runs the pingpong pairs so on a virtio-rdma
# device.
#
# Needs root (namespaces, TAP, QEMU). The first run builds the guest image
# (about 2 minutes, Debian packages only). Logs and captures go to
# target/interop/; the exit status is the number of failed pairs (0 = all
# passed).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
H=${RXE_HARNESS:-$ROOT/../shared/interop/rxe-guest}
. "$ROOT/scripts/lib/cache.sh"
export RXE_CACHE_DIR=${RXE_CACHE_DIR:-$VRDMA_CACHE_DIR/rxe-cache}
export RXE_RUN_DIR=${RXE_RUN_DIR:-$ROOT/target/rxe-run}
OUT=${INTEROP_OUT:-$ROOT/target/interop}
MTUS=("${@:-1024 4096}")
read -r -a MTUS <<< "${MTUS[*]}"
GUEST=10.47.91.11
NS=rxens

[ -x "$H/start.sh" ] || { echo "no interop harness at $H" >&2; exit 125; }
[ "$(id -u)" = 0 ] || { echo "interop needs root (namespaces, TAP, QEMU)" >&2; exit 125; }
mkdir -p "$OUT"
cargo build --release --locked -p vrdma --manifest-path "$ROOT/Cargo.toml" || exit 125
VRDMA=$ROOT/target/release/vrdma
PEER=${INTEROP_PEER:-$VRDMA}
command -v tshark > /dev/null || "$ROOT/scripts/setup.sh" || exit 125

"$H/setup-host.sh" > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 125; }
cache_locked "$RXE_CACHE_DIR" "$H/build-image.sh" >> "$OUT/setup.log" 2>&1 || { tail "$OUT/setup.log"; exit 125; }
cache_locked "$RXE_CACHE_DIR" "$H/probe-accel.sh" >> "$OUT/setup.log" 2>&1 || { tail "$OUT/setup.log"; exit 125; }
trap '"$H/stop.sh" -i 1 > /dev/null 2>&1; ip -n $NS link set rxebr0 mtu 1500 2> /dev/null' EXIT

pass=0
failed=()

. "$ROOT/scripts/lib/pcap.sh"
pcap_init || exit 125

# Waits for a background guest job (exec.sh -b prefix) to finish; its rc.
job_rc() {
    local prefix=$1 limit=$2
    for _ in $(seq 1 $((limit * 5))); do
        [ -s "$prefix.rc" ] && { cat "$prefix.rc"; return; }
        sleep 0.2
    done
    echo timeout
}

# run NAME RXE_CMD VRDMA_ARGS: both roles.
run() {
    local name=$1 rxe=$2 args=$3
    [[ -n ${INTEROP_ONLY:-} && ! $name =~ $INTEROP_ONLY ]] && return
    for role in rxe-server vrdma-server; do
        local tag="$name.$role" ok=1
        local pcap=$OUT/$tag.pcap
        pcap_start $NS rxetap1 "$pcap" || { echo "  capture did not start: $pcap.err"; ok=0; }
        if [ $role = rxe-server ]; then
            local job
            job=$("$H/exec.sh" -i 1 -b "$rxe" | tail -1)
            "$H/exec.sh" -i 1 -t 30 'wait-listen 18515' > /dev/null
            timeout 300 ip netns exec $NS "$PEER" $args --timeout 60 $GUEST > "$OUT/$tag.vrdma" 2>&1 || ok=0
            local rc
            rc=$(job_rc "$job" 300)
            cp "$job.stdout" "$OUT/$tag.rxe" 2> /dev/null
            cat "$job.stderr" >> "$OUT/$tag.rxe" 2> /dev/null
            [ "$rc" = 0 ] || ok=0
        else
            timeout 300 ip netns exec $NS "$PEER" $args --timeout 60 > "$OUT/$tag.vrdma" 2>&1 &
            local pid=$!
            for _ in $(seq 1 50); do
                ip netns exec $NS ss -ltn 2> /dev/null | grep -q ':18515 ' && break
                sleep 0.1
            done
            "$H/exec.sh" -i 1 -t 300 "$rxe host" > "$OUT/$tag.rxe" 2>&1 || ok=0
            wait $pid || ok=0
        fi
        local dropped
        dropped=$(pcap_stop "$pcap")
        [ "$dropped" = 0 ] || { echo "  the capture lost ${dropped:-?} packets ($pcap.err)"; ok=0; }
        pcap_check "$VRDMA" "$pcap" "$OUT/$tag" || ok=0
        if [ $ok = 1 ]; then
            pass=$((pass + 1))
            echo "ok    $tag"
        else
            failed+=("$tag")
            echo "FAIL  $tag (logs: $OUT/$tag.*)"
        fi
    done
}

for mtu in "${MTUS[@]}"; do
    # rxe's active MTU follows its netdev (1500 -> 1024, 9000 -> 4096), so
    # the guest, its TAP and the bridge carry jumbo frames for 4096.
    netmtu=1500
    [ "$mtu" = 4096 ] && netmtu=9000
    "$H/stop.sh" -i 1 > /dev/null 2>&1
    "$H/start.sh" -i 1 > "$OUT/start.log" 2>&1 || { cat "$OUT/start.log"; exit 125; }
    # A bridge's MTU cannot exceed its ports': the TAP first. RoCE wants a
    # lossless network (PFC on real fabrics); the emulated guest drains its
    # TAP slowly, so the TAP queues a 1 MiB message whole (UC cannot
    # recover a lost packet, and rxe's own bursts need the room too).
    ip -n $NS link set rxetap1 mtu $netmtu txqueuelen 10000
    ip -n $NS link set rxebr0 mtu $netmtu
    "$H/exec.sh" -i 1 "ip link set eth0 mtu $netmtu" > /dev/null
    "$H/exec.sh" -i 1 "ibv_devinfo -d rxe0 | grep active_mtu" | tee "$OUT/mtu$mtu.devinfo"
    g="-d rxe0 -g 1"
    for t in rc uc; do
        for size in 1 4096 1048576; do
            n=100
            [ $size = 1048576 ] && n=5
            run "$t-pingpong.mtu$mtu.s$size" "ibv_${t}_pingpong $g -m $mtu -s $size -n $n" \
                "pingpong $t -m $mtu -s $size -n $n"
        done
    done
    for size in 1 $mtu; do
        run "ud-pingpong.mtu$mtu.s$size" "ibv_ud_pingpong $g -s $size -n 100" "pingpong ud -s $size -n 100"
    done
    # perftest: every verb, bandwidth and latency, at the smallest size and
    # at 1 MiB (atomics: 8 B). -F: the guest's CPU frequency varies.
    p="-d rxe0 -x 1 -F"
    for spec in "write_bw 1 100" "write_bw 1048576 5" "read_bw 1 100" "read_bw 1048576 5" \
        "send_bw 1 100" "send_bw 1048576 5" "atomic_bw 8 100" \
        "write_lat 1 100" "write_lat 1048576 5" "read_lat 1 100" "read_lat 1048576 5" \
        "send_lat 1 100" "send_lat 1048576 5" "atomic_lat 8 100"; do
        read -r t size n <<< "$spec"
        s="-s $size"
        [[ $t == atomic* ]] && s=""
        run "perf-$t.mtu$mtu.s$size" "ib_$t $p -m $mtu $s -n $n" "perf $t -m $mtu $s -n $n"
    done
done

echo "$pass passed, ${#failed[@]} failed"
for f in "${failed[@]}"; do echo "  $f"; done
exit ${#failed[@]}
