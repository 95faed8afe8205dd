#!/usr/bin/env bash
# The interop matrix of a Linux guest on a vrdma PVRDMA device (pvrdma guest 1, 10.47.91.21):
# every test in both roles against each peer, every exchange captured whole on the guest's uplink
# (vrdtap1; a capture that lost packets fails its pair) and decoded clean by `vrdma decode` and
# tshark.
#   scripts/pvrdma-guest/matrix.sh           # the whole matrix (14-20 minutes under TCG)
#   scripts/pvrdma-guest/matrix.sh --quick   # CI's subset (about 4 minutes): below
# Peers (MATRIX_PEERS, default "rxe host pvrdma"):
#   rxe     a guest on the kernel's rxe (rxe harness guest MATRIX_RXE_ID, default 1: 10.47.91.11,
#           in the smoke's run folder target/pvrdma-guest/rxe-run)
#   host    `vrdma pingpong` / `vrdma perf` on the host side of the namespace (10.47.91.1)
#   pvrdma  a second guest on vrdma (pvrdma guest 2, 10.47.91.22, its own `vrdma serve`)
# Tests (MTU 1024, the guest's active MTU): ibv_rc_pingpong 1 B, 4 KiB, 1 MiB; ibv_ud_pingpong
# 1 B, 1 KiB; perftest ib_{write,read,send}_{bw,lat} 1 B and 1 MiB, ib_atomic_{bw,lat}; against
# rxe and pvrdma also ibv_srq_pingpong 4 KiB, rping and ib_write_bw -R (both over rdma_cm; the
# host tools have neither SRQ pingpong nor CM).
# --quick: ibv_devinfo, rc_pingpong 4 KiB with each peer, ib_write_bw 1 MiB with the host,
# rping with the second guest, ib_write_bw -R with rxe; both roles each.
# MATRIX_SHM=1: one `vrdma serve` serves both pvrdma guests (as lifecycle.sh's daemon does), so
# the pvrdma pairs go through same-host shared memory: each such pair must leave no RoCE packet
# in the capture on pv1's uplink and grow the daemon's shm counters (`vrdma stat`), instead of
# being decoded; the rxe and host pairs run as always, from the same device. MATRIX_SHM=2: each
# guest has its own daemon, as by default, and both join one rendezvous directory (--shm-dir):
# the pvrdma pairs go through the rings between the daemons, and are checked the same way.
# PVRDMA_KIND=virtio-pci: guest 1 (and, unless MATRIX_KIND2 says otherwise, guest 2) is a
# virtio-rdma guest (Debian 13, the project's virtio_rdma driver and rdma-core provider;
# scripts/virtio-guest/image.sh) instead of a PVRDMA one, and the whole matrix adds
# ibv_uc_pingpong (with every peer but a PVRDMA guest, which has no UC) and perftest at 4 KiB.
# MATRIX_KIND2=pvrdma|virtio-pci: the kind of guest 2, the "pvrdma" peer (its tag says which:
# pvrdma or virtio); so a virtio-rdma guest meets a PVRDMA one.
# MATRIX_ONLY=REGEX runs the tests whose tag (test.peer.role) matches. Builds vrdma unless
# PVRDMA_NO_BUILD=1. Exit: the number of failed pairs (0: all passed), 125 the harness failed.
# Logs, captures, decodes: target/pvrdma-guest/matrix/ (summary.txt: one line a pair).
set -uo pipefail
export RXE_RUN_DIR="${RXE_RUN_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/target/pvrdma-guest/rxe-run}"
. "$(dirname "$0")/config.sh"
. "$PV_DIR/lib.sh"
. "$PROJECT_ROOT/scripts/lib/pcap.sh"
need_root
QUICK=0
case "${1:-}" in --quick) QUICK=1 ;; "") ;; *) sed -n '2,20p' "$0"; exit 2 ;; esac
PEERS=${MATRIX_PEERS:-rxe host pvrdma}
KIND1=$PV_KIND
KIND2=${MATRIX_KIND2:-$KIND1}
case $KIND2 in pvrdma) SECOND=pvrdma ;; virtio-pci) SECOND=virtio ;; *) echo "MATRIX_KIND2: pvrdma or virtio-pci" >&2; exit 2 ;; esac
HCA=vmw_pvrdma; [ "$KIND1" = virtio-pci ] && HCA=virtio_rdma
SHM=${MATRIX_SHM:-0}
SERVE=$PV_RUN/serve            # MATRIX_SHM: the shared daemon's sockets, log and PID
R=${MATRIX_RXE_ID:-1}
[[ "$R" =~ ^[1-8]$ ]] || { echo "MATRIX_RXE_ID must be 1..8" >&2; exit 2; }
RXE=$RXE_HARNESS
OUT=$PV_OUT/matrix
LIFE=3600
MTU=1024
rm -rf "$OUT"; mkdir -p "$OUT"
say() { echo "matrix: $*" >&2; }
has_peer() { [[ " $PEERS " == *" $1 "* ]]; }

