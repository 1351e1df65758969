"""The switches of bmt.torch_ops (which ops are routed, FP8 for routed linears) and the routed-call counts; the
routes themselves are in torch_ops.py, which re-exports everything here."""
import contextlib
import os
import weakref

import torch

from .utils import env_switch

OPS = ("linear", "layer_norm", "attention", "cross_entropy", "gelu_linear")
_ENV = "BMT_ROUTE_TORCH_OPS"


def _from_env():
    v = os.environ.get(_ENV, "1").strip().lower()
    if v in ("", "1", "on", "true", "all"):
        return set(OPS)
    if v in ("0", "off", "false", "none"):
        return set()
    names = {s.strip() for s in v.split(",") if s.strip()}
    bad = names - set(OPS)
    if bad:
        raise ValueError(f"{_ENV}={v!r}: unknown op(s) {sorted(bad)}; use 0, 1 or a comma list of {list(OPS)}")
    return names


_enabled = None  # the set of routed op names; read from the environment on first use
_counts = dict.fromkeys(OPS + ("fp8_linear",), 0)  # fp8_linear: routed linears that ran in FP8


def _on():
    global _enabled
    if _enabled is None:
        _enabled = _from_env()
    return _enabled


def set_routing(enabled, ops=None):
    """Turns routing on or off for `ops` (names from OPS; default all). Returns the previous set of routed ops."""
    global _enabled
    prev = set(_on())
    names = set(OPS if ops is None else ops)
    bad = names - set(OPS)
    if bad:
        raise ValueError(f"set_routing: unknown op(s) {sorted(bad)}; choose from {list(OPS)}")
    _enabled = (prev | names) if enabled else (prev - names)
    return prev


def routed_ops():
    """The op names currently routed (a copy)."""
    return set(_on())


_fp8 = None  # whether a routed F.linear runs in FP8; BMT_ROUTE_FP8, read on first use


def fp8_on():
    global _fp8
    if _fp8 is None:
        _fp8 = env_switch("BMT_ROUTE_FP8", False)
    return _fp8


def set_fp8(enabled):
    """Routed F.linear calls inside Blocks run as FP8 GEMMs (bmt.nn.fp8_linear) or not; returns the previous
    setting. Takes effect at the next call (a checkpointed Block's recompute uses the setting of its backward)."""
    global _fp8
    prev = fp8_on()
    _fp8 = bool(enabled)
    return prev


_fp8_excluded = weakref.WeakSet()  # inner modules of Blocks whose routed linears stay as written


def set_fp8_exclude(blocks):
    """Blocks (or their inner modules) whose routed F.linear calls stay as written while FP8 is on, e.g. the first
    and last layers; replaces the previous list (empty: none, the default) and returns it."""
    prev = list(_fp8_excluded)
    mods = [getattr(b, "inner_module", b) for b in blocks]
    for m in mods:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"set_fp8_exclude: expected Blocks or modules, got {type(m).__name__}")
    _fp8_excluded.clear()
    for m in mods:
        _fp8_excluded.add(m)
    return prev


@contextlib.contextmanager
def fp8(enabled=True, exclude=None):
    """Context manager form of set_fp8 (and of set_fp8_exclude when exclude is given); restores both on exit."""
    prev = set_fp8(enabled)
    prev_excluded = set_fp8_exclude(exclude) if exclude is not None else None
    try:
        yield
    finally:
        set_fp8(prev)
        if prev_excluded is not None:
            set_fp8_exclude(prev_excluded)


@contextlib.contextmanager
def routing(enabled, ops=None):
    """Context manager form of set_routing; restores the previous setting on exit."""
    global _enabled
    prev = set_routing(enabled, ops)
    try:
        yield
    finally:
        _enabled = prev


def routed_counts(reset=False):
    """How many calls each route has taken since the last reset (tests and benchmarks check routing happened)."""
    out = dict(_counts)
    if reset:
        for k in _counts:
            _counts[k] = 0
    return out
