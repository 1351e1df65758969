"""bmt.estimate_memory: memory of a training configuration before launching it (bmt::estimate_memory; the model
and its check against bench/results: docs/memory_estimate.md). No initialisation needed."""
from . import _C


def estimate_memory(preset=None, **kwargs):
    """estimate_memory("gpt-1.3b", world=8, batch=8, seq=2048, checkpointing=True) or, without a preset, the shape:
    arch ("gpt"|"llama"), layers, hidden, heads, ffn, kv_heads, vocab, max_seq. Run options: world, ranks_per_host,
    tp, pp, zero (2|3), checkpointing, offload, offload_gpu_blocks, offload_grad_bf16, step_in_backward, batch (sequences per
    data-parallel rank), seq, dtype ("bf16"|"fp16"|"fp32").

    Returns {"gpu": {...}, "host": {...}, "params", "params_per_rank", "ranks_per_host", "table"} where gpu/host map
    parameters, gradients, optimizer_states, activations, buffers, runtime and total to bytes."""
    return _C.estimate_memory(preset, **kwargs)
