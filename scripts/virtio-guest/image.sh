#!/usr/bin/env bash
# The virtio-rdma guest image: Debian 13 (trixie, kernel 6.12) with the project's guest side.
#
# 1. The base: the rxe harness's own builder (../shared/interop/rxe-guest/build-image.sh) with
#    RXE_SUITE=trixie into $VRDMA_CACHE_DIR/virtio-guest/trixie-cache (VIRTIO_GUEST_BASE_DIR): rootfs.img,
#    vmlinuz, the busybox initrd.img and image.info. Built once (about 45 s here), kept until it is
#    missing; `--rebase` rebuilds it, and so does this script, once, when Debian's mirror no longer
#    has the base kernel's headers (a kernel update replaces them). The host's apt sources name
#    only bookworm, where the harness looks for the suite's mirror, so its mirror is handed over
#    (RXE_MIRROR, RXE_SEC_MIRROR: the host's Debian mirror and its security archive, or
#    VIRTIO_GUEST_MIRROR and VIRTIO_GUEST_SEC_MIRROR when set).
# 2. A copy of it (grown to VIRTIO_GUEST_IMAGE_SIZE, 6G sparse: room for the provider's build),
#    loop-mounted; in a chroot of it: linux-headers-KVER (the image's exact kernel), gcc, make,
#    and what the harness's package list lacks that the scripts use (nvme-cli).
# 3. The virtio_rdma module (guest/linux/virtio_rdma, the ABI headers in guest/include) built there
#    against the guest kernel's own headers with W=1 — a warning fails — installed in
#    lib/modules/KVER/extra (depmod), its vermagic the kernel's, its alias virtio device 42's.
# 3b. Linux's own vmw_pvrdma, unmodified, from the guest kernel's source package (below), in
#    lib/modules/KVER/extra too: PVRDMA_GUEST=trixie boots this image on the PVRDMA face.
# 4. The kernel's own `checkpatch.pl --strict` (from linux-source-6.12, the guest kernel's source
#    package: three files of it kept in the cache's virtio-guest/checkpatch) over the kernel-side
#    sources (guest/linux, guest/include): no error, warning or check.
# 5. The rdma-core provider (guest/rdma-core/virtio_rdma): scripts/virtio-guest/build-provider.sh
#    ROOT builds it in the root's own rdma-core source and installs it there; its exit status
#    decides. Then scripts/virtio-guest/provider-check.sh ROOT: the root's libibverbs picks it,
#    and guest/rdma-core/tests/ring_test.c passes (its data path against the check playing the
#    device, byte for byte at the specification's offsets). VIRTIO_GUEST_NO_PROVIDER=1 leaves
#    both out, openly: image.info says so and it is an input, so the next build without it
#    builds it.
#
# Rebuilt only when an input changes: the base image (size, mtime, image.info), every file under
# guest/, this script, build-provider.sh, provider-check.sh. Root; the network is Debian's mirror (apt in the root).
# About 1.5 minutes from nothing on this machine (2 cores), 30-40 s with the base kept, 0.1 s
# when up to date.
#
#   scripts/virtio-guest/image.sh [--force | --rebase]
#
# Output (VG_DIR: $VRDMA_CACHE_DIR/virtio-guest, scripts/lib/cache.sh): rootfs.img (raw ext4, booted with snapshot=on by
# scripts/pvrdma-guest/start.sh with PVRDMA_KIND=virtio-pci and by pci-boot.sh, with the base's
# vmlinuz and initrd.img), image.info, and the logs: base-image.log, apt.log, module-build.log,
# checkpatch.log, provider-build.log.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export PVRDMA_KIND=virtio-pci
source "$here/../pvrdma-guest/config.sh"
die() { echo "virtio-guest: $*" >&2; exit 1; }
log() { echo "virtio-guest: $*" >&2; }
need_root
FORCE=0 REBASE=0
case "${1:-}" in
    --force) FORCE=1 ;;
    --rebase) FORCE=1 REBASE=1 ;;
    "") ;;
    *) echo "usage: $0 [--force | --rebase]" >&2; exit 2 ;;
esac
# one build at a time in the cache (scripts/lib/cache.sh), whichever clone runs it
if [ -z "${VG_IMAGE_LOCKED:-}" ]; then
    export VG_IMAGE_LOCKED=1
    cache_locked "$VG_DIR" "$0" "$@"
    exit
