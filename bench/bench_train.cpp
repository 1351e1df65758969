// bmt-bench-train: training throughput of one GPT configuration, bmtrain against plain LibTorch, one process.
//
//   bmt-bench-train --framework bmt|plain --preset gpt2-124m|gpt-1.3b|gpt-6.7b|llama-7b|tiny --seq T --batch B
//                   --steps N --warmup W [--checkpointing] [--offload] [--zero 2|3] [--json PATH]
//
// framework bmt:   examples/models (GPT-2, or Llama for llama-7b) with every layer a ZeRO Block inside a
//                  TransformerBlockList, bf16 parameters on GPUs (fp32 on CPUs), AdamOptimizer (or, with
//                  --offload, AdamOffloadOptimizer) driven by an OptimManager without loss scaling (its global
//                  inf/NaN check included, as in a real training loop; --raw-step calls the optimizer directly).
//                  With --offload, OptimManager::overlap_offload_with_backward starts each Block's CPU update
//                  during the backward (after checking its gradients for inf/NaN); --no-overlap leaves every
//                  update to the step after it.
// framework plain: bench/plain_gpt.h, the same GPT in plain LibTorch: fp32 parameters + bf16 autocast on CUDA,
//                  fused AdamW (at::_fused_adamw_); --checkpointing recomputes every block.
// Both: AdamW lr 3e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on every parameter; vocabulary 50304; random
// tokens (a few batches generated on the device before timing, cycled). W warm-up steps, then N timed steps, each
// followed by a device synchronisation and timed with a steady clock.
//
// --offload-blocks: --offload for the parameters inside Blocks only; the embeddings and the final norm (whose
// gradients are complete only at the end of the backward) keep a GPU AdamOptimizer in the same OptimManager.
// --offload-gpu-blocks K: the same, and layers.0 .. K-1 too (their updates are the ones that cannot overlap).
// --offload-grad-bf16 / --offload-async: AdamOffloadOptimizer::set_grad_transfer_dtype(bf16) / set_async_step.
// --cuda-graphs (bmt; not with --offload, --step-in-backward, --pp): forward + backward, the Blocks' gathers and
// gradient reductions included, captured once as a CUDA graph (bmt::CudaGraphStep, after 2 eager warm-up calls)
// and replayed; the optimizer step stays eager. The JSON row says how many steps replayed ("cuda_graphs_status").
// --profile: 2 more steps under the Kineto profiler after the timed ones (gpu_profile.h), printed and in the JSON.
// The command line is parsed in bench_train_args.cpp.
// --memory-snapshot PATH / --memory-breakdown: what holds the GPU memory peak (bench/memory_report.h): the
// allocator's pickled history for https://pytorch.org/memory_viz, and a per-category table at the largest sample.
// --tp N (bmt, under bmtrun): tensor parallelism over N ranks (examples' sequence-parallel layout, vocab-parallel
// loss); the N ranks of a tp group share one batch, so tokens per step = B·T·(world / N).
// --pp N --micro-batches M [--pp-schedule gpipe] (bmt, gpt or llama, under bmtrun): the layers split over N pipeline stages
// (world = pp x dp x tp), each step 1F1B over M micro-batches of B/M sequences; tokens per step = B·T·dp. Also
// reported: bubble = 1 - (the stage's compute time, CUDA events around its forwards and backwards) / (the
// pipeline part of the step, forward_backward to a device sync), the mean over ranks, next to (p-1)/(m+p-1).
// Reported: tokens/s = N·B·T / (sum of the timed step times); step_s = mean timed step; MFU = tokens/s ·
// FLOPs/token / 989e12 (H100/H200 dense bf16 peak; null on CPU) with FLOPs/token = 6·N_matmul + 6·L·d·T, where
// N_matmul counts every parameter except the learned position table and 6·L·d·T is the causal attention term
// (12·L·d·T halved by the mask), the convention behind peers.md's MFU figures; peak_gpu_gib = the CUDA caching
// allocator's peak allocated bytes over the whole run (warm-up included) / 2^30.
// --json PATH appends one JSON line: bench, config, framework, world, tokens_per_s, mfu, peak_gpu_gib, step_s,
// git_commit (env BMT_GIT_COMMIT, else git), machine (env BMT_BENCH_MACHINE, else the host name), date (UTC),
// plus details (preset, seq, batch, params, flops_per_token, losses, ...).
// Exit codes: 0 ok, 1 error (e.g. out of memory), 2 bad arguments, 3 not enough host memory for --offload.
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

