"""bmtrain.inspect: statistics of parameters and gradients, gathered over shards (BMTrain's inspect_model)."""
import fnmatch

import torch

from . import _C
from .parameter import DistributedParameter


def _stats(t):
    t = t.float()
    if t.numel() == 0:
        return {"mean": float("nan"), "std": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"mean": t.mean().item(), "std": t.std(unbiased=False).item() if t.numel() > 1 else 0.0,
            "min": t.min().item(), "max": t.max().item()}


def inspect_model(model, param_name="*"):
    """One dict per parameter whose name matches the shell pattern: name, shape, mean, std, min, max of the whole
    (gathered) parameter and, when it has a gradient, grad_mean, grad_std, grad_min, grad_max of the whole
    gradient. Collective: every rank must call it."""
    out = []
    for name, p in model.named_parameters():
        if not fnmatch.fnmatch(name, param_name):
            continue
        full = _C.gather_logical(p) if isinstance(p, DistributedParameter) else p.detach()
        row = {"name": name, "shape": tuple(full.shape)}
        row.update(_stats(full))
        g = _C.main_grad(p) if isinstance(p, DistributedParameter) else p.grad
        if g is not None and isinstance(p, DistributedParameter):
            gfull = _gather_grad(p, g)
            row.update({"grad_" + k: v for k, v in _stats(gfull).items()})
        elif g is not None:
            row.update({"grad_" + k: v for k, v in _stats(g).items()})
        out.append(row)
    return out


def _gather_grad(p, g):
    comm = _C.param_comm(p)
    n = torch.tensor([g.numel()], dtype=torch.int64, device=g.device)
    longest = int(_C.raw_all_reduce(n, "max", comm).item())
    padded = torch.zeros(longest, dtype=torch.float32, device=g.device)
    padded[: g.numel()] = g.float().reshape(-1)
    sizes = _C.raw_all_gather(n, comm).reshape(-1).tolist()
    parts = _C.raw_all_gather(padded, comm)
    return torch.cat([parts[i, : sizes[i]] for i in range(len(sizes))])


def format_summary(summary):
    """The table BMTrain prints for inspect_model's result."""
    lines = [f"{'name':<40} {'shape':<16} {'mean':>10} {'std':>10} {'min':>10} {'max':>10}"]
    for r in summary:
        lines.append(f"{r['name']:<40} {str(r['shape']):<16} {r['mean']:>10.4g} {r['std']:>10.4g} "
                     f"{r['min']:>10.4g} {r['max']:>10.4g}")
    return "\n".join(lines)
