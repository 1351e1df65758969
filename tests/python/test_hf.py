"""bmt.load_hf_safetensors vs plain torch (workers/w_hf.py, worlds 1 and 2)."""
import pytest

from launcher import run_case, worker_cases

WORKER = "w_hf"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_hf(launcher, case, world):
    run_case(launcher, WORKER, case, world)
