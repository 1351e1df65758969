"""init_parameters and grouped_parameters (BMTrain's bmtrain.param_init)."""
from collections import OrderedDict

from . import _C
from ._holder import holder_of
from .parameter import DistributedParameter


def init_parameters(model):
    """Runs every DistributedParameter's init_method on a full-size tensor generated on this rank (in
    named_parameters order) and keeps the local shard: bit-identical to initialising the unwrapped model with the
    same seed. Then reseeds so that data-parallel ranks draw different dropout masks."""
    _C.init_parameters(holder_of(model, buffers=False))


def grouped_parameters(model):
    """Yields (group name, [parameters]) over the model's parameters, grouped by DistributedParameter.group
    (None for plain parameters and ungrouped ones)."""
    groups = OrderedDict()
    for p in model.parameters():
        key = p.group if isinstance(p, DistributedParameter) else None
        groups.setdefault(key, []).append(p)
    yield from groups.items()
