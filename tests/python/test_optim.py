"""optimizers, OptimManager, resume and LR schedulers vs torch.optim / BMTrain formulas (workers/w_optim.py, worlds 1, 2, 4)."""
import pytest

from launcher import run_case, worker_cases

WORKER = "w_optim"


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_optim(launcher, case, world):
    run_case(launcher, WORKER, case, world)
