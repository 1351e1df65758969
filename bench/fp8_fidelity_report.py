"""fp8_fidelity_report.py: issue 34's loss-fidelity verdicts from train_gpt metrics files (--metrics) of the same
run in bf16 (--bf16, the reference) and in variants (--fp8 PATH, or --run NAME=PATH, repeated: fp8, fp8_e4m3grad,
fp8_ends, bf16_seed2 ... as bench/run_fp8_fidelity.sh names them). Appends to --results one row per run (framework
bmt, kind fp8_fidelity, variant, fp8, the held-out curve, the final held-out and training losses, tokens/s) and one
comparison row per variant against bf16 (the final held-out losses' relative difference, whether it is within 1%,
whether either run diverged: a non-finite loss, or a held-out loss that ends above its minimum by more than 10%),
and, where a recipe and bf16 both ran with 2+ seeds (NAME_seedN), one on the seed means (with bf16's seed spread and
the same-seed pairs' differences), all with $BMT_CALL_ID. A run that stopped before bf16's last step (a time limit)
keeps its row, marked complete: false, and enters no verdict; writes --svg, the held-out curves and the training losses of bf16 and the first variant (a
20-step running mean) on one chart. Prints one verdict line per variant."""
import argparse
import json
import math
import os
import sys


def load(path):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    speeds = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")]
    if not evals or not train:
        raise SystemExit(f"{path}: no held-out or training losses (did the run end early?)")
    return evals, train, speeds


def running_mean(points, width=20):
    out, acc = [], []
    for s, v in points:
        acc.append(v)
        if len(acc) > width:
            acc.pop(0)
        out.append((s, sum(acc) / len(acc)))
    return out


def diverged(evals, train):
    values = [v for _, v in evals] + [v for _, v in train]
    if any(not math.isfinite(v) for v in values):
        return "non-finite loss"
    low = min(v for _, v in evals)
    if evals[-1][1] > 1.1 * low:
        return f"held-out loss ended at {evals[-1][1]:.4f}, above its minimum {low:.4f} by more than 10%"
    return ""


def svg(path, title, series):
    """series: [(label, colour, dash, [(x, y)])] -> a line chart with axes and a legend, no dependencies."""
    w, h, l, r, t, b = 720, 420, 64, 16, 36, 48
    xs = [x for *_, pts in series for x, _ in pts]
    ys = [y for *_, pts in series for _, y in pts if math.isfinite(y)]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    y0, y1 = y0 - 0.02 * (y1 - y0), y1 + 0.02 * (y1 - y0)
    px = lambda x: l + (x - x0) / max(x1 - x0, 1e-9) * (w - l - r)
    py = lambda y: t + (y1 - y) / max(y1 - y0, 1e-9) * (h - t - b)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           f'font-size="12"><rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>']
    for i in range(6):
        yv = y0 + (y1 - y0) * i / 5
        xv = x0 + (x1 - x0) * i / 5
        out.append(f'<line x1="{l}" x2="{w - r}" y1="{py(yv):.1f}" y2="{py(yv):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{l - 6}" y="{py(yv) + 4:.1f}" text-anchor="end">{yv:.2f}</text>')
        out.append(f'<text x="{px(xv):.1f}" y="{h - b + 16}" text-anchor="middle">{xv:.0f}</text>')
    out.append(f'<text x="{(l + w - r) / 2}" y="{h - 10}" text-anchor="middle">step</text>')
    out.append(f'<text x="14" y="{(t + h - b) / 2}" transform="rotate(-90 14 {(t + h - b) / 2})" '
               f'text-anchor="middle">loss (nats/byte)</text>')
    out.append(f'<rect x="{l}" y="{t}" width="{w - l - r}" height="{h - t - b}" fill="none" stroke="#888"/>')
    for i, (label, colour, dash, pts) in enumerate(series):
        d = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts if math.isfinite(y))
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.6" stroke-dasharray="{dash}" '
                   f'points="{d}"/>')
        ly = t + 14 + 16 * i
        out.append(f'<line x1="{w - r - 210}" x2="{w - r - 180}" y1="{ly}" y2="{ly}" stroke="{colour}" '
                   f'stroke-width="2" stroke-dasharray="{dash}"/>')
        out.append(f'<text x="{w - r - 174}" y="{ly + 4}">{label}</text>')
    out.append("</svg>")
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        f.write("\n".join(out) + "\n")
    os.replace(tmp, path)


def recipe(name):
    """A run's name without its seed: fp8_ends_seed2 -> fp8_ends."""
    return "_".join(p for p in name.split("_") if not (p.startswith("seed") and p[4:].isdigit()))


