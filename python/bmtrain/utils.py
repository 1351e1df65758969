"""print_block, print_dict, print_rank, see_memory, round_up, check_torch_version, tp_split_tensor, AverageRecorder,
main_grad (BMTrain's bmtrain.utils);
env_switch (ours: the on/off environment switches)."""
import os
import sys

import torch

from . import _C
from .global_var import config


def env_switch(name, default):
    """An on/off environment switch (not in BMTrain): 1/on/true or 0/off/false, `default` when unset or empty; any
    other value is an error that names the variable."""
    v = os.environ.get(name, "").strip().lower()
    if v == "":
        return default
    if v in ("1", "on", "true"):
        return True
    if v in ("0", "off", "false"):
        return False
    raise ValueError(f"{name}={v!r}: use 1 (on) or 0 (off)")


def print_rank(*args, rank=0, **kwargs):
    """print() on one rank only."""
    if config["rank"] == rank:
        print(*args, **kwargs)


ROW_WIDTH = 60


def round_up(x, d):
    """(x + d - 1) // d * d"""
    return (x + d - 1) // d * d


def check_torch_version(version_str):
    """BMTrain's: the running torch's version minus `version_str` ("x.y.z"), each encoded as x*10000+y*100+z."""
    def encode(v):
        a = [int(x) for x in v.split("+")[0].split(".")[:3]]
        return a[0] * 10000 + a[1] * 100 + a[2]
    return encode(torch.__version__) - encode(version_str)


def print_block(title, content=None, file=sys.stdout):
    """BMTrain's format: the title centred in a 60-column rule of "=", then the content."""
    left = (ROW_WIDTH - len(title) - 2) // 2
    right = ROW_WIDTH - len(title) - 2 - left
    print("=" * left + " " + title + " " + "=" * right, file=file)
    if content is not None:
        print(content, file=file)


def print_dict(title, content, file=sys.stdout):
    """BMTrain's format: "key :" padded to a multiple of 4 columns, values wrapped at 60 columns."""
    width = round_up(max(len(k) for k in content.keys()) + 3, 4)
    out = ""
    for k, v in content.items():
        out += k + " :" + " " * (width - len(k) - 2)
        text = "%s" % v or " "
        row = ROW_WIDTH - width
        for st in range(0, len(text), row):
            if st > 0:
                out += " " * width
            out += text[st: st + row] + "\n"
    print_block(title, out, file)


def tp_split_tensor(tensor, split_dim):
    """This tensor-parallel rank's chunk of `tensor` along split_dim (a contiguous copy)."""
    return tensor.chunk(config["tp_size"], dim=split_dim)[config["topology"].tp_id].contiguous().clone()


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
