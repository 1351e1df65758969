"""bmt.nn's tensor-parallel layers (the C++ layers' forwards, bound) at tp 2: world 2 (tp 2) and world 4 (data
parallel 2 x tp 2, every tp piece also ZeRO-sharded), each against the same layer unsplit in plain torch, forward
and gradients; and bmt.distributed's backwards against BMTrain's closed forms.

Layouts (BMTrain's): sequence-parallel activations are split along dim 0 over tp (rank r holds chunk r). Every
data-parallel rank d has its own data; the tp ranks of one group share it. Objective: one loss per data-parallel
rank, sum(Y * G) of the unsplit layer's output Y (a replicated output: every tp rank computes it; a split one: each
tp rank its part), summed over data-parallel ranks, so parameter gradients (summed over dp by ZeRO) equal the sum of
the dense gradients over the dp ranks' data.
"""
import torch
import torch.nn.functional as F

import bmtrain as bmt
from bmtrain import _C
from common import assert_close, assert_equal, case, device, expect_raises, main, randn
from tp_util import logical_grad

R, IN, HID, OUT = 4, 6, 8, 5  # rows per tp rank


def _tp():
    return bmt.config["tp_size"], bmt.config["tp_rank"], bmt.config["tp_zero_size"], bmt.config["tp_zero_rank"]


def load_ref(layer, ref):
    ref.to(device()).load_state_dict({k: v.to(device()) for k, v in layer.state_dict().items()})
    return ref


def rows(t, tp, r):
    return t.chunk(tp, 0)[r]


def cols(t, tp, r):
    return t.chunk(tp, -1)[r]


def dense_grads(ref, make_x, make_g, dp):
    """Sum over the dp ranks' data of the dense layer's gradients; returns (grads by name, per-dp (x, y))."""
    ref.zero_grad()
    xs = []
    for d in range(dp):
        x = make_x(d).clone().requires_grad_(True)
        y = ref(x)
        (y * make_g(d)).sum().backward()
        xs.append((x, y.detach()))
    return {k: v.grad.clone() for k, v in ref.named_parameters()}, xs


def check_param_grads(layer, want, what):
    for name, p in layer.named_parameters():
        assert_close(f"{what}: {name} grad", logical_grad(p), want[name], rtol=1e-4, atol=1e-5)


