"""FP8 linears from Python (bmt.nn.fp8_linear, bmt.nn.Linear(fp8=True), routed F.linear under bmt.torch_ops.fp8):
against an fp64 product of the operands as the cast leaves them (per-tensor scale = fp8_max / amax, round to nearest
even, saturate), computed here independently of the engine, within the accumulation's rounding."""
import torch
import torch.nn.functional as F

import bmtrain as bmt
from common import assert_equal, case, device, expect_raises, full_grad, main, on_cuda, randn, rank, rank_input, world

ROWS, IN, OUT = 32, 64, 48  # every GEMM dimension a multiple of 16 (the FP8 path's condition)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def dequantized(t, dtype):
    """t as the FP8 cast leaves it, in fp64: scale = fp8_max / amax in fp32, round(t * scale) / scale."""
    fmax = torch.finfo(dtype).max
    scale = torch.tensor(fmax, dtype=torch.float32, device=t.device) / t.detach().abs().max().float()
    q = (t.detach().float() * scale).clamp(-fmax, fmax).to(dtype)
    return q.double() / scale.double()


def check_product(what, got, a, b):
    """got ≈ a @ b.T (fp64 operands) within the rounding of a float32 sum of k products, the output's own rounding
    and, on GPUs, the forward's fast accumulation (~14-bit partial sums)."""
    want = a @ b.t()
    k = a.shape[1]
    rel = k * 2.0 ** -14 if on_cuda() else (k + 2) * 2.0 ** -23
    bound = rel * (a.abs() @ b.abs().t()) + 1e-30
    err = (got.double() - want).abs()
    if not bool((err <= bound).all()):
        i = int((err - bound).argmax())
        raise AssertionError(f"{what}: element {i} is {got.reshape(-1)[i].item()}, want {want.reshape(-1)[i].item()} "
                             f"(error {err.reshape(-1)[i].item():.3g} > bound {bound.reshape(-1)[i].item():.3g})")
    return want


def _w(seed):
    return randn(OUT, IN, seed=seed, scale=0.1), randn(OUT, seed=seed + 1, scale=0.1)


@case
def fp8_linear_function_matches_the_dequantized_product():
    """bmt.nn.fp8_linear on plain tensors, both gradient formats: y, dx, dW, db against fp64 products."""
    for fmt, gdt in (("e5m2", E5M2), ("e4m3", E4M3)):
        x = rank_input(rank(), ROWS, IN, seed=11, requires_grad=True)
        w0, b0 = _w(12)
        w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
        y = bmt.nn.fp8_linear(x, w, b, grad_format=fmt)
        check_product(f"{fmt} forward", y - b0, dequantized(x, E4M3), dequantized(w0, E4M3))
        if torch.equal(y, F.linear(x, w0, b0)):
            raise AssertionError("fp8_linear returned the full-precision product: the FP8 path did not run")
        g = rank_input(rank(), ROWS, OUT, seed=13)
        (y * g).sum().backward()
        check_product(f"{fmt} dgrad", x.grad, dequantized(g, gdt), dequantized(w0, E4M3).t())
        check_product(f"{fmt} wgrad", w.grad, dequantized(g, gdt).t(), dequantized(x, E4M3).t())
        if not torch.allclose(b.grad.double(), g.double().sum(0), rtol=1e-6, atol=1e-6):
            raise AssertionError(f"{fmt}: the bias gradient is not the sum of the output gradient's rows")


