"""bmt.save_checkpoint / bmt.load_checkpoint as a user meets them: asynchronous saves, bf16 models resumed at
another world size and tensor-parallel size, and every error path with its exception type and message.

Launched by test_checkpoint.py with $BMT_CKPT_DIR (shared by the launches) and $BMT_CKPT_TP (tp_size).
`ckpt_async_save` (world 2, tp 1): a bf16 tensor-parallel MLP trains 2 steps; save_checkpoint(async_save=True)
returns while the files are written, and the model trains 2 more steps before the handle is waited for; the files
must hold the state at the save (rank 0 keeps that state and the final one in .pt files).
`ckpt_resume_*` (any world / tp): a fresh model (other seed) loads the checkpoint: its bf16 parameters are the
saved ones bit for bit, and 2 more steps reach the saved run's final state (within 2 bf16 ulps: another world or tp
size sums in another order).
`ckpt_errors`: a missing directory, a flipped byte, a truncated and a deleted shard file, a model with a missing
and an extra key (strict and strict=False).
"""
import os
import shutil

import torch
import torch.nn.functional as F

import bmtrain as bmt
from common import assert_equal, case, compare_state, main, rank, world

IN, HID, OUT, G = 8, 16, 8, 8  # G rows per step over all ranks
DIR = os.environ.get("BMT_CKPT_DIR", "/tmp/bmt_ckpt")
TP = int(os.environ.get("BMT_CKPT_TP", "1"))
CKPT = os.path.join(DIR, "ckpt")
BF16_ULP = 2.0 ** -7  # bf16 keeps 8 significant bits: one ulp is 2^-7 relative at the bottom of a binade


class MLP(bmt.DistributedModule):
    def __init__(self, extra=False):
        super().__init__()
        self.up = bmt.nn.ColumnParallelLinear(IN, HID, bias=True, dtype=torch.bfloat16, gather_input=True,
                                              gather_output=False)
        self.down = bmt.nn.RowParallelLinear(HID, OUT, bias=True, dtype=torch.bfloat16)
        if extra:  # a model that does not match the checkpoint: one key more
            self.extra = bmt.nn.Linear(OUT, OUT, dtype=torch.bfloat16)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def _setup(seed, extra=False):
    torch.manual_seed(seed)
    model = MLP(extra)
    bmt.init_parameters(model)
    opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
    sched = bmt.lr_scheduler.Noam(opt, start_lr=1e-2, warmup_iter=2, end_iter=100, num_iter=0)
    om = bmt.optim.OptimManager(loss_scale=None)
    om.add_optimizer(opt, sched)
    return model, om


def _steps(model, om, first, n):
    """The same objective at every world and tp size: one global batch of G rows split over the ranks in rank
    order (under tp each rank also feeds its own rows: the sequence-parallel layout), each rank's loss the mean
    over its rows; the OptimManager averages over the ranks."""
    rows = G // world()
    for step in range(first, first + n):
        torch.manual_seed(500 + step)
        x = torch.randn(G, IN).to(torch.bfloat16)
        out = model(x[rank() * rows:(rank() + 1) * rows].to(bmt.config["device"]))
        om.zero_grad()
        om.backward(out.float().pow(2).sum() / rows)
        om.step()


class _Held(torch.nn.Module):  # compare_state wants a module
    def __init__(self, state):
        super().__init__()
        self._state = state

    def state_dict(self):
        return self._state


@case
def ckpt_async_save():
    model, om = _setup(31)
    _steps(model, om, 0, 2)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    handle = bmt.save_checkpoint(CKPT, model, om, step=2, async_save=True)
    _steps(model, om, 2, 2)  # training goes on while the files are written
    stats = handle.wait()
    if not stats["dir"].endswith("ckpt") or stats["rank_nbytes"] <= 0:
        raise AssertionError(f"SaveHandle.wait() returned {stats}")
    final = model.state_dict()
    if rank() == 0:
        torch.save({"at_save": at_save, "final": final, "world": world()}, os.path.join(DIR, "saved.pt"))
    if at_save["up.weight"].dtype != torch.bfloat16:
        raise AssertionError(f"the model is not bf16: {at_save['up.weight'].dtype}")
    bmt.synchronize()


def _resume():
    saved = torch.load(os.path.join(DIR, "saved.pt"), weights_only=False)
    model, om = _setup(32)  # other initial values: everything must come from the checkpoint
    info = bmt.load_checkpoint(CKPT, model, om)
    if info["step"] != 2 or info["saved_world_size"] != saved["world"]:
        raise AssertionError(f"load_checkpoint returned {info}; expected step 2 at world {saved['world']}")
    got = model.state_dict()
    for k, v in saved["at_save"].items():  # the state at the save, not the 2 steps after it
        assert_equal(f"{k} after load_checkpoint at world {world()}, tp {TP}", got[k], v)
    _steps(model, om, 2, 2)
    compare_state(model, _Held(saved["final"]), rtol=2 * BF16_ULP, atol=2 * BF16_ULP * 1e-2,
                  what=f"2 steps after resuming at world {world()}, tp {TP}: ")


