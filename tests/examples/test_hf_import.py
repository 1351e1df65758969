"""Hugging Face import (examples/export/hf_import.h, src/bmt/checkpoint/hf_dir.h) against transformers itself.

transformers builds a small random GPT-2 and a small random Llama (2 layers, hidden 64, 4 heads, 2 kv heads,
vocab 128; every tensor random, LayerNorm biases included) and saves them with save_pretrained, as one
model.safetensors and sharded (model.safetensors.index.json). Our model (hf_import_tool, under bmtrun) loads them at
world 1, dp 2 and tp 2; its logits must equal transformers' (fp32, 1e-4). Under tp 2 and dp 2 each rank must copy
exactly the bytes of its shards (counted by the reader) and less than the whole model. train_gpt --init-from
fine-tunes a few steps and exports; transformers loads the export and gives the logits of our model loaded from it,
and the weights moved. Run through CTest (it sets BMT_HF_IMPORT_TOOL, BMTRUN and TRAIN_GPT).

On a GPU machine (BMT_HF_IMPORT_ON_GPU=1, scripts/gpu_check.sh) our side runs on the GPUs over NCCL, one rank per
GPU: the cases needing more ranks than GPUs skip saying so, and the fine-tuning runs on as many ranks as there are
GPUs (at most 2). Transformers' reference stays on the CPU in fp32; TF32 is off in both (LibTorch's default), so the
1e-4 bound holds there too."""
import json
import os
import re
import subprocess

import pytest

# Installed by scripts/setup.sh: a missing package fails the import (never a skip that passes).
import safetensors.torch as safetensors_torch
import torch
import transformers

TOOL = os.environ.get("BMT_HF_IMPORT_TOOL")
BMTRUN = os.environ.get("BMTRUN")
TRAIN_GPT = os.environ.get("TRAIN_GPT")
if not (TOOL and BMTRUN and TRAIN_GPT):
    pytest.fail("BMT_HF_IMPORT_TOOL / BMTRUN / TRAIN_GPT not set: run this test through ctest", pytrace=False)

VOCAB, SEQ = 128, 12
ON_GPU = os.environ.get("BMT_HF_IMPORT_ON_GPU") == "1"
if ON_GPU and not torch.cuda.is_available():
    pytest.skip("BMT_HF_IMPORT_ON_GPU=1 but torch sees no GPU", allow_module_level=True)
NGPU = torch.cuda.device_count() if ON_GPU else 0


def ranks(wanted):
    """Ranks for a case that wants `wanted` (CPU: always; GPU: skip when there are fewer GPUs)."""
    if ON_GPU and wanted > NGPU:
        pytest.skip(f"needs {wanted} GPUs, {NGPU} visible")
    return wanted


def make_model(arch, vocab=VOCAB):
    torch.manual_seed(7 if arch == "gpt2" else 8)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_inner=96, vocab_size=vocab, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64,
                                       rms_norm_eps=1e-5, rope_theta=500.0)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():  # every tensor random: a swapped or untransposed one cannot hide
            norm_weight = name.endswith("norm.weight") or (".ln_" in name and name.endswith(".weight"))
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if norm_weight else 0.0))
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_import")
    dirs = {}
    for arch in ("gpt2", "llama"):
        model = make_model(arch)
        single, sharded = root / f"{arch}_single", root / f"{arch}_sharded"
        model.save_pretrained(single)
        model.save_pretrained(sharded, max_shard_size="40KB")
        assert (sharded / "model.safetensors.index.json").exists()
        assert len(list(sharded.glob("*.safetensors"))) > 2
        dirs[arch] = (single, sharded)
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(3))
    (root / "ids.txt").write_text("".join(" ".join(str(int(t)) for t in row) + "\n" for row in ids))
    return root, dirs, ids


