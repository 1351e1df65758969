"""bmt.torch_ops (torch's functional ops inside Blocks routed to the engine's) and the optimizer step inside the
backward that OptimManager turns on by itself: each against the plain ops / the normal step."""
import os
import sys

import torch
import torch.nn.functional as F

import bmtrain as bmt
from common import (Skip, assert_close, assert_equal, case, check_twins_simple, device, expect_raises,
                    load_into_ref, main, rank)

from torchops_models import BLM, VOCAB, BLayer, RefList, TLayer

ROUTE_OFF = "route-off" in sys.argv[2:]  # launched with BMT_ROUTE_TORCH_OPS=0


def bmt_list(layers, use_checkpoint=True):
    return bmt.TransformerBlockList([bmt.Block(m, use_checkpoint=use_checkpoint) for m in layers])


def check_routing_state():
    if ROUTE_OFF:
        if bmt.torch_ops.routed_ops():
            raise AssertionError(f"BMT_ROUTE_TORCH_OPS=0 but routed ops are {bmt.torch_ops.routed_ops()}")
    elif bmt.torch_ops.routed_ops() != set(bmt.torch_ops.OPS):
        raise AssertionError(f"routing should be on for every op, got {bmt.torch_ops.routed_ops()}")


def expect_counts(counts, want_routed, ops=("linear", "layer_norm", "attention")):
    for op in ops:
        if want_routed and counts[op] == 0:
            raise AssertionError(f"{op}: no call was routed to the engine ({counts})")
        if not want_routed and counts[op] != 0:
            raise AssertionError(f"{op}: {counts[op]} calls were routed although routing is off ({counts})")


# --------------------------------------------------------------------------------------------- layer routes

class CastInput(torch.nn.Module):
    """model(x.to(dtype)).float(): half-precision layers under the fp32 twin checks (same names on both sides)."""

    def __init__(self, inner, dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, x):
        return self.inner(x.to(self.dtype)).float()


def _layers_vs_plain(use_checkpoint, rtol=None, atol=None, **layer_kw):
    dim, heads, n = 32, 4, 3
    model = bmt.TransformerBlockList([bmt.Block(BLayer(dim, heads, 10 + i, **layer_kw), use_checkpoint=use_checkpoint)
                                      for i in range(n)])
    ref = RefList([TLayer(dim, heads, 10 + i, **layer_kw) for i in range(n)])
    load_into_ref(model, ref)
    dtype = layer_kw.get("dtype", torch.float32)
    if dtype != torch.float32:  # the cases' inputs are fp32: both models take them in their own dtype
        model, ref = CastInput(model, dtype), CastInput(ref, dtype)
    bmt.torch_ops.routed_counts(reset=True)
    # fp32 on CPUs: the same kernels, so CPU-level tolerances. On GPUs the engine's attention is the fused kernel
    # torch's SDPA picks for it (cuDNN/flash) while the plain twin's SDPA may pick another (efficient/math): fp32
    # sums in another order, ~1e-6 absolute at these magnitudes (measured 2.9e-6 on an H200).
    tol = (1e-4, 2e-5) if device().type == "cuda" else (1e-5, 1e-6)
    check_twins_simple(model, ref, (2, 8, dim), what=f"checkpoint={use_checkpoint} {layer_kw} ", rtol=rtol or tol[0],
                       atol=atol or tol[1])
    return bmt.torch_ops.routed_counts(reset=True)


@case
def layers_match_plain_ops():
    """F.linear / F.layer_norm / SDPA(is_causal) inside Blocks: output, input and parameter gradients equal the plain
    torch twin's (fp32), with and without checkpointing; every one of them went to the engine."""
    check_routing_state()
    for ckpt in (False, True):
        counts = _layers_vs_plain(ckpt)
        expect_counts(counts, not ROUTE_OFF)
        if not ROUTE_OFF:
            # per layer 4 linears, 2 LayerNorms, 1 attention: 3 layers, forward (+ recompute)
            runs = 2 if ckpt else 1
            want = {"linear": 12 * runs, "layer_norm": 6 * runs}
            for op, w in want.items():
                if counts[op] != w:
                    raise AssertionError(f"checkpoint={ckpt}: {op} routed {counts[op]} times, expected {w}")


