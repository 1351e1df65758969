"""Drop-in behaviours of BMTrain 1.0.1 (issue 31): optimizers as torch.optim.Optimizer, torch optimizers under
OptimManager, optimizer / manager state dicts in BMTrain's layout, the modules BMTrain scripts import (nccl,
store's object collectives, loss._function, utils, benchmark.send_recv, zero_context), save / load (any extension,
dtype conversion, state-dict hooks) and inspect's rows and table. References: plain torch (torch.optim.Adam, SGD,
LambdaLR, F.cross_entropy, Tensor.std) and closed forms; the BMTrain layouts are written out here from BMTrain's
source (optim/adam.py, adam_offload.py, optim_manager.py, lr_scheduler/warmup.py, inspect/format.py).
"""
import math
import os

import torch
import torch.nn.functional as F

import bmtrain as bmt
from common import (OUT, assert_close, assert_equal, case, compare_state, device, expect_raises, local_shard_range,
                    main, randn, rank, rank_input, world)
from models import BMT, TORCH, make

D, B = 6, 3
BETAS, EPS = (0.9, 0.95), 1e-8


def _loss(out, seed=7):
    return (out * randn(*out.shape, seed=seed)).sum() / out.shape[0]


def _ref_loss(ref, seed):
    return sum(_loss(ref(rank_input(r, B, D, seed=seed))) for r in range(world())) / world()


def _twins(seed):
    return make(BMT).Net(D, 2, seed), make(TORCH).Net(D, 2, seed)


def _step_both(model, om, ref, ref_opt, seed, ref_step=True):
    om.zero_grad()
    ref_opt.zero_grad()
    om.backward(_loss(model(rank_input(rank(), B, D, seed=seed))))
    _ref_loss(ref, seed).backward()
    om.step()
    if ref_step:
        ref_opt.step()


def _shard(full, p):
    """This rank's elements of the full tensor `full` (flattened) for the DistributedParameter p."""
    rng = local_shard_range(p)
    flat = full.detach().reshape(-1)
    return flat[rng[0]:rng[1]] if rng is not None else flat[:0]


def _check_state_vs_torch(opt, model, ref_opt, ref, what):
    refp = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        rs = ref_opt.state[refp[name]]
        s = opt.state[p]
        if s["step"] != int(rs["step"]):
            raise AssertionError(f"{what}: state[{name}]['step'] {s['step']} != torch's {int(rs['step'])}")
        for k in ("exp_avg", "exp_avg_sq"):
            assert_close(f"{what}: state[{name}][{k}]", s[k].reshape(-1), _shard(rs[k], p), rtol=1e-5, atol=1e-8)


# ------------------------------------------------------------------------------------ 1. torch.optim interface

@case
def bmt_adam_is_a_torch_optimizer():
    """param_groups are torch's dicts, add_param_group adds a group the engine updates with its own lr, state[p]
    shows the engine's moments, zero_grad zeros the gradients: against torch.optim.Adam with the same groups."""
    for opt_cls in (bmt.optim.AdamOptimizer, bmt.optim.AdamOffloadOptimizer):
        model, ref = _twins(11)
        inner = [p for n, p in model.named_parameters() if n.startswith("layers.")]
        outer = [p for n, p in model.named_parameters() if not n.startswith("layers.")]
        ref_inner = [p for n, p in ref.named_parameters() if n.startswith("layers.")]
        ref_outer = [p for n, p in ref.named_parameters() if not n.startswith("layers.")]
        opt = opt_cls(inner, lr=1e-2, betas=BETAS, eps=EPS)
        what = opt_cls.__name__
        if not isinstance(opt, torch.optim.Optimizer) or type(opt.param_groups[0]) is not dict:
            raise AssertionError(f"{what} is not a torch.optim.Optimizer with dict param groups")
        if len(opt.state) != 0 or opt.state[inner[0]] != {}:
            raise AssertionError(f"{what}: state before the first step {dict(opt.state)}")
        opt.add_param_group({"params": outer, "lr": 3e-3})
        if opt.param_groups[1]["betas"] != BETAS or opt.param_groups[1]["lr"] != 3e-3:
            raise AssertionError(f"{what}: the added group {opt.param_groups[1]} lacks the defaults")
        ref_opt = torch.optim.Adam(ref_inner, lr=1e-2, betas=BETAS, eps=EPS)
        ref_opt.add_param_group({"params": ref_outer, "lr": 3e-3})
        om = bmt.optim.OptimManager(loss_scale=None)
        om.add_optimizer(opt)
        for step in range(3):
            _step_both(model, om, ref, ref_opt, 20 + step)
            compare_state(model, ref, rtol=1e-5, atol=1e-6, what=f"{what} two groups, step {step + 1}: ")
        _check_state_vs_torch(opt, model, ref_opt, ref, what)
        if len(opt.state) != len(inner) + len(outer):
            raise AssertionError(f"{what}: {len(opt.state)} parameters with state")
        opt.zero_grad()
        for n, p in model.named_parameters():
            g = bmt.main_grad(p)
            if g is not None and g.count_nonzero().item() != 0:
                raise AssertionError(f"{what}: gradient of {n} not zero after zero_grad()")


