#!/usr/bin/env bash
# Run a command in a running (start.sh) pvrdma guest, as the rxe harness's exec.sh does.
#   scripts/pvrdma-guest/exec.sh -i N [-t TIMEOUT_S] [-b] 'CMD'
# Default: wait, print stdout/stderr, exit with CMD's code (124: its in-guest timeout, default
# 300 s; 125: harness error). -b: start it in the background and print the job's output prefix
# (run/gN/share/ctl/jobs/NAME.{stdout,stderr,rc}; .rc appears when it has finished).
# CMD runs with bash as root and sees RXE_DEV (vmw_pvrdma0), RXE_GID_IDX, RXE_NETDEV, GUEST_IP.
set -uo pipefail
. "$(dirname "$0")/config.sh"
. "$PV_DIR/lib.sh"
need_root
DIE_RC=125   # harness errors exit 125, never a command's code

N=""; T=300; BG=0
while getopts "i:t:bh" o; do
    case $o in
        i) N=$OPTARG ;; t) T=$OPTARG ;; b) BG=1 ;;
        *) sed -n '2,7p' "$0"; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
[ -n "$N" ] && [ $# -ge 1 ] || { sed -n '2,7p' "$0"; exit 2; }
check_id "$N"
[[ "$T" =~ ^[0-9]+$ ]] || die "timeout must be seconds (got '$T')"
P=$(qemu_pid "$N") || die "pvrdma guest $N is not running (start.sh -i $N)"
D=$(guest_dir "$N"); J=$D/share/ctl/jobs
[ -e "$D/share/out/ready" ] || die "pvrdma guest $N is not ready"

NAME=j$(date +%s%N)
echo "$T" > "$J/$NAME.timeout"
printf '%s\n' "$*" > "$J/$NAME.tmp"
mv "$J/$NAME.tmp" "$J/$NAME.sh"

if [ "$BG" = 1 ]; then echo "$J/$NAME"; exit 0; fi
if ! wait_for "$((T + 30))" bash -c "[ -e '$J/$NAME.rc' ] || ! kill -0 $P 2>/dev/null" || [ ! -e "$J/$NAME.rc" ]; then
    log "no result for job $NAME on pvrdma guest $N"
    exit 125
fi
cat "$J/$NAME.stdout"
cat "$J/$NAME.stderr" >&2
exit "$(cat "$J/$NAME.rc")"
