#!/usr/bin/env python3
"""fp8_gemm_probe.py: the FP8 GEMMs of one GPT layer alone, against the same GEMMs in bf16 (issue 34).

The FP8 training step measured 1.022x bf16 at gpt-1.3b although its GEMMs are ~75% of the step: either the FP8
GEMMs themselves are not ~2x faster at these shapes and layouts, or the casts around them eat the gain. This times
the GEMMs only, as nn::fp8_linear calls them (at::_scaled_mm, row-major A, column-major B, per-tensor scales,
bf16 output), for the layer's four linears and each of their three GEMMs:

  fwd    y  = x W^T       [tokens, in] x [out, in]^T      E4M3 x E4M3, fast accumulation (our forward)
  dgrad  dx = dy W        [tokens, out] x [out, in]       E5M2 x E4M3, full accumulation (our backward)
  wgrad  dW = dy^T x      [out, tokens] x [tokens, in]    E5M2 x E4M3, full accumulation

Each is also run with the other accumulation setting, and the bf16 GEMM with the same operand layouts (torch.mm).
Median of --reps CUDA-event timings after warm-up; TFLOP/s and the FP8 / bf16 speed-up per GEMM and summed per layer.
Where bmtrain imports (PYTHONPATH=<build>/python), each linear's whole forward + backward is also timed as the engine
runs it: bmt's FP8 linear (casts and amax included; per-tensor and rowwise scaling) against its bf16 linear (rows
with gemm "linear_fwd_bwd").

  python3 bench/fp8_gemm_probe.py [--preset gpt-1.3b|gpt-6.7b] [--tokens 16384] [--json PATH]
Environment: BMT_CALL_ID, BMT_GIT_COMMIT as in torchops_gpt.py. On a CPU (--device cpu) it runs the same calls at a
reduced size as a check of the script, not a measurement.
"""
import argparse
import os
import statistics
import sys
import time

import torch

from bench_rows import append_rows, git_commit, machine, utc_now  # (bench/: the script's folder)

PRESETS = {"gpt-1.3b": (2048, 8192), "gpt-6.7b": (4096, 16384)}


def linears(d, ff):
    """(name, in, out) of a GPT layer's four linears."""
    return [("c_attn", d, 3 * d), ("attn_proj", d, d), ("fc", d, ff), ("mlp_proj", ff, d)]


def timer(device, reps):
    if device.type == "cuda":
        def run(fn):
            for _ in range(3):
                fn()
            times = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            return statistics.median(times)
    else:
        def run(fn):
            fn()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
    return run


def fp8(t, dtype):
    """t cast to FP8 with a per-tensor scale (torch ops: this probe times the GEMMs, not the casts)."""
    fmax = torch.finfo(dtype).max
    scale = (fmax / t.abs().max().float().clamp(min=1e-12))
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return q, (1.0 / scale).reshape(())


