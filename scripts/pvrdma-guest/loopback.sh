#!/usr/bin/env bash
# What a guest's long loopback transfer costs the daemon: one guest on vrdma runs perftest's
# ib_read_bw with both ends in the guest (two QPs of one device, so every packet loops back
# through the daemon's Ethernet port) at 256 MiB per message, while the daemon's anonymous memory
# (RssAnon: its own heap; the guest pages it touches are RssShmem and cost the host nothing
# extra) is read every 50 ms.
#   scripts/pvrdma-guest/loopback.sh            # about 4 minutes under TCG; as root
#   VRDMA=/path/to/vrdma scripts/pvrdma-guest/loopback.sh   # another daemon build, to compare
# Results: target/pvrdma-guest/loopback/ (result.txt: RssAnon before, at its peak, the growth,
# the bandwidth). Exit 0 when the growth stays under LOOPBACK_LIMIT_MIB (32) and the test
# completed, 1 otherwise, 125 when the harness failed. PVRDMA_NO_BUILD=1 skips the cargo build.
set -uo pipefail
# Two 256 MiB buffers (perftest doubles each) need more than the default 1 GiB.
export PVRDMA_GUEST_MEM=${PVRDMA_GUEST_MEM:-3G}
. "$(dirname "$0")/config.sh"
. "$PV_DIR/lib.sh"
need_root
OUT=$PV_OUT/loopback
SIZE=${LOOPBACK_SIZE:-268435456}
ITERS=${LOOPBACK_ITERS:-8}
LIMIT_MIB=${LOOPBACK_LIMIT_MIB:-32}
rm -rf "$OUT"; mkdir -p "$OUT"
say() { echo "loopback: $*" >&2; }

if [ "${PVRDMA_NO_BUILD:-0}" != 1 ] && [ "$VRDMA" = "$PROJECT_ROOT/target/release/vrdma" ]; then
    cargo build --release --locked -p vrdma --manifest-path "$PROJECT_ROOT/Cargo.toml" > "$OUT/build.log" 2>&1 \
        || { tail -30 "$OUT/build.log"; exit 125; }
fi
pv_images > "$OUT/image.log" 2>&1 || { tail -30 "$OUT/image.log"; exit 125; }
if qemu_pid 1 > /dev/null; then
    say "pvrdma guest 1 is running (another suite?)"; exit 125
fi
SAMPLER=""
cleanup() {
    [ -n "$SAMPLER" ] && kill "$SAMPLER" 2>/dev/null
    "$PV_DIR/stop.sh" -i 1 > /dev/null 2>&1
    return 0
}
trap cleanup EXIT
"$PV_DIR/start.sh" -i 1 -l 1800 > "$OUT/start.log" 2>&1 || { cat "$OUT/start.log"; exit 125; }
DPID=$(daemon_pid 1) || { say "no daemon"; exit 125; }
X="$PV_DIR/exec.sh -i 1"

rss_anon() { awk '/^RssAnon:/ { print $2 }' "/proc/$1/status" 2>/dev/null; }
BEFORE=$(rss_anon "$DPID")
# The sampler: one line a sample, kB.
( while kill -0 "$DPID" 2>/dev/null; do rss_anon "$DPID"; sleep 0.05; done ) > "$OUT/rss_anon.kB" &
SAMPLER=$!

# Server and client in the guest, over the device's own GID (TCP to the guest's own address).
$X -t 900 "ib_read_bw -d \$RXE_DEV -x \$RXE_GID_IDX -F -s $SIZE -n $ITERS > /tmp/server.log 2>&1 &
    for i in \$(seq 100); do ss -Hltn 'sport = :18515' | grep -q . && break; sleep 0.2; done
    ib_read_bw -d \$RXE_DEV -x \$RXE_GID_IDX -F -s $SIZE -n $ITERS \$GUEST_IP; rc=\$?
    wait; cat /tmp/server.log; exit \$rc" > "$OUT/ib_read_bw.log" 2>&1
RC=$?
kill "$SAMPLER" 2>/dev/null; SAMPLER=""
kill -0 "$DPID" 2>/dev/null || { say "the daemon died"; RC=1; }
PEAK=$(sort -n "$OUT/rss_anon.kB" | tail -1)
GROWTH=$(( (${PEAK:-0} - ${BEFORE:-0}) / 1024 ))
BW=$(awk '/#bytes/ { h = 1; next } h && NF >= 4 && $1 ~ /^[0-9]+$/ { print $4; exit }' "$OUT/ib_read_bw.log")
{
    echo "daemon: $VRDMA ($(git -C "$PROJECT_ROOT" rev-parse --short HEAD) in the tree)"
    echo "ib_read_bw -s $SIZE -n $ITERS, both ends in one guest: exit $RC, BW average ${BW:-?} MB/s"
    echo "daemon RssAnon: before ${BEFORE:-?} kB, peak ${PEAK:-?} kB, growth $GROWTH MiB (limit $LIMIT_MIB MiB), $(wc -l < "$OUT/rss_anon.kB") samples"
} | tee "$OUT/result.txt"
[ "$RC" = 0 ] || { say "ib_read_bw failed (see $OUT/ib_read_bw.log)"; exit 1; }
[ "$GROWTH" -lt "$LIMIT_MIB" ] || { say "the daemon's anonymous memory grew by $GROWTH MiB"; exit 1; }
exit 0
