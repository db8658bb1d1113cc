#!/usr/bin/env python3
"""Clang's thread-safety analysis over the sources that state their lock rules.

Every translation unit of src/ that includes common/thread_annotations.h (directly or through
other project headers: common/mutex.h, the session, relay and job headers) is compiled with
`clang++ -fsyntax-only -Wthread-safety -Werror=thread-safety`, with the include paths and
definitions the CMake build uses (build/compile_commands.json). Then the deliberately wrong
sample tests/unit/tsa_negative.cpp must be rejected, with an error on exactly the lines it
marks `// expect: thread-safety error`, so that the check is known to be able to fail.

Passes only when every source passes and the sample fails as marked.

A pass is remembered under $RDMIG_CACHE/thread-safety (scripts/cache-env.sh), keyed by the
clang version, the flags and the source's preprocessed text (the clone's and the build's paths
replaced by placeholders, so that every clone on the machine shares the passes) (`clang++ -E`, a tenth of the
analysis' time): the analysis reads nothing else, so an unchanged key cannot change the
verdict. Failures are never remembered, and the negative sample is always compiled.
`--no-cache` analyses everything.

    tests/unit/thread_safety_check.py --build-dir build [--clang clang++-14] [-v] [files...]

ctest runs it as `thread_safety_clang` (label unit); scripts/install-deps.sh --test installs
Debian's clang. GCC ignores the annotations (common/thread_annotations.h).
"""

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

ANNOTATIONS = "common/thread_annotations.h"
INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
EXPECT_MARK = "// expect: thread-safety error"


def find_clang(wanted):
    names = [wanted] if wanted else ["clang++", "clang++-16", "clang++-15", "clang++-14"]
    for n in names:
        path = shutil.which(n) if not os.path.isabs(n) else (n if os.access(n, os.X_OK) else None)
        if path:
            return path
    return None


class Includes:
    """Which project files include the annotations header, through `#include "..."` chains."""

    def __init__(self, roots):
        self.roots = roots
        self.memo = {}

    def resolve(self, name, from_dir):
        for d in [from_dir] + self.roots:
            p = os.path.normpath(os.path.join(d, name))
            if os.path.isfile(p):
                return p
        return None  # a generated or third-party header: not ours to follow

    def annotated(self, path, stack=()):
        if path in self.memo:
            return self.memo[path]
        if path in stack:
            return False
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        found = False
        for name in INCLUDE_RE.findall(text):
            if name == ANNOTATIONS or name.endswith("/" + ANNOTATIONS):
                found = True
                break
            p = self.resolve(name, os.path.dirname(path))
            if p and self.annotated(p, stack + (path,)):
                found = True
                break
        self.memo[path] = found
        return found


def flags_of(entry):
    """The include paths, definitions and standard of one compile command; warnings dropped."""
    args = entry.get("arguments") or shlex.split(entry["command"])
    out = []
    i = 1  # args[0] is the compiler
    while i < len(args):
        a = args[i]
        if a in ("-isystem", "-I", "-iquote", "-D", "-U", "-include"):
            out += [a, args[i + 1]]
            i += 2
            continue
        if a.startswith(("-I", "-D", "-U", "-std=", "-isystem")) or a == "-pthread":
            out.append(a)
        i += 1
    return out


def sources_of(entry):
    """The sources one compile command compiles: its file, or, for a batch of a unity build
    (scripts/build.sh, cmake/RdmigUnity.cmake), the sources the batch includes, each checked on
    its own with the batch's flags."""
    path = os.path.realpath(os.path.join(entry.get("directory", ""), entry["file"]))
    if os.sep + "rdmig-unity" + os.sep not in path or not os.path.basename(path).startswith("batch_"):
        return [path]
    with open(path) as f:
        return [os.path.realpath(os.path.join(os.path.dirname(path), m.group(1)))
                for m in re.finditer(r'^#include "([^"]+)"', f.read(), re.M)]


def clang_check(clang, flags, path):
    cmd = [clang, "-fsyntax-only", "-Wthread-safety", "-Werror=thread-safety", *flags, path]
    started = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, r.stderr, time.monotonic() - started


