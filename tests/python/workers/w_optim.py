"""Optimizers, OptimManager, checkpoint/resume and LR schedulers against torch.optim and BMTrain's formulas.

Data parallelism: every rank computes the loss of its own micro-batch; OptimManager divides by grad_scale =
world size (BMTrain), so the torch reference steps on the mean of the ranks' losses.
"""
import math
import os

import torch

import bmtrain as bmt
from common import OUT, assert_close, assert_equal, case, compare_state, main, randn, rank, rank_input, world
from models import BMT, TORCH, make

D, B = 6, 3
BETAS, EPS = (0.9, 0.95), 1e-8


def _loss(out, seed=7):
    return (out * randn(*out.shape, seed=seed)).sum() / out.shape[0]


def _ref_loss(ref, seed):
    return sum(_loss(ref(rank_input(r, B, D, seed=seed))) for r in range(world())) / world()


def _compare_trajectory(opt_cls, ref_cls, wd, steps=4, lr=1e-2, decoupled=False):
    T, M = make(TORCH), make(BMT)
    model, ref = M.Net(D, 2, 11), T.Net(D, 2, 11)
    opt = opt_cls(model.parameters(), lr=lr, betas=BETAS, eps=EPS, weight_decay=wd, decoupled_weight_decay=decoupled)
    om = bmt.optim.OptimManager(loss_scale=1024)
    om.add_optimizer(opt)
    ref_opt = ref_cls(ref.parameters(), lr=lr, betas=BETAS, eps=EPS, weight_decay=wd)
    what = f"{opt_cls.__name__}(weight_decay={wd}) vs torch.optim.{ref_cls.__name__}"
    for step in range(steps):
        om.zero_grad()
        ref_opt.zero_grad()
        loss = _loss(model(rank_input(rank(), B, D, seed=20 + step)))
        om.backward(loss)
        _ref_loss(ref, 20 + step).backward()
        om.step()
        ref_opt.step()
        compare_state(model, ref, rtol=1e-5, atol=1e-6, what=f"{what}, step {step + 1}: ")


@case
def adam_vs_torch():
    _compare_trajectory(bmt.optim.AdamOptimizer, torch.optim.Adam, 0.0)
    _compare_trajectory(bmt.optim.AdamOptimizer, torch.optim.Adam, 0.05)  # L2 weight decay, as BMTrain's fp32
    _compare_trajectory(bmt.optim.AdamOptimizer, torch.optim.AdamW, 0.05, decoupled=True)


@case
def adam_offload_vs_torch():
    _compare_trajectory(bmt.optim.AdamOffloadOptimizer, torch.optim.Adam, 0.0)
    _compare_trajectory(bmt.optim.AdamOffloadOptimizer, torch.optim.Adam, 0.05)
    _compare_trajectory(bmt.optim.AdamOffloadOptimizer, torch.optim.AdamW, 0.05, decoupled=True)


