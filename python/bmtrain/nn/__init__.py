"""bmtrain.nn: BMTrain's layers over DistributedParameters. Their forwards are the engine's: the C++ layer ops
(bmtrain._C.nn) and, for the tensor-parallel layers, the functions the C++ nn::ColumnParallelLinear, RowParallelLinear
and VPEmbedding call (bmtrain._C.tp, nn/tp_layer_ops.h); parameters, names and initialisation follow BMTrain's."""
import enum
import math

import torch
import torch.nn.functional as F

from .. import _C, recompute_tail
from ..global_var import config
from ..layer import DistributedModule
from ..parameter import DistributedParameter, ParameterInitializer

_tp = recompute_tail.Materializing(_C.tp)  # (a recompute's deferred inputs computed first)
# The engine's layer ops (Linear, ColumnParallelLinear and LayerNorm call them): torch's on CPU and under autocast;
# on CUDA our bias / LayerNorm gradient reductions (BMT_FUSED_REDUCTIONS=0: torch's). _nn.gelu_mlp and
# _nn.linear_residual (the GEMM-epilogue MLP, BMT_GEMM_EPILOGUES=0: separate ops) are there for user models.
_nn = recompute_tail.Materializing(_C.nn)


def causal_attention(query, key, value):
    """softmax(q kᵀ / √hd + causal mask) v for q (B, H, T, hd) and k, v (B, Hkv, T, hd), H % Hkv == 0 (grouped-query
    heads): the engine's nn::causal_attention, the fused kernel torch's scaled_dot_product_attention would pick
    (cuDNN's or flash), as one autograd function. Inside a checkpointed Block the first run keeps its output and
    log-sum-exp and the backward's recompute skips the attention's forward (one activation per Block; off with
    BMT_KEEP_FOR_RECOMPUTE=0). Not in BMTrain (whose users call torch's attention, which this equals)."""
    return _nn.causal_attention(query, key, value)


def fp8_linear(input, weight, bias=None, grad_format=None, scaling=None, scales=None):
    """y = input weightᵀ + bias with its three GEMMs in FP8 (the engine's nn::fp8_linear, through torch._scaled_mm:
    Hopper's FP8 tensor cores on GPUs, torch's CPU kernel on CPUs): E4M3 input and weight, the gradient in
    grad_format ("e5m2", the default from BMT_FP8_GRAD, or "e4m3"); dynamic scales computed on the device, per tensor
    or, with scaling="row" (default from BMT_FP8_SCALING: "tensor"), per row of each operand along the contracted
    dimension (every operand E4M3 then); output, master weights and gradients in the input's dtype. Falls back to
    the plain linear when a GEMM dimension (rows, in or out features) is not a multiple of 16 or the dtype is not
    fp32 / bf16 / fp16. scales: an Fp8LinearScales the caller keeps for this layer across steps; with
    set_fp8_delayed_inputs(True) (or BMT_FP8_DELAYED_INPUTS=1) and per-tensor scales the input and the weight are
    cast with the scales of their last 16 amaxes, each amax taken in the same pass (one read of each fewer, the
    weight's transposed copy kept for the backward; a value above that range saturates); with
    set_fp8_delayed_grads(True) (or BMT_FP8_DELAYED_GRADS=1), E5M2 gradients and per-tensor scales the backward
    casts the output gradient with the scale of its last 16 amaxes, its bias gradient from the same read (the
    autograd node keeps the state alive). scales.backward_only = True keeps the forward GEMM in the input's dtype
    and puts only the two backward GEMMs in FP8 (an LM head: exact logits, as train_gpt --fp8-head-backward). Not in
    BMTrain."""
    return _nn.fp8_linear(input, weight, bias, grad_format, scaling, True, scales)


def fp8_linear_residual(input, weight, bias, residual, grad_format=None, scaling=None, scales=None):
    """residual + fp8_linear(input, weight, bias): on CUDA with per-tensor scales the residual is added by the FP8
    GEMM's epilogue (one rounding, no separate pass; nn::fp8_linear_residual); scales as fp8_linear's. Not in
    BMTrain."""
    return _nn.fp8_linear_residual(input, weight, bias, residual, grad_format, scaling, scales)