class PassCache:
    """Remembered passes: one empty file per key (clang, flags, preprocessed source)."""

    def __init__(self, clang, version, source_dir, build_dir):
        root = os.environ.get("RDMIG_CACHE")
        self.dir = os.path.join(root, "thread-safety") if root else None
        self.clang, self.version = clang, version
        # Where the clone and its build are does not change a verdict: each clone's paths read the
        # same in the key (flags and the preprocessed text's line markers), so clones share passes.
        self.places = [(os.path.realpath(build_dir), "<build>"), (os.path.realpath(source_dir), "<source>")]

    def _placeless(self, text):
        for place, name in self.places:
            text = text.replace(place, name)
        return text

    def key(self, flags, path):
        if not self.dir:
            return None
        r = subprocess.run([self.clang, "-E", *flags, path], capture_output=True)
        if r.returncode != 0:
            return None  # let the analysis say what is wrong
        h = hashlib.sha256()
        text = self._placeless(r.stdout.decode("utf-8", "surrogateescape"))
        for part in (self.version.encode(), self._placeless("\0".join(flags)).encode(),
                     text.encode("utf-8", "surrogateescape")):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.hexdigest()

    def passed(self, key):
        return key is not None and os.path.exists(os.path.join(self.dir, key))

    def remember(self, key):
        if key is None:
            return
        os.makedirs(self.dir, exist_ok=True)
        open(os.path.join(self.dir, key), "w").close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--source-dir", default=os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..")))
    ap.add_argument("--clang", default=os.environ.get("RDMIG_CLANGXX", ""))
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--no-cache", action="store_true", help="analyse every source, remembered passes or not")
    ap.add_argument("files", nargs="*", help="only these sources (default: every annotated one)")
    opts = ap.parse_args()

    clang = find_clang(opts.clang)
    if not clang:
        print("thread-safety check: no clang++ found (scripts/install-deps.sh --test installs Debian's clang)",
              file=sys.stderr)
        return 1
    src_dir = os.path.realpath(os.path.join(opts.source_dir, "src"))
    db_path = os.path.join(opts.build_dir, "compile_commands.json")
    try:
        with open(db_path) as f:
            db = json.load(f)
    except OSError as e:
        print(f"thread-safety check: {db_path}: {e} (configure with cmake first; the build exports it)",
              file=sys.stderr)
        return 1

    includes = Includes([src_dir])
    units = {}
    for entry in db:
        for path in sources_of(entry):
            if not path.startswith(src_dir + os.sep) or path in units:
                continue
            if opts.files and not any(os.path.realpath(x) == path for x in opts.files):
                continue
            if includes.annotated(path):
                units[path] = flags_of(entry)
    if not units:
        print("thread-safety check: no source of src/ includes " + ANNOTATIONS, file=sys.stderr)
        return 1

    version = subprocess.run([clang, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    print(f"thread-safety check: {version}; {len(units)} sources of src/ include {ANNOTATIONS}")
    started = time.monotonic()
    cache = PassCache(clang, version, opts.source_dir, opts.build_dir) if not opts.no_cache else None
    failed, remembered = [], 0
    for path, flags in sorted(units.items()):
        rel = os.path.relpath(path, opts.source_dir)
        key = cache.key(flags, path) if cache else None
        if cache and cache.passed(key):
            remembered += 1
            if opts.verbose:
                print(f"ok   {rel} (unchanged since it passed)")
            continue
        rc, err, secs = clang_check(clang, flags, path)
        if rc != 0:
            failed.append(rel)
            print(f"FAIL {rel} ({secs:.1f} s)\n{err}")
            continue
        if cache:
            cache.remember(key)
        if opts.verbose:
            print(f"ok   {rel} ({secs:.1f} s)")
    print(f"thread-safety check: {len(units) - len(failed)} of {len(units)} sources pass "
          f"({time.monotonic() - started:.0f} s; {remembered} unchanged since they passed"
          f"{' under ' + cache.dir if cache and cache.dir else ''})")

    # The check must be able to fail: the sample breaks the rules on the lines it marks.
    sample = os.path.join(opts.source_dir, "tests", "unit", "tsa_negative.cpp")
    with open(sample) as f:
        lines = f.read().splitlines()
    expected = {i + 1 for i, line in enumerate(lines) if EXPECT_MARK in line}
    any_flags = next(iter(units.values()))
    rc, err, _ = clang_check(clang, any_flags, sample)
    got = {int(m.group(1)) for m in re.finditer(r"tsa_negative\.cpp:(\d+):\d+: error: .*\[-Werror,-Wthread-safety",
                                                err)}
    other = [l for l in err.splitlines() if ": error: " in l and "-Wthread-safety" not in l]
    sample_ok = rc != 0 and got == expected and not other and expected
    if sample_ok:
        print(f"thread-safety check: tests/unit/tsa_negative.cpp rejected as it should be "
              f"({len(got)} errors, on the marked lines {sorted(got)})")
    else:
        print(f"FAIL tests/unit/tsa_negative.cpp: expected thread-safety errors on lines {sorted(expected)}, "
              f"got {sorted(got)} (exit {rc})\n{err}")
    return 0 if not failed and sample_ok else 1


if __name__ == "__main__":
    sys.exit(main())
