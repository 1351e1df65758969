"""bmtrain.distributed: differentiable collectives (BMTrain's bmtrain.distributed), run by the engine's
communicators. comm=None means the world (bmt.config["comm"]).

Gradients: all_gather's backward keeps the local slice of the gradient, as BMTrain's does (the computation after
it is replicated over the group). all_reduce, reduce_scatter and broadcast follow the engine's convention (the
objective is the sum of every rank's loss): all_reduce(sum)'s backward all-reduces the gradient, reduce_scatter's
all-gathers it, broadcast's sums every rank's gradient into the root. (BMTrain's all_reduce backward is the
identity and its broadcast backward an all-reduce.)
"""
import torch

from .. import _C


class _AllGatherLocalGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.rank = comm.rank() if comm is not None else _C.config()["rank"]
        return _C.raw_all_gather(x.contiguous(), comm)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank], None


def all_gather(x, comm=None):
    """(ws, *x.shape): every rank's x stacked along a new first dim."""
    return _AllGatherLocalGrad.apply(x, comm)


def all_reduce(x, op="sum", comm=None):
    """op in sum, avg, max, min, prod."""
    return _C.all_reduce(x.contiguous(), op, comm)


def reduce_scatter(x, op="sum", comm=None):
    """x.shape[0] must be divisible by the group size; returns (x.shape[0] / ws, ...)."""
    return _C.reduce_scatter(x.contiguous(), op, comm)


def broadcast(x, src, comm=None):
    return _C.broadcast(x.contiguous(), src, comm)


def send_activations(hidden_state, next_rank, comm):
    """Sends a tensor with its shape and dtype to `next_rank` of `comm` (not differentiable)."""
    _C.send_activations(hidden_state.contiguous(), next_rank, comm)


def recv_activations(prev_rank, comm):
    return _C.recv_activations(prev_rank, comm)
