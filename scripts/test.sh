#!/usr/bin/env bash
# The project's test command (README; .ci/run calls exactly this):
# installs what is missing, then formatting, lints, docs, a fuzz smoke run
# and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
echo "== cargo fmt --check"
cargo fmt --all --check
cargo fmt --manifest-path fuzz/Cargo.toml --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
RUSTC_BOOTSTRAP=1 cargo clippy --manifest-path fuzz/Cargo.toml --locked -- -D warnings
echo "== cargo doc"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --document-private-items --locked --quiet
echo "== fuzz smoke (30 s per target)"
scripts/fuzz.sh 30
echo "== cargo test"
cargo test --workspace --locked
# Interoperability with the kernel's rxe: needs root (namespaces, TAP,
# QEMU) and the harness beside the checkout (CI has both); about 5
# minutes, plus 2 to build the guest image the first time.
if [ "$(id -u)" = 0 ] && [ -x ../shared/interop/rxe-guest/start.sh ]; then
    echo "== interop with Linux rxe"
    scripts/interop.sh
else
    echo "== interop with Linux rxe: not run (needs root and ../shared/interop/rxe-guest)"
fi
