"""Shared by the worker scripts: case registry and result protocol, device, references, comparisons.

A worker file defines cases with @case and ends with `main()`. `python worker.py all|name,name` runs the
selected cases in order on every rank (launched by torchrun). After each case the ranks meet at a file barrier
(a failing case on one rank may leave the others blocked in a collective: the barrier then times out and the
rank exits, so torchrun ends the launch instead of hanging). Each rank appends one JSON line per case to
$BMT_TEST_OUT/rank<r>.jsonl: {"case", "ok", "error", "skip", "seconds"}.
"""
import json
import os
import sys
import time
import traceback

import torch

import bmtrain as bmt

_CASES = []


def case(fn):
    _CASES.append(fn)
    return fn


class Skip(Exception):
    """Raised by a case that does not apply to this device variant or world size."""


OUT = os.environ.get("BMT_TEST_OUT", "/tmp/bmt_pytest_manual")
BARRIER_TIMEOUT_S = float(os.environ.get("BMT_TEST_BARRIER_TIMEOUT", "60"))


def on_cuda():
    return os.environ.get("BMT_TEST_DEVICE", "cpu") == "cuda"


def init(**kwargs):
    bmt.init_distributed(seed=kwargs.pop("seed", 1234), **kwargs)


def device():
    """The device the package keeps parameters on (bmt.config["device"] when it says; else cuda/cpu)."""
    try:
        d = bmt.config["device"]
        if d is not None:
            return torch.device(d)
    except (KeyError, TypeError):
        pass
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank():
    return bmt.rank()


def world():
    return bmt.world_size()


def _barrier(name):
    d = os.path.join(OUT, "barrier")
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, f"{name}.{rank()}"), "w").close()
    t0 = time.time()
    while True:
        if all(os.path.exists(os.path.join(d, f"{name}.{r}")) for r in range(world())):
            return
        if time.time() - t0 > BARRIER_TIMEOUT_S:
            print(f"[rank {rank()}] barrier after case {name} timed out: another rank is stuck; exiting",
                  flush=True)
            sys.stdout.flush()
            os._exit(3)
        time.sleep(0.02)


def _record(rec):
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"rank{rank()}.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def main(init_kwargs=None):
    init(**(init_kwargs or {}))
    sel = sys.argv[1] if len(sys.argv) > 1 else "all"
    names = [c.__name__ for c in _CASES] if sel == "all" else sel.split(",")
    by_name = {c.__name__: c for c in _CASES}
    any_failed = False
    for name in names:
        t0 = time.time()
        rec = {"case": name, "ok": True}
        try:
            torch.manual_seed(4321)  # each case starts from the same RNG state on every rank
            by_name[name]()
        except Skip as e:
            rec["skip"] = str(e) or "skipped"
        except BaseException:  # noqa: BLE001 - report everything, including SystemExit from the package
            rec["ok"] = False
            rec["error"] = traceback.format_exc()
            any_failed = True
            print(f"[rank {rank()}] case {name} FAILED:\n{rec['error']}", flush=True)
        rec["seconds"] = round(time.time() - t0, 3)
        _record(rec)
        if rec["ok"] and rank() == 0:
            print(f"case {name}: {'skipped' if 'skip' in rec else 'ok'} ({rec['seconds']} s)", flush=True)
        _barrier(name)
    sys.stdout.flush()
    # Results are in the files; a non-zero exit only tells torchrun something failed.
    os._exit(1 if any_failed else 0)


# ---------------------------------------------------------------------------------------------- comparisons

