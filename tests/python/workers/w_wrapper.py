"""BMTrainModelWrapper and bmt.inspect against the unwrapped torch model.

Every rank builds the same plain torch model (same seed), wraps a second copy, and feeds its own micro-batch; the
reference replays every rank's batch (gradients are summed over ranks and OptimManager divides by the world size).
"""
import torch
import torch.nn.functional as F

import bmtrain as bmt
from common import assert_close, case, device, main, rank, world

D, V, B, T = 8, 11, 2, 5


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(D, D) for _ in range(3)])
        self.norm = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, V)

    def forward(self, ids, scale=1.0):
        h = self.emb(ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h)) * scale
        return self.head(self.norm(h))


def _ids(r, step):
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randint(0, V, (B, T), generator=g)


def _models():
    torch.manual_seed(7)
    ref = Plain().to(device())
    torch.manual_seed(7)
    wrapped = bmt.BMTrainModelWrapper(Plain().to(device()))
    return ref, wrapped


@case
def wrapper_logits_equal_unwrapped():
    ref, wrapped = _models()
    if not isinstance(wrapped.layers, bmt.TransformerBlockList):
        raise AssertionError(f"the repeated layers became {type(wrapped.layers).__name__}, not a TransformerBlockList")
    for name, p in wrapped.named_parameters():
        if not isinstance(p, bmt.DistributedParameter):
            raise AssertionError(f"parameter {name} is not a DistributedParameter after wrapping")
    ids = _ids(rank(), 0).to(device())
    assert_close("logits", wrapped(ids, scale=0.5), ref(ids, scale=0.5), rtol=1e-5, atol=1e-6)
    sd = wrapped.state_dict()
    want = ref.state_dict()
    if list(sd.keys()) != list(want.keys()):
        raise AssertionError(f"state_dict keys differ: {list(sd.keys())} vs {list(want.keys())}")
    for k in want:
        assert_close(f"state_dict[{k}]", sd[k], want[k].cpu(), rtol=0, atol=0)


@case
def wrapper_trains_like_torch_adam():
    ref, wrapped = _models()
    opt = bmt.optim.AdamOptimizer(wrapped.parameters(), lr=1e-2)
    om = bmt.optim.OptimManager(loss_scale=None)
    om.add_optimizer(opt)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(3):
        om.zero_grad()
        ref_opt.zero_grad()
        loss = F.cross_entropy(wrapped(_ids(rank(), step).to(device())).reshape(-1, V),
                               _ids(rank(), step + 50).to(device()).reshape(-1))
        om.backward(loss)
        om.step()
        ref_loss = sum(F.cross_entropy(ref(_ids(r, step).to(device())).reshape(-1, V),
                                       _ids(r, step + 50).to(device()).reshape(-1)) for r in range(world())) / world()
        ref_loss.backward()
        ref_opt.step()
    sd = wrapped.state_dict()
    for k, v in ref.state_dict().items():
        assert_close(f"after 3 steps: {k}", sd[k], v.cpu(), rtol=1e-4, atol=1e-5)


@case
def inspect_model_gathers_shards():
    ref, wrapped = _models()
    ids = _ids(rank(), 1).to(device())
    wrapped(ids).sum().backward()
    ref_grads = {}
    for r in range(world()):
        ref.zero_grad()
        ref(_ids(r, 1).to(device())).sum().backward()
        for n, p in ref.named_parameters():
            ref_grads[n] = ref_grads.get(n, 0) + p.grad.detach().clone()
    rows = {row["name"]: row for row in bmt.inspect.inspect_model(wrapped, "layers.*")}
    if sorted(rows) != sorted(n for n, _ in ref.named_parameters() if n.startswith("layers.")):
        raise AssertionError(f"inspect_model('layers.*') returned {sorted(rows)}")
    for n, p in ref.named_parameters():
        if n not in rows:
            continue
        full, g = p.detach().float(), ref_grads[n].float()
        for stat, want in (("mean", full.mean()), ("min", full.min()), ("max", full.max()),
                           ("std", full.std()), ("grad_mean", g.mean()), ("grad_std", g.std())):
            got = rows[n][stat]
            if abs(got - want.item()) > 1e-5 * max(1.0, abs(want.item())):
                raise AssertionError(f"inspect_model {n} {stat}: {got} vs {want.item()}")
    text = bmt.inspect.format_summary(list(rows.values()))
    if "layers.0.weight" not in text:
        raise AssertionError(f"format_summary lacks the parameter names:\n{text}")


if __name__ == "__main__":
    main()