[ -x "$RXE/start.sh" ] || { say "no rxe harness at $RXE"; exit 125; }
command -v tshark > /dev/null || "$PROJECT_ROOT/scripts/setup.sh" || exit 125
pcap_init || exit 125
if [ "${PVRDMA_NO_BUILD:-0}" != 1 ]; then
    cargo build --release --locked -p vrdma --manifest-path "$PROJECT_ROOT/Cargo.toml" > "$OUT/build.log" 2>&1 \
        || { tail -30 "$OUT/build.log"; exit 125; }
fi
pv_images "$KIND1" "$KIND2" > "$OUT/image.log" 2>&1 || { tail -30 "$OUT/image.log"; exit 125; }
cache_locked "$RXE_CACHE_DIR" timeout 120 "$RXE/probe-accel.sh" >> "$OUT/image.log" 2>&1 || { tail -30 "$OUT/image.log"; exit 125; }

# ---- guests ------------------------------------------------------------------------------------
in_use() { ip -n "$NS" -br link show "$1" 2>/dev/null | grep -q LOWER_UP; }
for t in "rxetap$R" "$(pv_tap 1)" "$(pv_tap 2)"; do
    if in_use "$t" && [ "${MATRIX_FORCE:-0}" != 1 ]; then
        say "$t is in use (another suite running?); MATRIX_FORCE=1 stops this suite's guests first"
        exit 125
    fi
done
stop_all() {
    "$PV_DIR/stop.sh" -i 1 > "$OUT/stop-pv1.log" 2>&1
    "$PV_DIR/stop.sh" -i 2 > "$OUT/stop-pv2.log" 2>&1
    shared_serve_stop "$SERVE" "$OUT/stat-shared.txt" > "$OUT/stop-serve.log" 2>&1
    "$RXE/stop.sh" -i "$R" > "$OUT/stop-rxe.log" 2>&1
}
collect() {   # the daemons' counters and the guests' kernel logs, beside the results
    local n d
    for n in 1 2; do
        d=$(guest_dir "$n")
        [ -d "$d" ] || continue
        { daemon_pid "$n" > /dev/null || shared_serve_pid "$SERVE" > /dev/null; } \
            && timeout 10 "$VRDMA" stat --all "pvrdma-g$n" > "$OUT/stat-pv$n.txt" 2>&1
        cp "$d/daemon.log" "$OUT/daemon-pv$n.log" 2>/dev/null
        cp "$d/share/out/dmesg.log" "$OUT/dmesg-pv$n.log" 2>/dev/null
    done
    cp "$SERVE/daemon.log" "$OUT/daemon-shared.log" 2>/dev/null
    return 0
}
trap 'collect; stop_all' EXIT
stop_all
if has_peer rxe; then
    "$RXE/start.sh" -i "$R" -l $LIFE > "$OUT/start-rxe.log" 2>&1 || { cat "$OUT/start-rxe.log"; say "rxe guest $R did not start"; exit 125; }
    ip -n "$NS" link set "rxetap$R" txqueuelen 10000
