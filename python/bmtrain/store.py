"""save / load (BMTrain's bmtrain.store) and the sharded, resharding checkpoints of the C++ engine.

save(model, path) writes one file with the unwrapped model's keys, torch.load-able (.pt) or .safetensors, written
atomically (temporary file, fsync, rename) by the engine, which streams one parameter at a time instead of holding
the whole model on rank 0. load(model, path) reads .pt files saved by torch.save or BMTrain as well.
"""
from torch.nn.modules.module import _IncompatibleKeys

from . import _C
from ._holder import holder_of

_async_keepalive = []  # holders of asynchronous checkpoint saves still in flight


def save(model, file_name, non_blocking=False):
    """BMTrain's save. Collective (every rank takes part in the gathers). non_blocking is accepted for
    compatibility; the consolidated save completes before returning (use save_checkpoint(..., async_save=True)
    for a background save)."""
    _C.save_consolidated(holder_of(model), str(file_name))


def load(model, file_name, strict=True):
    """BMTrain's load: every rank keeps its shard of each tensor. Returns torch's (missing_keys, unexpected_keys)."""
    missing, unexpected = _C.load_consolidated(holder_of(model), str(file_name), strict)
    return _IncompatibleKeys(missing, unexpected)


def _components(optim_manager, optimizers, lr_schedulers):
    comps = []
    if optim_manager is not None:
        comps.append(("optim_manager", optim_manager._c))
    for i, o in enumerate(optimizers or []):
        comps.append((f"optimizer{i}", o._c))
    for i, s in enumerate(lr_schedulers or []):
        comps.append((f"lr_scheduler{i}", s._c))
    return comps


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
    tensor-parallel size. async_save: returns once the state is copied to host memory; the write runs in the
    background (the next save or load waits for it). Returns a handle whose wait() gives the statistics."""
    holder = holder_of(model)
    handle = _C.checkpoint_save(str(directory), holder, _components(optim_manager, optimizers, lr_schedulers),
                                step, async_save, dict(metadata or {}))
    if async_save:
        _async_keepalive[:] = [holder]
    return handle


def load_checkpoint(directory, model, optim_manager=None, *, optimizers=None, lr_schedulers=None, strict=True,
                    rng=True):
    """Loads a sharded checkpoint saved by save_checkpoint (the directory, or a parent with a `latest` link) at any
    world size. Returns a dict: path, step, saved_world_size, metadata, missing_keys, unexpected_keys."""
    return _C.checkpoint_load(str(directory), holder_of(model), _components(optim_manager, optimizers, lr_schedulers),
                              strict, rng)
