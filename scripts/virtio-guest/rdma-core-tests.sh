#!/usr/bin/env bash
# rdma-core's own test suite on virtio-rdma: a Debian 13 guest on vrdma's virtio-rdma device (the
# project's virtio_rdma driver and provider; scripts/pvrdma-guest/start.sh with
# PVRDMA_KIND=virtio-pci, guest RCT_ID) runs the tests/ of the rdma-core source its provider was
# built in (56.1, in the image at /usr/src/vrdma-provider: scripts/virtio-guest/build-provider.sh)
# through pyverbs, every test on the one device (both sides of each traffic test in the guest):
# QPs of each type, CQs (resize included), completion channels, MRs, memory windows of both types,
# atomics, SRQs, address handles, rdma_cm, fork safety. Beside it, in the suite's style, the
# project's own guest/rdma-core/tests/test_vrdma_limits.py (verbs' max_send_wr and max_recv_wr) and
# test_vrdma_av.py (address vectors with UCX's flow labels, wider than 20 bits, on UD and RC).
#
# Passing means: no test failed or erred, and every test named in rdma-core-tests.pass (beside
# this script: the tests this device is known to pass, one id a line) ran and passed — a test that
# regresses to "skipped" (a verb that starts answering EOPNOTSUPP) fails the run. The rest are
# skipped for what the device does not offer (extended CQs and QPs, XRC, ODP, device memory,
# rereg MR, raw packet QPs, multicast, SRQ resize) or the guest lacks (GPUs, huge pages); the
# summary counts them by reason.
#
#   scripts/virtio-guest/rdma-core-tests.sh     # about 2 minutes under TCG once the images exist
#
# Settings: RCT_ID (guest id, 4), RCT_TESTS (the suite's modules to run; the default list is every
# module that is not a vendor's). Evidence: target/virtio-guest/rdma-core-tests/ (summary.txt,
# outcomes.json: each test's outcome, suite.log: unittest's own output, dmesg.log).
# Exit 0 when it passes, 1 when it does not, 125 when the harness failed.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export PVRDMA_KIND=virtio-pci
source "$here/../pvrdma-guest/config.sh"
need_root
G=${RCT_ID:-4}
TESTS=${RCT_TESTS:-test_addr test_atomic test_cq test_cq_events test_cqex test_device test_fork \
test_mr test_odp test_parent_domain test_pd test_qp test_qpex test_rdmacm test_relaxed_ordering \
test_rss_traffic test_shared_pd test_srq test_tag_matching test_flow}
OUT="$PROJECT_ROOT/target/virtio-guest/rdma-core-tests"
rm -rf "$OUT"
mkdir -p "$OUT"
say() { echo "rdma-core-tests: $*" | tee -a "$OUT/summary.txt"; }

[ -x "$VRDMA" ] || (cd "$PROJECT_ROOT" && cargo build --release --locked -p vrdma) || exit 125
if ! "$QEMU11" -version > /dev/null 2>&1; then
    timeout 1200 "$QEMU11_DIR/setup.sh" > "$OUT/qemu11-setup.log" 2>&1 || { tail -n 20 "$OUT/qemu11-setup.log"; exit 125; }
fi
timeout 3600 "$here/image.sh" > "$OUT/image.log" 2>&1 || { tail -n 20 "$OUT/image.log"; exit 125; }

D=$(guest_dir "$G")
stop_guest() {
    [ -s "$D/share/out/dmesg.log" ] && cp "$D/share/out/dmesg.log" "$OUT/dmesg.log"
    "$PV_DIR/stop.sh" -i "$G" > "$OUT/stop.log" 2>&1
}
trap stop_guest EXIT
"$PV_DIR/start.sh" -i "$G" -l 1200 > "$OUT/start.log" 2>&1 \
    || { cat "$OUT/start.log"; say "the virtio-rdma guest did not start"; exit 125; }
mkdir -p "$D/share/bin"
cp "$here/guest/rdma-core-tests.py" "$PROJECT_ROOT/guest/rdma-core/tests/test_vrdma_limits.py" \
    "$PROJECT_ROOT/guest/rdma-core/tests/test_vrdma_av.py" "$D/share/bin/"

# The suite's source tree is the one the provider was built in: its tests match the image's
# libibverbs and pyverbs.
timeout 1100 "$PV_DIR/exec.sh" -i "$G" -t 1000 "set -o pipefail
tree=\$(ls -d /usr/src/vrdma-provider/rdma-core-*/ | head -n1)
[ -d \"\$tree/tests\" ] || { echo 'no rdma-core source in the image' >&2; exit 125; }
python3 /harness/bin/rdma-core-tests.py --tree \"\$tree\" --dev \$RXE_DEV --gid \$RXE_GID_IDX \
    --out /harness/out/outcomes.json --extra /harness/bin/test_vrdma_limits.py \
    --extra /harness/bin/test_vrdma_av.py $TESTS \
    > /harness/out/suite.log 2>&1" > "$OUT/exec.log" 2>&1
rc=$?
cp "$D/share/out/suite.log" "$OUT/suite.log" 2> /dev/null
cp "$D/share/out/outcomes.json" "$OUT/outcomes.json" 2> /dev/null
if [ ! -s "$OUT/outcomes.json" ]; then
    cat "$OUT/exec.log"; tail -n 30 "$OUT/suite.log" 2> /dev/null
    say "the suite wrote no outcomes (exit $rc)"; exit 125
fi

# The verdict: counts, skips by reason, failures, and the tests that must have passed.
python3 - "$OUT/outcomes.json" "$here/rdma-core-tests.pass" > "$OUT/verdict.txt" <<'EOF'
import collections, json, sys
outcomes = json.load(open(sys.argv[1]))
must = [l.strip() for l in open(sys.argv[2]) if l.strip() and not l.startswith("#")]
count = collections.Counter(v.split(":")[0] for v in outcomes.values())
print(f"ran {len(outcomes)}: {count['ok']} passed, {count['skipped']} skipped, "
      f"{count['fail']} failed, {count['error']} erred")
reasons = collections.Counter(v[len("skipped: "):] for v in outcomes.values() if v.startswith("skipped"))
for reason, n in reasons.most_common():
    print(f"  skipped {n:3d}: {reason}")
bad = sorted(t for t, v in outcomes.items() if v in ("fail", "error"))
for t in bad:
    print(f"FAILED: {t} ({outcomes[t]})")
missing = [t for t in must if outcomes.get(t) != "ok"]
for t in missing:
    print(f"NOT PASSED (must pass): {t} ({outcomes.get(t, 'not run')})")
print(f"must pass: {len(must) - len(missing)} of {len(must)}")
sys.exit(1 if bad or missing else 0)
EOF
verdict=$?
tee -a "$OUT/summary.txt" < "$OUT/verdict.txt"
if [ "$verdict" != 0 ] || [ "$rc" != 0 ]; then
    grep -E '^(FAIL|ERROR):' -A 20 "$OUT/suite.log" | head -n 80
    say "FAILED (suite exit $rc; see $OUT)"
    exit 1
fi
say "passed"