fi
EXTERNAL=()
if [ "$SHM" = 2 ]; then
    RDV=$PV_RUN/shm-rdv
    # Root's, sticky, open to the daemons' user (nobody): the daemons bind their sockets there
    # as that user; root writes its grant in RDV/grants first.
    rm -rf "$RDV"; mkdir -p "$RDV"; chmod 1777 "$RDV"
    export PVRDMA_SERVE_ARGS="$PVRDMA_SERVE_ARGS --shm-dir $RDV"
    say "each guest's daemon joins the rendezvous $RDV"
elif [ "$SHM" = 1 ]; then
    PVRDMA_KINDS="$KIND1 $KIND2" shared_serve_start "$SERVE" $LIFE 2 || { say "the shared daemon did not start"; exit 125; }
    EXTERNAL=(-x "$SERVE")
    say "vrdma serve pid $(shared_serve_pid "$SERVE"): pvrdma-g1, pvrdma-g2, same-host shared memory on"
fi
"$PV_DIR/start.sh" -i 1 -l $LIFE "${EXTERNAL[@]}" > "$OUT/start-pv1.log" 2>&1 || { cat "$OUT/start-pv1.log"; say "pvrdma guest 1 did not start"; exit 125; }
if has_peer pvrdma; then
    PVRDMA_KIND=$KIND2 "$PV_DIR/start.sh" -i 2 -l $LIFE "${EXTERNAL[@]}" > "$OUT/start-pv2.log" 2>&1 || { cat "$OUT/start-pv2.log"; say "guest 2 ($KIND2) did not start"; exit 125; }
fi
cat "$OUT"/start-*.log >&2

# ---- sides: where a command runs, and the address its peer uses ---------------------------------
ip_of() {
    case $1 in
        pv*) pv_ip "${1#pv}" ;;
        rxe) echo "$NET_PREFIX.$((10 + R))" ;;
        host) echo "$HOST_IP" ;;
    esac
}
# side_bg SIDE CMD: starts CMD; prints a handle for side_wait
side_bg() {
    case $1 in
        pv*) "$PV_DIR/exec.sh" -i "${1#pv}" -t 240 -b "$2" ;;
        rxe) "$RXE/exec.sh" -i "$R" -t 240 -b "$2" | tail -1 ;;
        host)
            local f; f=$OUT/host.$(date +%s%N)
            # shellcheck disable=SC2086 # $2: the tool's arguments
            # (its output not the caller's: $(side_bg ...) would wait for it)
            # (-e: it sleeps for completions; a busy-polling host tool takes a core from
            # the emulated guests and their daemons, which then answer late enough for RC
            # retries to run out)
            ( timeout 240 ip netns exec "$NS" "$VRDMA" $2 -e --timeout 120 > "$f.stdout" 2> "$f.stderr"
              echo $? > "$f.rc" ) < /dev/null > /dev/null 2>&1 &
            echo "$f" ;;
    esac
}
# side_wait HANDLE SECONDS: waits for the command; prints its rc (or "timeout")
side_wait() {
    local h=$1 t=$2 i
    for ((i = 0; i < t * 5; i++)); do
        [ -s "$h.rc" ] && { cat "$h.rc"; return; }
        sleep 0.2
    done
    echo timeout
}
# side_listening SIDE KIND PORT: waits (30 s) until the server listens: on TCP PORT (the tools'
# exchange) or, KIND cm, on rdma_cm's PORT
side_listening() {
    local side=$1 kind=$2 port=$3 i
    if [ "$kind" = cm ]; then
        local w="for i in \$(seq 150); do rdma res show cm_id 2>/dev/null | grep -q 'state LISTEN.*:$port\\b' && exit 0; sleep 0.2; done; exit 1"
        case $side in
            pv*) "$PV_DIR/exec.sh" -i "${side#pv}" -t 40 "$w" ;;
            rxe) "$RXE/exec.sh" -i "$R" -t 40 "$w" ;;
        esac
        return
    fi
    case $side in
        pv*) "$PV_DIR/exec.sh" -i "${side#pv}" -t 40 "wait-listen $port 30" ;;
        rxe) "$RXE/exec.sh" -i "$R" -t 40 "wait-listen $port 30" ;;
        host)
            for ((i = 0; i < 300; i++)); do
                ip netns exec "$NS" ss -Hltn "sport = :$port" | grep -q . && return 0
                sleep 0.1
            done
            return 1 ;;
    esac
}

