#!/bin/bash
# Guest side of the pvrdma-guest harness. Runs as PID 1 (exec'd by the rxe image's
# /sbin/rxe-harness-init from a copy in /run). The host share is mounted at /harness:
#   /harness/guest.env   settings written by start.sh (GUEST_ID, GUEST_IP, GUEST_MAC, MODE, ...)
#   /harness/cmd.sh      the command to start once the device is ready
#   /harness/out/        guest.log, dmesg.log (followed live), pci.txt, gids.txt, rxe.env,
#                        devinfo.txt, ready, setup-failed, cmd.{stdout,stderr,rc}
#   /harness/ctl/        from the host: stop, jobs/<name>.sh (exec.sh)
# Same protocol as the rxe harness's guest-init.sh, so that exec.sh/stop.sh behave alike and
# job commands see the same variables: RXE_DEV (here vmw_pvrdma0), RXE_GID_IDX (the RoCE v2
# IPv4 GID), RXE_NETDEV, GUEST_IP, GUEST_ID, HOST_IP, NET_PREFIX.
set -u
export PATH=/harness/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root TERM=dumb LANG=C.UTF-8
H=/harness
OUT=$H/out
CTL=$H/ctl
. $H/guest.env
READY_TIMEOUT=${READY_TIMEOUT:-90}

log() { echo "[pv$GUEST_ID $(cut -d' ' -f1 /proc/uptime)s] $*" | tee -a $OUT/guest.log > /dev/console; }

halt_now() {
    log "powering off"
    [ -n "${DMESG_PID:-}" ] && kill "$DMESG_PID" 2>/dev/null
    dmesg > $OUT/dmesg.txt 2>/dev/null
    sync
    cd /
    umount $H 2>/dev/null
    echo o > /proc/sysrq-trigger
    sleep 30
}

fail() {
    log "SETUP FAILED: $*"
    echo "$*" > $OUT/setup-failed
    { ls -l /sys/class/infiniband/ 2>&1; ibv_devinfo -v 2>&1; rdma link 2>&1; ip -d addr 2>&1; } > $OUT/failed-state.txt
    halt_now
}

# ---- basic system --------------------------------------------------------------------------
mkdir -p /dev/pts /dev/shm
mountpoint -q /dev/pts || mount -t devpts -o gid=5,mode=620 devpts /dev/pts
mountpoint -q /dev/shm || mount -t tmpfs tmpfs /dev/shm
mountpoint -q /tmp     || mount -t tmpfs tmpfs /tmp
mountpoint -q /sys/kernel/debug || mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
ulimit -l unlimited        # RDMA memory registration pins pages
hostname "pvrdma-g$GUEST_ID"
dmesg -n 4 2>/dev/null      # console: warnings and worse; everything goes to out/dmesg.log
dmesg -w > $OUT/dmesg.log 2>&1 &
DMESG_PID=$!
log "boot: kernel $(uname -r), up $(cut -d' ' -f1 /proc/uptime)s"

{
    echo "127.0.0.1 localhost"
    echo "$HOST_IP host"
    for i in 1 2 3 4 5 6 7 8; do echo "$NET_PREFIX.$((10+i)) g$i"; done     # rxe guests
    for i in 1 2 3 4 5 6 7 8; do echo "$NET_PREFIX.$((20+i)) pv$i"; done    # pvrdma guests
} > /etc/hosts

# PCI functions and their drivers (for debugging)
pci_list() {
    local d v dev drv
    for d in /sys/bus/pci/devices/*; do
        read -r v < $d/vendor; read -r dev < $d/device
        drv=-; [ -e $d/driver ] && drv=$(basename "$(readlink $d/driver)")
        echo "${d##*/} $v:$dev $drv"
    done
}

# ---- network: vmxnet3 (function 0 of the PVRDMA's slot; vmw_pvrdma binds to it) ---------------
ip link set lo up
modprobe -a virtio_rng 2>/dev/null
# The NIC's and the RDMA device's drivers: PVRDMA's (the default) or virtio-rdma's.
NIC_MOD=vmxnet3 RDMA_MOD=vmw_pvrdma
[ "${RDMA_KIND:-pvrdma}" = virtio-pci ] && NIC_MOD=virtio_net RDMA_MOD=virtio_rdma
modprobe $NIC_MOD || fail "modprobe $NIC_MOD"
ETH=""
for _ in $(seq 1 100); do
    for d in /sys/class/net/*; do
        [ "$(cat $d/address 2>/dev/null)" = "$GUEST_MAC" ] && ETH=${d##*/}
    done
    [ -n "$ETH" ] && break
    sleep 0.1
done
pci_list > $OUT/pci.txt
[ -n "$ETH" ] || fail "no NIC with MAC $GUEST_MAC ($NIC_MOD not bound? see pci.txt)"
ip link set "$ETH" up || fail "ip link set $ETH up"
ip addr add "$GUEST_IP/24" dev "$ETH" || fail "ip addr add $GUEST_IP"
log "net: $ETH $GUEST_IP/24 (host side $HOST_IP), driver $(basename "$(readlink /sys/class/net/$ETH/device/driver)")"

