#!/usr/bin/env bash
# Middleware and kernel ULPs, unmodified, in guests on vrdma (issue 38): each face against an rxe
# guest of the same Debian release, in both roles, and between two guests of that face on one
# daemon (their pairs go through its same-host shared memory).
#   pvrdma: Debian 12 guests (stock vmw_pvrdma, rdma-core's provider), UCX 1.13, libfabric 1.17,
#           OpenMPI 4.1
#   virtio: Debian 13 guests (the project's virtio_rdma driver and provider), UCX 1.18,
#           libfabric 2.1, OpenMPI 5.0
# The rxe guest boots the same image (the rxe harness, RXE_CACHE_DIR=$VRDMA_CACHE_DIR/middleware/REL).
# Tests, with Debian's packages and their default settings wherever rxe takes them:
#   ucx.*   ucx_perftest tag_lat, tag_bw, ucp_put_lat, ucp_get, ucp_add over rc_verbs (UCX_TLS=rc_v)
#           and ud_verbs (UCX_TLS=ud_v);
#   mpi     mpirun --mca pml ucx across the two guests: guest/middleware/mpi_check (a ping-pong
#           8 B..1 MiB, an allreduce, a windowed 1 MiB bandwidth test; every byte checked);
#   fi.*    fi_pingpong -v (data checked) over verbs (msg endpoints) and verbs;ofi_rxm (rdm);
#   nfs3, nfs4.2  NFS over RDMA (port 20049): a file written, read back after a remount, its
#           SHA-256 equal on the client and on the server's disk;
#   iser    LIO (targetcli) with an iSER portal as target, open-iscsi over iSER as initiator:
#           O_DIRECT writes and reads of the LUN, checksums on both sides;
#   smb     SMB Direct (ksmbd, mount -t cifs -o rdma) where both kernels have it (neither
#           Debian 12's 6.1 nor 13's 6.12 build CONFIG_SMB_SERVER_SMBDIRECT/CIFS_SMB_DIRECT:
#           reported "not in the kernels", not counted as passed).
#   NVMe-oF: scripts/virtio-guest/nvmf.sh (in CI).
# The control: a second rxe guest (r2), the same image, runs the tests with figures (UCX, MPI) as
# rxe <-> rxe; figures.txt sets every pair's figures beside the control's, as ratios (> 1: faster
# than rxe <-> rxe; for latency the control's time over the pair's).
#
#   scripts/middleware/matrix.sh                 # both faces, every test, both roles (~11 min a face, TCG)
#   scripts/middleware/matrix.sh --quick         # CI's subset: a virtio-rdma guest serving an rxe
#                                                # guest: UCX rc and ud, libfabric rdm, MPI (~2 min)
#   MW_FACES=pvrdma scripts/middleware/matrix.sh # one face;  MW_ONLY=REGEX: tests whose tag matches
# Exit: the number of failed checks (125: the harness failed). Evidence: target/middleware/out/
# (summary.txt with each test's figure, figures.txt, each test's log, the daemon's counters).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
QUICK=0
case "${1:-}" in --quick) QUICK=1 ;; "") ;; *) sed -n '2,30p' "$0"; exit 2 ;; esac
. "$here/../pvrdma-guest/config.sh"
. "$PV_DIR/lib.sh"
need_root
OUT=$PROJECT_ROOT/target/middleware/out
SERVE=$PROJECT_ROOT/target/middleware/serve
export RXE_RUN_DIR=$PROJECT_ROOT/target/middleware/rxe-run
LIFE=3000
ONLY=${MW_ONLY:-.}
if [ $QUICK = 1 ]; then FACES=${MW_FACES:-virtio}; else FACES=${MW_FACES:-pvrdma virtio}; fi
rm -rf "$OUT"; mkdir -p "$OUT"
say() { echo "middleware: $*" >&2; }
summary() { printf '%-44s %s\n' "$1" "$2" | tee -a "$OUT/summary.txt"; }
FAILED=0
PASSED=0

cargo build --release --locked -p vrdma --manifest-path "$PROJECT_ROOT/Cargo.toml" > "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 125; }

