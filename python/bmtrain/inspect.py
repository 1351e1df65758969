"""bmtrain.inspect: statistics of parameters, gradients and recorded activations (BMTrain's bmtrain.inspect).

The work is libbmtrain's (bmt::inspect, src/bmt/inspect.h): statistics are combined from every rank's shard
(count, sum, sum of squares, min, max) over the parameter's communicators, nothing is gathered. Rows carry BMTrain's
keys: inspect_model's name, shape, std, mean, max, min, grad_std, grad_mean (0.0 without a gradient), the
summaries of inspect_tensor name, min, max, mean, std, shape, grad_mean, grad_std (None without a gradient); std is
the sample standard deviation (divides by n - 1, torch's Tensor.std()) of the whole tensor.
"""
import math

import torch

from . import _C


def inspect_model(model, param_name="*", prefix=""):
    """One row per parameter of `model` whose name (with `prefix`) matches the shell pattern `param_name`.
    Collective: every rank must call it."""
    named = [(prefix + name, p) for name, p in model.named_parameters()]
    rows = []
    for r in _C.inspect_parameters(named, param_name):
        n = math.prod(r["shape"])
        has_grad = r["grad_std"] is not None
        rows.append({"name": r["name"], "shape": tuple(r["shape"]), "std": _sample_std(r["std"], n),
                     "mean": r["mean"], "max": r["max"], "min": r["min"],
                     "grad_std": _sample_std(r["grad_std"], n) if has_grad else 0.0,
                     "grad_mean": r["grad_mean"] if has_grad else 0.0})
    return rows


def _sample_std(population_std, n):
    """Tensor.std() (n - 1 in the denominator) from the population std over n elements (nan for n = 1, as torch)."""
    return population_std * math.sqrt(n / (n - 1)) if n > 1 else float("nan")


def _tensor_rows(rows):
    out = []
    for r in rows:
        n = math.prod(r["shape"])
        out.append({"name": r["name"], "min": r["min"], "max": r["max"], "mean": r["mean"],
                    "std": _sample_std(r["std"], n), "shape": tuple(r["shape"]), "grad_mean": r["grad_mean"],
                    "grad_std": None if r["grad_std"] is None else _sample_std(r["grad_std"], n)})
    return out


def record_tensor(x, name, group=None):
    """Records `x` (an activation) into the innermost inspect_tensor() scope; a no-op outside one. Inside Blocks
    with activation checkpointing the recompute does not record again: it adds the gradient to the first record."""
    if isinstance(x, torch.nn.Parameter):
        raise RuntimeError("bmt.inspect.record_tensor: cannot record a Parameter (record activations; inspect "
                           "parameters with bmt.inspect.inspect_model)")
    _C.record_tensor(x, name, "" if group is None else group)


class InspectTensor:
    """What `with bmt.inspect.inspect_tensor() as inspector:` yields."""

    def __init__(self):
        self._scope = _C.InspectTensor()
        self.summary = None

    def get_summary(self):
        """Rows for every record (names "{group.}{index}.{name}"), combined over the world: collective. Includes
        the gradients of records whose backward has run since."""
        self.summary = _tensor_rows(self._scope.summary())
        return self.summary

    def get_tensor(self, name, group=None, index=None):
        return self._scope.get_tensor(name, "" if group is None else group, -1 if index is None else index)

    def get_grad(self, name, group=None, index=None):
        return self._scope.get_grad(name, "" if group is None else group, -1 if index is None else index)

    def __len__(self):
        return len(self._scope)


class InspectTensorManager:
    def __enter__(self):
        self._inspector = InspectTensor()
        return self._inspector

    def __exit__(self, exc_type, exc, tb):
        self._inspector._scope.close()
        if exc_type is None:
            self._inspector.get_summary()  # frozen at exit, as BMTrain's; get_summary() refreshes it
        return False


def inspect_tensor():
    return InspectTensorManager()


_HEADERS = ("name", "shape", "max", "min", "std", "mean", "grad_std", "grad_mean")


def _cell(value, width):
    # BMTrain's format_line: one leading space, cut to the column, left-aligned.
    v = " " + value[: width - 1] if len(value) + 1 > width else " " + value
    return v + " " * (width - len(v))


def format_summary(summary):
    """BMTrain's table: columns name (longest name + 4), shape (20), max, min, std, mean, grad_std, grad_mean (10
    each); floats with 4 decimals, anything else (None, tuples, ints) as str()."""
    widths = [max([len("name")] + [len(item["name"]) for item in summary]) + 4, 20, 10, 10, 10, 10, 10, 10]
    lines = ["".join(_cell(h, w) for h, w in zip(_HEADERS, widths))]
    for item in summary:
        values = ["{:.4f}".format(item[h]) if isinstance(item[h], float) else str(item[h]) for h in _HEADERS]
        lines.append("".join(_cell(v, w) for v, w in zip(values, widths)))
    return "\n".join(lines)
