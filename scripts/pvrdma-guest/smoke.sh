#!/usr/bin/env bash
# Smoke test of a Linux guest on a vrdma PVRDMA device against the kernel's rxe:
#   scripts/pvrdma-guest/smoke.sh          # ibv_devinfo, ibv_rc_pingpong both roles (~1-1.5 min)
#   scripts/pvrdma-guest/smoke.sh --full   # also ud/srq pingpong, perftest's ib_*_bw/_lat, rping
# Builds vrdma (unless PVRDMA_NO_BUILD=1) and the image (image.sh), boots rxe guest 1
# (10.47.91.11, the rxe harness, its own run folder target/pvrdma-guest/rxe-run) and pvrdma
# guest 1 (10.47.91.21, start.sh), then in the
# pvrdma guest: `ibv_devinfo -v` (the device listed, port ACTIVE), and ibv_rc_pingpong
# against the rxe guest in both roles (-g: each side's RoCE v2 IPv4 GID index). Stops
# everything it started, also on failure. Exit status: 0 all passed, 1 a check failed,
# 125 the harness failed (build, boot). Logs and evidence: target/pvrdma-guest/smoke/.
#   SMOKE_ITERS (100), SMOKE_SIZE (4096): the pingpongs' -n and -s; PVRDMA_LOG: the daemon's
#   log filter (info; debug or trace for more); PVRDMA_SERVE_ARGS: more `vrdma serve` options;
#   SMOKE_RXE_ID (1): the rxe guest's index (the project's interop.sh and lossy.sh use 1 and 2);
#   SMOKE_FORCE=1: stop a running rxe/pvrdma guest (of these run folders) instead of refusing.
set -uo pipefail
# the rxe guest's run folder is the smoke's own, so that its stop/start never touch the guests of
# scripts/interop.sh or scripts/lossy.sh (target/rxe-run); RXE_RUN_DIR set by the caller wins
export RXE_RUN_DIR="${RXE_RUN_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/target/pvrdma-guest/rxe-run}"
. "$(dirname "$0")/config.sh"
. "$PV_DIR/lib.sh"
need_root
FULL=0
case "${1:-}" in --full) FULL=1 ;; "") ;; *) sed -n '2,16p' "$0"; exit 2 ;; esac
R=${SMOKE_RXE_ID:-1}          # the rxe guest: 10.47.91.(10+R), TAP rxetapR
[[ "$R" =~ ^[1-8]$ ]] || { echo "SMOKE_RXE_ID must be 1..8" >&2; exit 2; }
ITERS=${SMOKE_ITERS:-100}
SIZE=${SMOKE_SIZE:-4096}
LIFE=1800
OUT=$PV_OUT/smoke
RXE=$RXE_HARNESS
[ -x "$RXE/start.sh" ] || { echo "no rxe harness at $RXE" >&2; exit 125; }
rm -rf "$OUT"; mkdir -p "$OUT"
T0=$(date +%s.%N)
declare -a TIMES RESULTS
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }
step() { TIMES+=("$(printf '%-46s %6ss' "$1" "$2")"); }
result() { RESULTS+=("$(printf '%-72s %s' "$1" "$2")"); }
say() { echo "smoke: $*" >&2; }

# guest 1 of either harness may be someone else's: a TAP with carrier is held open by a QEMU or daemon
in_use() { ip -n "$NS" -br link show "$1" 2>/dev/null | grep -q LOWER_UP; }
if [ "${SMOKE_FORCE:-0}" != 1 ] && { in_use "rxetap$R" || in_use "$(pv_tap 1)" || qemu_pid 1 > /dev/null; }; then
    say "rxe guest $R (rxetap$R) or pvrdma guest 1 ($(pv_tap 1)) is in use (scripts/interop.sh or lossy.sh running?);" \
        "try SMOKE_RXE_ID=3, or stop it (SMOKE_FORCE=1 stops ours first)"
    exit 125
