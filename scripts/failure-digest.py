#!/usr/bin/env python3
"""After a failed ctest run: what went wrong in each failed test, in a few lines, printed last.

A CI log is often read from its tail only; ctest's own summary names the failed tests but not
why. This reads build/Testing/Temporary/LastTest.log and prints, for each failed test, the lines
of its output that say why (assertions, errors, tracebacks, FAIL lines), the last ones first cut.
    scripts/failure-digest.py [LastTest.log] [--lines N]
"""
import re
import sys

WHY = re.compile(r"(Error|FAIL|Traceback|assert|error:|failed|Failed|Timeout|timed out|differ|mismatch)")
NOISE = re.compile(r"(WARN|DEBUG|INFO)\s")


def digest(log_path, per_test):
    with open(log_path, errors="replace") as f:
        text = f.read()
    # One block per test: "N/M Testing: name" ... "Test Passed." / "Test Failed." / other endings.
    blocks = re.split(r"^\d+/\d+ Testing: ", text, flags=re.M)[1:]
    failed = 0
    for block in blocks:
        name = block.split("\n", 1)[0].strip()
        m = re.search(r"^Output:\n-+\n(.*?)^<end of output>\n(.*)", block, flags=re.M | re.S)
        if not m:
            continue
        tail = m.group(2).split("\n\n", 1)[0]  # up to the next test's block
        # Passed, or skipped ("Test Pass Reason: Skip regular expression found in output").
        if "Test Passed." in tail or "Test Pass Reason" in tail:
            continue
        failed += 1
        lines = [ln for ln in m.group(1).splitlines() if WHY.search(ln) and not NOISE.search(ln)]
        reason = re.search(r"Test Fail Reason:\n(.*)", tail)
        took = re.search(r"Test time = +([0-9.]+ sec)", tail)
        print("=== %s: failed after %s%s" % (name, took.group(1) if took else "?",
                                            (" (" + reason.group(1).strip() + ")") if reason else ""))
        for ln in lines[-per_test:]:
            print("  " + ln[:400])
    return failed


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    per_test = 30
    if "--lines" in sys.argv:
        per_test = int(sys.argv[sys.argv.index("--lines") + 1])
        args = [a for a in args if a != str(per_test)]
    path = args[0] if args else "Testing/Temporary/LastTest.log"
    n = digest(path, per_test)
    print("failure-digest: %d failed test(s) in %s" % (n, path))


if __name__ == "__main__":
    main()
