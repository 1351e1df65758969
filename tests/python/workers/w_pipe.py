"""PipelineTransformerBlockList (init_distributed(pipe_size=2)) against the same model in plain torch.

Launched with 2 ranks (pp 2; and 4 ranks, pp 2 x dp 2, with BMT_TEST_PIPE_WORLD4=1: test_pipe.py). BMTrain's
semantics: every rank feeds its own batch, the layers before and after the list run data-parallel on every rank,
OptimManager divides by config["zero_size"]
(= world / pipe_size), so the torch reference steps on sum over ranks of each rank's loss / zero_size.
"""
import os
import types

import torch

import bmtrain as bmt
from common import OUT, Skip, assert_close, assert_equal, case, expect_raises, main, randn, rank, rank_input, world
from models import BMT, TORCH, make

D, B, LAYERS = 6, 4, 5  # 5 layers over 2 stages: 3 + 2


def _pipe_kit(use_checkpoint=True, zero_level=3, num_micro_batches=None):
    def blocklist(mods, num_hidden=1):
        blocks = [bmt.Block(m, use_checkpoint=use_checkpoint, zero_level=zero_level, mode="PIPE") for m in mods]
        return bmt.PipelineTransformerBlockList(blocks, num_hidden, num_micro_batches=num_micro_batches)
    return types.SimpleNamespace(**{**BMT.__dict__, "name": "bmt-pipe", "blocklist": blocklist})


def _world2_only():
    if world() != 2:
        raise Skip("checked at world 2 (pp 2); world 4 (pp 2 x dp 2) runs the training comparison only")


def _loss(out, seed):
    return (out * randn(*out.shape, seed=seed)).sum() / out.shape[0]


def _ref_loss(ref, seed):
    return sum(_loss(ref(rank_input(r, B, D, seed=seed)), seed + 1) for r in range(world())) / bmt.config["zero_size"]


def _compare_params(model, ref, what):
    """Every parameter this stage holds (full value) against the reference's; the stage's layers only."""
    got = model.state_dict()
    want = ref.state_dict()
    lst = model.layers
    expect = [k for k in want if not k.startswith("layers.") or int(k.split(".")[1]) in lst.layer_ids]
    if sorted(got) != sorted(expect):
        raise AssertionError(f"{what}: state_dict keys {sorted(got)} != this stage's {sorted(expect)}")
    for k in expect:
        assert_close(f"{what}: {k}", got[k], want[k], rtol=1e-5, atol=1e-6)


