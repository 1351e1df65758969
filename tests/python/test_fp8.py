"""FP8 linears from Python against fp64 products of the cast operands (workers/w_fp8.py, worlds 1, 2)."""
import pytest

from launcher import run_case, worker_cases

WORKER = "w_fp8"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_fp8(launcher, case, world):
    run_case(launcher, WORKER, case, world)
