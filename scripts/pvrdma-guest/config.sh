# Shared configuration of the pvrdma-guest harness; sourced by every script here.
# Everything can be overridden from the environment (PVRDMA_*, RXE_*, QEMU11_* variables).
#
# A pvrdma guest is the rxe harness's Debian image plus Linux's vmw_pvrdma module, booted by
# QEMU 11 with a vmxnet3 (function 0) and a vfio-user-pci PVRDMA (function 1) in slot 5, both
# served by one `vrdma serve` device whose uplink is a TAP on the rxe harness's bridge.

PV_DIR="${PV_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"
PROJECT_ROOT="${PROJECT_ROOT:-$(cd "$PV_DIR/../.." && pwd)}"
RXE_HARNESS="${RXE_HARNESS:-$PROJECT_ROOT/../shared/interop/rxe-guest}"
QEMU11_DIR="${QEMU11_DIR:-$PROJECT_ROOT/../shared/interop/qemu11}"
# Images live in the machine-wide cache (scripts/lib/cache.sh: VRDMA_CACHE_DIR, outside the
# clone); what runs produce stays in the clone's target/.
. "$PROJECT_ROOT/scripts/lib/cache.sh"
# the rxe harness's image cache and run folder, as the project's other scripts use them
export RXE_CACHE_DIR="${RXE_CACHE_DIR:-$VRDMA_CACHE_DIR/rxe-cache}"
export RXE_RUN_DIR="${RXE_RUN_DIR:-$PROJECT_ROOT/target/rxe-run}"

# PV_CACHE: the PVRDMA guest's image and its build logs; PV_OUT: this clone's results (matrix,
# networks, smoke, lifecycle, bench, ...); PV_RUN: the guests' run folders
PV_CACHE="${PVRDMA_CACHE_DIR:-$VRDMA_CACHE_DIR/pvrdma-guest}"
PV_OUT="${PVRDMA_OUT_DIR:-$PROJECT_ROOT/target/pvrdma-guest}"
PV_RUN="${PVRDMA_RUN_DIR:-$PV_OUT/run}"
# PVRDMA_KIND: the guest's RDMA device — pvrdma (the default: vmxnet3 + VMware's PVRDMA function,
# the stock vmw_pvrdma driver, in the rxe harness's Debian 12 image) or virtio-pci (virtio-net +
# vrdma's virtio-rdma function over vfio-user, the project's virtio_rdma driver and rdma-core
# provider in a Debian 13 image, $VRDMA_CACHE_DIR/virtio-guest/rootfs.img, made by
# scripts/virtio-guest/image.sh on a trixie base of the rxe harness's builder, whose kernel and
# busybox initrd it boots). Everything else — addresses, TAPs, exec/stop — is the same.
PV_KIND="${PVRDMA_KIND:-pvrdma}"
# VG_DIR: the virtio-rdma guest's image, its base and build logs (cached); VG_OUT: results
VG_DIR="${VIRTIO_GUEST_CACHE_DIR:-$VRDMA_CACHE_DIR/virtio-guest}"
VG_OUT="$PROJECT_ROOT/target/virtio-guest"
VG_BASE="${VIRTIO_GUEST_BASE_DIR:-$VG_DIR/trixie-cache}"
# PVRDMA_GUEST=trixie: a pvrdma guest boots that Debian 13 image too (it carries Linux's
# vmw_pvrdma, built from the guest kernel's source package), to measure both faces under one guest.
PV_GUEST="${PVRDMA_GUEST:-}"
[ "$PV_KIND" = virtio-pci ] && PV_GUEST=trixie
if [ "$PV_GUEST" = trixie ]; then
    PV_IMAGE="$VG_DIR/rootfs.img"            # trixie base + virtio_rdma + provider (raw ext4, snapshot=on)
    PV_KERNEL="$VG_BASE/vmlinuz"             # the trixie base's kernel (6.12) and busybox initrd
    PV_INITRD="$VG_BASE/initrd.img"
    PV_IMAGE_CMD="scripts/virtio-guest/image.sh"
