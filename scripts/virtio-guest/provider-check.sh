#!/usr/bin/env bash
# Checks, without a device, that the libibverbs of a root filesystem finds and matches the
# virtio_rdma provider that scripts/virtio-guest/build-provider.sh installed there: a stand-in
# sysfs (SYSFS_PATH, which libibverbs honours) shows one uverbs device whose parent has the
# modalias of virtio device 42, and the root's own libibverbs (python3 ctypes in a chroot)
# lists it as virtio_rdma0 — so the driver file, the dlopen of the provider, its modalias
# match and its ABI version range all work. The same device with uverbs ABI 2 is refused by
# the provider's range (libibverbs says so), and a virtio device of another ID is not taken. Opening the stand-in (a plain file, no kernel behind it)
# fails cleanly through the provider's alloc_context. The stand-in /dev/infiniband and sysfs
# live on a tmpfs in a private mount namespace: nothing in ROOT changes. Root.
#
#   scripts/virtio-guest/provider-check.sh ROOT     # prints "N passed, M failed"
#
# libibverbs asks the kernel's RDMA netlink first and reads sysfs only when that is missing;
# on a host whose kernel has ib_core loaded the stand-in is not read, and the check says so
# and exits 0 without running.
set -euo pipefail
die() { echo "provider-check: $*" >&2; exit 1; }
[ $# = 1 ] || die "usage: $0 ROOT"
[ "$(id -u)" = 0 ] || die "must run as root"
ROOT="$(cd "$1" && pwd)"
[ -x "$ROOT/usr/bin/python3" ] || die "no python3 in $ROOT"
ls "$ROOT"/usr/lib/*/libibverbs/libvirtio_rdma-rdmav*.so >/dev/null 2>&1 \
    || die "no virtio_rdma provider in $ROOT (scripts/virtio-guest/build-provider.sh)"
[ -e "$ROOT/etc/libibverbs.d/virtio_rdma.driver" ] || die "no virtio_rdma.driver in $ROOT"
if [ -d /sys/class/infiniband ]; then
    echo "provider-check: not run: this kernel has ib_core (RDMA netlink), so libibverbs would not read a stand-in sysfs"
    exit 0
fi

# One case: $1 modalias, $2 uverbs ABI version, $3 the device list expected; in the child's
# own mount namespace, a tmpfs over ROOT/dev holds the stand-ins.
case_script='
set -eu
ROOT=$1 MODALIAS=$2 ABI=$3
mount -t tmpfs -o size=1m,mode=755 vrdma-check "$ROOT/dev"
S=$ROOT/dev/sys
mkdir -p "$ROOT/dev/infiniband" "$S/class/infiniband_verbs/uverbs0" "$S/class/infiniband/virtio_rdma0/device"
: > "$ROOT/dev/infiniband/uverbs0"
: > "$ROOT/dev/null"
echo 6 > "$S/class/infiniband_verbs/abi_version"
echo virtio_rdma0 > "$S/class/infiniband_verbs/uverbs0/ibdev"
echo 231:192 > "$S/class/infiniband_verbs/uverbs0/dev"
echo "$ABI" > "$S/class/infiniband_verbs/uverbs0/abi_version"
echo 1 > "$S/class/infiniband/virtio_rdma0/node_type"
echo 0202:03ff:fe04:0506 > "$S/class/infiniband/virtio_rdma0/node_guid"
echo "$MODALIAS" > "$S/class/infiniband/virtio_rdma0/device/modalias"
exec chroot "$ROOT" env -i PATH=/usr/bin:/bin SYSFS_PATH=/dev/sys python3 -c "
import ctypes
v = ctypes.CDLL(\"libibverbs.so.1\")
v.ibv_get_device_list.restype = ctypes.POINTER(ctypes.c_void_p)
v.ibv_get_device_name.restype = ctypes.c_char_p
v.ibv_open_device.restype = ctypes.c_void_p
n = ctypes.c_int(0)
devs = v.ibv_get_device_list(ctypes.byref(n))
names = [v.ibv_get_device_name(ctypes.c_void_p(devs[i])).decode() for i in range(n.value)]
opened = [bool(v.ibv_open_device(ctypes.c_void_p(devs[i]))) for i in range(n.value)]
print(\" \".join(names) or \"-\", \"opened\" if any(opened) else \"not-opened\")
"
'
pass=0 failed=0
check() { # $1 what, $2 modalias, $3 ABI, $4 expected output
    local got
    got=$(unshare -m --propagation private sh -c "$case_script" vrdma-check "$ROOT" "$2" "$3" 2>&1) || got="exit $?: $got"
    if [ "$got" = "$4" ]; then
        echo "ok: $1: $got"
        pass=$((pass + 1))
    else
        echo "FAILED: $1: expected '$4', got '$got'"
        failed=$((failed + 1))
    fi
}
check "virtio device 42, uverbs ABI 1: listed; its open fails with no kernel behind it" \
    virtio:d0000002Av00001AF4 1 "virtio_rdma0 not-opened"
check "virtio device 42, uverbs ABI 2: refused by the provider's ABI range" virtio:d0000002Av00001AF4 2 \
    "libibverbs: Warning: Driver virtio_rdma does not support the kernel ABI of 2 (supports 1 to 1) for device /dev/sys/class/infiniband/virtio_rdma0
- not-opened"
check "virtio device 1 (a NIC): not taken" virtio:d00000001v00001AF4 1 "- not-opened"

# The data path: guest/rdma-core/tests/ring_test.c runs the provider's post, poll and arm code
# on rings and a doorbell area of its own, playing the device, and reads every byte back at the
# specification's offsets. Built in the root against build-provider.sh's cached tree with
# rdma-core's warnings and -Werror; run against the root's libibverbs.
CACHE=/usr/src/vrdma-provider
TREE=$(cd "$ROOT$CACHE" 2>/dev/null && ls -d rdma-core-*/ 2>/dev/null | head -n1 || true)
if [ -z "$TREE" ] || [ ! -d "$ROOT$CACHE/build/include" ]; then
    echo "FAILED: no rdma-core tree in $ROOT$CACHE (scripts/virtio-guest/build-provider.sh first)"
    failed=$((failed + 1))
else
    TREE="$CACHE/${TREE%/}"
    cp "$(cd "$(dirname "$0")/../.." && pwd)/guest/rdma-core/tests/ring_test.c" "$ROOT$CACHE/ring_test.c"
    P="$TREE/providers/virtio_rdma"
    if out=$(timeout 300 chroot "$ROOT" env -i PATH=/usr/bin:/bin sh -c "cd $CACHE && cc -std=gnu11 -O2 -g \
        -Wall -Wextra -Wno-sign-compare -Wno-unused-parameter -Wmissing-prototypes \
        -Wmissing-declarations -Wshadow -Wstrict-prototypes -Wformat=2 -Werror \
        -I$CACHE/build/include -I$P -o ring_test ring_test.c $P/cq.c $P/qp.c $P/virtio_rdma.c \
        -L$CACHE/build/lib -libverbs -lpthread && ./ring_test" 2>&1); then
        echo "$out" | sed 's/^/ring_test: /'
        pass=$((pass + 1))
        echo "ok: the data path (ring_test)"
    else
        echo "$out" | sed 's/^/ring_test: /'
        echo "FAILED: the data path (ring_test)"
        failed=$((failed + 1))
    fi
fi
echo "$pass passed, $failed failed"
[ "$failed" = 0 ]
