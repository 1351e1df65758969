"""BMTrain's example/train.py logic (a GPT of VPEmbedding, Column/RowParallelLinear, OpParallelLinear and the
vocab-parallel FusedCrossEntropy, written by us) at tp 2 equals the same model unsplit in plain torch: losses,
gradients and weights over a few Adam steps (workers/w_tp_gpt.py; world 2 = tp 2, world 4 = dp 2 x tp 2)."""
import pytest

from launcher import run_case, worker_cases

WORKER = "w_tp_gpt"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_tp_gpt(launcher, case, world):
    run_case(launcher, WORKER, case, world, min_world=world)