@case
def torch_lambda_lr_on_bmt_adam():
    """torch.optim.lr_scheduler.LambdaLR drives our optimizer (and OptimManager steps it, as BMTrain's steps any
    scheduler): the same trajectory as torch.optim.Adam under the same LambdaLR."""
    model, ref = _twins(12)
    opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, betas=BETAS, eps=EPS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    om = bmt.optim.OptimManager(loss_scale=256)
    om.add_optimizer(opt, sched)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, betas=BETAS, eps=EPS)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.5 ** s)
    for step in range(4):
        _step_both(model, om, ref, ref_opt, 30 + step)
        ref_sched.step()
        if not math.isclose(opt.param_groups[0]["lr"], 1e-2 * 0.5 ** (step + 1), rel_tol=1e-12):
            raise AssertionError(f"LambdaLR set lr {opt.param_groups[0]['lr']} after step {step + 1}")
        compare_state(model, ref, rtol=1e-5, atol=1e-6, what=f"LambdaLR step {step + 1}: ")


@case
def torch_sgd_under_optim_manager():
    """torch.optim.SGD (momentum) in OptimManager with loss scale 1024 and bmt.lr_scheduler.Linear: gradients
    unscaled before SGD's own step, equal to plain torch; an inf on rank 0 skips the step on every rank (parameters,
    momentum and scheduler unchanged, gradients zeroed, scale halved)."""
    model, ref = _twins(13)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = bmt.lr_scheduler.Linear(opt, start_lr=0.1, warmup_iter=0, end_iter=10)
    om = bmt.optim.OptimManager(loss_scale=1024)
    om.add_optimizer(opt, sched)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    done = 0
    for step in range(4):
        poison = step == 2
        ref_opt.param_groups[0]["lr"] = 0.1 * (10 - done) / 10
        if poison:
            before = model.state_dict()
            om.zero_grad()
            loss = _loss(model(rank_input(rank(), B, D, seed=40 + step)))
            if rank() == 0:
                loss = loss * float("inf")
            om.backward(loss)
            if om.step() is not False:
                raise AssertionError("a step with an inf gradient was not skipped")
            for k, v in before.items():
                assert_equal(f"{k} after the skipped step", model.state_dict()[k], v)
            for n, p in model.named_parameters():
                if p.grad is not None and p.grad.count_nonzero().item() != 0:
                    raise AssertionError(f"{n}: gradient not zeroed after the skipped step")
            if om.loss_scale != 512 or sched.num_iter != done:
                raise AssertionError(f"after the overflow: scale {om.loss_scale}, scheduler at {sched.num_iter}")
            continue
        _step_both(model, om, ref, ref_opt, 40 + step)
        done += 1
        compare_state(model, ref, rtol=1e-5, atol=1e-6, what=f"SGD under OptimManager, step {step + 1}: ")
        if not math.isclose(opt.param_groups[0]["lr"], 0.1 * (10 - done) / 10, rel_tol=1e-12):
            raise AssertionError(f"Linear on SGD: lr {opt.param_groups[0]['lr']} after {done} steps")
    expect_raises("OptimManager.add_optimizer(not an optimizer)", (TypeError,),
                  lambda: om.add_optimizer(object()), ["torch.optim.Optimizer"])


