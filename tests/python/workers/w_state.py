"""state_dict / load_state_dict, bmt.save / bmt.load and init_parameters against plain torch."""
import math
import os

import torch

import bmtrain as bmt
from common import (OUT, assert_close, assert_equal, case, check_twins_simple, compare_state, device, expect_raises,
                    main, randn, rank, rank_input)
from models import BMT, TORCH, make
import philox_ref

D, B = 6, 3


def _check_round_trip(make_model, what):
    """keys/values of state_dict() equal the torch twin's; loading them into a differently-valued fresh model
    gives the torch twin's outputs."""
    model, ref, other = make_model(BMT, 1), make_model(TORCH, 1), make_model(BMT, 2)
    compare_state(model, ref, exact=True, what=what + ": ")
    for k, v in model.state_dict().items():
        if v.device.type != "cpu":
            raise AssertionError(f"{what}: state_dict()[{k}] is on {v.device}; BMTrain saves to the CPU")
    x = rank_input(rank(), B, D)
    with torch.no_grad():
        if torch.allclose(other(x), ref(x)):
            raise AssertionError(f"{what}: the second model already equals the first (test is vacuous)")
        res = other.load_state_dict(ref.state_dict())
        missing = getattr(res, "missing_keys", [])
        unexpected = getattr(res, "unexpected_keys", [])
        if missing or unexpected:
            raise AssertionError(f"{what}: load_state_dict reported missing {missing}, unexpected {unexpected}")
        compare_state(other, ref, exact=True, what=what + " after load: ")
        assert_close(f"{what}: output after load", other(x), ref(x))


@case
def state_dict_blocklist():
    _check_round_trip(lambda kit, s: make(kit).Net(D, 3, 10 * s), "Net with a TransformerBlockList")
    _check_round_trip(lambda kit, s: kit.blocklist([make(kit).Layer(D, 10 * s + i) for i in range(2)]),
                      "bare TransformerBlockList")


@case
def state_dict_block():
    _check_round_trip(lambda kit, s: kit.block(make(kit).Layer(D, 20 * s)), "Block")


@case
def state_dict_distributed_module():
    _check_round_trip(lambda kit, s: make(kit).Layer(D, 30 * s), "DistributedModule")


def _buffered(kit, seed):
    """A layer with a persistent buffer (used in forward) and a non-persistent one, inside blocks."""
    class Buffered(make(kit).Layer):
        def __init__(self, d, s):
            super().__init__(d, s)
            self.register_buffer("shift", randn(d, seed=s + 5))
            self.register_buffer("cache", torch.zeros(d, device=randn(1, seed=0).device), persistent=False)

        def forward(self, x):
            return super().forward(x) + self.shift
    return kit.blocklist([Buffered(D, seed), Buffered(D, seed + 1)])


@case
def state_dict_buffers():
    """Buffers inside blocks are saved and loaded (BMTrain's Block skips them on load)."""
    _check_round_trip(lambda kit, s: _buffered(kit, 90 * s), "block list with buffers")


@case
def save_load_file():
    """bmt.save writes a torch.load-able file with the unwrapped keys; bmt.load restores it into a fresh model."""
    T, M = make(TORCH), make(BMT)
    model, ref, other = M.Net(D, 2, 40), T.Net(D, 2, 40), M.Net(D, 2, 50)
    path = os.path.join(OUT, "save_load_file.pt")
    bmt.save(model, path)
    if rank() == 0:
        sd = torch.load(path, map_location="cpu")
        want = ref.state_dict()
        if list(sd.keys()) != list(want.keys()):
            raise AssertionError(f"saved keys {list(sd.keys())} != torch keys {list(want.keys())}")
        for k in want:
            assert_equal(f"saved[{k}]", sd[k], want[k])
        # The file loads into the plain torch model.
        T.Net(D, 2, 60).load_state_dict(sd)
    bmt.load(other, path)
    compare_state(other, ref, exact=True, what="after bmt.load: ")
    x = rank_input(rank(), B, D)
    with torch.no_grad():
        assert_close("output after bmt.load", other(x), ref(x))


@case
def load_shape_mismatch_names_key():
    T, M = make(TORCH), make(BMT)
    for what, model in (("Block", bmt.Block(M.Layer(D, 1))), ("DistributedModule", M.Layer(D, 1)),
                        ("Net", M.Net(D, 2, 1))):
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        key = [k for k in sd if k.endswith("lin2.weight")][0]
        sd[key] = torch.zeros(D + 1, D)
        expect_raises(f"{what}.load_state_dict with a wrong shape for {key}", (RuntimeError, ValueError),
                      lambda: model.load_state_dict(sd), must_mention=(key,))
    # Through a file and bmt.load, too.
    model = M.Net(D, 2, 1)
    sd = T.Net(D, 2, 1).state_dict()
    sd["layers.1.lin1.bias"] = torch.zeros(D + 2)
    path = os.path.join(OUT, "bad_shape.pt")
    if rank() == 0:
        torch.save(sd, path)
    bmt.synchronize()
    expect_raises("bmt.load with a wrong shape", (RuntimeError, ValueError), lambda: bmt.load(model, path),
                  must_mention=("lin1.bias",))


INITS = [  # (name, torch init function, kwargs) in the order the parameters are created
    ("normal", torch.nn.init.normal_, dict(mean=0.0, std=0.02)),
    ("xavier", torch.nn.init.xavier_normal_, {}),
    ("uniform", torch.nn.init.uniform_, dict(a=-0.5, b=0.5)),
    ("zeros", torch.nn.init.zeros_, {}),
    ("ones", torch.nn.init.ones_, {}),
    ("kaiming", torch.nn.init.kaiming_uniform_, dict(a=5 ** 0.5)),
]


