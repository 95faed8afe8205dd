#!/usr/bin/env bash
# The project's test command (README; .ci/run calls exactly this):
# installs what is missing, then formatting, lints, docs, a fuzz smoke run
# and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step says how long it took, and the end the whole run's time (CI's 45-minute budget).
T0=$(date +%s) TS=$T0 STEP=""
step() {
    local now
    now=$(date +%s)
    [ -z "$STEP" ] || echo "   ($STEP: $((now - TS)) s)"
    STEP=$1 TS=$now
    [ -z "$1" ] || echo "== $1"
}
trap 'rc=$?; step ""; echo "== test.sh: exit $rc after $(($(date +%s) - T0)) s"' EXIT

step "setup (scripts/setup.sh)"
scripts/setup.sh
step "cargo fmt --check"
cargo fmt --all --check
cargo fmt --manifest-path fuzz/Cargo.toml --check
step "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
RUSTC_BOOTSTRAP=1 cargo clippy --manifest-path fuzz/Cargo.toml --locked -- -D warnings
step "cargo doc"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --document-private-items --locked --quiet
step "fuzz smoke (20 s per target)"
scripts/fuzz.sh 20
step "cargo test"
cargo test --workspace --locked
# Interoperability with the kernel's rxe, and the harness's own captures:
# need root (namespaces, TAP, QEMU) and the harness beside the checkout.
# Under CI (CI=true) both are required: a missing prerequisite fails the
# run. Elsewhere they run when they can and say so when they cannot.
# About 8 minutes, plus 2 to build the guest image the first time.
harness=../shared/interop/rxe-guest
if [ "${CI:-}" = true ]; then
    [ "$(id -u)" = 0 ] || { echo "CI: interop needs root" >&2; exit 1; }
    [ -x "$harness/start.sh" ] || { echo "CI: no interop harness at $harness" >&2; exit 1; }
fi
if [ -d "$harness/pcaps" ]; then
    step "the harness's rxe captures"
    cargo test --locked -p vrdma-wire --test rxe_captures -- --ignored
else
    step "the harness's rxe captures: not run (no $harness/pcaps)"