@case
def adam_bf16_vs_fp32_master():
    """bf16 parameters: AdamOptimizer / AdamOffloadOptimizer keep fp32 master weights. Reference: the bf16 torch
    twin computes the gradients, torch.optim.AdamW steps an fp32 master copy, the twin gets the master rounded to
    bf16. Tolerance: one bf16 ulp (the lr is large enough that a wrong update would exceed it)."""
    from models import BMT_BF16, TORCH_BF16
    for opt_cls in (bmt.optim.AdamOptimizer, bmt.optim.AdamOffloadOptimizer):
        model, ref = make(BMT_BF16).Net(D, 2, 17), make(TORCH_BF16).Net(D, 2, 17)
        master = [p.detach().float().clone().requires_grad_(True) for p in ref.parameters()]
        # eps 1e-4: Adam turns a tiny gradient's bf16 rounding noise into a full-size step with eps 1e-8.
        opt = opt_cls(model.parameters(), lr=5e-2, betas=BETAS, eps=1e-4, weight_decay=0.1)
        om = bmt.optim.OptimManager(loss_scale=1024)
        om.add_optimizer(opt)
        ref_opt = torch.optim.AdamW(master, lr=5e-2, betas=BETAS, eps=1e-4, weight_decay=0.1)
        for step in range(3):
            om.zero_grad()
            om.backward(_loss(model(rank_input(rank(), B, D, seed=90 + step).to(torch.bfloat16)).float()))
            # Each rank's bf16 gradient, summed in fp32; every parameter keeps BMTrain's bf16 gradient shard (in
            # Blocks and outside them): the sum rounded to bf16 (once here; the engine's reduction rounds per step
            # at world 4, within the tolerance).
            for m in master:
                m.grad = torch.zeros_like(m)
            for r in range(world()):
                for p in ref.parameters():
                    p.grad = None
                (_loss(ref(rank_input(r, B, D, seed=90 + step).to(torch.bfloat16)).float()) / world()).backward()
                for m, p in zip(master, ref.parameters()):
                    m.grad += p.grad.float()
            for m in master:
                m.grad = m.grad.to(torch.bfloat16).float()
            om.step()
            ref_opt.step()
            with torch.no_grad():
                for m, p in zip(master, ref.parameters()):
                    p.copy_(m)
            compare_state(model, ref, rtol=1e-2, atol=1e-3, what=f"bf16 {opt_cls.__name__} step {step + 1}: ")
        if torch.equal(model.state_dict()["head.weight"], make(TORCH_BF16).Net(D, 2, 17).state_dict()["head.weight"].cpu()):
            raise AssertionError("bf16 parameters did not change")


@case
def adam_hold_steps():
    """hold_steps=2: the first 2 steps use lr 0 but still update the Adam moments (BMTrain's fp32 path); the
    reference is torch.optim.Adam with lr 0 for those steps."""
    for opt_cls in (bmt.optim.AdamOptimizer, bmt.optim.AdamOffloadOptimizer):
        model, ref = make(BMT).Net(D, 1, 18), make(TORCH).Net(D, 1, 18)
        opt = opt_cls(model.parameters(), lr=1e-2, betas=BETAS, eps=EPS, hold_steps=2)
        om = bmt.optim.OptimManager(loss_scale=1024)
        om.add_optimizer(opt)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, betas=BETAS, eps=EPS)
        initial = model.state_dict()
        for step in range(4):
            ref_opt.param_groups[0]["lr"] = 0.0 if step < 2 else 1e-2
            om.zero_grad()
            ref_opt.zero_grad()
            om.backward(_loss(model(rank_input(rank(), B, D, seed=95 + step))))
            _ref_loss(ref, 95 + step).backward()
            om.step()
            ref_opt.step()
            if step == 1:
                for k, v in initial.items():
                    assert_equal(f"{opt_cls.__name__}: {k} during hold_steps", model.state_dict()[k], v)
        compare_state(model, ref, rtol=1e-5, atol=1e-6, what=f"{opt_cls.__name__} hold_steps=2, after 4 steps: ")


@case
def clip_grad_norm_vs_torch():
    T, M = make(TORCH), make(BMT)
    model, ref = M.Net(D, 2, 12), T.Net(D, 2, 12)
    opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2)
    om = bmt.optim.OptimManager(loss_scale=1024)
    om.add_optimizer(opt)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step, max_norm in enumerate((1e-3, 1e3)):  # clipping active, then inactive
        om.zero_grad()
        ref_opt.zero_grad()
        om.backward(_loss(model(rank_input(rank(), B, D, seed=30 + step))))
        _ref_loss(ref, 30 + step).backward()
        norm = om.clip_grad_norm(opt.param_groups, max_norm)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        assert_close(f"clip_grad_norm total norm (max_norm {max_norm})", torch.as_tensor(float(norm)),
                     ref_norm, rtol=1e-5)
        om.step()
        ref_opt.step()
        compare_state(model, ref, rtol=1e-5, atol=1e-6, what=f"after clipped step {step + 1}: ")


