#!/usr/bin/env bash
# The pvrdma guest's image: the rxe harness's Debian image with Linux's vmw_pvrdma module.
#   scripts/pvrdma-guest/image.sh            # build if missing or if an input changed
#   scripts/pvrdma-guest/image.sh --force    # rebuild
# Makes sure QEMU 11 is installed (qemu11/setup.sh) and the rxe image exists (rxe-guest's
# build-image.sh, in $RXE_CACHE_DIR), then writes $PV_CACHE/rootfs.img (the machine-wide cache,
# scripts/lib/cache.sh; PVRDMA_CACHE_DIR overrides it): a copy of the
# rxe rootfs with vmw_pvrdma built by qemu11/build-pvrdma-module.sh (unmodified driver, from
# the guest kernel's Debian source package; installed in lib/modules/KVER/extra, depmod).
# The kernel and busybox initrd are the rxe cache's (the initrd only mounts the root; vmxnet3,
# ib_core and vmw_pvrdma load from the root). Inputs: the rxe image (size, mtime), the two
# scripts; rebuilt only when one changed. Needs root, a loop device and Debian's mirror.
set -euo pipefail
# (this script makes the PVRDMA kind's image, whatever kind the caller's guests are)
export PVRDMA_KIND=pvrdma
. "$(dirname "$0")/config.sh"
need_root
FORCE=0
case "${1:-}" in --force) FORCE=1 ;; "") ;; *) sed -n '2,12p' "$0"; exit 2 ;; esac
# one build at a time in the cache (scripts/lib/cache.sh), whichever clone runs it
if [ -z "${PV_IMAGE_LOCKED:-}" ]; then
    export PV_IMAGE_LOCKED=1
    cache_locked "$PV_CACHE" "$0" "$@"
    exit
fi

[ -x "$QEMU11_DIR/setup.sh" ] || die "no qemu11 scripts at $QEMU11_DIR"
[ -x "$RXE_HARNESS/build-image.sh" ] || die "no rxe harness at $RXE_HARNESS"
mkdir -p "$PV_CACHE"
cache_locked "$VRDMA_CACHE_DIR/qemu11" timeout 1200 "$QEMU11_DIR/setup.sh" > "$PV_CACHE/qemu11-setup.log" 2>&1 \
    || { tail -20 "$PV_CACHE/qemu11-setup.log" >&2; die "qemu11 setup failed (log: $PV_CACHE/qemu11-setup.log)"; }
cache_locked "$RXE_CACHE_DIR" timeout 1800 "$RXE_HARNESS/build-image.sh" > "$PV_CACHE/rxe-image.log" 2>&1 \
    || { tail -20 "$PV_CACHE/rxe-image.log" >&2; die "rxe image build failed (log: $PV_CACHE/rxe-image.log)"; }
SRC_IMG="$RXE_CACHE_DIR/rootfs.img"
[ -s "$SRC_IMG" ] && [ -s "$PV_KERNEL" ] && [ -s "$PV_INITRD" ] || die "rxe image incomplete in $RXE_CACHE_DIR"

inputs() {
    echo "rxe-image: $(readlink -f "$SRC_IMG") $(stat -c '%s %Y' "$SRC_IMG")"
    echo "kernel: $(stat -c '%s %Y' "$PV_KERNEL")"
    echo "build-pvrdma-module.sh: $(sha256sum < "$QEMU11_DIR/build-pvrdma-module.sh" | cut -d' ' -f1)"
    echo "image.sh: $(sha256sum < "$0" | cut -d' ' -f1)"
}
WANT=$(inputs)
if [ $FORCE = 0 ] && [ -s "$PV_IMAGE" ] && [ "$(cat "$PV_CACHE/inputs" 2>/dev/null)" = "$WANT" ]; then
    log "image up to date: $PV_IMAGE ($(sed -n 's/^module: //p' "$PV_CACHE/image.info" 2>/dev/null))"
    exit 0
fi

