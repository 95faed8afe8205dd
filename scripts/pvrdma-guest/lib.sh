# Helpers of the pvrdma-guest harness; sourced by start.sh, exec.sh, stop.sh (after config.sh).

# alive_pid FILE PATTERN -> prints the PID in FILE if that process lives and its command line
#   contains PATTERN (guards against PID reuse)
alive_pid() {
    local f="$1" pat="$2" p
    [ -s "$f" ] || return 1
    p=$(cat "$f")
    [[ "$p" =~ ^[0-9]+$ ]] || return 1
    kill -0 "$p" 2>/dev/null || return 1
    tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | grep -qF -- "$pat" || return 1
    echo "$p"
}
qemu_pid()   { alive_pid "$(guest_dir "$1")/qemu.pid" "pvrdma-guest-$1 "; }
daemon_pid() { alive_pid "$(guest_dir "$1")/daemon.pid" "$(guest_dir "$1")/vfio.sock"; }

# stop_pid PID [GRACE_S]: TERM, wait up to GRACE_S (default 5), then KILL
stop_pid() {
    local p="$1" g="${2:-5}" i
    kill -TERM "$p" 2>/dev/null || return 0
    for ((i = 0; i < g * 10; i++)); do kill -0 "$p" 2>/dev/null || return 0; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null
    return 0
}

# wait_for TIMEOUT_S TEST... : polls the test command every 0.1 s
wait_for() {
    local t="$1" end; shift; end=$(( $(date +%s) + t ))
    until "$@"; do
        [ "$(date +%s)" -lt "$end" ] || return 1
        sleep 0.1
    done
}

elapsed_since() {  # seconds since the float timestamp in file $1
    local t0; t0=$(cat "$1"); awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'
}

# teardown N: the guest (asked to power off when POLITE=1), its daemon, their timeout(1)
#   wrappers (all by the PIDs recorded in run/gN, each checked) and its TAP (PV_KEEP_TAP=1: not)
teardown() {
    local n="$1" polite="${2:-0}" d p i; d=$(guest_dir "$n")
    if p=$(qemu_pid "$n"); then
        if [ "$polite" = 1 ] && [ -e "$d/share/out/ready" ]; then
            touch "$d/share/ctl/stop"
            for ((i = 0; i < 200; i++)); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
            kill -0 "$p" 2>/dev/null && log "g$n did not power off in 20 s; killing qemu pid $p"
        fi
        stop_pid "$p" 5
    fi
    p=$(alive_pid "$d/qemu-timeout.pid" "pvrdma-guest-$n ") && stop_pid "$p" 2
    if p=$(daemon_pid "$n"); then
        # the counters, before the daemon goes
        [ -x "$VRDMA" ] && timeout 10 "$VRDMA" stat --all "pvrdma-g$n" > "$d/stat.txt" 2>&1
        stop_pid "$p" 5
    fi
    p=$(alive_pid "$d/daemon-timeout.pid" "$d/vfio.sock") && stop_pid "$p" 2
    # (an external daemon's TAP, start.sh -x, is the daemon's: it outlives the guest)
    if [ "${PV_KEEP_TAP:-0}" != 1 ] && [ ! -e "$d/external" ] \
        && ip netns list 2>/dev/null | grep -qw "^$NS" && ip -n "$NS" link show "$(pv_tap "$n")" > /dev/null 2>&1; then
        ip -n "$NS" link del "$(pv_tap "$n")"
    fi
    return 0
}

print_debug_tail() {
    local d; d=$(guest_dir "$1")
    echo "---- pvrdma guest $1 console (last 30 lines): $d/console.log" >&2
    tail -n 30 "$d/console.log" >&2 2>/dev/null
    [ -s "$d/qemu.log" ] && { echo "---- $d/qemu.log" >&2; tail -n 20 "$d/qemu.log" >&2; }
    [ -s "$d/share/out/dmesg.log" ] && {
        echo "---- guest dmesg (rdma/pvrdma/vmxnet3 lines): $d/share/out/dmesg.log" >&2
        grep -iE 'pvrdma|vmxnet3|infiniband|ib_|rdma|error|fail' "$d/share/out/dmesg.log" | tail -n 30 >&2
    }
    [ -s "$d/daemon.log" ] && { echo "---- daemon (last 30 lines): $d/daemon.log" >&2; tail -n 30 "$d/daemon.log" >&2; }
    return 0
}

# ---- one daemon serving guests 1..K (lifecycle.sh; matrix.sh with MATRIX_SHM=1) ---------------
# Its devices pvrdma-g1..K, all on one virtual network (net=$PV_NET, default pvnet) and each given
# its guest's address (ip=), reach each other through same-host shared memory (unless the options
# say --no-shm); each one's uplink is a TAP of its own (vrdtapN) on the namespace's bridge.

