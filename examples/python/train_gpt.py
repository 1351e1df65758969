"""A GPT trained with the `bmtrain` package, written the way a BMTrain user writes it.

Layers are bmt.DistributedModule's holding bmt.DistributedParameter's; the transformer blocks run in a
bmt.TransformerBlockList (ZeRO-3 sharded, each block gathered just in time, activations checkpointed); Adam (or
offloaded Adam) under bmt.optim.OptimManager with a Noam schedule; bmt.loss.FusedCrossEntropy.

  CPU ranks:  torchrun --standalone --nproc_per_node 2 examples/python/train_gpt.py
  one GPU:    torchrun --standalone --nproc_per_node 1 examples/python/train_gpt.py --preset gpt2-124m --json
The built-in data is fixed-width decimal addition ("ab+cd=sss;", the sum written least-significant digit
first), the task the C++ example trains on: a tiny model visibly learns it in a minute on 2 CPU ranks.
"""
import argparse
import json
import math
import os
import resource
import sys
import time

import torch
import torch.nn.functional as F

import bmtrain as bmt

# name: layers, dim, heads, ff, vocab, seq, per-rank batch, steps, peak lr, warmup
PRESETS = {
    "tiny": dict(layers=2, dim=64, heads=4, ff=256, vocab=13, seq=64, batch=16, steps=600, lr=1e-2, warmup=50),
    "gpt2-124m": dict(layers=12, dim=768, heads=12, ff=3072, vocab=50304, seq=1024, batch=16, steps=5000,
                      lr=6e-4, warmup=200),
    "gpt-1.3b": dict(layers=24, dim=2048, heads=16, ff=8192, vocab=50304, seq=2048, batch=8, steps=5000,
                     lr=2e-4, warmup=200),
}
PEAK_BF16_FLOPS = 989e12  # H200 dense bf16, for the MFU column


# ------------------------------------------------------------------------------------------------------ model