@case
def ckpt_resume_other_world():
    """World 1 (launched at 1 rank, tp 1) or world 2 at tp 2: the launch decides."""
    _resume()


def _expect_error(what, fn, fragments):
    try:
        fn()
    except RuntimeError as e:  # bmtrain's errors reach Python as RuntimeError (never a crash or a hang)
        msg = str(e)
        for f in fragments:
            if f not in msg:
                raise AssertionError(f"{what}: the error lacks {f!r}: {msg}")
        return msg
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{what}: {type(e).__name__} instead of RuntimeError: {e}")
    raise AssertionError(f"{what}: no error")


def _damaged_copy(name, damage):
    path = os.path.join(DIR, f"{name}_w{world()}_tp{TP}")
    if rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(CKPT, path)
        damage(path)
    bmt.synchronize()
    return path


def _flip(path):
    f = os.path.join(path, "rank-00000.bin")
    data = bytearray(open(f, "rb").read())
    mid = len(data) // 2
    for i in range(mid - 8, mid + 8):
        data[i] ^= 0xFF
    open(f, "wb").write(bytes(data))


def _truncate(path):
    f = os.path.join(path, "rank-00001.bin")
    os.truncate(f, os.path.getsize(f) // 2)


@case
def ckpt_errors():
    model, om = _setup(33)
    missing = os.path.join(DIR, "no_such_checkpoint")
    _expect_error("missing directory", lambda: bmt.load_checkpoint(missing, model, om),
                  ["cannot load checkpoint " + missing, "no such directory"])
    flipped = _damaged_copy("flipped", _flip)
    _expect_error("flipped bytes", lambda: bmt.load_checkpoint(flipped, model, om),
                  ["checksum mismatch", "rank-00000.bin"])
    truncated = _damaged_copy("truncated", _truncate)
    _expect_error("truncated shard", lambda: bmt.load_checkpoint(truncated, model, om),
                  [truncated + "/rank-00001.bin", "truncated"])
    deleted = _damaged_copy("deleted", lambda p: os.remove(os.path.join(p, "rank-00001.bin")))
    _expect_error("deleted shard", lambda: bmt.load_checkpoint(deleted, model, om),
                  ["missing shard file " + deleted + "/rank-00001.bin"])
    # A model with one module more: strict names the keys and the way out; strict=False loads the rest.
    bigger, om2 = _setup(34, extra=True)
    _expect_error("strict load into a bigger model", lambda: bmt.load_checkpoint(CKPT, bigger, om2),
                  ["missing model keys: extra.weight", "extra.bias"])
    bigger, _ = _setup(34, extra=True)
    info = bmt.load_checkpoint(CKPT, bigger, strict=False)
    if sorted(info["missing_keys"]) != ["extra.bias", "extra.weight"] or info["unexpected_keys"]:
        raise AssertionError(f"strict=False reported {info['missing_keys']} / {info['unexpected_keys']}")
    saved = torch.load(os.path.join(DIR, "saved.pt"), weights_only=False)
    got = bigger.state_dict()
    for k, v in saved["at_save"].items():
        assert_equal(f"{k} loaded with strict=False", got[k], v)
    # And the other way: a smaller model than the checkpoint (the checkpoint's extra keys are unexpected).
    if rank() == 0:
        shutil.rmtree(os.path.join(DIR, f"big_w{world()}_tp{TP}"), ignore_errors=True)
    bmt.synchronize()
    bmt.save_checkpoint(os.path.join(DIR, f"big_w{world()}_tp{TP}"), bigger, step=1)
    small, _ = _setup(35)
    _expect_error("strict load of a bigger checkpoint", lambda: bmt.load_checkpoint(
        os.path.join(DIR, f"big_w{world()}_tp{TP}"), small), ["unexpected model keys: extra.", "strict = false"])
    info = bmt.load_checkpoint(os.path.join(DIR, f"big_w{world()}_tp{TP}"), small, strict=False)
    if sorted(info["unexpected_keys"]) != ["extra.bias", "extra.weight"] or info["missing_keys"]:
        raise AssertionError(f"strict=False reported {info['missing_keys']} / {info['unexpected_keys']}")


if __name__ == "__main__":
    main(dict(tp_size=TP))
