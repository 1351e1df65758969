"""BMTrain's bmtrain.loss._function: the fused kernels' entry points, with their signatures, argument checks and
in-place outputs, computed with torch operations (fp32 arithmetic on fp16 / bf16 inputs, as BMTrain's kernels; any
device). bmt.loss.FusedCrossEntropy itself runs the engine's fused cross-entropy."""
import torch

_HALF = (torch.float16, torch.bfloat16)


def _check_half(x, fn):
    if x.dtype not in _HALF:
        raise ValueError(f"{fn} not supported for dtype {x.dtype}")


def has_inf_nan(g_half, out):
    """Sets out[0] = 1 when g_half holds an inf or NaN (out keeps 1 once set: calls accumulate, as the kernel's)."""
    assert out.dtype == torch.uint8, "out must be a uint8 tensor"
    assert g_half.is_contiguous(), "g_fp16 must be contiguous"
    assert out.is_contiguous(), "out must be contiguous"
    _check_half(g_half, "has_inf_nan")
    if not torch.isfinite(g_half).all():
        out.view(-1)[0] = 1


def cross_entropy_forward(m, n, input, target, softmax, output, ignore_index):
    """Per row i of input (m, n): softmax[i] = softmax(input[i]) (in input's dtype) and output[i] = the row's
    cross-entropy (fp32; 0 where target[i] == ignore_index)."""
    assert target.dtype == torch.int32, "target must be an int tensor"
    assert output.dtype == torch.float32, "output must be a float tensor"
    assert input.numel() == softmax.numel(), "input and softmax must have the same number of elements"
    assert target.numel() == output.numel(), "target and output must have the same number of elements"
    _check_half(input, "cross_entropy_forward")
    x = input.view(m, n).float()
    mx = x.max(dim=1, keepdim=True).values.clamp_min(-1e6)
    e = torch.exp(x - mx)
    s = e.sum(dim=1, keepdim=True) + 1e-10
    softmax.view(m, n).copy_(e / s)
    t = target.view(m).long()
    keep = t != ignore_index
    picked = x.gather(1, t.masked_fill(~keep, 0).view(m, 1)).view(m)
    loss = -picked + mx.view(m) + torch.log(s.view(m))
    output.view(m).copy_(torch.where(keep, loss, torch.zeros_like(loss)))


def cross_entropy_backward_inplace(m, n, grad_output, target, x, ignore_index):
    """x (the softmax, (m, n)) becomes the gradient of the loss: (x - onehot(target)) * grad_output[i]."""
    assert grad_output.dtype == torch.float32, "grad_output must be a float tensor"
    assert target.dtype == torch.int32, "target must be an int tensor"
    assert target.numel() == grad_output.numel(), "target and grad_output must have the same number of elements"
    _check_half(x, "cross_entropy_backward")
    xv = x.view(m, n)
    g = xv.float()
    t = target.view(m).long()
    inside = (t >= 0) & (t < n)
    rows = torch.arange(m, device=x.device)[inside]
    g[rows, t[inside]] -= 1
    xv.copy_(g * grad_output.view(m, 1))


def fused_sumexp(logits, max_logits):
    """sum_j exp(logits[i, j] - max_logits[i]) per row, fp32."""
    assert max_logits.dtype == torch.float32, "max_logits must be float tensor"
    assert max_logits.size(0) == logits.size(0), "max_logits must have same size(0) as logits"
    _check_half(logits, "fused_sumexp")
    return torch.exp(logits.float() - max_logits.view(-1, 1)).sum(dim=1)


def fused_softmax_inplace(logits, max_logits, sum_exp_logits):
    """logits[i] = exp(logits[i] - max_logits[i]) / sum_exp_logits[i], in place."""
    assert max_logits.dtype == torch.float32, "max_logits must be float tensor"
    assert sum_exp_logits.dtype == torch.float32, "sum_exp_logits must be float tensor"
    assert max_logits.size(0) == logits.size(0), "max_logits must have same size(0) as logits"
    assert sum_exp_logits.size(0) == logits.size(0), "sum_exp_logits must have same size(0) as logits"
    _check_half(logits, "fused_softmax_inplace")
    logits.copy_(torch.exp(logits.float() - max_logits.view(-1, 1)) / sum_exp_logits.view(-1, 1))