class LayerNorm(bmt.DistributedModule):
    def __init__(self, dim, dtype, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = bmt.DistributedParameter(torch.ones(dim, dtype=dtype),
                                               init_method=bmt.ParameterInitializer(torch.nn.init.ones_))
        self.bias = bmt.DistributedParameter(torch.zeros(dim, dtype=dtype),
                                             init_method=bmt.ParameterInitializer(torch.nn.init.zeros_))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class Attention(bmt.DistributedModule):
    def __init__(self, dim, heads, dtype):
        super().__init__()
        self.heads = heads
        self.qkv = bmt.nn.Linear(dim, 3 * dim, dtype=dtype)
        self.out = bmt.nn.Linear(dim, dim, dtype=dtype)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class FeedForward(bmt.DistributedModule):
    def __init__(self, dim, ff, dtype):
        super().__init__()
        self.w_in = bmt.nn.Linear(dim, ff, dtype=dtype)
        self.w_out = bmt.nn.Linear(ff, dim, dtype=dtype)

    def forward(self, x):
        return self.w_out(F.gelu(self.w_in(x), approximate="tanh"))


class TransformerBlock(bmt.DistributedModule):
    """Pre-LN: x + attn(ln(x)), then + ff(ln(x))."""

    def __init__(self, dim, heads, ff, dtype):
        super().__init__()
        self.ln_attn = LayerNorm(dim, dtype)
        self.attn = Attention(dim, heads, dtype)
        self.ln_ff = LayerNorm(dim, dtype)
        self.ff = FeedForward(dim, ff, dtype)

    def forward(self, x):
        x = x + self.attn(self.ln_attn(x))
        return x + self.ff(self.ln_ff(x))


class GPT(bmt.DistributedModule):
    def __init__(self, layers, dim, heads, ff, vocab, seq, dtype, use_checkpoint=True):
        super().__init__()
        normal = bmt.ParameterInitializer(torch.nn.init.normal_, mean=0.0, std=0.02)
        self.word_emb = bmt.DistributedParameter(torch.empty(vocab, dim, dtype=dtype), init_method=normal)
        self.pos_emb = bmt.DistributedParameter(torch.empty(seq, dim, dtype=dtype),
                                                init_method=bmt.ParameterInitializer(torch.nn.init.normal_, std=0.01))
        self.layers = bmt.TransformerBlockList(
            [bmt.Block(TransformerBlock(dim, heads, ff, dtype), use_checkpoint=use_checkpoint) for _ in range(layers)])
        self.ln_f = LayerNorm(dim, dtype)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = F.embedding(ids, self.word_emb) + F.embedding(pos, self.pos_emb)[None]
        x = self.ln_f(self.layers(x))
        return F.linear(x, self.word_emb)  # tied output projection


def count_params(model):
    return sum(math.prod(getattr(p, "_original_shape", p.shape)) for p in model.parameters())


# ------------------------------------------------------------------------------------------------------- data

class Addition:
    """Rows of random "ab+cd=sss;" examples (digits '0'-'9' -> 0-9, '+' 10, '=' 11, ';' 12)."""
    vocab = 13

    def __init__(self, seed, digits=2):
        self.seed, self.digits = seed, digits

    def example(self, a, b):
        s = str(a + b).zfill(self.digits + 1)[::-1]  # least-significant digit first
        text = f"{a:0{self.digits}d}+{b:0{self.digits}d}={s};"
        return [int(c) if c.isdigit() else {"+": 10, "=": 11, ";": 12}[c] for c in text]

    def batch(self, step, rank, rows, seq):
        """(rows, seq + 1) tokens; different for every (step, rank), the same on every run."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + rank)
        limit = 10 ** self.digits
        n_ex = (seq + 1) // (3 * self.digits + 4) + 2
        ab = torch.randint(0, limit, (rows, n_ex, 2), generator=g).tolist()
        out = [sum((self.example(a, b) for a, b in r), [])[:seq + 1] for r in ab]
        return torch.tensor(out, dtype=torch.long)


# ---------------------------------------------------------------------------------------------------- logging

def fmt_duration(s):
    s = int(s + 0.5)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def peak_mem_mib(dev):
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def json_value(v):
    return None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v


# ------------------------------------------------------------------------------------------------------- main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, help="optimizer steps (default: the preset's)")
    ap.add_argument("--batch", type=int, help="rows per rank per step (default: the preset's)")
    ap.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    ap.add_argument("--lr", type=float, help="peak learning rate, reached at the end of warm-up; Noam's start_lr "
                                             "is lr * sqrt(warmup) (default: the preset's)")
    ap.add_argument("--warmup", type=int, help="Noam warm-up steps (default: the preset's)")
    ap.add_argument("--vocab", type=int, help="vocabulary size (default: the preset's; 50257 for GPT-2's own)")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--dim", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--ff", type=int)
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                    help="parameter dtype (auto: bf16 on GPUs, fp32 on CPUs)")
    ap.add_argument("--offload", action="store_true", help="AdamOffloadOptimizer (Adam states in host memory)")
    ap.add_argument("--no-checkpoint", action="store_true", help="keep activations (no recompute in backward)")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm (0: off, norm still logged)")
    ap.add_argument("--loss-scale", type=float, default=1024.0,
                    help="initial dynamic loss scale (0: none; with --offload, 0 also overlaps the CPU Adam with the backward)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--metrics", default="runs/metrics_python.jsonl", help="JSONL metrics file ('' for none)")
    ap.add_argument("--log-every", type=int, default=0, help="progress line period (0: about 30 lines)")
    ap.add_argument("--json", action="store_true", help="print one JSON summary line at the end (benchmarks)")
    args = ap.parse_args(argv)
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    return args


def main(argv=None):
    args = parse_args(argv)
    bmt.init_distributed(seed=args.seed)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(
        args.dtype, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    data = Addition(args.seed)
    vocab = max(args.vocab, data.vocab)

    model = GPT(args.layers, args.dim, args.heads, args.ff, vocab, args.seq, dtype, not args.no_checkpoint)
    bmt.init_parameters(model)
    n_params = count_params(model)
    opt_cls = bmt.optim.AdamOffloadOptimizer if args.offload else bmt.optim.AdamOptimizer
    opt = opt_cls(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    sched = bmt.lr_scheduler.Noam(opt, start_lr=args.lr * math.sqrt(args.warmup), warmup_iter=args.warmup,
                                  end_iter=args.steps, num_iter=0)
    om = bmt.optim.OptimManager(loss_scale=args.loss_scale)
    om.add_optimizer(opt, sched)
    # Offload without loss scaling: each Block's CPU Adam update starts as soon as its gradients are reduced, while
    # the rest of the backward runs (refused under loss scaling, whose skipped steps could not undo an early update).
    overlap = om.overlap_offload_with_backward() if args.offload and not args.loss_scale else None  # noqa: F841
    loss_fn = bmt.loss.FusedCrossEntropy(ignore_index=-100)

    rank, world = bmt.rank(), bmt.world_size()
    log_every = args.log_every or max(1, args.steps // 30)
    metrics = None
    if rank == 0:
        bmt.print_rank(f"GPT {args.preset}: {n_params / 1e6:.2f}M parameters, {args.layers} layers x {args.dim}, "
                       f"{args.heads} heads, vocab {vocab}, seq {args.seq}, batch {args.batch}/rank x {world} ranks, "
                       f"{str(dtype).replace('torch.', '')} on {dev.type}, "
                       f"{'offloaded ' if args.offload else ''}Adam, peak lr {args.lr:g}", flush=True)
        if args.metrics:
            os.makedirs(os.path.dirname(args.metrics) or ".", exist_ok=True)
            metrics = open(args.metrics, "w")
    tokens_per_step = args.batch * args.seq * world
    # bench/bench_train.cpp's MFU: 6 * (parameters except the position table) + 6 * L * d * T per token.
    flops_per_token = 6 * (n_params - args.seq * args.dim) + 6 * args.layers * args.dim * args.seq
    t_begin = time.time()
    timed_tokens, timed_s, skip_timing = 0, 0.0, min(3, args.steps // 4)
    first_loss = last_loss = None
    rows = data.batch(0, rank, args.batch, args.seq).to(dev)
    for step in range(args.steps):
        t0 = time.time()
        lr = opt.param_groups[0]["lr"]
        om.zero_grad()
        logits = model(rows[:, :-1])
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
        om.backward(loss)
        grad_norm = om.clip_grad_norm(opt.param_groups, args.clip if args.clip > 0 else float("inf"))
        om.step()
        mean_loss = bmt.distributed.all_reduce(loss.detach().float().reshape(1), "avg").item()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.time() - t0  # the step only: the next batch is made below, outside the timing
        if step + 1 < args.steps:
            rows = data.batch(step + 1, rank, args.batch, args.seq).to(dev)
        if step >= skip_timing:
            timed_tokens, timed_s = timed_tokens + tokens_per_step, timed_s + dt
        first_loss = mean_loss if first_loss is None else first_loss
        last_loss = mean_loss
        if rank != 0:
            continue
        tok_s = tokens_per_step / dt
        mfu = flops_per_token * tok_s / world / PEAK_BF16_FLOPS if dev.type == "cuda" else None
        mem = peak_mem_mib(dev)
        if metrics:
            fields = dict(step=step + 1, loss=mean_loss, lr=lr, grad_norm=float(grad_norm), tokens_per_s=tok_s,
                          step_ms=1e3 * dt, mfu=mfu, mem_mib=int(mem), elapsed_s=time.time() - t_begin)
            metrics.write(json.dumps({k: json_value(v) for k, v in fields.items()}) + "\n")
            metrics.flush()
        if (step + 1) % log_every == 0 or step == 0 or step + 1 == args.steps:
            eta = (time.time() - t_begin) / (step + 1) * (args.steps - step - 1)
            mfu_s = f" MFU {100 * mfu:.1f}%" if mfu is not None else ""
            print(f"step {step + 1}/{args.steps} loss {mean_loss:.4f} lr {lr:.2e} {tok_s / 1e3:.1f}k tok/s{mfu_s} "
                  f"mem {mem:.0f}MiB eta {fmt_duration(eta)}", flush=True)
    if metrics:
        metrics.close()
    if rank == 0 and args.json:
        tok_s = timed_tokens / timed_s if timed_s > 0 else None
        print(json.dumps(dict(preset=args.preset, params=n_params, world=world, steps=args.steps, batch=args.batch,
                              seq=args.seq, dtype=str(dtype).replace("torch.", ""), offload=args.offload,
                              tokens_per_s=tok_s, peak_mem_mib=round(peak_mem_mib(dev), 1),
                              mfu=flops_per_token * tok_s / world / PEAK_BF16_FLOPS if tok_s and dev.type == "cuda"
                              else None,
                              first_loss=first_loss, final_loss=last_loss,
                              elapsed_s=round(time.time() - t_begin, 2))), flush=True)
    bmt.synchronize()


if __name__ == "__main__":
    sys.exit(main())
