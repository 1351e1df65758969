"""BMTrain's example/train.py logic at tp 2, written as a BMTrain user writes it (our code, not BMTrain's files): a
small GPT whose word embedding is a VPEmbedding (each tp rank embeds its chunk of the sequence; the output projection
is its vocabulary slice, trained with FusedCrossEntropy(parallel=True)), attention with ColumnParallelLinear Q/K/V
fused through OpParallelLinear (gather_input, as BMTrain's example) and a RowParallelLinear output, a
ColumnParallelLinear -> RowParallelLinear feed-forward, in Blocks of a TransformerBlockList; AdamOptimizer and
OptimManager. Against the same model unsplit in plain torch (torch.optim.Adam): the loss of every step and every
parameter's gradient (the unsplit tensors), over a few steps. World 2 (tp 2) and world 4 (dp 2 x tp 2, each data-
parallel rank its own batch).

The tp model keeps activations in BMTrain's sequence-parallel layout: (B, S/tp, D) on tp rank r holding positions
[r S/tp, (r+1) S/tp). OpParallelLinear(gather_input) and the projection give the gathered rows rank-major; where the
attention needs whole sequences the model reorders them (BMTrain's example views them as (B, S, ·), which is the
sequence order only for batch 1), and the targets are put in the projection's row order.
"""
import math

import torch
import torch.nn.functional as F

import bmtrain as bmt
from common import assert_close, case, device, main, rank
from tp_util import logical_grad

V, D, HEADS, DH, FF, LAYERS, B, S = 32, 16, 4, 4, 32, 2, 2, 8
STEPS, LR = 3, 1e-2


def _attention(q, k, v, dh):
    """Causal attention over (B, S, h * dh) -> (B, S, h * dh)."""
    b, s, _ = q.shape
    q, k, v = (t.view(b, s, -1, dh).transpose(1, 2) for t in (q, k, v))
    score = q @ k.transpose(-1, -2) / math.sqrt(dh)
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    score = score.masked_fill(~causal, float("-inf")).softmax(-1)
    return (score @ v).transpose(1, 2).reshape(b, s, -1)


# --------------------------------------------------------------------------------- the model, as a BMTrain user

class Embedding(bmt.DistributedModule):
    def __init__(self, n, dim):
        super().__init__()
        self.weight = bmt.DistributedParameter(torch.empty(n, dim), init_method=torch.nn.init.normal_)

    def forward(self, ids):
        return F.embedding(ids, self.weight)


class Layernorm(bmt.DistributedModule):
    def __init__(self, dim):
        super().__init__()
        self.weight = bmt.DistributedParameter(torch.empty(dim), init_method=torch.nn.init.ones_)
        self.bias = bmt.DistributedParameter(torch.empty(dim), init_method=torch.nn.init.zeros_)

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias)


