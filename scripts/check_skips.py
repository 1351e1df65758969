#!/usr/bin/env python3
"""Fails when a test run skipped a test that tests/allowed_skips.txt does not allow (a test must not pass by
skipping). Reads the logs of the runners, so nothing about a skip is taken on trust:

  check_skips.py [--allowed FILE] [--device cpu|cuda] ctest:LOG pytest:LOG gtest-xml:DIR ...

  ctest:LOG      a `ctest` run's output: the tests listed under "The following tests did not run:" as Skipped
                 (gtest's "[  SKIPPED ]" and pytest's "N skipped" make CTest report a skip: tests/CMakeLists.txt)
  pytest:LOG     a `pytest -rs` run's output: its "SKIPPED [n] file:line: reason" lines
  gtest-xml:DIR  gtest XML reports (--gtest_output=xml): every <testcase> with a <skipped> child

tests/allowed_skips.txt, one allowed skip a line: `<device> <runner> <what> -- <why>`, where device is cpu, cuda or
any (the variant the allowance holds for), runner is ctest, pytest or gtest, and what is the CTest test name (ctest),
a pytest skip reason (pytest; `*` at its end matches any tail), or `Suite.Test` (gtest). Prints every skip with its
verdict and exits 1 on any skip not allowed, or on a log that cannot be read."""
import argparse
import os
import re
import sys
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))


def read_allowed(path, device):
    allowed = []
    for n, line in enumerate(open(path), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^(cpu|cuda|any)\s+(ctest|pytest|gtest)\s+(.+?)\s+--\s+(\S.*)$", line)
        if not m:
            sys.exit(f"{path}:{n}: expected '<cpu|cuda|any> <ctest|pytest|gtest> <what> -- <why>', got: {line}")
        if m.group(1) in ("any", device):
            allowed.append((m.group(2), m.group(3), m.group(4)))
    return allowed


def matches(pattern, text):
    return text.startswith(pattern[:-1]) if pattern.endswith("*") else text == pattern


def ctest_skips(path):
    text = open(path, errors="replace").read()
    return [m.group(1).strip() for m in re.finditer(r"^\s*\d+ - (.+?) \(Skipped\)\s*$", text, re.M)]


def pytest_skips(path):
    text = open(path, errors="replace").read()
    out = []
    for m in re.finditer(r"^SKIPPED \[(\d+)\] ([^\n]*?):(\d+): (.*)$", text, re.M):
        out.append((m.group(4).strip(), f"{m.group(2)}:{m.group(3)} (x{m.group(1)})"))
    # `-q` without -rs would show a count but no reasons: a count without reasons is itself a failure.
    counted = sum(int(c) for c in re.findall(r"(\d+) skipped", text.splitlines()[-1] if text.strip() else ""))
    listed = sum(int(m.group(1)) for m in re.finditer(r"^SKIPPED \[(\d+)\]", text, re.M))
    if counted > listed:
        out.append((f"{counted - listed} skip(s) without a reason in the log (run pytest with -rs)", path))
    return out


def gtest_skips(folder):
    out = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".xml"):
            continue
        for case in ET.parse(os.path.join(folder, name)).getroot().iter("testcase"):
            sk = case.find("skipped")
            if sk is not None:
                out.append((f"{case.get('classname')}.{case.get('name')}", sk.get("message", "")))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--allowed", default=os.path.join(HERE, "..", "tests", "allowed_skips.txt"))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("logs", nargs="+")
    a = ap.parse_args()
    allowed = read_allowed(a.allowed, a.device)
    bad = 0
    total = 0
    for spec in a.logs:
        kind, _, path = spec.partition(":")
        if not os.path.exists(path):
            print(f"[skips] FAIL: {kind} log {path} does not exist")
            bad += 1
            continue
        if kind == "ctest":
            found = [(name, "") for name in ctest_skips(path)]
        elif kind == "pytest":
            found = pytest_skips(path)
        elif kind == "gtest-xml":
            kind = "gtest"
            found = gtest_skips(path)
        else:
            sys.exit(f"unknown log kind '{kind}' (ctest, pytest, gtest-xml)")
        for what, where in found:
            total += 1
            why = next((w for k, p, w in allowed if k == kind and matches(p, what)), None)
            if why:
                print(f"[skips] allowed {kind} skip: {what} -- {why}")
            else:
                bad += 1
                print(f"[skips] FAIL: {kind} skip not in tests/allowed_skips.txt: {what} {where}".rstrip())
    print(f"[skips] {total} skip(s), {bad} not allowed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
