"""Block (alias CheckpointBlock) and TransformerBlockList (BMTrain's bmtrain.block_layer), run by the C++ engine.

A Block hands its inner module's DistributedParameters to a C++ bmt::Block, which packs them into sharded flat
buffers, gathers them before the forward (on the comm stream, prefetched by TransformerBlockList), recomputes the
forward in the backward when use_checkpoint, and reduce-scatters the gradients. The inner module's Python forward
runs inside the engine's call: each call's non-tensor arguments and output structure travel as the call's context
(_BlockCall / _ListCall), which the engine hands back for the recompute.
"""
import functools

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import _C, torch_ops
from .layer import check_apply, load_distributed, save_distributed
from .parameter import DistributedParameter


def _split(tree):
    leaves, spec = tree_flatten(tree)
    pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[i] for i in pos]
    for i in pos:
        leaves[i] = None  # the engine holds the tensors; the context keeps the rest
    return leaves, spec, pos, tensors


def _join(leaves, spec, pos, tensors):
    leaves = list(leaves)
    for i, t in zip(pos, tensors):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


class _Outputs:

    def flatten_outputs(self, out):
        self.out_leaves, self.out_spec, self.out_pos, tensors = _split(out)
        return tensors

    def result(self, tensors):
        return _join(self.out_leaves, self.out_spec, self.out_pos, tensors)


class _BlockCall(_Outputs):
    """One call of a standalone Block: any positional and keyword arguments, any output structure."""

    def __init__(self, args, kwargs):
        self.leaves, self.spec, self.pos, self.tensor_inputs = _split((args, kwargs))

    def run(self, module, tensors):
        args, kwargs = _join(self.leaves, self.spec, self.pos, tensors)
        return self.flatten_outputs(module(*args, **kwargs))


class _ListCall(_Outputs):
    """One call of a TransformerBlockList: the first num_hidden tensors are threaded through the layers, the other
    positional arguments are passed unchanged to every layer."""

    def __init__(self, num_hidden, rest):
        self.num_hidden = num_hidden
        self.leaves, self.spec, self.pos, self.tensor_inputs = _split(tuple(rest))

    def run(self, module, tensors):
        rest = _join(self.leaves, self.spec, self.pos, tensors[self.num_hidden:])
        return self.flatten_outputs(module(*tensors[:self.num_hidden], *rest))


def _run_call(module, tensors, call):
    # Called by the engine (C++) with the GIL held, in the forward and again in the recompute; torch's functional
    # ops inside go to the engine's kernels (torch_ops.py, off with BMT_ROUTE_TORCH_OPS=0).
    return torch_ops.run_routed(module, lambda: call.run(module, tensors))


