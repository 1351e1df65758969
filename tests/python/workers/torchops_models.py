"""The GPT layer written with torch's functional ops, over bmtrain or torch (w_torch_ops, w_torch_compile)."""
import torch
import torch.nn.functional as F

import bmtrain as bmt
from common import device

VOCAB = 96


def make_classes(Base, param):
    """A GPT layer as a BMTrain user writes it, over a base class and a parameter factory (bmt or torch)."""

    class Layer(Base):
        def __init__(self, dim, heads, seed, dtype=torch.float32, gqa=False, scale=None, gelu_variant="tanh",
                     tail="residual"):
            super().__init__()
            self.heads, self.kv_heads = heads, heads // 2 if gqa else heads
            self.scale = scale
            self.gelu_variant = gelu_variant  # tanh; erf (approximate="none"); inplace (tanh, then h.mul_(1.0))
            self.tail = tail  # residual: x + F.linear(h); post_ln: a LayerNorm of that; view: that through a view
            kv = dim // heads * self.kv_heads
            g = torch.Generator().manual_seed(seed)

            def p(*shape, std=0.1, base=0.0):
                return param((torch.randn(*shape, generator=g) * std + base).to(dtype))
            self.ln_w, self.ln_b = p(dim, base=1.0), p(dim)
            self.qkv_w, self.qkv_b = p(dim + 2 * kv, dim), p(dim + 2 * kv)
            self.proj_w, self.proj_b = p(dim, dim), p(dim)
            self.ln2_w, self.ln2_b = p(dim, base=1.0), p(dim)
            self.fc_w, self.fc_b = p(4 * dim, dim), p(4 * dim)
            self.out_w, self.out_b = p(dim, 4 * dim), p(dim)

        def forward(self, x):
            B, T, C = x.shape
            hd = C // self.heads
            h = F.layer_norm(x, (C,), self.ln_w, self.ln_b, 1e-5)
            q, k, v = F.linear(h, self.qkv_w, self.qkv_b).split([C, hd * self.kv_heads, hd * self.kv_heads], dim=2)
            q = q.view(B, T, self.heads, hd).transpose(1, 2)
            k, v = (t.view(B, T, self.kv_heads, hd).transpose(1, 2) for t in (k, v))
            kw = {"enable_gqa": True} if self.kv_heads != self.heads else {}
            if self.scale is not None:
                kw["scale"] = self.scale
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
            x = x + F.linear(y.transpose(1, 2).reshape(B, T, C), self.proj_w, self.proj_b)
            h = F.gelu(F.linear(F.layer_norm(x, (C,), self.ln2_w, self.ln2_b), self.fc_w, self.fc_b),
                       approximate="none" if self.gelu_variant == "erf" else "tanh")
            if self.gelu_variant == "inplace":
                h = h.mul_(1.0)
            out = x + F.linear(h, self.out_w, self.out_b)
            if self.tail == "post_ln":
                return F.layer_norm(out, (C,), self.ln_w, self.ln_b, 1e-5)
            if self.tail == "view":
                return out.view(B * T, C).view(B, T, C)
            return out

    class LM(Base):
        """Embedding, layers, final LayerNorm, tied projection: the model's output are the logits."""

        def __init__(self, dim, heads, n, dtype, make_list, use_checkpoint=True):
            super().__init__()
            g = torch.Generator().manual_seed(77)
            self.wte = param((torch.randn(VOCAB, dim, generator=g) * 0.1).to(dtype))
            self.layers = make_list([Layer(dim, heads, 10 + i, dtype) for i in range(n)], use_checkpoint)
            self.lnf_w, self.lnf_b = param(torch.ones(dim, dtype=dtype)), param(torch.zeros(dim, dtype=dtype))

        def forward(self, ids):
            wte = self.wte
            x = self.layers(F.embedding(ids, wte))
            return F.linear(F.layer_norm(x, (x.shape[-1],), self.lnf_w, self.lnf_b), wte)

    return Layer, LM


def _bmt_param(t):
    return bmt.DistributedParameter(t)


BLayer, BLM = make_classes(bmt.DistributedModule, _bmt_param)
TLayer, TLM = make_classes(torch.nn.Module, lambda t: torch.nn.Parameter(t.to(device())))


class RefList(torch.nn.ModuleList):
    def forward(self, x):
        for m in self:
            x = m(x)
        return x