@case
def bmt_schedulers_on_torch_optimizer():
    """BMTrain's schedules on a torch optimizer, num_iter past end_iter included (Cosine rises again, as BMTrain's
    formula max(0, S/2 (1 + cos(pi (t - W) / max(1, E - W)))) does)."""
    S, W, E = 1e-3, 4, 12
    p = torch.nn.Parameter(torch.zeros(2))
    formulas = {
        "NoDecay": lambda t: S,
        "Noam": lambda t: S / math.sqrt(t),
        "Linear": lambda t: max(0.0, S * (E - t) / (E - W)),
        "Cosine": lambda t: max(0.0, S * 0.5 * (1 + math.cos(math.pi * (t - W) / max(1, E - W)))),
        "Exponential": lambda t: max(0.0, S * 0.95 ** (t - W)),
    }
    for kind, decay in formulas.items():
        opt = torch.optim.SGD([p], lr=5.0)
        sched = getattr(bmt.lr_scheduler, kind)(opt, start_lr=S, warmup_iter=W, end_iter=E, num_iter=0)
        for t in range(2 * E):
            warm = S / math.sqrt(W) * t / W if kind == "Noam" else S * t / W
            want = warm if t < W else decay(t)
            if not math.isclose(opt.param_groups[0]["lr"], want, rel_tol=1e-12, abs_tol=1e-18):
                raise AssertionError(f"{kind} at num_iter {t}: lr {opt.param_groups[0]['lr']}, BMTrain's {want}")
            sched.step()
    cos = bmt.lr_scheduler.Cosine(torch.optim.SGD([p], lr=1.0), start_lr=S, warmup_iter=W, end_iter=E,
                                  num_iter=E + (E - W) // 2)
    if not cos.current_lr > 0:
        raise AssertionError(f"Cosine past end_iter gives {cos.current_lr}; BMTrain's rises again")


# --------------------------------------------------------------------------------------- 2. state dict layouts

def _bmtrain_layout(opt, ref_opt, model, ref, offload):
    """The state dict BMTrain's optimizer would hold for torch.optim.Adam's state (fp32 parameters): per parameter
    index {"step": int, "exp_avg", "exp_avg_sq"} (offload: "_param_fp32" too, and "is_whole": False), one group."""
    refp = dict(ref.named_parameters())
    state = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        rs = ref_opt.state[refp[name]]
        e = {"step": int(rs["step"]), "exp_avg": _shard(rs["exp_avg"], p).clone().view(p.shape),
             "exp_avg_sq": _shard(rs["exp_avg_sq"], p).clone().view(p.shape)}
        if offload:
            e["_param_fp32"] = _shard(refp[name], p).detach().cpu().clone().view(p.shape)
        state[i] = e
    g = ref_opt.param_groups[0]
    sd = {"state": state, "param_groups": [{"lr": g["lr"], "betas": g["betas"], "eps": g["eps"],
                                            "weight_decay": g["weight_decay"],
                                            "params": list(range(len(state)))}]}
    if offload:
        sd["is_whole"] = False
    return sd


@case
def optimizer_state_dict_bmtrain_layout():
    """Ours has BMTrain's layout and values (torch.optim.Adam's moments of this rank's shards); BMTrain's layout,
    written from torch.optim.Adam's state, loads into ours and the run continues exactly like torch."""
    for opt_cls in (bmt.optim.AdamOptimizer, bmt.optim.AdamOffloadOptimizer):
        offload = opt_cls is bmt.optim.AdamOffloadOptimizer
        what = opt_cls.__name__
        model, ref = _twins(14)
        opt = opt_cls(model.parameters(), lr=1e-2, betas=BETAS, eps=EPS)
        om = bmt.optim.OptimManager(loss_scale=1024)
        om.add_optimizer(opt)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, betas=BETAS, eps=EPS)
        for step in range(2):
            _step_both(model, om, ref, ref_opt, 50 + step)
        sd = opt.state_dict()
        n = len(list(model.parameters()))
        want_top = {"state", "param_groups"} | ({"is_whole"} if offload else set())
        if set(sd) != want_top or (offload and sd["is_whole"] is not False):
            raise AssertionError(f"{what}.state_dict() keys {sorted(sd)}")
        g = sd["param_groups"]
        if len(g) != 1 or set(g[0]) != {"lr", "betas", "eps", "weight_decay", "params"} or g[0]["params"] != \
                list(range(n)) or g[0]["lr"] != 1e-2 or tuple(g[0]["betas"]) != BETAS:
            raise AssertionError(f"{what}.state_dict()['param_groups'] = {g}")
        if sorted(sd["state"]) != list(range(n)):
            raise AssertionError(f"{what}: state indices {sorted(sd['state'])}")
        mine = _bmtrain_layout(opt, ref_opt, model, ref, offload)
        for i, (name, p) in enumerate(model.named_parameters()):
            s = sd["state"][i]
            want_keys = {"step", "exp_avg", "exp_avg_sq"} | ({"_param_fp32"} if offload else set())
            if set(s) != want_keys or not isinstance(s["step"], int) or s["step"] != 2:
                raise AssertionError(f"{what}: state[{i}] ({name}) keys {sorted(s)} step {s['step']!r}")
            for k in want_keys - {"step"}:
                if s[k].dtype != torch.float32 or s[k].shape != p.shape:
                    raise AssertionError(f"{what}: state[{i}][{k}] is {s[k].dtype} {tuple(s[k].shape)}")
                if offload and s[k].device.type != "cpu":
                    raise AssertionError(f"{what}: state[{i}][{k}] on {s[k].device}; BMTrain's offload keeps it "
                                         "on the CPU")
                assert_close(f"{what}: state[{i}][{k}]", s[k], mine["state"][i][k], rtol=1e-5, atol=1e-8)
        # BMTrain's layout (from torch's state) into a fresh optimizer over a model holding torch's values.
        model2, _ = _twins(99)
        bmt.load(model2, _save_ref(ref, f"lay_{what}.pt"))
        opt2 = opt_cls(model2.parameters(), lr=5.0, betas=(0.5, 0.5), eps=1e-3)
        om2 = bmt.optim.OptimManager(loss_scale=1024)
        om2.add_optimizer(opt2)
        opt2.load_state_dict(mine)
        if opt2.param_groups[0]["lr"] != 1e-2 or tuple(opt2.param_groups[0]["betas"]) != BETAS:
            raise AssertionError(f"{what}: group options after load {opt2.param_groups[0]}")
        for step in range(2):
            _step_both(model2, om2, ref, ref_opt, 52 + step)
            compare_state(model2, ref, rtol=1e-5, atol=1e-6, what=f"{what} resumed from BMTrain's layout, step "
                                                                    f"{step + 1}: ")
        _check_state_vs_torch(opt2, model2, ref_opt, ref, what + " resumed")
        bad = dict(mine, param_groups=mine["param_groups"] * 2)
        expect_raises(f"{what}.load_state_dict with 2 groups", (ValueError,), lambda: opt2.load_state_dict(bad),
                      ["parameter groups"])


