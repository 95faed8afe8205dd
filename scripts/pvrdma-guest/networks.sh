#!/usr/bin/env bash
# Virtual networks under real guests (issue 37): one `vrdma serve` serves four guests of two
# tenants whose addresses overlap, as a cloud host does:
#   tenant-a: guest 1 (PVRDMA, 10.47.91.21) and guest 2 (virtio-rdma, 10.47.91.22), TAPs on the
#             harness's bridge (rxebr0)
#   tenant-b: guest 3 (PVRDMA, 10.47.91.21) and guest 4 (virtio-rdma, 10.47.91.22), TAPs on a
#             bridge of their own (vrdbr9): another tenant's network on the host
# Each device is on its tenant's network (net=) with its address (ip=). Inside each network,
# guest to guest, both roles: ib_send_lat over RC (the GID index) and ib_send_lat -R (rdma_cm,
# whose connection requests go to QP1 with its well-known Q_Key — what a flat fabric handed to the
# other tenant). Each pair must pass, leave no RoCEv2 on either guest's TAP (it went through the
# daemon's shared memory: the server's shm.rx_packets grows) — and the other tenant's two
# devices' counters (shm.rx_packets, engine packets received) must not move while it runs.
#   scripts/pvrdma-guest/networks.sh       # about 2-3 minutes under TCG once the images exist
# Builds vrdma unless PVRDMA_NO_BUILD=1. Exit: the number of failed checks, 125 the harness
# failed. Logs: target/pvrdma-guest/networks/ (summary.txt, each pair's log and captures).
set -uo pipefail
. "$(dirname "$0")/config.sh"
. "$PV_DIR/lib.sh"
. "$PROJECT_ROOT/scripts/lib/pcap.sh"
need_root
OUT=$PV_OUT/networks
SERVE=$PV_RUN/networks-serve
LIFE=1800
BR2=vrdbr9
rm -rf "$OUT"; mkdir -p "$OUT"
say() { echo "networks: $*" >&2; }
summary() { printf '%-56s %s\n' "$1" "$2" | tee -a "$OUT/summary.txt"; }
FAILED=0

# The two tenants, overlapping: guests 3 and 4 take guests 1's and 2's addresses.
KINDS=(pvrdma virtio-pci pvrdma virtio-pci)
export PV_NET_1=tenant-a PV_NET_2=tenant-a PV_NET_3=tenant-b PV_NET_4=tenant-b
export PV_IP_3=$NET_PREFIX.21 PV_IP_4=$NET_PREFIX.22
export PV_BR_3=$BR2 PV_BR_4=$BR2
tenant_of() { if [ "$1" -le 2 ]; then echo tenant-a; else echo tenant-b; fi; }

if [ "${PVRDMA_NO_BUILD:-0}" != 1 ]; then
    cargo build --release --locked -p vrdma --manifest-path "$PROJECT_ROOT/Cargo.toml" > "$OUT/build.log" 2>&1 \
        || { tail -30 "$OUT/build.log"; exit 125; }
fi
pv_images pvrdma virtio-pci > "$OUT/image.log" 2>&1 || { tail -30 "$OUT/image.log"; exit 125; }
for n in 1 2 3 4; do
    if qemu_pid "$n" > /dev/null; then say "pvrdma guest $n is running (another suite?)"; exit 125; fi
done

stop_all() {
    local n
    for n in 1 2 3 4; do "$PV_DIR/stop.sh" -i "$n" > /dev/null 2>&1; done
    shared_serve_stop "$SERVE" "$OUT/stat.final"
    ip -n "$NS" link del "$BR2" 2> /dev/null
}
collect() { [ -s "$SERVE/daemon.log" ] && cp "$SERVE/daemon.log" "$OUT/daemon.log"; }
trap 'collect; stop_all' EXIT

timeout 30 "$RXE_HARNESS/net.sh" up > /dev/null || { say "rxe harness net.sh up failed"; exit 125; }
ip -n "$NS" link show "$BR2" > /dev/null 2>&1 || ip -n "$NS" link add "$BR2" type bridge || exit 125
ip -n "$NS" link set "$BR2" up
PVRDMA_KINDS="${KINDS[*]}" shared_serve_start "$SERVE" $LIFE 4 || { say "the daemon did not start"; exit 125; }
say "vrdma serve pid $(shared_serve_pid "$SERVE"): pvrdma-g1..4, tenant-a and tenant-b"
for n in 1 2 3 4; do
    PVRDMA_KIND=${KINDS[n - 1]} "$PV_DIR/start.sh" -i "$n" -l $LIFE -x "$SERVE" > "$OUT/start-g$n.log" 2>&1 \
        || { cat "$OUT/start-g$n.log"; say "guest $n did not start"; exit 125; }
done

# stat_after T N KEY: device N's counter KEY, from a snapshot published after time T (ms)
stat_after() {
    local t=$1 n=$2 key=$3 i j
    for ((i = 0; i < 60; i++)); do
        j=$(timeout 10 "$VRDMA" stat --json "pvrdma-g$n" 2>/dev/null)
        if [ -n "$j" ] && python3 -c 'import json,sys; d=json.loads(sys.argv[1]); sys.exit(0 if d["updated_ms"] > int(sys.argv[2]) else 1)' "$j" "$t"; then
            python3 -c 'import json,sys; print(json.loads(sys.argv[1])["counters"].get(sys.argv[2], 0))' "$j" "$key"
            return 0
        fi
        sleep 0.2
    done
    echo none; return 1
}
now_ms() { date +%s%3N; }
# the counters of the other tenant's devices that a leak would move
others() {   # others T TENANT: "key=value ..." of the devices not of TENANT
    local t=$1 tenant=$2 n k
    for n in 1 2 3 4; do
        [ "$(tenant_of "$n")" = "$tenant" ] && continue
        for k in shm.rx_packets engine.rx_packets; do printf 'g%s.%s=%s ' "$n" "$k" "$(stat_after "$t" "$n" "$k")"; done
    done
}