def _resumable(opt_cls, seed):
    model = make(BMT).Net(D, 2, seed)
    opt = opt_cls(model.parameters(), lr=1e-2, betas=BETAS, weight_decay=0.01)
    sched = bmt.lr_scheduler.Noam(opt, start_lr=1e-2, warmup_iter=2, end_iter=100, num_iter=0)
    om = bmt.optim.OptimManager(loss_scale=1024)
    om.add_optimizer(opt, sched)
    return model, opt, om


def _steps(model, om, first, n):
    losses = []
    for step in range(first, first + n):
        om.zero_grad()
        loss = _loss(model(rank_input(rank(), B, D, seed=40 + step)))
        om.backward(loss)
        om.step()
        losses.append(loss.detach().clone())
    return losses


@case
def save_resume_bit_identical():
    """3 steps, save (bmt.save + OptimManager.state_dict), 3 more; a fresh run that loads the checkpoint and
    does the same 3 steps must reproduce losses and parameters bit for bit."""
    for opt_cls in (bmt.optim.AdamOptimizer, bmt.optim.AdamOffloadOptimizer):
        name = opt_cls.__name__
        model, opt, om = _resumable(opt_cls, 13)
        _steps(model, om, 0, 3)
        model_path = os.path.join(OUT, f"resume_{name}.pt")
        opt_path = os.path.join(OUT, f"resume_{name}.opt.{rank()}")
        bmt.save(model, model_path)
        torch.save(om.state_dict(), opt_path)
        losses = _steps(model, om, 3, 3)
        final = model.state_dict()
        lr = opt.param_groups[0]["lr"]

        model2, opt2, om2 = _resumable(opt_cls, 14)  # other initial values: everything must come from the files
        bmt.load(model2, model_path)
        om2.load_state_dict(torch.load(opt_path, weights_only=False))
        losses2 = _steps(model2, om2, 3, 3)
        for i, (a, b) in enumerate(zip(losses, losses2)):
            assert_equal(f"{name}: loss at resumed step {i + 4}", b, a)
        for k, v in final.items():
            assert_equal(f"{name}: {k} after resume", model2.state_dict()[k], v)
        if opt2.param_groups[0]["lr"] != lr:
            raise AssertionError(f"{name}: lr after resume {opt2.param_groups[0]['lr']} != {lr}")
        if om2.loss_scale != om.loss_scale:
            raise AssertionError(f"{name}: loss scale after resume {om2.loss_scale} != {om.loss_scale}")


S, W, E = 1e-3, 10, 50


def _bmt_formula(kind, t):
    """BMTrain 1.0.1's schedules (lr_scheduler/*.py): warm-up S*t/W (Noam: S/sqrt(W)*t/W)."""
    if t < W:
        return S / math.sqrt(W) * t / W if kind == "Noam" else S * t / W
    if kind == "NoDecay":
        return S
    if kind == "Noam":
        return S / math.sqrt(t)
    if kind == "Linear":
        return max(0.0, S * (E - t) / (E - W))
    if kind == "Cosine":
        return max(0.0, S * 0.5 * (1.0 + math.cos(math.pi * (t - W) / max(1, E - W))))
    if kind == "Exponential":
        return max(0.0, S * 0.95 ** (t - W))
    raise ValueError(kind)