@case
def column_parallel_linear():
    tp, r, dp, d = _tp()
    for gather_input in (True, False):
        for gather_output in (False, True):
            for chunks in ((0, 2) if gather_input else (0,)):
                _C.tp.set_overlap_chunks(chunks)
                what = f"column gather_input={gather_input} gather_output={gather_output} overlap={chunks}"
                torch.manual_seed(5)
                layer = bmt.nn.ColumnParallelLinear(IN, HID, bias=True, dtype=torch.float32,
                                                    gather_input=gather_input, gather_output=gather_output)
                bmt.init_parameters(layer)
                piece = tuple(layer._parameters["weight"]._original_shape)
                if piece != (HID // tp, IN):
                    raise AssertionError(f"{what}: weight piece {piece}")
                ref = load_ref(layer, torch.nn.Linear(IN, HID))
                X = lambda dd: randn(tp * R, IN, seed=10 + dd)
                G = lambda dd: randn(tp * R, HID, seed=20 + dd)
                want, dense = dense_grads(ref, X, G, dp)
                x = (rows(X(d), tp, r) if gather_input else X(d)).clone().requires_grad_(True)
                y = layer(x)
                y_want = dense[d][1] if gather_output else cols(dense[d][1], tp, r)
                assert_close(f"{what}: output", y, y_want)
                (y * (G(d) if gather_output else cols(G(d), tp, r))).sum().backward()
                gx = dense[d][0].grad
                assert_close(f"{what}: input grad", x.grad, rows(gx, tp, r) if gather_input else gx)
                check_param_grads(layer, want, what)
    _C.tp.set_overlap_chunks(0)


@case
def fp8_column_and_row_layers():
    """fp8=True (keyword-only, not in BMTrain): each rank's GEMM is bmt.nn.fp8_linear on its piece, bit for bit
    (the column layer on the gathered rows, the row layer's partial products summed over tp), and not the fp32
    product (FP8 really ran)."""
    tp, r, dp, d = _tp()
    rows_per, inf, hid = 16, 32, 64  # every GEMM dimension a multiple of 16 (the FP8 path's condition)
    torch.manual_seed(9)
    col = bmt.nn.ColumnParallelLinear(inf, hid, bias=True, dtype=torch.float32, fp8=True)
    row = bmt.nn.RowParallelLinear(hid, inf, bias=True, dtype=torch.float32, fp8=True)
    bmt.init_parameters(col)
    bmt.init_parameters(row)
    X = randn(tp * rows_per, inf, seed=60 + d)
    with torch.no_grad():
        h = col(rows(X, tp, r))
        assert_equal("fp8 column output", h, bmt.nn.fp8_linear(X, col.weight, col.bias))
        y = row(h)
        parts = bmt.distributed.all_gather(bmt.nn.fp8_linear(h, row.weight).contiguous(), bmt.config["tp_comm"])
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        assert_equal("fp8 row output", y, rows(total, tp, r) + row.bias)
        col.fp8 = row.fp8 = False
        y32 = row(col(rows(X, tp, r)))
    rel = float((y32 - y).abs().max() / y32.abs().max())
    if not 1e-4 < rel < 0.2:
        raise AssertionError(f"fp8 vs fp32 TP layers: relative difference {rel}")
    # The vocabulary-parallel head: this rank's slice of the gathered rows' logits, fp8_linear bit for bit.
    emb = bmt.nn.VPEmbedding(tp * 32, inf, dtype=torch.float32, fp8=True)
    bmt.init_parameters(emb)
    with torch.no_grad():
        lg = emb(rows(X, tp, r), projection=True)
        assert_equal("fp8 vocab-parallel projection", lg.reshape(-1, 32), bmt.nn.fp8_linear(X, emb.weight))
        emb.fp8 = False
        if torch.equal(emb(rows(X, tp, r), projection=True), lg):
            raise AssertionError("VPEmbedding(fp8=True): the projection equals the fp32 one (FP8 did not run)")


@case
def row_parallel_linear():
    tp, r, dp, d = _tp()
    for split_input in (False, True):
        for all_reduce_output in (False, True):
            for chunks in ((0, 2) if not all_reduce_output else (0,)):
                _C.tp.set_overlap_chunks(chunks)
                what = f"row split_input={split_input} all_reduce_output={all_reduce_output} overlap={chunks}"
                torch.manual_seed(6)
                layer = bmt.nn.RowParallelLinear(HID, OUT, bias=True, dtype=torch.float32, split_input=split_input,
                                                 all_reduce_output=all_reduce_output)
                bmt.init_parameters(layer)
                ref = load_ref(layer, torch.nn.Linear(HID, OUT))
                X = lambda dd: randn(tp * R, HID, seed=30 + dd)
                G = lambda dd: randn(tp * R, OUT, seed=40 + dd)
                want, dense = dense_grads(ref, X, G, dp)
                # split_input (BMTrain's): all features, rows split over tp; else this rank's features of all rows
                x = (rows(X(d), tp, r) if split_input else cols(X(d), tp, r)).clone().requires_grad_(True)
                y = layer(x)
                assert_close(f"{what}: output", y, dense[d][1] if all_reduce_output else rows(dense[d][1], tp, r))
                (y * (G(d) if all_reduce_output else rows(G(d), tp, r))).sum().backward()
                gx = dense[d][0].grad
                assert_close(f"{what}: input grad", x.grad, rows(gx, tp, r) if split_input else cols(gx, tp, r))
                check_param_grads(layer, want, what)  # the bias: every tp copy holds the unsplit gradient
    _C.tp.set_overlap_chunks(0)
    layer = bmt.nn.RowParallelLinear(HID, OUT, dtype=torch.float32)
    expect_raises("RowParallelLinear with all features and split_input=False", (RuntimeError, ValueError),
                  lambda: layer(torch.zeros(R, HID, device=device())), ["split_input"])


@case
def vp_embedding_different_ids_per_rank():
    """BMTrain's example: each tp rank embeds its chunk of the sequence (different ids per rank) and the projection
    gives (B, tp * S/tp, V/tp): the logits of the gathered rows (rank-major) for this rank's vocabulary slice."""
    tp, r, dp, d = _tp()
    V, D, B, S = 12, 6, 2, 4 * tp
    torch.manual_seed(7)
    emb = bmt.nn.VPEmbedding(V, D, dtype=torch.float32)
    bmt.init_parameters(emb)
    table = emb.state_dict()["weight"].to(device())
    weight = emb._parameters["weight"]  # the parameter (emb.weight outside a Block reads a gathered copy)
    if tuple(table.shape) != (V, D) or tuple(weight._original_shape) != (V // tp, D):
        raise AssertionError(f"VPEmbedding shapes: state_dict {tuple(table.shape)}, piece "
                             f"{tuple(weight._original_shape)}")
    ids_of = lambda dd: torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(50 + dd)).to(device())
    G = lambda dd: randn(B, S, D, seed=60 + dd)
    H = lambda dd: randn(B, S // tp * tp, D, seed=70 + dd)  # the projection's input before the split
    GL = lambda dd: randn(B * S, V, seed=80 + dd)
    td = table.clone().requires_grad_(True)
    per_dp = []
    for dd in range(dp):
        hd = H(dd).clone().requires_grad_(True)
        e = F.embedding(ids_of(dd), td)
        # BMTrain's projection layout: rank s's rows (B, S/tp) stacked rank-major, viewed (B, S, ·)
        h_rank_major = torch.cat([hd[:, s * (S // tp):(s + 1) * (S // tp)] for s in range(tp)], 0)
        logits = F.linear(h_rank_major.reshape(B, S, D), td)
        ((e * G(dd)).sum() + (logits.reshape(B * S, V) * GL(dd)).sum()).backward()
        per_dp.append((e.detach(), logits.detach(), hd))
    seq = slice(r * (S // tp), (r + 1) * (S // tp))
    ids = ids_of(d)[:, seq]
    out = emb(ids)
    assert_close("lookup of this rank's own ids", out, per_dp[d][0][:, seq])
    h = H(d)[:, seq].clone().requires_grad_(True)
    lg = emb(h, projection=True)
    if tuple(lg.shape) != (B, S, V // tp):
        raise AssertionError(f"projection shape {tuple(lg.shape)}, BMTrain's is {(B, S, V // tp)}")
    assert_close("projection (this rank's vocabulary slice)", lg, cols(per_dp[d][1], tp, r))
    ((out * G(d)[:, seq]).sum() + (lg.reshape(B * S, V // tp) * cols(GL(d), tp, r)).sum()).backward()
    assert_close("projection input grad", h.grad, per_dp[d][2].grad[:, seq])
    assert_close("table grad: every rank's tokens reach the row's owner", logical_grad(weight), td.grad,
                 rtol=1e-4, atol=1e-5)


@case
def op_parallel_linear_as_bmtrain():
    """OpParallelLinear.apply as BMTrain's example calls it (fused Q/K/V: gather_input, 7 positional arguments) and
    with an all-reduced output (the bias added on every rank before the reduction: tp x bias)."""
    tp, r, dp, d = _tp()
    torch.manual_seed(8)
    W, b = randn(HID, IN, seed=90), randn(HID, seed=91)
    X = randn(tp * R, IN, seed=92 + d)
    w_r, b_r = rows(W, tp, r).clone().requires_grad_(True), rows(b, tp, r).clone().requires_grad_(True)
    x = rows(X, tp, r).clone().requires_grad_(True)
    y = bmt.nn.OpParallelLinear.apply(x, w_r, b_r, True, False, False, None)
    assert_close("gather_input output", y, cols(F.linear(X, W, b), tp, r))
    g = randn(tp * R, HID, seed=93 + d)
    (y * cols(g, tp, r)).sum().backward()
    Xd, Wd, bd = X.clone().requires_grad_(True), W.clone().requires_grad_(True), b.clone().requires_grad_(True)
    (F.linear(Xd, Wd, bd) * g).sum().backward()
    assert_close("gather_input input grad", x.grad, rows(Xd.grad, tp, r))
    assert_close("gather_input weight grad", w_r.grad, rows(Wd.grad, tp, r))
    assert_close("gather_input bias grad", b_r.grad, rows(bd.grad, tp, r))
    # all-reduce: this rank's input features (of W^T: HID -> IN), the full bias on every rank
    w2 = cols(W.t(), tp, r).contiguous()
    x2 = cols(g, tp, r).contiguous()
    bias2 = randn(IN, seed=94)
    for reduce in (bmt.nn.ReduceType.ALL_REDUCE, 1):
        y2 = bmt.nn.OpParallelLinear.apply(x2, w2, bias2, False, False, False, reduce)
        assert_close(f"all_reduce output ({reduce!r}): x W^T + tp * b", y2, F.linear(g, W.t()) + tp * bias2)
    expect_raises("unknown reduce_output_type", (ValueError,),
                  lambda: bmt.nn.OpParallelLinear.apply(x2, w2, None, False, False, False, 7), ["reduce_output"])


if __name__ == "__main__":
    main(dict(tp_size=2))
