"""save / load (BMTrain's bmtrain.store), the object collectives BMTrain's store has (allgather_objects,
broadcast_object, DistributedStateDictWrapper), and the sharded, resharding checkpoints of the C++ engine.

save(model, path) writes one file with the unwrapped model's keys: .safetensors, or torch.save's format under any
other name (.pt, .ckpt, .bin, ...: BMTrain saves with torch.save whatever the extension), written atomically
(temporary file, fsync, rename) by the engine, which streams one parameter at a time instead of holding the whole
model on rank 0. load(model, path) reads files saved by torch.save or BMTrain as well.
State-dict hooks: a model with state_dict hooks (_register_state_dict_hook, register_state_dict_pre_hook) is saved
through model.state_dict() (the hooks run, as in BMTrain's save), and one with load_state_dict hooks, or whose file
holds tensors of another dtype than the model's (converted, as torch's load_state_dict does), is loaded through
model.load_state_dict(); these paths hold the whole model in host memory (rank 0 for save, every rank for load).
"""
import json
import os
import pickle
from collections.abc import Mapping

import torch
from torch.nn.modules.module import _IncompatibleKeys

from . import _C
from ._holder import holder_of
from .global_var import config

_async_keepalive = []  # holders of asynchronous checkpoint saves still in flight
_SCHEDULERS_KEY = "bmtrain.python.lr_schedulers"  # checkpoint metadata: the Python LR schedulers' states (JSON)


def _has_save_hooks(model):
    return any(m._state_dict_hooks or m._state_dict_pre_hooks for m in model.modules())


def _has_load_hooks(model):
    return any(m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks for m in model.modules())


def _save_state_atomic(state, file_name):
    """Writes `state` (torch.save's format, or safetensors by name) to a temporary file, fsyncs it and renames it
    over file_name: no half-written file under the final name."""
    tmp = f"{file_name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            if file_name.endswith(".safetensors"):
                import safetensors.torch
                f.write(safetensors.torch.save({k: v.contiguous() for k, v in state.items()}))
            else:
                torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file_name)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save(model, file_name, non_blocking=False):
    """BMTrain's save. Collective (every rank takes part in the gathers). non_blocking is accepted for
    compatibility; the consolidated save completes before returning (use save_checkpoint(..., async_save=True)
    for a background save)."""
    file_name = str(file_name)
    if _has_save_hooks(model):
        state = model.state_dict()  # collective; runs the hooks
        if config["rank"] == 0:
            _save_state_atomic(state, file_name)
        _C.synchronize()
        return
    _C.save_consolidated(holder_of(model), file_name)


def _load_file(file_name):
    if file_name.endswith(".safetensors"):
        import safetensors.torch
        return safetensors.torch.load_file(file_name)
    try:
        return torch.load(file_name, map_location="cpu", mmap=True)
    except RuntimeError:  # not a zip archive (legacy format): mmap is not possible
        return torch.load(file_name, map_location="cpu")


_DTYPE_NAMES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}


def _dtypes_differ(model, file_name):
    want = {k: v.dtype for k, v in model.named_parameters()}
    want.update({k: v.dtype for k, v in model.named_buffers()})
    have = _C.tensor_file_dtypes(file_name)
    return any(k in want and want[k] != _DTYPE_NAMES.get(dt) for k, dt in have.items())


def load(model, file_name, strict=True):
    """BMTrain's load: every rank keeps its shard of each tensor; tensors of another dtype are converted (as torch's
    load_state_dict does). Returns torch's (missing_keys, unexpected_keys)."""
    file_name = str(file_name)
    if _has_load_hooks(model) or _dtypes_differ(model, file_name):
        return model.load_state_dict(_load_file(file_name), strict=strict)
    missing, unexpected = _C.load_consolidated(holder_of(model), file_name, strict)
    return _IncompatibleKeys(missing, unexpected)


def _bytes_tensor(obj):
    data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(config.get("device", "cpu"))


