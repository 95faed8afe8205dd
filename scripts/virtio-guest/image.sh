#!/usr/bin/env bash
# The virtio-rdma guest image: the PVRDMA guest's (scripts/pvrdma-guest/image.sh: the rxe
# harness's Debian 12 image, with the guest kernel's headers, its linux-source and a compiler)
# plus the project's virtio_rdma module (guest/linux/virtio_rdma, the ABI header in
# guest/include), built in the image against the guest kernel's own headers with W=1 — a warning
# fails the build — installed in lib/modules/KVER/extra (depmod), and checked with the kernel's
# own `checkpatch.pl --strict` (from the image's linux-source; no error, warning or check).
# Rebuilt only when an input changes (the PVRDMA image, guest/, this script). Root.
#
#   scripts/virtio-guest/image.sh [--force]
#
# Output: target/virtio-guest/rootfs.img (raw ext4, used with snapshot=on), image.info,
# module-build.log, checkpatch.log.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# PV_IMAGE below is the PVRDMA guest's image, this one's input (whoever called us).
export PVRDMA_KIND=pvrdma
source "$here/../pvrdma-guest/config.sh"
need_root
VG="$PROJECT_ROOT/target/virtio-guest"
IMG="$VG/rootfs.img"
mkdir -p "$VG"
timeout 3600 "$PV_DIR/image.sh" > "$VG/pvrdma-image.log" 2>&1 \
    || die "scripts/pvrdma-guest/image.sh failed (see $VG/pvrdma-image.log)"

inputs() {
    stat -c '%s %Y' "$PV_IMAGE"
    (cd "$PROJECT_ROOT" && find guest -type f | sort | xargs sha256sum)
    sha256sum < "$here/image.sh"
}
if [ "${1:-}" != --force ] && [ -s "$IMG" ] && [ -s "$VG/inputs" ] && diff -q <(inputs) "$VG/inputs" >/dev/null; then
    echo "virtio-guest: image up to date: $IMG"
    exit 0
fi

start=$(date +%s)
rm -f "$IMG" "$VG/inputs"
cp --sparse=always "$PV_IMAGE" "$IMG.tmp"
MNT="$VG/mnt"
mkdir -p "$MNT"
mount -o loop "$IMG.tmp" "$MNT"
trap 'umount "$MNT" 2>/dev/null || true' EXIT
KVER=$(ls "$MNT/lib/modules" | sort -V | tail -n1)
SER=$(echo "$KVER" | cut -d. -f1-2)
[ -d "$MNT/usr/src/linux-headers-$KVER" ] || die "no linux-headers-$KVER in the PVRDMA image"

SRC=/usr/src/vrdma-guest
rm -rf "${MNT:?}$SRC"
mkdir -p "$MNT$SRC"
cp -r "$PROJECT_ROOT/guest/include" "$PROJECT_ROOT/guest/linux" "$MNT$SRC/"
set +e
chroot "$MNT" make -C "/usr/src/linux-headers-$KVER" M="$SRC/linux/virtio_rdma" W=1 modules \
    > "$VG/module-build.log" 2>&1
rc=$?
set -e
[ "$rc" = 0 ] || { tail -n 40 "$VG/module-build.log" >&2; die "virtio_rdma did not build for $KVER"; }
if grep -E 'warning:|error:' "$VG/module-build.log" >&2; then
    die "virtio_rdma built with warnings (above; $VG/module-build.log)"
fi
mkdir -p "$MNT/lib/modules/$KVER/extra"
cp "$MNT$SRC/linux/virtio_rdma/virtio_rdma.ko" "$MNT/lib/modules/$KVER/extra/"
chroot "$MNT" depmod "$KVER"
VERMAGIC=$(chroot "$MNT" modinfo -k "$KVER" -F vermagic virtio_rdma)
[[ "$VERMAGIC" == "$KVER "* ]] || die "virtio_rdma vermagic '$VERMAGIC' is not kernel $KVER's"
ALIAS=$(chroot "$MNT" modinfo -k "$KVER" -F alias virtio_rdma)
[ "$ALIAS" = "virtio:d0000002Av*" ] || die "virtio_rdma's alias is '$ALIAS', not device 42's"

# The kernel's checkpatch, from the guest kernel's source package (downloaded into the image's
# /tmp once, the three files it needs kept in $VG/checkpatch), run by the host's perl.
CP="$VG/checkpatch"
if [ ! -s "$CP/linux-source-$SER/scripts/checkpatch.pl" ]; then
    rm -rf "$CP"
    mkdir -p "$CP"
    chroot "$MNT" sh -c "cd /tmp && apt-get download -q linux-source-$SER" > "$VG/checkpatch-fetch.log" 2>&1 \
        || { chroot "$MNT" apt-get update -q >> "$VG/checkpatch-fetch.log" 2>&1 \
             && chroot "$MNT" sh -c "cd /tmp && apt-get download -q linux-source-$SER" >> "$VG/checkpatch-fetch.log" 2>&1; } \
        || die "cannot download linux-source-$SER (see $VG/checkpatch-fetch.log)"
    deb=$(ls "$MNT"/tmp/linux-source-"$SER"_*.deb | head -n1)
    dpkg-deb --fsys-tarfile "$deb" | tar -C "$CP" -x "./usr/src/linux-source-$SER.tar.xz"
    tar -C "$CP" -xaf "$CP/usr/src/linux-source-$SER.tar.xz" \
        "linux-source-$SER/scripts/checkpatch.pl" "linux-source-$SER/scripts/spelling.txt" \
        "linux-source-$SER/scripts/const_structs.checkpatch"
    rm -rf "$CP/usr" "$deb"
fi
files=$(cd "$PROJECT_ROOT" && find guest -name '*.[ch]' | sort)
(cd "$PROJECT_ROOT" && perl "$CP/linux-source-$SER/scripts/checkpatch.pl" --strict --no-tree \
    --terse --show-types -f $files) > "$VG/checkpatch.log" 2>&1 || true
if grep -E ': (ERROR|WARNING|CHECK):' "$VG/checkpatch.log" >&2; then
    die "checkpatch.pl --strict found the above ($VG/checkpatch.log)"
fi

umount "$MNT"
trap - EXIT
mv "$IMG.tmp" "$IMG"
inputs > "$VG/inputs"
{
    echo "built: $(date -u +%FT%TZ) from $PV_IMAGE"
    echo "kernel: $KVER"
    echo "module: virtio_rdma $VERMAGIC"
    echo "checkpatch: $(perl "$CP/linux-source-$SER/scripts/checkpatch.pl" --version 2>/dev/null | head -n1 || true) --strict clean"
    echo "timings_s: total=$(( $(date +%s) - start ))"
} > "$VG/image.info"
echo "virtio-guest: $IMG ($KVER, virtio_rdma built and checkpatch --strict clean)"
