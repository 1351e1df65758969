#!/usr/bin/env python3
"""torchops_gpt.py: one GPT written with torch's functional ops, trained by bmtrain, plain PyTorch or FSDP2.

The model is written as a BMTrain user writes it: F.linear, F.layer_norm, F.scaled_dot_product_attention(
is_causal=True), F.gelu(approximate="tanh"), an fp32 F.cross_entropy on the logits (`logits.float()`), GPT-2's
shapes (pre-LN, learned positions, tied output projection, vocab 50304, init normal(0.02), biases 0, LayerNorm
1/0). The same classes run under three frameworks (--framework):

  bmtrain  bf16 bmt.DistributedParameters, every layer a ZeRO-3 bmt.Block (use_checkpoint = --checkpointing) in a
           bmt.TransformerBlockList, bmt.optim.AdamOptimizer (AdamOffloadOptimizer with --offload) under
           bmt.optim.OptimManager(loss_scale=None): the loop is zero_grad / backward / step, nothing else, so what
           the package does on its own (routing the ops to its kernels, the step inside the backward) is measured.
           JSON framework "bmtrain-py-torchops".
  plain    fp32 torch parameters, bf16 autocast, torch.optim.AdamW(fused=True); --checkpointing wraps each layer
           in torch.utils.checkpoint. JSON framework "plain".
  fsdp2    fully_shard on every layer and the root (MixedPrecisionPolicy bf16 compute, fp32 reduce; fp32 sharded
           parameters), AdamW(fused=True), torch.utils.checkpoint per layer with --checkpointing. "fsdp2".
--compile compiles each layer module in place (Module.compile(): the parameter names stay). Timing: W warm-up steps,
N timed steps each followed by a synchronisation; tokens/s = N*B*T / their time; peak_gpu_gib =
torch.cuda.max_memory_allocated() after the warm-up. One process per run (world 1 unless launched by torchrun).

  python3 bench/torchops_gpt.py --framework bmtrain --preset gpt-1.3b --seq 2048 --batch 8 [--checkpointing]
      [--offload] [--compile] [--warmup 2 --steps 5] [--json PATH]
  python3 bench/torchops_gpt.py --framework bmtrain --preset tiny --steps 2     # CPU smoke test (Gloo)
Environment: BMT_CALL_ID (the call's id, same for every row of one call), BMT_GIT_COMMIT, BMT_BENCH_MACHINE.
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from bench_rows import append_rows, free_port, git_commit, machine, utc_now  # (bench/: the script's folder)

VOCAB = 50304
PEAK_FLOPS = 989e12  # H200 bf16 dense
PRESETS = {  # name: (layers, dim, heads, ffn, seq, batch)
    "tiny": (2, 64, 4, 256, 64, 4),
    "gpt2-124m": (12, 768, 12, 3072, 1024, 16),
    "gpt-1.3b": (24, 2048, 16, 8192, 2048, 8),
    "gpt-6.7b": (32, 4096, 32, 16384, 2048, 2),
}
FRAMEWORK_NAMES = {"bmtrain": "bmtrain-py-torchops", "plain": "plain", "fsdp2": "fsdp2"}


def build_model_classes(Base, param, normal, zeros, ones, torch_linear=False):
    """The GPT's classes over a module base class and a parameter factory param(shape, init) (bmtrain's
    DistributedParameter or torch's Parameter): the model code is the same for every framework. torch_linear: the
    layers' linears are torch.nn.Linear modules (same parameters, drawn in the same order), which torchao's float8
    conversion swaps (the --fp8 rows of plain and fsdp2)."""

    class Linear(Base):
        def __init__(self, fin, fout):
            super().__init__()
            self.weight = param((fout, fin), normal)
            self.bias = param((fout,), zeros)

        def forward(self, x):
            return F.linear(x, self.weight, self.bias)

    if torch_linear:
        def Linear(fin, fout):  # noqa: F811
            m = nn.Linear(fin, fout, device="meta")
            m.weight, m.bias = param((fout, fin), normal), param((fout,), zeros)
            return m

    class LayerNorm(Base):
        def __init__(self, dim, eps=1e-5):
            super().__init__()
            self.eps = eps
            self.weight = param((dim,), ones)
            self.bias = param((dim,), zeros)

        def forward(self, x):
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)

    class Layer(Base):
        def __init__(self, dim, heads, ffn):
            super().__init__()
            self.heads = heads
            self.ln_1, self.ln_2 = LayerNorm(dim), LayerNorm(dim)
            self.c_attn, self.attn_proj = Linear(dim, 3 * dim), Linear(dim, dim)
            self.c_fc, self.mlp_proj = Linear(dim, ffn), Linear(ffn, dim)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(Base):
        def __init__(self, layers, dim, heads, ffn, seq, make_stack):
            super().__init__()
            self.wte = param((VOCAB, dim), normal)
            self.wpe = param((seq, dim), normal)
            self.blocks = make_stack([Layer(dim, heads, ffn) for _ in range(layers)])
            self.ln_f = LayerNorm(dim)

        def forward(self, idx):
            T = idx.size(1)
            wte = self.wte  # read once: the lookup and the tied projection share it
            x = F.embedding(idx, wte) + self.wpe[:T]
            x = self.blocks(x)
            return F.linear(self.ln_f(x), wte)

    return GPT, Layer


class Sequential(nn.Module):
    """plain / FSDP2: the layers in order, each under torch.utils.checkpoint when asked."""

    def __init__(self, layers, checkpointing):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.checkpointing = checkpointing

    def forward(self, x):
        for layer in self.layers:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, use_reentrant=False, preserve_rng_state=False)
            else:
                x = layer(x)
        return x


def torch_param(device, dtype=None):
    """build_model_classes' parameter factory for plain torch: N(0, 0.02), zeros or ones, drawn from torch's RNG."""
    inits = {"normal": lambda t: t.normal_(0.0, 0.02), "zeros": lambda t: t.zero_(), "ones": lambda t: t.fill_(1.0)}

    def param(shape_, how):
        with torch.no_grad():
            return nn.Parameter(inits[how](torch.empty(shape_, device=device, dtype=dtype)))
    return param


def bmt_param(bmt, dtype):
    """The same for bmtrain: DistributedParameters with the same initialisers (filled by bmt.init_parameters)."""
    init = {"normal": bmt.ParameterInitializer(torch.nn.init.normal_, mean=0.0, std=0.02),
            "zeros": torch.nn.init.zeros_, "ones": torch.nn.init.ones_}

    def param(shape_, how):
        return bmt.DistributedParameter(torch.empty(shape_, dtype=dtype), init_method=init[how])
    return param


def setup_bmtrain(a, shape, dtype):
    import bmtrain as bmt
    L, d, H, ff, T = shape
    GPT, _ = build_model_classes(bmt.DistributedModule, bmt_param(bmt, dtype), "normal", "zeros", "ones")

    def stack(layers):
        for layer in layers:
            if a.compile:
                layer.compile()
        return bmt.TransformerBlockList([bmt.Block(m, use_checkpoint=a.checkpointing) for m in layers])

    model = GPT(L, d, H, ff, T, stack)
    bmt.init_parameters(model)
    if a.fp8:  # the routed F.linear inside the Blocks in FP8; the tied LM head outside them stays bf16
        bmt.torch_ops.set_fp8(True)
    # AdamW, as the plain and fsdp2 rows (fp32 parameters default to BMTrain's L2 weight decay)
    adam = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True)
    opt = (bmt.optim.AdamOffloadOptimizer if a.offload else bmt.optim.AdamOptimizer)(model.parameters(), **adam)
    manager = bmt.optim.OptimManager(loss_scale=None)
    manager.add_optimizer(opt)

    def step(tokens):
        manager.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), tokens[:, 1:].reshape(-1))
        manager.backward(loss)
        manager.step()
        return loss.detach()

    n_params = sum(p._tp_original_shape.numel() for p in model.parameters())
    info = {"precision": f"{dtype} params, fp32 master and moments", "world": bmt.world_size(),
            "optimizer": f"bmt.optim.{type(opt).__name__}", "rank": bmt.rank()}
    return step, n_params, info, bmt, manager


def setup_torch(a, shape, device):
    L, d, H, ff, T = shape
    GPT, Layer = build_model_classes(nn.Module, torch_param(device), "normal", "zeros", "ones", torch_linear=a.fp8)
    model = GPT(L, d, H, ff, T, lambda layers: Sequential(layers, a.checkpointing))
    cuda = device.type == "cuda"
    if a.fp8:  # torchao's float8 training (tensorwise dynamic scaling, its default) on the layers' linears
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model.blocks, config=Float8LinearConfig(
            enable_fsdp_float8_all_gather=a.framework == "fsdp2"))
    if a.framework == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else torch.float32, reduce_dtype=torch.float32)
        for layer in model.blocks.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    if a.compile:
        for layer in model.blocks.layers:
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            **({"fused": True} if cuda else {"foreach": True}))
    autocast = a.framework == "plain" and cuda

    def step(tokens):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    n_params = sum(p.numel() for p in model.parameters())
    if a.framework == "plain":
        precision = "fp32 params, bf16 autocast" if autocast else "fp32 params"
    else:
        precision = f"fp32 sharded params, {'bf16' if cuda else 'fp32'} compute, fp32 reduce"
    info = {"precision": precision, "world": torch.distributed.get_world_size() if a.framework == "fsdp2" else 1,
            "optimizer": "torch.optim.AdamW(fused)" if cuda else "torch.optim.AdamW(foreach)",
            "rank": torch.distributed.get_rank() if a.framework == "fsdp2" else 0}
    return step, n_params, info


def profile_steps(path, run_step, sync, cuda, steps=2):
    """Two steps under torch.profiler (host ops, Python frames of the model, kernels); the trace to path and its
    summary to stdout. Not timed: the profiler's own overhead stretches the host side."""
    from torch.profiler import ProfilerActivity, profile
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import trace_summary
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, with_stack=False) as prof:
        for i in range(steps):
            run_step(i)
        sync()
    prof.export_chrome_trace(path[:-3] if path.endswith(".gz") else path)
    if path.endswith(".gz"):
        import gzip
        import shutil
        with open(path[:-3], "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(path[:-3])
    print(f"torchops_gpt: profile of {steps} steps -> {path}\n" + trace_summary.summarize(trace_summary.load(path)),
          flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--framework", default="bmtrain", choices=sorted(FRAMEWORK_NAMES))
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seq", type=int, default=0)
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--offload", action="store_true", help="bmtrain: AdamOffloadOptimizer")
    ap.add_argument("--compile", action="store_true", help="compile every layer module (Module.compile())")
    ap.add_argument("--fp8", action="store_true",
                    help="the layers' linears in FP8: bmtrain through bmt.torch_ops.set_fp8 (the engine's "
                         "fp8_linear), plain and fsdp2 through torchao.float8 (needs torchao)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                    help="bmtrain's parameter dtype (auto: bf16 on GPUs, fp32 on CPUs)")
    ap.add_argument("--variant", default="", help="a label for this row (e.g. no-route), stored in the JSON")
    ap.add_argument("--memory-snapshot", default="", help="write torch's allocator snapshot (pickle) here")
    ap.add_argument("--profile", default="", help="after the timed steps, profile 2 more steps: write the chrome "
                    "trace to PATH (.json.gz) and print where the time went (bench/trace_summary.py)")
    ap.add_argument("--json", default="")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    if a.steps < 1 or a.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if a.offload and a.framework != "bmtrain":
        ap.error("--offload is the bmtrain AdamOffloadOptimizer row; plain and fsdp2 have no offload row")
    L, d, H, ff, seq, batch = PRESETS[a.preset]
    T, B = a.seq or seq, a.batch or batch
    shape = (L, d, H, ff, T)

    t_start = time.perf_counter()
    cuda = torch.cuda.is_available()
    bmt = manager = None
    if a.framework == "bmtrain":
        import bmtrain
        bmtrain.init_distributed(seed=a.seed, quiet=True)
        device = torch.device(bmtrain.config["device"])
        cuda = device.type == "cuda"
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(a.dtype, torch.bfloat16 if cuda else torch.float32)
        step, n_params, info, bmt, manager = setup_bmtrain(a, shape, dtype)
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        if a.framework == "fsdp2":
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            torch.distributed.init_process_group("nccl" if cuda else "gloo", **({"device_id": device} if cuda else {}))
        torch.manual_seed(a.seed)
        step, n_params, info = setup_torch(a, shape, device)
    rank0 = info["rank"] == 0
    n_matmul = n_params - T * d
    flops_per_token = 6.0 * n_matmul + 6.0 * L * d * T
    config = f"{a.preset} seq{T} batch{B}" + (" ckpt" if a.checkpointing else "") + (" offload" if a.offload else "")
    framework = FRAMEWORK_NAMES[a.framework]
    if rank0:
        print(f"torchops_gpt: {framework}{' compiled' if a.compile else ''}{' fp8' if a.fp8 else ''} | {config} | "
              f"world {info['world']} | "
              f"L{L} d{d} h{H} ff{ff} vocab {VOCAB} on {device} | {n_params / 1e6:.1f}M params | "
              f"{info['precision']} | {info['optimizer']} | torch {torch.__version__}", flush=True)

    gen = torch.Generator().manual_seed(a.seed + 1 + info["rank"])
    distinct = min(4, a.warmup + a.steps)
    batches = [torch.randint(0, VOCAB, (B, T + 1), generator=gen).to(device) for _ in range(distinct)]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    sync()
    t_setup = time.perf_counter() - t_start
    if bmt is not None:
        bmt.torch_ops.routed_counts(reset=True)
    losses, times = [], []
    t0 = time.perf_counter()
    for i in range(a.warmup):
        losses.append(step(batches[i % distinct]))
    sync()
    t_warmup = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        if a.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200000)
    for i in range(a.steps):
        t0 = time.perf_counter()
        losses.append(step(batches[(a.warmup + i) % distinct]))
        sync()
        times.append(time.perf_counter() - t0)
    total = sum(times)
    srt = sorted(times)
    tokens_per_s = B * T * a.steps / total  # per rank
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    if cuda and a.memory_snapshot and rank0:
        torch.cuda.memory._dump_snapshot(a.memory_snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    if a.profile and rank0:
        profile_steps(a.profile, lambda i: step(batches[i % distinct]), sync, cuda)
    loss_first, loss_last = losses[0].item(), losses[-1].item()
    if not math.isfinite(loss_last):
        print(f"torchops_gpt: error: loss is not finite: {loss_last}", file=sys.stderr)
        return 1
    extra = {}
    if bmt is not None:
        counts = bmt.torch_ops.routed_counts()
        extra = {"routed_calls": counts, "routed_ops": sorted(bmt.torch_ops.routed_ops()),
                 "step_in_backward": bool(manager.step_in_backward_active),
                 "recompute_tail": dict(bmt.recompute_tail.counts)}
    mfu = tokens_per_s * flops_per_token / PEAK_FLOPS if cuda else None
    if rank0:
        print(f"torchops_gpt: setup {t_setup:.1f} s, warm-up {a.warmup} steps {t_warmup:.1f} s; "
              f"loss {loss_first:.4f} -> {loss_last:.4f}" + (f"; {extra}" if extra else ""))
        print(f"RESULT framework={framework} config=\"{config}\"{' compile' if a.compile else ''}"
              f"{' fp8' if a.fp8 else ''} "
              f"tokens_per_s={tokens_per_s:.0f} step_s={total / a.steps:.4f} (median {srt[len(srt) // 2]:.4f}) "
              f"mfu={'n/a' if mfu is None else f'{100 * mfu:.4g}%'} "
              f"peak_gpu_gib={'n/a' if peak is None else f'{peak:.4g}'}", flush=True)
    if a.json and rank0:
        rec = {
            "bench": "train-torchops", "framework": framework, "config": config,
            "variant": a.variant or ("fp8 " if a.fp8 else "") + ("compile" if a.compile else "eager"),
            "compile": a.compile, "fp8": a.fp8,
            "fp8_recipe": (("bmt fp8_linear: per-tensor dynamic, E4M3 fwd, "
                            + (os.environ.get("BMT_FP8_GRAD") or "e5m2") + " grads")
                           if a.framework == "bmtrain" else "torchao float8 tensorwise") if a.fp8 else None,
            "tokens_per_s": tokens_per_s, "peak_gpu_gib": peak,
            "git_commit": git_commit(),
            "call_id": os.environ.get("BMT_CALL_ID", ""),
            "machine": machine(),
            "date": utc_now(),
            "world": info["world"], "mfu": mfu, "step_s": total / a.steps, "step_s_median": srt[len(srt) // 2],
            "preset": a.preset, "seq": T, "batch": B, "steps": a.steps, "warmup": a.warmup,
            "checkpointing": a.checkpointing, "offload": a.offload, "device": str(device), "params": n_params,
            "flops_per_token": flops_per_token, "loss_first": loss_first, "loss_last": loss_last,
            "precision": info["precision"], "optimizer": info["optimizer"], "torch": torch.__version__,
            "env": {k: v for k, v in os.environ.items() if k.startswith("BMT_") and k not in
                    ("BMT_GIT_COMMIT", "BMT_CALL_ID", "BMT_BENCH_MACHINE")},
            **extra,
        }
        append_rows(a.json, [rec])
    if a.framework == "fsdp2":
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
