"""state_dict, save/load and init_parameters vs plain torch (workers/w_state.py, worlds 1, 2, 4)."""
import pytest

from launcher import run_case, worker_cases

WORKER = "w_state"


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_state(launcher, case, world):
    run_case(launcher, WORKER, case, world)
