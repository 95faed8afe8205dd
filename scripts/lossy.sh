#!/usr/bin/env bash
# RC over a lossy link: vrdma <-> the kernel's rxe in both roles, and rxe <-> rxe
# (two guests) as the control, under the same impairment.
#
# The interop harness (../shared/interop/rxe-guest, or $RXE_HARNESS) boots Debian
# guests with rdma_rxe under QEMU on TAPs in the namespace "rxens"; vrdma runs in
# that namespace on 10.47.91.1. Guest 1 (10.47.91.11) impairs its own link, both
# ways, with netem (this host's kernel has no modules; the guest's has): egress on
# eth0, ingress redirected through ifb0 to a second netem. Every pair crosses
# guest 1's link: vrdma <-> guest 1, and guest 2 <-> guest 1 for the control.
#
#   scripts/lossy.sh                  # the suite: loss 0.1, 1 and 5 % (about 40 minutes)
#   scripts/lossy.sh --quick          # CI's subset: 1 %, vrdma <-> rxe only (about 3 minutes)
#   LOSSY_LOSS="1 5" LOSSY_ONLY='^read' scripts/lossy.sh   # some losses, pairs matching a regex
#   LOSSY_REPEAT=3 scripts/lossy.sh   # each run three times: medians (the emulated guests
#                                     # vary by tens of percent from run to run)
#
# Each loss rate comes with 1 % duplication, 1 % reordering and 1 ms of delay each
# way (LOSSY_DUP, LOSSY_REORDER, LOSSY_DELAY override them). Workloads, at rxe's
# path MTU 1024: ibv_rc_pingpong 4 KiB x 200; ib_write_bw, ib_read_bw, ib_send_bw
# 64 KiB x 100; ib_atomic_bw x 1000, with the attributes perftest and rdma-core set
# (timeout 14, retry_cnt 7, rnr_retry 7). Per run: completed or not (both sides exit
# 0 within LOSSY_LIMIT, 300 s; a pingpong whose client exited 0 with every message
# and whose vrdma server's last SEND alone went unacknowledged completed too, and
# is listed apart: ibv_rc_pingpong's own race, below), the time the client took, the requester's retries
# (vrdma: timeouts + sequence NAKs + implied NAKs; rxe: completer_retry_err; both
# sides' for the pingpong, where both send) and the packets the data's sender sent
# per packet the workload needs (both sides' for the pingpong, ACKs included).
#
# Needs root. Logs, captures of failed runs (of every run with LOSSY_KEEP=1) and the
# table (table.md) go to target/lossy/; the exit status is the number of vrdma <-> rxe
# runs that did not complete (0 = all did).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
H=${RXE_HARNESS:-$ROOT/../shared/interop/rxe-guest}
. "$ROOT/scripts/lib/cache.sh"
export RXE_CACHE_DIR=${RXE_CACHE_DIR:-$VRDMA_CACHE_DIR/rxe-cache}
export RXE_RUN_DIR=${RXE_RUN_DIR:-$ROOT/target/rxe-run}
OUT=$ROOT/target/lossy
NS=rxens
G1=10.47.91.11
MTU=1024
LIMIT=${LOSSY_LIMIT:-300}
DUP=${LOSSY_DUP:-1}
REORDER=${LOSSY_REORDER:-1}
DELAY=${LOSSY_DELAY:-1ms}
QUICK=0
[ "${1:-}" = --quick ] && QUICK=1
if [ $QUICK = 1 ]; then
    LOSSES=${LOSSY_LOSS:-1}
    ROLES="rxe-server vrdma-server"
else
    LOSSES=${LOSSY_LOSS:-0.1 1 5}
    ROLES="rxe-server vrdma-server rxe-rxe"
fi

[ -x "$H/start.sh" ] || { echo "no interop harness at $H" >&2; exit 125; }
[ "$(id -u)" = 0 ] || { echo "the lossy suite needs root (namespaces, TAP, QEMU)" >&2; exit 125; }
mkdir -p "$OUT"
cargo build --release --locked -p vrdma --manifest-path "$ROOT/Cargo.toml" || exit 125
VRDMA=$ROOT/target/release/vrdma

