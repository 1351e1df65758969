"""init_distributed: rendezvous, device, communicators and bmt.config (BMTrain's bmtrain.init)."""
import os

import torch

from . import _C
from .global_var import config


class Topology:
    """BMTrain's rank layout: world = pipe_size stages of contiguous ranks, tensor-parallel groups of tp_size
    consecutive ranks inside a stage. The ids below are the C++ engine's (bmt::Config)."""

    def __init__(self, c):
        r, world, tp, pp = c["rank"], c["world_size"], c["tp_size"], c["pipe_size"]
        stage_size = world // pp
        self.stages = pp
        self.pipe_idx, self.stage_id = r % stage_size, r // stage_size
        self.tp_id, self.tp_idx = r % tp, r // tp
        self.pp_zero_idx, self.pp_zero_id = self.stage_id, self.pipe_idx
        self.tp_zero_idx, self.tp_zero_id = self.tp_id, self.tp_idx
        self.pp_tp_zero_idx, self.pp_tp_zero_id = self.stage_id * tp + self.tp_id, self.pipe_idx // tp
        self.zero_idx, self.zero_id = 0, r
        # The engine's own ranks agree with these (bmt::Config); checked so a layout change cannot go unnoticed.
        assert self.stage_id == c["pipe_rank"] and self.tp_id == c["tp_rank"], "topology differs from the engine's"

    def get_group_id(self, group_name):
        return {"pipe": self.pipe_idx, "zero": self.zero_idx, "tp_zero": self.tp_zero_idx, "tp": self.tp_idx}[group_name]

    def get_group_rank(self, group_name):
        return {"pipe": self.stage_id, "zero": self.zero_id, "tp_zero": self.tp_zero_id, "tp": self.tp_id}[group_name]

    def __repr__(self):
        return (f"Topology(stage_id={self.stage_id}, pipe_idx={self.pipe_idx}, tp_id={self.tp_id}, "
                f"tp_idx={self.tp_idx}, zero_id={self.zero_id}, tp_zero_id={self.tp_zero_id})")


def _cuda_stream(t):
    if t is None:
        return None
    stream_id, device_index, device_type = t
    return torch.cuda.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type)


def init_distributed(init_method="env://", seed=0, pipe_size=-1, num_micro_batches=None, tp_size=1, *,
                     zero_level=3, backend="auto", timeout=None, sequence_parallel=True, quiet=False):
    """BMTrain's init_distributed. Reads torchrun's / bmtrun's / Slurm's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT), picks the GPU LOCAL_RANK (NCCL) or CPU ranks over Gloo when no GPU is visible,
    seeds the RNGs and creates the communicators. Keyword-only extras: zero_level (default of Blocks), backend
    ("auto", "nccl", "gloo"), timeout (seconds for every blocking wait; env BMT_TIMEOUT_S overrides)."""
    if init_method not in (None, "env://"):
        raise ValueError(f"init_method {init_method!r} is not supported: bmtrain rendezvous through env:// "
                         "(MASTER_ADDR / MASTER_PORT, as torchrun sets them)")
    if config["initialized"]:
        raise RuntimeError("bmtrain is already initialized: call init_distributed once per process")
    pipe = pipe_size if pipe_size > 0 else 1
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"init_distributed: tp_size must be an integer >= 1 (the ranks of one tensor-parallel "
                         f"group), got {tp_size!r}; pass tp_size=1 for no tensor parallelism (BMTrain silently "
                         "used 1 for values below 1)")
    tp = tp_size
    if pipe > 1 and tp > 1:
        raise NotImplementedError(f"init_distributed(pipe_size={pipe}, tp_size={tp}): the Python package does not "
                                  "combine pipeline and tensor parallelism yet (the C++ engine does: train_gpt --pp "
                                  "--tp); use one of them")
    if num_micro_batches is not None and num_micro_batches < 1:
        raise ValueError(f"init_distributed: num_micro_batches must be >= 1, got {num_micro_batches}")
    _C.init_distributed(seed=seed, tp_size=tp, pipe_size=pipe, zero_level=zero_level,
                        backend=backend, timeout_s=float(timeout or 0), sequence_parallel=sequence_parallel,
                        quiet=quiet, num_micro_batches=num_micro_batches or 0)
    c = _C.config()
    config.update(c)
    config["device"] = torch.device(c["device"])
    config["pipe_enabled"] = pipe_size > 0
    if pipe_size > 0:
        config["micros"] = num_micro_batches or pipe
        # BMTrain's groups: parameters outside the pipeline shard over the world (zero_comm), a stage's layers over
        # the stage's data-parallel group (pp_zero_comm).
        config["pp_zero_comm"] = c["zero_comm"]
        config["zero_comm"] = c["comm"]
    config["num_micro_batches"] = num_micro_batches
    config["calc_stream"] = _cuda_stream(c["calc_stream"])
    config["load_stream"] = _cuda_stream(c["load_stream"])
    config["tp_comm_stream"] = _cuda_stream(c["tp_comm_stream"])
    config["pp_comm_stream"] = _cuda_stream(c["pp_comm_stream"])
    config["topology"] = Topology(c)
    config.setdefault("save_param_to_cpu", True)
    config["initialized"] = True
    if config["device"].type == "cuda":
        torch.cuda.set_device(config["device"])


def is_initialized():
    return config["initialized"]