#include "bench_env.h"
#include "bench_train_args.h"
#include "gpu_profile.h"
#include "memory_report.h"
#include "bmt/block.h"
#include "bmt/core/error.h"
#include "bmt/cuda_graph_step.h"
#include "bmt/distributed.h"
#include "bmt/stream_sync.h"
#include "bmt/init.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/adam_offload.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/parameter.h"
#include "bmt/pipeline.h"
#include "models/language_model.h"
#include "models/presets.h"
#include "plain_gpt.h"

#ifndef BMT_SOURCE_DIR
#define BMT_SOURCE_DIR "."
#endif

namespace {

using bench::Args;
using bench::Shape;

constexpr double kPeakFlops = 989e12;  // H100/H200 SXM dense bf16
constexpr double kLr = 3e-4, kBeta1 = 0.9, kBeta2 = 0.95, kEps = 1e-8, kWeightDecay = 0.1;

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

using bench::json_num;
using bench::json_str;
using bench::utc_now;

// Peak allocated / reserved bytes of the CUDA caching allocator on `device` (-1 when not on CUDA).
struct GpuMem {
  int64_t peak_allocated = -1, peak_reserved = -1;
};
GpuMem gpu_memory(const c10::Device& device) {
  GpuMem m;
#ifdef BMT_WITH_CUDA
  if (device.is_cuda()) {
    const auto st = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    m.peak_allocated = st.allocated_bytes[agg].peak;
    m.peak_reserved = st.reserved_bytes[agg].peak;
  }
#else
  (void)device;
#endif
  return m;
}

int64_t proc_kib(const char* file, const char* key) {
  std::ifstream in(file);
  std::string k;
  int64_t v = -1;
  while (in >> k) {
    if (k == key) {
      in >> v;
      return v;
    }
    in.ignore(1 << 16, '\n');
  }
  return -1;
}

double gib(double bytes) { return bytes / double(1ll << 30); }

// One benchmark: how to run a step, and what to report about the model.
struct Runner {
  int data_parallel = 1;  // ranks with distinct batches (world / (tp * pp))
  int pp = 1, micro_batches = 1;
  std::function<double()> bubble = [] { return NAN; };  // measured over the timed steps (pipeline only)
  std::function<void()> reset_bubble = [] {};
  std::function<at::Tensor(const at::Tensor& tokens)> step;  // one optimizer step; returns the detached loss
  c10::Device device{c10::kCPU};
  int64_t num_params = 0, num_matmul_params = 0;
  std::string precision, optimizer;
  int world = 1, rank = 0;  // bmt under a launcher: every rank runs B sequences per step
  std::function<int64_t()> early_started = [] { return int64_t{0}; };  // Blocks updated during the backward
  std::function<int64_t()> skipped_steps = [] { return int64_t{0}; };  // OptimManager's inf/NaN skips
  std::function<void()> finish = [] {};
  std::function<std::string()> graph_status = [] { return std::string("off"); };  // --cuda-graphs
  // --memory-breakdown: registers the categories this framework can name (bytes on the device now).
  std::function<void(bench::MemoryBreakdown&)> memory_categories = [](bench::MemoryBreakdown&) {};
};

// Set while --memory-breakdown samples: the steps call it at their fixed points.
bench::MemoryBreakdown* g_breakdown = nullptr;
void sample_memory(const char* where) {
  if (g_breakdown) g_breakdown->sample(where);
}


struct Failure : std::runtime_error {
  int code;
  Failure(const std::string& what, int c) : std::runtime_error(what), code(c) {}
};

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
  r.memory_categories = [model, optimizer, gpu_optimizer, dp = r.data_parallel](bench::MemoryBreakdown& b) {
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
  r.memory_categories = [m = model.ptr()](bench::MemoryBreakdown& b) {
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

int run(const Args& a) {
  const Shape shape = resolve_shape(a);
  const int64_t T = shape.model.max_seq_len;
  const int64_t B = a.batch > 0 ? a.batch : shape.default_batch;
  const double t_start = now_s();

  // The history starts before the model exists, so the snapshot sees every allocation.
  const bool recording = !a.memory_snapshot.empty() && bench::start_memory_history();
  Runner r = a.framework == "bmt" ? make_bmt_runner(a, shape) : make_plain_runner(a, shape);
  const bool cuda = r.device.is_cuda();
  std::unique_ptr<bench::MemoryBreakdown> breakdown;
  int grad_hook = -1;
  if (a.memory_breakdown) {
    breakdown = std::make_unique<bench::MemoryBreakdown>(cuda && r.device.index() >= 0 ? r.device.index() : 0);
    r.memory_categories(*breakdown);
    g_breakdown = breakdown.get();
    if (a.framework == "bmt")
      grad_hook = bmt::add_grad_ready_hook([](bmt::Block&) { sample_memory("after a Block's gradients were reduced"); });
  }
  const double flops_per_token = 6.0 * static_cast<double>(r.num_matmul_params) +
                                 6.0 * static_cast<double>(shape.model.num_layers * shape.model.dim * T);
  std::string config = a.preset + " seq" + std::to_string(T) + " batch" + std::to_string(B);
  if (a.framework == "bmt" && a.zero != 3) config += " zero" + std::to_string(a.zero);
  if (a.tp > 1) config += " tp" + std::to_string(a.tp);
  if (r.pp > 1) config += " pp" + std::to_string(r.pp) + " m" + std::to_string(r.micro_batches) +
                          (a.pp_schedule == "gpipe" ? " gpipe" : "");
  if (a.checkpointing) config += " ckpt";
  if (a.step_in_backward) config += " step-in-backward";
  if (a.cuda_graphs) config += " cuda-graphs";
  if (a.offload) {
    if (a.offload_gpu_blocks > 0) config += " offload-gpu-blocks" + std::to_string(a.offload_gpu_blocks);
    else config += a.offload_blocks_only ? " offload-blocks" : " offload";
    if (a.offload_grad_bf16) config += " grad-bf16";
    if (a.offload_async) config += " async";
  }
  std::printf("bench_train: %s | %s | %s on %s | %.1fM params (%.1fM matmul), %.3g GFLOP/token | %s | %s\n",
              a.framework.c_str(), config.c_str(), shape.model.describe().c_str(), r.device.str().c_str(),
              static_cast<double>(r.num_params) / 1e6, static_cast<double>(r.num_matmul_params) / 1e6,
              flops_per_token / 1e9, r.precision.c_str(), r.optimizer.c_str());
  std::fflush(stdout);

  // Random tokens, generated on the device before timing and cycled.
  at::manual_seed(a.seed + 1);
  std::vector<at::Tensor> batches;
  const int64_t distinct = std::min<int64_t>(4, a.warmup + a.steps);
  for (int64_t i = 0; i < distinct; ++i)
    batches.push_back(at::randint(shape.model.vocab_size, {B, T + 1}, at::TensorOptions().dtype(at::kLong).device(r.device)));
  auto sync = [&] {
    if (cuda) torch::cuda::synchronize();
  };
  sync();
  const double t_setup = now_s() - t_start;

  std::vector<at::Tensor> losses;
  const double t_warm0 = now_s();
  for (int64_t i = 0; i < a.warmup; ++i) {
    losses.push_back(r.step(batches[static_cast<size_t>(i % distinct)]));
    sync();
  }
  const double t_warmup = now_s() - t_warm0;
  std::vector<double> times;
  r.reset_bubble();
  for (int64_t i = 0; i < a.steps; ++i) {
    const double t0 = now_s();
    losses.push_back(r.step(batches[static_cast<size_t>((a.warmup + i) % distinct)]));
    sync();
    times.push_back(now_s() - t0);
  }
  const int64_t early_started = r.early_started();  // before the profiled steps add theirs
  if (breakdown) {
    std::printf("%s", breakdown->report().c_str());
    g_breakdown = nullptr;
    if (grad_hook >= 0) bmt::remove_grad_ready_hook(grad_hook);
  }
  if (recording) bench::write_memory_snapshot(a.memory_snapshot);
  const double bubble = r.bubble();
  const double bubble_theory = static_cast<double>(r.pp - 1) / static_cast<double>(r.micro_batches + r.pp - 1);
  std::string profile_json = "null";
  if (a.profile) {
    // After the timed steps, so the profiler's overhead never touches the figures above.
    bench::GpuProfile profiler;
    profiler.start();
    for (int64_t i = 0; i < 2; ++i) r.step(batches[static_cast<size_t>((a.warmup + a.steps + i) % distinct)]);
    bench::GpuProfileSummary summary = profiler.stop();
    std::printf("profile of 2 steps:\n%s", summary.table().c_str());
    profile_json = summary.json();
  }
  double total = 0;
  for (double t : times) total += t;
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  const double step_s = total / static_cast<double>(times.size());
  const double median_s = sorted[sorted.size() / 2];
  // Tensor-parallel ranks share a batch: tokens per step = B * T * data-parallel ranks.
  const double tokens_per_s = static_cast<double>(B * T * r.data_parallel) * static_cast<double>(a.steps) / total;
  const double mfu = cuda ? tokens_per_s * flops_per_token / (kPeakFlops * r.world) : NAN;
  const GpuMem mem = gpu_memory(r.device);
  const double peak_gib = mem.peak_allocated >= 0 ? gib(static_cast<double>(mem.peak_allocated)) : NAN;
  const double host_peak_gib = gib(static_cast<double>(proc_kib("/proc/self/status", "VmHWM:")) * 1024.0);
  const double loss_first = losses.front().item<double>(), loss_last = losses.back().item<double>();
  if (!std::isfinite(loss_last)) throw std::runtime_error("loss is not finite: " + json_num(loss_last));

  std::printf("bench_train: setup %.1f s, warm-up %ld steps %.1f s; loss %.4f -> %.4f", t_setup,
              static_cast<long>(a.warmup), t_warmup, loss_first, loss_last);
  const double early_per_step = static_cast<double>(early_started) / static_cast<double>(a.warmup + a.steps);
  if (a.offload) std::printf("; %.1f Blocks per step updated during the backward", early_per_step);
  if (r.pp > 1)
    std::printf("; pipeline bubble %.1f%% measured (mean over ranks), %.1f%% = (p-1)/(m+p-1) theoretical",
                100.0 * bubble, 100.0 * bubble_theory);
  std::printf("\nlosses:");
  for (const at::Tensor& l : losses) std::printf(" %.4f", l.item<double>());
  // A skipped step (inf/NaN gradient) leaves the parameters as they were: say so next to the losses.
  std::printf("\nskipped steps (inf/NaN gradients): %ld\n", static_cast<long>(r.skipped_steps()));
  const std::string graph_status = r.graph_status();
  if (a.cuda_graphs) std::printf("cuda graphs: %s\n", graph_status.c_str());
  std::printf("RESULT framework=%s config=\"%s\" tokens_per_s=%.0f step_s=%.4f (median %.4f, min %.4f, max %.4f) "
              "mfu=%s peak_gpu_gib=%s (reserved %s) host_peak_gib=%.2f\n",
              a.framework.c_str(), config.c_str(), tokens_per_s, step_s, median_s, sorted.front(), sorted.back(),
              cuda ? (json_num(100.0 * mfu, 4) + "%").c_str() : "n/a",
              mem.peak_allocated >= 0 ? json_num(peak_gib, 4).c_str() : "n/a",
              mem.peak_reserved >= 0 ? json_num(gib(static_cast<double>(mem.peak_reserved)), 4).c_str() : "n/a",
              host_peak_gib);
  std::fflush(stdout);

  if (!a.json_path.empty() && r.rank == 0) {
    std::ostringstream j;
    j << "{\"bench\":\"train\",\"config\":" << json_str(config) << ",\"framework\":"
      << json_str(a.framework == "bmt" ? "bmtrain" : "plain") << ",\"world\":" << r.world << ",\"tp\":" << a.tp
      << ",\"tokens_per_s\":" << json_num(tokens_per_s, 8) << ",\"mfu\":" << json_num(mfu, 5)
      << ",\"peak_gpu_gib\":" << json_num(peak_gib, 5) << ",\"step_s\":" << json_num(step_s, 6)
      << ",\"git_commit\":" << json_str(bench::git_commit()) << ",\"machine\":" << json_str(bench::machine_name())
      << ",\"date\":" << json_str(utc_now()) << ",\"preset\":" << json_str(a.preset)
      << ",\"arch\":" << json_str(shape.model.arch) << ",\"seq\":" << T << ",\"batch\":" << B
      << ",\"steps\":" << a.steps << ",\"warmup\":" << a.warmup
      << ",\"checkpointing\":" << (a.checkpointing ? "true" : "false")
      << ",\"offload\":" << (a.offload ? "true" : "false") << ",\"zero\":" << (a.framework == "bmt" ? std::to_string(a.zero) : "null")
      << ",\"device\":" << json_str(r.device.str()) << ",\"params\":" << r.num_params
      << ",\"matmul_params\":" << r.num_matmul_params << ",\"flops_per_token\":" << json_num(flops_per_token, 8)
      << ",\"step_s_median\":" << json_num(median_s) << ",\"peak_reserved_gib\":"
      << json_num(mem.peak_reserved >= 0 ? gib(static_cast<double>(mem.peak_reserved)) : NAN, 5)
      << ",\"host_peak_gib\":" << json_num(host_peak_gib, 4) << ",\"loss_first\":" << json_num(loss_first)
      << ",\"loss_last\":" << json_num(loss_last) << ",\"precision\":" << json_str(r.precision)
      << ",\"optimizer\":" << json_str(r.optimizer) << ",\"offload_early_blocks_per_step\":" << json_num(early_per_step)
      << ",\"profile\":" << profile_json << ",\"offload_gpu_blocks\":" << a.offload_gpu_blocks << ",\"offload_grad_bf16\":" << (a.offload_grad_bf16 ? "true" : "false")
      << ",\"offload_async\":" << (a.offload_async ? "true" : "false")
      << ",\"step_in_backward\":" << (a.step_in_backward ? "true" : "false")
      << ",\"cuda_graphs\":" << (a.cuda_graphs ? "true" : "false") << ",\"cuda_graphs_status\":" << json_str(graph_status)
      << ",\"pp\":" << r.pp
      << ",\"micro_batches\":" << r.micro_batches << ",\"pp_schedule\":" << json_str(a.pp_schedule)
      << ",\"bubble\":" << json_num(r.pp > 1 ? bubble : NAN, 4)
      << ",\"bubble_theory\":" << json_num(r.pp > 1 ? bubble_theory : NAN, 4)
      << "}";
    std::ofstream out(a.json_path, std::ios::app);
    if (!out) throw std::runtime_error("cannot open --json file " + a.json_path);
    out << j.str() << "\n";
    std::printf("bench_train: appended to %s\n", a.json_path.c_str());
  }
  std::fflush(stdout);
  r.finish();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = bench::parse_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bmt-bench-train: %s\n%s", e.what(), bench::usage());
    return 2;
  }
  try {
    return run(args);
  } catch (const Failure& e) {
    std::fprintf(stderr, "bmt-bench-train: %s\n", e.what());
    return e.code;
  } catch (const c10::OutOfMemoryError& e) {
    std::fprintf(stderr, "bmt-bench-train: error: CUDA out of memory: %s\n",
                 std::string(e.what_without_backtrace()).substr(0, 400).c_str());
    return 1;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "bmt-bench-train: error: %s\n", std::string(e.what_without_backtrace()).substr(0, 2000).c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bmt-bench-train: error: %s\n", e.what());
    return 1;
  }
}