# ---- the guests: v1, v2 on vrdma (one daemon, one network), r1 (and r2, the control) on rxe ----
R=1
NR=1
node_ip() { case $1 in v*) pv_ip "${1#v}" ;; r*) echo "$NET_PREFIX.$((10 + ${1#r}))" ;; esac; }
# on NODE TIMEOUT 'CMD': CMD in NODE, waited for; its output on stdout
on() {
    case $1 in
        v*) timeout $(($2 + 60)) "$PV_DIR/exec.sh" -i "${1#v}" -t "$2" "$3" ;;
        r*) RXE_CACHE_DIR=$MWDIR timeout $(($2 + 60)) "$RXE_HARNESS/exec.sh" -i "${1#r}" -t "$2" "$3" ;;
    esac
}
# bg NODE TIMEOUT 'CMD': started in the background; prints the job's output prefix
bg() {
    case $1 in
        v*) "$PV_DIR/exec.sh" -i "${1#v}" -t "$2" -b "$3" ;;
        r*) RXE_CACHE_DIR=$MWDIR "$RXE_HARNESS/exec.sh" -i "${1#r}" -t "$2" -b "$3" ;;
    esac
}
wait_job() { # wait_job PREFIX SECONDS: prints the job's rc, or "timeout"
    local i
    for ((i = 0; i < $2 * 5; i++)); do [ -s "$1.rc" ] && break; sleep 0.2; done
    cat "$1.rc" 2>/dev/null || echo timeout
}
stop_guests() {
    local n
    for n in 1 2; do "$PV_DIR/stop.sh" -i "$n" > /dev/null 2>&1; done
    for n in 1 2; do RXE_CACHE_DIR=${MWDIR:-} "$RXE_HARNESS/stop.sh" -i $n > /dev/null 2>&1; done
    shared_serve_stop "$SERVE" "$OUT/stat.$FACE.txt"
}
FACE=none
trap 'stop_guests' EXIT

# every guest's services: sshd (mpirun starts its daemons over it), /run/sshd
SETUP='mkdir -p /run/sshd && /usr/sbin/sshd && echo sshd up'

# ---- one test: a server command, then a client command, both must pass --------------------------
# pair TAG SERVER CLIENT 'SERVER_CMD' 'CLIENT_CMD' PORT: SERVER_CMD in node SERVER in the
#   background; once its TCP PORT listens (PORT "-": at once), CLIENT_CMD in CLIENT with the
#   server's address as its argument $S (exported)
pair() {
    local tag=$1 s=$2 c=$3 scmd=$4 ccmd=$5 port=$6 hs hc src crc why=""
    [[ "$tag" =~ $ONLY ]] || return 0
    local sip; sip=$(node_ip "$s")
    hs=$(bg "$s" 400 "$scmd")
    if [ "$port" != - ]; then
        on "$s" 60 "wait-listen $port 50" > "$OUT/$tag.listen" 2>&1 || why+=" server not listening;"
    fi
    hc=$(bg "$c" 400 "export S=$sip; $ccmd")
    crc=$(wait_job "$hc" 460)
    src=$(wait_job "$hs" 60)
    { echo "== server ($s $sip, rc $src): $scmd"; cat "$hs.stdout" "$hs.stderr" 2>/dev/null
      echo "== client ($c $(node_ip "$c"), rc $crc): $ccmd"; cat "$hc.stdout" "$hc.stderr" 2>/dev/null; } > "$OUT/$tag.log" 2>&1
    [ "$src" = 0 ] || why+=" server rc $src;"
    [ "$crc" = 0 ] || why+=" client rc $crc;"
    verdict "$tag" "$why" "$(figure "$tag" "$hc.stdout")"
}
verdict() { # verdict TAG WHY [NOTE]
    if [ -z "$2" ]; then
        PASSED=$((PASSED + 1)); summary "$1" "ok   ${3:-}"
    else
        FAILED=$((FAILED + 1)); summary "$1" "FAIL$2 (log: $OUT/$1.log)"
    fi
}
# figure TAG FILE: the number a test reports (UCX: its last "Final" line's latency or bandwidth)
figure() {
    local f=$2
    case $1 in
        *ucx.*_lat*) awk '/^Final:/ { print $3 " us (median)" }' "$f" 2>/dev/null | tail -n1 ;;
        *ucx.*_add*) awk '/^Final:/ { print $8 " msg/s" }' "$f" 2>/dev/null | tail -n1 ;;
        *ucx.*) awk '/^Final:/ { print $6 " MB/s" }' "$f" 2>/dev/null | tail -n1 ;;
        *mpi*) awk '/pingpong 8 B/ { l = $5 " us" } /^bandwidth/ { b = $6 " MB/s" } END { print l, b }' "$f" 2>/dev/null ;;
    esac
}