def transformers_logits(path, ids):
    cls = transformers.AutoModelForCausalLM
    model = cls.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def run_tool(hf_dir, ids_file, out, nproc, tp, export=None):
    nproc = ranks(nproc)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [BMTRUN, "--nproc", str(nproc), TOOL, str(hf_dir), str(ids_file), str(out), "--tp", str(tp)]
    if export:
        cmd += ["--export", str(export)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    stats = {}
    for rank in range(nproc):
        copied, needed, files = (int(x) for x in (out / f"stats-{rank}.txt").read_text().split())
        stats[rank] = dict(copied=copied, needed=needed, files=files)
    return stats


def our_logits(out, shape):
    import numpy as np

    return torch.from_numpy(np.fromfile(out / "logits.bin", dtype="<f4").reshape(shape))


def tensor_nbytes(hf_dir):
    total = {}
    for f in hf_dir.glob("*.safetensors"):
        for k, v in safetensors_torch.load_file(str(f)).items():
            total[k] = v.numel() * v.element_size()
    return total


def tp_split(arch, name):
    """Whether our tp plan splits the parameter this HF tensor feeds (models/gpt.h, models/llama.h)."""
    if arch == "gpt2":
        return bool(re.search(r"(wte\.weight|c_attn\.(weight|bias)|c_fc\.(weight|bias)|c_proj\.weight)$", name))
    return bool(re.search(r"(embed_tokens\.weight|_proj\.weight|lm_head\.weight)$", name))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("nproc,tp", [(1, 1), (2, 1), (2, 2)], ids=["world1", "dp2", "tp2"])
def test_logits_equal_transformers(hf_dirs, tmp_path, arch, layout, nproc, tp):
    root, dirs, ids = hf_dirs
    hf_dir = dirs[arch][0 if layout == "single" else 1]
    theirs = transformers_logits(hf_dir, ids)
    stats = run_tool(hf_dir, root / "ids.txt", tmp_path, nproc, tp)
    diff = (our_logits(tmp_path, theirs.shape) - theirs).abs().max().item()
    assert diff < 1e-4, f"{arch} {layout} world {nproc} tp {tp}: max |logits difference| {diff}"

    sizes = tensor_nbytes(hf_dir)
    ignored = {"lm_head.weight"} if arch == "gpt2" else set()
    total = sum(v for k, v in sizes.items() if k not in ignored)
    for rank, s in stats.items():
        assert s["copied"] == s["needed"], f"rank {rank} copied {s['copied']} bytes, its shards hold {s['needed']}"
    if nproc == 1:
        assert stats[0]["copied"] == total
    elif tp == 1:  # ZeRO-3 over 2 ranks: every element copied exactly once, by its owner
        assert sum(s["copied"] for s in stats.values()) == total
        assert all(s["copied"] < 0.6 * total for s in stats.values())
    else:  # tp 2, dp 1: the split tensors half each, the replicated ones whole
        want = sum(v // 2 if tp_split(arch, k) else v for k, v in sizes.items() if k not in ignored)
        for rank, s in stats.items():
            assert s["copied"] == want, f"rank {rank}: {s['copied']} bytes copied, its pieces hold {want}"
            assert s["copied"] < total


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_export_of_import_is_identical(hf_dirs, tmp_path, arch):
    """Our export (export/hf_gpt2.h, export/hf_llama.h) of the model loaded at tp 2 holds transformers' tensors."""
    root, dirs, _ = hf_dirs
    src = dirs[arch][1]
    run_tool(src, root / "ids.txt", tmp_path / "out", 2, 2, export=tmp_path / "export")
    ours = safetensors_torch.load_file(str(tmp_path / "export" / "model.safetensors"))
    theirs = {}
    for f in src.glob("*.safetensors"):
        theirs.update(safetensors_torch.load_file(str(f)))
    theirs.pop("lm_head.weight", None) if arch == "gpt2" else None
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


@pytest.mark.parametrize("arch,tp", [("gpt2", 2), ("llama", 1), ("llama", 2)])
def test_fine_tune_and_export(hf_dirs, tmp_path, arch, tp):
    root, dirs, ids = hf_dirs
    src = dirs[arch][1]
    out = tmp_path / "export"
    nproc = ranks(max(tp, min(NGPU, 2))) if ON_GPU else 2  # on GPUs: one rank per GPU, at most 2
    cmd = [BMTRUN, "--nproc", str(nproc), TRAIN_GPT, "--init-from", str(src), "--tp", str(tp), "--steps", "3",
           "--batch", "4", "--seq", "16", "--lr", "1e-3", "--warmup", "0", "--eval-batches", "1", "--task-rows", "16",
           "--eval-every", "1000", "--samples", "0", "--progress", "lines", "--log-every", "1", "--export-hf", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "initialised from" in r.stdout
    # Training ran on the loaded weights and moved them.
    before = {}
    for f in src.glob("*.safetensors"):
        before.update(safetensors_torch.load_file(str(f)))
    after = safetensors_torch.load_file(str(out / "model.safetensors"))
    moved = [k for k in after if not torch.equal(after[k], before[k])]
    assert len(moved) > len(after) // 2, f"fine-tuning changed only {moved}"
    theirs = transformers_logits(out, ids)
    run_tool(out, root / "ids.txt", tmp_path / "ours", 1, 1)
    diff = (our_logits(tmp_path / "ours", theirs.shape) - theirs).abs().max().item()
    assert diff < 1e-4, f"fine-tuned {arch}: max |logits difference| {diff}"


def step_losses(output):
    return [float(x) for x in re.findall(r"\d+/\d+ loss ([0-9.]+)", output)]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_fine_tune_under_pipeline_matches_pp1(hf_dirs, arch):
    """--init-from with --pp 2: each stage loads its own layers (and its end's embedding / head; GPT-2's tied wte on
    both ends) by name; the losses of 3 steps equal those of --pp 1 on one rank (same global batch). ~3 s each."""
    _, dirs, _ = hf_dirs
    common = [TRAIN_GPT, "--init-from", str(dirs[arch][1]), "--steps", "3", "--batch", "4", "--seq", "16", "--lr",
              "1e-3", "--warmup", "0", "--eval-batches", "1", "--task-rows", "16", "--eval-every", "1000",
              "--samples", "0", "--progress", "lines", "--log-every", "1"]
    losses = {}
    ranks(2)
    for nproc, extra in ((1, []), (2, ["--pp", "2", "--micro-batches", "2"])):
        r = subprocess.run([BMTRUN, "--nproc", str(nproc)] + common + extra, capture_output=True, text=True,
                           timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "initialised from" in r.stdout, r.stdout
        losses[nproc] = step_losses(r.stdout)
    assert "pp 2 stages" in r.stdout, r.stdout
    assert len(losses[1]) == 3 and len(losses[2]) == 3, losses
    for a, b in zip(losses[1], losses[2]):
        assert abs(a - b) <= 2e-4, f"{arch}: pp 1 losses {losses[1]} vs pp 2 {losses[2]}"


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_vocabulary_padded_for_tp(hf_dirs, tmp_path, arch):
    """A vocabulary of 127 at tp 2: the embedding (and Llama's head) get a zero row; the logits are transformers'."""
    root, _, ids = hf_dirs
    src = tmp_path / "odd"
    make_model(arch, vocab=127).save_pretrained(src)
    theirs = transformers_logits(src, ids.clamp(max=126))
    (tmp_path / "ids.txt").write_text("".join(" ".join(str(int(t)) for t in row) + "\n" for row in ids.clamp(max=126)))
    stats = run_tool(src, tmp_path / "ids.txt", tmp_path / "out", 2, 2)
    diff = (our_logits(tmp_path / "out", theirs.shape) - theirs).abs().max().item()
    assert diff < 1e-4, f"{arch} vocab 127 at tp 2: max |logits difference| {diff}"
    assert all(s["copied"] == s["needed"] for s in stats.values())


def test_unsupported_config_is_named(hf_dirs, tmp_path):
    _, dirs, _ = hf_dirs
    bad = tmp_path / "bad"
    bad.mkdir()
    src = dirs["llama"][0]
    config = json.loads((src / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").symlink_to(src / "model.safetensors")
    r = subprocess.run([BMTRUN, "--nproc", "1", TRAIN_GPT, "--init-from", str(bad), "--steps", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "hidden_act" in r.stdout + r.stderr and "silu" in r.stdout + r.stderr
