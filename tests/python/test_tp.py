"""ColumnParallelLinear / RowParallelLinear at tp 2 vs torch.nn.Linear (workers/w_tp.py, world 2)."""
import pytest

from launcher import run_case, worker_cases

WORKER = "w_tp"


@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_tp(launcher, case):
    run_case(launcher, WORKER, case, 2, min_world=2)
