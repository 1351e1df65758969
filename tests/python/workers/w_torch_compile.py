"""torch.compile of the module inside a bmt.Block (inductor on CPU): the same outputs, gradients and trained
parameters as the eager Block over several steps (the gathered parameters are fresh buffers at every run, so a
compiled graph that kept old ones would diverge), with and without checkpointing."""
import torch

import bmtrain as bmt
from common import assert_close, case, check_twins_simple, device, load_into_ref, main, rank
from torchops_models import BLayer, RefList, TLayer

DIM, HEADS, LAYERS = 32, 4, 2
LR = 1e-2


def _model(compiled, use_checkpoint):
    layers = [BLayer(DIM, HEADS, 10 + i) for i in range(LAYERS)]
    if compiled:
        for m in layers:
            m.compile()  # in place: parameter names (and checkpoints) stay those of the eager module
    return bmt.TransformerBlockList([bmt.Block(m, use_checkpoint=use_checkpoint) for m in layers])


def _x(step):
    g = torch.Generator().manual_seed(1000 * step + rank())
    return torch.randn(2, 8, DIM, generator=g).to(device())


@case
def compiled_block_matches_eager():
    for ckpt in (False, True):
        models = {c: _model(c, ckpt) for c in (False, True)}
        ref = RefList([TLayer(DIM, HEADS, 10 + i) for i in range(LAYERS)])
        load_into_ref(models[True], ref)
        check_twins_simple(models[True], ref, (2, 8, DIM), what=f"compiled, checkpoint={ckpt}: ")
        managers = {}
        for c, m in models.items():
            opt = bmt.optim.AdamOptimizer(m.parameters(), lr=LR)
            managers[c] = bmt.optim.OptimManager(loss_scale=None)
            managers[c].add_optimizer(opt)
        for step in range(3):
            outs = {}
            for c, m in models.items():
                managers[c].zero_grad()
                y = m(_x(step))
                managers[c].backward((y * y).mean())
                managers[c].step()
                outs[c] = y.detach()
            assert_close(f"checkpoint={ckpt} step {step}: output", outs[True], outs[False], rtol=1e-4, atol=1e-5)
        # Adam divides by sqrt(v): an element whose gradient is near zero moves by up to lr per step whatever its
        # size, so the fused kernels' rounding (inductor's against the engine's on GPUs) can move it by a fraction
        # of lr; a stale-parameter bug moves the outputs above, and the parameters by many lr
        eager = dict(models[False].named_parameters())
        for n, p in models[True].named_parameters():
            assert_close(f"checkpoint={ckpt}: trained {n}", p, eager[n], rtol=1e-4, atol=0.25 * LR)
        if sorted(models[True].state_dict()) != sorted(models[False].state_dict()):
            raise AssertionError("compiling the inner modules changed the state_dict keys")


if __name__ == "__main__":
    main()