@case
def attention_variants():
    """Grouped-query heads (enable_gqa) and scale = 1/sqrt(hd) are routed; another scale is torch's."""
    check_routing_state()
    counts = _layers_vs_plain(True, gqa=True)
    expect_counts(counts, not ROUTE_OFF, ("attention",))
    counts = _layers_vs_plain(False, scale=1.0 / 8 ** 0.5)  # hd = 8: the default scale, written out
    expect_counts(counts, not ROUTE_OFF, ("attention",))
    counts = _layers_vs_plain(False, scale=0.3)
    if counts["attention"] != 0:
        raise AssertionError(f"SDPA with scale 0.3 was routed ({counts}); the engine's attention has the default scale")


@case
def gelu_then_linear_takes_the_fused_backward():
    """bf16 layers: the MLP's F.linear on F.gelu(approximate="tanh")'s output goes to linear_after_gelu (gradient to
    the pre-activation), once per layer in each run that records the graph; output and every gradient equal the plain bf16 twin's. Not taken
    when the GELU output was changed in place, for the erf GELU, or with the route switched off."""
    if ROUTE_OFF:
        raise Skip("routing is off for this launch")
    # (CUDA shapes this small run the separate GELU gradient inside the fused node: torch's math, so one tolerance)
    tol = dict(rtol=2e-2, atol=2e-3)
    for ckpt in (False, True):
        counts = _layers_vs_plain(ckpt, dtype=torch.bfloat16, **tol)
        # a checkpointed Block's first run records no graph (12 plain linears); its recompute fuses like a plain run
        want = {"gelu_linear": 3, "linear": 9 + (12 if ckpt else 0)}
        if {k: counts[k] for k in want} != want:
            raise AssertionError(f"checkpoint={ckpt}: expected {want}, got {counts}")
    for variant in ("inplace", "erf"):
        counts = _layers_vs_plain(False, dtype=torch.bfloat16, gelu_variant=variant, **tol)
        if counts["gelu_linear"] != 0 or counts["linear"] != 12:
            raise AssertionError(f"GELU {variant}: the fused path was taken ({counts})")
    with bmt.torch_ops.routing(False, ops=["gelu_linear"]):
        counts = _layers_vs_plain(False, dtype=torch.bfloat16, **tol)
        if counts["gelu_linear"] != 0 or counts["linear"] != 12:
            raise AssertionError(f"route gelu_linear off: {counts}")


@case
def recompute_skips_the_tail_linear():
    """A checkpointed Block's recompute leaves the GEMM of `x + F.linear(h, ...)` (the Block's output) uncomputed
    (recompute_tail.py): once per layer, with output and every gradient equal to the plain twin's. When that sum is
    read again in the Block (a LayerNorm after it, a view) everything is computed. Off (the default, or
    set_enabled(False)) nothing is deferred."""
    if ROUTE_OFF:
        raise Skip("routing is off for this launch")
    from bmtrain import recompute_tail as rt
    if rt.enabled() != (os.environ.get("BMT_RECOMPUTE_SKIP_TAIL", "0") == "1"):
        raise AssertionError("the recompute's tail skip should be off unless BMT_RECOMPUTE_SKIP_TAIL=1")
    rt.counts.update(deferred=0, skipped=0)
    if not rt.enabled():  # the default: nothing deferred
        _layers_vs_plain(True)
        if rt.counts != {"deferred": 0, "skipped": 0}:
            raise AssertionError(f"off by default, yet {rt.counts}")
    prev_on = rt.set_enabled(True)
    try:
        for dtype, tol in ((torch.float32, {}), (torch.bfloat16, dict(rtol=2e-2, atol=2e-3))):
            for tail, want_skipped in (("residual", 3), ("post_ln", 0), ("view", 0)):
                rt.counts.update(deferred=0, skipped=0)
                _layers_vs_plain(True, dtype=dtype, tail=tail, **tol)
                # every linear of the recompute is deferred (4 per layer), the tail ones stay uncomputed
                want = {"deferred": 12, "skipped": want_skipped}
                if rt.counts != want:
                    raise AssertionError(f"{dtype} tail={tail}: expected {want}, got {rt.counts}")
        rt.counts.update(deferred=0, skipped=0)
        _layers_vs_plain(False)  # no checkpointing: no recompute, nothing deferred
        rt.set_enabled(False)
        if rt.counts != {"deferred": 0, "skipped": 0}:
            raise AssertionError(f"without checkpointing: {rt.counts}")
        rt.counts.update(deferred=0, skipped=0)
        _layers_vs_plain(True)
        if rt.counts != {"deferred": 0, "skipped": 0}:
            raise AssertionError(f"switched off, yet {rt.counts}")
    finally:
        rt.set_enabled(prev_on)


