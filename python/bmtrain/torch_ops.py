"""Routes a user's torch.nn.functional calls to the engine's kernels (bmt.torch_ops).

A BMTrain user writes layers with torch's ops (F.linear, F.layer_norm, F.scaled_dot_product_attention) inside
bmt.Blocks and computes an fp32 F.cross_entropy on the logits. While a Block's forward runs (its first run and the
backward's recompute), those calls go to the engine's own ops, which compute the same function (caught by wrappers of
torch.nn.functional's functions or by a torch.overrides.TorchFunctionMode: BMT_ROUTE_MECHANISM, below run_routed):

  F.linear(x, w, b)                         -> bmtrain._C.nn.linear (CUDA: the bias gradient by our column
                                               reduction; the forward and the other gradients are torch's GEMMs)
  F.layer_norm(x, (d,), w, b, eps)          -> bmtrain._C.nn.layer_norm (CUDA: our weight/bias gradient reduction)
  F.scaled_dot_product_attention(q, k, v, is_causal=True)
                                            -> bmt.nn.causal_attention (the fused kernel torch's SDPA picks, as one
                                               autograd function: a checkpointed Block keeps its output for the
                                               recompute, recompute_keep.h)
  F.cross_entropy(logits.float(), target)   -> the engine's fused cross-entropy on the half-precision logits
                                               (fp32 statistics; no fp32 log-softmax saved, no fp32 gradient)
  F.linear(h, w, b) on h = F.gelu(pre, approximate="tanh") from the same Block run (the MLP's second linear)
                                            -> bmtrain._C.nn.linear_after_gelu ("gelu_linear"): the same forward;
                                               in the backward the gradient goes to pre with GELU's gradient done by
                                               the GEMM's DGELU epilogue (CUDA half tensors; elsewhere F.linear)

Calls outside those patterns (a mask, dropout, a 2-D normalized_shape, class weights, probabilities as targets...)
go to torch unchanged. The loss is usually computed outside any Block: after a top-level Block or
TransformerBlockList forward that records gradients, a second instance of the mode (the "loss window", which routes
only the cross-entropy) stays on the stack until the next such forward, OptimManager.backward() / zero_grad(), or
the first cross-entropy it routes. In it, `.float()` / `.to(torch.float32)` of a half tensor is remembered
(with the views taken of it afterwards: view, reshape, flatten, slicing), so that F.cross_entropy on the result can
be computed from the half tensor: the fp32 copy then lives only during the call that made it.

FP8 (opt-in, not in BMTrain): BMT_ROUTE_FP8=1 or set_fp8(True) / `with fp8(True): ...` sends a routed F.linear to
bmtrain._C.nn.fp8_linear instead (its three GEMMs in FP8; bmt.nn.fp8_linear) when its shapes qualify (rows, in and
out features multiples of 16); linears outside Blocks (an LM head, the loss) stay as written, and so do those of the
Blocks given to set_fp8_exclude (e.g. the first and last layers). Under the delayed recipe
(bmt.nn.set_fp8_recipe("delayed")) each routed FP8 linear keeps its delayed scales on its weight parameter.

Off switches: BMT_ROUTE_TORCH_OPS=0 (everything) or BMT_ROUTE_TORCH_OPS=linear,layer_norm (only those; names
below); from code, set_routing(False) / set_routing(True, ops=(...)), or `with routing(False): ...`.
A Block whose module is torch.compile'd runs without the mode (the compiled graph has its own kernels).
"""
import math
import os
import threading
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import _C, recompute_tail
from .torch_ops_switches import (OPS, fp8, fp8_on, routed_counts, routed_ops, routing, set_fp8,  # noqa: F401
                                 set_fp8_exclude, set_routing)
from .torch_ops_switches import _counts, _fp8_excluded, _on  # (module state the routes read and count in)

_HALF = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------------- the routes

_plain_types = {torch.Tensor: True, torch.nn.Parameter: True}  # type -> a tensor type the routes take


