"""bench/run_fp8_fidelity.sh (issue 34's loss fidelity) in its CPU smoke mode: train_gpt in bf16 and --fp8 on the
same text, one row per run and a verdict row, an SVG with the four curves; and fp8_fidelity_report.py's verdicts on
made-up curves (a NaN loss and a held-out loss that climbs away from its minimum count as divergence, a 2% gap is
not within 1%, one verdict per variant); an unknown FIDELITY_RUNS name is refused before any training; FIDELITY_REUSE
reports finished runs again without training them."""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPORT = os.path.join(REPO, "bench", "fp8_fidelity_report.py")


def _text(path):
    # real text: this repository's design notes, repeated to leave a held-out split of several windows
    docs = open(os.path.join(REPO, "docs", "design.md"), "rb").read()
    with open(path, "wb") as f:
        f.write(docs * max(1, 400_000 // len(docs) + 1))


def test_smoke_run_writes_rows_verdict_and_svg(tmp_path):
    corpus = tmp_path / "corpus.txt"
    _text(corpus)
    env = dict(os.environ, FIDELITY_SMOKE="1", OUT=str(tmp_path / "out"), FIDELITY_CORPUS=str(corpus),
               FIDELITY_TRAIN_GPT=os.environ["TRAIN_GPT"], BMT_CALL_ID="smoke-fidelity", OMP_NUM_THREADS="1")
    r = subprocess.run(["bash", os.path.join(REPO, "bench", "run_fp8_fidelity.sh"), "unused", "124m"], env=env,
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "out" / "fp8_fidelity"
    rows = [json.loads(l) for l in open(out / "smoke.jsonl")]
    assert [r.get("fp8") for r in rows] == [False, True, None], rows
    for row in rows:
        assert row["call_id"] == "smoke-fidelity" and row["kind"] == "fp8_fidelity" and row["config"] == "124m"
    bf16, fp8, verdict = rows
    assert bf16["steps"] == fp8["steps"] == 40
    assert [s for s, _ in bf16["eval_curve"]] == [0, 10, 20, 30, 40] == [s for s, _ in fp8["eval_curve"]]
    # the same init and batches: the step-0 held-out losses agree to FP8's effect on one forward
    assert abs(bf16["eval_curve"][0][1] - fp8["eval_curve"][0][1]) < 1e-2
    assert bf16["final_eval_loss"] < bf16["eval_curve"][0][1] - 0.5  # it learned
    assert verdict["final_eval_loss_variant"] == fp8["final_eval_loss"] and verdict["comparison"] == "fp8_vs_bf16"
    assert abs(verdict["rel_diff"]) < 0.01 and verdict["within_1pct"] is True and verdict["diverged"] is None
    svg = ET.parse(out / "fp8_fidelity_124m.svg").getroot()
    assert len(svg.findall("{http://www.w3.org/2000/svg}polyline")) == 4
    # FIDELITY_REUSE=1: the finished runs are reported again without training (train_gpt would fail here)
    env.update(FIDELITY_REUSE="1", FIDELITY_TRAIN_GPT="/bin/false")
    r = subprocess.run(["bash", os.path.join(REPO, "bench", "run_fp8_fidelity.sh"), "unused", "124m"], env=env,
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0 and r.stdout.count("reused (FIDELITY_REUSE=1)") == 2, r.stdout[-3000:] + r.stderr
    again = [json.loads(l) for l in open(out / "smoke.jsonl")][3:]
    assert [a["final_eval_loss"] for a in again[:2]] == [bf16["final_eval_loss"], fp8["final_eval_loss"]]
    assert again[2]["rel_diff"] == verdict["rel_diff"]


def _metrics(path, evals, train):
    with open(path, "w") as f:
        for s, v in evals:
            f.write(json.dumps({"step": s, "loss": None, "eval_loss": v}) + "\n")
        for s, v in train:
            f.write(json.dumps({"step": s, "loss": v, "tokens_per_s": 1.0, "eval_loss": None}) + "\n")


def _report(tmp_path, bf16_evals, fp8_evals, fp8_train=None):
    a, b, res = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "res.jsonl"
    train = [(s, 3.0 - s / 100) for s in range(1, 101)]
    _metrics(a, bf16_evals, train)
    _metrics(b, fp8_evals, fp8_train or train)
    r = subprocess.run([sys.executable, REPORT, "--config", "x", "--bf16", str(a), "--fp8", str(b), "--results",
                        str(res), "--svg", str(tmp_path / "c.svg")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [json.loads(l) for l in open(res)][-1]


def test_report_verdicts(tmp_path):
    base = [(0, 5.0), (50, 3.0), (100, 2.0)]
    v = _report(tmp_path, base, [(0, 5.0), (50, 3.0), (100, 2.015)])
    assert v["within_1pct"] is True and v["diverged"] is None and abs(v["rel_diff"] - 0.0075) < 1e-9
    v = _report(tmp_path, base, [(0, 5.0), (50, 3.0), (100, 2.04)])
    assert v["within_1pct"] is False and v["diverged"] is None
    v = _report(tmp_path, base, [(0, 5.0), (50, 2.0), (100, 2.5)])  # climbed 25% above its minimum
    assert "above its minimum" in v["diverged"]
    v = _report(tmp_path, base, base, fp8_train=[(1, 3.0), (2, float("nan"))])
    assert v["diverged"] == "non-finite loss"


def test_report_one_verdict_per_variant(tmp_path):
    train = [(s, 3.0 - s / 100) for s in range(1, 101)]
    paths = {}
    for name, final in (("bf16", 2.0), ("fp8", 2.04), ("fp8_ends", 2.01), ("bf16_seed2", 1.99)):
        paths[name] = tmp_path / f"{name}.jsonl"
        _metrics(paths[name], [(0, 5.0), (100, final)], train)
    res = tmp_path / "res.jsonl"
    r = subprocess.run([sys.executable, REPORT, "--config", "x", "--bf16", str(paths["bf16"])] +
                       [a for n in ("fp8", "fp8_ends", "bf16_seed2") for a in ("--run", f"{n}={paths[n]}")] +
                       ["--run", f"fp8_row={tmp_path / 'missing.jsonl'}", "--results", str(res), "--svg",
                        str(tmp_path / "c.svg")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "fp8_row wrote no metrics" in r.stdout
    rows = [json.loads(l) for l in open(res)]
    assert [(r["variant"], r["fp8"]) for r in rows[:4]] == [("bf16", False), ("fp8", True), ("fp8_ends", True),
                                                            ("bf16_seed2", False)]
    verdicts = {r["comparison"]: r for r in rows[4:]}
    assert sorted(verdicts) == ["bf16_seed2_vs_bf16", "fp8_ends_vs_bf16", "fp8_vs_bf16"]
    assert verdicts["fp8_vs_bf16"]["within_1pct"] is False and abs(verdicts["fp8_vs_bf16"]["rel_diff"] - 0.02) < 1e-9
    assert verdicts["fp8_ends_vs_bf16"]["within_1pct"] is True
    assert abs(verdicts["bf16_seed2_vs_bf16"]["rel_diff"] + 0.005) < 1e-9
    svg = ET.parse(tmp_path / "c.svg").getroot()
    assert len(svg.findall("{http://www.w3.org/2000/svg}polyline")) == 6  # 4 held-out, 2 training curves


def test_unknown_run_name_is_refused_before_training(tmp_path):
    env = dict(os.environ, FIDELITY_RUNS="bf16 fp8_fast", OUT=str(tmp_path / "out"), FIDELITY_TRAIN_GPT="/bin/false")
    r = subprocess.run(["bash", os.path.join(REPO, "bench", "run_fp8_fidelity.sh"), "unused", "124m"], env=env,
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and "unknown run 'fp8_fast'" in r.stderr, r.stdout + r.stderr
    env["FIDELITY_RUNS"] = "fp8 bf16"
    r = subprocess.run(["bash", os.path.join(REPO, "bench", "run_fp8_fidelity.sh"), "unused", "124m"], env=env,
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and "must start with bf16" in r.stderr, r.stdout + r.stderr


def test_report_verdict_on_seed_means(tmp_path):
    train = [(s, 3.0 - s / 100) for s in range(1, 101)]
    finals = {"bf16": 2.00, "bf16_seed2": 2.04, "fp8": 2.05, "fp8_seed2": 2.03, "fp8_ends": 2.01}
    args = []
    for name, final in finals.items():
        path = tmp_path / f"{name}.jsonl"
        _metrics(path, [(0, 5.0), (100, final)], train)
        args += ["--bf16", str(path)] if name == "bf16" else ["--run", f"{name}={path}"]
    res = tmp_path / "res.jsonl"
    r = subprocess.run([sys.executable, REPORT, "--config", "x"] + args + ["--results", str(res), "--svg",
                        str(tmp_path / "c.svg")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    verdicts = {v["comparison"]: v for v in map(json.loads, open(res)) if "comparison" in v}
    # single runs against the one bf16 run, and the fp8 recipe's 2 seeds against bf16's 2 (fp8_ends has one seed)
    assert abs(verdicts["fp8_vs_bf16"]["rel_diff"] - 0.025) < 1e-9 and not verdicts["fp8_vs_bf16"]["within_1pct"]
    mean = verdicts["fp8_seedmean_vs_bf16_seedmean"]
    assert mean["seeds_bf16"] == 2 and mean["seeds_variant"] == 2
    assert abs(mean["rel_diff"] - (2.04 - 2.02) / 2.02) < 1e-9 and mean["within_1pct"] is True
    assert abs(mean["bf16_seed_spread"] - 0.04 / 2.02) < 1e-9
    assert "fp8_ends_seedmean_vs_bf16_seedmean" not in verdicts
    assert "over 2 seeds" in r.stdout
    pairs = mean["paired_rel_diffs"]  # fp8 against bf16 (seed 1), fp8_seed2 against bf16_seed2
    assert sorted(pairs) == ["fp8", "fp8_seed2"] and abs(pairs["fp8"] - 0.025) < 1e-9
    assert abs(pairs["fp8_seed2"] - (2.03 - 2.04) / 2.04) < 1e-9


def test_report_leaves_an_unfinished_run_out_of_the_verdicts(tmp_path):
    full = [(s, 3.0 - s / 100) for s in range(1, 101)]
    runs = {"bf16": ([(0, 5.0), (50, 3.0), (100, 2.0)], full), "bf16_seed2": ([(0, 5.0), (100, 2.02)], full),
            "fp8": ([(0, 5.0), (100, 2.01)], full), "fp8_seed2": ([(0, 5.0), (50, 2.6)], full[:64])}
    args = []
    for name, (evals, train) in runs.items():
        path = tmp_path / f"{name}.jsonl"
        _metrics(path, evals, train)
        args += ["--bf16", str(path)] if name == "bf16" else ["--run", f"{name}={path}"]
    res = tmp_path / "res.jsonl"
    r = subprocess.run([sys.executable, REPORT, "--config", "x"] + args + ["--results", str(res), "--svg",
                        str(tmp_path / "c.svg")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(l) for l in open(res)]
    cut = next(x for x in rows if x.get("variant") == "fp8_seed2" and "comparison" not in x)
    assert cut["complete"] is False and cut["steps"] == 64
    assert "fp8_seed2 stopped at step 64 of 100: no verdict" in r.stdout
    comparisons = sorted(x["comparison"] for x in rows if "comparison" in x)
    assert comparisons == ["bf16_seed2_vs_bf16", "fp8_vs_bf16"]  # no seed mean: fp8 has one finished seed
