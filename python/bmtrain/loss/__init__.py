"""bmtrain.loss.FusedCrossEntropy: the engine's fused cross-entropy (fp32 statistics on half-precision logits,
vocabulary-parallel mode without full logits)."""
import torch

from .. import _C, recompute_tail
from . import _function  # noqa: F401  (BMTrain's bmtrain.loss._function)


class FusedCrossEntropy(torch.nn.Module):
    """BMTrain's FusedCrossEntropy(weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
    parallel=False). forward(input (N, C), target (N,)) -> fp32 loss. parallel=True: `input` is this
    tensor-parallel rank's vocabulary slice (VPEmbedding's projection); every tp rank passes the same targets.
    Class weights (not with parallel) scale each row's loss by weight[target], and "mean" divides by the sum of
    the weights of the non-ignored rows, as torch.nn.functional.cross_entropy does (with label smoothing too, where
    torch's own fp32 cross-entropy computes it).
    Keyword-only inplace=True writes the gradient over the logits (saves one logits-sized buffer)."""

    def __init__(self, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, parallel=False, *,
                 inplace=False):
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"FusedCrossEntropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        if weight is not None and parallel:
            raise ValueError("FusedCrossEntropy: class weights are not supported with parallel=True")
        self.weight, self.ignore_index, self.reduction = weight, ignore_index, reduction
        self.label_smoothing, self.parallel, self.inplace = label_smoothing, parallel, inplace

    def forward(self, input, target):
        recompute_tail.materialize(input)  # (a loss inside a checkpointed Block: computed before the engine reads it)
        if self.weight is None:
            return _C.fused_cross_entropy(input, target, self.ignore_index, self.reduction, self.label_smoothing,
                                          self.parallel, self.inplace)
        if self.label_smoothing > 0:  # weights spread over the smoothed classes: torch's formula, in fp32
            return torch.nn.functional.cross_entropy(input.float(), target, self.weight.float().to(input.device),
                                                     ignore_index=self.ignore_index, reduction=self.reduction,
                                                     label_smoothing=self.label_smoothing)
        rows = _C.fused_cross_entropy(input, target, self.ignore_index, "none", 0.0, False, self.inplace)
        keep = target != self.ignore_index
        w = self.weight.to(device=rows.device, dtype=torch.float32)[target.masked_fill(~keep, 0)] * keep
        rows = rows * w
        if self.reduction == "none":
            return rows
        if self.reduction == "sum":
            return rows.sum()
        return rows.sum() / w.sum()
