#!/usr/bin/env python3
"""Brings a device call's benchmark rows home. The GPU machine returns only a few files of $OUT, so rows appended to
bench/results/ there can be lost among logs. Around the benchmarks, on the device:

    python3 scripts/device_results.py snapshot            # before: line counts and digests of bench/results/*
    python3 scripts/device_results.py collect "$OUT"      # after: the new rows and new or changed files, into
                                                          # $OUT/00-results/ (its name sorts first)
and here, with the files the call returned:

    python3 scripts/device_results.py merge FILES_AT      # appends the rows to bench/results/<same file>, skipping
                                                          # rows already there; copies new files (plots) that are absent
--root DIR (default: the repository) names the tree whose bench/results is used; --state PATH the snapshot file
(default /tmp/bmt-device-results.json)."""
import argparse
import hashlib
import json
import os
import shutil
import sys

COLLECTED = "00-results"


def _results(root):
    d = os.path.join(root, "bench", "results")
    return d, sorted(f for f in os.listdir(d) if os.path.isfile(os.path.join(d, f))) if os.path.isdir(d) else []


def _digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _lines(path):
    with open(path, "rb") as f:
        return f.read().splitlines(keepends=True)


def snapshot(root, state):
    d, files = _results(root)
    snap = {f: {"lines": len(_lines(os.path.join(d, f))), "sha256": _digest(os.path.join(d, f))} for f in files}
    with open(state, "w") as f:
        json.dump(snap, f)
    print(f"device_results: snapshot of {len(snap)} files in {d}")


def collect(root, state, out):
    if not os.path.exists(state):
        sys.exit(f"device_results: no snapshot at {state} (run 'snapshot' before the benchmarks)")
    snap = json.load(open(state))
    d, files = _results(root)
    dest = os.path.join(out, COLLECTED)
    os.makedirs(dest, exist_ok=True)
    n_rows = n_files = 0
    for f in files:
        path, before = os.path.join(d, f), snap.get(f)
        if before and before["sha256"] == _digest(path):
            continue
        if f.endswith(".jsonl"):
            lines = _lines(path)
            start = before["lines"] if before else 0
            new = [l for l in lines[start:] if l.strip()]
            if new:
                with open(os.path.join(dest, f), "wb") as o:
                    o.writelines(l if l.endswith(b"\n") else l + b"\n" for l in new)
                n_rows += len(new)
        else:
            shutil.copy2(path, os.path.join(dest, f))
            n_files += 1
    print(f"device_results: {n_rows} new rows and {n_files} new or changed files in {dest}")


def merge(root, src):
    dest_dir, _ = _results(root)
    found = os.path.join(src, COLLECTED)
    src = found if os.path.isdir(found) else src
    rows, files = {}, []
    for f in sorted(os.listdir(src)):  # (every row checked before anything is written)
        path, dest = os.path.join(src, f), os.path.join(dest_dir, f)
        if not os.path.isfile(path):
            continue
        if f.endswith(".jsonl"):
            have = set(_lines(dest)) if os.path.exists(dest) else set()
            for line in _lines(path):
                line = line if line.endswith(b"\n") else line + b"\n"
                if line.strip() and line not in have:
                    try:
                        json.loads(line)
                    except ValueError as e:
                        sys.exit(f"device_results: {path}: a damaged row ({e}); nothing merged")
                    rows.setdefault(dest, []).append(line)
                    have.add(line)
        elif not os.path.exists(dest):
            files.append((path, dest))
    os.makedirs(dest_dir, exist_ok=True)
    for dest, new in rows.items():
        with open(dest, "ab") as o:
            o.writelines(new)
    for path, dest in files:
        shutil.copy2(path, dest)
    n_rows = sum(len(v) for v in rows.values())
    print(f"device_results: merged {n_rows} rows and {len(files)} files into {dest_dir}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["snapshot", "collect", "merge"])
    p.add_argument("dir", nargs="?", help="collect: the $OUT folder; merge: the returned files' folder")
    p.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--state", default="/tmp/bmt-device-results.json")
    a = p.parse_args()
    if a.command != "snapshot" and not a.dir:
        p.error(f"{a.command} needs a folder")
    if a.command == "snapshot":
        snapshot(a.root, a.state)
    elif a.command == "collect":
        collect(a.root, a.state, a.dir)
    else:
        merge(a.root, a.dir)


if __name__ == "__main__":
    main()
