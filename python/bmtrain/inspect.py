"""bmtrain.inspect: statistics of parameters, gradients and recorded activations (BMTrain's bmtrain.inspect).

The work is libbmtrain's (bmt::inspect, src/bmt/inspect.h): statistics are combined from every rank's shard
(count, sum, sum of squares, min, max) over the parameter's communicators, nothing is gathered. Rows are dicts with
the keys name, shape, mean, std, min, max, grad_mean, grad_std, grad_min, grad_max (grad_* are None without a
gradient); std is the population std.
"""
import torch

from . import _C


def inspect_model(model, param_name="*", prefix=""):
    """One row per parameter of `model` whose name (with `prefix`) matches the shell pattern `param_name`.
    Collective: every rank must call it."""
    named = [(prefix + name, p) for name, p in model.named_parameters()]
    return _C.inspect_parameters(named, param_name)


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
        self.summary = self._scope.summary()
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


def format_summary(summary):
    """BMTrain's table: name, shape, max, min, std, mean, grad_std, grad_mean."""
    return _C.format_summary(list(summary))
