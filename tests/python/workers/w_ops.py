"""Differentiable collectives (closed forms), gather_result / sum_loss, FusedCrossEntropy vs torch."""
import warnings

import torch
import torch.nn.functional as F

import bmtrain as bmt
from common import Skip, assert_close, case, device, expect_raises, main, on_cuda, rank, rank_input, world

SHAPE = (2, 3)


def _x(r, shape=SHAPE, seed=1):
    return rank_input(r, *shape, seed=seed, requires_grad=True)


def _g(r, shape, seed=2):
    """Rank r's upstream gradient (every rank can rebuild it)."""
    return rank_input(r, *shape, seed=seed)


def _backward(y, seed=2):
    g = _g(rank(), tuple(y.shape), seed)
    (y * g).sum().backward()
    return g


@case
def all_gather_grad():
    ws, me = world(), rank()
    x = _x(me)
    y = bmt.distributed.all_gather(x)
    assert_close("all_gather forward", y, torch.stack([_x(r).detach() for r in range(ws)]))
    _backward(y)
    # BMTrain's backward keeps the local slice of the upstream gradient (not a reduce-scatter).
    assert_close("all_gather backward (local slice)", x.grad, _g(me, (ws, *SHAPE))[me])


@case
def all_reduce_grad():
    """BMTrain's backward (bmtrain/distributed/ops.py), local to each rank: sum the identity, avg / ws, max/min the
    upstream gradient where this rank's input equals the result, prod times result / input."""
    ws, me = world(), rank()
    xs = [_x(r).detach() for r in range(ws)]
    forward = {"sum": sum(xs), "avg": sum(xs) / ws, "max": torch.stack(xs).amax(0), "min": torch.stack(xs).amin(0),
               "prod": torch.stack(xs).prod(0)}
    g_me = _g(me, SHAPE)
    for op, want in forward.items():
        x = _x(me)
        y = bmt.distributed.all_reduce(x, op)
        assert_close(f"all_reduce({op}) forward", y, want)
        _backward(y)
        grad = {"sum": g_me, "avg": g_me / ws, "max": g_me * (xs[me] == want), "min": g_me * (xs[me] == want),
                "prod": g_me * want / xs[me]}[op]
        assert_close(f"all_reduce({op}) backward", x.grad, grad, rtol=1e-5, atol=1e-6)


@case
def reduce_scatter_grad():
    ws, me = world(), rank()
    shape = (2 * ws, 3)
    xs = [_x(r, shape).detach() for r in range(ws)]
    for op, div in (("sum", 1), ("avg", ws)):
        x = _x(me, shape)
        y = bmt.distributed.reduce_scatter(x, op)
        assert_close(f"reduce_scatter({op}) forward", y, (sum(xs) / div)[2 * me:2 * me + 2])
        _backward(y)
        # Backward: all-gather of the ranks' upstream gradients (divided by ws for avg).
        assert_close(f"reduce_scatter({op}) backward", x.grad,
                     torch.cat([_g(r, (2, 3)) for r in range(ws)]) / div)
    for op in ("max", "min", "prod"):  # BMTrain raises in their backward
        y = bmt.distributed.reduce_scatter(_x(me, shape), op)
        expect_raises(f"reduce_scatter({op}) backward", (NotImplementedError,), lambda: y.sum().backward(), [op])


@case
def broadcast_grad():
    ws, me = world(), rank()
    for root in sorted({0, ws - 1}):
        x = _x(me)
        y = bmt.distributed.broadcast(x, root)
        assert_close(f"broadcast(root={root}) forward", y, _x(root).detach())
        _backward(y)
        # Backward (BMTrain's): the ranks' upstream gradients all-reduced, on every rank (the root and the others).
        assert_close(f"broadcast(root={root}) backward", x.grad, sum(_g(r, SHAPE) for r in range(ws)))


@case
def gather_result_and_sum_loss():
    ws, me = world(), rank()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = bmt.gather_result(_x(me).detach())
        assert_close("gather_result", got, torch.cat([_x(r).detach() for r in range(ws)]))
        if got.device != _x(me).device:
            raise AssertionError(f"gather_result moved the result to {got.device}")
        loss = torch.tensor(float(me + 1), device=device())
        # sum_loss returns the *mean* over ranks (BMTrain, despite the name).
        assert_close("sum_loss", bmt.sum_loss(loss), torch.tensor((ws + 1) / 2))


N, C = 12, 7


def _ce_inputs(dtype=torch.float32, ignore_index=-100):
    logits = rank_input(rank(), N, C, seed=3).mul(3).to(dtype).requires_grad_(True)
    g = torch.Generator().manual_seed(4)
    target = torch.randint(0, C, (N,), generator=g)
    target[::4] = ignore_index  # some ignored rows
    weight = torch.rand(C, generator=g) + 0.5
    return logits, target.to(device()), weight.to(device())