def _save_ref(ref, name):
    path = os.path.join(OUT, name)
    if rank() == 0:
        torch.save({k: v.detach().cpu() for k, v in ref.state_dict().items()}, path)
    bmt.synchronize()
    return path


@case
def fp16_moments_in_bmtrain_layout():
    """BMTrain's AdamOptimizer keeps an fp16 parameter's moments scaled by the loss scale (exp_avg in fp16):
    after one step with gradient g (loss scale 64), exp_avg = (1 - b1) g and exp_avg_sq = (1 - b2) g^2; the state
    dict holds exp_avg * 64 in fp16 and exp_avg_sq * 64, and loading it restores the unscaled moments."""
    g = torch.tensor([0.5, -1.0, 2.0, 0.25, -0.125], device=device())
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, -3.0, 0.5, 0.0], device=device()).half())
    opt = bmt.optim.AdamOptimizer([p], lr=1e-3)
    om = bmt.optim.OptimManager(loss_scale=64)
    om.add_optimizer(opt)
    p.grad = (g * 64).half()
    om.step()
    s = opt.state[p]
    assert_close("exp_avg (live)", s["exp_avg"], 0.1 * g, rtol=1e-6, atol=0)
    assert_close("exp_avg_sq (live)", s["exp_avg_sq"], 0.001 * g * g, rtol=1e-6, atol=0)
    e = opt.state_dict()["state"][0]
    if e["exp_avg"].dtype != torch.float16 or e["exp_avg_sq"].dtype != torch.float32 or \
            e["_param_fp32"].dtype != torch.float32 or e["step"] != 1:
        raise AssertionError(f"fp16 entry: {[(k, getattr(v, 'dtype', v)) for k, v in e.items()]}")
    assert_equal("exp_avg saved", e["exp_avg"], (0.1 * g * 64).half())
    assert_close("exp_avg_sq saved", e["exp_avg_sq"], 0.001 * g * g * 64, rtol=1e-6, atol=0)
    p2 = torch.nn.Parameter(p.detach().clone())
    opt2 = bmt.optim.AdamOptimizer([p2], lr=1e-3)
    om2 = bmt.optim.OptimManager(loss_scale=64)
    om2.add_optimizer(opt2)
    opt2.load_state_dict(opt.state_dict())
    assert_close("exp_avg after load", opt2.state[p2]["exp_avg"], 0.1 * g, rtol=1e-3, atol=0)
    assert_close("exp_avg_sq after load", opt2.state[p2]["exp_avg_sq"], 0.001 * g * g, rtol=1e-6, atol=0)
    assert_equal("master after load", opt2.state[p2]["_param_fp32"], s["_param_fp32"])


@case
def optim_manager_state_dict_bmtrain_layout():
    """OptimManager.state_dict() = {"optimizers", "lr_schedulers", "loss_scale", "loss_scale_enabled"} (+ our
    steps_since_last_scale); BMTrain's layout written by hand loads: loss scale, scheduler position and lr."""
    model, ref = _twins(15)
    opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2)
    sched = bmt.lr_scheduler.Noam(opt, start_lr=1e-2, warmup_iter=2, end_iter=100)
    om = bmt.optim.OptimManager(loss_scale=1024)
    om.add_optimizer(opt, sched)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    _step_both(model, om, ref, ref_opt, 60)
    sd = om.state_dict()
    if not {"optimizers", "lr_schedulers", "loss_scale", "loss_scale_enabled"} <= set(sd) or \
            sd["loss_scale"] != 1024 or sd["loss_scale_enabled"] is not True or len(sd["optimizers"]) != 1:
        raise AssertionError(f"OptimManager.state_dict(): { {k: v for k, v in sd.items() if k != 'optimizers'} }")
    if sd["lr_schedulers"] != [{"start_lr": 1e-2, "warmup_iter": 2, "end_iter": 100, "num_iter": 1}]:
        raise AssertionError(f"lr_schedulers {sd['lr_schedulers']}")
    if set(sd["optimizers"][0]) != {"state", "param_groups"}:
        raise AssertionError(f"optimizers[0] keys {sorted(sd['optimizers'][0])}")
    theirs = {"optimizers": [opt.state_dict()], "loss_scale": 256.0, "loss_scale_enabled": True,
              "lr_schedulers": [{"start_lr": 1e-2, "warmup_iter": 2, "end_iter": 100, "num_iter": 9}]}
    om.load_state_dict(theirs)
    if om.loss_scale != 256 or not om.loss_scale_enabled or sched.num_iter != 9:
        raise AssertionError(f"after load: scale {om.loss_scale}, scheduler at {sched.num_iter}")
    if not math.isclose(opt.param_groups[0]["lr"], 1e-2 / 3, rel_tol=1e-12):
        raise AssertionError(f"lr after loading num_iter 9: {opt.param_groups[0]['lr']} (Noam: 1e-2 / sqrt(9))")
    expect_raises("load_state_dict with 2 optimizers", (AssertionError,),
                  lambda: om.load_state_dict(dict(theirs, optimizers=theirs["optimizers"] * 2)))
    # torch optimizers take part with their own state dicts
    tm = bmt.optim.OptimManager(loss_scale=None)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tm.add_optimizer(sgd)
    tsd = tm.state_dict()
    if tsd["optimizers"][0] != sgd.state_dict() or tsd["loss_scale_enabled"] is not False or tsd["loss_scale"] != 1:
        raise AssertionError(f"OptimManager with SGD: {tsd}")
    tm.load_state_dict(tsd)


