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