def fp8_gelu_mlp(input, w_fc, b_fc, w_proj, b_proj, residual=None, grad_format=None, gelu_scale=None,
                 fc_scales=None, proj_scales=None):
    """[residual +] gelu_tanh(input w_fcᵀ + b_fc) w_projᵀ + b_proj with FP8 GEMMs (fp8_linear's numerics, per-tensor
    scales), c_fc's bias and GELU and c_proj's bias and residual in the FP8 GEMMs' epilogues on CUDA
    (nn::fp8_gelu_mlp); elsewhere, or with rowwise scales, the same from fp8_linear, gelu and fp8_linear.
    gelu_scale: an Fp8DelayedScale the caller keeps for this MLP across steps; with set_fp8_delayed_gelu(True)
    (or BMT_FP8_DELAYED_GELU=1) the fused CUDA path has c_fc's GEMM write the GELU output in E4M3 with the scale
    from the amaxes of its last history_len calls (one cast pass fewer; a value above that range saturates).
    fc_scales, proj_scales: c_fc's and c_proj's Fp8LinearScales, as fp8_linear's scales. Not in BMTrain."""
    return _nn.fp8_gelu_mlp(input, w_fc, b_fc, w_proj, b_proj, residual, grad_format, gelu_scale, fc_scales,
                            proj_scales)


Fp8DelayedScale = _nn.Fp8DelayedScale
Fp8LinearScales = _nn.Fp8LinearScales


def fp8_recipe():
    """How the FP8 layers find their per-tensor scales: "current" (each cast from its tensor's own amax; the
    default) or "delayed" (from the tensor's last 16 amaxes, taken by the casts themselves: no amax passes;
    TransformerEngine's recipe). BMT_FP8_RECIPE sets it for a process. Not in BMTrain."""
    return _nn.fp8_recipe()


def set_fp8_recipe(recipe):
    """Sets the FP8 recipe ("current" or "delayed") for this process: "delayed" turns on set_fp8_delayed_gelu,
    set_fp8_delayed_inputs and set_fp8_delayed_grads together, "current" turns them off. Not in BMTrain."""
    _nn.set_fp8_recipe(str(recipe))


def fp8_delayed_gelu():
    """Whether fp8_gelu_mlp uses a given gelu_scale (BMT_FP8_DELAYED_GELU, default: the recipe's). Not in
    BMTrain."""
    return _nn.fp8_delayed_gelu()


def set_fp8_delayed_gelu(enabled):
    """Switches fp8_gelu_mlp's delayed GELU-output scaling (and the C++ GPT's) for this process. Not in BMTrain."""
    _nn.set_fp8_delayed_gelu(bool(enabled))


def fp8_delayed_inputs():
    """Whether the FP8 linears use given delayed scales (BMT_FP8_DELAYED_INPUTS, default: the recipe's). Not in
    BMTrain."""
    return _nn.fp8_delayed_inputs()


def set_fp8_delayed_inputs(enabled):
    """Switches the FP8 linears' delayed input and weight scaling (bmt.nn.Linear's, the functions' scales, the
    C++ GPT's) for this process. Not in BMTrain."""
    _nn.set_fp8_delayed_inputs(bool(enabled))


def fp8_delayed_grads():
    """Whether the FP8 linears' backward uses given delayed gradient scales (BMT_FP8_DELAYED_GRADS, default: the
    recipe's).
    Not in BMTrain."""
    return _nn.fp8_delayed_grads()


def set_fp8_delayed_grads(enabled):
    """Switches the FP8 linears' delayed output-gradient scaling (bmt.nn.Linear's, the functions' scales, the FP8
    MLP's d pre with c_fc's bias gradient in one pass, the C++ GPT's) for this process. Not in BMTrain."""
    _nn.set_fp8_delayed_grads(bool(enabled))


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
    bias zeros. Keyword-only extra (not in BMTrain): fp8=True runs its GEMMs in FP8 (fp8_linear above); the
    attribute `fp8` may be changed between steps. Under set_fp8_delayed_inputs(True) or set_fp8_delayed_grads(True)
    the layer keeps its Fp8LinearScales (fp8_linear's scales)."""

    def __init__(self, in_features, out_features, bias=True, dtype=None, *, fp8=False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fp8 = bool(fp8)
        dt = _dtype(dtype)
        self.weight = DistributedParameter(torch.empty(out_features, in_features, dtype=dt),
                                           init_method=torch.nn.init.xavier_normal_)
        self.bias = (DistributedParameter(torch.empty(out_features, dtype=dt), init_method=torch.nn.init.zeros_)
                     if bias else None)

    def forward(self, input):
        if self.fp8:
            # (the delayed scales, made on first use under either switch: not in state_dict)
            scales = None
            if _nn.fp8_delayed_inputs() or _nn.fp8_delayed_grads():
                scales = self.__dict__.setdefault("_fp8_scales", Fp8LinearScales())
            return _nn.fp8_linear(input, self.weight, self.bias, None, None, True, scales)
        return _nn.linear(input, self.weight, self.bias)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                + (", fp8=True" if self.fp8 else ""))


def _overlap(chunks):
    """The chunk count for the overlapped sequence-parallel GEMMs: the layer's own when the overlap is on
    (BMT_TP_OVERLAP_CHUNKS / bmtrain._C.tp.set_overlap_chunks), else 0 (the separate ops; the same values)."""
    return max(1, int(chunks or 1)) if _tp.overlap_chunks() > 0 else 0


class ColumnParallelLinear(DistributedModule):
    """BMTrain's ColumnParallelLinear(in_features, out_features, bias=True, dtype=None, gather_output=False,
    gather_input=True, async_gather_chunks=2): weight (out/tp, in) and bias (out/tp) split over the tensor-parallel
    group. gather_input: the input's rows are split over tp (sequence parallel) and all-gathered first (the output
    has tp times the rows); else the input is replicated. gather_output: all tp ranks' output features, else this
    rank's out/tp. The forward is the C++ layer's (nn::column_parallel_linear). Keyword-only extra (not in
    BMTrain): fp8=True runs this rank's GEMM in FP8 (fp8_linear; the attribute may change between steps)."""

    def __init__(self, in_features, out_features, bias=True, dtype=None, gather_output=False, gather_input=True,
                 async_gather_chunks=2, *, fp8=False):
        super().__init__()
        self.fp8 = bool(fp8)
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
        return _tp.column_parallel_linear(input, self.weight, self.bias, self.gather_input, self.gather_output,
                                          _overlap(self.async_gather_chunks), self.fp8)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"out_features_per_partition={self.out_features_per_partition}, bias={self.bias is not None}")


