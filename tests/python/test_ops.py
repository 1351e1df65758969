"""differentiable collectives, gather_result and FusedCrossEntropy vs closed forms / torch (workers/w_ops.py, worlds 1, 2, 4)."""
import pytest

from launcher import run_case, worker_cases

WORKER = "w_ops"


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_ops(launcher, case, world):
    run_case(launcher, WORKER, case, world)
