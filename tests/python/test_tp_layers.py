"""bmt.nn's tensor-parallel layers (the C++ layers, bound) against the unsplit layers in plain torch
(workers/w_tp_layers.py): world 2 (tp 2) and world 4 (dp 2 x tp 2)."""
import pytest

from launcher import run_case, worker_cases

WORKER = "w_tp_layers"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_tp_layers(launcher, case, world):
    run_case(launcher, WORKER, case, world, min_world=world)
