"""bmt.inspect.inspect_tensor / record_tensor / format_summary vs plain torch (workers/w_inspect.py, worlds 1, 2)."""
import pytest

from launcher import run_case, worker_cases

WORKER = "w_inspect"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_inspect(launcher, case, world):
    run_case(launcher, WORKER, case, world)
