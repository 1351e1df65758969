// bmt-bench-train's command line and model shapes.
#include "bench_train_args.h"

#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "models/presets.h"

namespace bench {
namespace {

constexpr int64_t kVocab = 50304;

const char* kUsage =
    "usage: bmt-bench-train --framework bmt|plain --preset tiny|gpt2-124m|gpt-1.3b|gpt-6.7b|llama-7b\n"
    "                       [--seq T] [--batch B] [--steps N (10)] [--warmup W (3)] [--checkpointing] [--offload]\n"
    "                       [--fp8 (bmt, gpt: FP8 GEMMs in the transformer layers; JSON \"fp8\": true)]\n"
    "                       [--fp8-head (with --fp8: the LM head's GEMMs in FP8 too; JSON \"fp8_head\": true)]\n"
    "                       [--fp8-head-backward (instead: only the head's backward GEMMs in FP8; JSON\n"
    "                        \"fp8_head_backward\": true)]\n"
    "                       [--fp8-recipe current|delayed (with --fp8: how scales are found; default BMT_FP8_RECIPE,\n"
    "                        else current; JSON \"fp8_recipe\")]\n"
    "                       [--zero 2|3] [--json PATH] [--arch gpt|llama] [--device auto|cpu|cuda (plain)]\n"
    "                       [--plain-adamw fused|torch] [--autocast auto|on|off (plain, bf16)] [--raw-step (bmt)]\n"
    "                       [--no-overlap (offload: update every Block after the backward)]\n"
    "                       [--offload-blocks (CPU Adam for the Blocks' parameters only, GPU Adam for the rest)]\n"
    "                       [--offload-gpu-blocks K (--offload-blocks, and the first K Blocks keep GPU Adam too)]\n"
    "                       [--offload-grad-bf16 (offload: gradients cross the bus rounded to bf16)]\n"
    "                       [--offload-async (offload: the next forward waits per Block for the CPU updates)]\n"
    "                       [--step-in-backward (GPU Adam per Block during the backward; fp32 gradients freed)]\n"
    "                       [--cuda-graphs (bmt: forward + backward captured once, then replayed as a CUDA graph)]\n"
    "                       [--profile (2 extra steps under the profiler: GPU busy vs idle, top kernels)]\n"
    "                       [--memory-snapshot PATH (CUDA allocator history, for pytorch.org/memory_viz)]\n"
    "                       [--memory-breakdown (GPU bytes by category at the largest of the sampled moments)]\n"
    "                       [--force (skip the host memory check)]\n"
    "                       [--seed S] [--tp N (bmt: tensor parallelism; run under bmtrun with N | world)]\n"
    "                       [--pp N --micro-batches M --pp-schedule 1f1b|gpipe (bmt, gpt or llama: pipeline stages;\n"
    "                        reports the measured bubble and (p-1)/(m+p-1))]\n";

}  // namespace

const char* usage() { return kUsage; }

Args parse_args(int argc, char** argv) {
  Args a;
  auto need = [&](int& i) -> std::string {
    if (i + 1 >= argc) throw std::invalid_argument(std::string(argv[i]) + " needs a value");
    return argv[++i];
  };
  auto to_int = [](const std::string& flag, const std::string& v) -> int64_t {
    size_t pos = 0;
    int64_t x = 0;
    try {
      x = std::stoll(v, &pos);
    } catch (const std::exception&) {
      pos = 0;
    }
    if (pos != v.size() || v.empty()) throw std::invalid_argument(flag + ": not an integer: '" + v + "'");
    return x;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--framework") a.framework = need(i);
    else if (f == "--preset") a.preset = need(i);
    else if (f == "--arch") a.arch = need(i);
    else if (f == "--seq") a.seq = to_int(f, need(i));
    else if (f == "--batch") a.batch = to_int(f, need(i));
    else if (f == "--steps") a.steps = to_int(f, need(i));
    else if (f == "--warmup") a.warmup = to_int(f, need(i));
    else if (f == "--zero") a.zero = static_cast<int>(to_int(f, need(i)));
    else if (f == "--tp") a.tp = static_cast<int>(to_int(f, need(i)));
    else if (f == "--pp") a.pp = static_cast<int>(to_int(f, need(i)));
    else if (f == "--micro-batches") a.micro_batches = static_cast<int>(to_int(f, need(i)));
    else if (f == "--pp-schedule") a.pp_schedule = need(i);
    else if (f == "--json") a.json_path = need(i);
    else if (f == "--memory-snapshot") a.memory_snapshot = need(i);
    else if (f == "--memory-breakdown") a.memory_breakdown = true;
    else if (f == "--device") a.device = need(i);
    else if (f == "--plain-adamw") a.plain_adamw = need(i);
    else if (f == "--autocast") a.autocast = need(i);
    else if (f == "--seed") a.seed = static_cast<uint64_t>(to_int(f, need(i)));
    else if (f == "--checkpointing") a.checkpointing = true;
    else if (f == "--fp8") a.fp8 = true;
    else if (f == "--fp8-head") a.fp8_head = true;
    else if (f == "--fp8-head-backward") a.fp8_head_backward = true;
    else if (f == "--fp8-recipe") a.fp8_recipe = need(i);
    else if (f == "--offload") a.offload = true;
    else if (f == "--offload-blocks") a.offload = a.offload_blocks_only = true;
    else if (f == "--offload-gpu-blocks") {
      a.offload = a.offload_blocks_only = true;
      a.offload_gpu_blocks = to_int(f, need(i));
    } else if (f == "--offload-grad-bf16") a.offload_grad_bf16 = true;
    else if (f == "--offload-async") a.offload_async = true;
    else if (f == "--step-in-backward") a.step_in_backward = true;
    else if (f == "--profile") a.profile = true;
    else if (f == "--cuda-graphs") a.cuda_graphs = true;
    else if (f == "--raw-step") a.raw_step = true;
    else if (f == "--no-overlap") a.no_overlap = true;
    else if (f == "--force") a.force = true;
    else if (f == "--help" || f == "-h") {
      std::printf("%s", kUsage);
      std::exit(0);
    } else {
      throw std::invalid_argument("unknown argument '" + f + "'");
    }
  }
  if (a.framework == "bmtrain") a.framework = "bmt";
  if (a.framework != "bmt" && a.framework != "plain")
    throw std::invalid_argument("--framework must be bmt or plain, got '" + a.framework + "'");
  if (a.zero != 2 && a.zero != 3) throw std::invalid_argument("--zero must be 2 or 3");
  if (a.step_in_backward && (a.offload || a.raw_step))
    throw std::invalid_argument("--step-in-backward is for the GPU AdamOptimizer under the OptimManager (no --offload, no --raw-step)");
  if (a.offload_blocks_only && a.raw_step) throw std::invalid_argument("--offload-blocks needs the OptimManager (no --raw-step)");
  if (a.offload_gpu_blocks < 0) throw std::invalid_argument("--offload-gpu-blocks must be >= 0");
  if ((a.offload_grad_bf16 || a.offload_async) && !a.offload)
    throw std::invalid_argument("--offload-grad-bf16 and --offload-async need --offload");
  if (a.fp8 && a.framework != "bmt") throw std::invalid_argument("--fp8 is for --framework bmt");
  if (a.fp8_head && !a.fp8)
    throw std::invalid_argument("--fp8-head puts the LM head in FP8 beside the layers; add --fp8");
  if (a.fp8_head_backward && !a.fp8)
    throw std::invalid_argument("--fp8-head-backward puts the LM head's backward GEMMs in FP8; add --fp8");
  if (a.fp8_head && a.fp8_head_backward)
    throw std::invalid_argument("--fp8-head and --fp8-head-backward are two choices for the LM head; give one");
  if (!a.fp8_recipe.empty() && !a.fp8) throw std::invalid_argument("--fp8-recipe is for --fp8");
  if (!a.fp8_recipe.empty() && a.fp8_recipe != "current" && a.fp8_recipe != "delayed")
    throw std::invalid_argument("--fp8-recipe must be current or delayed, got '" + a.fp8_recipe + "'");
  if (a.tp < 1 || (a.tp > 1 && a.framework != "bmt")) throw std::invalid_argument("--tp N (>= 1) is for --framework bmt");
  if (a.pp < 1 || (a.pp > 1 && a.framework != "bmt")) throw std::invalid_argument("--pp N (>= 1) is for --framework bmt");
  if (a.micro_batches < 0) throw std::invalid_argument("--micro-batches must be >= 1");
  if (a.pp_schedule != "1f1b" && a.pp_schedule != "gpipe") throw std::invalid_argument("--pp-schedule must be 1f1b or gpipe");
  if (a.pp > 1 && (a.raw_step || a.offload)) throw std::invalid_argument("--pp needs the OptimManager without offload");
  if (a.cuda_graphs && (a.framework != "bmt" || a.offload || a.step_in_backward || a.pp > 1))
    throw std::invalid_argument("--cuda-graphs is for --framework bmt without --offload, --step-in-backward and --pp "
                                "(their host work runs during the backward, which a replayed graph skips)");
  if (a.steps < 1 || a.warmup < 0) throw std::invalid_argument("--steps must be >= 1 and --warmup >= 0");
  if (a.seq < 0 || a.batch < 0) throw std::invalid_argument("--seq and --batch must be positive");
  if (a.device != "auto" && a.device != "cpu" && a.device != "cuda")
    throw std::invalid_argument("--device must be auto, cpu or cuda");
  if (a.autocast != "auto" && a.autocast != "on" && a.autocast != "off")
    throw std::invalid_argument("--autocast must be auto, on or off");
  if (a.plain_adamw != "fused" && a.plain_adamw != "torch")
    throw std::invalid_argument("--plain-adamw must be fused or torch");
  return a;
}

Shape resolve_shape(const Args& a) {
  Shape s;
  const examples::Preset& p = examples::find_preset(a.preset);  // throws listing the known names
  s.model = p.model;
  s.default_batch = p.train.batch_per_rank;
  s.model.arch = !a.arch.empty() ? a.arch : (a.preset.rfind("llama", 0) == 0 ? "llama" : "gpt");
  s.model.vocab_size = kVocab;
  if (a.seq > 0) s.model.max_seq_len = a.seq;
  s.model.validate();
  return s;
}

}  // namespace bench
