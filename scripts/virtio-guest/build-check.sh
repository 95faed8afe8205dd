#!/usr/bin/env bash
# Builds the virtio_rdma module (guest/linux/virtio_rdma) against Debian 13's kernel headers
# (trixie, 6.12), with W=1: a warning or an error fails. The guest images run Debian 12's 6.1
# (scripts/virtio-guest/image.sh builds and loads the module there); this checks that the same
# source serves the other current stable distribution. A trixie root of its own (debootstrap
# minbase, the host's Debian mirror; target/virtio-guest/trixie-root, made once, about 3
# minutes) with linux-headers-amd64, gcc and make; nothing outside it changes. Root.
#
#   scripts/virtio-guest/build-check.sh     # exit 0: built clean for the root's kernel headers
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root_dir="$(cd "$here/../.." && pwd)"
VG="$root_dir/target/virtio-guest"
ROOT="$VG/trixie-root"
mkdir -p "$VG"
[ "$(id -u)" = 0 ] || { echo "build-check: must run as root" >&2; exit 1; }

host_mirror() {
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null |
        grep -oE '^(URIs:|deb) +[a-z]+://[^ ]+/debian/?( |$)' | awk '{print $2}' | head -n1 || true
}
if [ ! -e "$ROOT/.ready" ]; then
    MIRROR=${VIRTIO_GUEST_MIRROR:-$(host_mirror)}
    [ -n "$MIRROR" ] || { echo "build-check: no Debian mirror in /etc/apt; set VIRTIO_GUEST_MIRROR" >&2; exit 1; }
    command -v debootstrap >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap; }
    rm -rf "$ROOT"
    timeout 1200 debootstrap --variant=minbase trixie "$ROOT" "$MIRROR" > "$VG/trixie-debootstrap.log" 2>&1 \
        || { tail -n 20 "$VG/trixie-debootstrap.log" >&2; exit 1; }
    chroot "$ROOT" apt-get update -q > "$VG/trixie-apt.log" 2>&1
    chroot "$ROOT" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        linux-headers-amd64 gcc make libc6-dev perl >> "$VG/trixie-apt.log" 2>&1 \
        || { tail -n 20 "$VG/trixie-apt.log" >&2; exit 1; }
    touch "$ROOT/.ready"
fi
HDR=$(ls -d "$ROOT"/usr/src/linux-headers-*-amd64 | sort -V | tail -n1)
KVER=${HDR##*/linux-headers-}
SRC=/usr/src/vrdma-guest
rm -rf "${ROOT:?}$SRC"
mkdir -p "$ROOT$SRC"
cp -r "$root_dir/guest/include" "$root_dir/guest/linux" "$ROOT$SRC/"
set +e
chroot "$ROOT" make -C "/usr/src/linux-headers-$KVER" M="$SRC/linux/virtio_rdma" W=1 modules \
    > "$VG/build-check.log" 2>&1
rc=$?
set -e
if [ "$rc" != 0 ] || grep -E 'warning:|error:' "$VG/build-check.log" >&2; then
    tail -n 30 "$VG/build-check.log" >&2
    echo "build-check: virtio_rdma does not build clean against $KVER's headers" >&2
    exit 1
fi
echo "build-check: virtio_rdma built clean (W=1) against Debian 13's $KVER headers"
