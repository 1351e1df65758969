// bmt-bench-train's two Runners (bench_runners.h): the bmt engine's and plain LibTorch's training step.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#ifdef BMT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "bench_runners.h"
#include "bench_env.h"
#include "bench_train_args.h"
#include "gpu_profile.h"
#include "memory_report.h"
#include "bmt/engine/block.h"
#include "bmt/core/error.h"
#include "bmt/engine/cuda_graph_step.h"
#include "bmt/nn/fp8_delayed_scale.h"
#include "bmt/runtime/distributed.h"
#include "bmt/runtime/stream_sync.h"
#include "bmt/runtime/init.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/adam_offload.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/params/parameter.h"
#include "bmt/pipeline/pipeline.h"
#include "models/language_model.h"
#include "models/presets.h"
#include "plain_gpt.h"

#ifndef BMT_SOURCE_DIR
#define BMT_SOURCE_DIR "."
#endif

namespace bench {

Runner make_bmt_runner(const Args& a, const Shape& shape) {
  bmt::InitOptions init;
  init.seed = a.seed;
  init.zero_level = a.zero;
  init.tp_size = a.tp;
  init.pipe_size = a.pp;
  init.num_micro_batches = a.micro_batches > 0 ? a.micro_batches : 2 * a.pp;
  init.quiet = true;
  bmt::init_distributed(init);
  const auto& cfg = bmt::config();
  // BMT_BENCH_DTYPE=bf16|fp32 overrides the default (bf16 on GPUs, fp32 on CPUs), e.g. to run the bf16 path on CPU.
  at::ScalarType dtype = examples::default_param_dtype();
  if (const char* d = std::getenv("BMT_BENCH_DTYPE")) dtype = std::string(d) == "bf16" ? at::kBFloat16 : at::kFloat;
  examples::ParallelOptions parallel(a.zero, a.checkpointing);
  parallel.fp8 = a.fp8;
  parallel.fp8_head = a.fp8_head;
  parallel.fp8_head_backward = a.fp8_head_backward;
  if (!a.fp8_recipe.empty()) bmt::nn::set_fp8_recipe(bmt::nn::fp8_recipe_from_name(a.fp8_recipe, "--fp8-recipe"));
  parallel.pipe_schedule = bmt::parse_pipe_schedule(a.pp_schedule);
  std::shared_ptr<examples::LanguageModel> model = examples::make_model(shape.model, parallel, dtype);
  at::manual_seed(a.seed);
  if (model->pipelined()) bmt::init_parameters_by_name(*model, a.seed);
  else bmt::init_parameters(*model);

  Runner r;
  r.device = cfg.device;
  r.world = cfg.world_size;
  r.data_parallel = cfg.tp_zero_size;
  r.rank = cfg.rank;
  r.pp = cfg.pipe_size;
  r.micro_batches = cfg.num_micro_batches;
  for (const auto& item : model->named_parameters()) {
    // A pipeline's last stage holds a tied copy of wte: counted on the first stage only.
    if (model->pipelined() && item.key() == "wte.weight" && !cfg.topology.is_first_stage()) continue;
    int64_t n = 1;  // the logical (unsplit) size: tensor-parallel pieces count as whole parameters
    for (int64_t d : bmt::meta_of(item.value()).logical_shape()) n *= d;
    r.num_params += n;
    if (item.key() != "wpe.weight") r.num_matmul_params += n;
  }
  if (model->pipelined()) {  // every stage's parameters
    at::Tensor n = at::tensor({r.num_params, r.num_matmul_params}, at::kLong).to(cfg.device);
    n = bmt::distributed::raw_all_reduce(n, bmt::core::ReduceOp::kSum, *cfg.pipe_comm).cpu();
    r.num_params = n[0].item<int64_t>();
    r.num_matmul_params = n[1].item<int64_t>();
  }
  r.precision = std::string(dtype == at::kBFloat16 ? "bf16" : "fp32") + " params, fp32 grads/master";

  // gpu_params: --offload-blocks keeps non-Block parameters on the GPU, --offload-gpu-blocks K also layers.0..K-1
  // (updated last in the backward, needed first in the next forward).
  std::vector<at::Tensor> params, gpu_params;
  for (const auto& item : model->named_parameters()) {
    const at::Tensor& p = item.value();
    const bool in_block = bmt::in_block(p);
    bool on_gpu = a.offload_blocks_only && !in_block;
    if (a.offload_gpu_blocks > 0 && in_block && item.key().rfind("layers.", 0) == 0)
      on_gpu = std::stoll(item.key().substr(7)) < a.offload_gpu_blocks;
    if (on_gpu) {
      gpu_params.push_back(p);
    } else {
      params.push_back(p);
    }
  }
  if (a.offload && r.device.is_cuda()) {
    // Host bytes the offloaded state needs: fp32 master (half params) + two fp32 moments + pinned staging of exact
    // size for the gradient (fp32, or bf16 with --offload-grad-bf16) and the parameter.
    int64_t need = 0;
    for (const auto& p : params) {
      const int64_t n = p.numel();
      need += n * (p.scalar_type() == at::kFloat ? 8 : 12);
      need += n * (a.offload_grad_bf16 ? 2 : 4) + n * static_cast<int64_t>(p.element_size());
    }
    const int64_t avail = proc_kib("/proc/meminfo", "MemAvailable:") * 1024;
    std::printf("offload: ~%.1f GiB of host memory needed, %.1f GiB available\n", gib(need), gib(avail));
    if (avail > 0 && need > avail - (6ll << 30) && !a.force)
      throw Failure("--offload needs ~" + json_num(gib(need), 3) + " GiB of host memory, only " +
                        json_num(gib(avail), 3) + " GiB available (--force to try anyway)",
                    3);
  }
  bmt::optim::AdamOptions opts(kLr, {kBeta1, kBeta2}, kEps, kWeightDecay);
  opts.decoupled_weight_decay(true);  // AdamW, as the plain-LibTorch rows
  std::shared_ptr<bmt::optim::BmtOptimizer> optimizer;
  std::shared_ptr<bmt::optim::AdamOffloadOptimizer> offload;
  if (a.offload) {
    offload = std::make_shared<bmt::optim::AdamOffloadOptimizer>(params, opts);
    if (a.offload_grad_bf16) offload->set_grad_transfer_dtype(at::kBFloat16);
    offload->set_async_step(a.offload_async);
    optimizer = offload;
    r.optimizer = std::string("AdamOffloadOptimizer") + (a.offload_grad_bf16 ? " (bf16 gradient transfer)" : "") +
                  (a.offload_async ? " (asynchronous step)" : "");
  } else {
    optimizer = std::make_shared<bmt::optim::AdamOptimizer>(params, opts);
    r.optimizer = "AdamOptimizer";
  }
  auto manager = std::make_shared<bmt::optim::OptimManager>();  // loss scaling off (bf16 / fp32)
  std::shared_ptr<bmt::optim::BmtOptimizer> gpu_optimizer;
  if (!gpu_params.empty()) {
    // Stepped first: its kernels are queued before step() blocks on the CPU updates, so they overlap them.
    gpu_optimizer = std::make_shared<bmt::optim::AdamOptimizer>(gpu_params, opts);
    manager->add_optimizer(gpu_optimizer);
    r.optimizer += a.offload_gpu_blocks > 0
                       ? " for layers." + std::to_string(a.offload_gpu_blocks) + "+ and AdamOptimizer for the rest"
                       : " for Blocks + AdamOptimizer for the rest";
  }
  manager->add_optimizer(optimizer);
  std::shared_ptr<bmt::optim::OffloadOverlap> overlap;
  if (offload && !a.no_overlap) {
    // Start each offloaded Block's CPU update as soon as its gradients are reduced, while the backward runs on.
    overlap = std::make_shared<bmt::optim::OffloadOverlap>(manager->overlap_offload_with_backward());
    r.early_started = [overlap] { return overlap->num_early_starts(); };
    r.optimizer += " (per-Block early start)";
  }
  if (a.step_in_backward) {
    // Each Block's Adam update is queued as soon as its gradients are reduced and its fp32 gradient shards are
    // freed: the whole model's gradients are never held at once.
    overlap = std::make_shared<bmt::optim::OffloadOverlap>(manager->overlap_step_with_backward(true));
    r.early_started = [overlap] { return overlap->num_early_starts(); };
    r.optimizer += " (per-Block step in backward, gradients released)";
  }
  r.skipped_steps = [manager] { return manager->num_skipped_steps(); };
  if (a.raw_step) r.optimizer += " (raw step)";
  else r.optimizer += " + OptimManager";

  const bool raw = a.raw_step;
  if (model->pipelined()) {
    auto pipe = std::dynamic_pointer_cast<bmt::PipelineTransformerBlockList>(model->named_children()["layers"]);
    BMT_CHECK(pipe != nullptr, "bench: a pipelined model without a PipelineTransformerBlockList named layers");
    pipe->set_measure_busy(true);
    auto busy_s = std::make_shared<double>(0), pipe_s = std::make_shared<double>(0);
    r.reset_bubble = [busy_s, pipe_s] { *busy_s = *pipe_s = 0; };
    r.bubble = [busy_s, pipe_s] {
      // The mean over ranks of 1 - busy / duration.
      const double mine = *pipe_s > 0 ? 1.0 - *busy_s / *pipe_s : 0.0;
      at::Tensor t = at::tensor({mine}, at::kDouble).to(bmt::config().device);
      return bmt::distributed::raw_all_reduce(t, bmt::core::ReduceOp::kAvg, *bmt::config().comm).item<double>();
    };
    r.step = [model, manager, pipe, busy_s, pipe_s](const at::Tensor& tokens) {
      const int64_t T = tokens.size(1) - 1;
      const bool cuda = bmt::config().device.is_cuda();
      if (cuda) torch::cuda::synchronize();
      const double t0 = now_s();
      at::Tensor loss = model->pipeline_step(tokens.narrow(1, 0, T), tokens.narrow(1, 1, T), *manager);
      if (cuda) torch::cuda::synchronize();
      *pipe_s += now_s() - t0;
      *busy_s += pipe->last_busy_seconds();
      manager->step();
      manager->zero_grad();
      return loss.detach();
    };
    r.finish = [] { bmt::finalize(); };
    return r;
  }
  std::shared_ptr<bmt::CudaGraphStep> graph;
  if (a.cuda_graphs) {
    // Forward + backward (with the Blocks' gathers and gradient reductions) captured once and replayed; the
    // optimizer step (its inf/NaN check reads the device on the host) and zero_grad (in place) stay eager.
    bmt::CudaGraphOptions go;
    go.verbose = true;
    graph = std::make_shared<bmt::CudaGraphStep>(
        [model, manager, raw](const std::vector<at::Tensor>& in) {
          const int64_t T = in[0].size(1) - 1;
          at::Tensor loss = model->loss(in[0].narrow(1, 0, T), in[0].narrow(1, 1, T));
          if (raw) {
            loss.backward();
            bmt::wait_for_gradient_reduction();
          } else {
            manager->backward(loss);
          }
          return std::vector<at::Tensor>{loss.detach()};
        },
        go);
    r.graph_status = [graph] {
      return graph->disabled_reason().empty()
                 ? "captures " + std::to_string(graph->num_captures()) + ", replays " +
                       std::to_string(graph->num_replays()) + ", eager " + std::to_string(graph->num_eager())
                 : "off (" + graph->disabled_reason() + "), eager " + std::to_string(graph->num_eager());
    };
    r.step = [graph, optimizer, manager, raw](const at::Tensor& tokens) {
      at::Tensor loss = (*graph)({tokens}, manager->loss_scale())[0];
      if (raw) {
        optimizer->step(1.0);
        optimizer->zero_grad();
      } else {
        manager->step();
        manager->zero_grad();
      }
      return loss;
    };
  } else r.step = [model, optimizer, manager, raw](const at::Tensor& tokens) {
    const int64_t T = tokens.size(1) - 1;
    // model->loss: the vocab-parallel fused cross-entropy under tensor parallelism (no full logits).
    at::Tensor loss = model->loss(tokens.narrow(1, 0, T), tokens.narrow(1, 1, T));
    sample_memory("after the forward");
    if (raw) {
      loss.backward();
      sample_memory("after the backward");
      optimizer->step(1.0);  // BmtOptimizer::step orders itself after the gradient reduction
      sample_memory("after the optimizer step");
      optimizer->zero_grad();
    } else {
      manager->backward(loss);
      sample_memory("after the backward");
      manager->step();
      sample_memory("after the optimizer step");
      manager->zero_grad();
    }
    return loss.detach();
  };
  r.finish = [overlap, graph] {
    if (overlap) overlap->remove();
    if (graph) graph->reset();  // the graph holds NCCL work: gone before the communicators
    bmt::finalize();
  };
  r.memory_categories = [model, optimizer, gpu_optimizer, dp = r.data_parallel](MemoryBreakdown& b) {
    bench::add_bmt_memory_categories(b, *model, {optimizer, gpu_optimizer}, dp);
  };
  return r;
}

Runner make_plain_runner(const Args& a, const Shape& shape) {
  if (shape.model.arch != "gpt") throw std::invalid_argument("--framework plain implements the gpt architecture only");
  if (a.offload) throw std::invalid_argument("--framework plain has no optimizer offload");
  bool cuda = torch::cuda::is_available();
  if (a.device == "cpu") cuda = false;
  if (a.device == "cuda" && !cuda) throw std::invalid_argument("--device cuda: no CUDA device available");
  Runner r;
  r.device = cuda ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  at::manual_seed(a.seed);

  plain::GptConfig c;
  c.vocab_size = shape.model.vocab_size;
  c.max_seq_len = shape.model.max_seq_len;
  c.num_layers = shape.model.num_layers;
  c.dim = shape.model.dim;
  c.num_heads = shape.model.num_heads;
  c.ffn_dim = shape.model.ffn_dim;
  c.norm_eps = shape.model.norm_eps;
  plain::Gpt model(c);
  model->to(r.device);
  model->checkpointing = a.checkpointing;
  r.num_params = model->num_params();
  r.num_matmul_params = model->num_matmul_params();
  const bool autocast = a.autocast == "on" || (a.autocast == "auto" && cuda);
  r.precision = autocast ? "fp32 params + bf16 autocast" : "fp32";

  auto optimizer = std::make_shared<plain::FusedAdamW>(model->parameters(), kLr, kBeta1, kBeta2, kEps, kWeightDecay,
                                                       a.plain_adamw == "fused");
  r.optimizer = a.plain_adamw == "fused" ? "at::_fused_adamw_" : "torch::optim::AdamW";
  const at::DeviceType dt = r.device.type();
  r.memory_categories = [m = model.ptr()](MemoryBreakdown& b) {
    b.add_category("parameters (fp32)", [m] {
      int64_t n = 0;
      for (const auto& p : m->parameters()) n += p.is_cuda() ? int64_t(p.nbytes()) : 0;
      return n;
    });
    b.add_category("gradients (fp32)", [m] {
      int64_t n = 0;
      for (const auto& p : m->parameters()) n += p.grad().defined() && p.grad().is_cuda() ? int64_t(p.grad().nbytes()) : 0;
      return n;
    });
  };
  r.step = [m = model.ptr(), optimizer, autocast, dt](const at::Tensor& tokens) {
    at::Tensor loss;
    {
      plain::AutocastScope scope(autocast, dt);
      loss = m->loss(tokens);
    }
    sample_memory("after the forward");
    loss.backward();
    sample_memory("after the backward");
    optimizer->step();
    sample_memory("after the optimizer step");
    optimizer->zero_grad();
    return loss.detach();
  };
  return r;
}

}  // namespace bench