class RowParallelLinear(DistributedModule):
    """BMTrain's RowParallelLinear(in_features, out_features, bias=True, dtype=None, split_input=False,
    all_reduce_output=False, async_chunks=2): weight (out, in/tp) split over tp; bias (out) replicated over tp and
    added after the reduction. Input: this rank's in/tp features, or (split_input, as BMTrain's) all features with
    the rows split over tp: the rows are all-gathered and this rank keeps its feature slice. Output rows
    reduce-scattered over tp (sequence parallel), or all-reduced with all_reduce_output. The bias's gradient copies
    are combined over tp (summed for a reduce-scattered output, averaged for an all-reduced one), so they equal the
    unsplit layer's and never diverge. The forward is the C++ layer's (nn::row_parallel_linear). Keyword-only extra
    (not in BMTrain): fp8=True runs this rank's GEMM in FP8 (fp8_linear; the attribute may change between steps)."""

    def __init__(self, in_features, out_features, bias=True, dtype=None, split_input=False, all_reduce_output=False,
                 async_chunks=2, *, fp8=False):
        super().__init__()
        self.fp8 = bool(fp8)
        self.in_features, self.out_features = in_features, out_features
        self.in_features_per_partition = _split_size(in_features, "in_features", "RowParallelLinear")
        self.split_input, self.all_reduce_output = split_input, all_reduce_output
        self.async_chunks = async_chunks
        dt = _dtype(dtype)
        self.weight = DistributedParameter(torch.empty(out_features, self.in_features_per_partition, dtype=dt),
                                           init_method=torch.nn.init.xavier_normal_, tp_split_dim=1, tp_mode=True)
        self.bias = (DistributedParameter(torch.empty(out_features, dtype=dt), init_method=torch.nn.init.zeros_,
                                          tp_split_dim=-1, tp_mode=True) if bias else None)
        if bias:  # the parameter itself (self.bias outside a Block reads a gathered copy)
            _tp.set_grad_reduce(self._parameters["bias"], _tp.row_parallel_bias_grad_reduce(bool(all_reduce_output)))

    def forward(self, input):
        return _tp.row_parallel_linear(input, self.weight, self.bias, bool(self.split_input),
                                       bool(self.all_reduce_output), _overlap(self.async_chunks), self.fp8)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"in_features_per_partition={self.in_features_per_partition}, bias={self.bias is not None}")


class OpParallelLinear:
    """BMTrain's OpParallelLinear, called as BMTrain's is: OpParallelLinear.apply(input, weight, bias=None,
    gather_input=False, gather_output=False, split_input=False, reduce_output_type=None, async_gather_chunks=2).
    input -> (gather_input: all-gather the rows over tp) -> (split_input: this rank's in-feature slice) ->
    linear(·, weight, bias) -> (gather_output: all output features) -> (reduce_output_type: all-reduce, or
    reduce-scatter of the rows). reduce_output_type: None, ReduceType.ALL_REDUCE / REDUCE_SCATTER, their values 1 /
    2, or "all_reduce" / "reduce_scatter". As in BMTrain the bias is added on every rank before the reduction. The
    C++ op nn::op_parallel_linear."""

    @staticmethod
    def apply(input, weight, bias=None, gather_input=False, gather_output=False, split_input=False,
              reduce_output_type=None, async_gather_chunks=2):
        return _tp.op_parallel_linear(input, weight, bias, bool(gather_input), bool(gather_output), bool(split_input),
                                      _reduce_name(reduce_output_type), _overlap(async_gather_chunks))