# ---- the tests -------------------------------------------------------------------------------
# UCX: the device is the guest's only RDMA device; UCX_NET_DEVICES names it (port 1)
UCX_TESTS="tag_lat:8:300 tag_bw:65536:100 ucp_put_lat:8:300 ucp_get:65536:100 ucp_add:8:300"
ucx_tests() { # ucx_tests PREFIX SERVER CLIENT
    local t name size n tls port=13337
    for tls in rc_v ud_v; do
        for t in $UCX_TESTS; do
            IFS=: read -r name size n <<< "$t"
            [ $QUICK = 1 ] && case $tls.$name in rc_v.tag_lat | ud_v.tag_lat) ;; *) continue ;; esac
            local env="$UCX_ENV UCX_NET_DEVICES=\$RXE_DEV:1 UCX_TLS=$tls,self"
            pair "$1.ucx.$tls.$name" "$2" "$3" \
                "$env ucx_perftest $UCX_P0 -p $port -t $name -s $size -n $n -w 50" \
                "$env ucx_perftest $UCX_P0 \$S -p $port -t $name -s $size -n $n -w 50" $port
        done
    done
}
# libfabric: fi_pingpong with data verification; rxe's CQs (32767) are smaller than rxm's default
# (FI_UNIVERSE_SIZE 256: a 135168-entry CQ), so the rxe side lowers FI_UNIVERSE_SIZE
fi_env() { case $1 in r*) echo "FI_UNIVERSE_SIZE=64" ;; *) echo "" ;; esac; }
fi_tests() { # fi_tests PREFIX SERVER CLIENT
    local ep prov
    for ep in msg rdm; do
        [ $QUICK = 1 ] && [ $ep = msg ] && continue
        [ $ep = msg ] && prov=verbs || prov="verbs;ofi_rxm"
        pair "$1.fi.$ep" "$2" "$3" \
            "$(fi_env "$2") fi_pingpong -p '$prov' -e $ep -d \$RXE_DEV -v -I 50 -S 65536" \
            "$(fi_env "$3") fi_pingpong -p '$prov' -e $ep -d \$RXE_DEV -v -I 50 -S 65536 \$S" 47592
    done
}
# OpenMPI over UCX: launched from CLIENT (rank 0 there), rank 1 on SERVER over SSH
mpi_test() { # mpi_test PREFIX SERVER CLIENT
    local tag="$1.mpi" sip cip
    [[ "$tag" =~ $ONLY ]] || return 0
    sip=$(node_ip "$2"); cip=$(node_ip "$3")
    local cmd="export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;
timeout 600 mpirun --allow-run-as-root -np 2 --host \$(hostname):1,$sip:1 --map-by node --mca pml ucx --mca btl self \
  --mca osc ucx -x UCX_TLS=rc_v,self $(for e in $UCX_ENV; do printf -- '-x %s ' "$e"; done)-x OMPI_ALLOW_RUN_AS_ROOT=1 -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  /usr/local/bin/mpi_check"
    local rc why=""
    on "$3" 700 "$cmd" > "$OUT/$tag.log" 2>&1; rc=$?
    [ $rc = 0 ] || why=" rc $rc;"
    grep -q '^mpi_check: passed' "$OUT/$tag.log" || why+=" no pass line;"
    verdict "$tag" "$why" "$(figure "$tag" "$OUT/$tag.log")"
}

