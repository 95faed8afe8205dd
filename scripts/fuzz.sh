#!/usr/bin/env bash
# Runs every cargo-fuzz target for SECONDS each (default 600), seeded from
# fuzz/seeds/ (real rxe packets), with the corpus kept in fuzz/corpus/.
#
#   scripts/fuzz.sh          # 10 minutes per target
#   scripts/fuzz.sh 20       # a smoke run (what the test script does)
#
# Builds are optimised with debug assertions and overflow checks on (cargo
# fuzz's default; -O would turn them off). cargo fuzz needs nightly-only
# compiler flags; RUSTC_BOOTSTRAP lets the pinned stable toolchain accept
# them, so no second toolchain is needed.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-600}
export RUSTC_BOOTSTRAP=1
# The sanitizer builds of the dependencies do not change between clones: their target directory
# is in the machine-wide cache (scripts/lib/cache.sh), so a second clone rebuilds only the
# project's crates. Every target is built first, in one cargo run (in parallel).
. ../scripts/lib/cache.sh
target_dir="${VRDMA_FUZZ_TARGET_DIR:-$VRDMA_CACHE_DIR/fuzz-target}"
mkdir -p "$target_dir"

targets=$(cargo fuzz list)
if [ -z "$targets" ]; then
    echo "fuzz: no targets found" >&2
    exit 1
fi
cargo fuzz build --target-dir "$target_dir" > /dev/null 2> "$target_dir/build.log" \
    || { tail -n 40 "$target_dir/build.log" >&2; echo "fuzz: the targets did not build" >&2; exit 1; }
for target in $targets; do
    mkdir -p "corpus/$target"
    echo "fuzz: $target for ${secs}s"
    log=$(mktemp)
    status=0
    extra=()
    # This target serves one device from background threads for the whole
    # run; at exit LeakSanitizer reports what those threads hold while they
    # are being torn down (3 allocations, 1280 bytes, after 22 287
    # connections: nothing grows per input, and the target checks per input
    # that no descriptor outlives its connection). libFuzzer's -detect_leaks
    # covers only its own per-input check; the check at exit is ASan's, so it
    # is turned off through ASAN_OPTIONS, for this target alone.
    envs=()
    if [ "$target" = vhost_user_messages ]; then
        extra=(-detect_leaks=0)
        envs=(ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0")
    fi
    env "${envs[@]}" cargo fuzz run --target-dir "$target_dir" "$target" "corpus/$target" "seeds/$target" -- \
        -max_total_time="$secs" -max_len=4200 -print_final_stats=1 "${extra[@]}" >"$log" 2>&1 || status=$?
    grep -E '^(stat::number_of_executed_units|stat::average_exec_per_sec|stat::new_units_added|Done )' "$log" || true
    if [ "$status" -ne 0 ]; then
        echo "fuzz: $target failed (exit $status); its first errors:" >&2
        grep -E -m 5 '==ERROR|panicked at|^SUMMARY' "$log" >&2 || true
        echo "fuzz: the end of its log:" >&2
        tail -n 40 "$log" >&2
        rm -f "$log"
        exit 1
    fi
    rm -f "$log"
done
