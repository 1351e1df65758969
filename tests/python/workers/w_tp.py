"""ColumnParallelLinear / RowParallelLinear at tp 2 against torch.nn.Linear (launched with 2 ranks, tp_size=2).

BMTrain's layout (bmtrain.md 2.14): activations between TP layers are split along dim 0 (sequence parallel).
ColumnParallelLinear(gather_input=True) all-gathers the ranks' rows (rank-major) and computes its slice of the
output features; RowParallelLinear (default: reduce-scatter output) sums the partial products and hands rank r
its chunk of rows. The references use the full weights that state_dict() returns (TP-merged, full shapes).
"""
import os

import torch
import torch.nn.functional as F

import bmtrain as bmt
import philox_ref
from common import (OUT as OUT_DIR, Skip, assert_close, assert_equal, case, compare_state, device, main, rank,
                    rank_input, world)

IN, HID, OUT, R = 6, 8, 5, 4  # R rows per rank (divisible by the chunk counts)


def _tp():
    return bmt.config["tp_size"], bmt.config["tp_rank"]


def _piece_grad(p, name):
    """Gradient of this TP rank's piece (ZeRO over tp_zero_comm, of size 1 at world 2 / tp 2)."""
    if bmt.config["tp_zero_size"] != 1:
        raise Skip("piece gradients are read directly only when tp_zero_size == 1")
    shape = tuple(getattr(p, "_original_shape", p.shape))
    if p.grad is None:
        raise AssertionError(f"{name}: no gradient")
    return p.grad.detach().float().reshape(shape)


def _split(t, dim, tp, r):
    return t.chunk(tp, dim)[r]


class MLP(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.up = bmt.nn.ColumnParallelLinear(IN, HID, bias=True, gather_input=True, gather_output=False)
        self.down = bmt.nn.RowParallelLinear(HID, OUT, bias=True)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class RefMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(IN, HID)
        self.down = torch.nn.Linear(HID, OUT)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def _ref_from(model, ref):
    ref.to(device()).load_state_dict({k: v.to(device()) for k, v in model.state_dict().items()})
    compare_state(model, ref, what="TP state_dict (full shapes): ")
    return ref


@case
def config_tp():
    tp, tp_rank = _tp()
    if tp != 2 or tp_rank != rank() % 2 or bmt.config["tp_zero_size"] != world() // 2:
        raise AssertionError(f"config: tp_size {tp}, tp_rank {tp_rank}, tp_zero_size {bmt.config['tp_zero_size']} "
                             f"at rank {rank()} of {world()}")


@case
def sequence_parallel_mlp():
    """Column(gather_input) -> gelu -> Row(reduce-scatter): rank r's output rows equal torch's on all rows."""
    tp, me = _tp()
    if world() != tp:
        raise Skip("checked at world == tp")
    for in_block, chunks in ((False, 0), (True, 0), (False, 2), (True, 2)):
        # chunks 2: the overlapped gather/GEMM and chunked GEMM/reduce-scatter (BMT_TP_OVERLAP_CHUNKS's switch)
        bmt._C.tp.set_overlap_chunks(chunks)
        torch.manual_seed(5)
        model = bmt.Block(MLP()) if in_block else MLP()
        bmt.init_parameters(model)
        ref = _ref_from(model, RefMLP())
        x = rank_input(me, R, IN, requires_grad=True)
        y = model(x)
        up_g = rank_input(me, R, OUT, seed=7)
        (y * up_g).sum().backward()
        xs = [rank_input(r, R, IN, requires_grad=True) for r in range(tp)]
        y_ref = ref(torch.cat(xs))
        loss = sum((y_ref[r * R:(r + 1) * R] * rank_input(r, R, OUT, seed=7)).sum() for r in range(tp))
        loss.backward()
        what = ("in a Block" if in_block else "plain") + (f", overlap chunks {chunks}" if chunks else "")
        assert_close(f"{what}: output rows of rank {me}", y, y_ref[me * R:(me + 1) * R])
        assert_close(f"{what}: input grad", x.grad, xs[me].grad)
        params = dict(model.named_parameters())
        assert_close(f"{what}: up.weight grad piece", _piece_grad(params["up.weight"], "up.weight"),
                     _split(ref.up.weight.grad, 0, tp, me))
        assert_close(f"{what}: up.bias grad piece", _piece_grad(params["up.bias"], "up.bias"),
                     _split(ref.up.bias.grad, 0, tp, me))
        assert_close(f"{what}: down.weight grad piece", _piece_grad(params["down.weight"], "down.weight"),
                     _split(ref.down.weight.grad, 1, tp, me))
        # The replicated bias sees only this rank's rows; torch's gradient sums all rows.
        assert_close(f"{what}: down.bias grad (all rows)", _piece_grad(params["down.bias"], "down.bias"),
                     ref.down.bias.grad)
    bmt._C.tp.set_overlap_chunks(0)


@case
def tp_save_load_round_trip():
    """bmt.save of a TP model writes full (TP-merged) tensors; bmt.load scatters them into a fresh model."""
    tp, me = _tp()
    torch.manual_seed(9)
    model = MLP()
    bmt.init_parameters(model)
    path = os.path.join(OUT_DIR, "tp_mlp.pt")
    bmt.save(model, path)
    torch.manual_seed(10)
    other = MLP()
    bmt.init_parameters(other)
    bmt.load(other, path)
    compare_state(other, model, rtol=0, atol=0, what="TP model after bmt.load: ")
    x = rank_input(me, R, IN)
    with torch.no_grad():
        assert_close("TP output after bmt.load", other(x), model(x))
    sd = torch.load(path, map_location="cpu")
    if tuple(sd["up.weight"].shape) != (HID, IN) or tuple(sd["down.weight"].shape) != (OUT, HID):
        raise AssertionError(f"saved shapes {[(k, tuple(v.shape)) for k, v in sd.items()]}")


@case
def column_gather_output():
    """Column(gather_input=True, gather_output=True): every rank gets torch's output on all ranks' rows."""
    tp, me = _tp()
    if world() != tp:
        raise Skip("checked at world == tp")
    torch.manual_seed(6)
    lin = bmt.nn.ColumnParallelLinear(IN, HID, bias=True, gather_output=True)
    bmt.init_parameters(lin)
    ref = _ref_from(lin, torch.nn.Linear(IN, HID))
    x = rank_input(me, R, IN, requires_grad=True)
    y = lin(x)
    g = rank_input(0, tp * R, HID, seed=8)  # the same downstream on every rank (replicated after the gather)
    (y * g).sum().backward()
    xs = [rank_input(r, R, IN, requires_grad=True) for r in range(tp)]
    y_ref = ref(torch.cat(xs))
    (y_ref * g).sum().backward()
    assert_close("output", y, y_ref)
    assert_close("input grad", x.grad, xs[me].grad)
    p = dict(lin.named_parameters())
    assert_close("weight grad piece", _piece_grad(p["weight"], "weight"), _split(ref.weight.grad, 0, tp, me))
    assert_close("bias grad piece", _piece_grad(p["bias"], "bias"), _split(ref.bias.grad, 0, tp, me))


@case
def row_all_reduce_output():
    """Row(all_reduce_output=True) on column-split activations: every rank gets torch's full output."""
    tp, me = _tp()
    if world() != tp:
        raise Skip("checked at world == tp")
    torch.manual_seed(7)
    lin = bmt.nn.RowParallelLinear(HID, OUT, bias=True, all_reduce_output=True)
    bmt.init_parameters(lin)
    ref = _ref_from(lin, torch.nn.Linear(HID, OUT))
    full = rank_input(0, R, HID, requires_grad=True)
    x = _split(full.detach(), 1, tp, me).clone().requires_grad_(True)
    y = lin(x)
    g = rank_input(0, R, OUT, seed=9)
    (y * g).sum().backward()
    y_ref = ref(full)
    (y_ref * g).sum().backward()
    assert_close("output", y, y_ref)
    assert_close("input grad (this rank's columns)", x.grad, _split(full.grad, 1, tp, me))
    p = dict(lin.named_parameters())
    assert_close("weight grad piece", _piece_grad(p["weight"], "weight"), _split(ref.weight.grad, 1, tp, me))


@case
def vocab_parallel_embedding_and_loss():
    """VPEmbedding lookup equals F.embedding with the full table; FusedCrossEntropy(parallel=True) on this rank's
    vocabulary slice of the logits equals torch's cross-entropy on the full logits (loss and logits gradient)."""
    tp, me = _tp()
    V, Dm = 10, 6
    torch.manual_seed(8)
    emb = bmt.nn.VPEmbedding(V, Dm, dtype=torch.float32)
    bmt.init_parameters(emb)
    table = emb.state_dict()["weight"].to(device())
    if tuple(table.shape) != (V, Dm):
        raise AssertionError(f"VPEmbedding state_dict weight shape {tuple(table.shape)}, expected {(V, Dm)}")
    ids = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(3)).to(device())
    with torch.no_grad():
        # BMTrain's: every tp rank looks up its own ids (here the same ones) in the whole table
        assert_close("VPEmbedding lookup", emb(ids), F.embedding(ids, table))
    full = rank_input(0, 8, V, seed=11).mul(2)
    target = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(4)).to(device())
    target[5] = -100
    local = _split(full, 1, tp, me).clone().requires_grad_(True)
    loss = bmt.loss.FusedCrossEntropy(parallel=True)(local, target)
    full_ref = full.clone().requires_grad_(True)
    ref = F.cross_entropy(full_ref, target)
    assert_close("parallel cross-entropy loss", loss, ref)
    loss.backward()
    ref.backward()
    assert_close("parallel cross-entropy logits grad (this rank's slice)", local.grad, _split(full_ref.grad, 1, tp, me))


