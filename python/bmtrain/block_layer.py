"""Block (alias CheckpointBlock) and TransformerBlockList (BMTrain's bmtrain.block_layer), run by the C++ engine.

A Block hands its inner module's DistributedParameters to a C++ bmt::Block, which packs them into sharded flat
buffers, gathers them before the forward (on the comm stream, prefetched by TransformerBlockList), recomputes the
forward in the backward when use_checkpoint, and reduce-scatters the gradients. The inner module's Python forward
runs inside the engine's call: each call's non-tensor arguments and output structure travel as the call's context
(_BlockCall / _ListCall), which the engine hands back for the recompute.

Gradients (BMTrain's): after a backward, a parameter's .grad is its slice of the Block's gradient shard, which has
the parameter's dtype (bf16 parameters: a bf16 shard, 2 bytes a parameter); the optimizers read it there
(bmt.main_grad(p) is the same tensor). Block(..., reduce_dtype=torch.float32) keeps an fp32 shard for half
parameters instead (2 bytes a parameter more; .grad is then None and the gradient is bmt.main_grad(p)). Frozen
parameters (requires_grad=False) get no gradient.
"""
import copy
import functools

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import _C, torch_ops
from .layer import DistributedModule, check_apply, load_distributed, save_distributed
from .utils import env_switch
from .parameter import DistributedParameter


class BlockUsageError(AssertionError, ValueError):
    """A misuse that BMTrain reports with an assert: scripts catching AssertionError (BMTrain's) or ValueError
    (ours before) both catch it."""


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
    # A lone tensor (a transformer layer's usual output) skips the pytree round trip: out_spec stays None.
    out_spec = None

    def flatten_outputs(self, out):
        if type(out) is torch.Tensor:
            self.out_spec = None  # (a list's call object serves every layer: reset what an earlier one set)
            return [out]
        self.out_leaves, self.out_spec, self.out_pos, tensors = _split(out)
        return tensors

    def result(self, tensors):
        if self.out_spec is None:
            return tensors[0]
        return _join(self.out_leaves, self.out_spec, self.out_pos, tensors)


class _BlockCall(_Outputs):
    """One call of a standalone Block: any positional and keyword arguments, any output structure."""

    def __init__(self, args, kwargs):
        self.leaves, self.spec, self.pos, self.tensor_inputs = _split((args, kwargs))

    def run(self, module, tensors):
        args, kwargs = _join(self.leaves, self.spec, self.pos, tensors)
        return self.flatten_outputs(_block_output(module(*args, **kwargs)))


def _block_output(out):
    # BMTrain's Block returns a tensor as it is and any other sequence as a plain tuple of its items (a list, a
    # namedtuple); the items keep their own structure. A dict stays a dict (BMTrain would hand back its keys).
    if isinstance(out, (list, tuple)) and type(out) is not tuple:
        return tuple(out)
    return out


class _ListCall(_Outputs):
    """One call of a TransformerBlockList: the first num_hidden tensors are threaded through the layers, the other
    positional arguments are passed unchanged to every layer."""

    def __init__(self, num_hidden, rest):
        self.num_hidden = num_hidden
        self.leaves, self.spec, self.pos, self.tensor_inputs = _split(tuple(rest))

    def run(self, module, tensors):
        if not self.leaves:  # no arguments beside the hidden states
            return self.flatten_outputs(module(*tensors))
        rest = _join(self.leaves, self.spec, self.pos, tensors[self.num_hidden:])
        return self.flatten_outputs(module(*tensors[:self.num_hidden], *rest))


