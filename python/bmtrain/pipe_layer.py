"""PipelineTransformerBlockList (BMTrain's bmtrain.pipe_layer), run by the C++ engine's bmt::PipelineTransformerBlockList.

Used as BMTrain's: every stage builds the whole model and calls the list with its own batch; the list returns this
stage's rows of the last stage's output, so the code before and after it (embedding, head, loss) runs
data-parallel on every rank. The stages' batches are concatenated, cut into num_micro_batches micro-batches and
pipelined (every forward in the call, every backward when autograd reaches it). The scheduling, transfers and
gradient reduction are the engine's (bmt::PipelineTransformerBlockList::forward_autograd); this file only hands it
the Blocks.
"""
import torch

from . import _C
from .block_layer import Block, BlockUsageError, _ListCall
from .global_var import config


class PipelineNotEnabledError(BlockUsageError, RuntimeError):
    """A PipelineTransformerBlockList built without init_distributed(pipe_size=N)."""


class PipelineTransformerBlockList(torch.nn.Module):
    """BMTrain's PipelineTransformerBlockList(modules, num_hidden=1), after init_distributed(pipe_size=P,
    num_micro_batches=M). Stage s runs layers get_range_by_stage_id(s) (L // P each, the first L % P stages one
    more; or partition=[...] layers per stage, keyword-only). Only this stage's layers are kept and registered
    (as children named by their global layer index, so state_dict keys are those of the unpipelined list); their
    parameters shard over the stage's data-parallel group. Modules that are not Blocks are wrapped in
    Block(module, mode="PIPE"); Blocks must be created with mode="PIPE". Keyword-only extras: partition,
    num_micro_batches (default config["micros"]), prefetch_depth."""

    def __init__(self, modules, num_hidden=1, *, partition=None, num_micro_batches=None, prefetch_depth=1):
        super().__init__()
        if not config["initialized"] or not config.get("pipe_enabled"):
            # Both an AssertionError (what BMTrain raises for a list it cannot build) and a RuntimeError.
            raise PipelineNotEnabledError("PipelineTransformerBlockList needs bmt.init_distributed(pipe_size=N) "
                                          "(N >= 1)")
        if num_hidden < 1:
            raise ValueError(f"PipelineTransformerBlockList: num_hidden must be >= 1, got {num_hidden}")
        modules = list(modules)
        blocks, seen = [], {}  # id(inner module) -> layer
        for i, m in enumerate(modules):
            if not isinstance(m, Block):
                m = Block(m, mode="PIPE")
            elif m._mode != "PIPE":
                raise BlockUsageError(f"PipelineTransformerBlockList: layer {i} is a Block(mode='BLOCK'), already "
                                      "built over the whole world; create the layers' Blocks with mode='PIPE' (or pass "
                                      "the plain modules)")
            if id(m._module) in seen:
                raise BlockUsageError(f"PipelineTransformerBlockList: layers {seen[id(m._module)]} and {i} are the "
                                      "same module; a pipeline cannot share one layer's parameters between positions (they "
                                      "may sit on different stages): give each layer its own module")
            seen[id(m._module)] = i
            blocks.append(m)
        stages, stage = config["pipe_size"], config["topology"].stage_id
        part = list(partition) if partition is not None else _C.PipelineTransformerBlockList.even_partition(
            len(blocks), stages)
        if len(part) != stages or sum(part) != len(blocks):
            raise ValueError(f"PipelineTransformerBlockList: partition {part} must give one layer count per stage "
                             f"({stages}) summing to the number of layers ({len(blocks)})")
        begin = sum(part[:stage])
        end = begin + part[stage]
        # Every rank visits every layer in the same order: the parameters were sharded over the world, and moving
        # them (to this stage's group, or away from the other stages) gathers each once over the world.
        stage_comm = config["pp_zero_comm"]
        # What init_parameters needs of the other stages' layers: their initialisers run here too (drawing the same
        # numbers from torch's generator as BMTrain, which builds every layer on every stage), so each layer and
        # every parameter after the list gets the values the unpipelined model gets.
        other_layers = {}
        for layer, b in enumerate(blocks):
            for name, p in b._module.named_parameters():
                if begin <= layer < end:
                    _C.reshard_param(p, stage_comm)
                    p._zero_comm = stage_comm
                else:
                    _C.gather_logical(p)  # the collective only; the layer is dropped here
                    other_layers.setdefault(layer, []).append(
                        (name, tuple(p._tp_original_shape), p.dtype, p._init_method))
        self.__dict__["_other_layers"] = other_layers
        self.num_hidden = num_hidden
        self.stages, self.stage_id = stages, stage
        self.pipe_idx = config["topology"].pipe_idx
        self.layer_ids = list(range(begin, end))
        self._part = part
        for layer in self.layer_ids:
            self.add_module(str(layer), blocks[layer])
        self.__dict__["_blocks"] = blocks[begin:end]
        self.__dict__["_num_layers"] = len(blocks)
        self.__dict__["_clist"] = _C.PipelineTransformerBlockList(
            len(blocks), lambda layer: blocks[layer]._build(), num_hidden,
            int(num_micro_batches or config["micros"]), "gpipe", part, prefetch_depth)

    def forward(self, *args, batch_related=None, return_hidden_states=False):
        # batch_related (BMTrain's list of per-row arguments) is accepted and not needed: an extra argument is split
        # into micro-batches when its first dimension is the batch size.
        del batch_related
        if return_hidden_states:
            raise NotImplementedError("PipelineTransformerBlockList(return_hidden_states=True) is not supported")
        nh = self.num_hidden
        if len(args) < nh:
            raise ValueError(f"PipelineTransformerBlockList: {len(args)} arguments given but num_hidden is {nh}")
        for i, h in enumerate(args[:nh]):
            if not isinstance(h, torch.Tensor):
                raise TypeError(f"PipelineTransformerBlockList: hidden state {i} must be a tensor, got "
                                f"{type(h).__name__}")
        call = _ListCall(nh, args[nh:])
        outs = self._clist.forward(list(args[:nh]) + call.tensor_inputs, call)
        return outs[0] if nh == 1 else tuple(outs)

    def __deepcopy__(self, memo):
        raise TypeError("PipelineTransformerBlockList cannot be deep-copied: each stage holds only its own layers, "
                        "resharded over its stage's group. Build a second model and load_state_dict into it")

    @property
    def num_micro_batches(self):
        return self._clist.num_micro_batches

    def get_range_by_stage_id(self, stage_id):
        """[begin, end) of the layers of stage stage_id (BMTrain returns range(begin, end))."""
        b, e = self._clist.get_range_by_stage_id(stage_id)
        return range(b, e)

    def get_part_len_by_stage_id(self, stage_id):
        return self._part[stage_id]

    def get_stage_by_layer_id(self, layer_id):
        return self._clist.get_stage_by_layer_id(layer_id)

    def __len__(self):
        return self._num_layers

    def __iter__(self):
        return iter(self._blocks)

    def __getitem__(self, index):
        return self._modules[str(index)]