# ------------------------------------------------------------------------------------------ 3. modules, names

@case
def top_level_names():
    """Every public name BMTrain 1.0.1's bmtrain/__init__.py exports, and the submodules scripts import."""
    names = ["print_block", "print_dict", "print_rank", "see_memory", "load_nccl_pypi", "nccl", "config",
             "world_size", "rank", "init_distributed", "DistributedParameter", "ParameterInitializer",
             "DistributedModule", "init_parameters", "grouped_parameters", "synchronize", "sum_loss", "wait_loader",
             "gather_result", "Block", "TransformerBlockList", "BMTrainModelWrapper", "PipelineTransformerBlockList",
             "debug", "save", "load", "loss", "distributed", "nn", "optim", "inspect", "lr_scheduler",
             "CheckpointBlock"]
    missing = [n for n in names if not hasattr(bmt, n)]
    if missing:
        raise AssertionError(f"bmtrain lacks {missing}")
    import bmtrain.benchmark
    import bmtrain.loss._function
    import bmtrain.nccl
    import bmtrain.store
    import bmtrain.utils
    import bmtrain.zero_context
    from bmtrain.loss.cross_entropy import FusedCrossEntropy
    from bmtrain.lr_scheduler.warmup import WarmupLRScheduler
    from bmtrain.optim.adam_offload import AdamOffloadOptimizer
    if (FusedCrossEntropy, WarmupLRScheduler, AdamOffloadOptimizer) != (bmt.loss.FusedCrossEntropy,
                                                                       bmt.lr_scheduler.WarmupLRScheduler,
                                                                       bmt.optim.AdamOffloadOptimizer):
        raise AssertionError("BMTrain's module paths give other classes")
    for mod, attrs in ((bmtrain.store, ["allgather_objects", "broadcast_object", "DistributedStateDictWrapper"]),
                       (bmtrain.utils, ["round_up", "check_torch_version", "tp_split_tensor", "AverageRecorder"]),
                       (bmtrain.benchmark, ["all_gather", "reduce_scatter", "send_recv"]),
                       (bmtrain.zero_context, ["ZeroContext"]),
                       (bmtrain.loss._function, ["has_inf_nan", "cross_entropy_forward",
                                                 "cross_entropy_backward_inplace", "fused_sumexp",
                                                 "fused_softmax_inplace"]),
                       (bmtrain.nccl, ["allReduce", "broadcast", "reduce", "allGather", "reduceScatter", "send",
                                       "recv", "groupStart", "groupEnd", "commCount", "commRank", "getUniqueId",
                                       "commInitRank", "commDestroy", "dtype2nccl", "op2nccl", "ncclSum"])):
        lacking = [a for a in attrs if not hasattr(mod, a)]
        if lacking:
            raise AssertionError(f"{mod.__name__} lacks {lacking}")


