"""Block and TransformerBlockList against plain torch: outputs, input and parameter gradients.

Data parallelism: rank r feeds its own micro-batch x_r; a plain `loss.backward()` leaves the gradient summed over
ranks (BMTrain), so the reference runs every rank's micro-batch through the torch twin and accumulates.
"""
import torch
import torch.nn.functional as F

import bmtrain as bmt
from common import (Skip, assert_close, assert_equal, case, compare_grads, compare_state, expect_raises,  # noqa: F401
                    full_grad, local_shard_range, main, randn, rank, rank_input, world)
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
    """A dict output comes back as the same dict (the package returns any pytree unchanged)."""
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
    T, M = make(TORCH), make(BMT)
    out = check_twins(bmt.Block(M.ListLayer(D, 3)), T.ListLayer(D, 3), lambda m, x: m(x), [(B, D)], what="list")
    if not isinstance(out, list) or len(out) != 10:
        raise AssertionError(f"Block returned {type(out).__name__} of {len(_tensors(out))}; the module returns a "
                             "10-item list and issue 15 asks for it unchanged")


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
    g = dict(blk.named_parameters())[frozen].grad
    if g is not None and g.count_nonzero().item() != 0:
        raise AssertionError("a parameter with requires_grad=False got a non-zero .grad")
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


@case
def block_bf16():
    """bf16 parameters in a block list: outputs vs the bf16 torch twin, fp32 main gradients (bmt.main_grad) vs
    torch's bf16 gradients (bf16 tolerances)."""
    T, M = make(TORCH_BF16), make(BMT_BF16)
    model = bmt.TransformerBlockList([M.Layer(D * 4, 600 + 10 * i) for i in range(2)])
    ref = TORCH.blocklist([T.Layer(D * 4, 600 + 10 * i) for i in range(2)])
    x = rank_input(rank(), B, D * 4).to(torch.bfloat16)
    y = model(x)
    if y.dtype != torch.bfloat16:
        raise AssertionError(f"bf16 block list returned {y.dtype}")
    (y.float() * randn(B, D * 4, seed=9)).sum().backward()
    for r in range(world()):
        y_ref = ref(rank_input(r, B, D * 4).to(torch.bfloat16))
        (y_ref.float() * randn(B, D * 4, seed=9)).sum().backward()
        if r == rank():
            assert_close("bf16 output", y, y_ref, rtol=2e-2, atol=2e-2)
    compare_grads(model, ref, rtol=5e-2, atol=5e-2, what="bf16 main_grad ", main=True)


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


@case
def block_rejects_plain_parameters():
    M = make(BMT)
    layer = M.Layer(D, 1)
    expect_raises("the same module twice in one TransformerBlockList", (ValueError, RuntimeError, AssertionError),
                  lambda: bmt.TransformerBlockList([layer, layer]))
    e = expect_raises("bmt.Block(torch.nn.Linear(...))", (ValueError, RuntimeError),
                      lambda: bmt.Block(torch.nn.Linear(D, D).to(rank_input(0, 1).device)))
    if "DistributedParameter" not in str(e):
        raise AssertionError(f"the error does not say what to use instead (DistributedParameter): {e}")


if __name__ == "__main__":
    main()