@case
def fp8_residual_and_mlp_functions_are_the_composed_fp8_linears():
    """bmt.nn.fp8_linear_residual and bmt.nn.fp8_gelu_mlp against the same computation composed from
    bmt.nn.fp8_linear, F.gelu and +: bit for bit on CPU (where the engine composes them too), within FP8 rounding on
    a GPU (the epilogues round once, GELU reads the fp32 sum); the residual's gradient is the output's."""
    hidden = 128
    x0 = rank_input(rank(), ROWS, IN, seed=21)
    w0, b0 = _w(22)
    r0 = rank_input(rank(), ROWS, OUT, seed=23)
    w1, b1 = randn(hidden, IN, seed=24, scale=0.1), randn(hidden, seed=25, scale=0.1)
    w2, b2 = randn(OUT, hidden, seed=26, scale=0.1), randn(OUT, seed=27, scale=0.1)
    g = rank_input(rank(), ROWS, OUT, seed=28)

    def run(fn, *tensors):
        leaves = [t.clone().requires_grad_() for t in tensors]
        y = fn(*leaves)
        (y * g).sum().backward()
        return [y.detach()] + [t.grad for t in leaves]

    def compare(what, got, want):
        for i, (a, b) in enumerate(zip(got, want)):
            if on_cuda():
                rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
                if rel > 0.05:
                    raise AssertionError(f"{what}: output/gradient {i} differs by {rel:.3g} (norm) from the composed ops")
            else:
                assert_equal(f"{what}: output/gradient {i}", a, b)

    compare("fp8_linear_residual", run(lambda x, w, b, r: bmt.nn.fp8_linear_residual(x, w, b, r), x0, w0, b0, r0),
            run(lambda x, w, b, r: r + bmt.nn.fp8_linear(x, w, b), x0, w0, b0, r0))
    fused = run(lambda *t: bmt.nn.fp8_gelu_mlp(*t), x0, w1, b1, w2, b2, r0)
    compare("fp8_gelu_mlp", fused,
            run(lambda x, a, c, d, e, r: r + bmt.nn.fp8_linear(F.gelu(bmt.nn.fp8_linear(x, a, c), approximate="tanh"), d, e),
                x0, w1, b1, w2, b2, r0))
    if not torch.equal(fused[6], g):
        raise AssertionError("fp8_gelu_mlp: the residual's gradient is not the output's")
    exact = r0 + F.linear(F.gelu(F.linear(x0, w1, b1), approximate="tanh"), w2, b2)
    if torch.allclose(fused[0], exact, rtol=1e-4, atol=1e-4):
        raise AssertionError("fp8_gelu_mlp returned the full-precision MLP: the FP8 path did not run")
    expect_raises("a residual of the wrong shape", (RuntimeError, ValueError),
                  lambda: bmt.nn.fp8_linear_residual(x0, w0, b0, randn(ROWS, OUT + 16, seed=29)),
                  must_mention=("residual", "does not match the output"))


def dequantized_rows(t, dtype):
    """dequantized() with one scale per row (fp8_max / that row's amax; a zero row keeps scale 1)."""
    fmax = torch.finfo(dtype).max
    amax = t.detach().abs().amax(1, keepdim=True).float()
    scale = torch.where(amax > 0, torch.tensor(fmax, dtype=torch.float32, device=t.device) / amax,
                        torch.ones_like(amax))
    q = (t.detach().float() * scale).clamp(-fmax, fmax).to(dtype)
    return q.double() / scale.double()


@case
def fp8_linear_rowwise_matches_the_dequantized_product():
    """scaling="row": each operand scaled per row along the contracted dimension (x and dy per token, W per output
    row in the forward and per input column in dgrad, x and dy per feature in wgrad), every operand E4M3."""
    x = rank_input(rank(), ROWS, IN, seed=31, requires_grad=True)
    with torch.no_grad():
        x.mul_(torch.logspace(0, -6, ROWS, base=2.0, device=x.device, dtype=x.dtype).unsqueeze(1))  # unequal tokens
    w0, b0 = _w(32)
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    y = bmt.nn.fp8_linear(x, w, b, scaling="row")
    check_product("rowwise forward", y - b0, dequantized_rows(x, E4M3), dequantized_rows(w0, E4M3))
    g = rank_input(rank(), ROWS, OUT, seed=33)
    (y * g).sum().backward()
    check_product("rowwise dgrad", x.grad, dequantized_rows(g, E4M3), dequantized_rows(w0.t(), E4M3))
    check_product("rowwise wgrad", w.grad, dequantized_rows(g.t(), E4M3), dequantized_rows(x.detach().t(), E4M3))
    # the process default and its setter (BMT_FP8_SCALING)
    before = bmt._C.nn.fp8_scaling()
    try:
        bmt._C.nn.set_fp8_scaling("row")
        assert_equal("fp8_linear under the row default", bmt.nn.fp8_linear(x, w0, b0), y.detach())
    finally:
        bmt._C.nn.set_fp8_scaling(before)
    expect_raises("scaling='block'", (RuntimeError, ValueError),
                  lambda: bmt.nn.fp8_linear(x, w0, b0, scaling="block"), must_mention=("block", "row"))


@case
def fp8_linear_backward_only_keeps_the_forward_exact():
    """Fp8LinearScales.backward_only (the LM head under --fp8-head-backward): y is the unquantised linear, dx and dW
    the FP8 products (E5M2 gradient, E4M3 x and W) against fp64, db the rows' sum."""
    s = bmt.nn.Fp8LinearScales()
    if s.backward_only:
        raise AssertionError("Fp8LinearScales().backward_only is on by default")
    s.backward_only = True
    x = rank_input(rank(), ROWS, IN, seed=31, requires_grad=True)
    w0, b0 = _w(32)
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    y = bmt.nn.fp8_linear(x, w, b, scales=s)
    assert_equal("backward_only forward", y, bmt._C.nn.linear(x.detach(), w0, b0))
    g = rank_input(rank(), ROWS, OUT, seed=33)
    (y * g).sum().backward()
    check_product("backward_only dgrad", x.grad, dequantized(g, E5M2), dequantized(w0, E4M3).t())
    check_product("backward_only wgrad", w.grad, dequantized(g, E5M2).t(), dequantized(x, E4M3).t())
    if torch.allclose(w.grad, g.t() @ x.detach(), rtol=0, atol=0):
        raise AssertionError("backward_only: wgrad is the full-precision product: the FP8 backward did not run")
    if not torch.allclose(b.grad.double(), g.double().sum(0), rtol=1e-6, atol=1e-6):
        raise AssertionError("backward_only: the bias gradient is not the sum of the output gradient's rows")