# ---- PVRDMA ----------------------------------------------------------------------------------
for m in ib_core ib_uverbs rdma_ucm $RDMA_MOD; do
    modprobe "$m" || fail "modprobe $m"
    log "modprobe $m done"
done
pci_list > $OUT/pci.txt

DEV=""
for _ in $(seq 1 100); do
    for d in /sys/class/infiniband/*; do
        [ -e "$d" ] || continue
        case "$(basename "$(readlink $d/device/driver 2>/dev/null)")" in
            "$RDMA_MOD") DEV=${d##*/}; break ;;
        esac
    done
    [ -n "$DEV" ] && break
    sleep 0.1
done
[ -n "$DEV" ] || fail "no RDMA device bound to $RDMA_MOD in /sys/class/infiniband (see dmesg.log, pci.txt)"
log "RDMA device $DEV"

# wait for the port to be ACTIVE and the IPv4-mapped RoCE v2 GID to appear
# (bash builtins only: a fork costs ~10 ms under TCG)
want=$(printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' ${GUEST_IP//./ })
P=/sys/class/infiniband/$DEV/ports/1
GIDX=""
end=$(( ${READY_TIMEOUT} * 10 ))
for ((k = 0; k < end; k++)); do
    read -r st < $P/state 2>/dev/null
    if [[ "${st:-}" == *ACTIVE* ]]; then
        for ((i = 0; i < 32; i++)); do
            read -r v < $P/gids/$i 2>/dev/null || continue
            [ "$v" = "$want" ] || continue
            read -r ty < $P/gid_attrs/types/$i 2>/dev/null || continue
            [ "$ty" = "RoCE v2" ] && { GIDX=$i; break; }
        done
    fi
    [ -n "$GIDX" ] && break
    sleep 0.1
done

gid_table() {
    echo "# idx gid type netdev"
    for ((i = 0; i < 32; i++)); do
        read -r v < $P/gids/$i 2>/dev/null || continue
        [ "$v" = "0000:0000:0000:0000:0000:0000:0000:0000" ] && continue
        read -r ty < $P/gid_attrs/types/$i 2>/dev/null || ty=?
        read -r nd < $P/gid_attrs/ndevs/$i 2>/dev/null || nd=?
        echo "$i $v $ty $nd"
    done
}
gid_table > $OUT/gids.txt
[ -n "$GIDX" ] || fail "$DEV port 1 not ACTIVE or no RoCE v2 GID for $GUEST_IP after ${READY_TIMEOUT}s: state ${st:-none}"

export RXE_DEV=$DEV RXE_GID_IDX=$GIDX RXE_NETDEV=$ETH PVRDMA_DEV=$DEV GUEST_IP HOST_IP GUEST_ID NET_PREFIX
cat > $OUT/rxe.env <<EOF
RXE_DEV=$DEV
RXE_GID_IDX=$GIDX
RXE_NETDEV=$ETH
PVRDMA_DEV=$DEV
GUEST_IP=$GUEST_IP
GUEST_MAC=$GUEST_MAC
HOST_IP=$HOST_IP
KERNEL=$(uname -r)
EOF
ibv_devinfo -v > $OUT/devinfo.txt 2>&1
log "$DEV port ACTIVE on $ETH, RoCE v2 IPv4 GID index $GIDX"

# ---- run -------------------------------------------------------------------------------------
cd /root
run_job() {   # $1 = script  $2 = output prefix  $3 = timeout
    timeout -k 5 "$3" bash "$1" > "$2.stdout" 2> "$2.stderr" < /dev/null
    echo $? > "$2.rc.tmp"; mv "$2.rc.tmp" "$2.rc"
}

if [ "$MODE" = run ]; then
    log "running command (timeout ${CMD_TIMEOUT}s)"
    touch $OUT/ready
    run_job $H/cmd.sh $OUT/cmd "$CMD_TIMEOUT"
    log "command exited rc=$(cat $OUT/cmd.rc)"
    halt_now
fi

# daemon mode: command in the background, then serve jobs until ctl/stop appears
log "daemon: starting command in background"
run_job $H/cmd.sh $OUT/cmd "$CMD_TIMEOUT" &
touch $OUT/ready
mkdir -p $CTL/jobs
while [ ! -e $CTL/stop ]; do
    for j in $CTL/jobs/*.sh; do
        [ -e "$j" ] || continue
        name=${j##*/}; name=${name%.sh}
        mv "$j" "$CTL/jobs/$name.started" || continue
        jt=$(cat "$CTL/jobs/$name.timeout" 2>/dev/null || echo "$CMD_TIMEOUT")
        log "job $name (timeout ${jt}s)"
        run_job "$CTL/jobs/$name.started" "$CTL/jobs/$name" "$jt" &
    done
    sleep 0.2
done
log "stop requested"
pkill -TERM -P $$ 2>/dev/null   # our job wrappers (timeout processes are their children)
pkill -TERM timeout 2>/dev/null # ... and the commands' timeout wrappers (inside the guest only)
sleep 1
halt_now
