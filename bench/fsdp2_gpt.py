#!/usr/bin/env python3
"""fsdp2_gpt.py: the benchmark's GPT trained with PyTorch FSDP2 (``fully_shard``), one process (world size 1).

The PyTorch FSDP2 row of BENCHMARKS.md / peers.md: the same GPT as bmt-bench-train (pre-LN, learned positions,
tied embeddings, GELU-tanh MLP, SDPA causal attention, vocab 50304, init normal(0.02), biases 0, LayerNorm 1/0,
fp32 cross-entropy), every block and the root wrapped with ``fully_shard`` under
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (fp32 sharded parameters = master weights, bf16
compute), ``torch.optim.AdamW(fused=True)`` (lr 3e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1), random
tokens. ``--checkpointing`` recomputes every block (torch.utils.checkpoint, non-reentrant) inside its
``fully_shard`` unit, as torchtitan does. ``--zero 2`` keeps parameters gathered between forward and backward
(``reshard_after_forward=False``).

Timing, MFU and the JSON line are those of bmt-bench-train (see bench/bench_train.cpp): W warm-up steps, N timed
steps each followed by a synchronisation; tokens/s = N*B*T / sum(step times); MFU = tokens/s * (6*N_matmul +
6*L*d*T) / 989e12 (N_matmul = parameters except the position table); peak_gpu_gib =
torch.cuda.max_memory_allocated() / 2**30 over the whole run.

  python3 bench/fsdp2_gpt.py --preset gpt2-124m --seq 1024 --batch 16 --steps 10 --warmup 3 [--json PATH]
  python3 bench/fsdp2_gpt.py --device cpu --preset tiny --steps 3      # gloo on CPU (smoke test)
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from bench_rows import append_rows, free_port, git_commit, machine, utc_now  # (bench/: the script's folder)

PEAK_FLOPS = 989e12
VOCAB = 50304
# name: (layers, dim, heads, ffn, seq, default batch) -- examples/models/presets.cpp, plus peers.md's 6.7B GPT
PRESETS = {
    "tiny": (2, 64, 4, 256, 64, 32),
    "gpt2-124m": (12, 768, 12, 3072, 1024, 16),
    "gpt-1.3b": (24, 2048, 16, 8192, 2048, 8),
    "gpt-6.7b": (32, 4096, 32, 16384, 2048, 2),
}


class Block(nn.Module):
    def __init__(self, dim, heads, ffn, eps, checkpointing):
        super().__init__()
        self.heads = heads
        self.checkpointing = checkpointing
        self.ln_1 = nn.LayerNorm(dim, eps=eps)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.attn_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim, eps=eps)
        self.c_fc = nn.Linear(dim, ffn)
        self.mlp_proj = nn.Linear(ffn, dim)

    def _forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    def forward(self, x):
        if self.checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False, preserve_rng_state=False)
        return self._forward(x)


class GPT(nn.Module):
    def __init__(self, layers, dim, heads, ffn, seq, checkpointing, eps=1e-5):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, ffn, eps, checkpointing) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim, eps=eps)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    m.weight.normal_(0.0, 0.02)
                if isinstance(m, nn.Linear):
                    m.bias.zero_()

    def forward(self, idx):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied output projection


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seq", type=int, default=0)
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--zero", type=int, default=3, choices=(2, 3))
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--json", default="")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-fused", action="store_true", help="foreach AdamW instead of fused")
    ap.add_argument("--build-only", action="store_true", help="build and shard the model, no training")
    a = ap.parse_args()
    if a.steps < 1 or a.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")

    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

    cuda = torch.cuda.is_available() and a.device != "cpu"
    if a.device == "cuda" and not cuda:
        sys.exit("fsdp2_gpt: --device cuda but no CUDA device")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    L, d, H, ff, seq, default_batch = PRESETS[a.preset]
    T = a.seq or seq
    B = a.batch or default_batch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    kw = {"device_id": device} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, **kw)
    mesh = init_device_mesh(device.type, (1,))

    t_start = time.perf_counter()
    torch.manual_seed(a.seed)
    with device:
        model = GPT(L, d, H, ff, T, a.checkpointing)
    n_params = sum(p.numel() for p in model.parameters())
    n_matmul = n_params - model.wpe.weight.numel()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reshard = a.zero == 3
    for b in model.blocks:
        fully_shard(b, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fused = not a.no_fused

    def make_opt(fused_):
        extra = {"fused": True} if fused_ else {"foreach": True}
        return torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **extra)

    opt = make_opt(fused)
    flops_per_token = 6.0 * n_matmul + 6.0 * L * d * T
    config = f"{a.preset} seq{T} batch{B}" + ("" if a.zero == 3 else " zero2") + (" ckpt" if a.checkpointing else "")
    print(f"fsdp2_gpt: fsdp2 | {config} | gpt L{L} d{d} h{H} ff{ff} vocab{VOCAB} seq{T} on {device} | "
          f"{n_params / 1e6:.1f}M params ({n_matmul / 1e6:.1f}M matmul), {flops_per_token / 1e9:.3g} GFLOP/token | "
          f"fp32 sharded params, bf16 compute, fp32 reduce | AdamW({'fused' if fused else 'foreach'}) | "
          f"torch {torch.__version__}", flush=True)
    if a.build_only:
        dist.destroy_process_group()
        return 0

    torch.manual_seed(a.seed + 1)
    distinct = min(4, a.warmup + a.steps)
    batches = [torch.randint(0, VOCAB, (B, T + 1), device=device) for _ in range(distinct)]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step(tokens):
        nonlocal opt, fused
        logits = model(tokens[:, :T])
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        try:
            opt.step()
        except RuntimeError as e:  # fused AdamW unsupported for these parameters: fall back once
            if not fused:
                raise
            print(f"fsdp2_gpt: fused AdamW failed ({str(e)[:200]}); using foreach", flush=True)
            fused = False
            opt = make_opt(False)
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    sync()
    t_setup = time.perf_counter() - t_start
    losses = []
    t0 = time.perf_counter()
    for i in range(a.warmup):
        losses.append(step(batches[i % distinct]))
        sync()
    t_warmup = time.perf_counter() - t0
    times = []
    for i in range(a.steps):
        t0 = time.perf_counter()
        losses.append(step(batches[(a.warmup + i) % distinct]))
        sync()
        times.append(time.perf_counter() - t0)
    total = sum(times)
    step_s = total / len(times)
    srt = sorted(times)
    median_s = srt[len(srt) // 2]
    tokens_per_s = B * T * a.steps / total
    mfu = tokens_per_s * flops_per_token / PEAK_FLOPS if cuda else None
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    peak_reserved = torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None
    loss_first, loss_last = losses[0].item(), losses[-1].item()
    if not math.isfinite(loss_last):
        print(f"fsdp2_gpt: error: loss is not finite: {loss_last}", file=sys.stderr)
        return 1
    try:
        import resource
        host_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    except Exception:  # noqa: BLE001
        host_peak = None
    print(f"fsdp2_gpt: setup {t_setup:.1f} s, warm-up {a.warmup} steps {t_warmup:.1f} s; "
          f"loss {loss_first:.4f} -> {loss_last:.4f}")
    print(f"RESULT framework=fsdp2 config=\"{config}\" tokens_per_s={tokens_per_s:.0f} step_s={step_s:.4f} "
          f"(median {median_s:.4f}, min {srt[0]:.4f}, max {srt[-1]:.4f}) "
          f"mfu={'n/a' if mfu is None else f'{100 * mfu:.4g}%'} "
          f"peak_gpu_gib={'n/a' if peak is None else f'{peak:.4g}'} "
          f"(reserved {'n/a' if peak_reserved is None else f'{peak_reserved:.4g}'})", flush=True)
    if a.json:
        rec = {
            "bench": "train", "config": config, "framework": "fsdp2", "world": 1,
            "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_gpu_gib": peak, "step_s": step_s,
            "git_commit": git_commit(),
            "machine": machine(),
            "date": utc_now(),
            "preset": a.preset, "arch": "gpt", "seq": T, "batch": B, "steps": a.steps, "warmup": a.warmup,
            "checkpointing": a.checkpointing, "offload": False, "zero": a.zero, "device": str(device),
            "params": n_params, "matmul_params": n_matmul, "flops_per_token": flops_per_token,
            "step_s_median": median_s, "peak_reserved_gib": peak_reserved, "host_peak_gib": host_peak,
            "loss_first": loss_first, "loss_last": loss_last,
            "precision": "fp32 sharded params, bf16 compute, fp32 reduce",
            "optimizer": "torch.optim.AdamW(fused)" if fused else "torch.optim.AdamW(foreach)",
            "torch": torch.__version__,
        }
        append_rows(a.json, [rec])
        print(f"fsdp2_gpt: appended to {a.json}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
