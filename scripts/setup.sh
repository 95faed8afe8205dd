#!/usr/bin/env bash
# Installs what the tests need beyond the Rust toolchain (pinned in
# rust-toolchain.toml): Debian's tshark for the Wireshark cross-check, and
# cargo-fuzz for the fuzz targets. Idempotent: installs only what is missing.
set -euo pipefail

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

if ! command -v tshark >/dev/null 2>&1; then
    echo "setup: installing tshark (Debian package)"
    as_root apt-get update -qq
    # Non-interactive: tshark's package asks whether non-root users may
    # capture; the default (no) is what we want.
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tshark >/dev/null
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "setup: installing cargo-fuzz"
    cargo install --locked cargo-fuzz@0.13.2
fi