# ---- kernel ULPs: every byte checked -----------------------------------------------------------
MB=${MW_ULP_MB:-32}
# the client's file: MB MiB of random bytes in /root/data, its SHA-256 in /root/data.sum
MKDATA="dd if=/dev/urandom of=/root/data bs=1M count=$MB status=none && sha256sum < /root/data | cut -d' ' -f1 > /root/data.sum"
# ulp TAG SERVER CLIENT 'SERVER_SETUP' 'CLIENT_RUN' 'SERVER_CHECK' 'CLIENT_CLEANUP' 'SERVER_CLEANUP'
ulp() {
    local tag=$1 s=$2 c=$3 why="" rc sum_c sum_s
    [[ "$tag" =~ $ONLY ]] || return 0
    local sip; sip=$(node_ip "$s")
    {
        echo "== server setup ($s $sip)"; on "$s" 300 "$4"; rc=$?; [ $rc = 0 ] || why+=" server setup rc $rc;"
        if [ -z "$why" ]; then
            echo "== client ($c)"; on "$c" 500 "export S=$sip; $MKDATA && $5"; rc=$?; [ $rc = 0 ] || why+=" client rc $rc;"
            echo "== server check"; on "$s" 120 "$6"; rc=$?; [ $rc = 0 ] || why+=" server check rc $rc;"
        fi
        echo "== client cleanup"; on "$c" 120 "$7"
        echo "== server cleanup"; on "$s" 120 "$8"
    } > "$OUT/$tag.log" 2>&1
    sum_c=$(on "$c" 30 "cat /root/data.sum" 2>/dev/null | tail -n1)
    [ -z "$why" ] && grep -q "^sums equal" "$OUT/$tag.log" || why+=" checksums not confirmed;"
    verdict "$tag" "$why" "${MB} MiB, sha256 ${sum_c:0:12}… on both sides"
}
# the client's check: what it reads back (after a remount / with O_DIRECT) equals what it wrote
CMP='a=$(cat /root/data.sum); b=$(sha256sum < /root/back | cut -d" " -f1); [ "$a" = "$b" ] && echo "client read back $b" || { echo "client read back $b, wrote $a"; exit 1; }'
nfs_test() { # nfs_test PREFIX SERVER CLIENT VERS
    local v=$4 opts
    [ "$v" = 3 ] && opts="vers=3,proto=rdma,port=20049,nolock" || opts="vers=$v,proto=rdma,port=20049"
    local setup="set -e; modprobe nfsd; modprobe rpcrdma; mountpoint -q /proc/fs/nfsd || mount -t nfsd nfsd /proc/fs/nfsd
mkdir -p /export /var/lib/nfs/rpc_pipefs; mount -t tmpfs -o size=256M tmpfs /export
echo '/export *(rw,sync,no_root_squash,no_subtree_check,insecure,fsid=1)' > /etc/exports
pgrep -x rpcbind > /dev/null || rpcbind -w
echo 10 > /proc/fs/nfsd/nfsv4leasetime; echo 10 > /proc/fs/nfsd/nfsv4gracetime
exportfs -ra; pgrep -x rpc.mountd > /dev/null || rpc.mountd; rpc.nfsd 4; echo 'rdma 20049' > /proc/fs/nfsd/portlist
cat /proc/fs/nfsd/portlist"
    local run="set -e; modprobe rpcrdma; mkdir -p /mnt/nfs
timeout 200 mount -t nfs -o $opts \$S:/export /mnt/nfs; grep /mnt/nfs /proc/mounts
cp /root/data /mnt/nfs/data; sync; umount /mnt/nfs
timeout 200 mount -t nfs -o $opts \$S:/export /mnt/nfs; cp /mnt/nfs/data /root/back; grep -c rdma /proc/mounts
umount /mnt/nfs; $CMP"
    local check="b=\$(sha256sum < /export/data | cut -d' ' -f1); echo \"server holds \$b\"; a=\$(ssh -o BatchMode=yes $(node_ip "$3") cat /root/data.sum); [ \"\$a\" = \"\$b\" ] && echo 'sums equal'"
    ulp "$1.nfs$v" "$2" "$3" "$setup" "$run" "$check" "umount /mnt/nfs 2>/dev/null; true" \
        "rpc.nfsd 0; exportfs -ua; umount /export; true"
}
IQN=iqn.2026-12.dev.vrdma:mw
iser_test() { # iser_test PREFIX SERVER CLIENT
    local sip; sip=$(node_ip "$2")
    local setup="set -e; mountpoint -q /sys/kernel/config || mount -t configfs none /sys/kernel/config
modprobe ib_isert; truncate -s $((2 * MB))M /root/lun.img
# targetcli asks the system bus for TCMU backstores at start
mkdir -p /run/dbus; [ -S /run/dbus/system_bus_socket ] || dbus-daemon --system --fork
targetcli /backstores/fileio create name=lun0 file_or_dev=/root/lun.img size=$((2 * MB))M write_back=false
targetcli /iscsi create $IQN
targetcli /iscsi/$IQN/tpg1/luns create /backstores/fileio/lun0
targetcli /iscsi/$IQN/tpg1/portals delete 0.0.0.0 3260 || true
targetcli /iscsi/$IQN/tpg1/portals create $sip 3260
targetcli /iscsi/$IQN/tpg1/portals/$sip:3260 enable_iser boolean=true
targetcli /iscsi/$IQN/tpg1 set attribute authentication=0 demo_mode_write_protect=0 generate_node_acls=1 cache_dynamic_acls=1
targetcli ls /iscsi"
    # (no udev in the guests: sd_mod, which gives the LUN its disk, is loaded by hand)
    local run="set -e; modprobe ib_iser; modprobe sd_mod; mkdir -p /run/lock/iscsi
[ -s /etc/iscsi/initiatorname.iscsi ] || echo InitiatorName=iqn.2026-12.dev.vrdma:init-\$GUEST_ID > /etc/iscsi/initiatorname.iscsi
pgrep -x iscsid > /dev/null || iscsid
iscsiadm -m node -o new -T $IQN -p \$S:3260 -I iser
timeout 120 iscsiadm -m node -T $IQN -p \$S:3260 -I iser --login
for i in \$(seq 100); do d=\$(iscsiadm -m session -P3 | sed -n 's/.*Attached scsi disk \\([a-z]*\\).*/\\1/p' | head -n1); [ -n \"\$d\" ] && [ -b /dev/\$d ] && break; [ -n \"\$d\" ] && [ ! -b /dev/\$d ] && mknod /dev/\$d b \$(tr : ' ' < /sys/block/\$d/dev) && break; sleep 0.2; done
echo \"disk /dev/\$d: \$(iscsiadm -m session -P1 | grep -i 'iface transport' | head -n1)\"
iscsiadm -m session -P1 | grep -qi 'transport: iser' || { echo 'not over iser'; exit 1; }
dd if=/root/data of=/dev/\$d bs=1M count=$MB oflag=direct status=none; sync
dd if=/dev/\$d of=/root/back bs=1M count=$MB iflag=direct status=none
iscsiadm -m node -T $IQN -p \$S:3260 -I iser --logout; $CMP"
    local check="b=\$(head -c $((MB * 1048576)) /root/lun.img | sha256sum | cut -d' ' -f1); echo \"server holds \$b\"; a=\$(ssh -o BatchMode=yes $(node_ip "$3") cat /root/data.sum); [ \"\$a\" = \"\$b\" ] && echo 'sums equal'"
    ulp "$1.iser" "$2" "$3" "$setup" "$run" "$check" \
        "iscsiadm -m node -T $IQN -p $sip:3260 -I iser --logout 2>/dev/null; iscsiadm -m node -o delete -T $IQN 2>/dev/null; true" \
        "targetcli /iscsi delete $IQN; targetcli /backstores/fileio delete lun0; rm -f /root/lun.img; true"
}
smb_test() { # smb_test PREFIX SERVER CLIENT: only where both kernels build SMB Direct
    local tag="$1.smb"
    [[ "$tag" =~ $ONLY ]] || return 0
    local ks kc
    ks=$(on "$2" 30 'grep -c "^CONFIG_SMB_SERVER_SMBDIRECT=y" /boot/config-$(uname -r)' | tail -n1)
    kc=$(on "$3" 30 'grep -c "^CONFIG_CIFS_SMB_DIRECT=y" /boot/config-$(uname -r)' | tail -n1)
    if [ "$ks" != 1 ] || [ "$kc" != 1 ]; then
        summary "$tag" "not run: SMB Direct not in the kernels (server SMBDIRECT $ks, client CIFS_SMB_DIRECT $kc)"
        return 0
    fi
    local setup="set -e; modprobe ksmbd; mkdir -p /srv/smb /etc/ksmbd; mount -t tmpfs -o size=256M tmpfs /srv/smb
printf '[global]\n\tnetbios name = mw\n[share]\n\tpath = /srv/smb\n\twriteable = yes\n\tforce user = root\n' > /etc/ksmbd/ksmbd.conf
ksmbd.adduser -a root -p vrdma-mw; ksmbd.mountd"
    local run="set -e; mkdir -p /mnt/smb; o=rdma,vers=3.1.1,username=root,password=vrdma-mw
timeout 120 mount -t cifs //\$S/share /mnt/smb -o \$o; cp /root/data /mnt/smb/data; sync; umount /mnt/smb
timeout 120 mount -t cifs //\$S/share /mnt/smb -o \$o; cp /mnt/smb/data /root/back; umount /mnt/smb; $CMP"
    local check="b=\$(sha256sum < /srv/smb/data | cut -d' ' -f1); echo \"server holds \$b\"; a=\$(ssh -o BatchMode=yes $(node_ip "$3") cat /root/data.sum); [ \"\$a\" = \"\$b\" ] && echo 'sums equal'"
    ulp "$tag" "$2" "$3" "$setup" "$run" "$check" "umount /mnt/smb 2>/dev/null; true" "ksmbd.control -s; umount /srv/smb; true"
}

# ratios FACE: each test's figure in each pair beside rxe <-> rxe's (summary.txt's passed lines), as
# a speed ratio: the control's time over the pair's for latency, the pair's rate over the
# control's otherwise
ratios() {
    awk -v face="$1" '
        $2 != "ok" || index($1, face ".") != 1 { next }
        {
            n = split($1, t, "."); pair = t[2]; test = t[3]; for (i = 4; i <= n; i++) test = test "." t[i]
            if (test !~ /^(ucx\.|mpi$)/) next
            if (test == "mpi") { add(pair, "mpi.8B_lat", $3, $4); add(pair, "mpi.1MiB_bw", $5, $6) }
            else add(pair, test, $3, $4)
        }
        function add(p, k, v, u) { if (v == "") return; fig[p, k] = v; unit[k] = u; if (!(k in seen)) { seen[k] = 1; order[++nk] = k } }
        END {
            np = split("rxe-serves-rxe v-serves-rxe rxe-serves-v v-serves-v", pairs, " ")
            printf "%s: figures beside rxe <-> rxe (ratio > 1: faster)\n%-20s", face, "test"
            for (j = 1; j <= np; j++) printf " %24s", pairs[j]
            printf "\n"
            for (i = 1; i <= nk; i++) {
                k = order[i]; c = fig["rxe-serves-rxe", k]; printf "%-20s", k
                for (j = 1; j <= np; j++) {
                    v = fig[pairs[j], k]
                    if (v == "") { printf " %24s", "-"; continue }
                    r = ""
                    if (c != "" && c + 0 > 0 && v + 0 > 0) r = sprintf(" (%.2fx)", unit[k] == "us" ? c / v : v / c)
                    printf " %24s", v " " unit[k] r
                }
                printf "\n"
            }
        }' "$OUT/summary.txt"
}

# run_pair PREFIX A B: every test with A serving and B the client (B launches mpirun)
run_pair() {
    ucx_tests "$1" "$2" "$3"
    fi_tests "$1" "$2" "$3"
    mpi_test "$1" "$2" "$3"
    [ $QUICK = 1 ] && return 0
    nfs_test "$1" "$2" "$3" 3
    nfs_test "$1" "$2" "$3" 4.2
    iser_test "$1" "$2" "$3"
    smb_test "$1" "$2" "$3"
}

for FACE in $FACES; do
    case $FACE in
        pvrdma) REL=bookworm KIND=pvrdma ;;
        virtio) REL=trixie KIND=virtio-pci ;;
        *) say "no face $FACE (pvrdma, virtio)"; exit 125 ;;
    esac
    MWDIR=$VRDMA_CACHE_DIR/middleware/$REL
    # UCX (1.13 and 1.18 alike) drops every RoCEv2-over-IPv4 UD packet on a device without mlx5's
    # direct verbs when it checks the destination GID (rxe <-> rxe too: each side resends its
    # connection request until "UD endpoint ... unhandled timeout"): its check reads the GRH as an
    # IPv6 header. ucx_perftest of 1.18 runs as an MPI program unless -P 0.
    UCX_ENV="UCX_UD_VERBS_ETH_DGID_CHECK=n"
    if [ $REL = trixie ]; then UCX_P0="-P 0"; else UCX_P0=""; fi
    "$here/image.sh" $REL > "$OUT/image-$REL.log" 2>&1 || { tail -20 "$OUT/image-$REL.log"; exit 125; }
    export PVRDMA_IMAGE=$MWDIR/rootfs.img PVRDMA_KIND=$KIND
    unset PVRDMA_GUEST
    [ $REL = trixie ] || export PVRDMA_GUEST=""
    . "$here/../pvrdma-guest/config.sh"
    NV=2; [ $QUICK = 1 ] && NV=1
    PVRDMA_KINDS="$KIND $KIND" shared_serve_start "$SERVE" $LIFE $NV || { say "the daemon did not start"; exit 125; }
    for ((n = 1; n <= NV; n++)); do
        "$PV_DIR/start.sh" -i $n -l $LIFE -x "$SERVE" "$SETUP" > "$OUT/start-$FACE-v$n.log" 2>&1 \
            || { cat "$OUT/start-$FACE-v$n.log"; say "guest v$n did not start"; exit 125; }
    done
    # The rxe harness boots with the host's QEMU (7.2, TCG, -cpu max); Debian 13's kernel has been
    # seen to panic there in early boot (sched_clock_cpu, about one boot in ten): a second try.
    NR=2; [ $QUICK = 1 ] && NR=1
    for ((n = 1; n <= NR; n++)); do
        for try in 1 2; do
            RXE_CACHE_DIR=$MWDIR "$RXE_HARNESS/start.sh" -i $n -l $LIFE "$SETUP" > "$OUT/start-$FACE-r$n.log" 2>&1 && break
            cp "$OUT/start-$FACE-r$n.log" "$OUT/start-$FACE-r$n.try$try.log"
            RXE_CACHE_DIR=$MWDIR "$RXE_HARNESS/stop.sh" -i $n > /dev/null 2>&1
            [ $try = 2 ] && { cat "$OUT/start-$FACE-r$n.log"; say "rxe guest r$n did not start"; exit 125; }
            say "rxe guest r$n did not start (try $try; log: $OUT/start-$FACE-r$n.try$try.log); once more"
        done
    done
    say "$FACE: guests up ($REL): v1 $(node_ip v1)$([ $NV = 2 ] && echo ", v2 $(node_ip v2)"), rxe r1 $(node_ip r1)$([ $NR = 2 ] && echo ", control r2 $(node_ip r2)")"
    on v1 60 'for p in libucx0 libfabric1 openmpi-bin; do dpkg-query -W -f="\${Package} \${Version}\n" $p; done; ucx_info -v | head -n2; uname -r' \
        > "$OUT/versions-$FACE.txt" 2>&1
    run_pair "$FACE.v-serves-rxe" v1 r$R
    [ $QUICK = 1 ] || run_pair "$FACE.rxe-serves-v" r$R v1
    [ $NV = 2 ] && run_pair "$FACE.v-serves-v" v1 v2
    if [ $NR = 2 ]; then
        ucx_tests "$FACE.rxe-serves-rxe" r1 r2
        mpi_test "$FACE.rxe-serves-rxe" r1 r2
        ratios "$FACE" | tee -a "$OUT/figures.txt"
    fi
    stop_guests
done
say "$PASSED passed, $FAILED failed (summary: $OUT/summary.txt)"
exit "$FAILED"
