#!/usr/bin/env bash
# A virtio-rdma device against the kernel's rxe, over the wire (issue 20).
#
# No Linux guest drives virtio-rdma yet (its driver is issue 21), so the
# guest is played on the host: examples/virtio_pingpong (vrdma-tools) runs a
# virtio-rdma device — the vhost-user face of `vrdma serve`, on a UDP port at
# 10.47.91.1 in the interop namespace — and the virtio test kit's front-end
# on it: commands on the controlq, WQEs in rings in guest memory, doorbells,
# CQEs polled from the CQ ring. Against it, rdma-core's ibv_rc_pingpong,
# ibv_uc_pingpong and ibv_ud_pingpong in the interop guest on rxe, each in
# both roles, every exchange captured and decoded clean (scripts/interop.sh's
# pingpong pairs, with the example in vrdma's place).
#
#   scripts/virtio-guest/rxe.sh            # MTU 1024 and 4096
#   scripts/virtio-guest/rxe.sh 1024       # one MTU (CI)
#
# Needs root; logs and captures go to target/virtio-rxe/; the exit status is
# the number of failed pairs.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cargo build --release --locked -p vrdma-tools --example virtio_pingpong \
    --manifest-path "$ROOT/Cargo.toml" || exit 125
INTEROP_PEER=$ROOT/target/release/examples/virtio_pingpong \
    INTEROP_OUT=$ROOT/target/virtio-rxe \
    INTEROP_ONLY='^(rc|uc|ud)-pingpong' \
    exec "$ROOT/scripts/interop.sh" "$@"
