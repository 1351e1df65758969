"""bmtrain.benchmark: timings of the engine's collectives over the world (BMTrain's all_gather, reduce_scatter and
send_recv benchmarks, which bmtrain also imports so that bmt.benchmark works without an extra import). Sizes run
from 1 KiB up to max_nbytes (BMTrain's go to 4 GiB)."""
import time

import torch

from .. import _C
from ..global_var import config
from ..utils import print_rank


def _sizes(max_nbytes):
    n = 1024
    while n <= max_nbytes:
        yield n
        n *= 4


def _run(name, fn, max_nbytes, repeat):
    results = []
    for nbytes in _sizes(max_nbytes):
        x = torch.ones(max(1, nbytes // 2), dtype=torch.half, device=config["device"])
        fn(x)
        _C.synchronize()
        start = time.perf_counter()
        for _ in range(repeat):
            fn(x)
        _C.synchronize()
        seconds = (time.perf_counter() - start) / repeat
        results.append((nbytes, seconds))
        print_rank(f"{name} {nbytes / 1024:>12.0f} KiB  {seconds * 1e3:9.3f} ms  {nbytes / seconds / 1e9:8.2f} GB/s")
    return results


def all_gather(max_nbytes=64 << 20, repeat=10):
    return _run("all_gather", lambda x: _C.raw_all_gather(x, None), max_nbytes, repeat)


def reduce_scatter(max_nbytes=64 << 20, repeat=10):
    ws = config["world_size"]
    return _run("reduce_scatter", lambda x: _C.raw_reduce_scatter(x[: x.numel() // ws * ws], "sum", None) if
                x.numel() >= ws else x, max_nbytes, repeat)


def send_recv(max_nbytes=64 << 20, repeat=10):
    """Even ranks send to the next rank, odd ranks receive from the previous one (BMTrain's pairing); with an odd
    world size the last rank idles."""
    r, ws = config["rank"], config["world_size"]
    peer = r + 1 if r % 2 == 0 else r - 1
    comm = config["comm"]

    def once(x):
        if peer < ws:
            _C.nccl.batch_p2p([(r % 2 == 0, x, peer)], comm)
    return _run("send_recv", once, max_nbytes, repeat)