class _Attributes:
    """While a Block runs, each DistributedModule's parameters and submodules under it are also plain instance
    attributes: `self.weight` is then a dict hit (~0.06 us) instead of DistributedModule.__getattr__ (~1.1 us; a
    transformer layer reads 18). They are the objects __getattr__ returns inside a running Block and are taken out
    after the run, so no entry outlives a change of the registries; an attribute already in __dict__ is never
    shadowed. Not while any module of the tree is torch.compile'd (dynamo treats an instance attribute unlike a
    registered parameter), nor with BMT_BLOCK_ATTRIBUTES=0 (read when the Block is built)."""

    __slots__ = ("module", "tables", "children")

    def __init__(self, module):
        mods = list(module.modules()) if env_switch("BMT_BLOCK_ATTRIBUTES", True) else []
        self.module = module
        self.tables = [(m.__dict__, m._parameters, m._modules) for m in mods if isinstance(m, DistributedModule)]
        self.children = [m._modules for m in mods]  # read at each run: a child may be replaced by its compiled form

    def publish(self):
        """Sets the attributes; returns what to take out afterwards."""
        published = []
        if not self.tables or self._compiled():
            return published
        for d, params, modules in self.tables:
            for registry in (params, modules):
                if not registry:
                    continue
                if d.keys().isdisjoint(registry):  # always, unless a run on this module is already in progress
                    d.update(registry)
                    published.append((d, tuple(registry)))
                else:
                    names = tuple(name for name in registry if name not in d)
                    for name in names:
                        d[name] = registry[name]
                    published.append((d, names))
        return published

    def _compiled(self):
        # every module of the tree is the Block's module or a child of one: compiled in place (module.compile()) or
        # replaced by torch.compile(child) since the Block was built
        is_compiled = torch_ops.is_compiled
        if is_compiled(self.module):
            return True
        for registry in self.children:
            for child in registry.values():
                if child is not None and is_compiled(child):
                    return True
        return False


def _run_call(module, attributes, tensors, call):
    # Called by the engine (C++) with the GIL held, in the forward and again in the recompute; torch's functional
    # ops inside go to the engine's kernels (torch_ops.py, off with BMT_ROUTE_TORCH_OPS=0).
    published = attributes.publish()
    try:
        return torch_ops.run_routed(module, lambda: call.run(module, tensors))
    finally:
        for d, names in published:
            for name in names:
                d.pop(name, None)


