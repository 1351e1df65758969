"""fp32 Adam bit for bit against torch.optim.Adam / AdamW (issue 31): BMTrain runs fp32 parameters through torch's
own Adam (L2 weight decay; the gradient divided by the loss scale first; hold_steps updates at lr 0), so its
results equal torch's exactly. Also BMTrain's hold_steps count for half-precision parameters (closed form).

The gradients are written by the test (the same values for bmt and torch), so what is compared is the update
alone: any difference in the optimizer's arithmetic shows as a non-zero difference.
"""
import torch

import bmtrain as bmt
from common import assert_equal, case, device, local_shard_range, main, randn, world
from models import BMT, TORCH, make

LR, BETAS, EPS, WD = 1e-2, (0.8, 0.99), 1e-6, 0.05
SHAPES = [(37, 13), (129,), (5, 7, 3), (1000,)]  # odd sizes: vector loops and scalar tails of the CPU kernels


def _ref(params, decoupled, ref_cls="Adam"):
    if ref_cls == "AdamW":
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    return torch.optim.Adam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, decoupled_weight_decay=decoupled)


def _plain_trajectory(opt_cls, decoupled, ref_cls, hold, steps=24, scale=4.0):
    """Plain fp32 tensors under OptimManager(loss_scale=scale); torch gets the unscaled gradients and lr 0 for the
    first `hold` steps. The offload optimizer updates on the CPU (as BMTrain's): its reference runs there."""
    ref_dev = torch.device("cpu") if opt_cls is bmt.optim.AdamOffloadOptimizer else device()
    init = [randn(*s, seed=10 + i) for i, s in enumerate(SHAPES)]
    ours = [t.clone().requires_grad_() for t in init]
    theirs = [t.to(ref_dev, copy=True).requires_grad_() for t in init]
    opt = opt_cls(ours, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, hold_steps=hold,
                  decoupled_weight_decay=decoupled)
    om = bmt.optim.OptimManager(loss_scale=scale)
    om.add_optimizer(opt)
    ref = _ref(theirs, decoupled, ref_cls)
    what = f"{opt_cls.__name__}(decoupled_weight_decay={decoupled}, hold_steps={hold}) vs torch.optim.{ref_cls}"
    for step in range(steps):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            g = randn(*a.shape, seed=1000 * step + i)
            a.grad = g * om.loss_scale  # what a backward of the scaled loss leaves (exact: a power of two)
            b.grad = g.to(ref_dev, copy=True)
        ref.param_groups[0]["lr"] = 0.0 if step < hold else LR
        om.step()
        ref.step()
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_equal(f"{what}: parameter {i} after step {step + 1}", a.detach().to(ref_dev), b.detach())
            assert_equal(f"{what}: exp_avg {i} after step {step + 1}", opt.state[a]["exp_avg"].to(ref_dev),
                         ref.state[b]["exp_avg"])
    if torch.equal(ours[0].detach(), init[0]):
        raise AssertionError(f"{what}: the parameters never moved")
    return opt, ours, ref, theirs


@case
def fp32_l2_equals_torch_adam():
    for opt_cls in (bmt.optim.AdamOptimizer, bmt.optim.AdamOffloadOptimizer):
        _plain_trajectory(opt_cls, False, "Adam", hold=0)


@case
def fp32_hold_steps_equals_torch_adam_at_lr0():
    for opt_cls in (bmt.optim.AdamOptimizer, bmt.optim.AdamOffloadOptimizer):
        _plain_trajectory(opt_cls, False, "Adam", hold=5)


@case
def fp32_decoupled_equals_torch_adamw():
    for opt_cls in (bmt.optim.AdamOptimizer, bmt.optim.AdamOffloadOptimizer):
        _plain_trajectory(opt_cls, True, "Adam", hold=3)
        _plain_trajectory(opt_cls, True, "AdamW", hold=0)