fi
VG="$VG_DIR"
IMG="$PV_IMAGE"
BASE="$VG_BASE/rootfs.img"
SIZE=${VIRTIO_GUEST_IMAGE_SIZE:-6G}
mkdir -p "$VG"

# ---- 1. the trixie base --------------------------------------------------------------------
host_mirror() { # the host's Debian archive, and its security archive
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null |
        grep -oE "^(URIs:|deb) +[a-z]+://[^ ]+/$1/?( |\$)" | awk '{print $2}' | head -n1 || true
}
build_base() { # $1: --force or nothing (the harness's builder does nothing when the image is there)
    local mirror sec
    mirror=${VIRTIO_GUEST_MIRROR:-$(host_mirror debian)}
    sec=${VIRTIO_GUEST_SEC_MIRROR:-$(host_mirror debian-security)}
    [ -n "$mirror" ] || die "no Debian mirror in /etc/apt; set VIRTIO_GUEST_MIRROR"
    log "the trixie base in $VG_BASE (the rxe harness's build-image.sh; log: $VG/base-image.log)"
    RXE_SUITE=trixie RXE_CACHE_DIR="$VG_BASE" RXE_MIRROR="$mirror" RXE_SEC_MIRROR="$sec" \
        cache_locked "$VG_BASE" timeout 1800 "$RXE_HARNESS/build-image.sh" ${1:+"$1"} > "$VG/base-image.log" 2>&1 \
        || { tail -n 20 "$VG/base-image.log" >&2; die "the trixie base did not build (see $VG/base-image.log)"; }
    [ -s "$BASE" ] && [ -s "$PV_KERNEL" ] && [ -s "$PV_INITRD" ] || die "the base in $VG_BASE is incomplete"
    grep -q 'suite: trixie' "$VG_BASE/image.info" || die "$VG_BASE holds no trixie image (see its image.info)"
}
[ -x "$RXE_HARNESS/build-image.sh" ] || die "no rxe harness at $RXE_HARNESS"
if [ $REBASE = 1 ]; then build_base --force; else build_base; fi

inputs() {
    echo "base: $(stat -c '%s %Y' "$BASE") $(sha256sum < "$VG_BASE/image.info" | cut -d' ' -f1)"
    (cd "$PROJECT_ROOT" && find guest -type f | LC_ALL=C sort | xargs -d '\n' sha256sum)
    echo "image.sh: $(sha256sum < "$here/image.sh" | cut -d' ' -f1)"
    if [ "${VIRTIO_GUEST_NO_PROVIDER:-0}" = 1 ]; then
        echo "build-provider.sh: not run (VIRTIO_GUEST_NO_PROVIDER=1)"
    else
        echo "build-provider.sh: $(sha256sum < "$here/build-provider.sh" | cut -d' ' -f1)"
        echo "provider-check.sh: $(sha256sum < "$here/provider-check.sh" | cut -d' ' -f1)"
    fi
}
# (the image itself too: a file another script wrote over is not this one's output)
output() { stat -c 'output: %s %Y' "$IMG"; }
if [ $FORCE = 0 ] && [ -s "$IMG" ] && [ -s "$VG/inputs" ] \
    && diff -q <(inputs; output) "$VG/inputs" > /dev/null; then
    log "image up to date: $IMG ($(sed -n 's/^kernel: //p' "$VG/image.info" 2>/dev/null))"
    exit 0
fi
[ "${VIRTIO_GUEST_NO_PROVIDER:-0}" = 1 ] || [ -x "$here/build-provider.sh" ] \
    || die "no $here/build-provider.sh (VIRTIO_GUEST_NO_PROVIDER=1 builds the image without the provider)"