def allgather_objects(obj):
    """BMTrain's allgather_objects: every rank's picklable `obj`, in rank order, on every rank (collective)."""
    if config["world_size"] == 1:
        return [obj]
    mine = _bytes_tensor(obj)
    sizes = _C.raw_all_gather(torch.tensor([mine.numel()], device=mine.device), None).view(-1).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=mine.device)
    padded[: mine.numel()] = mine
    gathered = _C.raw_all_gather(padded, None).view(len(sizes), -1).cpu()
    return [pickle.loads(gathered[i, : sizes[i]].numpy().tobytes()) for i in range(len(sizes))]


def broadcast_object(obj, comm, src=0):
    """BMTrain's broadcast_object: rank `src` of `comm` pickles `obj`; every rank of `comm` returns it."""
    device = config.get("device", torch.device("cpu"))
    if comm.rank() == src:
        data = _bytes_tensor(obj)
        _C.raw_broadcast(torch.tensor([data.numel()], device=device), src, comm)
        _C.raw_broadcast(data, src, comm)
        return obj
    size = int(_C.raw_broadcast(torch.zeros(1, dtype=torch.int64, device=device), src, comm).item())
    data = _C.raw_broadcast(torch.zeros(size, dtype=torch.uint8, device=device), src, comm)
    return pickle.loads(data.cpu().numpy().tobytes())


class DistributedStateDictWrapper(Mapping):
    """BMTrain's DistributedStateDictWrapper: a state dict that only rank 0 holds, read on every rank (each
    access is collective over the world: keys, len and `in` are broadcast from rank 0, and `wrapper[key]` returns
    rank 0's tensor on every rank, on the CPU). So `model.load_state_dict(DistributedStateDictWrapper(sd))` loads
    rank 0's state everywhere. (BMTrain returns a tensor-like wrapper whose .broadcast() fetches the tensor; here
    the item is the tensor itself.)"""

    def __init__(self, state_dict):
        self._state_dict = state_dict
        self._metadata = broadcast_object(getattr(state_dict, "_metadata", None), config["comm"])

    def __getitem__(self, key):
        comm = config["comm"]
        head = broadcast_object((tuple(self._state_dict[key].shape), self._state_dict[key].dtype)
                                if comm.rank() == 0 else None, comm)
        shape, dtype = head
        device = config.get("device", torch.device("cpu"))
        x = self._state_dict[key].to(device).contiguous() if comm.rank() == 0 else torch.empty(shape, dtype=dtype,
                                                                                                 device=device)
        return _C.raw_broadcast(x, 0, comm).cpu()

    def copy(self):
        return self

    def __len__(self):
        return broadcast_object(len(self._state_dict), config["comm"])

    def __contains__(self, key):
        return broadcast_object(key in self._state_dict, config["comm"])

    def keys(self):
        return broadcast_object(list(self._state_dict.keys()), config["comm"])

    def __iter__(self):
        return iter(self.keys())


def _components(optim_manager, optimizers):
    from .optim.adam import _BmtOptimizer
    comps = []
    if optim_manager is not None:
        optim_manager._sync()
        comps.append(("optim_manager", optim_manager._c))
    for i, o in enumerate(optimizers or []):
        if not isinstance(o, _BmtOptimizer):
            raise TypeError(f"save_checkpoint / load_checkpoint: optimizers[{i}] is {type(o).__name__}, not a bmtrain "
                            "optimizer; save a torch optimizer's state_dict() with torch.save")
        o._push_options()
        comps.append((f"optimizer{i}", o._c))
    return comps


def _schedulers(optim_manager, lr_schedulers):
    out = [s for s in (optim_manager.lr_schedulers if optim_manager is not None else []) if s is not None]
    return out + list(lr_schedulers or [])


def _pull_options(optim_manager, optimizers):
    from .optim.adam import _BmtOptimizer
    for o in list(optim_manager.optimizers if optim_manager is not None else []) + list(optimizers or []):
        if isinstance(o, _BmtOptimizer):
            o._pull_options()


