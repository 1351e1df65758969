"""PipelineTransformerBlockList at pp 2 (world 2) and pp 2 x dp 2 (world 4) vs plain torch (workers/w_pipe.py)."""
import pytest

from launcher import run_case, worker_cases

WORKER = "w_pipe"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_pipe(launcher, case, world):
    run_case(launcher, WORKER, case, world, min_world=world)
