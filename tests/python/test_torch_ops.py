"""bmt.torch_ops and the step inside the backward (workers/w_torch_ops.py, worlds 1 and 2), the same cases with
BMT_ROUTE_TORCH_OPS=0, torch.compile inside a Block (workers/w_torch_compile.py) and the torch-ops benchmark
script's CPU smoke run."""
import json
import os
import subprocess
import sys

import pytest

from launcher import REPO, effective_world, run_case, worker_cases

WORKER = "w_torch_ops"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_torch_ops(launcher, case, world):
    run_case(launcher, WORKER, case, world)


@pytest.mark.parametrize("case", ["layers_match_plain_ops", "attention_variants", "gelu_then_linear_takes_the_fused_backward",
                                  "route_mechanism_is_scoped", "routing_switch_from_code"])
def test_torch_ops_mode_mechanism(launcher, case):
    """BMT_ROUTE_MECHANISM=mode: the same routes through the TorchFunctionMode for the whole Block run."""
    res = launcher.result(WORKER, 2, extra_args=("mode",), extra_env={"BMT_ROUTE_MECHANISM": "mode"})
    skip = res.check(case)
    assert not skip, skip


@pytest.mark.parametrize("case", ["layers_match_plain_ops", "attention_variants", "cross_entropy_of_upcast_logits"])
def test_torch_ops_env_off(launcher, case):
    """BMT_ROUTE_TORCH_OPS=0: nothing is routed and the results still equal the plain ops."""
    res = launcher.result(WORKER, 2, extra_args=("route-off",), extra_env={"BMT_ROUTE_TORCH_OPS": "0"})
    skip = res.check(case)
    assert not skip, skip


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", worker_cases("w_torch_compile"))
def test_torch_compile_in_block(launcher, case, world):
    # inductor compiles C++ on the CPU: minutes on a busy 2-core machine, so this launch gets 10 of them
    old = os.environ.get("BMT_TEST_TIMEOUT")
    os.environ["BMT_TEST_TIMEOUT"] = str(max(600.0, float(old or 0)))
    try:
        res = launcher.result("w_torch_compile", world)
    finally:
        if old is None:
            del os.environ["BMT_TEST_TIMEOUT"]
        else:
            os.environ["BMT_TEST_TIMEOUT"] = old
    assert effective_world(world) == res.nproc
    skip = res.check(case)
    assert not skip, skip


def test_torchops_bench_smoke(tmp_path):
    """bench/torchops_gpt.py on the tiny preset, CPU: the package (routing and step inside the backward on),
    plain PyTorch, FSDP2 and the package with --fp8 each write one JSON row with the benchmark's fields."""
    path = str(tmp_path / "rows.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", BMT_CALL_ID="smoke-call",
               PYTHONPATH=os.pathsep.join(p for p in [os.environ.get("PYTHONPATH", "")] if p),
               BMT_STEP_IN_BACKWARD="auto", PET_LOG_DIR=str(tmp_path / "torchelastic"))
    script = os.path.join(REPO, "bench", "torchops_gpt.py")
    runs = [["--framework", "bmtrain", "--dtype", "bf16", "--checkpointing"], ["--framework", "plain"],
            ["--framework", "fsdp2"], ["--framework", "bmtrain", "--fp8"]]
    for extra in runs:
        cmd = [sys.executable, script, "--preset", "tiny", "--warmup", "1", "--steps", "2", "--json", path] + extra
        if extra[1] == "bmtrain":  # world 1 through torchrun's environment
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"] + cmd[1:]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
        assert r.returncode == 0, f"{extra}: rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    rows = [json.loads(line) for line in open(path)]
    assert [r["framework"] for r in rows] == ["bmtrain-py-torchops", "plain", "fsdp2", "bmtrain-py-torchops"]
    for r in rows:
        for key in ("framework", "config", "tokens_per_s", "peak_gpu_gib", "git_commit", "call_id"):
            assert key in r, f"{r['framework']}: no {key}"
        assert r["call_id"] == "smoke-call" and r["tokens_per_s"] > 0
    bmt_row = rows[0]
    assert bmt_row["config"] == "tiny seq64 batch4 ckpt"
    # every op of the model reached the engine, and the loop got the step inside the backward (BMT_STEP_IN_BACKWARD=auto
    # below, as run_torchops_bench.sh sets it: the package's default is off)
    assert all(bmt_row["routed_calls"][op] > 0 for op in ("linear", "layer_norm", "attention", "cross_entropy")), \
        bmt_row["routed_calls"]
    assert bmt_row["step_in_backward"] is True
    # the same initial values and batches: the first loss of every framework agrees
    assert abs(rows[1]["loss_first"] - rows[2]["loss_first"]) < 1e-4
    # --fp8: every linear inside the Blocks ran as an FP8 GEMM (the tied LM head outside them is not routed)
    fp8 = rows[3]
    assert fp8["fp8"] is True and fp8["variant"] == "fp8 eager" and bmt_row["fp8"] is False
    assert fp8["routed_calls"]["fp8_linear"] > 0 and fp8["routed_calls"]["linear"] == 0, fp8["routed_calls"]


def test_host_overhead_bench_smoke(tmp_path):
    """bench/host_overhead.py on CPU: one row per framework and variant with positive per-layer times."""
    path = str(tmp_path / "rows.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", BMT_CALL_ID="smoke-call")
    cmd = [sys.executable, os.path.join(REPO, "bench", "host_overhead.py"), "--device", "cpu", "--layers", "2",
           "--reps", "2", "--json", path]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    rows = [json.loads(line) for line in open(path)]
    assert [(x["framework"], x["variant"]) for x in rows] == [
        ("plain", "eager"), ("plain", "ckpt"), ("bmtrain-py-torchops", "route"),
        ("bmtrain-py-torchops", "no-route"), ("bmtrain-py-torchops", "ckpt")]
    for x in rows:
        assert x["call_id"] == "smoke-call" and x["fwd_us_per_layer"] > 0
        assert x["fwd_bwd_us_per_layer"] > x["fwd_us_per_layer"] / 2, x
    routed = {x["variant"]: x["routed_calls"] for x in rows if x["framework"] != "plain"}
    assert routed["route"]["linear"] > 0 and routed["route"]["attention"] > 0, routed
    assert not any(routed["no-route"].values()), routed
