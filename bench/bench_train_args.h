// bmt-bench-train's command line (see bench_train.cpp's header for every flag) and the model shape it selects.
#pragma once

#include <cstdint>
#include <string>

#include "models/language_model.h"

namespace bench {

struct Args {
  std::string framework = "bmt";
  std::string preset = "tiny";
  std::string arch;  // "" = gpt, llama for llama-7b
  int64_t seq = 0, batch = 0;
  int64_t steps = 10, warmup = 3;
  bool checkpointing = false, offload = false, raw_step = false, force = false, no_overlap = false;
  bool fp8 = false;  // --fp8: FP8 GEMMs in the transformer layers' linears (examples::ParallelOptions::fp8)
  bool fp8_head = false;  // --fp8-head: the LM head in FP8 too (examples::ParallelOptions::fp8_head)
  bool fp8_head_backward = false;  // --fp8-head-backward: its backward GEMMs only (ParallelOptions::fp8_head_backward)
  std::string fp8_recipe;  // --fp8-recipe current|delayed (empty: BMT_FP8_RECIPE's; nn::set_fp8_recipe)
  int zero = 3;
  int tp = 1;
  int pp = 1;             // --pp N: pipeline stages (gpt)
  int micro_batches = 0;  // --micro-batches M (0: 2 x pp); B must be a multiple of M
  std::string pp_schedule = "1f1b";  // --pp-schedule 1f1b|gpipe
  bool offload_blocks_only = false;  // --offload-blocks: CPU Adam for Block parameters, GPU Adam for the rest
  int64_t offload_gpu_blocks = 0;    // --offload-gpu-blocks K: also the first K Blocks keep GPU Adam
  bool offload_grad_bf16 = false;    // --offload-grad-bf16: gradients cross the bus in bf16
  bool step_in_backward = false;     // --step-in-backward: GPU Adam per Block during the backward, gradients freed
  bool offload_async = false;        // --offload-async: step() returns before the Blocks' CPU updates finish
  bool cuda_graphs = false;          // --cuda-graphs: forward + backward replayed as one CUDA graph (CudaGraphStep)
  bool profile = false;              // --profile: 2 more steps under the Kineto profiler (GPU busy/idle, kernels)
  std::string json_path;
  std::string memory_snapshot;   // --memory-snapshot PATH: the CUDA allocator history, pickled (memory_report.h)
  bool memory_breakdown = false;  // --memory-breakdown: bytes by category at the largest sample
  std::string device = "auto";  // plain only
  std::string plain_adamw = "fused";
  std::string autocast = "auto";  // plain only: bf16 autocast on (auto: on CUDA)
  uint64_t seed = 1234;
};

// Parses argv; throws std::invalid_argument naming the bad flag. --help prints the usage and exits 0.
Args parse_args(int argc, char** argv);
// The usage text (every flag).
const char* usage();

// The model shape: the example presets, plus gpt-6.7b (peers.md's 6.7B GPT row), with vocabulary 50304.
struct Shape {
  examples::ModelConfig model;
  int64_t default_batch = 8;
};

// The preset's model (vocabulary 50304, --seq and --arch applied), validated.
Shape resolve_shape(const Args& a);

}  // namespace bench
