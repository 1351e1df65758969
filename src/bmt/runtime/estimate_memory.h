// bmt::estimate_memory: per-GPU and per-host memory of a training run, before launching it.
//
// The model follows how this engine allocates (docs/memory_estimate.md has the derivation and its check against
// bench/results): ZeRO-sharded bf16/fp16/fp32 parameters, fp32 main gradients, Adam states (fp32 master + two
// moments, on the host with offload), activations saved by autograd for the example GPT / Llama layers (all layers,
// or with checkpointing each layer's input plus one layer being recomputed), and buffers: gathered copies of
// Blocks (none when a Block's group has one rank: it aliases its shard), one Block's full gradient, the logits
// (the fused cross-entropy works in place on them). Torch-free: pure arithmetic.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace bmt {

// The shape of a decoder-only transformer (the examples' GPT or Llama; their presets: examples/models/preset_shapes.h).
struct ModelShape {
  std::string arch = "gpt";  // "gpt" (learned positions, LayerNorm, GELU MLP, tied head) or "llama" (RMSNorm,
                             // RoPE, SwiGLU, separate head)
  int64_t layers = 0, hidden = 0, heads = 0, ffn = 0;
  int64_t kv_heads = 0;      // llama grouped-query attention (0: = heads)
  int64_t vocab = 50304;
  int64_t max_seq = 2048;    // gpt: rows of the learned position table
  // Parameter counts (of the whole model; of one transformer layer; outside the layers).
  int64_t layer_params() const;
  int64_t other_params() const;
  int64_t params() const { return layers * layer_params() + other_params(); }
};

struct MemoryPlan {
  int world = 1;                 // ranks in total
  int ranks_per_host = 0;        // 0: min(world, 8)
  int tp = 1, pp = 1;            // tensor / pipeline parallel sizes (world % (tp * pp) == 0)
  int zero = 3;                  // 2: Blocks keep gathered parameters from forward to backward; 3: gather twice
  bool checkpointing = false;    // recompute each Block's forward in the backward
  bool offload = false;          // Adam states (and the update) on the host
  int offload_gpu_blocks = 0;    // with offload: the first K Blocks keep GPU Adam
  bool offload_grad_bf16 = false;  // with offload: bf16 gradient staging on the host
  bool step_in_backward = false;   // OptimManager::overlap_step_with_backward: Block gradients freed after update
  int64_t batch = 1;             // sequences per data-parallel rank per micro-step
  int64_t seq = 1024;            // tokens per sequence
  std::string dtype = "bf16";    // parameter dtype: bf16, fp16 or fp32
};

// Bytes per GPU (the most loaded rank: pipeline stage 0) and per host, by what holds them.
struct MemoryEstimate {
  struct Split {
    double parameters = 0, gradients = 0, optimizer_states = 0, activations = 0, buffers = 0, runtime = 0;
    double total() const { return parameters + gradients + optimizer_states + activations + buffers + runtime; }
  };
  Split gpu;   // one rank's device (what torch's allocator reports as peak: no CUDA context)
  Split host;  // one host: ranks_per_host ranks (offloaded Adam states and pinned staging, process runtime)
  int64_t params_total = 0, params_per_rank = 0;
  int ranks_per_host = 1;
};

// Throws bmt::core::Error naming a bad field (sizes not dividing, unknown dtype or arch).
MemoryEstimate estimate_memory(const ModelShape& model, const MemoryPlan& plan);
// A readable table (GiB) of the estimate.
std::string format_memory_estimate(const ModelShape& model, const MemoryPlan& plan, const MemoryEstimate& e);

}  // namespace bmt