fi
if [ "$(id -u)" = 0 ] && [ -x "$harness/start.sh" ]; then
    step "interop with Linux rxe"
    scripts/interop.sh
    # RC against rxe over a lossy link (1 % loss, duplication, reordering,
    # delay), vrdma in both roles: about 3 minutes. The whole matrix, with
    # rxe <-> rxe as the control, is scripts/lossy.sh (README).
    step "RC over a lossy link, vrdma <-> rxe (subset)"
    scripts/lossy.sh --quick
    # A Linux guest on a vrdma PVRDMA device (vrdma serve, QEMU 11's
    # vfio-user-pci, the unmodified vmw_pvrdma driver): the interop
    # matrix's subset, both roles each — ibv_devinfo; ibv_rc_pingpong
    # against rxe, the host's vrdma and a second guest on vrdma;
    # ib_write_bw 1 MiB with the host; rping with the second guest;
    # ib_write_bw -R (rdma_cm) with rxe; every exchange decoded. One
    # daemon serves both guests on vrdma (MATRIX_SHM=1): their pairs go
    # through its same-host shared memory and must leave nothing on the
    # wire (the whole matrix without it has them over the wire). About 5
    # minutes, plus about 3 to install QEMU 11 and build the guest image
    # the first time. The whole matrix (scripts/pvrdma-guest/matrix.sh),
    # the lifecycle checks (lifecycle.sh) and the benchmark (bench.sh)
    # are documented commands (README).
    step "Linux guests on vrdma serve (PVRDMA): the interop matrix's subset"
    MATRIX_SHM=1 scripts/pvrdma-guest/matrix.sh --quick
    # QEMU 11 attaches the virtio-rdma device (vhost-user-test-device-pci
    # with a stand-in ID, then as a virtio-pci function over vfio-user-pci
    # with its own ID, 42): features, config, queues, commands through
    # QEMU to the confined daemon. About 15 s.
    step "QEMU attaches vrdma serve's virtio-rdma device"
    scripts/virtio-guest/attach.sh
    # The project's virtio_rdma driver also builds clean (W=1) against
    # Debian 12's 6.1 headers (the virtio-rdma guest runs Debian 13's
    # 6.12), in the PVRDMA guest's image (made above), attached read-only
    # with the build in a tmpfs overlay. Seconds.
    step "virtio_rdma against Debian 12's kernel headers"
    scripts/virtio-guest/build-check.sh
    # A Debian 13 guest (6.12) on the daemon's virtio-pci function: its
    # stock virtio-pci finds virtio device 42 (no stray access counted),
    # the project's virtio_rdma binds, registers virtio_rdma0, is removed
    # and loaded again. Under a minute (TCG) once the image exists. The
    # image (scripts/virtio-guest/image.sh: a trixie base made by the rxe
    # harness's builder, kept in $VRDMA_CACHE_DIR/virtio-guest/trixie-cache; the
    # module built W=1 against the guest kernel's headers, checkpatch
    # --strict; the rdma-core provider built and installed) takes about
    # 1.5 minutes the first time here (the base about 45 s), about 40 s
    # when guest/ or its scripts change (the base kept), 0.1 s otherwise.
    step "a Linux guest's virtio-pci on vrdma serve's virtio-rdma function"
    scripts/virtio-guest/pci-boot.sh
    # A kernel ULP on the project's virtio_rdma driver: NVMe over Fabrics
    # (RDMA) between the virtio-rdma guest (Debian 13) and an rxe guest
    # (Debian 12), both roles, 256 MiB each way with O_DIRECT, checksums
    # on both sides, and rmmod / reload / reconnect under the host. About
    # 4 minutes (TCG).
    step "NVMe-oF (RDMA) between a virtio-rdma guest and an rxe guest"
    scripts/virtio-guest/nvmf.sh
    # Stock rdma-core tools in a virtio-rdma guest, through the project's
    # provider (post and poll in user space): the interop matrix's subset,
    # both roles each — ibv_devinfo; ibv_rc_pingpong against rxe, the
    # host's vrdma and a second virtio-rdma guest; ib_write_bw 1 MiB with
    # the host; rping with the second guest; ib_write_bw -R (rdma_cm) with
    # rxe; every exchange on the wire decoded. Both virtio-rdma guests on
    # one daemon: their pairs go through same-host shared memory. About 5
    # minutes (TCG). The whole matrix, the lifecycle checks and the
    # benchmark are documented commands (README).
    step "Linux guests on vrdma serve (virtio-rdma): the interop matrix's subset"
    PVRDMA_KIND=virtio-pci MATRIX_SHM=1 scripts/pvrdma-guest/matrix.sh --quick
    # rdma-core's own test suite (pyverbs, the tests of the rdma-core
    # source the provider was built in) on the virtio-rdma device: QPs,
    # CQs and their resize, memory windows of both types, atomics, SRQs,
    # AHs, rdma_cm across fork; none may fail, and the 86 named in
    # scripts/virtio-guest/rdma-core-tests.pass must pass (about 1
    # minute, TCG).
    # Virtual networks under real guests: two tenants' PVRDMA and virtio-rdma guests with the
    # same addresses on one daemon; ib_send_lat and rdma_cm's ib_send_lat -R inside each network
    # over shared memory, nothing on the wire, the other tenant's counters unmoved. About 3
    # minutes (TCG).
    step "two tenants with overlapping addresses on one daemon (virtual networks)"
    scripts/pvrdma-guest/networks.sh
    step "rdma-core's test suite on a virtio-rdma guest"
    scripts/virtio-guest/rdma-core-tests.sh
    # The conformance diff against rxe: verbs' attributes through edge values (AH flow labels
    # and GID indices, CQ sizes, MR and QP access flags, QP capabilities, each transition's
    # attributes, send flags and SGE counts) on rxe, a PVRDMA guest (the stock driver) and a
    # virtio-rdma guest; every difference from rxe must be one scripts/conformance/known.txt
    # explains. About 4 minutes (TCG).
    step "the conformance diff against rxe"
    scripts/conformance/run.sh
    # Middleware, Debian's, unmodified: a virtio-rdma guest (Debian 13) serving an rxe guest of
    # the same image — ucx_perftest tag latency over rc_verbs and ud_verbs, libfabric's
    # fi_pingpong -v over verbs;ofi_rxm, and mpirun --mca pml ucx running mpi_check (every byte
    # checked). About 4 minutes, plus 1 to install the packages into the image. The whole matrix
    # (both faces, both roles, guest to guest, NFS/RDMA, iSER) is scripts/middleware/matrix.sh.
    step "middleware in a virtio-rdma guest against rxe (subset)"
    scripts/middleware/matrix.sh --quick
    # A virtio-rdma device (the test kit's front-end playing the guest)
    # against rxe: the pingpong pairs at MTU 1024, both roles, captured
    # and decoded (about 3 minutes).
    step "a virtio-rdma device against Linux rxe (pingpong pairs, MTU 1024)"
    scripts/virtio-guest/rxe.sh 1024
else
    step "interop with Linux rxe: not run (needs root and $harness)"
fi
