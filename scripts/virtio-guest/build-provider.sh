#!/usr/bin/env bash
# Builds the virtio_rdma rdma-core provider (guest/rdma-core/virtio_rdma) inside a Debian 13
# (trixie) root filesystem and installs it there, beside the Debian package's providers:
#
#   /usr/lib/<multiarch>/libibverbs/libvirtio_rdma-rdmav<PABI>.so
#   /etc/libibverbs.d/virtio_rdma.driver
#
# A provider links against libibverbs's private ABI (IBVERBS_PRIVATE_<PABI>), which is
# promised only to the exact libibverbs build, so the provider is built in the root's own rdma-core
# source: `apt-get source rdma-core=<the root's libibverbs1 version>` (libibverbs1 is installed
# first if missing; the fetched version must equal it), with guest/rdma-core/virtio_rdma grafted
# in as providers/virtio_rdma and the two ABI headers (guest/include) as kernel headers, at build
# time only: none of rdma-core's source comes into this repository. rdma-core's own CMake and
# compiler flags; only the provider's target (and what it links with) is built; a compiler
# warning fails. The fetched, configured tree is kept in the root (/usr/src/vrdma-provider) so a
# rebuild takes seconds. Root; the network is the root's Debian mirror (apt in the chroot).
#
#   scripts/virtio-guest/build-provider.sh ROOT     # exit 0: installed (printed where)
#
# ROOT: a trixie chroot directory or a mounted guest image. The build dependencies (cmake,
# ninja-build, pkg-config, gcc, libnl-3-dev, libnl-route-3-dev, libudev-dev, python3, dpkg-dev)
# are installed into it, and a deb-src entry for the mirror it already uses is added
# (etc/apt/sources.list.d/vrdma-provider-src.list, or .sources for a deb822 root) when it has
# none. A mirror that serves the source tarballs but not the .dsc (some caching proxies) is
# handled: the tarballs are checked against the root's signed Sources index and unpacked as
# dpkg-source would. Once installed, the provider is checked in the root: no RPATH, `ldd -r`
# clean against the root's libibverbs, dlopen works. Log: ROOT/usr/src/vrdma-provider/build.log.
# scripts/virtio-guest/provider-check.sh ROOT then proves libibverbs picks it for the device.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
PROJECT_ROOT="$(cd "$here/../.." && pwd)"
PROV_SRC="$PROJECT_ROOT/guest/rdma-core/virtio_rdma"
ABI_SRC="$PROJECT_ROOT/guest/include"

