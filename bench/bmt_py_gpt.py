"""GPT training throughput through the Python package bmtrain (the model written as a BMTrain user writes it).

Same model, shapes, data and JSON record as bench/fsdp2_gpt.py and bmt-bench-train (presets, vocab 50304, tied
output projection, GELU-tanh MLP, SDPA attention): bf16 DistributedParameters with fp32 gradient shards, every layer
a ZeRO-3 Block in a TransformerBlockList, bmt.optim.AdamOptimizer (or AdamOffloadOptimizer) under OptimManager,
the fused in-place cross-entropy. Launch with torchrun for several GPUs; alone it runs world 1.

  python3 bench/bmt_py_gpt.py --preset gpt-1.3b --seq 2048 --batch 8 --steps 5 --warmup 2 [--checkpointing]
      [--offload] [--json PATH]
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

import bmtrain as bmt
from bench_rows import append_rows, git_commit, machine, utc_now  # (bench/: the script's folder)

PEAK_FLOPS = 989e12
VOCAB = 50304
PRESETS = {  # name: (layers, dim, heads, ffn, seq, default batch), as bench/fsdp2_gpt.py
    "tiny": (2, 64, 4, 256, 64, 32),
    "gpt2-124m": (12, 768, 12, 3072, 1024, 16),
    "gpt-1.3b": (24, 2048, 16, 8192, 2048, 8),
    "gpt-6.7b": (32, 4096, 32, 16384, 2048, 2),
}
NORMAL = bmt.ParameterInitializer(torch.nn.init.normal_, mean=0.0, std=0.02)


def param(shape, dtype, init=NORMAL):
    return bmt.DistributedParameter(torch.empty(shape, dtype=dtype), init_method=init)


class Linear(bmt.DistributedModule):
    def __init__(self, fin, fout, dtype):
        super().__init__()
        self.weight = param((fout, fin), dtype)
        self.bias = param((fout,), dtype, torch.nn.init.zeros_)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class LayerNorm(bmt.DistributedModule):
    def __init__(self, dim, dtype, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = param((dim,), dtype, torch.nn.init.ones_)
        self.bias = param((dim,), dtype, torch.nn.init.zeros_)

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class Layer(bmt.DistributedModule):
    def __init__(self, dim, heads, ffn, dtype):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = LayerNorm(dim, dtype), LayerNorm(dim, dtype)
        self.c_attn, self.attn_proj = Linear(dim, 3 * dim, dtype), Linear(dim, dim, dtype)
        self.c_fc, self.mlp_proj = Linear(dim, ffn, dtype), Linear(ffn, dim, dtype)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(bmt.DistributedModule):
    def __init__(self, layers, dim, heads, ffn, seq, dtype, checkpointing):
        super().__init__()
        self.wte = param((VOCAB, dim), dtype)
        self.wpe = param((seq, dim), dtype)
        self.blocks = bmt.TransformerBlockList(
            [bmt.Block(Layer(dim, heads, ffn, dtype), use_checkpoint=checkpointing) for _ in range(layers)])
        self.ln_f = LayerNorm(dim, dtype)

    def forward(self, idx):
        T = idx.size(1)
        wte = self.wte  # one gather, used by the lookup and the tied projection
        x = F.embedding(idx, wte) + self.wpe[:T]
        x = self.blocks(x)
        return F.linear(self.ln_f(x), wte)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seq", type=int, default=0)
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--offload", action="store_true", help="AdamOffloadOptimizer (bf16 gradient transfer, async)")
    ap.add_argument("--json", default="")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    if a.steps < 1 or a.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    bmt.init_distributed(seed=a.seed, quiet=True)
    device = bmt.config["device"]
    cuda = device.type == "cuda"
    L, d, H, ff, seq, default_batch = PRESETS[a.preset]
    T, B = a.seq or seq, a.batch or default_batch
    dtype = torch.bfloat16 if cuda else torch.float32

    t_start = time.perf_counter()
    model = GPT(L, d, H, ff, T, dtype, a.checkpointing)
    bmt.init_parameters(model)
    n_params = sum(p._tp_original_shape.numel() for p in model.parameters())
    n_matmul = n_params - T * d
    if a.offload:
        opt = bmt.optim.AdamOffloadOptimizer(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                             async_step=True, grad_transfer_dtype=torch.bfloat16,
                                             decoupled_weight_decay=True)
    else:  # AdamW for every dtype (fp32 parameters default to BMTrain's L2 weight decay)
        opt = bmt.optim.AdamOptimizer(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                      decoupled_weight_decay=True)
    manager = bmt.optim.OptimManager(loss_scale=None)
    manager.add_optimizer(opt)
    overlap = manager.overlap_offload_with_backward() if a.offload else None  # noqa: F841  (kept for the run)
    loss_fn = bmt.loss.FusedCrossEntropy(inplace=True)
    flops_per_token = 6.0 * n_matmul + 6.0 * L * d * T
    world = bmt.world_size()
    config = f"{a.preset} seq{T} batch{B}" + (" ckpt" if a.checkpointing else "") + (" offload" if a.offload else "")
    bmt.print_rank(f"bmt_py_gpt: bmtrain (Python) | {config} | world {world} | gpt L{L} d{d} h{H} ff{ff} vocab "
                   f"{VOCAB} seq{T} on {device} | {n_params / 1e6:.1f}M params | {dtype} params, fp32 grads | "
                   f"torch {torch.__version__}", flush=True)

    gen = torch.Generator(device="cpu").manual_seed(a.seed + 1 + bmt.rank())
    distinct = min(4, a.warmup + a.steps)
    batches = [torch.randint(0, VOCAB, (B, T + 1), generator=gen).to(device) for _ in range(distinct)]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step(tokens):
        manager.zero_grad()
        logits = model(tokens[:, :T])
        loss = loss_fn(logits.view(-1, VOCAB), tokens[:, 1:].reshape(-1))
        manager.backward(loss)
        manager.step()
        return loss.detach()

    sync()
    t_setup = time.perf_counter() - t_start
    losses, times = [], []
    for i in range(a.warmup):
        losses.append(step(batches[i % distinct]))
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(a.steps):
        t0 = time.perf_counter()
        losses.append(step(batches[(a.warmup + i) % distinct]))
        sync()
        times.append(time.perf_counter() - t0)
    total = sum(times)
    srt = sorted(times)
    tokens_per_s = B * T * a.steps / total  # per GPU
    mfu = tokens_per_s * flops_per_token / PEAK_FLOPS if cuda else None
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    loss_first, loss_last = losses[0].item(), losses[-1].item()
    if not math.isfinite(loss_last):
        print(f"bmt_py_gpt: error: loss is not finite: {loss_last}", file=sys.stderr)
        return 1
    bmt.print_rank(f"bmt_py_gpt: setup {t_setup:.1f} s; loss {loss_first:.4f} -> {loss_last:.4f}")
    bmt.print_rank(f"RESULT framework=bmt-python config=\"{config}\" tokens_per_s={tokens_per_s:.0f} "
                   f"step_s={total / a.steps:.4f} (median {srt[len(srt) // 2]:.4f}) "
                   f"mfu={'n/a' if mfu is None else f'{100 * mfu:.4g}%'} "
                   f"peak_gpu_gib={'n/a' if peak is None else f'{peak:.4g}'}", flush=True)
    if a.json and bmt.rank() == 0:
        rec = {
            "bench": "train", "config": config, "framework": "bmt-python", "world": world,
            "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_gpu_gib": peak, "step_s": total / a.steps,
            "git_commit": git_commit(),
            "machine": machine(),
            "date": utc_now(),
            "preset": a.preset, "arch": "gpt", "seq": T, "batch": B, "steps": a.steps, "warmup": a.warmup,
            "checkpointing": a.checkpointing, "offload": a.offload, "zero": 3, "device": str(device),
            "params": n_params, "flops_per_token": flops_per_token, "step_s_median": srt[len(srt) // 2],
            "loss_first": loss_first, "loss_last": loss_last, "torch": torch.__version__,
            "precision": f"{dtype} params, fp32 master and grads",
            "optimizer": "bmt.optim.AdamOffloadOptimizer" if a.offload else "bmt.optim.AdamOptimizer",
        }
        append_rows(a.json, [rec])
    return 0


if __name__ == "__main__":
    sys.exit(main())
