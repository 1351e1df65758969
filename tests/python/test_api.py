"""The package's import-time surface: BMTrain 1.0.1's names (bmtrain.md 1.1-1.14, issue 15 item 2) and the check
that refuses a torch other than the one it was built against."""
import os
import re
import subprocess
import sys


TOP = ["init_distributed", "config", "world_size", "rank", "DistributedParameter", "ParameterInitializer",
       "DistributedModule", "init_parameters", "grouped_parameters", "synchronize", "sum_loss", "gather_result",
       "Block", "CheckpointBlock", "TransformerBlockList", "save", "load", "print_rank", "print_block",
       "print_dict", "see_memory", "main_grad"]
SUB = {
    "nn": ["Linear", "ColumnParallelLinear", "RowParallelLinear", "VPEmbedding", "OpParallelLinear"],
    "loss": ["FusedCrossEntropy"],
    "optim": ["AdamOptimizer", "AdamOffloadOptimizer", "OptimManager"],
    "lr_scheduler": ["WarmupLRScheduler", "NoDecay", "Noam", "Linear", "Cosine", "Exponential"],
    "distributed": ["all_gather", "all_reduce", "reduce_scatter", "broadcast", "send_activations",
                    "recv_activations"],
    "utils": ["AverageRecorder", "print_block", "print_dict", "see_memory"],
}


def _env():
    env = dict(os.environ)
    if os.environ.get("BMT_TEST_DEVICE", "cpu") != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def test_names():
    import bmtrain as bmt
    missing = [n for n in TOP if not hasattr(bmt, n)]
    for mod, names in SUB.items():
        m = getattr(bmt, mod, None)
        missing += [f"{mod}.{n}" for n in names if m is None or not hasattr(m, n)]
    assert not missing, f"bmtrain lacks {missing}"
    assert bmt.CheckpointBlock is bmt.Block
    from bmtrain.global_var import config
    assert config is bmt.config
    import bmtrain.benchmark  # noqa: F401  (BMTrain forgets to import it; it must at least import)


def _package_checks_torch_version():
    import importlib.util
    spec = importlib.util.find_spec("bmtrain")
    pkg_dir = os.path.dirname(spec.origin)
    for root, _, files in os.walk(pkg_dir):
        for f in files:
            if f.endswith(".py") and "torch.__version__" in open(os.path.join(root, f), errors="ignore").read():
                return True
    return False


def test_torch_version_mismatch_is_refused():
    """Importing under another torch fails with a message naming both versions (issue 15 item 1). Simulated by
    overwriting torch.__version__ before the import (the real ABI still matches, so only the check can fail)."""
    assert _package_checks_torch_version(), "the package has no torch-version check in its Python files"
    code = "import torch; real = torch.__version__; torch.__version__ = '1.2.3+fake'; import bmtrain"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert p.returncode != 0, "import bmtrain succeeded under torch '1.2.3+fake'"
    import torch
    real = torch.__version__
    err = p.stderr
    assert "1.2.3+fake" in err, f"the error does not name the running torch version:\n{err[-3000:]}"
    built = re.escape(real.split("+")[0])
    assert re.search(built, err), f"the error does not name the version it was built against ({real}):\n{err[-3000:]}"
    assert "ImportError" in err or "RuntimeError" in err, err[-3000:]