else
    PV_IMAGE="$PV_CACHE/rootfs.img"          # rxe rootfs + vmw_pvrdma (raw ext4, used with snapshot=on)
    PV_KERNEL="$RXE_CACHE_DIR/vmlinuz"       # the rxe image's kernel (6.1) and busybox initrd, shared
    PV_INITRD="$RXE_CACHE_DIR/initrd.img"
    PV_IMAGE_CMD="scripts/pvrdma-guest/image.sh"
fi
# PVRDMA_IMAGE: another root for the guest on the same kernel (scripts/middleware/image.sh's images)
PV_IMAGE="${PVRDMA_IMAGE:-$PV_IMAGE}"
# pv_images [KIND...]: makes sure the images of the guests' kinds (default: PV_KIND) are built
#   and current — the PVRDMA image always (its script also installs QEMU 11), the virtio-rdma one
#   when a kind is virtio-pci; their output goes to stdout/stderr (callers keep it in a log)
pv_images() {
    local k
    "$PROJECT_ROOT/scripts/pvrdma-guest/image.sh" || return 1
    for k in "${@:-$PV_KIND}"; do
        if [ "$k" = virtio-pci ] || [ "${PVRDMA_GUEST:-}" = trixie ]; then
            "$PROJECT_ROOT/scripts/virtio-guest/image.sh" || return 1
            break
        fi
    done
}
VRDMA="${VRDMA:-$PROJECT_ROOT/target/release/vrdma}"
QEMU11="$QEMU11_DIR/qemu"

# ---- network: the rxe harness's namespace and bridge ------------------------------------------
NS="${RXE_NS:-rxens}"
BR="${RXE_BR:-rxebr0}"
NET_PREFIX="${RXE_NET_PREFIX:-10.47.91}"
HOST_IP="$NET_PREFIX.1"
# guest N -> 10.47.91.(20+N), or PV_IP_N (networks.sh: two tenants with the same addresses)
pv_ip()  { local v="PV_IP_$1"; echo "${!v:-$NET_PREFIX.$((20 + $1))}"; }
pv_tap() { echo "vrdtap$1"; }                          # guest N -> vrdtapN (inside $NS)
pv_mac() { printf '52:54:00:4c:00:%02x\n' "$1"; }      # guest N -> 52:54:00:4c:00:0N

# ---- QEMU ---------------------------------------------------------------------------------------
PV_MACHINE="${PVRDMA_MACHINE:-q35}"
PV_MEM="${PVRDMA_GUEST_MEM:-1G}"
PV_CPUS="${PVRDMA_GUEST_CPUS:-2}"
PV_BOOT_TIMEOUT="${PVRDMA_BOOT_TIMEOUT:-300}"    # s until the guest reports ready (TCG)
PV_LIFETIME="${PVRDMA_LIFETIME:-3600}"           # s hard limit of a guest's (and its daemon's) life
# PVRDMA_DEVICE_OPTS: more KEY=VALUE for the daemon's --device (e.g. doorbells=shared, mtu=...);
# PVRDMA_SERVE_ARGS: more `vrdma serve` options (e.g. --max-qp-rd-atom 16). The daemons run
# confined as a multi-tenant host runs them (--seccomp kill: a system call outside the allow-list
# kills the daemon, and the run fails; --user nobody: a confined daemon must not stay root),
# unless PVRDMA_SERVE_ARGS says otherwise.
PVRDMA_SERVE_ARGS="${PVRDMA_SERVE_ARGS---seccomp kill --user nobody}"
PV_LOG="${PVRDMA_LOG:-${VRDMA_LOG:-info}}"       # the daemon's VRDMA_LOG (tracing filter: debug, trace, ...)

die()  { echo "pvrdma-guest: $*" >&2; exit "${DIE_RC:-1}"; }
log()  { echo "pvrdma-guest: $*" >&2; }
need_root() { [ "$(id -u)" = 0 ] || die "must run as root"; }
check_id() { [[ "$1" =~ ^[1-8]$ ]] || die "guest id must be 1..8 (got '$1')"; }
guest_dir() { echo "$PV_RUN/g$1"; }