"$H/setup-host.sh" > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 125; }
cache_locked "$RXE_CACHE_DIR" "$H/build-image.sh" >> "$OUT/setup.log" 2>&1 || { tail "$OUT/setup.log"; exit 125; }
cache_locked "$RXE_CACHE_DIR" "$H/probe-accel.sh" >> "$OUT/setup.log" 2>&1 || { tail "$OUT/setup.log"; exit 125; }
GUESTS="1"
[[ $ROLES == *rxe-rxe* ]] && GUESTS="1 2"
stop_guests() { for g in $GUESTS; do "$H/stop.sh" -i "$g" > /dev/null 2>&1; done; }
trap stop_guests EXIT
for g in $GUESTS; do
    "$H/stop.sh" -i "$g" > /dev/null 2>&1
    "$H/start.sh" -i "$g" -l 14400 > "$OUT/start-g$g.log" 2>&1 || { cat "$OUT/start-g$g.log"; exit 125; }
    # The TAP queues what the emulated guest has not taken in yet, so that
    # losses are netem's, not an overflowing TAP's.
    ip -n $NS link set "rxetap$g" txqueuelen 10000
done

# impair LOSS: guest 1's link, both ways (LOSS 0: delay only).
impair() {
    local spec="limit 100000 delay $DELAY reorder $REORDER% loss $1% duplicate $DUP%"
    "$H/exec.sh" -i 1 "modprobe sch_netem && modprobe ifb numifbs=1 &&
        tc qdisc del dev eth0 root 2> /dev/null; tc qdisc del dev eth0 ingress 2> /dev/null;
        tc qdisc del dev ifb0 root 2> /dev/null;
        ip link set ifb0 up &&
        tc qdisc add dev eth0 root netem $spec &&
        tc qdisc add dev eth0 handle ffff: ingress &&
        tc filter add dev eth0 parent ffff: protocol all matchall action mirred egress redirect dev ifb0 &&
        tc qdisc add dev ifb0 root netem $spec &&
        tc -s qdisc show dev eth0 | head -1" > "$OUT/impair-$1.log" 2>&1 ||
        { cat "$OUT/impair-$1.log"; exit 125; }
}

# rxe_counters N: guest N's rxe0 "sent_pkts completer_retry_err".
rxe_counters() {
    "$H/exec.sh" -i "$1" 'd=/sys/class/infiniband/rxe0/ports/1/hw_counters;
        echo $(cat $d/sent_pkts) $(cat $d/completer_retry_err)'
}

# vrdma_counters DIR: "tx_packets retries" of the device that ran with
# VRDMA_RUN_DIR=DIR.
vrdma_counters() {
    VRDMA_RUN_DIR=$1 "$VRDMA" stat --all --zeros | awk '
        $1 == "engine.tx_packets" { tx = $2 }
        $1 ~ /^engine\.retry_(timeout|seq_nak|implied_nak)$/ { r += $2 }
        END { print tx + 0, r + 0 }'
}

# Waits for a background guest job (exec.sh -b prefix) to finish; its rc.
job_rc() {
    local prefix=$1 limit=$2
    for _ in $(seq 1 $((limit * 5))); do
        [ -s "$prefix.rc" ] && { cat "$prefix.rc"; return; }
        sleep 0.2
    done
    echo timeout
}

now() { date +%s.%N; }

# last_ack_lost LOG: vrdma pingpong's LOG ends in RETRY_EXC_ERR for its last
# SEND (wr_id 2) with every message received and all but that one sent.
last_ack_lost() {
    tail -1 "$1" | grep -Eq 'Failed status RetryExcErr \(12\) for wr_id 2 \(sent ([0-9]+) of ([0-9]+), received ([0-9]+)\)$' &&
        tail -1 "$1" | sed -E 's/.*sent ([0-9]+) of ([0-9]+), received ([0-9]+)\)$/\1 \2 \3/' |
        awk '{ exit !($1 == $2 - 1 && $3 == $2) }'
}

failed=()
lastack=()
TABLE=$OUT/table.md
RESULTS=$OUT/results.tsv
: > "$RESULTS"
REPEAT=${LOSSY_REPEAT:-1}

# run NAME LOSS RXE_SERVER RXE_CLIENT VRDMA_ARGS BYTES NEEDED DATA [OPS]: one workload
# in every role, LOSSY_REPEAT times (the roles take turns within each repetition).
# DATA says which side sends the data: "requester", "responder" or "both"; OPS, for
# atomics, the operations (goodput is then operations a second).
run() {
    local name=$1
    [[ -n ${LOSSY_ONLY:-} && ! $name =~ $LOSSY_ONLY ]] && return
    for rep in $(seq 1 "$REPEAT"); do
        for role in $ROLES; do
            once "$role" "$rep" "$@"
        done
    done
}

