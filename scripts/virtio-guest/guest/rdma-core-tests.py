#!/usr/bin/env python3
# Runs rdma-core's own test suite (the tests/ folder of the rdma-core source tree the provider was
# built in, so the tests match the installed libibverbs and pyverbs) on one device, as rdma-core's
# tests/run_tests.py does, and writes each test's outcome to a JSON file: {test id: "ok" |
# "skipped: REASON" | "fail" | "error"}. The caller decides what must have passed; a suite
# that skipped everything exits 0 here.
#   rdma-core-tests.py --tree DIR --dev DEV --gid N --out FILE [--extra PATH]... NAME...
# NAME: a test module, class or test of the suite (test_cq, test_mr.MWTest, ...). PATH: a test
# module of this project's written against the suite's package (tests.base), run with it.
# Exit: 0 when every test run passed or was skipped, 1 otherwise.
import argparse
import json
import os
import sys
import unittest
from importlib.machinery import SourceFileLoader


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--gid", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--extra", action="append", default=[])
    ap.add_argument("names", nargs="+")
    a = ap.parse_args()

    tests_dir = os.path.join(a.tree, "tests")
    sys.path.insert(0, tests_dir)
    # The suite reads its device from its own argument parser.
    sys.argv = [sys.argv[0], "--dev", a.dev, "--gid", a.gid]
    from args_parser import parser

    parser.parse_args()
    tests = SourceFileLoader("tests", os.path.join(tests_dir, "__init__.py")).load_module()
    suite = unittest.defaultTestLoader.loadTestsFromNames(a.names, module=tests)
    for path in a.extra:
        name = os.path.splitext(os.path.basename(path))[0]
        extra = SourceFileLoader(name, path).load_module()
        suite.addTests(unittest.defaultTestLoader.loadTestsFromModule(extra))

    outcomes = {}

    class Result(unittest.TextTestResult):
        def addSuccess(self, test):
            super().addSuccess(test)
            outcomes[test.id()] = "ok"

        def addSkip(self, test, reason):
            super().addSkip(test, reason)
            outcomes[test.id()] = "skipped: " + reason

        def addFailure(self, test, err):
            super().addFailure(test, err)
            outcomes[test.id()] = "fail"

        def addError(self, test, err):
            super().addError(test, err)
            outcomes[test.id()] = "error"

        def addUnexpectedSuccess(self, test):
            super().addUnexpectedSuccess(test)
            outcomes[test.id()] = "fail"

    result = unittest.TextTestRunner(verbosity=2, resultclass=Result).run(suite)
    with open(a.out, "w") as f:
        json.dump(outcomes, f, indent=1, sort_keys=True)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
