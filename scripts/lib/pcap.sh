# Checks a RoCEv2 capture two ways: `vrdma decode` (every packet well formed, ICRC good) and
# tshark (RoCE dissected, nothing malformed or in error). Sourced by scripts/interop.sh and
# scripts/pvrdma-guest/matrix.sh:
#   pcap_init                      once: finds tshark's RDMA-payload heuristics (needs tshark)
#   pcap_check VRDMA PCAP PREFIX   writes PREFIX.decode (and PREFIX.tshark, its errors); 0 clean,
#                                  1 with a line saying why

# Wireshark's heuristics for protocols carried over RDMA (RPC-over-RDMA, SMB Direct, ...) parse
# the tests' bytes as theirs and call them malformed (rxe's own packets too): the payload is
# opaque here, so those protocols are switched off (one --disable-protocol each; only names
# tshark knows as protocols). Nor is the payload an Ethernet frame: the EtherType guess turns
# random bytes into malformed VLAN or LOOP frames.
# The rxe harness's capture.sh uses tcpdump's default buffer, which loses most of an exchange
# a vrdma device writes at host speed (64 of ~5 200 packets of a 1 MiB write_bw once): the
# buffer here holds a whole test's exchange, and what the kernel still dropped is reported.
pcap_start() {
    local ns=$1 iface=$2 pcap=$3 i
    rm -f "$pcap" "$pcap.err"
    setsid timeout -s INT -k 5 600 ip netns exec "$ns" tcpdump -Z root --immediate-mode -B 262144 \
        -i "$iface" -U -s 0 -w "$pcap" udp port 4791 > "$pcap.err" 2>&1 < /dev/null &
    echo $! > "$pcap.pid"
    for ((i = 0; i < 100; i++)); do
        grep -qs "listening on" "$pcap.err" && return 0
        sleep 0.1
    done
    return 1
}

pcap_stop() {
    local p i; p=$(cat "$1.pid" 2>/dev/null) || return 1
    rm -f "$1.pid"
    sleep 0.3   # the last packets land
    kill -INT "$p" 2>/dev/null   # timeout(1) passes SIGINT on to tcpdump
    for ((i = 0; i < 100; i++)); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null
    sed -n 's/^\([0-9]*\) packets dropped by kernel.*/\1/p' "$1.err" | head -1
}

PCAP_OPAQUE=()
pcap_init() {
    local protocols p
    protocols=$(tshark -G protocols 2> /dev/null | cut -f3)
    PCAP_OPAQUE=()
    for p in $(tshark -G heuristic-decodes 2> /dev/null | awk '$1 == "infiniband.payload" { print $2 }'); do
        if grep -qx -- "$p" <<< "$protocols"; then PCAP_OPAQUE+=(--disable-protocol "$p"); fi
    done
    [ ${#PCAP_OPAQUE[@]} -gt 0 ] || { echo "tshark knows no RDMA payload protocols?" >&2; return 1; }
    PCAP_OPAQUE+=(-o infiniband.identify_payload:FALSE)
}

pcap_check() {
    local vrdma=$1 pcap=$2 prefix=$3 packets bad
    "$vrdma" decode "$pcap" > "$prefix.decode" 2>&1 || {
        echo "  vrdma decode rejected $pcap (see $prefix.decode)"
        return 1
    }
    local roce errors
    roce=$(tshark "${PCAP_OPAQUE[@]}" -r "$pcap" -Y "infiniband" 2> "$prefix.tshark") \
        && errors=$(tshark "${PCAP_OPAQUE[@]}" -r "$pcap" -Y "_ws.malformed || _ws.expert.severity == error" \
            2>> "$prefix.tshark") || {
        echo "  tshark could not read $pcap (see $prefix.tshark)"
        return 1
    }
    packets=$(grep -c . <<< "$roce")
    bad=$(grep -c . <<< "$errors")
    [ "$packets" -gt 0 ] && [ "$bad" -eq 0 ] || {
        echo "  tshark: $packets RoCE packets, $bad malformed or in error ($pcap)"
        return 1
    }
}