def _plain(*ts):
    # torch tensors and parameters (a running Block's DistributedParameters among them), not other subclasses;
    # per type, cached: this runs for every routed call
    for t in ts:
        if t is not None:
            cls = type(t)
            ok = _plain_types.get(cls)
            if ok is None:
                ok = _plain_types[cls] = issubclass(cls, torch.nn.Parameter)
            if not ok:
                return False
    return True


def _linear(args, kwargs):
    if kwargs:
        x, w, b = (list(args) + [None, None, None])[:3]
        w = kwargs.get("weight", w)
        b = kwargs.get("bias", b)
        x = kwargs.get("input", x)
    elif len(args) == 3:
        x, w, b = args
    elif len(args) == 2:
        (x, w), b = args, None
    else:
        return NotImplemented
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and _plain(x, w, b)) or w.dim() != 2:
        return NotImplemented
    if (fp8_on() and (not _fp8_excluded or getattr(_tls, "module", None) not in _fp8_excluded)
            and _C.nn.fp8_linear_applies(x, w) and (b is None or b.dtype == x.dtype)):
        _counts["fp8_linear"] += 1  # (no GELU epilogue: the FP8 GEMMs are the point)
        scales = _fp8_scales(w)
        if b is not None and recompute_tail.active():  # the recompute's tail, as below: no forward GEMM
            y = _C.nn.fp8_linear(x, w, b, None, None, False, scales)
            recompute_tail.defer_linear(x, w, b, y, fp8=True, scales=scales)
            return y
        return _C.nn.fp8_linear(x, w, b, None, None, True, scales)
    # in a checkpointed Block's recompute: the node without its GEMM until the output is read (recompute_tail.py)
    defer = b is not None and recompute_tail.active()
    if _gelus:
        rec = _gelus.get(id(x))
        # the GELU output as it was made (same tensor, neither it nor the pre-activation changed in place since)
        if (rec is not None and rec[0]() is x and x._version == rec[2] and rec[1]._version == rec[3]
                and "gelu_linear" in _on()):
            _counts["gelu_linear"] += 1
            y = _C.nn.linear_after_gelu(x, rec[1], w, b, not defer)
            if defer:
                recompute_tail.defer_linear(x, w, b, y)
            return y
    _counts["linear"] += 1
    if defer:
        y = _C.nn.linear_deferred(x, w, b)
        recompute_tail.defer_linear(x, w, b, y)
        return y
    return _C.nn.linear(x, w, b)


def _fp8_scales(w):
    # Under the delayed recipe (bmt.nn.set_fp8_recipe("delayed"), or its input / gradient switch) a routed FP8 linear's
    # delayed scales, kept on its weight: a Block's parameter is the same object at every step (gathered or not), so
    # the weight stands for the layer. A weight that is not a Parameter (made on the fly) casts dynamically.
    if not isinstance(w, torch.nn.Parameter) or not (_C.nn.fp8_delayed_inputs() or _C.nn.fp8_delayed_grads()):
        return None
    s = w.__dict__.get("_bmt_fp8_scales")
    if s is None:
        s = w._bmt_fp8_scales = _C.nn.Fp8LinearScales()
    return s


# GELU outputs made in the running Block: id(h) -> (weakref to h, pre, h's version, pre's version). Emptied when
# the outermost Block run ends, so nothing here outlives the layer's forward.
_gelus = {}


def _gelu(args, kwargs):
    out = torch._C._nn.gelu(*args, **kwargs)
    x = args[0] if args else kwargs.get("input")
    approximate = args[1] if len(args) > 1 else kwargs.get("approximate", "none")
    if approximate == "tanh" and out.requires_grad and type(x) is torch.Tensor and x.dtype in _HALF:
        _gelus[id(out)] = (weakref.ref(out), x, out._version, x._version)
    return out