die() { echo "build-provider: $*" >&2; exit 1; }
[ $# = 1 ] || die "usage: $0 ROOT"
[ "$(id -u)" = 0 ] || die "must run as root"
ROOT="$(cd "$1" && pwd)"
[ -x "$ROOT/usr/bin/apt-get" ] && [ -e "$ROOT/etc/debian_version" ] || die "$ROOT is no Debian root"
[ -d "$PROV_SRC" ] || die "no $PROV_SRC"

CACHE=/usr/src/vrdma-provider
mkdir -p "$ROOT$CACHE"
LOG="$ROOT$CACHE/build.log"
: > "$LOG"
# in_root SECONDS CMD...: CMD in the root, with a clean environment and a time limit.
in_root() { local t=$1; shift; timeout "$t" chroot "$ROOT" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive "$@"; }
fail() { tail -n 40 "$LOG" >&2; die "$* (log: $LOG)"; }

# /proc for the tools in the root (dpkg, cmake and ninja look there); unmounted as found.
mounted_proc=
cleanup() { if [ -n "$mounted_proc" ]; then umount "$ROOT/proc" 2>/dev/null || true; fi; }
trap cleanup EXIT
if ! mountpoint -q "$ROOT/proc"; then
    mount -t proc proc "$ROOT/proc"
    mounted_proc=1
fi

# --- apt: a deb-src line for the mirror the root uses, the build dependencies -------------
# One-line sources get a one-line deb-src twin (its [options] kept); a deb822 root gets a copy of
# its first stanza as Types: deb-src (Signed-By and the rest kept: apt refuses one URI with two
# different Signed-By).
src_list="$ROOT/etc/apt/sources.list.d/vrdma-provider-src.list"
src_deb822="$ROOT/etc/apt/sources.list.d/vrdma-provider-src.sources"
have_src() {
    cat "$ROOT"/etc/apt/sources.list "$ROOT"/etc/apt/sources.list.d/*.list 2>/dev/null |
        grep -qE '^deb-src +' && return 0
    cat "$ROOT"/etc/apt/sources.list.d/*.sources 2>/dev/null | grep -qE '^Types:.*deb-src'
}
if ! have_src; then
    line=$(cat "$ROOT"/etc/apt/sources.list "$ROOT"/etc/apt/sources.list.d/*.list 2>/dev/null |
        grep -E '^deb +(\[[^]]*\] +)?[a-z]+://' | head -n1 || true)
    stanza=
    for f in "$ROOT"/etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        stanza=$(awk 'BEGIN { RS = ""; FS = "\n" } /(^|\n)Types:[^\n]*deb/ { print; exit }' "$f" |
            sed 's/^Types:.*/Types: deb-src/')
        [ -n "$stanza" ] && break
    done
    if [ -n "$line" ]; then
        echo "deb-src ${line#deb }" > "$src_list"
        echo "build-provider: added $(cat "$src_list") to $src_list"
    elif [ -n "$stanza" ]; then
        echo "$stanza" > "$src_deb822"
        echo "build-provider: added a deb-src stanza to $src_deb822"
    else
        die "no Debian mirror found in $ROOT/etc/apt"
    fi
fi

DEPS=(cmake ninja-build pkg-config gcc libc6-dev libnl-3-dev libnl-route-3-dev libudev-dev
      python3 dpkg-dev libibverbs1)
missing=()
for p in "${DEPS[@]}"; do
    in_root 60 dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' \
        || missing+=("$p")
done
updated=
apt_update() { [ -n "$updated" ] || { in_root 600 apt-get update -q >> "$LOG" 2>&1 || fail "apt-get update failed"; updated=1; }; }
# The deb-src index must be there for apt-get source.
ls "$ROOT"/var/lib/apt/lists/*_Sources* >/dev/null 2>&1 || apt_update
if [ ${#missing[@]} != 0 ]; then
    echo "build-provider: installing ${missing[*]} in $ROOT"
    apt_update
    in_root 1200 apt-get install -y -q --no-install-recommends "${missing[@]}" >> "$LOG" 2>&1 \
        || fail "apt-get install ${missing[*]} failed"
fi
VER=$(in_root 60 dpkg-query -W -f='${Version}' libibverbs1)
[ -n "$VER" ] || die "no libibverbs1 version in $ROOT"

# apt-get source fetches the .dsc, the upstream tarball and the Debian tarball, and unpacks
# them with dpkg-source. Some mirrors (caching proxies) serve the tarballs but not the .dsc:
# then the tarballs apt did fetch are checked against the SHA-256 sums of the root's signed
# Sources index (apt-get source --print-uris) and unpacked as dpkg-source would a 3.0 (quilt)
# package: the upstream tree, debian/ over it, debian/patches/series applied in order.
unpack_without_dsc() {
    local uris name sum file orig= debtar= p
    # In an empty directory: --print-uris leaves out the files already fetched.
    uris=$(in_root 120 sh -c "mkdir -p /tmp/vrdma-uris && cd /tmp/vrdma-uris && apt-get source -q --print-uris rdma-core=$VER" \
        2>> "$LOG" | grep "^'") \
        || fail "no source of rdma-core $VER in the root's apt sources (a libibverbs1 older than the mirror's? apt-get install libibverbs1 in the root)"
    while read -r _ name _ sum; do
        case "$name" in *.dsc) continue ;; esac
        file="$ROOT$CACHE/$name"
        [ -f "$file" ] || fail "apt-get source did not fetch $name"
        [ "${sum%%:*}" = SHA256 ] || fail "no SHA-256 sum for $name in the Sources index"
        [ "$(sha256sum < "$file" | cut -d' ' -f1)" = "${sum#SHA256:}" ] || fail "$name: SHA-256 mismatch"
        case "$name" in
        *.orig.tar.*) orig=$name ;;
        *.debian.tar.*) debtar=$name ;;
        esac
    done <<< "$uris"
    [ -n "$orig" ] && [ -n "$debtar" ] || fail "rdma-core $VER is not a 3.0 (quilt) source package"
    echo "build-provider: the mirror serves no .dsc; unpacking the checked tarballs ($orig, $debtar)" | tee -a "$LOG"
    rm -rf "${ROOT:?}$TREE"
    in_root 300 sh -c "cd $CACHE && tar xf $orig && [ -d $TREE ] && tar xf $debtar -C $TREE" >> "$LOG" 2>&1 \
        || fail "unpacking $orig and $debtar into $TREE failed"
    if [ -f "$ROOT$TREE/debian/patches/series" ]; then
        while read -r p _; do
            case "$p" in ''|'#'*) continue ;; esac
            in_root 60 sh -c "cd $TREE && patch -p1 -s --no-backup-if-mismatch < debian/patches/$p" >> "$LOG" 2>&1 \
                || fail "debian/patches/$p does not apply"
        done < "$ROOT$TREE/debian/patches/series"
    fi
}

# --- rdma-core's source, of exactly the root's libibverbs1 version -------------------------
UPVER=${VER#*:}
UPVER=${UPVER%-*}
TREE="$CACHE/rdma-core-$UPVER"
stamp="$ROOT$CACHE/fetched-$VER"
if [ ! -e "$stamp" ] || [ ! -d "$ROOT$TREE" ]; then
    rm -rf "${ROOT:?}$CACHE"/rdma-core* "$ROOT$CACHE"/fetched-* "$ROOT$CACHE/build"
    echo "build-provider: fetching rdma-core $VER's source in $ROOT$CACHE"
    fetch() { in_root 900 sh -c "cd $CACHE && apt-get source -q rdma-core=$VER" >> "$LOG" 2>&1; }
    fetch || { apt_update; fetch; } || unpack_without_dsc
    [ -d "$ROOT$TREE" ] || fail "apt-get source made no $TREE"
    got=$(in_root 60 dpkg-parsechangelog -l "$TREE/debian/changelog" -S Version)
    [ "$got" = "$VER" ] || die "fetched rdma-core $got, but the root's libibverbs1 is $VER"
    touch "$stamp"
fi
[ -d "$ROOT$TREE/providers" ] && [ -f "$ROOT$TREE/CMakeLists.txt" ] || die "$ROOT$TREE is no rdma-core tree"

# --- the graft: the provider's sources and the ABI headers (refreshed on every run) --------
rsync_dir() { # $2 as $1: a file is copied when its content differs (so ninja sees it
               # new), and files $1 no longer has are removed
    local f
    mkdir -p "$2"
    for f in "$1"/*; do
        cmp -s "$f" "$2/${f##*/}" || cp "$f" "$2/${f##*/}"
    done
    for f in "$2"/*; do
        [ -e "$1/${f##*/}" ] || rm -f "$f"
    done
}
rsync_dir "$PROV_SRC" "$ROOT$TREE/providers/virtio_rdma"
# The user ABI is a kernel header upstream (include/uapi/rdma/): rdma-core keeps its copies in
# kernel-headers/rdma/ and derives the driver-data structures of DECLARE_DRV_CMD from them.
for h in virtio_rdma_abi.h virtio_rdma_user.h; do
    cmp -s "$ABI_SRC/$h" "$ROOT$TREE/kernel-headers/rdma/$h" || cp "$ABI_SRC/$h" "$ROOT$TREE/kernel-headers/rdma/$h"
