"""PipelineTransformerBlockList at pp 2 (world 2) vs plain torch (workers/w_pipe.py). pp 2 x dp 2 (world 4, the
training comparison) costs 4 more processes: it runs with BMT_TEST_PIPE_WORLD4=1 (CI's time budget keeps it out)."""
import os

import pytest

from launcher import run_case, worker_cases

WORKER = "w_pipe"
WORLDS = [2, 4] if os.environ.get("BMT_TEST_PIPE_WORLD4") == "1" else [2]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_pipe(launcher, case, world):
    run_case(launcher, WORKER, case, world, min_world=world)