@case
def nccl_buffer_collectives():
    """bmt.nccl on storages and tensors of bmt.config['comm'], against closed forms over the ranks' values."""
    from bmtrain import nccl
    comm = bmt.config["comm"]
    ws, r = world(), rank()
    if nccl.commCount(comm) != ws or nccl.commRank(comm) != r:
        raise AssertionError(f"commCount/commRank {nccl.commCount(comm)}, {nccl.commRank(comm)}")
    x = torch.arange(4, dtype=torch.float32, device=device()) + r
    nccl.allReduce(x.storage(), x.storage(), "sum", comm)
    assert_equal("allReduce sum in place", x, (torch.arange(4.) * ws + ws * (ws - 1) / 2).to(device()))
    y = torch.full((3,), float(r), device=device())
    out = torch.empty_like(y)
    nccl.allReduce(y.storage(), out.storage(), "max", comm)
    assert_equal("allReduce max", out, torch.full((3,), float(ws - 1), device=device()))
    b = torch.full((2,), float(r + 10), device=device())
    nccl.broadcast(b.storage(), b.storage(), ws - 1, comm)
    assert_equal("broadcast from the last rank", b, torch.full((2,), float(ws - 1 + 10), device=device()))
    g = torch.empty(2 * ws, dtype=torch.int64, device=device())
    nccl.allGather(torch.tensor([r, -r], device=device()).storage(), g.storage(), comm)
    assert_equal("allGather", g.cpu(), torch.tensor([v for q in range(ws) for v in (q, -q)]))
    src = torch.arange(2 * ws, dtype=torch.float32, device=device()) * (r + 1)
    dst = torch.empty(2, device=device())
    nccl.reduceScatter(src.storage(), dst.storage(), "sum", comm)
    total = ws * (ws + 1) / 2
    assert_equal("reduceScatter", dst.cpu(), torch.tensor([2 * r, 2 * r + 1], dtype=torch.float32) * total)
    red = torch.full((2,), -1.0, device=device())
    nccl.reduce(torch.ones(2, device=device()).storage(), red.storage(), "sum", 0, comm)
    assert_equal("reduce (dst written on the root only)", red.cpu(),
                 torch.full((2,), float(ws) if r == 0 else -1.0))
    if ws > 1:  # a ring exchange inside one group: every rank sends and receives (no deadlock)
        send = torch.full((5,), float(r), device=device())
        recv = torch.empty(5, device=device())
        nccl.groupStart()
        nccl.send(send.storage(), (r + 1) % ws, comm)
        nccl.recv(recv.storage(), (r - 1) % ws, comm)
        nccl.groupEnd()
        assert_equal("send/recv ring", recv.cpu(), torch.full((5,), float((r - 1) % ws)))
    if nccl.dtype2nccl(torch.bfloat16) != 9 or nccl.op2nccl("avg") != 4:
        raise AssertionError("NCCL enum values")
    expect_raises("nccl.getUniqueId", (NotImplementedError,), nccl.getUniqueId, ["init_distributed"])
    expect_raises("allReduce with mismatched sizes", (RuntimeError,),
                  lambda: nccl.allReduce(torch.ones(2, device=device()).storage(),
                                         torch.ones(3, device=device()).storage(), "sum", comm), ["elements"])


@case
def store_object_collectives():
    """allgather_objects / broadcast_object (any picklable object) and DistributedStateDictWrapper (rank 0's state
    dict loaded on every rank) against closed forms."""
    from bmtrain.store import DistributedStateDictWrapper, allgather_objects, broadcast_object
    ws, r = world(), rank()
    got = allgather_objects({"rank": r, "name": "x" * (r + 1)})
    if got != [{"rank": q, "name": "x" * (q + 1)} for q in range(ws)]:
        raise AssertionError(f"allgather_objects: {got}")
    src = ws - 1
    got = broadcast_object(("from", r, list(range(r))), bmt.config["comm"], src=src)
    if got != ("from", src, list(range(src))):
        raise AssertionError(f"broadcast_object: {got}")
    ref = make(TORCH).Net(D, 2, 16)
    full = {k: v.detach().cpu() for k, v in ref.state_dict().items()}
    wrapper = DistributedStateDictWrapper(full if r == 0 else {})
    if len(wrapper) != len(full) or list(wrapper.keys()) != list(full) or "head.weight" not in wrapper:
        raise AssertionError("DistributedStateDictWrapper keys / len / in")
    model = make(BMT).Net(D, 2, 17)
    model.load_state_dict(wrapper)
    compare_state(model, ref, exact=True, what="loaded through DistributedStateDictWrapper: ")