@case
def fp32_state_dict_resume_equals_torch():
    """10 steps, the optimizer's state_dict into a new optimizer, 10 more: still torch's values bit for bit."""
    opt, ours, ref, theirs = _plain_trajectory(bmt.optim.AdamOptimizer, False, "Adam", hold=0, steps=10)
    sd = opt.state_dict()
    opt2 = bmt.optim.AdamOptimizer(ours, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    opt2.load_state_dict(sd)
    for step in range(10, 20):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            g = randn(*a.shape, seed=1000 * step + i)
            a.grad, b.grad = g * 2.0, g.clone()
        opt2.step(scale=2.0)
        ref.step()
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_equal(f"resumed: parameter {i} after step {step + 1}", a.detach(), b.detach())


@case
def zero_sharded_fp32_block_equals_unsharded_torch():
    """A Net whose layers are ZeRO Blocks (each rank updates its shard of the flat parameters) equals
    torch.optim.Adam on the unsharded twin, bit for bit, for L2 and decoupled weight decay."""
    for decoupled in (False, True):
        d = 37
        model, twin = make(BMT).Net(d, 2, 41), make(TORCH).Net(d, 2, 41)
        opt = bmt.optim.AdamOptimizer(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                      hold_steps=2, decoupled_weight_decay=decoupled)
        om = bmt.optim.OptimManager(loss_scale=8)
        om.add_optimizer(opt)
        ref = _ref(twin.parameters(), decoupled)
        ours, theirs = dict(model.named_parameters()), dict(twin.named_parameters())
        partial = False  # some rank-local shard is a strict part of its parameter (world > 1)
        for step in range(20):
            om.zero_grad()
            om.backward(model(randn(3, d, seed=5)).sum())  # creates the gradient shards; overwritten below
            for i, (name, b) in enumerate(theirs.items()):
                a = ours[name]
                g = randn(*b.shape, seed=7000 * step + i)
                b.grad = g
                rng = local_shard_range(a) if world() > 1 else (0, g.numel())
                shard = bmt.main_grad(a)
                if shard is None or rng is None:
                    continue
                partial = partial or rng[1] - rng[0] < g.numel()
                with torch.no_grad():
                    shard.view(-1).copy_(g.reshape(-1)[rng[0]:rng[1]] * om.loss_scale)
            ref.param_groups[0]["lr"] = 0.0 if step < 2 else LR
            om.step()
            ref.step()
            got, want = model.state_dict(), twin.state_dict()
            for k in want:
                assert_equal(f"decoupled={decoupled} {k} after step {step + 1}", got[k], want[k].to(got[k].device))
        if world() > 1 and not partial:
            raise AssertionError("no parameter was sharded: the test did not exercise ZeRO shards")


@case
def bf16_hold_steps_count_is_bmtrains():
    """BMTrain counts a half-precision parameter's step before its hold check: with hold_steps=h the parameter
    stays unchanged for exactly h - 1 updates (fp32: h, above)."""
    for opt_cls in (bmt.optim.AdamOptimizer, bmt.optim.AdamOffloadOptimizer):
        for h in (1, 3, 4):
            p = randn(64, seed=3).to(torch.bfloat16).requires_grad_()
            opt = opt_cls([p], lr=0.1, hold_steps=h)
            unchanged = 0
            for step in range(h + 2):
                before = p.detach().clone()
                p.grad = randn(64, seed=50 + step).to(torch.bfloat16)
                opt.step()
                if torch.equal(p.detach(), before):
                    if unchanged != step:
                        raise AssertionError(f"{opt_cls.__name__} hold_steps={h}: update {step + 1} held after an "
                                             "update that was not")
                    unchanged += 1
            if unchanged != max(h - 1, 0):
                raise AssertionError(f"{opt_cls.__name__} bf16 hold_steps={h}: unchanged for {unchanged} updates, "
                                     f"BMTrain: {max(h - 1, 0)}")


if __name__ == "__main__":
    main()