# rping_exit_race HANDLE RC: the stock rping's own race, not the device's: once the last
#   CM event is handled the main thread destroys the event channel while rping's CM thread
#   may already be back in rdma_get_cm_event, which then fails with EBADF and exits 255
#   (rdma-core 44, Debian 12's; fixed upstream by rdma-core PR #1622, 2025). True when that is
#   all that went wrong: rc 255, the last line that error, after the DISCONNECT event, with
#   every one of the 10 pings (-C 10 -v) done.
rping_exit_race() {
    local h=$1 rc=$2
    [ "$rc" = 255 ] || return 1
    [ "$(tail -1 "$h.stderr" 2> /dev/null)" = "rdma_get_cm_event: Bad file descriptor" ] || return 1
    grep -q 'DISCONNECT EVENT' "$h.stderr" || return 1
    [ "$(grep -c 'ping data: rdma-ping-' "$h.stdout")" = 10 ]
}

PASS=0
FAILED=()
summary() { printf '%-52s %s\n' "$1" "$2" | tee -a "$OUT/summary.txt"; }

# shm_rx: the packets pv1's device took from shared memory, as the daemon last published them
shm_rx() { timeout 10 "$VRDMA" stat pvrdma-g1 2>/dev/null | awk '$1 == "shm.rx_packets" { print $2 }'; }
# shm_grew BEFORE: waits (10 s: counters are published once a second) for shm_rx to pass BEFORE
shm_grew() {
    local i n
    for ((i = 0; i < 50; i++)); do
        n=$(shm_rx); [ -n "$n" ] && [ "$n" -gt "$1" ] && { echo "$n"; return 0; }
        sleep 0.2
    done
    echo "${n:-none}"; return 1
}

