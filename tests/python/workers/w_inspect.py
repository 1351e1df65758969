"""bmt.inspect.inspect_tensor / record_tensor / format_summary against plain torch.

Every rank runs its own micro-batch through Blocks whose layer records its output; the reference runs every rank's
batch through the torch twin with retain_grad() and pools the statistics over the concatenated batch (exact
pooled statistics over the world, shape dim 0 times the world size).
"""
import torch

import bmtrain as bmt
from common import case, expect_raises, main, rank, rank_input, world
from models import BMT, TORCH, make

D, B, L = 6, 3, 3


def _recording(kit):
    base = make(kit).Layer

    class Rec(base):
        def forward(self, x):
            y = super().forward(x)
            bmt.inspect.record_tensor(y, "hidden", group="enc")
            return y

    return Rec


def _reference():
    """Per layer: (hidden over every rank's batch, its gradient)."""
    Rec = _recording(TORCH)
    layers = [Rec(D, 10 * i) for i in range(L)]
    hs = [[] for _ in range(L)]
    for r in range(world()):
        h = rank_input(r, B, D, seed=3)
        for i, layer in enumerate(layers):
            h = layer(h)
            h.retain_grad()
            hs[i].append(h)
        (h * h).sum().backward()
    return [(torch.cat([t.detach() for t in hs[i]]), torch.cat([t.grad for t in hs[i]])) for i in range(L)]


def _check_rows(rows, ref, what):
    if [r["name"] for r in rows] != [f"enc.{i}.hidden" for i in range(L)]:
        raise AssertionError(f"{what}: names {[r['name'] for r in rows]}")
    for row, (v, g) in zip(rows, ref):
        if tuple(row["shape"]) != (B * world(), D):
            raise AssertionError(f"{what}: shape {row['shape']}")
        if sorted(row) != sorted(["name", "min", "max", "mean", "std", "shape", "grad_mean", "grad_std"]):
            raise AssertionError(f"{what}: row keys {sorted(row)} are not BMTrain's")
        for key, want in (("mean", v.mean()), ("std", v.std()), ("min", v.min()), ("max", v.max()),
                          ("grad_mean", g.mean()), ("grad_std", g.std())):
            got = row[key]
            if got is None or abs(got - want.item()) > 1e-5 * max(1.0, abs(want.item())):
                raise AssertionError(f"{what} {row['name']} {key}: {got} vs {want.item()}")


def _run(use_checkpoint, as_list):
    Rec = _recording(BMT)
    blocks = [bmt.Block(Rec(D, 10 * i), use_checkpoint=use_checkpoint) for i in range(L)]
    model = bmt.TransformerBlockList(blocks) if as_list else None
    x = rank_input(rank(), B, D, seed=3, requires_grad=True)
    with bmt.inspect.inspect_tensor() as inspector:
        h = model(x) if as_list else x
        if not as_list:
            for b in blocks:
                h = b(h)
        (h * h).sum().backward()
    if len(inspector) != L:
        raise AssertionError(f"checkpoint={use_checkpoint}: {len(inspector)} records, want {L} (one per forward)")
    return inspector


@case
def record_tensor_in_blocks():
    ref = _reference()
    for use_checkpoint in (True, False):
        for as_list in (False, True):
            what = f"checkpoint={use_checkpoint} list={as_list}"
            inspector = _run(use_checkpoint, as_list)
            _check_rows(inspector.summary, ref, what)
            _check_rows(inspector.get_summary(), ref, what + " (get_summary)")
            mine = inspector.get_tensor("hidden", group="enc", index=1)
            want = ref[1][0][rank() * B:(rank() + 1) * B].to(mine.device)
            if not torch.allclose(mine, want, rtol=1e-5, atol=1e-6):
                raise AssertionError(f"{what}: get_tensor differs from the reference")


@case
def record_tensor_outside_and_parameters():
    bmt.inspect.record_tensor(torch.ones(2), "ignored")  # no scope: nothing happens
    with bmt.inspect.inspect_tensor() as inspector:
        expect_raises("recording a Parameter", RuntimeError,
                      lambda: bmt.inspect.record_tensor(torch.nn.Parameter(torch.ones(2)), "w"), ["Parameter"])
        bmt.inspect.record_tensor(torch.full((2, 2), float(rank() + 1)), "plain")
    rows = inspector.summary
    if len(rows) != 1 or rows[0]["name"] != "0.plain" or rows[0]["grad_mean"] is not None:
        raise AssertionError(f"rows {rows}")
    want_mean = sum(r + 1 for r in range(world())) / world()
    if abs(rows[0]["mean"] - want_mean) > 1e-9 or rows[0]["max"] != world() or rows[0]["min"] != 1:
        raise AssertionError(f"pooled statistics {rows[0]}, want mean {want_mean}")


@case
def format_summary_table():
    """BMTrain's inspect/format.py table: each cell one space then the value, left-aligned in its column (name:
    longest name + 4, shape 20, the rest 10), floats with 4 decimals, None as "None"."""
    rows = [{"name": "w", "shape": (3,), "max": 2.0, "min": -1.0, "std": 0.25, "mean": 0.5, "grad_std": None,
             "grad_mean": None},
            {"name": "layer.bias", "shape": (2, 3), "max": 2.0, "min": -1.0, "std": 0.25, "mean": 0.5,
             "grad_std": 1.0, "grad_mean": 0.125}]
    want = "\n".join([
        " name          shape               max       min       std       mean      grad_std  grad_mean",
        " w             (3,)                2.0000    -1.0000   0.2500    0.5000    None      None     ",
        " layer.bias    (2, 3)              2.0000    -1.0000   0.2500    0.5000    1.0000    0.1250   "])
    got = bmt.inspect.format_summary(rows)
    if got != want:
        raise AssertionError(f"format_summary:\n{got!r}\nwant:\n{want!r}")


if __name__ == "__main__":
    main()
