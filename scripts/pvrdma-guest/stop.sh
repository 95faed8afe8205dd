#!/usr/bin/env bash
# Stop pvrdma guests started by start.sh: asks the guest to power off (up to 20 s), then stops
# QEMU, the guest's `vrdma serve` (its counters go to run/gN/stat.txt first) and their
# timeout(1) wrappers, each by its recorded PID checked against its command line, and deletes
# the TAP vrdtapN (a guest of start.sh -x: QEMU only; the daemon and its TAP are its
# starter's). Prints the start command's output.
#   scripts/pvrdma-guest/stop.sh -i N
#   scripts/pvrdma-guest/stop.sh --all
set -uo pipefail
. "$(dirname "$0")/config.sh"
. "$PV_DIR/lib.sh"
need_root

ids=()
case "${1:-}" in
    --all) for d in "$PV_RUN"/g*; do [ -d "$d" ] && ids+=("${d##*/g}"); done ;;
    -i)    check_id "${2:-}"; ids=("$2") ;;
    *)     sed -n '2,8p' "$0"; exit 2 ;;
esac

for n in "${ids[@]}"; do
    D=$(guest_dir "$n"); OUT=$D/share/out
    was_running=0
    qemu_pid "$n" > /dev/null && was_running=1
    teardown "$n" 1
    [ "$was_running" = 1 ] && log "pv$n stopped"
    # report the start.sh command of guests we stopped (or of the one asked for by -i)
    [ "$was_running" = 1 ] || [ "$1" = -i ] || continue
    if [ -e "$OUT/cmd.rc" ] || [ -s "$OUT/cmd.stdout" ] || [ -s "$OUT/cmd.stderr" ]; then
        echo "==== pv$n command: $(head -c 200 "$D/share/cmd.sh" | head -1)"
        echo "---- stdout"; cat "$OUT/cmd.stdout" 2>/dev/null
        echo "---- stderr"; cat "$OUT/cmd.stderr" 2>/dev/null
        echo "---- rc: $(cat "$OUT/cmd.rc" 2>/dev/null || echo 'none (still running at stop)')"
    fi
done
exit 0