# ---- 2. the copy, mounted, and the build tools in it ----------------------------------------
t0=$(date +%s)
TMP="$IMG.tmp"
MNT="$VG/mnt"
LOOP=""
cleanup() {
    local m
    for m in dev/pts dev sys proc; do
        mountpoint -q "$MNT/$m" 2> /dev/null && umount -l "$MNT/$m"
    done
    mountpoint -q "$MNT" 2> /dev/null && umount "$MNT"
    [ -n "$LOOP" ] && losetup -d "$LOOP" 2> /dev/null
    return 0
}
trap cleanup EXIT
mountpoint -q "$MNT" 2> /dev/null && die "$MNT is mounted (another image.sh running?)"
rm -f "$TMP" "$VG/inputs"
log "copying $BASE ..."
cp --sparse=always "$BASE" "$TMP"
truncate -s ">$SIZE" "$TMP"
e2fsck -fy "$TMP" > "$VG/resize.log" 2>&1 || [ $? -le 1 ] || die "e2fsck failed on $TMP (see $VG/resize.log)"
resize2fs "$TMP" >> "$VG/resize.log" 2>&1 || die "resize2fs failed on $TMP (see $VG/resize.log)"
mkdir -p "$MNT"
LOOP=$(losetup -f --show "$TMP") || die "no free loop device"
mount -t ext4 "$LOOP" "$MNT"
mount -t proc proc "$MNT/proc"
mount -t sysfs sysfs "$MNT/sys"
mount --bind /dev "$MNT/dev"
mount --bind /dev/pts "$MNT/dev/pts"
# apt in the root resolves names with the host's resolver; the root's own file comes back after
# (removed first: were it a symlink, cp would write through it)
rm -f "$VG/resolv.conf.guest"
cp -a "$MNT/etc/resolv.conf" "$VG/resolv.conf.guest" 2> /dev/null || true
rm -f "$MNT/etc/resolv.conf"
cp -L /etc/resolv.conf "$MNT/etc/resolv.conf"
# in_root SECONDS CMD...: CMD in the root, with a clean environment and a time limit
in_root() {
    local t=$1
    shift
    timeout "$t" chroot "$MNT" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        HOME=/root LC_ALL=C.UTF-8 DEBIAN_FRONTEND=noninteractive "$@"
}

KVER=$(ls "$MNT/lib/modules" | sort -V | tail -n1)
SER=$(echo "$KVER" | cut -d. -f1-2)
cmp -s "$MNT/boot/vmlinuz-$KVER" "$PV_KERNEL" || die "the base's vmlinuz is not its root's kernel $KVER"
log "apt in the root: linux-headers-$KVER, gcc, make, nvme-cli (log: $VG/apt.log)"
in_root 600 apt-get update -q > "$VG/apt.log" 2>&1 || die "apt-get update failed in the root (see $VG/apt.log)"
if ! in_root 60 apt-cache show "linux-headers-$KVER" > /dev/null 2>&1; then
    # The mirror has moved to a newer kernel: this base cannot build a module any more.
    [ -z "${VIRTIO_GUEST_REBASED:-}" ] || die "the mirror has no linux-headers-$KVER even for a new base"
    log "Debian's mirror has no linux-headers-$KVER any more: rebuilding the base"
    cleanup
    LOOP=""
    trap - EXIT
    rm -f "$TMP"
    VIRTIO_GUEST_REBASED=1 exec "$0" --rebase
fi
in_root 1200 apt-get install -y -q --no-install-recommends \
    "linux-headers-$KVER" gcc make libc6-dev nvme-cli >> "$VG/apt.log" 2>&1 \
    || { tail -n 20 "$VG/apt.log" >&2; die "apt-get install failed in the root (see $VG/apt.log)"; }
[ -d "$MNT/usr/src/linux-headers-$KVER" ] || die "no /usr/src/linux-headers-$KVER in the root"
t1=$(date +%s)

# ---- 3. the module ----------------------------------------------------------------------------
SRC=/usr/src/vrdma-guest
rm -rf "${MNT:?}$SRC"
mkdir -p "$MNT$SRC"
cp -r "$PROJECT_ROOT/guest/include" "$PROJECT_ROOT/guest/linux" "$MNT$SRC/"
set +e
in_root 900 make -C "/usr/src/linux-headers-$KVER" M="$SRC/linux/virtio_rdma" W=1 modules > "$VG/module-build.log" 2>&1
rc=$?
set -e
[ "$rc" = 0 ] || { tail -n 40 "$VG/module-build.log" >&2; die "virtio_rdma did not build for $KVER"; }
if grep -E 'warning:|error:' "$VG/module-build.log" >&2; then
    die "virtio_rdma built with warnings (above; $VG/module-build.log)"
