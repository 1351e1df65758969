"""bmtrain.nccl: BMTrain's NCCL wrapper API over the engine's communicators (bmt.config["comm"], "tp_comm",
"pipe_comm", ... are bmtrain._C.Communicator objects: NCCL on GPUs, Gloo on CPU ranks).

Buffers are what BMTrain's scripts pass: storages (`x.storage()`, typed or untyped) or tensors (contiguous); the
result is written into `dst` in place, on the current stream. allReduce, broadcast, reduce, allGather,
reduceScatter, send, recv, commCount, commRank, groupStart / groupEnd (operations issued between them run when
groupEnd is called; sends and receives as one batch, so an exchange cannot deadlock) work on any communicator.
Creating or destroying communicators by hand (getUniqueId, commInitRank, commDestroy) is not possible: the engine
creates them in bmt.init_distributed; these raise NotImplementedError saying so.
"""
import torch

from .. import _C
from .enums import *  # noqa: F401,F403
from .enums import (ncclAvg, ncclBFloat16, ncclBool, ncclDouble, ncclFloat, ncclFloat16, ncclFloat32, ncclFloat64,
                    ncclHalf, ncclInt8, ncclInt32, ncclInt64, ncclMax, ncclMin, ncclProd, ncclSum, ncclUint8)

NCCLCommunicator = _C.Communicator  # what bmt.config's communicators are

_group = None  # operations queued between groupStart() and groupEnd()


def dtype2nccl(dtype):
    table = {torch.int8: ncclInt8, torch.uint8: ncclUint8, torch.int32: ncclInt32, torch.int64: ncclInt64,
             torch.float16: ncclFloat16, torch.half: ncclHalf, torch.bfloat16: ncclBFloat16,
             torch.float32: ncclFloat32, torch.float: ncclFloat, torch.float64: ncclFloat64,
             torch.double: ncclDouble, torch.bool: ncclBool}
    if dtype not in table:
        raise TypeError("Unsupport dtype %s" % dtype)
    return table[dtype]


def op2nccl(op):
    table = {"sum": ncclSum, "prod": ncclProd, "max": ncclMax, "min": ncclMin, "avg": ncclAvg}
    if op not in table:
        raise ValueError(f"Unknown gather op {op}")
    return table[op]


def _unsupported(name):
    raise NotImplementedError(f"bmtrain.nccl.{name}: communicators are created by bmt.init_distributed() and owned "
                              "by the engine; use bmt.config['comm'] (the world), 'tp_comm', 'pipe_comm', "
                              "'zero_comm', ... instead of creating one by hand")


def getUniqueId():
    _unsupported("getUniqueId")


def commInitRank(unique_id, world_size, rank):
    _unsupported("commInitRank")


def commDestroy(comm):
    _unsupported("commDestroy")


def commCount(comm):
    """The number of ranks of `comm`."""
    return comm.size()


def commRank(comm):
    """This process's rank in `comm`."""
    return comm.rank()


def _tensor(buf):
    """A 1-D tensor over the whole buffer (a storage or a contiguous tensor), sharing its memory."""
    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise ValueError("bmtrain.nccl: a tensor buffer must be contiguous")
        return buf.view(-1)
    if isinstance(buf, torch.TypedStorage):
        return torch.tensor([], dtype=buf.dtype, device=buf.device).set_(buf)
    if isinstance(buf, torch.UntypedStorage):
        return torch.tensor([], dtype=torch.uint8, device=buf.device).set_(buf)
    raise TypeError(f"bmtrain.nccl: expected a storage or a tensor, got {type(buf).__name__}")


def _run(fn, *args):
    if _group is not None:
        _group.append((fn, args))
    else:
        fn(*args)


def allReduce(src, dst, op, comm):
    op2nccl(op)
    _run(_C.nccl.all_reduce, _tensor(src), _tensor(dst), op, comm)


def broadcast(src, dst, root, comm):
    _run(_C.nccl.broadcast, _tensor(src), _tensor(dst), int(root), comm)


def _reduce(src, dst, op, root, comm):
    out = torch.empty_like(src)
    _C.nccl.all_reduce(src, out, op, comm)
    if comm.rank() == root:  # NCCL writes dst on the root only
        dst.copy_(out)


def reduce(src, dst, op, root, comm):
    op2nccl(op)
    if not 0 <= root < comm.size():
        raise ValueError(f"bmtrain.nccl.reduce: root {root} is not a rank of a group of {comm.size()}")
    s, d = _tensor(src), _tensor(dst)
    if s.numel() != d.numel():
        raise ValueError(f"bmtrain.nccl.reduce: src has {s.numel()} elements but dst {d.numel()}")
    _run(_reduce, s, d, op, int(root), comm)


def allGather(src, dst, comm):
    _run(_C.nccl.all_gather, _tensor(src), _tensor(dst), comm)


def reduceScatter(src, dst, op, comm):
    op2nccl(op)
    _run(_C.nccl.reduce_scatter, _tensor(src), _tensor(dst), op, comm)


def send(src, peer, comm):
    _run(_C.nccl.batch_p2p, [(True, _tensor(src), int(peer))], comm)


def recv(dst, peer, comm):
    _run(_C.nccl.batch_p2p, [(False, _tensor(dst), int(peer))], comm)


def groupStart():
    """Queues the following operations until groupEnd()."""
    global _group
    if _group is not None:
        raise RuntimeError("bmtrain.nccl.groupStart: a group is already open (call groupEnd first)")
    _group = []


def groupEnd():
    """Runs the queued operations in order; consecutive sends and receives on one communicator go as one batch."""
    global _group
    if _group is None:
        raise RuntimeError("bmtrain.nccl.groupEnd without groupStart")
    ops, _group = _group, None
    i = 0
    while i < len(ops):
        fn, args = ops[i]
        if fn is _C.nccl.batch_p2p:
            batch, comm = list(args[0]), args[1]
            while i + 1 < len(ops) and ops[i + 1][0] is _C.nccl.batch_p2p and ops[i + 1][1][1] is comm:
                i += 1
                batch += ops[i][1][0]
            fn(batch, comm)
        else:
            fn(*args)
        i += 1
