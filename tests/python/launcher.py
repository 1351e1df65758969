"""Launches a worker script on N ranks with torchrun and collects its per-case results.

One launch runs every case of a worker file (process start, `import torch` and `init_distributed` dominate the
cost on 2 cores, so cases are grouped); each rank appends one JSON line per case to $BMT_TEST_OUT/rank<r>.jsonl,
which the test for that case reads. A launch that exits non-zero, hangs or leaves a case unreported fails that
case with the workers' output.

Device selection (env BMT_TEST_DEVICE):
  cpu (default)  Gloo ranks, GPUs hidden (CUDA_VISIBLE_DEVICES=""), nproc = the requested world size.
  cuda           NCCL, one process per GPU, nproc = min(world size, GPU count), GPUs visible.
Timeout per launch: env BMT_TEST_TIMEOUT seconds (default 120).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers")
REPO = os.path.dirname(os.path.dirname(HERE))


def test_device():
    return os.environ.get("BMT_TEST_DEVICE", "cpu").strip().lower()


def gpu_count():
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:  # torch without CUDA
        return 0


def effective_world(world):
    """The number of ranks a launch of `world` really gets on this device variant."""
    if test_device() == "cuda":
        return max(1, min(world, gpu_count()))
    return world


def launch_env(out_dir):
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["BMT_TEST_OUT"] = out_dir
    env["PET_LOG_DIR"] = os.path.join(out_dir, "torchelastic")  # torchrun's --log-dir (else a /tmp folder it leaves)
    env["PYTHONUNBUFFERED"] = "1"
    # Workers import their helpers from workers/ (the script's own folder is on sys.path already).
    env["PYTHONPATH"] = os.pathsep.join(p for p in [WORKERS, env.get("PYTHONPATH", "")] if p)
    if test_device() != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["BMT_TEST_DEVICE"] = "cpu"
    return env


def run_torchrun(script, args, nproc, out_dir, timeout_s=None, extra_env=None):
    """Runs `torchrun --standalone --nproc_per_node nproc script args...` writing its results and logs under
    out_dir (the caller's, removed by the caller); returns (rc, output, timed_out)."""
    timeout_s = timeout_s or float(os.environ.get("BMT_TEST_TIMEOUT", "120"))
    env = launch_env(out_dir)
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           script] + list(args)
    # Own session, so a hang is ended by killing exactly this launch's process group.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -9, (out or "") + f"\n[launcher] killed after {timeout_s:.0f} s (hang or too slow)", True


def tail(text, nchars=12000):
    return text if len(text) <= nchars else "...\n" + text[-nchars:]


class LaunchResult:
    def __init__(self, worker, world, nproc, rc, output, timed_out, cases):
        self.worker, self.world, self.nproc = worker, world, nproc
        self.rc, self.output, self.timed_out = rc, output, timed_out
        self.cases = cases  # case -> {rank: record}

    def check(self, case):
        """Raises AssertionError unless every rank reported `case` as passed."""
        recs = self.cases.get(case, {})
        failed = {r: rec for r, rec in recs.items() if not rec.get("ok")}
        if failed:
            r0 = sorted(failed)[0]
            msg = failed[r0].get("error", "")
            raise AssertionError(f"{self.worker}:{case} failed on ranks {sorted(failed)} of {self.nproc} "
                                 f"(first, rank {r0}):\n{msg}\n--- workers' output (tail) ---\n{tail(self.output, 2500)}")
        if len(recs) < self.nproc:
            why = "timed out" if self.timed_out else f"exited with rc={self.rc}"
            raise AssertionError(f"{self.worker}:{case} was not reported by all {self.nproc} ranks "
                                 f"(got ranks {sorted(recs)}); the launch {why}. Workers' output:\n{tail(self.output)}")
        skipped = [rec for rec in recs.values() if rec.get("skip")]
        return skipped[0]["skip"] if skipped else None


def read_results(out_dir, nproc):
    cases = {}
    for r in range(nproc):
        path = os.path.join(out_dir, f"rank{r}.jsonl")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    rec = json.loads(line)
                    cases.setdefault(rec["case"], {})[r] = rec
    return cases


class Launcher:
    """Session-wide cache: each (worker, world) is launched once, every case test reads its result."""

    def __init__(self):
        self._results = {}
        self._dirs = []

    def result(self, worker, world, extra_args=(), extra_env=None):
        nproc = effective_world(world)
        key = (worker, nproc, tuple(extra_args))
        if key not in self._results:
            out_dir = tempfile.mkdtemp(prefix=f"bmt_{worker}_w{nproc}_")
            self._dirs.append(out_dir)
            script = os.path.join(WORKERS, worker + ".py")
            rc, output, timed_out = run_torchrun(script, ["all", *extra_args], nproc, extra_env=extra_env,
                                                 out_dir=out_dir)
            self._results[key] = LaunchResult(worker, world, nproc, rc, output, timed_out,
                                              read_results(out_dir, nproc))
        return self._results[key]

    def cleanup(self):
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)


def worker_cases(worker):
    """The case names a worker file defines (functions decorated with @case), in file order."""
    import re
    with open(os.path.join(WORKERS, worker + ".py")) as f:
        return re.findall(r"^@case\s*\ndef (\w+)\(", f.read(), flags=re.M)


def run_case(launcher, worker, case, world, min_world=1):
    """Runs (cached) `worker` at `world` ranks and asserts that `case` passed on every rank."""
    import pytest
    nproc = effective_world(world)
    if nproc < min_world:
        pytest.skip(f"needs {min_world} ranks, this device variant gives {nproc}")
    res = launcher.result(worker, world)
    skip = res.check(case)
    if skip:
        pytest.skip(skip)
