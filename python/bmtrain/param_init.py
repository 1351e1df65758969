"""init_parameters and grouped_parameters (BMTrain's bmtrain.param_init), and the built-in initialisers that fill
each rank's shard directly.

Two paths (docs/python.md, "Initialisation"): an init_method that is a Python callable (torch.nn.init.normal_,
a ParameterInitializer, any function of the full tensor: BMTrain's behaviour) runs on the whole tensor, one
parameter at a time, with torch's generator; every rank draws every number and keeps its part. An init_method made
here (normal, uniform, constant, zeros, ones, xavier_normal, xavier_uniform) is computed element by element from a
counter-based stream keyed by (seed, the parameter's name, the element's index in the whole tensor): each rank
computes only its shard, and the values are the same at every world and tensor-parallel size (but differ from
torch.nn.init's). Pass a meta tensor as the DistributedParameter's data to build a model without any full tensor:
    DistributedParameter(torch.empty(out, inp, device="meta", dtype=torch.bfloat16), init_method=normal(std=0.02))
"""
from collections import OrderedDict

import torch

from . import _C
from ._holder import holder_of
from .global_var import config
from .parameter import DistributedParameter


def init_parameters(model, seed=None, torch_generator=False):
    """Initialises every DistributedParameter with an init_method (named_parameters order), then reseeds so that
    data-parallel ranks draw different dropout masks. Built-in initialisers (this module's) fill shards from their
    counter-based streams, seeded with `seed` (default: bmt.init_distributed's seed); Python callables run on the full
    tensor with torch's generator, bit-identical to initialising the unwrapped model after the same
    torch.manual_seed. torch_generator=True sends the built-in ones down the full-tensor path too.
    With a PipelineTransformerBlockList, the other stages' layers' initialisers run too (their values dropped), as
    on BMTrain, where every stage builds every layer: each layer gets the unpipelined model's values."""
    if not any(getattr(m, "_other_layers", None) for m in model.modules()):
        _C.init_parameters(holder_of(model, buffers=False), seed=seed, torch_generator=bool(torch_generator))
        return
    builtin = []  # (name, parameter): counter-based streams, independent of the order
    with torch.no_grad():
        for name, p, shape, dtype, init in _init_order(model):
            if init is None:
                continue
            if not torch_generator and isinstance(init, _C.BuiltinInit):
                if p is not None:
                    builtin.append((name, p))
                continue
            full = torch.empty(shape, dtype=dtype, device=config["device"])
            init(full)  # as the engine's full-tensor path does, drawing from torch's generator
            if p is not None:
                _C.scatter_logical(p, full)
    # The built-in ones (and the per-rank reseed that ends every init_parameters).
    _C.init_parameters(_C.make_holder(builtin, []), seed=seed, torch_generator=False)


def _init_order(model):
    """(name, parameter or None, logical shape, dtype, init_method) in named_parameters order, the other stages'
    pipeline layers (parameter None) where the unpipelined model has them."""
    seen = set()

    def walk(module, prefix):
        for name, p in module._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(p, DistributedParameter):
                yield prefix + name, p, tuple(p._tp_original_shape), p.dtype, p._init_method
        other = getattr(module, "_other_layers", None)
        if other:
            for layer in range(len(module)):
                if str(layer) in module._modules:
                    yield from walk(module._modules[str(layer)], f"{prefix}{layer}.")
                else:
                    for name, shape, dtype, init in other.get(layer, []):
                        yield f"{prefix}{layer}.{name}", None, shape, dtype, init
            return
        for name, child in module._modules.items():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                yield from walk(child, f"{prefix}{name}.")

    yield from walk(model, "")


def normal(mean=0.0, std=1.0):
    return _C.init_normal(float(mean), float(std))


def uniform(a=0.0, b=1.0):
    return _C.init_uniform(float(a), float(b))


def constant(val):
    return _C.init_constant(float(val))


def zeros():
    return _C.init_constant(0.0)


def ones():
    return _C.init_constant(1.0)


def xavier_normal(gain=1.0):
    return _C.init_xavier_normal(float(gain))


def xavier_uniform(gain=1.0):
    return _C.init_xavier_uniform(float(gain))


def grouped_parameters(model):
    """Yields (group name, [parameters]) over the model's parameters, grouped by DistributedParameter.group
    (None for plain parameters and ungrouped ones)."""
    groups = OrderedDict()
    for p in model.parameters():
        key = p.group if isinstance(p, DistributedParameter) else None
        groups.setdefault(key, []).append(p)
    yield from groups.items()
