"""Twin models: the same layer code built once over plain torch and once over bmtrain.

`make(kit)` defines every test layer with `kit.Module` as base class and `kit.param` for parameters, so the bmt
model and its plain-torch reference share one forward and hold identical values (both draw them from seeded CPU
generators). TORCH wraps blocks in nothing and block lists in RefBlockList (BMTrain's TransformerBlockList
semantics written in plain torch); BMT uses bmt.Block and bmt.TransformerBlockList.
"""
import types

import torch
import torch.nn.functional as F

import bmtrain as bmt
from common import randn

COUNTS = {}  # layer name -> forward calls (to see whether a block recomputed)


class RefBlockList(torch.nn.ModuleList):
    """TransformerBlockList's forward in plain torch: the first num_hidden args are threaded through the layers,
    the rest go to every layer; return_hidden_states appends each hidden's stacked per-layer inputs."""

    def __init__(self, modules, num_hidden=1):
        super().__init__(modules)
        self.num_hidden = num_hidden

    def forward(self, *args, return_hidden_states=False):
        nh = self.num_hidden
        hidden, rest = list(args[:nh]), args[nh:]
        stacks = [[] for _ in range(nh)]
        out = None
        for m in self:
            for i in range(nh):
                stacks[i].append(hidden[i])
            out = m(*hidden, *rest)
            out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            hidden = list(out[:nh])
        if return_hidden_states:
            return tuple(out) + tuple(torch.stack(s, 0) for s in stacks)
        return hidden[0] if nh == 1 else tuple(hidden)


def _torch_param(t, init_method=None):
    return torch.nn.Parameter(t.detach().clone())


def _bmt_param(t, init_method=None):
    return bmt.DistributedParameter(t.detach().clone(), init_method=init_method)


def _torch_param_bf16(t, init_method=None):
    return torch.nn.Parameter(t.detach().clone().to(torch.bfloat16))


def _bmt_param_bf16(t, init_method=None):
    return bmt.DistributedParameter(t.detach().clone().to(torch.bfloat16), init_method=init_method)


TORCH = types.SimpleNamespace(name="torch", Module=torch.nn.Module, param=_torch_param,
                              block=lambda m, **kw: m, blocklist=RefBlockList)
BMT = types.SimpleNamespace(name="bmt", Module=bmt.DistributedModule, param=_bmt_param,
                            block=lambda m, **kw: bmt.Block(m, **kw),
                            blocklist=lambda mods, num_hidden=1: bmt.TransformerBlockList(mods, num_hidden))

TORCH_BF16 = types.SimpleNamespace(**{**TORCH.__dict__, "name": "torch-bf16", "param": _torch_param_bf16})
BMT_BF16 = types.SimpleNamespace(**{**BMT.__dict__, "name": "bmt-bf16", "param": _bmt_param_bf16})


def make(kit):
    """Returns a namespace of layer classes built over `kit`."""
    P = kit.param

    class Linear(kit.Module):
        def __init__(self, fin, fout, seed, bias=True):
            super().__init__()
            self.weight = P(randn(fout, fin, seed=seed, scale=fin ** -0.5))
            self.bias = P(randn(fout, seed=seed + 1, scale=0.1)) if bias else None

        def forward(self, x):
            return F.linear(x, self.weight, self.bias)

    class Layer(kit.Module):
        """x + lin2(tanh(lin1(x))) * gain; returns a tensor."""

        def __init__(self, d, seed, name="layer"):
            super().__init__()
            self.lin1 = Linear(d, d, seed)
            self.lin2 = Linear(d, d, seed + 10)
            self.gain = P(1.0 + randn(d, seed=seed + 20, scale=0.1))
            self.tag = name

        def forward(self, x):
            COUNTS[self.tag] = COUNTS.get(self.tag, 0) + 1
            return x + self.lin2(torch.tanh(self.lin1(x))) * self.gain

    class TupleLayer(Layer):
        def forward(self, x):
            y = super().forward(x)
            return (y, y * 2 + x)

    class ListLayer(Layer):
        def forward(self, x):
            y = super().forward(x)
            return [y * (i + 1) + x * i for i in range(10)]

    class KwLayer(Layer):
        def forward(self, x, scale=1.0, *, shift=None):
            y = super().forward(x) * scale
            return y if shift is None else y + shift

    class Hidden2Layer(kit.Module):
        """Two hidden states threaded through, a context passed unchanged to every layer."""

        def __init__(self, d, seed):
            super().__init__()
            self.lin1 = Linear(d, d, seed)
            self.lin2 = Linear(d, d, seed + 10)

        def forward(self, h1, h2, ctx):
            return h1 + torch.tanh(self.lin1(h2)) * ctx, h2 + torch.tanh(self.lin2(h1))

    class DropLayer(kit.Module):
        def __init__(self, d, seed, p=0.5):
            super().__init__()
            self.lin = Linear(d, d, seed)
            self.drop = torch.nn.Dropout(p)

        def forward(self, x):
            return self.drop(self.lin(x))

    class Net(kit.Module):
        """emb-like input projection + a block list + head: DistributedModule params outside blocks too."""

        def __init__(self, d, nlayers, seed):
            super().__init__()
            self.inp = Linear(d, d, seed)
            self.layers = kit.blocklist([Layer(d, seed + 100 * (i + 1)) for i in range(nlayers)])
            self.head = Linear(d, 3, seed + 7)

        def forward(self, x):
            return self.head(self.layers(self.inp(x)))

    return types.SimpleNamespace(**{k: v for k, v in locals().items() if isinstance(v, type)})