once() {
    local role=$1 rep=$2 name=$3 loss=$4 server=$5 client=$6 args=$7 bytes=$8 needed=$9
    local data=${10} ops=${11:-0}
    local tag="$name.loss$loss.$role" ok=1 start end rc job pid note=
    [ "$REPEAT" -gt 1 ] && tag="$tag.$rep"
    local dir=$OUT/run-$tag
    rm -rf "$dir"
    local pcap=$OUT/$tag.pcap
    "$H/capture.sh" start "$pcap" rxetap1 > /dev/null 2>&1
    local c1 c2 d1 d2
    c1=$(rxe_counters 1)
    case $role in
        rxe-server)
            job=$("$H/exec.sh" -i 1 -b "timeout $LIMIT $server" | tail -1)
            "$H/exec.sh" -i 1 -t 30 'wait-listen 18515' > /dev/null
            start=$(now)
            VRDMA_RUN_DIR=$dir timeout "$LIMIT" ip netns exec $NS "$VRDMA" $args --timeout 60 $G1 \
                > "$OUT/$tag.vrdma" 2>&1 || ok=0
            end=$(now)
            rc=$(job_rc "$job" "$LIMIT")
            cat "$job.stdout" "$job.stderr" > "$OUT/$tag.rxe" 2> /dev/null
            [ "$rc" = 0 ] || ok=0
            ;;
        vrdma-server)
            VRDMA_RUN_DIR=$dir timeout "$LIMIT" ip netns exec $NS "$VRDMA" $args --timeout 60 \
                > "$OUT/$tag.vrdma" 2>&1 &
            pid=$!
            for _ in $(seq 1 50); do
                ip netns exec $NS ss -ltn 2> /dev/null | grep -q ':18515 ' && break
                sleep 0.1
            done
            start=$(now)
            "$H/exec.sh" -i 1 -t "$LIMIT" "timeout $LIMIT $client host" > "$OUT/$tag.rxe" 2>&1 || ok=0
            end=$(now)
            if ! wait $pid; then
                # ibv_rc_pingpong's race: the server sends the last message and
                # the client leaves once it has it; when the client's ACK of it
                # is lost, the server's resends find no QP and its last SEND
                # ends in RETRY_EXC_ERR (rdma-core's server the same; the
                # rxe <-> rxe control shows it too). Every message arrived, so
                # the run completed; the table counts these apart.
                if [ "$name" = rc-pingpong ] && [ $ok = 1 ] && last_ack_lost "$OUT/$tag.vrdma"; then
                    lastack+=("$tag")
                    note="  (the server's last SEND unacknowledged: the client had left)"
                else
                    ok=0
                fi
            fi
            ;;
        rxe-rxe)
            d1=$(rxe_counters 2)
            job=$("$H/exec.sh" -i 1 -b "timeout $LIMIT $server" | tail -1)
            "$H/exec.sh" -i 1 -t 30 'wait-listen 18515' > /dev/null
            start=$(now)
            "$H/exec.sh" -i 2 -t "$LIMIT" "timeout $LIMIT $client g1" > "$OUT/$tag.rxe-client" 2>&1 || ok=0
            end=$(now)
            rc=$(job_rc "$job" "$LIMIT")
            cat "$job.stdout" "$job.stderr" > "$OUT/$tag.rxe" 2> /dev/null
            [ "$rc" = 0 ] || ok=0
            d2=$(rxe_counters 2)
            ;;
    esac
    c2=$(rxe_counters 1)
    "$H/capture.sh" stop "$pcap" > /dev/null 2>&1
    # The requester is the client; the data's sender is the requester (WRITE,
    # SEND, atomics, the pingpong's both sides) or the responder (READ).
    # Counters as deltas over the run.
    local g1sent g1retry vsent=0 vretry=0 g2sent=0 g2retry=0
    read -r g1sent g1retry <<< "$(paste -d' ' <(echo "$c2") <(echo "$c1") |
        awk '{ print $1 - $3, $2 - $4 }')"
    if [ "$role" = rxe-rxe ]; then
        read -r g2sent g2retry <<< "$(paste -d' ' <(echo "$d2") <(echo "$d1") |
            awk '{ print $1 - $3, $2 - $4 }')"
    else
        read -r vsent vretry <<< "$(vrdma_counters "$dir")"
    fi
    local req_sent req_retry resp_sent resp_retry
    case $role in
        rxe-server) req_sent=$vsent req_retry=$vretry resp_sent=$g1sent resp_retry=$g1retry ;;
        vrdma-server) req_sent=$g1sent req_retry=$g1retry resp_sent=$vsent resp_retry=$vretry ;;
        rxe-rxe) req_sent=$g2sent req_retry=$g2retry resp_sent=$g1sent resp_retry=$g1retry ;;
    esac
    local sent=$req_sent
    [ "$data" = responder ] && sent=$resp_sent
    if [ "$data" = both ]; then
        # Both sides send requests: both sides' retries count.
        sent=$((req_sent + resp_sent))
        req_retry=$((req_retry + resp_retry))
    fi
    local secs rate unit ratio
    secs=$(echo "$end $start" | awk '{ printf "%.1f", $1 - $2 }')
    if [ "$name" = atomic_bw ]; then
        rate=$(echo "$ops $end $start" | awk '{ printf "%.0f", $1 / ($2 - $3) }')
        unit=op/s
    else
        rate=$(echo "$bytes $end $start" | awk '{ printf "%.2f", $1 / ($2 - $3) / 1e6 }')
        unit=MB/s
    fi
    ratio=$(echo "$sent $needed" | awk '{ printf "%.2f", $1 / $2 }')
    if [ $ok = 1 ]; then
        [ -n "${LOSSY_KEEP:-}" ] || rm -f "$pcap"
        echo "ok    $tag  ${secs} s  retries $req_retry  sent/needed $ratio$note"
    else
        [ "$role" = rxe-rxe ] || failed+=("$tag")
        echo "FAIL  $tag  ${secs} s (logs and capture: $OUT/$tag.*)"
    fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$loss" "$role" "$ok" "$secs" \
        "$rate" "$unit" "$req_retry" "$ratio" >> "$RESULTS"
}