@case
def embedding_fp8_projection_is_the_fp8_linear_of_its_table():
    """bmt.nn.Embedding(fp8=True): the tied projection is fp8_linear of the table (the lookup unchanged)."""
    emb = bmt.nn.Embedding(OUT, IN, dtype=torch.float32, fp8=True)
    bmt.init_parameters(emb)
    x = rank_input(rank(), ROWS, IN, seed=25)
    with torch.no_grad():
        assert_equal("Embedding(fp8) projection", emb(x, projection=True), bmt.nn.fp8_linear(x, emb.weight))
        ids = torch.arange(OUT, device=x.device)
        assert_equal("Embedding(fp8) lookup", emb(ids), emb.weight)
        emb.fp8 = False
        if torch.equal(emb(x, projection=True), bmt.nn.fp8_linear(x, emb.weight)):
            raise AssertionError("Embedding(fp8=False) projection equals the FP8 one")


@case
def fp8_linear_falls_back_and_refuses_bad_formats():
    x, w = rank_input(rank(), ROWS, IN - 8, seed=21), randn(OUT, IN - 8, seed=22)  # 56 features: not FP8
    if bmt._C.nn.fp8_linear_applies(x, w):
        raise AssertionError("fp8_linear_applies accepts 56 input features")
    assert_equal("fallback to the plain linear", bmt.nn.fp8_linear(x, w), bmt._C.nn.linear(x, w))
    x, w = rank_input(rank(), ROWS, IN, seed=23), randn(OUT, IN, seed=24)
    expect_raises("grad_format='e3m4'", (RuntimeError, ValueError), lambda: bmt.nn.fp8_linear(x, w, None, "e3m4"),
                  must_mention=("e3m4", "e5m2"))


class _TwoLinears(bmt.DistributedModule):
    """A layer written with torch's functional linear (the routed path), and bmt.nn.Linear(fp8=True)."""

    def __init__(self):
        super().__init__()
        self.w = bmt.DistributedParameter(torch.empty(OUT, IN))
        self.b = bmt.DistributedParameter(torch.empty(OUT))
        self.lin = bmt.nn.Linear(OUT, IN, dtype=torch.float32, fp8=True)

    def forward(self, x):
        return self.lin(F.linear(x, self.w, self.b))


def _everyone(t):
    """Every rank's t (a list, rank order)."""
    with torch.no_grad():
        return list(bmt.distributed.all_gather(t.detach().contiguous())) if world() > 1 else [t.detach()]


@case
def fp8_in_a_block_matches_the_dequantized_products():
    """A checkpointed ZeRO-3 Block (every world size) holding a routed F.linear under bmt.torch_ops.fp8() and an
    FP8 bmt.nn.Linear: each GEMM against the fp64 product of its operands as cast (the hidden activation and its
    gradient read where the Block made them), the parameters' gradients summed over every rank's micro-batch."""
    model = bmt.Block(_TwoLinears(), use_checkpoint=True)
    w1, b1 = _w(31)
    w2, b2 = randn(IN, OUT, seed=33, scale=0.1), randn(IN, seed=34, scale=0.1)
    model.load_state_dict({"w": w1.cpu(), "b": b1.cpu(), "lin.weight": w2.cpu(), "lin.bias": b2.cpu()})
    seen = {}

    def keep_input(module, args):  # the hidden activation h (the forward's; the recompute's is the same)
        h = args[0]
        seen.setdefault("h", h.detach().clone())
        if h.requires_grad:
            h.register_hook(lambda grad: seen.__setitem__("dh", grad.detach().clone()))
    model.lin.register_forward_pre_hook(keep_input)
    bmt.torch_ops.routed_counts(reset=True)
    with bmt.torch_ops.fp8(True):
        x = rank_input(rank(), ROWS, IN, seed=35, requires_grad=True)
        y = model(x)
        g = rank_input(rank(), ROWS, IN, seed=36)
        (y * g).sum().backward()
    counts = bmt.torch_ops.routed_counts(reset=True)
    if counts["fp8_linear"] != 2 or counts["linear"] != 0:  # the forward and the checkpoint's recompute
        raise AssertionError(f"the routed F.linear did not run in FP8 in both runs: {counts}")
    h, dh = seen["h"], seen["dh"]
    check_product("routed F.linear forward", h - b1, dequantized(x, E4M3), dequantized(w1, E4M3))
    check_product("Linear(fp8) forward", y - b2, dequantized(h, E4M3), dequantized(w2, E4M3))
    check_product("Linear(fp8) dgrad", dh, dequantized(g, E5M2), dequantized(w2, E4M3).t())
    check_product("routed F.linear dgrad", x.grad, dequantized(dh, E5M2), dequantized(w1, E4M3).t())
    xs, hs, dhs, gs = _everyone(x), _everyone(h), _everyone(dh), _everyone(g)
    cat = lambda ts, fmt: torch.cat([dequantized(t, fmt).t() for t in ts], dim=1)  # noqa: E731
    check_product("lin.weight gradient (all ranks)", full_grad(model.lin.weight, "lin.weight"), cat(gs, E5M2),
                  cat(hs, E4M3))
    check_product("w gradient (all ranks)", full_grad(model.w, "w"), cat(dhs, E5M2), cat(xs, E4M3))
    with bmt.torch_ops.fp8(False):
        model(x)
    if bmt.torch_ops.routed_counts(reset=True)["fp8_linear"] != 0:
        raise AssertionError("bmt.torch_ops.fp8(False): the routed linear still ran in FP8")