@case
def loss_function_kernels():
    """bmtrain.loss._function against torch: the softmax / cross-entropy forward and in-place backward on bf16
    logits, fused_sumexp / fused_softmax_inplace, has_inf_nan."""
    from bmtrain.loss import _function as LF
    m, n = 5, 7
    x = randn(m, n, seed=70).to(torch.bfloat16)
    target = torch.tensor([0, 6, -100, 3, 2], dtype=torch.int32, device=device())
    softmax = torch.empty_like(x)
    out = torch.empty(m, dtype=torch.float32, device=device())
    LF.cross_entropy_forward(m, n, x, target, softmax, out, -100)
    want = F.cross_entropy(x.float(), target.long(), ignore_index=-100, reduction="none")
    assert_close("cross_entropy_forward", out, want, rtol=1e-5, atol=1e-6)
    assert_close("softmax", softmax.float(), torch.softmax(x.float(), 1), rtol=1e-2, atol=1e-3)
    xr = x.float().requires_grad_()
    go = torch.rand(m, device=device())
    (F.cross_entropy(xr, target.long(), ignore_index=-100, reduction="none") * go).sum().backward()
    go = go * (target != -100)
    LF.cross_entropy_backward_inplace(m, n, go, target, softmax, -100)
    assert_close("cross_entropy_backward_inplace", softmax.float(), xr.grad, rtol=2e-2, atol=1e-2)
    mx = x.float().max(dim=1).values
    s = LF.fused_sumexp(x, mx)
    assert_close("fused_sumexp", s, torch.exp(x.float() - mx[:, None]).sum(1), rtol=1e-6, atol=0)
    y = x.clone()
    LF.fused_softmax_inplace(y, mx, s)
    assert_close("fused_softmax_inplace", y.float(), torch.softmax(x.float(), 1), rtol=1e-2, atol=1e-3)
    flag = torch.zeros(1, dtype=torch.uint8, device=device())
    LF.has_inf_nan(x, flag)
    if flag.item() != 0:
        raise AssertionError("has_inf_nan on finite values")
    LF.has_inf_nan(torch.tensor([1.0, float("nan")], device=device()).half(), flag)
    LF.has_inf_nan(x, flag)  # stays set, as the kernel's output
    if flag.item() != 1:
        raise AssertionError("has_inf_nan missed a NaN")
    expect_raises("has_inf_nan on fp32", (ValueError,), lambda: LF.has_inf_nan(x.float(), flag), ["dtype"])


@case
def utils_and_send_recv_benchmark():
    import io
    from bmtrain.utils import check_torch_version, round_up
    if [round_up(x, 4) for x in (0, 1, 4, 5, 8)] != [0, 4, 4, 8, 8]:
        raise AssertionError("round_up")
    if not check_torch_version("1.0.0") > 0 or check_torch_version(torch.__version__.split("+")[0]) != 0:
        raise AssertionError("check_torch_version")
    buf = io.StringIO()
    bmt.print_block("ab", "body", file=buf)
    if buf.getvalue() != "=" * 28 + " ab " + "=" * 28 + "\nbody\n":
        raise AssertionError(f"print_block: {buf.getvalue()!r}")
    buf = io.StringIO()
    bmt.print_dict("t", {"key": 1, "a": "x" * 50}, file=buf)
    # width round_up(3 + 3, 4) = 8; values wrap at 60 - 8 = 52 columns
    want = ("=" * 28 + " t " + "=" * 29 + "\n" + "key :   1\n" + "a :     " + "x" * 50 + "\n\n")
    if buf.getvalue() != want:
        raise AssertionError(f"print_dict: {buf.getvalue()!r}\nwant {want!r}")
    res = bmt.benchmark.send_recv(max_nbytes=4096, repeat=2)
    if [nb for nb, _ in res] != [1024, 4096] or not all(t >= 0 for _, t in res):
        raise AssertionError(f"send_recv results {res}")


@case
def zero_context_gathers_a_block():
    """Inside ZeroContext(block) the Block's parameters are the full tensors (its state_dict's values); after it
    each is this rank's shard again."""
    from bmtrain.zero_context import ZeroContext
    model = make(BMT).Net(D, 2, 18)
    block = model.layers[0]
    full = model.state_dict()
    shard_numel = block.lin1.weight.numel()
    with ZeroContext(block):
        w = block.lin1.weight
        assert_equal("lin1.weight inside ZeroContext", w.detach().cpu(), full["layers.0.lin1.weight"])
    if block.lin1.weight.numel() != shard_numel:
        raise AssertionError(f"after ZeroContext lin1.weight has {block.lin1.weight.numel()} elements, its shard "
                             f"{shard_numel}")
    expect_raises("ZeroContext.enter(requires_grad=True)", (NotImplementedError,),
                  lambda: ZeroContext(block).enter(requires_grad=True), ["backward"])


# ---------------------------------------------------------------------------------------------- 4. save / load

@case
def save_load_any_extension_and_dtype():
    """bmt.save(model, "model.ckpt") writes torch.save's format (torch.load reads it); bmt.load of an fp32 file into
    a bf16 model converts like torch's load_state_dict (values = fp32.to(bf16))."""
    from models import BMT_BF16
    model = make(BMT).Net(D, 2, 19)
    path = os.path.join(OUT, "model.ckpt")
    bmt.save(model, path)
    loaded = torch.load(path, weights_only=True)
    want = model.state_dict()
    if sorted(loaded) != sorted(want):
        raise AssertionError(f"model.ckpt keys {list(loaded)}")
    for k, v in want.items():
        assert_equal(f"model.ckpt[{k}]", loaded[k], v)
    again = make(BMT).Net(D, 2, 20)
    bmt.load(again, path)
    compare_state(again, model, exact=True, what="bmt.load of model.ckpt: ")
    half = make(BMT_BF16).Net(D, 2, 21)
    res = bmt.load(half, path)
    if list(res.missing_keys) or list(res.unexpected_keys):
        raise AssertionError(f"fp32 -> bf16 load reported {res}")
    for k, v in half.state_dict().items():
        if v.dtype != torch.bfloat16:
            raise AssertionError(f"{k} is {v.dtype} after loading into a bf16 model")
        assert_equal(f"{k} fp32 -> bf16", v, want[k].to(torch.bfloat16))


