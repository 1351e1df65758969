"""bmt.load_hf_safetensors (src/bmt/checkpoint/hf_dir.h): a directory in the Hugging Face layout (config.json +
sharded safetensors with model.safetensors.index.json, one tensor stored transposed) written from the plain-torch
twin loads into the bmt model (blocks, ZeRO shards) with the twin's values; each rank copies less than the whole
model when the world is larger than 1; a missing tensor is reported."""
import json
import os

import bmtrain as bmt
from common import OUT, _barrier, case, compare_state, expect_raises, main, rank, world
from models import BMT, TORCH, make

D = 6


def _write_hf_dir(ref, path, transposed):
    """ref's state dict as HF-style names "model.<key>", two shards and an index; `transposed` stored (in, out)."""
    from safetensors.torch import save_file

    state = {("model." + k): (v.t() if k == transposed else v).detach().cpu().contiguous()
             for k, v in ref.state_dict().items()}
    names = sorted(state)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: state[n] for n in part}, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "test"}, f)
    return sum(v.numel() * v.element_size() for v in state.values())


@case
def load_hf_blocklist():
    import safetensors.torch  # noqa: F401  (installed by scripts/setup.sh: missing is a failure, not a skip)
    ref, model = make(TORCH).Net(D, 3, 10), make(BMT).Net(D, 3, 20)
    keys = list(ref.state_dict())
    transposed = next(k for k, v in ref.state_dict().items() if v.dim() == 2)
    path = os.path.join(OUT, "hf_dir")
    os.makedirs(path, exist_ok=True)
    total = _write_hf_dir(ref, path, transposed) if rank() == 0 else 0
    _barrier("hf_dir_written")
    name_map = {k: ("model." + k, k == transposed) for k in keys}
    missing, unexpected, copied = bmt.load_hf_safetensors(model, path, name_map)
    assert not missing and not unexpected, (missing, unexpected)
    compare_state(model, ref, exact=True, what="after load_hf_safetensors: ")
    if world() > 1 and rank() == 0:
        assert 0 < copied < total, f"rank 0 copied {copied} of the model's {total} bytes"
    expect_raises("a tensor missing from the directory", Exception,
                  lambda: bmt.load_hf_safetensors(model, path, dict(name_map, **{keys[0]: "model.nope"})),
                  must_mention=("model.nope",))


if __name__ == "__main__":
    main()