# pair TAG SERVER CLIENT 'SERVER_CMD' 'CLIENT_CMD' KIND PORT: SERVER_CMD in guest SERVER, once
#   it listens CLIENT_CMD in guest CLIENT followed by SERVER's address; both must pass, nothing
#   on either TAP, the server's shm.rx_packets up, the other tenant's counters still
pair() {
    local tag=$1 s=$2 c=$3 scmd=$4 ccmd=$5 kind=$6 port=$7 hs hc src crc why="" t0 before after
    local sip; sip=$(pv_ip "$s")
    t0=$(now_ms)
    before=$(others "$t0" "$(tenant_of "$s")")
    local rx0; rx0=$(stat_after "$t0" "$s" shm.rx_packets)
    pcap_start "$NS" "$(pv_tap "$s")" "$OUT/$tag.s.pcap" || why+=" capture did not start;"
    pcap_start "$NS" "$(pv_tap "$c")" "$OUT/$tag.c.pcap" || why+=" capture did not start;"
    hs=$("$PV_DIR/exec.sh" -i "$s" -t 240 -b "$scmd")
    if [ "$kind" = cm ]; then
        "$PV_DIR/exec.sh" -i "$s" -t 40 "for i in \$(seq 150); do rdma res show cm_id 2>/dev/null | grep -q 'state LISTEN.*:$port\\b' && exit 0; sleep 0.2; done; exit 1" \
            > "$OUT/$tag.listen" 2>&1 || why+=" server not listening;"
    else
        "$PV_DIR/exec.sh" -i "$s" -t 40 "wait-listen $port 30" > "$OUT/$tag.listen" 2>&1 || why+=" server not listening;"
    fi
    hc=$("$PV_DIR/exec.sh" -i "$c" -t 240 -b "$ccmd $sip")
    local i
    for ((i = 0; i < 1000; i++)); do [ -s "$hc.rc" ] && break; sleep 0.2; done
    for ((i = 0; i < 300; i++)); do [ -s "$hs.rc" ] && break; sleep 0.2; done
    crc=$(cat "$hc.rc" 2>/dev/null || echo timeout); src=$(cat "$hs.rc" 2>/dev/null || echo timeout)
    pcap_stop "$OUT/$tag.s.pcap" > /dev/null; pcap_stop "$OUT/$tag.c.pcap" > /dev/null
    { echo "== server (g$s, rc $src): $scmd"; cat "$hs.stdout" "$hs.stderr"
      echo "== client (g$c, rc $crc): $ccmd $sip"; cat "$hc.stdout" "$hc.stderr"; } > "$OUT/$tag.log" 2>&1
    [ "$src" = 0 ] || why+=" server rc $src;"
    [ "$crc" = 0 ] || why+=" client rc $crc;"
    local w
    for f in "$OUT/$tag.s.pcap" "$OUT/$tag.c.pcap"; do
        w=$(tcpdump -r "$f" 2>/dev/null | grep -c .)
        [ "$w" = 0 ] || why+=" $w RoCEv2 packets on $(basename "$f"), none expected;"
    done
    local t1 rx1; t1=$(now_ms)
    rx1=$(stat_after "$t1" "$s" shm.rx_packets)
    [ "$rx1" != none ] && [ "$rx0" != none ] && [ "$rx1" -gt "$rx0" ] || why+=" g$s's shm.rx_packets $rx0 -> $rx1;"
    after=$(others "$t1" "$(tenant_of "$s")")
    [ "$before" = "$after" ] || why+=" the other tenant's devices moved: $before -> $after;"
    if [ -z "$why" ]; then
        summary "$tag" "ok   over shm (g$s shm.rx_packets $rx0 -> $rx1); other tenant still: $after"
    else
        FAILED=$((FAILED + 1)); summary "$tag" "FAIL$why (logs: $OUT/$tag.*)"
    fi
}

LAT="ib_send_lat -d \$RXE_DEV -x \$RXE_GID_IDX -F -n 200 -s 64"
CM_LAT="ib_send_lat -d \$RXE_DEV -R -F -n 200 -s 64"
for t in a b; do
    if [ $t = a ]; then x=1 y=2; else x=3 y=4; fi
    pair "tenant-$t.send_lat.g$x-serves" $x $y "$LAT" "$LAT" tcp 18515
    pair "tenant-$t.send_lat.g$y-serves" $y $x "$LAT" "$LAT" tcp 18515
    pair "tenant-$t.send_lat-R.g$x-serves" $x $y "$CM_LAT" "$CM_LAT" cm 18515
    pair "tenant-$t.send_lat-R.g$y-serves" $y $x "$CM_LAT" "$CM_LAT" cm 18515
done
timeout 10 "$VRDMA" stat pvrdma-g1 pvrdma-g2 pvrdma-g3 pvrdma-g4 > "$OUT/stat.txt" 2>&1
grep '^network' "$OUT/stat.txt" | tee -a "$OUT/summary.txt"
say "$FAILED failed (summary: $OUT/summary.txt)"
exit "$FAILED"
