"""Hugging Face GPT-2 export (examples/export/hf_gpt2.cpp): the tiny GPT written by gpt_hf_fixture loads with
transformers' GPT2LMHeadModel and gives our logits within 1e-4; the safetensors file parses independently.

Run through CTest (it sets BMT_GPT_HF_FIXTURE to the helper executable)."""
import json
import os
import socket
import struct
import subprocess

import numpy as np
import pytest
import torch
import transformers  # installed by scripts/setup.sh: a missing package is a broken set-up, never a pass


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    fixture = os.environ.get("BMT_GPT_HF_FIXTURE")
    if not fixture:
        pytest.fail("BMT_GPT_HF_FIXTURE is not set: run this test through ctest (it sets the helper's path)")
    out = tmp_path_factory.mktemp("hf_export")
    # A single-process bmtrain job still hosts a rendezvous store. The port stays bound here (SO_REUSEADDR, not
    # listening) until the job has exited, so no other process is handed it in between; the store binds it too.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
        subprocess.run([fixture, str(out)], check=True, timeout=120, env=env)
    return out


def test_safetensors_layout(export_dir):
    data = (export_dir / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0
    header = json.loads(data[8 : 8 + n])
    assert header.pop("__metadata__") == {"format": "pt"}
    end = 0
    for name, info in header.items():
        assert info["dtype"] == "F32", name
        begin, stop = info["data_offsets"]
        assert begin == end, f"{name}: tensors must be back to back"
        count = 1
        for d in info["shape"]:
            count *= d
        assert stop - begin == 4 * count, name
        end = stop
    assert 8 + n + end == len(data)
    assert header["transformer.h.0.attn.c_attn.weight"]["shape"] == [32, 96]  # Conv1D (in, out)
    assert header["transformer.h.1.mlp.c_proj.weight"]["shape"] == [48, 32]
    assert "lm_head.weight" not in header  # tied to transformer.wte.weight
    config = json.loads((export_dir / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["n_inner"] == 48 and config["n_positions"] == 16


def test_transformers_logits_match(export_dir):
    model = transformers.GPT2LMHeadModel.from_pretrained(str(export_dir), torch_dtype=torch.float32)
    model.eval()
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr(), "lm_head must be tied"
    ids = [[int(t) for t in line.split()] for line in (export_dir / "ids.txt").read_text().splitlines()]
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits
    ours = torch.from_numpy(np.fromfile(export_dir / "logits.bin", dtype="<f4").reshape(theirs.shape))
    diff = (theirs - ours).abs().max().item()
    assert diff < 1e-4, f"max |logits difference| {diff}"