@case
def lr_schedulers():
    p = bmt.DistributedParameter(torch.zeros(4))
    for kind in ("NoDecay", "Noam", "Linear", "Cosine", "Exponential"):
        cls = getattr(bmt.lr_scheduler, kind)
        opt = bmt.optim.AdamOptimizer([p], lr=123.0)
        sched = cls(opt, start_lr=S, warmup_iter=W, end_iter=E, num_iter=0)
        for t in range(E):
            want = _bmt_formula(kind, t)
            for what, got in (("current_lr", sched.current_lr), ("get_lr()", sched.get_lr()),
                              ("param_groups lr", opt.param_groups[0]["lr"])):
                if not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15):
                    raise AssertionError(f"{kind} {what} at num_iter {t}: {got!r}, BMTrain gives {want!r}")
            sched.step()
        sd = sched.state_dict()
        for k in ("start_lr", "warmup_iter", "end_iter", "num_iter"):
            if k not in sd:
                raise AssertionError(f"{kind}.state_dict() lacks '{k}': {sd}")
        again = cls(bmt.optim.AdamOptimizer([p], lr=1.0), start_lr=S, warmup_iter=W, end_iter=E, num_iter=0)
        again.load_state_dict(sd)
        if not math.isclose(again.current_lr, _bmt_formula(kind, E), rel_tol=1e-9, abs_tol=1e-15):
            raise AssertionError(f"{kind}: after load_state_dict lr {again.current_lr}")
        sched.step(7)  # an explicit iteration number
        if not math.isclose(opt.param_groups[0]["lr"], _bmt_formula(kind, 7), rel_tol=1e-9, abs_tol=1e-15):
            raise AssertionError(f"{kind}: step(7) set lr {opt.param_groups[0]['lr']}")
        started = cls(bmt.optim.AdamOptimizer([p], lr=1.0), start_lr=S, warmup_iter=W, end_iter=E, num_iter=15)
        if not math.isclose(started.current_lr, _bmt_formula(kind, 15), rel_tol=1e-9, abs_tol=1e-15):
            raise AssertionError(f"{kind}(num_iter=15): lr {started.current_lr}")


@case
def loss_scale_overflow():
    """bf16 parameters: an inf gradient on rank 0 only makes every rank skip the step (parameters and scheduler
    unchanged) and halve the scale; loss_scale_steps clean steps later it doubles again (BMTrain's dynamics)."""
    from models import BMT_BF16
    model = make(BMT_BF16).Layer(D, 16)
    opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2)
    sched = bmt.lr_scheduler.NoDecay(opt, start_lr=1e-2, warmup_iter=4, end_iter=100, num_iter=0)
    om = bmt.optim.OptimManager(loss_scale=1024, loss_scale_factor=2, loss_scale_steps=2)
    om.add_optimizer(opt, sched)

    def step(seed, poison=False):
        om.zero_grad()
        loss = _loss(model(rank_input(rank(), B, D, seed=seed).to(torch.bfloat16)).float())
        if poison and rank() == 0:
            loss = loss * float("inf")
        om.backward(loss)
        om.step()

    step(60)
    before, lr_before = model.state_dict(), opt.param_groups[0]["lr"]
    step(61, poison=True)
    if om.loss_scale != 512:
        raise AssertionError(f"after an overflow the loss scale is {om.loss_scale}, expected 1024 / 2 = 512")
    for k, v in before.items():
        assert_equal(f"{k} after the skipped (overflow) step", model.state_dict()[k], v)
    if opt.param_groups[0]["lr"] != lr_before:
        raise AssertionError("the LR scheduler advanced on a skipped step")
    step(62)
    step(63)
    if om.loss_scale != 1024:
        raise AssertionError(f"after 2 clean steps (loss_scale_steps=2) the scale is {om.loss_scale}, expected 1024")
    if torch.equal(model.state_dict()["lin1.weight"], before["lin1.weight"]):
        raise AssertionError("clean steps after the overflow did not update the parameters")


