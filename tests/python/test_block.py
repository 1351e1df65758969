"""Block and TransformerBlockList vs plain torch (workers/w_block.py, worlds 1, 2, 4)."""
import pytest

from launcher import run_case, worker_cases

WORKER = "w_block"


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_block(launcher, case, world):
    run_case(launcher, WORKER, case, world)
