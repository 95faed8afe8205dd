#!/usr/bin/env bash
# Guest to guest on one host, three ways, side by side in one run:
#   scripts/pvrdma-guest/shm-bench.sh     # about 10 minutes under TCG; prints the table
# Two pvrdma guests (QEMU 11, TCG, 2 vCPUs each, vmxnet3 + vmw_pvrdma) run perftest's
# ib_write_bw (1 MiB) and ib_write_lat (2 B), pv2 the server, pv1 the client:
#   udp     each guest's own `vrdma serve`, no shared memory: RoCEv2 through the TAPs and the
#           namespace's bridge (--no-shm)
#   shm     one `vrdma serve` for both: same-host shared memory within the daemon
#   rings   each guest's own daemon, both joined to one rendezvous directory (--shm-dir): the
#           rings between the daemons
# Each cell is the median of BENCH_REPS (3) runs; the guests and daemons are started anew for
# each way. Under TCG the guests' emulated CPUs are most of the cost: the ratios say what the
# medium changes, not what it does on hardware.
# Results: target/pvrdma-guest/shm-bench/ (results.md: the table; one log a run).
# PVRDMA_NO_BUILD=1 skips the cargo build. Exit 0, or 1 when a run failed, 125 the harness failed.
set -uo pipefail
. "$(dirname "$0")/config.sh"
. "$PV_DIR/lib.sh"
need_root
OUT=$PV_OUT/shm-bench
REPS=${BENCH_REPS:-3}
MTU=1024
SERVE=$PV_RUN/serve
RDV=$PV_RUN/shm-rdv
rm -rf "$OUT"; mkdir -p "$OUT"
say() { echo "shm-bench: $*" >&2; }

if [ "${PVRDMA_NO_BUILD:-0}" != 1 ]; then
    cargo build --release --locked -p vrdma --manifest-path "$PROJECT_ROOT/Cargo.toml" > "$OUT/build.log" 2>&1 \
        || { tail -30 "$OUT/build.log"; exit 125; }
fi
pv_images > "$OUT/image.log" 2>&1 || { tail -30 "$OUT/image.log"; exit 125; }
for n in 1 2; do
    if qemu_pid "$n" > /dev/null && [ "${BENCH_FORCE:-0}" != 1 ]; then
        say "pvrdma guest $n is running (another suite?); BENCH_FORCE=1 stops it first"; exit 125
    fi
done
BASE_ARGS=$PVRDMA_SERVE_ARGS
stop_all() {
    "$PV_DIR/stop.sh" -i 1 > /dev/null 2>&1
    "$PV_DIR/stop.sh" -i 2 > /dev/null 2>&1
    shared_serve_stop "$SERVE" "$OUT/stat-$1.txt"
    rm -rf "$RDV"
    return 0
}
trap 'stop_all last' EXIT
stop_all first

# up WAY: both guests, served as WAY says
up() {
    local ext=() n
    export PVRDMA_SERVE_ARGS=$BASE_ARGS
    case $1 in
        udp) PVRDMA_SERVE_ARGS="$BASE_ARGS --no-shm" ;;
        shm) shared_serve_start "$SERVE" 3600 2 || return 1; ext=(-x "$SERVE") ;;
        rings) mkdir -p "$RDV"; chmod 1777 "$RDV"; PVRDMA_SERVE_ARGS="$BASE_ARGS --shm-dir $RDV" ;;
    esac
    for n in 1 2; do
        "$PV_DIR/start.sh" -i "$n" -l 3600 "${ext[@]}" > "$OUT/start-$1-pv$n.log" 2>&1 \
            || { tail -30 "$OUT/start-$1-pv$n.log"; return 1; }
    done
}

TESTS=(
    "write_bw.1MiB|write_bw|-s 1048576 -n 200|bw"
    "write_lat.2B|write_lat|-s 2 -n 2000|lat"
)
X1="$PV_DIR/exec.sh -i 1"
X2="$PV_DIR/exec.sh -i 2"
# one WAY NAME TEST ARGS KIND REP: pv2's server, then pv1's client
one() {
    local way=$1 name=$2 t=$3 args=$4 kind=$5 rep=$6 log h v i
    log=$OUT/$way.$name.$rep
    for i in 1 2 3; do   # perftest's clock calibration can fail under TCG ("inf"): again
        h=$($X2 -t 280 -b "ib_$t -d \$RXE_DEV -x \$RXE_GID_IDX -F -m $MTU $args")
        $X2 -t 40 "wait-listen 18515 30" > /dev/null 2>&1 || { say "pv2's server did not listen"; return 1; }
        $X1 -t 280 "ib_$t -d \$RXE_DEV -x \$RXE_GID_IDX -F -m $MTU $args $(pv_ip 2)" > "$log.client" 2>&1
        wait_for 60 test -e "$h.rc"
        cat "$h.stdout" "$h.stderr" > "$log.server" 2>/dev/null
        v=$(perftest_value "$log.client" "$kind")
        [ -n "$v" ] && { echo "$v"; return 0; }
    done
    say "$way $name run $rep: no result (see $log.client)"
    return 1
}
declare -A MED
FAILED=0
for way in udp shm rings; do
    up "$way" || { say "the guests did not start for $way"; exit 125; }
    for spec in "${TESTS[@]}"; do
        IFS='|' read -r name t args kind <<< "$spec"
        : > "$OUT/$way.$name.values"
        for ((r = 1; r <= REPS; r++)); do
            if v=$(one "$way" "$name" "$t" "$args" "$kind" "$r"); then
                echo "$v" >> "$OUT/$way.$name.values"
            else
                FAILED=1
            fi
        done
        MED[$way.$name]=$(median < "$OUT/$way.$name.values")
        say "$way $name: $(tr '\n' ' ' < "$OUT/$way.$name.values")-> median ${MED[$way.$name]}"
    done
    timeout 10 "$VRDMA" stat --all pvrdma-g1 > "$OUT/stat-$way-pv1.txt" 2>&1
    stop_all "$way"
done

{
    echo "machine: $(nproc) cores, $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)"
    echo "commit: $(git -C "$PROJECT_ROOT" rev-parse --short HEAD)$(git -C "$PROJECT_ROOT" diff --quiet HEAD -- crates || echo '+changes')"
    echo "guests: QEMU 11, $(cat "$RXE_CACHE_DIR/accel" 2>/dev/null || echo tcg), $PV_CPUS vCPUs, $PV_MEM each; date $(date -u +%Y-%m-%dT%H:%MZ)"
} > "$OUT/machine.txt"
{
    echo "| test | udp (two daemons, the bridge) | shm (one daemon) | shm / udp | rings (two daemons) | rings / udp |"
    echo "| --- | ---: | ---: | ---: | ---: | ---: |"
    for spec in "${TESTS[@]}"; do
        IFS='|' read -r name t args kind <<< "$spec"
        u=${MED[udp.$name]:-}; s=${MED[shm.$name]:-}; g=${MED[rings.$name]:-}
        if [ "$kind" = bw ]; then
            echo "| ib_$t $args (MB/s) | $u | $s | $(ratio "$s" "$u") | $g | $(ratio "$g" "$u") |"
        else
            # latency: the ratios are speed-ups (udp's time / the other's)
            echo "| ib_$t $args (t_typical µs) | $u | $s | $(ratio "$u" "$s") | $g | $(ratio "$u" "$g") |"
        fi
    done
} > "$OUT/results.md"
cat "$OUT/machine.txt"; echo; cat "$OUT/results.md"
exit $FAILED
