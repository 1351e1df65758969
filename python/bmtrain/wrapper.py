"""BMTrainModelWrapper (BMTrain's bmtrain.wrapper): converts an existing torch.nn.Module in place."""
import torch

from .block_layer import Block, TransformerBlockList
from .layer import DistributedModule
from .parameter import DistributedParameter

_converted_classes = {}


def _distributed_class(cls):
    if issubclass(cls, DistributedModule):
        return cls
    if cls not in _converted_classes:
        _converted_classes[cls] = type(cls.__name__, (DistributedModule, cls), {"__module__": cls.__module__})
    return _converted_classes[cls]


def _convert_parameters(module):
    for name, p in list(module._parameters.items()):
        if p is None or isinstance(p, DistributedParameter):
            continue
        module._parameters[name] = DistributedParameter(p.detach(), requires_grad=p.requires_grad)
    if module._parameters:
        module.__class__ = _distributed_class(type(module))


def _is_layer_list(m):
    return (isinstance(m, torch.nn.ModuleList) and len(m) > 1
            and len({type(x) for x in m}) == 1 and not isinstance(m[0], Block))


def BMTrainModelWrapper(model):
    """Makes every parameter of `model` a DistributedParameter (sharded over the data-parallel group; the values
    are kept) and turns each ModuleList of repeated layers into a TransformerBlockList of Blocks, so the model
    trains with ZeRO-3 and prefetch while its own forward code runs unchanged (iterating a block list yields its
    Blocks, which accept any arguments). Returns the model (converted in place)."""
    for _, m in list(model.named_modules()):
        _convert_parameters(m)
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if child is not None and _is_layer_list(child):
                parent._modules[child_name] = TransformerBlockList(list(child))
    return model