fi
mkdir -p "$MNT/lib/modules/$KVER/extra"
cp "$MNT$SRC/linux/virtio_rdma/virtio_rdma.ko" "$MNT/lib/modules/$KVER/extra/"
in_root 120 depmod "$KVER"
VERMAGIC=$(in_root 60 modinfo -k "$KVER" -F vermagic virtio_rdma)
[[ "$VERMAGIC" == "$KVER "* ]] || die "virtio_rdma vermagic '$VERMAGIC' is not kernel $KVER's"
ALIAS=$(in_root 60 modinfo -k "$KVER" -F alias virtio_rdma)
[ "$ALIAS" = "virtio:d0000002Av*" ] || die "virtio_rdma's alias is '$ALIAS', not device 42's"
for m in virtio_net ib_core ib_uverbs rdma_ucm nvme-rdma nvmet-rdma 9p 9pnet_virtio; do
    in_root 60 modinfo -k "$KVER" -F filename "$m" > /dev/null 2>&1 \
        || grep -qw "$m" "$MNT/lib/modules/$KVER/modules.builtin" || die "guest kernel $KVER lacks module $m"
done

# ---- 4. checkpatch ----------------------------------------------------------------------------
# The kernel's checkpatch, from the guest kernel's source package (downloaded into the root's
# /tmp once, the three files it needs kept in $VG/checkpatch), run by the host's perl.
CP="$VG/checkpatch"
PVD="linux-source-$SER/drivers/infiniband/hw/vmw_pvrdma"
if [ ! -s "$CP/linux-source-$SER/scripts/checkpatch.pl" ] || [ ! -s "$CP/$PVD/Makefile" ]; then
    rm -rf "$CP"
    mkdir -p "$CP"
    in_root 900 sh -c "cd /tmp && apt-get download -q linux-source-$SER" > "$VG/checkpatch-fetch.log" 2>&1 \
        || die "cannot download linux-source-$SER (see $VG/checkpatch-fetch.log)"
    deb=$(ls "$MNT"/tmp/linux-source-"$SER"_*.deb | head -n1)
    dpkg-deb --fsys-tarfile "$deb" | tar -C "$CP" -x "./usr/src/linux-source-$SER.tar.xz"
    tar -C "$CP" -xaf "$CP/usr/src/linux-source-$SER.tar.xz" \
        "linux-source-$SER/scripts/checkpatch.pl" "linux-source-$SER/scripts/spelling.txt" \
        "linux-source-$SER/scripts/const_structs.checkpatch" "$PVD"
    basename "$deb" .deb > "$CP/source"
    rm -rf "$CP/usr" "$deb"
fi
# Linux's vmw_pvrdma, unmodified, from the same source package (Debian's kernels leave it out;
# ../shared/interop/qemu11/build-pvrdma-module.sh does the same for a Debian 12 root): with it
# this image also boots on vrdma's PVRDMA face (PVRDMA_GUEST=trixie), so that the two faces can
# be measured under one guest kernel and user space.
rm -rf "${MNT:?}$SRC/vmw_pvrdma"
cp -r "$CP/$PVD" "$MNT$SRC/vmw_pvrdma"
in_root 900 make -C "/usr/src/linux-headers-$KVER" M="$SRC/vmw_pvrdma" \
    CONFIG_INFINIBAND_VMWARE_PVRDMA=m modules > "$VG/pvrdma-module-build.log" 2>&1 \
    || { tail -n 40 "$VG/pvrdma-module-build.log" >&2; die "vmw_pvrdma did not build for $KVER"; }
cp "$MNT$SRC/vmw_pvrdma/vmw_pvrdma.ko" "$MNT/lib/modules/$KVER/extra/"
in_root 120 depmod "$KVER"
PVMAGIC=$(in_root 60 modinfo -k "$KVER" -F vermagic vmw_pvrdma)
[[ "$PVMAGIC" == "$KVER "* ]] || die "vmw_pvrdma vermagic '$PVMAGIC' is not kernel $KVER's"

# The kernel-side sources only: the rdma-core provider follows rdma-core's conventions.
mapfile -t files < <(cd "$PROJECT_ROOT" && find guest/linux guest/include -name '*.[ch]' | LC_ALL=C sort)
[ "${#files[@]}" != 0 ] || die "no kernel-side sources under guest/"
# (--terse: one line an issue, nothing when clean; the exit status is 0 only when clean)
if ! (cd "$PROJECT_ROOT" && perl "$CP/linux-source-$SER/scripts/checkpatch.pl" --strict --no-tree \
    --terse --show-types -f "${files[@]}") > "$VG/checkpatch.log" 2>&1 || [ -s "$VG/checkpatch.log" ]; then
    cat "$VG/checkpatch.log" >&2
    die "checkpatch.pl --strict is not clean (above; $VG/checkpatch.log)"
