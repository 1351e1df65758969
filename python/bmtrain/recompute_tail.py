"""The recompute's tail linears: GEMMs whose results a checkpointed Block's recompute never reads (bmt.torch_ops).

A checkpointed Block runs its forward again in the backward to rebuild the graph; the outputs of that recompute
are only the roots of the backward (autograd needs their grad_fn, not their values). In a GPT layer written with
torch's ops the output is `x + F.linear(h, w_proj, b_proj)`: in the recompute that GEMM (a third of the layer's
forward FLOPs, ~6% of a checkpointed 1.3B step) computes values nobody reads.

While a recompute runs (and the switch is on), a routed F.linear with a bias returns its output *deferred*: the
autograd node without the GEMM (_C.nn.linear_deferred, linear_after_gelu(compute=False) or, routed to FP8,
fp8_linear(compute=False)), its values NaN.
Every later call the routing mode sees that takes a deferred tensor first computes it (_C.nn.linear_fill: the same
GEMM), except an addition of two tensors, whose result is deferred in turn (computed on the NaNs now, computed
again from its operands if it is used). When the Block's run ends, a deferred tensor that is one of the
Block's outputs, or only feeds such outputs through additions, stays uncomputed; every other one is computed then
(saved or stored values are correct before any backward reads them).

What the mode cannot see is a C++ extension called with a deferred tensor: it would read the NaNs (a NaN loss, not
silently wrong gradients). bmtrain's own layers, losses and collectives compute their inputs first (materialize()).
Switch: BMT_RECOMPUTE_SKIP_TAIL=1 (or set_enabled(True)); off by default until it has been measured on GPUs.
"""
import threading
import weakref

import torch

from . import _C

_ADD_FUNCS = {torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.add, torch.add}
# calls that read no values: they neither compute a deferred tensor nor make its result deferred
_METADATA = {f for f in (getattr(getattr(torch.Tensor, name, None), "__get__", None) for name in (
    "shape", "dtype", "device", "requires_grad", "is_cuda", "ndim", "grad_fn", "is_leaf", "layout"))
    if f is not None} | {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride,
                         torch.Tensor.is_contiguous}


def enabled():
    """BMT_RECOMPUTE_SKIP_TAIL (the engine's switch, which the C++ GPT's fused MLP reads too)."""
    return _C.recompute_skip_tail_enabled()


def set_enabled(on):
    """Turns the deferral on or off (returns the previous setting)."""
    prev = enabled()
    _C.set_recompute_skip_tail_enabled(bool(on))
    return prev


class _Entry:
    __slots__ = ("ref", "fill", "operands", "consumers")

    def __init__(self, tensor, fill, operands=()):
        self.ref = weakref.ref(tensor)
        self.fill = fill              # fill(tensor): writes its values
        self.operands = list(operands)  # keys of deferred tensors an addition read
        self.consumers = []           # keys of deferred additions that read this one


_tls = threading.local()  # active: a recompute at the outermost routed run of this thread
_deferred = {}            # id(tensor) -> _Entry, while a recompute runs
counts = {"deferred": 0, "skipped": 0}  # linears deferred, and of those never computed (tests, benchmarks)


def active():
    return getattr(_tls, "active", False)


def begin(depth):
    """At the start of a routed Block run (depth: 1 for the outermost): returns the previous state for end()."""
    prev = active()
    _tls.active = depth == 1 and _C.recompute_phase() == 2 and enabled()
    return prev


def _key_of(t):
    e = _deferred.get(id(t))
    return id(t) if e is not None and e.ref() is t else None


def _fp8_fill(x, w, b, scales, out):
    with torch.no_grad():  # the FP8 forward the first run computed (same casts, same GEMM; its delayed scales)
        out.copy_(_C.nn.fp8_linear(x, w, b, None, None, True, scales))


def defer_linear(x, w, b, y, fp8=False, scales=None):
    """Registers y, a routed linear's deferred output (x, w, b: what linear_fill, or with fp8 the FP8 forward with
    the linear's delayed scales, if any, needs to compute it)."""
    _deferred[id(y)] = _Entry(y, (lambda out: _fp8_fill(x, w, b, scales, out)) if fp8 else
                              (lambda out: _C.nn.linear_fill(x, w, b, out)))
    counts["deferred"] += 1


def _compute(key):
    e = _deferred.pop(key, None)
    if e is None:
        return
    for k in e.operands:  # an addition: its deferred operands first
        _compute(k)
    t = e.ref()
    if t is not None:
        e.fill(t)


def materialize(*tensors):
    """Computes any deferred tensor among `tensors` (for code the routing mode does not see)."""
    if not _deferred:
        return
    for t in tensors:
        if isinstance(t, torch.Tensor):
            k = _key_of(t)
            if k is not None:
                _compute(k)


def _tensor_keys(args, kwargs):
    keys = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            k = _key_of(a)
            if k is not None:
                keys.append(k)
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    k = _key_of(b)
                    if k is not None:
                        keys.append(k)
    return keys


def intercept(func, args, kwargs):
    """Called by the routing mode for every call while something is deferred: returns the call's result when it
    handled it (a deferred addition), else None after computing the deferred inputs."""
    if func in _METADATA:
        return None
    keys = _tensor_keys(args, kwargs)
    if not keys:
        return None
    if (func in _ADD_FUNCS and not kwargs and len(args) == 2 and all(isinstance(a, torch.Tensor) for a in args)
            and active()):
        out = func(*args)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            def redo(t, func=func, args=args):
                with torch.no_grad():
                    t.copy_(func(*args))
            _deferred[id(out)] = _Entry(out, redo, keys)
            for k in keys:
                _deferred[k].consumers.append(id(out))
            return out
        for k in keys:  # (not a graph value: compute the inputs and this result again)
            _compute(k)
        return func(*args)
    for k in keys:
        _compute(k)
    return None


def end(prev, outputs, completed=True):
    """At the end of the routed run begun with begin(): leaves uncomputed what only feeds `outputs` (the Block's
    output tensors), computes every other deferred tensor, restores the previous state. completed=False (the run
    raised): only forgets what was deferred."""
    try:
        if active() and _deferred and completed:
            keep = set()
            for o in outputs or ():
                if isinstance(o, torch.Tensor):
                    k = _key_of(o)
                    if k is not None:
                        keep.add(k)
            grown = True
            while grown:  # operands whose every consumer is kept
                grown = False
                for k, e in _deferred.items():
                    if k not in keep and e.consumers and all(c in keep for c in e.consumers):
                        keep.add(k)
                        grown = True
            counts["skipped"] += sum(1 for k in keep if not _deferred[k].operands)
            for k in [k for k in _deferred if k not in keep]:
                _compute(k)
    finally:
        if active():
            _deferred.clear()
        _tls.active = prev


class Materializing:
    """A bmtrain._C submodule whose functions compute their deferred tensor arguments first (bmt.nn's layers call
    the engine's ops directly, where the routing mode does not see them). Wrappers are made once, as attributes."""

    def __init__(self, module):
        for name in dir(module):
            f = getattr(module, name)
            if name.startswith("__") or not callable(f) or isinstance(f, type):
                continue

            def call(*args, _f=f, **kwargs):
                if _deferred:
                    materialize(*args, *kwargs.values())
                return _f(*args, **kwargs)
            call.__name__, call.__doc__ = name, f.__doc__
            setattr(self, name, call)
        self._module = module

    def __getattr__(self, name):  # anything not wrapped (classes, constants)
        return getattr(self._module, name)