def _layer_norm(args, kwargs):
    if not kwargs and len(args) == 5:  # F.layer_norm(x, shape, w, b, eps): the usual spelling, parsed without a dict
        x, shape, w, b, eps = args
    else:
        names = ("input", "normalized_shape", "weight", "bias", "eps")
        a = dict(zip(names, args), **kwargs)
        x, shape = a.get("input"), a.get("normalized_shape")
        w, b, eps = a.get("weight"), a.get("bias"), a.get("eps", 1e-5)
    if not isinstance(x, torch.Tensor) or not _plain(x, w, b) or x.dim() < 1:
        return NotImplemented
    shape = tuple(shape) if isinstance(shape, (list, tuple, torch.Size)) else (shape,)
    if len(shape) != 1 or shape[0] != x.shape[-1]:
        return NotImplemented
    if (w is not None and tuple(w.shape) != shape) or (b is not None and tuple(b.shape) != shape):
        return NotImplemented  # torch's own error message
    _counts["layer_norm"] += 1
    return _C.nn.layer_norm(x, int(shape[0]), w, b, float(eps))


_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _attention(args, kwargs):
    a = kwargs if len(args) == 3 else dict(zip(_SDPA_NAMES, args), **kwargs)  # usually (q, k, v, is_causal=True)
    q, k, v = args if len(args) == 3 else (a.get("query"), a.get("key"), a.get("value"))
    if not (a.get("is_causal", False) and a.get("attn_mask") is None and a.get("dropout_p", 0.0) == 0.0):
        return NotImplemented
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or not _plain(q, k, v):
        return NotImplemented
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0]:
        return NotImplemented
    if q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3] or not (q.dtype == k.dtype == v.dtype):
        return NotImplemented  # the causal mask of unequal lengths is torch's top-left one: not ours
    hq, hk = q.shape[1], k.shape[1]
    if hq != hk and not (a.get("enable_gqa", False) and hq % hk == 0):
        return NotImplemented
    scale = a.get("scale")
    if scale is not None and scale != 1.0 / math.sqrt(q.shape[-1]):
        return NotImplemented
    _counts["attention"] += 1
    return _C.nn.causal_attention(q, k, v)


# Upcasts seen by the mode: id(fp32 result) -> (weakref to it, half source, view ops applied since).
_upcasts = {}
_VIEW_FUNCS = {torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten, torch.Tensor.contiguous,
               torch.Tensor.__getitem__, torch.reshape, torch.flatten}


def _remember(out, src, chain):
    key = id(out)
    _upcasts[key] = (weakref.ref(out, lambda _r, key=key: _upcasts.pop(key, None)), src, chain)


def _upcast_source(t):
    rec = _upcasts.get(id(t))
    if rec is None or rec[0]() is not t:
        return None
    return rec


