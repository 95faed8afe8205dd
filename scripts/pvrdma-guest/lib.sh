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