# pair TAG SERVER CLIENT 'SERVER_CMD' 'CLIENT_CMD' KIND PORT: the server's command on SERVER,
#   then, once it listens, the client's on CLIENT followed by the server's address; the capture
#   on pv1's uplink is checked after both have ended
pair() {
    local tag=$1 s=$2 c=$3 scmd=$4 ccmd=$5 kind=$6 port=$7 hs hc src crc ok=1 m why=""
    [[ -n ${MATRIX_ONLY:-} && ! $tag =~ $MATRIX_ONLY ]] && return
    local pcap=$OUT/$tag.pcap t0 shm=0 shm0=0; t0=$(date +%s.%N)
    # (guest to guest through one daemon: shared memory, not the wire)
    if [ "$SHM" != 0 ] && [[ $s == pv2 || $c == pv2 ]]; then shm=1; shm0=$(shm_rx); shm0=${shm0:-0}; fi
    # (whole: a capture that lost packets fails the pair, scripts/lib/pcap.sh)
    pcap_start "$NS" "$(pv_tap 1)" "$pcap" || { summary "$tag" "FAIL (capture did not start: $pcap.err)"; FAILED+=("$tag"); return; }
    hs=$(side_bg "$s" "$scmd") || ok=0
    side_listening "$s" "$kind" "$port" > "$OUT/$tag.listen" 2>&1 || why+=" server not listening;"
    hc=$(side_bg "$c" "$ccmd $(ip_of "$s")") || ok=0
    crc=$(side_wait "$hc" 200)
    src=$(side_wait "$hs" 60)
    local dropped; dropped=$(pcap_stop "$pcap")
    [ "$dropped" = 0 ] || { ok=0; why+=" capture lost ${dropped:-?} packets ($pcap.err);"; }
    { echo "== server ($s, rc $src): $scmd"; cat "$hs.stdout" "$hs.stderr"
      echo "== client ($c, rc $crc): $ccmd $(ip_of "$s")"; cat "$hc.stdout" "$hc.stderr"; } > "$OUT/$tag.log" 2>&1
    local note=""
    if [[ $tag == rping.* ]]; then
        rping_exit_race "$hs" "$src" && { src=0; note=" (server: rping's exit race)"; }
        rping_exit_race "$hc" "$crc" && { crc=0; note+=" (client: rping's exit race)"; }
    fi
    [ "$src" = 0 ] || { ok=0; why+=" server rc $src;"; }
    [ "$crc" = 0 ] || { ok=0; why+=" client rc $crc;"; }
    local over=""
    if [ $shm = 1 ]; then
        # nothing on the wire, and the daemon says where it went
        local wire now; wire=$(tcpdump -r "$pcap" 2>/dev/null | grep -c .)
        [ "$wire" = 0 ] || { ok=0; why+=" $wire RoCE packets on the wire, none expected over shm;"; }
        if now=$(shm_grew "$shm0"); then over=" over shm: 0 pkts on the wire; pv1's shm.rx_packets $shm0 -> $now (published)"
        else ok=0; why+=" pv1's shm.rx_packets did not grow ($shm0 -> $now);"; fi
    elif ! pcap_check "$VRDMA" "$pcap" "$OUT/$tag" > "$OUT/$tag.pcapcheck" 2>&1; then
        ok=0; why+=" $(head -1 "$OUT/$tag.pcapcheck" | sed 's/^ *//');"
    fi
    m=$(grep -hoE '[0-9.]+ usec/iter' "$hc.stdout" "$hs.stdout" 2>/dev/null | head -1)
    [ -n "$m" ] || m=$(grep -hE '^ *[0-9]+ +[0-9]+ +[0-9.]+' "$hc.stdout" 2>/dev/null | tail -1 | awk '{$1=$1; print}')
    local secs; secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
    if [ $ok = 1 ] && [ $shm = 1 ]; then
        PASS=$((PASS + 1)); summary "$tag" "ok   ${secs}s ${over}  ${m}${note}"
    elif [ $ok = 1 ]; then
        PASS=$((PASS + 1)); summary "$tag" "ok   ${secs}s  $(sed -n 's/^ *\([0-9]*\) frames:.*/\1/p' "$OUT/$tag.decode") pkts  ${m}${note}"
    else
        FAILED+=("$tag"); summary "$tag" "FAIL ${secs}s ${why} (logs: $OUT/$tag.*)"
        # (the tools' own last words, so that a run whose files are gone still says why)
        { echo "server ($s) stderr:"; tail -8 "$hs.stderr"; echo "client ($c) stdout, stderr:"
          grep -v '^ *$' "$hc.stdout" | tail -6; tail -8 "$hc.stderr"
          tail -3 "$OUT/$tag.pcapcheck"; echo "connection management on the wire:"
          tshark "${PCAP_OPAQUE[@]}" -r "$pcap" -Y infiniband | grep -E 'CM: ' | tail -8; } 2>/dev/null | sed 's/^/    | /'
    fi
}

# run NAME PEER 'GUEST_CMD' 'HOST_ARGS' [KIND PORT]: both roles of pv1 against PEER. A guest
#   peer runs GUEST_CMD as pv1 does ('SERVER_CMD|CLIENT_CMD' when they differ; the client's gets
#   the server's address appended); the host runs `vrdma HOST_ARGS` ('-': no host version)
run() {
    local name=$1 peer=$2 g=$3 h=$4 kind=${5:-tcp} port=${6:-18515} side gs gc hs hc
    has_peer "$peer" || return
    gs=${g%%|*}; gc=${g#*|}
    local tag=$peer
    case $peer in
        rxe) side=rxe; hs=$gs; hc=$gc ;;
        pvrdma) side=pv2; hs=$gs; hc=$gc; tag=$SECOND ;;
        host) side=host; hs=$h; hc=$h; [ "$h" = - ] && return ;;
    esac
    pair "$name.$tag.pv1-server" pv1 "$side" "$gs" "$hc" "$kind" "$port"
    pair "$name.$tag.$tag-server" "$side" pv1 "$hs" "$gc" "$kind" "$port"
}

