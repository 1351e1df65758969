"""Helpers of the tensor-parallel workers (w_tp_layers.py, w_tp_gpt.py)."""
import torch

import bmtrain as bmt
from bmtrain import _C
from common import device


def logical_grad(p):
    """The unsplit (logical) gradient of a DistributedParameter: its ZeRO shards over tp_zero_comm assembled, then
    the tp pieces gathered along the split dim (a tp-replicated parameter: this rank's copy)."""
    shape = tuple(p._original_shape)
    n = 1
    for s in shape:
        n *= s
    flat = torch.zeros(n, dtype=torch.float32, device=device())
    b, e = _C.shard_range(p)
    g = p.grad if p.grad is not None else bmt.main_grad(p)
    if e > b:
        if g is None:
            raise AssertionError(f"parameter of shape {shape}: no gradient")
        flat[b:e] = g.detach().float().reshape(-1)
    flat = _C.raw_all_reduce(flat, "sum", bmt.config["tp_zero_comm"])
    piece = flat.view(shape)
    if p._tp_split_dim >= 0 and bmt.config["tp_size"] > 1:
        parts = _C.raw_all_gather(piece.contiguous(), bmt.config["tp_comm"])
        piece = torch.cat(list(parts.unbind(0)), p._tp_split_dim)
    return piece
