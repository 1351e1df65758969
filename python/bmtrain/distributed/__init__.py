"""bmtrain.distributed: differentiable collectives (BMTrain's bmtrain.distributed), run by the engine's
communicators. comm=None means the world (bmt.config["comm"]).

Gradients are BMTrain 1.0.1's (bmtrain/distributed/ops.py), so a BMTrain script computes the same numbers:
- all_gather: the gradient's own slice (grad[rank]);
- all_reduce: "sum" the identity, "avg" grad / world, "max"/"min" grad where this rank's input equals the result
  (0 elsewhere), "prod" grad * result / input (local: nothing is communicated);
- reduce_scatter: "sum" the all-gathered gradient, "avg" the same / world; "max"/"min"/"prod" raise
  NotImplementedError in backward, as BMTrain's;
- broadcast: the gradient all-reduced (summed) over the group, on every rank (the root's input and the others').
The C++ API (bmt::distributed, bmtrain._C.all_reduce & co.) keeps the engine's own convention (the objective is the
sum of every rank's loss: bmt/distributed.h); docs/python.md lists the difference.
"""
import torch

from .. import _C, recompute_tail


def _size(comm):
    return comm.size() if comm is not None else _C.config()["world_size"]


def _rank(comm):
    return comm.rank() if comm is not None else _C.config()["rank"]


_OPS = ("sum", "avg", "max", "min", "prod")


def _check_op(op, who):
    if op not in _OPS:
        raise ValueError(f"bmt.distributed.{who}: unknown op {op!r}; use one of {', '.join(_OPS)}")


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.rank = _rank(comm)
        return _C.raw_all_gather(x.contiguous(), comm)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank], None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, comm):
        x = x.contiguous()
        out = _C.raw_all_reduce(x, op, comm)
        ctx.op, ctx.size = op, _size(comm)
        if op in ("max", "min"):
            ctx.save_for_backward(x != out)
        elif op == "prod":
            ctx.save_for_backward(out / x)
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.op == "sum":
            return grad, None, None
        if ctx.op == "avg":
            return grad / ctx.size, None, None
        if ctx.op in ("max", "min"):
            return torch.masked_fill(grad, ctx.saved_tensors[0], 0), None, None
        return grad * ctx.saved_tensors[0], None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, comm):
        ctx.op, ctx.size, ctx.comm = op, _size(comm), comm
        return _C.raw_reduce_scatter(x.contiguous(), op, comm)

    @staticmethod
    def backward(ctx, grad):
        if ctx.op in ("max", "min", "prod"):
            raise NotImplementedError(f"bmt.distributed.reduce_scatter: op {ctx.op!r} has no backward (as in "
                                      "BMTrain); use 'sum' or 'avg'")
        g = _C.raw_all_gather(grad.contiguous(), ctx.comm).flatten(0, 1)
        return (g / ctx.size if ctx.op == "avg" else g), None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, root, comm):
        ctx.comm = comm
        return _C.raw_broadcast(x.contiguous(), root, comm)

    @staticmethod
    def backward(ctx, grad):
        return _C.raw_all_reduce(grad.contiguous(), "sum", ctx.comm), None, None


def all_gather(x, comm=None):
    """(ws, *x.shape): every rank's x stacked along a new first dim. Backward: this rank's slice of the gradient."""
    recompute_tail.materialize(x)  # (a recompute's deferred value: computed before the collective reads it)
    return _AllGather.apply(x, comm)


def all_reduce(x, op="sum", comm=None):
    """op in sum, avg, max, min, prod; backward as BMTrain's (module docstring)."""
    recompute_tail.materialize(x)  # (a recompute's deferred value: computed before the collective reads it)
    _check_op(op, "all_reduce")
    return _AllReduce.apply(x, op, comm)


def reduce_scatter(x, op="sum", comm=None):
    """x.shape[0] must be divisible by the group size; returns (x.shape[0] / ws, ...)."""
    recompute_tail.materialize(x)  # (a recompute's deferred value: computed before the collective reads it)
    _check_op(op, "reduce_scatter")
    return _ReduceScatter.apply(x, op, comm)


def broadcast(x, src, comm=None):
    """The root `src`'s x on every rank; backward: the gradient summed over the group, on every rank."""
    recompute_tail.materialize(x)  # (a recompute's deferred value: computed before the collective reads it)
    return _Broadcast.apply(x, src, comm)


def send_activations(hidden_state, next_rank, comm):
    """Sends a tensor with its shape and dtype to `next_rank` of `comm` (not differentiable)."""
    recompute_tail.materialize(hidden_state)  # (a recompute's deferred value: computed before the collective reads it)
    _C.send_activations(hidden_state.contiguous(), next_rank, comm)


def recv_activations(prev_rank, comm):
    return _C.recv_activations(prev_rank, comm)