COLOURS = ["#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--bf16", required=True, help="the reference run's metrics")
    p.add_argument("--fp8", help="shorthand for --run fp8=PATH")
    p.add_argument("--run", action="append", default=[], metavar="NAME=PATH", help="a variant's metrics")
    p.add_argument("--args", default="", help="the train_gpt arguments the runs shared")
    p.add_argument("--results", required=True)
    p.add_argument("--svg", required=True)
    p.add_argument("--corpus-info", default="")
    a = p.parse_args()
    variants = ([("fp8", a.fp8)] if a.fp8 else []) + [tuple(r.split("=", 1)) for r in a.run]
    if any(len(v) != 2 or not v[0] for v in variants):
        p.error("--run takes NAME=PATH")
    call_id = os.environ.get("BMT_CALL_ID", "unknown")
    base = {"kind": "fp8_fidelity", "framework": "bmt", "config": a.config, "args": a.args, "call_id": call_id,
            "git_commit": os.environ.get("BMT_GIT_COMMIT", "unknown"),
            "machine": os.environ.get("BMT_BENCH_MACHINE", "unknown")}
    if a.corpus_info and os.path.exists(a.corpus_info):
        info = json.loads(open(a.corpus_info).read().strip().splitlines()[-1])
        base["data"] = {k: info[k] for k in ("bytes", "files", "sha256", "torch") if k in info}
    if not os.path.exists(a.bf16):
        print(f"[fp8_fidelity] {a.config}: the bf16 run wrote no metrics ({a.bf16}); no verdict")
        return 1
    runs = {"bf16": load(a.bf16)}
    for name, path in variants:
        if os.path.exists(path):
            runs[name] = load(path)
        else:
            print(f"[fp8_fidelity] {a.config}: {name} wrote no metrics ({path}); no verdict for it")
    rows = {}
    for name, (evals, train, speeds) in runs.items():
        rows[name] = dict(base, variant=name, fp8=name.startswith("fp8"), steps=train[-1][0], eval_curve=evals,
                          final_eval_loss=evals[-1][1], final_train_loss_mean20=running_mean(train)[-1][1],
                          tokens_per_s=sorted(speeds)[len(speeds) // 2] if speeds else None,
                          diverged=diverged(evals, train) or None)
    ref = rows["bf16"]
    for name, row in rows.items():
        row["complete"] = row["steps"] >= ref["steps"] and row["eval_curve"][-1][0] >= ref["eval_curve"][-1][0]
        if not row["complete"]:
            print(f"[fp8_fidelity] {a.config}: {name} stopped at step {row['steps']} of {ref['steps']}: no verdict")
    done = {n: r for n, r in rows.items() if r["complete"]}
    verdicts = []
    for name, row in done.items():
        if name == "bf16":
            continue
        e16, e = ref["final_eval_loss"], row["final_eval_loss"]
        rel = (e - e16) / e16
        verdicts.append(dict(base, comparison=f"{name}_vs_bf16", variant=name, steps=ref["steps"],
                             final_eval_loss_bf16=e16, final_eval_loss_variant=e, rel_diff=rel,
                             within_1pct=abs(rel) <= 0.01, diverged=ref["diverged"] or row["diverged"] or None))
        print(f"RESULT fidelity {a.config} {name}: steps {ref['steps']}, held-out bf16 {e16:.4f} {name} {e:.4f} "
              f"({100 * rel:+.2f}%, within 1%: {abs(rel) <= 0.01}), diverged: {verdicts[-1]['diverged'] or 'no'}")
    # runs of one recipe with other seeds (NAME_seedN): the verdict on the seed means, where both sides have 2+ runs
    groups = {}
    for name, row in done.items():
        groups.setdefault(recipe(name), []).append(row["final_eval_loss"])
    ref_losses = groups.get("bf16", [])
    for name, losses in groups.items():
        if name == "bf16" or len(losses) < 2 or len(ref_losses) < 2:
            continue
        m16, m = sum(ref_losses) / len(ref_losses), sum(losses) / len(losses)
        rel = (m - m16) / m16
        # same init and data order on both sides: name_seedN against bf16_seedN (seed 1 has no suffix)
        pairs = {}
        for n, r in done.items():
            if recipe(n) == name:
                twin = "bf16" + n[len(name):]
                if twin in done:
                    pairs[n] = (r["final_eval_loss"] - done[twin]["final_eval_loss"]) / done[twin]["final_eval_loss"]
        verdicts.append(dict(base, comparison=f"{name}_seedmean_vs_bf16_seedmean", variant=name, steps=ref["steps"],
                             seeds_bf16=len(ref_losses), seeds_variant=len(losses), final_eval_loss_bf16=m16,
                             final_eval_loss_variant=m, rel_diff=rel, within_1pct=abs(rel) <= 0.01,
                             bf16_seed_spread=(max(ref_losses) - min(ref_losses)) / m16, paired_rel_diffs=pairs,
                             diverged=any(done[n]["diverged"] for n in done if recipe(n) in (name, "bf16")) or None))
        print(f"RESULT fidelity {a.config} {name} over {len(losses)} seeds: held-out mean bf16 {m16:.4f} ({len(ref_losses)} "
              f"seeds, spread {100 * verdicts[-1]['bf16_seed_spread']:.2f}%) {name} {m:.4f} ({100 * rel:+.2f}%, "
              f"within 1%: {abs(rel) <= 0.01}); same-seed pairs "
              + ", ".join(f"{n} {100 * d:+.2f}%" for n, d in pairs.items()))
    with open(a.results, "a") as f:
        for r in list(rows.values()) + verdicts:
            f.write(json.dumps(r) + "\n")
    series = [("bf16 held-out", "#1f77b4", "", runs["bf16"][0])]
    for i, name in enumerate(n for n in runs if n != "bf16"):
        series.append((f"{name} held-out", COLOURS[i % len(COLOURS)], "6 3", runs[name][0]))
    series.append(("bf16 train (mean 20)", "#9ecae1", "", running_mean(runs["bf16"][1])))
    first = next((n for n in runs if n != "bf16"), None)
    if first:
        series.append((f"{first} train (mean 20)", "#fcae91", "6 3", running_mean(runs[first][1])))
    names = ", ".join(runs)
    svg(a.svg, f"{a.config}: held-out loss of {names} ({a.args})", series)
    return 0


if __name__ == "__main__":
    sys.exit(main())
