"""bmt.estimate_memory (the C++ estimator through the binding): a measured peak of bench/results and the shape form."""
import bmtrain as bmt

GIB = 1024 ** 3


def test_preset_matches_a_measured_peak():
    # bench/results/2026-12-01-NVIDIA-H200.jsonl, run bmtcpp_after_fix_1p3b: 48.258 GiB (tests/core checks them all).
    e = bmt.estimate_memory("gpt-1.3b", batch=8, seq=2048)
    assert abs(e["gpu"]["total"] / GIB / 48.258 - 1) < 0.10, e["table"]
    assert e["params"] == 1315819520
    parts = ("parameters", "gradients", "optimizer_states", "activations", "buffers", "runtime")
    assert abs(sum(e["gpu"][k] for k in parts) - e["gpu"]["total"]) < 1.0


def test_shape_equals_preset_and_options_move_memory():
    by_shape = bmt.estimate_memory(arch="llama", layers=32, hidden=4096, heads=32, ffn=11008, world=8, batch=2,
                                   seq=2048, checkpointing=True)
    by_name = bmt.estimate_memory("llama-7b", world=8, batch=2, seq=2048, checkpointing=True)
    assert by_shape["gpu"] == by_name["gpu"]
    off = bmt.estimate_memory("llama-7b", world=8, batch=2, seq=2048, checkpointing=True, offload=True)
    assert off["gpu"]["optimizer_states"] == 0 and off["host"]["optimizer_states"] > 0
    assert "per GPU" in off["table"]
