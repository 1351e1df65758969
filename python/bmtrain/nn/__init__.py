"""bmtrain.nn: BMTrain's layers over DistributedParameters. Their forwards compose the engine's operations
(gathered parameters, the tensor-parallel ops of bmtrain._C.tp); initialisation follows BMTrain's."""
import math

import torch
import torch.nn.functional as F

from .. import _C
from ..global_var import config
from ..layer import DistributedModule
from ..parameter import DistributedParameter, ParameterInitializer

_tp = _C.tp
# The engine's layer ops (Linear, ColumnParallelLinear and LayerNorm call them): torch's on CPU and under autocast;
# on CUDA our bias / LayerNorm gradient reductions (BMT_FUSED_REDUCTIONS=0: torch's). _nn.gelu_mlp and
# _nn.linear_residual (the GEMM-epilogue MLP, BMT_GEMM_EPILOGUES=0: separate ops) are there for user models.
_nn = _C.nn


def causal_attention(query, key, value):
    """softmax(q kᵀ / √hd + causal mask) v for q (B, H, T, hd) and k, v (B, Hkv, T, hd), H % Hkv == 0 (grouped-query
    heads): the engine's nn::causal_attention, the fused kernel torch's scaled_dot_product_attention would pick
    (cuDNN's or flash), as one autograd function. Inside a checkpointed Block the first run keeps its output and
    log-sum-exp and the backward's recompute skips the attention's forward (one activation per Block; off with
    BMT_KEEP_FOR_RECOMPUTE=0). Not in BMTrain (whose users call torch's attention, which this equals)."""
    return _nn.causal_attention(query, key, value)


def _dtype(dtype):
    return dtype if dtype is not None else torch.get_default_dtype()


def _tp_size():
    return config.get("tp_size", 1)


def _split_size(n, what, who):
    tp = _tp_size()
    if n % tp != 0:
        raise ValueError(f"{who}: {what} = {n} is not divisible by tp_size = {tp}; choose sizes that tp_size "
                         "divides")
    return n // tp


