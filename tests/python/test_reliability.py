"""Failures a demanding user hits outside the happy path (issue 36), each in a fresh single-rank process:
bmt.save on a full disk (a file-size limit: EFBIG; Python ignores SIGXFSZ) is a RuntimeError naming the file, with
no temporary file left and the process alive (it used to die with SIGABRT inside torch's zip writer), and the
calls that used to answer silently with a placeholder (rank() and world_size() before init_distributed,
tp_size=0 or -2) raise errors naming the fix."""
import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest

SCRIPT = r"""
import json, os, sys
import torch
import bmtrain as bmt

out = {}
def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None

out["rank_before_init"] = error_of(bmt.rank)
out["world_size_before_init"] = error_of(bmt.world_size)
out["tp_zero"] = error_of(lambda: bmt.init_distributed(tp_size=0, quiet=True))
out["tp_negative"] = error_of(lambda: bmt.init_distributed(tp_size=-2, quiet=True))
bmt.init_distributed(seed=0, quiet=True)
out["rank_after_init"] = bmt.rank()

class Model(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.fc = bmt.nn.Linear(512, 512)   # 1 MiB of fp32 weights: past the 64 KiB file-size limit

model = Model()
bmt.init_parameters(model)
folder = sys.argv[1]
for name in ("model.pt", "model.safetensors"):
    out["save_" + name] = error_of(lambda: bmt.save(model, os.path.join(folder, name)))
out["files_left"] = sorted(os.listdir(folder))
print("RESULT " + json.dumps(out), flush=True)
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def result():
    folder = tempfile.mkdtemp(prefix="bmt_reliability_")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(k, None)
    # ulimit -f counts 1 KiB blocks: 64 KiB per file.
    cmd = f"ulimit -f 64; exec {sys.executable} -c \"$BMT_SCRIPT\" {folder}"
    p = subprocess.run(["bash", "-c", cmd], env=dict(env, BMT_SCRIPT=SCRIPT), capture_output=True, text=True,
                       timeout=300)
    text = p.stdout + p.stderr
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    yield {"returncode": p.returncode, "output": text, "folder": folder,
           "data": json.loads(line[len("RESULT "):]) if line else None}
    subprocess.run(["rm", "-rf", folder])


def test_save_on_a_full_disk_raises_and_leaves_no_file(result):
    assert result["returncode"] == 0, f"the process died (SIGABRT is -6 / 134):\n{result['output'][-4000:]}"
    data = result["data"]
    assert data is not None, result["output"][-4000:]
    for name in ("model.pt", "model.safetensors"):
        err = data["save_" + name]
        assert err is not None, f"bmt.save({name}) succeeded past a 64 KiB file-size limit"
        assert err.startswith("RuntimeError"), err
        assert os.path.join(result["folder"], name) in err, f"the error does not name the file:\n{err}"
        assert "File too large" in err and "ulimit -f" in err, f"the error does not say why:\n{err}"
        assert "Exception raised from" not in err, f"a C++ backtrace in the message:\n{err}"
    assert data["files_left"] == [], f"files left behind: {data['files_left']}"
    assert "terminate called" not in result["output"], result["output"][-4000:]


def test_rank_and_world_size_before_init_raise(result):
    data = result["data"]
    assert data is not None, result["output"][-4000:]
    for key, name in (("rank_before_init", "rank"), ("world_size_before_init", "world_size")):
        err = data[key]
        assert err is not None, f"bmt.{name}() answered before init_distributed"
        assert err.startswith("RuntimeError") and "init_distributed()" in err, err
    assert data["rank_after_init"] == 0


def test_tp_size_below_one_is_refused(result):
    data = result["data"]
    assert data is not None, result["output"][-4000:]
    for key, value in (("tp_zero", "0"), ("tp_negative", "-2")):
        err = data[key]
        assert err is not None, f"init_distributed(tp_size={value}) was accepted"
        assert err.startswith("ValueError") and f"got {value}" in err and "tp_size=1" in err, err
