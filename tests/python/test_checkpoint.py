"""bmt.save_checkpoint / bmt.load_checkpoint (workers/w_ckpt.py): an async save of a bf16 tensor-parallel model at
world 2, resumed at world 1 and at world 2 with tp 2, and every error path with its exception type and message."""
import pytest

import launcher


def _launch(d, cases, world, tp, name):
    nproc = launcher.effective_world(world)
    if nproc < world:
        pytest.skip(f"needs {world} ranks, this device variant gives {nproc}")
    out_dir = str(d / name)
    rc, out, timed_out = launcher.run_torchrun(launcher.os.path.join(launcher.WORKERS, "w_ckpt.py"), [cases],
                                               nproc, extra_env={"BMT_CKPT_DIR": str(d), "BMT_CKPT_TP": str(tp)},
                                               out_dir=out_dir)
    return launcher.LaunchResult("w_ckpt", nproc, nproc, rc, out, timed_out, launcher.read_results(out_dir, nproc))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    return d, _launch(d, "ckpt_async_save", 2, 1, "save")


def test_async_save_of_a_bf16_model(saved):
    saved[1].check("ckpt_async_save")


@pytest.mark.parametrize("world,tp", [(1, 1), (2, 2)])
def test_resume_at_another_world_and_tp_size(saved, world, tp):
    d, res = saved
    res.check("ckpt_async_save")
    _launch(d, "ckpt_resume_other_world", world, tp, f"resume_w{world}_tp{tp}").check("ckpt_resume_other_world")


@pytest.mark.parametrize("world", [1, 2])
def test_error_paths(saved, world):
    d, res = saved
    res.check("ckpt_async_save")
    _launch(d, "ckpt_errors", world, 1, f"errors_w{world}").check("ckpt_errors")