# shared_serve_pid DIR: the PID of the daemon serving on DIR's sockets, if it lives
shared_serve_pid() { alive_pid "$1/daemon.pid" "$1/g1.vfio.sock"; }

# shared_serve_start DIR LIFETIME_S K [SERVE OPTIONS...]: one `vrdma serve` (PVRDMA_SERVE_ARGS,
#   then the options given) in the namespace for guests 1..K, on DIR/gN.vfio.sock and
#   DIR/gN.net.sock (start.sh -x DIR boots a guest on them); its log DIR/daemon.log. Guest N's
#   device is of the Nth kind in PVRDMA_KINDS ("pvrdma virtio-pci ...", default: every guest
#   PVRDMA_KIND's); start.sh must boot it with that PVRDMA_KIND.
shared_serve_start() {
    local dir=$1 life=$2 k=$3 n tap br net tpid specs=() kinds
    read -r -a kinds <<< "${PVRDMA_KINDS:-}"
    shift 3
    rm -rf "$dir"; mkdir -p "$dir"
    echo "$k" > "$dir/guests"
    timeout 30 "$RXE_HARNESS/net.sh" up > /dev/null || { log "net.sh up failed"; return 1; }
    for ((n = 1; n <= k; n++)); do
        tap=$(pv_tap "$n")
        # PV_BR_N, PV_NET_N: guest N's bridge and virtual network (networks.sh), else the harness's
        br=PV_BR_$n; br=${!br:-$BR}
        net=PV_NET_$n; net=${!net:-${PV_NET:-pvnet}}
        ip -n "$NS" tuntap add dev "$tap" mode tap || { log "cannot create $tap"; return 1; }
        ip -n "$NS" link set "$tap" master "$br" txqueuelen 10000 up
        specs+=(--device "kind=${kinds[n - 1]:-$PV_KIND},socket=$dir/g$n.vfio.sock,netdev=$dir/g$n.net.sock,uplink=tap:$tap,mac=$(pv_mac "$n"),name=pvrdma-g$n,net=$net,ip=$(pv_ip "$n")")
    done
    # shellcheck disable=SC2086 # PVRDMA_SERVE_ARGS: extra options, split on spaces
    setsid nohup timeout -k 10 $((life + 60)) ip netns exec "$NS" env VRDMA_LOG="$PV_LOG" NO_COLOR=1 RUST_BACKTRACE=1 \
        "$VRDMA" serve "${specs[@]}" ${PVRDMA_SERVE_ARGS:-} "$@" > "$dir/daemon.log" 2>&1 < /dev/null &
    tpid=$!
    echo "$tpid" > "$dir/daemon-timeout.pid"
    wait_for 10 bash -c "pgrep -P $tpid > '$dir/daemon.pid' || ! kill -0 $tpid 2>/dev/null"
    if ! wait_for 30 bash -c "[ -S '$dir/g$k.net.sock' ]" || ! shared_serve_pid "$dir" > /dev/null; then
        log "the shared daemon did not start"; cat "$dir/daemon.log" >&2; return 1
    fi
}

# shared_serve_stop DIR [STAT_FILE]: the daemon (its counters first, into STAT_FILE), its
#   timeout(1) wrapper and its TAPs; nothing when DIR holds no daemon's state
shared_serve_stop() {
    local dir=$1 stat=${2:-/dev/null} k p n names=()
    [ -s "$dir/guests" ] || return 0
    k=$(cat "$dir/guests")
    for ((n = 1; n <= k; n++)); do names+=("pvrdma-g$n"); done
    if p=$(shared_serve_pid "$dir"); then
        timeout 10 "$VRDMA" stat --all "${names[@]}" > "$stat" 2>&1
        stop_pid "$p" 5
    fi
    p=$(alive_pid "$dir/daemon-timeout.pid" "$dir/g1.vfio.sock") && stop_pid "$p" 2
    for ((n = 1; n <= k; n++)); do ip -n "$NS" link del "$(pv_tap "$n")" 2>/dev/null; done
    return 0
}

# ---- the benchmarks' arithmetic (bench.sh, shm-bench.sh) -------------------------------------
# perftest_value FILE KIND: BW average (MB/s, KIND bw) or t_typical (µs, KIND lat) from
#   perftest's (or vrdma perf's) result table
perftest_value() {
    awk -v k="$2" '
        /#bytes/ { hdr = 1; next }
        hdr && NF >= 4 && $1 ~ /^[0-9]+$/ { v = (k == "bw") ? $4 : $5; hdr = 0 }
        END { if (v != "" && v != "inf") print v }' "$1"
}
# median: of the numbers on stdin, one a line
median() { sort -g | awk '{ a[NR] = $1 } END { if (NR) print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
# ratio A B: A / B to two places, "-" unless both are positive
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0 && b > 0) printf "%.2f", a / b; else print "-" }'; }