@case
def routing_switch_from_code():
    """set_routing(False) / routing(False) send every call to torch; the results stay equal to the twin's."""
    if ROUTE_OFF:
        raise Skip("routing is off for this launch")
    with bmt.torch_ops.routing(False):
        if bmt.torch_ops.routed_ops():
            raise AssertionError("routing(False) left ops routed")
        expect_counts(_layers_vs_plain(True), False)
    if bmt.torch_ops.routed_ops() != set(bmt.torch_ops.OPS):
        raise AssertionError("routing(False) did not restore the setting on exit")
    with bmt.torch_ops.routing(False, ops=["attention"]):
        counts = _layers_vs_plain(False)
        expect_counts(counts, True, ("linear", "layer_norm"))
        expect_counts(counts, False, ("attention",))
    expect_raises("unknown op name", (ValueError,), lambda: bmt.torch_ops.set_routing(False, ops=["conv"]),
                  ["conv"])


class _Probe(bmt.DistributedModule):
    """A layer that records, during its forward, what torch.nn.functional.linear is and whether a call of it from
    another thread was routed."""

    def __init__(self, dim):
        super().__init__()
        self.weight = bmt.DistributedParameter(torch.randn(dim, dim) * 0.1)
        self.seen = {}

    def forward(self, x):
        import threading
        self.seen["linear_is_torch"] = F.linear is torch._C._nn.linear
        before = bmt.torch_ops.routed_counts()["linear"]
        a, b = torch.randn(4, x.shape[-1]), torch.randn(3, x.shape[-1])
        t = threading.Thread(target=lambda: F.linear(a, b))
        t.start()
        t.join()
        self.seen["other_thread_routed"] = bmt.torch_ops.routed_counts()["linear"] - before
        return F.linear(x, self.weight)


@case
def route_mechanism_is_scoped():
    """BMT_ROUTE_MECHANISM=patch (default): inside a routed Block run torch.nn.functional.linear is the routing
    wrapper, outside torch's own again; "mode": torch's own throughout (the TorchFunctionMode routes). Either way a
    call from another thread during the run is not routed, and the layer's call is."""
    if ROUTE_OFF:
        raise Skip("routing is off for this launch")
    mech = os.environ.get("BMT_ROUTE_MECHANISM", "patch")
    probe = _Probe(16)
    block = bmt.Block(probe, use_checkpoint=False)
    bmt.torch_ops.routed_counts(reset=True)
    x = torch.randn(2, 16, device=device(), requires_grad=True)
    block(x).sum().backward()
    bmt.torch_ops.close_window()
    if probe.seen["linear_is_torch"] != (mech == "mode"):
        raise AssertionError(f"mechanism {mech}: inside the run F.linear is torch's own: {probe.seen}")
    if probe.seen["other_thread_routed"] != 0:
        raise AssertionError(f"mechanism {mech}: another thread's F.linear was routed: {probe.seen}")
    if F.linear is not torch._C._nn.linear or F.layer_norm is not bmt.torch_ops._torch_functions["layer_norm"]:
        raise AssertionError("torch.nn.functional was not restored after the Block run")
    if bmt.torch_ops.routed_counts(reset=True)["linear"] != 1:
        raise AssertionError("the layer's own F.linear was not routed exactly once")