class ReduceType(enum.Enum):
    """BMTrain's bmtrain.nn.parallel_linear_func.ReduceType."""
    ALL_REDUCE = 1
    REDUCE_SCATTER = 2


def _reduce_name(r):
    if r is None:
        return None
    if isinstance(r, str):
        return r
    try:
        r = ReduceType(r.value if isinstance(r, enum.Enum) else r)
    except ValueError:
        raise ValueError(f"OpParallelLinear: unknown reduce_output_type {r!r}; use None, ReduceType.ALL_REDUCE or "
                         "ReduceType.REDUCE_SCATTER") from None
    return "all_reduce" if r is ReduceType.ALL_REDUCE else "reduce_scatter"


class VPEmbedding(DistributedModule):
    """BMTrain's VPEmbedding(vocab_size, embedding_size, dtype=torch.half, init_mean=0.0, init_std=1): a
    vocabulary-parallel table (vocab/tp, dim), the C++ layer's forwards (nn::vocab_parallel_lookup / _projection).
    forward(ids): every tp rank looks up its own ids (BMTrain's example gives each rank its chunk of the sequence)
    in the whole table. Gradient: in the sequence-parallel layout (init_distributed's default) each rank's ids are
    different tokens and every rank's gradient reaches the row's owner (BMTrain keeps only the owner's own tokens);
    with init_distributed(sequence_parallel=False) the ids must be the same on every tp rank.
    forward(x, projection=True): logits of this rank's vocabulary slice (for FusedCrossEntropy(parallel=True)):
    x's rows are split over tp and all-gathered, as BMTrain's, returned as (x.shape[0], -1, vocab/tp).
    Keyword-only extra (not in BMTrain): fp8=True runs the projection's GEMM in FP8 (fp8_linear; the lookup is
    unchanged; the attribute may change between steps)."""

    def __init__(self, vocab_size, embedding_size, dtype=torch.half, init_mean=0.0, init_std=1, *, fp8=False):
        super().__init__()
        self.fp8 = bool(fp8)
        self.vocab_size, self.embedding_size = vocab_size, embedding_size
        self.dim_model = embedding_size
        self.vocab_per_partition = _split_size(vocab_size, "vocab_size", "VPEmbedding")
        self.vocab_size_per_partition = self.vocab_per_partition
        self.start_index = config.get("tp_rank", 0) * self.vocab_per_partition
        self.end_index = self.start_index + self.vocab_per_partition
        self.vocab_begin = self.start_index
        self.sequence_parallel = config.get("sequence_parallel", True)
        self.weight = DistributedParameter(
            torch.empty(self.vocab_per_partition, embedding_size, dtype=dtype),
            init_method=ParameterInitializer(torch.nn.init.normal_, mean=init_mean, std=init_std),
            tp_split_dim=0, tp_mode=True)

    def forward(self, x, projection=False):
        if not projection:
            return _tp.vocab_parallel_lookup(x, self.weight, self.sequence_parallel)
        y = _tp.vocab_parallel_projection(x, self.weight, self.sequence_parallel, self.fp8)
        # BMTrain's shape: the gathered rows viewed as (x.shape[0], -1, ·) (the C++ op keeps 2-dim rows as rows)
        return y.view(x.shape[0], -1, y.shape[-1]) if self.sequence_parallel and x.dim() == 2 else y


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
    """An embedding table over a DistributedParameter (normal init, std init_std). forward(x, projection=True): the
    tied projection x weightᵀ; fp8=True (keyword-only) runs it as fp8_linear."""

    def __init__(self, num_embeddings, embedding_dim, dtype=None, init_std=0.02, *, fp8=False):
        super().__init__()
        self.fp8 = bool(fp8)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = DistributedParameter(torch.empty(num_embeddings, embedding_dim, dtype=_dtype(dtype)),
                                           init_method=ParameterInitializer(torch.nn.init.normal_, std=init_std))

    def forward(self, ids, projection=False):
        w = self.weight
        if not projection:
            return F.embedding(ids, w)
        return _nn.fp8_linear(ids, w, None, None, None) if self.fp8 else F.linear(ids, w)


del math
