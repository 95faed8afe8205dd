#!/usr/bin/env bash
# Runs every cargo-fuzz target for SECONDS each (default 600), seeded from
# fuzz/seeds/ (real rxe packets), with the corpus kept in fuzz/corpus/.
#
#   scripts/fuzz.sh          # 10 minutes per target
#   scripts/fuzz.sh 30       # a smoke run (what the test script does)
#
# cargo fuzz needs nightly-only compiler flags; RUSTC_BOOTSTRAP lets the
# pinned stable toolchain accept them, so no second toolchain is needed.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-600}
export RUSTC_BOOTSTRAP=1
for target in $(cargo fuzz list); do
    mkdir -p "corpus/$target"
    echo "fuzz: $target for ${secs}s"
    cargo fuzz run -O "$target" "corpus/$target" "seeds/$target" -- \
        -max_total_time="$secs" -max_len=4200 -print_final_stats=1 2>&1 |
        grep -E '^(stat::number_of_executed_units|stat::new_units_added|Done|==|SUMMARY|INFO: Seed)' || true
    # cargo fuzz exits non-zero on a crash; pipefail does not see it through
    # grep, so check for artifacts instead.
    if compgen -G "artifacts/$target/*" >/dev/null; then
        echo "fuzz: $target found a crash:" artifacts/"$target"/*
        exit 1
    fi
done
