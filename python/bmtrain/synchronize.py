"""synchronize, sum_loss, gather_result, wait_loader (BMTrain's bmtrain.synchronize)."""
from . import _C


def synchronize():
    """Barrier over the world that also waits for this rank's queued device work."""
    _C.synchronize()


def sum_loss(loss, comm=None):
    """The mean of `loss` over the world (BMTrain's name: it has always returned the mean)."""
    if comm is not None:
        return _C.all_reduce(loss, "avg", comm)
    return _C.sum_loss(loss)


def gather_result(result):
    """All-gathers along dim 0 over the world: (B, ...) -> (B * world_size, ...)."""
    return _C.gather_result(result)


def wait_loader():
    """BMTrain's internal throttle of the parameter loader; the engine orders its streams by events itself."""