def engine_linears(a, device, d, ff, tokens, run, gpu, call_id):
    """Forward + backward of each linear through bmt's kernels, FP8 against bf16 (casts included); [] without bmt."""
    try:
        from bmtrain import _C
    except ImportError as e:
        print(f"[fp8-probe] bmtrain not importable ({e}): no engine linear rows", flush=True)
        return []
    rows, total = [], {"bf16": 0.0, "fp8": 0.0, "fp8_row": 0.0}
    for name, fin, fout in linears(d, ff):
        x = torch.randn(tokens, fin, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(fout, fin, device=device, dtype=torch.bfloat16) * 0.02).requires_grad_()
        dy = torch.randn(tokens, fout, device=device, dtype=torch.bfloat16) * 1e-3
        ops = {"bf16": lambda: _C.nn.linear(x, w, None), "fp8": lambda: _C.nn.fp8_linear(x, w, None, None, "tensor"),
               "fp8_row": lambda: _C.nn.fp8_linear(x, w, None, None, "row")}
        row = {"bench": "fp8-gemm-probe", "preset": a.preset, "linear": name, "gemm": "linear_fwd_bwd",
               "m": tokens, "n": fout, "k": fin, "device": gpu, "torch": torch.__version__, "git_commit": git_commit(),
               "call_id": call_id, "machine": machine(), "date": utc_now()}
        for kind, op in ops.items():
            def step(op=op):
                x.grad = w.grad = None
                torch.autograd.backward(op(), dy)
            row[f"{kind}_ms"] = 1e3 * run(step)
            total[kind] += row[f"{kind}_ms"]
        row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
        row["speedup_row"] = row["bf16_ms"] / row["fp8_row_ms"]
        rows.append(row)
        print(f"RESULT linear={name} gemm=linear_fwd_bwd bf16_ms={row['bf16_ms']:.4g} fp8_ms={row['fp8_ms']:.4g} "
              f"fp8_row_ms={row['fp8_row_ms']:.4g} speedup={row['speedup']:.4g} speedup_row={row['speedup_row']:.4g}",
              flush=True)
    print(f"[fp8-probe] engine linears fwd+bwd: bf16 {total['bf16']:.3f} ms, fp8 per tensor {total['fp8']:.3f} ms "
          f"({total['bf16'] / total['fp8']:.3f}x), rowwise {total['fp8_row']:.3f} ms "
          f"({total['bf16'] / total['fp8_row']:.3f}x)", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt-1.3b", choices=sorted(PRESETS))
    ap.add_argument("--tokens", type=int, default=16384, help="rows of the activations (batch x seq)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    device = torch.device(a.device)
    d, ff = PRESETS[a.preset]
    tokens = a.tokens
    if device.type == "cpu":  # a check of the script only
        d, ff, tokens = d // 32, ff // 32, 256
    run = timer(device, a.reps)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    call_id = os.environ.get("BMT_CALL_ID", "")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"[fp8-probe] {a.preset} tokens {tokens} on {gpu}, torch {torch.__version__}", flush=True)
    rows, totals = [], {}
    torch.manual_seed(0)
    for name, fin, fout in linears(d, ff):
        x = torch.randn(tokens, fin, device=device, dtype=torch.bfloat16)
        w = torch.randn(fout, fin, device=device, dtype=torch.bfloat16) * 0.02
        dy = torch.randn(tokens, fout, device=device, dtype=torch.bfloat16) * 1e-3
        x8, xs = fp8(x, e4)
        w8, ws = fp8(w, e4)
        dy8, dys = fp8(dy, e5)
        xt8, wt8, dyt8 = x8.t().contiguous(), w8.t().contiguous(), dy8.t().contiguous()
        xt, wt, dyt = x.t().contiguous(), w.t().contiguous(), dy.t().contiguous()
        # (m, n, k, bf16 GEMM, FP8 GEMM given fast_accum): row-major A and, as _scaled_mm wants, column-major B
        gemms = {
            "fwd": (tokens, fout, fin, lambda: torch.mm(x, w.t()),
                    lambda fast: torch._scaled_mm(x8, w8.t(), xs, ws, out_dtype=torch.bfloat16, use_fast_accum=fast),
                    True),
            "dgrad": (tokens, fin, fout, lambda: torch.mm(dy, wt.t()),
                      lambda fast: torch._scaled_mm(dy8, wt8.t(), dys, ws, out_dtype=torch.bfloat16,
                                                    use_fast_accum=fast), False),
            "wgrad": (fout, fin, tokens, lambda: torch.mm(dyt, xt.t()),
                      lambda fast: torch._scaled_mm(dyt8, xt8.t(), dys, xs, out_dtype=torch.bfloat16,
                                                    use_fast_accum=fast), False),
        }
        for gemm, (m, n, k, bf16_fn, fp8_fn, ours_fast) in gemms.items():
            flop = 2.0 * m * n * k
            row = {"bench": "fp8-gemm-probe", "preset": a.preset, "linear": name, "gemm": gemm, "m": m, "n": n,
                   "k": k, "device": gpu, "torch": torch.__version__, "git_commit": git_commit(), "call_id": call_id,
                   "machine": machine(), "date": utc_now()}
            try:
                row["bf16_ms"] = 1e3 * run(bf16_fn)
                row["fp8_ms"] = 1e3 * run(lambda: fp8_fn(ours_fast))  # as nn::fp8_linear calls it
                row["fp8_other_accum_ms"] = 1e3 * run(lambda: fp8_fn(not ours_fast))
                row["fp8_fast_accum"] = ours_fast
                row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
                row["bf16_tflops"] = flop / row["bf16_ms"] / 1e9
                row["fp8_tflops"] = flop / row["fp8_ms"] / 1e9
                for key in ("bf16_ms", "fp8_ms", "fp8_other_accum_ms"):
                    totals[key] = totals.get(key, 0.0) + row[key]
            except RuntimeError as e:  # a layout or dtype _scaled_mm refuses: recorded, the rest goes on
                row["error"] = str(e).splitlines()[0][:300]
            rows.append(row)
            print("RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in row.items() if k not in ("date", "torch", "device")), flush=True)
    rows += engine_linears(a, device, d, ff, tokens, run, gpu, call_id)
    if totals.get("fp8_ms"):
        print(f"[fp8-probe] layer total: bf16 {totals['bf16_ms']:.3f} ms, fp8 {totals['fp8_ms']:.3f} ms "
              f"(other accumulation {totals['fp8_other_accum_ms']:.3f} ms): {totals['bf16_ms'] / totals['fp8_ms']:.3f}x",
              flush=True)
    if a.json:
        append_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