# ---------------------------------------------------------------------------------------------- the loss

def _lm(dtype, use_checkpoint=True):
    model = BLM(32, 4, 2, dtype, bmt_list, use_checkpoint)
    return model


def _ids(seed):
    g = torch.Generator().manual_seed(seed + rank())
    ids = torch.randint(0, VOCAB, (2, 9), generator=g)
    return ids.to(device())


def _loss_and_grads(model, ids, loss_fn, loss_scope=None):
    """loss_scope: a context manager around the loss alone (the saved-tensor hooks below)."""
    import contextlib
    logits = model(ids[:, :-1])
    with loss_scope or contextlib.nullcontext():
        loss = loss_fn(logits, ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: bmt.main_grad(p).clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        bmt.main_grad(p).zero_()
    return loss.detach(), grads, logits


def _fp32_ce(logits, target):
    return F.cross_entropy(logits.float().view(-1, VOCAB), target)


@case
def cross_entropy_of_upcast_logits():
    """F.cross_entropy(logits.float()...) after the model's forward runs on the engine's fused loss from the bf16
    logits: the same loss and gradients as torch's fp32 loss (which the switch gives back), the fp32 copy is not
    saved for the backward, and the loss window has left the mode stack."""
    check_routing_state()
    model = _lm(torch.bfloat16)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    ids = _ids(5)
    bmt.torch_ops.routed_counts(reset=True)
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    loss, grads, logits = _loss_and_grads(model, ids, _fp32_ce, hooks)
    counts = bmt.torch_ops.routed_counts(reset=True)
    big_fp32 = [s for s in saved if s[0] == torch.float32 and s[1] and s[1][-1] == VOCAB]
    if ROUTE_OFF:
        if counts["cross_entropy"] != 0:
            raise AssertionError(f"cross-entropy routed with routing off: {counts}")
        return
    if counts["cross_entropy"] != 1:
        raise AssertionError(f"the loss was routed {counts['cross_entropy']} times, expected once ({counts})")
    if big_fp32:
        raise AssertionError(f"an fp32 logits-sized tensor was saved for the backward: {big_fp32}")
    # (the window went inert at the loss; it leaves the stack at the next forward, backward() or zero_grad())
    bmt.torch_ops.close_window()
    if torch._C._len_torch_function_stack() != 0:
        raise AssertionError("the loss window is still on the torch function mode stack after close_window()")
    with bmt.torch_ops.routing(False, ops=["cross_entropy"]):
        saved.clear()
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        ref_loss, ref_grads, _ = _loss_and_grads(model, ids, _fp32_ce, hooks)
    if not [s for s in saved if s[0] == torch.float32 and s[1] and s[1][-1] == VOCAB]:
        raise AssertionError("torch's loss saved no fp32 logits-sized tensor: this test does not see the saving")
    assert_close("loss", loss, ref_loss, rtol=1e-6, atol=1e-6)
    for n in ref_grads:
        assert_close(f"grad {n}", grads[n], ref_grads[n], rtol=2e-2, atol=2e-3)
    if logits.dtype != torch.bfloat16:
        raise AssertionError("the model's logits changed dtype")


@case
def cross_entropy_views_and_options():
    """Views after the upcast (reshape, flatten, slicing), label smoothing, ignore_index, reduction "sum" and "none":
    routed and equal to torch's fp32 loss; class weights, half-precision input and probabilities as targets are
    left to torch."""
    if ROUTE_OFF:
        raise Skip("routing is off for this launch")
    model = _lm(torch.bfloat16, use_checkpoint=False)
    ids = _ids(9)
    target = ids[:, 1:].reshape(-1).clone()
    target[3] = -100
    variants = {
        "reshape+smoothing": (lambda lg, t: F.cross_entropy(lg.float().reshape(-1, VOCAB), t, label_smoothing=0.1), 1),
        "flatten+ignore": (lambda lg, t: F.cross_entropy(lg.float().flatten(0, 1), t, ignore_index=-100), 1),
        "slice+sum": (lambda lg, t: F.cross_entropy(lg.float()[:, :4].reshape(-1, VOCAB), t.view(2, 8)[:, :4]
                                                     .reshape(-1), reduction="sum"), 1),
        "to(float32)+none": (lambda lg, t: F.cross_entropy(lg.to(torch.float32).view(-1, VOCAB), t,
                                                           reduction="none").sum(), 1),
        "class weights": (lambda lg, t: F.cross_entropy(lg.float().view(-1, VOCAB), t,
                                                        weight=torch.rand(VOCAB, device=lg.device)), 0),
        "bf16 input": (lambda lg, t: F.cross_entropy(lg.view(-1, VOCAB), t).float(), 0),
    }
    for name, (fn, routed) in variants.items():
        torch.manual_seed(3)
        bmt.torch_ops.routed_counts(reset=True)
        loss, grads, _ = _loss_and_grads(model, ids, lambda lg, _t: fn(lg, target))
        got = bmt.torch_ops.routed_counts(reset=True)["cross_entropy"]
        if got != routed:
            raise AssertionError(f"{name}: routed {got} times, expected {routed}")
        torch.manual_seed(3)
        with bmt.torch_ops.routing(False, ops=["cross_entropy"]):
            ref_loss, ref_grads, _ = _loss_and_grads(model, ids, lambda lg, _t: fn(lg, target))
        assert_close(f"{name}: loss", loss, ref_loss, rtol=1e-5, atol=1e-5)
        for n in ref_grads:
            assert_close(f"{name}: grad {n}", grads[n], ref_grads[n], rtol=2e-2, atol=2e-3)


@case
def loss_window_outside_training():
    """No window without gradients (an eval forward) and none left open by a forward whose loss is not taken."""
    if ROUTE_OFF:
        raise Skip("routing is off for this launch")
    model = _lm(torch.float32, use_checkpoint=False)
    ids = _ids(11)
    with torch.no_grad():
        model(ids)
    if torch._C._len_torch_function_stack() != 0:
        raise AssertionError("an eval forward left a mode on the stack")
    model(ids)  # a forward with gradients and no loss: the window stays until the next forward / backward
    model(ids)
    if torch._C._len_torch_function_stack() != 1:
        raise AssertionError(f"expected the one loss window, got {torch._C._len_torch_function_stack()} modes")
    bmt.torch_ops.close_window()
    if torch._C._len_torch_function_stack() != 0:
        raise AssertionError("close_window() left the window on the stack")


# ------------------------------------------------------------------------------------- step inside backward

def _train(steps, dtype, mode, loop="plain", loss_scale=None):
    """A few steps of the LM under OptimManager; returns (parameters after each step, manager)."""
    model = _lm(dtype)
    opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, weight_decay=0.1)
    manager = bmt.optim.OptimManager(loss_scale=loss_scale)
    manager.add_optimizer(opt)
    manager.set_step_in_backward(mode)
    history, active = [], []
    for i in range(steps):
        ids = _ids(100 + i)
        manager.zero_grad()
        repeats = 2 if loop == "accumulate" else 1
        for _ in range(repeats):
            logits = model(ids[:, :-1])
            manager.backward(_fp32_ce(logits, ids[:, 1:].reshape(-1)))
        if loop == "clip":
            manager.clip_grad_norm(opt.param_groups, 1e9)
        active.append(manager.step_in_backward_active)
        manager.step()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return history, active, manager