done
# Registered once: the provider in the top-level list, the headers in kernel-headers/.
top="$ROOT$TREE/CMakeLists.txt"
if ! grep -q '^add_subdirectory(providers/virtio_rdma)' "$top"; then
    line=$(grep -n '^add_subdirectory(providers/vmw_pvrdma' "$top" | head -n1 | cut -d: -f1)
    [ -n "$line" ] || die "no providers/vmw_pvrdma line in $top to add ours after"
    sed -i "${line}a add_subdirectory(providers/virtio_rdma)" "$top"
fi
kh="$ROOT$TREE/kernel-headers/CMakeLists.txt"
if ! grep -q 'rdma/virtio_rdma_user.h' "$kh"; then
    # Both published with the other kernel headers (publish_internal_headers: <rdma/...>);
    # the user ABI's structures also made available to DECLARE_DRV_CMD
    # (rdma_kernel_provider_abi: <kernel-abi/virtio_rdma_user.h>).
    lines=$(grep -n '^  rdma/vmw_pvrdma-abi.h$' "$kh" | cut -d: -f1 | tr '\n' ' ')
    set -- $lines
    [ $# = 2 ] || die "expected rdma/vmw_pvrdma-abi.h twice in $kh (the two header lists)"
    sed -i -e "$2a\\  rdma/virtio_rdma_user.h" \
        -e "$1a\\  rdma/virtio_rdma_abi.h\\n  rdma/virtio_rdma_user.h" "$kh"
fi

# --- configure once, build the provider's target ------------------------------------------
PABI=$(sed -n 's/^set(IBVERBS_PABI_VERSION "\([0-9]*\)")$/\1/p' "$top")
[ -n "$PABI" ] || die "no IBVERBS_PABI_VERSION in $top"
TARGET="virtio_rdma-rdmav$PABI"
BUILD="$CACHE/build"
# rdma-core's own flags (-Wall -Wextra ...) with its -Werror switch on; the build tree's
# libraries carry the installed RPATH (none), not the build tree's, since the provider is
# copied out of it as it is.
CMAKE_ARGS="-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_INSTALL_PREFIX=/usr \
-DCMAKE_INSTALL_SYSCONFDIR=/etc -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DENABLE_WERROR=1 \
-DNO_MAN_PAGES=1 -DNO_PYVERBS=1 -DENABLE_STATIC=0"
if [ ! -e "$ROOT$BUILD/build.ninja" ] || [ "$(cat "$ROOT$BUILD/.cmake-args" 2>/dev/null)" != "$CMAKE_ARGS" ]; then
    rm -rf "${ROOT:?}$BUILD"
    mkdir -p "$ROOT$BUILD"
    echo "build-provider: configuring rdma-core $UPVER in $ROOT$BUILD"
    in_root 600 sh -c "cd $BUILD && cmake $CMAKE_ARGS $TREE" >> "$LOG" 2>&1 \
        || { rm -f "$ROOT$BUILD/build.ninja"; fail "cmake failed"; }
    echo "$CMAKE_ARGS" > "$ROOT$BUILD/.cmake-args"
fi
# The provider's target and what it links with, only; ninja rebuilds what changed (and runs
# cmake again itself when a CMakeLists.txt changed).
set +e
in_root 1200 sh -c "cd $BUILD && ninja $TARGET" > "$ROOT$CACHE/ninja.log" 2>&1
rc=$?
set -e
cat "$ROOT$CACHE/ninja.log" >> "$LOG"
[ "$rc" = 0 ] || fail "the provider did not build"
if grep -E 'warning:|error:' "$ROOT$CACHE/ninja.log" >&2; then
    die "the provider built with warnings (above; $LOG)"
fi
SO="$BUILD/lib/lib$TARGET.so"
[ -f "$ROOT$SO" ] || die "no $SO after the build"

# --- install beside the Debian package's providers -----------------------------------------
MA=$(in_root 60 dpkg-architecture -qDEB_HOST_MULTIARCH)
PDIR="/usr/lib/$MA/libibverbs"
LIBIBVERBS="/usr/lib/$MA/libibverbs.so.1"
# The root's libibverbs looks for lib<driver>-rdmav<PABI>.so there and offers its private
# ABI under IBVERBS_PRIVATE_<PABI>: both must be this tree's.
[ -e "$ROOT$LIBIBVERBS" ] || die "no $LIBIBVERBS in $ROOT"
grep -qa "$PDIR/lib%s-rdmav$PABI.so" "$ROOT$LIBIBVERBS" \
    || die "$ROOT$LIBIBVERBS does not load providers from $PDIR/lib*-rdmav$PABI.so"
grep -qa "IBVERBS_PRIVATE_$PABI" "$ROOT$LIBIBVERBS" || die "$ROOT$LIBIBVERBS has no IBVERBS_PRIVATE_$PABI"
mkdir -p "$ROOT$PDIR" "$ROOT/etc/libibverbs.d"
install -m 644 "$ROOT$SO" "$ROOT$PDIR/lib$TARGET.so.new"
mv "$ROOT$PDIR/lib$TARGET.so.new" "$ROOT$PDIR/lib$TARGET.so"
echo "driver virtio_rdma" > "$ROOT/etc/libibverbs.d/virtio_rdma.driver"

# Installed as the root's libibverbs will load it: no RPATH, every symbol resolved there.
ldd_out=$(in_root 60 ldd -r "$PDIR/lib$TARGET.so" 2>&1) || { echo "$ldd_out" >&2; die "ldd -r failed"; }
echo "$ldd_out" >> "$LOG"
if echo "$ldd_out" | grep -E 'undefined symbol|not found' >&2; then
    die "$PDIR/lib$TARGET.so does not resolve in $ROOT (above)"
fi
echo "$ldd_out" | grep -qE "libibverbs\.so\.1 => (/usr)?/lib/$MA/libibverbs\.so\.1 " \
    || { echo "$ldd_out" >&2; die "$PDIR/lib$TARGET.so does not take the root's $LIBIBVERBS"; }
# And loads there as libibverbs loads it (dlopen with RTLD_NOW once libibverbs.so.1 is in): its
# constructor registers the driver.
in_root 60 python3 -c "import ctypes, os
ctypes.CDLL('libibverbs.so.1', mode=ctypes.RTLD_GLOBAL)
ctypes.CDLL('$PDIR/lib$TARGET.so', mode=os.RTLD_NOW)" >> "$LOG" 2>&1 \
    || { tail -n 5 "$LOG" >&2; die "dlopen of $PDIR/lib$TARGET.so failed in $ROOT"; }
echo "build-provider: installed $ROOT$PDIR/lib$TARGET.so and $ROOT/etc/libibverbs.d/virtio_rdma.driver (rdma-core $VER)"