class OpLinear(torch.autograd.Function):
    """BMTrain's OpLinear: y = x W^T + b (equal to torch.nn.functional.linear)."""

    @staticmethod
    def forward(ctx, x, weight, bias=None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gx = grad.matmul(weight)
        gw = grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        gb = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return gx, gw, gb


class Linear(DistributedModule):
    """BMTrain's Linear(in_features, out_features, bias=True, dtype=None): weight (out, in) xavier_normal_,
    bias zeros."""

    def __init__(self, in_features, out_features, bias=True, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        dt = _dtype(dtype)
        self.weight = DistributedParameter(torch.empty(out_features, in_features, dtype=dt),
                                           init_method=torch.nn.init.xavier_normal_)
        self.bias = (DistributedParameter(torch.empty(out_features, dtype=dt), init_method=torch.nn.init.zeros_)
                     if bias else None)

    def forward(self, input):
        return _nn.linear(input, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class ColumnParallelLinear(DistributedModule):
    """BMTrain's ColumnParallelLinear(in_features, out_features, bias=True, dtype=None, gather_output=False,
    gather_input=True, async_gather_chunks=2): weight (out/tp, in) split over the tensor-parallel group.
    gather_input: the input's rows are split over tp (sequence parallel) and all-gathered first; else the input is
    replicated. gather_output: all tp ranks' output features (replicated), else this rank's out/tp."""

    def __init__(self, in_features, out_features, bias=True, dtype=None, gather_output=False, gather_input=True,
                 async_gather_chunks=2):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.out_features_per_partition = _split_size(out_features, "out_features", "ColumnParallelLinear")
        self.gather_output, self.gather_input = gather_output, gather_input
        self.async_gather_chunks = async_gather_chunks
        dt = _dtype(dtype)
        self.weight = DistributedParameter(torch.empty(self.out_features_per_partition, in_features, dtype=dt),
                                           init_method=torch.nn.init.xavier_normal_, tp_split_dim=0, tp_mode=True)
        self.bias = (DistributedParameter(torch.empty(self.out_features_per_partition, dtype=dt),
                                          init_method=torch.nn.init.zeros_, tp_split_dim=0, tp_mode=True)
                     if bias else None)

    def forward(self, input):
        if self.gather_input and _tp_size() > 1 and _tp.overlap_chunks() > 0:
            # the all-gather overlapped with the GEMM (BMT_TP_OVERLAP_CHUNKS; this layer's async_gather_chunks)
            y = _tp.gather_rows_linear(input, self.weight, self.bias, max(1, int(self.async_gather_chunks or 1)))
        else:
            x = _tp.gather_rows(input) if self.gather_input else _tp.copy_to_tp(input)
            y = _nn.linear(x, self.weight, self.bias)
        return _tp.gather_last_dim(y) if self.gather_output else y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"out_features_per_partition={self.out_features_per_partition}, bias={self.bias is not None}")


class RowParallelLinear(DistributedModule):
    """BMTrain's RowParallelLinear(in_features, out_features, bias=True, dtype=None, split_input=False,
    all_reduce_output=False, async_chunks=2): weight (out, in/tp) split over tp; bias (out) replicated over tp and
    added after the reduction (its gradient copies are combined over tp, so they never diverge). Output rows
    reduce-scattered over tp (sequence parallel), or all-reduced with all_reduce_output."""

    def __init__(self, in_features, out_features, bias=True, dtype=None, split_input=False, all_reduce_output=False,
                 async_chunks=2):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.in_features_per_partition = _split_size(in_features, "in_features", "RowParallelLinear")
        self.split_input, self.all_reduce_output = split_input, all_reduce_output
        self.async_chunks = async_chunks
        dt = _dtype(dtype)
        self.weight = DistributedParameter(torch.empty(out_features, self.in_features_per_partition, dtype=dt),
                                           init_method=torch.nn.init.xavier_normal_, tp_split_dim=1, tp_mode=True)
        self.bias = (DistributedParameter(torch.empty(out_features, dtype=dt), init_method=torch.nn.init.zeros_,
                                          tp_split_dim=-1, tp_mode=True) if bias else None)

    def forward(self, input):
        x = _tp.split_last_dim(input) if self.split_input else input
        if x.shape[-1] != self.in_features_per_partition:
            raise ValueError(f"RowParallelLinear (rank {config['rank']}): input has {x.shape[-1]} features, expected "
                             f"in_features / tp_size = {self.in_features_per_partition}"
                             + ("" if self.split_input else " (pass split_input=True for inputs with all features)"))
        if not self.all_reduce_output and _tp_size() > 1 and _tp.overlap_chunks() > 0:
            # GEMM and reduce-scatter in chunks, overlapped (BMT_TP_OVERLAP_CHUNKS; this layer's async_chunks)
            y = _tp.linear_reduce_scatter_rows(x, self.weight, max(1, int(self.async_chunks or 1)))
        else:
            y = F.linear(x, self.weight)
            y = _tp.reduce_from_tp(y) if self.all_reduce_output else _tp.reduce_scatter_rows(y)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"in_features_per_partition={self.in_features_per_partition}, bias={self.bias is not None}")


class OpParallelLinear:
    """BMTrain's OpParallelLinear entry point, as a function: linear over the tp layout of ColumnParallelLinear
    (gather_input) or RowParallelLinear (reduce_output_type "reduce_scatter" or "all_reduce")."""

    @staticmethod
    def apply(input, weight, bias=None, gather_input=False, gather_output=False, split_input=False,
              reduce_output_type=None, *unused):
        x = _tp.split_last_dim(input) if split_input else input
        if gather_input:
            x = _tp.gather_rows(x)
        y = F.linear(x, weight, None if reduce_output_type else bias)
        if reduce_output_type == "reduce_scatter":
            y = _tp.reduce_scatter_rows(y)
        elif reduce_output_type == "all_reduce":
            y = _tp.reduce_from_tp(y)
        elif reduce_output_type is not None:
            raise ValueError(f"OpParallelLinear: unknown reduce_output_type {reduce_output_type!r}")
        if reduce_output_type and bias is not None:
            y = y + bias
        return _tp.gather_last_dim(y) if gather_output else y


class VPEmbedding(DistributedModule):
    """BMTrain's VPEmbedding(vocab_size, embedding_size, dtype=torch.half, init_mean=0.0, init_std=1): a
    vocabulary-parallel table (vocab/tp, dim). forward(ids): ids replicated over tp; every tp rank gets the full
    rows (B, S, dim), as BMTrain's does, without gathering the table: each rank looks up its vocabulary range and
    the partial rows are summed over tp (differentiable all-reduce: rows used on any tp rank send their gradient
    to the rank holding them). forward(x, projection=True): logits of this rank's vocabulary slice (for
    FusedCrossEntropy(parallel=True)); rows of x split over tp (sequence parallel) are all-gathered first."""

    def __init__(self, vocab_size, embedding_size, dtype=torch.half, init_mean=0.0, init_std=1):
        super().__init__()
        self.vocab_size, self.embedding_size = vocab_size, embedding_size
        self.vocab_per_partition = _split_size(vocab_size, "vocab_size", "VPEmbedding")
        self.vocab_begin = config.get("tp_rank", 0) * self.vocab_per_partition
        self.sequence_parallel = config.get("sequence_parallel", True)
        self.weight = DistributedParameter(
            torch.empty(self.vocab_per_partition, embedding_size, dtype=dtype),
            init_method=ParameterInitializer(torch.nn.init.normal_, mean=init_mean, std=init_std),
            tp_split_dim=0, tp_mode=True)

    def forward(self, x, projection=False):
        w = self.weight
        if projection:
            if _tp_size() > 1:
                x = _tp.gather_rows(x) if self.sequence_parallel else _tp.copy_to_tp(x)
            return F.linear(x, w)
        if _tp_size() == 1:
            return F.embedding(x, w)
        local = x - self.vocab_begin
        mine = (local >= 0) & (local < self.vocab_per_partition)
        rows = F.embedding(local.masked_fill(~mine, 0), w) * mine.unsqueeze(-1).to(w.dtype)
        return _C.all_reduce(rows, "sum", config["tp_comm"])


ParallelEmbedding = VPEmbedding


class LayerNorm(DistributedModule):
    """LayerNorm over DistributedParameters (weight ones, bias zeros), as BMTrain users write it."""

    def __init__(self, dim, eps=1e-5, bias=True, dtype=None):
        super().__init__()
        self.dim, self.eps = dim, eps
        dt = _dtype(dtype)
        self.weight = DistributedParameter(torch.empty(dim, dtype=dt), init_method=torch.nn.init.ones_)
        self.bias = DistributedParameter(torch.empty(dim, dtype=dt), init_method=torch.nn.init.zeros_) if bias else None

    def forward(self, x):
        return _nn.layer_norm(x, self.dim, self.weight, self.bias, self.eps)


class Embedding(DistributedModule):
    """An embedding table over a DistributedParameter (normal init, std init_std)."""

    def __init__(self, num_embeddings, embedding_dim, dtype=None, init_std=0.02):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = DistributedParameter(torch.empty(num_embeddings, embedding_dim, dtype=_dtype(dtype)),
                                           init_method=ParameterInitializer(torch.nn.init.normal_, std=init_std))

    def forward(self, ids, projection=False):
        w = self.weight
        return F.linear(ids, w) if projection else F.embedding(ids, w)


del math
