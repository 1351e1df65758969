"""Sharded checkpoints (bmt.save_checkpoint / bmt.load_checkpoint) resumed at another world size.

`reshard_save` (world W): 2 steps, save_checkpoint, 2 more steps, write the final full state to $BMT_RESHARD_DIR.
`reshard_resume` (any world): a fresh model loads the checkpoint and does the same 2 steps; its final state must
match. Every step uses one global batch of G rows split evenly over the ranks, and each rank's loss is the mean
over its rows, so the objective (the mean over ranks, OptimManager's grad_scale) is the same at every world size.
"""
import os

import torch

import bmtrain as bmt
from common import assert_equal, case, compare_state, main, randn, rank, world
from models import BMT, make

D, G = 6, 4  # width, global rows per step
DIR = os.environ.get("BMT_RESHARD_DIR", "/tmp/bmt_reshard")


def _setup(seed):
    model = make(BMT).Net(D, 2, seed)
    opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
    sched = bmt.lr_scheduler.Noam(opt, start_lr=1e-2, warmup_iter=2, end_iter=100, num_iter=0)
    om = bmt.optim.OptimManager(loss_scale=1024)
    om.add_optimizer(opt, sched)
    return model, om


def _steps(model, om, first, n):
    rows = G // world()
    for step in range(first, first + n):
        mine = slice(rank() * rows, (rank() + 1) * rows)
        out = model(randn(G, D, seed=500 + step)[mine])
        om.zero_grad()
        om.backward((out * randn(G, out.shape[1], seed=7)[mine]).sum() / rows)
        om.step()


@case
def reshard_save():
    model, om = _setup(21)
    _steps(model, om, 0, 2)
    bmt.save_checkpoint(os.path.join(DIR, "ckpt"), model, om, step=2)
    _steps(model, om, 2, 2)
    final = model.state_dict()
    if rank() == 0:
        torch.save({"state": final, "world": world()}, os.path.join(DIR, "final.pt"))
    bmt.synchronize()


@case
def reshard_resume():
    saved = torch.load(os.path.join(DIR, "final.pt"), weights_only=False)
    model, om = _setup(22)  # other initial values: everything must come from the checkpoint
    info = bmt.load_checkpoint(os.path.join(DIR, "ckpt"), model, om)
    if info.get("step") != 2 or info.get("saved_world_size") != saved["world"]:
        raise AssertionError(f"load_checkpoint returned {info}; expected step 2, saved_world_size {saved['world']}")
    _steps(model, om, 2, 2)
    got = model.state_dict()
    if world() == saved["world"]:
        for k, v in saved["state"].items():
            assert_equal(f"{k} resumed at the same world size", got[k], v)

    class Saved(torch.nn.Module):  # compare_state wants a module
        def state_dict(self):
            return saved["state"]
    compare_state(model, Saved(), rtol=1e-5, atol=1e-6,
                  what=f"resumed at world {world()} from world {saved['world']}: ")


@case
def reshard_control():
    """No checkpoint: 4 steps at this world size reach the saved run's final state (the objective is the same)."""
    saved = torch.load(os.path.join(DIR, "final.pt"), weights_only=False)
    model, om = _setup(21)
    _steps(model, om, 0, 4)

    class Saved(torch.nn.Module):
        def state_dict(self):
            return saved["state"]
    compare_state(model, Saved(), rtol=1e-5, atol=1e-6, what=f"4 steps at world {world()}: ")


if __name__ == "__main__":
    main()
