#!/usr/bin/env python3
"""After a failed ctest run: what went wrong in each failed test, in a few lines, printed last.

A CI log is often read from its tail only, and often only a part of it: ctest's own summary names
the failed tests but not why. This reads build/Testing/Temporary/LastTest.log and prints, for
each failed test, the lines of its output that say why (assertions, errors, tracebacks, FAIL
lines), and then, as the very last lines, one line per failed case of every failed test (the
case, its exception line), so that a tail of a few dozen lines names every failure however
long the blocks above it are.
    scripts/failure-digest.py [LastTest.log] [--lines N]
"""
import re
import sys

WHY = re.compile(r"(Error|FAIL|Traceback|assert|error:|failed|Failed|Timeout|timed out|differ|mismatch)")
NOISE = re.compile(r"(WARN|DEBUG|INFO)\s")
# A node's prefix in the Soft-RoCE rows ("a| ") and unittest's case headers.
PREFIX = re.compile(r"^[a-z]\| ")
CASE = re.compile(r"^(FAIL|ERROR): (\S+)")


def failed_cases(output):
    """(kind, case, exception line) for each FAIL/ERROR block of unittest's report in output."""
    lines = [PREFIX.sub("", ln) for ln in output.splitlines()]
    cases = []
    i = 0
    while i < len(lines):
        m = CASE.match(lines[i])
        if not m:
            i += 1
            continue
        kind, case, why = m.group(1), m.group(2), ""
        i += 1
        # The report: a ---- rule, the traceback (indented frames), the exception's lines, a
        # blank line. The exception line is the first unindented one after "Traceback".
        in_tb = False
        while i < len(lines) and not CASE.match(lines[i]) and not lines[i].startswith("====="):
            ln = lines[i]
            if ln.startswith("Traceback"):
                in_tb = True
            elif in_tb and ln and not ln.startswith(" ") and not ln.startswith("-----"):
                if not why:
                    why = ln
            i += 1
        cases.append((kind, case, why))
    return cases


def digest(log_path, per_test):
    with open(log_path, errors="replace") as f:
        text = f.read()
    # One block per test: "N/M Testing: name" ... "Test Passed." / "Test Failed." / other endings.
    blocks = re.split(r"^\d+/\d+ Testing: ", text, flags=re.M)[1:]
    summary = []
    for block in blocks:
        name = block.split("\n", 1)[0].strip()
        m = re.search(r"^Output:\n-+\n(.*?)^<end of output>\n(.*)", block, flags=re.M | re.S)
        if not m:
            continue
        tail = m.group(2).split("\n\n", 1)[0]  # up to the next test's block
        # Passed, or skipped ("Test Pass Reason: Skip regular expression found in output").
        if "Test Passed." in tail or "Test Pass Reason" in tail:
            continue
        lines = [ln for ln in m.group(1).splitlines() if WHY.search(ln) and not NOISE.search(ln)]
        reason = re.search(r"Test Fail Reason:\n(.*)", tail)
        took = re.search(r"Test time = +([0-9.]+ sec)", tail)
        head = "%s: failed after %s%s" % (name, took.group(1) if took else "?",
                                          (" (" + reason.group(1).strip() + ")") if reason else "")
        print("=== " + head)
        for ln in lines[-per_test:]:
            print("  " + ln[:400])
        cases = failed_cases(m.group(1))
        summary.append((head, cases))
    if summary:
        print("failure-digest: every failed case, one line each:")
        for head, cases in summary:
            print("  " + head)
            for kind, case, why in cases:
                print("    %s %s: %s" % (kind, case, why[:300]))
            if not cases:
                print("    (no unittest case report: see the lines above)")
    return len(summary)


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
