"""AdamOptimizer / AdamOffloadOptimizer: thin handles over the engine's optimizers.

Updates are AdamW-style (decoupled weight decay) for every dtype, with fp32 master weights and moments for
half-precision parameters; with weight_decay=0 the update equals torch.optim.Adam. Gradients are read where the
engine keeps them (bmt.main_grad: a Block's gradient shard, in the parameter's dtype by default, or fp32). param_groups is a list of dicts as in torch: writing "lr" (or
betas, eps, weight_decay) changes the engine's group.
"""
from collections.abc import Mapping

import torch

from .. import _C

_ENGINE_KEYS = ("lr", "betas", "eps", "weight_decay", "hold_steps")


class _ParamGroup(dict):
    """A param group dict whose optimizer options write through to the engine."""

    def __init__(self, optimizer, index, params, extra):
        super().__init__()
        dict.__setitem__(self, "params", params)
        dict.update(self, extra)
        self._optimizer, self._index = optimizer, index

    def __getitem__(self, key):
        if key in _ENGINE_KEYS:
            return self._optimizer._c.group_options(self._index)[key]
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def __contains__(self, key):
        return key in _ENGINE_KEYS or dict.__contains__(self, key)

    def __setitem__(self, key, value):
        if key in _ENGINE_KEYS:
            self._optimizer._c.set_group_option(self._index, key, value)
        elif key == "params":
            raise ValueError("the parameters of a bmtrain optimizer's group cannot be replaced")
        else:
            dict.__setitem__(self, key, value)

    def keys(self):
        return list(dict.keys(self)) + list(_ENGINE_KEYS)

    def items(self):
        return [(k, self[k]) for k in self.keys()]

    def __repr__(self):
        return repr(dict(self.items()))


def _groups(params):
    params = list(params)
    if not params:
        raise ValueError("optimizer got an empty parameter list")
    if not isinstance(params[0], Mapping):
        params = [{"params": params}]
    out = []
    for g in params:
        ps = list(g["params"]) if not isinstance(g["params"], torch.Tensor) else [g["params"]]
        opts = {k: v for k, v in g.items() if k != "params"}
        out.append((ps, opts))
    return out


class _BmtOptimizer:
    _bmtrain_optimizer = True  # BMTrain's marker: OptimManager hands it the loss scale
    _engine_class = None

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, hold_steps=0):
        groups = _groups(params)
        self._c = self._engine_class([(ps, {k: v for k, v in o.items() if k in _ENGINE_KEYS}) for ps, o in groups],
                                     float(lr), (float(betas[0]), float(betas[1])), float(eps), float(weight_decay),
                                     int(hold_steps))
        self.defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "hold_steps": hold_steps}
        self.param_groups = [
            _ParamGroup(self, i, ps, {k: v for k, v in o.items() if k not in _ENGINE_KEYS})
            for i, (ps, o) in enumerate(groups)]
        self.state = {}  # the Adam state lives in the engine; state_dict() holds it

    def step(self, closure=None, scale=1):
        """One update with the gradients divided by `scale` (the loss scale, when called directly)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._c.step(float(scale))
        return loss

    def zero_grad(self, set_to_none=False):
        self._c.zero_grad(set_to_none)

    def state_dict(self):
        """The engine's flat state dict (tensors by name: per-parameter step, exp_avg, exp_avg_sq, master, and the
        group options); each rank's holds its own shards."""
        return dict(self._c.state_dict())

    def load_state_dict(self, state_dict):
        self._c.load_state_dict(dict(state_dict))

    def add_param_group(self, param_group):
        raise NotImplementedError("bmtrain optimizers take all param groups at construction")

    def refresh_master(self):
        """Re-reads fp32 master copies from the (half-precision) parameters, e.g. after loading weights."""
        self._c.refresh_master()

    def get_avg_delta(self):
        raise NotImplementedError("record_delta statistics are not available in bmtrain")

    def get_var_delta(self):
        raise NotImplementedError("record_delta statistics are not available in bmtrain")

    def __repr__(self):
        return f"{type(self).__name__}({len(self.param_groups)} groups, defaults={self.defaults})"


class AdamOptimizer(_BmtOptimizer):
    """BMTrain's AdamOptimizer(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, hold_steps=0):
    fused Adam on the parameters' device (the state beside the shards)."""
    _engine_class = _C.AdamOptimizer


class AdamOffloadOptimizer(_BmtOptimizer):
    """BMTrain's AdamOffloadOptimizer(params, lr, betas, eps, weight_decay, hold_steps=0, record_delta=False):
    the fp32 master weights and moments in host memory, the update on a persistent pool of CPU threads (vectorised
    kernel), gradients and new values crossing the bus through pinned buffers.
    Extras: async_step (step() returns before the Blocks' updates finish; each Block waits for its own before it
    next gathers), grad_transfer_dtype (e.g. torch.bfloat16: gradients cross the bus rounded, as BMTrain's do)."""
    _engine_class = _C.AdamOffloadOptimizer

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, hold_steps=0,
                 record_delta=False, *, async_step=False, grad_transfer_dtype=None):
        if record_delta:
            raise NotImplementedError("AdamOffloadOptimizer(record_delta=True): update statistics are not "
                                      "available in bmtrain")
        super().__init__(params, lr, betas, eps, weight_decay, hold_steps)
        if async_step:
            self._c.set_async_step(True)
        if grad_transfer_dtype is not None:
            self._c.set_grad_transfer_dtype(grad_transfer_dtype)

    def state_dict(self, gather=False):
        if gather:
            raise NotImplementedError("AdamOffloadOptimizer.state_dict(gather=True): use "
                                      "bmt.save_checkpoint(...), whose optimizer state loads at any world size")
        return super().state_dict()

    def wait(self):
        """Waits for every update still running (asynchronous step)."""
        self._c.wait()
