#!/usr/bin/env bash
# Builds the virtio_rdma module (guest/linux/virtio_rdma) against Debian 12's kernel headers
# (bookworm, 6.1), with W=1: a warning or an error fails. The virtio-rdma guest runs Debian 13's
# 6.12 (scripts/virtio-guest/image.sh builds, installs and loads the module there); this checks
# that the same source still compiles cleanly for the previous stable distribution — a compile
# check, nothing loads it.
#
# The headers and compiler are the PVRDMA guest image's ($PV_CACHE/rootfs.img, made by
# scripts/pvrdma-guest/image.sh, run first: it does nothing when the image is up to date), which
# carries /usr/src/linux-headers-6.1.*-amd64 and gcc-12. That image is never written: it is
# attached read-only (a read-only loop device, ext4 mounted ro,noload), an overlay with its upper
# layer in a tmpfs takes the build's files, and all of it is unmounted after — its size, mtime and
# ctime, which scripts/pvrdma-guest/image.sh's rebuild logic reads, are checked unchanged. Root;
# seconds once the image exists.
#
#   scripts/virtio-guest/build-check.sh     # exit 0: built clean for the image's kernel headers
#
# Log: target/virtio-guest/build-check.log.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export PVRDMA_KIND=pvrdma    # PV_IMAGE: the PVRDMA guest's Debian 12 image
source "$here/../pvrdma-guest/config.sh"
die() { echo "build-check: $*" >&2; exit 1; }
log() { echo "build-check: $*" >&2; }
need_root
VG="$VG_OUT"
W="$VG/build-check"
mkdir -p "$VG"
timeout 3600 "$PV_DIR/image.sh" > "$VG/pvrdma-image.log" 2>&1 \
    || { tail -n 20 "$VG/pvrdma-image.log" >&2; die "scripts/pvrdma-guest/image.sh failed (see $VG/pvrdma-image.log)"; }
[ -s "$PV_IMAGE" ] || die "no $PV_IMAGE"
before=$(stat -c '%s %Y %Z' "$PV_IMAGE")

LOOP=""
cleanup() {
    local m
    for m in root rw lower; do
        mountpoint -q "$W/$m" 2> /dev/null && umount "$W/$m"
    done
    [ -n "$LOOP" ] && losetup -d "$LOOP" 2> /dev/null
    return 0
}
trap cleanup EXIT
for m in root rw lower; do
    mountpoint -q "$W/$m" 2> /dev/null && die "$W/$m is mounted (another build-check.sh running?)"
done
mkdir -p "$W/lower" "$W/rw" "$W/root"
LOOP=$(losetup -r -f --show "$PV_IMAGE") || die "no free loop device"
mount -t ext4 -o ro,noload "$LOOP" "$W/lower"
mount -t tmpfs -o size=1G tmpfs "$W/rw"
mkdir -p "$W/rw/upper" "$W/rw/work"
mount -t overlay overlay -o "lowerdir=$W/lower,upperdir=$W/rw/upper,workdir=$W/rw/work" "$W/root"

HDR=$(ls -d "$W/root"/usr/src/linux-headers-*-amd64 2> /dev/null | sort -V | tail -n1)
[ -n "$HDR" ] || die "no /usr/src/linux-headers-*-amd64 in $PV_IMAGE"
KVER=${HDR##*/linux-headers-}
[ -x "$W/root/usr/bin/gcc" ] && [ -x "$W/root/usr/bin/make" ] || die "no gcc or make in $PV_IMAGE"
SRC=/usr/src/vrdma-guest
mkdir -p "$W/root$SRC"
cp -r "$PROJECT_ROOT/guest/include" "$PROJECT_ROOT/guest/linux" "$W/root$SRC/"
set +e
timeout 900 chroot "$W/root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C.UTF-8 \
    make -C "/usr/src/linux-headers-$KVER" M="$SRC/linux/virtio_rdma" W=1 modules > "$VG/build-check.log" 2>&1
rc=$?
set -e
ko=0
[ -s "$W/root$SRC/linux/virtio_rdma/virtio_rdma.ko" ] && ko=1
cleanup
LOOP=""
trap - EXIT
[ "$(stat -c '%s %Y %Z' "$PV_IMAGE")" = "$before" ] || die "$PV_IMAGE changed under the check"

if [ "$rc" != 0 ] || [ "$ko" != 1 ] || grep -E 'warning:|error:' "$VG/build-check.log" >&2; then
    tail -n 30 "$VG/build-check.log" >&2
    die "virtio_rdma does not build clean against $KVER's headers"
fi
echo "build-check: virtio_rdma built clean (W=1) against Debian 12's $KVER headers ($PV_IMAGE, read-only)"