class Block(torch.nn.Module):
    """BMTrain's Block(inner_module, use_checkpoint=True, zero_level=3, initialized=False, mode="BLOCK").
    Every parameter of inner_module must be a DistributedParameter. The Block is transparent: parameters(),
    named_parameters(), state_dict() and attribute access are the inner module's (no "_module." prefix).
    Keyword-only extras: reduce_dtype (dtype of gradient accumulation and reduce-scatter, default fp32 for half
    parameters), reduce_op ("sum", BMTrain's, or "avg")."""

    def __init__(self, inner_module, use_checkpoint=True, zero_level=3, initialized=False, mode="BLOCK", *,
                 reduce_dtype=None, reduce_op="sum"):
        super().__init__()
        if mode not in ("BLOCK", "PIPE"):
            raise ValueError(f"Block: mode must be 'BLOCK' or 'PIPE', got {mode!r}")
        if isinstance(inner_module, Block):
            raise ValueError("Block: the module is already a Block; wrap each module once")
        if zero_level not in (2, 3):
            raise ValueError(f"Block: zero_level must be 2 or 3, got {zero_level}")
        named = list(inner_module.named_parameters())
        for name, p in named:
            if not isinstance(p, DistributedParameter):
                raise ValueError(f"Block: parameter '{name}' of {type(inner_module).__name__} (shape "
                                 f"{tuple(p.shape)}) is a plain torch parameter; every parameter inside a Block must "
                                 "be a bmt.DistributedParameter (use bmt.nn layers, or BMTrainModelWrapper to "
                                 "convert an existing model)")
        d = self.__dict__
        d["_module"] = inner_module
        # Share the inner module's registries: named_parameters(), state_dict(), children() see its tensors and
        # submodules under their own names.
        d["_parameters"] = inner_module._parameters
        d["_buffers"] = inner_module._buffers
        d["_modules"] = inner_module._modules
        d["_non_persistent_buffers_set"] = inner_module._non_persistent_buffers_set
        d["_mode"] = mode
        d["_build_args"] = (zero_level, bool(use_checkpoint), reduce_dtype, reduce_op)
        d["_cblock"] = None
        if mode == "BLOCK":
            self._build()
        # mode "PIPE": built by the PipelineTransformerBlockList that takes it, after its parameters moved to the
        # stage's group (and not at all on the other stages)
        self.training = inner_module.training

    def _build(self):
        zero_level, use_checkpoint, reduce_dtype, reduce_op = self.__dict__["_build_args"]
        named = list(self._module.named_parameters())
        self.__dict__["_cblock"] = _C.Block(_C.make_holder(named, []), functools.partial(_run_call, self._module),
                                            zero_level, use_checkpoint, reduce_dtype, reduce_op)
        return self._cblock

    def _built(self):
        if self.__dict__["_cblock"] is None:
            raise RuntimeError("Block(mode='PIPE') runs only inside a bmt.PipelineTransformerBlockList (which builds "
                               "it on the stage that holds the layer); use mode='BLOCK' for a standalone Block")
        return self.__dict__["_cblock"]

    @property
    def inner_module(self):
        return self._module

    @property
    def zero_level(self):
        return self._built().zero_level

    @property
    def use_checkpoint(self):
        return self._built().use_checkpoint

    def forward(self, *args, **kwargs):
        call = _BlockCall(args, kwargs)
        torch_ops.close_window()
        out = call.result(self._built().forward(call.tensor_inputs, call))
        torch_ops.open_window()  # the loss computed next routes its cross-entropy (torch_ops.py)
        return out

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_module"], name)

    def train(self, mode=True):
        super().train(mode)
        self._module.training = mode
        return self

    def _apply(self, fn, recurse=True):
        check_apply(self, fn)
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        save_distributed(self, destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        load_distributed(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def __repr__(self):
        return repr(self._module)


CheckpointBlock = Block


class TransformerBlockList(torch.nn.Module):
    """BMTrain's TransformerBlockList(modules, num_hidden=1, sqrt=False): runs the Blocks in sequence while the next
    Blocks' parameters are gathered ahead (prefetch_depth, keyword-only, default 1) and, in the backward, the
    gradient reduce-scatter of a Block overlaps the next one's compute. Modules that are not Blocks are wrapped in
    Block(module). State-dict keys are those of a torch.nn.ModuleList of the inner modules."""

    def __init__(self, modules, num_hidden=1, sqrt=False, *, prefetch_depth=1):
        super().__init__()
        if sqrt:
            raise NotImplementedError("TransformerBlockList(sqrt=True) is not supported; choose checkpointing per "
                                      "Block with Block(module, use_checkpoint=...)")
        if num_hidden < 1:
            raise ValueError(f"TransformerBlockList: num_hidden must be >= 1, got {num_hidden}")
        self.num_hidden = num_hidden
        blocks, seen = [], set()
        for i, m in enumerate(modules):
            if not isinstance(m, Block):
                m = Block(m)
            if id(m) in seen:
                raise AssertionError("Duplicate bmt.Block not supported in same block list!")
            seen.add(id(m))
            blocks.append(m)
            self.add_module(str(i), m)
        self.__dict__["_blocks"] = blocks
        self.__dict__["_clist"] = _C.TransformerBlockList([b._built() for b in blocks], prefetch_depth)

    def forward(self, *args, return_hidden_states=False):
        nh = self.num_hidden
        if len(args) < nh:
            raise ValueError(f"TransformerBlockList: {len(args)} arguments given but num_hidden is {nh}")
        for i, h in enumerate(args[:nh]):
            if not isinstance(h, torch.Tensor):
                raise TypeError(f"TransformerBlockList: hidden state {i} must be a tensor, got {type(h).__name__}")
        call = _ListCall(nh, args[nh:])
        torch_ops.close_window()
        outs = self._clist.forward(list(args[:nh]) + call.tensor_inputs, nh, bool(return_hidden_states), call)
        torch_ops.open_window()  # the loss computed next routes its cross-entropy (torch_ops.py)
        if return_hidden_states:
            return tuple(outs)
        return outs[0] if nh == 1 else tuple(outs)

    def __len__(self):
        return len(self._blocks)

    def __iter__(self):
        return iter(self._blocks)

    def __getitem__(self, index):
        if isinstance(index, str):
            return self._modules[index]
        return self._blocks[index]


class no_grad_sync:
    """Context manager: Blocks accumulate gradients without reducing them (gradient accumulation over
    micro-batches with one reduce-scatter per step: the first backward after the context reduces everything)."""

    def __enter__(self):
        self._guard = _C.GradSyncGuard()
        return self

    def __exit__(self, *exc):
        del self._guard
        return False
