// bmt-estimate: per-GPU and per-host memory of a training configuration before launching it (bmt::estimate_memory;
// the model and its accuracy against bench/results: docs/memory_estimate.md).
// Exit status: 0 on success, 1 on a bad configuration (message on stderr), 2 on bad usage.
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "bmt/core/error.h"
#include "bmt/runtime/estimate_memory.h"
#include "models/preset_shapes.h"

namespace {

const char* kHelp = R"(usage: bmt-estimate (--preset NAME | --layers L --hidden D --heads H --ffn F [--vocab V] [--arch gpt|llama]
                     [--kv-heads K] [--max-seq S]) [options]

Estimates the memory of one training step of the example GPT / Llama models with this engine: per GPU (the peak
torch's allocator reports; the CUDA context, ~0.5 GiB, is not included) and per host, split into parameters,
gradients, optimizer states, activations, buffers (gathered Blocks, a Block's full gradient, logits; pinned
staging with offload) and the processes' runtime. Checked within 10% against every measured peak of the current
engine in bench/results (tests/core/test_estimate_memory.cpp).

model:
  --preset NAME        tiny | gpt2-124m | gpt-1.3b | gpt-6.7b | llama-7b
  --arch A             gpt (default) or llama, with --layers/--hidden/--heads/--ffn/--vocab (50304)/--kv-heads/--max-seq
  --params N           only print the parameter count of the shape and whether N matches it
run:
  --world N            ranks in total (1)          --ranks-per-host N   (min(world, 8))
  --tp N --pp N        tensor / pipeline parallel sizes (1)
  --zero 2|3           ZeRO level of the Blocks (3)
  --checkpointing      recompute Blocks in the backward
  --offload            Adam on the host (CPU)      --offload-gpu-blocks K  first K Blocks keep GPU Adam
  --offload-grad-bf16  bf16 gradient staging on the host
  --step-in-backward   OptimManager::overlap_step_with_backward: each Block's fp32 gradients freed after its update
  --batch N            sequences per data-parallel rank per micro-step (1)
  --seq N              tokens per sequence (1024)
  --dtype bf16|fp16|fp32  parameter dtype (bf16)
)";

int64_t to_int(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    long long x = std::stoll(v, &used);
    if (used == v.size()) return x;
  } catch (...) {
  }
  throw std::invalid_argument(flag + " expects an integer, got '" + v + "'");
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  bmt::ModelShape m;
  bmt::MemoryPlan p;
  bool have_model = false;
  int64_t check_params = -1;
  try {
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& a = args[i];
      auto next = [&]() -> const std::string& {
        if (i + 1 >= args.size()) throw std::invalid_argument(a + " needs a value");
        return args[++i];
      };
      if (a == "-h" || a == "--help") {
        std::cout << kHelp;
        return 0;
      } else if (a == "--preset") {
        m = examples::preset_shape(next());
        have_model = true;
      } else if (a == "--arch") m.arch = next();
      else if (a == "--layers") m.layers = to_int(a, next()), have_model = true;
      else if (a == "--hidden") m.hidden = to_int(a, next());
      else if (a == "--heads") m.heads = to_int(a, next());
      else if (a == "--kv-heads") m.kv_heads = to_int(a, next());
      else if (a == "--ffn") m.ffn = to_int(a, next());
      else if (a == "--vocab") m.vocab = to_int(a, next());
      else if (a == "--max-seq") m.max_seq = to_int(a, next());
      else if (a == "--params") check_params = to_int(a, next());
      else if (a == "--world") p.world = static_cast<int>(to_int(a, next()));
      else if (a == "--ranks-per-host") p.ranks_per_host = static_cast<int>(to_int(a, next()));
      else if (a == "--tp") p.tp = static_cast<int>(to_int(a, next()));
      else if (a == "--pp") p.pp = static_cast<int>(to_int(a, next()));
      else if (a == "--zero") p.zero = static_cast<int>(to_int(a, next()));
      else if (a == "--checkpointing") p.checkpointing = true;
      else if (a == "--offload") p.offload = true;
      else if (a == "--offload-gpu-blocks") p.offload_gpu_blocks = static_cast<int>(to_int(a, next()));
      else if (a == "--offload-grad-bf16") p.offload_grad_bf16 = true;
      else if (a == "--step-in-backward") p.step_in_backward = true;
      else if (a == "--batch") p.batch = to_int(a, next());
      else if (a == "--seq") p.seq = to_int(a, next());
      else if (a == "--dtype") p.dtype = next();
      else throw std::invalid_argument("unknown option " + a);
    }
    if (!have_model) throw std::invalid_argument("give --preset NAME or the shape (--layers --hidden --heads --ffn)");
  } catch (const std::invalid_argument& e) {
    std::cerr << "bmt-estimate: " << e.what() << "\n\n" << kHelp;
    return 2;
  } catch (const bmt::core::Error& e) {
    std::cerr << "bmt-estimate: " << e.what() << "\n";
    return 1;
  }
  try {
    if (check_params >= 0) {
      std::cout << "the shape has " << m.params() << " parameters"
                << (m.params() == check_params ? " (matches --params)\n" : " (--params differs)\n");
      return m.params() == check_params ? 0 : 1;
    }
    const auto e = bmt::estimate_memory(m, p);
    std::cout << bmt::format_memory_estimate(m, p, e);
  } catch (const bmt::core::Error& e) {
    std::cerr << "bmt-estimate: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
