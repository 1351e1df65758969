"""fp32 Adam bit for bit against torch.optim.Adam / AdamW (L2 and decoupled weight decay, loss scale, hold_steps,
state_dict resume, ZeRO-sharded Blocks) and BMTrain's hold_steps count for bf16 (workers/w_adam_torch.py, worlds 1,
2)."""
import pytest

from launcher import run_case, worker_cases

WORKER = "w_adam_torch"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_adam_torch(launcher, case, world):
    run_case(launcher, WORKER, case, world)