@case
def step_in_backward_equals_normal_step():
    """The step inside the backward that OptimManager turns on by itself (from the second iteration of a
    zero_grad / backward / step loop without loss scale and clipping) gives bit for bit the parameters of the
    normal step, bf16 and fp32 parameters (one rank: the Block hands its own gradients over)."""
    for dtype in (torch.bfloat16, torch.float32):
        off, active_off, _ = _train(4, dtype, False)
        auto, active_auto, _ = _train(4, dtype, "auto")
        if any(active_off):
            raise AssertionError("set_step_in_backward(False) still turned the overlap on")
        if active_auto != [False, True, True, True]:
            raise AssertionError(f"auto mode should be on from the second iteration, got {active_auto}")
        for i, (a, b) in enumerate(zip(auto, off)):
            for n in b:
                assert_equal(f"{dtype} step {i}: {n}", a[n], b[n])
        forced, active_forced, _ = _train(2, dtype, True)
        if active_forced != [True, True]:
            raise AssertionError(f"set_step_in_backward(True) should be on from the first iteration: {active_forced}")
        for n in off[1]:
            assert_equal(f"{dtype} forced, step 1: {n}", forced[1][n], off[1][n])


@case
def step_in_backward_stays_off_when_unsafe():
    """Clipping, several backward() calls per step, or loss scaling keep auto mode off (same results as off);
    forcing it with loss scaling is refused; a second backward after it turned on raises naming the switch."""
    for loop in ("clip", "accumulate"):
        _, active, _ = _train(3, torch.float32, "auto", loop)
        if any(active):
            raise AssertionError(f"{loop}: auto mode turned on ({active})")
    _, active, _ = _train(3, torch.float32, "auto", loss_scale=1024.0)
    if any(active):
        raise AssertionError(f"loss scaling: auto mode turned on ({active})")
    expect_raises("forced with loss scaling", (RuntimeError,),
                  lambda: _train(1, torch.float32, True, loss_scale=1024.0), ["loss scaling"])
    _, _, manager = _train(1, torch.float32, "auto")
    expect_raises("bad env value", (ValueError,), lambda: manager.set_step_in_backward("sometimes"), ["sometimes"])


