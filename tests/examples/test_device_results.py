"""scripts/device_results.py: snapshot, then rows appended and a plot written as a benchmark would, collect puts
exactly the new rows and the new file under $OUT/00-results; merge appends them to another tree's bench/results once
(a second merge adds nothing), keeps existing files, and refuses a damaged row before writing anything."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "scripts", "device_results.py")


def _run(*args):
    r = subprocess.run([sys.executable, TOOL, *map(str, args)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _rows(path):
    return [json.loads(l) for l in open(path) if l.strip()]


def test_new_rows_travel_home_once(tmp_path):
    device, home, out, state = tmp_path / "device", tmp_path / "home", tmp_path / "out", tmp_path / "snap.json"
    for tree in (device, home):
        (tree / "bench" / "results").mkdir(parents=True)
        (tree / "bench" / "results" / "day.jsonl").write_text('{"call_id": "old", "x": 1}\n')
    (device / "bench" / "results" / "old.svg").write_text("<svg>old</svg>")
    _run("snapshot", "--root", device, "--state", state)
    with open(device / "bench" / "results" / "day.jsonl", "a") as f:
        f.write('{"call_id": "new", "x": 2}\n{"call_id": "new", "x": 3}\n')
    (device / "bench" / "results" / "other.jsonl").write_text('{"call_id": "new", "x": 4}\n')
    (device / "bench" / "results" / "curves.svg").write_text("<svg>new</svg>")
    assert "3 new rows and 1 new or changed files" in _run("collect", out, "--root", device, "--state", state)
    got = out / "00-results"
    assert sorted(os.listdir(got)) == ["curves.svg", "day.jsonl", "other.jsonl"]
    assert [r["x"] for r in _rows(got / "day.jsonl")] == [2, 3]

    assert "merged 3 rows and 1 files" in _run("merge", out, "--root", home)
    assert [r["x"] for r in _rows(home / "bench" / "results" / "day.jsonl")] == [1, 2, 3]
    assert [r["x"] for r in _rows(home / "bench" / "results" / "other.jsonl")] == [4]
    assert (home / "bench" / "results" / "curves.svg").read_text() == "<svg>new</svg>"
    assert "merged 0 rows and 0 files" in _run("merge", out, "--root", home)
    assert len(_rows(home / "bench" / "results" / "day.jsonl")) == 3

    # a damaged row in one file: nothing merged, not even the other file's good row
    (got / "day.jsonl").write_text('{"call_id": "bad"\n')
    (got / "zz.jsonl").write_text('{"call_id": "new", "x": 5}\n')
    r = subprocess.run([sys.executable, TOOL, "merge", out, "--root", home], capture_output=True, text=True)
    assert r.returncode != 0 and "damaged row" in r.stderr, r.stdout + r.stderr
    assert len(_rows(home / "bench" / "results" / "day.jsonl")) == 3
    assert not (home / "bench" / "results" / "zz.jsonl").exists()


def test_collect_needs_a_snapshot(tmp_path):
    (tmp_path / "bench" / "results").mkdir(parents=True)
    r = subprocess.run([sys.executable, TOOL, "collect", tmp_path / "out", "--root", tmp_path, "--state",
                        tmp_path / "missing.json"], capture_output=True, text=True)
    assert r.returncode != 0 and "no snapshot" in (r.stdout + r.stderr)