fi

t2=$(date +%s)

# ---- 5. the rdma-core provider ------------------------------------------------------------------
if [ "${VIRTIO_GUEST_NO_PROVIDER:-0}" = 1 ]; then
    PROVIDER="not built (VIRTIO_GUEST_NO_PROVIDER=1)"
else
    log "the rdma-core provider (scripts/virtio-guest/build-provider.sh; log: $VG/provider-build.log)"
    timeout 3600 "$here/build-provider.sh" "$MNT" > "$VG/provider-build.log" 2>&1 \
        || { tail -n 30 "$VG/provider-build.log" >&2; die "build-provider.sh failed (see $VG/provider-build.log)"; }
    so=$(cd "$MNT" && ls usr/lib/*/libibverbs/libvirtio_rdma-rdmav*.so 2> /dev/null | head -n1)
    [ -n "$so" ] && [ -s "$MNT/etc/libibverbs.d/virtio_rdma.driver" ] \
        || die "build-provider.sh succeeded but no /usr/lib/*/libibverbs/libvirtio_rdma-rdmav*.so and /etc/libibverbs.d/virtio_rdma.driver in the root"
    PROVIDER="/$so (rdma-core $(in_root 60 dpkg-query -W -f='${Version}' libibverbs1))"
    # libibverbs of the root picks it for a virtio device 42, and its data path passes
    # guest/rdma-core/tests/ring_test.c (the provider's post, poll and arm against this script
    # playing the device).
    log "the provider checked in the root (scripts/virtio-guest/provider-check.sh; log: $VG/provider-check.log)"
    timeout 600 "$here/provider-check.sh" "$MNT" > "$VG/provider-check.log" 2>&1 \
        || { tail -n 30 "$VG/provider-check.log" >&2; die "provider-check.sh failed (see $VG/provider-check.log)"; }
    PROVIDER="$PROVIDER; $(tail -n1 "$VG/provider-check.log")"
fi
t3=$(date +%s)

in_root 120 apt-get clean
rm -f "$MNT/etc/resolv.conf"
if [ -e "$VG/resolv.conf.guest" ] || [ -L "$VG/resolv.conf.guest" ]; then cp -a "$VG/resolv.conf.guest" "$MNT/etc/resolv.conf"; fi
{
    echo "built: $(date -u +%FT%TZ) from $BASE ($(sed -n 's/^built: //p' "$VG_BASE/image.info"))"
    echo "debian: $(cat "$MNT/etc/debian_version")"
    echo "kernel: $KVER"
    echo "module: virtio_rdma $VERMAGIC"
    echo "module: vmw_pvrdma $PVMAGIC (Linux's, unmodified, from $(cat "$CP/source"))"
    echo "checkpatch: $(cat "$CP/source") scripts/checkpatch.pl --strict clean (${#files[@]} files)"
    echo "provider: $PROVIDER"
    in_root 60 dpkg-query -W -f='${Package} ${Version}\n' "linux-image-$KVER" "linux-headers-$KVER" \
        rdma-core ibverbs-providers perftest iproute2 nvme-cli gcc 2> /dev/null
    df -h "$MNT" | awk 'NR == 2 { print "root: " $3 " used of " $2 }'
} > "$VG/image.info.tmp"
cleanup
LOOP=""
trap - EXIT
e2fsck -fy "$TMP" > "$VG/e2fsck.log" 2>&1 || [ $? -le 1 ] || die "e2fsck failed on $TMP (see $VG/e2fsck.log)"
mv "$TMP" "$IMG"
t4=$(date +%s)
echo "timings_s: copy_and_apt=$((t1 - t0)) module_and_checkpatch=$((t2 - t1)) provider=$((t3 - t2)) total=$((t4 - t0))" >> "$VG/image.info.tmp"
mv "$VG/image.info.tmp" "$VG/image.info"
{ inputs; output; } > "$VG/inputs"
cat "$VG/image.info"
log "image ready: $IMG (kernel $PV_KERNEL, initrd $PV_INITRD)"