def _is_fp32_upcast(func, args, kwargs):
    """`t.float()` or `t.to(torch.float32)` (any spelling without a device change) of a half tensor."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].dtype not in _HALF:
        return False
    if func is torch.Tensor.float:
        return True
    if func is torch.Tensor.to:
        rest = list(args[1:])
        dtype = kwargs.get("dtype", rest[0] if rest and isinstance(rest[0], torch.dtype) else None)
        return dtype is torch.float32 and "device" not in kwargs and not any(
            isinstance(r, (torch.device, str, torch.Tensor)) for r in rest)
    return False


def _cross_entropy(args, kwargs):
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
    a = dict(zip(names, args), **kwargs)
    x, t = a.get("input"), a.get("target")
    if a.get("weight") is not None or a.get("size_average") is not None or a.get("reduce") is not None:
        return NotImplemented
    if not isinstance(x, torch.Tensor) or not isinstance(t, torch.Tensor) or x.dtype != torch.float32:
        return NotImplemented  # half logits: torch's half-precision loss is what the user wrote
    if x.dim() != 2 or t.dim() != 1 or t.dtype != torch.int64 or t.shape[0] != x.shape[0]:
        return NotImplemented
    reduction = a.get("reduction", "mean")
    if reduction not in ("mean", "sum", "none"):
        return NotImplemented
    rec = _upcast_source(x)
    logits = x
    if rec is not None:  # the same values, from the half tensor (the upcast is exact)
        logits = rec[1]
        for f, fargs, fkwargs in rec[2]:
            logits = f(logits, *fargs, **fkwargs)
    _counts["cross_entropy"] += 1
    return _C.fused_cross_entropy(logits, t, int(a.get("ignore_index", -100)), reduction,
                                  float(a.get("label_smoothing", 0.0)), False, False)


# torch.nn.functional's name -> (the op's name in OPS, its route); the mode keys them by the function it sees
_PATCHED = {"linear": ("linear", _linear), "layer_norm": ("layer_norm", _layer_norm),
            "scaled_dot_product_attention": ("attention", _attention), "gelu": ("gelu_linear", _gelu)}
_SEEN_BY_MODE = {"linear": torch._C._nn.linear, "layer_norm": F.layer_norm, "gelu": torch._C._nn.gelu,
                 "scaled_dot_product_attention": torch._C._nn.scaled_dot_product_attention}
_ROUTES = {_SEEN_BY_MODE[fname]: route for fname, route in _PATCHED.items()}
_ROUTES[F.cross_entropy] = ("cross_entropy", _cross_entropy)  # the loss window's (never patched: not in a Block)


_is_compiling = torch.compiler.is_compiling


class _RoutingMode(TorchFunctionMode):
    """layers=True: inside a Block (every route); False: the loss window (cross-entropy and upcasts only)."""

    def __init__(self, layers):
        super().__init__()
        self.layers = layers
        self.live = True  # the loss window sets it False when it could not leave the stack yet

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call inside a Block comes here: the common case (not routed, nothing deferred) returns first.
        if kwargs is None:
            kwargs = {}
        if recompute_tail._deferred:  # a deferred tail linear's output (or an addition of it) is used
            out = recompute_tail.intercept(func, args, kwargs)
            if out is not None:
                return out
        route = _ROUTES.get(func)
        if route is None and self.layers:
            return func(*args, **kwargs)
        if route is None or not self.live or _is_compiling():
            out = func(*args, **kwargs)
            if not self.layers and self.live and isinstance(out, torch.Tensor) and not _is_compiling():
                _track_upcast(func, args, kwargs, out)
            return out
        name, fn = route
        if name in _on() and (self.layers or name == "cross_entropy"):
            out = fn(args, kwargs)
            if out is not NotImplemented:
                if not self.layers:
                    self.live = False  # one loss per window; it leaves the stack at the next close
                return out
        return func(*args, **kwargs)


def _track_upcast(func, args, kwargs, out):
    """The loss window: remembers fp32 upcasts of half tensors and the views taken of them."""
    if func in _VIEW_FUNCS:
        rec = _upcast_source(args[0]) if args and isinstance(args[0], torch.Tensor) else None
        if rec is not None and not any(isinstance(v, torch.dtype) for v in (*args[1:], *kwargs.values())):
            _remember(out, rec[1], rec[2] + ((func, tuple(args[1:]), kwargs),))
    elif _is_fp32_upcast(func, args, kwargs):
        _remember(out, args[0], ())


# ----------------------------------------------------------------------------------- how a Block run is routed
#
# Two mechanisms take the same routes (the functions above):
#  "patch" (default): while a routed Block run is on some thread, torch.nn.functional's linear, layer_norm,
#      scaled_dot_product_attention and gelu are wrappers that route the call when their own thread is inside a
#      routed Block run and call torch's function otherwise (other threads, torch.compile tracing); torch's functions
#      are put back when the last run ends. Every other call goes to torch untouched: under any TorchFunctionMode a
#      torch call costs ~1.4 µs more in C++, a Python-level one (F.layer_norm, Tensor.split) ~5 µs
#      (bench/host_overhead.py: -26% of a small layer's forward host time).
#  "mode": the TorchFunctionMode above for the whole run, which also routes calls that bypass the module attribute
#      (`from torch.nn.functional import linear` made before, torch._C._nn.linear). BMT_ROUTE_MECHANISM=mode.
# A checkpointed Block's recompute that defers its tail linears (recompute_tail.py) always runs under the mode: it must
# see every call that reads a deferred tensor.

_tls = threading.local()  # depth: Block forward functions running on this thread; patched: routed runs by "patch"
_torch_functions = {name: getattr(F, name) for name in _PATCHED}  # torch's own, taken at import
_patch_lock = threading.Lock()
_patch_users = 0  # routed runs by "patch" in progress, over all threads


_use_mode = None  # BMT_ROUTE_MECHANISM == "mode"; read from the environment on first use


def _mechanism_is_mode():
    global _use_mode
    if _use_mode is None:
        v = os.environ.get("BMT_ROUTE_MECHANISM", "patch").strip().lower()
        if v not in ("patch", "mode"):
            raise ValueError(f"BMT_ROUTE_MECHANISM={v!r}: use patch (the default) or mode")
        _use_mode = v == "mode"
    return _use_mode


def _wrapper(fname, name, route, original):
    def routed(*args, **kwargs):
        if not _is_compiling() and getattr(_tls, "patched", 0) and name in _on():
            out = route(args, kwargs)
            if out is not NotImplemented:
                return out
        return original(*args, **kwargs)
    routed.__name__, routed.__qualname__ = fname, fname
    routed.__doc__, routed.__wrapped__ = original.__doc__, original
    return routed


_wrappers = {fname: _wrapper(fname, name, route, _torch_functions[fname]) for fname, (name, route) in _PATCHED.items()}


def _patch_enter():
    global _patch_users
    with _patch_lock:
        _patch_users += 1
        if _patch_users == 1:
            for fname, w in _wrappers.items():
                setattr(F, fname, w)


def _patch_exit():
    global _patch_users
    with _patch_lock:
        _patch_users -= 1
        if _patch_users == 0:
            for fname, f in _torch_functions.items():
                setattr(F, fname, f)


def run_routed(module, run):
    """run() with the layers' calls routed, unless routing is off or `module` is torch.compile'd."""
    tls = _tls
    depth = tls.depth = getattr(tls, "depth", 0) + 1
    outer, tls.module = getattr(tls, "module", None), module  # the running Block's module (FP8 exclusions)
    try:
        if not _on() or is_compiled(module):
            return run()
        prev = recompute_tail.begin(depth)
        out, completed = None, False
        try:
            if recompute_tail.active() or _mechanism_is_mode():
                mode = getattr(tls, "mode", None)
                if mode is None:  # one per thread (it holds no state of a run)
                    mode = tls.mode = _RoutingMode(layers=True)
                patched, tls.patched = getattr(tls, "patched", 0), 0  # (the mode routes; the wrappers step aside)
                try:
                    with mode:
                        out = run()
                finally:
                    tls.patched = patched
            else:
                _patch_enter()
                tls.patched = getattr(tls, "patched", 0) + 1
                try:
                    out = run()
                finally:
                    tls.patched -= 1
                    _patch_exit()
            completed = True
        finally:
            recompute_tail.end(prev, out, completed)
        return out
    finally:
        tls.depth -= 1
        tls.module = outer
        if not tls.depth:
            _gelus.clear()


def is_compiled(module):
    """Whether `module` is torch.compile'd: in place (module.compile()) or the wrapper torch.compile(module) made."""
    # module.compile() sets _compiled_call_impl; torch.compile(module) is an OptimizedModule whose _orig_mod is a
    # submodule (looked up in the dicts: a missing attribute through nn.Module.__getattr__ costs an exception)
    d = module.__dict__
    return d.get("_compiled_call_impl") is not None or "_orig_mod" in d.get("_modules", ())


# ---------------------------------------------------------------------------------------------- the loss window

_window = None


def open_window():
    """After a top-level Block / TransformerBlockList forward that records gradients: route the loss."""
    global _window
    if getattr(_tls, "depth", 0):
        return  # a Block called inside another Block's forward: not the model's output
    _close_window()
    if "cross_entropy" not in _on() or not torch.is_grad_enabled() or _window is not None:
        return
    mode = _RoutingMode(layers=False)
    mode.__enter__()
    _window = mode


def _close_window():
    """Leaves the stack if on top; otherwise (a mode entered since is above it) goes inert until a later close."""
    global _window
    w = _window
    if w is None or getattr(_tls, "depth", 0):
        return
    w.live = False
    n = torch._C._len_torch_function_stack()
    if n > 0 and torch._C._get_function_stack_at(n - 1) is w:
        w.__exit__(None, None, None)
        _window = None


def close_window():
    """Before the next forward, OptimManager.backward() and zero_grad()."""
    _close_window()
    _upcasts.clear()