fi
if [ "${PVRDMA_NO_BUILD:-0}" != 1 ]; then
    t=$(now)
    cargo build --release --locked -p vrdma --manifest-path "$PROJECT_ROOT/Cargo.toml" > "$OUT/build.log" 2>&1 \
        || { tail -30 "$OUT/build.log"; exit 125; }
    step "cargo build --release -p vrdma" "$(since "$t")"
fi
t=$(now)
pv_images > "$OUT/image.log" 2>&1 || { tail -30 "$OUT/image.log"; exit 125; }
cache_locked "$RXE_CACHE_DIR" timeout 120 "$RXE/probe-accel.sh" >> "$OUT/image.log" 2>&1 || { tail -30 "$OUT/image.log"; exit 125; }
step "image.sh (+ rxe probe-accel)" "$(since "$t")"

stop_all() {
    "$PV_DIR/stop.sh" -i 1 > "$OUT/stop-pv1.log" 2>&1
    "$RXE/stop.sh" -i "$R" > "$OUT/stop-rxe$R.log" 2>&1
}
collect() {   # evidence of the pvrdma guest and its daemon, copied next to the smoke logs
    local d; d=$(guest_dir 1)
    [ -x "$VRDMA" ] && timeout 10 "$VRDMA" stat --all pvrdma-g1 > "$OUT/vrdma-stat.txt" 2>&1
    cp "$d/daemon.log" "$OUT/daemon.log" 2>/dev/null
    cp "$d/console.log" "$OUT/pv1-console.log" 2>/dev/null
    cp "$d/share/out/dmesg.log" "$OUT/pv1-dmesg.log" 2>/dev/null
    cp "$d/share/out/guest.log" "$OUT/pv1-guest.log" 2>/dev/null
    cp "$d/share/out/gids.txt" "$OUT/pv1-gids.txt" 2>/dev/null
    return 0
}
trap 'collect; stop_all' EXIT
stop_all

# ---- boot --------------------------------------------------------------------------------------
t=$(now)
"$RXE/start.sh" -i "$R" -l $LIFE > "$OUT/start-rxe$R.log" 2>&1 || { cat "$OUT/start-rxe$R.log"; say "rxe guest $R did not start"; exit 125; }
ip -n "$NS" link set "rxetap$R" txqueuelen 10000
step "rxe guest $R: start.sh until rxe0 ACTIVE" "$(since "$t")"
t=$(now)
"$PV_DIR/start.sh" -i 1 -l $LIFE > "$OUT/start-pv1.log" 2>&1 || { cat "$OUT/start-pv1.log"; say "pvrdma guest 1 did not start"; exit 125; }
step "pvrdma guest 1: start.sh until port ACTIVE" "$(since "$t")"
cat "$OUT/start-rxe$R.log" "$OUT/start-pv1.log" >&2
PV_IP=$(pv_ip 1)
RXE_IP=$NET_PREFIX.$((10 + R))
FAILED=0

# ---- ibv_devinfo -------------------------------------------------------------------------------
t=$(now)
"$PV_DIR/exec.sh" -i 1 -t 60 'ibv_devinfo -v' > "$OUT/devinfo.txt" 2>&1; rc=$?
step "ibv_devinfo -v" "$(since "$t")"
echo "==== pvrdma guest 1: ibv_devinfo -v (rc $rc)"
cat "$OUT/devinfo.txt"
if [ $rc = 0 ] && grep -qE '^hca_id:[[:space:]]+vmw_pvrdma' "$OUT/devinfo.txt" && grep -q 'PORT_ACTIVE' "$OUT/devinfo.txt"; then
    result "ibv_devinfo: vmw_pvrdma device, port ACTIVE" PASS
else
    result "ibv_devinfo: vmw_pvrdma device, port ACTIVE" FAIL; FAILED=1
fi
echo "==== pvrdma guest 1: GID table"; cat "$(guest_dir 1)/share/out/gids.txt"

