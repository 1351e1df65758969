"""bmt.save_checkpoint at world 2, bmt.load_checkpoint at worlds 4 and 1 (workers/w_reshard.py)."""
import pytest

import launcher


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("reshard")
    return d, launcher.run_torchrun(launcher.os.path.join(launcher.WORKERS, "w_reshard.py"), ["reshard_save"],
                                    launcher.effective_world(2), extra_env={"BMT_RESHARD_DIR": str(d)},
                                    out_dir=str(d / "save"))


def _check(out_dir, nproc, rc, output, timed_out, case):
    res = launcher.LaunchResult("w_reshard", nproc, nproc, rc, output, timed_out,
                                launcher.read_results(out_dir, nproc))
    res.check(case)


def test_save_at_world_2(saved):
    d, (rc, out, timed_out) = saved
    _check(str(d / "save"), launcher.effective_world(2), rc, out, timed_out, "reshard_save")


@pytest.mark.parametrize("world", [4, 1])
def test_resume_at_other_world(saved, world):
    d, (rc, out, timed_out) = saved
    _check(str(d / "save"), launcher.effective_world(2), rc, out, timed_out, "reshard_save")
    nproc = launcher.effective_world(world)
    out_dir = str(d / f"resume{world}")
    rc, out, timed_out = launcher.run_torchrun(launcher.os.path.join(launcher.WORKERS, "w_reshard.py"),
                                               ["reshard_control,reshard_resume"], nproc, extra_env={"BMT_RESHARD_DIR": str(d)},
                                               out_dir=out_dir)
    _check(out_dir, nproc, rc, out, timed_out, "reshard_control")  # same objective at this world size
    _check(out_dir, nproc, rc, out, timed_out, "reshard_resume")
