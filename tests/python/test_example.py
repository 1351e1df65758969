"""examples/python/train_gpt.py trains at world 2 (CPU ranks, or 2 GPUs with BMT_TEST_DEVICE=cuda) and its loss drops."""
import json
import os


import launcher

SCRIPT = os.path.join(launcher.REPO, "examples", "python", "train_gpt.py")


def test_train_gpt_loss_drops(tmp_path):
    nproc = launcher.effective_world(2)
    metrics = tmp_path / "metrics.jsonl"
    steps = 40
    rc, out, timed_out = launcher.run_torchrun(
        SCRIPT, ["--steps", str(steps), "--batch", "8", "--seq", "32", "--metrics", str(metrics), "--json",
                 "--log-every", "10"], nproc, timeout_s=float(os.environ.get("BMT_TEST_TIMEOUT", "120")) * 1.5,
        out_dir=str(tmp_path))
    assert rc == 0, f"train_gpt.py exited with {rc}{' (timed out)' if timed_out else ''}:\n{launcher.tail(out)}"
    summary = [json.loads(line) for line in out.splitlines() if line.startswith("{") and "tokens_per_s" in line]
    assert summary, f"no --json summary line in the output:\n{launcher.tail(out)}"
    s = summary[-1]
    assert s["world"] == nproc and s["steps"] == steps
    assert s["tokens_per_s"] and s["tokens_per_s"] > 0 and s["peak_mem_mib"] > 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_ms", "mfu", "mem_mib", "elapsed_s"):
        assert key in rows[0], f"metrics line lacks '{key}': {rows[0]}"
    first = rows[0]["loss"]
    last = sum(r["loss"] for r in rows[-5:]) / 5
    # Uniform over 13 tokens is ln 13 = 2.56; the separators and layout are learned within tens of steps.
    assert first > 2.3, f"first loss {first} (untrained should be about ln 13 = 2.56)"
    assert last < first - 0.4, f"loss did not drop enough: first {first:.4f}, mean of last 5 {last:.4f}\n{launcher.tail(out, 3000)}"
    assert "step 10/40" in out, f"no progress line:\n{launcher.tail(out, 3000)}"