class Attention(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.project_q = bmt.nn.ColumnParallelLinear(D, HEADS * DH, dtype=torch.float32, gather_input=False)
        self.project_k = bmt.nn.ColumnParallelLinear(D, HEADS * DH, dtype=torch.float32, gather_input=False)
        self.project_v = bmt.nn.ColumnParallelLinear(D, HEADS * DH, dtype=torch.float32, gather_input=False)
        self.project_out = bmt.nn.RowParallelLinear(HEADS * DH, D, dtype=torch.float32)

    def forward(self, x):  # (B, S/tp, D), this rank's positions
        tp = bmt.config["tp_size"]
        qkv = bmt.nn.OpParallelLinear.apply(
            x, torch.cat([self.project_q.weight, self.project_k.weight, self.project_v.weight], dim=0),
            torch.cat([self.project_q.bias, self.project_k.bias, self.project_v.bias], dim=0), True, False, False, None)
        b, s_local = x.shape[0], x.shape[1]
        qkv = qkv.view(tp, b, s_local, -1).transpose(0, 1).reshape(b, tp * s_local, -1)  # sequence order
        out = _attention(*qkv.chunk(3, dim=-1), DH)  # this rank's heads
        out = out.view(b, tp, s_local, -1).transpose(0, 1).reshape(tp * b, s_local, -1)  # rank-major rows again
        return self.project_out(out)  # reduce-scattered: (B, S/tp, D)


class Feedforward(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.w_in = bmt.nn.ColumnParallelLinear(D, FF, dtype=torch.float32)
        self.w_out = bmt.nn.RowParallelLinear(FF, D, dtype=torch.float32)

    def forward(self, x):
        return self.w_out(torch.relu(self.w_in(x)))


class TransformerEncoder(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.ln_attn, self.attn, self.ln_ff, self.ff = Layernorm(D), Attention(), Layernorm(D), Feedforward()

    def forward(self, hidden):
        hidden = hidden + self.attn(self.ln_attn(hidden))
        return hidden + self.ff(self.ln_ff(hidden)).view_as(hidden)


class GPT(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.word_emb = bmt.nn.VPEmbedding(V, D, dtype=torch.float32)
        self.pos_emb = Embedding(S, D)
        self.layers = bmt.TransformerBlockList([bmt.Block(TransformerEncoder()) for _ in range(LAYERS)])
        self.ln_f = Layernorm(D)

    def forward(self, ids, pos):  # (B, S) on every tp rank
        tp, r = bmt.config["tp_size"], bmt.config["tp_rank"]
        ids, pos = ids.chunk(tp, dim=1)[r], pos.chunk(tp, dim=1)[r]
        out = self.pos_emb(pos) + self.word_emb(ids)
        out = self.layers(out)
        return self.word_emb(self.ln_f(out), projection=True)  # (B, S, V/tp), rows rank-major


# ----------------------------------------------------------------------------------- the same model, unsplit

class RefLayernorm(torch.nn.LayerNorm):
    pass


class RefAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.project_q, self.project_k, self.project_v = (torch.nn.Linear(D, HEADS * DH) for _ in range(3))
        self.project_out = torch.nn.Linear(HEADS * DH, D)

    def forward(self, x):
        return self.project_out(_attention(self.project_q(x), self.project_k(x), self.project_v(x), DH))


class RefFeedforward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w_in, self.w_out = torch.nn.Linear(D, FF), torch.nn.Linear(FF, D)

    def forward(self, x):
        return self.w_out(torch.relu(self.w_in(x)))


class RefEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_attn, self.attn, self.ln_ff, self.ff = (torch.nn.LayerNorm(D), RefAttention(), torch.nn.LayerNorm(D),
                                                        RefFeedforward())

    def forward(self, hidden):
        hidden = hidden + self.attn(self.ln_attn(hidden))
        return hidden + self.ff(self.ln_ff(hidden))


class RefGPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.word_emb, self.pos_emb = torch.nn.Embedding(V, D), torch.nn.Embedding(S, D)
        self.layers = torch.nn.ModuleList([RefEncoder() for _ in range(LAYERS)])
        self.ln_f = torch.nn.LayerNorm(D)

    def forward(self, ids, pos):
        out = self.pos_emb(pos) + self.word_emb(ids)
        for layer in self.layers:
            out = layer(out)
        return F.linear(self.ln_f(out), self.word_emb.weight)


def _batch(d, step):
    """Data-parallel rank d's batch of a step (the same on its tp ranks): ids, positions, targets (-100 after each
    sample's length, as BMTrain's example masks them)."""
    g = torch.Generator().manual_seed(1000 * step + d)
    sent = torch.randint(0, V, (B, S + 1), generator=g)
    length = torch.randint(S // 2, S + 1, (B,), generator=g)
    targets = torch.where(torch.arange(S)[None, :] < length[:, None], sent[:, 1:], torch.full((B, S), -100))
    pos = torch.arange(S).repeat(B, 1)
    return sent[:, :-1].to(device()), pos.to(device()), targets.to(device())


@case
def gpt_tp2_equals_unsplit():
    tp, dp, d = bmt.config["tp_size"], bmt.config["tp_zero_size"], bmt.config["tp_zero_rank"]
    if tp != 2:
        raise AssertionError(f"launched with tp_size {tp}, expected 2")
    torch.manual_seed(3)
    model = GPT()
    bmt.init_parameters(model)
    ref = RefGPT().to(device())
    ref.load_state_dict({k: v.to(device()) for k, v in model.state_dict().items()})
    optimizer = bmt.optim.AdamOptimizer(model.parameters(), lr=LR, weight_decay=0)
    manager = bmt.optim.OptimManager(loss_scale=None, grad_scale=dp)  # gradients: the mean over data-parallel ranks
    manager.add_optimizer(optimizer)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR)
    loss_func = bmt.loss.FusedCrossEntropy(ignore_index=-100, parallel=True)
    for step in range(STEPS):
        ids, pos, targets = _batch(d, step)
        logits = model(ids, pos)
        if tuple(logits.shape) != (B, S, V // tp):
            raise AssertionError(f"logits shape {tuple(logits.shape)}, expected {(B, S, V // tp)}")
        # the projection's rows are rank-major (rank s's positions, every sample): targets in the same order
        tgt = torch.cat(list(targets.chunk(tp, dim=1)), dim=0).reshape(-1)
        loss = loss_func(logits.reshape(-1, V // tp), tgt)
        manager.zero_grad()
        manager.backward(loss)

        ref_opt.zero_grad()
        ref_losses = []
        for dd in range(dp):
            i, p, t = _batch(dd, step)
            ref_losses.append(F.cross_entropy(ref(i, p).reshape(-1, V), t.reshape(-1), ignore_index=-100))
        (sum(ref_losses) / dp).backward()
        assert_close(f"step {step}: loss (rank {rank()})", loss, ref_losses[d], rtol=1e-5, atol=1e-6)
        ref_params = dict(ref.named_parameters())
        names = [n for n, _ in model.named_parameters()]
        if sorted(names) != sorted(ref_params):
            raise AssertionError(f"parameter names differ: {sorted(names)} vs {sorted(ref_params)}")
        for name, p in model.named_parameters():
            assert_close(f"step {step}: grad {name}", logical_grad(p), ref_params[name].grad, rtol=1e-4, atol=2e-6)
        manager.step()
        ref_opt.step()
    for k, v in model.state_dict().items():
        # project_k.bias: its gradient is 0 in exact arithmetic (softmax ignores a shift shared by every key), so
        # Adam's normalised step turns rounding noise into updates of either sign; it changes no output.
        if not k.endswith("project_k.bias"):
            assert_close(f"after {STEPS} steps: {k}", v.to(device()), ref.state_dict()[k], rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
    main(dict(tp_size=2))