# ---- the device as the guest sees it ------------------------------------------------------------
"$PV_DIR/exec.sh" -i 1 -t 60 'ibv_devinfo -v' > "$OUT/devinfo.txt" 2>&1
if grep -qE "^hca_id:[[:space:]]+$HCA" "$OUT/devinfo.txt" && grep -q PORT_ACTIVE "$OUT/devinfo.txt"; then
    PASS=$((PASS + 1)); summary "ibv_devinfo.pv1" "ok   ($HCA, PORT_ACTIVE)"
else
    FAILED+=(ibv_devinfo.pv1); summary "ibv_devinfo.pv1" "FAIL (see $OUT/devinfo.txt)"
fi

G='-d $RXE_DEV -g $RXE_GID_IDX'        # rdma-core's pingpongs: the RoCE v2 IPv4 GID
P='-d $RXE_DEV -x $RXE_GID_IDX -F'     # perftest
CM_WRITE="ib_write_bw -d \$RXE_DEV -R -F -s 65536 -n 100"
RPING='rping -s -v -C 10 -a $GUEST_IP|rping -c -v -C 10 -a'   # server on its own address
for peer in $PEERS; do
    if [ $QUICK = 1 ]; then
        run rc.s4096 "$peer" "ibv_rc_pingpong $G -m $MTU -s 4096 -n 100" "pingpong rc -m $MTU -s 4096 -n 100"
        [ "$peer" = host ] && run write_bw.s1048576 host "ib_write_bw $P -m $MTU -s 1048576 -n 5" \
            "perf write_bw -m $MTU -s 1048576 -n 5"
        [ "$peer" = pvrdma ] && run rping pvrdma "$RPING" - cm 7174
        [ "$peer" = rxe ] && run write_bw_cm rxe "$CM_WRITE" - cm 18515
        continue
    fi
    for spec in "1 100" "4096 100" "1048576 5"; do
        read -r size n <<< "$spec"
        run "rc.s$size" "$peer" "ibv_rc_pingpong $G -m $MTU -s $size -n $n" "pingpong rc -m $MTU -s $size -n $n"
    done
    for size in 1 1024; do
        run "ud.s$size" "$peer" "ibv_ud_pingpong $G -s $size -n 100" "pingpong ud -s $size -n 100"
    done
    # (UC: a virtio-rdma guest's, with any peer but a PVRDMA guest, whose device has none)
    if [ "$KIND1" = virtio-pci ] && ! { [ "$peer" = pvrdma ] && [ "$KIND2" = pvrdma ]; }; then
        run uc.s4096 "$peer" "ibv_uc_pingpong $G -m $MTU -s 4096 -n 100" "pingpong uc -m $MTU -s 4096 -n 100"
    fi
    sizes="1 1048576"; [ "$KIND1" = virtio-pci ] && sizes="1 4096 1048576"
    specs=()
    for t in write_bw read_bw send_bw write_lat read_lat send_lat; do
        for size in $sizes; do
            n=100; [ "$size" = 1048576 ] && n=5
            specs+=("$t $size $n")
        done
    done
    specs+=("atomic_bw 8 100" "atomic_lat 8 100")
    for spec in "${specs[@]}"; do
        read -r t size n <<< "$spec"
        s="-s $size"; [[ $t == atomic* ]] && s=""
        run "$t.s$size" "$peer" "ib_$t $P -m $MTU $s -n $n" "perf $t -m $MTU $s -n $n"
    done
    [ "$peer" = host ] && continue
    # (the host's tools have no SRQ pingpong)
    run srq.s4096 "$peer" "ibv_srq_pingpong $G -m $MTU -s 4096 -n 100" -
    run rping "$peer" "$RPING" - cm 7174
    run write_bw_cm "$peer" "$CM_WRITE" - cm 18515
done

collect
echo "matrix: $PASS passed, ${#FAILED[@]} failed (summary: $OUT/summary.txt)"
for f in "${FAILED[@]}"; do echo "  FAIL $f"; done
exit ${#FAILED[@]}
