"""BMTrain drop-in behaviours of issue 31 (optimizers, schedulers, state dicts, nccl / store / loss._function /
utils / benchmark / zero_context, save / load, inspect) vs plain torch and closed forms (workers/w_dropin_optim.py,
worlds 1, 2, 4)."""
import pytest

from launcher import run_case, worker_cases

WORKER = "w_dropin_optim"


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_dropin_optim(launcher, case, world):
    run_case(launcher, WORKER, case, world)
