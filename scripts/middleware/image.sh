#!/usr/bin/env bash
# The middleware guests' images: a guest image of the project with Debian's middleware installed
# from that guest's own release, for scripts/middleware/matrix.sh.
#   scripts/middleware/image.sh bookworm   # Debian 12: the PVRDMA image (stock vmw_pvrdma, rxe)
#   scripts/middleware/image.sh trixie     # Debian 13: the virtio-rdma image (virtio_rdma, provider, rxe)
#   scripts/middleware/image.sh REL --force
# Writes $VRDMA_CACHE_DIR/middleware/REL/rootfs.img (the machine-wide cache, scripts/lib/cache.sh): a copy of that image with UCX (ucx-utils), libfabric
# (libfabric-bin), OpenMPI (openmpi-bin, libopenmpi-dev), an SSH server and a key every guest of
# the image trusts (mpirun starts its daemons over SSH), NFS (nfs-kernel-server), iSER
# (targetcli-fb, open-iscsi; dbus, as targetcli asks the system bus for TCMU backstores), SMB
# (ksmbd-tools, cifs-utils), and guest/middleware/mpi_check.c built with the release's mpicc
# (-Wall -Wextra -Werror) into /usr/local/bin/mpi_check. The same directory holds what the rxe
# harness needs to boot the image as an rxe guest (RXE_CACHE_DIR=that directory):
# the base image's kernel, busybox initrd and accel. Rebuilt only when an input changed (the base
# image, this script, mpi_check.c). Root; the network is Debian's mirror (apt in the root).
set -euo pipefail
REL=${1:-}
FORCE=0
[ "${2:-}" = --force ] && FORCE=1
here="$(cd "$(dirname "$0")" && pwd)"
case "$REL" in
    bookworm) export PVRDMA_KIND=pvrdma ;;
    trixie) export PVRDMA_KIND=virtio-pci ;;
    *) sed -n '2,15p' "$0"; exit 2 ;;
esac
. "$here/../pvrdma-guest/config.sh"
need_root
MW="$VRDMA_CACHE_DIR/middleware/$REL"
mkdir -p "$MW"
# one build at a time in the cache, whichever clone runs it
if [ -z "${MW_IMAGE_LOCKED:-}" ]; then
    export MW_IMAGE_LOCKED=1
    cache_locked "$MW" "$0" "$@"
    exit
fi
pv_images > "$MW/base-image.log" 2>&1 || { tail -20 "$MW/base-image.log" >&2; die "the base image failed (log: $MW/base-image.log)"; }
SRC=$PV_IMAGE
PACKAGES="ucx-utils libfabric-bin openmpi-bin libopenmpi-dev gcc libc6-dev openssh-server openssh-client
nfs-kernel-server nfs-common rpcbind targetcli-fb dbus open-iscsi ksmbd-tools cifs-utils keyutils"

inputs() {
    echo "base: $(readlink -f "$SRC") $(stat -c '%s %Y' "$SRC")"
    echo "image.sh: $(sha256sum < "$0" | cut -d' ' -f1)"
    echo "mpi_check.c: $(sha256sum < "$PROJECT_ROOT/guest/middleware/mpi_check.c" | cut -d' ' -f1)"
}
WANT=$(inputs)
if [ $FORCE = 0 ] && [ -s "$MW/rootfs.img" ] && [ "$(cat "$MW/inputs" 2>/dev/null)" = "$WANT" ]; then
    log "middleware image up to date: $MW/rootfs.img"
    exit 0
fi
t0=$(date +%s)
TMP="$MW/rootfs.img.tmp"
MNT="$MW/mnt"
LOOP=""
cleanup() {
    local m
    for m in dev/pts dev sys proc; do
        mountpoint -q "$MNT/$m" 2>/dev/null && umount -l "$MNT/$m"
    done
    mountpoint -q "$MNT" 2>/dev/null && umount "$MNT"
    [ -n "$LOOP" ] && losetup -d "$LOOP" 2>/dev/null
    return 0
}
trap cleanup EXIT
mountpoint -q "$MNT" 2>/dev/null && die "$MNT is mounted (another image.sh running?)"
rm -f "$TMP" "$MW/inputs"
cp --sparse=always "$SRC" "$TMP"
# room for the packages (the base images are 3 GiB with about 1 free)
truncate -s 6G "$TMP"
e2fsck -fy "$TMP" > "$MW/e2fsck-pre.log" 2>&1 || [ $? -le 1 ] || die "e2fsck failed on $TMP"
resize2fs "$TMP" > "$MW/resize.log" 2>&1 || die "resize2fs failed (see $MW/resize.log)"
mkdir -p "$MNT"
LOOP=$(losetup -f --show "$TMP") || die "no free loop device"
mount -t ext4 "$LOOP" "$MNT"
mount --bind /dev "$MNT/dev"
mount --bind /dev/pts "$MNT/dev/pts"
mount -t sysfs sysfs "$MNT/sys"
mount -t proc proc "$MNT/proc"
cp -a "$MNT/etc/resolv.conf" "$MW/resolv.conf.guest" 2>/dev/null || true
cp -L /etc/resolv.conf "$MNT/etc/resolv.conf"
# nothing starts services in a root being built
printf '#!/bin/sh\nexit 101\n' > "$MNT/usr/sbin/policy-rc.d"
chmod 0755 "$MNT/usr/sbin/policy-rc.d"
in_root() { local t=$1; shift; timeout "$t" chroot "$MNT" env DEBIAN_FRONTEND=noninteractive LC_ALL=C "$@"; }
log "apt in the root ($REL): $(echo $PACKAGES) (log: $MW/apt.log)"
in_root 600 apt-get update -q > "$MW/apt.log" 2>&1 || { tail -20 "$MW/apt.log" >&2; die "apt-get update failed"; }
# shellcheck disable=SC2086 # the package list
in_root 1800 apt-get install -y -q --no-install-recommends $PACKAGES >> "$MW/apt.log" 2>&1 \
    || { tail -20 "$MW/apt.log" >&2; die "apt-get install failed (see $MW/apt.log)"; }