t0=$(date +%s)
TMP="$PV_IMAGE.tmp"
MNT="$PV_CACHE/mnt"
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
rm -f "$TMP" "$PV_CACHE/inputs"
log "copying $SRC_IMG ..."
cp --sparse=always "$SRC_IMG" "$TMP"
mkdir -p "$MNT"
LOOP=$(losetup -f --show "$TMP") || die "no free loop device"
mount -t ext4 "$LOOP" "$MNT"
mount --bind /dev "$MNT/dev"
mount --bind /dev/pts "$MNT/dev/pts"
mount -t sysfs sysfs "$MNT/sys"
# apt inside the root resolves names with the host's resolver (the copy is restored afterwards)
cp -a "$MNT/etc/resolv.conf" "$PV_CACHE/resolv.conf.guest" 2>/dev/null || true
cp -L /etc/resolv.conf "$MNT/etc/resolv.conf"

log "building vmw_pvrdma (apt in the guest root; log: $PV_CACHE/module-build.log) ..."
timeout 1800 "$QEMU11_DIR/build-pvrdma-module.sh" "$MNT" > "$PV_CACHE/module-build.log" 2>&1 \
    || { tail -30 "$PV_CACHE/module-build.log" >&2; die "vmw_pvrdma build failed"; }
t1=$(date +%s)

KVER=$(ls "$MNT/lib/modules" | sort -V | tail -n1)
KO="$MNT/lib/modules/$KVER/extra/vmw_pvrdma.ko"
[ -s "$KO" ] || die "no $KO"
VERMAGIC=$(chroot "$MNT" modinfo -k "$KVER" -F vermagic vmw_pvrdma)
[[ "$VERMAGIC" == "$KVER "* ]] || die "vmw_pvrdma vermagic '$VERMAGIC' does not match kernel $KVER"
for m in vmxnet3 ib_core ib_uverbs rdma_ucm vmw_pvrdma 9p 9pnet_virtio; do
    chroot "$MNT" modinfo -k "$KVER" -F filename "$m" > /dev/null 2>&1 \
        || grep -qw "$m" "$MNT/lib/modules/$KVER/modules.builtin" || die "guest kernel $KVER lacks module $m"
done
[ -e "$MNT/usr/lib/x86_64-linux-gnu/libibverbs/libvmw_pvrdma-rdmav34.so" ] \
    || ls "$MNT"/usr/lib/x86_64-linux-gnu/libibverbs/libvmw_pvrdma-rdmav*.so > /dev/null 2>&1 \
    || die "the image has no rdma-core vmw_pvrdma provider"
# the source and the packages' archives are not needed at run time
rm -rf "$MNT"/usr/src/linux-source-*
chroot "$MNT" apt-get clean
if [ -e "$PV_CACHE/resolv.conf.guest" ]; then cp -a "$PV_CACHE/resolv.conf.guest" "$MNT/etc/resolv.conf"; fi
{
    echo "built: $(date -u +%FT%TZ) from $SRC_IMG"
    echo "kernel: $KVER"
    echo "module: vmw_pvrdma $(chroot "$MNT" modinfo -k "$KVER" -F vermagic vmw_pvrdma) depends $(chroot "$MNT" modinfo -k "$KVER" -F depends vmw_pvrdma)"
    echo "source: $(chroot "$MNT" dpkg-query -W -f='${Package} ${Version}\n' "linux-source-${KVER%.*-*}" 2>/dev/null \
        || chroot "$MNT" dpkg-query -W -f='${Package} ${Version}\n' 'linux-source-*' 2>/dev/null | head -1)"
} > "$PV_CACHE/image.info.tmp"
cleanup
LOOP=""
trap - EXIT
e2fsck -fy "$TMP" > "$PV_CACHE/e2fsck.log" 2>&1 || [ $? -le 1 ] || die "e2fsck failed on $TMP (see $PV_CACHE/e2fsck.log)"
mv "$TMP" "$PV_IMAGE"
t2=$(date +%s)
echo "timings_s: module=$((t1 - t0)) total=$((t2 - t0))" >> "$PV_CACHE/image.info.tmp"
mv "$PV_CACHE/image.info.tmp" "$PV_CACHE/image.info"
echo "$WANT" > "$PV_CACHE/inputs"
cat "$PV_CACHE/image.info"
log "image ready: $PV_IMAGE (kernel $PV_KERNEL, initrd $PV_INITRD)"