# ---- pairs: a server in one guest, its client in the other -----------------------------------
# pair NAME SERVER_EXEC CLIENT_EXEC 'SERVER_CMD' 'CLIENT_CMD' [PORT]: SERVER_CMD in one guest, then,
#   once it listens on TCP PORT (18515; '-': after 3 s), CLIENT_CMD in the other
pair() {
    local name="$1" sx="$2" cx="$3" cmd="$4" ccmd="$5" port="${6:-18515}" job src crc t m
    echo "==== $name: $cmd  /  $ccmd"
    t=$(now)
    job=$($sx -t 180 -b "$cmd") || { result "$name" "FAIL (harness)"; FAILED=1; return; }
    if [ "$port" = - ]; then sleep 3
    elif ! $sx -t 40 "wait-listen $port 30" > "$OUT/$name.listen" 2>&1; then cat "$OUT/$name.listen"
    fi
    $cx -t 150 "$ccmd" > "$OUT/$name.client" 2>&1; crc=$?
    wait_for 200 test -e "$job.rc"
    src=$(cat "$job.rc" 2>/dev/null || echo none)
    { cat "$job.stdout" "$job.stderr"; } > "$OUT/$name.server" 2>/dev/null
    step "$name" "$(since "$t")"
    echo "---- server (rc $src)"; cat "$OUT/$name.server"
    echo "---- client (rc $crc)"; cat "$OUT/$name.client"
    m=$(grep -oE '[0-9.]+ usec/iter' "$OUT/$name.client" | head -1)
    [ -n "$m" ] || m=$(grep -E '^ *[0-9]+ +[0-9]+ +[0-9.]+' "$OUT/$name.client" | tail -1 | awk '{$1=$1; print}')
    if [ "$src" = 0 ] && [ "$crc" = 0 ]; then
        result "$name${m:+ ($m)}" PASS
    else
        result "$name (server rc $src, client rc $crc)" FAIL; FAILED=1
    fi
}
PVX="$PV_DIR/exec.sh -i 1"
RXX="$RXE/exec.sh -i $R"
# both roles: pvrdma server and rxe client, then rxe server and pvrdma client
both() {   # NAME 'CMD': server CMD, client 'CMD SERVER_IP'
    pair "$1 pvrdma-server" "$PVX" "$RXX" "$2" "$2 $PV_IP"
    pair "$1 rxe-server" "$RXX" "$PVX" "$2" "$2 $RXE_IP"
}
both rc_pingpong "ibv_rc_pingpong -d \$RXE_DEV -g \$RXE_GID_IDX -n $ITERS -s $SIZE"
if [ "$FULL" = 1 ]; then
    both ud_pingpong "ibv_ud_pingpong -d \$RXE_DEV -g \$RXE_GID_IDX -n $ITERS -s 1024"
    both srq_pingpong "ibv_srq_pingpong -d \$RXE_DEV -g \$RXE_GID_IDX -n $ITERS -s $SIZE"
    for t in write_bw read_bw send_bw atomic_bw write_lat read_lat send_lat atomic_lat; do
        both "$t" "ib_$t -d \$RXE_DEV -x \$RXE_GID_IDX -F -n $ITERS"
    done
    # rdma_cm: connection set up with CM MADs on QP1, then RDMA READ and WRITE
    pair "rping pvrdma-server" "$PVX" "$RXX" "rping -s -v -C 10 -a $PV_IP" "rping -c -v -C 10 -a $PV_IP" -
    pair "rping rxe-server" "$RXX" "$PVX" "rping -s -v -C 10 -a $RXE_IP" "rping -c -v -C 10 -a $RXE_IP" -
fi

# ---- summary -----------------------------------------------------------------------------------
collect
echo "==== vrdma stat --all"; cat "$OUT/vrdma-stat.txt"
echo "==== timings"; printf '%s\n' "${TIMES[@]}"
echo "==== results"; printf '%s\n' "${RESULTS[@]}"
step "total" "$(since "$T0")"; echo "${TIMES[-1]}"
if [ $FAILED != 0 ]; then
    echo "smoke: FAILED; evidence in $OUT (daemon.log, pv1-dmesg.log, vrdma-stat.txt)"
    print_debug_tail 1
    exit 1
fi
echo "smoke: PASSED"
exit 0