in_root 120 apt-get clean
rm -f "$MNT/usr/sbin/policy-rc.d"
t1=$(date +%s)

# SSH: one key for root that every guest of this image trusts (the guests live on the harness's
# private bridge only); host keys made now, so every guest of the image has the same ones
in_root 60 ssh-keygen -A > /dev/null
mkdir -p "$MNT/root/.ssh"
chmod 0700 "$MNT/root/.ssh"
rm -f "$MNT/root/.ssh/id_ed25519" "$MNT/root/.ssh/id_ed25519.pub"
in_root 60 ssh-keygen -q -t ed25519 -N '' -f /root/.ssh/id_ed25519
cp "$MNT/root/.ssh/id_ed25519.pub" "$MNT/root/.ssh/authorized_keys"
cat > "$MNT/root/.ssh/config" <<'CFG'
Host *
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
    ConnectTimeout 20
CFG
chmod 0600 "$MNT/root/.ssh/"*
mkdir -p "$MNT/run/sshd"

# the MPI test, built with the release's own mpicc
install -D -m 0644 "$PROJECT_ROOT/guest/middleware/mpi_check.c" "$MNT/usr/local/src/mpi_check.c"
in_root 300 mpicc -O2 -Wall -Wextra -Werror -o /usr/local/bin/mpi_check /usr/local/src/mpi_check.c \
    > "$MW/mpicc.log" 2>&1 || { cat "$MW/mpicc.log" >&2; die "mpi_check did not build"; }
versions=$(in_root 60 dpkg-query -W -f='${Package} ${Version}\n' libucx0 libfabric1 openmpi-bin nfs-kernel-server \
    targetcli-fb open-iscsi ksmbd-tools cifs-utils 2>/dev/null | tr '\n' ';')
KVER=$(ls "$MNT/lib/modules" | sort -V | tail -n1)
kcfg=$(grep -E '^CONFIG_(SUNRPC_XPRT_RDMA|INFINIBAND_ISER|INFINIBAND_ISERT|SMB_SERVER|SMB_SERVER_SMBDIRECT|CIFS|CIFS_SMB_DIRECT|NVME_RDMA|NVME_TARGET_RDMA)=' \
    "$MNT/boot/config-$KVER" 2>/dev/null | tr '\n' ' ')
if [ -e "$MW/resolv.conf.guest" ]; then cp -a "$MW/resolv.conf.guest" "$MNT/etc/resolv.conf"; fi
cleanup
LOOP=""
trap - EXIT
e2fsck -fy "$TMP" > "$MW/e2fsck.log" 2>&1 || [ $? -le 1 ] || die "e2fsck failed on $TMP (see $MW/e2fsck.log)"
mv "$TMP" "$MW/rootfs.img"
# what the rxe harness boots with RXE_CACHE_DIR=$MW: this image, the base's kernel and initrd
ln -sf "$PV_KERNEL" "$MW/vmlinuz"
ln -sf "$PV_INITRD" "$MW/initrd.img"
[ -s "$RXE_CACHE_DIR/accel" ] && cp "$RXE_CACHE_DIR/accel" "$MW/accel"
t2=$(date +%s)
{
    echo "built: $(date -u +%FT%TZ) from $SRC ($REL, kernel $KVER)"
    echo "packages: $versions"
    echo "kernel: $kcfg"
    echo "timings_s: apt=$((t1 - t0)) total=$((t2 - t0))"
} > "$MW/image.info"
echo "$WANT" > "$MW/inputs"
cat "$MW/image.info"
log "middleware image ready: $MW/rootfs.img"
