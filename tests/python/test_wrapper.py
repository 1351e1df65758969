"""BMTrainModelWrapper and bmt.inspect vs the unwrapped torch model (workers/w_wrapper.py, worlds 1, 2, 4)."""
import pytest

from launcher import run_case, worker_cases

WORKER = "w_wrapper"


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_wrapper(launcher, case, world):
    run_case(launcher, WORKER, case, world)