class _OneLinear(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.w = bmt.DistributedParameter(torch.empty(IN, IN), init_method=torch.nn.init.normal_)
        self.b = bmt.DistributedParameter(torch.empty(IN), init_method=torch.nn.init.normal_)

    def forward(self, x):
        return F.linear(x, self.w, self.b)


@case
def fp8_exclude_keeps_blocks_as_written():
    """bmt.torch_ops.fp8(True, exclude=...) / set_fp8_exclude: the routed linears of the Blocks given (or of their
    modules) stay as written, the others run in FP8; the exclusions end with the context."""
    lst = bmt.TransformerBlockList([bmt.Block(_OneLinear(), use_checkpoint=False) for _ in range(3)])
    bmt.init_parameters(lst)
    x = rank_input(rank(), ROWS, IN, seed=41)
    for excluded, want in (([], 3), ([lst[0], lst[2]], 1), ([lst[1].inner_module], 2)):
        bmt.torch_ops.routed_counts(reset=True)
        with torch.no_grad(), bmt.torch_ops.fp8(True, exclude=excluded):
            lst(x)
        c = bmt.torch_ops.routed_counts(reset=True)
        if (c["fp8_linear"], c["linear"]) != (want, 3 - want):
            raise AssertionError(f"exclude {len(excluded)} Block(s): {c['fp8_linear']} FP8 and {c['linear']} plain "
                                 f"linears, want {want} and {3 - want}")
    if bmt.torch_ops.set_fp8_exclude([]) != []:
        raise AssertionError("the exclusions outlived their context")
    expect_raises("set_fp8_exclude([3])", (TypeError,), lambda: bmt.torch_ops.set_fp8_exclude([3]),
                  must_mention=("Blocks or modules",))


class _Mlp(bmt.DistributedModule):
    """x + F.linear(gelu(F.linear(x, w1, b1)), w2, b2): the Block's output is the sum, the recompute's tail."""

    def __init__(self):
        super().__init__()
        self.w1 = bmt.DistributedParameter(torch.empty(OUT, IN), init_method=lambda t: t.normal_(0, 0.1))
        self.b1 = bmt.DistributedParameter(torch.empty(OUT), init_method=lambda t: t.normal_(0, 0.1))
        self.w2 = bmt.DistributedParameter(torch.empty(IN, OUT), init_method=lambda t: t.normal_(0, 0.1))
        self.b2 = bmt.DistributedParameter(torch.empty(IN), init_method=lambda t: t.normal_(0, 0.1))

    def forward(self, x):
        return x + F.linear(F.gelu(F.linear(x, self.w1, self.b1), approximate="tanh"), self.w2, self.b2)


@case
def fp8_recompute_tail_skips_the_last_gemm():
    """BMT_RECOMPUTE_SKIP_TAIL with routed FP8 linears: in each checkpointed Block's recompute the output's FP8
    linear is deferred and never computed (no forward GEMM, no weight cast; every routed linear of the recompute is
    deferred, the first one computed when the GELU reads it), the output,
    the input's and every parameter's gradient equal those of the same run with the skip off, bit for bit."""
    from bmtrain import recompute_tail as rt
    results = {}
    for skip in (False, True):
        torch.manual_seed(7)
        lst = bmt.TransformerBlockList([bmt.Block(_Mlp(), use_checkpoint=True) for _ in range(2)])
        bmt.init_parameters(lst)
        prev = rt.set_enabled(skip)
        rt.counts.update(deferred=0, skipped=0)
        try:
            with bmt.torch_ops.fp8(True):
                x = rank_input(rank(), ROWS, IN, seed=51, requires_grad=True)
                y = lst(x)
                (y * rank_input(rank(), ROWS, IN, seed=52)).sum().backward()
        finally:
            rt.set_enabled(prev)
        counts = dict(rt.counts)
        want = {"deferred": 4, "skipped": 2} if skip else {"deferred": 0, "skipped": 0}
        if counts != want:
            raise AssertionError(f"skip {skip}: deferred/skipped {counts}, want {want}")
        results[skip] = [y.detach(), x.grad] + [full_grad(p, n) for n, p in lst.named_parameters()]
    for i, (a, b) in enumerate(zip(results[False], results[True])):
        assert_equal(f"value {i} with the tail skipped", b, a)



@case
def fp8_delayed_gelu_scale_from_python():
    """bmt.nn.Fp8DelayedScale: scale = fp8 max / the largest amax of the last history_len records (closed forms; a
    NaN amax stays out of the window). The fused FP8 MLP given one (bmtrain._C.nn.fp8_gelu_mlp_fused, any device):
    the first call casts h dynamically and records its amax (output and gradients bit for bit the call without a
    scale on CPU); the next call with the same operands has c_fc's GEMM write h in E4M3 with that scale, the one the
    dynamic cast computes (bit for bit again on CPU); with the input halved the delayed scale is not the dynamic one:
    within FP8 rounding, not equal. bmt.nn.fp8_gelu_mlp uses it only with set_fp8_delayed_gelu(True) on CUDA."""
    fmax = torch.finfo(E4M3).max
    s = bmt.nn.Fp8DelayedScale(history_len=2)
    if s.ready or s.history is not None or s.history_len != 2 or s.format != "e4m3":
        raise AssertionError(f"a new scale: ready {s.ready}, history {s.history}, {s.history_len}, {s.format}")
    expect_raises("the scale before any record", (RuntimeError, ValueError), lambda: s.scale,
                  must_mention=("before the first record",))
    expect_raises("an unknown format", (RuntimeError, ValueError), lambda: bmt.nn.Fp8DelayedScale(4, "e3m4"),
                  must_mention=("e3m4", "'e4m3' or 'e5m2'"))
    for amax, window_max in ((2.0, 2.0), (8.0, 8.0), (4.0, 8.0), (1.0, 4.0), (float("nan"), 1.0)):
        s.record_amax(torch.tensor(amax, device=device()))
        want = (torch.tensor(fmax, dtype=torch.float32) / torch.tensor(window_max, dtype=torch.float32)).item()
        if not s.ready or s.scale.item() != want:
            raise AssertionError(f"after amax {amax}: scale {s.scale.item()}, want {fmax} / {window_max} = {want}")
    assert_equal("the window, newest first (the NaN kept out as 0)", s.history.cpu(), torch.tensor([0.0, 1.0]))

    hidden = 128
    # (CUDA: bf16, the dtype cuBLASLt's FP8-output GEMM with a bias and pre-activation epilogue is used with)
    dt = torch.bfloat16 if on_cuda() else torch.float32
    x0 = rank_input(rank(), ROWS, IN, seed=61).to(dt)
    w1, b1 = randn(hidden, IN, seed=62, scale=0.1).to(dt), randn(hidden, seed=63, scale=0.1).to(dt)
    w2, b2 = randn(OUT, hidden, seed=64, scale=0.1).to(dt), randn(OUT, seed=65, scale=0.1).to(dt)
    g = rank_input(rank(), ROWS, OUT, seed=66).to(dt)

    def run(fn, x, **kw):
        leaves = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
        y = fn(*leaves, **kw)
        (y * g).sum().backward()
        return [y.detach()] + [t.grad for t in leaves]

    def close(what, got, want, exact):
        for i, (a, b) in enumerate(zip(got, want)):
            if exact:
                assert_equal(f"{what}: output/gradient {i}", a, b)
            else:
                rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
                if rel > 0.05:
                    raise AssertionError(f"{what}: output/gradient {i} differs by {rel:.3g} (norm)")

    fused = bmt._C.nn.fp8_gelu_mlp_fused
    gs = bmt.nn.Fp8DelayedScale()
    dynamic = run(fused, x0)
    close("first call (dynamic cast, amax recorded)", run(fused, x0, gelu_scale=gs), dynamic, not on_cuda())
    if not gs.ready:
        raise AssertionError("the first call did not record h's amax")
    close("second call (h written in E4M3 with the same scale)", run(fused, x0, gelu_scale=gs), dynamic,
          not on_cuda())
    half = run(fused, x0 * 0.5, gelu_scale=gs)
    half_dynamic = run(fused, x0 * 0.5)
    close("input halved (delayed scale from the larger amaxes)", half, half_dynamic, False)
    if torch.equal(half[0], half_dynamic[0]):
        raise AssertionError("the delayed scale gave the dynamic cast's output: it was not used")

    prev = bmt.nn.fp8_delayed_gelu()
    try:
        for on in (False, True):
            bmt.nn.set_fp8_delayed_gelu(on)
            if bmt.nn.fp8_delayed_gelu() != on:
                raise AssertionError(f"set_fp8_delayed_gelu({on}) did not switch")
            fresh = bmt.nn.Fp8DelayedScale()
            close(f"bmt.nn.fp8_gelu_mlp, switch {on}",
                  run(lambda *t: bmt.nn.fp8_gelu_mlp(*t, gelu_scale=fresh), x0), dynamic, False)
            if fresh.ready != (on and on_cuda()):
                raise AssertionError(f"switch {on}, cuda {on_cuda()}: the scale is ready={fresh.ready}")
    finally:
        bmt.nn.set_fp8_delayed_gelu(prev)


@case
def fp8_delayed_input_scale_from_python():
    """set_fp8_delayed_inputs(True): bmt.nn.fp8_linear(scales=) and bmt.nn.Linear(fp8=True) cast their input and
    weight with delayed scales. The first call is the dynamic cast (amaxes recorded), the second with the same
    operands uses those amaxes' scales: both bit for bit the call without scales; a smaller input is cast with the
    larger window's scale: within FP8 rounding, not equal. Switch off: the scales are not touched. A deep copy of the
    layer starts afresh."""
    import copy
    x0 = rank_input(rank(), ROWS, IN, seed=71)
    w0, b0 = _w(72)
    g = rank_input(rank(), ROWS, OUT, seed=73)

    def run(fn, x):
        xi, w, b = x.clone().requires_grad_(), w0.clone().requires_grad_(), b0.clone().requires_grad_()
        y = fn(xi, w, b)
        (y * g).sum().backward()
        return [y.detach(), xi.grad, w.grad, b.grad]

    dynamic = run(bmt.nn.fp8_linear, x0)
    prev = bmt.nn.fp8_delayed_inputs()
    try:
        bmt.nn.set_fp8_delayed_inputs(False)
        off = bmt.nn.Fp8LinearScales()
        run(lambda *t: bmt.nn.fp8_linear(*t, scales=off), x0)
        if off.input.ready or off.weight.ready:
            raise AssertionError("switch off: the delayed scales were used")
        bmt.nn.set_fp8_delayed_inputs(True)
        if not bmt.nn.fp8_delayed_inputs():
            raise AssertionError("set_fp8_delayed_inputs(True) did not switch")
        s = bmt.nn.Fp8LinearScales()
        for call in ("first call (dynamic, amaxes recorded)", "second call (the recorded scales)"):
            got = run(lambda *t: bmt.nn.fp8_linear(*t, scales=s), x0)
            for i, (a, b) in enumerate(zip(got, dynamic)):
                assert_equal(f"{call}: output/gradient {i}", a, b)
        assert_equal("the input's newest amax", s.input.history[0].cpu(), x0.abs().max().float().cpu())
        assert_equal("the weight's newest amax", s.weight.history[0].cpu(), w0.abs().max().float().cpu())
        # (not a power of two, which would only move FP8's exponents)
        half = run(lambda *t: bmt.nn.fp8_linear(*t, scales=s), x0 * 0.3)
        half_dynamic = run(bmt.nn.fp8_linear, x0 * 0.3)
        if torch.equal(half[0], half_dynamic[0]):
            raise AssertionError("a smaller input gave the dynamic cast's output: the delayed scale was not used")
        rel = ((half[0].double() - half_dynamic[0].double()).norm() / half_dynamic[0].double().norm()).item()
        if rel > 0.05:
            raise AssertionError(f"a smaller input: output differs by {rel:.3g} (norm) from the dynamic cast's")
        # the layer keeps its own state (made on first use)
        layer = bmt.nn.Linear(IN, OUT, dtype=torch.float32, fp8=True)
        bmt.init_parameters(layer)
        with torch.no_grad():
            want = bmt.nn.fp8_linear(x0, layer.weight, layer.bias)
            for _ in range(2):
                assert_equal("Linear(fp8) with its delayed input scale", layer(x0), want)
        if not (layer._fp8_scales.input.ready and layer._fp8_scales.weight.ready):
            raise AssertionError("Linear(fp8) did not record its operands' amaxes")
        twin = copy.deepcopy(layer)
        if twin._fp8_scales.input.ready or twin._fp8_scales is layer._fp8_scales:
            raise AssertionError("a deep copy shares or carries the delayed scales' windows")
        import pickle
        if pickle.loads(pickle.dumps(layer._fp8_scales)).weight.ready:
            raise AssertionError("an unpickled Fp8LinearScales carries a window")
    finally:
        bmt.nn.set_fp8_delayed_inputs(prev)


@case
def fp8_delayed_grad_scale_from_python():
    """set_fp8_delayed_grads(True): the backward of bmt.nn.fp8_linear(scales=) and of bmt.nn.Linear(fp8=True) casts the
    output gradient with its delayed scale (Fp8LinearScales.grad, E5M2), the bias gradient from the same pass. The
    first call is the dynamic cast (amax recorded), the second with the same gradient uses that amax's scale: outputs
    and dx, dw bit for bit the call without scales, db to fp32 rounding; a smaller gradient is cast with the window's
    larger scale: within FP8 rounding, not equal. Switch off: the state is not touched; the autograd node keeps the
    state alive when the caller drops its scales before the backward."""
    import gc
    x0 = rank_input(rank(), ROWS, IN, seed=81)
    w0, b0 = _w(82)
    g = rank_input(rank(), ROWS, OUT, seed=83) * 0.01

    def run(fn, grad):
        xi, w, b = x0.clone().requires_grad_(), w0.clone().requires_grad_(), b0.clone().requires_grad_()
        y = fn(xi, w, b)
        y.backward(grad)
        return [y.detach(), xi.grad, w.grad, b.grad]

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    dynamic, dynamic_small = run(bmt.nn.fp8_linear, g), run(bmt.nn.fp8_linear, g * 0.3)
    prev = bmt.nn.fp8_delayed_grads()
    try:
        bmt.nn.set_fp8_delayed_grads(False)
        off = bmt.nn.Fp8LinearScales()
        run(lambda *t: bmt.nn.fp8_linear(*t, scales=off), g)
        if off.grad.ready:
            raise AssertionError("switch off: the gradient's delayed scale was used")
        bmt.nn.set_fp8_delayed_grads(True)
        if not bmt.nn.fp8_delayed_grads():
            raise AssertionError("set_fp8_delayed_grads(True) did not switch")
        s = bmt.nn.Fp8LinearScales()
        for call in ("first call (dynamic, amax recorded)", "second call (the recorded scale)"):
            got = run(lambda *t: bmt.nn.fp8_linear(*t, scales=s), g)
            for i in range(3):
                assert_equal(f"{call}: output/gradient {i}", got[i], dynamic[i])
            if rel(got[3], dynamic[3]) > 1e-5:
                raise AssertionError(f"{call}: the bias gradient differs by {rel(got[3], dynamic[3]):.3g}")
        assert_equal("the gradient's newest amax", s.grad.history[0].cpu(), g.abs().max().float().cpu())
        if s.input.ready or s.weight.ready:
            raise AssertionError("the forward's states moved without set_fp8_delayed_inputs")
        small = run(lambda *t: bmt.nn.fp8_linear(*t, scales=s), g * 0.3)
        if torch.equal(small[1], dynamic_small[1]):
            raise AssertionError("a smaller gradient gave the dynamic cast's dx: the delayed scale was not used")
        for i, name in ((1, "dx"), (2, "dw")):
            if rel(small[i], dynamic_small[i]) > 0.1:
                raise AssertionError(f"a smaller gradient: {name} differs by {rel(small[i], dynamic_small[i]):.3g}")
        # the node holds the state: the caller's scales dropped between forward and backward
        kept = bmt.nn.Fp8LinearScales()
        run(lambda *t: bmt.nn.fp8_linear(*t, scales=kept), g)
        window = kept.grad.history  # (a tensor of the shared state)
        xi = x0.clone().requires_grad_()
        y = bmt.nn.fp8_linear(xi, w0, b0, scales=kept)
        del kept
        gc.collect()
        y.backward(g * 0.3)
        assert_equal("dx with the dropped scales", xi.grad, small[1])
        assert_equal("the node's record", window[0].cpu(), (g * 0.3).abs().max().float().cpu())
        # bmt.nn.Linear keeps its scales under this switch alone
        layer = bmt.nn.Linear(IN, OUT, dtype=torch.float32, fp8=True)
        bmt.init_parameters(layer)
        layer(x0).backward(g)
        if not layer._fp8_scales.grad.ready:
            raise AssertionError("Linear(fp8) did not record its gradient's amax")
    finally:
        bmt.nn.set_fp8_delayed_grads(prev)


@case
def fp8_recipe_switches_the_delayed_scalings_together():
    """set_fp8_recipe("delayed") turns on the three delayed scalings, "current" turns them off, a switch set after
    the recipe wins, and another name is refused naming the choices; with the delayed recipe bmt.nn.Linear(fp8=True)
    keeps delayed scales for its input, weight and gradient."""
    switches = (bmt.nn.fp8_delayed_gelu, bmt.nn.fp8_delayed_inputs, bmt.nn.fp8_delayed_grads)
    prev = (bmt.nn.fp8_recipe(), [f() for f in switches])
    try:
        bmt.nn.set_fp8_recipe("delayed")
        if bmt.nn.fp8_recipe() != "delayed" or not all(f() for f in switches):
            raise AssertionError(f"recipe 'delayed': {bmt.nn.fp8_recipe()}, switches {[f() for f in switches]}")
        layer = bmt.nn.Linear(IN, OUT, dtype=torch.float32, fp8=True)
        bmt.init_parameters(layer)
        layer(rank_input(rank(), ROWS, IN, seed=91)).backward(rank_input(rank(), ROWS, OUT, seed=92))
        s = layer._fp8_scales
        if not (s.input.ready and s.weight.ready and s.grad.ready):
            raise AssertionError("recipe 'delayed': Linear(fp8) did not record its input, weight and gradient amaxes")
        bmt.nn.set_fp8_delayed_grads(False)
        if bmt.nn.fp8_delayed_grads() or not bmt.nn.fp8_delayed_inputs():
            raise AssertionError("a switch set after the recipe did not win over it")
        bmt.nn.set_fp8_recipe("current")
        if bmt.nn.fp8_recipe() != "current" or any(f() for f in switches):
            raise AssertionError(f"recipe 'current': switches {[f() for f in switches]}")
        expect_raises("recipe 'tensorwise'", (RuntimeError, ValueError), lambda: bmt.nn.set_fp8_recipe("tensorwise"),
                      must_mention=("tensorwise", "current", "delayed"))
    finally:
        bmt.nn.set_fp8_recipe(prev[0])
        bmt.nn.set_fp8_delayed_gelu(prev[1][0])
        bmt.nn.set_fp8_delayed_inputs(prev[1][1])
        bmt.nn.set_fp8_delayed_grads(prev[1][2])


@case
def fp8_routed_linear_keeps_delayed_scales_on_its_weight():
    """Under the delayed recipe a routed FP8 F.linear in a ZeRO-3 Block keeps an Fp8LinearScales on its weight
    parameter: two steps give the output and input gradient of bmt.nn.fp8_linear driven through the same calls with
    a state of its own, bit for bit (the first step casts dynamically, the second with the recorded scales), and
    the states are ready; checkpointed, the recompute uses the same state; the current recipe makes no state."""
    prev = (bmt.nn.fp8_recipe(), bmt.nn.fp8_delayed_gelu(), bmt.nn.fp8_delayed_inputs(), bmt.nn.fp8_delayed_grads())
    try:
        bmt.nn.set_fp8_recipe("delayed")
        model = bmt.Block(_OneLinear())
        bmt.init_parameters(model)
        sd = model.state_dict()
        w, b = sd["w"].to(device()), sd["b"].to(device())
        ref = bmt.nn.Fp8LinearScales()
        g = rank_input(rank(), ROWS, IN, seed=96) * 0.01
        with bmt.torch_ops.fp8(True):
            for step, scale in enumerate((1.0, 0.5)):
                x = (rank_input(rank(), ROWS, IN, seed=95) * scale).requires_grad_()
                y = model(x)
                y.backward(g)
                xr = x.detach().clone().requires_grad_()
                yr = bmt.nn.fp8_linear(xr, w, b, scales=ref)
                yr.backward(g)
                assert_equal(f"step {step}: routed output", y.detach(), yr.detach())
                assert_equal(f"step {step}: routed input gradient", x.grad, xr.grad)
        s = model.w.__dict__.get("_bmt_fp8_scales")
        if s is None or not (s.input.ready and s.weight.ready and s.grad.ready):
            raise AssertionError("the routed linear kept no ready delayed scales on its weight")
        assert_equal("the input's newest amax", s.input.history[0].cpu(), ref.input.history[0].cpu())
        ckpt = bmt.Block(_OneLinear(), use_checkpoint=True)
        bmt.init_parameters(ckpt)
        with bmt.torch_ops.fp8(True):
            x = rank_input(rank(), ROWS, IN, seed=97, requires_grad=True)
            ckpt(x).backward(g)
        s = ckpt.w.__dict__.get("_bmt_fp8_scales")
        if s is None or not (s.input.ready and s.grad.ready) or x.grad is None or not torch.isfinite(x.grad).all():
            raise AssertionError("checkpointed: no ready delayed scales, or no finite input gradient")
        bmt.nn.set_fp8_recipe("current")
        plain = bmt.Block(_OneLinear())
        bmt.init_parameters(plain)
        with bmt.torch_ops.fp8(True):
            plain(rank_input(rank(), ROWS, IN, seed=98))
        if "_bmt_fp8_scales" in plain.w.__dict__:
            raise AssertionError("the current recipe made delayed scales for a routed linear")
    finally:
        bmt.nn.set_fp8_recipe(prev[0])
        bmt.nn.set_fp8_delayed_gelu(prev[1])
        bmt.nn.set_fp8_delayed_inputs(prev[2])
        bmt.nn.set_fp8_delayed_grads(prev[3])


if __name__ == "__main__":
    main()