@case
def save_load_state_dict_hooks():
    """A state-dict hook (_register_state_dict_hook) shapes what bmt.save writes, as in BMTrain's save (and torch's
    state_dict); a load pre-hook (_register_load_state_dict_pre_hook) maps old keys back on bmt.load."""
    model = make(BMT).Net(D, 2, 22)
    plain = model.state_dict()

    def rename(module, state, prefix, local_metadata):
        state[prefix + "w_renamed"] = state.pop(prefix + "weight") * 2
        return state

    model.head._register_state_dict_hook(rename)
    path = os.path.join(OUT, "hooked.pt")
    bmt.save(model, path)
    saved = torch.load(path, weights_only=True)
    if "head.weight" in saved or "head.w_renamed" not in saved:
        raise AssertionError(f"the state-dict hook did not shape the saved keys: {list(saved)}")
    assert_equal("hooked value", saved["head.w_renamed"], plain["head.weight"] * 2)

    target = make(BMT).Net(D, 2, 23)

    def unrename(state, prefix, local_metadata, strict, missing, unexpected, errors):
        if prefix + "w_renamed" in state:
            state[prefix + "weight"] = state.pop(prefix + "w_renamed") / 2

    target.head._register_load_state_dict_pre_hook(unrename)
    res = bmt.load(target, path)
    if list(res.missing_keys) or list(res.unexpected_keys):
        raise AssertionError(f"load with the pre-hook reported {res}")
    got = target.state_dict()
    for k, v in plain.items():
        assert_equal(f"{k} through save/load hooks", got[k], v)


# ---------------------------------------------------------------------------------------------------- 5. inspect

@case
def inspect_model_bmtrain_rows():
    """inspect_model: BMTrain's keys, Tensor.std() (sample) of the full tensor, 0.0 without a gradient; after a
    backward the gradient's mean and sample std; format_summary's table as BMTrain's format.py writes it."""
    model, ref = _twins(24)
    rows = bmt.inspect.inspect_model(model, "*")
    refp = dict(ref.named_parameters())
    keys = ["name", "shape", "std", "mean", "max", "min", "grad_std", "grad_mean"]
    for row in rows:
        if list(row) != keys:
            raise AssertionError(f"inspect_model row keys {list(row)}, BMTrain's {keys}")
        v = refp[row["name"]].detach()
        if row["grad_std"] != 0.0 or row["grad_mean"] != 0.0 or not isinstance(row["grad_std"], float):
            raise AssertionError(f"{row['name']}: without a gradient grad_std/grad_mean must be 0.0: {row}")
        for k, want in (("std", v.std()), ("mean", v.mean()), ("max", v.max()), ("min", v.min())):
            if not math.isclose(row[k], want.item(), rel_tol=1e-5, abs_tol=1e-7):
                raise AssertionError(f"{row['name']} {k}: {row[k]} vs torch {want.item()}")
        if row["shape"] != tuple(v.shape):
            raise AssertionError(f"{row['name']} shape {row['shape']}")
    if [r["name"] for r in rows] != list(refp):
        raise AssertionError(f"names {[r['name'] for r in rows]}")
    model(rank_input(rank(), B, D, seed=80)).sum().backward()
    sum(ref(rank_input(q, B, D, seed=80)).sum() for q in range(world())).backward()
    for row in bmt.inspect.inspect_model(model, "layers.*"):
        g = refp[row["name"]].grad
        for k, want in (("grad_std", g.std()), ("grad_mean", g.mean())):
            if not math.isclose(row[k], want.item(), rel_tol=1e-4, abs_tol=1e-6):
                raise AssertionError(f"{row['name']} {k}: {row[k]} vs torch {want.item()}")
    table = bmt.inspect.format_summary([
        {"name": "w", "shape": (3,), "max": 2.0, "min": -1.0, "std": 0.25, "mean": 0.5, "grad_std": 0.0,
         "grad_mean": None},
        {"name": "layer.bias", "shape": (2, 3), "max": 12345.678, "min": -1.0, "std": 0.25, "mean": 1,
         "grad_std": 1.0, "grad_mean": 0.125}])
    want = "\n".join([
        " name          shape               max       min       std       mean      grad_std  grad_mean",
        " w             (3,)                2.0000    -1.0000   0.2500    0.5000    0.0000    None     ",
        " layer.bias    (2, 3)              12345.678 -1.0000   0.2500    1         1.0000    0.1250   "])
    if table != want:
        raise AssertionError(f"format_summary:\n{table!r}\nwant\n{want!r}")


if __name__ == "__main__":
    main()