@case
def optim_manager_advances_scheduler():
    model = make(BMT).Layer(D, 15)
    opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1.0)
    sched = bmt.lr_scheduler.Linear(opt, start_lr=S, warmup_iter=W, end_iter=E, num_iter=0)
    om = bmt.optim.OptimManager(loss_scale=1024)
    om.add_optimizer(opt, sched)
    for step in range(3):
        om.zero_grad()
        om.backward(_loss(model(rank_input(rank(), B, D, seed=50 + step))))
        om.step()
    if not math.isclose(opt.param_groups[0]["lr"], _bmt_formula("Linear", 3), rel_tol=1e-9):
        raise AssertionError(f"after 3 OptimManager steps lr {opt.param_groups[0]['lr']}, expected "
                             f"{_bmt_formula('Linear', 3)} (num_iter 3)")
    if om.grad_scale != world():
        raise AssertionError(f"OptimManager.grad_scale {om.grad_scale}, BMTrain's default is the world size "
                             f"{world()} (no pipeline)")


@case
def offload_overlap_with_backward():
    """OptimManager.overlap_offload_with_backward(): every Block's update starts during the backward, and the
    parameters equal those of the same steps without the overlap, bit for bit; refused under loss scaling."""
    M = make(BMT)
    runs = {}
    for overlap in (False, True):
        model = M.Net(D, 2, 11)
        opt = bmt.optim.AdamOffloadOptimizer(model.parameters(), lr=1e-2, betas=BETAS, eps=EPS, weight_decay=0.05)
        om = bmt.optim.OptimManager(loss_scale=None)
        om.add_optimizer(opt)
        handle = om.overlap_offload_with_backward() if overlap else None
        for step in range(3):
            om.zero_grad()
            om.backward(_loss(model(rank_input(rank(), B, D, seed=40 + step))))
            om.step()
        if handle is not None:
            if handle.num_early_starts != 3 * 2:
                raise AssertionError(f"overlap started {handle.num_early_starts} Block updates early, expected 6 "
                                     "(2 Blocks x 3 steps)")
            handle.remove()
            if handle.active:
                raise AssertionError("overlap handle still active after remove()")
        runs[overlap] = model.state_dict()
    for k, v in runs[False].items():
        assert_equal(f"overlap vs none: {k}", runs[True][k], v)
    om = bmt.optim.OptimManager(loss_scale=1024)
    om.add_optimizer(bmt.optim.AdamOffloadOptimizer(M.Net(D, 1, 3).parameters()))
    try:
        om.overlap_offload_with_backward()
    except RuntimeError as e:
        if "loss scal" not in str(e):
            raise AssertionError(f"refusal under loss scaling does not say why: {e}")
    else:
        raise AssertionError("overlap_offload_with_backward() accepted a manager with loss scaling")


@case
def step_in_backward_releases_gradients():
    """OptimManager.overlap_step_with_backward() with AdamOptimizer: each Block is updated during the backward and
    its gradient shards are freed; parameters equal the plain steps' bit for bit; clipping is then refused."""
    M = make(BMT)
    runs = {}
    for overlap in (False, True):
        model = M.Net(D, 2, 11)
        opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, betas=BETAS, eps=EPS, weight_decay=0.05)
        om = bmt.optim.OptimManager(loss_scale=None)
        om.add_optimizer(opt)
        handle = om.overlap_step_with_backward() if overlap else None
        for step in range(3):
            om.zero_grad()
            om.backward(_loss(model(rank_input(rank(), B, D, seed=60 + step))))
            if handle is not None and step == 2:
                try:
                    om.clip_grad_norm(opt.param_groups, 1.0)
                except RuntimeError as e:
                    if "before any update" not in str(e):
                        raise AssertionError(f"clip_grad_norm refusal does not say why: {e}")
                else:
                    raise AssertionError("clip_grad_norm accepted a model whose Blocks were already updated")
            om.step()
        if handle is not None:
            if handle.num_early_starts != 3 * 2:
                raise AssertionError(f"{handle.num_early_starts} Block updates during the backward, expected 6")
            handle.remove()
        runs[overlap] = model.state_dict()
    for k, v in runs[False].items():
        assert_equal(f"step in backward vs plain: {k}", runs[True][k], v)


if __name__ == "__main__":
    main()
