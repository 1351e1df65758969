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
// --profile: 2 more steps under the Kineto profiler after the timed ones (gpu_profile.h), printed and in the JSON
// (BMT_PROFILE_TOP kernels listed, default 12).
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
#include "bench_runners.h"
#include "bench_train_args.h"
#include "gpu_profile.h"
#include "memory_report.h"
#include "bmt/engine/block.h"
#include "bmt/core/error.h"
#include "bmt/engine/cuda_graph_step.h"
#include "bmt/runtime/distributed.h"
#include "bmt/nn/fp8_linear.h"
#include "bmt/nn/fused_linear.h"
#include "bmt/nn/fused_reductions.h"
#include "bmt/nn/tp_overlap.h"
#include "bmt/runtime/stream_sync.h"
#include "bmt/runtime/init.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/adam_offload.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/params/parameter.h"
#include "bmt/pipeline/pipeline.h"
#include "bmt/engine/recompute_keep.h"
#include "models/language_model.h"
#include "models/presets.h"
#include "plain_gpt.h"

#ifndef BMT_SOURCE_DIR
#define BMT_SOURCE_DIR "."
#endif

namespace {

using bench::Args;
using bench::Failure;
using bench::g_breakdown;
using bench::gib;
using bench::json_num;
using bench::json_str;
using bench::kPeakFlops;
using bench::make_bmt_runner;
using bench::make_plain_runner;
using bench::now_s;
using bench::proc_kib;
using bench::Runner;
using bench::sample_memory;
using bench::Shape;
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
  // BMT_FP8_GRAD: the gradients' FP8 format; BMT_FP8_SCALING=row: rowwise scales (every operand E4M3)
  const bool fp8_rows = bmt::nn::fp8_scaling() == bmt::nn::Fp8Scaling::kRow;
  const std::string fp8_grad =
      fp8_rows || bmt::nn::fp8_grad_format() == bmt::nn::Fp8Format::kE4M3 ? "e4m3" : "e5m2";
  if (a.fp8) config += fp8_rows ? std::string(" fp8-rowwise") : " fp8-" + fp8_grad;
  if (a.fp8_head) config += " fp8-head";
  if (a.fp8_head_backward) config += " fp8-head-backward";
  // the delayed scalings in effect (nn::fp8_recipe, or each switch's own variable)
  std::string fp8_delayed;
  for (const auto& [on, name] : {std::pair<bool, const char*>{bmt::nn::fp8_delayed_gelu_enabled(), "gelu"},
                                 {bmt::nn::fp8_delayed_inputs_enabled(), "inputs"},
                                 {bmt::nn::fp8_delayed_grads_enabled(), "grads"}})
    if (on) fp8_delayed += (fp8_delayed.empty() ? "" : ",") + std::string(name);
  if (a.fp8 && !fp8_delayed.empty()) config += " fp8-delayed-" + fp8_delayed;
  if (a.step_in_backward) config += " step-in-backward";
  if (a.cuda_graphs) config += " cuda-graphs";
  const bool our_reductions = a.framework == "bmt" && bmt::nn::fused_reductions_enabled();  // BMT_FUSED_REDUCTIONS
  if (a.framework == "bmt" && !our_reductions) config += " torch-reductions";
  const bool epilogues = a.framework == "bmt" && bmt::nn::gemm_epilogues_enabled();  // BMT_GEMM_EPILOGUES
  if (a.framework == "bmt" && !epilogues) config += " no-epilogues";
  const bmt::nn::GeluMlpBackward gelu_bwd = bmt::nn::gelu_mlp_backward();  // BMT_GELU_MLP_BACKWARD
  if (epilogues && gelu_bwd == bmt::nn::GeluMlpBackward::kDGeluBGrad) config += " dgelu-bgrad";
  if (epilogues && gelu_bwd == bmt::nn::GeluMlpBackward::kSeparate) config += " separate-gelu-backward";
  // BMT_KEEP_FOR_RECOMPUTE (checkpointed runs), BMT_GRADIENT_HANDOVER (one-rank --step-in-backward)
  const bool keep_attention = a.framework == "bmt" && a.checkpointing && bmt::detail::keep_for_recompute_enabled();
  if (a.framework == "bmt" && a.checkpointing && !keep_attention) config += " recompute-all";
  const bool handover = a.framework == "bmt" && a.step_in_backward && bmt::detail::gradient_handover_enabled();
  if (a.framework == "bmt" && a.step_in_backward && !handover) config += " no-handover";
  const int64_t tp_overlap = a.framework == "bmt" && a.tp > 1 ? bmt::tp::overlap_chunks() : 0;  // BMT_TP_OVERLAP_CHUNKS
  if (tp_overlap > 0) config += " tp-overlap" + std::to_string(tp_overlap);
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
    // (BMT_PROFILE_TOP: how many kernels the summary lists, 12 by default)
    const char* top_env = std::getenv("BMT_PROFILE_TOP");
    bench::GpuProfileSummary summary = profiler.stop(top_env ? std::atoi(top_env) : 12);
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
      << ",\"checkpointing\":" << (a.checkpointing ? "true" : "false") << ",\"fp8\":" << (a.fp8 ? "true" : "false")
      << ",\"fp8_grad\":" << (a.fp8 ? json_str(fp8_grad) : "null")
      << ",\"fp8_scaling\":" << (a.fp8 ? json_str(fp8_rows ? "row" : "tensor") : "null")
      << ",\"fp8_head\":" << (a.fp8_head ? "true" : "false")
      << ",\"fp8_head_backward\":" << (a.fp8_head_backward ? "true" : "false")
      << ",\"fp8_delayed\":" << (a.fp8 ? json_str(fp8_delayed) : "null")
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
      << ",\"fused_reductions\":" << (our_reductions ? "true" : "false")
      << ",\"gemm_epilogues\":" << (epilogues ? "true" : "false") << ",\"tp_overlap_chunks\":" << tp_overlap
      << ",\"keep_for_recompute\":" << (keep_attention ? "true" : "false")
      << ",\"gradient_handover\":" << (handover ? "true" : "false")
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
