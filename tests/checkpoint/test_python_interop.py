"""Python interoperability of bmtrain's checkpoint files.

C++ -> Python: files written by bmt_ckpt_interop (formula tensors of every dtype; bmt::save of a model in both
formats; bmt-ckpt export of a sharded checkpoint) load in torch.load (weights_only) and in the safetensors package
with identical values. Python -> C++: files written by torch.save and safetensors.torch.save_file (including a
non-contiguous tensor) are read by bmtrain's readers with identical values. Corrupted files are rejected.

Run by CTest with BMT_CKPT_INTEROP (the helper) and BMT_CKPT_TOOL (bmt-ckpt) in the environment.
"""
import collections
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

INTEROP = os.environ.get("BMT_CKPT_INTEROP")
TOOL = os.environ.get("BMT_CKPT_TOOL")
if not INTEROP or not TOOL:
    pytest.fail("BMT_CKPT_INTEROP / BMT_CKPT_TOOL not set: run this test through ctest", pytrace=False)

SPEC = [("f32", [3, 4]), ("f64", [5]), ("f16", [2, 3]), ("bf16", [7]), ("i64", [4]), ("i32", [2, 2]),
        ("i16", [3]), ("i8", [3]), ("u8", [10]), ("bool", [5]), ("scalar_f32", []), ("empty_f32", [0, 2])]
DTYPES = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16, "bf16": torch.bfloat16,
          "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8, "u8": torch.uint8,
          "bool": torch.bool}


def formula(name, shape):
    """The same values as formula() in interop_tool.cpp."""
    dtype = DTYPES.get(name, torch.float32)
    numel = 1
    for d in shape:
        numel *= d
    idx = torch.arange(numel, dtype=torch.float64)
    if dtype == torch.bool:
        v = torch.fmod(idx, 3) == 0
    elif dtype == torch.uint8:
        v = torch.fmod(idx, 200).to(dtype)
    elif not dtype.is_floating_point:
        v = (idx - 5).to(dtype)
    else:
        v = (idx * 0.5 - 3).to(dtype)
    return v.reshape(shape)


def assert_same(a, b, what):
    assert a.dtype == b.dtype, f"{what}: {a.dtype} vs {b.dtype}"
    assert a.shape == b.shape, f"{what}: {a.shape} vs {b.shape}"
    assert torch.equal(a, b), f"{what}: values differ"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("cpp")
    subprocess.run([INTEROP, "write", str(out)], check=True)
    return out


def test_cpp_formula_files_load_in_python(written):
    from_pt = torch.load(written / "formula.pt", weights_only=True)
    from_st = load_file(written / "formula.safetensors")
    assert isinstance(from_pt, dict)
    assert sorted(from_pt) == sorted(n for n, _ in SPEC) == sorted(from_st)
    for name, shape in SPEC:
        assert_same(from_pt[name], formula(name, shape), f"torch.load {name}")
        assert_same(from_st[name], formula(name, shape), f"safetensors {name}")


def test_cpp_model_files_agree_and_match_export(written, tmp_path):
    model_pt = torch.load(written / "model.pt", weights_only=True)
    model_st = load_file(written / "model.safetensors")
    assert sorted(model_pt) == sorted(model_st)
    assert "embed.weight" in model_st and "layers.0.fc1.weight" in model_st and "ln_f.bias" in model_st
    assert model_st["layers.0.fc1.weight"].shape == (16, 8)
    for k in model_st:
        assert_same(model_pt[k], model_st[k], k)
    info = subprocess.run([TOOL, "info", str(written / "ckpt")], check=True, capture_output=True, text=True).stdout
    assert "world size      1" in info and "step            11" in info and "origin = interop" in info
    subprocess.run([TOOL, "verify", str(written / "ckpt")], check=True, capture_output=True)
    for ext in ("safetensors", "pt"):
        out = tmp_path / f"export.{ext}"
        subprocess.run([TOOL, "export", str(written / "ckpt"), str(out)], check=True, capture_output=True)
        exported = load_file(out) if ext == "safetensors" else torch.load(out, weights_only=True)
        assert sorted(exported) == sorted(model_st)
        for k in model_st:
            assert_same(exported[k], model_st[k], f"export.{ext} {k}")


def test_python_files_load_in_cpp(tmp_path):
    tensors = {name: formula(name, shape) for name, shape in SPEC}
    save_file(tensors, tmp_path / "py.safetensors")
    # torch.save of views: a non-contiguous tensor and a tensor sharing a larger storage.
    pt_tensors = dict(tensors)
    pt_tensors["f32"] = tensors["f32"].t().contiguous().t()
    assert not pt_tensors["f32"].is_contiguous()
    backing = torch.cat([torch.zeros(3, dtype=torch.float64), tensors["f64"]])
    pt_tensors["f64"] = backing[3:]
    torch.save(pt_tensors, tmp_path / "py.pt")
    # A module-style state dict: OrderedDict with _metadata (a pickle BUILD), an nn.Parameter value, protocol 4.
    state = collections.OrderedDict(pt_tensors)
    state._metadata = collections.OrderedDict({"": {"version": 1}})
    state["f16"] = torch.nn.Parameter(tensors["f16"], requires_grad=False)
    torch.save(state, tmp_path / "py_state_dict.pt")
    torch.save(pt_tensors, tmp_path / "py_proto4.pt", pickle_protocol=4)
    for name in ("py.safetensors", "py.pt", "py_state_dict.pt", "py_proto4.pt"):
        r = subprocess.run([INTEROP, "check", str(tmp_path / name)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_corrupted_and_truncated_files_are_rejected(written, tmp_path):
    data = (written / "formula.safetensors").read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(data[:-5])
    r = subprocess.run([INTEROP, "check", str(tmp_path / "trunc.safetensors")], capture_output=True, text=True)
    assert r.returncode != 0 and "truncated" in r.stderr
    bad = bytearray(data)
    bad[5] = 0x7F  # absurd header length (high bytes of the u64)
    (tmp_path / "bad.safetensors").write_bytes(bytes(bad))
    r = subprocess.run([INTEROP, "check", str(tmp_path / "bad.safetensors")], capture_output=True, text=True)
    assert r.returncode != 0 and "header length" in r.stderr
    # A flipped byte in a shard of the sharded checkpoint: verify and export name the file.
    import shutil
    ckpt = tmp_path / "ckpt"
    shutil.copytree(written / "ckpt", ckpt)
    shard = ckpt / "rank-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0x40
    shard.write_bytes(bytes(raw))
    r = subprocess.run([TOOL, "verify", str(ckpt)], capture_output=True, text=True)
    assert r.returncode == 1 and "rank-00000.bin" in r.stderr
    r = subprocess.run([TOOL, "export", str(ckpt), str(tmp_path / "x.safetensors")], capture_output=True, text=True)
    assert r.returncode == 1 and "checksum mismatch in rank-00000.bin" in r.stderr
    assert not (tmp_path / "x.safetensors").exists()