def _init_model(kit):
    """Parameters with init methods, in a top-level module and in blocks of a block list."""
    class Inited(kit.Module):
        def __init__(self, shift):
            super().__init__()
            for i, (name, fn, kw) in enumerate(INITS):
                shape = (D + shift, D + i) if name in ("xavier", "kaiming") else (D + i + shift,)
                t = torch.empty(*shape, device=device())
                init = bmt.ParameterInitializer(fn, **kw) if kit.name == "bmt" else None
                setattr(self, f"p_{name}", kit.param(t, init_method=init))

        def forward(self, x):
            return x

    class Top(kit.Module):
        def __init__(self):
            super().__init__()
            self.first = Inited(0)
            self.layers = kit.blocklist([Inited(s) for s in (1, 2)])
            self.single = kit.block(Inited(3))

    return Top()


@case
def init_parameters_bit_identical():
    """Assumption (BMTrain's): init_parameters visits the parameters in model.named_parameters() order and calls
    each init_method once on a full-size tensor with the global RNG, on every rank. The reference does the same
    with torch.manual_seed(seed) and the same functions in that order."""
    seed = 2024
    model = _init_model(BMT)
    torch.manual_seed(seed)
    bmt.init_parameters(model)
    ref = _init_model(TORCH)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            kind = name.rsplit("p_", 1)[1]
            fn, kw = [(f, k) for n, f, k in INITS if n == kind][0]
            fn(p, **kw)
    compare_state(model, ref, exact=True, what="init_parameters: ")


@case
def nn_linear_like_bmtrain():
    """bmt.nn.Linear: weight (out, in) xavier_normal_, bias zeros_ (BMTrain's init, bit-identical with the same seed
    and order weight, bias); forward and gradients equal F.linear's."""
    for bias in (True, False):
        torch.manual_seed(77)
        lin = bmt.nn.Linear(5, 7, bias=bias)
        bmt.init_parameters(lin)
        torch.manual_seed(77)
        w = torch.empty(7, 5, device=device())
        torch.nn.init.xavier_normal_(w)
        sd = lin.state_dict()
        if sorted(sd) != (["bias", "weight"] if bias else ["weight"]):
            raise AssertionError(f"bmt.nn.Linear(bias={bias}) state_dict keys {sorted(sd)}")
        assert_equal("bmt.nn.Linear weight init", sd["weight"], w.cpu())
        if bias:
            assert_equal("bmt.nn.Linear bias init", sd["bias"], torch.zeros(7))
        ref = torch.nn.Linear(5, 7, bias=bias).to(device())
        ref.load_state_dict({k: v.to(device()) for k, v in sd.items()})
        check_twins_simple(lin, ref, (B, 5))


@case
def parameter_without_init_keeps_data():
    """A DistributedParameter made from data, without init_method, keeps that data through init_parameters."""
    model, ref = make(BMT).Net(D, 2, 70), make(TORCH).Net(D, 2, 70)
    bmt.init_parameters(model)
    compare_state(model, ref, exact=True, what="no init_method: ")


@case
def init_parameters_builtin_sharded():
    """bmt.param_init's initialisers on meta-device parameters (no full tensor anywhere): every rank fills only its
    shard, and the gathered values equal the closed-form stream (philox_ref, by name and logical index) at every
    world size, so worlds 1, 2 and 4 agree bit for bit. A Python callable next to them keeps torch's generator."""
    pi = bmt.param_init

    def meta(*shape, dtype=torch.float32):
        return torch.empty(*shape, device="meta", dtype=dtype)

    class L(bmt.DistributedModule):
        def __init__(self):
            super().__init__()
            self.w = bmt.DistributedParameter(meta(7, 5), init_method=pi.normal(0.25, 0.5))
            self.b = bmt.DistributedParameter(meta(11, dtype=torch.bfloat16), init_method=pi.uniform(-2.0, 1.0))
            self.x = bmt.DistributedParameter(meta(3, 4), init_method=pi.xavier_normal(1.5))
            self.y = bmt.DistributedParameter(meta(6, 2), init_method=pi.xavier_uniform())
            self.c = bmt.DistributedParameter(meta(5), init_method=pi.ones())
            self.t = bmt.DistributedParameter(meta(4, 3), init_method=torch.nn.init.normal_)

        def forward(self, h):
            return h

    class Top(bmt.DistributedModule):
        def __init__(self):
            super().__init__()
            self.first = L()
            self.layers = bmt.TransformerBlockList([bmt.Block(L()) for _ in range(2)])

    model = Top()
    torch.manual_seed(9)
    bmt.init_parameters(model, seed=123)
    torch.manual_seed(9)
    sd = model.state_dict()
    for name in sd:  # named_parameters order: the torch-generator ones draw in this order
        leaf = name.rsplit(".", 1)[1]
        shape = tuple(sd[name].shape)
        if leaf == "w":
            want = philox_ref.reference(name, shape, torch.float32, "normal", 0.25, 0.5, 123)
        elif leaf == "b":
            want = philox_ref.reference(name, shape, torch.bfloat16, "uniform", -2.0, 3.0, 123)
        elif leaf == "x":
            want = philox_ref.reference(name, shape, torch.float32, "normal", 0.0, philox_ref.xavier_std(shape, 1.5), 123)
        elif leaf == "y":
            bound = math.sqrt(3.0) * philox_ref.xavier_std(shape, 1.0)
            want = philox_ref.reference(name, shape, torch.float32, "uniform", -bound, 2 * bound, 123)
        elif leaf == "c":
            want = torch.ones(shape)
        else:
            want = torch.empty(shape, device=device())
            torch.nn.init.normal_(want)
        assert_equal(f"init {name}", sd[name], want.cpu())


if __name__ == "__main__":
    main()