@case
def step_in_backward_is_off_by_default():
    """Without BMT_STEP_IN_BACKWARD or set_step_in_backward, plain iterations never move the step into the backward,
    and every parameter keeps its gradient after backward() (a script may read it before step())."""
    if "BMT_STEP_IN_BACKWARD" in os.environ:
        raise AssertionError("the launch must not set BMT_STEP_IN_BACKWARD")
    model = _lm(torch.float32)
    opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-3)
    manager = bmt.optim.OptimManager(loss_scale=None)
    manager.add_optimizer(opt)
    for i in range(3):
        ids = _ids(400 + i)
        manager.zero_grad()
        manager.backward(_fp32_ce(model(ids[:, :-1]), ids[:, 1:].reshape(-1)))
        if manager.step_in_backward_active:
            raise AssertionError(f"iteration {i}: the step moved into the backward without being asked")
        missing = [n for n, p in model.named_parameters()
                   if p.requires_grad and p.grad is None and bmt.main_grad(p) is None]
        if missing:
            raise AssertionError(f"iteration {i}: no gradient after backward() for {missing[:3]}")
        manager.step()


@case
def second_backward_after_auto_on_raises():
    model = _lm(torch.float32)
    opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-3)
    manager = bmt.optim.OptimManager(loss_scale=None)
    manager.add_optimizer(opt)
    manager.set_step_in_backward("auto")
    for i in range(2):
        ids = _ids(200 + i)
        manager.zero_grad()
        manager.backward(_fp32_ce(model(ids[:, :-1]), ids[:, 1:].reshape(-1)))
        manager.step()
    if not manager.step_in_backward_active:
        raise AssertionError("auto mode did not turn on after two plain iterations")
    ids = _ids(300)
    manager.zero_grad()
    manager.backward(_fp32_ce(model(ids[:, :-1]), ids[:, 1:].reshape(-1)))
    loss = _fp32_ce(model(ids[:, :-1]), ids[:, 1:].reshape(-1))
    expect_raises("second backward", (RuntimeError,), lambda: manager.backward(loss),
                  ["BMT_STEP_IN_BACKWARD=0", "set_step_in_backward(False)"])
    bmt.torch_ops.close_window()


if __name__ == "__main__":
    main()