class Block(torch.nn.Module):
    """BMTrain's Block(inner_module, use_checkpoint=True, zero_level=3, initialized=False, mode="BLOCK").
    Every parameter of inner_module must be a DistributedParameter. The Block is transparent: parameters(),
    named_parameters(), state_dict() and attribute access are the inner module's (no "_module." prefix).
    Keyword-only extras: reduce_dtype (dtype of the gradient shard, its accumulation and reduce-scatter; default
    None = each parameter's own dtype, BMTrain's; torch.float32 keeps an fp32 shard for half parameters, whose
    gradient is then bmt.main_grad(p) and .grad stays None), reduce_op ("sum", BMTrain's, or "avg")."""

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
        if reduce_dtype is None:
            reduce_dtype = _own_grad_dtype(inner_module, named)
        d["_build_args"] = (zero_level, bool(use_checkpoint), reduce_dtype, reduce_op)
        d["_cblock"] = None
        if mode == "BLOCK":
            self._build()
        # mode "PIPE": built by the PipelineTransformerBlockList that takes it, after its parameters moved to the
        # stage's group (and not at all on the other stages)
        self.training = inner_module.training

    @classmethod
    def _reference(cls, block):
        """A second Block over the same module and engine Block (BMTrain's Block.reference): the same layer listed
        twice in a TransformerBlockList runs twice and shares its parameters (their gradients add up)."""
        ref = torch.nn.Module.__new__(cls)
        torch.nn.Module.__init__(ref)
        d = ref.__dict__
        for key in ("_module", "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_mode",
                    "_build_args", "_cblock"):
            d[key] = block.__dict__[key]
        ref.training = block.training
        return ref

    def __deepcopy__(self, memo):
        # A copy over copied parameters (each DistributedParameter deep-copies to a new one with the same value)
        # with an engine Block of its own; collective, like building the model.
        if id(self) in memo:
            return memo[id(self)]
        shared = ("bmtrain.Block", id(self._module))  # a copied Block over this module: the copy references it
        if shared in memo:
            new = Block._reference(memo[shared])
        else:
            inner = copy.deepcopy(self._module, memo)
            zero_level, use_checkpoint, reduce_dtype, reduce_op = self.__dict__["_build_args"]
            new = Block(inner, use_checkpoint, zero_level, mode=self._mode, reduce_dtype=reduce_dtype,
                        reduce_op=reduce_op)
            memo[shared] = new
        new.train(self.training)
        memo[id(self)] = new
        return new

    def _build(self):
        zero_level, use_checkpoint, reduce_dtype, reduce_op = self.__dict__["_build_args"]
        named = list(self._module.named_parameters())
        self.__dict__["_cblock"] = _C.Block(_C.make_holder(named, []),
                                            functools.partial(_run_call, self._module, _Attributes(self._module)),
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


def _own_grad_dtype(module, named):
    """reduce_dtype=None: gradient shards in the parameters' own dtype. The engine takes one reduce dtype per Block
    and promotes it with each group's dtype, so the half dtype (or fp32 when there is none) gives every group its own
    dtype; a Block holding both float16 and bfloat16 parameters must choose."""
    halves = {p.dtype for _, p in named if p.dtype in (torch.float16, torch.bfloat16)}
    if len(halves) > 1:
        raise ValueError(f"Block: {type(module).__name__} holds both float16 and bfloat16 parameters; their gradient "
                         "shards cannot both keep their own dtype. Pass reduce_dtype=torch.float32 (fp32 gradient "
                         "shards, read with bmt.main_grad(p)) or give the parameters one dtype")
    return halves.pop() if halves else torch.float32


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
        self.__dict__["_prefetch_depth"] = prefetch_depth
        blocks, wrapped = [], {}  # wrapped: id(inner module) -> its Block in this list
        for i, m in enumerate(modules):
            if isinstance(m, Block):
                # BMTrain: a Block may occur once in a list (the same plain module may occur several times)
                if id(m._module) in wrapped:
                    raise BlockUsageError("Duplicate bmt.Block not supported in same block list! (the same Block "
                                          f"object at positions {blocks.index(wrapped[id(m._module)])} and {i}; "
                                          "list the plain module twice to share its parameters)")
            elif id(m) in wrapped:
                m = Block._reference(wrapped[id(m)])  # the same layer again: runs twice, shares its parameters
            else:
                m = Block(m)
            wrapped.setdefault(id(m._module), m)
            blocks.append(m)
            self.add_module(str(i), m)
        self.__dict__["_blocks"] = blocks
        engine_blocks = [b._built() for b in blocks]
        # The engine's list prefetches each next Block; a layer listed twice runs Block by Block instead.
        repeated = len({id(b) for b in engine_blocks}) < len(engine_blocks)
        self.__dict__["_clist"] = None if repeated else _C.TransformerBlockList(engine_blocks, prefetch_depth)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        items, firsts = [], set()
        for b in self._blocks:
            c = copy.deepcopy(b, memo)
            # A layer listed again goes in as its (copied) module, which the new list wraps as a reference again.
            items.append(c._module if id(c._module) in firsts else c)
            firsts.add(id(c._module))
        new = TransformerBlockList(items, self.num_hidden, prefetch_depth=self.__dict__["_prefetch_depth"])
        new.train(self.training)
        memo[id(self)] = new
        return new

    def _run_each(self, args, nh, return_hidden_states, call):
        # The engine list's loop (block_list.cpp), Block by Block: a list holding one layer several times.
        hidden, rest, stacked = list(args[:nh]), list(args[nh:]), [[] for _ in range(nh)]
        for i, b in enumerate(self._blocks):
            if return_hidden_states:
                for h in range(nh):
                    stacked[h].append(hidden[h])
            out = b._built().forward(hidden + rest, call)
            if len(out) < nh:
                raise ValueError(f"TransformerBlockList: block {i} returned {len(out)} tensors but num_hidden is {nh}")
            hidden = list(out[:nh])
        if return_hidden_states:
            hidden += [torch.stack(t) for t in stacked]
        return hidden

    def forward(self, *args, return_hidden_states=False):
        nh = self.num_hidden
        if len(args) < nh:
            raise ValueError(f"TransformerBlockList: {len(args)} arguments given but num_hidden is {nh}")
        for i, h in enumerate(args[:nh]):
            if not isinstance(h, torch.Tensor):
                raise TypeError(f"TransformerBlockList: hidden state {i} must be a tensor, got {type(h).__name__}")
        call = _ListCall(nh, args[nh:])
        torch_ops.close_window()
        if self._clist is None:
            outs = self._run_each(list(args[:nh]) + call.tensor_inputs, nh, bool(return_hidden_states), call)
        else:
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