def _check_ce(ignore_index, reduction, smoothing, use_weight):
    what = f"ignore_index={ignore_index} reduction={reduction} smoothing={smoothing} weight={use_weight}"
    x, t, w = _ce_inputs(ignore_index=ignore_index)
    w = w if use_weight else None
    loss_fn = bmt.loss.FusedCrossEntropy(weight=w, ignore_index=ignore_index, reduction=reduction,
                                         label_smoothing=smoothing)
    loss = loss_fn(x, t)
    x_ref = x.detach().clone().requires_grad_(True)
    ref = F.cross_entropy(x_ref, t, weight=w, ignore_index=ignore_index, reduction=reduction,
                          label_smoothing=smoothing)
    assert_close(f"{what}: loss", loss, ref, rtol=1e-5, atol=1e-6)
    up = torch.linspace(0.5, 1.5, N, device=device()) if reduction == "none" else 1.0
    (loss * up).sum().backward()
    (ref * up).sum().backward()
    assert_close(f"{what}: input grad", x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)


@case
def fused_cross_entropy_vs_torch():
    for ignore_index in (-100, 2):
        for reduction in ("mean", "sum", "none"):
            _check_ce(ignore_index, reduction, 0.0, False)
            _check_ce(ignore_index, reduction, 0.0, True)
            _check_ce(ignore_index, reduction, 0.1, False)


@case
def fused_cross_entropy_weight_and_smoothing():
    """Class weights together with label smoothing (BMTrain's fp32 path hands both to torch)."""
    for reduction in ("mean", "sum", "none"):
        _check_ce(-100, reduction, 0.1, True)


@case
def fused_cross_entropy_half_gpu():
    """fp16/bf16 logits (the fused kernel): loss close to torch's fp32 on the same values (BMTrain's contract)."""
    if not on_cuda():
        raise Skip("half-precision fused cross-entropy is checked on the GPU variant")
    for dtype in (torch.float16, torch.bfloat16):
        for use_weight in (False, True):
            x, t, w = _ce_inputs(dtype)
            w = w if use_weight else None
            loss = bmt.loss.FusedCrossEntropy(weight=w)(x, t)
            x_ref = x.detach().float().requires_grad_(True)
            ref = F.cross_entropy(x_ref, t, weight=w)
            assert_close(f"{dtype} weight={use_weight}: loss", loss.float(), ref, rtol=1e-3, atol=1e-4)
            (loss * 1024).backward()
            (ref * 1024).backward()
            assert_close(f"{dtype} weight={use_weight}: grad", x.grad.float(), x_ref.grad, rtol=2e-2, atol=0.1)


@case
def layer_ops_match_torch():
    """bmtrain._C.nn (what bmt.nn.Linear / LayerNorm call; gelu_mlp and linear_residual for user MLPs): outputs and
    every gradient against torch's functional ops. fp32 here (CUDA: our reductions; the epilogue GEMMs are bf16-only
    and checked by bmt_nn_cuda_tests)."""
    torch.manual_seed(5)
    dev = device()

    def leaves(*shapes):
        return [torch.randn(*s, device=dev, dtype=torch.float32).mul_(0.3).requires_grad_() for s in shapes]

    def grads_of(fn, tensors, gy):
        for t in tensors:
            t.grad = None
        fn(*tensors).backward(gy)
        return [t.grad.clone() for t in tensors]

    x, w1, b1, w2, b2, r = leaves((2, 5, 8), (16, 8), (16,), (8, 16), (8,), (2, 5, 8))
    ln_w, ln_b, w3 = leaves((8,), (8,), (8, 8))
    gy = torch.randn(2, 5, 8, device=dev)
    gh = torch.randn(2, 5, 16, device=dev)
    mlp_ref = lambda x, w1, b1, w2, b2, r: r + F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)
    cases = {
        "linear": (lambda x, w, b: bmt._C.nn.linear(x, w, b), F.linear, [x, w1, b1], gh),
        "linear without bias": (lambda x, w: bmt._C.nn.linear(x, w), F.linear, [x, w1], gh),
        "layer_norm": (lambda x, w, b: bmt._C.nn.layer_norm(x, 8, w, b, 1e-5),
                       lambda x, w, b: F.layer_norm(x, (8,), w, b, 1e-5), [x, ln_w, ln_b], gy),
        "gelu_mlp": (lambda *t: bmt._C.nn.gelu_mlp(*t), mlp_ref, [x, w1, b1, w2, b2, r], gy),
        "linear_residual": (lambda *t: bmt._C.nn.linear_residual(*t), lambda x, w, b, r: r + F.linear(x, w, b),
                            [x, w3, b2, r], gy),
    }
    for name, (ours, ref, tensors, g) in cases.items():
        assert_close(f"{name} forward", ours(*tensors), ref(*tensors), rtol=1e-5, atol=1e-5)
        for i, (a, b) in enumerate(zip(grads_of(ours, tensors, g), grads_of(ref, tensors, g))):
            assert_close(f"{name} grad of input {i}", a, b, rtol=1e-5, atol=1e-5)
    # A wrong feature count is the engine's error, named.
    try:
        bmt._C.nn.gelu_mlp(x, w1, b1, w1, b2)
    except RuntimeError as e:
        assert "c_proj weight" in str(e), e
    else:
        raise AssertionError("gelu_mlp accepted a c_proj weight of the wrong shape")


if __name__ == "__main__":
    main()
