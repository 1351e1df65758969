#include "train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>

#include "bmt/core/error.h"
#include "bmt/distributed.h"
#include "bmt/memory_stats.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/parameter.h"
#include "data/dataset.h"
#include "export/hf_gpt2.h"
#include "models/presets.h"
#include "train/checkpoint.h"
#include "train/evaluate.h"
#include "train/generate.h"
#include "train/metrics_log.h"
#include "train/progress.h"

namespace examples {

namespace {

constexpr double kPeakFlopsPerGpu = 989e12;  // H100/H200 dense bf16

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int64_t memory_nbytes() {
  if (bmt::config().device.is_cuda()) return bmt::memory_stats().device_peak_nbytes;
  long pages = 0, resident = 0;
  std::ifstream("/proc/self/statm") >> pages >> resident;
  return static_cast<int64_t>(resident) * ::sysconf(_SC_PAGESIZE);
}

// AdamW with weight decay on matrices (embeddings included) and none on biases and norm weights.
std::shared_ptr<bmt::optim::AdamOptimizer> make_optimizer(LanguageModel& model, double lr, double weight_decay) {
  std::vector<at::Tensor> decay, no_decay;
  for (const auto& p : model.parameters()) (bmt::meta_of(p).full_shape.size() >= 2 ? decay : no_decay).push_back(p);
  bmt::optim::AdamOptions defaults(lr, {0.9, 0.95}, 1e-8, weight_decay);
  std::vector<bmt::optim::ParamGroupSpec> groups = {{decay, {{"weight_decay", weight_decay}}},
                                                    {no_decay, {{"weight_decay", 0.0}}}};
  return std::make_shared<bmt::optim::AdamOptimizer>(groups, defaults);
}

std::string percent(std::optional<double> v) {
  if (!v) return "n/a";
  char buf[16];
  std::snprintf(buf, sizeof buf, "%.1f%%", 100.0 * *v);
  return buf;
}

}  // namespace

TrainResult run_training(const TrainArgs& args) {
  const auto& cfg = bmt::config();
  const bool rank0 = cfg.rank == 0;
  const double t_begin = now_s();

  BMT_CHECK(args.tp == cfg.tp_size, "train: --tp ", args.tp, " but bmtrain was initialised with tp_size ", cfg.tp_size);
  // Data parallelism is over the tp groups: every rank of a tp group gets the same batch (tp_zero_rank).
  const int dp = cfg.tp_zero_size, dp_rank = cfg.tp_zero_rank;
  auto data = make_dataset({args.data, args.data_format, args.seed});
  const Preset& preset = find_preset(args.preset);
  ModelConfig mc = preset.model;
  mc.arch = args.model;
  mc.vocab_size = data->vocab_size();
  if (mc.vocab_size % cfg.tp_size != 0) {  // vocabulary-parallel layers need a multiple of tp (never sampled)
    mc.vocab_size = (mc.vocab_size + cfg.tp_size - 1) / cfg.tp_size * cfg.tp_size;
    if (rank0)
      std::printf("vocabulary padded from %ld to %ld ids for --tp %d\n", static_cast<long>(data->vocab_size()),
                  static_cast<long>(mc.vocab_size), cfg.tp_size);
  }
  mc.num_kv_heads = args.kv_heads;
  if (args.seq > 0) mc.max_seq_len = args.seq;
  const int64_t seq = mc.max_seq_len;
  const int64_t steps = args.steps >= 0 ? args.steps : preset.train.steps;
  const int64_t stop = args.stop_at >= 0 ? std::min(args.stop_at, steps) : steps;  // last step of this run
  const int64_t batch = args.batch > 0                ? args.batch
                        : preset.train.global_batch > 0 ? std::max<int64_t>(1, preset.train.global_batch / dp)
                                                        : preset.train.batch_per_rank;
  const double lr = args.lr > 0 ? args.lr : preset.train.lr;
  const int64_t warmup = std::min(steps, args.warmup >= 0 ? args.warmup : preset.train.warmup_steps);
  const int64_t eval_every = args.eval_every > 0 ? args.eval_every : preset.train.eval_every_steps;
  const int64_t task_rows = (args.task_rows + dp - 1) / dp * dp;

  const at::ScalarType dtype = args.dtype == "fp32" ? at::kFloat : args.dtype == "bf16" ? at::kBFloat16 : default_param_dtype();
  auto model = make_model(mc, {args.zero, args.checkpointing}, dtype);
  at::manual_seed(args.seed);
  bmt::init_parameters(*model);
  auto optimizer = make_optimizer(*model, lr, args.weight_decay);
  auto scheduler = std::make_shared<bmt::optim::lr_scheduler::Cosine>(optimizer, lr, warmup, std::max<int64_t>(steps, 1));
  // No loss scaling (fp32 on CPU, bf16 on GPU). Gradients are summed over the data-parallel group only (tp ranks
  // share a batch): grad_scale = its size makes them the mean (the default, zero_size, counts tp ranks too).
  bmt::optim::OptimManagerOptions optim_options;
  optim_options.grad_scale = dp;
  bmt::optim::OptimManager optim(optim_options);
  optim.add_optimizer(optimizer, scheduler);

  const double flops_per_token = model->train_flops_per_token(seq);
  if (rank0) {
    std::string ranks = std::to_string(cfg.world_size) + " rank(s)";
    if (cfg.tp_size > 1)
      ranks += " = dp " + std::to_string(dp) + " x tp " + std::to_string(cfg.tp_size) +
               (cfg.sequence_parallel ? " (sequence parallel)" : "");
    std::printf("model: %s, %.2fM parameters, %s, ZeRO-%d%s, %s on %s\ndata: %s\n", mc.describe().c_str(),
                static_cast<double>(model->num_params()) / 1e6, c10::toString(dtype), args.zero,
                args.checkpointing ? " + checkpointing" : "", ranks.c_str(), cfg.device.str().c_str(),
                data->describe().c_str());
    std::printf("train: %ld steps x %ld seqs/%s x %ld tokens, lr %.2e (warm-up %ld, cosine), AdamW wd %.2g, clip %.2g\n",
                static_cast<long>(steps), static_cast<long>(batch), cfg.tp_size > 1 ? "dp rank" : "rank",
                static_cast<long>(seq), lr,
                static_cast<long>(warmup), args.weight_decay, args.grad_clip);
    std::fflush(stdout);
  }

  TrainResult result;
  if (args.resume) {
    if (auto info = load_checkpoint(args.save_dir, *model, optim)) {
      result.start_step = info->step;
      if (rank0)
        std::printf("resumed from %s at step %ld%s\n", info->dir.c_str(), static_cast<long>(info->step),
                    info->optimizer_restored ? "" : " (world or tp size changed: optimizer state restarted)");
    } else if (rank0) {
      std::printf("no checkpoint in %s: starting from scratch\n", args.save_dir.c_str());
    }
  }
  MetricsLog metrics;
  if (rank0 && !args.metrics_path.empty()) metrics = MetricsLog(args.metrics_path, args.resume && result.start_step > 0);
  Progress progress(steps, rank0 ? args.progress : "off", args.log_every);

  auto evaluate = [&](int64_t step, MetricFields& fields) {
    const double el = eval_loss(*model, *data, args.eval_batches, batch, seq);
    const std::optional<double> acc = task_accuracy(*model, *data, task_rows);
    if (!result.first_eval_loss) result.first_eval_loss = el, result.first_task_acc = acc;
    result.last_eval_loss = el;
    result.last_task_acc = acc;
    char buf[160];
    std::snprintf(buf, sizeof buf, "eval @ step %ld: held-out loss %.4f%s%s", static_cast<long>(step), el,
                  acc ? ", task accuracy " : "", acc ? percent(acc).c_str() : "");
    progress.message(buf);
    fields.emplace_back("eval_loss", el);
    fields.emplace_back("task_acc", acc);
  };
  if (steps == 0 || result.start_step == 0) {
    MetricFields fields = {{"step", 0.0}, {"loss", std::nullopt}};
    evaluate(result.start_step, fields);
    metrics.write(fields);
  }

  std::vector<double> losses;
  const double t_loop = now_s();
  double tokens_done = 0;
  for (int64_t step = result.start_step; step < stop; ++step) {
    const double t0 = now_s();
    at::Tensor tokens = data->train_batch(step, dp_rank, batch, seq).to(cfg.device);
    at::Tensor loss = model->loss(tokens.narrow(1, 0, seq), tokens.narrow(1, 1, seq));
    optim.backward(loss);
    const double grad_norm = args.grad_clip > 0 ? optim.clip_grad_norm(args.grad_clip) : 0.0;
    const double step_lr = scheduler->current_lr();
    optim.step();
    optim.zero_grad();
    const double mean_loss = bmt::sum_loss(loss.detach().to(at::kFloat)).item<double>();
    const double dt = now_s() - t0;
    if (losses.empty()) result.first_loss = mean_loss;
    losses.push_back(mean_loss);
    const double step_tokens = static_cast<double>(batch * seq * dp);
    tokens_done += step_tokens;

    StepStats st;
    st.step = step + 1;
    st.loss = mean_loss;
    st.lr = step_lr;
    st.tokens_per_s = step_tokens / dt;
    if (cfg.device.is_cuda()) st.mfu = flops_per_token * st.tokens_per_s / (kPeakFlopsPerGpu * cfg.world_size);
    st.mem_nbytes = memory_nbytes();
    st.eta_s = (now_s() - t_loop) / static_cast<double>(step + 1 - result.start_step) * static_cast<double>(stop - step - 1);
    progress.update(st);

    MetricFields fields = {{"step", static_cast<double>(step + 1)}, {"loss", mean_loss}, {"lr", step_lr},
                           {"grad_norm", grad_norm}, {"tokens_per_s", st.tokens_per_s}, {"step_ms", 1e3 * dt},
                           {"mfu", st.mfu >= 0 ? std::optional<double>(st.mfu) : std::nullopt},
                           {"mem_mib", static_cast<double>(st.mem_nbytes >> 20)}, {"elapsed_s", now_s() - t_begin}};
    if ((step + 1) % eval_every == 0 || step + 1 == stop) evaluate(step + 1, fields);
    else fields.insert(fields.end(), {{"eval_loss", std::nullopt}, {"task_acc", std::nullopt}});
    metrics.write(fields);
    if (args.save_every > 0 && ((step + 1) % args.save_every == 0 || step + 1 == stop)) {
      const std::string dir = save_checkpoint(args.save_dir, step + 1, *model, optim);
      progress.message("checkpoint: " + dir);
    }
  }
  progress.finish();
  result.end_step = std::max(stop, result.start_step);
  const size_t tail = std::min<size_t>(20, losses.size());
  for (size_t i = losses.size() - tail; i < losses.size(); ++i) result.last_loss += losses[i] / static_cast<double>(tail);
  result.mean_tokens_per_s = tokens_done / std::max(1e-9, now_s() - t_loop);

  GenerateOptions gen;
  gen.max_new_tokens = args.sample_tokens;
  gen.top_k = args.top_k;
  gen.stop_token = data->stop_token();
  gen.seed = args.seed;
  gen.vocab_size = data->vocab_size();  // never the ids padded for tp
  std::vector<std::string> prompts = data->sample_prompts();
  for (int64_t i = 0; i < args.samples && i < static_cast<int64_t>(prompts.size()); ++i) {
    const std::string& prompt = prompts[static_cast<size_t>(i)];
    std::string completion = data->decode(generate(*model, data->encode(prompt), gen));
    result.samples.push_back(prompt + "|" + completion);
    if (rank0) std::printf("sample: %s|%s %s\n", prompt.c_str(), completion.c_str(), data->annotate(prompt, completion).c_str());
  }
  if (!args.export_hf.empty()) {
    export_hf_gpt2(*model, args.export_hf);
    if (rank0) std::printf("exported Hugging Face GPT-2 model to %s\n", args.export_hf.c_str());
  }
  result.wall_s = now_s() - t_begin;
  if (rank0) {
    std::printf("done: steps %ld-%ld in %s (%.0f tokens/s); train loss %.4f -> %.4f", static_cast<long>(result.start_step),
                static_cast<long>(result.end_step), format_duration(result.wall_s).c_str(), result.mean_tokens_per_s,
                result.first_loss, result.last_loss);
    if (result.first_eval_loss)
      std::printf("; held-out loss %.4f -> %.4f", *result.first_eval_loss, *result.last_eval_loss);
    if (result.first_task_acc)
      std::printf("; task accuracy %s -> %s", percent(result.first_task_acc).c_str(), percent(result.last_task_acc).c_str());
    std::printf("\n");
    std::fflush(stdout);
  }
  return result;
}

}  // namespace examples
