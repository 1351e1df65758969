"""DistributedModule (BMTrain's bmtrain.layer): reading a DistributedParameter in forward gives the full tensor;
state_dict holds full tensors under the module's own keys and load_state_dict writes each rank's shard."""
from collections import OrderedDict

import torch

from . import _C
from .global_var import config
from .parameter import DistributedParameter

_STANDALONE = 1  # _C.param_state: a DistributedParameter outside any Block
_IN_IDLE_BLOCK = 3  # inside a Block that is not running (its tensor is the 1-D shard)


def save_distributed(module, destination, prefix, keep_vars):
    """Module._save_to_state_dict for modules holding DistributedParameters (collective over their groups)."""
    torch.nn.Module._save_to_state_dict(module, destination, prefix, keep_vars)
    to_cpu = config.get("save_param_to_cpu", True)
    for name, param in module._parameters.items():
        if isinstance(param, DistributedParameter):
            full = _C.gather_logical(param)
            destination[prefix + name] = full.cpu() if to_cpu else full
        elif param is not None and to_cpu and not keep_vars:
            destination[prefix + name] = param.detach().cpu()
    if to_cpu and not keep_vars:  # BMTrain saves plain parameters and buffers on the CPU too
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                destination[prefix + name] = buf.detach().cpu()


def load_distributed(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """Module._load_from_state_dict for modules holding DistributedParameters: checks each value's shape against
    the parameter's logical shape and writes only this rank's shard; everything else loads as torch does. Load
    pre-hooks run first (they may rename or convert keys), as in torch's and BMTrain's _load_from_state_dict."""
    pre_hooks = module._load_state_dict_pre_hooks
    for hook in pre_hooks.values():
        hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
    dist = {k: p for k, p in module._parameters.items() if isinstance(p, DistributedParameter)}
    for name, param in dist.items():
        key = prefix + name
        if key not in state_dict:
            missing_keys.append(key)
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            error_msgs.append(f'While copying the parameter named "{key}", expected torch.Tensor but got '
                              f'{type(value).__name__}.')
            continue
        want = tuple(_C.logical_shape(param))
        if tuple(value.shape) != want:
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                              f"checkpoint, the shape in current model is {want}.")
            continue
        _C.scatter_logical(param, value.to(param.dtype))
    saved = module.__dict__["_parameters"]
    module.__dict__["_parameters"] = {k: p for k, p in saved.items() if k not in dist}
    module.__dict__["_load_state_dict_pre_hooks"] = OrderedDict()  # they ran above
    try:
        torch.nn.Module._load_from_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys,
                                              unexpected_keys, error_msgs)
    finally:
        module.__dict__["_parameters"] = saved
        module.__dict__["_load_state_dict_pre_hooks"] = pre_hooks
    if strict:
        mine = {prefix + k for k in dist}
        unexpected_keys[:] = [k for k in unexpected_keys if k not in mine]


_distributed_types = {}  # type -> whether it is a DistributedParameter (sub)class


def _is_distributed_type(cls):
    yes = _distributed_types.get(cls)
    if yes is None:
        yes = _distributed_types[cls] = issubclass(cls, DistributedParameter)
    return yes


class DistributedModule(torch.nn.Module):
    """BMTrain's DistributedModule. Outside a Block, reading a DistributedParameter attribute all-gathers it
    (differentiable; read it once per forward); inside a running Block it is already the full tensor."""

    # Both run for every parameter read and module call of a forward: the type test is a cached issubclass
    # (isinstance of a Parameter subclass goes through Python-level _ParameterMeta.__instancecheck__).
    def __getattr__(self, name):
        value = super().__getattr__(name)
        if _is_distributed_type(type(value)) and _C.param_state(value) == _STANDALONE:
            return _C.gathered(value)
        return value

    def __call__(self, *args, **kwargs):
        d = self.__dict__
        for name, p in d["_parameters"].items():
            if name in d:  # published as an attribute: its Block is running (block_layer._run_call)
                break
            if _is_distributed_type(type(p)):  # a module's parameters all belong to one Block, or none
                if _C.param_state(p) == _IN_IDLE_BLOCK:
                    raise RuntimeError(
                        f"{type(self).__name__} was called outside its Block: its parameters (e.g. '{name}') belong "
                        "to a bmt.Block, which gathers them only while it runs. Call the Block (or the "
                        "TransformerBlockList holding it) instead of the module inside it.")
                break
        return super().__call__(*args, **kwargs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        save_distributed(self, destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        load_distributed(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)


def check_apply(module, fn):
    """Module._apply guard: a DistributedParameter's storage belongs to the engine (a Block's packed shard), so
    .to()/.half()/.cuda() may not replace it; conversions that change nothing are allowed."""
    for name, p in module.named_parameters():
        if isinstance(p, DistributedParameter) and fn(p) is not p:
            raise RuntimeError(f"cannot convert or move DistributedParameter '{name}' ({p.dtype}, {p.device}): its "
                               "storage is the engine's shard. Create the model with the dtype it trains in; "
                               "parameters are already on bmt.config['device']")


def _distributed_apply(self, fn, recurse=True):
    check_apply(self, fn)
    return torch.nn.Module._apply(self, fn, recurse)


DistributedModule._apply = _distributed_apply