def assert_close(name, got, want, rtol=1e-5, atol=1e-6):
    got = got.detach().to("cpu", torch.float64)
    want = want.detach().to("cpu", torch.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != expected {tuple(want.shape)}")
    if not torch.allclose(got, want, rtol=rtol, atol=atol):
        diff = (got - want).abs()
        i = int(diff.argmax())
        raise AssertionError(f"{name}: max |diff| {diff.max().item():.3e} at flat index {i} "
                             f"(got {got.flatten()[i].item():.8g}, expected {want.flatten()[i].item():.8g}; "
                             f"rtol {rtol}, atol {atol})")


def assert_equal(name, got, want):
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
        if got.shape == want.shape:
            d = (got.double() - want.double()).abs().max().item()
            raise AssertionError(f"{name}: not bit-identical (dtype {got.dtype} vs {want.dtype}, max |diff| {d:.3e})")
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != expected {tuple(want.shape)}")


def expect_raises(what, excs, fn, must_mention=()):
    """Calls fn() and checks it raises one of `excs` whose message mentions every string in must_mention."""
    try:
        fn()
    except excs as e:
        msg = str(e)
        for s in must_mention:
            if s not in msg:
                raise AssertionError(f"{what}: raised {type(e).__name__} but the message does not name '{s}': {msg}")
        return e
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{what}: expected {[x.__name__ for x in excs]}, got {type(e).__name__}: {e}")
    raise AssertionError(f"{what}: expected {[x.__name__ for x in excs]}, nothing was raised")


# --------------------------------------------------------------------------------------------- data, grads

def randn(*shape, seed, scale=1.0):
    """Deterministic on every rank and device: drawn on the CPU from its own generator."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device())


def rank_input(r, *shape, seed=100, requires_grad=False):
    """Rank r's micro-batch; every rank can rebuild every other rank's (for the plain-torch reference)."""
    x = randn(*shape, seed=seed * 1000 + r)
    return x.requires_grad_(requires_grad)


def local_shard_range(p):
    """(begin, end) of this rank's slice of p's flattened full tensor, or None if p holds none.

    BMTrain keeps it in `_start_partition` / `_end_partition` (updated when a Block re-packs the parameter); the
    engine's own record (bmtrain._C.shard_range) is read when present, and block_shard_attributes checks that
    both agree."""
    fn = getattr(getattr(bmt, "_C", None), "shard_range", None)
    if fn is not None:
        b, e = fn(p)
    elif hasattr(p, "_start_partition"):
        b, e = p._start_partition, p._end_partition
    else:
        raise AssertionError("DistributedParameter has no _start_partition/_end_partition (BMTrain keeps them; "
                             "the tests use them to place a gradient shard in the full tensor)")
    if b is None or e is None or e <= b:
        return None
    return int(b), int(e)


def full_shape(p):
    return tuple(p._original_shape) if hasattr(p, "_original_shape") else tuple(p.shape)


def is_sharded(p):
    return isinstance(p, bmt.DistributedParameter)


def full_grad(p, name="?", main=False):
    """The full-size gradient of a DistributedParameter, assembled from the ranks' shards (fp32, on device).
    main=True reads bmt.main_grad(p) (the fp32 gradient shard, for any parameter dtype) instead of p.grad."""
    shape = full_shape(p)
    numel = 1
    for s in shape:
        numel *= s
    flat = torch.zeros(numel, dtype=torch.float32, device=device())
    g = bmt.main_grad(p) if main else p.grad
    if g is not None and g.numel() == numel and world() == 1:
        return g.detach().float().reshape(shape)
    rng = local_shard_range(p)
    if rng is not None:
        if g is None:
            g = torch.zeros(rng[1] - rng[0], device=device())
        if g.numel() != rng[1] - rng[0]:
            raise AssertionError(f"{name}: .grad has {g.numel()} elements, its shard [{rng[0]}, {rng[1]}) "
                                 f"{rng[1] - rng[0]}")
        flat[rng[0]:rng[1]] = g.detach().float().reshape(-1)
    if world() > 1:
        with torch.no_grad():
            flat = bmt.distributed.all_reduce(flat, "sum")
    return flat.reshape(shape)


def compare_grads(bmt_model, ref_model, rtol=1e-5, atol=1e-6, what="", main=False):
    """Every parameter's full gradient (bmt: assembled from shards) against the torch twin's."""
    ref = dict(ref_model.named_parameters())
    got = dict(bmt_model.named_parameters())
    if sorted(got) != sorted(ref):
        raise AssertionError(f"{what} parameter names differ: {sorted(got)} vs {sorted(ref)}")
    for name, rp in ref.items():
        p = got[name]
        if rp.grad is None:
            g = full_grad(p, name, main)
            if g.count_nonzero().item() != 0:
                raise AssertionError(f"{what}{name}: torch has no gradient, bmt has a non-zero one")
            continue
        assert_close(f"{what}grad {name}", full_grad(p, name, main), rp.grad, rtol, atol)


def compare_state(bmt_model, ref_model, exact=False, rtol=1e-5, atol=1e-6, what=""):
    """bmt state_dict() (full tensors, unwrapped keys) against the torch twin's."""
    got = bmt_model.state_dict()
    want = ref_model.state_dict()
    if list(got.keys()) != list(want.keys()):
        raise AssertionError(f"{what}state_dict keys differ:\n  bmt   {list(got.keys())}\n  torch {list(want.keys())}")
    for k in want:
        if exact:
            assert_equal(f"{what}state_dict[{k}]", got[k], want[k])
        else:
            assert_close(f"{what}state_dict[{k}]", got[k], want[k], rtol, atol)


def load_into_ref(bmt_model, ref_model):
    """Copies the bmt model's full values into its torch twin (keys must match)."""
    sd = {k: v.to(device()) for k, v in bmt_model.state_dict().items()}
    ref_model.load_state_dict(sd)


def check_twins_simple(model, ref, in_shape, what="", rtol=1e-5, atol=1e-6):
    """Output and input gradient of this rank's micro-batch, parameter gradients summed over ranks."""
    x = rank_input(rank(), *in_shape, seed=31, requires_grad=True)
    y = model(x)
    (y * randn(*y.shape, seed=32)).sum().backward()
    for r in range(world()):
        xr = rank_input(r, *in_shape, seed=31, requires_grad=True)
        yr = ref(xr)
        (yr * randn(*yr.shape, seed=32)).sum().backward()
        if r == rank():
            assert_close(f"{what}output", y, yr, rtol, atol)
            assert_close(f"{what}input grad", x.grad, xr.grad, rtol, atol)
    compare_grads(model, ref, rtol, atol, what=what)