@case
def init_parameters_builtin_tp():
    """Built-in initialisers on tensor-parallel pieces (split along dim 0 and dim 1) and a tp-replicated parameter:
    each rank fills its piece's shard from the logical element indices, so the merged tensors equal the closed-form
    stream of the unsplit tensor (the values a world-1 model gets)."""
    tp, _ = _tp()
    pi = bmt.param_init

    class M(bmt.DistributedModule):
        def __init__(self):
            super().__init__()
            self.rows = bmt.DistributedParameter(torch.empty(HID // tp, IN, device="meta"),
                                                 init_method=pi.normal(0.0, 1.0), tp_mode=True, tp_split_dim=0)
            self.cols = bmt.DistributedParameter(torch.empty(IN, HID // tp, device="meta", dtype=torch.bfloat16),
                                                 init_method=pi.uniform(-1.0, 1.0), tp_mode=True, tp_split_dim=1)
            self.rep = bmt.DistributedParameter(torch.empty(5, device="meta"), init_method=pi.normal(1.0, 2.0))

    m = M()
    bmt.init_parameters(m, seed=7)
    sd = m.state_dict()
    wants = {"rows": philox_ref.reference("rows", (HID, IN), torch.float32, "normal", 0.0, 1.0, 7),
             "cols": philox_ref.reference("cols", (IN, HID), torch.bfloat16, "uniform", -1.0, 2.0, 7),
             "rep": philox_ref.reference("rep", (5,), torch.float32, "normal", 1.0, 2.0, 7)}
    for name, want in wants.items():
        assert_equal(f"tp init {name}", sd[name], want)


if __name__ == "__main__":
    main(dict(tp_size=2))
