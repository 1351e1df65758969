#!/usr/bin/env python3
"""host_overhead.py: the host time a torch-ops GPT layer costs per forward and backward, bmtrain against plain torch.

At small shapes the GPU waits for the host: GPT-2 124M's forward on an H200 ran host-bound in the torch-ops script
(bench/torchops_gpt.py). This measures that cost where it can be measured without a GPU: the layers of
torchops_gpt.py (the same classes) at a tiny width (--dim 64, seq 16, batch 1 by default), where each op's compute
is small beside its dispatch, run as

  plain     the layers in a torch.nn.ModuleList-like Sequential, fp32 torch parameters
  bmtrain   every layer a ZeRO-3 bmt.Block in a bmt.TransformerBlockList (routing as configured; variants below)

and reports microseconds per layer for the forward alone (the part that ran host-bound) and for forward + backward
(median over --reps repetitions of one pass over --layers layers). On a GPU the same run measures the host's
launch rate (the kernels are too small to be the bottleneck); on a CPU it measures dispatch plus tiny kernels.

  python3 bench/host_overhead.py [--device cpu|cuda] [--layers 12] [--reps 30] [--json PATH] [--cprofile N]
Variants of the bmtrain row (--variants, comma list): route (default routing; BMT_ROUTE_MECHANISM=mode for the
TorchFunctionMode, recorded as route_mechanism), no-route (BMT_ROUTE_TORCH_OPS=0),
ckpt (use_checkpoint=True: the backward runs the forward again), no-attrs (route with BMT_BLOCK_ATTRIBUTES=0: a
parameter read inside a running Block goes through DistributedModule.__getattr__). --cprofile N prints the N functions with the most
own time in the bmtrain forward (Python's cProfile; stretches the run, so not timed).
Environment: BMT_CALL_ID, BMT_GIT_COMMIT, BMT_BENCH_MACHINE as in torchops_gpt.py.
"""
import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_rows  # noqa: E402
import torchops_gpt  # noqa: E402  (the model classes)


def timed(fn, reps, sync):
    """Median seconds of fn() over reps calls (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build(framework, a, device, dtype, checkpointing):
    if framework == "plain":
        _, Layer = torchops_gpt.build_model_classes(torch.nn.Module, torchops_gpt.torch_param(device, dtype),
                                                    "normal", "zeros", "ones")
        return torchops_gpt.Sequential([Layer(a.dim, a.heads, 4 * a.dim) for _ in range(a.layers)], checkpointing)
    import bmtrain as bmt
    _, Layer = torchops_gpt.build_model_classes(bmt.DistributedModule, torchops_gpt.bmt_param(bmt, dtype),
                                                "normal", "zeros", "ones")
    stack = bmt.TransformerBlockList([bmt.Block(Layer(a.dim, a.heads, 4 * a.dim), use_checkpoint=checkpointing)
                                      for _ in range(a.layers)])
    bmt.init_parameters(stack)
    return stack


def measure(model, a, device, dtype, sync):
    x = torch.randn(a.batch, a.seq, a.dim, device=device, dtype=dtype, requires_grad=True)

    def forward():
        return model(x)

    def train():
        model(x).float().sum().backward()

    fwd = timed(forward, a.reps, sync)
    both = timed(train, a.reps, sync)
    return 1e6 * fwd / a.layers, 1e6 * both / a.layers


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--variants", default="route,no-route,ckpt")
    ap.add_argument("--cprofile", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's intra-op threads (1: a tiny op split over busy cores measures the scheduler)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if a.layers < 1 or a.reps < 1 or a.dim % a.heads:
        ap.error("--layers and --reps must be >= 1 and --dim a multiple of --heads")
    import bmtrain as bmt
    bmt.init_distributed(seed=1234, quiet=True)
    torch.set_num_threads(a.threads)  # after init_distributed, which sets its own count for CPU ranks
    device = torch.device(bmt.config["device"])
    if a.device == "cpu" and device.type != "cpu":
        ap.error("--device cpu: bmtrain chose a GPU (run with CUDA_VISIBLE_DEVICES='')")
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    call_id = os.environ.get("BMT_CALL_ID", "")
    rows = []

    def row(framework, variant, fwd_us, both_us, routed=None):
        print(f"RESULT framework={framework} variant={variant} fwd_us_per_layer={fwd_us:.1f} "
              f"fwd_bwd_us_per_layer={both_us:.1f}", flush=True)
        rows.append({
            "bench": "host-overhead", "framework": framework, "variant": variant,
            "config": f"L{a.layers} d{a.dim} h{a.heads} seq{a.seq} batch{a.batch}", "device": str(device),
            "dtype": str(dtype), "fwd_us_per_layer": fwd_us, "fwd_bwd_us_per_layer": both_us, "reps": a.reps,
            "git_commit": bench_rows.git_commit(), "call_id": call_id, "machine": bench_rows.machine(),
            "date": bench_rows.utc_now(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "routed_calls": routed,
            "route_mechanism": os.environ.get("BMT_ROUTE_MECHANISM", "patch") if routed else None,
            "block_attributes": None if framework == "plain" else variant != "no-attrs"})

    torch.manual_seed(0)
    for ckpt in (False, True):
        plain = build("plain", a, device, dtype, ckpt)
        row("plain", "ckpt" if ckpt else "eager", *measure(plain, a, device, dtype, sync))
        del plain
    for variant in [v for v in a.variants.split(",") if v]:
        if variant not in ("route", "no-route", "ckpt", "no-attrs"):
            ap.error(f"--variants: unknown variant {variant!r}")
        if variant == "no-attrs":  # read when a Block is built
            os.environ["BMT_BLOCK_ATTRIBUTES"] = "0"
        try:
            model = build("bmtrain", a, device, dtype, variant == "ckpt")
        finally:
            os.environ.pop("BMT_BLOCK_ATTRIBUTES", None)
        with bmt.torch_ops.routing(variant != "no-route"):
            bmt.torch_ops.routed_counts(reset=True)
            times = measure(model, a, device, dtype, sync)
            row("bmtrain-py-torchops", variant, *times, routed=bmt.torch_ops.routed_counts(reset=True))
            if a.cprofile and variant == "route":
                x = torch.randn(a.batch, a.seq, a.dim, device=device, dtype=dtype, requires_grad=True)
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(a.reps):
                    model(x)
                sync()
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.cprofile)
                print(s.getvalue())
        del model
    if a.json:
        bench_rows.append_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