def load_hf_safetensors(model, directory, name_map, strict=True, ignore=()):
    """Loads a Hugging Face directory (config.json + model.safetensors, or shards named by
    model.safetensors.index.json) into `model` without a full copy per rank: the files are memory-mapped and every
    rank copies only the elements of its own shards (src/bmt/checkpoint/hf_dir.h). name_map: {our state_dict key:
    HF tensor name, or (HF tensor name, transpose)}. Returns (missing_keys, unexpected_keys, bytes_copied)."""
    pairs = {k: (v, False) if isinstance(v, str) else (str(v[0]), bool(v[1])) for k, v in name_map.items()}
    return _C.load_hf_safetensors(holder_of(model), str(directory), pairs, strict, list(ignore))


def prepare_async_save(model, optim_manager=None, *, optimizers=None, lr_schedulers=None):
    """Collective. Call once the model and optimizer exist (before the training loop) when you will save with
    save_checkpoint(..., async_save=True): it starts allocating (pinning, on GPUs) this rank's host buffers for such
    a save on a background thread and returns at once, so that the first async save does not pin its whole shard
    file inside the call (7.2 s at gpt-1.3b on an H200; later saves reuse the buffers: 0.12 s). A save issued before
    the buffers are ready waits for them."""
    _C.checkpoint_prepare_async_save(holder_of(model), _components(optim_manager, optimizers, lr_schedulers))


def save_checkpoint(directory, model, optim_manager=None, step=0, *, optimizers=None, lr_schedulers=None,
                    async_save=False, metadata=None):
    """Sharded checkpoint (one file per rank, checksummed, committed atomically) of the model and the optimizer
    state (through the OptimManager: optimizers, LR schedulers, loss scale), loadable at any world size and
    tensor-parallel size. async_save: returns once the state is copied (to GPU memory when it has room, else to
    host memory); the write runs in the background (the next save or load waits for it). Returns a handle whose wait() gives the statistics."""
    holder = holder_of(model)
    meta = dict(metadata or {})
    if _SCHEDULERS_KEY in meta:
        raise ValueError(f"save_checkpoint: metadata key {_SCHEDULERS_KEY!r} is reserved")
    scheds = [s.state_dict() for s in _schedulers(optim_manager, lr_schedulers)]
    try:
        meta[_SCHEDULERS_KEY] = json.dumps(scheds)
    except TypeError as e:
        raise TypeError(f"save_checkpoint: an LR scheduler's state_dict() is not JSON-serialisable ({e}); save it "
                        "with torch.save instead") from None
    handle = _C.checkpoint_save(str(directory), holder, _components(optim_manager, optimizers), step, async_save, meta)
    if async_save:
        _async_keepalive[:] = [holder]
    return handle


def load_checkpoint(directory, model, optim_manager=None, *, optimizers=None, lr_schedulers=None, strict=True,
                    rng=True):
    """Loads a sharded checkpoint saved by save_checkpoint (the directory, or a parent with a `latest` link) at any
    world size. Returns a dict: path, step, saved_world_size, metadata, missing_keys, unexpected_keys."""
    info = _C.checkpoint_load(str(directory), holder_of(model), _components(optim_manager, optimizers), strict, rng)
    _pull_options(optim_manager, optimizers)
    meta = dict(info["metadata"])
    saved = json.loads(meta.pop(_SCHEDULERS_KEY, "[]"))
    scheds = _schedulers(optim_manager, lr_schedulers)
    if scheds and len(saved) != len(scheds):
        raise RuntimeError(f"load_checkpoint: the checkpoint holds {len(saved)} LR scheduler states, but "
                           f"{len(scheds)} schedulers were given (through the OptimManager and lr_schedulers=)")
    for s, st in zip(scheds, saved):
        s.load_state_dict(st)
    info["metadata"] = meta
    return info
