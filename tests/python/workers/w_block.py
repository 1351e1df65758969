"""Block and TransformerBlockList against plain torch: outputs, input and parameter gradients.

Data parallelism: rank r feeds its own micro-batch x_r; a plain `loss.backward()` leaves the gradient summed over
ranks (BMTrain), so the reference runs every rank's micro-batch through the torch twin and accumulates.
"""
import collections
import copy

import torch
import torch.nn.functional as F

import bmtrain as bmt
from common import (Skip, assert_close, assert_equal, case, compare_grads, compare_state, expect_raises,  # noqa: F401
                    device, full_grad, local_shard_range, main, randn, rank, rank_input, world)
from models import BMT, BMT_BF16, COUNTS, TORCH, TORCH_BF16, make

D, B = 6, 3  # feature width, rows per rank


def _tensors(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _loss(out, seed=7):
    """A weighted sum (not .sum(), so a permuted gradient would show) over every output tensor."""
    return sum((t * randn(*t.shape, seed=seed + i)).sum() for i, t in enumerate(_tensors(out)))


def check_twins(model, ref, call, in_shapes, input_grad=True, what=""):
    """Runs call(model, *inputs) here and call(ref, *inputs_r) for every rank r; compares this rank's outputs and
    input gradients, then all parameter gradients (summed over ranks)."""
    xs = [rank_input(rank(), *s, seed=10 + i, requires_grad=input_grad) for i, s in enumerate(in_shapes)]
    out = call(model, *xs)
    _loss(out).backward()
    for r in range(world()):
        xr = [rank_input(r, *s, seed=10 + i, requires_grad=input_grad) for i, s in enumerate(in_shapes)]
        ref_out = call(ref, *xr)
        _loss(ref_out).backward()
        if r != rank():
            continue
        got, want = _tensors(out), _tensors(ref_out)
        if len(got) != len(want):
            raise AssertionError(f"{what}: {len(got)} outputs, torch gives {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(f"{what} output {i}", g, w)
        if input_grad:
            for i, (x, x_ref) in enumerate(zip(xs, xr)):
                if x_ref.grad is None:  # an input the call does not use
                    if x.grad is not None and x.grad.count_nonzero().item() != 0:
                        raise AssertionError(f"{what} input {i}: unused by torch, yet has a non-zero gradient")
                    continue
                assert_close(f"{what} input {i} grad", x.grad, x_ref.grad)
    compare_grads(model, ref, what=what + " ")
    return out


@case
def block_tensor():
    T, M = make(TORCH), make(BMT)
    for zero_level in (3, 2):
        check_twins(bmt.Block(M.Layer(D, 1), zero_level=zero_level), T.Layer(D, 1), lambda m, x: m(x), [(B, D)],
                    what=f"zero_level={zero_level}")
    for use_checkpoint in (True, False):
        for input_grad in (True, False):  # inputs without grad: only the parameters need it (first block)
            what = f"checkpoint={use_checkpoint} input_grad={input_grad}"
            out = check_twins(bmt.Block(M.Layer(D, 1), use_checkpoint=use_checkpoint), T.Layer(D, 1),
                              lambda m, x: m(x), [(B, D)], input_grad, what)
            if not isinstance(out, torch.Tensor):
                raise AssertionError(f"{what}: Block returned {type(out).__name__}, the module returns a tensor")


def _attention_layer(kit, attend):
    """x + causal self-attention of x (3 heads of width 2, no output projection) with `attend` as the kernel."""
    class AttnLayer(kit.Module):
        def __init__(self, seed):
            super().__init__()
            self.wqkv = kit.param(randn(3 * D, D, seed=seed, scale=D ** -0.5))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (y.view(b, t, 3, D // 3).transpose(1, 2) for y in F.linear(x, self.wqkv).chunk(3, -1))
            return x + attend(q, k, v).transpose(1, 2).reshape(b, t, D)
    return AttnLayer


@case
def block_causal_attention():
    """bmt.nn.causal_attention in Blocks (checkpointed: the first run keeps the attention's output for the
    recompute) against torch's scaled_dot_product_attention in the twin."""
    TorchAttn = _attention_layer(TORCH, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    BmtAttn = _attention_layer(BMT, bmt.nn.causal_attention)
    for use_checkpoint in (True, False):
        check_twins(bmt.Block(BmtAttn(5), use_checkpoint=use_checkpoint), TorchAttn(5), lambda m, x: m(x),
                    [(B, 5, D)], what=f"attention checkpoint={use_checkpoint}")
    layers = BMT.blocklist([BmtAttn(5 + i) for i in range(2)])
    ref = TORCH.blocklist([TorchAttn(5 + i) for i in range(2)])
    check_twins(layers, ref, lambda m, x: m(x), [(B, 5, D)], what="attention block list")


@case
def block_shard_attributes():
    """BMTrain's _start_partition/_end_partition/_original_shape describe the slice a parameter holds, also after
    a Block re-packed it (other code, e.g. optimizer-state slicing, relies on them)."""
    M = make(BMT)
    inner = M.Layer(D, 1)
    blk = bmt.Block(inner)
    for name, p in blk.named_parameters():
        rng = local_shard_range(p)
        got = (p._start_partition, p._end_partition)
        if rng is None:
            if p.numel() != 0 or (got[0] is not None and got[1] > got[0]):
                raise AssertionError(f"{name}: holds nothing but numel {p.numel()}, partition {got}")
            continue
        if tuple(got) != rng:
            raise AssertionError(f"{name}: _start_partition/_end_partition {got}, the engine's shard is {rng}")
        if p.numel() != rng[1] - rng[0]:
            raise AssertionError(f"{name}: holds {p.numel()} elements, its partition {rng} has {rng[1] - rng[0]}")
        if tuple(p._original_shape) != tuple(dict(make(TORCH).Layer(D, 1).named_parameters())[name].shape):
            raise AssertionError(f"{name}: _original_shape {tuple(p._original_shape)}")


@case
def block_checkpoint_alias():
    if bmt.CheckpointBlock is not bmt.Block:
        raise AssertionError("bmt.CheckpointBlock is not bmt.Block")


@case
def block_tuple():
    T, M = make(TORCH), make(BMT)
    out = check_twins(bmt.Block(M.TupleLayer(D, 2)), T.TupleLayer(D, 2), lambda m, x: m(x), [(B, D)], what="tuple")
    if not isinstance(out, tuple) or len(out) != 2:
        raise AssertionError(f"Block returned {type(out).__name__} of {len(_tensors(out))}, expected a 2-tuple")


@case
def block_dict():
    """A dict output comes back as the same dict, its items' structure kept (BMTrain would return the dict's keys:
    docs/python.md lists the difference)."""
    T, M = make(TORCH), make(BMT)

    def as_dict(layer_cls):
        class DictLayer(layer_cls):
            def forward(self, x):
                y = super().forward(x)
                return {"y": y, "aux": [y * 3, x * 2]}
        return DictLayer

    def call(m, x):
        out = m(x)
        if not isinstance(out, dict) or sorted(out) != ["aux", "y"] or not isinstance(out["aux"], list):
            raise AssertionError(f"Block returned {type(out).__name__} {out if not isinstance(out, dict) else sorted(out)}")
        return [out["y"], *out["aux"]]
    check_twins(bmt.Block(as_dict(M.Layer)(D, 2)), as_dict(T.Layer)(D, 2), call, [(B, D)], what="dict")


@case
def block_list10():
    """A module returning a list (or a namedtuple) gives a plain tuple of the same items, as BMTrain's Block does
    (tuple(out)); an item that is itself a list stays a list."""
    T, M = make(TORCH), make(BMT)
    out = check_twins(bmt.Block(M.ListLayer(D, 3)), T.ListLayer(D, 3), lambda m, x: m(x), [(B, D)], what="list")
    if type(out) is not tuple or len(out) != 10:
        raise AssertionError(f"Block returned {type(out).__name__} of {len(_tensors(out))}; the module returns a "
                             "10-item list and BMTrain's Block gives a 10-tuple")
    Pair = collections.namedtuple("Pair", "y aux")

    def nested(layer_cls):
        class NestedLayer(layer_cls):
            def forward(self, x):
                y = super().forward(x)
                return Pair(y, [y * 3, x * 2])
        return NestedLayer

    def call(m, x):
        out = m(x)
        if m is not None and isinstance(m, bmt.Block):
            if type(out) is not tuple or len(out) != 2 or type(out[1]) is not list:
                raise AssertionError(f"namedtuple output: Block returned {type(out).__name__} holding "
                                     f"{[type(o).__name__ for o in out]}, expected a plain tuple (tensor, list)")
        return [out[0], *out[1]]
    check_twins(bmt.Block(nested(M.Layer)(D, 3)), nested(T.Layer)(D, 3), call, [(B, D)], what="namedtuple")


@case
def block_kwargs():
    T, M = make(TORCH), make(BMT)
    calls = {
        "positional scale": lambda m, x, s: m(x, 0.5),
        "keyword scale": lambda m, x, s: m(x, scale=2.0),
        "keyword-only tensor": lambda m, x, s: m(x, shift=s),  # BMTrain drops keyword-only args: we must not
        "all keywords": lambda m, x, s: m(x=x, scale=-1.5, shift=s * 3),
        "defaults": lambda m, x, s: m(x),
    }
    for what, call in calls.items():
        check_twins(bmt.Block(M.KwLayer(D, 4)), T.KwLayer(D, 4), call, [(B, D), (B, D)], what=what)


@case
def block_no_grad():
    T, M = make(TORCH), make(BMT)
    ref = T.Layer(D, 5, name="ref")
    for use_checkpoint in (True, False):
        blk = bmt.Block(M.Layer(D, 5, name="nograd"), use_checkpoint=use_checkpoint)
        x = rank_input(rank(), B, D, requires_grad=True)
        COUNTS.clear()
        with torch.no_grad():
            y = blk(x)
        if COUNTS.get("nograd") != 1:
            raise AssertionError(f"checkpoint={use_checkpoint}: under no_grad the inner forward ran "
                                 f"{COUNTS.get('nograd')} times, expected once")
        if y.requires_grad:
            raise AssertionError("no_grad output requires grad")
        with torch.no_grad():
            assert_close("no_grad output", y, ref(x))
    # With grad: no checkpointing -> one forward; checkpointing -> the backward recomputes once.
    for use_checkpoint, calls in ((False, 1), (True, 2)):
        blk = bmt.Block(M.Layer(D, 5, name="grad"), use_checkpoint=use_checkpoint)
        COUNTS.clear()
        blk(rank_input(rank(), B, D, requires_grad=True)).sum().backward()
        if COUNTS.get("grad") != calls:
            raise AssertionError(f"use_checkpoint={use_checkpoint}: forward+backward ran the inner forward "
                                 f"{COUNTS.get('grad')} times, expected {calls}")


def _adam_pair(model, ref, lr=1e-2):
    opt = bmt.optim.AdamOptimizer(model.parameters(), lr=lr)
    om = bmt.optim.OptimManager(loss_scale=1024)
    om.add_optimizer(opt)
    ref_opt = torch.optim.Adam([p for p in ref.parameters()], lr=lr)
    return om, ref_opt


def _dp_step(model, ref, om, ref_opt, seed):
    """One data-parallel step: bmt with OptimManager (divides by world), torch on the mean of the ranks' losses."""
    om.zero_grad()
    ref_opt.zero_grad()
    om.backward(_loss(model(rank_input(rank(), B, D, seed=seed))))
    ref_loss = sum(_loss(ref(rank_input(r, B, D, seed=seed))) for r in range(world())) / world()
    ref_loss.backward()
    om.step()
    ref_opt.step()


@case
def block_requires_grad_toggle():
    T, M = make(TORCH), make(BMT)
    blk, ref = bmt.Block(M.Layer(D, 6)), T.Layer(D, 6)
    frozen = "lin1.weight"
    for m in (blk, ref):
        dict(m.named_parameters())[frozen].requires_grad_(False)
    check_twins(blk, ref, lambda m, x: m(x), [(B, D)], what="frozen lin1.weight")
    p = dict(blk.named_parameters())[frozen]
    if p.grad is not None or bmt.main_grad(p) is not None:
        raise AssertionError(f"a parameter with requires_grad=False got a gradient: .grad {p.grad}, main_grad "
                             f"{bmt.main_grad(p)} (torch leaves it None)")
    for name, q in blk.named_parameters():
        if name != frozen and local_shard_range(q) is not None and q.grad is None:
            raise AssertionError(f"trainable {name} has no .grad after backward")
    om, ref_opt = _adam_pair(blk, ref)
    before = blk.state_dict()[frozen].clone()
    for step in range(2):
        _dp_step(blk, ref, om, ref_opt, seed=50 + step)
    assert_equal("frozen parameter after 2 steps", blk.state_dict()[frozen], before)
    compare_state(blk, ref, what="frozen: ")
    for m in (blk, ref):
        dict(m.named_parameters())[frozen].requires_grad_(True)
    for step in range(2):
        _dp_step(blk, ref, om, ref_opt, seed=60 + step)
    compare_state(blk, ref, what="unfrozen again: ")
    if torch.equal(blk.state_dict()[frozen], before):
        raise AssertionError("the unfrozen parameter did not change in 2 steps")
    if local_shard_range(p) is not None and p.grad is None:
        raise AssertionError("the unfrozen parameter has no .grad after its backward")


@case
def grad_accumulation():
    """Two backward()s before step() equal one backward of the summed loss (and torch on that loss)."""
    T, M = make(TORCH), make(BMT)
    a, b, ref = M.Net(D, 2, 7), M.Net(D, 2, 7), T.Net(D, 2, 7)
    om_a, ref_opt = _adam_pair(a, ref)
    om_b, _ = _adam_pair(b, T.Net(D, 2, 7))
    x1, x2 = (rank_input(rank(), B, D, seed=s) for s in (70, 71))
    om_a.zero_grad()
    om_b.zero_grad()
    om_a.backward(_loss(a(x1)))
    om_a.backward(_loss(a(x2)))
    om_b.backward(_loss(b(x1)) + _loss(b(x2)))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert_close(f"accumulated grad {name}", full_grad(pa, name), full_grad(pb, name), rtol=1e-5, atol=1e-4)
    ref_opt.zero_grad()
    ref_loss = sum(_loss(ref(rank_input(r, B, D, seed=70))) + _loss(ref(rank_input(r, B, D, seed=71)))
                   for r in range(world())) / world()
    ref_loss.backward()
    om_a.step()
    om_b.step()
    ref_opt.step()
    compare_state(a, b, what="two backward vs one: ")
    compare_state(a, ref, what="accumulated vs torch: ")


@case
def blocklist_num_hidden():
    T, M = make(TORCH), make(BMT)
    for explicit_blocks in (False, True):
        mods = [M.Hidden2Layer(D, 200 + 10 * i) for i in range(3)]
        model = bmt.TransformerBlockList([bmt.Block(m) for m in mods] if explicit_blocks else mods, num_hidden=2)
        ref = TORCH.blocklist([T.Hidden2Layer(D, 200 + 10 * i) for i in range(3)], num_hidden=2)
        what = f"num_hidden=2 blocks={'explicit' if explicit_blocks else 'wrapped'}"
        out = check_twins(model, ref, lambda m, h1, h2, c: m(h1, h2, c), [(B, D)] * 3, what=what)
        if not isinstance(out, tuple) or len(out) != 2:
            raise AssertionError(f"{what}: returned {type(out).__name__}, expected a 2-tuple")


@case
def blocklist_without_checkpoint():
    """Blocks with use_checkpoint=False (activations kept) and ZeRO-2 blocks in one list."""
    T, M = make(TORCH), make(BMT)
    blocks = [bmt.Block(M.Layer(D, 700), use_checkpoint=False), bmt.Block(M.Layer(D, 710), zero_level=2),
              bmt.Block(M.Layer(D, 720), use_checkpoint=False, zero_level=2)]
    ref = TORCH.blocklist([T.Layer(D, 700), T.Layer(D, 710), T.Layer(D, 720)])
    check_twins(bmt.TransformerBlockList(blocks), ref, lambda m, x: m(x), [(B, D)], what="no checkpoint / zero 2")


@case
def tied_parameter_outside_block():
    """A DistributedModule parameter read twice in one forward (tied embedding and projection): gradients add."""
    T, M = make(TORCH), make(BMT)

    def tied(kit, layers):
        class Tied(kit.Module):
            def __init__(self):
                super().__init__()
                self.emb = kit.param(randn(11, D, seed=800))
                self.layers = layers

            def forward(self, ids):
                return F.linear(self.layers(F.embedding(ids, self.emb)), self.emb)
        return Tied()

    model = tied(BMT, bmt.TransformerBlockList([M.Layer(D, 810)]))
    ref = tied(TORCH, TORCH.blocklist([T.Layer(D, 810)]))
    ids = [torch.randint(0, 11, (B, 4), generator=torch.Generator().manual_seed(r)).to(randn(1, seed=0).device)
           for r in range(world())]
    _loss(model(ids[rank()])).backward()
    for r in range(world()):
        out = ref(ids[r])
        _loss(out).backward()
        if r == rank():
            with torch.no_grad():
                assert_close("tied output", model(ids[r]), out)
    compare_grads(model, ref, what="tied ")


@case
def blocklist_return_hidden_states():
    T, M = make(TORCH), make(BMT)
    model = bmt.TransformerBlockList([M.Layer(D, 300 + 10 * i) for i in range(3)])
    ref = TORCH.blocklist([T.Layer(D, 300 + 10 * i) for i in range(3)])
    out = check_twins(model, ref, lambda m, x: m(x, return_hidden_states=True), [(B, D)],
                      what="num_hidden=1 return_hidden_states")
    if len(out) != 2 or tuple(out[1].shape) != (3, B, D):
        raise AssertionError(f"expected (output, hidden states of shape (3, {B}, {D})), got "
                             f"{[tuple(t.shape) for t in _tensors(out)]}")
    model = bmt.TransformerBlockList([M.Hidden2Layer(D, 400 + 10 * i) for i in range(2)], num_hidden=2)
    ref = TORCH.blocklist([T.Hidden2Layer(D, 400 + 10 * i) for i in range(2)], num_hidden=2)
    out = check_twins(model, ref, lambda m, h1, h2, c: m(h1, h2, c, return_hidden_states=True), [(B, D)] * 3,
                      what="num_hidden=2 return_hidden_states")
    if len(out) != 4:
        raise AssertionError(f"num_hidden=2 return_hidden_states gave {len(out)} tensors, expected 4")


@case
def blocklist_dropout():
    T, M = make(TORCH), make(BMT)
    model = bmt.TransformerBlockList([M.DropLayer(D * 4, 500 + i) for i in range(2)])
    ref = TORCH.blocklist([T.DropLayer(D * 4, 500 + i) for i in range(2)])
    x = rank_input(rank(), B, D * 4)
    model.eval()
    ref.eval()
    with torch.no_grad():
        e1, e2, e_ref = model(x), model(x), ref(x)
    assert_equal("eval() output twice", e1, e2)
    assert_close("eval() output vs torch", e1, e_ref)
    model.train()
    with torch.no_grad():
        t1, t2 = model(x), model(x)
    if torch.allclose(t1, e1):
        raise AssertionError("train() output equals eval() output: dropout is not active in the block list")
    if torch.equal(t1, t2):
        raise AssertionError("two train() forwards gave the same dropout mask")
    # The mask used in forward must be reused by the recompute in backward: read the mask off the output of a
    # one-layer list (lin(x) is never exactly 0) and differentiate torch with that mask.
    model = bmt.TransformerBlockList([M.DropLayer(D * 4, 510)])
    ref = T.DropLayer(D * 4, 510)
    model.train()
    x = rank_input(rank(), B, D * 4, requires_grad=True)
    y = model(x)
    (y * randn(B, D * 4, seed=9)).sum().backward()
    for r in range(world()):
        xr = rank_input(r, B, D * 4, requires_grad=True)
        mask = torch.empty(0)
        if r == rank():
            mask = (y != 0).to(y.dtype)
        # Other ranks' masks: broadcast rank r's mask to everyone.
        mask_r = bmt.distributed.broadcast(mask if r == rank() else torch.zeros(B, D * 4, device=y.device), r) \
            if world() > 1 else mask
        y_ref = ref.lin(xr) * mask_r * 2.0
        (y_ref * randn(B, D * 4, seed=9)).sum().backward()
        if r == rank():
            assert_close("train() output vs torch with the same mask", y, y_ref)
            assert_close("train() input grad (recompute used the forward's mask)", x.grad, xr.grad)
    compare_grads(model, TORCH.blocklist([ref]), what="dropout train: ")


def _bf16_twins(seed=600, n=2, **block_kw):
    T, M = make(TORCH_BF16), make(BMT_BF16)
    model = bmt.TransformerBlockList([bmt.Block(M.Layer(D * 4, seed + 10 * i), **block_kw) for i in range(n)])
    ref = TORCH.blocklist([T.Layer(D * 4, seed + 10 * i) for i in range(n)])
    return model, ref


def _bf16_backward(model, ref, seed=9, scale=1.0, check_output=True):
    """model's backward on this rank's batch; returns every torch parameter's gradient summed over the ranks'
    batches in fp32 (each rank's own bf16 gradient, as the engine reduces them)."""
    x = rank_input(rank(), B, D * 4).to(torch.bfloat16)
    y = model(x)
    if y.dtype != torch.bfloat16:
        raise AssertionError(f"bf16 block list returned {y.dtype}")
    ((y.float() * randn(B, D * 4, seed=seed)).sum() * scale).backward()
    sums = {}
    for r in range(world()):
        ref.zero_grad(set_to_none=True)
        y_ref = ref(rank_input(r, B, D * 4).to(torch.bfloat16))
        ((y_ref.float() * randn(B, D * 4, seed=seed)).sum() * scale).backward()
        if r == rank() and check_output:
            assert_close("bf16 output", y, y_ref, rtol=2e-2, atol=2e-2)
        for name, p in ref.named_parameters():
            sums[name] = sums.get(name, 0) + p.grad.float()
    return sums


def _check_shard_grads(model, sums, what, fp32_shard=False):
    """Each parameter's gradient slice against the ranks' summed torch gradients: rounded once to bf16 (the bf16
    shard) or kept in fp32 (reduce_dtype=torch.float32). Exact at worlds 1 and 2 (two bf16 numbers add exactly in
    fp32); world 4 reduces in steps, so within bf16's rounding."""
    for name, p in model.named_parameters():
        rng = local_shard_range(p)
        g = bmt.main_grad(p) if fp32_shard else p.grad
        if rng is None:
            if g is not None and g.numel() != 0:
                raise AssertionError(f"{what} {name}: holds no elements but has a gradient of {g.numel()}")
            continue
        want_dtype = torch.float32 if fp32_shard else torch.bfloat16
        if g is None or g.dtype != want_dtype or g.numel() != rng[1] - rng[0]:
            raise AssertionError(f"{what} {name}: gradient {None if g is None else (g.dtype, g.numel())}, expected "
                                 f"{want_dtype} of {rng[1] - rng[0]} elements (its shard)")
        if fp32_shard:
            if p.grad is not None:
                raise AssertionError(f"{what} {name}: .grad is set though the shard is fp32 (bmt.main_grad holds it)")
        elif bmt.main_grad(p).data_ptr() != g.data_ptr():
            raise AssertionError(f"{what} {name}: bmt.main_grad(p) is not p.grad (the optimizers read another tensor)")
        want = sums[name].reshape(-1)[rng[0]:rng[1]].to(want_dtype)
        if world() <= 2:
            assert_equal(f"{what} grad {name}", g, want)
        else:
            assert_close(f"{what} grad {name}", g.float(), want.float(), rtol=2e-2, atol=1e-2)


@case
def block_bf16():
    """bf16 parameters in Blocks: outputs vs the bf16 torch twin; after backward each parameter's .grad is its bf16
    slice of the Block's bf16 gradient shard (BMTrain's), and bmt.main_grad(p) is that same tensor."""
    model, ref = _bf16_twins()
    sums = _bf16_backward(model, ref)
    _check_shard_grads(model, sums, "bf16 shard")
    # A second backward accumulates into the shard (the sum of the two, rounded per step as BMTrain does).
    before = {n: p.grad.float().clone() for n, p in model.named_parameters() if local_shard_range(p) is not None}
    sums2 = _bf16_backward(model, ref, seed=19, check_output=False)
    for name, p in model.named_parameters():
        if name in before:
            rng = local_shard_range(p)
            want = (before[name] + sums2[name].reshape(-1)[rng[0]:rng[1]].to(torch.bfloat16).float())
            assert_close(f"accumulated bf16 grad {name}", p.grad.float(), want, rtol=2e-2, atol=2e-2)


@case
def outside_block_bf16_grad():
    """bf16 DistributedParameters outside any Block (the Net's input projection and head): after backward, .grad is
    this rank's shard of the gradient summed over the ranks in the parameter's dtype (BMTrain's), bmt.main_grad(p)
    is that tensor, a second backward adds to it, and `p.grad = None` (zero_grad(set_to_none=True)) discards it:
    the next backward starts from zero."""
    T, M = make(TORCH_BF16), make(BMT_BF16)
    model, ref = M.Net(D, 2, 670), T.Net(D, 2, 670)

    def backward(seed):
        ((model(rank_input(rank(), B, D, seed=seed).to(torch.bfloat16)).float() * randn(B, 3, seed=seed)).sum()).backward()
        sums = {}
        for r in range(world()):
            ref.zero_grad(set_to_none=True)
            ((ref(rank_input(r, B, D, seed=seed).to(torch.bfloat16)).float() * randn(B, 3, seed=seed)).sum()).backward()
            for name, p in ref.named_parameters():
                sums[name] = sums.get(name, 0) + p.grad.float()
        return sums

    outside = [(n, p) for n, p in model.named_parameters() if not n.startswith("layers.")]
    if not outside:
        raise AssertionError("the Net has no parameter outside its Blocks")
    first = backward(31)
    for name, p in outside:
        rng = local_shard_range(p)
        if rng is None:
            continue
        g = p.grad
        if g is None or g.dtype != torch.bfloat16 or g.numel() != rng[1] - rng[0]:
            raise AssertionError(f"{name}: .grad is {None if g is None else (g.dtype, g.numel())}, expected the "
                                 f"parameter's bf16 shard of {rng[1] - rng[0]} elements")
        if bmt.main_grad(p) is None or bmt.main_grad(p).data_ptr() != g.data_ptr():
            raise AssertionError(f"{name}: bmt.main_grad(p) is not p.grad (the optimizers read another tensor)")
        want = first[name].reshape(-1)[rng[0]:rng[1]].to(torch.bfloat16)
        if world() <= 2:
            assert_equal(f"outside-Block grad {name}", g, want)
        else:
            assert_close(f"outside-Block grad {name}", g.float(), want.float(), rtol=2e-2, atol=1e-2)
    before = {n: p.grad.float().clone() for n, p in outside if local_shard_range(p) is not None}
    second = backward(32)
    for name, p in outside:
        if name in before:
            rng = local_shard_range(p)
            want = before[name] + second[name].reshape(-1)[rng[0]:rng[1]].to(torch.bfloat16).float()
            assert_close(f"accumulated outside-Block grad {name}", p.grad.float(), want, rtol=2e-2, atol=2e-2)
    for _, p in outside:
        p.grad = None
    third = backward(33)
    for name, p in outside:
        rng = local_shard_range(p)
        if rng is None:
            continue
        if p.grad is None:
            raise AssertionError(f"{name}: .grad stayed None after a backward that followed p.grad = None")
        want = third[name].reshape(-1)[rng[0]:rng[1]].to(torch.bfloat16)
        assert_close(f"outside-Block grad after p.grad = None {name}", p.grad.float(), want.float(), rtol=2e-2,
                     atol=1e-2)


@case
def block_bf16_fp32_shard():
    """reduce_dtype=torch.float32 keeps the fp32 gradient shard (.grad None, the gradient in bmt.main_grad(p)):
    twice the bytes of the default bf16 shard, which is exactly the size of the parameter shard."""
    model, ref = _bf16_twins(seed=640, reduce_dtype=torch.float32)
    sums = _bf16_backward(model, ref)
    _check_shard_grads(model, sums, "fp32 shard", fp32_shard=True)
    default, _ = _bf16_twins(seed=640)
    _bf16_backward(default, ref, check_output=False)
    for blk_fp32, blk_bf16 in zip(model, default):
        c32, c16 = blk_fp32._cblock, blk_bf16._cblock
        if c16.grad_nbytes != c16.shard_nbytes or c32.grad_nbytes != 2 * c32.shard_nbytes:
            raise AssertionError(f"gradient shard bytes: default {c16.grad_nbytes} (parameter shard "
                                 f"{c16.shard_nbytes}: expected equal), fp32 {c32.grad_nbytes} (expected twice "
                                 f"{c32.shard_nbytes})")


@case
def block_bf16_optimizers():
    """AdamOptimizer and AdamOffloadOptimizer under OptimManager read the bf16 gradient shard: one step equals torch's
    Adam on fp32 masters fed that gradient (the shard's values: the ranks' gradients of loss / world, summed,
    rounded to bf16), the new bf16 values within one bf16 rounding."""
    for opt_cls in (bmt.optim.AdamOptimizer, bmt.optim.AdamOffloadOptimizer):
        model, ref = _bf16_twins(seed=660)
        om = bmt.optim.OptimManager(loss_scale=None)
        om.add_optimizer(opt_cls(model.parameters(), lr=1e-2))
        om.zero_grad()
        sums = _bf16_backward(model, ref, scale=1.0 / world())  # om.backward divides by grad_scale = world
        masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in ref.named_parameters()}
        for n, m in masters.items():
            m.grad = sums[n].to(torch.bfloat16).float()
        torch_opt = torch.optim.Adam(list(masters.values()), lr=1e-2)
        torch_opt.step()
        if not om.step():
            raise AssertionError(f"{opt_cls.__name__}: the step was skipped")
        got = model.state_dict()
        for n, m in masters.items():
            want = m.detach().to(torch.bfloat16).float()
            assert_close(f"{opt_cls.__name__} after one step: {n}", got[n].float(), want, rtol=1e-2, atol=1e-2)
            # (a Block's state_dict holds CPU tensors, as BMTrain's DistributedModule saves them)
            if torch.equal(got[n].to(device()), ref.state_dict()[n].to(device())):
                raise AssertionError(f"{opt_cls.__name__}: {n} did not change")


@case
def block_bf16_clip_and_inf():
    """OptimManager.clip_grad_norm over bf16 .grad: returns the global norm of the gradients (the closed form over the
    assembled shards) and scales every .grad in place; torch.nn.utils.clip_grad_norm_ sees the same tensors. Loss
    scaling: an inf in a bf16 gradient shard skips the step everywhere and halves the scale."""
    model, ref = _bf16_twins(seed=680)
    opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2)
    om = bmt.optim.OptimManager(loss_scale=None)
    om.add_optimizer(opt)
    om.zero_grad()
    _bf16_backward(model, ref, check_output=False)
    params = dict(model.named_parameters())
    full = {n: full_grad(p, n) for n, p in params.items()}
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in full.values())).item()
    if world() == 1:  # torch's clip over the same .grad tensors (a norm over this rank's shards only)
        tnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9).item()
        assert_close("torch.nn.utils.clip_grad_norm_ over .grad", torch.tensor(tnorm), torch.tensor(norm), rtol=2e-2)
    before = {n: p.grad.float().clone() for n, p in params.items() if p.grad is not None}
    max_norm = norm / 4
    got = om.clip_grad_norm(opt.param_groups, max_norm)
    assert_close("clip_grad_norm's returned norm", torch.tensor(float(got)), torch.tensor(norm), rtol=1e-3)
    coef = max_norm / (norm + 1e-6)
    for n, g in before.items():
        assert_close(f"clipped .grad {n}", params[n].grad.float(), (g * coef).to(torch.bfloat16).float(),
                     rtol=1e-2, atol=1e-3)
    # inf/NaN check over the bf16 shards, with loss scaling
    model, ref = _bf16_twins(seed=690)
    om = bmt.optim.OptimManager(loss_scale=1024)
    om.add_optimizer(bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    om.zero_grad()
    x = rank_input(rank(), B, D * 4).to(torch.bfloat16)
    if rank() == world() - 1:
        x[0, 0] = float("inf")
    om.backward(model(x).float().sum())
    if om.step():
        raise AssertionError("a step with an inf gradient on one rank was not skipped")
    if om.loss_scale != 512:
        raise AssertionError(f"loss scale after a skipped step: {om.loss_scale}, expected 512")
    for k, v in model.state_dict().items():
        assert_equal(f"after the skipped step: {k}", v, start[k])


@case
def zero_grad_set_to_none():
    """optimizer.zero_grad(set_to_none=True) drops .grad; the next backward brings .grad back holding only its own
    gradient (not added to the discarded one)."""
    T, M = make(TORCH), make(BMT)
    blk, ref = bmt.Block(M.Layer(D, 720)), T.Layer(D, 720)
    opt = bmt.optim.AdamOptimizer(blk.parameters(), lr=1e-2)
    check_twins(blk, ref, lambda m, x: m(x), [(B, D)], what="first backward")
    opt.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    for name, p in blk.named_parameters():
        if p.grad is not None:
            raise AssertionError(f"{name}: .grad is still set after zero_grad(set_to_none=True)")
    check_twins(blk, ref, lambda m, x: m(x), [(B, D)], what="after zero_grad(set_to_none=True)")
    for name, p in blk.named_parameters():
        if local_shard_range(p) is not None and p.grad is None:
            raise AssertionError(f"{name}: .grad did not come back with the next backward")


@case
def blocklist_same_layer_twice():
    """The same plain layer listed twice: BMTrain wraps it in two Blocks over one set of parameters (Block.reference),
    which run twice and add their gradients; state_dict has both positions' keys, as torch's ModuleList. The same
    Block twice is BMTrain's AssertionError."""
    T, M = make(TORCH), make(BMT)
    a, b = M.Layer(D, 740), M.Layer(D, 750)
    ta, tb = T.Layer(D, 740), T.Layer(D, 750)
    model = bmt.TransformerBlockList([a, b, a])
    ref = TORCH.blocklist([ta, tb, ta])
    if model[0] is model[2] or not isinstance(model[2], bmt.Block) or model[0]._module is not model[2]._module:
        raise AssertionError("the repeated layer is not wrapped twice over one module")
    if len(list(model.parameters())) != len(list(ref.parameters())):
        raise AssertionError(f"{len(list(model.parameters()))} parameters, torch has {len(list(ref.parameters()))}")
    if list(model.state_dict()) != list(ref.state_dict()):
        raise AssertionError(f"state_dict keys {list(model.state_dict())} != torch's {list(ref.state_dict())}")
    om, ref_opt = _adam_pair(model, ref)
    check_twins(model, ref, lambda m, x: m(x), [(B, D)], what="a layer listed twice")
    out = check_twins(model, ref, lambda m, x: m(x, return_hidden_states=True), [(B, D)],
                      what="a layer listed twice, return_hidden_states")
    if tuple(out[1].shape) != (3, B, D):
        raise AssertionError(f"hidden states {tuple(out[1].shape)}")
    _dp_step(model, ref, om, ref_opt, seed=760)
    compare_state(model, ref, what="a layer listed twice, after a step: ")
    blk = bmt.Block(M.Layer(D, 770))
    expect_raises("the same Block twice in one TransformerBlockList", (AssertionError,),
                  lambda: bmt.TransformerBlockList([blk, M.Layer(D, 780), blk]))


@case
def deepcopy_model():
    """copy.deepcopy of a model with DistributedParameters (outside Blocks, in Blocks, in a block list with a layer
    listed twice): an independent model with the same values, parameters, attributes and options, which trains as a
    fresh twin does; stepping the original leaves the copy as it was."""
    T, M = make(TORCH), make(BMT)
    model, ref = M.Net(D, 2, 790), T.Net(D, 2, 790)
    model.layers[1].lin1.weight.custom_tag = "kept"
    twin = copy.deepcopy(model)
    compare_state(twin, ref, exact=True, what="deepcopy: ")
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        if p is q or not isinstance(q, bmt.DistributedParameter) or q.dtype != p.dtype or q.shape != p.shape:
            raise AssertionError(f"deepcopy: {n} is {'the same object' if p is q else type(q).__name__}")
        if q._init_method is not p._init_method or q.group != p.group or q._original_shape != p._original_shape:
            raise AssertionError(f"deepcopy: {n} lost its init_method, group or shape")
    if twin.layers[1].lin1.weight.__dict__.get("custom_tag") != "kept":
        raise AssertionError("deepcopy dropped a user attribute of a parameter")
    if not isinstance(twin.layers, bmt.TransformerBlockList) or twin.layers[0] is model.layers[0]:
        raise AssertionError("deepcopy: the block list is not copied")
    om, ref_opt = _adam_pair(model, ref)
    _dp_step(model, ref, om, ref_opt, seed=800)
    compare_state(model, ref, what="original after a step: ")
    compare_state(twin, T.Net(D, 2, 790), exact=True, what="copy after the original stepped: ")
    check_twins(twin, T.Net(D, 2, 790), lambda m, x: m(x), [(B, D)], what="the copy")
    blk = bmt.Block(M.Layer(D, 810), zero_level=2, use_checkpoint=False, reduce_dtype=torch.float32)
    c = copy.deepcopy(blk)
    if (c.zero_level, c.use_checkpoint, c.__dict__["_build_args"]) != (2, False, blk.__dict__["_build_args"]):
        raise AssertionError("deepcopy of a Block lost its options")
    a = M.Layer(D, 820)
    lst = copy.deepcopy(bmt.TransformerBlockList([a, M.Layer(D, 830), a]))
    if lst[0]._module is not lst[2]._module or lst[0]._module is a:
        raise AssertionError("deepcopy of a list with a layer listed twice: the copies do not share one new layer")
    ta = T.Layer(D, 820)
    check_twins(lst, TORCH.blocklist([ta, T.Layer(D, 830), ta]), lambda m, x: m(x), [(B, D)],
                what="copied list with a repeated layer")


@case
def inner_module_called_outside_block():
    """Calling a Block's inner module directly (its parameters are 1-D shards there) must fail with a message that
    names the problem (issue 15: "a parameter used outside its Block"), not torch's "mat2 must be a matrix"."""
    M = make(BMT)
    inner = M.Layer(D, 1)
    blk = bmt.Block(inner)
    x = rank_input(rank(), B, D)
    for what, fn in (("inner(x)", lambda: inner(x)), ("blk.lin1(x)", lambda: blk.lin1(x))):
        expect_raises(what, (RuntimeError, ValueError), fn, must_mention=("Block",))
    with torch.no_grad():
        blk(x)  # the Block itself still works afterwards


class _AttrProbe(bmt.DistributedModule):
    """Records, at each forward, what its attributes are inside the running Block."""

    def __init__(self, sub=None):
        super().__init__()
        self.w = bmt.DistributedParameter(torch.ones(D, D) * 0.5)
        self.sub = sub
        self.seen = []
        self.fail = False

    def forward(self, x):
        d = self.__dict__
        self.seen.append({"w_published": d.get("w") is self._parameters["w"], "w_shape": tuple(self.w.shape),
                          "sub_published": self.sub is not None and d.get("sub") is self._modules["sub"]})
        if self.fail:
            raise ValueError("the probe fails on purpose")
        y = x @ self.w
        return y + self.sub(x) if self.sub is not None else y


def _unpublished(*modules):
    """No registered parameter or submodule is also an instance attribute."""
    return not any(name in m.__dict__ for m in modules for name in (*m._parameters, *m._modules))


@case
def attributes_inside_a_running_block():
    """Inside a running Block each DistributedModule's parameters and submodules are plain instance attributes (the
    full parameters, the registries' own objects); none is left after the run, after a failed run, or after the
    recompute of a checkpointed Block; the result is the same as without (BMT_BLOCK_ATTRIBUTES=0)."""
    import os
    x = rank_input(rank(), B, D, requires_grad=True)
    outs = {}
    for switch in ("1", "0"):
        os.environ["BMT_BLOCK_ATTRIBUTES"] = switch
        try:
            inner = _AttrProbe(sub=_AttrProbe())
            blk = bmt.Block(inner, use_checkpoint=True)
        finally:
            del os.environ["BMT_BLOCK_ATTRIBUTES"]
        bmt.init_parameters(blk)
        if not _unpublished(inner, inner.sub):
            raise AssertionError(f"BMT_BLOCK_ATTRIBUTES={switch}: attributes published before any run")
        out = blk(x)
        if not _unpublished(inner, inner.sub):
            raise AssertionError(f"BMT_BLOCK_ATTRIBUTES={switch}: attributes left after the forward")
        out.sum().backward()  # the recompute runs the forward again
        if not _unpublished(inner, inner.sub):
            raise AssertionError(f"BMT_BLOCK_ATTRIBUTES={switch}: attributes left after the recompute")
        want = switch == "1"
        for where, seen in (("outer", inner.seen), ("inner", inner.sub.seen)):
            if len(seen) != 2:
                raise AssertionError(f"{where}: {len(seen)} runs recorded, want 2 (forward and recompute)")
            for s in seen:
                if s["w_shape"] != (D, D):
                    raise AssertionError(f"{where}: the parameter read in the run has shape {s['w_shape']}")
                if s["w_published"] != want or (where == "outer" and s["sub_published"] != want):
                    raise AssertionError(f"BMT_BLOCK_ATTRIBUTES={switch}, {where}: published {s}, want {want}")
        inner.fail = True
        expect_raises("a failing forward", (ValueError,), lambda: blk(x), must_mention=("on purpose",))
        if not _unpublished(inner, inner.sub):
            raise AssertionError(f"BMT_BLOCK_ATTRIBUTES={switch}: attributes left after a failed run")
        outs[switch] = out.detach()
    assert_equal("the output with and without published attributes", outs["1"], outs["0"])


@case
def block_rejects_plain_parameters():
    M = make(BMT)
    e = expect_raises("bmt.Block(torch.nn.Linear(...))", (ValueError, RuntimeError),
                      lambda: bmt.Block(torch.nn.Linear(D, D).to(rank_input(0, 1).device)))
    if "DistributedParameter" not in str(e):
        raise AssertionError(f"the error does not say what to use instead (DistributedParameter): {e}")


if __name__ == "__main__":
    main()