# The table: per workload, loss and role, the runs that completed and the medians
# of those runs' time, goodput, retries and packets sent per packet needed.
table() {
    echo "| workload | loss | role | completed | time (s) | goodput | requester retries | sent / needed |"
    echo "|---|---|---|---|---|---|---|---|"
    awk -F'\t' '
        function median(list,   n, a, i, j, t) {
            n = split(list, a, " ")
            if (n == 0) return "-"
            for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++)
                if (a[j] + 0 < a[i] + 0) { t = a[i]; a[i] = a[j]; a[j] = t }
            return (n % 2) ? a[(n + 1) / 2] : sprintf("%.3g", (a[n / 2] + a[n / 2 + 1]) / 2)
        }
        {
            k = $1 SUBSEP $2 SUBSEP $3
            if (!(k in runs)) { order[++keys] = k; name[k] = $1; loss[k] = $2; role[k] = $3 }
            runs[k]++
            unit[k] = $7
            if ($4 == 1) { done[k]++; secs[k] = secs[k] " " $5; rate[k] = rate[k] " " $6
                retry[k] = retry[k] " " $8; ratio[k] = ratio[k] " " $9 }
        }
        END {
            for (i = 1; i <= keys; i++) {
                k = order[i]
                r = median(rate[k]); if (r != "-") r = r " " unit[k]
                printf "| %s | %s %% | %s | %d/%d | %s | %s | %s | %s |\n", name[k], loss[k], role[k],
                    done[k], runs[k], median(secs[k]), r, median(retry[k]), median(ratio[k])
            }
        }' "$RESULTS"
}

for loss in $LOSSES; do
    impair "$loss"
    g="-d rxe0 -g 1"
    p="-d rxe0 -x 1 -F -m $MTU"
    # ibv_rc_pingpong: 4 KiB each way, 200 round trips; 4 packets and an
    # ACK per message, both sides.
    run rc-pingpong "$loss" "ibv_rc_pingpong $g -m $MTU -s 4096 -n 200" \
        "ibv_rc_pingpong $g -m $MTU -s 4096 -n 200" "pingpong rc -m $MTU -s 4096 -n 200" \
        $((2 * 200 * 4096)) $((2 * 200 * 5)) both
    # 64 KiB x 100: 64 packets a message.
    for t in write_bw read_bw send_bw; do
        data=requester
        [ $t = read_bw ] && data=responder
        run "$t" "$loss" "ib_$t $p -s 65536 -n 100" "ib_$t $p -s 65536 -n 100" \
            "perf $t -m $MTU -s 65536 -n 100" $((100 * 65536)) $((100 * 64)) $data
    done
    run atomic_bw "$loss" "ib_atomic_bw $p -n 1000" "ib_atomic_bw $p -n 1000" \
        "perf atomic_bw -m $MTU -n 1000" $((1000 * 8)) 1000 requester 1000
done

table > "$TABLE"
echo
cat "$TABLE"
echo
if [ ${#lastack[@]} -gt 0 ]; then
    echo "${#lastack[@]} pingpong runs completed with the server's last SEND unacknowledged" \
        "(the client had left; ibv_rc_pingpong's race):"
    for f in "${lastack[@]}"; do echo "  $f"; done
fi
echo "${#failed[@]} vrdma <-> rxe runs did not complete"
for f in "${failed[@]}"; do echo "  $f"; done
exit ${#failed[@]}
