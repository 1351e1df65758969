"""DistributedParameter and ParameterInitializer (BMTrain's bmtrain.parameter).

A DistributedParameter is a torch.nn.Parameter whose tensor holds only this rank's shard of the flattened full
tensor (1-D). The C++ engine keeps its record (shape, communicator, shard range, init method) keyed by this very
object's tensor, which is why the object is created empty first and then made distributed in place: wrapping an
existing tensor in a new Parameter would make a tensor the engine does not know.
"""
import copy

import torch

from . import _C
from .global_var import config


class DistributedParameter(torch.nn.Parameter):
    """BMTrain's DistributedParameter(data, requires_grad=True, init_method=None, group=None, tp_mode=False,
    tp_split_dim=-1). `data` is the full initial value (any device); only this rank's shard is kept on the
    configured device. tp_mode=True: `data` is this tensor-parallel rank's piece of a tensor split along
    tp_split_dim (-1: replicated over the tensor-parallel group), and the group becomes "tp"."""

    def __new__(cls, data, requires_grad=True, init_method=None, group=None, tp_mode=False, tp_split_dim=-1):
        if not config["initialized"]:
            raise RuntimeError("BMTrain is not initialized: call bmt.init_distributed() before creating "
                               "DistributedParameters")
        if not isinstance(data, torch.Tensor):
            data = torch.as_tensor(data)
        # With a pipeline, a parameter outside it is used by every stage on its own data: it shards over the world
        # (BMTrain's zero_comm); a pipeline layer's parameters move to their stage's group when the list takes them.
        comm = config["comm"] if config.get("pipe_size", 1) > 1 else None
        return cls._create(data, requires_grad, init_method, group, tp_mode, tp_split_dim, comm)

    @classmethod
    def _create(cls, data, requires_grad, init_method, group, tp_mode, tp_split_dim, comm):
        obj = torch.Tensor._make_subclass(cls, torch.empty(0, dtype=data.dtype, device=config["device"]),
                                          requires_grad)
        _C.make_distributed(obj, data.detach(), init_method, bool(tp_mode), int(tp_split_dim), comm)
        obj._init_method = init_method
        obj._tp_mode = bool(tp_mode)
        obj._tp_split_dim = int(tp_split_dim) if tp_mode else -1
        obj._group = "tp" if tp_mode else group
        obj._original_shape = torch.Size(_C.full_shape(obj))
        obj._tp_original_shape = torch.Size(_C.logical_shape(obj))
        obj._zero_comm = _C.param_comm(obj)
        return obj

    def __init__(self, *args, **kwargs):  # everything happened in __new__
        pass

    @property
    def group(self):
        return self._group

    # This rank's element range of the flattened full tensor (a Block re-packs it when it takes the parameter).
    @property
    def _start_partition(self):
        return _C.shard_range(self)[0]

    @property
    def _end_partition(self):
        return _C.shard_range(self)[1]

    def gather(self):
        """The full tensor (this tensor-parallel rank's piece), differentiable: outside a Block an all-gather whose
        backward reduce-scatters into the gradient shard; inside a running Block the gathered parameter itself."""
        return _C.gathered(self)

    def gather_all(self):
        """The whole logical tensor (also gathered over tensor parallelism); a copy, not differentiable."""
        return _C.gather_logical(self)

    def tp_gather(self):
        return _C.gather_logical(self)

    def _copy_data(self, data):
        """Writes this rank's part of the full tensor `data` into the shard."""
        _C.scatter_full(self, data)

    def __reduce_ex__(self, proto):
        raise TypeError("a DistributedParameter holds one shard and cannot be pickled; save the model with "
                        "bmt.save(model, path) or its state_dict()")

    def __deepcopy__(self, memo):
        """A new DistributedParameter with this one's value, shape, dtype, init_method, group, tensor-parallel split
        and requires_grad, sharded the same way (outside any Block; a copied Block takes it). Collective over the
        parameter's group, like creating one: every rank deep-copies the same model. Other attributes are deep-copied;
        the gradient is not (torch's Parameter does the same)."""
        if id(self) in memo:
            return memo[id(self)]
        full = _C.gather_full(self)  # this tensor-parallel rank's piece, full_shape
        comm = None if (self._tp_mode and self._tp_split_dim >= 0) else _C.param_comm(self)
        new = type(self)._create(full, self.requires_grad, self._init_method, self._group, self._tp_mode,
                                 self._tp_split_dim, comm)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key not in new.__dict__:
                new.__dict__[key] = copy.deepcopy(value, memo)
        return new


class ParameterInitializer:
    """BMTrain's ParameterInitializer(func, *args, **kwargs): calling it with a tensor runs
    func(tensor, *args, **kwargs), e.g. ParameterInitializer(torch.nn.init.normal_, mean=0.0, std=0.02)."""

    def __init__(self, func, *args, **kwargs):
        self.func, self._args, self._kwargs = func, args, kwargs

    def __call__(self, param):
        self.func(param, *self._args, **self._kwargs)

    def __repr__(self):
        return f"ParameterInitializer({getattr(self.func, '__name__', self.func)!r}, {self._args}, {self._kwargs})"