def _trajectory(kit, steps=3, lr=1e-2):
    T, M = make(TORCH), make(kit)
    model, ref = M.Net(D, LAYERS, 11), T.Net(D, LAYERS, 11)
    om = bmt.optim.OptimManager(loss_scale=1024)
    om.add_optimizer(bmt.optim.AdamOptimizer(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    for step in range(steps):
        om.zero_grad()
        ref_opt.zero_grad()
        loss = _loss(model(rank_input(rank(), B, D, seed=20 + step)), 21 + step)
        om.backward(loss)
        ref_loss = _ref_loss(ref, 20 + step)
        ref_loss.backward()
        total = bmt.sum_loss(loss.detach()) * world() / bmt.config["zero_size"]  # sum_loss is the mean
        assert_close(f"{kit.name} step {step + 1} loss", total, ref_loss, rtol=1e-5, atol=1e-6)
        om.step()
        ref_opt.step()
        _compare_params(model, ref, f"{kit.name} after step {step + 1}")
    return model, ref


@case
def topology_config():
    c, topo = bmt.config, bmt.config["topology"]
    stage_size = world() // 2
    if c["pipe_size"] != 2 or not c["pipe_enabled"] or c["micros"] != 2:
        raise AssertionError(f"pipe_size {c['pipe_size']}, pipe_enabled {c['pipe_enabled']}, micros {c['micros']}")
    if topo.stage_id != rank() // stage_size or topo.pipe_idx != rank() % stage_size or topo.stages != 2:
        raise AssertionError(f"topology {topo} at rank {rank()} of {world()}")
    if topo.get_group_rank("pipe") != topo.stage_id or topo.get_group_id("pipe") != topo.pipe_idx:
        raise AssertionError("get_group_rank/get_group_id('pipe') differ from stage_id/pipe_idx")
    if c["pipe_comm"].size() != 2 or c["pipe_comm"].rank() != topo.stage_id:
        raise AssertionError(f"pipe_comm {c['pipe_comm']}")
    if c["pp_zero_comm"].size() != stage_size or c["zero_size"] != stage_size or c["zero_comm"].size() != world():
        raise AssertionError(f"pp_zero_comm {c['pp_zero_comm']}, zero_size {c['zero_size']}, zero_comm "
                             f"{c['zero_comm']}")


@case
def layers_split_over_stages():
    _world2_only()
    model = make(_pipe_kit()).Net(D, LAYERS, 11)
    lst = model.layers
    want = range(0, 3) if bmt.config["topology"].stage_id == 0 else range(3, 5)
    if list(lst.layer_ids) != list(want) or lst.get_range_by_stage_id(1) != range(3, 5) or len(lst) != LAYERS:
        raise AssertionError(f"layer_ids {lst.layer_ids}, stage 1 range {lst.get_range_by_stage_id(1)}")
    if [lst.get_stage_by_layer_id(i) for i in range(LAYERS)] != [0, 0, 0, 1, 1]:
        raise AssertionError("get_stage_by_layer_id")
    names = {n.split(".")[1] for n, _ in model.named_parameters() if n.startswith("layers.")}
    if names != {str(i) for i in want}:
        raise AssertionError(f"stage parameters {sorted(names)}")
    expect_raises("Block(mode='PIPE') outside a list", (RuntimeError,),
                  lambda: bmt.Block(make(BMT).Layer(D, 3), mode="PIPE")(torch.zeros(2, D)),
                  must_mention=("PipelineTransformerBlockList",))


@case
def train_matches_torch():
    """3 Adam steps, checkpointed ZeRO-3 Blocks, 2 micro-batches: losses and parameters equal torch's."""
    _trajectory(_pipe_kit())


@case
def train_matches_torch_zero2_no_checkpoint_4_micro():
    _world2_only()
    _trajectory(_pipe_kit(use_checkpoint=False, zero_level=2, num_micro_batches=4))


@case
def save_and_load_consolidated():
    """bmt.save of a pipelined model writes the whole model (every stage's layers, the unpipelined keys);
    bmt.load reads it back into the stages."""
    _world2_only()
    T, M = make(TORCH), make(_pipe_kit())
    model, ref = M.Net(D, LAYERS, 11), T.Net(D, LAYERS, 11)
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "pipe_model.pt")
    bmt.save(model, path)
    saved = torch.load(path, map_location="cpu", weights_only=True)
    want = ref.state_dict()
    if sorted(saved) != sorted(want):
        raise AssertionError(f"saved keys {sorted(saved)} != {sorted(want)}")
    for k in want:
        assert_close(f"saved {k}", saved[k], want[k])
    other = M.Net(D, LAYERS, 99)
    bmt.load(other, path)
    _compare_params(other, ref, "loaded")


@case
def eval_without_grad():
    _world2_only()
    T, M = make(TORCH), make(_pipe_kit())
    model, ref = M.Net(D, LAYERS, 11), T.Net(D, LAYERS, 11)
    x = rank_input(rank(), B, D, seed=50)
    with torch.no_grad():
        assert_close("no-grad output", model(x), ref(x))


@case
def two_hidden_and_batched_extra():
    """num_hidden=2 and an extra per-row argument that requires grad: outputs, input and extra gradients."""
    _world2_only()
    kit = _pipe_kit()
    T, M = make(TORCH), make(kit)
    ref_list = TORCH.blocklist([T.Hidden2Layer(D, 200 + 10 * i) for i in range(3)], 2)
    lst = kit.blocklist([M.Hidden2Layer(D, 200 + 10 * i) for i in range(3)], 2)

    def run(blocks, r):
        h1 = rank_input(r, B, D, seed=60, requires_grad=True)
        h2 = rank_input(r, B, D, seed=61, requires_grad=True)
        ctx = rank_input(r, B, D, seed=62, requires_grad=True)
        o1, o2 = blocks(h1, h2, ctx)
        ((o1 * randn(B, D, seed=63)).sum() + (o2 * randn(B, D, seed=64)).sum()).backward()
        return o1, o2, h1.grad, h2.grad, ctx.grad

    got = run(lst, rank())
    want = run(ref_list, rank())
    for name, g, w in zip(("out1", "out2", "h1 grad", "h2 grad", "ctx grad"), got, want):
        assert_close(name, g, w)


def _init_model(pipelined):
    """A model whose parameters all carry initialisers: Python callables (torch.nn.init, drawing from torch's
    generator) and one built-in counter-based one; plain torch when pipelined is None (initialised in
    named_parameters order: the reference for the callables)."""
    normal = torch.nn.init.normal_
    uniform = bmt.ParameterInitializer(torch.nn.init.uniform_, a=-1.0, b=1.0)
    builtin = bmt.param_init.normal(0.0, 0.5)

    def param(shape, init):
        if pipelined is None:
            p = torch.nn.Parameter(torch.empty(*shape, device=bmt.config["device"]))
            p.init = init
            return p
        return bmt.DistributedParameter(torch.empty(*shape), init_method=init)

    base = torch.nn.Module if pipelined is None else bmt.DistributedModule

    class Layer(base):
        def __init__(self):
            super().__init__()
            self.w = param((D, D), normal)
            self.b = param((D,), uniform)
            self.s = param((3, D), builtin)

    class Model(base):
        def __init__(self):
            super().__init__()
            self.pre = param((D, 2), normal)
            layers = [Layer() for _ in range(LAYERS)]
            if pipelined is None:
                self.layers = torch.nn.ModuleList(layers)
            elif pipelined:
                self.layers = bmt.PipelineTransformerBlockList([bmt.Block(m, mode="PIPE") for m in layers])
            else:
                self.layers = bmt.TransformerBlockList(layers)
            self.post = param((2, D), uniform)
    model = Model()
    if pipelined is None:  # BMTrain's order: named_parameters (a module's own parameters before its children's)
        with torch.no_grad():
            for p in model.parameters():
                if p.init is not builtin:
                    p.init(p)
    return model


@case
def init_parameters_as_unpipelined():
    """init_parameters of a pipelined model gives every layer this stage holds, and the parameters before and after
    the list, the values the unpipelined model gets (BMTrain builds every layer on every stage, so torch's generator
    draws for all of them): the callables' values equal plain torch initialising the same parameters in
    named_parameters order after the same torch.manual_seed; the built-in initialiser's equal a TransformerBlockList
    model's (they depend on the parameter's name only)."""
    torch.manual_seed(77)
    model = _init_model(pipelined=True)
    torch.manual_seed(77)
    bmt.init_parameters(model)
    torch.manual_seed(77)
    flat = _init_model(pipelined=False)
    torch.manual_seed(77)
    bmt.init_parameters(flat)
    torch.manual_seed(77)
    ref = _init_model(pipelined=None)
    got, flat_sd, want = model.state_dict(), flat.state_dict(), ref.state_dict()
    stage_layers = set(model.layers.layer_ids)
    expect = [k for k in want if not k.startswith("layers.") or int(k.split(".")[1]) in stage_layers]
    if sorted(got) != sorted(expect):
        raise AssertionError(f"state_dict keys {sorted(got)} != {sorted(expect)}")
    for k in expect:
        if k.endswith(".s"):
            assert_equal(f"built-in init {k} vs the unpipelined model", got[k], flat_sd[k])
        else:
            assert_equal(f"init {k} vs plain torch", got[k], want[k].cpu())
            assert_equal(f"init {k} vs the unpipelined model", got[k], flat_sd[k])


@case
def pipeline_usage_errors_are_assertions():
    """BMTrain asserts on a Block(mode="BLOCK") in a pipeline and on a Block listed twice: AssertionError (also a
    ValueError here); the same plain module twice is refused too (its positions may sit on different stages)."""
    _world2_only()
    M = make(BMT)
    expect_raises("a Block(mode='BLOCK') in a pipeline", (AssertionError,),
                  lambda: bmt.PipelineTransformerBlockList([bmt.Block(M.Layer(D, 1)), M.Layer(D, 2)]),
                  must_mention=("mode='PIPE'",))
    blk = bmt.Block(M.Layer(D, 3), mode="PIPE")
    expect_raises("the same Block twice", (AssertionError,), lambda: bmt.PipelineTransformerBlockList([blk, blk]),
                  must_mention=("same module",))
    layer = M.Layer(D, 4)
    expect_raises("the same module twice", (AssertionError,),
                  lambda: bmt.PipelineTransformerBlockList([layer, M.Layer(D, 5), layer]), must_mention=("same module",))


if __name__ == "__main__":
    main(dict(pipe_size=2, num_micro_batches=2))
