"""print_block, print_dict, print_rank, see_memory, AverageRecorder, main_grad (BMTrain's bmtrain.utils)."""
import sys

import torch

from . import _C
from .global_var import config


def print_rank(*args, rank=0, **kwargs):
    """print() on one rank only."""
    if config["rank"] == rank:
        print(*args, **kwargs)


def print_block(title, content=None, file=sys.stdout):
    if title is not None:
        print("=" * 60, file=file)
        print(title.center(60), file=file)
    print("=" * 60, file=file)
    if content is not None:
        print(content, file=file)
        print("=" * 60, file=file)


def print_dict(title, content, file=sys.stdout):
    lines = [f"{k}: {v}" for k, v in content.items()]
    print_block(title, "\n".join(lines), file=file)


def see_memory(message, detail=False):
    """Prints the allocated and peak device memory on rank 0 (and the engine's parameter / gradient bytes), then
    resets the peak."""
    stats = _C.memory_stats()
    if config["rank"] == 0:
        if detail and torch.cuda.is_available() and config.get("device", torch.device("cpu")).type == "cuda":
            print(torch.cuda.memory_summary())
        gib = 1024 ** 3
        print_block(message, f"allocated {stats['device_allocated_nbytes'] / gib:.2f} GiB, peak "
                             f"{stats['device_peak_nbytes'] / gib:.2f} GiB; shards {stats['shard_nbytes'] / gib:.2f} "
                             f"GiB, gathered {stats['gathered_nbytes'] / gib:.2f} GiB, gradients "
                             f"{stats['grad_nbytes'] / gib:.2f} GiB")
    _C.reset_peak_memory_stats()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def main_grad(param):
    """The gradient the optimizers read for `param`: a DistributedParameter's slice of its gradient shard (in a
    Block, by default, the parameter's dtype and the same tensor as param.grad; an fp32 shard with
    Block(..., reduce_dtype=torch.float32) or for a half-precision parameter outside any Block, whose .grad stays
    None), else param.grad. None for a frozen parameter."""
    g = _C.main_grad(param)
    return param.grad if g is None else g


def load_nccl_pypi():
    """BMTrain loads NCCL from the nvidia-nccl pip package here; bmtrain links the NCCL torch uses, so there is
    nothing to do."""


class AverageRecorder:
    """Exponential moving average of a value (BMTrain's utils.AverageRecorder)."""

    def __init__(self, alpha=0.9, start_value=0):
        self._value = start_value
        self.alpha = alpha
        self._steps = 0

    def record(self, v):
        if isinstance(v, torch.Tensor):
            v = v.item()
        self._value = self._value * self.alpha + (1 - self.alpha) * v
        self._steps += 1

    @property
    def value(self):
        if self._steps <= 0:
            return self._value
        return self._value / (1 - pow(self.alpha, self._steps))
